#!/usr/bin/env bash
# Instructions per request under valgrind's callgrind: the axum layer's overhead over the bare
# router, tollgate (and its lean layer) beside tower_governor, counted by
# `benches/instructions.rs` (see its docs).
#
#   bash benches/instructions.sh           # every case, 1 and 10,000 client IPs, both peers
#   bash benches/instructions.sh --check   # the admitted path (headers on, one client IP):
#                                          # fails when it is more than 15 % above the count
#                                          # recorded in benches/instructions.baseline
#
# Each count is the minimum of three runs; a case's count per request is the difference of the
# totals at two request counts divided by the difference of the counts, minus the same for the
# bare router. Needs valgrind (`apt-get install valgrind`).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
bin=$(cargo bench --bench instructions --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*instructions[^"]*"' | tail -n1 | sed 's/.*"executable":"\(.*\)"/\1/')
[ -x "$bin" ] || { echo "could not build benches/instructions.rs" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Measure a copy: a build in the shared target directory during the run (which takes minutes)
# would otherwise replace the binary between counts.
cp "$bin" "$tmp/instructions"
bin="$tmp/instructions"
R1=2000
R2=12000

# Total instructions of one run: the minimum of three.
total() {
  local best=""
  for _ in 1 2 3; do
    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=instructions::measured \
      --callgrind-out-file="$tmp/out" "$bin" "$@" >/dev/null 2>"$tmp/err" \
      || { cat "$tmp/err" >&2; exit 1; }
    local n
    n=$(awk '/^(summary|totals):/ {print $2; exit}' "$tmp/out")
    if [ -z "$best" ] || [ "$n" -lt "$best" ]; then best=$n; fi
  done
  echo "$best"
}

# Instructions per request of a stack, for a case and a number of keys.
per_request() {
  local a b
  a=$(total "$1" "$2" "$3" "$R1")
  b=$(total "$1" "$2" "$3" "$R2")
  echo $(( (b - a) / (R2 - R1) ))
}

overhead() {
  local stack bare
  stack=$(per_request "$1" "$2" "$3")
  bare=$(per_request bare "$2" "$3")
  echo $(( stack - bare ))
}

if [ "${1:-}" = "--check" ]; then
  recorded=$(awk '$1 == "allowed" && $2 == 1 {print $3}' benches/instructions.baseline)
  now=$(overhead tollgate allowed 1)
  limit=$(( recorded * 115 / 100 ))
  echo "instructions per request, admitted with headers, one client IP: $now (recorded $recorded, limit $limit)"
  [ "$now" -le "$limit" ] || { echo "the admitted path grew by more than 15 %" >&2; exit 1; }
  exit 0
fi

printf '%-20s %6s %10s %6s %14s %6s %15s\n' case keys tollgate ratio tollgate_lean ratio tower_governor
for keys in 1 10000; do
  for case in allowed allowed_no_headers limited; do
    ours=$(overhead tollgate "$case" "$keys")
    lean=$(overhead tollgate_lean "$case" "$keys")
    theirs=$(overhead tower_governor "$case" "$keys")
    ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')
    lean_ratio=$(awk -v a="$lean" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')
    printf '%-20s %6s %10s %5sx %14s %5sx %15s\n' "$case" "$keys" "$ours" "$ratio" "$lean" "$lean_ratio" "$theirs"
  done
done
