//! `nodeplan apply` end to end: the real binary on temp directories.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;

struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        Env { dir: tempfile::tempdir().unwrap() }
    }
    fn p(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }
    fn plan(&self, json: serde_json::Value) -> String {
        let path = self.p("test.plan");
        std::fs::write(&path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
        path
    }
    fn cmd(&self, plan: &str, extra: &[&str]) -> Command {
        let mut c = Command::new(NODEPLAN);
        c.args(["apply", plan, "--work-dir", &self.p("work"), "--pid-dir", &self.p("pids")]).args(extra);
        c.env("NODEPLAN_LOG", "warn");
        c
    }
    fn fifo(&self, name: &str) -> String {
        let p = self.p(name);
        let c = std::ffi::CString::new(p.clone()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        p
    }
}

fn sh(name: &str, script: &str) -> serde_json::Value {
    serde_json::json!({"name": name, "command": "sh", "args": ["-c", script]})
}

#[test]
fn applies_a_plan_and_exits_zero() {
    let e = Env::new();
    let target = e.p("out/greeting");
    let plan = e.plan(serde_json::json!({
        "files": [{"path": target, "content": "aGk=", "permissions": "0640"}],
        "instructions": [sh("check", &format!("test \"$(cat {target})\" = hi"))]
    }));
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("succeeded: 1/1 instructions"), "{err}");
    assert!(Path::new(&target).exists());
}

#[test]
fn a_failing_instruction_exits_one_and_prints_its_outcome() {
    let e = Env::new();
    let plan = e.plan(serde_json::json!({"instructions": [sh("a", "true"), sh("b", "echo boom >&2; exit 3"), sh("c", &format!("touch {}", e.p("c")))]}));
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("instruction 1 (b) failed: exit status 3"), "{err}");
    assert!(err.contains("  | boom"), "the failed instruction's output is shown: {err}");
    assert!(err.contains("failed after 1/3 instructions"), "{err}");
    assert!(!Path::new(&e.p("c")).exists());
}

#[test]
fn bad_plans_give_one_clear_line_and_change_nothing() {
    let e = Env::new();
    let early = e.p("early-file");
    let good_file = serde_json::json!({"path": early, "content": "eA=="});
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (serde_json::json!({"files": [good_file, {"path": "relative/x"}]}), "files[1].path"),
        (serde_json::json!({"files": [good_file, {"path": "/x", "content": "%%%"}]}), "files[1].content: bad base64"),
        (serde_json::json!({"files": [good_file, {"path": "/x", "permissions": "rw-r--r--"}]}), "files[1].permissions"),
        (serde_json::json!({"files": [good_file, {"path": ""}]}), "files[1].path: is empty"),
        (serde_json::json!({"files": [good_file], "instructions": [{"name": "x"}]}), "instructions[0].command"),
    ];
    for (plan, want) in cases {
        let path = e.plan(plan);
        let out = e.cmd(&path, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.contains(want), "{want}: {err}");
        assert!(!Path::new(&early).exists(), "nothing is touched before the whole plan is valid");
    }
    std::fs::write(e.p("junk.plan"), b"{\"instructions\": [").unwrap();
    let out = e.cmd(&e.p("junk.plan"), &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("malformed JSON"));
    let out = e.cmd(&e.p("missing.plan"), &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

/// Spawn nodeplan with stderr forwarded line by line to a channel.
fn spawn_with_stderr(mut c: Command) -> (std::process::Child, mpsc::Receiver<String>) {
    let mut child = c.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    (child, rx)
}

fn wait_stderr(rx: &mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) {
    loop {
        let l = rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("no stderr line containing {needle:?}; saw {seen:?}"));
        seen.push(l.clone());
        if l.contains(needle) {
            return;
        }
    }
}

fn read_fifo(path: &str) -> String {
    std::fs::read_to_string(path).unwrap()
}

fn sigint(child: &std::process::Child) {
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
}

#[test]
fn first_ctrl_c_pauses_at_the_boundary_and_the_printed_command_resumes() {
    let e = Env::new();
    let (ready, go, marker) = (e.fifo("ready"), e.fifo("go"), e.p("marker"));
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("one", &format!("echo one >> {marker}")),
        sh("two", &format!("echo two >> {marker}; echo > {ready}; cat {go} >/dev/null")),
        sh("three", &format!("echo three >> {marker}")),
    ]}));
    let (mut child, rx) = spawn_with_stderr(e.cmd(&plan, &[]));
    read_fifo(&ready);
    sigint(&child);
    let mut seen = Vec::new();
    wait_stderr(&rx, "pausing after the running instruction", &mut seen);
    std::fs::write(&go, b"").unwrap();
    wait_stderr(&rx, "resume with:", &mut seen);
    wait_stderr(&rx, "--resume-from 2", &mut seen);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3), "{seen:?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\n");
    let resume = seen.last().unwrap().trim().to_string();
    let args: Vec<&str> = resume.split_whitespace().collect();
    assert_eq!(&args[..4], ["nodeplan", "apply", plan.as_str(), "--resume-from"]);
    let out = Command::new(NODEPLAN).args(&args[1..]).env("NODEPLAN_LOG", "warn").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\nthree\n", "finished instructions are not re-run");
}

#[test]
fn second_ctrl_c_cancels_through_the_stop_ladder() {
    let e = Env::new();
    let ready = e.fifo("ready");
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("long", &format!("echo $$ > {ready}; exec sleep 300")),
        sh("after", &format!("touch {}", e.p("after"))),
    ]}));
    let (mut child, rx) = spawn_with_stderr(e.cmd(&plan, &[]));
    let pid: i32 = read_fifo(&ready).trim().parse().unwrap();
    assert!(alive(pid));
    let mut seen = Vec::new();
    sigint(&child);
    wait_stderr(&rx, "pausing", &mut seen);
    sigint(&child);
    wait_stderr(&rx, "canceled after 0/2 instructions", &mut seen);
    let status = child.wait().unwrap();
    let still = alive(pid);
    kill_all(&[pid]);
    assert_eq!(status.code(), Some(4), "{seen:?}");
    assert!(!still, "the running instruction was stopped");
    assert!(!Path::new(&e.p("after")).exists());
    assert_eq!(std::fs::read_dir(e.p("pids")).map(|d| d.count()).unwrap_or(0), 0, "PID records removed");
}

#[test]
fn help_lists_exit_codes_defaults_and_the_duration_format() {
    let out = Command::new(NODEPLAN).args(["apply", "--help"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--resume-from"), "{help}");
    for code in ["0  the plan succeeded", "1  the plan failed", "2  bad input", "3  paused", "4  canceled"] {
        assert!(help.contains(code), "exit code {code:?} missing: {help}");
    }
    for (option, default) in [
        ("--work-dir", "[default: /var/lib/nodeplan/work]"),
        ("--stop-timeout", "[default: 10s]"),
        ("--output-cap", "[default: 65536]"),
        ("--log-level", "else info]"),
        ("--preserve-work-dir", "[default: off]"),
    ] {
        let line = help.lines().find(|l| l.trim_start().starts_with(option)).unwrap_or_else(|| panic!("{option}"));
        assert!(line.contains(default), "{option} does not show its default {default:?}: {line}");
    }
    for option in ["--stop-timeout", "--kill-timeout"] {
        let line = help.lines().find(|l| l.trim_start().starts_with(option)).unwrap();
        assert!(line.contains("500ms, 10s, 5m, 1h or seconds"), "{line}");
    }
}

/// Every bad argument is one line naming it and exit 2, before anything runs: an unknown log
/// level (it used to silence every log line), relative directories, an output cap below the
/// config's minimum, a cgroup directory that does not exist (it used to be a warning).
#[test]
fn bad_arguments_exit_two_with_one_line_and_run_nothing() {
    let e = Env::new();
    let ran = e.p("ran");
    let plan = e.plan(serde_json::json!({"instructions": [sh("touch", &format!("touch {ran}"))]}));
    let missing = e.p("no-such-cgroup");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--log-level", "bogus"], "trace, debug, info, warn, error"),
        (vec!["--work-dir", "work"], "relative"),
        (vec!["--pid-dir", "pids"], "relative"),
        (vec!["--images-dir", "images"], "relative"),
        (vec!["--registries", "r.yaml"], "relative"),
        (vec!["--output-cap", "100"], "at least 1024"),
        (vec!["--cgroup", &missing], "no such directory"),
        (vec!["--stop-timeout", "soon"], "--stop-timeout"),
        (vec!["--kill-timeout", "0"], "must be positive"),
    ];
    for (args, want) in cases {
        let mut c = Command::new(NODEPLAN);
        c.args(["apply", &plan]);
        for (option, dir) in [("--work-dir", "work"), ("--pid-dir", "pids")] {
            if !args.contains(&option) {
                c.args([option, &e.p(dir)]);
            }
        }
        c.args(&args);
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains(want), "{args:?}: {want:?} not in {err}");
        assert!(!Path::new(&ran).exists(), "{args:?}: the plan ran");
    }
    for args in [&["plan", "pause"][..], &["plan", "push", "x.plan"], &["plan", "pause", "--secret", "nons"]] {
        let out = Command::new(NODEPLAN).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
    }
}

/// `NODEPLAN_LOG`/`CATTLE_LOGLEVEL` that are not a level: one warning and logging at info (a node
/// system-agent ran with a bad `CATTLE_LOGLEVEL` keeps working); it used to silence every line.
#[test]
fn a_bad_log_level_in_the_environment_warns_and_logs_at_info() {
    for var in ["NODEPLAN_LOG", "CATTLE_LOGLEVEL"] {
        let e = Env::new();
        let plan = e.plan(serde_json::json!({"instructions": [sh("say", "echo said-it")]}));
        let mut c = e.cmd(&plan, &[]);
        c.env_remove("NODEPLAN_LOG").env(var, "verbose");
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        let warned = err.lines().filter(|l| l.contains(&format!("{var}: \"verbose\" is not a log level"))).count();
        assert_eq!(warned, 1, "{var}: {err}");
        assert!(err.contains("said-it"), "{var}: info lines are logged: {err}");
    }
}

/// A PID directory others can write to may hold forged records (or hide a real leftover): apply
/// refuses it with one line, runs nothing and exits 1.
#[test]
fn an_untrusted_pid_directory_refuses_the_apply() {
    use std::os::unix::fs::PermissionsExt;
    let e = Env::new();
    let ran = e.p("ran");
    let plan = e.plan(serde_json::json!({"instructions": [sh("touch", &format!("touch {ran}"))]}));
    std::fs::create_dir(e.p("pids")).unwrap();
    std::fs::set_permissions(e.p("pids"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("nodeplan: ")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("writable by group or others (mode 0777)"), "{err}");
    assert!(!Path::new(&ran).exists(), "the plan ran");
}

/// The cgroup v1 host case: with cgroup2 hidden in a private mount namespace (only the v1
/// hierarchies left, as on RHEL 8), `--cgroup auto` falls back to the v1 freezer hierarchy, and a
/// cancel stops an escapee that left the session and dropped its whole environment (process group
/// and run marker cannot find it; it used to survive).
#[test]
fn on_a_host_without_cgroup2_a_cancel_kills_an_escapee_through_the_v1_freezer() {
    use nodeplan::process::cgroup::{find_cgroup2_mount, find_v1_mount};
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let unshare = Command::new("unshare").arg("--help").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !require(unshare && find_v1_mount(&mi, "freezer").is_some(), "unshare and a cgroup v1 freezer hierarchy") {
        return;
    }
    let e = Env::new();
    let fifo = e.fifo("escapee");
    let script = format!(
        r#"setsid env -i /bin/sh -c 'trap "" TERM; echo $$ > {fifo}; exec sleep 1000' </dev/null >/dev/null 2>&1 & exec sleep 1000"#
    );
    let plan = e.plan(serde_json::json!({"instructions": [sh("escape", &script)]}));
    // The private namespace only hides the cgroup2 mount from nodeplan; the host keeps it.
    let hide = match find_cgroup2_mount(&mi) {
        Some(m) => format!("umount -l '{}' && ", m.display()),
        None => String::new(),
    };
    let mut c = Command::new("unshare");
    c.args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!("{hide}exec \"$@\""))
        .args(["sh", NODEPLAN, "apply", &plan, "--work-dir", &e.p("work"), "--pid-dir", &e.p("pids")])
        .args(["--cgroup", "auto", "--stop-timeout", "300ms"])
        .env("NODEPLAN_LOG", "info");
    let (mut child, rx) = spawn_with_stderr(c);
    let escapee: i32 = read_fifo(&fifo).trim().parse().unwrap();
    let guard = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(escapee).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut seen = Vec::new();
    wait_stderr(&rx, "canceled after 0/1 instructions", &mut seen);
    let status = child.wait().unwrap();
    let survived = alive(escapee);
    let _ = rustix::process::pidfd_send_signal(&guard, rustix::process::Signal::KILL);
    assert_eq!(status.code(), Some(4), "{seen:?}");
    assert!(seen.iter().any(|l| l.contains("using the cgroup v1 freezer hierarchy")), "{seen:?}");
    assert!(!survived, "the escapee survived the cancel; nodeplan said: {seen:?}");
}
