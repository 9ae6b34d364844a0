//! The few pgoutput records the WAL relay reads (protocol version 1, `messages 'true'`), and
//! log sequence numbers as PostgreSQL writes them.
//!
//! The slot's publication has no tables, so pgoutput sends only the transactions that emitted
//! messages: `B` (begin), one `M` per `pg_logical_emit_message`, `C` (commit). Anything else is
//! skipped. Each row `pg_logical_slot_peek_binary_changes` returns holds one record.

use idem_core::StoreError;

/// One committed transaction, as far as the relay cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Committed {
    /// The end of its commit record: advancing the slot here skips this transaction.
    pub(crate) end_lsn: u64,
    /// The contents of its messages with the relay's prefix, in the order they were emitted.
    pub(crate) messages: Vec<Vec<u8>>,
}

fn corrupt(what: String) -> StoreError {
    StoreError::Corrupt { what: format!("pgoutput record: {what}") }
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at + 8)?;
    Some(u64::from_be_bytes(s.try_into().ok()?))
}

/// The transactions in `records`, in commit order, with the messages whose prefix is `prefix`.
/// A transaction cut off at the end (no `C` yet) is left out: peeks end on transaction
/// boundaries, so it does not happen, and were it to, the transaction is read again next time.
pub(crate) fn committed(records: &[Vec<u8>], prefix: &str) -> Result<Vec<Committed>, StoreError> {
    let mut out = Vec::new();
    let mut open: Option<Vec<Vec<u8>>> = None;
    for r in records {
        match r.first() {
            Some(b'B') => open = Some(Vec::new()),
            // M: flags u8, lsn u64, prefix (NUL-terminated), length u32, content.
            Some(b'M') => {
                let rest = r.get(10..).ok_or_else(|| corrupt("message cut short".into()))?;
                let nul = rest
                    .iter()
                    .position(|&b| b == 0)
                    .ok_or_else(|| corrupt("message prefix not terminated".into()))?;
                let (p, after) = (&rest[..nul], &rest[nul + 1..]);
                let len = after
                    .get(..4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                    .ok_or_else(|| corrupt("message length cut short".into()))?;
                let content = usize::try_from(len)
                    .ok()
                    .and_then(|n| after.get(4..4 + n))
                    .ok_or_else(|| corrupt(format!("message content shorter than {len} bytes")))?;
                if p == prefix.as_bytes() {
                    match open.as_mut() {
                        Some(msgs) => msgs.push(content.to_vec()),
                        None => return Err(corrupt("message outside a transaction".into())),
                    }
                }
            }
            // C: flags u8, commit lsn u64, end lsn u64, timestamp i64.
            Some(b'C') => {
                let end_lsn = be_u64(r, 10).ok_or_else(|| corrupt("commit cut short".into()))?;
                let messages = open.take().unwrap_or_default();
                out.push(Committed { end_lsn, messages });
            }
            Some(_) => {}
            None => return Err(corrupt("empty record".into())),
        }
    }
    Ok(out)
}

/// `0/1D74960` → 0x1D74960.
pub(crate) fn parse_lsn(text: &str) -> Result<u64, StoreError> {
    let bad = || StoreError::Corrupt { what: format!("log sequence number {text:?}") };
    let (hi, lo) = text.split_once('/').ok_or_else(bad)?;
    let hi = u64::from_str_radix(hi, 16).map_err(|_| bad())?;
    let lo = u64::from_str_radix(lo, 16).map_err(|_| bad())?;
    if hi > u64::from(u32::MAX) || lo > u64::from(u32::MAX) {
        return Err(bad());
    }
    Ok(hi << 32 | lo)
}

/// 0x1D74960 → `0/1D74960`.
pub(crate) fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// Rows PostgreSQL 15 returned for one transaction emitting `hello` and `\x0001` under
    /// `idem:try` (see `docs/adr/0008-wal-outbox.md`).
    #[test]
    fn decodes_what_postgres_sent() {
        let rows = [
            hex("420000000001d74930000304d9815963d6000002d8"),
            hex("4d010000000001d748f06964656d3a747279000000000568656c6c6f"),
            hex("4d010000000001d749306964656d3a74727900000000020001"),
            hex("43000000000001d749300000000001d74960000304d9815963d6"),
        ];
        let got = committed(&rows, "idem:try").unwrap();
        assert_eq!(
            got,
            vec![Committed { end_lsn: 0x1D74960, messages: vec![b"hello".to_vec(), vec![0, 1]] }]
        );
        assert!(committed(&rows, "other").unwrap()[0].messages.is_empty());
        assert!(committed(&rows[..3], "idem:try").unwrap().is_empty(), "no commit yet");
        let mut cut = rows[1].clone();
        cut.truncate(cut.len() - 1);
        assert!(committed(&[rows[0].clone(), cut], "idem:try").is_err());
    }

    #[test]
    fn lsns_round_trip() {
        assert_eq!(parse_lsn("0/1D74960").unwrap(), 0x1D74960);
        assert_eq!(format_lsn(0x1_0000_00FF), "1/FF");
        assert_eq!(parse_lsn(&format_lsn(u64::MAX)).unwrap(), u64::MAX);
        assert!(parse_lsn("1D74960").is_err() && parse_lsn("x/1").is_err());
    }
}
