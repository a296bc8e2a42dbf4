# FindCUDNNFrontend: the header-only cuDNN frontend (cudnn_frontend.h).
# Provides CUDNN::frontend and CUDNNFrontend_INCLUDE_DIR. Looked for, in order: the cache variable
# REPLAY_CUDNN_FRONTEND_INCLUDE_DIR, the staged bundle .deps/cudnn-frontend/include (scripts/setup.sh
# --bundle), and the include folder of the nvidia-cudnn-frontend Python package.
include(FindPackageHandleStandardArgs)

set(_fe_hints "${REPLAY_CUDNN_FRONTEND_INCLUDE_DIR}" "${PROJECT_SOURCE_DIR}/.deps/cudnn-frontend/include")
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
      "import importlib.metadata as m, pathlib\nfor f in m.files('nvidia-cudnn-frontend') or []:\n    if str(f).endswith('include/cudnn_frontend.h'):\n        print(pathlib.Path(f.locate()).parent.resolve()); break"
    OUTPUT_VARIABLE _fe_py_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_fe_py_dir)
    list(APPEND _fe_hints "${_fe_py_dir}")
  endif()
endif()

find_path(CUDNNFrontend_INCLUDE_DIR cudnn_frontend.h HINTS ${_fe_hints} NO_CMAKE_SYSTEM_PATH)
find_path(CUDNNFrontend_INCLUDE_DIR cudnn_frontend.h)

if(CUDNNFrontend_INCLUDE_DIR AND EXISTS "${CUDNNFrontend_INCLUDE_DIR}/cudnn_frontend_version.h")
  file(STRINGS "${CUDNNFrontend_INCLUDE_DIR}/cudnn_frontend_version.h" _fe_defs REGEX "#define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "CUDNN_FRONTEND_${_part}_VERSION +([0-9]+)" _m "${_fe_defs}")
    set(_fe_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(CUDNNFrontend_VERSION "${_fe_MAJOR}.${_fe_MINOR}.${_fe_PATCH}")
endif()

find_package_handle_standard_args(CUDNNFrontend
  REQUIRED_VARS CUDNNFrontend_INCLUDE_DIR
  VERSION_VAR CUDNNFrontend_VERSION
  REASON_FAILURE_MESSAGE "run scripts/setup.sh, or pass -DREPLAY_CUDNN_FRONTEND_INCLUDE_DIR=<dir>")

if(CUDNNFrontend_FOUND AND NOT TARGET CUDNN::frontend)
  add_library(CUDNN::frontend INTERFACE IMPORTED)
  # SYSTEM: the frontend's own warnings are not ours.
  set_target_properties(CUDNN::frontend PROPERTIES
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${CUDNNFrontend_INCLUDE_DIR}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNNFrontend_INCLUDE_DIR}")
  # Every translation unit that includes the frontend must agree on this (it changes class layouts);
  # replay does not use the frontend's JSON serialisation, and skipping it halves compile time.
  set_target_properties(CUDNN::frontend PROPERTIES INTERFACE_COMPILE_DEFINITIONS CUDNN_FRONTEND_SKIP_JSON_LIB)
  target_link_libraries(CUDNN::frontend INTERFACE CUDNN::cudnn CUDA::cudart)
endif()
mark_as_advanced(CUDNNFrontend_INCLUDE_DIR)
