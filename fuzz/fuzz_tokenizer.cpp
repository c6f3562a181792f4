// Tokenizer files: Keel's JSON BPE, llm.c's binary gpt2_tokenizer.bin and llama2.c's tokenizer.bin.
// A tokenizer that loads must decode every id it has and, when it can encode, encode text: a BPE
// one to ids that decode back to it (llama2.c's scored encoding adds a space and is not lossless).
#include <string>

#include "core/error.h"
#include "data/tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write_input("tokenizer", data, size);
  try {
    const keel::Tokenizer tok = keel::Tokenizer::load(path);
    for (int id = 0; id < tok.vocab_size() && id < 4096; ++id) (void)tok.decode_token(id);
    if (tok.can_encode()) {
      const std::string text = "Hello, world! 123 \xc3\xa9t\xc3\xa9 \n\n  spaces";
      const std::vector<int> ids = tok.encode(text);
      if (!tok.scored() && tok.decode(ids) != text) __builtin_trap();  // byte-level BPE is lossless
    }
  } catch (const keel::Error&) {
  }
  return 0;
}
