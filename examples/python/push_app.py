#!/usr/bin/env python3
"""An application for `idem serve`'s push mode (Python standard library only).

`idem serve` consumes a queue and POSTs each new message here. Duplicates and conflicts never
arrive; what arrives carries `Idempotency-Key` (the same on every attempt), `Idem-Attempt`,
`Idem-Scope`, `Idem-Key`, `Idem-Message-Id` and, after a lease ran out, `Idem-Took-Over: true`.

What push mode needs from the application: its own write must be idempotent on
`Idempotency-Key`. idem records the key as completed only after this endpoint answered 2xx; if
idem (or the network) fails between this commit and that record, the message is pushed again
with the same key. Here the key is the table's primary key and the insert is
`INSERT ... ON CONFLICT DO NOTHING`, so the second push finds the row and answers as the first.

Answers, and what idem does with them:
    200 + JSON body   completed; the body is stored as the key's result; the message is acked
    400               the payload is not a JSON object with an "id": dead-lettered, with the
                      status and this body as the reason
    503 + Retry-After the first --fail-first N requests (to watch retries): pushed again

    python3 examples/python/push_app.py --db /tmp/orders.db --port 8080 [--fail-first N]

GET /ledger returns every stored row as JSON (for tests).
"""

import argparse
import json
import sqlite3
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    idempotency_key TEXT PRIMARY KEY,
    order_id        TEXT NOT NULL,
    total_cents     INTEGER NOT NULL,
    attempt         INTEGER NOT NULL,
    message_id      TEXT,
    received_at     TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)
"""


class App:
    def __init__(self, db_path, fail_first):
        self.db_path = db_path
        self.fail_left = fail_first
        self.lock = threading.Lock()
        with self.connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(SCHEMA)

    def connect(self):
        # One connection per request: sqlite3 connections are not shared between threads.
        return sqlite3.connect(self.db_path, timeout=10)

    def take_failure(self):
        with self.lock:
            if self.fail_left > 0:
                self.fail_left -= 1
                return True
            return False


class Handler(BaseHTTPRequestHandler):
    server_version = "push-app/1"
    # Keep-alive: idem's pusher reuses its connections (every answer has a Content-Length).
    protocol_version = "HTTP/1.1"

    def answer(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        app = self.server.app
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/orders":
            return self.answer(404, {"error": f"no route POST {self.path}"})
        if app.take_failure():
            return self.answer(503, {"error": "warming up"}, [("Retry-After", "1")])
        key = self.headers.get("Idempotency-Key")
        if not key:
            return self.answer(400, {"error": "missing Idempotency-Key"})
        try:
            order = json.loads(body)
            order_id = str(order["id"])
            total = sum(int(i["qty"]) * int(i["price_cents"]) for i in order.get("items", []))
        except (ValueError, TypeError, KeyError):
            # Permanent: no retry makes this payload valid, so idem dead-letters it.
            return self.answer(400, {"error": "the payload must be a JSON object with an \"id\""})
        attempt = int(self.headers.get("Idem-Attempt") or 1)
        with app.connect() as db:  # commits on leaving the block
            db.execute(
                "INSERT INTO orders (idempotency_key, order_id, total_cents, attempt, message_id)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (key, order_id, total, attempt, self.headers.get("Idem-Message-Id")),
            )
            # The stored row, not this request, is the answer: a repeated push gets the same
            # result as the first one.
            row = db.execute(
                "SELECT order_id, total_cents, attempt FROM orders WHERE idempotency_key = ?",
                (key,),
            ).fetchone()
        self.answer(200, {"order_id": row[0], "total_cents": row[1], "first_attempt": row[2]})

    def do_GET(self):
        if self.path != "/ledger":
            return self.answer(404, {"error": f"no route GET {self.path}"})
        with self.server.app.connect() as db:
            db.row_factory = sqlite3.Row
            rows = [dict(r) for r in db.execute("SELECT * FROM orders ORDER BY received_at")]
        self.answer(200, rows)

    def log_message(self, fmt, *args):
        sys.stderr.write(f"push_app: {self.command} {self.path} "
                         f"key={self.headers.get('Idempotency-Key')} "
                         f"attempt={self.headers.get('Idem-Attempt')} {fmt % args}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", default="orders.db", help="SQLite file (created if missing)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--fail-first", type=int, default=0, metavar="N",
                    help="answer 503 with Retry-After: 1 to the first N requests")
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    server.app = App(a.db, a.fail_first)
    print(f"push_app listening on http://{a.host}:{a.port} (db {a.db})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
