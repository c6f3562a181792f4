// The tests' main: the same compute environment as keel's own main (kernels/cpu/blas.h
// prepare_compute_environment: the OpenMP wait policy and OpenBLAS's kernels), so that a test
// computing in its own process and the `keel` binary it runs give the same bytes.
#include <gtest/gtest.h>

#include "kernels/cpu/blas.h"

int main(int argc, char** argv) {
  keel::prepare_compute_environment(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
