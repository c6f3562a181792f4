// The pipeline's parts that need no second rank: stage cuts (the exact min-max cut against brute
// force, explicit boundaries and their errors), a stage model on activation slots against the
// whole model, the executor on one rank (loss, gradients, lookahead hints reaching the chunk
// store), and the dynamic micro-batch choice on synthetic measurements.
#include <gtest/gtest.h>

#include "core/config.h"

#include <cmath>
#include <functional>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/rng.h"
#include "pipeline/executor.h"
#include "pipeline/gradient_predictor.h"
#include "pipeline/layout.h"
#include "pipeline/micro_batching.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

ModelConfig small_model(int layers) {
  ModelConfig m;
  m.n_layer = layers;
  m.n_head = 2;
  m.n_embd = 32;
  m.vocab_size = 64;
  m.padded_vocab_size = 128;
  m.max_seq_len = 16;
  return m;
}

// The most expensive stage of every contiguous cut of `costs` into `stages`, minimised by brute force.
double brute_force_best(const std::vector<double>& costs, int stages) {
  const int L = static_cast<int>(costs.size());
  double best = 1e300;
  std::function<void(int, int, double)> go = [&](int first, int left, double worst) {
    if (left == 1) {
      double c = 0;
      for (int i = first; i < L; ++i) c += costs[i];
      best = std::min(best, std::max(worst, c));
      return;
    }
    double c = 0;
    for (int end = first; end < L - left + 1; ++end) {
      c += costs[end];
      go(end + 1, left - 1, std::max(worst, c));
    }
  };
  go(0, stages, 0);
  return best;
}

TEST(PipelineLayout, BalancedCutIsTheExactMinMax) {
  Rng rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const int L = 3 + static_cast<int>(rng.below(8));
    std::vector<double> costs(L);
    for (double& c : costs) c = 0.1 + rng.uniform();
    for (int S = 1; S <= L; ++S) {
      const std::vector<LayerRange> cut = pipeline::cut_stages(costs, S, "");
      ASSERT_EQ(static_cast<int>(cut.size()), S);
      double worst = 0;
      for (int s = 0; s < S; ++s) {
        EXPECT_EQ(cut[s].first, s == 0 ? 0 : cut[s - 1].last + 1);
        EXPECT_LE(cut[s].first, cut[s].last);
        double c = 0;
        for (int i = cut[s].first; i <= cut[s].last; ++i) c += costs[i];
        worst = std::max(worst, c);
      }
      EXPECT_EQ(cut.back().last, L - 1);
      EXPECT_NEAR(worst, brute_force_best(costs, S), 1e-12) << "L=" << L << " S=" << S;
    }
  }
}

TEST(PipelineLayout, ExplicitBoundariesAndTheirErrors) {
  const std::vector<double> costs(8, 1.0);
  const std::vector<LayerRange> cut = pipeline::cut_stages(costs, 3, "2,5");
  ASSERT_EQ(cut.size(), 3u);
  EXPECT_EQ(cut[0].last, 1);
  EXPECT_EQ(cut[1].first, 2);
  EXPECT_EQ(cut[2].first, 5);
  EXPECT_EQ(cut[2].last, 7);
  EXPECT_NE(error_of([&] { pipeline::cut_stages(costs, 3, "2,9"); }).find("boundary 9 out of range"), std::string::npos);
  EXPECT_NE(error_of([&] { pipeline::cut_stages(costs, 3, "5,2"); }).find("boundary 2 out of range"), std::string::npos);
  EXPECT_NE(error_of([&] { pipeline::cut_stages(costs, 3, "2"); }).find("expected 2 boundaries for 3 stages"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pipeline::cut_stages(costs, 3, "2,x"); }).find("comma-separated layer indices"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pipeline::cut_stages(costs, 9, ""); }).find("at most one stage per layer"),
            std::string::npos);
}

TEST(PipelineLayout, HeadCostsMoreThanABlockAtALargeVocabulary) {
  ModelConfig m = small_model(4);
  m.vocab_size = 50257;
  m.padded_vocab_size = 50304;
  m.n_embd = 768;
  const std::vector<double> c = pipeline::layer_costs(m, 1024);
  ASSERT_EQ(c.size(), 6u);
  EXPECT_LT(c[0], c[1]);
  EXPECT_GT(c[5], c[1]);
}

// A mixture-of-experts block costs what one token activates: llama-moe-d4's top-2 of 8 experts of
// 352 units are llama-d4's 704 dense units, plus the router (2 C E); its dense blocks
// (model.moe_every = 2) cost a dense block's.
TEST(PipelineLayout, MoeBlocksCostTheirActiveExperts) {
  Config dense = Config::load("", {"model.preset=llama-d4"}), moe = Config::load("", {"model.preset=llama-moe-d4"});
  dense.resolve(1);
  moe.resolve(1);
  ASSERT_EQ(moe.model.moe_top_k * moe.model.moe_hidden, dense.model.ffn_hidden);
  const std::vector<double> d = pipeline::layer_costs(dense.model, 128), e = pipeline::layer_costs(moe.model, 128);
  const double C = 256, E = 8;
  for (int l = 1; l <= 4; ++l) EXPECT_DOUBLE_EQ(e[l], d[l] + 2 * C * E) << l;
  moe = Config::load("", {"model.preset=llama-moe-d4", "model.moe_every=2"});
  moe.resolve(1);
  const std::vector<double> every2 = pipeline::layer_costs(moe.model, 128);
  EXPECT_DOUBLE_EQ(every2[1], d[1]);
  EXPECT_DOUBLE_EQ(every2[2], d[2] + 2 * C * E);
}

// Two stages of one model on slots, one micro-batch after another in a 1F1B-like order, give the
// whole model's loss and gradients.
TEST(PipelineStages, TwoStagesOnSlotsEqualTheWholeModel) {
  const ModelConfig m = small_model(3);
  const int B = 2, T = 8, L = m.n_layer + 2;
  Rng rng(11);
  std::vector<int> tokens(4 * B * T), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>(rng.below(64)), targets[i] = static_cast<int>(rng.below(64));
  auto batch = [&](int j) {
    Batch b;
    b.inputs = tokens.data() + j * B * T;
    b.targets = targets.data() + j * B * T;
    b.B = B;
    b.T = T;
    b.grad_scale = 1.0f / (B * T * 4);
    return b;
  };
  ChunkStore whole_store(4096);
  GPT whole(m, whole_store);
  whole_store.finalize();
  whole.init_weights(5);
  whole.allocate(B, T);
  double whole_loss = 0;
  for (int j = 0; j < 4; ++j) {
    whole_loss += whole.forward(batch(j));
    whole.backward(batch(j));
  }
  // One "rank" holding both stages as separate ranges, activations of 3 micro-batches in flight.
  const LayerRange first{0, 2}, second{3, L - 1};
  ChunkStore store(4096);
  GPT staged(m, store, {first, second});
  store.finalize();
  staged.init_weights(5);
  staged.allocate(B, T, 3);
  double loss = 0;
  auto forward = [&](int j, int slot) {
    staged.forward(first, slot, batch(j));
    std::copy_n(staged.output(slot, first.last), B * T * m.n_embd, staged.input(slot, second.first));
    loss += staged.forward(second, slot, batch(j));
  };
  auto backward = [&](int j, int slot) {
    staged.backward_input(second, slot, batch(j));
    std::copy_n(staged.input_grad(slot, second.first), B * T * m.n_embd, staged.output_grad(slot, first.last));
    staged.backward_weight(second, slot, batch(j));
    staged.backward_input(first, slot, batch(j));
    staged.backward_weight(first, slot, batch(j));
  };
  forward(0, 0);
  forward(1, 1);
  forward(2, 2);
  backward(0, 0);
  forward(3, 0);
  backward(1, 1);
  backward(2, 2);
  backward(3, 0);
  EXPECT_EQ(loss, whole_loss);
  const auto a = whole_store.range_view(Plane::grad, 0, whole_store.numel());
  const auto b = store.range_view(Plane::grad, 0, store.numel());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
}

TEST(PipelineStages, AStageWithTheHeadKeepsACopyOfTheTiedEmbedding) {
  const ModelConfig m = small_model(2);
  ChunkStore store(4096);
  GPT last(m, store, {LayerRange{2, 3}});
  store.finalize();
  std::vector<std::string> names;
  for (const TensorInfo& t : store.tensors()) names.push_back(t.spec.name);
  EXPECT_EQ(names.front(), "wte");
  EXPECT_EQ(std::count(names.begin(), names.end(), "wpe"), 0);
  EXPECT_TRUE(last.has_layer(3));
  EXPECT_FALSE(last.has_layer(0));
  EXPECT_NE(error_of([&] {
              ChunkStore s(4096);
              GPT g(m, s, {LayerRange{0, 1}, LayerRange{1, 2}});
            }).find("layer 1 in two ranges"),
            std::string::npos);
}

// The executor on a pipeline of one rank (a world of one, no MPI): the schedule's F, B, W run
// on slots, the loss is the model's, and each compute instruction first hints the layers of the
// next `lookahead` ones to the chunk store.
TEST(PipelineExecutor, OneRankRunsTheScheduleAndHintsAhead) {
  const ModelConfig m = small_model(2);
  const int B = 2, T = 8, M = 3;
  ChunkStore store(4096);
  GPT model(m, store);
  store.finalize();
  model.init_weights(1);
  const pipeline::Schedule schedule = pipeline::make_schedule({pipeline::Kind::one_f_one_b, 1, M, 1});
  const pipeline::ScheduleCheck check = pipeline::validate(schedule);
  model.allocate(B, T, pipeline::Executor::slots_needed(check, 0));
  Communicator& world = Communicator::world();
  ASSERT_EQ(world.size(), 1);
  pipeline::Executor executor(model, world, schedule, {LayerRange{0, m.n_layer + 1}}, 2);
  std::vector<std::vector<LayerHint>> hints;
  executor.set_lookahead_hook([&](const std::vector<LayerHint>& h) {
    hints.push_back(h);
    EXPECT_EQ(store.hint_layers(h), 0);  // no tiers: counted only
  });
  Rng rng(2);
  std::vector<int> tokens(M * B * T), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>(rng.below(64)), targets[i] = static_cast<int>(rng.below(64));
  std::vector<Batch> micro(M);
  for (int j = 0; j < M; ++j) {
    micro[j] = Batch{tokens.data() + j * B * T, targets.data() + j * B * T, B, T, 1.0f / (B * T * M)};
  }
  const double loss = executor.run_step(micro);
  double expected = 0;
  ChunkStore ref_store(4096);
  GPT ref(m, ref_store);
  ref_store.finalize();
  ref.init_weights(1);
  ref.allocate(B, T);
  for (const Batch& b : micro) expected += ref.forward(b);
  EXPECT_EQ(loss, expected);
  // 3 x (F, B, W) compute instructions; each hints its own layers and the next two's (the last
  // ones fewer).
  ASSERT_EQ(hints.size(), 9u);
  // One rank's 1F1B is F0 B0 W0 F1 ...: at F0, F0 (embedding first), then B0 and W0 (head first).
  const size_t L = static_cast<size_t>(model.num_layers());
  ASSERT_EQ(hints[0].size(), 3 * L);
  const LayerHint head_params{model.num_layers() - 1, Plane::param}, head_grads{model.num_layers() - 1, Plane::grad};
  EXPECT_EQ(hints[0].front(), (LayerHint{0, Plane::param}));  // F0 reads parameters
  EXPECT_EQ(hints[0][L], head_params);                        // B0 too
  EXPECT_EQ(hints[0][2 * L], head_grads);                     // W0 writes gradients
  EXPECT_EQ(hints[2].front(), (LayerHint{model.num_layers() - 1, Plane::grad}));  // at W0: W0, F1, B1
  EXPECT_EQ(hints[2][L], (LayerHint{0, Plane::param}));
  EXPECT_EQ(hints.back().size(), L);  // the last W: itself only
  EXPECT_GT(store.chunks()[0].hinted, 0u);
  EXPECT_EQ(executor.timeline().size(), 9u);
  EXPECT_GE(executor.stats().peak_slots, 1);
}

Config pipeline_config(int micro) {
  Config c;
  c.model = small_model(6);
  c.train.batch_size = 4;
  c.train.grad_accum = 4;
  c.train.seq_len = 16;
  c.parallel.pipeline = 2;
  c.parallel.schedule = ScheduleKind::one_f_one_b;
  c.parallel.micro_batches = micro;
  return c;
}

// Synthetic measurements: a stage's F, B, W each cost `overhead` + `per_sequence` x sequences.
pipeline::StageTimes measured(int micro_batch, int stages, double overhead, double per_sequence) {
  pipeline::StageTimes t;
  t.micro_batch = micro_batch;
  t.forward.assign(stages, overhead + per_sequence * micro_batch);
  t.backward_input = t.forward;
  t.backward_weight = t.forward;
  return t;
}

TEST(PipelineMicroBatches, ProbeAndChoice) {
  const Config c = pipeline_config(4);  // 16 sequences a step
  EXPECT_EQ(pipeline::allowed_micro_batches(c), (std::vector<int>{1, 2, 4, 8, 16}));
  EXPECT_EQ(pipeline::probe_micro_batches(c, 4), 8);
  EXPECT_EQ(pipeline::probe_micro_batches(c, 16), 8);
  const std::vector<LayerRange> stages = pipeline::cut_stages(std::vector<double>(8, 1.0), 2, "");
  // No overhead: the most micro-batches (smallest bubble) win.
  pipeline::MicroBatchChoice free = pipeline::choose_micro_batches(c, stages, measured(4, 2, 0, 1), measured(2, 2, 0, 1));
  EXPECT_EQ(free.micro_batches, 16);
  EXPECT_NE(free.reason.find("16 micro-batches of 1 sequences"), std::string::npos) << free.reason;
  // A large overhead per instruction: one micro-batch.
  pipeline::MicroBatchChoice costly = pipeline::choose_micro_batches(c, stages, measured(4, 2, 100, 1), measured(2, 2, 100, 1));
  EXPECT_EQ(costly.micro_batches, 1);
  // In between: simulated optimum, never worse than any allowed count.
  pipeline::MicroBatchChoice mid = pipeline::choose_micro_batches(c, stages, measured(4, 2, 1, 1), measured(2, 2, 1, 1));
  EXPECT_GT(mid.micro_batches, 1);
  EXPECT_LT(mid.micro_batches, 16);
  EXPECT_NE(error_of([&] { pipeline::choose_micro_batches(c, stages, measured(4, 2, 0, 1), measured(4, 2, 0, 1)); })
                .find("same micro-batch size"),
            std::string::npos);
}

TEST(PipelineMicroBatches, ActivationBoundExcludesCounts) {
  Config c = pipeline_config(4);
  const std::vector<LayerRange> stages = pipeline::cut_stages(std::vector<double>(8, 1.0), 2, "");
  const pipeline::Plan small = pipeline::plan(c, stages, 16);
  const pipeline::Plan large = pipeline::plan(c, stages, 1);
  // A bound between the two plans' peaks: one micro-batch of 16 no longer fits.
  const int64_t bound = (*std::max_element(small.check.peak_bytes.begin(), small.check.peak_bytes.end()) +
                         *std::max_element(large.check.peak_bytes.begin(), large.check.peak_bytes.end())) / 2;
  c.parallel.activation_mib = std::max<int64_t>(1, bound >> 20);
  if ((c.parallel.activation_mib << 20) >= *std::max_element(large.check.peak_bytes.begin(), large.check.peak_bytes.end())) {
    GTEST_SKIP() << "model too small for a MiB bound between the plans";
  }
  EXPECT_NE(error_of([&] { pipeline::plan(c, stages, 1); }).find("parallel.activation_mib"), std::string::npos);
  const pipeline::MicroBatchChoice choice =
      pipeline::choose_micro_batches(c, stages, measured(4, 2, 100, 1), measured(2, 2, 100, 1));
  EXPECT_GT(choice.micro_batches, 1);
  EXPECT_NE(choice.reason.find("over the activation bound"), std::string::npos) << choice.reason;
}

TEST(GradientPredictorLstm, GradientMatchesFiniteDifferences) {
  pipeline::BlendLstm lstm(7);
  pipeline::BlendLstm::State state;
  pipeline::BlendLstm::Trace trace;
  lstm.step(state, {0.3f, -0.2f, 0.5f, 0.1f}, trace);  // a state that is not zero
  const pipeline::BlendLstm::State before = state;
  const pipeline::BlendLstm::Input x = {0.9f, 0.1f, -0.4f, 0.7f};
  const pipeline::BlendLstm::Output target = {0.2f, 0.6f};
  lstm.step(state, x, trace);
  const std::vector<float> analytic = lstm.gradient(trace, target);
  auto loss = [&] {
    pipeline::BlendLstm::State s = before;
    pipeline::BlendLstm::Trace t;
    const auto y = lstm.step(s, x, t);
    return 0.5 * ((y[0] - target[0]) * (y[0] - target[0]) + (y[1] - target[1]) * (y[1] - target[1]));
  };
  std::vector<float>& w = lstm.parameters();
  ASSERT_EQ(analytic.size(), w.size());
  for (size_t k = 0; k < w.size(); ++k) {
    const float keep = w[k];
    const float h = 1e-2f;
    w[k] = keep + h;
    const double up = loss();
    w[k] = keep - h;
    const double down = loss();
    w[k] = keep;
    EXPECT_NEAR(analytic[k], (up - down) / (2 * h), 2e-3) << "parameter " << k;
  }
}

TEST(GradientPredictorLstm, StartsAsTheMeanAndLearnsTheBlendThatFits) {
  // Chunks whose W's true gradient is always 0.25 * mean + 0.75 * previous: the predictor starts
  // at (1, 0) and learns to blend close to (0.25, 0.75).
  pipeline::GradientPredictor p(1);
  Rng rng(4);
  const size_t n = 256;
  auto random = [&] {
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(rng.normal());
    return v;
  };
  std::vector<float> mean = random(), previous = random();
  auto first = p.blend(0, mean, previous);
  EXPECT_NEAR(first[0], 1.0f, 0.05f);
  EXPECT_NEAR(first[1], 0.0f, 0.05f);
  pipeline::BlendLstm::Output last{};
  for (int step = 0; step < 400; ++step) {
    std::vector<float> actual(n);
    for (size_t i = 0; i < n; ++i) actual[i] = 0.25f * mean[i] + 0.75f * previous[i];
    p.learn(0, mean, previous, actual);
    previous = actual;
    mean = random();
    last = p.blend(0, mean, previous);
  }
  EXPECT_NEAR(last[0], 0.25f, 0.1f);
  EXPECT_NEAR(last[1], 0.75f, 0.1f);
  EXPECT_LT(p.last_loss(), 1e-2);
}

// A predictor saved mid-run (pipeline checkpoints) and loaded into a fresh one goes on with the
// same bytes: every blend and loss after the load is the one the original computes.
TEST(GradientPredictorLstm, SavedAndLoadedGoesOnWithTheSameBytes) {
  const int chunks = 3;
  const size_t n = 64;
  pipeline::GradientPredictor original(chunks);
  Rng rng(9);
  auto random = [&] {
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(rng.normal());
    return v;
  };
  std::vector<std::vector<float>> mean(chunks), previous(chunks);
  auto step = [&](pipeline::GradientPredictor& p, int c, const std::vector<float>& actual) {
    p.learn(c, mean[c], previous[c], actual);
    return p.blend(c, mean[c], previous[c]);
  };
  // A few steps of every chunk but the last, which stays untraced (its first learn() learns nothing).
  for (int s = 0; s < 5; ++s) {
    for (int c = 0; c + 1 < chunks; ++c) {
      mean[c] = random();
      previous[c] = random();
      step(original, c, random());
    }
  }
  std::vector<float> saved;
  original.save(saved);
  ASSERT_EQ(saved.size(), pipeline::GradientPredictor::saved_floats(chunks));
  pipeline::GradientPredictor loaded(chunks);
  ASSERT_EQ(loaded.load(saved), saved.size());
  loaded.set_last_loss(original.last_loss());
  std::vector<float> again;
  loaded.save(again);
  EXPECT_TRUE(again == saved);
  for (int s = 0; s < 5; ++s) {
    for (int c = 0; c < chunks; ++c) {
      mean[c] = random();
      previous[c] = random();
      const std::vector<float> actual = random();
      const pipeline::BlendLstm::Output a = step(original, c, actual), b = step(loaded, c, actual);
      EXPECT_EQ(a, b) << "step " << s << " chunk " << c;
      EXPECT_EQ(original.last_loss(), loaded.last_loss());
    }
  }
  // Too few floats for the chunks: an error, not a read past the end.
  pipeline::GradientPredictor more(chunks + 1);
  EXPECT_THROW(more.load(saved), Error);
}

}  // namespace
}  // namespace keel
