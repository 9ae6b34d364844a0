//! The store pages: counts by state and scope, the leases that need an operator (in doubt, in
//! progress), a scope's recent records; force release and force fail.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use axum::extract::{Query, State};
use axum::response::{IntoResponse as _, Redirect, Response};
use idem_core::{Counts, ListFilter, Record, RecordState};
use serde::Deserialize;

use super::ConsoleState;
use super::html::{self, ConsoleError, enc, esc};
use super::layout::{self, Nav};
use super::session::{Action, Viewer};
use crate::auth::Scopes;
use crate::wire;

/// Scopes counted one by one on the overview, at most.
const MAX_SCOPES: usize = 50;
/// Records read to find the scopes in use (for a token with `*`).
const SCOPE_SAMPLE: usize = 1000;
/// Rows of each records table.
const ROWS: usize = 100;
/// The longest reason a force fail takes.
const MAX_REASON: usize = 1000;

/// The overview's filters.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct OverviewQuery {
    scope: Option<String>,
    state: Option<String>,
}

/// The scopes the viewer may see: a token's own, or (with `*`) those of recent records.
async fn scopes(s: &ConsoleState, viewer: &Viewer) -> Result<(Vec<String>, bool), ConsoleError> {
    match viewer.caller.scopes() {
        Scopes::Only(set) => {
            Ok((set.iter().take(MAX_SCOPES).cloned().collect(), set.len() > MAX_SCOPES))
        }
        Scopes::All => {
            let recent = s.app.store.list(&ListFilter::new(SCOPE_SAMPLE)).await?;
            let set: BTreeSet<String> = recent.into_iter().map(|r| r.scope).collect();
            let more = set.len() > MAX_SCOPES;
            Ok((set.into_iter().take(MAX_SCOPES).collect(), more))
        }
    }
}

fn counts_row(out: &mut String, label: &str, link: Option<&str>, c: &Counts) {
    let name = match link {
        Some(scope) => format!("<a href=\"/console?scope={}\">{}</a>", enc(scope), esc(label)),
        None => format!("<strong>{}</strong>", esc(label)),
    };
    let _ = write!(
        out,
        "<tr><th scope=\"row\">{name}</th><td class=\"n\">{}</td><td class=\"n\">{}</td>\
         <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n{}\">{}</td>\
         <td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
        c.in_progress,
        c.completed,
        c.released,
        c.failed,
        if c.in_doubt > 0 { " warn" } else { "" },
        c.in_doubt,
        c.expired,
        c.total()
    );
}

/// Records the viewer may see in `state`, most recent first, at most [`ROWS`].
async fn in_state(
    s: &ConsoleState,
    viewer: &Viewer,
    scopes: &[String],
    state: RecordState,
) -> Result<Vec<Record>, ConsoleError> {
    let mut out = match viewer.caller.scopes() {
        Scopes::All => s.app.store.list(&ListFilter::new(ROWS).state(state)).await?,
        Scopes::Only(_) => {
            let mut all = Vec::new();
            for scope in scopes {
                all.extend(
                    s.app
                        .store
                        .list(&ListFilter::new(ROWS).scope(scope.clone()).state(state))
                        .await?,
                );
            }
            all
        }
    };
    out.sort_by_key(|r| std::cmp::Reverse(r.updated_at));
    out.truncate(ROWS);
    Ok(out)
}

fn result_text(r: &Record) -> String {
    r.result.as_deref().map(|b| html::payload_text(b, 200)).unwrap_or_default()
}

fn records_table(s: &ConsoleState, viewer: &Viewer, records: &[Record], actions: bool) -> String {
    if records.is_empty() {
        return "<p class=\"empty\">None.</p>".into();
    }
    let mut out = String::from(
        "<table class=\"records\"><thead><tr><th>Scope</th><th>Key</th><th>State</th>\
         <th>Attempt</th><th>Lease until</th><th>Updated</th><th>Result or reason</th>",
    );
    let actions = actions && !s.console.read_only;
    if actions {
        out.push_str("<th>Actions</th>");
    }
    out.push_str("</tr></thead><tbody>");
    for r in records {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"mono\">{}</td><td><span class=\"state {st}\">{st}</span></td>\
             <td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"mono small\">{}</td>",
            esc(&r.scope),
            esc(&r.id),
            r.attempt,
            r.lease_until.map(|t| t.to_string()).unwrap_or_default(),
            r.updated_at,
            esc(&result_text(r)),
            st = r.state.as_str(),
        );
        if actions {
            let fields = [("scope", r.scope.as_str()), ("key", r.id.as_str())];
            let release =
                layout::button(viewer, "/console/store/release", &fields, "Release", "secondary");
            let _ = write!(
                out,
                "<td class=\"actions\">{release}\
                 <form method=\"post\" action=\"/console/store/fail\" class=\"inline\">\
                 <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
                 <input type=\"hidden\" name=\"scope\" value=\"{}\">\
                 <input type=\"hidden\" name=\"key\" value=\"{}\">\
                 <input name=\"reason\" placeholder=\"reason\" required maxlength=\"{MAX_REASON}\" \
                 aria-label=\"Reason for failing {}\">\
                 <button type=\"submit\" class=\"danger\">Fail</button></form></td>",
                esc(&viewer.csrf),
                esc(&r.scope),
                esc(&r.id),
                esc(&r.id),
            );
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

/// `GET /console`: the store overview.
pub(crate) async fn overview(
    State(s): State<ConsoleState>,
    viewer: Viewer,
    Query(q): Query<OverviewQuery>,
) -> Result<Response, ConsoleError> {
    let (scopes, more) = scopes(&s, &viewer).await?;
    let mut body = String::from(
        "<section><h2>Records by state</h2><table class=\"counts\"><thead><tr><th>Scope</th>\
         <th>In progress</th><th>Completed</th><th>Released</th><th>Failed</th><th>In doubt</th>\
         <th>Expired</th><th>Total</th></tr></thead><tbody>",
    );
    if viewer.caller.may_use_all("counting every scope").is_ok() {
        counts_row(&mut body, "all scopes", None, &s.app.store.count(None).await?);
    }
    for scope in &scopes {
        counts_row(&mut body, scope, Some(scope), &s.app.store.count(Some(scope)).await?);
    }
    body.push_str("</tbody></table>");
    if more {
        let _ = write!(body, "<p class=\"hint\">Only the first {MAX_SCOPES} scopes are shown.</p>");
    }
    if matches!(viewer.caller.scopes(), Scopes::All) {
        let _ = write!(
            body,
            "<p class=\"hint\">Scopes are those of the {SCOPE_SAMPLE} most recently changed \
             records.</p>"
        );
    }
    body.push_str("</section>");

    let in_doubt = in_state(&s, &viewer, &scopes, RecordState::InDoubt).await?;
    let in_progress = in_state(&s, &viewer, &scopes, RecordState::InProgress).await?;
    let _ = write!(
        body,
        "<section id=\"in-doubt\"><h2>In doubt <span class=\"count\">{}</span></h2>\
         <p class=\"hint\">A holder's lease ran out mid-effect: check whether the effect \
         happened, then <em>Release</em> (run it again) or <em>Fail</em> (it did not happen and \
         must not run again without a new delivery).</p>{}</section>\
         <section id=\"in-progress\"><h2>In progress <span class=\"count\">{}</span></h2>{}</section>",
        in_doubt.len(),
        records_table(&s, &viewer, &in_doubt, true),
        in_progress.len(),
        records_table(&s, &viewer, &in_progress, true),
    );

    if let Some(scope) = q.scope.as_deref().filter(|x| !x.is_empty()) {
        viewer.caller.may_use(scope)?;
        let mut filter = ListFilter::new(ROWS).scope(scope.to_owned());
        if let Some(state) = wire::state_filter(q.state.as_deref().filter(|x| !x.is_empty()))? {
            filter = filter.state(state);
        }
        let records = s.app.store.list(&filter).await?;
        let _ = write!(
            body,
            "<section id=\"records\"><h2>Recent records of {}</h2>{}</section>",
            esc(scope),
            records_table(&s, &viewer, &records, false)
        );
    }
    Ok(layout::page(&s, &viewer, Nav::Store, "Store", &body, &[]))
}

fn record_key(a: &Action) -> Result<idem_core::DedupKey, ConsoleError> {
    let scope = a.form.required("scope", 512)?;
    let key = a.form.required("key", 4096)?;
    let key = wire::key(scope, key)?;
    a.viewer.caller.may_use(scope)?;
    Ok(key)
}

/// `POST /console/store/release`: force release of one record.
pub(crate) async fn release(
    State(s): State<ConsoleState>,
    a: Action,
) -> Result<Response, ConsoleError> {
    let key = record_key(&a)?;
    let changed = s.app.store.force_release(&key).await?;
    tracing::info!(target: "idem::console", token = a.viewer.caller.name(), scope = key.scope(),
        key = key.id(), changed, "console: record released");
    let what = if changed {
        "released: its next delivery runs the handler again"
    } else {
        "had no record"
    };
    a.viewer.flash(&s, format!("<p>{} / {} {what}.</p>", esc(key.scope()), esc(key.id())));
    Ok(Redirect::to("/console").into_response())
}

/// `POST /console/store/fail`: force fail of one record (never of a completed one).
pub(crate) async fn fail(
    State(s): State<ConsoleState>,
    a: Action,
) -> Result<Response, ConsoleError> {
    let key = record_key(&a)?;
    let reason = a.form.required("reason", MAX_REASON)?;
    let changed = s.app.store.force_fail(&key, reason).await?;
    tracing::info!(target: "idem::console", token = a.viewer.caller.name(), scope = key.scope(),
        key = key.id(), changed, "console: record failed");
    let what = if changed {
        "failed"
    } else {
        "was not failed (no record, or it is completed: its effect happened)"
    };
    a.viewer.flash(&s, format!("<p>{} / {} {what}.</p>", esc(key.scope()), esc(key.id())));
    Ok(Redirect::to("/console").into_response())
}
