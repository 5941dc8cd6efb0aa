//! Table tests of the applyinator against real processes (`sh`), synchronised through FIFOs.

use super::*;
use crate::plan::{FileOp, format_unix_date};
use crate::process::{CgroupMode, StopPolicy, SupervisorConfig};
use chrono::TimeZone;
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Mutex;

struct Fixture {
    dir: tempfile::TempDir,
    app: Applyinator,
    clock: Arc<FixedClock>,
}

struct FixedClock(Mutex<DateTime<Utc>>);

impl Clock for FixedClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap()
    }
}

impl FixedClock {
    fn advance(&self, secs: i64) {
        *self.0.lock().unwrap() += chrono::Duration::seconds(secs);
    }
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sup = Supervisor::new(SupervisorConfig {
        policy: StopPolicy { grace: Duration::from_secs(5), kill_timeout: Duration::from_secs(5), kill: true },
        cgroup: CgroupMode::Auto,
        pid_dir: Some(dir.path().join("pids")),
        ..Default::default()
    });
    let clock = Arc::new(FixedClock(Mutex::new(Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap())));
    let mut cfg = ApplyConfig::new(dir.path().join("work"));
    cfg.applied_plan_dir = Some(dir.path().join("applied"));
    let app = Applyinator::with_clock(cfg, sup, clock.clone());
    Fixture { dir, app, clock }
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
    fn exists(&self, name: &str) -> bool {
        self.dir.path().join(name).exists()
    }
}

/// A plan of `sh -c` instructions named a, b, c… with `saveOutput`.
fn sh_plan(scripts: &[&str]) -> ValidPlan {
    let ins: Vec<serde_json::Value> = scripts
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"name": ((b'a' + i as u8) as char).to_string(), "command": "sh", "args": ["-c", s], "saveOutput": true})
        })
        .collect();
    crate::plan::parse(serde_json::to_string(&serde_json::json!({ "instructions": ins })).unwrap().as_bytes()).unwrap()
}

fn input<'a>(plan: &'a ValidPlan, rx: watch::Receiver<Interrupt>) -> ApplyInput<'a> {
    ApplyInput {
        plan,
        reconcile_files: true,
        run_one_time: true,
        attempt: 1,
        resume_from: 0,
        one_time_output: BTreeMap::new(),
        periodic_output: BTreeMap::new(),
        run_periodic: true,
        interrupts: rx,
        owner: crate::process::Owner::apply(&plan.checksum),
        observer: Arc::new(NoObserver),
    }
}

/// Block until the instruction opened `fifo` for writing (it is running), then return.
async fn wait_running(fifo: String) {
    let f = tokio::task::spawn_blocking(move || std::fs::read(fifo).unwrap());
    tokio::time::timeout(Duration::from_secs(30), f).await.expect("instruction never started").unwrap();
}

/// Let the instruction blocked on reading `fifo` continue.
async fn release(fifo: String) {
    tokio::task::spawn_blocking(move || drop(std::fs::OpenOptions::new().write(true).open(fifo).unwrap()))
        .await
        .unwrap();
}

/// Instruction a signals READY, then blocks on GO and ends with `a_end`; b and c touch files.
/// While a runs, a pause is requested; then GO is released.
async fn pause_while_running(a_end: &str) -> (Fixture, ApplyResult) {
    let fx = fixture();
    let (ready, go) = (fx.fifo("ready"), fx.fifo("go"));
    let a = format!("echo a-out; echo a-err >&2; echo > {ready}; cat {go} > /dev/null; {a_end}");
    let b = format!("touch {}", fx.path("b-ran"));
    let c = format!("touch {}", fx.path("c-ran"));
    let plan = sh_plan(&[&a, &b, &c]);
    let (tx, rx) = watch::channel(Interrupt::default());
    let res = {
        let run = fx.app.apply(input(&plan, rx));
        let drive = async {
            wait_running(ready).await;
            tx.send_modify(|i| i.pause = true);
            release(go).await;
        };
        let (r, ()) = tokio::join!(run, drive);
        r.unwrap()
    };
    (fx, res)
}

#[tokio::test]
async fn pause_while_an_instruction_runs_stops_at_the_boundary() {
    let (fx, r) = pause_while_running("exit 0").await;
    assert_eq!(r.interruption, Some(Interruption::Paused));
    assert_eq!((r.completed, r.total), (1, 3));
    assert!(!r.one_time_succeeded);
    assert!(!fx.exists("b-ran"), "the next instruction must never start");
    assert_eq!(r.one_time_output["a"], b"a-out\na-err\n".to_vec(), "saved output kept with the pause (R12)");
    assert_eq!(execution_dirs(&fx).await, ["_0"], "no directory for an instruction the pause held");
}

#[tokio::test]
async fn pause_pending_while_the_instruction_fails_is_a_failure() {
    let (fx, r) = pause_while_running("exit 7").await;
    assert_eq!(r.interruption, None, "pause never masks a failure (R5)");
    assert!(!r.one_time_succeeded);
    assert_eq!(r.completed, 0);
    assert_eq!(r.reports[0].outcome.to_string(), "exit status 7");
    assert!(!fx.exists("b-ran"));
}

#[tokio::test]
async fn a_pause_pending_at_a_failure_is_not_taken_up_by_the_periodic_pass() {
    // A genuine failure with a pause pending, in a plan that also has periodic instructions: the
    // periodic pass must not turn the failure into a pause (R5).
    let fx = fixture();
    let (ready, go) = (fx.fifo("ready"), fx.fifo("go"));
    let raw = serde_json::to_vec(&serde_json::json!({
        "instructions": [{"name": "a", "command": "sh", "args": ["-c", format!("echo > {ready}; cat {go} > /dev/null; exit 5")]}],
        "periodicInstructions": [{"name": "p", "command": "true"}]
    }))
    .unwrap();
    let plan = crate::plan::parse(&raw).unwrap();
    let (tx, rx) = watch::channel(Interrupt::default());
    let (r, ()) = tokio::join!(fx.app.apply(input(&plan, rx)), async {
        wait_running(ready).await;
        tx.send_modify(|i| i.pause = true);
        release(go).await;
    });
    let r = r.unwrap();
    assert_eq!(r.interruption, None, "the failure is recorded, not the pause");
    assert!(!r.one_time_succeeded);
    assert_eq!(r.reports.len(), 1, "the pause stopped the periodic pass before it started anything");
}

#[tokio::test]
async fn cancel_while_an_instruction_runs_stops_its_tree() {
    // `a` never finishes by itself: it waits on a FIFO nobody will write after the cancel.
    let fx = fixture();
    let ready = fx.fifo("ready");
    let plan = sh_plan(&[&format!("echo > {ready}; sleep 300 & wait"), &format!("touch {}", fx.path("b-ran"))]);
    let (tx, rx) = watch::channel(Interrupt::default());
    let (r, ()) = tokio::join!(fx.app.apply(input(&plan, rx)), async {
        wait_running(ready).await;
        tx.send_modify(|i| i.cancel = true);
    });
    let r = r.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Canceled));
    assert_eq!(r.completed, 0);
    assert!(!r.termination_incomplete);
    assert_eq!(r.reports[0].outcome.stop_reason(), Some(StopReason::Cancel));
    assert!(!fx.exists("b-ran"));
}

#[tokio::test]
async fn cancel_while_the_instruction_fails_is_a_cancel() {
    // `a` exits 1 when it gets SIGTERM: that failure is the cancel's doing (R9).
    let fx = fixture();
    let ready = fx.fifo("ready");
    // No child process: a shell's background child can swallow a SIGTERM that arrives between its
    // fork and exec. The shell spins in builtins until the trap turns SIGTERM into exit 1.
    let a = format!("trap 'exit 1' TERM; echo > {ready}; while :; do :; done");
    let plan = sh_plan(&[&a, &format!("touch {}", fx.path("b-ran"))]);
    let (tx, rx) = watch::channel(Interrupt::default());
    let (r, ()) = tokio::join!(fx.app.apply(input(&plan, rx)), async {
        wait_running(ready).await;
        tx.send_modify(|i| i.cancel = true);
    });
    let r = r.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Canceled));
    assert_eq!(r.completed, 0);
    assert_eq!(r.reports[0].outcome.to_string(), "exited after stop request: exit status 1");
    assert!(!fx.exists("b-ran"));
}

#[tokio::test]
async fn cancel_before_anything_runs_spawns_nothing() {
    let fx = fixture();
    let plan = sh_plan(&[&format!("touch {}", fx.path("a-ran"))]);
    let (_tx, rx) = watch::channel(Interrupt { cancel: true, ..Default::default() });
    let r = fx.app.apply(input(&plan, rx)).await.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Canceled));
    assert_eq!((r.completed, r.total), (0, 1));
    assert!(r.reports.is_empty());
    assert!(!fx.exists("a-ran"));
}

/// Cancels from inside `instruction_started`, i.e. after the applyinator decided to run the
/// instruction and before its process exists.
struct CancelOnStart(watch::Sender<Interrupt>);
impl Observer for CancelOnStart {
    fn instruction_started(&self, _: usize, _: usize, _: &str, _: bool) {
        self.0.send_modify(|i| i.cancel = true);
    }
}

#[tokio::test]
async fn cancel_in_the_gap_between_deciding_and_spawning_prevents_the_spawn() {
    let fx = fixture();
    let plan = sh_plan(&[&format!("touch {}", fx.path("a-ran"))]);
    let (tx, rx) = watch::channel(Interrupt::default());
    let mut inp = input(&plan, rx);
    inp.observer = Arc::new(CancelOnStart(tx));
    let r = fx.app.apply(inp).await.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Canceled));
    assert_eq!(r.reports[0].outcome, Outcome::NotStarted(StopReason::Cancel));
    assert!(!fx.exists("a-ran"));
    assert!(r.one_time_output.is_empty(), "a never-started instruction saves no output");
}

#[tokio::test]
async fn resume_skips_finished_instructions_and_keeps_their_outputs() {
    let fx = fixture();
    let plan = sh_plan(&[
        &format!("touch {}", fx.path("a-ran")),
        &format!("touch {}", fx.path("b-ran")),
        &format!("touch {}; echo c-out", fx.path("c-ran")),
    ]);
    let (_tx, rx) = watch::channel(Interrupt::default());
    let mut inp = input(&plan, rx);
    inp.resume_from = 2;
    inp.one_time_output.insert("a".into(), b"old a".to_vec());
    let r = fx.app.apply(inp).await.unwrap();
    assert!(r.one_time_succeeded);
    assert_eq!(r.completed, 3);
    assert!(!fx.exists("a-ran") && !fx.exists("b-ran") && fx.exists("c-ran"));
    assert_eq!(r.one_time_output["a"], b"old a");
    assert_eq!(r.one_time_output["c"], b"c-out\n");
}

#[tokio::test]
async fn periodic_outputs_survive_an_interruption() {
    let fx = fixture();
    let plan = sh_plan(&["true"]);
    let (_tx, rx) = watch::channel(Interrupt { pause: true, ..Default::default() });
    let mut inp = input(&plan, rx);
    let kept = PeriodicInstructionOutput {
        name: "p".into(),
        stdout: b"x".to_vec(),
        last_successful_run_time: "Mon Nov 30 05:29:24 UTC 2026".into(),
        ..Default::default()
    };
    inp.periodic_output.insert("p".into(), kept.clone());
    let r = fx.app.apply(inp).await.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Paused));
    assert_eq!(r.periodic_output["p"], kept);
}

#[tokio::test]
async fn stops_at_the_first_failure_and_runs_in_order() {
    let fx = fixture();
    let log = fx.path("log");
    let plan = sh_plan(&[
        &format!("echo one >> {log}"),
        &format!("echo two >> {log}; exit 2"),
        &format!("echo three >> {log}"),
    ]);
    let (_tx, rx) = watch::channel(Interrupt::default());
    let r = fx.app.apply(input(&plan, rx)).await.unwrap();
    assert!(!r.one_time_succeeded);
    assert_eq!(r.completed, 1);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\n");
    assert_eq!(r.reports.len(), 2);
    assert!(r.one_time_output.contains_key("b"), "a failed instruction's output is saved too");
    assert_eq!(execution_dirs(&fx).await, ["_0", "_1"], "no directory for the instruction that never ran");
}

/// The suffixes (`_<index>`) of the execution directories the last apply made, once the disk
/// lane has done what the apply handed to it (a directory prepared for an instruction that did
/// not run is removed in its turn there, not before the apply returns).
async fn execution_dirs(fx: &Fixture) -> Vec<String> {
    crate::disk::run(|| Ok(())).await.unwrap();
    let work = fx.dir.path().join("work");
    let stamps: Vec<_> = std::fs::read_dir(&work).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(stamps.len(), 1, "one execution directory per apply: {stamps:?}");
    let mut dirs: Vec<String> = std::fs::read_dir(&stamps[0])
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().rsplit_once('_').map(|(_, i)| format!("_{i}")).unwrap())
        .collect();
    dirs.sort();
    dirs
}

#[tokio::test]
async fn instruction_environment_and_default_command() {
    let fx = fixture();
    let raw = serde_json::json!({"instructions": [
        {"name": "env", "command": "sh", "args": ["-c", "echo $CATTLE_AGENT_EXECUTION_PWD; echo $CATTLE_AGENT_ATTEMPT_NUMBER; echo $PATH; echo $FOO; pwd"],
         "env": ["FOO=bar", "CATTLE_AGENT_ATTEMPT_NUMBER=99"], "saveOutput": true},
        {"name": "runsh"}
    ]});
    let raw = serde_json::to_vec(&raw).unwrap();
    let plan = crate::plan::parse(&raw);
    assert!(plan.is_err(), "an instruction with neither command nor image is rejected up front");
    let raw = serde_json::to_vec(&serde_json::json!({"instructions": [
        {"name": "env", "command": "sh", "args": ["-c", "echo $CATTLE_AGENT_EXECUTION_PWD; echo $CATTLE_AGENT_ATTEMPT_NUMBER; echo $PATH; echo $FOO; pwd"],
         "env": ["FOO=bar", "CATTLE_AGENT_ATTEMPT_NUMBER=99"], "saveOutput": true}]})).unwrap();
    let plan = crate::plan::parse(&raw).unwrap();
    let (_tx, rx) = watch::channel(Interrupt::default());
    let mut inp = input(&plan, rx);
    inp.attempt = 4;
    let r = fx.app.apply(inp).await.unwrap();
    assert!(r.one_time_succeeded, "{:?}", r.reports);
    let out = String::from_utf8(r.one_time_output["env"].clone()).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    let exec = lines[0];
    assert!(exec.starts_with(&fx.path("work")) && exec.ends_with(&format!("{}_0", plan.checksum)), "{exec}");
    assert_eq!(lines[1], "4", "the agent's attempt number wins over the instruction's env");
    assert!(lines[2].ends_with(&format!(":{exec}")), "PATH extended: {}", lines[2]);
    assert_eq!(lines[3], "bar");
    assert_eq!(lines[4], exec, "cwd is the execution directory");
}

#[tokio::test]
async fn instruction_timeout_fails_the_instruction() {
    let fx = fixture();
    let raw = br#"{"instructions":[{"name":"slow","command":"sleep","args":["300"],"timeoutSeconds":1}]}"#;
    let plan = crate::plan::parse(raw).unwrap();
    let (_tx, rx) = watch::channel(Interrupt::default());
    let r = fx.app.apply(input(&plan, rx)).await.unwrap();
    assert!(!r.one_time_succeeded);
    assert_eq!(r.interruption, None);
    assert!(r.reports[0].outcome.timed_out(), "{}", r.reports[0].outcome);
    assert!(r.reports[0].outcome.to_string().starts_with("timed out after 1s"));
}

#[tokio::test]
async fn missing_run_sh_is_a_start_failure_naming_it() {
    let fx = fixture();
    let plan = sh_plan(&["true"]);
    let mut plan2 = plan.clone();
    plan2.plan.instructions[0].common.command.clear();
    let (_tx, rx) = watch::channel(Interrupt::default());
    let r = fx.app.apply(input(&plan2, rx)).await.unwrap();
    let msg = r.reports[0].outcome.to_string();
    assert!(msg.starts_with("failed to start: ") && msg.contains("/run.sh"), "{msg}");
}

#[tokio::test]
async fn file_operations() {
    let fx = fixture();
    let root = fx.path("files");
    let ops = vec![
        FileOp::Write {
            path: format!("{root}/a/b/c.conf"),
            content: b"hello".to_vec(),
            mode: 0o640,
            uid: 1234,
            gid: 4321,
        },
        FileOp::Directory { path: format!("{root}/d/e"), mode: 0o700, uid: 7, gid: 8 },
        FileOp::Write { path: format!("{root}/gone"), content: b"x".to_vec(), mode: 0o600, uid: 0, gid: 0 },
    ];
    for op in &ops {
        files::apply_file(op).unwrap();
    }
    let md = std::fs::metadata(format!("{root}/a/b/c.conf")).unwrap();
    assert_eq!((md.permissions().mode() & 0o7777, md.uid(), md.gid()), (0o640, 1234, 4321));
    assert_eq!(
        std::fs::metadata(format!("{root}/a/b")).unwrap().permissions().mode() & 0o777,
        0o755,
        "nested parents 0755"
    );
    let dmd = std::fs::metadata(format!("{root}/d/e")).unwrap();
    assert!(dmd.is_dir());
    assert_eq!((dmd.permissions().mode() & 0o777, dmd.uid(), dmd.gid()), (0o700, 7, 8));
    // Idempotent rewrite: same content → same inode and mtime; mode and owner re-applied anyway.
    std::fs::set_permissions(format!("{root}/a/b/c.conf"), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(format!("{root}/a/b/c.conf"), Some(0), Some(0)).unwrap();
    files::apply_file(&ops[0]).unwrap();
    let again = std::fs::metadata(format!("{root}/a/b/c.conf")).unwrap();
    assert_eq!((again.ino(), again.mtime_nsec()), (md.ino(), md.mtime_nsec()), "unchanged content is not rewritten");
    assert_eq!((again.permissions().mode() & 0o777, again.uid()), (0o640, 1234));
    // Changed content: replaced atomically (new inode), no temp files left.
    let changed =
        FileOp::Write { path: format!("{root}/a/b/c.conf"), content: b"new".to_vec(), mode: 0o640, uid: 0, gid: 0 };
    files::apply_file(&changed).unwrap();
    assert_eq!(std::fs::read(format!("{root}/a/b/c.conf")).unwrap(), b"new");
    assert_eq!(std::fs::read_dir(format!("{root}/a/b")).unwrap().count(), 1);
    // Delete: file, directory, and a missing path are all fine.
    files::apply_file(&FileOp::Delete { path: format!("{root}/gone"), directory: false }).unwrap();
    files::apply_file(&FileOp::Delete { path: format!("{root}/d"), directory: true }).unwrap();
    files::apply_file(&FileOp::Delete { path: format!("{root}/never"), directory: false }).unwrap();
    assert!(!std::path::Path::new(&format!("{root}/gone")).exists());
    assert!(!std::path::Path::new(&format!("{root}/d")).exists());
}

#[tokio::test]
async fn files_are_written_before_instructions_and_archived() {
    let fx = fixture();
    let target = fx.path("etc/conf");
    let raw = serde_json::to_vec(&serde_json::json!({
        "files": [{"path": target, "content": "aGVsbG8=", "permissions": "0644"}],
        "instructions": [{"name": "cat", "command": "cat", "args": [target], "saveOutput": true}]
    }))
    .unwrap();
    let plan = crate::plan::parse(&raw).unwrap();
    let (_tx, rx) = watch::channel(Interrupt::default());
    let r = fx.app.apply(input(&plan, rx.clone())).await.unwrap();
    assert_eq!(r.one_time_output["cat"], b"hello");
    let archived: Vec<_> = std::fs::read_dir(fx.path("applied")).unwrap().flatten().collect();
    assert_eq!(archived.len(), 1);
    let body: serde_json::Value = serde_json::from_slice(&std::fs::read(archived[0].path()).unwrap()).unwrap();
    assert_eq!(body["Checksum"], plan.checksum);
    // The same plan again is not archived twice.
    fx.app.apply(input(&plan, rx)).await.unwrap();
    assert_eq!(std::fs::read_dir(fx.path("applied")).unwrap().count(), 1);
}

#[tokio::test]
async fn periodic_schedule_and_backoff_follow_the_clock() {
    let fx = fixture();
    let count = fx.path("count");
    let fail = fx.path("fail");
    let raw = serde_json::to_vec(&serde_json::json!({"periodicInstructions": [
        {"name": "p", "command": "sh", "args": ["-c", format!("echo run >> {count}; echo err >&2; test ! -e {fail}")], "periodSeconds": 60, "saveStderrOutput": true}
    ]}))
    .unwrap();
    let plan = crate::plan::parse(&raw).unwrap();
    let runs = || std::fs::read_to_string(&count).map(|s| s.lines().count()).unwrap_or(0);
    let mut outputs: BTreeMap<String, PeriodicInstructionOutput> = BTreeMap::new();
    // (seconds to advance, make it fail?, runs so far, failures, why)
    let table: &[(i64, bool, usize, i64, &str)] = &[
        (0, false, 1, 0, "never ran: due"),
        (59, false, 1, 0, "inside the period"),
        (1, false, 2, 0, "a full period later"),
        (60, true, 3, 1, "due again; fails"),
        (29, true, 3, 1, "failure backoff 30 s x 1"),
        (1, true, 4, 2, "backoff over; fails again"),
        (59, true, 4, 2, "failure backoff 30 s x 2"),
        (1, false, 5, 0, "succeeds; failures reset"),
    ];
    for (advance, failing, want_runs, want_failures, why) in table {
        fx.clock.advance(*advance);
        if *failing {
            std::fs::write(&fail, b"").unwrap();
        } else {
            let _ = std::fs::remove_file(&fail);
        }
        let (_tx, rx) = watch::channel(Interrupt::default());
        let mut inp = input(&plan, rx);
        inp.run_one_time = false;
        inp.periodic_output = outputs.clone();
        let r = fx.app.apply(inp).await.unwrap();
        outputs = r.periodic_output;
        assert_eq!((runs(), outputs["p"].failures), (*want_runs, *want_failures), "{why}");
    }
    let out = &outputs["p"];
    assert_eq!(out.last_successful_run_time, format_unix_date(fx.clock.now()));
    assert_eq!(out.last_failed_run_time, "");
    assert_eq!(out.stderr, b"err\n", "saveStderrOutput");
    assert_eq!(out.stdout, b"", "stdout of the periodic instruction");
}

/// Typed errors keep the one-line messages: each source's text is already in the line, so
/// [`crate::error_line`] adds nothing.
#[test]
fn apply_errors_read_as_one_line_with_their_sources() {
    let denied = || std::io::Error::from_raw_os_error(libc::EACCES);
    let cases = [
        (
            ApplyError::Files(FileError { action: "writing", path: "/etc/x".into(), source: denied() }),
            "files: writing /etc/x: Permission denied (os error 13)",
        ),
        (
            ApplyError::Interlock(InterlockError::Io { path: "/i".into(), source: denied() }),
            "interlock: /i: Permission denied (os error 13)",
        ),
        (
            ApplyError::WorkDir(WorkDirError::Wipe { path: "/w/20260101-000000".into(), source: denied() }),
            "work directory: wiping /w/20260101-000000: Permission denied (os error 13)",
        ),
        (
            ApplyError::ForeignWorkDir(WorkDirError::Foreign {
                dir: "/home".into(),
                entries: ["a", "b", "c", "d"].map(String::from).to_vec(),
            }),
            "work directory: /home holds entries nodeplan did not create (\"a\", \"b\", \"c\" and 1 more); refusing to \
             use it as the work directory (give an empty directory or one only nodeplan uses)",
        ),
    ];
    for (e, line) in cases {
        assert_eq!(e.to_string(), line);
        assert_eq!(crate::error_line(&e), line);
    }
}

#[test]
fn instruction_results_and_their_metric() {
    use crate::metrics::InstructionResult as R;
    use crate::process::{ExitKind, StopReason};
    let g = Duration::from_secs(1);
    let table = [
        (Outcome::Exited(ExitKind::Code(0)), R::Ok),
        (Outcome::Exited(ExitKind::Code(3)), R::Failed),
        (Outcome::StartFailed("x".into()), R::Failed),
        (Outcome::Killed { reason: StopReason::Timeout(g), grace: g }, R::Failed),
        (Outcome::Killed { reason: StopReason::Cancel, grace: g }, R::Canceled),
        (Outcome::NotStarted(StopReason::Cancel), R::Canceled),
        (Outcome::ExitedAfterStop { reason: StopReason::Shutdown, status: ExitKind::Code(0) }, R::Stopped),
    ];
    for (o, want) in table {
        assert_eq!(instruction_metric(&o), want, "{o:?}");
    }
}

/// R31: the disk lane does not answer (held here by an operation that waits for the test). A
/// cancel ends the apply's wait for the work directory's lock: nothing of the plan happens, then
/// or after the disk answers again, and the next apply runs as usual.
#[tokio::test]
async fn a_cancel_while_the_disk_does_not_answer_ends_the_wait() {
    let fx = fixture();
    let (planted, ran) = (fx.path("planted"), fx.path("ran"));
    let mut plan = sh_plan(&[&format!("touch {ran}")]);
    plan.files = vec![FileOp::Write { path: planted.clone(), content: b"x".to_vec(), mode: 0o600, uid: 0, gid: 0 }];
    let (go, stalled) = std::sync::mpsc::channel::<()>();
    let stall = crate::disk::run(move || Ok(stalled.recv().is_ok()));
    let (tx, rx) = watch::channel(Interrupt::default());
    let run = fx.app.apply(input(&plan, rx));
    let cancel = async {
        // `join!` polls the apply first: it is waiting on the lane by now.
        tokio::task::yield_now().await;
        tx.send_modify(|i| i.cancel = true);
    };
    let (r, ()) = tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(run, cancel) })
        .await
        .expect("the cancel ended the wait");
    let r = r.unwrap();
    assert_eq!(r.interruption, Some(Interruption::Canceled));
    assert!(r.reports.is_empty());
    go.send(()).unwrap();
    assert!(stall.await.unwrap(), "the stalled operation ran");
    crate::disk::run(|| Ok(())).await.unwrap();
    assert!(!fx.exists("planted") && !fx.exists("ran"), "nothing of the canceled plan happens after the disk answers");
    let next = sh_plan(&[&format!("touch {}", fx.path("next"))]);
    let (_tx, rx) = watch::channel(Interrupt::default());
    let r = fx.app.apply(input(&next, rx)).await.unwrap();
    assert!(r.one_time_succeeded && fx.exists("next"), "the work directory's lock was let go");
}

/// R31: a preparation its apply stopped waiting for stops at its next step: no interlock is
/// entered and no file of the plan is written.
#[test]
fn an_abandoned_preparation_writes_nothing_more() {
    let fx = fixture();
    let prepare = |abandoned: bool| Prepare {
        interlock_dir: Some(fx.dir.path().join("interlock")),
        applied_plan_dir: None,
        plan: sh_plan(&["true"]).plan,
        checksum: "c".into(),
        now: Utc::now(),
        files: vec![FileOp::Write { path: fx.path("planted"), content: b"x".to_vec(), mode: 0o600, uid: 0, gid: 0 }],
        work_dir: fx.dir.path().join("work"),
        wipe: true,
        abandoned: Arc::new(std::sync::atomic::AtomicBool::new(abandoned)),
    };
    assert!(prepare(true).run().unwrap().is_none());
    assert!(!fx.exists("planted"));
    assert!(!fx.exists("interlock/applyinator-active"));
    let held = prepare(false).run().unwrap();
    assert!(held.is_some() && fx.exists("planted") && fx.exists("interlock/applyinator-active"));
    drop(held);
    assert!(!fx.exists("interlock/applyinator-active"));
}
