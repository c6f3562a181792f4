// Memory tiers in `keel simulate`: one pipeline rank's pages homed by Keel's own placement
// (store/placement.h place_pages, on a layout-only store of the rank's layers) within the budgets
// a cluster gives it, and one step's acquires replayed under the tier manager's policy
// (store/tiers.h): the acquires in the order Keel's layers lease them (forward: each layer's
// parameters; B: its parameters again; W: its gradients; the optimizer's update of a chunk,
// deferred to just before the next forward first uses it), prefetch of the next `lookahead`
// acquires while the current one computes, Belady eviction (the unpinned page used farthest
// ahead; never one needed sooner than the page fetched), modified pages written back to their
// home when evicted, a consumed gradient refetched as zeros (nothing moves), AdamW moments homed
// on the host updated there (the host reads and writes them; the gradient goes down the link and
// the parameter comes back). Transfers queue on the device's links: host -> device and
// device -> host over PCIe (each way), NVMe reads and writes over the node's drives shared by its
// devices, and then PCIe. Compute follows the step's simulated timeline; an acquire whose pages
// have not arrived waits, and every wait delays the rest of the rank's step (a stall).
//
// Simplifications, each conservative or neutral: the steady state is a second step replayed
// after a first (the recorded schedule, as the manager uses it from its second step); an evicted
// page's memory is free at once (Keel holds it until its write-back completes); ZeRO-2's
// discarded gradient shards are not modelled (the rank holds all of its gradients); the stall
// of the rank with the most parameters delays the whole step.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt.h"
#include "pipeline/schedule.h"
#include "sim/cluster.h"
#include "store/tiers.h"

namespace keel::sim {

struct TierPrediction {
  bool enabled = false;
  double stall_ms = 0;           // per step: acquires waiting for their pages
  double host_optimizer_ms = 0;  // per step: host-homed moments updated on the host (exposed)
  double bytes_read[kNumTiers] = {};     // per step, into the device from each home (device: 0)
  double bytes_written[kNumTiers] = {};  // per step, written back to each home
  // First touches of a page per step (TierCounters::acquires, by home), and those that found the
  // page present (hits).
  double touches[kNumTiers] = {}, hits[kNumTiers] = {};
  double home_gib[kNumTiers] = {};  // bytes homed on each tier (per device)
  double device_budget_gib = 0;     // device memory left to pages beside the activations
  std::vector<std::string> notes;   // placement's demotions
  // Share of first touches served from each tier: a present page from the device, an absent one
  // from its home.
  double served_share(Tier t) const;
  double hit_rate(Tier home) const { return touches[static_cast<int>(home)] > 0 ? hits[static_cast<int>(home)] / touches[static_cast<int>(home)] : 1.0; }
};

struct TierInputs {
  // Per layer of the model (pipeline/layout.h's indices): F, B (with any recomputed F) and W,
  // milliseconds per micro-batch.
  std::vector<double> forward, backward_input, backward_weight;
  std::vector<LayerRange> stages;          // every stage's layers (the schedule's stage index)
  const pipeline::Schedule* schedule = nullptr;
  const pipeline::Timeline* timeline = nullptr;  // the step simulated without tiers
  int rank = 0;                            // the pipeline rank modelled
  int data = 1, tensor = 1;                // replicas (ZeRO shards) and tensor degree
  double activations_gib = 0;              // device memory the rank's activations take
  // The rank's pages: its chunks, at no fewer bytes than give this many (the replay costs time per
  // page; placement and the policy work by layer, so finer cuts change little).
  int max_chunks = 1024;
};

// Throws keel::Error (naming the cluster key or the budget) when the pages cannot be placed: too
// little device memory for one operation's working set, or pages that must go to NVMe on a
// cluster without drives.
TierPrediction predict_tiers(const Config& config, const Cluster& cluster, const TierInputs& in);

}  // namespace keel::sim
