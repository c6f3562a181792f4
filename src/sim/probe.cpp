#include "sim/probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "comm/codec.h"
#include "comm/sync_policy.h"
#include "core/clock.h"
#include "core/rng.h"

namespace keel::sim {

std::string probe_codecs(const SyncConfig& sync, size_t floats, int repeats) {
  std::vector<float> x(floats), residual(floats, 0.0f), y(floats, 0.0f), scratch;
  Rng rng(1);
  for (float& v : x) v = static_cast<float>(rng.normal()) * 1e-3f;
  std::vector<uint8_t> encoded;
  std::string out;
  for (int k = 1; k < 7; ++k) {
    const CodecKind kind = static_cast<CodecKind>(k);
    const std::unique_ptr<Codec> codec = Codec::make(sync_codec_params(sync, kind));
    double encode_ms = 1e300, decode_ms = 1e300;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      encode_with_feedback(*codec, x.data(), residual.data(), floats, static_cast<uint64_t>(r), encoded, scratch);
      encode_ms = std::min(encode_ms, ms_since(t0));
      const auto t1 = std::chrono::steady_clock::now();
      codec->decode_add(encoded.data(), encoded.size(), floats, y.data());
      decode_ms = std::min(decode_ms, ms_since(t1));
    }
    const double bytes = static_cast<double>(floats) * sizeof(float);
    char line[160];
    std::snprintf(line, sizeof line, "%s_encode = %.3f\n%s_decode = %.3f\n", codec_name(kind),
                  bytes / (encode_ms * 1e-3) / 1e9, codec_name(kind), bytes / (decode_ms * 1e-3) / 1e9);
    out += line;
  }
  return out;
}

double probe_memory_gbps(size_t floats, int repeats) {
  std::vector<float> a(floats, 0.0f), b(floats, 1.0f), c(floats, 2.0f);
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const float s = 0.5f + static_cast<float>(r);
    const auto t0 = std::chrono::steady_clock::now();
    float* __restrict pa = a.data();
    const float* __restrict pb = b.data();
    const float* __restrict pc = c.data();
    for (size_t i = 0; i < floats; ++i) pa[i] = pb[i] + s * pc[i];
    best = std::min(best, ms_since(t0));
  }
  volatile float sink = a[floats / 2];  // the result is used
  (void)sink;
  return 12.0 * static_cast<double>(floats) / (best * 1e-3) / 1e9;
}

std::string probe_machine(const SyncConfig& sync) {
  char line[200];
  std::snprintf(line, sizeof line,
                "# measured by keel simulate --probe yes, one thread\n[device]\nhbm_gbps = %.3f   # streaming triad\n\n"
                "[codecs]   # GB/s of float32: an encoding with error feedback, one decode-add\n",
                probe_memory_gbps());
  return line + probe_codecs(sync);
}

}  // namespace keel::sim
