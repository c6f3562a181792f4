// The keel command as a user meets it: llm.c interoperability and every kind of bad input
// answered by one line naming the thing, with a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "runtime/job_config.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::run_command;
using testing::run_keel;

// Expects a failed command whose output is exactly one "keel: ..." line containing each needle.
void expect_one_line_error(const testing::CommandResult& r, std::initializer_list<std::string> needles) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  EXPECT_EQ(r.output.rfind("keel: ", 0), 0u) << r.output;
  for (const std::string& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in: " << r.output;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    Rng rng(3);
    std::vector<uint16_t> t(6000);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>((i * 5 + rng.below(3)) % 60);
    write_token_shard(dir / "train.bin", t);
    write_token_shard(dir / "val.bin", std::vector<uint16_t>(t.begin(), t.begin() + 1500));
    testing::write_text(dir / "toy.toml",
                        "[model]\npreset = \"tiny\"\nvocab_size = 64\nn_embd = 32\nn_head = 2\nmax_seq_len = 32\n"
                        "[train]\nbatch_size = 2\nseq_len = 16\nsteps = 6\neval_batches = 2\nsample_tokens = 0\n"
                        "run_dir = \"" + dir / "run" + "\"\n"
                        "[data]\ntrain = \"" + dir / "train.bin" + "\"\nval = \"" + dir / "val.bin" +
                        "\"\ntokenizer = \"\"\n[runtime]\npeak_gflops = 100\n");
  }
  std::string train_args() const { return "train --config " + dir / "toy.toml"; }
  testing::TempDir dir;
};

TEST_F(Cli, TrainsAndWritesMetricsConfigAndCheckpoint) {
  auto r = run_keel(train_args());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("val loss"), std::string::npos);
  EXPECT_NE(r.output.find("tok/s"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(dir / "run/config.toml"));
  EXPECT_TRUE(std::filesystem::exists(testing::newest_checkpoint(dir / "run/ckpt") + "/manifest.json"));
  int step_lines = 0;
  std::string text = read_text_file(dir / "run/metrics.jsonl");
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    auto j = nlohmann::json::parse(text.substr(start, end - start));
    if (j.contains("loss")) {
      step_lines++;
      for (const char* key : {"step", "lr", "grad_norm", "ms", "tokens_per_s", "mfu", "matmul_efficiency"}) {
        EXPECT_TRUE(j.contains(key)) << key;
      }
    }
    start = end + 1;
  }
  EXPECT_EQ(step_lines, 6);
}

// MFU against the CPU's peak (no runtime.peak_gflops): a fraction of it, whatever else the
// machine runs; the start-up line says how the peak was found.
TEST_F(Cli, MfuIsAgainstTheHardwarePeak) {
  auto r = run_keel(train_args() + " --set runtime.peak_gflops=0 --set runtime.threads=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("keel: MFU against a peak of "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("FLOP/cycle"), std::string::npos) << r.output;
  std::istringstream lines(read_text_file(dir / "run/metrics.jsonl"));
  std::string line;
  int steps = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("mfu")) continue;
    steps++;
    EXPECT_GT(j["mfu"].get<double>(), 0.0) << line;
    EXPECT_LT(j["mfu"].get<double>(), 1.0) << line;
  }
  EXPECT_EQ(steps, 6);
}

// Every command prints its own usage for --help and exits 0 (launch's own, not its subcommand's).
TEST(CliHelp, EveryCommandHasHelp) {
  for (const std::string cmd : {"train", "launch", "tokenize", "eval", "generate", "export", "import", "schedule",
                                "checkpoints"}) {
    auto r = run_keel(cmd + " --help");
    EXPECT_EQ(r.exit_code, 0) << cmd << ": " << r.output;
    EXPECT_EQ(r.output.rfind("usage: keel " + cmd + " ", 0), 0u) << r.output;
  }
  auto r = run_keel("launch -n 2 --help -- train");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("usage: keel launch ", 0), 0u) << r.output;
}

TEST_F(Cli, CheckpointsListsAndVerifies) {
  ASSERT_EQ(run_keel(train_args() + " --set train.checkpoint_every=2").exit_code, 0);
  auto r = run_keel("checkpoints --dir " + dir / "run/ckpt" + " --verify yes");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step-00000006"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" diff "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("FAILED"), std::string::npos) << r.output;
  // A flipped byte in the newest checkpoint's data fails verification, naming the file.
  const std::string data = testing::newest_checkpoint(dir / "run/ckpt") + "/r0.bin";
  std::vector<char> bytes = read_file(data);
  bytes[bytes.size() / 3] ^= 0x04;
  write_file(data, bytes.data(), bytes.size());
  r = run_keel("checkpoints --dir " + dir / "run/ckpt" + " --verify yes");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("FAILED: checkpoint file " + data), std::string::npos) << r.output;
  r = run_keel("checkpoints --dir " + dir / "nothing");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("not found"), std::string::npos) << r.output;
}

TEST_F(Cli, LlmcImportThenExportGivesIdenticalBytes) {
  const std::string src = testing::source_path("tests/fixtures/tiny_gpt2.bin");
  ASSERT_EQ(run_keel("import --llmc " + src + " --out " + dir / "imported").exit_code, 0);
  auto r = run_keel("export --checkpoint " + dir / "imported" + " --out " + dir / "again.bin");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_file(src), read_file(dir / "again.bin"));
}

// A Keel-trained model exported to llm.c format and evaluated by the independent PyTorch
// reference gives Keel's own loss.
TEST_F(Cli, ExportedModelEvaluatesTheSameInPyTorch) {
  ASSERT_EQ(run_keel(train_args()).exit_code, 0);
  ASSERT_EQ(run_keel("export --checkpoint " + dir / "run/ckpt" + " --out " + dir / "m.bin").exit_code, 0);
  auto ours = run_keel("eval --checkpoint " + dir / "run/ckpt" + " --data " + dir / "val.bin" +
                       " --batch 2 --seq 16 --batches 5");
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  auto exported = run_keel("eval --llmc " + dir / "m.bin" + " --data " + dir / "val.bin" + " --batch 2 --seq 16 --batches 5");
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  auto theirs = run_command("/usr/bin/python3 " + testing::source_path("tests/reference/gpt2_reference.py") +
                            " eval --model " + dir / "m.bin" + " --tokens " + dir / "val.bin" +
                            " --batch 2 --seq 16 --batches 5");
  ASSERT_EQ(theirs.exit_code, 0) << theirs.output;
  const double a = nlohmann::json::parse(ours.output)["loss"];
  const double b = nlohmann::json::parse(exported.output)["loss"];
  const double c = nlohmann::json::parse(theirs.output.substr(theirs.output.rfind('{')))["loss"];
  EXPECT_EQ(a, b);
  EXPECT_NEAR(a, c, 1e-5 * c);
}

TEST_F(Cli, BadCommandLine) {
  expect_one_line_error(run_keel("frobnicate"), {"unknown command 'frobnicate'"});
  expect_one_line_error(run_keel("train --nope 1"), {"unknown option --nope"});
  expect_one_line_error(run_keel("train --config"), {"--config needs a value"});
  expect_one_line_error(run_keel("generate --checkpoint " + dir / "run/ckpt" + " --tokens many"), {"--tokens", "integer"});
}

TEST_F(Cli, BadConfig) {
  expect_one_line_error(run_keel("train --config " + dir / "missing.toml"), {"missing.toml", "not found"});
  expect_one_line_error(run_keel(train_args() + " --set train.lernin_rate=1"), {"train.lernin_rate", "unknown"});
  expect_one_line_error(run_keel(train_args() + " --set train.batch_size=two"), {"train.batch_size", "integer", "two"});
  expect_one_line_error(run_keel(train_args() + " --set model.n_head=3"), {"model.n_head", "divisor", "32"});
  testing::write_text(dir / "typo.toml", "[trian]\nsteps = 3\n");
  expect_one_line_error(run_keel("train --config " + dir / "typo.toml"), {"[trian]", "typo.toml"});
}

TEST_F(Cli, BadShards) {
  const std::string set = train_args() + " --set data.train=" + dir / "x.bin";
  expect_one_line_error(run_keel(set), {"x.bin"});  // missing
  write_file(dir / "x.bin", std::string(100, 'g'));  // garbage
  expect_one_line_error(run_keel(set), {"x.bin"});
  std::vector<char> good = read_file(dir / "train.bin");
  write_file(dir / "x.bin", good.data(), good.size() - 7);  // truncated
  expect_one_line_error(run_keel(set), {"x.bin"});
  write_token_shard(dir / "x.bin", std::vector<uint16_t>(10, 1));  // too short for one batch
  expect_one_line_error(run_keel(set), {"x.bin", "at least 33"});
  write_token_shard(dir / "x.bin", std::vector<uint16_t>(100, 64));  // token beyond the vocabulary
  expect_one_line_error(run_keel(set), {"x.bin", "64"});
}

TEST_F(Cli, VocabularySmallerThanTokenizer) {
  testing::write_text(dir / "text.txt", std::string(2000, 'a') + "\n%\nthe quick brown fox jumps over the lazy dog\n%\nand again\n");
  ASSERT_EQ(run_keel("tokenize --input " + dir / "text.txt" + " --out " + dir / "tok --vocab-size 300").exit_code, 0);
  expect_one_line_error(run_keel(train_args() + " --set data.tokenizer=" + dir / "tok/tokenizer.json"),
                        {"model.vocab_size", "300", "64"});
}

TEST_F(Cli, BadLlmcCheckpoints) {
  std::vector<char> good = read_file(testing::source_path("tests/fixtures/tiny_gpt2.bin"));
  auto eval = [&] { return run_keel("eval --llmc " + dir / "m.bin" + " --data " + dir / "val.bin"); };
  std::vector<char> bad = good;
  bad[0] = 1;  // magic
  write_file(dir / "m.bin", bad.data(), bad.size());
  expect_one_line_error(eval(), {"m.bin", "expected magic 20240326"});
  bad = good;
  bad[4] = 5;  // version 5 = bf16
  write_file(dir / "m.bin", bad.data(), bad.size());
  expect_one_line_error(eval(), {"m.bin", "expected version 3", "found 5"});
  write_file(dir / "m.bin", good.data(), good.size() - 4);  // sizes
  expect_one_line_error(eval(), {"m.bin", "bytes"});
  bad = good;
  bad[5 * 4] = 3;  // n_head = 3 does not divide C = 16
  write_file(dir / "m.bin", bad.data(), bad.size());
  expect_one_line_error(eval(), {"m.bin", "n_head"});
  expect_one_line_error(run_keel("eval --checkpoint " + dir / "nothing"), {"nothing", "not found"});
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// Every shipped config parses and resolves (data files need not exist to check the config).
// (configs/prometheus/ holds a Prometheus server's rules, checked by promtool in monitor_test.)
TEST(ShippedConfigs, AllResolve) {
  int configs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(testing::source_path("configs"))) {
    if (entry.path().extension() != ".toml") continue;
    configs++;
    Config c = Config::load(entry.path().string(), {});
    EXPECT_NO_THROW(resolve_job_config(c)) << entry.path();
  }
  EXPECT_GE(configs, 2);
  Config d = Config::load(testing::source_path("configs/default.toml"), {});
  resolve_job_config(d);
  Config builtin = Config::load("", {});
  resolve_job_config(builtin);
  EXPECT_EQ(d.to_toml(), builtin.to_toml()) << "configs/default.toml must spell out the built-in default";
  // And spell out every key of every section, not only leave them to their defaults.
  const std::string shipped = read_text_file(testing::source_path("configs/default.toml"));
  std::istringstream keys(Config::load("", {}).to_toml());
  std::string line, section;
  while (std::getline(keys, line)) {
    if (line.empty()) continue;
    if (line[0] == '[') {
      section = line;
      EXPECT_NE(shipped.find("\n" + section + "\n"), std::string::npos) << "configs/default.toml lacks " << section;
      continue;
    }
    const std::string key = line.substr(0, line.find(" = "));
    const size_t at = shipped.find("\n" + section + "\n");
    const size_t end = shipped.find("\n[", at + 1);
    const std::string body = shipped.substr(at, end == std::string::npos ? std::string::npos : end - at);
    EXPECT_NE(body.find("\n" + key + " = "), std::string::npos) << "configs/default.toml lacks " << section << " " << key;
  }
}

}  // namespace
}  // namespace keel
