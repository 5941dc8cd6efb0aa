//! Spawning with `clone3`: straight into a cgroup (`CLONE_INTO_CGROUP`, so the child is born in its
//! leaf: no migration, which costs far more than the spawn itself) and with a pidfd
//! (`CLONE_PIDFD`). On x86_64 the child shares the agent's address space (`CLONE_VM` on a stack of
//! its own, entered through a few lines of assembly): no page tables are copied and no
//! copy-on-write faults follow in the agent, which is most of what a fork of a multi-threaded
//! process costs. Elsewhere it has fork semantics. Either way, between the clone and `execve` the
//! child only makes raw system calls (no errno, no allocation, no locks) on memory prepared before
//! the clone (dup3, fcntl, setpgid, write, chdir, rt_sigaction, rt_sigprocmask, execve,
//! exit_group), with every signal blocked until its handlers are back to the defaults, as glibc's
//! posix_spawn does.
//!
//! The clone is not a vfork: the agent's thread goes on at once while the child runs elsewhere,
//! and learns through a close-on-exec pipe that the child has exec'd (end of file) or failed (its
//! errno), awaited like any other descriptor. So a child stuck before its exec (in `chdir` or
//! `execve` on an unresponsive network or FUSE mount) holds no thread, and the spawn needs no hand-
//! off to another one. The memory the child uses is kept until that pipe has spoken. [`RawChild`]
//! owns the child: it waits through the pidfd (readable when the process ends) and reaps with
//! `waitid(P_PIDFD)`.

use super::SpawnSpec;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use tokio::io::unix::AsyncFd;

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// The child's pid from the moment it exists (the kernel stores it before the child first runs,
/// `CLONE_PARENT_SETTID`), so that a child stuck before `execve` (in `chdir` or `execve` on an
/// unresponsive network or FUSE mount) can be killed while its spawn is awaited.
#[derive(Default)]
pub(crate) struct EarlyPid {
    pid: std::sync::atomic::AtomicI32,
    /// Set once the spawning thread reaps the child: its pid may be reused from then on.
    reaped: std::sync::Mutex<bool>,
}

impl EarlyPid {
    /// SIGKILL the child if it exists and has not been reaped. Signalling by pid is safe here: an
    /// unreaped child's pid cannot be reused.
    pub fn kill(&self) {
        let Ok(reaped) = self.reaped.lock() else { return };
        let pid = self.pid.load(std::sync::atomic::Ordering::SeqCst);
        if !*reaped && pid > 0 {
            // SAFETY: kill(2) with a pid of our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }

    fn reaping(&self) {
        if let Ok(mut r) = self.reaped.lock() {
            *r = true;
        }
    }
}

/// `struct clone_args` (version 2, with `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"))
}

/// The program as `execve` needs it: a path with a `/` is used as is; a bare name is looked up in
/// the child's own `PATH` (as std does when the environment sets PATH).
fn resolve(program: &OsStr, env: &[(OsString, OsString)]) -> io::Result<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return Ok(PathBuf::from(program));
    }
    let path = env.iter().rev().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone()).unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(program);
        if rustix::fs::access(&candidate, rustix::fs::Access::EXEC_OK).is_ok() && candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(io::Error::new(io::ErrorKind::NotFound, "not found in PATH"))
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

/// Everything the child reads between the clone and `execve`, prepared by the parent.
#[repr(C)]
struct ChildCtx {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    fd_null: libc::c_int,
    fd_out: libc::c_int,
    fd_err: libc::c_int,
    /// The write end of the report pipe (close-on-exec, above 2): the errno of a failure.
    fd_report: libc::c_int,
    /// A cgroup v1 leaf's `cgroup.procs` (open for writing) that the child joins before anything
    /// else it runs can fork, or -1. cgroup v2 leaves are entered by the clone itself.
    fd_join: libc::c_int,
}

/// A raw system call: the negated errno on failure, and nothing written to `errno`, which is the
/// agent thread's own (the child shares its memory and its thread pointer).
///
/// # Safety
/// The arguments must be valid for system call `n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sys(n: libc::c_long, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    // SAFETY: see the function's contract; `syscall` clobbers rcx and r11 only.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a,
            in("rsi") b,
            in("rdx") c,
            in("r10") d,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

/// The same through libc where the child has a memory of its own (fork semantics).
///
/// # Safety
/// The arguments must be valid for system call `n`.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn sys(n: libc::c_long, a: usize, b: usize, c: usize, d: usize) -> isize {
    // SAFETY: see the function's contract.
    let r = unsafe { libc::syscall(n, a, b, c, d) };
    if r < 0 { -(unsafe { *libc::__errno_location() } as isize) } else { r as isize }
}

/// The child side: raw system calls only, no allocation, no locks, never returns.
///
/// # Safety
/// `ctx` points to a live [`ChildCtx`] whose pointers are valid C strings and arrays.
unsafe extern "C" fn child_main(ctx: *mut libc::c_void) -> ! {
    // SAFETY: see the function's contract; every call below is a raw system call.
    unsafe {
        let ctx = &*ctx.cast::<ChildCtx>();
        let fail = |r: isize| -> ! {
            let e: libc::c_int = if r < 0 { -r as libc::c_int } else { libc::EINVAL };
            sys(libc::SYS_write, ctx.fd_report as usize, (&e as *const libc::c_int) as usize, 4, 0);
            loop {
                sys(libc::SYS_exit_group, 127, 0, 0, 0);
            }
        };
        // dup3 onto itself is refused, and would leave close-on-exec set (when the agent started
        // without an fd 0, 1 or 2): clear the flag instead.
        let onto = |from: libc::c_int, to: libc::c_int| {
            if from == to {
                sys(libc::SYS_fcntl, to as usize, libc::F_SETFD as usize, 0, 0)
            } else {
                sys(libc::SYS_dup3, from as usize, to as usize, 0, 0)
            }
        };
        for (from, to) in [(ctx.fd_null, 0), (ctx.fd_out, 1), (ctx.fd_err, 2)] {
            let r = onto(from, to);
            if r < 0 {
                fail(r);
            }
        }
        let r = sys(libc::SYS_setpgid, 0, 0, 0, 0);
        if r < 0 {
            fail(r);
        }
        // "0" is the writer itself: the child moves into its v1 leaf before exec.
        if ctx.fd_join >= 0 {
            let r = sys(libc::SYS_write, ctx.fd_join as usize, b"0".as_ptr() as usize, 1, 0);
            if r != 1 {
                fail(r);
            }
        }
        if !ctx.cwd.is_null() {
            let r = sys(libc::SYS_chdir, ctx.cwd as usize, 0, 0, 0);
            if r < 0 {
                fail(r);
            }
        }
        reset_signal_dispositions();
        let empty: u64 = 0;
        sys(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK as usize, (&empty as *const u64) as usize, 0, 8);
        let r = sys(libc::SYS_execve, ctx.program as usize, ctx.argv as usize, ctx.envp as usize, 0);
        fail(r)
    }
}

/// Every signal disposition back to the default, as a service manager starts its services:
/// handlers the agent installed (a handler run in a child that shares the agent's memory would
/// act on it), SIGPIPE, which Rust ignores, and any signal ignored by whoever started the agent
/// (`nohup`, a shell's background job): an instruction must not silently ignore SIGHUP or SIGINT
/// because of how the agent was launched.
///
/// # Safety
/// Raw system calls only; for a child between fork or clone and exec.
pub(crate) unsafe fn reset_signal_dispositions() {
    /// The kernel's `struct sigaction` (x86_64 and the generic layout): the raw system call
    /// reaches signals 32 and 33 too, which glibc's sigaction refuses as its own.
    #[repr(C)]
    struct KernelSigaction {
        handler: usize,
        flags: libc::c_ulong,
        restorer: usize,
        mask: u64,
    }
    // SAFETY: rt_sigaction on local structs of the kernel's layout; see the function's contract.
    unsafe {
        for sig in 1..=64usize {
            if sig == libc::SIGKILL as usize || sig == libc::SIGSTOP as usize {
                continue;
            }
            let mut old: KernelSigaction = std::mem::zeroed();
            if sys(libc::SYS_rt_sigaction, sig, 0, (&mut old as *mut KernelSigaction) as usize, 8) != 0 {
                continue;
            }
            if old.handler != libc::SIG_DFL {
                let dfl: KernelSigaction = std::mem::zeroed();
                sys(libc::SYS_rt_sigaction, sig, (&dfl as *const KernelSigaction) as usize, 0, 8);
            }
        }
    }
}

/// What the child reads and runs on until it has exec'd or failed: boxed, so its address never
/// changes, and kept until the report pipe has spoken ([`InFlight`]).
struct Prepared {
    ctx: ChildCtx,
    _strings: Vec<CString>,
    _pointers: [Vec<*const libc::c_char>; 2],
    /// The child's stack where it shares the agent's memory: 2 × 32 KiB, 16-byte aligned
    /// (child_main needs a few hundred bytes; glibc's posix_spawn uses 32 KiB plus the arguments).
    stack: Vec<u128>,
}

// SAFETY: the raw pointers point into the value's own heap buffers, which do not move with it.
unsafe impl Send for Prepared {}

/// Clone a child that runs [`child_main`] with `prepared`, every signal blocked around the clone.
/// Returns the pid, or the negated errno.
fn clone_child(args: &mut CloneArgs, prepared: &mut Prepared) -> i64 {
    // The raw system call, as glibc's posix_spawn does: pthread_sigmask would leave glibc's two
    // internal signals (cancellation, setxid) deliverable, and their handlers must not run in a
    // child that shares the agent's memory.
    let all: u64 = !0;
    let mut old: u64 = 0;
    // SAFETY: plain signal-mask system calls on local 64-bit kernel sigsets.
    unsafe {
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &all as *const u64, &mut old as *mut u64, 8usize);
    }
    let ret = clone_raw(args, prepared);
    // SAFETY: restoring this thread's mask saved above.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &old as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        );
    }
    ret
}

/// The child shares the agent's address space and runs on a stack of its own, entered straight
/// from the `syscall` instruction (it cannot return through any Rust frame); the parent goes on.
#[cfg(target_arch = "x86_64")]
fn clone_raw(args: &mut CloneArgs, prepared: &mut Prepared) -> i64 {
    // The kernel starts the child at `stack + stack_size`; the first clone3 kernels (5.3, 5.4)
    // used `stack` itself, so it points at the middle: either way there are 32 KiB below.
    let half = (prepared.stack.capacity() / 2 * std::mem::size_of::<u128>()) as u64;
    args.flags |= libc::CLONE_VM as u64;
    args.stack = prepared.stack.as_mut_ptr() as u64 + half;
    args.stack_size = half;
    let f: unsafe extern "C" fn(*mut libc::c_void) -> ! = child_main;
    let ret: i64;
    // SAFETY: clone3 returns twice. The parent gets the pid (or -errno) in rax and continues
    // normally. The child gets 0, runs on the new stack (the kernel set rsp to its top, 16-byte
    // aligned) and calls child_main, which never returns; r12/r13 survive the syscall. The
    // caller keeps `prepared` (the context and the stack) until the child has exec'd or exited.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") args as *mut CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") &mut prepared.ctx as *mut ChildCtx as *mut libc::c_void,
            in("r13") f,
            lateout("rcx") _,
            lateout("r11") _,
        );
    }
    ret
}

/// fork flavour for other architectures: the child has its own copy of the address space.
#[cfg(not(target_arch = "x86_64"))]
fn clone_raw(args: &mut CloneArgs, prepared: &mut Prepared) -> i64 {
    // SAFETY: clone3 with fork semantics (no CLONE_VM, no new stack); the child only runs
    // child_main, which never returns.
    let ret = unsafe { libc::syscall(libc::SYS_clone3, args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if ret == 0 {
        unsafe { child_main(&mut prepared.ctx as *mut ChildCtx as *mut libc::c_void) }
    }
    if ret < 0 { -(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL) as i64) } else { ret }
}

/// The read end of a child's report pipe, registered with the runtime once it is awaited.
enum Report {
    Plain(OwnedFd),
    Registered(AsyncFd<OwnedFd>),
}

/// A child between its clone and its exec: the memory it runs on, kept until its report pipe
/// ends (close-on-exec: it has exec'd; or it has exited). Dropped before that (the spawn given
/// up), both go to a thread that waits for the pipe's end first.
struct InFlight {
    prepared: Option<Box<Prepared>>,
    report: Option<Report>,
}

impl InFlight {
    /// `None` once the child has exec'd (or died), its errno when it failed before.
    async fn heard(&mut self) -> io::Result<Option<i32>> {
        if let Some(Report::Plain(fd)) = self.report.take() {
            rustix::io::ioctl_fionbio(&fd, true)?;
            // SAFETY: the OwnedFd is moved into the AsyncFd and stays open, unchanged, until it
            // is dropped or taken back with into_inner.
            match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
                Ok(afd) => self.report = Some(Report::Registered(afd)),
                Err(e) => {
                    let (fd, e) = e.into_parts();
                    self.report = Some(Report::Plain(fd));
                    return Err(e);
                }
            }
        }
        let Some(Report::Registered(afd)) = &self.report else {
            return Err(io::Error::other("the report pipe is gone"));
        };
        let (mut buf, mut got) = ([0u8; 4], 0);
        loop {
            let mut guard = afd.readable().await?;
            match guard.try_io(|fd| rustix::io::read(fd.get_ref(), &mut buf[got.min(3)..]).map_err(io::Error::from)) {
                // The end: the child no longer runs on this memory.
                Ok(Ok(0)) => break,
                Ok(Ok(n)) => got += n,
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        self.prepared = None;
        Ok((got >= 4).then(|| i32::from_ne_bytes(buf)))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(prepared) = self.prepared.take() else { return };
        let fd = match self.report.take() {
            Some(Report::Plain(fd)) => fd,
            Some(Report::Registered(afd)) => afd.into_inner(),
            None => {
                Box::leak(prepared);
                return;
            }
        };
        // Freed only by the thread, after the pipe's end; leaked if no thread can be started.
        let raw = Box::into_raw(prepared) as usize;
        let _ = std::thread::Builder::new().name("nodeplan-spawn".into()).spawn(move || {
            let _ = rustix::io::ioctl_fionbio(&fd, false);
            let mut buf = [0u8; 4];
            while !matches!(rustix::io::read(&fd, &mut buf), Ok(0) | Err(rustix::io::Errno::BADF)) {}
            // SAFETY: `raw` came from Box::into_raw above and the child is done with it.
            drop(unsafe { Box::from_raw(raw as *mut Prepared) });
        });
    }
}

/// A child started by [`spawn`].
pub(crate) struct RawChild {
    pub pid: i32,
    pidfd: Option<AsyncFd<OwnedFd>>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    reaped: bool,
}

/// Why `clone3` itself could not be used (old kernel, seccomp, no cgroup fd): use another way.
#[derive(Debug)]
pub(crate) enum SpawnError {
    Unsupported(io::Error),
    /// The cgroup leaf is gone (removed by someone else between its mkdir and the clone): nothing
    /// ran; start without it.
    LeafGone(io::Error),
    Failed(io::Error),
}

/// Start `spec` (with the run marker in its environment) in its own process group, inside the
/// cgroup `cgroup_dir` when given: born in it when it is a cgroup2 directory, joining it before
/// exec otherwise (a cgroup v1 leaf, which `CLONE_INTO_CGROUP` does not accept). Resolves once
/// the child has exec'd (or failed to); `early` learns the pid as soon as the child exists.
pub(crate) async fn spawn(
    spec: &SpawnSpec,
    marker: &str,
    cgroup_dir: Option<&Path>,
    early: &EarlyPid,
) -> Result<RawChild, SpawnError> {
    let (mut child, mut in_flight) = start(spec, marker, cgroup_dir, early)?;
    match in_flight.heard().await {
        Ok(None) => Ok(child),
        Ok(Some(errno)) => {
            early.reaping();
            let _ = child.wait().await;
            Err(SpawnError::Failed(io::Error::from_raw_os_error(errno)))
        }
        Err(e) => {
            // Nothing tells when it execs: it does not run unwatched.
            let _ = child.start_kill();
            Err(SpawnError::Failed(e))
        }
    }
}

/// The clone: the child and what it runs on until its exec ([`spawn`]).
fn start(
    spec: &SpawnSpec,
    marker: &str,
    cgroup_dir: Option<&Path>,
    early: &EarlyPid,
) -> Result<(RawChild, InFlight), SpawnError> {
    use SpawnError::{Failed, LeafGone, Unsupported};
    let mut env: Vec<(OsString, OsString)> = spec.env.iter().filter(|(k, _)| k != super::MARKER_ENV).cloned().collect();
    env.push((super::MARKER_ENV.into(), marker.into()));
    // Everything the child touches is prepared here, before the clone.
    let program = resolve(&spec.program, &env).map_err(Failed)?;
    let mut strings = vec![cstring(program.as_os_str()).map_err(Failed)?, cstring(&spec.program).map_err(Failed)?];
    for a in &spec.args {
        strings.push(cstring(a).map_err(Failed)?);
    }
    let env_from = strings.len();
    for (k, v) in &env {
        let mut kv = k.clone();
        kv.push("=");
        kv.push(v);
        strings.push(cstring(&kv).map_err(Failed)?);
    }
    let cwd_at = match &spec.cwd {
        Some(d) => {
            strings.push(cstring(d.as_os_str()).map_err(Failed)?);
            Some(strings.len() - 1)
        }
        None => None,
    };
    let end = cwd_at.unwrap_or(strings.len());
    let argv: Vec<*const libc::c_char> =
        strings[1..env_from].iter().map(|c| c.as_ptr()).chain([std::ptr::null()]).collect();
    let envp: Vec<*const libc::c_char> =
        strings[env_from..end].iter().map(|c| c.as_ptr()).chain([std::ptr::null()]).collect();
    let leaf = match cgroup_dir {
        Some(dir) => Some(
            rustix::fs::open(
                dir,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .map_err(|e| if e == rustix::io::Errno::NOENT { LeafGone(e.into()) } else { Unsupported(e.into()) })?,
        ),
        None => None,
    };
    let (cgroup, join) = match leaf {
        Some(fd) => {
            let v2 = rustix::fs::fstatfs(&fd).map_err(|e| Unsupported(e.into()))?.f_type as u64
                == super::cgroup::CGROUP2_SUPER_MAGIC;
            if v2 {
                (Some(fd), None)
            } else {
                let procs = rustix::fs::openat(
                    &fd,
                    "cgroup.procs",
                    rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(|e| if e == rustix::io::Errno::NOENT { LeafGone(e.into()) } else { Failed(e.into()) })?;
                (None, Some(procs))
            }
        }
        None => (None, None),
    };
    let devnull = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| Failed(e.into()))?;
    let (out_r, out_w) = pipe().map_err(Failed)?;
    let (err_r, err_w) = pipe().map_err(Failed)?;
    let (report_r, report_w) = pipe().map_err(Failed)?;
    // Above 2, so that the child's dup3 onto 0, 1 and 2 never replaces it.
    let report_w = if report_w.as_raw_fd() < 3 {
        rustix::io::fcntl_dupfd_cloexec(&report_w, 3).map_err(|e| Failed(e.into()))?
    } else {
        report_w
    };
    let ctx = ChildCtx {
        program: strings[0].as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cwd_at.map_or(std::ptr::null(), |i| strings[i].as_ptr()),
        fd_null: devnull.as_raw_fd(),
        fd_out: out_w.as_raw_fd(),
        fd_err: err_w.as_raw_fd(),
        fd_report: report_w.as_raw_fd(),
        fd_join: join.as_ref().map_or(-1, |j| j.as_raw_fd()),
    };
    let mut prepared =
        Box::new(Prepared { ctx, _strings: strings, _pointers: [argv, envp], stack: Vec::with_capacity(4096) });

    let mut pidfd: libc::c_int = -1;
    let mut flags = (libc::CLONE_PIDFD | libc::CLONE_PARENT_SETTID) as u64;
    if cgroup.is_some() {
        flags |= CLONE_INTO_CGROUP;
    }
    let mut args = CloneArgs {
        flags,
        pidfd: &mut pidfd as *mut libc::c_int as u64,
        parent_tid: early.pid.as_ptr() as u64,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.as_ref().map_or(0, |c| c.as_raw_fd() as u64),
        ..Default::default()
    };
    let ret = clone_child(&mut args, &mut prepared);
    // The child has its own descriptor table: the agent's copies go at once.
    drop((devnull, out_w, err_w, cgroup, join, report_w));
    if ret < 0 {
        let e = io::Error::from_raw_os_error(-ret as i32);
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT | libc::ENODEV) if args.cgroup != 0 => LeafGone(e),
            Some(libc::ENOSYS | libc::EPERM | libc::EINVAL | libc::E2BIG | libc::EOPNOTSUPP | libc::EBADF) => {
                Unsupported(e)
            }
            _ => Failed(e),
        });
    }
    let in_flight = InFlight { prepared: Some(prepared), report: Some(Report::Plain(report_r)) };
    // SAFETY: the kernel returned a new pidfd in `pidfd`.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let mut child = RawChild { pid: ret as i32, pidfd: None, stdout: Some(out_r), stderr: Some(err_r), reaped: false };
    if let Err(e) = rustix::io::ioctl_fionbio(&pidfd, true) {
        let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
        return Err(Failed(e.into()));
    }
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open, unchanged, until it is dropped
    // or taken back with into_inner.
    match unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) } {
        Ok(afd) => child.pidfd = Some(afd),
        Err(e) => {
            let (pidfd, e) = e.into_parts();
            let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
            return Err(Failed(e));
        }
    }
    Ok((child, in_flight))
}

impl RawChild {
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|a| a.get_ref().as_fd())
    }

    /// Reap without blocking: `Some` once the process has ended.
    pub fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt;
        let Some(fd) = self.fd() else { return Err(io::Error::other("already reaped")) };
        match rustix::process::waitid(
            rustix::process::WaitId::PidFd(fd),
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOHANG,
        )? {
            Some(st) => {
                self.reaped = true;
                let raw = match (st.exit_status(), st.terminating_signal()) {
                    (Some(code), _) => (code & 0xff) << 8,
                    (None, Some(sig)) => sig & 0x7f,
                    _ => 0,
                };
                Ok(Some(std::process::ExitStatus::from_raw(raw)))
            }
            None => Ok(None),
        }
    }

    /// Wait for the process to end and reap it (cancel-safe).
    pub async fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(s);
            }
            let Some(afd) = &self.pidfd else { return Err(io::Error::other("no pidfd")) };
            let mut guard = afd.readable().await?;
            guard.clear_ready();
        }
    }

    pub fn start_kill(&self) -> io::Result<()> {
        match self.fd() {
            Some(fd) => match rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL) {
                Err(e) if e == rustix::io::Errno::SRCH => Ok(()),
                r => r.map_err(Into::into),
            },
            None => Ok(()),
        }
    }
}

impl Drop for RawChild {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        // A child given up on (the no-kill policy) is still ours to reap: wait for it off-thread.
        if let Some(afd) = self.pidfd.take() {
            let fd = afd.into_inner();
            let _ = std::thread::Builder::new().name("nodeplan-reaper".into()).spawn(move || {
                let _ = rustix::io::ioctl_fionbio(&fd, false);
                let _ = rustix::process::waitid(
                    rustix::process::WaitId::PidFd(fd.as_fd()),
                    rustix::process::WaitIdOptions::EXITED,
                );
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_vanished_cgroup_leaf_is_reported_as_such_and_nothing_runs() {
        let d = tempfile::tempdir().unwrap();
        let marker_file = d.path().join("ran");
        let spec = SpawnSpec::new("/bin/touch", [marker_file.as_os_str()]);
        let gone = d.path().join("no-such-leaf");
        let early = EarlyPid::default();
        assert!(matches!(spawn(&spec, "np-test", Some(&gone), &early).await, Err(SpawnError::LeafGone(_))));
        assert!(!marker_file.exists());
        let mut child = spawn(&spec, "np-test", None, &early).await.unwrap();
        assert_eq!(early.pid.load(std::sync::atomic::Ordering::SeqCst), child.pid, "known before the spawn returned");
        assert!(child.wait().await.unwrap().success());
        assert!(marker_file.exists());
    }

    /// A failure between the clone and the exec comes back as that errno (the child reaped); the
    /// agent's own errno is not the child's to write.
    #[tokio::test]
    async fn a_failure_before_the_exec_is_its_errno() {
        let d = tempfile::tempdir().unwrap();
        let mut spec = SpawnSpec::new("/bin/true", Vec::<String>::new());
        spec.cwd = Some(d.path().join("no-such-dir"));
        let early = EarlyPid::default();
        // SAFETY: this thread's errno, set to a value no failure below produces.
        unsafe { *libc::__errno_location() = 12345 };
        match spawn(&spec, "np-test", None, &early).await {
            Err(SpawnError::Failed(e)) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}"),
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("started in a directory that does not exist"),
        }
        // SAFETY: as above.
        assert_eq!(unsafe { *libc::__errno_location() }, 12345, "the child wrote the agent's errno");
        spec.cwd = None;
        spec.program = d.path().join("not-a-program").into_os_string();
        std::fs::write(d.path().join("not-a-program"), "").unwrap();
        match spawn(&spec, "np-test", None, &early).await {
            Err(SpawnError::Failed(e)) => assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}"),
            other => panic!("{:?}", other.map(|c| c.pid)),
        }
    }

    /// A spawn given up between the clone and the exec (its future dropped) still lets the child
    /// run: the memory it runs on goes only once it has exec'd.
    #[tokio::test]
    async fn a_spawn_given_up_before_the_exec_is_heard_lets_the_child_run() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..20 {
            let fifo = d.path().join(format!("fifo{i}"));
            rustix::fs::mkfifoat(rustix::fs::CWD, &fifo, rustix::fs::Mode::from_raw_mode(0o600)).unwrap();
            let script = format!("echo ran > {}", fifo.display());
            let spec = SpawnSpec::new("/bin/sh", ["-c", script.as_str()]);
            let early = EarlyPid::default();
            // Polled once (the clone happens), then dropped while the report is awaited.
            let _ = tokio::time::timeout(Duration::ZERO, spawn(&spec, "np-test", None, &early)).await;
            let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo));
            let got = tokio::time::timeout(Duration::from_secs(10), read).await.expect("the child never ran");
            assert_eq!(got.unwrap().unwrap(), "ran\n");
        }
    }
}
