//! PID records: one small file per running process, created just before the spawn and removed only
//! once the process tree is gone, so a restarted agent can find what the previous one left behind
//! and verify it before touching it.
//!
//! The file is JSON lines: the record (pid 0 until the process exists), then, appended through the
//! descriptor kept open since its creation, `{"pid":…,"startTime":…}` once the spawn returned.
//! Neither write renames over an existing file (on ext4 that forces a writeback of the data on
//! every spawn) and neither is synced (see [`PidRecord::create`]); only [`PidRecord::rewrite`],
//! for a run that loses its cgroup before the spawn, replaces the file (temp file, rename). A
//! record torn by a crash in the middle of a write is harmless: a torn first line means the spawn
//! never happened (the record is written before it), and a torn update leaves pid 0, which
//! recovery handles by the run's cgroup and marker, never by number.

#[cfg(unix)]
use super::MARKER_ENV;
use super::Owner;
#[cfg(unix)]
use super::procfs::{self, ProcHandle};
use serde::{Deserialize, Serialize};
#[cfg(unix)]
use std::io::{self, Write};
#[cfg(unix)]
use std::os::unix::ffi::OsStrExt;
#[cfg(unix)]
use std::path::Path;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PidRecord {
    /// 0 while the process is being started (the record is written before the spawn).
    pub pid: i32,
    /// Field 22 of /proc/<pid>/stat.
    pub start_time: u64,
    pub boot_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
    /// The value of `NODEPLAN_RUN` in the process's environment.
    pub marker: String,
    /// What the process belongs to, chosen by the caller (e.g. `apply:<checksum>:3`); kept as its
    /// text form. Any text is read (an owner this build does not write is an unknown [`Owner`]).
    pub owner: Owner,
    #[serde(default)]
    pub command: String,
}

/// The line appended once the process exists.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PidUpdate {
    pid: i32,
    start_time: u64,
}

#[cfg(unix)]
/// A record file being kept: its path and the open descriptor its update is appended to.
#[derive(Debug)]
pub struct RecordFile {
    path: PathBuf,
    file: std::fs::File,
}

#[cfg(unix)]
impl RecordFile {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append the pid and its start time (one `write`).
    pub fn set_pid(&mut self, pid: i32, start_time: u64) -> io::Result<()> {
        self.file.write_all(&json_line(&PidUpdate { pid, start_time })?)
    }
}

#[cfg(unix)]
/// The record's first line: its JSON with the format (R25), and a newline.
fn record_line(r: &PidRecord) -> io::Result<Vec<u8>> {
    let v = serde_json::to_value(r).map_err(io::Error::other)?;
    json_line(&crate::formats::stamp(v, crate::formats::PID_RECORD))
}

#[cfg(unix)]
/// One line of the record file: compact JSON and a newline.
fn json_line<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(v).map_err(io::Error::other)?;
    line.push(b'\n');
    Ok(line)
}

#[cfg(unix)]
/// Whether a record still describes a live process of ours.
#[derive(Debug)]
pub(crate) enum Identity {
    /// The leader is alive and is the process the record describes.
    Match,
    /// There is no such process (any more).
    Gone,
    /// The pid belongs to another process now; it must never be signalled.
    Mismatch(String),
}

impl PidRecord {
    pub fn file_name(marker: &str) -> String {
        format!("{marker}.json")
    }

    /// "pid 42 (/bin/sh)", or for a record written just before its spawn, the run marker instead.
    pub fn describe(&self) -> String {
        match self.pid {
            0 => format!("run {} ({}, its pid not recorded yet)", self.marker, self.command),
            pid => format!("pid {pid} ({})", self.command),
        }
    }

    /// One record: a JSON object (the first line), then optional `{"pid","startTime"}` updates.
    /// A torn last update (the agent died while appending it) is ignored.
    pub fn parse(raw: &[u8]) -> Result<PidRecord, String> {
        let mut values = serde_json::Deserializer::from_slice(raw).into_iter::<serde_json::Value>();
        let first = match values.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => return Err(format!("malformed PID record: {e}")),
            None => return Err("malformed PID record: the file is empty".into()),
        };
        crate::formats::check(&first, "PID record", crate::formats::PID_RECORD)?;
        let mut r: PidRecord = serde_json::from_value(first).map_err(|e| format!("malformed PID record: {e}"))?;
        for v in values {
            let update: PidUpdate = match v {
                Ok(v) => serde_json::from_value(v).map_err(|e| format!("malformed PID record update: {e}"))?,
                Err(e) if e.is_eof() => break,
                Err(e) => return Err(format!("malformed PID record update: {e}")),
            };
            r.pid = update.pid;
            r.start_time = update.start_time;
        }
        if r.pid < 0 {
            return Err(format!("malformed PID record: pid {} is negative", r.pid));
        }
        // The marker names the run's cgroup leaf under the agent's root: one plain path component.
        if r.marker.is_empty()
            || r.marker.starts_with('.')
            || !r.marker.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        {
            return Err(format!("malformed PID record: bad marker {:?}", r.marker));
        }
        Ok(r)
    }
}

#[cfg(unix)]
impl PidRecord {
    /// Create the record file (it must not exist yet) and keep it open for [`RecordFile::set_pid`].
    /// Deliberately no fsync: a record only means something within the boot it was written in (its
    /// boot id is checked), and the page cache survives an agent crash, so an fsync would only
    /// protect against a power loss after which every record is stale anyway. It would also put a
    /// disk flush on the critical path of every spawn.
    pub fn create(&self, dir: &Path) -> io::Result<RecordFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(Self::file_name(&self.marker));
        let line = record_line(self)?;
        let open = || std::fs::OpenOptions::new().append(true).create_new(true).mode(0o600).open(&path);
        let mut file = match open() {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir)?;
                open()?
            }
            r => r?,
        };
        if let Err(e) = file.write_all(&line) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        Ok(RecordFile { path, file })
    }

    /// Write the whole record again under its name (temp file, rename), e.g. when the cgroup
    /// changed before the spawn.
    pub fn rewrite(&self, file: &mut RecordFile) -> io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = file.path.parent().unwrap_or(Path::new("."));
        // An unguessable name, created exclusively: nothing planted in the directory is followed.
        let name = crate::safefs::temp_name(std::ffi::OsStr::new(&Self::file_name(&self.marker)))?;
        let tmp = dir.join(std::ffi::OsStr::from_bytes(&name));
        let line = record_line(self)?;
        let result = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&line)?;
            std::fs::rename(&tmp, &file.path)?;
            Ok(f)
        })();
        match result {
            Ok(f) => {
                file.file = f;
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Every `*.json` record in `dir` (see [`scan`]), parsed or with the reason it could not be
    /// used; nothing when the directory itself is refused.
    pub fn load_all(dir: &Path) -> Vec<(PathBuf, Result<PidRecord, String>)> {
        scan(dir)
            .unwrap_or_default()
            .into_iter()
            .map(|(p, e)| {
                let r = match e {
                    Entry::Record(r) => Ok(r),
                    Entry::Invalid(e) | Entry::Untrusted(e) => Err(e),
                };
                (p, r)
            })
            .collect()
    }

    /// The nodeplan process that started this record's run (the agent, `apply` or `supervise`),
    /// when it is still running and is not this process: the pid and start time its marker begins
    /// with (`np<pid>.<start time hex>-…`), checked against `/proc/<pid>`, within the record's
    /// boot. `None` for a marker without a start time (earlier versions), which cannot be verified.
    pub(crate) fn live_owner(&self) -> Option<i32> {
        let (pid, Some(start)) = marker_owner(&self.marker)? else { return None };
        if pid as u32 == std::process::id() || procfs::boot_id().ok()? != self.boot_id {
            return None;
        }
        let st = ProcHandle::open(pid).and_then(|h| h.stat()).ok()?;
        (st.start_time == start && !matches!(st.state, 'Z' | 'X' | 'x')).then_some(pid)
    }

    /// Verify through `/proc/<pid>` opened as a directory: same boot, same tgid, same start time,
    /// and our marker in its environment.
    pub(crate) fn verify(&self) -> Identity {
        match procfs::boot_id() {
            Ok(b) if b == self.boot_id => {}
            Ok(_) => return Identity::Gone,
            Err(e) => return Identity::Mismatch(format!("cannot read boot id: {e}")),
        }
        if self.pid == 0 {
            return Identity::Gone;
        }
        let h = match ProcHandle::open(self.pid) {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Identity::Gone,
            Err(e) => return Identity::Mismatch(format!("cannot open /proc/{}: {e}", self.pid)),
        };
        let check = || -> Result<Identity, String> {
            let tgid = h.tgid().map_err(|e| e.to_string())?;
            if tgid != self.pid {
                return Ok(Identity::Mismatch(format!("pid {} is a thread of {tgid}", self.pid)));
            }
            let st = h.stat().map_err(|e| e.to_string())?;
            if st.start_time != self.start_time {
                return Ok(Identity::Mismatch(format!(
                    "pid {} started at tick {}, the record says {}",
                    self.pid, st.start_time, self.start_time
                )));
            }
            if matches!(st.state, 'Z' | 'X' | 'x') {
                return Ok(Identity::Gone);
            }
            if !h.has_env(format!("{MARKER_ENV}={}", self.marker).as_bytes()) {
                return Ok(Identity::Mismatch(format!("pid {} does not carry marker {}", self.pid, self.marker)));
            }
            Ok(Identity::Match)
        };
        match check() {
            Ok(i) => i,
            Err(_) if !h.alive() => Identity::Gone,
            Err(e) => Identity::Mismatch(e),
        }
    }
}

#[cfg(unix)]
/// The pid and (when present) start time of the nodeplan process that made a run marker or
/// cgroup leaf name: `np<pid>.<start time hex>-…`, or `np<pid>-…` from earlier versions.
pub(crate) fn marker_owner(marker: &str) -> Option<(i32, Option<u64>)> {
    let head = marker.strip_prefix("np")?.split('-').next()?;
    match head.split_once('.') {
        Some((p, s)) => Some((p.parse().ok()?, Some(u64::from_str_radix(s, 16).ok()?))),
        None => Some((head.parse().ok()?, None)),
    }
}

#[cfg(unix)]
/// One `*.json` entry of the PID directory.
#[derive(Debug)]
pub(crate) enum Entry {
    Record(PidRecord),
    /// A trusted file that does not parse (e.g. torn by a crash before its spawn).
    Invalid(String),
    /// Not a file the agent can have written (a symbolic link, not a regular file, another
    /// owner, writable by group or others): its content is not read.
    Untrusted(String),
}

#[cfg(unix)]
/// Whether a file or directory with this owner and mode can only have been written by the agent's
/// own user: owned by the effective uid, not writable by group or others.
fn trusted(st: &rustix::fs::Stat) -> Result<(), String> {
    crate::safefs::own_only(st.st_uid, st.st_mode)
}

#[cfg(unix)]
/// Read the PID directory without trusting anything in it that the agent's user did not write:
/// the directory must be owned by the effective uid and not writable by group or others (`Err`
/// with one line otherwise; a missing directory holds no records). Each `*.json` entry is opened
/// through the directory fd without following symbolic links and must be a regular file passing
/// the same owner and mode check; only then is it read and parsed.
pub(crate) fn scan(dir: &Path) -> Result<Vec<(PathBuf, Entry)>, String> {
    use rustix::fs::{FileType, Mode, OFlags};
    let dfd = match rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(Vec::new()),
        Err(e) => return Err(format!("PID directory {}: cannot open it: {}", dir.display(), io::Error::from(e))),
    };
    let st = rustix::fs::fstat(&dfd).map_err(|e| format!("PID directory {}: {}", dir.display(), io::Error::from(e)))?;
    trusted(&st).map_err(|why| {
        format!(
            "PID directory {} {why}; its records are refused until it is fixed (nothing was signalled)",
            dir.display()
        )
    })?;
    let mut names: Vec<std::ffi::OsString> = Vec::new();
    let rd = rustix::fs::Dir::read_from(&dfd)
        .map_err(|e| format!("PID directory {}: cannot list it: {}", dir.display(), io::Error::from(e)))?;
    for e in rd {
        let e = e.map_err(|e| format!("PID directory {}: cannot list it: {}", dir.display(), io::Error::from(e)))?;
        let name = std::ffi::OsStr::from_bytes(e.file_name().to_bytes());
        if Path::new(name).extension().is_some_and(|x| x == "json") {
            names.push(name.to_os_string());
        }
    }
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let path = dir.join(&name);
        let refuse = |why: String| {
            Entry::Untrusted(format!(
                "PID record {} {why}; refused (nothing was signalled, the record is kept)",
                path.display()
            ))
        };
        // O_NONBLOCK: a FIFO planted under a record's name must not hang the open.
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let entry = match rustix::fs::openat(&dfd, name.as_os_str(), flags, Mode::empty()) {
            Err(rustix::io::Errno::LOOP) => refuse("is a symbolic link".into()),
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => refuse(format!("cannot be opened: {}", io::Error::from(e))),
            Ok(fd) => match rustix::fs::fstat(&fd) {
                Err(e) => refuse(format!("cannot be examined: {}", io::Error::from(e))),
                Ok(st) if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile => {
                    refuse("is not a regular file".into())
                }
                Ok(st) => match trusted(&st) {
                    Err(why) => refuse(why),
                    Ok(()) => {
                        let mut raw = Vec::new();
                        match std::io::Read::read_to_end(&mut std::fs::File::from(fd), &mut raw) {
                            Err(e) => Entry::Invalid(format!("cannot read: {e}")),
                            Ok(_) => match PidRecord::parse(&raw) {
                                Ok(r) => Entry::Record(r),
                                Err(e) => Entry::Invalid(e),
                            },
                        }
                    }
                },
            },
        };
        out.push((path, entry));
    }
    Ok(out)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// R25: records carry their format; a newer one is refused (kept, its plan held), never read
    /// with a guess.
    #[test]
    fn records_carry_their_format_and_a_newer_one_is_refused() {
        let r = PidRecord {
            pid: 0,
            start_time: 0,
            boot_id: "b".into(),
            cgroup: None,
            marker: "np1.2".into(),
            owner: Owner::apply("abc"),
            command: "sh".into(),
        };
        let line = record_line(&r).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["nodeplanFormat"], crate::formats::PID_RECORD);
        assert_eq!(PidRecord::parse(&line).unwrap(), r);
        let mut newer = v.clone();
        newer["nodeplanFormat"] = 2.into();
        let e = PidRecord::parse(&serde_json::to_vec(&newer).unwrap()).unwrap_err();
        assert!(e.contains("PID record written by a newer nodeplan (format 2"), "{e}");
    }

    #[test]
    fn bad_records_give_one_clear_error() {
        for raw in [
            &b"{"[..],
            b"[]",
            br#"{"pid":-3,"startTime":1,"bootId":"b","marker":"m","owner":"o"}"#,
            br#"{"pid":5,"startTime":1,"bootId":"b","marker":"../x","owner":"o"}"#,
            br#"{"pid":5,"startTime":1,"bootId":"b","marker":"..","owner":"o"}"#,
            br#"{"pid":5,"startTime":1,"bootId":"b","marker":"a b","owner":"o"}"#,
            br#"{"pid":"5"}"#,
        ] {
            let e = PidRecord::parse(raw).unwrap_err();
            assert!(e.starts_with("malformed PID record"), "{e}");
        }
        let ok = PidRecord::parse(br#"{"pid":5,"startTime":1,"bootId":"b","marker":"m","owner":"o"}"#).unwrap();
        assert_eq!(ok.pid, 5);
    }

    /// A record is never refused for its owner: any text is read, and written back unchanged.
    #[test]
    fn any_owner_text_is_read_and_written_back_unchanged() {
        let cs = "440b2eb0b6bdd3b7eea28188e7b15ae147842a7d65359938a4d1961952971213";
        let (remote, garbled) = (format!("remote:{cs}:p1"), format!("apply:{cs}:x"));
        for owner in ["local:/p/a.plan:0", &remote, "supervise:web", "", "garbage", "local:", &garbled] {
            let raw = format!(r#"{{"pid":5,"startTime":1,"bootId":"b","marker":"m","owner":{owner:?}}}"#);
            let r = PidRecord::parse(raw.as_bytes()).unwrap();
            assert_eq!(r.owner.to_string(), owner);
            assert_eq!(serde_json::to_value(&r).unwrap()["owner"], owner);
        }
    }

    fn sample() -> PidRecord {
        PidRecord {
            pid: 0,
            start_time: 0,
            boot_id: "b".into(),
            cgroup: None,
            marker: "np1-2-3".into(),
            owner: Owner::supervise("o"),
            command: "sh".into(),
        }
    }

    #[test]
    fn a_record_is_created_once_then_gets_its_pid_appended() {
        let d = tempfile::tempdir().unwrap();
        let mut f = sample().create(d.path().join("sub").as_path()).unwrap();
        let before = PidRecord::parse(&std::fs::read(f.path()).unwrap()).unwrap();
        assert_eq!((before.pid, before.start_time), (0, 0), "pid 0 until the process exists");
        assert!(sample().create(&d.path().join("sub")).is_err(), "never replaces a live record");
        f.set_pid(42, 4242).unwrap();
        let raw = std::fs::read(f.path()).unwrap();
        let after = PidRecord::parse(&raw).unwrap();
        assert_eq!(after, PidRecord { pid: 42, start_time: 4242, ..sample() });
        // A crash while appending leaves a torn last line: the record is still read, without it.
        let torn = [&raw[..], br#"{"pid":99,"sta"#].concat();
        assert_eq!(PidRecord::parse(&torn).unwrap().pid, 42);
        let mut bad = raw.clone();
        bad.extend_from_slice(b"[1]\n");
        assert!(PidRecord::parse(&bad).unwrap_err().starts_with("malformed PID record update"));
        assert!(PidRecord::parse(b"").unwrap_err().contains("empty"));
        // The pretty-printed single-object form of earlier versions still parses.
        let pretty = serde_json::to_vec_pretty(&after).unwrap();
        assert_eq!(PidRecord::parse(&pretty).unwrap(), after);
    }

    #[test]
    fn rewrite_replaces_the_record_and_keeps_appending_to_the_new_file() {
        let d = tempfile::tempdir().unwrap();
        let mut f = sample().create(d.path()).unwrap();
        let moved = PidRecord { cgroup: None, owner: Owner::supervise("changed"), ..sample() };
        moved.rewrite(&mut f).unwrap();
        f.set_pid(7, 70).unwrap();
        let r = PidRecord::parse(&std::fs::read(f.path()).unwrap()).unwrap();
        assert_eq!((r.owner.to_string().as_str(), r.pid, r.start_time), ("supervise:changed", 7, 70));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "no temp file left");
    }
}
