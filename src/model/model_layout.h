// The layout of a model: every parameter tensor it has (name, shape, store layer, chunk kind,
// weight decay, replica flag) in the order the model registers them with its chunk store, as a
// pure function of the model's configuration and of the rank's place in the parallel layout (its
// pipeline layers now; a tensor or expert shard is a further argument of the same function when
// those arrive). Nothing is allocated and no layer is built: checkpoints, stage migration, the
// partitioner, the simulator and the CLI learn the layout here, and the models register exactly
// these tensors, in this order (same order, same chunks: checkpoints and hashes follow).
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

struct ModelLayout {
  // In registration order (store layers non-decreasing). Layer ids are the store's (the model's
  // layer index plus ModelConfig::layer_base).
  std::vector<TensorSpec> tensors;
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
// The head: GPT-2 norm_w, norm_b; llama norm_w, then lm_head_w unless tied (the tied head reads
// wte: the embedding's, or on a rank without the embedding a replica registered just before).
enum Head : int { norm_w, norm_b, lm_head_w = 1 };  // lm_head_w: llama's untied head, after norm_w
}  // namespace layout

// The decoder (either family) over the layers in `ranges` (empty: the whole model, layers
// 0..n_layer+1): the embedding, the blocks, the head, each when its layer is in a range; a rank
// with the head but not the embedding of a tied model holds the wte replica (TiedGroup), filed
// under the embedding's layer. Ranges are checked (inside the model, no layer twice): one line.
ModelLayout model_layout(const ModelConfig& config, std::span<const LayerRange> ranges = {});
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
