#!/usr/bin/env bash
# Local services for idem's integration tests (see ../shared/SERVICES.md):
#   .ci/services.sh up      install what is missing (Debian), start each service that does not answer
#   .ci/services.sh status  print which services answer; exit 1 if any does not
#   .ci/services.sh restart postgres|mariadb|rabbitmq|galera-N
#                           restart one shared server and wait until it answers again (the
#                           server-restart tests run this mid-load)
#   .ci/services.sh galera  start only the 3-node MariaDB Galera cluster (part of `up`; 17 s cold,
#                           0.3 s when it runs)
#   .ci/services.sh kill|stop galera-N
#                           SIGKILL / shut down Galera node N (1-3) and wait until it is gone;
#                           `restart galera-N` brings it back (it rejoins by IST, or SST)
# Ports can be moved with PG_PORT, MYSQL_PORT, REDIS_PORT, AMQP_PORT, MQTT_PORT, NATS_PORT, KAFKA_PORT,
# REDIS_CLUSTER_PORT (the first of three: a Redis Cluster of 3 masters, no replicas), GALERA_PORT
# (the first of three MariaDB Galera nodes; see galera_up).
# Kafka is tansu (a Kafka-protocol broker in Rust, ../shared/KAFKA.md): no Debian package, so a
# missing one is built with `cargo install` once per machine (11-21 min cold, measured), then reused.
#
# TLS listeners (issue 23; .ci/tls.sh, proved by .ci/tls-selftest.sh). Each listener also binds
# 127.0.0.2, which is NOT in the server certificate: connect there to test a wrong host name.
#   env var (default)               what
#   IDEM_TLS_DIR ($STATE/tls)       the throw-away PKI below; STATE is CI_STATE_DIR or /tmp/idem-ci
#   PG_TLS_PORT (5433)              PostgreSQL, hostssl only, db `test`; postgres: trust;
#                                   idem_client: client certificate only (CN idem-client)
#   MYSQL_TLS_PORT (3307)           MariaDB, require_secure_transport, db `test`; root: empty
#                                   password; idem_client: client certificate (REQUIRE SUBJECT/ISSUER)
#   REDIS_TLS_PORT (6380)           Redis, TLS only, client certificate optional
#   REDIS_MTLS_PORT (6381)          Redis, TLS only, client certificate required
#   AMQPS_PORT (5671)               RabbitMQ (AMQP 0-9-1 and 1.0): guest/guest, or a client
#                                   certificate with SASL EXTERNAL as user idem-client
#   NATS_TLS_PORT (4223)            NATS + JetStream, TLS, nkey user (user.nk) only
#   NATS_CREDS_PORT (4224)          NATS + JetStream, TLS, operator mode: user.creds only
#   NATS_MTLS_PORT (4225)           NATS, TLS, client certificate required, no other auth
#   KAFKA_TLS_PORT (9093)           tansu (in memory) behind socat's TLS, advertised as
#                                   localhost:9093 (tansu 0.6.0 cannot serve TLS itself: tls.sh)
# Files in IDEM_TLS_DIR (PEM; keys EC P-256 PKCS#8, mode 0600; remade when missing or expiring):
#   ca.pem ca.key                 the CA that signs everything below but wrong-client
#   server.pem server.key         CN localhost, SANs DNS:localhost, IP:127.0.0.1; every listener's
#   client.pem client.key         CN idem-client, extendedKeyUsage clientAuth
#   wrong-ca.pem wrong-ca.key     an unrelated CA ("wrong CA is refused")
#   wrong-client.pem .key         CN idem-client signed by wrong-ca (refused by every listener)
#   user.nk user.nk.pub           NATS nkey user: seed (SU...) and public key (U...)
#   user.creds                    NATS user JWT + seed of the operator/account in nats/
# The shared PostgreSQL on PG_PORT has ssl off, so sslmode=require against it fails.
set -euo pipefail
log() { echo "[services] $*"; }
port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }
wait_port() {
  local i
  for ((i = 0; i < $2; i++)); do port_open "$1" && { log "$3 up on :$1 (${i}s)"; return 0; }; sleep 1; done
  log "$3 did not come up on :$1 within $2s"; return 1
}
PG_PORT=${PG_PORT:-5432}; MYSQL_PORT=${MYSQL_PORT:-3306}; REDIS_PORT=${REDIS_PORT:-6379}
AMQP_PORT=${AMQP_PORT:-5672}; MQTT_PORT=${MQTT_PORT:-1883}; NATS_PORT=${NATS_PORT:-4222}
KAFKA_PORT=${KAFKA_PORT:-9092}; TANSU_VERSION=0.6.0
# libsql: the Kafka restart test keeps a private broker's log in a SQLite file (the shared broker
# stays in memory). A tansu built with other features is rebuilt once.
TANSU_FEATURES=dynostore,libsql; TANSU_MARK=$HOME/.cache/idem-tansu-features
REDIS_CLUSTER_PORT=${REDIS_CLUSTER_PORT:-7000}
GALERA_PORT=${GALERA_PORT:-3311}
COSMOS_PORT=${COSMOS_PORT:-8081}; COSMOSDB_SERVER_VERSION=1.0.1   # @vercel/cosmosdb-server, see up()
STATE=${CI_STATE_DIR:-/tmp/idem-ci}; mkdir -p "$STATE"
SUDO=""; [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && SUDO="sudo"
MARIADB_PID=/run/mysqld/mysqld.pid   # Debian's pid-file: tells the shared mariadbd from mariadb-tls
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/tls.sh"

status() {
  local bad=0 name port
  for pair in "postgres:$PG_PORT" "mariadb:$MYSQL_PORT" "redis:$REDIS_PORT" "rabbitmq:$AMQP_PORT" \
              "mosquitto:$MQTT_PORT" "nats:$NATS_PORT" "kafka:$KAFKA_PORT" \
              "redis-cluster:$REDIS_CLUSTER_PORT" "redis-cluster:$((REDIS_CLUSTER_PORT + 1))" \
              "redis-cluster:$((REDIS_CLUSTER_PORT + 2))" "galera-1:$GALERA_PORT" \
              "galera-2:$((GALERA_PORT + 1))" "galera-3:$((GALERA_PORT + 2))"; do
    name=${pair%%:*}; port=${pair##*:}
    if port_open "$port"; then log "$name answers on 127.0.0.1:$port"; else log "$name DOES NOT answer on 127.0.0.1:$port"; bad=1; fi
  done
  if port_open "$COSMOS_PORT"; then log "cosmosdb-server answers on 127.0.0.1:$COSMOS_PORT"; else log "cosmosdb-server DOES NOT answer on 127.0.0.1:$COSMOS_PORT"; bad=1; fi
  tls_status || bad=1
  return $bad
}

install_missing() {
  local pkgs=()
  command -v pg_ctlcluster   >/dev/null || pkgs+=(postgresql)
  command -v mariadbd        >/dev/null || pkgs+=(mariadb-server)
  command -v redis-server    >/dev/null || pkgs+=(redis-server)
  command -v rabbitmq-server >/dev/null || pkgs+=(rabbitmq-server)
  command -v mosquitto       >/dev/null || pkgs+=(mosquitto)
  command -v nats-server     >/dev/null || pkgs+=(nats-server)
  command -v faketime        >/dev/null || pkgs+=(faketime)   # the clock-skew tests
  command -v openssl         >/dev/null || pkgs+=(openssl)    # the TLS listeners (tls.sh)
  command -v socat           >/dev/null || pkgs+=(socat)
  /usr/bin/python3 -c 'import cryptography' 2>/dev/null || pkgs+=(python3-cryptography)
  if ((${#pkgs[@]})); then
    log "installing: ${pkgs[*]}"; export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >"$STATE/apt.log" 2>&1 || { tail -20 "$STATE/apt.log"; exit 1; }
  fi
}

# Whether the installed tansu is the version and features this script builds.
tansu_current() {
  [[ -x $(tansu_bin) && $(cat "$TANSU_MARK" 2>/dev/null) == "$TANSU_VERSION $TANSU_FEATURES" ]]
}
tansu_bin() { command -v tansu || echo "$HOME/.cargo/bin/tansu"; }

# Builds tansu from crates.io. opt-level 1: the broker only has to keep up with tests, and the
# build costs about half the CPU of the default opt-level 3.
tansu_install() {
  local t0=$SECONDS
  log "installing tansu $TANSU_VERSION ($TANSU_FEATURES) from crates.io (log: $STATE/tansu-install.log)"
  CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=false \
    cargo install tansu --version "$TANSU_VERSION" --locked --force --features "$TANSU_FEATURES" \
    --target-dir "${TANSU_TARGET_DIR:-$HOME/.cache/tansu-target}" >"$STATE/tansu-install.log" 2>&1 \
    || { tail -30 "$STATE/tansu-install.log"; return 1; }
  mkdir -p "$(dirname "$TANSU_MARK")"; echo "$TANSU_VERSION $TANSU_FEATURES" >"$TANSU_MARK"
  log "tansu installed in $((SECONDS - t0))s"
}

# The shared broker: tansu on loopback only (its default listener is 0.0.0.0), in memory.
kafka_up() {
  nohup setsid "$(tansu_bin)" broker --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" --storage-engine memory://tansu/ \
    >"$STATE/tansu.log" 2>&1 </dev/null &
  wait_port "$KAFKA_PORT" 30 kafka
}

# Installs tansu and starts the Kafka listeners in a background process. Until it is done, a file
# per address in $STATE/starting/ says so: idem_testkit::service::require waits for an address
# that has one (and fails at once, with the log, when its .failed twin appears), so the Kafka
# tests wait for the build instead of failing, and nothing else waits for it.
kafka_background() {
  local addrs=("127.0.0.1:$KAFKA_PORT" "localhost:$KAFKA_TLS_PORT") a
  mkdir -p "$STATE/starting"
  for a in "${addrs[@]}"; do
    rm -f "$STATE/starting/$a.failed"
    echo "tansu $TANSU_VERSION is being built by .ci/services.sh (log: $STATE/tansu-install.log)" >"$STATE/starting/$a"
  done
  log "kafka: building tansu in the background (log: $STATE/tansu-install.log; tests wait for :$KAFKA_PORT)"
  nohup setsid "$0" kafka-background >"$STATE/kafka-background.log" 2>&1 </dev/null &
}
kafka_background_run() {
  local a ok=1
  tansu_install && kafka_up && tls_pki && kafka_tls_up || ok=0
  for a in "127.0.0.1:$KAFKA_PORT" "localhost:$KAFKA_TLS_PORT"; do
    ((ok)) || { echo "tansu could not be installed or started: see $STATE/tansu-install.log and $STATE/kafka-background.log"; tail -20 "$STATE/tansu-install.log"; } >"$STATE/starting/$a.failed"
    rm -f "$STATE/starting/$a"
  done
  ((ok))
}

# Blocks until the Kafka listeners answer (or their background start failed).
kafka_wait() {
  local t0=$SECONDS
  while [[ -e $STATE/starting/127.0.0.1:$KAFKA_PORT ]]; do
    (( (SECONDS - t0) % 60 == 0 )) && log "waiting for tansu's build ($((SECONDS - t0))s; log: $STATE/tansu-install.log)"
    sleep 1
  done
  [[ -e $STATE/starting/127.0.0.1:$KAFKA_PORT.failed ]] && { cat "$STATE/starting/127.0.0.1:$KAFKA_PORT.failed"; return 1; }
  wait_port "$KAFKA_PORT" 30 kafka
}

up() {
  install_missing
  # PostgreSQL: trust on loopback, database `test`.
  if ! psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1; then
    local v hba; v=$(ls /etc/postgresql | sort -V | tail -1); hba=/etc/postgresql/$v/main/pg_hba.conf
    $SUDO sed -ri 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+(127\.0\.0\.1\/32|::1\/128)[[:space:]]+)[a-z0-9-]+/\1trust/' "$hba"
    if port_open "$PG_PORT"; then $SUDO pg_ctlcluster --skip-systemctl-redirect "$v" main reload
    else $SUDO pg_ctlcluster --skip-systemctl-redirect "$v" main start; fi
    wait_port "$PG_PORT" 30 postgres
  fi
  psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -Atqc "select 1 from pg_database where datname='test'" | grep -q 1 \
    || psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc 'create database test'
  # No TLS on the shared server (Debian turns it on with a snakeoil certificate): the TLS tests use
  # PG_TLS_PORT, and sslmode=require here must fail. `ssl` reloads without a restart.
  [[ $(psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -Atqc 'show ssl') == off ]] \
    || psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc 'alter system set ssl = off' -c 'select pg_reload_conf()' >/dev/null
  # Logical decoding for the WAL outbox (pg_logical_emit_message read from a replication slot):
  # wal_level changes only on a restart, so restart once, and only when it is not logical yet.
  if [[ $(psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -Atqc 'show wal_level') != logical ]]; then
    psql -w -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc 'alter system set wal_level = logical'
    restart postgres
  fi
  # MariaDB: root with an empty password over TCP (sqlx cannot use unix_socket auth).
  if ! port_open "$MYSQL_PORT"; then
    $SUDO install -d -o mysql -g mysql /run/mysqld
    # --pidfile: with only --exec, a running mariadb-tls would count as "already running".
    $SUDO start-stop-daemon --start --oknodo --background --pidfile "$MARIADB_PID" --exec /usr/sbin/mariadbd -- --user=mysql
    wait_port "$MYSQL_PORT" 60 mariadb
  fi
  mariadb -uroot -h127.0.0.1 -P"$MYSQL_PORT" -e 'select 1' >/dev/null 2>&1 \
    || $SUDO mariadb -uroot -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD(''); FLUSH PRIVILEGES;"
  mariadb -uroot -h127.0.0.1 -P"$MYSQL_PORT" -e 'CREATE DATABASE IF NOT EXISTS test'
  galera_up
  # Redis without persistence.
  port_open "$REDIS_PORT" || { redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no \
    --dir "$STATE" --logfile "$STATE/redis.log" --pidfile "$STATE/redis.pid"; wait_port "$REDIS_PORT" 15 redis; }
  redis_cluster_up
  # RabbitMQ (takes 10-20 s to boot) with AMQP 1.0 and its TLS listener: rabbitmq_up in tls.sh.
  tls_pki
  rabbitmq_up
  # Mosquitto dies silently without /run/mosquitto.
  port_open "$MQTT_PORT" || { $SUDO install -d -o mosquitto -g mosquitto /run/mosquitto
    $SUDO mosquitto -d -c /etc/mosquitto/mosquitto.conf; wait_port "$MQTT_PORT" 15 mosquitto; }
  # NATS with JetStream (needs a writable store directory).
  port_open "$NATS_PORT" || { mkdir -p "$STATE/nats"
    start-stop-daemon --start --oknodo --background --make-pidfile --pidfile "$STATE/nats.pid" \
      --exec "$(command -v nats-server)" -- -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$STATE/nats" -l "$STATE/nats.log"
    wait_port "$NATS_PORT" 15 nats; }
  # Kafka protocol: tansu. A missing one is built in the background (minutes of compiling) while
  # the rest comes up and CI builds the workspace; the Kafka tests wait for its port (see
  # kafka_background).
  if ! port_open "$KAFKA_PORT"; then
    if tansu_current; then kafka_up
    else kafka_background; fi
  fi
  # --- cosmosdb-server (idem-cosmos wire tests) -------------------------------------------------
  # @vercel/cosmosdb-server: the Cosmos DB REST API in Node, in memory, HTTPS with its own
  # self-signed certificate, on loopback. It checks no auth and its batches are NOT atomic: tests
  # claim neither from it. npm-installed once per machine into ~/.cache (needs node >= 20).
  port_open "$COSMOS_PORT" || { local cosmos_dir=$HOME/.cache/idem-cosmosdb-server
    local cosmos_pkg=$cosmos_dir/node_modules/@vercel/cosmosdb-server
    if ! grep -qs "\"version\": \"$COSMOSDB_SERVER_VERSION\"" "$cosmos_pkg/package.json"; then
      if ! command -v npm >/dev/null; then
        log "installing: nodejs npm"; export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >"$STATE/apt-node.log" 2>&1 || { tail -20 "$STATE/apt-node.log"; exit 1; }
      fi
      log "installing @vercel/cosmosdb-server@$COSMOSDB_SERVER_VERSION into $cosmos_dir"
      mkdir -p "$cosmos_dir"
      npm install --prefix "$cosmos_dir" --no-audit --no-fund --save-exact "@vercel/cosmosdb-server@$COSMOSDB_SERVER_VERSION" \
        >"$STATE/cosmosdb-server-install.log" 2>&1 || { tail -20 "$STATE/cosmosdb-server-install.log"; exit 1; }
    fi
    nohup setsid node "$cosmos_pkg/lib/cli.js" --host 127.0.0.1 -p "$COSMOS_PORT" \
      >"$STATE/cosmosdb-server.log" 2>&1 </dev/null &
    wait_port "$COSMOS_PORT" 30 cosmosdb-server; }
  # --- end cosmosdb-server ----------------------------------------------------------------------
  tls_nats_keys
  tls_up
  log "all services ready"
}

# Redis Cluster: three masters without replicas on REDIS_CLUSTER_PORT..+2 (Debian's redis-server
# with --cluster-enabled yes), no persistence, `noeviction`. The store's cluster tests and the
# cluster benchmark use it; the failover test starts a private 3 + 3 cluster of its own.
redis_cluster_up() {
  local i p nodes=() dir
  for i in 0 1 2; do
    p=$((REDIS_CLUSTER_PORT + i)); nodes+=("127.0.0.1:$p"); dir=$STATE/redis-cluster/$p
    port_open "$p" && continue
    rm -rf "$dir"; mkdir -p "$dir"   # a fresh node: a stale nodes.conf would name old peers
    redis-server --daemonize yes --bind 127.0.0.1 --port "$p" --cluster-enabled yes \
      --cluster-config-file "$dir/nodes.conf" --cluster-node-timeout 2000 --save '' --appendonly no \
      --maxmemory-policy noeviction --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid"
    wait_port "$p" 15 "redis-cluster node"
  done
  if redis-cli -p "$REDIS_CLUSTER_PORT" cluster info 2>/dev/null | grep -q 'cluster_state:ok' \
     && [[ $(redis-cli -p "$REDIS_CLUSTER_PORT" cluster info | tr -d '\r' | sed -n 's/^cluster_known_nodes://p') == 3 ]]; then
    return 0
  fi
  # Not one healthy 3-node cluster: reset every node and create it.
  for n in "${nodes[@]}"; do
    redis-cli -p "${n##*:}" flushall >/dev/null 2>&1 || true
    redis-cli -p "${n##*:}" cluster reset hard >/dev/null
  done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$STATE/redis-cluster-create.log" 2>&1 \
    || { tail -20 "$STATE/redis-cluster-create.log"; exit 1; }
  for ((i = 0; i < 30; i++)); do
    local ok=0
    for n in "${nodes[@]}"; do redis-cli -p "${n##*:}" cluster info | grep -q 'cluster_state:ok' && ok=$((ok + 1)); done
    ((ok == 3)) && { log "redis-cluster ready on ${nodes[*]} (${i}s)"; return 0; }
    sleep 1
  done
  log "redis-cluster did not reach cluster_state:ok within 30s"; return 1
}

# --- Galera ---------------------------------------------------------------------------------------
# A 3-node MariaDB Galera cluster on loopback: Debian's galera-4 under three more mariadbd (the
# shared one on MYSQL_PORT is not touched). Node N (1..3): SQL on GALERA_PORT+N-1 (3311-3313),
# group communication on 4570+N, IST on 4580+N, rsync SST on 4590+N; datadir, socket, pid file and
# error log under $STATE/galera/N, reading only its own my.cnf. root with an empty password over
# TCP, database `test`. With no node in a primary component, node 1 bootstraps a new cluster
# (--wsrep-new-cluster) and the others join it by SST (rsync); a node restarted later catches up by
# IST. `restart galera-N` / `kill galera-N` / `stop galera-N` serve the node-failure tests.
galera_dir() { echo "$STATE/galera/$1"; }
galera_port() { echo $((GALERA_PORT + $1 - 1)); }
# shellcheck disable=SC2206   # $SUDO is empty or one word
galera_sql() { local n=$1; shift; local sql=($SUDO mariadb --defaults-file="$(galera_dir "$n")/my.cnf" -uroot -N -B); "${sql[@]}" "$@"; }
galera_status_var() { { galera_sql "$1" -e "SHOW GLOBAL STATUS LIKE '$2'" 2>/dev/null || true; } | cut -f2; }
galera_pid() { $SUDO cat "$(galera_dir "$1")/mysqld.pid" 2>/dev/null || true; }
galera_running() { local pid; pid=$(galera_pid "$1"); [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }

galera_cnf() {
  local n=$1 dir; dir=$(galera_dir "$1")
  $SUDO install -d -o mysql -g mysql -m 0750 "$dir"
  tls_put mysql 0644 "$dir/my.cnf" <<EOF || true
[mariadbd]
user = mysql
datadir = $dir/data
socket = $dir/mysqld.sock
pid-file = $dir/mysqld.pid
log-error = $dir/error.log
port = $(galera_port "$n")
bind-address = 127.0.0.1
innodb-buffer-pool-size = 32M
innodb-flush-log-at-trx-commit = 2
innodb-autoinc-lock-mode = 2
performance-schema = OFF
binlog-format = ROW
default-storage-engine = InnoDB
wsrep-on = ON
wsrep-provider = /usr/lib/galera/libgalera_smm.so
wsrep-cluster-name = idem-galera
wsrep-cluster-address = gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573
wsrep-node-name = galera-$n
wsrep-node-address = 127.0.0.1:$((4570 + n))
wsrep-provider-options = "gmcast.listen_addr=tcp://127.0.0.1:$((4570 + n));ist.recv_addr=127.0.0.1:$((4580 + n));gcache.size=64M;evs.suspect_timeout=PT3S;evs.inactive_timeout=PT6S;evs.install_timeout=PT3S"
wsrep-sst-method = rsync
wsrep-sst-receive-address = 127.0.0.1:$((4590 + n))
wsrep-slave-threads = 2
[client]
socket = $dir/mysqld.sock
EOF
}

# The last position node N committed, after a crash (its grastate.dat then says seqno -1): what
# Debian's galera_recovery finds with --wsrep-recover. Passed back as --wsrep-start-position, it
# lets the node catch up by IST instead of a full SST.
galera_recovered() {
  local dir; dir=$(galera_dir "$1")
  $SUDO grep -qs '^seqno: *-1' "$dir/data/grastate.dat" && $SUDO test -d "$dir/data/mysql" || return 0
  { $SUDO /usr/sbin/mariadbd --defaults-file="$dir/my.cnf" --wsrep-recover --disable-log-error 2>&1 || true; } \
    | sed -n 's/.*WSREP: Recovered position: *//p' | tail -1
}

# Starts node N (extra arguments go to mariadbd) and waits until it is Synced.
galera_start() {
  local n=$1 dir i state pos; dir=$(galera_dir "$1"); shift
  pos=$(galera_recovered "$n")
  [[ -n $pos ]] && { log "galera-$n recovered position $pos"; set -- "$@" "--wsrep-start-position=$pos"; }
  $SUDO start-stop-daemon --start --oknodo --background --pidfile "$dir/mysqld.pid" \
    --exec /usr/sbin/mariadbd -- --defaults-file="$dir/my.cnf" "$@"
  # A joiner opens its port only after its state transfer; then wait for Synced.
  for ((i = 0; i < 600; i++)); do
    state=$(galera_status_var "$n" wsrep_local_state_comment)
    [[ $state == Synced ]] && { log "galera-$n synced on :$(galera_port "$n") ($((i / 5))s)"; return 0; }
    sleep 0.2
  done
  log "galera-$n not Synced within 120s (state '${state:-down}'); see $dir/error.log"; return 1
}

# Sends node N SIGTERM (a clean shutdown; the default) or SIGKILL (a crash) and waits until it is
# gone.
galera_stop() {
  local n=$1 sig=${2:-TERM} pid i; pid=$(galera_pid "$n")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill "-$sig" "$pid"
  for ((i = 0; i < 600; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  log "galera-$n (pid $pid) still alive 60s after SIG$sig"; return 1
}

galera_up() {
  local n t0=$SECONDS primary=0
  [[ -e /usr/lib/galera/libgalera_smm.so ]] && command -v rsync >/dev/null || {
    log "installing: galera-4 rsync"; export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends galera-4 rsync >"$STATE/apt-galera.log" 2>&1 \
      || { tail -20 "$STATE/apt-galera.log"; exit 1; }; }
  for n in 1 2 3; do
    galera_cnf "$n"
    [[ $(galera_status_var "$n" wsrep_cluster_status) == Primary ]] && primary=1
  done
  if ((primary == 0)); then
    # No cluster to join: whatever runs is stopped, node 1 starts a new one from its data and
    # the others are sent a full copy (their grastate.dat says nothing the new cluster knows).
    for n in 1 2 3; do galera_stop "$n" TERM; done
    if ! $SUDO test -d "$(galera_dir 1)/data/mysql"; then
      $SUDO mariadb-install-db --defaults-file="$(galera_dir 1)/my.cnf" --auth-root-authentication-method=normal \
        --skip-test-db >"$STATE/galera-install.log" 2>&1 || { tail -20 "$STATE/galera-install.log"; exit 1; }
    fi
    $SUDO sed -i 's/^safe_to_bootstrap: 0/safe_to_bootstrap: 1/' "$(galera_dir 1)/data/grastate.dat" 2>/dev/null || true
    $SUDO rm -f "$(galera_dir 2)/data/grastate.dat" "$(galera_dir 3)/data/grastate.dat"
    galera_start 1 --wsrep-new-cluster
  fi
  for n in 1 2 3; do
    galera_running "$n" && [[ $(galera_status_var "$n" wsrep_local_state_comment) == Synced ]] && continue
    galera_stop "$n" TERM
    $SUDO install -d -o mysql -g mysql -m 0750 "$(galera_dir "$n")/data"
    galera_start "$n"
  done
  # root over TCP as on the shared server; users and databases replicate (as statements).
  mariadb -uroot -h127.0.0.1 -P"$GALERA_PORT" -e 'select 1' >/dev/null 2>&1 \
    || galera_sql 1 -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD(''); FLUSH PRIVILEGES;"
  galera_sql 1 -e 'CREATE DATABASE IF NOT EXISTS test'
  log "galera: $(galera_status_var 1 wsrep_cluster_size) nodes on :$GALERA_PORT-:$((GALERA_PORT + 2)) ($((SECONDS - t0))s)"
}
# --- end Galera -----------------------------------------------------------------------------------

# Stops and starts one shared server the way an operator would, then waits for it to answer.
restart() {
  local t0=$SECONDS
  case "${1:-}" in
    postgres)
      local v; v=$(ls /etc/postgresql | sort -V | tail -1)
      $SUDO pg_ctlcluster --skip-systemctl-redirect "$v" main restart -m fast
      wait_port "$PG_PORT" 30 postgres ;;
    mariadb)
      # `shutdown` returns before the process is gone; a start before then is refused.
      local pid i; pid=$($SUDO cat "$MARIADB_PID" 2>/dev/null || true)
      mariadb-admin -uroot -h127.0.0.1 -P"$MYSQL_PORT" shutdown
      for ((i = 0; i < 300; i++)); do [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      $SUDO install -d -o mysql -g mysql /run/mysqld
      $SUDO start-stop-daemon --start --oknodo --background --pidfile "$MARIADB_PID" --exec /usr/sbin/mariadbd -- --user=mysql
      wait_port "$MYSQL_PORT" 60 mariadb ;;
    rabbitmq)
      $SUDO rabbitmqctl -q stop_app && $SUDO rabbitmqctl -q start_app
      wait_port "$AMQP_PORT" 60 rabbitmq; wait_port "$AMQPS_PORT" 30 rabbitmq-tls ;;
    galera-[123])
      galera_stop "${1#galera-}" TERM
      galera_start "${1#galera-}" ;;
    *) echo "usage: $0 restart postgres|mariadb|rabbitmq|galera-1|galera-2|galera-3" >&2; exit 64 ;;
  esac
  log "$1 restarted in $((SECONDS - t0))s"
}

case "${1:-}" in
  up) up ;;
  status) status ;;
  restart) restart "${2:-}" ;;
  galera) galera_up ;;
  kafka-background) kafka_background_run ;;
  wait-kafka) kafka_wait ;;
  kill | stop)
    [[ ${2:-} == galera-[123] ]] || { echo "usage: $0 $1 galera-1|galera-2|galera-3" >&2; exit 64; }
    t0=$SECONDS
    if [[ $1 == kill ]]; then galera_stop "${2#galera-}" KILL; else galera_stop "${2#galera-}" TERM; fi
    log "$2 gone after $1 in $((SECONDS - t0))s" ;;
  *) echo "usage: $0 up|status|restart <service>|galera|wait-kafka|kill <galera-N>|stop <galera-N>" >&2; exit 64 ;;
esac
