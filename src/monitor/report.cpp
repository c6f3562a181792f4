#include "monitor/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string num(double v, const char* format = "%.4g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (step, value)
};

struct Marker {
  double step;
  std::string kind;  // checkpoint, recovery, alert
};

// A line plot of `series` against the step, with horizontal threshold lines and event markers.
std::string plot(const std::string& title, const std::vector<Series>& series,
                 const std::vector<std::pair<double, std::string>>& thresholds, const std::vector<Marker>& markers) {
  constexpr double W = 640, H = 220, L = 60, R = 10, T = 24, B = 30;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series& s : series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  }
  if (x0 > x1) return "";  // nothing to draw
  for (const auto& [v, label] : thresholds) y0 = std::min(y0, v), y1 = std::max(y1, v);
  if (y1 - y0 < 1e-12) y0 -= 0.5, y1 += 0.5;
  if (x1 - x0 < 1e-12) x0 -= 0.5, x1 += 0.5;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad, y1 += pad;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  std::ostringstream o;
  o << "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << " " << H << "\">";
  o << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#fff\"/>";
  o << "<text x=\"" << L << "\" y=\"16\" font-size=\"13\" font-weight=\"bold\">" << escape(title) << "</text>";
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B << "\" stroke=\"#888\"/>";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B << "\" stroke=\"#888\"/>";
  for (double f : {0.0, 0.5, 1.0}) {
    const double v = y0 + f * (y1 - y0);
    o << "<text x=\"" << L - 4 << "\" y=\"" << Y(v) + 4 << "\" font-size=\"10\" text-anchor=\"end\">" << num(v)
      << "</text>";
  }
  o << "<text x=\"" << L << "\" y=\"" << H - 10 << "\" font-size=\"10\">step " << num(x0, "%.0f") << "</text>";
  o << "<text x=\"" << W - R << "\" y=\"" << H - 10 << "\" font-size=\"10\" text-anchor=\"end\">step "
    << num(x1, "%.0f") << "</text>";
  for (const Marker& m : markers) {
    if (m.step < x0 || m.step > x1) continue;
    const char* color = m.kind == "alert" ? "#d33" : m.kind == "recovery" ? "#e90" : "#9ac";
    o << "<line x1=\"" << X(m.step) << "\" y1=\"" << T << "\" x2=\"" << X(m.step) << "\" y2=\"" << H - B
      << "\" stroke=\"" << color << "\" stroke-dasharray=\"2,3\"><title>" << m.kind << " at step " << m.step
      << "</title></line>";
  }
  for (const auto& [v, label] : thresholds) {
    o << "<line x1=\"" << L << "\" y1=\"" << Y(v) << "\" x2=\"" << W - R << "\" y2=\"" << Y(v)
      << "\" stroke=\"#d33\" stroke-dasharray=\"6,4\"/><text x=\"" << W - R - 4 << "\" y=\"" << Y(v) - 4
      << "\" font-size=\"10\" fill=\"#d33\" text-anchor=\"end\">" << escape(label) << "</text>";
  }
  double legend = L + 8.5 * static_cast<double>(title.size()) + 24;
  for (const Series& s : series) {
    std::ostringstream path;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      path << (path.tellp() == 0 ? "M" : "L") << num(X(x), "%.1f") << "," << num(Y(y), "%.1f");
    }
    o << "<path d=\"" << path.str() << "\" fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"1.5\"/>";
    if (s.points.size() == 1) {
      o << "<circle cx=\"" << X(s.points[0].first) << "\" cy=\"" << Y(s.points[0].second) << "\" r=\"3\" fill=\""
        << s.color << "\"/>";
    }
    o << "<text x=\"" << legend << "\" y=\"16\" font-size=\"11\" fill=\"" << s.color << "\">" << escape(s.name)
      << "</text>";
    legend += 9.0 * static_cast<double>(s.name.size()) + 20;
  }
  o << "</svg>";
  return o.str();
}

// Bytes per layer over the run: for each layer, what a ring all-reduce of float32 gradients would
// have sent and what was sent, as paired horizontal bars on one scale, the codec named beside them.
struct LayerBytes {
  std::string codec;
  double raw = 0, wire = 0;
};

std::string layer_bars(const std::map<int, LayerBytes>& layers, int n_layer) {
  if (layers.empty()) return "";
  double most = 0;
  for (const auto& [layer, b] : layers) most = std::max({most, b.raw, b.wire});
  if (most <= 0) return "";
  constexpr double W = 640, L = 110, R = 150, RowH = 26, T = 40;
  const double H = T + RowH * static_cast<double>(layers.size()) + 10;
  std::ostringstream o;
  o << "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\">";
  o << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#fff\"/>";
  o << "<text x=\"" << L << "\" y=\"16\" font-size=\"13\" font-weight=\"bold\">Gradient bytes per layer "
    << "(rank 0, whole run)</text>";
  o << "<text x=\"" << L << "\" y=\"32\" font-size=\"11\" fill=\"#aab\">float32</text><text x=\"" << L + 60
    << "\" y=\"32\" font-size=\"11\" fill=\"#4a90d9\">sent</text>";
  double y = T;
  for (const auto& [layer, b] : layers) {
    const std::string name = layer == 0 ? "embedding" : layer > n_layer ? "final norm" : "block " + std::to_string(layer - 1);
    const double raw_w = b.raw / most * (W - L - R), wire_w = b.wire / most * (W - L - R);
    o << "<text x=\"4\" y=\"" << y + 15 << "\" font-size=\"11\">" << escape(name) << "</text>";
    o << "<rect x=\"" << L << "\" y=\"" << y + 2 << "\" width=\"" << num(std::max(raw_w, 0.5), "%.1f")
      << "\" height=\"10\" fill=\"#aab\"><title>" << num(b.raw / 1e6) << " MB float32</title></rect>";
    o << "<rect x=\"" << L << "\" y=\"" << y + 12 << "\" width=\"" << num(std::max(wire_w, 0.5), "%.1f")
      << "\" height=\"10\" fill=\"#4a90d9\"><title>" << num(b.wire / 1e6) << " MB sent</title></rect>";
    o << "<text x=\"" << W - R + 6 << "\" y=\"" << y + 15 << "\" font-size=\"11\">" << escape(b.codec) << ", "
      << num(b.wire > 0 ? b.raw / b.wire : 1.0, "%.1f") << "x</text>";
    y += RowH;
  }
  o << "</svg>";
  return o.str();
}

// A mixture of experts over the run (the step lines' moe_layers): per MoE block, each expert's share of
// the (token, choice) pairs routed, as a table with a bar per expert; "" when the run has none.
std::string expert_shares(const std::vector<json>& steps) {
  std::map<int, std::vector<double>> tokens;  // block's store layer -> pairs per expert
  std::map<int, double> dropped;
  for (const json& l : steps) {
    if (!l.contains("moe_layers") || !l.at("moe_layers").is_array()) continue;
    for (const json& x : l.at("moe_layers")) {
      if (!x.is_object() || !x.contains("tokens") || !x.at("tokens").is_array()) continue;
      std::vector<double>& t = tokens[x.value("layer", 0)];
      const json& routed = x.at("tokens");
      if (t.size() < routed.size()) t.resize(routed.size(), 0.0);
      for (size_t e = 0; e < routed.size(); ++e) t[e] += routed[e].is_number() ? routed[e].get<double>() : 0.0;
      dropped[x.value("layer", 0)] += x.value("dropped", 0.0);
    }
  }
  if (tokens.empty()) return "";
  std::ostringstream o;
  o << "<h3>Tokens per expert (whole run)</h3><table><tr><th>MoE block</th><th>share of the routed pairs per expert"
       "</th><th>busiest / mean</th><th>dropped</th></tr>";
  for (const auto& [layer, t] : tokens) {
    double total = 0, most = 0;
    for (double v : t) total += v, most = std::max(most, v);
    o << "<tr><td>block " << layer - 1 << "</td><td><svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
      << 14 * t.size() + 4 << "\" height=\"44\">";
    for (size_t e = 0; e < t.size(); ++e) {
      const double share = total > 0 ? t[e] / total : 0, h = most > 0 ? 40 * t[e] / most : 0;
      o << "<rect x=\"" << 2 + 14 * e << "\" y=\"" << num(42 - h, "%.1f") << "\" width=\"11\" height=\""
        << num(std::max(h, 0.5), "%.1f") << "\" fill=\"#4a90d9\"><title>expert " << e << ": "
        << num(100 * share, "%.1f") << " %</title></rect>";
    }
    o << "</svg></td><td>" << num(total > 0 ? most / (total / static_cast<double>(t.size())) : 0.0, "%.2f")
      << "</td><td>" << num(dropped[layer], "%.0f") << " of " << num(total, "%.0f") << "</td></tr>";
  }
  o << "</table>";
  return o.str();
}

// A mixture of experts in the memory tiers (the step lines' tier_experts, runtime/expert_tiers.h):
// per MoE block and expert over the run, the pairs routed to it (moe_layers), its pages' first
// touches, hit rate, stall and bytes read, and its home step by step as a strip of one segment per
// run of steps in the same tier; "" when the run has none. Values that are not numbers (or, for a
// home, not a string) are left out as if absent.
std::string expert_tier_table(const std::vector<json>& steps) {
  struct Home {
    double first, last;
    std::string tier;
  };
  struct ExpertRun {
    double routed = 0, acquires = 0, hits = 0, stall_ms = 0, read_bytes = 0;
    std::vector<Home> homes;  // consecutive steps in one tier merged
  };
  std::map<int, std::map<int, ExpertRun>> blocks;  // store layer -> expert -> its run
  std::map<int, double> routed_in_block;
  double first_step = 1e300, last_step = -1e300;
  for (const json& l : steps) {
    if (!l.contains("tier_experts") || !l.at("tier_experts").is_array()) continue;
    const double step = l.value("step", 0.0);
    first_step = std::min(first_step, step), last_step = std::max(last_step, step);
    std::map<int, const json*> tokens;  // layer -> the step's pairs per expert
    if (l.contains("moe_layers") && l.at("moe_layers").is_array()) {
      for (const json& x : l.at("moe_layers")) {
        if (x.is_object() && x.contains("tokens") && x.at("tokens").is_array()) tokens[x.value("layer", 0)] = &x.at("tokens");
      }
    }
    for (const json& x : l.at("tier_experts")) {
      if (!x.is_object() || !x.contains("experts") || !x.at("experts").is_array()) continue;
      const int layer = x.value("layer", 0);
      const json& index = x.at("experts");
      auto at = [&](const char* field, size_t i) -> const json* {
        if (!x.contains(field) || !x.at(field).is_array() || i >= x.at(field).size()) return nullptr;
        return &x.at(field)[i];
      };
      auto number = [&](const char* field, size_t i) {
        const json* v = at(field, i);
        return v != nullptr && v->is_number() ? v->get<double>() : 0.0;
      };
      for (size_t i = 0; i < index.size(); ++i) {
        if (!index[i].is_number_integer()) continue;
        const int e = index[i].get<int>();
        ExpertRun& r = blocks[layer][e];
        r.acquires += number("acquires", i);
        r.hits += number("hits", i);
        r.stall_ms += number("stall_ms", i);
        r.read_bytes += number("read_bytes", i);
        const auto t = tokens.find(layer);
        if (t != tokens.end() && e >= 0 && static_cast<size_t>(e) < t->second->size() && (*t->second)[e].is_number()) {
          const double pairs = (*t->second)[e].get<double>();
          r.routed += pairs;
          routed_in_block[layer] += pairs;
        }
        const json* home = at("home", i);
        if (home == nullptr || !home->is_string()) continue;
        const std::string tier = home->get<std::string>();
        if (!r.homes.empty() && r.homes.back().tier == tier) r.homes.back().last = step;
        else r.homes.push_back({step, step, tier});
      }
    }
  }
  if (blocks.empty()) return "";
  const std::map<std::string, const char*> colors = {{"device", "#50b86c"}, {"host", "#e90"}, {"nvme", "#9b59b6"}};
  auto color = [&](const std::string& tier) {
    const auto c = colors.find(tier);
    return c == colors.end() ? "#aaa" : c->second;
  };
  constexpr double StripW = 300;
  const double span = std::max(last_step - first_step + 1, 1.0);
  std::ostringstream o;
  o << "<h3>Experts in the memory tiers (whole run)</h3><p>home over steps " << num(first_step, "%.0f") << "-"
    << num(last_step, "%.0f") << ":";
  for (const auto& [tier, c] : colors) o << " <span style=\"color:" << c << "\">&#9632; " << tier << "</span>";
  o << "</p><table><tr><th>MoE block</th><th>expert</th><th>routed pairs (share of the block's)</th>"
       "<th>first touches</th><th>hit rate</th><th>stall (ms)</th><th>read (MB)</th><th>home over steps</th>"
       "<th>home at the end</th></tr>";
  for (const auto& [layer, experts] : blocks) {
    for (const auto& [e, r] : experts) {
      const double in_block = routed_in_block[layer];
      o << "<tr><td>block " << layer - 1 << "</td><td>expert " << e << "</td><td>" << num(r.routed, "%.0f") << " ("
        << num(in_block > 0 ? 100 * r.routed / in_block : 0.0, "%.1f") << " %)</td><td>" << num(r.acquires, "%.0f")
        << "</td><td>" << (r.acquires > 0 ? num(100 * r.hits / r.acquires, "%.1f") + " %" : std::string("-"))
        << "</td><td>" << num(r.stall_ms, "%.1f") << "</td><td>" << num(r.read_bytes / 1e6, "%.2f") << "</td><td>";
      o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << StripW << "\" height=\"14\">";
      for (const Home& h : r.homes) {
        const double x = (h.first - first_step) / span * StripW, w = (h.last - h.first + 1) / span * StripW;
        o << "<rect x=\"" << num(x, "%.1f") << "\" y=\"1\" width=\"" << num(std::max(w, 0.5), "%.1f")
          << "\" height=\"12\" fill=\"" << color(h.tier) << "\"><title>"
          << (h.first == h.last ? "step " + num(h.first, "%.0f") : "steps " + num(h.first, "%.0f") + "-" + num(h.last, "%.0f"))
          << ": " << escape(h.tier) << "</title></rect>";
      }
      o << "</svg></td><td>" << (r.homes.empty() ? std::string("-") : escape(r.homes.back().tier)) << "</td></tr>";
    }
  }
  o << "</table>";
  return o.str();
}

// The pipeline's Gantt chart from a Chrome trace (complete "X" events, one row per pid: a rank).
// The trace is a file like any other: an event whose pid, ts or dur is not a number is skipped (and
// counted in `skipped`), and the rows are the pids that occur, in order, so a pid of 2^31 costs one
// row, not two billion.
std::string gantt(const json& trace, int* skipped) {
  const json& events = trace.is_object() ? trace.value("traceEvents", json::array()) : trace;
  if (!events.is_array()) return "";
  double t0 = 1e300, t1 = -1e300;
  std::vector<const json*> bars;
  std::map<int64_t, int> rows;  // pid -> row
  for (const json& e : events) {
    if (!e.is_object() || !e.contains("ph") || e.at("ph") != "X") continue;
    const json* pid = e.contains("pid") ? &e.at("pid") : nullptr;
    const json* ts = e.contains("ts") ? &e.at("ts") : nullptr;
    const json* dur = e.contains("dur") ? &e.at("dur") : nullptr;
    if (pid == nullptr || !pid->is_number_integer() || ts == nullptr || !ts->is_number() || dur == nullptr ||
        !dur->is_number() || !std::isfinite(ts->get<double>()) || !std::isfinite(dur->get<double>()) ||
        dur->get<double>() < 0) {
      ++*skipped;
      continue;
    }
    rows.emplace(pid->get<int64_t>(), 0);
    t0 = std::min(t0, ts->get<double>()), t1 = std::max(t1, ts->get<double>() + dur->get<double>());
    bars.push_back(&e);
  }
  if (bars.empty() || !(t1 > t0)) return "";
  int next = 0;
  for (auto& [pid, row] : rows) row = next++;
  constexpr double W = 900, L = 60, RowH = 22;
  const double H = 30 + static_cast<double>(rows.size()) * RowH;
  std::ostringstream o;
  o << "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\">";
  o << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#fff\"/>";
  o << "<text x=\"" << L << "\" y=\"16\" font-size=\"13\" font-weight=\"bold\">Pipeline step (last traced step)</text>";
  const std::map<char, const char*> colors = {{'F', "#4a90d9"}, {'B', "#e94e3c"}, {'W', "#50b86c"}};
  for (const json* e : bars) {
    const int row = rows.at(e->at("pid").get<int64_t>());
    const double x = L + (e->at("ts").get<double>() - t0) / (t1 - t0) * (W - L - 10);
    const double w = std::max(0.5, e->at("dur").get<double>() / (t1 - t0) * (W - L - 10));
    const std::string name = e->contains("name") && e->at("name").is_string() ? e->at("name").get<std::string>() : "";
    const auto c = colors.find(name.empty() ? '?' : name[0]);
    o << "<rect x=\"" << num(x, "%.1f") << "\" y=\"" << 24 + row * RowH << "\" width=\"" << num(w, "%.1f")
      << "\" height=\"" << RowH - 4 << "\" fill=\"" << (c == colors.end() ? "#aaa" : c->second) << "\"><title>"
      << escape(name) << "</title></rect>";
  }
  for (const auto& [pid, row] : rows) {
    o << "<text x=\"4\" y=\"" << 38 + row * RowH << "\" font-size=\"11\">rank " << pid << "</text>";
  }
  o << "</svg>";
  return o.str();
}

// The type of each field of a metrics line that the report reads: "number", "string", an object's
// own fields, or [the fields of an array's objects].
const json& metrics_line_types() {
  static const json types = json::parse(R"({
    "step": "number", "loss": "number", "val_loss": "number", "ms": "number", "tokens_per_s": "number",
    "samples_per_s": "number", "mfu": "number", "grad_norm_image": "number", "grad_norm_text": "number",
    "recall_i2t_at1": "number", "recall_i2t_at5": "number", "recall_t2i_at1": "number", "recall_t2i_at5": "number",
    "val_pairs": "number", "tier_hit_rate": "number", "tier_device_hit_rate": "number", "tier_host_hit_rate": "number",
    "tier_nvme_hit_rate": "number", "pipeline_bubble": "number", "sync_latency_ms": "number", "sync_jitter": "number",
    "energy_kwh_per_mtok": "number", "energy_source": "string", "ranks": "number",
    "sync_layers": [{"layer": "number", "raw_bytes": "number", "wire_bytes": "number", "codec": "string"}],
    "moe_imbalance": "number", "moe_dropped": "number", "moe_entropy": "number",
    "moe_layers": [{"layer": "number", "imbalance": "number", "dropped": "number", "entropy": "number",
                    "tokens": ["number"]}],
    "tier_experts": [{"layer": "number", "experts": ["number"], "acquires": ["number"], "hits": ["number"],
                      "stall_ms": ["number"], "read_bytes": ["number"], "home": ["string"]}],
    "tier_expert_hit_rate": "number", "tier_expert_stall_ms": "number", "tier_expert_read_bytes": "number",
    "event": "string", "started": "string", "host": "string", "cpu": "string", "threads_per_rank": "number",
    "peak_gflops": "number", "peak_how": "string",
    "model": {"preset": "string", "n_layer": "number", "n_embd": "number", "n_head": "number", "vocab_size": "number",
              "parameters": "number"},
    "batch": {"batch_size": "number", "seq_len": "number", "grad_accum": "number", "steps": "number"},
    "layout": {"ranks": "number", "data": "number", "pipeline": "number", "zero": "number", "codec": "string",
               "tiers": {"device_mib": "number", "host_mib": "number", "nvme_dir": "string"}}
  })");
  return types;
}

// Removes from object `j` each field the report reads whose value is not of the type `types` gives
// it, noting each in `skipped` ("WHERE: field 'a.b': expected a number, found a string"): a value
// written wrong costs that value, not the report of a whole run.
void drop_mistyped(json& j, const json& types, const std::string& where, const std::string& prefix,
                   std::vector<std::string>& skipped) {
  for (auto it = j.begin(); it != j.end();) {
    const auto type = types.find(it.key());
    if (type == types.end()) {
      ++it;
      continue;
    }
    const std::string field = prefix + it.key();
    json& v = it.value();
    std::string expected;
    if (type->is_string()) {
      expected = type->get<std::string>();
      if ((expected == "number" && v.is_number()) || (expected == "string" && v.is_string())) expected.clear();
    } else if (type->is_object()) {
      if (v.is_object()) drop_mistyped(v, *type, where, field + ".", skipped);
      else expected = "an object";
    } else if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i].is_object()) drop_mistyped(v[i], type->front(), where, field + "[" + std::to_string(i) + "].", skipped);
      }
    } else {
      expected = "an array";
    }
    if (expected.empty()) {
      ++it;
      continue;
    }
    auto a = [](const std::string& type) { return type == "null" ? type : (type[0] == 'a' || type[0] == 'o' ? "an " : "a ") + type; };
    if (expected == "number" || expected == "string") expected = a(expected);
    skipped.push_back(where + ": field '" + field + "': expected " + expected + ", found " + a(v.type_name()) + " (" +
                      v.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 40) + "); value skipped");
    it = j.erase(it);
  }
}

}  // namespace

std::string render_report(const std::string& run_dir, std::vector<std::string>* skipped_values) {
  const std::string metrics_path = run_dir + "/metrics.jsonl";
  check(fs::is_directory(run_dir), "report " + run_dir + ": not a directory");
  check(fs::exists(fs::symlink_status(metrics_path)), "report " + run_dir + ": not a run directory (no metrics.jsonl)");
  std::vector<json> steps, evals, events;
  std::vector<std::string> skipped;
  {
    const std::string text = read_text_file(metrics_path);
    int n = 0;
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const std::string line = text.substr(at, end - at);
      const std::string where = metrics_path + " line " + std::to_string(++n);
      at = end + 1;
      if (line.empty()) continue;
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception&) {
        // A run still going may be writing its last line: what does not parse there is not yet skipped.
        if (end < text.size()) skipped.push_back(where + ": not JSON; line skipped");
        continue;
      }
      if (!j.is_object()) {
        skipped.push_back(where + ": expected a JSON object, found " + j.dump().substr(0, 40) + "; line skipped");
        continue;
      }
      drop_mistyped(j, metrics_line_types(), where, "", skipped);
      if (j.contains("event")) events.push_back(j);
      else if (j.contains("val_loss")) evals.push_back(j);
      else if (j.contains("loss")) steps.push_back(j);
    }
  }
  MonitorConfig thresholds;
  std::string config_text;
  if (fs::exists(fs::symlink_status(run_dir + "/config.toml"))) {
    config_text = read_text_file(run_dir + "/config.toml");
    try {
      thresholds = Config::parse(config_text, run_dir + "/config.toml").monitor;
    } catch (const Error&) {
    }
  }
  auto series = [&](const std::vector<json>& lines, const char* field, const std::string& name, const std::string& color,
                    double scale = 1.0) {
    Series s{name, color, {}};
    for (const json& l : lines) {
      if (l.contains(field) && l.at(field).is_number()) {
        s.points.emplace_back(l.value("step", 0.0), l.at(field).get<double>() * scale);
      }
    }
    return s;
  };
  // Layer sums of the compressed sync's per-layer bytes (rank 0's view).
  std::map<int, LayerBytes> layer_bytes;
  for (const json& l : steps) {
    if (!l.contains("sync_layers") || !l.at("sync_layers").is_array() || !l.contains("ranks")) continue;
    for (const json& x : l.at("sync_layers")) {
      if (!x.is_object()) continue;
      LayerBytes& b = layer_bytes[x.value("layer", 0)];
      // What a ring all-reduce of float32 would have sent for it, as the sync summary counts.
      const double ranks = l.value("ranks", 2.0);
      b.raw += x.value("raw_bytes", 0.0) * 2 * (ranks - 1) / ranks;
      b.wire += x.value("wire_bytes", 0.0);
      const std::string codec = x.value("codec", "");
      if (codec != "none" || b.codec.empty()) b.codec = codec;
    }
  }
  // The run's first "run" line: model, sizes, hardware and layout; later ones are restarts. The
  // summary shows them; the events table has the rest.
  json run_line;
  int starts = 0;
  for (const json& e : events) {
    if (e.value("event", "") != "run") continue;
    if (starts++ == 0) run_line = e;
  }
  std::erase_if(events, [](const json& e) { return e.value("event", "") == "run"; });
  std::vector<Marker> markers;
  for (const json& e : events) {
    const std::string kind = e.value("event", "");
    if (kind == "checkpoint" || kind == "recovery" || kind == "alert") markers.push_back({e.value("step", 0.0), kind});
  }
  double tokens = 0, ms = 0;
  for (const json& l : steps) {
    ms += l.value("ms", 0.0);
    tokens += l.value("tokens_per_s", 0.0) * l.value("ms", 0.0) / 1e3;
  }
  std::ostringstream h;
  h << "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Keel run " << escape(run_dir) << "</title>"
    << "<style>body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse}"
       "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}svg.plot{display:block;"
       "margin:10px 0;border:1px solid #eee}pre{background:#f6f6f6;padding:8px;font-size:12px;max-height:300px;"
       "overflow:auto}</style></head><body>";
  h << "<h1>Keel run " << escape(run_dir) << "</h1><table>";
  auto row = [&](const std::string& k, const std::string& v) { h << "<tr><th>" << k << "</th><td>" << v << "</td></tr>"; };
  if (run_line.is_object()) {
    const json model = run_line.value("model", json::object()), batch = run_line.value("batch", json::object()),
               layout = run_line.value("layout", json::object());
    row("started", escape(run_line.value("started", "?")) + " on " + escape(run_line.value("host", "?")) +
                       (starts > 1 ? " (" + std::to_string(starts - 1) + " restarts)" : ""));
    row("model", "preset " + escape(model.value("preset", "?")) + ": " + std::to_string(model.value("n_layer", 0)) +
                     " layers, width " + std::to_string(model.value("n_embd", 0)) + ", " +
                     std::to_string(model.value("n_head", 0)) + " heads, vocabulary " +
                     std::to_string(model.value("vocab_size", 0)) + ", " +
                     num(model.value("parameters", 0.0) / 1e6, "%.2f") + "M parameters");
    row("batch", std::to_string(batch.value("batch_size", 0)) + " x " + std::to_string(batch.value("seq_len", 0)) +
                     " tokens x " + std::to_string(batch.value("grad_accum", 1)) + " accumulated, per data rank; " +
                     std::to_string(batch.value("steps", 0)) + " steps planned");
    std::string l = std::to_string(layout.value("ranks", 1)) + " ranks: " + std::to_string(layout.value("data", 1)) +
                    " data x " + std::to_string(layout.value("pipeline", 1)) + " pipeline, ZeRO-" +
                    std::to_string(layout.value("zero", 0)) + ", sync codec " + escape(layout.value("codec", "none"));
    if (layout.contains("tiers")) {
      const json& t = layout.at("tiers");
      l += ", tiers: device " + std::to_string(t.value("device_mib", 0)) + " MiB, host " +
           std::to_string(t.value("host_mib", 0)) + " MiB" +
           (t.value("nvme_dir", "").empty() ? "" : ", NVMe " + escape(t.value("nvme_dir", "")));
    }
    row("layout", l);
    row("hardware", escape(run_line.value("cpu", "?")) + ", " + std::to_string(run_line.value("threads_per_rank", 1)) +
                        " threads per rank; peak " + num(run_line.value("peak_gflops", 0.0), "%.1f") + " GFLOP/s (" +
                        escape(run_line.value("peak_how", "")) + ")");
  }
  row("steps", steps.empty() ? "0" : num(steps.back().value("step", 0.0), "%.0f"));
  row("training time", num(ms / 1e3, "%.1f") + " s");
  row("tokens", num(tokens, "%.0f"));
  row("mean tokens/s", ms > 0 ? num(tokens / (ms / 1e3), "%.0f") : "-");
  row("last train loss", steps.empty() ? "-" : num(steps.back().value("loss", 0.0)));
  row("first / last validation loss",
      evals.empty() ? "-" : num(evals.front().value("val_loss", 0.0)) + " / " + num(evals.back().value("val_loss", 0.0)));
  if (!evals.empty() && evals.back().contains("recall_i2t_at5")) {  // a dual encoder's zero-shot retrieval
    const json& e = evals.back();
    row("zero-shot retrieval (last evaluation)",
        "image->text R@1 " + num(e.value("recall_i2t_at1", 0.0), "%.3f") + ", R@5 " +
            num(e.value("recall_i2t_at5", 0.0), "%.3f") + "; text->image R@1 " +
            num(e.value("recall_t2i_at1", 0.0), "%.3f") + ", R@5 " + num(e.value("recall_t2i_at5", 0.0), "%.3f") +
            " over " + std::to_string(e.value("val_pairs", 0)) + " held-out pairs");
  }
  if (!steps.empty() && steps.back().contains("energy_kwh_per_mtok")) {
    row("energy", num(steps.back().value("energy_kwh_per_mtok", 0.0)) + " kWh per million tokens (" +
                      escape(steps.back().value("energy_source", "?")) + ")");
  }
  row("events", std::to_string(events.size()) + " (checkpoints, recoveries, alerts)");
  if (!skipped.empty()) {
    row("skipped", std::to_string(skipped.size()) + " values or lines of metrics.jsonl (the first: " + escape(skipped.front()) + ")");
  }
  h << "</table>";
  h << "<h2>Training</h2>";
  h << plot("Loss", {series(steps, "loss", "train", "#4a90d9"), series(evals, "val_loss", "validation", "#e94e3c")}, {},
            markers);
  h << plot("Tokens per second", {series(steps, "tokens_per_s", "tokens/s", "#50b86c")}, {}, markers);
  // A dual encoder's own figures (absent from a language model's lines: nothing drawn).
  h << plot("Image-caption pairs per second", {series(steps, "samples_per_s", "pairs/s", "#50b86c")}, {}, markers);
  h << plot("Zero-shot retrieval recall (held-out pairs)",
            {series(evals, "recall_i2t_at1", "image->text R@1", "#4a90d9"),
             series(evals, "recall_i2t_at5", "image->text R@5", "#1f5f99"),
             series(evals, "recall_t2i_at1", "text->image R@1", "#e94e3c"),
             series(evals, "recall_t2i_at5", "text->image R@5", "#9b2c1f")},
            {}, markers);
  h << plot("Tower gradient norms",
            {series(steps, "grad_norm_image", "image tower", "#4a90d9"),
             series(steps, "grad_norm_text", "text tower", "#e94e3c")},
            {}, markers);
  h << plot("MFU", {series(steps, "mfu", "MFU", "#9b59b6")}, {}, markers);
  h << plot("Tier hit rate",
            {series(steps, "tier_hit_rate", "off-device", "#4a90d9"),
             series(steps, "tier_device_hit_rate", "device", "#50b86c"),
             series(steps, "tier_host_hit_rate", "host", "#e90"), series(steps, "tier_nvme_hit_rate", "nvme", "#9b59b6")},
            {{thresholds.min_hit_rate, "target " + num(thresholds.min_hit_rate)}}, markers);
  h << plot("Pipeline bubble", {series(steps, "pipeline_bubble", "bubble", "#e94e3c")},
            {{thresholds.max_bubble, "target " + num(thresholds.max_bubble)}}, markers);
  h << plot("Gradient sync latency (ms)", {series(steps, "sync_latency_ms", "latency", "#4a90d9")}, {}, markers);
  h << plot("Gradient sync jitter", {series(steps, "sync_jitter", "jitter", "#e94e3c")},
            {{thresholds.max_sync_jitter, "target " + num(thresholds.max_sync_jitter)}}, markers);
  h << layer_bars(layer_bytes, run_line.is_object() ? run_line.value("model", json::object()).value("n_layer", 0) : 0);
  // A mixture of experts: per MoE block, its load imbalance (with the alert's threshold) and its
  // router's entropy, step by step; dropped pairs when a capacity drops any; the experts' shares.
  {
    static const char* colors[] = {"#4a90d9", "#e94e3c", "#50b86c", "#9b59b6", "#e90", "#1f5f99", "#9b2c1f", "#555"};
    std::map<int, Series> imbalance, entropy;
    for (const json& l : steps) {
      if (!l.contains("moe_layers") || !l.at("moe_layers").is_array()) continue;
      for (const json& x : l.at("moe_layers")) {
        if (!x.is_object()) continue;
        const int layer = x.value("layer", 0);
        const std::string name = "block " + std::to_string(layer - 1), color = colors[imbalance.size() % 8];
        auto add = [&](std::map<int, Series>& to, const char* field) {
          auto [it, fresh] = to.try_emplace(layer, Series{name, color, {}});
          if (x.contains(field) && x.at(field).is_number()) {
            it->second.points.emplace_back(l.value("step", 0.0), x.at(field).get<double>());
          }
        };
        add(imbalance, "imbalance");
        add(entropy, "entropy");
      }
    }
    auto values = [](const std::map<int, Series>& m) {
      std::vector<Series> out;
      for (const auto& [layer, s] : m) out.push_back(s);
      return out;
    };
    const std::string tier_table = expert_tier_table(steps);
    if (!imbalance.empty() || !tier_table.empty()) {
      h << "<h2>Mixture of experts</h2>";
      h << plot("MoE load imbalance (busiest expert / mean)", values(imbalance),
                {{thresholds.max_moe_imbalance, "alert above " + num(thresholds.max_moe_imbalance)}}, markers);
      h << plot("MoE router entropy (nats)", values(entropy), {}, markers);
      bool any_dropped = false;
      for (const json& l : steps) any_dropped = any_dropped || l.value("moe_dropped", 0.0) > 0;
      if (any_dropped) h << plot("MoE dropped pairs (over capacity)", {series(steps, "moe_dropped", "dropped", "#e94e3c")}, {}, markers);
      h << expert_shares(steps);
      // Experts homed in the memory tiers: their pages' hit rate, stall and reads step by step, and
      // each expert's figures and home over the run.
      h << plot("Experts' pages: hit rate", {series(steps, "tier_expert_hit_rate", "experts", "#4a90d9")},
                {{thresholds.min_hit_rate, "target " + num(thresholds.min_hit_rate)}}, markers);
      h << plot("Experts' pages: stall (ms per step)", {series(steps, "tier_expert_stall_ms", "stall", "#e94e3c")}, {},
                markers);
      h << plot("Experts' pages: bytes read (MB per step)",
                {series(steps, "tier_expert_read_bytes", "read", "#9b59b6", 1e-6)}, {}, markers);
      h << tier_table;
    }
  }
  h << plot("Energy (kWh per million tokens)", {series(steps, "energy_kwh_per_mtok", "kWh/Mtok", "#e90")}, {}, markers);
  if (fs::exists(fs::symlink_status(run_dir + "/pipeline_trace.json"))) {
    try {
      int skipped_events = 0;
      h << "<h2>Pipeline</h2>" << gantt(json::parse(read_text_file(run_dir + "/pipeline_trace.json")), &skipped_events);
      if (skipped_events > 0) {
        skipped.push_back(run_dir + "/pipeline_trace.json: " + std::to_string(skipped_events) +
                          " events without a numeric pid, ts or dur; skipped");
      }
    } catch (const json::exception&) {
      skipped.push_back(run_dir + "/pipeline_trace.json: not a JSON trace; no pipeline chart");
    }
  }
  h << "<h2>Events</h2><table><tr><th>step</th><th>event</th><th>details</th></tr>";
  for (const json& e : events) {
    json rest = e;
    rest.erase("event");
    rest.erase("step");
    h << "<tr><td>" << e.value("step", 0) << "</td><td>" << escape(e.value("event", "")) << "</td><td>"
      << escape(rest.dump()) << "</td></tr>";
  }
  h << "</table>";
  if (!config_text.empty()) h << "<h2>Configuration</h2><pre>" << escape(config_text) << "</pre>";
  h << "</body></html>\n";
  if (skipped_values != nullptr) *skipped_values = std::move(skipped);
  return h.str();
}

}  // namespace keel
