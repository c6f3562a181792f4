// Wall-clock intervals for the measurements components report.
#pragma once

#include <chrono>

namespace keel {

// Milliseconds since t0 (steady clock).
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace keel
