// The text tower of a dual encoder: Keel's transformer (either family, model/gpt.h) over the
// caption's tokens, then a pooling head: each caption's final hidden state at its last token
// (position lengths[b] - 1: with causal attention it has read the whole caption and nothing of the
// padding after it), the final norm (GPT-2: LayerNorm "lnf.w"/"lnf.b"; llama: RMSNorm "norm.w")
// and a projection without bias into the shared embedding ("proj.w" [D, C]). Tensor names carry
// the prefix "text." ("text.wte", "text.h.0.attn.qkv.w", ...), store layers start at layer_base:
// the embedding, the blocks, then the pooling head.
#pragma once

#include <memory>

#include "core/config.h"
#include "model/model_layout.h"
#include "model/tower.h"
#include "store/chunk_store.h"

namespace keel {

// `text` is a resolved model config; its prefix and layer base are set here. `precision`
// (runtime.precision): the arithmetic of every product of the tower; under bf16 the transformer
// also keeps its matrix products' activations in bf16.
std::unique_ptr<Tower> make_text_tower(const ModelConfig& text, int layer_base, int embed_dim, ChunkStore& store,
                                       MatmulPrecision precision);
// The tower's tensors (model/model_layout.h): the body's (model_layout over the embedding and the
// blocks, prefixed "text."), then the pooling head's.
ModelLayout text_tower_layout(const ModelConfig& text, int layer_base, int embed_dim);

}  // namespace keel
