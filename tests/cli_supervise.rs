//! `nodeplan supervise` end to end: the real binary supervising the helper program.

mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

struct Sup {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

fn supervise(pid_dir: &str, extra: &[&str], helper_args: &[&str]) -> Sup {
    let mut child = Command::new(NODEPLAN)
        .args(["supervise", "--name", "svc", "--pid-dir", pid_dir])
        .args(extra)
        .arg("--")
        .arg(HELPER)
        .args(helper_args)
        .env("NODEPLAN_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = lines_of(child.stderr.take().unwrap());
    Sup { child, lines: rx, seen: Vec::new() }
}

impl Sup {
    fn wait_log(&mut self, needle: &str) -> String {
        loop {
            let l =
                self.lines.recv_timeout(GUARD).unwrap_or_else(|_| panic!("never logged {needle:?}: {:?}", self.seen));
            self.seen.push(l.clone());
            if l.contains(needle) {
                return l;
            }
        }
    }
    fn term_and_wait(&mut self) -> (i32, Vec<String>) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let code = self.child.wait().unwrap().code().unwrap_or(-1);
        let rest: Vec<String> = self.lines.iter().collect();
        (code, rest)
    }
}

impl Drop for Sup {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pid_of(line: &str) -> i32 {
    line.split_whitespace().last().unwrap().parse().unwrap()
}

fn records(dir: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.filter(|e| e.as_ref().is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json"))).count())
        .unwrap_or(0)
}

#[test]
fn sigterm_runs_the_ladder_and_exits_zero() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let mut s = supervise(&pids, &[], &["term-exit"]);
    let pid = pid_of(&s.wait_log("[svc:stdout]: ready "));
    assert_eq!(records(&pids), 1, "a PID record while it runs");
    let (code, _) = s.term_and_wait();
    assert_eq!(code, 0);
    assert!(!alive(pid));
    assert_eq!(records(&pids), 0, "removed once the tree is gone");
}

#[test]
fn no_kill_gives_up_exits_non_zero_with_one_line_and_keeps_the_record() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let mut s = supervise(&pids, &["--no-kill", "--stop-timeout", "300ms"], &["term-ignore"]);
    let pid = pid_of(&s.wait_log("ready "));
    let (code, rest) = s.term_and_wait();
    let still = alive(pid);
    kill_all(&[pid]);
    assert_eq!(code, 1);
    let errors: Vec<&String> = rest.iter().filter(|l| l.starts_with("nodeplan:")).collect();
    assert_eq!(errors.len(), 1, "{rest:?}");
    assert!(errors[0].contains("could not be stopped") && errors[0].contains("300ms"), "{}", errors[0]);
    assert!(still, "--no-kill leaves the process");
    assert_eq!(records(&pids), 1, "and its PID record");
}

#[test]
fn respawns_with_backoff() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let mut s = supervise(&pids, &[], &["exit", "1"]);
    let line = s.wait_log("restarting in");
    assert!(line.contains("exit status 1; restarting in 1s"), "{line}");
    assert!(line.contains("supervise:svc"), "names the service: {line}");
    assert!(s.wait_log("restarting in").contains("restarting in 2s"));
    let (code, _) = s.term_and_wait();
    assert_eq!(code, 0);
}

#[test]
fn a_verified_previous_instance_is_stopped_first() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let mut first = supervise(&pids, &[], &["term-exit"]);
    let old = pid_of(&first.wait_log("ready "));
    unsafe { libc::kill(first.child.id() as i32, libc::SIGKILL) };
    let _ = first.child.wait();
    assert!(alive(old), "the supervised process outlives a SIGKILLed supervisor");
    let mut second = supervise(&pids, &[], &["term-exit"]);
    second.wait_log(&format!("stopped leftover pid {old}"));
    let new = pid_of(&second.wait_log("ready "));
    let old_alive = alive(old);
    kill_all(&[old]);
    assert!(!old_alive);
    assert_ne!(new, old);
    assert_eq!(second.term_and_wait().0, 0);
}

/// A first start that cannot succeed (no such program, not executable, a PID directory that is a
/// file) gives up at once with one line naming the service, instead of retrying forever.
#[test]
fn a_start_that_cannot_succeed_gives_up_at_once_naming_the_service() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let not_exec = d.path().join("script");
    std::fs::write(&not_exec, b"#!/bin/sh\n").unwrap();
    let file_as_dir = d.path().join("file");
    std::fs::write(&file_as_dir, b"").unwrap();
    let cannot = "cannot start:";
    let cases: [(&str, &str, &str, &str); 3] = [
        (&pids, "/nonexistent/command", cannot, "No such file or directory (os error 2); not retrying"),
        (&pids, not_exec.to_str().unwrap(), cannot, "Permission denied (os error 13); not retrying"),
        (
            file_as_dir.to_str().unwrap(),
            "/bin/true",
            "owner lock",
            "cannot make its directory: File exists (os error 17)",
        ),
    ];
    for (pid_dir, cmd, what, why) in cases {
        let out = Command::new(NODEPLAN)
            .args(["supervise", "--name", "svc", "--pid-dir", pid_dir, "--", cmd])
            .env("NODEPLAN_LOG", "error")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cmd}: {err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with(&format!("nodeplan: svc: {what}")) && last.contains(why), "{cmd}: {err}");
    }
}

/// One owner, one run: a second `supervise --name svc` while the first is alive refuses at once
/// with exit 5 naming the first's pid, and the first's process is left alone. Both used to end up
/// running (the second stopped the first's process as a "leftover", then the first respawned it).
#[test]
fn a_second_instance_of_a_live_name_refuses_and_leaves_the_first_alone() {
    let d = tempfile::tempdir().unwrap();
    let pids = d.path().join("pids").to_string_lossy().into_owned();
    let mut first = supervise(&pids, &[], &["term-exit"]);
    let pid = pid_of(&first.wait_log("ready "));
    let mut second = supervise(&pids, &[], &["term-exit"]);
    let code = second.child.wait().unwrap().code();
    let lines: Vec<String> = second.lines.iter().collect();
    let still = alive(pid);
    let (first_code, rest) = first.term_and_wait();
    kill_all(&[pid]);
    assert_eq!(code, Some(5), "{lines:?}");
    let errors: Vec<&String> = lines.iter().filter(|l| l.starts_with("nodeplan:")).collect();
    assert_eq!(errors.len(), 1, "{lines:?}");
    assert!(errors[0].contains(&format!("svc: already running as nodeplan pid {}", first.child.id())), "{}", errors[0]);
    assert!(!lines.iter().any(|l| l.contains("[svc:stdout]: ready")), "the second started the command: {lines:?}");
    assert!(still, "the second stopped the first's process");
    assert!(!rest.iter().any(|l| l.contains("restarting")), "the first's process was stopped: {rest:?}");
    assert_eq!(first_code, 0);
    let out = Command::new(NODEPLAN).args(["supervise", "--help"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("\n  5  already running: another live `nodeplan supervise`"));
}

#[test]
fn bad_arguments_exit_two_with_one_line() {
    for args in [&["--pid-dir", "relative"][..], &["--stop-timeout", "5d"], &["--log-level", "loud"]] {
        let child = Command::new(NODEPLAN)
            .arg("supervise")
            .args(args)
            .args(["--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Accepted arguments would supervise `true` for ever: a guard turns that into a failure.
        let pid = child.id() as i32;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || tx.send(child.wait_with_output()));
        let out = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap_or_else(|_| {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{args:?} was accepted: nodeplan supervise is running")
        });
        let out = out.unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
    }
}
