// A mixture of experts over the memory tiers on 2 ranks (some cases on 4), through the keel binary
// on the toy corpus (llama-moe-tiny at the toy's size: 2 MoE blocks of 4 experts, top-2, one
// shared expert), each against the same layout in memory, bit for bit: a pipeline of 2 stages
// (each tiering its own block; and two replicas of it with expert groups), re-cut too; expert
// parallelism (parallel.expert = 2, each rank holding and tiering only its 2 experts of each
// block, leasing and hinting those that rows were sent to), with the experts homed by routing
// share too, and its checkpoint resumed without expert parallelism, and under ZeRO-1/2 (a
// rank owning its experts' whole state; also with bf16 training state, on one stage and in a
// pipeline); ZeRO-3 (the gathered layer in the compute tier, a rank's shard homed by the tiers),
// with and without expert groups (each rank holding and tiering only its 2 experts), resumed, and
// with the experts homed by routing share (gathered apart where several ranks hold each); and
// what stays refused, in one line each.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "moe_runs.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// 2 micro-batches of one sequence of 32 tokens per step and rank; chunks of 64 KiB (an expert's
// weights are 48 KiB: a chunk of its own).
class MoeTiersParallel : public testing::MoeRuns {
 protected:
  static void SetUpTestSuite() {
    start_suite("keel-moe-tiers-parallel", kSteps,
                "--set train.batch_size=1 --set store.chunk_bytes=65536 --set runtime.threads=1");
  }
  static constexpr int kSteps = 6;
  // A compute tier of 1 MiB with 1 MiB of host DRAM and NVMe for the rest.
  static std::string tiers() { return one_mib_tiers(); }
  static testing::CommandResult train(const std::string& run, const std::string& extra, int ranks = 2) {
    return MoeRuns::train(ranks, run, extra);
  }
  // Every step of `run` (from step `first_read` on) moved pages through rank 0's off-device tiers,
  // and every step reported rank 0's experts (`experts`, their numbers in each block), within the
  // compute tier's budget.
  static void expect_tiered(const std::string& run, const std::vector<int>& experts, int first_read = 1) {
    const std::vector<json> got = lines(run);
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << run;
    for (const json& s : got) {
      EXPECT_EQ(s.at("tier_stale_refetches").get<int>(), 0) << run;
      if (s.at("step").get<int>() >= first_read) {
        EXPECT_GT(s.at("tier_nvme_read_bytes").get<double>() + s.at("tier_host_read_bytes").get<double>(), 0)
            << run << " step " << s.at("step");
      }
      EXPECT_LE(s.at("tier_device_resident_bytes").get<double>(), 1 << 20) << run;
      ASSERT_EQ(s.at("tier_experts").size(), 2u) << s;
      for (const json& block : s.at("tier_experts")) {
        EXPECT_EQ(block.at("experts").get<std::vector<int>>(), experts) << run;
        for (const char* key : {"acquires", "hits", "stall_ms", "read_bytes", "home"})
          EXPECT_EQ(block.at(key).size(), experts.size()) << key;
      }
    }
  }
};

// Expert groups of 2 over 2 ranks (each rank holds, tiers and runs experts 0-1 or 2-3 of every
// block): through a 1 MiB compute tier, with the experts' homes as placed and re-homed by
// routing share every 2 steps, the bytes of the same layout in memory. The tiered run's step-4
// checkpoint resumed on the 2 ranks without expert parallelism (every rank every expert, through
// the tiers) gives the bytes of the in-memory run's checkpoint resumed so.
TEST_F(MoeTiersParallel, ExpertGroupsThroughTheTiersTrainTheirBytesInMemory) {
  const std::string ep = "--set parallel.expert=2 --set train.checkpoint_every=4 ";
  testing::CommandResult r = train("ep2", ep);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string& variant : {std::string(""), std::string("--set tier.experts=by_frequency --set tier.experts_every=2 "
                                                                  "--set model.moe_aux_weight=0")}) {
    const std::string reference = variant.empty() ? "ep2" : "ep2-noaux", run = variant.empty() ? "ep2-tiered" : "ep2-freq";
    if (!variant.empty()) {
      r = train(reference, ep + "--set model.moe_aux_weight=0");
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    r = train(run, ep + tiers() + variant);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    expect_same_training(reference, run);
    expect_tiered(run, {0, 1});
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
  }
  // By routing share: re-homed at least once (the plan moves the experts off their placement).
  int rehomed = 0;
  for (const json& s : lines("ep2-freq")) rehomed += s.contains("tier_experts_rehomed") ? 1 : 0;
  EXPECT_GE(rehomed, 1);

  const std::string from = " --set train.resume=", step4 = "/ckpt/step-00000004";
  r = train("ep1-resumed", from + at("ep2") + step4);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train("ep1-tiered-resumed", tiers() + from + at("ep2-tiered") + step4);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  expect_same_training("ep1-resumed", "ep1-tiered-resumed");
}

// ZeRO-3 over 2 ranks with the tiers (a rank's shard homed there, each MoE block's whole layer
// gathered into the compute tier, the chosen experts' leases nested in it): the bytes of ZeRO-3
// in memory, without and with expert groups of 2. With expert groups a rank holds, tiers and
// reports only its 2 experts of every block (their only holder: it homes their whole state, and
// its shard of the chunks of no expert), as many bytes of them as in memory; the tiered run's
// step-4 checkpoint resumed through the tiers in the same layout gives the uninterrupted run's bytes.
// So does a pipeline of 2 stages with 2 replicas in expert groups of 2.
TEST_F(MoeTiersParallel, ZeroThreeThroughTheTiersTrainsItsBytesInMemory) {
  for (const bool ep2 : {false, true}) {
    const std::string layout = "--set parallel.zero=3 " +
                               std::string(ep2 ? "--set parallel.expert=2 --set train.checkpoint_every=4 " : "");
    testing::CommandResult r = train("z3", layout);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train("z3-tiered", layout + tiers());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("each runs and holds 2 of every MoE block's 4 experts") != std::string::npos, ep2)
        << r.output;
    expect_same_training("z3", "z3-tiered");
    expect_tiered("z3-tiered", ep2 ? std::vector<int>{0, 1} : std::vector<int>{0, 1, 2, 3});
    if (ep2) {
      const std::vector<json> want = lines("z3"), got = lines("z3-tiered");
      for (size_t i = 0; i < got.size(); ++i) {
        const std::vector<int64_t> held = got[i].at("held_expert_param_bytes");
        for (int64_t h : held) EXPECT_EQ(2 * h, got[i].at("model_expert_param_bytes").get<int64_t>()) << i;
        for (const char* key : {"held_param_bytes", "zero3_param_shard_bytes", "zero3_moment_bytes"}) {
          EXPECT_EQ(got[i].at(key), want[i].at(key)) << key << " step " << i + 1;
        }
      }
      const std::string from = " --set train.resume=" + at("z3-tiered") + "/ckpt/step-00000004";
      r = train("z3-tiered-resumed", layout + tiers() + from);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
      expect_same_checkpoint("z3", "z3-tiered-resumed");
      fs::remove_all(at("z3-tiered-resumed"));
    }
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
    fs::remove_all(at("z3"));
    fs::remove_all(at("z3-tiered"));
  }
  // Two replicas of two stages (4 ranks), each stage's replicas an expert group of 2: a rank holds
  // and tiers its stage's block's 2 experts, and trains the bytes of the same layout in memory.
  const std::string staged = "--set parallel.zero=3 --set parallel.expert=2 --set parallel.pipeline=2 ";
  testing::CommandResult r = train("z3-d2p2", staged, 4);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train("z3-d2p2-tiered", staged + tiers(), 4);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
  expect_same_training("z3-d2p2", "z3-d2p2-tiered");
  expect_tiered("z3-d2p2-tiered", {0, 1}, 2);  // (step 1 of rank 0's stage fits its compute tier)
  EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
  fs::remove_all(at("z3-d2p2"));
  fs::remove_all(at("z3-d2p2-tiered"));
}

// ZeRO-3 with expert groups of 2 on 2 ranks, each rank its experts' only holder (their chunks
// never broadcast: a MoE block leases only its experts that rows were sent to, apart from the
// layer's gather), with the experts re-homed by routing share every 2 steps through a 1 MiB
// compute tier: the bytes of the same layout in memory, re-homed at least once. So with tensor
// groups of 2 (data 2 x tensor 2, 4 ranks: each rank the only holder of its tensor shard of its
// expert group's 2 experts).
TEST_F(MoeTiersParallel, ZeroThreeWithExpertGroupsHomesTheExpertsByRoutingShare) {
  for (const int tensor : {1, 2}) {
    const std::string layout = "--set parallel.zero=3 --set parallel.expert=2 --set model.moe_aux_weight=0 "
                               "--set parallel.tensor=" + std::to_string(tensor) + " ";
    const std::string reference = "z3-ep2-t" + std::to_string(tensor) + "-noaux",
                      run = "z3-ep2-t" + std::to_string(tensor) + "-freq";
    testing::CommandResult r = train(reference, layout, 2 * tensor);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(run, layout + tiers() + "--set tier.experts=by_frequency --set tier.experts_every=2 ", 2 * tensor);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    expect_same_training(reference, run);
    expect_tiered(run, {0, 1}, tensor);  // (with tensor groups step 1 of a rank's shard fits its compute tier)
    int rehomed = 0;
    for (const json& s : lines(run)) rehomed += s.contains("tier_experts_rehomed") ? 1 : 0;
    EXPECT_GE(rehomed, 1) << run;
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
    fs::remove_all(at(reference));
    fs::remove_all(at(run));
  }
}

// ZeRO-3 where several ranks hold each expert, the experts re-homed by routing share every 2 steps
// through a 1 MiB compute tier: a block's holders agree on the experts any of them routed rows to
// and gather only those, one at a time apart from the layer (comm/expert_parallel.h
// experts_gathered_apart), where the same layout in memory gathers every expert with its layer.
// At 8 experts of which each token chooses 1, without expert groups on 2 ranks (each holds every
// expert, its shard of their chunks homed by its tiers), with expert groups of 2 on 4 ranks (two
// holders of each expert), in two replicas of 2 pipeline stages (a stage's replicas hold its
// block's experts) and on 2 ranks with bf16 gradients (the tiers home the experts' parameter pages
// alone): the bytes of the layout in memory, re-homed at least once, no more bytes
// gathered by any rank in any step (fewer where some micro-batch leaves an expert unchosen by all
// of its holders: the runs are deterministic, so the same each time).
TEST_F(MoeTiersParallel, ZeroThreeGathersTheExpertsSomeHolderChoseApartByRoutingShare) {
  struct Case {
    std::string reference, layout;
    int ranks;
    std::vector<int> experts;  // rank 0's
    bool fewer;                // some micro-batch's holders routed no rows to some expert (the same each run)
    int first_read = 1;        // the first step whose pages outgrow rank 0's compute tier
  };
  const std::string eight = "--set model.moe_experts=8 --set model.moe_top_k=1 ";
  const std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
  for (const Case& c : {Case{"z3-d2-noaux", eight, 2, all, true},
                        Case{"z3-d4-ep2-noaux", eight + "--set parallel.expert=2 ", 4, {0, 1, 2, 3}, false, 2},
                        Case{"z3-d2p2-noaux", eight + "--set parallel.pipeline=2 ", 4, all, true, 2},
                        Case{"z3-d2-bf16-grads", eight + "--set runtime.grad_dtype=bf16 ", 2, all, true, 2}}) {
    const std::string layout = "--set parallel.zero=3 --set model.moe_aux_weight=0 " + c.layout;
    const std::string run = c.reference + "-freq";
    testing::CommandResult r = train(c.reference, layout, c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(run, layout + tiers() + "--set tier.experts=by_frequency --set tier.experts_every=2 ", c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training(c.reference, run);
    expect_tiered(run, c.experts, c.first_read);
    const std::vector<json> want = lines(c.reference), got = lines(run);
    int rehomed = 0;
    double gathered = 0, gathered_with_layers = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      rehomed += got[i].contains("tier_experts_rehomed") ? 1 : 0;
      // (per rank of rank 0's data group: the bytes it received)
      const std::vector<int64_t> apart = got[i].at("zero3_gathered_bytes"), whole = want[i].at("zero3_gathered_bytes");
      ASSERT_EQ(apart.size(), whole.size()) << run;
      for (size_t k = 0; k < apart.size(); ++k) {
        EXPECT_LE(apart[k], whole[k]) << run << " step " << i + 1 << " rank " << k;
        gathered += static_cast<double>(apart[k]);
        gathered_with_layers += static_cast<double>(whole[k]);
      }
    }
    EXPECT_GE(rehomed, 1) << run;
    if (c.fewer) {
      EXPECT_LT(gathered, gathered_with_layers) << run;
    }
    std::printf("%s: %.0f bytes gathered, %.0f gathering every expert with its layer\n", run.c_str(), gathered,
                gathered_with_layers);
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
    fs::remove_all(at(c.reference));
    fs::remove_all(at(run));
  }
}

// Expert groups of 2 under ZeRO-1 and ZeRO-2 (each rank holds its 2 experts of every block, the
// chunks of no expert shared out over the data group, an expert's over the ranks holding it:
// ChunkPartition::balanced_experts_apart), through a 1 MiB compute tier, as placed and with the
// experts re-homed by routing share every 2 steps: the bytes of the same layout in memory. On 2
// ranks a rank owns its experts' whole state; on 4 (ZeRO-1, by routing share) two ranks hold each
// expert, and the tiers' chunk-by-chunk update broadcasts an expert chunk from its owner among them.
TEST_F(MoeTiersParallel, ExpertGroupsUnderZeroOneAndTwoThroughTheTiersTrainTheirBytesInMemory) {
  struct Case {
    std::string zero;
    int ranks;
    std::vector<std::string> variants;
  };
  const std::string by_share = "--set tier.experts=by_frequency --set tier.experts_every=2 ";
  for (const Case& c : {Case{"1", 2, {"", by_share}}, Case{"2", 2, {"", by_share}}, Case{"1", 4, {by_share}}}) {
    const std::string zero = c.zero;
    const std::string layout = "--set parallel.expert=2 --set model.moe_aux_weight=0 --set parallel.zero=" + zero + " ";
    const std::string reference = "ep2-zero" + zero + "-r" + std::to_string(c.ranks);
    testing::CommandResult r = train(reference, layout, c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const std::string& variant : c.variants) {
      const std::string run = reference + (variant.empty() ? "-tiered" : "-freq");
      r = train(run, layout + tiers() + variant, c.ranks);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
      expect_same_training(reference, run);
      // (on 4 ranks a rank's first step fits its compute tier: its pages are read back from step 2)
      expect_tiered(run, {0, 1}, c.ranks == 4 ? 2 : 1);
      EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
      fs::remove_all(at(run));
    }
    fs::remove_all(at(reference));
  }
}

// bf16 training state with expert groups of 2 under ZeRO-1 and ZeRO-2 on 2 ranks (each rank holds
// its 2 experts of every block, their bf16 bits and the float32 masters of the chunks it owns
// outside the tiers; the AdamW moments through them), at twice the toy's width so that a rank's
// moments (1.5 MB) outgrow the 1 MiB compute tier, and under ZeRO-1 in two replicas of two
// pipeline stages (each stage's replicas sharing out its experts; at three times the toy's width,
// so that a rank's moments of its stage outgrow the tier too): the bytes of the same layout in
// memory, with pages read back through the off-device tiers once the moments exist.
TEST_F(MoeTiersParallel, Bf16StateWithExpertGroupsUnderZeroOneAndTwoThroughTheTiersTrainsItsBytesInMemory) {
  const std::string layout = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set parallel.expert=2 ";
  struct Case {
    std::string reference, layout;
    int ranks;
  };
  for (const Case& c : {Case{"bf16-ep2-zero1", "--set model.n_embd=128 --set parallel.zero=1", 2},
                        Case{"bf16-ep2-zero2", "--set model.n_embd=128 --set parallel.zero=2", 2},
                        Case{"bf16-ep2-zero1-d2p2",
                             "--set model.n_embd=192 --set parallel.zero=1 --set parallel.pipeline=2", 4}}) {
    const std::string run = c.reference + "-tiered";
    testing::CommandResult r = train(c.reference, layout + c.layout, c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(run, layout + c.layout + tiers(), c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("each runs and holds 2 of every MoE block's 4 experts"), std::string::npos) << r.output;
    expect_same_training(c.reference, run);
    double read = 0;
    for (const json& s : lines(run)) {
      EXPECT_EQ(s.at("tier_stale_refetches").get<int>(), 0) << run;
      EXPECT_LE(s.at("tier_device_resident_bytes").get<double>(), 1 << 20) << run;
      read += s.at("tier_nvme_read_bytes").get<double>() + s.at("tier_host_read_bytes").get<double>();
    }
    EXPECT_GT(read, 0) << run;
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
    fs::remove_all(at(c.reference));
    fs::remove_all(at(run));
  }
}

// A pipeline of 2 stages (each rank holding and tiering its stage's MoE block; the line's
// tier_experts merged over the stages: both blocks), through a 1 MiB compute tier, with the
// experts' homes as placed and re-homed by routing share every 2 steps, and two replicas of it
// with expert groups of 2 (4 ranks, by routing share): the bytes of the same layout in memory.
// Then a re-cut (parallel.repartition_every, at step 4) from the embedding alone on the first
// stage, the second stage's rank slowed threefold: a MoE block moves to the first stage with its
// pages (through the new stage's tiers), its routed pairs since the last plan and its page
// counters (the new stage re-homes its experts by the last plan's shares): the bytes of the same
// re-cuts in memory.
TEST_F(MoeTiersParallel, PipelineStagesThroughTheTiersTrainTheirBytesInMemory) {
  const std::string p2 = "--set parallel.pipeline=2 ";
  const std::string by_frequency = "--set tier.experts=by_frequency --set tier.experts_every=2 ";
  const std::string noaux = "--set model.moe_aux_weight=0 ";
  struct Case {
    std::string reference, run, layout, tiered;
    int ranks = 2;
    std::vector<int> experts = {0, 1, 2, 3};  // rank 0's
  };
  for (const Case& c : {Case{"p2", "p2-tiered", p2, ""}, Case{"p2-noaux", "p2-freq", p2 + noaux, by_frequency},
                        Case{"d2p2-ep2", "d2p2-ep2-freq", p2 + noaux + "--set parallel.expert=2 ", by_frequency, 4,
                             {0, 1}}}) {
    testing::CommandResult r = train(c.reference, c.layout, c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(c.run, c.layout + tiers() + c.tiered, c.ranks);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training(c.reference, c.run);
    // (Rank 0's stage reads nothing off the device in step 1: what it touches then fits the compute tier.)
    expect_tiered(c.run, c.experts, 2);
    for (const json& s : lines(c.run)) {
      EXPECT_EQ(s.at("tier_experts")[0].at("layer").get<int>(), 1) << s;
      EXPECT_EQ(s.at("tier_experts")[1].at("layer").get<int>(), 2) << s;
    }
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
  }
  int rehomed = 0;
  for (const json& s : lines("p2-freq")) rehomed += s.contains("tier_experts_rehomed") ? 1 : 0;
  EXPECT_GE(rehomed, 1);

  const std::string recut = p2 + noaux +
                            "--set parallel.stage_boundaries=1 --set parallel.repartition_every=4"
                            " --set monitor.layer_costs_every=2 --set parallel.partitioner=dp"
                            " --set parallel.repartition_threshold=0 --set runtime.slow_rank=1"
                            " --set runtime.slow_factor=3 ";
  testing::CommandResult r = train("p2-recut", recut);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train("p2-recut-freq", recut + tiers() + by_frequency);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // (The cuts follow measured times, so the two runs need not cut alike: where they cut apart, at
  // "2" and "3", they trained the same bytes.)
  expect_same_training("p2-recut", "p2-recut-freq");
  const std::vector<json> got = lines("p2-recut-freq");
  int moves = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    moves += got[i].at("stage_boundaries") != (i == 0 ? json("1") : got[i - 1].at("stage_boundaries"));
    ASSERT_EQ(got[i].at("tier_experts").size(), 2u) << got[i];
  }
  EXPECT_GE(moves, 1) << "the tiered run never moved a block\n" << r.output;
  EXPECT_TRUE(fs::is_empty(at("nvme"))) << "a tier's file outlived the run";
  for (const char* run :
       {"p2", "p2-tiered", "p2-noaux", "p2-freq", "d2p2-ep2", "d2p2-ep2-freq", "p2-recut", "p2-recut-freq"}) {
    fs::remove_all(at(run));
  }
}

// What stays refused with memory tiers and a mixture of experts, in one line: experts homed by
// routing share with bf16 training state (also under ZeRO-3); and what is built: by routing share
// under ZeRO-3 in every layout (each rank its experts' only holder, with or without tensor groups;
// several holders of each expert).
TEST_F(MoeTiersParallel, WhatIsNotBuiltIsRefusedInOneLine) {
  const std::vector<std::string> moe = {"model.preset=llama-moe-tiny", "tier.device_mib=64", "tier.host_mib=64"};
  auto refusal = [&](std::vector<std::string> extra) {
    std::vector<std::string> sets = moe;
    sets.insert(sets.end(), extra.begin(), extra.end());
    const std::string why = testing::config_refusal(sets, 2);
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    return why;
  };
  EXPECT_NE(refusal({"parallel.zero=3", "tier.experts=by_frequency", "runtime.param_dtype=bf16"})
                .find("config key 'runtime.param_dtype'"),
            std::string::npos);
  // (on 4 ranks in expert groups of 2 each expert has 2 holders; with tensor groups of 2 each rank
  // is again its expert shards' only holder)
  std::vector<std::string> four = moe;
  for (const char* set : {"parallel.zero=3", "parallel.expert=2", "tier.experts=by_frequency"}) four.push_back(set);
  EXPECT_EQ(testing::config_refusal(four, 4), "");
  four.push_back("parallel.tensor=2");
  EXPECT_EQ(testing::config_refusal(four, 4), "");
  for (const std::vector<std::string>& built :
       {std::vector<std::string>{"parallel.expert=2"}, {"parallel.expert=2", "tier.experts=by_frequency"},
        {"parallel.zero=1", "parallel.expert=2"}, {"parallel.zero=2", "parallel.expert=2", "tier.experts=by_frequency"},
        {"parallel.zero=3"}, {"parallel.zero=3", "parallel.expert=2"}, {"parallel.zero=3", "tier.experts=by_frequency"},
        {"parallel.zero=3", "parallel.expert=2", "tier.experts=by_frequency"}, {"parallel.pipeline=2"},
        {"parallel.pipeline=2", "tier.experts=by_frequency"},
        {"parallel.pipeline=2", "parallel.repartition_every=4", "monitor.layer_costs_every=2"}}) {
    EXPECT_EQ(refusal(built), "") << built.back();
  }
}

}  // namespace
}  // namespace keel
