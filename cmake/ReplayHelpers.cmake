# Helpers shared by every CMakeLists.txt: compile options, one helper per target kind.

# Environment of every test run under mpiexec: OpenMPI refuses to start as root (CI and the GPU
# machine run as root) unless told, and NVLink multicast stays off on shared multi-GPU hosts.
set(REPLAY_MPI_TEST_ENVIRONMENT
    "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;NCCL_NVLS_ENABLE=0")

# replay_set_options(<target>): warnings and CUDA flags every replay target uses.
function(replay_set_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall,-Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<CONFIG:Debug>>:-lineinfo>)
  if(REPLAY_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
endfunction()

# replay_add_library(<name> [CUDA] SOURCES ... [LIBS ...])
function(replay_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_LIBS})
  replay_set_options(${name})
endfunction()

# replay_add_workload(<name> SOURCES ... [LIBS ...]): an executable installed to bin/ and placed in
# <build>/bin so that scripts find every binary in one folder.
function(replay_add_workload name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/bin")
  replay_set_options(${name})
  install(TARGETS ${name} RUNTIME DESTINATION bin)
endfunction()

# replay_add_test(<name> SOURCES ... [LIBS ...] LABELS cpu|gpu|mpi [RANKS n] [TIMEOUT s] [ARGS ...])
# GPU and MPI tests link tests/support's main, which exits 77 without a usable GPU; CTest counts 77 as
# a skip (SKIP_RETURN_CODE). MPI tests run under mpiexec with RANKS processes.
function(replay_add_test name)
  cmake_parse_arguments(ARG "" "RANKS;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  if(NOT ARG_LABELS)
    message(FATAL_ERROR "replay_add_test(${name}): LABELS cpu|gpu|mpi is required")
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest replay_test_support)
  if("gpu" IN_LIST ARG_LABELS OR "mpi" IN_LIST ARG_LABELS)
    target_link_libraries(${name} PRIVATE replay_test_gpu_main)
  else()
    target_link_libraries(${name} PRIVATE GTest::gtest_main)
  endif()
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests")
  replay_set_options(${name})
  if("mpi" IN_LIST ARG_LABELS)
    if(NOT ARG_RANKS)
      set(ARG_RANKS 2)
    endif()
    add_test(NAME ${name}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ARG_RANKS} --oversubscribe
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS} ${ARG_ARGS})
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${REPLAY_MPI_TEST_ENVIRONMENT}")
  else()
    add_test(NAME ${name} COMMAND ${name} ${ARG_ARGS})
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES
    LABELS "${ARG_LABELS}" SKIP_RETURN_CODE 77 TIMEOUT ${ARG_TIMEOUT})
endfunction()
