// One training step of a Keel config on a described cluster (sim/cluster.h), predicted: the
// model `keel simulate` runs.
//
// What it models, and through which of Keel's own pieces:
//  * Layout: data x pipeline x tensor. Data and pipeline are the config's (parallel.data,
//    parallel.pipeline, zero, schedule, micro-batches; the stage cut is Keel's own startup_cut);
//    tensor (the config's parallel.tensor, as Keel runs it, or SimLayout::tensor for a layout
//    Keel is not given): Megatron's split of each block, with two all-reduces of a micro-batch's
//    activations in its forward and two in its backward, the vocabulary-parallel embedding's in
//    forward and the head's input gradient's in backward, and the vocabulary-parallel
//    cross-entropy's three of one value per token, inside a node: the all-reduces Keel's trainer
//    makes (comm/tensor_parallel.h), and the clipping norm's one value per step before the
//    optimizer. Ranks are placed tensor-fastest, then data, then pipeline: a tensor group stays in
//    a node, a data group does while tensor x data fits one. Expert parallelism (the config's
//    parallel.expert): per mixture-of-experts block and micro-batch, the expert group's exchanges
//    Keel's trainer makes (comm/expert_parallel.h, model/moe.cpp): in forward the routing counts,
//    the sorted rows out to their experts' ranks (overlapped with the shared experts' forward) and
//    the outputs back; in backward the output gradients out (overlapped with the shared experts'
//    hidden gradient) and the input gradients back; rows at balanced routing (N x top-k a rank),
//    each exchange at the cluster's all-to-all figures (sim/cluster.h Network).
//  * Compute: each layer's matrix products (qkv, the attention's batched products per head, the
//    projection, the MLP's; the head's vocabulary product) at the device's share of the peak for
//    their shapes (Device::gemm_share at the smallest dimension; a roofline below: never faster
//    than the bytes through device memory), times the stack's kernel_efficiency; the rest of the
//    layer's FLOPs (pipeline/layout.h layer_costs, the FLOP model the static partitioner cuts by)
//    at the largest shape's share. B and W each cost what F does (Keel's split of backward); with
//    activation recomputation (train.recompute, or --recompute: full on every block) B runs a
//    recomputing block's F again (full) or its attention's share of it (selective), and a
//    zero-bubble schedule's W, apart from its B, rebuilds that and runs B again; each block's
//    elementwise work (the stack's elementwise_values of the width per token in F, twice that in
//    B) at the device's memory bandwidth, and the stack's fixed block_pass_ms once in F and once
//    in B (a recomputed F: again). Or each layer's F, B, W as a Keel run measured them
//    (SimLayout::layer_costs), for a cluster of the machine that measured them.
//  * The pipeline: Keel's schedule (pipeline/schedule.h make_schedule) replayed by Keel's schedule
//    simulator on those stage costs, a message between stages costing its bytes over the link
//    that joins them (NVLink inside a node, the device's NIC share across nodes) plus latency:
//    bubble included.
//  * Data-parallel sync: each device's gradients (the stack's bytes per element) as Keel's GradSync
//    buckets them (by layer and codec; the stack's bucket size, else bucket_bytes), each bucket by
//    the stack's collective algorithm (sim/collective.h: Keel's flat ring over the data group's
//    slowest link, or NCCL's ring or tree) (ZeRO-2 and -3 reduce-scatter: half of it; ZeRO-1
//    all-reduces like ZeRO-0; ZeRO-1 and -2 all-gather the parameters after the optimizer,
//    exposed; ZeRO-3 gathers each layer's parameters for every micro-batch's forward and backward
//    and reduce-scatters every micro-batch's gradients, exposed where they outlast the compute).
//    Overlap (where the stack overlaps its reduction) follows
//    the last micro-batch's backward layer by layer: a layer's collectives queue on the link once
//    its W is done (GPT-2's tied embedding completes last); what runs past the backward is exposed.
//    With a pipeline, GPT-2's tied embedding is summed between its first and last stage every
//    step. The optimizer: AdamW's bytes (and the clipping norm's) through device memory.
//  * Variability: the step waits for its slowest device: jitter as the expected maximum of the
//    devices' normal spread, stragglers as their slowdown. Reliability: the share of time lost
//    to failures (half a checkpoint interval and a restart per failure, at the cluster's rate).
//  * Memory per device: the stack's bytes per parameter (Keel: float32 parameters and gradients,
//    AdamW moments; ZeRO shards the state at 1, gradients at 2, parameters at 3), activations in
//    flight as Keel lays them out (GPT::slot_bytes_for times the schedule's proven peak in flight,
//    under the recomputation asked, and the set recomputing blocks share) or, for a stack laid out
//    as Megatron-LM, by megatron_activation_bytes; each divided over the tensor group.
//  * Compressed sync (sync.codec, HybridGC): each chunk's codec by Keel's policy, its encoded size
//    by the codec itself, and CompressedAllreduce's shape (two-phase or gather) give the bytes
//    sent (sync_wire_ratio); the codecs' compute at the cluster file's [codecs] rates (measured
//    by `keel simulate --probe yes`; not costed where the file gives none) runs on the training
//    thread, never hidden. The uncompressed warm-up steps are not modelled.
//  * Per step, the cluster's step_overhead_ms (what a profiling run measured beyond the model).
//  * Memory tiers (SimLayout::tiers or the config's tier.device_mib): sim/tier_model.h; the
//    rank's stall waiting for pages and the host's update of host-homed moments join the step.
//  * Checkpoints: each interval's snapshot of parameters and moments off the device (PCIe),
//    amortized over the steps; its write to the node's NVMe drives in the background.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "model/model_layout.h"
#include "pipeline/schedule.h"
#include "sim/cluster.h"
#include "sim/stack.h"
#include "sim/tier_model.h"

namespace keel::sim {

struct SimLayout {
  int tensor = 1;          // tensor-parallel degree (the config's parallel.tensor when that is > 1)
  bool recompute = false;  // full activation recomputation of every block (where train.recompute is "none")
  // Measured per-layer F, B, W (ms per micro-batch of this config's size, on one device: a run's
  // metrics.jsonl layer_costs line, pipeline/layer_profile.h) in place of the FLOP model at the
  // device's peak; their sequence length is carried to the config's by the FLOP model. Empty:
  // the FLOP model.
  std::string layer_costs;
  // Memory tiers (sim/tier_model.h): pages homed on device, host and NVMe by Keel's placement
  // within the cluster's memories. Also on where the config's tier.device_mib is set.
  bool tiers = false;
  int tier_chunks = 1024;  // the tier model's chunks per rank at most (TierInputs::max_chunks)
  // The data-parallel sync overlaps the backward layer by layer, as Keel's GradSync does. false:
  // it starts after the backward (a peer that reduces gradients at the end of the step, as
  // Megatron-LM's 2021 runs did; `keel simulate --overlap-sync no`).
  bool overlap_sync = true;
  // The software stack whose run is predicted (sim/stack.h; `keel simulate --stack`): its kernels'
  // share of the GEMM rates, gradient reduction (bytes, buckets, overlap, collective algorithm)
  // and memory layout. Default: Keel's own.
  StackProfile stack{};
};

struct MemoryPerDevice {
  double params_gib = 0, grads_gib = 0, optimizer_gib = 0, activations_gib = 0;
  double total_gib() const { return params_gib + grads_gib + optimizer_gib + activations_gib; }
};

struct StepPrediction {
  int data = 1, pipeline = 1, tensor = 1, devices = 1;
  int micro_batches = 1, micro_batch = 1;  // per replica and step; sequences per micro-batch
  int64_t sequences = 0;                   // per step, over the replicas
  std::string cut;                         // the stages' first layers
  // Milliseconds of one step, and its parts (compute: the busiest pipeline rank's F + B + W;
  // bubble: the rest of the pipeline's span; tensor / pipeline comm are inside F and B and the
  // span; sync: the data-parallel sync left exposed after overlap).
  double step_ms = 0, span_ms = 0, compute_ms = 0, bubble_ms = 0, tensor_comm_ms = 0, pipeline_comm_ms = 0;
  double sync_ms = 0, sync_codec_ms = 0, sync_exposed_ms = 0, optimizer_ms = 0, variability_ms = 0;
  std::string stack = "keel";           // the software stack predicted
  std::string sync_algorithm = "none";  // the data-parallel all-reduce's algorithm (sim/collective.h)
  // Bytes one rank of the first stage's tensor group hands to the group's all-reduces per step, as
  // Keel's trainer counts them (metrics.jsonl tensor_allreduce_bytes: sums' floats at 4 bytes, the
  // cross-entropy's maxima at 8): per micro-batch of N tokens, 4 N C per block on the stage (2 N C
  // in forward, 2 N C in backward) and 2 N C per block recomputed in full but the stage's last,
  // N C for the embedding (first stage) and N C + 2 N floats + N doubles for the head and loss
  // (last stage). 0 without tensor parallelism. (Zero-bubble schedules' W re-running a recomputed
  // block are not counted.)
  double tensor_allreduce_bytes = 0;
  // Expert parallelism: the expert group's size, and the bytes one rank sends in its exchanges per
  // step as Keel's trainer counts them (metrics.jsonl expert_alltoall_bytes, its own rows included):
  // per MoE block and micro-batch of N tokens, 4 E bytes of routing counts and four exchanges of
  // N x top-k rows of C floats (balanced routing: what a rank receives is what it sends); a block
  // recomputed in full exchanges its forward's again (but a stage's last recomputing block).
  // expert_comm_ms: the exchanges' time per step on the critical path (inside F and B).
  int expert = 1;
  double expert_alltoall_bytes = 0, expert_comm_ms = 0;
  // The busiest rank's float32 parameter bytes as it holds them (metrics.jsonl param_bytes under
  // expert parallelism: with sharded experts, E / P routed experts a block), and the bytes its
  // data-parallel sync sends per step as GradSync counts them (sync_sent_bytes: 2 (n-1)/n of each
  // plain bucket over its group, a sharded expert's over the data / P ranks holding it, none where
  // data = P; ZeRO-2's reduce-scatter half that; compressed buckets their encodings), and ZeRO-1/2's
  // all-gather of the updated parameters after the optimizer (param_gather_bytes: (n-1)/n of each
  // parameter over the ranks that share it out, a sharded expert's over its holders; not in the
  // trainer's sync_sent_bytes).
  double param_bytes = 0, sync_sent_bytes = 0, param_gather_bytes = 0;
  double bubble = 0;              // the schedule's idle share
  double sync_wire_ratio = 1;     // bytes sent over what a ring all-reduce of float32 gradients sends (HybridGC)
  double samples_per_s = 0, tokens_per_s = 0;
  double model_tflops_per_device = 0;  // model FLOPs (3 x forward, no recomputation) per second per device
  double mfu = 0;                 // of the device peak at the run's precision
  double goodput = 1;             // share of wall time not lost to failures
  MemoryPerDevice memory;
  bool fits = true;               // memory within the device's (with tiers: the pages could be placed)
  TierPrediction tiers;           // memory tiers' traffic and stalls (enabled: tiers on)
  double checkpoint_share = 0;    // share of the step spent on checkpoints' snapshots (amortized)
  pipeline::Timeline timeline;    // replica 0's step (Chrome trace)
};

// `config` resolved for cluster.devices() / layout.tensor ranks (resolve_job_config).
StepPrediction predict_step(const Config& config, const Cluster& cluster, const SimLayout& layout);

// Milliseconds of layer `i`'s forward (0 the embedding, 1..n_layer the blocks, n_layer + 1 the
// head) on one device for `tokens` tokens in sequences of T, split over `tp` tensor ranks: each
// matrix product at the device's share of `peak` FLOP/s for its shape (Device::gemm_share at its
// smallest dimension, never faster than its bytes through device memory) times the stack's
// kernel_efficiency; the layer's other FLOPs at the share of the largest shape.
double layer_forward_ms(const ModelConfig& m, int i, double tokens, int T, int tp, const Device& device, double peak,
                        double act_bytes, double kernel_efficiency);

// Activation bytes one device holds under Megatron-LM's layout (Korthikanti et al. 2022): per block
// and micro-batch, by recomputation mode, sequence parallelism and fused attention; `in_flight`
// micro-batches on the busiest of `stages`; plus the head's float32 logits.
double megatron_activation_bytes(const ModelConfig& m, const std::vector<LayerRange>& stages, Recompute mode, int micro_batch,
                                 int T, int tp, int in_flight, bool sequence_parallel, bool flash);

// Parameters per layer (embedding, blocks, head) as Keel's model registers them: GPT-2's tied
// head holds none of its own. `expert_shards` > 1: a rank's, with its mixture-of-experts blocks'
// routed experts sharded over that many ranks (E / expert_shards each; comm/expert_parallel.h).
std::vector<double> layer_params(const ModelConfig& model, int expert_shards = 1);

}  // namespace keel::sim
