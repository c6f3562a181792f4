#include "sim/tier_model.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>

#include "core/error.h"
#include "model/model_layout.h"
#include "sim/step_model.h"
#include "store/chunk_store.h"
#include "store/placement.h"

namespace keel::sim {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int64_t kNever = std::numeric_limits<int64_t>::max() / 4;
// Device memory kept beside pages and activations (kernels' workspace, the allocator's slack).
constexpr double kReserveGiB = 1.0;

// One acquire: the pages an operation pins while it computes.
struct Acquire {
  std::vector<int> read, write;  // page indices (chunk * kNumPlanes + plane)
  double start = 0, ms = 0;      // in the step's tier-free timeline
  bool optimizer = false;        // AdamW's update: its gradient pages are consumed
};

// A transfer link: one direction of PCIe, or the NVMe drives' share.
struct Channel {
  double free_at = 0;
};

}  // namespace

double TierPrediction::served_share(Tier t) const {
  double all = 0;
  for (int i = 0; i < kNumTiers; ++i) all += touches[i];
  if (all <= 0) return t == Tier::device ? 1.0 : 0.0;
  double served = 0;
  for (int i = 0; i < kNumTiers; ++i) {
    const double misses = touches[i] - hits[i];
    if (t == Tier::device) served += hits[i];
    else if (i == static_cast<int>(t)) served += misses;
  }
  return served / all;
}

TierPrediction predict_tiers(const Config& config, const Cluster& cluster, const TierInputs& in) {
  const ModelConfig& m = config.model;
  TierPrediction out;
  out.enabled = true;
  const pipeline::Schedule& schedule = *in.schedule;
  std::vector<LayerRange> mine;
  for (size_t s = 0; s < in.stages.size(); ++s) {
    if (schedule.stage_rank[s] == in.rank) mine.push_back(in.stages[s]);
  }
  // The rank's pages, as Keel's model registers them (nothing allocated), moments sharded as
  // ZeRO shards them (replica 0's share).
  const std::vector<double> params = layer_params(m);
  double bytes = 0;
  for (const LayerRange& r : mine) {
    for (int i = r.first; i <= r.last; ++i) bytes += params[static_cast<size_t>(i)] * sizeof(float);
  }
  ChunkStore store(std::max<int64_t>(config.store.chunk_bytes, static_cast<int64_t>(bytes / std::max(in.max_chunks, 1)) / 4096 * 4096));
  register_layout(store, model_layout(m, mine));
  store.finalize_layout();
  const auto& chunks = store.chunks();
  const int n = static_cast<int>(chunks.size());
  if (config.parallel.zero > 0 && in.data > 1) {
    // Replica 0's share of the chunks, balanced by elements as ChunkPartition::balanced cuts them
    // (not called: it refuses shards beyond MPI's 2^31-element counts, a limit of Keel's
    // collectives today, not of the layout).
    int64_t total = 0, sum = 0;
    for (const Chunk& c : chunks) total += c.numel;
    int end = 0;
    while (end < n && sum + chunks[end].numel / 2 <= total / in.data) sum += chunks[end++].numel;
    store.shard_moments(0, std::max(end, 1));
  }
  const int m_begin = store.moment_chunks().first, m_end = store.moment_chunks().second;  // (lambdas capture them)

  // Budgets per device: what the device memory leaves beside the activations; the node's host
  // memory and NVMe drives shared by its devices. Placement sees full-width pages; a tensor
  // group's device holds 1/tensor of each, so its budgets are scaled up alike.
  const double tp = in.tensor;
  const double budget = (cluster.device.memory_gib - in.activations_gib - kReserveGiB) * kGiB;
  out.device_budget_gib = budget / kGiB;
  char what[240];
  std::snprintf(what, sizeof what, "simulate: memory tiers: %.1f GiB of device memory beside %.1f GiB of activations",
                std::max(0.0, budget / kGiB), in.activations_gib);
  check(budget > 0, std::string(what) + " leaves nothing for pages (more pipeline stages, tensor parallelism or fewer micro-batches in flight)");
  TierConfig t = config.tier;
  t.device_mib = static_cast<int64_t>(budget * tp) >> 20;
  t.host_mib = static_cast<int64_t>(cluster.host.memory_gib * 1024 / cluster.devices_per_node * tp);
  t.nvme_dir = "(simulated)";  // (checked against the cluster's drives below)
  Placement placement;
  try {
    placement = place_pages(t, store);
  } catch (const Error& e) {
    throw Error(std::string(what) + ", " + std::to_string(static_cast<int64_t>(cluster.host.memory_gib / cluster.devices_per_node)) +
                " GiB of host memory per device and " + std::to_string(cluster.host.nvme_drives) +
                " NVMe drives per node: " + e.what());
  }
  out.notes = placement.notes;
  for (int i = 0; i < kNumTiers; ++i) out.home_gib[i] = static_cast<double>(placement.bytes[i]) / tp / kGiB;
  if (placement.bytes[static_cast<int>(Tier::nvme)] > 0) {
    char none[240];
    std::snprintf(none, sizeof none, "simulate: memory tiers: %.1f GiB of pages per device go to NVMe (by tier class or for "
                  "want of host memory) but the cluster has no NVMe drives (host.nvme_drives)", out.home_gib[static_cast<int>(Tier::nvme)]);
    check(cluster.host.nvme_drives > 0, none);
  }
  if (cluster.host.nvme_tib > 0) {
    const double nvme_per_device_gib = cluster.host.nvme_drives * cluster.host.nvme_tib * 1024 / cluster.devices_per_node;
    char need[200];
    std::snprintf(need, sizeof need, "simulate: memory tiers: %.0f GiB of pages go to NVMe per device, the node's drives give each %.0f GiB",
                  out.home_gib[static_cast<int>(Tier::nvme)], nvme_per_device_gib);
    check(out.home_gib[static_cast<int>(Tier::nvme)] <= nvme_per_device_gib, need);
  }

  const int pages = n * kNumPlanes;
  auto exists = [&](int c, int p) { return p < static_cast<int>(Plane::adam_m) || (c >= m_begin && c < m_end); };
  std::vector<double> page_bytes(static_cast<size_t>(pages), 0.0);
  std::vector<Tier> home(static_cast<size_t>(pages), Tier::device);
  for (int c = 0; c < n; ++c) {
    for (int p = 0; p < kNumPlanes; ++p) {
      if (!exists(c, p)) continue;
      page_bytes[c * kNumPlanes + p] = 4.0 * static_cast<double>(chunks[c].numel) / tp;
      home[c * kNumPlanes + p] = placement.homes[c * kNumPlanes + p];
    }
  }
  auto moments_at_home = [&](int c) {
    return exists(c, 2) && home[c * kNumPlanes + 2] == Tier::host && home[c * kNumPlanes + 3] == Tier::host;
  };
  std::vector<std::vector<int>> layer_chunks(static_cast<size_t>(m.n_layer + 2));
  for (int c = 0; c < n; ++c) layer_chunks[static_cast<size_t>(chunks[c].layer)].push_back(c);

  // The step's acquires, from the rank's simulated timeline.
  const bool tied = !m.llama() || m.tie_embeddings.value_or(false);
  const int head = m.n_layer + 1;
  std::vector<Acquire> seq;
  std::vector<bool> updated(layer_chunks.size(), false);
  auto pages_of = [&](int layer, Plane plane, std::vector<int>& to) {
    for (int c : layer_chunks[static_cast<size_t>(layer)]) to.push_back(c * kNumPlanes + static_cast<int>(plane));
  };
  auto add_optimizer = [&](int layer, double start) {  // AdamW's update, chunk by chunk
    for (int c : layer_chunks[static_cast<size_t>(layer)]) {
      Acquire a;
      a.optimizer = true, a.start = start;
      a.read.push_back(c * kNumPlanes + static_cast<int>(Plane::grad));
      a.write.push_back(c * kNumPlanes + static_cast<int>(Plane::param));
      if (exists(c, 2) && !moments_at_home(c)) {
        a.write.push_back(c * kNumPlanes + static_cast<int>(Plane::adam_m));
        a.write.push_back(c * kNumPlanes + static_cast<int>(Plane::adam_v));
      }
      seq.push_back(std::move(a));
    }
  };
  const std::vector<pipeline::Interval>& ivs = in.timeline->per_rank[static_cast<size_t>(in.rank)];
  double end_of_compute = 0;
  for (const pipeline::Interval& iv : ivs) {
    if (!pipeline::is_compute(iv.instr.op)) continue;
    const LayerRange& s = in.stages[static_cast<size_t>(iv.instr.stage)];
    const bool fwd = iv.instr.op == pipeline::Op::forward;
    const std::vector<double>& cost = fwd ? in.forward
                                      : iv.instr.op == pipeline::Op::backward_input ? in.backward_input : in.backward_weight;
    double total = 0;
    for (int l = s.first; l <= s.last; ++l) total += cost[static_cast<size_t>(l)];
    double at = iv.start;
    for (int k = 0; k <= s.last - s.first; ++k) {
      const int l = fwd ? s.first + k : s.last - k;
      if (fwd && config.tier.defer_update && !updated[static_cast<size_t>(l)]) {
        updated[static_cast<size_t>(l)] = true;  // the update runs just before the forward first uses the chunk
        add_optimizer(l, at);
        if (l == head && tied) add_optimizer(0, at);
      }
      Acquire a;
      a.start = at;
      a.ms = total > 0 ? (iv.end - iv.start) * cost[static_cast<size_t>(l)] / total : 0.0;
      const bool weight = iv.instr.op == pipeline::Op::backward_weight;
      pages_of(l, weight ? Plane::grad : Plane::param, weight ? a.write : a.read);
      if (l == head && tied) {
        pages_of(0, weight ? Plane::grad : Plane::param, weight ? a.write : a.read);  // the tied embedding's chunks
      }
      at += a.ms;
      if (!a.read.empty() || !a.write.empty()) seq.push_back(std::move(a));
    }
    end_of_compute = std::max(end_of_compute, iv.end);
  }
  for (size_t l = 0; l < layer_chunks.size(); ++l) {
    if (!updated[l]) add_optimizer(static_cast<int>(l), end_of_compute);  // (defer_update = false, or a replica)
  }
  // Host-homed moments are updated on the host: it reads and writes them and the parameter, and
  // reads the gradient; the gradient crosses PCIe down and the parameter back.
  double at_home = 0;
  for (int c = m_begin; c < m_end; ++c) {
    if (moments_at_home(c)) at_home += static_cast<double>(chunks[c].numel) / tp;
  }
  if (at_home > 0) {
    char need[200];
    std::snprintf(need, sizeof need, "simulate: memory tiers: %.2f GiB of AdamW moments are homed on the host and updated there, "
                  "but the cluster file gives no 'host.memory_gbps'", at_home * 8 / kGiB);
    check(cluster.host.memory_gbps > 0, need);
    out.host_optimizer_ms = std::max(at_home * 24 / (cluster.host.memory_gbps * 1e9 / cluster.devices_per_node),
                                     at_home * 4 / (cluster.host.pcie_gbps * 1e9)) * 1e3;
  }

  // Each page's uses (acquire positions) within a step.
  const int64_t N = static_cast<int64_t>(seq.size());
  std::vector<std::vector<int>> uses(static_cast<size_t>(pages));
  for (int64_t i = 0; i < N; ++i) {
    for (const std::vector<int>* list : {&seq[i].read, &seq[i].write}) {
      for (int p : *list) {
        if (uses[p].empty() || uses[p].back() != i) uses[p].push_back(static_cast<int>(i));
      }
    }
  }
  auto next_use = [&](int p, int64_t g) -> int64_t {  // the first use after global position g
    const std::vector<int>& u = uses[static_cast<size_t>(p)];
    if (u.empty()) return kNever;
    const int64_t pass = g / N, local = g % N;
    const auto it = std::upper_bound(u.begin(), u.end(), static_cast<int>(local));
    return it != u.end() ? pass * N + *it : (pass + 1) * N + u.front();
  };

  // The replay: two steps, the second one counted.
  struct PageState {
    bool present = false, dirty = false, zero = true;
    int pinned = 0;
    double ready_at = 0;
    int64_t key = kNever;  // next use when last touched (its place among the evictable)
  };
  std::vector<PageState> st(static_cast<size_t>(pages));
  std::set<std::pair<int64_t, int>> evictable;  // present, unpinned, not device-homed
  double device_used = 0;
  for (int p = 0; p < pages; ++p) {
    if (page_bytes[p] > 0 && home[p] == Tier::device) st[p].present = true, device_used += page_bytes[p];
  }
  const double pcie = cluster.host.pcie_gbps * 1e9;
  const double nvme = cluster.host.nvme_drives > 0
                          ? std::min(pcie, cluster.host.nvme_drives * cluster.host.nvme_gbps * 1e9 / cluster.devices_per_node) : pcie;
  Channel h2d, d2h, drives;
  bool counting = false;
  auto evict = [&](int p, double now) {
    PageState& s = st[p];
    evictable.erase({s.key, p});
    s.present = false;
    device_used -= page_bytes[p];
    if (!s.dirty) return;
    s.dirty = false;
    const double b = page_bytes[p];
    if (home[p] == Tier::host) {
      d2h.free_at = std::max(now, d2h.free_at) + b / pcie * 1e3;
    } else {
      const double start = std::max({now, d2h.free_at, drives.free_at});
      d2h.free_at = drives.free_at = start + b / nvme * 1e3;
    }
    if (counting) out.bytes_written[static_cast<int>(home[p])] += b;
  };
  auto make_room = [&](double b, int64_t horizon, double now) {
    while (device_used + b > budget) {
      if (evictable.empty()) return false;
      const auto last = std::prev(evictable.end());
      if (last->first <= horizon) return false;
      evict(last->second, now);
    }
    return true;
  };
  auto fetch = [&](int p, int64_t horizon, double now) {
    PageState& s = st[p];
    if (s.present) return true;
    if (!make_room(page_bytes[p], horizon, now)) return false;
    s.present = true;
    device_used += page_bytes[p];
    const double b = page_bytes[p];
    if (s.zero) {
      s.ready_at = now;  // a consumed gradient: a memset, nothing moves
    } else if (home[p] == Tier::host) {
      s.ready_at = h2d.free_at = std::max(now, h2d.free_at) + b / pcie * 1e3;
    } else {
      const double start = std::max({now, h2d.free_at, drives.free_at});
      s.ready_at = h2d.free_at = drives.free_at = start + b / nvme * 1e3;
    }
    if (counting && !s.zero) out.bytes_read[static_cast<int>(home[p])] += b;
    s.key = next_use(p, horizon < 0 ? 0 : horizon - 1);
    evictable.insert({s.key, p});
    return true;
  };
  const int lookahead = config.tier.prefetch ? std::max(config.tier.lookahead, 0) : 0;
  const double step_span = in.timeline->makespan;
  double delay = 0, prev_end = 0, delay_at_counting = 0;
  std::vector<int64_t> touched_in_pass(static_cast<size_t>(pages), -1);
  std::vector<int> op_pages;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) counting = true, delay_at_counting = delay;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t g = pass * N + i;
      const Acquire& a = seq[i];
      double now = std::max(a.start + pass * step_span + delay, prev_end);
      op_pages.assign(a.read.begin(), a.read.end());
      op_pages.insert(op_pages.end(), a.write.begin(), a.write.end());
      for (int p : op_pages) {
        if (page_bytes[p] <= 0 || touched_in_pass[p] == pass) continue;
        touched_in_pass[p] = pass;
        if (!counting) continue;
        const int h = static_cast<int>(home[p]);
        out.touches[h] += 1;
        if (st[p].present && st[p].ready_at <= now) out.hits[h] += 1;
      }
      for (int p : op_pages) {  // on demand: anything not needed before this acquire may go
        if (page_bytes[p] <= 0 || st[p].present) continue;
        check(fetch(p, g, now), "simulate: memory tiers: one operation's pages do not fit the device budget");
      }
      double ready = now;
      for (int p : op_pages) {
        if (page_bytes[p] <= 0) continue;
        if (st[p].pinned++ == 0 && home[p] != Tier::device) evictable.erase({st[p].key, p});
        ready = std::max(ready, st[p].ready_at);
      }
      delay += ready - now;
      now = ready;
      // Prefetch the next acquires' pages while this one computes (the recorded schedule).
      bool room = true;
      for (int j = 1; j <= lookahead && room && j < N; ++j) {
        const int64_t gj = g + j;
        const Acquire& b = seq[gj % N];
        for (const std::vector<int>* list : {&b.read, &b.write}) {
          for (int p : *list) {
            if (page_bytes[p] <= 0 || st[p].present) continue;
            if (!fetch(p, gj, now)) { room = false; break; }
          }
          if (!room) break;
        }
      }
      prev_end = now + a.ms;
      for (size_t k = 0; k < op_pages.size(); ++k) {
        const int p = op_pages[k];
        if (page_bytes[p] <= 0) continue;
        PageState& s = st[p];
        const bool written = k >= a.read.size();  // (an acquire's read and written pages are disjoint)
        if (--s.pinned > 0) continue;
        const bool consumed = a.optimizer && static_cast<int>(p % kNumPlanes) == static_cast<int>(Plane::grad);
        if (consumed) {  // AdamW zeroed it: declared zero, given back, next fetched as a memset
          s.zero = true, s.dirty = false;
          if (home[p] != Tier::device) s.present = false, device_used -= page_bytes[p];
          continue;
        }
        if (written) s.dirty = home[p] != Tier::device, s.zero = false;
        if (home[p] == Tier::device) continue;
        s.key = next_use(p, g);
        evictable.insert({s.key, p});
      }
    }
  }
  out.stall_ms = delay - delay_at_counting;
  return out;
}

}  // namespace keel::sim
