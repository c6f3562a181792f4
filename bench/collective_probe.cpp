// The data-parallel sync's collective as Keel's GradSync runs it, timed across whatever ranks MPI
// starts it on (e.g. hosts in network namespaces, scripts/netns.sh): a float32 buffer of `bytes`
// in buckets of `bucket` bytes, every bucket's non-blocking all-reduce started, then all waited
// for; best of `repeats`. Also one float's all-reduce (the round trip a collective's step costs),
// median of 200. Rank 0 prints one JSON line: ranks, bytes, allreduce_ms, small_us, and the link
// bandwidth a ring all-reduce would need for that time (ring_gbit: 2 (n-1)/n of the bytes per
// rank), which is what bench/simulate_calibration.py puts in a cluster file's network.gbit.
//   mpirun -n 2 build/bench/keel_collective_probe [bytes=21299200] [bucket=8388608] [repeats=5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/communicator.h"
#include "core/clock.h"

int main(int argc, char** argv) {
  keel::Communicator& comm = keel::Communicator::world();
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 21299200;
  const size_t bucket = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t{8} << 20;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  const size_t floats = bytes / sizeof(float), per = std::max<size_t>(1, bucket / sizeof(float));
  std::vector<float> data(floats, 1.0f);
  std::vector<double> small;
  for (int i = 0; i < 200; ++i) {
    float one = 1.0f;
    const auto t0 = std::chrono::steady_clock::now();
    comm.allreduce_sum(&one, 1);
    small.push_back(keel::ms_since(t0) * 1e3);
  }
  std::sort(small.begin(), small.end());
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<keel::Communicator::Request> requests;
    for (size_t at = 0; at < floats; at += per) requests.push_back(comm.iallreduce_sum(data.data() + at, std::min(per, floats - at)));
    for (keel::Communicator::Request& q : requests) comm.wait(q);
    best = std::min(best, comm.allreduce_max(keel::ms_since(t0)));
  }
  if (comm.is_root()) {
    const double n = comm.size();
    const double ring_gbit = 2 * (n - 1) / n * static_cast<double>(bytes) * 8 / (best * 1e-3) / 1e9;
    std::printf("{\"ranks\": %d, \"bytes\": %zu, \"bucket\": %zu, \"allreduce_ms\": %.3f, \"small_us\": %.1f, \"ring_gbit\": %.4f}\n",
                comm.size(), bytes, bucket, best, small[small.size() / 2], ring_gbit);
  }
  return 0;
}
