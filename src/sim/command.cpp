#include "sim/command.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "runtime/job_config.h"
#include "sim/search.h"
#include "sim/step_model.h"

namespace keel::sim {

namespace {

void print_text(const Config& config, const Cluster& cluster, const StepPrediction& p, const std::string& trace) {
  const MemoryPerDevice& mem = p.memory;
  const ModelConfig& m = config.model;
  std::printf("keel simulate: %s (L=%d C=%d V=%d, T=%d) on %s: %d nodes x %d %s = %d devices\n", m.preset.c_str(),
              m.n_layer, m.n_embd, m.vocab_size, config.train.longest_seq_len(), cluster.name.c_str(), cluster.nodes,
              cluster.devices_per_node, cluster.device.name.c_str(), p.devices);
  std::printf("layout: data %d x pipeline %d x tensor %d%s, ZeRO-%d, "
              "schedule %s, %d micro-batches of %d sequences, stages cut at %s\n",
              p.data, p.pipeline, p.tensor,
              p.tensor > 1 && config.parallel.tensor == 1 ? " (--tensor: a split this config does not run)" : "",
              config.parallel.zero, to_string(config.parallel.schedule), p.micro_batches,
              p.micro_batch, p.cut.empty() ? "(one stage)" : p.cut.c_str());
  std::printf("software stack: %s; data-parallel all-reduce: %s\n", p.stack.c_str(), p.sync_algorithm.c_str());
  std::printf("step %.1f ms: compute %.1f, bubble %.1f (%.1f %%), tensor comm %.1f (inside compute), pipeline messages "
              "%.1f, data-parallel sync %.1f on the wire (%.0f %% of float32's bytes) + %.1f codecs, %.1f exposed, optimizer %.1f, "
              "slowest device +%.1f\n",
              p.step_ms, p.compute_ms, p.bubble_ms, 100 * p.bubble, p.tensor_comm_ms, p.pipeline_comm_ms, p.sync_ms,
              100 * p.sync_wire_ratio, p.sync_codec_ms, p.sync_exposed_ms, p.optimizer_ms, p.variability_ms);
  std::printf("throughput: %.1f samples/s, %.0f tokens/s, %.1f model TFLOP/s per device, MFU %.1f %%%s\n",
              p.samples_per_s, p.tokens_per_s, p.model_tflops_per_device, 100 * p.mfu,
              p.goodput < 1 ? (", goodput " + std::to_string(static_cast<int>(100 * p.goodput + 0.5)) + " % after failures").c_str() : "");
  std::printf("memory per device: parameters %.2f GiB, gradients %.2f, AdamW moments %.2f, activations %.2f: %.2f of "
              "%.0f GiB (%s)\n",
              mem.params_gib, mem.grads_gib, mem.optimizer_gib, mem.activations_gib, mem.total_gib(),
              cluster.device.memory_gib,
              p.tiers.enabled ? "the planes homed over device, host and NVMe: below" : p.fits ? "fits" : "DOES NOT FIT");
  const TierPrediction& t = p.tiers;
  if (t.enabled) {
    const int d = static_cast<int>(Tier::device), h = static_cast<int>(Tier::host), n = static_cast<int>(Tier::nvme);
    std::printf("memory tiers: pages homed device %.2f GiB (of %.2f left beside activations), host %.2f, NVMe %.2f; per step "
                "%.2f GiB read from host, %.2f from NVMe, %.2f written back to host, %.2f to NVMe; stall %.1f ms, host "
                "optimizer %.1f ms\n",
                t.home_gib[d], t.device_budget_gib, t.home_gib[h], t.home_gib[n], t.bytes_read[h] / (1 << 30),
                t.bytes_read[n] / (1 << 30), t.bytes_written[h] / (1 << 30), t.bytes_written[n] / (1 << 30), t.stall_ms,
                t.host_optimizer_ms);
    std::printf("first touches served: device %.1f %%, host %.1f %%, NVMe %.1f %%; hit rate by home: host %.1f %%, NVMe %.1f %%\n",
                100 * t.served_share(Tier::device), 100 * t.served_share(Tier::host), 100 * t.served_share(Tier::nvme),
                100 * t.hit_rate(Tier::host), 100 * t.hit_rate(Tier::nvme));
    for (const std::string& note : t.notes) std::printf("placement: %s\n", note.c_str());
  }
  if (p.tensor > 1) {
    std::printf("tensor group: %.1f MB handed to all-reduces per rank and step (as metrics.jsonl's tensor_allreduce_bytes)\n",
                p.tensor_allreduce_bytes / 1e6);
  }
  if (p.expert > 1) {
    std::printf("expert group: %d ranks, %.1f MB sent in all-to-alls per rank and step (as metrics.jsonl's "
                "expert_alltoall_bytes, at balanced routing), %.1f ms of them on the critical path\n",
                p.expert, p.expert_alltoall_bytes / 1e6, p.expert_comm_ms);
  }
  if (p.checkpoint_share > 0.001) std::printf("checkpoints: %.1f %% of the step (snapshots off the device)\n", 100 * p.checkpoint_share);
  if (!trace.empty()) std::printf("Chrome trace of the simulated step: %s\n", trace.c_str());
}

nlohmann::json tiers_json(const TierPrediction& t) {
  if (!t.enabled) return nullptr;
  const int d = static_cast<int>(Tier::device), h = static_cast<int>(Tier::host), n = static_cast<int>(Tier::nvme);
  return {{"home_gib", {{"device", t.home_gib[d]}, {"host", t.home_gib[h]}, {"nvme", t.home_gib[n]}}},
          {"device_budget_gib", t.device_budget_gib},
          {"read_gib", {{"host", t.bytes_read[h] / (1 << 30)}, {"nvme", t.bytes_read[n] / (1 << 30)}}},
          {"written_gib", {{"host", t.bytes_written[h] / (1 << 30)}, {"nvme", t.bytes_written[n] / (1 << 30)}}},
          {"stall_ms", t.stall_ms}, {"host_optimizer_ms", t.host_optimizer_ms},
          {"served", {{"device", t.served_share(Tier::device)}, {"host", t.served_share(Tier::host)}, {"nvme", t.served_share(Tier::nvme)}}},
          {"hit_rate", {{"host", t.hit_rate(Tier::host)}, {"nvme", t.hit_rate(Tier::nvme)}}}};
}

int search_command(const SimulateOptions& o, const Config& config, const Cluster& cluster) {
  check(o.top >= 1, "simulate --top: expected >= 1, found " + std::to_string(o.top));
  check(o.layer_costs.empty() && o.trace.empty() && o.tensor == 1 && !o.recompute && !o.tiers && o.overlap_sync,
        "simulate --search: searches tensor degrees, recomputation and memory tiers itself (no --tensor, --recompute, "
        "--tiers, --overlap-sync, --layer-costs or --trace with it)");
  const SearchResult found = search_layouts(config, cluster);
  const ModelConfig& m = config.model;
  if (!o.json) {
    std::printf("keel simulate --search: %s (L=%d C=%d V=%d, T=%d) on %s: %d nodes x %d %s = %d devices; %d layouts "
                "tried, %d do not fit %.0f GiB even with memory tiers\n",
                m.preset.c_str(), m.n_layer, m.n_embd, m.vocab_size, config.train.longest_seq_len(), cluster.name.c_str(),
                cluster.nodes, cluster.devices_per_node, cluster.device.name.c_str(), cluster.devices(), found.tried,
                found.rejected, cluster.device.memory_gib);
  }
  const size_t shown = std::min(found.ranked.size(), static_cast<size_t>(o.top));
  for (size_t i = 0; i < shown; ++i) {
    const Candidate& c = found.ranked[i];
    const StepPrediction& p = c.prediction;
    if (o.json) {
      const nlohmann::json j = {{"rank", i + 1}, {"tensor", c.tensor}, {"pipeline", c.pipeline}, {"data", p.data},
                                {"zero", c.zero}, {"schedule", to_string(c.schedule)}, {"micro_batches", c.micro_batches},
                                {"micro_batch", p.micro_batch}, {"codec", to_string(c.codec)}, {"recompute", c.recompute},
                                {"tiers", c.tiers}, {"tier_stall_ms", p.tiers.stall_ms + p.tiers.host_optimizer_ms},
                                {"step_ms", p.step_ms}, {"compute_ms", p.compute_ms}, {"bubble_ms", p.bubble_ms},
                                {"sync_exposed_ms", p.sync_exposed_ms}, {"optimizer_ms", p.optimizer_ms},
                                {"samples_per_s", p.samples_per_s}, {"mfu", p.mfu}, {"memory_gib", p.memory.total_gib()}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%zu. %.1f samples/s, MFU %.1f %%: %s\n   step %.1f ms: compute %.1f, bubble %.1f, sync exposed %.1f, "
                  "optimizer %.1f, tier stalls %.1f; %.1f GiB per device%s\n",
                  i + 1, p.samples_per_s, 100 * p.mfu, c.describe().c_str(), p.step_ms, p.compute_ms, p.bubble_ms,
                  p.sync_exposed_ms, p.optimizer_ms, p.tiers.stall_ms + p.tiers.host_optimizer_ms, p.memory.total_gib(),
                  c.tiers ? " over device, host and NVMe" : "");
    }
  }
  std::fflush(stdout);
  char need[200];
  std::snprintf(need, sizeof need, "simulate --search: no layout of %d tried fits %.0f GiB per device, even with memory tiers (the least needs %.1f GiB)",
                found.tried, cluster.device.memory_gib, found.least_gib);
  check(!found.ranked.empty(), found.tried == 0 ? std::string("simulate --search: no layout Keel accepts for this model and cluster") : std::string(need));
  return 0;
}

}  // namespace

int simulate_command(const SimulateOptions& o) {
  check(!o.cluster.empty(), "simulate: missing --cluster FILE.toml (configs/clusters/ holds examples)");
  Cluster cluster = Cluster::load(o.cluster);
  check(o.nodes >= 0, "simulate --nodes: expected >= 1, found " + std::to_string(o.nodes));
  if (o.nodes > 0) cluster.nodes = o.nodes;
  check(o.tensor >= 1, "simulate --tensor: expected >= 1, found " + std::to_string(o.tensor));
  Config config = Config::load(o.config, o.sets);
  const StackProfile stack = StackProfile::load(o.stacks, o.stack);
  check(!o.tiers || o.stack == "keel", "simulate --tiers: replays Keel's tier manager over Keel's planes (no --stack with it)");
  check(!o.search || (o.stack == "keel" && o.vocab == 0), "simulate --search: ranks Keel's layouts (no --stack or --vocab with it)");
  if (o.search) return search_command(o, config, cluster);
  // A config that runs tensor parallelism (parallel.tensor) is resolved as Keel's trainer resolves
  // it, over all the devices; --tensor alone models a split Keel is not given (its data-parallel
  // world is that of the smaller model).
  check(config.parallel.tensor == 1 || o.tensor == 1 || o.tensor == config.parallel.tensor,
        "simulate --tensor: expected the config's parallel.tensor (" + std::to_string(config.parallel.tensor) +
            ") or 1, found " + std::to_string(o.tensor));
  resolve_job_config(config, config.parallel.tensor > 1 ? cluster.devices() : cluster.devices() / o.tensor);
  // The simulator tokenizes nothing: a vocabulary of any size (Keel's uint16 token shards cap a
  // trained one at 65,536), padded to a multiple of 128 as Keel pads; set once the config is resolved (whose
  // validation holds a trained vocabulary to that cap).
  check(o.vocab >= 0, "simulate --vocab: expected >= 2, found " + std::to_string(o.vocab));
  if (o.vocab > 0) {
    check(o.vocab >= 2, "simulate --vocab: expected >= 2, found " + std::to_string(o.vocab));
    config.model.vocab_size = o.vocab;
    config.model.padded_vocab_size = (static_cast<int64_t>(o.vocab) + 127) / 128 * 128;
  }
  SimLayout layout{o.tensor, o.recompute, o.layer_costs, o.tiers};
  layout.overlap_sync = o.overlap_sync;
  layout.stack = stack;
  const StepPrediction p = predict_step(config, cluster, layout);
  if (!o.trace.empty()) {
    const std::string trace = pipeline::chrome_trace(p.timeline, "keel simulate: " + config.model.preset + " on " + cluster.name);
    write_file_atomic(o.trace, {ByteRange{trace.data(), trace.size()}});
  }
  const MemoryPerDevice& mem = p.memory;
  if (o.json) {
    const nlohmann::json j = {
        {"cluster", cluster.name}, {"devices", p.devices}, {"data", p.data}, {"pipeline", p.pipeline},
        {"tensor", p.tensor}, {"zero", config.parallel.zero}, {"schedule", to_string(config.parallel.schedule)},
        {"micro_batches", p.micro_batches}, {"micro_batch", p.micro_batch}, {"sequences", p.sequences},
        {"cut", p.cut}, {"step_ms", p.step_ms}, {"span_ms", p.span_ms}, {"compute_ms", p.compute_ms},
        {"bubble_ms", p.bubble_ms}, {"bubble", p.bubble}, {"tensor_comm_ms", p.tensor_comm_ms}, {"tensor_allreduce_bytes", p.tensor_allreduce_bytes},
        {"expert", p.expert}, {"expert_alltoall_bytes", p.expert_alltoall_bytes}, {"expert_comm_ms", p.expert_comm_ms},
        {"param_bytes", p.param_bytes}, {"sync_sent_bytes", p.sync_sent_bytes}, {"param_gather_bytes", p.param_gather_bytes},
        {"pipeline_comm_ms", p.pipeline_comm_ms}, {"sync_ms", p.sync_ms}, {"sync_codec_ms", p.sync_codec_ms}, {"sync_exposed_ms", p.sync_exposed_ms}, {"sync_wire_ratio", p.sync_wire_ratio},
        {"optimizer_ms", p.optimizer_ms}, {"stack", stack.name}, {"sync_algorithm", p.sync_algorithm}, {"variability_ms", p.variability_ms}, {"samples_per_s", p.samples_per_s},
        {"tokens_per_s", p.tokens_per_s}, {"model_tflops_per_device", p.model_tflops_per_device}, {"mfu", p.mfu},
        {"goodput", p.goodput},
        {"memory_gib", {{"params", mem.params_gib}, {"grads", mem.grads_gib}, {"optimizer", mem.optimizer_gib},
                        {"activations", mem.activations_gib}, {"total", mem.total_gib()}}},
        {"fits", p.fits}, {"checkpoint_share", p.checkpoint_share}, {"tiers", tiers_json(p.tiers)}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    print_text(config, cluster, p, o.trace);
  }
  std::fflush(stdout);  // (the breakdown before the error line)
  char need[160];
  std::snprintf(need, sizeof need, "simulate: this layout needs %.1f GiB per device, the %s has %.0f", mem.total_gib(),
                cluster.device.name.c_str(), cluster.device.memory_gib);
  check(p.fits, std::string(need) + " (--tiers yes homes pages on host and NVMe; or more pipeline stages, tensor parallelism or ZeRO)");
  return 0;
}

}  // namespace keel::sim
