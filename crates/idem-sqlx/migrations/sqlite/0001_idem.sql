-- idem dedup records (sqlite). Generated from the store's migrate(); default names.
CREATE TABLE IF NOT EXISTS idem_records (key_hash BLOB NOT NULL PRIMARY KEY CHECK (length(key_hash) = 32), scope TEXT NOT NULL, key_id TEXT NOT NULL, state INTEGER NOT NULL, fingerprint BLOB, result BLOB, attempt INTEGER NOT NULL, token INTEGER NOT NULL, prev_state INTEGER, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, lease_until INTEGER, expires_at INTEGER NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at);
CREATE TABLE IF NOT EXISTS idem_records_versions (entity_hash BLOB NOT NULL PRIMARY KEY CHECK (length(entity_hash) = 32), scope TEXT NOT NULL, entity_id TEXT NOT NULL, version INTEGER NOT NULL, updated_at INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS idem_records_positions (scope TEXT NOT NULL, log TEXT NOT NULL, part INTEGER NOT NULL, next_offset INTEGER, PRIMARY KEY (scope, log, part)) WITHOUT ROWID;
