// The rate of a square matrix product at a given precision on this machine (a probe): the bound
// bench/step_breakdown puts beside the step's GEMMs, and the comparison behind the trainer's
// start-up warning where bf16 products are slower than float32 ones.
#pragma once

#include <string>

#include "kernels/cpu/bf16.h"

namespace keel {

// GFLOP/s of an n x n x n product at `precision` (fp32: SGEMM; bf16: gemm_bf16 on operands already
// in bf16, as a run's weight copies are) on the current threads: the best of `repeats` after one
// warm-up, on normal random operands.
double measure_gemm_gflops(MatmulPrecision precision, int n = 1024, int repeats = 3);

// The start-up line of a bf16 run where this CPU's bf16 products (`bf16_gflops`, the probe above)
// are slower than its float32 ones (`sgemm_gflops`), both compared as printed (to 0.1 GFLOP/s):
// names both rates and suggests fp32. "" where bf16 is not slower (or a rate is unknown, <= 0).
std::string bf16_slower_warning(double bf16_gflops, double sgemm_gflops);

}  // namespace keel
