//! The process tree of one run, behind one type: its cgroup when there is one (v2, or a v1 freezer
//! leaf), otherwise its process group plus every process that still carries the run's environment
//! marker (which also finds `setsid` escapees that kept their environment, but not one that
//! dropped both its session and its environment). Members are always opened through
//! `/proc/<pid>` dirfds and signalled through them.

use super::MARKER_ENV;
use super::cgroup::{self, Backend, Leaf};
use super::ladder::TreeOps;
use super::procfs::{self, ProcHandle};
use rustix::process::Signal;
use std::collections::HashSet;
use std::io;

impl TreeOps for Tree {
    fn request_stop(&self) -> io::Result<bool> {
        Tree::request_stop(self).map(|()| true)
    }
    fn kill(&self) -> io::Result<()> {
        Tree::kill(self)
    }
    fn is_empty(&self) -> bool {
        Tree::is_empty(self)
    }
    fn survivors(&self) -> usize {
        Tree::survivors(self)
    }
    fn leader_reaped(&self) {
        self.pgid.store(0, std::sync::atomic::Ordering::SeqCst);
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Tree {
    pub cgroup: Option<Leaf>,
    /// The run's process group id, only while its leader has not been reaped (so the id is ours);
    /// 0 afterwards. Shared by clones, so the ladder can retire it while it waits.
    pub pgid: std::sync::Arc<std::sync::atomic::AtomicI32>,
    pub marker: String,
}

impl Tree {
    pub fn new(cgroup: Option<Leaf>, pgid: Option<i32>, marker: String) -> Tree {
        Tree { cgroup, pgid: std::sync::Arc::new(std::sync::atomic::AtomicI32::new(pgid.unwrap_or(0))), marker }
    }

    fn marker_entry(&self) -> Vec<u8> {
        format!("{MARKER_ENV}={}", self.marker).into_bytes()
    }

    /// Live (non-zombie) members, each opened and checked through its dirfd.
    pub fn members(&self) -> Vec<ProcHandle> {
        if let Some(leaf) = &self.cgroup {
            return cgroup::procs(&leaf.dir)
                .into_iter()
                .filter_map(|pid| ProcHandle::open(pid).ok())
                .filter(|h| h.alive())
                .collect();
        }
        let entry = self.marker_entry();
        let me = std::process::id() as i32;
        procfs::all_pids()
            .into_iter()
            .filter(|pid| *pid != me)
            .filter_map(|pid| ProcHandle::open(pid).ok())
            .filter(|h| {
                let Ok(st) = h.stat() else { return false };
                if matches!(st.state, 'Z' | 'X' | 'x') {
                    return false;
                }
                let pgid = self.pgid.load(std::sync::atomic::Ordering::SeqCst);
                (pgid > 0 && st.pgrp == pgid) || h.has_env(&entry)
            })
            .collect()
    }

    /// Send `sig` to every member, repeating until a pass finds no member it has not signalled yet
    /// (so processes forked meanwhile are caught too). Returns how many were signalled.
    pub fn signal(&self, sig: Signal) -> io::Result<usize> {
        let mut seen: HashSet<(i32, u64)> = HashSet::new();
        for _ in 0..16 {
            let mut new = 0;
            for h in self.members() {
                let key = (h.pid, h.stat().map(|s| s.start_time).unwrap_or(0));
                if seen.insert(key) {
                    h.signal(sig)?;
                    new += 1;
                }
            }
            if new == 0 {
                break;
            }
        }
        Ok(seen.len())
    }

    /// SIGTERM then SIGCONT (so stopped processes can act on the SIGTERM).
    pub fn request_stop(&self) -> io::Result<()> {
        self.signal(Signal::TERM)?;
        self.signal(Signal::CONT)?;
        Ok(())
    }

    /// SIGKILL the whole tree: `cgroup.kill` where available; a v1 freezer leaf is frozen first
    /// (nothing in it can fork while each member is killed) and thawed after; else each member.
    pub fn kill(&self) -> io::Result<()> {
        match &self.cgroup {
            Some(Leaf { dir, backend: Backend::V2 }) => match cgroup::kill(dir) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            },
            Some(Leaf { dir, backend: Backend::V1Freezer }) => {
                let frozen = cgroup::freeze(dir);
                // Frozen or not (a task stuck in the kernel can hold the leaf in FREEZING), kill
                // every member, repeating until a pass finds no new one; always thaw, so that the
                // SIGKILLs take effect.
                let killed = self.signal(Signal::KILL).map(|_| ());
                let thawed = cgroup::thaw(dir);
                frozen?;
                killed?;
                return thawed;
            }
            None => {}
        }
        self.signal(Signal::KILL).map(|_| ())
    }

    pub fn is_empty(&self) -> bool {
        match &self.cgroup {
            Some(leaf) => !cgroup::populated(leaf),
            None => self.members().is_empty(),
        }
    }

    /// A cheap, possibly false-positive check after the leader exited by itself: the cgroup is
    /// populated, or a signal-0 probe of the leader's old group finds someone (zombies included).
    /// An empty cgroup is removed on the way (rmdir succeeds only on an empty cgroup, so it is
    /// the check itself in the common case).
    pub fn maybe_leftovers(&self, leader: i32) -> bool {
        match &self.cgroup {
            Some(leaf) => std::fs::remove_dir(&leaf.dir).is_err() && cgroup::populated(leaf),
            None => rustix::process::Pid::from_raw(leader)
                .is_some_and(|p| rustix::process::test_kill_process_group(p).is_ok()),
        }
    }

    pub fn survivors(&self) -> usize {
        self.members().len()
    }

    /// Remove the run's cgroup once it is empty.
    pub fn cleanup(&self) {
        if let Some(leaf) = &self.cgroup {
            cgroup::remove(&leaf.dir);
        }
    }
}
