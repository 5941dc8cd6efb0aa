//! PID records: one small JSON file per running process, written atomically right after spawn and
//! removed only once the process tree is gone, so a restarted agent can find what the previous one
//! left behind and verify it before touching it.

use super::procfs::{self, ProcHandle};
use super::tree::MARKER_ENV;
use serde::{Deserialize, Serialize};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

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
    /// What the process belongs to, chosen by the caller (e.g. `plan:<checksum>:3`).
    pub owner: String,
    #[serde(default)]
    pub command: String,
}

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

    /// Write atomically: temp file, then rename over the final name, so a reader sees either no
    /// record or a whole one. Deliberately no fsync: a record only means something within the boot
    /// it was written in (its boot id is checked), and the page cache survives an agent crash, so
    /// an fsync would only protect against a power loss after which every record is stale anyway.
    /// It would also put a disk flush on the critical path of every spawn.
    pub fn write(&self, dir: &Path) -> io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(Self::file_name(&self.marker));
        let json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        write_file(&path, &json, 0o600, false)?;
        Ok(path)
    }

    pub fn parse(raw: &[u8]) -> Result<PidRecord, String> {
        let r: PidRecord = serde_json::from_slice(raw).map_err(|e| format!("malformed PID record: {e}"))?;
        if r.pid < 0 {
            return Err(format!("malformed PID record: pid {} is negative", r.pid));
        }
        if r.marker.is_empty() || r.marker.contains(['/', '\0']) {
            return Err(format!("malformed PID record: bad marker {:?}", r.marker));
        }
        Ok(r)
    }

    /// Every `*.json` record in `dir`, parsed or with the reason it could not be.
    pub fn load_all(dir: &Path) -> Vec<(PathBuf, Result<PidRecord, String>)> {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        paths
            .into_iter()
            .map(|p| {
                let r = std::fs::read(&p).map_err(|e| format!("cannot read: {e}")).and_then(|b| PidRecord::parse(&b));
                (p, r)
            })
            .collect()
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

/// Temp file in the same directory, fsync, rename over `path`, fsync the directory.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_file(path, data, mode, true)
}

fn write_file(path: &Path, data: &[u8], mode: u32, durable: bool) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(data)?;
        if durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if durable {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_records_give_one_clear_error() {
        for raw in [
            &b"{"[..],
            b"[]",
            br#"{"pid":-3,"startTime":1,"bootId":"b","marker":"m","owner":"o"}"#,
            br#"{"pid":5,"startTime":1,"bootId":"b","marker":"../x","owner":"o"}"#,
            br#"{"pid":"5"}"#,
        ] {
            let e = PidRecord::parse(raw).unwrap_err();
            assert!(e.starts_with("malformed PID record"), "{e}");
        }
        let ok = PidRecord::parse(br#"{"pid":5,"startTime":1,"bootId":"b","marker":"m","owner":"o"}"#).unwrap();
        assert_eq!(ok.pid, 5);
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
