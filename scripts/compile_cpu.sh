#!/usr/bin/env bash
# A compiler and linker launcher that appends each command's CPU seconds (user, system) and its
# output file to $KEEL_COMPILE_CPU_LOG: CPU time, unlike wall time, does not grow when other work
# shares the machine. Summarise a log with `bash scripts/compile_cpu.sh --summary LOG`.
# Usage (a scratch tree, ccache off so every file is compiled):
#   CCACHE_DISABLE=1 cmake -S . -B build-cpu -DCMAKE_BUILD_TYPE=Release \
#     -DCMAKE_CXX_COMPILER_LAUNCHER=$PWD/scripts/compile_cpu.sh -DCMAKE_CXX_LINKER_LAUNCHER=$PWD/scripts/compile_cpu.sh
#   KEEL_COMPILE_CPU_LOG=$PWD/build-cpu/cpu.log cmake --build build-cpu -j2
set -euo pipefail
if [ "${1:-}" = "--summary" ]; then
  # Groups: the library's sources, keel's main, test files, the tests' precompiled header, bench,
  # fuzz targets, links; per group the files, CPU seconds and the five costliest files.
  awk '{
    cpu = $1 + $2; out = $3; g = "other"
    if (out ~ /\.gch$|\.pch$/) g = "precompiled header"
    else if (out !~ /\.o$/) g = "links"
    else if (out ~ /\/keel_core\.dir\//) g = "src (keel_core)"
    else if (out ~ /\/keel\.dir\//) g = "src/cli/main.cpp"
    else if (out ~ /\/tests\/CMakeFiles\//) g = "tests"
    else if (out ~ /\/bench\/CMakeFiles\//) g = "bench"
    else if (out ~ /\/fuzz\/CMakeFiles\//) g = "fuzz targets"
    n[g]++; s[g] += cpu; total += cpu
    if (cpu > top[g, 5]) {
      top[g, 5] = cpu; name[g, 5] = out
      for (i = 5; i > 1 && top[g, i] > top[g, i - 1]; i--) {
        t = top[g, i]; top[g, i] = top[g, i - 1]; top[g, i - 1] = t
        t = name[g, i]; name[g, i] = name[g, i - 1]; name[g, i - 1] = t
      }
    }
  }
  END {
    for (g in n) {
      printf "%-20s %4d commands %8.1f CPU s\n", g, n[g], s[g]
      for (i = 1; i <= 5 && name[g, i] != ""; i++) printf "    %7.1f %s\n", top[g, i], name[g, i]
    }
    printf "%-20s %4s          %8.1f CPU s\n", "all", "", total
  }' "$2"
  exit 0
fi
out=unknown prev=""
for arg in "$@"; do
  if [ "$prev" = "-o" ]; then out=$arg; fi  # relative to the directory the build runs it in
  prev=$arg
done
case $out in /*) ;; *) out=$PWD/$out ;; esac
exec /usr/bin/time -a -o "${KEEL_COMPILE_CPU_LOG:?set KEEL_COMPILE_CPU_LOG to a log file}" -f "%U %S $out" "$@"
