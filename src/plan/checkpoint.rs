//! Plan states, the checkpoint (`plan-checkpoint`) and the pause/cancel annotation values.

use serde::{Deserialize, Serialize};
use std::fmt;

pub const ANNOTATION_PAUSED: &str = "plan.cattle.io/paused";
pub const ANNOTATION_CANCELED: &str = "plan.cattle.io/canceled";
/// Cancel as `github.com/rancher/rancher/pkg/plan` spelled it in May 2026 (its `state.go` at
/// `v0.0.0-20260508124826-0b6b24d9811e`, which system-agent 0.15 pins): read as
/// [`ANNOTATION_CANCELED`]; a plan canceled through it is written back as [`STATE_CANCELLED`].
pub const ANNOTATION_CANCELLED: &str = "plan.cattle.io/cancelled";
/// That version's `PlanStateCancelled`: its `IsTerminal` knows this spelling only.
pub const STATE_CANCELLED: &str = "cancelled";

/// The `plan-state` values. Unknown values are kept verbatim and treated as terminal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PlanState {
    Pending,
    InProgress,
    Succeeded,
    Failed,
    Canceled,
    Paused,
    Other(String),
}

impl PlanState {
    pub fn parse(s: &str) -> PlanState {
        match s {
            "pending" => PlanState::Pending,
            "in-progress" => PlanState::InProgress,
            "succeeded" => PlanState::Succeeded,
            "failed" => PlanState::Failed,
            "canceled" | STATE_CANCELLED => PlanState::Canceled,
            "paused" => PlanState::Paused,
            other => PlanState::Other(other.to_string()),
        }
    }
    pub fn as_str(&self) -> &str {
        match self {
            PlanState::Pending => "pending",
            PlanState::InProgress => "in-progress",
            PlanState::Succeeded => "succeeded",
            PlanState::Failed => "failed",
            PlanState::Canceled => "canceled",
            PlanState::Paused => "paused",
            PlanState::Other(s) => s,
        }
    }
    /// succeeded, failed and canceled (rancher `IsTerminal`).
    pub fn is_terminal(&self) -> bool {
        matches!(self, PlanState::Succeeded | PlanState::Failed | PlanState::Canceled)
    }
}

impl Serialize for PlanState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for PlanState {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|s| PlanState::parse(&s))
    }
}

/// An optional state stored as a string that is empty (or absent) when there is none: the
/// encoding of `resumeState` in a checkpoint and `planState` in a `.pos` file.
pub mod optional_state {
    use super::PlanState;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<PlanState>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_ref().map_or("", PlanState::as_str))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PlanState>, D::Error> {
        let s = String::deserialize(d)?;
        Ok((!s.is_empty()).then(|| PlanState::parse(&s)))
    }
}

impl fmt::Display for PlanState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a run stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    Paused,
    Canceled,
    Shutdown,
    /// The agent may no longer act on the plan source: its Lease is not renewed in time, or not
    /// yet its own for certain (R26). Stopped like a shutdown; recorded like a restart point.
    Fenced,
}

/// `plan-checkpoint`: where a paused or canceled plan stopped. Field order and omitted empty
/// fields match system-agent exactly when written. Read, every field may be absent: Rancher's own
/// checkpoint struct marks each one `omitempty`, so a plan paused before it started arrives
/// without `completedInstructions` (an absent count is 0, an absent flag `false`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    #[serde(default)]
    pub checksum: String,
    #[serde(default)]
    pub completed_instructions: usize,
    #[serde(default)]
    pub total_instructions: usize,
    /// The state a paused plan resumes into (none for a cancel).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "optional_state")]
    pub resume_state: Option<PlanState>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub termination_incomplete: bool,
}

impl Checkpoint {
    /// Read a stored checkpoint for the plan with `checksum`. A missing or empty value, bad JSON,
    /// the wrong shape or another plan's checksum all mean "no checkpoint".
    pub fn read(raw: Option<&[u8]>, checksum: &str) -> Option<Checkpoint> {
        let raw = raw?;
        if raw.is_empty() {
            return None;
        }
        let cp: Checkpoint = serde_json::from_slice(raw).ok()?;
        (cp.checksum == checksum).then_some(cp)
    }

    pub fn to_json(&self) -> String {
        // Serialising a struct of strings, integers and booleans cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Parse one annotation value (R1): absent is `false`, only exactly `"true"` and `"false"` are
/// valid.
pub fn parse_annotation_value(v: Option<&str>) -> Result<bool, String> {
    match v {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(other.to_string()),
    }
}

/// The raw annotation values (or control-file contents in local mode).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Annotations<'a> {
    pub paused: Option<&'a str>,
    pub canceled: Option<&'a str>,
}

/// What the annotations ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    None,
    Pause,
    Cancel,
}

/// An invalid annotation value (R3); the message names every bad key with its quoted value (a
/// short, escaped prefix of it: see [`shown_value`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|(k, v)| format!("invalid value {} for {k} (expected \"true\" or \"false\")", shown_value(v))).collect::<Vec<_>>().join("; "))]
pub struct InvalidAnnotation(pub Vec<(String, String)>);

/// How many characters of a value someone else wrote are shown in logs and `plan status`.
const SHOWN_CHARS: usize = 40;

/// A value someone else wrote (an annotation, a control file), as logs and `plan status` show
/// it: quoted and escaped (no control characters or line breaks reach a log), and cut to its
/// first [`SHOWN_CHARS`] characters with its full length when longer, so a 2 MB control file is
/// not a 2 MB log line.
pub fn shown_value(v: &str) -> String {
    match v.char_indices().nth(SHOWN_CHARS) {
        None => format!("{v:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &v[..cut], v.len()),
    }
}

/// R1 + R2: a valid `canceled="true"` wins even when `paused` is invalid; otherwise any invalid
/// value is an error; otherwise `paused="true"` pauses.
pub fn resolve_annotations(a: &Annotations<'_>) -> Result<Hold, InvalidAnnotation> {
    let canceled = parse_annotation_value(a.canceled);
    if canceled == Ok(true) {
        return Ok(Hold::Cancel);
    }
    let paused = parse_annotation_value(a.paused);
    let mut bad = Vec::new();
    if let Err(v) = &paused {
        bad.push((ANNOTATION_PAUSED.to_string(), v.clone()));
    }
    if let Err(v) = &canceled {
        bad.push((ANNOTATION_CANCELED.to_string(), v.clone()));
    }
    if !bad.is_empty() {
        return Err(InvalidAnnotation(bad));
    }
    Ok(if paused == Ok(true) { Hold::Pause } else { Hold::None })
}
