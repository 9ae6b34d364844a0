//! Dead letters read back from their dead-letter stream, replayed and removed: the
//! [`DeadLetterQueue`] of `idem dlq` and the console.

use futures_util::future::BoxFuture;
use idem_dlq::{DeadLetterQueue, DlqError, Letter, Republish};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{RedisError, Value};

use super::source::GROUP_FIELD;

/// The dead-letter entries a [`StreamConsumer`](crate::StreamConsumer) wrote to a stream: a
/// [`DeadLetterQueue`].
///
/// - **Id**: the entry id (`<ms>-<seq>`).
/// - **Read**: `XRANGE <key> - + COUNT <limit>`, oldest first; a read changes nothing (the
///   dead-letter stream has no consumer group of idem's).
/// - **Fields**: the payload field (default `payload`) is the letter's payload, the id field
///   (default `message_id`) its message id, every other field a header, in the entry's order.
/// - **Remove**: `XDEL`.
/// - **Republish**: `XADD <destination> * message_id <id> payload <payload> <header> <value>…`,
///   the entry [`StreamPublisher`](crate::StreamPublisher) writes and the consumer reads,
///   confirmed by the new entry's id. [`GROUP_FIELD`] (the group that dead-lettered it) is not
///   sent again. Redis has no duplicate window: a replay is always stored, and the consumer
///   finds a second one a duplicate.
///
/// `C` is any connection of the `redis` crate: a [`ConnectionManager`] (reconnects by itself),
/// a cluster connection ([`redis::cluster_async::ClusterConnection`], or a
/// [`RedisConnection`](crate::RedisConnection)): each command names one key, so on a Redis
/// Cluster it goes to the node that owns that key (the dead-letter stream and the destination
/// may live on different nodes).
///
/// ```no_run
/// use idem_dlq::{OnConflict, Workbench};
/// use idem_redis::StreamDeadLetters;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let conn = redis::Client::open("redis://127.0.0.1/")?.get_connection_manager().await?;
/// let bench = Workbench::new(StreamDeadLetters::for_source(conn, "orders")); // orders:dead-letter
/// let letters = bench.list(100).await?;
/// let report = bench.replay(&letters, OnConflict::Refuse).await?;
/// println!("{report}");
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct StreamDeadLetters<C = ConnectionManager> {
    conn: C,
    stream: String,
    id_field: String,
    payload_field: String,
}

impl<C> std::fmt::Debug for StreamDeadLetters<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDeadLetters")
            .field("stream", &self.stream)
            .field("id_field", &self.id_field)
            .field("payload_field", &self.payload_field)
            .finish_non_exhaustive()
    }
}

impl<C> StreamDeadLetters<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The dead letters in the stream at `stream` (a key), with the default fields
    /// (`message_id`, `payload`).
    pub fn new(conn: C, stream: impl Into<String>) -> Self {
        Self {
            conn,
            stream: stream.into(),
            id_field: "message_id".to_owned(),
            payload_field: "payload".to_owned(),
        }
    }

    /// The dead letters of consumers of `consumed`, where
    /// [`StreamConfig`](crate::StreamConfig) puts them by default:
    /// [`stream_for(consumed)`](Self::stream_for).
    pub fn for_source(conn: C, consumed: &str) -> Self {
        Self::new(conn, Self::stream_for(consumed))
    }

    /// The default dead-letter stream of consumers of `consumed`.
    ///
    /// ```
    /// use idem_redis::StreamDeadLetters;
    ///
    /// assert_eq!(StreamDeadLetters::<redis::aio::ConnectionManager>::stream_for("{orders}"),
    ///            "{orders}:dead-letter");
    /// ```
    pub fn stream_for(consumed: &str) -> String {
        format!("{consumed}:dead-letter")
    }

    /// The field holding the message id (default `message_id`), as the consumer's
    /// [`id_field`](crate::StreamConfig::id_field): read from the dead letters, written on a
    /// replay.
    pub fn id_field(mut self, name: impl Into<String>) -> Self {
        self.id_field = name.into();
        self
    }

    /// The field holding the payload (default `payload`), as the consumer's
    /// [`payload_field`](crate::StreamConfig::payload_field).
    pub fn payload_field(mut self, name: impl Into<String>) -> Self {
        self.payload_field = name.into();
        self
    }

    /// The dead-letter stream's key.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    async fn read_letters(&self, limit: usize) -> Result<Vec<Letter>, DlqError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let reply: Value = redis::cmd("XRANGE")
            .arg(&self.stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(limit)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| DlqError::broker(format!("XRANGE {}", self.stream), e))?;
        let entries = entries(reply).map_err(|e| {
            DlqError::broker(format!("XRANGE {}", self.stream), RedisError::from(e))
        })?;
        Ok(entries.into_iter().map(|(id, fields)| self.letter(id, fields)).collect())
    }

    fn letter(&self, id: String, fields: Fields) -> Letter {
        let mut l = Letter::new(id, Vec::new());
        for (k, v) in fields {
            let k = String::from_utf8_lossy(&k).into_owned();
            if k == self.payload_field {
                l.payload = v;
            } else if k == self.id_field {
                l.message_id = Some(String::from_utf8_lossy(&v).into_owned());
            } else {
                l.headers.push((k, String::from_utf8_lossy(&v).into_owned()));
            }
        }
        l
    }

    async fn add(&self, r: &Republish) -> Result<(), DlqError> {
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&r.destination).arg("*");
        if let Some(id) = &r.message_id {
            xadd.arg(&self.id_field).arg(id);
        }
        xadd.arg(&self.payload_field).arg(&r.payload);
        for (name, value) in &r.headers {
            // The id and payload are the replay's own; the group is the dead letter's.
            let own = [self.id_field.as_str(), self.payload_field.as_str(), GROUP_FIELD];
            if !own.iter().any(|f| name.eq_ignore_ascii_case(f)) {
                xadd.arg(name).arg(value);
            }
        }
        let what = || format!("XADD {} (replaying {})", r.destination, r.letter);
        let reply: Value = xadd
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| DlqError::broker(what(), e))?;
        match reply {
            Value::BulkString(_) | Value::SimpleString(_) => Ok(()),
            other => Err(DlqError::NotPublished {
                letter: r.letter.clone(),
                why: format!("XADD {} answered {other:?}, not an entry id", r.destination),
            }),
        }
    }
}

/// An entry's fields, in order.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// An `XRANGE` reply as `(id, fields)`, in order.
fn entries(reply: Value) -> Result<Vec<(String, Fields)>, (redis::ErrorKind, &'static str)> {
    const BAD: (redis::ErrorKind, &str) =
        (redis::ErrorKind::Parse, "an XRANGE entry is not [id, [field, value, …]]");
    let list = match reply {
        Value::Array(list) => list,
        Value::Nil => return Ok(Vec::new()),
        _ => return Err(BAD),
    };
    list.into_iter()
        .map(|entry| {
            let Value::Array(parts) = entry else { return Err(BAD) };
            let mut parts = parts.into_iter();
            let (Some(id), Some(Value::Array(flat)), None) =
                (parts.next().and_then(bytes), parts.next(), parts.next())
            else {
                return Err(BAD);
            };
            let id = String::from_utf8(id).map_err(|_| BAD)?;
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let Some(k) = flat.next() {
                let (Some(k), Some(v)) = (bytes(k), flat.next().and_then(bytes)) else {
                    return Err(BAD);
                };
                fields.push((k, v));
            }
            Ok((id, fields))
        })
        .collect()
}

fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

/// Whether `id` has the shape of a stream entry id (`XDEL` refuses the whole call otherwise).
fn entry_id(id: &str) -> bool {
    let mut parts = id.splitn(2, '-');
    let digits =
        |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    digits(parts.next()) && digits(parts.next())
}

impl<C> DeadLetterQueue for StreamDeadLetters<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn describe(&self) -> String {
        format!("redis stream {}", self.stream)
    }

    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        Box::pin(self.read_letters(limit))
    }

    /// One `XADD` per message, sent together (each to the node owning its destination); the
    /// first failure is returned (the others may have been stored: a replay is at worst twice
    /// on the stream).
    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        Box::pin(async move {
            let adds = messages.iter().map(|r| self.add(r));
            futures_util::future::join_all(adds).await.into_iter().collect()
        })
    }

    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        Box::pin(async move {
            // An id of another shape names no entry.
            let ids: Vec<&str> = ids.iter().map(String::as_str).filter(|id| entry_id(id)).collect();
            if ids.is_empty() {
                return Ok(0);
            }
            let removed: u64 = redis::cmd("XDEL")
                .arg(&self.stream)
                .arg(&ids)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(|e| DlqError::broker(format!("XDEL {}", self.stream), e))?;
            Ok(removed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn reads_entries_in_order() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("1-0"),
            Value::Array(vec![bulk("b"), bulk("2"), bulk("a"), bulk("1")]),
        ])]);
        let got = entries(reply).expect("entries");
        assert_eq!(got[0].0, "1-0");
        let names: Vec<&[u8]> = got[0].1.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(names, [b"b".as_slice(), b"a"]);
        assert!(entries(Value::Array(vec![bulk("1-0")])).is_err());
        assert!(entries(Value::Nil).expect("nil").is_empty());
    }

    #[test]
    fn every_connection_of_the_crate_will_do() {
        fn queue<Q: DeadLetterQueue>() {}
        queue::<StreamDeadLetters>();
        queue::<StreamDeadLetters<crate::RedisConnection>>();
        queue::<StreamDeadLetters<redis::cluster_async::ClusterConnection>>();
        queue::<StreamDeadLetters<redis::aio::MultiplexedConnection>>();
    }

    #[test]
    fn entry_ids() {
        assert!(entry_id("1526919030474-55"));
        for bad in ["", "1", "1-", "-1", "a-1", "1-0-0", "1-b"] {
            assert!(!entry_id(bad), "{bad}");
        }
    }
}
