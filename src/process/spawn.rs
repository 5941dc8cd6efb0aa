//! Spawning with `clone3`: straight into a cgroup (`CLONE_INTO_CGROUP`, so the child is born in its
//! leaf: no migration, which costs far more than the spawn itself) and with a pidfd
//! (`CLONE_PIDFD`). On x86_64 the clone also has vfork semantics (`CLONE_VM | CLONE_VFORK` on a
//! stack of its own, entered through a few lines of assembly): no page tables are copied and no
//! copy-on-write faults follow in the agent, which is most of what a fork of a multi-threaded
//! process costs. Elsewhere it has fork semantics. Either way, between the clone and `execve` the
//! child only makes async-signal-safe system calls on memory prepared before the clone (dup2,
//! fcntl, setpgid, write, chdir, sigaction, sigprocmask, execve, _exit), with every signal blocked
//! until its handlers are back to the defaults, as glibc's posix_spawn does. [`RawChild`] owns the
//! child: it waits through the pidfd (readable when the process ends) and reaps with
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
/// unresponsive network or FUSE mount), which also holds the spawning thread under vfork, can be
/// killed from another thread.
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

/// Whether [`clone_child`] shares the address space (vfork) on this architecture.
const VFORK: bool = cfg!(target_arch = "x86_64");

/// Everything the child reads between the clone and `execve`, prepared by the parent. Under vfork
/// the child writes `errno` here before `_exit` (the parent is suspended until then).
#[repr(C)]
struct ChildCtx {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    fd_null: libc::c_int,
    fd_out: libc::c_int,
    fd_err: libc::c_int,
    fd_report: libc::c_int,
    /// A cgroup v1 leaf's `cgroup.procs` (open for writing) that the child joins before anything
    /// else it runs can fork, or -1. cgroup v2 leaves are entered by the clone itself.
    fd_join: libc::c_int,
    errno: libc::c_int,
}

/// The child side: async-signal-safe calls only, no allocation, no locks, never returns.
///
/// # Safety
/// `ctx` points to a live [`ChildCtx`] whose pointers are valid C strings and arrays.
unsafe extern "C" fn child_main(ctx: *mut libc::c_void) -> ! {
    // SAFETY: see the function's contract; every call below is async-signal-safe.
    unsafe {
        let ctx = ctx.cast::<ChildCtx>();
        let fail = |ctx: *mut ChildCtx| -> ! {
            let e = match *libc::__errno_location() {
                0 => libc::EINVAL,
                e => e,
            };
            if VFORK {
                std::ptr::write_volatile(&mut (*ctx).errno, e);
            } else {
                libc::write((*ctx).fd_report, (&e as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>());
            }
            libc::_exit(127)
        };
        // dup2 onto itself is a no-op that would leave close-on-exec set (when the agent started
        // without an fd 0, 1 or 2): clear the flag instead.
        let onto = |from: libc::c_int, to: libc::c_int| {
            if from == to { libc::fcntl(to, libc::F_SETFD, 0) } else { libc::dup2(from, to) }
        };
        if onto((*ctx).fd_null, 0) < 0 || onto((*ctx).fd_out, 1) < 0 || onto((*ctx).fd_err, 2) < 0 {
            fail(ctx);
        }
        if libc::setpgid(0, 0) < 0 {
            fail(ctx);
        }
        // "0" is the writer itself: the child moves into its v1 leaf before exec.
        if (*ctx).fd_join >= 0 && libc::write((*ctx).fd_join, b"0".as_ptr().cast(), 1) != 1 {
            fail(ctx);
        }
        if !(*ctx).cwd.is_null() && libc::chdir((*ctx).cwd) < 0 {
            fail(ctx);
        }
        reset_signal_dispositions();
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve((*ctx).program, (*ctx).argv, (*ctx).envp);
        fail(ctx)
    }
}

/// Every signal disposition back to the default, as a service manager starts its services:
/// handlers the agent installed (a handler run in a vfork child would act on the agent's
/// memory), SIGPIPE, which Rust ignores, and any signal ignored by whoever started the agent
/// (`nohup`, a shell's background job): an instruction must not silently ignore SIGHUP or SIGINT
/// because of how the agent was launched.
///
/// # Safety
/// Async-signal-safe (sigaction only); for a child between fork or clone and exec.
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
        for sig in 1..=64 {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            let mut old: KernelSigaction = std::mem::zeroed();
            let none = std::ptr::null::<KernelSigaction>();
            if libc::syscall(libc::SYS_rt_sigaction, sig, none, &mut old as *mut KernelSigaction, 8usize) != 0 {
                continue;
            }
            if old.handler != libc::SIG_DFL {
                let dfl: KernelSigaction = std::mem::zeroed();
                let none = std::ptr::null_mut::<KernelSigaction>();
                libc::syscall(libc::SYS_rt_sigaction, sig, &dfl as *const KernelSigaction, none, 8usize);
            }
        }
    }
}

/// Clone a child that runs [`child_main`] with `ctx`, every signal blocked around the clone.
/// Returns the pid, or the negated errno.
fn clone_child(args: &mut CloneArgs, ctx: &mut ChildCtx) -> i64 {
    // The raw system call, as glibc's posix_spawn does: pthread_sigmask would leave glibc's two
    // internal signals (cancellation, setxid) deliverable, and their handlers must not run in a
    // child that shares the agent's memory.
    let all: u64 = !0;
    let mut old: u64 = 0;
    // SAFETY: plain signal-mask system calls on local 64-bit kernel sigsets.
    unsafe {
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &all as *const u64, &mut old as *mut u64, 8usize);
    }
    let ret = clone_raw(args, ctx);
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

/// vfork flavour: the child runs on a stack of its own in the agent's address space, entered
/// straight from the `syscall` instruction (it cannot return through any Rust frame), while the
/// parent thread sleeps until the child has exec'd or exited.
#[cfg(target_arch = "x86_64")]
fn clone_raw(args: &mut CloneArgs, ctx: &mut ChildCtx) -> i64 {
    // 2 × 32 KiB, 16-byte aligned: child_main needs a few hundred bytes (glibc's posix_spawn
    // uses 32 KiB plus the arguments). The kernel starts the child at `stack + stack_size`; the
    // first clone3 kernels (5.3, 5.4) used `stack` itself, so it points at the middle: either
    // way there are 32 KiB below.
    let mut stack = vec![0u128; 4096];
    let half = (stack.len() / 2 * std::mem::size_of::<u128>()) as u64;
    args.flags |= (libc::CLONE_VM | libc::CLONE_VFORK) as u64;
    args.stack = stack.as_mut_ptr() as u64 + half;
    args.stack_size = half;
    let f: unsafe extern "C" fn(*mut libc::c_void) -> ! = child_main;
    let ret: i64;
    // SAFETY: clone3 returns twice. The parent gets the pid (or -errno) in rax and continues
    // normally. The child gets 0, runs on the new stack (the kernel set rsp to its top, 16-byte
    // aligned) and calls child_main, which never returns; r12/r13 survive the syscall. The
    // parent is suspended until the child execs or exits, so `ctx` and `stack` outlive the child's
    // use of them.
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
            in("r12") ctx as *mut ChildCtx as *mut libc::c_void,
            in("r13") f,
            lateout("rcx") _,
            lateout("r11") _,
        );
    }
    drop(stack);
    ret
}

/// fork flavour for other architectures: the child has its own copy of the address space.
#[cfg(not(target_arch = "x86_64"))]
fn clone_raw(args: &mut CloneArgs, ctx: &mut ChildCtx) -> i64 {
    // SAFETY: clone3 with fork semantics (no CLONE_VM, no new stack); the child only runs
    // child_main, which never returns.
    let ret = unsafe { libc::syscall(libc::SYS_clone3, args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if ret == 0 {
        unsafe { child_main(ctx as *mut ChildCtx as *mut libc::c_void) }
    }
    if ret < 0 { -(io::Error::last_os_error().raw_os_error().unwrap_or(libc::EINVAL) as i64) } else { ret }
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
/// exec otherwise (a cgroup v1 leaf, which `CLONE_INTO_CGROUP` does not accept).
///
/// Under vfork this blocks the calling thread until the child has exec'd or exited, which may be
/// never (a hung mount): call it off the runtime thread. `early` learns the pid before the child
/// runs.
pub(crate) fn spawn(
    spec: &SpawnSpec,
    marker: &str,
    cgroup_dir: Option<&Path>,
    early: &EarlyPid,
) -> Result<RawChild, SpawnError> {
    use SpawnError::{Failed, LeafGone, Unsupported};
    let mut env: Vec<(OsString, OsString)> = spec.env.iter().filter(|(k, _)| k != super::MARKER_ENV).cloned().collect();
    env.push((super::MARKER_ENV.into(), marker.into()));
    // Everything the child touches is prepared here, before the clone.
    let program = resolve(&spec.program, &env).map_err(Failed)?;
    let program_c = cstring(program.as_os_str()).map_err(Failed)?;
    let mut argv_c = vec![cstring(&spec.program).map_err(Failed)?];
    for a in &spec.args {
        argv_c.push(cstring(a).map_err(Failed)?);
    }
    let mut envp_c = Vec::with_capacity(env.len());
    for (k, v) in &env {
        let mut kv = k.clone();
        kv.push("=");
        kv.push(v);
        envp_c.push(cstring(&kv).map_err(Failed)?);
    }
    let argv: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).chain([std::ptr::null()]).collect();
    let envp: Vec<*const libc::c_char> = envp_c.iter().map(|c| c.as_ptr()).chain([std::ptr::null()]).collect();
    let cwd_c = match &spec.cwd {
        Some(d) => Some(cstring(d.as_os_str()).map_err(Failed)?),
        None => None,
    };
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
    // Fork semantics need a pipe for the child's errno; under vfork it writes `ctx.errno`.
    let report = if VFORK { None } else { Some(pipe().map_err(Failed)?) };
    let mut ctx = ChildCtx {
        program: program_c.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cwd_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
        fd_null: devnull.as_raw_fd(),
        fd_out: out_w.as_raw_fd(),
        fd_err: err_w.as_raw_fd(),
        fd_report: report.as_ref().map_or(-1, |(_, w)| w.as_raw_fd()),
        fd_join: join.as_ref().map_or(-1, |j| j.as_raw_fd()),
        errno: 0,
    };

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
    let ret = clone_child(&mut args, &mut ctx);
    if ret < 0 {
        let e = io::Error::from_raw_os_error(-ret as i32);
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT | libc::ENODEV) if cgroup.is_some() => LeafGone(e),
            Some(libc::ENOSYS | libc::EPERM | libc::EINVAL | libc::E2BIG | libc::EOPNOTSUPP | libc::EBADF) => {
                Unsupported(e)
            }
            _ => Failed(e),
        });
    }
    let pid = ret as i32;
    // SAFETY: the kernel returned a new pidfd in `pidfd`.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    drop((devnull, out_w, err_w, cgroup, join));
    // Under vfork the child has exec'd or exited by now and left its errno in `ctx`. With fork
    // semantics the report pipe ends at EOF once execve succeeded (CLOEXEC), or carries the errno.
    // SAFETY: the child no longer runs on this memory (vfork returned), or never shared it.
    let mut errno = unsafe { std::ptr::read_volatile(&ctx.errno) };
    if let Some((report_r, report_w)) = report {
        drop(report_w);
        let mut buf = [0u8; 4];
        let n = loop {
            match rustix::io::read(&report_r, &mut buf) {
                Err(e) if e == rustix::io::Errno::INTR => continue,
                r => break r.unwrap_or(0),
            }
        };
        if n == 4 {
            errno = i32::from_ne_bytes(buf);
        }
    }
    let mut child = RawChild { pid, pidfd: None, stdout: Some(out_r), stderr: Some(err_r), reaped: false };
    if errno != 0 {
        early.reaping();
        let _ = rustix::process::waitid(
            rustix::process::WaitId::PidFd(pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED,
        );
        child.reaped = true;
        return Err(Failed(io::Error::from_raw_os_error(errno)));
    }
    rustix::io::ioctl_fionbio(&pidfd, true).map_err(|e| Failed(e.into()))?;
    // SAFETY: the OwnedFd is moved into the AsyncFd and stays open, unchanged, until it is
    // dropped or taken back with into_inner.
    let afd = unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) };
    child.pidfd = Some(afd.map_err(|e| Failed(e.into()))?);
    Ok(child)
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

    #[tokio::test]
    async fn a_vanished_cgroup_leaf_is_reported_as_such_and_nothing_runs() {
        let d = tempfile::tempdir().unwrap();
        let marker_file = d.path().join("ran");
        let spec = SpawnSpec::new("/bin/touch", [marker_file.as_os_str()]);
        let gone = d.path().join("no-such-leaf");
        let early = EarlyPid::default();
        assert!(matches!(spawn(&spec, "np-test", Some(&gone), &early), Err(SpawnError::LeafGone(_))));
        assert!(!marker_file.exists());
        let mut child = spawn(&spec, "np-test", None, &early).unwrap();
        assert_eq!(early.pid.load(std::sync::atomic::Ordering::SeqCst), child.pid, "known before the spawn returned");
        assert!(child.wait().await.unwrap().success());
        assert!(marker_file.exists());
    }
}
