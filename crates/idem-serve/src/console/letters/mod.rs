//! The dead-letter pages: each queue's letters grouped by cause, a group's letters, one letter
//! with the store's record for its key; replay, accept as new, discard and purge by the rules of
//! [`Workbench`].

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::Response;
use idem_core::{Fingerprint, consumer::headers};
use idem_dlq::{DeadLetterQueue, Letter, Workbench, group};
use serde::Deserialize;

use super::ConsoleState;
use super::html::{self, ConsoleError, enc, esc};
use super::layout::{self, Nav};
use super::session::Viewer;
use crate::auth::Caller;

mod act;
pub(crate) use act::act;

/// Sample letters linked from a group's row.
const SAMPLES: usize = 3;
/// Payload bytes shown on a letter's page.
const MAX_PAYLOAD_SHOWN: usize = 64 << 10;
/// The longest letter id an action takes.
const MAX_ID: usize = 1024;

type Queue = Arc<dyn DeadLetterQueue>;

fn may_see(caller: &Caller, l: &Letter) -> bool {
    match l.scope() {
        Some(scope) => caller.may_use(scope).is_ok(),
        None => caller.may_use_all("dead letters without a scope").is_ok(),
    }
}

fn check_scope(caller: &Caller, l: &Letter) -> Result<(), ConsoleError> {
    match l.scope() {
        Some(scope) => caller.may_use(scope)?,
        None => caller.may_use_all("dead letters without a scope")?,
    }
    Ok(())
}

/// The letters of `q` the viewer may see, and how many others were hidden.
async fn visible(
    s: &ConsoleState,
    q: &Queue,
    caller: &Caller,
) -> Result<(Vec<Letter>, usize), ConsoleError> {
    let all = Workbench::new(q.clone()).list(s.console.read_limit).await?;
    let total = all.len();
    let shown: Vec<Letter> = all.into_iter().filter(|l| may_see(caller, l)).collect();
    let hidden = total - shown.len();
    Ok((shown, hidden))
}

fn queue_url(name: &str) -> String {
    format!("/console/dead-letters/{}", enc(name))
}

fn group_url(name: &str, group: &str) -> String {
    format!("{}/groups/{}", queue_url(name), enc(group))
}

fn letter_url(name: &str, id: &str) -> String {
    format!("{}/letter?id={}", queue_url(name), enc(id))
}

fn outcome_badge(outcome: &str) -> String {
    let class = if outcome == "conflict" { "state conflict" } else { "state failed" };
    format!("<span class=\"{class}\">{}</span>", esc(outcome))
}

/// The buttons acting on a whole group.
fn group_actions(
    s: &ConsoleState,
    viewer: &Viewer,
    name: &str,
    gid: &str,
    conflict: bool,
) -> String {
    if s.console.read_only {
        return String::new();
    }
    let url = group_url(name, gid);
    let act = |action: &str, label: &str, class: &str| {
        layout::button(viewer, &url, &[("target", "group"), ("action", action)], label, class)
    };
    if conflict {
        // A conflict is never replayed under its key: only these two.
        format!(
            "{}{}",
            act("discard", "Discard all", "danger"),
            act("accept", "Accept all as new", "secondary")
        )
    } else {
        format!("{}{}", act("replay", "Replay all", "primary"), act("purge", "Purge all", "danger"))
    }
}

async fn queue_section(s: &ConsoleState, viewer: &Viewer, name: &str, q: &Queue) -> String {
    let mut out = format!(
        "<section class=\"queue\"><h2><a href=\"{}\">{}</a></h2><p class=\"hint\">{}</p>",
        esc(&queue_url(name)),
        esc(name),
        esc(&q.describe())
    );
    let (letters, hidden) = match visible(s, q, &viewer.caller).await {
        Ok(v) => v,
        Err(e) => {
            let _ = write!(
                out,
                "<p class=\"error\">Could not read it: {}</p></section>",
                esc(e.message())
            );
            return out;
        }
    };
    let limit = s.console.read_limit;
    let read = letters.len() + hidden;
    let _ = write!(
        out,
        "<p><span class=\"count\" data-queue=\"{}\">{}</span> dead letters{}{}</p>",
        esc(name),
        letters.len(),
        if read >= limit { format!(" (the oldest {limit} read)") } else { String::new() },
        if hidden > 0 {
            format!("; {hidden} of scopes this token may not use are hidden")
        } else {
            String::new()
        },
    );
    if letters.is_empty() {
        out.push_str("<p class=\"empty\">No dead letters.</p></section>");
        return out;
    }
    out.push_str(
        "<table class=\"groups\"><thead><tr><th>Scope</th><th>Outcome</th><th>Reason</th>\
         <th>Count</th><th>Samples</th><th>Actions</th></tr></thead><tbody>",
    );
    for g in group(&letters) {
        let gid = g.key.id();
        let samples: String = g
            .ids
            .iter()
            .take(SAMPLES)
            .map(|id| {
                format!(
                    "<a class=\"mono\" href=\"{}\">{}</a> ",
                    esc(&letter_url(name, id)),
                    esc(id)
                )
            })
            .collect();
        let conflict = g.key.outcome == "conflict";
        let _ = write!(
            out,
            "<tr data-group=\"{gid}\" data-outcome=\"{}\"><td>{}</td><td>{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td>{samples}</td><td class=\"actions\">\
             <a href=\"{}\">Show letters</a> {}</td></tr>",
            esc(&g.key.outcome),
            esc(&g.key.scope),
            outcome_badge(&g.key.outcome),
            esc(&g.key.reason),
            g.ids.len(),
            esc(&group_url(name, &gid)),
            group_actions(s, viewer, name, &gid, conflict),
        );
    }
    out.push_str("</tbody></table>");
    if letters.iter().any(Letter::is_conflict) {
        out.push_str(
            "<p class=\"hint\">A <strong>conflict</strong> (its key was already used by another \
             payload) is never replayed under its key, where it would only conflict again: \
             discard it, or accept it as a new message (a new message id derived from the old \
             one and the payload).</p>",
        );
    }
    out.push_str("</section>");
    out
}

/// `GET /console/dead-letters`: every configured queue, grouped.
pub(crate) async fn index(State(s): State<ConsoleState>, viewer: Viewer) -> Response {
    let mut body = String::new();
    if s.console.queues.is_empty() {
        body.push_str(
            "<p class=\"empty\">No dead-letter queue is configured. Push consumers' dead letters \
             are shown by default; others are listed under <code>[[console.dead_letters]]</code> \
             in the configuration.</p>",
        );
    }
    for (name, q) in &s.console.queues {
        body.push_str(&queue_section(&s, &viewer, name, q).await);
    }
    layout::page(&s, &viewer, Nav::DeadLetters, "Dead letters", &body, &[])
}

fn find_queue<'a>(s: &'a ConsoleState, name: &str) -> Result<&'a Queue, ConsoleError> {
    s.queue(name).ok_or_else(|| ConsoleError::not_found(format!("no dead-letter queue {name:?}")))
}

/// `GET /console/dead-letters/{queue}`: one queue, grouped.
pub(crate) async fn queue(
    State(s): State<ConsoleState>,
    viewer: Viewer,
    Path(name): Path<String>,
) -> Result<Response, ConsoleError> {
    let q = find_queue(&s, &name)?;
    let body = queue_section(&s, &viewer, &name, q).await;
    Ok(layout::page(&s, &viewer, Nav::DeadLetters, &format!("Dead letters: {name}"), &body, &[]))
}

/// `GET /console/dead-letters/{queue}/groups/{group}`: a group's letters, to select from.
pub(crate) async fn group_page(
    State(s): State<ConsoleState>,
    viewer: Viewer,
    Path((name, gid)): Path<(String, String)>,
) -> Result<Response, ConsoleError> {
    let q = find_queue(&s, &name)?;
    let (letters, _) = visible(&s, q, &viewer.caller).await?;
    let letters: Vec<Letter> = letters.into_iter().filter(|l| l.in_group(&gid)).collect();
    let mut body = format!("<p><a href=\"{}\">← {}</a></p>", esc(&queue_url(&name)), esc(&name));
    let Some(first) = letters.first() else {
        body.push_str("<p class=\"empty\">This group has no dead letters (any more).</p>");
        return Ok(layout::page(&s, &viewer, Nav::DeadLetters, "Dead-letter group", &body, &[]));
    };
    let key = first.group();
    let conflict = first.is_conflict();
    let _ = write!(
        body,
        "<dl class=\"facts\"><dt>Scope</dt><dd>{}</dd><dt>Outcome</dt><dd>{}</dd>\
         <dt>Reason</dt><dd>{}</dd><dt>Letters</dt><dd>{}</dd></dl>",
        esc(&key.scope),
        outcome_badge(&key.outcome),
        esc(&key.reason),
        letters.len()
    );
    let read_only = s.console.read_only;
    if !read_only {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"{}\" id=\"selection\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <input type=\"hidden\" name=\"target\" value=\"selected\">",
            esc(&group_url(&name, &gid)),
            esc(&viewer.csrf)
        );
    }
    body.push_str("<table class=\"letters\"><thead><tr>");
    if !read_only {
        body.push_str("<th><span class=\"sr\">Select</span></th>");
    }
    body.push_str(
        "<th>Letter</th><th>Message id</th><th>Key</th><th>Reason</th><th>Source</th>\
         <th>Delivered</th></tr></thead><tbody>",
    );
    for l in &letters {
        body.push_str("<tr>");
        if !read_only {
            let _ = write!(
                body,
                "<td><input type=\"checkbox\" name=\"id\" value=\"{}\" aria-label=\"Select {}\"></td>",
                esc(&l.id),
                esc(&l.id)
            );
        }
        let _ = write!(
            body,
            "<td><a class=\"mono\" href=\"{}\">{}</a></td><td class=\"mono\">{}</td>\
             <td class=\"mono\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&letter_url(&name, &l.id)),
            esc(&l.id),
            esc(l.message_id.as_deref().unwrap_or("")),
            esc(l.key().unwrap_or("")),
            esc(l.reason().unwrap_or("")),
            esc(l.source().unwrap_or("")),
            esc(l.header(headers::DELIVERED).unwrap_or("")),
        );
    }
    body.push_str("</tbody></table>");
    if !read_only {
        body.push_str("<p class=\"actions\">Selected letters: ");
        if conflict {
            body.push_str(
                "<button type=\"submit\" name=\"action\" value=\"discard\" class=\"danger\">Discard</button>\
                 <button type=\"submit\" name=\"action\" value=\"accept\" class=\"secondary\">Accept as new</button>",
            );
        } else {
            body.push_str(
                "<button type=\"submit\" name=\"action\" value=\"replay\" class=\"primary\">Replay</button>\
                 <button type=\"submit\" name=\"action\" value=\"purge\" class=\"danger\">Purge</button>",
            );
        }
        let _ = write!(
            body,
            "</p></form><p class=\"actions\">Whole group: {}</p>",
            group_actions(&s, &viewer, &name, &gid, conflict)
        );
    }
    let title = format!("Dead letters: {name} · {}", key.outcome);
    Ok(layout::page(&s, &viewer, Nav::DeadLetters, &title, &body, &[]))
}

/// The query of a letter's page.
#[derive(Debug, Deserialize)]
pub(crate) struct LetterQuery {
    id: String,
}

fn fingerprint_line(l: &Letter, stored: Option<Fingerprint>) -> String {
    let bytes = Fingerprint::of_bytes(&l.payload);
    let json = Fingerprint::of_json_bytes(&l.payload).ok();
    match stored {
        None => "the record keeps no fingerprint".into(),
        Some(f) if f == bytes || Some(f) == json => {
            "matches this payload (the same message was processed under this key)".into()
        }
        Some(_) => "differs from this payload's (bytes and canonical JSON): another payload \
                    used this key"
            .into(),
    }
}

async fn record_section(s: &ConsoleState, viewer: &Viewer, l: &Letter) -> String {
    let (Some(scope), Some(key)) = (l.scope(), l.key()) else {
        return format!(
            "<p class=\"empty\">No {} / {} header: the store's record cannot be found.</p>",
            headers::SCOPE,
            headers::KEY
        );
    };
    if viewer.caller.may_use(scope).is_err() {
        return "<p class=\"empty\">This token may not use the letter's scope.</p>".into();
    }
    let key = match idem_core::DedupKey::new(scope, key) {
        Ok(k) => k,
        Err(e) => {
            return format!("<p class=\"error\">The key is not valid: {}</p>", esc(&e.to_string()));
        }
    };
    match s.app.store.get(&key).await {
        Ok(None) => {
            "<p class=\"empty\">No record for this key (never claimed, or purged).</p>".into()
        }
        Ok(Some(r)) => format!(
            "<dl class=\"facts\" id=\"record\"><dt>Key</dt><dd class=\"mono\">{} / {}</dd>\
             <dt>State</dt><dd><span class=\"state {st}\">{st}</span></dd><dt>Attempt</dt><dd>{}</dd>\
             <dt>Fingerprint</dt><dd><span class=\"mono small\">{}</span> — {}</dd>\
             <dt>Result or reason</dt><dd class=\"mono small\">{}</dd>\
             <dt>Created</dt><dd>{}</dd><dt>Updated</dt><dd>{}</dd><dt>Expires</dt><dd>{}</dd></dl>",
            esc(&r.scope),
            esc(&r.id),
            r.attempt,
            r.fingerprint.map(|f| hex::encode(f.as_bytes())).unwrap_or_else(|| "—".into()),
            fingerprint_line(l, r.fingerprint),
            esc(&r.result.as_deref().map(|b| html::payload_text(b, 2000)).unwrap_or_default()),
            r.created_at,
            r.updated_at,
            r.expires_at,
            st = r.state.as_str(),
        ),
        Err(e) => format!(
            "<p class=\"error\">The store failed: {}</p>",
            esc(&idem_core::ErrorChain(&e).to_string())
        ),
    }
}

/// `GET /console/dead-letters/{queue}/letter?id=`: one letter, its headers, its payload and the
/// store's record for its key.
pub(crate) async fn letter(
    State(s): State<ConsoleState>,
    viewer: Viewer,
    Path(name): Path<String>,
    Query(q): Query<LetterQuery>,
) -> Result<Response, ConsoleError> {
    let queue = find_queue(&s, &name)?;
    let all = Workbench::new(queue.clone()).list(s.console.read_limit).await?;
    let l = all.into_iter().find(|l| l.id == q.id).ok_or_else(|| {
        ConsoleError::not_found(format!(
            "no dead letter {:?} in {name} (replayed or purged?)",
            q.id
        ))
    })?;
    check_scope(&viewer.caller, &l)?;
    let gid = l.group().id();
    let mut body = format!(
        "<p><a href=\"{}\">← {}</a> · <a href=\"{}\">its group</a></p>\
         <dl class=\"facts\"><dt>Letter</dt><dd class=\"mono\">{}</dd><dt>Message id</dt>\
         <dd class=\"mono\">{}</dd><dt>Content type</dt><dd>{}</dd><dt>Correlation id</dt>\
         <dd class=\"mono\">{}</dd><dt>Sent</dt><dd>{}</dd><dt>Outcome</dt><dd>{}</dd>\
         <dt>Reason</dt><dd>{}</dd></dl>",
        esc(&queue_url(&name)),
        esc(&name),
        esc(&group_url(&name, &gid)),
        esc(&l.id),
        esc(l.message_id.as_deref().unwrap_or("—")),
        esc(&match (&l.content_type, &l.content_encoding) {
            (Some(t), Some(e)) => format!("{t} ({e})"),
            (Some(t), None) => t.clone(),
            (None, Some(e)) => format!("({e})"),
            (None, None) => "—".to_owned(),
        }),
        esc(l.correlation_id.as_deref().unwrap_or("—")),
        l.timestamp.map_or_else(
            || "—".to_owned(),
            |t| idem_core::Timestamp::from_system_time(t).to_string()
        ),
        outcome_badge(l.outcome().unwrap_or("unknown")),
        esc(l.reason().unwrap_or("—")),
    );
    body.push_str("<h2>Headers</h2><table class=\"headers\"><tbody>");
    for (k, v) in &l.headers {
        let class = if idem_dlq::is_dead_letter_header(k) { " class=\"idem\"" } else { "" };
        let _ = write!(
            body,
            "<tr{class}><th scope=\"row\">{}</th><td class=\"mono\">{}</td></tr>",
            esc(k),
            esc(v)
        );
    }
    let _ = write!(
        body,
        "</tbody></table><h2>Payload <span class=\"count\">{} bytes</span></h2>\
         <pre class=\"payload\">{}</pre><h2>The store's record</h2>{}",
        l.payload.len(),
        esc(&html::payload_text(&l.payload, MAX_PAYLOAD_SHOWN)),
        record_section(&s, &viewer, &l).await,
    );
    if !s.console.read_only {
        let url = group_url(&name, &gid);
        let one = |action: &str, label: &str, class: &str| {
            layout::button(
                &viewer,
                &url,
                &[("target", "selected"), ("id", &l.id), ("action", action)],
                label,
                class,
            )
        };
        let buttons = if l.is_conflict() {
            format!(
                "{}{}",
                one("discard", "Discard", "danger"),
                one("accept", "Accept as new", "secondary")
            )
        } else {
            format!("{}{}", one("replay", "Replay", "primary"), one("purge", "Purge", "danger"))
        };
        let _ = write!(body, "<p class=\"actions\">This letter: {buttons}</p>");
    }
    Ok(layout::page(&s, &viewer, Nav::DeadLetters, "Dead letter", &body, &[]))
}
