// Tensor parallelism (parallel.tensor) over OpenMPI, through the keel binary as a user runs it:
// T ranks splitting every layer train what one rank trains with the same batch (losses within
// 1e-5 relative over 20 steps, weights within 1e-5), alone and beside data parallelism; the
// checkpoints hold the whole model's layout, so a run resumes on another tensor size; layouts and
// models that cannot be split are refused in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"
#include "toy_runs.h"

namespace keel {
namespace {

using testing::run_keel;

class TensorParallel : public testing::ToyRuns {
 protected:
  TensorParallel() : ToyRuns("keel-tp") {}
};

TEST_F(TensorParallel, TensorRanksTrainWhatOneRankTrains) {
  ASSERT_EQ(train(0, 8, "one").exit_code, 0);
  ASSERT_EQ(losses("one").size(), 20u);
  // T = 2 and T = 4 (oversubscribed) with the whole batch; data 2 x tensor 2 with half of it each.
  for (const auto& [ranks, batch, tensor] : {std::tuple{2, 8, 2}, std::tuple{4, 8, 4}, std::tuple{4, 4, 2}}) {
    const std::string run = "d" + std::to_string(ranks / tensor) + "t" + std::to_string(tensor);
    auto r = train(ranks, batch, run, "--set parallel.tensor=" + std::to_string(tensor));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over " + std::to_string(tensor) + " ranks (data " +
                            std::to_string(ranks / tensor) + " x pipeline 1 x tensor " + std::to_string(tensor) + ")"),
              std::string::npos)
        << r.output;
    expect_same_training("one", run);
  }
}

// llama: grouped-query attention with its key/value heads split (4 heads, 2 KV heads), the fused
// gate_up split so each rank holds matching gate and up rows, an untied LM head split by vocabulary.
TEST_F(TensorParallel, LlamaTensorRanksTrainWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  ASSERT_EQ(train(0, 8, "one", llama).exit_code, 0);
  ASSERT_EQ(losses("one").size(), 20u);
  for (const auto& [ranks, batch, tensor] : {std::tuple{2, 8, 2}, std::tuple{4, 4, 2}}) {
    const std::string run = "d" + std::to_string(ranks / tensor) + "t" + std::to_string(tensor);
    auto r = train(ranks, batch, run, llama + "--set parallel.tensor=" + std::to_string(tensor));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training("one", run);
    const auto distance = testing::weight_distance(dir / "one/ckpt", dir / (run + "/ckpt"));
    EXPECT_TRUE(distance.contains("h.0.mlp.gate_up.w") && distance.contains("lm_head.w")) << run;
  }
}

// Composition: activation recomputation (full and selective: a recomputed forward repeats its
// all-reduces on every rank) trains what one rank trains with the same setting; the final
// evaluation runs, and one process evaluates the checkpoint (the whole model's layout).
TEST_F(TensorParallel, ComposesWithRecomputationAndEval) {
  for (const std::string setting : {"full", "selective"}) {
    const std::string extra = "--set train.steps=8 --set train.recompute=" + setting + " ";
    ASSERT_EQ(train(0, 8, "one" + setting, extra).exit_code, 0);
    auto r = train(2, 8, "t2" + setting, extra + "--set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("val loss"), std::string::npos) << r.output;
    expect_same_training("one" + setting, "t2" + setting);
  }
  auto e = run_keel("eval --checkpoint " + dir / "t2full/ckpt" + " --data " + dir / "val.bin" + " --batch 2 --seq 32");
  EXPECT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("loss"), std::string::npos) << e.output;
}

// Dynamic attention windows: each tensor rank probes its own heads and the masses are summed over
// the group, so T = 2 takes the windows one rank takes (the same "attention_windows" events, some
// window below the sequence length) and trains what one rank trains; GPT-2 and llama (grouped-query
// attention: each rank's query heads with its key/value heads).
TEST_F(TensorParallel, DynamicWindowsDecideAndTrainAsOneRank) {
  const std::string dyn = "--set model.attention_window=dynamic --set model.dynamic_window_every=5 "
                          "--set model.dynamic_window_min=4 --set model.dynamic_window_loss=0.05 ";
  auto windows = [&](const std::string& run) {
    std::vector<nlohmann::json> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      if (j.value("event", "") == "attention_windows") out.push_back(j);
      at = end + 1;
    }
    return out;
  };
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = dyn + (family == "llama" ? llama : "");
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    auto r = train(2, 8, family + "t2", extra + "--set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training(family + "one", family + "t2");
    const std::vector<nlohmann::json> want = windows(family + "one"), got = windows(family + "t2");
    ASSERT_FALSE(want.empty()) << family;
    ASSERT_EQ(got.size(), want.size()) << family;
    bool narrowed = false;
    for (size_t e = 0; e < want.size(); ++e) {
      EXPECT_EQ(got[e]["step"], want[e]["step"]) << family;
      EXPECT_EQ(got[e]["windows"], want[e]["windows"]) << family << " step " << want[e]["step"];
      for (int w : want[e]["windows"].get<std::vector<int>>()) narrowed |= w > 0 && w < 32;
      // The mass the windows leave out, read from all heads' sums (one rank's heads alone differ).
      const auto out_want = want[e]["outside_mass"].get<std::vector<double>>();
      const auto out_got = got[e]["outside_mass"].get<std::vector<double>>();
      ASSERT_EQ(out_got.size(), out_want.size()) << family;
      for (size_t b = 0; b < out_want.size(); ++b) {
        EXPECT_NEAR(out_got[b], out_want[b], 1e-5 * std::abs(out_want[b]) + 1e-9) << family << " block " << b;
      }
    }
    EXPECT_TRUE(narrowed) << family << ": no window below the sequence length (32)";
  }
}

// bf16 products: each rank multiplies its shard's bf16 copies of the weights with the same bf16
// inputs as one rank, but a row-parallel product's float32 partial sums are added in another
// order, and the differences, once in the weights, change their bf16 rounding: the trajectory
// agrees to bf16's precision, not float32's (losses within 1e-4 relative over 8 steps, weights
// within 1e-2).
TEST_F(TensorParallel, Bf16TrainsWhatOneRankTrainsToBf16Precision) {
  const std::string bf16 = "--set train.steps=8 --set runtime.precision=bf16 ";
  ASSERT_EQ(train(0, 8, "one", bf16).exit_code, 0);
  auto r = train(2, 8, "t2", bf16 + "--set parallel.tensor=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> want = losses("one"), got = losses("t2");
  ASSERT_EQ(got.size(), 8u);
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-4 * want[s]) << "step " << s + 1;
  for (const auto& [name, d] : testing::weight_distance(dir / "one/ckpt", dir / "t2/ckpt")) EXPECT_LT(d, 1e-2) << name;
}

// bf16 training state (runtime.param_dtype / grad_dtype = "bf16", store/bf16_state.h) over tensor
// groups: each rank holds its shards and the replicated tensors as bf16 bits, float32 masters for
// the chunks it updates. T = 2 and data 2 x tensor 2 (GPT-2 under ZeRO-1 and ZeRO-3, llama under
// ZeRO-2), and for GPT-2 T = 2 with sequence parallelism and pipeline 2 x tensor 2 with
// post-validation, train what one rank trains with the whole batch in bf16 state: losses within 1e-3
// relative over 8 steps, the bound of tests/bf16_state_test.cpp NRanksTrainWhatOneRankTrains-
// WithTheWholeBatch (a row-parallel product's partial sums are added in another order and the
// data ranks' gradients summed in bf16: a last-bit difference flips a bf16 rounding). Checkpoints
// hold the owners' float32 masters (under ZeRO-1 gathered from the data rank that owns a chunk):
// data 2 x tensor 2 under ZeRO-1 resumed from its step-4 checkpoint ends with the uninterrupted
// run's bytes, and its step-8 checkpoint resumed on one rank (nothing trained) is saved there
// with the same bytes.
TEST_F(TensorParallel, Bf16TrainingStateTrainsWhatOneRankTrainsAndResumesOnOneRank) {
  // (3 blocks in 16 KiB chunks: the chunks a data rank owns in its tensor shard's store under ZeRO
  // and those of the whole model's copy it writes are not the same parts of the model.)
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set train.steps=8 "
                           "--set train.eval_every=0 --set store.chunk_bytes=16384 --set model.n_layer=3 ";
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string t2 = "--set parallel.tensor=2 ";
  auto expect_close = [&](const std::string& reference, const std::string& run) {
    const std::vector<double> want = losses(reference), got = losses(run);
    ASSERT_EQ(want.size(), 8u) << reference;
    ASSERT_EQ(got.size(), want.size()) << run;
    double farthest = 0;
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_NEAR(got[s], want[s], 1e-3 * want[s]) << run << " step " << s + 1;
      farthest = std::max(farthest, std::abs(got[s] - want[s]) / want[s]);
    }
    std::printf("[ bf16 state ] %s: losses within %.2g of %s\n", run.c_str(), farthest, reference.c_str());
  };
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = bf16 + (family == "llama" ? llama : "");
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    auto r = train(2, 8, family + "t2", extra + t2);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: bf16 training state: parameters bf16, gradients bf16"), std::string::npos)
        << r.output;
    expect_close(family + "one", family + "t2");
    const std::vector<std::string> zeros =
        family == "gpt" ? std::vector<std::string>{"1", "3"} : std::vector<std::string>{"2"};
    for (const std::string& zero : zeros) {
      const std::string run = family + "d2t2z" + zero;
      r = train(4, 4, run, extra + t2 + "--set train.checkpoint_every=4 --set parallel.zero=" + zero);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 2 x pipeline 1 x tensor 2)"), std::string::npos)
          << r.output;
      expect_close(family + "one", run);
    }
  }
  // GPT-2 with sequence parallelism (the norms' gradients summed over the group in float32 under
  // their layer's lease), and pipeline 2 x tensor 2 (ZB-H1, 4 micro-batches accumulated in bf16)
  // with post-validation (the copy is the bits and masters of each rank's shards).
  auto r = train(2, 8, "gptt2sp", bf16 + t2 + "--set parallel.sequence_parallel=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_close("gptone", "gptt2sp");
  r = train(4, 8, "gptp2t2", bf16 + t2 + "--set parallel.pipeline=2 --set parallel.micro_batches=4 "
                              "--set parallel.schedule=zb-h1 --set parallel.post_validate=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_close("gptone", "gptp2t2");
  // Run `run` resumed from the data 2 x tensor 2 ZeRO-1 run's checkpoint of `step` ends with its
  // final checkpoint's bytes (parameters and both moments).
  const std::string root = dir / "gptd2t2z1/ckpt";
  auto expect_resumed_to_its_bytes = [&](int ranks, int b, const std::string& run, const std::string& extra,
                                         const std::string& step) {
    const auto resumed = train(ranks, b, run, bf16 + extra + "--set train.resume=" + root + "/step-0000000" + step);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(dir / (run + "/ckpt"), plane), testing::checkpoint_bytes(root, plane))
          << run << " plane " << static_cast<int>(plane);
    }
  };
  expect_resumed_to_its_bytes(4, 4, "resumed", t2 + "--set train.checkpoint_every=4 --set parallel.zero=1 ", "4");
  // The masters are float32: in every tensor almost no saved weight is a bf16 value (1 in 2^16 by
  // chance; a chunk whose writer saved its bf16 bits would be all of them).
  const auto manifest = nlohmann::json::parse(read_text_file(testing::newest_checkpoint(root) + "/manifest.json"));
  const std::vector<char> saved = testing::checkpoint_bytes(root);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(saved.data());
  std::map<std::string, std::pair<int64_t, int64_t>> bf16_valued;  // tensor: (bf16 values, elements)
  for (const auto& chunk : manifest["chunks"]) {
    for (const auto& t : chunk["tensors"]) {
      const int64_t numel = t[2], at = chunk["offset"].get<int64_t>() + t[3].get<int64_t>();
      auto& [exact, all] = bf16_valued[t[0].get<std::string>()];
      for (int64_t i = 0; i < numel; ++i) {
        if (bits[at + i] == 0) continue;  // (the padded vocabulary's rows)
        exact += (bits[at + i] & 0xffffu) == 0 ? 1 : 0;
        all++;
      }
    }
  }
  for (const auto& [name, count] : bf16_valued) EXPECT_LT(count.first, count.second / 64) << name;
  expect_resumed_to_its_bytes(0, 8, "on_one", "", "8");  // (nothing trained: saved again)
}

// The checkpoint is the whole model's (gathered from the shards): a T = 2 run resumed on T = 2
// continues to the bytes of the uninterrupted run, and one rank and two tensor ranks take up each
// other's checkpoints.
TEST_F(TensorParallel, CheckpointsHoldTheWholeModelAndResumeOnAnyTensorSize) {
  const std::string t2 = "--set parallel.tensor=2 ";
  ASSERT_EQ(train(2, 8, "straight", t2 + "--set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(2, 8, "half", t2 + "--set train.steps=6").exit_code, 0);
  auto r = train(2, 8, "resumed", t2 + "--set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::checkpoint_bytes(dir / "straight/ckpt"), testing::checkpoint_bytes(dir / "resumed/ckpt"));
  EXPECT_EQ(testing::checkpoint_bytes(dir / "straight/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(dir / "resumed/ckpt", Plane::adam_v));
  // T = 2's checkpoint on one rank, and one rank's on T = 2: the one-rank run's weights.
  ASSERT_EQ(train(0, 8, "one", "--set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(0, 8, "one_half", "--set train.steps=6").exit_code, 0);
  // (The data position carries over: a replica reads windows of train.batch_size sequences either way.)
  r = train(0, 8, "on_one", "--set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("resuming with data windows"), std::string::npos) << r.output;
  r = train(2, 8, "on_two", t2 + "--set train.steps=12 --set train.resume=" + dir / "one_half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("resuming with data windows"), std::string::npos) << r.output;
  for (const char* run : {"on_one", "on_two", "straight"}) {
    for (const auto& [name, d] : testing::weight_distance(dir / "one/ckpt", dir / (std::string(run) + "/ckpt"))) {
      EXPECT_LT(d, 1e-5) << run << ": " << name;
    }
  }
}

// A tensor rank SIGKILLed in the middle of writing the second checkpoint (KEEL_FAULT kills rank 0,
// which writes the gathered whole model, at the third file operation under ckpt/step-00000008) is
// recovered by `keel launch --max-restarts` from the step-4 checkpoint, split over the tensor ranks
// again, to the uninterrupted run's bytes: parameters and both moments.
TEST_F(TensorParallel, AKilledTensorRankIsRecoveredToTheUninterruptedBytes) {
  const std::string job = "launch -n 2 --max-restarts 1 -- train --config " + dir / "toy.toml" +
                          " --set train.batch_size=8 --set train.steps=12 --set parallel.tensor=2 --set train.run_dir=";
  auto reference = run_keel(job + dir / "reference --set train.checkpoint_every=4");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string fault = "KEEL_FAULT=kill:op=3:path=ckpt/step-00000008:rank=0:once=" + dir / "fault.spent";
  auto killed = testing::run_command(fault + " " + std::string(KEEL_BINARY) + " " + job + dir / "killed" +
                                     " --set train.checkpoint_every=4");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "fault.spent")) << killed.output;
  EXPECT_NE(killed.output.find("restart 1 of 1"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("resumed from"), std::string::npos) << killed.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "killed/ckpt", plane), testing::checkpoint_bytes(dir / "reference/ckpt", plane))
        << static_cast<int>(plane);
  }
  EXPECT_EQ(losses("killed"), losses("reference"));
}

// Memory copies (checkpoint.memory_every): each tensor rank copies its own shard (and its buddy's)
// to /dev/shm every step; rank 1 SIGKILLed after step 15 (KEEL_FAULT, at its buddy copy of step 15)
// is recovered by `keel launch --max-restarts` from both ranks' own copies of step 15 (newer than
// the disk's step 10) to the uninterrupted run's bytes: parameters and both moments.
TEST_F(TensorParallel, MemoryCopiesRecoverAKilledTensorRankToTheUninterruptedBytes) {
  const std::string job = "launch -n 2 --max-restarts 1 -- train --config " + dir / "toy.toml" +
                          " --set train.batch_size=8 --set train.steps=20 --set train.eval_every=0"
                          " --set train.checkpoint_every=10 --set parallel.tensor=2 --set train.run_dir=";
  auto reference = run_keel(job + dir / "reference");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string fault = "KEEL_FAULT=kill:op=1:path=buddy-r0-step-00000015.bin:rank=1:once=" + dir / "killed.spent";
  auto killed = testing::run_command(fault + " " + std::string(KEEL_BINARY) + " " + job + dir / "killed" +
                                     " --set checkpoint.memory_every=1");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "killed.spent")) << killed.output;
  EXPECT_NE(killed.output.find("restart 1 of 1"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("keel: resumed from memory (step 15) in "), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("2 rank(s) from their own copy, 0 from their buddy's"), std::string::npos)
      << killed.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "killed/ckpt", plane), testing::checkpoint_bytes(dir / "reference/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// ZeRO on the data dimension: data 2 x tensor 2 with the moments (ZeRO-1) and the reduced
// gradients too (ZeRO-2) shared out over each shard's data-parallel pair trains what one rank
// trains with the whole batch (losses within 1e-5 relative over 20 steps, weights within 1e-5);
// the checkpoints gather the moments from their owners before the tensor group gathers its
// shards, and a ZeRO-2 run resumed from its step-6 checkpoint continues to the uninterrupted
// run's bytes (parameters and both moments).
TEST_F(TensorParallel, ZeroOnTheDataDimensionTrainsWhatOneRankTrains) {
  ASSERT_EQ(train(0, 8, "one").exit_code, 0);
  ASSERT_EQ(losses("one").size(), 20u);
  for (const std::string zero : {"1", "2"}) {
    auto r = train(4, 4, "d2t2z" + zero, "--set parallel.tensor=2 --set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training("one", "d2t2z" + zero);
  }
  const std::string z2 = "--set parallel.tensor=2 --set parallel.zero=2 ";
  ASSERT_EQ(train(4, 4, "half", z2 + "--set train.steps=6").exit_code, 0);
  auto r = train(4, 4, "resumed", z2 + "--set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "d2t2z2/ckpt", plane), testing::checkpoint_bytes(dir / "resumed/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// Memory tiers under tensor parallelism: each rank's shard of a 0.46M-parameter model (7.4 MB of
// state; 3.7 MB a rank under data 2 x tensor 2, about half that a rank under pipeline 2 x tensor 2)
// is paged through a 1 MiB compute tier, a 1 MiB host tier and NVMe files of its own. The tiers
// move bytes, never change them: each run's checkpoint (parameters and both moments, gathered from
// the shards through the tiers) is the same bytes as its layout's without tiers, and its losses
// are one rank's within 1e-5 relative.
TEST_F(TensorParallel, TiersPageEachRanksShard) {
  const std::string model = "--set model.vocab_size=512 --set model.n_embd=128 --set store.chunk_bytes=65536 ";
  ASSERT_EQ(train(0, 8, "one", model).exit_code, 0);
  for (const auto& [run, batch, layout] :
       {std::tuple<std::string, int, std::string>{"d2t2", 4, "--set parallel.tensor=2 "},
        std::tuple<std::string, int, std::string>{"p2t2", 8, "--set parallel.tensor=2 --set parallel.pipeline=2 "
                                                              "--set parallel.micro_batches=4 "}}) {
    std::filesystem::create_directories(dir / ("nvme-" + run));
    auto r = train(4, batch, run, model + layout);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(4, batch, run + "-tiers", model + layout + "--set tier.device_mib=1 --set tier.host_mib=1 " +
                                            "--set tier.verify=true --set tier.nvme_dir=" + dir / ("nvme-" + run));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<double> want = losses("one"), got = losses(run + "-tiers");
    ASSERT_EQ(got.size(), want.size()) << run;
    for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << run << " step " << s + 1;
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(dir / (run + "/ckpt"), plane),
                testing::checkpoint_bytes(dir / (run + "-tiers/ckpt"), plane))
          << run << " plane " << static_cast<int>(plane);
    }
    // The budget forced NVMe traffic on rank 0 (metrics.jsonl is rank 0's) in every step after
    // the first (whose pages may all start where they are first used).
    std::ifstream in(dir / (run + "-tiers/metrics.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      if (++steps > 1) {
        EXPECT_GT(j.value("tier_nvme_read_bytes", 0.0), 0) << run << ": " << line;
      }
    }
    EXPECT_EQ(steps, 20) << run;
    EXPECT_TRUE(std::filesystem::is_empty(dir / ("nvme-" + run))) << "the tiers' files outlived " << run;
  }
}

// Compressed gradient sync runs on the data dimension only (each tensor rank's shard compressed
// over the ranks holding the same shard; the tensor group's all-reduces stay exact). fp16 rounds
// each element on its own, with each element's error fed back, so data 2 x tensor 2 trains what
// data 2 trains with the same codec: losses within 1e-5 relative, weights within 2e-4 (a
// gradient that differs in its last bits, as the tensor group's sums make it, can round to the
// neighbouring fp16 value; the error feedback carries the difference into the next step). The
// hybrid codec's blocks mix a rank's shards with the replicated tensors, whose gradients the
// group's first rank hands the others (without that the replicated parameters drift apart and the
// checkpoint refuses them); its residuals are saved per rank, and a resume on the same layout
// replays to the uninterrupted run's bytes.
TEST_F(TensorParallel, CompressedSyncRunsOnTheDataDimension) {
  const std::string fp16 = "--set sync.codec=fp16 --set sync.warmup_steps=2 ";
  ASSERT_EQ(train(2, 4, "d2", fp16).exit_code, 0);
  auto r = train(4, 4, "d2t2", fp16 + "--set parallel.tensor=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("compressed sync \"fp16\""), std::string::npos) << r.output;
  const std::vector<double> want = losses("d2"), got = losses("d2t2");
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << "step " << s + 1;
  for (const auto& [name, d] : testing::weight_distance(dir / "d2/ckpt", dir / "d2t2/ckpt")) EXPECT_LT(d, 2e-4) << name;
  const std::vector<nlohmann::json> lines = testing::step_lines(dir / "d2t2/metrics.jsonl");
  ASSERT_EQ(lines.size(), 20u);
  EXPECT_DOUBLE_EQ(lines[1]["sync_ratio"].get<double>(), 1.0);  // warm-up: uncompressed
  EXPECT_NEAR(lines[5]["sync_ratio"].get<double>(), 2.0, 0.1);   // fp16: half the bytes
  const std::string hybrid = "--set parallel.tensor=2 --set sync.codec=hybrid --set sync.warmup_steps=2 ";
  ASSERT_EQ(train(4, 4, "straight", hybrid + "--set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(4, 4, "half", hybrid + "--set train.steps=6").exit_code, 0);
  r = train(4, 4, "resumed", hybrid + "--set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("residuals dropped"), std::string::npos) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "straight/ckpt", plane), testing::checkpoint_bytes(dir / "resumed/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// ZeRO-3 on the data dimension: data 2 x tensor 2, each tensor shard's parameters (with their
// moments and reduced gradients) shared out over its data-parallel pair, gathered layer by layer
// under the layers' leases, trains what one rank trains with the whole batch (losses within 1e-5
// relative over 20 steps, weights within 1e-5): GPT-2, llama, and GPT-2 with sequence
// parallelism. The checkpoints gather the parameters and moments from their owners before the
// tensor group gathers its shards; a run resumed from its step-6 checkpoint continues to the
// uninterrupted run's bytes (parameters and both moments).
TEST_F(TensorParallel, ZeroThreeOnTheDataDimensionTrainsWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string z3 = "--set parallel.tensor=2 --set parallel.zero=3 ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    ASSERT_EQ(losses(family + "one").size(), 20u);
    auto r = train(4, 4, family + "d2t2z3", extra + z3);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 2 x pipeline 1 x tensor 2)"), std::string::npos)
        << r.output;
    expect_same_training(family + "one", family + "d2t2z3");
  }
  auto r = train(4, 4, "d2t2z3sp", z3 + "--set parallel.sequence_parallel=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training("gptone", "d2t2z3sp");
  ASSERT_EQ(train(4, 4, "half", z3 + "--set train.steps=6").exit_code, 0);
  r = train(4, 4, "resumed", z3 + "--set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "gptd2t2z3/ckpt", plane), testing::checkpoint_bytes(dir / "resumed/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// Pipeline x tensor: 2 stages of 2 tensor ranks each (4 ranks, oversubscribed), 4 micro-batches
// of the whole batch, train what one rank trains (losses within 1e-5 relative over 20 steps,
// weights within 1e-5): GPT-2 (the tied head on the last stage holds its shard of the embedding's
// replica) under 1F1B and zero-bubble ZB-H1, llama (grouped-query attention, untied head) under
// 1F1B and the interleaved schedule (two stages per rank).
TEST_F(TensorParallel, PipelineTimesTensorTrainsWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string pt = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=4 ";
  for (const auto& [family, schedules] : {std::pair<std::string, std::vector<std::string>>{"gpt", {"1f1b", "zb-h1"}},
                                          std::pair<std::string, std::vector<std::string>>{"llama", {"1f1b", "interleaved"}}}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    ASSERT_EQ(losses(family + "one").size(), 20u);
    for (const std::string& schedule : schedules) {
      const std::string run = family + "p2t2" + schedule;
      auto r = train(4, 8, run, extra + pt + "--set parallel.schedule=" + schedule);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 1 x pipeline 2 x tensor 2)"), std::string::npos)
          << r.output;
      expect_same_training(family + "one", run);
    }
  }
}

// The text Gantt chart of a traced pipeline x tensor run is replica 0's stages (world ranks 0 and
// 2: each stage's first tensor rank), so its bubble is the one the step line reports (measured
// over the same stages); it used to draw world ranks 0 and 1, two tensor ranks of stage 0.
TEST_F(TensorParallel, PipelineTraceDrawsReplicaZerosStages) {
  auto r = train(4, 8, "trace", "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=4 "
                                "--set parallel.trace=true --set train.steps=2 --set train.log_every=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto percent_before = [&](const std::string& marker) {
    const size_t at = r.output.rfind(marker);
    EXPECT_NE(at, std::string::npos) << marker << "\n" << r.output;
    if (at == std::string::npos) return -1.0;
    const size_t start = r.output.rfind("bubble ", at) + 7;
    return std::stod(r.output.substr(start, at - start));
  };
  const double gantt = percent_before("%; Chrome trace"), step_line = percent_before("%, waits");
  EXPECT_GT(gantt, 0);
  EXPECT_EQ(gantt, step_line) << r.output;
}

// A pipeline x tensor run's checkpoints hold the whole model (each stage's tensor group gathers
// its layers' shards): resumed on the same layout it continues to the uninterrupted run's bytes
// (parameters and both moments); one rank takes up its checkpoint, and it takes up one rank's, to
// the one-rank run's weights; data 2 x tensor 2 takes up its checkpoint likewise.
TEST_F(TensorParallel, PipelineTimesTensorCheckpointsResumeOnAnyLayout) {
  const std::string pt = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=4 "
                         "--set parallel.schedule=1f1b ";
  ASSERT_EQ(train(4, 8, "straight", pt + "--set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(4, 8, "half", pt + "--set train.steps=6").exit_code, 0);
  auto r = train(4, 8, "resumed", pt + "--set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "straight/ckpt", plane), testing::checkpoint_bytes(dir / "resumed/ckpt", plane))
        << static_cast<int>(plane);
  }
  ASSERT_EQ(train(0, 8, "one", "--set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(0, 8, "one_half", "--set train.steps=6").exit_code, 0);
  r = train(0, 8, "on_one", "--set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(4, 8, "on_p2t2", pt + "--set train.steps=12 --set train.resume=" + dir / "one_half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("resuming with data windows"), std::string::npos) << r.output;
  r = train(4, 4, "on_d2t2", "--set parallel.tensor=2 --set train.steps=12 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* run : {"straight", "on_one", "on_p2t2", "on_d2t2"}) {
    const auto distance = testing::weight_distance(dir / "one/ckpt", dir / (std::string(run) + "/ckpt"));
    EXPECT_FALSE(distance.empty()) << run;
    for (const auto& [name, d] : distance) EXPECT_LT(d, 1e-5) << run << ": " << name;
  }
}

// A re-cut of pipeline 2 x tensor 2 (parallel.repartition_every; stages "1": the first holds only
// the embedding, the second four blocks and the head on slowed ranks, and the exact partitioner
// moves for any gain at step 4): each tensor rank's shards move between the ranks of its pipeline
// group. The moved run ends with the bytes (parameters, both moments) and losses of the same run
// never re-cut (a stage cut changes no arithmetic), and with those of the run resumed from its
// step-4 checkpoint under the new cut. GPT-2 (the tied head's replica of the embedding's shard
// moves too) and llama.
TEST_F(TensorParallel, PipelineTimesTensorReCutMovesTheShards) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  // Four blocks (with two the imbalance was at times within the oversubscribed ranks' timing
  // noise: no move), and the second stage's first rank 3x slower.
  const std::string common = "--set train.steps=7 --set train.eval_every=0 --set model.n_layer=4 ";
  const std::string pt = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.schedule=1f1b "
                         "--set parallel.micro_batches=4 --set train.checkpoint_every=4 ";
  const std::string recut = "--set parallel.stage_boundaries=1 --set parallel.repartition_every=4 "
                            "--set monitor.layer_costs_every=2 --set parallel.partitioner=dp "
                            "--set parallel.repartition_threshold=0 --set runtime.slow_rank=2 "
                            "--set runtime.slow_factor=3 ";
  auto same_state = [&](const std::string& a, const std::string& b) {
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(dir / (a + "/ckpt"), plane), testing::checkpoint_bytes(dir / (b + "/ckpt"), plane))
          << a << " vs " << b << " plane " << static_cast<int>(plane);
    }
  };
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = (family == "llama" ? llama : "") + common;
    auto r = train(4, 8, family + "moved", extra + pt + recut);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::vector<nlohmann::json> decisions;
    const std::string text = read_text_file(dir / (family + "moved/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      at = end + 1;
      if (j.value("event", "") == "repartition") decisions.push_back(j);
    }
    ASSERT_EQ(decisions.size(), 1u) << r.output;
    ASSERT_TRUE(decisions[0].at("moved").get<bool>()) << decisions[0].dump();
    EXPECT_EQ(decisions[0].at("step").get<int>(), 4);
    EXPECT_GT(decisions[0].at("bytes_sent").get<double>(), 0) << decisions[0].dump();
    const std::string to = decisions[0].at("proposed").get<std::string>();
    r = train(4, 8, family + "still", extra + pt + "--set parallel.stage_boundaries=1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    same_state(family + "moved", family + "still");
    EXPECT_EQ(losses(family + "moved"), losses(family + "still")) << family;
    r = train(4, 8, family + "fixed", extra + pt + "--set parallel.stage_boundaries=" + to + " --set train.resume=" +
                                          dir / (family + "moved/ckpt/step-00000004"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    same_state(family + "moved", family + "fixed");
    const std::vector<double> moved = losses(family + "moved"), fixed = losses(family + "fixed");
    ASSERT_EQ(moved.size(), 7u);
    ASSERT_EQ(fixed.size(), 3u);
    for (size_t i = 0; i < fixed.size(); ++i) EXPECT_EQ(moved[4 + i], fixed[i]) << family << " step " << 5 + i;
  }
}

// The whole mesh: data 2 x pipeline 2 x tensor 2 (8 ranks, oversubscribed; world rank =
// (replica x 2 + stage) x 2 + tensor rank), half the batch per replica in 2 micro-batches under
// 1F1B, trains what one rank trains with the whole batch (losses within 1e-5 relative over 20
// steps, weights within 1e-5), GPT-2 and llama.
TEST_F(TensorParallel, DataTimesPipelineTimesTensorTrainsWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    auto r = train(8, 4, family + "d2p2t2",
                   extra + "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=2 "
                           "--set parallel.schedule=1f1b");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 2 x pipeline 2 x tensor 2)"), std::string::npos)
        << r.output;
    expect_same_training(family + "one", family + "d2p2t2");
  }
}

// ZeRO-1 and ZeRO-2 on the data dimension of the whole mesh: data 2 x pipeline 2 x tensor 2, each
// stage's shard's data-parallel pair sharing out its moments (and reduced gradients), trains what
// one rank trains (losses within 1e-5 relative over 20 steps, weights within 1e-5): the ZeRO-2
// norm sums every rank's owned chunks' share over the world, the checkpoint gathers the moments
// over the data-parallel pair before the tensor group gathers the shards.
TEST_F(TensorParallel, ZeroOnTheDataDimensionOfTheWholeMeshTrainsWhatOneRankTrains) {
  ASSERT_EQ(train(0, 8, "one").exit_code, 0);
  for (const std::string zero : {"1", "2"}) {
    auto r = train(8, 4, "d2p2t2z" + zero,
                   "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=2 "
                   "--set parallel.schedule=1f1b --set parallel.zero=" + zero);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_same_training("one", "d2p2t2z" + zero);
  }
}

// ZeRO-3 on the data dimension of the whole mesh: data 2 x pipeline 2 x tensor 2 (8 ranks,
// oversubscribed), each stage's tensor shard's parameters (with their moments and reduced
// gradients) shared out over its data-parallel pair and gathered layer by layer under the layers'
// leases, trains what one rank trains with the whole batch (losses within 1e-5 relative over 20
// steps, weights within 1e-5), GPT-2 (the last stage's copy of the embedding's shard sharded with
// the stage's other chunks), llama, and GPT-2 with sequence parallelism; a GPT-2 run resumed from
// its step-6 checkpoint continues to the uninterrupted run's bytes (parameters and both moments).
TEST_F(TensorParallel, ZeroThreeOfAPipelineOfTensorGroupsTrainsWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string mesh = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=2 "
                           "--set parallel.schedule=1f1b --set parallel.zero=3 ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    auto r = train(8, 4, family + "d2p2t2z3", extra + mesh);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 2 x pipeline 2 x tensor 2)"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
    expect_same_training(family + "one", family + "d2p2t2z3");
  }
  // With sequence parallelism too (each stage's tensor ranks sending their rows).
  auto r = train(8, 4, "gptd2p2t2z3sp", mesh + "--set parallel.sequence_parallel=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training("gptone", "gptd2p2t2z3sp");
  ASSERT_EQ(train(8, 4, "half", mesh + "--set train.steps=6").exit_code, 0);
  r = train(8, 4, "resumed", mesh + "--set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "gptd2p2t2z3/ckpt", plane),
              testing::checkpoint_bytes(dir / "resumed/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// Zero Bubble's post-validation with pipeline 2 x tensor 2 (ZB-H1, 4 ranks, oversubscribed): each
// rank steps optimistically from a copy of its own shards while the stages sum the norm (each
// stage's share its tensor group's), and redoes the step when clipping applies: the same bytes
// (parameters and both moments) and losses as waiting for the norm, with steps rolled back (the
// first steps' norms exceed optim.grad_clip = 1). GPT-2 and llama, 8 steps.
TEST_F(TensorParallel, PostValidationOfAPipelineOfTensorGroupsIsExact) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string pt = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=4 "
                         "--set parallel.schedule=zb-h1 --set train.steps=8 ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = (family == "llama" ? llama : "") + pt;
    ASSERT_EQ(train(4, 8, family + "waiting", extra).exit_code, 0);
    auto r = train(4, 8, family + "post", extra + "--set parallel.post_validate=true");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(losses(family + "waiting"), losses(family + "post")) << family;
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(dir / (family + "waiting/ckpt"), plane),
                testing::checkpoint_bytes(dir / (family + "post/ckpt"), plane))
          << family << " " << static_cast<int>(plane);
    }
    int rolled_back = 0;
    const std::string text = read_text_file(dir / (family + "post/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
      at = end + 1;
      if (j.contains("loss")) rolled_back += j.value("pipeline_rolled_back", false);
    }
    EXPECT_GT(rolled_back, 0) << family;
  }
}

// metrics.jsonl's tensor_allreduce_bytes against the closed form (docs/parallelism.md): per
// micro-batch of N = B x seq tokens, in floats of 4 bytes, 2 L N C forward (the row-parallel
// outputs) + N C (the embedding) and 2 L N C backward (the column-parallel input gradients) + N C
// (the head's input gradient), with full recomputation 2 (L - 1) N C more (every block's forward
// again but the last's, which the shared recomputed set still holds at backward); the
// cross-entropy 2 N sums and N maxima (8 bytes each: they run in double). Evaluations between
// steps (every 2 steps here) are not counted. GPT-2 and llama, T = 2, 2 micro-batches a step.
// Each line also holds tensor_comm_ms, the rank's wall time in those collectives.
TEST_F(TensorParallel, TensorAllReduceBytesFollowTheClosedForm) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const int64_t B = 4, seq = 32, C = 64, L = 2, micro = 2, N = B * seq;
  for (const std::string family : {"gpt", "llama"}) {
    for (const bool recompute : {false, true}) {
      const std::string run = family + (recompute ? "full" : "none");
      auto r = train(2, static_cast<int>(B), run,
                     (family == "llama" ? llama : "") + "--set parallel.tensor=2 --set train.steps=4 "
                     "--set train.grad_accum=2 --set train.eval_every=2 --set train.recompute=" +
                         (recompute ? "full" : "none"));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      // (Full recomputation rebuilds every block but the last, whose forward is still the shared set's.)
      const int64_t forward = 2 * L * N * C + N * C + (recompute ? 2 * (L - 1) * N * C : 0);
      const int64_t backward = 2 * L * N * C + N * C;
      const int64_t floats = forward + backward + 2 * N;
      const int64_t want = micro * (4 * floats + 8 * N);
      int lines = 0;
      const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
      for (size_t at = 0; at < text.size();) {
        const size_t end = std::min(text.find('\n', at), text.size());
        const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
        at = end + 1;
        if (!j.contains("loss")) continue;
        ++lines;
        EXPECT_EQ(j.value("tensor_allreduce_bytes", int64_t{-1}), want) << run << " step " << j["step"];
        // (and the wall time the rank spent in those collectives: a figure, present on every line)
        EXPECT_GE(j.value("tensor_comm_ms", -1.0), 0.0) << run << " step " << j["step"];
      }
      EXPECT_EQ(lines, 4) << run;
    }
  }
}

// The "run" event's activation_bytes of run `run` (this rank's: the model's activation counter).
int64_t run_activation_bytes(const std::string& metrics) {
  const std::string text = read_text_file(metrics);
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
    at = end + 1;
    if (j.value("event", "") == "run") return j.value("activation_bytes", int64_t{-1});
  }
  return -1;
}

// Sequence parallelism (parallel.sequence_parallel): the norms and the residual stream held as
// B x T / 2 token rows per rank, gathered before the column-parallel products and reduce-scattered
// after the row-parallel ones. T = 2 with it trains what one rank trains with the whole batch and
// what T = 2 trains without it (losses within 1e-5 relative over 20 steps, weights within 1e-5),
// and so does data 2 x tensor 2 with it; its ranks' activation memory (the model's counter) is
// lower than without it. GPT-2 (tied vocabulary-parallel head, position table) and llama
// (grouped-query attention, untied head).
TEST_F(TensorParallel, SequenceParallelTrainsWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string sp = "--set parallel.sequence_parallel=true ";
  for (const std::string family : {"gpt", "llama"}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    ASSERT_EQ(losses(family + "one").size(), 20u);
    auto r = train(2, 8, family + "t2", extra + "--set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(2, 8, family + "t2sp", extra + sp + "--set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: sequence parallel: norms and residual stream as 1/2"), std::string::npos) << r.output;
    expect_same_training(family + "one", family + "t2sp");
    expect_same_training(family + "t2", family + "t2sp");
    r = train(4, 4, family + "d2t2sp", extra + sp + "--set parallel.tensor=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 2 x pipeline 1 x tensor 2)"), std::string::npos)
        << r.output;
    expect_same_training(family + "one", family + "d2t2sp");
    const int64_t without = run_activation_bytes(dir / (family + "t2/metrics.jsonl"));
    const int64_t with = run_activation_bytes(dir / (family + "t2sp/metrics.jsonl"));
    ASSERT_GT(with, 0) << family;
    EXPECT_LT(with, without) << family;
    std::printf("[ sequence parallel ] %s T=2 activation bytes per rank: %lld without, %lld with\n", family.c_str(),
                static_cast<long long>(without), static_cast<long long>(with));
  }
}

// Sequence parallelism with activation recomputation (full: the recomputed forward repeats its
// gathers and reduce-scatters on every rank of the group; selective: attention and the MLP's
// activation rebuilt from what the block keeps) and with bf16 (the norms' outputs kept as bf16
// bits and gathered as they are, in half the bytes) trains what T = 2 trains without it under the
// same setting: the first step's loss the same (the same sums: a reduce-scatter and an all-reduce
// of two ranks add the same two numbers), every step's within 1e-5 relative over 8 steps. The
// norms' weight gradients are summed in another order (per rank's rows, then over the group):
// float32 weights end within 1e-5; under bf16 a last-bit difference in a norm's weights can flip
// the bf16 rounding of the activations it produces, so the weights end within bf16's precision
// (1e-3 relative per tensor; measured up to 6.8e-4 for GPT-2, under 1e-6 for llama). GPT-2 and llama.
TEST_F(TensorParallel, SequenceParallelComposesWithRecomputationAndBf16) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::vector<std::pair<std::string, std::string>> settings = {
      {"full", "--set train.recompute=full "},
      {"selective", "--set train.recompute=selective "},
      {"bf16", "--set runtime.precision=bf16 "},
      {"bf16full", "--set runtime.precision=bf16 --set train.recompute=full "}};
  for (const std::string family : {"gpt", "llama"}) {
    for (const auto& [name, setting] : settings) {
      const std::string extra = (family == "llama" ? llama : "") + setting + "--set train.steps=8 --set parallel.tensor=2 ";
      const std::string plain = family + name, sp = family + name + "sp";
      auto r = train(2, 8, plain, extra);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = train(2, 8, sp, extra + "--set parallel.sequence_parallel=true");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const std::vector<double> want = losses(plain), got = losses(sp);
      ASSERT_EQ(got.size(), 8u) << sp;
      EXPECT_EQ(got[0], want[0]) << sp;
      double farthest = 0;
      if (name.starts_with("bf16")) {
        for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-5 * want[s]) << sp << " step " << s + 1;
        const auto distance = testing::weight_distance(dir / (plain + "/ckpt"), dir / (sp + "/ckpt"));
        EXPECT_FALSE(distance.empty());
        for (const auto& [tensor, d] : distance) {
          EXPECT_LT(d, 1e-3) << sp << ": " << tensor;
          farthest = std::max(farthest, d);
        }
      } else {
        expect_same_training(plain, sp);
      }
      std::printf("[ sequence parallel ] %s T=2 %s activation bytes per rank: %lld without, %lld with%s\n",
                  family.c_str(), name.c_str(),
                  static_cast<long long>(run_activation_bytes(dir / (plain + "/metrics.jsonl"))),
                  static_cast<long long>(run_activation_bytes(dir / (sp + "/metrics.jsonl"))),
                  farthest > 0 ? (", weights up to " + std::to_string(farthest) + " apart").c_str() : "");
    }
  }
}

// Sequence parallelism with pipelines: pipeline 2 x tensor 2 (4 ranks, oversubscribed), each tensor
// rank sending its N / 2 rows of the residual stream (and receiving their gradients) to its
// counterpart in the next stage (half the floats of a message without it), trains what one rank
// trains with the whole batch and what pipeline 2 x tensor 2 trains without it (losses within 1e-5
// relative over 20 steps, weights within 1e-5): GPT-2 under 1F1B and zero-bubble ZB-H1 (the
// deferred W of a selectively recomputing block re-runs its B, gathers and reduce-scatters
// included), llama under 1F1B and the interleaved schedule (two stages per rank).
TEST_F(TensorParallel, SequenceParallelPipelinesTrainWhatOneRankTrains) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const std::string pt = "--set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.micro_batches=4 ";
  const std::string sp = "--set parallel.sequence_parallel=true ";
  for (const auto& [family, schedules] :
       {std::pair<std::string, std::vector<std::string>>{"gpt", {"1f1b", "zb-h1"}},
        std::pair<std::string, std::vector<std::string>>{"llama", {"1f1b", "interleaved"}}}) {
    const std::string extra = family == "llama" ? llama : "";
    ASSERT_EQ(train(0, 8, family + "one", extra).exit_code, 0);
    ASSERT_EQ(losses(family + "one").size(), 20u);
    auto r = train(4, 8, family + "p2t2", extra + pt + "--set parallel.schedule=1f1b");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    for (const std::string& schedule : schedules) {
      const std::string run = family + "p2t2sp" + schedule;
      r = train(4, 8, run, extra + pt + sp + "--set parallel.schedule=" + schedule);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 1 x pipeline 2 x tensor 2)"), std::string::npos)
          << r.output;
      expect_same_training(family + "one", run);
      expect_same_training(family + "p2t2", run);
    }
    const int64_t without = run_activation_bytes(dir / (family + "p2t2/metrics.jsonl"));
    const int64_t with = run_activation_bytes(dir / (family + "p2t2sp1f1b/metrics.jsonl"));
    ASSERT_GT(with, 0) << family;
    EXPECT_LT(with, without) << family;
    std::printf("[ sequence parallel ] %s P=2 T=2 1f1b activation bytes per rank: %lld without, %lld with\n",
                family.c_str(), static_cast<long long>(without), static_cast<long long>(with));
  }
  // ZB-H1 with selective recomputation: W deferred past other micro-batches rebuilds its block's
  // shared set and re-runs B (with its collectives) before it.
  const std::string zb = pt + "--set parallel.schedule=zb-h1 --set train.recompute=selective --set train.steps=8 ";
  ASSERT_EQ(train(4, 8, "zbsel", zb).exit_code, 0);
  auto r = train(4, 8, "zbselsp", zb + sp);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training("zbsel", "zbselsp");
}

// metrics.jsonl's gather and scatter bytes under sequence parallelism against the closed form
// (docs/parallelism.md): per micro-batch of N = B x seq tokens, in whole buffers of N C floats (4
// bytes each), all-gathers: per block 2 forward (the two norms' outputs), 2 in B (the two
// row-parallel outputs' gradients) and 2 in W (the norms' outputs again), the head's input and
// the embedding's output gradient: (6 L + 2) N C; reduce-scatters: per block 2 forward (the
// row-parallel outputs) and 2 in B (the column-parallel inputs' gradients), the embedding's
// output and the head's input gradient: (4 L + 2) N C. All-reduces: the cross-entropy's 2 N sums
// and N maxima (8 bytes each), and the norms' weight gradients (GPT-2: 4 C per block and 2 C at
// the head; llama: 2 C and C). Under bf16 with full recomputation the blocks' norm-output gathers
// (forward, recomputed forward, W) carry bf16 bits, 2 bytes an element, and every block's forward
// but the last's runs again (its norm outputs gathered and its row-parallel outputs
// reduce-scattered again: 2 (L - 1) N C more of each). GPT-2 and llama, T = 2, 2 micro-batches a
// step, evaluations between steps not counted.
TEST_F(TensorParallel, SequenceParallelGatherAndScatterBytesFollowTheClosedForm) {
  const std::string llama = "--set model.family=llama --set model.n_kv_head=2 --set model.tie_embeddings=false ";
  const int64_t B = 4, seq = 32, C = 64, L = 2, micro = 2, N = B * seq;
  for (const std::string family : {"gpt", "llama"}) {
    for (const bool bf16full : {false, true}) {
      const std::string run = family + (bf16full ? "bf16full" : "");
      auto r = train(2, static_cast<int>(B), run,
                     (family == "llama" ? llama : "") + "--set parallel.tensor=2 --set parallel.sequence_parallel=true "
                     "--set train.steps=4 --set train.grad_accum=2 --set train.eval_every=2 " +
                         (bf16full ? "--set runtime.precision=bf16 --set train.recompute=full" : ""));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const int64_t norm_gathers = 2 * L + 2 * L + (bf16full ? 2 * (L - 1) : 0);  // forward, W, recomputed forward
      const int64_t gather = micro * ((bf16full ? 2 : 4) * norm_gathers + 4 * (2 * L + 2)) * N * C;
      const int64_t scatter = micro * 4 * (4 * L + 2 + (bf16full ? 2 * (L - 1) : 0)) * N * C;
      const int64_t norms = family == "llama" ? L * 2 * C + C : L * 4 * C + 2 * C;
      const int64_t allreduce = micro * (4 * (2 * N + norms) + 8 * N);
      int lines = 0;
      const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
      for (size_t at = 0; at < text.size();) {
        const size_t end = std::min(text.find('\n', at), text.size());
        const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
        at = end + 1;
        if (!j.contains("loss")) continue;
        ++lines;
        EXPECT_EQ(j.value("tensor_allgather_bytes", int64_t{-1}), gather) << run << " step " << j["step"];
        EXPECT_EQ(j.value("tensor_reduce_scatter_bytes", int64_t{-1}), scatter) << run << " step " << j["step"];
        EXPECT_EQ(j.value("tensor_allreduce_bytes", int64_t{-1}), allreduce) << run << " step " << j["step"];
      }
      EXPECT_EQ(lines, 4) << run;
    }
  }
}

// What sequence parallelism is not built with is refused in one line naming the key.
TEST_F(TensorParallel, SequenceParallelRefusesWhatItIsNotBuiltWith) {
  auto refuses = [](std::vector<std::string> sets, int world, const std::string& needle) {
    sets.insert(sets.begin(), {"model.preset=tiny", "parallel.sequence_parallel=true"});
    const std::string why = testing::config_refusal(sets, world);
    EXPECT_NE(why.find(needle), std::string::npos) << why;
  };
  refuses({}, 1, "config key 'parallel.sequence_parallel': expected false with parallel.tensor = 1");
  // With context parallelism a rank's rows are its chunks: B x T / context of them.
  refuses({"parallel.tensor=4", "parallel.context=2", "train.batch_size=1", "train.seq_len=4", "model.n_head=4",
           "model.attention=blockwise"},
          8, "config key 'train.batch_size': expected batch_size x seq_len / parallel.context (1 x 4 / 2) divisible by "
             "parallel.tensor with parallel.sequence_parallel, found 1");
  refuses({"parallel.tensor=2", "train.batch_size=1", "train.seq_len=31", "model.max_seq_len=32"}, 2,
          "config key 'train.batch_size': expected batch_size x seq_len (1 x 31) divisible by parallel.tensor");
  EXPECT_EQ(testing::config_refusal({"model.preset=tiny", "parallel.tensor=2", "parallel.sequence_parallel=true"}, 4),
            "");
  // (Built with pipelines, recomputation, bf16 and context parallelism.)
  for (const std::string set : {"parallel.pipeline=2", "train.recompute=full", "runtime.precision=bf16"}) {
    EXPECT_EQ(testing::config_refusal({"model.preset=tiny", "parallel.tensor=2", "parallel.sequence_parallel=true", set},
                                      4),
              "")
        << set;
  }
  EXPECT_EQ(testing::config_refusal({"model.preset=tiny", "parallel.tensor=2", "parallel.sequence_parallel=true",
                                     "parallel.context=2", "model.attention=blockwise"},
                                    4),
            "");
  // A job refused the same way (exit 2, before any step).
  auto r = train(1, 8, "x", "--set parallel.sequence_parallel=true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("parallel.sequence_parallel"), std::string::npos) << r.output;
}

TEST_F(TensorParallel, LayoutsAndModelsThatCannotBeSplitAreRefusedInOneLine) {
  auto refused = [](const testing::CommandResult& r, const std::string& needle) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  // The toy model: 4 heads, 256 MLP units, vocabulary 64 padded to 128.
  refused(train(3, 8, "x", "--set parallel.tensor=3"), "config key 'parallel.tensor': expected a divisor of the "
                                                       "model's attention heads, model.n_head (4), found 3");
  refused(train(3, 8, "x", "--set parallel.tensor=2"), "config key 'parallel.tensor': expected pipeline x tensor (1 x 2) "
                                                       "dividing the 3 rank(s) of this job");
  refused(train(4, 8, "x", "--set parallel.tensor=2 --set parallel.data=1"), "parallel.data");
  refused(train(2, 8, "x", "--set parallel.tensor=2 --set parallel.pipeline=2"), "parallel.tensor");
  // Configurations alone (no job started): the hidden size, key/value heads, vocabulary, a dual encoder, llama.
  auto refusal = [](std::vector<std::string> sets, int world) { return testing::config_refusal(sets, world); };
  EXPECT_NE(refusal({"model.preset=tiny", "model.n_head=4", "model.n_embd=64", "parallel.tensor=8"}, 8)
                .find("expected a divisor of the model's attention heads, model.n_head (4), found 8"),
            std::string::npos);
  auto refuses = [&](std::vector<std::string> sets, int world, const std::string& needle) {
    const std::string why = refusal(sets, world);
    EXPECT_NE(why.find(needle), std::string::npos) << why;
  };
  // 3 heads of 16: the vocabulary (64, padded to 128 rows) does not split in 3.
  refuses({"model.preset=tiny", "model.vocab_size=64", "model.n_head=3", "model.n_embd=48", "parallel.tensor=3"}, 3,
          "config key 'parallel.tensor': expected a divisor of the model's padded vocabulary, model.vocab_size rounded "
          "up (128), found 3");
  refuses({"model.family=llama", "model.preset=tiny", "model.n_head=4", "model.n_kv_head=1", "model.n_embd=64",
           "parallel.tensor=2"}, 2, "key/value heads, model.n_kv_head (1), found 2");
  refuses({"model.family=llama", "model.preset=tiny", "model.n_head=4", "model.n_embd=64", "model.ffn_hidden=171",
           "parallel.tensor=2"}, 2, "MLP hidden units (171), found 2");
  refuses({"model.preset=tiny", "parallel.tensor=2", "clip.image_tower=resnet18"}, 2,
          "config key 'parallel.tensor': expected 1 with clip.image_tower");
  EXPECT_EQ(refusal({"model.preset=tiny", "parallel.tensor=2"}, 2), "");
  EXPECT_EQ(refusal({"model.preset=tiny", "parallel.tensor=2"}, 4), "");  // data 2 x tensor 2
  EXPECT_EQ(refusal({"model.preset=tiny", "parallel.tensor=2", "parallel.pipeline=2"}, 4), "");
  EXPECT_EQ(refusal({"model.preset=tiny", "parallel.tensor=2", "parallel.pipeline=2", "parallel.zero=3",
                     "train.batch_size=8", "parallel.micro_batches=4"}, 8),
            "");  // (ZeRO-3 of a pipeline of tensor groups: built)
  // A pipeline of tensor groups: what is not built for shards yet.
  for (const auto& [set, key] : {std::pair<std::string, std::string>{"parallel.predict_gradients=mean",
                                                                     "parallel.predict_gradients"}}) {
    refuses({"model.preset=tiny", "parallel.tensor=2", "parallel.pipeline=2", "monitor.layer_costs_every=2",
             "train.batch_size=8", "parallel.micro_batches=4", set}, 4,
            "config key '" + key + "': expected its default with parallel.tensor > 1 (not yet supported together)");
  }
}

}  // namespace
}  // namespace keel
