#!/usr/bin/env bash
# Issue 16 benchmark session: idem and the peers back to back on one quiet machine.
set -u
B=$HOME/.cache/idem-target/release/examples/redis_bench
P=/work/shared/peers
W=/tmp/peers/workload.jsonl
stamp() { echo "=== $* ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"; }
stamp "primitives, default runtime (2 workers)"; $B primitives 60000
stamp "primitives, 1 worker"; IDEM_BENCH_WORKERS=1 $B primitives 60000
stamp "workload, default runtime"; $B workload $W 3
stamp "workload, 1 worker"; IDEM_BENCH_WORKERS=1 $B workload $W 3
stamp "peers"; REPEATS=3 bash $P/run_peers.sh 'py-powertools/p1|ts-powertools/c1$|ts-powertools/c16|ts-powertools/p2xc16|node-idempotency/c1$|node-idempotency/c16|node-idempotency/p2xc16'
stamp "raw redis-benchmark SET NX"; for cp in "1 1" "16 1" "16 16"; do REPEATS=3 bash $P/redis_bench.sh $cp | tail -1; done
stamp "workload again, default runtime"; $B workload $W 3
stamp "workload again, 1 worker"; IDEM_BENCH_WORKERS=1 $B workload $W 3
stamp "cluster"; $B cluster 60000
stamp "primitives again, default runtime"; $B primitives 60000
stamp "end"
