# FindNCCL: the NCCL collectives library.
# Provides NCCL::nccl, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY.
# Looked for, in order: NCCL_ROOT (CMake or environment) and NCCL_HOME, the CUDA toolkit (its
# include/ and lib/, and targets/<arch>-linux), the pip wheel (nvidia-nccl-cu13 or -cu12:
# site-packages/nvidia/nccl, whose library is only libnccl.so.2), then the system paths, the
# platform's multiarch folders (lib/<multiarch>, include/<multiarch>) included.
# (CMake itself searches NCCL_ROOT and CMAKE_PREFIX_PATH, as prefixes, before all of these.)
# <arch> and <multiarch> follow the architecture being configured for, not the build machine:
# x86_64 -> targets/x86_64-linux and x86_64-linux-gnu; aarch64 (Grace, GH200) -> targets/sbsa-linux
# and aarch64-linux-gnu. <multiarch> is CMAKE_LIBRARY_ARCHITECTURE where the compiler set it.
include(FindPackageHandleStandardArgs)

include(${CMAKE_CURRENT_LIST_DIR}/ReplaySearchSuffixes.cmake)
replay_search_suffixes(_nccl_include_suffixes _nccl_lib_suffixes)

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_ROOT}
    ${CUDAToolkit_TARGET_DIR})

# The pip wheel, in every site-packages of the Python the project uses (only until found: the result
# is cached).
set(_nccl_wheels "")
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  if(NOT Python3_EXECUTABLE)
    find_package(Python3 COMPONENTS Interpreter QUIET)
  endif()
  if(Python3_EXECUTABLE)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
        "import os, sys\nfor p in sys.path:\n    d = os.path.join(p, 'nvidia', 'nccl')\n    if p and os.path.isdir(d): print(os.path.abspath(d))"
      OUTPUT_VARIABLE _nccl_wheels OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(REPLACE "\n" ";" _nccl_wheels "${_nccl_wheels}")
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} ${_nccl_wheels}
  PATHS /usr/local/cuda /usr
  PATH_SUFFIXES ${_nccl_include_suffixes})
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
  HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR} ${_nccl_wheels}
  PATHS /usr/local/cuda /usr
  PATH_SUFFIXES ${_nccl_lib_suffixes})

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defs REGEX "#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_nccl_defs}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

string(REPLACE ";" ", " _nccl_searched "${_nccl_lib_suffixes}")
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE
    "searched NCCL_ROOT, the CUDA toolkit, pip's nvidia/nccl and the system paths, below each: ${_nccl_searched} (configuring for ${CMAKE_SYSTEM_PROCESSOR}). Pass -DNCCL_ROOT=<folder with include/nccl.h and lib/libnccl.so>")

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl SHARED IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
