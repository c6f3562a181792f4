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


def print_table(head, rows):
    """Prints rows (lists of cells) under head as a text table: columns padded to their widest cell,
    separated by " | ", a rule under the head."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    print(" | ".join(str(h).ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def run_or_exit(cmd, env):
    """Runs cmd (stdout and stderr together); exits the bench with its tail when it fails."""
    import subprocess
    import sys
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if r.returncode != 0:
        sys.exit("command failed: %s\n%s" % (" ".join(cmd), r.stdout[-3000:]))
    return r.stdout


CLEARED_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GLIBC_TUNABLES")


def run_logged(cmd, log_path, cwd, timeout, who, env_extra=None, fatal=True):
    """Runs cmd with one OpenMP thread per process (the benches' setting; none of the caller's
    thread or allocator settings), then env_extra, its output in log_path. When it fails or times out:
    exits the bench (prefixed by `who`) with the log's tail, or without `fatal` returns the exit code
    ("timeout" for a timeout); 0 when it succeeded."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env["OMP_NUM_THREADS"] = "1"
    env.update(env_extra or {})
    with open(log_path, "w") as out:
        try:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 and fatal:
        tail = open(log_path).read()[-2000:]
        sys.exit("%s: run failed (%s): %s\n%s" % (who, rc, " ".join(cmd), tail))
    return rc


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
