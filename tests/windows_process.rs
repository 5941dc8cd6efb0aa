//! The Windows process layer (`src/process/windows.rs`): each run in its own Job Object, the stop
//! ladder (Ctrl-C on the run's console, the grace period, `TerminateJobObject`, `ActiveProcesses`
//! at 0), the
//! lone-process fallback, and a dead agent's runs. Built for `x86_64-pc-windows-gnu` and run under
//! Wine by `tools/windows.sh` (which `tools/test.sh` calls); on Linux this file is empty.
#![cfg(windows)]

use nodeplan::process::{self, Identity, Job, Outcome, Run, StopPolicy, StopReason};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
fn ready(child: &mut std::process::Child) -> Tree {
    let out = child.stdout.take().expect("stdout piped");
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).expect("read the ready line");
    let pids = line.strip_prefix("ready ").unwrap_or_else(|| panic!("not a ready line: {line:?}"));
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

fn start(args: &[&str]) -> (Run, Tree) {
    interrupter();
    let mut run = process::spawn(&mut helper(args)).expect("spawn");
    assert_eq!(run.job_error(), None, "the run must be in its job");
    let ids = ready(run.child_mut());
    (run, ids)
}

#[test]
fn everything_a_run_starts_is_born_in_its_job() {
    let (mut run, ids) = start(&["tree", "2"]);
    assert_eq!(ids.len(), 3, "a three-level tree");
    let job = run.job().expect("a job");
    for id in ids.iter() {
        assert!(job.contains(id.pid).expect("IsProcessInJob"), "pid {} is outside the run's job", id.pid);
    }
    // The three levels, and the run's console host where the system counts it in the job.
    let active = run.active().expect("ActiveProcesses");
    assert!((3..=4).contains(&active), "the job counts {active} processes");
    assert_eq!(ids[0], run.identity());
    let _ = run.stop(StopReason::Shutdown, &policy(0));
}

#[test]
fn a_cancel_ends_a_three_level_tree_that_honours_ctrl_c_within_the_grace_period() {
    let (mut run, ids) = start(&["tree", "2"]);
    let t = Instant::now();
    let outcome = run.stop(StopReason::Cancel, &policy(10_000));
    assert!(
        matches!(outcome, Outcome::ExitedAfterStop { reason: StopReason::Cancel, .. }),
        "Ctrl-C on the run's console ends every level before the grace period: {outcome:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "not a grace period's wait: {:?}", t.elapsed());
    assert_none_left(&mut run, &ids);
}

#[test]
fn a_tree_that_ignores_ctrl_c_is_ended_by_terminate_job_object_after_the_grace_period() {
    let (mut run, ids) = start(&["tree-ignore", "2"]);
    let t = Instant::now();
    let outcome = run.stop(StopReason::Cancel, &policy(300));
    assert!(
        matches!(outcome, Outcome::Killed { reason: StopReason::Cancel, .. }),
        "Ctrl-C ignored: the job is terminated: {outcome:?}"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "the grace period was given: {:?}", t.elapsed());
    assert_none_left(&mut run, &ids);
    assert_eq!(run.wait().expect("exit status").code(), Some(process::TERMINATED as i32));
}

#[test]
fn without_the_kill_rung_the_ladder_gives_up_and_counts_the_survivors() {
    let (mut run, ids) = start(&["tree-ignore", "1"]);
    let outcome = run.stop(StopReason::Cancel, &StopPolicy { kill: false, ..policy(100) });
    // Both levels, and the console host where it is in the job.
    assert!(matches!(outcome, Outcome::GaveUp { survivors: 2..=3, .. }), "{outcome:?}");
    assert!(outcome.termination_incomplete());
    assert!(ids.iter().all(Identity::alive));
    let outcome = run.stop(StopReason::Cancel, &policy(0));
    assert!(matches!(outcome, Outcome::Killed { .. }), "{outcome:?}");
}

#[test]
fn a_process_that_cannot_join_a_job_runs_alone_and_only_it_can_be_stopped() {
    interrupter();
    let refusing = Job::new().and_then(|j| j.query_only());
    let mut run = process::spawn_in(&mut helper(&["tree-ignore", "1"]), refusing).expect("spawn");
    let why = run.job_error().expect("the assignment is refused").to_string();
    assert!(!why.is_empty());
    let ids = ready(run.child_mut());
    assert_eq!(run.active().expect("the direct child alone"), 1);
    let outcome = run.stop(StopReason::Cancel, &policy(100));
    assert!(matches!(outcome, Outcome::Killed { .. }), "{outcome:?}");
    assert!(!ids[0].alive(), "the direct child is ended");
    assert!(ids[1].alive(), "its child was never in a job: it escapes (why the job matters)");
    kill(ids[1].pid);
    assert!(all_gone_within(&ids[1..], Duration::from_secs(5)));
}

#[test]
fn a_dead_agent_leaves_no_process_of_its_runs_behind() {
    let mut agent = helper(&["agent", "2"]).spawn().expect("spawn the agent");
    let ids = ready(&mut agent);
    assert_eq!(ids.len(), 4, "the agent and a three-level tree");
    let tree = &ids[1..];
    assert!(tree.iter().all(Identity::alive));
    agent.kill().expect("kill the agent");
    let _ = agent.wait();
    assert!(all_gone_within(tree, Duration::from_secs(10)), "KILL_ON_JOB_CLOSE ends the tree with its agent");
}

#[test]
fn an_identity_names_one_process_not_a_later_one_with_its_pid() {
    let (mut run, ids) = start(&["tree", "0"]);
    let me = ids[0];
    assert!(me.alive());
    let other = Identity { pid: me.pid, created: me.created + 1 };
    assert!(!other.alive(), "the same pid created at another time is another process");
    let _ = run.stop(StopReason::Shutdown, &policy(0));
    assert!(!me.alive());
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
