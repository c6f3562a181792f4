// Mixtures of experts in the llama family (model/moe.h, kernels/cpu/moe.h): the whole model
// against an independent float64 PyTorch implementation (tests/reference/moe_reference.py: the
// loss and every gradient, the router's included, dropless and with a capacity), each kernel
// against central finite differences in double precision, the routing plan against a hand-worked
// case, micro-batches adding up to the whole batch, and the configurations refused in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "kernels/cpu/moe.h"
#include "model/gpt.h"
#include "model/moe.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

struct MoeCase {
  const char* name;
  int experts, top_k, shared, every;
  double capacity;
  int n_layer = 2;
  bool bias = false;  // model.moe_balance = "bias", with random routing biases
};

ModelConfig small_moe(const MoeCase& p) {
  Config c;
  c.model.preset = "llama-moe-tiny";
  c.model.n_layer = p.n_layer;
  c.model.n_head = 4;
  c.model.n_kv_head = 2;
  c.model.n_embd = 16;
  c.model.vocab_size = 37;
  c.model.max_seq_len = 16;
  c.model.ffn_multiple_of = 8;
  c.model.attention = Attention::dense;
  c.model.moe_experts = p.experts;
  c.model.moe_top_k = p.top_k;
  c.model.moe_shared_experts = p.shared;
  c.model.moe_every = p.every;
  c.model.moe_hidden = 12;
  c.model.moe_aux_weight = 0.05;
  c.model.moe_capacity = p.capacity;
  if (p.bias) c.model.moe_balance = MoeBalance::bias;
  c.train.seq_len = 16;
  c.resolve(1);
  return c.model;
}

// Random values everywhere (norms near 1), so that every gradient is exercised and routing is far
// from ties; padded vocabulary rows stay zero. Appends each tensor's name, shape and offset.
void randomize(ChunkStore& store, const ModelConfig& m, json& tensors, std::vector<float>& weights, uint64_t seed) {
  Rng rng(seed);
  for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
    const TensorSpec& spec = store.tensors()[id].spec;
    std::span<float> w = store.view(id, Plane::param);
    const bool vocab = spec.name == "wte" || spec.name == "lm_head.w";
    const int64_t used = vocab ? static_cast<int64_t>(m.vocab_size) * m.n_embd : static_cast<int64_t>(w.size());
    const bool router = spec.name.find("router") != std::string::npos;
    for (int64_t i = 0; i < used; ++i) {
      w[i] = static_cast<float>(spec.kind == ChunkKind::norm ? 1.0 + 0.3 * rng.normal()
                                                             : (router ? 1.0 : 0.3) * rng.normal());
    }
    tensors.push_back({{"name", spec.name}, {"shape", spec.shape}, {"offset", weights.size()}});
    weights.insert(weights.end(), w.begin(), w.end());
  }
}

class MoeReference : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeReference, LossAndEveryGradientMatchPyTorchFloat64) {
  const MoeCase& p = GetParam();
  const ModelConfig m = small_moe(p);
  ChunkStore store(4096);
  GPT model(m, store);
  store.finalize();
  model.init_weights(5);
  json tensors = json::array();
  std::vector<float> weights;
  randomize(store, m, tensors, weights, 17);
  Rng rng(23);
  json biases = json::object();  // per block: its routing biases (as the balancer would have moved them)
  for (int l = 0; l < model.num_layers() && p.bias; ++l) {
    if (MoeFeedForward* moe = model.layer(l).moe()) {
      for (float& b : moe->routing_bias()) b = static_cast<float>(0.2 * rng.normal());
      biases[std::to_string(l - 1)] = moe->routing_bias();
    }
  }
  const int B = 2, T = 7;
  std::vector<int> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = static_cast<int>(rng.below(m.vocab_size));
    targets[i] = static_cast<int>(rng.below(m.vocab_size));
  }
  model.allocate(B, T);
  store.zero_grads();
  const float scale = 1.0f / (B * T);
  const float loss = model.forward(Batch{inputs.data(), targets.data(), B, T, scale});
  model.backward(Batch{inputs.data(), targets.data(), B, T, scale});

  testing::TempDir dir("keel-moe-ref");
  const json spec = {{"config",
                      {{"n_layer", m.n_layer},
                       {"n_head", m.n_head},
                       {"n_kv_head", m.n_kv_head},
                       {"n_embd", m.n_embd},
                       {"ffn_hidden", m.ffn_hidden},
                       {"vocab_size", m.vocab_size},
                       {"rope_theta", m.rope_theta},
                       {"tie_embeddings", m.tie_embeddings.value()},
                       {"moe_experts", m.moe_experts},
                       {"moe_top_k", m.moe_top_k},
                       {"moe_hidden", m.moe_hidden},
                       {"moe_shared_experts", m.moe_shared_experts},
                       {"moe_every", m.moe_every},
                       {"moe_aux_weight", m.moe_aux_weight},
                       {"moe_capacity", m.moe_capacity},
                       {"moe_balance", p.bias ? "bias" : "aux"},
                       {"moe_bias", biases}}},
                     {"B", B},
                     {"T", T},
                     {"tokens", inputs},
                     {"targets", targets},
                     {"tensors", tensors}};
  testing::write_text(dir / "model.json", spec.dump());
  std::ofstream(dir / "weights.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(weights.data()), static_cast<std::streamsize>(weights.size() * 4));
  const testing::CommandResult ref = testing::run_command(
      "/usr/bin/python3 " + testing::source_path("tests/reference/moe_reference.py") + " " + dir.path());
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const json out = json::parse(read_text_file(dir / "reference.json"));
  const double want = out.at("loss").get<double>();
  EXPECT_NEAR(loss, want, 2e-6 * std::abs(want)) << p.name;
  // The balancing loss each MoE block measured (mean per sequence), summed over the blocks.
  double aux = 0, dropped = 0;
  for (int l = 0; l < model.num_layers(); ++l) {
    if (MoeStats* s = model.layer(l).moe_stats()) {
      aux += s->aux_sum / s->sequences;
      dropped += s->dropped;
    }
  }
  EXPECT_NEAR(aux, out.at("aux").get<double>(), 1e-5) << p.name;
  if (p.capacity > 0) {
    EXPECT_GT(dropped, 0) << p.name << ": a capacity this small drops pairs";
  } else {
    EXPECT_EQ(dropped, 0) << p.name;
  }
  std::vector<double> grads(weights.size());
  std::ifstream(dir / "grads.bin", std::ios::binary)
      .read(reinterpret_cast<char*>(grads.data()), static_cast<std::streamsize>(grads.size() * 8));
  for (const json& t : tensors) {
    const std::string name = t.at("name");
    std::span<const float> g = store.view(store.find(name), Plane::grad);
    const size_t at = t.at("offset").get<size_t>();
    double diff = 0, scale_ref = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      diff = std::max(diff, std::abs(g[i] - grads[at + i]));
      scale_ref = std::max(scale_ref, std::abs(grads[at + i]));
    }
    if (scale_ref == 0) {  // only a routed expert no pair of the batch reached: then no gradient here either
      EXPECT_NE(name.find(".moe.expert."), std::string::npos) << p.name << ": the reference gives " << name
                                                              << " no gradient";
      EXPECT_EQ(diff, 0) << p.name << ": " << name;
      continue;
    }
    EXPECT_LT(diff / scale_ref, 2e-5) << p.name << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeReference,
                         ::testing::Values(MoeCase{"top2_of_4_shared", 4, 2, 1, 1, 0.0},
                                           MoeCase{"top1_of_3_every2", 3, 1, 0, 2, 0.0, 4},
                                           MoeCase{"top2_of_4_capacity", 4, 2, 0, 1, 0.5},
                                           MoeCase{"top2_of_4_bias", 4, 2, 1, 1, 0.0, 2, true},
                                           MoeCase{"top1_of_4_bias_capacity", 4, 1, 0, 1, 0.5, 2, true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(MoeReference, TheReferenceChecksItselfWithGradcheck) {
  const testing::CommandResult r = testing::run_command(
      "/usr/bin/python3 " + testing::source_path("tests/reference/moe_reference.py") + " --self-check");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// ---- kernels against finite differences ---------------------------------------------------------
constexpr double kStep = 1e-6, kTol = 1e-6;

std::vector<double> random_vector(Rng& rng, size_t n) {
  std::vector<double> v(n);
  for (double& x : v) x = rng.normal();
  return v;
}

template <typename F>
std::vector<double> finite_difference(std::vector<double>& x, F&& objective) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kStep;
    const double lp = objective();
    x[i] = x0 - kStep;
    const double lm = objective();
    x[i] = x0;
    grad[i] = (lp - lm) / (2 * kStep);
  }
  return grad;
}

void expect_close(const char* what, const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  ASSERT_GT(scale, 0) << what;
  EXPECT_LT(diff / scale, kTol) << what;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// A routing of N = B T tokens (B = 2, T = 5) over E = 4 experts, top-2, and its plan.
struct Plan {
  int B = 2, T = 5, E = 4, k = 2, N = 10;
  std::vector<int32_t> choice, offsets, rows, slot;
  int M = 0;
  explicit Plan(int capacity = 0) : choice(N * k), offsets(E + 1), rows(N * k), slot(N * k) {
    for (int n = 0; n < N; ++n) {
      choice[n * k] = (n * 3) % E;
      choice[n * k + 1] = (n * 3 + 1 + n % 2) % E;
    }
    moe::plan_routing(offsets.data(), rows.data(), slot.data(), choice.data(), B, T, k, E, capacity);
    M = offsets[E];
  }
};

TEST(MoeKernels, GroupedLinearMatchesFiniteDifferences) {
  const Plan plan;
  const int C = 3, OC = 5;
  Rng rng(1);
  std::vector<double> inp = random_vector(rng, plan.M * C), w = random_vector(rng, plan.E * OC * C),
                      probe = random_vector(rng, plan.M * OC), out(plan.M * OC);
  std::vector<double> dinp(inp.size()), dw(w.size(), 0.0);
  // One matrix per expert, each anywhere: here expert e's lies at (E - 1 - e) of the stacks.
  std::vector<const double*> ws(plan.E);
  std::vector<double*> dws(plan.E);
  for (int e = 0; e < plan.E; ++e) {
    ws[e] = w.data() + (plan.E - 1 - e) * OC * C;
    dws[e] = dw.data() + (plan.E - 1 - e) * OC * C;
  }
  auto objective = [&] {
    moe::grouped_linear_forward<double>(MatmulPrecision::fp32, out.data(), inp.data(), ws.data(), plan.offsets.data(),
                                        plan.E, C, OC);
    return dot(out, probe);
  };
  moe::grouped_linear_backward_input<double>(MatmulPrecision::fp32, dinp.data(), probe.data(), ws.data(),
                                             plan.offsets.data(), plan.E, C, OC);
  moe::grouped_linear_backward_weight<double>(MatmulPrecision::fp32, dws.data(), probe.data(), inp.data(),
                                              plan.offsets.data(), plan.E, C, OC);
  expect_close("dinp", dinp, finite_difference(inp, objective));
  expect_close("dw", dw, finite_difference(w, objective));
  // Each row multiplied by its own expert's weight alone.
  objective();
  for (int e = 0; e < plan.E; ++e) {
    for (int m = plan.offsets[e]; m < plan.offsets[e + 1]; ++m) {
      for (int o = 0; o < OC; ++o) {
        double want = 0;
        for (int c = 0; c < C; ++c) want += inp[m * C + c] * ws[e][o * C + c];
        EXPECT_NEAR(out[m * OC + o], want, 1e-12);
      }
    }
  }
}

TEST(MoeKernels, RouterSoftmaxAndCombineMatchFiniteDifferences) {
  const Plan plan(/*capacity=*/2);  // some pairs dropped
  const int C = 3;
  Rng rng(2);
  std::vector<double> logits = random_vector(rng, plan.N * plan.E), ye = random_vector(rng, plan.M * C),
                      probe = random_vector(rng, plan.N * C), probs(logits.size()), y(plan.N * C);
  auto objective = [&] {
    moe::router_softmax_forward(probs.data(), logits.data(), plan.N, plan.E);
    std::fill(y.begin(), y.end(), 0.0);
    moe::combine_forward(y.data(), ye.data(), probs.data(), plan.choice.data(), plan.slot.data(), plan.N, plan.k,
                         plan.E, C);
    return dot(y, probe);
  };
  objective();
  std::vector<double> dye(ye.size()), dprobs(probs.size(), 0.0), dlogits(probs.size());
  moe::combine_backward(dye.data(), dprobs.data(), probe.data(), ye.data(), probs.data(), plan.choice.data(),
                        plan.slot.data(), plan.N, plan.k, plan.E, C);
  moe::router_softmax_backward(dlogits.data(), dprobs.data(), probs.data(), plan.N, plan.E);
  expect_close("dye", dye, finite_difference(ye, objective));
  expect_close("dlogits", dlogits, finite_difference(logits, objective));
}

TEST(MoeKernels, BalancingLossMatchesFiniteDifferencesWithTheChoicesHeld) {
  const Plan plan;
  Rng rng(3);
  std::vector<double> probs = random_vector(rng, plan.N * plan.E);
  for (double& p : probs) p = std::abs(p);
  auto objective = [&] {
    return 0.7 * moe::aux_loss_forward(probs.data(), plan.choice.data(), plan.B, plan.T, plan.E, plan.k);
  };
  std::vector<double> dprobs(probs.size(), 0.0);
  moe::aux_loss_backward(dprobs.data(), plan.choice.data(), plan.B, plan.T, plan.E, plan.k, 0.7);
  expect_close("dprobs", dprobs, finite_difference(probs, objective));
  // Perfect balance with uniform probabilities gives 1 per sequence.
  std::vector<int32_t> even = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1};  // B = 1, T = 5, k = 2 -> 10 choices... over 4 experts
  std::vector<double> uniform(5 * 4, 0.25);
  std::vector<int32_t> balanced = {0, 1, 2, 3};  // T = 2, k = 2
  EXPECT_DOUBLE_EQ(moe::aux_loss_forward(uniform.data(), balanced.data(), 1, 2, 4, 2), 1.0);
  (void)even;
}

TEST(MoeKernels, GatherAndScatterAreAdjoint) {
  const Plan plan(/*capacity=*/2);
  const int C = 4;
  Rng rng(4);
  std::vector<double> x = random_vector(rng, plan.N * C), dxs = random_vector(rng, plan.M * C), xs(plan.M * C),
                      dx(plan.N * C, 0.0);
  moe::gather_rows(xs.data(), x.data(), plan.rows.data(), plan.M, plan.k, C);
  moe::scatter_add_rows(dx.data(), dxs.data(), plan.slot.data(), plan.N, plan.k, C);
  EXPECT_NEAR(dot(xs, dxs), dot(x, dx), 1e-12);
}

TEST(MoeKernels, RoutingPlanSortsByExpertInTokenOrderAndDropsOverCapacity) {
  // One sequence of 4 tokens, top-1 over 2 experts: choices 1, 0, 1, 1.
  const std::vector<int32_t> choice = {1, 0, 1, 1};
  std::vector<int32_t> offsets(3), rows(4), slot(4);
  EXPECT_EQ(moe::plan_routing(offsets.data(), rows.data(), slot.data(), choice.data(), 1, 4, 1, 2, 0), 0);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(rows, (std::vector<int32_t>{1, 0, 2, 3}));
  EXPECT_EQ(slot, (std::vector<int32_t>{1, 0, 2, 3}));
  // Capacity 2: expert 1 keeps tokens 0 and 2; token 3 is dropped.
  EXPECT_EQ(moe::plan_routing(offsets.data(), rows.data(), slot.data(), choice.data(), 1, 4, 1, 2, 2), 1);
  EXPECT_EQ(offsets, (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ((std::vector<int32_t>(rows.begin(), rows.begin() + 3)), (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(slot, (std::vector<int32_t>{1, 0, 2, -1}));
  // Top-k: the most probable first; a tie keeps the lower index.
  const std::vector<float> probs = {0.1f, 0.4f, 0.4f, 0.1f};
  std::vector<int32_t> top(2);
  moe::top_k(top.data(), probs.data(), 1, 4, 2);
  EXPECT_EQ(top, (std::vector<int32_t>{1, 2}));
  // With routing biases the choice is by probs + bias (0.35, 0.3, 0.45, 0.1): experts 2, then 0.
  const std::vector<float> bias = {0.25f, -0.1f, 0.05f, 0.0f};
  moe::top_k(top.data(), probs.data(), 1, 4, 2, bias.data());
  EXPECT_EQ(top, (std::vector<int32_t>{2, 0}));
}

// A context group's view of the plan: 2 sequences of 16 tokens, top-2 over 4 experts, capacity 5,
// cut into 4 chunks of 4 tokens, rank r of 2 holding chunks r and 3 - r. Each rank plans its two
// chunks with what the whole sequence's plan kept of each expert before each chunk (counted from
// that plan, not by the model's formula): every pair is kept or dropped as in the whole plan, and
// the ranks' drops add up to its drops (some pairs dropped in the later chunks, so the counts carry).
TEST(MoeKernels, RoutingPlanOverAContextRanksChunksKeepsWhatTheWholeSequenceKeeps) {
  const int B = 2, T = 16, k = 2, E = 4, capacity = 5, P = 2, chunk = T / (2 * P);
  Rng rng(11);
  std::vector<int32_t> choice(B * T * k);
  for (int n = 0; n < B * T; ++n) {
    choice[n * k] = static_cast<int32_t>(rng.below(E));
    choice[n * k + 1] = static_cast<int32_t>((choice[n * k] + 1 + rng.below(E - 1)) % E);  // distinct
  }
  std::vector<int32_t> offsets(E + 1), rows(B * T * k), slot(B * T * k);
  const int64_t whole_dropped =
      moe::plan_routing(offsets.data(), rows.data(), slot.data(), choice.data(), B, T, k, E, capacity);
  ASSERT_GT(whole_dropped, 0);
  const std::vector<int32_t> whole_slot = slot;
  int64_t dropped = 0;
  for (int r = 0; r < P; ++r) {
    const int mine[2] = {r, 2 * P - 1 - r};
    const int Tl = 2 * chunk;
    std::vector<int32_t> local(B * Tl * k), kept_before(B * 2 * E, 0), place(B * Tl * k);  // place: the whole plan's pair
    for (int s = 0; s < B; ++s) {
      for (int g = 0; g < 2; ++g) {
        for (int p = 0; p < mine[g] * chunk * k; ++p) {  // the pairs before the chunk the whole plan kept
          const int at = s * T * k + p;
          kept_before[(s * 2 + g) * E + choice[at]] += whole_slot[at] >= 0 ? 1 : 0;
        }
        for (int t = 0; t < chunk; ++t) {
          for (int j = 0; j < k; ++j) {
            const int l = (s * Tl + g * chunk + t) * k + j, w = (s * T + mine[g] * chunk + t) * k + j;
            local[l] = choice[w], place[l] = w;
          }
        }
      }
    }
    std::vector<int32_t> lrows(B * Tl * k), lslot(B * Tl * k);
    dropped += moe::plan_routing(offsets.data(), lrows.data(), lslot.data(), local.data(), B, Tl, k, E, capacity,
                                 kept_before.data(), 2);
    for (size_t l = 0; l < local.size(); ++l) {
      EXPECT_EQ(lslot[l] >= 0, whole_slot[static_cast<size_t>(place[l])] >= 0) << "rank " << r << " pair " << place[l];
    }
  }
  EXPECT_EQ(dropped, whole_dropped);
}

// DeepSeek's update, worked by hand: loads 3, 1, 2, 2 (mean 2) move the biases by -r, +r, 0, 0.
TEST(MoeKernels, BalanceBiasMovesAgainstTheLoadBySignTimesRate) {
  std::vector<float> bias = {0.5f, 0.5f, -0.25f, 0.0f};
  const std::vector<double> load = {3, 1, 2, 2};
  moe::update_balance_bias(bias.data(), load.data(), 4, 0.125f);
  EXPECT_EQ(bias, (std::vector<float>{0.375f, 0.625f, -0.25f, 0.0f}));
  const std::vector<double> even = {5, 5, 5, 5};
  moe::update_balance_bias(bias.data(), even.data(), 4, 0.125f);
  EXPECT_EQ(bias, (std::vector<float>{0.375f, 0.625f, -0.25f, 0.0f}));
}

// ---- the model: micro-batches add up, same bytes -------------------------------------------------
// Gradients of one micro-batch of B = 4 sequences vs four micro-batches of one (grad_scale of the
// whole step): the balancing loss is per sequence, so the step is the same (data-parallel ranks
// split a step the same way); and two runs give the same bytes.
std::vector<float> step_grads(const ModelConfig& m, int micro, const std::vector<int>& in, const std::vector<int>& tg,
                              int B, int T) {
  ChunkStore store(4096);
  GPT model(m, store);
  store.finalize();
  model.init_weights(7);
  json tensors = json::array();
  std::vector<float> weights;
  randomize(store, m, tensors, weights, 29);
  const int b = B / micro;
  model.allocate(b, T);
  store.zero_grads();
  for (int i = 0; i < micro; ++i) {
    const Batch batch{in.data() + i * b * T, tg.data() + i * b * T, b, T, 1.0f / (B * T)};
    model.forward(batch);
    model.backward(batch);
  }
  std::vector<float> out;
  for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
    std::span<const float> g = store.view(id, Plane::grad);
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

TEST(MoeModel, MicroBatchesAddUpToTheWholeBatchAndRunsRepeatTheirBytes) {
  const ModelConfig m = small_moe(MoeCase{"m", 4, 2, 1, 1, 0.0});
  const int B = 4, T = 6;
  Rng rng(31);
  std::vector<int> in(B * T), tg(B * T);
  for (int i = 0; i < B * T; ++i) {
    in[i] = static_cast<int>(rng.below(m.vocab_size));
    tg[i] = static_cast<int>(rng.below(m.vocab_size));
  }
  const std::vector<float> whole = step_grads(m, 1, in, tg, B, T), split = step_grads(m, 4, in, tg, B, T);
  ASSERT_EQ(whole.size(), split.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(whole[i] - split[i])));
    scale = std::max(scale, static_cast<double>(std::abs(whole[i])));
  }
  EXPECT_LT(diff / scale, 1e-5);
  const std::vector<float> again = step_grads(m, 1, in, tg, B, T);
  EXPECT_EQ(std::memcmp(whole.data(), again.data(), whole.size() * sizeof(float)), 0);
}

// ---- configurations refused in one line ---------------------------------------------------------
std::string refusal(const std::string& toml, int world = 1) {
  try {
    Config c = Config::parse(toml, "test.toml");
    c.resolve(world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MoeConfig, PresetsResolve) {
  Config c;
  c.model.preset = "llama-moe-d4";
  c.resolve(1);
  EXPECT_EQ(c.model.moe_experts, 8);
  EXPECT_EQ(c.model.moe_top_k, 2);
  EXPECT_EQ(c.model.moe_every, 1);
  EXPECT_EQ(c.model.moe_hidden, 352);
  Config dense;
  dense.model.preset = "llama-d4";
  dense.resolve(1);
  EXPECT_FALSE(dense.model.moe());
  EXPECT_EQ(dense.shape_hash() == c.shape_hash(), false);
}

TEST(MoeConfig, BadInputIsRefusedInOneLineNamingTheKey) {
  const std::string moe = "[model]\npreset = \"llama-moe-tiny\"\n";
  struct Bad {
    std::string toml, names;
    int world = 1;
  };
  const std::vector<Bad> bad = {
      {moe + "moe_top_k = 5\n", "model.moe_top_k: expected 1..moe_experts=4"},
      {"[model]\npreset = \"d4\"\nmoe_experts = 8\n", "model.moe_experts: a mixture of experts is a llama option"},
      {moe + "moe_every = 3\n", "model.moe_every: expected a divisor of n_layer=2"},
      {moe + "moe_balance = \"bias\"\nmoe_bias_rate = 0\n", "model.moe_bias_rate"},
      {"[model]\npreset = \"llama-d4\"\nmoe_balance = \"bias\"\n", "model.moe_experts > 0"},
      {moe + "moe_balance = \"sinkhorn\"\n", "model.moe_balance"},
      {moe + "moe_capacity = -1\n", "model.moe_capacity"},
      {moe + "moe_aux_weight = -0.1\n", "model.moe_aux_weight"},
      {"[model]\npreset = \"llama-d4\"\nmoe_top_k = 2\n", "model.moe_experts > 0"},
  };
  for (const Bad& b : bad) {
    const std::string why = refusal(b.toml, b.world);
    EXPECT_NE(why.find(b.names), std::string::npos) << b.toml << " -> " << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  EXPECT_EQ(refusal(moe), "");
  // (ZeRO-3 with experts homed by routing share: tests/moe_tiers_parallel_test.cpp)
  EXPECT_EQ(refusal(moe + "[tier]\ndevice_mib = 64\nexperts = \"by_frequency\"\n[parallel]\nzero = 3\n", 2), "");
  EXPECT_EQ(refusal(moe + "[parallel]\ntensor = 2\n", 2), "");  // (tests/moe_tensor_test.cpp)
  EXPECT_EQ(refusal(moe + "moe_balance = \"bias\"\n[checkpoint]\nmemory_every = 5\n"), "");  // (its biases in the copies)
  EXPECT_EQ(refusal(moe + "moe_balance = \"bias\"\n[train]\nrecompute = \"full\"\n"), "");
}

}  // namespace
}  // namespace keel
