//! Prometheus metrics: this module owns the registry, every metric family, the facts the rest of
//! the agent reports to it (one-line hooks such as [`plan_recorded`] and [`stop_ladder`]), the
//! sizes of the agent's directories ([`disk`]) and the HTTP endpoint that serves them
//! ([`server`]). It decides nothing about plans or processes and never writes a file: callers
//! report what they already know, and a hook never blocks or fails.
//!
//! Metrics are opt-in (`metricsAddress` in the config, `--metrics-address` on `nodeplan agent`).
//! Until [`install`] is called every hook is one atomic load that finds nothing and returns, so a
//! node without metrics pays nothing measurable, and `nodeplan apply` never reports anything.
//!
//! A leaf: it imports nothing of the crate but `safefs` (to open a measured directory). Callers
//! hand it plain labels ([`PlanResult`], [`InstructionResult`], [`Ladder`], [`Recovery`], a
//! probe's name and health); each module that owns a fact maps it to its label.
//!
//! Labels are bounded: plans are named by their 12-character id (`plan::id`, the one every
//! command and log line shows; `nodeplan_plan_info` maps it to where the plan is kept),
//! probes by their name in the plan (a name over 64 characters by its first 55, `~` and 8 hex
//! digits of its SHA-256, so distinct names stay distinct series); every other label takes a
//! fixed set of values.
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `nodeplan_plans_total` | counter | `result`: `succeeded`, `failed`, `paused`, `canceled` | plan runs (or pauses and cancels recorded before a run) by the state recorded for them |
//! | `nodeplan_instruction_duration_seconds` | histogram | `kind`: `one_time`, `periodic`; `result`: `ok`, `failed`, `canceled`, `stopped` | how long each instruction took, image staging included |
//! | `nodeplan_stop_ladder_total` | counter | `outcome`: `exited_on_term`, `killed`, `survivors`, `error` | stop-ladder runs (cancel, timeout, shutdown, leftovers of a previous agent): the tree was gone within the grace after SIGTERM, needed SIGKILL, left processes behind, or could not be signalled or waited for |
//! | `nodeplan_stop_survivors_total` | counter | | processes the stop ladder left running (`survivors` outcomes) |
//! | `nodeplan_cancel_latency_seconds` | histogram | | from a cancel reaching a running plan to the plan being recorded canceled |
//! | `nodeplan_plan_info` | gauge | `plan`, `name` | 1 for each plan the agent knows now: its id and where it is kept (a plan file's path, `secret NS/NAME`, `nodeplan NS/NAME`); gone with the plan. Join on `plan` to name the other series |
//! | `nodeplan_probe_healthy` | gauge | `plan`, `probe` | 1 while the probe is healthy, 0 while not; gone with the probe or its plan |
//! | `nodeplan_pid_record_recoveries_total` | counter | `result`: `stopped`, `not_stopped`, `gone`, `mismatch`, `refused`, `owner_alive`, `invalid` | PID records of a previous agent looked at by crash recovery, by what became of them |
//! | `nodeplan_write_retries_total` | counter | `target`: `secret`, `nodeplan`; `reason`: `conflict`, `error` | writes of plan state tried again: after a 409 conflict (at once, on the fresh object) or after a write that failed (a kept outcome written again) |
//! | `nodeplan_image_pull_bytes_total` | counter | | layer bytes downloaded from registries |
//! | `nodeplan_image_pull_duration_seconds` | histogram | `result`: `ok`, `error` | how long pulling one image from its registries took (every endpoint tried) |
//! | `nodeplan_directory_size_bytes` | gauge | `directory`: `applied`, `images`, `work` | disk space used under the applied-plan archive, the images directory and the work directory (measured at scrape time, at most every 10 s) |
//! | `nodeplan_directory_size_complete` | gauge | `directory` | 1 when the last measurement saw the whole directory, 0 when it stopped at its bound (the size is then a lower bound) |

/// Unix only so far: Windows has no directory-size gauge yet (docs/windows.md).
#[cfg(unix)]
pub mod disk;
pub mod server;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Buckets of instruction durations: from a `true` (a few ms) to an hour-long install.
const INSTRUCTION_BUCKETS: [f64; 12] = [0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];
/// Buckets of cancel latency: event-driven delivery takes milliseconds, the stop ladder's grace
/// (10 s by default) and kill timeout bound the rest.
const CANCEL_BUCKETS: [f64; 11] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Buckets of image pulls: a cached small image to a multi-GB installer on a slow link.
const PULL_BUCKETS: [f64; 10] = [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0];
/// Probe names longer than this are cut in labels (a plan is trusted, but a label is no place for
/// a paragraph); see [`label_text`].
const MAX_LABEL_CHARS: usize = 64;
/// Hex digits of the name's SHA-256 that end a cut probe name.
const LABEL_HASH_CHARS: usize = 8;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstructionLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProblemLabels {
    source: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    target: &'static str,
    reason: &'static str,
}

/// One probe of one plan.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    plan: String,
    probe: String,
}

/// One plan, by its id and where it is kept.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlanLabels {
    plan: String,
    name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
#[cfg_attr(windows, allow(dead_code))]
struct DirLabel {
    directory: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn instruction_histogram() -> Histogram {
    Histogram::new(INSTRUCTION_BUCKETS)
}

fn pull_histogram() -> Histogram {
    Histogram::new(PULL_BUCKETS)
}

/// Which of the agent's directories are measured, by their `directory` label.
#[derive(Debug, Clone, Default)]
pub struct Directories {
    /// `appliedPlanDirectory` (`applied`).
    pub applied: Option<PathBuf>,
    /// `imagesDirectory` (`images`).
    pub images: Option<PathBuf>,
    /// `workDirectory` (`work`): the execution directories.
    pub work: Option<PathBuf>,
}

/// The registry and every family. One per agent ([`install`]); tests make their own.
pub struct Metrics {
    registry: Registry,
    plans: Family<ResultLabel, Counter>,
    instruction_seconds: HistogramFamily<InstructionLabels>,
    stop_ladder: Family<OutcomeLabel, Counter>,
    stop_survivors: Counter,
    cancel_seconds: Histogram,
    probe_healthy: Family<ProbeLabels, Gauge>,
    plan_info: Family<PlanLabels, Gauge>,
    pid_recoveries: Family<ResultLabel, Counter>,
    write_retries: Family<WriteLabels, Counter>,
    pull_bytes: Counter,
    pull_seconds: HistogramFamily<ResultLabel>,
    api_refusals: Family<StatusLabel, Gauge>,
    plans_failed: Gauge,
    lease_held: Family<SourceLabel, Gauge>,
    api_failing: Gauge,
    source_problem: Family<ProblemLabels, Gauge>,
    #[cfg(unix)]
    disk: disk::DiskGauges,
}

impl Metrics {
    #[cfg_attr(windows, allow(unused_variables))]
    pub fn new(dirs: Directories) -> Metrics {
        let mut registry = Registry::default();
        let plans = Family::<ResultLabel, Counter>::default();
        registry.register(
            "nodeplan_plans",
            "Plan runs (and pauses or cancels recorded before a run) by the state recorded for them",
            plans.clone(),
        );
        let instruction_seconds = HistogramFamily::<InstructionLabels>::new_with_constructor(instruction_histogram);
        registry.register(
            "nodeplan_instruction_duration_seconds",
            "How long each instruction took, image staging included, by kind and result",
            instruction_seconds.clone(),
        );
        let stop_ladder = Family::<OutcomeLabel, Counter>::default();
        registry.register("nodeplan_stop_ladder", "Stop-ladder runs by outcome", stop_ladder.clone());
        let stop_survivors = Counter::default();
        registry.register("nodeplan_stop_survivors", "Processes the stop ladder left running", stop_survivors.clone());
        let cancel_seconds = Histogram::new(CANCEL_BUCKETS);
        registry.register(
            "nodeplan_cancel_latency_seconds",
            "From a cancel reaching a running plan to the plan being recorded canceled",
            cancel_seconds.clone(),
        );
        let probe_healthy = Family::<ProbeLabels, Gauge>::default();
        registry.register(
            "nodeplan_probe_healthy",
            "1 while a plan's probe is healthy, 0 while it is not",
            probe_healthy.clone(),
        );
        let plan_info = Family::<PlanLabels, Gauge>::default();
        registry.register(
            "nodeplan_plan_info",
            "1 for each plan the agent knows now, by its id and where it is kept",
            plan_info.clone(),
        );
        let pid_recoveries = Family::<ResultLabel, Counter>::default();
        registry.register(
            "nodeplan_pid_record_recoveries",
            "PID records of a previous agent looked at by crash recovery, by what became of them",
            pid_recoveries.clone(),
        );
        let write_retries = Family::<WriteLabels, Counter>::default();
        registry.register(
            "nodeplan_write_retries",
            "Writes of plan state to the Secret or a NodePlan tried again after a conflict or an error",
            write_retries.clone(),
        );
        let pull_bytes = Counter::default();
        registry.register("nodeplan_image_pull_bytes", "Layer bytes downloaded from registries", pull_bytes.clone());
        let pull_seconds = HistogramFamily::<ResultLabel>::new_with_constructor(pull_histogram);
        registry.register(
            "nodeplan_image_pull_duration_seconds",
            "How long pulling one image from its registries took",
            pull_seconds.clone(),
        );
        let api_refusals = Family::<StatusLabel, Gauge>::default();
        registry.register(
            "nodeplan_api_refusals",
            "Kinds of request the API server refuses now, by status (401: the agent's token; 403: a verb on its plan objects)",
            api_refusals.clone(),
        );
        for status in ["401", "403"] {
            api_refusals.get_or_create(&StatusLabel { status }).set(0);
        }
        let api_failing = Gauge::default();
        registry.register(
            "nodeplan_api_failing",
            "1 while requests to the API server get no answer (unreachable, timing out), else 0",
            api_failing.clone(),
        );
        let source_problem = Family::<ProblemLabels, Gauge>::default();
        registry.register(
            "nodeplan_source_problem",
            "1 while a plan source has the problem its reason names (missing: its plan Secret does not exist)",
            source_problem.clone(),
        );
        // Every labelled counter is there from the start, at 0: a rate over a series that appears
        // only with its first event misses that event.
        for result in [PlanResult::Succeeded, PlanResult::Failed, PlanResult::Paused, PlanResult::Canceled] {
            plans.get_or_create(&ResultLabel { result: result.label() }).inc_by(0);
        }
        for outcome in [Ladder::ExitedOnTerm, Ladder::Killed, Ladder::Survivors(0), Ladder::Error] {
            stop_ladder.get_or_create(&OutcomeLabel { outcome: outcome.label() }).inc_by(0);
        }
        for result in [
            Recovery::Invalid,
            Recovery::Gone,
            Recovery::Mismatch,
            Recovery::Stopped,
            Recovery::NotStopped,
            Recovery::Refused,
            Recovery::OwnerAlive,
        ] {
            pid_recoveries.get_or_create(&ResultLabel { result: result.label() }).inc_by(0);
        }
        for target in [WriteTarget::Secret, WriteTarget::NodePlan] {
            for reason in [RetryReason::Conflict, RetryReason::Error] {
                write_retries.get_or_create(&WriteLabels { target: target.label(), reason: reason.label() }).inc_by(0);
            }
        }
        let plans_failed = Gauge::default();
        registry.register(
            "nodeplan_plans_failed",
            "Plans whose state is failed now (a retry that starts or a success takes one off)",
            plans_failed.clone(),
        );
        let lease_held = Family::<SourceLabel, Gauge>::default();
        registry.register(
            "nodeplan_lease_held",
            "1 while the agent holds the Lease of a plan source, 0 while it waits for it",
            lease_held.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        registry.register("nodeplan_build_info", "1, labelled with the agent's version and commit", build.clone());
        build
            .get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION"), commit: env!("NODEPLAN_COMMIT") })
            .set(1);
        #[cfg(unix)]
        let disk = disk::DiskGauges::new(dirs);
        #[cfg(unix)]
        disk.register(&mut registry);
        Metrics {
            registry,
            plans,
            instruction_seconds,
            stop_ladder,
            stop_survivors,
            cancel_seconds,
            probe_healthy,
            plan_info,
            pid_recoveries,
            write_retries,
            pull_bytes,
            pull_seconds,
            api_refusals,
            plans_failed,
            lease_held,
            api_failing,
            source_problem,
            #[cfg(unix)]
            disk,
        }
    }

    /// The registry encoded in `format`, the directory sizes measured first when they are stale.
    /// Blocking (it may walk directories): call it off the runtime's threads.
    pub fn encode(&self, format: server::Format) -> String {
        #[cfg(unix)]
        self.disk.refresh();
        let mut out = String::new();
        let r = match format {
            server::Format::Text => prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry),
            server::Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &self.registry),
        };
        if let Err(e) = r {
            tracing::warn!("cannot encode the metrics: {e}");
        }
        out
    }

    fn plan_recorded(&self, result: PlanResult) {
        self.plans.get_or_create(&ResultLabel { result: result.label() }).inc();
    }

    fn instruction_finished(&self, periodic: bool, result: InstructionResult, elapsed: Duration) {
        let labels = InstructionLabels { kind: if periodic { "periodic" } else { "one_time" }, result: result.label() };
        self.instruction_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }

    fn stop_ladder(&self, outcome: Ladder) {
        self.stop_ladder.get_or_create(&OutcomeLabel { outcome: outcome.label() }).inc();
        if let Ladder::Survivors(n) = outcome {
            self.stop_survivors.inc_by(n as u64);
        }
    }

    fn pid_record_recovered(&self, result: Recovery) {
        self.pid_recoveries.get_or_create(&ResultLabel { result: result.label() }).inc();
    }

    fn write_retried(&self, target: WriteTarget, reason: RetryReason) {
        let labels = WriteLabels { target: target.label(), reason: reason.label() };
        self.write_retries.get_or_create(&labels).inc();
    }

    fn set_probe(&self, labels: &ProbeLabels, healthy: bool) {
        self.probe_healthy.get_or_create(labels).set(i64::from(healthy));
    }

    fn remove_probe(&self, labels: &ProbeLabels) {
        self.probe_healthy.remove(labels);
    }
}

static METRICS: OnceLock<Arc<Metrics>> = OnceLock::new();

/// Make `m` the agent's metrics: from now on the hooks report to it. Only the first call counts
/// (a process has one registry); returns the installed one.
pub fn install(m: Metrics) -> Arc<Metrics> {
    METRICS.get_or_init(|| Arc::new(m)).clone()
}

fn get() -> Option<&'static Metrics> {
    METRICS.get().map(|m| &**m)
}

/// The `result` label of a recorded plan state (a state that is an outcome).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanResult {
    Succeeded,
    Failed,
    Paused,
    Canceled,
}

impl PlanResult {
    pub fn label(self) -> &'static str {
        match self {
            PlanResult::Succeeded => "succeeded",
            PlanResult::Failed => "failed",
            PlanResult::Paused => "paused",
            PlanResult::Canceled => "canceled",
        }
    }
}

/// The `result` label of a finished instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstructionResult {
    Ok,
    Failed,
    Canceled,
    Stopped,
}

impl InstructionResult {
    pub fn label(self) -> &'static str {
        match self {
            InstructionResult::Ok => "ok",
            InstructionResult::Failed => "failed",
            InstructionResult::Canceled => "canceled",
            InstructionResult::Stopped => "stopped",
        }
    }
}

/// How a stop-ladder run ended: the `outcome` label, and the processes left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ladder {
    /// The tree was gone within the grace after SIGTERM.
    ExitedOnTerm,
    /// It needed SIGKILL.
    Killed,
    /// This many processes were left running.
    Survivors(usize),
    /// The tree could not be signalled or waited for.
    Error,
}

impl Ladder {
    pub fn label(self) -> &'static str {
        match self {
            Ladder::ExitedOnTerm => "exited_on_term",
            Ladder::Killed => "killed",
            Ladder::Survivors(_) => "survivors",
            Ladder::Error => "error",
        }
    }
}

/// The `result` label of a PID record seen by crash recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    Invalid,
    Gone,
    Mismatch,
    Stopped,
    NotStopped,
    Refused,
    OwnerAlive,
}

impl Recovery {
    pub fn label(self) -> &'static str {
        match self {
            Recovery::Invalid => "invalid",
            Recovery::Gone => "gone",
            Recovery::Mismatch => "mismatch",
            Recovery::Stopped => "stopped",
            Recovery::NotStopped => "not_stopped",
            Recovery::Refused => "refused",
            Recovery::OwnerAlive => "owner_alive",
        }
    }
}

/// Where a plan-state write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteTarget {
    Secret,
    NodePlan,
}

impl WriteTarget {
    fn label(self) -> &'static str {
        match self {
            WriteTarget::Secret => "secret",
            WriteTarget::NodePlan => "nodeplan",
        }
    }
}

/// Why a write is tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// The object changed since it was read (409): written again on the fresh object.
    Conflict,
    /// The previous attempt failed (API server slow, down, throttling): a kept write again.
    Error,
}

impl RetryReason {
    fn label(self) -> &'static str {
        match self {
            RetryReason::Conflict => "conflict",
            RetryReason::Error => "error",
        }
    }
}

/// A label value from outside the agent's own vocabulary (a probe's name, a path, an object's
/// name): the value itself when it has at most [`MAX_LABEL_CHARS`]
/// characters; otherwise its start, `~` and the first [`LABEL_HASH_CHARS`] hex digits of the
/// whole name's SHA-256, [`MAX_LABEL_CHARS`] characters in all. Two names that share their start
/// (and a short name that looks like a cut one) stay two series.
fn label_text(name: &str) -> String {
    if name.chars().count() <= MAX_LABEL_CHARS {
        return name.to_string();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(name.as_bytes());
    let hash: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut label: String = name.chars().take(MAX_LABEL_CHARS - LABEL_HASH_CHARS - 1).collect();
    label.push('~');
    label.push_str(&hash[..LABEL_HASH_CHARS]);
    label
}

// ---- hooks: one line at the place that knows the fact; nothing happens without `install` ----

/// A plan state that is an outcome was recorded for a plan (after a run, or a pause or cancel
/// before one).
pub fn plan_recorded(result: PlanResult) {
    if let Some(m) = get() {
        m.plan_recorded(result);
    }
}

/// An instruction (`periodic` or one-time) finished with `result` after `elapsed`.
pub fn instruction_finished(periodic: bool, result: InstructionResult, elapsed: Duration) {
    if let Some(m) = get() {
        m.instruction_finished(periodic, result, elapsed);
    }
}

/// The stop ladder ended with `outcome`.
pub fn stop_ladder(outcome: Ladder) {
    if let Some(m) = get() {
        m.stop_ladder(outcome);
    }
}

/// A cancel reached a running plan `latency` before the plan was recorded canceled.
pub fn cancel_recorded(latency: Duration) {
    if let Some(m) = get() {
        m.cancel_seconds.observe(latency.as_secs_f64());
    }
}

/// Crash recovery is done with one PID record.
pub fn pid_record_recovered(result: Recovery) {
    if let Some(m) = get() {
        m.pid_record_recovered(result);
    }
}

/// A write of plan state is tried again.
pub fn write_retried(target: WriteTarget, reason: RetryReason) {
    if let Some(m) = get() {
        m.write_retried(target, reason);
    }
}

/// The kinds of request the API server refuses now, per status ([`crate::k8s::refusals`]).
pub fn api_refusals(counts: [(u16, i64); 2]) {
    if let Some(m) = get() {
        for (status, n) in counts {
            let status = if status == 401 { "401" } else { "403" };
            m.api_refusals.get_or_create(&StatusLabel { status }).set(n);
        }
    }
}

/// Whether requests to the API server get no answer now ([`crate::k8s::liveness`]).
pub fn api_failing(failing: bool) {
    if let Some(m) = get() {
        m.api_failing.set(i64::from(failing));
    }
}

/// Whether the source `what` (`secret NS/NAME`) has the problem `reason` now (`missing`).
pub fn source_problem(what: &str, reason: &'static str, now: bool) {
    if let Some(m) = get() {
        m.source_problem.get_or_create(&ProblemLabels { source: label_text(what), reason }).set(i64::from(now));
    }
}

/// Whether the agent holds the Lease of the source `what` (`secret NS/NAME`) or waits for it.
pub fn lease_held(what: &str, held: bool) {
    if let Some(m) = get() {
        m.lease_held.get_or_create(&SourceLabel { source: label_text(what) }).set(i64::from(held));
    }
}

/// One plan's share of `nodeplan_plans_failed`: [`FailedNow::set`] follows the plan's state,
/// dropping it (the plan is gone) takes the plan off.
#[derive(Debug, Default)]
pub struct FailedNow(bool);

impl FailedNow {
    pub fn set(&mut self, failed: bool) {
        if self.0 != failed {
            self.0 = failed;
            if let Some(m) = get() {
                m.plans_failed.inc_by(if failed { 1 } else { -1 });
            }
        }
    }
}

impl Drop for FailedNow {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// `n` layer bytes came from a registry.
pub fn image_pull_bytes(n: usize) {
    if let Some(m) = get() {
        m.pull_bytes.inc_by(n as u64);
    }
}

/// Pulling one image from its registries took `elapsed` and succeeded (`ok`) or not.
pub fn image_pulled(ok: bool, elapsed: Duration) {
    if let Some(m) = get() {
        let result = if ok { "ok" } else { "error" };
        m.pull_seconds.get_or_create(&ResultLabel { result }).observe(elapsed.as_secs_f64());
    }
}

/// The probe gauges of one plan: [`ProbeHealth::set`] shows the latest statuses (removing probes
/// that are gone), and dropping it (the plan is gone) removes them all.
#[derive(Debug, Default)]
pub struct ProbeHealth {
    shown: Vec<ProbeLabels>,
}

impl ProbeHealth {
    /// Show the health of the probes (name, healthy) of the plan with `id`.
    pub fn set<'a>(&mut self, id: &str, probes: impl IntoIterator<Item = (&'a str, bool)>) {
        let Some(m) = get() else { return };
        self.set_in(m, id, probes);
    }

    /// Remove every gauge of the plan (its probes are gone).
    pub fn clear(&mut self) {
        if let Some(m) = get() {
            self.clear_in(m);
        }
    }

    fn set_in<'a>(&mut self, m: &Metrics, id: &str, probes: impl IntoIterator<Item = (&'a str, bool)>) {
        let plan = label_text(id);
        let now: Vec<(ProbeLabels, bool)> = probes
            .into_iter()
            .map(|(name, healthy)| (ProbeLabels { plan: plan.clone(), probe: label_text(name) }, healthy))
            .collect();
        for old in self.shown.iter().filter(|o| !now.iter().any(|(l, _)| l == *o)) {
            m.remove_probe(old);
        }
        for (labels, healthy) in &now {
            m.set_probe(labels, *healthy);
        }
        self.shown = now.into_iter().map(|(l, _)| l).collect();
    }

    fn clear_in(&mut self, m: &Metrics) {
        for l in self.shown.drain(..) {
            m.remove_probe(&l);
        }
    }
}

impl Drop for ProbeHealth {
    fn drop(&mut self) {
        self.clear();
    }
}

/// The `nodeplan_plan_info` series of one plan: [`PlanInfo::set`] shows its id and where it is
/// kept (replacing what it showed before), dropping it (the plan is gone) removes it.
#[derive(Debug, Default)]
pub struct PlanInfo {
    shown: Option<PlanLabels>,
}

impl PlanInfo {
    /// The plan with `id`, kept at `name`, is known now.
    pub fn set(&mut self, id: &str, name: &str) {
        if let Some(m) = get() {
            self.set_in(m, id, name);
        }
    }

    fn set_in(&mut self, m: &Metrics, id: &str, name: &str) {
        let labels = PlanLabels { plan: label_text(id), name: label_text(name) };
        if self.shown.as_ref() == Some(&labels) {
            return;
        }
        self.clear_in(m);
        m.plan_info.get_or_create(&labels).set(1);
        self.shown = Some(labels);
    }

    /// The plan is gone.
    pub fn clear(&mut self) {
        if let Some(m) = get() {
            self.clear_in(m);
        }
    }

    fn clear_in(&mut self, m: &Metrics) {
        if let Some(l) = self.shown.take() {
            m.plan_info.remove(&l);
        }
    }
}

impl Drop for PlanInfo {
    fn drop(&mut self) {
        self.clear();
    }
}

/// For tests of the modules that report: the process's metrics (installed on first use), and the
/// value of one series (`name{labels}` as exposed; 0 when absent). Counts only grow, so tests
/// compare before and after.
#[cfg(all(test, unix))]
pub(crate) fn sample(series: &str) -> f64 {
    let m = install(Metrics::new(Directories::default()));
    let text = m.encode(server::Format::Text);
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests;
