#!/usr/bin/env bash
# Instructions per message on the engine's paths that need no server (issue 40): each path of
# the `cost` example (crates/idem-testkit/examples/cost.rs) runs under callgrind at two sizes;
# (Ir(N2) - Ir(N1)) / (N2 - N1) is its cost per message, start-up excluded. Instruction counts
# are the same from run to run for one binary and input, so two builds compare without noise.
#
#   bench/callgrind.sh [PATH ...]          # default: every path
#   N1=1000 N2=5000 OUT=/tmp/cg bench/callgrind.sh two-phase-memory
#
# Prints one line per path: `path  Ir/message`; keeps each N2 run's callgrind file in $OUT
# (default /tmp/idem-callgrind) for `callgrind_annotate --inclusive=yes FILE | head -60`.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source .ci/env.sh
N1=${N1:-1000}; N2=${N2:-5000}; OUT=${OUT:-/tmp/idem-callgrind}
mkdir -p "$OUT"
cargo build --release -q -p idem-testkit --example cost
BIN=$CARGO_TARGET_DIR/release/examples/cost
paths=("$@")
[[ ${#paths[@]} -gt 0 ]] || paths=(two-phase-memory two-phase-memory-1 duplicate-memory inbox-sqlite two-phase-sqlite bare-sqlite)
ir() { # PATH N -> total instructions of the run
  local f="$OUT/$1-$2.out"
  valgrind --tool=callgrind --callgrind-out-file="$f" "$BIN" "$1" "$2" >/dev/null 2>"$f.log"
  grep -m1 '^summary:' "$f" | awk '{print $2}'
}
printf '%-22s %12s\n' path Ir/message
for p in "${paths[@]}"; do
  a=$(ir "$p" "$N1"); b=$(ir "$p" "$N2")
  printf '%-22s %12d\n' "$p" $(( (b - a) / (N2 - N1) ))
done
