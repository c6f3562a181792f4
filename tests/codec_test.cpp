// The HybridGC gradient codecs: each codec's round trip against its stated bound, checked by an
// independent reference (exhaustive half tables, a full sort for top-k, the sampler for random
// positions); decode_add sums; determinism; error feedback conserves mass and stays bounded;
// malformed encodings are refused without touching memory they should not; encoded sizes.
#include "comm/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace keel {
namespace {

const size_t kSizes[] = {1, 7, 256, 1000, 100003};

std::vector<float> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> x(n);
  for (auto& v : x) v = static_cast<float>(rng.normal() * scale);
  return x;
}

std::vector<uint8_t> encode(const Codec& c, const std::vector<float>& x, uint64_t seed = 1) {
  std::vector<uint8_t> out;
  c.encode(x.data(), x.size(), seed, out);
  return out;
}

std::vector<float> decode(const Codec& c, const std::vector<uint8_t>& bytes, size_t n) {
  std::vector<float> y(n, 0.0f);
  c.decode_add(bytes.data(), bytes.size(), n, y.data());
  return y;
}

std::unique_ptr<Codec> make(CodecKind kind, double keep = 1.0, int block = 256) {
  return Codec::make(CodecParams{kind, keep, block});
}

// One codec of every kind, sign1 both dense and sparsified, with small blocks so that tests cross
// block boundaries.
std::vector<CodecParams> all_configs() {
  return {{CodecKind::none, 1.0, 256}, {CodecKind::fp16, 1.0, 256}, {CodecKind::bf16, 1.0, 256},
          {CodecKind::sign1, 1.0, 7},  {CodecKind::sign1, 0.3, 7},  {CodecKind::quant2_topk, 0.1, 5},
          {CodecKind::quant2_topk, 1.0, 5}, {CodecKind::topk, 0.1, 256}, {CodecKind::randk, 0.1, 256}};
}

std::string describe(const CodecParams& p) {
  return std::string(codec_name(p.kind)) + " keep=" + std::to_string(p.keep) + " block=" + std::to_string(p.block);
}

std::vector<size_t> nonzero_positions(const std::vector<float>& d) {
  std::vector<size_t> p;
  for (size_t i = 0; i < d.size(); ++i)
    if (d[i] != 0.0f) p.push_back(i);
  return p;
}

// The reference top-k: a full sort by (|x| descending, index ascending), first k, ascending.
std::vector<size_t> reference_topk(const std::vector<float>& x, size_t k) {
  std::vector<size_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa != fb ? fa > fb : a < b;
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

// ---- half and bfloat16 conversions against independent references ----

// The exact value of a finite binary16, from the definition.
double half_value(uint32_t h) {
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

// Round to nearest even by search over the table of every positive finite half.
uint16_t reference_half(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7E00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;  // 65504 + half an ulp and beyond: inf
  uint32_t lo = 0, hi = 0x7BFF;            // largest h with half_value(h) <= a
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (half_value(mid) <= a)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double below = half_value(lo);
  if (below == a) return static_cast<uint16_t>(sign | lo);
  const double above = lo == 0x7BFF ? 65536.0 : half_value(lo + 1);
  const double d_lo = a - below, d_hi = above - a;
  const uint32_t r = d_lo < d_hi ? lo : d_hi < d_lo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return static_cast<uint16_t>(sign | r);
}

// Round to nearest even between the two bfloat16 neighbours, compared in double.
uint16_t reference_bfloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  if (std::isnan(f)) return sign | 0x7FC0;
  const uint32_t lo = (x & 0x7FFFFFFF) >> 16;
  const double a = std::fabs(static_cast<double>(f));
  const double below = std::bit_cast<float>(lo << 16);
  const double above = lo == 0x7F7F ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>((lo + 1) << 16));
  if (below == a) return static_cast<uint16_t>(sign | lo);
  const double d_lo = a - below, d_hi = above - a;
  const uint32_t r = d_lo < d_hi ? lo : d_hi < d_lo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return static_cast<uint16_t>(sign | r);
}

// Floats worth converting: a stride through all bit patterns, every halfway point between
// neighbouring halves and bfloat16s and their float neighbours, and the special values.
std::vector<float> conversion_probes() {
  std::vector<float> probes;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4093)
    probes.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  for (uint32_t h = 0; h < 0x7BFF; ++h) {
    const float mid = static_cast<float>((half_value(h) + half_value(h + 1)) / 2);  // exact in float
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      probes.push_back(f);
      probes.push_back(-f);
    }
  }
  for (uint32_t b = 0; b < 0x7F80; b += 3) {
    const float mid = std::bit_cast<float>((b << 16) | 0x8000u);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e38f)}) {
      probes.push_back(f);
      probes.push_back(-f);
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, -0.0f, inf, -inf, 65504.0f, 65519.99f, 65520.0f, 0x1.0p-24f, 0x1.0p-25f, 0x1.8p-25f, 0x1.0p-14f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()})
    probes.push_back(f);
  return probes;
}

TEST(Codec, HalfConversionsRoundToNearestEvenLikeTheReference) {
  for (float f : conversion_probes()) {
    const uint16_t h = float_to_half(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(h))) << f;
      EXPECT_EQ(h & 0x8000, std::signbit(f) ? 0x8000 : 0);
      continue;
    }
    ASSERT_EQ(h, reference_half(f)) << std::hexfloat << f;
#ifdef __FLT16_MAX__  // the compiler's own conversion, a second reference where it has one
    ASSERT_EQ(h, std::bit_cast<uint16_t>(static_cast<_Float16>(f))) << std::hexfloat << f;
#endif
  }
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0) {
      EXPECT_TRUE(std::isnan(f)) << h;
    } else if ((h & 0x7FFF) == 0x7C00) {
      EXPECT_EQ(f, (h & 0x8000) ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(h)) << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
      ASSERT_EQ(float_to_half(f), h) << h;  // every half survives the round trip
    }
  }
}

TEST(Codec, BfloatConversionsRoundToNearestEvenLikeTheReference) {
  for (float f : conversion_probes()) {
    const uint16_t b = float_to_bfloat16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(b))) << f;
      EXPECT_EQ(b & 0x8000, std::signbit(f) ? 0x8000 : 0);
      continue;
    }
    ASSERT_EQ(b, reference_bfloat16(f)) << std::hexfloat << f;
  }
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bfloat16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_bfloat16(f), b);
    }
  }
}

// ---- names and params ----

TEST(Codec, NamesParseBackAndUnknownNamesAreRefusedWithTheChoices) {
  for (const CodecParams& p : all_configs()) EXPECT_EQ(parse_codec(codec_name(p.kind)), p.kind);
  EXPECT_STREQ(codec_name(CodecKind::quant2_topk), "quant2-topk");
  try {
    parse_codec("top-k");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"top-k\""), std::string::npos) << m;
    EXPECT_NE(m.find("none, fp16, bf16, sign1, quant2-topk, topk, randk"), std::string::npos) << m;
  }
}

TEST(Codec, MakeRefusesKeepOutsideZeroOneAndBlockBelowOne) {
  for (double keep : {0.0, -0.5, 1.5, std::nan("")}) EXPECT_THROW(make(CodecKind::topk, keep), Error) << keep;
  EXPECT_THROW(make(CodecKind::sign1, 1.0, 0), Error);
  EXPECT_THROW(make(CodecKind::quant2_topk, 0.5, -3), Error);
  EXPECT_THROW(Codec::make(CodecParams{static_cast<CodecKind>(42), 1.0, 256}), Error);
  EXPECT_NO_THROW(make(CodecKind::randk, 1e-9));
  EXPECT_TRUE(make(CodecKind::none)->lossless());
  for (const CodecParams& p : all_configs())
    if (p.kind != CodecKind::none) {
      EXPECT_FALSE(Codec::make(p)->lossless());
    }
}

TEST(Codec, KeepCountIsCeilOfKeepTimesNAtLeastOne) {
  EXPECT_EQ(codec_keep_count(0, 0.5), 0u);
  EXPECT_EQ(codec_keep_count(1, 0.01), 1u);
  EXPECT_EQ(codec_keep_count(1000, 0.01), 10u);
  EXPECT_EQ(codec_keep_count(1001, 0.01), 11u);
  EXPECT_EQ(codec_keep_count(7, 1.0), 7u);
  EXPECT_EQ(codec_keep_count(100003, 0.1), 10001u);
}

// ---- round trips ----

TEST(Codec, NoneRoundTripIsExact) {
  auto c = make(CodecKind::none);
  for (size_t n : kSizes) {
    const auto x = random_vector(n, n);
    EXPECT_EQ(decode(*c, encode(*c, x), n), x);
  }
}

// Round to nearest: relative error at most half an ulp, 2^-11 for fp16 (normal range), 2^-8 for
// bf16. Data spans 2^-12 .. 2^12 times a normal deviate.
TEST(Codec, HalfRoundTripsWithinHalfAnUlp) {
  for (auto [kind, rel] : {std::pair{CodecKind::fp16, 0x1.0p-11}, std::pair{CodecKind::bf16, 0x1.0p-8}}) {
    auto c = make(kind);
    for (size_t n : kSizes) {
      auto x = random_vector(n, n + 1);
      Rng rng(n);
      for (auto& v : x) v = std::ldexp(v, static_cast<int>(rng.below(25)) - 12);
      const auto d = decode(*c, encode(*c, x), n);
      size_t checked = 0;
      for (size_t i = 0; i < n; ++i) {
        const double a = std::fabs(x[i]);
        if (kind == CodecKind::fp16 && (a < 0x1.0p-14 || a > 65504)) {
          if (a < 0x1.0p-14) {
            ASSERT_LE(std::fabs(d[i] - x[i]), 0x1.0p-25) << i;  // subnormal: half a step
          }
          continue;
        }
        ASSERT_LE(std::fabs(static_cast<double>(d[i]) - x[i]), rel * a) << codec_name(kind) << " n=" << n << " i=" << i;
        ++checked;
      }
      EXPECT_GT(checked, n / 2);
    }
  }
}

// Dense sign1: every value decodes as +-(mean |x| of its block) with the sign of x, so the block
// means of |d| equal those of |x|, and ||x - d||^2 = ||x||^2 - sum_blocks len * s^2 <= ||x||^2.
TEST(Codec, Sign1KeepsSignsAndBlockMeansAndIsAContraction) {
  for (int block : {1, 7, 256}) {
    auto c = make(CodecKind::sign1, 1.0, block);
    for (size_t n : kSizes) {
      const auto x = random_vector(n, n + 2);
      const auto d = decode(*c, encode(*c, x), n);
      double err = 0, norm = 0;
      for (size_t first = 0; first < n; first += block) {
        const size_t end = std::min(n, first + block);
        double mean_x = 0, mean_d = 0;
        for (size_t i = first; i < end; ++i) {
          mean_x += std::fabs(x[i]);
          mean_d += std::fabs(d[i]);
          ASSERT_EQ(std::signbit(d[i]), std::signbit(x[i])) << i;
          ASSERT_EQ(std::fabs(d[i]), std::fabs(d[first])) << i;
          err += (static_cast<double>(x[i]) - d[i]) * (static_cast<double>(x[i]) - d[i]);
          norm += static_cast<double>(x[i]) * x[i];
        }
        ASSERT_NEAR(mean_d, mean_x, 1e-5 * mean_x) << "block " << block << " n " << n << " at " << first;
      }
      EXPECT_LE(err, norm) << "block " << block << " n " << n;
    }
  }
}

// Sparsified sign1: exactly the seed's k positions are nonzero (not rescaled by 1/keep), each
// block of `block` consecutive kept values decodes as +-(mean |x| over that block).
TEST(Codec, Sign1SparsifiedKeepsTheSeedsPositionsWithBlockMeans) {
  const int block = 7;
  auto c = make(CodecKind::sign1, 0.3, block);
  for (size_t n : kSizes) {
    const auto x = random_vector(n, n + 3);
    const auto d = decode(*c, encode(*c, x, 99), n);
    std::vector<uint32_t> kept;
    sample_positions(n, codec_keep_count(n, 0.3), 99, kept);
    const auto nz = nonzero_positions(d);
    ASSERT_EQ(nz, std::vector<size_t>(kept.begin(), kept.end())) << n;
    for (size_t first = 0; first < kept.size(); first += block) {
      const size_t end = std::min(kept.size(), first + block);
      double mean_x = 0;
      for (size_t j = first; j < end; ++j) mean_x += std::fabs(x[kept[j]]);
      mean_x /= static_cast<double>(end - first);
      for (size_t j = first; j < end; ++j) {
        ASSERT_NEAR(std::fabs(d[kept[j]]), mean_x, 1e-5 * mean_x) << n << " " << j;
        ASSERT_EQ(std::signbit(d[kept[j]]), std::signbit(x[kept[j]]));
      }
    }
  }
}

TEST(Codec, TopKKeepsExactlyTheLargestExactlyLowerIndexWinningTies) {
  auto c = make(CodecKind::topk, 0.1);
  for (size_t n : kSizes) {
    const size_t k = codec_keep_count(n, 0.1);
    for (bool ties : {false, true}) {
      auto x = random_vector(n, n + 4);
      Rng rng(n);
      if (ties)  // few distinct magnitudes: the cut falls inside a run of equal |x|
        for (auto& v : x)
          v = static_cast<float>(static_cast<int>(rng.below(4)) - 2) + (rng.below(4) >= 2 ? 0.5f : 0.0f);
      for (auto& v : x)
        if (v == 0.0f) v = 0.25f;  // nonzero, so decoded zeros mean dropped
      const auto d = decode(*c, encode(*c, x), n);
      const auto want = reference_topk(x, k);
      ASSERT_EQ(nonzero_positions(d), want) << n << (ties ? " ties" : "");
      for (size_t i : want) ASSERT_EQ(d[i], x[i]);
    }
  }
}

// quant2-topk keeps topk's positions (all of them at keep 1, with no positions sent); each kept
// value decodes to its sign times the nearer of its block's two magnitudes lo <= hi. The fitted
// magnitudes never do worse than sign1's code (mean |v| times the sign) on the same block, and on
// Gaussian values come within 7 % of the 4-level Lloyd-Max error (0.1175 of the variance).
TEST(Codec, Quant2TopKKeepsTopKPositionsOnFittedLevels) {
  for (double keep : {0.1, 1.0}) {
    for (int block : {5, 256}) {
      auto c = make(CodecKind::quant2_topk, keep, block);
      for (size_t n : kSizes) {
        const auto x = random_vector(n, n + 5);
        const auto bytes = encode(*c, x);
        const auto d = decode(*c, bytes, n);
        const size_t k = codec_keep_count(n, keep);
        const auto kept = reference_topk(x, k);
        if (keep == 1.0) {
          const size_t payload = 8 * ((n + block - 1) / block) + (n + 3) / 4;
          ASSERT_EQ(bytes.size(), Codec::kHeaderBytes + payload) << "dense: no positions";
        } else {
          ASSERT_EQ(nonzero_positions(d), kept) << n;
        }
        double err = 0, err_sign = 0, power = 0;
        for (size_t first = 0; first < kept.size(); first += block) {
          const size_t end = std::min(kept.size(), first + static_cast<size_t>(block));
          double mean_abs = 0;
          for (size_t j = first; j < end; ++j)
            mean_abs += std::fabs(static_cast<double>(x[kept[j]])) / static_cast<double>(end - first);
          // The block's magnitudes, where codec.h puts them: after the positions, two f32 per block.
          float level[2];
          std::memcpy(level, bytes.data() + Codec::kHeaderBytes + (k < n ? 4 * k : 0) + 8 * (first / block), 8);
          const double lo = level[0], hi = level[1];
          ASSERT_LE(lo, hi);
          ASSERT_GT(lo, 0.0);
          for (size_t j = first; j < end; ++j) {
            const double v = x[kept[j]], q = d[kept[j]];
            ASSERT_EQ(q > 0, v >= 0) << "sign of " << v;
            const double m = std::fabs(q), a = std::fabs(v);
            ASSERT_TRUE(m == lo || m == hi) << m;
            ASSERT_LE(std::fabs(a - m), std::min(std::fabs(a - lo), std::fabs(a - hi)) * (1 + 1e-6) + 1e-7 * hi)
                << "not the nearer magnitude: " << a << " -> " << m << " of " << lo << ", " << hi;
            err += (v - q) * (v - q);
            err_sign += (a - mean_abs) * (a - mean_abs);
            power += v * v;
          }
        }
        EXPECT_LE(err, err_sign * (1 + 1e-6) + 1e-12) << n << " block " << block;
        if (keep == 1.0 && n >= 1000) {
          EXPECT_LT(err, 0.1175 * 1.07 * power) << n << " block " << block;
        }
      }
    }
  }
}

TEST(Codec, RandKKeepsTheSeedsPositionsUnscaled) {
  auto c = make(CodecKind::randk, 0.1);
  for (size_t n : kSizes) {
    const auto x = random_vector(n, n + 6);
    const auto d = decode(*c, encode(*c, x, 7), n);
    std::vector<uint32_t> kept;
    sample_positions(n, codec_keep_count(n, 0.1), 7, kept);
    ASSERT_EQ(nonzero_positions(d), std::vector<size_t>(kept.begin(), kept.end())) << n;
    for (uint32_t i : kept) ASSERT_EQ(d[i], x[i]);
  }
}

// Each position is kept with probability k/n (both below and above half, where the sampler draws
// the complement); positions are distinct and ascending; the draw is a function of the seed only.
TEST(Codec, SamplePositionsIsUniformDistinctAndAscending) {
  const size_t n = 50, draws = 20000;
  for (size_t k : {size_t{10}, size_t{40}}) {
    std::vector<int> hits(n, 0);
    std::vector<uint32_t> p;
    for (size_t s = 0; s < draws; ++s) {
      sample_positions(n, k, s, p);
      ASSERT_EQ(p.size(), k);
      for (size_t j = 0; j < k; ++j) {
        ASSERT_LT(p[j], n);
        if (j > 0) {
          ASSERT_LT(p[j - 1], p[j]);
        }
        ++hits[p[j]];
      }
    }
    const double expect = static_cast<double>(draws) * k / n;
    const double sigma = std::sqrt(expect * (1.0 - static_cast<double>(k) / n));
    for (size_t i = 0; i < n; ++i) EXPECT_NEAR(hits[i], expect, 5 * sigma) << "k=" << k << " position " << i;
  }
  std::vector<uint32_t> too_many;
  EXPECT_THROW(sample_positions(5, 6, 1, too_many), Error);
}

TEST(Codec, EmptyInputEncodesToAHeader) {
  for (const CodecParams& p : all_configs()) {
    auto c = Codec::make(p);
    const auto bytes = encode(*c, {});
    EXPECT_EQ(bytes.size(), Codec::kHeaderBytes) << describe(p);
    EXPECT_NO_THROW(decode(*c, bytes, 0));
  }
}

// ---- decode_add, determinism ----

TEST(Codec, DecodeAddAddsSoDecodingSeveralEncodingsSumsThem) {
  const size_t n = 1000;
  for (const CodecParams& p : all_configs()) {
    auto c = Codec::make(p);
    const auto a = random_vector(n, 10), b = random_vector(n, 11), base = random_vector(n, 12);
    const auto ea = encode(*c, a, 1), eb = encode(*c, b, 2);
    const auto da = decode(*c, ea, n), db = decode(*c, eb, n);
    auto y = base;
    c->decode_add(ea.data(), ea.size(), n, y.data());
    c->decode_add(eb.data(), eb.size(), n, y.data());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(y[i], (base[i] + da[i]) + db[i]) << describe(p) << " " << i;
  }
}

TEST(Codec, SameInputAndSeedGiveTheSameBytesAndOnlyDrawingCodecsDependOnTheSeed) {
  const auto x = random_vector(1000, 13);
  for (const CodecParams& p : all_configs()) {
    auto c = Codec::make(p);
    const auto e1 = encode(*c, x, 1);
    EXPECT_EQ(e1, encode(*c, x, 1)) << describe(p);
    EXPECT_EQ(e1, encode(*Codec::make(p), x, 1)) << describe(p);
    const bool draws = p.kind == CodecKind::randk || (p.kind == CodecKind::sign1 && p.keep < 1);
    const auto e2 = encode(*c, x, 2);
    if (draws) {
      EXPECT_NE(e1, e2) << describe(p);
      EXPECT_NE(nonzero_positions(decode(*c, e1, x.size())), nonzero_positions(decode(*c, e2, x.size())));
    } else {
      EXPECT_EQ(e1, e2) << describe(p);
    }
  }
}

// The bytes are part of a wire format read by other ranks and other builds: pin them. Inputs come
// from integer arithmetic only, so the fixture does not depend on libm.
TEST(Codec, EncodingsMatchPinnedChecksums) {
  std::vector<float> x(1000);
  uint64_t state = 12345;
  for (auto& v : x) v = static_cast<float>(static_cast<int64_t>(splitmix64(state) % 2001) - 1000) / 64.0f;
  std::vector<uint32_t> p;
  sample_positions(1000, 5, 42, p);
  EXPECT_EQ(p, (std::vector<uint32_t>{83, 377, 678, 923, 991}));
  const uint64_t pinned[] = {0xa7c292007de542d5, 0xf22459efc0634a02, 0xcf9773677aca0e88,
                             0x0b9390ec03d2c438, 0xbd2b8136a963ad52, 0xa1b29a5c1c7ead82,
                             0xf04ff0c9426b021f, 0x5892c10d2de35646, 0xd6a262fb43f5790b};
  const auto configs = all_configs();
  for (size_t i = 0; i < configs.size(); ++i) {
    const auto bytes = encode(*Codec::make(configs[i]), x, 42);
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
    EXPECT_EQ(h, pinned[i]) << describe(configs[i]) << std::hex << ": 0x" << h;
  }
}

// ---- error feedback ----

// Over 200 steps, everything decoded plus the final residual equals everything put in, per
// element (float rounding aside): error feedback loses nothing, it only delays.
TEST(Codec, ErrorFeedbackConservesMass) {
  const size_t n = 1000, steps = 200;
  for (const CodecParams& p : all_configs()) {
    auto c = Codec::make(p);
    std::vector<float> residual(n, 0.0f), scratch;
    std::vector<uint8_t> out;
    std::vector<double> sum_in(n, 0.0), sum_out(n, 0.0), sum_abs_in(n, 0.0);
    for (size_t t = 0; t < steps; ++t) {
      const auto g = random_vector(n, 1000 + t, 1e-3);
      encode_with_feedback(*c, g.data(), residual.data(), n, t, out, scratch);
      const auto d = decode(*c, out, n);
      for (size_t i = 0; i < n; ++i) {
        sum_in[i] += g[i];
        sum_abs_in[i] += std::fabs(g[i]);
        sum_out[i] += d[i];
      }
    }
    for (size_t i = 0; i < n; ++i) {
      if (c->lossless()) {
        ASSERT_EQ(residual[i], 0.0f);
      }
      ASSERT_NEAR(sum_out[i] + residual[i], sum_in[i], 1e-4 * sum_abs_in[i]) << describe(p) << " element " << i;
    }
  }
}

// With top-k (keep 0.1) and rand-k (keep 0.1) the residual reaches a plateau instead of growing:
// its norm over the last third of 600 steps stays within 1.5x of its peak over the middle third,
// and within a fixed multiple of one gradient's norm.
TEST(Codec, ErrorFeedbackResidualStaysBounded) {
  const size_t n = 1000, steps = 600;
  for (CodecKind kind : {CodecKind::topk, CodecKind::randk}) {
    auto c = make(kind, 0.1);
    std::vector<float> residual(n, 0.0f), scratch;
    std::vector<uint8_t> out;
    double peak_middle = 0, peak_last = 0, grad_norm = 0;
    for (size_t t = 0; t < steps; ++t) {
      const auto g = random_vector(n, 5000 + t);
      encode_with_feedback(*c, g.data(), residual.data(), n, t, out, scratch);
      double r2 = 0, g2 = 0;
      for (size_t i = 0; i < n; ++i) {
        r2 += static_cast<double>(residual[i]) * residual[i];
        g2 += static_cast<double>(g[i]) * g[i];
      }
      grad_norm = std::sqrt(g2);
      if (t >= steps / 3 && t < 2 * steps / 3) peak_middle = std::max(peak_middle, std::sqrt(r2));
      if (t >= 2 * steps / 3) peak_last = std::max(peak_last, std::sqrt(r2));
    }
    std::printf("%s keep 0.1: residual norm peak %.2f (steps 200-399), %.2f (400-599); gradient norm %.2f\n",
                codec_name(kind), peak_middle, peak_last, grad_norm);
    EXPECT_LE(peak_last, 1.5 * peak_middle) << codec_name(kind);
    EXPECT_LE(peak_last, 10 * grad_norm) << codec_name(kind);
  }
}

// ---- malformed encodings ----

TEST(Codec, MalformedEncodingsAreRefused) {
  const size_t n = 37;
  const auto x = random_vector(n, 14);
  const auto configs = all_configs();
  for (const CodecParams& p : configs) {
    auto c = Codec::make(p);
    const auto good = encode(*c, x, 5);
    ASSERT_EQ(good.size(), c->max_encoded_bytes(n));
    std::vector<float> y(n + 1, 0.0f);
    const auto refused = [&](std::vector<uint8_t> bytes, size_t count, const std::string& why) {
      std::vector<float> before = y;
      EXPECT_THROW(c->decode_add(bytes.data(), bytes.size(), count, y.data()), Error) << describe(p) << ": " << why;
      EXPECT_EQ(y, before) << describe(p) << ": " << why << " changed y";
    };
    for (size_t len = 0; len < good.size(); ++len)
      refused(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len)), n, "truncated");
    auto longer = good;
    longer.push_back(0);
    refused(longer, n, "trailing byte");
    refused(good, n - 1, "wrong n");
    refused(good, n + 1, "wrong n");
    for (const CodecParams& q : configs)
      if (describe(q) != describe(p)) refused(encode(*Codec::make(q), x, 5), n, "encoding of " + describe(q));
    auto header = good;
    header[0] = 200;
    refused(header, n, "unknown kind byte");
    header = good;
    header[1] = 3;
    refused(header, n, "format version");
    header = good;
    header[2] = 1;
    refused(header, n, "reserved bytes");
    if (p.kind == CodecKind::topk || (p.kind == CodecKind::quant2_topk && p.keep < 1)) {
      auto bad = good;
      const uint32_t out_of_range = n;
      std::memcpy(bad.data() + Codec::kHeaderBytes, &out_of_range, 4);  // position 0 = n
      refused(bad, n, "position out of range");
      bad = good;
      std::memcpy(bad.data() + Codec::kHeaderBytes, bad.data() + Codec::kHeaderBytes + 4, 4);  // duplicate
      refused(bad, n, "positions not ascending");
      bad = good;
      bad[24] = 1;
      refused(bad, n, "seed set where nothing is drawn");
    }
    // Garbage payloads behind a valid header decode or are refused, and never touch memory
    // outside the buffers (the sanitizer build checks that).
    Rng rng(15);
    for (int trial = 0; trial < 200; ++trial) {
      auto bad = good;
      for (size_t i = Codec::kHeaderBytes; i < bad.size(); ++i) bad[i] = static_cast<uint8_t>(rng.next_u64());
      try {
        c->decode_add(bad.data(), bad.size(), n, y.data());
      } catch (const Error&) {
      }
    }
  }
}

TEST(Codec, RefusesTwoToTheThirtyTwoElementsWherePositionsAreStored) {
  const float x = 1.0f;
  std::vector<uint8_t> out;
  // Only the size is checked before reading x, so one float stands in for a huge input.
  for (CodecKind kind : {CodecKind::topk, CodecKind::quant2_topk, CodecKind::randk})
    EXPECT_THROW(make(kind, 1e-12)->encode(&x, size_t{1} << 32, 0, out), Error) << codec_name(kind);
  EXPECT_THROW(make(CodecKind::sign1, 0.5)->encode(&x, size_t{1} << 32, 0, out), Error);
}

TEST(Codec, NotANumberAndInfinityDoNotBreakSelection) {
  std::vector<float> x = random_vector(100, 16);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[50] = -std::numeric_limits<float>::infinity();
  for (CodecKind kind : {CodecKind::topk, CodecKind::quant2_topk}) {
    auto c = make(kind, 0.05);
    const auto d = decode(*c, encode(*c, x), x.size());
    EXPECT_TRUE(std::isnan(d[3])) << codec_name(kind);
    if (kind == CodecKind::topk) {
      EXPECT_EQ(d[50], x[50]);
    }
  }
}

// ---- sizes ----

// The bytes per element each codec puts on the wire for a 1M-element bucket with the default
// params (keep 0.01 for the sparsifiers, dense sign1, block 256) and dense quant2-topk (keep 1,
// no positions), against fp32's 4.
TEST(Codec, EncodedSizesPerElementAtOneMillion) {
  const size_t n = 1000000;
  const auto x = random_vector(n, 17);
  const CodecParams configs[] = {{CodecKind::none, 1.0, 256},         {CodecKind::fp16, 1.0, 256},
                                 {CodecKind::bf16, 1.0, 256},         {CodecKind::sign1, 1.0, 256},
                                 {CodecKind::quant2_topk, 0.01, 256}, {CodecKind::topk, 0.01, 256},
                                 {CodecKind::randk, 0.01, 256},       {CodecKind::quant2_topk, 1.0, 256}};
  const size_t k = 10000, h = Codec::kHeaderBytes;
  const size_t expected[] = {h + 4 * n, h + 2 * n, h + 2 * n, h + 4 * 3907 + n / 8, h + 4 * k + 8 * 40 + k / 4,
                             h + 8 * k, h + 4 * k, h + 8 * 3907 + n / 4};
  std::printf("%-12s %6s %12s %14s %12s\n", "codec", "keep", "bytes", "bytes/element", "vs fp32");
  for (size_t i = 0; i < std::size(configs); ++i) {
    auto c = Codec::make(configs[i]);
    const auto bytes = encode(*c, x);
    EXPECT_EQ(bytes.size(), expected[i]) << codec_name(configs[i].kind);
    EXPECT_EQ(bytes.size(), c->max_encoded_bytes(n));
    const double per = static_cast<double>(bytes.size()) / n;
    std::printf("%-12s %6.2f %12zu %14.5f %11.1fx\n", codec_name(configs[i].kind), configs[i].keep, bytes.size(), per,
                4.0 / per);
  }
}

}  // namespace
}  // namespace keel
