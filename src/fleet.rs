//! Many nodes at once: where each node's plan Secret stands, as one row per node, for
//! `nodeplan plan status --selector` (a table sorted failures first, or one JSON object per node
//! and per change) and the fan-out commands.
//!
//! Pure: a [`Row`] is computed from a Secret snapshot ([`row_of`]) and rendered ([`table`],
//! [`Row::json`]); [`Rows`] keeps the latest row of every node and says which changed, so a watch
//! reports every transition once. Reading and watching the Secrets is `remote::client`'s; the
//! commands are `cli`'s.

use crate::plan::{self, Checkpoint, PlanState};
use crate::remote::client::SecretSnapshot;
use crate::remote::wire;
use serde::Serialize;
use std::collections::BTreeMap;

/// Where one node's plan stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// The plan Secret's name (one per node).
    pub node: String,
    /// `plan-state`; in the legacy checksum flow `applied`, `failed` or `pending`; `no plan`.
    pub state: String,
    /// The plan's short id (12 hex digits; empty without a plan).
    pub plan: String,
    /// One-time instructions known done (`None`: running, the agent reports no progress then).
    pub completed: Option<usize>,
    pub total: usize,
    pub probes_healthy: usize,
    pub probes: usize,
    /// `last-apply-time` as the agent wrote it.
    pub last_change: String,
    /// Why it needs a look: failures, an invalid pause/cancel value, a pause or cancel asked for.
    pub error: String,
}

impl Row {
    /// One line of JSON.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Failures first, then what is held or running, then what waits, then what is done.
    fn rank(&self) -> u8 {
        match self.state.as_str() {
            "failed" => 0,
            "canceled" => 1,
            "paused" => 2,
            "in-progress" => 3,
            "pending" => 4,
            "succeeded" | "applied" => 6,
            _ => 5,
        }
    }

    /// Whether the node is done with the plan.
    pub fn done(&self) -> bool {
        matches!(self.state.as_str(), "succeeded" | "applied")
    }

    /// Whether the node failed (or was canceled).
    pub fn failed(&self) -> bool {
        matches!(self.state.as_str(), "failed" | "canceled")
    }
}

/// The row of the Secret `name`.
pub fn row_of(name: &str, s: &SecretSnapshot) -> Row {
    let text = |k: &str| wire::text(s, k).unwrap_or_default();
    let Some(raw) = s.data.get(wire::PLAN) else {
        return Row {
            node: name.to_string(),
            state: "no plan".into(),
            plan: String::new(),
            completed: None,
            total: 0,
            probes_healthy: 0,
            probes: 0,
            last_change: text(wire::LAST_APPLY_TIME),
            error: String::new(),
        };
    };
    let checksum = plan::checksum(raw);
    let total = plan::parse(raw).map(|p| p.plan.instructions.len()).unwrap_or(0);
    let state = match wire::plan_state(s) {
        Some(st) => st.as_str().to_string(),
        None => match wire::legacy_outcome(s, &checksum) {
            Some(true) => "applied".into(),
            Some(false) => "failed".into(),
            None => "pending".into(),
        },
    };
    let checkpoint = Checkpoint::read(s.data.get(wire::PLAN_CHECKPOINT).map(Vec::as_slice), &checksum);
    let completed = match (&state[..], &checkpoint) {
        ("succeeded" | "applied", _) => Some(total),
        (_, Some(cp)) => Some(cp.completed_instructions.min(total)),
        ("pending", None) => Some(0),
        _ => None,
    };
    let probes = wire::probe_statuses(s);
    let mut error = Vec::new();
    if state == "failed" {
        error.push(format!("{} failures", wire::failure_count(s)));
    }
    let a = wire::annotations(s);
    match plan::resolve_annotations(&a) {
        Err(e) => error.push(e.to_string()),
        Ok(_) => {
            if plan::parse_annotation_value(a.canceled) == Ok(true) && state != "canceled" {
                error.push("cancel asked".into());
            } else if plan::parse_annotation_value(a.paused) == Ok(true) && state != PlanState::Paused.as_str() {
                error.push("pause asked".into());
            }
        }
    }
    Row {
        node: name.to_string(),
        state,
        plan: checksum[..12].to_string(),
        completed,
        total,
        probes_healthy: probes.values().filter(|p| p.healthy).count(),
        probes: probes.len(),
        last_change: text(wire::LAST_APPLY_TIME),
        error: error.join("; "),
    }
}

/// Rows sorted as the table shows them: failures first, then by node.
pub fn sorted(mut rows: Vec<Row>) -> Vec<Row> {
    rows.sort_by(|a, b| (a.rank(), &a.node).cmp(&(b.rank(), &b.node)));
    rows
}

/// The table, one line per node under a header, columns padded to their widest cell.
pub fn table(rows: &[Row]) -> String {
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.node.clone(),
                r.state.clone(),
                r.plan.clone(),
                match r.completed {
                    Some(c) => format!("{c}/{}", r.total),
                    None => format!("?/{}", r.total),
                },
                if r.probes == 0 { "-".into() } else { format!("{}/{} healthy", r.probes_healthy, r.probes) },
                if r.last_change.is_empty() { "-".into() } else { r.last_change.clone() },
                r.error.clone(),
            ]
        })
        .collect();
    let header = ["NODE", "STATE", "PLAN", "INSTRUCTIONS", "PROBES", "LAST CHANGE", "ERROR"].map(String::from);
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |row: &[String; 7]| {
        let mut out = String::new();
        for (i, (c, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        out.trim_end().to_string()
    };
    let mut out = line(&header);
    for row in &cells {
        out.push('\n');
        out.push_str(&line(row));
    }
    out
}

/// A one-line summary: how many nodes in each state.
pub fn summary(rows: &[Row]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rows {
        *counts.entry(r.state.as_str()).or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
    format!("{} nodes: {}", rows.len(), parts.join(", "))
}

/// The latest row of every node, for a watch.
#[derive(Debug, Default)]
pub struct Rows {
    rows: BTreeMap<String, Row>,
}

impl Rows {
    /// Record a node's row; `true` when it differs from the one it had (a transition to report).
    pub fn set(&mut self, row: Row) -> bool {
        if self.rows.get(&row.node) == Some(&row) {
            return false;
        }
        self.rows.insert(row.node.clone(), row);
        true
    }

    /// Forget a node (its Secret was deleted or no longer matches); `true` if it was known.
    pub fn remove(&mut self, node: &str) -> bool {
        self.rows.remove(node).is_some()
    }

    pub fn all(&self) -> Vec<Row> {
        sorted(self.rows.values().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::client::test_snapshot as snap;

    #[test]
    fn rows_of_every_state() {
        let p =
            serde_json::json!({"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "true"}]});
        let sum = plan::checksum(&serde_json::to_vec(&p).unwrap_or_default());
        let cp = format!(r#"{{"checksum":"{sum}","completedInstructions":1,"totalInstructions":2,"paused":true}}"#);
        let probes = r#"{"web":{"healthy":true},"db":{"healthy":false}}"#;
        let rows = [
            (snap(&p, &[("plan-state", "pending")], &[]), "pending", Some(0), ""),
            (snap(&p, &[("plan-state", "in-progress")], &[]), "in-progress", None, ""),
            (snap(&p, &[("plan-state", "paused"), ("plan-checkpoint", &cp)], &[]), "paused", Some(1), ""),
            (snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", probes)], &[]), "succeeded", Some(2), ""),
            (snap(&p, &[("plan-state", "failed"), ("failure-count", "3")], &[]), "failed", None, "3 failures"),
            (snap(&p, &[("applied-checksum", &sum)], &[]), "applied", Some(2), ""),
            (snap(&p, &[("failed-checksum", &sum), ("failure-count", "1")], &[]), "failed", None, "1 failures"),
            (
                snap(&p, &[("plan-state", "in-progress")], &[(plan::ANNOTATION_CANCELED, "true")]),
                "in-progress",
                None,
                "cancel asked",
            ),
            (snap(&p, &[("plan-state", "pending")], &[(plan::ANNOTATION_PAUSED, "yes")]), "pending", Some(0), "paused"),
        ];
        for (s, state, completed, error) in rows {
            let r = row_of("n", &s);
            assert_eq!((r.state.as_str(), r.completed, r.total), (state, completed, 2), "{r:?}");
            assert!(r.error.contains(error), "{error:?} in {r:?}");
            assert_eq!(r.plan, sum[..12]);
        }
        let r = row_of("n", &snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", probes)], &[]));
        assert_eq!((r.probes_healthy, r.probes), (1, 2));
        let mut none = snap(&p, &[], &[]);
        none.data.clear();
        assert_eq!(row_of("n", &none).state, "no plan");
    }

    #[test]
    fn failures_sort_first_and_the_table_aligns() {
        let row = |node: &str, state: &str| Row {
            node: node.into(),
            state: state.into(),
            plan: "abc".into(),
            completed: Some(1),
            total: 2,
            probes_healthy: 0,
            probes: 0,
            last_change: String::new(),
            error: String::new(),
        };
        let rows = sorted(vec![row("a", "succeeded"), row("b", "failed"), row("c", "in-progress"), row("d", "failed")]);
        let order: Vec<&str> = rows.iter().map(|r| r.node.as_str()).collect();
        assert_eq!(order, ["b", "d", "c", "a"]);
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines[0].starts_with("NODE  STATE        PLAN  INSTRUCTIONS"), "{t}");
        assert!(lines[1].starts_with("b     failed       abc   1/2"), "{t}");
        assert_eq!(summary(&rows), "4 nodes: 2 failed, 1 in-progress, 1 succeeded");
    }

    #[test]
    fn a_watch_reports_each_change_once() {
        let mut rows = Rows::default();
        let r = Row {
            node: "a".into(),
            state: "pending".into(),
            plan: "x".into(),
            completed: Some(0),
            total: 1,
            probes_healthy: 0,
            probes: 0,
            last_change: String::new(),
            error: String::new(),
        };
        assert!(rows.set(r.clone()));
        assert!(!rows.set(r.clone()), "the same row again is no transition");
        assert!(rows.set(Row { state: "succeeded".into(), ..r.clone() }));
        assert!(rows.remove("a") && !rows.remove("a"));
        let json: serde_json::Value = serde_json::from_str(&r.json()).unwrap_or_default();
        assert_eq!((json["node"].as_str(), json["completed"].as_u64()), (Some("a"), Some(0)));
    }
}
