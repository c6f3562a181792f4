// bf16 matrix products (runtime.precision = "bf16"). bf16 keeps float32's 8-bit exponent and
// drops its mantissa to 7 bits: operands are rounded to bf16 (to nearest, ties to even), the
// products and their sums stay in float32. Two engines give that arithmetic:
//   - oneDNN's matmul primitive with bf16 source and weights and a float32 destination, one
//     primitive per shape, created once and cached, where the CPU has bf16 instructions
//     (AVX512_BF16: Zen 4 and later, Cooper Lake and later);
//   - elsewhere, emulated: the operands rounded to bf16 values held in float32, multiplied by
//     OpenBLAS's SGEMM. The same numbers up to the order of the float32 sums; bf16's numerics
//     without its speed. Keel says so in one line at start-up (cli/trainer), and runs.
// Master weights, gradients, their reduction and AdamW stay float32 (the model's store). Under
// bf16 the layers also keep some activations as bf16 bits (model/layer_util.h Stash): a GEMM
// operand may then arrive already in bf16 (`Operand`), which oneDNN reads as it is and the
// emulation widens to float32.
#pragma once

#include <cstdint>
#include <string>

namespace keel {

// The arithmetic of one float matrix product (kernels/cpu/blas.h gemm<float>): float32 (SGEMM),
// bf16 operands with float32 sums (runtime.precision = "bf16"), or int8 (dynamic range-based int8
// products, kernels/cpu/int8_gemm.h: an image tower's forward under clip.visual_quant = "int8").
// It is a value every product is given by its caller, not a state of the process: each layer holds
// the precision of its passes from its construction (model/layer.h MathMode) and hands it to the
// kernels, so models of different precisions can run side by side in one process.
enum class MatmulPrecision { fp32, bf16, int8 };

// Whether this CPU has bf16 dot-product instructions (CPUID leaf 7 subleaf 1: AVX512_BF16).
bool cpu_has_bf16();
// Which engine bf16 GEMMs use here ("oneDNN bf16 matmul (AMX-BF16)", "... (AVX512_BF16)" or
// "emulated ...").
std::string bf16_engine();

// float32 -> bf16 bits (round to nearest, ties to even; NaN stays NaN) and back.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}
inline float round_to_bf16(float x) { return from_bf16(to_bf16(x)); }

// n floats to bf16 bits (in parallel unless already inside a parallel region).
void to_bf16(uint16_t* dst, const float* src, int64_t n);

// A read-only matrix operand held as float32 or as bf16 bits (an activation stored in bf16).
struct Operand {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  Operand(const float* p) : f32(p) {}  // NOLINT: a float pointer is an Operand
  static Operand bits(const uint16_t* p) {
    Operand o(nullptr);
    o.bf16 = p;
    return o;
  }
  float operator[](int64_t i) const { return bf16 != nullptr ? from_bf16(bf16[i]) : f32[i]; }
  Operand offset(int64_t i) const { return bf16 != nullptr ? bits(bf16 + i) : Operand(f32 + i); }
};

// C[M,N] = alpha * op(A) op(B) + beta * C with A and B rounded to bf16 (row-major, as gemm).
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc);

// The same with either operand possibly in bf16 already (row-major, leading dimensions in elements).
// Operands that must be converted first (rounded, or widened by the emulation) are converted into
// per-thread buffers; a product whose buffers would exceed 8 M elements runs in panels along K
// (each panel's sum accumulated into C), so that the buffers stay bounded (tens of MB, not the
// size of the LM head's logits).
void gemm_bf16(bool trans_a, bool trans_b, int M, int N, int K, float alpha, Operand A, int lda, Operand B, int ldb,
               float beta, float* C, int ldc);

// The oneDNN matmul path itself, for `dt` = "f32" or "bf16" operands (tests check it against
// SGEMM with f32 where the CPU has no bf16). False when oneDNN has no implementation here.
bool onednn_gemm(const char* dt, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace keel
