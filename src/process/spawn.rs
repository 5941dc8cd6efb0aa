//! Spawning straight into a cgroup: `clone3(CLONE_INTO_CGROUP | CLONE_PIDFD)` with fork
//! semantics, so the child is born in its leaf (no migration, which costs far more than the spawn
//! itself) and comes with a pidfd. Between the clone and `execve` the child only makes
//! async-signal-safe system calls on memory prepared before the clone: dup2, setpgid, chdir,
//! sigaction, sigprocmask, execve, write, _exit. [`RawChild`] owns the child: it waits through the
//! pidfd (readable when the process ends) and reaps with `waitid(P_PIDFD)`.

use super::SpawnSpec;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use tokio::io::unix::AsyncFd;

const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

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
    Failed(io::Error),
}

/// Start `spec` (with the run marker in its environment) in its own process group, inside the
/// cgroup `cgroup_dir`.
pub(crate) fn spawn(spec: &SpawnSpec, marker: &str, cgroup_dir: &Path) -> Result<RawChild, SpawnError> {
    use SpawnError::{Failed, Unsupported};
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
    let cgroup = rustix::fs::open(
        cgroup_dir,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| Unsupported(e.into()))?;
    let devnull = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| Failed(e.into()))?;
    let (out_r, out_w) = pipe().map_err(Failed)?;
    let (err_r, err_w) = pipe().map_err(Failed)?;
    let (report_r, report_w) = pipe().map_err(Failed)?;
    let (fd_null, fd_out, fd_err, fd_report) =
        (devnull.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd(), report_w.as_raw_fd());
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: initialising a local sigset.
    unsafe { libc::sigemptyset(&mut empty) };

    let mut pidfd: libc::c_int = -1;
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP | libc::CLONE_PIDFD as u64,
        pidfd: &mut pidfd as *mut libc::c_int as u64,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cgroup.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: clone3 with fork semantics (no CLONE_VM, no new stack). In the child only
    // async-signal-safe system calls on memory prepared above run before execve or _exit.
    let ret = unsafe { libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if ret == 0 {
        unsafe {
            let fail = |fd: libc::c_int| -> ! {
                let e = *libc::__errno_location();
                libc::write(fd, (&e as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>());
                libc::_exit(127)
            };
            if libc::dup2(fd_null, 0) < 0 || libc::dup2(fd_out, 1) < 0 || libc::dup2(fd_err, 2) < 0 {
                fail(fd_report);
            }
            if libc::setpgid(0, 0) < 0 {
                fail(fd_report);
            }
            if let Some(c) = &cwd_c
                && libc::chdir(c.as_ptr()) < 0
            {
                fail(fd_report);
            }
            // As std does: default SIGPIPE (Rust ignores it in the agent) and no blocked signals.
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            libc::execve(program_c.as_ptr(), argv.as_ptr(), envp.as_ptr());
            fail(fd_report);
        }
    }
    if ret < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOSYS | libc::EPERM | libc::EINVAL | libc::E2BIG | libc::EOPNOTSUPP | libc::EBADF) => {
                Unsupported(e)
            }
            _ => Failed(e),
        });
    }
    let pid = ret as i32;
    // SAFETY: the kernel returned a new pidfd in `pidfd`.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    drop((devnull, out_w, err_w, report_w, cgroup));
    // The report pipe ends at EOF once execve succeeded (CLOEXEC), or carries the child's errno.
    let mut buf = [0u8; 4];
    let n = loop {
        match rustix::io::read(&report_r, &mut buf) {
            Err(e) if e == rustix::io::Errno::INTR => continue,
            r => break r.unwrap_or(0),
        }
    };
    let mut child = RawChild { pid, pidfd: None, stdout: Some(out_r), stderr: Some(err_r), reaped: false };
    if n == 4 {
        let _ = rustix::process::waitid(
            rustix::process::WaitId::PidFd(pidfd.as_fd()),
            rustix::process::WaitIdOptions::EXITED,
        );
        child.reaped = true;
        return Err(Failed(io::Error::from_raw_os_error(i32::from_ne_bytes(buf))));
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
