#!/usr/bin/env python3
"""Exactly-once order processing through `idem serve`'s claim API (Python standard library only).

Run against a running `idem serve` (see README.md beside this file):

    IDEM_URL=http://127.0.0.1:7700 IDEM_TOKEN=<secret> python3 examples/python/claim_api.py

Environment:
    IDEM_URL    the server (default http://127.0.0.1:7700)
    IDEM_TOKEN  a token allowed the scope (unset: no Authorization header, for a server with
                auth.anonymous = true)
    IDEM_SCOPE  the scope to use (default "orders")

The pattern, for every message: claim its key; if acquired, run the effect and complete the key
with the effect's result; if duplicate, the effect already ran: use the stored result; if
in_progress, another worker holds the key: try again after retry_after_ms; if conflict, the key
was used for different content: never run it, report it.

main() walks through each answer once and checks it. It prints one line per step and exits 1 if
an expectation fails, so it doubles as a check of the server.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid


class IdemError(Exception):
    """The server answered with a problem document (RFC 9457)."""

    def __init__(self, status, problem):
        self.status = status
        self.problem = problem
        # `type` is one word: invalid, unauthorized, forbidden, not_found, lease_lost,
        # too_large, unavailable, corrupt, not_migrated, internal.
        self.kind = problem.get("type", "unknown")
        self.retryable = bool(problem.get("retryable", False))
        super().__init__(f"HTTP {status} {self.kind}: {problem.get('detail', '')}")


class Conflict(Exception):
    """The key was claimed before with another payload."""

    def __init__(self, record):
        self.record = record
        super().__init__(f"key {record['scope']}/{record['key']} was claimed with another payload")


class IdemClient:
    """A client of the claim API. Leases are the server's JSON objects, passed back unchanged."""

    def __init__(self, url="http://127.0.0.1:7700", token=None, timeout=10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _post(self, path, body):
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as res:
                text = res.read()
                return json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                problem = json.loads(text)
            except ValueError:
                problem = {"type": "unknown", "detail": text.decode(errors="replace")}
            raise IdemError(e.code, problem) from None

    def claim(self, scope, key, payload=None, fingerprint=None, lease_ms=None, retain_ms=None):
        """Claims a key. Returns the answer: a dict whose "outcome" is acquired, duplicate,
        in_progress or conflict.

        `payload` (text) is fingerprinted by the server; a later claim of the key with other
        text is a conflict. `fingerprint` (64 hex digits, SHA-256) instead keeps the payload on
        this side.
        """
        body = {"scope": scope, "key": key}
        for name, value in (("payload", payload), ("fingerprint", fingerprint),
                            ("lease_ms", lease_ms), ("retain_ms", retain_ms)):
            if value is not None:
                body[name] = value
        return self._post("/v1/claims", body)

    def complete(self, lease, result=None, retain_ms=None):
        """The effect happened: stores `result` (text) for duplicates. Raises IdemError
        (`lease_lost`, 409) when the lease was taken over or released meanwhile."""
        body = {"lease": lease}
        if result is not None:
            body["result"] = result
        if retain_ms is not None:
            body["retain_ms"] = retain_ms
        self._post("/v1/complete", body)

    def release(self, lease):
        """Gives the key back (a transient failure): the next claim runs the effect again."""
        self._post("/v1/release", {"lease": lease})

    def fail(self, lease, reason, kind=None):
        """The effect will not happen: `permanent` (default; a resubmitted message runs again)
        or `in_doubt` (parked until an operator decides)."""
        body = {"lease": lease, "reason": reason}
        if kind is not None:
            body["kind"] = kind
        self._post("/v1/fail", body)

    def run_once(self, scope, key, payload, effect, max_wait_s=30.0):
        """Runs `effect()` (returning text) at most once for the key, and returns
        (result_text, ran): the effect's result, or the stored one for a duplicate.

        Waits while another worker holds the key; raises Conflict for a key reused with other
        content. If the effect raises, the key is released so a redelivery runs it again.
        """
        deadline = time.monotonic() + max_wait_s
        while True:
            answer = self.claim(scope, key, payload=payload)
            outcome = answer["outcome"]
            if outcome == "acquired":
                lease = answer["lease"]
                try:
                    result = effect()
                except BaseException:
                    self.release(lease)
                    raise
                self.complete(lease, result)
                return result, True
            if outcome == "duplicate":
                return answer["record"].get("result"), False
            if outcome == "conflict":
                raise Conflict(answer["record"])
            # in_progress
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scope}/{key} still in progress after {max_wait_s} s")
            time.sleep(min(answer["retry_after_ms"], 1000) / 1000)


# ---- the walkthrough -------------------------------------------------------------------------

def order_payload(order):
    # One canonical serialisation, so the same order always has the same fingerprint.
    return json.dumps(order, sort_keys=True, separators=(",", ":"))


def main():
    client = IdemClient(os.environ.get("IDEM_URL", "http://127.0.0.1:7700"),
                        os.environ.get("IDEM_TOKEN") or None)
    scope = os.environ.get("IDEM_SCOPE", "orders")
    # Keys unique to this run: the store keeps records for days, and the run must start afresh.
    run = uuid.uuid4().hex[:8]
    failures = []
    charged = []  # the effect: in a real service, a payment or a database write

    def check(step, ok, detail):
        print(f"{'ok  ' if ok else 'FAIL'} {step}: {detail}", flush=True)
        if not ok:
            failures.append(step)

    def charge(order):
        def effect():
            total = sum(i["qty"] * i["price_cents"] for i in order["items"])
            charged.append(order["id"])
            return json.dumps({"order_id": order["id"], "charged_cents": total})
        return effect

    orders = [
        {"id": f"{run}-1", "items": [{"sku": "tea", "qty": 2, "price_cents": 450}]},
        {"id": f"{run}-2", "items": [{"sku": "mug", "qty": 1, "price_cents": 1200}]},
        {"id": f"{run}-3", "items": [{"sku": "pot", "qty": 1, "price_cents": 3900},
                                     {"sku": "tea", "qty": 1, "price_cents": 450}]},
    ]

    try:
        # 1. Each order once: claim -> acquired -> effect -> complete.
        for order in orders:
            result, ran = client.run_once(scope, order["id"], order_payload(order), charge(order))
            check("process", ran and json.loads(result)["order_id"] == order["id"],
                  f"order {order['id']} acquired, charged, completed with {result}")

        # 2. A redelivery of order 1: answered from the stored result, no second charge.
        first = orders[0]
        answer = client.claim(scope, first["id"], payload=order_payload(first))
        stored = answer.get("record", {}).get("result")
        check("duplicate", answer["outcome"] == "duplicate" and stored is not None
              and json.loads(stored)["charged_cents"] == 900 and charged.count(first["id"]) == 1,
              f"order {first['id']} again: outcome {answer['outcome']}, stored result {stored}")

        # 3. The same key with other content: a conflict, never run.
        changed = dict(orders[1], items=[{"sku": "mug", "qty": 5, "price_cents": 1200}])
        answer = client.claim(scope, changed["id"], payload=order_payload(changed))
        check("conflict", answer["outcome"] == "conflict"
              and answer.get("record", {}).get("state") == "completed",
              f"order {changed['id']} with other items: outcome {answer['outcome']}")

        # 4. A key held by another worker: in_progress, with the time left on its lease.
        busy = {"id": f"{run}-4", "items": [{"sku": "tray", "qty": 1, "price_cents": 2500}]}
        held = client.claim(scope, busy["id"], payload=order_payload(busy), lease_ms=10_000)
        answer = client.claim(scope, busy["id"], payload=order_payload(busy))
        check("in_progress", held["outcome"] == "acquired" and answer["outcome"] == "in_progress"
              and 0 < answer["retry_after_ms"] <= 10_000 and answer["attempt"] == 1,
              f"order {busy['id']} while held: outcome {answer['outcome']}, "
              f"retry_after_ms {answer.get('retry_after_ms')}")

        # 5. The holder gives the key back (a transient failure); the next claim is attempt 2,
        #    and the first holder's lease is stale: completing with it changes nothing.
        client.release(held["lease"])
        result, ran = client.run_once(scope, busy["id"], order_payload(busy), charge(busy))
        check("release", ran and charged.count(busy["id"]) == 1,
              f"order {busy['id']} released, then run by the next claim: {result}")
        try:
            client.complete(held["lease"], "stale")
            check("lease_lost", False, "completing with a released lease was accepted")
        except IdemError as e:
            check("lease_lost", e.status == 409 and e.kind == "lease_lost",
                  f"completing with the released lease: HTTP {e.status} {e.kind}")

        # 6. An order that can never succeed: failed for good, with the reason stored.
        bad = {"id": f"{run}-5", "items": []}
        answer = client.claim(scope, bad["id"], payload=order_payload(bad))
        client.fail(answer["lease"], "order has no items")
        again = client.claim(scope, bad["id"], payload=order_payload(bad))
        check("fail", answer["outcome"] == "acquired" and again["outcome"] == "acquired"
              and again["lease"].get("previous") == "failed",
              f"order {bad['id']} failed; a resubmission is claimable again "
              f"(previous {again.get('lease', {}).get('previous')})")
        client.release(again["lease"])

        check("exactly once", sorted(charged) == sorted(o["id"] for o in orders + [busy]),
              f"{len(charged)} charges for {len(orders) + 1} orders")
    except (IdemError, Conflict, OSError, KeyError, ValueError) as e:
        check("request", False, repr(e))

    if failures:
        print(f"{len(failures)} step(s) failed: {', '.join(failures)}")
        return 1
    print("all steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
