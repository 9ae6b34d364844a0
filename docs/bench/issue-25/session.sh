#!/usr/bin/env bash
# Issue 25's benchmark session: this commit's benches (NEW) beside the issue's starting
# commit 575efcf (OLD), alternated, on a machine running nothing else. Build both first:
#   CARGO_TARGET_DIR=~/.cache/idem-bench-target cargo build --release -p idem-redis -p idem-nats -p idem-amqp --examples
#   (copy release/examples/{redis,nats,amqp}_bench to $NEW, then the same from a worktree at
#   575efcf to $OLD), and bash ../shared/peers/setup_peers.sh for the peers and the workload.
set -euo pipefail
NEW=${NEW:-/tmp/bench-new} OLD=${OLD:-/tmp/bench-old}
W=/tmp/peers/workload.jsonl
echo "== $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
# 1. One message in flight on Redis: the sequential consumer, pipelined (c) and not (s), the
#    engine's process() at 1 task (OLD's only shape at 1 in flight), the raw commands, peers.
IDEM_BENCH_WORKERS=1 IDEM_BENCH_SHAPES=c1x1,s1x1,1x1 $NEW/redis_bench workload $W 3
IDEM_BENCH_WORKERS=1 IDEM_BENCH_SHAPES=1x1 $OLD/redis_bench workload $W 3
IDEM_BENCH_WORKERS=1 $NEW/redis_bench primitives 20000
REPEATS=3 bash ../shared/peers/run_peers.sh 'ts-powertools/c1$|node-idempotency/c1$' | tail -4
for cp in "1 1"; do REPEATS=3 bash ../shared/peers/redis_bench.sh $cp | tail -1; done
# 2. Inbox on PostgreSQL at 1 and 4 lanes: NEW (pipelined, bare durable rows) vs OLD.
for lanes in 1 4; do
  IDEM_BENCH_MODES=inbox,bare $NEW/nats_bench 20000 64 $lanes
  IDEM_BENCH_MODES=inbox $OLD/nats_bench 20000 64 $lanes
done
$NEW/redis_bench streams 20000 64 1
$OLD/redis_bench streams 20000 64 1
IDEM_BENCH_MODES=inbox,bare $NEW/amqp_bench 10000 64 1
