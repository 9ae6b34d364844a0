//! A consumer whose connection is lost stops — its run ends with an error, bounded by the
//! broker timeout, never hangs on an ack lapin cannot resolve — and the message it held comes
//! back to the queue. The connection goes through a TCP proxy the test cuts (both sockets
//! dropped: the broker sees the client vanish) while the handler is inside its effect.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Broker;
use idem_amqp::lapin::{Connection, ConnectionProperties};
use idem_amqp::{AmqpConfig, AmqpConsumer};
use idem_core::MemoryStore;
use idem_core::engine::HandlerError;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

/// A TCP proxy to the broker whose connections the test can cut.
struct Proxy {
    addr: String,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let t = Arc::clone(&tasks);
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let up = upstream.clone();
                let h = tokio::spawn(async move {
                    let mut server = TcpStream::connect(up).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
                t.lock().unwrap().push(h);
            }
        });
        Self { addr, tasks, accept }
    }

    /// Drops both sockets of every proxied connection.
    fn cut(&self) {
        self.accept.abort();
        for h in self.tasks.lock().unwrap().drain(..) {
            h.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_connection_is_cut_stops_and_its_message_comes_back() {
    let Some(broker) = Broker::new("cut").await else { return };
    broker.publish(Some("m-1"), br#"{"order":1}"#, &[]).await;
    // `amqp://user:pass@host:port/vhost`: the same URL through the proxy.
    let (head, rest) = broker.url.split_once('@').unwrap();
    let (upstream, vhost) = rest.split_once('/').unwrap();
    let proxy = Proxy::start(upstream.to_owned()).await;
    let url = format!("{head}@{}/{vhost}", proxy.addr);
    let conn = Connection::connect(&url, ConnectionProperties::default()).await.unwrap();
    let timeout = Duration::from_secs(3);
    let consumer = AmqpConsumer::builder(AmqpConfig::new(&conn, broker.queue()))
        .store(MemoryStore::new())
        .scope("cut")
        .broker_timeout(timeout)
        .build()
        .await
        .unwrap();

    let (entered, inside) = oneshot::channel::<()>();
    let entered = Mutex::new(Some(entered));
    let release = Arc::new(Notify::new());
    let handler = |_ctx, _m| {
        let (entered, release) = (entered.lock().unwrap().take(), Arc::clone(&release));
        async move {
            if let Some(tx) = entered {
                let _ = tx.send(());
            }
            release.notified().await; // the effect, finished after the cut
            Ok::<_, HandlerError<String>>(())
        }
    };
    let run = consumer.run(handler, std::future::pending());
    let cut = async {
        inside.await.unwrap();
        proxy.cut();
        release.notify_one();
    };
    let (ended, ()) =
        tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(run, cut) })
            .await
            .expect("the consumer hung after its connection was cut");
    let e = ended.expect_err("a run whose connection is gone must end with an error");
    eprintln!("the run ended: {e}");

    // The broker saw the client vanish and requeued the unacknowledged message.
    broker.wait_count(broker.queue(), 1, Duration::from_secs(20)).await;
    broker.cleanup().await;
}
