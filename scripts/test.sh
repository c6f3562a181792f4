#!/usr/bin/env bash
# Installs dependencies, builds, and runs every test: the Release suite (unit, model-vs-PyTorch,
# end-to-end CLI and determinism tests), then the fast unit tests again under AddressSanitizer
# and UndefinedBehaviorSanitizer (with the in-process checkpoint tests; clang, in the fuzz targets'
# tree), then every parser of outside input under libFuzzer (scripts/fuzz.sh: 30 s per target, two at a time, ASan + UBSan).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
export OMP_WAIT_POLICY=PASSIVE
ctest --test-dir build --output-on-failure -j2 --timeout 600

# The tier manager's tests, 20 times: their I/O completes asynchronously, and a test that depends on
# when cannot hide behind one lucky run. They wait on I/O more than they compute, so they run while
# the sanitizer tree compiles (a busy machine is part of the check), and their verdict is read after.
echo "== tiers_test x20 (beside the sanitizer build) =="
tiers_log=$(mktemp)
build/tests/tiers_test --gtest_repeat=20 --gtest_brief=1 >"$tiers_log" 2>&1 &
tiers_pid=$!
trap 'kill "$tiers_pid" 2>/dev/null || true' EXIT

echo "== sanitizer build (ASan + UBSan) of the unit tests =="
# One clang tree for the sanitized unit tests and the fuzz targets (scripts/fuzz.sh builds into it
# too): keel_core is compiled once under ASan + UBSan (and libFuzzer's coverage hooks), not twice.
# -O1 and line tables only: the sanitizers' reports keep file:line, the build takes less time.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DKEEL_FUZZ=ON -DKEEL_BENCH=OFF -DBUILD_TESTING=ON >/dev/null
sanitized=(ops_test store_test config_test model_test shard_test tokenizer_test env_test checkpoint_test codec_test compressed_sync_test
           block_file_test tiers_test pipeline_schedule_test pipeline_unit_test kv_cache_test partitioner_test images_test
           int8_gemm_test ring_attention_test moe_test moe_tiers_test)
cmake --build build-fuzz -j"$(nproc)" --target "${sanitized[@]}"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-fuzz --output-on-failure -j2 --timeout 600 -E 'Licences' \
  -R '^(Ops[A-Za-z]*|KvCache|Families/KvCacheModels|ChunkStore|Config|TinyModel|Shard|Corpus|Pretokenize|Tokenizer|Llama2cTokenizer|Env|Checkpoint|CheckpointCorruption|Codec|SyncPolicy|BlockFile|Engines/BlockFileEngines|Tiers|Tiers/Engines|AsyncHost/Engines|PipelineSchedule|PipelineLayout|PipelineStages|PipelineExecutor|PipelineMicroBatches|Partitioner|LayerCosts|Images|Int8Gemm|RingAttention|MoeKernels|MoeModel|MoeConfig|MoeReference|MoeTierLeases|ExpertHomes)\.'

if ! wait "$tiers_pid"; then
  echo "== tiers_test x20: FAILED"; cat "$tiers_log"; exit 1
fi
tail -3 "$tiers_log"; rm -f "$tiers_log"

echo "== fuzzing (libFuzzer, ASan + UBSan): every parser of outside input =="
bash scripts/fuzz.sh 30
