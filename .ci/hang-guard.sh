#!/usr/bin/env bash
# Turns a hung test into a failure that carries its evidence.
#
#   .ci/hang-guard.sh MINUTES FILE...
#
# Watches FILEs (the output of a running step); once none of them has grown for MINUTES, prints
# every thread's stack of each running test binary (an executable under
# "$CARGO_TARGET_DIR/debug/deps", and the processes it started), then kills those binaries, so
# the step fails naming the test instead of waiting for CI's own limit. Runs until killed.
# Why: a hang inside a test can stop the test's own deadline too (docs/TESTING.md, flake 7:
# a tokio worker spinning in a library kept the harness's watchdog, a task on the same runtime,
# from ever running); a process that only prints nothing tells nobody anything.
set -uo pipefail
minutes=${1:?minutes}; shift
(($#)) || { echo "hang-guard: name at least one file to watch" >&2; exit 2; }
deps="$(realpath -m "${CARGO_TARGET_DIR:-target}")/debug/deps/"
newest() { # the newest modification time among the files, in seconds
  local f t m=0
  for f in "$@"; do
    t=$(stat -c %Y "$f" 2>/dev/null) || continue
    ((t > m)) && m=$t
  done
  echo "$m"
}
test_pids() { # the running test binaries, and every process under them
  local p exe roots=() all
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    [[ $exe == "$deps"* ]] && roots+=("${p#/proc/}")
  done
  ((${#roots[@]})) || return 0
  all=("${roots[@]}")
  for p in "${roots[@]}"; do
    mapfile -t -O "${#all[@]}" all < <(pgrep -P "$p" 2>/dev/null)
  done
  printf '%s\n' "${all[@]}" | sort -un
}
while sleep 30; do
  last=$(newest "$@")
  ((last == 0)) && continue
  (( $(date +%s) - last < minutes * 60 )) && continue
  pids=$(test_pids)
  [[ -n $pids ]] || continue
  echo "[ci] hang guard: no output for ${minutes} min; the stacks of the running test processes:"
  for p in $pids; do
    echo "[ci] --- pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-300)"
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p "$p" -batch -ex "thread apply all bt 25" 2>/dev/null \
        | grep -E '^(Thread|#)' | head -400
    else
      for t in /proc/"$p"/task/*; do echo "thread ${t##*/}: $(cat "$t/wchan" 2>/dev/null)"; done
    fi
  done
  echo "[ci] hang guard: killing them; the step fails"
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null
  # One report per hang: the step's output changes again as the binary dies.
  touch "$@" 2>/dev/null
done
