// Token shards in llm.c's .bin format, so shards from llm.c's data scripts work unchanged:
// a header of 256 little-endian int32 ([0] magic 20240520, [1] version 1, [2] token count,
// the rest zero), then that many little-endian uint16 tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

// Writes tokens to path as an llm.c shard. Atomic: the bytes go to path.tmp, are fsynced and
// renamed over path, so path is always either absent, the old shard or the complete new one.
// Requires tokens.size() < 2^31 (the header's count is an int32). Errors name path.
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);

// Reads and validates a shard. A missing file, a short header, a wrong magic or version, or a
// token count that does not match the file size (truncated or trailing bytes) gives a
// keel::Error like "shard data/x.bin: expected magic 20240520, found 12345". If max_token >= 0,
// a token above max_token is an error naming its position and value.
std::vector<uint16_t> read_token_shard(const std::string& path, int max_token = -1);

}  // namespace keel
