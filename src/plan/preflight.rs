//! Checks that must pass before a plan begins (a NodePlan's `preflightChecks`): what to check,
//! and what checking found. The source says which checks a plan has; the reconcile loop runs them
//! (through [`crate::probe::Prober::preflight`]) as the gate before a start.

use super::Probe;

/// A preflight check, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Preflight {
    pub name: String,
    pub probe: Probe,
    /// A failing required check keeps the plan from starting; an optional one is only reported.
    pub required: bool,
}

/// What preflight checks found: the failing checks (name, why), required ones first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreflightResult {
    pub required_failed: Vec<(String, String)>,
    pub optional_failed: Vec<(String, String)>,
}

impl PreflightResult {
    pub fn passed(&self) -> bool {
        self.required_failed.is_empty()
    }

    /// The names of the required checks that failed, for a log line.
    pub fn failed_names(&self) -> String {
        self.required_failed.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
    }
}
