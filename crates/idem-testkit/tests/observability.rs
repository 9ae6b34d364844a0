//! Observability of the consumer engine. Alone in its own test binary: `tracing` caches callsite
//! interest process-wide, so a thread-local subscriber in a binary whose other tests run on
//! threads without one may miss events.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Message;
use idem_core::{Engine, MemoryStore, Outcome};

type Out = Outcome<String, String>;

fn order(id: &str, cents: u32) -> Message {
    Message::new(format!(r#"{{"order_id":"{id}","cents":{cents}}}"#)).with_message_id(id)
}

fn consumer(store: MemoryStore) -> Engine<MemoryStore> {
    Engine::builder(store).scope("orders").lease(Duration::from_secs(30)).build().unwrap()
}

fn counting(
    runs: &Arc<AtomicU32>,
) -> impl Fn(Context) -> std::future::Ready<Result<String, HandlerError<String>>> {
    let runs = Arc::clone(runs);
    move |ctx: Context| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(format!("charged#{}", ctx.attempt())))
    }
}

/// One `tracing` event per delivery, carrying scope, key, correlation id, outcome and attempt;
/// outcome counters and the claim histogram in `metrics`.
#[test]
fn every_delivery_is_traced_and_counted() {
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Default, Clone)]
    struct Events(Arc<std::sync::Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Events {
        fn on_event(&self, ev: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            struct V(String);
            impl tracing::field::Visit for V {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    self.0.push_str(&format!("{}={:?} ", f.name(), v));
                }
                fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                    self.0.push_str(&format!("{}={} ", f.name(), v));
                }
            }
            let mut v = V(String::new());
            ev.record(&mut v);
            self.0.lock().unwrap().push(v.0);
        }
    }
    let events = Events::default();
    let subscriber = tracing_subscriber::registry()
        .with(events.clone())
        .with(tracing_subscriber::filter::LevelFilter::DEBUG);
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            rt.block_on(async {
                let c = consumer(MemoryStore::new());
                let runs = Arc::new(AtomicU32::new(0));
                let msg = order("o-9", 1).with_correlation_id("corr-1");
                let _: Out = c.process(&msg, counting(&runs)).await;
                let _: Out = c.process(&msg, counting(&runs)).await;
            });
        });
    });
    let events = events.0.lock().unwrap();
    let finished: Vec<&String> =
        events.iter().filter(|e| e.contains("delivery finished")).collect();
    assert_eq!(finished.len(), 2, "{events:?}");
    for field in ["scope=orders", "key=o-9", "correlation_id=corr-1", "attempt=1"] {
        assert!(finished.iter().all(|e| e.contains(field)), "{field} missing in {finished:?}");
    }
    assert!(finished[0].contains("outcome=processed"));
    assert!(finished[1].contains("outcome=duplicate"));
    let snap = snapshotter.snapshot().into_vec();
    let count = |outcome: &str| {
        snap.iter().find_map(|(k, _, _, v)| {
            let key = k.key();
            (key.name() == "idem_outcomes_total" && key.labels().any(|l| l.value() == outcome))
                .then_some(v)
        })
    };
    assert_eq!(count("processed"), Some(&metrics_util::debugging::DebugValue::Counter(1)));
    assert_eq!(count("duplicate"), Some(&metrics_util::debugging::DebugValue::Counter(1)));
    assert!(snap.iter().any(|(k, _, _, _)| k.key().name() == "idem_claim_duration_seconds"));
}
