#!/usr/bin/env bash
# The environment every test step runs in: CI=true (a missing server fails a test, never skips
# it), each service's address with its loopback default, and the shared target dir. Sourced by
# .ci/run and .ci/repeat.sh, so a repeated test sees what CI gives it.
# shellcheck disable=SC2034
export CI=true   # integration tests fail, never skip, when their server is missing
PG_PORT=${PG_PORT:-5432}; MYSQL_PORT=${MYSQL_PORT:-3306}; REDIS_PORT=${REDIS_PORT:-6379}
AMQP_PORT=${AMQP_PORT:-5672}; NATS_PORT=${NATS_PORT:-4222}; KAFKA_PORT=${KAFKA_PORT:-9092}
COSMOS_PORT=${COSMOS_PORT:-8081}; REDIS_CLUSTER_PORT=${REDIS_CLUSTER_PORT:-7000}
export IDEM_TEST_POSTGRES_URL=${IDEM_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:$PG_PORT/test}
export IDEM_TEST_MYSQL_URL=${IDEM_TEST_MYSQL_URL:-mysql://root@127.0.0.1:$MYSQL_PORT/test}
export IDEM_TEST_REDIS_URL=${IDEM_TEST_REDIS_URL:-redis://127.0.0.1:$REDIS_PORT/}
export IDEM_TEST_REDIS_CLUSTER_URLS=${IDEM_TEST_REDIS_CLUSTER_URLS:-redis://127.0.0.1:$REDIS_CLUSTER_PORT/,redis://127.0.0.1:$((REDIS_CLUSTER_PORT + 1))/,redis://127.0.0.1:$((REDIS_CLUSTER_PORT + 2))/}
export IDEM_TEST_AMQP_URL=${IDEM_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f}
export IDEM_TEST_NATS_URL=${IDEM_TEST_NATS_URL:-127.0.0.1:$NATS_PORT}
export IDEM_TEST_KAFKA_BROKERS=${IDEM_TEST_KAFKA_BROKERS:-127.0.0.1:$KAFKA_PORT}
# The 3-node MariaDB Galera cluster .ci/services.sh starts (3311-3313).
GALERA_PORT=${GALERA_PORT:-3311}
export IDEM_TEST_GALERA_URLS=${IDEM_TEST_GALERA_URLS:-mysql://root@127.0.0.1:$GALERA_PORT/test,mysql://root@127.0.0.1:$((GALERA_PORT + 1))/test,mysql://root@127.0.0.1:$((GALERA_PORT + 2))/test}
export IDEM_TEST_COSMOS_SERVER_URL=${IDEM_TEST_COSMOS_SERVER_URL:-https://127.0.0.1:$COSMOS_PORT/}
# The TLS listeners and their throw-away PKI (.ci/tls.sh); clients connect as `localhost`.
export IDEM_TEST_TLS_DIR=${IDEM_TEST_TLS_DIR:-${IDEM_TLS_DIR:-${CI_STATE_DIR:-/tmp/idem-ci}/tls}}
export IDEM_TEST_POSTGRES_TLS_URL=${IDEM_TEST_POSTGRES_TLS_URL:-postgres://postgres@localhost:${PG_TLS_PORT:-5433}/test}
export IDEM_TEST_MYSQL_TLS_URL=${IDEM_TEST_MYSQL_TLS_URL:-mysql://root@localhost:${MYSQL_TLS_PORT:-3307}/test}
export IDEM_TEST_REDIS_TLS_URL=${IDEM_TEST_REDIS_TLS_URL:-rediss://localhost:${REDIS_TLS_PORT:-6380}/}
export IDEM_TEST_REDIS_MTLS_URL=${IDEM_TEST_REDIS_MTLS_URL:-rediss://localhost:${REDIS_MTLS_PORT:-6381}/}
export IDEM_TEST_AMQPS_URL=${IDEM_TEST_AMQPS_URL:-amqps://guest:guest@localhost:${AMQPS_PORT:-5671}/%2f}
export IDEM_TEST_AMQP10S_URL=${IDEM_TEST_AMQP10S_URL:-amqps://guest:guest@localhost:${AMQPS_PORT:-5671}}
export IDEM_TEST_NATS_TLS_URL=${IDEM_TEST_NATS_TLS_URL:-tls://localhost:${NATS_TLS_PORT:-4223}}
export IDEM_TEST_NATS_CREDS_URL=${IDEM_TEST_NATS_CREDS_URL:-tls://localhost:${NATS_CREDS_PORT:-4224}}
export IDEM_TEST_NATS_MTLS_URL=${IDEM_TEST_NATS_MTLS_URL:-tls://localhost:${NATS_MTLS_PORT:-4225}}
export IDEM_TEST_KAFKA_TLS_BROKERS=${IDEM_TEST_KAFKA_TLS_BROKERS:-localhost:${KAFKA_TLS_PORT:-9093}}
# CI runs on the machine of the session that submitted: a target dir outside the clone lets it
# reuse that build instead of compiling every dependency cold.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target} CARGO_TERM_COLOR=never
