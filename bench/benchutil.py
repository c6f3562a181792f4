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
