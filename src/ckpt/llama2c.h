// llama2.c's model file (its run.c format, "version 0"), so llama models move between llama2.c and
// Keel: a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
// vocab_size < 0 when the classifier is not shared with the token embedding), then fp32 weights:
// token_embedding [V, dim], rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim],
// wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim], w1 [L, hidden, dim], w2 [L, dim, hidden],
// w3 [L, hidden, dim], rms_final [dim], the RoPE table (cos then sin, [seq_len, head_size / 2] each,
// which run.c skips), and wcls [V, dim] when not shared. RoPE's base is fixed at 10000.
// Keel's fused tensors map onto it: attn.qkv.w = wq | wk | wv (rows), mlp.gate_up.w = w1 | w3.
#pragma once

#include <string>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// Reads and validates the header of a llama2.c model file (sizes, and the file's length against
// them). The model section it describes (family llama, theta 10000).
ModelConfig read_llama2c_model_config(const std::string& path);
// Copies a llama2.c model's weights into a store built for read_llama2c_model_config(path).
void import_llama2c(const std::string& path, ChunkStore& store, const ModelConfig& model);
// Writes the store's parameters as a llama2.c model file (atomically: path.tmp then rename).
void export_llama2c(const std::string& path, const ChunkStore& store, const ModelConfig& model);

}  // namespace keel
