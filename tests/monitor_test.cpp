// Monitoring: energy from RAPL counters (a powercap tree the test writes) or modelled from CPU
// time; alerts that fire after monitor.alert_after steps out of range and resolve once back; and
// alerts provoked for real in training runs.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/fileio.h"
#include "monitor/alerts.h"
#include "monitor/energy.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

void write_zone(const std::string& dir, uint64_t energy_uj, uint64_t max_uj) {
  fs::create_directories(dir);
  testing::write_text(dir + "/energy_uj", std::to_string(energy_uj) + "\n");
  testing::write_text(dir + "/max_energy_range_uj", std::to_string(max_uj) + "\n");
}

TEST(Rapl, PackagesAreSummedSubZonesIgnoredAndWraparoundHandled) {
  testing::TempDir dir("keel-rapl");
  const std::string root = dir.path();
  write_zone(root + "/intel-rapl:0", 1'000'000, 10'000'000);
  write_zone(root + "/intel-rapl:0:0", 5, 10'000'000);  // a sub-zone (cores): inside package 0's count
  write_zone(root + "/intel-rapl:1", 9'500'000, 10'000'000);
  fs::create_directories(root + "/intel-rapl-mmio:0");   // not a package counter
  RaplCounters rapl(root);
  ASSERT_TRUE(rapl.available());
  EXPECT_EQ(rapl.packages(), 2u);
  EXPECT_EQ(rapl.take_joules(), 0.0);  // the first read only starts the count
  write_zone(root + "/intel-rapl:0", 3'500'000, 10'000'000);  // +2.5 J
  write_zone(root + "/intel-rapl:1", 500'000, 10'000'000);    // wrapped: +1.0 J
  EXPECT_NEAR(rapl.take_joules(), 3.5, 1e-9);
  EXPECT_FALSE(RaplCounters(root + "/none").available());
}

TEST(Energy, FromRaplWhereThereIsRaplElseModelledFromCpuTime) {
  testing::TempDir dir("keel-energy");
  write_zone(dir.path() + "/intel-rapl:0", 0, 1'000'000'000);
  MonitorConfig with;
  with.powercap = dir.path();
  Communicator& world = Communicator::world();
  EnergyMeter rapl(with, world, 1e6);
  EXPECT_TRUE(rapl.measured());
  rapl.before_step(0);
  write_zone(dir.path() + "/intel-rapl:0", 7'200'000, 1'000'000'000);  // 7.2 J
  rapl.after_step(1);
  EXPECT_NEAR(rapl.step_joules(), 7.2, 1e-9);
  json line;
  rapl.add_step_fields(10, line);
  EXPECT_EQ(line.at("energy_source"), "rapl");
  EXPECT_NEAR(line.at("energy_kwh_per_mtok").get<double>(), 7.2 / 3.6e6, 1e-15);

  MonitorConfig without;
  without.powercap = dir.path() + "/absent";
  without.cpu_watts = 10;
  EnergyMeter modelled(without, world, 1000);
  EXPECT_FALSE(modelled.measured());
  modelled.before_step(0);
  volatile double x = 0;
  for (int i = 0; i < 20'000'000; ++i) x = x + std::sqrt(static_cast<double>(i));  // burn CPU time
  modelled.after_step(1);
  EXPECT_GT(modelled.step_joules(), 0.0);
  EXPECT_LT(modelled.step_joules(), 10 * 60.0);  // at most a minute of CPU at 10 W
  modelled.add_step_fields(10, line);
  EXPECT_EQ(line.at("energy_source"), "modelled");
}

TEST(AlertRules, FireAfterConsecutiveStepsAndResolveOnce) {
  MonitorConfig c;
  c.alert_after = 3;
  std::vector<json> events;
  Alerts alerts(c, [&](const json& e) { events.push_back(e); });
  auto step = [&](int n, double hit) {
    alerts.observe_step(json{{"step", n}, {"loss", 3.0}, {"ms", 100.0}, {"tier_hit_rate", hit}});
  };
  step(1, 0.5);
  step(2, 0.5);
  EXPECT_TRUE(events.empty());
  step(3, 0.95);  // back in range: the count starts over
  for (int n = 4; n <= 6; ++n) step(n, 0.5);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].at("state"), "firing");
  EXPECT_EQ(events[0].at("metric"), "tier_hit_rate");
  EXPECT_EQ(events[0].at("step"), 6);
  EXPECT_DOUBLE_EQ(events[0].at("threshold").get<double>(), 0.90);
  EXPECT_EQ(alerts.firing(), std::vector<std::string>{"tier_hit_rate"});
  for (int n = 7; n <= 8; ++n) step(n, 0.5);  // still firing: nothing new
  for (int n = 9; n <= 11; ++n) step(n, 0.97);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].at("state"), "resolved");
  EXPECT_EQ(events[1].at("step"), 11);
  EXPECT_TRUE(alerts.firing().empty());

  // A loss that is not finite, or far above the recent mean, and a step far slower than usual.
  Alerts spikes(c, [&](const json& e) { events.push_back(e); });
  events.clear();
  for (int n = 1; n <= 10; ++n) spikes.observe_step(json{{"step", n}, {"loss", 3.0}, {"ms", 100.0}});
  for (int n = 11; n <= 13; ++n) spikes.observe_step(json{{"step", n}, {"loss", 30.0}, {"ms", 900.0}});
  std::set<std::string> fired;
  for (const json& e : events) fired.insert(e.at("metric").get<std::string>());
  EXPECT_EQ(fired, (std::set<std::string>{"loss", "ms"}));
}

class MonitorRun : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 12);
  }
  std::vector<json> events(const std::string& run) {
    std::vector<json> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      const json line = json::parse(text.substr(at, end - at));
      if (line.value("event", "") == "alert") out.push_back(line);
      at = end + 1;
    }
    return out;
  }
  testing::TempDir dir{"keel-monitor"};
};

// Memory tiers: the first step records the schedule (no prefetch yet), so first touches miss; from
// the second step prefetch follows it. With alert_after = 1 the hit-rate alert fires on step 1 and
// resolves on step 2, in a real tiered run.
TEST_F(MonitorRun, TierHitRateAlertFiresWhilePrefetchHasNoScheduleAndResolves) {
  fs::create_directories(dir / "nvme");
  const testing::CommandResult r = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "tiers" +
      " --set tier.device_mib=1 --set tier.host_mib=8 --set tier.nvme_dir=" + dir / "nvme" +
      " --set monitor.alert_after=1 --set train.eval_every=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> e = events("tiers");
  ASSERT_GE(e.size(), 2u) << r.output;
  EXPECT_EQ(e[0].at("metric"), "tier_hit_rate");
  EXPECT_EQ(e[0].at("state"), "firing");
  EXPECT_EQ(e[1].at("metric"), "tier_hit_rate");
  EXPECT_EQ(e[1].at("state"), "resolved");
  EXPECT_NE(r.output.find("keel: ALERT at step 1: tier_hit_rate "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("keel: alert resolved at step "), std::string::npos) << r.output;
}

// A badly cut pipeline: stage 0 holds the embedding alone, stage 1 everything else, so stage 0
// idles most of each step and the bubble alert fires.
TEST_F(MonitorRun, BubbleAlertFiresForABadlyCutPipeline) {
  const testing::CommandResult r = testing::run_keel(
      "launch -n 2 -- train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "pipe" +
      " --set parallel.pipeline=2 --set parallel.stage_boundaries=1 --set train.eval_every=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> e = events("pipe");
  ASSERT_FALSE(e.empty()) << r.output;
  EXPECT_EQ(e[0].at("metric"), "pipeline_bubble");
  EXPECT_EQ(e[0].at("state"), "firing");
  EXPECT_GT(e[0].at("value").get<double>(), 0.05);
}

}  // namespace
}  // namespace keel
