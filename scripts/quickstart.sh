#!/usr/bin/env bash
# The default job, from a fresh machine: install dependencies, build, train a ~5M-parameter GPT
# on the fortunes corpus (real English text from Debian's `fortunes` package) for a few minutes
# on the CPU, show the validation loss before and after, then sample text from the result.
# Extra arguments go to `keel train` (e.g. --set train.steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
# resume=auto: run twice, the second run continues this one (a finished run has nothing left to
# do and writes nothing); a run of another model or optimizer in runs/default is refused.
./build/keel train --set train.resume=auto "$@"
echo
echo "== keel generate --checkpoint runs/default/ckpt --prompt 'The' =="
./build/keel generate --checkpoint runs/default/ckpt --prompt "The" --tokens 60 --samples 3 --seed 7
