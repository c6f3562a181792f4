// Wall-clock intervals for the measurements components report.
#pragma once

#include <chrono>
#include <cstdint>

namespace keel {

// Milliseconds since t0 (steady clock).
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// System-clock nanoseconds since the epoch at which this process ran its static initialisers
// (its start, to within the dynamic loader's work): where a restarted rank's time begins in
// recovery's breakdown.
int64_t process_start_ns();

}  // namespace keel
