//! The dead-letter actions: replay, accept as new, discard and purge, on a group or on letters
//! selected from it, by the rules of [`Workbench`], reported as the session's flash message.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use axum::extract::{Path, State};
use axum::response::{IntoResponse as _, Redirect, Response};
use idem_dlq::{Letter, OnConflict, ReplayReport, Workbench};

use super::super::html::{ConsoleError, esc};
use super::super::session::Action;
use super::super::{ConsoleState, MAX_SELECTED};
use super::*;

/// What an action does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Verb {
    /// Send again under the key (conflicts are refused by the rules).
    Replay,
    /// Conflicts only: send again under a derived message id.
    Accept,
    /// Remove without sending (conflicts).
    Discard,
    /// Remove without sending.
    Purge,
}

impl Verb {
    fn parse(s: &str) -> Result<Self, ConsoleError> {
        Ok(match s {
            "replay" => Self::Replay,
            "accept" => Self::Accept,
            "discard" => Self::Discard,
            "purge" => Self::Purge,
            other => {
                return Err(ConsoleError::bad_request(format!(
                    "action: {:?} is not replay, accept, discard or purge",
                    other.escape_debug().to_string()
                )));
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Accept => "accept as new",
            Self::Discard => "discard",
            Self::Purge => "purge",
        }
    }
}

fn id_list(ids: &[String]) -> String {
    let shown: Vec<String> =
        ids.iter().take(20).map(|i| format!("<code>{}</code>", esc(i))).collect();
    let more = if ids.len() > 20 { format!(" and {} more", ids.len() - 20) } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// The report of an action, as the flash message.
fn report_html(queue: &str, verb: Verb, r: &ReplayReport, missing: &[String]) -> String {
    let mut out = format!(
        "<h2>Done: {} on {}</h2><p class=\"summary\">{}; {} removed from the dead letters.</p><ul class=\"report\">",
        verb.name(),
        esc(queue),
        esc(&r.to_string()),
        r.removed
    );
    if !r.replayed.is_empty() {
        let _ = write!(
            out,
            "<li data-kind=\"replayed\">Replayed under their key ({}): {}</li>",
            r.replayed.len(),
            id_list(&r.replayed)
        );
    }
    if !r.accepted_as_new.is_empty() {
        let items: Vec<String> = r
            .accepted_as_new
            .iter()
            .take(20)
            .map(|(l, m)| format!("<code>{}</code> → message id <code>{}</code>", esc(l), esc(m)))
            .collect();
        let _ = write!(
            out,
            "<li data-kind=\"accepted\">Accepted as new messages ({}): {}</li>",
            r.accepted_as_new.len(),
            items.join(", ")
        );
    }
    if !r.discarded.is_empty() {
        let _ = write!(
            out,
            "<li data-kind=\"removed\">Removed without being sent ({}): {}</li>",
            r.discarded.len(),
            id_list(&r.discarded)
        );
    }
    for (id, why) in r.refused.iter().take(20) {
        let _ = write!(
            out,
            "<li data-kind=\"refused\">Left dead-lettered: <code>{}</code>: {}</li>",
            esc(id),
            esc(why)
        );
    }
    if !missing.is_empty() {
        let _ = write!(
            out,
            "<li data-kind=\"missing\">Not in this group (or already gone): {}</li>",
            id_list(missing)
        );
    }
    out.push_str("</ul>");
    out
}

/// `POST /console/dead-letters/{queue}/groups/{group}`: act on the group, or on letters of it
/// (`target=selected`, `id` repeated).
pub(crate) async fn act(
    State(s): State<ConsoleState>,
    Path((name, gid)): Path<(String, String)>,
    a: Action,
) -> Result<Response, ConsoleError> {
    let q = find_queue(&s, &name)?.clone();
    let verb = Verb::parse(a.form.required("action", 16)?)?;
    let selected: Option<BTreeSet<&str>> = match a.form.get("target").unwrap_or("group") {
        "group" => None,
        "selected" => {
            let ids: BTreeSet<&str> = a.form.all("id").filter(|i| !i.is_empty()).collect();
            if ids.is_empty() {
                return Err(ConsoleError::bad_request("select at least one letter"));
            }
            if ids.len() > MAX_SELECTED {
                return Err(ConsoleError::bad_request(format!(
                    "{} letters selected, more than the limit of {MAX_SELECTED}: act on the whole group",
                    ids.len()
                )));
            }
            if let Some(long) = ids.iter().find(|i| i.len() > MAX_ID) {
                return Err(ConsoleError::bad_request(format!(
                    "id: {} bytes, more than the limit of {MAX_ID}",
                    long.len()
                )));
            }
            Some(ids)
        }
        other => {
            return Err(ConsoleError::bad_request(format!(
                "target: {:?} is not group or selected",
                other.escape_debug().to_string()
            )));
        }
    };
    let bench = Workbench::new(q);
    let in_group: Vec<Letter> =
        bench.list(s.console.read_limit).await?.into_iter().filter(|l| l.in_group(&gid)).collect();
    // One group is one scope: its key includes it.
    if let Some(first) = in_group.first() {
        check_scope(&a.viewer.caller, first)?;
    }
    let (chosen, missing): (Vec<Letter>, Vec<String>) = match &selected {
        None => (in_group, Vec::new()),
        Some(ids) => {
            let found: Vec<Letter> =
                in_group.into_iter().filter(|l| ids.contains(l.id.as_str())).collect();
            let missing = ids
                .iter()
                .filter(|i| !found.iter().any(|l| l.id == **i))
                .map(|i| (*i).to_owned())
                .collect();
            (found, missing)
        }
    };
    let conflict = chosen.first().is_some_and(Letter::is_conflict);
    if matches!(verb, Verb::Accept | Verb::Discard) && !chosen.is_empty() && !conflict {
        return Err(ConsoleError::bad_request(format!(
            "{} is for conflicts; this group's letters failed: replay or purge them",
            verb.name()
        )));
    }
    let report = match verb {
        _ if chosen.is_empty() => ReplayReport::default(),
        // A conflict selected for a replay is refused by the rules and stays.
        Verb::Replay => bench.replay(&chosen, OnConflict::Refuse).await?,
        Verb::Accept => bench.replay(&chosen, OnConflict::AcceptAsNew).await?,
        Verb::Discard | Verb::Purge => {
            let removed = bench.purge(&chosen).await?;
            let mut r = ReplayReport::default();
            r.discarded = chosen.iter().map(|l| l.id.clone()).collect();
            r.removed = removed;
            r
        }
    };
    tracing::info!(target: "idem::console", token = a.viewer.caller.name(), queue = %name,
        group = %gid, action = verb.name(), replayed = report.replayed.len(),
        accepted = report.accepted_as_new.len(), removed = report.removed,
        refused = report.refused.len(), "console: dead letters");
    let mut flash = report_html(&name, verb, &report, &missing);
    if chosen.is_empty() && missing.is_empty() {
        flash = format!(
            "<p>Nothing to do: the group on {} has no dead letters any more.</p>",
            esc(&name)
        );
    }
    a.viewer.flash(&s, flash);
    Ok(Redirect::to(&queue_url(&name)).into_response())
}
