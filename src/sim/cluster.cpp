#include "sim/cluster.h"

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <variant>
#include <vector>

#include "comm/codec.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/toml_util.h"

namespace keel::sim {

namespace {

// One key of the file: where it goes, whether the file must give it, and the range it must be in.
struct Key {
  std::string section, name;
  std::variant<double*, int*, std::string*> target;
  bool required = true;
  double lo = 0, hi = 1e300;  // numbers: lo <= x <= hi (strings: one of `choices`, when given)
  bool lo_open = false;       // x > lo instead of x >= lo
  std::vector<std::string> choices;
};

Key num(const char* section, const char* name, std::variant<double*, int*, std::string*> target, bool required,
        double lo, double hi, bool lo_open = false) {
  Key k;
  k.section = section, k.name = name, k.target = target, k.required = required, k.lo = lo, k.hi = hi, k.lo_open = lo_open;
  return k;
}

Key text(const char* section, const char* name, std::string* target, bool required, std::vector<std::string> choices) {
  Key k;
  k.section = section, k.name = name, k.target = target, k.required = required, k.choices = std::move(choices);
  return k;
}

std::vector<Key> keys(Cluster& c) {
  std::vector<Key> out = {
      text("cluster", "name", &c.name, false, {}),
      num("cluster", "nodes", &c.nodes, true, 1, 1e6, false),
      num("cluster", "devices_per_node", &c.devices_per_node, true, 1, 1024, false),
      text("device", "name", &c.device.name, false, {}),
      num("device", "tflops_bf16", &c.device.tflops_bf16, true, 0, 1e6, true),
      num("device", "tflops_fp32", &c.device.tflops_fp32, true, 0, 1e6, true),
      num("device", "memory_gib", &c.device.memory_gib, true, 0, 1e6, true),
      num("device", "hbm_gbps", &c.device.hbm_gbps, true, 0, 1e7, true),
      num("device", "matmul_efficiency", &c.device.matmul_efficiency, false, 0, 1, true),
      num("device", "step_overhead_ms", &c.device.step_overhead_ms, false, -1e6, 1e6, false),
      num("host", "memory_gib", &c.host.memory_gib, true, 0, 1e7, true),
      num("host", "pcie_gbps", &c.host.pcie_gbps, true, 0, 1e6, true),
      num("host", "nvme_drives", &c.host.nvme_drives, false, 0, 1024, false),
      num("host", "nvme_gbps", &c.host.nvme_gbps, false, 0, 1e5, false),
      num("host", "nvme_tib", &c.host.nvme_tib, false, 0, 1e5, false),
      num("host", "memory_gbps", &c.host.memory_gbps, false, 0, 1e6, false),
      text("intra", "kind", &c.intra.kind, true, {"nvlink", "pcie"}),
      num("intra", "gbps", &c.intra.gbps, true, 0, 1e6, true),
      num("intra", "latency_us", &c.intra.latency_us, true, 0, 1e6, false),
      num("network", "gbit", &c.network.gbit, true, 0, 1e6, true),
      num("network", "nics_per_node", &c.network.nics_per_node, true, 1, 1024, false),
      num("network", "latency_us", &c.network.latency_us, true, 0, 1e6, false),
      text("network", "topology", &c.network.topology, true, {"fat-tree", "rail"}),
      num("network", "oversubscription", &c.network.oversubscription, false, 1, 1e3, false),
      num("network", "alltoall_latency_us", &c.network.alltoall_latency_us, false, 0, 1e9, false),
      num("network", "alltoall_gbps", &c.network.alltoall_gbps, false, 0, 1e6, false),
      num("network", "reduce_scatter_gbit", &c.network.reduce_scatter_gbit, false, 0, 1e6, false),
      num("network", "allgather_gbit", &c.network.allgather_gbit, false, 0, 1e6, false),
      num("network", "blocking_allreduce_gbit", &c.network.blocking_allreduce_gbit, false, 0, 1e6, false),
      num("variability", "jitter", &c.variability.jitter, false, 0, 1, false),
      num("variability", "straggler_fraction", &c.variability.straggler_fraction, false, 0, 1, false),
      num("variability", "straggler_slowdown", &c.variability.straggler_slowdown, false, 1, 100, false),
      num("reliability", "node_mtbf_hours", &c.reliability.node_mtbf_hours, false, 0, 1e9, false),
      num("reliability", "checkpoint_every_minutes", &c.reliability.checkpoint_every_minutes, false, 0, 1e6, false),
      num("reliability", "restart_minutes", &c.reliability.restart_minutes, false, 0, 1e6, false),
  };
  // codecs.<name>_encode / codecs.<name>_decode for every lossy codec (names as sync.codec spells them).
  for (int k = 1; k < 7; ++k) {
    const std::string name = codec_name(static_cast<CodecKind>(k));
    out.push_back(num("codecs", (name + "_encode").c_str(), &c.codecs.encode_gbps[k], false, 0, 1e6, false));
    out.push_back(num("codecs", (name + "_decode").c_str(), &c.codecs.decode_gbps[k], false, 0, 1e6, false));
  }
  return out;
}

std::string number(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

// [[min_dim, share], ...]: dimensions increasing, shares in (0, 1].
std::vector<std::pair<double, double>> gemm_points(const toml::node& node, const std::string& where) {
  const toml::array* a = node.as_array();
  check(a != nullptr && !a->empty(), where + ": expected an array of [smallest dimension, share] pairs");
  std::vector<std::pair<double, double>> out;
  for (const toml::node& item : *a) {
    const toml::array* pair = item.as_array();
    const std::optional<double> d = pair && pair->size() == 2 ? (*pair)[0].value<double>() : std::nullopt;
    const std::optional<double> e = pair && pair->size() == 2 ? (*pair)[1].value<double>() : std::nullopt;
    check(d && e && std::isfinite(*d) && std::isfinite(*e), where + ": expected [smallest dimension, share] pairs of numbers");
    check(*d >= 1 && (out.empty() || *d > out.back().first),
          where + ": expected dimensions >= 1 and increasing, found " + number(*d));
    check(*e > 0 && *e <= 1, where + ": expected shares in (0, 1], found " + number(*e));
    out.emplace_back(*d, *e);
  }
  return out;
}

}  // namespace

double Device::gemm_share(double min_dim) const {
  if (gemm_efficiency.empty()) return matmul_efficiency;
  if (min_dim <= gemm_efficiency.front().first) return gemm_efficiency.front().second;
  for (size_t i = 1; i < gemm_efficiency.size(); ++i) {
    const auto& [d1, e1] = gemm_efficiency[i];
    if (min_dim <= d1) {
      const auto& [d0, e0] = gemm_efficiency[i - 1];
      const double w = std::log2(min_dim / d0) / std::log2(d1 / d0);
      return e0 + w * (e1 - e0);
    }
  }
  return gemm_efficiency.back().second;
}

double Network::device_gbps(int devices_per_node, double measured_gbit) const {
  return (measured_gbit > 0 ? measured_gbit : gbit) / 8.0 * nics_per_node / devices_per_node / oversubscription;
}

Cluster Cluster::load(const std::string& path) { return parse(read_text_file(path), "cluster file " + path); }

Cluster Cluster::parse(const std::string& toml_text, const std::string& what) {
  Cluster c;
  c.network.oversubscription = 1;
  c.variability.straggler_slowdown = 1;
  toml::table root = parse_toml(toml_text, what);
  std::vector<Key> all = keys(c);
  std::map<std::string, Key*> by_name;
  std::set<std::string> sections;
  for (Key& k : all) {
    by_name[k.section + "." + k.name] = &k;
    sections.insert(k.section);
  }
  std::set<std::string> seen;
  for (auto&& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    check(section_node.is_table() && sections.count(section) > 0,
          what + ": unknown section '" + section + "' (expected cluster, device, host, intra, network, variability, "
                 "reliability, codecs)");
    for (auto&& [key, node] : *section_node.as_table()) {
      const std::string full = section + "." + std::string(key.str());
      if (full == "device.gemm_efficiency") {
        c.device.gemm_efficiency = gemm_points(node, what + ": key '" + full + "'");
        continue;
      }
      const auto it = by_name.find(full);
      check(it != by_name.end(), what + ": unknown key '" + full + "'");
      Key& k = *it->second;
      seen.insert(full);
      if (auto* s = std::get_if<std::string*>(&k.target)) {
        const std::optional<std::string> v = node.value<std::string>();
        check(v.has_value(), what + ": key '" + full + "': expected a string");
        std::string options;
        for (const std::string& o : k.choices) options += (options.empty() ? "" : ", ") + o;
        check(k.choices.empty() || std::find(k.choices.begin(), k.choices.end(), *v) != k.choices.end(),
              what + ": key '" + full + "': expected one of " + options + ", found \"" + *v + "\"");
        **s = *v;
        continue;
      }
      const std::optional<double> v = node.value<double>();
      check(v.has_value() && std::isfinite(*v), what + ": key '" + full + "': expected a number");
      const bool ok = (k.lo_open ? *v > k.lo : *v >= k.lo) && *v <= k.hi;
      check(ok, what + ": key '" + full + "': expected " + (k.lo_open ? "> " : ">= ") + number(k.lo) + " and <= " +
                    number(k.hi) + ", found " + number(*v));
      if (auto* i = std::get_if<int*>(&k.target)) {
        check(*v == std::floor(*v), what + ": key '" + full + "': expected a whole number, found " + number(*v));
        **i = static_cast<int>(*v);
      } else {
        *std::get<double*>(k.target) = *v;
      }
    }
  }
  for (const Key& k : all) {
    check(!k.required || seen.count(k.section + "." + k.name) > 0,
          what + ": missing key '" + k.section + "." + k.name + "'");
  }
  check(c.network.topology != "rail" || c.network.nics_per_node == c.devices_per_node,
        what + ": key 'network.nics_per_node': a rail topology has one NIC per device (" +
            std::to_string(c.devices_per_node) + "), found " + std::to_string(c.network.nics_per_node));
  check(!c.device.gemm_efficiency.empty() || c.device.matmul_efficiency > 0,
        what + ": missing key 'device.matmul_efficiency' (or 'device.gemm_efficiency')");
  check(c.host.nvme_drives == 0 || c.host.nvme_gbps > 0,
        what + ": key 'host.nvme_gbps': expected > 0 with " + std::to_string(c.host.nvme_drives) + " NVMe drives");
  return c;
}

}  // namespace keel::sim
