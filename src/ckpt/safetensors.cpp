#include "ckpt/safetensors.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

static_assert(std::endian::native == std::endian::little, "safetensors files are little-endian, as this host must be");

using nlohmann::json;

// The format's own limit on the header (a larger one is refused before it is parsed).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Every dtype of the format and its element size in bytes.
int dtype_bytes(const std::string& dtype) {
  static const std::pair<const char*, int> kDtypes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  for (const auto& [name, bytes] : kDtypes) {
    if (dtype == name) return bytes;
  }
  return 0;
}

std::string clipped(const json& j) {
  std::string s = j.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

SafetensorsTensor parse_tensor(const std::string& name, const json& t, uint64_t data_bytes, const std::string& where) {
  const std::string at = where + ": tensor \"" + name + "\"";
  check(t.is_object(), at + ": expected an object {dtype, shape, data_offsets}, found " + clipped(t));
  for (const auto& [key, value] : t.items()) {
    check(key == "dtype" || key == "shape" || key == "data_offsets",
          at + ": unexpected field \"" + key + "\" (expected dtype, shape, data_offsets)");
  }
  SafetensorsTensor out;
  out.name = name;
  check(t.contains("dtype") && t["dtype"].is_string(), at + ": field dtype: expected a string, found " +
                                                          (t.contains("dtype") ? clipped(t["dtype"]) : "none"));
  out.dtype = t["dtype"].get<std::string>();
  out.element_bytes = dtype_bytes(out.dtype);
  check(out.element_bytes > 0, at + ": field dtype: expected one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, "
                                    "BF16, I32, U32, F32, F64, I64, U64, found \"" + out.dtype + "\"");
  check(t.contains("shape") && t["shape"].is_array(),
        at + ": field shape: expected an array, found " + (t.contains("shape") ? clipped(t["shape"]) : "none"));
  // The element count stays below 2^62 bytes' worth, so no product below overflows.
  uint64_t numel = 1;
  for (const json& d : t["shape"]) {
    check(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
          at + ": field shape: expected non-negative integers, found " + clipped(t["shape"]));
    const uint64_t n = d.get<uint64_t>();
    check(n == 0 || numel <= (uint64_t{1} << 62) / n, at + ": field shape: " + clipped(t["shape"]) + " is too large");
    numel *= n;
    out.shape.push_back(static_cast<int64_t>(n));
  }
  check(t.contains("data_offsets") && t["data_offsets"].is_array() && t["data_offsets"].size() == 2 &&
            t["data_offsets"][0].is_number_unsigned() && t["data_offsets"][1].is_number_unsigned(),
        at + ": field data_offsets: expected [begin, end] (non-negative integers), found " +
            (t.contains("data_offsets") ? clipped(t["data_offsets"]) : "none"));
  out.begin = t["data_offsets"][0].get<uint64_t>();
  out.end = t["data_offsets"][1].get<uint64_t>();
  check(out.begin <= out.end && out.end <= data_bytes,
        at + ": field data_offsets: expected 0 <= begin <= end <= " + std::to_string(data_bytes) +
            " (the data section's bytes), found [" + std::to_string(out.begin) + ", " + std::to_string(out.end) + "]");
  check(numel <= (uint64_t{1} << 62) / 8 && out.end - out.begin == numel * static_cast<uint64_t>(out.element_bytes),
        at + ": field data_offsets: expected " + std::to_string(numel) + " x " + std::to_string(out.element_bytes) +
            " bytes for shape " + clipped(t["shape"]) + " and dtype " + out.dtype + ", found " +
            std::to_string(out.end - out.begin));
  return out;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsTensor* SafetensorsHeader::find(const std::string& name) const {
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

SafetensorsHeader parse_safetensors(std::span<const char> file, const std::string& where) {
  check(file.size() >= 8, where + ": expected an 8-byte header length, found a " + std::to_string(file.size()) + "-byte file");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, file.data(), 8);
  check(header_bytes <= kMaxHeaderBytes && header_bytes <= file.size() - 8,
        where + ": header length " + std::to_string(header_bytes) + " exceeds the file's " +
            std::to_string(file.size() - 8) + " bytes after it" + (header_bytes > kMaxHeaderBytes ? " (or 100 MB)" : ""));
  const std::string_view text(file.data() + 8, header_bytes);
  check(!text.empty() && text[0] == '{', where + ": expected the header to begin with '{'");
  // A key given twice would let two entries claim one name; the parser keeps only the last.
  std::set<std::string> keys;
  std::string repeated;
  const json::parser_callback_t note_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && !keys.insert(parsed.get<std::string>()).second &&
        repeated.empty()) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), note_keys);
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw Error(where + ": header is not valid JSON: " + what);
  }
  check(j.is_object(), where + ": expected the header to be a JSON object, found " + std::string(j.type_name()));
  check(repeated.empty(), where + ": tensor \"" + repeated + "\" named twice in the header");
  SafetensorsHeader out;
  out.data_offset = 8 + header_bytes;
  const uint64_t data_bytes = file.size() - out.data_offset;
  for (const auto& [name, value] : j.items()) {
    if (name == "__metadata__") {
      check(value.is_object(), where + ": field __metadata__: expected an object of strings, found " + clipped(value));
      for (const auto& [key, v] : value.items()) {
        check(v.is_string(), where + ": field __metadata__." + key + ": expected a string, found " + clipped(v));
        out.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    out.tensors.push_back(parse_tensor(name, value, data_bytes, where));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const SafetensorsTensor& t : out.tensors) {
    check(t.begin >= covered, where + ": tensor \"" + t.name + "\": field data_offsets: begins at " +
                                  std::to_string(t.begin) + ", inside the tensor before it (which ends at " +
                                  std::to_string(covered) + "): overlapping tensors");
    check(t.begin == covered, where + ": tensor \"" + t.name + "\": field data_offsets: begins at " +
                                  std::to_string(t.begin) + ", leaving a gap after byte " + std::to_string(covered));
    covered = t.end;
  }
  check(covered == data_bytes, where + ": the tensors cover " + std::to_string(covered) + " bytes of the data section's " +
                                   std::to_string(data_bytes) + " (trailing bytes)");
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  uint64_t size = 0;
  const FileDescriptor fd = open_regular_file(path, "safetensors file", &size);
  check(size >= 8, "safetensors file " + path + ": expected an 8-byte header length, found a " + std::to_string(size) +
                       "-byte file");
  void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd.get(), 0);
  check(p != MAP_FAILED, "safetensors file " + path + ": cannot map it: " + std::strerror(errno));
  map_ = static_cast<const char*>(p);
  bytes_ = static_cast<size_t>(size);
  try {
    header_ = parse_safetensors({map_, bytes_}, "safetensors file " + path);
  } catch (...) {
    ::munmap(const_cast<char*>(map_), bytes_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { ::munmap(const_cast<char*>(map_), bytes_); }

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero and subnormals
  return sign ? -magnitude : magnitude;
}

float bfloat16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

std::vector<float> SafetensorsFile::read_float32(const SafetensorsTensor& t) const {
  const char* src = map_ + header_.data_offset + t.begin;
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (out.empty() && (t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16")) return out;  // (memcpy's null)
  if (t.dtype == "F32") {
    std::memcpy(out.data(), src, out.size() * sizeof(float));
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    const bool bf16 = t.dtype == "BF16";
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t bits = 0;
      std::memcpy(&bits, src + 2 * i, 2);
      out[i] = bf16 ? bfloat16_to_float(bits) : half_to_float(bits);
    }
  } else {
    throw Error("safetensors file " + path_ + ": tensor \"" + t.name + "\": field dtype: expected F32, BF16 or F16, found " +
                t.dtype);
  }
  return out;
}

std::span<const float> SafetensorsFile::float32_view(const SafetensorsTensor& t) const {
  const char* src = map_ + header_.data_offset + t.begin;
  if (t.dtype != "F32" || reinterpret_cast<uintptr_t>(src) % alignof(float) != 0 || t.numel() == 0) return {};
  return {reinterpret_cast<const float*>(src), static_cast<size_t>(t.numel())};
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  if (!fs::exists(index)) {
    check(fs::exists(single), "hf checkpoint " + dir + ": expected model.safetensors or model.safetensors.index.json, found neither");
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const SafetensorsTensor& t : files_.back()->header().tensors) entries_[t.name] = {files_.back().get(), &t};
    return;
  }
  json j;
  try {
    j = json::parse(read_text_file(index));
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw Error(index + ": not valid JSON: " + what);
  }
  check(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
        index + ": field weight_map: expected an object {tensor: file}, found " +
            (j.is_object() && j.contains("weight_map") ? clipped(j["weight_map"]) : "none"));
  std::map<std::string, SafetensorsFile*> opened;
  for (const auto& [name, file] : j["weight_map"].items()) {
    check(file.is_string(), index + ": field weight_map." + name + ": expected a file name, found " + clipped(file));
    const std::string shard = file.get<std::string>();
    check(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
          index + ": field weight_map." + name + ": expected a file name in " + dir + ", found \"" + shard + "\"");
    SafetensorsFile*& f = opened[shard];
    if (f == nullptr) {
      files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / shard).string()));
      f = files_.back().get();
    }
    const SafetensorsTensor* t = f->header().find(name);
    check(t != nullptr, index + ": field weight_map." + name + ": tensor not found in " + f->path());
    entries_[name] = {f, t};
  }
  // A tensor a shard holds but the index does not name is refused: which copy counts would be a guess.
  for (const auto& f : files_) {
    for (const SafetensorsTensor& t : f->header().tensors) {
      const auto it = entries_.find(t.name);
      check(it != entries_.end() && it->second.file == f.get(),
            f->path() + ": tensor \"" + t.name + "\" is not mapped to this file by " + index);
    }
  }
}

SafetensorsCheckpoint::Entry SafetensorsCheckpoint::find(const std::string& name) const {
  const auto it = entries_.find(name);
  return it == entries_.end() ? Entry{} : it->second;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<ByteRange> ranges(1 + 1 + tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsOut& t = tensors[i];
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    check(static_cast<size_t>(numel) == t.values.size(),
          "safetensors file " + path + ": tensor " + t.name + " has " + std::to_string(t.values.size()) +
              " values for its shape's " + std::to_string(numel));
    const uint64_t bytes = t.values.size_bytes();
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    ranges[2 + i] = ByteRange{t.values.data(), bytes};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const uint64_t header_bytes = text.size();
  ranges[0] = ByteRange{&header_bytes, 8};
  ranges[1] = ByteRange{text.data(), text.size()};
  write_file_atomic(path, std::span<const ByteRange>(ranges));
}

}  // namespace keel
