#!/usr/bin/env bash
# The operator console end to end, in headless Chromium: `idem serve --console` on Redis (the
# store, and a push consumer on a Redis stream delivering to .ci/console/app.cjs), poison
# messages dead-lettered, then replayed from the console's page once the application is fixed;
# the application must accept each exactly once. Screenshots go to docs/console/.
#   IDEM_BIN          the idem binary (default $CARGO_TARGET_DIR/debug/idem, built if missing)
#   CONSOLE_SHOTS     where the screenshots go (default docs/console)
#   IDEM_TEST_REDIS_URL  (default redis://127.0.0.1:6379/)
#   IDEM_CHROMIUM     the browser (default: `command -v chromium`)
# Needs Debian's chromium (`apt-get install chromium`) and node; playwright-core is installed
# once under ~/.cache/idem-console-npm. Without chromium it prints "skipped: chromium
# unavailable" and exits 0, except under CI=true, where it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[console] $*"; }
skip() {
  if [ "${CI:-}" = "true" ]; then echo "[console] FAILED: $* (CI=true: nothing may be skipped)" >&2; exit 1; fi
  say "skipped: $*"; exit 0
}
T0=$(date +%s%N)

CHROMIUM=${IDEM_CHROMIUM:-$(command -v chromium || true)}
if [ -z "$CHROMIUM" ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
  say "installing Debian's chromium (apt-get)"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium; } \
    >/tmp/idem-console-apt.log 2>&1 || tail -5 /tmp/idem-console-apt.log
  CHROMIUM=$(command -v chromium || true)
fi
[ -n "$CHROMIUM" ] && [ -x "$CHROMIUM" ] || skip "chromium unavailable (apt-get install chromium)"
command -v node >/dev/null || skip "node unavailable"
command -v redis-cli >/dev/null || skip "redis-cli unavailable"
REDIS_URL=${IDEM_TEST_REDIS_URL:-redis://127.0.0.1:6379/}
rcli() { redis-cli -u "$REDIS_URL" "$@"; }
rcli ping >/dev/null 2>&1 || skip "Redis does not answer at $REDIS_URL"

# playwright-core, pinned, cached outside the clone (no browser download: Debian's chromium).
PW_VERSION=1.65.2
NPM_DIR=${IDEM_CONSOLE_NPM:-$HOME/.cache/idem-console-npm}
PW="$NPM_DIR/node_modules/playwright-core"
if ! grep -q "\"version\": \"$PW_VERSION\"" "$PW/package.json" 2>/dev/null; then
  mkdir -p "$NPM_DIR"
  say "installing playwright-core@$PW_VERSION into $NPM_DIR"
  npm install --prefix "$NPM_DIR" --no-audit --no-fund --silent "playwright-core@$PW_VERSION" \
    || skip "playwright-core could not be installed from npm"
fi

BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-target}/debug/idem}
if [ ! -x "$BIN" ]; then
  say "building the idem binary"
  cargo build -q -p idem-cli
fi

DIR=$(mktemp -d)
PIDS=()
RUN="idem-ci-console-$$"
STREAM="$RUN-orders"
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rcli DEL "$STREAM" "$STREAM.dlq" >/dev/null 2>&1 || true
  rcli --scan --pattern "idem:{$RUN}:*" 2>/dev/null | xargs -r redis-cli -u "$REDIS_URL" DEL >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap cleanup EXIT

wait_line() { # file, pattern: waits up to 20 s for the pattern in the file
  for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "[console] timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; return 1
}

# The application: 422 for poison orders until fixed.
node .ci/console/app.cjs >"$DIR/app.out" 2>&1 &
PIDS+=($!)
wait_line "$DIR/app.out" "listening on"
APP_PORT=$(sed -n 's/^listening on //p' "$DIR/app.out")

# The messages: two good orders (one of them twice: a duplicate), three poison orders, and an
# order whose id comes again with another payload (a conflict).
SCOPE="console-orders"
add() { rcli XADD "$STREAM" '*' message_id "$1" content-type application/json payload "$2" >/dev/null; }
rcli DEL "$STREAM" "$STREAM.dlq" >/dev/null
add m-1 '{"id":"o-1","sku":"tea","qty":2}'
add m-1 '{"id":"o-1","sku":"tea","qty":2}'
add m-2 '{"id":"o-2","sku":"cup","qty":1}'
add m-3 '{"id":"o-3","sku":"X-13","qty":1,"poison":true}'
add m-4 '{"id":"o-4","sku":"X-14","qty":5,"poison":true}'
add m-5 '{"id":"o-5","sku":"X-15","qty":2,"poison":true}'
add m-6 '{"id":"o-6","sku":"pot","qty":1}'
add m-6 '{"id":"o-6","sku":"pot","qty":9}'

TOKEN="console-ops-$RANDOM-0123456789abcdef"
cat >"$DIR/serve.toml" <<TOML
listen = "127.0.0.1:0"
[store]
url = "$REDIS_URL"
prefix = "$RUN"
[[push]]
name = "orders"
broker = "$REDIS_URL"
source = "$STREAM"
dead_letter = "$STREAM.dlq"
scope = "$SCOPE"
endpoint = "http://127.0.0.1:$APP_PORT/orders"
timeout_ms = 5000
lease_ms = 15000
TOML
IDEM_SERVE_TOKENS="ops:*:$TOKEN" "$BIN" serve --console --config "$DIR/serve.toml" \
  >"$DIR/serve.out" 2>"$DIR/serve.err" &
PIDS+=($!)
wait_line "$DIR/serve.out" "listening on" || { cat "$DIR/serve.err" >&2; exit 1; }
URL=$(sed -n 's/^listening on //p' "$DIR/serve.out")

# Wait for the dead letters: three poison messages and the conflict.
dead=0
for _ in $(seq 200); do
  dead=$(rcli XLEN "$STREAM.dlq" 2>/dev/null || echo 0)
  [ "$dead" = 4 ] && break
  sleep 0.1
done
if [ "$dead" != 4 ]; then
  echo "[console] expected 4 dead letters, got $dead" >&2
  cat "$DIR/serve.err" "$DIR/app.out" >&2
  exit 1
fi
say "4 dead letters; opening the console at $URL/console"

if ! PLAYWRIGHT_CORE="$PW" CHROMIUM="$CHROMIUM" IDEM_URL="$URL" IDEM_TOKEN="$TOKEN" \
  APP_URL="http://127.0.0.1:$APP_PORT" SCOPE="$SCOPE" SHOTS="${CONSOLE_SHOTS:-docs/console}" \
  POISON_IDS="m-3,m-4,m-5" OK_IDS="m-1,m-2,m-6" CONFLICT_ID="m-6" \
  node .ci/console/e2e.cjs; then
  echo "[console] idem serve's log:" >&2
  tail -n 40 "$DIR/serve.err" >&2
  exit 1
fi
ms=$(( ($(date +%s%N) - T0) / 1000000 ))
say "passed in $((ms / 1000)).$((ms % 1000 / 100)) s"
