//! The plan Secret's data keys and the pure functions over them: reading a snapshot into the
//! flow's vocabulary, the legacy checksum flow's decision, turning outcomes into the keys to
//! write, and the orchestrator's patches (`nodeplan plan`). No I/O.

use super::client::SecretSnapshot;
use crate::flow::{self, CheckpointWrite, Record, Transition};
use crate::plan::{
    self, Annotations, Checkpoint, PeriodicInstructionOutput, PlanState, ProbeStatus, format_unix_date, parse_unix_date,
};
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;

pub const PLAN: &str = "plan";
pub const PLAN_STATE: &str = "plan-state";
pub const PLAN_REVISION: &str = "plan-revision";
pub const PLAN_CHECKPOINT: &str = "plan-checkpoint";
pub const APPLIED_CHECKSUM: &str = "applied-checksum";
pub const APPLIED_OUTPUT: &str = "applied-output";
pub const FAILED_CHECKSUM: &str = "failed-checksum";
pub const FAILED_OUTPUT: &str = "failed-output";
/// nodeplan's own key (Rancher neither reads nor writes it): what made the plan of
/// `failed-checksum` fail, JSON of [`crate::plan::Failure`]; written and cleared with
/// `failed-checksum`.
pub const FAILED_INSTRUCTION: &str = "failed-instruction";
pub const FAILURE_COUNT: &str = "failure-count";
pub const SUCCESS_COUNT: &str = "success-count";
pub const MAX_FAILURES: &str = "max-failures";
pub const LAST_APPLY_TIME: &str = "last-apply-time";
pub const APPLIED_PERIODIC_OUTPUT: &str = "applied-periodic-output";
pub const PROBE_STATUSES: &str = "probe-statuses";
pub const PROBE_PERIOD_SECONDS: &str = "probe-period-seconds";

/// The legacy flow's failure cooldown.
pub const FAILURE_COOLDOWN: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

/// Budget for one encoded output key (gzip), so the Secret stays far below Kubernetes' 1 MiB.
pub const OUTPUT_BUDGET: usize = 256 * 1024;

/// Keys to write: `Some(bytes)` sets (an empty value clears, as system-agent does), `None` deletes.
pub type Keys = BTreeMap<String, Option<Vec<u8>>>;

/// A key's value as text (lossy), `None` when absent.
pub fn text(s: &SecretSnapshot, key: &str) -> Option<String> {
    s.data.get(key).map(|v| String::from_utf8_lossy(v).into_owned())
}

/// In the legacy checksum flow (no `plan-state`), how the plan with `checksum` ended:
/// `Some(true)` applied, `Some(false)` failed, `None` neither yet.
pub fn legacy_outcome(s: &SecretSnapshot, checksum: &str) -> Option<bool> {
    if text(s, APPLIED_CHECKSUM).as_deref() == Some(checksum) {
        Some(true)
    } else if text(s, FAILED_CHECKSUM).as_deref() == Some(checksum) {
        Some(false)
    } else {
        None
    }
}

fn int(s: &SecretSnapshot, key: &str) -> Option<i64> {
    text(s, key).and_then(|v| v.trim().parse().ok())
}

/// An unparsable or missing counter becomes 1 when incremented (system-agent's `incrementCount`).
fn incremented(s: &SecretSnapshot, key: &str) -> Vec<u8> {
    int(s, key).map_or(1, |n| n + 1).to_string().into_bytes()
}

pub fn plan_state(s: &SecretSnapshot) -> Option<PlanState> {
    text(s, PLAN_STATE).filter(|v| !v.is_empty()).map(|v| PlanState::parse(&v))
}

pub fn failure_count(s: &SecretSnapshot) -> i64 {
    int(s, FAILURE_COUNT).unwrap_or(0)
}

/// `max-failures`: unset, empty or invalid means unlimited (−1).
pub fn max_failures(s: &SecretSnapshot) -> i64 {
    int(s, MAX_FAILURES).unwrap_or(-1)
}

/// `CATTLE_AGENT_ATTEMPT_NUMBER`: failure-count + 1 when the key is present and non-empty, else 1.
pub fn attempt(s: &SecretSnapshot) -> i64 {
    match text(s, FAILURE_COUNT) {
        Some(v) if !v.is_empty() => v.trim().parse::<i64>().unwrap_or(0) + 1,
        _ => 1,
    }
}

pub fn probe_period(s: &SecretSnapshot) -> Option<std::time::Duration> {
    int(s, PROBE_PERIOD_SECONDS).filter(|n| *n > 0).map(|n| std::time::Duration::from_secs(n as u64))
}

pub fn probe_statuses(s: &SecretSnapshot) -> BTreeMap<String, ProbeStatus> {
    s.data.get(PROBE_STATUSES).and_then(|v| serde_json::from_slice(v).ok()).unwrap_or_default()
}

/// An unreadable output key is treated as empty (as before), with a warning naming it.
fn decoded<T: Default>(key: &str, r: Result<T, plan::CodecError>) -> T {
    r.unwrap_or_else(|e| {
        tracing::warn!("secret key {key}: {e}; treated as empty");
        T::default()
    })
}

pub fn one_time_output(s: &SecretSnapshot, key: &str) -> BTreeMap<String, Vec<u8>> {
    s.data.get(key).map(|v| decoded(key, plan::decode_one_time_output(v))).unwrap_or_default()
}

pub fn periodic_output(s: &SecretSnapshot) -> BTreeMap<String, PeriodicInstructionOutput> {
    let key = APPLIED_PERIODIC_OUTPUT;
    s.data.get(key).map(|v| decoded(key, plan::decode_periodic_output(v))).unwrap_or_default()
}

pub fn annotations(s: &SecretSnapshot) -> Annotations<'_> {
    let get = |k: &str| s.annotations.get(k).map(String::as_str);
    Annotations {
        paused: get(plan::ANNOTATION_PAUSED),
        canceled: either_cancel(get(plan::ANNOTATION_CANCELED), get(plan::ANNOTATION_CANCELLED)),
    }
}

/// Cancel read through both of Rancher's spellings with one rule: either saying `true` cancels;
/// otherwise an invalid value in either holds the plan (R3); otherwise whichever is set.
fn either_cancel<'a>(us: Option<&'a str>, uk: Option<&'a str>) -> Option<&'a str> {
    let valid = |v: Option<&str>| plan::parse_annotation_value(v).is_ok();
    if us == Some("true") || uk == Some("true") {
        Some("true")
    } else if !valid(us) {
        us
    } else if !valid(uk) {
        uk
    } else {
        us.or(uk)
    }
}

/// `keys` as the Secret's Rancher reads them: a plan canceled through the May 2026 spelling of
/// the annotation alone (`plan.cattle.io/cancelled`) is written `cancelled`, the only spelling that
/// Rancher's `IsTerminal` knows; every other cancel is written `canceled`.
pub fn spelled_for(s: &SecretSnapshot, mut keys: Keys) -> Keys {
    let british = s.annotations.contains_key(plan::ANNOTATION_CANCELLED)
        && !s.annotations.contains_key(plan::ANNOTATION_CANCELED);
    if british
        && let Some(Some(v)) = keys.get_mut(PLAN_STATE)
        && v.as_slice() == PlanState::Canceled.as_str().as_bytes()
    {
        *v = plan::STATE_CANCELLED.as_bytes().to_vec();
    }
    keys
}

/// The checksum of the plan the Secret carries now (`None` without a `plan` key).
pub fn plan_checksum(s: &SecretSnapshot) -> Option<String> {
    s.data.get(PLAN).map(|p| plan::checksum(p))
}

/// The plan-state flow's view of the Secret.
pub fn flow_snapshot(s: &SecretSnapshot, checksum: &str, state: PlanState, total: usize) -> flow::Snapshot {
    flow::Snapshot {
        checksum: checksum.to_string(),
        state,
        hold: plan::resolve_annotations(&annotations(s)),
        checkpoint: Checkpoint::read(s.data.get(PLAN_CHECKPOINT).map(Vec::as_slice), checksum),
        total,
    }
}

fn set(k: &mut Keys, key: &str, v: impl Into<Vec<u8>>) {
    k.insert(key.to_string(), Some(v.into()));
}

/// `failed-instruction` follows `failed-checksum` in `k`: the failure of a run recorded as failed,
/// cleared (an empty value) when a success clears `failed-checksum`, untouched otherwise.
pub fn failure_key(k: &mut Keys, failure: Option<&crate::plan::Failure>) {
    let failed = match k.get(FAILED_CHECKSUM) {
        Some(Some(v)) => !v.is_empty(),
        _ => return,
    };
    let value = match failure.filter(|_| failed) {
        Some(f) => serde_json::to_vec(f).unwrap_or_default(),
        None => Vec::new(),
    };
    set(k, FAILED_INSTRUCTION, value);
}

/// The failure recorded for the plan with `checksum`, if the Secret holds one (bounded: others
/// may write the key).
pub fn failure(s: &SecretSnapshot, checksum: &str) -> Option<crate::plan::Failure> {
    let raw = s.data.get(FAILED_INSTRUCTION).filter(|v| !v.is_empty())?;
    serde_json::from_slice::<crate::plan::Failure>(raw).ok().filter(|f| f.checksum == checksum).map(|f| f.bounded())
}

/// A recorded pause or cancel (or a resume commit).
pub fn transition_keys(t: &Transition) -> Keys {
    let mut k = Keys::new();
    set(&mut k, PLAN_STATE, t.state.as_str());
    set(&mut k, PLAN_CHECKPOINT, t.checkpoint.to_json());
    k
}

/// pending → in-progress, bumping the revision, with a resume's checkpoint folded in.
pub fn begin_keys(s: &SecretSnapshot, resume: Option<&Checkpoint>) -> Keys {
    let mut k = Keys::new();
    set(&mut k, PLAN_STATE, PlanState::InProgress.as_str());
    set(&mut k, PLAN_REVISION, incremented(s, PLAN_REVISION));
    if let Some(c) = resume {
        set(&mut k, PLAN_CHECKPOINT, c.to_json());
    }
    k
}

/// Encode a one-time output map within the budget: the largest entries are trimmed to their tail
/// until the gzip fits (the Secret must stay far below 1 MiB).
pub fn encode_output_capped(map: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let mut map = map.clone();
    loop {
        let enc = plan::encode_one_time_output(&map);
        if enc.len() <= OUTPUT_BUDGET {
            return enc;
        }
        let Some((name, longest)) = map.iter().max_by_key(|(_, v)| v.len()).map(|(k, v)| (k.clone(), v.len())) else {
            return enc;
        };
        if longest <= 1024 {
            return enc;
        }
        let keep = longest / 2;
        if let Some(v) = map.get_mut(&name) {
            let mut trimmed = format!("[nodeplan: {} bytes dropped to fit the Secret]\n", v.len() - keep).into_bytes();
            trimmed.extend_from_slice(&v[v.len() - keep..]);
            *v = trimmed;
        }
    }
}

/// Success or failure bookkeeping shared by both flows (system-agent's outcome table).
fn outcome_keys(
    k: &mut Keys,
    s: &SecretSnapshot,
    checksum: &str,
    succeeded: bool,
    output: &BTreeMap<String, Vec<u8>>,
    now: DateTime<Utc>,
) {
    if succeeded {
        set(k, APPLIED_CHECKSUM, checksum);
        set(k, APPLIED_OUTPUT, encode_output_capped(output));
        set(k, FAILURE_COUNT, "0");
        set(k, FAILED_OUTPUT, "");
        set(k, FAILED_CHECKSUM, "");
        set(k, LAST_APPLY_TIME, format_unix_date(now));
        set(k, SUCCESS_COUNT, incremented(s, SUCCESS_COUNT));
    } else {
        set(k, FAILED_CHECKSUM, checksum);
        set(k, FAILURE_COUNT, incremented(s, FAILURE_COUNT));
        set(k, FAILED_OUTPUT, encode_output_capped(output));
        set(k, SUCCESS_COUNT, "0");
        set(k, LAST_APPLY_TIME, format_unix_date(now));
    }
}

/// The keys for a plan-state flow [`Record`].
pub fn record_keys(s: &SecretSnapshot, checksum: &str, r: &Record, now: DateTime<Utc>) -> Keys {
    let mut k = Keys::new();
    if let Some(state) = &r.state {
        set(&mut k, PLAN_STATE, state.as_str());
    }
    match &r.checkpoint {
        CheckpointWrite::Set(cp) => set(&mut k, PLAN_CHECKPOINT, cp.to_json()),
        // Cleared by an empty value, never by deleting the key.
        CheckpointWrite::Clear => set(&mut k, PLAN_CHECKPOINT, ""),
        CheckpointWrite::Keep => {}
    }
    let empty = BTreeMap::new();
    match r.succeeded {
        Some(ok) => outcome_keys(&mut k, s, checksum, ok, r.one_time_output.as_ref().unwrap_or(&empty), now),
        None => {
            if let Some(o) = &r.one_time_output {
                set(&mut k, APPLIED_OUTPUT, encode_output_capped(o));
            }
        }
    }
    if let Some(p) = &r.periodic_output {
        set(&mut k, APPLIED_PERIODIC_OUTPUT, plan::encode_periodic_output(p));
    }
    k
}

/// What the legacy checksum flow (no `plan-state`) decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegacyDecision {
    pub needs_apply: bool,
    pub was_failed_plan: bool,
    /// A failed plan cooling down: when its cooldown is over and it is retried.
    pub retry_in: Option<std::time::Duration>,
}

/// system-agent's checksum flow: apply when the applied checksum differs (or on the first
/// reconcile since start); a plan that failed waits out max-failures and the 30 s cooldown (and is
/// retried when the cooldown is over, `retry_in`); our own write echoing back is not a reason to
/// apply.
pub fn legacy_decide(
    s: &SecretSnapshot,
    checksum: &str,
    has_run_once: bool,
    own_echo: bool,
    now: DateTime<Utc>,
) -> LegacyDecision {
    let mut needs = text(s, APPLIED_CHECKSUM).as_deref() != Some(checksum);
    if !has_run_once {
        needs = true;
    }
    let failures = failure_count(s);
    let mut was_failed = false;
    let mut retry_in = None;
    if failures != 0 && text(s, FAILED_CHECKSUM).as_deref() == Some(checksum) {
        was_failed = true;
        let max = max_failures(s);
        let last = text(s, LAST_APPLY_TIME).and_then(|t| parse_unix_date(&t)).unwrap_or(now);
        let exhausted = max != -1 && failures >= max;
        let cooling_down = now != last && now <= last + FAILURE_COOLDOWN;
        if exhausted || cooling_down {
            needs = false;
        }
        if cooling_down && !exhausted {
            // Due the first moment the check above no longer holds it.
            let over = last + FAILURE_COOLDOWN + chrono::TimeDelta::milliseconds(1);
            retry_in = (over - now).to_std().ok();
        }
    }
    if own_echo && !was_failed {
        needs = false;
    }
    LegacyDecision { needs_apply: needs, was_failed_plan: was_failed, retry_in }
}

/// The legacy flow's outcome keys.
pub fn legacy_keys(
    s: &SecretSnapshot,
    checksum: &str,
    d: LegacyDecision,
    one_time_succeeded: bool,
    output: &BTreeMap<String, Vec<u8>>,
    periodic: &BTreeMap<String, PeriodicInstructionOutput>,
    now: DateTime<Utc>,
) -> Keys {
    let mut k = Keys::new();
    set(&mut k, APPLIED_PERIODIC_OUTPUT, plan::encode_periodic_output(periodic));
    if (d.needs_apply && !one_time_succeeded) || (!d.needs_apply && d.was_failed_plan) {
        if d.needs_apply {
            outcome_keys(&mut k, s, checksum, false, output, now);
        } else {
            set(&mut k, FAILED_CHECKSUM, checksum);
        }
    } else if d.needs_apply {
        outcome_keys(&mut k, s, checksum, true, output, now);
    } else {
        set(&mut k, APPLIED_CHECKSUM, checksum);
        set(&mut k, APPLIED_OUTPUT, encode_output_capped(output));
        set(&mut k, FAILURE_COUNT, "0");
        set(&mut k, FAILED_OUTPUT, "");
        set(&mut k, FAILED_CHECKSUM, "");
    }
    k
}

/// Whether the Secret's `probe-statuses` is already the empty map a plan without probes writes.
pub fn says_no_probes(s: &SecretSnapshot) -> bool {
    s.data.get(PROBE_STATUSES).is_some_and(|v| v.as_slice() == b"{}")
}

pub fn probe_keys(statuses: &BTreeMap<String, ProbeStatus>) -> Keys {
    let mut k = Keys::new();
    set(&mut k, PROBE_STATUSES, serde_json::to_vec(statuses).unwrap_or_default());
    k
}

// The orchestrator's writes (`nodeplan plan`, for people without Rancher): what Rancher would write.

fn b64(v: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(v)
}

/// The data of a plan Secret created by `nodeplan plan push`: the plan, as `pending`.
pub fn push_data(raw_plan: &[u8]) -> BTreeMap<String, Vec<u8>> {
    BTreeMap::from([
        (PLAN.to_string(), raw_plan.to_vec()),
        (PLAN_STATE.to_string(), PlanState::Pending.as_str().as_bytes().to_vec()),
    ])
}

/// `nodeplan plan push` into an existing Secret (a JSON merge patch): the plan, as `pending`; the
/// previous plan's probe statuses deleted (as Rancher does) and its cancel removed (a new plan
/// starts afresh). Of the agent's keys only `probe-statuses` is touched.
pub fn push_patch(raw_plan: &[u8]) -> serde_json::Value {
    serde_json::json!({
        "metadata": {"annotations": {plan::ANNOTATION_CANCELED: null}},
        "data": {PLAN: b64(raw_plan), PLAN_STATE: b64(PlanState::Pending.as_str().as_bytes()), PROBE_STATUSES: null}
    })
}

/// `nodeplan plan reset`: the plan runs again from its first instruction (`pending`), and a cancel
/// is removed (R8: only this ends a cancel).
pub fn reset_patch() -> serde_json::Value {
    serde_json::json!({
        "metadata": {"annotations": {plan::ANNOTATION_CANCELED: null, plan::ANNOTATION_PAUSED: null}},
        "data": {PLAN_STATE: b64(PlanState::Pending.as_str().as_bytes())}
    })
}

/// `nodeplan plan pause|resume|cancel`: set an annotation (`Some`) or remove it (`None`).
pub fn annotation_patch(key: &str, value: Option<&str>) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {key: value}}})
}

/// Drop the keys whose value already is what we would write.
pub fn changed_only(s: &SecretSnapshot, mut k: Keys) -> Keys {
    k.retain(|key, v| match v {
        Some(v) => s.data.get(key) != Some(v),
        None => s.data.contains_key(key),
    });
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn secret(pairs: &[(&str, &str)]) -> SecretSnapshot {
        SecretSnapshot {
            uid: "u".into(),
            resource_version: "1".into(),
            data: pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
            ..SecretSnapshot::default()
        }
    }

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap()
    }

    fn s(k: &Keys, key: &str) -> Option<String> {
        k.get(key).cloned().flatten().map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    #[test]
    fn the_failure_follows_failed_checksum() {
        let f = crate::plan::Failure::instruction("abc", 1, 2, "boom", "exit status 3".into(), b"no\n", &[]);
        let json = serde_json::to_string(&f).unwrap();
        let with = |pairs: &[(&str, &str)], failure| {
            let mut k: Keys = pairs.iter().map(|(k, v)| (k.to_string(), Some(v.as_bytes().to_vec()))).collect();
            failure_key(&mut k, failure);
            s(&k, FAILED_INSTRUCTION)
        };
        assert_eq!(with(&[(FAILED_CHECKSUM, "abc")], Some(&f)), Some(json.clone()), "a failure is written");
        assert_eq!(with(&[(FAILED_CHECKSUM, "")], Some(&f)), Some(String::new()), "a success clears it");
        assert_eq!(with(&[(FAILED_CHECKSUM, "abc")], None), Some(String::new()), "no stale detail");
        assert_eq!(with(&[(PLAN_STATE, "paused")], Some(&f)), None, "other writes leave it alone");
        // Read back only for the plan it is of.
        let sec = secret(&[(FAILED_INSTRUCTION, &json)]);
        assert_eq!(failure(&sec, "abc"), Some(f));
        assert_eq!(failure(&sec, "other"), None);
        assert_eq!(failure(&secret(&[(FAILED_INSTRUCTION, "{bad")]), "abc"), None);
    }

    #[test]
    fn counters_and_attempts() {
        assert_eq!(attempt(&secret(&[])), 1);
        assert_eq!(attempt(&secret(&[(FAILURE_COUNT, "")])), 1);
        assert_eq!(attempt(&secret(&[(FAILURE_COUNT, "2")])), 3);
        assert_eq!(max_failures(&secret(&[(MAX_FAILURES, "x")])), -1);
        assert_eq!(max_failures(&secret(&[(MAX_FAILURES, "3")])), 3);
        assert_eq!(s(&begin_keys(&secret(&[]), None), PLAN_REVISION).as_deref(), Some("1"));
        assert_eq!(s(&begin_keys(&secret(&[(PLAN_REVISION, "7")]), None), PLAN_REVISION).as_deref(), Some("8"));
        assert_eq!(s(&begin_keys(&secret(&[(PLAN_REVISION, "junk")]), None), PLAN_REVISION).as_deref(), Some("1"));
    }

    #[test]
    fn both_spellings_of_cancel_are_read_alike_and_a_cancel_is_written_as_it_was_asked() {
        let with = |ann: &[(&str, &str)]| {
            let mut s = secret(&[]);
            s.annotations = ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            s
        };
        let (us, uk) = (plan::ANNOTATION_CANCELED, plan::ANNOTATION_CANCELLED);
        type Row<'a> = (Vec<(&'a str, &'a str)>, Result<plan::Hold, ()>);
        let rows: Vec<Row> = vec![
            (vec![], Ok(plan::Hold::None)),
            (vec![(us, "true")], Ok(plan::Hold::Cancel)),
            (vec![(uk, "true")], Ok(plan::Hold::Cancel)),
            (vec![(us, "false"), (uk, "true")], Ok(plan::Hold::Cancel)),
            (vec![(us, "true"), (uk, "yes")], Ok(plan::Hold::Cancel)),
            (vec![(uk, "false")], Ok(plan::Hold::None)),
            (vec![(uk, "TRUE")], Err(())),
            (vec![(us, "false"), (uk, "1")], Err(())),
        ];
        for (ann, want) in rows {
            let got = plan::resolve_annotations(&annotations(&with(&ann))).map_err(drop);
            assert_eq!(got, want, "{ann:?}");
        }
        // Rancher's May 2026 IsTerminal knows "cancelled" only; the newer one "canceled" only.
        let canceled = || Keys::from([(PLAN_STATE.to_string(), Some(b"canceled".to_vec()))]);
        let state = |k: &Keys| String::from_utf8(k[PLAN_STATE].clone().unwrap()).unwrap();
        assert_eq!(state(&spelled_for(&with(&[(uk, "true")]), canceled())), "cancelled");
        assert_eq!(state(&spelled_for(&with(&[(us, "true")]), canceled())), "canceled");
        assert_eq!(state(&spelled_for(&with(&[(us, "true"), (uk, "true")]), canceled())), "canceled");
        let done = Keys::from([(PLAN_STATE.to_string(), Some(b"succeeded".to_vec()))]);
        assert_eq!(state(&spelled_for(&with(&[(uk, "true")]), done)), "succeeded");
        // Read back, either spelling is the terminal state.
        assert_eq!(PlanState::parse("cancelled"), PlanState::Canceled);
        assert!(PlanState::parse("cancelled").is_terminal());
    }

    #[test]
    fn legacy_flow_table() {
        let t = |dt: i64| format_unix_date(now() + chrono::TimeDelta::seconds(dt));
        let last10 = t(-10);
        let last40 = t(-40);
        type Row<'a> = (&'a str, Vec<(&'a str, &'a str)>, bool, bool, bool);
        let rows: Vec<Row> = vec![
            ("new plan", vec![(APPLIED_CHECKSUM, "old")], true, false, true),
            ("already applied", vec![(APPLIED_CHECKSUM, "c")], true, false, false),
            ("first reconcile forces", vec![(APPLIED_CHECKSUM, "c")], false, false, true),
            (
                "failed, in cooldown",
                vec![(FAILURE_COUNT, "1"), (FAILED_CHECKSUM, "c"), (LAST_APPLY_TIME, &last10)],
                true,
                false,
                false,
            ),
            (
                "failed, cooldown over",
                vec![(FAILURE_COUNT, "1"), (FAILED_CHECKSUM, "c"), (LAST_APPLY_TIME, &last40)],
                true,
                false,
                true,
            ),
            (
                "max failures reached",
                vec![(FAILURE_COUNT, "3"), (FAILED_CHECKSUM, "c"), (MAX_FAILURES, "3"), (LAST_APPLY_TIME, &last40)],
                true,
                false,
                false,
            ),
            (
                "below max failures",
                vec![(FAILURE_COUNT, "2"), (FAILED_CHECKSUM, "c"), (MAX_FAILURES, "3"), (LAST_APPLY_TIME, &last40)],
                true,
                false,
                true,
            ),
            (
                "another plan failed: no cooldown",
                vec![(FAILURE_COUNT, "1"), (FAILED_CHECKSUM, "other"), (LAST_APPLY_TIME, &last10)],
                true,
                false,
                true,
            ),
            ("own write echoing back", vec![(APPLIED_CHECKSUM, "old")], true, true, false),
        ];
        for (what, data, ran_once, echo, want) in rows {
            let d = legacy_decide(&secret(&data), "c", ran_once, echo, now());
            assert_eq!(d.needs_apply, want, "{what}");
            // Only a plan that waits out its cooldown is due again by itself.
            let cooling = what == "failed, in cooldown";
            assert_eq!(d.retry_in.is_some(), cooling, "{what}: {:?}", d.retry_in);
        }
        // Due right after the 30 s from its last apply, when the check above lets it run.
        let failed = |last: &str| secret(&[(FAILURE_COUNT, "1"), (FAILED_CHECKSUM, "c"), (LAST_APPLY_TIME, last)]);
        let d = legacy_decide(&failed(&last10), "c", true, false, now());
        let due = d.retry_in.unwrap();
        assert!(due > std::time::Duration::from_secs(19) && due <= std::time::Duration::from_secs(21), "{due:?}");
        let at = now() + chrono::TimeDelta::from_std(due).unwrap();
        assert!(legacy_decide(&failed(&last10), "c", true, false, at).needs_apply, "due at {at}");
        // Exhausted: never due by itself.
        let spent =
            secret(&[(FAILURE_COUNT, "3"), (FAILED_CHECKSUM, "c"), (MAX_FAILURES, "3"), (LAST_APPLY_TIME, &last10)]);
        assert_eq!(legacy_decide(&spent, "c", true, false, now()).retry_in, None);
    }

    #[test]
    fn legacy_outcome_keys() {
        let base = secret(&[(SUCCESS_COUNT, "4"), (FAILURE_COUNT, "2")]);
        let out = BTreeMap::from([("a".to_string(), b"x".to_vec())]);
        let periodic = BTreeMap::new();
        let ok = legacy_keys(
            &base,
            "c",
            LegacyDecision { needs_apply: true, was_failed_plan: false, retry_in: None },
            true,
            &out,
            &periodic,
            now(),
        );
        assert_eq!(s(&ok, APPLIED_CHECKSUM).as_deref(), Some("c"));
        assert_eq!(s(&ok, SUCCESS_COUNT).as_deref(), Some("5"));
        assert_eq!(s(&ok, FAILURE_COUNT).as_deref(), Some("0"));
        assert_eq!(s(&ok, FAILED_CHECKSUM).as_deref(), Some(""));
        assert_eq!(plan::decode_one_time_output(ok[APPLIED_OUTPUT].as_ref().unwrap()).unwrap(), out);
        let bad = legacy_keys(
            &base,
            "c",
            LegacyDecision { needs_apply: true, was_failed_plan: false, retry_in: None },
            false,
            &out,
            &periodic,
            now(),
        );
        assert_eq!(s(&bad, FAILURE_COUNT).as_deref(), Some("3"));
        assert_eq!(s(&bad, SUCCESS_COUNT).as_deref(), Some("0"));
        assert_eq!(s(&bad, FAILED_CHECKSUM).as_deref(), Some("c"));
        assert!(!bad.contains_key(APPLIED_CHECKSUM));
        assert_eq!(s(&bad, LAST_APPLY_TIME), Some(format_unix_date(now())));
        let held = legacy_keys(
            &base,
            "c",
            LegacyDecision { needs_apply: false, was_failed_plan: true, retry_in: None },
            false,
            &out,
            &periodic,
            now(),
        );
        assert_eq!(s(&held, FAILED_CHECKSUM).as_deref(), Some("c"));
        assert!(!held.contains_key(FAILURE_COUNT), "a held failed plan does not count again");
    }

    #[test]
    fn record_keys_clear_the_checkpoint_with_an_empty_value() {
        let r = Record {
            state: Some(PlanState::Succeeded),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(true),
            one_time_output: Some(BTreeMap::new()),
            ..Default::default()
        };
        let k = record_keys(&secret(&[]), "c", &r, now());
        assert_eq!(k.get(PLAN_CHECKPOINT), Some(&Some(Vec::new())));
        assert_eq!(s(&k, PLAN_STATE).as_deref(), Some("succeeded"));
        let paused = Record {
            state: Some(PlanState::Paused),
            checkpoint: CheckpointWrite::Set(Checkpoint {
                checksum: "c".into(),
                completed_instructions: 1,
                total_instructions: 3,
                resume_state: Some(PlanState::InProgress),
                paused: true,
                termination_incomplete: false,
            }),
            ..Default::default()
        };
        let k = record_keys(&secret(&[]), "c", &paused, now());
        assert!(
            !k.contains_key(APPLIED_CHECKSUM) && !k.contains_key(FAILURE_COUNT) && !k.contains_key(SUCCESS_COUNT),
            "R12: never the counters"
        );
        assert_eq!(
            s(&k, PLAN_CHECKPOINT).as_deref(),
            Some(
                r#"{"checksum":"c","completedInstructions":1,"totalInstructions":3,"resumeState":"in-progress","paused":true}"#
            )
        );
    }

    #[test]
    fn outputs_are_capped_to_keep_the_secret_small() {
        // Incompressible bytes, 4 × 200 KiB.
        let mut x: u64 = 88172645463325252;
        let mut noise = || {
            (0..200 * 1024)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x & 0xff) as u8
                })
                .collect::<Vec<u8>>()
        };
        let map: BTreeMap<String, Vec<u8>> = (0..4).map(|i| (format!("i{i}"), noise())).collect();
        let enc = encode_output_capped(&map);
        assert!(enc.len() <= OUTPUT_BUDGET, "{}", enc.len());
        let back = plan::decode_one_time_output(&enc).unwrap();
        assert_eq!(back.len(), 4, "every instruction keeps an entry");
        assert!(String::from_utf8_lossy(&back["i0"]).starts_with("[nodeplan: "));
        let small = BTreeMap::from([("a".to_string(), b"hello".to_vec())]);
        assert_eq!(plan::decode_one_time_output(&encode_output_capped(&small)).unwrap(), small);
    }

    #[test]
    fn changed_only_drops_unchanged_keys() {
        let base = secret(&[(PLAN_STATE, "succeeded"), (FAILURE_COUNT, "0")]);
        let mut k = Keys::new();
        set(&mut k, PLAN_STATE, "succeeded");
        set(&mut k, FAILURE_COUNT, "1");
        k.insert("gone".into(), None);
        let k = changed_only(&base, k);
        assert_eq!(k.keys().collect::<Vec<_>>(), ["failure-count"]);
    }

    #[test]
    fn orchestrator_patches() {
        let raw = br#"{"instructions":[]}"#;
        let rows: Vec<(&str, serde_json::Value, serde_json::Value)> = vec![
            (
                "push",
                push_patch(raw),
                serde_json::json!({
                    "metadata": {"annotations": {"plan.cattle.io/canceled": null}},
                    "data": {"plan": "eyJpbnN0cnVjdGlvbnMiOltdfQ==", "plan-state": "cGVuZGluZw==", "probe-statuses": null}
                }),
            ),
            (
                "reset",
                reset_patch(),
                serde_json::json!({
                    "metadata": {"annotations": {"plan.cattle.io/canceled": null, "plan.cattle.io/paused": null}},
                    "data": {"plan-state": "cGVuZGluZw=="}
                }),
            ),
            (
                "pause",
                annotation_patch(plan::ANNOTATION_PAUSED, Some("true")),
                serde_json::json!({"metadata": {"annotations": {"plan.cattle.io/paused": "true"}}}),
            ),
            (
                "resume",
                annotation_patch(plan::ANNOTATION_PAUSED, None),
                serde_json::json!({"metadata": {"annotations": {"plan.cattle.io/paused": null}}}),
            ),
            (
                "cancel",
                annotation_patch(plan::ANNOTATION_CANCELED, Some("true")),
                serde_json::json!({"metadata": {"annotations": {"plan.cattle.io/canceled": "true"}}}),
            ),
        ];
        for (what, got, want) in rows {
            assert_eq!(got, want, "{what}");
        }
        let created = push_data(raw);
        assert_eq!(created.keys().collect::<Vec<_>>(), ["plan", "plan-state"]);
        assert_eq!((created["plan"].as_slice(), created["plan-state"].as_slice()), (&raw[..], &b"pending"[..]));
    }
}
