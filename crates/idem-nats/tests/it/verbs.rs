//! Outcome → JetStream verb, on the real server (two-phase mode over SQLite).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{Env, header, nats_url};
use idem_core::consumer::{Report, headers};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::{Claim, ClaimRequest, DedupStore, FingerprintSpec};
use idem_nats::{Error, JetStreamConfig, JetStreamConsumer};
use idem_sqlx::SqliteStore;
use idem_testkit::wait_for;

async fn store(dir: &tempfile::TempDir) -> SqliteStore {
    SqliteStore::open(dir.path().join("idem.sqlite")).await.expect("open sqlite")
}

#[tokio::test]
async fn outcomes_map_to_ack_nak_and_dead_letter() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pull = env.consumer("verbs", Duration::from_secs(30), 3).await;
    let nats = JetStreamConsumer::builder(
        JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject)
            .retry_delay(Duration::from_millis(50)),
    )
    .store(store(&dir).await)
    .scope("verbs")
    .build()
    .await
    .expect("adapter");

    let mut last = tokio::time::Instant::now();
    env.publish("a", br#"{"n":1}"#).await;
    env.publish("flaky", br#"{"n":3}"#).await;
    env.publish("bad", br#"{"n":4}"#).await;
    env.publish("hopeless", br#"{"n":5}"#).await;
    env.retry("a", br#"{"n":1}"#, &mut last).await; // producer duplicate, same body
    env.retry("a", br#"{"n":2}"#, &mut last).await; // same id, different body

    let flaky = AtomicU32::new(0);
    let handler = |_ctx, d: idem_nats::Delivery| {
        let id = d.message_id().unwrap_or_default().to_owned();
        let flaky_try = if id == "flaky" { flaky.fetch_add(1, Ordering::SeqCst) } else { 0 };
        async move {
            match id.as_str() {
                "flaky" if flaky_try == 0 => Err(HandlerError::Transient("try again".to_owned())),
                "bad" => Err(HandlerError::Permanent("malformed order".to_owned())),
                "hopeless" => Err(HandlerError::Transient("still down".to_owned())),
                _ => Ok(id),
            }
        }
    };
    let mut total = Report::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while total.dead_lettered < 3 || total.processed < 2 {
        assert!(tokio::time::Instant::now() < deadline, "not settled: {total}");
        total += nats.poll(handler).await.expect("poll");
    }
    assert_eq!(total.processed, 2, "{total}"); // a, flaky (second try)
    assert_eq!(total.duplicates, 1, "{total}");
    assert_eq!(total.conflicts, 1, "{total}");
    assert_eq!(total.dead_lettered, 3, "{total}"); // conflict, bad, hopeless (gave up)
    assert_eq!(flaky.load(Ordering::SeqCst), 2);

    let dl = env.dead_letters().await;
    let reason = |id: &str| {
        dl.iter()
            .find(|m| header(m, headers::ORIGINAL_MESSAGE_ID) == Some(id))
            .and_then(|m| header(m, headers::REASON))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    assert!(reason("a").starts_with("conflict: key verbs/a reused"), "{}", reason("a"));
    assert_eq!(reason("bad"), "handler failed: malformed order");
    assert!(reason("hopeless").starts_with("gave up after 3 deliveries"), "{}", reason("hopeless"));
    let conflict =
        dl.iter().find(|m| header(m, headers::ORIGINAL_MESSAGE_ID) == Some("a")).expect("a");
    assert_eq!(header(conflict, headers::OUTCOME), Some("conflict"));
    assert_eq!(header(conflict, headers::SCOPE), Some("verbs"));
    assert!(header(conflict, headers::POSITION).is_some_and(|p| p.starts_with(&env.name)));
    assert_eq!(&conflict.payload[..], br#"{"n":2}"#);
    assert!(
        conflict.headers.get("Nats-Msg-Id").is_some_and(|v| v.as_str().starts_with("idem-dlq:"))
    );

    wait_for("nothing pending", Duration::from_secs(5), || async {
        env.pending("verbs").await == (0, 0)
    })
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn progress_keeps_a_long_handler_from_being_redelivered() {
    let Some(url) = nats_url() else { return };
    let _ = tracing_subscriber::fmt().with_env_filter("idem=debug").with_test_writer().try_init();
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    // ack_wait 1 s, handler 3 s: without Progress JetStream would redeliver it twice meanwhile.
    let pull = env.consumer("slow", Duration::from_secs(1), 5).await;
    let sqlite = store(&dir).await;
    let probe = sqlite.clone();
    let nats = Arc::new(
        JetStreamConsumer::builder(JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject))
            .store(sqlite)
            .scope("slow")
            .lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(250))
            .build()
            .await
            .expect("adapter"),
    );
    env.publish("long", b"{}").await;
    let batch = nats.fetch().await.expect("fetch");
    assert_eq!(batch.len(), 1);
    // A second consumer polling meanwhile must see nothing redelivered.
    let other = Arc::clone(&nats);
    let spy = tokio::spawn(async move {
        let mut seen = 0;
        for _ in 0..3 {
            seen += other.fetch().await.expect("fetch").len();
        }
        seen
    });
    let probe = &probe;
    let decided = nats
        .decide(batch, |ctx, d| async move {
            // The slow work itself, past the 1 s lease: the heartbeat must have extended it, so a
            // competing claim now finds the key in progress rather than taking it over.
            tokio::time::sleep(Duration::from_millis(2500)).await;
            let key = ctx.key().expect("keyed").clone();
            let fp = FingerprintSpec::default().fingerprint(d.payload()).expect("json");
            let req = ClaimRequest::new(key, fp, Duration::from_secs(1), Duration::from_secs(60));
            let claim = probe.claim(&req).await.expect("claim");
            assert!(matches!(claim, Claim::InProgress { .. }), "lease not extended: {claim:?}");
            tokio::time::sleep(Duration::from_millis(500)).await;
            Ok::<_, HandlerError<String>>(())
        })
        .await
        .expect("decide");
    let report = nats.settle(decided).await.expect("settle");
    assert_eq!((report.processed, report.acked), (1, 1), "{report}");
    assert_eq!(spy.await.expect("spy"), 0, "the message was redelivered while its handler ran");
    let info =
        env.js.get_stream(&env.name).await.expect("s").consumer_info("slow").await.expect("i");
    assert_eq!(info.num_redelivered, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn startup_refuses_unsafe_configurations() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = &dir;
    let week = Duration::from_secs(7 * 86_400);

    let open = |config: JetStreamConfig, retain| async move {
        let e = JetStreamConsumer::builder(config)
            .store(store(dir).await)
            .scope("s")
            .retain(retain)
            .build()
            .await
            .expect_err("an unsafe configuration");
        match e {
            idem_core::consumer::BuildError::Open(e) => e,
            other => panic!("expected the source to refuse: {other}"),
        }
    };

    let unbounded = env.consumer("unbounded", Duration::from_secs(30), -1).await;
    let e = open(JetStreamConfig::new(env.js.clone(), unbounded, &env.dlq_subject), week).await;
    assert!(matches!(e, Error::UnboundedRedelivery { .. }), "{e}");

    let pull = env.consumer("short", Duration::from_secs(60), 10).await;
    let e = open(
        JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject),
        Duration::from_secs(300),
    )
    .await;
    assert!(e.to_string().contains("10 deliveries × 1m"), "{e}");

    let pull = env.consumer("nodlq", Duration::from_secs(30), 5).await;
    let e = open(JetStreamConfig::new(env.js.clone(), pull, "nowhere.at.all"), week).await;
    assert!(matches!(e, Error::NoDeadLetterStream { .. }), "{e}");

    let pull = env.consumer("beat", Duration::from_secs(2), 5).await;
    let config = JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject)
        .progress(Duration::from_secs(2));
    let e = open(config, week).await;
    assert!(matches!(e, Error::Heartbeat { .. }), "{e}");
    env.cleanup().await;
}

#[tokio::test]
async fn run_processes_until_shutdown_and_finishes_its_batch() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pull = env.consumer("runner", Duration::from_secs(30), 5).await;
    let nats =
        JetStreamConsumer::builder(JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject))
            .store(store(&dir).await)
            .scope("runner")
            .batch(16)
            .idle_wait(Duration::from_millis(100))
            .build()
            .await
            .expect("adapter");
    for i in 0..50 {
        env.publish(&format!("r-{i}"), format!(r#"{{"i":{i}}}"#).as_bytes()).await;
    }
    let handled = Arc::new(AtomicU32::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let counter = Arc::clone(&handled);
    let run = tokio::spawn(async move {
        nats.run(
            move |_ctx, _d| {
                let counter = Arc::clone(&counter);
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>(())
                }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await
    });
    wait_for("50 handled", Duration::from_secs(10), || async {
        handled.load(Ordering::SeqCst) == 50
    })
    .await;
    wait_for("all acked", Duration::from_secs(10), || async {
        env.pending("runner").await == (0, 0)
    })
    .await;
    stop.send(()).expect("stop");
    let report = run.await.expect("join").expect("run");
    assert_eq!((report.processed, report.acked, report.fetched), (50, 50, 50), "{report}");
    env.cleanup().await;
}

/// A producer's `Nats-*` headers are instructions to the server for that one publish
/// (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`, `Nats-Rollup`, `Nats-TTL`): the
/// stream stores them, and copying them onto the dead-letter publish made the dead-letter
/// stream refuse it (wrong stream, wrong sequence), so such a message could never leave.
#[tokio::test]
async fn server_instructions_stay_off_the_dead_letter_copy() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pull = env.consumer("guarded", Duration::from_secs(30), 3).await;
    let nats =
        JetStreamConsumer::builder(JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject))
            .store(store(&dir).await)
            .scope("guarded")
            .build()
            .await
            .expect("adapter");

    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", "guarded-1");
    h.insert("Nats-Expected-Stream", env.name.as_str());
    h.insert("Nats-Expected-Last-Sequence", "0");
    h.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    env.js
        .publish_with_headers(format!("{}.m", env.subject), h, b"{}".to_vec().into())
        .await
        .expect("publish")
        .await
        .expect("the guarded publish is stored");

    let handler = |_ctx, _d: idem_nats::Delivery| async {
        Err::<(), _>(HandlerError::Permanent("malformed order".to_owned()))
    };
    let mut total = Report::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while total.dead_lettered < 1 {
        assert!(tokio::time::Instant::now() < deadline, "never dead-lettered: {total}");
        total += nats.poll(handler).await.expect("poll");
    }
    let dl = env.dead_letters().await;
    assert_eq!(dl.len(), 1, "one dead letter");
    let copy = &dl[0];
    assert_eq!(header(copy, headers::ORIGINAL_MESSAGE_ID), Some("guarded-1"));
    assert_eq!(
        header(copy, "traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        "the message's own headers are kept"
    );
    for gone in ["Nats-Expected-Stream", "Nats-Expected-Last-Sequence"] {
        assert!(header(copy, gone).is_none(), "{gone} copied onto the dead letter");
    }
    env.cleanup().await;
}
