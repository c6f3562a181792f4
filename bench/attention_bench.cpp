// Times Keel's attention kernels alone, forward + backward, at one shape and prints one JSON line;
// bench/long_context.sh runs it side by side with PyTorch's scaled_dot_product_attention
// (bench/torch_long_context.py --attention-only) on the same shape.
//   keel_bench_attention --kind blockwise|dense --precision fp32|bf16 --batch B --seq T --heads NH
//                        [--kv-heads NKV] --head-size HS [--window W] [--repeats N] [--threads N]
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/blas.h"
#include "kernels/cpu/float_mode.h"

using namespace keel;

int main(int argc, char** argv) {
  prepare_compute_environment(argv);
  try {
    std::string kind = "blockwise", precision = "fp32";
    int B = 1, T = 4096, NH = 4, NKV = 0, hs = 64, window = 0, repeats = 2, threads = 0;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--kind" && has_value) kind = argv[++i];
      else if (a == "--precision" && has_value) precision = argv[++i];
      else if (a == "--batch" && has_value) B = std::stoi(argv[++i]);
      else if (a == "--seq" && has_value) T = std::stoi(argv[++i]);
      else if (a == "--heads" && has_value) NH = std::stoi(argv[++i]);
      else if (a == "--kv-heads" && has_value) NKV = std::stoi(argv[++i]);
      else if (a == "--head-size" && has_value) hs = std::stoi(argv[++i]);
      else if (a == "--window" && has_value) window = std::stoi(argv[++i]);
      else if (a == "--repeats" && has_value) repeats = std::stoi(argv[++i]);
      else if (a == "--threads" && has_value) threads = std::stoi(argv[++i]);
      else throw Error("keel_bench_attention: unknown or incomplete option '" + a + "' (see the file's header)");
    }
    if (NKV == 0) NKV = NH;
    check(kind == "blockwise" || kind == "dense", "--kind: expected blockwise or dense, found '" + kind + "'");
    check(precision == "fp32" || precision == "bf16", "--precision: expected fp32 or bf16, found '" + precision + "'");
    check(B >= 1 && T >= 1 && NH >= 1 && NKV >= 1 && NH % NKV == 0 && hs >= 1 && window >= 0 && repeats >= 1,
          "keel_bench_attention: expected positive sizes, --kv-heads dividing --heads, --window >= 0");
    check(kind == "blockwise" || window == 0, "--window: the dense kernel has no window");
    if (threads > 0) omp_set_num_threads(threads);
    set_flush_denormals(true);
    const MatmulPrecision p = precision == "bf16" ? MatmulPrecision::bf16 : MatmulPrecision::fp32;
    const ops::AttentionTiming t = ops::time_attention(kind == "dense", p, B, T, NH * hs, NH, NKV, window, repeats);
    std::printf("{\"kind\": \"%s\", \"precision\": \"%s\", \"seq\": %d, \"window\": %d, \"forward_ms\": %.2f, "
                "\"backward_ms\": %.2f, \"ms\": %.2f, \"threads\": %d}\n",
                kind.c_str(), precision.c_str(), T, window, t.forward_ms, t.backward_ms, t.total_ms(),
                omp_get_max_threads());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
