//! Test support: SQLite rows holding any value of any type in any column, for the decoders'
//! property tests. SQLite keeps whatever type was written, so a row can really come back
//! like this.

// Without SQLite only the configuration is used.
#![cfg_attr(not(feature = "sqlite"), allow(dead_code))]

use proptest::prelude::*;
use proptest::test_runner::Config;
#[cfg(feature = "sqlite")]
use {
    proptest::test_runner::{TestCaseError, TestRunner},
    sqlx::sqlite::{SqliteConnection, SqliteRow},
    sqlx::{AssertSqlSafe, Connection},
    std::cell::RefCell,
};

/// Cases per property in this crate.
pub(crate) const CASES: u32 = 512;

/// [`CASES`] cases and no `proptest-regressions/` files (failures become named tests).
pub(crate) fn config() -> Config {
    Config { cases: CASES, failure_persistence: None, ..Config::default() }
}

/// One SQLite value.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

impl Cell {
    /// The bytes of a blob, or of a text (the driver reads a text's UTF-8 as bytes, which is
    /// what it holds).
    pub(crate) fn bytes(&self) -> Option<Vec<u8>> {
        match self {
            Cell::Blob(b) => Some(b.clone()),
            Cell::Text(s) => Some(s.as_bytes().to_vec()),
            _ => None,
        }
    }
}

/// Any value, biased towards domain edges: small and huge integers, integral and fractional
/// reals (finite: SQLite stores NaN as NULL), short texts, 32-byte and other blobs.
pub(crate) fn any_cell() -> impl Strategy<Value = Cell> {
    prop_oneof![
        Just(Cell::Null),
        prop_oneof![any::<i64>(), -2i64..6, Just(i64::from(u32::MAX) + 1)].prop_map(Cell::Int),
        prop_oneof![
            Just(2.5),
            Just(3.0),
            Just(-1.0),
            any::<f64>().prop_filter("finite", |f| f.is_finite())
        ]
        .prop_map(Cell::Real),
        ".{0,6}".prop_map(Cell::Text),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 32),
            proptest::collection::vec(any::<u8>(), 0..40)
        ]
        .prop_map(Cell::Blob),
    ]
}

/// `cells` with up to two of them replaced by any value.
#[cfg(feature = "sqlite")]
pub(crate) fn with_swaps(
    cells: impl Strategy<Value = Vec<Cell>>,
    width: usize,
) -> impl Strategy<Value = Vec<Cell>> {
    (cells, proptest::collection::vec((0..width, any_cell()), 0..3)).prop_map(
        |(mut cells, swaps)| {
            for (i, c) in swaps {
                cells[i] = c;
            }
            cells
        },
    )
}

/// Runs `check` on the row `SELECT ?1, ?2, …` with `cells` bound, for [`CASES`] generated
/// cell lists, on one in-memory database.
#[cfg(feature = "sqlite")]
pub(crate) fn for_rows(
    cells: impl Strategy<Value = Vec<Cell>>,
    check: impl Fn(&[Cell], SqliteRow) -> Result<(), TestCaseError>,
) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let conn = rt.block_on(SqliteConnection::connect("sqlite::memory:")).expect("sqlite");
    let conn = RefCell::new(conn);
    let result = TestRunner::new(config()).run(&cells, |cells| {
        let params: Vec<String> = (1..=cells.len()).map(|i| format!("?{i}")).collect();
        let mut q = sqlx::query(AssertSqlSafe(format!("SELECT {}", params.join(", "))));
        for c in &cells {
            q = match c {
                Cell::Null => q.bind(None::<i64>),
                Cell::Int(v) => q.bind(*v),
                Cell::Real(v) => q.bind(*v),
                Cell::Text(s) => q.bind(s.clone()),
                Cell::Blob(b) => q.bind(b.clone()),
            };
        }
        let row = rt
            .block_on(q.fetch_one(&mut *conn.borrow_mut()))
            .map_err(|e| TestCaseError::fail(format!("select: {e}")))?;
        check(&cells, row)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
