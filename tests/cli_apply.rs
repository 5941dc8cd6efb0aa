//! `nodeplan apply` end to end: the real binary on temp directories.

mod common;

use common::*;
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

/// Disk stays bounded: a successful apply removes its execution directory at once (what it
/// staged goes with it), a failed one keeps it to look at until the next apply, and
/// `--preserve-work-dir` keeps every one. The removal is handed to the disk lane (R31) and the
/// command waits for it before it exits: what it staged here is many files, so that removal
/// takes longer than the runtime's own shutdown would wait for it.
#[test]
fn a_successful_apply_leaves_no_execution_directory_and_a_failed_one_does() {
    let e = Env::new();
    let entries = |e: &Env| std::fs::read_dir(e.p("work")).map(|d| d.count()).unwrap_or(0);
    let ok = e.plan(serde_json::json!({"instructions": [sh(
        "a",
        "echo staged > staged-file && mkdir many && cd many && seq 20000 | xargs touch"
    )]}));
    assert_eq!(e.cmd(&ok, &[]).status().unwrap().code(), Some(0));
    assert_eq!(entries(&e), 0, "the successful apply's directory is gone");
    let bad = e.p("bad.plan");
    std::fs::write(&bad, serde_json::json!({"instructions": [sh("a", "echo kept > kept-file; exit 1")]}).to_string())
        .unwrap();
    assert_eq!(e.cmd(&bad, &[]).status().unwrap().code(), Some(1));
    assert_eq!(entries(&e), 1, "the failed apply's directory is kept");
    assert_eq!(e.cmd(&ok, &["--preserve-work-dir"]).status().unwrap().code(), Some(0));
    assert_eq!(entries(&e), 2, "preserved: both kept");
}

#[test]
fn a_failing_instruction_exits_one_and_prints_its_outcome() {
    let e = Env::new();
    let plan = e.plan(serde_json::json!({"instructions": [sh("a", "true"), sh("b", "echo boom >&2; exit 3"), sh("c", &format!("touch {}", e.p("c")))]}));
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("instruction 2/3 b: FAILED (exit status 3, "), "{err}");
    assert!(err.contains("  | boom"), "the failed instruction's output is shown: {err}");
    assert!(err.contains("failed after 1/3 instructions"), "{err}");
    assert!(!Path::new(&e.p("c")).exists());
}

#[test]
fn bad_plans_give_one_clear_line_and_change_nothing() {
    let e = Env::new();
    let early = e.p("early-file");
    let good_file = serde_json::json!({"path": early, "content": "eA=="});
    let kept_dir = e.p("kept");
    let kept_dir_dot = format!("{kept_dir}/./");
    std::fs::create_dir(&kept_dir).unwrap();
    std::fs::write(e.p("kept/keep"), b"k").unwrap();
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (serde_json::json!({"files": [good_file, {"path": "relative/x"}]}), "files[1].path"),
        (serde_json::json!({"files": [good_file, {"path": "/x", "content": "%%%"}]}), "files[1].content: bad base64"),
        (serde_json::json!({"files": [good_file, {"path": "/x", "permissions": "rw-r--r--"}]}), "files[1].permissions"),
        (serde_json::json!({"files": [good_file, {"path": ""}]}), "files[1].path: is empty"),
        (serde_json::json!({"files": [good_file], "instructions": [{"name": "x"}]}), "instructions[0].command"),
        // Paths: every one of these used to write the files before it, or worse.
        (
            serde_json::json!({"files": [good_file, {"path": kept_dir_dot, "directory": true, "action": "delete"}]}),
            "files[1].path",
        ),
        (
            serde_json::json!({"files": [good_file, {"path": "/", "content": "eA=="}]}),
            "files[1].path: \"/\" is the root directory",
        ),
        (
            serde_json::json!({"files": [good_file, {"path": format!("{kept_dir}//keep"), "action": "delete"}]}),
            "contains \"//\"",
        ),
        (
            serde_json::json!({"files": [good_file, {"path": format!("{kept_dir}/keep/"), "action": "delete"}]}),
            "ends with \"/\"",
        ),
        (
            serde_json::json!({"files": [good_file, {"path": kept_dir, "directory": true, "action": "delete"}, {"path": format!("{kept_dir}/"), "directory": true}]}),
            "files[2].path",
        ),
        (serde_json::json!({"files": [good_file, good_file]}), "files[1].path: "),
        // Other fields.
        (
            serde_json::json!({"files": [good_file], "periodicInstructions": [{"name": "p", "command": "true", "periodSeconds": -1}]}),
            "periodicInstructions[0].periodSeconds: -1 is negative",
        ),
        (
            serde_json::json!({"files": [good_file], "instructions": [{"command": "true"}]}),
            "instructions[0].name: is empty",
        ),
        (serde_json::json!({"files": [good_file, {"path": "/x", "permissions": "77777"}]}), "files[1].permissions"),
        (
            serde_json::json!({"files": [good_file], "probes": {"web": {"httpGet": {"url": "http//nohost"}}}}),
            "probes[\"web\"].httpGet.url",
        ),
        (serde_json::json!([{"files": [good_file]}]), "the plan must be a JSON object"),
    ];
    for (plan, want) in cases {
        let path = e.plan(plan);
        let out = e.cmd(&path, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.contains(want), "{want}: {err}");
        assert!(!Path::new(&early).exists(), "nothing is touched before the whole plan is valid");
        assert!(Path::new(&e.p("kept/keep")).exists(), "{want}: nothing is deleted before the whole plan is valid");
    }
    // A byte order mark is refused by name (Go's encoding/json refuses it too).
    let bom = [&b"\xef\xbb\xbf"[..], &serde_json::to_vec(&serde_json::json!({"files": [good_file]})).unwrap()].concat();
    std::fs::write(e.p("bom.plan"), bom).unwrap();
    let out = e.cmd(&e.p("bom.plan"), &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!((out.status.code(), err.trim_end().lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("byte order mark"), "{err}");
    assert!(!Path::new(&early).exists());
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
    let rx = lines_of(child.stderr.take().unwrap());
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

/// Start `cmd`, wait until its instruction says it runs (`ready`), press Ctrl-C, wait for the
/// pause notice, then let the instruction finish (`go`).
fn ctrl_c_while_running(
    cmd: Command,
    ready: &str,
    go: &str,
) -> (std::process::Child, mpsc::Receiver<String>, Vec<String>) {
    let (child, rx) = spawn_with_stderr(cmd);
    read_fifo(ready);
    sigint(&child);
    let mut seen = Vec::new();
    wait_stderr(&rx, "pausing after the running instruction", &mut seen);
    std::fs::write(go, b"").unwrap();
    (child, rx, seen)
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
    let (mut child, rx, mut seen) = ctrl_c_while_running(e.cmd(&plan, &[]), &ready, &go);
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

/// A pause that arrives during the last instruction leaves nothing to pause: the plan succeeds
/// (exit 0), and the pause only holds the periodic instructions.
#[test]
fn ctrl_c_during_the_last_instruction_ends_as_succeeded() {
    let e = Env::new();
    let (ready, go) = (e.fifo("ready"), e.fifo("go"));
    let periodic = e.p("periodic");
    let plan = e.plan(serde_json::json!({
        "instructions": [sh("one", "true"), sh("last", &format!("echo > {ready}; cat {go} >/dev/null"))],
        "periodicInstructions": [{"name": "p", "command": "touch", "args": [periodic], "periodSeconds": 60}]
    }));
    let (mut child, rx, mut seen) = ctrl_c_while_running(e.cmd(&plan, &[]), &ready, &go);
    wait_stderr(&rx, "succeeded: 2/2 instructions", &mut seen);
    assert_eq!(child.wait().unwrap().code(), Some(0), "{seen:?}");
    assert!(!Path::new(&periodic).exists(), "the pause holds the periodic instructions");
}

/// The printed resume command carries every option that shaped the run, so it runs the rest the
/// same way.
#[test]
fn the_resume_command_carries_every_option() {
    let e = Env::new();
    let (ready, go, marker) = (e.fifo("ready"), e.fifo("go"), e.p("marker"));
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("one", &format!("echo > {ready}; cat {go} >/dev/null")),
        sh("two", &format!("echo two >> {marker}")),
    ]}));
    let (regs, images) = (e.p("registries.yaml"), e.p("images"));
    let extra = [
        "--registries",
        &regs,
        "--images-dir",
        &images,
        "--preserve-work-dir",
        "--stop-timeout",
        "3s",
        "--output-cap",
        "2048",
        "--cgroup",
        "off",
    ];
    let (mut child, rx, mut seen) = ctrl_c_while_running(e.cmd(&plan, &extra), &ready, &go);
    wait_stderr(&rx, "--resume-from 1", &mut seen);
    assert_eq!(child.wait().unwrap().code(), Some(3), "{seen:?}");
    let resume = seen.last().unwrap().trim().to_string();
    for opt in extra {
        assert!(resume.split(' ').any(|a| a == opt), "{opt} missing from {resume}");
    }
    let args: Vec<&str> = resume.split_whitespace().collect();
    let out = Command::new(NODEPLAN).args(&args[1..]).env("NODEPLAN_LOG", "warn").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "two\n");
}

/// `apply` removes only the execution directories of earlier applies; a work directory that
/// holds anything else (someone's files) is refused with exit 2 and left exactly as it was.
#[test]
fn apply_never_wipes_files_it_did_not_create() {
    use std::os::unix::fs::PermissionsExt;
    let e = Env::new();
    let work = e.p("work");
    std::fs::create_dir_all(format!("{work}/20250101-000000/old_0")).unwrap();
    let plan = e.plan(serde_json::json!({"instructions": [sh("a", "true")]}));
    let out = e.cmd(&plan, &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!Path::new(&format!("{work}/20250101-000000")).exists(), "an earlier apply's directory is wiped");
    std::fs::write(format!("{work}/notes.txt"), b"mine").unwrap();
    std::fs::create_dir(format!("{work}/20250101-000000")).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("holds entries nodeplan did not create (\"notes.txt\")"), "{err}");
    assert_eq!(std::fs::read(format!("{work}/notes.txt")).unwrap(), b"mine");
    assert!(Path::new(&format!("{work}/20250101-000000")).exists(), "nothing touched");
    assert_eq!(std::fs::metadata(&work).unwrap().permissions().mode() & 0o777, 0o755, "not made private either");
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
    assert!(seen.iter().any(|l| l.starts_with("instruction 1/2 long: canceled (")), "{seen:?}");
    assert!(!seen.iter().any(|l| l.contains("FAILED")), "a cancel is not a failure: {seen:?}");
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
    assert!(help.contains("\n  5  already running: another live `nodeplan apply` of this plan"), "{help}");
    for code in ["0  the plan succeeded", "1  the plan failed", "2  bad input", "3  paused", "4  canceled"] {
        assert!(help.contains(code), "exit code {code:?} missing: {help}");
    }
    for (option, default) in [
        ("--work-dir", "[default: the agent's workDirectory (see --config), else /var/lib/rancher/agent/work]"),
        ("--stop-timeout", "[default: 10s]"),
        ("--output-cap", "[default: 65536]"),
        ("--log-level", "else info]"),
        ("--preserve-work-dir", "[default: off]"),
        ("--color", "[default: auto]"),
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

/// Run `c` to completion with a hang guard: a command that blocks is killed and the test fails.
fn output_within(mut c: Command) -> std::process::Output {
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(GUARD) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            kill_all(&[pid]);
            panic!("{c:?} hung");
        }
    }
}

/// A plan path that is a FIFO, a device or a directory gets one clear line at once, from `apply`
/// (exit 2) and from `plan status`; a FIFO used to block the read forever, deaf to Ctrl-C.
#[test]
fn a_plan_path_that_is_a_fifo_a_device_or_a_directory_is_refused_at_once() {
    let e = Env::new();
    let fifo = e.fifo("fifo.plan");
    std::fs::create_dir(e.p("dir.plan")).unwrap();
    for (path, kind) in
        [(fifo.as_str(), "a FIFO"), ("/dev/null", "a character device"), (&e.p("dir.plan"), "a directory")]
    {
        let out = output_within(e.cmd(path, &[]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{path}: one line: {err}");
        assert!(err.contains(&format!("cannot read {path}: is not a regular file ({kind})")), "{err}");
    }
    for path in [&fifo, &e.p("dir.plan")] {
        let mut c = Command::new(NODEPLAN);
        c.args(["plan", "status", path]);
        let out = output_within(c);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{path}: one line: {err}");
        assert!(err.contains("is not a regular file"), "{err}");
    }
    // A link to a plan is followed, as for any path typed on the command line.
    let plan = e.plan(serde_json::json!({"instructions": [sh("a", "true")]}));
    std::os::unix::fs::symlink(&plan, e.p("link.plan")).unwrap();
    let out = output_within(e.cmd(&e.p("link.plan"), &[]));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// One run of a plan at a time: a second `apply` of a plan whose first run is alive refuses at once
/// with exit 5 naming the first's pid, and the first run's instruction is left alone and finishes.
/// This holds through the owner lock and, were the lock gone (an earlier version, removed by
/// hand), through the run marker of the first's PID record. It used to stop the first's
/// instruction as a "leftover" and run the plan a second time.
#[test]
fn a_second_apply_of_a_running_plan_refuses_and_leaves_the_first_alone() {
    let e = Env::new();
    let (ready, go, done) = (e.fifo("ready"), e.fifo("go"), e.p("done"));
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("long", &format!("echo $$ > {ready}; cat {go} > /dev/null; touch {done}")),
    ]}));
    let (mut first, rx) = spawn_with_stderr(e.cmd(&plan, &[]));
    let instruction: i32 = read_fifo(&ready).trim().parse().unwrap();
    let want = format!("this plan is already being applied by nodeplan pid {}", first.id());
    let second = output_within(e.cmd(&plan, &[]));
    let err = String::from_utf8_lossy(&second.stderr);
    let alive_after_second = alive(instruction);
    // Without the lock file: the first's PID record names it (pid, start time, boot) as alive.
    let locks: Vec<_> = std::fs::read_dir(e.p("pids"))
        .unwrap()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with(".lock"))
        .collect();
    assert_eq!(locks.len(), 1, "one owner lock in the PID directory");
    std::fs::remove_file(locks[0].path()).unwrap();
    let third = output_within(e.cmd(&plan, &[]));
    let err3 = String::from_utf8_lossy(&third.stderr);
    let alive_after_third = alive(instruction);
    release_fifo(&go);
    let status = first.wait().unwrap();
    let seen: Vec<String> = rx.try_iter().collect();
    assert_eq!(second.status.code(), Some(5), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(&want), "{err}");
    assert!(alive_after_second, "the second apply stopped the first's instruction");
    assert_eq!(third.status.code(), Some(5), "{err3}");
    assert!(err3.lines().any(|l| l.contains(&want)), "{err3}");
    assert!(alive_after_third, "the third apply stopped the first's instruction");
    assert_eq!(status.code(), Some(0), "the first run finishes: {seen:?}");
    assert!(Path::new(&done).exists());
}

/// What a SIGKILLed `apply` left running is a leftover: the next apply of the plan stops it (the
/// kernel dropped the dead one's lock) and runs the plan.
#[test]
fn a_leftover_of_a_killed_apply_is_stopped_by_the_next_one() {
    let e = Env::new();
    let ready = e.fifo("ready");
    let once = e.p("once");
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("long", &format!("if mkdir {once} 2>/dev/null; then echo $$ > {ready}; exec sleep 300; fi")),
    ]}));
    let (mut first, _rx) = spawn_with_stderr(e.cmd(&plan, &[]));
    let leftover: i32 = read_fifo(&ready).trim().parse().unwrap();
    first.kill().unwrap();
    first.wait().unwrap();
    let was_alive = alive(leftover);
    let out = output_within(e.cmd(&plan, &["--stop-timeout", "2s"]));
    let still = alive(leftover);
    kill_all(&[leftover]);
    assert!(was_alive, "the instruction outlives a SIGKILLed apply");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!still, "the leftover was not stopped");
}

/// A human duration: `120ms`, `3.8s`, `10s`, `2m05s` (never `3.8209999999999997s`).
fn is_human_duration(s: &str) -> bool {
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
    if let Some(n) = s.strip_suffix("ms") {
        return digits(n);
    }
    if let Some(n) = s.strip_suffix('s') {
        return match n.split_once('m') {
            Some((m, sec)) => digits(m) && sec.len() == 2 && digits(sec),
            None => match n.split_once('.') {
                Some((a, b)) => digits(a) && b.len() == 1 && digits(b),
                None => digits(n),
            },
        };
    }
    false
}

/// Without a terminal: a line when each instruction starts and ends, numbered i/n from 1, with a
/// human duration; a failure reported once with its outcome and output; the 12-digit plan id,
/// never the checksum; no colour codes.
#[test]
fn without_a_terminal_each_instruction_starts_and_ends_on_one_numbered_line() {
    let e = Env::new();
    let plan = e.plan(
        serde_json::json!({"instructions": [sh("a", "true"), sh("stuck", "echo boom >&2; exit 3"), sh("c", "true")]}),
    );
    let raw = std::fs::read(&plan).unwrap();
    let checksum = nodeplan::plan::checksum(&raw);
    let mut c = e.cmd(&plan, &[]);
    c.env("NODEPLAN_LOG", "info").env_remove("NO_COLOR");
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    let pos = |l: &str| lines.iter().position(|x| *x == l).unwrap_or_else(|| panic!("no line {l:?}: {err}"));
    let (a0, s0) = (pos("instruction 1/3 a: started"), pos("instruction 2/3 stuck: started"));
    let ends: Vec<(usize, &str)> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("instruction ") && l.contains(": ok (") || l.contains(": FAILED ("))
        .map(|(i, l)| (i, *l))
        .collect();
    assert_eq!(ends.len(), 2, "{err}");
    assert!(
        ends[0].1.starts_with("instruction 1/3 a: ok (exit status 0, ") && a0 < ends[0].0 && ends[0].0 < s0,
        "{err}"
    );
    assert!(ends[1].1.starts_with("instruction 2/3 stuck: FAILED (exit status 3, ") && s0 < ends[1].0, "{err}");
    for (_, l) in &ends {
        let took = l.rsplit(", ").next().unwrap().trim_end_matches(')');
        assert!(is_human_duration(took), "{took:?} in {l}");
    }
    assert_eq!(lines.get(ends[1].0 + 1), Some(&"  | boom"), "the output follows the failure: {err}");
    let mentions = lines.iter().filter(|l| l.contains("stuck") && l.to_lowercase().contains("fail")).count();
    assert_eq!(mentions, 1, "the failure is reported once: {err}");
    assert!(!err.contains("instruction 3/3 c: started"), "{err}");
    let id = nodeplan::plan::id_of(&raw).unwrap();
    assert!(err.contains(&format!("plan {id} failed after 1/3 instructions (")), "{err}");
    assert!(!err.contains(&checksum), "log lines carry the short id, not the checksum: {err}");
    assert!(!err.contains("instruction 0"), "numbered from 1: {err}");
    assert!(!err.contains('\x1b'), "no colour codes into a pipe: {err}");
}

/// Colour only on a terminal, unless forced with `--color always`; `NO_COLOR` is for `auto`.
#[test]
fn colour_is_off_in_a_pipe_and_can_be_forced() {
    let e = Env::new();
    let plan = e.plan(serde_json::json!({"instructions": [sh("say", "echo said")]}));
    let run = |extra: &[&str], no_color: Option<&str>| {
        let mut c = e.cmd(&plan, extra);
        c.env("NODEPLAN_LOG", "info");
        match no_color {
            Some(v) => c.env("NO_COLOR", v),
            None => c.env_remove("NO_COLOR"),
        };
        let out = c.output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(!run(&[], None).contains('\x1b'));
    assert!(!run(&["--color", "auto"], Some("")).contains('\x1b'));
    assert!(run(&["--color", "always"], None).contains('\x1b'));
    assert!(run(&["--color", "always"], Some("1")).contains('\x1b'), "the flag wins over NO_COLOR");
    assert!(!run(&["--color", "never"], None).contains('\x1b'));
}

/// Checks a JSON value has no object with a key twice (serde_json's Value keeps the last one).
struct NoDuplicateKeys;

impl<'de> serde::Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = NoDuplicateKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                while a.next_element::<NoDuplicateKeys>()?.is_some() {}
                Ok(NoDuplicateKeys)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
                let mut keys = std::collections::HashSet::new();
                while let Some(k) = a.next_key::<String>()? {
                    if !keys.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicate key {k:?}")));
                    }
                    a.next_value::<NoDuplicateKeys>()?;
                }
                Ok(NoDuplicateKeys)
            }
        }
        d.deserialize_any(V)
    }
}

/// `--log-format json`: every stderr line is one JSON object with no key twice (the span's
/// `name` used to collide with the instruction's), and apply's progress comes as JSON events.
#[test]
fn json_output_is_one_object_per_line_with_progress_events() {
    let e = Env::new();
    let plan = e.plan(serde_json::json!({
        "instructions": [sh("first", "echo out"), sh("second", "echo bad >&2; exit 2")],
        "periodicInstructions": [{"name": "tick", "command": "true"}]
    }));
    let mut c = e.cmd(&plan, &["--log-format", "json"]);
    c.env("NODEPLAN_LOG", "info");
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let mut events = Vec::new();
    for l in err.lines() {
        serde_json::from_str::<NoDuplicateKeys>(l).unwrap_or_else(|x| panic!("{x}: {l}"));
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v.is_object(), "{l}");
        events.push(v);
    }
    let of = |event: &str| -> Vec<&serde_json::Value> { events.iter().filter(|v| v["event"] == event).collect() };
    let started = of("instruction_started");
    assert_eq!(started.len(), 3, "{err}");
    assert_eq!(
        (started[0]["i"].as_u64(), started[0]["n"].as_u64(), started[0]["name"].as_str()),
        (Some(1), Some(2), Some("first"))
    );
    let finished = of("instruction_finished");
    assert_eq!(finished.len(), 3, "{err}");
    assert_eq!(finished[1]["ok"], false);
    assert_eq!(finished[1]["outcome"], "exit status 2");
    assert_eq!(finished[1]["output"], "bad");
    let output = events.iter().find(|v| v["message"] == "[first:stdout]: out").unwrap_or_else(|| panic!("{err}"));
    assert_eq!(output["span"]["instruction"]["name"], "first");
    assert_eq!(output["span"]["instruction"]["i"], 1);
    assert_eq!(output["span"]["plan"]["source"], "apply");
    assert_eq!(output["span"]["plan"]["id"].as_str().map(str::len), Some(12));
    let end = of("plan_finished");
    assert_eq!(end.len(), 1, "{err}");
    assert_eq!((end[0]["result"].as_str(), end[0]["completed"].as_u64()), (Some("failed"), Some(1)));
}

/// A stderr whose reader is gone: no panic (it used to end in exit 101 after the plan ran), the
/// exit code is the plan's.
#[test]
fn a_closed_stderr_leaves_the_exit_code_to_the_plan() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let e = Env::new();
    let marker = e.p("done");
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("talk", "for i in $(seq 1 300); do echo line $i; done"),
        sh("mark", &format!("touch {marker}")),
    ]}));
    let mut fds = [0; 2];
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let mut c = e.cmd(&plan, &[]);
    c.env("NODEPLAN_LOG", "info").stdout(Stdio::null()).stderr(Stdio::from(write));
    let status = c.status().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(Path::new(&marker).exists());
}

/// A stderr nobody reads (a full pipe) while a long plan prints a lot: SIGTERM still cancels,
/// with exit 4, within the guard (the signal handler used to wait behind a blocked write).
#[test]
fn sigterm_cancels_while_stderr_is_a_full_pipe_nobody_reads() {
    let e = Env::new();
    let ready = e.fifo("ready");
    let plan = e.plan(serde_json::json!({"instructions": [
        sh("chatty", &format!("seq 1 20000; echo $$ > {ready}; exec sleep 300")),
        sh("after", &format!("touch {}", e.p("after"))),
    ]}));
    let mut c = e.cmd(&plan, &[]);
    c.env("NODEPLAN_LOG", "info").stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let _unread = child.stderr.take();
    let (tx, rx) = mpsc::channel();
    let fifo = ready.clone();
    std::thread::spawn(move || tx.send(std::fs::read_to_string(fifo).unwrap_or_default()));
    let Ok(pid) = rx.recv_timeout(GUARD) else {
        let _ = child.kill();
        panic!("the instruction never got past its output: nodeplan stopped reading it");
    };
    let pid: i32 = pid.trim().parse().unwrap();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let id = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait().map(|s| s.code())));
    let code = rx.recv_timeout(GUARD).unwrap_or_else(|_| {
        unsafe { libc::kill(id, libc::SIGKILL) };
        kill_all(&[pid]);
        panic!("SIGTERM did not end nodeplan while its stderr was full")
    });
    let still = alive(pid);
    kill_all(&[pid]);
    assert_eq!(code.unwrap(), Some(4));
    assert!(!still, "the running instruction was stopped");
    assert!(!Path::new(&e.p("after")).exists());
}

/// Two applies of different plans in one work directory: the first holds its instruction until
/// `go` is released, the second has been started and has said it waits for the lock (its line).
struct TwoApplies {
    first: std::process::Child,
    second: std::process::Child,
    go: String,
    log: String,
    waiting: String,
    seen: Vec<String>,
    /// The first's stderr stays read until the test ends.
    _first_stderr: mpsc::Receiver<String>,
}

fn two_applies(e: &Env) -> TwoApplies {
    let (ready, go, log) = (e.fifo("ready"), e.fifo("go"), e.p("log"));
    let first_plan = e.plan(serde_json::json!({"instructions": [
        sh("first", &format!("echo first-start >> {log}; echo > {ready}; cat {go} > /dev/null; echo first-end >> {log}")),
    ]}));
    let second_plan = e.p("second.plan");
    let second_json = serde_json::json!({"instructions": [sh("second", &format!("echo second >> {log}"))]});
    std::fs::write(&second_plan, serde_json::to_vec(&second_json).unwrap()).unwrap();
    let (first, first_stderr) = spawn_with_stderr(e.cmd(&first_plan, &[]));
    read_fifo(&ready);
    let mut cmd = e.cmd(&second_plan, &[]);
    cmd.env("NODEPLAN_LOG", "info");
    let (second, rx2) = spawn_with_stderr(cmd);
    let mut seen = Vec::new();
    wait_stderr(&rx2, "waiting for the work directory's lock", &mut seen);
    let waiting = seen.last().cloned().unwrap_or_default();
    TwoApplies { first, second, go, log, waiting, seen, _first_stderr: first_stderr }
}

/// Two applies of different plans in one work directory never run at once (they would wipe each
/// other's execution directories): the second waits for the work directory's lock, says who
/// holds it, and runs once the first is done.
#[test]
fn a_second_apply_in_the_same_work_directory_waits_for_the_first() {
    let e = Env::new();
    let mut t = two_applies(&e);
    let line = &t.waiting;
    assert!(line.contains(&format!("(pid {})", t.first.id())) && line.contains("held by apply:"), "{line}");
    assert_eq!(std::fs::read_to_string(&t.log).unwrap(), "first-start\n", "the second did not wait");
    release_fifo(&t.go);
    assert_eq!(t.first.wait().unwrap().code(), Some(0));
    assert_eq!(t.second.wait().unwrap().code(), Some(0), "{:?}", t.seen);
    assert_eq!(std::fs::read_to_string(&t.log).unwrap(), "first-start\nfirst-end\nsecond\n");
}

/// Ctrl-C stops an apply that waits for the work directory's lock: nothing of its plan runs.
#[test]
fn ctrl_c_stops_waiting_for_the_work_directory() {
    let e = Env::new();
    let mut t = two_applies(&e);
    sigint(&t.second);
    let code = t.second.wait().unwrap().code();
    release_fifo(&t.go);
    assert_eq!(t.first.wait().unwrap().code(), Some(0));
    assert_ne!(code, Some(0), "an apply stopped before it ran is not a success");
    assert_eq!(std::fs::read_to_string(&t.log).unwrap(), "first-start\nfirst-end\n", "the second plan ran");
}

/// Issue 23, item 8: a password in an image reference or a probe URL is masked in a dry run as in
/// the agent's own errors (`***@`), with or without `--show-secrets`.
#[test]
fn a_dry_run_masks_passwords_in_images_and_probe_urls() {
    let e = Env::new();
    let plan = e.plan(serde_json::json!({
        "instructions": [{"name": "img", "image": "robot:hunter2@reg.example/a/b:1"}],
        "probes": {"web": {"httpGet": {"url": "https://admin:hunter2@127.0.0.1:9/healthz"}}},
    }));
    for extra in [&["--dry-run"][..], &["--dry-run", "--show-secrets"]] {
        let out = output_within(e.cmd(&plan, extra));
        let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "no file, no drift: {text}{err}");
        assert!(text.contains("image ***@reg.example/a/b:1"), "{text}");
        assert!(text.contains("GET https://***@127.0.0.1:9/healthz"), "{text}");
        assert!(!text.contains("hunter2") && !err.contains("hunter2"), "{extra:?}: {text}{err}");
    }
}

/// `--dry-run` shows each file's diff and each instruction, masks secrets, touches nothing (no
/// work or PID directory, no file, no process), and exits 6 when a file differs from the plan
/// (drift), 0 when every file matches, whatever instructions it would run.
#[test]
fn a_dry_run_shows_the_changes_and_touches_nothing() {
    use base64::Engine as _;
    let e = Env::new();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let (conf, token, ran) = (e.p("conf"), e.p("token"), e.p("ran"));
    std::fs::write(&conf, "one\ntwo\n").unwrap();
    std::fs::set_permissions(&conf, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let plan = e.plan(serde_json::json!({
        "files": [
            {"path": conf, "content": b64("one\n2\n"), "permissions": "0644"},
            {"path": token, "content": b64("join-secret\n")},
        ],
        "instructions": [{"name": "go", "command": "touch", "args": [ran], "env": ["TOKEN=env-secret"]}],
    }));
    let out = output_within(e.cmd(&plan, &["--dry-run"]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(6), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for want in ["modify ", "-two", "+2", "create ", "[1/1] go", "env TOKEN=(masked)"] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
    assert!(!text.contains("join-secret") && !text.contains("env-secret"), "a secret was shown:\n{text}");
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), "one\ntwo\n");
    for p in [&token, &ran, &e.p("work"), &e.p("pids")] {
        assert!(!Path::new(p).exists(), "{p} was made by a dry run");
    }
    let shown = output_within(e.cmd(&plan, &["--dry-run", "--show-secrets"]));
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("+join-secret") && shown.contains("TOKEN=env-secret"), "{shown}");
    // A plan whose files are in place: no drift, though its instruction would run again.
    let done = e.plan(serde_json::json!({
        "files": [{"path": conf, "content": b64("one\ntwo\n"), "permissions": "0644"}],
        "instructions": [{"name": "go", "command": "touch", "args": [ran]}],
    }));
    let out = output_within(e.cmd(&done, &["--dry-run"]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("files: 0 of 1 would change") && text.contains("[1/1] go"), "{text}");
    // One file's mode drifted: exit 6 again.
    std::fs::set_permissions(&conf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = output_within(e.cmd(&done, &["--dry-run"]));
    assert_eq!(out.status.code(), Some(6), "{}", String::from_utf8_lossy(&out.stdout));
    // --show-secrets only means something with --dry-run.
    let out = output_within(e.cmd(&done, &["--show-secrets"]));
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A misspelt plan key makes an empty plan (system-agent ignores unknown keys, and so does the
/// agent): `apply` says so in a warning naming the key, and still applies what the plan says.
#[test]
fn a_misspelt_plan_key_is_named_in_a_warning() {
    let e = Env::new();
    let ran = e.p("ran");
    let plan = e.plan(serde_json::json!({
        "instrutions": [sh("lost", "true")],
        "instructions": [{"name": "a", "command": "touch", "args": [ran.clone()], "retries": 2}]
    }));
    let out = e.cmd(&plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "warning: {plan}: unknown plan key(s) \"plan.instrutions\", \"plan.instructions[0].retries\": ignored"
        )),
        "{err}"
    );
    assert!(Path::new(&ran).exists());
}

/// An API server that refuses the connection is one line from nodeplan, with no line of the
/// Kubernetes client library's before it (it said `ERROR failed with error client error (Connect)`).
#[test]
fn a_refused_api_server_is_one_line() {
    let e = Env::new();
    // A loopback port nothing listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kubeconfig = e.p("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"https://127.0.0.1:{port}\"}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\ncontexts: [{{name: x, context: {{cluster: c, user: u}}}}]\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let out = Command::new(NODEPLAN)
        .args(["plan", "status", "--secret", "ns/x", "--kubeconfig", &kubeconfig])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("nodeplan: get secret ns/x: ") && err.contains("Connection refused"), "{err}");
}
