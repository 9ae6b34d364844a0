//! The console through its routes, in process: login, sessions, CSRF, read-only mode, scopes,
//! and the dead-letter rules (a conflict group is never replayed under its key; a replayed
//! group is republished, then removed).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Fingerprint, InspectStore, MemoryStore,
    RecordState,
};
use idem_dlq::{Letter, MemoryDeadLetters};
use idem_serve::console::Console;
use idem_serve::{MetricsRender, Scopes, Token, Tokens};
use tower::ServiceExt as _;

const ADMIN: &str = "admin-secret-0123456789";
const ORDERS: &str = "orders-secret-0123456789";

fn tokens() -> Tokens {
    Tokens::new(vec![
        Token::new("admin", ADMIN, Scopes::All).expect("token"),
        Token::new("orders-team", ORDERS, Scopes::from_list(["orders"])).expect("token"),
    ])
    .expect("tokens")
}

/// A dead letter as idem's consumer writes it.
fn letter(id: &str, scope: &str, outcome: &str, reason: &str, payload: &str) -> Letter {
    Letter::new(id, payload.as_bytes().to_vec())
        .with_message_id(format!("m-{id}"))
        .with_content_type("application/json")
        .with_header("traceparent", "00-abc-def-01")
        .with_header("idem-outcome", outcome)
        .with_header("idem-reason", reason)
        .with_header("idem-scope", scope)
        .with_header("idem-key", format!("m-{id}"))
        .with_header("idem-source", format!("{scope}-stream"))
}

struct Fixture {
    store: MemoryStore,
    queue: MemoryDeadLetters,
    app: Router,
}

/// Three poison letters and a conflict in `orders`, one failure in `payments`; an in-progress
/// record in each scope.
async fn fixture(read_only: bool) -> Fixture {
    let store = MemoryStore::new();
    let queue = MemoryDeadLetters::new();
    for i in 1..=3 {
        queue.push(letter(
            &format!("{i}-0"),
            "orders",
            "failed_permanent",
            &format!("HTTP 422 from the application: order {i} is poison"),
            &format!("{{\"id\":{i},\"poison\":true}}"),
        ));
    }
    queue.push(letter(
        "4-0",
        "orders",
        "conflict",
        "key reused with another payload",
        "{\"id\":2}",
    ));
    queue.push(letter("5-0", "payments", "failed_permanent", "card <b>declined</b>", "{}"));
    for (scope, id) in [("orders", "held-1"), ("payments", "held-2")] {
        let req = ClaimRequest::new(
            DedupKey::new(scope, id).expect("key"),
            None,
            Duration::from_secs(600),
            Duration::from_secs(3600),
        );
        let Claim::Acquired(lease) = store.claim(&req).await.expect("claim") else {
            panic!("a new key is acquired");
        };
        drop(lease);
    }
    // The record of the conflict's key, completed with another payload.
    let req = ClaimRequest::new(
        DedupKey::new("orders", "m-4-0").expect("key"),
        Some(Fingerprint::of_bytes(b"{\"id\":1}")),
        Duration::from_secs(600),
        Duration::from_secs(3600),
    );
    let Claim::Acquired(lease) = store.claim(&req).await.expect("claim") else {
        panic!("a new key is acquired");
    };
    store.complete(lease, None, Duration::from_secs(3600)).await.expect("complete");
    let metrics: MetricsRender = Arc::new(|| {
        "idem_outcomes_total{scope=\"orders\",outcome=\"processed\"} 12\n\
         idem_outcomes_total{scope=\"payments\",outcome=\"processed\"} 5\n\
         idem_dead_letters_total{scope=\"orders\",outcome=\"failed_permanent\"} 3\n"
            .to_owned()
    });
    let console =
        Console::new().read_only(read_only).dead_letters("orders", Arc::new(queue.clone()));
    let app = idem_serve::router_with_console(store.clone(), tokens(), Some(metrics), console);
    Fixture { store, queue, app }
}

struct Answer {
    status: StatusCode,
    location: Option<String>,
    set_cookie: Option<String>,
    body: String,
}

struct Browser {
    app: Router,
    cookie: Option<String>,
}

impl Browser {
    fn new(app: &Router) -> Self {
        Self { app: app.clone(), cookie: None }
    }

    async fn send(&mut self, req: Request<Body>) -> Answer {
        let res = self.app.clone().oneshot(req).await.expect("infallible");
        let h = |n: header::HeaderName| {
            res.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_owned)
        };
        let (location, set_cookie) = (h(header::LOCATION), h(header::SET_COOKIE));
        if let Some(c) = &set_cookie {
            let pair = c.split(';').next().unwrap_or_default();
            self.cookie =
                pair.split_once('=').filter(|(_, v)| !v.is_empty()).map(|_| pair.to_owned());
        }
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 24).await.expect("body");
        Answer { status, location, set_cookie, body: String::from_utf8_lossy(&bytes).into_owned() }
    }

    async fn get(&mut self, path: &str) -> Answer {
        let mut req = Request::get(path);
        if let Some(c) = &self.cookie {
            req = req.header(header::COOKIE, c);
        }
        self.send(req.body(Body::empty()).expect("request")).await
    }

    async fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Answer {
        let body: String =
            form_urlencoded::Serializer::new(String::new()).extend_pairs(fields).finish();
        let mut req =
            Request::post(path).header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        if let Some(c) = &self.cookie {
            req = req.header(header::COOKIE, c);
        }
        self.send(req.body(Body::from(body)).expect("request")).await
    }

    async fn login(app: &Router, token: &str) -> Self {
        let mut b = Self::new(app);
        let a = b.post("/console/login", &[("token", token)]).await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
        assert!(b.cookie.is_some(), "a session cookie");
        b
    }

    /// The CSRF token of the session, as its pages carry it.
    async fn csrf(&mut self) -> String {
        let page = self.get("/console").await.body;
        let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
        page[at..at + 64].to_owned()
    }
}

/// The group id of letter `id`, as the pages link it.
async fn group_of(f: &Fixture, id: &str) -> String {
    read(&f.queue).await.into_iter().find(|l| l.id == id).expect("letter").group().id()
}

async fn read(q: &MemoryDeadLetters) -> Vec<Letter> {
    use idem_dlq::DeadLetterQueue as _;
    q.read(1000).await.expect("read")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_takes_a_known_token_and_refuses_a_wrong_one() {
    let f = fixture(false).await;
    let mut anon = Browser::new(&f.app);
    let a = anon.get("/console").await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert_eq!(a.location.as_deref(), Some("/console/login"));
    assert_eq!(anon.get("/console/metrics.json").await.status, StatusCode::UNAUTHORIZED);

    let a = anon.post("/console/login", &[("token", "wrong-secret-0123456789")]).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert!(a.set_cookie.is_none() && a.body.contains("unknown token"), "{}", a.body);
    let a = anon.post("/console/login", &[("token", "")]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let long = "x".repeat(2000);
    assert_eq!(
        anon.post("/console/login", &[("token", &long)]).await.status,
        StatusCode::BAD_REQUEST
    );

    let a = anon.post("/console/login", &[("token", ADMIN)]).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    let cookie = a.set_cookie.expect("cookie");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age=28800"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    assert!(!cookie.contains(ADMIN), "the token is not the cookie");
    let page = anon.get("/console").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(
        page.body.contains("Records by state") && page.body.contains(">admin<"),
        "{}",
        page.body
    );

    // A forged cookie is no session.
    let mut forged = Browser::new(&f.app);
    forged.cookie = Some(format!("idem_console={}", "a".repeat(64)));
    assert_eq!(forged.get("/console").await.status, StatusCode::SEE_OTHER);

    // Logging out ends the session on the server, not only in the browser.
    let old = anon.cookie.clone();
    let csrf = anon.csrf().await;
    assert_eq!(
        anon.post("/console/logout", &[("csrf", &csrf)]).await.status,
        StatusCode::SEE_OTHER
    );
    anon.cookie = old;
    assert_eq!(anon.get("/console").await.status, StatusCode::SEE_OTHER);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_without_its_csrf_token_is_403_and_changes_nothing() {
    let f = fixture(false).await;
    let mut b = Browser::login(&f.app, ADMIN).await;
    let group = group_of(&f, "1-0").await;
    let url = format!("/console/dead-letters/orders/groups/{group}");
    let held = DedupKey::new("orders", "held-1").expect("key");
    for csrf in [None, Some("0".repeat(64)), Some(String::new())] {
        let mut fields = vec![("action", "replay"), ("target", "group")];
        if let Some(c) = &csrf {
            fields.push(("csrf", c));
        }
        let a = b.post(&url, &fields).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{csrf:?}");
        assert!(a.body.contains("CSRF"), "{}", a.body);
        let mut release = vec![("scope", "orders"), ("key", "held-1")];
        if let Some(c) = &csrf {
            release.push(("csrf", c));
        }
        assert_eq!(b.post("/console/store/release", &release).await.status, StatusCode::FORBIDDEN);
    }
    assert_eq!(f.queue.len(), 5);
    assert!(f.queue.published().is_empty());
    let rec = f.store.get(&held).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::InProgress);

    // Another session's token is not this one's.
    let mut other = Browser::login(&f.app, ADMIN).await;
    let theirs = other.csrf().await;
    let fields = [("action", "replay"), ("target", "group"), ("csrf", theirs.as_str())];
    assert_eq!(b.post(&url, &fields).await.status, StatusCode::FORBIDDEN);
    // Without a session at all.
    let mut anon = Browser::new(&f.app);
    assert_eq!(anon.post(&url, &fields).await.status, StatusCode::FORBIDDEN);
    assert_eq!(f.queue.len(), 5);

    // A form from another origin is refused even with the right token.
    let mine = b.csrf().await;
    let body = format!("action=replay&target=group&csrf={mine}");
    let req = Request::post(&url)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .header(header::COOKIE, b.cookie.clone().expect("cookie"))
        .header(header::HOST, "127.0.0.1:7700")
        .header(header::ORIGIN, "http://evil.example")
        .body(Body::from(body))
        .expect("request");
    assert_eq!(b.send(req).await.status, StatusCode::FORBIDDEN);
    assert_eq!(f.queue.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_shows_no_action_and_refuses_every_one() {
    let f = fixture(true).await;
    let mut b = Browser::login(&f.app, ADMIN).await;
    let group = group_of(&f, "1-0").await;
    let pages = [
        "/console".to_owned(),
        "/console/dead-letters".to_owned(),
        format!("/console/dead-letters/orders/groups/{group}"),
        "/console/dead-letters/orders/letter?id=1-0".to_owned(),
    ];
    for p in &pages {
        let a = b.get(p).await;
        assert_eq!(a.status, StatusCode::OK, "{p}");
        assert!(a.body.contains("read-only"), "{p}");
        // The only form, and the only button, left is logging out's.
        assert_eq!(a.body.matches("<form").count(), 1, "{p}: {}", a.body);
        assert_eq!(a.body.matches("<button").count(), 1, "{p}: {}", a.body);
    }
    let csrf = b.csrf().await;
    let url = format!("/console/dead-letters/orders/groups/{group}");
    let a = b.post(&url, &[("action", "replay"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert!(a.body.contains("read-only"));
    let release = [("scope", "orders"), ("key", "held-1"), ("csrf", csrf.as_str())];
    assert_eq!(b.post("/console/store/release", &release).await.status, StatusCode::FORBIDDEN);
    let fail = [("scope", "orders"), ("key", "held-1"), ("reason", "x"), ("csrf", csrf.as_str())];
    assert_eq!(b.post("/console/store/fail", &fail).await.status, StatusCode::FORBIDDEN);
    assert_eq!(f.queue.len(), 5);
    assert!(f.queue.published().is_empty());
    let held = DedupKey::new("orders", "held-1").expect("key");
    assert_eq!(
        f.store.get(&held).await.expect("get").expect("record").state,
        RecordState::InProgress
    );
    // Logging out still works.
    assert_eq!(b.post("/console/logout", &[("csrf", &csrf)]).await.status, StatusCode::SEE_OTHER);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_sees_and_acts_only_on_its_scopes() {
    let f = fixture(false).await;
    let mut b = Browser::login(&f.app, ORDERS).await;
    let store = b.get("/console").await.body;
    assert!(!store.contains("all scopes"), "store-wide counts need *");
    assert!(store.contains("held-1") && !store.contains("held-2"), "{store}");
    let letters = b.get("/console/dead-letters").await.body;
    assert!(letters.contains("poison") && !letters.contains("declined"), "{letters}");
    assert!(letters.contains("1 of scopes this token may not use are hidden"), "{letters}");
    assert_eq!(
        b.get("/console/dead-letters/orders/letter?id=5-0").await.status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(b.get("/console?scope=payments").await.status, StatusCode::FORBIDDEN);

    let csrf = b.csrf().await;
    let payments = group_of(&f, "5-0").await;
    let url = format!("/console/dead-letters/orders/groups/{payments}");
    for action in ["replay", "purge"] {
        let a = b.post(&url, &[("action", action), ("target", "group"), ("csrf", &csrf)]).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{action}: {}", a.body);
    }
    let release = [("scope", "payments"), ("key", "held-2"), ("csrf", csrf.as_str())];
    assert_eq!(b.post("/console/store/release", &release).await.status, StatusCode::FORBIDDEN);
    assert_eq!(f.queue.len(), 5);
    let held = DedupKey::new("payments", "held-2").expect("key");
    assert_eq!(
        f.store.get(&held).await.expect("get").expect("record").state,
        RecordState::InProgress
    );

    // Its own scope, it may act on.
    let release = [("scope", "orders"), ("key", "held-1"), ("csrf", csrf.as_str())];
    assert_eq!(b.post("/console/store/release", &release).await.status, StatusCode::SEE_OTHER);
    let held = DedupKey::new("orders", "held-1").expect("key");
    assert_eq!(
        f.store.get(&held).await.expect("get").expect("record").state,
        RecordState::Released
    );
    assert!(b.get("/console").await.body.contains("released: its next delivery"));

    // Its charts show its scopes only.
    let json = b.get("/console/metrics.json").await.body;
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(v["scopes"].as_array().expect("scopes").len(), 1, "{json}");
    assert_eq!(v["scopes"][0]["scope"], "orders");
    assert_eq!(v["scopes"][0]["processed"], 12.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_group_is_never_replayed_under_its_key() {
    let f = fixture(false).await;
    let mut b = Browser::login(&f.app, ADMIN).await;
    let conflict = group_of(&f, "4-0").await;
    let page = b.get("/console/dead-letters").await.body;
    let row = page
        .split("<tr data-group=")
        .find(|r| r.contains("data-outcome=\"conflict\""))
        .expect("the conflict's row");
    let row = &row[..row.find("</tr>").expect("row end")];
    assert!(row.contains("Discard all") && row.contains("Accept all as new"), "{row}");
    assert!(!row.contains("Replay"), "a conflict offers no replay: {row}");
    let group_page = b.get(&format!("/console/dead-letters/orders/groups/{conflict}")).await.body;
    assert!(!group_page.contains("value=\"replay\""), "{group_page}");

    // Crafted by hand, the replay is refused by the rules: nothing sent, nothing removed.
    let csrf = b.csrf().await;
    let url = format!("/console/dead-letters/orders/groups/{conflict}");
    let a = b.post(&url, &[("action", "replay"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert!(f.queue.published().is_empty());
    assert_eq!(f.queue.len(), 5);
    let report = b.get(a.location.as_deref().expect("redirect")).await.body;
    assert!(
        report.contains("Left dead-lettered") && report.contains("never replayed under"),
        "{report}"
    );

    // The letter's page shows the store's record: another payload completed this key.
    let one = b.get("/console/dead-letters/orders/letter?id=4-0").await.body;
    assert!(one.contains("completed") && one.contains("another payload used this key"), "{one}");

    // Accepted as new: sent under a derived id, then removed.
    let a = b.post(&url, &[("action", "accept"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    let sent = f.queue.published();
    assert_eq!(sent.len(), 1);
    let id = sent[0].message_id.clone().expect("id");
    assert!(id.starts_with("m-4-0.accepted."), "{id}");
    assert_eq!(f.queue.len(), 4);
    let report = b.get("/console/dead-letters/orders").await.body;
    assert!(report.contains("Accepted as new messages (1)") && report.contains(&id), "{report}");

    // accept/discard are for conflicts only.
    let poison = group_of(&f, "1-0").await;
    let url = format!("/console/dead-letters/orders/groups/{poison}");
    let a = b.post(&url, &[("action", "accept"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(f.queue.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_a_group_republishes_its_letters_then_removes_them() {
    let f = fixture(false).await;
    let mut b = Browser::login(&f.app, ADMIN).await;
    let poison = group_of(&f, "1-0").await;
    let page = b.get(&format!("/console/dead-letters/orders/groups/{poison}")).await.body;
    for id in ["1-0", "2-0", "3-0"] {
        assert!(page.contains(&format!("value=\"{id}\"")), "{id} selectable");
    }
    // Every value is escaped: a reason with markup shows as text.
    let letters = b.get("/console/dead-letters").await.body;
    assert!(
        letters.contains("card &lt;b&gt;declined&lt;/b&gt;") && !letters.contains("<b>declined")
    );

    let csrf = b.csrf().await;
    let url = format!("/console/dead-letters/orders/groups/{poison}");
    // One selected letter first, then the rest of the group.
    let a = b
        .post(&url, &[("action", "replay"), ("target", "selected"), ("id", "2-0"), ("csrf", &csrf)])
        .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert_eq!(f.queue.published().len(), 1);
    assert_eq!(f.queue.len(), 4);
    let a = b.post(&url, &[("action", "replay"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert_eq!(a.location.as_deref(), Some("/console/dead-letters/orders"));
    let sent = f.queue.published();
    let mut ids: Vec<&str> = sent.iter().filter_map(|r| r.message_id.as_deref()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["m-1-0", "m-2-0", "m-3-0"], "each once, under its own id");
    for r in &sent {
        assert_eq!(r.destination, "orders-stream");
        assert!(r.headers.iter().any(|(k, _)| k == "idem-replayed-from"));
        assert!(!r.headers.iter().any(|(k, _)| k == "idem-reason"));
    }
    // Only the conflict and the other scope's letter are left.
    let left: Vec<String> = read(&f.queue).await.into_iter().map(|l| l.id).collect();
    assert_eq!(left, ["4-0", "5-0"]);

    // The page says what was done, once (the charts' polling meanwhile does not take it).
    assert_eq!(b.get("/console/metrics.json").await.status, StatusCode::OK);
    let page = b.get("/console/dead-letters/orders").await.body;
    assert!(page.contains("Replayed under their key (2)") && page.contains("2 removed"), "{page}");
    assert!(!page.contains("poison"), "the group is gone: {page}");
    assert!(!b.get("/console/dead-letters/orders").await.body.contains("Replayed under"));

    // Limits on input, with clear errors.
    let a = b.post(&url, &[("action", "replay"), ("target", "selected"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("select at least one letter"));
    let many: Vec<String> = (0..1001).map(|i| format!("x-{i}")).collect();
    let mut fields = vec![("action", "replay"), ("target", "selected"), ("csrf", csrf.as_str())];
    fields.extend(many.iter().map(|i| ("id", i.as_str())));
    let a = b.post(&url, &fields).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("more than the limit of 1000"), "{}", a.body);
    let a = b.post(&url, &[("action", "explode"), ("target", "group"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = b
        .post("/console/store/fail", &[("scope", "orders"), ("key", "held-1"), ("csrf", &csrf)])
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("reason: missing"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_fail_and_the_in_doubt_list() {
    let f = fixture(false).await;
    let key = DedupKey::new("orders", "doubt-1").expect("key");
    let req =
        ClaimRequest::new(key.clone(), None, Duration::from_secs(60), Duration::from_secs(600));
    let Claim::Acquired(lease) = f.store.claim(&req).await.expect("claim") else {
        panic!("acquired");
    };
    f.store
        .fail(lease, FailKind::InDoubt, "lease ran out", Duration::from_secs(600))
        .await
        .expect("park");
    let mut b = Browser::login(&f.app, ADMIN).await;
    let page = b.get("/console").await.body;
    let doubt = &page[page.find("id=\"in-doubt\"").expect("section")..];
    assert!(doubt.contains("doubt-1") && doubt.contains(">Fail<"), "{doubt}");
    let csrf = b.csrf().await;
    let fields = [
        ("scope", "orders"),
        ("key", "doubt-1"),
        ("reason", "checked: no charge"),
        ("csrf", csrf.as_str()),
    ];
    assert_eq!(b.post("/console/store/fail", &fields).await.status, StatusCode::SEE_OTHER);
    let rec = f.store.get(&key).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::Failed);
    assert_eq!(rec.result.as_deref(), Some(&b"checked: no charge"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_server_opens_a_session_without_a_token() {
    let console = Console::new();
    let app =
        idem_serve::router_with_console(MemoryStore::new(), Tokens::anonymous(), None, console);
    let mut b = Browser::new(&app);
    let a = b.get("/console/login").await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert!(b.cookie.is_some());
    assert_eq!(b.get("/console").await.status, StatusCode::OK);
    let charts = b.get("/console/charts").await.body;
    assert!(charts.contains("renders no metrics"));
    // The API itself is unchanged beside the console.
    assert_eq!(b.get("/healthz").await.status, StatusCode::OK);
    let css = b.get("/console/assets/console.css").await;
    assert_eq!(css.status, StatusCode::OK);
    assert_eq!(b.get("/console/assets/other.js").await.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_page_lists_unsent_rows_and_only_star_retries_parked_ones() {
    use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, PublishFailure};
    let outbox = MemoryOutbox::new();
    outbox
        .send(vec![Outgoing::new("orders", b"a".to_vec()), Outgoing::new("orders", b"b".to_vec())])
        .await
        .expect("send");
    let leased = outbox.claim(1, Duration::from_secs(30)).await.expect("claim");
    let failures: Vec<PublishFailure> = leased
        .into_iter()
        .map(|p| PublishFailure { ticket: p.ticket, reason: "broker down".into(), retry_in: None })
        .collect();
    outbox.mark_failed(&failures).await.expect("park");
    let console = Console::new().outbox(Arc::new(outbox.clone()));
    let app = idem_serve::router_with_console(MemoryStore::new(), tokens(), None, console);

    let mut orders = Browser::login(&app, ORDERS).await;
    let page = orders.get("/console/outbox").await.body;
    assert!(page.contains("id=\"parked\">1<") && page.contains("id=\"pending\">1<"), "{page}");
    // Each unsent row, parked first, with its destination, failures and last error.
    let table = page.split("id=\"unsent\"").nth(1).expect("the unsent rows' table");
    let (parked, pending) = (table.find("parked</span>"), table.find("<td>pending</td>"));
    assert!(parked.is_some() && pending.is_some() && parked < pending, "{table}");
    assert!(table.contains("<td>orders</td>") && table.contains("broker down"), "{table}");
    assert!(!page.contains("Retry parked"), "only a token with * may retry");
    let csrf = orders.csrf().await;
    let a = orders.post("/console/outbox/retry", &[("limit", "10"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert_eq!(outbox.counts().await.expect("counts").parked, 1);

    let mut admin = Browser::login(&app, ADMIN).await;
    let csrf = admin.csrf().await;
    let a = admin.post("/console/outbox/retry", &[("limit", "0"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = admin.post("/console/outbox/retry", &[("limit", "10"), ("csrf", &csrf)]).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER);
    assert_eq!(outbox.counts().await.expect("counts").parked, 0);
    assert!(admin.get("/console/outbox").await.body.contains("1 parked rows are due again"));
}
