// Activation recomputation (train.recompute, model/gpt.h): every setting trains the same bytes as
// none. In process: both families, float32 and bf16 activations, dense and blockwise attention,
// every mode and a block range, B then W per layer, every B before every W (a zero-bubble
// pipeline's order: W re-runs its layer's recomputation and B), and a pipeline stage with several
// micro-batches in flight (their F's, B's and W's interleaved). Through the keel binary: one rank
// and a 2-stage pipeline (1F1B and ZB-H1) with gradient accumulation, every step's loss and the
// final weights equal to none's; what each setting keeps (the start-up line, and the peak
// resident set of real runs against it); bad input refused in one line.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

constexpr int kLayers = 4;

ModelConfig small_model(Family family, Attention attention) {
  Config c;
  c.model.preset = family == Family::llama ? "llama-tiny" : "tiny";
  c.model.family = family;
  c.model.n_layer = kLayers;
  c.model.n_head = 4;
  c.model.n_embd = 32;
  c.model.vocab_size = 61;
  c.model.max_seq_len = 16;
  if (family == Family::llama) {
    c.model.n_kv_head = 2;
    c.model.ffn_multiple_of = 8;
  }
  c.model.attention = attention;
  c.train.seq_len = 16;
  c.resolve(1);
  return c.model;
}

struct Case {
  Family family;
  Attention attention;
  bool bf16;
};

std::string name_of(const Case& c) {
  return std::string(c.family == Family::llama ? "llama" : "gpt2") + "_" +
         (c.attention == Attention::dense ? "dense" : "blockwise") + (c.bf16 ? "_bf16" : "_fp32");
}

// A model of `c`, its weights drawn from one seed, with `plan`; a pipeline stage of `ranges` when
// given, with `slots` micro-batches in flight.
struct Built {
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<GPT> model;
};
Built build(const Case& c, RecomputePlan plan, std::vector<LayerRange> ranges = {}, int slots = 1) {
  Built b;
  const ModelConfig m = small_model(c.family, c.attention);
  b.store = std::make_unique<ChunkStore>(4096);
  b.model = std::make_unique<GPT>(m, *b.store, ranges, c.bf16,
                                  MathMode::uniform(c.bf16 ? MatmulPrecision::bf16 : MatmulPrecision::fp32), plan);
  b.store->finalize();
  b.model->init_weights(1234);
  b.model->allocate(2, 16, slots);
  return b;
}

std::vector<int> tokens(int n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> t(static_cast<size_t>(n));
  for (int& x : t) x = static_cast<int>(rng.below(61));
  return t;
}

std::vector<char> grad_bytes(ChunkStore& store) {
  const char* p = reinterpret_cast<const char*>(store.chunk_view(0, Plane::grad).data());
  return std::vector<char>(p, p + store.numel() * sizeof(float));
}

// Three micro-batches of gradient accumulation through the whole model: the losses' bytes and the
// gradient plane's. defer: every B before every W.
std::pair<std::vector<float>, std::vector<char>> whole_model(const Case& c, RecomputePlan plan, bool defer) {
  Built b = build(c, plan);
  std::vector<float> losses;
  for (int micro = 0; micro < 3; ++micro) {
    const std::vector<int> in = tokens(32, 10 + micro), out = tokens(32, 20 + micro);
    const Batch batch{in.data(), out.data(), 2, 16, 1.0f / 96};
    losses.push_back(b.model->forward(batch));
    b.model->backward(batch, defer);
  }
  return {losses, grad_bytes(*b.store)};
}

RecomputePlan plan_of(Recompute mode, int first = 0, int last = kLayers - 1) { return RecomputePlan{mode, first, last}; }

class RecomputeModel : public ::testing::TestWithParam<Case> {};

TEST_P(RecomputeModel, EverySettingGivesTheSameBytesAsNone) {
  const Case c = GetParam();
  for (bool defer : {false, true}) {
    const auto [losses, grads] = whole_model(c, plan_of(Recompute::none), defer);
    for (const RecomputePlan& plan : {plan_of(Recompute::selective), plan_of(Recompute::full),
                                      plan_of(Recompute::full, 1, 2), plan_of(Recompute::selective, 3, 3)}) {
      const std::string what = std::string(to_string(plan.mode)) + " blocks " + std::to_string(plan.first_block) +
                               "-" + std::to_string(plan.last_block) + (defer ? ", W deferred" : "");
      const auto [l, g] = whole_model(c, plan, defer);
      ASSERT_EQ(l.size(), losses.size());
      for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(std::memcmp(&l[i], &losses[i], sizeof(float)), 0) << what;
      ASSERT_EQ(g.size(), grads.size());
      EXPECT_TRUE(g == grads) << what << ": gradient bytes differ";
    }
  }
}

// A pipeline stage (blocks 1..3 and the head) with three micro-batches in flight, run as 1F1B's
// warm-up would and then with the W's deferred: F F F, B(0) W(0), B(1), B(2), W(2), W(1).
TEST_P(RecomputeModel, AStageWithMicroBatchesInFlightGivesTheSameBytes) {
  const Case c = GetParam();
  const LayerRange stage{2, kLayers + 1};
  auto run = [&](RecomputePlan plan) {
    Built b = build(c, plan, {stage}, 3);
    std::vector<std::vector<int>> in, out;
    std::vector<Batch> batches;
    for (int k = 0; k < 3; ++k) {
      in.push_back(tokens(32, 30 + k));
      out.push_back(tokens(32, 40 + k));
    }
    for (int k = 0; k < 3; ++k) batches.push_back(Batch{in[k].data(), out[k].data(), 2, 16, 1.0f / 96});
    std::vector<float> losses;
    for (int k = 0; k < 3; ++k) {
      // The stage's input: a fixed activation per micro-batch (what the previous stage would send).
      Rng rng(50 + k);
      float* x = b.model->input(k, stage.first);
      for (int i = 0; i < 2 * 16 * 32; ++i) x[i] = static_cast<float>(rng.normal());
      losses.push_back(b.model->forward(stage, k, batches[k]));
    }
    std::vector<char> input_grads;
    auto keep_input_grad = [&](int k) {
      const char* g = reinterpret_cast<const char*>(b.model->input_grad(k, stage.first));
      input_grads.insert(input_grads.end(), g, g + 2 * 16 * 32 * sizeof(float));
    };
    b.model->backward_input(stage, 0, batches[0]);
    keep_input_grad(0);
    b.model->backward_weight(stage, 0, batches[0]);
    b.model->backward_input(stage, 1, batches[1]);
    keep_input_grad(1);
    b.model->backward_input(stage, 2, batches[2]);
    keep_input_grad(2);
    b.model->backward_weight(stage, 2, batches[2]);
    b.model->backward_weight(stage, 1, batches[1]);
    std::vector<char> bytes = grad_bytes(*b.store);
    bytes.insert(bytes.end(), input_grads.begin(), input_grads.end());
    for (float l : losses) bytes.insert(bytes.end(), reinterpret_cast<char*>(&l), reinterpret_cast<char*>(&l) + 4);
    return bytes;
  };
  const std::vector<char> none = run(plan_of(Recompute::none));
  EXPECT_TRUE(run(plan_of(Recompute::selective)) == none) << "selective";
  EXPECT_TRUE(run(plan_of(Recompute::full)) == none) << "full";
  EXPECT_TRUE(run(plan_of(Recompute::full, 2, 2)) == none) << "full, block 2";
}

// What each setting keeps: selective less than none, full less than selective, and a range
// between; the shared set is one block's.
TEST_P(RecomputeModel, EachSettingKeepsLess) {
  const Case c = GetParam();
  const Built none = build(c, plan_of(Recompute::none), {}, 2);
  const Built selective = build(c, plan_of(Recompute::selective), {}, 2);
  const Built full = build(c, plan_of(Recompute::full), {}, 2);
  const Built some = build(c, plan_of(Recompute::full, 1, 2), {}, 2);
  EXPECT_EQ(none.model->recomputed_bytes(), 0);
  EXPECT_LT(selective.model->slot_bytes(), none.model->slot_bytes());
  EXPECT_LT(full.model->slot_bytes(), selective.model->slot_bytes());
  EXPECT_LT(full.model->slot_bytes(), some.model->slot_bytes());
  EXPECT_LT(some.model->slot_bytes(), none.model->slot_bytes());
  // Full keeps per micro-batch only the layers' inputs and outputs (and the embedding's and
  // head's own): a block costs two [B, T, C] and nothing more.
  const int64_t io = 2 * 2 * 16 * 32 * static_cast<int64_t>(sizeof(float));
  EXPECT_EQ(full.model->layer_activation_bytes(2, 2, 16), io);
  EXPECT_EQ(GPT::slot_bytes_for(full.model->config(), {1, kLayers}, 2, 16, c.bf16, plan_of(Recompute::full)),
            2 * io / 2 + kLayers * io);
  // The shared set is at most a block's whole activations (and a gradient of [B, T, C]).
  EXPECT_LE(full.model->recomputed_bytes(), none.model->layer_activation_bytes(2, 2, 16));
  EXPECT_EQ(full.model->activation_bytes() - none.model->activation_bytes(),
            2 * (full.model->slot_bytes() - none.model->slot_bytes()) + full.model->recomputed_bytes());
}

INSTANTIATE_TEST_SUITE_P(Recompute, RecomputeModel,
                         ::testing::Values(Case{Family::gpt2, Attention::dense, false},
                                           Case{Family::gpt2, Attention::blockwise, false},
                                           Case{Family::gpt2, Attention::dense, true},
                                           Case{Family::llama, Attention::dense, false},
                                           Case{Family::llama, Attention::blockwise, false},
                                           Case{Family::llama, Attention::blockwise, true}),
                         [](const auto& info) { return name_of(info.param); });

// ---- the keel binary ---------------------------------------------------------------------------

class RecomputeTraining : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("keel-recompute");
    testing::write_toy_corpus(dir_->path());
    testing::write_toy_config(dir_->path(), kSteps);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static constexpr int kSteps = 5;
  // Four blocks, 2 sequences a micro-batch, 4 micro-batches a step.
  static std::string common() {
    return " --set model.n_layer=4 --set train.batch_size=2 --set train.grad_accum=4 --set train.eval_every=0";
  }
  static testing::CommandResult train(int ranks, const std::string& run, const std::string& extra) {
    const std::string args = "train --config " + dir_->path() + "/toy.toml" + common() + " --set train.run_dir=" +
                             dir_->path() + "/" + run + " " + extra;
    return testing::run_keel(ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " -- " + args);
  }
  // Each step's loss as metrics.jsonl wrote it (its text: the same bytes print the same).
  static std::vector<std::string> losses(const std::string& run) {
    std::vector<std::string> out;
    const std::string text = read_text_file(dir_->path() + "/" + run + "/metrics.jsonl");
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      const auto j = nlohmann::json::parse(text.substr(start, end - start));
      if (j.contains("loss") && j.contains("step")) out.push_back(j["loss"].dump());
      start = end + 1;
    }
    return out;
  }
  // Trains `run` with `extra` and `reference` with the same and train.recompute = "none": every
  // step's loss and the final parameters are the same bytes.
  static void expect_same_bytes(int ranks, const std::string& run, const std::string& reference,
                                const std::string& extra, const std::string& recompute) {
    if (!std::filesystem::exists(dir_->path() + "/" + reference)) {
      const testing::CommandResult r = train(ranks, reference, extra);
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    const testing::CommandResult r = train(ranks, run, extra + " " + recompute);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<std::string> a = losses(reference), b = losses(run);
    ASSERT_EQ(a.size(), static_cast<size_t>(kSteps)) << reference;
    EXPECT_EQ(a, b) << run;
    EXPECT_TRUE(testing::checkpoint_bytes(dir_->path() + "/" + reference + "/ckpt") ==
                testing::checkpoint_bytes(dir_->path() + "/" + run + "/ckpt"))
        << run << ": final weights differ";
  }
  static testing::TempDir* dir_;
};

testing::TempDir* RecomputeTraining::dir_ = nullptr;

TEST_F(RecomputeTraining, OneRankGpt2AndLlamaFloat32AndBf16) {
  expect_same_bytes(0, "gpt2-full", "gpt2-none", "", "--set train.recompute=full");
  expect_same_bytes(0, "gpt2-selective", "gpt2-none", "", "--set train.recompute=selective");
  const std::string llama = "--set model.preset=llama-tiny --set model.n_kv_head=2 --set model.ffn_multiple_of=8";
  expect_same_bytes(0, "llama-full-1-2", "llama-none", llama,
                    "--set train.recompute=full --set train.recompute_layers=1-2");
  const std::string bf16 = llama + " --set runtime.precision=bf16";
  expect_same_bytes(0, "llama-bf16-selective", "llama-bf16-none", bf16, "--set train.recompute=selective");
  expect_same_bytes(0, "llama-bf16-full", "llama-bf16-none", bf16, "--set train.recompute=full");
}

TEST_F(RecomputeTraining, TwoStagePipelineOneFOneBAndZeroBubble) {
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    const std::string pp = "--set parallel.pipeline=2 --set parallel.schedule=" + schedule;
    expect_same_bytes(2, "pp-" + schedule + "-full", "pp-" + schedule + "-none", pp, "--set train.recompute=full");
    expect_same_bytes(2, "pp-" + schedule + "-selective", "pp-" + schedule + "-none", pp,
                      "--set train.recompute=selective --set train.recompute_layers=0-2");
  }
}

// Parameters paged through memory tiers: a recomputed forward leases its layer's parameters as a
// forward does (tier.verify checks every page the tiers move).
TEST_F(RecomputeTraining, OverMemoryTiers) {
  std::filesystem::create_directories(dir_->path() + "/nvme");
  const std::string tiers = "--set tier.device_mib=2 --set tier.host_mib=1 --set tier.verify=true --set tier.nvme_dir=" +
                            dir_->path() + "/nvme";
  expect_same_bytes(0, "tiers-full", "tiers-none", tiers, "--set train.recompute=full");
}

TEST_F(RecomputeTraining, BadInputIsOneLine) {
  struct Bad {
    std::string set, expect;
  };
  for (const Bad& b : {Bad{"train.recompute=partial", "config key 'train.recompute': expected \"none\", \"selective\" or "
                                                      "\"full\", found \"partial\""},
                       Bad{"train.recompute_layers=2-4", "config key 'train.recompute_layers': expected \"all\" or "
                                                         "\"LO-HI\" (blocks 0..3), found \"2-4\": blocks 2-4 outside 0..3"},
                       Bad{"train.recompute_layers=3-1", "found \"3-1\": the range 3-1 is empty"},
                       Bad{"train.recompute_layers=some", "found \"some\": 'some' is not LO-HI"}}) {
    const testing::CommandResult r = train(0, "bad", "--set train.recompute=full --set " + b.set);
    EXPECT_NE(r.exit_code, 0) << b.set;
    EXPECT_NE(r.output.find(b.expect), std::string::npos) << b.set << ": " << r.output;
    EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  }
}

// The start-up line's figures are what the run allocates: the difference between two settings'
// printed totals is the difference between their peak resident sets (every activation page is
// written at allocation), within 10 % (and 4 MB of the allocator's own).
TEST_F(RecomputeTraining, PrintedActivationMemoryIsWhatTheRunHolds) {
  const std::string big = "--set model.n_embd=128 --set model.max_seq_len=256 --set train.seq_len=256 "
                          "--set train.batch_size=16 --set train.grad_accum=1 --set model.attention=dense "
                          "--set train.steps=2";
  struct Seen {
    double printed_mb = 0, rss_mb = 0;
  };
  auto run = [&](const std::string& mode) {
    const testing::CommandResult r = train(0, "memory-" + mode, big + " --set train.recompute=" + mode);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    Seen s;
    const size_t at = r.output.find("MB recomputed set, ");
    EXPECT_NE(at, std::string::npos) << r.output;
    if (at != std::string::npos) s.printed_mb = std::atof(r.output.c_str() + at + std::strlen("MB recomputed set, "));
    const std::string text = read_text_file(dir_->path() + "/memory-" + mode + "/metrics.jsonl");
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      const auto j = nlohmann::json::parse(text.substr(start, end - start));
      if (j.contains("peak_rss_mb")) s.rss_mb = std::max(s.rss_mb, j["peak_rss_mb"].get<double>());
      start = end + 1;
    }
    return s;
  };
  const Seen none = run("none"), selective = run("selective"), full = run("full");
  std::printf("activations printed (MB): none %.1f, selective %.1f, full %.1f; peak RSS (MB): %.1f, %.1f, %.1f\n",
              none.printed_mb, selective.printed_mb, full.printed_mb, none.rss_mb, selective.rss_mb, full.rss_mb);
  EXPECT_GT(none.printed_mb - full.printed_mb, 100);  // (sized so the allocator's noise is small beside it)
  for (const Seen& s : {selective, full}) {
    const double printed = none.printed_mb - s.printed_mb, measured = none.rss_mb - s.rss_mb;
    EXPECT_NEAR(measured, printed, 0.1 * printed + 4) << "printed saving " << printed << " MB, measured " << measured;
  }
}

}  // namespace
}  // namespace keel
