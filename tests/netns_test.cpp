// Data and tensor parallelism across "hosts": scripts/netns.sh puts each rank in its own network namespace on a
// private bridge, with OpenMPI's rsh launcher and TCP as between real machines. The job must give the
// same bytes as `keel launch -n 2` on one host, its ranks must really sit in different namespaces and
// its gradients must really cross the veth links, also through a rate-shaped link. Needs root and
// iproute2; skipped otherwise. Every namespace, link and bridge is removed afterwards, also on failure.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::CommandResult;
using testing::run_command;

const std::string kScript = testing::source_path("scripts/netns.sh");

// A namespace set of its own (prefix unique to this process and test), removed when this dies.
class Namespaces {
 public:
  explicit Namespaces(const std::string& up_args) {
    static int counter = 0;
    prefix_ = "kt" + std::to_string(::getpid()) + "x" + std::to_string(counter++) + "-";
    up_ = run_command(env() + " bash " + kScript + " up " + up_args);
  }
  ~Namespaces() {
    const CommandResult r = run_command(env() + " bash " + kScript + " down");
    if (r.exit_code != 0) std::fprintf(stderr, "netns.sh down failed: %s\n", r.output.c_str());
  }
  Namespaces(const Namespaces&) = delete;
  Namespaces& operator=(const Namespaces&) = delete;

  const CommandResult& up() const { return up_; }
  const std::string& prefix() const { return prefix_; }
  // Runs netns.sh with this prefix; a hung job is stopped after two minutes (the guard still cleans up).
  CommandResult script(const std::string& args) const {
    return run_command("timeout -k 10 120 env " + env() + " bash " + kScript + " " + args);
  }
  // Bytes host i has sent on its link (eth0 inside namespace i).
  long long sent_by(int host) const {
    const CommandResult r =
        run_command("ip netns exec " + prefix_ + std::to_string(host) + " cat /sys/class/net/eth0/statistics/tx_bytes");
    return r.exit_code == 0 ? std::stoll(r.output) : -1;
  }

 private:
  std::string env() const { return "KEEL_NETNS_PREFIX=" + prefix_ + " KEEL_BINARY=" + KEEL_BINARY; }
  std::string prefix_;
  CommandResult up_;
};

class AcrossNamespaces : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::geteuid() != 0) {
      skip_reason_ = "needs root (network namespaces)";
      return;
    }
    const std::string probe = "keel-probe-" + std::to_string(::getpid());
    const CommandResult r = run_command("ip netns add " + probe + " && ip netns delete " + probe);
    if (r.exit_code != 0) {
      skip_reason_ = "ip netns unusable here: " + r.output;
      return;
    }
    // Namespaces of an earlier run of this test that was killed before its guards ran (prefix
    // kt<pid>x<n>- of a process that is gone): remove them.
    const CommandResult stale = run_command(
        "ip netns list | awk '{print $1}' | sed -n 's/^\\(kt\\([0-9]*\\)x[0-9]*-\\)[0-9]*$/\\1 \\2/p' | sort -u");
    for (size_t p = 0; p < stale.output.size();) {
      const size_t e = stale.output.find('\n', p);
      const std::string line = stale.output.substr(p, e - p);
      p = e == std::string::npos ? e : e + 1;
      const size_t space = line.find(' ');
      if (space == std::string::npos || std::filesystem::exists("/proc/" + line.substr(space + 1))) continue;
      run_command("KEEL_NETNS_PREFIX=" + line.substr(0, space) + " bash " + kScript + " down");
    }
  }
  void SetUp() override {
    if (!skip_reason_.empty()) GTEST_SKIP() << skip_reason_;
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 10);
  }
  std::string train_args(const std::string& run) const {
    return "train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / run;
  }
  // One metric (loss, sync_sent_bytes) of every step, from rank 0's metrics.
  std::vector<double> column(const std::string& run, const char* key) const {
    std::vector<double> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      auto j = nlohmann::json::parse(text.substr(start, end - start));
      if (j.contains(key)) out.push_back(j[key]);
      start = end + 1;
    }
    return out;
  }
  std::vector<char> param_bytes(const std::string& run) const { return testing::checkpoint_bytes(dir / (run + "/ckpt")); }
  // The same job with plain `keel launch -n 2` on this host, the reference for every variant.
  void train_plain() {
    const auto t0 = std::chrono::steady_clock::now();
    const CommandResult r = testing::run_keel("launch -n 2 -- " + train_args("plain"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::printf("plain keel launch -n 2: %.2f s\n", seconds_since(t0));
  }
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Trains across the namespaces and checks: same bytes and losses as plain; rank r in namespace r
  // (mpirun's map); each host put at least half of rank 0's modelled sync bytes on its veth.
  void train_across(const Namespaces& ns, const std::string& run) {
    const long long before0 = ns.sent_by(0), before1 = ns.sent_by(1);
    const auto t0 = std::chrono::steady_clock::now();
    const CommandResult r = ns.script("run -n 2 --mca rmaps_base_display_map 1 -- " + train_args(run));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::printf("keel launch across namespaces %s0,%s1: %.2f s\n", ns.prefix().c_str(), ns.prefix().c_str(),
                seconds_since(t0));
    EXPECT_NE(r.output.find("data parallel over 2 ranks"), std::string::npos) << r.output;
    // The map: "Data for node: <ns>0 ..." then rank 0, "Data for node: <ns>1 ..." then rank 1.
    const size_t node0 = r.output.find("Data for node: " + ns.prefix() + "0");
    const size_t node1 = r.output.find("Data for node: " + ns.prefix() + "1");
    ASSERT_NE(node0, std::string::npos) << r.output;
    ASSERT_NE(node1, std::string::npos) << r.output;
    const size_t first = std::min(node0, node1), second = std::max(node0, node1);
    const std::string block_first = r.output.substr(first, second - first);
    const std::string block_second = r.output.substr(second, r.output.find("=====", second) - second);
    EXPECT_NE((node0 < node1 ? block_first : block_second).find("Process rank: 0"), std::string::npos) << r.output;
    EXPECT_NE((node0 < node1 ? block_second : block_first).find("Process rank: 1"), std::string::npos) << r.output;

    EXPECT_EQ(param_bytes("plain"), param_bytes(run));
    EXPECT_EQ(column("plain", "loss"), column(run, "loss"));
    ASSERT_EQ(column(run, "loss").size(), 10u);

    double modelled = 0;
    for (double b : column(run, "sync_sent_bytes")) modelled += b;
    const long long sent0 = ns.sent_by(0) - before0, sent1 = ns.sent_by(1) - before1;
    std::printf("bytes onto the bridge: host 0 %lld, host 1 %lld (rank 0 modelled %.0f)\n", sent0, sent1, modelled);
    EXPECT_GT(modelled, 0);
    EXPECT_GE(sent0, modelled / 2);
    EXPECT_GE(sent1, modelled / 2);
  }
  testing::TempDir dir{"keel-netns-test"};
  static inline std::string skip_reason_;
};

// The harness itself: ranks of a plain mpirun job land in the namespaces, each with the namespace's
// name as hostname, with the caller's working directory and environment; up/status/down behave.
TEST_F(AcrossNamespaces, HarnessPlacesRanksInNamespaces) {
  std::string prefix;
  {
    Namespaces ns("2");
    prefix = ns.prefix();
    ASSERT_EQ(ns.up().exit_code, 0) << ns.up().output;
    EXPECT_EQ(ns.script("up 2").exit_code, 0);  // already up, same settings: fine
    EXPECT_NE(ns.script("up 3").exit_code, 0);  // other settings: refused
    const CommandResult status = ns.script("status");
    EXPECT_EQ(status.exit_code, 0) << status.output;
    EXPECT_NE(status.output.find(prefix + "1: 10."), std::string::npos) << status.output;
    const CommandResult r = run_command("cd " + dir.path() + " && KEEL_NETNS_CHECK=yes " +
                                        "KEEL_NETNS_PREFIX=" + prefix + " timeout -k 10 120 bash " + kScript +
                                        " run --mpirun -n 2 -- /bin/sh -c "
                                        "'echo \"rank=$OMPI_COMM_WORLD_RANK ns=$(ip netns identify) host=$(hostname) "
                                        "cwd=$(pwd) env=$KEEL_NETNS_CHECK\"'");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("rank=0 ns=" + prefix + "0 host=" + prefix + "0 cwd=" + dir.path() + " env=yes"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("rank=1 ns=" + prefix + "1 host=" + prefix + "1 cwd=" + dir.path() + " env=yes"),
              std::string::npos)
        << r.output;
  }
  // Down removed everything and a second down is harmless.
  EXPECT_EQ(run_command("ip netns list | grep -c '^" + prefix + "'").output, "0\n");
  EXPECT_NE(run_command("KEEL_NETNS_PREFIX=" + prefix + " bash " + kScript + " status").exit_code, 0);
  EXPECT_EQ(run_command("KEEL_NETNS_PREFIX=" + prefix + " bash " + kScript + " down").exit_code, 0);
}

TEST_F(AcrossNamespaces, TwoHostsGiveTheSameBytesAsOneHost) {
  ASSERT_NO_FATAL_FAILURE(train_plain());
  Namespaces ns("2");
  ASSERT_EQ(ns.up().exit_code, 0) << ns.up().output;
  train_across(ns, "hosts");
}

TEST_F(AcrossNamespaces, RateShapedLinkGivesTheSameBytes) {
  ASSERT_NO_FATAL_FAILURE(train_plain());
  Namespaces ns("2 --rate 100mbit");
  ASSERT_EQ(ns.up().exit_code, 0) << ns.up().output;
  const CommandResult qdisc = run_command("ip netns exec " + ns.prefix() + "0 tc qdisc show dev eth0");
  EXPECT_NE(qdisc.output.find("tbf"), std::string::npos) << qdisc.output;
  EXPECT_NE(qdisc.output.find("100Mbit"), std::string::npos) << qdisc.output;
  train_across(ns, "shaped");
}

// Tensor parallelism across the namespaces: a T = 2 job with its two tensor ranks on two "hosts"
// (every layer's all-reduces over TCP through the bridge) gives the bytes and losses of the same job
// under plain `keel launch -n 2`, and each host's link carries at least the forward all-reduces of
// one layer per step (two of batch x seq x n_embd floats: a lower bound, the backward's and the
// other layers' come on top).
TEST_F(AcrossNamespaces, TensorRanksOnTwoHostsGiveTheSameBytesAsOneHost) {
  const std::string tensor = " --set parallel.tensor=2";
  const CommandResult plain = testing::run_keel("launch -n 2 -- " + train_args("plain") + tensor);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  Namespaces ns("2");
  ASSERT_EQ(ns.up().exit_code, 0) << ns.up().output;
  const long long before0 = ns.sent_by(0), before1 = ns.sent_by(1);
  const CommandResult r = ns.script("run -n 2 -- " + train_args("hosts") + tensor);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensor parallel over 2 ranks (data 1 x pipeline 1 x tensor 2)"), std::string::npos)
      << r.output;
  EXPECT_EQ(param_bytes("plain"), param_bytes("hosts"));
  EXPECT_EQ(column("plain", "loss"), column("hosts", "loss"));
  ASSERT_EQ(column("hosts", "loss").size(), 10u);
  const long long sent0 = ns.sent_by(0) - before0, sent1 = ns.sent_by(1) - before1;
  const long long floor = 10LL * 2 * 4 * 32 * 64 * static_cast<long long>(sizeof(float));  // toy: batch 4, seq 32, n_embd 64
  std::printf("tensor ranks: bytes onto the bridge: host 0 %lld, host 1 %lld (floor %lld)\n", sent0, sent1, floor);
  EXPECT_GE(sent0, floor);
  EXPECT_GE(sent1, floor);
}

// --delay adds netem where the kernel has it; where it does not, up fails with a line that says so
// and leaves nothing behind. Either way a bad value is refused before anything is made.
TEST_F(AcrossNamespaces, DelayIsNetemOrAClearRefusal) {
  std::string prefix;
  {
    Namespaces bad("2 --delay fast");
    EXPECT_NE(bad.up().exit_code, 0);
    EXPECT_NE(bad.up().output.find("--delay: expected a time such as 0.2ms"), std::string::npos) << bad.up().output;
  }
  {
    Namespaces ns("2 --rate 1gbit --delay 0.2ms");
    prefix = ns.prefix();
    if (ns.up().exit_code == 0) {
      const CommandResult qdisc = run_command("ip netns exec " + prefix + "0 tc qdisc show dev eth0");
      EXPECT_NE(qdisc.output.find("netem"), std::string::npos) << qdisc.output;
      EXPECT_NE(qdisc.output.find("tbf"), std::string::npos) << qdisc.output;
    } else {
      EXPECT_NE(ns.up().output.find("lacks sch_netem"), std::string::npos) << ns.up().output;
      EXPECT_EQ(run_command("ip netns list | grep -c '^" + prefix + "'").output, "0\n");
    }
  }
  EXPECT_EQ(run_command("ip netns list | grep -c '^" + prefix + "'").output, "0\n");
}

}  // namespace
}  // namespace keel
