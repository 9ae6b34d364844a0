#!/usr/bin/env python3
"""idem serve's claim API from Python, on the peers' workload (the counterpart of
/work/shared/peers/peer_powertools_py.py; standard library only).

Run beside the peer, against an `idem serve` on the same Redis (see bench/README.md):
  python3 bench/sidecar_py.py --in-flight 1  [--repeats 3] [--max-seconds 300]
  python3 bench/sidecar_py.py --in-flight 16
Workload: /tmp/peers/workload.jsonl from gen_workload.py (100k messages, 80k unique keys, 20k duplicates).
Per message (timed): json.loads(raw line) -> POST /v1/claims {scope, key: message_id, retain_ms: 3600000}
(no payload validation and a 1 h expiry, as the peer's defaults) -> acquired: handler runs (counted), its
result is computed and POST /v1/complete stores it as JSON; duplicate: the stored result is the answer;
in_progress: retried after 1 ms (bounded), counted as `inprogress_retries`; conflict: an error.
N threads (--in-flight) split the stream round-robin (a duplicate may land on another thread), each with
its own keep-alive http.client connection (urllib would open one per request and measure TCP setup).
Checks per run: every unique key's handler ran exactly once (counted in-process, merged), every message
(first or duplicate) got the correct result.
Each run uses a fresh scope, bench-<random>, so earlier runs' records are not duplicates. Nothing is
flushed unless --flush-redis is given: then Redis db 0 is FLUSHDB'd before each run and after the last,
as the peer does (only when the server's store is that Redis, and no one else uses it).
Last line: median messages/s.
"""
import argparse
import collections
import http.client
import json
import os
import secrets
import socket
import statistics
import sys
import threading
import time
import urllib.parse

WORKLOAD = "/tmp/peers/workload.jsonl"
RETAIN_MS = 3_600_000


def compute(msg):
    return {
        "order_id": msg["order_id"],
        "total_cents": sum(i["qty"] * i["price_cents"] for i in msg["items"]),
        "item_count": sum(i["qty"] for i in msg["items"]),
        "status": "processed",
    }


class Api:
    """One keep-alive connection to the claim API."""

    def __init__(self, url, token):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http":
            raise SystemExit(f"--url must be http://host:port, not {url}")
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = "Bearer " + token

    def post(self, path, body):
        self.conn.request("POST", path, json.dumps(body), self.headers)
        res = self.conn.getresponse()
        data = res.read()
        if res.status >= 300:
            raise RuntimeError(f"POST {path}: HTTP {res.status} {data[:300]!r}")
        return json.loads(data) if data else None

    def get(self, path):
        self.conn.request("GET", path, headers=self.headers)
        res = self.conn.getresponse()
        data = res.read()
        if res.status >= 300:
            raise RuntimeError(f"GET {path}: HTTP {res.status} {data[:300]!r}")
        return data


def worker(wid, nthreads, lines, barrier, results, url, token, scope, max_seconds):
    try:
        results[wid] = _worker(wid, nthreads, lines, barrier, url, token, scope, max_seconds)
    except BaseException as e:  # make the others fail fast instead of waiting on the barrier
        barrier.abort()
        results[wid] = {"error": repr(e)}


def _worker(wid, nthreads, lines, barrier, url, token, scope, max_seconds):
    api = Api(url, token)
    api.conn.connect()
    api.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    calls = collections.Counter()
    mine = lines[wid::nthreads]
    barrier.wait()
    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    wrong = retries = done = 0
    for raw in mine:
        msg = json.loads(raw)
        for attempt in range(5000):
            answer = api.post("/v1/claims", {"scope": scope, "key": msg["message_id"], "retain_ms": RETAIN_MS})
            outcome = answer["outcome"]
            if outcome == "acquired":
                calls[msg["message_id"]] += 1
                res = compute(msg)
                api.post("/v1/complete", {"lease": answer["lease"], "result": json.dumps(res)})
                break
            if outcome == "duplicate":
                res = json.loads(answer["record"].get("result") or "null")
                break
            if outcome == "in_progress":
                retries += 1
                time.sleep(0.001)
                continue
            raise RuntimeError(f"unexpected outcome {outcome} for {msg['message_id']}: {answer}")
        else:
            raise RuntimeError("in-progress retries exhausted for " + msg["message_id"])
        if res != compute(msg):
            wrong += 1
        done += 1
        if (done & 255) == 0 and time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - t0
    api.conn.close()
    return {"wid": wid, "calls": calls, "wrong": wrong, "retries": retries, "done": done,
            "assigned": len(mine), "elapsed": elapsed}


def flush_redis():
    # FLUSHDB on db 0 of the local Redis, in RESP, so the script needs no client library.
    with socket.create_connection(("127.0.0.1", 6379), timeout=10) as s:
        s.sendall(b"*1\r\n$7\r\nFLUSHDB\r\n")
        reply = s.recv(64)
    if not reply.startswith(b"+OK"):
        raise SystemExit(f"FLUSHDB failed: {reply!r}")


def run_once(lines, nthreads, max_seconds, unique_keys, url, token, flush):
    if flush:
        flush_redis()
    scope = "bench-" + secrets.token_hex(4)
    barrier = threading.Barrier(nthreads + 1)
    results = [None] * nthreads
    threads = [threading.Thread(target=worker, args=(w, nthreads, lines, barrier, results, url, token, scope,
                                                     max_seconds), daemon=True)
               for w in range(nthreads)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=max_seconds + 120)
    wall = time.perf_counter() - t0
    if any(r is None for r in results):
        raise SystemExit(f"a worker did not finish within {max_seconds + 120:.0f} s")
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit("worker failed: " + "; ".join(errors))
    calls = collections.Counter()
    for r in results:
        calls.update(r["calls"])
    done = sum(r["done"] for r in results)
    complete = done == len(lines)
    twice = sum(1 for v in calls.values() if v > 1)
    never = len(unique_keys - set(calls)) if complete else None
    wrong = sum(r["wrong"] for r in results)
    retries = sum(r["retries"] for r in results)
    ok = complete and twice == 0 and never == 0 and sum(calls.values()) == len(unique_keys) and wrong == 0
    rate = done / wall
    print(f"  run: in_flight={nthreads} scope={scope} messages={done} wall={wall:.2f}s rate={rate:.0f} msg/s "
          f"handler_runs={sum(calls.values())} keys_run_twice={twice} keys_never_run={never} wrong_results={wrong} "
          f"inprogress_retries={retries} load1={open('/proc/loadavg').read().split()[0]} "
          f"exactly_once={'OK' if ok else 'FAIL'}", flush=True)
    return rate, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--in-flight", type=int, default=1, help="threads, each with one keep-alive connection")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=300)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--url", default=os.environ.get("IDEM_URL", "http://127.0.0.1:7700"))
    ap.add_argument("--token", default=os.environ.get("IDEM_TOKEN"), help="default: $IDEM_TOKEN")
    ap.add_argument("--flush-redis", action="store_true",
                    help="FLUSHDB Redis db 0 before each run and after the last (as the peer does)")
    a = ap.parse_args()
    with open(a.workload) as f:
        lines = [ln for ln in f.read().split("\n") if ln]
    unique_keys = {json.loads(ln)["message_id"] for ln in lines}
    probe = Api(a.url, a.token)
    version = json.loads(probe.get("/openapi.json"))["info"]["version"]
    probe.get("/readyz")
    probe.conn.close()
    print(f"idem serve {a.url} (API {version}) python {sys.version.split()[0]} messages={len(lines)} "
          f"unique={len(unique_keys)}", flush=True)
    rates, oks = [], []
    for _ in range(a.repeats):
        r, ok = run_once(lines, a.in_flight, a.max_seconds, unique_keys, a.url, a.token, a.flush_redis)
        rates.append(r)
        oks.append(ok)
    if a.flush_redis:
        flush_redis()
    print(f"idem-serve-python in_flight={a.in_flight} exactly_once={'OK' if all(oks) else 'FAIL'} "
          f"median_msgs_per_s={statistics.median(rates):.0f}")
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())
