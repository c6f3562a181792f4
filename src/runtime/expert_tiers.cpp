#include "runtime/expert_tiers.h"

#include <algorithm>
#include <functional>
#include <cstdio>

#include "core/error.h"
#include "core/text.h"
#include "model/moe.h"
#include "store/block_file.h"
#include "store/expert_homes.h"

namespace keel {

namespace {

int64_t slot_bytes(const Chunk& c) { return static_cast<int64_t>(BlockFile::align_up(static_cast<size_t>(c.numel) * 4)); }

}  // namespace

ExpertTiers::ExpertTiers(const TierConfig& config, ChunkStore& store, TieredMemory& tiers, GPT& model,
                         Communicator& dp, int64_t device_reserve, int rehome_every, bool print_notes,
                         Communicator* stages, uint8_t absent_planes)
    : config_(config), manager_(tiers.manager()), dp_(dp), stages_(stages), rehome_every_(rehome_every),
      print_notes_(print_notes) {
  const ModelConfig& m = model.config();
  block_experts_ = m.moe_experts;
  for (int l = 0; l < m.n_layer; ++l) {
    if (!m.moe_block(l)) continue;
    // (In a pipeline this rank builds its stage's blocks only.)
    if (model.has_layer(l + 1)) {
      if (MoeStats* s = model.layer(l + 1).moe_stats()) {
        stats_.push_back(s);
        layers_.push_back(s->layer);
        index_.push_back(static_cast<int>(all_layers_.size()));
      }
    }
    all_layers_.push_back(l + 1);
  }
  routed_.assign(stats_.size() * static_cast<size_t>(block_experts_), 0.0);
  planned_ = routed_;
  // Each expert's parameter and gradient pages, from the chunks that hold its weights.
  const std::vector<Tier>& homes = tiers.placement().homes;
  const auto [m_begin, m_end] = store.moment_chunks();
  int64_t other_device = 0, other_host = 0, largest_slot = 0;
  std::vector<uint8_t> is_expert_page(homes.size(), 0);
  for (const Chunk& c : store.chunks()) {
    largest_slot = std::max(largest_slot, slot_bytes(c));
    if (c.expert < 0) continue;
    const auto block = std::find(layers_.begin(), layers_.end(), c.layer);
    if (block == layers_.end()) continue;
    const int b = static_cast<int>(block - layers_.begin());
    auto it = std::find_if(experts_.begin(), experts_.end(),
                           [&](const Expert& e) { return e.block == b && e.index == c.expert; });
    if (it == experts_.end()) {
      experts_.push_back(Expert{b, c.expert, {}, 0, homes[static_cast<size_t>(c.id) * kNumPlanes], {}, {}});
      it = experts_.end() - 1;
    }
    for (Plane p : {Plane::param, Plane::grad}) {
      if ((absent_planes >> static_cast<int>(p)) & 1) continue;
      it->pages.push_back({c.id, p});
      it->bytes += slot_bytes(c);
      is_expert_page[static_cast<size_t>(c.id) * kNumPlanes + static_cast<int>(p)] = 1;
    }
  }
  // The rooms the experts may share: the budgets less every other page homed there (moments
  // only within this rank's shard), the reserve on the device and two NVMe staging buffers on host.
  for (const Chunk& c : store.chunks()) {
    for (int p = 0; p < kNumPlanes; ++p) {
      const size_t i = static_cast<size_t>(c.id) * kNumPlanes + p;
      if (is_expert_page[i] || ((absent_planes >> p) & 1) ||
          (p >= static_cast<int>(Plane::adam_m) && (c.id < m_begin || c.id >= m_end))) {
        continue;
      }
      if (homes[i] == Tier::device) other_device += c.numel * 4;
      if (homes[i] == Tier::host) other_host += slot_bytes(c);
    }
  }
  device_room_ = std::max<int64_t>(0, (config.device_mib << 20) - other_device - device_reserve);
  host_room_ = std::max<int64_t>(0, (config.host_mib << 20) - other_host - 2 * largest_slot);
}

void ExpertTiers::after_step(int64_t step) {
  for (Expert& e : experts_) {
    e.step = PageCounters{};
    for (const PageRef& p : e.pages) e.step += manager_.take_page_counters(p);
    e.total += e.step;
  }
  for (size_t b = 0; b < stats_.size(); ++b) {
    const std::vector<double>& tokens = stats_[b]->tokens;
    std::transform(tokens.begin(), tokens.end(), routed_.begin() + static_cast<std::ptrdiff_t>(b * tokens.size()),
                   routed_.begin() + static_cast<std::ptrdiff_t>(b * tokens.size()), std::plus<>());
  }
  note_.clear();
  if (rehome_every_ > 0 && step % rehome_every_ == 0) rehome();
}

void ExpertTiers::rehome() {
  // Each expert's share: the pairs every rank of the data group routed to it (with sharded experts,
  // the rows its holders received from their expert groups).
  if (dp_.size() > 1 && !routed_.empty()) dp_.allreduce_sum(routed_.data(), routed_.size());
  planned_ = routed_;
  planned_once_ = true;
  std::fill(routed_.begin(), routed_.end(), 0.0);
  plan_and_move(planned_);
}

void ExpertTiers::plan_and_move(const std::vector<double>& routed) {
  std::vector<double> shares;
  std::vector<int64_t> bytes;
  std::vector<Tier> current;
  for (const Expert& e : experts_) {
    shares.push_back(routed.at(static_cast<size_t>(e.block * block_experts_ + e.index)));
    bytes.push_back(e.bytes);
    current.push_back(e.home);
  }
  ExpertHomesInput in;
  in.shares = shares;
  in.bytes = bytes;
  in.current = current;
  in.device_room = device_room_;
  in.host_room = host_room_;
  in.nvme = !config_.nvme_dir.empty();
  const std::vector<Tier> plan = plan_expert_homes(in);
  std::vector<PageRef> pages;
  std::vector<Tier> homes;
  int moved = 0;
  for (size_t k = 0; k < experts_.size(); ++k) {
    Expert& e = experts_[k];
    for (const PageRef& p : e.pages) {
      if (manager_.home(p) == plan[k]) continue;
      pages.push_back(p);
      homes.push_back(plan[k]);
    }
    moved += e.home != plan[k];
    e.home = plan[k];
  }
  if (pages.empty()) return;
  const std::vector<int64_t> bytes_to = manager_.rehome_pages(pages, homes, 0);
  rehomings_++;
  int on[kNumTiers] = {};
  for (const Expert& e : experts_) on[static_cast<int>(e.home)]++;
  note_ = "experts re-homed by routing share: " + std::to_string(moved) + " moved (" + format_mib(bytes_to[0]) +
          " to device, " + format_mib(bytes_to[1]) + " to host, " + format_mib(bytes_to[2]) + " to nvme); now " +
          std::to_string(on[0]) + " on device, " + std::to_string(on[1]) + " on host, " + std::to_string(on[2]) +
          " on nvme";
  if (print_notes_) std::printf("keel: %s\n", note_.c_str());
}

void ExpertTiers::print_startup() const {
  if (rehome_every_ == 0) return;
  std::printf("keel: tier.experts = by_frequency: %zu experts, re-homed every %d steps within %s of the device and %s "
              "of host DRAM\n",
              experts_.size(), rehome_every_, format_mib(device_room_).c_str(), format_mib(host_room_).c_str());
}

std::vector<ExpertTiers::Figures> ExpertTiers::line_figures() {
  std::vector<Figures> out;
  if (stages_ == nullptr || stages_->size() == 1) {
    for (const Expert& e : experts_) out.push_back({layers_[static_cast<size_t>(e.block)], e.index, e.step, e.home});
    return out;
  }
  // Every block of the model, per expert: held, first touches, hits, stall, bytes read, home;
  // each block's rows from its one stage (the others add zeros: exact).
  constexpr size_t kWidth = 6;
  const size_t E = static_cast<size_t>(block_experts_);
  std::vector<double> table(all_layers_.size() * E * kWidth, 0.0);
  for (const Expert& e : experts_) {
    double* r = table.data() + (static_cast<size_t>(index_[static_cast<size_t>(e.block)]) * E + static_cast<size_t>(e.index)) * kWidth;
    r[0] = 1;
    r[1] = static_cast<double>(e.step.acquires), r[2] = static_cast<double>(e.step.hits), r[3] = e.step.stall_ms;
    r[4] = static_cast<double>(e.step.bytes_read), r[5] = static_cast<double>(static_cast<int>(e.home));
  }
  if (!table.empty()) stages_->allreduce_sum(table.data(), table.size());
  for (size_t b = 0; b < all_layers_.size(); ++b) {
    for (size_t x = 0; x < E; ++x) {
      const double* r = table.data() + (b * E + x) * kWidth;
      if (r[0] == 0) continue;
      Figures f;
      f.layer = all_layers_[b], f.index = static_cast<int>(x);
      f.step.acquires = static_cast<uint64_t>(r[1]), f.step.hits = static_cast<uint64_t>(r[2]), f.step.stall_ms = r[3];
      f.step.bytes_read = static_cast<uint64_t>(r[4]);
      f.home = static_cast<Tier>(static_cast<int>(r[5]));
      out.push_back(f);
    }
  }
  return out;
}

void ExpertTiers::add_step_fields(double, nlohmann::json& line) {
  const std::vector<Figures> figures = line_figures();  // (by block, then expert)
  nlohmann::json blocks = nlohmann::json::array();
  uint64_t acquires = 0, hits = 0, read = 0;
  double stall = 0;
  for (size_t i = 0; i < figures.size();) {
    const int layer = figures[i].layer;
    nlohmann::json j = {{"layer", layer}};
    std::vector<int> index;
    std::vector<uint64_t> touches, hit, bytes;
    std::vector<double> stall_ms;
    std::vector<std::string> home;
    for (; i < figures.size() && figures[i].layer == layer; ++i) {
      const Figures& f = figures[i];
      index.push_back(f.index);
      touches.push_back(f.step.acquires);
      hit.push_back(f.step.hits);
      stall_ms.push_back(f.step.stall_ms);
      bytes.push_back(f.step.bytes_read);
      home.push_back(tier_name(f.home));
      acquires += f.step.acquires, hits += f.step.hits, read += f.step.bytes_read, stall += f.step.stall_ms;
    }
    j["experts"] = index;
    j["acquires"] = touches;
    j["hits"] = hit;
    j["stall_ms"] = stall_ms;
    j["read_bytes"] = bytes;
    j["home"] = home;
    blocks.push_back(std::move(j));
  }
  line["tier_experts"] = std::move(blocks);
  line["tier_expert_hit_rate"] = acquires ? static_cast<double>(hits) / static_cast<double>(acquires) : 1.0;
  line["tier_expert_stall_ms"] = stall;
  line["tier_expert_read_bytes"] = read;
  if (!note_.empty()) line["tier_experts_rehomed"] = note_;
}

void ExpertTiers::carry(const ExpertTiers& from) {
  // Every block of the model, per expert: routed since the last plan, the last plan's share, the
  // step's and the run's page counters (first touches, hits, stall, bytes read); each block's
  // rows from the old stage that held it (the others add zeros: exact).
  constexpr size_t kWidth = 10;
  const size_t E = static_cast<size_t>(block_experts_);
  std::vector<double> table(all_layers_.size() * E * kWidth, 0.0);
  auto row = [&](int block, int expert) {
    return table.data() + (static_cast<size_t>(block) * E + static_cast<size_t>(expert)) * kWidth;
  };
  auto put = [](double* r, const PageCounters& c) {
    r[0] = static_cast<double>(c.acquires), r[1] = static_cast<double>(c.hits), r[2] = c.stall_ms;
    r[3] = static_cast<double>(c.bytes_read);
  };
  auto take = [](const double* r) {
    PageCounters c;
    c.acquires = static_cast<uint64_t>(r[0]), c.hits = static_cast<uint64_t>(r[1]), c.stall_ms = r[2];
    c.bytes_read = static_cast<uint64_t>(r[3]);
    return c;
  };
  for (size_t b = 0; b < from.index_.size(); ++b) {
    for (size_t x = 0; x < E; ++x) {
      double* r = row(from.index_[b], static_cast<int>(x));
      r[0] = from.routed_[b * E + x];
      r[1] = from.planned_[b * E + x];
    }
  }
  for (const Expert& e : from.experts_) {
    double* r = row(from.index_[static_cast<size_t>(e.block)], e.index);
    put(r + 2, e.step);
    put(r + 6, e.total);
  }
  if (stages_ != nullptr && stages_->size() > 1 && !table.empty()) stages_->allreduce_sum(table.data(), table.size());
  for (size_t b = 0; b < index_.size(); ++b) {
    for (size_t x = 0; x < E; ++x) {
      const double* r = row(index_[b], static_cast<int>(x));
      routed_[b * E + x] = r[0];
      planned_[b * E + x] = r[1];
    }
  }
  for (Expert& e : experts_) {
    const double* r = row(index_[static_cast<size_t>(e.block)], e.index);
    e.step = take(r + 2);
    e.total = take(r + 6);
  }
  rehomings_ = from.rehomings_;
  note_ = from.note_;
  planned_once_ = from.planned_once_;
  if (planned_once_) plan_and_move(planned_);  // (this stage's rooms: the last plan's homes for its blocks)
}

std::string ExpertTiers::progress_fragment(double) const {
  uint64_t acquires = 0, hits = 0;
  for (const Expert& e : experts_) acquires += e.step.acquires, hits += e.step.hits;
  char buf[64];
  std::snprintf(buf, sizeof buf, "experts hit %.1f%%",
                acquires ? 100.0 * static_cast<double>(hits) / static_cast<double>(acquires) : 100.0);
  return buf;
}

void ExpertTiers::print_summary() const {
  uint64_t acquires = 0, hits = 0, read = 0;
  double stall = 0;
  for (const Expert& e : experts_) {
    acquires += e.total.acquires, hits += e.total.hits, read += e.total.bytes_read, stall += e.total.stall_ms;
  }
  std::printf("routed experts in the tiers over this run: %zu experts, hit rate %.1f%% (%llu first touches), "
              "%.1f ms stalled, %s read%s\n",
              experts_.size(), acquires ? 100.0 * static_cast<double>(hits) / static_cast<double>(acquires) : 100.0,
              static_cast<unsigned long long>(acquires), stall, format_mib(static_cast<int64_t>(read)).c_str(),
              rehome_every_ > 0 ? (", " + std::to_string(rehomings_) + " re-homings by routing share").c_str() : "");
}

}  // namespace keel
