#include "model/model_layout.h"

#include "core/error.h"

#include <algorithm>

namespace keel {

int ModelLayout::index(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return static_cast<int>(i);
  }
  throw Error("model layout: no tensor named " + name);
}

namespace {

// A shard as rows of a whole tensor viewed [outer, extent of dim, inner]: for each outer index and
// each block, the rank's slice of the block.
template <typename Copy>
void for_each_shard_run(const TensorShard& shard, TensorPlace place, Copy copy) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < static_cast<int>(shard.whole_shape.size()); ++d) {
    if (d < shard.dim) outer *= shard.whole_shape[d];
    if (d > shard.dim) inner *= shard.whole_shape[d];
  }
  if (!shard.split()) {
    copy(0, 0, outer * inner);
    return;
  }
  const int64_t extent = shard.whole_shape[shard.dim];
  int64_t shard_extent = 0;
  for (int64_t b : shard.blocks) shard_extent += b / place.size;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t whole_row = 0, shard_row = 0;
    for (int64_t b : shard.blocks) {
      const int64_t part = b / place.size;
      copy((o * extent + whole_row + place.rank * part) * inner, (o * shard_extent + shard_row) * inner, part * inner);
      whole_row += b;
      shard_row += part;
    }
  }
}

}  // namespace

void slice_shard(const TensorShard& shard, TensorPlace place, const float* whole, float* out) {
  for_each_shard_run(shard, place, [&](int64_t at_whole, int64_t at_shard, int64_t n) {
    std::copy(whole + at_whole, whole + at_whole + n, out + at_shard);
  });
}

void place_shard(const TensorShard& shard, TensorPlace place, const float* in, float* whole) {
  for_each_shard_run(shard, place, [&](int64_t at_whole, int64_t at_shard, int64_t n) {
    std::copy(in + at_shard, in + at_shard + n, whole + at_whole);
  });
}

std::string tensor_parallel_problem(const ModelConfig& m, int tensor) {
  if (tensor <= 1) return "";
  auto divides = [&](int64_t n, const std::string& what) {
    return n % tensor == 0 ? std::string()
                           : "expected a divisor of the model's " + what + " (" + std::to_string(n) + ")";
  };
  bool dense_mlp = false;  // (a mixture of experts in every block has no dense MLP to split)
  for (int l = 0; l < m.n_layer; ++l) dense_mlp = dense_mlp || !m.moe_block(l);
  for (const std::string& why :
       {divides(m.n_head, "attention heads, model.n_head"), divides(m.n_kv_head, "key/value heads, model.n_kv_head"),
        dense_mlp ? divides(m.ffn_hidden, "MLP hidden units") : std::string(),
        m.moe() ? divides(m.moe_hidden, "experts' hidden units, model.moe_hidden") : std::string(),
        divides(m.padded_vocab_size, "padded vocabulary, model.vocab_size rounded up")}) {
    if (!why.empty()) return why;
  }
  return "";
}

void ModelLayout::append(const ModelLayout& part) {
  check(part.tensors.empty() || tensors.empty() || tensors.back().layer <= part.tensors.front().layer,
        "model layout: " + (part.tensors.empty() ? std::string() : part.tensors.front().name) +
            " appended out of layer order");
  tensors.insert(tensors.end(), part.tensors.begin(), part.tensors.end());
  shards.insert(shards.end(), part.shards.begin(), part.shards.end());
  tied.insert(tied.end(), part.tied.begin(), part.tied.end());
}

std::vector<bool> local_layers(const ModelConfig& config, std::span<const LayerRange> ranges) {
  const int L = config.n_layer + 2;
  if (ranges.empty()) return std::vector<bool>(L, true);
  std::vector<bool> local(L, false);
  for (const LayerRange& r : ranges) {
    check(r.first >= 0 && r.first <= r.last && r.last < L, "GPT: layer range [" + std::to_string(r.first) + ", " +
                                                               std::to_string(r.last) + "] outside the model's 0.." +
                                                               std::to_string(L - 1));
    for (int i = r.first; i <= r.last; ++i) {
      check(!local[i], "GPT: layer " + std::to_string(i) + " in two ranges");
      local[i] = true;
    }
  }
  return local;
}

ModelLayout model_layout(const ModelConfig& m, std::span<const LayerRange> ranges, TensorPlace place,
                         ExpertPlace experts) {
  const std::vector<bool> local = local_layers(m, ranges);
  const std::string problem = tensor_parallel_problem(m, place.size);
  check(problem.empty(), "config key 'parallel.tensor': " + problem + ", found " + std::to_string(place.size));
  check(experts.size == 1 || m.moe(), "config key 'parallel.expert': expected 1 without a mixture of experts, found " +
                                          std::to_string(experts.size));
  check(experts.size >= 1 && experts.rank >= 0 && experts.rank < experts.size && m.moe_experts % experts.size == 0,
        "config key 'parallel.expert': expected a divisor of the " + std::to_string(m.moe_experts) +
            " experts, found " + std::to_string(experts.size));
  const int L = m.n_layer + 2;
  const std::string& prefix = m.tensor_prefix;
  const int64_t C = m.n_embd, Vp = m.padded_vocab_size;
  ModelLayout out;
  out.place = place;
  // `split`: the dimension split over the tensor group (-1: replicated) and its blocks (empty: one).
  auto add = [&](const std::string& name, std::vector<int64_t> shape, int layer, ChunkKind kind, bool decay,
                 int split = -1, std::vector<int64_t> blocks = {}) {
    TensorShard shard{split, shape, std::move(blocks), {}, 0};
    if (split >= 0) {
      if (shard.blocks.empty()) shard.blocks = {shape[split]};
      shape[split] /= place.size;
    }
    out.tensors.push_back(TensorSpec{prefix + name, std::move(shape), m.layer_base + layer, kind, decay});
    out.shards.push_back(std::move(shard));
  };
  const int64_t KV = static_cast<int64_t>(m.n_kv_head) * m.head_size();
  // GPT-2's head is always tied to the token embedding; llama's when model.tie_embeddings says so.
  const bool tied = !m.llama() || m.tie_embeddings.value_or(false);
  if (tied) out.tied.push_back(TiedGroup{prefix + "wte", 0, {0, L - 1}});

  // layer 0: the token embedding (and GPT-2's position table)
  if (local[0]) {
    add("wte", {Vp, C}, 0, ChunkKind::embedding, true, 0);
    if (!m.llama()) add("wpe", {m.max_seq_len, C}, 0, ChunkKind::embedding, true);
  } else if (tied && local[L - 1]) {
    add("wte", {Vp, C}, 0, ChunkKind::embedding, true, 0);  // the head's replica (TiedGroup)
    out.tensors.back().replica = true;
  }
  // layers 1..n_layer: the blocks
  for (int l = 1; l <= m.n_layer; ++l) {
    if (!local[l]) continue;
    const std::string p = "h." + std::to_string(l - 1) + ".";
    if (m.llama()) {
      const int64_t H = m.ffn_hidden;
      add(p + "attn_norm.w", {C}, l, ChunkKind::norm, false);
      add(p + "attn.qkv.w", {m.qkv_dim(), C}, l, ChunkKind::attention, true, 0, {C, KV, KV});
      add(p + "attn.proj.w", {C, C}, l, ChunkKind::attention, true, 1);
      add(p + "mlp_norm.w", {C}, l, ChunkKind::norm, false);
      if (m.moe_block(l - 1)) {  // a mixture of experts (model/moe.h)
        // Over a tensor group the router is replicated; the shared experts and every routed expert
        // are split as the dense MLP is (gate_up column-parallel, proj row-parallel).
        const int64_t E = m.moe_experts, Hm = m.moe_hidden, S = static_cast<int64_t>(m.moe_shared_experts) * Hm;
        add(p + "moe.router.w", {E, C}, l, ChunkKind::ffn, true);
        if (S > 0) {
          add(p + "moe.shared_mlp.gate_up.w", {2 * S, C}, l, ChunkKind::ffn, true, 0, {S, S});
          add(p + "moe.shared_mlp.proj.w", {C, S}, l, ChunkKind::ffn, true, 1);
        }
        const int El = m.moe_experts / experts.size;
        for (int j = experts.rank * El; j < (experts.rank + 1) * El; ++j) {
          const std::string e = p + "moe.expert." + std::to_string(j) + ".";
          // Each continues its stack's stream (TensorShard::stream): expert j's part of it.
          add(e + "gate_up.w", {2 * Hm, C}, l, ChunkKind::ffn, true, 0, {Hm, Hm});
          out.shards.back().stream = prefix + p + "moe.experts_mlp.gate_up.w";
          out.shards.back().stream_first = j * 2 * Hm * C;
          out.tensors.back().expert = j;
          add(e + "proj.w", {C, Hm}, l, ChunkKind::ffn, true, 1);
          out.shards.back().stream = prefix + p + "moe.experts_mlp.proj.w";
          out.shards.back().stream_first = j * C * Hm;
          out.tensors.back().expert = j;
        }
        continue;
      }
      add(p + "mlp.gate_up.w", {2 * H, C}, l, ChunkKind::ffn, true, 0, {H, H});
      add(p + "mlp.proj.w", {C, H}, l, ChunkKind::ffn, true, 1);
    } else {
      add(p + "ln1.w", {C}, l, ChunkKind::norm, false);
      add(p + "ln1.b", {C}, l, ChunkKind::norm, false);
      add(p + "attn.qkv.w", {3 * C, C}, l, ChunkKind::attention, true, 0, {C, C, C});
      add(p + "attn.qkv.b", {3 * C}, l, ChunkKind::attention, false, 0, {C, C, C});
      add(p + "attn.proj.w", {C, C}, l, ChunkKind::attention, true, 1);
      add(p + "attn.proj.b", {C}, l, ChunkKind::attention, false);
      add(p + "ln2.w", {C}, l, ChunkKind::norm, false);
      add(p + "ln2.b", {C}, l, ChunkKind::norm, false);
      add(p + "mlp.fc.w", {4 * C, C}, l, ChunkKind::ffn, true, 0);
      add(p + "mlp.fc.b", {4 * C}, l, ChunkKind::ffn, false, 0);
      add(p + "mlp.proj.w", {C, 4 * C}, l, ChunkKind::ffn, true, 1);
      add(p + "mlp.proj.b", {C}, l, ChunkKind::ffn, false);
    }
  }
  // layer n_layer + 1: the final norm and (untied) the LM head
  if (local[L - 1]) {
    if (m.llama()) {
      add("norm.w", {C}, L - 1, ChunkKind::norm, false);
    } else {
      add("lnf.w", {C}, L - 1, ChunkKind::norm, false);
      add("lnf.b", {C}, L - 1, ChunkKind::norm, false);
    }
    if (!tied) add("lm_head.w", {Vp, C}, L - 1, ChunkKind::embedding, true, 0);
  }
  return out;
}

std::vector<TensorId> register_layout(ChunkStore& store, const ModelLayout& layout) {
  std::vector<TensorId> ids;
  ids.reserve(layout.tensors.size());
  for (const TensorSpec& spec : layout.tensors) ids.push_back(store.add(spec));
  return ids;
}

std::vector<TensorId> layer_tensors(const ModelLayout& layout, std::span<const TensorId> ids, int store_layer) {
  std::vector<TensorId> out;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (layout.tensors[i].layer == store_layer) out.push_back(ids[i]);
  }
  return out;
}

}  // namespace keel
