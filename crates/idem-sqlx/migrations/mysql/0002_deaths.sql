-- idem dedup records: the deaths count (mysql). Generated from the store's migrate(); default names.
ALTER TABLE `idem_records` ADD COLUMN deaths BIGINT NOT NULL DEFAULT 0 AFTER expires_at;
