//! Race-free access to other processes through `/proc/<pid>` directory fds.
//!
//! Everything read about a process (its stat line, status, environ) is read through one open
//! directory fd, and signals are sent through that same fd with `pidfd_send_signal` (the kernel
//! accepts a `/proc/<pid>` dirfd as a pidfd). Once the process is gone the fd refers to nothing,
//! so a recycled PID can never be signalled by mistake.

use rustix::fd::OwnedFd;
use rustix::fs::{Mode, OFlags};
use rustix::process::Signal;
use std::io::{self, Read};

pub(crate) struct ProcHandle {
    pub pid: i32,
    dir: OwnedFd,
}

/// The fields of `/proc/<pid>/stat` we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    pub state: char,
    pub pgrp: i32,
    /// Field 22: start time in clock ticks since boot.
    pub start_time: u64,
}

/// Parse a `/proc/<pid>/stat` line. The command name may contain spaces and parentheses, so fields
/// are counted from the last `)`.
pub(crate) fn parse_stat(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: f.first()?.chars().next()?,
        pgrp: f.get(2)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
    })
}

impl ProcHandle {
    pub fn open(pid: i32) -> io::Result<ProcHandle> {
        if pid <= 0 {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        let dir = rustix::fs::open(
            format!("/proc/{pid}"),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(ProcHandle { pid, dir })
    }

    pub fn read(&self, name: &str) -> io::Result<Vec<u8>> {
        let fd = rustix::fs::openat(&self.dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
        // Most of these files fit in one read of this size.
        let mut out = Vec::with_capacity(1024);
        std::fs::File::from(fd).read_to_end(&mut out)?;
        Ok(out)
    }

    pub fn stat(&self) -> io::Result<Stat> {
        let raw = self.read("stat")?;
        parse_stat(&String::from_utf8_lossy(&raw))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable /proc stat"))
    }

    pub fn tgid(&self) -> io::Result<i32> {
        let raw = self.read("status")?;
        String::from_utf8_lossy(&raw)
            .lines()
            .find_map(|l| l.strip_prefix("Tgid:").and_then(|v| v.trim().parse().ok()))
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Tgid in /proc status"))
    }

    /// Whether the environment contains exactly the entry `key=value`.
    pub fn has_env(&self, entry: &[u8]) -> bool {
        self.read("environ").is_ok_and(|env| env.split(|b| *b == 0).any(|e| e == entry))
    }

    /// Live, not a zombie.
    pub fn alive(&self) -> bool {
        self.stat().is_ok_and(|s| !matches!(s.state, 'Z' | 'X' | 'x'))
    }

    pub fn signal(&self, sig: Signal) -> io::Result<()> {
        match rustix::process::pidfd_send_signal(&self.dir, sig) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::SRCH => Ok(()),
            // Kernels before 5.1 cannot signal through a /proc dirfd: check through it that the
            // process is still there (not yet reaped), then use kill(2). The window left is the
            // one every pre-pidfd supervisor has.
            Err(e) if e == rustix::io::Errno::NOSYS => {
                if self.stat().is_err() {
                    return Ok(());
                }
                match rustix::process::Pid::from_raw(self.pid) {
                    Some(p) => match rustix::process::kill_process(p, sig) {
                        Err(e) if e == rustix::io::Errno::SRCH => Ok(()),
                        r => r.map_err(Into::into),
                    },
                    None => Ok(()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// This boot's id (read once; it cannot change while we run).
/// This process as a Lease names it: the inode of its PID namespace, and its pid and start time
/// as `/proc` shows them (one view for both).
pub(crate) fn own_identity() -> io::Result<(u64, i32, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let ns = std::fs::metadata("/proc/self/ns/pid")?.ino();
    let line = std::fs::read_to_string("/proc/self/stat")?;
    let pid = line.split_whitespace().next().and_then(|p| p.parse().ok());
    let start = parse_stat(&line).map(|s| s.start_time);
    match (pid, start) {
        (Some(pid), Some(start)) => Ok((ns, pid, start)),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, "unparsable /proc/self/stat")),
    }
}

/// Whether the process `pid` that started at `start` (clock ticks since boot) still runs (not a
/// zombie): a pid reused by another process does not count.
pub(crate) fn running(pid: i32, start: u64) -> bool {
    ProcHandle::open(pid)
        .and_then(|p| p.stat())
        .is_ok_and(|s| s.start_time == start && !matches!(s.state, 'Z' | 'X' | 'x'))
}

pub(crate) fn boot_id() -> io::Result<String> {
    static BOOT_ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(b) = BOOT_ID.get() {
        return Ok(b.clone());
    }
    let b = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_string();
    Ok(BOOT_ID.get_or_init(|| b).clone())
}

/// Every numeric entry of /proc.
pub(crate) fn all_pids() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_command_names() {
        let line =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(parse_stat(line), Some(Stat { state: 'S', pgrp: 1234, start_time: 987654 }));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 1"), None);
    }

    #[test]
    fn reads_own_process() {
        let me = ProcHandle::open(std::process::id() as i32).unwrap();
        assert_eq!(me.tgid().unwrap(), std::process::id() as i32);
        assert!(me.alive());
        assert!(me.stat().unwrap().start_time > 0);
        assert_eq!(boot_id().unwrap().len(), 36);
    }
}
