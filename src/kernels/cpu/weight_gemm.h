// The float32 products whose second operand is a layer's weight: the forward y = x W^T and the
// input gradient dx = dy W of every linear layer (kernels/cpu/ops.h linear_forward,
// linear_backward_input). OpenBLAS copies both operands into its panel layout on every call; at
// training's row counts oneDNN's matmul on a weight in the blocked layout it chooses for the shape
// is faster (docs/performance.md, bench/gemm_routes.cpp). Such products run through oneDNN with
// the weight reordered into that layout on every call (a copy of K x N floats, 1-2 % of the
// products' time at the default job's shapes in bench/gemm_routes.cpp, and no copy to keep
// current as the optimizer updates the weight). Which route a product takes depends only on its shape
// (packed_weight_route), never on timing, residency or thread count: a seed and layout keep their
// bytes run to run. The two routes differ in the last bits of the float32 sums.
#pragma once

#include "kernels/cpu/bf16.h"

namespace keel {

// Whether a float32 weight product of M rows, N output columns and K inputs (weight K x N as the
// product reads it) runs through oneDNN with the weight packed: at least 512 rows (the reorder's
// cost is amortised over the rows), a weight of at most 4 M floats (GPT-2 124M's tied head, 38.6 M,
// stays on OpenBLAS: its two 154 MB reorders per step cost more than they save), and called
// outside an OpenMP parallel region (attention's per-head products, run one per thread, stay on
// OpenBLAS).
bool packed_weight_route(int M, int N, int K);

// C[M, N] = A[M, K] op(W) + beta C, row-major, op(W) = W^T (W [N, K], leading dimension ldw) when
// trans_w, else W [K, N]: through packed_weight_route's choice, counted in gemm_stats. `precision`
// other than fp32 (and double) goes to gemm<T> unchanged.
template <typename T>
void gemm_weight(MatmulPrecision precision, bool trans_w, int M, int N, int K, const T* A, int lda, const T* W,
                 int ldw, T beta, T* C, int ldc);

// The oneDNN route itself, whatever packed_weight_route says (tests compare it with SGEMM). False
// when oneDNN has no implementation for the shape here (nothing written).
bool onednn_packed_weight_gemm(bool trans_w, int M, int N, int K, const float* A, int lda, const float* W, int ldw,
                               float beta, float* C, int ldc);

}  // namespace keel
