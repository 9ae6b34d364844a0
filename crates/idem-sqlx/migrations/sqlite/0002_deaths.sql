-- idem dedup records: the deaths count (sqlite). Generated from the store's migrate(); default names.
ALTER TABLE idem_records ADD COLUMN deaths INTEGER NOT NULL DEFAULT 0;
