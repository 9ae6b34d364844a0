//! An in-process `idem serve` over a store, and the clients the tests use.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::{DedupStore, InspectStore};
use idem_serve::{RemoteStore, Scopes, Token, Tokens};
use tokio::sync::oneshot;

/// The secret of the all-scopes token the tests use.
pub const ADMIN: &str = "admin-secret-0123456789";
/// The secret of a token limited to scope `orders`.
pub const ORDERS: &str = "orders-secret-0123456789";

/// A running server; stops (gracefully) when dropped.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Server {
    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client with the all-scopes token.
    pub fn admin(&self) -> RemoteStore {
        RemoteStore::new(&self.base()).expect("client").token(ADMIN)
    }
}

pub fn tokens() -> Tokens {
    Tokens::new(vec![
        Token::new("admin", ADMIN, Scopes::All).expect("token"),
        Token::new("orders", ORDERS, Scopes::from_list(["orders"])).expect("token"),
    ])
    .expect("tokens")
}

/// Serves `store` on a free loopback port.
pub async fn serve<S: DedupStore + InspectStore>(store: S) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel();
    let app = idem_serve::router(store, tokens(), None);
    tokio::spawn(idem_serve::serve(app, listener, None, idem_serve::Limits::default(), async {
        let _ = rx.await;
    }));
    Server { addr, stop: Some(tx) }
}

/// A name no other test (or test process) uses.
pub fn unique(prefix: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{n}_{nanos}", std::process::id())
}
