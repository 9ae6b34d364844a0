//! What the offset inbox needs from the source: where each partition's reading continued from
//! ([`LogPosition::from`](idem_core::extract::LogPosition::from)), and a seek to the stored
//! positions after an assignment.
//!
//! The seek saves work, not correctness: a message below its partition's stored position is a
//! duplicate whoever reads it, and the group's Kafka offset, committed after the database, is
//! never past it. It runs at the start of a fetch (the rebalance callback runs on librdkafka's
//! thread, inside a poll, where no database can be awaited); a fetch that sees an assignment
//! arrive ends its batch early so that the next one seeks first.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};

use crate::Delivery;
use crate::rebalance::Ctx;
use crate::source::{KafkaSource, State, Tp};

/// How many fetches try to read a partition's stored position before it is left where the
/// group's offset is.
const SEEK_TRIES: u32 = 10;

impl State {
    /// Sets where the reading of `d`'s partition continued from as it is polled: the offset
    /// after the message polled before it (bridged past dead letters), or the seek position.
    pub(crate) fn read_from(&mut self, d: &mut Delivery) {
        let tp = d.tp();
        d.from = self.next_from.get(&tp).copied();
        self.bridge(d);
        self.next_from.insert(tp, d.offset() + 1);
    }

    /// Moves `d.from` back past messages dead-lettered since it was polled: a dead letter is
    /// settled but stops its partition's stored position, which `from` must reach.
    pub(crate) fn bridge(&self, d: &mut Delivery) {
        let Some(b) = self.bridges.get(&d.tp()) else { return };
        // Each step goes to a smaller offset, so this ends.
        while let Some(back) = d.from.and_then(|f| b.get(&f)) {
            d.from = *back;
        }
    }

    /// `d`'s dead-letter copy is confirmed: a message read right after it may pass it.
    pub(crate) fn dead_lettered(&mut self, d: &Delivery) {
        self.bridges.entry(d.tp()).or_default().insert(d.offset() + 1, d.from);
    }
}

impl KafkaSource {
    /// Whether partitions were assigned since the last seek.
    pub(crate) fn assigned_since(consumer: &StreamConsumer<Ctx>) -> bool {
        !consumer.context().assigned.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }

    /// Seeks the partitions assigned since the last call to their stored positions, when the
    /// source reads positions ([`KafkaConfig::stored_positions`](crate::KafkaConfig::stored_positions)).
    /// A failed read is tried again at the next fetch, up to 10 times, then left (the partition
    /// is read from the group's offset, and its duplicates skipped by offset).
    pub(crate) async fn seek_assigned(&self, consumer: &Arc<StreamConsumer<Ctx>>) {
        let assigned: Vec<(Tp, u32)> = std::mem::take(
            &mut *consumer.context().assigned.lock().unwrap_or_else(PoisonError::into_inner),
        );
        let Some(reader) = &self.positions else { return };
        if assigned.is_empty() {
            return;
        }
        let tps: Vec<Tp> = assigned.iter().map(|(tp, _)| tp.clone()).collect();
        let stored = match reader.read(&self.scope, &tps).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(target: "idem", error = %e,
                    "could not read the stored positions of the assigned partitions");
                return self.again(consumer, assigned);
            }
        };
        let mut tpl = TopicPartitionList::new();
        let mut targets = Vec::new();
        for ((tp, _), s) in assigned.into_iter().zip(stored) {
            let Some(s) = s else { continue };
            if tpl.add_partition_offset(&tp.0, tp.1, Offset::Offset(s)).is_ok() {
                targets.push((tp, s));
            }
        }
        if targets.is_empty() {
            return;
        }
        // Asynchronous (timeout 0): a seek that waits for the fetcher was seen to wait its whole
        // timeout for a partition whose fetch had not started. One that does not take leaves
        // the partition at the group's offset, which is never past the stored one: the
        // messages in between are duplicates by offset.
        if let Err(e) = consumer.seek_partitions(tpl, Duration::ZERO) {
            tracing::warn!(target: "idem", error = %e, "seeking to the stored positions failed");
            return;
        }
        let mut st = self.state();
        for (tp, s) in targets {
            tracing::debug!(target: "idem", topic = %tp.0, partition = tp.1, offset = s,
                "seeking to the stored position");
            st.next_from.insert(tp, s);
        }
    }

    /// Puts partitions back for the next fetch's seek, each up to [`SEEK_TRIES`] times.
    fn again(&self, consumer: &StreamConsumer<Ctx>, retry: Vec<(Tp, u32)>) {
        let mut a = consumer.context().assigned.lock().unwrap_or_else(PoisonError::into_inner);
        for (tp, tries) in retry {
            if tries + 1 < SEEK_TRIES {
                a.push((tp, tries + 1));
            } else {
                tracing::warn!(target: "idem", topic = %tp.0, partition = tp.1,
                    "gave up seeking to the stored position; reading from the group's offset");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(st: &mut State, offset: i64) -> Delivery {
        let mut d = Delivery::new("t", 0, offset, Vec::new());
        st.read_from(&mut d);
        d
    }

    #[test]
    fn each_message_continues_from_the_one_before_and_dead_letters_are_bridged() {
        let mut st = State::default();
        let first = read(&mut st, 5);
        assert_eq!(first.from, None, "the first after an assignment: unknown");
        let (six, seven) = (read(&mut st, 6), read(&mut st, 7));
        assert_eq!((six.from, seven.from), (Some(6), Some(7)));
        // 6 and 7 are dead-lettered (the position stopped at 6): 8 may follow once 5 is
        // committed, and a retried copy of 7 is bridged back too.
        st.dead_lettered(&six);
        st.dead_lettered(&seven);
        let mut eight = read(&mut st, 8);
        assert_eq!(eight.from, Some(6));
        let mut again = seven.clone();
        st.bridge(&mut again);
        assert_eq!(again.from, Some(6));
        // A message read after 8 continues from 8, which is not settled.
        assert_eq!(read(&mut st, 9).from, Some(9));
        st.bridge(&mut eight);
        assert_eq!(eight.from, Some(6), "bridging twice changes nothing");
    }
}
