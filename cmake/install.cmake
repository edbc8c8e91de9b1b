# What `cmake --install` (and `make install PREFIX=...`) puts where, by
# component; the .deb packages (package.cmake) are cut along the same lines:
#   runtime  libkvpipe.so.X                       -> libkvpipe
#   dev      headers, libkvpipe.so, libkvpipe.a, kvpipe.pc, CMake package, docs
#                                                 -> libkvpipe-dev
#   cli      bin/kvpipe                           -> kvpipe
# The Python module installs through pip (pyproject.toml), not here.
include(CMakePackageConfigHelpers)
set(KVP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/kvpipe)

install(DIRECTORY ${CMAKE_SOURCE_DIR}/include/kvpipe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(FILES ${CMAKE_BINARY_DIR}/include/kvpipe/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kvpipe COMPONENT dev)

install(TARGETS kvpipe_shared EXPORT kvpipeTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(TARGETS kvpipe EXPORT kvpipeStaticTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(TARGETS kvpipe_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT cli)

# The CMake package: kvpipe::kvpipe, and kvpipe::kvpipe_static on request.
install(EXPORT kvpipeTargets NAMESPACE kvpipe:: DESTINATION ${KVP_CMAKE_DIR} COMPONENT dev)
install(EXPORT kvpipeStaticTargets NAMESPACE kvpipe:: DESTINATION ${KVP_CMAKE_DIR}
        COMPONENT dev)
string(REPLACE ";" " " KVP_STATIC_DEPS_TEXT "${KVP_STATIC_DEPS}")
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/kvpipeConfig.cmake.in
  ${CMAKE_BINARY_DIR}/cmake/kvpipeConfig.cmake INSTALL_DESTINATION ${KVP_CMAKE_DIR})
# 0.x: only the same minor version is compatible (as the SONAME says).
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(KVP_COMPAT SameMinorVersion)
else()
  set(KVP_COMPAT SameMajorVersion)
endif()
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cmake/kvpipeConfigVersion.cmake
  COMPATIBILITY ${KVP_COMPAT})
install(FILES ${CMAKE_BINARY_DIR}/cmake/kvpipeConfig.cmake
              ${CMAKE_BINARY_DIR}/cmake/kvpipeConfigVersion.cmake
        DESTINATION ${KVP_CMAKE_DIR} COMPONENT dev)

# kvpipe.pc: its prefix is the one installed to, known only at install time
# (--prefix, DESTDIR and cpack choose it), so the file is written then, into a
# folder of its own per destination so that two installs at once do not mix.
# Libs.private names the libraries libkvpipe.a needs (as found here), not their
# .pc modules: `pkg-config --static` would expand those into their own private
# dependencies, which Debian's libzmq.pc lists wrongly (a libprotokit.a no
# package ships).
set(KVP_PC_LIBS_PRIVATE "")
foreach(dep IN LISTS KVP_STATIC_DEPS)
  string(REGEX REPLACE "=.*" "" prefix ${dep})
  foreach(dir IN LISTS ${prefix}_LIBRARY_DIRS)
    if(NOT dir IN_LIST CMAKE_C_IMPLICIT_LINK_DIRECTORIES AND NOT dir STREQUAL "/usr/lib")
      list(APPEND KVP_PC_LIBS_PRIVATE -L${dir})
    endif()
  endforeach()
  foreach(lib IN LISTS ${prefix}_LIBRARIES)
    list(APPEND KVP_PC_LIBS_PRIVATE -l${lib})
  endforeach()
endforeach()
list(REMOVE_DUPLICATES KVP_PC_LIBS_PRIVATE)
string(REPLACE ";" " " KVP_PC_LIBS_PRIVATE "${KVP_PC_LIBS_PRIVATE}")
set(KVP_PC_PREFIX "@KVP_PC_PREFIX@")
configure_file(${CMAKE_CURRENT_LIST_DIR}/kvpipe.pc.in ${CMAKE_BINARY_DIR}/pkgconfig/kvpipe.pc.in
               @ONLY)
install(CODE "
  set(KVP_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  string(MD5 _kvp_dest \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${CMAKE_BINARY_DIR}/pkgconfig/kvpipe.pc.in\"
                 \"${CMAKE_BINARY_DIR}/pkgconfig/\${_kvp_dest}/kvpipe.pc\" @ONLY)
  file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig\"
       TYPE FILE FILES \"${CMAKE_BINARY_DIR}/pkgconfig/\${_kvp_dest}/kvpipe.pc\")
" COMPONENT dev)

install(FILES ${CMAKE_SOURCE_DIR}/README.md ${CMAKE_SOURCE_DIR}/CHANGELOG.md
              ${CMAKE_SOURCE_DIR}/LICENSE
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT dev)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.md")
install(DIRECTORY ${CMAKE_SOURCE_DIR}/examples/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples
        COMPONENT dev FILES_MATCHING PATTERN "*.c" PATTERN "*.h" PATTERN "*.txt" PATTERN "Makefile"
        PATTERN "*.sh")
