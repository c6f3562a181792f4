// Every Keel technique with the llama family (model.family = "llama", the llama-tiny preset:
// grouped-query attention 4:2, untied head, SwiGLU) on the toy corpus, each against the same
// invariant GPT-2 is held to: data parallelism and its ZeRO stages train what one rank trains;
// HybridGC trains close to dense sync; memory tiers give the bytes of training in memory;
// pipeline schedules train what one rank trains; a resumed run gives the uninterrupted bytes;
// `keel generate` samples from a llama checkpoint, the same tokens for the same seed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

class LlamaTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("keel-llama-train");
    testing::write_toy_corpus(dir_->path());
    testing::write_toy_config(dir_->path(), kSteps);
    const testing::CommandResult r = train(0, "one", "");
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static constexpr int kSteps = 16;
  // 4 micro-batches of 2 sequences per step (pipelines need several); llama-tiny at the toy's size.
  static std::string common() {
    return " --set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=32"
           " --set train.batch_size=2 --set train.grad_accum=4 --set train.eval_every=0";
  }
  static testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    const std::string args = "train --config " + dir_->path() + "/toy.toml" + common() + " --set train.run_dir=" +
                             dir_->path() + "/" + run + " " + extra;
    return testing::run_keel(ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " -- " + args);
  }
  static std::string at(const std::string& run) { return dir_->path() + "/" + run; }
  static std::vector<double> losses(const std::string& run) {
    std::vector<double> out;
    const std::string text = read_text_file(at(run) + "/metrics.jsonl");
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      const nlohmann::json j = nlohmann::json::parse(text.substr(start, end - start));
      if (j.contains("loss") && !j.contains("event")) out.push_back(j.at("loss").get<double>());
      start = end + 1;
    }
    return out;
  }
  // `run` trained what one rank trained: every step's loss and the final weights, within tolerance.
  static void expect_like_one_rank(const std::string& run, double loss_tolerance = 1e-5,
                                   double weight_tolerance = 1e-5) {
    const std::vector<double> want = losses("one"), got = losses(run);
    ASSERT_EQ(got.size(), want.size()) << run;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(std::abs(got[i] - want[i]), loss_tolerance * std::abs(want[i])) << run << " step " << i + 1;
    }
    for (const auto& [name, d] : testing::weight_distance(at("one") + "/ckpt", at(run) + "/ckpt")) {
      EXPECT_LT(d, weight_tolerance) << run << ": " << name;
    }
  }
  static testing::TempDir* dir_;
};

testing::TempDir* LlamaTraining::dir_ = nullptr;

TEST_F(LlamaTraining, OneRankLearnsTheToyLanguage) {
  const std::vector<double> l = losses("one");
  ASSERT_EQ(l.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(l.back(), 0.75 * l.front());
  const std::string config = read_text_file(at("one") + "/config.toml");
  EXPECT_NE(config.find("family = 'llama'"), std::string::npos) << config;
  EXPECT_NE(config.find("n_kv_head = 2"), std::string::npos);
}

// Two data-parallel ranks, each with one sequence of every micro-batch: the same 8 sequences a
// step as one rank; ZeRO-1 and -2 shard moments (and gradients) without changing a byte.
TEST_F(LlamaTraining, DataParallelAndEveryZeroStageTrainWhatOneRankTrains) {
  for (int zero : {0, 1, 2}) {
    const std::string run = "dp2-zero" + std::to_string(zero);
    const testing::CommandResult r =
        train(2, run, "--set train.batch_size=1 --set parallel.zero=" + std::to_string(zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like_one_rank(run);
  }
  EXPECT_EQ(testing::checkpoint_bytes(at("dp2-zero1") + "/ckpt"), testing::checkpoint_bytes(at("dp2-zero0") + "/ckpt"));
  EXPECT_EQ(testing::checkpoint_bytes(at("dp2-zero2") + "/ckpt"), testing::checkpoint_bytes(at("dp2-zero0") + "/ckpt"));
}

// HybridGC (compressed sync with error feedback, after its uncompressed warm-up) trains close to
// dense sync.
TEST_F(LlamaTraining, HybridCompressedSyncTrainsCloseToDense) {
  const testing::CommandResult r =
      train(2, "dp2-hybrid", "--set train.batch_size=1 --set sync.codec=hybrid --set sync.warmup_steps=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("compressed sync \"hybrid\""), std::string::npos) << r.output;
  const std::vector<double> dense = losses("one"), hybrid = losses("dp2-hybrid");
  ASSERT_EQ(hybrid.size(), dense.size());
  EXPECT_LT(std::abs(hybrid.back() - dense.back()), 0.1 * dense.back());
}

TEST_F(LlamaTraining, MemoryTiersGiveTheBytesOfTrainingInMemory) {
  fs::create_directories(at("nvme"));
  const testing::CommandResult r =
      train(0, "tiers", "--set tier.device_mib=1 --set tier.host_mib=1 --set tier.nvme_dir=" + at("nvme"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tiered memory over this run"), std::string::npos) << r.output;
  EXPECT_EQ(testing::checkpoint_bytes(at("tiers") + "/ckpt"), testing::checkpoint_bytes(at("one") + "/ckpt"));
}

// The 4 layers (embedding, 2 blocks, head) cut over 2 stages, in each schedule family.
TEST_F(LlamaTraining, PipelineSchedulesTrainWhatOneRankTrains) {
  for (const char* schedule : {"1f1b", "zb-h2", "zb-v"}) {
    const std::string run = std::string("pipe-") + schedule;
    const testing::CommandResult r =
        train(2, run, std::string("--set parallel.pipeline=2 --set parallel.schedule=") + schedule);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_like_one_rank(run);
  }
}

// With the head tied to the embedding (a pipeline then keeps a replica of wte on the head's stage
// and sums the copies' gradients).
TEST_F(LlamaTraining, ATiedHeadAcrossPipelineStagesTrainsWhatOneRankTrains) {
  ASSERT_EQ(train(0, "tied", "--set model.tie_embeddings=true").exit_code, 0);
  const testing::CommandResult r =
      train(2, "tied-pipe", "--set model.tie_embeddings=true --set parallel.pipeline=2 --set parallel.schedule=1f1b");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> want = losses("tied"), got = losses("tied-pipe");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(std::abs(got[i] - want[i]), 1e-5 * want[i]) << "step " << i + 1;
  for (const auto& [name, d] : testing::weight_distance(at("tied") + "/ckpt", at("tied-pipe") + "/ckpt")) {
    EXPECT_LT(d, 1e-5) << name;
  }
}

// Resumed from the checkpoint of step 8, trained to the end: the bytes of the uninterrupted run.
TEST_F(LlamaTraining, AResumedRunGivesTheUninterruptedBytes) {
  ASSERT_EQ(train(0, "saving", "--set train.checkpoint_every=8").exit_code, 0);
  const testing::CommandResult r = train(0, "resumed", "--set train.resume=" + at("saving") + "/ckpt/step-00000008");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_EQ(testing::checkpoint_bytes(at("resumed") + "/ckpt"), testing::checkpoint_bytes(at("one") + "/ckpt"));
  EXPECT_EQ(testing::checkpoint_bytes(at("resumed") + "/ckpt", Plane::adam_v),
            testing::checkpoint_bytes(at("one") + "/ckpt", Plane::adam_v));
}

// Text in, text out: a BPE tokenizer of the fortunes (320 tokens), a few steps, then samples.
TEST_F(LlamaTraining, GenerateSamplesFromALlamaCheckpointDeterministically) {
  const std::string data = dir_->path() + "/fortunes";
  ASSERT_EQ(testing::run_keel("tokenize --out " + data + " --vocab-size 320").exit_code, 0);
  const testing::CommandResult t = testing::run_keel(
      "train --set model.preset=llama-tiny --set model.vocab_size=320 --set train.steps=4 --set train.seq_len=32"
      " --set train.batch_size=2 --set train.eval_every=0 --set train.sample_tokens=0 --set data.train=" + data +
      "/train.bin --set data.val=" + data + "/val.bin --set data.tokenizer=" + data +
      "/tokenizer.json --set train.run_dir=" + at("text"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const std::string ckpt = testing::newest_checkpoint(at("text") + "/ckpt");
  const std::string cmd = "generate --checkpoint " + ckpt + " --tokens 12 --seed 3 --prompt 'The '";
  const testing::CommandResult a = testing::run_keel(cmd), b = testing::run_keel(cmd);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output, b.output);
  EXPECT_FALSE(a.output.empty());
  const testing::CommandResult eval = testing::run_keel("eval --checkpoint " + ckpt + " --data " + data + "/val.bin");
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_NE(eval.output.find("loss"), std::string::npos) << eval.output;
}

// A llama checkpoint exports to llama2.c's format (the default for the family) and evaluates to
// the same loss from that file; llm.c's format holds GPT-2 only, so --format llmc is refused.
TEST_F(LlamaTraining, ExportsToLlama2cAndEvaluatesTheSameFromIt) {
  const std::string ckpt = testing::newest_checkpoint(at("one") + "/ckpt");
  const testing::CommandResult r = testing::run_keel("export --checkpoint " + ckpt + " --out " + at("model.bin"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("llama2.c"), std::string::npos) << r.output;
  const std::string data = " --data " + dir_->path() + "/val.bin --batch 2 --seq 32 --batches 4";
  const testing::CommandResult from_ckpt = testing::run_keel("eval --checkpoint " + ckpt + data);
  const testing::CommandResult from_file = testing::run_keel("eval --llama2c " + at("model.bin") + data);
  ASSERT_EQ(from_ckpt.exit_code, 0) << from_ckpt.output;
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  EXPECT_EQ(from_ckpt.output.substr(from_ckpt.output.find("loss")), from_file.output.substr(from_file.output.find("loss")));
  const testing::CommandResult imported =
      testing::run_keel("import --llama2c " + at("model.bin") + " --out " + at("imported"));
  ASSERT_EQ(imported.exit_code, 0) << imported.output;
  EXPECT_EQ(testing::checkpoint_bytes(at("imported")), testing::checkpoint_bytes(at("one") + "/ckpt"));

  const testing::CommandResult llmc =
      testing::run_keel("export --checkpoint " + ckpt + " --format llmc --out " + at("x.bin"));
  EXPECT_EQ(llmc.exit_code, 2) << llmc.output;
  EXPECT_EQ(testing::count_lines(llmc.output), 1) << llmc.output;
  EXPECT_NE(llmc.output.find("llm.c's format holds GPT-2 models"), std::string::npos) << llmc.output;
  EXPECT_FALSE(fs::exists(at("x.bin")));
}

}  // namespace
}  // namespace keel
