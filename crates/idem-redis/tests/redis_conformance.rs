//! The conformance suite against `RedisStore` on the real server, each case in its own
//! namespace. Time moves through the store's test clock offset (added to Redis `TIME`).

mod common;

use std::time::Duration;

use idem_redis::ClockOffset;
use idem_testkit::{Harness, TimeControl};

struct Offset(ClockOffset);

impl TimeControl for Offset {
    async fn advance(&self, d: Duration) {
        self.0.advance(d);
    }
}

idem_testkit::dedup_store_conformance!(server: || async {
    let url = common::url()?;
    let (store, offset, cleanup) = common::store(&url, "conf").await;
    Some(Harness::new(store, Offset(offset), Duration::from_secs(10)).with_guard(cleanup))
});
