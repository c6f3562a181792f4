"""PyTorch's side of bench/gemm_routes.cpp: the same products of one training step of a GPT-2
shape, as PyTorch's training step computes them (bench/torch_gpt2_train.py: nn.Linear's forward
F.linear with its bias, autograd's input gradient dy @ W and weight gradient dy^T @ x (zero_grad(set_to_none=True):
the first micro-batch's gradient is the product itself, nothing added); attention's batched products on [B*NH, T, hs] tensors), timed by CPU time
(time.process_time: all threads), the median of --repeats measurements of --inner calls each.
Run it in the environment the steady-state bench gives PyTorch (2 threads, passive waiting):
    OMP_WAIT_POLICY=PASSIVE /work/venv-torch/bin/python bench/gemm_routes_torch.py
Prints one line per product, the step's sum and a JSON line; which BLAS PyTorch was built with
(torch.__config__: MKL in the PyPI wheels, OpenBLAS in Debian's 1.13)."""
import argparse
import json
import math
import re
import statistics
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 16), ("seq", 128), ("channels", 256), ("hidden", 1024), ("vocab", 8192),
                          ("heads", 4), ("layers", 4), ("repeats", 7), ("inner", 3), ("threads", 2)):
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(5)
    B, T, C, H, V, NH, L = a.batch, a.seq, a.channels, a.hidden, a.vocab, a.heads, a.layers
    N, hs = B * T, C // NH
    config = torch.__config__.show()
    found = re.search(r"BLAS_INFO=(\w+)", config)
    blas = found.group(1) if found else "?"
    mkldnn = "USE_MKLDNN=ON" in config or "USE_MKLDNN=1" in config
    print("PyTorch %s, BLAS %s, oneDNN (mkldnn) %s, %d threads; CPU ms per call, median of %d measurements of %d calls"
          % (torch.__version__, blas, "built in" if mkldnn else "absent", torch.get_num_threads(), a.repeats, a.inner))

    def r(*shape):
        return torch.randn(*shape) * 0.1

    products = []  # (name, per_step, flop, fn)
    for name, cin, cout, count, bias in (("qkv", C, 3 * C, L, True), ("proj", C, C, L, True), ("fc", C, H, L, True),
                                         ("fc.proj", H, C, L, True), ("head", C, V, 1, False)):
        x, w, dy = r(N, cin), r(cout, cin), r(N, cout)
        b = r(cout) if bias else None
        flop = 2.0 * N * cin * cout
        products.append((name + " forward", count, flop, lambda x=x, w=w, b=b: F.linear(x, w, b)))
        products.append((name + " input-grad", count, flop, lambda dy=dy, w=w: dy.mm(w)))
        products.append((name + " weight-grad", count, flop, lambda dy=dy, x=x: dy.t().mm(x)))
    q, k, v, d = r(B * NH, T, hs), r(B * NH, T, hs), r(B * NH, T, hs), r(B * NH, T, hs)
    att, mask = r(B * NH, T, T), r(T, T)
    hflop = 2.0 * B * NH * T * T * hs
    scale = 1.0 / math.sqrt(hs)
    products += [
        ("attn q k^T", L, hflop, lambda: torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)),
        ("attn att v", L, hflop, lambda: torch.bmm(att, v)),
        ("attn d v^T", L, hflop, lambda: torch.bmm(d, v.transpose(1, 2))),
        ("attn att^T d", L, hflop, lambda: torch.bmm(att.transpose(1, 2), d)),
        ("attn datt k", L, hflop, lambda: torch.bmm(att, k)),
        ("attn datt^T q", L, hflop, lambda: torch.bmm(att.transpose(1, 2), q)),
    ]
    total = 0.0
    rows = []
    with torch.no_grad():
        for name, count, flop, fn in products:
            fn()
            samples = []
            for _ in range(a.repeats):
                t0 = time.process_time()
                for _ in range(a.inner):
                    fn()
                samples.append((time.process_time() - t0) * 1e3 / a.inner)
            ms = statistics.median(samples)
            total += ms * count
            rows.append({"product": name, "per_step": count, "cpu_ms": round(ms, 4)})
            print("%-20s x%-3d torch %.3f [%.0f]" % (name, count, ms, flop / ms * 1e-6))
    print("CPU ms per step (all products x their count): torch %.1f" % total)
    print(json.dumps({"torch": torch.__version__, "blas": blas, "step_cpu_ms": round(total, 2), "products": rows}))


if __name__ == "__main__":
    main()
