-- idem dedup records (postgres). Generated from the store's migrate(); default names.
CREATE SCHEMA IF NOT EXISTS "idem";
CREATE TABLE IF NOT EXISTS "idem"."idem_records" (key_hash BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(key_hash) = 32), scope TEXT NOT NULL, key_id TEXT NOT NULL, state BIGINT NOT NULL, fingerprint BYTEA, result BYTEA, attempt BIGINT NOT NULL, token BIGINT NOT NULL, prev_state BIGINT, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL, lease_until BIGINT, expires_at BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS "idem_records_expires_at" ON "idem"."idem_records" (expires_at);
CREATE TABLE IF NOT EXISTS "idem"."idem_records_versions" (entity_hash BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(entity_hash) = 32), scope TEXT NOT NULL, entity_id TEXT NOT NULL, version BIGINT NOT NULL, updated_at BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS "idem"."idem_records_positions" (scope TEXT NOT NULL, log TEXT NOT NULL, part INTEGER NOT NULL, next_offset BIGINT, PRIMARY KEY (scope, log, part));
