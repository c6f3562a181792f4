#include "kernels/cpu/float_mode.h"

#include <omp.h>
#include <xmmintrin.h>

namespace keel {

namespace {

constexpr unsigned kFlushToZero = 1u << 15;       // MXCSR.FTZ
constexpr unsigned kDenormalsAreZero = 1u << 6;   // MXCSR.DAZ
constexpr unsigned kBoth = kFlushToZero | kDenormalsAreZero;

void set_this_thread(bool on) { _mm_setcsr(on ? (_mm_getcsr() | kBoth) : (_mm_getcsr() & ~kBoth)); }

}  // namespace

void set_flush_denormals(bool on) {
  set_this_thread(on);
  // Every pool thread once (each runs the region's body exactly once: a team of max threads).
#pragma omp parallel num_threads(omp_get_max_threads())
  set_this_thread(on);
}

bool flush_denormals_on() { return (_mm_getcsr() & kBoth) == kBoth; }

}  // namespace keel
