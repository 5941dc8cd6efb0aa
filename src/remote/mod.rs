//! Remote mode: the plan Secret. This module owns the Kubernetes edge (`client`: one Secret read,
//! watched and patched) and, on top of it, the reconcile of the plan-state and checksum flows with
//! conflict-safe writes. It must not spawn processes (the applyinator does, through `process`).

pub mod agent;
pub mod client;
pub mod wire;
