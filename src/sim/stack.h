// A software stack as `keel simulate --stack NAME` models it (configs/sim/stacks.toml): what the
// stack's own code adds to or takes from the device's GEMM rates, how it reduces gradients, and how
// it lays out memory. Keel itself ("keel", the default) is built in: the model as calibrated on
// this machine. Every number of a stack file is a named key; a missing, unknown or impossible key is
// one error naming the file and the key.
#pragma once

#include <string>

namespace keel::sim {

// How a stack's collectives are run (sim/collective.h): "ring" (OpenMPI's all-reduce as Keel's
// collective probe measured it: one flat ring over every rank), "nccl" (NCCL's choice: the cheaper
// of its ring laid out node by node and its double binary tree across nodes) or "hierarchical"
// (reduce-scatter inside the node, all-reduce across nodes, all-gather inside: MPI's and Horovod's
// hierarchical all-reduce; also offered where it is cheaper than NCCL's two).
enum class CollectiveKind { ring, nccl, hierarchical };

struct StackProfile {
  std::string name = "keel";
  // The share of the device's GEMM rate at a shape (the cluster's gemm curve) the stack's training
  // kernels reach, end to end: clocks under the power cap, launch gaps, unfused epilogues.
  double kernel_efficiency = 1.0;
  bool overlap_grad_reduce = true;  // gradient reduction overlaps the backward
  double grad_reduce_bytes = 4;     // bytes per gradient element on the wire
  double bucket_mb = 0;             // gradient bucket, MB (0: the config's sync.bucket_bytes)
  CollectiveKind collective = CollectiveKind::ring;
  // Memory per parameter, bytes: the working parameters, the gradients, the optimizer's state
  // (fp32 master copy and AdamW moments). ZeRO shards them by stage (1: state, 2: + gradients,
  // 3: + parameters). Keel: float32 planes, 4 / 4 / 8.
  double param_bytes = 4, grad_bytes = 4, state_bytes = 8;
  // Activations: "keel" (Keel's own layout, sim/step_model.cpp) or "megatron" (the per-layer
  // formula of Korthikanti et al. 2022: bf16, fused attention, with or without sequence
  // parallelism).
  bool keel_activations = true;
  bool sequence_parallel = false;
  bool flash_attention = false;  // attention fused: its scores are not kept (Megatron layout)
  // Per token and block, the elementwise values read and written in the forward (norms,
  // activation, residual adds, biases), in units of the model width, at memory bandwidth.
  double elementwise_values = 36;
  // Per attention-score element ([b, a, T, T] per block), the bytes an unfused attention's
  // softmax, mask and dropout kernels read and write at memory bandwidth, in the forward and in
  // the backward (Megatron-LM 2021: fused scale-mask-softmax, 2 + 2, then torch dropout, 2 + 2 +
  // a 1-byte mask; backward: dropout 2 + 1 + 2, softmax 2 + 2 + 2). 0 with a flash kernel, whose
  // scores never reach memory. Keel's built-in profile: 0 (its attention is calibrated whole on
  // this machine, bench/simulate_calibration.py).
  double score_bytes_forward = 0, score_bytes_backward = 0;
  // Milliseconds each transformer block adds per pass over it (its forward, its recomputed
  // forward, its backward) beyond its kernels' device time, whatever the block's size: what the
  // stack's host side leaves exposed per block (eager dispatch of the block's kernels, a sharding
  // wrapper's per-unit hooks that wait on the device before issuing the next gather). It weighs
  // most where a block's device time is short: small micro-batches on a fast device. Keel's
  // built-in profile: 0 (its per-step overhead is measured whole, Device::step_overhead_ms).
  double block_pass_ms = 0;

  // The named stack of a stacks file ("keel" without a file: the built-in). Throws keel::Error
  // naming the file and the key.
  static StackProfile load(const std::string& path, const std::string& name);
  static StackProfile parse(const std::string& toml_text, const std::string& what, const std::string& name);
};

}  // namespace keel::sim
