//! The loop driven through an in-memory plan source holding several plans, with the real
//! applyinator and supervisor running `sh`: pause, resume, cancel, an invalid value, a crash in
//! the middle of a run and the recovery after it. The source below is the whole of what a new
//! plan source has to provide; nothing in the loop knows about it.

use super::gate::{Gate, GateState, Gated};
use super::*;
use crate::apply::ApplyConfig;
use crate::flow::{CheckpointWrite, Snapshot};
use crate::plan::{Annotations, Checkpoint, PlanState, resolve_annotations};
use crate::process::{CgroupMode, Source, StopPolicy, Supervisor, SupervisorConfig};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use tokio::sync::Notify;

/// Long enough for anything here to happen on a loaded machine; a test that waits this long fails.
const GUARD: Duration = Duration::from_secs(60);

/// One plan as the in-memory store keeps it.
#[derive(Debug, Clone)]
struct Stored {
    plan: ValidPlan,
    checksum: String,
    state: PlanState,
    checkpoint: Option<Checkpoint>,
    paused: Option<String>,
    canceled: Option<String>,
    outputs: BTreeMap<String, Vec<u8>>,
    failures: i64,
    blocked: Option<String>,
    probes: BTreeMap<String, ProbeStatus>,
    periodic: BTreeMap<String, crate::plan::PeriodicInstructionOutput>,
    /// Writes of this plan.
    writes: u64,
    /// Every state written, in order.
    history: Vec<PlanState>,
    /// A failed plan's retry: shown `pending` from then on (before it, the look says how long).
    retry_at: Option<Instant>,
    /// Checks before a start, what they found when it began, and every wait shown.
    preflight: Vec<crate::plan::Preflight>,
    checked: Option<PreflightResult>,
    waits: Vec<String>,
}

#[derive(Default)]
struct Store {
    plans: Mutex<BTreeMap<String, Stored>>,
    /// Wakes the loop (the source's change notification).
    changed: Notify,
    /// Bumped on every write and every look (the test's handshakes: it waits for the loop's
    /// steps, never for time).
    writes: watch::Sender<u64>,
    looks: watch::Sender<u64>,
    /// Calls of `show` (what a look found to show, written when the loop asks).
    shows: watch::Sender<u64>,
    /// Calls of `restored` (the loop asks for an outcome a previous agent kept).
    restores: std::sync::atomic::AtomicU64,
    freshes: std::sync::atomic::AtomicU64,
    /// Runs begun (`applying(true)`).
    applies: std::sync::atomic::AtomicU64,
    /// How long each look takes, in turn, before it reads the plan (a slow API server).
    look_delays: Mutex<std::collections::VecDeque<Duration>>,
    /// When each start was committed.
    begun: Mutex<Vec<Instant>>,
    /// The events told, as `reason: note`.
    events: Mutex<Vec<String>>,
    /// `looks` when the last write was made.
    looks_at_write: std::sync::atomic::AtomicU64,
    /// Faults: the producer pauses the plan the moment its start is written; outcomes cannot be
    /// written (as when an API server is down) and the store asks for an hour before a retry.
    pause_on_begin: AtomicBool,
    down: AtomicBool,
    /// Attempts to write an outcome while down.
    refused: watch::Sender<u64>,
    /// The loop's passes over the plans.
    passes: watch::Sender<u64>,
}

/// The in-memory source: keys are plan names; its period.
struct MemSource(Arc<Store>, Duration);

const OWNER: &str = "mem:";

impl MemSource {
    fn write(&self, name: &str, f: impl FnOnce(&mut Stored)) -> Written {
        let mut plans = self.0.plans.lock().unwrap();
        let Some(p) = plans.get_mut(name) else { return Written::Abandoned };
        let before = p.state.clone();
        f(p);
        p.writes += 1;
        if p.state != before {
            let s = p.state.clone();
            p.history.push(s);
        }
        drop(plans);
        self.0.looks_at_write.store(*self.0.looks.borrow(), SeqCst);
        self.0.writes.send_modify(|n| *n += 1);
        Written::Done
    }
}

impl PlanSource for MemSource {
    type Key = String;
    type Kept = flow::Record;

    async fn changed(&mut self) -> bool {
        self.0.changed.notified().await;
        true
    }

    async fn keys(&mut self) -> Vec<String> {
        self.0.passes.send_modify(|n| *n += 1);
        self.0.plans.lock().unwrap().keys().cloned().collect()
    }

    async fn show(&mut self, _name: &String) {
        self.0.shows.send_modify(|n| *n += 1);
    }

    async fn restored(&mut self, _name: &String) -> Option<flow::Record> {
        self.0.restores.fetch_add(1, SeqCst);
        None
    }

    async fn fresh(&mut self, _name: &String) -> Result<(), String> {
        self.0.freshes.fetch_add(1, SeqCst);
        Ok(())
    }

    async fn wait(&mut self, name: &String, _: &Look, why: Wait<'_>) {
        let shown = match why {
            Wait::Turn(owner) => format!("turn: {owner}"),
            Wait::Preflight(r) => format!("preflight: {}", r.failed_names()),
        };
        self.write(name, |p| p.waits.push(shown));
    }

    async fn look(&mut self, name: &String) -> Seen {
        self.0.looks.send_modify(|n| *n += 1);
        let delay = self.0.look_delays.lock().unwrap().pop_front();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let Some(mut p) = self.0.plans.lock().unwrap().get(name).cloned() else { return Seen::Nothing };
        let mut retry_in = None;
        if let Some(t) = p.retry_at.filter(|_| p.state == PlanState::Failed) {
            let now = Instant::now();
            match t.checked_duration_since(now).filter(|d| !d.is_zero()) {
                Some(d) => retry_in = Some(d),
                None => p.state = PlanState::Pending,
            }
        }
        let hold = resolve_annotations(&Annotations { paused: p.paused.as_deref(), canceled: p.canceled.as_deref() });
        let snap = Snapshot {
            checksum: p.checksum.clone(),
            state: p.state.clone(),
            hold,
            checkpoint: p.checkpoint.clone(),
            total: p.plan.plan.instructions.len(),
        };
        Seen::Plan(Box::new(Look {
            label: format!("plan {name}"),
            place: format!("memory {name}"),
            plan: p.plan,
            checksum: p.checksum,
            view: View::Flow(snap),
            attempt: p.failures + 1,
            begin_attempt: p.failures + 1,
            one_time_output: p.outputs,
            periodic_output: p.periodic,
            probe_statuses: p.probes,
            retry_in,
            stop_after: None,
            preflight: p.preflight,
            checked: None,
        }))
    }

    async fn commit(&mut self, name: &String, look: &Look, commit: &Commit) -> Written {
        let w = self.write(name, |p| {
            p.state = commit.state();
            p.checkpoint = commit.checkpoint().cloned();
            if matches!(commit, Commit::Begin { .. }) {
                p.checked = look.checked.clone();
            }
        });
        if matches!(commit, Commit::Begin { .. }) {
            self.0.begun.lock().unwrap().push(Instant::now());
        }
        if matches!(commit, Commit::Begin { .. }) && self.0.pause_on_begin.load(SeqCst) {
            self.write(name, |p| p.paused = Some("true".into()));
        }
        w
    }

    async fn record(&mut self, name: &String, _: &Look, outcome: Outcome<'_>) -> Sent<flow::Record> {
        let Some(r) = outcome.record else { return (Written::Done, None) };
        if let Some(s) = outcome.probes {
            self.write(name, |p| p.probes = s);
        }
        self.resend(name, r).await
    }

    async fn not_started(&mut self, _: &String, _: &Look, _: &ApplyError) -> Option<Written> {
        None
    }

    async fn write_probes(&mut self, name: &String, _: &str, statuses: BTreeMap<String, ProbeStatus>) -> Written {
        self.write(name, |p| p.probes = statuses)
    }

    async fn resend(&mut self, name: &String, r: flow::Record) -> Sent<flow::Record> {
        if self.0.down.load(SeqCst) {
            self.0.refused.send_modify(|n| *n += 1);
            return (Written::Failed { error: "down".into(), retry_after: Some(Duration::from_secs(3600)) }, Some(r));
        }
        let w = self.write(name, |p| {
            if let Some(s) = r.state {
                p.state = s;
            }
            match r.checkpoint {
                CheckpointWrite::Keep => {}
                CheckpointWrite::Clear => p.checkpoint = None,
                CheckpointWrite::Set(c) => p.checkpoint = Some(c),
            }
            if r.succeeded == Some(false) {
                p.failures += 1;
            }
            if let Some(o) = r.one_time_output {
                p.outputs = o;
            }
            if let Some(o) = r.periodic_output {
                p.periodic = o;
            }
        });
        (w, None)
    }

    async fn set_blocked(&mut self, name: &String, why: Option<&str>) {
        self.write(name, |p| p.blocked = why.map(str::to_string));
    }

    fn interrupt(&mut self, name: &String, _: &Look) -> Observed {
        let plans = self.0.plans.lock().unwrap();
        let Some(p) = plans.get(name) else { return Observed::default() };
        let valid = |v: &Option<String>| crate::plan::parse_annotation_value(v.as_deref()) == Ok(true);
        Observed {
            interrupt: Interrupt { pause: valid(&p.paused), cancel: valid(&p.canceled), ..Interrupt::default() },
            note: None,
        }
    }

    fn owner(&self, name: &String, _: &Look) -> Owner {
        // The store's plans are named like local plans (any text works as a local id).
        Owner::new(Source::Local, format!("{OWNER}{name}"))
    }

    fn claim(&self, owner: &Owner) -> Claim<String> {
        match owner.local_plan() {
            Some(p) => match p.to_str().and_then(|p| p.strip_prefix(OWNER)) {
                Some(name) => Claim::Plan(name.to_string()),
                None => Claim::NotMine,
            },
            None if owner.belongs_to(Source::Local) => Claim::Unknown,
            None => Claim::NotMine,
        }
    }

    fn period(&self) -> Duration {
        self.1
    }

    fn applying(&self, _: &String, on: bool) {
        if on {
            self.0.applies.fetch_add(1, SeqCst);
        }
    }

    fn event(&mut self, _: &String, reason: Reason, note: &str) {
        self.0.events.lock().unwrap().push(format!("{reason:?}: {note}"));
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    store: Arc<Store>,
    app: Arc<Applyinator>,
    /// [`Flaky`]'s switches: its next write is abandoned; it sees no plan.
    abandon: Arc<std::sync::atomic::AtomicBool>,
    vanish: Arc<std::sync::atomic::AtomicBool>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sup = Supervisor::new(SupervisorConfig {
        policy: StopPolicy { grace: Duration::from_secs(5), kill_timeout: Duration::from_secs(5), kill: true },
        cgroup: CgroupMode::Auto,
        pid_dir: Some(dir.path().join("pids")),
        ..Default::default()
    });
    let app = Arc::new(Applyinator::new(ApplyConfig::new(dir.path().join("work")), sup));
    Fixture { dir, store: Arc::new(Store::default()), app, abandon: Default::default(), vanish: Default::default() }
}

impl Fixture {
    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    fn fifo(&self, name: &str) -> String {
        let p = self.path(name);
        let c = CString::new(p.clone()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        p
    }

    /// Add a plan of `sh -c` instructions, as `pending`.
    fn add(&self, name: &str, scripts: &[&str]) {
        self.add_with(name, scripts, serde_json::json!({}));
    }

    /// Add a plan of `sh -c` instructions and these probes, as `pending`.
    fn add_with(&self, name: &str, scripts: &[&str], probes: serde_json::Value) {
        self.add_plan(name, scripts, serde_json::json!({ "probes": probes }));
    }

    /// Add a plan of `sh -c` instructions and the other fields of `more`, as `pending`.
    fn add_plan(&self, name: &str, scripts: &[&str], mut more: serde_json::Value) {
        let ins: Vec<serde_json::Value> = scripts
            .iter()
            .enumerate()
            .map(|(i, s)| serde_json::json!({"name": format!("{name}{}", i + 1), "command": "sh", "args": ["-c", s]}))
            .collect();
        more["instructions"] = serde_json::Value::Array(ins);
        let raw = serde_json::to_vec(&more).unwrap();
        let stored = Stored {
            plan: crate::plan::parse(&raw).unwrap(),
            checksum: crate::plan::checksum(&raw),
            state: PlanState::Pending,
            checkpoint: None,
            paused: None,
            canceled: None,
            outputs: BTreeMap::new(),
            failures: 0,
            blocked: None,
            probes: BTreeMap::new(),
            periodic: BTreeMap::new(),
            writes: 0,
            history: Vec::new(),
            retry_at: None,
            preflight: Vec::new(),
            checked: None,
            waits: Vec::new(),
        };
        self.store.plans.lock().unwrap().insert(name.to_string(), stored);
    }

    /// Change a plan as its producer would, and tell the loop.
    fn set(&self, name: &str, f: impl FnOnce(&mut Stored)) {
        f(self.store.plans.lock().unwrap().get_mut(name).unwrap());
        self.store.changed.notify_one();
    }

    fn get(&self, name: &str) -> Stored {
        self.store.plans.lock().unwrap()[name].clone()
    }

    /// Wait until the source has written `name` into a state where `pred` holds.
    /// The guard is real time (a detached thread's sleep), so it also holds in the tests that run
    /// on tokio's paused clock while real processes work.
    async fn until(&self, name: &str, what: &str, pred: impl Fn(&Stored) -> bool) -> Stored {
        let mut writes = self.store.writes.subscribe();
        let (tx, mut guard) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            std::thread::sleep(GUARD);
            let _ = tx.send(());
        });
        loop {
            let p = self.get(name);
            if pred(&p) {
                return p;
            }
            tokio::select! {
                r = writes.changed() => r.unwrap(),
                _ = &mut guard => panic!("plan {name} never became {what}: {:?}", self.get(name)),
            }
        }
    }

    /// Wake the loop and wait until it has looked at every plan again.
    async fn look_again(&self) {
        let mut looks = self.store.looks.subscribe();
        let want = *looks.borrow_and_update() + self.store.plans.lock().unwrap().len() as u64;
        self.store.changed.notify_one();
        tokio::time::timeout(GUARD, looks.wait_for(|n| *n >= want)).await.expect("the loop looked again").unwrap();
    }

    /// Wake the loop and wait until it has gone over its plans once more.
    async fn pass_again(&self) {
        let mut passes = self.store.passes.subscribe();
        let want = *passes.borrow_and_update() + 1;
        self.store.changed.notify_one();
        tokio::time::timeout(GUARD, passes.wait_for(|n| *n >= want))
            .await
            .expect("the loop went over its plans")
            .unwrap();
    }

    fn start(&self) -> (watch::Sender<bool>, tokio::task::JoinHandle<(AgentExit, MemSource)>) {
        self.start_every(Duration::from_secs(3600))
    }

    /// Start the loop with this probe (and look) period.
    fn start_every(&self, period: Duration) -> (watch::Sender<bool>, tokio::task::JoinHandle<(AgentExit, MemSource)>) {
        let (tx, rx) = watch::channel(false);
        let source = MemSource(self.store.clone(), period);
        let r = Reconciler::new(source, self.app.clone(), Arc::new(Prober::new()), rx);
        (tx, tokio::spawn(r.run()))
    }

    /// Start the loop behind an open gate whose fence the test moves: the fence, the stop switch
    /// and the loop's task.
    fn start_fenced(&self) -> (watch::Sender<bool>, watch::Sender<bool>, FencedLoop) {
        let (fence_tx, fence) = watch::channel(true);
        let (stop, rx) = watch::channel(false);
        let (_state_tx, gate) = watch::channel(GateState::Open);
        let (task_stop, task) = (tokio::sync::oneshot::channel().0, tokio::spawn(async {}));
        let source = MemSource(self.store.clone(), Duration::from_secs(3600));
        let source = Gated::new(source, Gate::new(gate, fence, task_stop, task));
        let r = Reconciler::new(source, self.app.clone(), Arc::new(Prober::new()), rx);
        (fence_tx, stop, tokio::spawn(r.run()))
    }
}

type FencedLoop = tokio::task::JoinHandle<(AgentExit, Gated<MemSource>)>;

/// Stop the loop and wait for its end: how it ended, and its source.
async fn stopped<S>(stop: watch::Sender<bool>, agent: tokio::task::JoinHandle<(AgentExit, S)>) -> (AgentExit, S) {
    stop.send(true).unwrap();
    tokio::time::timeout(GUARD, agent).await.expect("the loop stopped").unwrap()
}

/// Wait until an instruction opens `fifo` for writing (it is running).
async fn running(fifo: &str) {
    let f = fifo.to_string();
    let read = tokio::task::spawn_blocking(move || std::fs::read(f));
    tokio::time::timeout(GUARD, read).await.expect("the instruction never ran").unwrap().unwrap();
}

/// Let an instruction blocked on `gate` go on.
async fn open(gate: &str) {
    let g = gate.to_string();
    tokio::task::spawn_blocking(move || std::fs::write(g, b"go\n")).await.unwrap().unwrap();
}

fn lines(path: &str) -> usize {
    std::fs::read_to_string(path).map(|s| s.lines().count()).unwrap_or(0)
}

fn alive(pid: i32) -> bool {
    // Signal 0 checks existence; a zombie of ours would still count, so reap-free processes only.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_plans_one_at_a_time_through_pause_resume_and_cancel() {
    let fx = fixture();
    let (ready, gate, log) = (fx.fifo("a-ready"), fx.fifo("a-gate"), fx.path("log"));
    fx.add(
        "a",
        &[
            &format!("echo a1 >> {log}"),
            &format!("echo a2 >> {log}; echo > {ready}; read x < {gate}"),
            &format!("echo a3 >> {log}"),
        ],
    );
    fx.add("b", &[&format!("echo b1 >> {log}")]);
    let (c_ready, c_pid) = (fx.fifo("c-ready"), fx.path("c-pid"));
    fx.add("c", &[&format!("echo $$ > {c_pid}; echo > {c_ready}; exec sleep 300"), "true"]);
    let (stop, agent) = fx.start();

    // `a` runs first; nothing else runs while it does.
    running(&ready).await;
    assert_eq!(fx.get("a").state, PlanState::InProgress);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a1\na2\n", "b waits for a");
    // Pause while instruction 2 runs: it finishes, nothing new starts (R5).
    fx.set("a", |p| p.paused = Some("true".into()));
    open(&gate).await;
    let a = fx.until("a", "paused", |p| p.state == PlanState::Paused).await;
    let cp = a.checkpoint.expect("a paused plan has a checkpoint");
    assert_eq!((cp.completed_instructions, cp.total_instructions, cp.paused), (2, 3, true));
    // The loop goes on with the other plans while `a` is paused.
    fx.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    running(&c_ready).await;
    let pid: i32 = std::fs::read_to_string(&c_pid).unwrap().trim().parse().unwrap();
    // Cancel: the running tree goes through the stop ladder at once (R7).
    fx.set("c", |p| p.canceled = Some("true".into()));
    let c = fx.until("c", "canceled", |p| p.state == PlanState::Canceled).await;
    assert!(!alive(pid), "the canceled instruction is stopped");
    assert_eq!(c.checkpoint.map(|c| c.completed_instructions), Some(0));
    // Resume `a`: only instruction 3 runs.
    fx.set("a", |p| p.paused = None);
    let a = fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a1\na2\nb1\na3\n");
    assert_eq!(
        a.history,
        [PlanState::InProgress, PlanState::Paused, PlanState::InProgress, PlanState::Succeeded],
        "every state change is written once"
    );
    assert_eq!(a.checkpoint, None, "a finished plan keeps no checkpoint");
    // Cancel is terminal (R8): looking again changes nothing.
    fx.set("c", |p| p.canceled = None);
    fx.look_again().await;
    let (exit, _) = stopped(stop, agent).await;
    assert_eq!(exit, AgentExit::Clean);
    assert_eq!(fx.get("c").history, [PlanState::InProgress, PlanState::Canceled]);
}

/// R26: a closed fence (the Lease not renewed in time, or not yet this agent's for certain)
/// stops the running instruction and records the boundary as a restart point; nothing starts
/// while it stays closed, and once it opens the plan goes on after its finished instructions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_fence_stops_at_a_recorded_boundary_and_nothing_starts_until_it_opens() {
    let fx = fixture();
    let (ready, pid, log) = (fx.fifo("ready"), fx.path("pid"), fx.path("log"));
    fx.add(
        "a",
        &[
            &format!("echo a1 >> {log}"),
            &format!("echo a2 >> {log}; [ -e {pid} ] && exit 0; echo $$ > {pid}; echo > {ready}; exec sleep 300"),
            &format!("echo a3 >> {log}"),
        ],
    );
    let (fence_tx, stop, agent) = fx.start_fenced();
    running(&ready).await;
    let long: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();

    fence_tx.send(false).unwrap();
    let a = fx.until("a", "its boundary recorded", |p| p.checkpoint.is_some()).await;
    assert!(!alive(long), "the running instruction is stopped");
    assert_eq!(a.state, PlanState::InProgress, "not a pause: Rancher's states are left alone");
    let cp = a.checkpoint.unwrap();
    assert_eq!((cp.completed_instructions, cp.total_instructions, cp.paused), (1, 3, true));
    assert_eq!(cp.resume_state, Some(PlanState::InProgress));
    // Closed: the loop goes over its plans and starts or writes nothing.
    fx.pass_again().await;
    let writes = fx.get("a").writes;
    fx.pass_again().await;
    assert_eq!(fx.get("a").writes, writes, "nothing is committed while the fence is closed");
    assert_eq!(lines(&log), 2);

    // Open: the plan goes on at instruction 2 (the one stopped; it does not block the second
    // time), never running 1 again.
    fence_tx.send(true).unwrap();
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a1\na2\na2\na3\n");
    let (exit, _) = stopped(stop, agent).await;
    assert_eq!(exit, AgentExit::Clean);
}

/// R26: a fence that opens again while the instruction it stopped is still on its way out (a
/// renewal landed during the stop ladder) leaves a fenced stop, not a shutdown: the boundary is
/// recorded and the plan goes on there, and the agent keeps running. (Before, the stop read as the
/// agent's own shutdown: nothing recorded, and the loop ended as if told to stop.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_that_opens_again_during_the_stop_leaves_a_recorded_boundary() {
    let fx = fixture();
    let (ready, stopping, go, log) = (fx.fifo("ready"), fx.fifo("stopping"), fx.fifo("go"), fx.path("log"));
    let once = fx.path("once");
    fx.add(
        "a",
        &[
            &format!("echo a1 >> {log}"),
            &format!(
                "echo a2 >> {log}; [ -e {once} ] && exit 0; : > {once}; \
                 trap 'echo > {stopping}; read x < {go}; exit 1' TERM; echo > {ready}; sleep 300 & wait"
            ),
            &format!("echo a3 >> {log}"),
        ],
    );
    let (fence_tx, stop, agent) = fx.start_fenced();
    running(&ready).await;
    fence_tx.send(false).unwrap();
    running(&stopping).await;
    fence_tx.send(true).unwrap();
    open(&go).await;
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a1\na2\na2\na3\n", "resumed at the stopped instruction");
    assert!(!agent.is_finished(), "the loop goes on");
    let (exit, _) = stopped(stop, agent).await;
    assert_eq!(exit, AgentExit::Clean);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_value_holds_its_plan_without_a_write_and_others_run() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    fx.add("b", &[&format!("echo b >> {log}")]);
    fx.set("a", |p| p.paused = Some("yes".into()));
    let (stop, agent) = fx.start();
    fx.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    // Looked at again (a change): still held, still nothing written (R3).
    fx.set("a", |p| p.canceled = Some("maybe".into()));
    fx.look_again().await;
    fx.look_again().await;
    let a = fx.get("a");
    assert_eq!((a.writes, a.state), (0, PlanState::Pending), "nothing is written while a value is invalid");
    fx.set("a", |p| {
        p.paused = Some("false".into());
        p.canceled = None;
    });
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(fx.get("a").history, [PlanState::InProgress, PlanState::Succeeded]);
    assert_eq!(lines(&log), 2);
    stopped(stop, agent).await;
}

/// A crash in the middle of a run (the loop's task is dropped: its child keeps running, its PID
/// record stays, the plan stays in-progress), then a new loop over the same store: the leftover is
/// stopped before the plan runs again from its first instruction (R17), and a shutdown while it
/// runs leaves it in-progress for the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_run_is_recovered_before_the_plan_runs_again() {
    let fx = fixture();
    let (ready, starts, pid_file) = (fx.fifo("ready"), fx.path("starts"), fx.path("pid"));
    fx.add("d", &[&format!("echo start >> {starts}; echo $$ > {pid_file}; echo > {ready}; exec sleep 300")]);
    let (_stop, first) = fx.start();
    running(&ready).await;
    let leftover: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    first.abort();
    assert!(first.await.is_err_and(|e| e.is_cancelled()));
    assert!(alive(leftover), "the instruction outlives the crashed loop");
    assert_eq!(fx.get("d").state, PlanState::InProgress);

    let (stop, second) = fx.start();
    running(&ready).await;
    assert!(!alive(leftover), "the leftover was stopped before the re-run");
    assert_eq!(lines(&starts), 2);
    let (exit, _) = stopped(stop, second).await;
    assert_eq!(exit, AgentExit::Clean);
    let d = fx.get("d");
    assert_eq!((d.state, d.history), (PlanState::InProgress, vec![PlanState::InProgress]));
    assert!(std::fs::read_dir(fx.dir.path().join("pids")).unwrap().next().is_none(), "no PID records left");
}

/// A run that failed is looked at again at once, without a change: its source says there when it
/// is retried (a local plan's schedule), which `nodeplan status` shows beside the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_is_looked_at_again_at_once() {
    let fx = fixture();
    let mut looks = fx.store.looks.subscribe();
    fx.add("f", &["true", "exit 3"]);
    let (stop, run) = fx.start();
    fx.until("f", "failed", |p| p.state == PlanState::Failed).await;
    let at_write = fx.store.looks_at_write.load(SeqCst);
    tokio::time::timeout(GUARD, looks.wait_for(|n| *n > at_write))
        .await
        .expect("the failed plan was not looked at again (the next look waits for a change or the hour's period)")
        .unwrap();
    assert_eq!(fx.get("f").history, [PlanState::InProgress, PlanState::Failed], "looked at, not run again");
    stopped(stop, run).await;
}

/// A pause that lands while the start is being written takes effect before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_landing_with_the_start_runs_nothing() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    // The producer's pause lands right after the start is written: the pause wins.
    fx.store.pause_on_begin.store(true, SeqCst);
    let (stop, agent) = fx.start();
    let a = fx.until("a", "paused", |p| p.state == PlanState::Paused).await;
    assert_eq!(a.checkpoint.map(|c| (c.completed_instructions, c.paused)), Some((0, true)));
    assert_eq!(lines(&log), 0, "nothing ran");
    stopped(stop, agent).await;
}

/// The loop's gate before a start: a plan whose required preflight check fails is not started
/// (nothing committed, nothing run) and its source is told why it waits; once the check passes
/// it begins, and the start carries what the checks found (an optional check that failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_waits_for_its_required_preflight_checks() {
    let fx = fixture();
    let (log, needed) = (fx.path("log"), fx.path("needed"));
    fx.add("a", &[&format!("echo a >> {log}")]);
    let check = |name: &str, path: &str, required: bool| crate::plan::Preflight {
        name: name.into(),
        probe: serde_json::from_value(serde_json::json!({"fileExists": {"path": path}})).unwrap(),
        required,
    };
    let missing = fx.path("never");
    fx.set("a", |p| p.preflight = vec![check("needed", &needed, true), check("nice", &missing, false)]);
    let (stop, agent) = fx.start();
    let a = fx.until("a", "shown waiting", |p| !p.waits.is_empty()).await;
    assert!(a.waits.iter().all(|w| w == "preflight: needed"), "{:?}", a.waits);
    assert_eq!((a.state, a.history.len(), lines(&log)), (PlanState::Pending, 0, 0), "nothing committed or run");
    std::fs::write(&needed, b"").unwrap();
    fx.set("a", |_| {});
    let a = fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(lines(&log), 1);
    let checked = a.checked.expect("the start carries what the checks found");
    assert!(checked.passed() && checked.optional_failed.len() == 1, "{checked:?}");
    assert_eq!(checked.optional_failed[0].0, "nice");
    stopped(stop, agent).await;
}

/// While one plan applies, another that would start is told it waits for its turn, naming the
/// running plan's owner, and keeps its state until the first one ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_that_would_start_meanwhile_is_shown_waiting_for_its_turn() {
    let fx = fixture();
    let (ready, gate) = (fx.fifo("ready"), fx.fifo("gate"));
    fx.add("a", &[&format!("echo > {ready}; cat {gate} > /dev/null")]);
    let (stop, agent) = fx.start();
    running(&ready).await;
    fx.add("b", &["true"]);
    fx.set("b", |_| {});
    let b = fx.until("b", "shown waiting", |p| !p.waits.is_empty()).await;
    assert!(b.waits.iter().all(|w| *w == format!("turn: local:{OWNER}a")), "{:?}", b.waits);
    assert_eq!(b.state, PlanState::Pending, "nothing committed while it waits");
    open(&gate).await;
    let b = fx.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(b.history, [PlanState::InProgress, PlanState::Succeeded]);
    assert_eq!(fx.get("a").state, PlanState::Succeeded);
    stopped(stop, agent).await;
}

/// An HTTP server answering every request with the status in `code`.
async fn http_server(code: Arc<std::sync::atomic::AtomicU16>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let code = code.load(std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let reply = format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    port
}

/// R10 with several plans: one plan's probes keep running, and their statuses keep being written,
/// while another plan applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_of_other_plans_keep_running_while_one_applies() {
    let fx = fixture();
    let code = Arc::new(std::sync::atomic::AtomicU16::new(200));
    let port = http_server(code.clone()).await;
    let probe = serde_json::json!({"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")},
        "successThreshold": 1, "failureThreshold": 1}});
    fx.add_with("a", &[], probe);
    let (ready, gate) = (fx.fifo("ready"), fx.fifo("gate"));
    fx.add("b", &[&format!("echo > {ready}; read x < {gate}")]);
    let (stop, agent) = fx.start_every(Duration::from_millis(200));
    let healthy = |p: &Stored| p.probes.get("web").is_some_and(|w| w.healthy);
    fx.until("a", "healthy", healthy).await;
    running(&ready).await;
    code.store(500, std::sync::atomic::Ordering::SeqCst);
    fx.until("a", "unhealthy while b runs", |p| p.probes.get("web").is_some_and(|w| !w.healthy)).await;
    assert_eq!(fx.get("b").state, PlanState::InProgress, "b is still running");
    code.store(200, std::sync::atomic::Ordering::SeqCst);
    fx.until("a", "healthy again while b runs", healthy).await;
    assert_eq!(fx.get("b").state, PlanState::InProgress, "b is still running");
    open(&gate).await;
    fx.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    stopped(stop, agent).await;
}

/// An outcome that cannot be written is kept, retried only after its back-off (here the store's
/// own hint: an hour) however often the loop wakes, and at once when the source reports a change
/// (its watch is back): it never waits for the timer after an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_outcome_lands_as_soon_as_the_source_is_back() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    fx.store.down.store(true, SeqCst);
    let (stop, agent) = fx.start_every(Duration::from_millis(50));
    // The start lands (in-progress), the run ends, its outcome does not.
    let mut refused = fx.store.refused.subscribe();
    tokio::time::timeout(GUARD, refused.wait_for(|n| *n > 0)).await.expect("the outcome was attempted").unwrap();
    assert_eq!(lines(&log), 1);
    // Passes go by (the loop wakes every 50 ms): the kept write waits for its back-off.
    let looks = *fx.store.looks.borrow();
    let mut passes = fx.store.passes.subscribe();
    let five_more = *passes.borrow_and_update() + 5;
    tokio::time::timeout(GUARD, passes.wait_for(|n| *n >= five_more)).await.expect("the loop kept waking").unwrap();
    assert_eq!(*fx.store.refused.borrow(), 1, "not retried before its back-off");
    assert_eq!(*fx.store.looks.borrow(), looks, "nothing is decided while an outcome is kept");
    assert_eq!(fx.get("a").state, PlanState::InProgress);
    // The source is back and says so: the outcome lands at once (not in an hour), run once.
    fx.store.down.store(false, SeqCst);
    fx.store.changed.notify_one();
    let a = fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(a.history, [PlanState::InProgress, PlanState::Succeeded]);
    assert_eq!(lines(&log), 1, "the plan did not run again");
    stopped(stop, agent).await;
}

#[test]
fn back_off_steps_double_only_once_their_delay_has_passed() {
    let t0 = Instant::now();
    let mut s = Step::new(Duration::from_secs(1));
    let first = s.next(t0, t0);
    assert!(first >= Duration::from_secs(1) && first <= Duration::from_millis(1100), "{first:?}");
    // Looked at again early (a change woke the loop): the same deadline, not a doubled one.
    let half = t0 + Duration::from_millis(500);
    let again = s.next(half, half);
    assert_eq!(again, first - Duration::from_millis(500));
    // An early attempt still in flight when the deadline passes (a write to a server just back):
    // the back-off's own attempt is due at once, the step is not taken.
    let late = t0 + first + Duration::from_millis(300);
    assert_eq!(s.next(half, late), Duration::ZERO);
    assert_eq!(s.until, Some(t0 + first));
    let second = s.next(t0 + first, t0 + first);
    assert!(second >= Duration::from_secs(2) && second <= Duration::from_millis(2200), "{second:?}");
    for _ in 0..20 {
        let now = s.until.unwrap();
        assert!(s.next(now, now) <= Duration::from_secs(301));
    }
    // A plan held again after it was not starts its back-off from the first step.
    let mut m = Memory::default();
    let d = m.held(t0);
    assert!(m.held(t0 + d) >= Duration::from_secs(2));
    m.standing = Standing::Clear;
    assert!(m.held(t0 + d) <= Duration::from_millis(1100));
}

/// A write the server asked to retry later (HTTP 429 with a hint) waits out the hint, jittered,
/// instead of the loop's own back-off, and leaves that back-off where it was.
#[tokio::test]
async fn a_failed_write_waits_out_the_servers_hint() {
    let fx = fixture();
    let (_stop, rx) = watch::channel(false);
    let mut r = Reconciler::new(
        MemSource(fx.store.clone(), Duration::from_secs(3600)),
        fx.app.clone(),
        Arc::new(Prober::new()),
        rx,
    );
    let key = "a".to_string();
    let hinted = r.write_failed(&key, "x", "429", Some(Duration::from_secs(7)));
    let Action::After(d) = hinted else { panic!("{hinted:?}") };
    assert!(d >= Duration::from_secs(7) && d <= Duration::from_millis(7700), "{d:?}");
    assert!(r.mem(&key).write.as_ref().is_some_and(|w| w.step.until.is_none()), "the own back-off is not stepped");
    let own = r.write_failed(&key, "x", "down", None);
    let Action::After(d) = own else { panic!("{own:?}") };
    assert!(d >= Duration::from_secs(1) && d <= Duration::from_millis(1100), "{d:?}");
}

/// A source whose API server can be down: its writes fail while `down` holds; each attempt's
/// (virtual) time is recorded. `kept`: an outcome a previous agent kept on the node, handed to the
/// loop once. Its period is a second: the loop looks at its plans every second.
struct Flaky {
    inner: MemSource,
    down: Arc<std::sync::atomic::AtomicBool>,
    /// The next attempt finds the plan changed (a conflict): the write is abandoned.
    abandon: Arc<std::sync::atomic::AtomicBool>,
    /// The source sees no plan (its key stays listed).
    vanish: Arc<std::sync::atomic::AtomicBool>,
    kept: bool,
    /// The kept outcome landed.
    landed: bool,
    attempts: watch::Sender<Vec<Instant>>,
}

impl Flaky {
    fn attempt(&mut self) -> Written {
        self.attempts.send_modify(|a| a.push(Instant::now()));
        if self.abandon.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Written::Abandoned;
        }
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            Written::failed("connection refused")
        } else {
            Written::Done
        }
    }
}

impl PlanSource for Flaky {
    type Key = String;
    type Kept = ();
    async fn changed(&mut self) -> bool {
        self.inner.changed().await
    }
    async fn keys(&mut self) -> Vec<String> {
        self.inner.keys().await
    }
    async fn look(&mut self, k: &String) -> Seen {
        let seen = self.inner.look(k).await;
        if self.vanish.load(std::sync::atomic::Ordering::SeqCst) { Seen::Nothing } else { seen }
    }
    async fn commit(&mut self, k: &String, l: &Look, c: &Commit) -> Written {
        match self.attempt() {
            Written::Done => self.inner.commit(k, l, c).await,
            failed => failed,
        }
    }
    async fn record(&mut self, k: &String, l: &Look, o: Outcome<'_>) -> Sent<()> {
        (self.inner.record(k, l, o).await.0, None)
    }
    async fn not_started(&mut self, k: &String, l: &Look, e: &ApplyError) -> Option<Written> {
        self.inner.not_started(k, l, e).await
    }
    async fn write_probes(&mut self, k: &String, l: &str, s: BTreeMap<String, ProbeStatus>) -> Written {
        self.inner.write_probes(k, l, s).await
    }
    async fn restored(&mut self, _: &String) -> Option<()> {
        std::mem::take(&mut self.kept).then_some(())
    }
    async fn resend(&mut self, _: &String, (): ()) -> Sent<()> {
        let w = self.attempt();
        self.landed = w == Written::Done;
        let keep = matches!(w, Written::Failed { .. }).then_some(());
        (w, keep)
    }
    async fn set_blocked(&mut self, k: &String, why: Option<&str>) {
        self.inner.set_blocked(k, why).await
    }
    fn interrupt(&mut self, k: &String, l: &Look) -> Observed {
        self.inner.interrupt(k, l)
    }
    fn owner(&self, k: &String, l: &Look) -> Owner {
        self.inner.owner(k, l)
    }
    fn claim(&self, o: &Owner) -> Claim<String> {
        self.inner.claim(o)
    }
    fn period(&self) -> Duration {
        Duration::from_secs(1)
    }
}

impl Fixture {
    /// Run the loop over a [`Flaky`] source that is down; the attempts, and the switch.
    #[allow(clippy::type_complexity)]
    fn start_flaky(
        &self,
        kept: bool,
    ) -> (
        watch::Sender<bool>,
        tokio::task::JoinHandle<(AgentExit, Flaky)>,
        watch::Receiver<Vec<Instant>>,
        Arc<std::sync::atomic::AtomicBool>,
    ) {
        let (stop, rx) = watch::channel(false);
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (attempts, seen) = watch::channel(Vec::new());
        let (abandon, vanish) = (self.abandon.clone(), self.vanish.clone());
        let inner = MemSource(self.store.clone(), Duration::from_secs(3600));
        let source = Flaky { inner, down: down.clone(), abandon, vanish, kept, landed: false, attempts };
        let r = Reconciler::new(source, self.app.clone(), Arc::new(Prober::new()), rx);
        (stop, tokio::spawn(r.run()), seen, down)
    }
}

/// The gaps between successive attempts.
fn gaps(at: &[Instant]) -> Vec<Duration> {
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

/// `d` is the back-off step `base`, jittered (up to a tenth more).
fn step_of(d: Duration, base: u64) -> bool {
    let base = Duration::from_secs(base);
    d >= base && d <= base + base / 10
}

async fn attempts(seen: &mut watch::Receiver<Vec<Instant>>, n: usize) -> Vec<Instant> {
    let a = tokio::time::timeout(GUARD * 10, seen.wait_for(|a| a.len() >= n)).await;
    a.expect("the loop attempted the write").unwrap().clone()
}

/// An outcome kept through an outage is retried with back-off (1, 2, 4, 8 s, jittered) while
/// nothing changes, although the loop looks at the plan every second (its period); a change the source reports while the server is still down retries it at once
/// without moving the back-off's deadline (it does not double twice without waiting); and the
/// change that comes with the server's return (the watch is back) writes it at once, not at the
/// back-off's next step 16 s later. Virtual time: the back-off costs nothing.
#[tokio::test(start_paused = true)]
async fn a_kept_outcome_is_written_at_the_first_change_after_an_outage() {
    let fx = fixture();
    fx.add("a", &["true"]);
    fx.store.plans.lock().unwrap().get_mut("a").unwrap().state = PlanState::Failed;
    let (stop, agent, mut seen, down) = fx.start_flaky(true);
    let at = attempts(&mut seen, 4).await;
    let g = gaps(&at);
    assert!(step_of(g[0], 1) && step_of(g[1], 2) && step_of(g[2], 4), "{g:?}");
    // A change while the server is still down: one more attempt at once...
    fx.store.changed.notify_one();
    let at = attempts(&mut seen, 5).await;
    assert_eq!(at[4], at[3], "a change retries the kept outcome at once");
    // ...and the next timed attempt keeps the deadline set at the fourth (8 s after it, not 16).
    let at = attempts(&mut seen, 6).await;
    assert!(step_of(at[5] - at[3], 8), "{:?}", at[5] - at[3]);
    // The server is back and the watch reports it: the outcome is written at once.
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    fx.store.changed.notify_one();
    let at = attempts(&mut seen, 7).await;
    assert_eq!(at[6], at[5], "written at the change, not at the back-off's next step (16 s later)");
    stop.send(true).unwrap();
    let (_, source) = agent.await.unwrap();
    assert!(source.landed, "the outcome landed");
}

/// A kept outcome abandoned (the plan changed before it could land) ends its back-off with it: the
/// new plan's first write that fails waits the first step (1 s), not what was left of the old
/// outcome's step (8 s).
#[tokio::test(start_paused = true)]
async fn an_abandoned_kept_outcome_ends_its_back_off() {
    let fx = fixture();
    fx.add("a", &["true"]);
    fx.store.plans.lock().unwrap().get_mut("a").unwrap().state = PlanState::Failed;
    let (stop, agent, mut seen, _down) = fx.start_flaky(true);
    let at = attempts(&mut seen, 4).await;
    assert!(step_of(at[3] - at[2], 4), "{:?}", gaps(&at));
    // New content arrives: the kept outcome is abandoned, the new plan's start fails (still down).
    fx.abandon.store(true, std::sync::atomic::Ordering::SeqCst);
    fx.add("a", &["echo b"]);
    fx.store.changed.notify_one();
    let at = attempts(&mut seen, 7).await;
    assert_eq!((at[4], at[5]), (at[3], at[3]), "abandoned, then the start tried, at once");
    assert!(step_of(at[6] - at[5], 1), "the start's back-off begins anew: {:?}", at[6] - at[5]);
    stop.send(true).unwrap();
    agent.await.unwrap();
}

/// A commit (a start) that does not land backs off too: 1, 2, 4 s, jittered. A pass with nothing
/// kept to flush does not reset that back-off, and the period (a second) does not bring the next
/// attempt forward.
#[tokio::test(start_paused = true)]
async fn a_failing_commit_backs_off() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    let (stop, agent, mut seen, _down) = fx.start_flaky(false);
    let at = attempts(&mut seen, 4).await;
    let g = gaps(&at);
    assert!(step_of(g[0], 1) && step_of(g[1], 2) && step_of(g[2], 4), "{g:?}");
    stop.send(true).unwrap();
    agent.await.unwrap();
    assert_eq!(lines(&log), 0, "nothing runs before its start is written");
    assert_eq!(fx.get("a").state, PlanState::Pending);
}

/// A write abandoned (the plan changed under it) asks for a look at once: a back-off left by an
/// earlier failure does not hold that look back.
#[tokio::test(start_paused = true)]
async fn an_abandoned_write_is_looked_at_again_at_once_despite_an_earlier_failure() {
    let fx = fixture();
    fx.add("a", &["true"]);
    // A cancel of a pending plan: recorded by a commit, nothing runs.
    fx.store.plans.lock().unwrap().get_mut("a").unwrap().canceled = Some("true".into());
    let (stop, agent, mut seen, down) = fx.start_flaky(false);
    attempts(&mut seen, 1).await;
    // The server is back, and the plan changed under the next write.
    down.store(false, std::sync::atomic::Ordering::SeqCst);
    fx.abandon.store(true, std::sync::atomic::Ordering::SeqCst);
    fx.store.changed.notify_one();
    let at = attempts(&mut seen, 3).await;
    assert_eq!((at[1], at[2]), (at[0], at[0]), "decided and written again at once");
    fx.until("a", "canceled", |p| p.state == PlanState::Canceled).await;
    stop.send(true).unwrap();
    agent.await.unwrap();
}

/// A plan whose probes are due but that its pass does not reach (held by an invalid value, R3) is
/// looked at again with the hold's back-off, not in a loop: probes that fell due are no reason to
/// wake at once when nothing will run them.
#[tokio::test(start_paused = true)]
async fn a_held_plan_whose_probes_fell_due_is_not_looked_at_in_a_loop() {
    let fx = fixture();
    let raw = serde_json::to_vec(&serde_json::json!({
        "instructions": [{"name": "a1", "command": "true"}],
        "probes": {"web": {"httpGet": {"url": "http://127.0.0.1:1/"}}}
    }))
    .unwrap();
    fx.add("a", &["true"]);
    fx.set("a", |p| {
        p.plan = crate::plan::parse(&raw).unwrap();
        p.checksum = crate::plan::checksum(&raw);
        p.paused = Some("true".into());
    });
    let (stop, agent) = fx.start();
    fx.until("a", "paused", |p| p.state == PlanState::Paused).await;
    fx.set("a", |p| p.paused = Some("yes".into()));
    fx.look_again().await;
    // Hours pass (the period is one): a held plan is looked at with back-off, at most every 5 min.
    let mut looks = fx.store.looks.subscribe();
    let start = *looks.borrow_and_update();
    let spun = tokio::time::timeout(Duration::from_secs(3 * 3600), looks.wait_for(|n| *n >= start + 100)).await.is_ok();
    assert!(!spun, "looked at {} times", *looks.borrow() - start);
    stop.send(true).unwrap();
    agent.await.unwrap();
}

/// An apply that could not start (its work directory is in the way) is tried again with back-off;
/// once it has run, the back-off's gate that has passed is no reason to look again: the loop rests.
#[tokio::test(start_paused = true)]
async fn a_passed_apply_gate_does_not_keep_the_loop_awake() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    std::fs::write(fx.dir.path().join("work"), b"in the way").unwrap();
    let (stop, agent) = fx.start();
    let mut looks = fx.store.looks.subscribe();
    // A guard of real time: on the paused clock a tokio timeout is the next timer the clock jumps
    // to while the apply waits on a thread the runtime does not track (seen under load).
    let (tx, guard) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(GUARD);
        let _ = tx.send(());
    });
    tokio::select! {
        r = looks.wait_for(|n| *n >= 3) => { r.unwrap(); }
        _ = guard => panic!("never tried again"),
    }
    std::fs::remove_file(fx.dir.path().join("work")).unwrap();
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    let start = *looks.borrow_and_update();
    let spun = tokio::time::timeout(Duration::from_secs(3 * 3600), looks.wait_for(|n| *n >= start + 100)).await.is_ok();
    assert!(!spun, "looked at {} times", *looks.borrow() - start);
    assert_eq!(lines(&log), 1);
    stop.send(true).unwrap();
    agent.await.unwrap();
}

/// The wall clock of the applyinator's schedules, following tokio's (paused) clock from a fixed
/// start: periodic instructions fall due in virtual time.
struct TokioClock(Instant, chrono::DateTime<chrono::Utc>);

impl crate::apply::Clock for TokioClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.1 + chrono::Duration::from_std(Instant::now() - self.0).unwrap()
    }
}

/// The loop over `fx`'s store, looking at every plan each second, with an applyinator on
/// [`TokioClock`].
fn start_on_tokio_clock(fx: &Fixture) -> (watch::Sender<bool>, tokio::task::JoinHandle<(AgentExit, MemSource)>) {
    let sup = Supervisor::new(SupervisorConfig {
        pid_dir: Some(fx.dir.path().join("pids")),
        cgroup: CgroupMode::Auto,
        ..Default::default()
    });
    let clock = Arc::new(TokioClock(Instant::now(), chrono::Utc::now()));
    let app = Arc::new(Applyinator::with_clock(ApplyConfig::new(fx.dir.path().join("work")), sup, clock));
    let (tx, rx) = watch::channel(false);
    let r = Reconciler::new(MemSource(fx.store.clone(), Duration::from_secs(1)), app, Arc::new(Prober::new()), rx);
    (tx, tokio::spawn(r.run()))
}

/// A succeeded plan is looked at every second (the source's period) for an hour: without periodic
/// instructions nothing runs again and nothing is written (a pass with nothing due used to begin a
/// run each time: the Lease renewed as a busy agent's, the outcome written again).
#[tokio::test(start_paused = true)]
async fn a_succeeded_plan_without_periodic_instructions_is_not_run_again() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    let (stop, agent) = start_on_tokio_clock(&fx);
    let done = fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    let mut looks = fx.store.looks.subscribe();
    let start = *looks.borrow_and_update();
    tokio::time::timeout(GUARD * 60, looks.wait_for(|n| *n >= start + 3000)).await.expect("looked at").unwrap();
    assert_eq!(fx.store.applies.load(SeqCst), 1, "runs begun");
    assert_eq!(fx.get("a").writes, done.writes, "writes after it succeeded");
    assert_eq!(lines(&log), 1);
    stopped(stop, agent).await;
}

/// The loop's Events name the plan they are about: two plans with the same shape (the same notes
/// but for the id) are told apart, as `kubectl describe` shows a machine's plans one after another.
#[tokio::test]
async fn each_plan_event_names_its_plan() {
    let fx = fixture();
    let mut ids = Vec::new();
    for script in ["true", "true # another plan"] {
        fx.add("a", &[script]);
        ids.push(fx.get("a").plan.id());
        let (stop, agent) = fx.start();
        fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
        stopped(stop, agent).await;
    }
    assert_ne!(ids[0], ids[1]);
    let want: Vec<String> = ids
        .iter()
        .flat_map(|id| {
            [
                format!("Started: plan {id}: attempt 1: applying 1 instruction"),
                format!("Succeeded: plan {id}: succeeded (1/1 instructions)"),
            ]
        })
        .collect();
    assert_eq!(*fx.store.events.lock().unwrap(), want);
}

/// A periodic instruction (every 60 s) runs when it is due, and nothing runs in between although
/// the plan is looked at every second: each run begun ran it. (The schedule's clock is tokio's
/// paused one, which runs ahead while a real process works: what counts is runs, not minutes.)
#[tokio::test(start_paused = true)]
async fn a_periodic_instruction_runs_when_due_and_nothing_runs_between() {
    let fx = fixture();
    let (log, plog) = (fx.path("log"), fx.path("plog"));
    let periodic = serde_json::json!([{"name": "p", "command": "sh", "args": ["-c", format!("echo p >> {plog}")], "periodSeconds": 60}]);
    fx.add_plan("a", &[&format!("echo a >> {log}")], serde_json::json!({ "periodicInstructions": periodic }));
    let (stop, agent) = start_on_tokio_clock(&fx);
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    let start = *fx.store.looks.borrow();
    fx.until("a", "ran its periodic instruction 4 times more", |_| lines(&plog) >= 5).await;
    let looks = *fx.store.looks.borrow() - start;
    let (runs, applies) = (lines(&plog) as u64, fx.store.applies.load(SeqCst));
    assert!(looks >= 4 * 30, "looked at {looks} times");
    assert_eq!(applies, runs, "runs begun: the first with the one-time instruction, then one a period");
    assert_eq!(lines(&log), 1);
    stopped(stop, agent).await;
}

/// A plan looked at again after a back-off (held, R3) that is then gone (the source sees no plan)
/// leaves no deadline behind that keeps the loop awake.
#[tokio::test(start_paused = true)]
async fn a_deadline_served_by_a_pass_does_not_keep_the_loop_awake() {
    let fx = fixture();
    fx.add("a", &["true"]);
    fx.store.plans.lock().unwrap().get_mut("a").unwrap().paused = Some("yes".into());
    let (stop, agent, _attempts, _down) = fx.start_flaky(false);
    let mut looks = fx.store.looks.subscribe();
    tokio::time::timeout(GUARD, looks.wait_for(|n| *n >= 2)).await.expect("held, looked at again").unwrap();
    fx.vanish.store(true, std::sync::atomic::Ordering::SeqCst);
    let start = *looks.borrow_and_update();
    // Ten seconds: about ten looks (the period is a second).
    let spun = tokio::time::timeout(Duration::from_secs(10), looks.wait_for(|n| *n >= start + 100)).await.is_ok();
    assert!(!spun, "looked at {} times", *looks.borrow() - start);
    stop.send(true).unwrap();
    agent.await.unwrap();
}

/// A failed plan's retry is due a moment after a look that found it not due yet, and the pass
/// goes on past that moment (the look was slow): the deadline that pass set is still served at
/// once, not at the next change or period (here an hour: it was, and the retry came an hour late).
#[tokio::test(start_paused = true)]
async fn a_retry_due_during_the_pass_that_saw_it_is_not_lost() {
    let fx = fixture();
    fx.add("f", &["true"]);
    let t0 = Instant::now();
    let due = t0 + Duration::from_millis(1000);
    if let Some(p) = fx.store.plans.lock().unwrap().get_mut("f") {
        (p.state, p.retry_at) = (PlanState::Failed, Some(due));
    }
    // Slow looks: the first (by 300 ms) makes the next pass come early, the second (200 ms)
    // reads the plan 100 ms before its retry is due, and the pass then ends after it.
    fx.store.look_delays.lock().unwrap().extend([Duration::from_millis(300), Duration::from_millis(200)]);
    let (stop, agent) = fx.start();
    fx.until("f", "succeeded", |p| p.state == PlanState::Succeeded).await;
    let begun = fx.store.begun.lock().unwrap().clone();
    assert_eq!(begun.len(), 1);
    assert!(begun[0] >= due && begun[0] < due + Duration::from_secs(5), "began {:?} after", begun[0] - t0);
    stopped(stop, agent).await;
}

/// The legacy checksum flow has no plan state: a one-time pass that was not interrupted counts as
/// succeeded or failed for `nodeplan_plans_total`; periodic-only runs, interrupted runs and the
/// plan-state flow (which records its own state) count nothing here.
#[test]
fn legacy_runs_count_as_succeeded_or_failed() {
    use crate::plan::Interruption;
    let result = |ok: bool, interruption: Option<Interruption>| ApplyResult {
        one_time_succeeded: ok,
        interruption,
        ..ApplyResult::default()
    };
    let legacy = View::Legacy { one_time: true };
    let table = [
        (&legacy, RunPlan::Legacy { one_time: true }, result(true, None), Some(PlanState::Succeeded)),
        (&legacy, RunPlan::Legacy { one_time: true }, result(false, None), Some(PlanState::Failed)),
        (&legacy, RunPlan::Legacy { one_time: true }, result(false, Some(Interruption::Canceled)), None),
        (&legacy, RunPlan::Legacy { one_time: true }, result(false, Some(Interruption::Shutdown)), None),
        (&legacy, RunPlan::Legacy { one_time: false }, result(false, None), None),
    ];
    for (view, run, r, want) in table {
        assert_eq!(legacy_state(view, &run, &r), want, "{run:?} {r:?}");
    }
}

#[test]
fn plan_states_and_their_metric() {
    use crate::metrics::PlanResult as R;
    let table = [
        (PlanState::Succeeded, Some(R::Succeeded)),
        (PlanState::Failed, Some(R::Failed)),
        (PlanState::Paused, Some(R::Paused)),
        (PlanState::Canceled, Some(R::Canceled)),
        (PlanState::Pending, None),
        (PlanState::InProgress, None),
        (PlanState::Other("weird".into()), None),
    ];
    for (state, want) in table {
        assert_eq!(plan_metric(&state), want, "{state:?}");
    }
}

/// Two sources joined ([`super::both::Both`]) are served by one loop: a plan of one waits while a
/// plan of the other runs (one plan at a time on the node by construction), and each source's
/// writes go to that source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joined_sources_run_one_plan_at_a_time_each_writing_its_own() {
    let (fx, other) = (fixture(), fixture());
    let (ready, gate, log) = (fx.fifo("ready"), fx.fifo("gate"), fx.path("log"));
    fx.add("a", &[&format!("echo > {ready}; read x < {gate}; echo a-end >> {log}")]);
    other.add("b", &[&format!("echo b >> {log}")]);
    let (stop, rx) = watch::channel(false);
    let source = super::both::Both::new(
        MemSource(fx.store.clone(), Duration::from_secs(3600)),
        MemSource(other.store.clone(), Duration::from_secs(3600)),
    );
    let agent = tokio::spawn(Reconciler::new(source, fx.app.clone(), Arc::new(Prober::new()), rx).run());
    running(&ready).await;
    // The other source's plan is not started while this one runs, even when its source says it
    // changed.
    other.set("b", |_| {});
    open(&gate).await;
    other.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "a-end\nb\n", "b ran after a, never beside it");
    assert_eq!(fx.get("a").history, [PlanState::InProgress, PlanState::Succeeded]);
    assert_eq!(other.get("b").history, [PlanState::InProgress, PlanState::Succeeded]);
    let (exit, _) = stopped(stop, agent).await;
    assert_eq!(exit, AgentExit::Clean);
}

/// `fx`'s plans behind `gate`, joined with `other`'s.
fn gated_beside(fx: &Fixture, gate: Gate, other: &Fixture) -> super::both::Both<Gated<MemSource>, MemSource> {
    super::both::Both::new(
        Gated::new(MemSource(fx.store.clone(), Duration::from_secs(3600)), gate),
        MemSource(other.store.clone(), Duration::from_secs(3600)),
    )
}

/// Every wrapper (either side of a `Both`, an `Option`, a `Gated`) passes on the calls a source
/// may leave to the trait's defaults (`show`, `wait`, `event`, `restored`, `fresh`): a wrapper that
/// did not would drop what the source shows without a word (a NodePlan's `Waiting` condition went
/// missing that way), an outcome a previous agent kept on the node, or a source's own check before
/// a start.
#[tokio::test]
async fn wrappers_pass_on_what_a_source_may_leave_to_the_defaults() {
    async fn drive<S: PlanSource>(s: &mut S, key: S::Key, look: &Look) {
        s.show(&key).await;
        s.wait(&key, look, Wait::Turn("x")).await;
        s.event(&key, Reason::Started, "note");
        s.restored(&key).await;
        s.fresh(&key).await.unwrap();
    }
    let fx = fixture();
    fx.add("a", &["true"]);
    let mem = || MemSource(fx.store.clone(), Duration::from_secs(3600));
    let Seen::Plan(look) = mem().look(&"a".to_string()).await else { panic!("no plan") };
    use super::both::{Both, Side};
    drive(&mut Both::new(mem(), mem()), Side::A("a".to_string()), &look).await;
    drive(&mut Both::new(mem(), mem()), Side::B("a".to_string()), &look).await;
    drive(&mut Some(mem()), "a".to_string(), &look).await;
    let (_fence_tx, fence) = watch::channel(true);
    let (_state_tx, state) = watch::channel(GateState::Open);
    let gate = Gate::new(state, fence, tokio::sync::oneshot::channel().0, tokio::spawn(async {}));
    drive(&mut Gated::new(mem(), gate), "a".to_string(), &look).await;
    assert_eq!(*fx.store.shows.borrow(), 4, "shows");
    assert_eq!(fx.get("a").waits, vec!["turn: x"; 4]);
    assert_eq!(*fx.store.events.lock().unwrap(), vec!["Started: note"; 4]);
    assert_eq!(fx.store.restores.load(SeqCst), 4, "restored");
    assert_eq!(fx.store.freshes.load(SeqCst), 4, "fresh");
}

/// A look only reads: what it finds to show (a NodePlan that waits says so in its status) is
/// written through `show`, which the loop calls after a look only while the plan's fence is open.
/// While another source's plan runs, a plan whose Lease is not held is looked at, and nothing of
/// it is written; once its fence opens, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_look_finds_to_show_is_written_only_while_its_fence_is_open() {
    let (fx, other) = (fixture(), fixture());
    let (ready, gate) = (other.fifo("ready"), other.fifo("gate"));
    fx.add("a", &["true"]);
    other.add("b", &[&format!("echo > {ready}; cat {gate} > /dev/null")]);
    let (fence_tx, fence) = watch::channel(false);
    let (_state_tx, state) = watch::channel(GateState::Open);
    let (task_stop, task) = (tokio::sync::oneshot::channel().0, tokio::spawn(async {}));
    let (stop, rx) = watch::channel(false);
    let source = gated_beside(&fx, Gate::new(state, fence, task_stop, task), &other);
    let agent = tokio::spawn(Reconciler::new(source, fx.app.clone(), Arc::new(Prober::new()), rx).run());
    running(&ready).await;
    // b runs; a change of a makes the loop look at it (twice: the first look's show is decided
    // before the second look starts), and nothing of it is shown: its fence is closed.
    let mut looks = fx.store.looks.subscribe();
    for n in 1..=2 {
        fx.set("a", |_| {});
        tokio::time::timeout(GUARD, looks.wait_for(|l| *l >= n)).await.expect("the loop looked at a").unwrap();
    }
    assert_eq!(*fx.store.shows.borrow(), 0, "shown with the fence closed");
    assert_eq!(fx.get("a").writes, 0);
    // Open: the next look at it is followed by its show.
    let mut shows = fx.store.shows.subscribe();
    fence_tx.send(true).unwrap();
    fx.set("a", |_| {});
    tokio::time::timeout(GUARD, shows.wait_for(|s| *s >= 1)).await.expect("shown once its fence is open").unwrap();
    // ... and it is shown waiting for its turn (through both wrappers).
    let a = fx.until("a", "shown waiting", |p| !p.waits.is_empty()).await;
    assert_eq!(a.waits[0], format!("turn: local:{OWNER}b"));
    open(&gate).await;
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    assert_eq!(other.get("b").history, [PlanState::InProgress, PlanState::Succeeded]);
    let (exit, _) = stopped(stop, agent).await;
    assert_eq!(exit, AgentExit::Clean);
}

/// A gated source ([`super::gate::Gated`]) shows nothing while its gate waits (the other
/// source's plans run meanwhile), runs once it opens, and when its gate ends (another agent took
/// its Lease) the running plan is stopped as at a shutdown, the gate's task is told to give its
/// Lease up, and the loop ends with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_holds_its_source_until_it_opens_and_its_end_stops_the_agent() {
    let (fx, other) = (fixture(), fixture());
    let (ready, pid, log) = (fx.fifo("ready"), fx.path("pid"), fx.path("log"));
    fx.add("a", &[&format!("echo a >> {log}")]);
    other.add("b", &[&format!("echo b >> {log}")]);
    let (state_tx, state) = watch::channel(GateState::Waiting);
    let (_fence_tx, fence) = watch::channel(true);
    let (task_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (released_tx, released) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        if stopped.await.is_ok() {
            let _ = released_tx.send(());
        }
    });
    let (stop, rx) = watch::channel(false);
    let source = gated_beside(&fx, Gate::new(state, fence, task_stop, task), &other);
    let agent = tokio::spawn(Reconciler::new(source, fx.app.clone(), Arc::new(Prober::new()), rx).run());
    other.until("b", "succeeded", |p| p.state == PlanState::Succeeded).await;
    other.pass_again().await;
    assert_eq!((fx.get("a").writes, *fx.store.passes.borrow()), (0, 0), "a waiting gate shows no plan");

    state_tx.send(GateState::Open).unwrap();
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    fx.add("c", &[&format!("echo $$ > {pid}; echo > {ready}; exec sleep 300")]);
    fx.set("c", |_| {});
    running(&ready).await;
    let long: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();

    state_tx.send(GateState::Ended("another agent took the plan source's Lease".into())).unwrap();
    let (exit, _) = tokio::time::timeout(GUARD, agent).await.unwrap().unwrap();
    assert_eq!(exit, AgentExit::Displaced("another agent took the plan source's Lease".into()));
    assert!(!alive(long), "the running instruction is stopped");
    assert_eq!(fx.get("c").history, [PlanState::InProgress], "stopped as at a shutdown: it runs again later");
    tokio::time::timeout(GUARD, released).await.unwrap().expect("the gate's task was told to give its Lease up");
    drop(stop);
}

/// R26: a gate's `fresh` (asked before a start or a write) is answered at once without a Lease
/// (no asker, or nobody renews while the fence is open), refuses when nobody renews and the fence
/// is closed, passes on the renewer's answer, and never waits longer than `FRESH_WAIT`, even for a
/// renewer that never reads (its queue full), nor past the agent's shutdown. On a paused clock.
#[tokio::test(start_paused = true)]
async fn a_gate_answers_fresh_at_once_without_a_lease_and_within_its_bound_with_one() {
    use super::gate::FRESH_WAIT;
    let gate = |fence: bool| {
        let (fence_tx, fence_rx) = watch::channel(fence);
        let (_state_tx, state) = watch::channel(GateState::Open);
        let g = Gate::new(state, fence_rx, tokio::sync::oneshot::channel().0, tokio::spawn(async {}));
        (g, fence_tx)
    };
    let (g, _f) = gate(true);
    assert_eq!(g.fresh().await, Ok(()), "no asker");
    let (shutdown_tx, shutdown) = watch::channel(false);
    let asker = |g: Gate| {
        let (ask_tx, ask_rx) = tokio::sync::mpsc::channel(1);
        (g.telling(watch::channel(false).0, ask_tx, shutdown.clone()), ask_rx)
    };
    let (g, _f) = gate(true);
    let (g, rx) = asker(g);
    drop(rx);
    assert_eq!(g.fresh().await, Ok(()), "nobody renews, the fence open");
    let (g, _f) = gate(false);
    let (g, rx) = asker(g);
    drop(rx);
    assert!(g.fresh().await.is_err(), "nobody renews, the fence closed");
    // The renewer's answer, as it gives it.
    let (g, _f) = gate(true);
    let (g, mut rx) = asker(g);
    let renewer = tokio::spawn(async move {
        let first = rx.recv().await.unwrap();
        first.send(Ok(())).unwrap();
        let second = rx.recv().await.unwrap();
        second.send(Err("taken".to_string())).unwrap();
        rx
    });
    assert_eq!(g.fresh().await, Ok(()));
    assert_eq!(g.fresh().await, Err("taken".to_string()));
    // A renewer that never answers, then one that never reads (its queue of one full).
    let _rx = renewer.await.unwrap();
    for _ in 0..2 {
        let started = Instant::now();
        assert!(g.fresh().await.is_err());
        assert_eq!(started.elapsed(), FRESH_WAIT);
    }
    // A shutdown while it waits ends the wait then: it is not held up by the renewal.
    let started = Instant::now();
    let asked = g.fresh();
    let shut = async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        shutdown_tx.send_replace(true);
        std::future::pending::<()>().await
    };
    tokio::select! {
        r = asked => assert_eq!(r, Err("the agent shuts down".to_string())),
        () = shut => unreachable!(),
    }
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    // And once shut down, an ask is refused at once.
    assert_eq!(g.fresh().await, Err("the agent shuts down".to_string()));
}

/// An apply that could not start says why once per reason (its Event), while its back-off grows
/// at every try.
#[test]
fn a_reason_an_apply_could_not_start_is_new_once() {
    let mut m = Memory::default();
    let now = Instant::now();
    let (first, new) = m.not_started(now, "disk full".into());
    assert!(new);
    let later = now + first;
    let (second, new) = m.not_started(later, "disk full".into());
    assert!(!new, "the same reason again");
    assert!(second > first, "the back-off grows: {first:?} then {second:?}");
    let later = later + second;
    assert!(m.not_started(later, "interlock held".into()).1, "another reason");
    assert!(m.not_started(later, "disk full".into()).1, "a reason said before the last one is new again");
}
