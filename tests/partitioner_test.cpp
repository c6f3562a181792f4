// Per-layer costs measured while training (pipeline/layer_profile.h) and the partitioners that
// cut stages by them (pipeline/partitioner.h): the exact partitioner against every cut, memory
// caps, the learning agent against the exact optimum, the costs' file format, and a real run's
// `layer_costs` lines read back by `keel schedule`.
#include "pipeline/partitioner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "test_util.h"

namespace keel::pipeline {
namespace {

using nlohmann::json;

// Costs per layer: embedding, `blocks` blocks of cost 1 (F 1/3, B 1/3, W 1/3), head of `head`.
PartitionProblem problem(int blocks, double head, int ranks, int micro, Kind kind = Kind::one_f_one_b) {
  const int L = blocks + 2;
  PartitionProblem p;
  LayerCosts& c = p.costs;
  for (std::vector<double>* v : {&c.forward, &c.backward_input, &c.backward_weight, &c.comm, &c.activation_bytes,
                                 &c.param_bytes}) {
    v->assign(L, 0.0);
  }
  for (int i = 0; i < L; ++i) {
    const double cost = i == 0 ? 0.05 : i == L - 1 ? head : 1.0;
    c.forward[i] = c.backward_input[i] = c.backward_weight[i] = cost / 3;
    c.activation_bytes[i] = 1 << 20;
    c.param_bytes[i] = i == L - 1 ? 8 << 20 : 1 << 20;
  }
  c.message_ms = 0;
  p.flops.assign(L, 1.0);  // the FLOP model believes every layer costs the same
  p.schedule = {kind, ranks, micro, 1};
  return p;
}

// Every cut of L layers into S non-empty stages.
void every_cut(int L, int S, const std::function<void(const std::vector<LayerRange>&)>& f) {
  std::vector<int> first(S);
  std::function<void(int, int)> rec = [&](int s, int from) {
    if (s == S) {
      std::vector<LayerRange> cut;
      for (int k = 0; k < S; ++k) cut.push_back({first[k], k + 1 < S ? first[k + 1] - 1 : L - 1});
      f(cut);
      return;
    }
    for (int b = from; b <= L - (S - s); ++b) {
      first[s] = b;
      rec(s + 1, b + 1);
    }
  };
  first[0] = 0;
  rec(1, 1);
}

TEST(Partitioner, DpFindsTheShortestSimulatedSpanAmongEveryCut) {
  Rng rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    PartitionProblem p = problem(6, 1, 3, 6);
    for (int i = 0; i < p.costs.layers(); ++i) p.costs.forward[i] = 0.1 + rng.uniform();
    const std::vector<LayerRange> cut = DpPartitioner().cut(p, {});
    double best = std::numeric_limits<double>::infinity(), best_span = best;
    every_cut(p.costs.layers(), 3, [&](const std::vector<LayerRange>& c) {
      best = std::min(best, score_cut(p, c).max_stage);
      best_span = std::min(best_span, score_cut(p, c).span);
    });
    // So few cuts (21) are scored one by one: the shortest simulated span of them all.
    const CutScore got = score_cut(p, cut);
    EXPECT_EQ(got.span, best_span) << trial;
    EXPECT_LE(got.max_stage, best * 1.5) << trial;
  }
}

// On problems too large to score every cut (40 layers into 8 stages: 15 M cuts), the min-max
// programme against an independent method: binary search on the largest stage, each candidate
// checked by greedy filling (optimal for contiguous cuts). The dp cut that starts from it never
// has a longer simulated step.
TEST(Partitioner, TheMinMaxProgrammeMatchesBinarySearchOnLargeProblems) {
  Rng rng(11);
  for (int trial = 0; trial < 10; ++trial) {
    PartitionProblem p = problem(38, 1, 8, 16);
    for (int i = 0; i < p.costs.layers(); ++i) p.costs.forward[i] = 0.1 + 3 * rng.uniform();
    const std::vector<double> cost = p.costs.total();
    auto stages_needed = [&](double cap) {
      int n = 1;
      double run = 0;
      for (double c : cost) {
        if (c > cap) return 1 << 30;
        if (run + c > cap) n++, run = 0;
        run += c;
      }
      return n;
    };
    double lo = 0, hi = 0;
    for (double c : cost) hi += c;
    for (int it = 0; it < 200; ++it) {
      const double mid = (lo + hi) / 2;
      (stages_needed(mid) <= 8 ? hi : lo) = mid;
    }
    const std::vector<LayerRange> cut = min_max_cut(p);
    ASSERT_EQ(cut.size(), 8u);
    EXPECT_NEAR(score_cut(p, cut).max_stage, hi, 1e-9 * hi) << trial;
    EXPECT_LE(score_cut(p, DpPartitioner().cut(p, {})).span, score_cut(p, cut).span) << trial;
  }
}

TEST(Partitioner, AHeavyHeadIsGivenAStageOfItsOwnWhereTheFlopModelDoesNot) {
  PartitionProblem p = problem(6, 4, 2, 8);  // the head costs 4 blocks
  const std::vector<LayerRange> flat = StaticPartitioner().cut(p, {}), dp = DpPartitioner().cut(p, {});
  EXPECT_EQ(boundaries_of(flat), "4");  // the FLOP model's halves: 0-3 | 4-7
  const CutScore s = score_cut(p, flat), d = score_cut(p, dp);
  EXPECT_LT(d.span, 0.8 * s.span) << boundaries_of(dp);
  EXPECT_EQ(boundaries_of(dp), "6");  // 0-5 (5.05) | 6-7 (5): the least largest stage
}

// A rank that computes twice as slowly (runtime.slow_factor) costs its stages twice their layers:
// the cuts give it fewer layers, and the simulator's span is the one of those doubled costs.
TEST(Partitioner, ASlowRankIsGivenFewerLayers) {
  PartitionProblem p = problem(10, 1, 2, 8);  // 12 layers; the even cut is "6"
  const std::vector<LayerRange> even = min_max_cut(p);
  EXPECT_EQ(boundaries_of(even), "6");  // 0.05 + 5 blocks | 5 blocks + head
  p.rank_slowdown = {1.0, 2.0};  // rank 1 (stage 1) half as fast
  const std::vector<LayerRange> cut = DpPartitioner().cut(p, {});
  EXPECT_GE(cut[1].first, 8) << boundaries_of(cut);
  // The least largest stage: 0.05 + 7 blocks against (3 blocks + head) x 2.
  EXPECT_EQ(boundaries_of(min_max_cut(p)), "8");
  const CutScore slow_even = score_cut(p, even), slow_cut = score_cut(p, cut);
  EXPECT_LT(slow_cut.span, slow_even.span);
  EXPECT_DOUBLE_EQ(slow_even.max_stage, 2 * 6.0);  // the second stage, doubled
  // The agent gets there too, from the even cut.
  QLearningPartitioner agent(3);
  int within = -1;
  learn_cut(agent, p, even, 50, slow_cut.span, &within);
  EXPECT_GE(within, 1);
  EXPECT_LE(within, 50);
}

// A re-cut estimates a slow rank from what the ranks measured: the median block's forward time over
// its FLOP cost, against the fastest rank's; noise below 1.15x counts as none, and a rank that holds
// no block (or a cut where only one rank does) cannot be told apart.
TEST(Partitioner, EstimatesASlowRankFromMeasuredForwardTimes) {
  PartitionProblem p = problem(10, 1, 2, 8);
  const std::vector<LayerRange> even = min_max_cut(p);  // "6": blocks 1-5 | 6-10 + head
  for (int i = 6; i <= 10; ++i) p.costs.forward[i] *= 1.8;  // rank 1's blocks
  // Blocks of a third of a millisecond: under the floor, no estimate.
  EXPECT_EQ(measured_rank_slowdown(p, even), (std::vector<double>{1.0, 1.0}));
  for (double& f : p.costs.forward) f *= 10;  // blocks of 3.3 ms (and 6 ms on rank 1)
  p.costs.forward[7] *= 5;                                   // one outlier: the median ignores it
  p.costs.forward[0] = 30;                                   // the embedding: not a block
  std::vector<double> slow = measured_rank_slowdown(p, even);
  ASSERT_EQ(slow.size(), 2u);
  EXPECT_DOUBLE_EQ(slow[0], 1.0);
  EXPECT_NEAR(slow[1], 1.8, 1e-12);
  for (int i = 6; i <= 10; ++i) p.costs.forward[i] /= 1.8 / 1.1;  // 1.1x: noise
  EXPECT_EQ(measured_rank_slowdown(p, even), (std::vector<double>{1.0, 1.0}));
  // Rank 0 holds only the embedding: nothing to compare with.
  for (int i = 6; i <= 10; ++i) p.costs.forward[i] *= 3;
  const std::vector<LayerRange> lone = {{0, 0}, {1, 11}};
  EXPECT_EQ(measured_rank_slowdown(p, lone), (std::vector<double>{1.0, 1.0}));
}

TEST(Partitioner, MemoryCapsShapeTheCutAndAnImpossibleCapIsOneLine) {
  PartitionProblem p = problem(6, 1, 2, 8);  // every layer costs the same
  EXPECT_LT(DpPartitioner().cut(p, {})[1].first, 6);
  // Stage 1 holds the head (8 MB of parameters: 32 MB of state) and 1F1B keeps one micro-batch
  // in flight there (1 MB a layer): a cap of 42 MB leaves it the head and one block at most.
  p.stage_memory_cap = 42 << 20;
  const std::vector<LayerRange> cut = DpPartitioner().cut(p, {});
  for (int64_t b : score_cut(p, cut).stage_bytes) EXPECT_LE(b, p.stage_memory_cap);
  EXPECT_EQ(boundaries_of(cut), "6");
  p.stage_memory_cap = 20 << 20;
  try {
    DpPartitioner().cut(p, {});
    ADD_FAILURE() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no cut of the 8 layers into 2 stages keeps every stage within 20 MiB"),
              std::string::npos)
        << e.what();
  }
}

// From the FLOP cut, the agent comes within 5 % of the exact optimum's simulated span in at most
// 50 decisions, on workloads whose load sits where the FLOP model does not expect it.
TEST(Partitioner, QLearningComesWithinFivePercentOfTheOptimumInFiftyDecisions) {
  struct Case {
    const char* name;
    PartitionProblem p;
  };
  std::vector<Case> cases = {{"head-heavy P=2", problem(10, 5, 2, 8)},
                             {"head-heavy P=4", problem(14, 4, 4, 16)},
                             {"zb-h1 P=4", problem(14, 3, 4, 16, Kind::zb_h1)}};
  // Early layers frozen: no W (and cheaper B) for the first half of the blocks.
  cases.push_back({"frozen half P=4", problem(14, 1, 4, 16)});
  for (int i = 1; i <= 7; ++i) cases.back().p.costs.backward_weight[i] = 0, cases.back().p.costs.backward_input[i] *= 0.5;
  for (Case& c : cases) {
    const double optimum = score_cut(c.p, DpPartitioner().cut(c.p, {})).span;
    QLearningPartitioner agent(3);
    std::vector<LayerRange> now = StaticPartitioner().cut(c.p, {});
    int within = score_cut(c.p, now).span <= 1.05 * optimum ? 0 : -1;
    for (int d = 1; d <= 50 && within < 0; ++d) {
      now = agent.cut(c.p, now);
      if (score_cut(c.p, now).span <= 1.05 * optimum) within = d;
    }
    EXPECT_GE(within, 0) << c.name << ": " << score_cut(c.p, now).span << " vs " << optimum;
    std::printf("%s: within 5 %% of dp after %d decisions\n", c.name, within);
  }
}

TEST(Partitioner, TheAgentIsSeeded) {
  const PartitionProblem p = problem(10, 5, 2, 8);
  auto run = [&](uint64_t seed) {
    QLearningPartitioner agent(seed);
    std::vector<LayerRange> now = StaticPartitioner().cut(p, {});
    std::string moves;
    for (int d = 0; d < 20; ++d) moves += boundaries_of(now = agent.cut(p, now)) + ";";
    return moves;
  };
  EXPECT_EQ(run(5), run(5));
  EXPECT_THROW(parse_enum<PartitionerKind>("greedy", "parallel.partitioner"), Error);
}

TEST(LayerCosts, RoundTripAndBadFilesAreOneLine) {
  const PartitionProblem p = problem(2, 1, 2, 4);
  const LayerCosts back = LayerCosts::from_json(p.costs.to_json(), 4, "x");
  EXPECT_EQ(back.forward, p.costs.forward);
  EXPECT_EQ(back.param_bytes, p.costs.param_bytes);
  json j = p.costs.to_json();
  j["forward"] = {1, 2};
  EXPECT_THROW(LayerCosts::from_json(j, 4, "x"), Error);
  j["forward"] = {1, 2, -3, 4};
  EXPECT_THROW(LayerCosts::from_json(j, 4, "x"), Error);
}

TEST(LayerCosts, ScaleWithSequenceLengthAsTheirFlops) {
  Config c;
  c.model.preset = "tiny";
  c.resolve(1);
  LayerCosts costs = problem(c.model.n_layer, 1, 2, 4).costs;
  costs.seq_len = 64;
  const LayerCosts twice = costs.at_seq_len(c.model, 128);
  // A block: 24 C^2 + 4 T C per token, twice the tokens.
  const double C = c.model.n_embd;
  const double block = 2 * (24 * C * C + 4 * 128 * C) / (24 * C * C + 4 * 64 * C);
  EXPECT_NEAR(twice.forward[1] / costs.forward[1], block, 1e-9);
  EXPECT_NEAR(twice.activation_bytes[1] / costs.activation_bytes[1], 2.0, 1e-12);
}

// A real run: its metrics carry layer_costs lines with every layer measured (two stages, each
// measuring its own), which `keel schedule --layer-costs` reads.
TEST(LayerProfiler, APipelinedRunReportsEveryLayersCostsAndScheduleReadsThem) {
  testing::TempDir dir("keel-profile");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 12);
  const std::string common = " --set model.n_layer=4 --set train.batch_size=2 --set train.grad_accum=4 "
                             "--set monitor.layer_costs_every=5 --set train.eval_every=0";
  const testing::CommandResult r = testing::run_keel("launch -n 2 -- train --config " + dir / "toy.toml" + common +
                                                     " --set parallel.pipeline=2 --set train.run_dir=" + dir / "run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string text = read_text_file(dir / "run/metrics.jsonl");
  int reports = 0;
  json last;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const json line = json::parse(text.substr(at, end - at));
    if (line.value("event", "") == "layer_costs") reports++, last = line;
    at = end + 1;
  }
  EXPECT_EQ(reports, 2);  // steps 5 (measured 2..5: the first step is set-up) and 10
  ASSERT_TRUE(last.contains("prediction_error")) << last.dump();
  EXPECT_GE(last.at("prediction_error").get<double>(), 0.0);
  const LayerCosts costs = LayerCosts::from_json(last.at("layer_costs"), 6, "metrics");
  for (int i = 1; i <= 5; ++i) EXPECT_GT(costs.forward[i], 0) << "layer " << i;
  for (int i = 1; i <= 4; ++i) {
    EXPECT_GT(costs.backward_input[i], 0) << i;
    EXPECT_GT(costs.backward_weight[i], 0) << i;
    EXPECT_GT(costs.param_bytes[i], 0) << i;
    EXPECT_GT(costs.activation_bytes[i], 0) << i;
  }
  EXPECT_GT(costs.comm[0] + costs.comm[1] + costs.comm[2] + costs.comm[3] + costs.comm[4] + costs.comm[5], 0);
  const testing::CommandResult s = testing::run_keel("schedule --config " + dir / "toy.toml" + common +
                                                     " --set parallel.pipeline=2 --layer-costs " + dir / "run/metrics.jsonl");
  EXPECT_EQ(s.exit_code, 0) << s.output;
  EXPECT_NE(s.output.find("cut by dp: boundaries"), std::string::npos) << s.output;
  const testing::CommandResult q = testing::run_keel("schedule --config " + dir / "toy.toml" + common +
                                                     " --set parallel.pipeline=2 --partitioner qlearning --layer-costs " +
                                                     dir / "run/metrics.jsonl");
  EXPECT_EQ(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("cut by qlearning, 50 decisions: within 5 % of dp after"), std::string::npos) << q.output;
  const testing::CommandResult bad = testing::run_keel("schedule --config " + dir / "toy.toml" + common +
                                                       " --set parallel.pipeline=2 --layer-costs " + dir / "toy.toml");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("layer costs " + dir / "toy.toml"), std::string::npos) << bad.output;
}

// At start-up a pipelined run cuts its stages by parallel.partitioner on parallel.layer_costs:
// with a head that costs five blocks, dp gives the head's stage fewer blocks than the FLOP
// model's cut; bad settings are one line each.
TEST(LayerProfiler, ARunCutsItsStagesByMeasuredCostsAndBadSettingsAreOneLine) {
  testing::TempDir dir("keel-startup-cut");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 2);
  PartitionProblem p = problem(4, 5, 2, 4);
  testing::write_text(dir / "costs.json", p.costs.to_json().dump());
  const std::string common = " --set model.n_layer=4 --set train.batch_size=2 --set train.grad_accum=4 "
                             "--set train.eval_every=0 --set parallel.pipeline=2";
  auto stages_of = [&](const std::string& run) {
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    return json::parse(text.substr(0, text.find('\n'))).at("stages").dump();
  };
  auto train = [&](const std::string& run, const std::string& extra) {
    return testing::run_keel("launch -n 2 -- train --config " + dir / "toy.toml" + common + " --set train.run_dir=" +
                             dir / run + " " + extra);
  };
  ASSERT_EQ(train("static", "").exit_code, 0);
  const testing::CommandResult dp =
      train("dp", "--set parallel.partitioner=dp --set parallel.layer_costs=" + dir / "costs.json");
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_EQ(stages_of("static"), "[[0,2],[3,5]]");  // the FLOP model: this head costs less than a block
  EXPECT_EQ(stages_of("dp"), "[[0,4],[5,5]]");      // 4.05 | 5
  const testing::CommandResult q =
      train("q", "--set parallel.partitioner=qlearning --set parallel.layer_costs=" + dir / "costs.json");
  ASSERT_EQ(q.exit_code, 0) << q.output;
  EXPECT_EQ(stages_of("q"), "[[0,4],[5,5]]");
  struct Bad {
    std::string set, expect;
  };
  for (const Bad& b : std::vector<Bad>{
           {"--set parallel.partitioner=greedy", "config key 'parallel.partitioner': expected static, dp or qlearning"},
           {"--set parallel.partitioner=dp --set parallel.stage_memory_mib=1",
            "config key 'parallel.stage_memory_mib': no cut of the 6 layers into 2 stages"},
           {"--set parallel.partitioner=dp --set parallel.stage_boundaries=3", "config key 'parallel.stage_boundaries'"},
           {"--set parallel.partitioner=dp --set parallel.layer_costs=" + dir / "nothing.json", "nothing.json"}}) {
    const testing::CommandResult r = train("bad", b.set);
    EXPECT_EQ(r.exit_code, 2) << b.set << "\n" << r.output;
    EXPECT_NE(r.output.find(b.expect), std::string::npos) << b.set << "\n" << r.output;
  }
  const testing::CommandResult one = testing::run_keel("train --config " + dir / "toy.toml" +
                                                       " --set parallel.partitioner=dp --set train.run_dir=" + dir / "one");
  EXPECT_EQ(one.exit_code, 2) << one.output;
  EXPECT_NE(one.output.find("config key 'parallel.partitioner': cutting stages (partitioner, layer_costs, "
                            "stage_memory_mib) only with parallel.pipeline > 1"),
            std::string::npos)
      << one.output;
}

// Frozen layers (optim.freeze_layers) skip their B and W: the profile shows none, and a
// pipeline still trains the bytes one rank trains (one thread per rank).
TEST(LayerProfiler, FrozenLayersSkipTheirBackwardPasses) {
  testing::TempDir dir("keel-frozen");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 8);
  const std::string common = " --set model.n_layer=4 --set train.batch_size=2 --set train.grad_accum=4 "
                             "--set train.eval_every=0 --set optim.freeze_layers=3 --set runtime.threads=1 "
                             "--set monitor.layer_costs_every=5";
  ASSERT_EQ(testing::run_keel("train --config " + dir / "toy.toml" + common + " --set train.run_dir=" + dir / "one").exit_code, 0);
  const testing::CommandResult pipe = testing::run_keel("launch -n 2 -- train --config " + dir / "toy.toml" + common +
                                                        " --set parallel.pipeline=2 --set train.run_dir=" + dir / "pipe");
  ASSERT_EQ(pipe.exit_code, 0) << pipe.output;
  for (Plane p : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_TRUE(testing::checkpoint_bytes(dir / "one/ckpt", p) == testing::checkpoint_bytes(dir / "pipe/ckpt", p))
        << static_cast<int>(p);
  }
  const LayerCosts costs = read_layer_costs(dir / "one/metrics.jsonl", 6);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(costs.backward_input[i] == 0, i < 3) << "layer " << i;
    EXPECT_EQ(costs.backward_weight[i] == 0, i < 3) << "layer " << i;
  }
}

}  // namespace
}  // namespace keel::pipeline
