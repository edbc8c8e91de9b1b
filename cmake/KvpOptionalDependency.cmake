# kvp_optional_dependency(OPTION PREFIX MODULE DOC)
#
# An optional feature that needs the pkg-config module MODULE. The cache
# variable OPTION takes AUTO (the default: on when MODULE is found), ON (MODULE
# is required; configuring fails without it) or OFF (left out, MODULE not even
# looked for). Sets KVP_HAVE_<name> (OPTION with KVP_WITH_ replaced by
# KVP_HAVE_) to ON or OFF, and creates PkgConfig::PREFIX when found, like
# pkg_check_modules(PREFIX IMPORTED_TARGET MODULE).
function(kvp_optional_dependency option prefix module doc)
  set(${option} AUTO CACHE STRING "${doc}: AUTO (on when ${module} is found), ON or OFF")
  set_property(CACHE ${option} PROPERTY STRINGS AUTO ON OFF)
  string(REPLACE "KVP_WITH_" "KVP_HAVE_" have ${option})
  string(TOUPPER "${${option}}" want)
  if(want STREQUAL "OFF" OR want STREQUAL "NO" OR want STREQUAL "FALSE" OR want STREQUAL "0")
    set(${have} OFF PARENT_SCOPE)
    message(STATUS "${option}: OFF (${doc} left out)")
    return()
  endif()
  if(NOT want MATCHES "^(AUTO|ON|YES|TRUE|1)$")
    message(FATAL_ERROR "${option} is '${${option}}'; use AUTO, ON or OFF")
  endif()
  if(NOT TARGET PkgConfig::${prefix})
    pkg_check_modules(${prefix} QUIET IMPORTED_TARGET GLOBAL ${module})
  endif()
  if(TARGET PkgConfig::${prefix})
    set(${have} ON PARENT_SCOPE)
    message(STATUS "${option}: ON (${module} ${${prefix}_VERSION})")
  elseif(want STREQUAL "AUTO")
    set(${have} OFF PARENT_SCOPE)
    message(STATUS "${option}: OFF (${module} not found; ${doc} left out)")
  else()
    message(FATAL_ERROR "${option}=ON but pkg-config finds no ${module} (install its -dev "
                        "package, or configure with -D${option}=OFF)")
  endif()
endfunction()
