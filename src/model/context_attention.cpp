#include "model/context_attention.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/ring_attention.h"

namespace keel {

namespace {

// This rank's rows [B, T, 2 kv] of k | v, packed for the ring.
void pack_kv(float* dst, const float* qkv, int64_t rows, int C, int kv) {
  const int C3 = C + 2 * kv;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * 2 * kv, qkv + r * C3 + C, sizeof(float) * 2 * kv);
}

void positions(std::vector<int>& pos, const ContextGroup& group, int T, int member) {
  pos.resize(T);
  for (int t = 0; t < T; ++t) pos[t] = group.position(t, T, member);
}

}  // namespace

ContextAttention& context_ring_attention() {
  static thread_local ContextAttention ring;
  return ring;
}

void ContextAttention::forward(ContextGroup& group, MatmulPrecision precision, float* out, float* lse,
                               const float* qkv, int B, int T, int C, int NH, int NKV, int window) {
  const int P = group.size(), r = group.rank(), kv = NKV * (C / NH);
  const int64_t rows = static_cast<int64_t>(B) * T, block = rows * 2 * kv;
  ops::RingBlock s;
  s.B = B, s.Tq = T, s.Tk = T, s.C = C, s.NH = NH, s.NKV = NKV, s.window = window, s.ldq = C + 2 * kv, s.ldkv = 2 * kv;
  positions(qpos_, group, T, r);
  s.qpos = qpos_.data();
  for (auto& b : blocks_) b.resize(block);
  acc_.resize(rows * C);
  m_.resize(rows * NH);
  l_.resize(rows * NH);
  pack_kv(blocks_[0].data(), qkv, rows, C, kv);
  ops::ring_attention_begin(acc_.data(), m_.data(), l_.data(), s);
  for (int step = 0; step < P; ++step) {
    const float* cur = blocks_[step % 2].data();
    if (step + 1 < P) group.start_shift(cur, blocks_[(step + 1) % 2].data(), block, 0);
    positions(kpos_, group, T, (r - step + P) % P);
    s.kpos = kpos_.data();
    if (ops::ring_block_visible(s)) {
      ops::ring_attention_forward_block(precision, acc_.data(), m_.data(), l_.data(), qkv, cur, cur + kv, s);
    }
    if (step + 1 < P) group.finish_shift(0);
  }
  ops::ring_attention_finish(out, lse, acc_.data(), m_.data(), l_.data(), s);
}

void ContextAttention::backward(ContextGroup& group, MatmulPrecision precision, float* dqkv, const float* dout,
                                const float* out, const float* lse, const float* qkv, int B, int T, int C, int NH,
                                int NKV, int window) {
  const int P = group.size(), r = group.rank(), kv = NKV * (C / NH), C3 = C + 2 * kv;
  const int64_t rows = static_cast<int64_t>(B) * T, block = rows * 2 * kv;
  ops::RingBlock s;
  s.B = B, s.Tq = T, s.Tk = T, s.C = C, s.NH = NH, s.NKV = NKV, s.window = window, s.ldq = C3, s.ldkv = 2 * kv;
  positions(qpos_, group, T, r);
  s.qpos = qpos_.data();
  for (auto& b : blocks_) b.resize(block);
  delta_.resize(rows * NH);
  mine_.resize(block);
  grad_in_.resize(block);
  grad_out_.resize(block);
  pack_kv(blocks_[0].data(), qkv, rows, C, kv);
  ops::ring_attention_delta(delta_.data(), dout, out, s);
  std::memset(dqkv, 0, sizeof(float) * rows * C3);  // dq accumulates over the blocks (dk, dv come back below)
  for (int step = 0; step < P; ++step) {
    const float* cur = blocks_[step % 2].data();
    if (step + 1 < P) group.start_shift(cur, blocks_[(step + 1) % 2].data(), block, 0);
    positions(kpos_, group, T, (r - step + P) % P);
    s.kpos = kpos_.data();
    // This rank's share of the block's gradient, then the sum so far (from r - 1, sent after its
    // previous step's share) added to it.
    const bool visible = ops::ring_block_visible(s);
    std::fill(mine_.begin(), mine_.end(), 0.0f);
    if (visible) {
      ops::ring_attention_backward_block(precision, dqkv, mine_.data(), mine_.data() + kv, dout, lse, delta_.data(),
                                         qkv, cur, cur + kv, s);
    }
    if (step > 0) {
      group.finish_shift(1);
      for (int64_t i = 0; i < block; ++i) mine_[i] = grad_in_[i] + mine_[i];
    }
    // The sum passes on to r + 1; after the last step, what arrives from r - 1 is this rank's own
    // block's whole gradient.
    std::swap(mine_, grad_out_);
    if (P > 1) group.start_shift(grad_out_.data(), grad_in_.data(), block, 1);
    if (step + 1 < P) group.finish_shift(0);
  }
  const float* own = grad_out_.data();  // P = 1: this rank's own sum
  if (P > 1) {
    group.finish_shift(1);
    own = grad_in_.data();
  }
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) std::memcpy(dqkv + row * C3 + C, own + row * 2 * kv, sizeof(float) * 2 * kv);
}

}  // namespace keel
