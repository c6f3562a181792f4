#include "sim/stack.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"
#include "core/toml_util.h"

namespace keel::sim {

namespace {

std::string number(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

}  // namespace

StackProfile StackProfile::load(const std::string& path, const std::string& name) {
  if (path.empty() && name == "keel") return StackProfile{};
  return parse(read_text_file(path), "stacks file " + path, name);
}

StackProfile StackProfile::parse(const std::string& toml_text, const std::string& what, const std::string& name) {
  const toml::table root = parse_toml(toml_text, what);
  const toml::table* stacks = root["stack"].as_table();
  check(stacks != nullptr, what + ": missing section [stack.NAME]");
  const toml::table* t = (*stacks)[name].as_table();
  if (t == nullptr) {
    std::string names;
    for (auto&& [k, v] : *stacks) names += (names.empty() ? "" : ", ") + std::string(k.str());
    throw Error(what + ": no stack '" + name + "' (expected one of " + names + ")");
  }
  StackProfile s;
  s.name = name;
  const std::string where = what + ": stack." + name;
  // Every key is required: a stack's figures carry their provenance in the file, none defaults.
  std::map<std::string, bool> seen;
  for (auto&& [k, v] : *t) seen[std::string(k.str())] = false;
  auto num = [&](const char* key, double lo, double hi, bool lo_open) {
    const std::optional<double> v = (*t)[key].value<double>();
    check(v.has_value() && std::isfinite(*v), where + ": key '" + key + "': expected a number");
    check((lo_open ? *v > lo : *v >= lo) && *v <= hi, where + ": key '" + key + "': expected " + (lo_open ? "> " : ">= ") +
                                                          number(lo) + " and <= " + number(hi) + ", found " + number(*v));
    seen[key] = true;
    return *v;
  };
  auto flag = [&](const char* key) {
    const std::optional<bool> v = (*t)[key].value<bool>();
    check(v.has_value(), where + ": key '" + key + "': expected true or false");
    seen[key] = true;
    return *v;
  };
  auto text = [&](const char* key, const std::vector<std::string>& choices) {
    const std::optional<std::string> v = (*t)[key].value<std::string>();
    std::string names;
    for (size_t i = 0; i < choices.size(); ++i) names += (i == 0 ? "\"" : i + 1 == choices.size() ? " or \"" : ", \"") + choices[i] + "\"";
    const auto it = v ? std::find(choices.begin(), choices.end(), *v) : choices.end();
    check(it != choices.end(), where + ": key '" + key + "': expected " + names + (v.has_value() ? ", found \"" + *v + "\"" : ""));
    seen[key] = true;
    return static_cast<int>(it - choices.begin());
  };
  s.kernel_efficiency = num("kernel_efficiency", 0, 1, true);
  s.overlap_grad_reduce = flag("overlap_grad_reduce");
  s.grad_reduce_bytes = num("grad_reduce_bytes", 1, 8, false);
  s.bucket_mb = num("bucket_mb", 0, 1e6, false);
  s.collective = static_cast<CollectiveKind>(text("collective", {"ring", "nccl", "hierarchical"}));
  s.param_bytes = num("param_bytes", 0, 16, true);
  s.grad_bytes = num("grad_bytes", 0, 16, true);
  s.state_bytes = num("state_bytes", 0, 32, false);
  s.keel_activations = text("activations", {"keel", "megatron"}) == 0;
  s.sequence_parallel = flag("sequence_parallel");
  s.flash_attention = flag("flash_attention");
  s.elementwise_values = num("elementwise_values", 0, 1000, false);
  s.score_bytes_forward = num("score_bytes_forward", 0, 64, false);
  s.score_bytes_backward = num("score_bytes_backward", 0, 64, false);
  s.block_pass_ms = num("block_pass_ms", 0, 1000, false);
  for (const auto& [key, used] : seen) check(used, where + ": unknown key '" + key + "'");
  return s;
}

}  // namespace keel::sim
