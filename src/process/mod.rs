//! The process layer: the only place in nodeplan that spawns, waits for or signals a process.
//!
//! It owns spawning (argv, env, cwd, stdin from /dev/null, its own process group, its own cgroup
//! leaf when a hierarchy is usable: cgroup v2, born in it with clone3 or joining it before exec,
//! else a cgroup v1 freezer leaf joined before exec; see [`cgroup`]), concurrent capture of stdout
//! and stderr, the stop ladder (SIGTERM+SIGCONT to the tree, grace, SIGKILL: `cgroup.kill` on v2,
//! freeze, kill and thaw on v1; kill timeout), typed outcomes, PID records, the owner locks of
//! `apply` and `supervise`, crash recovery, and the respawn loop of `nodeplan supervise`. It knows
//! nothing about plans beyond whose a process is (an [`Owner`]: source, plan id, instruction slot,
//! kept in its PID record so that recovery can tell callers whose leftover it found): callers hand
//! it a [`SpawnSpec`] and a [`StopSignal`] and get a [`RunResult`] back. Nothing here ever waits on
//! pipe EOF alone, so an escaped grandchild that holds a pipe cannot hang a run.

mod capture;
pub mod cgroup;
mod outcome;
mod owner;
pub mod owner_lock;
mod procfs;
pub(crate) use procfs::{boot_id, own_identity, running};
mod record;
mod spawn;
pub mod supervise;
mod tree;

pub use capture::{Capture, LineSink, LogSink, NullSink, Output, Stream};
pub use cgroup::CgroupMode;
pub use outcome::{ExitKind, Outcome, Rung, StopPolicy, StopReason, signal_name};
pub use owner::{Owner, Slot, Source};
pub use owner_lock::{LockError, OwnerLock};
pub use record::{PidRecord, RecordFile};
pub use tree::MARKER_ENV;

use capture::Captures;
use record::Identity;
use std::ffi::OsString;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tree::{Tree, TreeOps};

/// How often the ladder looks at the tree while waiting for it to empty.
const POLL: Duration = Duration::from_millis(5);

#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub policy: StopPolicy,
    /// Bytes kept per stream (and for the interleaved capture), head and tail.
    pub capture_limit: usize,
    pub cgroup: CgroupMode,
    /// Where PID records go; `None` = no records.
    pub pid_dir: Option<PathBuf>,
    /// After the process exits by itself, how long to keep reading pipes that a leftover process
    /// still holds open.
    pub drain_timeout: Duration,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            policy: StopPolicy::default(),
            capture_limit: 64 * 1024,
            cgroup: CgroupMode::Auto,
            pid_dir: None,
            drain_timeout: Duration::from_secs(1),
        }
    }
}

/// What to run.
#[derive(Clone)]
pub struct SpawnSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    /// The complete environment of the process (nothing is inherited implicitly).
    pub env: Vec<(OsString, OsString)>,
    pub cwd: Option<PathBuf>,
    /// What the process belongs to; stored in its PID record.
    pub owner: Owner,
    /// Run the stop ladder after this long.
    pub timeout: Option<Duration>,
    pub sink: Arc<dyn LineSink>,
}

impl SpawnSpec {
    /// `program args…` with the agent's own environment and no sink.
    pub fn new(program: impl Into<OsString>, args: impl IntoIterator<Item = impl Into<OsString>>) -> SpawnSpec {
        SpawnSpec {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: std::env::vars_os().collect(),
            cwd: None,
            owner: Owner::default(),
            timeout: None,
            sink: Arc::new(NullSink),
        }
    }
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub outcome: Outcome,
    pub output: Output,
    pub pid: Option<i32>,
    pub marker: String,
    pub elapsed: Duration,
}

type Changed<'a> = Pin<Box<dyn Future<Output = bool> + Send + 'a>>;

trait StopSource: Send + Sync {
    fn requested(&self) -> Option<StopReason>;
    /// Resolves when the value may have changed; false when it never will again.
    fn changed(&mut self) -> Changed<'_>;
    fn boxed_clone(&self) -> Box<dyn StopSource>;
}

struct Mapped<T> {
    rx: watch::Receiver<T>,
    f: fn(&T) -> Option<StopReason>,
}

impl<T: Send + Sync + 'static> StopSource for Mapped<T> {
    fn requested(&self) -> Option<StopReason> {
        (self.f)(&self.rx.borrow())
    }
    fn changed(&mut self) -> Changed<'_> {
        Box::pin(async move { self.rx.changed().await.is_ok() })
    }
    fn boxed_clone(&self) -> Box<dyn StopSource> {
        Box::new(Mapped { rx: self.rx.clone(), f: self.f })
    }
}

/// How a run learns that it must stop: a view of some `watch` channel. A stop that is already
/// requested prevents the spawn.
pub struct StopSignal {
    src: Box<dyn StopSource>,
}

impl Clone for StopSignal {
    fn clone(&self) -> Self {
        StopSignal { src: self.src.boxed_clone() }
    }
}

impl StopSignal {
    /// A signal and the sender that triggers it.
    pub fn channel() -> (watch::Sender<Option<StopReason>>, StopSignal) {
        let (tx, rx) = watch::channel(None);
        (tx, StopSignal::from_watch(rx, |v| *v))
    }

    /// Never requests a stop (timeouts still apply).
    pub fn never() -> StopSignal {
        let (tx, s) = StopSignal::channel();
        // Keep the sender alive forever so `changed` never reports "closed" in a busy loop.
        std::mem::forget(tx);
        s
    }

    /// A view of any watch channel through a projection.
    pub fn from_watch<T: Send + Sync + 'static>(rx: watch::Receiver<T>, f: fn(&T) -> Option<StopReason>) -> StopSignal {
        StopSignal { src: Box::new(Mapped { rx, f }) }
    }

    pub fn requested(&self) -> Option<StopReason> {
        self.src.requested()
    }

    /// Resolves with the reason once a stop is requested; never resolves otherwise.
    pub async fn wait(&mut self) -> StopReason {
        loop {
            if let Some(r) = self.src.requested() {
                return r;
            }
            if !self.src.changed().await {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Spawns, supervises and stops processes. Cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

struct Inner {
    config: SupervisorConfig,
    cgroups: Option<cgroup::CgroupRoot>,
    seq: AtomicU64,
    leaf_warned: AtomicBool,
    /// Spawning straight into the cgroup works here (until the kernel says otherwise).
    clone3: AtomicBool,
    /// Leaves of runs whose process exited by itself and left processes behind (a daemon it
    /// started): removed once they are empty.
    lingering: Mutex<Vec<PathBuf>>,
}

static CGROUP_WARNING: OnceLock<()> = OnceLock::new();

impl Supervisor {
    pub fn new(config: SupervisorConfig) -> Supervisor {
        let cgroups = match cgroup::CgroupRoot::discover(&config.cgroup) {
            Ok(c) => c,
            Err(e) => {
                CGROUP_WARNING.get_or_init(|| {
                    tracing::warn!("no usable cgroup hierarchy ({e}); process trees are tracked by process group and run marker only, so a setsid escapee that clears its environment cannot be stopped");
                });
                None
            }
        };
        Supervisor {
            inner: Arc::new(Inner {
                config,
                cgroups,
                seq: AtomicU64::new(0),
                leaf_warned: AtomicBool::new(false),
                clone3: AtomicBool::new(true),
                lingering: Mutex::new(Vec::new()),
            }),
        }
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    /// The directory under which runs get their cgroups, if cgroups are in use.
    pub fn cgroup_root(&self) -> Option<&Path> {
        self.inner.cgroups.as_ref().map(|c| c.dir.as_path())
    }

    /// Take `owner`'s lock in the PID directory (see [`owner_lock`]) before recovering and running
    /// anything of it: [`LockError::Held`] names the live instance that holds it. `None` without a
    /// PID directory.
    pub fn lock_owner(&self, owner: &Owner) -> Result<Option<OwnerLock>, LockError> {
        match &self.inner.config.pid_dir {
            Some(dir) => owner_lock::lock(dir, owner).map(Some),
            None => Ok(None),
        }
    }

    fn new_marker(&self) -> String {
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        // The agent's pid and start time first: a later agent can tell whether the one that made
        // a cgroup leaf still runs, even once its pid is reused.
        format!("np{}.{:x}-{n}-{nanos:08x}", std::process::id(), own_start_time())
    }

    /// Run `spec` to completion: until it exits by itself, or until `stop` or its timeout runs the
    /// stop ladder. Never hangs: every wait is bounded once a stop is requested.
    pub async fn run(&self, spec: SpawnSpec, stop: &mut StopSignal) -> RunResult {
        self.sweep_lingering();
        let started = Instant::now();
        let marker = self.new_marker();
        let finish = |outcome, output, pid| RunResult {
            outcome,
            output,
            pid,
            marker: marker.clone(),
            elapsed: started.elapsed(),
        };
        if let Some(r) = stop.requested() {
            return finish(Outcome::NotStarted(r), Output::default(), None);
        }
        let mut setup = match self.set_up(&spec, &marker) {
            Ok(s) => s,
            Err(outcome) => return finish(outcome, Output::default(), None),
        };
        // The last look before the process exists: a stop requested during the set-up above
        // prevents the spawn (R7).
        if let Some(r) = stop.requested() {
            return finish(setup.abandon(Outcome::NotStarted(r)), Output::default(), None);
        }
        let deadline = spec.timeout.map(|t| tokio::time::Instant::now() + t);
        let spec = Arc::new(spec);
        let started_child = match self.spawn_child(&spec, &marker, &mut setup, stop, deadline).await {
            Ok(s) => s,
            Err(outcome) => return finish(outcome, Output::default(), None),
        };
        let (outcome, output, pid) = self.follow(&spec, &marker, setup, started_child, stop, deadline).await;
        finish(outcome, output, Some(pid))
    }

    /// The run's cgroup leaf (when one can be made) and its PID record. The record exists before
    /// the process does (pid 0 = not known yet): an agent killed at any moment after the spawn
    /// leaves a record that finds the tree by its cgroup or marker. Without its record a process
    /// could not be found again after a crash (R17): no record, no spawn (`Err`, the leaf removed).
    fn set_up(&self, spec: &SpawnSpec, marker: &str) -> Result<Setup, Outcome> {
        let cgroup = self.create_leaf(marker);
        let record = PidRecord {
            pid: 0,
            start_time: 0,
            boot_id: procfs::boot_id().unwrap_or_default(),
            cgroup: cgroup.clone(),
            marker: marker.to_string(),
            owner: spec.owner.clone(),
            command: spec.program.to_string_lossy().into_owned(),
        };
        let file = match &self.inner.config.pid_dir {
            Some(dir) => match record.create(dir) {
                Ok(f) => Some(f),
                Err(e) => {
                    if let Some(d) = &cgroup {
                        cgroup::remove(d);
                    }
                    let why = format!("cannot write its PID record in {}: {e}", dir.display());
                    return Err(Outcome::StartFailed(why));
                }
            },
            None => None,
        };
        Ok(Setup { record, file, cgroup })
    }

    /// A cgroup leaf named `marker` under the root, when cgroups are in use and one can be made
    /// (the first failure is logged; the run then goes by its process group).
    fn create_leaf(&self, marker: &str) -> Option<PathBuf> {
        let root = self.inner.cgroups.as_ref()?;
        match root.create_leaf(marker) {
            Ok(l) => Some(l),
            Err(e) => {
                if !self.inner.leaf_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!("cannot create a cgroup under {}: {e}; using the process group", root.dir.display());
                }
                None
            }
        }
    }

    /// Start the process: born in its cgroup with a pidfd (clone3) where the kernel allows it,
    /// its exec awaited on this thread (nothing waits on the child); otherwise tokio's spawn,
    /// joining the cgroup before exec, on the blocking pool, since its spawning thread waits until
    /// the child has exec'd. A child stuck in chdir or execve (a hung network or FUSE mount) never
    /// holds the runtime's thread, and a stop or the timeout meanwhile kills it where it stands. `Err` with the run's outcome when no
    /// process runs (the set-up undone, or kept for a child stuck before its exec).
    async fn spawn_child(
        &self,
        spec: &Arc<SpawnSpec>,
        marker: &str,
        setup: &mut Setup,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Started, Outcome> {
        let mut interrupted = None;
        let born = if self.inner.clone3.load(Ordering::Relaxed) {
            self.spawn_born_in_cgroup(spec, marker, setup, stop, deadline, &mut interrupted).await?
        } else {
            None
        };
        let child = match born {
            Some(c) => c,
            None => self.spawn_joining_cgroup(spec, marker, setup, stop, deadline, &mut interrupted).await?,
        };
        Ok(Started { child, interrupted })
    }

    /// clone3 into the run's cgroup (see [`Supervisor::spawn_child`]); without one if the leaf
    /// vanished meanwhile. `Ok(None)` when the kernel cannot: remembered, and from then on
    /// children join their cgroup before exec.
    async fn spawn_born_in_cgroup(
        &self,
        spec: &Arc<SpawnSpec>,
        marker: &str,
        setup: &mut Setup,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
        interrupted: &mut Option<StopReason>,
    ) -> Result<Option<Child>, Outcome> {
        let mut spawned = self.spawn_raw(spec, marker, setup.cgroup.as_deref(), stop, deadline).await;
        if let Ok(Err(spawn::SpawnError::LeafGone(e))) = &spawned {
            tracing::warn!(
                "the cgroup of {} vanished before its spawn ({e}); starting it without one",
                spec.owner.short()
            );
            setup.forget_cgroup();
            spawned = self.spawn_raw(spec, marker, None, stop, deadline).await;
        }
        let spawned = settle(spawned, interrupted).map_err(|reason| setup.stuck(spec, reason))?;
        match spawned {
            Ok(c) => Ok(Some(Child::Raw(c))),
            Err(_) if interrupted.is_some() => {
                let reason = interrupted.unwrap_or(StopReason::Cancel);
                Err(setup.abandon(Outcome::NotStarted(reason)))
            }
            Err(spawn::SpawnError::LeafGone(e) | spawn::SpawnError::Failed(e)) => {
                let what = format!("{}: {e}", spec.program.to_string_lossy());
                Err(setup.abandon(Outcome::StartFailed(what)))
            }
            Err(spawn::SpawnError::Unsupported(e)) => {
                self.inner.clone3.store(false, Ordering::Relaxed);
                tracing::info!("clone3 into a cgroup is unavailable ({e}); children join their cgroup before exec");
                Ok(None)
            }
        }
    }

    /// tokio's spawn, joining the run's cgroup before exec (see [`Supervisor::spawn_child`]).
    async fn spawn_joining_cgroup(
        &self,
        spec: &Arc<SpawnSpec>,
        marker: &str,
        setup: &mut Setup,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
        interrupted: &mut Option<StopReason>,
    ) -> Result<Child, Outcome> {
        let mut spawned = self.spawn_tokio(spec, marker, setup.cgroup.clone(), stop, deadline).await;
        if matches!(spawned, Ok(Err(_)))
            && let Some(d) = setup.cgroup.clone()
        {
            // Joining the cgroup may be what failed (delegation, EBUSY): nothing ran, so
            // try once more with the process group only.
            cgroup::remove(&d);
            setup.forget_cgroup();
            spawned = self.spawn_tokio(spec, marker, None, stop, deadline).await;
            if matches!(spawned, Ok(Ok(_))) && !self.inner.leaf_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "cannot start processes in their own cgroup under {}; using the process group",
                    d.display()
                );
            }
        }
        let spawned = settle(spawned, interrupted).map_err(|reason| setup.stuck(spec, reason))?;
        match spawned {
            Ok(c) => Ok(Child::Tokio(c)),
            Err(_) if interrupted.is_some() => {
                let reason = interrupted.unwrap_or(StopReason::Cancel);
                Err(setup.abandon(Outcome::NotStarted(reason)))
            }
            Err(e) => {
                let what = format!("{}: {e}", spec.program.to_string_lossy());
                Err(setup.abandon(Outcome::StartFailed(what)))
            }
        }
    }

    /// Follow a started process until it exits by itself, or until a stop (one that came during
    /// its spawn, `stop`, or the timeout at `deadline`) runs the ladder on its tree. Returns the
    /// outcome, the captured output and the pid.
    async fn follow(
        &self,
        spec: &SpawnSpec,
        marker: &str,
        setup: Setup,
        started: Started,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
    ) -> (Outcome, Output, i32) {
        let Started { mut child, interrupted } = started;
        let Setup { file, cgroup: cgroup_dir, .. } = setup;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        let backend = self.backend();
        let tree =
            Tree::new(cgroup_dir.clone().map(|dir| cgroup::Leaf { dir, backend }), Some(pid), marker.to_string());
        let record_path = record_pid(file, pid);
        let captures = Captures::new(self.inner.config.capture_limit);
        let mut readers = read_output(&mut child, &captures, &spec.sink);

        let stop_reason = tokio::select! {
            biased;
            // Stopped while it was being spawned: straight to the ladder.
            r = std::future::ready(interrupted), if interrupted.is_some() => r.unwrap_or(StopReason::Cancel),
            status = child.wait() => {
                let outcome = match status {
                    Ok(s) => Outcome::Exited(ExitKind::from_status(s)),
                    Err(e) => Outcome::WaitFailed(e.to_string()),
                };
                self.after_exit(spec, &tree, pid, cgroup_dir.as_ref(), &mut readers, &outcome).await;
                if !outcome.termination_incomplete() {
                    remove_record(record_path.as_deref());
                }
                return (outcome, captures.take(), pid);
            }
            r = stop.wait() => r,
            _ = sleep_until_opt(deadline) => StopReason::Timeout(spec.timeout.unwrap_or_default()),
        };

        let outcome = ladder(&tree, Some(&mut child), &self.inner.config.policy, stop_reason, || {
            for r in &readers {
                r.abort();
            }
        })
        .await;
        if let Some(m) = outcome.ladder_metric() {
            crate::metrics::stop_ladder(m);
        }
        // After a successful stop the pipes are at EOF or were closed; never wait long on them.
        self.drain(&mut readers, Duration::from_millis(100)).await;
        if !outcome.termination_incomplete() {
            remove_record(record_path.as_deref());
            tree.leader_reaped();
            blocking(tree, |t| t.cleanup()).await;
        }
        (outcome, captures.take(), pid)
    }

    /// The process exited by itself (`outcome`): read what its pipes still hold, for a bounded
    /// time. A process that exits by itself and leaves children behind started them on purpose
    /// (a daemon): they are left alone, like any daemon started by hand. Only the run's own cgroup
    /// is tidied up once they are gone.
    async fn after_exit(
        &self,
        spec: &SpawnSpec,
        tree: &Tree,
        pid: i32,
        cgroup_dir: Option<&PathBuf>,
        readers: &mut Vec<tokio::task::JoinHandle<()>>,
        outcome: &Outcome,
    ) {
        // The leader is gone; the pgid is no longer ours to signal.
        tree.leader_reaped();
        self.drain(readers, self.inner.config.drain_timeout).await;
        // Cheap check first (the leaf's rmdir, which succeeds only once it is empty, or a
        // signal-0 probe of the group); the /proc scan only when something seems left.
        if !tree.maybe_leftovers(pid) {
            return;
        }
        let leftovers = blocking(tree.clone(), |t| t.survivors()).await;
        if leftovers > 0 {
            tracing::warn!(
                "{} exited ({outcome}) and left {leftovers} process(es) running; they are left alone{}",
                spec.program.to_string_lossy(),
                cgroup_dir.map(|d| format!(" in {}", d.display())).unwrap_or_default()
            );
            if let (Some(d), Ok(mut l)) = (cgroup_dir, self.inner.lingering.lock()) {
                l.push(d.clone());
            }
        }
        // What seemed left may have ended meanwhile (an empty leaf was already removed by the
        // check itself).
        tree.cleanup();
    }

    /// What kills a child stuck before its exec through its cgroup leaf `dir`, if it has one: the
    /// tree's own kill for the leaf's backend (`cgroup.kill` on v2, freeze-kill-thaw on v1).
    fn leaf_killer(&self, dir: Option<PathBuf>, marker: &str) -> impl FnOnce() + use<> {
        let backend = self.backend();
        let tree = dir.map(|dir| Tree::new(Some(cgroup::Leaf { dir, backend }), None, marker.to_string()));
        move || {
            if let Some(t) = tree {
                let _ = t.kill();
            }
        }
    }

    /// The kind of cgroup hierarchy the leaves are made in.
    fn backend(&self) -> cgroup::Backend {
        self.inner.cgroups.as_ref().map_or(cgroup::Backend::V2, |r| r.backend)
    }

    /// `clone3` (see [`spawn::spawn`] and [`await_spawn`]).
    async fn spawn_raw(
        &self,
        spec: &Arc<SpawnSpec>,
        marker: &str,
        dir: Option<&Path>,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
    ) -> Spawned<Result<spawn::RawChild, spawn::SpawnError>> {
        let early = Arc::new(spawn::EarlyPid::default());
        let job = {
            let (spec, marker, dir, early) =
                (spec.clone(), marker.to_string(), dir.map(Path::to_path_buf), early.clone());
            tokio::spawn(async move { spawn::spawn(&spec, &marker, dir.as_deref(), &early).await })
        };
        let leaf = self.leaf_killer(dir.map(Path::to_path_buf), marker);
        let kill = move || {
            leaf();
            early.kill();
        };
        let failed = |e| Err(spawn::SpawnError::Failed(std::io::Error::other(e)));
        await_spawn(job, failed, kill, stop, deadline, spec.timeout, self.inner.config.policy.kill_timeout).await
    }

    /// tokio's spawn (joining the cgroup `dir` before exec) on the blocking pool. A child stuck
    /// before exec can only be killed through its cgroup here.
    async fn spawn_tokio(
        &self,
        spec: &Arc<SpawnSpec>,
        marker: &str,
        dir: Option<PathBuf>,
        stop: &mut StopSignal,
        deadline: Option<tokio::time::Instant>,
    ) -> Spawned<std::io::Result<tokio::process::Child>> {
        let kill = self.leaf_killer(dir.clone(), marker);
        let job = {
            let (spec, marker) = (spec.clone(), marker.to_string());
            tokio::task::spawn_blocking(move || {
                let procs = dir.as_deref().map(cgroup::open_procs).transpose()?;
                command(&spec, &marker, procs.as_ref().map(|fd| fd.as_raw_fd())).spawn()
            })
        };
        let failed = |e| Err(std::io::Error::other(e));
        await_spawn(job, failed, kill, stop, deadline, spec.timeout, self.inner.config.policy.kill_timeout).await
    }

    /// Remove the cgroups of daemons left by earlier runs once they are empty.
    fn sweep_lingering(&self) {
        if let Ok(mut l) = self.inner.lingering.lock()
            && !l.is_empty()
        {
            l.retain(|d| std::fs::remove_dir(d).is_err_and(|e| e.kind() != std::io::ErrorKind::NotFound));
        }
    }

    async fn drain(&self, readers: &mut Vec<tokio::task::JoinHandle<()>>, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        for r in readers.iter_mut() {
            if tokio::time::timeout_at(deadline, &mut *r).await.is_err() {
                tracing::warn!("an output pipe is still held open by a leftover process; stopped reading it");
                r.abort();
            }
        }
        readers.clear();
    }

    /// Verify and stop what a previous agent left behind: every PID record in the PID directory
    /// accepted by `filter`. Records that do not match a live process of ours are discarded and
    /// their pid is never signalled. Records (or a whole PID directory) that cannot be trusted are
    /// [`RecoveryResult::Refused`] whatever `filter` says, since their owner is not known: callers
    /// hold what they were about to run, as for a leftover that could not be stopped.
    pub async fn recover(&self, filter: impl Fn(&PidRecord) -> bool) -> Vec<Recovered> {
        if let Some(root) = self.cgroup_root() {
            blocking(root.to_path_buf(), |r| cgroup::sweep_dead_agents(&r)).await;
        }
        self.sweep_lingering();
        let Some(dir) = self.inner.config.pid_dir.clone() else {
            return Vec::new();
        };
        let entries = match blocking(dir.clone(), |d| record::scan(&d)).await {
            Ok(e) => e,
            Err(why) => {
                tracing::error!("{why}");
                return vec![Recovered { path: dir, record: None, result: RecoveryResult::Refused(why) }];
            }
        };
        let mut out = Vec::new();
        for (path, entry) in entries {
            let rec = match entry {
                record::Entry::Record(r) => r,
                record::Entry::Invalid(e) => {
                    let kept = path.with_extension("invalid");
                    tracing::warn!("{}: {e}; renamed to {} and ignored", path.display(), kept.display());
                    let _ = std::fs::rename(&path, &kept);
                    let result = RecoveryResult::Invalid(e);
                    crate::metrics::pid_record_recovered(result.metric());
                    out.push(Recovered { path, record: None, result });
                    continue;
                }
                record::Entry::Untrusted(why) => {
                    tracing::error!("{why}");
                    let result = RecoveryResult::Refused(why);
                    crate::metrics::pid_record_recovered(result.metric());
                    out.push(Recovered { path, record: None, result });
                    continue;
                }
            };
            if !filter(&rec) {
                continue;
            }
            let result = match self.recover_one(&rec).await {
                RecoveryResult::Refused(why) => RecoveryResult::Refused(format!(
                    "PID record {} of {} {why}; refused (nothing was signalled, the record is kept)",
                    path.display(),
                    rec.owner.short()
                )),
                r => r,
            };
            crate::metrics::pid_record_recovered(result.metric());
            match &result {
                RecoveryResult::Stopped(o) => {
                    tracing::info!("stopped leftover {} of {}: {o}", rec.describe(), rec.owner.short())
                }
                RecoveryResult::NotStopped(o) => {
                    tracing::error!("leftover {} of {} could not be stopped: {o}", rec.describe(), rec.owner.short())
                }
                RecoveryResult::Mismatch(why) => {
                    tracing::warn!("discarding PID record {}: {why}; pid {} not signalled", path.display(), rec.pid)
                }
                RecoveryResult::Refused(why) => tracing::error!("{why}"),
                RecoveryResult::OwnerAlive(pid) => tracing::warn!(
                    "{} of {} belongs to nodeplan pid {pid}, which is still running; left alone",
                    rec.describe(),
                    rec.owner
                ),
                _ => {}
            }
            if !matches!(
                result,
                RecoveryResult::NotStopped(_) | RecoveryResult::Refused(_) | RecoveryResult::OwnerAlive(_)
            ) {
                remove_record(Some(&path));
            }
            out.push(Recovered { path, record: Some(rec), result });
        }
        out
    }

    /// Stop what one trusted record describes. Signals go only to a verified leaf (exactly this
    /// agent's cgroup root plus the record's marker, on a cgroup filesystem), to the verified
    /// leader and its process group, or to processes verified through their /proc dirfd to carry
    /// the record's unique marker; never to a pid, pgid or cgroup taken from the record on trust.
    async fn recover_one(&self, rec: &PidRecord) -> RecoveryResult {
        if procfs::boot_id().is_ok_and(|b| b != rec.boot_id) {
            // Nothing of another boot can be running; its cgroups went with it.
            return RecoveryResult::Gone;
        }
        let leaf = match (&rec.cgroup, &self.inner.cgroups) {
            (None, _) => None,
            (Some(c), None) => {
                return RecoveryResult::Refused(format!(
                    "names cgroup {}, which cannot be verified without a cgroup root (cgroups are off or unavailable here)",
                    c.display()
                ));
            }
            (Some(c), Some(root)) => {
                let (root, c, marker) = (root.clone(), c.clone(), rec.marker.clone());
                match blocking((), move |_| root.verify_leaf(&c, &marker).map(|l| l.map(|d| root.leaf(d)))).await {
                    Ok(l) => l,
                    Err(why) => return RecoveryResult::Refused(why),
                }
            }
        };
        // A run of another live nodeplan process (its marker names it: pid, start time, and the
        // record's boot) is not a leftover, whatever it looks like: never stopped from here.
        if let Some(pid) = blocking(rec.clone(), |r| r.live_owner()).await {
            return RecoveryResult::OwnerAlive(pid);
        }
        let identity = blocking(rec.clone(), |r| r.verify()).await;
        // The leader's process group only while the leader itself is verified alive (its pgid
        // cannot have been reused then).
        let pgid = matches!(identity, Identity::Match).then_some(rec.pid);
        let tree = match &leaf {
            Some(l) => Tree::new(Some(l.clone()), None, rec.marker.clone()),
            None => Tree::new(None, pgid, rec.marker.clone()),
        };
        if blocking(tree.clone(), |t| t.is_empty()).await {
            blocking(tree, |t| t.cleanup()).await;
            return match identity {
                Identity::Mismatch(why) => RecoveryResult::Mismatch(why),
                _ => RecoveryResult::Gone,
            };
        }
        if let Identity::Mismatch(why) = &identity {
            tracing::warn!(
                "PID record of {}: {why}; stopping only {}",
                rec.owner.short(),
                if leaf.is_some() { "its verified cgroup leaf" } else { "the processes that carry its marker" }
            );
        }
        let outcome = ladder(&tree, None, &self.inner.config.policy, StopReason::Shutdown, || {}).await;
        if let Some(m) = outcome.ladder_metric() {
            crate::metrics::stop_ladder(m);
        }
        if outcome.termination_incomplete() {
            RecoveryResult::NotStopped(outcome)
        } else {
            blocking(tree, |t| t.cleanup()).await;
            RecoveryResult::Stopped(outcome)
        }
    }
}

/// One PID record found by [`Supervisor::recover`].
#[derive(Debug)]
pub struct Recovered {
    pub path: PathBuf,
    pub record: Option<PidRecord>,
    pub result: RecoveryResult,
}

impl Recovered {
    /// Why what this record belongs to must not run now (a leftover that could not be stopped, or
    /// a record that was refused); `None` when recovery is done with it.
    pub fn hold_reason(&self) -> Option<String> {
        match &self.result {
            RecoveryResult::NotStopped(o) => Some(format!(
                "a leftover process ({}) could not be stopped: {o}",
                self.record.as_ref().map(PidRecord::describe).unwrap_or_default()
            )),
            RecoveryResult::Refused(why) => Some(why.clone()),
            RecoveryResult::OwnerAlive(pid) => Some(format!(
                "{} belongs to nodeplan pid {pid}, which is still running",
                self.record.as_ref().map(PidRecord::describe).unwrap_or_default()
            )),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum RecoveryResult {
    /// The record could not be parsed; it was renamed to `*.invalid` and nothing was signalled.
    Invalid(String),
    /// Nothing of the run is left.
    Gone,
    /// The pid is someone else's now; it was not signalled.
    Mismatch(String),
    /// Leftovers were found and stopped through the ladder.
    Stopped(Outcome),
    /// Leftovers could not be stopped; the record is kept.
    NotStopped(Outcome),
    /// The record (or the whole PID directory) cannot be trusted: a symbolic link, not a regular
    /// file, the wrong owner or mode, or a cgroup that is not this agent's leaf for its marker.
    /// Nothing was signalled or removed; the record is kept and what it belongs to must be held.
    Refused(String),
    /// The run belongs to another nodeplan process (this pid) that is still running: not a
    /// leftover. Nothing was signalled; the record is kept and what it belongs to must be held.
    OwnerAlive(i32),
}

impl RecoveryResult {
    /// What the recovery metric says of this result.
    pub fn metric(&self) -> crate::metrics::Recovery {
        use crate::metrics::Recovery;
        match self {
            RecoveryResult::Invalid(_) => Recovery::Invalid,
            RecoveryResult::Gone => Recovery::Gone,
            RecoveryResult::Mismatch(_) => Recovery::Mismatch,
            RecoveryResult::Stopped(_) => Recovery::Stopped,
            RecoveryResult::NotStopped(_) => Recovery::NotStopped,
            RecoveryResult::Refused(_) => Recovery::Refused,
            RecoveryResult::OwnerAlive(_) => Recovery::OwnerAlive,
        }
    }
}

fn remove_record(path: Option<&Path>) {
    if let Some(p) = path
        && let Err(e) = std::fs::remove_file(p)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("cannot remove PID record {}: {e}", p.display());
    }
}

async fn sleep_until_opt(d: Option<tokio::time::Instant>) {
    match d {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// A spawn that a stop or the timeout interrupted: the child (if any) was killed where it stood;
/// `result` is what the spawn returned once the kill freed it, `None` when it is still stuck.
struct Interrupted<R> {
    reason: StopReason,
    result: Option<R>,
}

/// What a spawn (a task awaiting its child's exec) came to.
type Spawned<R> = Result<R, Interrupted<R>>;

/// How long a spawn still running when a stop comes gets to return before its child is killed
/// where it stands.
const SPAWN_SETTLE: Duration = Duration::from_secs(1);

/// Await a spawn (its task), or, on a stop or at `deadline`, give it a moment
/// to return (then the caller stops the child through the ladder like any other), else `kill` the
/// child where it stands and give the spawn `kill_wait` more to return.
async fn await_spawn<R>(
    job: tokio::task::JoinHandle<R>,
    failed: impl Fn(tokio::task::JoinError) -> R,
    kill: impl FnOnce(),
    stop: &mut StopSignal,
    deadline: Option<tokio::time::Instant>,
    timeout: Option<Duration>,
    kill_wait: Duration,
) -> Spawned<R> {
    tokio::pin!(job);
    let reason = tokio::select! {
        biased;
        r = &mut job => return Ok(r.unwrap_or_else(&failed)),
        r = stop.wait() => r,
        _ = sleep_until_opt(deadline) => StopReason::Timeout(timeout.unwrap_or_default()),
    };
    // On a loaded machine the child may have exec'd (and be running) while its spawn has not
    // heard so yet: that child deserves the ladder (SIGTERM first,
    // a chance to clean up), which the caller gives it since the stop stays requested. Only a
    // spawn that is still not back, a child stuck before its exec, is killed where it stands.
    if let Ok(r) = tokio::time::timeout(SPAWN_SETTLE.min(kill_wait), &mut job).await {
        return Ok(r.unwrap_or_else(&failed));
    }
    kill();
    let result = tokio::time::timeout(kill_wait, &mut job).await.ok().map(|r| r.unwrap_or_else(&failed));
    Err(Interrupted { reason, result })
}

/// The spawned value, noting in `interrupted` why a stop came during the spawn; `Err` with that
/// reason when the child is still stuck.
fn settle<R>(spawned: Spawned<R>, interrupted: &mut Option<StopReason>) -> Result<R, StopReason> {
    match spawned {
        Ok(r) => Ok(r),
        Err(Interrupted { reason, result: Some(r) }) => {
            *interrupted = Some(reason);
            Ok(r)
        }
        Err(Interrupted { reason, result: None }) => Err(reason),
    }
}

/// A run between its set-up and its process: its PID record (with the open file its pid is
/// appended to) and its cgroup leaf, which a spawn that does not happen undoes.
struct Setup {
    record: PidRecord,
    file: Option<RecordFile>,
    cgroup: Option<PathBuf>,
}

impl Setup {
    /// Nothing was started: the record and the leaf are removed. Returns `outcome`.
    fn abandon(&mut self, outcome: Outcome) -> Outcome {
        remove_record(self.file.take().as_ref().map(RecordFile::path));
        if let Some(d) = self.cgroup.take() {
            cgroup::remove(&d);
        }
        outcome
    }

    /// A child stuck before its exec (see [`stuck_before_exec`]): its record is kept.
    fn stuck(&mut self, spec: &SpawnSpec, reason: StopReason) -> Outcome {
        stuck_before_exec(spec, self.file.take());
        Outcome::Incomplete { reason, survivors: 1 }
    }

    /// The run goes on without its cgroup: its PID record stops naming one.
    fn forget_cgroup(&mut self) {
        self.cgroup = None;
        self.record.cgroup = None;
        if let Some(f) = &mut self.file
            && let Err(e) = self.record.rewrite(f)
        {
            tracing::warn!("cannot rewrite the PID record {}: {e}", f.path().display());
        }
    }
}

/// A process that was started, and the stop that came during its spawn, if one did.
struct Started {
    child: Child,
    interrupted: Option<StopReason>,
}

/// Append the pid and its start time to the run's open record (one write), before the output is
/// read: no line the process printed is seen before its record names it. Returns the record's path.
fn record_pid(file: Option<RecordFile>, pid: i32) -> Option<PathBuf> {
    let mut f = file?;
    let start_time = procfs::ProcHandle::open(pid).and_then(|h| h.stat()).map(|s| s.start_time).unwrap_or(0);
    if let Err(e) = f.set_pid(pid, start_time) {
        tracing::warn!("cannot update the PID record of pid {pid}: {e}");
    }
    Some(f.path().to_path_buf())
}

/// Read the child's stdout and stderr, each on a task of its own, into `captures` and `sink`.
fn read_output(
    child: &mut Child,
    captures: &Arc<Captures>,
    sink: &Arc<dyn LineSink>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut readers = Vec::new();
    for stream in [Stream::Stdout, Stream::Stderr] {
        if let Some(pipe) = child.take_output(stream) {
            let read = capture::read_lines(pipe, stream, captures.clone(), sink.clone());
            readers.push(tokio::spawn(tracing::Instrument::in_current_span(read)));
        }
    }
    readers
}

/// A child that SIGKILL did not free from before its exec (an uninterruptible wait in the
/// kernel): its PID record stays, so that a later recovery finds it by its cgroup or marker.
fn stuck_before_exec(spec: &SpawnSpec, record: Option<RecordFile>) {
    tracing::error!(
        "{} is stuck before exec and survived SIGKILL; its PID record is kept",
        spec.program.to_string_lossy()
    );
    drop(record);
}

/// A started child: spawned by tokio (joining its cgroup before exec, or without one) or by
/// [`spawn::spawn`] (born in its cgroup). The one owner of its wait and its kill.
enum Child {
    Tokio(tokio::process::Child),
    Raw(spawn::RawChild),
}

type Pipe = Box<dyn tokio::io::AsyncRead + Send + Unpin>;

impl Child {
    fn id(&self) -> Option<u32> {
        match self {
            Child::Tokio(c) => c.id(),
            Child::Raw(c) => Some(c.pid as u32),
        }
    }

    /// Wait for the process to end and reap it (cancel-safe).
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            Child::Tokio(c) => c.wait().await,
            Child::Raw(c) => c.wait().await,
        }
    }

    fn start_kill(&mut self) -> std::io::Result<()> {
        match self {
            Child::Tokio(c) => c.start_kill(),
            Child::Raw(c) => c.start_kill(),
        }
    }

    fn take_output(&mut self, stream: Stream) -> Option<Pipe> {
        match (self, stream) {
            (Child::Tokio(c), Stream::Stdout) => c.stdout.take().map(|p| Box::new(p) as Pipe),
            (Child::Tokio(c), Stream::Stderr) => c.stderr.take().map(|p| Box::new(p) as Pipe),
            (Child::Raw(c), s) => {
                let fd = if s == Stream::Stdout { c.stdout.take() } else { c.stderr.take() }?;
                match tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
                    Ok(r) => Some(Box::new(r) as Pipe),
                    Err(e) => {
                        tracing::warn!("cannot read the output pipe of pid {}: {e}", c.pid);
                        None
                    }
                }
            }
        }
    }
}

/// The command for `spec`: its own environment plus the run marker, stdin from /dev/null, piped
/// output, its own process group, and (with `cgroup_procs`) joining a cgroup before exec.
fn command(spec: &SpawnSpec, marker: &str, cgroup_procs: Option<std::os::fd::RawFd>) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(MARKER_ENV, marker)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    // SAFETY: the closure only calls sigaction and write(2), which are async-signal-safe, on an
    // fd opened before the fork (and kept open until the spawn returns); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            spawn::reset_signal_dispositions();
            match cgroup_procs {
                Some(fd) if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 => Err(std::io::Error::last_os_error()),
                _ => Ok(()),
            }
        });
    }
    cmd
}

/// When the process `pid` started (field 22 of its `/proc` stat, clock ticks since boot), if it
/// exists: with its pid, what tells a live process from a later one given the same pid.
pub fn start_time_of(pid: i32) -> Option<u64> {
    procfs::ProcHandle::open(pid).and_then(|h| h.stat()).ok().map(|s| s.start_time)
}

/// This process's start time (field 22 of /proc/self/stat), read once.
fn own_start_time() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    *START.get_or_init(|| {
        procfs::ProcHandle::open(std::process::id() as i32).and_then(|h| h.stat()).map_or(0, |s| s.start_time)
    })
}

/// Run /proc and cgroup work off the async threads.
async fn blocking<T: Send + 'static, R: Send + 'static>(v: T, f: impl FnOnce(T) -> R + Send + 'static) -> R {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let handle = tokio::task::spawn_blocking(move || {
        let _ = tx.send(f(v));
    });
    drop(handle);
    match rx.await {
        Ok(r) => r,
        // Only if the blocking pool is shutting down; there is nothing sensible left to do.
        Err(_) => std::future::pending().await,
    }
}

/// How long one look at the tree may take: a /proc read can block on a process stuck in the
/// kernel, and the ladder must never hang on it.
const TREE_OP_LIMIT: Duration = Duration::from_secs(2);

fn stuck() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "the process tree did not answer (a /proc read is stuck)")
}

/// [`blocking`], bounded by [`TREE_OP_LIMIT`]; `fallback` when it takes longer.
async fn bounded<T: Send + 'static, R: Send + 'static>(
    v: T,
    fallback: R,
    f: impl FnOnce(T) -> R + Send + 'static,
) -> R {
    tokio::time::timeout(TREE_OP_LIMIT, blocking(v, f)).await.unwrap_or(fallback)
}

/// Wait until the leader (if any) has been reaped and the tree is empty, or until `deadline`.
/// Returns the leader's status if it was reaped, and whether everything is gone.
async fn wait_gone<T: TreeOps>(
    tree: &T,
    leader: &mut Option<&mut Child>,
    status: &mut Option<ExitKind>,
    wait_err: &mut Option<String>,
    deadline: tokio::time::Instant,
) -> bool {
    loop {
        if status.is_none() && wait_err.is_none() {
            if let Some(child) = leader.as_deref_mut() {
                tokio::select! {
                    r = child.wait() => {
                        match r {
                            Ok(s) => *status = Some(ExitKind::from_status(s)),
                            Err(e) => *wait_err = Some(e.to_string()),
                        }
                        tree.leader_reaped();
                    }
                    _ = tokio::time::sleep(POLL) => {}
                }
            } else {
                tokio::time::sleep(POLL).await;
            }
        } else {
            tokio::time::sleep(POLL).await;
        }
        let leader_done = leader.is_none() || status.is_some() || wait_err.is_some();
        if leader_done && bounded(tree.clone(), false, |t| t.is_empty()).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
    }
}

/// The stop ladder: SIGTERM+SIGCONT to the tree, wait up to the grace period for it to empty,
/// then (unless the policy forbids it) SIGKILL the tree, close the pipes (`close_pipes`) and wait
/// up to the kill timeout.
async fn ladder<T: TreeOps>(
    tree: &T,
    mut leader: Option<&mut Child>,
    policy: &StopPolicy,
    reason: StopReason,
    close_pipes: impl FnOnce(),
) -> Outcome {
    let mut status = None;
    let mut wait_err = None;
    if let Err(e) = bounded(tree.clone(), Err(stuck()), |t| t.request_stop()).await {
        return Outcome::SignalFailed { reason, error: e.to_string() };
    }
    let grace_deadline = tokio::time::Instant::now() + policy.grace;
    if wait_gone(tree, &mut leader, &mut status, &mut wait_err, grace_deadline).await {
        return match (wait_err, status) {
            (Some(e), _) => Outcome::WaitFailed(e),
            (None, Some(s)) => Outcome::ExitedAfterStop { reason, status: s },
            (None, None) => Outcome::ExitedAfterStop { reason, status: ExitKind::Unknown },
        };
    }
    if !policy.kill {
        close_pipes();
        let survivors = bounded(tree.clone(), 1, |t| t.survivors()).await.max(1);
        return Outcome::GaveUp { reason, grace: policy.grace, survivors };
    }
    let killed = bounded(tree.clone(), Err(stuck()), |t| t.kill()).await;
    if let Some(child) = leader.as_deref_mut()
        && status.is_none()
    {
        let _ = child.start_kill();
    }
    close_pipes();
    if let Err(e) = killed {
        return Outcome::SignalFailed { reason, error: e.to_string() };
    }
    let kill_deadline = tokio::time::Instant::now() + policy.kill_timeout;
    if wait_gone(tree, &mut leader, &mut status, &mut wait_err, kill_deadline).await {
        return match wait_err {
            Some(e) => Outcome::WaitFailed(e),
            None => Outcome::Killed { reason, grace: policy.grace },
        };
    }
    let survivors = bounded(tree.clone(), 1, |t| t.survivors()).await.max(1);
    Outcome::Incomplete { reason, survivors }
}

#[cfg(test)]
mod ladder_tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A tree scripted to misbehave: it may refuse signals, or never empty.
    #[derive(Clone)]
    struct Scripted {
        stop_error: Option<i32>,
        kill_error: Option<i32>,
        empties_on_term: bool,
        empties_on_kill: bool,
        state: Arc<(AtomicBool, AtomicBool, AtomicUsize)>,
    }

    impl Scripted {
        fn new(empties_on_term: bool, empties_on_kill: bool) -> Scripted {
            Scripted {
                stop_error: None,
                kill_error: None,
                empties_on_term,
                empties_on_kill,
                state: Arc::new((AtomicBool::new(false), AtomicBool::new(false), AtomicUsize::new(3))),
            }
        }
        fn killed(&self) -> bool {
            self.state.1.load(Ordering::SeqCst)
        }
    }

    impl TreeOps for Scripted {
        fn request_stop(&self) -> std::io::Result<()> {
            if let Some(e) = self.stop_error {
                return Err(std::io::Error::from_raw_os_error(e));
            }
            self.state.0.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn kill(&self) -> std::io::Result<()> {
            if let Some(e) = self.kill_error {
                return Err(std::io::Error::from_raw_os_error(e));
            }
            self.state.1.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn is_empty(&self) -> bool {
            (self.empties_on_term && self.state.0.load(Ordering::SeqCst))
                || (self.empties_on_kill && self.state.1.load(Ordering::SeqCst))
        }
        fn survivors(&self) -> usize {
            if self.is_empty() { 0 } else { self.state.2.load(Ordering::SeqCst) }
        }
    }

    const POLICY: StopPolicy =
        StopPolicy { grace: Duration::from_secs(10), kill_timeout: Duration::from_secs(5), kill: true };

    async fn run(tree: &Scripted, policy: StopPolicy) -> (Outcome, bool) {
        let mut pipes_closed = false;
        let o = ladder(tree, None, &policy, StopReason::Cancel, || pipes_closed = true).await;
        (o, pipes_closed)
    }

    #[tokio::test(start_paused = true)]
    async fn every_rung_of_the_ladder() {
        let c = StopReason::Cancel;
        // Empties on SIGTERM: no SIGKILL, pipes left to reach EOF.
        let t = Scripted::new(true, true);
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::ExitedAfterStop { reason: c, status: ExitKind::Unknown });
        assert!(!t.killed() && !closed);
        // Needs SIGKILL: killed after the grace, pipes closed.
        let t = Scripted::new(false, true);
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::Killed { reason: c, grace: Duration::from_secs(10) });
        assert!(t.killed() && closed);
        // Survives SIGKILL: incomplete after the kill timeout, never a hang.
        let t = Scripted::new(false, false);
        let started = tokio::time::Instant::now();
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::Incomplete { reason: c, survivors: 3 });
        assert_eq!(o.to_string(), "termination incomplete: 3 processes survived SIGKILL");
        assert!(closed && o.termination_incomplete());
        assert!(started.elapsed() >= Duration::from_secs(15) && started.elapsed() < Duration::from_secs(16));
        // The no-kill policy gives up after the grace and never sends SIGKILL.
        let t = Scripted::new(false, true);
        let (o, closed) = run(&t, StopPolicy { kill: false, ..POLICY }).await;
        assert_eq!(o, Outcome::GaveUp { reason: c, grace: Duration::from_secs(10), survivors: 3 });
        assert!(!t.killed() && closed);
        // Signalling fails: reported, record kept (termination incomplete).
        let t = Scripted { stop_error: Some(libc::EPERM), ..Scripted::new(true, true) };
        let (o, _) = run(&t, POLICY).await;
        assert!(
            matches!(&o, Outcome::SignalFailed { error, .. } if error.contains("Operation not permitted")),
            "{o:?}"
        );
        assert!(o.to_string().starts_with("failed to signal: ") && o.termination_incomplete());
        let t = Scripted { kill_error: Some(libc::EPERM), ..Scripted::new(false, true) };
        let (o, closed) = run(&t, POLICY).await;
        assert!(matches!(o, Outcome::SignalFailed { .. }) && closed, "{o:?}");
    }
}

#[cfg(test)]
mod await_spawn_tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A spawn whose blocking thread returns late (a loaded machine) while a stop is already
    /// requested: the child is not killed where it stands; it is handed back for the ladder.
    #[tokio::test(start_paused = true)]
    async fn a_spawn_that_returns_soon_after_a_stop_is_not_killed() {
        let (tx, mut stop) = StopSignal::channel();
        tx.send_replace(Some(StopReason::Cancel));
        let killed = Arc::new(AtomicBool::new(false));
        let k = killed.clone();
        let job = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            7
        });
        let r = await_spawn(
            job,
            |_| 0,
            move || k.store(true, Ordering::SeqCst),
            &mut stop,
            None,
            None,
            Duration::from_secs(5),
        )
        .await;
        assert!(matches!(r, Ok(7)), "handed back");
        assert!(!killed.load(Ordering::SeqCst), "a started child gets the ladder, not SIGKILL");
        assert_eq!(stop.requested(), Some(StopReason::Cancel), "the stop is still there for the ladder");
    }

    /// A spawn that does not come back (a child stuck before its exec) is killed where it stands.
    #[tokio::test(start_paused = true)]
    async fn a_spawn_stuck_after_a_stop_is_killed() {
        let (tx, mut stop) = StopSignal::channel();
        tx.send_replace(Some(StopReason::Cancel));
        let killed = Arc::new(AtomicBool::new(false));
        let k = killed.clone();
        let job = tokio::spawn(std::future::pending::<i32>());
        let r = await_spawn(
            job,
            |_| 0,
            move || k.store(true, Ordering::SeqCst),
            &mut stop,
            None,
            None,
            Duration::from_secs(5),
        )
        .await;
        assert!(matches!(r, Err(Interrupted { reason: StopReason::Cancel, result: None })));
        assert!(killed.load(Ordering::SeqCst));
    }
}

#[cfg(test)]
mod recovery_metric_tests {
    use super::*;
    use crate::metrics::Recovery;

    #[test]
    fn recovery_results_and_their_metric() {
        let o = || Outcome::Killed { reason: StopReason::Shutdown, grace: Duration::from_secs(1) };
        let table = [
            (RecoveryResult::Invalid("x".into()), Recovery::Invalid),
            (RecoveryResult::Gone, Recovery::Gone),
            (RecoveryResult::Mismatch("x".into()), Recovery::Mismatch),
            (RecoveryResult::Stopped(o()), Recovery::Stopped),
            (RecoveryResult::NotStopped(o()), Recovery::NotStopped),
            (RecoveryResult::Refused("x".into()), Recovery::Refused),
            (RecoveryResult::OwnerAlive(1), Recovery::OwnerAlive),
        ];
        for (r, want) in table {
            assert_eq!(r.metric(), want, "{r:?}");
        }
    }
}
