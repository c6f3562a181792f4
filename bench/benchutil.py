"""Helpers shared by the Python benches."""
import random
import struct


def write_tokens(path, n=1 << 20, vocab=50257, seed=1):
    """A token file of `n` uniform random tokens in llm.c's shard format: a 256 int32 header
    (magic, version, count), then uint16 tokens."""
    rng = random.Random(seed)
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, n
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % n, *[rng.randrange(vocab) for _ in range(n)]))


def run_or_exit(cmd, env):
    """Runs cmd (stdout and stderr together); exits the bench with its tail when it fails."""
    import subprocess
    import sys
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit("command failed: %s\n%s" % (" ".join(cmd), r.stdout[-3000:]))
    return r.stdout


def run_logged(cmd, log_path, cwd, timeout, who, env_extra=None):
    """Runs cmd with one OpenMP thread per process (the benches' setting), its output in log_path;
    exits the bench (prefixed by `who`) with the log's tail when it fails or times out."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    with open(log_path, "w") as out:
        try:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = open(log_path).read()[-2000:]
        sys.exit("%s: run failed (%s): %s\n%s" % (who, rc, " ".join(cmd), tail))


def netns_sh(netns_path, keel, prefix, who, *args, check=True):
    """scripts/netns.sh ARGS for namespaces named PREFIX<i>; exits the bench (prefixed by `who`)
    with netns.sh's error when it fails and `check`."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, KEEL_NETNS_PREFIX=prefix, KEEL_BINARY=keel)
    p = subprocess.run(["bash", netns_path] + list(args), env=env, capture_output=True, text=True)
    if check and p.returncode != 0:
        sys.exit("%s: netns.sh %s failed: %s" % (who, " ".join(args), p.stderr.strip()))
    return p
