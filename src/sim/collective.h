// The data-parallel collectives `keel simulate` costs (sim/step_model.cpp), by algorithm: a flat
// ring over every rank (OpenMPI's all-reduce as Keel runs it; what Keel's collective probe measures
// here); NCCL's choice between a ring laid out node by node and a double binary tree across nodes
// with a chain inside each, the cheaper for the message as NCCL's tuner picks by its own cost
// model; and, for stacks that run one, a hierarchical all-reduce (reduce-scatter inside the node,
// all-reduce of the shard across nodes, all-gather inside the node) where it is cheaper still.
#pragma once

#include "sim/stack.h"

namespace keel::sim {

// One collective group: `ranks` devices, `per_node` of them in each node (1 where the tensor and
// pipeline groups fill the node: one member per node). Inside a node each member has `intra_gbps`
// GB/s each way (bus bandwidth of the node's all-reduce) and a hop costs `intra_latency_us`; the
// group's traffic leaving one node shares `node_gbps` GB/s (the node's NICs over the groups that
// use them at once) and a hop between nodes costs `inter_latency_us`. For the flat ring of
// CollectiveKind::ring, `device_gbps` is the bandwidth one member gets across nodes (its NIC share).
// Across nodes, the flat ring's reduce-scatter and all-gather alone run at `device_rs_gbps` and
// `device_ag_gbps` where the library measured other rates for them (0: device_gbps).
struct CollectiveGroup {
  int ranks = 1, per_node = 1;
  double intra_gbps = 0, intra_latency_us = 0;
  double node_gbps = 0, device_gbps = 0, inter_latency_us = 0;
  double device_rs_gbps = 0, device_ag_gbps = 0;
  int nodes() const { return (ranks + per_node - 1) / per_node; }
};

enum class Algorithm { none, ring, tree, hierarchical };
const char* to_string(Algorithm a);

struct CollectiveCost {
  double ms = 0;
  Algorithm algorithm = Algorithm::none;
};

// Milliseconds of an all-reduce of `bytes` per rank over `g` (`fraction` 0.5: a reduce-scatter or
// an all-gather alone), by `kind`'s algorithm (the cheapest of those `kind` offers).
CollectiveCost allreduce(double bytes, const CollectiveGroup& g, CollectiveKind kind, double fraction = 1.0);

// The latency part alone (bytes -> 0) of the algorithm chosen for `bytes`: what each further bucket
// of a bucketed reduction pays again.
double allreduce_latency_ms(double bytes, const CollectiveGroup& g, CollectiveKind kind, double fraction = 1.0);

}  // namespace keel::sim
