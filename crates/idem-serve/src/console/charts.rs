//! Live charts: processed, duplicates, conflicts and dead letters per scope, read from the
//! process's own metrics (`idem_outcomes_total`, `idem_dead_letters_total`), polled by the
//! page every 2 s and drawn as SVG.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::Json;
use axum::extract::State;
use axum::response::Response;
use idem_core::telemetry::{DEAD_LETTERS_TOTAL, OUTCOMES_TOTAL};
use serde::Serialize;

use super::ConsoleState;
use super::html::esc;
use super::layout::{self, Nav};
use super::session::Viewer;
use crate::auth::Caller;

/// One scope's totals since the process started.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub(crate) struct ScopeTotals {
    scope: String,
    processed: f64,
    duplicate: f64,
    conflict: f64,
    dead_lettered: f64,
}

/// What `/console/metrics.json` answers.
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    /// Whether the process renders metrics at all.
    enabled: bool,
    /// Scopes the viewer may use, by name.
    scopes: Vec<ScopeTotals>,
}

/// One sample of the Prometheus text format.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

/// One sample of the Prometheus text format: name, labels, value.
fn parse_line(line: &str) -> Option<Sample<'_>> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (series, rest) = if line.contains('{') {
        let close = line.rfind('}')?;
        (&line[..close + 1], &line[close + 1..])
    } else {
        line.split_once(' ')?
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, l)) => (name, parse_labels(l.strip_suffix('}')?)?),
        None => (series, Vec::new()),
    };
    Some(Sample { name, labels, value })
}

fn parse_labels(mut s: &str) -> Option<Vec<(&str, String)>> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if s.is_empty() {
            return Some(out);
        }
        let (k, rest) = s.split_once("=\"")?;
        let mut v = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => v.push('\n'),
                    c => v.push(c),
                },
                (_, c) => v.push(c),
            }
        };
        out.push((k.trim(), v));
        s = &rest[end + 1..];
    }
}

/// Totals per scope from a Prometheus text.
pub(crate) fn totals(text: &str) -> Vec<ScopeTotals> {
    let mut by: BTreeMap<String, ScopeTotals> = BTreeMap::new();
    for Sample { name, labels, value } in text.lines().filter_map(parse_line) {
        if name != OUTCOMES_TOTAL && name != DEAD_LETTERS_TOTAL {
            continue;
        }
        let label = |k: &str| labels.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        let Some(scope) = label("scope") else { continue };
        let t = by
            .entry(scope.to_owned())
            .or_insert_with(|| ScopeTotals { scope: scope.to_owned(), ..ScopeTotals::default() });
        if name == DEAD_LETTERS_TOTAL {
            t.dead_lettered += value;
            continue;
        }
        match label("outcome") {
            Some("processed") => t.processed += value,
            Some("duplicate") => t.duplicate += value,
            Some("conflict") => t.conflict += value,
            _ => {}
        }
    }
    by.into_values().collect()
}

fn snapshot(s: &ConsoleState, caller: &Caller) -> Snapshot {
    match &s.app.metrics {
        Some(render) => Snapshot {
            enabled: true,
            scopes: totals(&render())
                .into_iter()
                .filter(|t| caller.may_use(&t.scope).is_ok())
                .collect(),
        },
        None => Snapshot { enabled: false, scopes: Vec::new() },
    }
}

/// `GET /console/metrics.json`.
pub(crate) async fn json(State(s): State<ConsoleState>, viewer: Viewer) -> Json<Snapshot> {
    Json(snapshot(&s, &viewer.caller))
}

/// `GET /console/charts`: the totals (rendered here, so they show without script too) and the
/// charts the script draws.
pub(crate) async fn page(State(s): State<ConsoleState>, viewer: Viewer) -> Response {
    let snap = snapshot(&s, &viewer.caller);
    let mut body = String::new();
    if !snap.enabled {
        body.push_str(
            "<p class=\"empty\">This server renders no metrics (<code>metrics = false</code>).</p>",
        );
        return layout::page(&s, &viewer, Nav::Charts, "Charts", &body, &[]);
    }
    body.push_str(
        "<p class=\"hint\">Messages per second, per scope, from this process's consumers \
         (push mode), sampled every 2 s. The table counts since the process started.</p>\
         <table class=\"counts\" id=\"totals\"><thead><tr><th>Scope</th><th>Processed</th>\
         <th>Duplicates</th><th>Conflicts</th><th>Dead-lettered</th></tr></thead><tbody>",
    );
    for t in &snap.scopes {
        let _ = write!(
            body,
            "<tr data-scope=\"{}\"><th scope=\"row\">{}</th><td class=\"n\" data-series=\"processed\">{}</td>\
             <td class=\"n\" data-series=\"duplicate\">{}</td><td class=\"n\" data-series=\"conflict\">{}</td>\
             <td class=\"n\" data-series=\"dead_lettered\">{}</td></tr>",
            esc(&t.scope),
            esc(&t.scope),
            t.processed,
            t.duplicate,
            t.conflict,
            t.dead_lettered
        );
    }
    body.push_str(
        "</tbody></table><div id=\"charts\" data-src=\"/console/metrics.json\" aria-live=\"polite\"></div>",
    );
    layout::page(&s, &viewer, Nav::Charts, "Charts", &body, &["charts.js"])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_outcomes_and_dead_letters_per_scope() {
        let text = "# HELP idem_outcomes_total Deliveries decided.\n\
            # TYPE idem_outcomes_total counter\n\
            idem_outcomes_total{scope=\"orders\",outcome=\"processed\"} 7\n\
            idem_outcomes_total{scope=\"orders\",outcome=\"duplicate\"} 2\n\
            idem_outcomes_total{outcome=\"conflict\",scope=\"orders\"} 1\n\
            idem_outcomes_total{scope=\"odd \\\"one\\\"\",outcome=\"processed\"} 3 1700000000\n\
            idem_dead_letters_total{scope=\"orders\",outcome=\"conflict\"} 1\n\
            idem_dead_letters_total{scope=\"orders\",outcome=\"failed_permanent\"} 4\n\
            idem_api_requests_total{operation=\"claim\",status=\"200\"} 9\n";
        let t = totals(text);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].scope, "odd \"one\"");
        assert_eq!(t[0].processed, 3.0);
        let o = &t[1];
        assert_eq!((o.processed, o.duplicate, o.conflict, o.dead_lettered), (7.0, 2.0, 1.0, 5.0));
    }
}
