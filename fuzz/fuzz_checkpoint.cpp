// Checkpoint manifests and records. The input is one checkpoint directory: a little-endian
// uint32 length, that many bytes of manifest.json, and the rest as r0.bin. It is listed,
// described, verified and decoded; every failure must be a keel::Error naming the file. The
// whole input is also decoded as a rank's part (the bytes ranks send rank 0 at a checkpoint).
#include <cstring>
#include <filesystem>
#include <string>

#include "ckpt/checkpoint.h"
#include "ckpt/manifest.h"
#include "core/error.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)keel::decode_part(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const keel::Error&) {
  }
  if (size < 4) return 0;
  uint32_t manifest_size = 0;
  std::memcpy(&manifest_size, data, 4);
  if (manifest_size > size - 4) return 0;
  const std::string root = keel::fuzz::scratch() + "/ckpt";
  const std::string dir = root + "/step-00000001";
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  std::filesystem::create_directories(dir);
  keel::fuzz::write_input("ckpt/step-00000001/manifest.json", data + 4, manifest_size);
  keel::fuzz::write_input("ckpt/step-00000001/r0.bin", data + 4 + manifest_size, size - 4 - manifest_size);
  try {
    (void)keel::list_checkpoints(root);
    (void)keel::describe_checkpoint(dir);
  } catch (const keel::Error&) {
  }
  try {
    (void)keel::verify_checkpoint(dir);
  } catch (const keel::Error&) {
  }
  try {
    // Decoding allocates the manifest's numel floats: bounded, as a real loader's store is.
    const keel::Manifest m = keel::read_manifest(dir);
    if (m.numel >= 0 && m.numel <= (1 << 20)) (void)keel::read_checkpoint_plane(dir, keel::Plane::param);
  } catch (const keel::Error&) {
  }
  try {
    (void)keel::read_rank_residual(dir, 0);
  } catch (const keel::Error&) {
  }
  return 0;
}
