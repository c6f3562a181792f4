// Where a packed-weight route for the float32 products would pay (issue 38 item 4): each dense
// product of a training step at one model shape, timed through three routes side by side,
// interleaved (route 1, 2, 3, 1, 2, 3, ...), the best of `--repeats` each:
//   - OpenBLAS SGEMM as Keel runs it (kernels/cpu/blas.h gemm<float>), which copies both operands
//     into its panel layout on every call;
//   - oneDNN's float32 matmul on the same row-major operands (plain strides);
//   - oneDNN's float32 matmul with the weight operand reordered beforehand into the blocked layout
//     oneDNN picks for the shape (what a copy kept per optimizer step, as the bf16 copies are, would
//     give), with the reorder's own time beside it (paid once per update and layout).
// Products (N tokens, C channels, H hidden, V vocabulary), weights W [out, in] as the layers hold
// them: forward y = x W^T and backward-input dx = dy W for the attention's qkv and output
// projections, the MLP's two and the tied LM head. (Weight gradients read two activations: no
// weight to pack.) Prints one line per product and a JSON line with the step's totals.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dnnl.hpp>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/blas.h"

using namespace keel;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Product {
  std::string name;
  int M, N, K;
  bool trans_b;  // forward: B = W^T (W [N, K] read transposed); backward-input: B = W [K, N]
};

struct Times {
  double blas_s = 1e30, onednn_s = 1e30, packed_s = 1e30, reorder_s = 1e30;
};

Times time_product(const Product& p, int repeats) {
  using dnnl::memory;
  std::vector<float> a(static_cast<size_t>(p.M) * p.K), b(static_cast<size_t>(p.K) * p.N), c(static_cast<size_t>(p.M) * p.N);
  Rng rng(5);
  for (float& x : a) x = static_cast<float>(rng.normal());
  for (float& x : b) x = static_cast<float>(rng.normal());
  const int ldb = p.trans_b ? p.K : p.N;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc a_md({p.M, p.K}, memory::data_type::f32, memory::dims{p.K, 1});
  const memory::desc b_md({p.K, p.N}, memory::data_type::f32, p.trans_b ? memory::dims{1, p.K} : memory::dims{p.N, 1});
  const memory::desc c_md({p.M, p.N}, memory::data_type::f32, memory::dims{p.N, 1});
  const memory::desc b_any({p.K, p.N}, memory::data_type::f32, memory::format_tag::any);
  const dnnl::matmul plain(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine));
  const dnnl::matmul::primitive_desc packed_pd(dnnl::matmul::desc(a_md, b_any, c_md), engine);
  const dnnl::matmul packed(packed_pd);
  memory a_mem(a_md, engine, a.data()), b_mem(b_md, engine, b.data()), c_mem(c_md, engine, c.data());
  memory b_packed(packed_pd.weights_desc(), engine);
  auto blas = [&] {
    gemm<float>(MatmulPrecision::fp32, false, p.trans_b, p.M, p.N, p.K, 1.0f, a.data(), p.K, b.data(), ldb, 0.0f,
                c.data(), p.N);
  };
  auto reorder = [&] {
    dnnl::reorder(b_mem, b_packed).execute(stream, b_mem, b_packed);
    stream.wait();
  };
  auto run = [&](const dnnl::matmul& m, memory& weights) {
    m.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, c_mem}});
    stream.wait();
  };
  blas();
  reorder();
  run(plain, b_mem);
  run(packed, b_packed);
  Times t;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    blas();
    t.blas_s = std::min(t.blas_s, seconds_since(t0));
    t0 = Clock::now();
    run(plain, b_mem);
    t.onednn_s = std::min(t.onednn_s, seconds_since(t0));
    t0 = Clock::now();
    reorder();
    t.reorder_s = std::min(t.reorder_s, seconds_since(t0));
    t0 = Clock::now();
    run(packed, b_packed);
    t.packed_s = std::min(t.packed_s, seconds_since(t0));
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_compute_environment(argv);
  int N = 512, C = 768, H = 3072, V = 50304, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--tokens") N = v;
    else if (k == "--channels") C = v;
    else if (k == "--hidden") H = v;
    else if (k == "--vocab") V = v;
    else if (k == "--repeats") repeats = v;
    else {
      std::fprintf(stderr, "gemm_routes: unknown option %s (--tokens --channels --hidden --vocab --repeats)\n", k.c_str());
      return 2;
    }
  }
  const std::vector<Product> products = {
      {"qkv forward", N, 3 * C, C, true},    {"qkv backward-input", N, C, 3 * C, false},
      {"attn.proj forward", N, C, C, true},  {"attn.proj backward-input", N, C, C, false},
      {"fc forward", N, H, C, true},         {"fc backward-input", N, C, H, false},
      {"fc.proj forward", N, C, H, true},    {"fc.proj backward-input", N, H, C, false},
      {"head forward", N, V, C, true},       {"head backward-input", N, C, V, false}};
  std::printf("N=%d C=%d H=%d V=%d, %d threads, OpenBLAS %s; ms, the best of %d interleaved runs\n", N, C, H, V,
              omp_get_max_threads(), blas_core().c_str(), repeats);
  Times layer{0, 0, 0, 0}, head{0, 0, 0, 0};  // sums
  for (const Product& p : products) {
    const Times t = time_product(p, repeats);
    const double gflop = 2.0 * p.M * p.N * p.K * 1e-9;
    std::printf("%-26s OpenBLAS %8.2f (%6.1f GFLOP/s)  oneDNN %8.2f (%.2fx)  oneDNN packed %8.2f (%.2fx) + reorder %7.2f\n",
                p.name.c_str(), t.blas_s * 1e3, gflop / t.blas_s, t.onednn_s * 1e3, t.blas_s / t.onednn_s,
                t.packed_s * 1e3, t.blas_s / t.packed_s, t.reorder_s * 1e3);
    Times& sum = p.name.rfind("head", 0) == 0 ? head : layer;
    sum.blas_s += t.blas_s;
    sum.onednn_s += t.onednn_s;
    sum.packed_s += t.packed_s;
    sum.reorder_s += t.reorder_s;
  }
  std::printf("{\"tokens\": %d, \"channels\": %d, \"layer_ms\": {\"openblas\": %.2f, \"onednn\": %.2f, \"packed\": %.2f, "
              "\"reorders\": %.2f}, \"head_ms\": {\"openblas\": %.2f, \"onednn\": %.2f, \"packed\": %.2f, \"reorders\": %.2f}}\n",
              N, C, layer.blas_s * 1e3, layer.onednn_s * 1e3, layer.packed_s * 1e3, layer.reorder_s * 1e3,
              head.blas_s * 1e3, head.onednn_s * 1e3, head.packed_s * 1e3, head.reorder_s * 1e3);
  return 0;
}
