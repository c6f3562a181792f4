// Small text helpers shared by the config parsers and the human-readable reports.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace keel {

// `s` without leading and trailing blanks and tabs.
inline std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t");
  return s.substr(a, b - a + 1);
}

// "12.3 MiB".
inline std::string format_mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace keel
