//! [`RemoteStore`]: a [`DedupStore`] whose records live behind an `idem serve`.

use std::fmt;
use std::time::Duration;

use idem_core::{
    Claim, ClaimRequest, Completion, Counts, DedupKey, DedupStore, FailKind, InspectStore, Lease,
    ListFilter, Record, RecordState, StoreError,
};
use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;

use crate::error::ApiError;
use crate::wire::*;

/// Default time a call may take, connection included: 10 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// A store reached over the claim API of an `idem serve`: the consumer engine, the HTTP layer and
/// every other user of [`DedupStore`] work on it unchanged, and the server's store (PostgreSQL,
/// Redis, …) arbitrates every race as it does in process.
///
/// Transport failures (refused, reset, timed out) are retryable backend errors, as a lost
/// database connection is; the server's answers map back to the store's errors one for one
/// (`409 lease_lost` is [`StoreError::LeaseLost`], `413` is [`StoreError::TooLarge`]).
///
/// ```no_run
/// use idem_serve::RemoteStore;
///
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RemoteStore::new("http://127.0.0.1:7700")?
///     .token(std::env::var("IDEM_TOKEN")?);
/// let consumer = idem_core::Engine::builder(store); // as with any store
/// # let _ = consumer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RemoteStore {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl fmt::Debug for RemoteStore {
    // The token never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteStore")
            .field("base", &self.base)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// A [`RemoteStore`] could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The base URL is not `http://` or `https://`.
    #[error("base URL {0:?} must start with http:// or https://")]
    Url(String),
    /// The HTTP client could not be built.
    #[error("could not build the HTTP client")]
    Client(#[source] reqwest::Error),
    /// A CA file does not parse, or the TLS settings are refused.
    #[error("tls: {0}")]
    Tls(String),
}

impl RemoteStore {
    /// A store behind the server at `base` (`http://host:port` or `https://…`), with the
    /// defaults of [`RemoteStoreBuilder`].
    ///
    /// # Errors
    /// As [`RemoteStoreBuilder::build`].
    pub fn new(base: &str) -> Result<Self, RemoteError> {
        Self::builder(base).build()
    }

    /// A builder, for a timeout, a private CA or a token.
    pub fn builder(base: &str) -> RemoteStoreBuilder {
        RemoteStoreBuilder {
            base: base.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            roots: Vec::new(),
            token: None,
        }
    }

    /// Sends `Authorization: Bearer <token>` with every call.
    #[must_use]
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    async fn call<R: DeserializeOwned>(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<Option<R>, StoreError> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let res = req.send().await.map_err(|e| StoreError::backend(op, true, e))?;
        let status = res.status();
        if status == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let bytes = res.bytes().await.map_err(|e| StoreError::backend(op, true, e))?;
        if status.is_success() {
            return serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| StoreError::Corrupt { what: format!("{op} answer: {e}") });
        }
        let problem: Problem = serde_json::from_slice(&bytes).map_err(|_| {
            StoreError::backend(
                op,
                status.is_server_error(),
                format!("HTTP {status}: {}", String::from_utf8_lossy(&bytes)),
            )
        })?;
        Err(store_error(op, ApiError::from_problem(problem)))
    }

    async fn expect<R: DeserializeOwned>(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<R, StoreError> {
        self.call(op, method, path, body)
            .await?
            .ok_or_else(|| StoreError::Corrupt { what: format!("{op}: empty answer") })
    }

    async fn no_answer(
        &self,
        op: &'static str,
        path: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<(), StoreError> {
        self.call::<serde_json::Value>(op, Method::POST, path, Some(body)).await.map(drop)
    }
}

/// Settings of a [`RemoteStore`].
#[must_use]
pub struct RemoteStoreBuilder {
    base: String,
    timeout: Duration,
    roots: Vec<CertificateDer<'static>>,
    token: Option<String>,
}

impl fmt::Debug for RemoteStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteStoreBuilder")
            .field("base", &self.base)
            .field("timeout", &self.timeout)
            .field("extra_roots", &self.roots.len())
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl RemoteStoreBuilder {
    /// Time each call may take, connecting included (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Also trust the CA certificates in `pem` for an `https://` server (the OS trust store is
    /// always trusted).
    ///
    /// # Errors
    /// [`RemoteError::Tls`] when `pem` holds no certificate or one does not parse.
    pub fn ca_pem(mut self, pem: &[u8]) -> Result<Self, RemoteError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| RemoteError::Tls(e.to_string()))?;
        if certs.is_empty() {
            return Err(RemoteError::Tls("no BEGIN CERTIFICATE block in the CA file".into()));
        }
        self.roots.extend(certs);
        Ok(self)
    }

    /// Sends `Authorization: Bearer <token>` with every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The store.
    ///
    /// # Errors
    /// [`RemoteError`] when the base is not an HTTP(S) URL or the client cannot be built.
    pub fn build(self) -> Result<RemoteStore, RemoteError> {
        let base = self.base;
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(RemoteError::Url(base));
        }
        let http = crate::tls::client_builder(&self.roots)
            .map_err(RemoteError::Tls)?
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .tcp_nodelay(true)
            .pool_max_idle_per_host(64)
            .build()
            .map_err(RemoteError::Client)?;
        Ok(RemoteStore { http, base: base.trim_end_matches('/').to_owned(), token: self.token })
    }
}

/// [`StoreError::TooLarge`] past the API's limit, checked before sending (the server checks too).
fn too_large(field: &'static str, len: usize) -> Result<(), StoreError> {
    StoreError::check_len(field, len, MAX_RESULT_BYTES)
}

/// The store error a problem stands for.
fn store_error(op: &'static str, e: ApiError) -> StoreError {
    match e {
        ApiError::LeaseLost(detail) => StoreError::LeaseLost { key: lost_key(&detail) },
        ApiError::TooLarge { field, len, limit } => StoreError::TooLarge {
            field: if field == "reason" { "reason" } else { "result" },
            len: usize::try_from(len).unwrap_or(usize::MAX),
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
        },
        ApiError::Unavailable { retryable, .. } => StoreError::backend(op, retryable, e),
        ApiError::Internal { kind: "corrupt", detail } => StoreError::Corrupt { what: detail },
        other => StoreError::backend(op, false, other),
    }
}

/// The `scope/id` of a lease-lost detail ("lease on a/b was lost: …").
fn lost_key(detail: &str) -> String {
    detail
        .strip_prefix("lease on ")
        .and_then(|d| d.split(" was lost").next())
        .unwrap_or(detail)
        .to_owned()
}

fn claim_body(r: &ClaimRequest) -> ClaimBody {
    ClaimBody {
        scope: r.key.scope().to_owned(),
        key: r.key.id().to_owned(),
        fingerprint: r.fingerprint.map(|f| hex::encode(f.as_bytes())),
        payload: None,
        lease_ms: Some(ms(r.lease_for)),
        retain_ms: Some(ms(r.retain_for)),
        takeover: (!r.takeover).then_some(false),
    }
}

/// Milliseconds, at least 1 (the API refuses 0).
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn to_claim(op: &'static str, a: ClaimAnswer) -> Result<Claim, StoreError> {
    a.into_claim().map_err(|e| StoreError::Corrupt { what: format!("{op} answer: {e}") })
}

fn complete_body(lease: &Lease, result: Option<&[u8]>, retain_for: Duration) -> CompleteBody {
    let (result, result_base64) = encode_result(result);
    CompleteBody {
        lease: LeaseBody::from_lease(lease),
        result,
        result_base64,
        retain_ms: Some(ms(retain_for)),
    }
}

/// Path segment, percent-encoded (keys may hold `/`, `?`, spaces).
fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl DedupStore for RemoteStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let a: ClaimAnswer =
            self.expect("claim", Method::POST, "/v1/claims", Some(&claim_body(req))).await?;
        to_claim("claim", a)
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let mut out = Vec::with_capacity(reqs.len());
        for chunk in reqs.chunks(MAX_BATCH) {
            let body = ClaimBatchBody { claims: chunk.iter().map(claim_body).collect() };
            let a: ClaimBatchAnswer =
                self.expect("claim_many", Method::POST, "/v1/claims/batch", Some(&body)).await?;
            if a.answers.len() != chunk.len() {
                return Err(StoreError::Corrupt {
                    what: format!("{} answers to {} claims", a.answers.len(), chunk.len()),
                });
            }
            for answer in a.answers {
                out.push(to_claim("claim_many", answer)?);
            }
        }
        Ok(out)
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        too_large("result", result.map_or(0, <[u8]>::len))?;
        self.no_answer("complete", "/v1/complete", &complete_body(&lease, result, retain_for)).await
    }

    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for c in &items {
            too_large("result", c.result.as_ref().map_or(0, Vec::len))?;
        }
        for chunk in items.chunks(MAX_BATCH) {
            let body = CompleteBatchBody {
                items: chunk
                    .iter()
                    .map(|c| complete_body(&c.lease, c.result.as_deref(), c.retain_for))
                    .collect(),
            };
            let a: CompleteBatchAnswer = self
                .expect("complete_many", Method::POST, "/v1/complete/batch", Some(&body))
                .await?;
            if a.results.len() != chunk.len() {
                return Err(StoreError::Corrupt {
                    what: format!("{} answers to {} completions", a.results.len(), chunk.len()),
                });
            }
            out.extend(a.results.into_iter().map(|p| match p {
                None => Ok(()),
                Some(p) => Err(store_error("complete_many", ApiError::from_problem(p))),
            }));
        }
        Ok(out)
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        too_large("reason", reason.len())?;
        let body = FailBody {
            lease: LeaseBody::from_lease(&lease),
            kind: Some(fail_kind_name(kind).to_owned()),
            reason: reason.to_owned(),
            retain_ms: Some(ms(retain_for)),
        };
        self.no_answer("fail", "/v1/fail", &body).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        self.no_answer(
            "release",
            "/v1/release",
            &ReleaseBody { lease: LeaseBody::from_lease(&lease) },
        )
        .await
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let body = ExtendBody { lease: LeaseBody::from_lease(lease), by_ms: ms(by) };
        let a: ExtendAnswer =
            self.expect("extend", Method::POST, "/v1/extend", Some(&body)).await?;
        lease.set_until(idem_core::Timestamp::from_micros(a.lease.until_us));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let body = PurgeBody { limit: Some(limit.clamp(1, 10_000) as u64) };
        let a: Purged = self.expect("purge", Method::POST, "/v1/purge", Some(&body)).await?;
        Ok(a.deleted)
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        let res = self
            .http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .map_err(|e| StoreError::backend("check", true, e))?;
        if res.status().is_success() {
            Ok(Vec::new())
        } else {
            let status = res.status();
            let text = res.text().await.unwrap_or_default();
            Err(StoreError::backend(
                "check",
                true,
                format!("{} /readyz: {status} {text}", self.base),
            ))
        }
    }
}

impl InspectStore for RemoteStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let path = format!("/v1/records/{}/{}", seg(key.scope()), seg(key.id()));
        match self.call::<RecordBody>("get", Method::GET, &path, None::<&()>).await {
            Ok(Some(r)) => r
                .to_record()
                .map(Some)
                .map_err(|e| StoreError::Corrupt { what: format!("get answer: {e}") }),
            Ok(None) => Ok(None),
            Err(StoreError::Backend { source, .. })
                if source
                    .downcast_ref::<ApiError>()
                    .is_some_and(|e| matches!(e, ApiError::NotFound(_))) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let mut q = vec![format!("limit={}", filter.limit.clamp(1, MAX_LIST))];
        if let Some(s) = &filter.scope {
            q.push(format!("scope={}", seg(s)));
        }
        if let Some(s) = filter.state {
            q.push(format!("state={}", s.as_str()));
        }
        let path = format!("/v1/records?{}", q.join("&"));
        let a: RecordList = self.expect("list", Method::GET, &path, None::<&()>).await?;
        a.records
            .iter()
            .map(|r| r.to_record().map_err(|e| StoreError::Corrupt { what: format!("list: {e}") }))
            .collect()
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let path = match scope {
            Some(s) => format!("/v1/stats?scope={}", seg(s)),
            None => "/v1/stats".to_owned(),
        };
        let a: CountsBody = self.expect("count", Method::GET, &path, None::<&()>).await?;
        let mut c = Counts::default();
        c.add(RecordState::InProgress, a.in_progress);
        c.add(RecordState::Completed, a.completed);
        c.add(RecordState::Released, a.released);
        c.add(RecordState::Failed, a.failed);
        c.add(RecordState::InDoubt, a.in_doubt);
        c.expired = a.expired;
        Ok(c)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let path = format!("/v1/records/{}/{}/release", seg(key.scope()), seg(key.id()));
        let a: Changed = self.expect("force_release", Method::POST, &path, None::<&()>).await?;
        Ok(a.changed)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        let path = format!("/v1/records/{}/{}/fail", seg(key.scope()), seg(key.id()));
        too_large("reason", reason.len())?;
        let body = ForceFailBody { reason: reason.to_owned() };
        let a: Changed = self.expect("force_fail", Method::POST, &path, Some(&body)).await?;
        Ok(a.changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(seg("a/b c?%"), "a%2Fb%20c%3F%25");
        assert_eq!(seg("order-1.x_~"), "order-1.x_~");
    }

    #[test]
    fn lease_lost_names_the_key() {
        assert_eq!(lost_key("lease on orders/42 was lost: the key was taken over"), "orders/42");
    }

    #[test]
    fn the_token_is_not_shown() {
        let s = RemoteStore::new("http://127.0.0.1:1").expect("client").token("s3cret-s3cret");
        assert!(!format!("{s:?}").contains("s3cret"));
        assert!(matches!(RemoteStore::new("ftp://x"), Err(RemoteError::Url(_))));
    }
}
