// llm.c's GPT-2 checkpoint format, so models move between llm.c and Keel: a header of 256 int32
// (magic 20240326, version 3, max_seq_len, vocab_size, n_layer, n_head, n_embd,
// padded_vocab_size) followed by fp32 parameters in llm.c's order: wte, wpe, then each
// per-layer tensor stacked over all layers (ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w,
// ln2b, fcw, fcb, fcprojw, fcprojb), then lnfw, lnfb.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

inline constexpr int kLlmcModelMagic = 20240326;
inline constexpr int kLlmcModelVersion = 3;

// Keel tensor names in llm.c file order (per-layer tensors stacked over layers: all ln1.w, then all ln1.b, ...).
std::vector<std::string> llmc_tensor_order(const ModelConfig& model);
// Reads and validates the header of an llm.c checkpoint (magic, version, sizes, file length).
ModelConfig read_llmc_model_config(const std::string& path);
// Copies the parameters of an llm.c checkpoint into a store built for read_llmc_model_config(path).
void import_llmc(const std::string& path, ChunkStore& store, const ModelConfig& model);
// Writes the store's parameters as an llm.c checkpoint (atomically: path.tmp then rename).
void export_llmc(const std::string& path, const ChunkStore& store, const ModelConfig& model);

}  // namespace keel
