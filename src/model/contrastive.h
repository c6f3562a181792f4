// The dual encoder's loss: symmetric InfoNCE over a batch of N image-caption pairs with a learnable
// temperature. With features normalised to unit length (img_n, txt_n) and s = exp(min(logit_scale,
// log(max_scale))), logits = s img_n txt_n^T [N, N]; the loss is the mean of the image-to-text and
// text-to-image cross-entropies whose right answers are the diagonal:
//   L = (1 / 2N) sum_i [ -log softmax_j(logits[i, :])[i] - log softmax_j(logits[:, i])[i] ].
// dL/dlogits = (1 / 2N) (P_row + P_col - 2 I), with P_row / P_col the row / column softmaxes.
//
// Data parallelism: every rank holds all N samples' features (gathered: rank-major rows) and
// computes the whole N x N loss (N^2 D multiply-adds, small beside the towers), but the gradient
// only for its own rows [first, first + n). Those are exactly the global loss's gradients for its
// samples — no second collective is needed — and one rank with the whole batch gets the same.
#pragma once

#include <cstdint>

namespace keel {

struct ContrastiveResult {
  double loss = 0;
  double dlogit_scale = 0;   // dL/d(logit_scale): 0 where the scale is clamped
  double accuracy_i2t = 0;   // share of rows whose largest logit is the diagonal (image -> text)
  double accuracy_t2i = 0;   // the same for columns (text -> image)
};

// img, txt: [N, D] unnormalised features of all N samples. Writes dimg, dtxt [n, D]: the gradient
// of L (times grad_scale) for rows first .. first + n - 1 (null: loss only). Sums run in a fixed
// order in double: the same bytes for the same inputs on every rank.
ContrastiveResult contrastive_loss(const float* img, const float* txt, int N, int D, float logit_scale,
                                   double max_scale, int first, int n, float grad_scale, float* dimg, float* dtxt);

}  // namespace keel

namespace keel {

// Zero-shot retrieval over N pairs of normalised embeddings (img, txt [N, D]; pair i is the right
// answer for query i): recall@k is the share of queries whose right answer ranks among the k most
// similar by cosine (ties ranked against the query: an equal score counts as ahead of it).
struct RetrievalRecall {
  double i2t_at1 = 0, i2t_at5 = 0;  // image -> text
  double t2i_at1 = 0, t2i_at5 = 0;  // text -> image
  int pairs = 0;
};
RetrievalRecall retrieval_recall(const float* img, const float* txt, int N, int D);

}  // namespace keel
