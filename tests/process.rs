//! The process layer against the helper program: every outcome variant, whole-tree stops, escaped
//! grandchildren, pipe holders, PID records and recovery, and supervise's respawn loop.

mod common;

use common::*;
use nodeplan::process::supervise::{Backoff, SuperviseError, SuperviseObserver, supervise};
use nodeplan::process::*;
use std::time::Duration;

fn sup_with(policy: StopPolicy, cgroup: CgroupMode, pid_dir: Option<&std::path::Path>) -> Supervisor {
    Supervisor::new(SupervisorConfig {
        policy,
        cgroup,
        pid_dir: pid_dir.map(|p| p.to_path_buf()),
        capture_limit: 4096,
        drain_timeout: Duration::from_millis(300),
    })
}

fn short(kill: bool) -> StopPolicy {
    StopPolicy { grace: Duration::from_millis(300), kill_timeout: Duration::from_secs(5), kill }
}

fn long() -> StopPolicy {
    StopPolicy { grace: Duration::from_secs(20), kill_timeout: Duration::from_secs(5), kill: true }
}

/// Start `args`, wait for `ready`, request a stop, return the result.
async fn stop_after_ready(sup: &Supervisor, args: &[&str], ready: &str) -> RunResult {
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let spec = helper(args, sink);
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(spec, &mut stop).await });
    wait_line(&mut lines, ready).await;
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = tokio::time::timeout(GUARD, run).await.expect("run hung").unwrap();
    drop(tx);
    r
}

#[tokio::test]
async fn natural_exits() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (sink, _l) = chan_sink();
    let r = sup.run(helper(&["exit", "1"], sink.clone()), &mut StopSignal::never()).await;
    assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(1)));
    assert_eq!(r.outcome.to_string(), "exit status 1");
    assert!(!r.outcome.success());
    let r = sup.run(helper(&["exit", "0"], sink), &mut StopSignal::never()).await;
    assert!(r.outcome.success());
    assert_eq!(r.outcome.stop_reason(), None);
}

#[tokio::test]
async fn start_failure_is_an_outcome() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let spec = SpawnSpec::new("/nonexistent/program", Vec::<String>::new());
    let r = sup.run(spec, &mut StopSignal::never()).await;
    assert!(matches!(r.outcome, Outcome::StartFailed(_)), "{:?}", r.outcome);
    assert!(r.outcome.to_string().starts_with("failed to start: /nonexistent/program"));
}

/// A child that cannot start (exec or chdir fails after the clone) is a StartFailed with the
/// reason, in either cgroup mode, and leaves neither its PID record nor its cgroup behind.
#[tokio::test]
async fn a_child_that_fails_before_exec_reports_why_and_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let not_exec = d.path().join("not-executable");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    let pids = d.path().join("pids");
    for mode in [CgroupMode::Auto, CgroupMode::Off] {
        let sup = sup_with(long(), mode, Some(&pids));
        let r = sup.run(SpawnSpec::new(&not_exec, Vec::<String>::new()), &mut StopSignal::never()).await;
        assert!(r.outcome.to_string().contains("Permission denied"), "{}", r.outcome);
        let mut spec = SpawnSpec::new("/bin/true", Vec::<String>::new());
        spec.cwd = Some(d.path().join("no-such-dir"));
        let r = sup.run(spec, &mut StopSignal::never()).await;
        assert!(matches!(r.outcome, Outcome::StartFailed(_)), "{:?}", r.outcome);
        assert!(r.outcome.to_string().contains("No such file or directory"), "{}", r.outcome);
        assert!(PidRecord::load_all(&pids).is_empty(), "no record left");
        if let Some(root) = sup.cgroup_root() {
            assert!(!root.join(&r.marker).exists(), "no cgroup left");
        }
    }
}

/// The agent ignores SIGPIPE (as every Rust program does) and blocks every signal around the
/// clone; its children must start with neither, and with no signal ignored at all: what the
/// agent itself inherited as ignored (whatever its parent ignored, and SIGPIPE from Rust) is
/// reset too, as a service manager does for its services.
#[tokio::test]
async fn a_child_starts_with_no_ignored_and_no_blocked_signals() {
    let own = std::fs::read_to_string("/proc/self/status").unwrap();
    let own_ign = own.lines().find_map(|l| l.strip_prefix("SigIgn:")).unwrap().trim();
    let own_ign = u64::from_str_radix(own_ign, 16).unwrap();
    assert_ne!(own_ign & (1 << (libc::SIGPIPE - 1)), 0, "the test process ignores SIGPIPE");
    let expected = "SigIgn:\t0000000000000000";
    for mode in [CgroupMode::Auto, CgroupMode::Off] {
        let sup = sup_with(long(), mode, None);
        let spec = SpawnSpec::new("/bin/grep", ["-E", "^Sig(Ign|Blk):", "/proc/self/status"]);
        let r = sup.run(spec, &mut StopSignal::never()).await;
        assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(0)));
        let text = String::from_utf8_lossy(&r.output.stdout).into_owned();
        assert!(text.contains(expected), "{text} (expected {expected})");
        assert!(text.contains("SigBlk:\t0000000000000000"), "{text}");
    }
}

#[tokio::test]
async fn exits_on_sigterm() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let r = stop_after_ready(&sup, &["term-exit"], "ready").await;
    assert_eq!(r.outcome, Outcome::ExitedAfterStop { reason: StopReason::Cancel, status: ExitKind::Code(0) });
    assert_eq!(r.outcome.to_string(), "exited after stop request: exit status 0");
    assert_eq!(r.outcome.rung(), Some(Rung::Term));
    assert!(survivors(&r.marker).is_empty());
}

#[tokio::test]
async fn exits_non_zero_on_sigterm() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let r = stop_after_ready(&sup, &["term-fail"], "ready").await;
    assert_eq!(r.outcome.to_string(), "exited after stop request: exit status 3");
    assert_eq!(r.outcome.stop_reason(), Some(StopReason::Cancel));
}

#[tokio::test]
async fn dies_of_sigterm() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let r = stop_after_ready(&sup, &["term-die"], "ready").await;
    assert_eq!(
        r.outcome,
        Outcome::ExitedAfterStop { reason: StopReason::Cancel, status: ExitKind::Signal(libc::SIGTERM) }
    );
    assert_eq!(r.outcome.to_string(), "exited after stop request: signal: terminated");
}

#[tokio::test]
async fn ignoring_sigterm_gets_killed_after_the_grace() {
    let sup = sup_with(short(true), CgroupMode::Auto, None);
    let r = stop_after_ready(&sup, &["term-ignore"], "ready").await;
    assert_eq!(r.outcome, Outcome::Killed { reason: StopReason::Cancel, grace: Duration::from_millis(300) });
    assert_eq!(r.outcome.to_string(), "killed after 300ms grace");
    assert_eq!(r.outcome.rung(), Some(Rung::Kill));
    assert!(!r.outcome.termination_incomplete());
    assert!(survivors(&r.marker).is_empty());
}

#[tokio::test]
async fn stopped_process_gets_sigcont_and_acts_on_sigterm() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let r = stop_after_ready(&sup, &["sigstop"], "ready").await;
    assert_eq!(r.outcome.to_string(), "exited after stop request: exit status 0");
}

#[tokio::test]
async fn children_in_the_group_are_stopped_too() {
    for mode in [CgroupMode::Auto, CgroupMode::Off] {
        let sup = sup_with(long(), mode.clone(), None);
        let (sink, mut lines) = chan_sink();
        let (tx, mut stop) = StopSignal::channel();
        let sup2 = sup.clone();
        let run = tokio::spawn(async move { sup2.run(helper(&["fork", "3"], sink), &mut stop).await });
        let mut kids = Vec::new();
        for _ in 0..3 {
            kids.push(wait_line(&mut lines, "child").await.parse::<i32>().unwrap());
        }
        wait_line(&mut lines, "ready").await;
        assert!(kids.iter().all(|k| alive(*k)));
        tx.send(Some(StopReason::Cancel)).unwrap();
        let r = tokio::time::timeout(GUARD, run).await.unwrap().unwrap();
        assert_eq!(r.outcome.rung(), Some(Rung::Term), "{mode:?}: {}", r.outcome);
        assert!(kids.iter().all(|k| !alive(*k)), "{mode:?}: children survived");
        assert!(survivors(&r.marker).is_empty());
    }
}

#[tokio::test]
async fn setsid_grandchild_is_killed_with_the_cgroup() {
    let sup = sup_with(short(true), CgroupMode::Auto, None);
    if !require_cgroup(&sup) {
        return;
    }
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(helper(&["setsid-wait"], sink), &mut stop).await });
    let gc: i32 = wait_line(&mut lines, "grandchild").await.parse().unwrap();
    wait_line(&mut lines, "ready").await;
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = tokio::time::timeout(GUARD, run).await.expect("hung on the pipe-holding grandchild").unwrap();
    let left = survivors(&r.marker);
    kill_all(&left);
    assert!(!alive(gc), "the setsid grandchild survived the cancel");
    assert!(left.is_empty());
    assert_eq!(r.outcome.to_string(), "killed after 300ms grace");
    let cg = sup.cgroup_root().unwrap().join(&r.marker);
    assert!(!cg.exists(), "the run's cgroup is removed once empty");
}

#[tokio::test]
async fn setsid_grandchild_is_found_by_its_marker_without_cgroups() {
    let sup = sup_with(short(true), CgroupMode::Off, None);
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(helper(&["setsid-wait"], sink), &mut stop).await });
    let gc: i32 = wait_line(&mut lines, "grandchild").await.parse().unwrap();
    wait_line(&mut lines, "ready").await;
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = tokio::time::timeout(GUARD, run).await.unwrap().unwrap();
    let alive_gc = alive(gc);
    kill_all(&[gc]);
    assert!(!alive_gc, "the setsid grandchild survived");
    assert_eq!(r.outcome.rung(), Some(Rung::Kill));
}

#[tokio::test]
async fn a_pipe_holding_grandchild_never_hangs_a_natural_exit() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (sink, mut lines) = chan_sink();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(helper(&["setsid-exit"], sink), &mut StopSignal::never()).await });
    let gc: i32 = wait_line(&mut lines, "grandchild").await.parse().unwrap();
    let r = tokio::time::timeout(GUARD, run).await.expect("waited on pipe EOF").unwrap();
    let was_alive = alive(gc);
    kill_all(&[gc]);
    assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(0)));
    assert!(was_alive, "the grandchild kept running after the parent's exit (it holds the pipe)");
    assert!(String::from_utf8_lossy(&r.output.stdout).contains("parent exiting"));
}

/// Policy for a process that exits by itself and leaves a daemon behind: the daemon is left alone
/// (no record, so no later recovery stops it), and the run's cgroup is removed once it is empty.
#[tokio::test]
async fn a_daemon_left_by_an_instruction_is_left_alone_and_its_cgroup_tidied_later() {
    let pids = tempfile::tempdir().unwrap();
    let sup = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    if !require_cgroup(&sup) {
        return;
    }
    let (sink, mut lines) = chan_sink();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(helper(&["setsid-exit"], sink), &mut StopSignal::never()).await });
    let daemon: i32 = wait_line(&mut lines, "grandchild").await.parse().unwrap();
    let r = tokio::time::timeout(GUARD, run).await.unwrap().unwrap();
    let leaf = sup.cgroup_root().unwrap().join(&r.marker);
    let (daemon_alive, leaf_kept) = (alive(daemon), leaf.exists());
    assert!(PidRecord::load_all(pids.path()).is_empty(), "the record goes with the process that was started");
    let other = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    let recovered = other.recover(|_| true).await;
    let survived_recovery = alive(daemon);
    // The daemon ends (here: killed by the test); the next run removes its empty cgroup.
    let fd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(daemon).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    kill_all(&[daemon]);
    let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&fd), events: libc::POLLIN, revents: 0 };
    let ended = unsafe { libc::poll(&mut pfd, 1, GUARD.as_millis() as i32) };
    assert_eq!(ended, 1, "the daemon never ended");
    let next = sup.run(SpawnSpec::new("/bin/true", Vec::<String>::new()), &mut StopSignal::never()).await;
    assert_eq!(next.outcome, Outcome::Exited(ExitKind::Code(0)));
    assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(0)));
    assert!(daemon_alive && leaf_kept, "the daemon keeps running in the run's cgroup");
    assert!(recovered.is_empty() && survived_recovery, "a later recovery does not stop it: {recovered:?}");
    assert!(!leaf.exists(), "its cgroup is removed once empty");
}

#[tokio::test]
async fn no_kill_policy_gives_up_and_keeps_the_record() {
    let pids = tempfile::tempdir().unwrap();
    let sup = sup_with(short(false), CgroupMode::Auto, Some(pids.path()));
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(helper(&["term-ignore"], sink), &mut stop).await });
    let pid: i32 = wait_line(&mut lines, "ready").await.parse().unwrap();
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = tokio::time::timeout(GUARD, run).await.unwrap().unwrap();
    let still = alive(pid);
    let records = PidRecord::load_all(pids.path());
    // Clean up through recovery with a kill policy: this also proves the kept record works.
    let killer = sup_with(short(true), CgroupMode::Auto, Some(pids.path()));
    let rec = killer.recover(|_| true).await;
    kill_all(&[pid]);
    assert!(matches!(r.outcome, Outcome::GaveUp { survivors: 1, .. }), "{:?}", r.outcome);
    assert_eq!(r.outcome.rung(), Some(Rung::GaveUp));
    assert!(r.outcome.termination_incomplete());
    assert!(r.outcome.to_string().starts_with("termination incomplete: 1 process still running after 300ms grace"));
    assert!(still, "the no-kill policy must leave the process running");
    assert_eq!(records.len(), 1, "the record is kept");
    assert!(matches!(rec[0].result, RecoveryResult::Stopped(Outcome::Killed { .. })), "{:?}", rec[0].result);
    assert!(!alive(pid));
}

#[tokio::test]
async fn timeout_runs_the_ladder() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (sink, _lines) = chan_sink();
    let mut spec = helper(&["term-exit"], sink);
    // Long enough for the helper to install its SIGTERM handler even on a loaded machine.
    spec.timeout = Some(Duration::from_millis(1500));
    let r = tokio::time::timeout(GUARD, sup.run(spec, &mut StopSignal::never())).await.unwrap();
    assert!(r.outcome.timed_out());
    assert_eq!(r.outcome.to_string(), "timed out after 1.5s: exited after stop request: exit status 0");
    assert!(!r.outcome.success());
}

#[tokio::test]
async fn a_stop_requested_before_spawn_prevents_the_spawn() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("ran");
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (tx, mut stop) = StopSignal::channel();
    tx.send(Some(StopReason::Cancel)).unwrap();
    let (sink, _l) = chan_sink();
    let r = sup.run(helper(&["touch", flag.to_str().unwrap()], sink), &mut stop).await;
    assert_eq!(r.outcome, Outcome::NotStarted(StopReason::Cancel));
    assert_eq!(r.pid, None);
    assert!(!flag.exists(), "the process must never have started");
}

#[tokio::test]
async fn output_is_captured_bounded_and_interleaved() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (sink, _l) = chan_sink();
    let r = sup.run(helper(&["write", "200000"], sink.clone()), &mut StopSignal::never()).await;
    assert!(r.outcome.success());
    let out = String::from_utf8_lossy(&r.output.stdout);
    assert!(r.output.stdout.len() < 4096 + 100, "capped: {}", r.output.stdout.len());
    assert!(out.contains("[nodeplan: 195904 bytes of output dropped]"), "{}", &out[2000..2100]);
    assert!(out.starts_with("xxx") && out.ends_with("x\n"));
    let r = sup.run(helper(&["interleave"], sink), &mut StopSignal::never()).await;
    let combined = String::from_utf8_lossy(&r.output.combined);
    for l in ["out0", "out1", "out2", "err0", "err1", "err2"] {
        assert!(combined.lines().any(|x| x == l), "{l} missing from {combined:?}");
    }
    assert_eq!(String::from_utf8_lossy(&r.output.stderr), "err0\nerr1\nerr2\n");
}

#[tokio::test]
async fn pid_record_lifecycle() {
    let pids = tempfile::tempdir().unwrap();
    let sup = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let sup2 = sup.clone();
    let mut spec = helper(&["term-exit"], sink);
    spec.owner = Owner::apply("abc").with_slot(Slot::OneTime(0));
    let run = tokio::spawn(async move { sup2.run(spec, &mut stop).await });
    let pid: i32 = wait_line(&mut lines, "ready").await.parse().unwrap();
    let recs = PidRecord::load_all(pids.path());
    assert_eq!(recs.len(), 1);
    let rec = recs[0].1.clone().unwrap();
    assert_eq!(rec.pid, pid);
    assert_eq!(rec.owner, Owner::apply("abc").with_slot(Slot::OneTime(0)));
    assert_eq!(rec.owner.to_string(), "apply:abc:0");
    assert!(rec.start_time > 0);
    assert_eq!(rec.boot_id, std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim());
    assert_eq!(rec.cgroup.is_some(), sup.cgroup_root().is_some());
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = run.await.unwrap();
    assert_eq!(rec.marker, r.marker);
    assert!(PidRecord::load_all(pids.path()).is_empty(), "removed once the tree is gone");
}

#[tokio::test]
async fn recovery_stops_a_verified_leftover() {
    let pids = tempfile::tempdir().unwrap();
    let first = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    let (sink, mut lines) = chan_sink();
    let spec = helper(&["fork", "2"], sink);
    // The "crashed agent": its run is dropped mid-flight, leaving the process tree and its record.
    let run = tokio::spawn(async move { first.run(spec, &mut StopSignal::never()).await });
    let c1: i32 = wait_line(&mut lines, "child").await.parse().unwrap();
    let c2: i32 = wait_line(&mut lines, "child").await.parse().unwrap();
    let pid: i32 = wait_line(&mut lines, "ready").await.parse().unwrap();
    run.abort();
    let _ = run.await;
    assert!(alive(pid) && alive(c1) && alive(c2));
    let second = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    let rec = tokio::time::timeout(GUARD, second.recover(|r| r.owner == Owner::supervise("test"))).await.unwrap();
    let gone = !alive(pid) && !alive(c1) && !alive(c2);
    kill_all(&[pid, c1, c2]);
    assert_eq!(rec.len(), 1);
    assert!(matches!(rec[0].result, RecoveryResult::Stopped(_)), "{:?}", rec[0].result);
    assert!(gone, "leader and children stopped");
    assert!(PidRecord::load_all(pids.path()).is_empty());
}

#[tokio::test]
async fn a_record_that_does_not_match_never_gets_its_pid_signalled() {
    let pids = tempfile::tempdir().unwrap();
    // An unrelated live process (default SIGTERM disposition: any signal would kill it).
    let mut victim = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let vpid = victim.id() as i32;
    let stat = std::fs::read_to_string(format!("/proc/{vpid}/stat")).unwrap();
    let start: u64 = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().parse().unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_string();
    let bad_start = PidRecord {
        pid: vpid,
        start_time: start + 1,
        boot_id: boot.clone(),
        cgroup: None,
        marker: "np-test-a".into(),
        owner: Owner::supervise("x"),
        command: "sleep".into(),
    };
    let no_marker = PidRecord { start_time: start, marker: "np-test-b".into(), ..bad_start.clone() };
    bad_start.create(pids.path()).unwrap();
    no_marker.create(pids.path()).unwrap();
    std::fs::write(pids.path().join("junk.json"), b"{not json").unwrap();
    let sup = sup_with(short(true), CgroupMode::Auto, Some(pids.path()));
    let rec = sup.recover(|_| true).await;
    let survived = victim.try_wait().unwrap().is_none();
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(survived, "an unrelated process was signalled");
    assert_eq!(rec.len(), 3);
    let mismatches = rec.iter().filter(|r| matches!(r.result, RecoveryResult::Mismatch(_))).count();
    assert_eq!(mismatches, 2, "{rec:?}");
    assert!(
        rec.iter().any(|r| matches!(&r.result, RecoveryResult::Invalid(e) if e.starts_with("malformed PID record")))
    );
    assert!(pids.path().join("junk.invalid").exists(), "an unreadable record is kept aside, not deleted");
    assert!(PidRecord::load_all(pids.path()).is_empty());
}

struct Recorder {
    delays: Vec<Duration>,
    starts: u64,
    stop_after: u64,
    tx: Option<tokio::sync::watch::Sender<Option<StopReason>>>,
}

impl SuperviseObserver for Recorder {
    fn started(&mut self, attempt: u64) {
        self.starts = attempt;
    }
    fn exited(&mut self, r: &RunResult, delay: Duration) {
        assert_eq!(r.outcome, Outcome::Exited(ExitKind::Code(1)));
        self.delays.push(delay);
        if self.starts == self.stop_after
            && let Some(tx) = &self.tx
        {
            let _ = tx.send(Some(StopReason::Shutdown));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn supervise_respawns_with_exponential_backoff() {
    let sup = sup_with(long(), CgroupMode::Auto, None);
    let (sink, _l) = chan_sink();
    let mut spec = helper(&["exit", "1"], sink);
    spec.owner = Owner::supervise("crasher");
    let (tx, stop) = StopSignal::channel();
    let mut rec = Recorder { delays: vec![], starts: 0, stop_after: 5, tx: Some(tx) };
    let out = supervise(&sup, spec, stop, Backoff::default(), &mut rec).await.unwrap();
    assert_eq!(out, Outcome::NotStarted(StopReason::Shutdown));
    let secs: Vec<u64> = rec.delays.iter().map(|d| d.as_secs()).collect();
    assert_eq!(secs, [1, 2, 4, 8, 16]);
    assert_eq!(rec.starts, 5);
}

#[tokio::test]
async fn supervise_stops_a_verified_previous_instance_or_refuses_to_start() {
    let pids = tempfile::tempdir().unwrap();
    let old = sup_with(long(), CgroupMode::Auto, Some(pids.path()));
    let (sink, mut lines) = chan_sink();
    let mut spec = helper(&["term-ignore"], sink.clone());
    spec.owner = Owner::supervise("svc");
    let spec2 = spec.clone();
    let run = tokio::spawn(async move { old.run(spec2, &mut StopSignal::never()).await });
    let pid: i32 = wait_line(&mut lines, "ready").await.parse().unwrap();
    run.abort();
    let _ = run.await;
    // A no-kill supervisor cannot stop the SIGTERM-ignoring previous instance: it refuses.
    let polite = sup_with(short(false), CgroupMode::Auto, Some(pids.path()));
    let (tx, stop) = StopSignal::channel();
    let refused = supervise(&polite, spec.clone(), stop, Backoff::default(), &mut ()).await;
    let still = alive(pid);
    // A killing supervisor stops it, then runs its own copy until told to stop.
    let firm = sup_with(short(true), CgroupMode::Auto, Some(pids.path()));
    let (tx2, stop2) = StopSignal::channel();
    let firm2 = firm.clone();
    let task = tokio::spawn(async move { supervise(&firm2, spec, stop2, Backoff::default(), &mut ()).await });
    let new_pid: i32 = wait_line(&mut lines, "ready").await.parse().unwrap();
    let old_gone = !alive(pid);
    tx2.send(Some(StopReason::Shutdown)).unwrap();
    let done = tokio::time::timeout(GUARD, task).await.unwrap().unwrap();
    kill_all(&[pid, new_pid]);
    drop(tx);
    assert!(matches!(refused, Err(SuperviseError::PreviousInstance { pid: p, .. }) if p == pid), "{refused:?}");
    assert!(still);
    assert!(old_gone, "the verified previous instance was stopped first");
    assert_ne!(new_pid, pid);
    assert!(matches!(done, Ok(Outcome::Killed { .. })), "{done:?}");
}

/// A `sleep` started by the test (optionally carrying a run marker, as a process of ours would),
/// SIGKILLed and reaped when dropped, whatever the test found.
struct Victim {
    child: std::process::Child,
    pid: i32,
}

impl Victim {
    fn start(marker: Option<&str>) -> Victim {
        let mut c = std::process::Command::new("sleep");
        c.arg("1000");
        if let Some(m) = marker {
            c.env(MARKER_ENV, m);
        }
        // spawn() returns once exec succeeded: its environment is in /proc from here on.
        let child = c.spawn().unwrap();
        let pid = child.id() as i32;
        Victim { child, pid }
    }
    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
    /// A record a previous agent could have written for this process (identity verifiable).
    fn record(&self, marker: &str, cgroup: Option<std::path::PathBuf>) -> PidRecord {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap();
        let start_time = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(19).unwrap().parse().unwrap();
        PidRecord {
            pid: self.pid,
            start_time,
            boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_string(),
            cgroup,
            marker: marker.into(),
            owner: Owner::supervise("test"),
            command: "sleep".into(),
        }
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cgroup the test makes (and removes, moving its processes out first).
struct TestCgroup(std::path::PathBuf);

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Ok(p) = std::fs::read_to_string(self.0.join("cgroup.procs")) {
            let parent = self.0.parent().unwrap().join("cgroup.procs");
            for pid in p.lines() {
                let _ = std::fs::write(&parent, pid);
            }
        }
        let _ = std::fs::remove_dir(&self.0);
        if let Some(p) = self.0.parent() {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// A forged record: a real cgroup made by the test in `hierarchy` but outside the agent's root,
/// named after the record's marker (tagged `tag`), with a victim process in it, and a PID record
/// naming that cgroup. pid 0: the run "never started" as far as the record knows, so only its
/// cgroup could matter. Returns the cgroup, the victim, the PID directory and the record's file.
fn forged_record(
    hierarchy: &std::path::Path,
    tag: &str,
) -> (TestCgroup, Victim, tempfile::TempDir, std::path::PathBuf) {
    let marker = format!("np1.1-0-{tag}{}", std::process::id());
    let outside = hierarchy.join(format!("nodeplan-test-forged-{}", std::process::id()));
    std::fs::create_dir_all(outside.join(&marker)).unwrap();
    let cg = TestCgroup(outside.join(&marker));
    let victim = Victim::start(None);
    std::fs::write(cg.0.join("cgroup.procs"), victim.pid.to_string()).unwrap();
    let pids = tempfile::tempdir().unwrap();
    let rec = PidRecord { pid: 0, start_time: 0, ..victim.record(&marker, Some(cg.0.clone())) };
    let file = rec.create(pids.path()).unwrap().path().to_path_buf();
    (cg, victim, pids, file)
}

fn refused(r: &Recovered) -> &str {
    match &r.result {
        RecoveryResult::Refused(why) => why,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A record naming a real cgroup2 directory outside the agent's root (with the record's marker as
/// its last component, which is all that used to be checked) is refused: its process is not
/// signalled, the cgroup is not removed, the record is kept.
#[tokio::test]
async fn a_record_naming_another_cgroup_is_refused_and_nothing_in_it_is_touched() {
    let sup = sup_with(short(true), CgroupMode::Auto, None);
    if !require_cgroup(&sup) {
        return;
    }
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mount = nodeplan::process::cgroup::find_cgroup2_mount(&mi).unwrap();
    let (cg, mut victim, pids, file) = forged_record(&mount, "forged");
    let sup = sup_with(short(true), CgroupMode::Auto, Some(pids.path()));
    let out = tokio::time::timeout(GUARD, sup.recover(|_| true)).await.unwrap();
    let (alive, kept) = (victim.alive(), cg.0.is_dir());
    assert!(alive, "a process in a cgroup the record merely named was signalled");
    assert!(kept, "a cgroup the record merely named was removed");
    assert_eq!(out.len(), 1);
    let why = refused(&out[0]);
    assert!(why.contains("not this agent's leaf") && !why.contains('\n'), "{why}");
    assert!(file.exists(), "the refused record is kept");
}

/// A record naming a plain directory made to look like a populated cgroup is refused: the process
/// its fake `cgroup.procs` lists is not signalled and nothing is removed.
#[tokio::test]
async fn a_record_naming_a_fake_cgroup_directory_is_refused() {
    let fake = tempfile::tempdir().unwrap();
    let marker = "np1.1-0-fakecg";
    let leaf = fake.path().join(marker);
    std::fs::create_dir(&leaf).unwrap();
    let mut victim = Victim::start(None);
    std::fs::write(leaf.join("cgroup.procs"), format!("{}\n", victim.pid)).unwrap();
    std::fs::write(leaf.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
    let pids = tempfile::tempdir().unwrap();
    let rec = PidRecord { pid: 0, start_time: 0, ..victim.record(marker, Some(leaf.clone())) };
    let file = rec.create(pids.path()).unwrap().path().to_path_buf();
    for mode in [CgroupMode::Auto, CgroupMode::Off] {
        let sup = sup_with(short(true), mode.clone(), Some(pids.path()));
        let out = tokio::time::timeout(GUARD, sup.recover(|_| true)).await.unwrap();
        assert!(victim.alive(), "{mode:?}: a process listed in a fake cgroup.procs was signalled");
        assert_eq!(out.len(), 1, "{mode:?}");
        let why = refused(&out[0]);
        assert!(why.contains(&leaf.display().to_string()) && !why.contains('\n'), "{why}");
        assert!(leaf.join("cgroup.procs").exists() && file.exists(), "{mode:?}: something was removed");
    }
}

/// A PID directory writable by group or others could hold anyone's records: all of them are
/// refused, even one that would verify, with one line naming the directory.
#[tokio::test]
async fn a_group_writable_pid_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let pids = tempfile::tempdir().unwrap();
    let marker = "np1.1-0-gw";
    let mut victim = Victim::start(Some(marker));
    victim.record(marker, None).create(pids.path()).unwrap();
    std::fs::set_permissions(pids.path(), std::fs::Permissions::from_mode(0o770)).unwrap();
    let sup = sup_with(short(true), CgroupMode::Off, Some(pids.path()));
    let out = tokio::time::timeout(GUARD, sup.recover(|_| true)).await.unwrap();
    assert!(victim.alive(), "a record in a group-writable directory was acted on");
    assert_eq!(out.len(), 1);
    let why = refused(&out[0]);
    assert!(why.contains("writable by group or others (mode 0770)") && !why.contains('\n'), "{why}");
    assert_eq!(out[0].path, pids.path());
    assert_eq!(std::fs::read_dir(pids.path()).unwrap().count(), 1, "the record is kept");
}

/// Record files the agent cannot have written are refused without being read: a symbolic link
/// (to a record that would verify), a file writable by group, a file owned by another user.
#[tokio::test]
async fn untrusted_record_files_are_refused_and_nothing_is_signalled() {
    use std::os::unix::fs::PermissionsExt;
    let elsewhere = tempfile::tempdir().unwrap();
    let pids = tempfile::tempdir().unwrap();
    let marker = "np1.1-0-untrusted";
    let mut victim = Victim::start(Some(marker));
    let target = victim.record(marker, None).create(elsewhere.path()).unwrap().path().to_path_buf();
    std::os::unix::fs::symlink(&target, pids.path().join("a-link.json")).unwrap();
    let gw = pids.path().join("b-group-writable.json");
    std::fs::copy(&target, &gw).unwrap();
    std::fs::set_permissions(&gw, std::fs::Permissions::from_mode(0o620)).unwrap();
    let other = pids.path().join("c-other-owner.json");
    std::fs::copy(&target, &other).unwrap();
    std::os::unix::fs::chown(&other, Some(65534), Some(65534)).unwrap();
    let sup = sup_with(short(true), CgroupMode::Off, Some(pids.path()));
    let out = tokio::time::timeout(GUARD, sup.recover(|_| true)).await.unwrap();
    assert!(victim.alive(), "an untrusted record was acted on");
    let whys: Vec<&str> = out.iter().map(refused).collect();
    assert_eq!(whys.len(), 3, "{whys:?}");
    assert!(whys[0].contains("a-link.json is a symbolic link"), "{}", whys[0]);
    assert!(whys[1].contains("writable by group or others (mode 0620)"), "{}", whys[1]);
    assert!(whys[2].contains("is owned by uid 65534"), "{}", whys[2]);
    assert!(whys.iter().all(|w| !w.contains('\n')));
    assert!(out.iter().all(|r| r.record.is_none()), "nothing of an untrusted record is read");
    assert_eq!(std::fs::read_dir(pids.path()).unwrap().count(), 3, "the records are kept");
}

/// A process the test must not leave behind whatever happens, killed on drop through a pidfd
/// taken while it was known to be ours (never a recycled pid).
struct Guard(rustix::fd::OwnedFd);

impl Guard {
    fn new(pid: i32) -> Guard {
        let pid = rustix::process::Pid::from_raw(pid).unwrap();
        Guard(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = rustix::process::pidfd_send_signal(&self.0, rustix::process::Signal::KILL);
    }
}

/// An instruction that starts an escapee which leaves its session and drops its whole environment
/// (so neither the process group nor the run marker finds it) and ignores SIGTERM, then waits.
const ESCAPE: &str = r#"setsid env -i /bin/sh -c 'trap "" TERM; echo escapee $$; exec sleep 1000' </dev/null & echo ready; exec sleep 1000"#;

fn sh_spec(script: &str, sink: std::sync::Arc<dyn LineSink>) -> SpawnSpec {
    let mut spec = SpawnSpec::new("sh", ["-c", script]);
    spec.sink = sink;
    spec.owner = Owner::supervise("test");
    spec
}

fn v1_supervisor(policy: StopPolicy, pid_dir: Option<&std::path::Path>) -> Option<Supervisor> {
    let sup = sup_with(policy, CgroupMode::V1, pid_dir);
    require(sup.cgroup_root().is_some(), "a cgroup v1 freezer hierarchy").then_some(sup)
}

/// Start [`ESCAPE`] and wait until the escapee is set up; its pid, checked to have really escaped.
async fn start_escapee(lines: &mut Lines) -> (i32, Guard) {
    let pid: i32 = wait_line(lines, "escapee").await.parse().unwrap();
    let guard = Guard::new(pid);
    wait_line(lines, "ready").await;
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(!env.windows(MARKER_ENV.len()).any(|w| w == MARKER_ENV.as_bytes()), "the escapee kept the marker");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let sid: i32 = stat[stat.rfind(')').unwrap() + 1..].split_whitespace().nth(3).unwrap().parse().unwrap();
    assert_eq!(sid, pid, "the escapee leads a session of its own");
    (pid, guard)
}

/// With the cgroup v1 freezer backend, a cancel stops an escapee that left the session and dropped
/// its environment (the process-group-and-marker fallback cannot find it): the leaf is frozen, its
/// processes killed, the leaf thawed and removed.
#[tokio::test]
async fn v1_freezer_cancel_kills_an_escapee_that_dropped_its_session_and_environment() {
    let Some(sup) = v1_supervisor(short(true), None) else { return };
    let root = sup.cgroup_root().unwrap().to_path_buf();
    assert_eq!(nodeplan::process::cgroup::fs_magic(&root).unwrap(), nodeplan::process::cgroup::CGROUP_SUPER_MAGIC);
    let (sink, mut lines) = chan_sink();
    let (tx, mut stop) = StopSignal::channel();
    let sup2 = sup.clone();
    let run = tokio::spawn(async move { sup2.run(sh_spec(ESCAPE, sink), &mut stop).await });
    let (escapee, _guard) = start_escapee(&mut lines).await;
    let in_leaf = std::fs::read_to_string(format!("/proc/{escapee}/cgroup")).unwrap();
    tx.send(Some(StopReason::Cancel)).unwrap();
    let r = tokio::time::timeout(GUARD, run).await.expect("the cancel hung").unwrap();
    let survived = alive(escapee);
    assert!(in_leaf.lines().any(|l| l.contains(":freezer:") && l.ends_with(&r.marker)), "{in_leaf}");
    assert!(!survived, "the escapee survived the cancel");
    assert_eq!(r.outcome.to_string(), "killed after 300ms grace");
    assert!(!root.join(&r.marker).exists(), "the run's v1 leaf is removed once empty");
}

/// Recovery with the v1 backend: the record names the v1 leaf, which is verified (this agent's v1
/// root plus the marker, on a cgroup v1 filesystem) and stopped with everything in it.
#[tokio::test]
async fn v1_freezer_recovery_stops_a_leftover_escapee_through_its_leaf() {
    let pids = tempfile::tempdir().unwrap();
    let Some(first) = v1_supervisor(long(), Some(pids.path())) else { return };
    let (sink, mut lines) = chan_sink();
    // The "crashed agent": its run is dropped mid-flight, leaving the tree and its record.
    let run = tokio::spawn(async move { first.run(sh_spec(ESCAPE, sink), &mut StopSignal::never()).await });
    let (escapee, _guard) = start_escapee(&mut lines).await;
    run.abort();
    let _ = run.await;
    let recs = PidRecord::load_all(pids.path());
    let leaf = recs[0].1.as_ref().unwrap().cgroup.clone().unwrap();
    assert!(alive(escapee) && leaf.is_dir());
    let second = v1_supervisor(short(true), Some(pids.path())).unwrap();
    assert!(leaf.starts_with(second.cgroup_root().unwrap()), "{}", leaf.display());
    let rec = tokio::time::timeout(GUARD, second.recover(|r| r.owner == Owner::supervise("test"))).await.unwrap();
    let survived = alive(escapee);
    assert_eq!(rec.len(), 1);
    assert!(matches!(rec[0].result, RecoveryResult::Stopped(Outcome::Killed { .. })), "{:?}", rec[0].result);
    assert!(!survived, "the escapee survived recovery");
    assert!(!leaf.exists(), "the leaf is removed");
    assert!(PidRecord::load_all(pids.path()).is_empty());
}

/// Item 3's rule holds for the v1 backend too: a record naming a v1 freezer cgroup outside the
/// agent's v1 root is refused, and nothing in it is signalled or removed.
#[tokio::test]
async fn a_record_naming_another_v1_cgroup_is_refused() {
    let Some(sup) = v1_supervisor(short(true), None) else { return };
    let hierarchy = sup.cgroup_root().unwrap().parent().unwrap().to_path_buf();
    let (cg, mut victim, pids, _file) = forged_record(&hierarchy, "forgedv1");
    let sup = v1_supervisor(short(true), Some(pids.path())).unwrap();
    let out = tokio::time::timeout(GUARD, sup.recover(|_| true)).await.unwrap();
    assert!(victim.alive() && cg.0.is_dir(), "a v1 cgroup the record merely named was acted on");
    assert!(refused(&out[0]).contains("not this agent's leaf"), "{out:?}");
}
