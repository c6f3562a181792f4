// The pieces of ring attention (context parallelism): blockwise causal attention of a rank's
// queries over key/value blocks that arrive one at a time, each from another rank. The forward
// merges one block into running online-softmax statistics (the unnormalised output, each row's
// running maximum and sum), and a finish turns them into the output and its log-sum-exp, the same
// function as flash_attention_forward (kernels/cpu/ops.h) over all the blocks' keys together.
// The backward, given the finished output and log-sum-exp, adds one block's share to the local
// queries' gradient and produces that block's key and value gradients, which travel back to the
// block's owner.
//
// Positions are global token positions (a rank's queries are two mirrored chunks of the sequence,
// not one contiguous range): query position i attends to key position j when j <= i and, with a
// window w > 0, j > i - w. Both position lists are shared by every batch row.
//
// Layouts: q rows of NH heads of hs = C / NH columns, row stride ldq, batch row b's rows start at
// b * Tq * ldq (a qkv buffer's q part: ldq = C + 2 * NKV * hs). Keys and values likewise, NKV heads,
// row stride ldkv, batch stride Tk * ldkv (a qkv buffer's k and v parts, or a packed block
// [B, Tk, 2 * NKV * hs] of k | v). Query head h reads key/value head h / (NH / NKV).
// Work is split into tasks whose sums run in a fixed order: the same bytes for any thread count.
// Float blocks run on the blockwise kernel's vector path (kernels/cpu/attention.h) where it runs
// these shapes (AVX-512, head sizes a multiple of 16); elsewhere, and for double, a tile at a time
// through BLAS products.
#pragma once

#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace keel::ops {

// The shapes of one (local queries, key/value block) pair.
struct RingBlock {
  int B = 0;        // batch rows
  int Tq = 0;       // local query rows
  int Tk = 0;       // the block's key rows
  int C = 0;        // query width (NH * hs)
  int NH = 0;       // query heads
  int NKV = 0;      // key/value heads (divides NH)
  int window = 0;   // 0: causal; > 0: a sliding window of that many keys
  int64_t ldq = 0;  // row strides of q, of k and v, of dq, of dk and dv
  int64_t ldkv = 0;
  const int* qpos = nullptr;  // [Tq] the queries' global positions
  const int* kpos = nullptr;  // [Tk] the keys' global positions
};

// The least and greatest of n >= 1 positions, and whether some query of range q may attend to some
// key of range k (exact for ranges of consecutive positions, conservative otherwise: the element
// mask decides). Tiles whose ranges do not meet are never read.
struct PositionRange {
  int lo, hi;
};
PositionRange position_range(const int* pos, int n);
inline bool ranges_meet(PositionRange q, PositionRange k, int window) {
  return k.lo <= q.hi && (window <= 0 || k.hi > q.lo - window);
}

// Whether any query may attend to any key of the block (a ring step that is not, is skipped).
bool ring_block_visible(const RingBlock& s);

// acc[B, Tq, C] = 0, m[B, NH, Tq] = -inf, l[B, NH, Tq] = 0: statistics before the first block.
template <typename T>
void ring_attention_begin(T* acc, T* m, T* l, const RingBlock& s);

// Merges one block into the statistics: for each row, the allowed keys' scores q k / sqrt(hs),
// acc += exp(score - m) v with acc and l rescaled when the row's maximum m grows.
template <typename T>
void ring_attention_forward_block(MatmulPrecision precision, T* acc, T* m, T* l, const T* q, const T* k, const T* v,
                                  const RingBlock& s);

// out[B, Tq, C] = acc / l, lse[B, NH, Tq] = m + log(l). Every row must have met an allowed key.
template <typename T>
void ring_attention_finish(T* out, T* lse, const T* acc, const T* m, const T* l, const RingBlock& s);

// delta[B, NH, Tq] = rowsum(dout * out) per head, once per backward (dout and out [B, Tq, C]).
template <typename T>
void ring_attention_delta(T* delta, const T* dout, const T* out, const RingBlock& s);

// One block's share of the backward: with p = exp(q k / sqrt(hs) - lse) on allowed pairs,
// dq += ds k (dq: q's layout, ldq), dk += ds^T q and dv += p^T dout (dk, dv: k's layout, ldkv),
// ds = p (dout v^T - delta) / sqrt(hs). The caller zeroes dq once and dk, dv per block.
template <typename T>
void ring_attention_backward_block(MatmulPrecision precision, T* dq, T* dk, T* dv, const T* dout, const T* lse,
                                   const T* delta, const T* q, const T* k, const T* v, const RingBlock& s);

}  // namespace keel::ops
