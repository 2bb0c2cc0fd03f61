#!/usr/bin/env bash
# Runs the side-by-side benchmarks of BENCHMARKS.md and prints tollgate / peer ratios.
#
#   bash benches/compare.sh          # 3 runs of each timing benchmark (about 20 minutes)
#   RUNS=1 bash benches/compare.sh   # one run
#
# Each criterion run is saved as a baseline (run1, run2, ...); the report takes the median over
# the runs of each benchmark's median, because one run on a shared 2-core VM drifts by +-20%.
# The Redis benchmark needs redis-server on PATH and is skipped without it.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
rm -rf target/criterion
for r in $(seq 1 "$runs"); do
  cargo bench --bench compare -- --save-baseline "run$r"
  if command -v redis-server >/dev/null 2>&1; then
    cargo bench --bench redis --features redis -- --save-baseline "run$r"
  fi
done
cargo bench --bench memory
cargo run --release --example bench_report
