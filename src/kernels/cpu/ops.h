// CPU kernels of the forward and backward passes of both model families (GPT-2, llama). Every op comes as a pair (or
// triple): `X_forward`, `X_backward_input` (B: gradient w.r.t. the input) and `X_backward_weight` (W: gradient w.r.t.
// the weights), side by side, with the shapes of every argument above them. All are templated on the scalar (float for
// training, double for finite-difference tests), use OpenBLAS for matrix products (oneDNN for the float32 weight
// products of >= 512 rows: kernels/cpu/weight_gemm.h) and OpenMP with static schedules
// elsewhere, so results are bit-identical run to run for a given thread count. `_backward_weight` kernels accumulate
// (+=) into weight gradients so micro-batches add up; `_backward_input` kernels overwrite unless `accumulate` is set.
//
// Kernels that multiply matrices take the arithmetic of their products as their first argument
// (`precision`, kernels/cpu/bf16.h; the layer's own, model/layer.h MathMode); double callers pass
// MatmulPrecision::fp32 (float64 products). Attention's products (q k^T and p v per head, run
// inside the kernel's parallel region, one head per thread) use the same precision as the
// layer's dense products: a bf16 layer's attention multiplies in bf16 and an int8 image tower's
// forward attention in int8, as the tower's other products. Nothing else decides a product's
// precision, so models of different precisions run interleaved or on concurrent threads, each
// with its own arithmetic.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/bf16.h"

namespace keel::ops {

// ---- token + position embedding ----------------------------------------------------------------
// out[N=B*T, C] = wte[tokens[n], :] + wpe[n % T, :]   (wpe may be null: no position table)
template <typename T>
void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe, int B, int Tn, int C);
// dwte[Vp, C] += scatter(dout) by token; dwpe[T, C] += sum over batch of dout (dwpe may be null).
template <typename T>
void encoder_backward_weight(T* dwte, T* dwpe, const T* dout, const int* tokens, int B, int Tn, int C);

// ---- layer normalisation (eps 1e-5) ------------------------------------------------------------
// out[N, C] = (inp - mean) * rstd * w + b; saves mean[N], rstd[N] for the backward pass.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C);
// Fused residual add + layernorm: res[N, C] = a + b_in, then out = layernorm(res).
template <typename T>
void residual_layernorm_forward(T* res, T* out, T* mean, T* rstd, const T* a, const T* b_in, const T* w,
                                const T* b, int N, int C);
// dinp[N, C] (= or +=) d/dinp of layernorm given dout[N, C].
template <typename T>
void layernorm_backward_input(T* dinp, const T* dout, const T* inp, const T* mean, const T* rstd, const T* w,
                              int N, int C, bool accumulate);
// dw[C] += sum_n dout * xhat, db[C] += sum_n dout.
template <typename T>
void layernorm_backward_weight(T* dw, T* db, const T* dout, const T* inp, const T* mean, const T* rstd, int N,
                               int C);

// ---- RMS normalisation (eps 1e-5; llama) -------------------------------------------------------
// out[N, C] = inp * rstd * w, rstd = 1 / sqrt(mean(inp^2) + eps); saves rstd[N].
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* w, int N, int C);
// Fused residual add + RMSNorm: res[N, C] = a + b_in, then out = rmsnorm(res).
template <typename T>
void residual_rmsnorm_forward(T* res, T* out, T* rstd, const T* a, const T* b_in, const T* w, int N, int C);
// dinp[N, C] (= or +=) d/dinp of rmsnorm given dout[N, C].
template <typename T>
void rmsnorm_backward_input(T* dinp, const T* dout, const T* inp, const T* rstd, const T* w, int N, int C,
                            bool accumulate);
// dw[C] += sum_n dout * inp * rstd.
template <typename T>
void rmsnorm_backward_weight(T* dw, const T* dout, const T* inp, const T* rstd, int N, int C);

// ---- linear: y = x W^T + b, W stored [OC, C] like PyTorch and llm.c ---------------------------
// out[N, OC] = inp[N, C] @ w[OC, C]^T + bias[OC] (bias may be null)
template <typename T>
void linear_forward(MatmulPrecision precision, T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC);
// dinp[N, C] (= or +=) dout[N, OC] @ w[OC, C]
template <typename T>
void linear_backward_input(MatmulPrecision precision, T* dinp, const T* dout, const T* w, int N, int C, int OC,
                           bool accumulate);
// dw[OC, C] += dout[N, OC]^T @ inp[N, C];  dbias[OC] += sum_n dout (dbias may be null)
template <typename T>
void linear_backward_weight(MatmulPrecision precision, T* dw, T* dbias, const T* dout, const T* inp, int N, int C,
                            int OC);

// float32 overloads whose stored operands may be bf16 bits (activations a layer keeps in bf16
// under runtime.precision = "bf16", model/layer_util.h Stash, and weights' bf16 copies): the products multiply in bf16,
// the bias sum widens each value to float32 and sums in float32.
void linear_forward(MatmulPrecision precision, float* out, Operand inp, Operand w, const float* bias, int N, int C,
                    int OC);
// The same for the input gradient, with the weight possibly in bf16 (the store's bf16 copy of it,
// store/chunk_store.h ChunkStore::bf16_params).
void linear_backward_input(MatmulPrecision precision, float* dinp, const float* dout, Operand w, int N, int C, int OC,
                           bool accumulate);
// The same with the output's gradient possibly in bf16 (a stash's bits).
void linear_backward_input(MatmulPrecision precision, float* dinp, Operand dout, Operand w, int N, int C, int OC,
                           bool accumulate);
void linear_backward_weight(MatmulPrecision precision, float* dw, float* dbias, Operand dout, Operand inp, int N, int C,
                            int OC);

// ---- GELU, tanh approximation ------------------------------------------------------------------
// out[n] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
// dinp[n] = gelu'(inp) * dout   (overwrites)
template <typename T>
void gelu_backward_input(T* dinp, const T* dout, const T* inp, int64_t n);
// The same with the stored input possibly in bf16 (computed in float32).
void gelu_backward_input(float* dinp, const float* dout, Operand inp, int64_t n);
// gelu_backward_input for a bf16 stash: dinp_bits = bf16(gelu'(inp) dout).
void gelu_backward_rounded(uint16_t* dinp_bits, const float* dout, Operand inp, int64_t n);
// gelu_forward for bf16 stashes, one pass: in_bits = bf16(inp), out_bits = bf16(gelu(inp)) (gelu
// of the float input, as gelu_forward computes it).
void gelu_forward_rounded(uint16_t* in_bits, uint16_t* out_bits, const float* inp, int64_t n);

// ---- SwiGLU (llama's MLP gate) ----------------------------------------------------------------
// inp[N, 2H] holds [a | b] per row (the gate and up projections); out[N, H] = silu(a) * b.
template <typename T>
void swiglu_forward(T* out, const T* inp, int N, int H);
// dinp[N, 2H] (overwritten) from dout[N, H] and the forward's inp.
template <typename T>
void swiglu_backward_input(T* dinp, const T* dout, const T* inp, int N, int H);
// The same with the stored input possibly in bf16 (computed in float32).
void swiglu_backward_input(float* dinp, const float* dout, Operand inp, int N, int H);
// swiglu_backward_input for a bf16 stash: dinp_bits [N, 2H] = bf16 of its float gradient.
void swiglu_backward_rounded(uint16_t* dinp_bits, const float* dout, Operand inp, int N, int H);
// swiglu_forward for bf16 stashes, one pass: in_bits = bf16(inp) [N, 2H], out_bits = bf16(silu(a) b)
// [N, H] (of the float input, as swiglu_forward computes it).
void swiglu_forward_rounded(uint16_t* in_bits, uint16_t* out_bits, const float* inp, int N, int H);

// ---- rotary position embedding (RoPE; llama) ---------------------------------------------------
// Rotates, in place, the q heads and the k heads of qkv[B, T, C + 2 * NKV * hs] ([q | k | v], q
// with NH heads, k and v with NKV): within each head, the pair (2i, 2i+1) at position t by the
// angle (pos0 + t) * theta^(-2i / hs) (Meta's and llama2.c's interleaved convention). inverse =
// true rotates back: that is the backward pass (a rotation's transpose is its inverse), applied to
// the gradients dq, dk in place.
template <typename T>
// position_scale multiplies every position (RoPE's linear scaling past the trained length).
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, double theta, int pos0, bool inverse = false,
                  double position_scale = 1.0);
// The same with the pairs' frequencies given (freq[i] for pair i, hs / 2 of them, in place of
// theta^(-2i / hs): ModelConfig::rope_frequencies, llama3's per-frequency scaling) and, when
// `positions` is not null, row r of the B * Tn rows at position positions[r] (a packed pass of
// several sequences) instead of pos0 + r % Tn. The angles' cos / sin table covers the positions
// asked for and is kept for the next call that needs no others.
template <typename T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, const std::vector<double>& freq, int pos0,
                  const int* positions, bool inverse = false, double position_scale = 1.0);

// ---- residual add ------------------------------------------------------------------------------
// out[n] = a[n] + b[n]
template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);

// ---- causal multi-head self-attention (no weights: only forward and backward_input) ------------
// qkv[B, T, C + 2 * NKV * hs] holds [q | k | v], hs = C / NH: q has NH heads, k and v NKV (NKV
// divides NH; query head h reads key/value head h / (NH / NKV): grouped-query attention; NKV = 0
// means NH, GPT-2's multi-head attention with qkv[B, T, 3C]). Head h's columns are h*hs..(h+1)*hs-1
// of its part. out[B, T, C] = softmax_causal(q k^T / sqrt(hs)) v per head; saves att[B, NH, T, T]
// (probabilities, zero above the diagonal) for the backward pass. causal = false: every position
// attends to every other (an image tower's patches).
template <typename T>
void attention_forward(MatmulPrecision precision, T* out, T* att, const T* qkv, int B, int Tn, int C, int NH,
                       int NKV = 0, bool causal = true);
// dqkv (overwritten, qkv's shape) from dout[B, T, C], att and qkv of the forward pass. The query
// heads of a group add into their key/value head's gradient in head order (a fixed order).
template <typename T>
void attention_backward_input(MatmulPrecision precision, T* dqkv, const T* dout, const T* att, const T* qkv, int B,
                              int Tn, int C, int NH, int NKV = 0, bool causal = true);

// ---- blockwise causal attention (FlashAttention-2's algorithm): no T x T buffer ----------------
// The same function as attention_forward (qkv's layout, grouped-query heads, NKV = 0 meaning NH),
// computed over tiles of 64 queries x 64 keys with an online softmax; it keeps only the
// log-sum-exp of each row, lse[B, NH, T], for the backward pass. window > 0: query i attends to
// keys i - window + 1 .. i only (a sliding window), and tiles wholly outside it are skipped, not
// masked; window = 0: all keys up to i.
template <typename T>
void flash_attention_forward(MatmulPrecision precision, T* out, T* lse, const T* qkv, int B, int Tn, int C, int NH,
                             int NKV, int window);
// Where causal attention's probability mass goes by distance (the dynamic window's signal): for
// the last `rows` query rows of each sequence of qkv (layout as above) and every query head, the
// full causal softmax (no window) is computed and its mass at distance d = i - j added to
// mass[h * buckets + bucket(d)] (bucket 0: d = 0; bucket b >= 1: 2^(b-1) <= d < 2^b; the last
// bucket takes everything beyond). Adds B * min(rows, T) rows per head.
template <typename T>
void attention_distance_mass(double* mass, int buckets, const T* qkv, int B, int Tn, int C, int NH, int NKV, int rows);
// Attention of n new queries over keys and values kept in fixed-size blocks (a KV cache):
// q[n, ldq] holds NH heads of hs columns for positions pos0 .. pos0 + n - 1; block b holds the
// keys of positions b * block_tokens .. in its first [block_tokens, NKV * hs] floats and their
// values in the next as many. Every key up to each query's own position must be in the blocks
// (the new tokens' included). out[n, NH * hs] is causal softmax attention, window as above; blocks
// wholly outside a query tile's window are never read.
template <typename T>
void paged_attention_forward(MatmulPrecision precision, T* out, const T* q, int ldq, int n, int pos0,
                             const T* const* blocks, int block_tokens, int NH, int NKV, int hs, int window);
// dqkv (overwritten) from dout, the forward's out and lse, and qkv: each tile's probabilities are
// recomputed from q, k and lse; delta = rowsum(dout * out) stands for rowsum(dp * p). Tasks are a
// batch row's key/value head with its query heads in order (a fixed summation order).
template <typename T>
void flash_attention_backward_input(MatmulPrecision precision, T* dqkv, const T* dout, const T* out, const T* lse,
                                    const T* qkv, int B, int Tn, int C, int NH, int NKV, int window);

// ---- softmax cross-entropy, fused with its gradient --------------------------------------------
// logits[N, Vp] (only the first V columns are real). losses[n] = -log softmax(logits[n])[targets[n]].
// If grad_scale != 0, logits is overwritten in place with grad_scale * (softmax - onehot), and the
// padded columns V..Vp-1 with zero: the gradient of grad_scale * sum(losses).
template <typename T>
void crossentropy_forward(T* losses, T* logits, const int* targets, int N, int V, int Vp, T grad_scale);

// The same with the gradient (grad_scale != 0) written as bf16 bits for bf16 products: row n's
// at uint16 offset n * 2Vp + Vp of `logits` (the upper half of its own float32 row, written from
// the row's end down, so that no float is overwritten before it is read): the gradient as a
// [N, Vp] bf16 matrix at ((uint16_t*)logits) + Vp with row stride 2Vp. The floats are not the
// gradient afterwards.
void crossentropy_forward_bf16_gradient(float* losses, float* logits, const int* targets, int N, int V, int Vp,
                                        float grad_scale);

}  // namespace keel::ops
