# ctest packaging_install: install the titans build tree into a fresh prefix.
#   cmake -DBUILD_DIR=<build tree> -DPREFIX=<prefix> [-DCONFIG=<cfg>] [-DLIBDIR=lib] -P install.cmake
foreach(_v BUILD_DIR PREFIX)
  if(NOT DEFINED ${_v} OR "${${_v}}" STREQUAL "")
    message(FATAL_ERROR "install.cmake: ${_v} is required")
  endif()
endforeach()
if(NOT DEFINED LIBDIR OR LIBDIR STREQUAL "")
  set(LIBDIR lib)
endif()

file(REMOVE_RECURSE "${PREFIX}")  # no stale files from an earlier install
set(_cmd "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}")
if(DEFINED CONFIG AND NOT CONFIG STREQUAL "")
  list(APPEND _cmd --config "${CONFIG}")
endif()
execute_process(COMMAND ${_cmd} RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${_rc})")
endif()

foreach(_f
    "include/titans/config.hpp"
    "${LIBDIR}/cmake/titans/titansConfig.cmake"
    "${LIBDIR}/cmake/titans/titansConfigVersion.cmake"
    "${LIBDIR}/cmake/titans/titansTargets.cmake")
  if(NOT EXISTS "${PREFIX}/${_f}")
    message(FATAL_ERROR "missing from the install tree: ${PREFIX}/${_f}")
  endif()
endforeach()
message(STATUS "installed titans into ${PREFIX}")
