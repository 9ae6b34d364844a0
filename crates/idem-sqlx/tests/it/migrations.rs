//! The DDL shipped under `migrations/<db>/` is exactly what `migrate()` runs (default names):
//! `0001_idem.sql` the tables as first shipped (never changed, so a migration tool that applied
//! it keeps its checksum), `0002_deaths.sql` the column the crash-loop count added.
//! Regenerate with `IDEM_WRITE_MIGRATIONS=1 cargo test -p idem-sqlx --all-features --test it migrations::`.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing
#![cfg(all(feature = "postgres", feature = "mysql", feature = "sqlite"))]

use std::path::Path;

fn check(db: &str, ddl: String) {
    // The second step is the statement that adds `deaths`; the first, everything before it.
    let at = ddl.find("ALTER TABLE").expect("the deaths step");
    let steps = [
        ("0001_idem.sql", "idem dedup records", &ddl[..at]),
        ("0002_deaths.sql", "idem dedup records: the deaths count", &ddl[at..]),
    ];
    for (file, what, sql) in steps {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("migrations/{db}/{file}"));
        let text = format!(
            "-- {what} ({db}). Generated from the store's migrate(); default names.\n{sql}"
        );
        if std::env::var_os("IDEM_WRITE_MIGRATIONS").is_some() {
            std::fs::write(&path, &text).unwrap();
        }
        let shipped = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(
            shipped,
            text,
            "{} is stale: regenerate it (see this file's header)",
            path.display()
        );
    }
}

#[tokio::test]
async fn shipped_migrations_match_the_code() {
    let pg =
        sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://localhost/none").unwrap();
    check("postgres", idem_sqlx::PostgresStore::new(pg).schema_sql());
    let my = sqlx::mysql::MySqlPoolOptions::new().connect_lazy("mysql://localhost/none").unwrap();
    check("mysql", idem_sqlx::MySqlStore::new(my).schema_sql());
    let lite = sqlx::sqlite::SqlitePoolOptions::new().connect_lazy("sqlite::memory:").unwrap();
    check("sqlite", idem_sqlx::SqliteStore::new(lite).schema());
}
