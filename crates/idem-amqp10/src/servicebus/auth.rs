//! Service Bus credentials: connection strings, SAS tokens, Entra ID token sources, and the
//! claims-based-security (`$cbs`) handshake that puts a token before a link attaches.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::primitives::Timestamp;
use fe2o3_amqp_cbs::client::CbsClient;
use fe2o3_amqp_cbs::token::CbsToken;
use hmac::{Hmac, Mac};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// What `urllib.parse.quote_plus` and .NET's `UrlEncode` leave alone (the Azure SDKs' SAS
/// encoding): letters, digits and `-_.~`.
const SAS: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');

use idem_core::redact::Redacted;

use crate::error::Error;

/// The error a [`TokenSource`] reports.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What kind of token a [`TokenSource`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenKind {
    /// An Entra ID (Azure AD) access token.
    Jwt,
    /// A shared access signature.
    Sas,
}

impl TokenKind {
    fn cbs_type(self) -> &'static str {
        match self {
            Self::Jwt => "jwt",
            Self::Sas => "servicebus.windows.net:sastoken",
        }
    }
}

/// A token and when it expires.
#[derive(Clone)]
#[non_exhaustive]
pub struct AccessToken {
    /// The token.
    pub token: String,
    /// Its kind.
    pub kind: TokenKind,
    /// When it stops being valid.
    pub expires_at: SystemTime,
}

impl AccessToken {
    /// A token of `kind` valid until `expires_at`.
    pub fn new(token: impl Into<String>, kind: TokenKind, expires_at: SystemTime) -> Self {
        Self { token: token.into(), kind, expires_at }
    }
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessToken")
            .field("kind", &self.kind)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Where tokens come from, for Entra ID: wrap `azure_identity`'s credential (scope
/// `https://servicebus.azure.net/.default`), or anything else that issues tokens.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idem_amqp10::{AccessToken, BoxError, ServiceBus, TokenKind, TokenSource};
///
/// struct Fixed(String);
/// impl TokenSource for Fixed {
///     fn token<'a>(&'a self, _audience: &'a str)
///         -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<AccessToken, BoxError>> + Send + 'a>> {
///         let t = AccessToken::new(self.0.clone(), TokenKind::Jwt, SystemTime::now() + Duration::from_secs(3600));
///         Box::pin(async move { Ok(t) })
///     }
/// }
/// let sb = ServiceBus::with_token_source("shop.servicebus.windows.net", Fixed("eyJ…".into()));
/// ```
pub trait TokenSource: Send + Sync + 'static {
    /// A token for `audience` (`sb://<namespace>/<entity>`).
    fn token<'a>(
        &'a self,
        audience: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<AccessToken, BoxError>> + Send + 'a>>;
}

/// How the namespace is authorised.
#[derive(Clone)]
pub(crate) enum Credential {
    /// A shared access key: tokens are signed here.
    Key { name: String, key: String },
    /// A ready-made shared access signature (connection string `SharedAccessSignature=`).
    Signature(String),
    /// Tokens from elsewhere (Entra ID).
    Source(Arc<dyn TokenSource>),
}

impl std::fmt::Debug for Credential {
    // Never print a key or a token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Key { name, .. } => write!(f, "SharedAccessKey({name}, ***)"),
            Self::Signature(_) => f.write_str("SharedAccessSignature(***)"),
            Self::Source(_) => f.write_str("TokenSource"),
        }
    }
}

/// How long a SAS token signed here is valid; it is put again well before.
const SAS_LIFETIME: Duration = Duration::from_secs(3600);

impl Credential {
    async fn token(&self, audience: &str) -> Result<AccessToken, Error> {
        match self {
            Self::Key { name, key } => {
                let expires_at = SystemTime::now() + SAS_LIFETIME;
                let token = sas_token(audience, name, key, expires_at)?;
                Ok(AccessToken::new(token, TokenKind::Sas, expires_at))
            }
            Self::Signature(sig) => {
                // A signature carries its own expiry (`se=`); assume an hour if it is unreadable.
                let expires_at =
                    signature_expiry(sig).unwrap_or_else(|| SystemTime::now() + SAS_LIFETIME);
                Ok(AccessToken::new(sig.clone(), TokenKind::Sas, expires_at))
            }
            Self::Source(source) => source.token(audience).await.map_err(|e| Error::Authorize {
                audience: audience.to_owned(),
                reason: e.to_string(),
            }),
        }
    }
}

/// A SAS token for `resource`: `SharedAccessSignature sr=…&sig=…&se=…&skn=…`, signed with
/// HMAC-SHA256 over the encoded resource and the expiry, as Service Bus verifies it.
pub(crate) fn sas_token(
    resource: &str,
    key_name: &str,
    key: &str,
    expires_at: SystemTime,
) -> Result<String, Error> {
    let expiry = expires_at
        .duration_since(UNIX_EPOCH)
        .map_err(|_| Error::config("expiry", "before 1970"))?
        .as_secs();
    let sr = utf8_percent_encode(resource, SAS).to_string();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes())
        .map_err(|_| Error::config("SharedAccessKey", "cannot key HMAC-SHA256"))?;
    mac.update(format!("{sr}\n{expiry}").as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    let sig = utf8_percent_encode(&sig, SAS);
    let skn = utf8_percent_encode(key_name, SAS);
    Ok(format!("SharedAccessSignature sr={sr}&sig={sig}&se={expiry}&skn={skn}"))
}

fn signature_expiry(sig: &str) -> Option<SystemTime> {
    let se = sig.split(['&', ' ']).find_map(|p| p.strip_prefix("se="))?;
    Some(UNIX_EPOCH + Duration::from_secs(se.parse().ok()?))
}

pub(crate) struct Parsed {
    pub(crate) host: String,
    pub(crate) credential: Credential,
    pub(crate) entity_path: Option<String>,
}

/// Parses `Endpoint=sb://host/;SharedAccessKeyName=…;SharedAccessKey=…[;EntityPath=…]`.
pub(crate) fn parse_connection_string(connection: &str) -> Result<Parsed, Error> {
    let mut endpoint = None;
    let (mut name, mut key, mut signature, mut entity) = (None, None, None, None);
    let parts = connection.split(';').map(str::trim).enumerate().filter(|(_, p)| !p.is_empty());
    for (i, part) in parts {
        // Its text is not shown: it could be a key pasted without its name.
        let (k, v) = part.split_once('=').ok_or_else(|| {
            Error::config("connection string", format!("part {} is not key=value", i + 1))
        })?;
        match k.to_ascii_lowercase().as_str() {
            "endpoint" => endpoint = Some(v),
            "sharedaccesskeyname" => name = Some(v),
            "sharedaccesskey" => key = Some(v),
            "sharedaccesssignature" => signature = Some(v),
            "entitypath" => entity = Some(v),
            _ => {} // UseDevelopmentEmulator, TransportType…: not ours to judge
        }
    }
    let endpoint =
        endpoint.ok_or_else(|| Error::config("Endpoint", "missing from the connection string"))?;
    let host = endpoint
        .strip_prefix("sb://")
        .ok_or_else(|| {
            Error::config("Endpoint", format!("`{}` does not start with sb://", Redacted(endpoint)))
        })?
        .trim_end_matches('/');
    // No user-info either: a key there would become the host name, shown in Debug and errors.
    if host.is_empty() || host.contains(['/', '@']) {
        let shown = Redacted(endpoint);
        return Err(Error::config("Endpoint", format!("`{shown}` is not sb://<namespace>/")));
    }
    let credential = match (name, key, signature) {
        (_, _, Some(sig)) => Credential::Signature(sig.to_owned()),
        (Some(name), Some(key), None) if !name.is_empty() && !key.is_empty() => {
            Credential::Key { name: name.to_owned(), key: key.to_owned() }
        }
        (None | Some(""), _, None) => {
            return Err(Error::config("SharedAccessKeyName", "missing from the connection string"));
        }
        _ => return Err(Error::config("SharedAccessKey", "missing from the connection string")),
    };
    let entity_path = entity.filter(|e| !e.is_empty()).map(str::to_owned);
    Ok(Parsed { host: host.to_owned(), credential, entity_path })
}

/// Puts a token for `entity` on the `$cbs` node, then keeps putting a fresh one before it
/// expires, on a task that ends with the source.
pub(crate) async fn authorize(
    session: &mut SessionHandle<()>,
    host: &str,
    entity: &str,
    credential: Credential,
    bound: Duration,
) -> Result<Option<tokio::task::JoinHandle<()>>, Error> {
    let audience = format!("sb://{host}/{entity}");
    let fail = |reason: String| Error::Authorize { audience: audience.clone(), reason };
    let mut cbs = tokio::time::timeout(bound, CbsClient::attach(session))
        .await
        .map_err(|_| Error::Timeout { verb: "attach $cbs", after: bound })?
        .map_err(|e| fail(e.to_string()))?;
    let mut expires_at = put(&mut cbs, &audience, &credential, bound).await?;
    let task = tokio::spawn(async move {
        loop {
            // Renew at 80 % of the remaining lifetime, at least a second apart.
            let left = expires_at.duration_since(SystemTime::now()).unwrap_or_default();
            tokio::time::sleep((left * 4 / 5).max(Duration::from_secs(1))).await;
            match put(&mut cbs, &audience, &credential, bound).await {
                Ok(next) => expires_at = next,
                Err(e) => tracing::warn!(error = %e, "token renewal failed; retrying"),
            }
        }
    });
    Ok(Some(task))
}

async fn put(
    cbs: &mut CbsClient,
    audience: &str,
    credential: &Credential,
    bound: Duration,
) -> Result<SystemTime, Error> {
    let token = credential.token(audience).await?;
    let millis = token
        .expires_at
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .unwrap_or(i64::MAX);
    let cbs_token = CbsToken::new(
        token.token.as_str(),
        token.kind.cbs_type(),
        Timestamp::from_milliseconds(millis),
    );
    tokio::time::timeout(bound, cbs.put_token(audience, cbs_token))
        .await
        .map_err(|_| Error::Timeout { verb: "put-token", after: bound })?
        .map_err(|e| Error::Authorize { audience: audience.to_owned(), reason: e.to_string() })?;
    Ok(token.expires_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_portal_connection_string() {
        let p = parse_connection_string(
            "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=abc=;EntityPath=orders",
        )
        .unwrap();
        assert_eq!(p.host, "shop.servicebus.windows.net");
        assert_eq!(p.entity_path.as_deref(), Some("orders"));
        assert!(
            matches!(p.credential, Credential::Key { ref name, ref key } if name == "listen" && key == "abc=")
        );
        assert_eq!(format!("{:?}", p.credential), "SharedAccessKey(listen, ***)");
    }

    #[test]
    fn names_the_missing_field() {
        let err = |s: &str| match parse_connection_string(s) {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}", other = other.map(|_| ())),
        };
        assert_eq!(err("SharedAccessKeyName=a;SharedAccessKey=b"), "Endpoint");
        assert_eq!(err("Endpoint=https://x/;SharedAccessKeyName=a;SharedAccessKey=b"), "Endpoint");
        assert_eq!(err("Endpoint=sb://x/;SharedAccessKey=b"), "SharedAccessKeyName");
        assert_eq!(err("Endpoint=sb://x/;SharedAccessKeyName=a"), "SharedAccessKey");
        assert_eq!(err("Endpoint=sb://x/;garbage"), "connection string");
    }

    #[test]
    fn errors_and_debug_never_show_a_key() {
        const KEY: &str = "UGxhbnRlZFNlY3JldEtleQ==";
        // A key pasted without its name; a key in the endpoint's user-info.
        for s in [
            format!("Endpoint=sb://x/;SharedAccessKeyName=a;{KEY}"),
            format!("Endpoint=sb://a:{KEY}@x/y;SharedAccessKeyName=a;SharedAccessKey=b"),
            format!("Endpoint=sb://a:{KEY}@x/;SharedAccessKeyName=a;SharedAccessKey=b"),
            format!("Endpoint=https://a:{KEY}@x/;SharedAccessKeyName=a;SharedAccessKey=b"),
        ] {
            let e = parse_connection_string(&s).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(!e.is_empty() && !e.contains(KEY.trim_end_matches('=')), "{e}");
        }
        let s = format!("Endpoint=sb://x/;SharedAccessKeyName=a;SharedAccessKey={KEY}");
        let sb = crate::ServiceBus::from_connection_string(&s).unwrap();
        assert!(!format!("{sb:?}").contains(KEY), "{sb:?}");
        let s =
            format!("Endpoint=sb://x/;SharedAccessSignature=SharedAccessSignature sr=x&sig={KEY}");
        let sb = crate::ServiceBus::from_connection_string(&s).unwrap();
        assert!(!format!("{sb:?}").contains(KEY), "{sb:?}");
        let url = format!("amqp://u:{KEY}@h:5672/?password={KEY}");
        let config = crate::Amqp10Config::new(url, "q");
        let d = format!("{config:?}");
        assert!(!d.contains(KEY) && d.contains("amqp://u:***@h:5672"), "{d}");
    }

    #[test]
    fn signs_as_the_azure_sdks_do() {
        // Python's hmac + urllib.parse.quote_plus (the Azure SDK's recipe) gave this token.
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let t =
            sas_token("sb://shop.servicebus.windows.net/orders", "listen", "c2VjcmV0", at).unwrap();
        assert_eq!(
            t,
            "SharedAccessSignature sr=sb%3A%2F%2Fshop.servicebus.windows.net%2Forders\
             &sig=23Mtwm6On%2FkLLa8t5VHYXrV7iunN%2FPM%2BDyaJ9cEb5IM%3D&se=1700000000&skn=listen"
        );
        assert_eq!(signature_expiry(&t), Some(at));
    }
}
