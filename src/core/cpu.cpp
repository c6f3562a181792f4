#include "core/cpu.h"

#include <cpuid.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace keel {

namespace {

struct VectorUnits {
  int lanes = 4;      // FP32 lanes per FMA unit
  int fma_units = 1;  // FMAs issued per cycle
  bool fma = false;
  std::string name;
};

VectorUnits vector_units() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0, &a, &b, &c, &d);
  const bool amd = b == 0x68747541;  // "Auth"enticAMD
  __get_cpuid(1, &a, &b, &c, &d);
  const unsigned base_family = (a >> 8) & 0xf, ext_family = (a >> 20) & 0xff;
  const unsigned family = base_family == 0xf ? base_family + ext_family : base_family;
  const bool fma = (c >> 12) & 1, avx = (c >> 28) & 1;
  unsigned b7 = 0;
  if (__get_cpuid_max(0, nullptr) >= 7) __cpuid_count(7, 0, a, b7, c, d);
  const bool avx2 = (b7 >> 5) & 1, avx512f = (b7 >> 16) & 1;
  VectorUnits u;
  u.fma = fma;
  if (avx512f) {
    // Zen 4 (family 0x19) executes 512-bit FMAs on 256-bit units; Zen 5 (0x1A) and Intel's
    // server cores have full 512-bit FMA units.
    const bool half = amd && family == 0x19;
    u.lanes = half ? 8 : 16;
    u.fma_units = 2;
    u.name = half ? "AVX-512 on 2x256-bit FMA" : "AVX-512 2x512-bit FMA";
  } else if (avx2 && fma) {
    u.lanes = 8;
    u.fma_units = 2;
    u.name = "AVX2 2x256-bit FMA";
  } else if (avx) {
    u.lanes = 8;
    u.name = "AVX 256-bit, no FMA";
  } else {
    u.name = "SSE 128-bit";
  }
  return u;
}

// The value of the first /proc/cpuinfo line whose key starts with `key` ("" if none).
std::string cpuinfo_value(const std::string& key) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) return "";
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

// GHz and where it came from.
std::pair<double, std::string> clock_ghz() {
  std::ifstream max_freq("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
  double khz = 0;
  if (max_freq >> khz && khz > 0) return {khz / 1e6, "cpufreq max"};
  const double mhz = std::atof(cpuinfo_value("cpu MHz").c_str());
  if (mhz > 0) return {mhz / 1e3, "cpuinfo MHz"};
  return {2.0, "clock unknown, 2 GHz assumed"};
}

}  // namespace

std::string vector_kernel_family() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid(0, &a, &b, &c, &d);
  const bool amd = b == 0x68747541;  // "Auth"enticAMD
  __get_cpuid(1, &a, &b, &c, &d);
  const bool fma = (c >> 12) & 1;
  if (__get_cpuid_max(0, nullptr) < 7) return "";
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  __cpuid_count(7, 0, a, b7, c7, d7);
  __cpuid_count(7, 1, a71, b71, c71, d71);
  const bool avx2 = (b7 >> 5) & 1;
  const bool avx512 = ((b7 >> 16) & 1) && ((b7 >> 17) & 1) && ((b7 >> 28) & 1) && ((b7 >> 30) & 1) &&
                      ((b7 >> 31) & 1);  // F, DQ, CD, BW, VL
  const bool avx512_bf16 = (a71 >> 5) & 1;
  if (avx512 && !amd) return avx512_bf16 ? "Cooperlake" : "SkylakeX";
  if (avx2 && fma) return amd ? "Zen" : "Haswell";
  return "";
}

int online_cpus() {
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

CpuPeak cpu_peak(double cores) {
  const VectorUnits u = vector_units();
  const auto [ghz, source] = clock_ghz();
  CpuPeak p;
  p.flops_per_cycle = static_cast<double>(u.lanes) * u.fma_units * (u.fma ? 2 : 1);
  p.ghz = ghz;
  p.cores = cores;
  p.gflops = p.flops_per_cycle * ghz * cores;
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s, %.0f FP32 FLOP/cycle, %.2f GHz (%s) x %.3g cores", u.name.c_str(),
                p.flops_per_cycle, ghz, source.c_str(), cores);
  p.how = buf;
  return p;
}

std::string cpu_model_name() {
  const std::string name = cpuinfo_value("model name");
  return name.empty() ? "unknown CPU" : name;
}

}  // namespace keel
