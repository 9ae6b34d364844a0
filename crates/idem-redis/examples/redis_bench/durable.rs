//! The bare durable loop on Redis Streams: `XREADGROUP COUNT batch`, one transaction that
//! inserts the batch's message ids (ignoring those present), `XACK` — the program a user would
//! write without idem, pipelined as the adapter's lanes are unless `IDEM_BENCH_PIPELINE=0`.

use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use idem_testkit::bare::{BareBroker, BareMarks, durable_lane, pipelined};
use redis::aio::MultiplexedConnection;

use super::BoxErr;

/// One lane's reader: its own connection and consumer name in the group.
struct Lane {
    conn: MultiplexedConnection,
    stream: String,
    group: String,
    name: String,
    batch: usize,
    block: Duration,
}

impl BareBroker for Lane {
    type Msg = (String, String);

    async fn fetch(&self) -> Result<Vec<(String, String)>, BoxErr> {
        let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.group)
            .arg(&self.name)
            .arg("COUNT")
            .arg(self.batch)
            .arg("BLOCK")
            .arg(self.block.as_millis().to_string())
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(reply
            .map(|r| r.keys)
            .unwrap_or_default()
            .into_iter()
            .flat_map(|k| k.ids)
            .map(|e| {
                let id: Option<String> = e.get("message_id");
                (e.id, id.unwrap_or_default())
            })
            .collect())
    }

    fn key(m: &(String, String)) -> String {
        m.1.clone()
    }

    async fn ack(&self, msgs: Vec<(String, String)>) -> Result<(), BoxErr> {
        let ids: Vec<&str> = msgs.iter().map(|(id, _)| id.as_str()).collect();
        let _: i64 = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&ids)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

/// `lanes` durable loops over `stream` (read from the start by a group of their own) into
/// `marks`, until `n` entries are acknowledged.
pub(crate) async fn run(
    client: &redis::Client,
    stream: &str,
    marks: &BareMarks,
    n: usize,
    batch: usize,
    lanes: usize,
    block: Duration,
) -> Result<Duration, BoxErr> {
    let mut conn = client.get_multiplexed_async_connection().await?;
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg("bare-durable")
        .arg("0")
        .query_async(&mut conn)
        .await?;
    marks.create().await?;
    let mut readers = Vec::new();
    for k in 0..lanes {
        readers.push(Lane {
            conn: client.get_multiplexed_async_connection().await?,
            stream: stream.to_owned(),
            group: "bare-durable".into(),
            name: format!("c{k}"),
            batch,
            block,
        });
    }
    let done = AtomicUsize::new(0);
    let t = Instant::now();
    let ended = futures_util::future::join_all(
        readers.iter().map(|r| durable_lane(r, marks, n, &done, pipelined())),
    )
    .await;
    let took = t.elapsed();
    marks.drop_table().await?;
    for r in ended {
        r?;
    }
    Ok(took)
}
