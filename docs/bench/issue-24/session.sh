#!/usr/bin/env bash
# Before: `git worktree add /tmp/bb b2d499d`, built there with the command of docs/BENCHMARKS.md
# (issue 24 section) and its five *_bench copied to /tmp/bench-before; after: the same from main
# (cda4a56) into /tmp/bench-after. Both built into one CARGO_TARGET_DIR (same Cargo.lock).
# Alternates the pre-issue-24 (b2d499d) and post (main) bench binaries, one at a time.
set -u
out=/work/main/docs/bench/issue-24
export IDEM_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test IDEM_TEST_MYSQL_URL=mysql://root@127.0.0.1:3306/test
run() { # name side round cmd...
  local name=$1 side=$2 round=$3; shift 3
  local f=$out/$name-$side-$round.txt
  echo "== $(date -u +%H:%M:%S) $name $side round $round: $* (load $(cut -d' ' -f1 /proc/loadavg))" | tee -a $out/session.log
  "$@" > "$f" 2>&1 || echo "   exit $?" | tee -a $out/session.log
  grep -E "^\| " "$f" | tail -n +3 >> $out/session.log
}
for round in 1 2 3; do
  for side in before after; do
    [[ $round == 2 ]] && { [[ $side == before ]] && side=after || side=before; }
    B=/tmp/bench-$side
    run amqp $side $round $B/amqp_bench 10000 64 1
    run nats $side $round $B/nats_bench 100000 64 1
    run kafka $side $round $B/kafka_bench 10000 64
    run redis $side $round $B/redis_bench streams 20000 64 1
    run amqp10 $side $round $B/amqp10_bench 20000 64
  done
done
echo "== $(date -u +%H:%M:%S) done" | tee -a $out/session.log
