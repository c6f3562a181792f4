// The llama family's layers (model.family = "llama"), built by GPT for the layers a rank holds.
// Layer 0 is GPT's embedding without a position table (RoPE rotates q and k instead). Layers 1..L: x_out =
// res2 + down(silu(gate(n2)) * up(n2)), n2 = rmsnorm(res2), res2 = x + o(attention(rope(qkv(
// rmsnorm(x))))) with n_kv_head key/value heads shared by groups of query heads; no biases.
// Layer L+1 (model/head.h, shared with GPT-2): final RMSNorm, the LM head (its own lm_head.w, or
// the tied wte), cross-entropy.
// Tensor names (the store's, the checkpoints' and the PyTorch reference's): wte; h.N.attn_norm.w,
// h.N.attn.qkv.w [C + 2 kv, C] (rows q | k | v), h.N.attn.proj.w [C, C], h.N.mlp_norm.w,
// h.N.mlp.gate_up.w [2H, C] (rows gate | up), h.N.mlp.proj.w [C, H]; norm.w, lm_head.w [Vp, C].
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "model/context_group.h"
#include "model/layer.h"
#include "model/tensor_group.h"
#include "store/chunk_store.h"

namespace keel {

// ids: the block's tensors in model_layout's order (layout::LlamaBlock). recompute: train.recompute
// for this block (model/layer.h Layer::recompute). tensor: the tensor group (null: unsplit): the
// block holds its shard (model_layout's place) and all-reduces over the group (model/tensor_group.h).
// context: the context group (null: none): the batch's rows are this rank's chunks, rotated at their
// global positions, and attention runs over the group's ring (model/context_attention.h).
std::unique_ptr<Layer> make_llama_block(const ModelConfig& m, ChunkStore& store, int layer,
                                        const std::vector<TensorId>& ids, bool bf16, MathMode math,
                                        Recompute recompute = Recompute::none, TensorGroup* tensor = nullptr,
                                        ContextGroup* context = nullptr);

}  // namespace keel
