//! How one outbox message is laid out in a WAL message's content.
//!
//! The fields are the table outbox's columns, in the same encodings (headers as the JSON array
//! of pairs of [`encode_headers`]), framed by lengths instead of columns:
//!
//! ```text
//! u8  version (1)
//! u16 id length,           id (UTF-8)
//! u16 destination length,  destination (UTF-8)
//! u16 ordering key length + 1 (0: none), ordering key (UTF-8)
//! u32 headers length,      headers (JSON text)
//! …   payload (the rest)
//! ```
//! Integers are big-endian.

use idem_core::StoreError;
use idem_core::outbox::{OutboxId, OutboxMessage, decode_headers, encode_headers};

const VERSION: u8 = 1;

/// The content of the WAL message that carries `m`.
pub(crate) fn encode(m: &OutboxMessage) -> Vec<u8> {
    let headers = encode_headers(m.headers());
    let key = m.ordering_key().unwrap_or("");
    let mut out = Vec::with_capacity(
        11 + m.id().as_str().len()
            + m.destination().len()
            + key.len()
            + headers.len()
            + m.payload().len(),
    );
    out.push(VERSION);
    // Lengths fit: `Outgoing::validate` bounds ids, destinations and keys to 255 bytes and
    // headers to 64 × 4 KiB.
    let short = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&u16::try_from(s.len()).unwrap_or(u16::MAX).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    short(&mut out, m.id().as_str());
    short(&mut out, m.destination());
    match m.ordering_key() {
        Some(k) => {
            out.extend_from_slice(&u16::try_from(k.len() + 1).unwrap_or(u16::MAX).to_be_bytes());
            out.extend_from_slice(k.as_bytes());
        }
        None => out.extend_from_slice(&0u16.to_be_bytes()),
    }
    out.extend_from_slice(&u32::try_from(headers.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(headers.as_bytes());
    out.extend_from_slice(m.payload());
    out
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt { what: format!("WAL outbox message: {what}") }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], StoreError> {
        if self.0.len() < n {
            return Err(corrupt(&format!("cut short in the {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self, what: &str) -> Result<usize, StoreError> {
        let b = self.take(2, what)?;
        Ok(usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    fn text(&mut self, n: usize, what: &str) -> Result<String, StoreError> {
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| corrupt(&format!("{what} is not UTF-8")))
    }
}

/// The message carried by a WAL message's `content`.
pub(crate) fn decode(content: &[u8]) -> Result<OutboxMessage, StoreError> {
    let mut r = Reader(content);
    let version = r.take(1, "version")?[0];
    if version != VERSION {
        return Err(corrupt(&format!("unknown version {version}")));
    }
    let n = r.u16("id length")?;
    let id = r.text(n, "id")?;
    let n = r.u16("destination length")?;
    let destination = r.text(n, "destination")?;
    let key = match r.u16("ordering key length")? {
        0 => None,
        n => Some(r.text(n - 1, "ordering key")?),
    };
    let b = r.take(4, "headers length")?;
    let n = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let n = usize::try_from(n).map_err(|_| corrupt("headers length"))?;
    let headers = decode_headers(&r.text(n, "headers")?)?;
    Ok(OutboxMessage::from_parts(
        OutboxId::from_stored(id),
        destination,
        r.0.to_vec(),
        headers,
        key,
    ))
}

#[cfg(test)]
mod tests {
    use idem_core::outbox::Outgoing;
    use proptest::prelude::*;

    use super::*;

    fn message(key: Option<String>, payload: Vec<u8>) -> OutboxMessage {
        let mut m = Outgoing::new("orders.accepted", payload).header("content-type", "x/y");
        if let Some(k) = key {
            m = m.ordering_key(k);
        }
        m.into_message(OutboxId::random)
    }

    #[test]
    fn round_trips_with_and_without_a_key() {
        for m in [message(None, b"p".to_vec()), message(Some("k".into()), Vec::new())] {
            assert_eq!(decode(&encode(&m)).unwrap(), m);
        }
    }

    #[test]
    fn cut_or_foreign_content_is_corrupt() {
        let bytes = encode(&message(Some("customer-7".into()), b"payload".to_vec()));
        for end in 0..bytes.len() - b"payload".len() {
            assert!(matches!(decode(&bytes[..end]), Err(StoreError::Corrupt { .. })), "{end}");
        }
        assert!(matches!(decode(b"\x02abc"), Err(StoreError::Corrupt { .. })));
    }

    proptest! {
        #[test]
        fn any_message_round_trips(key in proptest::option::of("[a-z]{1,20}"),
                                   payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let m = message(key, payload);
            prop_assert_eq!(decode(&encode(&m)).unwrap(), m);
        }

        #[test]
        fn any_bytes_decode_or_are_corrupt(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            match decode(&bytes) {
                Ok(_) | Err(StoreError::Corrupt { .. }) => {}
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
    }
}
