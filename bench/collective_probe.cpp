// The data-parallel sync's collective as Keel's GradSync runs it, timed across whatever ranks MPI
// starts it on (e.g. hosts in network namespaces, scripts/netns.sh): a float32 buffer of `bytes`
// in buckets of `bucket` bytes, every bucket's non-blocking all-reduce started, then all waited
// for; best of `repeats`. Also one float's all-reduce (the round trip a collective's step costs),
// median of 200. Rank 0 prints one JSON line: ranks, bytes, allreduce_ms, small_us, and the link
// bandwidth a ring all-reduce would need for that time (ring_gbit: 2 (n-1)/n of the bytes per
// rank), which is what bench/simulate_calibration.py puts in a cluster file's network.gbit. Beside
// it the library's other collectives the trainer calls, each as a ring's bandwidth for its time:
// GradSync's bucketed non-blocking reduce-scatter (ZeRO-2; reduce_scatter_ms, _gbit: (n-1)/n of the
// bytes), ZeRO's blocking all-gather of the parameters (allgather_ms, _gbit: (n-1)/n) and one
// blocking all-reduce of `blocking` bytes (blocking_allreduce_ms, _gbit: 2 (n-1)/n; the pipeline's
// tied-embedding sum): OpenMPI's non-blocking collectives (libnbc) run other algorithms than its
// blocking ones (tuned), at other rates on the same link.
//   mpirun -n 2 build/bench/keel_collective_probe [bytes=21299200] [bucket=8388608] [repeats=5] [message=262144]
//       [tensor_sizes=] [tensor_group=world] [gap_ms=0] [alltoall_sizes=] [expert_group=world] [blocking=bytes]
//       [plain_group=world]
// (message: one pipeline message's bytes, timed one way between ranks 0 and 1: message_ms)
// tensor_sizes (comma-separated bytes, e.g. the d4 job's 1024,2048,262144): a tensor group's
// all-reduces as Keel's trainer makes them (comm/tensor_parallel.cpp: one blocking
// Communicator::allreduce_sum per call, back to back), over groups of `tensor_group` consecutive
// ranks (tensor innermost, as comm/process_groups.h lays them out; every group all-reducing at
// once, as in a data x tensor job): per size the mean of 40 calls (what a step of such calls adds up
// to: with more ranks than cores a call either finds its peers running or waits for a time slice,
// and the median hides the second) and their median, the slowest rank's, as
// "tensor": [{"bytes": B, "ms": MEAN, "median_ms": M}, ...]. gap_ms: each rank computes (spins) that
// long before each call, as the trainer's ranks compute between a block's all-reduces (a link's
// token bucket refills meanwhile, and with more ranks than cores the ranks compete for them).
// The spin is CPU time of the calling thread, not wall time (a negative gap_ms: wall time): the
// trainer's compute is work, so a rank that waits for a core reaches its next collective late, as
// a trainer's rank does.
// tensor_sizes as a step's sequence instead ("bytes:gap_ms:dp_bytes,..."): the tensor group's
// calls in the order one step of the trainer makes them, each after its own gap of CPU time (the
// layer's share of compute before it); dp_bytes > 0 starts, before that call, the data-parallel
// sync's non-blocking all-reduce of that many gradient bytes over the data group (ranks with the
// same place in their tensor groups), all waited for after the step's last call, as GradSync does;
// bytes 0: no tensor call (the gap and the sync's start alone). The step is replayed 6 times (the
// first untimed); per size the mean and median of its calls, as above.
// alltoall_sizes, expert_group: an expert group's exchanges the same way, as "alltoall": [...].
// "tensor_added" and "alltoall_added": what the calls add to the wall time of the rounds (steps)
// that make them, against rounds of the same gaps without them, one after each:
// {"loop_ms", "gaps_ms", "calls_ms", "share": (loop - gaps) / calls, within [0, 1]}, the slowest
// rank's each. With more ranks than cores a rank waiting in a call waits in part for peers that
// compute meanwhile on the cores it shares, so the calls add less than their own times.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <ctime>
#include <vector>

#include "comm/communicator.h"
#include "core/clock.h"

int main(int argc, char** argv) {
  keel::Communicator& comm = keel::Communicator::world();
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 21299200;
  const size_t bucket = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : size_t{8} << 20;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  const size_t floats = bytes / sizeof(float), per = std::max<size_t>(1, bucket / sizeof(float));
  // plain_group (argv 11): the collectives above over groups of that many consecutive ranks, every
  // group at once (a data group of a job with more ranks, e.g. a 4-rank pipeline's groups of 2);
  // default: all ranks. Timings are the slowest group's (best of) and group 0's (medians).
  const int plain_size = argc > 11 ? std::atoi(argv[11]) : comm.size();
  if (plain_size < 1 || comm.size() % plain_size != 0) {
    std::fprintf(stderr, "collective_probe: a plain group of %d does not divide %d ranks\n", plain_size, comm.size());
    return 2;
  }
  std::unique_ptr<keel::Communicator> plain_split =
      plain_size < comm.size() ? comm.split(comm.rank() / plain_size, comm.rank() % plain_size) : nullptr;
  keel::Communicator& pc = plain_split ? *plain_split : comm;
  std::vector<float> data(floats, 1.0f);
  std::vector<double> small;
  for (int i = 0; i < 200; ++i) {
    float one = 1.0f;
    const auto t0 = std::chrono::steady_clock::now();
    pc.allreduce_sum(&one, 1);
    small.push_back(keel::ms_since(t0) * 1e3);
  }
  std::sort(small.begin(), small.end());
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<keel::Communicator::Request> requests;
    for (size_t at = 0; at < floats; at += per) requests.push_back(pc.iallreduce_sum(data.data() + at, std::min(per, floats - at)));
    for (keel::Communicator::Request& q : requests) pc.wait(q);
    best = std::min(best, comm.allreduce_max(keel::ms_since(t0)));
  }
  // The library's other collectives as Keel's trainer calls them, best of `repeats` each: GradSync's
  // non-blocking reduce-scatter under ZeRO-2 (the same buckets, each scattered to the ranks whose
  // contiguous shares of the buffer it overlaps, as ZeRO's partition gives them), ZeRO-1/2's
  // blocking all-gather of the updated parameters (every rank's share, in place), and a blocking
  // all-reduce of `blocking` bytes in one call (a pipeline's tied-embedding sum).
  const size_t blocking = argc > 10 ? std::strtoull(argv[10], nullptr, 10) : bytes;
  const int ranks = pc.size();
  std::vector<size_t> begin(static_cast<size_t>(ranks) + 1);
  for (int q = 0; q <= ranks; ++q) begin[static_cast<size_t>(q)] = floats * static_cast<size_t>(q) / static_cast<size_t>(ranks);
  auto best_of = [&](const std::function<void()>& body) {
    double out = 1e300;
    for (int r = 0; r < repeats; ++r) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      body();
      out = std::min(out, comm.allreduce_max(keel::ms_since(t0)));
    }
    return out;
  };
  const double scatter_ms = best_of([&] {
    std::vector<keel::Communicator::Request> requests;
    for (size_t at = 0; at < floats; at += per) {
      const size_t end = std::min(floats, at + per);
      std::vector<int> counts(static_cast<size_t>(ranks), 0);
      for (int q = 0; q < ranks; ++q) {
        const size_t lo = std::max(at, begin[static_cast<size_t>(q)]), hi = std::min(end, begin[static_cast<size_t>(q) + 1]);
        counts[static_cast<size_t>(q)] = hi > lo ? static_cast<int>(hi - lo) : 0;
      }
      requests.push_back(pc.ireduce_scatter_sum(data.data() + at, counts));
    }
    for (keel::Communicator::Request& q : requests) pc.wait(q);
  });
  std::vector<int> share_counts(static_cast<size_t>(ranks)), share_displs(static_cast<size_t>(ranks));
  for (int q = 0; q < ranks; ++q) {
    share_displs[static_cast<size_t>(q)] = static_cast<int>(begin[static_cast<size_t>(q)]);
    share_counts[static_cast<size_t>(q)] = static_cast<int>(begin[static_cast<size_t>(q) + 1] - begin[static_cast<size_t>(q)]);
  }
  const double gather_ms = best_of([&] { pc.allgatherv(data.data(), share_counts, share_displs); });
  std::vector<float> tied(std::max<size_t>(1, blocking / sizeof(float)), 1.0f);
  const double blocking_ms = best_of([&] { pc.allreduce_sum(tied.data(), tied.size()); });
  // A pipeline's activation message: `message` bytes from rank 0 to rank 1 and back (its gradient),
  // each way after the other rank's reply, as a stage boundary sees them; median of 20 one-way times.
  const size_t message = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 262144;
  std::vector<float> msg(std::max<size_t>(1, message / sizeof(float)), 1.0f);
  std::vector<double> one_way;
  for (int i = 0; i < 20 && pc.size() > 1; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (pc.rank() == 0) {
      keel::Communicator::Request s = pc.isend(msg.data(), msg.size(), 1, 7);
      pc.wait(s);
      keel::Communicator::Request r = pc.irecv(msg.data(), msg.size(), 1, 8);
      pc.wait(r);
      one_way.push_back(keel::ms_since(t0) / 2);
    } else if (pc.rank() == 1) {
      keel::Communicator::Request r = pc.irecv(msg.data(), msg.size(), 0, 7);
      pc.wait(r);
      keel::Communicator::Request s = pc.isend(msg.data(), msg.size(), 0, 8);
      pc.wait(s);
    }
  }
  std::sort(one_way.begin(), one_way.end());
  // The tensor group's all-reduces at its own message sizes; an expert group's all-to-alls.
  auto parse_sizes = [](const char* text) {
    std::vector<size_t> out;
    for (const char* p = text; *p;) {
      char* end = nullptr;
      const size_t v = std::strtoull(p, &end, 10);
      if (end == p) break;
      if (v > 0) out.push_back(v);
      p = *end == ',' ? end + 1 : end;
    }
    return out;
  };
  // A step's sequence "bytes:gap_ms:dp_bytes,...", or none when the text has no ':'.
  struct Call {
    size_t bytes = 0, dp_bytes = 0;
    double gap_ms = 0;
  };
  auto parse_sequence = [](const char* text) {
    std::vector<Call> out;
    if (std::string(text).find(':') == std::string::npos) return out;
    for (const char* p = text; *p;) {
      char* end = nullptr;
      Call c;
      c.bytes = std::strtoull(p, &end, 10);
      if (end == p || *end != ':') break;
      c.gap_ms = std::strtod(end + 1, &end);
      if (*end != ':') break;
      c.dp_bytes = std::strtoull(end + 1, &end, 10);
      out.push_back(c);
      p = *end == ',' ? end + 1 : end;
    }
    return out;
  };
  // Spins `ms` of this thread's CPU time (ms < 0: -ms of wall time, the probe's earlier gap, kept
  // for comparison).
  auto compute = [](double ms) {
    if (ms < 0) {
      const auto t0 = std::chrono::steady_clock::now();
      volatile double spin = 0;
      while (keel::ms_since(t0) < -ms) spin = spin + 1.0;
      return;
    }
    auto cpu_ms = [] {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
    };
    const double until = cpu_ms() + ms;
    volatile double spin = 0;
    while (cpu_ms() < until) spin = spin + 1.0;
  };
  auto split = [&](int size) -> std::unique_ptr<keel::Communicator> {
    if (size < 1 || comm.size() % size != 0) {
      std::fprintf(stderr, "collective_probe: a group of %d does not divide %d ranks\n", size, comm.size());
      std::exit(2);
    }
    return comm.split(comm.rank() / size, comm.rank() % size);
  };
  const double gap_ms = argc > 7 ? std::atof(argv[7]) : 0.0;
  // Per size the mean and median of its calls' times, the slowest rank's, as a JSON list.
  auto report = [&](const std::vector<size_t>& sizes, std::vector<std::vector<double>>& all) {
    std::string out = "[";
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<double>& times = all[k];
      std::sort(times.begin(), times.end());
      double sum = 0;
      for (double t : times) sum += t;
      const double mean = comm.allreduce_max(sum / static_cast<double>(times.size()));
      const double median = comm.allreduce_max(times[times.size() / 2]);
      char item[128];
      std::snprintf(item, sizeof item, "%s{\"bytes\": %zu, \"ms\": %.4f, \"median_ms\": %.4f}", k ? ", " : "",
                    sizes[k], mean, median);
      out += item;
    }
    return out + "]";
  };
  // What the calls add to the wall time of the loop that makes them, as a share of the calls' own
  // times: (the loop's wall time - the same gaps' without the calls) / the sum of the calls' times,
  // each the slowest rank's. With no more ranks than cores a call's time is what it adds (about 1);
  // with more, a rank that waits in a call waits in part for peers that are computing on the cores
  // it would otherwise share, so the calls add less than their own times (the profile's layer costs,
  // measured with every rank computing, already hold that sharing).
  auto added = [&](double loop_ms, double gaps_ms, double calls_ms) {
    loop_ms = comm.allreduce_max(loop_ms);
    gaps_ms = comm.allreduce_max(gaps_ms);
    calls_ms = comm.allreduce_max(calls_ms);
    char item[160];
    std::snprintf(item, sizeof item, "{\"loop_ms\": %.3f, \"gaps_ms\": %.3f, \"calls_ms\": %.3f, \"share\": %.4f}", loop_ms,
                  gaps_ms, calls_ms, calls_ms > 0 ? std::clamp((loop_ms - gaps_ms) / calls_ms, 0.0, 1.0) : 1.0);
    return std::string(item);
  };
  // Per size, `call` 45 times (5 to warm up), each after gap_ms of spinning, the sizes taken in turn
  // call by call (a load that moves during the probe weighs on every size alike): the mean and
  // median of the 40 timed, the slowest rank's, as a JSON list; `share` gets what the 40 rounds
  // add to their wall time (above) against rounds of the same gaps alone, one after each (a load
  // that moves weighs on both alike), every round started by all ranks together (a barrier, not
  // timed): without it a rank's gaps alone overlap its peers' waits in calls and run faster than
  // with every rank computing.
  auto timed = [&](const std::vector<size_t>& sizes, const std::function<void(size_t)>& call, std::string* share) {
    std::vector<std::vector<double>> all(sizes.size());
    double calls_ms = 0, loop_ms = 0, gaps_ms = 0;
    for (int i = 0; i < 45; ++i) {
      comm.barrier();
      const auto round0 = std::chrono::steady_clock::now();
      for (size_t k = 0; k < sizes.size(); ++k) {
        compute(gap_ms);
        const auto t0 = std::chrono::steady_clock::now();
        call(sizes[k]);
        if (i >= 5) {
          all[k].push_back(keel::ms_since(t0));
          calls_ms += all[k].back();
        }
      }
      if (i < 5) continue;
      loop_ms += keel::ms_since(round0);
      comm.barrier();  // every rank computes its gaps at once, as the profile's ranks did
      const auto gaps0 = std::chrono::steady_clock::now();
      for (size_t k = 0; k < sizes.size(); ++k) compute(gap_ms);
      gaps_ms += keel::ms_since(gaps0);
    }
    if (share) *share = added(loop_ms, gaps_ms, calls_ms);
    return report(sizes, all);
  };
  const int group_size = argc > 6 ? std::atoi(argv[6]) : comm.size();
  std::unique_ptr<keel::Communicator> group = split(group_size);
  const std::vector<Call> sequence = argc > 5 ? parse_sequence(argv[5]) : std::vector<Call>{};
  std::vector<size_t> tensor_sizes;
  if (sequence.empty()) {
    tensor_sizes = argc > 5 ? parse_sizes(argv[5]) : std::vector<size_t>{};
  } else {
    for (const Call& c : sequence) {
      if (c.bytes > 0 && std::find(tensor_sizes.begin(), tensor_sizes.end(), c.bytes) == tensor_sizes.end()) tensor_sizes.push_back(c.bytes);
    }
  }
  std::vector<float> buf(std::max<size_t>(1, tensor_sizes.empty() ? 1 : *std::max_element(tensor_sizes.begin(), tensor_sizes.end()) / sizeof(float)), 1.0f);
  std::string tensor, tensor_share = "null", alltoall_share = "null";
  if (sequence.empty()) {
    tensor = timed(tensor_sizes, [&](size_t size) {
      group->allreduce_sum(buf.data(), std::max<size_t>(1, size / sizeof(float)));
    }, &tensor_share);
  } else {
    // The data group: the ranks at the same place in their tensor groups.
    std::unique_ptr<keel::Communicator> data = comm.split(comm.rank() % group_size, comm.rank() / group_size);
    size_t dp_total = 0;
    for (const Call& c : sequence) dp_total += c.dp_bytes;
    std::vector<float> grads(std::max<size_t>(1, dp_total / sizeof(float)), 1.0f);
    std::vector<std::vector<double>> all(tensor_sizes.size());
    double calls_ms = 0;
    // One step, with the tensor calls (timed: their times kept) or without them (the gaps and the
    // data group's sync alone); its wall time. One untimed step, then five timed ones, each
    // followed by one without the calls: what the calls add to a step (`added` above).
    auto replay = [&](bool with_calls, bool timed_step) {
      const auto step0 = std::chrono::steady_clock::now();
      std::vector<keel::Communicator::Request> syncs;
      size_t at = 0;
      for (const Call& c : sequence) {
        compute(c.gap_ms);
        if (c.dp_bytes > 0 && data->size() > 1) {
          syncs.push_back(data->iallreduce_sum(grads.data() + at, c.dp_bytes / sizeof(float)));
          at += c.dp_bytes / sizeof(float);
        }
        if (c.bytes == 0 || !with_calls) continue;
        const auto t0 = std::chrono::steady_clock::now();
        group->allreduce_sum(buf.data(), std::max<size_t>(1, c.bytes / sizeof(float)));
        const size_t k = static_cast<size_t>(std::find(tensor_sizes.begin(), tensor_sizes.end(), c.bytes) - tensor_sizes.begin());
        if (timed_step) {
          all[k].push_back(keel::ms_since(t0));
          calls_ms += all[k].back();
        }
      }
      for (keel::Communicator::Request& q : syncs) data->wait(q);
      return keel::ms_since(step0);
    };
    comm.barrier();
    replay(true, false);
    double loop_ms = 0, gaps_ms = 0;
    for (int step = 0; step < 5; ++step) {
      comm.barrier();
      loop_ms += replay(true, true);
      comm.barrier();  // every rank computes its gaps at once, as the profile's ranks did
      gaps_ms += replay(false, false);
    }
    tensor = report(tensor_sizes, all);
    tensor_share = added(loop_ms, gaps_ms, calls_ms);
  }
  // alltoall_sizes (comma-separated bytes a rank sends in all, its own share included) over groups
  // of `expert_group` consecutive ranks: the trainer's exchange (model/moe.cpp: one non-blocking
  // all-to-all of bytes, equal parts to every rank of the group, then its wait).
  const int expert_size = argc > 9 ? std::atoi(argv[9]) : comm.size();
  std::unique_ptr<keel::Communicator> experts = split(expert_size);
  const std::vector<size_t> alltoall_sizes = argc > 8 ? parse_sizes(argv[8]) : std::vector<size_t>{};
  std::vector<uint8_t> send(alltoall_sizes.empty() ? 1 : *std::max_element(alltoall_sizes.begin(), alltoall_sizes.end()), 1),
      recv(send.size(), 0);
  const std::string alltoall = timed(alltoall_sizes, [&](size_t size) {
    const int P = experts->size(), part = static_cast<int>(size / P);
    std::vector<int> counts(P, part), displs(P);
    for (int q = 0; q < P; ++q) displs[q] = q * part;
    keel::Communicator::Request request = experts->ialltoallv(send.data(), counts, displs, recv.data(), counts, displs);
    experts->wait(request);
  }, &alltoall_share);
  if (comm.is_root()) {
    const double n = pc.size();
    const double ring_gbit = 2 * (n - 1) / n * static_cast<double>(bytes) * 8 / (best * 1e-3) / 1e9;
    const double half = (n - 1) / n * static_cast<double>(bytes) * 8 / 1e6;  // Gbit/s x ms of a reduce-scatter or all-gather
    std::printf("{\"reduce_scatter_ms\": %.3f, \"reduce_scatter_gbit\": %.4f, \"allgather_ms\": %.3f, \"allgather_gbit\": %.4f, "
                "\"blocking_bytes\": %zu, \"blocking_allreduce_ms\": %.3f, \"blocking_allreduce_gbit\": %.4f, ",
                scatter_ms, half / scatter_ms, gather_ms, half / gather_ms, blocking, blocking_ms,
                2 * (n - 1) / n * static_cast<double>(blocking) * 8 / 1e6 / blocking_ms);
    std::printf("\"plain_group\": %d, ", pc.size());
    std::printf("\"ranks\": %d, \"bytes\": %zu, \"bucket\": %zu, \"allreduce_ms\": %.3f, \"small_us\": %.1f, \"ring_gbit\": %.4f, "
                "\"message_bytes\": %zu, \"message_ms\": %.3f, \"tensor_group\": %d, \"gap_ms\": %.3f, \"tensor\": %s, \"tensor_added\": %s, \"expert_group\": %d, \"alltoall\": %s, \"alltoall_added\": %s}\n",
                comm.size(), bytes, bucket, best, small[small.size() / 2], ring_gbit, message,
                one_way.empty() ? 0.0 : one_way[one_way.size() / 2], group_size, gap_ms, tensor.c_str(), tensor_share.c_str(), expert_size, alltoall.c_str(), alltoall_share.c_str());
  }
  return 0;
}
