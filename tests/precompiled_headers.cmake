# One precompiled header for the test programs of a clang tree (scripts/test.sh's sanitizer tree;
# included by tests/CMakeLists.txt after keel_test_main is defined). Each test file otherwise parses
# GoogleTest, nlohmann/json and the standard library's headers again; with them parsed once, clang
# compiles the 21 sanitized test files (-O1, ASan + UBSan) in 14 % less CPU, 3-42 % a file
# (docs/testing.md, "Where a clean clone's time goes"). Not with GCC: at -O3 the precompiled header
# saved it 2-21 % a file, and GCC 12 then reports its std::string false positives (-Warray-bounds,
# -Wstringop-overflow: GCC bug 105329) as errors in test files that compile cleanly without it;
# KEEL_TEST_PCH=ON with GCC is refused.
# Only outside headers: CMake marks the precompiled header a system header, and the compiler treats
# what it includes as system headers too, whose warnings it does not report. Keel's own headers
# (test_util.h and what it includes) stay outside it, compiled with -Wall -Wextra -Werror as before.
# The header is built once, on keel_test_main, and reused by every executable of this directory
# that links keel_test_main (those defined further down in this directory too: the reuse is applied
# when the directory's CMakeLists.txt has been read). Reuse needs the same compile definitions on
# both sides: keel_test_main carries the tests' own (KEEL_SOURCE_DIR, KEEL_BINARY) as PUBLIC.
# A test file must still include what it uses: the header is force-included, so a missing include
# shows in the GCC tree (no precompiled header) only.
# ccache caches a file compiled with a precompiled header only with the sloppiness
# pch_defines,time_macros (its manual, "Precompiled headers"): where the launcher is ccache, the
# test programs' compiles get CCACHE_SLOPPINESS=pch_defines,time_macros in their environment
# (replacing a sloppiness set in ccache's configuration, for these compiles only).
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  set(keel_test_pch_default ON)
else()
  set(keel_test_pch_default OFF)
endif()
option(KEEL_TEST_PCH "Precompile the headers shared by the test programs (clang only; default ON with clang)"
       ${keel_test_pch_default})
if(KEEL_TEST_PCH AND NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "KEEL_TEST_PCH=ON: expected clang (configure with CC=clang CXX=clang++), found "
                      "${CMAKE_CXX_COMPILER_ID}: GCC 12 fails test files on false -Warray-bounds/-Wstringop-overflow "
                      "through a precompiled header")
endif()
if(KEEL_TEST_PCH)
  target_precompile_headers(keel_test_main PRIVATE
                            <gtest/gtest.h> <nlohmann/json.hpp>
                            <algorithm> <chrono> <cmath> <cstring> <filesystem> <fstream> <functional> <map> <memory>
                            <set> <sstream> <string> <thread> <vector>)

  if(CMAKE_CXX_COMPILER_LAUNCHER MATCHES "(^|/)ccache$")
    set(keel_test_launcher env CCACHE_SLOPPINESS=pch_defines,time_macros ${CMAKE_CXX_COMPILER_LAUNCHER})
    set_target_properties(keel_test_main PROPERTIES CXX_COMPILER_LAUNCHER "${keel_test_launcher}")
  endif()

  function(keel_reuse_test_pch)
    get_property(targets DIRECTORY PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target ${targets})
      get_target_property(type ${target} TYPE)
      get_target_property(libraries ${target} LINK_LIBRARIES)
      if(type STREQUAL "EXECUTABLE" AND keel_test_main IN_LIST libraries)
        target_precompile_headers(${target} REUSE_FROM keel_test_main)
        if(keel_test_launcher)
          set_target_properties(${target} PROPERTIES CXX_COMPILER_LAUNCHER "${keel_test_launcher}")
        endif()
      endif()
    endforeach()
  endfunction()
  cmake_language(DEFER CALL keel_reuse_test_pch)
endif()
