# test_find_modules.cmake: cmake/FindCUDNN.cmake and cmake/FindNCCL.cmake against fake cuDNN and NCCL
# installs, configured as for aarch64 (Grace, GH200) and as for x86_64. CPU only, no compiler.
#
#   cmake -DCASE=<layout>:<arch> [-DWORK_DIR=dir] [-DGENERATOR=Ninja] [-DMAKE_PROGRAM=ninja]
#         [-DPYTHON=python3] -P tests/cmake/test_find_modules.cmake
#
# Without CASE every case runs. <arch> is aarch64 or x86_64; <layout> is one of
#   cuda           the CUDA toolkit's targets/sbsa-linux and targets/x86_64-linux side by side (one tree
#                  for both machines, each with its own versions), given as FindCUDAToolkit gives it
#   debian         Debian's multiarch folders, both machines' side by side, no hints: found through the
#                  system paths of the fake root, CMAKE_LIBRARY_ARCHITECTURE set as the compiler sets it
#   debian_noarch  the same without CMAKE_LIBRARY_ARCHITECTURE: the modules derive it from the processor
#   pip            the nvidia-cudnn-cu13 and nvidia-nccl-cu13 wheels' layout (nvidia/cudnn, nvidia/nccl,
#                  only libcudnn.so.9 and libnccl.so.2) in a site-packages on PYTHONPATH
#   hint           CUDNN_ROOT (CMake variable) and NCCL_ROOT (environment) name a tarball-style install
#                  while the CUDA toolkit holds other versions: the hints win
#   foreign        a tree with only the other machine's files: nothing is found, and the message says
#                  what was searched
# Each case writes its fake tree under WORK_DIR/root and configures
# tests/cmake/find_modules_project with a toolchain file that sets CMAKE_SYSTEM_PROCESSOR (and
# CMAKE_LIBRARY_ARCHITECTURE) and confines every search to that root (CMAKE_FIND_ROOT_PATH, mode ONLY),
# so the build machine's own libraries cannot satisfy it. It then checks the library, the include
# folder, the version read from the header and the imported target's location.
cmake_minimum_required(VERSION 3.25)

set(_all_cases)
foreach(_arch aarch64 x86_64)
  foreach(_layout cuda debian debian_noarch pip hint foreign)
    list(APPEND _all_cases ${_layout}:${_arch})
  endforeach()
endforeach()
if(NOT CASE)
  set(CASE ${_all_cases})
endif()
if(NOT WORK_DIR)
  set(_tmp "$ENV{TMPDIR}")
  if(NOT _tmp)
    set(_tmp /tmp)
  endif()
  set(WORK_DIR "${_tmp}/replay_test_find_modules")
endif()
if(NOT PYTHON)
  find_program(PYTHON NAMES python3 python)
endif()
get_filename_component(_project "${CMAKE_CURRENT_LIST_DIR}/find_modules_project" ABSOLUTE)

set(_failures 0)
macro(check what got want)
  if(NOT "${got}" STREQUAL "${want}")
    message(SEND_ERROR "FAIL ${_case}: ${what} is '${got}', expected '${want}'")
    math(EXPR _failures "${_failures} + 1")
  endif()
endmacro()

function(fake_file path)
  get_filename_component(_dir "${path}" DIRECTORY)
  file(MAKE_DIRECTORY "${_dir}")
  file(WRITE "${path}" "")
endfunction()
# fake_cudnn(<include dir> <lib dir> <version> [WHEEL]): cudnn_version.h as cuDNN 9 writes it, and the
# libraries' names (a wheel has only the soname).
function(fake_cudnn inc lib version)
  string(REPLACE "." ";" _v "${version}")
  list(GET _v 0 _major)
  list(GET _v 1 _minor)
  list(GET _v 2 _patch)
  file(MAKE_DIRECTORY "${inc}")
  file(WRITE "${inc}/cudnn_version.h"
    "/* fake cuDNN ${version} */\n#ifndef CUDNN_VERSION_H_\n#define CUDNN_VERSION_H_\n\n"
    "#define CUDNN_MAJOR ${_major}\n#define CUDNN_MINOR ${_minor}\n#define CUDNN_PATCHLEVEL ${_patch}\n\n"
    "#define CUDNN_VERSION (CUDNN_MAJOR * 10000 + CUDNN_MINOR * 100 + CUDNN_PATCHLEVEL)\n#endif\n")
  fake_file("${lib}/libcudnn.so.${_major}")
  fake_file("${lib}/libcudnn_graph.so.${_major}")
  if(NOT "WHEEL" IN_LIST ARGN)
    fake_file("${lib}/libcudnn.so")
    fake_file("${lib}/libcudnn_graph.so")
  endif()
endfunction()
# fake_nccl(<include dir> <lib dir> <version> [WHEEL]): nccl.h's version lines and the library's names.
function(fake_nccl inc lib version)
  string(REPLACE "." ";" _v "${version}")
  list(GET _v 0 _major)
  list(GET _v 1 _minor)
  list(GET _v 2 _patch)
  file(MAKE_DIRECTORY "${inc}")
  file(WRITE "${inc}/nccl.h"
    "/* fake NCCL ${version} */\n#ifndef NCCL_H_\n#define NCCL_H_\n\n"
    "#define NCCL_MAJOR ${_major}\n#define NCCL_MINOR ${_minor}\n#define NCCL_PATCH ${_patch}\n"
    "#define NCCL_SUFFIX \"\"\n\n#define NCCL_VERSION_CODE ${_major}${_minor}0${_patch}\n#endif\n")
  fake_file("${lib}/libnccl.so.${_major}")
  if(NOT "WHEEL" IN_LIST ARGN)
    fake_file("${lib}/libnccl.so")
  endif()
endfunction()

# Per machine: CUDA's targets/ folder, Debian's multiarch folder, and the versions each fake install
# carries (different per machine, so that a version also tells which tree was read).
set(_cuda_target_aarch64 sbsa-linux)
set(_cuda_target_x86_64 x86_64-linux)
set(_multiarch_aarch64 aarch64-linux-gnu)
set(_multiarch_x86_64 x86_64-linux-gnu)
set(_cuda_cudnn_aarch64 9.11.1)
set(_cuda_nccl_aarch64 2.27.7)
set(_cuda_cudnn_x86_64 9.10.2)
set(_cuda_nccl_x86_64 2.26.5)
set(_deb_cudnn_aarch64 9.8.3)
set(_deb_cudnn_x86_64 9.7.4)
set(_deb_nccl 2.25.1) # /usr/include/nccl.h is one file for every machine
set(_pip_cudnn 9.13.0)
set(_pip_nccl 2.28.3)
set(_hint_cudnn 9.14.2)
set(_hint_nccl 2.29.1)

foreach(_case IN LISTS CASE)
  string(REPLACE ":" ";" _parts "${_case}")
  list(LENGTH _parts _n)
  if(NOT _n EQUAL 2)
    message(FATAL_ERROR "CASE '${_case}': expected <layout>:<arch>")
  endif()
  list(GET _parts 0 _layout)
  list(GET _parts 1 _arch)
  if(NOT _arch MATCHES "^(aarch64|x86_64)$")
    message(FATAL_ERROR "CASE '${_case}': the architecture is aarch64 or x86_64")
  endif()
  if(_arch STREQUAL "aarch64")
    set(_other x86_64)
  else()
    set(_other aarch64)
  endif()

  set(_work "${WORK_DIR}/${_layout}-${_arch}")
  file(REMOVE_RECURSE "${_work}")
  set(_root "${_work}/root")
  file(MAKE_DIRECTORY "${_root}")
  set(_defs)
  set(_env --unset=CUDNN_ROOT --unset=CUDNN_HOME --unset=NCCL_ROOT --unset=NCCL_HOME
           --unset=CMAKE_PREFIX_PATH --unset=PYTHONPATH)
  set(_set_library_architecture TRUE)
  set(_expect_found TRUE)
  set(_cuda "${_root}/usr/local/cuda-13.0")

  if(_layout STREQUAL "cuda" OR _layout STREQUAL "hint")
    foreach(_a aarch64 x86_64)
      set(_t "${_cuda}/targets/${_cuda_target_${_a}}")
      fake_cudnn("${_t}/include" "${_t}/lib" ${_cuda_cudnn_${_a}})
      fake_nccl("${_t}/include" "${_t}/lib" ${_cuda_nccl_${_a}})
    endforeach()
    # What FindCUDAToolkit sets on a native build (CUDAToolkit_TARGET_DIR is the toolkit's root there).
    list(APPEND _defs "-DCUDAToolkit_LIBRARY_ROOT=${_cuda}" "-DCUDAToolkit_TARGET_DIR=${_cuda}")
    set(_t "${_cuda}/targets/${_cuda_target_${_arch}}")
    set(_want_cudnn "${_t}/lib/libcudnn.so" "${_t}/include" ${_cuda_cudnn_${_arch}})
    set(_want_nccl "${_t}/lib/libnccl.so" "${_t}/include" ${_cuda_nccl_${_arch}})
    if(_layout STREQUAL "hint")
      # A cuDNN tarball (cudnn-linux-sbsa-*_cuda13-archive) and an NCCL build, each include/ and lib/.
      set(_c "${_root}/opt/cudnn-linux-archive")
      set(_g "${_root}/opt/nccl")
      fake_cudnn("${_c}/include" "${_c}/lib" ${_hint_cudnn})
      fake_nccl("${_g}/include" "${_g}/lib" ${_hint_nccl})
      list(APPEND _defs "-DCUDNN_ROOT=${_c}")
      list(APPEND _env "NCCL_ROOT=${_g}")
      set(_want_cudnn "${_c}/lib/libcudnn.so" "${_c}/include" ${_hint_cudnn})
      set(_want_nccl "${_g}/lib/libnccl.so" "${_g}/include" ${_hint_nccl})
    endif()
  elseif(_layout STREQUAL "debian" OR _layout STREQUAL "debian_noarch")
    foreach(_a aarch64 x86_64)
      set(_m ${_multiarch_${_a}})
      fake_cudnn("${_root}/usr/include/${_m}" "${_root}/usr/lib/${_m}" ${_deb_cudnn_${_a}})
      fake_nccl("${_root}/usr/include" "${_root}/usr/lib/${_m}" ${_deb_nccl})
    endforeach()
    set(_m ${_multiarch_${_arch}})
    set(_want_cudnn "${_root}/usr/lib/${_m}/libcudnn.so" "${_root}/usr/include/${_m}" ${_deb_cudnn_${_arch}})
    set(_want_nccl "${_root}/usr/lib/${_m}/libnccl.so" "${_root}/usr/include" ${_deb_nccl})
    if(_layout STREQUAL "debian_noarch")
      set(_set_library_architecture FALSE)
    endif()
  elseif(_layout STREQUAL "pip")
    if(NOT PYTHON)
      message("SKIPPED: ${_case} needs a Python interpreter (none found; pass -DPYTHON=...)")
      continue()
    endif()
    set(_sp "${_root}/venv/lib/python3/site-packages")
    fake_cudnn("${_sp}/nvidia/cudnn/include" "${_sp}/nvidia/cudnn/lib" ${_pip_cudnn} WHEEL)
    fake_nccl("${_sp}/nvidia/nccl/include" "${_sp}/nvidia/nccl/lib" ${_pip_nccl} WHEEL)
    list(APPEND _env "PYTHONPATH=${_sp}")
    string(REGEX MATCH "^[0-9]+" _cudnn_major "${_pip_cudnn}")
    string(REGEX MATCH "^[0-9]+" _nccl_major "${_pip_nccl}")
    set(_want_cudnn "${_sp}/nvidia/cudnn/lib/libcudnn.so.${_cudnn_major}" "${_sp}/nvidia/cudnn/include" ${_pip_cudnn})
    set(_want_nccl "${_sp}/nvidia/nccl/lib/libnccl.so.${_nccl_major}" "${_sp}/nvidia/nccl/include" ${_pip_nccl})
  elseif(_layout STREQUAL "foreign")
    # Everything a build for the other machine would find, in all three places, and nothing for this one.
    set(_t "${_cuda}/targets/${_cuda_target_${_other}}")
    fake_cudnn("${_t}/include" "${_t}/lib" ${_cuda_cudnn_${_other}})
    fake_nccl("${_t}/include" "${_t}/lib" ${_cuda_nccl_${_other}})
    set(_m ${_multiarch_${_other}})
    fake_cudnn("${_root}/usr/include/${_m}" "${_root}/usr/lib/${_m}" ${_deb_cudnn_${_other}})
    fake_nccl("${_root}/usr/include/${_m}" "${_root}/usr/lib/${_m}" ${_deb_nccl})
    list(APPEND _defs "-DCUDAToolkit_LIBRARY_ROOT=${_cuda}" "-DCUDAToolkit_TARGET_DIR=${_cuda}")
    set(_expect_found FALSE)
  else()
    message(FATAL_ERROR "CASE '${_case}': unknown layout '${_layout}'")
  endif()

  set(_toolchain "${_work}/toolchain-${_arch}.cmake")
  set(_tc "set(CMAKE_SYSTEM_NAME Linux)\nset(CMAKE_SYSTEM_PROCESSOR ${_arch})\n")
  if(_set_library_architecture)
    string(APPEND _tc "set(CMAKE_LIBRARY_ARCHITECTURE ${_multiarch_${_arch}})\n")
  endif()
  string(APPEND _tc
    "set(CMAKE_FIND_ROOT_PATH \"${_root}\")\n"
    "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)\n"
    "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)\n"
    "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)\n"
    "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)\n")
  file(WRITE "${_toolchain}" "${_tc}")

  set(_gen)
  if(GENERATOR)
    list(APPEND _gen -G "${GENERATOR}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND _gen "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(PYTHON)
    list(APPEND _defs "-DPython3_EXECUTABLE=${PYTHON}")
  endif()
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env ${_env}
            ${CMAKE_COMMAND} -S "${_project}" -B "${_work}/build" ${_gen}
            "-DCMAKE_TOOLCHAIN_FILE=${_toolchain}" ${_defs}
    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)

  if(NOT _expect_found)
    # Both modules must fail, naming this machine's folders in what they searched.
    if(_rc EQUAL 0)
      message(SEND_ERROR "FAIL ${_case}: configured, but only ${_other} files exist\n${_out}")
      math(EXPR _failures "${_failures} + 1")
    elseif(NOT _out MATCHES "Could NOT find CUDNN" OR NOT _out MATCHES "Could NOT find NCCL"
           OR NOT _out MATCHES "targets/${_cuda_target_${_arch}}/lib"
           OR NOT _out MATCHES "lib/${_multiarch_${_arch}}")
      message(SEND_ERROR "FAIL ${_case}: not the expected failure\n${_out}")
      math(EXPR _failures "${_failures} + 1")
    else()
      message(STATUS "ok ${_case}: nothing found among ${_other} files")
    endif()
    continue()
  endif()

  if(NOT _rc EQUAL 0)
    message(SEND_ERROR "FAIL ${_case}: configure failed\n${_out}")
    math(EXPR _failures "${_failures} + 1")
    continue()
  endif()
  set(_failures_before ${_failures})
  include("${_work}/build/found.cmake")
  check("CMAKE_SYSTEM_PROCESSOR" "${FOUND_SYSTEM_PROCESSOR}" "${_arch}")
  list(GET _want_cudnn 0 _lib)
  list(GET _want_cudnn 1 _inc)
  list(GET _want_cudnn 2 _ver)
  check("CUDNN_LIBRARY" "${FOUND_CUDNN_LIBRARY}" "${_lib}")
  check("CUDNN_INCLUDE_DIR" "${FOUND_CUDNN_INCLUDE_DIR}" "${_inc}")
  check("CUDNN_VERSION" "${FOUND_CUDNN_VERSION}" "${_ver}")
  check("CUDNN::cudnn's IMPORTED_LOCATION" "${FOUND_CUDNN_TARGET_LOCATION}" "${_lib}")
  list(GET _want_nccl 0 _lib)
  list(GET _want_nccl 1 _inc)
  list(GET _want_nccl 2 _ver)
  check("NCCL_LIBRARY" "${FOUND_NCCL_LIBRARY}" "${_lib}")
  check("NCCL_INCLUDE_DIR" "${FOUND_NCCL_INCLUDE_DIR}" "${_inc}")
  check("NCCL_VERSION" "${FOUND_NCCL_VERSION}" "${_ver}")
  check("NCCL::nccl's IMPORTED_LOCATION" "${FOUND_NCCL_TARGET_LOCATION}" "${_lib}")
  if(_failures EQUAL _failures_before)
    message(STATUS "ok ${_case}: cuDNN ${FOUND_CUDNN_VERSION} ${FOUND_CUDNN_LIBRARY}, NCCL ${FOUND_NCCL_VERSION} ${FOUND_NCCL_LIBRARY}")
  endif()
endforeach()

if(_failures GREATER 0)
  message(FATAL_ERROR "${_failures} check(s) failed")
endif()
