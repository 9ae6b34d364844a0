#!/usr/bin/env bash
# Issue 25's benchmark session: this commit's benches (NEW) beside the issue's starting commit
# 575efcf (OLD), alternated, on a machine running nothing else. Build both first (release,
# one target dir so dependencies are shared), copy the binaries to $NEW and $OLD:
#   cargo build --release -p idem-redis -p idem-nats -p idem-amqp -p idem-kafka --examples
#   cargo build --release -p idem-consumer --features amqp,nats,postgres --example outbox_bench
#   (the same, minus kafka and outbox_bench, in a worktree at 575efcf for $OLD)
# and run bash ../shared/peers/setup_peers.sh once for the peers and the workload.
set -euo pipefail
NEW=${NEW:-/tmp/bench-new} OLD=${OLD:-/tmp/bench-old}
W=/tmp/peers/workload.jsonl
stamp() { echo "== $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg) — $*"; }
stamp "1. one message in flight on Redis (peers' workload, 1 worker), 3 rounds alternated"
for r in 1 2 3; do
  IDEM_BENCH_WORKERS=1 IDEM_BENCH_SHAPES=c1x1,s1x1,1x1 $NEW/redis_bench workload $W 1 | grep '^| [cs1]'
  IDEM_BENCH_WORKERS=1 IDEM_BENCH_SHAPES=1x1 $OLD/redis_bench workload $W 1 | grep '^| 1' | sed 's/^| 1/| OLD 1/'
done
REPEATS=3 bash ../shared/peers/run_peers.sh 'ts-powertools/c1$|node-idempotency/c1$' | tail -1
REPEATS=3 bash ../shared/peers/redis_bench.sh 1 1 | tail -1
IDEM_BENCH_WORKERS=1 $NEW/redis_bench primitives 20000 | grep -E '^\| (tasks|1 \| 1 )'
stamp "2. inbox beside the bare durable loop, NEW vs OLD alternated"
for lanes in 1 4; do for r in 1 2; do
  echo "-- NATS, $lanes lane(s), NEW"; IDEM_BENCH_MODES=inbox,bare $NEW/nats_bench 100000 64 $lanes | grep '^| '
  echo "-- NATS, $lanes lane(s), OLD"; IDEM_BENCH_MODES=inbox $OLD/nats_bench 100000 64 $lanes | grep '^| '
done; done
for r in 1 2; do
  echo "-- Redis Streams, NEW"; $NEW/redis_bench streams 50000 64 1 | grep '^| '
  echo "-- Redis Streams, OLD"; $OLD/redis_bench streams 50000 64 1 | grep '^| '
done
for lanes in 1 4; do
  echo "-- RabbitMQ, $lanes lane(s), NEW"; IDEM_BENCH_MODES=inbox,bare $NEW/amqp_bench 30000 64 $lanes | grep '^| '
  echo "-- RabbitMQ, $lanes lane(s), OLD"; IDEM_BENCH_MODES=inbox $OLD/amqp_bench 30000 64 $lanes | grep '^| '
done
stamp "3. Kafka offset inbox (tansu)"
for r in 1 2; do $NEW/kafka_bench 20000 100 offset | grep 'msg/s'; done
stamp "4. WAL outbox relay beside the bare publish loop and the table relay"
$NEW/outbox_bench 20000 3 | tail -40
stamp "done"
