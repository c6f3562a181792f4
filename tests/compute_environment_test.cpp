// The compute environment every Keel process starts with (kernels/cpu/blas.h
// prepare_compute_environment, run by keel's main and by every test program's): OpenBLAS kernels
// that use the CPU's vector units, the same in the keel binary as in a test's own process.
#include <gtest/gtest.h>

#include <string>

#include "core/cpu.h"
#include "kernels/cpu/blas.h"
#include "test_util.h"

namespace keel {
namespace {

TEST(ComputeEnvironment, OpenBlasRunsKernelsForThisCpusVectorUnits) {
  const std::string family = vector_kernel_family();
  const std::string core = blas_core();
  if (family.empty()) GTEST_SKIP() << "a CPU without AVX2: OpenBLAS's own choice (" << core << ") stands";
  // An SSE-era kernel on a CPU with AVX2 or AVX-512 is what prepare_compute_environment replaces.
  for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Sandybridge"}) {
    EXPECT_EQ(core.rfind(old, 0), std::string::npos) << "OpenBLAS runs " << core << " on a CPU with " << family;
  }
}

// Without a policy in the environment: inference commands spin briefly before sleeping (a decode
// step's many short parallel regions), everything else sleeps at once.
TEST(ComputeEnvironment, OpenMpWaitsByCommand) {
  EXPECT_EQ(default_openmp_wait("generate"), "GOMP_SPINCOUNT=10000");
  EXPECT_EQ(default_openmp_wait("score"), "GOMP_SPINCOUNT=10000");
  for (const char* c : {"train", "eval", "launch", "--gtest_filter=X"}) EXPECT_EQ(default_openmp_wait(c), "OMP_WAIT_POLICY=PASSIVE") << c;
  EXPECT_EQ(default_openmp_wait(nullptr), "OMP_WAIT_POLICY=PASSIVE");
}

// keel itself starts the same way: its run event names the kernels this process runs.
TEST(ComputeEnvironment, KeelRunsTheSameKernelsAsThisProcess) {
  testing::TempDir dir("keel-compute-env");
  testing::write_toy_shards(dir.path());
  const auto r = testing::run_keel("train --set model.preset=tiny --set model.vocab_size=64 --set train.steps=1 "
                                   "--set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 "
                                   "--set train.eval_batches=1 --set train.sample_tokens=0 --set data.tokenizer= "
                                   "--set data.train=" + dir / "train.bin" + " --set data.val=" + dir / "val.bin" +
                                   " --set train.run_dir=" + dir / "run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(OpenBLAS kernels " + blas_core() + ")"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace keel
