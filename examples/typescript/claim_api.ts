// Exactly-once order processing through `idem serve`'s claim API (Node, no dependencies).
//
// Node runs TypeScript by stripping the types: Node 23.6 and later as it is, Node 22.6 to 23.5
// with --experimental-strip-types (the package.json beside it makes the files ES modules; it
// has no dependencies). Node 20 and older cannot run .ts files: use a newer one, or strip the
// types with any TypeScript tool (only erasable syntax is used: no enums, namespaces or
// parameter properties).
//
//   IDEM_URL=http://127.0.0.1:7700 IDEM_TOKEN=<secret> \
//     node --experimental-strip-types examples/typescript/claim_api.ts
//
// Environment: IDEM_URL (default http://127.0.0.1:7700), IDEM_TOKEN (unset: no Authorization
// header, for a server with auth.anonymous = true), IDEM_SCOPE (default "orders").
//
// The pattern, for every message: claim its key; if acquired, run the effect and complete the
// key with the effect's result; if duplicate, the effect already ran: use the stored result; if
// in_progress, another worker holds the key: try again after retry_after_ms; if conflict, the
// key was used for different content: never run it, report it.
//
// main() walks through each answer once and checks it, one line per step; it exits 1 if an
// expectation fails, so it doubles as a check of the server.

import { randomUUID } from "node:crypto";

/** A lease as the server hands it out; sent back unchanged. Tokens are decimal strings. */
export type Lease = {
  scope: string;
  key: string;
  token: string;
  attempt: number;
  until_us: number;
  fingerprint?: string;
  previous?: string;
};

/** A stored record. */
export type StoredRecord = {
  scope: string;
  key: string;
  state: "in_progress" | "completed" | "released" | "failed" | "in_doubt";
  fingerprint?: string;
  result?: string;
  result_base64?: string;
  attempt: number;
  token: string;
  previous?: string;
  created_us: number;
  updated_us: number;
  lease_until_us?: number;
  expires_us: number;
};

/** The answer to a claim: one of four outcomes. */
export type ClaimAnswer =
  | { outcome: "acquired"; lease: Lease; downstream_key: string }
  | { outcome: "duplicate"; record: StoredRecord }
  | { outcome: "in_progress"; retry_after_ms: number; attempt: number }
  | { outcome: "conflict"; record: StoredRecord };

/** An RFC 9457 problem document: every error the API answers with. */
export type Problem = {
  type: string;
  title: string;
  status: number;
  detail: string;
  field?: string;
  limit?: number;
  retryable?: boolean;
};

/** The server answered with a problem document. */
export class IdemError extends Error {
  readonly status: number;
  readonly problem: Problem;
  constructor(status: number, problem: Problem) {
    super(`HTTP ${status} ${problem.type}: ${problem.detail}`);
    this.status = status;
    this.problem = problem;
  }
  /** One word: invalid, unauthorized, forbidden, not_found, lease_lost, too_large, ... */
  get kind(): string {
    return this.problem.type;
  }
}

/** The key was claimed before with another payload. */
export class Conflict extends Error {
  readonly record: StoredRecord;
  constructor(record: StoredRecord) {
    super(`key ${record.scope}/${record.key} was claimed with another payload`);
    this.record = record;
  }
}

export type ClaimOptions = {
  payload?: string;
  fingerprint?: string;
  lease_ms?: number;
  retain_ms?: number;
};

/** A client of the claim API. */
export class IdemClient {
  readonly url: string;
  readonly token: string | undefined;
  readonly timeoutMs: number;

  constructor(url = "http://127.0.0.1:7700", token?: string, timeoutMs = 10_000) {
    this.url = url.replace(/\/+$/, "");
    this.token = token;
    this.timeoutMs = timeoutMs;
  }

  private async post<T>(path: string, body: unknown): Promise<T> {
    const headers: Record<string, string> = { "content-type": "application/json" };
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    const res = await fetch(this.url + path, {
      method: "POST",
      headers,
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(this.timeoutMs),
    });
    const text = await res.text();
    if (!res.ok) {
      let problem: Problem;
      try {
        problem = JSON.parse(text) as Problem;
      } catch {
        problem = { type: "unknown", title: res.statusText, status: res.status, detail: text };
      }
      throw new IdemError(res.status, problem);
    }
    return (text ? JSON.parse(text) : undefined) as T;
  }

  /** Claims a key. `payload` is fingerprinted by the server: a later claim of the key with
   * other text is a conflict. */
  claim(scope: string, key: string, opts: ClaimOptions = {}): Promise<ClaimAnswer> {
    return this.post<ClaimAnswer>("/v1/claims", { scope, key, ...opts });
  }

  /** The effect happened: stores `result` (text) for duplicates. Throws IdemError `lease_lost`
   * (409) when the lease was taken over or released meanwhile. */
  async complete(lease: Lease, result?: string, retain_ms?: number): Promise<void> {
    await this.post<void>("/v1/complete", { lease, result, retain_ms });
  }

  /** Gives the key back (a transient failure): the next claim runs the effect again. */
  async release(lease: Lease): Promise<void> {
    await this.post<void>("/v1/release", { lease });
  }

  /** The effect will not happen: `permanent` (default; a resubmitted message runs again) or
   * `in_doubt` (parked until an operator decides). */
  async fail(lease: Lease, reason: string, kind?: "permanent" | "in_doubt"): Promise<void> {
    await this.post<void>("/v1/fail", { lease, reason, kind });
  }

  /** Runs `effect` at most once for the key; returns its result, or the stored one for a
   * duplicate. Waits while another worker holds the key; throws Conflict for a key reused with
   * other content; releases the key if the effect throws, so a redelivery runs it again. */
  async runOnce(
    scope: string,
    key: string,
    payload: string,
    effect: () => Promise<string>,
    maxWaitMs = 30_000,
  ): Promise<{ result: string | undefined; ran: boolean }> {
    const deadline = Date.now() + maxWaitMs;
    for (;;) {
      const answer = await this.claim(scope, key, { payload });
      switch (answer.outcome) {
        case "acquired": {
          let result: string;
          try {
            result = await effect();
          } catch (e) {
            await this.release(answer.lease);
            throw e;
          }
          await this.complete(answer.lease, result);
          return { result, ran: true };
        }
        case "duplicate":
          return { result: answer.record.result, ran: false };
        case "conflict":
          throw new Conflict(answer.record);
        case "in_progress":
          if (Date.now() > deadline) {
            throw new Error(`${scope}/${key} still in progress after ${maxWaitMs} ms`);
          }
          await new Promise((r) => setTimeout(r, Math.min(answer.retry_after_ms, 1000)));
      }
    }
  }
}

// ---- the walkthrough ---------------------------------------------------------------------------

type Item = { sku: string; qty: number; price_cents: number };
type Order = { id: string; items: Item[] };

/** One canonical serialisation, so the same order always has the same fingerprint. */
function orderPayload(o: Order): string {
  return JSON.stringify({ id: o.id, items: o.items.map((i) => ({ price_cents: i.price_cents, qty: i.qty, sku: i.sku })) });
}

async function main(): Promise<number> {
  const client = new IdemClient(
    process.env.IDEM_URL ?? "http://127.0.0.1:7700",
    process.env.IDEM_TOKEN || undefined,
  );
  const scope = process.env.IDEM_SCOPE ?? "orders";
  // Keys unique to this run: the store keeps records for days, and the run must start afresh.
  const run = randomUUID().slice(0, 8);
  const failures: string[] = [];
  const charged: string[] = []; // the effect: in a real service, a payment or a database write

  const check = (step: string, ok: boolean, detail: string): void => {
    console.log(`${ok ? "ok  " : "FAIL"} ${step}: ${detail}`);
    if (!ok) failures.push(step);
  };
  const charge = (o: Order) => async (): Promise<string> => {
    const total = o.items.reduce((s, i) => s + i.qty * i.price_cents, 0);
    charged.push(o.id);
    return JSON.stringify({ order_id: o.id, charged_cents: total });
  };
  const count = (id: string) => charged.filter((c) => c === id).length;

  const orders: Order[] = [
    { id: `${run}-1`, items: [{ sku: "tea", qty: 2, price_cents: 450 }] },
    { id: `${run}-2`, items: [{ sku: "mug", qty: 1, price_cents: 1200 }] },
    { id: `${run}-3`, items: [{ sku: "pot", qty: 1, price_cents: 3900 }, { sku: "tea", qty: 1, price_cents: 450 }] },
  ];

  try {
    // 1. Each order once: claim -> acquired -> effect -> complete.
    for (const o of orders) {
      const { result, ran } = await client.runOnce(scope, o.id, orderPayload(o), charge(o));
      check("process", ran && JSON.parse(result ?? "{}").order_id === o.id,
        `order ${o.id} acquired, charged, completed with ${result}`);
    }

    // 2. A redelivery of order 1: answered from the stored result, no second charge.
    const first = orders[0];
    let a = await client.claim(scope, first.id, { payload: orderPayload(first) });
    const stored = a.outcome === "duplicate" ? a.record.result : undefined;
    check("duplicate", a.outcome === "duplicate" && stored !== undefined
      && JSON.parse(stored).charged_cents === 900 && count(first.id) === 1,
      `order ${first.id} again: outcome ${a.outcome}, stored result ${stored}`);

    // 3. The same key with other content: a conflict, never run.
    const changed: Order = { ...orders[1], items: [{ sku: "mug", qty: 5, price_cents: 1200 }] };
    a = await client.claim(scope, changed.id, { payload: orderPayload(changed) });
    check("conflict", a.outcome === "conflict" && a.record.state === "completed",
      `order ${changed.id} with other items: outcome ${a.outcome}`);

    // 4. A key held by another worker: in_progress, with the time left on its lease.
    const busy: Order = { id: `${run}-4`, items: [{ sku: "tray", qty: 1, price_cents: 2500 }] };
    const held = await client.claim(scope, busy.id, { payload: orderPayload(busy), lease_ms: 10_000 });
    a = await client.claim(scope, busy.id, { payload: orderPayload(busy) });
    check("in_progress", held.outcome === "acquired" && a.outcome === "in_progress"
      && a.retry_after_ms > 0 && a.retry_after_ms <= 10_000 && a.attempt === 1,
      `order ${busy.id} while held: outcome ${a.outcome}, retry_after_ms ${a.outcome === "in_progress" ? a.retry_after_ms : "-"}`);
    if (held.outcome !== "acquired") throw new Error(`claim of ${busy.id}: ${held.outcome}`);

    // 5. The holder gives the key back (a transient failure); the next claim is attempt 2,
    //    and the first holder's lease is stale: completing with it changes nothing.
    await client.release(held.lease);
    const r = await client.runOnce(scope, busy.id, orderPayload(busy), charge(busy));
    check("release", r.ran && count(busy.id) === 1,
      `order ${busy.id} released, then run by the next claim: ${r.result}`);
    try {
      await client.complete(held.lease, "stale");
      check("lease_lost", false, "completing with a released lease was accepted");
    } catch (e) {
      if (!(e instanceof IdemError)) throw e;
      check("lease_lost", e.status === 409 && e.kind === "lease_lost",
        `completing with the released lease: HTTP ${e.status} ${e.kind}`);
    }

    // 6. An order that can never succeed: failed for good, with the reason stored.
    const bad: Order = { id: `${run}-5`, items: [] };
    const claimed = await client.claim(scope, bad.id, { payload: orderPayload(bad) });
    if (claimed.outcome !== "acquired") throw new Error(`claim of ${bad.id}: ${claimed.outcome}`);
    await client.fail(claimed.lease, "order has no items");
    const again = await client.claim(scope, bad.id, { payload: orderPayload(bad) });
    const previous = again.outcome === "acquired" ? again.lease.previous : undefined;
    check("fail", previous === "failed",
      `order ${bad.id} failed; a resubmission is claimable again (previous ${previous})`);
    if (again.outcome === "acquired") await client.release(again.lease);

    const expected = [...orders, busy].map((o) => o.id).sort();
    check("exactly once", JSON.stringify([...charged].sort()) === JSON.stringify(expected),
      `${charged.length} charges for ${expected.length} orders`);
  } catch (e) {
    check("request", false, String(e));
  }

  if (failures.length > 0) {
    console.log(`${failures.length} step(s) failed: ${failures.join(", ")}`);
    return 1;
  }
  console.log("all steps passed");
  return 0;
}

main().then((code) => process.exit(code));
