// Model files of other projects: llm.c's GPT-2 (v3: header of 256 int32, fp32 parameters) and
// llama2.c's (run.c format: 7 int32, fp32 weights). The header is read and checked; a small enough
// model is imported into a chunk store (sizes and finiteness checked).
#include <string>

#include "ckpt/llama2c.h"
#include "ckpt/llmc.h"
#include "core/error.h"
#include "fuzz_util.h"
#include "model/gpt.h"
#include "store/chunk_store.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write_input("model.bin", data, size);
  try {
    const keel::ModelConfig m = keel::read_llmc_model_config(path);
    // Importing builds the model: only for sizes a fuzzing run can afford.
    if (m.n_layer > 4 || m.n_embd > 64 || m.padded_vocab_size > 1024 || m.max_seq_len > 128) return 0;
    keel::validate_model(m, "fuzz");
    keel::ChunkStore store(4096);
    keel::GPT model(m, store);
    store.finalize();
    keel::import_llmc(path, store, m);
  } catch (const keel::Error&) {
  }
  try {
    const keel::ModelConfig m = keel::read_llama2c_model_config(path);
    if (m.n_layer > 4 || m.n_embd > 64 || m.ffn_hidden > 256 || m.padded_vocab_size > 1024 || m.max_seq_len > 128) {
      return 0;
    }
    keel::ChunkStore store(4096);
    keel::GPT model(m, store);
    store.finalize();
    keel::import_llama2c(path, store, m);
  } catch (const keel::Error&) {
  }
  return 0;
}
