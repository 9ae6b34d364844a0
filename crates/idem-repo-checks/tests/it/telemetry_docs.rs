//! `docs/OPERATIONS.md` and the Grafana dashboard name exactly the metrics the engine emits.

use std::collections::BTreeSet;

use idem_core::telemetry;

const OPERATIONS: &str = include_str!("../../../../docs/OPERATIONS.md");
const DASHBOARD: &str = include_str!("../../../../docs/grafana/idem.json");

#[test]
fn operations_lists_every_metric() {
    for name in telemetry::ALL.iter().chain(&idem_serve::METRICS) {
        assert!(OPERATIONS.contains(&format!("| `{name}` |")), "{name} missing from OPERATIONS.md");
    }
}

#[test]
fn dashboard_parses_and_queries_only_emitted_metrics() {
    let dash: serde_json::Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let vars = dash.pointer("/templating/list").and_then(|v| v.as_array()).expect("variables");
    assert!(vars.iter().any(|v| v["name"] == "scope"), "no scope variable");
    let panels = dash["panels"].as_array().expect("panels");
    let mut queried = BTreeSet::new();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let targets = p["targets"].as_array().expect("every panel has targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("a PromQL expression");
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("idem_") {
                    let base = ["_bucket", "_count", "_sum"]
                        .iter()
                        .find_map(|s| word.strip_suffix(s))
                        .unwrap_or(word);
                    assert!(telemetry::ALL.contains(&base), "{expr} queries unknown {word}");
                    queried.insert(base.to_owned());
                }
            }
        }
    }
    let all: BTreeSet<String> = telemetry::ALL.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(queried, all, "every metric has a panel");
}
