# FindCUDNN: the cuDNN 9 library (backend API).
# Provides CUDNN::cudnn, CUDNN_VERSION, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY.
# Looked for, in order: CUDNN_ROOT (CMake or environment) and CUDNN_HOME, the CUDA toolkit (its
# include/ and lib/, and targets/<arch>-linux), the pip wheel (nvidia-cudnn-cu13 or -cu12:
# site-packages/nvidia/cudnn, whose library is only libcudnn.so.9), then the system paths, the
# platform's multiarch folders (lib/<multiarch>, include/<multiarch>) included.
# (CMake itself searches CUDNN_ROOT and CMAKE_PREFIX_PATH, as prefixes, before all of these.)
# <arch> and <multiarch> follow the architecture being configured for, not the build machine:
# x86_64 -> targets/x86_64-linux and x86_64-linux-gnu; aarch64 (Grace, GH200) -> targets/sbsa-linux
# and aarch64-linux-gnu. <multiarch> is CMAKE_LIBRARY_ARCHITECTURE where the compiler set it.
include(FindPackageHandleStandardArgs)

include(${CMAKE_CURRENT_LIST_DIR}/ReplaySearchSuffixes.cmake)
replay_search_suffixes(_cudnn_include_suffixes _cudnn_lib_suffixes)

set(_cudnn_hints ${CUDNN_ROOT} $ENV{CUDNN_ROOT} $ENV{CUDNN_HOME} ${CUDAToolkit_LIBRARY_ROOT}
    ${CUDAToolkit_TARGET_DIR})
foreach(_d IN LISTS CUDAToolkit_INCLUDE_DIRS)
  get_filename_component(_p "${_d}" DIRECTORY)
  list(APPEND _cudnn_hints "${_p}")
endforeach()

# The pip wheel, in every site-packages of the Python the project uses (only until found: the result
# is cached).
if(NOT CUDNN_INCLUDE_DIR OR NOT CUDNN_LIBRARY)
  if(NOT Python3_EXECUTABLE)
    find_package(Python3 COMPONENTS Interpreter QUIET)
  endif()
  if(Python3_EXECUTABLE)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
        "import os, sys\nfor p in sys.path:\n    d = os.path.join(p, 'nvidia', 'cudnn')\n    if p and os.path.isdir(d): print(os.path.abspath(d))"
      OUTPUT_VARIABLE _cudnn_wheels OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(REPLACE "\n" ";" _cudnn_wheels "${_cudnn_wheels}")
    list(APPEND _cudnn_hints ${_cudnn_wheels})
  endif()
endif()

find_path(CUDNN_INCLUDE_DIR cudnn_version.h
  HINTS ${_cudnn_hints}
  PATHS /usr/local/cuda /usr
  PATH_SUFFIXES ${_cudnn_include_suffixes})
find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 NAMES_PER_DIR
  HINTS ${_cudnn_hints}
  PATHS /usr/local/cuda /usr
  PATH_SUFFIXES ${_cudnn_lib_suffixes})

if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(STRINGS "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _cudnn_defs REGEX "#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
  foreach(_part MAJOR MINOR PATCHLEVEL)
    string(REGEX MATCH "CUDNN_${_part} +([0-9]+)" _m "${_cudnn_defs}")
    set(_cudnn_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(CUDNN_VERSION "${_cudnn_MAJOR}.${_cudnn_MINOR}.${_cudnn_PATCHLEVEL}")
endif()

string(REPLACE ";" ", " _cudnn_searched "${_cudnn_lib_suffixes}")
find_package_handle_standard_args(CUDNN
  REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
  VERSION_VAR CUDNN_VERSION
  REASON_FAILURE_MESSAGE
    "searched CUDNN_ROOT, the CUDA toolkit, pip's nvidia/cudnn and the system paths, below each: ${_cudnn_searched} (configuring for ${CMAKE_SYSTEM_PROCESSOR}). Pass -DCUDNN_ROOT=<folder with include/cudnn_version.h and lib/libcudnn.so>")

if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn SHARED IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()
mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
