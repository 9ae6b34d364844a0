//! The console's page layout: the navigation, the operator's session on every page, and the
//! forms that carry its CSRF token.

use std::fmt::Write as _;

use axum::response::{Html, IntoResponse, Response};

use super::ConsoleState;
use super::html::{document, esc, secured};
use super::session::Viewer;

/// The sections of the navigation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Store,
    DeadLetters,
    Outbox,
    Charts,
}

/// A page of the console, with its navigation, the operator's name, the flash message and
/// `scripts` (asset names) at the end.
pub(crate) fn page(
    s: &ConsoleState,
    viewer: &Viewer,
    active: Nav,
    title: &str,
    body: &str,
    scripts: &[&str],
) -> Response {
    let mut nav = String::new();
    let mut items = vec![
        (Nav::Store, "/console", "Store"),
        (Nav::DeadLetters, "/console/dead-letters", "Dead letters"),
    ];
    if s.console.outbox.is_some() {
        items.push((Nav::Outbox, "/console/outbox", "Outbox"));
    }
    items.push((Nav::Charts, "/console/charts", "Charts"));
    for (n, href, label) in items {
        let current = if n == active { " aria-current=\"page\"" } else { "" };
        let _ = write!(nav, "<a href=\"{href}\"{current}>{label}</a>");
    }
    let mode = if s.console.read_only {
        "<span class=\"badge\" title=\"No action is possible\">read-only</span>"
    } else {
        ""
    };
    let flash = viewer
        .flash
        .as_deref()
        .map(|f| format!("<section class=\"flash\" role=\"status\" id=\"flash\">{f}</section>"))
        .unwrap_or_default();
    let scripts: String = scripts
        .iter()
        .map(|f| format!("<script src=\"/console/assets/{f}\" defer></script>"))
        .collect();
    let body = format!(
        "<header><span class=\"brand\">idem</span><nav>{nav}</nav>{mode}\
         <form method=\"post\" action=\"/console/logout\" class=\"logout\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
         <span class=\"who\">{who}</span><button type=\"submit\" class=\"link\">Log out</button>\
         </form></header><main>{flash}<h1>{title}</h1>{body}</main>{scripts}",
        csrf = esc(&viewer.csrf),
        who = esc(viewer.caller.name()),
        title = esc(title),
    );
    secured(Html(document(title, &body)).into_response())
}

/// A POST form of one button, with the session's CSRF token and hidden `fields`.
pub(crate) fn button(
    viewer: &Viewer,
    action: &str,
    fields: &[(&str, &str)],
    label: &str,
    class: &str,
) -> String {
    let mut out = format!(
        "<form method=\"post\" action=\"{}\" class=\"inline\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        esc(action),
        esc(&viewer.csrf)
    );
    for (k, v) in fields {
        let _ = write!(out, "<input type=\"hidden\" name=\"{}\" value=\"{}\">", esc(k), esc(v));
    }
    let _ = write!(
        out,
        "<button type=\"submit\" class=\"{}\">{}</button></form>",
        esc(class),
        esc(label)
    );
    out
}
