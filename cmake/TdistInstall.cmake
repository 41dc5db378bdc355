include(CMakePackageConfigHelpers)
get_property(_tdist_exported GLOBAL PROPERTY TDIST_EXPORTED)
install(TARGETS ${_tdist_exported} EXPORT tdistTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
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
