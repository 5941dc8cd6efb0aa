//! Remote mode: the plan Secret. This module owns the Kubernetes edge (`client`: one Secret read,
//! watched and patched), the Secret's keys and the pure functions over them (`wire`), and, on top
//! of both, the reconcile loop of the plan-state and checksum flows with conflict-safe writes
//! (`agent`), whose writes chain on their own answers (`base`, shared with the NodePlan source), and
//! the look for Rancher's own agent on this node (`rival`). It
//! must not spawn processes (the applyinator does, through `process`).

pub mod agent;
pub mod client;
pub mod kept;
#[cfg(unix)]
pub mod rival;
pub mod wire;
