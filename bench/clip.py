#!/usr/bin/env python3
"""Keel's dual-encoder (CLIP-style) training against the same model in PyTorch + torchvision,
side by side on this machine, in one invocation: image-caption pairs per second and zero-shot
recall@5 on the held-out pairs.

Dataset: `keel data images --from /usr/share/icons/Tango --out WORKDIR/tango --size 64` (Debian's
tango-icon-theme: 196 training and 19 held-out pairs of 64 x 64 pixels, with their tokenizer),
made once per work directory.

Configurations (--configs, default resnet18,vit,vit-flip), each trained for --steps steps (default 40),
batch 32, captions of up to 32 tokens, embedding 64, text tower GPT-2 L=2 H=2 C=64 V=512, AdamW
lr 1e-3 with 5 warm-up steps then cosine to 1e-4 (configs/clip.toml as shipped):
  resnet18   ResNet-18 with GroupNorm, stem width 16 (configs/clip.toml)
  vit        ViT: 8 x 8 patches of 8 px, 4 blocks, width 64, 4 heads
  vit-flip   the ViT with FLIP patch masking: half of each training image's patches dropped
Keel's multimodal switches on the ViT (vit's flags plus `--set clip.KEY=VALUE`), Keel runs only (no
PyTorch peer; --switches selects them all):
  vit-balance  clip.grad_balance=norm (cross-modal gradient normalisation)
  vit-text2    clip.text_update_every=2 (the text tower trains on every second step, steps 1, 3,
               5, ... of the step lines, and runs forward only on the others)
  vit-image2   clip.image_update_every=2 (the image tower likewise)
  vit-bf16     clip.visual_quant=bf16 (the image tower's matrix products in bf16)
  vit-int8     clip.visual_quant=int8 (its forward products in dynamic int8, backward in bf16)
  vit-all      grad_balance=norm, text_update_every=2, vit_mask=0.5 and visual_quant=int8 together
A switch selected without vit brings vit along (the switches are compared with it).

Trainers, 2 threads each (OMP_NUM_THREADS=2; Keel's runtime.threads=2, torch.set_num_threads(2)):
  keel     build/keel train --config configs/clip.toml --set ... (pairs/s: the median of the
           step lines' samples_per_s after the first 3 steps; with a tower update cadence k > 1,
           the median over consecutive windows of k of those steps, each window's pairs over its
           summed step times, so that every window holds one training step of that tower;
           recall: the last evaluation line), in two variants: "passive" (keel's own default,
           OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep between parallel regions, the better
           choice on shared cores) and "spin" (OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000:
           threads spin that long first, as libgomp's default does for PyTorch's default
           environment; better on cores of its own); --no-variants runs "passive" only
  debian   bench/torch_clip_train.py under /usr/bin/python3 with Debian's python3-torch and
           python3-torchvision (the model code is tests/reference/clip_reference.py's, float32;
           pairs/s: the median over the same steps, timed the same way; recall over the same 19
           held-out pairs)
  pypi     (--pypi) the same script under the current PyTorch from PyPI, installed with plain
           `pip install torch torchvision numpy` into WORKDIR/venv (reused when it already
           imports torch); skipped, saying why, when the install fails or runs past
           --pip-timeout. OpenCLIP (`pip install open_clip_torch`) is tried in that venv too and,
           where it imports, adds a run with its ClipLoss as the loss.
Each PyTorch trainer is run in the variants that may make it faster and the best is compared:
the default environment and compare_pytorch.sh's tuned one (OMP_WAIT_POLICY=PASSIVE,
OPENBLAS_NUM_THREADS=2, glibc malloc tunables); for the ResNet, contiguous (NCHW) and
channels_last tensors; torch.compile where the PyTorch has it (not Debian's 1.13). Runs are
interleaved (per configuration in --configs order: keel, then every peer variant, none for a
switch) and repeated --repeats times; each trainer's best run counts (PyTorch's best is of more
runs than Keel's, which favours it; the table says so).

Output: a table of the configurations with a PyTorch peer (configuration | Keel pairs/s | PyTorch
pairs/s | Keel/PyTorch | ... | R@5 | the 2.7x claim); when a switch ran, a second table, "Keel's
multimodal switches", with a row for each of plain vit, vit-flip, every switch and vit-all that ran
(Keel pairs/s | ratio to Keel's plain vit | ratio to the fastest Debian (and PyPI) PyTorch run of
the plain vit | the last step's training loss | R@5 i2t/t2i | the 2.7x claim against the fastest
of those PyTorch runs), its rows also under "switches" in clip_bench.json; every run's figures
(with the cores other processes kept busy meanwhile), the exact commands, and
WORKDIR/clip_bench.json. Keel's design claims 2.7x over "the conventional method"
for image-text training; here that method is PyTorch + torchvision training the same model, and
the ratio is measured, not assumed ("met" needs 2.7x against the fastest PyTorch run). Exit
status 0 whatever the ratios; non-zero only when a Keel or Debian PyTorch run fails.

Usage: bench/clip.py [--steps N] [--workdir DIR] [--configs resnet18,vit,vit-flip] [--switches]
                     [--repeats R] [--pypi] [--pip-timeout S] [--no-variants] [--quiet-wait S]
                     [--source DIR] [--keel-only]
  --steps N        optimizer steps of every run (default 40; the median skips the first 3)
  --workdir DIR    dataset, run directories, logs, venv and clip_bench.json (default: a new
                   temporary directory, kept and printed)
  --configs LIST   any of resnet18, vit, vit-flip, vit-balance, vit-text2, vit-image2, vit-bf16,
                   vit-int8, vit-all (default resnet18,vit,vit-flip)
  --switches       add vit, vit-flip and all six switch configurations to --configs (after it)
  --repeats R      interleaved runs of every trainer and variant (default 2)
  --pypi           also the current PyTorch from PyPI (and OpenCLIP's loss where it installs)
  --pip-timeout S  seconds allowed for each pip install (default 1500)
  --no-variants    PyTorch in its default environment and layout only
  --quiet-wait S   before each run, wait up to S seconds for other processes to leave the cores
                   idle (default 0: do not wait); every run reports the cores others kept busy
  --source DIR     the pictures `keel data images` reads (default /usr/share/icons/Tango); e.g.
                   /usr/share/icons: every installed theme (Tango, oxygen, Adwaita, hicolor), 2,176
                   training and 255 held-out pairs here, enough for recall to rise above chance
  --keel-only      Keel's runs only (no PyTorch): one table of pairs/s, final loss and recall@1/@5
                   per configuration (for quality: e.g. --source /usr/share/icons --steps 300)
Environment: KEEL (default build/keel), PYTHON (default /usr/bin/python3), RUN_TIMEOUT (seconds
per run, default 1800).
"""
import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
from benchutil import print_table, run_logged, run_or_exit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEL = os.environ.get("KEEL", os.path.join(ROOT, "build", "keel"))
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
PEER = os.path.join(ROOT, "bench", "torch_clip_train.py")
RUN_TIMEOUT = int(os.environ.get("RUN_TIMEOUT", "1800"))
TANGO = "/usr/share/icons/Tango"
CLAIM = 2.7
SKIP = 3  # steps left out of the medians: the first pays for allocation and warm-up
THREADS = 2

VIT = ["--set", "clip.image_tower=vit", "--set", "clip.vit_patch=8", "--set", "clip.vit_layers=4",
       "--set", "clip.vit_width=64", "--set", "clip.vit_heads=4"]
VIT_PEER = ["--tower", "vit", "--vit-patch", "8", "--vit-layers", "4", "--vit-width", "64", "--vit-heads", "4"]
CONFIGS = {
    "resnet18": {"label": "ResNet-18 (GN, width 16)", "keel": [], "peer": ["--tower", "resnet18", "--width", "16"],
                 "resnet": True},
    "vit": {"label": "ViT p8 L4 C64 H4", "keel": VIT, "peer": VIT_PEER, "resnet": False},
    "vit-flip": {"label": "ViT + FLIP mask 0.5", "keel": VIT + ["--set", "clip.vit_mask=0.5"],
                 "peer": VIT_PEER + ["--vit-mask", "0.5"], "resnet": False},
}
# Keel's multimodal switches on top of the plain ViT: Keel runs only ("peer": None), compared in the
# second table with Keel's plain ViT and the PyTorch runs of the plain ViT. "cadence": the larger
# tower update cadence (pairs/s is taken over windows of that many steps).
SWITCHES = [
    ("vit-balance", "ViT + grad_balance=norm", ["clip.grad_balance=norm"], 1),
    ("vit-text2", "ViT + text_update_every=2", ["clip.text_update_every=2"], 2),
    ("vit-image2", "ViT + image_update_every=2", ["clip.image_update_every=2"], 2),
    ("vit-bf16", "ViT + visual_quant=bf16", ["clip.visual_quant=bf16"], 1),
    ("vit-int8", "ViT + visual_quant=int8", ["clip.visual_quant=int8"], 1),
    ("vit-all", "ViT + all (norm, text/2, mask 0.5, int8)",
     ["clip.grad_balance=norm", "clip.text_update_every=2", "clip.vit_mask=0.5", "clip.visual_quant=int8"], 2),
]
for _name, _label, _sets, _cadence in SWITCHES:
    CONFIGS[_name] = {"label": _label, "keel": VIT + [x for kv in _sets for x in ("--set", kv)], "peer": None,
                      "resnet": False, "switch": True, "cadence": _cadence}
SWITCH_BASELINES = ["vit", "vit-flip"]  # the second table's first rows; --switches adds them
# The shape and optimizer of configs/clip.toml, as the peer's flags.
PEER_COMMON = ["--embed-dim", "64", "--text-layers", "2", "--text-heads", "2", "--text-width", "64",
               "--vocab", "512", "--batch", "32", "--seq", "32", "--lr", "1e-3", "--warmup", "5",
               "--min-lr-ratio", "0.1", "--weight-decay", "0.1", "--beta1", "0.9", "--beta2", "0.95",
               "--eps", "1e-8", "--clip", "1.0", "--skip", str(SKIP), "--threads", str(THREADS)]
TUNED_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": str(THREADS),
             "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def env_prefix(extra):
    return " ".join("%s=%s" % (k, shlex.quote(v)) for k, v in sorted(extra.items()))


def command_line(cmd, extra):
    return (env_prefix(extra) + " " if extra else "") + " ".join(shlex.quote(c) for c in cmd)


def machine_busy_s():
    """CPU seconds this machine's cores have been busy since boot (/proc/stat; 0 where unreadable)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Interference:
    """Cores kept busy by other processes while a run went on: the machine's busy CPU time over
    the run less the run's own (this bench's children), divided by the run's wall time."""

    def __init__(self):
        self.t, self.busy, self.mine = time.time(), machine_busy_s(), children_cpu_s()

    def cores(self):
        wall = max(time.time() - self.t, 1e-9)
        return max(0.0, (machine_busy_s() - self.busy) - (children_cpu_s() - self.mine)) / wall


def wait_quiet(max_s, threshold=0.25):
    """Waits (up to max_s seconds) until other processes keep fewer than `threshold` cores busy over
    a one-second probe; returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < max_s:
        busy, t = machine_busy_s(), time.time()
        time.sleep(1.0)
        if (machine_busy_s() - busy) / (time.time() - t) < threshold:
            break
    return time.time() - t0


# ---------------------------------------------------------------------------------------------
# Keel


def keel_command(cfg, dataset, run_dir, steps):
    return [KEEL, "train", "--config", os.path.join(ROOT, "configs", "clip.toml"),
            "--set", "clip.dataset=" + dataset, "--set", "data.tokenizer=" + os.path.join(dataset, "tokenizer.json"),
            "--set", "train.run_dir=" + run_dir, "--set", "train.steps=%d" % steps, "--set", "train.eval_every=0",
            "--set", "runtime.threads=%d" % THREADS] + CONFIGS[cfg]["keel"]


# Keel's OpenMP waiting: `keel` sets OMP_WAIT_POLICY=PASSIVE itself unless the environment names a
# policy (threads sleep between parallel regions: the better choice when other processes share the
# cores); "spin" is what PyTorch's default environment gets from libgomp (threads spin for
# GOMP_SPINCOUNT=300000 iterations before sleeping), better on cores of its own.
KEEL_VARIANTS = [("passive", {}), ("spin", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"})]


def run_keel(cfg, dataset, work, steps, rep, variant="passive", env=None):
    run_dir = os.path.join(work, "keel-%s-%s-%d" % (cfg, variant, rep))
    shutil.rmtree(run_dir, ignore_errors=True)  # a run directory with a checkpoint would be resumed
    cmd = keel_command(cfg, dataset, run_dir, steps)
    extra = dict({"OMP_NUM_THREADS": str(THREADS)}, **(env or {}))
    t0, other = time.time(), Interference()
    run_logged(cmd, run_dir + ".log", ROOT, RUN_TIMEOUT, "clip.py: keel %s" % cfg, extra)
    wall, other_cores = time.time() - t0, other.cores()
    steps_, evals, params = [], [], None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            j = json.loads(line)
            if j.get("event") == "run":
                params = j.get("model", {}).get("parameters")
            elif "samples_per_s" in j:
                steps_.append(j)
            elif "recall_i2t_at5" in j:
                evals.append(j)
    if not steps_ or not evals:
        sys.exit("clip.py: keel %s: metrics.jsonl in %s has no step or no evaluation lines" % (cfg, run_dir))
    timed = [s["samples_per_s"] for s in steps_ if s["step"] > SKIP] or [s["samples_per_s"] for s in steps_]
    # A tower trained every k-th step makes the step times alternate: the median is over windows of
    # k consecutive steps (each holds one training step of that tower), a window's pairs/s being its
    # pairs over its summed step times; k = 1 is the plain median of the steps.
    k = CONFIGS[cfg].get("cadence", 1)
    windows = [timed[i:i + k] for i in range(0, len(timed) - k + 1, k)] or [timed]
    med = statistics.median(len(w) * 32 / sum(32 / v for v in w) for w in windows)
    last = evals[-1]
    return {"trainer": "keel", "variant": variant, "config": cfg, "rep": rep, "samples_per_s": med,
            "ms_per_step": 1e3 * 32 / med, "samples_per_s_all": [round(s["samples_per_s"], 1) for s in steps_],
            "final_loss": steps_[-1]["loss"], "params": params,
            "recall_i2t_at1": last["recall_i2t_at1"], "recall_i2t_at5": last["recall_i2t_at5"],
            "recall_t2i_at1": last["recall_t2i_at1"], "recall_t2i_at5": last["recall_t2i_at5"],
            "val_pairs": last.get("val_pairs"), "wall_s": wall, "other_cores": other_cores, "command": command_line(cmd, extra),
            "peak_rss_mb": steps_[-1].get("peak_rss_mb")}


# ---------------------------------------------------------------------------------------------
# PyTorch peers


def peer_variants(cfg, trainer, has_compile, openclip, variants):
    """(name, extra flags, extra environment) of every variant of a PyTorch trainer for cfg."""
    base = [("eager", [], {})]
    if variants and CONFIGS[cfg]["resnet"]:
        base.append(("channels_last", ["--channels-last"], {}))
    out = []
    for name, flags, env in base:
        out.append((name, flags, env))
        if variants:
            out.append((name + "+tuned-env", flags, dict(TUNED_ENV)))
    if has_compile:
        # torch.compile with the first layout; the default environment.
        out.append(("compile", ["--compile"], {}))
    if openclip:
        out.append(("openclip-loss", ["--loss", "openclip"], {}))
    return out


def run_peer(python, trainer, cfg, variant, flags, env, dataset, work, steps, rep, must):
    cmd = [python, PEER, "--dataset", dataset, "--steps", str(steps)] + PEER_COMMON + CONFIGS[cfg]["peer"] + flags
    extra = {"OMP_NUM_THREADS": str(THREADS)}
    extra.update(env)
    log_path = os.path.join(work, "%s-%s-%s-%d.log" % (trainer, cfg, variant, rep))
    t0, other = time.time(), Interference()
    # (An optional trainer's failure is reported, not fatal.)
    rc = run_logged(cmd, log_path, ROOT, RUN_TIMEOUT, "clip.py: %s %s %s" % (trainer, cfg, variant), extra, fatal=must)
    if rc != 0:
        tail = open(log_path).read().strip().splitlines()[-1:] or ["(no output)"]
        log("    %s %s %s failed (%s): %s" % (trainer, cfg, variant, rc, tail[0][:200]))
        return None
    wall, other_cores = time.time() - t0, other.cores()
    lines = [l for l in open(log_path).read().splitlines() if l.startswith("{")]
    if not lines:
        if must:
            sys.exit("clip.py: %s %s %s printed no JSON result; see %s" % (trainer, cfg, variant, log_path))
        return None
    r = json.loads(lines[-1])
    r.update({"trainer": trainer, "variant": variant, "config": cfg, "rep": rep, "wall_s": wall,
              "other_cores": other_cores,
              "command": command_line(cmd, extra)})
    return r


# ---------------------------------------------------------------------------------------------
# PyPI's PyTorch in a virtual environment


def venv_probe(py):
    """(torch version, has torch.compile, OpenCLIP version or None), or None when torch does not import."""
    code = ("import json, torch, torchvision, numpy\n"
            "try:\n import open_clip; oc = getattr(open_clip, '__version__', '?')\nexcept Exception:\n oc = None\n"
            "print(json.dumps([torch.__version__, hasattr(torch, 'compile'), oc]))")
    try:
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def pip(py, packages, timeout, log_path):
    cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"] + packages
    log("  %s (at most %d s; log %s)" % (" ".join(cmd), timeout, log_path))
    t0 = time.time()
    with open(log_path, "w") as out:
        try:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout after %d s" % timeout
    secs = time.time() - t0
    if rc != 0:
        tail = open(log_path).read().strip().splitlines()[-1:] or [""]
        return False, secs, "pip install %s: %s %s" % (" ".join(packages), rc, tail[0][:200])
    return True, secs, ""


def setup_pypi(work, timeout):
    """Returns (python, info dict); python None when PyPI's PyTorch is not usable (info says why)."""
    venv = os.path.join(work, "venv")
    py = os.path.join(venv, "bin", "python")
    info = {"venv": venv, "install_s": 0.0, "openclip_install_s": 0.0}
    if not os.path.exists(py):
        log("pypi: creating %s" % venv)
        r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
        if r.returncode != 0:
            info["skipped"] = "python3 -m venv failed: " + (r.stderr.strip().splitlines() or [""])[-1]
            return None, info
    probe = venv_probe(py)
    if probe is None:
        ok, secs, why = pip(py, ["torch", "torchvision", "numpy"], timeout, os.path.join(work, "pip-torch.log"))
        info["install_s"] = secs
        if not ok:
            info["skipped"] = why
            return None, info
        probe = venv_probe(py)
        if probe is None:
            info["skipped"] = "torch installed but does not import in " + venv
            return None, info
    else:
        log("pypi: %s already has torch %s" % (venv, probe[0]))
    if probe[2] is None:
        ok, secs, why = pip(py, ["open_clip_torch"], min(timeout, 900), os.path.join(work, "pip-openclip.log"))
        info["openclip_install_s"] = secs
        if ok:
            probe = venv_probe(py) or probe
        if probe[2] is None:
            info["openclip"] = "not usable: " + (why or "installed but does not import")
    info.update({"torch": probe[0], "has_compile": bool(probe[1]), "openclip_version": probe[2]})
    return py, info


# ---------------------------------------------------------------------------------------------
# Report


def best(runs, **match):
    rs = [r for r in runs if all(r.get(k) == v for k, v in match.items())]
    return max(rs, key=lambda r: r["samples_per_s"]) if rs else None


def fmt_ratio(k, p):
    return "%.2fx" % (k / p) if k and p else "-"


def report(res):
    runs = res["runs"]
    cfgs = [c for c in res["configs"] if CONFIGS[c]["peer"] is not None]  # the switches have no peer
    trainers = ["debian"] + (["pypi"] if any(r["trainer"] == "pypi" for r in runs) else [])
    tname = {"debian": "PyTorch %s (Debian)" % res["debian"].get("torch", "?"),
             "pypi": "PyTorch %s (PyPI)" % res.get("pypi", {}).get("torch", "?")}
    print()
    print("=== Keel vs PyTorch + torchvision: dual-encoder training, %d steps, batch 32, %d threads each, "
          "pairs/s = median after step %d, best of %d ===" % (res["steps"], THREADS, SKIP, res["repeats"]))
    head = ["configuration", "Keel pairs/s"]
    for t in trainers:
        head += [tname[t] + " pairs/s", "Keel/PyTorch"]
    short = {"debian": "Debian", "pypi": "PyPI"}
    head += ["Keel R@5 i2t/t2i"] + ["%s R@5 i2t/t2i" % short[t] for t in trainers] + ["Keel's claim %.1fx" % CLAIM]
    rows = []
    summary = {}
    for cfg in cfgs:
        k = best(runs, trainer="keel", config=cfg)
        row = [CONFIGS[cfg]["label"], "%.1f [%s]" % (k["samples_per_s"], k["variant"])]
        summary[cfg] = {"keel": k["samples_per_s"], "keel_recall_at5": [k["recall_i2t_at5"], k["recall_t2i_at5"]]}
        ratios, recalls = [], []
        for t in trainers:
            p = best(runs, trainer=t, config=cfg)
            if p is None:
                row += ["(failed)", "-"]
                recalls.append("-")
                continue
            row += ["%.1f [%s]" % (p["samples_per_s"], p["variant"]), fmt_ratio(k["samples_per_s"], p["samples_per_s"])]
            ratios.append(k["samples_per_s"] / p["samples_per_s"])
            recalls.append("%.2f/%.2f" % (p["recall_i2t_at5"], p["recall_t2i_at5"]))
            summary[cfg][t] = {"samples_per_s": p["samples_per_s"], "variant": p["variant"],
                               "ratio": k["samples_per_s"] / p["samples_per_s"],
                               "recall_at5": [p["recall_i2t_at5"], p["recall_t2i_at5"]]}
        row.append("%.2f/%.2f" % (k["recall_i2t_at5"], k["recall_t2i_at5"]))
        row += recalls
        if ratios:
            lo = min(ratios)
            row.append("%s (%.2fx vs the fastest PyTorch)" % ("met" if lo >= CLAIM else "not met", lo))
            summary[cfg]["claim_met"] = lo >= CLAIM
        else:
            row.append("-")
        rows.append(row)
    print_table(head, rows)
    print("Recall@5 is over %s held-out pairs (chance = 5/%s), from the run counted; [variant] is the PyTorch run "
          "counted." % (runs[0].get("val_pairs", "?"), runs[0].get("val_pairs", "?")))
    for t in trainers:
        tried = sorted({r["variant"] for r in runs if r["trainer"] == t})
        most = max(sum(1 for r in runs if r["trainer"] == t and r["config"] == c) for c in cfgs)
        keel_most = max(sum(1 for r in runs if r["trainer"] == "keel" and r["config"] == c) for c in cfgs)
        print("%s: the best of up to %d runs per configuration (variants %s) against Keel's best of %d (variants %s); "
              "the maximum of more noisy runs favours the side with more, so every run is listed below." % (
                  tname[t], most, ", ".join(tried), keel_most,
                  ", ".join(sorted({r["variant"] for r in runs if r["trainer"] == "keel"}))))
    res["summary"] = summary
    if any(CONFIGS[c].get("switch") for c in res["configs"]):
        report_switches(res, trainers, tname, short)

    print()
    print("=== Every run ===")
    print("%-11s %-7s %-24s %3s %8s %8s %7s %11s %11s %8s %6s %7s" % (
        "config", "trainer", "variant", "rep", "pairs/s", "ms/step", "loss", "R@1 i2t/t2i", "R@5 i2t/t2i", "params",
        "wall s", "others"))
    for r in runs:
        print("%-11s %-7s %-24s %3d %8.1f %8.1f %7.4f %11s %11s %8s %6.1f %7.2f" % (
            r["config"], r["trainer"], r["variant"], r["rep"], r["samples_per_s"], 1e3 * 32 / r["samples_per_s"],
            r["final_loss"], "%.2f/%.2f" % (r["recall_i2t_at1"], r["recall_t2i_at1"]),
            "%.2f/%.2f" % (r["recall_i2t_at5"], r["recall_t2i_at5"]), r.get("params"), r["wall_s"],
            r.get("other_cores", 0.0)))
    print("(loss: the last step's training loss; others: cores other processes kept busy during the run)")
    counted = [best(runs, trainer=t, config=c) for c in cfgs for t in ["keel"] + trainers]
    counted += [best(runs, trainer="keel", config=c) for c in res["configs"] if c not in cfgs]
    disturbed = [r for r in counted if r is not None and r.get("other_cores", 0.0) > 0.25]
    if disturbed:
        print("WARNING: other processes kept cores busy during runs the table counts (%s): their pairs/s are "
              "disturbed; run again on a quiet machine (or with more --repeats)." % ", ".join(
                  "%s %s %s rep %d: %.2f cores" % (r["config"], r["trainer"], r["variant"], r["rep"], r["other_cores"])
                  for r in disturbed))
    for r in runs:
        if r.get("compile_error"):
            print("  %s %s %s: torch.compile not used: %s" % (r["config"], r["trainer"], r["variant"],
                                                            r["compile_error"]))
    print()
    print("PyTorch peers: %s" % "; ".join(
        "%s torch %s, torchvision %s, torch.compile %s" % (
            t, res[t].get("torch", "?"), res[t].get("torchvision", "?"),
            "available" if res[t].get("has_compile") else "not available")
        for t in trainers))
    if res.get("pypi", {}).get("skipped"):
        print("PyPI PyTorch skipped: %s" % res["pypi"]["skipped"])
    if res.get("pypi", {}).get("openclip"):
        print("OpenCLIP: %s" % res["pypi"]["openclip"])
    print("Captions: Keel's byte-level BPE ported to Python (bench/torch_clip_train.py); both trainers read the same "
          "tokenizer.json and the same token ids (checked: %s)." % res.get("tokenizer_check", "not checked"))
    print("Not identical: the random draws (initial weights, batch order, FLIP's kept patches) come from each "
          "trainer's own generator; same distributions, other numbers.")
    print()
    print("=== Commands ===")
    print(res["dataset_command"])
    seen = set()
    for r in runs:
        key = (r["trainer"], r["config"], r["variant"])
        if key not in seen:
            seen.add(key)
            print(r["command"])


def report_switches(res, trainers, tname, short):
    """The second table: Keel's plain ViT, the ViT with FLIP, every switch and all together, against
    Keel's plain ViT and the fastest PyTorch run of the plain ViT; its rows go to res["switches"]."""
    runs = res["runs"]
    base = best(runs, trainer="keel", config="vit")
    peers = {t: best(runs, trainer=t, config="vit") for t in trainers}
    print()
    print("=== Keel's multimodal switches (%s): %d steps, batch 32, %d threads, pairs/s = median after step %d, "
          "best of %d ===" % (CONFIGS["vit"]["label"], res["steps"], THREADS, SKIP, res["repeats"]))
    head = ["configuration", "Keel pairs/s", "vs Keel ViT"] + ["vs %s ViT" % short[t] for t in trainers] + [
        "final loss", "R@5 i2t/t2i", "Keel's claim %.1fx" % CLAIM]
    rows, out = [], []
    order = [c for c in SWITCH_BASELINES + [s[0] for s in SWITCHES] if c in res["configs"]]
    for cfg in order:
        k = best(runs, trainer="keel", config=cfg)
        label = "plain ViT" if cfg == "vit" else CONFIGS[cfg]["label"]
        row = [label, "%.1f" % k["samples_per_s"], fmt_ratio(k["samples_per_s"], base["samples_per_s"])]
        entry = {"config": cfg, "label": label, "keel": k["samples_per_s"],
                 "vs_keel_vit": k["samples_per_s"] / base["samples_per_s"], "final_loss": k["final_loss"],
                 "keel_recall_at5": [k["recall_i2t_at5"], k["recall_t2i_at5"]], "rep": k["rep"]}
        ratios = []
        for t in trainers:
            p = peers[t]
            row.append(fmt_ratio(k["samples_per_s"], p["samples_per_s"]) if p else "-")
            if p:
                ratios.append(k["samples_per_s"] / p["samples_per_s"])
                entry["vs_%s_vit" % t] = k["samples_per_s"] / p["samples_per_s"]
        row += ["%.4f" % k["final_loss"], "%.2f/%.2f" % (k["recall_i2t_at5"], k["recall_t2i_at5"])]
        if ratios:
            lo = min(ratios)
            row.append("%s (%.2fx vs the fastest PyTorch ViT)" % ("met" if lo >= CLAIM else "not met", lo))
            entry["claim_met"] = lo >= CLAIM
        else:
            row.append("-")
        rows.append(row)
        out.append(entry)
    print_table(head, rows)
    print("Every row is a Keel run (the best of %d); the ratios are against Keel's plain ViT (%.1f pairs/s) and "
          "the PyTorch runs of the plain ViT counted in the table above: %s.%s Final loss: the last step's training "
          "loss; R@5 over the same held-out pairs." % (
              res["repeats"], base["samples_per_s"], "; ".join(
                  "%s %s" % (tname[t], "%.1f [%s]" % (peers[t]["samples_per_s"], peers[t]["variant"]) if peers[t]
                             else "(failed)") for t in trainers),
              " Tower cadences (%s): pairs/s is the median over windows of k consecutive steps, one training step of "
              "the tower in each." % ", ".join(c for c in order if CONFIGS[c].get("cadence", 1) > 1)
              if any(CONFIGS[c].get("cadence", 1) > 1 for c in order) else ""))
    res["switches"] = out


def check_tokenizer(python, dataset):
    """The peer's tokenizer port against Keel's split of the dataset: every caption round-trips,
    and no caption is longer than 32 tokens with its end token (Keel refuses those at start-up)."""
    code = ("import sys; sys.dont_write_bytecode = True; sys.path.insert(0, %r)\n"
            "import torch_clip_train as t\n"
            "tok = t.KeelBPE(%r)\n"
            "n = 0\n"
            "for split in ('train', 'val'):\n"
            "    _, caps = t.read_split(%r, split)\n"
            "    for c in caps:\n"
            "        ids = tok.encode(c)\n"
            "        assert tok.decode(ids) == c and len(ids) + 1 <= 32 and max(ids) < tok.eot, c\n"
            "        n += 1\n"
            "print(n)\n") % (os.path.join(ROOT, "bench"), os.path.join(dataset, "tokenizer.json"), dataset)
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return "FAILED: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return "%s captions round-trip through the port" % r.stdout.strip()


def keel_only(a, cfgs, work, dataset, ds_cmd, t_start):
    """--keel-only: Keel's runs alone (no PyTorch), and a table of speed and retrieval quality."""
    res = {"steps": a.steps, "repeats": a.repeats, "configs": cfgs, "workdir": work, "threads": THREADS,
           "dataset": dataset, "dataset_command": command_line(ds_cmd, {}), "runs": []}
    with open(os.path.join(dataset, "meta.json")) as f:
        meta = json.load(f)
    for rep in range(1, a.repeats + 1):
        for cfg in cfgs:
            log("[%s, run %d/%d]" % (cfg, rep, a.repeats))
            waited = wait_quiet(a.quiet_wait)
            r = run_keel(cfg, dataset, work, a.steps, rep)
            r["waited_s"] = waited
            res["runs"].append(r)
            log("  keel     %-26s %8.1f pairs/s  R@5 %.3f/%.3f  (%.0f s; others %.2f cores)" % (
                "", r["samples_per_s"], r["recall_i2t_at5"], r["recall_t2i_at5"], r["wall_s"], r["other_cores"]))
    res["wall_s"] = time.time() - t_start
    print()
    print("=== Keel alone: %d steps, batch 32, %d threads, %s (%s train / %s held-out pairs); pairs/s = median "
          "after step %d, best of %d; recall from that run's last evaluation ===" % (
              a.steps, THREADS, os.path.basename(dataset), meta.get("train", "?"), meta.get("val", "?"), SKIP,
              a.repeats))
    head = ["configuration", "pairs/s", "vs plain", "final loss", "R@1 i2t/t2i", "R@5 i2t/t2i"]
    rows = []
    base = best(res["runs"], trainer="keel", config="vit") if "vit" in cfgs else None
    for cfg in cfgs:
        k = best(res["runs"], trainer="keel", config=cfg)
        rows.append([CONFIGS[cfg]["label"], "%.1f" % k["samples_per_s"],
                     "%.2fx" % (k["samples_per_s"] / base["samples_per_s"]) if base else "-",
                     "%.4f" % k["final_loss"], "%.3f/%.3f" % (k["recall_i2t_at1"], k["recall_t2i_at1"]),
                     "%.3f/%.3f" % (k["recall_i2t_at5"], k["recall_t2i_at5"])])
    print_table(head, rows)
    out = os.path.join(work, "clip_bench.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print()
    print("results: %s (%.0f s in all)" % (out, res["wall_s"]))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--configs", default="resnet18,vit,vit-flip")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pypi", action="store_true")
    ap.add_argument("--pip-timeout", type=int, default=1500)
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--quiet-wait", type=float, default=0.0)
    ap.add_argument("--switches", action="store_true")
    ap.add_argument("--source", default=TANGO)
    ap.add_argument("--keel-only", action="store_true")
    a = ap.parse_args()
    cfgs = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in cfgs if c not in CONFIGS]
    if unknown or not cfgs:
        sys.exit("clip.py: --configs takes any of %s; found %s" % (", ".join(CONFIGS), ", ".join(unknown) or "none"))
    cfgs = list(dict.fromkeys(cfgs))
    if a.switches:
        cfgs += [c for c in SWITCH_BASELINES + [s[0] for s in SWITCHES] if c not in cfgs]
    elif any(CONFIGS[c].get("switch") for c in cfgs) and "vit" not in cfgs:
        cfgs.append("vit")  # the switches' baseline
        log("clip.py: added vit to --configs (the switches are compared with it)")
    if a.steps <= SKIP or a.repeats < 1:
        sys.exit("clip.py: --steps must be above %d and --repeats at least 1" % SKIP)
    if not os.access(KEEL, os.X_OK):
        sys.exit("clip.py: %s not found; build it: make -C build keel" % KEEL)
    if not os.path.isdir(a.source):
        sys.exit("clip.py: --source %s not found; install Debian's tango-icon-theme and oxygen-icon-theme "
                 "(scripts/setup.sh does)" % a.source)
    work = os.path.abspath(a.workdir) if a.workdir else tempfile.mkdtemp(prefix="keel-clip-bench.")
    os.makedirs(work, exist_ok=True)
    log("clip.py: work directory %s" % work)
    t_start = time.time()

    source = os.path.abspath(a.source)
    dataset = os.path.join(work, "tango" if source == TANGO else "ds-" + source.strip("/").replace("/", "-"))
    ds_cmd = [KEEL, "data", "images", "--from", source, "--out", dataset, "--size", "64"]
    if not os.path.exists(os.path.join(dataset, "meta.json")):
        shutil.rmtree(dataset, ignore_errors=True)
        log("dataset: " + run_or_exit(ds_cmd, dict(os.environ)).strip().splitlines()[-1])
    else:
        log("dataset: %s exists" % dataset)

    if a.keel_only:
        return keel_only(a, cfgs, work, dataset, ds_cmd, t_start)
    probe = venv_probe(PYTHON)
    if probe is None:
        sys.exit("clip.py: %s cannot import torch, torchvision and numpy (apt-get install python3-torch "
                 "python3-torchvision)" % PYTHON)
    tv = subprocess.run([PYTHON, "-c", "import torchvision; print(torchvision.__version__)"],
                        capture_output=True, text=True).stdout.strip()
    res = {"steps": a.steps, "repeats": a.repeats, "quiet_wait": a.quiet_wait, "configs": cfgs, "workdir": work, "threads": THREADS,
           "claim": CLAIM, "dataset": dataset, "dataset_command": command_line(ds_cmd, {}),
           "debian": {"python": PYTHON, "torch": probe[0], "torchvision": tv, "has_compile": bool(probe[1])},
           "runs": []}
    res["tokenizer_check"] = check_tokenizer(PYTHON, dataset)
    log("tokenizer: " + res["tokenizer_check"])

    trainers = [("debian", PYTHON, bool(probe[1]), False, True)]
    if a.pypi:
        py, info = setup_pypi(work, a.pip_timeout)
        res["pypi"] = info
        if py is None:
            log("pypi: skipped: %s" % info["skipped"])
        else:
            info["torchvision"] = subprocess.run([py, "-c", "import torchvision; print(torchvision.__version__)"],
                                                 capture_output=True, text=True).stdout.strip()
            log("pypi: torch %s, torch.compile %s, OpenCLIP %s" % (
                info["torch"], "yes" if info["has_compile"] else "no", info.get("openclip_version") or "no"))
            trainers.append(("pypi", py, info["has_compile"], bool(info.get("openclip_version")), False))

    for rep in range(1, a.repeats + 1):
        for cfg in cfgs:
            log("[%s, run %d/%d]" % (cfg, rep, a.repeats))
            for variant, env in KEEL_VARIANTS[:1 if a.no_variants else None]:
                waited = wait_quiet(a.quiet_wait)
                r = run_keel(cfg, dataset, work, a.steps, rep, variant, env)
                r["waited_s"] = waited
                res["runs"].append(r)
                log("  keel     %-26s %8.1f pairs/s  R@5 %.2f/%.2f  (%.0f s; others %.2f cores)" % (
                    variant, r["samples_per_s"], r["recall_i2t_at5"], r["recall_t2i_at5"], r["wall_s"], r["other_cores"]))
            for trainer, py, has_compile, openclip, must in trainers:
                if CONFIGS[cfg]["peer"] is None:
                    break  # a Keel switch: no PyTorch peer
                for variant, flags, env in peer_variants(cfg, trainer, has_compile, openclip, not a.no_variants):
                    waited = wait_quiet(a.quiet_wait)
                    p = run_peer(py, trainer, cfg, variant, flags, env, dataset, work, a.steps, rep, must)
                    if p is None:
                        continue
                    p["waited_s"] = waited
                    res["runs"].append(p)
                    log("  %-8s %-26s %8.1f pairs/s  R@5 %.2f/%.2f  (%.0f s; others %.2f cores)" % (
                        trainer, variant, p["samples_per_s"], p["recall_i2t_at5"], p["recall_t2i_at5"], p["wall_s"],
                        p["other_cores"]))

    res["wall_s"] = time.time() - t_start
    report(res)
    out = os.path.join(work, "clip_bench.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print()
    print("results: %s (%.0f s in all)" % (out, res["wall_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
