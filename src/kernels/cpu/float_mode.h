// Flush-to-zero (FTZ) and denormals-are-zero (DAZ): the x86 MXCSR bits that make float32
// arithmetic treat values below 2^-126 (denormals) as zero, results and operands alike.
//
// Why Keel sets them (runtime.flush_denormals = true, the default): as a model trains, small
// gradients, their squares in AdamW's second moment and products of small activations fall into
// the denormal range, and every SGEMM or elementwise op that meets one takes the CPU's microcoded
// slow path (tens to hundreds of cycles per operation). Measured on Keel's default job, the step
// time grew 1.6x over 300 steps without flushing and stayed flat with it. What it changes
// numerically: a value smaller than 1.2e-38 in magnitude becomes 0. Weights, activations and
// losses of a trained model are many orders of magnitude above that; a gradient or moment that
// small contributes nothing an update could resolve against float32 weights (their spacing near
// 1e-3 is 1e-10), and AdamW's epsilon (1e-8) dominates a second moment below 1e-38 either way.
// Runs stay deterministic: the same seed and layout give the same bytes with flushing on, and
// (other bytes) with it off.
//
// MXCSR is per thread. A thread inherits its creator's at creation, so the mode is set on the
// calling thread and on every thread of the OpenMP pool (which OpenBLAS and oneDNN also run on);
// threads created afterwards (background writers, the pool's later members) inherit it.
#pragma once

namespace keel {

// Sets (or clears) FTZ and DAZ on the calling thread and on every thread of the OpenMP pool
// (a team of omp_get_max_threads()). A no-op on CPUs without SSE control (none Keel builds for).
void set_flush_denormals(bool on);

// Whether FTZ and DAZ are both set on the calling thread.
bool flush_denormals_on();

// Sets the mode for the lifetime of the scope (a Trainer, a loaded model) and restores the
// calling thread's and the pool's previous mode after it.
class FlushDenormalsScope {
 public:
  explicit FlushDenormalsScope(bool on) : before_(flush_denormals_on()) { set_flush_denormals(on); }
  ~FlushDenormalsScope() { set_flush_denormals(before_); }
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;

 private:
  bool before_;
};

}  // namespace keel
