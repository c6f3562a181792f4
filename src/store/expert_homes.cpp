#include "store/expert_homes.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace keel {

std::vector<Tier> plan_expert_homes(const ExpertHomesInput& in) {
  const size_t n = in.shares.size();
  check(in.bytes.size() == n && in.current.size() == n, "expert homes: shares, bytes and homes of different counts");
  check(in.hysteresis >= 1.0, "expert homes: hysteresis below 1");
  std::vector<Tier> out(n, in.nvme ? Tier::nvme : Tier::host);
  std::vector<uint8_t> placed(n, 0);
  auto fill = [&](Tier tier, int64_t room) {
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    auto score = [&](size_t e) { return in.shares[e] * (in.current[e] == tier ? in.hysteresis : 1.0); };
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (score(a) != score(b)) return score(a) > score(b);
      return in.current[a] == tier && in.current[b] != tier;  // a tie keeps the incumbent
    });
    for (size_t e : order) {
      if (placed[e] || in.bytes[e] > room) continue;
      out[e] = tier;
      placed[e] = 1;
      room -= in.bytes[e];
    }
  };
  fill(Tier::device, in.device_room);
  fill(Tier::host, in.host_room);
  return out;
}

}  // namespace keel
