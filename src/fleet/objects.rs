//! The I/O edge of the fleet commands (`plan status|pause|resume|cancel|reset --selector`,
//! `rollout`): the plan objects a label selector picks, of either kind (plan Secrets in one
//! namespace; NodePlans in one namespace or in all), listed, watched and written. Every request is
//! bounded by the caller's timeout; [`write_all`] keeps at most [`PARALLEL`] writes in flight.
//! What the objects mean is [`super::Standing`]'s; which writes to make is the commands' and
//! `crate::fleet::rollout`'s.

use super::Standing;
use crate::nodeplan::source::api_resource;
use crate::remote::client::{SecretClient, SecretRef, SecretSnapshot};
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use std::time::Duration;

/// Writes in flight at once in a fan-out: enough to reach 500 nodes in a few seconds, few enough
/// not to trip the API server's own flow control.
pub const PARALLEL: usize = 16;

/// Which kind of plan object a node has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The node's plan Secret (remote mode, Rancher's wire format).
    Secrets,
    /// The node's NodePlan (NodePlan mode); one selected per node.
    NodePlans,
}

/// The selected objects: their kind, namespace (`None`: every namespace, NodePlans only) and
/// label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub selector: String,
}

impl Scope {
    /// "the plan Secrets matching "x" in namespace ns", for messages.
    pub fn describe(&self) -> String {
        let what = match self.kind {
            Kind::Secrets => "plan Secrets",
            Kind::NodePlans => "NodePlans",
        };
        let place = match &self.namespace {
            Some(ns) => format!("namespace {ns}"),
            None => "any namespace".into(),
        };
        format!("the {what} matching {:?} in {place}", self.selector)
    }

    /// An object's key: its name in one namespace, `NAMESPACE/NAME` across all.
    fn key(&self, namespace: Option<&str>, name: &str) -> String {
        match (&self.namespace, namespace) {
            (None, Some(ns)) => format!("{ns}/{name}"),
            _ => name.to_string(),
        }
    }

    /// The namespace and name of a key.
    pub fn locate(&self, key: &str) -> (String, String) {
        match (&self.namespace, key.split_once('/')) {
            (Some(ns), _) => (ns.clone(), key.to_string()),
            (None, Some((ns, name))) => (ns.to_string(), name.to_string()),
            (None, None) => (String::new(), key.to_string()),
        }
    }

    fn nodeplans(&self, kube: kube::Client) -> Api<DynamicObject> {
        match &self.namespace {
            Some(ns) => Api::namespaced_with(kube, ns, &api_resource()),
            None => Api::all_with(kube, &api_resource()),
        }
    }
}

/// One selected object as read.
#[derive(Debug, Clone)]
pub enum Object {
    Secret(SecretSnapshot),
    NodePlan(Box<DynamicObject>),
}

impl Object {
    /// Where its node stands; `key` names it when it has no node.
    pub fn standing(&self, key: &str) -> Standing {
        match self {
            Object::Secret(s) => super::secret::standing(key, s),
            Object::NodePlan(o) => super::nodeplan::standing(key, o),
        }
    }

    /// Its row, naming the object (`key` in `scope`).
    pub fn row(&self, scope: &Scope, key: &str) -> super::Row {
        let (namespace, name) = scope.locate(key);
        self.row_named(key, namespace, name)
    }

    /// Its row, naming the object (`namespace`/`name`; `key` names a node that has no label).
    pub fn row_named(&self, key: &str, namespace: String, name: String) -> super::Row {
        let kind = match self {
            Object::Secret(_) => "Secret",
            Object::NodePlan(_) => "NodePlan",
        };
        super::Row { kind: kind.into(), namespace, name, ..super::row_of(&self.standing(key)) }
    }

    pub fn resource_version(&self) -> &str {
        match self {
            Object::Secret(s) => &s.resource_version,
            Object::NodePlan(o) => o.metadata.resource_version.as_deref().unwrap_or_default(),
        }
    }
}

/// A kube error as one line. A 404 on a list names no object: NodePlans are not served.
fn error_line(kind: Kind, e: &kube::Error, listing: bool) -> String {
    match e {
        kube::Error::Api(s) if kind == Kind::NodePlans && s.code == 404 && listing => {
            "the API server does not serve NodePlans: install the CRD with `nodeplan crd | kubectl apply -f -`".into()
        }
        other => crate::k8s::error_line(other),
    }
}

/// The selected objects, by key.
pub async fn list(kube: kube::Client, scope: &Scope, timeout: Duration) -> Result<Vec<(String, Object)>, String> {
    let what = format!("list {}", scope.describe());
    match scope.kind {
        Kind::Secrets => {
            let ns = scope.namespace.clone().unwrap_or_default();
            let found =
                crate::k8s::bounded(timeout, &what, crate::remote::client::list_selected(kube, &ns, &scope.selector))
                    .await?;
            Ok(found.into_iter().map(|(n, s)| (n, Object::Secret(s))).collect())
        }
        Kind::NodePlans => {
            let api = scope.nodeplans(kube);
            let lp = ListParams::default().labels(&scope.selector);
            let list = crate::k8s::bounded(timeout, &what, async {
                api.list(&lp).await.map_err(|e| format!("{what}: {}", error_line(Kind::NodePlans, &e, true)))
            })
            .await?;
            Ok(list.items.into_iter().filter_map(|o| keyed(scope, o)).collect())
        }
    }
}

fn keyed(scope: &Scope, o: DynamicObject) -> Option<(String, Object)> {
    let key = scope.key(o.metadata.namespace.as_deref(), o.metadata.name.as_deref()?);
    Some((key, Object::NodePlan(Box::new(o))))
}

/// A change among the selected objects, as the one list/watch ([`crate::k8s::watch::follow`])
/// reports it.
pub type Selected = crate::k8s::watch::Event<Object>;

/// Every selected object at the start, then every change, listing again whenever the watch
/// breaks, goes quiet or may sit on a connection that died (the agent's own list/watch and
/// bounds; its log lines say when it fails and when it is back).
pub fn watch(kube: kube::Client, scope: &Scope) -> std::pin::Pin<Box<dyn Stream<Item = Selected> + Send>> {
    use crate::k8s::watch::{Event, KubeListWatch, follow};
    /// The event with its object made an [`Object`] (`None`: one that cannot be, left out).
    fn of<K>(e: Event<K>, object: impl Fn(K) -> Option<Object>) -> Option<Selected> {
        Some(match e {
            Event::Is(key, o) => Event::Is(key, object(o)?),
            Event::Gone(key) => Event::Gone(key),
            Event::Relisting => Event::Relisting,
            Event::Listed => Event::Listed,
        })
    }
    let what = scope.describe();
    match scope.kind {
        Kind::Secrets => {
            let api: Api<Secret> = Api::namespaced(kube, scope.namespace.as_deref().unwrap_or_default());
            let secret = |s| crate::remote::client::named_snapshot(s).map(|(_, s)| Object::Secret(s));
            let lw = KubeListWatch::labelled(api, &scope.selector);
            Box::pin(follow(lw, what).filter_map(move |e| std::future::ready(of(e, secret))))
        }
        Kind::NodePlans => {
            let lw = KubeListWatch::labelled(scope.nodeplans(kube), &scope.selector);
            let lw = if scope.namespace.is_none() { lw.across_namespaces() } else { lw };
            let nodeplan = |o| Some(Object::NodePlan(Box::new(o)));
            Box::pin(follow(lw, what).filter_map(move |e| std::future::ready(of(e, nodeplan))))
        }
    }
}

/// The selected objects as a watch reports them: the latest of each, and whether the first list
/// is complete.
#[derive(Debug, Default)]
pub struct Tracker {
    pub objects: std::collections::BTreeMap<String, Object>,
    pub listed: bool,
    /// During a relist: the objects listed so far (the others are gone when it completes).
    relisting: Option<std::collections::BTreeSet<String>>,
}

/// What one watch event changed, for the command to report.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// This object is new or changed.
    Is(String),
    /// This object is gone (it was known).
    Gone(String),
    /// A list is complete; these objects were not in it (deleted while the watch was down).
    Listed(Vec<String>),
    None,
}

impl Tracker {
    pub fn apply(&mut self, e: Selected) -> Change {
        match e {
            Selected::Is(key, o) => {
                if let Some(seen) = &mut self.relisting {
                    seen.insert(key.clone());
                }
                self.objects.insert(key.clone(), o);
                Change::Is(key)
            }
            Selected::Relisting => {
                self.relisting = Some(Default::default());
                Change::None
            }
            Selected::Gone(key) => match self.objects.remove(&key) {
                Some(_) => Change::Gone(key),
                None => Change::None,
            },
            Selected::Listed => {
                self.listed = true;
                let Some(seen) = self.relisting.take() else { return Change::Listed(Vec::new()) };
                let gone: Vec<String> = self.objects.keys().filter(|k| !seen.contains(*k)).cloned().collect();
                for k in &gone {
                    self.objects.remove(k);
                }
                Change::Listed(gone)
            }
        }
    }
}

/// A write to one selected object.
#[derive(Debug, Clone)]
pub enum Write {
    /// A JSON merge patch (annotations, and for NodePlans spec scalars).
    Merge(serde_json::Value),
    /// A rollout's start of a NodePlan: `spec.plan` replaced whole (see
    /// `crate::fleet::rollout::start_nodeplan`), on the version just read, read again on a conflict.
    StartNodePlan { plan: serde_json::Value, lease: Option<String> },
}

/// How often a NodePlan start reads again when its object changed between the read and the write.
const START_ATTEMPTS: usize = 8;

/// Write one object; its answer (the object as written).
pub async fn write(
    kube: kube::Client,
    scope: &Scope,
    key: &str,
    w: Write,
    timeout: Duration,
) -> Result<Object, String> {
    let (ns, name) = scope.locate(key);
    match (scope.kind, w) {
        (Kind::Secrets, Write::Merge(patch)) => {
            let what = format!("patch secret {ns}/{name}");
            let c = SecretClient::new(kube, SecretRef { namespace: ns, name });
            crate::k8s::bounded(timeout, &what, c.orchestrator_patch(patch)).await.map(Object::Secret)
        }
        (Kind::Secrets, Write::StartNodePlan { .. }) => Err("a NodePlan write to a plan Secret".into()),
        (Kind::NodePlans, Write::Merge(patch)) => {
            let api: Api<DynamicObject> = Api::namespaced_with(kube, &ns, &api_resource());
            let what = format!("patch nodeplan {ns}/{name}");
            crate::k8s::bounded(timeout, &what, async {
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(|e| format!("{what}: {}", error_line(Kind::NodePlans, &e, false)))
            })
            .await
            .map(|o| Object::NodePlan(Box::new(o)))
        }
        (Kind::NodePlans, Write::StartNodePlan { plan, lease }) => {
            let api: Api<DynamicObject> = Api::namespaced_with(kube, &ns, &api_resource());
            let what = format!("write nodeplan {ns}/{name}");
            for _ in 0..START_ATTEMPTS {
                let o = crate::k8s::bounded(timeout, &what, async {
                    api.get(&name).await.map_err(|e| format!("{what}: {}", error_line(Kind::NodePlans, &e, false)))
                })
                .await?;
                let next =
                    crate::fleet::rollout::start_nodeplan(&o, plan.clone(), chrono::Utc::now(), lease.as_deref());
                let r = tokio::time::timeout(timeout, api.replace(&name, &PostParams::default(), &next)).await;
                match r {
                    Ok(Ok(o)) => return Ok(Object::NodePlan(Box::new(o))),
                    // The agent wrote its status meanwhile: read again.
                    Ok(Err(kube::Error::Api(s))) if s.code == 409 => continue,
                    Ok(Err(e)) => return Err(format!("{what}: {}", error_line(Kind::NodePlans, &e, false))),
                    Err(_) => return Err(crate::k8s::no_answer(&what, timeout)),
                }
            }
            Err(format!("{what}: it kept changing under every write; try again"))
        }
    }
}

/// Write many objects, at most [`PARALLEL`] at a time; the answers in key order.
pub async fn write_all(
    kube: &kube::Client,
    scope: &Scope,
    writes: Vec<(String, Write)>,
    timeout: Duration,
) -> Vec<(String, Result<Object, String>)> {
    let mut done: Vec<(String, Result<Object, String>)> = futures::stream::iter(writes.into_iter().map(|(key, w)| {
        let kube = kube.clone();
        async move {
            let r = write(kube, scope, &key, w, timeout).await;
            (key, r)
        }
    }))
    .buffer_unordered(PARALLEL)
    .collect()
    .await;
    done.sort_by(|a, b| a.0.cmp(&b.0));
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_an_object_in_its_scope() {
        let one = Scope { kind: Kind::NodePlans, namespace: Some("ns".into()), selector: "a=b".into() };
        let all = Scope { namespace: None, ..one.clone() };
        assert_eq!(one.key(Some("ns"), "p"), "p");
        assert_eq!(all.key(Some("node-1"), "p"), "node-1/p");
        assert_eq!(one.locate("p"), ("ns".into(), "p".into()));
        assert_eq!(all.locate("node-1/p"), ("node-1".into(), "p".into()));
        assert_eq!(all.describe(), "the NodePlans matching \"a=b\" in any namespace");
    }

    #[test]
    fn a_tracker_tells_each_change() {
        let mut t = Tracker::default();
        let one = crate::remote::client::test_snapshot(&serde_json::json!({}), &[], &[]);
        assert_eq!(t.apply(Selected::Is("a".into(), Object::Secret(one))), Change::Is("a".into()));
        assert_eq!(t.apply(Selected::Listed), Change::Listed(vec![]));
        assert!(t.listed);
        assert_eq!(t.apply(Selected::Gone("a".into())), Change::Gone("a".into()));
        assert_eq!(t.apply(Selected::Gone("a".into())), Change::None);
        // A relist after the watch broke: what it does not list again was deleted meanwhile.
        let snap = || Object::Secret(crate::remote::client::test_snapshot(&serde_json::json!({}), &[], &[]));
        for k in ["b", "c"] {
            t.apply(Selected::Is(k.into(), snap()));
        }
        assert_eq!(t.apply(Selected::Relisting), Change::None);
        assert_eq!(t.apply(Selected::Is("c".into(), snap())), Change::Is("c".into()));
        assert_eq!(t.apply(Selected::Listed), Change::Listed(vec!["b".into()]));
        assert_eq!(t.objects.keys().collect::<Vec<_>>(), ["c"]);
    }
}
