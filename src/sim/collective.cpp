#include "sim/collective.h"

#include <algorithm>
#include <cmath>

namespace keel::sim {

namespace {

struct Terms {
  double bandwidth_ms = 0, latency_ms = 0;
  double ms() const { return bandwidth_ms + latency_ms; }
};

// A flat ring as OpenMPI runs it: 2 (n-1)/n of the bytes over the slowest member's link, 2 (n-1)
// latency-bound rounds at the slowest hop's latency.
Terms flat_ring(double bytes, const CollectiveGroup& g) {
  const double n = g.ranks;
  const bool inside = g.nodes() <= 1;
  const double gbps = inside ? g.intra_gbps : g.device_gbps;
  const double lat = inside ? g.intra_latency_us : g.inter_latency_us;
  return {2 * (n - 1) / n * bytes / (gbps * 1e9) * 1e3, 2 * (n - 1) * lat * 1e-3};
}

// NCCL's ring, laid out node by node: its channels spread over the node's NICs, so the bytes
// leaving a node run at the node's share; of its n - 1 hops per pass, one per node crosses nodes.
Terms node_ring(double bytes, const CollectiveGroup& g) {
  const double n = g.ranks, N = g.nodes();
  const double gbps = N > 1 ? std::min(g.intra_gbps, g.node_gbps) : g.intra_gbps;
  const double hops_inter = N > 1 ? N : 0, hops_intra = n - 1 - (N > 1 ? N - 1 : 0);
  return {2 * (n - 1) / n * bytes / (gbps * 1e9) * 1e3,
          2 * (hops_inter * g.inter_latency_us + std::max(0.0, hops_intra) * g.intra_latency_us) * 1e-3};
}

// NCCL's double binary tree across nodes, a chain inside each: every node sends and receives the
// whole message once up and once down (split over the two trees), depth log2 of the nodes.
Terms tree(double bytes, const CollectiveGroup& g) {
  const double N = g.nodes(), per = g.per_node;
  const double gbps = std::min(g.intra_gbps, g.node_gbps);
  return {2 * bytes / (gbps * 1e9) * 1e3,
          2 * (std::ceil(std::log2(std::max(N, 2.0))) * g.inter_latency_us + (per - 1) * g.intra_latency_us) * 1e-3};
}

// (Not among NCCL's choices: its measured bus bandwidth across 2-3 nodes, 91-96 GB/s of 100,
// matches its ring and tree, not this algorithm's fewer bytes across nodes.)
// Reduce-scatter inside the node, a ring all-reduce of each member's 1 / per_node shard across the
// nodes (each member on its own share of the node's NICs), all-gather inside the node.
Terms hierarchical(double bytes, const CollectiveGroup& g) {
  const double N = g.nodes(), per = g.per_node;
  const double inside = 2 * (per - 1) / per * bytes / (g.intra_gbps * 1e9) * 1e3;
  const double across = 2 * (N - 1) / N * bytes / per / (g.node_gbps / per * 1e9) * 1e3;
  return {inside + across, (2 * (per - 1) * g.intra_latency_us + 2 * (N - 1) * g.inter_latency_us) * 1e-3};
}

Terms choose(double bytes, const CollectiveGroup& g, CollectiveKind kind, Algorithm* algorithm) {
  if (kind == CollectiveKind::ring || g.nodes() <= 1) {
    *algorithm = Algorithm::ring;
    return kind == CollectiveKind::ring ? flat_ring(bytes, g) : node_ring(bytes, g);
  }
  Terms best = node_ring(bytes, g);
  *algorithm = Algorithm::ring;
  const Terms t = tree(bytes, g);
  if (t.ms() < best.ms()) best = t, *algorithm = Algorithm::tree;
  if (kind == CollectiveKind::hierarchical && g.per_node > 1) {
    const Terms h = hierarchical(bytes, g);
    if (h.ms() < best.ms()) best = h, *algorithm = Algorithm::hierarchical;
  }
  return best;
}

}  // namespace

const char* to_string(Algorithm a) {
  switch (a) {
    case Algorithm::ring: return "ring";
    case Algorithm::tree: return "tree";
    case Algorithm::hierarchical: return "hierarchical";
    case Algorithm::none: break;
  }
  return "none";
}

CollectiveCost allreduce(double bytes, const CollectiveGroup& g, CollectiveKind kind, double fraction) {
  CollectiveCost out;
  if (g.ranks <= 1 || bytes <= 0) return out;
  out.ms = fraction * choose(bytes, g, kind, &out.algorithm).ms();
  return out;
}

double allreduce_latency_ms(double bytes, const CollectiveGroup& g, CollectiveKind kind, double fraction) {
  if (g.ranks <= 1) return 0;
  Algorithm a = Algorithm::none;
  return fraction * choose(std::max(bytes, 1.0), g, kind, &a).latency_ms;
}

}  // namespace keel::sim
