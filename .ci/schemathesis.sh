#!/usr/bin/env bash
# Property-based test of `idem serve`'s claim API against its own OpenAPI document.
#
#   bash .ci/schemathesis.sh
#
# Starts `idem serve` on a SQLite store in a temporary directory, with one token of scope "*",
# on a free loopback port; runs schemathesis against /openapi.json with the token; stops the
# server on exit. Fails (exit 1) when a response is a 5xx or does not match the documented
# schema, when fewer than ST_MIN_REQUESTS requests were made, or when the server died.
#
# Environment:
#   IDEM_BIN            the idem binary (default $CARGO_TARGET_DIR/debug/idem, else
#                       target/debug/idem); built beforehand, this script does not build
#   ST_MAX_EXAMPLES     generated cases per operation and phase (default 100)
#   ST_MIN_REQUESTS     fewest requests the run must make (default 500)
#   ST_SEED             schemathesis seed (default random; the run prints the one it used)
#   SCHEMATHESIS_VERSION  installed into $HOME/.cache/idem-venv-schemathesis when missing
#                       (default 4.32.5, the version this script was written against)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IDEM_BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/idem}
MAX_EXAMPLES=${ST_MAX_EXAMPLES:-100}
MIN_REQUESTS=${ST_MIN_REQUESTS:-500}
VERSION=${SCHEMATHESIS_VERSION:-4.32.5}
VENV=$HOME/.cache/idem-venv-schemathesis

if [ ! -x "$IDEM_BIN" ]; then
  echo "schemathesis.sh: no idem binary at $IDEM_BIN (set IDEM_BIN, or build it first)" >&2
  exit 1
fi

installed=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("schemathesis"))' 2>/dev/null || true)
if [ "$installed" != "$VERSION" ]; then
  echo "schemathesis.sh: installing schemathesis $VERSION into $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$VERSION"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/idem-schemathesis.XXXXXX")
SERVER_PID=
stop() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    # Graceful shutdown drains for at most 10 s.
    for _ in $(seq 1 120); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap stop EXIT
trap 'exit 130' INT TERM

TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
# Port 0: the kernel picks a free port; the server prints the address it got.
IDEM_STORE="$WORK/idem.db" IDEM_SERVE_LISTEN=127.0.0.1:0 IDEM_SERVE_TOKENS="schemathesis:*:$TOKEN" \
  RUST_LOG=${RUST_LOG:-warn} "$IDEM_BIN" serve >"$WORK/server.out" 2>"$WORK/server.err" &
SERVER_PID=$!

URL=
for _ in $(seq 1 300); do
  URL=$(sed -n 's/^listening on \(http:\/\/[^ ]*\)$/\1/p' "$WORK/server.out" | head -1)
  [ -n "$URL" ] && break
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then break; fi
  sleep 0.1
done
if [ -z "$URL" ]; then
  echo "schemathesis.sh: idem serve did not start; its log:" >&2
  cat "$WORK/server.err" >&2
  exit 1
fi
echo "schemathesis.sh: idem serve at $URL (SQLite store in $WORK), schemathesis $VERSION"

set +e
(
  cd "$WORK"
  "$VENV/bin/schemathesis" run "$URL/openapi.json" \
    --header "Authorization: Bearer $TOKEN" \
    --checks not_a_server_error,response_schema_conformance \
    --max-examples "$MAX_EXAMPLES" \
    ${ST_SEED:+--seed "$ST_SEED"} \
    --generation-database none \
    --no-color \
    --report har --report-har-path "$WORK/requests.har"
)
status=$?
set -e

REQUESTS=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["log"]["entries"]))' \
  "$WORK/requests.har" 2>/dev/null || echo 0)
echo "schemathesis.sh: $REQUESTS requests made"

failed=0
if [ "$status" -ne 0 ]; then
  echo "schemathesis.sh: FAIL: schemathesis exited with $status (failures above)" >&2
  failed=1
fi
if [ "$REQUESTS" -lt "$MIN_REQUESTS" ]; then
  echo "schemathesis.sh: FAIL: $REQUESTS requests, fewer than $MIN_REQUESTS" >&2
  failed=1
fi
if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "schemathesis.sh: FAIL: idem serve exited during the run" >&2
  failed=1
fi
if [ "$failed" -ne 0 ]; then
  echo "--- idem serve log (last 40 lines) ---" >&2
  tail -40 "$WORK/server.err" >&2
  exit 1
fi
echo "schemathesis.sh: ok"
