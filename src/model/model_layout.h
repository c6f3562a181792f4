// The layout of a model: every parameter tensor it has (name, shape, store layer, chunk kind,
// weight decay, replica flag) in the order the model registers them with its chunk store, as a
// pure function of the model's configuration and of the rank's place in the parallel layout (its
// pipeline layers, its tensor shard and its share of the routed experts). Nothing is allocated
// and no layer is built: checkpoints, stage migration, the partitioner, the simulator and the CLI
// learn the layout here, and the models register exactly these tensors, in this order (same
// order, same chunks: checkpoints and hashes follow).
//
// Each layer's tensors come in a fixed order, named by the enums below; a layer looks its tensors
// up by those indices among the ids of its own (LayerTensors), never by spelling a name or shape.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// Layers first..last (inclusive) of the model: one pipeline stage.
struct LayerRange {
  int first = 0, last = 0;
};

// Parameters shared by several layers: one tensor, whose chunks belong to `home` (the layer the
// store files it under), read and written by every layer in `layers`. A rank holding some of
// `layers` but not `home` keeps a replica (TensorSpec::replica) of the same name and initial
// values; whoever splits the model (a pipeline) sums the copies' gradients over the ranks that
// hold one, hints and leases `home`'s chunks beside the layers that use them, and holds back
// `home`'s gradient sync until the sum is done.
struct TiedGroup {
  std::string tensor;
  int home = 0;
  std::vector<int> layers;
};

// This rank's place in its tensor group (parallel.tensor): shard `rank` of `size` of every split
// tensor. {0, 1}: the whole model.
struct TensorPlace {
  int rank = 0, size = 1;
};

// This rank's place in its expert group (parallel.expert): of every mixture-of-experts block's E
// routed experts it holds experts rank E / size .. (rank + 1) E / size - 1. {0, 1}: every expert.
struct ExpertPlace {
  int rank = 0, size = 1;
};

// How one tensor of the layout is split over the tensor group: along dimension `dim` (-1:
// replicated, every rank holds it whole), whose whole extent is the sum of `blocks`, each block
// split evenly in rank order (a fused qkv: q, k and v rows each split, so a rank's shard holds the
// q, k and v rows of its own heads, in that order). `whole_shape`: the whole model's shape.
//
// `stream`, `stream_first`: where the tensor's initial values come from (GPT::init_weights): the
// normal stream seeded by the name `stream` (empty: the tensor's own name), from its element
// `stream_first` on. A routed expert's matrix continues the stream of the stack of all E experts'
// matrices of its kind ([E, 2 Hm, C] gate_up, [E, C, Hm] proj), expert j from element j x its
// size: the values do not depend on how the experts are dealt out.
struct TensorShard {
  int dim = -1;
  std::vector<int64_t> whole_shape;
  std::vector<int64_t> blocks;
  std::string stream;
  int64_t stream_first = 0;
  bool split() const { return dim >= 0; }
};

// Copies between a whole tensor and shard `place` of it (TensorShard's order): slice_shard reads
// the shard out of `whole`; place_shard writes it into its place in `whole`. A replicated tensor
// is copied whole.
void slice_shard(const TensorShard& shard, TensorPlace place, const float* whole, float* out);
void place_shard(const TensorShard& shard, TensorPlace place, const float* in, float* whole);

struct ModelLayout {
  // In registration order (store layers non-decreasing). Layer ids are the store's (the model's
  // layer index plus ModelConfig::layer_base). A tensor-parallel rank's shapes are its shard's.
  std::vector<TensorSpec> tensors;
  std::vector<TensorShard> shards;  // per tensor: how it is split over the tensor group
  TensorPlace place;
  std::vector<TiedGroup> tied;
  // Index in `tensors` of the tensor named `name`; throws keel::Error naming it when absent.
  int index(const std::string& name) const;
  // Appends `part` (whose layers must not precede this layout's last).
  void append(const ModelLayout& part);
};

// Tensor order within each decoder layer (model_layout and the layers that read it agree here).
namespace layout {
enum Embedding : int { wte, wpe };  // wpe: GPT-2 only
enum Gpt2Block : int { ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc_proj_w, fc_proj_b };
enum LlamaBlock : int { attn_norm_w, llama_qkv_w, llama_proj_w, mlp_norm_w, gate_up_w, down_w };
// A llama block that is a mixture of experts (ModelConfig::moe_block): the same first four, then
// the router [E, C], with shared experts their fused gate_up [2 S Hm, C] and proj [C, S Hm], then
// each of the rank's routed experts j (ExpertPlace; all E without one) in expert order: its gate_up
// [2 Hm, C] and proj [C, Hm], named moe.expert.j.gate_up.w and moe.expert.j.proj.w, each
// TensorSpec::expert = j (chunks of their own). Over a tensor group the router is replicated and
// the shared and routed experts split as the dense MLP (gate_up by its gate and up rows, proj by
// columns: a rank holds Hm / T of every expert's units).
enum MoeBlock : int { moe_router_w = mlp_norm_w + 1, shared_gate_up_w, shared_down_w };
enum MoeExpert : int { expert_gate_up_w, expert_down_w, expert_tensors };
// The index of local expert `e`'s tensor `t` among a MoE block's tensors (`shared`: the block has
// shared experts).
inline int moe_expert_tensor(bool shared, int e, MoeExpert t) {
  return (shared ? shared_down_w : moe_router_w) + 1 + e * expert_tensors + t;
}
// The head: GPT-2 norm_w, norm_b; llama norm_w, then lm_head_w unless tied (the tied head reads
// wte: the embedding's, or on a rank without the embedding a replica registered just before).
enum Head : int { norm_w, norm_b, lm_head_w = 1 };  // lm_head_w: llama's untied head, after norm_w
}  // namespace layout

// The decoder (either family) over the layers in `ranges` (empty: the whole model, layers
// 0..n_layer+1): the embedding, the blocks, the head, each when its layer is in a range; a rank
// with the head but not the embedding of a tied model holds the wte replica (TiedGroup), filed
// under the embedding's layer. Ranges are checked (inside the model, no layer twice): one line.
// `place`: the tensor shard (Megatron's layout): column-parallel qkv, fc and gate_up (rows split:
// heads, hidden units), row-parallel attention and MLP output projections (columns split), the
// token embedding and LM head split by vocabulary rows; norms, the position table and the biases
// of row-parallel products replicated. A size that does not divide is refused in one line.
// `experts`: the rank's routed experts of each MoE block (the others are not in its layout; the
// size must divide model.moe_experts: one line).
ModelLayout model_layout(const ModelConfig& config, std::span<const LayerRange> ranges = {}, TensorPlace place = {},
                         ExpertPlace experts = {});
// Why `config`'s model cannot be split over `tensor` ranks ("" when it can): heads, key/value
// heads, MLP hidden units (of a dense MLP, and of each expert: model.moe_hidden) and the padded
// vocabulary must divide evenly.
std::string tensor_parallel_problem(const ModelConfig& config, int tensor);
// Which of the decoder's layers `ranges` hold (empty: all), checked as model_layout checks them.
std::vector<bool> local_layers(const ModelConfig& config, std::span<const LayerRange> ranges);

// Registers `layout`'s tensors with `store` (not finalized), in order. Returns their ids (one per
// layout tensor). A layout-only store: register_layout(store, layout); store.finalize_layout():
// nothing allocated, its tensors() and chunks() say where each tensor lands (offset, chunks,
// segments) for that store's chunk size, as the model's own store lays it out.
std::vector<TensorId> register_layout(ChunkStore& store, const ModelLayout& layout);

// The ids of one layer's tensors, in layout order, from the ids register_layout returned.
std::vector<TensorId> layer_tensors(const ModelLayout& layout, std::span<const TensorId> ids, int store_layer);

}  // namespace keel
