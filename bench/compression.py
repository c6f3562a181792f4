#!/usr/bin/env python3
"""HybridGC: compressed data-parallel gradient sync against uncompressed, side by side, on this machine.

Two parts, each printed as tables with verdicts (exit status 0 whatever the verdicts; non-zero only
when a run fails or a part cannot run):

convergence  The default job (model d4, ~5M parameters, the fortunes corpus in data/fortunes) on
             2 and 4 ranks (1 thread each; 4 ranks oversubscribe 2 cores, which changes speed, not
             results), the same seed, steps and global batch (32 sequences of 128 tokens) for every
             run: uncompressed (sync.codec=none) against HybridGC (sync.codec=hybrid, its default
             depth policy), and, on 2 ranks, each codec alone. Reports the final validation loss
             and its distance from the uncompressed run, the bytes each rank sent over the run and
             how many fewer that is, codec time as a share of the step, and the loss curves of
             uncompressed and hybrid side by side (training loss averaged over 25-step windows,
             validation loss every 50 steps). Targets: hybrid's final validation loss within 2 %
             of uncompressed, with at least 85 % fewer bytes.

network      GPT-2 124M (L12 C768 H12, vocabulary 50304, random tokens, per-rank batch 4 x 64
             tokens, as bench/compare_dp.sh), 2 ranks in two network namespaces joined by veth
             pairs through a bridge (scripts/netns.sh), real TCP between them:
               shaped    tbf 1 Gbit/s each way (and netem delay 0.2 ms where the kernel has
                         sch_netem; where it does not, the run says so and goes on without it)
               unshaped  the same namespaces and links without any qdisc
             Uncompressed and hybrid (without its uncompressed warm-up steps, so that every timed
             step is compressed) alternate, --repeats times each, and the best tokens/s of each
             is kept. Target: hybrid at least 2x the tokens/s of uncompressed on the
             shaped link. Needs root and iproute2.

Usage: bench/compression.py [--only convergence|network] [--steps N] [--ranks 2,4] [--codecs LIST]
                            [--net-steps N] [--net-warmup N] [--repeats R] [--rate R] [--delay D]
                            [--out FILE] [--report FILE]
  --steps N       optimizer steps of each convergence run (default 300, the default job's)
  --ranks LIST    rank counts for uncompressed vs hybrid (default 2,4)
  --codecs LIST   codecs run alone on 2 ranks (default fp16,bf16,sign1,quant2-topk,topk,randk; "" = none)
  --net-steps N   timed steps per network run (default 4), after --net-warmup N untimed (default 2)
  --repeats R     network runs of each variant per link (default 2)
  --rate R        shaped link rate (default 1gbit); --delay D its one-way delay (default 0.2ms)
  --out FILE      also write every run's result as a JSON line
  --report FILE   run nothing: print the tables again from a file written by --out
Environment: KEEL (default build/keel), RUN_TIMEOUT (seconds per run, default 3600).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from benchutil import netns_sh, run_logged, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
NETNS = os.path.join(ROOT, "scripts", "netns.sh")
RUN_TIMEOUT = int(os.environ.get("RUN_TIMEOUT", "3600"))
DEFAULT_CODECS = "fp16,bf16,sign1,quant2-topk,topk,randk"


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def read_metrics(run_dir):
    steps, evals = [], []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            j = json.loads(line)
            if "loss" in j:
                steps.append(j)
            elif "val_loss" in j:
                evals.append(j)
    return steps, evals


def run_keel(args, log_path, env_extra=None, prefix=None):
    run_logged((prefix or [KEEL]) + args, log_path, ROOT, RUN_TIMEOUT, "compression.py", env_extra)


# ---------------------------------------------------------------------------------------------
# Convergence

def convergence_run(work, ranks, codec, steps):
    name = "conv-%d-%s" % (ranks, codec)
    run_dir = os.path.join(work, name)
    args = ["launch", "-n", str(ranks), "--", "train",
            "--set", "train.run_dir=" + run_dir, "--set", "train.steps=%d" % steps,
            "--set", "train.global_batch_size=32", "--set", "train.eval_every=50",
            "--set", "train.sample_tokens=0", "--set", "train.log_every=50",
            "--set", "train.checkpoint_every=0", "--set", "runtime.threads=1",
            "--set", "runtime.peak_gflops=100", "--set", "sync.codec=" + codec]
    log("  [convergence] %d ranks, codec %-11s ..." % (ranks, codec))
    run_keel(args, run_dir + ".log")
    s, e = read_metrics(run_dir)
    sent = sum(x.get("sync_sent_bytes", 0.0) for x in s)
    plain = sum(x.get("sync_uncompressed_bytes", x.get("sync_sent_bytes", 0.0)) for x in s)
    timed = [x for x in s if x["step"] > 1]
    result = {
        "part": "convergence", "ranks": ranks, "codec": codec, "steps": steps,
        "val_loss": e[-1]["val_loss"], "val_curve": [[x["step"], x["val_loss"]] for x in e],
        "train_loss": [x["loss"] for x in s],
        "sent_mb": sent / 1e6, "uncompressed_mb": plain / 1e6,
        "tokens_per_s": mean([x["tokens_per_s"] for x in timed]),
        "codec_share": mean([x.get("sync_codec_share", 0.0) for x in timed]),
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def report_convergence(results):
    conv = [r for r in results if r["part"] == "convergence"]
    if not conv:
        return
    print("\n== Convergence: model d4 on data/fortunes, global batch 32 x 128 tokens, %d steps, seed 1337 ==" %
          conv[0]["steps"])
    print("%-6s %-12s %9s %8s %11s %11s %8s %8s" % ("ranks", "codec", "val loss", "vs none", "MB sent/rk",
                                                    "fewer B", "codec %", "tok/s"))
    base = {r["ranks"]: r for r in conv if r["codec"] == "none"}
    for r in sorted(conv, key=lambda r: (r["ranks"], r["codec"] != "none", r["codec"] != "hybrid", r["codec"])):
        b = base.get(r["ranks"])
        dv = 100 * (r["val_loss"] / b["val_loss"] - 1) if b else float("nan")
        fewer = 100 * (1 - r["sent_mb"] / b["sent_mb"]) if b and b["sent_mb"] > 0 else float("nan")
        print("%-6d %-12s %9.4f %+7.2f%% %11.1f %10.1f%% %7.1f%% %8.0f" % (
            r["ranks"], r["codec"], r["val_loss"], dv, r["sent_mb"], fewer, 100 * r["codec_share"],
            r["tokens_per_s"]))
    for ranks in sorted(base):
        h = next((r for r in conv if r["ranks"] == ranks and r["codec"] == "hybrid"), None)
        if h is None:
            continue
        b = base[ranks]
        print("\nloss curves, %d ranks (training loss: mean of each 25-step window; val loss at its steps)" % ranks)
        print("%6s %12s %12s %12s %12s" % ("step", "train none", "train hybrid", "val none", "val hybrid"))
        vn, vh = dict(map(tuple, b["val_curve"])), dict(map(tuple, h["val_curve"]))
        n = min(len(b["train_loss"]), len(h["train_loss"]))
        for end in range(25, n + 1, 25):
            tn = sum(b["train_loss"][end - 25:end]) / 25
            th = sum(h["train_loss"][end - 25:end]) / 25
            fmt = lambda d: ("%12.4f" % d[end]) if end in d else "%12s" % ""
            print("%6d %12.4f %12.4f %s %s" % (end, tn, th, fmt(vn), fmt(vh)))
        gap = 100 * (h["val_loss"] / b["val_loss"] - 1)
        fewer = 100 * (1 - h["sent_mb"] / b["sent_mb"])
        print("%s: %d ranks: hybrid val loss %.4f vs %.4f (%+.2f %%, target within 2 %%), %.1f %% fewer bytes "
              "(target >= 85 %%)" % ("PASS" if abs(gap) <= 2 and fewer >= 85 else "MISS", ranks, h["val_loss"],
                                     b["val_loss"], gap, fewer))


# ---------------------------------------------------------------------------------------------
# Network

def netns(prefix, *args, check=True):
    return netns_sh(NETNS, KEEL, prefix, "compression.py", *args, check=check)


def network_run(work, prefix, link, codec, rep, warmup, steps):
    run_dir = os.path.join(work, "net-%s-%s-%d" % (link, codec, rep))
    tokens = os.path.join(work, "tokens.bin")
    train = ["train", "--set", "model.preset=gpt2-124m", "--set", "model.vocab_size=50304",
             "--set", "model.max_seq_len=64", "--set", "data.train=" + tokens, "--set", "data.val=" + tokens,
             "--set", "data.tokenizer=", "--set", "train.batch_size=4", "--set", "train.seq_len=64",
             "--set", "train.steps=%d" % (warmup + steps), "--set", "train.eval_batches=1",
             "--set", "train.eval_every=0", "--set", "train.sample_tokens=0", "--set", "train.checkpoint_every=0",
             "--set", "train.log_every=1", "--set", "runtime.peak_gflops=100", "--set", "runtime.threads=1",
             "--set", "train.run_dir=" + run_dir, "--set", "sync.codec=" + codec,
             # A few timed steps: no uncompressed warm-up (convergence is the other part's business).
             "--set", "sync.warmup_steps=0"]
    log("  [network] %-8s %-6s rep %d ..." % (link, codec, rep))
    run_keel(train, run_dir + ".log", env_extra={"KEEL_NETNS_PREFIX": prefix, "KEEL_BINARY": KEEL}, prefix=["bash", NETNS, "run", "-n", "2", "--"])
    s, _ = read_metrics(run_dir)
    timed = [x for x in s if x["step"] > warmup]
    result = {
        "part": "network", "link": link, "codec": codec, "rep": rep,
        "tokens_per_s": mean([x["tokens_per_s"] for x in timed]),
        "ms_per_step": mean([x["ms"] for x in timed]),
        "sent_mb": mean([x["sync_sent_bytes"] for x in timed]) / 1e6,
        "exposed_ms": mean([x["sync_exposed_ms"] for x in timed]),
        "codec_ms": mean([x.get("sync_encode_ms", 0.0) + x.get("sync_decode_ms", 0.0) for x in timed]),
    }
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def report_network(results):
    net = [r for r in results if r["part"] == "network"]
    if not net:
        return
    info = next((r for r in results if r["part"] == "network-setup"), {})
    print("\n== Where it matters: GPT-2 124M, 2 ranks in 2 network namespaces, per-rank batch 4 x 64 ==")
    if info:
        print("shaped link: %s" % info.get("shaped", "?"))
    print("%-9s %-7s %9s %9s %11s %12s %10s" % ("link", "codec", "tok/s", "ms/step", "MB sent/rk",
                                               "exposed ms", "codec ms"))
    best = {}
    for r in net:
        k = (r["link"], r["codec"])
        if k not in best or r["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = r
    for link in ("shaped", "unshaped"):
        for codec in ("none", "hybrid"):
            r = best.get((link, codec))
            if r:
                print("%-9s %-7s %9.1f %9.0f %11.1f %12.0f %10.0f" % (link, codec, r["tokens_per_s"], r["ms_per_step"],
                                                                     r["sent_mb"], r["exposed_ms"], r["codec_ms"]))
    for link in ("shaped", "unshaped"):
        a, b = best.get((link, "none")), best.get((link, "hybrid"))
        if a and b:
            ratio = b["tokens_per_s"] / a["tokens_per_s"]
            verdict = ("PASS" if ratio >= 2 else "MISS") if link == "shaped" else "INFO"
            print("%s: %s link: hybrid %.1f tok/s vs uncompressed %.1f tok/s = %.2fx%s" % (
                verdict, link, b["tokens_per_s"], a["tokens_per_s"], ratio, " (target >= 2x)" if link == "shaped" else ""))


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["convergence", "network"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--codecs", default=DEFAULT_CODECS)
    ap.add_argument("--net-steps", type=int, default=4)
    ap.add_argument("--net-warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="0.2ms")
    ap.add_argument("--out")
    ap.add_argument("--report")
    a = ap.parse_args()
    if a.report:
        results = [json.loads(l) for l in open(a.report) if l.strip()]
        report_convergence(results)
        report_network(results)
        return
    for v, name in ((a.steps, "--steps"), (a.net_steps, "--net-steps"), (a.repeats, "--repeats")):
        if v < 1:
            sys.exit("compression.py: %s must be >= 1" % name)
    if not os.access(KEEL, os.X_OK):
        sys.exit("compression.py: %s not found; build it first (scripts/build.sh)" % KEEL)
    try:
        ranks = [int(x) for x in a.ranks.split(",") if x]
    except ValueError:
        sys.exit("compression.py: --ranks expects numbers like 2,4, found '%s'" % a.ranks)
    codecs = [c for c in a.codecs.split(",") if c]
    out = open(a.out, "w") if a.out else None
    results = []

    def keep(r):
        results.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    work = tempfile.mkdtemp(prefix="keel-compression.")
    try:
        if a.only in (None, "convergence"):
            if not os.path.exists(os.path.join(ROOT, "data/fortunes/train.bin")):
                sys.exit("compression.py: data/fortunes is missing; run scripts/quickstart.sh once to build it")
            for n in ranks:
                for codec in ("none", "hybrid"):
                    keep(convergence_run(work, n, codec, a.steps))
            for codec in codecs:
                keep(convergence_run(work, 2, codec, a.steps))
            report_convergence(results)
        if a.only in (None, "network"):
            if os.geteuid() != 0 or not shutil.which("tc"):
                sys.exit("compression.py: the network part needs root and iproute2 (tc)")
            write_tokens(os.path.join(work, "tokens.bin"))
            pid = os.getpid()
            shaped, plain = "kcs%d-" % pid, "kcu%d-" % pid
            try:
                p = netns(shaped, "up", "2", "--rate", a.rate, "--delay", a.delay, check=False)
                desc = "tbf %s each way, netem delay %s one way" % (a.rate, a.delay)
                if p.returncode != 0:
                    if "sch_netem" not in p.stderr:
                        sys.exit("compression.py: netns.sh up failed: " + p.stderr.strip())
                    log("  this kernel has no sch_netem: the shaped link gets no added delay")
                    netns(shaped, "up", "2", "--rate", a.rate)
                    desc = "tbf %s each way, no added delay (this kernel lacks sch_netem)" % a.rate
                netns(plain, "up", "2")
                keep({"part": "network-setup", "shaped": desc})
                for rep in range(1, a.repeats + 1):
                    for link, prefix in (("shaped", shaped), ("unshaped", plain)):
                        for codec in ("none", "hybrid"):
                            keep(network_run(work, prefix, link, codec, rep, a.net_warmup, a.net_steps))
            finally:
                netns(shaped, "down", check=False)
                netns(plain, "down", check=False)
            report_network(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
