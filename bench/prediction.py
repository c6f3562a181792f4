#!/usr/bin/env python3
"""Experimental gradient prediction in the pipeline, measured: each stage's last W of a step runs
in the next step's first wait for a message (or before its first W), and its gradient is
predicted meanwhile ("mean": the step's other micro-batches' mean; "previous": what that W added
last step; "momentum": an exponential average of what it added; "lstm": per chunk, a blend of
mean and previous chosen by a small LSTM over the chunk's history), corrected by the true gradient a step later. Real runs at P = 2 (one thread per
rank) of the default job's model on the fortunes corpus, against the exact run ("off"): step
time, bubble, final training and validation loss. Also Zero Bubble's optimizer post-validation
("post-validate": exact, so its losses equal "off"'s; only its time can differ).

    python3 bench/prediction.py [--keel build/keel] [--steps 40] [--schedules 1f1b,zb-h2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--schedules", default="1f1b,zb-h2")
    args = ap.parse_args()
    keel = os.path.abspath(args.keel)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    work = tempfile.mkdtemp(prefix="keel-bench-prediction-")
    print("P = 2, default model (d4) on fortunes, 8 micro-batches of 2 x 128 tokens, %d steps; "
          "step ms and bubble: medians over steps 3..%d" % (args.steps, args.steps))
    print("| schedule | prediction | step ms | vs off | bubble | train loss (last 5 steps) | val loss |")
    print("|---|---|---|---|---|---|---|")
    for s in args.schedules.split(","):
        base = None
        for p in ("off", "mean", "previous", "momentum", "lstm", "post-validate"):
            run_dir = "%s/%s-%s" % (work, s, p)
            option = ["--set", "parallel.post_validate=true"] if p == "post-validate" else \
                ["--set", "parallel.predict_gradients=" + p]
            cmd = [keel, "launch", "-n", "2", "--", "train", "--set", "parallel.pipeline=2",
                   "--set", "parallel.schedule=" + s] + option + [
                   "--set", "train.batch_size=2", "--set", "train.grad_accum=8", "--set", "train.steps=%d" % args.steps,
                   "--set", "train.eval_every=0", "--set", "train.eval_batches=8", "--set", "train.sample_tokens=0",
                   "--set", "runtime.threads=1", "--set", "train.run_dir=" + run_dir]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            if r.returncode != 0:
                sys.exit("failed: %s\n%s" % (" ".join(cmd), r.stdout[-3000:]))
            lines = [json.loads(x) for x in open(run_dir + "/metrics.jsonl")]
            steps = [x for x in lines if "loss" in x and "step" in x]
            steady = [x for x in steps if x["step"] >= 3]
            ms = statistics.median(x["ms"] for x in steady)
            bubble = statistics.median(x["pipeline_bubble"] for x in steady)
            train = statistics.mean(x["loss"] for x in steps[-5:])
            val = [x["val_loss"] for x in lines if "val_loss" in x][-1]
            if base is None:
                base = ms
            print("| %s | %s | %.0f | %.2fx | %.1f%% | %.4f | %.4f |" % (s, p, ms, base / ms, 100 * bubble, train, val))


if __name__ == "__main__":
    main()
