//! `idem demo` end to end: the binary runs the story and its verdict is right.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::process::Command;

fn idem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idem"))
}

fn row<'a>(out: &'a str, label: &str) -> (&'a str, &'a str) {
    let line = out
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no row {label:?} in:\n{out}"));
    let mut cols = line[label.len()..].split_whitespace();
    (cols.next().unwrap(), cols.next().unwrap())
}

#[test]
fn demo_shows_naive_double_charges_and_idem_none() {
    let out = idem().args(["demo", "--orders", "400", "--seed", "7"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (naive, idem) = row(&stdout, "customers charged twice");
    assert!(naive.parse::<u32>().unwrap() > 0, "naive should double-charge:\n{stdout}");
    assert_eq!(idem, "0");
    let (_, idem) = row(&stdout, "orders stored twice");
    assert_eq!(idem, "0");
    let (naive, idem) = row(&stdout, "conflicts dead-lettered");
    assert_eq!((naive, idem), ("0", "1"));
    let (_, idem) = row(&stdout, "orders stored (rows)");
    assert_eq!(idem, "400");
    let (_, crashes) = row(&stdout, "consumer crashes injected");
    assert!(crashes.parse::<u32>().unwrap() > 0, "crashes must be injected:\n{stdout}");
}

#[test]
fn demo_keeps_the_store_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kept.sqlite");
    let out = idem()
        .args(["demo", "--orders", "50", "--crash-rate", "0", "--store"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success());
    // The operator tools read what the demo left.
    let stats = idem().args(["stats", "--store"]).arg(&path).output().unwrap();
    let stats = String::from_utf8_lossy(&stats.stdout);
    assert!(stats.contains("completed"), "{stats}");
    let completed: u64 = stats
        .lines()
        .find(|l| l.starts_with("completed"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(completed >= 100, "50 payment records and 50 inbox markers expected, got {completed}");
}

#[test]
fn operator_tools_report_bad_input_clearly() {
    let out = idem().args(["stats", "--store", "/nonexistent/x.sqlite"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no SQLite database file at /nonexistent/x.sqlite")
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sqlite");
    assert!(
        idem()
            .args(["demo", "--orders", "10", "--crash-rate", "0", "--store"])
            .arg(&path)
            .output()
            .unwrap()
            .status
            .success()
    );
    let out = idem().args(["inspect", "--state", "bogus", "--store"]).arg(&path).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown state \"bogus\""));
    let out = idem().args(["stats", "--table", "x;drop", "--store"]).arg(&path).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("table name"));
}
