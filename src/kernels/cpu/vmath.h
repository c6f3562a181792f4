// Vectorizable exp and tanh for the float kernels. glibc's expf/tanhf are scalar calls unless
// the whole program is built with -ffast-math, and softmax, cross-entropy and GELU spend most
// of their time in them. These are branch-free (GCC vectorizes loops calling them under
// `omp simd`), accurate to a few ulp, and give the same bits on every run. The double overloads
// (used by the finite-difference tests) are the exact library functions.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace keel::vmath {

// e^x for float: range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r
// (Cephes expf coefficients), then scaling by 2^n through the exponent bits. Inputs are clamped
// to [-87.3, 88.7]: results below 2^-126 become ~1e-38 rather than subnormal or zero, which
// softmax cannot tell apart.
inline float exp(float x) {
  // Ternaries rather than fmin/fmax/floor: those keep NaN and errno semantics that stop GCC from
  // vectorizing without -ffast-math. Rounding to nearest by adding and removing 1.5 * 2^23.
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.7f ? 88.7f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}
inline double exp(double x) { return std::exp(x); }

// tanh(x) = 1 - 2 / (e^{2x} + 1); saturates cleanly to +-1.
inline float tanh(float x) { return 1.0f - 2.0f / (vmath::exp(2.0f * x) + 1.0f); }
inline double tanh(double x) { return std::tanh(x); }

}  // namespace keel::vmath
