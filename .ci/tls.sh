# shellcheck shell=bash
# TLS listeners for idem's production-connection tests: sourced by .ci/services.sh, which documents
# the ports, users and files at its top. Every function here is idempotent: a listener that answers
# with the current certificates and configuration is left alone and logs one line.
TLS_DIR=${IDEM_TLS_DIR:-$STATE/tls}
PG_TLS_PORT=${PG_TLS_PORT:-5433}; MYSQL_TLS_PORT=${MYSQL_TLS_PORT:-3307}
REDIS_TLS_PORT=${REDIS_TLS_PORT:-6380}; REDIS_MTLS_PORT=${REDIS_MTLS_PORT:-6381}
AMQPS_PORT=${AMQPS_PORT:-5671}
NATS_TLS_PORT=${NATS_TLS_PORT:-4223}; NATS_CREDS_PORT=${NATS_CREDS_PORT:-4224}
NATS_MTLS_PORT=${NATS_MTLS_PORT:-4225}
KAFKA_TLS_PORT=${KAFKA_TLS_PORT:-9093}; KAFKA_TLS_BACKEND_PORT=${KAFKA_TLS_BACKEND_PORT:-19093}
TLS_TOOL=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tls-tool.py
PYTHON=/usr/bin/python3   # Debian's, with python3-cryptography (a pyenv/venv python may lack it)

# Runs a command as a system user (postgres, mysql) whether we are root or use sudo.
as_user() { local u=$1; shift; if [[ $(id -u) -eq 0 ]]; then runuser -u "$u" -- "$@"; else sudo -u "$u" -- "$@"; fi; }

# Writes stdin to PATH (owner USER, MODE) when it differs; returns 0 when it changed the file.
tls_put() {
  local tmp; tmp=$(mktemp); cat >"$tmp"
  if $SUDO cmp -s "$tmp" "$3"; then rm -f "$tmp"; return 1; fi
  $SUDO install -o "$1" -g "$1" -m "$2" "$tmp" "$3"; rm -f "$tmp"
}

# Copies ca.pem, server.pem and server.key into DIR owned by USER, for servers that run as their
# own user and want to own their key (PostgreSQL refuses a key others can read). Returns 0 when a
# file changed.
tls_copy() {
  local user=$1 dir=$2 f changed=1
  $SUDO install -d -o "$user" -g "$user" -m 0750 "$dir"
  for f in ca.pem server.pem server.key; do
    $SUDO cmp -s "$TLS_DIR/$f" "$dir/$f" && continue
    $SUDO install -o "$user" -g "$user" -m "$([[ $f == *.key ]] && echo 0600 || echo 0644)" "$TLS_DIR/$f" "$dir/$f"
    changed=0
  done
  return $changed
}

# A listener started from the TLS dir directly remembers the certificates and arguments it was
# started with: `tls_stale NAME ARGS...` is true when that stamp differs (then it is restarted).
tls_stamp() { { cat "$TLS_DIR/ca.pem" "$TLS_DIR/server.pem"; echo "$*"; } | sha256sum | cut -c1-16; }
tls_stale() { local name=$1; shift; [[ $(cat "$STATE/tls-stamps/$name" 2>/dev/null) != "$(tls_stamp "$@")" ]]; }
tls_stamp_save() { local name=$1; shift; mkdir -p "$STATE/tls-stamps"; tls_stamp "$@" >"$STATE/tls-stamps/$name"; }

# Stops the process in PIDFILE (if any) and waits until PORT is closed.
stop_pidfile() {
  local pid i; pid=$(cat "$1" 2>/dev/null || true)
  [[ -n $pid ]] && kill "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do port_open "$2" || return 0; sleep 0.1; done
  log "port $2 still open after stopping pid ${pid:-?}"; return 1
}

# --- PKI ------------------------------------------------------------------------------------------
# One throw-away CA signs a server certificate (CN localhost, SANs DNS:localhost, IP:127.0.0.1) and a
# client certificate (CN idem-client, clientAuth). An unrelated CA signs wrong-client.pem. Every
# listener also binds 127.0.0.2, which is NOT in the SANs: connecting there is the wrong-host case.
# EC P-256 keys in PKCS#8 PEM. Remade (all together) when a certificate is missing or expires
# within a day; the listeners pick the new ones up on this same run.
tls_pki() {
  local f ok=1
  for f in ca server client wrong-ca wrong-client; do
    openssl x509 -checkend 86400 -noout -in "$TLS_DIR/$f.pem" >/dev/null 2>&1 || ok=0
  done
  ((ok)) && return 0
  mkdir -p "$TLS_DIR"; chmod 0700 "$TLS_DIR"
  local d; d=$(mktemp -d "$TLS_DIR/.new.XXXXXX")
  ( umask 077; cd "$d"
    cat >x509.cnf <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
    key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key"; }
    ca() { key "$1"; openssl req -new -x509 -config x509.cnf -extensions ca -key "$1.key" -subj "/CN=$2" \
             -days 3650 -sha256 -out "$1.pem"; }
    leaf() { # name CN extensions issuer
      key "$1"; openssl req -new -config x509.cnf -key "$1.key" -subj "/CN=$2" -out "$1.csr"
      openssl x509 -req -in "$1.csr" -CA "$4.pem" -CAkey "$4.key" -set_serial "0x$(openssl rand -hex 15)" \
        -days 825 -sha256 -extfile x509.cnf -extensions "$3" -out "$1.pem" 2>/dev/null
    }
    ca ca "idem test CA"; ca wrong-ca "idem unrelated CA"
    leaf server localhost server ca; leaf client idem-client client ca
    leaf wrong-client idem-client client wrong-ca
    chmod 0644 ./*.pem ) >"$STATE/tls-pki.log" 2>&1 || { cat "$STATE/tls-pki.log"; rm -rf "$d"; exit 1; }
  for f in ca server client wrong-ca wrong-client; do mv "$d/$f.key" "$d/$f.pem" "$TLS_DIR/"; done
  rm -rf "$d"
  log "TLS PKI made in $TLS_DIR"
}

# NATS keys: user.nk (an nkey user's seed), user.creds (a user of an operator/account chain) and
# nats/operator.conf (the operator JWT and the account JWT for a MEMORY resolver). Kept across PKI
# renewals: they do not expire.
tls_nats_keys() {
  [[ -s $TLS_DIR/user.nk && -s $TLS_DIR/user.creds && -s $TLS_DIR/nats/operator.conf && -s $TLS_DIR/user.nk.pub ]] \
    || "$PYTHON" "$TLS_TOOL" nats-keys "$TLS_DIR"
}

# --- PostgreSQL -----------------------------------------------------------------------------------
# A private cluster (initdb) under $STATE/pg-tls, not registered with pg_ctlcluster, so the shared
# cluster on PG_PORT and its restart are untouched. hostssl lines only: a plaintext connect is
# refused. postgres (and any other role) by trust; idem_client only with a client certificate whose
# CN idem-client maps to it. fsync off: a throw-away server.
pg_tls_up() {
  local v bin dir=$STATE/pg-tls data restart=0
  v=$(ls /etc/postgresql | sort -V | tail -1); bin=/usr/lib/postgresql/$v/bin; data=$STATE/pg-tls/data
  if ! $SUDO test -s "$data/PG_VERSION"; then
    $SUDO rm -rf "$dir"; $SUDO install -d -o postgres -g postgres -m 0700 "$dir"
    as_user postgres "$bin/initdb" -D "$data" -U postgres -A trust -E UTF8 --locale=C.UTF-8 --no-sync \
      >"$STATE/pg-tls-initdb.log" 2>&1 || { tail -20 "$STATE/pg-tls-initdb.log"; exit 1; }
    echo "include 'idem-tls.conf'" | as_user postgres tee -a "$data/postgresql.conf" >/dev/null
  fi
  tls_copy postgres "$dir/tls" && restart=1
  tls_put postgres 0600 "$data/idem-tls.conf" <<EOF && restart=1
port = $PG_TLS_PORT
listen_addresses = 'localhost,127.0.0.2'
unix_socket_directories = '$dir'
ssl = on
ssl_ca_file = '$dir/tls/ca.pem'
ssl_cert_file = '$dir/tls/server.pem'
ssl_key_file = '$dir/tls/server.key'
shared_buffers = 32MB
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
  tls_put postgres 0600 "$data/pg_hba.conf" <<'EOF' && restart=1
local   all all                        trust
hostssl all idem_client 127.0.0.0/8    cert map=idem
hostssl all idem_client ::1/128        cert map=idem
hostssl all all         127.0.0.0/8    trust
hostssl all all         ::1/128        trust
EOF
  tls_put postgres 0600 "$data/pg_ident.conf" <<<'idem idem-client idem_client' && restart=1
  if port_open "$PG_TLS_PORT" && ((restart == 0)); then
    log "postgres-tls answers on :$PG_TLS_PORT"
  else
    port_open "$PG_TLS_PORT" && as_user postgres "$bin/pg_ctl" -D "$data" -m fast -s stop
    as_user postgres "$bin/pg_ctl" -D "$data" -l "$dir/postgres.log" -W -s start
    wait_port "$PG_TLS_PORT" 30 postgres-tls
  fi
  local psql=(as_user postgres psql -X -w -h "$dir" -p "$PG_TLS_PORT" -U postgres -Atq)
  [[ $("${psql[@]}" -d postgres -c "select count(*) from pg_database where datname = 'test'") == 1 ]] \
    || "${psql[@]}" -d postgres -c 'create database test'
  [[ $("${psql[@]}" -d test -c "select has_schema_privilege('idem_client', 'public', 'create')" 2>/dev/null) == t ]] \
    || "${psql[@]}" -d test -c "do \$\$ begin
         if not exists (select from pg_roles where rolname = 'idem_client') then create role idem_client login; end if;
       end \$\$" -c 'grant all on database test to idem_client' -c 'grant all on schema public to idem_client'
}

# --- MariaDB --------------------------------------------------------------------------------------
# A second mariadbd with its own datadir, socket and pid file under $STATE/mariadb-tls, reading only
# its own my.cnf (Debian's /etc/mysql is not read). require_secure_transport: plaintext TCP is
# refused (the unix socket, used for setup, counts as secure). root with an empty password over
# TCP as on the shared server; idem_client only with the client certificate (REQUIRE SUBJECT/ISSUER).
mariadb_tls_up() {
  local dir=$STATE/mariadb-tls restart=0
  $SUDO install -d -o mysql -g mysql -m 0750 "$dir"
  tls_copy mysql "$dir/tls" && restart=1
  tls_put mysql 0644 "$dir/my.cnf" <<EOF && restart=1
[mariadbd]
user = mysql
datadir = $dir/data
socket = $dir/mysqld.sock
pid-file = $dir/mysqld.pid
log-error = $dir/error.log
port = $MYSQL_TLS_PORT
bind-address = 127.0.0.1,127.0.0.2
ssl-ca = $dir/tls/ca.pem
ssl-cert = $dir/tls/server.pem
ssl-key = $dir/tls/server.key
require-secure-transport = ON
innodb-buffer-pool-size = 32M
innodb-flush-log-at-trx-commit = 2
performance-schema = OFF
[client]
socket = $dir/mysqld.sock
EOF
  if ! $SUDO test -d "$dir/data/mysql"; then
    $SUDO mariadb-install-db --defaults-file="$dir/my.cnf" --auth-root-authentication-method=normal \
      --skip-test-db >"$STATE/mariadb-tls-install.log" 2>&1 || { tail -20 "$STATE/mariadb-tls-install.log"; exit 1; }
  fi
  if port_open "$MYSQL_TLS_PORT" && ((restart == 0)); then
    log "mariadb-tls answers on :$MYSQL_TLS_PORT"
  else
    if port_open "$MYSQL_TLS_PORT"; then
      local pid i; pid=$($SUDO cat "$dir/mysqld.pid")
      $SUDO mariadb-admin --defaults-file="$dir/my.cnf" -uroot shutdown
      for ((i = 0; i < 300; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    $SUDO start-stop-daemon --start --oknodo --background --pidfile "$dir/mysqld.pid" \
      --exec /usr/sbin/mariadbd -- --defaults-file="$dir/my.cnf"
    wait_port "$MYSQL_TLS_PORT" 60 mariadb-tls
  fi
  # shellcheck disable=SC2206   # $SUDO is empty or one word
  local sql=($SUDO mariadb --defaults-file="$dir/my.cnf" -uroot -N -B)
  [[ $("${sql[@]}" -e "select (select count(*) from mysql.global_priv where user = 'idem_client')
                            + (select count(*) from information_schema.schemata where schema_name = 'test')") == 2 ]] \
    || "${sql[@]}" -e "DELETE FROM mysql.global_priv WHERE user = '';
      ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('');
      CREATE DATABASE IF NOT EXISTS test;
      CREATE USER IF NOT EXISTS 'idem_client'@'%' REQUIRE SUBJECT '/CN=idem-client' AND ISSUER '/CN=idem test CA';
      GRANT ALL ON test.* TO 'idem_client'@'%'; FLUSH PRIVILEGES;"
}

# --- Redis ----------------------------------------------------------------------------------------
# TLS only (--port 0), no persistence. REDIS_TLS_PORT: a client certificate is optional;
# REDIS_MTLS_PORT: required. `-::1`: bind IPv6 loopback where there is one.
redis_tls_up() {
  local name=$1 port=$2 auth=$3 dir=$STATE/redis-tls/$2 args
  args=(--bind 127.0.0.1 127.0.0.2 -::1 --port 0 --tls-port "$port" --tls-cert-file "$TLS_DIR/server.pem"
        --tls-key-file "$TLS_DIR/server.key" --tls-ca-cert-file "$TLS_DIR/ca.pem" --tls-auth-clients "$auth"
        --save '' --appendonly no --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid")
  if port_open "$port"; then
    tls_stale "redis-$port" "${args[@]}" || { log "$name answers on :$port"; return 0; }
    stop_pidfile "$dir/redis.pid" "$port"
  fi
  mkdir -p "$dir"
  redis-server --daemonize yes "${args[@]}"
  wait_port "$port" 15 "$name"
  tls_stamp_save "redis-$port" "${args[@]}"
}

# --- NATS -----------------------------------------------------------------------------------------
# Three servers, all TLS (NATS sends INFO in plaintext, then the client upgrades; 2.9 has no
# TLS-first handshake). They listen on 0.0.0.0 (one address per server; 127.0.0.2 is the
# wrong-host case) and all of them authenticate every client:
#   NATS_TLS_PORT    nkey user (user.nk), JetStream;      NATS_CREDS_PORT  operator mode, user.creds,
#   NATS_MTLS_PORT   client certificate required (verify: true), no other auth.
nats_tls_up() {
  local port=$1 name=$2 body=$3 dir=$STATE/nats-tls/$1 conf
  conf="listen: \"0.0.0.0:$port\"
server_name: idem-$name-$port
pid_file: \"$dir/nats.pid\"
tls { cert_file: \"$TLS_DIR/server.pem\", key_file: \"$TLS_DIR/server.key\", ca_file: \"$TLS_DIR/ca.pem\", $4 }
$body"
  if port_open "$port"; then
    tls_stale "nats-$port" "$conf" || { log "$name answers on :$port"; return 0; }
    stop_pidfile "$dir/nats.pid" "$port"
  fi
  mkdir -p "$dir"; printf '%s\n' "$conf" >"$dir/nats.conf"
  start-stop-daemon --start --oknodo --background --pidfile "$dir/nats.pid" \
    --exec "$(command -v nats-server)" -- -c "$dir/nats.conf" -l "$dir/nats.log"
  wait_port "$port" 15 "$name"
  tls_stamp_save "nats-$port" "$conf"
}

nats_tls_all_up() {
  local js="jetstream { store_dir: \"$STATE/nats-tls/%s/js\" }"
  # shellcheck disable=SC2059
  nats_tls_up "$NATS_TLS_PORT" nats-tls "$(printf "$js" "$NATS_TLS_PORT")
authorization { users: [ { nkey: $(cat "$TLS_DIR/user.nk.pub") } ] }" "verify: false"
  # shellcheck disable=SC2059
  nats_tls_up "$NATS_CREDS_PORT" nats-creds "$(printf "$js" "$NATS_CREDS_PORT")
$(cat "$TLS_DIR/nats/operator.conf")" "verify: false"
  nats_tls_up "$NATS_MTLS_PORT" nats-mtls "" "verify: true"
}

# --- Kafka ----------------------------------------------------------------------------------------
# tansu 0.6.0 takes --cert/--key but never wraps a connection in TLS (tansu-broker-0.6.0
# src/broker.rs:268 builds `_acceptor` and drops it; line 301 serves the raw TcpStream). So a
# second in-memory tansu listens in plaintext on 127.0.0.1:KAFKA_TLS_BACKEND_PORT, advertises
# localhost:KAFKA_TLS_PORT, and socat terminates TLS on KAFKA_TLS_PORT (127.0.0.1 and 127.0.0.2) in
# front of it: Kafka clients see a TLS-only broker. No client certificate is asked for.
kafka_tls_up() {
  local tansu dir=$STATE/kafka-tls a args started=0
  tansu=$(command -v tansu || echo "$HOME/.cargo/bin/tansu")
  # While tansu builds in the background, kafka_background starts this listener after it.
  [[ -x $tansu ]] || { log "kafka-tls: follows kafka, once tansu is built"; return 0; }
  mkdir -p "$dir"
  if ! port_open "$KAFKA_TLS_BACKEND_PORT"; then
    nohup setsid "$tansu" broker --listener-url "tcp://127.0.0.1:$KAFKA_TLS_BACKEND_PORT" \
      --advertised-listener-url "tcp://localhost:$KAFKA_TLS_PORT" --storage-engine memory://tansu/ \
      >"$dir/tansu.log" 2>&1 </dev/null &
    echo $! >"$dir/tansu.pid"; started=1
    wait_port "$KAFKA_TLS_BACKEND_PORT" 30 "kafka-tls backend (tansu)" >/dev/null \
      || { tail -5 "$dir/tansu.log"; exit 1; }
  fi
  for a in 127.0.0.1 127.0.0.2; do
    args="OPENSSL-LISTEN:$KAFKA_TLS_PORT,bind=$a,reuseaddr,fork,cert=$TLS_DIR/server.pem,key=$TLS_DIR/server.key,verify=0"
    if timeout 1 bash -c "exec 3<>/dev/tcp/$a/$KAFKA_TLS_PORT" 2>/dev/null; then
      tls_stale "kafka-$a" "$args" || continue
      stop_pidfile "$dir/socat-$a.pid" "$KAFKA_TLS_PORT" || true
    fi
    nohup setsid socat -lf "$dir/socat-$a.log" "$args" "TCP:127.0.0.1:$KAFKA_TLS_BACKEND_PORT" </dev/null >/dev/null 2>&1 &
    echo $! >"$dir/socat-$a.pid"; started=1
    tls_stamp_save "kafka-$a" "$args"
  done
  if ((started)); then wait_port "$KAFKA_TLS_PORT" 15 "kafka-tls (tansu behind socat)"
  else log "kafka-tls answers on :$KAFKA_TLS_PORT"; fi
}

# --- RabbitMQ -------------------------------------------------------------------------------------
# The one node serves AMQP 0-9-1 and 1.0 in plaintext on AMQP_PORT and over TLS on AMQPS_PORT. A
# client certificate logs in with SASL EXTERNAL as its CN (idem-client, no password). Our settings
# live between two marker lines of /etc/rabbitmq/rabbitmq.conf; a change there (or new
# certificates) restarts the node, which takes 10-20 s; otherwise nothing is restarted.
rabbitmq_up() {
  local conf=/etc/rabbitmq/rabbitmq.conf dir=/etc/rabbitmq/idem-tls changed=0 p missing=() started=0
  local begin='# BEGIN idem-tls, written by services.sh' end='# END idem-tls'
  tls_copy rabbitmq "$dir" && changed=1
  { $SUDO sed "/^$begin\$/,/^$end\$/d" "$conf" 2>/dev/null || true
    cat <<EOF
$begin
listeners.ssl.1 = 127.0.0.1:$AMQPS_PORT
listeners.ssl.2 = 127.0.0.2:$AMQPS_PORT
ssl_options.cacertfile = $dir/ca.pem
ssl_options.certfile = $dir/server.pem
ssl_options.keyfile = $dir/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
$end
EOF
  } | tls_put root 0644 "$conf" && changed=1
  # AMQP 1.0 (the Service Bus protocol) on the same ports: RabbitMQ 3.10 bundles the plugin.
  for p in rabbitmq_amqp1_0 rabbitmq_auth_mechanism_ssl; do
    $SUDO grep -qs "$p" /etc/rabbitmq/enabled_plugins || missing+=("$p")
  done
  if ! port_open "$AMQP_PORT"; then
    rabbitmq_plugins --offline "${missing[@]}"
    $SUDO rabbitmq-server -detached; started=1
  elif ((changed)) || ! port_open "$AMQPS_PORT"; then
    rabbitmq_plugins --offline "${missing[@]}"
    log "rabbitmq: restarting the node for its TLS listener"
    $SUDO rabbitmqctl -q stop
    local i; for ((i = 0; i < 100; i++)); do port_open "$AMQP_PORT" || break; sleep 0.2; done
    $SUDO rabbitmq-server -detached; started=1
  else
    rabbitmq_plugins --online "${missing[@]}"
  fi
  if ((started)); then
    wait_port "$AMQP_PORT" 120 rabbitmq; wait_port "$AMQPS_PORT" 30 rabbitmq-tls
  else
    log "rabbitmq-tls answers on :$AMQPS_PORT"
  fi
  # The certificate's user: no password (EXTERNAL only), everything on vhost /. The marker spares a
  # warm run the 1-2 s of each rabbitmqctl call.
  [[ -f $STATE/rabbitmq-idem-client ]] && return 0
  $SUDO rabbitmqctl -q list_users | grep -q '^idem-client\b' || {
    $SUDO rabbitmqctl -q add_user idem-client "$(openssl rand -hex 16)" >/dev/null
    $SUDO rabbitmqctl -q clear_password idem-client >/dev/null; }
  $SUDO rabbitmqctl -q set_permissions -p / idem-client '.*' '.*' '.*' >/dev/null
  touch "$STATE/rabbitmq-idem-client"
}

rabbitmq_plugins() {
  local mode=$1; shift
  (($#)) || return 0
  $SUDO rabbitmq-plugins enable "$mode" "$@" >"$STATE/rabbitmq-plugins.log" 2>&1 \
    || { tail -5 "$STATE/rabbitmq-plugins.log"; exit 1; }
}

# Everything on top of the plaintext services, RabbitMQ's TLS listener aside (rabbitmq_up).
tls_up() {
  pg_tls_up
  mariadb_tls_up
  redis_tls_up redis-tls "$REDIS_TLS_PORT" optional
  redis_tls_up redis-mtls "$REDIS_MTLS_PORT" yes
  nats_tls_all_up
  kafka_tls_up
}

tls_status() {
  local bad=0 pair name port
  for pair in "postgres-tls:$PG_TLS_PORT" "mariadb-tls:$MYSQL_TLS_PORT" "redis-tls:$REDIS_TLS_PORT" \
              "redis-mtls:$REDIS_MTLS_PORT" "rabbitmq-tls:$AMQPS_PORT" "nats-tls:$NATS_TLS_PORT" \
              "nats-creds:$NATS_CREDS_PORT" "nats-mtls:$NATS_MTLS_PORT" "kafka-tls:$KAFKA_TLS_PORT"; do
    name=${pair%%:*}; port=${pair##*:}
    if port_open "$port"; then log "$name answers on 127.0.0.1:$port"; else log "$name DOES NOT answer on 127.0.0.1:$port"; bad=1; fi
  done
  return $bad
}
