//! `idem dlq` end to end on real servers: dead letters made by a real consumer, read back,
//! shown with their store record, replayed and purged by the binary, and the consumer's effects
//! counted (once each, never for a conflict replayed under its key).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test setup: a failure is the test failing

use std::collections::HashMap;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem_testkit::wait_for;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ok(args: &[&str]) -> String {
    let o = idem(args);
    assert!(o.status.success(), "idem {}: {}", args.join(" "), text(&o));
    text(&o)
}

fn letters(at: &[&str]) -> Vec<Value> {
    let mut args = vec!["dlq", "list", "--json"];
    args.extend_from_slice(at);
    ok(&args).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_verbs_on_redis_streams() {
    let Some(url) =
        idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    else {
        return;
    };
    let stream = format!("idem-cli-dlq-{}", std::process::id());
    let client = idem::redis::redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.sqlite");
    let store = idem::SqliteStore::open(&db).await.unwrap();
    let db = db.to_str().unwrap().to_owned();

    let ledger: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let fixed = Arc::new(AtomicBool::new(false));
    let handler = |_ctx, m: idem::redis::Delivery| {
        let id = m.message_id().unwrap_or_default().to_owned();
        let poison = String::from_utf8_lossy(m.payload()).contains("poison");
        let (ledger, fixed) = (ledger.clone(), fixed.load(Ordering::SeqCst));
        async move {
            if poison && !fixed {
                return Err(HandlerError::Permanent(format!("order {id} refused: poison")));
            }
            *ledger.lock().unwrap().entry(id).or_default() += 1;
            Ok::<(), HandlerError<String>>(())
        }
    };
    let config = idem::redis::StreamConfig::new(client.clone(), &stream, "billing", "c-1")
        .reclaim_idle(Duration::from_millis(500));
    let consumer = idem::Consumer::builder(config)
        .store(store)
        .scope("billing")
        .idle_wait(Duration::from_millis(100))
        .build()
        .await
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let count = |id: &str| ledger.lock().unwrap().get(id).copied().unwrap_or(0);
    let script = async {
        let xadd = |id: &str, body: &str| {
            let mut c = idem::redis::redis::cmd("XADD");
            c.arg(&stream).arg("*").arg("message_id").arg(id).arg("payload").arg(body);
            c
        };
        for (id, body) in [
            ("p-1", r#"{"order":1,"poison":true}"#),
            ("p-2", r#"{"order":2,"poison":true}"#),
            ("c-3", r#"{"order":3}"#),
        ] {
            let _: String = xadd(id, body).query_async(&mut conn).await.unwrap();
        }
        wait_for("c-3 processed", LIMIT, || async { count("c-3") == 1 }).await;
        let _: String =
            xadd("c-3", r#"{"order":3,"other":true}"#).query_async(&mut conn).await.unwrap();
        let at = ["--broker", url.as_str(), "--queue", stream.as_str()];
        wait_for("3 dead letters", LIMIT, || async { letters(&at).len() == 3 }).await;

        // list: two groups, the poison one first.
        let mut list_args = vec!["dlq", "list"];
        list_args.extend_from_slice(&at);
        let table = ok(&list_args);
        assert!(table.contains("billing") && table.contains("failed_permanent"), "{table}");
        let all = letters(&at);
        let poison: Vec<&Value> =
            all.iter().filter(|l| l["outcome"] == "failed_permanent").collect();
        let conflict = all.iter().find(|l| l["outcome"] == "conflict").unwrap();
        assert_eq!(poison.len(), 2, "{all:?}");
        assert_eq!(poison[0]["group"], poison[1]["group"]);
        let group = poison[0]["group"].as_str().unwrap();
        let conflict_id = conflict["id"].as_str().unwrap();

        // show: headers, payload and the store's failed record.
        let id = poison[0]["id"].as_str().unwrap();
        let mut show = vec!["dlq", "show", id, "--store", db.as_str()];
        show.extend_from_slice(&at);
        let shown = ok(&show);
        assert!(
            shown.contains("idem-reason: handler failed: order p-1 refused: poison"),
            "{shown}"
        );
        assert!(shown.contains("record      failed"), "{shown}");

        // A conflict is not replayed under its key.
        let mut replay = vec!["dlq", "replay", "--id", conflict_id];
        replay.extend_from_slice(&at);
        let out = ok(&replay);
        assert!(out.contains("left") && out.contains("never replayed under its key"), "{out}");
        assert_eq!(letters(&at).len(), 3);

        // The poison group, once fixed: each processed once; a dry run first does nothing.
        fixed.store(true, Ordering::SeqCst);
        let mut dry = vec!["dlq", "replay", "--group", group, "--dry-run"];
        dry.extend_from_slice(&at);
        assert!(ok(&dry).contains("would replay"));
        assert_eq!(letters(&at).len(), 3);
        let mut replay = vec!["dlq", "replay", "--group", group];
        replay.extend_from_slice(&at);
        let out = ok(&replay);
        assert!(out.contains("2 replayed under their key"), "{out}");
        wait_for("p-1 and p-2 processed", LIMIT, || async {
            count("p-1") == 1 && count("p-2") == 1
        })
        .await;

        // The conflict accepted as a new message.
        let mut accept = vec!["dlq", "replay", "--id", conflict_id, "--conflicts", "accept-as-new"];
        accept.extend_from_slice(&at);
        let out = ok(&accept);
        assert!(out.contains("accepted") && out.contains("c-3.accepted."), "{out}");
        wait_for("the accepted conflict processed", LIMIT, || async {
            ledger.lock().unwrap().keys().any(|k| k.starts_with("c-3.accepted."))
        })
        .await;
        assert!(letters(&at).is_empty());

        // purge: gone without an effect; an unknown id is an error naming it.
        fixed.store(false, Ordering::SeqCst);
        let _: String =
            xadd("p-4", r#"{"order":4,"poison":true}"#).query_async(&mut conn).await.unwrap();
        wait_for("p-4 dead-lettered", LIMIT, || async { letters(&at).len() == 1 }).await;
        let mut purge = vec!["dlq", "purge", "--id", "nope"];
        purge.extend_from_slice(&at);
        let o = idem(&purge);
        assert!(!o.status.success() && text(&o).contains("no dead letter nope"), "{}", text(&o));
        let mut purge = vec!["dlq", "purge", "--all"];
        purge.extend_from_slice(&at);
        assert!(ok(&purge).contains("1 dead letters removed"));
        assert!(letters(&at).is_empty());
        assert_eq!(count("p-4"), 0);
        let effects = ledger.lock().unwrap().clone();
        assert!(effects.values().all(|n| *n == 1), "{effects:?}");
        assert_eq!(effects.len(), 4, "{effects:?}");
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(run, script);
    report.expect("run");
    let _: u64 = idem::redis::redis::cmd("DEL")
        .arg(&stream)
        .arg(format!("{stream}:dead-letter"))
        .query_async(&mut client.get_multiplexed_async_connection().await.unwrap())
        .await
        .unwrap();
}

#[test]
fn errors_name_the_problem() {
    let o = idem(&["dlq", "list", "--broker", "ftp://x", "--queue", "q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unsupported scheme"), "{}", text(&o));
    let o = idem(&["dlq", "replay", "--broker", "redis://127.0.0.1:1", "--queue", "q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--id"), "a replay needs a selection: {}", text(&o));
    let o = idem(&["dlq", "list", "--broker", "amqp10://127.0.0.1:5672", "--queue", "q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("name it with --dead-letter"), "{}", text(&o));
}

#[test]
fn rabbitmq_and_nats_dead_letters_open() {
    if let Some(url) = idem_testkit::service::require(
        "rabbitmq",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    ) {
        // A queue that does not exist is named in the error.
        let q = format!("idem-cli-dlq-missing-{}", std::process::id());
        let o = idem(&["dlq", "list", "--broker", &url, "--queue", &q]);
        assert!(!o.status.success());
        assert!(text(&o).contains(&format!("{q}.idem.dlq")), "{}", text(&o));
    }
    if let Some(url) =
        idem_testkit::service::require_nats("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
    {
        // CI gives the bare `host:port` the NATS crates take; the CLI wants a scheme.
        let url = if url.contains("://") { url } else { format!("nats://{url}") };
        let o = idem(&["dlq", "list", "--broker", &url, "--queue", "idem.cli.nothing.here"]);
        assert!(!o.status.success());
        assert!(text(&o).contains("idem.cli.nothing.here"), "{}", text(&o));
    }
}
