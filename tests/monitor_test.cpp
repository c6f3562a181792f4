// Monitoring: energy from RAPL counters (a powercap tree the test writes) or modelled from CPU
// time; alerts that fire after monitor.alert_after steps out of range and resolve once back; and
// alerts provoked for real in training runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <signal.h>
#include <sys/stat.h>

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

// A counter file that is a FIFO (or another special file) is no counter, and is not waited on.
TEST(Rapl, ACounterThatIsNotARegularFileIsNoCounter) {
  testing::TempDir dir("keel-rapl-fifo");
  const std::string root = dir.path();
  write_zone(root + "/intel-rapl:0", 1'000'000, 10'000'000);
  fs::create_directories(root + "/intel-rapl:1");
  ASSERT_EQ(::mkfifo((root + "/intel-rapl:1/energy_uj").c_str(), 0600), 0);
  ::alarm(120);  // a reader that waits on the FIFO ends the test (SIGALRM) instead of hanging it
  RaplCounters rapl(root);
  EXPECT_EQ(rapl.packages(), 1u);
  fs::remove(root + "/intel-rapl:0/energy_uj");
  ASSERT_EQ(::mkfifo((root + "/intel-rapl:0/energy_uj").c_str(), 0600), 0);  // after the start
  EXPECT_EQ(rapl.take_joules(), 0.0);
  ::alarm(0);
}

TEST(Energy, FromRaplWhereThereIsRaplElseModelledFromCpuTime) {
  testing::TempDir dir("keel-energy");
  write_zone(dir.path() + "/intel-rapl:0", 0, 1'000'000'000);
  MonitorConfig with;
  with.powercap = dir.path();
  Communicator& world = Communicator::world();
  // Steps of 1 and then 2 million tokens (a curriculum doubling the length).
  EnergyMeter rapl(with, world, [](int64_t step) { return 1e6 * static_cast<double>(step + 1); });
  EXPECT_TRUE(rapl.measured());
  rapl.before_step(0);
  write_zone(dir.path() + "/intel-rapl:0", 7'200'000, 1'000'000'000);  // 7.2 J
  rapl.after_step(1);
  EXPECT_NEAR(rapl.step_joules(), 7.2, 1e-9);
  json line;
  rapl.add_step_fields(10, line);
  EXPECT_EQ(line.at("energy_source"), "rapl");
  EXPECT_NEAR(line.at("energy_kwh_per_mtok").get<double>(), 7.2 / 3.6e6, 1e-15);
  rapl.before_step(1);
  write_zone(dir.path() + "/intel-rapl:0", 14'400'000, 1'000'000'000);  // 7.2 J more, over twice the tokens
  rapl.after_step(2);
  rapl.add_step_fields(10, line);
  EXPECT_NEAR(line.at("energy_kwh_per_mtok").get<double>(), 7.2 / 3.6e6 / 2, 1e-15);

  MonitorConfig without;
  without.powercap = dir.path() + "/absent";
  without.cpu_watts = 10;
  EnergyMeter modelled(without, world, [](int64_t) { return 1000.0; });
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

// A mixture of experts' imbalance rule counts its own run of steps (monitor.moe_imbalance_after),
// not alert_after's.
TEST(AlertRules, MoeImbalanceFiresAfterItsOwnRunOfStepsAndResolves) {
  MonitorConfig c;
  c.alert_after = 2;
  c.max_moe_imbalance = 1.5;
  c.moe_imbalance_after = 4;
  std::vector<json> events;
  Alerts alerts(c, [&](const json& e) { events.push_back(e); });
  auto step = [&](int n, double imbalance) {
    alerts.observe_step(json{{"step", n}, {"loss", 3.0}, {"ms", 100.0}, {"moe_imbalance", imbalance}});
  };
  for (int n = 1; n <= 3; ++n) step(n, 2.0);
  EXPECT_TRUE(events.empty());  // 3 steps: past alert_after, not moe_imbalance_after
  step(4, 1.5);                 // at the threshold is in range: the count starts over
  for (int n = 5; n <= 8; ++n) step(n, 1.6);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].at("metric"), "moe_imbalance");
  EXPECT_EQ(events[0].at("rule"), "monitor.max_moe_imbalance");
  EXPECT_EQ(events[0].at("step"), 8);
  EXPECT_DOUBLE_EQ(events[0].at("threshold").get<double>(), 1.5);
  for (int n = 9; n <= 11; ++n) step(n, 1.0);
  EXPECT_EQ(events.size(), 1u);
  step(12, 1.0);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].at("state"), "resolved");
  EXPECT_EQ(events[1].at("step"), 12);
}

class MonitorRun : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 12);
  }
  // The alert events of run/metrics.jsonl. A live run may be writing its last line: only whole
  // lines (ended by a newline) are read.
  std::vector<json> events(const std::string& run) {
    std::vector<json> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t at = 0; at < text.size();) {
      const size_t end = text.find('\n', at);
      if (end == std::string::npos) break;
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
// resolves on step 2, in a real tiered run. Device and host tiers only (tier.ffn = host): the trainer copies a
// host-homed page when its prefetch starts, so a prefetched page is present when its acquire comes,
// however loaded the machine (an NVMe read still in flight at its acquire counts as a miss: with an
// NVMe tier the hit rate would depend on the machine's load).
TEST_F(MonitorRun, TierHitRateAlertFiresWhilePrefetchHasNoScheduleAndResolves) {
  const testing::CommandResult r = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "tiers" +
      " --set tier.device_mib=1 --set tier.host_mib=8 --set tier.ffn=host" +
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

// The loss rule, for real. A corpus whose first 30,000 tokens are the toy language and whose last
// 10,000 are uniform noise, read in file order: the loss falls to about 1.2, then the noise lifts
// it to about ln 64 = 4.2, past twice the recent mean (the spike fires); once the recent mean
// has caught up the loss is in range again (it resolves). And a learning rate that blows the
// weights up makes the loss not finite (the rule fires with an infinite threshold).
TEST_F(MonitorRun, LossSpikeAndNonFiniteLossAlertsFireInRealRuns) {
  Rng rng(11);
  std::vector<uint16_t> tokens(40000);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool noise = i >= 30000 || rng.uniform() < 0.1;
    tokens[i] = static_cast<uint16_t>(noise ? rng.below(64) : (i * 7 + i / 13) % 64);
  }
  write_token_shard(dir / "shift.bin", tokens);
  const testing::CommandResult r = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "shift" + " --set data.train=" +
      dir / "shift.bin" + " --set data.shuffle=false --set train.steps=300 --set train.eval_every=0" +
      " --set monitor.loss_spike=2 --set monitor.alert_after=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<json> loss;
  for (const json& e : events("shift")) {
    if (e.at("metric") == "loss") loss.push_back(e);
  }
  ASSERT_EQ(loss.size(), 2u) << r.output;
  EXPECT_EQ(loss[0].at("state"), "firing");
  EXPECT_GT(loss[0].at("step").get<int64_t>(), 200);  // where the noise starts (30,000 / 128 tokens a step)
  EXPECT_GT(loss[0].at("value").get<double>(), loss[0].at("threshold").get<double>());
  EXPECT_EQ(loss[1].at("state"), "resolved");

  const testing::CommandResult nan = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "nan" +
      " --set optim.lr=1e30 --set optim.warmup_steps=0 --set optim.skip_nonfinite_steps=3 --set monitor.alert_after=1" +
      " --set train.eval_every=0");
  EXPECT_EQ(nan.exit_code, 4) << nan.output;  // a non-finite step past the allowed ones ends the run
  const std::vector<json> e = events("nan");
  ASSERT_FALSE(e.empty()) << nan.output;
  EXPECT_EQ(e[0].at("metric"), "loss");
  EXPECT_EQ(e[0].at("state"), "firing");
  EXPECT_FALSE(e[0].contains("threshold"));  // infinite: not written
  EXPECT_NE(nan.output.find("keel: ALERT at step "), std::string::npos) << nan.output;
}

// A rank slowed for real: the test stops one rank of a running job (SIGSTOP) for 300 ms at a
// time (longer where that did not fire the rules) and lets it run again (SIGCONT), as a preempted
// or throttled host would, with at least 25 steps between pauses. Each pause makes one step of the
// other rank wait; a pause that falls inside that rank's gradient sync (or pipeline stage work)
// shows in the sync latency (or the bubble) too. Pauses go on until every rule in `want` has fired;
// then the run continues until each has resolved, and is stopped. Returns the run's alert events.
class SlowedRank : public MonitorRun {
 protected:
  // The last step in run/metrics.jsonl (0 before the first).
  int64_t last_step(const std::string& run) {
    const std::string path = dir / (run + "/metrics.jsonl");
    if (!fs::exists(path)) return 0;
    const std::string text = read_text_file(path);
    int64_t step = 0;
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      if (end > at) {
        const json line = json::parse(text.substr(at, end - at), nullptr, false);
        if (line.is_object() && !line.contains("event")) step = std::max(step, line.value("step", int64_t{0}));
      }
      at = end + 1;
    }
    return step;
  }
  template <typename Ready>
  bool poll(Ready ready, double seconds = 300) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!ready()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }
  // Whether `metric` fired at or after `from` and resolved after that, and whether it fired.
  static bool fired(const std::vector<json>& e, const std::string& metric, int64_t from, bool* resolved) {
    bool firing = false;
    *resolved = false;
    for (const json& x : e) {
      if (x.at("metric") != metric) continue;
      if (x.at("state") == "firing" && x.at("step").get<int64_t>() >= from) firing = true;
      if (x.at("state") == "resolved" && firing) *resolved = true;
    }
    return firing;
  }
  std::vector<json> slow_rank(const std::string& run, const std::vector<std::string>& sets,
                              const std::vector<std::string>& want, int64_t* first_pause_step) {
    std::vector<std::string> args = {"launch", "-n", "2", "--", "train", "--config", dir / "toy.toml",
                                     "--set", "train.run_dir=" + dir / run, "--set", "train.steps=1000000",
                                     "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
                                     "--set", "monitor.alert_after=1"};
    for (const std::string& s : sets) args.insert(args.end(), {"--set", s});
    testing::KeelJob job(args, dir / (run + ".log"), {"OMP_NUM_THREADS=1"});
    EXPECT_TRUE(poll([&] { return last_step(run) >= 30 || !job.running(); })) << job.output();
    std::vector<pid_t> ranks = testing::keel_train_pids(dir / "toy.toml");
    EXPECT_EQ(ranks.size(), 2u) << job.output();
    *first_pause_step = last_step(run);
    auto all = [&](bool need_resolved) {
      const std::vector<json> e = events(run);
      for (const std::string& m : want) {
        bool resolved = false;
        if (!fired(e, m, *first_pause_step, &resolved) || (need_resolved && !resolved)) return false;
      }
      return true;
    };
    for (int pause = 0; pause < 12 && ranks.size() == 2 && job.running() && !all(false); ++pause) {
      // 300 ms, and twice as long after every two pauses that did not fire the rules (up to 4.8 s):
      // on a loaded machine every sync takes tens of milliseconds, and a spike must stand out of
      // that (one spike of L among 20 syncs of b lifts the jitter to about 4.4 L / (L + 19 b)).
      ::kill(ranks[1], SIGSTOP);
      std::this_thread::sleep_for(std::chrono::milliseconds(300 << std::min(pause / 2, 4)));
      ::kill(ranks[1], SIGCONT);
      const int64_t resumed = last_step(run);
      EXPECT_TRUE(poll([&] { return last_step(run) >= resumed + 25 || !job.running(); })) << job.output();
    }
    EXPECT_TRUE(poll([&] { return all(true) || !job.running(); }, 120)) << job.output();
    ::kill(job.pid(), SIGTERM);  // a clean stop: the ranks finish their step and exit
    EXPECT_EQ(job.wait(120), 128 + SIGTERM) << job.output();
    std::printf("first pause after step %lld; alerts:\n", static_cast<long long>(*first_pause_step));
    for (const json& x : events(run)) std::printf("  %s\n", x.dump().c_str());
    return events(run);
  }
};

// Data parallelism: a pause shows as a step far slower than the median (stalled progress) and,
// when it falls in the sync, as a latency spike that lifts the jitter over its last 20 steps; the
// step-time alert resolves on the next step, the jitter alert once the spike leaves the window.
// The jitter threshold is above what sub-millisecond syncs of a toy model show on a busy machine
// (about 0.2-0.5) and below one 300 ms spike among 20 steps (about 4).
TEST_F(SlowedRank, StalledProgressAndSyncJitterAlertsFireAndResolve) {
  int64_t from = 0;
  const std::vector<json> e = slow_rank("dp", {"monitor.max_sync_jitter=2.5"}, {"ms", "sync_jitter"}, &from);
  for (const std::string metric : {"ms", "sync_jitter"}) {
    bool resolved = false;
    EXPECT_TRUE(fired(e, metric, from, &resolved)) << metric << " never fired after step " << from;
    EXPECT_TRUE(resolved) << metric << " never resolved";
  }
  for (const json& x : e) {
    if (x.at("state") == "firing" && x.at("metric") == "ms" && x.at("step").get<int64_t>() >= from) {
      EXPECT_GT(x.at("value").get<double>(), x.at("threshold").get<double>());
    }
  }
}

// A pipeline whose second stage is paused: the first idles and the bubble rises far over what a
// well-cut zero-bubble schedule shows here (about 0.05-0.15); back to that once the stage runs.
TEST_F(SlowedRank, BubbleAlertFiresWhileAStageIsSlowedAndResolves) {
  int64_t from = 0;
  const std::vector<json> e = slow_rank(
      "pipe", {"parallel.pipeline=2", "parallel.schedule=zb-h2", "parallel.micro_batches=8", "train.batch_size=16",
               "model.n_layer=4", "model.n_embd=128", "monitor.max_bubble=0.35"},
      {"pipeline_bubble"}, &from);
  bool resolved = false;
  EXPECT_TRUE(fired(e, "pipeline_bubble", from, &resolved)) << "the bubble alert never fired after step " << from;
  EXPECT_TRUE(resolved) << "the bubble alert never resolved";
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// Free TCP ports on loopback, as the kernel hands them out.
std::vector<int> free_ports(int n) {
  const testing::CommandResult r = testing::run_command(
      "python3 -c \"import socket\nss=[socket.socket() for _ in range(" + std::to_string(n) +
      ")]\nfor s in ss: s.bind(('127.0.0.1',0))\nprint(' '.join(str(s.getsockname()[1]) for s in ss))\"");
  std::vector<int> ports;
  std::istringstream in(r.output);
  for (int p; in >> p;) ports.push_back(p);
  return ports;
}

std::string http_get(const std::string& url) {
  return testing::run_command("python3 -c \"import sys,urllib.request\ntry:\n  print(urllib.request.urlopen('" + url +
                              "', timeout=5).read().decode())\nexcept Exception as e:\n  print('ERROR', e)\"")
      .output;
}

// A live `keel train` scraped by Debian's Prometheus server on loopback; its values read back
// through Prometheus's query API; promtool accepts the exposition; malformed requests and a slow
// client leave the endpoint serving.
TEST_F(MonitorRun, APrometheusServerScrapesALiveRun) {
  const std::vector<int> ports = free_ports(2);
  ASSERT_EQ(ports.size(), 2u);
  const int keel_port = ports[0], prom_port = ports[1];
  testing::write_text(dir / "prometheus.yml", "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: keel\n"
                                              "    static_configs:\n      - targets: ['127.0.0.1:" +
                                                  std::to_string(keel_port) + "']\n");
  const testing::CommandResult prom = testing::run_command(
      "prometheus --config.file=" + dir / "prometheus.yml" + " --storage.tsdb.path=" + dir / "tsdb" +
      " --web.listen-address=127.0.0.1:" + std::to_string(prom_port) + " > " + dir / "prometheus.log" +
      " 2>&1 & echo $!");
  const pid_t prom_pid = std::atoi(prom.output.c_str());
  ASSERT_GT(prom_pid, 0) << prom.output;
  testing::KeelJob job({"train", "--config", dir / "toy.toml", "--set", "train.run_dir=" + dir / "live", "--set",
                        "train.steps=1000000", "--set", "train.eval_every=0", "--set",
                        "monitor.port=" + std::to_string(keel_port)},
                       dir / "live.log", {});
  const std::string metrics_url = "http://127.0.0.1:" + std::to_string(keel_port) + "/metrics";
  std::string exposition;
  for (int i = 0; i < 600 && exposition.find("keel_step ") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    exposition = http_get(metrics_url);
  }
  ASSERT_NE(exposition.find("keel_step "), std::string::npos) << exposition << job.output();
  testing::write_text(dir / "exposition.txt", exposition);
  const testing::CommandResult check = testing::run_command("promtool check metrics < " + dir / "exposition.txt");
  EXPECT_EQ(check.exit_code, 0) << check.output;
  // Hostile clients: garbage, a request line and nothing more (a slow client), then a normal scrape.
  testing::run_command("python3 -c \"import socket,time\na=socket.create_connection(('127.0.0.1'," +
                       std::to_string(keel_port) +
                       "))\na.sendall(b'\\x00\\xffGARBAGE\\r\\n\\r\\n')\nb=socket.create_connection(('127.0.0.1'," +
                       std::to_string(keel_port) + "))\nb.sendall(b'GET /metrics HTTP/1.1\\r\\n')\ntime.sleep(1)\"");
  EXPECT_NE(http_get(metrics_url).find("keel_tokens_total "), std::string::npos);
  // Prometheus has scraped it: the step is there, through the query API.
  std::string answer;
  for (int i = 0; i < 300; ++i) {
    answer = http_get("http://127.0.0.1:" + std::to_string(prom_port) + "/api/v1/query?query=keel_step");
    if (answer.find("\"result\":[{") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ::kill(prom_pid, SIGTERM);
  ::kill(job.pid(), SIGTERM);
  job.wait(60);
  ASSERT_NE(answer.find("\"result\":[{"), std::string::npos) << answer << read_text_file(dir / "prometheus.log");
  const json parsed = json::parse(answer);
  const double step = std::stod(parsed.at("data").at("result")[0].at("value")[1].get<std::string>());
  EXPECT_GE(step, 1.0) << answer;
}

// A mixture of experts' routing per block and expert in the exposition of a live run (which
// promtool accepts): imbalance, entropy and counters of tokens per expert and of dropped pairs.
TEST_F(MonitorRun, AMixtureOfExpertsRoutingIsExposedPerBlockAndExpert) {
  const std::vector<int> ports = free_ports(1);
  ASSERT_EQ(ports.size(), 1u);
  testing::KeelJob job({"train", "--config", dir / "toy.toml", "--set", "train.run_dir=" + dir / "moe", "--set",
                        "model.preset=llama-moe-tiny", "--set", "model.vocab_size=64", "--set", "model.max_seq_len=32",
                        "--set", "model.moe_capacity=0.5", "--set", "train.steps=1000000", "--set",
                        "train.eval_every=0", "--set", "monitor.port=" + std::to_string(ports[0])},
                       dir / "moe.log", {});
  const std::string url = "http://127.0.0.1:" + std::to_string(ports[0]) + "/metrics";
  std::string exposition;
  for (int i = 0; i < 600 && exposition.find("keel_moe_expert_tokens_total") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    exposition = http_get(url);
  }
  ::kill(job.pid(), SIGTERM);
  job.wait(60);
  ASSERT_NE(exposition.find("keel_moe_expert_tokens_total"), std::string::npos) << exposition << job.output();
  testing::write_text(dir / "moe-exposition.txt", exposition);
  const testing::CommandResult check = testing::run_command("promtool check metrics < " + dir / "moe-exposition.txt");
  EXPECT_EQ(check.exit_code, 0) << check.output;
  // Blocks 0 and 1 are the store's layers 1 and 2; 4 experts each.
  for (const char* series : {"keel_moe_imbalance_ratio{layer=\"1\"}", "keel_moe_imbalance_ratio{layer=\"2\"}",
                             "keel_moe_router_entropy_nats{layer=\"2\"}", "keel_moe_dropped_tokens_total{layer=\"1\"}",
                             "keel_moe_expert_tokens_total{expert=\"3\",layer=\"2\"}"}) {
    EXPECT_NE(exposition.find(series), std::string::npos) << series << "\n" << exposition;
  }
}

// Experts in the memory tiers (tier.experts = "by_frequency") in the exposition of a live run
// (which promtool accepts): per block and expert, counters of its pages' first touches, hits,
// stall and bytes read, and its home as one gauge per tier, 1 on exactly one of them.
TEST_F(MonitorRun, ExpertsInTheTiersAreExposedPerBlockAndExpert) {
  const std::vector<int> ports = free_ports(1);
  ASSERT_EQ(ports.size(), 1u);
  fs::create_directories(dir / "nvme");
  testing::KeelJob job({"train", "--config", dir / "toy.toml", "--set", "train.run_dir=" + dir / "moe-tiers", "--set",
                        "model.preset=llama-moe-tiny", "--set", "model.vocab_size=64", "--set", "model.max_seq_len=32",
                        "--set", "train.steps=1000000", "--set", "train.eval_every=0", "--set", "store.chunk_bytes=65536",
                        "--set", "tier.device_mib=1", "--set", "tier.host_mib=1", "--set", "tier.nvme_dir=" + dir / "nvme",
                        "--set", "tier.experts=by_frequency", "--set", "tier.experts_every=2", "--set",
                        "monitor.port=" + std::to_string(ports[0])},
                       dir / "moe-tiers.log", {});
  const std::string url = "http://127.0.0.1:" + std::to_string(ports[0]) + "/metrics";
  std::string exposition;
  for (int i = 0; i < 600 && exposition.find("keel_moe_expert_home") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    exposition = http_get(url);
  }
  ::kill(job.pid(), SIGTERM);
  job.wait(60);
  ASSERT_NE(exposition.find("keel_moe_expert_home"), std::string::npos) << exposition << job.output();
  testing::write_text(dir / "moe-tiers-exposition.txt", exposition);
  const testing::CommandResult check =
      testing::run_command("promtool check metrics < " + dir / "moe-tiers-exposition.txt");
  EXPECT_EQ(check.exit_code, 0) << check.output;
  for (const char* series :
       {"keel_moe_expert_tier_touches_total{expert=\"0\",layer=\"1\"}", "keel_moe_expert_tier_hits_total{expert=\"3\",layer=\"2\"}",
        "keel_moe_expert_tier_stall_seconds_total{expert=\"2\",layer=\"1\"}",
        "keel_moe_expert_tier_read_bytes_total{expert=\"1\",layer=\"2\"}"}) {
    EXPECT_NE(exposition.find(series), std::string::npos) << series << "\n" << exposition;
  }
  // Each of the 8 experts is homed on exactly one tier.
  for (int layer : {1, 2}) {
    for (int e = 0; e < 4; ++e) {
      int homed = 0, listed = 0;
      for (const char* tier : {"device", "host", "nvme"}) {
        const std::string series = "keel_moe_expert_home{expert=\"" + std::to_string(e) + "\",layer=\"" +
                                   std::to_string(layer) + "\",tier=\"" + tier + "\"} ";
        const size_t at = exposition.find(series);
        if (at == std::string::npos) continue;
        listed++;
        homed += std::stod(exposition.substr(at + series.size())) == 1.0;
      }
      EXPECT_EQ(listed, 3) << "layer " << layer << " expert " << e << "\n" << exposition;
      EXPECT_EQ(homed, 1) << "layer " << layer << " expert " << e << "\n" << exposition;
    }
  }
}

// Bad endpoint settings are refused before training starts, in one line.
TEST_F(MonitorRun, ABusyPortOrARemoteBindWithoutPermissionIsRefused) {
  const testing::CommandResult remote = testing::run_keel("train --config " + dir / "toy.toml" +
                                                          " --set monitor.port=9 --set monitor.bind=0.0.0.0");
  EXPECT_EQ(remote.exit_code, 2) << remote.output;
  EXPECT_NE(remote.output.find("monitor.bind"), std::string::npos) << remote.output;
  const testing::CommandResult range = testing::run_keel("train --config " + dir / "toy.toml" + " --set monitor.port=70000");
  EXPECT_EQ(range.exit_code, 2) << range.output;
  EXPECT_NE(range.output.find("monitor.port"), std::string::npos) << range.output;
  // A port held by a listening socket (python keeps it for the command's life).
  const testing::CommandResult busy = testing::run_command(
      "python3 -c \"import socket,subprocess,sys\ns=socket.socket()\ns.bind(('127.0.0.1',0))\ns.listen()\n"
      "p=s.getsockname()[1]\nr=subprocess.run([sys.argv[1],'train','--config',sys.argv[2],'--set','train.run_dir='+sys.argv[3],"
      "'--set','monitor.port=%d'%p],capture_output=True,text=True)\nprint(r.stdout+r.stderr)\nprint('EXIT',r.returncode)\" " +
      std::string(KEEL_BINARY) + " " + dir / "toy.toml" + " " + dir / "busy");
  EXPECT_NE(busy.output.find("EXIT 2"), std::string::npos) << busy.output;
  EXPECT_NE(busy.output.find("cannot listen on 127.0.0.1:"), std::string::npos) << busy.output;
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// The shipped Prometheus rules are valid, and each fires on series that break its target (and
// only there): promtool's own rule tests.
TEST(PrometheusRules, ShippedAlertRulesPassPromtool) {
  const std::string rules = testing::source_path("configs/prometheus/keel-alerts.yml");
  const testing::CommandResult check = testing::run_command("promtool check rules " + rules);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  const testing::CommandResult unit = testing::run_command("cd " + testing::source_path("tests/prometheus") +
                                                           " && promtool test rules keel-alerts.test.yml");
  EXPECT_EQ(unit.exit_code, 0) << unit.output;
  EXPECT_NE(unit.output.find("SUCCESS"), std::string::npos) << unit.output;
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// `keel report` of a pipelined run (with its trace): one self-contained HTML file that headless
// Chromium opens without a script error and draws (the screenshot is not a blank page); a
// directory that is not a run is refused in one line.
TEST_F(MonitorRun, TheReportOpensInChromiumWithItsPlotsDrawn) {
  const testing::CommandResult run = testing::run_keel(
      "launch -n 2 -- train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "rep" +
      " --set parallel.pipeline=2 --set parallel.trace=true --set train.eval_every=4");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const testing::CommandResult r = testing::run_keel("report " + dir / "rep" + " --out " + dir / "rep.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read_text_file(dir / "rep.html");
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1)) svgs++;
  EXPECT_GE(svgs, 5u);
  EXPECT_NE(html.find("Pipeline step"), std::string::npos);  // the Gantt chart from the trace
  for (const char* fetch : {"src=", "href=", "@import", "url(", "<script"}) {
    EXPECT_EQ(html.find(fetch), std::string::npos) << fetch;  // nothing fetched from anywhere
  }
  const testing::CommandResult shot = testing::run_command(
      "timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --enable-logging=stderr --v=0 "
      "--window-size=1000,1600 --screenshot=" + dir / "rep.png" + " file://" + dir / "rep.html");
  ASSERT_TRUE(fs::exists(dir / "rep.png")) << shot.output;
  EXPECT_EQ(shot.output.find("Uncaught"), std::string::npos) << shot.output;
  EXPECT_EQ(shot.output.find("CONSOLE"), std::string::npos) << shot.output;
  // The screenshot's pixels: many colours (lines, text, bars), not one blank page.
  const testing::CommandResult colours = testing::run_command(
      "python3 -c \"import zlib,struct,sys\nd=open(sys.argv[1],'rb').read()\npos=8\nidat=b''\nw=h=0\n"
      "while pos<len(d):\n  n,t=struct.unpack('>I4s',d[pos:pos+8]);c=d[pos+8:pos+8+n];pos+=12+n\n"
      "  if t==b'IHDR': w,h,bd,ct=struct.unpack('>IIBB',c[:10])\n  if t==b'IDAT': idat+=c\n"
      "raw=zlib.decompress(idat);bpp=4 if ct==6 else 3;stride=w*bpp\ncols=set();prev=bytearray(stride)\n"
      "for y in range(h):\n  f=raw[y*(stride+1)];line=bytearray(raw[y*(stride+1)+1:(y+1)*(stride+1)])\n"
      "  for i in range(stride):\n    a=line[i-bpp] if i>=bpp else 0;b=prev[i];cc=prev[i-bpp] if i>=bpp else 0\n"
      "    if f==1: line[i]=(line[i]+a)&255\n    elif f==2: line[i]=(line[i]+b)&255\n"
      "    elif f==3: line[i]=(line[i]+((a+b)>>1))&255\n"
      "    elif f==4:\n      p=a+b-cc;pa,pb,pc=abs(p-a),abs(p-b),abs(p-cc)\n"
      "      line[i]=(line[i]+(a if pa<=pb and pa<=pc else b if pb<=pc else cc))&255\n"
      "  prev=line\n  if y%7==0: cols.update(bytes(line[i:i+3]) for i in range(0,stride,bpp*5))\n"
      "print(len(cols))\" " + dir / "rep.png");
  EXPECT_GT(std::atoi(colours.output.c_str()), 20) << colours.output;

  // A data-parallel run with compressed sync and memory tiers: the summary names the model and
  // the layout, the hit rates are drawn per tier, and the bytes per layer with their codec.
  fs::create_directories(dir / "nvme");
  const testing::CommandResult dp = testing::run_keel(
      "launch -n 2 -- train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "dp" +
      " --set sync.codec=hybrid --set tier.device_mib=1 --set tier.host_mib=8 --set tier.nvme_dir=" + dir / "nvme");
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  ASSERT_EQ(testing::run_keel("report " + dir / "dp" + " --out " + dir / "dp.html").exit_code, 0);
  const std::string dp_html = read_text_file(dir / "dp.html");
  for (const char* part : {"<th>model</th><td>preset tiny: 2 layers, width 64", "2 data x 1 pipeline",
                           "tiers: device 1 MiB", "<th>hardware</th>", "Gradient bytes per layer", "block 1",
                           "MB sent</title>", ">nvme</text>", ">host</text>"}) {
    EXPECT_NE(dp_html.find(part), std::string::npos) << part;
  }

  const testing::CommandResult bad = testing::run_keel("report " + dir.path());
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("not a run directory (no metrics.jsonl)"), std::string::npos) << bad.output;
  EXPECT_EQ(testing::count_lines(bad.output), 1) << bad.output;
}

// Experts in the memory tiers (tier.experts = "by_frequency", re-homed every 2 steps): the report's
// MoE section draws the experts' pages' hit rate, stall and reads step by step, and has a row per
// expert whose figures are the sums of the run's tier_experts and moe_layers (routed pairs and
// their share, first touches, hit rate, stall, bytes read) and whose strip names its home at
// every step, one segment per run of steps in one tier (re-homings included).
TEST_F(MonitorRun, TheReportShowsEachExpertsTierFiguresAndHome) {
  fs::create_directories(dir / "nvme");
  const testing::CommandResult run = testing::run_keel(
      "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / "experts" +
      " --set model.preset=llama-moe-tiny --set model.vocab_size=64 --set model.max_seq_len=32 --set train.steps=6"
      " --set train.eval_every=0 --set store.chunk_bytes=65536 --set runtime.threads=1 --set model.moe_aux_weight=0"
      " --set tier.device_mib=1 --set tier.host_mib=1 --set tier.nvme_dir=" + dir / "nvme" +
      " --set tier.experts=by_frequency --set tier.experts_every=2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const testing::CommandResult r = testing::run_keel("report " + dir / "experts" + " --out " + dir / "experts.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string html = read_text_file(dir / "experts.html");
  for (const char* part : {"<h2>Mixture of experts</h2>", "Experts in the memory tiers (whole run)",
                           "Experts' pages: hit rate", "Experts' pages: stall (ms per step)",
                           "Experts' pages: bytes read (MB per step)", "Tokens per expert (whole run)"}) {
    EXPECT_NE(html.find(part), std::string::npos) << part;
  }
  EXPECT_EQ(html.find("values or lines of metrics.jsonl"), std::string::npos);  // nothing skipped

  struct Sums {
    double routed = 0, acquires = 0, hits = 0, stall_ms = 0, read_bytes = 0;
    std::vector<std::string> homes;  // per step
  };
  std::map<std::pair<int, int>, Sums> experts;  // (store layer, expert)
  std::map<int, double> routed_in_block;
  const std::vector<json> steps = testing::step_lines(dir / "experts/metrics.jsonl");
  ASSERT_EQ(steps.size(), 6u);
  for (const json& l : steps) {
    ASSERT_EQ(l.at("step").get<size_t>(), static_cast<size_t>(&l - steps.data()) + 1);  // homes[k]: step k + 1
    for (const json& b : l.at("tier_experts")) {
      const int layer = b.at("layer").get<int>();
      const json* tokens = nullptr;
      for (const json& m : l.at("moe_layers")) {
        if (m.at("layer").get<int>() == layer) tokens = &m.at("tokens");
      }
      ASSERT_NE(tokens, nullptr) << l;
      for (size_t i = 0; i < b.at("experts").size(); ++i) {
        const int e = b.at("experts")[i].get<int>();
        Sums& s = experts[{layer, e}];
        s.acquires += b.at("acquires")[i].get<double>();
        s.hits += b.at("hits")[i].get<double>();
        s.stall_ms += b.at("stall_ms")[i].get<double>();
        s.read_bytes += b.at("read_bytes")[i].get<double>();
        s.homes.push_back(b.at("home")[i].get<std::string>());
        s.routed += tokens->at(e).get<double>();
        routed_in_block[layer] += tokens->at(e).get<double>();
      }
    }
  }
  ASSERT_EQ(experts.size(), 8u);  // 2 MoE blocks of 4 experts
  int rehomed = 0;
  for (const auto& [key, s] : experts) {
    const auto [layer, e] = key;
    char hit_rate[32] = "-";
    if (s.acquires > 0) std::snprintf(hit_rate, sizeof hit_rate, "%.1f %%", 100 * s.hits / s.acquires);
    char row[512];
    std::snprintf(row, sizeof row,
                  "<tr><td>block %d</td><td>expert %d</td><td>%.0f (%.1f %%)</td><td>%.0f</td><td>%s</td><td>%.1f</td>"
                  "<td>%.2f</td>",
                  layer - 1, e, s.routed, 100 * s.routed / routed_in_block[layer], s.acquires, hit_rate, s.stall_ms,
                  s.read_bytes / 1e6);
    const size_t at = html.find(row);
    ASSERT_NE(at, std::string::npos) << row;
    const std::string cells = html.substr(at, html.find("</tr>", at) - at);
    size_t segments = 0;
    for (size_t first = 0, k = 1; k <= s.homes.size(); ++k) {
      if (k < s.homes.size() && s.homes[k] == s.homes[first]) continue;
      const std::string title = "<title>" +
                                (k == first + 1 ? "step " + std::to_string(k)
                                                : "steps " + std::to_string(first + 1) + "-" + std::to_string(k)) +
                                ": " + s.homes[first] + "</title>";
      EXPECT_NE(cells.find(title), std::string::npos) << row << " " << title;
      segments++;
      first = k;
    }
    size_t drawn = 0;
    for (size_t p = cells.find("<rect"); p != std::string::npos; p = cells.find("<rect", p + 1)) drawn++;
    EXPECT_EQ(drawn, segments) << row;
    EXPECT_NE(cells.find("<td>" + s.homes.back() + "</td>"), std::string::npos) << row;
    rehomed += segments > 1;
  }
  EXPECT_GT(rehomed, 0) << "the first plan moves experts off their placement";
}

}  // namespace
}  // namespace keel
