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
      {edit("matmul_efficiency = 0.66", "matmul_efficiency = 0.66\nstep_overhead_ms = \"x\""), "",
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
