// Token shards in llm.c's .bin format, so shards from llm.c's data scripts work unchanged: a
// header of 256 little-endian int32 ([0] magic, [1] version, [2] token count, the rest zero), then
// that many little-endian tokens: uint16 (magic 20240520, version 1: GPT-2's shards) or, for
// vocabularies above 65,536, uint32 (magic 20240801, version 7: llm.c's Llama 3 shards).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

// Writes tokens to path as a uint16 shard. Atomic: the bytes go to path.tmp, are fsynced and
// renamed over path, so path is always either absent, the old shard or the complete new one.
// Requires tokens.size() < 2^31 (the header's count is an int32). Errors name path.
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// The same as a uint32 shard.
void write_token_shard32(const std::string& path, const std::vector<uint32_t>& tokens);
// The narrowest shard for a vocabulary: uint16 up to 65,536 tokens, else uint32. Every token must
// be below vocab_size.
void write_tokens(const std::string& path, const std::vector<uint32_t>& tokens, int vocab_size);

// Reads and validates a shard of either width. A missing file, a short header, a wrong magic or
// version, or a token count that does not match the file size (truncated or trailing bytes) gives a
// keel::Error like "shard data/x.bin: expected magic 20240520 or 20240801, found 12345". If
// max_token >= 0, a token above max_token is an error naming its position and value.
std::vector<uint32_t> read_tokens(const std::string& path, int max_token = -1);
// A uint16 shard only (a uint32 one is refused in one line naming its magic).
std::vector<uint16_t> read_token_shard(const std::string& path, int max_token = -1);

}  // namespace keel
