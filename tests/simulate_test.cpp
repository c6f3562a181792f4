// `keel simulate` (sim/): cluster files are checked key by key, the step model's parameter count is
// Keel's own model's, its memory per device follows ZeRO's shards, its breakdown adds up to its step,
// and bad input is one line with a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "model/gpt.h"
#include "runtime/job_config.h"
#include "core/fileio.h"
#include "sim/cluster.h"
#include "sim/collective.h"
#include "sim/stack.h"
#include "sim/step_model.h"
#include "store/chunk_store.h"
#include "store/tiers.h"
#include "test_util.h"

namespace keel {
namespace {

const std::string kCluster = testing::source_path("configs/clusters/dgx-a100.toml");

nlohmann::json simulate(const std::string& args) {
  const testing::CommandResult r = testing::run_keel("simulate --cluster " + kCluster + " --json yes " + args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t line = r.output.rfind("\n{");
  return nlohmann::json::parse(r.output.substr(line == std::string::npos ? 0 : line + 1));
}

// Every shipped cluster file loads, and gives a prediction for the default job.
TEST(Simulate, ShippedClusterFilesLoad) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(testing::source_path("configs/clusters"))) {
    const sim::Cluster c = sim::Cluster::load(entry.path().string());
    EXPECT_GT(c.devices(), 0) << entry.path();
    const testing::CommandResult r = testing::run_keel("simulate --cluster " + entry.path().string());
    EXPECT_EQ(r.exit_code, 0) << entry.path() << "\n" << r.output;
    files++;
  }
  EXPECT_GE(files, 2);
}

// The analytic parameter count the simulator costs memory and sync by is the count of the tensors
// Keel's model registers, for both families, tied and untied.
TEST(Simulate, ParameterCountIsTheModelsOwn) {
  for (const std::string set : {"model.preset=gpt2-124m", "model.preset=llama-110m", "model.preset=llama-d4"}) {
    Config c = Config::load("", {set});
    c.resolve(1);
    ChunkStore store(c.store.chunk_bytes);
    const GPT model(c.model, store);
    store.finalize_layout();
    double sum = 0;
    for (double p : sim::layer_params(c.model)) sum += p;
    EXPECT_EQ(sum, static_cast<double>(store.param_count())) << set;
  }
}

// The step is its parts; ZeRO-1 divides the moments over the data-parallel ranks, and a pipeline
// the parameters over its stages; tensor parallelism divides both again.
TEST(Simulate, BreakdownAddsUpAndMemoryFollowsTheLayout) {
  const std::string model = "--set model.preset=gpt2-350m --set runtime.precision=bf16 --set train.grad_accum=8 --set train.batch_size=1";
  const nlohmann::json dp = simulate(model);
  EXPECT_EQ(dp.at("data").get<int>(), 32);
  EXPECT_NEAR(dp.at("step_ms").get<double>(),
              (dp.at("span_ms").get<double>() + dp.at("sync_exposed_ms").get<double>() + dp.at("optimizer_ms").get<double>()) /
                      (1 - dp.at("checkpoint_share").get<double>()) +
                  dp.at("variability_ms").get<double>(),
              1e-9 * dp.at("step_ms").get<double>());
  EXPECT_GT(dp.at("checkpoint_share").get<double>(), 0);
  EXPECT_LT(dp.at("checkpoint_share").get<double>(), 0.01);
  // A peer that reduces its gradients after the backward exposes all of the sync; Keel's
  // GradSync hides part of it under the backward.
  const nlohmann::json late = simulate(model + " --overlap-sync no");
  EXPECT_NEAR(late.at("sync_exposed_ms").get<double>(), late.at("sync_ms").get<double>() + late.at("sync_codec_ms").get<double>(),
              1e-9 * late.at("sync_ms").get<double>());
  EXPECT_GT(late.at("sync_exposed_ms").get<double>(), dp.at("sync_exposed_ms").get<double>());
  EXPECT_EQ(late.at("sync_ms").get<double>(), dp.at("sync_ms").get<double>());
  EXPECT_GT(dp.at("sync_ms").get<double>(), 0);
  EXPECT_EQ(dp.at("bubble").get<double>(), 0);  // one stage
  const nlohmann::json z1 = simulate(model + " --set parallel.zero=1");
  EXPECT_NEAR(z1.at("memory_gib").at("optimizer").get<double>() * 32, dp.at("memory_gib").at("optimizer").get<double>(), 1e-9);
  const nlohmann::json pp = simulate(model + " --set parallel.pipeline=4");
  EXPECT_EQ(pp.at("data").get<int>(), 8);
  EXPECT_GT(pp.at("bubble").get<double>(), 0);
  EXPECT_LT(pp.at("memory_gib").at("params").get<double>(), 0.4 * dp.at("memory_gib").at("params").get<double>());
  const nlohmann::json tp = simulate(model + " --set parallel.pipeline=4 --tensor 8");
  EXPECT_EQ(tp.at("data").get<int>(), 1);
  EXPECT_NEAR(tp.at("memory_gib").at("params").get<double>() * 8, pp.at("memory_gib").at("params").get<double>(), 1e-9);
  EXPECT_GT(tp.at("tensor_comm_ms").get<double>(), 0);
  // The same step on twice the nodes: twice the samples per step, at most twice the samples/s.
  const nlohmann::json twice = simulate(model + " --nodes 8");
  EXPECT_EQ(twice.at("sequences").get<int>(), 2 * dp.at("sequences").get<int>());
  EXPECT_LE(twice.at("samples_per_s").get<double>(), 2 * dp.at("samples_per_s").get<double>() * (1 + 1e-12));
  EXPECT_GT(twice.at("samples_per_s").get<double>(), dp.at("samples_per_s").get<double>());
}

// HybridGC in the sync term: each chunk's codec by Keel's policy, its wire size by the codec; the
// sync's bandwidth term shrinks by that ratio.
TEST(Simulate, CompressedSyncSendsTheCodecsBytes) {
  const std::string model = "--set model.preset=gpt2-350m --set runtime.precision=bf16 --set train.grad_accum=8 --set train.batch_size=1";
  const nlohmann::json plain = simulate(model), topk = simulate(model + " --set sync.codec=topk"),
                       hybrid = simulate(model + " --set sync.codec=hybrid");
  EXPECT_EQ(plain.at("sync_wire_ratio").get<double>(), 1.0);
  // topk keeps 5 % as (value, position) pairs: 0.1 of float32's bytes per encoding; being sparse
  // it sums by gather, N-1 encodings per rank against a ring's 2 (N-1)/N: N/2 x 0.1 of the ring.
  const double r = topk.at("sync_wire_ratio").get<double>(), data = topk.at("data").get<double>();
  EXPECT_NEAR(r, data / 2 * 0.1, 0.01 * data / 2 * 0.1);
  // Time follows the bytes (within the buckets' latency, which the two count differently).
  EXPECT_NEAR(topk.at("sync_ms").get<double>() / plain.at("sync_ms").get<double>(), r, 0.15 * r);
  // No [codecs] rates in the file: the codecs' compute is not costed.
  EXPECT_EQ(topk.at("sync_codec_ms").get<double>(), 0.0);
  EXPECT_LT(hybrid.at("sync_wire_ratio").get<double>(), 1.0);
  EXPECT_LT(hybrid.at("step_ms").get<double>(), plain.at("step_ms").get<double>());
}

// A cluster file's [codecs] rates cost HybridGC's compute on the training thread: never hidden,
// and twice the rates take half the time. `keel simulate --probe yes` measures them here, as TOML
// a cluster file takes.
// Memory tiers: a model that does not fit one small device is placed by Keel's placement over
// device, host and NVMe; every page is homed once, the device's share stays within what the
// activations leave, pages that cannot all stay on the device are read and written back every
// step, and the tier manager's prefetch never stalls the step more than fetching on demand.
TEST(Simulate, TiersPlaceThePagesAndCountTheirTraffic) {
  std::string text = read_text_file(kCluster);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"nodes = 4 ", "nodes = 1 "}, {"devices_per_node = 8", "devices_per_node = 1"},
           {"memory_gib = 80", "memory_gib = 2.25"}, {"nics_per_node = 8", "nics_per_node = 1"}}) {
    text.replace(text.find(from), from.size(), to);
  }
  const sim::Cluster small = sim::Cluster::parse(text, "small");
  auto predict = [&](std::vector<std::string> sets, bool tiers) {
    for (const char* s : {"model.preset=gpt2-124m", "train.batch_size=1", "train.grad_accum=4", "train.seq_len=512"}) sets.push_back(s);
    Config config = Config::load("", sets);
    resolve_job_config(config, 1);
    return sim::predict_step(config, small, sim::SimLayout{1, false, "", tiers});
  };
  const sim::StepPrediction alone = predict({}, false);
  EXPECT_FALSE(alone.fits);
  EXPECT_FALSE(alone.tiers.enabled);
  const sim::StepPrediction tiered = predict({}, true);
  ASSERT_TRUE(tiered.tiers.enabled);
  EXPECT_TRUE(tiered.fits);
  const sim::TierPrediction& t = tiered.tiers;
  const double planes = alone.memory.params_gib + alone.memory.grads_gib + alone.memory.optimizer_gib;
  EXPECT_NEAR(t.home_gib[0] + t.home_gib[1] + t.home_gib[2], planes, 1e-3 * planes);  // (host and NVMe slots: whole 4 KiB pages)
  EXPECT_GT(t.device_budget_gib, 0);
  EXPECT_LE(t.home_gib[0], t.device_budget_gib);
  EXPECT_NEAR(t.served_share(Tier::device) + t.served_share(Tier::host) + t.served_share(Tier::nvme), 1.0, 1e-12);
  EXPECT_GE(tiered.step_ms, alone.step_ms + t.stall_ms + t.host_optimizer_ms - 1e-9);

  // Every class homed on the host: each step, the parameters the device cannot keep come in (at
  // least their bytes beyond its room) and, updated by AdamW, go back.
  const std::vector<std::string> host = {"tier.embedding=host", "tier.attention=host", "tier.ffn=host", "tier.norm=host"};
  std::vector<std::string> on_demand = host;
  on_demand.push_back("tier.prefetch=false");
  const sim::StepPrediction h = predict(host, true), d = predict(on_demand, true);
  const double gib = 1024.0 * 1024 * 1024;
  EXPECT_EQ(h.tiers.home_gib[0], 0);
  EXPECT_EQ(h.tiers.home_gib[2], 0);
  EXPECT_GE(h.tiers.bytes_read[1] / gib, alone.memory.params_gib - h.tiers.device_budget_gib);
  EXPECT_GE(h.tiers.bytes_written[1] / gib, alone.memory.params_gib - h.tiers.device_budget_gib);
  EXPECT_GT(h.tiers.host_optimizer_ms, 0);  // moments homed on the host are updated there
  EXPECT_LT(h.tiers.served_share(Tier::device), 1);
  EXPECT_GT(d.tiers.stall_ms, 0);
  EXPECT_LT(h.tiers.stall_ms, d.tiers.stall_ms);
  EXPECT_LT(h.tiers.served_share(Tier::host), d.tiers.served_share(Tier::host) + 1e-12);
}

TEST(Simulate, CodecRatesCostTheCodecs) {
  const std::string base = read_text_file(kCluster);
  Config config = Config::load("", {"model.preset=gpt2-124m", "sync.codec=hybrid", "train.batch_size=4"});
  resolve_job_config(config, 32);
  const testing::CommandResult probe = testing::run_keel("simulate --probe yes");
  ASSERT_EQ(probe.exit_code, 0) << probe.output;
  const sim::Cluster measured = sim::Cluster::parse(base + "\n" + probe.output.substr(probe.output.find("[codecs]")), "probe");
  for (int k = 1; k < 7; ++k) {
    EXPECT_GT(measured.codecs.encode_gbps[k], 0) << k;
    EXPECT_GT(measured.codecs.decode_gbps[k], 0) << k;
  }
  auto with_rates = [&](double gbps) {
    std::string text = base + "\n[codecs]\n";
    for (const char* c : {"fp16", "bf16", "sign1", "quant2-topk", "topk", "randk"}) {
      text += std::string(c) + "_encode = " + std::to_string(gbps) + "\n" + c + "_decode = " + std::to_string(gbps) + "\n";
    }
    return sim::predict_step(config, sim::Cluster::parse(text, "rates"), sim::SimLayout{});
  };
  const sim::StepPrediction none = sim::predict_step(config, sim::Cluster::parse(base, "none"), sim::SimLayout{});
  const sim::StepPrediction slow = with_rates(50), fast = with_rates(100);
  EXPECT_EQ(none.sync_codec_ms, 0.0);
  EXPECT_GT(slow.sync_codec_ms, 0.0);
  EXPECT_NEAR(fast.sync_codec_ms, slow.sync_codec_ms / 2, 1e-9 * slow.sync_codec_ms);
  EXPECT_NEAR(slow.sync_exposed_ms - none.sync_exposed_ms, slow.sync_codec_ms, 1e-6 * slow.sync_codec_ms);
  EXPECT_THROW(sim::Cluster::parse(base + "\n[codecs]\nzstd_encode = 1\n", "bad"), Error);
  EXPECT_THROW(sim::Cluster::parse(base + "\n[codecs]\nsign1_encode = -1\n", "bad"), Error);
}

// --search ranks the layouts that fit by simulated throughput, fastest first, each with its
// breakdown; a model no layout fits is one line and exit 2.
TEST(Simulate, SearchRanksLayoutsThatFit) {
  const testing::CommandResult r = testing::run_keel(
      "simulate --cluster " + kCluster + " --nodes 1 --search yes --top 4 --json yes --set model.preset=gpt2-350m "
      "--set runtime.precision=bf16 --set train.batch_size=8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<nlohmann::json> ranked;
  size_t at = 0;
  while ((at = r.output.find("{\"", at)) != std::string::npos) {
    const size_t end = r.output.find('\n', at);
    ranked.push_back(nlohmann::json::parse(r.output.substr(at, end - at)));
    at = end;
  }
  ASSERT_EQ(ranked.size(), 4u);
  for (size_t i = 0; i < ranked.size(); ++i) {
    EXPECT_EQ(ranked[i].at("rank").get<int>(), static_cast<int>(i) + 1);
    EXPECT_LE(ranked[i].at("memory_gib").get<double>(), 80.0);
    EXPECT_EQ(ranked[i].at("tensor").get<int>() * ranked[i].at("pipeline").get<int>() * ranked[i].at("data").get<int>(), 8);
    if (i > 0) {
      EXPECT_LE(ranked[i].at("samples_per_s").get<double>(), ranked[i - 1].at("samples_per_s").get<double>());
    }
  }
  // Too large for any layout of one node, even over its host memory and NVMe drives (3.3T
  // parameters): one line naming the need.
  const testing::CommandResult big = testing::run_keel(
      "simulate --cluster " + kCluster + " --nodes 1 --search yes --set model.preset=gpt2-124m "
      "--set model.n_layer=64 --set model.n_embd=65536 --set model.n_head=128 --set train.batch_size=8");
  EXPECT_EQ(big.exit_code, 2) << big.output;
  EXPECT_NE(big.output.find("simulate --search: no layout of"), std::string::npos) << big.output;
}

// Measured layer costs in place of the FLOP model: one device's step is its micro-batches' F + B + W
// as the file gives them (ms per micro-batch), and a pipeline's stages sum their layers'.
TEST(Simulate, MeasuredLayerCostsReplaceTheFlopModel) {
  testing::TempDir dir("keel-sim-costs");
  // tiny: 2 blocks, so 4 layers (embedding, 2 blocks, head).
  testing::write_text(dir.path() + "/costs.json",
                      R"({"forward": [0.5, 2, 2, 4], "backward_input": [0, 3, 3, 5], "backward_weight": [1, 2, 2, 4],)"
                      R"( "comm": 0, "seq_len": 128})");
  const std::string cluster = read_text_file(kCluster);
  std::string one = cluster;
  one.replace(one.find("nodes = 4 "), 10, "nodes = 1 ");
  one.replace(one.find("devices_per_node = 8"), 20, "devices_per_node = 2");
  one.replace(one.find("nics_per_node = 8"), 17, "nics_per_node = 2");
  testing::write_text(dir.path() + "/local.toml", one);
  auto run = [&](const std::string& args) {
    const testing::CommandResult r = testing::run_keel("simulate --cluster " + dir.path() + "/local.toml --json yes "
                                                       "--set model.preset=tiny --set train.grad_accum=4 --layer-costs " +
                                                       dir.path() + "/costs.json " + args);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output.substr(r.output.rfind("\n{") + 1));
  };
  const nlohmann::json dp = run("");
  EXPECT_EQ(dp.at("data").get<int>(), 2);
  EXPECT_NEAR(dp.at("compute_ms").get<double>(), 4 * (6.5 + 13 + 9), 1e-9);  // 4 micro-batches x every layer's F + B + W
  const nlohmann::json pp = run("--set parallel.pipeline=2 --set parallel.stage_boundaries=2");
  EXPECT_NEAR(pp.at("compute_ms").get<double>(), 4 * (6 + 8 + 6), 1e-9);  // layers 2-3: the busier rank
  EXPECT_GT(pp.at("bubble").get<double>(), 0);
}

// The GEMM curve: a share read at a product's smallest dimension, interpolated in log2 of it and
// held beyond the ends; a block's forward is its products' times at those shares (hand-computed).
TEST(Simulate, GemmRateFollowsTheShapeCurve) {
  sim::Device d;
  d.gemm_efficiency = {{256, 0.4}, {1024, 0.8}};
  d.hbm_gbps = 1e9;  // (no product bound by memory here)
  EXPECT_DOUBLE_EQ(d.gemm_share(100), 0.4);
  EXPECT_DOUBLE_EQ(d.gemm_share(256), 0.4);
  EXPECT_DOUBLE_EQ(d.gemm_share(512), 0.6);  // halfway in log2 between 256 and 1024
  EXPECT_DOUBLE_EQ(d.gemm_share(4096), 0.8);
  Config c = Config::load("", {"model.preset=gpt2-124m", "model.n_layer=1", "model.n_embd=1024", "model.n_head=16",
                               "model.max_seq_len=1024", "train.seq_len=1024", "data.tokenizer="});
  c.resolve(1);
  const double peak = 100e12, tokens = 2048, T = 1024;  // two sequences
  // qkv 2048x3072x1024, attention 2 x 16 heads x (1024x1024x64 + 1024x64x1024), projection
  // 2048x1024x1024, fc 2048x4096x1024, fcproj 2048x1024x4096: min dims 1024 -> 0.8, 64 -> 0.4.
  const double big = 2.0 * 2048 * 1024 * (3072 + 1024 + 4096 + 4096) / (peak * 0.8);
  const double attention = 2.0 * 32 * 2 * 1024 * 1024 * 64 / (peak * 0.4);
  const double expected_ms = (big + attention) * 1e3;
  EXPECT_NEAR(sim::layer_forward_ms(c.model, 1, tokens, static_cast<int>(T), 1, d, peak, 2, 1.0), expected_ms, 1e-9 * expected_ms);
  // A stack's kernel efficiency divides it; tensor parallelism of 2 shrinks the products'
  // N (or K) to 512 -> 0.6 for projection and fcproj's K... each product's own share.
  EXPECT_NEAR(sim::layer_forward_ms(c.model, 1, tokens, static_cast<int>(T), 1, d, peak, 2, 0.5), 2 * expected_ms, 1e-9 * expected_ms);
  const double tp2 = (2.0 * 2048 * 1024 * (1536 + 2048) / (peak * 0.8) +   // qkv N 1536, fc N 2048
                      2.0 * 2048 * 1024 * 512 / (peak * 0.6) +             // projection K 512
                      2.0 * 2048 * 1024 * 2048 / (peak * 0.8) +            // fcproj K 2048
                      attention / 2) * 1e3;
  EXPECT_NEAR(sim::layer_forward_ms(c.model, 1, tokens, static_cast<int>(T), 2, d, peak, 2, 1.0), tp2, 1e-9 * tp2);
  // A product too small for the device is bound by its bytes through memory.
  d.hbm_gbps = 1;
  const double bytes = 2.0 * (2048.0 * 1024 + 1024.0 * 3072 + 2048.0 * 3072);  // qkv's operands and result
  EXPECT_GT(sim::layer_forward_ms(c.model, 1, tokens, static_cast<int>(T), 1, d, peak, 2, 1.0), bytes / 1e9 * 1e3);
}

// Collectives: a flat ring (Keel over OpenMPI) as before; NCCL's choice is the cheapest of ring,
// tree and hierarchical: the tree for small messages across many nodes, a ring for large ones;
// their times hand-computed. Checked against published nccl-tests bus bandwidths.
TEST(Simulate, CollectiveAlgorithmChoice) {
  sim::CollectiveGroup g;
  g.ranks = 64, g.per_node = 8, g.intra_gbps = 200, g.intra_latency_us = 2, g.node_gbps = 100, g.device_gbps = 12.5,
  g.inter_latency_us = 5;
  const double n = 64, N = 8, big = 1e9, small = 1e4;
  // Flat ring: 2 (n-1)/n of the bytes at the device's NIC share, 2 (n-1) hops at the inter-node latency.
  const sim::CollectiveCost flat = sim::allreduce(big, g, sim::CollectiveKind::ring);
  EXPECT_NEAR(flat.ms, 2 * (n - 1) / n * big / 12.5e9 * 1e3 + 2 * (n - 1) * 5e-3, 1e-9);
  // NCCL, large message: the node-by-node ring at the node's NIC bandwidth, N hops across nodes.
  const sim::CollectiveCost large = sim::allreduce(big, g, sim::CollectiveKind::nccl);
  EXPECT_EQ(large.algorithm, sim::Algorithm::ring);
  EXPECT_NEAR(large.ms, 2 * (n - 1) / n * big / 100e9 * 1e3 + 2 * (N * 5 + (n - 1 - (N - 1)) * 2) * 1e-3, 1e-9);
  // Small message: the double binary tree's log2(8) = 3 levels beat the ring's 64 hops.
  const sim::CollectiveCost tree = sim::allreduce(small, g, sim::CollectiveKind::nccl);
  EXPECT_EQ(tree.algorithm, sim::Algorithm::tree);
  EXPECT_NEAR(tree.ms, 2 * small / 100e9 * 1e3 + 2 * (3 * 5 + 7 * 2) * 1e-3, 1e-12);
  // A stack running a hierarchical all-reduce: across 2 nodes it sends 1 / 8 of the bytes each
  // member reduces over the network, 2 (2-1)/2 of it: cheaper than NCCL's ring for a large message.
  sim::CollectiveGroup two = g;
  two.ranks = 16;
  const sim::CollectiveCost h = sim::allreduce(big, two, sim::CollectiveKind::hierarchical);
  EXPECT_EQ(h.algorithm, sim::Algorithm::hierarchical);
  EXPECT_NEAR(h.ms, (2 * 7.0 / 8 * big / 200e9 + big / 8 / 12.5e9) * 1e3 + (2 * 7 * 2 + 2 * 5) * 1e-3, 1e-9);
  EXPECT_EQ(sim::allreduce(big, two, sim::CollectiveKind::nccl).algorithm, sim::Algorithm::ring);
  // Inside one node every kind is a ring over the node's links; a reduce-scatter is half of it.
  sim::CollectiveGroup node = g;
  node.ranks = 8;
  EXPECT_EQ(sim::allreduce(big, node, sim::CollectiveKind::nccl).algorithm, sim::Algorithm::ring);
  EXPECT_NEAR(sim::allreduce(big, node, sim::CollectiveKind::nccl, 0.5).ms, 0.5 * sim::allreduce(big, node, sim::CollectiveKind::ring).ms, 1e-9);
  // Published all_reduce_perf bus bandwidths (busbw = 2 (n-1)/n bytes / time), large messages:
  // 8 x A100-SXM4 in one node 232.5 GB/s (NVIDIA/nccl-tests issue 175), modelled with dgx-a100's
  // 230; 3 nodes x 8 A100 with 4 HDR NICs each, 96 GB/s peak (nccl-tests issue 119) and 2 such
  // nodes 91 GB/s (nccl-tests issue 100): each within 15 %.
  auto busbw = [](const sim::CollectiveGroup& grp, double bytes) {
    return 2 * (grp.ranks - 1.0) / grp.ranks * bytes / (sim::allreduce(bytes, grp, sim::CollectiveKind::nccl).ms * 1e-3) / 1e9;
  };
  sim::CollectiveGroup a100;
  a100.ranks = 8, a100.per_node = 8, a100.intra_gbps = 230, a100.intra_latency_us = 3, a100.inter_latency_us = 5;
  a100.node_gbps = 4 * 200 / 8.0, a100.device_gbps = a100.node_gbps / 8;
  EXPECT_NEAR(busbw(a100, 1 << 30), 232.5, 0.15 * 232.5);
  a100.ranks = 24;
  EXPECT_NEAR(busbw(a100, 128 << 20), 96, 0.15 * 96);
  a100.ranks = 16;
  EXPECT_NEAR(busbw(a100, 1 << 30), 91, 0.15 * 91);
}

// Memory as a stack lays it out: bf16 parameters, fp32 gradients and state, sharded by ZeRO-3
// over the data group; Megatron's activation accounting; a vocabulary above 65,536.
TEST(Simulate, MemoryWithZero3AndBf16) {
  testing::TempDir dir("keel-sim-stack");
  const std::string stacks = dir.path() + "/stacks.toml";
  testing::write_text(stacks, "[stack.s]\nkernel_efficiency = 0.5\noverlap_grad_reduce = true\ngrad_reduce_bytes = 2\n"
                              "bucket_mb = 25\ncollective = \"nccl\"\nparam_bytes = 2\ngrad_bytes = 4\nstate_bytes = 12\n"
                              "activations = \"megatron\"\nsequence_parallel = false\nflash_attention = false\nelementwise_values = 36\nscore_bytes_forward = 9\nscore_bytes_backward = 11\n"
                              "block_pass_ms = 0\n");
  const std::string model = "--set model.preset=gpt2-124m --set model.n_layer=4 --set model.n_embd=1024 --set model.n_head=16 "
                            "--set model.max_seq_len=1024 --set train.seq_len=1024 --set runtime.precision=bf16 --set data.tokenizer= "
                            "--set train.batch_size=2 --set train.recompute=none --vocab 128000 --stack s --stacks " + stacks;
  const nlohmann::json z3 = simulate(model + " --set parallel.zero=3");
  const nlohmann::json z0 = simulate(model + " --set parallel.zero=0");
  const double C = 1024, V = 128000, T = 1024, D = 32, GiB = 1024.0 * 1024 * 1024;
  const double params = V * C + T * C + 4 * (12 * C * C + 13 * C) + 2 * C;  // embeddings, blocks, final norm
  EXPECT_NEAR(z0.at("memory_gib").at("params").get<double>(), params * 2 / GiB, 1e-9);
  EXPECT_NEAR(z0.at("memory_gib").at("grads").get<double>(), params * 4 / GiB, 1e-9);
  EXPECT_NEAR(z0.at("memory_gib").at("optimizer").get<double>(), params * 12 / GiB, 1e-9);
  EXPECT_NEAR(z3.at("memory_gib").at("params").get<double>(), params * 2 / D / GiB, 1e-9);
  EXPECT_NEAR(z3.at("memory_gib").at("grads").get<double>(), params * 4 / D / GiB, 1e-9);
  EXPECT_NEAR(z3.at("memory_gib").at("optimizer").get<double>(), params * 12 / D / GiB, 1e-9);
  // Activations, no recomputation, no sequence parallelism, t = 1: s b h (34 + 5 a s / h) per
  // block for the one micro-batch in flight, 4 blocks, and the float32 logits.
  const double sbh = T * 2 * C;
  const double act = 4 * sbh * (34 + 5 * 16 * T / C) + T * 2 * V * 4;
  EXPECT_NEAR(z3.at("memory_gib").at("activations").get<double>(), act / GiB, 1e-9);
  // ZeRO-3 gathers parameters and reduce-scatters gradients: more bytes on the wire than ZeRO-0's all-reduce.
  EXPECT_GT(z3.at("sync_ms").get<double>(), 0);
  EXPECT_EQ(z3.at("stack").get<std::string>(), "s");
}

// A stack's fixed cost per block and pass (block_pass_ms) joins each block's forward once and its
// backward once, and a recomputed forward again: the busiest rank's compute grows by it times the
// blocks, the micro-batches and the passes (2, or 3 with full recomputation), whatever the model.
TEST(Simulate, BlockPassCostIsPerBlockAndPass) {
  testing::TempDir dir("keel-sim-pass");
  auto stack_with = [&](double ms) {
    const std::string path = dir.path() + "/stacks" + std::to_string(static_cast<int>(ms)) + ".toml";
    testing::write_text(path, "[stack.s]\nkernel_efficiency = 0.8\noverlap_grad_reduce = true\ngrad_reduce_bytes = 4\n"
                              "bucket_mb = 1000000\ncollective = \"nccl\"\nparam_bytes = 4\ngrad_bytes = 4\nstate_bytes = 8\n"
                              "activations = \"megatron\"\nsequence_parallel = false\nflash_attention = true\n"
                              "elementwise_values = 36\nscore_bytes_forward = 0\nscore_bytes_backward = 0\n"
                              "block_pass_ms = " + std::to_string(ms) + "\n");
    return path;
  };
  const std::string zero = stack_with(0), seven = stack_with(7);
  for (const char* recompute : {"none", "full"}) {
    const std::string model = std::string("--set model.preset=gpt2-124m --set model.n_layer=6 --set model.n_embd=512 ") +
                              "--set model.n_head=8 --set model.max_seq_len=512 --set train.seq_len=512 --set runtime.precision=bf16 " +
                              "--set data.tokenizer= --set train.batch_size=2 --set train.grad_accum=3 --set parallel.zero=3 " +
                              "--set train.recompute=" + recompute + " --stack s --stacks ";
    const nlohmann::json a = simulate(model + zero), b = simulate(model + seven);
    const double passes = std::string(recompute) == "full" ? 3 : 2;
    EXPECT_EQ(a.at("micro_batches").get<int>(), 3);
    EXPECT_NEAR(b.at("compute_ms").get<double>() - a.at("compute_ms").get<double>(), 7.0 * 6 * 3 * passes, 1e-6) << recompute;
    EXPECT_GT(b.at("step_ms").get<double>(), a.at("step_ms").get<double>());
  }
}

// The tensor group's traffic: for real tensor-parallel runs of the toy model (`keel launch`, T = 2
// and 4, data 2 x tensor 2; GPT-2 tied and llama untied, with 2 and 4 key/value heads; 2
// micro-batches a step; full recomputation), `keel simulate` of the same config on a node of as many devices
// predicts, per rank and step, the bytes every step line's tensor_allreduce_bytes counts.
TEST(Simulate, TensorGroupBytesAreTheTrainers) {
  testing::TempDir dir("keel-sim-tp");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 3);
  std::string cluster_text = read_text_file(kCluster);
  cluster_text.replace(cluster_text.find("nodes = 4"), 9, "nodes = 1");
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  struct Case {
    int ranks, tensor, batch;
    std::string extra;
  };
  const std::vector<Case> cases = {
      {2, 2, 8, ""},
      {4, 4, 8, "--set model.family=llama --set model.n_kv_head=4 --set model.tie_embeddings=false "},
      {4, 2, 4, ""},
      {2, 2, 8, llama + "--set train.recompute=full "},
      // A mixture of experts: the router's probability gradient is summed over the group too.
      {2, 2, 8, "--set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32 "},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string run = "r" + std::to_string(i);
    const std::string sets = c.extra + "--set train.grad_accum=2 --set parallel.tensor=" + std::to_string(c.tensor);
    const testing::CommandResult r = testing::run_keel(testing::toy_train_args(dir, c.ranks, c.batch, run, sets));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::string text = cluster_text;
    text.replace(text.find("devices_per_node = 8"), 20, "devices_per_node = " + std::to_string(c.ranks));
    text.replace(text.find("nics_per_node = 8"), 17, "nics_per_node = " + std::to_string(c.ranks));  // (rail: one a device)
    const std::string cluster = dir / ("cluster" + std::to_string(c.ranks) + ".toml");
    testing::write_text(cluster, text);
    const testing::CommandResult s = testing::run_keel("simulate --cluster " + cluster + " --json yes --config " +
                                                       dir / "toy.toml" + " --set train.batch_size=" +
                                                       std::to_string(c.batch) + " " + sets);
    ASSERT_EQ(s.exit_code, 0) << s.output;
    const nlohmann::json p = nlohmann::json::parse(s.output.substr(s.output.rfind("\n{") + 1));
    EXPECT_EQ(p.at("tensor").get<int>(), c.tensor) << run;
    EXPECT_EQ(p.at("data").get<int>(), c.ranks / c.tensor) << run;
    const double predicted = p.at("tensor_allreduce_bytes").get<double>();
    EXPECT_GT(predicted, 0) << run;
    int lines = 0;
    for (const nlohmann::json& j : testing::step_lines(dir / (run + "/metrics.jsonl"))) {
      ++lines;
      EXPECT_EQ(j.value("tensor_allreduce_bytes", int64_t{-1}), static_cast<int64_t>(predicted)) << run << " " << sets;
    }
    EXPECT_EQ(lines, 3) << run;
  }
}

// Expert parallelism: the bytes the simulator says a rank sends in its expert group's all-to-alls
// per step are the trainer's own count (metrics.jsonl expert_alltoall_bytes) on 2 ranks with
// parallel.expert = 2: every token routed to all 4 experts (top-k = experts, so that each rank
// receives exactly what it sends: the simulator's balanced routing), 2 micro-batches a step, with
// and without full recomputation (a recomputed block's forward exchanges again).
TEST(Simulate, ExpertAlltoallBytesAreTheTrainers) {
  testing::TempDir dir("keel-sim-ep");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 3);
  std::string text = read_text_file(kCluster);
  text.replace(text.find("nodes = 4"), 9, "nodes = 1");
  text.replace(text.find("devices_per_node = 8"), 20, "devices_per_node = 2");
  text.replace(text.find("nics_per_node = 8"), 17, "nics_per_node = 2");
  const std::string cluster = dir / "cluster2.toml";
  testing::write_text(cluster, text);
  const std::string moe = "--set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32 "
                          "--set model.moe_top_k=4 --set train.eval_every=0 --set train.grad_accum=2 "
                          "--set parallel.expert=2 ";
  const std::vector<std::string> extras = {"", "--set train.recompute=full"};
  double first = 0;
  for (size_t i = 0; i < extras.size(); ++i) {
    const std::string run = "e" + std::to_string(i), sets = moe + extras[i];
    const testing::CommandResult r = testing::run_keel(testing::toy_train_args(dir, 2, 2, run, sets));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const testing::CommandResult s = testing::run_keel("simulate --cluster " + cluster + " --json yes --config " +
                                                       dir / "toy.toml" + " --set train.batch_size=2 " + sets);
    ASSERT_EQ(s.exit_code, 0) << s.output;
    const nlohmann::json p = nlohmann::json::parse(s.output.substr(s.output.rfind("\n{") + 1));
    EXPECT_EQ(p.at("expert").get<int>(), 2) << run;
    const double predicted = p.at("expert_alltoall_bytes").get<double>();
    EXPECT_GT(predicted, 0) << run;
    EXPECT_GT(p.at("expert_comm_ms").get<double>(), 0) << run;
    if (i == 0) first = predicted;
    if (i == 1) {
      EXPECT_GT(predicted, first) << "a recomputed block exchanges its forward again";
    }
    int lines = 0;
    for (const nlohmann::json& j : testing::step_lines(dir / (run + "/metrics.jsonl"))) {
      ++lines;
      EXPECT_EQ(j.value("expert_alltoall_bytes", int64_t{-1}), static_cast<int64_t>(predicted)) << run << " " << sets;
    }
    EXPECT_EQ(lines, 3) << run;
  }
}

// kCluster as one node of `ranks` devices (each with its NIC), written into `dir`: the cluster
// file the trainer's runs of that many ranks on this machine are predicted on.
std::string write_one_node_cluster(const testing::TempDir& dir, int ranks) {
  std::string text = read_text_file(kCluster);
  text.replace(text.find("nodes = 4"), 9, "nodes = 1");
  text.replace(text.find("devices_per_node = 8"), 20, "devices_per_node = " + std::to_string(ranks));
  text.replace(text.find("nics_per_node = 8"), 17, "nics_per_node = " + std::to_string(ranks));
  const std::string cluster = dir / ("cluster" + std::to_string(ranks) + ".toml");
  testing::write_text(cluster, text);
  return cluster;
}

// Sharded experts (parallel.expert = P: a rank holds E / P routed experts): the simulator's
// parameter bytes per rank and data-parallel sync bytes per step are the trainer's own counts
// (metrics.jsonl param_bytes, sync_sent_bytes) on 2 ranks with P = 2 (each expert held by one rank:
// its gradient is not summed) and 4 ranks with P = 2 (each expert summed over 2 ranks), under
// ZeRO-0, and under ZeRO-1, -2 and -3 (experts' chunks shared out over the ranks holding them: their
// gradients reduced and their parameters gathered over those ranks, not the data group).
TEST(Simulate, ShardedExpertBytesAreTheTrainers) {
  testing::TempDir dir("keel-sim-eps");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 3);
  const std::string model = "--set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32 "
                            "--set train.eval_every=0 ";
  double whole = 0;
  for (int zero : {0, 1, 2, 3}) {
    const std::string moe = model + "--set parallel.expert=2 --set parallel.zero=" + std::to_string(zero) + " ";
    for (int ranks : {2, 4}) {
      const std::string cluster = write_one_node_cluster(dir, ranks);
      const std::string run = "s" + std::to_string(ranks) + "z" + std::to_string(zero);
      const testing::CommandResult r = testing::run_keel(testing::toy_train_args(dir, ranks, 2, run, moe));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      auto predict = [&](const std::string& sets) {
        const testing::CommandResult s = testing::run_keel("simulate --cluster " + cluster + " --json yes --config " +
                                                           dir / "toy.toml" + " --set train.batch_size=2 " + sets);
        EXPECT_EQ(s.exit_code, 0) << s.output;
        return nlohmann::json::parse(s.output.substr(s.output.rfind("\n{") + 1));
      };
      const nlohmann::json p = predict(moe);
      // Every expert on every rank (no expert parallelism): more parameters, more sync.
      const nlohmann::json all = predict(model + "--set parallel.zero=" + std::to_string(zero));
      EXPECT_LT(p.at("param_bytes").get<double>(), all.at("param_bytes").get<double>()) << run;
      EXPECT_LT(p.at("sync_sent_bytes").get<double>(), all.at("sync_sent_bytes").get<double>()) << run;
      int lines = 0;
      for (const nlohmann::json& j : testing::step_lines(dir / (run + "/metrics.jsonl"))) {
        ++lines;
        EXPECT_EQ(j.value("param_bytes", int64_t{-1}), static_cast<int64_t>(p.at("param_bytes").get<double>())) << run;
        EXPECT_EQ(j.value("model_param_bytes", int64_t{-1}), static_cast<int64_t>(all.at("param_bytes").get<double>())) << run;
        whole = j.value("model_param_bytes", 0.0);
        EXPECT_NEAR(j.value("sync_sent_bytes", -1.0), p.at("sync_sent_bytes").get<double>(), 0.5) << run;
        if (zero == 3) {
          // The step's gathers (Zero3GatherBytesAreTheTrainers below): what the ranks received of
          // each other's parameters, on average, every step.
          double mean = 0;
          for (const nlohmann::json& b : j.at("zero3_gathered_bytes")) mean += b.get<double>() / ranks;
          EXPECT_NEAR(mean, p.at("param_gather_bytes").get<double>(), 0.5) << run << " step " << j.at("step");
        }
      }
      EXPECT_EQ(lines, 3) << run;
    }
  }
  EXPECT_GT(whole, 0);
}

// ZeRO-3's gathers as the simulator counts them (param_gather_bytes) are what the ranks received
// of each other's parameters (zero3_gathered_bytes, on average over the ranks: a rank's own share
// is whole chunks, not exactly 1/n), per step: every micro-batch gathers each block and the head
// before its forward and its backward-input pass, the embedding before its forward only (its
// backward reads no parameter), and a tied head's two leases hold the embedding's chunks too.
// llama (untied) and GPT-2 (tied), 2 and 4 ranks, 1 and 2 micro-batches, every step of 4 with an
// evaluation before the first and after the second (train.eval_every = 2): a step's broadcasts
// ahead follow the last step's schedule, not the evaluation's between them (which had the step
// after the evaluation's successor broadcast one more embedding ahead, the evaluation's next
// batch's), and an evaluation's gathers are its own figure (zero3_eval_gathered_bytes), not the
// next step's.
TEST(Simulate, Zero3GatherBytesAreTheTrainers) {
  testing::TempDir dir("keel-sim-z3g");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 4);
  for (const std::string family : {"llama", "gpt"}) {
    const std::string model = (family == "llama" ? "--set model.preset=llama-tiny --set model.vocab_size=64 "
                                                   "--set model.max_seq_len=32 "
                                                 : "") + std::string("--set train.eval_every=2 --set parallel.zero=3 ");
    for (int ranks : {2, 4}) {
      for (int micro : {1, 2}) {
        const std::string cluster = write_one_node_cluster(dir, ranks);
        const std::string sets = model + "--set train.grad_accum=" + std::to_string(micro) + " ";
        const std::string run = family + std::to_string(ranks) + "m" + std::to_string(micro);
        const testing::CommandResult r = testing::run_keel(testing::toy_train_args(dir, ranks, 2, run, sets));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        const testing::CommandResult s = testing::run_keel("simulate --cluster " + cluster + " --json yes --config " +
                                                           dir / "toy.toml" + " --set train.batch_size=2 " + sets);
        ASSERT_EQ(s.exit_code, 0) << s.output;
        const double predicted =
            nlohmann::json::parse(s.output.substr(s.output.rfind("\n{") + 1)).at("param_gather_bytes").get<double>();
        EXPECT_GT(predicted, 0) << run;
        int lines = 0;
        for (const nlohmann::json& j : testing::step_lines(dir / (run + "/metrics.jsonl"))) {
          ++lines;
          double mean = 0;
          for (const nlohmann::json& b : j.at("zero3_gathered_bytes")) mean += b.get<double>() / ranks;
          EXPECT_NEAR(mean, predicted, 0.5) << run << " step " << j.at("step");
          // (an evaluation ran before steps 1 and 3)
          const bool evaluated = j.at("step").get<int>() % 2 == 1;
          for (const nlohmann::json& b : j.at("zero3_eval_gathered_bytes")) {
            EXPECT_EQ(b.get<double>() > 0, evaluated) << run << " step " << j.at("step");
          }
        }
        EXPECT_EQ(lines, 4) << run;
      }
    }
  }
}

// A cluster file's measured rates of the library's other collectives price those collectives only:
// the pipeline's tied-embedding sum (one blocking all-reduce between the two stages) at
// blocking_allreduce_gbit, ZeRO-1/2's parameter all-gather at allgather_gbit, ZeRO-2's bucketed
// reduce-scatter at reduce_scatter_gbit, each a ring's bytes at that rate (hand-computed from the
// prediction's own bytes); an all-reducing ZeRO-0 step is unchanged by all three.
TEST(Simulate, EachCollectiveAtItsMeasuredRate) {
  // This machine as the calibration describes it: every rank a node of one device, 0.5 Gbit/s.
  std::string base = read_text_file(kCluster);
  base.replace(base.find("nodes = 4 "), 10, "nodes = 2 ");
  base.replace(base.find("devices_per_node = 8"), 20, "devices_per_node = 1");
  base.replace(base.find("gbit = 200"), 10, "gbit = 0.5");
  base.replace(base.find("nics_per_node = 8"), 17, "nics_per_node = 1");
  base.replace(base.find("topology = \"rail\""), 17, "topology = \"fat-tree\"");
  auto predict = [&](const std::vector<std::string>& sets, const std::string& network_keys) {
    Config config = Config::load("", sets);
    resolve_job_config(config, 2);
    std::string text = base;
    text.insert(text.find("oversubscription = 1"), network_keys);
    return sim::predict_step(config, sim::Cluster::parse(text, "rates"), sim::SimLayout{});
  };
  const std::vector<std::string> job = {"model.preset=d4", "train.batch_size=2", "train.grad_accum=4", "train.seq_len=128"};
  const double gbs = 0.5 / 8 * 1e9;  // the network's bytes per second
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), job.begin(), job.end());
    return more;
  };
  // The tied tensor's gradient: wte (padded vocabulary x C floats; not the position embedding),
  // each rank sending all of it once (a ring of two) at the blocking all-reduce's rate.
  Config d4 = Config::load("", job);
  resolve_job_config(d4, 2);
  const double tied_bytes = static_cast<double>(d4.model.padded_vocab_size) * d4.model.n_embd * 4;
  ASSERT_GT(tied_bytes, 8e6);
  const std::vector<std::string> pipe = with({"parallel.pipeline=2", "parallel.schedule=1f1b"});
  const sim::StepPrediction tied = predict(pipe, ""), tied_fast = predict(pipe, "blocking_allreduce_gbit = 2\n");
  EXPECT_EQ(tied.pipeline, 2);
  EXPECT_NEAR(tied.sync_exposed_ms - tied_fast.sync_exposed_ms, tied_bytes / gbs * 1e3 * (1 - 0.25), 1e-6);
  // (the step: the same, within the cluster file's amortized checkpoint share)
  EXPECT_NEAR(tied.step_ms - tied_fast.step_ms, tied_bytes / gbs * 1e3 * (1 - 0.25), 1e-5 * tied.step_ms);
  // ZeRO-1: all-reduce (2 (n-1)/n = 1 of the bytes) then all-gather (1/2 of them).
  const sim::StepPrediction z1 = predict(with({"parallel.zero=1"}), ""),
                            z1_fast = predict(with({"parallel.zero=1"}), "allgather_gbit = 1\n");
  const double raw1 = z1.sync_sent_bytes;
  EXPECT_NEAR(z1.param_gather_bytes, raw1 / 2, 1e-6);
  EXPECT_NEAR(z1.sync_ms - z1_fast.sync_ms, raw1 / 2 / gbs * 1e3 * (1 - 0.5), 1e-6);
  // ZeRO-2: reduce-scatter (1/2) and all-gather (1/2).
  const sim::StepPrediction z2 = predict(with({"parallel.zero=2"}), ""),
                            z2_rs = predict(with({"parallel.zero=2"}), "reduce_scatter_gbit = 0.25\n"),
                            z2_ag = predict(with({"parallel.zero=2"}), "allgather_gbit = 1\n");
  const double raw2 = 2 * z2.sync_sent_bytes;
  EXPECT_NEAR(z2.param_gather_bytes, raw2 / 2, 1e-6);
  EXPECT_NEAR(raw2, raw1, 1e-6);
  EXPECT_NEAR(z2_rs.sync_ms - z2.sync_ms, raw2 / 2 / gbs * 1e3 * (2 - 1), 1e-6);
  EXPECT_NEAR(z2.sync_ms - z2_ag.sync_ms, raw2 / 2 / gbs * 1e3 * (1 - 0.5), 1e-6);
  // ZeRO-0 all-reduces only, without a tied sum: none of the three applies.
  const sim::StepPrediction z0 = predict(job, ""),
                            z0_all = predict(job, "reduce_scatter_gbit = 0.25\nallgather_gbit = 1\nblocking_allreduce_gbit = 2\n");
  EXPECT_EQ(z0.step_ms, z0_all.step_ms);
  EXPECT_GT(z0.sync_ms, 0);
  std::string negative = base;
  negative.insert(negative.find("oversubscription = 1"), "allgather_gbit = -1\n");
  EXPECT_THROW(sim::Cluster::parse(negative, "negative"), Error);
}

TEST(Simulate, BadInputIsOneLine) {
  testing::TempDir dir("keel-sim");
  const std::string good = read_text_file(kCluster);
  struct Case {
    std::string file, args, needle;
  };
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  std::string stacks_text = read_text_file(testing::source_path("configs/sim/stacks.toml"));
  stacks_text.replace(stacks_text.find("collective = \"nccl\""), 20, "collective = \"mpi\"");
  const std::string bad_stacks = dir.path() + "/stacks.toml";
  testing::write_text(bad_stacks, stacks_text);
  const std::string original = read_text_file(testing::source_path("configs/sim/stacks.toml"));
  std::string short_text = original, extra_text = original;
  short_text.erase(short_text.find("flash_attention = false"), 23);
  extra_text.insert(extra_text.find("flash_attention = false"), "bucket_size = 3\n");
  const std::string short_stacks = dir.path() + "/short.toml", extra_stacks = dir.path() + "/extra.toml";
  testing::write_text(short_stacks, short_text);
  testing::write_text(extra_stacks, extra_text);
  std::string negative_text = original;
  negative_text.replace(negative_text.find("block_pass_ms = 2.68"), 20, "block_pass_ms = -1");
  const std::string negative_stacks = dir.path() + "/negative.toml";
  testing::write_text(negative_stacks, negative_text);
  const std::vector<Case> cases = {
      {edit("hbm_gbps = 2039", ""), "", "missing key 'device.hbm_gbps'"},
      {edit("hbm_gbps = 2039", "hbm_gbps = -1"), "", "key 'device.hbm_gbps': expected > 0"},
      {edit("gbit = 200", "gbit = \"fast\""), "", "key 'network.gbit': expected a number"},
      {edit("latency_us = 5", "latency_us = 5\nspeed = 3"), "", "unknown key 'network.speed'"},
      {edit("topology = \"rail\"", "topology = \"torus\""), "", "key 'network.topology': expected one of"},
      {edit("nics_per_node = 8", "nics_per_node = 4"), "", "a rail topology has one NIC per device"},
      {edit("nodes = 4 ", "nodes = 2.5 "), "", "key 'cluster.nodes': expected a whole number"},
      {edit("[device]", "[device"), "", "cluster file"},
      {good, "--set parallel.pipeline=32 --set model.preset=tiny", "parallel.pipeline"},
      {good, "--tensor 3", "simulate --tensor"},
      {good, "--set model.preset=gpt2-1.5b --set train.batch_size=64", "GiB per device"},
      {edit("[reliability]", "[codecs]\nzstd_encode = 3\n\n[reliability]"), "", "unknown key 'codecs.zstd_encode'"},
      {edit("hbm_gbps = 2039", "hbm_gbps = 2039\nstep_overhead_ms = \"x\""), "",
       "key 'device.step_overhead_ms': expected a number"},
      {good, "--search maybe", "simulate --search: expected yes or no"},
      {good, "--search yes --top 0", "simulate --top: expected >= 1"},
      {good, "--search yes --tensor 2", "simulate --search: searches tensor degrees"},
      {good, "--probe sometimes", "simulate --probe: expected yes or no"},
      {good, "--tiers maybe", "simulate --tiers: expected yes or no"},
      {good, "--overlap-sync later", "simulate --overlap-sync: expected yes or no"},
      {good, "--search yes --tiers yes", "simulate --search: searches tensor degrees, recomputation and memory tiers"},
      {good, "--set model.preset=gpt2-1.5b --set train.batch_size=64", "--tiers yes homes pages"},
      {edit("memory_gbps = 300", ""), "--tiers yes", "no 'host.memory_gbps'"},
      {edit("nvme_tib = 3.5", "nvme_tib = 0.00001"), "--tiers yes", "of pages go to NVMe per device, the node's drives give each"},
      {edit("nvme_drives = 4", "nvme_drives = 0"), "--tiers yes", "but the cluster has no NVMe drives (host.nvme_drives)"},
      {edit("memory_gib = 80", "memory_gib = 1.5"), "--tiers yes --set train.batch_size=64", "leaves nothing for pages"},
      {edit("gemm_efficiency = [[256, 0.50], [512, 0.833]", "gemm_efficiency = [[512, 0.50], [256, 0.833]"), "",
       "key 'device.gemm_efficiency': expected dimensions >= 1 and increasing, found 256"},
      {edit("[1024, 0.869]", "[1024, 1.869]"), "", "key 'device.gemm_efficiency': expected shares in (0, 1], found 1.869"},
      {edit("gemm_efficiency = ", "gemm_efficiency_x = "), "", "unknown key 'device.gemm_efficiency_x'"},
      {good, "--stack nope --stacks " + testing::source_path("configs/sim/stacks.toml"), "no stack 'nope' (expected one of"},
      {good, "--stack torchtitan --stacks /nonexistent.toml", "file /nonexistent.toml"},
      {good, "--stack megatron-2021 --stacks " + bad_stacks,
       "stack.megatron-2021: key 'collective': expected \"ring\", \"nccl\" or \"hierarchical\", found \"mpi\""},
      {good, "--stack megatron-2021 --stacks " + short_stacks, "stack.megatron-2021: key 'flash_attention': expected true or false"},
      {good, "--stack megatron-2021 --stacks " + extra_stacks, "stack.megatron-2021: unknown key 'bucket_size'"},
      {good, "--stack llm-foundry --stacks " + negative_stacks, "stack.llm-foundry: key 'block_pass_ms': expected >= 0 and <= 1000, found -1"},
      {good, "--vocab 1", "simulate --vocab: expected >= 2, found 1"},
      {good, "--set parallel.tensor=2 --tensor 4", "simulate --tensor: expected the config's parallel.tensor (2) or 1, found 4"},
      {good, "--tiers yes --stack torchtitan --stacks " + testing::source_path("configs/sim/stacks.toml"), "no --stack with it"},
      {good, "--search yes --stack torchtitan --stacks " + testing::source_path("configs/sim/stacks.toml"), "no --stack or --vocab with it"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir.path() + "/c" + std::to_string(i) + ".toml";
    testing::write_text(path, cases[i].file);
    const testing::CommandResult r = testing::run_keel("simulate --cluster " + path + " " + cases[i].args);
    EXPECT_EQ(r.exit_code, 2) << cases[i].needle << "\n" << r.output;
    const std::string last = r.output.substr(r.output.rfind("keel: "));
    EXPECT_NE(last.find(cases[i].needle), std::string::npos) << r.output;
    EXPECT_EQ(std::count(last.begin(), last.end(), '\n'), 1) << last;
  }
}

}  // namespace
}  // namespace keel
