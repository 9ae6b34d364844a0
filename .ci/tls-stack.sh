#!/usr/bin/env bash
# One TLS stack: an all-features build has exactly one rustls, on the `ring` provider, no aws-lc,
# and OpenSSL only under librdkafka; a default-feature build of the facade has no TLS at all.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { echo "[tls-stack] FAIL: $*" >&2; exit 1; }
all=$(cargo tree --workspace --all-features -e normal,build,dev --prefix none -f '{p} [{f}]' 2>/dev/null | sort -u)
grep -qE '^aws-lc' <<<"$all" && fail "aws-lc in the all-features tree: $(grep -E '^aws-lc' <<<"$all" | head -3)"
rustls=$(grep -E '^rustls v' <<<"$all" || true)
[[ $(cut -d' ' -f2 <<<"$rustls" | sort -u | wc -l) == 1 ]] || fail "several rustls versions: $rustls"
grep -q 'ring' <<<"$rustls" || fail "rustls without ring: $rustls"
grep -qE 'aws[-_]lc' <<<"$rustls" && fail "rustls with aws-lc: $rustls"
openssl_users=$(cargo tree --workspace --all-features -e normal -i openssl-sys --prefix none 2>/dev/null \
  | grep -E '^[a-z]' | cut -d' ' -f1 | sort -u | grep -vE '^(openssl-sys|rdkafka-sys|rdkafka|idem-.*)$' || true)
[[ -z $openssl_users ]] || fail "OpenSSL used outside librdkafka by: $openssl_users"
default=$(cargo tree -p idem-consumer -e normal --prefix none 2>/dev/null)
grep -qE '^(rustls|openssl|native-tls|ring) ' <<<"$default" && fail "a default-feature build pulls TLS"
echo "[tls-stack] ok: $(cut -d' ' -f1,2 <<<"$rustls" | head -1) with ring; no aws-lc; OpenSSL only in rdkafka; default build has no TLS"
