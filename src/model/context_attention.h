// Ring attention over a context group (model/context_group.h): blockwise causal attention of this
// rank's T / C rows of each sequence against every rank's keys and values, the same function as
// flash_attention_forward / flash_attention_backward_input (kernels/cpu/ops.h) over the whole
// sequence, restricted to this rank's rows.
//
// Forward: C steps; at step s the rank holds the key/value block of member r - s, starts passing
// it on to r + 1 (receiving r - s - 1's) and merges it into its rows' online-softmax statistics
// (kernels/cpu/ring_attention.h) while the block travels. A block wholly masked for this rank's
// rows (causal: every key after every query; outside a sliding window) is passed on unread.
// Backward: the key/value blocks travel the same way, and beside them each block's key/value
// gradient: the rank adds its share to the sum received from r - 1 and passes it on, so after C
// steps every block's gradient, summed over every rank's queries in ring order, is back with its
// owner. Every rank makes the same calls in the same order (collective over the group).
#pragma once

#include <vector>

#include "kernels/cpu/bf16.h"
#include "model/context_group.h"

namespace keel {

class ContextAttention {
 public:
  // out[B, T, C] and lse[B, NH, T] from qkv[B, T, C + 2 NKV hs] (T: this rank's rows, q and k
  // already rotated at their global positions), window as flash_attention_forward's.
  void forward(ContextGroup& group, MatmulPrecision precision, float* out, float* lse, const float* qkv, int B, int T,
               int C, int NH, int NKV, int window);
  // dqkv (overwritten, qkv's shape) from dout[B, T, C] and the forward's out, lse and qkv.
  void backward(ContextGroup& group, MatmulPrecision precision, float* dqkv, const float* dout, const float* out,
                const float* lse, const float* qkv, int B, int T, int C, int NH, int NKV, int window);

 private:
  // Working buffers, kept between calls (their size is one layer's: every block of a model uses
  // the same shapes): two key/value blocks, the statistics, the travelling gradients.
  std::vector<float> blocks_[2], acc_, m_, l_, delta_, grad_in_, grad_out_, mine_;
  std::vector<int> qpos_, kpos_;
};

// The working buffers every block's attention shares (one attention runs at a time on a thread).
ContextAttention& context_ring_attention();

}  // namespace keel
