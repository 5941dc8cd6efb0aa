//! The test helper on Linux: one program, many behaviours, chosen by the first argument.
//! It reports readiness on stdout (`ready <pid>`) after its signal dispositions are in place, so
//! tests synchronise on lines, never on sleeps.
//!
//! Modes: `exit N`, `term-exit`, `term-ignore`, `term-fail`, `term-die`, `fork N`,
//! `setsid-wait`, `setsid-exit`, `sigstop`, `write N`, `interleave`, `touch FILE` (create FILE,
//! then exit 0), `record-term FILE [READY]` (on SIGTERM write CLOCK_REALTIME ns to FILE and exit 0; once ready, write
//! its pid to READY), `fuse-hang DIR` (mount a FUSE filesystem at DIR that answers the kernel's
//! INIT and nothing else: any lookup under DIR, such as an execve of `DIR/x`, waits until the
//! helper dies; each request is reported on stdout as `request <opcode>`).

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

pub fn main() {
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
        "fuse-hang" => fuse_hang(&arg(1)),
        other => {
            eprintln!("test-helper: unknown mode {other:?}");
            std::process::exit(64);
        }
    }
}

/// A FUSE server that never answers: the stand-in for a hung network or FUSE mount.
fn fuse_hang(dir: &str) -> ! {
    const FUSE_INIT: u32 = 26;
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR) };
    if fd < 0 {
        eprintln!("test-helper: cannot open /dev/fuse: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
    let target = std::ffi::CString::new(dir).unwrap_or_default();
    let opts = std::ffi::CString::new(format!("fd={fd},rootmode=40000,user_id=0,group_id=0")).unwrap_or_default();
    let r = unsafe {
        libc::mount(
            c"nodeplan-hang".as_ptr(),
            target.as_ptr(),
            c"fuse".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        eprintln!("test-helper: cannot mount fuse on {dir}: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
    ready();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 40 {
            forever();
        }
        let u32_at = |o: usize| u32::from_ne_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]]);
        let opcode = u32_at(4);
        let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap_or_default());
        if opcode != FUSE_INIT {
            say(&format!("request {opcode}"));
            continue;
        }
        // fuse_out_header (16 bytes) + fuse_init_out (64 bytes): protocol 7.31, nothing else.
        let mut out = [0u8; 80];
        out[0..4].copy_from_slice(&80u32.to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        out[16..20].copy_from_slice(&7u32.to_ne_bytes());
        out[20..24].copy_from_slice(&31u32.to_ne_bytes());
        out[24..28].copy_from_slice(&u32_at(48).to_ne_bytes()); // max_readahead, as asked
        out[36..40].copy_from_slice(&4096u32.to_ne_bytes()); // max_write
        out[40..44].copy_from_slice(&1u32.to_ne_bytes()); // time_gran
        unsafe { libc::write(fd, out.as_ptr().cast(), out.len()) };
    }
}
