// Re-cutting a pipeline while it trains (pipeline/repartitioner.h, pipeline/stage_migration.h):
// every parallel.repartition_every steps the partitioner proposes a cut from the measured layer
// costs; when the stages move, parameters, AdamW moments and versions travel between ranks over
// MPI and the stages' components are rebuilt. Exact: a run re-cut at step k ends with the bytes of
// a run that used the new cut from step k on (resumed from the first run's step-k checkpoint with
// that cut as its stage_boundaries) — with data parallelism and ZeRO-1 too, where the moments'
// shards change owners. At one thread per rank a pipeline computes one rank's bytes, so there
// both also equal the uninterrupted one-rank run.
//
// Which cut the partitioner proposes depends on measured times; the runs start from a cut with
// the embedding alone on the first stage (every measurement calls it unbalanced) and a threshold of
// 0, and each test reads the cut it moved to from metrics.jsonl.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/manifest.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

class Repartition : public ::testing::Test {
 protected:
  static constexpr int kSteps = 7;
  // A decision every 4 steps on the layer profiler's report of that step, by the exact partitioner,
  // moving for any predicted gain.
  static constexpr const char* kRecut = " --set parallel.repartition_every=4 --set monitor.layer_costs_every=2"
                                        " --set parallel.partitioner=dp --set parallel.repartition_threshold=0";
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), kSteps);
  }
  std::string at(const std::string& run) const { return dir.path() + "/" + run; }
  testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    const std::string a = "train --config " + dir.path() + "/toy.toml --set train.run_dir=" + at(run) +
                          " --set train.eval_every=0 --set runtime.threads=1 --set train.batch_size=2"
                          " --set train.grad_accum=4 " + extra;
    return testing::run_keel(ranks <= 1 ? a : "launch -n " + std::to_string(ranks) + " -- " + a);
  }
  // The lines of a run's metrics.jsonl that are `event` events ("": the step lines).
  std::vector<nlohmann::json> lines(const std::string& run, const std::string& event) const {
    std::vector<nlohmann::json> out;
    const std::string text = read_text_file(at(run) + "/metrics.jsonl");
    for (size_t p = 0; p < text.size();) {
      const size_t e = std::min(text.find('\n', p), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(p, e - p));
      if (event.empty() ? j.contains("loss") && !j.contains("event") : j.value("event", "") == event) out.push_back(j);
      p = e + 1;
    }
    return out;
  }
  std::vector<nlohmann::json> decisions(const std::string& run) const { return lines(run, "repartition"); }
  // The chunk versions the newest checkpoint of a run records.
  std::vector<uint64_t> versions(const std::string& run) const {
    const nlohmann::json m = nlohmann::json::parse(read_text_file(testing::newest_checkpoint(at(run) + "/ckpt") + "/manifest.json"));
    std::vector<uint64_t> out;
    for (const nlohmann::json& c : m.at("chunks")) out.push_back(c.at("version").get<uint64_t>());
    return out;
  }
  void expect_same_state(const std::string& a, const std::string& b) const {
    for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_TRUE(testing::checkpoint_bytes(at(a) + "/ckpt", p) == testing::checkpoint_bytes(at(b) + "/ckpt", p))
          << a << " vs " << b << ": plane " << static_cast<int>(p);
    }
    EXPECT_EQ(versions(a), versions(b)) << a << " vs " << b;
  }
  // Run `moved` re-cuts at step 4 (checkpointing there), then the same from its step-4
  // checkpoint with the new cut fixed: the same final state, the same losses after step 4.
  void expect_recut_exact(int ranks, const std::string& layout) {
    const std::string recut = layout + kRecut +
                              " --set train.checkpoint_every=4";
    const testing::CommandResult a = train(ranks, "moved", recut);
    ASSERT_EQ(a.exit_code, 0) << a.output;
    const std::vector<nlohmann::json> d = decisions("moved");
    ASSERT_EQ(d.size(), 1u) << a.output;  // at step 4 (none in the last interval)
    ASSERT_TRUE(d[0].at("moved").get<bool>()) << d[0].dump();
    EXPECT_EQ(d[0].at("step").get<int>(), 4);
    EXPECT_EQ(d[0].at("from").get<std::string>(), "1");
    EXPECT_GT(d[0].at("move_ms").get<double>(), 0) << d[0].dump();
    EXPECT_GT(d[0].at("bytes_sent").get<double>(), 0) << d[0].dump();
    const std::string to = d[0].at("proposed").get<std::string>();
    EXPECT_NE(a.output.find("stages re-cut 1 -> " + to), std::string::npos) << a.output;
    const testing::CommandResult b = train(ranks, "fixed", layout + " --set parallel.stage_boundaries=" + to +
                                                               " --set train.resume=" + at("moved") + "/ckpt/step-00000004");
    ASSERT_EQ(b.exit_code, 0) << b.output;
    fixed_output = b.output;
    expect_same_state("moved", "fixed");
    const std::vector<double> la = testing::step_losses(at("moved") + "/metrics.jsonl"),
                              lb = testing::step_losses(at("fixed") + "/metrics.jsonl");
    ASSERT_EQ(la.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(lb.size(), static_cast<size_t>(kSteps - 4));
    for (int i = 0; i < kSteps - 4; ++i) EXPECT_EQ(la[4 + i], lb[i]) << "step " << 5 + i;
  }
  testing::TempDir dir{"keel-recut"};
  std::string fixed_output;  // of expect_recut_exact's run with the new cut from step 4
};

// Two stages of llama (untied): the moved run, the run with the new cut from step 4, and one rank
// uninterrupted end with the same bytes.
TEST_F(Repartition, AStageMoveMidRunEndsWithTheBytesOfTheNewCutFromThatStep) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32";
  expect_recut_exact(2, llama + " --set parallel.pipeline=2 --set parallel.stage_boundaries=1");
  const testing::CommandResult one = train(1, "one", llama);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_same_state("moved", "one");
}

// ZB-V: each rank holds two stages (the V's two ends), and the re-cut moves boundaries of both.
// Six blocks cut "1,2,3": rank 0 holds the embedding and blocks 3-6 with the head, rank 1 only
// blocks 1 and 2, an imbalance no timing noise hides.
TEST_F(Repartition, ReCutsTwoStagesPerRankUnderZbV) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
                            " --set model.n_layer=6";
  const testing::CommandResult a = train(2, "zbv", llama + " --set parallel.pipeline=2 --set parallel.schedule=zb-v"
                                                           " --set parallel.stage_boundaries=1,2,3" + kRecut);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::vector<nlohmann::json> d = decisions("zbv");
  ASSERT_EQ(d.size(), 1u);
  ASSERT_TRUE(d[0].at("moved").get<bool>()) << d[0].dump();
  ASSERT_EQ(train(1, "one", llama).exit_code, 0);
  expect_same_state("zbv", "one");
}

// With memory tiers (pages between a 1 MiB device budget, host and an NVMe file): the new stages'
// tiers are built before the state moves in, page by page through their leases.
TEST_F(Repartition, MovesStateIntoTieredStagesExactly) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32";
  const testing::CommandResult a = train(2, "tiered", llama + " --set parallel.pipeline=2 --set parallel.stage_boundaries=1" + kRecut +
                                                              " --set tier.device_mib=1 --set tier.host_mib=1 --set tier.nvme_dir=" + dir.path());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(decisions("tiered").size(), 1u);
  EXPECT_TRUE(decisions("tiered")[0].at("moved").get<bool>());
  ASSERT_EQ(train(1, "one", llama).exit_code, 0);
  expect_same_state("tiered", "one");
}

// 2 x 2 (two replicas of two stages) with ZeRO-1, GPT-2 (wte tied between the embedding's and the
// head's stage, its replica moving with the head): the moments' shards are cut anew with the
// stages and change owners between replicas.
TEST_F(Repartition, MovesShardedMomentsBetweenReplicasExactly) {
  expect_recut_exact(4, "--set parallel.pipeline=2 --set parallel.zero=1 --set parallel.stage_boundaries=1"
                        " --set train.batch_size=1");
}

// A shifting workload: optim.freeze_at_step freezes the first layers mid-run. Before that step they
// train; from it on their parameters, moments and versions stand still (and a pipeline's early
// stages get lighter: what a re-cut then follows). The same in a PP = 2 run whose second rank is
// slowed twofold (runtime.slow_factor: sleeps only) and that re-cuts at that step: exact against
// one rank, and the slow rank ends with fewer layers than it started with.
// Compressed sync (HybridGC's top-k with error feedback) on 2 x 2, GPT-2 (the head's stage holds
// a replica of the tied wte, with buckets of its own): every bucket's residual travels with its
// layer, keyed by layer and position among the layer's buckets, and a checkpoint resumed under the
// new cut carries them by the same keys, so the moved run is still the resumed one. Residuals
// dropped instead (the step-4 checkpoint without them) end elsewhere: they did travel.
TEST_F(Repartition, CarriesCompressionResidualsWithTheirLayers) {
  const std::string layout = "--set parallel.pipeline=2 --set parallel.stage_boundaries=1 --set train.batch_size=1"
                             " --set sync.codec=topk --set sync.warmup_steps=0";
  expect_recut_exact(4, layout);
  const nlohmann::json moved = decisions("moved")[0].at("compression_residuals");
  EXPECT_GT(moved.at("buckets").get<int>(), 2) << moved.dump();
  EXPECT_EQ(moved.at("moved"), moved.at("buckets")) << moved.dump();
  const std::string n = std::to_string(moved.at("buckets").get<int>());
  EXPECT_NE(fixed_output.find("carried by key into " + n + " of " + n + " buckets"), std::string::npos) << fixed_output;
  // The step-4 checkpoint again, its residuals taken out of the manifest.
  const std::string copy = at("stripped-ckpt");
  std::filesystem::copy(at("moved") + "/ckpt", copy, std::filesystem::copy_options::recursive);
  const std::string manifest = copy + "/step-00000004/manifest.json";
  nlohmann::json m = nlohmann::json::parse(read_text_file(manifest));
  for (nlohmann::json& r : m.at("ranks")) {
    ASSERT_TRUE(r.contains("residual"));
    EXPECT_TRUE(r.at("residual").contains("keys"));
    r.erase("residual");
  }
  testing::write_text(manifest, seal_manifest(m.dump(1)));
  const std::string to = decisions("moved")[0].at("proposed").get<std::string>();
  const testing::CommandResult dropped = train(4, "dropped", layout + " --set parallel.stage_boundaries=" + to +
                                                                 " --set train.resume=" + copy + "/step-00000004");
  ASSERT_EQ(dropped.exit_code, 0) << dropped.output;
  EXPECT_NE(dropped.output.find("compression residuals dropped"), std::string::npos) << dropped.output;
  EXPECT_FALSE(testing::checkpoint_bytes(at("moved") + "/ckpt", Plane::param) ==
               testing::checkpoint_bytes(at("dropped") + "/ckpt", Plane::param));
}

TEST_F(Repartition, LayersFrozenMidRunStopFromThatStep) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32";
  const std::string freeze = " --set optim.freeze_layers=2 --set optim.freeze_at_step=4 --set train.checkpoint_every=2";
  const testing::CommandResult one = train(1, "one", llama + freeze);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string root = at("one") + "/ckpt";
  const nlohmann::json m = nlohmann::json::parse(read_text_file(root + "/step-00000004/manifest.json"));
  auto plane = [&](const std::string& step, Plane p) { return read_checkpoint_plane(root + "/step-0000000" + step, p); };
  int frozen_chunks = 0;
  for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    const std::vector<float> at2 = plane("2", p), at4 = plane("4", p), at7 = plane("7", p);
    for (const nlohmann::json& c : m.at("chunks")) {
      const int64_t off = c.at("offset").get<int64_t>(), n = c.at("numel").get<int64_t>();
      const auto range = [&](const std::vector<float>& v) { return std::vector<float>(v.begin() + off, v.begin() + off + n); };
      if (c.at("layer").get<int>() < 2) {
        frozen_chunks += p == Plane::param;
        EXPECT_NE(range(at2), range(at4)) << "chunk " << c.at("id") << " trains before step 4";
        EXPECT_EQ(range(at4), range(at7)) << "chunk " << c.at("id") << " is frozen from step 4";
      } else {
        EXPECT_NE(range(at4), range(at7)) << "chunk " << c.at("id") << " trains on";
      }
    }
  }
  EXPECT_GT(frozen_chunks, 0);
  const testing::CommandResult piped =
      train(2, "piped", llama + freeze + " --set parallel.pipeline=2 --set parallel.stage_boundaries=1" + kRecut +
                                         " --set runtime.slow_rank=1 --set runtime.slow_factor=2");
  ASSERT_EQ(piped.exit_code, 0) << piped.output;
  expect_same_state("piped", "one");
  const std::vector<nlohmann::json> d = decisions("piped");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_TRUE(d[0].at("moved").get<bool>()) << d[0].dump();
  EXPECT_GT(std::stoi(d[0].at("proposed").get<std::string>()), 1) << d[0].dump();
}

// The re-cut is not told which rank is slow: it estimates each rank's factor from the measured
// forward times of its blocks (their median over the FLOP model, against the fastest rank's). Rank 1
// sleeps 4x each layer's time after it (runtime.slow_factor = 5), a margin no contention between
// the two ranks' own speeds comes near; the estimate lands in the event, and the slow rank loses
// blocks. Blocks 512 wide, so that each takes milliseconds (the estimate ignores shorter ones).
TEST_F(Repartition, EstimatesASlowRankFromItsMeasuredLayers) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
                            " --set model.n_layer=4 --set model.n_embd=512 --set model.n_head=8 --set model.n_kv_head=8";
  const testing::CommandResult a = train(2, "slow", llama + " --set parallel.pipeline=2 --set parallel.stage_boundaries=3" + kRecut +
                                                          " --set runtime.slow_rank=1 --set runtime.slow_factor=5");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::vector<nlohmann::json> d = decisions("slow");
  ASSERT_EQ(d.size(), 1u);
  const std::vector<double> slow = d[0].at("rank_slowdown").get<std::vector<double>>();
  ASSERT_EQ(slow.size(), 2u) << d[0].dump();
  EXPECT_EQ(slow[0], 1.0) << d[0].dump();
  EXPECT_GT(slow[1], 1.5) << d[0].dump();
  EXPECT_GT(std::stoi(d[0].at("proposed").get<std::string>()), 3) << d[0].dump();
}

// A sequence-length curriculum (train.seq_len_schedule): 16 tokens for three steps, then 32. The
// loader reads the windows of 32 in halves, three a step, so the step-1 checkpoint stands mid-window; runs
// resumed from it and from the step of the switch end with the uninterrupted run's bytes.
TEST_F(Repartition, ACurriculumDoublesTheLengthAndResumesExactlyAcrossIt) {
  const std::string curriculum = "--set train.seq_len=16 --set train.seq_len_schedule=3:32 --set checkpoint.keep=10"
                                 " --set train.checkpoint_every=1 --set train.grad_accum=3";
  const testing::CommandResult a = train(1, "whole", curriculum);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("sequence-length curriculum: 16 in steps 1-3, 32 from step 4"), std::string::npos) << a.output;
  const std::vector<nlohmann::json> steps = lines("whole", "");
  ASSERT_EQ(steps.size(), static_cast<size_t>(kSteps));
  for (int k = 0; k < kSteps; ++k) EXPECT_EQ(steps[k].at("seq_len").get<int>(), k < 3 ? 16 : 32) << "step " << k + 1;
  const nlohmann::json m1 = nlohmann::json::parse(read_text_file(at("whole") + "/ckpt/step-00000001/manifest.json"));
  EXPECT_GT(m1.at("ranks").at(0).at("data").value("offset", 0), 0) << m1.at("ranks").dump();
  for (const std::string step : {"1", "3"}) {
    const testing::CommandResult b =
        train(1, "from" + step, curriculum + " --set train.resume=" + at("whole") + "/ckpt/step-0000000" + step);
    ASSERT_EQ(b.exit_code, 0) << b.output;
    expect_same_state("whole", "from" + step);
  }
}

// Two stages of llama under the same curriculum (16, then 32 from step 5), re-cut when the length
// doubles: the decision at step 4 predicts the coming interval at 32 tokens; the moved run, the run
// with the new cut from step 4 and one rank end with the same bytes.
TEST_F(Repartition, ReCutsWhenACurriculumLengthensTheSequences) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
                            " --set train.seq_len=16 --set train.seq_len_schedule=4:32";
  expect_recut_exact(2, llama + " --set parallel.pipeline=2 --set parallel.stage_boundaries=1");
  EXPECT_EQ(decisions("moved")[0].at("seq_len").get<int>(), 32) << decisions("moved")[0].dump();
  const testing::CommandResult one = train(1, "one", llama);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_same_state("moved", "one");
  // The same stages all along, under 1F1B and ZB-H1 (deferred W): the messages between them
  // double in size mid-run, into buffers sized for the longest.
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    const testing::CommandResult kept = train(2, "kept-" + schedule, llama + " --set parallel.pipeline=2 --set parallel.schedule=" +
                                                                     schedule + " --set parallel.stage_boundaries=2");
    ASSERT_EQ(kept.exit_code, 0) << kept.output;
    expect_same_state("kept-" + schedule, "one");
  }
}

TEST_F(Repartition, BadSettingsAreOneLine) {
  struct Case {
    int ranks;
    std::string set, key;
  };
  const std::vector<Case> cases = {
      {1, "--set parallel.repartition_every=4", "parallel.repartition_every"},
      {2, "--set parallel.pipeline=2 --set parallel.repartition_every=5 --set monitor.layer_costs_every=2",
       "parallel.repartition_every"},
      {2, "--set parallel.pipeline=2 --set parallel.repartition_every=4 --set parallel.predict_gradients=mean",
       "parallel.repartition_every"},
      {2, "--set parallel.pipeline=2 --set parallel.repartition_threshold=1.5", "parallel.repartition_threshold"},
      {2, "--set parallel.pipeline=2 --set parallel.stage_boundaries=1 --set parallel.partitioner=dp",
       "parallel.stage_boundaries"},
      {1, "--set optim.freeze_at_step=-1", "optim.freeze_at_step"},
      {1, "--set train.seq_len=16 --set train.seq_len_schedule=3-32", "train.seq_len_schedule"},
      {1, "--set train.seq_len=16 --set train.seq_len_schedule=4:32,3:16", "train.seq_len_schedule"},
      {1, "--set train.seq_len=16 --set train.seq_len_schedule=3:24", "train.seq_len_schedule"},
      {1, "--set train.seq_len=16 --set train.seq_len_schedule=7:32", "train.seq_len_schedule"},
      {1, "--set train.seq_len=16 --set train.seq_len_schedule=3:64", "train.seq_len_schedule"},
  };
  for (const Case& c : cases) {
    const testing::CommandResult r = train(c.ranks, "bad", c.set);
    EXPECT_NE(r.exit_code, 0) << c.set;
    EXPECT_NE(r.output.find("config key '" + c.key + "'"), std::string::npos) << c.set << "\n" << r.output;
  }
}

}  // namespace
}  // namespace keel
