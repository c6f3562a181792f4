// CPU kernels of a mixture-of-experts layer (model/moe.h): the router's softmax and top-k choice,
// the routing plan that sorts a micro-batch's (token, choice) pairs by expert, the gather into
// and the weighted combine out of that order, grouped products (one product per expert over its
// contiguous rows, never one per token) and the Switch/GShard balancing loss taken per sequence.
// Same conventions as kernels/cpu/ops.h: shapes above each kernel, templated on the scalar (double
// for finite-difference tests), `_backward_weight` kernels accumulate, the others overwrite unless
// said; fixed summation orders, so results are bit-identical run to run.
#pragma once

#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace keel::moe {

// ---- router -------------------------------------------------------------------------------------
// probs[N, E] = softmax over each row of logits[N, E] (probs may be logits: in place).
template <typename T>
void router_softmax_forward(T* probs, const T* logits, int N, int E);
// dlogits[N, E] = p * (dprobs - sum_e p dprobs), row by row (overwrites; dlogits may be dprobs).
template <typename T>
void router_softmax_backward(T* dlogits, const T* dprobs, const T* probs, int N, int E);
// choice[N, k]: each row's k most probable experts, most probable first (ties: the lower index).
// With bias[E] (model.moe_balance = "bias"), the k largest probs + bias instead.
template <typename T>
void top_k(int32_t* choice, const T* probs, int N, int E, int k, const T* bias = nullptr);
// DeepSeek's auxiliary-loss-free balancing, after an optimizer step: bias[e] += rate x sign(mean
// load - load[e]) for the E experts' loads (pairs routed to each over the step, every rank's).
void update_balance_bias(float* bias, const double* load, int E, float rate);

// ---- routing plan: the (token, choice) pairs sorted by expert -----------------------------------
// From choice[N = B*T, k]: per expert e its rows offsets[e] .. offsets[e+1] (offsets: E + 1 ints)
// of the sorted order; row m holds pair rows[m] = n * k + j (token n, its j-th choice), pairs of
// an expert in token order; slot[n * k + j] = that row, or -1 when the pair was dropped. capacity
// (0 = none, dropless): an expert takes at most `capacity` pairs of each sequence (T consecutive
// tokens), the earliest positions first. Returns the number of dropped pairs.
// With kept_before [B, segments, E] (a sequence's rows are `segments` equal runs of positions that
// are not consecutive in the whole sequence, e.g. a context rank's chunks): run g of sequence b
// starts expert e's count at kept_before[(b segments + g) E + e], the pairs of e the sequence's
// earlier positions kept elsewhere, instead of at 0 (the same plan as over the whole sequence).
int64_t plan_routing(int32_t* offsets, int32_t* rows, int32_t* slot, const int32_t* choice, int B, int T, int k,
                     int E, int capacity, const int32_t* kept_before = nullptr, int segments = 1);

// xs[M, C] = x[rows[m] / k, :]: each sorted row's token.
template <typename T>
void gather_rows(T* xs, const T* x, const int32_t* rows, int M, int k, int C);
// dx[N, C] += sum_j dxs[slot[n * k + j], :] over the pairs not dropped, j in order.
template <typename T>
void scatter_add_rows(T* dx, const T* dxs, const int32_t* slot, int N, int k, int C);

// ---- combine: y[n] += sum_j p[n, choice[n, j]] ye[slot[n, j]] ------------------------------------
// y[N, C] (+=), ye[M, C] the experts' outputs in sorted order, probs[N, E], choice/slot [N, k].
template <typename T>
void combine_forward(T* y, const T* ye, const T* probs, const int32_t* choice, const int32_t* slot, int N, int k,
                     int E, int C);
// dye[M, C] (overwritten; rows of dropped pairs do not exist) = p dy[n]; dprobs[N, E] (+=) at each
// chosen expert: dot(dy[n], ye[row]).
template <typename T>
void combine_backward(T* dye, T* dprobs, const T* dy, const T* ye, const T* probs, const int32_t* choice,
                      const int32_t* slot, int N, int k, int E, int C);

// ---- grouped linear: out[m, :] = inp[m, :] @ w[e]^T for the rows m of expert e ------------------
// inp[M, C], w[e] [OC, C] for each of the E experts (one matrix each, anywhere), out[M, OC],
// offsets[E + 1] (M = offsets[E]); experts without rows skipped (their w[e] not read).
template <typename T>
void grouped_linear_forward(MatmulPrecision precision, T* out, const T* inp, const T* const* w, const int32_t* offsets,
                            int E, int C, int OC);
// dinp[M, C] (overwritten) = dout[M, OC] @ w[e] per expert.
template <typename T>
void grouped_linear_backward_input(MatmulPrecision precision, T* dinp, const T* dout, const T* const* w,
                                   const int32_t* offsets, int E, int C, int OC);
// dw[e] [OC, C] += dout[rows of e]^T @ inp[rows of e] (experts without rows: dw[e] untouched).
template <typename T>
void grouped_linear_backward_weight(MatmulPrecision precision, T* const* dw, const T* dout, const T* inp,
                                    const int32_t* offsets, int E, int C, int OC);

// ---- balancing loss (Switch Transformer / GShard), per sequence ---------------------------------
// For each of the B sequences of T tokens: aux = E sum_e f_e P_e with f_e the share of the
// sequence's T k choices that picked e (before any drop) and P_e the mean router probability of e
// over its tokens. Returns the sum over the B sequences.
template <typename T>
double aux_loss_forward(const T* probs, const int32_t* choice, int B, int Tn, int E, int k);
// dprobs[N, E] += scale * E * f_e / T: the gradient of scale * (the sum aux_loss_forward returns).
template <typename T>
void aux_loss_backward(T* dprobs, const int32_t* choice, int B, int Tn, int E, int k, T scale);
// The same with the shares given: f[B, E], each sequence's share of its choices per expert (where
// a sequence's choices are counted elsewhere, e.g. summed over a context group's ranks).
template <typename T>
void aux_loss_backward_shares(T* dprobs, const double* f, int B, int Tn, int E, T scale);

}  // namespace keel::moe
