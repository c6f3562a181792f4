// The model layout (model/model_layout.h): for both decoder families (tied and untied heads,
// grouped-query attention), pipeline stages (a head stage holding the wte replica) and the CLIP
// towers, the layout is exactly what the built model registers with its chunk store — names,
// shapes, layers, kinds, decay, replica flags, and the chunks they land in — and the code outside
// src/model/ asks the layout instead of building a model to learn it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "comm/zero.h"
#include "core/config.h"
#include "model/clip.h"
#include "model/gpt.h"
#include "model/model_layout.h"
#include "sim/step_model.h"
#include "test_util.h"

namespace keel {
namespace {

ModelConfig small(const std::string& preset, int n_kv_head = 0, std::optional<bool> tied = std::nullopt) {
  Config c;
  c.model.preset = preset;
  c.model.n_layer = 3;
  c.model.n_head = 4;
  c.model.n_embd = 32;
  c.model.vocab_size = 61;
  c.model.max_seq_len = 16;
  if (preset.rfind("llama", 0) == 0) {
    c.model.n_kv_head = n_kv_head;
    c.model.ffn_multiple_of = 8;
    c.model.tie_embeddings = tied;
  }
  c.train.seq_len = 16;
  c.resolve(1);
  return c.model;
}

// Two layout-only stores, one from the layout and one from what `build` registers, compared
// tensor by tensor and chunk by chunk (small chunks: tensors span several, chunks hold several).
void expect_same_store(const ModelLayout& layout, const std::function<void(ChunkStore&)>& build,
                       const std::string& what) {
  for (int64_t chunk_bytes : {int64_t{4096}, int64_t{1} << 20}) {
    SCOPED_TRACE(what + ", chunks of " + std::to_string(chunk_bytes) + " bytes");
    ChunkStore from_layout(chunk_bytes), from_model(chunk_bytes);
    const std::vector<TensorId> ids = register_layout(from_layout, layout);
    build(from_model);
    from_layout.finalize_layout();
    from_model.finalize_layout();
    ASSERT_EQ(ids.size(), layout.tensors.size());
    ASSERT_EQ(from_model.tensors().size(), layout.tensors.size());
    for (size_t i = 0; i < layout.tensors.size(); ++i) {
      const TensorSpec& want = layout.tensors[i];
      const TensorInfo& got = from_model.tensors()[i];
      EXPECT_EQ(ids[i], static_cast<TensorId>(i));
      EXPECT_EQ(got.spec.name, want.name) << i;
      EXPECT_EQ(got.spec.shape, want.shape) << want.name;
      EXPECT_EQ(got.spec.layer, want.layer) << want.name;
      EXPECT_EQ(got.spec.kind, want.kind) << want.name;
      EXPECT_EQ(got.spec.decay, want.decay) << want.name;
      EXPECT_EQ(got.spec.replica, want.replica) << want.name;
      EXPECT_EQ(got.spec.expert, want.expert) << want.name;
      EXPECT_EQ(got.offset, from_layout.tensors()[i].offset) << want.name;
      EXPECT_EQ(got.numel, from_layout.tensors()[i].numel) << want.name;
    }
    ASSERT_EQ(from_model.chunks().size(), from_layout.chunks().size());
    for (size_t c = 0; c < from_model.chunks().size(); ++c) {
      const Chunk &a = from_model.chunks()[c], &b = from_layout.chunks()[c];
      EXPECT_EQ(a.layer, b.layer) << c;
      EXPECT_EQ(a.kind, b.kind) << c;
      EXPECT_EQ(a.offset, b.offset) << c;
      EXPECT_EQ(a.numel, b.numel) << c;
      EXPECT_EQ(a.replica, b.replica) << c;
      EXPECT_EQ(a.expert, b.expert) << c;
      ASSERT_EQ(a.segments.size(), b.segments.size()) << c;
      for (size_t k = 0; k < a.segments.size(); ++k) {
        EXPECT_EQ(a.segments[k].tensor, b.segments[k].tensor);
        EXPECT_EQ(a.segments[k].offset, b.segments[k].offset);
        EXPECT_EQ(a.segments[k].numel, b.segments[k].numel);
        EXPECT_EQ(a.segments[k].tensor_offset, b.segments[k].tensor_offset);
      }
    }
    EXPECT_EQ(from_model.numel(), from_layout.numel());
  }
}

struct DecoderCase {
  std::string name;
  ModelConfig model;
};

std::vector<DecoderCase> decoders() {
  return {{"gpt2 tiny", small("tiny")},
          {"llama GQA untied", small("llama-tiny", 2, false)},
          {"llama GQA tied", small("llama-tiny", 2, true)},
          {"llama MHA untied", small("llama-tiny", 4, false)},
          {"llama MoE, shared expert", small("llama-moe-tiny", 2, false)}};
}

// Every pipeline cut of the 5 layers (embedding, 3 blocks, head) into stages, as a rank holding
// several (interleaved schedules) would too.
std::vector<std::vector<LayerRange>> stage_sets() {
  return {{{0, 4}},          {{0, 0}},         {{1, 3}},         {{4, 4}},
          {{3, 4}},          {{0, 1}, {3, 4}}, {{1, 2}, {4, 4}}, {{0, 0}, {2, 2}}};
}

TEST(ModelLayout, DecoderLayoutIsWhatTheModelRegisters) {
  for (const DecoderCase& d : decoders()) {
    expect_same_store(model_layout(d.model), [&](ChunkStore& s) { const GPT model(d.model, s); }, d.name + ", whole");
    for (const std::vector<LayerRange>& ranges : stage_sets()) {
      std::string what = d.name + ", layers";
      for (const LayerRange& r : ranges) what += " " + std::to_string(r.first) + ".." + std::to_string(r.last);
      for (bool bf16 : {false, true}) {
        expect_same_store(model_layout(d.model, ranges),
                          [&](ChunkStore& s) { const GPT model(d.model, s, ranges, bf16); }, what);
      }
    }
  }
}

TEST(ModelLayout, TiedHeadsAndReplicas) {
  const LayerRange head_only{4, 4}, with_embedding{0, 4}, first{0, 0};
  for (const DecoderCase& d : decoders()) {
    SCOPED_TRACE(d.name);
    const ModelConfig& m = d.model;
    const bool tied = !m.llama() || m.tie_embeddings.value_or(false);
    ChunkStore store(1 << 20);
    const GPT model(m, store);
    const ModelLayout whole = model_layout(m);
    ASSERT_EQ(whole.tied.size(), model.tied_groups().size());
    ASSERT_EQ(whole.tied.size(), tied ? 1u : 0u);
    if (tied) {
      EXPECT_EQ(whole.tied[0].tensor, "wte");
      EXPECT_EQ(whole.tied[0].home, 0);
      EXPECT_EQ(whole.tied[0].layers, (std::vector<int>{0, 4}));
      EXPECT_EQ(model.tied_groups()[0].layers, whole.tied[0].layers);
    }
    // A stage with the head but not the embedding: the replica of wte, first, filed under layer 0.
    const ModelLayout head = model_layout(m, {&head_only, 1});
    ASSERT_FALSE(head.tensors.empty());
    if (tied) {
      EXPECT_EQ(head.tensors[0].name, "wte");
      EXPECT_TRUE(head.tensors[0].replica);
      EXPECT_EQ(head.tensors[0].layer, 0);
      EXPECT_EQ(head.tensors[0].shape, (std::vector<int64_t>{m.padded_vocab_size, m.n_embd}));
      EXPECT_THROW(head.index("lm_head.w"), Error);
    } else {
      EXPECT_THROW(head.index("wte"), Error);
      EXPECT_EQ(head.tensors[head.index("lm_head.w")].shape, (std::vector<int64_t>{m.padded_vocab_size, m.n_embd}));
    }
    for (const LayerRange* r : {&with_embedding, &first}) {
      for (const TensorSpec& t : model_layout(m, {r, 1}).tensors) EXPECT_FALSE(t.replica) << t.name;
    }
    // Grouped-query attention: q, then n_kv_head keys and values of head size C / n_head.
    const TensorSpec& qkv = whole.tensors[whole.index("h.0.attn.qkv.w")];
    const int64_t hs = m.n_embd / m.n_head;
    EXPECT_EQ(qkv.shape, (std::vector<int64_t>{m.n_embd + 2 * m.n_kv_head * hs, m.n_embd}));
  }
}

// A pipeline's stages, together, hold every tensor of the whole model once (replicas aside), in
// the whole model's order.
TEST(ModelLayout, StagesPartitionTheWholeModel) {
  for (const DecoderCase& d : decoders()) {
    const ModelLayout whole = model_layout(d.model);
    std::vector<std::string> stages;
    for (const LayerRange& r : {LayerRange{0, 1}, LayerRange{2, 3}, LayerRange{4, 4}}) {
      for (const TensorSpec& t : model_layout(d.model, {&r, 1}).tensors) {
        if (!t.replica) stages.push_back(t.name);
      }
    }
    std::vector<std::string> names;
    for (const TensorSpec& t : whole.tensors) names.push_back(t.name);
    EXPECT_EQ(stages, names) << d.name;
  }
}

// The simulator's closed-form parameter counts per layer are the layout's (the whole model's,
// never allocated: a 124M- and a 110M-parameter model; mixtures of experts with and without a
// shared expert, every block or every second one).
TEST(ModelLayout, ParameterCountsPerLayerAreTheSimulatorsClosedForm) {
  for (const std::vector<std::string>& sets :
       std::vector<std::vector<std::string>>{{"model.preset=gpt2-124m"},
                                             {"model.preset=llama-110m"},
                                             {"model.preset=llama-d4"},
                                             {"model.preset=llama-moe-tiny"},
                                             {"model.preset=llama-moe-d4", "model.moe_every=2"}}) {
    const std::string set = sets.back();
    Config c = Config::load("", sets);
    c.resolve(1);
    const ModelLayout layout = model_layout(c.model);
    std::vector<double> per_layer(static_cast<size_t>(c.model.n_layer + 2), 0.0);
    for (const TensorSpec& t : layout.tensors) {
      double n = 1;
      for (int64_t d : t.shape) n *= static_cast<double>(d);
      per_layer.at(static_cast<size_t>(t.layer)) += n;
    }
    EXPECT_EQ(per_layer, sim::layer_params(c.model)) << set;
  }
}

TEST(ModelLayout, ClipLayoutIsWhatTheDualEncoderRegisters) {
  struct Case {
    std::string name;
    ImageTower tower;
    std::string block, text;
    std::vector<int> layers;
  };
  const std::vector<Case> cases{
      {"resnet basic, gpt2 text", ImageTower::resnet18, "basic", "gpt2", {1, 1, 1, 1}},
      {"resnet bottleneck, llama text", ImageTower::resnet50, "bottleneck", "llama", {1, 2, 1, 1}},
      {"vit, gpt2 text", ImageTower::vit, "", "gpt2", {}},
      {"vit, llama text", ImageTower::vit, "", "llama", {}}};
  for (const Case& k : cases) {
    ClipSpec spec;
    spec.image_tower = k.tower;
    if (k.tower == ImageTower::vit) {
      spec.vit.patch = 8;
      spec.vit.layers = 2;
      spec.vit.width = 32;
      spec.vit.heads = 2;
    } else {
      spec.resnet = ResNetSpec{};
      spec.resnet->block = k.block;
      spec.resnet->layers = k.layers;
      spec.image_width = 8;
    }
    spec.image_size = 32;
    spec.embed_dim = 16;
    const ModelConfig text = k.text == "llama" ? small("llama-tiny", 2, false) : small("tiny");
    const ModelLayout layout = clip_layout(spec, text);
    expect_same_store(layout, [&](ChunkStore& s) { const ClipModel model(spec, text, s); }, k.name);
    // The dual encoder's shape: the image tower's tensors, the text tower's, logit_scale last.
    ChunkStore store(1 << 20);
    ClipModel model(spec, text, store);
    EXPECT_EQ(layout.tensors.back().name, "logit_scale");
    EXPECT_TRUE(layout.tied.empty());  // no tower's head reads its token embedding
    EXPECT_EQ(layout.tensors.back().layer, model.loss_layer());
    EXPECT_EQ(layout.tensors[layout.index("text.wte")].layer, model.text().first_layer());
    EXPECT_EQ(layout.tensors[layout.index("text.proj.w")].shape, (std::vector<int64_t>{16, 32}));
    if (k.tower == ImageTower::vit) {
      EXPECT_EQ(layout.tensors[layout.index("visual.pos")].shape, (std::vector<int64_t>{16 + 1, 32}));
      EXPECT_EQ(layout.tensors[layout.index("visual.h.1.attn.qkv.w")].layer, 2);
    } else if (k.block == "basic") {
      // torchvision's names; stage 2's first block changes the shape: a shortcut convolution.
      EXPECT_EQ(layout.tensors[layout.index("visual.layer2.0.downsample.0.weight")].shape,
                (std::vector<int64_t>{16, 8, 1, 1}));
      EXPECT_THROW(layout.index("visual.layer1.0.downsample.0.weight"), Error);
    } else {
      EXPECT_EQ(layout.tensors[layout.index("visual.layer1.0.downsample.0.weight")].shape,
                (std::vector<int64_t>{32, 8, 1, 1}));
      EXPECT_EQ(layout.tensors[layout.index("visual.proj.weight")].shape, (std::vector<int64_t>{16, 8 * 8 * 4}));
    }
  }
}

// A mixture-of-experts block's routed experts: each expert's gate_up and proj are tensors of their
// own, in chunks holding nothing else (TensorSpec::expert), drawing the values of expert j's part
// of the stack of all E experts (TensorShard::stream). A rank of an expert group of P holds the
// same tensors but only its E / P experts'; a P that does not divide E is one line.
TEST(ModelLayout, RoutedExpertsAreTensorsAndChunksOfTheirOwn) {
  const ModelConfig m = small("llama-moe-tiny", 2, false);  // 3 MoE blocks of 4 experts, one shared
  const int E = m.moe_experts;
  const int64_t C = m.n_embd, Hm = m.moe_hidden;
  ASSERT_EQ(E, 4);
  const ModelLayout whole = model_layout(m);
  for (int j = 0; j < E; ++j) {
    const int g = whole.index("h.1.moe.expert." + std::to_string(j) + ".gate_up.w");
    const int d = whole.index("h.1.moe.expert." + std::to_string(j) + ".proj.w");
    EXPECT_EQ(whole.tensors[g].shape, (std::vector<int64_t>{2 * Hm, C}));
    EXPECT_EQ(whole.tensors[d].shape, (std::vector<int64_t>{C, Hm}));
    EXPECT_EQ(whole.tensors[g].expert, j);
    EXPECT_EQ(whole.tensors[d].expert, j);
    EXPECT_EQ(whole.shards[g].stream, "h.1.moe.experts_mlp.gate_up.w");
    EXPECT_EQ(whole.shards[g].stream_first, j * 2 * Hm * C);
    EXPECT_EQ(whole.shards[d].stream, "h.1.moe.experts_mlp.proj.w");
    EXPECT_EQ(whole.shards[d].stream_first, j * C * Hm);
  }
  for (const char* other : {"h.1.moe.router.w", "h.1.moe.shared_mlp.gate_up.w", "h.1.attn.qkv.w"}) {
    EXPECT_EQ(whole.tensors[whole.index(other)].expert, -1) << other;
  }
  // Chunks: an expert's chunk holds only that expert's tensors, at any chunk size.
  for (int64_t chunk_bytes : {int64_t{4096}, int64_t{1} << 20}) {
    ChunkStore store(chunk_bytes);
    register_layout(store, whole);
    store.finalize_layout();
    int expert_chunks = 0;
    for (const Chunk& c : store.chunks()) {
      expert_chunks += c.expert >= 0;
      for (const Segment& seg : c.segments) EXPECT_EQ(store.tensors()[seg.tensor].spec.expert, c.expert) << c.id;
    }
    EXPECT_GE(expert_chunks, m.n_layer * E) << chunk_bytes;
  }
  // Expert groups of 2 and 4: rank r holds experts r E / P .. (r + 1) E / P - 1 and everything else.
  for (int P : {2, 4}) {
    std::vector<std::string> union_names;
    for (int r = 0; r < P; ++r) {
      const ModelLayout mine = model_layout(m, {}, {}, ExpertPlace{r, P});
      int experts = 0;
      for (size_t i = 0; i < mine.tensors.size(); ++i) {
        const TensorSpec& t = mine.tensors[i];
        if (t.expert < 0) {
          EXPECT_EQ(t.name, whole.tensors[whole.index(t.name)].name);
          if (r == 0) union_names.push_back(t.name);
          continue;
        }
        ++experts;
        EXPECT_GE(t.expert, r * E / P) << t.name;
        EXPECT_LT(t.expert, (r + 1) * E / P) << t.name;
        EXPECT_EQ(mine.shards[i].stream_first, whole.shards[whole.index(t.name)].stream_first) << t.name;
        union_names.push_back(t.name);
      }
      EXPECT_EQ(experts, m.n_layer * 2 * E / P) << P;
    }
    EXPECT_EQ(union_names.size(), whole.tensors.size()) << P;
  }
  EXPECT_EQ(testing::error_of([&] { model_layout(m, {}, {}, ExpertPlace{0, 3}); }),
            "config key 'parallel.expert': expected a divisor of the 4 experts, found 3");
  EXPECT_EQ(testing::error_of([&] { model_layout(small("llama-tiny"), {}, {}, ExpertPlace{0, 2}); }),
            "config key 'parallel.expert': expected 1 without a mixture of experts, found 2");
}

// ZeRO with sharded experts (comm/zero.h, experts apart), against a brute-force count: over D
// data ranks in expert groups of P, each holding its experts' layout, the ranks' stores lie alike
// (the same chunks at the same offsets, experts or not), every element of every tensor of the whole
// model is owned by exactly one rank (an expert's by one of the D / P ranks holding it), each
// chunk's elements are counted to its owner by the tiling of its kind (what a reduce-scatter of a
// bucket of it sends), and each rank owns its share of the elements to within the largest chunk.
TEST(ModelLayout, ZeroSharesEachExpertOutOverTheRanksHoldingIt) {
  const ModelConfig m = small("llama-moe-tiny", 2, false);
  const ModelLayout whole = model_layout(m);
  for (int64_t chunk_bytes : {int64_t{4096}, int64_t{1} << 20}) {
    for (const auto& [P, D] : {std::pair{2, 2}, std::pair{2, 4}, std::pair{4, 4}, std::pair{2, 8}, std::pair{4, 8}}) {
      const std::string where = "P " + std::to_string(P) + ", D " + std::to_string(D) + ", chunk " + std::to_string(chunk_bytes);
      std::vector<std::unique_ptr<ChunkStore>> stores;
      for (int d = 0; d < D; ++d) {
        stores.push_back(std::make_unique<ChunkStore>(chunk_bytes));
        register_layout(*stores.back(), model_layout(m, {}, {}, ExpertPlace{d % P, P}));
        stores.back()->finalize_layout();
      }
      std::map<std::string, int64_t> owned;         // elements of each tensor owned, over all ranks
      std::set<std::pair<std::string, int64_t>> pieces;  // (tensor, first element) of each owned piece
      int64_t total = 0, largest = 0;
      std::vector<int64_t> per_rank(static_cast<size_t>(D), 0);
      for (int d = 0; d < D; ++d) {
        const ChunkStore& store = *stores[d];
        const ChunkPartition p = ChunkPartition::balanced_experts_apart(store, D, P);
        ASSERT_EQ(store.chunks().size(), stores[0]->chunks().size()) << where;
        for (const Chunk& c : store.chunks()) {
          const Chunk& first = stores[0]->chunks()[c.id];
          EXPECT_EQ(c.offset, first.offset) << where;
          EXPECT_EQ(c.numel, first.numel) << where;
          EXPECT_EQ(c.expert >= 0, first.expert >= 0) << where;
          // The tiling of its kind counts the chunk to its owner (data rank, or holder d / P).
          const std::vector<int> counts = p.intersect(c.offset, c.numel, c.expert >= 0);
          const int owner = c.expert >= 0 ? p.expert_holder(c.id) : p.owner(c.id);
          EXPECT_EQ(counts[static_cast<size_t>(owner)], c.numel) << where << " chunk " << c.id;
          EXPECT_EQ(p.owns(d, c), c.expert >= 0 ? owner == d / P : owner == d) << where << " chunk " << c.id;
          if (d == 0) largest = std::max(largest, c.numel);
          if (!p.owns(d, c)) continue;
          for (const Segment& seg : c.segments) {
            const std::string& name = store.tensors()[seg.tensor].spec.name;
            owned[name] += seg.numel;
            EXPECT_TRUE(pieces.insert({name, seg.tensor_offset}).second) << where << ": " << name << " owned twice";
            per_rank[static_cast<size_t>(d)] += seg.numel;
            total += seg.numel;
          }
        }
      }
      for (const TensorSpec& t : whole.tensors) {
        int64_t n = 1;
        for (int64_t x : t.shape) n *= x;
        EXPECT_EQ(owned[t.name], n) << where << ": " << t.name;
      }
      for (int d = 0; d < D; ++d) {
        EXPECT_LE(std::abs(per_rank[static_cast<size_t>(d)] - total / D), 2 * largest) << where << " rank " << d;
      }
    }
  }
}

TEST(ModelLayout, BadRangesAreOneLine) {
  const ModelConfig m = small("tiny");
  const std::vector<LayerRange> twice = {{0, 2}, {2, 4}}, outside = {{0, 5}};
  EXPECT_EQ(testing::error_of([&] { model_layout(m, twice); }), "GPT: layer 2 in two ranges");
  EXPECT_EQ(testing::error_of([&] { model_layout(m, outside); }), "GPT: layer range [0, 5] outside the model's 0..4");
}

// Outside src/model/, a GPT is built only where its layers run (a rank's model, a loaded model
// for evaluation and generation); everyone else asks model_layout.
TEST(ModelLayout, NoModelIsBuiltOutsideTheModelFolderForItsLayout) {
  const std::filesystem::path src = std::filesystem::path(KEEL_SOURCE_DIR) / "src";
  const std::regex built(R"(\bGPT\s*>\s*\(|\bGPT\s+\w+\s*[\({]|\bGPT\s*\()");
  std::map<std::string, int> found;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(src)) {
    if (!entry.is_regular_file()) continue;
    const std::string rel = std::filesystem::relative(entry.path(), src).string();
    if (rel.rfind("model/", 0) == 0) continue;
    std::ifstream in(entry.path());
    std::string line;
    while (std::getline(in, line)) {
      const std::string code = line.substr(0, line.find("//"));
      if (std::regex_search(code, built)) found[rel]++;
    }
  }
  const std::map<std::string, int> running = {{"cli/main.cpp", 1}, {"runtime/rank_model.cpp", 1}};
  EXPECT_EQ(found, running);
}

}  // namespace
}  // namespace keel
