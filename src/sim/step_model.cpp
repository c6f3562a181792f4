#include "sim/step_model.h"

#include <algorithm>
#include <cmath>

#include "comm/codec.h"
#include "comm/expert_parallel.h"
#include "comm/sync_policy.h"
#include "core/error.h"
#include "model/gpt.h"
#include "sim/collective.h"
#include "pipeline/layer_profile.h"
#include "pipeline/layout.h"
#include "pipeline/partitioner.h"
#include "store/placement.h"

namespace keel::sim {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Milliseconds of a ring all-reduce of `bytes` over `ranks` (each sends and receives 2 (n-1)/n of
// it, in 2 (n-1) latency-bound rounds); `fraction` 0.5 for a reduce-scatter or an all-gather alone.
double ring_ms(double bytes, int ranks, double gbps, double latency_us, double fraction = 1.0) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const double n = ranks;
  return fraction * (2 * (n - 1) / n * bytes / (gbps * 1e9) * 1e3 + 2 * (n - 1) * latency_us * 1e-3);
}

// The expected largest of n draws of a unit normal (a bound good from n of a few on).
double expected_max_normal(int n) { return n <= 1 ? 0.0 : std::sqrt(2.0 * std::log(static_cast<double>(n))); }

// One rank's data-parallel sync of the gradients of `ranges` (float32, divided over `tp` tensor
// ranks) among `ranks` replicas over a link of `gbps` GB/s and `latency_us`: milliseconds on the
// wire, the codecs' compute, and bytes sent against float32 bytes. Buckets and codecs as Keel's
// GradSync cuts them: plain buckets by MPI's all-reduce (a ring; ZeRO: reduce-scatter, then the
// parameters' all-gather), compressed ones (HybridGC, sync.codec) by CompressedAllreduce in its
// two shapes: two-phase sends 2 (N-1)/N of each encoding and encodes (1 + 1/N) and decodes 2
// buffers' worth; gather sends (N-1) encodings, encodes one and decodes N.
struct SyncCost {
  double ms = 0, codec_ms = 0, raw_bytes = 0, wire_bytes = 0;
  // Of wire_bytes: ZeRO's all-gathers of the parameters (the rest is GradSync's, which the
  // trainer's sync_sent_bytes counts); of raw_bytes: sharded experts' (summed over their holders).
  double gather_bytes = 0, expert_raw_bytes = 0;
  // Of raw_bytes (ZeRO-3's gathers count them per lease): the embedding layer's own chunks, and a
  // pipeline head stage's replica of a tied embedding.
  double first_layer_raw = 0, replica_raw = 0;
  // ms's parts: each layer's collectives (index as pipeline/layout.h's layers: 0 the embedding,
  // 1..n_layer the blocks, n_layer + 1 the head), which can start once the layer's gradient is
  // complete; and what only runs after the optimizer (ZeRO's all-gather of parameters).
  std::vector<double> layer_ms;
  double after_ms = 0;
  // ZeRO-3: the parameters' gathers before each layer's forward and backward, which prefetching
  // hides under compute; what outlasts the compute is exposed.
  double gather_ms = 0;
  std::string algorithm = "none";  // the algorithm of the whole gradient's all-reduce
};

SyncCost sync_cost(const Config& config, const std::vector<LayerRange>& ranges, int tp, const CollectiveGroup& data_group,
                   const StackProfile& stack, const CodecRates& rates) {
  SyncCost out;
  out.layer_ms.assign(static_cast<size_t>(config.model.n_layer + 2), 0.0);
  if (data_group.ranks <= 1) return out;
  // Sharded experts (comm/expert_parallel.h): a rank holds E / P routed experts, each summed over
  // the data / P ranks holding it (consecutive expert groups: every P-th data rank).
  const int shards = experts_sharded(config) ? std::max(1, config.parallel.expert) : 1;
  CollectiveGroup expert_group = data_group;
  expert_group.ranks = std::max(1, data_group.ranks / shards);
  expert_group.per_node = std::max(1, std::min(expert_group.ranks, data_group.per_node / shards));
  const bool flat = stack.collective == CollectiveKind::ring;
  // (the group's figures; an expert's chunks are rebound to expert_group below)
  const CollectiveGroup* g = &data_group;
  int ranks = 0;
  double n = 0, gbps = 0, rs_gbps = 0, ag_gbps = 0, latency_us = 0, round_ms = 0;
  auto bind = [&](const CollectiveGroup& to) {
    g = &to, ranks = to.ranks, n = to.ranks;
    gbps = to.nodes() <= 1 ? to.intra_gbps : to.device_gbps;
    // (a flat ring across nodes: the library's reduce-scatter and all-gather at their own rates)
    rs_gbps = to.nodes() > 1 && to.device_rs_gbps > 0 ? to.device_rs_gbps : gbps;
    ag_gbps = to.nodes() > 1 && to.device_ag_gbps > 0 ? to.device_ag_gbps : gbps;
    latency_us = to.nodes() <= 1 ? to.intra_latency_us : to.inter_latency_us;
    // Each bucket's collective pays its rounds' latency: 2 (N-1) for a ring (two-phase and the
    // all-gather of gather alike, within a factor 2 for the latter).
    round_ms = 2 * (n - 1) * latency_us * 1e-3;
  };
  bind(data_group);
  const int64_t bucket = stack.bucket_mb > 0 ? static_cast<int64_t>(stack.bucket_mb * 1e6)
                                             : std::max<int64_t>(config.parallel.bucket_bytes, 1);
  // Bytes on the wire per float32 byte of gradient (a stack reducing bf16 gradients sends half).
  const double wire = stack.grad_reduce_bytes / sizeof(float);
  // A registry of the rank's tensors (nothing allocated), in the config's chunks; a large model's
  // at no fewer bytes than give 4,096 of them (codec sizes are linear in elements but a header).
  const bool compressed = sync_compressed(config.sync);
  double bytes = 0;
  const std::vector<double> params = layer_params(config.model, shards);
  for (const LayerRange& r : ranges) {
    for (int i = r.first; i <= r.last; ++i) bytes += params[static_cast<size_t>(i)] * sizeof(float);
  }
  ChunkStore registry(std::max<int64_t>(config.store.chunk_bytes, static_cast<int64_t>(bytes / 4096) / 4096 * 4096));
  register_layout(registry, model_layout(config.model, ranges, {}, ExpertPlace{0, shards}));
  registry.finalize_layout();
  const std::vector<CodecParams> codecs =
      compressed ? sync_chunk_codecs(config.sync, config.model.n_layer, registry) : std::vector<CodecParams>{};
  // GradSync's buckets: consecutive chunks of one layer and codec, up to bucket_bytes each.
  double run_bytes = 0, run_plain = 0;
  int run_layer = -1;
  bool run_expert = false;
  CodecKind run_kind = CodecKind::none;
  const size_t last = out.layer_ms.size() - 1;
  auto layer_of = [&](int chunk_layer) { return std::min(static_cast<size_t>(std::max(chunk_layer, 0)), last); };
  // ZeRO-2 and -3 reduce-scatter the gradients (half a ring, under backward); ZeRO-1 all-reduces
  // them as ZeRO-0 does (GradSync scatters only for ZeRO-2). ZeRO-1 and -2 then all-gather the
  // updated parameters after the optimizer (half a ring, exposed); ZeRO-3 gathers each layer's
  // parameters before its forward and again before its backward (gather_ms, prefetched).
  const double plain_overlap = config.parallel.zero >= 2 ? 0.5 : 1.0;
  auto close_run = [&] {
    if (run_bytes <= 0) return;
    const double buckets = std::ceil(run_bytes / static_cast<double>(bucket));
    if (flat) {
      out.layer_ms[layer_of(run_layer)] += buckets * round_ms;
    } else if (run_plain > 0) {  // the stack's algorithm per bucket, bandwidth and latency together
      out.layer_ms[layer_of(run_layer)] +=
          buckets * allreduce(run_plain * wire / buckets, *g, stack.collective, plain_overlap).ms;
    }
    run_bytes = 0, run_plain = 0;
  };
  const std::vector<Chunk>& chunks = registry.chunks();
  for (size_t k = 0; k < chunks.size(); ++k) {
    const Chunk& c = chunks[k];
    // A bucket reduces its chunks' whole span, the alignment padding after each tensor included
    // (GradSync's bucket numel), as the trainer counts it.
    const int64_t span = (k + 1 < chunks.size() ? chunks[k + 1].offset : registry.numel()) - c.offset;
    const double raw = static_cast<double>(span) * sizeof(float) / tp;
    const bool expert = shards > 1 && c.expert >= 0;
    const CodecParams p = compressed ? codecs[static_cast<size_t>(c.id)] : CodecParams{};
    // (GradSync's buckets never mix an expert's chunks with others)
    if (expert != run_expert || ((compressed || !flat) && (c.layer != run_layer || p.kind != run_kind))) close_run();
    run_expert = expert;
    bind(expert ? expert_group : data_group);
    if (ranks <= 1) continue;  // an expert held by this rank alone: nothing to sum
    out.raw_bytes += raw;
    if (expert) out.expert_raw_bytes += raw;
    if (!expert && c.replica) {
      out.replica_raw += raw;
    } else if (!expert && c.layer == 0) {
      out.first_layer_raw += raw;
    }
    run_layer = c.layer, run_kind = p.kind, run_bytes += raw;
    if (p.kind == CodecKind::none) {
      const double sent = plain_overlap * 2 * (n - 1) / n * raw * wire;
      out.wire_bytes += sent;
      if (flat) {  // (ZeRO-2/3: the reduce-scatter alone)
        out.layer_ms[layer_of(c.layer)] += sent / ((config.parallel.zero >= 2 ? rs_gbps : gbps) * 1e9) * 1e3;
      } else {
        run_plain += raw;
      }
      continue;
    }
    const std::unique_ptr<Codec> codec = Codec::make(p);
    const double encoded = static_cast<double>(codec->max_encoded_bytes(static_cast<size_t>(c.numel))) / tp;
    const bool sparse = codec->data_dependent_positions() || p.kind == CodecKind::randk ||
                        (p.kind == CodecKind::sign1 && p.keep < 1.0);
    const bool two_phase = !sparse && (config.sync.shape == SumShape::two_phase || (config.sync.shape == SumShape::automatic && ranks > 2));
    const double sent = two_phase ? 2 * (n - 1) / n * encoded : (n - 1) * encoded;
    out.wire_bytes += sent;
    const int kind = static_cast<int>(p.kind);
    const double enc = rates.encode_gbps[kind], dec = rates.decode_gbps[kind];
    const double encoded_share = two_phase ? 1 + 1 / n : 1.0, decoded_share = two_phase ? 2.0 : n;
    if (enc > 0) out.codec_ms += encoded_share * raw / (enc * 1e9) * 1e3;
    if (dec > 0) out.codec_ms += decoded_share * raw / (dec * 1e9) * 1e3;
    out.layer_ms[layer_of(c.layer)] += sent / (gbps * 1e9) * 1e3;
  }
  close_run();
  bind(data_group);
  out.algorithm = to_string(allreduce(out.raw_bytes * wire, data_group, stack.collective).algorithm);
  const double param_wire = stack.param_bytes / sizeof(float);  // a gathered parameter's bytes per float32 byte
  if (config.parallel.zero == 1 || config.parallel.zero == 2) {  // every parameter, gathered after the optimizer
    // (sharded experts' over the ranks holding them, the rest over the data group: comm/zero.h)
    auto gather = [&](const CollectiveGroup& over, double raw) {
      if (raw <= 0) return;
      bind(over);
      const double sent = (n - 1) / n * raw * param_wire;
      out.after_ms += flat ? sent / (ag_gbps * 1e9) * 1e3 + std::ceil(raw / static_cast<double>(bucket)) * (n - 1) * latency_us * 1e-3
                           : allreduce(raw * param_wire, over, stack.collective, 0.5).ms;
      out.gather_bytes += sent;
    };
    gather(data_group, out.raw_bytes - out.expert_raw_bytes);
    gather(expert_group, out.expert_raw_bytes);
    bind(data_group);
    out.wire_bytes += out.gather_bytes;
  } else if (config.parallel.zero >= 3) {
    // Every micro-batch's leases gather what they read (model/gpt.cpp, head.cpp): a block's and the
    // head's parameters before the forward and again before the backward-input pass; the
    // embedding's once, before the forward (its backward reads no parameter), and twice more
    // where the head is tied to it on the same stage (the head's two leases hold the embedding's
    // chunks); a pipeline head stage's replica of the tied embedding twice (the head's leases).
    // gather_ms is one micro-batch's (the step multiplies it), gather_bytes the step's. Sharded
    // experts' over the ranks holding them, the rest over the data group.
    const ModelConfig& model = config.model;
    const bool tied = model.llama() ? model.tie_embeddings.value_or(false) : true;
    const double first_passes = 1.0 + (tied && config.parallel.pipeline <= 1 ? 2.0 : 0.0);
    const double micro = static_cast<double>(pipeline::micro_batches(config));
    const double calls = 2.0 * static_cast<double>(out.layer_ms.size());  // about one gather per lease
    auto gather = [&](const CollectiveGroup& over, double raw) {
      if (raw <= 0) return;
      bind(over);
      out.gather_ms += calls * allreduce(raw * param_wire / calls, over, stack.collective, 0.5).ms;
      out.gather_bytes += micro * (n - 1) / n * raw * param_wire;
    };
    const double others = out.raw_bytes - out.expert_raw_bytes - out.first_layer_raw - out.replica_raw;
    gather(data_group, 2 * others + first_passes * out.first_layer_raw + 2 * out.replica_raw);
    gather(expert_group, 2 * out.expert_raw_bytes);
    bind(data_group);
    out.wire_bytes += out.gather_bytes;
  }
  out.ms = out.after_ms + out.gather_ms;
  for (double ms : out.layer_ms) out.ms += ms;
  return out;
}

// Checkpoints: every interval (reliability.checkpoint_every_minutes, else Keel's 15) a rank's
// `bytes` (its parameters and moments) are snapshot off the device over PCIe (exposed), then
// written in the background to the node's NVMe drives (exposed only where a write outlasts the
// interval). The share of the step they cost.
double checkpoint_share(const Cluster& cluster, double bytes) {
  const double interval_ms = (cluster.reliability.checkpoint_every_minutes > 0 ? cluster.reliability.checkpoint_every_minutes : 15) * 60e3;
  double per_checkpoint = bytes / (cluster.host.pcie_gbps * 1e9) * 1e3;
  if (cluster.host.nvme_drives > 0) {
    const double write_ms = bytes / (cluster.host.nvme_drives * cluster.host.nvme_gbps * 1e9 / cluster.devices_per_node) * 1e3;
    per_checkpoint += std::max(0.0, write_ms - interval_ms);
  }
  return std::min(0.5, per_checkpoint / interval_ms);
}

}  // namespace

// Milliseconds of layer `i`'s forward on one device for `tokens` tokens (sequences of T) split
// over `tp` tensor ranks: each matrix product at the device's share of the peak for its shape
// (Device::gemm_share at its smallest dimension; a roofline: never faster than its operands' and
// result's bytes through device memory), times the stack's kernel efficiency. A block's products:
// qkv, the attention's two batched products per head (T x T x head size), the output projection,
// the MLP's two (GPT-2) or three (LLaMA); the head's vocabulary product; the rest of the layer's
// FLOPs (pipeline/layout.h layer_costs) at the largest shape's share.
double layer_forward_ms(const ModelConfig& m, int i, double tokens, int T, int tp, const Device& device, double peak,
                        double act_bytes, double kernel_efficiency) {
  const std::vector<double> flops = pipeline::layer_costs(m, T);
  const double total = flops[static_cast<size_t>(i)] * tokens / tp;  // FLOPs
  if (device.gemm_efficiency.empty()) return total / (peak * device.matmul_efficiency * kernel_efficiency) * 1e3;
  double ms = 0, counted = 0;
  auto gemm = [&](double M, double N, double K, double count) {
    const double f = 2 * M * N * K * count;
    const double compute = f / (peak * device.gemm_share(std::min({M, N, K})) * kernel_efficiency);
    const double memory = (M * K + K * N + M * N) * act_bytes * count / (device.hbm_gbps * 1e9);
    ms += std::max(compute, memory) * 1e3, counted += f;
  };
  const double C = m.n_embd, V = m.padded_vocab_size, hs = m.head_size();
  if (i >= 1 && i <= m.n_layer) {
    const double qkv = m.llama() ? m.qkv_dim() : 3 * C, ffn = m.llama() ? m.ffn_hidden : 4 * C;
    gemm(tokens, qkv / tp, C, 1);
    const double heads = static_cast<double>(m.n_head) / tp * tokens / T;  // (sequence, head) pairs
    gemm(T, T, hs, heads), gemm(T, hs, T, heads);
    gemm(tokens, C, C / tp, 1);
    if (m.moe_block(i - 1)) {  // the router; each expert's rows (balanced routing); the shared experts
      const double E = m.moe_experts, Hm = m.moe_hidden, rows = tokens * m.moe_top_k / E;
      const double shared = std::max(0, m.moe_shared_experts) * Hm;
      gemm(tokens, E, C, 1);
      gemm(rows, 2 * Hm, C, E), gemm(rows, C, Hm, E);
      if (shared > 0) gemm(tokens, 2 * shared, C, 1), gemm(tokens, C, shared, 1);
    } else {
      gemm(tokens, ffn / tp, C, m.llama() ? 2 : 1);
      gemm(tokens, C, ffn / tp, 1);
    }
  } else if (i == m.n_layer + 1) {
    gemm(tokens, V / tp, C, 1);
  }
  const double rest = std::max(0.0, total - counted);
  return ms + rest / (peak * device.gemm_share(1e9) * kernel_efficiency) * 1e3;
}

// Bytes of activations one device of a stack laid out as Megatron-LM lays them holds: per block
// and micro-batch s b h (10 + 24 / t + 5 a s / (h t)) in 16-bit values (Korthikanti et al. 2022,
// "Reducing Activation Recomputation in Large Transformer Models", eq. 2), 34 / t + 5 a s / (h t)
// with sequence parallelism (eq. 4); the attention scores' 5 a s / (h t) not kept with a fused
// (flash) attention or selective recomputation (eq. 6); 2 s b h (/ t with sequence parallelism)
// per block with full recomputation, plus one block's full set while it is recomputed; `in_flight`
// micro-batches on the busiest stage (1F1B: the pipeline degree); the head's float32 logits.
double megatron_activation_bytes(const ModelConfig& m, const std::vector<LayerRange>& stages, Recompute mode, int micro_batch,
                                 int T, int tp, int in_flight, bool sequence_parallel, bool flash) {
  const double s = T, b = micro_batch, h = m.n_embd, a = m.n_head, t = tp;
  const double scores = flash ? 0.0 : 5 * a * s / (h * t);
  const double kept = sequence_parallel ? 34 / t : 10 + 24 / t;
  const double whole = kept + scores;
  const double per_block = mode == Recompute::full ? (sequence_parallel ? 2 / t : 2.0) : mode == Recompute::selective ? kept : whole;
  int blocks = 0;
  for (const LayerRange& r : stages) {
    int n = 0;
    for (int i = r.first; i <= r.last; ++i) n += i >= 1 && i <= m.n_layer;
    blocks = std::max(blocks, n);
  }
  double bytes = s * b * h * per_block * blocks * in_flight;
  if (mode == Recompute::full) bytes += s * b * h * whole;
  return bytes + s * b * m.padded_vocab_size / t * 4;
}

std::vector<double> layer_params(const ModelConfig& m, int expert_shards) {
  const double C = m.n_embd, Vp = m.padded_vocab_size;
  std::vector<double> out;
  out.push_back(Vp * C + (m.llama() ? 0.0 : static_cast<double>(m.max_seq_len) * C));
  const double block = m.llama() ? 2 * C + m.qkv_dim() * C + C * C + 3.0 * m.ffn_hidden * C : 12 * C * C + 13 * C;
  // A mixture-of-experts block holds every expert (and the router, the shared experts) in place of the MLP.
  // (Sharded experts: the rank's E / expert_shards routed experts.)
  const double routed = static_cast<double>(m.moe_experts) / std::max(1, expert_shards);
  const double moe_block = block - 3.0 * m.ffn_hidden * C + m.moe_experts * C +
                           3.0 * m.moe_hidden * C * (routed + std::max(0, m.moe_shared_experts));
  for (int l = 0; l < m.n_layer; ++l) out.push_back(m.moe_block(l) ? moe_block : block);
  out.push_back(m.llama() ? C + (m.tie_embeddings.value_or(false) ? 0.0 : Vp * C) : 2 * C);
  return out;
}

StepPrediction predict_step(const Config& config, const Cluster& cluster, const SimLayout& layout) {
  const ModelConfig& m = config.model;
  const ParallelConfig& par = config.parallel;
  const TrainConfig& t = config.train;
  StepPrediction r;
  check(par.tensor == 1 || layout.tensor == 1 || par.tensor == layout.tensor,
        "simulate --tensor: expected the config's parallel.tensor (" + std::to_string(par.tensor) + ") or 1, found " +
            std::to_string(layout.tensor));
  r.tensor = std::max(par.tensor, layout.tensor);
  r.pipeline = par.pipeline;
  r.devices = cluster.devices();
  check(r.tensor >= 1 && cluster.devices() % r.tensor == 0,
        "simulate --tensor: expected a divisor of the cluster's " + std::to_string(cluster.devices()) + " devices, found " +
            std::to_string(r.tensor));
  check(r.tensor <= cluster.devices_per_node,
        "simulate --tensor: a tensor group stays inside a node of " + std::to_string(cluster.devices_per_node) +
            " devices, found " + std::to_string(r.tensor));
  check(m.n_head % r.tensor == 0, "simulate --tensor: expected a divisor of model.n_head = " +
                                      std::to_string(m.n_head) + ", found " + std::to_string(r.tensor));
  r.data = cluster.devices() / r.tensor / par.pipeline;
  check(r.data >= 1 && r.data * par.pipeline * r.tensor == cluster.devices(),
        "simulate: data x pipeline x tensor must use the cluster's " + std::to_string(cluster.devices()) + " devices");
  const int D = r.data, P = par.pipeline, TP = r.tensor;
  const int T = t.longest_seq_len();
  r.micro_batches = pipeline::micro_batches(config);
  r.micro_batch = t.batch_size * t.grad_accum / r.micro_batches;
  r.sequences = static_cast<int64_t>(t.batch_size) * t.grad_accum * D;
  const bool bf16 = config.runtime.precision == Precision::bf16;
  const double peak = (bf16 ? cluster.device.tflops_bf16 : cluster.device.tflops_fp32) * 1e12;
  const StackProfile& stack = layout.stack;
  const double act_bytes = bf16 ? 2 : 4;                        // an activation element between devices

  // Stages and their per-micro-batch costs.
  const std::vector<LayerRange> stages = pipeline::startup_cut(config);
  r.cut = pipeline::boundaries_of(stages);
  const std::vector<double> flops = pipeline::layer_costs(m, T);  // forward FLOPs per token
  const double tokens = static_cast<double>(r.micro_batch) * T;
  const double activation = tokens * m.n_embd * act_bytes;  // one micro-batch's [b, T, C]
  const double tp_ar = ring_ms(activation, TP, cluster.intra.gbps, cluster.intra.latency_us);
  const double tp_embed = tp_ar;  // the embedding's forward, the head's backward: one [b, T, C] each
  // The vocabulary-parallel cross-entropy's two sums (model/tensor_group.cpp): the rows' maxima (N
  // doubles), then their sums of exponentials and target logits together (2 N floats).
  const double tp_loss = TP > 1 ? 2 * ring_ms(tokens * 8, TP, cluster.intra.gbps, cluster.intra.latency_us) : 0.0;
  // Expert parallelism: each exchange of a mixture-of-experts block, one rank's view. A rank sends
  // N x top-k rows (balanced routing; its own experts' share stays on the rank) and receives as many.
  const int EP = std::max(1, par.expert);
  r.expert = EP;
  auto alltoall_ms = [&](double bytes) {
    if (EP <= 1) return 0.0;
    const double off = bytes * (EP - 1.0) / EP;
    if (cluster.network.alltoall_gbps > 0) {
      return cluster.network.alltoall_latency_us * 1e-3 + off / (cluster.network.alltoall_gbps * 1e9) * 1e3;
    }
    const bool inside = TP * EP <= cluster.devices_per_node;  // (expert groups: consecutive data ranks)
    const double gbps = inside ? cluster.intra.gbps : cluster.network.device_gbps(cluster.devices_per_node);
    const double lat = inside ? cluster.intra.latency_us : cluster.network.latency_us;
    return (EP - 1.0) * lat * 1e-3 + off / (gbps * 1e9) * 1e3;
  };
  const double ep_rows_bytes = tokens * m.moe_top_k * m.n_embd * 4.0;  // float32 rows, any precision
  const double ep_counts = alltoall_ms(4.0 * m.moe_experts), ep_rows = alltoall_ms(ep_rows_bytes);
  double ep_per_step = 0;
  pipeline::LayerCosts measured;
  if (!layout.layer_costs.empty()) {
    measured = pipeline::read_layer_costs(layout.layer_costs, m.n_layer + 2).at_seq_len(m, T);
  }
  pipeline::Costs costs;
  double tp_per_rank_max = 0;
  // Activation recomputation (train.recompute, or every block in full with --recompute): a
  // recomputing block's B runs its forward again (full) or its attention (selective: attention's
  // share of the forward's FLOPs); a zero-bubble schedule's W, which does not follow its B,
  // rebuilds that and runs B again (GPT::backward_weight).
  RecomputePlan recompute = recompute_plan(t, m.n_layer);
  if (layout.recompute && recompute.mode == Recompute::none) recompute = RecomputePlan{Recompute::full, 0, m.n_layer - 1};
  const bool w_apart = par.schedule == ScheduleKind::zb_h1 || par.schedule == ScheduleKind::zb_h2 ||
                       par.schedule == ScheduleKind::zb_v;
  const double attention_share = m.n_layer > 0 ? 4.0 * T * m.n_embd / flops[1] : 0.0;
  // Each layer's F, B (with its recomputed F) and W per micro-batch, tensor all-reduces included:
  // the sync's overlap and the tier model follow them layer by layer.
  const size_t layers = static_cast<size_t>(m.n_layer + 2);
  std::vector<double> layer_f(layers, 0.0), layer_b(layers, 0.0), layer_w(layers, 0.0);
  for (const LayerRange& s : stages) {
    double f = 0, b = 0, w = 0;
    double stage_f = 0, stage_b = 0, stage_w = 0;  // the layers' below, summed
    int blocks = 0;
    double tp_again = 0;  // the all-reduces of recomputed F's (and re-run B's)
    for (int i = s.first; i <= s.last; ++i) {
      const double f_before = f, b_before = b, w_before = w;
      if (measured.layers() > 0) {
        f += measured.forward[i] / TP, b += measured.backward_input[i] / TP, w += measured.backward_weight[i] / TP;
      } else {
        const double ms = layer_forward_ms(m, i, tokens, T, TP, cluster.device, peak, act_bytes, stack.kernel_efficiency);
        f += ms, b += ms, w += ms;
        if (i >= 1 && i <= m.n_layer) {  // a block's elementwise passes, bound by device memory
          const double pass = stack.elementwise_values * m.n_embd * tokens * act_bytes / TP / (cluster.device.hbm_gbps * 1e9) * 1e3;
          f += pass, b += 2 * pass;
          // An unfused attention's score passes (softmax, mask, dropout): a / TP heads of T x T
          // scores per sequence, at memory bandwidth. The share that grows with T / C: what makes
          // small models at sequence 2048 slower per FLOP than large ones (Megatron-LM 2021).
          const double scores = static_cast<double>(m.n_head) / TP * tokens * T;
          f += scores * stack.score_bytes_forward / (cluster.device.hbm_gbps * 1e9) * 1e3;
          b += scores * stack.score_bytes_backward / (cluster.device.hbm_gbps * 1e9) * 1e3;
          // The stack's fixed cost per block and pass (its forward; its backward, B and W one
          // pass; a recomputed forward repeats F's below).
          f += stack.block_pass_ms, b += stack.block_pass_ms;
        }
      }
      const bool block = i >= 1 && i <= m.n_layer;
      blocks += block;
      // The vocabulary-parallel embedding sums each token's row (forward); the head's input
      // gradient is summed in backward, and the cross-entropy's sums run in forward.
      if (i == 0) f += tp_embed;
      if (i == m.n_layer + 1) f += tp_loss, b += tp_embed;
      if (block && EP > 1 && m.moe_block(i - 1)) {
        // The rows' dispatch runs beside the shared experts' forward (their share of the block's
        // FLOPs), the combine after the local experts; in backward the gradients' dispatch beside
        // the shared experts' down-projection input gradient, the combine after.
        const double shared = std::max(0, m.moe_shared_experts) * static_cast<double>(m.moe_hidden) * m.n_embd;
        const double hide_f = (f - f_before) * 6 * shared / flops[i], hide_b = (b - b_before) * 2 * shared / flops[i];
        const double ef = ep_counts + std::max(0.0, ep_rows - hide_f) + ep_rows;
        const double eb = std::max(0.0, ep_rows - hide_b) + ep_rows;
        f += ef, b += eb;
        if (s.first == stages.front().first) ep_per_step += (ef + eb) * r.micro_batches;
      }
      const Recompute mode = recompute.at_layer(i);
      if (block && mode != Recompute::none) {
        tp_again += (mode == Recompute::full ? 2 * tp_ar : 0.0) +
                    (w_apart ? 2 * tp_ar + (mode == Recompute::full ? 2 * tp_ar : 0.0) : 0.0);
      }
      const double layer_fi = f - f_before + (block ? 2 * tp_ar : 0.0);
      const double again = mode == Recompute::full ? layer_fi : mode == Recompute::selective ? (f - f_before) * attention_share : 0.0;
      const double layer_bi = b - b_before + (block ? 2 * tp_ar : 0.0);
      layer_f[static_cast<size_t>(i)] = layer_fi;
      layer_b[static_cast<size_t>(i)] = layer_bi + again;
      layer_w[static_cast<size_t>(i)] = w - w_before + (w_apart && mode != Recompute::none ? again + layer_bi : 0.0);
      stage_f += layer_f[static_cast<size_t>(i)], stage_b += layer_b[static_cast<size_t>(i)];
      stage_w += layer_w[static_cast<size_t>(i)];
    }
    // Two all-reduces per block in F, two in B; the embedding's and the head's and loss's.
    const double tp = 4 * blocks * tp_ar + (s.first == 0 ? tp_embed : 0.0) +
                      (s.last == m.n_layer + 1 ? tp_embed + tp_loss : 0.0);
    costs.forward.push_back(stage_f);
    costs.backward_input.push_back(stage_b);
    costs.backward_weight.push_back(stage_w);
    tp_per_rank_max = std::max(tp_per_rank_max, (tp + tp_again) * r.micro_batches);
  }
  if (TP > 1) {
    // The bytes the trainer counts (its first stage's group's), in floats of 4 bytes and the
    // cross-entropy's maxima in doubles; a recomputed block's forward all-reduces again, but the
    // last recomputing block's on a stage: its activations are still the shared set's.
    const LayerRange& s = stages.front();
    const double N = tokens, C = m.n_embd;
    double floats = 0, doubles = 0;
    int recomputed = 0;
    for (int i = std::max(s.first, 1); i <= std::min(s.last, m.n_layer); ++i) {
      floats += 4 * N * C;
      // A MoE block's router probability gradient (its partial sums over the split experts), once
      // in the backward pass: N x E floats.
      if (m.moe_block(i - 1)) floats += N * m.moe_experts;
      recomputed += recompute.at_layer(i) == Recompute::full;
    }
    floats += 2 * N * C * std::max(0, recomputed - 1);
    if (s.first == 0) floats += N * C;
    if (s.last == m.n_layer + 1) floats += N * C + 2 * N, doubles += N;
    r.tensor_allreduce_bytes = r.micro_batches * (4 * floats + 8 * doubles);
  }
  if (EP > 1) {
    // The bytes the trainer counts on a rank of the first stage: per MoE block the counts and four
    // row exchanges; a block recomputed in full exchanges its forward again (counts and two), but
    // the stage's last recomputing block.
    const LayerRange& s = stages.front();
    double bytes = 0;
    int recomputed = 0;
    for (int i = std::max(s.first, 1); i <= std::min(s.last, m.n_layer); ++i) {
      if (!m.moe_block(i - 1)) continue;
      bytes += 4.0 * m.moe_experts + 4 * ep_rows_bytes;
      recomputed += recompute.at_layer(i) == Recompute::full;
    }
    bytes += (4.0 * m.moe_experts + 2 * ep_rows_bytes) * std::max(0, recomputed - 1);
    r.expert_alltoall_bytes = r.micro_batches * bytes;
    r.expert_comm_ms = ep_per_step;
  }
  // A stage boundary crosses nodes once a stage's tensor x data devices fill one.
  const bool pp_across = TP * D >= cluster.devices_per_node && P > 1;
  const double pp_gbps = pp_across ? cluster.network.device_gbps(cluster.devices_per_node) : cluster.intra.gbps;
  const double pp_lat = pp_across ? cluster.network.latency_us : cluster.intra.latency_us;
  costs.comm = P > 1 ? activation / TP / (pp_gbps * 1e9) * 1e3 + pp_lat * 1e-3 : 0.0;
  const pipeline::Schedule schedule =
      pipeline::make_schedule({par.schedule, P, r.micro_batches, pipeline::virtual_stages(par)});

  // Data-parallel sync and the optimizer, on the rank with the most parameters (sharded experts:
  // its E / P routed experts a block).
  const std::vector<double> params = layer_params(m, experts_sharded(config) ? EP : 1);
  double most = 0;
  int most_rank = 0;
  std::vector<double> rank_params(static_cast<size_t>(P), 0.0);
  for (size_t s = 0; s < stages.size(); ++s) {
    for (int i = stages[s].first; i <= stages[s].last; ++i) rank_params[schedule.stage_rank[s]] += params[i] / TP;
  }
  if (!m.llama() && P > 1) {  // GPT-2's head stage keeps a replica of the tied wte
    rank_params[schedule.stage_rank[stages.size() - 1]] += params[0] / TP;
  }
  for (int p = 0; p < P; ++p) {
    if (rank_params[p] > most) most = rank_params[p], most_rank = p;
  }
  // The data group: ranks are placed tensor-fastest, so a node holds devices_per_node / TP of its
  // members (all of them while tensor x data fits a node); the node's NICs are shared by the
  // groups with members in it.
  CollectiveGroup group;
  group.ranks = D;
  group.per_node = std::min(D, std::max(1, cluster.devices_per_node / TP));
  group.intra_gbps = cluster.intra.gbps, group.intra_latency_us = cluster.intra.latency_us;
  group.device_gbps = cluster.network.device_gbps(cluster.devices_per_node);
  group.node_gbps = group.device_gbps * group.per_node, group.inter_latency_us = cluster.network.latency_us;
  group.device_rs_gbps = cluster.network.device_gbps(cluster.devices_per_node, cluster.network.reduce_scatter_gbit);
  group.device_ag_gbps = cluster.network.device_gbps(cluster.devices_per_node, cluster.network.allgather_gbit);
  std::vector<LayerRange> heaviest;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (schedule.stage_rank[s] == most_rank) heaviest.push_back(stages[s]);
  }
  const SyncCost sync = sync_cost(config, heaviest, TP, group, stack, cluster.codecs);
  r.sync_algorithm = sync.algorithm;
  r.stack = stack.name;
  r.sync_wire_ratio = sync.raw_bytes > 0 && D > 1 ? sync.wire_bytes / (2 * (D - 1.0) / D * sync.raw_bytes) : 1.0;
  r.sync_ms = sync.ms;
  r.sync_codec_ms = sync.codec_ms;
  r.sync_sent_bytes = sync.wire_bytes - sync.gather_bytes;
  r.param_gather_bytes = sync.gather_bytes;
  r.param_bytes = most * sizeof(float);
  // AdamW: parameter, gradient, two moments read; parameter, moments and the zeroed gradient
  // written; the clipping norm's read of the gradient before it (float32).
  const double shard = par.zero > 0 ? 1.0 / D : 1.0;
  r.optimizer_ms = most * shard * 36 / (cluster.device.hbm_gbps * 1e9) * 1e3;
  // With a tensor group, the clipping norm's squares are summed over it first (tensor_grad_squares:
  // one blocking all-reduce of a double per step, before AdamW: on the critical path).
  const double tp_norm = ring_ms(8, TP, cluster.intra.gbps, cluster.intra.latency_us);
  r.optimizer_ms += tp_norm;
  // Sharded experts: the experts' squares are summed over the expert group (expert_grad_squares:
  // one blocking all-reduce of a double per step), on its data ranks' link.
  if (experts_sharded(config)) {
    const bool inside = TP * EP <= cluster.devices_per_node;
    r.optimizer_ms += inside ? ring_ms(8, EP, cluster.intra.gbps, cluster.intra.latency_us)
                             : ring_ms(8, EP, cluster.network.device_gbps(cluster.devices_per_node), cluster.network.latency_us);
  }
  // The last micro-batch's backward on that rank, layer by layer from the last: each layer's
  // collectives queue on the link once its W is done (GradSync starts a bucket as soon as its
  // chunks' gradients are complete; a tied embedding's only at the very end); what runs past the
  // end of backward is exposed, and ZeRO's all-gather after the optimizer is exposed whole.
  const bool overlap = layout.overlap_sync && stack.overlap_grad_reduce;
  double bw_end = 0, link_free = 0;
  std::vector<bool> visited(sync.layer_ms.size(), false);
  for (size_t s = stages.size(); s-- > 0;) {
    if (schedule.stage_rank[s] != most_rank) continue;
    for (int i = stages[s].last; i >= stages[s].first; --i) {
      bw_end += layer_b[static_cast<size_t>(i)] + layer_w[static_cast<size_t>(i)];
      visited[static_cast<size_t>(i)] = true;
      const double ms = sync.layer_ms[static_cast<size_t>(i)];
      // (overlap_sync false: every collective waits for the end of backward)
      if (ms > 0 && overlap) link_free = std::max(link_free, bw_end) + ms;
    }
  }
  for (size_t i = 0; i < visited.size(); ++i) {
    // Gradients of layers this rank holds only as replicas (GPT-2's tied embedding on the head
    // stage) are complete at the end of its backward.
    const bool late = !visited[i] || !overlap;
    if (late && sync.layer_ms[i] > 0) link_free = std::max(link_free, bw_end) + sync.layer_ms[i];
  }
  r.sync_exposed_ms = std::max(0.0, link_free - bw_end) + sync.after_ms + r.sync_codec_ms;
  if (!m.llama() && P > 1) {
    // GPT-2's tied embedding lives on the first stage and as a replica on the head's: the two
    // copies' gradients are summed between those ranks every step, once both backwards are done:
    // one blocking all-reduce (PipelineStep::sum_tied_grads), at a blocking all-reduce's rate.
    const double tied_gbps =
        pp_across ? cluster.network.device_gbps(cluster.devices_per_node, cluster.network.blocking_allreduce_gbit) : pp_gbps;
    // The group's tensor is wte alone (the position embedding is the first stage's own).
    const double tied = ring_ms(static_cast<double>(m.padded_vocab_size) * m.n_embd / TP * 4, 2, tied_gbps, pp_lat);
    r.sync_ms += tied;
    r.sync_exposed_ms += tied;
  }
  costs.grad_sync = r.sync_exposed_ms;
  costs.optimizer = r.optimizer_ms;
  r.timeline = pipeline::simulate(schedule, costs);

  // The step: the pipeline's span (F, B, W, messages, bubble), then exposed sync and optimizer.
  double span_end = 0, busiest = 0;
  for (int p = 0; p < P; ++p) busiest = std::max(busiest, r.timeline.busy[p]);
  for (const std::vector<pipeline::Interval>& rank : r.timeline.per_rank) {
    for (const pipeline::Interval& iv : rank) {
      if (iv.instr.op != pipeline::Op::grad_sync && iv.instr.op != pipeline::Op::optimizer) span_end = std::max(span_end, iv.end);
    }
  }
  r.span_ms = span_end;
  r.compute_ms = busiest;
  if (sync.gather_ms > 0) {
    // ZeRO-3 gathers each layer's parameters for every micro-batch's forward and backward, and
    // reduce-scatters every micro-batch's gradients (the last one's is costed above): prefetched
    // under the compute, exposed where they outlast it.
    double layers_ms = 0;
    for (double ms : sync.layer_ms) layers_ms += ms;
    const double more = sync.gather_ms * r.micro_batches + layers_ms * (r.micro_batches - 1);
    r.sync_ms += more - sync.gather_ms;
    r.sync_exposed_ms += std::max(0.0, more - busiest);
  }
  r.bubble = r.timeline.bubble;
  r.bubble_ms = std::max(0.0, r.span_ms - r.compute_ms);
  r.tensor_comm_ms = tp_per_rank_max + tp_norm;
  r.pipeline_comm_ms = P > 1 ? 2.0 * r.micro_batches * costs.comm : 0.0;
  // Memory of the rank with the most parameters: the stack's bytes per parameter (Keel's float32
  // planes), sharded by ZeRO's stage; activations in flight.
  r.memory.params_gib = most * stack.param_bytes * (par.zero >= 3 ? 1.0 / D : 1.0) / kGiB;
  r.memory.grads_gib = most * stack.grad_bytes * (par.zero >= 2 ? 1.0 / D : 1.0) / kGiB;
  r.memory.optimizer_gib = most * stack.state_bytes * shard / kGiB;
  double in_flight = 0;
  if (stack.keel_activations) {
    // Activations as Keel lays them out under the recomputation asked: the slots in flight (each
    // keeping what its blocks' mode keeps) and the one set the recomputing blocks share.
    Config laid_out = config;
    laid_out.train.recompute = recompute.mode;
    laid_out.train.recompute_layers = std::to_string(recompute.first_block) + "-" + std::to_string(recompute.last_block);
    if (recompute.mode == Recompute::none) laid_out.train.recompute_layers = "all";
    const pipeline::Plan plan = pipeline::plan(laid_out, stages, r.micro_batches);
    in_flight = static_cast<double>(*std::max_element(plan.check.peak_bytes.begin(), plan.check.peak_bytes.end()));
    double shared = 0;
    for (const LayerRange& s : stages) {
      shared = std::max(shared, static_cast<double>(GPT::recomputed_bytes_for(m, s, r.micro_batch, T, bf16, recompute)));
    }
    in_flight = (in_flight + shared) / TP;
  } else {
    in_flight = megatron_activation_bytes(m, stages, recompute.mode, r.micro_batch, T, TP, std::min(r.micro_batches, P),
                                          stack.sequence_parallel, stack.flash_attention);
  }
  r.memory.activations_gib = in_flight / kGiB;
  r.fits = r.memory.total_gib() <= cluster.device.memory_gib;
  if (layout.tiers || tiering_enabled(config.tier)) {
    // Memory tiers: the rank's pages placed by Keel's placement within what the device leaves
    // beside the activations, the step's acquires replayed under the tier manager's policy.
    TierInputs in;
    in.forward = layer_f, in.backward_input = layer_b, in.backward_weight = layer_w;
    in.stages = stages, in.schedule = &schedule, in.timeline = &r.timeline, in.rank = most_rank;
    in.data = D, in.tensor = TP, in.activations_gib = r.memory.activations_gib, in.max_chunks = layout.tier_chunks;
    r.tiers = predict_tiers(config, cluster, in);
    r.fits = true;  // (placement threw where the pages cannot be placed)
  }
  r.checkpoint_share = checkpoint_share(cluster, most * (4 + 8 * shard));
  const double base = std::max(0.0, r.span_ms + r.sync_exposed_ms + r.optimizer_ms + cluster.device.step_overhead_ms +
                                        r.tiers.stall_ms + r.tiers.host_optimizer_ms) / (1 - r.checkpoint_share);
  // The step waits for its slowest device.
  double slow = 1 + cluster.variability.jitter * expected_max_normal(cluster.devices());
  if (cluster.variability.straggler_fraction * cluster.devices() >= 1) slow *= cluster.variability.straggler_slowdown;
  r.variability_ms = base * (slow - 1);
  r.step_ms = base * slow;

  r.samples_per_s = static_cast<double>(r.sequences) / (r.step_ms * 1e-3);
  r.tokens_per_s = r.samples_per_s * T;
  double forward_per_token = 0;
  for (double f : flops) forward_per_token += f;
  const double model_flops = 3 * forward_per_token * static_cast<double>(r.sequences) * T;
  r.model_tflops_per_device = model_flops / (r.step_ms * 1e-3) / cluster.devices() / 1e12;
  r.mfu = r.model_tflops_per_device * 1e12 / peak;
  // Failures: each costs half a checkpoint interval of work and a restart, at the cluster's rate.
  if (cluster.reliability.node_mtbf_hours > 0) {
    const double interval_h = (cluster.reliability.checkpoint_every_minutes > 0 ? cluster.reliability.checkpoint_every_minutes : 15) / 60;
    const double lost_h = interval_h / 2 + cluster.reliability.restart_minutes / 60;
    r.goodput = std::max(0.0, 1 - cluster.nodes / cluster.reliability.node_mtbf_hours * lost_h);
  }
  return r;
}

}  // namespace keel::sim
