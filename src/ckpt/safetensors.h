// The safetensors format (Hugging Face's checkpoint files), so models move between Keel and the
// tools people evaluate and serve with: an 8-byte little-endian header length N, N bytes of JSON
// ({"__metadata__": {string: string}, NAME: {"dtype": D, "shape": [...], "data_offsets": [b, e]}}),
// then the data, where each tensor's bytes are [b, e) counted from the end of the header. The data
// is covered exactly: sorted by offset, each tensor begins where the previous ended, the last ends
// at the end of the file, and e - b is the tensor's element count times its dtype's size.
//
// A directory checkpoint is `model.safetensors`, or shards named by `model.safetensors.index.json`
// ({"metadata": {...}, "weight_map": {NAME: FILE}}). Keel reads F32, BF16 and F16 tensors as
// float32 and writes F32.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", ... (every dtype of the format is recognised)
  int element_bytes = 0;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // [begin, end) in the data section
  int64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // in offset order
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data section begins in the file (8 + N)
  // The tensor named `name`, or nullptr.
  const SafetensorsTensor* find(const std::string& name) const;
};

// Parses and validates a whole file's bytes (its size is file.size()): the header length, the JSON,
// every tensor's dtype, shape and offsets, and the coverage rules above. Any violation is a
// keel::Error of one line naming `where`, the tensor and the field.
SafetensorsHeader parse_safetensors(std::span<const char> file, const std::string& where);

// One safetensors file, memory-mapped read-only and validated when opened.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The tensor's values as float32 (F32 copied, BF16 and F16 widened exactly). Other dtypes are
  // refused in one line naming the file, the tensor and its dtype.
  std::vector<float> read_float32(const SafetensorsTensor& tensor) const;
  // The tensor's float32 values in place in the mapping (no copy) when it is F32 and 4-byte
  // aligned there; else empty (read_float32 then). Valid while the file lives.
  std::span<const float> float32_view(const SafetensorsTensor& tensor) const;

 private:
  std::string path_;
  const char* map_ = nullptr;
  size_t bytes_ = 0;
  SafetensorsHeader header_;
};

// A checkpoint directory's tensors: DIR/model.safetensors, or the shards DIR's
// model.safetensors.index.json names (each file validated; every weight_map entry present in its
// file; no tensor in two shards).
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& dir);
  // The tensor named `name` and the file holding it; nullptr when no file has it.
  struct Entry {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  Entry find(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> entries_;
};

// One float32 tensor to write.
struct SafetensorsOut {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> values;  // numel(shape) floats
};
// Writes `tensors` (in this order) as one F32 safetensors file, atomically (path.tmp, then a rename).
void write_safetensors(const std::string& path, const std::vector<SafetensorsOut>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// float16 and bfloat16 bit patterns widened to float32 (exactly: every value, subnormals, infinities, NaN).
float half_to_float(uint16_t bits);
float bfloat16_to_float(uint16_t bits);

}  // namespace keel
