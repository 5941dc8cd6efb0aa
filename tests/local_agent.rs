//! Local mode end to end: the real `nodeplan agent` binary on a temp plan directory.

mod common;

use common::*;

use nodeplan::plan::PlanState;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

struct Setup {
    node: LocalNode,
}

impl std::ops::Deref for Setup {
    type Target = LocalNode;
    fn deref(&self) -> &LocalNode {
        &self.node
    }
}

impl Setup {
    fn new() -> Setup {
        Setup { node: LocalNode::new(|_| String::new()) }
    }
    fn start(&self) -> AgentProc {
        AgentProc::start(&self.config())
    }
    fn cli(&self, args: &[&str]) {
        let out = Command::new(NODEPLAN).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

fn sh(name: &str, script: &str) -> serde_json::Value {
    serde_json::json!({"name": name, "command": "sh", "args": ["-c", script], "saveOutput": true})
}

fn last_pid(line: &str) -> i32 {
    line.split_whitespace().last().unwrap().parse().unwrap()
}

#[test]
fn applies_a_plan_and_records_the_pos_file() {
    let s = Setup::new();
    let target = s.p("etc/app.conf");
    let raw = s.plan(
        "web",
        serde_json::json!({
            "files": [{"path": target, "content": "aGVsbG8=", "permissions": "0640"}],
            "instructions": [sh("cat", &format!("cat {target}"))]
        }),
    );
    let mut agent = s.start();
    let pos = s.wait_pos("web", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    let checksum = nodeplan::plan::checksum(&raw);
    assert_eq!(pos.applied_checksum, checksum);
    assert_eq!(pos.plan_checksum, checksum);
    assert_eq!(pos.success_count, 1);
    assert_eq!(pos.failure_count, 0);
    assert!(pos.checkpoint.is_none());
    let out = nodeplan::plan::decode_one_time_output(&pos.output).unwrap();
    assert_eq!(out["cat"], b"hello");
    assert_eq!(std::fs::read(&target).unwrap(), b"hello");
    assert_eq!(agent.stop(), 0);
}

/// R23: a plan that upgrades nodeplan itself. Instruction 1 replaces the agent's program (here a
/// copy the test started, replaced by a wrapper that notes each start) and asks for a restart;
/// the agent records its progress and executes the new program in the same process; the
/// restarted agent goes on at instruction 2. Nothing runs twice, the agent restarts once, and its
/// pid (a systemd unit's main process) stays.
#[test]
fn a_plan_that_upgrades_the_agent_restarts_it_once_and_never_runs_again() {
    let s = Setup::new();
    let bin = s.p("bin");
    std::fs::create_dir(&bin).unwrap();
    let program = format!("{bin}/nodeplan");
    std::fs::copy(NODEPLAN, &program).unwrap();
    let (runs, starts) = (s.p("runs"), s.p("starts"));
    let upgrade = upgrade_script(&program, &runs, &format!("echo started >> {starts}"));
    s.plan(
        "upgrade",
        serde_json::json!({"instructions": [sh("upgrade", &upgrade), sh("after", &format!("echo after >> {runs}"))]}),
    );
    let mut agent = AgentProc::start_program(Path::new(&program), Path::new(&s.p("config.yaml")), &[]);
    let pid = agent.child.id();
    agent.wait_log("asked for the agent to restart");
    agent.wait_log("starting again as an instruction asked");
    agent.wait_log("resuming at instruction 2/2");
    let pos = s.wait_pos("upgrade", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(pos.success_count, 1);
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "upgrade\nafter\n", "nothing ran twice");
    assert_eq!(std::fs::read_to_string(&starts).unwrap(), "started\n", "one restart, by the new program");
    assert_eq!(agent.child.try_wait().unwrap(), None, "the same process goes on");
    assert_eq!(agent.child.id(), pid);
    assert_eq!(agent.stop(), 0);
}

#[test]
fn a_failed_plan_is_recorded_as_failed_and_retried_after_the_backoff() {
    let s = Setup::new();
    let ok = s.p("ok");
    s.plan("retry", serde_json::json!({"instructions": [sh("check", &format!("test -e {ok}"))]}));
    let mut agent = s.start();
    let failed = s.wait_pos("retry", "failed", |p| p.plan_state == Some(PlanState::Failed));
    assert!(failed.applied_checksum.is_empty(), "a failed plan is not recorded as applied");
    assert_eq!(failed.failed_checksum, failed.plan_checksum);
    assert!(failed.failure_count >= 1);
    agent.wait_log("retrying after failure");
    std::fs::write(&ok, b"").unwrap();
    let done = s.wait_pos("retry", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(done.failure_count, 0);
    assert_eq!(done.applied_checksum, done.plan_checksum);
    assert_eq!(agent.stop(), 0);
}

/// A plan that fails at its second instruction (issue 24): `plan status` names the instruction,
/// its exit status and its last output lines, with the instruction's env value masked, and
/// `plan logs` shows each instruction's saved output and outcome; the `.pos` file keeps the
/// failure (`lastFailure`) until the plan succeeds.
#[test]
fn plan_status_names_the_failing_instruction_its_exit_status_and_last_lines() {
    let s = Setup::new();
    let ok = s.p("ok");
    let mut boom = sh("boom", &format!("test -e {ok} && exit 0; echo disk full; echo token $TOKEN; exit 3"));
    boom["env"] = serde_json::json!(["TOKEN=hunter2-secret"]);
    s.plan("f", serde_json::json!({"instructions": [sh("prepare", "echo ready"), boom]}));
    let mut agent = s.start();
    let failed = s.wait_pos("f", "failed", |p| p.plan_state == Some(PlanState::Failed));
    let f = failed.last_failure.expect("lastFailure");
    assert_eq!((f.instruction, f.total, f.outcome.as_str()), (Some(2), 2, "exit status 3"));
    let status = Command::new(NODEPLAN).args(["plan", "status", s.plan_path("f").to_str().unwrap()]).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(
            "failure:    instruction 2/2 boom: exit status 3\n            | disk full\n            | token ***\n"
        ),
        "{status}"
    );
    assert!(!status.contains("hunter2"), "{status}");
    // The same as one document (the row `--selector` prints for a node), and by name.
    let path = s.plan_path("f").display().to_string();
    let shown = |format: &str| {
        let out = Command::new(NODEPLAN).args(["plan", "status", &path, "-o", format]).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let row: serde_json::Value = serde_json::from_str(&shown("json")).unwrap();
    assert_eq!(
        (&row["kind"], &row["name"], &row["state"]),
        (&"PlanFile".into(), &path.clone().into(), &"failed".into())
    );
    assert_eq!((&row["completed"], &row["total"]), (&1.into(), &2.into()), "{row}");
    assert_eq!(row["plan"], nodeplan::plan::id_of(&std::fs::read(&path).unwrap()).unwrap());
    let error = row["error"].as_str().unwrap();
    assert!(error.contains("instruction 2/2 boom: exit status 3") && !error.contains("hunter2"), "{row}");
    assert!(row["lastChange"].as_str().is_some_and(|t| t.ends_with('Z') && t.contains('T')), "RFC 3339: {row}");
    // The same document in YAML (its fields that a retry meanwhile cannot change).
    let yaml: serde_json::Value = serde_yaml_ng::from_str(&shown("yaml")).unwrap();
    for field in ["kind", "name", "node", "plan", "total"] {
        assert_eq!(yaml[field], row[field], "{field}: {yaml}");
    }
    assert_eq!(shown("name"), format!("{path}\n"));
    // The retry (1 s later) may have begun: the failed run is shown under a line that says so.
    let logs = Command::new(NODEPLAN).args(["plan", "logs", s.plan_path("f").to_str().unwrap()]).output().unwrap();
    let logs = String::from_utf8_lossy(&logs.stdout);
    assert_eq!(
        logs.strip_prefix("in-progress again; its last finished run failed:\n").unwrap_or(&logs),
        "instruction 1/2 prepare: ok\n  | ready\ninstruction 2/2 boom: FAILED (exit status 3)\n  | disk full\n  | token ***\n"
    );
    std::fs::write(&ok, b"").unwrap();
    let done = s.wait_pos("f", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(done.last_failure, None, "a success clears it");
    let status = Command::new(NODEPLAN).args(["plan", "status", s.plan_path("f").to_str().unwrap()]).output().unwrap();
    assert!(!String::from_utf8_lossy(&status.stdout).contains("failure:"));
    assert_eq!(agent.stop(), 0);
}

/// Files that cannot be written fail the apply like a failing instruction: recorded as failed
/// with its counter (and shown so by `plan status`), retried on the local schedule the log names
/// (localRetrySeconds 1: 1s, then 2s), and applied once the obstacle is gone.
#[test]
fn a_plan_whose_files_cannot_be_written_is_a_failed_apply_retried_on_schedule() {
    let s = Setup::new();
    let blocker = s.p("blocker");
    std::fs::write(&blocker, b"a file where a directory is needed").unwrap();
    let ran = s.p("ran");
    s.plan(
        "f",
        serde_json::json!({
            "files": [{"path": format!("{blocker}/conf"), "content": "eA=="}],
            "instructions": [sh("a", &format!("touch {ran}"))]
        }),
    );
    let mut agent = s.start();
    agent.wait_log("the apply failed (failure 1); retrying in 1s");
    let failed = s.wait_pos("f", "failed", |p| p.plan_state == Some(PlanState::Failed));
    assert_eq!(failed.failure_count, 1);
    let status = Command::new(NODEPLAN).args(["plan", "status", s.plan_path("f").to_str().unwrap()]).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("state:      failed"), "{status}");
    assert!(status.contains("1 failed in a row"), "{status}");
    assert!(status.contains(&format!("failure:    files: writing {blocker}/conf: Not a directory")), "{status}");
    agent.wait_log("the apply failed (failure 2); retrying in 2s");
    assert!(!Path::new(&ran).exists(), "nothing ran");
    std::fs::remove_file(&blocker).unwrap();
    let done = s.wait_pos("f", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(done.failure_count, 0);
    assert!(Path::new(&ran).exists());
    assert_eq!(std::fs::read(format!("{blocker}/conf")).unwrap(), b"x");
    assert_eq!(agent.stop(), 0);
}

/// A plan file removed while the plan runs: the running instruction finishes, nothing new starts,
/// the plan is recorded as paused with its checkpoint; the same plan put back continues.
#[test]
fn a_plan_removed_while_it_runs_stops_at_the_boundary_and_continues_when_it_comes_back() {
    let s = Setup::new();
    let (ready, go, marker) = (s.fifo("ready"), s.fifo("go"), s.p("marker"));
    let raw = s.plan(
        "r",
        serde_json::json!({"instructions": [
            sh("one", &format!("echo one >> {marker}; echo > {ready}; cat {go} > /dev/null")),
            sh("two", &format!("echo two >> {marker}")),
        ]}),
    );
    let mut agent = s.start();
    read_fifo(&ready);
    std::fs::remove_file(s.plan_path("r")).unwrap();
    agent.wait_log("the plan file was removed while the plan runs");
    release_fifo(&go);
    let paused = s.wait_pos("r", "paused", |p| p.plan_state == Some(PlanState::Paused));
    let cp = paused.checkpoint.unwrap();
    assert_eq!((cp.completed_instructions, cp.total_instructions), (1, 2));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\n", "nothing new started");
    std::fs::write(s.plan_path("r"), &raw).unwrap();
    s.wait_pos("r", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\n", "continued, nothing ran twice");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn pause_while_instruction_two_runs_then_resume_runs_only_instruction_three() {
    let s = Setup::new();
    let (ready, go, marker) = (s.fifo("ready"), s.fifo("go"), s.p("marker"));
    s.plan(
        "p",
        serde_json::json!({"instructions": [
            sh("one", &format!("echo one >> {marker}")),
            sh("two", &format!("echo two >> {marker}; echo > {ready}; cat {go} > /dev/null")),
            sh("three", &format!("echo three >> {marker}")),
        ]}),
    );
    let plan = s.plan_path("p");
    let mut agent = s.start();
    read_fifo(&ready);
    s.cli(&["plan", "pause", plan.to_str().unwrap()]);
    agent.wait_log("pause requested");
    release_fifo(&go);
    let paused = s.wait_pos("p", "paused", |p| p.plan_state == Some(PlanState::Paused));
    let cp = paused.checkpoint.clone().unwrap();
    assert_eq!((cp.completed_instructions, cp.total_instructions, cp.paused), (2, 3, true));
    assert_eq!(cp.resume_state, Some(PlanState::InProgress));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\n");
    let status = Command::new(NODEPLAN).args(["plan", "status", plan.to_str().unwrap()]).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("state:      paused") && status.contains("2/3 instructions done"), "{status}");
    s.cli(&["plan", "resume", plan.to_str().unwrap()]);
    let done = s.wait_pos("p", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\nthree\n", "finished instructions are not re-run");
    let out = nodeplan::plan::decode_one_time_output(&done.output).unwrap();
    assert!(out.contains_key("one") && out.contains_key("two") && out.contains_key("three"), "{out:?}");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn cancel_kills_the_whole_tree_including_a_setsid_grandchild() {
    let s = Setup::new();
    let after = s.p("after");
    s.plan(
        "c",
        serde_json::json!({"instructions": [
            {"name": "escape", "command": HELPER, "args": ["setsid-wait"], "saveOutput": true},
            sh("after", &format!("touch {after}")),
        ]}),
    );
    let plan = s.plan_path("c");
    let mut agent = AgentProc::start_with(&s.config(), &[OUTPUT_LOGGED]);
    let gc = last_pid(&agent.wait_log("grandchild "));
    let leader = last_pid(&agent.wait_log("ready "));
    assert!(alive(gc) && alive(leader));
    s.cli(&["plan", "cancel", plan.to_str().unwrap()]);
    let pos = s.wait_pos("c", "canceled", |p| p.plan_state == Some(PlanState::Canceled));
    let (gc_alive, leader_alive) = (alive(gc), alive(leader));
    kill_all(&[gc, leader]);
    assert!(!leader_alive, "the instruction survived the cancel");
    assert!(!gc_alive, "the setsid grandchild survived the cancel");
    let cp = pos.checkpoint.unwrap();
    assert!(!cp.paused && cp.resume_state.is_none());
    assert_eq!((cp.completed_instructions, cp.total_instructions), (0, 2));
    assert!(!Path::new(&after).exists());
    agent.wait_log("the node may be left partly changed");
    // `plan logs` tells the instruction stopped while it ran from the one never run.
    let logs = Command::new(NODEPLAN).args(["plan", "logs", plan.to_str().unwrap()]).output().unwrap();
    let logs = String::from_utf8_lossy(&logs.stdout);
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines.first(), Some(&"instruction 1/2 escape: stopped while running (canceled)"), "{logs}");
    assert!(lines.iter().any(|l| l.starts_with("  | ready ")), "its output: {logs}");
    assert_eq!(lines.last(), Some(&"instruction 2/2 after: not run (canceled)"), "{logs}");
    // Terminal: removing the control file does not resume (R8); reset runs it again.
    std::fs::remove_file(s.dir.path().join("plans/c.canceled")).unwrap();
    // A plan created after the removal is applied in a cycle that also looked at `c` again.
    s.plan("d", serde_json::json!({"instructions": [sh("d", "true")]}));
    s.wait_pos("d", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(s.pos("c").plan_state, Some(PlanState::Canceled));
    assert!(!agent.drain().iter().any(|l| l.contains("grandchild ")), "nothing ran again");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn a_killed_agent_leaves_nothing_running_twice() {
    let s = Setup::new();
    let (ready, starts, overlap, pidfile) = (s.fifo("ready"), s.p("starts"), s.p("overlap"), s.p("pid"));
    let script = format!(
        "{}; echo start >> {starts}; echo > {ready}; exec sleep 300",
        overlap_check(&pidfile, &overlap, "overlap")
    );
    s.plan("k", serde_json::json!({"instructions": [sh("long", &script)]}));
    let mut first = s.start();
    read_fifo(&ready);
    let leftover: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    first.signal(libc::SIGKILL);
    let _ = first.child.wait();
    assert!(alive(leftover), "the instruction outlives the SIGKILLed agent");
    assert_eq!(s.pos("k").plan_state, Some(PlanState::InProgress));
    let mut second = s.start();
    read_fifo(&ready);
    let was_alive = alive(leftover);
    kill_all(&[leftover]);
    assert!(!was_alive, "the leftover was stopped before the re-run");
    second.drain();
    assert!(
        !Path::new(&overlap).exists(),
        "two copies of the instruction ran at once; agent log:\n{}",
        second.seen.join("\n")
    );
    assert_eq!(std::fs::read_to_string(&starts).unwrap(), "start\nstart\n");
    second.wait_log("stopped leftover pid");
    // Shutdown: the instruction is stopped through the ladder, the plan stays in-progress, exit 0.
    assert_eq!(second.stop(), 0);
    assert_eq!(s.pos("k").plan_state, Some(PlanState::InProgress));
    assert!(std::fs::read_dir(s.p("pids")).unwrap().next().is_none(), "no PID records left");
}

#[test]
fn an_invalid_control_value_writes_nothing() {
    let s = Setup::new();
    let ran = s.p("ran");
    s.plan("bad", serde_json::json!({"instructions": [sh("a", &format!("touch {ran}"))]}));
    std::fs::write(s.dir.path().join("plans/bad.paused"), b"yes\n").unwrap();
    s.plan("good", serde_json::json!({"instructions": [sh("a", "true")]}));
    let mut agent = s.start();
    agent.wait_log("invalid value \"yes\"");
    s.wait_pos("good", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    // Several more cycles (the good plan's probes and rescans) pass; still nothing for `bad`.
    agent.wait_log("");
    assert!(!s.dir.path().join("plans/bad.pos").exists(), "R3: nothing is written");
    assert!(!Path::new(&ran).exists(), "R3: nothing runs");
    // A valid value releases it.
    std::fs::write(s.dir.path().join("plans/bad.paused"), b"false").unwrap();
    s.wait_pos("bad", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(Path::new(&ran).exists());
    assert_eq!(agent.stop(), 0);
}

/// SECURITY.md, local mode: files others may have planted in the plan directory (a FIFO as a
/// control file, a `.pos` that is a link, a plan file others can write) hold their plan with one
/// clear line; they never hang the agent, are never followed, and never run.
#[test]
fn hostile_local_files_hold_their_plan_and_never_hang_the_agent() {
    use std::os::unix::fs::PermissionsExt;
    let s = Setup::new();
    let ran = |n: &str| s.p(&format!("ran-{n}"));
    for name in ["fifo", "link", "open", "newer", "good"] {
        s.plan(name, serde_json::json!({"instructions": [sh("a", &format!("touch {}", ran(name)))]}));
    }
    // R25: a .pos written by a newer nodeplan is kept as it is and holds its plan.
    let newer = br#"{"appliedChecksum":"x","nodeplanFormat":2}"#;
    std::fs::write(s.p("plans/newer.pos"), newer).unwrap();
    mkfifo(&s.p("plans/fifo.paused"));
    let victim = s.p("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::os::unix::fs::symlink(&victim, s.p("plans/link.pos")).unwrap();
    std::fs::set_permissions(s.plan_path("open"), std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut agent = s.start();
    agent.wait_log("fifo.paused: is not a regular file (a FIFO)");
    agent.wait_log("link.pos: cannot use: is a symlink (not followed)");
    agent.wait_log("open.plan is writable by group or others (mode 0666)");
    agent.wait_log("newer.pos: cannot use: .pos file written by a newer nodeplan (format 2");
    s.wait_pos("good", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    for name in ["fifo", "link", "open", "newer"] {
        assert!(!Path::new(&ran(name)).exists(), "{name}: held, never run");
    }
    assert_eq!(std::fs::read(s.p("plans/newer.pos")).unwrap(), newer, "never written over");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    // Once the file is as it should be, the plan runs.
    std::fs::set_permissions(s.plan_path("open"), std::fs::Permissions::from_mode(0o644)).unwrap();
    s.wait_pos("open", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    // The FIFO never had a writer: the agent still stops on SIGTERM at once.
    assert_eq!(agent.stop(), 0);
    assert!(!Path::new(&ran("fifo")).exists());
}

#[test]
fn probe_statuses_keep_changing_while_paused() {
    let s = Setup::new();
    let status = Arc::new(AtomicU16::new(200));
    let port = http_server(status.clone());
    let ran = s.p("ran");
    s.plan("h", serde_json::json!({
        "instructions": [sh("a", &format!("touch {ran}"))],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/healthz")}, "successThreshold": 1, "failureThreshold": 1}}
    }));
    std::fs::write(s.dir.path().join("plans/h.paused"), b"").unwrap();
    let mut agent = s.start();
    s.wait_pos("h", "paused and healthy", |p| {
        p.plan_state == Some(PlanState::Paused) && p.probe_status.get("web").is_some_and(|w| w.healthy)
    });
    status.store(503, Ordering::SeqCst);
    s.wait_pos("h", "unhealthy", |p| p.probe_status.get("web").is_some_and(|w| !w.healthy && w.failure_count == 1));
    status.store(200, Ordering::SeqCst);
    s.wait_pos("h", "healthy again", |p| p.probe_status.get("web").is_some_and(|w| w.healthy));
    assert!(!Path::new(&ran).exists(), "nothing ran while paused");
    assert_eq!(s.pos("h").plan_state, Some(PlanState::Paused));
    assert_eq!(agent.stop(), 0);
}

#[test]
fn bad_config_is_one_line_and_exit_2() {
    let s = Setup::new();
    let path = s.p("config.yaml");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = Command::new(NODEPLAN).args(["agent", "--config", &path]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("0600"), "{err}");
}

#[test]
fn a_plan_system_agent_already_applied_is_not_run_again() {
    let s = Setup::new();
    let ran = s.p("ran");
    let raw = s.plan("old", serde_json::json!({"instructions": [sh("a", &format!("touch {ran}"))]}));
    // system-agent's .pos: only its own fields.
    let pos = format!(r#"{{"appliedChecksum":"{}"}}"#, nodeplan::plan::checksum(&raw));
    std::fs::write(s.dir.path().join("plans/old.pos"), pos).unwrap();
    // Plans are applied in path order: `zz` comes after `old` in the same cycle.
    s.plan("zz", serde_json::json!({"instructions": [sh("a", "true")]}));
    let mut agent = s.start();
    s.wait_pos("zz", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(!Path::new(&ran).exists(), "an already-applied plan was run again after the migration");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn without_inotify_pause_and_shutdown_still_reach_a_running_plan() {
    let s = Setup::new();
    let (ready, go, marker) = (s.fifo("ready"), s.fifo("go"), s.p("marker"));
    s.plan(
        "n",
        serde_json::json!({"instructions": [
            sh("one", &format!("echo one >> {marker}; echo > {ready}; cat {go} > /dev/null")),
            sh("two", &format!("echo two >> {marker}")),
        ]}),
    );
    let plan = s.plan_path("n");
    let mut agent = AgentProc::start_with(s.dir.path().join("config.yaml").as_path(), &[("NODEPLAN_NO_INOTIFY", "1")]);
    read_fifo(&ready);
    s.cli(&["plan", "pause", plan.to_str().unwrap()]);
    // No inotify: the running plan's control files are polled.
    agent.wait_log("pause requested");
    release_fifo(&go);
    let p = s.wait_pos("n", "paused", |p| p.plan_state == Some(PlanState::Paused));
    assert_eq!(p.checkpoint.unwrap().completed_instructions, 1);
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\n");
    assert_eq!(agent.stop(), 0);
}

/// The plan directory removed and made again: the agent watches the new one (and applies what
/// appears in it).
#[test]
fn a_recreated_plan_directory_is_watched_again() {
    let s = Setup::new();
    let mut agent = s.start();
    let plans = s.p("plans");
    agent.wait_log(&format!("watching {plans} for changes"));
    std::fs::remove_dir(&plans).unwrap();
    std::fs::create_dir(&plans).unwrap();
    agent.wait_log(&format!("watching {plans} for changes"));
    let marker = s.p("marker");
    s.plan("again", serde_json::json!({"instructions": [sh("one", &format!("touch {marker}"))]}));
    s.wait_pos("again", "applied", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(Path::new(&marker).exists());
    assert_eq!(agent.stop(), 0);
}

/// Faults (`docs/rules.md#proof-faults`): the agent SIGKILLed at pseudo-random points of a plan and
/// restarted, again and again. The plan ends succeeded, no instruction ever ran while its previous
/// copy was alive, and nothing any of the agents started is left running.
#[test]
fn sigkill_at_random_points_then_restart() {
    let s = Setup::new();
    let (log, overlap, pidfile) = (s.p("log"), s.p("overlap"), s.p("pid"));
    let steps: Vec<serde_json::Value> = (0..5)
        .map(|i| {
            sh(
                &format!("s{i}"),
                &format!(
                    "{}; echo start-{i} >> {log}; sleep 0.1; echo end-{i} >> {log}",
                    overlap_check(&pidfile, &overlap, &format!("overlap-{i}"))
                ),
            )
        })
        .collect();
    s.plan("f", serde_json::json!({ "instructions": steps }));
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut agents = Vec::new();
    for _ in 0..8 {
        let agent = s.start();
        agents.push(agent.child.id());
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // A fault injected at a pseudo-random moment (this sleep is the fault's timing, not a wait).
        std::thread::sleep(Duration::from_millis(seed % 400));
        agent.crash();
    }
    let mut last = s.start();
    agents.push(last.child.id());
    s.wait_pos("f", "succeeded after the faults", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(last.stop(), 0);
    assert!(
        !Path::new(&overlap).exists(),
        "an instruction ran while its previous copy was alive: {}",
        std::fs::read_to_string(&overlap).unwrap_or_default()
    );
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    for i in 0..5 {
        assert!(log.contains(&format!("end-{i}")), "instruction {i} never finished: {log}");
    }
    assert!(log.matches("start-").count() > 5, "the faults hit the plan mid-way (instructions re-ran): {log}");
    let left: Vec<i32> = agents.iter().flat_map(|a| started_by(*a)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// A PID record of one plan that cannot be trusted (it names a cgroup that is not the agent's
/// leaf for its marker) holds that plan, reported as blocked, instead of letting it run again
/// beside whatever may still be running; other plans run.
#[test]
fn a_refused_pid_record_blocks_its_plan_and_only_that_plan() {
    let s = Setup::new();
    let (ran_a, ran_b) = (s.p("ran-a"), s.p("ran-b"));
    s.plan("a", serde_json::json!({"instructions": [sh("a", &format!("touch {ran_a}"))]}));
    s.plan("b", serde_json::json!({"instructions": [sh("b", &format!("touch {ran_b}"))]}));
    let marker = "np1.1-0-forgedlocal";
    let fake = s.dir.path().join("fake").join(marker);
    std::fs::create_dir_all(&fake).unwrap();
    let record = nodeplan::process::PidRecord {
        pid: 0,
        start_time: 0,
        boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_string(),
        cgroup: Some(fake.clone()),
        marker: marker.into(),
        owner: nodeplan::process::Owner::local(&s.plan_path("a")).with_slot(nodeplan::process::Slot::OneTime(0)),
        command: "sh".into(),
    };
    let file = record.create(Path::new(&s.p("pids"))).unwrap().path().to_path_buf();
    let mut agent = s.start();
    let pos = s.wait_pos("a", "blocked", |p| !p.blocked.is_empty());
    s.wait_pos("b", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(pos.blocked.contains("refused") && pos.blocked.contains(&fake.display().to_string()), "{}", pos.blocked);
    assert!(!Path::new(&ran_a).exists(), "the blocked plan ran");
    assert!(file.exists() && fake.is_dir(), "nothing is removed");
    assert_eq!(agent.stop(), 0);
}

/// The `plan` commands on a local plan: a bare file name works (relative to the current
/// directory), a plan that does not exist is refused before anything is written, each command
/// says in one line what it did, and `plan status` shows a long control value as a short prefix.
#[test]
fn plan_commands_say_what_they_did_and_refuse_a_missing_plan() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("a.plan"), b"{}").unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(NODEPLAN).args(args).current_dir(d.path()).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = run(&["plan", "pause", "a.plan"]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "paused a.plan: wrote a.paused (the agent pauses it at the next instruction boundary)\n"),
        "{err}"
    );
    assert_eq!(std::fs::read(d.path().join("a.paused")).unwrap(), b"true\n");
    let (code, out, _) = run(&["plan", "resume", "a.plan"]);
    assert_eq!((code, out.as_str()), (Some(0), "resumed a.plan: removed a.paused\n"));
    let (code, out, _) = run(&["plan", "resume", "a.plan"]);
    assert_eq!((code, out.as_str()), (Some(0), "a.plan was not paused (no a.paused); nothing to do\n"));
    // Reset does what it says: the plan runs again, neither canceled nor paused.
    run(&["plan", "pause", "a.plan"]);
    let (code, out, _) = run(&["plan", "reset", "a.plan"]);
    assert_eq!(
        (code, out.as_str()),
        (
            Some(0),
            "reset a.plan: wrote a.reset, removed a.paused (the agent runs it again from its first instruction)\n"
        )
    );
    assert!(!d.path().join("a.paused").exists());
    std::fs::remove_file(d.path().join("a.reset")).unwrap();
    for action in ["pause", "resume", "cancel", "reset", "status"] {
        let (code, out, err) = run(&["plan", action, "b.plan"]);
        assert_eq!((code, out.as_str()), (Some(2), ""), "{action}: {err}");
        assert!(err.starts_with("nodeplan: b.plan: No such file or directory"), "{action}: {err}");
    }
    let (code, _, err) = run(&["plan", "push", "a.plan"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("plan push needs --secret NAMESPACE/NAME"), "{err}");
    let names: Vec<String> =
        std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["a.plan"], "nothing written beside a missing plan");
    std::fs::write(d.path().join("a.canceled"), "y\n".repeat(500)).unwrap();
    let (code, out, _) = run(&["plan", "status", "a.plan"]);
    assert_eq!(code, Some(0));
    assert!(out.lines().all(|l| l.len() < 300), "{out}");
    assert!(out.contains(&format!("canceled={:?}… (999 bytes)", "y\n".repeat(20))), "{out}");
    assert!(out.contains("for a.canceled (expected"), "the control file is named: {out}");
}

/// Issue 43: a plan with a misspelt key (`instruction`) is taken as system-agent takes it (an
/// empty plan, succeeded), and the agent says so in its log, once, naming the key.
#[test]
fn a_misspelt_plan_key_is_said_once_by_the_agent() {
    let s = Setup::new();
    s.plan("typo", serde_json::json!({"instruction": [sh("one", "true")]}));
    let mut agent = s.start();
    s.wait_pos("typo", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(agent.stop(), 0);
    let log = agent.rest().join("\n");
    let said: Vec<&str> = log.lines().filter(|l| l.contains("unknown plan key(s) \"plan.instruction\"")).collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains(" WARN ") && said[0].contains("(a typo?)"), "{log}");
}

/// Issue 43: `plan status` of a plan the agent cannot run says it is invalid and why, and exits
/// 2 (it said `pending (not started)` and exited 0); a plan with a misspelt key is shown with a
/// warning naming the key, and exits 0.
#[test]
fn plan_status_says_an_invalid_plan_is_invalid_and_warns_of_a_misspelt_key() {
    let s = Setup::new();
    std::fs::write(s.plan_path("broken"), br#"{"instructions": [{"name": "a", "command": 7}]}"#).unwrap();
    s.plan("typo", serde_json::json!({"instruction": [sh("one", "true")]}));
    let status = |name: &str| {
        let out = Command::new(NODEPLAN).args(["plan", "status"]).arg(s.plan_path(name)).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = status("broken");
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(out.contains("state:      invalid (the agent does not run it until it is fixed)"), "{out}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("broken.plan: invalid plan: malformed JSON"), "{err}");
    let (code, out, err) = status("typo");
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("warning:    unknown plan key(s) \"plan.instruction\""), "{out}");
}

/// A fleet's logs stay small: each one-time instruction's start and end at info, periodic
/// instructions only at debug.
#[test]
fn one_time_instructions_are_logged_at_info_and_periodic_ones_at_debug() {
    for level in ["info", "debug"] {
        let s = Setup::new();
        s.plan(
            "fleet",
            serde_json::json!({
                "instructions": [sh("first", "true")],
                "periodicInstructions": [{"name": "tick", "command": "true", "periodSeconds": 3600}]
            }),
        );
        let mut agent = AgentProc::start_with(s.dir.path().join("config.yaml").as_path(), &[("NODEPLAN_LOG", level)]);
        s.wait_pos("fleet", "the periodic instruction's output", |p| {
            p.plan_state == Some(PlanState::Succeeded)
                && nodeplan::plan::decode_periodic_output(&p.periodic_output).is_ok_and(|m| m.contains_key("tick"))
        });
        assert_eq!(agent.stop(), 0);
        let log = agent.rest().join("\n");
        assert!(log.contains("instruction 1/1 first: started"), "{level}: {log}");
        // One short prefix: the plan's id, not the spans' names and fields (issue 24).
        let id = nodeplan::plan::id_of(&std::fs::read(s.plan_path("fleet")).unwrap()).unwrap();
        let line = log.lines().find(|l| l.contains("instruction 1/1 first: started")).unwrap_or_default();
        assert!(line.ends_with(&format!(" INFO [{id}] instruction 1/1 first: started")), "{line}");
        assert!(log.contains("instruction 1/1 first: ok (exit status 0, "), "{level}: {log}");
        let periodic = log.contains("periodic instruction 1/1 tick: started")
            && log.contains("periodic instruction 1/1 tick: ok (exit status 0, ");
        assert_eq!(periodic, level == "debug", "{level}: {log}");
    }
}

/// Instruction output goes to the agent's log at debug only: at the default level (info) a line
/// a successful instruction prints is not in the log, and a failed instruction's last 10 lines
/// (and none before them) follow its failure line. At debug every line is there.
#[test]
fn instruction_output_is_logged_at_debug_and_a_failures_last_lines_at_error() {
    let secret = "password=hunter2-not-for-logs";
    let lines = "for i in $(seq -w 1 15); do echo out-$i-end; done";
    for level in ["info", "debug"] {
        let s = Setup::new();
        s.plan("quiet", serde_json::json!({"instructions": [sh("talk", &format!("echo {secret}"))]}));
        s.plan("loud", serde_json::json!({"instructions": [sh("break", &format!("{lines}; exit 3"))]}));
        let mut agent = AgentProc::start_with(&s.config(), &[("NODEPLAN_LOG", level)]);
        s.wait_pos("quiet", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
        s.wait_pos("loud", "failed", |p| p.plan_state == Some(PlanState::Failed));
        assert_eq!(agent.stop(), 0);
        let log = agent.rest();
        let all = log.join("\n");
        assert!(all.contains("instruction 1/1 talk: ok (exit status 0, "), "{level}: {all}");
        assert_eq!(all.contains(secret), level == "debug", "{level}: {all}");
        let failed = log
            .iter()
            .position(|l| l.contains("instruction 1/1 break: FAILED (exit status 3, "))
            .unwrap_or_else(|| panic!("{level}: {all}"));
        assert!(log[failed].contains("ERROR"), "{level}: {}", log[failed]);
        let tail: Vec<&String> = log[failed + 1..].iter().filter(|l| l.contains("instruction 1/1 break: | ")).collect();
        assert_eq!(tail.len(), 10, "{level}: {all}");
        for (i, l) in tail.iter().enumerate() {
            assert!(l.contains("ERROR") && l.ends_with(&format!("| out-{:02}-end", i + 6)), "{level}: {l}");
        }
        let out_lines = log.iter().filter(|l| l.contains("-end") && l.contains("out-")).count();
        assert_eq!(out_lines, if level == "debug" { 25 } else { 10 }, "{level}: {all}");
    }
}

/// The applied-plan archive keeps every plan: two plans applied within the same second get two
/// entries (they used to share a name, and the second replaced the first), numbered in order.
#[test]
fn plans_applied_within_one_second_are_all_archived() {
    let s = Setup::new();
    for name in ["a", "b", "c"] {
        s.plan(name, serde_json::json!({"instructions": [sh(name, "true")]}));
    }
    let mut agent = s.start();
    for name in ["a", "b", "c"] {
        s.wait_pos(name, "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    }
    assert_eq!(agent.stop(), 0);
    let mut names: Vec<String> = std::fs::read_dir(s.p("applied"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    for (i, n) in names.iter().enumerate() {
        assert!(n.starts_with(&format!("{:06}-", i + 1)) && n.ends_with("Z-applied.plan"), "{names:?}");
    }
}

/// `plan status` into a reader that went away (`| head -1`) ends normally: no panic, exit 0.
#[test]
fn plan_status_into_a_closed_stdout_does_not_panic() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let d = tempfile::tempdir().unwrap();
    let plan = d.path().join("a.plan");
    std::fs::write(&plan, b"{}").unwrap();
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let out = Command::new(NODEPLAN)
        .args(["plan", "status", plan.to_str().unwrap()])
        .stdout(std::process::Stdio::from(write))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Another local user (here: files and directories owned by uid 1000, as that user would leave
/// them), SECURITY.md "Local mode".
const OTHER: u32 = 1000;

fn chmod(path: &str, mode: u32) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
}

/// Issue 23, item 3. A sticky world-writable plan directory (as `/tmp`): root's plan is held, not
/// run, whatever another user puts beside it. Made root's 0755 with the other user's files still
/// there, the plan runs from its first instruction, once: their `.canceled`, `.reset`, forged
/// `.pos` checkpoint and `.plan.skip` do not count (the first three are each said once).
#[test]
fn a_writable_plan_directory_holds_its_plans_and_only_roots_files_beside_a_plan_count() {
    let s = Setup::new();
    let (log, plans) = (s.p("log"), s.p("plans"));
    let raw = s.plan(
        "p",
        serde_json::json!({"instructions": [
            sh("security-check", &format!("echo check >> {log}")),
            sh("two", &format!("echo two >> {log}")),
        ]}),
    );
    chmod(&plans, 0o1777);
    let checksum = nodeplan::plan::checksum(&raw);
    let forged = nodeplan::local::pos::Pos {
        plan_state: Some(PlanState::Paused),
        plan_checksum: checksum.clone(),
        checkpoint: Some(nodeplan::plan::Checkpoint {
            checksum,
            completed_instructions: 1,
            total_instructions: 2,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        }),
        ..Default::default()
    };
    let theirs = [
        ("p.canceled", b"true\n".to_vec()),
        ("p.reset", Vec::new()),
        ("p.plan.skip", Vec::new()),
        ("p.pos", serde_json::to_vec(&forged).unwrap()),
    ];
    for (name, content) in &theirs {
        let path = format!("{plans}/{name}");
        std::fs::write(&path, content).unwrap();
        std::os::unix::fs::chown(&path, Some(OTHER), Some(OTHER)).unwrap();
    }
    let mut agent = s.start();
    agent.wait_log(&format!("{plans} is writable by group or others (mode 1777): not walked or watched"));
    assert!(!Path::new(&log).exists(), "held: nothing ran");
    chmod(&plans, 0o755);
    for name in ["p.canceled", "p.reset", "p.pos"] {
        agent.wait_log(&format!("{plans}/{name} is owned by uid {OTHER}: ignored"));
    }
    s.wait_pos("p", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded) && p.checkpoint.is_none());
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "check\ntwo\n", "from the first instruction, once");
    assert!(Path::new(&format!("{plans}/p.reset")).exists(), "their reset was not acted on");
    assert_eq!(agent.stop(), 0);
}

/// The inotify watches the agent `pid` holds (one `inotify wd:` line per watch in fdinfo).
fn inotify_watches(pid: u32) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo")).unwrap().flatten() {
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        n += info.lines().filter(|l| l.starts_with("inotify wd:")).count();
    }
    n
}

/// Issue 23, item 4. A directory another user owns in the plan tree: their `a.plan.skip` does not
/// skip root's `a.plan`, and neither it nor any of the directories below it is walked or watched
/// (one line says which); root's own subdirectory is.
#[test]
fn another_users_directories_are_neither_walked_nor_watched() {
    let s = Setup::new();
    let plans = s.p("plans");
    let (ran_a, ran_b) = (s.p("ran-a"), s.p("ran-b"));
    s.plan("a", serde_json::json!({"instructions": [sh("a", &format!("touch {ran_a}"))]}));
    std::fs::create_dir(format!("{plans}/mine")).unwrap();
    let b = serde_json::json!({"instructions": [sh("b", &format!("touch {ran_b}"))]});
    std::fs::write(format!("{plans}/mine/b.plan"), serde_json::to_vec(&b).unwrap()).unwrap();
    let theirs = format!("{plans}/theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(format!("{theirs}/a.plan.skip"), b"").unwrap();
    for i in 0..40 {
        std::fs::create_dir_all(format!("{theirs}/d{i}/e")).unwrap();
    }
    for e in walkdir(&theirs) {
        std::os::unix::fs::lchown(&e, Some(OTHER), Some(OTHER)).unwrap();
    }
    let mut agent = s.start();
    agent.wait_log(&format!("{theirs} is owned by uid {OTHER}: not walked or watched"));
    agent.wait_log(&format!("watching {plans} for changes"));
    for name in ["a", "mine/b"] {
        s.wait_pos(name, "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    }
    assert!(Path::new(&ran_a).exists() && Path::new(&ran_b).exists());
    assert_eq!(inotify_watches(agent.child.id()), 2, "plans and plans/mine only");
    assert_eq!(agent.stop(), 0);
}

/// Every path below `dir`, `dir` included.
fn walkdir(dir: &str) -> Vec<std::path::PathBuf> {
    let mut out = vec![std::path::PathBuf::from(dir)];
    let mut i = 0;
    while i < out.len() {
        if out[i].is_dir()
            && let Ok(rd) = std::fs::read_dir(&out[i])
        {
            out.extend(rd.flatten().map(|e| e.path()));
        }
        i += 1;
    }
    out
}

/// Issue 23, item 6. A file name with a line break forges no log line: the name is escaped.
#[test]
fn a_file_name_with_a_newline_forges_no_log_line() {
    let s = Setup::new();
    let name = "x\n1999-01-01T00:00:00.000000Z ERROR forged";
    s.plan(name, serde_json::json!({"instructions": [sh("a", "true")]}));
    chmod(s.plan_path(name).to_str().unwrap(), 0o666);
    let mut agent = s.start();
    let line = agent.wait_log("ERROR forged");
    assert!(line.contains("plans/x\\n1999-01-01T00:00:00.000000Z ERROR forged.plan is writable"), "{line}");
    assert_eq!(agent.stop(), 0);
    agent.rest();
    assert!(!agent.seen.iter().any(|l| l.starts_with("1999-01-01")), "a forged line:\n{}", agent.seen.join("\n"));
}

/// `nodeplan status` (issue 24): this node's agent at a glance, from the config it runs with. While
/// an instruction runs it names the plan and the instruction; once the plan failed, the last result
/// names the failing instruction and the retry shows when it runs again; `-o json` is the record.
/// No agent running: one line, exit 1.
#[test]
fn nodeplan_status_shows_the_running_instruction_the_last_result_and_the_retry() {
    let s = Setup::new();
    let config = s.config();
    // A retry an hour away: the failed state stays while the test looks.
    let text = std::fs::read_to_string(&config).unwrap();
    let mut lines: Vec<&str> = text.lines().filter(|l| !l.starts_with("localRetrySeconds:")).collect();
    lines.push("localRetrySeconds: 3600");
    std::fs::write(&config, lines.join("\n") + "\n").unwrap();
    let status = |extra: &[&str]| {
        let out = Command::new(NODEPLAN).args(["status", "--config"]).arg(&config).args(extra).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = status(&[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nodeplan: no agent runs with"), "{err}");
    let (ready, go) = (s.fifo("ready"), s.fifo("go"));
    s.plan(
        "a",
        serde_json::json!({"instructions": [
            sh("wait", &format!("echo > {ready}; read x < {go}")),
            sh("boom", "exit 3")
        ]}),
    );
    let mut agent = s.start();
    read_fifo(&ready);
    let plan = s.plan_path("a").display().to_string();
    let until = |what: &str, pred: &dyn Fn(&str) -> bool| agent_status_until(&config, what, pred);
    let out = until("the running instruction", &|o| o.contains("running:    instruction 1/2 wait"));
    assert!(out.contains(&format!("agent:      running, pid {}", agent.child.id())), "{out}");
    assert!(out.contains(&format!("applying:   {plan}, since ")), "{out}");
    assert!(out.contains(&format!("source:     local: directory {}", s.p("plans"))), "{out}");
    // `plan status` of the file says the same of it (the agent found by its config, as here
    // through NODEPLAN_CONFIG): the running instruction, later the retry.
    let plan_status = |file: &str| {
        let out =
            Command::new(NODEPLAN).args(["plan", "status", file]).env("NODEPLAN_CONFIG", &config).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = plan_status(&plan);
    assert!(text.contains("\nrunning:    instruction 1/2 wait, since "), "{text}");
    // A plan file no agent watches says so instead of a bare "pending".
    let elsewhere = s.p("elsewhere.plan");
    std::fs::write(&elsewhere, b"{}").unwrap();
    let text = plan_status(&elsewhere);
    assert!(text.contains(&format!("state:      pending (not started: the agent watches {}", s.p("plans"))), "{text}");
    std::fs::write(&go, b"go\n").unwrap();
    let out = until("the failure", &|o| o.contains("applying:   nothing") && o.contains("retry:"));
    assert!(out.contains(&format!("last:       {plan}: failed: instruction 2/2 boom: exit status 3, ")), "{out}");
    assert!(out.contains(&format!("retry:      {plan} ")) && out.contains(" (in "), "{out}");
    let text = plan_status(&plan);
    assert!(text.contains("\nretry:      ") && text.contains(" (in "), "{text}");
    assert!(!text.contains("running:"), "{text}");
    let (_, json, _) = status(&["-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["pid"], agent.child.id());
    assert_eq!(v["last"]["result"], "failed: instruction 2/2 boom: exit status 3");
    assert_eq!(agent.stop(), 0);
    let (code, _, err) = status(&[]);
    assert_eq!(code, Some(1), "a stopped agent leaves no record: {err}");
}

/// Issue 24: a hand-run `nodeplan apply` takes the agent's work directory (its config's
/// `workDirectory`, the default of `--work-dir`), so the one-apply-at-a-time lock keeps it off the
/// agent's plan: it waits, saying who holds the directory, and runs once the agent's plan is done.
#[test]
fn a_hand_run_apply_waits_for_the_agents_plan() {
    let s = Setup::new();
    let (ready, go, log) = (s.fifo("ready"), s.fifo("go"), s.p("log"));
    s.plan(
        "agents",
        serde_json::json!({"instructions": [sh("agents", &format!("echo agent-start >> {log}; echo > {ready}; cat {go} > /dev/null; echo agent-end >> {log}"))]}),
    );
    let mut agent = s.start();
    read_fifo(&ready);
    let by_hand = s.p("by-hand.plan");
    let plan = serde_json::json!({"instructions": [sh("by-hand", &format!("echo by-hand >> {log}"))]});
    std::fs::write(&by_hand, serde_json::to_vec(&plan).unwrap()).unwrap();
    let config = s.config().display().to_string();
    let mut apply = Command::new(NODEPLAN)
        .args(["apply", &by_hand, "--config", &config])
        .env("NODEPLAN_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(apply.stderr.take().unwrap());
    let waiting = loop {
        let l = lines.recv_timeout(GUARD).expect("the apply never said it waits for the work directory");
        if l.contains("waiting for the work directory's lock") {
            break l;
        }
    };
    assert!(waiting.contains(&format!("(pid {})", agent.child.id())), "held by the agent: {waiting}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "agent-start\n", "the apply did not wait");
    release_fifo(&go);
    assert_eq!(apply.wait().unwrap().code(), Some(0));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "agent-start\nagent-end\nby-hand\n");
    assert_eq!(agent.stop(), 0);
}

/// A `.pos` nobody can read (not JSON) is moved aside as `.pos.invalid`, kept for a person to
/// look at, and the plan starts over: the move is written when the loop asks the source to show
/// what its look found (a look only reads).
#[test]
fn an_unreadable_pos_is_moved_aside_and_the_plan_starts_over() {
    let s = Setup::new();
    let ran = s.p("ran");
    s.plan("a", serde_json::json!({"instructions": [sh("a", &format!("touch {ran}"))]}));
    let pos = s.dir.path().join("plans/a.pos");
    std::fs::write(&pos, b"{ not json").unwrap();
    chmod(pos.to_str().unwrap(), 0o600);
    let mut agent = s.start();
    // The line is logged once the move is done.
    agent.wait_log("a.pos.invalid and starting over");
    assert!(s.dir.path().join("plans/a.pos.invalid").exists(), "moved aside before it says so");
    s.wait_pos("a", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(Path::new(&ran).exists());
    assert_eq!(std::fs::read(s.dir.path().join("plans/a.pos.invalid")).unwrap(), b"{ not json");
    assert_eq!(agent.stop(), 0);
}

/// Issue 41, items 1 and 2: no part of an instruction's env value of 6 characters or more
/// reaches the agent's log (a failure's last lines at error, a periodic failure's at info, each
/// output line at debug), `plan status`, `plan logs` or the `.pos` file, however it was printed: a
/// short value inside a longer one (`5432` in the password), a long token after 500 characters of
/// prefix (masked before the line is cut), and each line of a value of several lines (a key).
#[test]
fn no_part_of_an_env_value_reaches_the_log_the_status_or_the_pos_file() {
    let s = Setup::new();
    let token: String = "QXZJKV7931".chars().cycle().take(600).collect();
    let key = "-----BEGIN TEST KEY-----\nQXZ9JKV7QXZ9JKV7QXZ9\nJKV7931QXZJKV7931QX\n-----END TEST KEY-----";
    let env =
        serde_json::json!(["PGPORT=5432", "DB_PASSWORD=Zk5432Lm9Qw", format!("TOKEN={token}"), format!("KEY={key}")]);
    let mut boom = sh(
        "boom",
        "echo \"login failed: password $DB_PASSWORD on port $PGPORT\"; \
         printf 'x%.0s' $(seq 500); echo \"$TOKEN\"; echo \"$KEY\"; exit 3",
    );
    boom["env"] = env.clone();
    s.plan("f", serde_json::json!({"instructions": [boom]}));
    let mut watch = sh("watch", "echo \"periodic $DB_PASSWORD\"; echo \"$KEY\"; exit 1");
    watch["env"] = env;
    watch["periodSeconds"] = 3600.into();
    s.plan("p", serde_json::json!({"periodicInstructions": [watch]}));
    let mut agent = AgentProc::start_with(&s.config(), &[OUTPUT_LOGGED]);
    s.wait_pos("f", "failed", |p| p.plan_state == Some(PlanState::Failed));
    agent.wait_log("periodic instruction 1/1 watch: FAILED");
    assert_eq!(agent.stop(), 0);
    agent.rest();
    let mut shown = vec![("the agent's log".to_string(), agent.seen.join("\n"))];
    for name in ["f", "p"] {
        let path = s.plan_path(name).display().to_string();
        for cmd in ["status", "logs"] {
            let out = Command::new(NODEPLAN).args(["plan", cmd, &path]).output().unwrap();
            shown.push((format!("plan {cmd} {name}"), String::from_utf8_lossy(&out.stdout).into_owned()));
        }
        let pos = std::fs::read_to_string(s.dir.path().join("plans").join(format!("{name}.pos"))).unwrap();
        shown.push((format!("{name}.pos"), pos));
    }
    assert!(shown[1].1.contains("***"), "the failure's lines are shown, masked: {}", shown[1].1);
    for secret in ["Zk5432Lm9Qw", token.as_str(), key] {
        let chars: Vec<char> = secret.chars().collect();
        for w in chars.windows(6) {
            let part: String = w.iter().collect();
            for (place, text) in &shown {
                assert!(!text.contains(&part), "{part:?} of an env value is in {place}:\n{text}");
            }
        }
    }
}

/// Issue 41, item 6: a plan whose `httpGet` probe reads its `caCert` from a path that never
/// answers (a FIFO nobody writes, as a hung mount a user controls) fails that probe and holds
/// nothing else: another plan applies meanwhile, and the agent stops on SIGTERM. Before, the file
/// was read on a runtime thread and the agent froze.
#[test]
fn a_probe_whose_ca_cert_never_opens_holds_nothing_else() {
    let s = Setup::new();
    let fifo = s.p("ca.pem");
    mkfifo(&fifo);
    let probe = serde_json::json!({"https://hung": {
        "httpGet": {"url": "https://127.0.0.1:9/", "caCert": fifo},
        "timeoutSeconds": 1
    }});
    s.plan("probed", serde_json::json!({"instructions": [sh("one", "true")], "probes": probe}));
    let mut agent = s.start();
    s.wait_pos("probed", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    let ran = s.p("ran");
    s.plan("next", serde_json::json!({"instructions": [sh("next", &format!("touch {ran}"))]}));
    s.wait_pos("next", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(Path::new(&ran).exists());
    let probed = s.pos("probed");
    let status = &probed.probe_status["https://hung"];
    assert!(!status.healthy && status.failure_count >= 1, "{status:?}");
    let started = std::time::Instant::now();
    assert_eq!(agent.stop(), 0);
    assert!(started.elapsed() < Duration::from_secs(10), "SIGTERM took {:?}", started.elapsed());
}

/// Issue 41, item 3 (R32): two agents on one plan directory (a unit started twice, a container
/// beside the host's agent), each with a work directory of its own. The second waits for the
/// directory, saying so in its log and in `nodeplan status`, and runs nothing; each plan runs
/// once. When the first stops, the second takes the directory over and applies the next plan.
#[test]
fn a_second_agent_on_one_plan_directory_waits_and_each_plan_runs_once() {
    let s = Setup::new();
    let other = tempfile::tempdir().unwrap();
    let o = other.path().display().to_string();
    let plans = s.dir.path().join("plans");
    let config = other.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "localEnabled: true\nlocalPlanDirectory: {}\nworkDirectory: {o}/work\nappliedPlanDirectory: {o}/applied\n\
             interlockDirectory: {o}/interlock\npidDirectory: {o}/pids\nstopTimeout: 1s\nkillTimeout: 5s\n\
             rescanSeconds: 1\nprobePeriodSeconds: 1\nlocalRetrySeconds: 1\n",
            plans.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let runs = s.p("runs");
    let mut first = s.start();
    s.plan("a", serde_json::json!({"instructions": [sh("one", &format!("echo a >> {runs}"))]}));
    s.wait_pos("a", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    let mut second = AgentProc::start(&config);
    second.wait_log("waiting for the plan directory");
    // The status board is written a moment after the change.
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        let out = Command::new(NODEPLAN).args(["status", "--config", config.to_str().unwrap()]).output().unwrap();
        let status = String::from_utf8_lossy(&out.stdout).into_owned();
        if status.contains("another agent holds the plan directory") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status}{}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(50));
    }
    s.plan("b", serde_json::json!({"instructions": [sh("two", &format!("echo b >> {runs}"))]}));
    s.wait_pos("b", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(first.stop(), 0);
    second.wait_log("holding the plan directory");
    s.plan("c", serde_json::json!({"instructions": [sh("three", &format!("echo c >> {runs}"))]}));
    s.wait_pos("c", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert_eq!(second.stop(), 0);
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "a\nb\nc\n", "each plan ran once");
}
