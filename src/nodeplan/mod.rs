//! NodePlan custom resources (`agent.cattle.io/v1alpha1`, kind `NodePlan`): a node's plans as
//! structured objects with a schema the API server enforces and a status people can read.
//!
//! This module owns the resource's shape and the checks made of a spec ([`resource`]); what a
//! NodePlan means for the plan-state flow and the status written back ([`wire`], pure); the
//! source on the shared loop ([`source`]) over the shared list-then-watch ([`crate::k8s::watch`]) and the runs in
//! progress kept on the node ([`runs`]); and the producer's side the CLI uses (the objects and
//! spec patches it sends, the text it prints: [`cli_wire`], pure). It must not spawn processes or
//! decide plan states (the shared loop in [`crate::reconcile`] and the rules in [`crate::flow`]
//! do).

pub mod cli_wire;
pub mod resource;
pub mod runs;
pub mod source;
pub mod wire;
