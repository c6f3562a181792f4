// Dense causal attention's per-head products on AMX tiles (bf16 products, float32 sums), for the
// dense attention of kernels/cpu/ops.h (attention_forward / attention_backward_input) where the
// layer's products run in bf16 and the CPU has AMX-BF16.
//
// Why not oneDNN: on a machine with AMX, oneDNN 2.6's matmul takes ~160 us per head for attention's
// 512 x 512 x 64 products (its per-call setup and the weight's reorder into the tiles' pair layout
// dominate such small products; ~200 GFLOP/s against 1,300-1,600 on a layer's products), and
// its 4-D batched matmul falls back to gemm:jit. Here each head's operands are rounded to bf16 once,
// laid out as the tiles read them, and the products run straight from those buffers; the causal
// mask skips the tiles above the diagonal.
//
// The same arithmetic as the oneDNN route: q, k, v, the probabilities, dout and the scores'
// gradient rounded to bf16 (nearest even), products summed in float32, softmax and its backward in
// float32 (kernels/cpu/ops.cpp). Deterministic: a fixed order of tiles and sums, one head per call.
#pragma once

#include "kernels/cpu/blas.h"

namespace keel::ops {

// Whether the dense attention's heads run here: bf16 products, AMX-BF16 granted by the OS, the head
// size a multiple of 32 (at most 256) and Tn at most kAmxAttentionMaxTokens.
constexpr int kAmxAttentionMaxTokens = 4096;
bool amx_attention(MatmulPrecision precision, int head_size, int Tn);

// One head of causal (or full) attention: att [Tn, Tn] = softmax(scale q k^T) (zero above the
// diagonal when causal), out [Tn, hs] = att v (row stride ldo). q, k, v: Tn rows at stride ld.
void amx_attention_head_forward(float* out, int ldo, float* att, const float* q, const float* k, const float* v,
                                int ld, int Tn, int hs, bool causal, float scale);

// Its backward from att (the forward's probabilities) and dout (row stride ldo): dq = dS k
// (overwritten), dk (+)= dS^T q and dv (+)= att^T dout (added where `accumulate`: a key/value head
// shared by several query heads), with dS = att * (dout v^T - rowsum) * scale; dq, dk, dv rows at
// stride ld.
void amx_attention_head_backward(float* dq, float* dk, float* dv, int ld, bool accumulate, const float* dout, int ldo,
                                 const float* att, const float* q, const float* k, const float* v, int Tn, int hs,
                                 bool causal, float scale);

}  // namespace keel::ops
