// Float32 products over batch x head of matrices that sit inside larger tensors: dense
// attention's per-head products (kernels/cpu/ops.h attention_forward / attention_backward_input:
// q, k and v at columns h*hs.. of qkv's rows, probabilities in att[B, NH, T, T]) as one oneDNN
// matmul over all B x NH heads instead of one OpenBLAS call per head on each thread: 1.2-1.3x less
// CPU time on the default job's heads (T 128, hs 64; bench/gemm_routes.cpp, docs/performance.md).
// The route is taken by shape alone (a seed and layout keep their bytes); its sums may differ from
// the per-head calls' in the last bits.
#pragma once

#include <cstdint>

namespace keel {

// One operand of B x H matrices: element (row r, column c) of matrix (b, h) at
// data[b * batch_stride + h * head_stride + r * row_stride + c * col_stride] (col_stride = 1 for a
// row-major matrix, row_stride = 1 for a transposed one).
struct HeadMatrices {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
};

// For every b < B and h < H: C = alpha * A B + beta * C, A M x K, B K x N, C M x N (C's data is
// written through its const pointer). Call it outside OpenMP parallel regions (oneDNN spreads the
// heads over the threads). Returns false, having written nothing, where oneDNN has no
// implementation for the shape; the caller then runs its own loop.
bool batched_head_gemm(int B, int H, int M, int N, int K, float alpha, const HeadMatrices& A, const HeadMatrices& Bm,
                       float beta, const HeadMatrices& C);

}  // namespace keel
