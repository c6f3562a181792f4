// Hugging Face tokenizer.json files: read and validated (model, added tokens, normalizer,
// pre-tokenizer patterns, decoder, post-processor); a file that passes encodes a few texts (invalid
// UTF-8 among them) and decodes what it gave.
#include <cstdint>
#include <string>

#include "core/error.h"
#include "data/hf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const keel::HfTokenizer t = keel::HfTokenizer::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const char* text : {"Hello, world! It's 42.", "\xff\xfe \xe2\x82 caf\xc3\xa9 \xf0\x9f\x98\x80", "  \n\t<s>x"}) {
      const std::vector<int> ids = t.encode(text);
      for (int id : ids) {
        if (id < 0 || id >= t.vocab_size()) __builtin_trap();  // an id outside the vocabulary got out
      }
      t.decode(ids);
    }
  } catch (const keel::Error&) {
  }
  return 0;
}
