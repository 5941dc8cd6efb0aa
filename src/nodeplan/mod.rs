//! NodePlan custom resources (`agent.cattle.io/v1alpha1`, kind `NodePlan`): a node's plans as
//! structured objects with a schema the API server enforces and a status people can read.
//!
//! This module owns the resource's shape and the checks made of a spec ([`resource`]), and what
//! a NodePlan means for the plan-state flow and the status written back ([`wire`], pure), and the
//! list-then-watch that keeps the node's NodePlans current ([`watch`]). It must
//! not spawn processes or decide plan states (the shared loop in [`crate::reconcile`] and the
//! rules in [`crate::flow`] do).

pub mod resource;
pub mod source;
pub mod watch;
pub mod wire;
