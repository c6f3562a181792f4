// Helpers shared by Keel's tests: temporary directories and running the keel binary.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace keel::testing {

// A fresh directory under /tmp, removed with everything in it when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "keel-test") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command, capturing its output.
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Runs the keel binary built with the tests.
inline CommandResult run_keel(const std::string& args) { return run_command(std::string(KEEL_BINARY) + " " + args); }

inline std::string source_path(const std::string& relative) { return std::string(KEEL_SOURCE_DIR) + "/" + relative; }

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Number of lines in s (errors must be one line).
inline int count_lines(const std::string& s) {
  int lines = 0;
  for (char c : s) lines += c == '\n';
  return lines + (!s.empty() && s.back() != '\n');
}

}  // namespace keel::testing
