# Debian packages: `cpack -G DEB` in a build folder (or `make deb`) writes
# <build>/packages/{libkvpipe,libkvpipe-dev,kvpipe}_<version>_<arch>.deb, one
# per install component (install.cmake). They install under /usr.
set(CPACK_PACKAGE_NAME kvpipe)
set(CPACK_PACKAGE_VENDOR kvpipe)
set(CPACK_PACKAGE_CONTACT "kvpipe maintainers <kvpipe@localhost>")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_RESOURCE_FILE_LICENSE ${CMAKE_SOURCE_DIR}/LICENSE)
set(CPACK_PACKAGE_DIRECTORY ${CMAKE_BINARY_DIR}/packages)
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev cli)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
# Dependencies on Debian's packages (libzmq5, libcurl4, ...) come from
# dpkg-shlibdeps; the CLI finds libkvpipe in this build folder.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${CMAKE_BINARY_DIR})

set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libkvpipe)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_GENERATE_SHLIBS ON) # shlibs file and the ldconfig trigger
set(CPACK_COMPONENT_RUNTIME_DESCRIPTION
    "kvpipe shared library\n Transfer engine (one-sided READ/WRITE over TCP and shared memory,\n Mooncake's wire formats) and tensor pipe (vLLM's MooncakePipe).")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libkvpipe-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libkvpipe (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_DEV_DESCRIPTION
    "kvpipe development files\n Headers, libkvpipe.so and libkvpipe.a, kvpipe.pc, the CMake package\n (find_package(kvpipe)), docs and examples.")

set(CPACK_DEBIAN_CLI_PACKAGE_NAME kvpipe)
set(CPACK_DEBIAN_CLI_PACKAGE_SECTION net)
set(CPACK_DEBIAN_CLI_PACKAGE_DEPENDS "libkvpipe (= ${PROJECT_VERSION})")
set(CPACK_COMPONENT_CLI_DESCRIPTION
    "kvpipe command-line tool\n kvpipe demo, bench, metadata-server and info.")

include(CPack)
