#include "runtime/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace keel {

std::vector<int> generate(GPT& model, int allocated_T, std::vector<int> prompt, const SampleOptions& o, Rng& rng) {
  check(!prompt.empty(), "generate: the prompt encodes to no tokens");
  const int V = model.config().vocab_size, Vp = model.config().padded_vocab_size;
  std::vector<double> probs(V);
  std::vector<int> order(V);
  for (int i = 0; i < o.max_new_tokens; ++i) {
    const int T = std::min<int>(static_cast<int>(prompt.size()), allocated_T);
    const int* context = prompt.data() + prompt.size() - T;
    model.forward(Batch{context, nullptr, 1, T, 0.0f});
    const float* logits = model.logits() + static_cast<int64_t>(T - 1) * Vp;
    int next = 0;
    if (o.temperature <= 0) {
      next = static_cast<int>(std::max_element(logits, logits + V) - logits);
    } else {
      std::iota(order.begin(), order.end(), 0);
      const int k = (o.top_k > 0 && o.top_k < V) ? o.top_k : V;
      // Ties broken by token id so the choice does not depend on the sort's internals.
      auto better = [&](int a, int b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
      std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
      const double mx = logits[order[0]];
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += probs[j] = std::exp((logits[order[j]] - mx) / o.temperature);
      double r = rng.uniform() * sum;
      next = order[k - 1];
      for (int j = 0; j < k; ++j) {
        r -= probs[j];
        if (r < 0) {
          next = order[j];
          break;
        }
      }
    }
    prompt.push_back(next);
    if (next == o.stop_token) break;
  }
  return prompt;
}

}  // namespace keel
