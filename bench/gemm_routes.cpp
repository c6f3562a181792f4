// Per shape, which route computes a float32 product of a training step fastest (issue 38 item 4).
// Every matrix product of one step of a GPT-2 shape (N tokens = B x T rows, C channels, H hidden,
// V vocabulary, NH heads of T positions), timed by CPU time (CLOCK_PROCESS_CPUTIME_ID: all
// threads, which a machine loaded by others disturbs far less than wall time), routes interleaved
// (route 1, 2, 3, ..., 1, 2, 3, ...), the median of `--repeats` measurements of `--inner` calls each:
//   openblas  OpenBLAS SGEMM as Keel calls it (kernels/cpu/blas.h gemm<float>), which copies both
//             operands into its panel layout on every call; attention's per-head products one per
//             thread inside a parallel region, as ops.cpp attention_forward/backward runs them;
//   plain     oneDNN's float32 matmul on the same strided operands (attention: one batched
//             4-D matmul over batch x head);
//   reorder   oneDNN with the weight reordered on every call into the blocked layout oneDNN picks
//             (kernels/cpu/weight_gemm.h's route; weight products only);
//   packed    oneDNN on a weight reordered once beforehand (a copy kept per optimizer step would
//             give this; weight products only), the reorder's own CPU time beside it.
// Products, weights W [out, in] as the layers hold them: forward y = x W^T (+ bias: beta 1),
// input gradient dx = dy W, weight gradient dW += dy^T x for qkv, attention out (proj), fc,
// fc.proj (x n_layer) and the tied LM head (x 1); attention's QK^T, PV and their four backward
// products (x B x NH x n_layer). Prints one line per product, the step's sums per route, and a
// JSON line. bench/gemm_routes_torch.py times PyTorch on the same list.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <dnnl.hpp>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/blas.h"

using namespace keel;

namespace {

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double wall_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

enum class Kind { weight, weight_grad, attention };

// One matrix operand of a (possibly batched) product, row-major: `rows` x `cols` as stored
// (the transpose of the logical operand when trans), leading dimension ld, and for attention the
// offsets of batch b and head h.
struct Matrix {
  bool trans = false;
  int ld = 0;
  int64_t batch_stride = 0, head_stride = 0;
};

struct Product {
  std::string name;
  Kind kind;
  int M, N, K;
  Matrix a, b, c;
  float alpha, beta;
  int count;  // per step
  std::string torch;  // how bench/gemm_routes_torch.py computes it
};

struct Sizes {
  int B, T, C, H, V, NH, L;
};

std::vector<Product> step_products(const Sizes& s) {
  const int N = s.B * s.T, C = s.C, H = s.H, V = s.V, L = s.L, hs = s.C / s.NH, C3 = 3 * s.C, T = s.T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  auto row = [](int ld) { return Matrix{false, ld, 0, 0}; };
  auto col = [](int ld) { return Matrix{true, ld, 0, 0}; };
  std::vector<Product> p;
  struct Linear {
    const char* name;
    int in, out, count;
    float fwd_beta;
  };
  const Linear linears[] = {{"qkv", C, C3, L, 1.0f},
                            {"proj", C, C, L, 1.0f},
                            {"fc", C, H, L, 1.0f},
                            {"fc.proj", H, C, L, 1.0f},
                            {"head", C, V, 1, 0.0f}};
  for (const Linear& l : linears) {
    const std::string n = l.name;
    // forward out[N, out] = x[N, in] W^T, W [out, in]
    p.push_back({n + " forward", Kind::weight, N, l.out, l.in, row(l.in), col(l.in), row(l.out), 1.0f, l.fwd_beta,
                 l.count, "linear"});
    // input gradient dx[N, in] = dy[N, out] W
    p.push_back({n + " input-grad", Kind::weight, N, l.in, l.out, row(l.out), row(l.in), row(l.in), 1.0f, 0.0f,
                 l.count, "dy@W"});
    // weight gradient dW[out, in] += dy^T x
    p.push_back({n + " weight-grad", Kind::weight_grad, l.out, l.in, N, col(l.out), row(l.in), row(l.in), 1.0f, 1.0f,
                 l.count, "dy.t()@x"});
  }
  const int heads = s.B * s.NH * L;
  // [B, T, width] tensors read per head at column h * hs; [B, NH, T, T] attention maps.
  auto rows_of = [&](int ld, bool trans) { return Matrix{trans, ld, static_cast<int64_t>(T) * ld, hs}; };
  const Matrix map{false, T, static_cast<int64_t>(s.NH) * T * T, static_cast<int64_t>(T) * T};
  Matrix map_t = map;
  map_t.trans = true;
  p.push_back({"attn q k^T", Kind::attention, T, T, hs, rows_of(C3, false), rows_of(C3, true), map, scale, 0.0f, heads,
               "bmm"});
  p.push_back({"attn att v", Kind::attention, T, hs, T, map, rows_of(C3, false), rows_of(C, false), 1.0f, 0.0f, heads,
               "bmm"});
  p.push_back({"attn d v^T", Kind::attention, T, T, hs, rows_of(C, false), rows_of(C3, true), map, 1.0f, 0.0f, heads,
               "bmm"});
  p.push_back({"attn att^T d", Kind::attention, T, hs, T, map_t, rows_of(C, false), rows_of(C3, false), 1.0f, 0.0f,
               heads, "bmm"});
  p.push_back({"attn datt k", Kind::attention, T, hs, T, map, rows_of(C3, false), rows_of(C3, false), 1.0f, 0.0f,
               heads, "bmm"});
  p.push_back({"attn datt^T q", Kind::attention, T, hs, T, map_t, rows_of(C3, false), rows_of(C3, false), 1.0f, 0.0f,
               heads, "bmm"});
  return p;
}

// Elements an operand of logical rows x cols spans (one matrix, or all B x NH of them).
size_t span(const Matrix& o, int rows, int cols, const Sizes& s, bool batched) {
  const int stored_rows = o.trans ? cols : rows;
  const int stored_cols = o.trans ? rows : cols;
  size_t n = static_cast<size_t>(stored_rows - 1) * o.ld + stored_cols;
  if (batched) n += static_cast<size_t>(s.B - 1) * o.batch_stride + static_cast<size_t>(s.NH - 1) * o.head_stride;
  return n;
}

dnnl::memory::desc desc_of(const Matrix& o, int rows, int cols, const Sizes& s, bool batched) {
  using dnnl::memory;
  const memory::dim inner_row = o.trans ? 1 : o.ld, inner_col = o.trans ? o.ld : 1;
  if (!batched) return memory::desc({rows, cols}, memory::data_type::f32, memory::dims{inner_row, inner_col});
  return memory::desc({s.B, s.NH, rows, cols}, memory::data_type::f32,
                      memory::dims{o.batch_stride, o.head_stride, inner_row, inner_col});
}

struct Routes {
  std::vector<std::string> names;
  std::vector<std::function<void()>> runs;
};

// CPU ms per call: median over repeats of (CPU time of `inner` calls) / inner; routes interleaved.
std::vector<double> time_routes(const Routes& r, int repeats, int inner, std::vector<double>* wall_ms) {
  const size_t n = r.runs.size();
  std::vector<std::vector<double>> cpu(n), wall(n);
  for (const auto& run : r.runs) run();  // warm-up (primitive creation, first-touch)
  for (int rep = 0; rep < repeats; ++rep) {
    for (size_t i = 0; i < n; ++i) {
      const double w0 = wall_seconds(), c0 = cpu_seconds();
      for (int k = 0; k < inner; ++k) r.runs[i]();
      cpu[i].push_back((cpu_seconds() - c0) * 1e3 / inner);
      wall[i].push_back((wall_seconds() - w0) * 1e3 / inner);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  std::vector<double> out(n);
  wall_ms->assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    out[i] = median(cpu[i]);
    (*wall_ms)[i] = median(wall[i]);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_compute_environment(argv);
  Sizes s{16, 128, 256, 1024, 8192, 4, 4};  // the default job (configs/default.toml, preset d4)
  int repeats = 7, inner = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--batch") s.B = v;
    else if (k == "--seq") s.T = v;
    else if (k == "--channels") s.C = v;
    else if (k == "--hidden") s.H = v;
    else if (k == "--vocab") s.V = v;
    else if (k == "--heads") s.NH = v;
    else if (k == "--layers") s.L = v;
    else if (k == "--repeats") repeats = v;
    else if (k == "--inner") inner = v;
    else {
      std::fprintf(stderr,
                   "gemm_routes: unknown option %s (--batch --seq --channels --hidden --vocab --heads --layers "
                   "--repeats --inner)\n",
                   k.c_str());
      return 2;
    }
  }
  if (s.C % s.NH != 0 || repeats < 1 || inner < 1) {
    std::fprintf(stderr, "gemm_routes: --channels must be a multiple of --heads; --repeats, --inner >= 1\n");
    return 2;
  }
  const std::vector<Product> products = step_products(s);
  std::printf("B=%d T=%d C=%d H=%d V=%d NH=%d L=%d (%d rows), %d threads, OpenBLAS %s, oneDNN %d.%d.%d\n", s.B, s.T,
              s.C, s.H, s.V, s.NH, s.L, s.B * s.T, omp_get_max_threads(), blas_core().c_str(),
              dnnl_version()->major, dnnl_version()->minor, dnnl_version()->patch);
  std::printf("CPU ms per call (all threads), median of %d interleaved measurements of %d calls; GFLOP per CPU-second "
              "in brackets\n",
              repeats, inner);
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::map<std::string, double> step_ms;  // route -> CPU ms per step
  double best_ms = 0, openblas_ms = 0, reorder_once_ms = 0;
  std::string json = "[";
  for (const Product& p : products) {
    using dnnl::memory;
    const bool batched = p.kind == Kind::attention;
    Rng rng(5);
    auto filled = [&](size_t n) {
      std::vector<float> v(n);
      for (float& x : v) x = static_cast<float>(rng.normal()) * 0.1f;
      return v;
    };
    std::vector<float> a = filled(span(p.a, p.M, p.K, s, batched)), b = filled(span(p.b, p.K, p.N, s, batched)),
                       c = filled(span(p.c, p.M, p.N, s, batched));
    const memory::desc a_md = desc_of(p.a, p.M, p.K, s, batched), b_md = desc_of(p.b, p.K, p.N, s, batched),
                       c_md = desc_of(p.c, p.M, p.N, s, batched);
    dnnl::primitive_attr attr;
    if (p.alpha != 1.0f) attr.set_output_scales(0, {p.alpha});
    if (p.beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(p.beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul plain(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine));
    memory a_mem(a_md, engine, a.data()), b_mem(b_md, engine, b.data()), c_mem(c_md, engine, c.data());
    Routes r;
    auto blas_one = [&p](const float* A, const float* B, float* C) {
      gemm<float>(MatmulPrecision::fp32, p.a.trans, p.b.trans, p.M, p.N, p.K, p.alpha, A, p.a.ld, B, p.b.ld, p.beta, C,
                  p.c.ld);
    };
    if (batched) {
      r.names.push_back("openblas");
      r.runs.push_back([&] {
#pragma omp parallel for schedule(static)
        for (int bh = 0; bh < s.B * s.NH; ++bh) {
          const int bi = bh / s.NH, h = bh % s.NH;
          auto at = [&](const Matrix& o) { return bi * o.batch_stride + h * o.head_stride; };
          blas_one(a.data() + at(p.a), b.data() + at(p.b), c.data() + at(p.c));
        }
      });
    } else {
      r.names.push_back("openblas");
      r.runs.push_back([&] { blas_one(a.data(), b.data(), c.data()); });
    }
    r.names.push_back("plain");
    r.runs.push_back([&] {
      plain.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
      stream.wait();
    });
    // The weight products' blocked routes.
    std::unique_ptr<dnnl::matmul> packed;
    std::unique_ptr<dnnl::reorder> reorder;
    memory b_packed;
    if (p.kind == Kind::weight) {
      const memory::desc b_any({p.K, p.N}, memory::data_type::f32, memory::format_tag::any);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_any, c_md), attr, engine);
      packed = std::make_unique<dnnl::matmul>(pd);
      b_packed = memory(pd.weights_desc(), engine);
      reorder = std::make_unique<dnnl::reorder>(b_mem, b_packed);
      auto do_reorder = [&] {
        reorder->execute(stream, b_mem, b_packed);
        stream.wait();
      };
      auto do_packed = [&] {
        packed->execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_packed}, {DNNL_ARG_DST, c_mem}});
        stream.wait();
      };
      r.names.push_back("reorder");
      r.runs.push_back([=] {
        do_reorder();
        do_packed();
      });
      r.names.push_back("packed");
      r.runs.push_back(do_packed);
      r.names.push_back("(the reorder)");
      r.runs.push_back(do_reorder);
    }
    std::vector<double> wall;
    const std::vector<double> ms = time_routes(r, repeats, inner, &wall);
    const double gflop = 2.0 * p.M * p.N * p.K * (batched ? s.B * s.NH : 1) * 1e-9;
    std::printf("%-20s %5d x %5d x %5d%s x%-4d", p.name.c_str(), p.M, p.N, p.K, batched ? " (per head)" : "",
                batched ? p.count / (s.B * s.NH) : p.count);
    size_t best = 0;
    const size_t compared = p.kind == Kind::weight ? 4 : r.runs.size();  // (the reorder) alone is not a route
    for (size_t i = 0; i < r.runs.size(); ++i) {
      const bool route = i < compared;
      std::printf("  %s %.3f", r.names[i].c_str(), ms[i]);
      if (route) std::printf(" [%.0f]", gflop / ms[i] * 1e3);
      if (route && ms[i] < ms[best]) best = i;
    }
    const int per_step = batched ? p.count / (s.B * s.NH) : p.count;
    std::printf("  -> %s %.2fx\n", r.names[best].c_str(), ms[0] / ms[best]);
    for (size_t i = 0; i < compared; ++i) {
      step_ms[r.names[i]] += ms[i] * per_step;
    }
    // Routes a product does not have count as OpenBLAS in the per-route sums.
    if (p.kind != Kind::weight) {
      step_ms["reorder"] += ms[0] * per_step;
      step_ms["packed"] += ms[0] * per_step;
    }
    if (p.kind == Kind::weight) reorder_once_ms += ms[4] * per_step;
    best_ms += ms[best] * per_step;
    openblas_ms += ms[0] * per_step;
    char buffer[512];
    std::snprintf(buffer, sizeof buffer, "%s{\"product\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, \"per_step\": %d, "
                  "\"cpu_ms\": {",
                  json.size() > 1 ? ", " : "", p.name.c_str(), p.M, p.N, p.K, per_step);
    json += buffer;
    for (size_t i = 0; i < r.runs.size(); ++i) {
      std::snprintf(buffer, sizeof buffer, "%s\"%s\": %.4f", i > 0 ? ", " : "", r.names[i].c_str(), ms[i]);
      json += buffer;
    }
    json += "}}";
  }
  json += "]";
  std::printf("CPU ms per step (all products x their count): openblas %.1f, plain %.1f, reorder %.1f, packed %.1f "
              "(+ reorders once per update %.1f), the best route per product %.1f (%.2fx openblas)\n",
              step_ms["openblas"], step_ms["plain"], step_ms["reorder"], step_ms["packed"], reorder_once_ms, best_ms,
              openblas_ms / best_ms);
  std::printf("{\"B\": %d, \"T\": %d, \"C\": %d, \"H\": %d, \"V\": %d, \"NH\": %d, \"L\": %d, \"step_cpu_ms\": {\"openblas\": "
              "%.2f, \"plain\": %.2f, \"reorder\": %.2f, \"packed\": %.2f, \"reorders_once\": %.2f, \"best\": %.2f}, "
              "\"products\": %s}\n",
              s.B, s.T, s.C, s.H, s.V, s.NH, s.L, step_ms["openblas"], step_ms["plain"], step_ms["reorder"],
              step_ms["packed"], reorder_once_ms, best_ms, json.c_str());
  return 0;
}
