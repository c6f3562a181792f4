// ZeRO-3 (parallel.zero = 3, comm/sharded_params.h) through the keel binary over OpenMPI: N ranks
// train what one rank trains with the whole batch, with gradient accumulation and every
// zero3_keep; checkpoints resume exactly under ZeRO 0..3 and on another rank count, and evaluate
// and generate on one process; a rank's parameter memory, measured, is its shard plus the layers
// in flight; one rank shards nothing (said so); combinations not supported are refused in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "runtime/job_config.h"
#include "test_util.h"
#include "toy_runs.h"

namespace keel {
namespace {

using testing::run_keel;

class Zero3 : public testing::ToyRuns {
 protected:
  Zero3() : ToyRuns("keel-zero3") {}
  std::vector<nlohmann::json> step_lines(const std::string& run) { return testing::step_lines(dir / (run + "/metrics.jsonl")); }
  std::vector<char> param_bytes(const std::string& run) { return testing::checkpoint_bytes(dir / (run + "/ckpt")); }
};

TEST_F(Zero3, NRanksTrainWhatOneRankTrainsWithTheWholeBatch) {
  ASSERT_EQ(train(0, 8, "one").exit_code, 0);
  ASSERT_EQ(losses("one").size(), 20u);
  for (int n : {2, 4}) {
    const std::string run = "z3n" + std::to_string(n);
    auto r = train(n, 8 / n, run, "--set parallel.zero=3");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 over " + std::to_string(n) + " ranks"), std::string::npos) << r.output;
    // The memory line gives what a rank holds: its shard and what is in flight, not the whole model.
    EXPECT_NE(r.output.find("keel: memory per rank: params "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(" MB (its shard) + up to "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("grads "), std::string::npos) << r.output;
    expect_same_training("one", run);
  }
  // Keeping gathered layers until backward changes what is communicated, not what is computed.
  for (const char* keep : {"last", "all"}) {
    const std::string run = std::string("keep_") + keep;
    auto r = train(2, 4, run, std::string("--set parallel.zero=3 --set parallel.zero3_keep=") + keep);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(param_bytes(run), param_bytes("z3n2")) << keep;
    EXPECT_EQ(losses(run), losses("z3n2")) << keep;
  }
}

// The progress thread (parallel.zero3_progress_thread) moves when the broadcasts ahead complete,
// never what they carry: the same bytes with it and without it, on 2 and 4 ranks.
TEST_F(Zero3, TheProgressThreadChangesNoBytes) {
  for (int n : {2, 4}) {
    const std::string steps = "--set train.steps=6 --set parallel.zero=3 --set parallel.zero3_progress_thread=";
    const std::string on = "thread_on" + std::to_string(n), off = "thread_off" + std::to_string(n);
    auto r = train(n, 8 / n, on, steps + "true");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("broadcast ahead, driven by a progress thread)"), std::string::npos) << r.output;
    r = train(n, 8 / n, off, steps + "false");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("broadcast ahead, driven by MPI calls only)"), std::string::npos) << r.output;
    EXPECT_EQ(param_bytes(on), param_bytes(off)) << n;
    EXPECT_EQ(losses(on), losses(off)) << n;
    EXPECT_GT(step_lines(on).back()["zero3_ahead_peak_bytes"].get<std::vector<int64_t>>().at(0), 0) << n;
  }
}

TEST_F(Zero3, GradientAccumulation) {
  ASSERT_EQ(train(0, 8, "acc1", "--set train.grad_accum=2").exit_code, 0);
  auto r = train(2, 4, "acc2", "--set train.grad_accum=2 --set parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training("acc1", "acc2");
}

// llama (untied head, RMSNorm, SwiGLU, RoPE) and bf16 products: ZeRO-3 gives the bytes ZeRO-0 gives
// on the same ranks, and llama's ranks train what one rank trains with the whole batch.
TEST_F(Zero3, LlamaAndBf16ProductsTrainAsWithoutSharding) {
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32 "
                            "--set train.steps=8 ";
  ASSERT_EQ(train(0, 8, "llama1", llama).exit_code, 0);
  for (int zero : {0, 3}) {
    auto r = train(2, 4, "llama2z" + std::to_string(zero), llama + "--set parallel.zero=" + std::to_string(zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  EXPECT_EQ(param_bytes("llama2z3"), param_bytes("llama2z0"));
  expect_same_training("llama1", "llama2z3");
  for (int zero : {0, 3}) {
    auto r = train(2, 4, "bf16z" + std::to_string(zero),
                   "--set train.steps=8 --set runtime.precision=bf16 --set parallel.zero=" + std::to_string(zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  EXPECT_EQ(param_bytes("bf16z3"), param_bytes("bf16z0"));
  EXPECT_EQ(losses("bf16z3"), losses("bf16z0"));
}

// A rank holds its own shard between layers, and its shard plus the gathered layers at the most:
// measured (resident pages), against the partition's accounting; on the recorded schedule the
// next layer's broadcasts start ahead.
TEST_F(Zero3, ParameterBytesAreTheShardPlusTheLayersInFlight) {
  for (const char* keep : {"none", "all"}) {
    const std::string run = std::string("mem_") + keep;
    auto r = train(2, 4, run,
                   std::string("--set train.steps=4 --set parallel.zero=3 --set parallel.zero3_keep=") + keep);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<nlohmann::json> steps = step_lines(run);
    ASSERT_EQ(steps.size(), 4u);
    for (const nlohmann::json& s : steps) {
      const auto shard = s["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
      const auto resident = s["zero3_param_resident_bytes"].get<std::vector<int64_t>>();
      const auto peak = s["zero3_param_peak_resident_bytes"].get<std::vector<int64_t>>();
      const auto in_flight = s["zero3_in_flight_peak_bytes"].get<std::vector<int64_t>>();
      const auto received = s["zero3_gathered_bytes"].get<std::vector<int64_t>>();
      const auto ahead = s["zero3_ahead_peak_bytes"].get<std::vector<int64_t>>();
      ASSERT_EQ(shard.size(), 2u) << s.dump();
      const int64_t whole = shard[0] + shard[1];
      for (int rank = 0; rank < 2; ++rank) {
        SCOPED_TRACE(std::string(keep) + " step " + s["step"].dump() + " rank " + std::to_string(rank));
        EXPECT_GT(shard[rank], 0);
        EXPECT_EQ(resident[rank], shard[rank]);  // between steps: its own shard only
        EXPECT_EQ(peak[rank], shard[rank] + in_flight[rank]);
        const int64_t others = whole - shard[rank];
        if (std::string(keep) == "all") {
          EXPECT_EQ(in_flight[rank], others);  // every other rank's layer at once
        } else {
          EXPECT_GT(in_flight[rank], 0);
          EXPECT_LT(in_flight[rank], others);
        }
        // From the second step on, the leases follow the last step's record (not the evaluation's
        // before the first step): layers arrive ahead.
        if (s["step"].get<int>() >= 2) {
          EXPECT_GT(ahead[rank], 0);
        }
        EXPECT_LE(ahead[rank], others);
        // Kept, every other rank's chunk arrives once a step (for the first step, in the evaluation
        // before it, which keeps them too); otherwise at least once for forward and again for backward.
        if (std::string(keep) == "all") {
          EXPECT_EQ(received[rank] + s["zero3_eval_gathered_bytes"][rank].get<int64_t>(), others);
        } else {
          EXPECT_GE(received[rank], 2 * others);
        }
      }
    }
  }
}

// Start-up draws (or loads) a rank's own chunks only: before the first step its parameter pages
// are its shard (mincore), and its peak resident set grows with the model by its share, not by the
// whole model (two depths of one width: the 8 extra layers' parameters dwarf what else grows).
TEST_F(Zero3, StartUpHoldsTheShardNotTheWholeModel) {
  const std::string wide = "--set model.n_embd=512 --set train.seq_len=16 --set train.steps=1 --set train.eval_batches=1 "
                           "--set parallel.zero=3 --set model.n_layer=";
  std::map<int, std::vector<int64_t>> peak, whole;
  for (int layers : {8, 16}) {
    const std::string run = "wide" + std::to_string(layers);
    auto r = train(2, 1, run, wide + std::to_string(layers));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const nlohmann::json first = step_lines(run).at(0);
    const auto shard = first["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
    const auto resident = first["zero3_startup_param_resident_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(shard.size(), 2u);
    EXPECT_EQ(resident, shard) << run;
    peak[layers] = first["zero3_startup_peak_rss_bytes"].get<std::vector<int64_t>>();
    whole[layers] = {shard[0] + shard[1], shard[0], shard[1]};
  }
  const int64_t added = whole[16][0] - whole[8][0];
  ASSERT_GT(added, 90'000'000);
  for (int rank = 0; rank < 2; ++rank) {
    const int64_t share = whole[16][rank + 1] - whole[8][rank + 1];
    const int64_t grown = peak[16][rank] - peak[8][rank];
    EXPECT_GE(grown, share / 2) << "rank " << rank;  // the shard's pages are resident: measured
    EXPECT_LT(grown, share + added / 4) << "rank " << rank << ": its share " << share << " of " << added;
  }
  // Resumed from a checkpoint: only the rank's own chunks are loaded.
  auto r = train(2, 1, "wide_resumed", wide + "16 --set train.steps=2 --set train.resume=" + dir / "wide16/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json first = step_lines("wide_resumed").at(0);
  EXPECT_EQ(first["zero3_startup_param_resident_bytes"], first["zero3_param_shard_bytes"]);
  EXPECT_EQ(first["step"].get<int>(), 2);
}

TEST_F(Zero3, CheckpointsResumeExactlyUnderEveryZeroAndRankCount) {
  ASSERT_EQ(train(2, 4, "straight", "--set parallel.zero=3 --set train.steps=12").exit_code, 0);
  ASSERT_EQ(train(2, 4, "half3", "--set parallel.zero=3 --set train.steps=6").exit_code, 0);
  ASSERT_EQ(train(2, 4, "half1", "--set parallel.zero=1 --set train.steps=6").exit_code, 0);
  // ZeRO-3's checkpoint resumed under ZeRO 0, 1, 2 and 3, and ZeRO-1's under ZeRO-3: the same bytes.
  for (int zero : {0, 1, 2, 3}) {
    const std::string run = "from3z" + std::to_string(zero);
    auto r = train(2, 4, run,
                   "--set parallel.zero=" + std::to_string(zero) + " --set train.steps=12 --set train.resume=" +
                       dir / "half3/ckpt");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(param_bytes(run), param_bytes("straight")) << run;
    EXPECT_EQ(testing::checkpoint_bytes(dir / (run + "/ckpt"), Plane::adam_v),
              testing::checkpoint_bytes(dir / "straight/ckpt", Plane::adam_v))
        << run;
  }
  auto r = train(2, 4, "from1", "--set parallel.zero=3 --set train.steps=12 --set train.resume=" + dir / "half1/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("from1"), param_bytes("straight"));
  // On 4 ranks (batch 2 each: the same global batch), and on one process.
  r = train(4, 2, "on4", "--set parallel.zero=3 --set train.steps=12 --set train.resume=" + dir / "half3/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(0, 8, "on1", "--set train.steps=12 --set train.resume=" + dir / "half3/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* run : {"on4", "on1"}) {
    for (const auto& [name, d] : testing::weight_distance(dir / "straight/ckpt", dir / (std::string(run) + "/ckpt"))) {
      EXPECT_LT(d, 1e-5) << run << ": " << name;
    }
  }
}

// A ZeRO-3 rank's checkpoints stream from its own chunks (no snapshot copy of its range: under
// ZeRO-3 that copy is most of what the rank holds), full and differential alike, and resume
// exactly: from a differential one under ZeRO-0, from a full one under ZeRO-3 on 4 ranks.
TEST_F(Zero3, CheckpointsStreamWithoutASnapshotAndResumeExactly) {
  const std::string every = " --set train.steps=12 --set train.checkpoint_every=2 --set checkpoint.full_every=3 "
                            "--set checkpoint.keep=10";
  auto r = train(2, 4, "streamed", "--set parallel.zero=3" + every);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoint buffers 0.0 MB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(": differential,"), std::string::npos) << r.output;
  auto z2 = train(2, 4, "snapshot", "--set parallel.zero=2" + every);
  ASSERT_EQ(z2.exit_code, 0) << z2.output;
  EXPECT_EQ(z2.output.find("checkpoint buffers 0.0 MB"), std::string::npos) << z2.output;  // ZeRO-2 snapshots
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "streamed/ckpt", plane), testing::checkpoint_bytes(dir / "snapshot/ckpt", plane))
        << static_cast<int>(plane);
  }
  // Step 6's checkpoint is the third (differential: its unchanged chunks point into older ones).
  const std::string step6 = dir / "streamed/ckpt/step-00000006";
  const auto manifest = nlohmann::json::parse(read_text_file(step6 + "/manifest.json"));
  ASSERT_NE(manifest.value("base", ""), "") << manifest.dump().substr(0, 400);
  r = train(2, 4, "from6z0", "--set parallel.zero=0 --set train.steps=12 --set train.resume=" + step6);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(4, 2, "from6on4", "--set parallel.zero=3 --set train.steps=12 --set train.resume=" + step6);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("from6z0"), param_bytes("streamed"));
  EXPECT_EQ(testing::checkpoint_bytes(dir / "from6z0/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(dir / "streamed/ckpt", Plane::adam_v));
  for (const auto& [name, d] : testing::weight_distance(dir / "streamed/ckpt", dir / "from6on4/ckpt")) {
    EXPECT_LT(d, 1e-5) << name;
  }
}

// Samples at the end of a ZeRO-3 run (rank 0 alone runs the model: the whole model gathered
// first), and `keel eval` / `keel generate` on one process from its checkpoint: as from ZeRO-0's.
// A rank SIGKILLed while writing a checkpoint (KEEL_FAULT kills it at a file operation) is
// recovered by `keel launch --max-restarts` from the last checkpoint, sharded again, to the
// uninterrupted run's bytes: parameters and both moments.
TEST_F(Zero3, AKilledRankIsRecoveredToTheUninterruptedBytes) {
  const std::string job = "launch -n 2 --max-restarts 1 -- train --config " + dir / "toy.toml" +
                          " --set train.batch_size=4 --set train.steps=12 --set parallel.zero=3 --set train.run_dir=";
  auto reference = run_keel(job + dir / "reference --set train.checkpoint_every=0");
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  // Rank 1's operations per checkpoint: create_dirs, create r1.bin, one append per chunk and
  // plane, sync, close, sync_dir. Killed at its fourth append of the second checkpoint (step 8).
  const auto manifest =
      nlohmann::json::parse(read_text_file(testing::newest_checkpoint(dir / "reference/ckpt") + "/manifest.json"));
  const auto& writers = manifest.at("layout").at("writers");
  ASSERT_EQ(writers.size(), 2u);
  const int chunks = writers[1][1].get<int>() - writers[1][0].get<int>();
  const int op = (3 * chunks + 5) + 2 + 4;
  const std::string fault =
      "KEEL_FAULT=kill:op=" + std::to_string(op) + ":path=ckpt/step-:rank=1:once=" + dir / "fault.spent";
  auto killed = testing::run_command(fault + " " + std::string(KEEL_BINARY) + " " + job + dir / "killed" +
                                     " --set train.checkpoint_every=4");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("restart 1 of 1"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("resumed from"), std::string::npos) << killed.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "killed/ckpt", plane), testing::checkpoint_bytes(dir / "reference/ckpt", plane))
        << static_cast<int>(plane);
  }
}

TEST_F(Zero3, SamplesEvaluatesAndGeneratesFromAZero3Checkpoint) {
  std::filesystem::create_directories(dir / "text");
  for (int i = 0; i < 10; ++i) {
    testing::write_text(dir / ("text/" + std::to_string(i) + ".txt"),
                        "The cat sat on the mat number " + std::to_string(i) + " and a bird flew by.\n");
  }
  const auto tokenized = run_keel("tokenize --input " + dir / "text" + " --out " + dir / "tok" + " --vocab-size 290");
  ASSERT_EQ(tokenized.exit_code, 0) << tokenized.output;
  const std::string text = "--set train.steps=6 --set model.vocab_size=290 --set train.sample_tokens=8 --set "
                           "data.tokenizer=" + dir / "tok/tokenizer.json --set parallel.zero=";
  auto z3 = train(2, 4, "z3", text + "3");
  ASSERT_EQ(z3.exit_code, 0) << z3.output;
  auto z0 = train(2, 4, "z0", text + "0");
  ASSERT_EQ(z0.exit_code, 0) << z0.output;
  ASSERT_EQ(param_bytes("z3"), param_bytes("z0"));
  const auto samples = [](const std::string& out) { return out.substr(out.find("samples (")); };
  ASSERT_NE(z3.output.find("--- sample 1 ---"), std::string::npos) << z3.output;
  EXPECT_EQ(samples(z3.output), samples(z0.output));
  const std::string eval = " --data " + dir / "val.bin" + " --batch 2 --seq 16 --batches 3";
  auto a = run_keel("eval --checkpoint " + dir / "z3/ckpt" + eval);
  auto b = run_keel("eval --checkpoint " + dir / "z0/ckpt" + eval);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(nlohmann::json::parse(a.output)["loss"], nlohmann::json::parse(b.output)["loss"]);
  const std::string gen = " --tokens 8 --seed 5 --prompt 'The cat'";
  auto g = run_keel("generate --checkpoint " + dir / "z3/ckpt" + gen);
  auto h = run_keel("generate --checkpoint " + dir / "z0/ckpt" + gen);
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_EQ(g.output, h.output);
}

// Inside a pipeline: world = data 2 x pipeline 2 (4 ranks), each stage's two replicas shard that
// stage's chunks. Both families and four schedules (interleaved and zb-v: two stages a rank)
// train what one rank trains with the whole batch; the stage checkpoints, written in the whole
// model's layout, resume exactly on the same layout and within 1e-5 on one rank, and one rank's
// checkpoint resumes on the sharded pipeline.
TEST_F(Zero3, InsideEachPipelineStagesReplicas) {
  const std::string common = "--set model.n_layer=6 --set train.grad_accum=4 --set train.eval_every=0 "
                             "--set train.checkpoint_every=10 ";
  const std::string piped = common + "--set parallel.pipeline=2 --set train.global_batch_size=2 "
                                     "--set parallel.micro_batches=4 --set parallel.zero=3 --set parallel.schedule=";
  const std::string llama = "--set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32 ";
  ASSERT_EQ(train(0, 2, "one", common).exit_code, 0);
  ASSERT_EQ(train(0, 2, "llama1", llama + common).exit_code, 0);
  for (const auto& [family, schedule] : std::vector<std::pair<std::string, std::string>>{
           {"gpt2", "1f1b"}, {"gpt2", "zb-v"}, {"llama", "interleaved"}, {"llama", "zb-h1"}}) {
    const std::string run = family + "-" + schedule;
    auto r = train(4, 2, run, (family == "llama" ? llama : "") + piped + schedule);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("x 2 data-parallel replica(s)"), std::string::npos) << r.output;
    // Every rank of a stage holds its shard of the stage's chunks, not the stage's whole plane.
    const nlohmann::json last = step_lines(run).back();
    const auto shard = last["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
    ASSERT_EQ(shard.size(), 2u) << last.dump();
    EXPECT_GT(shard[0], 0);
    EXPECT_GT(shard[1], 0);
    expect_same_training(family == "llama" ? "llama1" : "one", run);
  }
  // Resumed from step 10 (the runs above checkpoint every 10 steps): the sharded pipeline's
  // checkpoint on the same layout (the same bytes as without the stop) and on one rank; one
  // rank's checkpoint on the sharded pipeline.
  const std::string step10 = "/ckpt/step-00000010";
  auto r = train(4, 2, "p_from_p", piped + "1f1b --set train.resume=" + dir / ("gpt2-1f1b" + step10));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_EQ(param_bytes("p_from_p"), param_bytes("gpt2-1f1b"));
  EXPECT_EQ(testing::checkpoint_bytes(dir / "p_from_p/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(dir / "gpt2-1f1b/ckpt", Plane::adam_v));
  const std::vector<double> straight = losses("gpt2-1f1b");
  EXPECT_EQ(losses("p_from_p"), std::vector<double>(straight.begin() + 10, straight.end()));
  r = train(0, 2, "one_from_p", common + "--set train.resume=" + dir / ("gpt2-1f1b" + step10));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = train(4, 2, "p_from_one", piped + "zb-v --set train.resume=" + dir / ("one" + step10));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* run : {"one_from_p", "p_from_one"}) {
    ASSERT_EQ(losses(run).size(), 10u) << run;
    for (const auto& [name, d] : testing::weight_distance(dir / "one/ckpt", dir / (std::string(run) + "/ckpt"))) {
      EXPECT_LT(d, 1e-5) << run << ": " << name;
    }
  }
}

// ZeRO-Infinity's layout: each rank's shard homed by the tier policy (a 1 MiB compute tier, the
// rest on NVMe files), other ranks' layers broadcast into the compute tier
// under their lease. The same bytes as ZeRO-3 in memory, what one rank trains within 1e-5, and
// its checkpoint resumes through the tiers to the same bytes.
TEST_F(Zero3, ShardsHomedOnTheNvmeTier) {
  std::filesystem::create_directories(dir / "nvme");
  const std::string model = "--set store.chunk_bytes=16384 --set train.checkpoint_every=10 ";
  const std::string tiers = "--set parallel.zero=3 --set tier.device_mib=1 --set tier.host_mib=0 --set tier.verify=true "
                            "--set tier.nvme_dir=" + dir / "nvme ";
  ASSERT_EQ(train(0, 8, "one", model).exit_code, 0);
  ASSERT_EQ(train(2, 4, "memory", model + "--set parallel.zero=3").exit_code, 0);
  auto r = train(2, 4, "tiered", model + tiers);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "tiered/ckpt", plane), testing::checkpoint_bytes(dir / "memory/ckpt", plane))
        << static_cast<int>(plane);
  }
  EXPECT_EQ(losses("tiered"), losses("memory"));
  expect_same_training("one", "tiered");
  EXPECT_GT(step_lines("tiered").back()["tier_nvme_read_bytes"].get<double>(), 0);
  // Updates applied at once rather than deferred into the next forward pass: the same bytes.
  r = train(2, 4, "undeferred", model + tiers + "--set tier.defer_update=false");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("undeferred"), param_bytes("memory"));
  r = train(2, 4, "resumed", model + tiers + "--set train.resume=" + dir / "tiered/ckpt/step-00000010");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "resumed/ckpt", plane), testing::checkpoint_bytes(dir / "tiered/ckpt", plane))
        << static_cast<int>(plane);
  }
  // Every gathered layer kept until the optimizer step (zero3_keep = "all") in a compute tier that
  // cannot hold them: other ranks' pages are evicted with bytes, spill to scratch and come back
  // from it, to the same bytes.
  const std::string wide = "--set model.n_embd=128 --set tier.lookahead=2 ";
  ASSERT_EQ(train(2, 4, "kept_memory", model + wide + "--set parallel.zero=3 --set parallel.zero3_keep=all").exit_code, 0);
  r = train(2, 4, "kept", model + wide + tiers + "--set parallel.zero3_keep=all");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("kept"), param_bytes("kept_memory"));
  EXPECT_EQ(losses("kept"), losses("kept_memory"));
  const nlohmann::json last = step_lines("kept").back();
  const auto kept_shard = last["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
  const int64_t kept_scratch = last["tier_nvme_scratch_bytes"].get<int64_t>();
  EXPECT_EQ(last["tier_nvme_file_bytes"].get<int64_t>(), 4 * kept_shard.at(0) + kept_scratch);
  EXPECT_GT(kept_scratch, 0);
  EXPECT_LT(kept_scratch, 2 * (kept_shard.at(0) + kept_shard.at(1)));
  std::printf("keep all: rank 0's own slots %lld bytes, scratch %lld, whole model's parameters %lld\n",
              static_cast<long long>(4 * kept_shard.at(0)), static_cast<long long>(kept_scratch),
              static_cast<long long>(kept_shard.at(0) + kept_shard.at(1)));
}

// A rank's NVMe file holds slots for its own chunks only (store/tiers.h, transient pages): every
// class homed on NVMe, its file at the end of each step is its shard's four planes (parameters,
// gradients, both moments: 4 x zero3_param_shard_bytes, the partition's figure) plus the scratch
// that other ranks' pages spilled to (measured: the file's disk blocks), where slots for every
// chunk's parameters and gradients would be 2 x the whole model's more. The same bytes as ZeRO-3
// in memory, and an exact resume through the tiers.
TEST_F(Zero3, ARanksTierFileHoldsItsOwnShard) {
  std::filesystem::create_directories(dir / "nvme");
  const std::string model = "--set store.chunk_bytes=16384 --set train.checkpoint_every=10 ";
  const std::string tiers = "--set parallel.zero=3 --set tier.device_mib=1 --set tier.host_mib=0 --set tier.verify=true "
                            "--set tier.embedding=nvme --set tier.attention=nvme --set tier.ffn=nvme --set tier.norm=nvme "
                            "--set tier.optimizer=nvme --set tier.nvme_dir=" + dir / "nvme ";
  ASSERT_EQ(train(2, 4, "memory", model + "--set parallel.zero=3").exit_code, 0);
  auto r = train(2, 4, "tiered", model + tiers);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(ZeRO-3) have no NVMe slots"), std::string::npos) << r.output;
  EXPECT_EQ(param_bytes("tiered"), param_bytes("memory"));
  EXPECT_EQ(losses("tiered"), losses("memory"));
  const std::vector<nlohmann::json> lines = step_lines("tiered");
  ASSERT_EQ(lines.size(), 20u);
  const auto shard = lines.back()["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
  ASSERT_EQ(shard.size(), 2u);
  const int64_t whole = shard[0] + shard[1], own = 4 * shard[0];  // rank 0's: the line's tier figures are its
  int64_t most_scratch = 0;
  for (const nlohmann::json& line : lines) {
    const int64_t file = line["tier_nvme_file_bytes"].get<int64_t>(), scratch = line["tier_nvme_scratch_bytes"].get<int64_t>();
    EXPECT_EQ(file, own + scratch) << line["step"];
    // Spilled transient pages stay well below slots for every chunk's parameters and gradients.
    EXPECT_LT(scratch, whole) << line["step"];
    most_scratch = std::max(most_scratch, scratch);
  }
  std::printf("rank 0: own slots %lld bytes, scratch at most %lld, whole model's parameters %lld\n",
              static_cast<long long>(own), static_cast<long long>(most_scratch), static_cast<long long>(whole));
  EXPECT_GT(lines.back()["tier_nvme_read_bytes"].get<double>(), 0);
  r = train(2, 4, "resumed", model + tiers + "--set train.resume=" + dir / "tiered/ckpt/step-00000010");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "resumed/ckpt", plane), testing::checkpoint_bytes(dir / "tiered/ckpt", plane))
        << static_cast<int>(plane);
  }
  // Every gathered layer kept until the optimizer step (zero3_keep = "all") in a compute tier that
  // cannot hold them: other ranks' pages are evicted with bytes, spill to scratch and come back
  // from it, to the same bytes.
  const std::string wide = "--set model.n_embd=128 --set tier.lookahead=2 ";
  ASSERT_EQ(train(2, 4, "kept_memory", model + wide + "--set parallel.zero=3 --set parallel.zero3_keep=all").exit_code, 0);
  r = train(2, 4, "kept", model + wide + tiers + "--set parallel.zero3_keep=all");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(param_bytes("kept"), param_bytes("kept_memory"));
  EXPECT_EQ(losses("kept"), losses("kept_memory"));
  const nlohmann::json last = step_lines("kept").back();
  const auto kept_shard = last["zero3_param_shard_bytes"].get<std::vector<int64_t>>();
  const int64_t kept_scratch = last["tier_nvme_scratch_bytes"].get<int64_t>();
  EXPECT_EQ(last["tier_nvme_file_bytes"].get<int64_t>(), 4 * kept_shard.at(0) + kept_scratch);
  EXPECT_GT(kept_scratch, 0);
  EXPECT_LT(kept_scratch, 2 * (kept_shard.at(0) + kept_shard.at(1)));
  std::printf("keep all: rank 0's own slots %lld bytes, scratch %lld, whole model's parameters %lld\n",
              static_cast<long long>(4 * kept_shard.at(0)), static_cast<long long>(kept_scratch),
              static_cast<long long>(kept_shard.at(0) + kept_shard.at(1)));
}

// bf16 training state (runtime.param_dtype / grad_dtype = "bf16") under ZeRO-3: the gathers move
// the owners' bf16 bits (half of float32's bytes, counted in zero3_gathered_bytes), the gradients
// are reduce-scattered in bf16, and each rank keeps float32 masters of its own chunks only. The
// same bytes as ZeRO-2 with bf16 state (on 2 ranks both compute with the owners' bits and sum
// once per element), close to one rank (as bf16_state_test's), and an exact resume.
TEST_F(Zero3, Bf16TrainingStateGathersBitsInHalfTheBytes) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set train.checkpoint_every=10 ";
  ASSERT_EQ(train(0, 8, "one", bf16).exit_code, 0);
  ASSERT_EQ(train(2, 4, "z2", bf16 + "--set parallel.zero=2").exit_code, 0);
  ASSERT_EQ(train(2, 4, "f32", "--set parallel.zero=3 --set train.checkpoint_every=10").exit_code, 0);
  auto r = train(2, 4, "z3", bf16 + "--set parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("keel: bf16 training state: parameters bf16, gradients bf16"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "z3/ckpt", plane), testing::checkpoint_bytes(dir / "z2/ckpt", plane))
        << static_cast<int>(plane);
  }
  EXPECT_EQ(losses("z3"), losses("z2"));
  const std::vector<double> want = losses("one"), got = losses("z3");
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-3 * want[s]) << "step " << s + 1;
  EXPECT_NE(got, losses("f32"));  // bf16, not float32's bytes
  const nlohmann::json last = step_lines("z3").back(), last32 = step_lines("f32").back();
  // The same leases gather the same chunks: in bf16, half the bytes.
  const auto received = last["zero3_gathered_bytes"].get<std::vector<int64_t>>();
  const auto received32 = last32["zero3_gathered_bytes"].get<std::vector<int64_t>>();
  ASSERT_EQ(received.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_GT(received[rank], 0) << rank;
    EXPECT_EQ(2 * received[rank], received32[rank]) << rank;
  }
  // Masters for this rank's shard only; gradients summed on their bits (2 bytes an element).
  EXPECT_LT(last["bf16_master_bytes"].get<int64_t>(), 2 * last["bf16_param_bytes"].get<int64_t>());
  EXPECT_EQ(last["sync_payload_bytes"].get<double>(), static_cast<double>(last["bf16_grad_bytes"].get<int64_t>()));
  EXPECT_EQ(last["bf16_param_broadcast_bytes"].get<int64_t>(), 0);  // no owner's broadcast after the update
  // Between steps a rank's bf16 parameters are its own chunks' bits (measured, mincore): about
  // half of the whole model's on 2 ranks; ZeRO-2's ranks hold every chunk's.
  const int64_t whole = last["bf16_param_bytes"].get<int64_t>();
  EXPECT_LT(last["bf16_param_resident_bytes"].get<int64_t>(), whole * 3 / 4);
  EXPECT_GT(step_lines("z2").back()["bf16_param_resident_bytes"].get<int64_t>(), whole * 3 / 4);
  r = train(2, 4, "resumed", bf16 + "--set parallel.zero=3 --set train.resume=" + dir / "z3/ckpt/step-00000010");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
    EXPECT_EQ(testing::checkpoint_bytes(dir / "resumed/ckpt", plane), testing::checkpoint_bytes(dir / "z3/ckpt", plane))
        << static_cast<int>(plane);
  }
}

// ZeRO-2 snapshots its range for checkpoints: the start-up line counts one snapshot (three planes of
// the rank's writer share) where the only checkpoint is the end-of-run one, and two (the base a
// differential checkpoint is taken against) where differential checkpoints are periodic.
TEST_F(Zero3, SnapshotBuffersCountTheCopiesARunTakes) {
  auto buffers = [&](const std::string& run, const std::string& extra) {
    auto r = train(2, 4, run, "--set parallel.zero=2 --set train.steps=3 --set checkpoint.full_every=3" + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find("checkpoint buffers ");
    EXPECT_NE(at, std::string::npos) << r.output;
    return at == std::string::npos ? 0.0 : std::stod(r.output.substr(at + 19));
  };
  const double once = buffers("end_only", " --set train.checkpoint_every=0");
  const double periodic = buffers("periodic", " --set train.checkpoint_every=1");
  EXPECT_GT(once, 0.0);
  EXPECT_NEAR(periodic, 2 * once, 0.15);  // each printed %.1f
  // One snapshot: three planes of about half the model (the two ranks' writer shares).
  double parameters = 0;
  std::istringstream lines(read_text_file(dir / "end_only/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("model") && j["model"].is_object() && j["model"].contains("parameters")) {
      parameters = j["model"]["parameters"].get<double>();
    }
  }
  ASSERT_GT(parameters, 0.0);
  const double half_mb = 3 * 4.0 * parameters / 2 / 1e6;
  EXPECT_NEAR(once, half_mb, 0.25 * half_mb);
}

// The start-up line's figures under ZeRO-3 + bf16 state are what a rank holds, measured: its own
// chunks' bf16 parameter and gradient bits (mincore, between steps: other ranks' gradient bits
// are given back once reduce-scattered, where ZeRO-1's ranks keep every chunk's), its float32
// masters, the bf16 bits gathered in flight, the float32 pages a layer's lease widens, and the
// moments; "in all" is their sum with the activations. Each measured figure is within the line's
// (which takes the largest over the ranks) and near it.
TEST_F(Zero3, Bf16MemoryLineCountsWhatARankHolds) {
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set model.n_embd=512 "
                           "--set train.steps=3 ";
  auto r = train(2, 4, "z3", bf16 + "--set parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(train(2, 4, "z1", bf16 + "--set parallel.zero=1").exit_code, 0);
  const size_t at = r.output.find("keel: memory per rank: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
  auto bytes = [&](const std::string& before) {
    const size_t i = line.find(before);
    EXPECT_NE(i, std::string::npos) << before << " in " << line;
    return i == std::string::npos ? 0.0 : std::stod(line.substr(i + before.size())) * 1e6;
  };
  const double bits = bytes("params "), masters = bytes("bf16 (its shard) + ");
  const double in_flight = bytes("MB float32 masters (its shard) + up to "), widened = bytes("layers in flight + ");
  const double grads = bytes("grads "), bucket = bytes("reduce-scattered ("), grad_widened = bytes("MB each, bf16) + ");
  const double moments = bytes("AdamW moments "), activations = bytes("activations ");
  const double in_all = bytes("checkpoint buffers 0.0 MB; ");
  const double sum = bits + masters + in_flight + widened + grads + bucket + grad_widened + moments + activations;
  EXPECT_NEAR(in_all, sum, 0.5e6) << line;
  const nlohmann::json last = step_lines("z3").back();
  constexpr double kPrinted = 0.05e6 + 65536;  // %.1f MB, and mincore's whole pages at a range's ends
  auto within = [&](double measured, double printed, double least, const char* what) {
    EXPECT_LE(measured, printed + kPrinted) << what << ": " << line;
    EXPECT_GE(measured, least * printed) << what << ": " << line;
  };
  auto largest = [&](const char* key) {
    const auto v = last[key].get<std::vector<int64_t>>();
    return static_cast<double>(*std::max_element(v.begin(), v.end()));
  };
  within(last["bf16_param_resident_bytes"].get<double>(), bits, 0.8, "parameter bits");
  within(last["bf16_grad_resident_bytes"].get<double>(), grads, 0.8, "gradient bits");
  within(last["bf16_master_bytes"].get<double>(), masters, 0.8, "masters");
  within(largest("zero3_in_flight_peak_bytes"), in_flight, 0.5, "bits in flight");
  within(last["bf16_float_param_peak_bytes"].get<double>(), widened, 0.5, "float32 parameter pages");
  within(last["bf16_float_grad_peak_bytes"].get<double>(), grad_widened, 0.5, "float32 gradient pages");
  within(largest("zero3_moment_bytes"), moments, 0.8, "moments");
  // Other ranks' gradient bits given back (ZeRO-3); ZeRO-1 all-reduces and keeps all of them.
  const double whole = last["bf16_grad_bytes"].get<double>();
  EXPECT_LT(last["bf16_grad_resident_bytes"].get<double>(), 0.75 * whole);
  EXPECT_GT(step_lines("z1").back()["bf16_grad_resident_bytes"].get<double>(), 0.75 * whole);
}

// bf16 training state over memory tiers: the bits and each rank's float32 masters stay in its
// memory, the moments are homed on NVMe files past a 1 MiB compute tier (tier.verify checks every
// page's bytes as it arrives; 128 channels and tier.optimizer = "nvme": a rank's moments, 1.6 MB,
// do not fit the compute tier and are evicted and fetched again every step). On one rank and on
// 2 ranks under ZeRO-3, the same bytes as the same bf16 run without tiers, 12 steps; the 2-rank
// run's checkpoint of step 6 resumes through the tiers to the same bytes.
TEST_F(Zero3, Bf16TrainingStateOverNvmeTiers) {
  std::filesystem::create_directories(dir / "nvme");
  const std::string bf16 = "--set runtime.param_dtype=bf16 --set runtime.grad_dtype=bf16 --set store.chunk_bytes=16384 "
                           "--set model.n_embd=128 --set train.steps=12 --set train.checkpoint_every=6 ";
  const std::string tiers = "--set tier.device_mib=1 --set tier.host_mib=0 --set tier.optimizer=nvme "
                            "--set tier.verify=true --set tier.nvme_dir=" + dir / "nvme ";
  auto same_state = [&](const std::string& a, const std::string& b) {
    for (Plane plane : {Plane::param, Plane::adam_m, Plane::adam_v}) {
      EXPECT_EQ(testing::checkpoint_bytes(dir / (a + "/ckpt"), plane), testing::checkpoint_bytes(dir / (b + "/ckpt"), plane))
          << a << " vs " << b << ", plane " << static_cast<int>(plane);
    }
  };
  ASSERT_EQ(train(0, 8, "one_memory", bf16).exit_code, 0);
  auto r = train(0, 8, "one_tiered", bf16 + tiers);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  same_state("one_tiered", "one_memory");
  EXPECT_EQ(losses("one_tiered"), losses("one_memory"));
  ASSERT_EQ(train(2, 4, "memory", bf16 + "--set parallel.zero=3").exit_code, 0);
  r = train(2, 4, "tiered", bf16 + tiers + "--set parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("keel: bf16 training state: parameters bf16, gradients bf16"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ZeRO-3 over 2 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("keel: tiered memory:"), std::string::npos) << r.output;
  same_state("tiered", "memory");
  EXPECT_EQ(losses("tiered"), losses("memory"));
  const nlohmann::json last = step_lines("tiered").back();
  // The moments travel through the NVMe tier; the bf16 parameters are gathered as without tiers.
  EXPECT_GT(last["tier_nvme_read_bytes"].get<double>(), 0);
  EXPECT_GT(last["tier_nvme_written_bytes"].get<double>(), 0);
  EXPECT_EQ(last["zero3_gathered_bytes"], step_lines("memory").back()["zero3_gathered_bytes"]);
  r = train(2, 4, "resumed", bf16 + tiers + "--set parallel.zero=3 --set train.resume=" + dir / "tiered/ckpt/step-00000006");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  same_state("resumed", "tiered");
}

TEST_F(Zero3, OneRankShardsNothingAndSaysSo) {
  ASSERT_EQ(train(0, 4, "z0", "--set train.steps=4").exit_code, 0);
  auto r = train(0, 4, "z3", "--set train.steps=4 --set parallel.zero=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("parallel.zero = 3 on one data-parallel rank shards nothing"), std::string::npos) << r.output;
  EXPECT_EQ(param_bytes("z3"), param_bytes("z0"));
}

TEST_F(Zero3, CombinationsNotSupportedAreRefusedInOneLine) {
  auto refused = [](const std::vector<std::string>& sets, const std::string& needle, int world = 2) {
    const std::string why = testing::config_refusal(sets, world);
    EXPECT_NE(why.find(needle), std::string::npos) << (why.empty() ? "accepted: " + sets.back() : why);
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  };
  refused({"parallel.zero=3", "sync.codec=sign1"}, "config key 'sync.codec': expected its default with parallel.zero = 3");
  refused({"parallel.zero=3", "parallel.pipeline=2", "parallel.predict_gradients=mean"},
          "config key 'parallel.predict_gradients': expected its default with parallel.zero = 3", 4);
  refused({"parallel.zero=3", "parallel.pipeline=2", "parallel.repartition_every=2", "monitor.layer_costs_every=2"},
          "config key 'parallel.repartition_every': expected its default with parallel.zero = 3", 4);
  refused({"parallel.zero=3", "checkpoint.memory_every=2"}, "checkpoint.memory_every");
  refused({"parallel.zero=4"}, "config key 'parallel.zero': expected 0, 1, 2 or 3, found 4");
  refused({"parallel.zero=3", "parallel.zero3_keep=some"}, "expected \"none\", \"last\" or \"all\", found \"some\"");
  // Allowed where nothing is sharded: one data-parallel rank (a pipeline's stage alone).
  Config c = Config::load("", {"parallel.zero=3", "parallel.pipeline=2"});
  EXPECT_NO_THROW(resolve_job_config(c, 2));
  // Through the binary: one line, non-zero exit.
  auto r = train(2, 4, "x", "--set parallel.zero=3 --set sync.codec=sign1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("config key 'sync.codec': expected its default with parallel.zero = 3"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace keel
