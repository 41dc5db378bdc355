include(CMakePackageConfigHelpers)
get_property(_tdist_exported GLOBAL PROPERTY TDIST_EXPORTED)
install(TARGETS ${_tdist_exported} EXPORT tdistTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Headers: a module's public headers are those outside its detail/ folders. A detail/ header is
# installed only when an installed header includes it (an inline or template part of the public
# API needs it to compile); the other detail/ headers stay in the source tree.
get_property(_tdist_module_dirs GLOBAL PROPERTY TDIST_MODULE_DIRS)
set(_tdist_headers "")
foreach(_module IN LISTS _tdist_module_dirs)
  file(GLOB_RECURSE _module_headers RELATIVE ${PROJECT_SOURCE_DIR}
       ${PROJECT_SOURCE_DIR}/${_module}/*.h)
  foreach(_h IN LISTS _module_headers)
    if(NOT _h MATCHES "(^|/)detail/")
      list(APPEND _tdist_headers ${_h})
    endif()
  endforeach()
endforeach()
set(_tdist_queue ${_tdist_headers})
while(_tdist_queue)
  list(POP_FRONT _tdist_queue _h)
  file(STRINGS ${PROJECT_SOURCE_DIR}/${_h} _includes REGEX "^#include \"tdist/[^\"]+\"")
  foreach(_line IN LISTS _includes)
    string(REGEX REPLACE "^#include \"tdist/([^\"]+)\".*" "\\1" _inc "${_line}")
    if(EXISTS ${PROJECT_SOURCE_DIR}/${_inc} AND NOT _inc IN_LIST _tdist_headers)
      list(APPEND _tdist_headers ${_inc})
      list(APPEND _tdist_queue ${_inc})
    endif()
  endforeach()
endwhile()
foreach(_h IN LISTS _tdist_headers)
  get_filename_component(_dir ${_h} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${_h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tdist/${_dir})
endforeach()

install(EXPORT tdistTargets NAMESPACE tdist:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tdist)
configure_package_config_file(${CMAKE_CURRENT_SOURCE_DIR}/cmake/tdistConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/tdistConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tdist)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tdistConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tdistConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/tdistConfigVersion.cmake
              ${CMAKE_CURRENT_SOURCE_DIR}/cmake/TdistTorch.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tdist)
