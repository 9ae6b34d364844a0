#!/usr/bin/env bash
# Runs tests again and again, as CI runs them, to tell a flaky test from a sound one.
#
#   .ci/repeat.sh [-n N] [--busy] [--out DIR] SPEC...
#
# SPEC is one quoted argument: "PACKAGE TARGET [LIBTEST ARGS...]": the test binary TARGET of
# PACKAGE (`lib`: its unit tests) as the README's `cargo test --workspace --all-features`
# builds it, run with ARGS from the package's directory in CI's environment (.ci/env.sh:
# CI=true, the services' addresses). Examples:
#   .ci/repeat.sh -n 10 "idem-kafka it"                          # the crate's whole binary
#   .ci/repeat.sh -n 5 --busy "idem-cli it --ignored chaos::push_mode_kafka"
#
#   -n N      runs of each SPEC, back to back (default 10)
#   --busy    keeps one core busy with a CPU burner for the whole repeat (CI machines are shared)
#   --out DIR where the failing runs' output is kept (default a new directory under /tmp)
#
# Prints, per SPEC: runs, failures, median and max seconds, and the failing runs' logs; the
# same table goes to DIR/summary.md with the commit it ran on. Exits 1 if any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=10 busy=0 out=""
while (($#)); do
  case $1 in
    -n) runs=$2; shift 2 ;;
    --busy) busy=1; shift ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "repeat: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
(($#)) || { echo "repeat: name at least one SPEC (see --help)" >&2; exit 2; }
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "repeat: -n wants a positive number, got '$runs'" >&2; exit 2; }
# shellcheck source-path=SCRIPTDIR
source .ci/env.sh
out=${out:-$(mktemp -d /tmp/idem-repeat.XXXXXX)}
mkdir -p "$out"

# The test binaries exactly as the README's command builds them (`--workspace --all-features`:
# one feature set for every crate; `cargo test -p CRATE` would unify features over that crate's
# graph only and build other binaries), each mapped from "PACKAGE TARGET" to its executable and
# its package's directory (libtest runs a test binary there).
bins=$out/binaries.tsv
cargo test --workspace --all-features --no-run --message-format=json-render-diagnostics 2>"$out/build.log" \
  | jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
           | "-\t\(if .target.kind[0] == "lib" then "lib" else .target.name end)\t\(.executable)\t\(.manifest_path | sub("/Cargo.toml$"; ""))"' \
  >"$bins" || { cat "$out/build.log" >&2; exit 1; }
# Each package's directory, by name.
names=$(cargo metadata --no-deps --format-version 1 | jq -r '.packages[] | "\(.name)\t\(.manifest_path | sub("/Cargo.toml$"; ""))"')
run_of() { # SPEC -> "dir<TAB>exe<TAB>args"
  local pkg target rest dir exe
  read -r pkg target rest <<<"$1"
  [[ -n $pkg && -n $target ]] || { echo "repeat: bad SPEC '$1' (want: PACKAGE TARGET [ARGS])" >&2; exit 2; }
  dir=$(awk -F'\t' -v p="$pkg" '$1 == p {print $2}' <<<"$names")
  [[ -n $dir ]] || { echo "repeat: no package '$pkg' in the workspace" >&2; exit 2; }
  exe=$(awk -F'\t' -v t="$target" -v d="$dir" '$2 == t && $4 == d {print $3}' "$bins" | head -1)
  [[ -n $exe ]] || { echo "repeat: no test target '$target' in $pkg" >&2; exit 2; }
  printf '%s\t%s\t%s\n' "$dir" "$exe" "$rest"
}
for spec in "$@"; do run_of "$spec" >/dev/null; done

burner=""
stop_burner() { [[ -n $burner ]] && kill "$burner" 2>/dev/null; burner=""; }
trap stop_burner EXIT
if ((busy)); then
  # One busy process: the scheduler gives it a core; the tests share what is left.
  bash -c 'while :; do :; done' & burner=$!
  echo "[repeat] CPU burner running (pid $burner)"
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git status --porcelain 2>/dev/null | grep -qv '^??' && echo "+changes" || true)
summary=$out/summary.md
{
  echo "| test | runs | failures | median s | max s | busy | commit | date |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
} >"$summary"
failed_any=0
for spec in "$@"; do
  slug=$(tr -c 'A-Za-z0-9_.-' '_' <<<"$spec" | sed 's/_*$//')
  times=() fails=0
  for ((i = 1; i <= runs; i++)); do
    log=$out/$slug.run$i.log
    t0=$(date +%s.%N)
    IFS=$'\t' read -r dir exe args < <(run_of "$spec")
    : >"$log"
    # A run that prints nothing for 10 min is a hang: its stacks go to its log, and it fails.
    .ci/hang-guard.sh 10 "$log" >>"$log.hang" 2>&1 & guard=$!
    # shellcheck disable=SC2086
    if (cd "$dir" && "$exe" $args) >"$log" 2>&1; then status=ok; rm -f "$log"
    else status=FAILED; fails=$((fails + 1)); failed_any=1; fi
    kill "$guard" 2>/dev/null || true; wait "$guard" 2>/dev/null || true
    if [[ -s $log.hang ]]; then cat "$log.hang" >>"$log"; fi
    rm -f "$log.hang"
    t=$(echo "$(date +%s.%N) - $t0" | bc); times+=("$t")
    printf '[repeat] %s: run %d/%d %s in %.1f s%s\n' "$spec" "$i" "$runs" "$status" "$t" \
      "$([[ $status == ok ]] || echo " (output: $log)")"
  done
  sorted=$(printf '%s\n' "${times[@]}" | sort -n)
  median=$(awk '{a[NR]=$1} END {m=(NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2; printf "%.1f", m}' <<<"$sorted")
  max=$(tail -1 <<<"$sorted" | xargs printf '%.1f')
  echo "| \`$spec\` | $runs | $fails | $median | $max | $( ((busy)) && echo "1 core" || echo no) | $commit$dirty | $(date -u +%F) |" >>"$summary"
done
stop_burner
echo
cat "$summary"
((failed_any == 0)) || { echo; echo "[repeat] failing runs' output: $out/*.log"; exit 1; }
