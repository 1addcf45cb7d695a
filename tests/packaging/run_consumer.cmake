# ctest packaging_find_package / packaging_add_subdirectory: configure, build and run the consumer
# project in tests/packaging from a clean binary dir, with the same generator and compiler as the
# titans build tree.
#   cmake -DMODE=find_package|subdir -DCONSUMER_SOURCE_DIR=... -DCONSUMER_BINARY_DIR=...
#         [-DPREFIX=<install prefix>] [-DTITANS_SOURCE_DIR=<src>] [-DGENERATOR=...]
#         [-DGENERATOR_PLATFORM=...] [-DGENERATOR_TOOLSET=...] [-DMAKE_PROGRAM=...]
#         [-DCXX_COMPILER=...] [-DEIGEN3_DIR=...] [-DUSE_OPENMP=ON|OFF] [-DEXPECT_OPENMP=ON|OFF]
#         [-DEXPECT_VERSION=x.y.z] [-DWITH_IO=ON] -P run_consumer.cmake
foreach(_v MODE CONSUMER_SOURCE_DIR CONSUMER_BINARY_DIR)
  if(NOT DEFINED ${_v} OR "${${_v}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${_v} is required")
  endif()
endforeach()

set(_args -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}"
  -DCMAKE_BUILD_TYPE=Release
  -DTITANS_CONSUMER_MODE=${MODE}
  # Only what we pass may be found: no user/system package registries.
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(GENERATOR)
  list(APPEND _args -G "${GENERATOR}")
endif()
if(GENERATOR_PLATFORM)
  list(APPEND _args -A "${GENERATOR_PLATFORM}")
endif()
if(GENERATOR_TOOLSET)
  list(APPEND _args -T "${GENERATOR_TOOLSET}")
endif()
if(MAKE_PROGRAM)
  list(APPEND _args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND _args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(EIGEN3_DIR)
  list(APPEND _args "-DEigen3_DIR=${EIGEN3_DIR}")
endif()
if(DEFINED EXPECT_OPENMP AND NOT EXPECT_OPENMP STREQUAL "")
  list(APPEND _args "-DTITANS_CONSUMER_EXPECT_OPENMP=${EXPECT_OPENMP}")
endif()
if(EXPECT_VERSION)
  list(APPEND _args "-DTITANS_CONSUMER_EXPECT_VERSION=${EXPECT_VERSION}")
endif()
if(WITH_IO)
  list(APPEND _args "-DTITANS_CONSUMER_WITH_IO=ON")
endif()

if(MODE STREQUAL "find_package")
  if(NOT PREFIX OR NOT IS_DIRECTORY "${PREFIX}")
    message(FATAL_ERROR "find_package mode needs -DPREFIX=<existing install prefix>, got '${PREFIX}'")
  endif()
  list(APPEND _args "-DCMAKE_PREFIX_PATH=${PREFIX}")
elseif(MODE STREQUAL "subdir")
  list(APPEND _args "-DTITANS_SOURCE_DIR=${TITANS_SOURCE_DIR}")
  if(DEFINED USE_OPENMP AND NOT USE_OPENMP STREQUAL "")
    list(APPEND _args "-DTITANS_USE_OPENMP=${USE_OPENMP}")
  endif()
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

function(_run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "consumer ${what} failed (${_rc})")
  endif()
endfunction()

file(REMOVE_RECURSE "${CONSUMER_BINARY_DIR}")
_run(configure "${CMAKE_COMMAND}" ${_args})
_run(build "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}" --config Release)
_run(run "${CONSUMER_BINARY_DIR}/bin/titans_consumer")
if(WITH_IO)
  _run(run-io "${CONSUMER_BINARY_DIR}/bin/titans_io_consumer" "${CONSUMER_BINARY_DIR}/roundtrip.safetensors")
endif()
message(STATUS "consumer (${MODE}) OK")
