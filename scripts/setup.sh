#!/usr/bin/env bash
# Installs everything Keel needs from Debian packages. Idempotent: safe to run twice.
# Usage: bash scripts/setup.sh        (as root, or with sudo available)
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  clang                                 # libFuzzer (with ASan and UBSan) for the fuzz targets in fuzz/
  libopenblas-openmp-dev                # BLAS, the OpenMP build: BLAS and our kernels share one thread pool
  libdnnl-dev ocl-icd-opencl-dev        # oneDNN: bf16 matrix products (runtime.precision = "bf16"); its CMake config requires OpenCL
  libgtest-dev libbenchmark-dev         # tests and micro-benchmarks
  libtomlplusplus-dev nlohmann-json3-dev # configs (TOML) and JSON lines / manifests
  libzstd-dev libxxhash-dev             # compression and checksums for checkpoints
  libicu-dev                            # Unicode regular expressions: tokenizer.json's pre-tokenizer patterns
  liburing-dev                          # asynchronous O_DIRECT I/O for the NVMe memory tier
  prometheus-cpp-dev prometheus         # the metrics endpoint; a real Prometheus server in its test
  chromium                              # a real browser opens `keel report` in its test
  openmpi-bin libopenmpi-dev            # the distributed engine: every byte between ranks
  slurm-wlm munge                       # Slurm (slurmctld, slurmd, srun, sbatch; its PMIx plugin) and its authentication: slurm_test starts a real one
  iproute2 procps                       # network namespaces for multi-host tests; pgrep
  fortunes fortunes-min                 # the default training corpus: real English text
  libpng-dev libjpeg-dev                # image decoding for image-caption datasets (keel data images)
  tango-icon-theme                      # named icons: a small real image-caption source (tests)
  oxygen-icon-theme                     # more named icons (1,423 pairs): enough for held-out recall to rise above chance
  python3 python3-numpy python3-torch   # independent reference for tests, peer for benchmarks
  python3-torchvision                   # torchvision's ResNet: the image tower's reference (tests)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present"
fi
