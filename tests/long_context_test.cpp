// Long context: with blockwise attention the activations a model keeps grow linearly in the
// sequence length (the dense kernel's grow with its square), and a llama model trains on
// sequences far longer than the dense kernel could hold here, blockwise and dense giving the
// same losses where both fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "runtime/attention_choice.h"
#include "runtime/dynamic_windows.h"
#include "test_util.h"

namespace keel {
namespace {

int64_t activation_bytes(const std::string& attention, int T) {
  Config c;
  c.model.preset = "llama-tiny";
  c.model.attention = parse_enum<Attention>(attention, "model.attention");
  c.model.max_seq_len = T;
  c.model.vocab_size = 64;
  c.train.seq_len = T;
  c.resolve(1);
  ChunkStore store(1 << 20);
  GPT model(c.model, store);
  store.finalize();
  model.allocate(1, T);
  return model.activation_bytes();
}

TEST(LongContext, BlockwiseActivationsGrowLinearlyDenseOnesQuadratically) {
  const int64_t b1 = activation_bytes("blockwise", 2048), b2 = activation_bytes("blockwise", 4096),
                b4 = activation_bytes("blockwise", 8192);
  EXPECT_NEAR(static_cast<double>(b2) / b1, 2.0, 0.01);
  EXPECT_NEAR(static_cast<double>(b4) / b2, 2.0, 0.01);
  const int64_t d1 = activation_bytes("dense", 2048), d2 = activation_bytes("dense", 4096);
  EXPECT_GT(static_cast<double>(d2) / d1, 3.0);  // the T x T probabilities dominate
  std::printf("activations of llama-tiny, batch 1: blockwise %.1f / %.1f / %.1f MB at T = 2048 / 4096 / 8192; "
              "dense %.1f / %.1f MB at 2048 / 4096\n",
              b1 / 1e6, b2 / 1e6, b4 / 1e6, d1 / 1e6, d2 / 1e6);
}

class LongContextTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 3);
  }
  std::vector<double> losses(const std::string& run) { return testing::step_losses(dir / (run + "/metrics.jsonl")); }
  testing::CommandResult train(const std::string& run, int T, const std::string& extra) {
    return testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / run +
                             " --set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=" +
                             std::to_string(T) + " --set train.seq_len=" + std::to_string(T) +
                             " --set train.batch_size=1 --set train.eval_every=0 --set train.eval_batches=1 " + extra);
  }
  testing::TempDir dir{"keel-long"};
};

// 2,048 tokens a sequence: blockwise and dense attention train the same model (within float32
// rounding of their different summation orders).
TEST_F(LongContextTraining, BlockwiseAndDenseTrainTheSameAt2048Tokens) {
  ASSERT_EQ(train("blockwise", 2048, "--set model.attention=blockwise").exit_code, 0);
  ASSERT_EQ(train("dense", 2048, "--set model.attention=dense").exit_code, 0);
  const std::vector<double> a = losses("blockwise"), b = losses("dense");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4 * b[i]) << "step " << i + 1;
}

// bf16 products through blockwise attention (kernels/cpu/attention.h), both families: GPT-2 (tiny,
// 4 heads of 16) and llama (llama-tiny: grouped keys, 4 query heads on 2 key/value heads, RoPE), at
// 512 tokens. Each trains to finite losses within bf16's precision of its float32 run and not
// equal to it (the products did run in bf16), and twice gives the same bytes.
TEST_F(LongContextTraining, BothFamiliesTrainInBf16WithBlockwiseAttention) {
  for (const std::string preset : {"tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    const std::string common = "--set model.preset=" + preset + " --set model.attention=blockwise";
    for (const std::string run : {"bf16-a", "bf16-b", "fp32"}) {
      const std::string precision = run == "fp32" ? "fp32" : "bf16";
      const testing::CommandResult r = train(preset + "-" + run, 512, common + " --set runtime.precision=" + precision);
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    const std::vector<double> a = losses(preset + "-bf16-a"), b = losses(preset + "-bf16-b"), f = losses(preset + "-fp32");
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(f.size(), 3u);
    EXPECT_EQ(a, b);
    EXPECT_EQ(testing::checkpoint_bytes(dir / (preset + "-bf16-a/ckpt")),
              testing::checkpoint_bytes(dir / (preset + "-bf16-b/ckpt")));
    EXPECT_NE(a, f);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(std::isfinite(a[i]));
      EXPECT_NEAR(a[i], f[i], 2e-2 * f[i]) << "step " << i + 1;
    }
  }
}

// model.attention = "auto" (runtime/attention_choice.h): the faster of two measurements where they
// differ by more than 10 %, else the length rule; no measurement where dense cannot fit; a decision
// measured once is cached per machine and shape and taken again from the cache (so reruns keep
// their kernel); `keel train` says which it chose, and runs with it.
TEST(AttentionChoice, AutoTakesTheMeasuredFasterKernelAndKeepsItsDecision) {
  for (const int T : {32, 255, 256, 4096}) {
    EXPECT_EQ(faster_attention(1.0, 1.2, T), Attention::dense) << T;
    EXPECT_EQ(faster_attention(1.2, 1.0, T), Attention::blockwise) << T;
    // Within 10 % either way (a tie on a busy machine): by length, whichever measured faster.
    for (const auto& [dense_ms, blockwise_ms] : {std::pair{1.0, 1.09}, {1.09, 1.0}, {1.0, 1.0}}) {
      EXPECT_EQ(faster_attention(dense_ms, blockwise_ms, T), T >= 256 ? Attention::blockwise : Attention::dense)
          << T << ": " << dense_ms << " vs " << blockwise_ms;
    }
  }

  testing::TempDir cache("keel-attention-cache");
  const char* saved = std::getenv("XDG_CACHE_HOME");
  const std::string saved_value = saved != nullptr ? saved : "";
  ::setenv("XDG_CACHE_HOME", cache.path().c_str(), 1);
  auto config_at = [](int T) {
    Config c;
    c.model.preset = "llama-tiny";
    c.model.vocab_size = 64;
    c.model.max_seq_len = T;
    c.train.seq_len = T;
    c.train.batch_size = 1;
    c.runtime.threads = 2;
    c.resolve(1);
    return c;
  };
  // The rule is the resolution's where nothing measures.
  for (const int T : {255, 256}) EXPECT_EQ(config_at(T).model.attention, attention_by_length(T)) << T;
  // 65,536 tokens: dense would keep 2 layers x 4 heads x T^2 floats = 128 GiB; not measured, not cached.
  const AttentionChoice huge = choose_attention(config_at(65536));
  EXPECT_EQ(huge.kernel, Attention::blockwise);
  EXPECT_NE(huge.reason.find("dense would keep 128.0 GiB"), std::string::npos) << huge.reason;
  EXPECT_FALSE(std::filesystem::exists(cache / "keel"));

  // Shorter than kMeasuredFromTokens: the rule, unmeasured, nothing cached.
  for (const int T : {255, 256, kMeasuredFromTokens - 1}) {
    const AttentionChoice short_job = choose_attention(config_at(T));
    EXPECT_EQ(short_job.kernel, attention_by_length(T)) << T;
    EXPECT_NE(short_job.reason.find("by length (" + std::to_string(T) + " tokens: measured only from 512)"),
              std::string::npos)
        << short_job.reason;
  }
  EXPECT_FALSE(std::filesystem::exists(cache / "keel"));

  const AttentionChoice first = choose_attention(config_at(512));
  EXPECT_NE(first.reason.find("measured at 512 tokens, 2 heads of 16, fp32, 2 threads: dense "), std::string::npos)
      << first.reason;
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(cache / "keel")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const AttentionChoice again = choose_attention(config_at(512));
  EXPECT_EQ(again.kernel, first.kernel);
  EXPECT_NE(again.reason.find("measured earlier on this machine"), std::string::npos) << again.reason;
  // The cache decides: the other kernel written there is what the next run takes.
  std::string line = read_text_file(files[0].string());
  const bool was_dense = line.rfind("dense ", 0) == 0;
  line = (was_dense ? "blockwise" : "dense") + line.substr(line.find(' '));
  testing::write_text(files[0].string(), line);
  EXPECT_EQ(choose_attention(config_at(512)).kernel, was_dense ? Attention::blockwise : Attention::dense);

  // The command: says which it chose and trains with it (its config.toml holds the kernel).
  testing::TempDir dir("keel-attention-auto");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 1);
  const testing::CommandResult r = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "run" +
      " --set model.max_seq_len=512 --set train.seq_len=512 --set train.batch_size=1 --set train.eval_every=0");
  ::setenv("XDG_CACHE_HOME", saved_value.c_str(), 1);
  if (saved == nullptr) ::unsetenv("XDG_CACHE_HOME");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("keel train: attention = auto: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string chosen = r.output.substr(at + 30, r.output.find(' ', at + 30) - at - 30);
  ASSERT_TRUE(chosen == "dense" || chosen == "blockwise") << r.output;
  EXPECT_NE(r.output.find("measured at 512 tokens", at), std::string::npos) << r.output;
  const std::string config = read_text_file(dir / "run/config.toml");
  EXPECT_NE(config.find("attention = '" + chosen + "'"), std::string::npos) << config;
}

// A resumed run keeps the kernel its checkpoint was trained with (recorded in the manifest's
// config), whatever a measurement or the length rule would pick now: from its own run directory
// (train.resume = auto) and from another (as on another machine), and says so.
TEST(AttentionChoice, AResumeKeepsTheKernelItsCheckpointRanWith) {
  testing::TempDir dir("keel-attention-resume");
  testing::write_toy_corpus(dir.path());
  testing::write_toy_config(dir.path(), 2);
  const char* saved = std::getenv("XDG_CACHE_HOME");
  const std::string saved_value = saved != nullptr ? saved : "";
  ::setenv("XDG_CACHE_HOME", (dir / "cache").c_str(), 1);
  // 32 tokens: the length rule says dense; the run trains with blockwise.
  const testing::CommandResult first =
      testing::run_keel(testing::toy_train_args(dir, 0, 4, "run", "--set model.attention=blockwise --set train.eval_every=0"));
  auto resumed = [&](const std::string& run, const std::string& extra) {
    return testing::run_keel(testing::toy_train_args(
        dir, 0, 4, run, "--set model.attention=auto --set train.steps=3 --set train.eval_every=0 " + extra));
  };
  const testing::CommandResult other = resumed("other", "--set train.resume=" + dir / "run/ckpt");
  const testing::CommandResult own = resumed("run", "--set train.resume=auto");
  const testing::CommandResult fresh = resumed("fresh", "");
  ::setenv("XDG_CACHE_HOME", saved_value.c_str(), 1);
  if (saved == nullptr) ::unsetenv("XDG_CACHE_HOME");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (const auto& [r, run] : {std::pair{&own, "run"}, {&other, "other"}}) {
    ASSERT_EQ(r->exit_code, 0) << r->output;
    EXPECT_NE(r->output.find("keel train: attention = auto: blockwise (as recorded in checkpoint " +
                             dir / "run/ckpt/step-00000002" + ", which this run resumes)"),
              std::string::npos)
        << r->output;
    EXPECT_NE(r->output.find("resumed from"), std::string::npos) << r->output;
    const std::string config = read_text_file(dir / (std::string(run) + "/config.toml"));
    EXPECT_NE(config.find("attention = 'blockwise'"), std::string::npos) << config;
  }
  // Nothing to resume: the length rule at 32 tokens (dense; the recorded blockwise was not the rule's).
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_NE(fresh.output.find("keel train: attention = auto: dense (by length (32 tokens"), std::string::npos)
      << fresh.output;
}

// A sliding window of 128 keys at 4,096 tokens: trains, and differs from full attention.
TEST_F(LongContextTraining, ASlidingWindowTrainsAt4096Tokens) {
  const testing::CommandResult r = train("window", 4096, "--set model.attention_window=128");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(train("full", 4096, "").exit_code, 0);
  const std::vector<double> w = losses("window"), f = losses("full");
  ASSERT_EQ(w.size(), 3u);
  for (double l : w) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(w.back(), f.back());
  const std::string config = read_text_file(dir / "window/config.toml");
  EXPECT_NE(config.find("attention = 'blockwise'"), std::string::npos) << config;
  // Bad input: refused before training (exit 2), in one line naming the key.
  auto refused = [&](const std::string& settings, const std::string& says) {
    const testing::CommandResult r = train("bad", 256, settings);
    EXPECT_EQ(r.exit_code, 2) << settings << ": " << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << settings << ": " << r.output;
  };
  refused("--set model.attention=dense --set model.attention_window=64", "model.attention_window");
  refused("--set model.attention_window=0-5:64", "outside 0..1");
  refused("--set model.attention_window=512", "windows of at most train.seq_len = 256");
  refused("--set model.attention_window=dynamic --set parallel.pipeline=2", "model.attention_window");
  refused("--set model.attention_window=dynamic --set model.dynamic_windows_state=64", "model.dynamic_windows_state");
}

// 32,768 tokens a sequence (batch 1) with a sliding window of 256 keys: trains, its activations
// those of the linear kernel (about 16 x those at 2,048 tokens).
TEST_F(LongContextTraining, TrainsAt32768Tokens) {
  const testing::CommandResult r = train("32k", 32768, "--set model.attention_window=256 --set train.steps=2 --set data.val=" + dir / "train.bin");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<double> l = losses("32k");
  ASSERT_EQ(l.size(), 2u);
  for (double x : l) EXPECT_TRUE(std::isfinite(x));
  EXPECT_NEAR(static_cast<double>(activation_bytes("blockwise", 32768)) / activation_bytes("blockwise", 2048), 16.0, 0.1);
}

// Past the trained length: a model trained on 64-token sequences evaluated on 256 with RoPE as
// trained, linearly interpolated positions and an NTK-scaled base; each a finite loss, and
// scaling by a factor of 1 is no scaling at all (the same bytes of output).
TEST_F(LongContextTraining, RopeScalingExtendsPastTheTrainedLength) {
  ASSERT_EQ(train("short", 64, "--set train.steps=30 --set train.batch_size=4").exit_code, 0);
  const std::string ckpt = testing::newest_checkpoint(dir / "short/ckpt");
  auto eval = [&](const std::string& extra) {
    const testing::CommandResult r = testing::run_keel("eval --checkpoint " + ckpt + " --data " + dir / "val.bin" +
                                                       " --batch 1 --batches 4 " + extra);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    const size_t at = r.output.find('{');
    return at == std::string::npos ? nlohmann::json() : nlohmann::json::parse(r.output.substr(at));
  };
  const double trained = eval("--seq 64").at("loss").get<double>();
  const double as_is = eval("--seq 256 --set model.max_seq_len=256").at("loss").get<double>();
  const double linear = eval("--seq 256 --set model.max_seq_len=256 --set model.rope_scaling=linear --set model.rope_factor=4").at("loss").get<double>();
  const double ntk = eval("--seq 256 --set model.max_seq_len=256 --set model.rope_scaling=ntk --set model.rope_factor=4").at("loss").get<double>();
  for (double x : {trained, as_is, linear, ntk}) EXPECT_TRUE(std::isfinite(x));
  std::printf("loss at the trained 64 tokens %.4f; at 256: RoPE as trained %.4f, linear x4 %.4f, ntk x4 %.4f\n", trained,
              as_is, linear, ntk);
  EXPECT_EQ(eval("--seq 64 --set model.rope_scaling=linear --set model.rope_factor=1").dump(), eval("--seq 64").dump());
  // Bad input: GPT-2 has no RoPE; a factor below 1.
  const testing::CommandResult bad = testing::run_keel("eval --checkpoint " + ckpt + " --set model.rope_factor=0.5");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("model.rope_factor"), std::string::npos) << bad.output;
}

// The rule: the smallest power of two >= the minimum that leaves at most eps of the worst head's
// mass outside; none when no window below the sequence length does.
TEST(DynamicWindows, ChooseTheSmallestWindowThatKeepsTheMass) {
  const int K = AttentionProbe::kBuckets, heads = 2;
  std::vector<double> mass(heads * K, 0.0);
  // 10 rows; head 0 puts 0.9 at distance 0 and 0.1 at 16..31 (bucket 5); head 1 all within 2..3.
  mass[0 * K + 0] = 9, mass[0 * K + 5] = 1, mass[1 * K + 2] = 10;
  double outside = -1;
  EXPECT_EQ(DynamicWindows::choose(mass, 10, heads, 0.2, 1, 1024, &outside), 4);  // head 0's 0.1 outside 4
  EXPECT_DOUBLE_EQ(outside, 0.1);
  EXPECT_EQ(DynamicWindows::choose(mass, 10, heads, 0.05, 1, 1024, &outside), 32);  // distances up to 31 inside
  EXPECT_DOUBLE_EQ(outside, 0.0);
  EXPECT_EQ(DynamicWindows::choose(mass, 10, heads, 0.05, 64, 1024, &outside), 64);  // the minimum
  EXPECT_EQ(DynamicWindows::choose(mass, 10, heads, 0.05, 1, 32, &outside), 0);  // 32 is the whole sequence
}

// "dynamic" on a corpus where each token is the one three back plus one (three interleaved
// counters, 2 % noise): the model learns to look back a short way, the windows shrink from full
// attention, the validation loss stays within a few per cent of full attention's, and a run
// resumed from a checkpoint goes on with its windows to the same bytes as an uninterrupted one.
TEST_F(LongContextTraining, DynamicWindowsShrinkWhereAttentionIsLocalAndResumeExactly) {
  Rng rng(5);
  std::vector<uint16_t> tokens = {1, 20, 40};
  while (tokens.size() < 40000) {
    tokens.push_back(static_cast<uint16_t>(rng.uniform() < 0.02 ? rng.below(64) : (tokens[tokens.size() - 3] + 1) % 64));
  }
  write_token_shard(dir / "counters.bin", tokens);
  auto run = [&](const std::string& name, const std::string& extra) {
    return testing::run_keel("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / name +
                             " --set model.preset=llama-tiny --set model.vocab_size=64 --set model.max_seq_len=256"
                             " --set train.seq_len=256 --set train.batch_size=4 --set train.steps=200 --set optim.lr=1e-2"
                             " --set train.eval_every=0 --set train.eval_batches=2 --set data.train=" + dir / "counters.bin" +
                             " --set data.val=" + dir / "counters.bin " + extra);
  };
  const std::string dyn = "--set model.attention_window=dynamic --set model.dynamic_window_every=40 "
                          "--set model.dynamic_window_min=8 --set model.dynamic_window_loss=0.02 ";
  const testing::CommandResult d = run("dyn", dyn + "--set train.checkpoint_every=100");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  ASSERT_EQ(run("full", "").exit_code, 0);
  std::vector<int> windows;
  const std::string text = read_text_file(dir / "dyn/metrics.jsonl");
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
    if (j.value("event", "") == "attention_windows") {
      windows = j.at("windows").get<std::vector<int>>();
      EXPECT_LE(j.at("probe_loss").get<double>(), j.at("probe_loss_full").get<double>() * 1.02 + 1e-12);
    }
    at = end + 1;
  }
  ASSERT_EQ(windows.size(), 2u) << d.output;
  EXPECT_TRUE(std::any_of(windows.begin(), windows.end(), [](int w) { return w >= 8 && w < 256; })) << d.output;
  const std::vector<double> a = losses("dyn"), f = losses("full");
  EXPECT_NEAR(a.back(), f.back(), 0.05 * f.back() + 0.02);
  std::printf("windows %d, %d; final loss %.4f with dynamic windows, %.4f with full attention\n", windows[0], windows[1],
              a.back(), f.back());
  // Resumed at step 100 (its windows from the checkpoint): the same final bytes.
  const testing::CommandResult r = run("resumed", dyn + "--set train.resume=" + dir / "dyn/ckpt/step-00000100");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::checkpoint_bytes(dir / "resumed/ckpt"), testing::checkpoint_bytes(dir / "dyn/ckpt"));
}

}  // namespace
}  // namespace keel
