// The vector path of the blockwise attention kernels (kernels/cpu/ops.h flash_attention_forward,
// flash_attention_backward_input): the same function, computed with AVX-512 micro-kernels on
// packed 64 x 64 tiles instead of a BLAS call per tile. Under MatmulPrecision::bf16 its products
// take bf16 operands with float32 sums (AVX512_BF16 dot products): q, k, v, dout rounded, and each
// tile's probabilities (exp(s - m), m the row's running maximum after that tile) and score
// gradients rounded where they enter a product; softmax, its statistics and every sum stay float32.
//
// Work is split into tasks whose arithmetic does not depend on which thread runs them: the forward
// per (batch row, query head, 64-query tile), the backward per (batch row, query head) with its key
// tiles in order and, in each, its query tiles in order; a key/value head's gradient sums its query
// heads in head order after them. Results are therefore the same bytes for any thread count.
#pragma once

#include "kernels/cpu/bf16.h"

namespace keel::ops {

// Whether the vector path runs these shapes here: a CPU with AVX-512 (and AVX512_BF16 for bf16),
// float32 or bf16 products, a head size that is a multiple of 16 up to 256.
bool blockwise_attention_vectorized(MatmulPrecision precision, int head_size);

// The arguments and results of flash_attention_forward / flash_attention_backward_input (float);
// callers check blockwise_attention_vectorized first.
void blockwise_attention_forward_vector(MatmulPrecision precision, float* out, float* lse, const float* qkv, int B,
                                        int Tn, int C, int NH, int NKV, int window);
void blockwise_attention_backward_vector(MatmulPrecision precision, float* dqkv, const float* dout, const float* out,
                                         const float* lse, const float* qkv, int B, int Tn, int C, int NH, int NKV,
                                         int window);

// The vector path of ring attention's per-block pieces (kernels/cpu/ring_attention.h
// ring_attention_forward_block / _backward_block, float): the same micro-kernels on the block's
// packed tiles, each tile row's allowed keys found by comparing positions. Tasks as above: the
// forward per (batch row, query head, query tile), the backward per (batch row, query head) with
// its key tiles in order; a grouped key/value head's gradient sums its heads in head order.
struct RingBlock;
void ring_attention_forward_vector(MatmulPrecision precision, float* acc, float* m, float* l, const float* q,
                                   const float* k, const float* v, const RingBlock& s);
void ring_attention_backward_vector(MatmulPrecision precision, float* dq, float* dk, float* dv, const float* dout,
                                    const float* lse, const float* delta, const float* q, const float* k,
                                    const float* v, const RingBlock& s);

// Milliseconds of one forward and one backward pass of causal attention over B rows of Tn tokens
// (qkv's layout as ops.h; synthetic data), dense (attention_forward / _backward_input) or blockwise
// (flash_attention_*, window as there), with the caller's threads: the least of `repeats` timed
// passes after one untimed. The measurement behind model.attention = "auto" and the attention bench.
struct AttentionTiming {
  double forward_ms = 0, backward_ms = 0;
  double total_ms() const { return forward_ms + backward_ms; }
};
AttentionTiming time_attention(bool dense, MatmulPrecision precision, int B, int Tn, int C, int NH, int NKV,
                               int window, int repeats);

}  // namespace keel::ops
