//! The conformance suite against `RedisStore` on the real server, each case in its own
//! namespace. Time moves through the store's test clock offset (added to Redis `TIME`).

use crate::common;

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
    assert!(store.fast_claim(), "Redis >= 7: the script-free fresh claim");
    Some(Harness::new(store, Offset(offset), Duration::from_secs(10)).with_guard(cleanup))
});

/// The same cases with every claim through the script (Redis < 7.0, or `fast_claim(false)`).
mod scripts_only {
    use super::*;

    idem_testkit::dedup_store_conformance!(server: || async {
        let url = common::url()?;
        let (store, offset, cleanup) = common::store_with(&url, "conf-scripts", false).await;
        assert!(!store.fast_claim());
        Some(Harness::new(store, Offset(offset), Duration::from_secs(10)).with_guard(cleanup))
    });
}

/// On the local 3-master Redis Cluster: the namespace's records on the master owning its slot.
mod cluster {
    use super::*;

    idem_testkit::dedup_store_conformance!(server: || async {
        let urls = common::cluster_urls()?;
        let (store, offset, cleanup) = common::cluster_store(&urls, "conf-cluster", true).await;
        Some(Harness::new(store, Offset(offset), Duration::from_secs(10)).with_guard(cleanup))
    });
}

/// On the cluster, every claim through the script.
mod cluster_scripts_only {
    use super::*;

    idem_testkit::dedup_store_conformance!(server: || async {
        let urls = common::cluster_urls()?;
        let (store, offset, cleanup) = common::cluster_store(&urls, "conf-cl-scripts", false).await;
        Some(Harness::new(store, Offset(offset), Duration::from_secs(10)).with_guard(cleanup))
    });
}
