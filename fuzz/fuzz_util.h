// Shared by Keel's fuzz targets: each writes the fuzzer's bytes to a file under one private
// directory (the parsers under test read files, as users give them) and runs the parser. A
// keel::Error is the expected answer to bad input; anything else (a crash, a sanitizer report,
// another exception type, a hang) is a defect.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace keel::fuzz {

// A directory of this process's own, removed at exit (the path is never destroyed: the exit
// handler that removes it runs after static objects are gone).
inline const std::string& scratch() {
  static const std::string* dir = [] {
    auto* d = new std::string(std::filesystem::temp_directory_path() / ("keel-fuzz-" + std::to_string(::getpid())));
    std::filesystem::create_directories(*d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch(), ec);
    });
    return d;
  }();
  return *dir;
}

inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace keel::fuzz
