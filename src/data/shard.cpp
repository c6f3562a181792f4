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

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr size_t kHeaderInts = 256;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

}  // namespace

void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  check(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
        "shard " + path + ": expected at most 2147483647 tokens, found " + std::to_string(tokens.size()));
  int32_t header[kHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  write_file_atomic(path, {ByteRange{header, kHeaderBytes}, ByteRange{tokens.data(), tokens.size() * sizeof(uint16_t)}});
}

std::vector<uint16_t> read_token_shard(const std::string& path, int max_token) {
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
  check(header[0] == kShardMagic,
        where + ": expected magic " + std::to_string(kShardMagic) + ", found " + std::to_string(header[0]));
  check(header[1] == kShardVersion,
        where + ": expected version " + std::to_string(kShardVersion) + ", found " + std::to_string(header[1]));
  const int32_t count = header[2];
  check(count >= 0, where + ": expected a non-negative token count, found " + std::to_string(count));
  const uintmax_t expected_bytes = kHeaderBytes + static_cast<uintmax_t>(count) * sizeof(uint16_t);
  check(file_bytes == expected_bytes, where + ": header says " + std::to_string(count) + " tokens, so expected " +
                                          std::to_string(expected_bytes) + " bytes, found " +
                                          std::to_string(file_bytes) +
                                          (file_bytes < expected_bytes ? " (truncated)" : " (trailing bytes)"));

  std::vector<uint16_t> tokens(static_cast<size_t>(count));
  check(std::fread(tokens.data(), sizeof(uint16_t), tokens.size(), in.get()) == tokens.size(),
        where + ": cannot read its " + std::to_string(count) + " tokens");
  if (max_token >= 0) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] > max_token)
        throw Error(where + ": expected tokens at most " + std::to_string(max_token) + ", found " +
                    std::to_string(tokens[i]) + " at position " + std::to_string(i));
    }
  }
  return tokens;
}

}  // namespace keel
