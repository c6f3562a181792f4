// Token shards in llm.c's format (header of 256 int32, uint16 tokens).
#include <cstdint>

#include "core/error.h"
#include "data/shard.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write_input("shard.bin", data, size);
  for (int max_token : {-1, 255, 50256}) {
    try {
      const std::vector<uint16_t> tokens = keel::read_token_shard(path, max_token);
      for (uint16_t t : tokens) {
        if (max_token >= 0 && t > max_token) __builtin_trap();  // a token over the limit got through
      }
    } catch (const keel::Error&) {
    }
  }
  return 0;
}
