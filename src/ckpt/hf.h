// Hugging Face checkpoint directories (config.json + model.safetensors, or shards with
// model.safetensors.index.json), so models move between Keel and transformers:
//   - GPT2LMHeadModel: transformer.{wte,wpe}.weight, transformer.h.L.{ln_1,attn.c_attn,attn.c_proj,
//     ln_2,mlp.c_fc,mlp.c_proj}.{weight,bias}, transformer.ln_f.{weight,bias}; the head is wte. The
//     attention and MLP weights are Conv1D's [in, out], the transpose of Keel's [out, in].
//   - LlamaForCausalLM: model.embed_tokens.weight, model.layers.L.{input_layernorm,
//     self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight,
//     model.norm.weight, lm_head.weight (absent when tie_word_embeddings). Keel's fused tensors are
//     attn.qkv.w = q | k | v and mlp.gate_up.w = gate | up (rows). Keel rotates adjacent pairs of a
//     head's query and key features (llama2.c's and Meta's order); HF rotates feature i with
//     i + head_size / 2, so its q_proj and k_proj rows are that permutation of Keel's: Keel row
//     h * hs + 2i + p is HF row h * hs + p * hs / 2 + i (p = 0, 1; i < hs / 2).
// Keel's RMSNorm and LayerNorm use eps 1e-5 and GPT-2's GELU is the tanh form: config.json must say so.
// Rope scaling: rope_parameters (transformers 5) or rope_scaling of type "linear" or "llama3" is
// Keel's model.rope_scaling of that name (ModelConfig::rope_frequencies), written back on export.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// The model section DIR/config.json describes (architecture, sizes, rotary base, tie), validated;
// a field Keel cannot represent, or an unsupported architecture, is one line naming config.json and
// the field. Imports keep the position table's length (max_position_embeddings, n_positions).
ModelConfig read_hf_model_config(const std::string& dir);

// The tokens that end a generated text, as transformers' generate() finds them: eos_token_id (an
// id or a list) of DIR/generation_config.json, else of DIR/config.json, else the id in
// DIR/tokenizer.json of DIR/tokenizer_config.json's eos_token; empty when none names one.
std::vector<int> read_hf_eos_tokens(const std::string& dir);

// The same as generate.stop_tokens's text: "2", "128001,128009", "" for none.
std::string stop_tokens_text(const std::vector<int>& ids);

// train.init = "hf:DIR": fills `model`'s unset shape keys (family, sizes, heads, rotary base, tie)
// from `hf` (read_hf_model_config(DIR)); a key the config sets to another value is refused in one
// line naming it and DIR.
void take_hf_model_shape(ModelConfig& model, const ModelConfig& hf, const std::string& dir);

// Copies DIR's weights into `store`, built for `model` (whose shapes read_hf_model_config(DIR)
// gave, or which agree with it): every tensor `store` holds is filled (a pipeline stage holds some),
// each HF tensor's shape checked against config.json, its values finite, F32 / BF16 / F16 read as
// float32. A tensor the architecture does not have is refused (its weights would be lost silently).
void import_hf(const std::string& dir, ChunkStore& store, const ModelConfig& model);

// transformers' default shard size for save_pretrained (decimal: 5 GB = 5e9 bytes).
inline constexpr uint64_t kDefaultHfMaxShardBytes = 5'000'000'000ull;

// Writes `store`'s weights (F32) and DIR/config.json in the layout above (DIR is created; each file
// written atomically): one DIR/model.safetensors when the tensors' bytes fit in `max_shard_bytes`,
// else shards DIR/model-0000i-of-0000N.safetensors of at most that many tensor bytes each (a tensor
// larger than the limit alone in its shard; tensors in export order, a new shard when the next one
// would overflow, as transformers cuts them) named by DIR/model.safetensors.index.json ({"metadata":
// {"total_size": bytes}, "weight_map": {tensor: file}}). The other form's file left by an earlier
// export (model.safetensors or the index) is removed, so the directory reads back as written.
// config.json's eos_token_id is `eos` (an id, a list, or null when empty).
void export_hf(const std::string& dir, const ChunkStore& store, const ModelConfig& model,
               uint64_t max_shard_bytes = kDefaultHfMaxShardBytes, const std::vector<int>& eos = {});

}  // namespace keel
