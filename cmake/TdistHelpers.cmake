# tdist_add_module(NAME SOURCES... [DEPS targets...] [PRIVATE_DEPS targets...])
# Defines the library tdist_<NAME> with alias tdist::<NAME> and adds it to the umbrella target and
# the export set; cmake/TdistInstall.cmake installs its public headers under include/tdist/<NAME>/.
set(TDIST_MODULE_TARGETS "" CACHE INTERNAL "")
function(tdist_add_module name)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(tdist_${name} ${M_SOURCES})
  add_library(tdist::${name} ALIAS tdist_${name})
  set_target_properties(tdist_${name} PROPERTIES OUTPUT_NAME tdist_${name} EXPORT_NAME ${name})
  target_include_directories(tdist_${name} PUBLIC
    $<BUILD_INTERFACE:${TDIST_INCLUDE_ROOT}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_options(tdist_${name} PRIVATE -Wall -Wextra)
  target_link_libraries(tdist_${name} PUBLIC ${M_DEPS} PRIVATE ${M_PRIVATE_DEPS})
  tdist_unity_build(tdist_${name})
  set(TDIST_MODULE_TARGETS ${TDIST_MODULE_TARGETS} tdist_${name} CACHE INTERNAL "")
  set_property(GLOBAL APPEND PROPERTY TDIST_EXPORTED tdist_${name})
  set_property(GLOBAL APPEND PROPERTY TDIST_MODULE_DIRS ${name})
endfunction()

# tdist_unity_build(target): `target`'s sources are compiled TDIST_UNITY_LIBS to a translation
# unit when that is above 0 (scripts/build.sh, the sanitizer trees), one each otherwise. For the
# libraries and the apps: most of a translation unit's time goes to what every one of them
# instantiates (libtorch above all): tdist-bench's ten files took 374 s of CPU one by one on a
# slow machine and 113 in two. Anonymous namespaces of one target meet in a unity build: their
# names must differ (apps/bench/collective.cpp).
function(tdist_unity_build target)
  if(TDIST_UNITY_LIBS GREATER 0)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON
                                               UNITY_BUILD_BATCH_SIZE ${TDIST_UNITY_LIBS})
  endif()
endfunction()

# tdist_use_torch_pch(target): `target` (an executable: an app or a test) includes the heavy
# libtorch headers precompiled. They are precompiled once, by tdist_torch_pch, and reused by every
# executable: with debug information one precompiled <torch/torch.h> takes about 860 MB and a
# minute to build, so one per target cost some 13 GB of disk and a quarter of an hour. A reused
# header must be compiled like its users: tdist_torch_pch is an executable with their warnings,
# so it gets their -fPIE too.
function(tdist_use_torch_pch target)
  if(NOT TARGET tdist_torch_pch)
    add_executable(tdist_torch_pch ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cpp)
    target_link_libraries(tdist_torch_pch PRIVATE tdist_torch::torch)
    target_compile_options(tdist_torch_pch PRIVATE -Wall -Wextra)
    target_precompile_headers(tdist_torch_pch PRIVATE <torch/torch.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM tdist_torch_pch)
endfunction()
