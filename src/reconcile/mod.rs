//! The one reconcile loop of the node, over all of its plan sources (local mode's plan directory,
//! remote mode's Secret, the node's NodePlans, and any source added later), joined into one with
//! [`both::Both`]; a source the agent may act on only under its Lease sits behind a [`gate::Gated`].
//! One plan runs at a time by construction: the loop awaits it, and looks at the other plans
//! meanwhile only to say that they wait.
//!
//! A source ([`PlanSource`]) reads and writes its own storage and nothing else: it lists its
//! plans, shows what it sees of one ([`Look`]: the plan, a [`flow::Snapshot`], saved outputs and
//! probe statuses; a look only reads), commits the transitions and outcomes the loop hands it
//! (an outcome that did not land comes back as the source encoded it, [`PlanSource::Kept`]: the
//! loop keeps it in its outbox and sends it again, [`PlanSource::resend`]),
//! writes what a look found to show when the loop asks ([`PlanSource::show`], only while the
//! plan's fence is open), and reports the pause/cancel values of a running plan. Everything
//! between is here, once:
//!
//! - recovery of a previous agent's leftovers before any plan runs, and the "blocked" state of a
//!   plan whose leftovers cannot be stopped (R17), looked at again with back-off;
//! - the pure rules ([`flow::decide`], [`flow::record`]) turned into writes and runs;
//! - the gates before a start: one plan at a time (another plan that would start meanwhile
//!   keeps its state and is shown waiting for its turn, [`PlanSource::wait`]) and the plan's
//!   required preflight checks ([`Look::preflight`], run here, never by a source);
//! - the commit of a start or resume before anything runs, and a pause or cancel that landed
//!   meanwhile taking effect before anything runs;
//! - interrupt delivery to the running plan: every change the source reports, a poll every second
//!   only where the source has no change notifications ([`PlanSource::polled`]), the run's timeout
//!   ([`Look::stop_after`]), a source that ended (as a shutdown), and shutdown (R15);
//! - back-off (one [`Backoff`] per reason) and warn-once for a held plan (R3), for an apply that
//!   could not start, and for a write that did not land, with jitter so a fleet does not write in
//!   the same millisecond when its API server comes back; a write that did not land is retried at
//!   its back-off step (or the server's Retry-After), not at every period, and at once when the
//!   source reports a change (its watch is back);
//! - probe scheduling: every plan's probes once per period (not while an invalid value holds it,
//!   R3; also while paused or canceled, R10), and right after a one-time pass.
//!
//! Each reconcile of one plan ends in an [`Action`], as kube-runtime's reconcilers do.
//!
//! # Adding a source
//! Implement [`PlanSource`] for a type that owns the storage (its keys name plans within it), and
//! join it to the others with one more [`both::Both`] where the agent builds its source
//! (`cli/agent.rs`; behind a [`gate::Gated`] if it needs a Lease). The source decides nothing about
//! states: it encodes [`Commit`] and [`Outcome`] into its storage and decodes its storage into a
//! [`Look`]. What it names as [`PlanSource::Kept`] is what the loop keeps of an outcome that did
//! not land (`std::convert::Infallible` for storage that is read again instead, as local mode's
//! `.pos`); a source that keeps outcomes on the node for a restart hands them over through
//! [`PlanSource::restored`]. `tests.rs` drives this loop with an in-memory source holding several
//! plans through pause, cancel, a crash, an outage and recovery: it is the smallest complete
//! example.

use crate::apply::{AgentExit, ApplyError, ApplyInput, ApplyResult, Applyinator, Interrupt, LogObserver};
use crate::backoff::{Backoff, jittered};
use crate::duration::human as human_duration;
pub use crate::events::Reason;
use crate::flow::{self, Commit, Decision, RunPlan};
use crate::plan::{Interruption, PeriodicInstructionOutput, Preflight, PreflightResult, ProbeStatus, ValidPlan};
use crate::probe::Prober;
use crate::process::Owner;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

pub mod both;
pub mod gate;
#[cfg(all(test, unix))]
mod tests;

/// What the loop does after reconciling one plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing due: look again at the next change or period.
    Wait,
    /// Look again after this long (or at the next change, whichever comes first).
    After(Duration),
    /// The agent is stopping.
    Stop,
}

/// How a source sees one plan's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum View {
    /// The plan-state flow (R1–R12).
    Flow(flow::Snapshot),
    /// No plan state (remote mode's legacy checksum flow): the source decided whether the one-time
    /// instructions run; nothing is committed before the run.
    Legacy { one_time: bool },
}

/// What a source sees of one plan when the loop looks at it.
#[derive(Debug, Clone)]
pub struct Look {
    /// How log lines name the plan (`plan 0123456789ab`, a plan file's path).
    pub label: String,
    /// Where the plan is kept, as people name it (a plan file's path, `secret NS/NAME`,
    /// `nodeplan NS/NAME`): the `name` of its `nodeplan_plan_info` series.
    pub place: String,
    pub plan: ValidPlan,
    pub checksum: String,
    pub view: View,
    /// `CATTLE_AGENT_ATTEMPT_NUMBER` when the run continues the plan, and when it begins it.
    pub attempt: i64,
    pub begin_attempt: i64,
    /// Outputs saved by earlier runs of this plan: one-time outputs are kept for the instructions
    /// a resume does not run again (and the legacy flow keeps them across runs).
    pub one_time_output: BTreeMap<String, Vec<u8>>,
    pub periodic_output: BTreeMap<String, PeriodicInstructionOutput>,
    pub probe_statuses: BTreeMap<String, ProbeStatus>,
    /// A failed plan the source retries on its own schedule (local mode): when it is due.
    pub retry_in: Option<Duration>,
    /// The run's timeout, from now (NodePlan mode): once it has passed, the loop asks the source
    /// for the running plan's interrupt (which then says cancel) every second, not before.
    pub stop_after: Option<Duration>,
    /// Checks that must pass before the plan begins (NodePlan mode's `preflightChecks`): the
    /// loop runs them as the gate before a start; a required one failing keeps the plan waiting.
    pub preflight: Vec<Preflight>,
    /// What those checks found, filled in by the loop once they passed (a source may write it
    /// with the start).
    pub checked: Option<PreflightResult>,
}

/// Why a plan that would start waits, for its source to show ([`PlanSource::wait`]).
#[derive(Debug, Clone, Copy)]
pub enum Wait<'a> {
    /// Another plan of the node applies (one at a time): its owner, as PID records name it.
    Turn(&'a str),
    /// Required preflight checks failed.
    Preflight(&'a PreflightResult),
}

/// The result of looking at one plan.
#[derive(Debug, Clone)]
pub enum Seen {
    Plan(Box<Look>),
    /// No plan there (gone, or no plan key yet): nothing to do.
    Nothing,
    /// Nothing is run or written for the plan and its probes do not run (R3): the text is logged
    /// once per distinct value and the plan is looked at again with back-off.
    Held(String),
    /// A plan that does not parse: logged once per checksum, looked at again at the next change.
    Bad {
        checksum: String,
        error: String,
    },
}

/// How a write went (the one writer's answer, [`crate::k8s::write`]).
pub use crate::k8s::write::Written;

/// How a write that must not be lost went, and what to keep of it (`Some` when it did not land):
/// the loop keeps that in its outbox and hands it back to [`PlanSource::resend`].
pub type Sent<K> = (Written, Option<K>);

/// A finished run, for the source to store.
#[derive(Debug)]
pub struct Outcome<'a> {
    pub run: &'a RunPlan,
    /// What the plan-state rules say to write ([`View::Flow`] only).
    pub record: Option<flow::Record>,
    pub result: &'a ApplyResult,
    /// Probe statuses taken right after the run, to store with it.
    pub probes: Option<BTreeMap<String, ProbeStatus>>,
    /// What made the run fail (a failed run only), to store beside its state for `plan status`.
    pub failure: Option<crate::plan::Failure>,
}

/// The pause/cancel values a running plan sees now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Only valid values count (an invalid value in flight is ignored: never kill on a guess).
    pub interrupt: Interrupt,
    /// Something to log once for this run (an invalid value ignored, a plan file removed).
    pub note: Option<String>,
}

/// Whose a PID record is, by its owner label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim<K> {
    /// Another source's (or another tool's).
    NotMine,
    Plan(K),
    /// This source's, but for a plan it cannot name: such a record blocks every plan.
    Unknown,
}

/// A place plans come from. See the module doc for the contract.
pub trait PlanSource: Send {
    /// Names one plan within the source.
    type Key: Clone + Eq + Hash + fmt::Debug + Send + Sync + 'static;
    /// An outcome that did not land, in the source's own encoding (data keys, a status): the loop
    /// keeps it (its outbox) and hands it back to [`PlanSource::resend`].
    type Kept: Send + 'static;

    /// Wait until something may have changed (cancel-safe: the loop drops it to look at other
    /// things). `false`: the source ended and the loop stops.
    fn changed(&mut self) -> impl Future<Output = bool> + Send;
    /// The plans to look at in one pass, in order.
    fn keys(&mut self) -> impl Future<Output = Vec<Self::Key>> + Send;
    /// What the source sees of one plan now.
    fn look(&mut self, key: &Self::Key) -> impl Future<Output = Seen> + Send;
    /// Write a transition (a start, a resume, a pause or cancel recorded at reconcile time).
    fn commit(&mut self, key: &Self::Key, look: &Look, commit: &Commit) -> impl Future<Output = Written> + Send;
    /// Write a finished run's outcome: how it went, and what to keep of it when it did not land
    /// (`Some`, with [`Written::Failed`]): the loop keeps that and hands it back to
    /// [`PlanSource::resend`] until it lands or no longer applies.
    fn record(
        &mut self,
        key: &Self::Key,
        look: &Look,
        outcome: Outcome<'_>,
    ) -> impl Future<Output = Sent<Self::Kept>> + Send;
    /// An apply that could not start (`err`): store it if the source counts it as a failed apply
    /// (`Some`), or leave the plan as it is (`None`: the loop retries with back-off).
    fn not_started(
        &mut self,
        key: &Self::Key,
        look: &Look,
        err: &ApplyError,
    ) -> impl Future<Output = Option<Written>> + Send;
    /// Write probe statuses taken while the plan does not run (of the plan with `checksum`: a
    /// source whose plan changed meanwhile abandons the write).
    fn write_probes(
        &mut self,
        key: &Self::Key,
        checksum: &str,
        statuses: BTreeMap<String, ProbeStatus>,
    ) -> impl Future<Output = Written> + Send;
    /// Send a kept outcome again: how it went, and what to keep of it still (`Some`, with
    /// [`Written::Failed`]). [`Written::Abandoned`]: it no longer applies (the plan changed).
    fn resend(&mut self, key: &Self::Key, kept: Self::Kept) -> impl Future<Output = Sent<Self::Kept>> + Send;
    /// An outcome a previous agent kept on the node for this plan and did not write (R17): the
    /// loop sends it ([`PlanSource::resend`]) before anything of the plan is decided. Asked
    /// before every look while the loop keeps nothing for the plan; a source hands each such
    /// outcome over once.
    fn restored(&mut self, _key: &Self::Key) -> impl Future<Output = Option<Self::Kept>> + Send {
        async { None }
    }
    /// Show (or clear) why a plan is blocked, where the source can (local mode's `.pos`).
    fn set_blocked(&mut self, key: &Self::Key, why: Option<&str>) -> impl Future<Output = ()> + Send;
    /// Write what the last look at this plan found to show, if anything (a NodePlan this agent
    /// refuses says so in its status). A look only reads: the loop calls this after it, and only
    /// while the plan's fence is open (R26: nothing is written without the Lease).
    fn show(&mut self, _key: &Self::Key) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// Show that a plan which would start waits, and why (a NodePlan says so in its status, once).
    /// Nothing is committed for it: it keeps its state. Called only while its fence is open.
    fn wait(&mut self, _key: &Self::Key, _look: &Look, _why: Wait<'_>) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// The pause/cancel values the running plan sees now.
    fn interrupt(&mut self, key: &Self::Key, look: &Look) -> Observed;
    /// The owner of the PID records of this plan's processes.
    fn owner(&self, key: &Self::Key, look: &Look) -> Owner;
    /// Whose a PID record with this owner is.
    fn claim(&self, owner: &Owner) -> Claim<Self::Key>;
    /// How long the loop waits for a change before it looks at every plan again: a rescan period
    /// for a source that is not watched (local mode), [`WATCHED_PERIOD`] for one whose watch
    /// delivers every change.
    fn period(&self) -> Duration;
    /// How often the probes of this plan run (the source's period by default).
    fn probe_period(&self, _key: &Self::Key) -> Duration {
        self.period()
    }
    /// Start watching the storage (called once, before the first [`PlanSource::keys`]).
    fn start(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// Whether the agent may act on this plan now (R26: the Lease of its source is this agent's,
    /// renewed in time). Closed, nothing starts or is written and a running plan stops at a
    /// recorded boundary; [`PlanSource::changed`] returns when a fence opens or closes. Without
    /// a Lease the fence never closes (the default: a receiver whose sender is gone).
    fn fence(&self, _key: &Self::Key) -> watch::Receiver<bool> {
        watch::channel(true).1
    }
    /// Whether a running plan of this source learns of pause and cancel only by polling (its
    /// storage has no change notifications): the loop then asks every second.
    fn polled(&self, _key: &Self::Key) -> bool {
        false
    }
    /// A plan of the source starts (`true`) or stops (`false`) executing: a source that holds a
    /// Lease renews it more often while one does (R24).
    fn applying(&self, _key: &Self::Key, _on: bool) {}
    /// Before a plan of the source starts executing: `Err` (why) when the agent may not act on it
    /// now. A source that holds a Lease has it renewed first unless its last renewal leaves margin
    /// (R26); its own writes ask the same.
    fn fresh(&mut self, _key: &Self::Key) -> impl Future<Output = Result<(), String>> + Send {
        async { Ok(()) }
    }
    /// Whether plans of the source became this agent's to act on since the last call (a gate
    /// opened, see [`gate`]): the loop then recovers leftovers again before any of them runs (R17).
    fn opened(&mut self) -> bool {
        false
    }
    /// The loop ended: give up what the source holds (its Lease); `Some(why)` when the source
    /// ended because another agent must act on it alone ([`AgentExit::Displaced`]).
    fn close(&mut self) -> impl Future<Output = Option<String>> + Send {
        async { None }
    }
    /// Tell people what happened to a plan (a Kubernetes Event where the source has an object;
    /// nothing by default). Must not wait: the loop calls it between steps.
    fn event(&mut self, _key: &Self::Key, _reason: Reason, _note: &str) {}
}

/// How long a loop over sources that deliver every change (a watch) waits without one before it
/// looks at every plan again: nothing depends on it (probes, periodic instructions, retries and
/// back-offs have timers of their own); it is a safety net.
pub const WATCHED_PERIOD: Duration = Duration::from_secs(60);

/// A back-off of `initial` doubling to five minutes.
fn backoff(initial: Duration) -> Backoff {
    Backoff::new(initial, Duration::from_secs(300), Duration::MAX)
}

/// The note of a state recorded without a run (a pause or cancel of a plan not running): what
/// had run of it.
fn recorded_note(view: &View, state: &crate::plan::PlanState, cp: &crate::plan::Checkpoint) -> String {
    use crate::plan::PlanState;
    let (done, total) = (cp.completed_instructions, cp.total_instructions);
    match view {
        View::Flow(s) if s.state == PlanState::Succeeded && *state == PlanState::Canceled => {
            format!("canceled after it succeeded ({done}/{total} instructions): its periodic instructions stop")
        }
        View::Flow(s) if s.state == PlanState::Succeeded => {
            format!("{state} after it succeeded ({done}/{total} instructions): its periodic instructions wait")
        }
        _ if done == 0 => format!("{state} before it ran"),
        _ => format!("{state} after {done}/{total} instructions"),
    }
}

/// The event for a plan state written after (or instead of) a run.
fn outcome_reason(state: &crate::plan::PlanState, survivors: bool) -> Option<Reason> {
    use crate::plan::PlanState;
    match state {
        PlanState::Succeeded => Some(Reason::Succeeded),
        PlanState::Failed => Some(Reason::Failed),
        PlanState::Paused => Some(Reason::Paused),
        PlanState::Canceled if survivors => Some(Reason::CanceledWithSurvivors),
        PlanState::Canceled => Some(Reason::Canceled),
        _ => None,
    }
}

/// What a run of the legacy checksum flow (no plan state) amounts to, for
/// `nodeplan_plans_total`: a one-time pass that was not interrupted succeeded or failed.
fn legacy_state(view: &View, run: &RunPlan, result: &ApplyResult) -> Option<crate::plan::PlanState> {
    use crate::plan::PlanState;
    match view {
        View::Legacy { .. } if run.one_time() && result.interruption.is_none() => {
            Some(if result.one_time_succeeded { PlanState::Succeeded } else { PlanState::Failed })
        }
        _ => None,
    }
}

/// The metric of a recorded plan state; `None` for states that are not an outcome.
fn plan_metric(state: &crate::plan::PlanState) -> Option<crate::metrics::PlanResult> {
    use crate::metrics::PlanResult;
    use crate::plan::PlanState;
    match state {
        PlanState::Succeeded => Some(PlanResult::Succeeded),
        PlanState::Failed => Some(PlanResult::Failed),
        PlanState::Paused => Some(PlanResult::Paused),
        PlanState::Canceled => Some(PlanResult::Canceled),
        PlanState::Pending | PlanState::InProgress | PlanState::Other(_) => None,
    }
}

/// Count a recorded plan state in `nodeplan_plans_total` (when it is an outcome).
fn count_recorded(state: &crate::plan::PlanState) {
    if let Some(r) = plan_metric(state) {
        crate::metrics::plan_recorded(r);
    }
}

/// The probes' health as the probe gauges take it.
fn health(statuses: &BTreeMap<String, ProbeStatus>) -> impl Iterator<Item = (&str, bool)> {
    statuses.iter().map(|(name, s)| (name.as_str(), s.healthy))
}

/// A back-off step that is taken only once its previous delay has passed: being looked at again
/// early (a change woke the loop) does not double it.
struct Step {
    backoff: Backoff,
    until: Option<Instant>,
}

impl Step {
    fn new(initial: Duration) -> Step {
        Step { backoff: backoff(initial), until: None }
    }
    /// The next delay, when the look or attempt that began at `began` ends at `now`. One that began
    /// before the last deadline was brought early (a change woke the loop): the same deadline
    /// holds, and is due at once when it passed meanwhile (a write that was in flight at its
    /// deadline: the back-off's own attempt is still to come). One that began at or after the
    /// deadline takes the next step.
    fn next(&mut self, began: Instant, now: Instant) -> Duration {
        if let Some(t) = self.until
            && t > began
        {
            return t.saturating_duration_since(now);
        }
        let d = jittered(self.backoff.after_run(Duration::ZERO));
        self.until = Some(now + d);
        d
    }
}

/// Another plan's probes, taken while a plan applies.
type SideProbe<K> = std::pin::Pin<Box<dyn Future<Output = (K, Probes, BTreeMap<String, ProbeStatus>)> + Send>>;

/// What came of the last look at a plan, each with its own timer: one at a time.
enum Standing {
    /// Nothing holds the plan back.
    Clear,
    /// Held (R3: an invalid value; its source holds it; its required preflight checks failed):
    /// looked at again at its back-off step, or at the next change. Its probes do not run.
    Held(Step),
    /// A plan that does not parse, reported once for this checksum; looked at again at the
    /// next change.
    Bad(String),
    /// An apply that could not start (the interlock, the work directory): the plan keeps its
    /// state and is not looked at before the step's deadline (a gate); a started apply clears it.
    /// With why it could not, as last said.
    NotStarted(Step, String),
}

/// A plan whose leftovers could not be stopped (R17): nothing of it runs, whatever its look says,
/// and recovery is tried again at the step's deadline (a gate). Kept apart from [`Standing`]: it
/// holds whatever the source shows, until recovery succeeds.
struct Blocked {
    why: String,
    step: Step,
}

/// A write that did not land (a commit, probe statuses, or an outcome the loop keeps): tried
/// again at `at` (its back-off step, or the server's hint), or at once after a change.
struct Writing {
    step: Step,
    at: Option<Instant>,
    /// When the pass that tries it again began (its failure is judged against the deadline then).
    began: Option<Instant>,
}

/// What the loop remembers about one plan (never persisted): where it stands, and beside that
/// whether it is blocked and whether a write backs off (both can hold whatever it stands at),
/// its next deadline, its probes, and the log lines said once.
struct Memory {
    standing: Standing,
    blocked: Option<Blocked>,
    write: Option<Writing>,
    /// Look again then (a failed plan's retry, periodic instructions, a back-off).
    due: Option<Instant>,
    /// Log lines already written (warn-once), cleared when the plan is no longer held.
    warned: HashSet<String>,
    next_probe: Option<Instant>,
    /// The plan's probes as last seen (not while it is held): they keep running while another
    /// plan applies.
    probes: Option<Probes>,
    /// The plan's `nodeplan_probe_healthy` gauges (removed when the plan is forgotten).
    probe_health: crate::metrics::ProbeHealth,
    /// The id of the plan last looked at, by its checksum (computed once per plan), and its
    /// `nodeplan_plan_info` series (removed when the plan is forgotten).
    id: Option<(String, String)>,
    plan_info: crate::metrics::PlanInfo,
    /// The plan's share of `nodeplan_plans_failed` (its state as last looked at).
    failed_now: crate::metrics::FailedNow,
}

/// What probing a plan needs, kept between looks (small: not the plan).
#[derive(Clone)]
struct Probes {
    checksum: String,
    id: String,
    label: String,
    probes: BTreeMap<String, crate::plan::Probe>,
    statuses: BTreeMap<String, ProbeStatus>,
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            standing: Standing::Clear,
            blocked: None,
            write: None,
            due: None,
            warned: HashSet::new(),
            next_probe: None,
            probes: None,
            probe_health: crate::metrics::ProbeHealth::default(),
            id: None,
            plan_info: crate::metrics::PlanInfo::default(),
            failed_now: crate::metrics::FailedNow::default(),
        }
    }
}

impl Memory {
    /// The id of the plan `look` shows ([`crate::plan::id`], computed once per plan), which
    /// `nodeplan_plan_info` now maps to where the plan is kept.
    fn id_of(&mut self, look: &Look) -> String {
        let id = match &self.id {
            Some((checksum, id)) if *checksum == look.checksum => id.clone(),
            _ => {
                let id = look.plan.id();
                self.id = Some((look.checksum.clone(), id.clone()));
                id
            }
        };
        self.plan_info.set(&id, &look.place);
        self.failed_now.set(matches!(&look.view, View::Flow(s) if s.state == crate::plan::PlanState::Failed));
        id
    }

    /// The plan is held: the delay before it is looked at again (a step of its back-off).
    fn held(&mut self, now: Instant) -> Duration {
        self.probes = None;
        let mut step = match std::mem::replace(&mut self.standing, Standing::Clear) {
            Standing::Held(step) => step,
            _ => Step::new(Duration::from_secs(1)),
        };
        let d = step.next(now, now);
        self.standing = Standing::Held(step);
        d
    }

    /// An apply could not start (`why`): the delay before it is tried again (a step of its
    /// back-off), and whether `why` is new (not what the last try said).
    fn not_started(&mut self, now: Instant, why: String) -> (Duration, bool) {
        let (mut step, new) = match std::mem::replace(&mut self.standing, Standing::Clear) {
            Standing::NotStarted(step, said) => (step, said != why),
            _ => (Step::new(Duration::from_secs(1)), true),
        };
        let d = step.next(now, now);
        self.standing = Standing::NotStarted(step, why);
        (d, new)
    }

    /// Not looked at before this: an apply backing off, or a blocked plan's next recovery.
    fn gate(&self) -> Option<Instant> {
        let apply = match &self.standing {
            Standing::NotStarted(step, _) => step.until,
            _ => None,
        };
        apply.max(self.blocked.as_ref().and_then(|b| b.step.until))
    }

    /// Blocked for `why` (its recovery step kept when it already was).
    fn block(&mut self, why: String) -> &mut Blocked {
        let b =
            self.blocked.get_or_insert_with(|| Blocked { why: String::new(), step: Step::new(Duration::from_secs(5)) });
        b.why = why;
        b
    }

    fn blocked_why(&self) -> Option<String> {
        self.blocked.as_ref().map(|b| b.why.clone())
    }

    /// The plan is gone: its series go too.
    fn forget(&mut self) {
        self.probe_health.clear();
        self.plan_info.clear();
        self.id = None;
    }

    /// Log `msg` unless it was logged already; whether it was logged now.
    fn warn_once(&mut self, msg: String) -> bool {
        let first = self.warned.insert(msg.clone());
        if first {
            tracing::warn!("{msg}");
        }
        first
    }
}

/// The reconcile loop over one source.
pub struct Reconciler<S: PlanSource> {
    source: S,
    app: Arc<Applyinator>,
    prober: Arc<Prober>,
    memory: HashMap<S::Key, Memory>,
    /// The outbox: per plan, an outcome that did not land yet, sent again before anything else of
    /// the plan happens, until it lands or no longer applies.
    outbox: HashMap<S::Key, S::Kept>,
    /// A refused record whose plan cannot be known (or a refused PID directory): every plan of
    /// the source is held, as any of them may still be running.
    blocked_all: Option<String>,
    /// Why the agent exits with [`AgentExit::Incomplete`]: a run's processes could not be stopped,
    /// and their plan is still blocked (cleared when the leftovers are found gone).
    incomplete: Option<String>,
    /// An instruction asked for the agent to restart (R23) and its progress is recorded: the loop
    /// ends with [`AgentExit::Restart`].
    restart: bool,
    /// ... once the outcome of this plan, kept after a failed write, lands.
    restart_after_write: Option<S::Key>,
    shutdown: watch::Receiver<bool>,
    /// A source ended while a plan ran ([`PlanSource::changed`] said so): the loop stops after it.
    ended: bool,
    /// The source reported a change while a plan ran (delivered to it as an interrupt): the pass
    /// after the run looks at every plan again instead of waiting for the next change.
    dirty: bool,
    /// This pass follows a change the source reported (or is the first): a write backing off is
    /// tried again at once. A pass that only follows the period (or another plan's timer) leaves
    /// it to its back-off.
    by_change: bool,
    /// When the running plan first saw a cancel (for `nodeplan_cancel_latency_seconds`).
    cancel_seen: Option<Instant>,
}

/// What recovery found: the plans whose leftovers could not be stopped (or whose records are
/// refused), and a reason that holds every plan.
pub struct Recovery<K> {
    pub held: HashMap<K, String>,
    pub all: Option<String>,
    /// Per plan, the leftovers stopped.
    pub stopped: HashMap<K, usize>,
}

/// Stop the verified leftovers claimed by `claim` (those of `only`, or all of them) before anything
/// runs (R17); report what is kept.
pub async fn recover<K: Clone + Eq + Hash>(
    app: &Applyinator,
    claim: impl Fn(&Owner) -> Claim<K>,
    only: Option<&K>,
) -> Recovery<K> {
    let mut out = Recovery { held: HashMap::new(), all: None, stopped: HashMap::new() };
    let results = app
        .supervisor()
        .recover(|rec| match claim(&rec.owner) {
            Claim::NotMine => false,
            Claim::Plan(k) => only.is_none_or(|o| *o == k),
            Claim::Unknown => true,
        })
        .await;
    for r in results {
        if let (crate::process::RecoveryResult::Stopped(_), Some(Claim::Plan(k))) =
            (&r.result, r.record.as_ref().map(|rec| claim(&rec.owner)))
        {
            *out.stopped.entry(k).or_default() += 1;
        }
        let Some(why) = r.hold_reason() else { continue };
        match r.record.as_ref().map(|rec| claim(&rec.owner)) {
            Some(Claim::Plan(k)) => {
                out.held.insert(k, why);
            }
            _ => out.all = Some(why),
        }
    }
    out
}

impl<S: PlanSource> Reconciler<S> {
    pub fn new(source: S, app: Arc<Applyinator>, prober: Arc<Prober>, shutdown: watch::Receiver<bool>) -> Self {
        Reconciler {
            source,
            app,
            prober,
            memory: HashMap::new(),
            outbox: HashMap::new(),
            blocked_all: None,
            incomplete: None,
            restart: false,
            restart_after_write: None,
            shutdown,
            ended: false,
            dirty: false,
            by_change: true,
            cancel_seen: None,
        }
    }

    /// Run until shutdown (or until the source ends).
    pub async fn run(mut self) -> (AgentExit, S) {
        // R17: whatever a previous agent left running is found and stopped before any plan runs.
        self.recover_all().await;
        self.source.start().await;
        let mut shutdown = self.shutdown.clone();
        'outer: loop {
            if *shutdown.borrow() || self.ended {
                break;
            }
            let keys = self.source.keys().await;
            if self.source.opened() {
                self.recover_all().await;
            }
            // A plan that is gone is forgotten, unless it is blocked: its leftovers still run.
            self.memory.retain(|k, m| keys.contains(k) || m.blocked.is_some());
            self.outbox.retain(|k, _| keys.contains(k));
            for key in keys {
                if *shutdown.borrow() || self.restart || self.ended {
                    break 'outer;
                }
                let started = Instant::now();
                let action = self.reconcile(&key).await;
                let mem = self.memory.entry(key).or_default();
                match action {
                    Action::Stop => break 'outer,
                    // The sooner of this and a deadline the pass set itself (a retry's).
                    Action::After(d) => {
                        let t = Instant::now() + d;
                        mem.due = Some(mem.due.filter(|u| *u > started).map_or(t, |u| u.min(t)));
                    }
                    // A deadline that had passed when this pass began was served by it (a pass
                    // that ends early does not clear it itself). One set by this pass still
                    // holds, even when it has passed meanwhile (a retry due a moment after the
                    // look): that is the next pass's to serve.
                    Action::Wait => {
                        if mem.due.is_some_and(|t| t <= started) {
                            mem.due = None;
                        }
                    }
                }
            }
            if std::mem::take(&mut self.dirty) {
                self.by_change = true;
                continue;
            }
            // The next thing due. A gate that has passed, and probes that are due but were not
            // reached by this pass (the plan is held, gated or its write is backing off), are no
            // reason to look again at once: that would spin until they are reached.
            let now = Instant::now();
            let next = self
                .memory
                .values()
                .flat_map(|m| [m.due, m.gate().filter(|t| *t > now), m.next_probe.filter(|t| *t > now)])
                .flatten()
                .map(|t| t.saturating_duration_since(now))
                .fold(self.source.period(), Duration::min);
            self.by_change = false;
            tokio::select! {
                alive = self.source.changed() => {
                    if !alive { break }
                    self.by_change = true;
                }
                _ = tokio::time::sleep(next) => {}
                r = shutdown.changed() => if r.is_err() { break },
            }
        }
        let displaced = self.source.close().await;
        let exit = match (self.incomplete.take(), displaced) {
            (Some(e), _) => AgentExit::Incomplete(e),
            (None, _) if self.restart => AgentExit::Restart,
            (None, Some(why)) => AgentExit::Displaced(why),
            (None, None) => AgentExit::Clean,
        };
        (exit, self.source)
    }

    async fn recover_all(&mut self) {
        let source = &self.source;
        let r = recover(&self.app, |o| source.claim(o), None).await;
        for (key, n) in r.stopped {
            let note =
                format!("{n} process tree(s) a previous agent left running were stopped before the plan runs again");
            self.source.event(&key, Reason::LeftoversStopped, &note);
        }
        for (key, why) in r.held {
            tracing::error!("{why}; the plan is blocked until this is resolved");
            self.source.event(&key, Reason::Blocked, &why);
            self.memory.entry(key).or_default().block(why);
        }
        if let Some(why) = &r.all {
            tracing::error!("{why}; every plan is blocked until this is resolved");
        }
        self.blocked_all = r.all;
    }

    /// Look at one blocked plan again: recovery runs for it (the stop ladder again), with back-off
    /// so other plans are not held up. Returns whether it is still blocked.
    async fn recheck_blocked(&mut self, key: &S::Key) -> bool {
        let source = &self.source;
        let r = recover(&self.app, |o| source.claim(o), Some(key)).await;
        let mut held = r.held;
        let why = held.remove(key).or_else(|| r.all.clone());
        self.blocked_all = r.all;
        let now = Instant::now();
        let mem = self.memory.entry(key.clone()).or_default();
        match why {
            Some(why) => {
                mem.block(why.clone()).step.next(now, now);
                self.source.set_blocked(key, Some(&why)).await;
                true
            }
            None => {
                mem.blocked = None;
                // What a run could not stop is gone: unless another plan is still blocked, there is
                // nothing left to report on the way out.
                if self.blocked_all.is_none() && self.memory.values().all(|m| m.blocked.is_none()) {
                    self.incomplete = None;
                }
                self.source.set_blocked(key, None).await;
                false
            }
        }
    }

    fn mem(&mut self, key: &S::Key) -> &mut Memory {
        self.memory.entry(key.clone()).or_default()
    }

    /// A Kubernetes Event about the plan `look` shows. Its note begins with the plan's id (as
    /// `nodeplan plan status` shows it): `kubectl describe` says which of the plans the object held
    /// it was about, and the same note for another plan is another event, where it was one series
    /// (each plan Rancher writes into a machine's Secret began `attempt 1: applying …` again).
    fn plan_event(&mut self, key: &S::Key, look: &Look, reason: Reason, note: &str) {
        let id = self.mem(key).id_of(look);
        self.source.event(key, reason, &format!("plan {id}: {note}"));
    }

    /// A write failed: keep trying with back-off (the server's hint when it gave one).
    fn write_failed(&mut self, key: &S::Key, what: &str, error: &str, retry_after: Option<Duration>) -> Action {
        let now = Instant::now();
        let w = self.mem(key).write.get_or_insert_with(|| Writing {
            step: Step::new(Duration::from_secs(1)),
            at: None,
            began: None,
        });
        let began = w.began.take().unwrap_or(now);
        let d = match retry_after {
            Some(d) => jittered(d),
            None => w.step.next(began, now),
        };
        w.at = Some(now + d);
        if *self.shutdown.borrow() {
            // The loop ends before the retry: nothing to warn of.
            tracing::debug!("did not write {what} ({error}): the agent shuts down");
        } else {
            tracing::warn!("cannot write {what} ({error}); retrying in {}", human_duration(d));
        }
        Action::After(d)
    }

    fn wrote(&mut self, key: &S::Key) {
        if self.restart_after_write.as_ref() == Some(key) {
            self.restart = true;
        }
        self.mem(key).write = None;
    }

    /// An outcome did not land: the loop keeps what the source made of it (`keep`) and sends it
    /// again with back-off.
    fn outcome_failed(
        &mut self,
        key: &S::Key,
        keep: Option<S::Kept>,
        what: &str,
        error: &str,
        retry_after: Option<Duration>,
    ) -> Action {
        if let Some(k) = keep {
            self.outbox.insert(key.clone(), k);
        }
        self.write_failed(key, what, error, retry_after)
    }

    /// Reconcile one plan.
    async fn reconcile(&mut self, key: &S::Key) -> Action {
        // R26: while the fence is closed the agent neither starts nor writes anything (a kept write
        // included: it lands once the Lease is renewed, or never if the Lease was lost); the loop
        // looks again when the fence opens.
        if !*self.source.fence(key).borrow() {
            self.mem(key).warn_once(
                "waiting: this agent's Lease on the plan source is not renewed in time; nothing starts and nothing is written until it is".to_string(),
            );
            return Action::Wait;
        }
        let now = Instant::now();
        if self.mem(key).gate().is_some_and(|t| now < t) {
            return Action::Wait;
        }
        // A write backing off is tried again at its step, or at once after a change (the source's
        // watch is back, the plan changed); the period alone does not bring it forward.
        let backing_off = |w: &Writing| w.at.is_some_and(|t| now < t);
        if !self.by_change && self.mem(key).write.as_ref().is_some_and(backing_off) {
            return Action::Wait;
        }
        // This pass tries again; a write that fails in it sets the next attempt anew (a write
        // abandoned meanwhile asks for a look at once, which nothing holds back).
        if let Some(w) = self.mem(key).write.as_mut() {
            w.at = None;
            w.began = Some(now);
        }
        // A kept outcome lands first (as soon as the source is reachable again), as does one a
        // previous agent kept on the node: nothing of the plan is decided before.
        let kept = match self.outbox.remove(key) {
            Some(k) => Some(k),
            None => self.source.restored(key).await,
        };
        if let Some(kept) = kept {
            match self.source.resend(key, kept).await {
                // Landed, or no longer applies: either way its back-off ends, and a restart asked
                // for is due now (the binary it was for is in place).
                (w @ (Written::Done | Written::Abandoned), _) => {
                    if w == Written::Abandoned {
                        tracing::info!(
                            "the plan changed before its outcome could be written; reconciling the new plan"
                        );
                    }
                    self.wrote(key);
                    if self.restart {
                        return Action::Stop;
                    }
                }
                (Written::Failed { error, retry_after }, keep) => {
                    return self.outcome_failed(key, keep, "the outcome", &error, retry_after);
                }
            }
        }
        let seen = self.source.look(key).await;
        self.source.show(key).await;
        let look = match seen {
            Seen::Nothing => {
                self.mem(key).forget();
                return Action::Wait;
            }
            Seen::Held(why) => {
                let mem = self.mem(key);
                mem.warn_once(why);
                return Action::After(mem.held(now));
            }
            Seen::Bad { checksum, error } => {
                let mem = self.mem(key);
                if !matches!(&mem.standing, Standing::Bad(c) if *c == checksum) {
                    tracing::error!("{error}");
                    mem.standing = Standing::Bad(checksum);
                }
                return Action::Wait;
            }
            Seen::Plan(look) => look,
        };
        if let Some(w) = &look.plan.unknown_keys {
            // Taken as system-agent takes it, but said (once per plan): a typo makes an empty plan.
            self.mem(key).warn_once(format!("{}: {w}", look.label));
        }
        let id = self.mem(key).id_of(&look);
        let decision = match &look.view {
            View::Flow(snap) => flow::decide(snap),
            View::Legacy { one_time } => Decision::Run(RunPlan::Legacy { one_time: *one_time }),
        };
        if let Decision::Invalid(e) = &decision {
            // R3: nothing written, nothing run, no probes; looked at again with back-off.
            let msg = format!("{}: {e}; the plan is held and nothing is written", look.label);
            let mem = self.mem(key);
            let first = mem.warn_once(msg);
            let after = mem.held(now);
            if first {
                self.plan_event(
                    key,
                    &look,
                    Reason::InvalidValue,
                    &format!("{e}; the plan is held and nothing is written"),
                );
            }
            return Action::After(after);
        }
        // The gate before a start: required preflight checks. A plan whose checks fail waits, as
        // a held plan does (looked at again with back-off), and its source shows why.
        let mut look = look;
        if matches!(decision, Decision::Run(RunPlan::Begin { .. })) && !look.preflight.is_empty() {
            let result = self.prober.preflight(&look.preflight).await;
            if !result.passed() {
                self.source.wait(key, &look, Wait::Preflight(&result)).await;
                let mem = self.mem(key);
                mem.warn_once(format!(
                    "{}: preflight checks failed ({}); the plan waits",
                    look.label,
                    result.failed_names()
                ));
                return Action::After(mem.held(now));
            }
            look.checked = Some(result);
        }
        {
            let mem = self.mem(key);
            if matches!(mem.standing, Standing::Held(_) | Standing::Bad(_)) {
                mem.standing = Standing::Clear;
            }
            mem.warned.clear();
            mem.due = look.retry_in.map(|d| now + d);
            if let Some(d) = look.retry_in.filter(|d| !d.is_zero()) {
                crate::board::retry(&look.label, d);
            }
            mem.probes = (!look.plan.plan.probes.is_empty()).then(|| Probes {
                checksum: look.checksum.clone(),
                id: id.clone(),
                label: look.label.clone(),
                probes: look.plan.plan.probes.clone(),
                statuses: look.probe_statuses.clone(),
            });
            if look.plan.plan.probes.is_empty() {
                mem.probe_health.clear();
            }
        }
        // A blocked plan (its leftovers could not be stopped) is looked at again: recovery runs
        // for it once more. Not while a value is invalid: then nothing is written (R3).
        if (self.mem(key).blocked.is_some() || self.blocked_all.is_some()) && !self.recheck_blocked(key).await {
            tracing::info!("{}: its leftovers are gone; the plan is no longer blocked", look.label);
        }
        if let Some(why) = self.mem(key).blocked_why().or_else(|| self.blocked_all.clone()) {
            self.mem(key).warn_once(format!("{}: not running: {why}", look.label));
            return self.probe(key).await;
        }
        match decision {
            Decision::Invalid(_) => Action::Wait,
            Decision::Observe => self.probe(key).await,
            Decision::Record { transition, partial_cancel } => {
                if partial_cancel {
                    tracing::warn!(
                        "{}: canceled after {}/{} instructions; the node may be left partly changed",
                        look.label,
                        transition.checkpoint.completed_instructions,
                        transition.checkpoint.total_instructions
                    );
                }
                tracing::info!("{}: {}", look.label, transition.state);
                let (state, checkpoint) = (transition.state.clone(), transition.checkpoint.clone());
                match self.source.commit(key, &look, &Commit::Record(transition)).await {
                    Written::Done => {
                        self.wrote(key);
                        count_recorded(&state);
                        if let Some(reason) = outcome_reason(&state, false) {
                            self.plan_event(key, &look, reason, &recorded_note(&look.view, &state, &checkpoint));
                        }
                        self.probe(key).await
                    }
                    Written::Abandoned => Action::After(Duration::ZERO),
                    Written::Failed { error, retry_after } => {
                        self.write_failed(key, &format!("{}: {state}", look.label), &error, retry_after)
                    }
                }
            }
            // A pass of periodic instructions alone (a succeeded plan, a legacy plan applied
            // already) with none due does nothing: no run, no write, the Lease left idle. Its
            // probes go on as an observed plan's; the loop looks again when one falls due.
            Decision::Run(run) if !run.one_time() && run.commit().is_none() => {
                match self.app.periodic_due_in(&look.plan.plan, &look.periodic_output) {
                    Some(d) if d.is_zero() => self.run_plan(key, &look, run).await,
                    due => match (self.probe(key).await, due) {
                        (Action::Wait, Some(d)) => Action::After(d),
                        (Action::After(a), Some(d)) => Action::After(a.min(d)),
                        (action, _) => action,
                    },
                }
            }
            Decision::Run(run) => self.run_plan(key, &look, run).await,
        }
    }

    /// Run the plan's probes when they are due and store their statuses.
    async fn probe(&mut self, key: &S::Key) -> Action {
        let Some(p) = self.probe_due(key) else { return Action::Wait };
        let statuses = self.prober.probe_all(&p.probes, &p.statuses, false).await;
        self.store_probes(key, p, statuses).await
    }

    /// The probes of `key` when they are due (and marks them taken for this period).
    fn probe_due(&mut self, key: &S::Key) -> Option<Probes> {
        let now = Instant::now();
        let period = self.source.probe_period(key);
        let mem = self.mem(key);
        if mem.next_probe.is_some_and(|t| now < t) {
            return None;
        }
        let p = mem.probes.clone()?;
        mem.next_probe = Some(now + period);
        Some(p)
    }

    /// Write probe statuses when they changed.
    async fn store_probes(&mut self, key: &S::Key, p: Probes, statuses: BTreeMap<String, ProbeStatus>) -> Action {
        self.mem(key).probe_health.set(&p.id, health(&statuses));
        if statuses == p.statuses {
            return Action::Wait;
        }
        match self.source.write_probes(key, &p.checksum, statuses.clone()).await {
            Written::Done => {
                self.wrote(key);
                if let Some(cached) = self.mem(key).probes.as_mut().filter(|c| c.checksum == p.checksum) {
                    cached.statuses = statuses;
                }
                Action::Wait
            }
            Written::Abandoned => Action::After(Duration::ZERO),
            Written::Failed { error, retry_after } => {
                self.mem(key).next_probe = None;
                self.write_failed(key, &format!("{}: probe statuses", p.label), &error, retry_after)
            }
        }
    }

    /// While `running` applies, the next other plan whose probes are due: when, and which.
    fn next_side_probe(&self, running: &S::Key) -> Option<(Instant, S::Key)> {
        self.memory
            .iter()
            .filter(|(k, m)| *k != running && m.probes.is_some() && m.gate().is_none_or(|g| g <= Instant::now()))
            .map(|(k, m)| (m.next_probe.unwrap_or_else(Instant::now), k.clone()))
            .min_by_key(|(t, _)| *t)
    }

    async fn run_plan(&mut self, key: &S::Key, look: &Look, run: RunPlan) -> Action {
        // R26: the Lease leaves margin to act (renewed first after a quiet while).
        if let Err(e) = self.source.fresh(key).await {
            return self.write_failed(key, &format!("the start of {}", look.label), &e, None);
        }
        // Commit the start (pending → in-progress) or the resume before anything runs.
        if let Some(commit) = run.commit() {
            match self.source.commit(key, look, &commit).await {
                Written::Done => {
                    self.wrote(key);
                    let total = look.plan.plan.instructions.len();
                    match &commit {
                        Commit::Begin { .. } => {
                            let note = format!(
                                "attempt {}: applying {}",
                                look.begin_attempt,
                                crate::count(total, "instruction")
                            );
                            self.plan_event(key, look, Reason::Started, &note);
                        }
                        Commit::Resume(_) => {
                            let from = (run.resume_from() + 1).min(total);
                            self.plan_event(
                                key,
                                look,
                                Reason::Resumed,
                                &format!("resuming at instruction {from}/{total}"),
                            );
                        }
                        Commit::Record(_) => {}
                    }
                }
                Written::Abandoned => return Action::After(Duration::ZERO),
                Written::Failed { error, retry_after } => {
                    return self.write_failed(key, &format!("the start of {}", look.label), &error, retry_after);
                }
            }
            // A pause or cancel that landed meanwhile takes effect before anything runs.
            let now = self.source.interrupt(key, look);
            if now.interrupt.pause || now.interrupt.cancel {
                return Action::After(Duration::ZERO);
            }
        }
        let total = look.plan.plan.instructions.len();
        if run.one_time() {
            match run.resume_from() {
                0 => tracing::info!("{}: applying ({})", look.label, crate::count(total, "instruction")),
                n => tracing::info!("{}: resuming at instruction {}/{total}", look.label, (n + 1).min(total)),
            }
        }
        if run.one_time() {
            crate::board::plan_started(&look.label);
        }
        let applied = self.apply(key, look, &run).await;
        crate::board::plan_ended();
        let result = match applied {
            Ok(r) => {
                let mem = self.mem(key);
                if matches!(mem.standing, Standing::NotStarted(..)) {
                    mem.standing = Standing::Clear;
                }
                r
            }
            Err(e) => {
                if let Some(w) = self.source.not_started(key, look, &e).await {
                    return match w {
                        Written::Done => Action::Wait,
                        Written::Abandoned => Action::After(Duration::ZERO),
                        Written::Failed { error, retry_after } => {
                            self.write_failed(key, &format!("{}: the failure", look.label), &error, retry_after)
                        }
                    };
                }
                // An apply that could not start (interlock, work directory) records nothing and is
                // retried with back-off; the plan keeps its state.
                let now = Instant::now();
                let (d, new) = self.mem(key).not_started(now, e.to_string());
                crate::board::retry(&look.label, d);
                tracing::error!("{}: {e}; retrying in {}", look.label, human_duration(d));
                // Whoever watches the object sees why nothing happens after "Started": once per
                // reason, not at every try.
                if new {
                    self.plan_event(
                        key,
                        look,
                        Reason::NotStarted,
                        &format!("cannot start: {e}; retrying with back-off"),
                    );
                }
                return Action::After(d);
            }
        };
        if let Some(why) = result.incomplete_reason() {
            tracing::error!("{}: {why}", look.label);
            self.mem(key).block(why.clone());
            self.source.set_blocked(key, Some(&why)).await;
            self.incomplete = Some(why);
        }
        if result.restart_requested && matches!(look.view, View::Legacy { .. }) && !result.one_time_succeeded {
            // The legacy checksum flow has no checkpoint: the restarted agent runs the plan again
            // from its first instruction (put the request in the last instruction there).
            tracing::warn!(
                "{}: restarting before the plan's last instruction; without a plan state (legacy flow) it runs again from its first",
                look.label
            );
            self.restart = true;
            return Action::Stop;
        }
        if result.interruption == Some(Interruption::Shutdown) {
            tracing::info!(
                "{}: stopped for shutdown; it runs again from its first instruction at the next start",
                look.label
            );
            return Action::Stop;
        }
        if result.interruption == Some(Interruption::Fenced) {
            if matches!(look.view, View::Legacy { .. }) || !run.one_time() {
                // Nothing to record: without a plan state (legacy flow) there is no checkpoint, and
                // a pass of periodic instructions alone has no boundary to keep.
                tracing::warn!("{}: stopped by the Lease's fence; it runs again once the Lease is renewed", look.label);
                return Action::Wait;
            }
            tracing::warn!(
                "{}: stopped by the Lease's fence after {}/{} instructions; that point is recorded and the plan goes on there",
                look.label,
                result.completed,
                look.plan.plan.instructions.len()
            );
        }
        // R11: the applyinator logs the warning for an interrupted instruction.
        let record = match &look.view {
            View::Flow(snap) => Some(flow::record(snap, &run, &result.ran())),
            View::Legacy { .. } => None,
        };
        if let Some(s) = record.as_ref().and_then(|r| r.state.as_ref()) {
            tracing::info!("{}: {s} ({}/{total} instructions)", look.label, result.completed);
        }
        let initial = run.one_time() && result.interruption.is_none();
        let due = self.mem(key).next_probe.is_none_or(|t| Instant::now() >= t);
        let probes = if !look.plan.plan.probes.is_empty() && (initial || due) {
            self.mem(key).next_probe = Some(Instant::now() + self.source.probe_period(key));
            Some(self.prober.probe_all(&look.plan.plan.probes, &look.probe_statuses, initial).await)
        } else {
            None
        };
        if let Some(statuses) = &probes {
            let mem = self.mem(key);
            let id = mem.id_of(look);
            mem.probe_health.set(&id, health(statuses));
        }
        let state = record.as_ref().and_then(|r| r.state.clone());
        // A succeeded plan's periodic pass stopped by a hold: the Event reads as that hold's when it
        // lands between passes (every one-time instruction had run).
        let said = match (&state, record.as_ref().map(|r| &r.checkpoint)) {
            (Some(s), Some(flow::CheckpointWrite::Set(c))) if !run.one_time() => Some(recorded_note(&look.view, s, c)),
            _ => None,
        };
        if result.restart_requested {
            self.restart_after_write = Some(key.clone());
        }
        // Counted once, when the run ends (a write that fails is kept and retried, not rerun).
        let recorded = state.clone().or_else(|| legacy_state(&look.view, &run, &result));
        if let Some(s) = &recorded {
            count_recorded(s);
        }
        let failure = match recorded {
            Some(crate::plan::PlanState::Failed) => result.failure(&look.plan, &look.checksum),
            _ => None,
        };
        let note = failure.as_ref().map(|f| f.note());
        let failed = failure.is_some();
        if let Some(s) = &recorded {
            let result = match (s, &failure) {
                (crate::plan::PlanState::Failed, Some(f)) => format!("failed: {}", f.summary()),
                _ => s.as_str().to_string(),
            };
            crate::board::outcome(&look.label, &result);
        }
        match self.source.record(key, look, Outcome { run: &run, record, result: &result, probes, failure }).await {
            (Written::Done, _) => {
                self.wrote(key);
                if let (Some(crate::plan::PlanState::Canceled), Some(seen)) = (&state, self.cancel_seen.take()) {
                    crate::metrics::cancel_recorded(seen.elapsed());
                }
                if let Some(s) = &state
                    && let Some(reason) = outcome_reason(s, result.termination_incomplete)
                {
                    let mut text =
                        said.clone().unwrap_or_else(|| format!("{s} ({}/{total} instructions)", result.completed));
                    if let Some(n) = &note {
                        text = format!("{text}: {n}");
                    }
                    self.plan_event(key, look, reason, &text);
                }
                if self.restart {
                    tracing::info!("{}: restarting the agent as asked, its progress recorded", look.label);
                    return Action::Stop;
                }
                // A failed plan is looked at again at once: its source says when it is retried,
                // and the loop (and `nodeplan status`) learn it now, not at the next change.
                if failed {
                    return Action::After(Duration::ZERO);
                }
                // Periodic instructions run again when the shortest of their periods has passed
                // (the applyinator runs those that are due), whatever the source's period.
                match look.plan.plan.periodic_instructions.iter().map(|p| p.period()).min() {
                    Some(d) => Action::After(d),
                    None => Action::Wait,
                }
            }
            (Written::Abandoned, _) => {
                tracing::info!("the plan changed before its outcome could be written; reconciling the new plan");
                if result.restart_requested {
                    self.restart = true;
                    return Action::Stop;
                }
                Action::After(Duration::ZERO)
            }
            (Written::Failed { error, retry_after }, keep) => {
                self.outcome_failed(key, keep, &format!("the outcome of {}", look.label), &error, retry_after)
            }
        }
    }

    /// While `running` applies: look at the other plans (a look only reads), so a plan that waits
    /// for the node says so where its source shows it (a NodePlan's `Waiting` condition, written
    /// through [`PlanSource::show`] only while that plan's fence is open) and in the log, once, as
    /// any held plan does. Nothing else of theirs happens before the run ends.
    async fn look_at_others(&mut self, running: &S::Key, running_label: &str, running_owner: &str) {
        for k in self.source.keys().await {
            if k == *running {
                continue;
            }
            let seen = self.source.look(&k).await;
            // Its fence may be closed (another source's Lease): then nothing of it is written.
            let open = *self.source.fence(&k).borrow();
            if open {
                self.source.show(&k).await;
            }
            match seen {
                Seen::Held(why) => {
                    self.mem(&k).warn_once(why);
                }
                Seen::Plan(other) => {
                    let starts = match &other.view {
                        View::Flow(snap) => matches!(flow::decide(snap), Decision::Run(r) if r.one_time()),
                        View::Legacy { one_time } => *one_time,
                    };
                    // Nothing is committed before its turn (no `in-progress` while it waits).
                    if !starts {
                        continue;
                    }
                    if open {
                        self.source.wait(&k, &other, Wait::Turn(running_owner)).await;
                    }
                    let line = format!("{}: waiting for {running_label} to finish (one plan at a time)", other.label);
                    if self.mem(&k).warned.insert(line.clone()) {
                        tracing::info!("{line}");
                    }
                }
                Seen::Nothing | Seen::Bad { .. } => {}
            }
        }
    }

    /// Run the applyinator (see [`Reconciler::run_apply`]), the source told that a plan of it
    /// executes meanwhile.
    async fn apply(&mut self, key: &S::Key, look: &Look, run: &RunPlan) -> Result<ApplyResult, ApplyError> {
        self.source.applying(key, true);
        let r = self.run_apply(key, look, run).await;
        self.source.applying(key, false);
        r
    }

    /// Run the applyinator, feeding it the pause/cancel values as the source reports them (R15)
    /// and shutdown.
    async fn run_apply(&mut self, key: &S::Key, look: &Look, run: &RunPlan) -> Result<ApplyResult, ApplyError> {
        let first = self.source.interrupt(key, look);
        self.cancel_seen = first.interrupt.cancel.then(Instant::now);
        let mut notes = HashSet::new();
        let note = |notes: &mut HashSet<String>, o: &Observed| {
            if let Some(n) = &o.note
                && notes.insert(n.clone())
            {
                tracing::warn!("{n}");
            }
        };
        note(&mut notes, &first);
        let (tx, rx) = watch::channel(Interrupt {
            shutdown: *self.shutdown.borrow(),
            fenced: !*self.source.fence(key).borrow(),
            ..first.interrupt
        });
        let saved = match (&look.view, run.resume_from()) {
            (View::Legacy { .. }, _) => look.one_time_output.clone(),
            (View::Flow(_), 0) => BTreeMap::new(),
            (View::Flow(_), _) => look.one_time_output.clone(),
        };
        let input = ApplyInput {
            plan: &look.plan,
            reconcile_files: run.one_time(),
            run_one_time: run.one_time(),
            attempt: if matches!(run, RunPlan::Begin { .. }) { look.begin_attempt } else { look.attempt },
            resume_from: run.resume_from(),
            one_time_output: saved,
            periodic_output: look.periodic_output.clone(),
            run_periodic: true,
            interrupts: rx,
            owner: self.source.owner(key, look),
            observer: Arc::new(LogObserver),
        };
        let input_owner = input.owner.short();
        let app = self.app.clone();
        let mut apply = std::pin::pin!(app.apply(input));
        let mut shutdown = self.shutdown.clone();
        let (mut fence, mut fence_alive) = (self.source.fence(key), true);
        let mut polled = self.source.polled(key);
        let mut deadline = look.stop_after.map(|d| Instant::now() + d);
        let mut poll = tokio::time::interval(Duration::from_secs(1));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut source_alive, mut shutdown_alive) = (true, true);
        // Other plans' probes keep running while this one applies (one at a time).
        let mut side: Option<SideProbe<S::Key>> = None;
        // When the other plans are looked at next (after a change, at most once a second).
        let mut others: Option<Instant> = None;
        let mut others_last = Instant::now();
        loop {
            let next_side = if side.is_none() { self.next_side_probe(key) } else { None };
            // Biased: what the source, shutdown or the fence say is delivered before the run is
            // polled again, so an instruction that ends while a pause or cancel waits to be read
            // never lets the next one start (R5, R7) however the two wake-ups are ordered.
            let deliver = tokio::select! {
                biased;
                r = shutdown.changed(), if shutdown_alive => {
                    shutdown_alive = r.is_ok();
                    if shutdown_alive && *shutdown.borrow() {
                        tx.send_if_modified(|i| !std::mem::replace(&mut i.shutdown, true));
                    }
                    false
                }
                r = fence.changed(), if fence_alive => {
                    fence_alive = r.is_ok();
                    let fenced = !*fence.borrow();
                    if tx.send_if_modified(|i| std::mem::replace(&mut i.fenced, fenced) != fenced) && fenced {
                        tracing::warn!(
                            "{}: this agent's Lease is not renewed in time: stopping the running instruction; the progress is recorded and the plan goes on there once the Lease is renewed",
                            look.label
                        );
                    }
                    false
                }
                alive = self.source.changed(), if source_alive => {
                    source_alive = alive;
                    if !alive {
                        // A source ended (its gate: another agent acts on it now): the agent stops
                        // as a whole, the running plan as at a shutdown.
                        self.ended = true;
                        tx.send_if_modified(|i| !std::mem::replace(&mut i.shutdown, true));
                    }
                    self.dirty = true;
                    others.get_or_insert(others_last + Duration::from_secs(1));
                    true
                }
                _ = poll.tick(), if polled => true,
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                    deadline = None;
                    polled = true;
                    true
                }
                r = &mut apply => return r,
                _ = tokio::time::sleep_until(next_side.as_ref().map_or_else(Instant::now, |(t, _)| *t)),
                    if next_side.is_some() =>
                {
                    if let Some((_, k)) = next_side
                        && let Some(p) = self.probe_due(&k)
                    {
                        let prober = self.prober.clone();
                        side = Some(Box::pin(async move {
                            let statuses = prober.probe_all(&p.probes, &p.statuses, false).await;
                            (k, p, statuses)
                        }));
                    }
                    false
                }
                (k, p, statuses) = async {
                    match side.as_mut() {
                        Some(f) => f.await,
                        None => std::future::pending().await,
                    }
                } => {
                    side = None;
                    self.store_probes(&k, p, statuses).await;
                    false
                }
                _ = tokio::time::sleep_until(others.unwrap_or_else(Instant::now)), if others.is_some() => {
                    others = None;
                    others_last = Instant::now();
                    self.look_at_others(key, &look.label, &input_owner).await;
                    false
                }
            };
            if deliver {
                let o = self.source.interrupt(key, look);
                if o.interrupt.cancel && self.cancel_seen.is_none() {
                    self.cancel_seen = Some(Instant::now());
                }
                note(&mut notes, &o);
                crate::apply::update_interrupt(&tx, o.interrupt, &look.label);
            }
        }
    }
}
