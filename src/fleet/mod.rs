//! Many nodes at once: where each node's plan object (its plan Secret, or its NodePlan) stands,
//! as one row per node, for `nodeplan plan status --selector` (a table sorted failures first, or
//! one JSON object per node and per change), the fan-out commands and the rollout.
//!
//! Pure, except [`objects`]: a [`Standing`] is read from either kind of object ([`secret`],
//! [`nodeplan`]) so everything above it (rows, the rollout's rules in `crate::fleet::rollout`) is written
//! once; a [`Row`] is computed from it ([`row_of`]) and rendered ([`table`], [`Row::json`]);
//! [`Rows`] keeps the latest row of every node and says which changed, so a watch reports every
//! transition once. [`objects`] is the I/O edge: listing, watching and writing the selected
//! objects of either kind. The commands are `cli`'s.

pub mod local;
pub mod logs;
pub mod nodeplan;
pub mod objects;
pub mod rollout;
pub mod secret;

use crate::plan::ProbeStatus;
use serde::Serialize;
use std::collections::BTreeMap;

/// How the run of the plan an object holds ended, as far as its agent reported.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Outcome {
    /// Not over yet: not taken up, pending, in progress, paused, or a failure to be retried.
    #[default]
    Running,
    Succeeded,
    /// Over without success: failed, canceled, or refused by the agent (why, for people).
    Failed(String),
}

/// Where one node stands on the plan its object holds, whatever the object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Standing {
    /// The node as people name it: the plan Secret's name, the NodePlan's node.
    pub node: String,
    /// The checksum of the plan the object holds (`None`: no plan). A plan Secret's is of its
    /// bytes, a NodePlan's of `spec.plan` in canonical JSON (what a rollout compares).
    pub plan: Option<String>,
    /// The plan's id as every command shows it ([`crate::plan::id`]; empty: no valid plan).
    pub id: String,
    /// As shown: `no plan`, `pending`, `in-progress`, `paused`, `succeeded`, `failed`,
    /// `canceled`; `applied` in the legacy checksum flow; `refused` for a spec the agent will
    /// not run.
    pub state: String,
    pub outcome: Outcome,
    /// One-time instructions known done (`None`: running, the agent reports no progress then).
    pub completed: Option<usize>,
    pub total: usize,
    /// The probes the plan has.
    pub probe_names: Vec<String>,
    /// The probes the agent reports.
    pub probes: BTreeMap<String, ProbeStatus>,
    /// The last change as the agent wrote it.
    pub last_change: String,
    /// Why it needs a look: failures, an invalid pause/cancel value, a pause or cancel asked for.
    pub notes: Vec<String>,
    pub annotations: BTreeMap<String, String>,
}

impl Standing {
    /// Whether every probe of the plan is reported healthy.
    pub fn healthy(&self) -> bool {
        self.probe_names.iter().all(|n| self.probes.get(n).is_some_and(|p| p.healthy))
    }
}

/// Where one node's plan stands.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// The node (one plan object per node).
    pub node: String,
    /// The plan object: `Secret` or `NodePlan` (empty when not known), its namespace and name.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub kind: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// See [`Standing::state`].
    pub state: String,
    /// The plan's short id (12 hex digits; empty without a plan).
    pub plan: String,
    /// One-time instructions known done (`None`: running, the agent reports no progress then).
    pub completed: Option<usize>,
    pub total: usize,
    pub probes_healthy: usize,
    pub probes: usize,
    /// The last change as the agent wrote it.
    pub last_change: String,
    /// Why it needs a look: failures, an invalid pause/cancel value, a pause or cancel asked for.
    pub error: String,
}

impl Row {
    /// `NAMESPACE/NAME` of the object (`-` when not known).
    pub fn object(&self) -> String {
        if self.name.is_empty() { "-".into() } else { format!("{}/{}", self.namespace, self.name) }
    }

    /// The object as kubectl's `-o name` says it: `secret/NAME`, `nodeplan.agent.cattle.io/NAME`.
    pub fn kube_name(&self) -> String {
        match self.kind.as_str() {
            "Secret" => format!("secret/{}", self.name),
            "NodePlan" => format!("nodeplan.{}/{}", crate::nodeplan::resource::GROUP, self.name),
            _ => self.node.clone(),
        }
    }

    /// One line of JSON.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Failures first, then what is held or running, then what waits, then what is done.
    fn rank(&self) -> u8 {
        match self.state.as_str() {
            "failed" | "refused" => 0,
            "canceled" => 1,
            "paused" => 2,
            "in-progress" => 3,
            "pending" => 4,
            "succeeded" | "applied" => 6,
            _ => 5,
        }
    }
}

/// `1 failure` or `N failures` in a row, and what made the plan fail when its agent said so: a
/// failed node's note, and (after `failed`) its outcome as a rollout shows it.
pub fn failure_text(failures: i64, failure: Option<&crate::plan::Failure>) -> String {
    let n = if failures == 1 { "1 failure".to_string() } else { format!("{failures} failures") };
    match failure {
        Some(f) => format!("{n}: {}", f.note()),
        None => n,
    }
}

/// The row of a node.
pub fn row_of(s: &Standing) -> Row {
    Row {
        node: s.node.clone(),
        kind: String::new(),
        namespace: String::new(),
        name: String::new(),
        state: s.state.clone(),
        plan: if s.id.is_empty() {
            s.plan.as_deref().map(crate::plan::short).unwrap_or_default().to_string()
        } else {
            s.id.clone()
        },
        completed: s.completed,
        total: s.total,
        probes_healthy: s.probes.values().filter(|p| p.healthy).count(),
        probes: s.probes.len(),
        last_change: crate::plan::shown_time(&s.last_change),
        error: s.notes.join("; "),
    }
}

/// Rows sorted as the table shows them: failures first, then by node.
pub fn sorted(mut rows: Vec<Row>) -> Vec<Row> {
    rows.sort_by(|a, b| a.rank().cmp(&b.rank()).then_with(|| natural(&a.node, &b.node)));
    rows
}

/// Names in the order people count them: runs of digits by their value (`node-2` before
/// `node-10`), everything else as text.
fn natural(a: &str, b: &str) -> std::cmp::Ordering {
    fn runs(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        for (i, c) in s.char_indices().skip(1) {
            let prev = s[..i].chars().next_back().is_some_and(|p| p.is_ascii_digit());
            if c.is_ascii_digit() != prev {
                out.push((prev, &s[start..i]));
                start = i;
            }
        }
        if !s.is_empty() {
            out.push((s[start..].starts_with(|c: char| c.is_ascii_digit()), &s[start..]));
        }
        out
    }
    fn key((digits, run): (bool, &str)) -> (bool, usize, &str, &str) {
        let n = if digits { run.trim_start_matches('0') } else { "" };
        (!digits, n.len(), n, run)
    }
    runs(a).into_iter().map(key).cmp(runs(b).into_iter().map(key))
}

/// The table, one line per node under a header, columns padded to their widest cell; `wide`
/// adds the object (namespace and name) each row is of.
pub fn table(rows: &[Row], wide: bool) -> String {
    let mut header =
        ["NODE", "STATE", "PLAN", "INSTRUCTIONS", "PROBES", "LAST CHANGE", "ERROR"].map(String::from).to_vec();
    if wide {
        header.insert(6, "OBJECT".into());
    }
    let mut cells = vec![header];
    for r in rows {
        let mut row = vec![
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
        ];
        if wide {
            row.insert(6, r.object());
        }
        cells.push(row);
    }
    crate::columns(&cells).join("\n")
}

/// A one-line summary: how many nodes in each state. When the nodes hold two or three plans (a
/// rollout under way, or stopped by its failure budget), per plan: a node that succeeded on the
/// older plan has not succeeded on the new one. More plans than that (each node its own) are only
/// counted.
pub fn summary(rows: &[Row]) -> String {
    let plans: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.plan.as_str()).collect();
    let split = (2..=3).contains(&plans.len());
    let mut counts: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for r in rows {
        let plan = if split { r.plan.as_str() } else { "" };
        *counts.entry((plan, r.state.as_str())).or_default() += 1;
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|((plan, s), n)| match *plan {
            _ if !split => format!("{n} {s}"),
            "" => format!("{n} {s} (no plan)"),
            p => format!("{n} {s} on plan {p}"),
        })
        .collect();
    let more = if plans.len() > 3 { format!(" ({} plans)", plans.len()) } else { String::new() };
    format!("{}: {}{more}", crate::count(rows.len(), "node"), parts.join(", "))
}

/// The latest row of every node, for a watch.
#[derive(Debug, Default)]
pub struct Rows {
    rows: BTreeMap<String, Row>,
}

impl Rows {
    /// Record the row of the object `key`; `true` when it differs from the one it had (a
    /// transition to report).
    pub fn set(&mut self, key: &str, row: Row) -> bool {
        if self.rows.get(key) == Some(&row) {
            return false;
        }
        self.rows.insert(key.to_string(), row);
        true
    }

    /// Forget an object (it was deleted or no longer matches); its last row if it was known.
    pub fn remove(&mut self, key: &str) -> Option<Row> {
        self.rows.remove(key)
    }

    pub fn all(&self) -> Vec<Row> {
        sorted(self.rows.values().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One time format in rows (table and JSON) whatever the object: a Secret's Go `UnixDate` and a
    /// NodePlan's RFC 3339 with milliseconds both show as RFC 3339 to the second.
    #[test]
    fn row_times_are_rfc3339_whatever_the_object_wrote() {
        let st = Standing { last_change: "Wed Dec  2 12:00:00 UTC 2026".into(), ..Standing::default() };
        assert!(row_of(&st).json().contains(r#""lastChange":"2026-12-02T12:00:00Z""#), "{}", row_of(&st).json());
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
            ..Row::default()
        };
        let rows = sorted(vec![row("a", "succeeded"), row("b", "failed"), row("c", "in-progress"), row("d", "failed")]);
        let order: Vec<&str> = rows.iter().map(|r| r.node.as_str()).collect();
        assert_eq!(order, ["b", "d", "c", "a"]);
        let t = table(&rows, false);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines[0].starts_with("NODE   STATE         PLAN   INSTRUCTIONS"), "{t}");
        assert!(lines[1].starts_with("b      failed        abc    1/2"), "{t}");
        assert_eq!(summary(&rows), "4 nodes: 2 failed, 1 in-progress, 1 succeeded");
        assert_eq!(summary(&rows[..1]), "1 node: 1 failed", "one node is not \"1 nodes\"");
        // Issue 43: nodes still on an older plan are not counted as succeeded on the new one.
        let older = |node: &str, state: &str| Row { plan: "def".into(), ..row(node, state) };
        let mixed = vec![row("a", "succeeded"), older("b", "succeeded"), older("c", "succeeded"), row("d", "failed")];
        assert_eq!(summary(&mixed), "4 nodes: 1 failed on plan abc, 1 succeeded on plan abc, 2 succeeded on plan def");
        let own = |node: &str| Row { plan: format!("p-{node}"), ..row(node, "canceled") };
        let each = vec![own("a"), own("b"), own("c"), own("d")];
        assert_eq!(summary(&each), "4 nodes: 4 canceled (4 plans)", "each node its own plan: counted, not listed");
    }

    #[test]
    fn nodes_sort_as_people_count_them() {
        let mut names = vec!["node-10", "node-2", "node-1", "node-02", "alpha", "node-", "node-1a", "7", "10", ""];
        names.sort_by(|a, b| natural(a, b));
        assert_eq!(names, ["", "7", "10", "alpha", "node-", "node-1", "node-1a", "node-02", "node-2", "node-10"]);
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
            ..Row::default()
        };
        assert!(rows.set("a", r.clone()));
        assert!(!rows.set("a", r.clone()), "the same row again is no transition");
        assert!(rows.set("a", Row { state: "succeeded".into(), ..r.clone() }));
        assert!(rows.remove("a").is_some() && rows.remove("a").is_none());
        let json: serde_json::Value = serde_json::from_str(&r.json()).unwrap_or_default();
        assert_eq!((json["node"].as_str(), json["completed"].as_u64()), (Some("a"), Some(0)));
    }
}
