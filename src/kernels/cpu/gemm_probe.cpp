#include "kernels/cpu/gemm_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/blas.h"

namespace keel {

double measure_gemm_gflops(MatmulPrecision precision, int n, int repeats) {
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  Rng rng(3);
  for (float& x : a) x = static_cast<float>(rng.normal());
  for (float& x : b) x = static_cast<float>(rng.normal());
  std::vector<uint16_t> a16, b16;
  if (precision == MatmulPrecision::bf16) {
    a16.resize(a.size());
    b16.resize(b.size());
    to_bf16(a16.data(), a.data(), static_cast<int64_t>(a.size()));
    to_bf16(b16.data(), b.data(), static_cast<int64_t>(b.size()));
  }
  auto once = [&] {
    if (precision == MatmulPrecision::bf16) {
      gemm_bf16(false, false, n, n, n, 1.0f, Operand::bits(a16.data()), n, Operand::bits(b16.data()), n, 0.0f,
                c.data(), n);
    } else {
      gemm<float>(precision, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    }
  };
  once();
  double best_s = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    best_s = std::min(best_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / best_s * 1e-9;
}

std::string bf16_slower_warning(double bf16_gflops, double sgemm_gflops) {
  const double bf16_shown = std::round(bf16_gflops * 10) / 10, sgemm_shown = std::round(sgemm_gflops * 10) / 10;
  if (bf16_shown <= 0 || sgemm_shown <= 0 || bf16_shown >= sgemm_shown) return "";
  char line[320];
  std::snprintf(line, sizeof line,
                "keel: warning: runtime.precision = \"bf16\" is slower here: bf16 products run at %.1f GFLOP/s on "
                "this CPU, float32 ones (SGEMM) at %.1f; runtime.precision = \"fp32\" trains faster on it",
                bf16_shown, sgemm_shown);
  return line;
}

}  // namespace keel
