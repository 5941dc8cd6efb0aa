//! The Windows process layer (`src/process/job.rs`, `src/process/windows.rs`): each run in its own
//! Job Object, the stop ladder (Ctrl-C on the run's console, the grace period, `TerminateJobObject`,
//! `ActiveProcesses` at 0), the lone-process fallback, a dead agent's runs, and the supervisor's
//! runs (output, exit codes, cancel, timeout, a daemon left alone). Built for `x86_64-pc-windows-gnu` and run under
//! Wine by `tools/windows.sh` (which `tools/test.sh` calls); on Linux this file is empty.
#![cfg(windows)]

use nodeplan::process::{
    self, ExitKind, Identity, Job, LineSink, Outcome, Run, SpawnSpec, StopPolicy, StopReason, StopSignal, Stream,
    Supervisor, SupervisorConfig,
};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;

const HELPER: &str = env!("CARGO_BIN_EXE_nodeplan-test-helper");

/// The test binary is not the agent: the graceful step runs the agent's binary.
fn interrupter() {
    process::set_interrupter(env!("CARGO_BIN_EXE_nodeplan").into());
}

fn helper(args: &[&str]) -> Command {
    let mut c = Command::new(HELPER);
    c.args(args).stdout(Stdio::piped());
    c
}

/// Processes a test started, ended when the test ends however it ends (a failing test must not
/// leave processes holding the runner's output open).
struct Tree(Vec<Identity>);

impl std::ops::Deref for Tree {
    type Target = [Identity];
    fn deref(&self) -> &[Identity] {
        &self.0
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        for id in self.0.iter().filter(|id| id.alive()) {
            kill(id.pid);
        }
    }
}

/// The pids a helper prints on its `ready` line (its own first), as identities.
async fn ready(child: &mut tokio::process::Child) -> Tree {
    let out = child.stdout.take().expect("stdout piped");
    let mut line = String::new();
    tokio::io::BufReader::new(out).read_line(&mut line).await.expect("read the ready line");
    identities(&line)
}

fn identities(line: &str) -> Tree {
    let pids = line.trim().strip_prefix("ready ").unwrap_or_else(|| panic!("not a ready line: {line:?}"));
    Tree(
        pids.split_whitespace()
            .map(|p| p.parse().expect("a pid"))
            .map(|pid| Identity::of(pid).unwrap_or_else(|| panic!("pid {pid} is not running")))
            .collect(),
    )
}

/// Whether every process in `ids` is gone within `limit`.
fn all_gone_within(ids: &[Identity], limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while ids.iter().any(Identity::alive) {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// The job counts no process, and none of the tree runs.
fn assert_none_left(run: &mut Run, ids: &[Identity]) {
    assert_eq!(run.active().expect("ActiveProcesses"), 0, "the job's count");
    for id in ids {
        assert!(!id.alive(), "pid {} is still running", id.pid);
    }
}

fn policy(grace_ms: u64) -> StopPolicy {
    StopPolicy { grace: Duration::from_millis(grace_ms), kill_timeout: Duration::from_secs(5), kill: true }
}

async fn start(args: &[&str]) -> (Run, Tree) {
    interrupter();
    let mut run = process::spawn(&mut helper(args)).expect("spawn");
    assert_eq!(run.job_error(), None, "the run must be in its job");
    let ids = ready(run.child_mut()).await;
    (run, ids)
}

#[tokio::test]
async fn everything_a_run_starts_is_born_in_its_job() {
    let (mut run, ids) = start(&["tree", "2"]).await;
    assert_eq!(ids.len(), 3, "a three-level tree");
    let job = run.job().expect("a job");
    for id in ids.iter() {
        assert!(job.contains(id.pid).expect("IsProcessInJob"), "pid {} is outside the run's job", id.pid);
    }
    // The three levels, and the run's console host where the system counts it in the job.
    let active = run.active().expect("ActiveProcesses");
    assert!((3..=4).contains(&active), "the job counts {active} processes");
    assert_eq!(ids[0], run.identity());
    let _ = run.stop(StopReason::Shutdown, &policy(0), || {}).await;
}

#[tokio::test]
async fn a_cancel_ends_a_three_level_tree_that_honours_ctrl_c_within_the_grace_period() {
    let (mut run, ids) = start(&["tree", "2"]).await;
    let t = Instant::now();
    let outcome = run.stop(StopReason::Cancel, &policy(10_000), || {}).await;
    assert!(
        matches!(outcome, Outcome::ExitedAfterStop { reason: StopReason::Cancel, .. }),
        "Ctrl-C on the run's console ends every level before the grace period: {outcome:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "not a grace period's wait: {:?}", t.elapsed());
    assert_none_left(&mut run, &ids);
}

#[tokio::test]
async fn a_tree_that_ignores_ctrl_c_is_ended_by_terminate_job_object_after_the_grace_period() {
    let (mut run, ids) = start(&["tree-ignore", "2"]).await;
    let t = Instant::now();
    let outcome = run.stop(StopReason::Cancel, &policy(300), || {}).await;
    assert!(
        matches!(outcome, Outcome::Killed { reason: StopReason::Cancel, .. }),
        "Ctrl-C ignored: the job is terminated: {outcome:?}"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "the grace period was given: {:?}", t.elapsed());
    assert_none_left(&mut run, &ids);
    assert_eq!(run.wait().await.expect("exit status").code(), Some(process::TERMINATED as i32));
}

#[tokio::test]
async fn without_the_kill_rung_the_ladder_gives_up_and_counts_the_survivors() {
    let (mut run, ids) = start(&["tree-ignore", "1"]).await;
    let outcome = run.stop(StopReason::Cancel, &StopPolicy { kill: false, ..policy(100) }, || {}).await;
    // Both levels, and the console host where it is in the job.
    assert!(matches!(outcome, Outcome::GaveUp { survivors: 2..=3, .. }), "{outcome:?}");
    assert!(outcome.termination_incomplete());
    assert!(ids.iter().all(Identity::alive));
    let outcome = run.stop(StopReason::Cancel, &policy(0), || {}).await;
    assert!(matches!(outcome, Outcome::Killed { .. }), "{outcome:?}");
}

#[tokio::test]
async fn a_process_that_cannot_join_a_job_runs_alone_and_only_it_can_be_stopped() {
    interrupter();
    let refusing = Job::new().and_then(|j| j.query_only());
    let mut run = process::spawn_in(&mut helper(&["tree-ignore", "1"]), refusing).expect("spawn");
    let why = run.job_error().expect("the assignment is refused").to_string();
    assert!(!why.is_empty());
    let ids = ready(run.child_mut()).await;
    assert_eq!(run.active().expect("the direct child alone"), 1);
    let outcome = run.stop(StopReason::Cancel, &policy(100), || {}).await;
    assert!(matches!(outcome, Outcome::Killed { .. }), "{outcome:?}");
    assert!(!ids[0].alive(), "the direct child is ended");
    assert!(ids[1].alive(), "its child was never in a job: it escapes (why the job matters)");
    kill(ids[1].pid);
    assert!(all_gone_within(&ids[1..], Duration::from_secs(5)));
}

#[tokio::test]
async fn a_dead_agent_leaves_no_process_of_its_runs_behind() {
    let mut agent = helper(&["agent", "2"]).spawn().expect("spawn the agent");
    let ids = ready(&mut agent).await;
    assert_eq!(ids.len(), 4, "the agent and a three-level tree");
    let tree = &ids[1..];
    assert!(tree.iter().all(Identity::alive));
    agent.kill().await.expect("kill the agent");
    assert!(all_gone_within(tree, Duration::from_secs(10)), "KILL_ON_JOB_CLOSE ends the tree with its agent");
}

#[tokio::test]
async fn an_identity_names_one_process_not_a_later_one_with_its_pid() {
    let (mut run, ids) = start(&["tree", "0"]).await;
    let me = ids[0];
    assert!(me.alive());
    let other = Identity { pid: me.pid, created: me.created + 1 };
    assert!(!other.alive(), "the same pid created at another time is another process");
    let _ = run.stop(StopReason::Shutdown, &policy(0), || {}).await;
    assert!(!me.alive());
}

/// Hands each line a run prints to the test (the handshake: a test acts once a run is set up).
struct Lines(tokio::sync::mpsc::UnboundedSender<(Stream, String)>);

impl LineSink for Lines {
    fn line(&self, stream: Stream, line: &[u8]) {
        let _ = self.0.send((stream, String::from_utf8_lossy(line).trim_end().to_string()));
    }
}

fn supervisor(grace_ms: u64) -> Supervisor {
    interrupter();
    Supervisor::new(SupervisorConfig { policy: policy(grace_ms), ..SupervisorConfig::default() })
}

fn spec(args: &[&str]) -> (SpawnSpec, tokio::sync::mpsc::UnboundedReceiver<(Stream, String)>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut spec = SpawnSpec::new(HELPER, args.iter().copied());
    spec.sink = Arc::new(Lines(tx));
    (spec, rx)
}

/// The identities on the first `ready` line a run prints.
async fn ready_line(rx: &mut tokio::sync::mpsc::UnboundedReceiver<(Stream, String)>) -> Tree {
    loop {
        match rx.recv().await {
            Some((Stream::Stdout, l)) if l.starts_with("ready ") => return identities(&l),
            Some(_) => {}
            None => panic!("the run ended without a ready line"),
        }
    }
}

#[tokio::test]
async fn the_supervisor_captures_both_streams_and_the_exit_code() {
    let (spec, _rx) = spec(&["print", "3"]);
    let r = supervisor(1000).run(spec, &mut StopSignal::never()).await;
    assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(3)));
    assert_eq!(String::from_utf8_lossy(&r.output.stdout).trim_end(), "to stdout");
    assert_eq!(String::from_utf8_lossy(&r.output.stderr).trim_end(), "to stderr");
    let r = supervisor(1000).run(SpawnSpec::new("C:/no/such/program.exe", ["x"]), &mut StopSignal::never()).await;
    assert!(matches!(&r.outcome, Outcome::StartFailed(why) if why.contains("program.exe")), "{:?}", r.outcome);
}

#[tokio::test]
async fn a_cancel_through_the_supervisor_ends_a_three_level_tree() {
    let (spec, mut rx) = spec(&["tree", "2"]);
    let (tx, mut stop) = StopSignal::channel();
    let sup = supervisor(10_000);
    let run = tokio::spawn(async move { sup.run(spec, &mut stop).await });
    let ids = ready_line(&mut rx).await;
    assert_eq!(ids.len(), 3);
    tx.send(Some(StopReason::Cancel)).expect("the run listens");
    let r = run.await.expect("the run's task");
    assert!(
        matches!(r.outcome, Outcome::ExitedAfterStop { reason: StopReason::Cancel, .. }),
        "Ctrl-C ends the tree within the grace period: {:?}",
        r.outcome
    );
    assert!(r.elapsed < Duration::from_secs(10), "{:?}", r.elapsed);
    for id in ids.iter() {
        assert!(!id.alive(), "pid {} is still running", id.pid);
    }
    assert_eq!(r.pid, Some(ids[0].pid as i32));
}

#[tokio::test]
async fn a_timeout_ends_a_tree_that_ignores_ctrl_c_with_terminate_job_object() {
    let (mut spec, mut rx) = spec(&["tree-ignore", "1"]);
    spec.timeout = Some(Duration::from_millis(1500));
    let sup = supervisor(300);
    let run = tokio::spawn(async move { sup.run(spec, &mut StopSignal::never()).await });
    let ids = ready_line(&mut rx).await;
    let r = run.await.expect("the run's task");
    assert!(
        matches!(r.outcome, Outcome::Killed { reason: StopReason::Timeout(t), .. } if t == Duration::from_millis(1500)),
        "{:?}",
        r.outcome
    );
    assert!(ids.iter().all(|id| !id.alive()), "every level is gone");
}

#[tokio::test]
async fn a_daemon_a_run_started_is_left_alone_when_the_run_exits() {
    let (spec, mut rx) = spec(&["daemon"]);
    let r = supervisor(1000).run(spec, &mut StopSignal::never()).await;
    assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(0)));
    let daemon = ready_line(&mut rx).await;
    // The run and its job are gone; what it started on purpose still runs.
    assert!(daemon[0].alive(), "the daemon was ended with its run's job");
}

fn kill(pid: u32) {
    use windows_sys::Win32::Foundation::CloseHandle;
    use windows_sys::Win32::System::Threading::{OpenProcess, PROCESS_TERMINATE, TerminateProcess};
    // SAFETY: a handle opened and closed here.
    unsafe {
        let h = OpenProcess(PROCESS_TERMINATE, 0, pid);
        if !h.is_null() {
            TerminateProcess(h, 1);
            CloseHandle(h);
        }
    }
}
