//! The plan model: Rancher-compatible wire types, validation, the checksum, the output codecs, the
//! checkpoint, plan states and the pause/cancel annotation values (R1, R2).
//!
//! This module owns the vocabulary every other module speaks; it does no I/O at all (no files, no
//! processes, no network, no clock), so everything here is a pure function tested with tables.
//! Unknown JSON fields are ignored, as Go's `encoding/json` does.

mod checkpoint;
mod codec;
pub mod failure;
pub mod fields;
mod preflight;

pub use checkpoint::{
    ANNOTATION_CANCELED, ANNOTATION_CANCELLED, ANNOTATION_PAUSED, Annotations, Checkpoint, Hold, Interruption,
    InvalidAnnotation, PlanState, STATE_CANCELLED, optional_state, parse_annotation_value, resolve_annotations,
    shown_value,
};
pub use codec::{
    CodecError, decode_one_time_output, decode_periodic_output, encode_one_time_output, encode_periodic_output,
    format_unix_date, parse_unix_date, shown_time,
};
pub use failure::Failure;
pub use preflight::{Preflight, PreflightResult};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// Default period of a periodic instruction whose `periodSeconds` is 0 (system-agent's default).
pub const DEFAULT_PERIOD_SECONDS: u64 = 600;

fn is_zero(v: &i64) -> bool {
    *v == 0
}
fn is_false(v: &bool) -> bool {
    !*v
}

/// A node plan, as `rancher/pkg/plan.NodePlan` serialises it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Plan {
    #[serde(skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub files: Vec<File>,
    #[serde(skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub instructions: Vec<OneTimeInstruction>,
    #[serde(skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub periodic_instructions: Vec<PeriodicInstruction>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty", deserialize_with = "null_as_default")]
    pub probes: BTreeMap<String, Probe>,
}

/// Go writes `null` for nil slices and maps; read it as empty.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// One file entry of a plan.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct File {
    /// Standard base64 (padded) of the file's bytes.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub content: String,
    #[serde(skip_serializing_if = "is_false")]
    pub directory: bool,
    #[serde(skip_serializing_if = "is_zero")]
    pub uid: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub gid: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub path: String,
    /// Octal string such as `"0644"` or `"644"`; empty means 0600 for files, 0755 for directories.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub permissions: String,
    /// Only `"delete"` has a meaning.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub action: String,
    #[serde(skip_serializing_if = "is_false")]
    pub dynamic: bool,
    #[serde(skip_serializing_if = "is_false")]
    pub minor: bool,
}

impl File {
    pub fn is_delete(&self) -> bool {
        self.action == "delete"
    }
}

/// The fields one-time and periodic instructions share.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CommonInstruction {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub image: String,
    #[serde(skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub args: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub command: String,
    /// nodeplan extension (ignored by Rancher's parser): stop the instruction through the stop
    /// ladder after this many seconds; the instruction then fails. 0 = no timeout.
    #[serde(skip_serializing_if = "is_zero")]
    pub timeout_seconds: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OneTimeInstruction {
    #[serde(flatten)]
    pub common: CommonInstruction,
    #[serde(skip_serializing_if = "is_false")]
    pub save_output: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PeriodicInstruction {
    #[serde(flatten)]
    pub common: CommonInstruction,
    #[serde(skip_serializing_if = "is_zero")]
    pub period_seconds: i64,
    #[serde(skip_serializing_if = "is_false")]
    pub save_stderr_output: bool,
}

impl PeriodicInstruction {
    /// The period, with 0 (or a negative value) meaning system-agent's default of 600 s.
    pub fn period(&self) -> std::time::Duration {
        let secs = if self.period_seconds > 0 { self.period_seconds as u64 } else { DEFAULT_PERIOD_SECONDS };
        std::time::Duration::from_secs(secs)
    }
}

/// An HTTP(S) health probe. `name` is overwritten with the map key when a plan is parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Probe {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(skip_serializing_if = "is_zero")]
    pub initial_delay_seconds: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub timeout_seconds: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub success_threshold: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub failure_threshold: i64,
    pub http_get: HttpGetAction,
    /// nodeplan extension (the NodePlan draft's probe kind): healthy while this path exists.
    /// A probe has either this or `httpGet`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_exists: Option<FileExistsAction>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FileExistsAction {
    pub path: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpGetAction {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub url: String,
    #[serde(skip_serializing_if = "is_false")]
    pub insecure: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub client_cert: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub client_key: String,
    #[serde(rename = "caCert", skip_serializing_if = "String::is_empty")]
    pub ca_cert: String,
}

/// A probe's health as written to `probe-statuses`; every field is omitted when empty, so an
/// unhealthy zero-count status is `{}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProbeStatus {
    #[serde(skip_serializing_if = "is_false")]
    pub healthy: bool,
    #[serde(skip_serializing_if = "is_zero")]
    pub success_count: i64,
    #[serde(skip_serializing_if = "is_zero")]
    pub failure_count: i64,
}

/// The saved result of a periodic instruction (`applied-periodic-output` values). No field is
/// omitted; `stdout`/`stderr` are base64 strings on the wire (Go `[]byte`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PeriodicInstructionOutput {
    pub name: String,
    #[serde(with = "b64_bytes")]
    pub stdout: Vec<u8>,
    #[serde(with = "b64_bytes")]
    pub stderr: Vec<u8>,
    pub exit_code: i64,
    /// Go `time.UnixDate`, empty when never.
    pub last_successful_run_time: String,
    pub failures: i64,
    pub last_failed_run_time: String,
}

/// Go's `[]byte` JSON encoding: a standard base64 string, `null` for nil.
pub mod b64_bytes {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        base64::engine::general_purpose::STANDARD.decode(s.as_bytes()).map_err(serde::de::Error::custom)
    }
}

/// Lowercase hex SHA-256 of the plan bytes exactly as stored (whitespace matters).
pub fn checksum(raw: &[u8]) -> String {
    let digest = Sha256::digest(raw);
    let mut out = String::with_capacity(64);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// How many hex digits of a checksum name a plan where people read it.
pub const ID_LEN: usize = 12;

/// The id people see for a plan: the first [`ID_LEN`] hex digits of the SHA-256 of its
/// canonical form (the plan as this agent reads it, serialized with its fields in a fixed order,
/// no whitespace). One plan has one id wherever it is kept (a file, a Secret, a NodePlan's spec),
/// however it was formatted, and a NodePlan keeps it across `reset`. The checksums the wire
/// formats compare stay what they are: [`checksum`] of the bytes as stored for files and Secrets
/// (system-agent's), a run's identity for NodePlans.
pub fn id(plan: &Plan) -> String {
    let canonical = serde_json::to_vec(plan).unwrap_or_default();
    short(&checksum(&canonical)).to_string()
}

/// The id of raw plan bytes ([`id`]); `None` when they are no valid plan.
pub fn id_of(raw: &[u8]) -> Option<String> {
    parse(raw).ok().map(|p| p.id())
}

/// The start of a checksum that names it where people read it (the whole of a shorter one).
pub fn short(checksum: &str) -> &str {
    checksum.get(..ID_LEN).unwrap_or(checksum)
}

/// A plan that failed validation; the message names the field (and index) and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid plan: {0}")]
pub struct PlanError(pub String);

/// A validated plan: parsed, every field checked, with the values the applyinator needs decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPlan {
    pub plan: Plan,
    pub checksum: String,
    /// Decoded file contents and modes, parallel to `plan.files`.
    pub files: Vec<FileOp>,
    /// The line naming keys of the plan that nothing reads (a typo such as `instruction`), if any.
    pub unknown_keys: Option<String>,
}

impl ValidPlan {
    /// The plan's [`id`].
    pub fn id(&self) -> String {
        id(&self.plan)
    }
}

/// What to do for one file entry, fully decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileOp {
    Delete { path: String, directory: bool },
    Directory { path: String, mode: u32, uid: u32, gid: u32 },
    Write { path: String, content: Vec<u8>, mode: u32, uid: u32, gid: u32 },
}

impl FileOp {
    pub fn path(&self) -> &str {
        match self {
            FileOp::Delete { path, .. } | FileOp::Directory { path, .. } | FileOp::Write { path, .. } => path,
        }
    }
}

/// Parse an octal permission string (`"0644"`, `"644"`); empty gives `default`.
pub fn parse_permissions(s: &str, default: u32) -> Result<u32, String> {
    if s.is_empty() {
        return Ok(default);
    }
    // Digits only: `from_str_radix` would also take a sign (`"+644"`).
    if !s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(format!("{s:?} is not an octal permission string such as \"0644\""));
    }
    let mode =
        u32::from_str_radix(s, 8).map_err(|_| format!("{s:?} is not an octal permission string such as \"0644\""))?;
    if mode > 0o7777 {
        return Err(format!("{s:?} is larger than 07777"));
    }
    Ok(mode)
}

fn user_id(v: i64, what: &str) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{what} {v} is not a valid id"))
}

/// Parse and validate raw plan bytes. Nothing about the node is touched; the first problem found
/// is returned, naming the field.
pub fn parse(raw: &[u8]) -> Result<ValidPlan, PlanError> {
    if raw.starts_with(b"\xef\xbb\xbf") {
        // Go's encoding/json (system-agent) refuses it too; the checksum is of the bytes as stored.
        return Err(PlanError("the plan starts with a UTF-8 byte order mark; save it without one".into()));
    }
    // serde would read a struct from a JSON array too (`[]` as an empty plan).
    let first = raw.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    let kind = match first {
        None => Some("empty"),
        Some(b'[') => Some("an array"),
        Some(b'"') => Some("a string"),
        Some(b'n') => Some("null"),
        Some(b't' | b'f') => Some("a boolean"),
        Some(b'-' | b'0'..=b'9') => Some("a number"),
        _ => None,
    };
    if let Some(kind) = kind {
        return Err(PlanError(format!(
            "the plan must be a JSON object ({{\"files\": …, \"instructions\": …}}), not {kind}"
        )));
    }
    let mut plan: Plan = serde_json::from_slice(raw).map_err(|e| PlanError(format!("malformed JSON: {e}")))?;
    for (key, probe) in plan.probes.iter_mut() {
        probe.name = key.clone();
    }
    let files = validate(&plan)?;
    Ok(ValidPlan { plan, checksum: checksum(raw), files, unknown_keys: fields::unknown_keys_warning(raw) })
}

fn validate(plan: &Plan) -> Result<Vec<FileOp>, PlanError> {
    let mut ops = Vec::with_capacity(plan.files.len());
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (i, f) in plan.files.iter().enumerate() {
        let field = |name: &str, msg: String| PlanError(format!("files[{i}].{name}: {msg}"));
        let path = normalised_path(&f.path, f.directory).map_err(|m| field("path", m))?;
        if let Some(first) = seen.insert(path.clone(), i) {
            return Err(field(
                "path",
                format!("{path:?} is also files[{first}].path (a path may appear once per plan)"),
            ));
        }
        let uid = user_id(f.uid, "uid").map_err(|m| field("uid", m))?;
        let gid = user_id(f.gid, "gid").map_err(|m| field("gid", m))?;
        let op = if f.is_delete() {
            FileOp::Delete { path, directory: f.directory }
        } else if f.directory {
            let mode = parse_permissions(&f.permissions, 0o755).map_err(|m| field("permissions", m))?;
            FileOp::Directory { path, mode, uid, gid }
        } else {
            let mode = parse_permissions(&f.permissions, 0o600).map_err(|m| field("permissions", m))?;
            let content = base64::engine::general_purpose::STANDARD
                .decode(f.content.as_bytes())
                .map_err(|e| field("content", format!("bad base64: {e}")))?;
            FileOp::Write { path, content, mode, uid, gid }
        };
        ops.push(op);
    }
    let commons = plan
        .instructions
        .iter()
        .map(|i| ("instructions", &i.common))
        .chain(plan.periodic_instructions.iter().map(|p| ("periodicInstructions", &p.common)));
    let mut counters: BTreeMap<&str, usize> = BTreeMap::new();
    for (list, c) in commons {
        let idx = counters.entry(list).or_default();
        let i = *idx;
        *idx += 1;
        let field = |name: &str, msg: String| PlanError(format!("{list}[{i}].{name}: {msg}"));
        if c.name.is_empty() {
            return Err(field("name", "is empty; every instruction needs a name (its output is kept under it)".into()));
        }
        if c.command.is_empty() && c.image.is_empty() {
            return Err(field("command", "neither command nor image is set".into()));
        }
        if c.command.contains('\0') {
            return Err(field("command", "contains a NUL byte".into()));
        }
        for (j, e) in c.env.iter().enumerate() {
            match e.split_once('=') {
                Some((k, _)) if !k.is_empty() && !k.contains('\0') && !e.contains('\0') => {}
                _ => {
                    return Err(field(&format!("env[{j}]"), format!("{e:?} is not KEY=VALUE")));
                }
            }
        }
        if let Some(j) = c.args.iter().position(|a| a.contains('\0')) {
            return Err(field(&format!("args[{j}]"), "contains a NUL byte".into()));
        }
        if c.timeout_seconds < 0 {
            return Err(field("timeoutSeconds", format!("{} is negative", c.timeout_seconds)));
        }
    }
    for (i, p) in plan.periodic_instructions.iter().enumerate() {
        if p.period_seconds < 0 {
            return Err(PlanError(format!(
                "periodicInstructions[{i}].periodSeconds: {} is negative (0 means the default of {DEFAULT_PERIOD_SECONDS})",
                p.period_seconds
            )));
        }
    }
    for (name, p) in &plan.probes {
        if let Some(f) = &p.file_exists {
            if !p.http_get.url.is_empty() {
                return Err(PlanError(format!("probes[{name:?}]: has both httpGet and fileExists; give one")));
            }
            if !f.path.starts_with('/') {
                return Err(PlanError(format!(
                    "probes[{name:?}].fileExists.path: {:?} is not an absolute path",
                    f.path
                )));
            }
            continue;
        }
        let field = |msg: String| PlanError(format!("probes[{name:?}].httpGet.url: {msg}"));
        let url = &p.http_get.url;
        if url.is_empty() {
            return Err(field("is empty".into()));
        }
        let parsed = url::Url::parse(url).map_err(|e| field(format!("{url:?} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(field(format!("{url:?}: the scheme must be http or https, not {:?}", parsed.scheme())));
        }
    }
    Ok(ops)
}

/// A plan path, checked to be a normalised absolute path: not `/` itself, no `.` or `..`
/// components, no `//`, no NUL byte, no trailing `/` on a file. A directory entry (created or
/// deleted) may end with one `/`, which is dropped. Returns the path to use.
fn normalised_path(p: &str, directory: bool) -> Result<String, String> {
    if p.is_empty() {
        return Err("is empty; an absolute path is required".into());
    }
    if p.contains('\0') {
        return Err(format!("{p:?} contains a NUL byte"));
    }
    if !p.starts_with('/') {
        return Err(format!("{p:?} is not an absolute path"));
    }
    let body = match p.strip_suffix('/') {
        Some(b) if directory && !b.is_empty() && !b.ends_with('/') => b,
        _ => p,
    };
    if body == "/" {
        return Err(format!("{p:?} is the root directory"));
    }
    if body.contains("//") {
        return Err(format!("{p:?} contains \"//\"; write the normalised path"));
    }
    if body.ends_with('/') {
        return Err(format!(
            "{p:?} ends with \"/\", which only a directory entry (\"directory\": true) may; write the normalised path"
        ));
    }
    if let Some(c) = body.split('/').skip(1).find(|c| *c == "." || *c == "..") {
        return Err(format!("{p:?} contains a {c:?} component; write the normalised path"));
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests;
