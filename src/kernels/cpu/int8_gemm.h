// Dynamic, range-based int8 matrix products (a dual encoder's visual-token quantisation).
//
// C[M,N] = alpha * Q(op(A)) Q(op(B)) + beta * C, row-major, op(X) = X^T when trans_* is true.
// Quantisation is symmetric and recomputed on every call from the operands' own ranges:
//   - every row i of op(A) gets its own scale  sa[i] = max_k |op(A)[i,k]| / 127,
//   - every column j of op(B) gets its own scale sb[j] = max_k |op(B)[k,j]| / 127,
//   - an element's code is q = round-half-even(x / s), clamped to [-127, 127] (float32 division);
//     a row or column that is all zeros has scale 0 and all codes 0.
// The integer products are summed exactly in int32, and then
//   C[i,j] = alpha * (sa[i] * sb[j]) * float(acc[i,j])                    when beta == 0 (C is not read),
//   C[i,j] = fma(beta, C[i,j], alpha * (sa[i] * sb[j]) * float(acc[i,j]))  otherwise,
// each product rounded to float32 in that order and the beta term added with a single rounding, so
// that no compiler's choice of contraction can make two evaluations of the formula differ.
//
// Every step is exact or a fixed sequence of float32 operations, so the fast path and the reference
// produce the same bytes, and repeated calls produce the same bytes whatever the thread count.
//
// Requirements: finite inputs (a NaN or infinity makes the scales meaningless), M, N, K >= 0, and
// K <= 133143 so that the int32 sums cannot overflow (127 * 127 * K < 2^31); keel::Error otherwise.
#pragma once

#include <string>

namespace keel {

// The fast path: the operands quantised in parallel into compact int8 buffers, their product taken
// by oneDNN's int8 matmul (int32 results), then the scale/alpha/beta epilogue. Where oneDNN has no
// int8 matmul for a shape, the reference loops below. Safe to call from several threads at once,
// and from inside an OpenMP parallel region (it then runs on the calling thread alone).
void gemm_int8_dynamic(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                       const float* B, int ldb, float beta, float* C, int ldc);

// Which engine gemm_int8_dynamic uses on this machine: "oneDNN int8 matmul (s8 x s8 -> s32, <impl>)",
// or "reference loops (...)" where oneDNN has none.
std::string int8_engine();

// The reference: the same quantisation, the int32 sums by plain loops, the same epilogue. Slow;
// for tests, which require gemm_int8_dynamic to equal it byte for byte.
void gemm_int8_dynamic_reference(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                                 const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace keel
