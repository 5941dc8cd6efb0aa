//! Test helper for the process layer: one program, many behaviours, chosen by the first argument.
//! It reports readiness on stdout (`ready <pid>`) after its signal dispositions are in place, so
//! tests synchronise on lines, never on sleeps.
//!
//! Modes: `exit N`, `term-exit`, `term-ignore`, `term-fail`, `term-die`, `fork N`,
//! `setsid-wait`, `setsid-exit`, `sigstop`, `write N`, `interleave`, `touch FILE` (create FILE,
//! then exit 0), `record-term FILE [READY]` (on SIGTERM write CLOCK_REALTIME ns to FILE and exit 0; once ready, write
//! its pid to READY).

use std::io::Write;

fn say(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

extern "C" fn exit0(_: libc::c_int) {
    unsafe { libc::_exit(0) }
}
extern "C" fn exit3(_: libc::c_int) {
    unsafe { libc::_exit(3) }
}

static mut RECORD_FD: libc::c_int = -1;

extern "C" fn record(_: libc::c_int) {
    // Only async-signal-safe calls: clock_gettime, write, _exit.
    unsafe {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts);
        let mut n = ts.tv_sec as u128 * 1_000_000_000 + ts.tv_nsec as u128;
        let mut buf = [0u8; 40];
        let mut i = buf.len();
        loop {
            i -= 1;
            buf[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        libc::write(RECORD_FD, buf[i..].as_ptr().cast(), buf.len() - i);
        libc::_exit(0);
    }
}

fn on_term(handler: libc::sighandler_t) {
    unsafe {
        libc::signal(libc::SIGTERM, handler);
    }
}

fn forever() -> ! {
    loop {
        unsafe {
            libc::pause();
        }
    }
}

fn ready() {
    say(&format!("ready {}", std::process::id()));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let num = |i: usize| arg(i).parse::<u64>().unwrap_or(0);
    match arg(0).as_str() {
        "exit" => std::process::exit(num(1) as i32),
        "term-exit" => {
            on_term(exit0 as *const () as libc::sighandler_t);
            ready();
            forever()
        }
        "term-fail" => {
            on_term(exit3 as *const () as libc::sighandler_t);
            ready();
            forever()
        }
        "term-ignore" => {
            on_term(libc::SIG_IGN);
            ready();
            forever()
        }
        "term-die" => {
            ready();
            forever()
        }
        "fork" => {
            for _ in 0..num(1) {
                match unsafe { libc::fork() } {
                    0 => {
                        say(&format!("child {}", std::process::id()));
                        forever()
                    }
                    -1 => std::process::exit(90),
                    _ => {}
                }
            }
            on_term(exit0 as *const () as libc::sighandler_t);
            ready();
            forever()
        }
        "setsid-wait" | "setsid-exit" => {
            match unsafe { libc::fork() } {
                0 => {
                    unsafe { libc::setsid() };
                    match unsafe { libc::fork() } {
                        0 => {
                            // The escapee: own session, ignores SIGTERM, keeps stdout open.
                            on_term(libc::SIG_IGN);
                            say(&format!("grandchild {}", std::process::id()));
                            forever()
                        }
                        _ => unsafe { libc::_exit(0) },
                    }
                }
                -1 => std::process::exit(90),
                child => unsafe {
                    let mut st = 0;
                    libc::waitpid(child, &mut st, 0);
                },
            }
            if arg(0) == "setsid-exit" {
                say("parent exiting");
                std::process::exit(0);
            }
            ready();
            forever()
        }
        "sigstop" => {
            on_term(exit0 as *const () as libc::sighandler_t);
            ready();
            unsafe { libc::raise(libc::SIGSTOP) };
            forever()
        }
        "write" => {
            let mut out = std::io::stdout().lock();
            let line = [b'x'; 99];
            let mut left = num(1) as usize;
            while left > 0 {
                let n = left.min(100);
                if n == 100 {
                    let _ = out.write_all(&line);
                    let _ = out.write_all(b"\n");
                } else {
                    let _ = out.write_all(&vec![b'y'; n]);
                }
                left -= n;
            }
        }
        "interleave" => {
            for i in 0..3 {
                say(&format!("out{i}"));
                eprintln!("err{i}");
            }
        }
        "touch" => {
            let _ = std::fs::write(arg(1), b"ran");
        }
        "record-term" => {
            let path = std::ffi::CString::new(arg(1)).unwrap_or_default();
            unsafe {
                RECORD_FD = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, 0o644);
            }
            on_term(record as *const () as libc::sighandler_t);
            ready();
            // Optional readiness file (a FIFO the caller reads): our pid, once the handler is in place.
            if !arg(2).is_empty() {
                let _ = std::fs::write(arg(2), format!("{}\n", std::process::id()));
            }
            forever()
        }
        other => {
            eprintln!("test-helper: unknown mode {other:?}");
            std::process::exit(64);
        }
    }
}
