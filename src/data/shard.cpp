#include "data/shard.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {
namespace {

// The format is little-endian; the raw memcpy/fread below rely on the host being so too.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

constexpr int32_t kShardMagic = 20240520;  // uint16 tokens
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShard32Magic = 20240801;  // uint32 tokens
constexpr int32_t kShard32Version = 7;
constexpr size_t kHeaderInts = 256;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

template <typename Token>
void write_shard(const std::string& path, const std::vector<Token>& tokens) {
  check(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
        "shard " + path + ": expected at most 2147483647 tokens, found " + std::to_string(tokens.size()));
  int32_t header[kHeaderInts] = {};
  header[0] = sizeof(Token) == 2 ? kShardMagic : kShard32Magic;
  header[1] = sizeof(Token) == 2 ? kShardVersion : kShard32Version;
  header[2] = static_cast<int32_t>(tokens.size());
  write_file_atomic(path, {ByteRange{header, kHeaderBytes}, ByteRange{tokens.data(), tokens.size() * sizeof(Token)}});
}

// Reads a shard whose tokens are `Token` wide (16 or 32 bits as its header says; a uint16 shard
// widened when Token is uint32_t).
template <typename Token>
std::vector<Token> read_shard(const std::string& path, int max_token) {
  const std::string where = "shard " + path;
  std::error_code ec;
  check(std::filesystem::exists(std::filesystem::status(path, ec)), where + ": expected a file, found none");
  uint64_t size = 0;
  const FileStream in = open_regular_stream(path, "shard", &size);
  const uintmax_t file_bytes = size;
  check(file_bytes >= kHeaderBytes, where + ": expected a " + std::to_string(kHeaderBytes) + "-byte header, found a " +
                                        std::to_string(file_bytes) + "-byte file");
  int32_t header[kHeaderInts];
  check(std::fread(header, 1, kHeaderBytes, in.get()) == kHeaderBytes, where + ": cannot read its header");
  const bool wide = header[0] == kShard32Magic;
  if (sizeof(Token) == 2) {
    check(!wide, where + ": holds uint32 tokens (magic " + std::to_string(kShard32Magic) + "), expected uint16 (magic " +
                     std::to_string(kShardMagic) + ")");
    check(header[0] == kShardMagic,
          where + ": expected magic " + std::to_string(kShardMagic) + ", found " + std::to_string(header[0]));
  } else {
    check(wide || header[0] == kShardMagic, where + ": expected magic " + std::to_string(kShardMagic) + " (uint16 tokens) or " +
                                                std::to_string(kShard32Magic) + " (uint32), found " +
                                                std::to_string(header[0]));
  }
  const int32_t version = wide ? kShard32Version : kShardVersion;
  check(header[1] == version, where + ": expected version " + std::to_string(version) + ", found " + std::to_string(header[1]));
  const int32_t count = header[2];
  check(count >= 0, where + ": expected a non-negative token count, found " + std::to_string(count));
  const size_t token_bytes = wide ? 4 : 2;
  const uintmax_t expected_bytes = kHeaderBytes + static_cast<uintmax_t>(count) * token_bytes;
  check(file_bytes == expected_bytes, where + ": header says " + std::to_string(count) + " tokens, so expected " +
                                          std::to_string(expected_bytes) + " bytes, found " +
                                          std::to_string(file_bytes) +
                                          (file_bytes < expected_bytes ? " (truncated)" : " (trailing bytes)"));

  std::vector<Token> tokens(static_cast<size_t>(count));
  if (wide || sizeof(Token) == 2) {
    check(std::fread(tokens.data(), sizeof(Token), tokens.size(), in.get()) == tokens.size(),
          where + ": cannot read its " + std::to_string(count) + " tokens");
  } else {
    std::vector<uint16_t> narrow(tokens.size());
    check(std::fread(narrow.data(), sizeof(uint16_t), narrow.size(), in.get()) == narrow.size(),
          where + ": cannot read its " + std::to_string(count) + " tokens");
    std::copy(narrow.begin(), narrow.end(), tokens.begin());
  }
  if (max_token >= 0) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] > static_cast<uint32_t>(max_token))
        throw Error(where + ": expected tokens at most " + std::to_string(max_token) + ", found " +
                    std::to_string(tokens[i]) + " at position " + std::to_string(i));
    }
  }
  return tokens;
}

}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) { write_shard(path, tokens); }

void write_token_shard32(const std::string& path, const std::vector<uint32_t>& tokens) { write_shard(path, tokens); }

void write_tokens(const std::string& path, const std::vector<uint32_t>& tokens, int vocab_size) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= static_cast<uint32_t>(vocab_size))
      throw Error("shard " + path + ": token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                  " is outside the vocabulary of " + std::to_string(vocab_size));
  }
  if (vocab_size > 65536) return write_shard(path, tokens);
  write_shard(path, std::vector<uint16_t>(tokens.begin(), tokens.end()));
}

std::vector<uint32_t> read_tokens(const std::string& path, int max_token) { return read_shard<uint32_t>(path, max_token); }

std::vector<uint16_t> read_token_shard(const std::string& path, int max_token) {
  return read_shard<uint16_t>(path, max_token);
}

}  // namespace keel
