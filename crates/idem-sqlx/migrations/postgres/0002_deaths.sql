-- idem dedup records: the deaths count (postgres). Generated from the store's migrate(); default names.
ALTER TABLE "idem"."idem_records" ADD COLUMN IF NOT EXISTS deaths BIGINT NOT NULL DEFAULT 0;
