//! The operator verbs (`inspect`, `stats`, `release`, `fail`, `purge`) run as the built `idem`
//! binary against each store, on records seeded through the store API; and the errors an
//! operator sees for a missing file, a wrong scheme, an unreachable server, a missing table.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::process::{Command, Output};
use std::time::Duration;

use idem::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Fingerprint, InspectStore, Lease,
    RecordState, StoreError,
};
use serde_json::Value;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Runs `idem <verb> <store args…> <rest…>`, expecting success; returns stdout.
fn ok(verb: &str, store: &[&str], rest: &[&str]) -> String {
    let args: Vec<&str> = [verb].iter().chain(store).chain(rest).copied().collect();
    let out = idem(&args);
    assert!(out.status.success(), "idem {}: {}", args.join(" "), text(&out));
    String::from_utf8(out.stdout).unwrap()
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

const LEASE: Duration = Duration::from_secs(300);
const RETAIN: Duration = Duration::from_secs(3600);

fn key(scope: &str, id: &str) -> DedupKey {
    DedupKey::new(scope, id).unwrap()
}

fn req(k: &DedupKey) -> ClaimRequest {
    ClaimRequest::new(k.clone(), Some(Fingerprint::of_bytes(k.id().as_bytes())), LEASE, RETAIN)
}

async fn acquire<S: DedupStore>(store: &S, k: &DedupKey) -> Lease {
    match store.claim(&req(k)).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{k}: {other:?}"),
    }
}

/// Seeds: `orders/o-1` completed (text result), `o-2` completed (binary result), `o-3` in
/// progress (its lease returned), `o-4` in doubt, `billing/b-1` completed and, when `expired`,
/// `orders/o-5` completed with no retention (expired at once; Redis would delete it itself).
async fn seed<S: DedupStore>(store: &S, expired: bool) -> Lease {
    let l = acquire(store, &key("orders", "o-1")).await;
    store.complete(l, Some(b"charged 42"), RETAIN).await.unwrap();
    let l = acquire(store, &key("orders", "o-2")).await;
    store.complete(l, Some(&[0xff, 0x00]), RETAIN).await.unwrap();
    let held = acquire(store, &key("orders", "o-3")).await;
    let l = acquire(store, &key("orders", "o-4")).await;
    store.fail(l, FailKind::InDoubt, "lease expired", RETAIN).await.unwrap();
    let l = acquire(store, &key("billing", "b-1")).await;
    store.complete(l, None, RETAIN).await.unwrap();
    if expired {
        let l = acquire(store, &key("orders", "o-5")).await;
        store.complete(l, None, Duration::ZERO).await.unwrap();
    }
    held
}

/// Every verb on a seeded store reached through `store_args`.
async fn scenario<S: DedupStore + InspectStore>(store: &S, store_args: &[&str], expired: bool) {
    let held = seed(store, expired).await;
    let n = 5 + usize::from(expired);

    // inspect, as a table: every record, newest first.
    let out = ok("inspect", store_args, &[]);
    assert!(out.lines().next().unwrap().starts_with("scope"), "{out}");
    assert!(out.contains(&format!("{n} record(s)")), "{out}");
    for id in ["o-1", "o-2", "o-3", "o-4", "b-1"] {
        assert!(out.contains(id), "{id} missing:\n{out}");
    }
    assert!(out.contains("charged 42") && out.contains("lease expired"), "{out}");

    // inspect --json: one object per record, every field.
    let recs = json_lines(&ok("inspect", store_args, &["--scope", "orders", "--json"]));
    assert_eq!(recs.len(), n - 1, "{recs:?}");
    let by_id = |id: &str| recs.iter().find(|r| r["id"] == id).unwrap().clone();
    let o1 = by_id("o-1");
    assert_eq!(o1["scope"], "orders");
    assert_eq!(o1["state"], "completed");
    assert_eq!(o1["attempt"], 1);
    assert_eq!(o1["result"], "charged 42");
    assert_eq!(o1["result_encoding"], "utf8");
    assert_eq!(o1["fingerprint"], Fingerprint::of_bytes(b"o-1").to_string());
    assert!(o1["created_at_us"].as_i64().unwrap() > 0, "{o1}");
    let o2 = by_id("o-2");
    assert_eq!(
        (o2["result"].as_str(), o2["result_encoding"].as_str()),
        (Some("/wA="), Some("base64"))
    );
    let o3 = by_id("o-3");
    assert_eq!(o3["state"], "in_progress");
    assert!(o3["lease_until_us"].as_i64().is_some(), "{o3}");
    assert_eq!(by_id("o-4")["state"], "in_doubt");

    // inspect --key (exact, needs the scope), --state, --limit.
    let one =
        json_lines(&ok("inspect", store_args, &["--scope", "orders", "--key", "o-4", "--json"]));
    assert_eq!(one.len(), 1);
    assert_eq!(
        (one[0]["id"].as_str(), one[0]["result"].as_str()),
        (Some("o-4"), Some("lease expired"))
    );
    let no_scope = idem(&[&["inspect"][..], store_args, &["--key", "o-4"]].concat());
    assert!(
        !no_scope.status.success() && text(&no_scope).contains("--scope"),
        "{}",
        text(&no_scope)
    );
    let out = ok("inspect", store_args, &["--state", "in_doubt"]);
    assert!(out.contains("o-4") && out.contains("1 record(s)"), "{out}");
    let out = ok("inspect", store_args, &["--limit", "2"]);
    assert!(out.contains("2 record(s)"), "{out}");
    let missing =
        idem(&[&["inspect"][..], store_args, &["--scope", "orders", "--key", "nope"]].concat());
    assert!(text(&missing).contains("no record for orders/nope"), "{}", text(&missing));

    // stats: counts by state and by scope, the oldest in-progress lease.
    let s: Value = serde_json::from_str(&ok("stats", store_args, &["--json"])).unwrap();
    let c = &s["counts"];
    assert_eq!(c["in_progress"], 1, "{s}");
    assert_eq!(c["completed"], 3 + u64::from(expired), "{s}");
    assert_eq!(c["in_doubt"], 1, "{s}");
    assert_eq!(c["total"], n, "{s}");
    assert_eq!(c["expired"], u64::from(expired), "{s}");
    assert_eq!(s["by_scope"]["orders"]["total"], n - 1, "{s}");
    assert_eq!(s["by_scope"]["billing"]["completed"], 1, "{s}");
    assert_eq!(s["by_scope_complete"], true, "{s}");
    assert_eq!(s["oldest_in_progress"]["id"], "o-3", "{s}");
    assert_eq!(s["oldest_in_progress"]["lease_live"], true, "{s}");
    let out = ok("stats", store_args, &[]);
    assert!(out.contains("in_doubt    1"), "{out}");
    assert!(out.contains("oldest in-progress lease: orders/o-3"), "{out}");
    assert!(out.contains("billing"), "{out}");
    let s: Value =
        serde_json::from_str(&ok("stats", store_args, &["--scope", "billing", "--json"])).unwrap();
    assert_eq!(s["counts"]["total"], 1, "{s}");
    assert!(s.get("by_scope").is_none() && s["oldest_in_progress"].is_null(), "{s}");

    // fail: the in-doubt record becomes failed with the operator's reason, and re-claimable.
    let out = ok(
        "fail",
        store_args,
        &["--scope", "orders", "--id", "o-4", "--reason", "checked: not charged"],
    );
    assert!(out.contains("was in_doubt"), "{out}");
    let rec = store.get(&key("orders", "o-4")).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Failed);
    assert_eq!(rec.result.as_deref(), Some(&b"checked: not charged"[..]));
    let again = acquire(store, &key("orders", "o-4")).await;
    assert_eq!(again.previous(), Some(RecordState::Failed));
    store.complete(again, None, RETAIN).await.unwrap();
    let refused = idem(
        &[&["fail"][..], store_args, &["--scope", "orders", "--id", "o-1", "--reason", "x"]]
            .concat(),
    );
    assert!(
        !refused.status.success() && text(&refused).contains("is completed"),
        "{}",
        text(&refused)
    );
    let absent = idem(
        &[&["fail"][..], store_args, &["--scope", "orders", "--id", "nope", "--reason", "x"]]
            .concat(),
    );
    assert!(
        !absent.status.success() && text(&absent).contains("no record for orders/nope"),
        "{}",
        text(&absent)
    );

    // release: the in-progress record is released and its holder fenced out.
    let out = ok("release", store_args, &["orders", "o-3"]);
    assert!(out.contains("released orders/o-3"), "{out}");
    assert_eq!(
        store.get(&key("orders", "o-3")).await.unwrap().unwrap().state,
        RecordState::Released
    );
    assert!(matches!(store.complete(held, None, RETAIN).await, Err(StoreError::LeaseLost { .. })));

    // purge: only the expired record goes, in batches.
    let out = ok("purge", store_args, &["--batch", "1"]);
    assert!(out.contains(&format!("purged {} expired record(s)", u64::from(expired))), "{out}");
    assert!(store.get(&key("orders", "o-5")).await.unwrap().is_none());
    assert_eq!(store.count(None).await.unwrap().total(), 5);
    let out = ok("purge", store_args, &["--max", "0"]);
    assert!(out.contains("purged 0 expired record(s) in 0 batch(es)"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_verbs_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idem.sqlite");
    let store =
        idem::SqliteStore::open(&file).await.unwrap().with_table_name("ops_records").unwrap();
    store.migrate().await.unwrap();
    scenario(&store, &["--store", file.to_str().unwrap(), "--table", "ops_records"], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_verbs_on_postgres() {
    let Some(url) = idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let schema = format!("idem_cli_ops_{}", std::process::id());
    let pool =
        idem::sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    let store = idem::PostgresStore::new(pool.clone()).with_schema(&schema).unwrap();
    store.migrate().await.unwrap();
    scenario(&store, &["--store", &url, "--schema", &schema], true).await;
    let wrong = idem(&["stats", "--store", &url, "--schema", &schema, "--table", "nosuch"]);
    assert!(
        text(&wrong).contains(&format!("no table {schema}.nosuch in PostgreSQL at"))
            && text(&wrong).contains("migrate()"),
        "{}",
        text(&wrong)
    );
    idem::sqlx::query(idem::sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_verbs_on_mariadb() {
    let Some(url) = idem_testkit::service::require(
        "mysql",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return;
    };
    let table = format!("idem_cli_ops_{}", std::process::id());
    let pool =
        idem::sqlx::mysql::MySqlPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    let store = idem::MySqlStore::new(pool.clone()).with_table_name(&table).unwrap();
    store.migrate().await.unwrap();
    scenario(&store, &["--store", &url, "--table", &table], true).await;
    for t in [table.clone(), format!("{table}_versions")] {
        idem::sqlx::query(idem::sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS `{t}`, `{t}_positions`"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_verbs_on_redis() {
    let Some(url) =
        idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    else {
        return;
    };
    let ns = format!("idem-cli-ops-{}", std::process::id());
    let store = idem::redis::RedisStore::builder(&url)
        .unwrap()
        .namespace(&ns)
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Redis deletes an expired record itself (native TTL), so none is seeded for purge.
    scenario(&store, &["--store", &url, "--prefix", &ns], false).await;

    let mut conn = store.connection().clone();
    let keys: Vec<String> = idem::redis::redis::cmd("KEYS")
        .arg(format!("{}*", store.namespace().key_prefix()))
        .query_async(&mut conn)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: u64 =
            idem::redis::redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.sqlite");
    let out = idem(&["inspect", "--store", absent.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("no SQLite database file at"), "{}", text(&out));

    let out = idem(&["stats", "--store", "http://127.0.0.1/x"]);
    assert!(
        text(&out).contains("unknown scheme \"http\"")
            && text(&out).contains("postgres://, postgresql://, mysql://, mariadb:// or redis://"),
        "{}",
        text(&out)
    );

    // Nothing listens on port 1: refused at once, and the message says where.
    let out = idem(&["stats", "--store", "redis://127.0.0.1:1"]);
    assert!(
        text(&out).contains("cannot connect to Redis at redis://127.0.0.1:1"),
        "{}",
        text(&out)
    );

    // A SQLite file without the table: named, with what creates it; nothing is created.
    let file = dir.path().join("other.sqlite");
    idem::SqliteStore::open(&file).await.unwrap();
    let out = idem(&["purge", "--store", file.to_str().unwrap(), "--table", "nosuch"]);
    assert!(
        text(&out).contains("no table nosuch in SQLite database")
            && text(&out).contains("migrate()"),
        "{}",
        text(&out)
    );
    let again = idem(&["purge", "--store", file.to_str().unwrap(), "--table", "nosuch"]);
    assert!(text(&again).contains("no table nosuch"), "{}", text(&again));
}

/// Producer-supplied text reaches the terminal escaped: an id, scope and result carrying
/// terminal escape sequences (clear screen, carriage return, window title, colour) are shown
/// as `\u{1b}`… in the table and in `stats`, and as JSON escapes with `--json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_stats_escape_control_characters() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idem.sqlite");
    let store = idem::SqliteStore::open(&file).await.unwrap();
    store.migrate().await.unwrap();
    let (scope, id) = ("evil\x1b]0;owned\x07", "o-\x1b[2J\rX\u{9b}1m");
    let k = key(scope, id);
    let l = acquire(&store, &k).await;
    store.complete(l, Some(b"\x1b[31mred\x7f"), RETAIN).await.unwrap();
    let _held = acquire(&store, &key(scope, "in-progress\r")).await;
    let args = ["--store", file.to_str().unwrap()];

    let raw = |out: &str| out.contains(['\x1b', '\r', '\x07', '\x7f', '\u{9b}']);
    let table = ok("inspect", &args, &[]);
    assert!(!raw(&table), "{table:?}");
    assert!(table.contains("o-\\u{1b}[2J\\u{d}X\\u{9b}1m"), "{table}");
    assert!(table.contains("evil\\u{1b}]0;owned\\u{7}"), "{table}");
    assert!(table.contains("\\u{1b}[31mred\\u{7f}"), "{table}");

    let json = ok("inspect", &args, &["--json"]);
    assert!(!raw(&json), "{json:?}");
    let recs = json_lines(&json);
    assert!(recs.iter().any(|r| r["id"] == id && r["scope"] == scope), "{recs:?}");

    for extra in [&[][..], &["--json"]] {
        let stats = ok("stats", &args, extra);
        assert!(!raw(&stats), "{stats:?}");
        assert!(stats.contains("in-progress"), "{stats}");
    }
    let released = ok("release", &args, &[scope, id]);
    assert!(!raw(&released) && released.contains("released evil\\u{1b}"), "{released:?}");
}
