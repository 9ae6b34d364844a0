//! The Prometheus endpoint after known traffic: every count and histogram an operator's
//! alerts read (docs/OPERATIONS.md) has the value the traffic implies.
//!
//! One test function only, in a binary of its own: the recorder is process-global.
#![cfg(feature = "prometheus")]

use std::net::SocketAddr;
use std::time::Duration;

use idem::consumer::MemoryQueue;
use idem::engine::HandlerError;
use idem::extract::Message;
use idem::time::ManualClock;
use idem::{Claim, ClaimRequest, Consumer, DedupStore, MemoryStore};
use idem_testkit::faults::{FaultyStore, Op};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_after_known_traffic_shows_exact_counts() {
    let addr = free_addr();
    let handle = idem::prometheus::install(addr).expect("install the exporter");
    // A second install is refused (one global recorder per process), naming the address.
    let again = idem::prometheus::install(free_addr()).expect_err("second install");
    assert!(again.to_string().contains("could not install the Prometheus exporter"), "{again}");

    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryStore::with_clock(clock.clone()));
    let queue = MemoryQueue::new();
    let driver = Consumer::builder(queue.clone())
        .store(store.clone())
        .scope("billing")
        .batch(4)
        // Exact counts: pipelined, batch 2's claims could go out while batch 1 runs, and its
        // duplicates of batch 1 (then in progress) be claimed a second time.
        .pipeline(false)
        .concurrency(1)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .expect("driver");

    // A consumer that crashed holding o-5: its lease runs out before o-5 is delivered here,
    // so this consumer takes it over (attempt 2).
    let crashed = Message::new(payload(5)).with_message_id("o-5");
    let engine = driver.engine();
    let key = engine.key_of(&crashed).expect("o-5 has a key");
    let fingerprint = engine.fingerprint_of(&crashed).expect("a JSON payload");
    let req = ClaimRequest::new(key, fingerprint, engine.lease(), engine.retain());
    let Ok(Claim::Acquired(lease)) = store.inner().claim(&req).await else {
        panic!("the first claim of o-5 is acquired")
    };
    drop(lease); // the crash: never completed, never released
    clock.advance(driver.engine().lease() + Duration::from_secs(1));

    // Batch 1: o-1..o-4, new. Batch 2: o-5 (taken over), o-1 and o-2 again (duplicates), o-3
    // with another payload (a conflict, dead-lettered).
    for i in 1..=5 {
        queue.push(format!("o-{i}"), payload(i));
    }
    queue.push("o-1", payload(1));
    queue.push("o-2", payload(2));
    queue.push("o-3", payload(999));
    // The first completion fails as a dropped connection would, and is tried again.
    store.fail_next(Op::Complete, 1);

    let report = driver
        .run(|_ctx, _msg| async { Ok::<_, HandlerError<String>>(()) }, queue.drained())
        .await
        .expect("run");
    assert_eq!((report.processed, report.duplicates, report.conflicts), (5, 2, 1), "{report:?}");
    assert_eq!(queue.dead_letters().len(), 1);

    let body = scrape(addr).await;
    // The HTTP endpoint and the handle render the same registry.
    assert!(handle.render().contains("idem_outcomes_total"));
    let scope = ("scope", "billing");
    let expect = [
        ("idem_outcomes_total", vec![scope, ("outcome", "processed")], 5.0),
        ("idem_outcomes_total", vec![scope, ("outcome", "duplicate")], 2.0),
        ("idem_outcomes_total", vec![scope, ("outcome", "conflict")], 1.0),
        ("idem_dead_letters_total", vec![scope, ("outcome", "conflict")], 1.0),
        ("idem_takeovers_total", vec![scope, ("policy", "run")], 1.0),
        ("idem_complete_retries_total", vec![scope], 1.0),
        (
            "idem_store_errors_total",
            vec![scope, ("op", "complete_many"), ("retryable", "true")],
            1.0,
        ),
        // One claim_many per batch, which takes over no expired lease; then o-5's takeover,
        // claimed alone at its turn (a claim that takes over must be one its handler runs).
        ("idem_claim_duration_seconds_count", vec![scope], 3.0),
        // Batch 1: its four completions, then the failed one again; batch 2: o-5's.
        ("idem_complete_duration_seconds_count", vec![scope], 3.0),
        ("idem_batch_size_count", vec![scope], 2.0),
        ("idem_batch_size_sum", vec![scope], 8.0),
        // Bucket bounds are set, so these are histograms: 4 ≤ 5 holds both batches.
        ("idem_batch_size_bucket", vec![scope, ("le", "5")], 2.0),
        ("idem_batch_size_bucket", vec![scope, ("le", "2")], 0.0),
    ];
    for (name, labels, want) in expect {
        assert_eq!(value(&body, name, &labels), Some(want), "{name}{labels:?} in\n{body}");
    }
    // Nothing failed, so no such series exists.
    assert_eq!(
        value(&body, "idem_outcomes_total", &[scope, ("outcome", "failed_permanent")]),
        None
    );
    for line in [
        "# TYPE idem_claim_duration_seconds histogram",
        "# TYPE idem_outcomes_total counter",
        "# HELP idem_takeovers_total Claims that took over an expired lease",
    ] {
        assert!(body.contains(line), "{line:?} missing from\n{body}");
    }
}

fn payload(i: u32) -> String {
    format!(r#"{{"cents":{}}}"#, i * 100)
}

/// A port nobody listens on now (the exporter binds it right after; it cannot report the port
/// it chose for `:0`).
fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr")
}

/// `GET /metrics` over a plain TCP connection; the body.
async fn scrape(addr: SocketAddr) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect to the exporter");
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(req.as_bytes()).await.expect("send the request");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut raw))
        .await
        .expect("the exporter answers within 10 s")
        .expect("read the response");
    let raw = String::from_utf8(raw).expect("UTF-8 exposition text");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(!head.to_ascii_lowercase().contains("transfer-encoding: chunked"), "{head}");
    body.to_owned()
}

/// The value of the sample `name` whose labels are exactly `labels` (in any order).
fn value(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    want.sort();
    body.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (series, v) = line.rsplit_once(' ')?;
        let (n, got) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}')?),
            None => (series, ""),
        };
        let mut got: Vec<String> =
            got.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect();
        got.sort();
        (n == name && got == want).then(|| v.parse().expect("a number"))
    })
}
