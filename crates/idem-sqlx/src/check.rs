//! What every SQL store's startup check compares: the columns its table must have.

use idem_core::StoreError;

use crate::row::COLUMNS;

/// [`StoreError::NotMigrated`] when `found` (the table's column names, as the database lists
/// them) is empty — no such table — or lacks one of the record columns or of `extra`.
pub(crate) fn unmigrated(
    table: String,
    found: &[String],
    extra: &[&str],
    migrate: &'static str,
) -> Option<StoreError> {
    let problem = if found.is_empty() {
        "does not exist".to_owned()
    } else {
        let missing: Vec<&str> = COLUMNS
            .split(',')
            .map(str::trim)
            .chain(extra.iter().copied())
            .filter(|c| !found.iter().any(|f| f.eq_ignore_ascii_case(c)))
            .collect();
        if missing.is_empty() {
            return None;
        }
        format!("lacks the columns {} (it was not created by this version)", missing.join(", "))
    };
    Some(StoreError::NotMigrated { table, problem, migrate })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<String> {
        COLUMNS.split(',').map(|c| c.trim().to_owned()).collect()
    }

    #[test]
    fn a_table_with_every_column_passes_and_a_missing_one_is_named() {
        assert!(unmigrated("t".into(), &all(), &[], "migrate()").is_none());
        let e = unmigrated("t".into(), &all(), &["owner"], "migrate()").expect("owner missing");
        assert!(e.to_string().contains("lacks the columns owner"), "{e}");
        let mut upper: Vec<String> = all().iter().map(|c| c.to_uppercase()).collect();
        assert!(unmigrated("t".into(), &upper, &[], "m").is_none(), "names compare without case");
        upper.retain(|c| c != "TOKEN" && c != "EXPIRES_AT");
        let e = unmigrated("t".into(), &upper, &[], "m").expect("two missing");
        assert!(e.to_string().contains("lacks the columns token, expires_at"), "{e}");
    }

    #[test]
    fn no_columns_is_no_table() {
        let e = unmigrated("\"s\".\"t\"".into(), &[], &[], "PostgresStore::migrate()").unwrap();
        assert_eq!(
            e.to_string(),
            "table \"s\".\"t\" does not exist: run PostgresStore::migrate() once (or apply the \
             DDL it runs) before starting a consumer"
        );
    }
}
