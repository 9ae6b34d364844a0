//! `Debug` of every settings type that holds a Redis URL never shows its password.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use idem_redis::{RedisStore, StreamConfig, redis};

const SECRET: &str = "PlantedRedisSecret42";

#[test]
fn builders_and_stream_configs_hide_the_password() {
    for url in [format!("redis://:{SECRET}@127.0.0.1:6379/0"), format!("redis://app:{SECRET}@h:1")]
    {
        let builder = RedisStore::builder(&url).unwrap();
        assert!(!format!("{builder:?}").contains(SECRET), "{builder:?}");
        let client = redis::Client::open(url.as_str()).unwrap();
        let config = StreamConfig::new(client, "orders", "billing", "worker-1");
        let d = format!("{config:?}");
        assert!(!d.contains(SECRET) && d.contains("orders"), "{d}");
    }
    let cluster =
        RedisStore::cluster_builder([format!("redis://:{SECRET}@127.0.0.1:7000/")]).unwrap();
    assert!(!format!("{cluster:?}").contains(SECRET), "{cluster:?}");
}
