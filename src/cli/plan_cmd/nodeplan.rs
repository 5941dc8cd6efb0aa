//! `nodeplan plan push|pause|resume|cancel|reset|status --nodeplan NAMESPACE/NAME` and
//! `nodeplan plan status --node NODE`: a NodePlan's spec written as a producer writes it, its
//! status read back. The objects, patches and text come from [`crate::nodeplan::cli_wire`]; this
//! module parses the names, asks the API server (every request bounded by `--request-timeout`) and
//! reports. It never writes a status: that is the agent's record.
//!
//! `reset` writes a new `spec.runToken`: the agent identifies a run by `spec.plan` and the token
//! (docs/rules.md R18), so the same plan runs again from its first instruction.

use super::{Failure, NodeList, Output, PlanAction, RemoteTarget, bad_input};
use crate::nodeplan::cli_wire::{self, Control};
use crate::nodeplan::resource::{self, NODE_LABEL};
use crate::nodeplan::source::{api_resource, node_label_value};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use std::future::Future;

/// A NodePlan's namespace and name, as `--nodeplan NAMESPACE/NAME` gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlanRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for NodePlanRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Lowercase letters, digits, `-` (and `.` when `dots`), starting and ending with a letter or
/// digit: what the API server accepts as a namespace (a DNS label) or a NodePlan's name (a DNS
/// subdomain). Checked here so a typo is exit 2 and never part of a request path.
fn dns_name(s: &str, max: usize, dots: bool) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= max
        && s.chars().all(|c| alnum(c) || c == '-' || (dots && c == '.'))
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

/// `--namespace`: a DNS label.
pub fn parse_namespace(s: &str) -> Result<String, String> {
    if dns_name(s, 63, false) {
        Ok(s.to_string())
    } else {
        Err(format!("{}: not a namespace (lowercase letters, digits and '-', at most 63)", crate::quoted(s)))
    }
}

/// `--nodeplan NAMESPACE/NAME`.
pub fn parse_ref(s: &str) -> Result<NodePlanRef, String> {
    let Some((namespace, name)) = s.split_once('/') else {
        return Err(format!("{}: expected NAMESPACE/NAME", crate::quoted(s)));
    };
    let namespace = parse_namespace(namespace)?;
    if !dns_name(name, 253, true) {
        return Err(format!(
            "{}: not a NodePlan name (lowercase letters, digits, '-' and '.', at most 253)",
            crate::quoted(name)
        ));
    }
    Ok(NodePlanRef { namespace, name: name.to_string() })
}

/// `--node`: a node name as the agent's `nodeName` holds it (any text without blanks or control
/// characters, at most 253 bytes; a name that is no label value is hashed into the label).
pub fn parse_node(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 253 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{}: not a node name (no blanks, at most 253 bytes)", crate::quoted(s)));
    }
    Ok(s.to_string())
}

/// Why a request failed.
#[derive(Debug)]
enum ApiError {
    /// The object does not exist.
    NotFound,
    /// A precondition (resourceVersion) failed, or the object exists already.
    Conflict,
    /// A 404 that is not about the object: NodePlans are not served (no CRD).
    NotServed,
    /// Anything else, as one line.
    Failed(String),
}

/// One request, bounded by `--request-timeout`; `what` names it in an error.
async fn ask<T>(
    t: &RemoteTarget,
    what: &str,
    request: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout(t.request_timeout, request).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(kube::Error::Api(s))) if s.code == 404 && s.reason == "NotFound" => Err(ApiError::NotFound),
        Ok(Err(kube::Error::Api(s))) if s.code == 404 => Err(ApiError::NotServed),
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => Err(ApiError::Conflict),
        Ok(Err(e)) => Err(ApiError::Failed(format!("{what}: {}", crate::k8s::error_line(&e)))),
        Err(_) => Err(ApiError::Failed(crate::k8s::no_answer(what, t.request_timeout))),
    }
}

impl ApiError {
    /// The command's failure: a NodePlan that does not exist is "no such plan" (exit 2, as for a
    /// local plan); the rest could not be read or written (exit 1).
    fn of(self, r: &NodePlanRef) -> Failure {
        match self {
            ApiError::NotFound => bad_input(format!("nodeplan {r} does not exist")),
            ApiError::Conflict => Failure::Failed(format!("nodeplan {r} kept changing under every write; try again")),
            ApiError::NotServed => not_served(),
            ApiError::Failed(e) => Failure::Failed(e),
        }
    }
}

fn not_served() -> Failure {
    Failure::Failed(format!(
        "the API server does not serve NodePlans ({}/{}): install the CRD with `nodeplan crd | kubectl apply -f -`",
        resource::GROUP,
        resource::VERSION
    ))
}

/// `push|pause|resume|cancel|reset|status --nodeplan`.
pub(super) async fn run(action: &PlanAction, t: &RemoteTarget) -> Result<(), Failure> {
    let Some(r) = &t.nodeplan else { return Err(bad_input("no --nodeplan given".into())) };
    match action {
        PlanAction::Push { file, node, priority, .. } => {
            // The plan file is checked before anything is asked.
            let plan = plan_object(file)?;
            push(&nodeplans(t, r).await?, t, r, plan, node.as_deref(), *priority).await
        }
        PlanAction::Pause(_) => control(&nodeplans(t, r).await?, t, r, Control::Pause).await,
        PlanAction::Resume(_) => control(&nodeplans(t, r).await?, t, r, Control::Resume).await,
        PlanAction::Cancel(_) => control(&nodeplans(t, r).await?, t, r, Control::Cancel).await,
        PlanAction::Reset(_) => reset(&nodeplans(t, r).await?, t, r).await,
        PlanAction::Logs(_) => {
            let api = nodeplans(t, r).await?;
            let o = ask(t, "read the NodePlan", api.get(&r.name)).await.map_err(|e| e.of(r))?;
            let lines = crate::fleet::logs::of_object(&crate::fleet::objects::Object::NodePlan(Box::new(o)))?;
            super::print_lines(lines);
            Ok(())
        }
        PlanAction::Status { list, .. } => {
            let api = nodeplans(t, r).await?;
            let o = ask(t, "read the NodePlan", api.get(&r.name)).await.map_err(|e| e.of(r))?;
            if list.output.text() {
                for l in cli_wire::status_lines(&o) {
                    crate::cli::out!("{l}");
                }
            } else {
                let row = crate::fleet::objects::Object::NodePlan(Box::new(o)).row_named(
                    &r.name,
                    r.namespace.clone(),
                    r.name.clone(),
                );
                crate::cli::format::print(&[row], true, list.output, crate::fleet::Row::kube_name);
            }
            Ok(())
        }
    }
}

/// For `push --dry-run`: the plan file checked as a push checks it, and the plan JSON the NodePlan
/// holds now (`None`: no such NodePlan, or no plan in it).
pub(super) async fn current_plan(
    file: &std::path::Path,
    t: &RemoteTarget,
    r: &NodePlanRef,
) -> Result<Option<Vec<u8>>, Failure> {
    plan_object(file)?;
    let api = nodeplans(t, r).await?;
    let o = match ask(t, "read the NodePlan", api.get(&r.name)).await {
        Ok(o) => o,
        Err(ApiError::NotFound) => return Ok(None),
        Err(e) => return Err(e.of(r)),
    };
    Ok(o.data.pointer("/spec/plan").filter(|p| !p.is_null()).and_then(|p| serde_json::to_vec(p).ok()))
}

/// The NodePlans of `r`'s namespace, through the kubeconfig's current context.
async fn nodeplans(t: &RemoteTarget, r: &NodePlanRef) -> Result<Api<DynamicObject>, Failure> {
    Ok(Api::namespaced_with(super::kube_client(t).await?, &r.namespace, &api_resource()))
}

/// The plan file as the object `spec.plan` holds: validated as every push validates a plan, and
/// refused (exit 2) when this agent would refuse it in a NodePlan.
fn plan_object(file: &std::path::Path) -> Result<serde_json::Value, Failure> {
    let raw = super::read_plan(file).map_err(bad_input)?;
    crate::plan::parse(&raw).map_err(|e| bad_input(format!("{}: {e}", file.display())))?;
    cli_wire::plan_object(&raw).map_err(|e| bad_input(format!("{}: {e}", file.display())))
}

/// How often a push reads again when the NodePlan changed between its read and its write (the
/// agent writes its status often; the write carries the version it read).
const PUSH_ATTEMPTS: usize = 8;

/// Create the NodePlan, or replace its `spec.plan` on the version whose node was checked.
async fn push(
    api: &Api<DynamicObject>,
    t: &RemoteTarget,
    r: &NodePlanRef,
    plan: serde_json::Value,
    node: Option<&str>,
    priority: Option<i32>,
) -> Result<(), Failure> {
    for _ in 0..PUSH_ATTEMPTS {
        let existing = match ask(t, "read the NodePlan", api.get(&r.name)).await {
            Ok(o) => Some(o),
            Err(ApiError::NotFound) => None,
            Err(e) => return Err(e.of(r)),
        };
        let (written, what) = match existing {
            None => {
                let Some(node) = node else {
                    return Err(bad_input(format!("nodeplan {r} does not exist: give --node NODE to create it")));
                };
                let obj = cli_wire::new_nodeplan(&r.namespace, &r.name, node, priority, plan.clone());
                let obj: DynamicObject = serde_json::from_value(obj).map_err(|e| Failure::Failed(e.to_string()))?;
                let created = ask(t, "create the NodePlan", api.create(&PostParams::default(), &obj)).await;
                let what = format!(
                    "created for node {} ({NODE_LABEL}={})",
                    crate::plan::failure::shown(node, 80),
                    node_label_value(node)
                );
                (created, what)
            }
            Some(o) => {
                if let Some(node) = node.filter(|n| !crate::nodeplan::wire::is_for_node(&o, n)) {
                    return Err(bad_input(format!(
                        "nodeplan {r} is for {}, not node {}: nothing pushed",
                        cli_wire::node_of(&o),
                        crate::plan::failure::shown(node, 80)
                    )));
                }
                let was_canceled = o.data.pointer("/spec/canceled").and_then(serde_json::Value::as_bool) == Some(true);
                let next = cli_wire::replace_plan(&o, plan.clone(), priority);
                let replaced = ask(t, "write the NodePlan", api.replace(&r.name, &PostParams::default(), &next)).await;
                let mut what = String::from("replaced spec.plan");
                if was_canceled {
                    what.push_str(", cleared spec.canceled");
                }
                if let Some(p) = priority {
                    what.push_str(&format!(", spec.priority={p}"));
                }
                (replaced, what)
            }
        };
        match written {
            Ok(o) => {
                // As the API server stored it (the id of what runs, whatever the run token).
                let id = crate::nodeplan::wire::plan_bytes(&cli_wire::spec_of(&o)).and_then(|b| crate::plan::id_of(&b));
                crate::cli::out!("pushed plan {} to nodeplan {r}: {what}", id.as_deref().unwrap_or("-"));
                if let Some(note) = cli_wire::push_note(&o) {
                    crate::cli::out!("{note}");
                }
                return Ok(());
            }
            // Created or changed meanwhile: read it again.
            Err(ApiError::Conflict) => continue,
            Err(e) => return Err(e.of(r)),
        }
    }
    Err(ApiError::Conflict.of(r))
}

/// `pause`, `resume`, `cancel`: one spec field, by a JSON merge patch.
async fn control(api: &Api<DynamicObject>, t: &RemoteTarget, r: &NodePlanRef, c: Control) -> Result<(), Failure> {
    let patch = c.patch();
    ask(t, "patch the NodePlan", api.patch(&r.name, &PatchParams::default(), &Patch::Merge(&patch)))
        .await
        .map_err(|e| e.of(r))?;
    let (field, value) = c.field();
    let (done, effect) = match c {
        Control::Pause => ("paused", "the agent pauses it at the next instruction boundary"),
        Control::Resume => ("resumed", "a paused plan goes on without re-running finished instructions"),
        Control::Cancel => (
            "canceled",
            "the running instruction is stopped; the plan stays canceled until `nodeplan plan reset`, a cleared spec.canceled or a new spec.plan",
        ),
    };
    crate::cli::out!("{done} nodeplan {r}: set spec.{field}={value} ({effect})");
    Ok(())
}

/// `reset`: a new `spec.runToken` (the time), so the agent runs the plan again from its first
/// instruction with a fresh record; the pause and cancel are cleared.
async fn reset(api: &Api<DynamicObject>, t: &RemoteTarget, r: &NodePlanRef) -> Result<(), Failure> {
    let token = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    let patch = cli_wire::reset_patch(&token);
    ask(t, "patch the NodePlan", api.patch(&r.name, &PatchParams::default(), &Patch::Merge(&patch)))
        .await
        .map_err(|e| e.of(r))?;
    crate::cli::out!(
        "reset nodeplan {r}: set spec.runToken={token} (the agent runs the plan again from its first instruction)"
    );
    Ok(())
}

/// `status --node NODE [--namespace NS | -A]`: the node's NodePlans in the order its agent runs
/// them.
pub(super) async fn list(node: &str, l: &NodeList, t: &RemoteTarget) -> Result<(), Failure> {
    let client = super::kube_client(t).await?;
    let (api, place): (Api<DynamicObject>, String) = if l.all_namespaces {
        (Api::all_with(client, &api_resource()), "any namespace".into())
    } else {
        let ns = l.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
        let place = format!("namespace {ns}");
        (Api::namespaced_with(client, &ns, &api_resource()), place)
    };
    let lp = ListParams::default().labels(&format!("{NODE_LABEL}={}", node_label_value(node)));
    let objects = match ask(t, "list NodePlans", api.list(&lp)).await {
        Ok(list) => list.items,
        Err(ApiError::NotFound | ApiError::NotServed) => return Err(not_served()),
        Err(ApiError::Conflict) => return Err(Failure::Failed("list NodePlans: conflict".into())),
        Err(ApiError::Failed(e)) => return Err(Failure::Failed(e)),
    };
    let rows = cli_wire::rows(&objects, node, chrono::Utc::now().timestamp());
    match l.output {
        Output::Table | Output::Wide if rows.is_empty() => {
            crate::cli::out!("no NodePlans for node {} in {place}", crate::plan::failure::shown(node, 80));
        }
        Output::Table | Output::Wide => {
            for line in cli_wire::table(&rows, l.all_namespaces || l.output == Output::Wide, l.output == Output::Wide) {
                crate::cli::out!("{line}");
            }
        }
        _ => crate::cli::format::print(&rows, false, l.output, |r| format!("nodeplan.{}/{}", resource::GROUP, r.name)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_on_the_command_line() {
        let ok = |ns: &str, name: &str| Ok(NodePlanRef { namespace: ns.into(), name: name.into() });
        assert_eq!(parse_ref("ns/p"), ok("ns", "p"));
        assert_eq!(parse_ref("ns-1/p.v2-a"), ok("ns-1", "p.v2-a"));
        for bad in ["foo", "/p", "ns/", "ns/p/q", "NS/p", "ns/P", "ns/-p", "ns/p?x", "n.s/p", "ns/p q"] {
            let e = parse_ref(bad).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
        assert!(parse_ref(&format!("{}/p", "n".repeat(64))).is_err());
        assert_eq!(parse_node("node-a"), Ok("node-a".into()));
        assert_eq!(parse_node(&"N".repeat(200)), Ok("N".repeat(200)));
        for bad in ["", "a b", "a\nb", &"n".repeat(254)] {
            assert!(parse_node(bad).is_err(), "{bad:?}");
        }
    }
}
