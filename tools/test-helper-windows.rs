//! The test helper on Windows. Every mode that stays up prints `ready <pid> [<pid>…]` (its own pid,
//! then those of the processes it started, deepest last) once it is set up, then waits for ever.
//!
//! Modes: `exit N`; `print N` (a line on stdout, one on stderr, exit N); `touch PATH`;
//! `wait-file PATH` (prints `waiting`, then waits until PATH exists); `alive PID…` (prints those
//! still running); `daemon` (starts `tree 0`
//! without waiting for it, prints `ready <its pid>`, exits 0); `tree N` (a chain of N more copies of itself below it: `tree 2` is a
//! three-level tree; each level ends on its console's Ctrl-C, the default); `tree-ignore N` (the
//! same, each level ignoring Ctrl-C and Ctrl-Break); `agent N` (starts `tree N` through nodeplan's
//! process layer, in a job, and stays up: killing it must end the tree).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

fn forever() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

fn say(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

/// The first line the helper started by `cmd` prints, the pids after its `ready`.
fn ready_pids(child: &mut std::process::Child) -> String {
    let Some(out) = child.stdout.take() else { std::process::exit(91) };
    let mut line = String::new();
    if BufReader::new(out).read_line(&mut line).is_err() || !line.starts_with("ready ") {
        std::process::exit(92);
    }
    line["ready ".len()..].trim().to_string()
}

unsafe extern "system" fn ignore_interrupts(ctrl: u32) -> i32 {
    use windows_sys::Win32::System::Console::{CTRL_BREAK_EVENT, CTRL_C_EVENT};
    i32::from(ctrl == CTRL_C_EVENT || ctrl == CTRL_BREAK_EVENT)
}

fn tree(levels: u64, ignore: bool) -> ! {
    if ignore {
        // SAFETY: a handler that only returns a value.
        unsafe { windows_sys::Win32::System::Console::SetConsoleCtrlHandler(Some(ignore_interrupts), 1) };
    }
    let me = std::process::id();
    if levels == 0 {
        say(&format!("ready {me}"));
        forever()
    }
    let mode = if ignore { "tree-ignore" } else { "tree" };
    let Ok(exe) = std::env::current_exe() else { std::process::exit(90) };
    let Ok(mut child) = Command::new(exe).args([mode, &(levels - 1).to_string()]).stdout(Stdio::piped()).spawn() else {
        std::process::exit(90)
    };
    let below = ready_pids(&mut child);
    say(&format!("ready {me} {below}"));
    forever()
}

pub fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let num = |i: usize| arg(i).parse::<u64>().unwrap_or(0);
    match arg(0).as_str() {
        "exit" => std::process::exit(num(1) as i32),
        "print" => {
            say("to stdout");
            eprintln!("to stderr");
            std::process::exit(num(1) as i32)
        }
        "touch" => match std::fs::write(arg(1), b"") {
            Ok(()) => std::process::exit(0),
            Err(_) => std::process::exit(95),
        },
        "wait-file" => {
            say("waiting");
            while !std::path::Path::new(&arg(1)).exists() {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            std::process::exit(0)
        }
        "alive" => {
            let alive: Vec<String> = args[1..]
                .iter()
                .filter(|p| p.parse().ok().and_then(nodeplan::process::Identity::of).is_some_and(|id| id.alive()))
                .cloned()
                .collect();
            say(&alive.join(" "));
            std::process::exit(0)
        }
        "daemon" => {
            let Ok(exe) = std::env::current_exe() else { std::process::exit(90) };
            let Ok(mut child) = Command::new(exe).args(["tree", "0"]).stdout(Stdio::piped()).spawn() else {
                std::process::exit(90)
            };
            let below = ready_pids(&mut child);
            say(&format!("ready {below}"));
            std::process::exit(0)
        }
        "tree" => tree(num(1), false),
        "tree-ignore" => tree(num(1), true),
        "agent" => {
            let Ok(exe) = std::env::current_exe() else { std::process::exit(90) };
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                std::process::exit(94)
            };
            let below = rt.block_on(async {
                use tokio::io::AsyncBufReadExt;
                let mut cmd = tokio::process::Command::new(exe);
                cmd.args(["tree", &num(1).to_string()]).stdout(Stdio::piped());
                let Ok(mut run) = nodeplan::process::spawn(&mut cmd) else { std::process::exit(93) };
                let Some(out) = run.child_mut().stdout.take() else { std::process::exit(91) };
                let mut line = String::new();
                if tokio::io::BufReader::new(out).read_line(&mut line).await.is_err() || !line.starts_with("ready ") {
                    std::process::exit(92);
                }
                // The run (and its job) must outlive this block: the agent holds it until killed.
                std::mem::forget(run);
                line["ready ".len()..].trim().to_string()
            });
            say(&format!("ready {} {below}", std::process::id()));
            forever()
        }
        other => {
            eprintln!("nodeplan-test-helper: unknown mode {other:?}");
            std::process::exit(2)
        }
    }
}
