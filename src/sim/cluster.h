// A cluster described for `keel simulate` (sim/step_model.h): nodes of devices, the devices'
// arithmetic and memory, the links inside a node and the network between nodes, variability and
// reliability. One TOML file (configs/clusters/*.toml documents every key); every key is
// required unless the comment below gives a default, and an impossible value is an error that
// names the file and the key.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace keel::sim {

struct Device {
  std::string name;
  double tflops_bf16 = 0;        // dense peak, 16-bit matrix products
  double tflops_fp32 = 0;        // dense peak, float32 matrix products
  double memory_gib = 0;         // device memory
  double hbm_gbps = 0;           // device memory bandwidth, GB/s
  // The share of the peak a matrix product reaches, by shape: points (smallest of M, N, K; share),
  // increasing in the dimension, interpolated in log2 of it and held beyond the ends
  // (`gemm_efficiency = [[256, 0.40], ...]`, from published GEMM benchmarks of the device). Where
  // a file gives none, matmul_efficiency applies to every shape (then required).
  std::vector<std::pair<double, double>> gemm_efficiency;
  double matmul_efficiency = 0;  // share of the peak a large product reaches (0..1]
  // The share of the peak reached by a product whose smallest dimension is `min_dim`.
  double gemm_share(double min_dim) const;
  // Per step, what the model leaves out (data loading, the loss, the gradient norm, logging), as a
  // profiling run on the machine measured it: its step beyond its own prediction (negative where
  // the run's smoothed layer costs overstate its steps). Default 0.
  double step_overhead_ms = 0;
};

struct Host {
  double memory_gib = 0;   // per node
  double pcie_gbps = 0;    // host <-> one device, GB/s each way
  int nvme_drives = 0;     // per node (default 0)
  double nvme_gbps = 0;    // per drive, GB/s (default 0)
  double nvme_tib = 0;     // per drive, capacity (default 0: not checked)
  // Host memory bandwidth per node, GB/s: AdamW moments homed on the host are updated there
  // (default 0: required only when the memory tiers home moments on the host).
  double memory_gbps = 0;
};

struct Link {  // inside a node: every device to every other
  std::string kind;        // "nvlink" or "pcie" (informative)
  double gbps = 0;         // GB/s per device, each way
  double latency_us = 0;
};

struct Network {  // between nodes
  double gbit = 0;             // per NIC, Gbit/s
  int nics_per_node = 0;
  double latency_us = 0;
  std::string topology;        // "fat-tree" or "rail" (rail: device i of every node on NIC i's rail)
  double oversubscription = 1; // edge : core bandwidth (1 = non-blocking; default 1)
  // An expert group's all-to-all (parallel.expert) as measured (bench/collective_probe.cpp): one
  // exchange costs alltoall_latency_us + the bytes a rank sends off-rank at alltoall_gbps GB/s.
  // Default 0: from the links (the group's link bandwidth, one latency per peer).
  double alltoall_latency_us = 0, alltoall_gbps = 0;
  // `gbit` is what the data-parallel sync's bucketed non-blocking all-reduce reaches, as a ring's
  // bandwidth. Where an MPI library reaches other rates with its other collectives (OpenMPI:
  // libnbc's non-blocking algorithms are not its blocking ones' rings), each as a ring's bandwidth
  // per NIC, Gbit/s, measured apart (bench/collective_probe.cpp): GradSync's bucketed non-blocking
  // reduce-scatter under ZeRO-2 (reduce_scatter_gbit: (n-1)/n of the bytes), the blocking
  // all-gather of ZeRO-1/2's updated parameters (allgather_gbit: (n-1)/n), a blocking all-reduce
  // (blocking_allreduce_gbit: 2 (n-1)/n; the pipeline's tied-embedding sum between two stages).
  // Default 0: gbit.
  double reduce_scatter_gbit = 0, allgather_gbit = 0, blocking_allreduce_gbit = 0;
  // Bandwidth one device gets to another node, GB/s: its NIC share, over the oversubscription
  // (of a collective measured at `measured_gbit` per NIC where given, else at `gbit`).
  double device_gbps(int devices_per_node, double measured_gbit = 0) const;
};

struct Variability {
  double jitter = 0;              // relative spread (standard deviation) of a device's step compute (default 0)
  double straggler_fraction = 0;  // share of devices slower by straggler_slowdown (default 0)
  double straggler_slowdown = 1;  // (default 1)
};

struct Reliability {
  double node_mtbf_hours = 0;           // mean time between failures of one node (0 = none; default 0)
  double checkpoint_every_minutes = 0;  // (default 0: the model takes Keel's 15)
  double restart_minutes = 0;           // detection + restart + reload (default 0)
};

// Throughput of Keel's gradient codecs (HybridGC) on the device, GB/s of float32 input: `encode`
// is an encoding with error feedback (encode, then decode into the residual), `decode` one
// decode-add. Indexed by CodecKind; 0 = not given: the codec's compute is not costed (default 0).
// `keel simulate --probe-codecs yes` measures them on the machine it runs on.
struct CodecRates {
  double encode_gbps[7] = {0, 0, 0, 0, 0, 0, 0};
  double decode_gbps[7] = {0, 0, 0, 0, 0, 0, 0};
};

struct Cluster {
  std::string name;
  int nodes = 0;
  int devices_per_node = 0;
  Device device;
  Host host;
  Link intra;
  Network network;
  Variability variability;
  Reliability reliability;
  CodecRates codecs;

  int devices() const { return nodes * devices_per_node; }
  // Reads and validates `path`; throws keel::Error naming the file and the key.
  static Cluster load(const std::string& path);
  // The same from TOML text (`what` names it in errors).
  static Cluster parse(const std::string& toml_text, const std::string& what);
};

}  // namespace keel::sim
