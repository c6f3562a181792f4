// The last layer of both families: the final norm (GPT-2: LayerNorm with a bias, "lnf.w",
// "lnf.b"; llama: RMSNorm, "norm.w"), the LM head (the token embedding wte when tied — always for
// GPT-2 — else llama's own "lm_head.w" [Vp, C]) and cross-entropy.
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "model/layer.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

// ids: the head layer's tensors in model_layout's order (layout::Head). tied_wte >= 0: the head
// reads the token embedding (layer 0's, or a replica); else lm_head.w. bf16: the normalised input
// of the LM head is kept in bf16 (model/layer_util.h Stash). math: the precision of its products
// (the LM head's and its input gradient's). tensor: the tensor group (null: unsplit): the head
// holds its rows of the vocabulary (the tied embedding's shard is the head's), its logits are
// those rows', and the loss is the vocabulary-parallel cross-entropy (model/tensor_group.h).
std::unique_ptr<Layer> make_head(const ModelConfig& m, ChunkStore& store, int layer, const std::vector<TensorId>& ids,
                                 TensorId tied_wte, bool bf16, MathMode math, TensorGroup* tensor = nullptr);

}  // namespace keel
