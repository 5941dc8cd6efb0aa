//! The loop driven through an in-memory plan source holding several plans, with the real
//! applyinator and supervisor running `sh`: pause, resume, cancel, an invalid value, a crash in
//! the middle of a run and the recovery after it. The source below is the whole of what a new
//! plan source has to provide; nothing in the loop knows about it.

use super::*;
use crate::apply::ApplyConfig;
use crate::flow::{CheckpointWrite, Snapshot};
use crate::plan::{Annotations, Checkpoint, PlanState, resolve_annotations};
use crate::process::{CgroupMode, StopPolicy, Supervisor, SupervisorConfig};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::Mutex;
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
    /// Writes of this plan.
    writes: u64,
    /// Every state written, in order.
    history: Vec<PlanState>,
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
}

/// The in-memory source: keys are plan names.
struct MemSource(Arc<Store>);

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
        self.0.writes.send_modify(|n| *n += 1);
        Written::Done
    }
}

impl PlanSource for MemSource {
    type Key = String;

    async fn changed(&mut self) -> bool {
        self.0.changed.notified().await;
        true
    }

    async fn keys(&mut self) -> Vec<String> {
        self.0.plans.lock().unwrap().keys().cloned().collect()
    }

    async fn look(&mut self, name: &String) -> Seen {
        self.0.looks.send_modify(|n| *n += 1);
        let Some(p) = self.0.plans.lock().unwrap().get(name).cloned() else { return Seen::Nothing };
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
            plan: p.plan,
            checksum: p.checksum,
            view: View::Flow(snap),
            attempt: p.failures + 1,
            begin_attempt: p.failures + 1,
            one_time_output: p.outputs,
            periodic_output: BTreeMap::new(),
            probe_statuses: BTreeMap::new(),
            retry_in: None,
        }))
    }

    async fn commit(&mut self, name: &String, _: &Look, commit: &Commit) -> Written {
        self.write(name, |p| {
            p.state = commit.state();
            p.checkpoint = commit.checkpoint().cloned();
        })
    }

    async fn record(&mut self, name: &String, _: &Look, outcome: Outcome<'_>) -> Written {
        let Some(r) = outcome.record else { return Written::Done };
        self.write(name, |p| {
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
        })
    }

    async fn not_started(&mut self, _: &String, _: &Look, _: &ApplyError) -> Option<Written> {
        None
    }

    async fn write_probes(&mut self, _: &String, _: &Look, _: BTreeMap<String, ProbeStatus>) -> Written {
        Written::Done
    }

    async fn flush(&mut self, _: &String) -> Written {
        Written::Done
    }

    async fn set_blocked(&mut self, name: &String, why: Option<&str>) {
        self.write(name, |p| p.blocked = why.map(str::to_string));
    }

    fn interrupt(&mut self, name: &String, _: &Look) -> Observed {
        let plans = self.0.plans.lock().unwrap();
        let Some(p) = plans.get(name) else { return Observed::default() };
        let valid = |v: &Option<String>| crate::plan::parse_annotation_value(v.as_deref()) == Ok(true);
        Observed {
            interrupt: Interrupt { pause: valid(&p.paused), cancel: valid(&p.canceled), shutdown: false },
            note: None,
        }
    }

    fn owner(&self, name: &String, _: &Look) -> String {
        format!("{OWNER}{name}")
    }

    fn claim(&self, owner: &str) -> Claim<String> {
        match owner.strip_prefix(OWNER).and_then(|o| o.rsplit_once(':')) {
            Some((name, _)) => Claim::Plan(name.to_string()),
            None if owner.starts_with(OWNER) => Claim::Unknown,
            None => Claim::NotMine,
        }
    }

    fn period(&self) -> Duration {
        Duration::from_secs(3600)
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
        let ins: Vec<serde_json::Value> = scripts
            .iter()
            .enumerate()
            .map(|(i, s)| serde_json::json!({"name": format!("{name}{}", i + 1), "command": "sh", "args": ["-c", s]}))
            .collect();
        let raw = serde_json::to_vec(&serde_json::json!({ "instructions": ins })).unwrap();
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
            writes: 0,
            history: Vec::new(),
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
    async fn until(&self, name: &str, what: &str, pred: impl Fn(&Stored) -> bool) -> Stored {
        let mut writes = self.store.writes.subscribe();
        let waited = tokio::time::timeout(GUARD, async {
            loop {
                let p = self.get(name);
                if pred(&p) {
                    return p;
                }
                writes.changed().await.unwrap();
            }
        })
        .await;
        waited.unwrap_or_else(|_| panic!("plan {name} never became {what}: {:?}", self.get(name)))
    }

    /// Wake the loop and wait until it has looked at every plan again.
    async fn look_again(&self) {
        let mut looks = self.store.looks.subscribe();
        let want = *looks.borrow_and_update() + self.store.plans.lock().unwrap().len() as u64;
        self.store.changed.notify_one();
        tokio::time::timeout(GUARD, looks.wait_for(|n| *n >= want)).await.expect("the loop looked again").unwrap();
    }

    fn start(&self) -> (watch::Sender<bool>, tokio::task::JoinHandle<(AgentExit, MemSource)>) {
        let (tx, rx) = watch::channel(false);
        let r = Reconciler::new(MemSource(self.store.clone()), self.app.clone(), Arc::new(Prober::new()), rx);
        (tx, tokio::spawn(r.run()))
    }
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
    stop.send(true).unwrap();
    let (exit, _) = tokio::time::timeout(GUARD, agent).await.unwrap().unwrap();
    assert_eq!(exit, AgentExit::Clean);
    assert_eq!(fx.get("c").history, [PlanState::InProgress, PlanState::Canceled]);
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
    stop.send(true).unwrap();
    tokio::time::timeout(GUARD, agent).await.unwrap().unwrap();
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
    stop.send(true).unwrap();
    let (exit, _) = tokio::time::timeout(GUARD, second).await.unwrap().unwrap();
    assert_eq!(exit, AgentExit::Clean);
    let d = fx.get("d");
    assert_eq!((d.state, d.history), (PlanState::InProgress, vec![PlanState::InProgress]));
    assert!(std::fs::read_dir(fx.dir.path().join("pids")).unwrap().next().is_none(), "no PID records left");
}

/// A pause that lands while the start is being written takes effect before anything runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_landing_with_the_start_runs_nothing() {
    let fx = fixture();
    let log = fx.path("log");
    fx.add("a", &[&format!("echo a >> {log}")]);
    // The source reports the pause at the first look after the start commit: the write and the
    // producer's pause race, and the pause wins.
    struct PauseOnBegin(MemSource);
    impl PlanSource for PauseOnBegin {
        type Key = String;
        async fn changed(&mut self) -> bool {
            self.0.changed().await
        }
        async fn keys(&mut self) -> Vec<String> {
            self.0.keys().await
        }
        async fn look(&mut self, k: &String) -> Seen {
            self.0.look(k).await
        }
        async fn commit(&mut self, k: &String, l: &Look, c: &Commit) -> Written {
            let w = self.0.commit(k, l, c).await;
            if matches!(c, Commit::Begin { .. }) {
                self.0.write(k, |p| p.paused = Some("true".into()));
            }
            w
        }
        async fn record(&mut self, k: &String, l: &Look, o: Outcome<'_>) -> Written {
            self.0.record(k, l, o).await
        }
        async fn not_started(&mut self, k: &String, l: &Look, e: &ApplyError) -> Option<Written> {
            self.0.not_started(k, l, e).await
        }
        async fn write_probes(&mut self, k: &String, l: &Look, s: BTreeMap<String, ProbeStatus>) -> Written {
            self.0.write_probes(k, l, s).await
        }
        async fn flush(&mut self, k: &String) -> Written {
            self.0.flush(k).await
        }
        async fn set_blocked(&mut self, k: &String, why: Option<&str>) {
            self.0.set_blocked(k, why).await
        }
        fn interrupt(&mut self, k: &String, l: &Look) -> Observed {
            self.0.interrupt(k, l)
        }
        fn owner(&self, k: &String, l: &Look) -> String {
            self.0.owner(k, l)
        }
        fn claim(&self, o: &str) -> Claim<String> {
            self.0.claim(o)
        }
        fn period(&self) -> Duration {
            self.0.period()
        }
    }
    let (stop, rx) = watch::channel(false);
    let source = PauseOnBegin(MemSource(fx.store.clone()));
    let agent = tokio::spawn(Reconciler::new(source, fx.app.clone(), Arc::new(Prober::new()), rx).run());
    let a = fx.until("a", "paused", |p| p.state == PlanState::Paused).await;
    assert_eq!(a.checkpoint.map(|c| (c.completed_instructions, c.paused)), Some((0, true)));
    assert_eq!(lines(&log), 0, "nothing ran");
    stop.send(true).unwrap();
    tokio::time::timeout(GUARD, agent).await.unwrap().unwrap();
}

#[test]
fn back_off_steps_double_only_once_their_delay_has_passed() {
    let t0 = Instant::now();
    let mut s = Step::new(Duration::from_secs(1));
    let first = s.next(t0);
    assert!(first >= Duration::from_secs(1) && first <= Duration::from_millis(1100), "{first:?}");
    // Looked at again early (a change woke the loop): the same deadline, not a doubled one.
    let again = s.next(t0 + Duration::from_millis(500));
    assert_eq!(again, first - Duration::from_millis(500));
    let second = s.next(t0 + first);
    assert!(second >= Duration::from_secs(2) && second <= Duration::from_millis(2200), "{second:?}");
    for _ in 0..20 {
        let now = s.until.unwrap();
        assert!(s.next(now) <= Duration::from_secs(301));
    }
    s.reset(Duration::from_secs(1));
    assert!(s.next(t0) <= Duration::from_millis(1100));
    // Jitter stays within a tenth, and at most a second.
    for d in [Duration::ZERO, Duration::from_secs(5), Duration::from_secs(300)] {
        let j = jittered(d);
        assert!(j >= d && j <= d + (d / 10).min(Duration::from_secs(1)), "{d:?} → {j:?}");
    }
}

/// A write the server asked to retry later (HTTP 429 with a hint) waits out the hint, jittered,
/// instead of the loop's own back-off, and leaves that back-off where it was.
#[tokio::test]
async fn a_failed_write_waits_out_the_servers_hint() {
    let fx = fixture();
    let (_stop, rx) = watch::channel(false);
    let mut r = Reconciler::new(MemSource(fx.store.clone()), fx.app.clone(), Arc::new(Prober::new()), rx);
    let key = "a".to_string();
    let hinted = r.write_failed(&key, "x", "429", Some(Duration::from_secs(7)));
    let Action::After(d) = hinted else { panic!("{hinted:?}") };
    assert!(d >= Duration::from_secs(7) && d <= Duration::from_millis(7700), "{d:?}");
    assert!(r.mem(&key).write.until.is_none(), "the own back-off is not stepped");
    let own = r.write_failed(&key, "x", "down", None);
    let Action::After(d) = own else { panic!("{own:?}") };
    assert!(d >= Duration::from_secs(1) && d <= Duration::from_millis(1100), "{d:?}");
}

/// A source whose API server can be down: its writes fail while `down` holds; each attempt's
/// (virtual) time is recorded. `kept`: an outcome the source keeps from an earlier failed write.
/// Its period is a second: the loop looks at its plans every second.
struct Flaky {
    inner: MemSource,
    down: Arc<std::sync::atomic::AtomicBool>,
    /// The next attempt finds the plan changed (a conflict): the write is abandoned.
    abandon: Arc<std::sync::atomic::AtomicBool>,
    /// The source sees no plan (its key stays listed).
    vanish: Arc<std::sync::atomic::AtomicBool>,
    kept: bool,
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
    async fn record(&mut self, k: &String, l: &Look, o: Outcome<'_>) -> Written {
        self.inner.record(k, l, o).await
    }
    async fn not_started(&mut self, k: &String, l: &Look, e: &ApplyError) -> Option<Written> {
        self.inner.not_started(k, l, e).await
    }
    async fn write_probes(&mut self, k: &String, l: &Look, s: BTreeMap<String, ProbeStatus>) -> Written {
        self.inner.write_probes(k, l, s).await
    }
    async fn flush(&mut self, _: &String) -> Written {
        if !self.kept {
            return Written::Done;
        }
        let w = self.attempt();
        self.kept = w != Written::Done;
        w
    }
    async fn set_blocked(&mut self, k: &String, why: Option<&str>) {
        self.inner.set_blocked(k, why).await
    }
    fn interrupt(&mut self, k: &String, l: &Look) -> Observed {
        self.inner.interrupt(k, l)
    }
    fn owner(&self, k: &String, l: &Look) -> String {
        self.inner.owner(k, l)
    }
    fn claim(&self, o: &str) -> Claim<String> {
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
        let inner = MemSource(self.store.clone());
        let source = Flaky { inner, down: down.clone(), abandon, vanish, kept, attempts };
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
    assert!(!source.kept, "the outcome landed");
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
    tokio::time::timeout(GUARD, looks.wait_for(|n| *n >= 3)).await.expect("tried again").unwrap();
    std::fs::remove_file(fx.dir.path().join("work")).unwrap();
    fx.until("a", "succeeded", |p| p.state == PlanState::Succeeded).await;
    let start = *looks.borrow_and_update();
    let spun = tokio::time::timeout(Duration::from_secs(3 * 3600), looks.wait_for(|n| *n >= start + 100)).await.is_ok();
    assert!(!spun, "looked at {} times", *looks.borrow() - start);
    assert_eq!(lines(&log), 1);
    stop.send(true).unwrap();
    agent.await.unwrap();
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
