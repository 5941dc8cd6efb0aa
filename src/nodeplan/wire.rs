//! A NodePlan as the plan-state flow sees it, and the status written back: pure functions (the
//! time is an argument), tested by tables. The source ([`super::source`]) reads and writes the
//! objects around them.
//!
//! A run is identified by the checksum of `spec.plan` (its canonical JSON), not by
//! `metadata.generation`: flipping `spec.paused` or `spec.canceled` changes the generation but
//! is the same run, and acts on it at once.

use super::resource::{Condition, InstructionResult, NodePlanSpec, NodePlanStatus, PreflightCheck};
use crate::apply::ApplyResult;
use crate::flow::{self, CheckpointWrite, Commit, Record};
use crate::plan::{self, Hold, PlanState, Preflight, PreflightResult, ProbeStatus};
use chrono::{DateTime, SecondsFormat, Utc};
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::time::Duration;

/// The most output one instruction keeps in the status, and all instructions together: the
/// status must stay far below the object size limit (1.5 MiB on etcd's default).
pub const OUTPUT_CAP: usize = 16 << 10;
pub const OUTPUT_TOTAL_CAP: usize = 128 << 10;

/// The plan JSON of a spec (its canonical form: keys sorted), from which the checksum and the
/// validated plan come.
pub fn plan_bytes(spec: &NodePlanSpec) -> Option<Vec<u8>> {
    spec.plan.as_ref().filter(|p| !p.is_null()).and_then(|p| serde_json::to_vec(p).ok())
}

/// What identifies a run: the checksum of the spec's plan (its canonical JSON), and of the run
/// token after it when there is one (a new token runs the same plan again).
pub fn plan_checksum(spec: &NodePlanSpec) -> Option<String> {
    let mut bytes = plan_bytes(spec)?;
    if !spec.run_token.is_empty() {
        bytes.push(b'\n');
        bytes.extend_from_slice(spec.run_token.as_bytes());
    }
    Some(plan::checksum(&bytes))
}

/// Retries of a failed run, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// Runs in all, the first included.
    pub max_attempts: i64,
    pub multiplier: f64,
    pub initial: Duration,
    pub max: Duration,
}

/// The most runs a `retryStrategy` may ask for (the first included).
pub const MAX_ATTEMPTS: i64 = 100;
/// The floor under every wait between runs: 1 s after the first failure, doubling after each
/// further one (up to `maxDelay`), whatever `initialDelay` and `backoffMultiplier` say, so a
/// strategy of `0s` and `1` cannot retry (and write the object) many times a second.
const FLOOR: Duration = Duration::from_secs(1);

impl Retry {
    /// The wait after the `failures`-th failure in a row (1 for the first).
    pub fn delay(&self, failures: i64) -> Duration {
        let exp = failures.clamp(1, 64) - 1;
        let asked = self.initial.as_secs_f64() * self.multiplier.powi(exp as i32);
        let floor = FLOOR.as_secs_f64() * 2f64.powi(exp as i32);
        let secs = asked.max(floor);
        let max = self.max.max(FLOOR);
        if !secs.is_finite() || secs >= max.as_secs_f64() {
            return max;
        }
        Duration::from_secs_f64(secs)
    }
}

/// What shapes a run besides its plan: retries, preflight checks and the timeout.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policy {
    pub retry: Option<Retry>,
    pub preflight: Vec<Preflight>,
    pub timeout: Option<Duration>,
}

fn duration_field(s: &str, field: &str, default: Duration) -> Result<Duration, String> {
    if s.is_empty() {
        return Ok(default);
    }
    crate::duration::parse(s).map_err(|e| format!("{field}: {e}"))
}

/// The spec's retries, preflight checks and timeout, checked (one error line naming the field).
pub fn policy(spec: &NodePlanSpec) -> Result<Policy, String> {
    let retry = match &spec.retry_strategy {
        None => None,
        Some(r) => {
            let max_attempts = if r.max_attempts == 0 { 3 } else { r.max_attempts };
            if max_attempts < 1 {
                return Err(format!("spec.retryStrategy.maxAttempts: {max_attempts} is less than 1"));
            }
            if max_attempts > MAX_ATTEMPTS {
                return Err(format!("spec.retryStrategy.maxAttempts: {max_attempts} is more than {MAX_ATTEMPTS}"));
            }
            let multiplier = r.backoff_multiplier.unwrap_or(2.0);
            if !multiplier.is_finite() || multiplier < 1.0 {
                return Err(format!("spec.retryStrategy.backoffMultiplier: {multiplier} is less than 1"));
            }
            let initial = duration_field(&r.initial_delay, "spec.retryStrategy.initialDelay", Duration::from_secs(10))?;
            let max = duration_field(&r.max_delay, "spec.retryStrategy.maxDelay", Duration::from_secs(600))?;
            Some(Retry { max_attempts, multiplier, initial, max: max.max(initial) })
        }
    };
    let timeout = match spec.execution.as_ref().map(|e| e.timeout.as_str()).filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => match crate::duration::parse(t) {
            Ok(d) if d.is_zero() => return Err("spec.execution.timeout: must be more than 0".into()),
            Ok(d) => Some(d),
            Err(e) => return Err(format!("spec.execution.timeout: {e}")),
        },
    };
    let checks = spec.preflight_checks.as_deref().unwrap_or_default();
    Ok(Policy { retry, preflight: preflight(checks)?, timeout })
}

/// Preflight checks, each probe validated as a plan's probes are.
fn preflight(checks: &[PreflightCheck]) -> Result<Vec<Preflight>, String> {
    let mut out: Vec<Preflight> = Vec::new();
    for (i, c) in checks.iter().enumerate() {
        let at = format!("spec.preflightChecks[{i}]");
        if c.name.is_empty() {
            return Err(format!("{at}.name: is empty"));
        }
        if out.iter().any(|p| p.name == c.name) {
            return Err(format!("{at}.name: {:?} is used twice", c.name));
        }
        // The probe is checked by the plan parser, as a plan's only probe.
        let as_plan = serde_json::json!({"probes": {c.name.clone(): c.probe.clone()}});
        let bytes = serde_json::to_vec(&as_plan).map_err(|e| format!("{at}.probe: {e}"))?;
        let mut parsed = plan::parse(&bytes).map_err(|e| format!("{at}.probe: {e}"))?;
        let probe = parsed.plan.probes.remove(&c.name).ok_or_else(|| format!("{at}.probe: missing"))?;
        out.push(Preflight { name: c.name.clone(), probe, required: c.required });
    }
    Ok(out)
}

/// Whether `node`'s agent runs this NodePlan: its watch selects the label
/// [`node_label_value`](super::resource::node_label_value)`(node)`, a hashed label must name the
/// node in `spec.nodeName`, and a `spec.nodeName` that names another node wins over the label (the
/// object says two things; it runs on neither guess).
pub fn is_for_node(o: &kube::api::DynamicObject, node: &str) -> bool {
    let label = o.metadata.labels.as_ref().and_then(|l| l.get(super::resource::NODE_LABEL));
    let Some(label) = label else { return false };
    let spec_name = o.data.pointer("/spec/nodeName").and_then(serde_json::Value::as_str).filter(|n| !n.is_empty());
    if spec_name.is_some_and(|n| n != node) {
        return false;
    }
    *label == super::resource::node_label_value(node) && (label == node || spec_name == Some(node))
}

/// What a NodePlan is ordered by ([`order`]): its priority, creation time and name.
pub fn order_key(o: &kube::api::DynamicObject) -> (i32, String, String) {
    let priority = o.data.pointer("/spec/priority").and_then(serde_json::Value::as_i64).unwrap_or(0);
    let created = o.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default();
    (priority.clamp(i32::MIN.into(), i32::MAX.into()) as i32, created, o.metadata.name.clone().unwrap_or_default())
}

/// The order in which a node's waiting plans run: higher priority first, then the older, then
/// by name.
pub fn order(a: (i32, &str, &str), b: (i32, &str, &str)) -> Ordering {
    b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)).then_with(|| a.2.cmp(b.2))
}

/// The phase people see for a plan state.
pub fn phase(state: &PlanState) -> &'static str {
    match state {
        PlanState::Pending => "Pending",
        PlanState::InProgress => "Executing",
        PlanState::Paused => "Paused",
        PlanState::Succeeded => "Applied",
        PlanState::Failed => "Failed",
        PlanState::Canceled => "Cancelled",
        PlanState::Other(_) => "Unknown",
    }
}

/// The flow's view of a NodePlan whose run is `checksum` (`total` one-time instructions), and
/// when a failed run is retried if that is later than `now`.
///
/// Two NodePlan rules on top of the shared flow: a canceled run whose `spec.canceled` is cleared
/// runs again from its first instruction (the producer's way back, as for a changed plan), and a
/// failed run is retried by the spec's retry strategy until it has had `maxAttempts` runs (it is
/// seen as `pending` once its wait is over).
pub fn snapshot(
    spec: &NodePlanSpec,
    status: &NodePlanStatus,
    checksum: &str,
    total: usize,
    policy: &Policy,
    now: DateTime<Utc>,
) -> (flow::Snapshot, Option<Duration>) {
    let ours = status.plan_checksum == checksum;
    let mut state = match &status.state {
        Some(s) if ours => s.clone(),
        _ => PlanState::Pending,
    };
    let mut retry_in = None;
    let mut fresh = false;
    if state == PlanState::Canceled && !spec.canceled {
        state = PlanState::Pending;
        fresh = true;
    }
    if state == PlanState::Failed && !spec.canceled && !spec.paused {
        match retry_due(status, policy, now) {
            Some(Ok(())) => {
                state = PlanState::Pending;
                fresh = true;
            }
            Some(Err(wait)) => retry_in = Some(wait),
            None => {}
        }
    }
    let hold = if spec.canceled {
        Hold::Cancel
    } else if spec.paused {
        Hold::Pause
    } else {
        Hold::None
    };
    let checkpoint = status.checkpoint.clone().filter(|c| ours && !fresh && c.checksum == checksum);
    (flow::Snapshot { checksum: checksum.to_string(), state, hold: Ok(hold), checkpoint, total }, retry_in)
}

/// For a failed run: `None` when it is not retried (no strategy, or its attempts are used up),
/// `Some(Ok)` when its retry is due, `Some(Err(wait))` while it waits.
pub fn retry_due(status: &NodePlanStatus, policy: &Policy, now: DateTime<Utc>) -> Option<Result<(), Duration>> {
    let retry = policy.retry.as_ref()?;
    if status.failures >= retry.max_attempts {
        return None;
    }
    let due = next_retry(status, retry)?;
    match (due - now).to_std() {
        Ok(wait) if !wait.is_zero() => Some(Err(wait)),
        _ => Some(Ok(())),
    }
}

/// When a failed run is retried (`None`: no time recorded; it is retried at once).
fn next_retry(status: &NodePlanStatus, retry: &Retry) -> Option<DateTime<Utc>> {
    let last = DateTime::parse_from_rfc3339(&status.last_apply_time).ok()?.with_timezone(&Utc);
    Some(last + chrono::Duration::from_std(retry.delay(status.failures)).unwrap_or_default())
}

/// Whether a run that started at `status.executionState.started` has run past the timeout.
pub fn timed_out(status: &NodePlanStatus, policy: &Policy, now: DateTime<Utc>) -> bool {
    let (Some(timeout), Some(PlanState::InProgress)) = (policy.timeout, &status.state) else { return false };
    let Ok(started) = DateTime::parse_from_rfc3339(&status.execution_state.started) else { return false };
    now - started.with_timezone(&Utc) >= chrono::Duration::from_std(timeout).unwrap_or(chrono::Duration::MAX)
}

/// How long a run that goes on (or begins) now may still run before its timeout stops it: the
/// whole timeout for a run that begins, what is left of it for one in progress since
/// `status.executionState.started` (nothing left: zero).
pub fn time_left(status: &NodePlanStatus, policy: &Policy, now: DateTime<Utc>) -> Option<Duration> {
    let timeout = policy.timeout?;
    let started = match &status.state {
        Some(PlanState::InProgress) => DateTime::parse_from_rfc3339(&status.execution_state.started).ok(),
        _ => None,
    };
    let Some(started) = started else { return Some(timeout) };
    let elapsed = (now - started.with_timezone(&Utc)).to_std().unwrap_or_default();
    Some(timeout.saturating_sub(elapsed))
}

/// A run stopped because it ran past its timeout is a failed run (it counts against the retry
/// strategy's attempts), with reason `Timeout`.
pub fn as_timeout(rec: &Record) -> Record {
    match rec.state {
        Some(PlanState::Canceled) => Record {
            state: Some(PlanState::Failed),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(false),
            ..rec.clone()
        },
        _ => rec.clone(),
    }
}

/// The status after [`record`] of a run that timed out.
pub fn mark_timeout(s: &mut NodePlanStatus, timeout: Duration, generation: i64, now: DateTime<Utc>) {
    let msg = format!("the run exceeded its timeout of {}; its processes were stopped", crate::duration::show(timeout));
    set_condition(&mut s.conditions, "Applied", "False", "Timeout", &msg, generation, now);
}

/// The status after a failed run: when it is retried, or that it is not.
pub fn mark_retry(s: &mut NodePlanStatus, policy: &Policy) {
    s.execution_state.next_retry = match &policy.retry {
        Some(r) if s.state == Some(PlanState::Failed) && s.failures < r.max_attempts => {
            next_retry(s, r).map(precise).unwrap_or_default()
        }
        _ => String::new(),
    };
}

/// Failed checks as a condition's message shows them.
fn describe(list: &[(String, String)]) -> String {
    list.iter().map(|(n, why)| format!("{n} ({why})")).collect::<Vec<_>>().join(", ")
}

/// The `Preflight` condition for a result.
pub fn set_preflight(s: &mut NodePlanStatus, r: &PreflightResult, generation: i64, now: DateTime<Utc>) {
    let (status, reason, msg) = if !r.passed() {
        ("False", "CheckFailed", format!("required checks failed: {}", describe(&r.required_failed)))
    } else if !r.optional_failed.is_empty() {
        ("True", "OptionalCheckFailed", format!("optional checks failed: {}", describe(&r.optional_failed)))
    } else {
        ("True", "Passed", "all checks passed".to_string())
    };
    set_condition(&mut s.conditions, "Preflight", status, reason, &msg, generation, now);
}

/// The status of a plan that does not start yet (the caller adds the condition that says why).
/// A run that would begin shows `Pending`; one that would go on (a resume, a recovery) keeps its
/// state and checkpoint, so waiting never loses its place.
pub fn waiting(prev: &NodePlanStatus, t: Target<'_>, begins: bool, now: DateTime<Utc>) -> NodePlanStatus {
    let same_run = prev.plan_checksum == t.checksum && prev.state.is_some();
    let mut s = if same_run && (!begins || prev.state == Some(PlanState::Pending)) {
        prev.clone()
    } else {
        with_state(prev, t, PlanState::Pending, now)
    };
    s.observed_generation = t.generation;
    s
}

/// The `Waiting` condition and lock holder of a plan waiting for the node's plan lock (`None`:
/// it no longer waits).
pub fn set_lock_holder(s: &mut NodePlanStatus, holder: Option<&str>, generation: i64, now: DateTime<Utc>) {
    match holder {
        Some(h) => {
            s.execution_state.lock_holder = h.to_string();
            let msg = format!("waiting for the node's plan lock, held by {h}");
            set_condition(&mut s.conditions, "Waiting", "True", "LockHeld", &msg, generation, now);
        }
        None => {
            s.execution_state.lock_holder.clear();
            s.conditions.retain(|c| c.type_ != "Waiting");
        }
    }
}

/// `CATTLE_AGENT_ATTEMPT_NUMBER` of the next run of this plan.
pub fn attempt(status: &NodePlanStatus, checksum: &str) -> i64 {
    if status.plan_checksum == checksum { status.failures + 1 } else { 1 }
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// With milliseconds: the times retries and the timeout count from.
fn precise(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Which object and plan a status is written for.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `metadata.generation` of the spec acted on.
    pub generation: i64,
    /// The checksum of `spec.plan`.
    pub checksum: &'a str,
    /// One-time instructions in the plan.
    pub total: usize,
}

/// The status with a new state: phase, progress and the `Applied` condition follow it; a new
/// run starts its counters and its probes' history over (as a push clears a plan Secret's
/// `probe-statuses`), so a probe's health is never carried from an earlier run into this one.
fn with_state(prev: &NodePlanStatus, t: Target<'_>, state: PlanState, now: DateTime<Utc>) -> NodePlanStatus {
    let Target { generation, checksum, total } = t;
    let mut s = prev.clone();
    if s.plan_checksum != checksum {
        s = NodePlanStatus { plan_checksum: checksum.to_string(), ..NodePlanStatus::default() };
    }
    s.observed_generation = generation;
    s.phase = phase(&state).to_string();
    let completed = s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions);
    s.progress = match state {
        PlanState::Succeeded => format!("{total}/{total}"),
        _ => format!("{completed}/{total}"),
    };
    let (status, reason) = applied_of(&state);
    set_condition(&mut s.conditions, "Applied", status, reason, &format!("plan {}", state), generation, now);
    s.state = Some(state);
    s
}

/// Set a condition, keeping its transition time when its status does not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    generation: i64,
    now: DateTime<Utc>,
) {
    let c = Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: time(now),
        observed_generation: generation,
    };
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(old) => {
            let since = if old.status == c.status { old.last_transition_time.clone() } else { c.last_transition_time };
            *old = Condition { last_transition_time: since, ..c };
        }
        None => conditions.push(c),
    }
}

/// A transition written before (or instead of) a run.
pub fn commit(prev: &NodePlanStatus, t: Target<'_>, c: &Commit, now: DateTime<Utc>) -> NodePlanStatus {
    let total = t.total;
    let mut s = with_state(prev, t, c.state(), now);
    match c {
        Commit::Begin { resume: None } => {
            s.checkpoint = None;
            s.instructions.clear();
        }
        _ => s.checkpoint = c.checkpoint().cloned(),
    }
    if matches!(c, Commit::Begin { .. } | Commit::Resume(_)) {
        s.execution_state.started = precise(now);
        s.execution_state.next_retry.clear();
        set_lock_holder(&mut s, None, t.generation, now);
    }
    if matches!(c, Commit::Begin { .. }) {
        s.attempts = s.failures + 1;
        s.progress = format!("{}/{total}", s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions));
    }
    s
}

/// Plain text of an instruction's saved output, its tail kept within `cap` bytes.
fn plain(out: &[u8], cap: usize) -> String {
    let tail = &out[out.len().saturating_sub(cap)..];
    String::from_utf8_lossy(tail).into_owned()
}

/// Per-instruction results of a run, merged into the previous ones (a resume keeps the results of
/// the instructions it does not run again); outputs capped per instruction and in total.
fn results(prev: &[InstructionResult], result: &ApplyResult, now: DateTime<Utc>) -> Vec<InstructionResult> {
    let mut out: Vec<InstructionResult> = prev.to_vec();
    for r in result.reports.iter().filter(|r| !r.periodic) {
        let end = now;
        let start = end - chrono::Duration::from_std(r.elapsed).unwrap_or_default();
        // Masked whole (the instruction's env values), then its tail kept.
        let masked = |o: &Vec<u8>| r.mask.text(&String::from_utf8_lossy(o));
        let saved =
            result.one_time_output.get(&r.name).map(|o| plain(masked(o).as_bytes(), OUTPUT_CAP)).unwrap_or_default();
        let item = InstructionResult {
            name: r.name.clone(),
            outcome: crate::apply::result_word(&r.outcome).to_string(),
            exit_code: Some(i64::from(r.outcome.exit_code())).filter(|c| *c >= 0),
            start_time: time(start),
            end_time: time(end),
            output: saved,
        };
        match out.get_mut(r.index) {
            Some(slot) => *slot = item,
            None => {
                while out.len() < r.index {
                    out.push(InstructionResult::default());
                }
                out.push(item);
            }
        }
    }
    // The total cap: the oldest outputs go first.
    let mut total: usize = out.iter().map(|r| r.output.len()).sum();
    for r in out.iter_mut() {
        if total <= OUTPUT_TOTAL_CAP {
            break;
        }
        total -= r.output.len();
        r.output = String::from("(output dropped: the status keeps at most 128 KiB of outputs)");
        total += r.output.len();
    }
    out
}

/// The most a whole NodePlan (spec, status and metadata) may weigh when the agent writes its
/// status: etcd's default request limit (1.5 MiB; it refuses a write of about 2 MiB with its
/// gRPC overhead), and a status that cannot be written is an outcome never recorded (the run
/// would start again at every agent restart).
pub const OBJECT_BUDGET: usize = 1_536 << 10;

/// What a status result's name is cut to when the status must shrink.
const SHORT_NAME: usize = 64;

/// The status, made to fit in `budget` bytes of JSON: what it must say (phase, state, checkpoint,
/// counts, conditions) is never dropped; first the instructions' and periodic instructions' saved
/// outputs go (each marked), then long names are cut (with a marker) and the finished
/// instructions lose their times, then the per-instruction results go altogether. Returns the
/// status and whether anything was dropped.
pub fn fit(mut s: NodePlanStatus, budget: usize) -> (NodePlanStatus, bool) {
    let size = |s: &NodePlanStatus| serde_json::to_vec(s).map_or(usize::MAX, |v| v.len());
    if size(&s) <= budget {
        return (s, false);
    }
    for r in s.instructions.iter_mut().filter(|r| !r.output.is_empty()) {
        r.output = String::from("(output dropped: the NodePlan is near its size limit)");
    }
    for p in s.periodic_outputs.values_mut() {
        p.stdout.clear();
        p.stderr.clear();
    }
    if let Some(f) = s.failure.as_mut() {
        f.last_lines.clear();
    }
    if size(&s) <= budget {
        return (s, true);
    }
    for r in s.instructions.iter_mut() {
        if let Some((cut, _)) = r.name.char_indices().nth(SHORT_NAME) {
            r.name = format!("{}…", &r.name[..cut]);
        }
        r.output.clear();
        if r.outcome == "succeeded" {
            r.start_time.clear();
            r.end_time.clear();
        }
    }
    if size(&s) <= budget {
        return (s, true);
    }
    s.instructions.clear();
    (s, true)
}

/// A finished run's record.
pub fn record(
    prev: &NodePlanStatus,
    t: Target<'_>,
    rec: &Record,
    result: &ApplyResult,
    probes: Option<&BTreeMap<String, ProbeStatus>>,
    now: DateTime<Utc>,
) -> NodePlanStatus {
    let total = t.total;
    let mut s = match &rec.state {
        Some(state) => with_state(prev, t, state.clone(), now),
        None => NodePlanStatus { observed_generation: t.generation, ..prev.clone() },
    };
    match &rec.checkpoint {
        CheckpointWrite::Keep => {}
        CheckpointWrite::Clear => s.checkpoint = None,
        CheckpointWrite::Set(c) => {
            s.progress = format!("{}/{total}", c.completed_instructions);
            s.checkpoint = Some(c.clone());
        }
    }
    // A failed run keeps no checkpoint (it starts over), but what it did adds up with its
    // results: the instructions before the one that failed.
    if rec.state == Some(PlanState::Failed) {
        s.progress = format!("{}/{total}", result.completed.min(total));
    }
    if rec.state.is_some() {
        s.instructions = results(&s.instructions, result, now);
    }
    match rec.succeeded {
        Some(true) => {
            s.successes += 1;
            s.failures = 0;
            s.last_apply_time = precise(now);
        }
        Some(false) => {
            s.failures += 1;
            s.successes = 0;
            s.last_apply_time = precise(now);
        }
        None => {}
    }
    if let Some(p) = probes {
        s.probe_statuses = p.clone();
    }
    if let Some(p) = &rec.periodic_output {
        s.periodic_outputs = p.clone();
    }
    s
}

/// What made a run fail, beside its state: a failed run's [`Failure`](crate::plan::Failure) in
/// `status.failure` and in the `Applied` condition's message; a success clears it; any other
/// record (a pause, a cancel, a retry's start) keeps the last one.
pub fn set_failure(
    s: &mut NodePlanStatus,
    failure: Option<&crate::plan::Failure>,
    generation: i64,
    now: DateTime<Utc>,
) {
    match s.state {
        Some(PlanState::Succeeded) => s.failure = None,
        Some(PlanState::Failed) => {
            s.failure = failure.cloned();
            if let Some(f) = failure {
                let msg = format!("plan failed: {}", f.note());
                set_condition(&mut s.conditions, "Applied", "False", "Failed", &msg, generation, now);
            }
        }
        _ => {}
    }
}

/// A spec the agent refuses to run: `Failed` with the reason, never run as an empty plan.
pub fn refused(
    prev: &NodePlanStatus,
    generation: i64,
    reason: &str,
    message: &str,
    now: DateTime<Utc>,
) -> NodePlanStatus {
    let mut s = NodePlanStatus { observed_generation: generation, ..prev.clone() };
    s.phase = "Failed".into();
    set_condition(&mut s.conditions, "Applied", "False", reason, message, generation, now);
    s
}

/// The `Applied` condition reasons of [`refused`] (the spec, not its run, was refused).
pub const REFUSALS: [&str; 4] = ["Unsupported", "NoPlan", "InvalidSpec", "InvalidPlan"];

/// A status that still shows a refusal ([`refused`]) of an earlier generation, once the spec of
/// `generation` is taken again: phase and `Applied` condition put back to what its run's state
/// says (`Pending` for a plan that never ran). `None` when it shows no refusal to undo.
pub fn unrefused(prev: &NodePlanStatus, generation: i64, now: DateTime<Utc>) -> Option<NodePlanStatus> {
    let applied = prev.conditions.iter().find(|c| c.type_ == "Applied")?;
    if prev.phase != "Failed" || !REFUSALS.contains(&applied.reason.as_str()) || prev.observed_generation >= generation
    {
        return None;
    }
    let state = prev.state.clone().unwrap_or(PlanState::Pending);
    let mut s = NodePlanStatus { observed_generation: generation, ..prev.clone() };
    s.phase = phase(&state).to_string();
    let (status, reason, message) = match &prev.failure {
        Some(f) if state == PlanState::Failed => ("False", "Failed", format!("plan failed: {}", f.note())),
        _ => {
            let (status, reason) = applied_of(&state);
            (status, reason, format!("plan {state}"))
        }
    };
    set_condition(&mut s.conditions, "Applied", status, reason, &message, generation, now);
    Some(s)
}

/// The `Applied` condition's status and reason for a state.
fn applied_of(state: &PlanState) -> (&'static str, &'static str) {
    match state {
        PlanState::Succeeded => ("True", "Applied"),
        PlanState::Pending => ("False", "Pending"),
        PlanState::InProgress => ("False", "Executing"),
        PlanState::Paused => ("False", "Paused"),
        PlanState::Failed => ("False", "Failed"),
        PlanState::Canceled => ("False", "Cancelled"),
        PlanState::Other(_) => ("Unknown", "Unknown"),
    }
}

/// The plan JSON of a spec, validated as any plan is, and the run's identity ([`plan_checksum`]).
pub fn valid_plan(spec: &NodePlanSpec) -> Result<(plan::ValidPlan, String), String> {
    let raw = plan_bytes(spec).ok_or("spec.plan is missing")?;
    let run = plan_checksum(spec).ok_or("spec.plan is missing")?;
    plan::parse(&raw).map(|vp| (vp, run)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Checkpoint, Interruption};
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().with_timezone(&Utc)
    }

    /// A refusal of generation 2 (an unknown field) over a run that had succeeded, undone when
    /// generation 3 is taken again; never for a real failure, nor for the refused generation.
    #[test]
    fn a_refusal_is_undone_when_a_later_spec_is_taken() {
        let t = Target { generation: 1, checksum: "c", total: 2 };
        let done = with_state(&NodePlanStatus::default(), t, PlanState::Succeeded, now());
        let held = refused(&done, 2, "Unsupported", "unknown field spec.foo", now());
        assert_eq!(held.phase, "Failed");
        assert_eq!(unrefused(&held, 2, now()), None, "the refused generation stays refused");
        let back = unrefused(&held, 3, now()).expect("undone");
        assert_eq!((back.phase.as_str(), back.observed_generation), ("Applied", 3));
        let applied = back.conditions.iter().find(|c| c.type_ == "Applied").unwrap();
        assert_eq!((applied.status.as_str(), applied.reason.as_str()), ("True", "Applied"));
        assert_eq!(unrefused(&back, 4, now()), None, "nothing left to undo");
        let never_ran = refused(&NodePlanStatus::default(), 1, "InvalidPlan", "bad", now());
        assert_eq!(unrefused(&never_ran, 2, now()).map(|s| s.phase), Some("Pending".into()));
        let failed = with_state(&done, Target { generation: 2, ..t }, PlanState::Failed, now());
        assert_eq!(unrefused(&failed, 3, now()), None, "a failed run is no refusal");
    }

    fn spec(paused: bool, canceled: bool) -> NodePlanSpec {
        NodePlanSpec {
            paused,
            canceled,
            plan: Some(json!({"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "true"}]})),
            ..NodePlanSpec::default()
        }
    }

    #[test]
    fn the_flow_sees_the_spec_switches_and_the_status_of_this_plan_only() {
        let (vp, c) = valid_plan(&spec(false, false)).unwrap();
        assert_eq!(vp.plan.instructions.len(), 2);
        let mine = NodePlanStatus { plan_checksum: c.clone(), state: Some(PlanState::Paused), ..Default::default() };
        let other = NodePlanStatus { plan_checksum: "old".into(), ..mine.clone() };
        let rows = [
            (spec(false, false), &mine, PlanState::Paused, Hold::None),
            (spec(true, false), &mine, PlanState::Paused, Hold::Pause),
            (spec(true, true), &mine, PlanState::Paused, Hold::Cancel),
            (spec(false, false), &other, PlanState::Pending, Hold::None),
        ];
        for (sp, st, state, hold) in rows {
            let (s, _) = snapshot(&sp, st, &c, 2, &Policy::default(), now());
            assert_eq!((s.state, s.hold), (state, Ok(hold)));
        }
        // Key order in the object does not change the checksum (canonical JSON).
        let reordered = NodePlanSpec {
            plan: Some(json!({"instructions": [{"command": "true", "name": "a"}, {"command": "true", "name": "b"}]})),
            ..NodePlanSpec::default()
        };
        assert_eq!(valid_plan(&reordered).unwrap().1, c);
    }

    fn retry(max_attempts: i64) -> Policy {
        let r = crate::nodeplan::resource::RetryStrategy {
            max_attempts,
            backoff_multiplier: Some(3.0),
            initial_delay: "10s".into(),
            max_delay: "1m".into(),
        };
        policy(&NodePlanSpec { retry_strategy: Some(r), ..spec(false, false) }).unwrap()
    }

    #[test]
    fn failed_runs_are_retried_by_the_strategy_and_canceled_ones_when_the_cancel_is_cleared() {
        let c = "c";
        let failed = |failures: i64, ago: i64| NodePlanStatus {
            plan_checksum: c.into(),
            state: Some(PlanState::Failed),
            failures,
            last_apply_time: time(now() - chrono::Duration::seconds(ago)),
            ..Default::default()
        };
        let secs = Duration::from_secs;
        type Row = (&'static str, NodePlanSpec, NodePlanStatus, Policy, PlanState, Option<Duration>);
        let rows: [Row; 9] = [
            ("no strategy: terminal", spec(false, false), failed(1, 999), Policy::default(), PlanState::Failed, None),
            ("first retry waits 10s", spec(false, false), failed(1, 4), retry(3), PlanState::Failed, Some(secs(6))),
            ("first retry due", spec(false, false), failed(1, 10), retry(3), PlanState::Pending, None),
            ("second waits 30s", spec(false, false), failed(2, 20), retry(3), PlanState::Failed, Some(secs(10))),
            ("attempts used up", spec(false, false), failed(3, 999), retry(3), PlanState::Failed, None),
            ("a held plan is not retried", spec(true, false), failed(1, 999), retry(3), PlanState::Failed, None),
            (
                "canceled, cancel still set",
                spec(false, true),
                NodePlanStatus { state: Some(PlanState::Canceled), ..failed(0, 0) },
                Policy::default(),
                PlanState::Canceled,
                None,
            ),
            (
                "canceled, cancel cleared: runs again",
                spec(false, false),
                NodePlanStatus { state: Some(PlanState::Canceled), ..failed(0, 0) },
                Policy::default(),
                PlanState::Pending,
                None,
            ),
            (
                "another run",
                spec(false, false),
                NodePlanStatus { plan_checksum: "old".into(), ..failed(3, 0) },
                retry(3),
                PlanState::Pending,
                None,
            ),
        ];
        for (what, sp, st, pol, state, wait) in rows {
            let (s, retry_in) = snapshot(&sp, &st, c, 2, &pol, now());
            assert_eq!((s.state, retry_in), (state, wait), "{what}");
        }
        // The waits grow by the multiplier up to the maximum.
        let r = retry(9).retry.unwrap();
        assert_eq!([1, 2, 3, 4].map(|f| r.delay(f)), [secs(10), secs(30), secs(60), secs(60)]);
        // The floor: 1 s doubling, under a strategy that asks for no wait at all, up to its max.
        let eager = crate::nodeplan::resource::RetryStrategy {
            max_attempts: 100,
            backoff_multiplier: Some(1.0),
            initial_delay: "0s".into(),
            max_delay: "5s".into(),
        };
        let r =
            policy(&NodePlanSpec { retry_strategy: Some(eager.clone()), ..spec(false, false) }).unwrap().retry.unwrap();
        assert_eq!([1, 2, 3, 4, 10].map(|f| r.delay(f)), [secs(1), secs(2), secs(4), secs(5), secs(5)]);
        let zero_max = crate::nodeplan::resource::RetryStrategy { max_delay: "0s".into(), ..eager.clone() };
        let r = policy(&NodePlanSpec { retry_strategy: Some(zero_max), ..spec(false, false) }).unwrap().retry.unwrap();
        assert_eq!(r.delay(1), secs(1), "never less than the floor");
        let too_many = crate::nodeplan::resource::RetryStrategy { max_attempts: 101, ..eager };
        let e = policy(&NodePlanSpec { retry_strategy: Some(too_many), ..spec(false, false) }).unwrap_err();
        assert_eq!(e, "spec.retryStrategy.maxAttempts: 101 is more than 100");
    }

    #[test]
    fn a_run_past_its_timeout_fails_with_reason_timeout() {
        let pol = policy(&NodePlanSpec {
            execution: Some(crate::nodeplan::resource::Execution { timeout: "1m".into() }),
            ..spec(false, false)
        })
        .unwrap();
        let mut st = NodePlanStatus { state: Some(PlanState::InProgress), ..Default::default() };
        st.execution_state.started = time(now() - chrono::Duration::seconds(59));
        assert!(!timed_out(&st, &pol, now()));
        assert!(timed_out(&st, &pol, now() + chrono::Duration::seconds(1)));
        assert!(!timed_out(&st, &Policy::default(), now() + chrono::Duration::hours(1)), "no timeout set");
        let done = NodePlanStatus { state: Some(PlanState::Succeeded), ..st.clone() };
        assert!(!timed_out(&done, &pol, now() + chrono::Duration::hours(1)), "only a run in progress");
        // What the loop waits before it asks the source whether the run timed out.
        let left = |st: &NodePlanStatus, pol: &Policy, at| time_left(st, pol, at);
        assert_eq!(left(&st, &pol, now()), Some(Duration::from_secs(1)), "what is left of a run in progress");
        assert_eq!(left(&st, &pol, now() + chrono::Duration::hours(1)), Some(Duration::ZERO), "nothing left");
        assert_eq!(left(&done, &pol, now()), Some(Duration::from_secs(60)), "a run that begins gets it all");
        assert_eq!(left(&st, &Policy::default(), now()), None, "no timeout set");
        let unreadable = NodePlanStatus { execution_state: Default::default(), ..st.clone() };
        assert_eq!(left(&unreadable, &pol, now()), Some(Duration::from_secs(60)));
        let canceled = Record { state: Some(PlanState::Canceled), ..Default::default() };
        let t = Target { generation: 1, checksum: "c", total: 2 };
        let rec = as_timeout(&canceled);
        let mut s = record(&st, t, &rec, &ApplyResult::default(), None, now());
        mark_timeout(&mut s, Duration::from_secs(60), 1, now());
        assert_eq!((s.phase.as_str(), s.failures, s.checkpoint.clone()), ("Failed", 1, None));
        assert_eq!(s.conditions[0].reason, "Timeout");
    }

    #[test]
    fn bad_policies_are_one_line_naming_the_field() {
        use crate::nodeplan::resource::{Execution, PreflightCheck, RetryStrategy};
        let with = |f: &dyn Fn(&mut NodePlanSpec)| {
            let mut s = spec(false, false);
            f(&mut s);
            policy(&s).unwrap_err()
        };
        let e = with(&|s| s.execution = Some(Execution { timeout: "soon".into() }));
        assert!(e.starts_with("spec.execution.timeout: "), "{e}");
        let e =
            with(&|s| s.retry_strategy = Some(RetryStrategy { backoff_multiplier: Some(0.5), ..Default::default() }));
        assert!(e.starts_with("spec.retryStrategy.backoffMultiplier"), "{e}");
        let check = |name: &str, probe: serde_json::Value| PreflightCheck { name: name.into(), probe, required: true };
        let e = with(&|s| s.preflight_checks = Some(vec![check("a", json!({"fileExists": {"path": "rel"}}))]));
        assert!(e.starts_with("spec.preflightChecks[0].probe: "), "{e}");
        let ok = json!({"fileExists": {"path": "/x"}});
        let e = with(&|s| s.preflight_checks = Some(vec![check("a", ok.clone()), check("a", ok.clone())]));
        assert!(e.contains("used twice"), "{e}");
    }

    /// A status that would not fit beside its spec is shrunk: outputs first, then names and the
    /// finished instructions' times, then the results; the state, checkpoint, counts and
    /// conditions always stay.
    #[test]
    fn a_status_is_made_to_fit_its_budget() {
        let result = |i: usize, outcome: &str| InstructionResult {
            name: format!("{}-{i}", "n".repeat(100)),
            outcome: outcome.into(),
            exit_code: Some(0),
            start_time: "2026-12-02T00:00:00Z".into(),
            end_time: "2026-12-02T00:00:01Z".into(),
            output: "x".repeat(100),
        };
        let mut full = NodePlanStatus {
            phase: "Failed".into(),
            state: Some(PlanState::Failed),
            progress: "2799/2800".into(),
            failures: 1,
            conditions: vec![Condition { type_: "Ready".into(), status: "False".into(), ..Default::default() }],
            ..Default::default()
        };
        full.instructions = (0..2800).map(|i| result(i, if i == 2799 { "failed" } else { "succeeded" })).collect();
        let size = |s: &NodePlanStatus| serde_json::to_vec(s).unwrap().len();
        let whole = size(&full);
        assert_eq!(fit(full.clone(), whole), (full.clone(), false), "it fits: untouched");

        let (no_outputs, cut) = fit(full.clone(), whole - 1);
        assert!(cut && size(&no_outputs) < whole);
        assert!(no_outputs.instructions.iter().all(|r| r.output.starts_with("(output dropped")));
        assert_eq!(no_outputs.instructions[0].name, full.instructions[0].name);

        let (short, _) = fit(full.clone(), size(&no_outputs) - 1);
        assert_eq!(short.instructions.len(), 2800);
        assert!(short.instructions[0].name.ends_with('…') && short.instructions[0].name.chars().count() == 65);
        assert!(short.instructions[0].start_time.is_empty(), "a finished instruction loses its times");
        assert_eq!(short.instructions[2799].end_time, "2026-12-02T00:00:01Z", "the failure keeps them");

        let (bare, _) = fit(full.clone(), 1000);
        assert!(bare.instructions.is_empty());
        assert_eq!(
            (bare.phase.as_str(), bare.state.clone(), bare.progress.as_str(), bare.failures, bare.conditions.len()),
            ("Failed", Some(PlanState::Failed), "2799/2800", 1, 1)
        );
    }

    #[test]
    fn a_run_token_makes_the_same_plan_a_new_run() {
        let a = spec(false, false);
        let b = NodePlanSpec { run_token: "2026-11-30T12:00:00Z".into(), ..a.clone() };
        assert_ne!(plan_checksum(&a), plan_checksum(&b));
        let (vp, run) = valid_plan(&a).unwrap();
        assert_eq!((Some(run.clone()), vp.checksum), (plan_checksum(&a), run), "no token: the plan's own checksum");
        assert_eq!(valid_plan(&b).unwrap().1, plan_checksum(&b).unwrap());
    }

    #[test]
    fn a_plan_waiting_to_go_on_keeps_its_state_and_checkpoint() {
        let t = Target { generation: 2, checksum: "c", total: 3 };
        let cp = Checkpoint {
            checksum: "c".into(),
            completed_instructions: 2,
            total_instructions: 3,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        };
        let paused = NodePlanStatus {
            plan_checksum: "c".into(),
            state: Some(PlanState::Paused),
            phase: "Paused".into(),
            checkpoint: Some(cp.clone()),
            ..Default::default()
        };
        let w = waiting(&paused, t, false, now());
        assert_eq!((w.state, w.phase.as_str(), w.checkpoint), (Some(PlanState::Paused), "Paused", Some(cp)));
        let failed = NodePlanStatus { state: Some(PlanState::Failed), checkpoint: None, ..paused.clone() };
        assert_eq!(waiting(&failed, t, true, now()).phase, "Pending", "a retry that would begin");
        let other = NodePlanStatus { plan_checksum: "old".into(), ..paused };
        let w = waiting(&other, t, false, now());
        assert_eq!((w.phase.as_str(), w.plan_checksum.as_str()), ("Pending", "c"), "a new run");
    }

    #[test]
    fn waiting_plans_run_by_priority_then_age_then_name() {
        let mut v = [
            (0, "2026-01-02T00:00:00Z", "b"),
            (5, "2026-01-03T00:00:00Z", "z"),
            (0, "2026-01-01T00:00:00Z", "c"),
            (0, "2026-01-02T00:00:00Z", "a"),
        ];
        v.sort_by(|x, y| order(*x, *y));
        let names: Vec<&str> = v.iter().map(|x| x.2).collect();
        assert_eq!(names, ["z", "c", "a", "b"]);
    }

    #[test]
    fn statuses_follow_the_flow() {
        let t = |generation| Target { generation, checksum: "c", total: 2 };
        let begun = commit(&NodePlanStatus::default(), t(3), &Commit::Begin { resume: None }, now());
        assert_eq!((begun.phase.as_str(), begun.progress.as_str(), begun.attempts), ("Executing", "0/2", 1));
        assert_eq!(begun.conditions[0].status, "False");
        let cp = Checkpoint {
            checksum: "c".into(),
            completed_instructions: 1,
            total_instructions: 2,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        };
        let result = ApplyResult { completed: 1, interruption: Some(Interruption::Paused), ..Default::default() };
        let paused = Record {
            state: Some(PlanState::Paused),
            checkpoint: CheckpointWrite::Set(cp.clone()),
            ..Default::default()
        };
        let p = record(&begun, t(4), &paused, &result, None, now());
        assert_eq!((p.phase.as_str(), p.progress.as_str(), p.checkpoint.clone()), ("Paused", "1/2", Some(cp)));
        assert_eq!(p.observed_generation, 4);
        let ok = Record {
            state: Some(PlanState::Succeeded),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(true),
            ..Default::default()
        };
        let later = now() + chrono::Duration::seconds(60);
        let done = record(&p, t(5), &ok, &ApplyResult::default(), None, later);
        assert_eq!((done.phase.as_str(), done.progress.as_str(), done.successes), ("Applied", "2/2", 1));
        assert_eq!((done.checkpoint.clone(), done.state.clone()), (None, Some(PlanState::Succeeded)));
        assert_eq!(done.conditions.len(), 1);
        assert_eq!(
            (done.conditions[0].status.as_str(), done.conditions[0].last_transition_time.as_str()),
            ("True", "2026-11-30T12:01:00Z")
        );
        // A run that fails at its second instruction: progress adds up with the results (1 of 2).
        let failed = Record {
            state: Some(PlanState::Failed),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(false),
            ..Default::default()
        };
        let f = record(&begun, t(4), &failed, &ApplyResult { completed: 1, ..Default::default() }, None, now());
        assert_eq!((f.phase.as_str(), f.progress.as_str(), f.checkpoint.clone()), ("Failed", "1/2", None));
        // A new run starts over, its probes' history too (an earlier run's health is not this one's).
        let mut probed = done.clone();
        probed.probe_statuses.insert("web".into(), crate::plan::ProbeStatus { healthy: true, ..Default::default() });
        let again = commit(
            &probed,
            Target { generation: 6, checksum: "new", total: 1 },
            &Commit::Begin { resume: None },
            later,
        );
        assert_eq!((again.successes, again.plan_checksum.as_str(), again.progress.as_str()), (0, "new", "0/1"));
        assert!(again.probe_statuses.is_empty(), "{:?}", again.probe_statuses);
        let same = commit(&probed, t(7), &Commit::Begin { resume: None }, later);
        assert_eq!(same.probe_statuses.len(), 1, "the same run keeps its probes' history");
    }

    /// docs/states.md maps each state to its phase: the same map as [`phase`], state by state.
    #[test]
    fn the_state_map_in_docs_is_the_agents() {
        let doc = include_str!("../../docs/states.md");
        let rows: Vec<(String, String)> = doc
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let state = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                let phase = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
                Some((state.to_string(), phase.to_string()))
            })
            .collect();
        let states = ["pending", "in-progress", "paused", "succeeded", "failed", "canceled"];
        assert_eq!(rows.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), states);
        for (state, doc_phase) in &rows {
            assert_eq!(phase(&PlanState::parse(state)), doc_phase, "{state}");
        }
    }

    #[test]
    fn a_failure_is_kept_beside_a_failed_state_until_a_success() {
        let t = Target { generation: 2, checksum: "c", total: 2 };
        let begun = commit(&NodePlanStatus::default(), t, &Commit::Begin { resume: None }, now());
        let fail = Record { state: Some(PlanState::Failed), succeeded: Some(false), ..Default::default() };
        let why = crate::plan::Failure::instruction("c", 1, 2, "boom", "exit status 3".into(), b"no disk\n", &[]);
        let mut failed = record(&begun, t, &fail, &ApplyResult::default(), None, now());
        set_failure(&mut failed, Some(&why), 2, now());
        assert_eq!(failed.failure.as_ref(), Some(&why));
        assert_eq!(
            failed.conditions[0].message,
            "plan failed: instruction 2/2 boom: exit status 3; last output: no disk"
        );
        // A retry's start keeps it (what failed last time); a success clears it.
        let mut retry = commit(&failed, t, &Commit::Begin { resume: None }, now());
        set_failure(&mut retry, None, 2, now());
        assert_eq!(retry.failure.as_ref(), Some(&why));
        let ok = Record { state: Some(PlanState::Succeeded), succeeded: Some(true), ..Default::default() };
        let mut done = record(&retry, t, &ok, &ApplyResult::default(), None, now());
        set_failure(&mut done, None, 2, now());
        assert_eq!(done.failure, None);
        // Near the size limit the output lines go first, the failure itself stays.
        let (fitted, dropped) = fit(failed.clone(), serde_json::to_vec(&failed).unwrap().len() - 1);
        assert!(dropped);
        assert_eq!(fitted.failure.map(|f| (f.summary(), f.last_lines.len())), Some((why.summary(), 0)));
    }

    #[test]
    fn outputs_are_plain_text_capped_per_instruction_and_per_object() {
        let big = vec![b'x'; OUTPUT_CAP * 2];
        assert_eq!(plain(&big, OUTPUT_CAP).len(), OUTPUT_CAP);
        let prev: Vec<InstructionResult> = (0..20)
            .map(|i| InstructionResult { name: format!("i{i}"), output: "y".repeat(OUTPUT_CAP), ..Default::default() })
            .collect();
        let out = results(&prev, &ApplyResult::default(), now());
        let total: usize = out.iter().map(|r| r.output.len()).sum();
        assert!(total <= OUTPUT_TOTAL_CAP, "{total}");
        assert_eq!(out[19].output.len(), OUTPUT_CAP, "the newest outputs are kept");
    }
}
