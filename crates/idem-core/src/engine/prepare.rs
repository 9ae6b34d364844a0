//! Making a delivery ready for its claim: its key and fingerprint, or the outcome decided
//! without the store (no usable key, a payload the fingerprint cannot read).

use super::{Cause, Engine, FailureKind, MissingKeyPolicy, Outcome};
use crate::extract::{Envelope, ExtractError};
use crate::{ClaimRequest, DedupKey, KeyError};

/// A delivery made ready for its claim.
#[derive(Debug)]
pub(crate) enum Prepared<T, E> {
    /// Claim (or mark) this key with this fingerprint.
    Claim(ClaimRequest),
    /// No key, and the policy processes such messages without dedup.
    Unkeyed,
    /// Decided already.
    Done(Outcome<T, E>),
}

/// Why a message yields no usable key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFailure {
    /// The message carries no key where the extractor looks.
    #[error(transparent)]
    Missing(ExtractError),
    /// The key is there but unreadable (wrong JSON type, not JSON).
    #[error(transparent)]
    Extract(ExtractError),
    /// The key is malformed (empty, too long, NUL).
    #[error("invalid dedup key: {0}")]
    Invalid(KeyError),
}

impl<E> From<KeyFailure> for Cause<E> {
    fn from(f: KeyFailure) -> Self {
        match f {
            KeyFailure::Missing(e) => Cause::MissingKey(e),
            KeyFailure::Extract(e) => Cause::Extract(e),
            KeyFailure::Invalid(e) => Cause::InvalidKey(e),
        }
    }
}

impl<B> Engine<B> {
    /// The key this engine would use for `msg`.
    ///
    /// # Errors
    /// [`KeyFailure`]: what would fail the delivery (missing or invalid key).
    pub fn key_of<M: Envelope>(&self, msg: &M) -> Result<DedupKey, KeyFailure> {
        self.key_from(self.cfg.extractor.extract(msg as &dyn Envelope))
    }

    /// [`key_of`](Self::key_of) for a payload parsed as `json` already.
    fn key_of_parsed<M: Envelope>(
        &self,
        msg: &M,
        json: &serde_json::Value,
    ) -> Result<DedupKey, KeyFailure> {
        self.key_from(self.cfg.extractor.extract_parsed(msg as &dyn Envelope, json))
    }

    fn key_from(&self, id: Result<String, ExtractError>) -> Result<DedupKey, KeyFailure> {
        let id = id.map_err(|e| {
            if e.is_missing() { KeyFailure::Missing(e) } else { KeyFailure::Extract(e) }
        })?;
        DedupKey::with_limit(self.cfg.scope.clone(), id, self.cfg.max_key_bytes)
            .map_err(KeyFailure::Invalid)
    }

    /// The fingerprint this engine would record for `msg`.
    ///
    /// # Errors
    /// The parse error when the fingerprint spec needs JSON and the payload is not JSON.
    pub fn fingerprint_of<M: Envelope>(
        &self,
        msg: &M,
    ) -> Result<Option<crate::Fingerprint>, serde_json::Error> {
        self.cfg.fingerprint.fingerprint(msg.payload())
    }

    /// The key and fingerprint of `msg` as a claim request, or the outcome that needs no store.
    /// A payload the fingerprint reads as JSON is parsed once, for the key extractor too.
    pub(crate) fn prepare<M: Envelope, T, E>(&self, msg: &M) -> Prepared<T, E> {
        let spec = &self.cfg.fingerprint;
        let parsed: Option<serde_json::Value> =
            spec.reads_json().then(|| serde_json::from_slice(msg.payload()).ok()).flatten();
        let key = match parsed.as_ref() {
            Some(json) => self.key_of_parsed(msg, json),
            None => self.key_of(msg),
        };
        let key = match key {
            Ok(k) => k,
            Err(KeyFailure::Missing(_))
                if self.cfg.missing_key == MissingKeyPolicy::ProcessWithoutDedup =>
            {
                return Prepared::Unkeyed;
            }
            Err(e) => return Prepared::Done(Outcome::failed(FailureKind::Permanent, e.into())),
        };
        let fp = match parsed.as_ref() {
            Some(json) => Ok(spec.fingerprint_parsed(msg.payload(), json)),
            None => spec.fingerprint(msg.payload()),
        };
        match fp {
            Ok(fp) => Prepared::Claim(ClaimRequest::new(key, fp, self.cfg.lease, self.cfg.retain)),
            Err(e) => Prepared::Done(Outcome::failed(FailureKind::Permanent, Cause::Payload(e))),
        }
    }
}
