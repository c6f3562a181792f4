// safetensors files (Hugging Face checkpoints): the header is parsed and validated (length, JSON,
// dtypes, shapes, offsets, coverage); a file that passes is opened memory-mapped and each of its
// float tensors read as float32.
#include <cstdint>
#include <string>

#include "ckpt/safetensors.h"
#include "core/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const keel::SafetensorsHeader h = keel::parse_safetensors({reinterpret_cast<const char*>(data), size}, "fuzz");
    // What validation promises: every tensor inside the data section, its bytes its shape's.
    for (const keel::SafetensorsTensor& t : h.tensors) {
      if (t.end > size - h.data_offset || t.end - t.begin != static_cast<uint64_t>(t.numel()) * t.element_bytes) {
        __builtin_trap();
      }
    }
  } catch (const keel::Error&) {
    return 0;
  }
  const std::string path = keel::fuzz::write_input("model.safetensors", data, size);
  try {
    const keel::SafetensorsFile f(path);
    for (const keel::SafetensorsTensor& t : f.header().tensors) {
      if (t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16") f.read_float32(t);
    }
  } catch (const keel::Error&) {
  }
  return 0;
}
