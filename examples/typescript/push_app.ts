// An application for `idem serve`'s push mode (Node, no dependencies).
//
// Node runs TypeScript by stripping the types: Node 23.6 and later as it is, Node 22.6 to 23.5
// with --experimental-strip-types (the package.json beside it makes the files ES modules).
// Node 20 and older cannot run .ts files.
//
//   node --experimental-strip-types examples/typescript/push_app.ts \
//     --ledger /tmp/orders.json --port 8080 [--fail-first N]
//
// `idem serve` consumes a queue and POSTs each new message here. Duplicates and conflicts never
// arrive; what arrives carries `Idempotency-Key` (the same on every attempt), `Idem-Attempt`,
// `Idem-Scope`, `Idem-Key`, `Idem-Message-Id` and, after a lease ran out, `Idem-Took-Over: true`.
//
// What push mode needs from the application: its own write must be idempotent on
// `Idempotency-Key`. idem records the key as completed only after this endpoint answered 2xx;
// if idem (or the network) fails between this write and that record, the message is pushed
// again with the same key. Here the ledger is a Map keyed by `Idempotency-Key` (written through
// to a JSON file when --ledger is given): a second push finds the entry and answers as the
// first. A database does the same with a UNIQUE column and `INSERT ... ON CONFLICT DO NOTHING`.
//
// Answers, and what idem does with them:
//   200 + JSON body    completed; the body is stored as the key's result; the message is acked
//   400                the payload is not a JSON object with an "id": dead-lettered, with the
//                      status and this body as the reason
//   503 + Retry-After  the first --fail-first N requests (to watch retries): pushed again
//
// GET /ledger returns every entry as JSON (for tests).

import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import { existsSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { parseArgs } from "node:util";

type Entry = {
  idempotency_key: string;
  order_id: string;
  total_cents: number;
  attempt: number;
  message_id: string | null;
  received_at: string;
};

const { values: args } = parseArgs({
  options: {
    ledger: { type: "string" },
    port: { type: "string", default: "8080" },
    host: { type: "string", default: "127.0.0.1" },
    "fail-first": { type: "string", default: "0" },
  },
});

const ledgerPath = args.ledger;
const ledger = new Map<string, Entry>();
if (ledgerPath && existsSync(ledgerPath)) {
  for (const e of JSON.parse(readFileSync(ledgerPath, "utf8")) as Entry[]) ledger.set(e.idempotency_key, e);
}
let failLeft = Number(args["fail-first"]);

function save(): void {
  if (!ledgerPath) return;
  // Write-then-rename: a crash leaves the old file or the new one, never half of one.
  writeFileSync(`${ledgerPath}.tmp`, JSON.stringify([...ledger.values()], null, 1));
  renameSync(`${ledgerPath}.tmp`, ledgerPath);
}

function answer(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const data = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(data), ...headers });
  res.end(data);
}

function header(req: IncomingMessage, name: string): string | undefined {
  const v = req.headers[name];
  return Array.isArray(v) ? v[0] : v;
}

async function readBody(req: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const c of req) chunks.push(c as Buffer);
  return Buffer.concat(chunks).toString("utf8");
}

async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
  if (req.method === "GET" && req.url === "/ledger") {
    return answer(res, 200, [...ledger.values()]);
  }
  if (req.method !== "POST" || req.url !== "/orders") {
    return answer(res, 404, { error: `no route ${req.method} ${req.url}` });
  }
  const body = await readBody(req);
  if (failLeft > 0) {
    failLeft -= 1;
    return answer(res, 503, { error: "warming up" }, { "retry-after": "1" });
  }
  const key = header(req, "idempotency-key");
  if (!key) return answer(res, 400, { error: "missing Idempotency-Key" });
  let orderId: string;
  let total: number;
  try {
    const order = JSON.parse(body) as { id?: unknown; items?: { qty: number; price_cents: number }[] };
    if (typeof order !== "object" || order === null || order.id === undefined) throw new Error("no id");
    orderId = String(order.id);
    total = (order.items ?? []).reduce((s, i) => s + Number(i.qty) * Number(i.price_cents), 0);
  } catch {
    // Permanent: no retry makes this payload valid, so idem dead-letters it.
    return answer(res, 400, { error: 'the payload must be a JSON object with an "id"' });
  }
  // The idempotent write: only the first push of a key creates the entry. The stored entry, not
  // this request, is the answer, so a repeated push gets the same result as the first.
  let entry = ledger.get(key);
  if (!entry) {
    entry = {
      idempotency_key: key,
      order_id: orderId,
      total_cents: total,
      attempt: Number(header(req, "idem-attempt") ?? 1),
      message_id: header(req, "idem-message-id") ?? null,
      received_at: new Date().toISOString(),
    };
    ledger.set(key, entry);
    save();
  }
  answer(res, 200, { order_id: entry.order_id, total_cents: entry.total_cents, first_attempt: entry.attempt });
}

const server = createServer((req, res) => {
  handle(req, res)
    .catch((e: unknown) => answer(res, 500, { error: String(e) }))
    .finally(() => {
      console.error(`push_app: ${req.method} ${req.url} key=${header(req, "idempotency-key")} ` +
        `attempt=${header(req, "idem-attempt")} ${res.statusCode}`);
    });
});
server.listen(Number(args.port), args.host, () => {
  console.log(`push_app listening on http://${args.host}:${args.port} (ledger ${ledgerPath ?? "in memory"})`);
});
for (const sig of ["SIGINT", "SIGTERM"] as const) process.on(sig, () => server.close(() => process.exit(0)));
