//! A Redis Streams consumer never dead-letters into the stream it reads, on the real server.

use crate::common;

use idem_core::MemoryStore;
use idem_core::consumer::BuildError;
use idem_redis::{Error, StreamConfig, StreamConsumer};
use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};

/// Opens a two-phase consumer over `config`; the source's error when it refuses.
async fn open(config: StreamConfig) -> Result<(), Error> {
    let built = StreamConsumer::builder(config).store(MemoryStore::new()).scope("s").build().await;
    match built {
        Ok(_) => Ok(()),
        Err(BuildError::Open(e)) => Err(e),
        Err(other) => panic!("expected the source to open or refuse: {other}"),
    }
}

/// A copy written to the consumed stream, as a dead letter would be (the entry's fields, its
/// `message_id` too), is read by the group as a new entry: with a conflict, the same conflict
/// again, for ever. Naming the consumed stream as the dead-letter stream is refused, naming
/// both; the default dead-letter stream opens.
#[tokio::test]
async fn the_consumed_stream_as_dead_letter_stream_is_refused() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("dl-loop");
    let _cleanup = common::Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");

    // What the refusal prevents.
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .expect("group");
    let _: String = conn
        .xadd(&stream, "*", &[("message_id", "o-3"), ("payload", r#"{"amount":9999}"#)])
        .await
        .expect("xadd");
    let read = StreamReadOptions::default().group("g", "c").count(10);
    let first: StreamReadReply = conn.xread_options(&[&stream], &[">"], &read).await.expect("read");
    assert_eq!(first.keys[0].ids.len(), 1);
    let _: String = conn
        .xadd(
            &stream,
            "*",
            &[
                ("message_id", "o-3"),
                ("payload", r#"{"amount":9999}"#),
                ("idem-outcome", "conflict"),
            ],
        )
        .await
        .expect("the dead-letter copy");
    let again: StreamReadReply = conn.xread_options(&[&stream], &[">"], &read).await.expect("read");
    let back = &again.keys[0].ids;
    assert_eq!(back.len(), 1, "the group reads the copy as a new entry");
    assert_eq!(back[0].get::<String>("message_id").as_deref(), Some("o-3"), "under the same key");

    let e = open(StreamConfig::new(client.clone(), &stream, "g2", "c").dead_letter_stream(&stream))
        .await
        .expect_err("a loop");
    assert!(matches!(e, Error::DeadLetterLoop { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains(&format!("dead-letter stream `{stream}` is the consumed stream `{stream}`")),
        "{text}"
    );

    open(StreamConfig::new(client, &stream, "g2", "c")).await.expect("the default dead letters");
}
