//! A rollout: one plan pushed to many nodes' plan objects (their plan Secrets, or one NodePlan
//! per node), a few at a time, stopping by itself when too many fail. Kubernetes is the engine:
//! the rollout keeps no state of its own, so a rerun of the same command (after Ctrl-C, a lost
//! connection, a closed laptop) sees where every node stands from the objects alone and goes on;
//! failures already counted stay counted.
//!
//! A node is in one of four places ([`classify`], from the node's [`Standing`], whichever kind of
//! object it is read from): done (its object holds this plan and it succeeded, and with
//! `--wait-healthy` its probes pass), failed (this plan failed or was canceled or refused there,
//! or the rollout gave up on it at its timeout), in flight (this plan is not over there yet), or
//! to start (its object holds another plan, or none). [`decide`] turns the nodes and the limits
//! into the next step: which nodes to start, which to give up on, and whether the rollout is
//! over. Pure; the command (`cli::rollout`) does the I/O, through `fleet::objects`, which writes
//! the patches made here.

use crate::fleet::{Outcome, Standing};
use crate::plan;
use crate::remote::wire;
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::time::Duration;

/// When the rollout started the node (RFC 3339), for its per-node timeout.
pub const ANNOTATION_STARTED: &str = "rollout.nodeplan.cattle.io/started";
/// The rollout gave up on the node at its timeout (and canceled its plan): a failure.
pub const ANNOTATION_TIMED_OUT: &str = "rollout.nodeplan.cattle.io/timed-out";
/// The rollout the node belongs to: the name of its Lease. A second rollout over a node whose
/// rollout's Lease is held is refused.
pub const ANNOTATION_LEASE: &str = "rollout.nodeplan.cattle.io/lease";

/// The Lease of the rollout over `selector` in `namespace` (the same command, run again, has the
/// same one).
pub fn lease_name(namespace: &str, selector: &str) -> String {
    let id = plan::checksum(format!("{namespace}\n{selector}").as_bytes());
    format!("nodeplan-rollout-{}", &id[..12])
}

/// The merge patch that claims a node for the rollout whose Lease is `lease`.
pub fn claim_patch(lease: &str) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_LEASE: lease}}})
}

/// `N` or `P%` of the selected nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amount {
    Count(usize),
    Percent(u8),
}

impl Amount {
    pub fn parse(s: &str) -> Result<Amount, String> {
        let bad = || format!("{}: expected a count (5) or a percentage (10%)", crate::quoted(s));
        match s.strip_suffix('%') {
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= 100 => Ok(Amount::Percent(p)),
                _ => Err(bad()),
            },
            None => s.parse::<usize>().map(Amount::Count).map_err(|_| bad()),
        }
    }

    /// Of `total` nodes; a percentage of concurrency rounds up (and is at least 1), of errors down.
    pub fn of(self, total: usize, round_up: bool) -> usize {
        match self {
            Amount::Count(n) => n,
            Amount::Percent(p) => {
                let scaled = total * p as usize;
                if round_up { scaled.div_ceil(100).max(1) } else { scaled / 100 }
            }
        }
    }
}

/// The rollout's limits, resolved against the number of selected nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_concurrent: usize,
    /// Failures tolerated; one more and no new node starts.
    pub max_errors: usize,
    pub wait_healthy: bool,
    pub timeout: Option<Duration>,
}

/// Where one node stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    Done,
    Failed(String),
    InFlight { started: Option<DateTime<Utc>> },
    ToStart,
}

/// Where a node stands in a rollout of the plan with `checksum` (of the plan's bytes for a plan
/// Secret, of its canonical JSON for a NodePlan: what [`Standing::plan`] holds).
pub fn classify(s: &Standing, checksum: &str, wait_healthy: bool) -> Place {
    if s.plan.as_deref() != Some(checksum) {
        return Place::ToStart;
    }
    if s.annotations.get(ANNOTATION_TIMED_OUT).is_some_and(|v| v == "true") {
        return Place::Failed("timed out".into());
    }
    let started =
        s.annotations.get(ANNOTATION_STARTED).and_then(|t| DateTime::parse_from_rfc3339(t).ok()).map(|t| t.to_utc());
    match &s.outcome {
        Outcome::Failed(why) => Place::Failed(why.clone()),
        Outcome::Succeeded if !wait_healthy || s.healthy() => Place::Done,
        Outcome::Succeeded | Outcome::Running => Place::InFlight { started },
    }
}

/// How a rollout ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Every selected node is done.
    AllSucceeded,
    /// Every node was tried; some failed, within the budget.
    SomeFailed,
    /// More failures than `--max-errors`: no new node was started, the ones in flight finished.
    ErrorBudget,
}

/// The next step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// Start these nodes now (push the plan), in this order.
    pub start: Vec<String>,
    /// Give up on these (in flight past the timeout): cancel their plan, count them failed.
    pub give_up: Vec<String>,
    pub finish: Option<Finish>,
}

/// Counts for the progress line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub done: usize,
    /// Over without success, a cancel excepted.
    pub failed: usize,
    /// Canceled (by `rollout cancel`, `plan cancel` or someone else): over, not a failure of the
    /// plan; it counts against the error budget as a failure does.
    pub canceled: usize,
    pub in_flight: usize,
    pub to_start: usize,
}

pub fn counts(nodes: &BTreeMap<String, Place>) -> Counts {
    let mut c = Counts::default();
    for p in nodes.values() {
        match p {
            Place::Done => c.done += 1,
            Place::Failed(why) if why == "canceled" => c.canceled += 1,
            Place::Failed(_) => c.failed += 1,
            Place::InFlight { .. } => c.in_flight += 1,
            Place::ToStart => c.to_start += 1,
        }
    }
    c
}

/// An overall progress bar `width` cells wide: `#` done, `x` failed, `>` in flight, `.` waiting.
pub fn bar(c: Counts, total: usize, width: usize) -> String {
    let cells = |n: usize| (n * width).checked_div(total).unwrap_or(0);
    let (done, failed, flying) = (cells(c.done), cells(c.failed + c.canceled), cells(c.in_flight));
    let rest = width.saturating_sub(done + failed + flying);
    format!("[{}{}{}{}] {}/{total}", "#".repeat(done), "x".repeat(failed), ">".repeat(flying), ".".repeat(rest), c.done)
}

/// The rule: give up on nodes past their timeout; while failures are within the budget, start
/// nodes (by name) until `max_concurrent` are in flight; the rollout is over when nothing is in
/// flight and nothing more will start.
pub fn decide(nodes: &BTreeMap<String, Place>, limits: &Limits, now: DateTime<Utc>) -> Step {
    let mut step = Step::default();
    if let Some(t) = limits.timeout.and_then(|t| chrono::TimeDelta::from_std(t).ok()) {
        for (name, p) in nodes {
            if let Place::InFlight { started: Some(s) } = p
                && now - *s >= t
            {
                step.give_up.push(name.clone());
            }
        }
    }
    let c = counts(nodes);
    let failed = c.failed + c.canceled + step.give_up.len();
    let in_flight = c.in_flight - step.give_up.len();
    let over_budget = failed > limits.max_errors;
    if !over_budget {
        let slots = limits.max_concurrent.saturating_sub(in_flight);
        step.start = nodes.iter().filter(|(_, p)| **p == Place::ToStart).map(|(n, _)| n.clone()).take(slots).collect();
    }
    let to_start = if over_budget { 0 } else { c.to_start };
    if in_flight == 0 && (to_start == 0 || over_budget) && step.start.is_empty() {
        step.finish = Some(if over_budget {
            Finish::ErrorBudget
        } else if failed > 0 {
            Finish::SomeFailed
        } else {
            Finish::AllSucceeded
        });
    }
    step
}

/// The merge patch that starts a node: the plan as `pending` (as `plan push` writes it), a cancel
/// left from before cleared (a pause stays: the node waits in flight until resumed), and the start
/// time.
pub fn start_patch(raw_plan: &[u8], now: DateTime<Utc>) -> serde_json::Value {
    let mut p = wire::push_patch(raw_plan);
    p["metadata"]["annotations"] = serde_json::json!({
        ANNOTATION_STARTED: now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        ANNOTATION_TIMED_OUT: null,
        plan::ANNOTATION_CANCELED: null,
    });
    p
}

/// The merge patch that gives up on a node at its timeout: cancel its plan, mark it timed out.
pub fn give_up_patch() -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {plan::ANNOTATION_CANCELED: "true", ANNOTATION_TIMED_OUT: "true"}}})
}

/// A NodePlan's [`give_up_patch`]: `spec.canceled`, and the mark.
pub fn give_up_nodeplan_patch() -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANNOTATION_TIMED_OUT: "true"}}, "spec": {"canceled": true}})
}

/// The NodePlan that starts a node (written over `existing`, on its resourceVersion): the whole
/// `spec.plan` replaced and `spec.canceled` cleared as `plan push` does it (a pause stays), a new
/// `spec.runToken` (the start time: the run is a new one, so no status of an earlier run of the
/// same plan, failed or applied, is taken for it), the start time, the claim (`lease`), a timeout
/// mark from before removed.
pub fn start_nodeplan(
    existing: &kube::api::DynamicObject,
    plan: serde_json::Value,
    now: DateTime<Utc>,
    lease: Option<&str>,
) -> kube::api::DynamicObject {
    let mut next = crate::nodeplan::cli_wire::replace_plan(existing, plan, None);
    next.data["spec"]["runToken"] = now.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true).into();
    let a = next.metadata.annotations.get_or_insert_default();
    a.insert(ANNOTATION_STARTED.into(), now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    a.remove(ANNOTATION_TIMED_OUT);
    if let Some(l) = lease {
        a.insert(ANNOTATION_LEASE.into(), l.into());
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::secret;
    use crate::remote::client::test_snapshot as snap;

    fn limits(c: usize, e: usize) -> Limits {
        Limits { max_concurrent: c, max_errors: e, wait_healthy: false, timeout: Some(Duration::from_secs(60)) }
    }

    fn nodes(places: &[(&str, Place)]) -> BTreeMap<String, Place> {
        places.iter().map(|(n, p)| (n.to_string(), p.clone())).collect()
    }

    #[test]
    fn the_bar_shows_each_place() {
        let c = Counts { done: 5, failed: 1, canceled: 0, in_flight: 2, to_start: 2 };
        assert_eq!(bar(c, 10, 10), "[#####x>>..] 5/10");
        let with_cancel = Counts { failed: 0, canceled: 1, ..c };
        assert_eq!(bar(with_cancel, 10, 10), "[#####x>>..] 5/10");
        // A canceled node is counted as canceled, not as a failure (it still spends the budget).
        let places =
            nodes(&[("a", Place::Failed("canceled".into())), ("b", Place::Failed("failed (1 failure)".into()))]);
        assert_eq!((counts(&places).failed, counts(&places).canceled), (1, 1));
        assert_eq!(bar(Counts::default(), 0, 4), "[....] 0/0");
    }

    #[test]
    fn amounts() {
        assert_eq!(Amount::parse("5"), Ok(Amount::Count(5)));
        assert_eq!(Amount::parse("10%"), Ok(Amount::Percent(10)));
        for bad in ["", "x", "-1", "101%", "5 %", "%"] {
            assert!(Amount::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Amount::Percent(10).of(20, true), 2);
        assert_eq!(Amount::Percent(10).of(5, true), 1, "concurrency rounds up, at least 1");
        assert_eq!(Amount::Percent(10).of(5, false), 0, "errors round down");
        assert_eq!(Amount::Percent(0).of(5, true), 1);
        assert_eq!(Amount::Count(3).of(100, false), 3);
    }

    #[test]
    fn decide_table() {
        let now = Utc::now();
        let running = Place::InFlight { started: Some(now) };
        let old = Place::InFlight { started: Some(now - chrono::TimeDelta::seconds(61)) };
        let f = || Place::Failed("failed".into());
        let rows: Vec<(&str, BTreeMap<String, Place>, Limits, Step)> = vec![
            (
                "start up to the concurrency, by name",
                nodes(&[("c", Place::ToStart), ("a", Place::ToStart), ("b", Place::ToStart)]),
                limits(2, 0),
                Step { start: vec!["a".into(), "b".into()], ..Default::default() },
            ),
            (
                "in flight take slots",
                nodes(&[("a", running.clone()), ("b", Place::ToStart), ("c", Place::ToStart)]),
                limits(2, 0),
                Step { start: vec!["b".into()], ..Default::default() },
            ),
            (
                "within the budget: go on",
                nodes(&[("a", f()), ("b", Place::ToStart)]),
                limits(1, 1),
                Step { start: vec!["b".into()], ..Default::default() },
            ),
            (
                "over the budget: start nothing, wait for the in-flight",
                nodes(&[("a", f()), ("b", f()), ("c", running.clone()), ("d", Place::ToStart)]),
                limits(5, 1),
                Step::default(),
            ),
            (
                "over the budget and nothing in flight: stopped",
                nodes(&[("a", f()), ("b", f()), ("d", Place::ToStart)]),
                limits(5, 1),
                Step { finish: Some(Finish::ErrorBudget), ..Default::default() },
            ),
            (
                "all done",
                nodes(&[("a", Place::Done), ("b", Place::Done)]),
                limits(1, 0),
                Step { finish: Some(Finish::AllSucceeded), ..Default::default() },
            ),
            (
                "all tried, a failure within the budget",
                nodes(&[("a", Place::Done), ("b", f())]),
                limits(1, 1),
                Step { finish: Some(Finish::SomeFailed), ..Default::default() },
            ),
            (
                "past the timeout: give up, which frees its slot",
                nodes(&[("a", old.clone()), ("b", Place::ToStart)]),
                limits(1, 1),
                Step { give_up: vec!["a".into()], start: vec!["b".into()], finish: None },
            ),
            (
                "a give-up that exceeds the budget starts nothing",
                nodes(&[("a", old), ("b", Place::ToStart)]),
                limits(1, 0),
                Step { give_up: vec!["a".into()], start: vec![], finish: Some(Finish::ErrorBudget) },
            ),
            (
                "nothing selected",
                nodes(&[]),
                limits(1, 0),
                Step { finish: Some(Finish::AllSucceeded), ..Default::default() },
            ),
        ];
        for (what, n, l, want) in rows {
            assert_eq!(decide(&n, &l, now), want, "{what}");
        }
    }

    #[test]
    fn classify_table() {
        let p = serde_json::json!({"instructions": [{"name": "a", "command": "true"}], "probes": {"web": {"httpGet": {"url": "http://x"}}}});
        let other = serde_json::json!({"instructions": []});
        let c = plan::checksum(&serde_json::to_vec(&p).unwrap_or_default());
        let healthy = r#"{"web":{"healthy":true}}"#;
        let sick = r#"{"web":{"healthy":false}}"#;
        let t0 = "2026-12-01T10:00:00Z";
        let done_cp = format!(
            r#"{{"checksum":"{c}","completedInstructions":0,"totalInstructions":0,"resumeState":"succeeded","paused":true}}"#
        );
        let started = Some(DateTime::parse_from_rfc3339(t0).map(|t| t.to_utc()).unwrap_or_default());
        let rows = [
            ("another plan", snap(&other, &[("plan-state", "succeeded")], &[]), false, Place::ToStart),
            (
                "pending",
                snap(&p, &[("plan-state", "pending")], &[(ANNOTATION_STARTED, t0)]),
                false,
                Place::InFlight { started },
            ),
            ("running", snap(&p, &[("plan-state", "in-progress")], &[]), false, Place::InFlight { started: None }),
            ("paused", snap(&p, &[("plan-state", "paused")], &[]), false, Place::InFlight { started: None }),
            (
                "paused after succeeding",
                snap(&p, &[("plan-state", "paused"), ("plan-checkpoint", &done_cp)], &[]),
                false,
                Place::Done,
            ),
            ("succeeded", snap(&p, &[("plan-state", "succeeded")], &[]), false, Place::Done),
            (
                "succeeded, healthy",
                snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", healthy)], &[]),
                true,
                Place::Done,
            ),
            (
                "succeeded, sick",
                snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", sick)], &[]),
                true,
                Place::InFlight { started: None },
            ),
            (
                "succeeded, no probe yet",
                snap(&p, &[("plan-state", "succeeded")], &[]),
                true,
                Place::InFlight { started: None },
            ),
            (
                "failed",
                snap(&p, &[("plan-state", "failed"), ("failure-count", "2")], &[]),
                false,
                Place::Failed("failed (2 failures)".into()),
            ),
            ("canceled", snap(&p, &[("plan-state", "canceled")], &[]), false, Place::Failed("canceled".into())),
            (
                "timed out",
                snap(&p, &[("plan-state", "in-progress")], &[(ANNOTATION_TIMED_OUT, "true")]),
                false,
                Place::Failed("timed out".into()),
            ),
            ("legacy applied", snap(&p, &[("applied-checksum", &c)], &[]), false, Place::Done),
            (
                "legacy failed",
                snap(&p, &[("failed-checksum", &c)], &[]),
                false,
                Place::Failed("failed (0 failures)".into()),
            ),
        ];
        for (what, s, wait_healthy, want) in rows {
            assert_eq!(classify(&secret::standing("n", &s), &c, wait_healthy), want, "{what}");
        }
        let mut none = snap(&p, &[], &[]);
        none.data.clear();
        assert_eq!(classify(&secret::standing("n", &none), &c, false), Place::ToStart);
    }

    #[test]
    fn a_nodeplan_start_replaces_the_plan_and_clears_what_held_it() {
        let now = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z").map(|t| t.to_utc()).unwrap_or_default();
        let existing: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
            "metadata": {"name": "p", "resourceVersion": "5", "annotations": {ANNOTATION_TIMED_OUT: "true", "keep": "me"}},
            "spec": {"canceled": true, "paused": true, "priority": 3,
                     "plan": {"instructions": [], "probes": {"old": {"fileExists": {"path": "/x"}}}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let next = start_nodeplan(&existing, serde_json::json!({"instructions": []}), now, Some("ns/lease"));
        let a = next.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(a.get(ANNOTATION_STARTED).map(String::as_str), Some("2026-12-01T10:00:00Z"));
        assert_eq!(a.get(ANNOTATION_LEASE).map(String::as_str), Some("ns/lease"));
        assert!(!a.contains_key(ANNOTATION_TIMED_OUT) && a.contains_key("keep"), "{a:?}");
        assert_eq!(next.metadata.resource_version.as_deref(), Some("5"), "written on the version read");
        let spec = &next.data["spec"];
        assert_eq!(spec["plan"], serde_json::json!({"instructions": []}), "the plan replaced whole");
        assert_eq!(spec["runToken"], "2026-12-01T10:00:00.000000000Z", "a new run");
        assert_eq!(
            (spec["canceled"].as_bool(), spec["paused"].as_bool(), spec["priority"].as_i64()),
            (Some(false), Some(true), Some(3))
        );
    }

    #[test]
    fn the_start_patch_pushes_and_clears_what_held_the_node() {
        let now = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z").map(|t| t.to_utc()).unwrap_or_default();
        let p = start_patch(b"{}", now);
        assert_eq!(p["metadata"]["annotations"][ANNOTATION_STARTED], "2026-12-01T10:00:00Z");
        assert!(p["metadata"]["annotations"][plan::ANNOTATION_CANCELED].is_null());
        assert!(p["data"]["plan"].is_string() && p["data"]["plan-state"].is_string(), "{p}");
    }
}
