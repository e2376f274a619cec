# Stand-in for CANN's ascendc.cmake, for x86 CI (build_checks/npu_build, docs/npu_build.md). Our own code: it reproduces
# the interface and the side effects of the real one that a consuming project sees, and nothing of bisheng.
#   * include() runs here in the caller's scope, so, like the real host_config.cmake, it turns RPATHs off for the
#     whole including directory: a project that wants a RUNPATH must restore it after the include;
#   * SOC_VERSION is validated for the families lmcache_npu builds for (A2/A3: c220, 310P: m200), lower case accepted;
#   * ascendc_library(<name> SHARED|STATIC|OBJECT <kernel sources>) generates
#     ${CMAKE_BINARY_DIR}/include/<name>/aclrtlaunch_<kernel>.h from each kernel's signature and builds <name> from
#     stub launchers with exactly that signature; its usage requirements are the real ones: the header directory and
#     <CANN>/include, <CANN>/lib64, and the CANN host libraries on the link line; output in ${CMAKE_BINARY_DIR}/lib;
#   * after linking a SHARED or STATIC <name>, a POST_BUILD step deletes it and re-links it by replaying
#     CMakeFiles/<name>.dir/link.txt split on whitespace, without a shell (relink.py), as the real rule does: shell
#     quoting in link.txt (a RUNPATH's "\$ORIGIN") reaches the linker literally, and a generator that writes no
#     link.txt (Ninja) fails the build;
#   * ascendc_compile_definitions / ascendc_include_directories / ascendc_compile_options forward to the target
#     (the definitions also reach the header generator, which resolves the kernel's name with them).
if(NOT DEFINED SOC_VERSION)
  message(FATAL_ERROR "SOC_VERSION value not set.")
endif()
string(TOLOWER "${SOC_VERSION}" _standin_soc)
set(_standin_c220_socs ascend910b1 ascend910b2 ascend910b2c ascend910b3 ascend910b4 ascend910b4-1
    ascend910_9391 ascend910_9381 ascend910_9372 ascend910_9392 ascend910_9382 ascend910_9362)
set(_standin_m200_socs ascend310p1 ascend310p3 ascend310p5 ascend310p7)
if(_standin_soc IN_LIST _standin_c220_socs)
  set(BUILD_MODE c220)
elseif(_standin_soc IN_LIST _standin_m200_socs)
  set(BUILD_MODE m200)
else()
  message(FATAL_ERROR "SOC_VERSION ${SOC_VERSION} does not support (stand-in CANN: A2/A3 ${_standin_c220_socs}, "
                      "310P ${_standin_m200_socs})")
endif()
if(NOT DEFINED RUN_MODE)
  set(RUN_MODE npu)
endif()
if(NOT EXISTS "${ASCEND_CANN_PACKAGE_PATH}/include/acl/acl.h")
  message(FATAL_ERROR "stand-in CANN at ${ASCEND_CANN_PACKAGE_PATH} has no include/acl: "
                      "assemble it with build_checks/npu_build")
endif()
set(ASCEND_PYTHON_EXECUTABLE "python3" CACHE STRING "python for the toolkit's generator scripts")

# The side effect the project must survive (the real toolkit's host_config.cmake does the same).
set(CMAKE_SKIP_RPATH TRUE)

set(_STANDIN_ASCENDC_CMAKE_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(ascendc_library target_name target_type)
  string(TOUPPER "${target_type}" type)
  if(NOT type MATCHES "^(SHARED|STATIC|OBJECT)$")
    message(FATAL_ERROR "target_type ${target_type} does not support, the support list is SHARED;STATIC;OBJECT")
  endif()
  set(sources)
  foreach(source IN LISTS ARGN)
    get_filename_component(absolute "${source}" ABSOLUTE)
    list(APPEND sources "${absolute}")
  endforeach()
  set(include_dir "${CMAKE_BINARY_DIR}/include/${target_name}")
  set(stub_source "${CMAKE_BINARY_DIR}/auto_gen/${target_name}/${target_name}_launch_stubs.cpp")
  add_custom_command(
    OUTPUT "${stub_source}"
    COMMAND "${ASCEND_PYTHON_EXECUTABLE}" "${_STANDIN_ASCENDC_CMAKE_DIR}/launch_header.py"
            --include-dir "${include_dir}" --stub-source "${stub_source}"
            "--definitions=$<TARGET_PROPERTY:${target_name},COMPILE_DEFINITIONS>" ${sources}
    DEPENDS ${sources} "${_STANDIN_ASCENDC_CMAKE_DIR}/launch_header.py"
    COMMENT "stand-in CANN: launch headers for ${target_name}"
    VERBATIM)
  add_library(${target_name} ${type} "${stub_source}")
  target_include_directories(${target_name}
    PRIVATE "${include_dir}" "${ASCEND_CANN_PACKAGE_PATH}/include"
    INTERFACE "${include_dir}" "${ASCEND_CANN_PACKAGE_PATH}/include")
  target_link_directories(${target_name} PUBLIC "${ASCEND_CANN_PACKAGE_PATH}/lib64")
  target_link_libraries(${target_name}
    INTERFACE ascendcl runtime tiling_api register platform error_manager profapi ge_common_base unified_dlog mmpa dl
    PUBLIC ascend_dump c_sec)
  set_target_properties(${target_name} PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    LIBRARY_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/lib"
    ARCHIVE_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/lib")
  if(NOT type STREQUAL "OBJECT")
    # The real toolkit re-links here to add its host-stub objects; the stand-in replays the same command unchanged.
    add_custom_command(TARGET ${target_name} POST_BUILD
      COMMAND rm -f $<TARGET_FILE:${target_name}>
      COMMAND "${ASCEND_PYTHON_EXECUTABLE}" "${_STANDIN_ASCENDC_CMAKE_DIR}/relink.py"
              --root-dir "${CMAKE_CURRENT_BINARY_DIR}" --target-name ${target_name}
      COMMENT "stand-in CANN: re-linking ${target_name} from link.txt")
  endif()
endfunction()

function(ascendc_compile_definitions target_name target_scope)
  target_compile_definitions(${target_name} ${target_scope} ${ARGN})
endfunction()

function(ascendc_include_directories target_name target_scope)
  target_include_directories(${target_name} ${target_scope} ${ARGN})
endfunction()

function(ascendc_compile_options target_name target_scope)
  target_compile_options(${target_name} ${target_scope} ${ARGN})
endfunction()
