// CPU kernels of the GPT forward and backward passes. Every op comes as a pair (or triple):
// `X_forward`, `X_backward_input` (B: gradient w.r.t. the input) and `X_backward_weight`
// (W: gradient w.r.t. the weights), side by side, with the shapes of every argument above them.
// All are templated on the scalar (float for training, double for finite-difference tests), use
// OpenBLAS for matrix products and OpenMP with static schedules elsewhere, so results are
// bit-identical run to run for a given thread count. `_backward_weight` kernels accumulate (+=)
// into weight gradients so micro-batches add up; `_backward_input` kernels overwrite unless
// `accumulate` is set.
#pragma once

#include <cstdint>

namespace keel::ops {

// ---- token + position embedding ----------------------------------------------------------------
// out[N=B*T, C] = wte[tokens[n], :] + wpe[n % T, :]
template <typename T>
void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe, int B, int Tn, int C);
// dwte[Vp, C] += scatter(dout) by token; dwpe[T, C] += sum over batch of dout.
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

// ---- linear: y = x W^T + b, W stored [OC, C] like PyTorch and llm.c ---------------------------
// out[N, OC] = inp[N, C] @ w[OC, C]^T + bias[OC] (bias may be null)
template <typename T>
void linear_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC);
// dinp[N, C] (= or +=) dout[N, OC] @ w[OC, C]
template <typename T>
void linear_backward_input(T* dinp, const T* dout, const T* w, int N, int C, int OC, bool accumulate);
// dw[OC, C] += dout[N, OC]^T @ inp[N, C];  dbias[OC] += sum_n dout (dbias may be null)
template <typename T>
void linear_backward_weight(T* dw, T* dbias, const T* dout, const T* inp, int N, int C, int OC);

// ---- GELU, tanh approximation ------------------------------------------------------------------
// out[n] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
// dinp[n] = gelu'(inp) * dout   (overwrites)
template <typename T>
void gelu_backward_input(T* dinp, const T* dout, const T* inp, int64_t n);

// ---- residual add ------------------------------------------------------------------------------
// out[n] = a[n] + b[n]
template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);

// ---- causal multi-head self-attention (no weights: only forward and backward_input) ------------
// qkv[B, T, 3C] holds [q | k | v], head h at columns h*hs..(h+1)*hs-1 of each, hs = C / NH.
// out[B, T, C] = softmax_causal(q k^T / sqrt(hs)) v per head; saves att[B, NH, T, T] (probabilities,
// zero above the diagonal) for the backward pass.
template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH);
// dqkv[B, T, 3C] (overwritten) from dout[B, T, C], att and qkv of the forward pass.
template <typename T>
void attention_backward_input(T* dqkv, const T* dout, const T* att, const T* qkv, int B, int Tn, int C, int NH);

// ---- softmax cross-entropy, fused with its gradient --------------------------------------------
// logits[N, Vp] (only the first V columns are real). losses[n] = -log softmax(logits[n])[targets[n]].
// If grad_scale != 0, logits is overwritten in place with grad_scale * (softmax - onehot), and the
// padded columns V..Vp-1 with zero: the gradient of grad_scale * sum(losses).
template <typename T>
void crossentropy_forward(T* losses, T* logits, const int* targets, int N, int V, int Vp, T grad_scale);

}  // namespace keel::ops
