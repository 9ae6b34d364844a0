#!/usr/bin/env bash
# Proves from the shell that each TLS listener of `.ci/services.sh up` works: a verified TLS
# connection (host name and CA checked), a client-certificate login where the listener has one,
# and the refusals the Rust tests rely on: plaintext, a wrong CA, a wrong host (127.0.0.2 is not
# in the server certificate), a client certificate from the wrong CA, no client certificate where
# one is required. `up` does not run this. Prints one line per check, then "N passed, M failed";
# exits 1 if any check failed.
set -uo pipefail
STATE=${CI_STATE_DIR:-/tmp/idem-ci}; D=${IDEM_TLS_DIR:-$STATE/tls}
PG_PORT=${PG_PORT:-5432}; PG_TLS_PORT=${PG_TLS_PORT:-5433}; MYSQL_TLS_PORT=${MYSQL_TLS_PORT:-3307}
REDIS_TLS_PORT=${REDIS_TLS_PORT:-6380}; REDIS_MTLS_PORT=${REDIS_MTLS_PORT:-6381}; AMQPS_PORT=${AMQPS_PORT:-5671}
NATS_TLS_PORT=${NATS_TLS_PORT:-4223}; NATS_CREDS_PORT=${NATS_CREDS_PORT:-4224}; NATS_MTLS_PORT=${NATS_MTLS_PORT:-4225}
KAFKA_TLS_PORT=${KAFKA_TLS_PORT:-9093}
TOOL=(timeout 20 /usr/bin/python3 "$(cd "$(dirname "$0")" && pwd)/tls-tool.py")
export PGCONNECT_TIMEOUT=5
passed=0 failed=0

# check ok|refused DESCRIPTION COMMAND...: the command must succeed (ok) or fail (refused).
check() {
  local want=$1 what=$2 out rc; shift 2
  out=$("$@" 2>&1); rc=$?
  # A refusal proves nothing when no server listens: "connection refused" fails the check.
  if { [[ $want == ok ]] && ((rc == 0)); } \
     || { [[ $want == refused ]] && ((rc != 0)) && ! grep -qiE 'connection ?refused' <<<"$out"; }; then
    passed=$((passed + 1)); printf 'ok      %-58s %s\n' "$what" "$(tail -1 <<<"$out" | cut -c1-110)"
  else
    failed=$((failed + 1)); printf 'FAILED  %s (wanted %s, exit %d)\n%s\n' "$what" "$want" "$rc" "$out"
  fi
}
# A TLS handshake that verifies the chain against CA and the name HOST (IP or DNS).
handshake() { # HOST PORT CA [extra s_client args]
  local host=$1 port=$2 ca=$3 verify=(-verify_hostname "$1"); shift 3
  [[ $host =~ ^[0-9.]+$ ]] && verify=(-verify_ip "$host")
  timeout 20 openssl s_client -connect "$host:$port" -CAfile "$ca" -verify_return_error "${verify[@]}" -brief "$@" </dev/null
}
pg() { timeout 20 psql "host=${HOST:-localhost} port=$1 dbname=test $2" -X -Atqc "$3"; }
my() { timeout 20 mariadb --no-defaults -h "${HOST:-localhost}" -P "$MYSQL_TLS_PORT" -N -B "$@"; }
rcli() { timeout 20 redis-cli "$@"; }

echo "# PostgreSQL :$PG_TLS_PORT"
check ok      "verify-full as postgres" pg "$PG_TLS_PORT" "sslmode=verify-full sslrootcert=$D/ca.pem user=postgres" \
  "select 'ssl=' || ssl || ' ' || version from pg_stat_ssl where pid = pg_backend_pid()"
check ok      "client certificate login as idem_client" pg "$PG_TLS_PORT" \
  "sslmode=verify-full sslrootcert=$D/ca.pem sslcert=$D/client.pem sslkey=$D/client.key user=idem_client" \
  "select current_user || ' ' || client_dn from pg_stat_ssl where pid = pg_backend_pid()"
check refused "idem_client without a client certificate" pg "$PG_TLS_PORT" "sslmode=verify-full sslrootcert=$D/ca.pem user=idem_client" "select 1"
check refused "idem_client with wrong-client.pem" pg "$PG_TLS_PORT" \
  "sslmode=verify-full sslrootcert=$D/ca.pem sslcert=$D/wrong-client.pem sslkey=$D/wrong-client.key user=idem_client" "select 1"
check refused "plaintext (sslmode=disable)" pg "$PG_TLS_PORT" "sslmode=disable user=postgres" "select 1"
check refused "wrong CA" pg "$PG_TLS_PORT" "sslmode=verify-full sslrootcert=$D/wrong-ca.pem user=postgres" "select 1"
HOST=127.0.0.2 check refused "wrong host 127.0.0.2" pg "$PG_TLS_PORT" "sslmode=verify-full sslrootcert=$D/ca.pem user=postgres" "select 1"
check refused "shared server :$PG_PORT with sslmode=require" pg "$PG_PORT" "sslmode=require user=postgres" "select 1"

echo "# MariaDB :$MYSQL_TLS_PORT"
check ok      "verified TLS as root" my --ssl-ca="$D/ca.pem" --ssl-verify-server-cert -uroot \
  -e "select concat(current_user(), ' ', variable_value) from information_schema.session_status where variable_name = 'Ssl_version'"
check ok      "client certificate login as idem_client" my --ssl-ca="$D/ca.pem" --ssl-verify-server-cert \
  --ssl-cert="$D/client.pem" --ssl-key="$D/client.key" -uidem_client -D test -e "select current_user()"
check refused "idem_client without a client certificate" my --ssl-ca="$D/ca.pem" --ssl-verify-server-cert -uidem_client -e "select 1"
check refused "idem_client with wrong-client.pem" my --ssl-ca="$D/ca.pem" --ssl-verify-server-cert \
  --ssl-cert="$D/wrong-client.pem" --ssl-key="$D/wrong-client.key" -uidem_client -e "select 1"
check refused "plaintext (--skip-ssl)" my --skip-ssl -uroot -e "select 1"
check refused "wrong CA" my --ssl-ca="$D/wrong-ca.pem" --ssl-verify-server-cert -uroot -e "select 1"
HOST=127.0.0.2 check refused "wrong host 127.0.0.2" my --ssl-ca="$D/ca.pem" --ssl-verify-server-cert -uroot -e "select 1"

echo "# Redis :$REDIS_TLS_PORT (client certificate optional), :$REDIS_MTLS_PORT (required)"
check ok      "PING over TLS, no client certificate" rcli --tls --cacert "$D/ca.pem" -h localhost -p "$REDIS_TLS_PORT" ping
check ok      "PING with a client certificate (:$REDIS_MTLS_PORT)" rcli --tls --cacert "$D/ca.pem" \
  --cert "$D/client.pem" --key "$D/client.key" -h localhost -p "$REDIS_MTLS_PORT" ping
check refused "no client certificate (:$REDIS_MTLS_PORT)" rcli --tls --cacert "$D/ca.pem" -h localhost -p "$REDIS_MTLS_PORT" ping
check refused "wrong-client.pem (:$REDIS_MTLS_PORT)" rcli --tls --cacert "$D/ca.pem" \
  --cert "$D/wrong-client.pem" --key "$D/wrong-client.key" -h localhost -p "$REDIS_MTLS_PORT" ping
check refused "plaintext" rcli -h 127.0.0.1 -p "$REDIS_TLS_PORT" ping
check refused "wrong CA" rcli --tls --cacert "$D/wrong-ca.pem" -h localhost -p "$REDIS_TLS_PORT" ping
# redis-cli checks the chain but not the host name: the name check is openssl's.
check refused "wrong host 127.0.0.2 (openssl s_client)" handshake 127.0.0.2 "$REDIS_TLS_PORT" "$D/ca.pem"

echo "# RabbitMQ :$AMQPS_PORT"
check ok      "TLS handshake (openssl s_client)" handshake localhost "$AMQPS_PORT" "$D/ca.pem"
check ok      "AMQP 0-9-1 SASL EXTERNAL as idem-client" "${TOOL[@]}" amqp "$AMQPS_PORT" --ca "$D/ca.pem" \
  --cert "$D/client.pem" --key "$D/client.key" --external
check ok      "AMQP 1.0 SASL EXTERNAL as idem-client" "${TOOL[@]}" amqp "$AMQPS_PORT" --version 1.0 --ca "$D/ca.pem" \
  --cert "$D/client.pem" --key "$D/client.key" --external
check refused "AMQP 0-9-1 EXTERNAL without a client certificate" "${TOOL[@]}" amqp "$AMQPS_PORT" --ca "$D/ca.pem" --external
check refused "AMQP 1.0 EXTERNAL without a client certificate" "${TOOL[@]}" amqp "$AMQPS_PORT" --version 1.0 --ca "$D/ca.pem" --external
check refused "wrong-client.pem" "${TOOL[@]}" amqp "$AMQPS_PORT" --ca "$D/ca.pem" --cert "$D/wrong-client.pem" --key "$D/wrong-client.key"
check refused "plaintext AMQP header" "${TOOL[@]}" amqp "$AMQPS_PORT" --ca "$D/ca.pem" --plaintext
check refused "wrong CA" "${TOOL[@]}" amqp "$AMQPS_PORT" --ca "$D/wrong-ca.pem"
check refused "wrong host 127.0.0.2" "${TOOL[@]}" amqp "$AMQPS_PORT" --host 127.0.0.2 --ca "$D/ca.pem"

echo "# NATS :$NATS_TLS_PORT (nkey), :$NATS_CREDS_PORT (creds), :$NATS_MTLS_PORT (client certificate)"
check ok      "nkey user + JetStream" "${TOOL[@]}" nats "$NATS_TLS_PORT" --ca "$D/ca.pem" --nk "$D/user.nk" --jetstream
check ok      "creds user + JetStream" "${TOOL[@]}" nats "$NATS_CREDS_PORT" --ca "$D/ca.pem" --creds "$D/user.creds" --jetstream
check ok      "client certificate" "${TOOL[@]}" nats "$NATS_MTLS_PORT" --ca "$D/ca.pem" --cert "$D/client.pem" --key "$D/client.key"
check refused "no nkey (:$NATS_TLS_PORT)" "${TOOL[@]}" nats "$NATS_TLS_PORT" --ca "$D/ca.pem"
check refused "an nkey but no creds (:$NATS_CREDS_PORT)" "${TOOL[@]}" nats "$NATS_CREDS_PORT" --ca "$D/ca.pem" --nk "$D/user.nk"
check refused "no client certificate (:$NATS_MTLS_PORT)" "${TOOL[@]}" nats "$NATS_MTLS_PORT" --ca "$D/ca.pem"
check refused "wrong-client.pem (:$NATS_MTLS_PORT)" "${TOOL[@]}" nats "$NATS_MTLS_PORT" --ca "$D/ca.pem" \
  --cert "$D/wrong-client.pem" --key "$D/wrong-client.key"
check refused "plaintext" "${TOOL[@]}" nats "$NATS_TLS_PORT" --ca "$D/ca.pem" --nk "$D/user.nk" --plaintext
check refused "wrong CA" "${TOOL[@]}" nats "$NATS_TLS_PORT" --ca "$D/wrong-ca.pem" --nk "$D/user.nk"
check refused "wrong host 127.0.0.2" "${TOOL[@]}" nats "$NATS_TLS_PORT" --host 127.0.0.2 --ca "$D/ca.pem" --nk "$D/user.nk"

echo "# Kafka :$KAFKA_TLS_PORT (tansu behind socat)"
check ok      "ApiVersions over TLS" "${TOOL[@]}" kafka "$KAFKA_TLS_PORT" --ca "$D/ca.pem"
check refused "plaintext ApiVersions" "${TOOL[@]}" kafka "$KAFKA_TLS_PORT" --ca "$D/ca.pem" --plaintext
check refused "wrong CA" "${TOOL[@]}" kafka "$KAFKA_TLS_PORT" --ca "$D/wrong-ca.pem"
check refused "wrong host 127.0.0.2" "${TOOL[@]}" kafka "$KAFKA_TLS_PORT" --host 127.0.0.2 --ca "$D/ca.pem"

echo "$passed passed, $failed failed"
((failed == 0))
