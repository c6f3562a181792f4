// The peak floating-point rate of this machine's CPU, from the hardware: vector width and FMA
// units (CPUID), cores, and clock (cpufreq's maximum where the kernel exposes it, else
// /proc/cpuinfo's current MHz, which under a hypervisor is the nominal clock). MFU is model
// FLOP/s over this peak (PaLM's definition); a timing taken at start-up under whatever else the
// machine runs is no peak.
#pragma once

#include <string>

namespace keel {

struct CpuPeak {
  double flops_per_cycle = 0;  // FP32 FLOP per cycle per core (FMA = 2)
  double ghz = 0;
  double cores = 0;            // the cores the figure covers
  double gflops = 0;           // flops_per_cycle * ghz * cores
  std::string how;             // e.g. "AVX2 2x256-bit FMA, 2.45 GHz (cpuinfo MHz) x 2 cores"
};

// The FP32 peak of `cores` cores of this CPU.
CpuPeak cpu_peak(double cores);

// Online logical CPUs.
int online_cpus();

// The CPU's model name as /proc/cpuinfo gives it ("unknown CPU" where it gives none).
std::string cpu_model_name();

// The OpenBLAS kernel family (an OPENBLAS_CORETYPE name) this CPU's vector units call for, from
// CPUID: "Cooperlake" (AVX-512 with bf16 dot products), "SkylakeX" (AVX-512 F/CD/BW/DQ/VL), "Zen"
// (an AMD CPU with AVX2 and FMA), "Haswell" (AVX2 and FMA), or "" (nothing past SSE/AVX).
std::string vector_kernel_family();

}  // namespace keel
