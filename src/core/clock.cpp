#include "core/clock.h"

namespace keel {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Taken during static initialisation, before main.
const int64_t g_process_start_ns = now_ns();

}  // namespace

int64_t process_start_ns() { return g_process_start_ns; }

}  // namespace keel
