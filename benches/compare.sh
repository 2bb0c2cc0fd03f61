#!/usr/bin/env bash
# Runs the side-by-side benchmarks of BENCHMARKS.md and prints tollgate / peer ratios.
#
#   bash benches/compare.sh          # 3 interleaved runs (about 20 minutes)
#   RUNS=5 bash benches/compare.sh   # more runs
#
# Each run measures every case for tollgate and its peer back to back (criterion baselines
# run1, run2, ...). The report gives, per case, the median and the range of the per-run ratios:
# one run on a shared 2-core VM drifts by +-20%. The Redis benchmark needs redis-server on PATH
# and is skipped without it. Results go to the target directory cargo uses (CARGO_TARGET_DIR or
# build.target-dir are honoured).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
if [ "$runs" -lt 3 ]; then
  echo "warning: fewer than 3 runs; BENCHMARKS.md reports at least 3" >&2
fi
target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
export CRITERION_HOME="$target/criterion"
rm -rf "$CRITERION_HOME"
for r in $(seq 1 "$runs"); do
  echo "== run $r of $runs"
  cargo bench --bench compare -- --save-baseline "run$r"
  if command -v redis-server >/dev/null 2>&1; then
    cargo bench --bench redis --features redis -- --save-baseline "run$r"
  fi
done
cargo bench --bench memory
cargo run --release --example bench_report
