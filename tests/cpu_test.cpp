// The CPU peak MFU is measured against: read from the hardware, never from a timing.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "core/cpu.h"

namespace keel {
namespace {

TEST(CpuPeak, ComesFromVectorUnitsClockAndCores) {
  const CpuPeak one = cpu_peak(1);
  // FP32 FLOP per cycle per core: lanes x FMA units x 2 (SSE without FMA: 4 lanes x 1 = 4).
  const double fpc = one.flops_per_cycle;
  EXPECT_TRUE(fpc == 4 || fpc == 8 || fpc == 16 || fpc == 32 || fpc == 64) << fpc;
  EXPECT_GT(one.ghz, 0.5);
  EXPECT_LT(one.ghz, 7.0);
  EXPECT_DOUBLE_EQ(one.gflops, fpc * one.ghz);
  const CpuPeak two = cpu_peak(2);
  EXPECT_DOUBLE_EQ(two.gflops, 2 * one.gflops) << "the peak scales with the cores it covers";
  EXPECT_NE(two.how.find("FLOP/cycle"), std::string::npos) << two.how;
  // The vector units named agree with what the kernel reports.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      flags = line + " ";
      break;
    }
  }
  if (flags.find(" avx512f ") != std::string::npos) {
    EXPECT_GE(fpc, 32);
  } else if (flags.find(" avx2 ") != std::string::npos && flags.find(" fma ") != std::string::npos) {
    EXPECT_EQ(fpc, 32);
  }
  EXPECT_GE(online_cpus(), 1);
}

}  // namespace
}  // namespace keel
