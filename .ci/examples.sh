#!/usr/bin/env bash
# The `idem serve` examples against a real server: the claim API clients in Python and
# TypeScript (each exits 1 when an answer is not the expected one), and push mode end to end
# with the Python application on a Redis stream (a duplicate never reaches it, a bad payload is
# dead-lettered, the ledger holds each order once).
#   IDEM_BIN  the idem binary (default $CARGO_TARGET_DIR/debug/idem or target/debug/idem)
# TypeScript runs through `npx tsx` (Node 20 here cannot strip types itself).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-target}/debug/idem}
[ -x "$BIN" ] || { echo "[examples] no idem binary at $BIN" >&2; exit 1; }
DIR=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT

wait_line() { # file, pattern: waits up to 20 s for the pattern in the file
  for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "[examples] timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; return 1
}

# 1. The claim API clients.
TOKEN=example-secret-0123456789
IDEM_STORE="$DIR/claims.db" IDEM_SERVE_LISTEN=127.0.0.1:0 \
  IDEM_SERVE_TOKENS="example:orders:$TOKEN" "$BIN" serve >"$DIR/serve.out" 2>"$DIR/serve.err" &
PIDS+=($!)
wait_line "$DIR/serve.out" "listening on"
URL=$(sed -n 's/^listening on //p' "$DIR/serve.out")
IDEM_URL=$URL IDEM_TOKEN=$TOKEN python3 examples/python/claim_api.py
IDEM_URL=$URL IDEM_TOKEN=$TOKEN npx --yes tsx@4 examples/typescript/claim_api.ts

# 2. Push mode: the Python application, idem serve consuming a fresh Redis stream.
REDIS_URL=${IDEM_TEST_REDIS_URL:-redis://127.0.0.1:6379/}
STREAM="idem-ci-examples-$$"
APP_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 examples/python/push_app.py --db "$DIR/orders.db" --port "$APP_PORT" >"$DIR/app.out" 2>&1 &
PIDS+=($!)
cat >"$DIR/push.toml" <<TOML
listen = "127.0.0.1:0"
[store]
url = "$DIR/push.db"
[auth]
anonymous = true
[[push]]
name = "orders"
broker = "$REDIS_URL"
source = "$STREAM"
dead_letter = "$STREAM.dlq"
scope = "orders"
endpoint = "http://127.0.0.1:$APP_PORT/orders"
timeout_ms = 5000
lease_ms = 15000
TOML
rcli() { redis-cli -u "$REDIS_URL" "$@"; }
rcli DEL "$STREAM" "$STREAM.dlq" >/dev/null
rcli XADD "$STREAM" '*' message_id m-1 content-type application/json payload '{"id":"o-1","items":[{"qty":2,"price_cents":450}]}' >/dev/null
rcli XADD "$STREAM" '*' message_id m-1 content-type application/json payload '{"id":"o-1","items":[{"qty":2,"price_cents":450}]}' >/dev/null
rcli XADD "$STREAM" '*' message_id m-2 content-type application/json payload '{"id":"o-2","items":[{"qty":1,"price_cents":999}]}' >/dev/null
rcli XADD "$STREAM" '*' message_id m-3 content-type application/json payload 'not json' >/dev/null
"$BIN" serve --config "$DIR/push.toml" >"$DIR/push.out" 2>"$DIR/push.err" &
PIDS+=($!)
ok=""
for _ in $(seq 200); do
  ledger=$(curl -sf "http://127.0.0.1:$APP_PORT/ledger" || true)
  dead=$(rcli XLEN "$STREAM.dlq" 2>/dev/null || echo 0)
  rows=$(printf '%s' "$ledger" | python3 -c 'import json,sys; d=json.load(sys.stdin); r=d.get("rows",d) if isinstance(d,dict) else d; print(len(r))' 2>/dev/null || echo 0)
  if [ "$rows" = 2 ] && [ "$dead" = 1 ]; then ok=1; break; fi
  sleep 0.1
done
rcli DEL "$STREAM" "$STREAM.dlq" >/dev/null
if [ -z "$ok" ]; then
  echo "[examples] push mode: expected 2 ledger rows and 1 dead letter, got rows=$rows dead=$dead" >&2
  cat "$DIR/push.err" "$DIR/app.out" >&2
  exit 1
fi
echo "[examples] push mode: 2 orders in the ledger once each, the duplicate absorbed, the bad payload dead-lettered"
