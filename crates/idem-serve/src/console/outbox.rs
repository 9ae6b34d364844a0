//! The outbox page: rows by state, the unsent ones (id, destination, failures, last error),
//! and retrying parked rows (scope `*`: an outbox is not scoped).

use std::fmt::Write as _;

use axum::extract::State;
use axum::response::{IntoResponse as _, Redirect, Response};

use super::ConsoleState;
use super::html::{ConsoleError, esc};
use super::layout::{self, Nav};
use super::session::{Action, Viewer};

/// The most parked rows one retry makes due again.
const MAX_RETRY: usize = 10_000;
/// Unsent rows the page lists.
const ROWS_SHOWN: usize = 200;

fn outbox(s: &ConsoleState) -> Result<&std::sync::Arc<dyn super::OutboxAdmin>, ConsoleError> {
    s.console.outbox.as_ref().ok_or_else(|| ConsoleError::not_found("no outbox is configured"))
}

/// `GET /console/outbox`.
pub(crate) async fn page(
    State(s): State<ConsoleState>,
    viewer: Viewer,
) -> Result<Response, ConsoleError> {
    let c = outbox(&s)?.counts().await?;
    let mut body = format!(
        "<table class=\"counts\"><thead><tr><th>Pending</th><th>Parked</th><th>Sent (kept)</th></tr>\
         </thead><tbody><tr><td class=\"n\" id=\"pending\">{}</td><td class=\"n{}\" id=\"parked\">{}</td>\
         <td class=\"n\">{}</td></tr></tbody></table>\
         <p class=\"hint\">A row is parked after repeated failed publishes; it blocks later rows \
         with its ordering key. Fix the cause (the broker, the destination), then retry.</p>",
        c.pending,
        if c.parked > 0 { " warn" } else { "" },
        c.parked,
        c.sent
    );
    let rows = outbox(&s)?.unsent(ROWS_SHOWN).await?;
    if !rows.is_empty() {
        body.push_str(
            "<h2>Not sent yet</h2><table class=\"rows\" id=\"unsent\"><thead><tr><th>Row</th>\
             <th>Message id</th><th>Destination</th><th>State</th><th>Failed</th>\
             <th>Last error</th></tr></thead><tbody>",
        );
        for r in &rows {
            let _ = write!(
                body,
                "<tr><td class=\"n\">{}</td><td class=\"mono\">{}</td><td>{}</td><td>{}</td>\
                 <td class=\"n\">{}</td><td>{}</td></tr>",
                r.row,
                esc(&r.message_id),
                esc(&r.destination),
                if r.parked { "<span class=\"state conflict\">parked</span>" } else { "pending" },
                r.failures,
                esc(r.last_error.as_deref().unwrap_or("—")),
            );
        }
        body.push_str("</tbody></table>");
        if rows.len() == ROWS_SHOWN {
            let _ = write!(body, "<p class=\"hint\">The first {ROWS_SHOWN}, parked first.</p>");
        }
    }
    if !s.console.read_only && viewer.caller.may_use_all("the outbox").is_ok() {
        let _ = write!(
            body,
            "<form method=\"post\" action=\"/console/outbox/retry\" class=\"inline\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <label>Retry up to <input name=\"limit\" type=\"number\" min=\"1\" max=\"{MAX_RETRY}\" \
             value=\"1000\"> parked rows</label> <button type=\"submit\" class=\"primary\">Retry parked</button></form>",
            esc(&viewer.csrf)
        );
    }
    Ok(layout::page(&s, &viewer, Nav::Outbox, "Outbox", &body, &[]))
}

/// `POST /console/outbox/retry`: makes up to `limit` parked rows due again.
pub(crate) async fn retry(
    State(s): State<ConsoleState>,
    a: Action,
) -> Result<Response, ConsoleError> {
    let o = outbox(&s)?;
    a.viewer.caller.may_use_all("retrying the outbox's parked rows")?;
    let limit = a.form.get("limit").map(str::trim).filter(|l| !l.is_empty()).unwrap_or("1000");
    let limit: usize = limit
        .parse()
        .ok()
        .filter(|n| (1..=MAX_RETRY).contains(n))
        .ok_or_else(|| ConsoleError::bad_request(format!("limit: must be 1 to {MAX_RETRY}")))?;
    let n = o.retry_parked(limit).await?;
    tracing::info!(target: "idem::console", token = a.viewer.caller.name(), rows = n,
        "console: outbox parked rows retried");
    a.viewer.flash(&s, format!("<p>{n} parked rows are due again.</p>"));
    Ok(Redirect::to("/console/outbox").into_response())
}
