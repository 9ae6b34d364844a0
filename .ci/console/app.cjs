// The application the console's browser test pushes to (idem serve's push mode): it answers 422
// to a poison order until told it is fixed (POST /fix), and counts, per message id and per
// Idempotency-Key, every delivery it accepted and every one it refused.
//   node app.cjs        listens on a free loopback port and prints "listening on <port>"
"use strict";
const http = require("http");

let fixed = false;
const accepted = {}; // Idem-Message-Id -> 2xx answers
const refused = {}; // Idem-Message-Id -> 422 answers
const keys = {}; // Idempotency-Key -> 2xx answers

function bump(map, k) {
  map[k] = (map[k] || 0) + 1;
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const json = (status, body) => {
      res.writeHead(status, { "content-type": "application/json" });
      res.end(JSON.stringify(body));
    };
    if (req.method === "GET" && req.url === "/stats") return json(200, { fixed, accepted, refused, keys });
    if (req.method === "POST" && req.url === "/fix") {
      fixed = true;
      return json(200, { fixed });
    }
    if (req.method !== "POST" || req.url !== "/orders") return json(404, { error: "no route" });
    const id = req.headers["idem-message-id"] || "(none)";
    let order = {};
    try {
      order = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    } catch (_) {
      // not JSON: an ordinary order without the poison flag
    }
    if (order.poison && !fixed) {
      bump(refused, id);
      res.writeHead(422, { "content-type": "text/plain" });
      return res.end(`order ${order.id} cannot be priced: unknown SKU ${order.sku}`);
    }
    bump(accepted, id);
    bump(keys, req.headers["idempotency-key"] || "(none)");
    return json(200, { ok: true, order: order.id });
  });
});

server.listen(0, "127.0.0.1", () => console.log(`listening on ${server.address().port}`));
process.on("SIGTERM", () => server.close(() => process.exit(0)));
