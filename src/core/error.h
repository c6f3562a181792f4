// Errors in Keel are exceptions of one type carrying a one-line message that names the
// thing that failed, what was expected and what was found. The CLI catches them at the
// top and prints "keel: <message>" with a non-zero exit; nothing else prints errors.
#pragma once

#include <stdexcept>
#include <string>

namespace keel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws keel::Error(message) unless cond holds. For user-facing checks (bad input).
inline void check(bool cond, const std::string& message) {
  if (!cond) throw Error(message);
}

}  // namespace keel
