//! Windows runs and their Job Objects: each run in a job of its own, stopped by the shared stop
//! ladder ([`super::ladder`]) with the same typed outcomes as on Linux.
//!
//! A run is created suspended, assigned to a new job, and only then resumed, so nothing it starts
//! can be born outside the job (a child spawned between the start and a late assignment would
//! escape a cancel). The job kills every process in it when its last handle closes
//! (`KILL_ON_JOB_CLOSE`): an agent that dies leaves no tree behind.
//!
//! The ladder: the graceful step, the grace period, `TerminateJobObject`, then the job's
//! `ActiveProcesses` must reach 0 within the kill timeout, else the run is
//! [`Outcome::Incomplete`]. The graceful step is a console Ctrl-C: each run gets a console of its
//! own, without a window (`CREATE_NO_WINDOW`), so an event on that console reaches the run's tree
//! and nothing else, and the agent needs no console at all. Only a process attached to
//! a console can raise an event on it, so a short-lived copy of the agent does it
//! ([`interrupt_console`], the binary's [`INTERRUPT_MODE`]): attach to the run's console, Ctrl-C
//! to every process on it, exit. (CTRL_BREAK to a process group sharing the agent's console is the
//! other way; Wine, where this is tested, implements only Ctrl-C.)
//!
//! A process that cannot join a job (no job could be made, or the assignment was refused) still
//! runs, alone: the ladder then ends the direct child only, and [`Run::job_error`] says why.
//!
//! [`super::windows`] builds the supervisor on these runs; what it does not have yet is listed in
//! `docs/windows.md`.

use super::ladder::{Leader, POLL, TreeOps, ladder};
use super::{Outcome, StopPolicy, StopReason};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::ffi::c_void;
use std::io;
use std::os::windows::io::RawHandle;
use std::os::windows::io::{AsRawHandle, FromRawHandle, OwnedHandle};
use std::os::windows::process::CommandExt;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};
use tokio::process::Child;
use windows_sys::Win32::Foundation::{DuplicateHandle, FILETIME, HANDLE, INVALID_HANDLE_VALUE, STILL_ACTIVE};
use windows_sys::Win32::System::Console::{
    AttachConsole, CTRL_C_EVENT, FreeConsole, GenerateConsoleCtrlEvent, SetConsoleCtrlHandler,
};
use windows_sys::Win32::System::Diagnostics::ToolHelp::{
    CreateToolhelp32Snapshot, TH32CS_SNAPTHREAD, THREADENTRY32, Thread32First, Thread32Next,
};
use windows_sys::Win32::System::JobObjects::{
    AssignProcessToJobObject, CreateJobObjectW, IsProcessInJob, JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE,
    JOBOBJECT_BASIC_ACCOUNTING_INFORMATION, JOBOBJECT_EXTENDED_LIMIT_INFORMATION, JobObjectBasicAccountingInformation,
    JobObjectExtendedLimitInformation, QueryInformationJobObject, SetInformationJobObject, TerminateJobObject,
};
use windows_sys::Win32::System::SystemServices::JOB_OBJECT_QUERY;
use windows_sys::Win32::System::Threading::{
    CREATE_NO_WINDOW, CREATE_SUSPENDED, DETACHED_PROCESS, GetCurrentProcess, GetExitCodeProcess, GetProcessTimes,
    OpenProcess, OpenThread, PROCESS_QUERY_INFORMATION, PROCESS_QUERY_LIMITED_INFORMATION, ResumeThread,
    THREAD_SUSPEND_RESUME,
};

/// The exit code `TerminateJobObject` gives every process of a stopped run.
pub const TERMINATED: u32 = 1;

fn owned(h: HANDLE) -> io::Result<OwnedHandle> {
    if h.is_null() || h == INVALID_HANDLE_VALUE {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: a valid handle just returned to us, owned by nothing else.
        Ok(unsafe { OwnedHandle::from_raw_handle(h) })
    }
}

fn check(ok: i32) -> io::Result<()> {
    if ok == 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A Job Object whose processes all end when its last handle closes.
#[derive(Debug)]
pub struct Job(OwnedHandle);

impl Job {
    /// A new, unnamed job with `KILL_ON_JOB_CLOSE`.
    pub fn new() -> io::Result<Job> {
        // SAFETY: no security attributes, no name.
        let job = Job(owned(unsafe { CreateJobObjectW(std::ptr::null(), std::ptr::null()) })?);
        job.set_limits(JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE)?;
        Ok(job)
    }

    /// Set the job's limit flags (and no other limit).
    fn set_limits(&self, flags: u32) -> io::Result<()> {
        let mut limits = JOBOBJECT_EXTENDED_LIMIT_INFORMATION::default();
        limits.BasicLimitInformation.LimitFlags = flags;
        // SAFETY: the structure and its size match the information class.
        check(unsafe {
            SetInformationJobObject(
                self.0.as_raw_handle(),
                JobObjectExtendedLimitInformation,
                (&raw const limits).cast::<c_void>(),
                size_of::<JOBOBJECT_EXTENDED_LIMIT_INFORMATION>() as u32,
            )
        })
    }

    /// Another handle to this job that may only query it (a job that refuses assignments, for
    /// tests of the lone-process fallback).
    pub fn query_only(&self) -> io::Result<Job> {
        let mut dup: HANDLE = std::ptr::null_mut();
        // SAFETY: duplicating our own valid handle within our own process.
        check(unsafe {
            DuplicateHandle(
                GetCurrentProcess(),
                self.0.as_raw_handle(),
                GetCurrentProcess(),
                &mut dup,
                JOB_OBJECT_QUERY,
                0,
                0,
            )
        })?;
        Ok(Job(owned(dup)?))
    }

    fn assign(&self, process: RawHandle) -> io::Result<()> {
        // SAFETY: both handles are valid for the call.
        check(unsafe { AssignProcessToJobObject(self.0.as_raw_handle(), process) })
    }

    /// Let the job's processes outlive its last handle (a daemon a run started on purpose, left
    /// alone as on Linux).
    pub fn release(&self) -> io::Result<()> {
        self.set_limits(0)
    }

    /// Whether the running process `pid` is in this job.
    pub fn contains(&self, pid: u32) -> io::Result<bool> {
        // SAFETY: the handle is owned below. (Wine wants the full query right here.)
        let h = owned(unsafe { OpenProcess(PROCESS_QUERY_INFORMATION, 0, pid) })?;
        let mut inside = 0;
        // SAFETY: valid process and job handles.
        check(unsafe { IsProcessInJob(h.as_raw_handle(), self.0.as_raw_handle(), &mut inside) })?;
        Ok(inside != 0)
    }

    /// How many processes of the job are still running (a run's console host among them, where
    /// the system puts it in the job).
    pub fn active_processes(&self) -> io::Result<u32> {
        let mut info = JOBOBJECT_BASIC_ACCOUNTING_INFORMATION::default();
        // SAFETY: the structure and its size match the information class.
        check(unsafe {
            QueryInformationJobObject(
                self.0.as_raw_handle(),
                JobObjectBasicAccountingInformation,
                (&raw mut info).cast::<c_void>(),
                size_of::<JOBOBJECT_BASIC_ACCOUNTING_INFORMATION>() as u32,
                std::ptr::null_mut(),
            )
        })?;
        Ok(info.ActiveProcesses)
    }

    /// End every process in the job.
    pub fn terminate(&self) -> io::Result<()> {
        // SAFETY: a valid job handle.
        check(unsafe { TerminateJobObject(self.0.as_raw_handle(), TERMINATED) })
    }
}

/// Resume every thread of the suspended process `pid` (a new process has one).
fn resume(pid: u32) -> io::Result<()> {
    // SAFETY: a snapshot of all threads; the handle is owned below.
    let snap = owned(unsafe { CreateToolhelp32Snapshot(TH32CS_SNAPTHREAD, 0) })?;
    let mut entry = THREADENTRY32 { dwSize: size_of::<THREADENTRY32>() as u32, ..Default::default() };
    let mut resumed = 0;
    // SAFETY: `entry` is a THREADENTRY32 with its size set, as both calls require.
    let mut more = unsafe { Thread32First(snap.as_raw_handle(), &mut entry) } != 0;
    while more {
        if entry.th32OwnerProcessID == pid {
            // SAFETY: a thread id from the snapshot; the handle is owned below.
            let thread = owned(unsafe { OpenThread(THREAD_SUSPEND_RESUME, 0, entry.th32ThreadID) })?;
            // SAFETY: a valid thread handle with THREAD_SUSPEND_RESUME.
            match unsafe { ResumeThread(thread.as_raw_handle()) } {
                u32::MAX => return Err(io::Error::last_os_error()),
                // It was running already: something started it before its job was in place.
                0 => return Err(io::Error::other(format!("process {pid} was not created suspended"))),
                _ => {}
            }
            resumed += 1;
        }
        // SAFETY: as above.
        more = unsafe { Thread32Next(snap.as_raw_handle(), &mut entry) } != 0;
    }
    if resumed == 0 {
        return Err(io::Error::other(format!("process {pid} has no thread to resume")));
    }
    Ok(())
}

/// A process's identity that survives the reuse of its id: the id and its creation time (100 ns
/// units since 1601, as `GetProcessTimes` gives it). What a PID record keeps on Windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub pid: u32,
    pub created: u64,
}

impl Identity {
    /// The identity of the running process `pid`; `None` when there is none (or it cannot be read).
    pub fn of(pid: u32) -> Option<Identity> {
        // SAFETY: the handle is owned below.
        let h = owned(unsafe { OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, 0, pid) }).ok()?;
        created(&h).ok().map(|created| Identity { pid, created })
    }

    /// Whether this very process still runs: its id names a process created at the same time that
    /// has not exited. A reused id names another process, and is not this one.
    pub fn alive(&self) -> bool {
        // SAFETY: the handle is owned below.
        let Ok(h) = owned(unsafe { OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, 0, self.pid) }) else {
            return false;
        };
        let mut code = 0u32;
        // SAFETY: a valid process handle with query rights.
        let running = unsafe { GetExitCodeProcess(h.as_raw_handle(), &mut code) } != 0 && code == STILL_ACTIVE as u32;
        running && created(&h).is_ok_and(|c| c == self.created)
    }
}

fn created(h: &impl AsRawHandle) -> io::Result<u64> {
    let (mut c, mut e, mut k, mut u) =
        (FILETIME::default(), FILETIME::default(), FILETIME::default(), FILETIME::default());
    // SAFETY: a valid process handle and four FILETIMEs to fill.
    check(unsafe { GetProcessTimes(h.as_raw_handle(), &mut c, &mut e, &mut k, &mut u) })?;
    Ok((u64::from(c.dwHighDateTime) << 32) | u64::from(c.dwLowDateTime))
}

/// A started process and the job that holds it and everything it starts.
#[derive(Debug)]
pub struct Run {
    child: Child,
    job: Option<Arc<Job>>,
    job_error: Option<String>,
    identity: Identity,
    reaped: Arc<AtomicBool>,
}

/// Start `cmd` in a new job of its own (see the module doc). `Err` when no process runs.
pub fn spawn(cmd: &mut tokio::process::Command) -> io::Result<Run> {
    spawn_in(cmd, Job::new())
}

/// [`spawn`] with the job given (or the error making one gave).
pub fn spawn_in(cmd: &mut tokio::process::Command, job: io::Result<Job>) -> io::Result<Run> {
    cmd.creation_flags(CREATE_SUSPENDED | CREATE_NO_WINDOW).kill_on_drop(false);
    let mut child = cmd.spawn()?;
    let (Some(pid), Some(handle)) = (child.id(), child.raw_handle()) else {
        return Err(io::Error::other("the new process has no id or handle"));
    };
    let (job, job_error) = match job.and_then(|j| j.assign(handle).map(|()| j)) {
        Ok(j) => (Some(Arc::new(j)), None),
        Err(e) => (None, Some(e.to_string())),
    };
    if let Err(e) = resume(pid) {
        // It never ran a single instruction: nothing else can exist.
        let _ = child.start_kill();
        return Err(e);
    }
    // SAFETY: the child's handle is valid while `child` lives, which outlasts this borrow.
    let created = created(&unsafe { std::os::windows::io::BorrowedHandle::borrow_raw(handle) }).unwrap_or(0);
    let identity = Identity { pid, created };
    Ok(Run { child, job, job_error, identity, reaped: Arc::new(AtomicBool::new(false)) })
}

impl Run {
    pub fn pid(&self) -> u32 {
        self.identity.pid
    }

    /// The process's identity, for its PID record.
    pub fn identity(&self) -> Identity {
        self.identity
    }

    /// Why the process runs without a job (its tree cannot be stopped or counted), if it does.
    pub fn job_error(&self) -> Option<&str> {
        self.job_error.as_deref()
    }

    /// The process's stdout and stderr, when `cmd` asked for pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Wait for the process to exit by itself (cancel-safe).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        let s = self.child.wait().await;
        self.reaped.store(true, Ordering::SeqCst);
        s
    }

    /// The run's job, when it has one.
    pub fn job(&self) -> Option<&Job> {
        self.job.as_deref()
    }

    /// How many processes of the run still run: the job's count, or the direct child alone when
    /// it has no job.
    pub fn active(&mut self) -> io::Result<u32> {
        self.tree().active()
    }

    /// The run's tree as the ladder sees it.
    pub(crate) fn tree(&self) -> JobTree {
        JobTree { job: self.job.clone(), pid: self.pid(), reaped: self.reaped.clone() }
    }

    /// Stop the run's whole tree through the ladder (see the module doc) and say how it ended.
    /// `close_pipes` runs once the ladder has gone past the graceful step.
    pub async fn stop(&mut self, reason: StopReason, policy: &StopPolicy, close_pipes: impl FnOnce()) -> Outcome {
        let tree = self.tree();
        ladder(&tree, Some(self), policy, reason, close_pipes).await
    }
}

impl Leader for Run {
    async fn wait(&mut self) -> io::Result<ExitStatus> {
        Run::wait(self).await
    }
    fn start_kill(&mut self) -> io::Result<()> {
        self.child.start_kill()
    }
}

/// A run's tree for the ladder: its job, or its direct child alone when it has none.
#[derive(Debug, Clone)]
pub(crate) struct JobTree {
    job: Option<Arc<Job>>,
    pid: u32,
    reaped: Arc<AtomicBool>,
}

impl JobTree {
    fn active(&self) -> io::Result<u32> {
        match &self.job {
            Some(j) => j.active_processes(),
            None => Ok(u32::from(!self.reaped.load(Ordering::SeqCst))),
        }
    }
}

impl TreeOps for JobTree {
    /// Ctrl-C on the run's console; `Ok(false)` when it cannot be raised (the ladder then goes
    /// straight to the kill).
    fn request_stop(&self) -> io::Result<bool> {
        match send_interrupt(self.pid) {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::warn!("cannot interrupt the console of process {} ({e}): no graceful step", self.pid);
                Ok(false)
            }
        }
    }
    /// `TerminateJobObject`; without a job the ladder kills the direct child itself.
    fn kill(&self) -> io::Result<()> {
        self.job.as_ref().map_or(Ok(()), |j| j.terminate())
    }
    fn is_empty(&self) -> bool {
        self.active().is_ok_and(|n| n == 0)
    }
    fn survivors(&self) -> usize {
        self.active().map_or(1, |n| n as usize)
    }
    fn leader_reaped(&self) {
        self.reaped.store(true, Ordering::SeqCst);
    }
}

/// The first argument that makes the `nodeplan` binary [`interrupt_console`] the pid after it.
pub const INTERRUPT_MODE: &str = "__interrupt-console";

/// How long the interrupting copy of the agent gets before it is killed and the step counts as
/// not sent.
const INTERRUPT_TIMEOUT: Duration = Duration::from_secs(5);

static INTERRUPTER: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// The program run as `<program> __interrupt-console <pid>` for the graceful step: the agent's own
/// binary unless set (once) here, as tests do.
pub fn set_interrupter(program: std::path::PathBuf) {
    let _ = INTERRUPTER.set(program);
}

/// Run the interrupter for the console of `pid` and wait (bounded) for it to say it was sent.
fn send_interrupt(pid: u32) -> io::Result<()> {
    let program = match INTERRUPTER.get() {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let mut child = Command::new(program)
        .args([INTERRUPT_MODE, &pid.to_string()])
        .creation_flags(DETACHED_PROCESS)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let end = Instant::now() + INTERRUPT_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            return if status.success() {
                Ok(())
            } else {
                Err(io::Error::other(format!("the interrupter exited with {status}")))
            };
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other("the interrupter did not finish"));
        }
        std::thread::sleep(POLL);
    }
}

/// Raise Ctrl-C on the console of process `pid`, for every process attached to it. This detaches
/// the calling process from its own console and ignores Ctrl-C in it: call it only from a process
/// that exists for this (the binary's [`INTERRUPT_MODE`]).
pub fn interrupt_console(pid: u32) -> io::Result<()> {
    // SAFETY: console calls on this process alone.
    unsafe {
        FreeConsole();
        check(AttachConsole(pid))?;
        check(SetConsoleCtrlHandler(None, 1))?;
        check(GenerateConsoleCtrlEvent(CTRL_C_EVENT, 0))?;
        FreeConsole();
    }
    Ok(())
}
