//! The Linux backend of the process layer: the [`Supervisor`] over cgroups (v2, or a v1 freezer),
//! process groups and run markers, spawning through `clone3` ([`super::spawn`]) or tokio.

use super::capture::{self, Captures};
use super::cgroup;
use super::ladder::{Leader, NoLeader, TreeOps, blocking, ladder};
use super::owner_lock::{self, LockError, OwnerLock};
use super::procfs;
use super::record::{self, Identity, PidRecord, RecordFile};
use super::spawn;
use super::tree::Tree;
use super::{
    LineSink, MARKER_ENV, Outcome, Output, Owner, Recovered, RecoveryResult, RunClock, RunResult, SpawnSpec,
    StopReason, StopSignal, Stream, SupervisorConfig, drain, remove_record, sleep_until_opt,
};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

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
        let clock = RunClock::start(self.new_marker());
        if let Some(r) = clock.stopped_before(stop) {
            return r;
        }
        let (marker, finish) = (&clock.marker, |o, out, pid| clock.finish(o, out, pid));
        let mut setup = match self.set_up(&spec, marker) {
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
        let started_child = match self.spawn_child(&spec, marker, &mut setup, stop, deadline).await {
            Ok(s) => s,
            Err(outcome) => return finish(outcome, Output::default(), None),
        };
        let (outcome, output, pid) = self.follow(&spec, marker, setup, started_child, stop, deadline).await;
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
                let outcome = Outcome::of_exit(status);
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
        // After a successful stop the pipes are at EOF or were closed; never wait long on them.
        drain(&mut readers, Duration::from_millis(100)).await;
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
        drain(readers, self.inner.config.drain_timeout).await;
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
        let outcome =
            ladder(&tree, None::<&mut NoLeader>, &self.inner.config.policy, StopReason::Shutdown, || {}).await;
        if outcome.termination_incomplete() {
            RecoveryResult::NotStopped(outcome)
        } else {
            blocking(tree, |t| t.cleanup()).await;
            RecoveryResult::Stopped(outcome)
        }
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

impl Leader for Child {
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
}

impl Child {
    fn id(&self) -> Option<u32> {
        match self {
            Child::Tokio(c) => c.id(),
            Child::Raw(c) => Some(c.pid as u32),
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
