// Batches of image-caption pairs for dual-encoder training, from a `keel data images` dataset
// (data/images.h) and a tokenizer.
//
// Images: bytes to float, channels-last, normalised per channel with the mean and deviation of
// OpenAI CLIP's training images (R, G, B mean 0.4815, 0.4578, 0.4082; deviation 0.2686, 0.2613,
// 0.2758), the convention pretrained image towers expect. Captions: the tokenizer's ids and its
// end-of-text token; the caption's feature is read at that end token (position length - 1), and
// the window is padded after it with end tokens (causal attention never reads them). A caption
// longer than the text tower's context (with its end token) is refused when the loader is made:
// one line naming the caption, its length and the context — nothing is silently cut.
//
// Order: each epoch a permutation of the split drawn from (seed, epoch); a global batch is the
// next world x B samples of it and rank r reads samples r*B .. r*B + B - 1, so N ranks see exactly
// what one rank with N x B would. An epoch's tail shorter than a global batch is skipped. The
// position (samples consumed) is all a checkpoint needs to resume the order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/batch.h"
#include "data/images.h"
#include "data/loader.h"
#include "data/tokenizer.h"

namespace keel {

struct CaptionedImages {
  ImageSplit split;
  std::vector<std::vector<int>> tokens;  // per caption, end token included
  int context = 0;
};

// Reads DATASET's `split` and tokenizes every caption for a text tower of `context` tokens.
CaptionedImages load_captioned_images(const std::string& dataset, const std::string& split, const Tokenizer& tokenizer,
                                      int context);

class ClipLoader {
 public:
  // B samples per rank and micro-batch; `shuffle` false: file order (evaluation).
  ClipLoader(const CaptionedImages& data, int B, int rank, int world, uint64_t seed, bool shuffle);
  // The next micro-batch of this rank (valid until the next call).
  const ClipBatch& next();
  // The batch of samples [first, first + count) in file order (evaluation; count <= B).
  const ClipBatch& rows(int first, int count);
  int64_t position() const { return position_; }  // samples consumed over all ranks
  void seek(int64_t position);
  // The position as checkpoints record a loader's: epoch, and samples consumed within it.
  LoaderPosition loader_position() const;
  void set_loader_position(const LoaderPosition& p);
  int samples() const { return data_.split.count; }
  int image_size() const { return data_.split.height; }
  int context() const { return data_.context; }
  int batches_per_epoch() const { return data_.split.count / (B_ * world_); }

 private:
  void fill(const std::vector<int>& indices);
  const std::vector<int>& order(int64_t epoch);

  const CaptionedImages& data_;
  int B_, rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t position_ = 0;
  int64_t epoch_cached_ = -1;
  std::vector<int> order_;
  std::vector<float> images_;
  std::vector<int> tokens_, lengths_;
  ClipBatch batch_;
};

}  // namespace keel
