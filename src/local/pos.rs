//! The `.pos` position file beside each local plan, and the control files (`NAME.paused`,
//! `NAME.canceled`, `NAME.reset`).
//!
//! `.pos` keeps system-agent's fields (`appliedChecksum`, `output`, `probeStatus`,
//! `periodicOutput`, all omitted when empty) and adds the plan-state flow: the state and the
//! checksum it belongs to, the checkpoint, and the counters, with the same meaning as the Secret
//! keys of remote mode.

use crate::plan::{Checkpoint, PlanState, ProbeStatus};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn is_zero(v: &i64) -> bool {
    *v == 0
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Pos {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub applied_checksum: String,
    /// gzip JSON of the one-time outputs of the last successful apply (base64 on the wire).
    #[serde(with = "crate::plan::b64_bytes", skip_serializing_if = "Vec::is_empty")]
    pub output: Vec<u8>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub probe_status: BTreeMap<String, ProbeStatus>,
    #[serde(with = "crate::plan::b64_bytes", skip_serializing_if = "Vec::is_empty")]
    pub periodic_output: Vec<u8>,
    /// nodeplan: the plan-state of the plan whose checksum is `planChecksum`.
    #[serde(skip_serializing_if = "Option::is_none", with = "crate::plan::optional_state")]
    pub plan_state: Option<PlanState>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub plan_checksum: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
    #[serde(skip_serializing_if = "is_zero")]
    pub failure_count: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub success_count: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub failed_checksum: String,
    #[serde(with = "crate::plan::b64_bytes", skip_serializing_if = "Vec::is_empty")]
    pub failed_output: Vec<u8>,
    /// Go `UnixDate` of the last one-time attempt.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub last_apply_time: String,
    /// What made the plan of `failedChecksum` fail (nodeplan's own field; cleared at a success).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<crate::plan::Failure>,
    /// A human-readable reason the plan is blocked (a leftover process could not be stopped).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub blocked: String,
    /// `nodeplanFormat` (R25): set by [`write_pos`]; 0 in memory (a read `.pos` of a format this
    /// build knows is held as the current one).
    #[serde(rename = "nodeplanFormat", skip_serializing_if = "is_zero_u64")]
    pub format: u64,
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// The files that belong to one plan file `DIR/NAME.plan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanFiles {
    pub plan: PathBuf,
    pub name: String,
}

impl PlanFiles {
    /// `None` when the path does not end in `.plan`.
    pub fn new(plan: &Path) -> Option<PlanFiles> {
        let file = plan.file_name()?.to_str()?;
        let name = file.strip_suffix(".plan")?.to_string();
        Some(PlanFiles { plan: plan.to_path_buf(), name })
    }
    fn sibling(&self, ext: &str) -> PathBuf {
        self.plan.with_file_name(format!("{}.{ext}", self.name))
    }
    pub fn pos(&self) -> PathBuf {
        self.sibling("pos")
    }
    pub fn paused(&self) -> PathBuf {
        self.sibling("paused")
    }
    pub fn canceled(&self) -> PathBuf {
        self.sibling("canceled")
    }
    pub fn reset(&self) -> PathBuf {
        self.sibling("reset")
    }
}

/// Parse a `.pos` file; the error is one line.
pub fn parse_pos(raw: &[u8]) -> Result<Pos, String> {
    parse_checked(raw).map_err(|e| e.to_string())
}

/// [`parse_pos`], telling a newer format (held: [`PosError::Unusable`]) from a damaged file.
fn parse_checked(raw: &[u8]) -> Result<Pos, PosError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(Pos::default());
    }
    let malformed = |e: String| PosError::Malformed(format!("malformed .pos file: {e}"));
    let v: serde_json::Value = serde_json::from_slice(raw).map_err(|e| malformed(e.to_string()))?;
    if !v.is_object() {
        return Err(malformed("expected a JSON object".into()));
    }
    crate::formats::check(&v, ".pos file", crate::formats::POS).map_err(PosError::Unusable)?;
    let pos: Pos = serde_json::from_value(v).map_err(|e| malformed(e.to_string()))?;
    // Read in, every format this build knows is the current one.
    Ok(Pos { format: 0, ..pos })
}

/// The most a `.pos` file may hold (outputs are capped and gzipped, so real ones are far smaller).
pub const POS_CAP: u64 = 32 << 20;
/// The most a control file may hold: a value is `true` or `false`.
pub const CONTROL_CAP: u64 = 4096;

/// Why a `.pos` file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PosError {
    /// Not a regular file, a link, too large, or unreadable: someone put it there; the plan is
    /// held until it is removed (nothing is run or written over it).
    #[error("cannot use: {0}")]
    Unusable(String),
    /// A regular file that does not parse: kept aside, the plan starts over.
    #[error("{0}")]
    Malformed(String),
}

/// Read a `.pos` file (absent → empty), never following a link or blocking (see
/// [`crate::safefs::read_small`]).
pub fn read_pos(path: &Path) -> Result<Pos, PosError> {
    match crate::safefs::read_small(path, POS_CAP) {
        Ok(Some(raw)) => parse_checked(&raw),
        Ok(None) => Ok(Pos::default()),
        Err(e) => Err(PosError::Unusable(e.to_string())),
    }
}

/// Serialise and write atomically (mode 0600) when the bytes differ from what is there.
pub fn write_pos(path: &Path, pos: &Pos) -> std::io::Result<bool> {
    let stamped = Pos { format: crate::formats::POS, ..pos.clone() };
    let bytes = serde_json::to_vec(&stamped).map_err(std::io::Error::other)?;
    crate::safefs::write_file(path, &bytes, 0o600, None)
}

/// What `nodeplan plan pause|cancel` writes to `NAME.paused` / `NAME.canceled`: `true` (R1, R16).
pub const CONTROL_TRUE: &[u8] = b"true\n";
/// What `nodeplan plan reset` writes to `NAME.reset`: the file being there is the request.
pub const RESET_REQUEST: &[u8] = b"";

/// Read a control file: absent → `None`; empty → `"true"`; otherwise the content less one
/// trailing newline (validated later, as an annotation value would be). A file that is not a
/// regular file, is a link, or is larger than [`CONTROL_CAP`] is an error naming the file.
pub fn read_control(path: &Path) -> Result<Option<String>, String> {
    match crate::safefs::read_small(path, CONTROL_CAP) {
        Ok(Some(raw)) => Ok(Some(control_value(raw))),
        Ok(None) => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// What the agent reads beside a plan: the file counts only when it passes the plan file's owner
/// and mode rule ([`super::trust::owner_and_mode`]); one that does not is ignored (as if absent)
/// and its path and reason are added to `ignored`.
fn read_sibling(path: &Path, cap: u64, ignored: &mut Vec<String>) -> std::io::Result<Option<Vec<u8>>> {
    match crate::safefs::read_small_checked(path, cap, super::trust::owner_and_mode)? {
        Some(Ok(raw)) => Ok(Some(raw)),
        Some(Err(why)) => {
            ignored.push(format!("{} {why}", path.display()));
            Ok(None)
        }
        None => Ok(None),
    }
}

/// [`read_pos`] as the agent reads it: a `.pos` that fails the owner and mode rule is ignored.
pub fn read_pos_trusted(path: &Path, ignored: &mut Vec<String>) -> Result<Pos, PosError> {
    match read_sibling(path, POS_CAP, ignored) {
        Ok(Some(raw)) => parse_checked(&raw),
        Ok(None) => Ok(Pos::default()),
        Err(e) => Err(PosError::Unusable(e.to_string())),
    }
}

/// [`read_control`] as the agent reads it: a control file that fails the owner and mode rule is
/// ignored.
pub fn read_control_trusted(path: &Path, ignored: &mut Vec<String>) -> Result<Option<String>, String> {
    match read_sibling(path, CONTROL_CAP, ignored) {
        Ok(raw) => Ok(raw.map(control_value)),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Whether a reset (or skip) file is there and counts: a regular file, not a link, that passes
/// the owner and mode rule.
pub fn marker_trusted(path: &Path, ignored: &mut Vec<String>) -> bool {
    read_sibling(path, CONTROL_CAP, ignored).is_ok_and(|r| r.is_some())
}

/// A control file's value: empty → `"true"`; otherwise the content less one trailing newline.
fn control_value(raw: Vec<u8>) -> String {
    if raw.is_empty() {
        return "true".into();
    }
    let s = String::from_utf8_lossy(&raw).into_owned();
    s.strip_suffix('\n').map(str::to_string).unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pos_keeps_system_agent_fields_and_omits_empty_ones() {
        assert_eq!(serde_json::to_string(&Pos::default()).unwrap(), "{}");
        let p = Pos {
            applied_checksum: "abc".into(),
            output: vec![1, 2],
            plan_state: Some(PlanState::Succeeded),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"appliedChecksum":"abc","output":"AQI=","planState":"succeeded"}"#
        );
        // A system-agent .pos (no nodeplan fields, unknown fields) reads fine.
        let rancher = br#"{"appliedChecksum":"x","output":"H4sI","probeStatus":{"p":{"healthy":true}},"periodicOutput":"","somethingNew":1}"#;
        let p = parse_pos(rancher).unwrap();
        assert_eq!(p.applied_checksum, "x");
        assert!(p.probe_status["p"].healthy);
        for bad in [&b"{"[..], b"[]", br#"{"output":"!!"}"#, br#"{"failureCount":"x"}"#] {
            let e = parse_pos(bad).unwrap_err();
            assert!(e.starts_with("malformed .pos file") && !e.contains('\n'), "{e}");
        }
        assert_eq!(parse_pos(b"").unwrap(), Pos::default());
        // R25: a newer format is held (never started over), an older or current one is read.
        let newer = parse_checked(br#"{"appliedChecksum":"x","nodeplanFormat":2}"#).unwrap_err();
        assert!(matches!(&newer, PosError::Unusable(e) if e.contains("newer nodeplan (format 2")), "{newer:?}");
        assert_eq!(parse_checked(br#"{"appliedChecksum":"x","nodeplanFormat":1}"#).unwrap().applied_checksum, "x");
    }

    #[test]
    fn written_pos_files_carry_their_format() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("p.pos");
        write_pos(&path, &Pos { applied_checksum: "abc".into(), ..Default::default() }).unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(raw, br#"{"appliedChecksum":"abc","nodeplanFormat":1}"#);
        assert_eq!(read_pos(&path).unwrap().applied_checksum, "abc");
    }

    #[test]
    fn control_file_values() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("x.paused");
        assert_eq!(read_control(&f).unwrap(), None);
        for (content, want) in [
            ("", "true"),
            ("true\n", "true"),
            ("false", "false"),
            ("true\n\n", "true\n"),
            ("yes\n", "yes"),
            ("true ", "true "),
        ] {
            std::fs::write(&f, content).unwrap();
            assert_eq!(read_control(&f).unwrap().as_deref(), Some(want), "{content:?}");
        }
        std::fs::write(&f, CONTROL_TRUE).unwrap();
        assert_eq!(read_control(&f).unwrap().as_deref(), Some("true"), "what `nodeplan plan` writes");
    }

    /// As root, a control, `.pos` or reset file another user owns, or that group or others can
    /// write, is ignored as if absent and named; root's own counts.
    #[test]
    fn files_beside_a_plan_count_only_when_roots() {
        use std::os::unix::fs::PermissionsExt;
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let (c, p, r) = (d.path().join("x.canceled"), d.path().join("x.pos"), d.path().join("x.reset"));
        std::fs::write(&c, CONTROL_TRUE).unwrap();
        std::fs::write(&p, br#"{"appliedChecksum":"forged"}"#).unwrap();
        std::fs::write(&r, b"").unwrap();
        let mut ignored = Vec::new();
        assert_eq!(read_control_trusted(&c, &mut ignored).unwrap().as_deref(), Some("true"));
        assert_eq!(read_pos_trusted(&p, &mut ignored).unwrap().applied_checksum, "forged");
        assert!(marker_trusted(&r, &mut ignored));
        assert!(ignored.is_empty(), "{ignored:?}");
        for f in [&c, &p] {
            std::os::unix::fs::chown(f, Some(1000), None).unwrap();
        }
        std::fs::set_permissions(&r, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(read_control_trusted(&c, &mut ignored).unwrap(), None);
        assert_eq!(read_pos_trusted(&p, &mut ignored).unwrap(), Pos::default());
        assert!(!marker_trusted(&r, &mut ignored));
        assert_eq!(
            ignored,
            [
                format!("{} is owned by uid 1000", c.display()),
                format!("{} is owned by uid 1000", p.display()),
                format!("{} is writable by group or others (mode 0666)", r.display()),
            ]
        );
    }

    #[test]
    fn plan_files_siblings() {
        let f = PlanFiles::new(Path::new("/p/dir/web.plan")).unwrap();
        assert_eq!(f.name, "web");
        assert_eq!(f.pos(), Path::new("/p/dir/web.pos"));
        assert_eq!(f.paused(), Path::new("/p/dir/web.paused"));
        assert!(PlanFiles::new(Path::new("/p/x.txt")).is_none());
    }
}
