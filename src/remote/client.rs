//! The Kubernetes edge of remote mode: one Secret, read, watched and patched; no decisions.
//!
//! This module owns every call remote mode makes to the Kubernetes API for the plan Secret
//! (system-agent's `pkg/k8splan` informer and `updateSecret`): building a [`kube::Client`] from
//! the connection-info kubeconfig (through [`crate::k8s::client`]: every request bounded), GET, a
//! field-selected watch that never ends (an adapter over the shared [`crate::k8s::watch`]), and
//! updates (PUT) of `data` keys guarded by a `metadata.resourceVersion` precondition: an update,
//! as system-agent writes, since Rancher's per-machine Role grants `update` on the Secret and not
//! `patch`.
//!
//! It must not decide anything: it does not parse the plan, compare checksums or resource
//! versions, retry conflicts, debounce or back off (the shared watch does what it needs). It
//! touches no other object than the one Secret named by [`SecretRef`], and it never writes a key
//! the caller did not name. What the data means is the reconcile loop's business.
//!
//! The orchestrator's side (what Rancher does: writing `plan`, `plan-state` and the annotations,
//! creating the Secret) lives here too, so `nodeplan plan` and the tests take the same wire path:
//! [`SecretClient::orchestrator_patch`] and [`SecretClient::create`] serve `nodeplan plan`, the
//! tests and the cancel-latency benchmark; [`SecretClient::delete`] serves only the tests. For
//! many nodes at once (`nodeplan plan status|pause|resume|cancel|reset --selector`), [`list_selected`]
//! reads the Secrets a label selector picks (`fleet::objects` watches them through the one
//! list/watch); each is then written through its own [`SecretClient`].

use std::collections::BTreeMap;

use futures::Stream;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The Secret type Rancher gives machine-plan Secrets.
pub const MACHINE_PLAN_SECRET_TYPE: &str = "rke.cattle.io/machine-plan";

/// Where the plan Secret lives (connection-info `namespace` and `secretName`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

/// A snapshot of the Secret: what remote mode decides from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretSnapshot {
    pub uid: String,
    pub resource_version: String,
    /// Raw bytes of `Secret.data` (already base64-decoded).
    pub data: BTreeMap<String, Vec<u8>>,
    pub annotations: BTreeMap<String, String>,
    /// Its labels (Rancher names the machine in `rke.cattle.io/machine-name`).
    pub labels: BTreeMap<String, String>,
    /// The rest of what an update must carry back so as to change nothing but `data` (shared:
    /// snapshots are cloned often).
    pub kept: std::sync::Arc<Kept>,
}

/// What an update of a Secret sends back unchanged besides its labels, annotations and data: the
/// rest of its metadata (owners, finalizers; not `managedFields`, which the server keeps) and its
/// type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Kept {
    meta: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    type_: Option<String>,
    immutable: Option<bool>,
}

// Strings, maps and times: equality is total.
impl Eq for Kept {}

impl SecretSnapshot {
    /// Convert an API object. A Secret without `uid` or `resourceVersion` did not come from a
    /// real apiserver and cannot be reasoned about, so it is an error rather than a default.
    fn from_secret(secret: Secret) -> Result<Self, String> {
        let mut meta = secret.metadata;
        let uid = meta.uid.take().filter(|u| !u.is_empty()).ok_or("secret has no metadata.uid")?;
        let resource_version =
            meta.resource_version.take().filter(|rv| !rv.is_empty()).ok_or("secret has no metadata.resourceVersion")?;
        let data = secret.data.unwrap_or_default().into_iter().map(|(k, ByteString(v))| (k, v)).collect();
        let annotations = meta.annotations.take().unwrap_or_default();
        let labels = meta.labels.take().unwrap_or_default();
        meta.managed_fields = None;
        let kept = std::sync::Arc::new(Kept { meta, type_: secret.type_, immutable: secret.immutable });
        Ok(SecretSnapshot { uid, resource_version, data, annotations, labels, kept })
    }
}

/// The Secrets of `namespace` that the label selector `selector` picks, by name.
pub async fn list_selected(
    client: kube::Client,
    namespace: &str,
    selector: &str,
) -> Result<Vec<(String, SecretSnapshot)>, String> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let list = api
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|e| format!("list secrets in {namespace} matching {selector:?}: {}", kube_error_line(&e)))?;
    Ok(list.items.into_iter().filter_map(named_snapshot).collect())
}

pub(crate) fn named_snapshot(s: Secret) -> Option<(String, SecretSnapshot)> {
    let name = s.metadata.name.clone()?;
    SecretSnapshot::from_secret(s).ok().map(|snap| (name, snap))
}

/// A Secret snapshot for tables in tests: the plan's JSON, other keys as text, annotations.
#[cfg(all(test, unix))]
pub(crate) fn test_snapshot(
    plan: &serde_json::Value,
    keys: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> SecretSnapshot {
    let mut data: BTreeMap<String, Vec<u8>> =
        keys.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect();
    data.insert("plan".into(), serde_json::to_vec(plan).unwrap_or_default());
    SecretSnapshot {
        uid: "u".into(),
        resource_version: "1".into(),
        data,
        annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..SecretSnapshot::default()
    }
}

/// Why a precondition-guarded write failed: the one writer's error ([`crate::k8s::write`]).
pub use crate::k8s::write::WriteError;

/// Reads, watches and patches the one plan Secret. Cheap to clone (shares the connection pool).
#[derive(Clone)]
pub struct SecretClient {
    api: Api<Secret>,
    secret: SecretRef,
}

impl std::fmt::Debug for SecretClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretClient").field("secret", &self.secret).finish_non_exhaustive()
    }
}

use crate::AbortOnDrop;
use crate::k8s::error_line as kube_error_line;

/// The Secret [`SecretClient::update_data`] sends: `base` as it was read (its resourceVersion the
/// precondition) with `updates` to `data` (`None` removes a key).
fn put_body(secret: &SecretRef, base: &SecretSnapshot, updates: &BTreeMap<String, Option<Vec<u8>>>) -> Secret {
    let mut meta = base.kept.meta.clone();
    meta.name = Some(secret.name.clone());
    meta.namespace = Some(secret.namespace.clone());
    meta.uid = Some(base.uid.clone());
    meta.resource_version = Some(base.resource_version.clone());
    meta.annotations = (!base.annotations.is_empty()).then(|| base.annotations.clone());
    meta.labels = (!base.labels.is_empty()).then(|| base.labels.clone());
    let mut data: BTreeMap<String, ByteString> =
        base.data.iter().map(|(k, v)| (k.clone(), ByteString(v.clone()))).collect();
    for (k, v) in updates {
        match v {
            Some(bytes) => data.insert(k.clone(), ByteString(bytes.clone())),
            None => data.remove(k),
        };
    }
    Secret {
        metadata: meta,
        data: Some(data),
        type_: base.kept.type_.clone(),
        immutable: base.kept.immutable,
        string_data: None,
    }
}

impl SecretClient {
    pub fn new(client: kube::Client, secret: SecretRef) -> Self {
        let api = Api::namespaced(client, &secret.namespace);
        SecretClient { api, secret }
    }

    /// The client underneath (for requests about other objects: Events, the Lease).
    pub fn kube_client(&self) -> kube::Client {
        self.api.clone().into_client()
    }

    /// The Secret this client is bound to.
    pub fn secret_ref(&self) -> &SecretRef {
        &self.secret
    }

    /// Build a kube::Client from kubeconfig YAML text (as in system-agent's connection-info
    /// `kubeConfig`), with rustls; strict CA verification (no fallback to system roots).
    ///
    /// When the kubeconfig carries a CA (`certificate-authority-data` or a
    /// `certificate-authority` path), that CA is the only trust root; unlike system-agent there
    /// is no retry without it after an "unknown authority" failure. Without a CA, kube uses the
    /// platform verifier (as Go does with no CA data). The current context's cluster, user and
    /// namespace are used; proxy settings follow kube (kubeconfig `proxy-url`, then
    /// `HTTPS_PROXY`).
    pub async fn client_from_kubeconfig_yaml(yaml: &str) -> Result<kube::Client, String> {
        let (_, config) = config_from_kubeconfig_yaml(yaml).await?;
        crate::k8s::client(config).map_err(|e| format!("kube client: {}", kube_error_line(&e)))
    }

    /// GET the Secret; `None` when it does not exist. Used by the agent after a conflict and by
    /// `nodeplan plan push|status`.
    pub async fn get(&self) -> Result<Option<SecretSnapshot>, String> {
        match self.api.get_opt(&self.secret.name).await {
            Ok(Some(secret)) => SecretSnapshot::from_secret(secret).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(format!("get secret {}: {}", self.describe(), kube_error_line(&e))),
        }
    }

    /// Update (PUT) `base` with `updates` to its `data` keys (Some(bytes) = set, None = delete),
    /// its resourceVersion the precondition: nothing else of the Secret changes. Returns the new
    /// snapshot. 409 → WriteError::Conflict, 404 → NotFound.
    pub async fn update_data(
        &self,
        base: &SecretSnapshot,
        updates: &BTreeMap<String, Option<Vec<u8>>>,
    ) -> Result<SecretSnapshot, WriteError> {
        let body = put_body(&self.secret, base, updates);
        let secret =
            self.api.replace(&self.secret.name, &PostParams::default(), &body).await.map_err(WriteError::from)?;
        SecretSnapshot::from_secret(secret).map_err(WriteError::Other)
    }

    /// A stream of snapshots of the one Secret (None when it does not exist), through the shared
    /// list/watch ([`crate::k8s::watch`]) with fieldSelector metadata.name=<name> in the
    /// namespace. It never ends: errors are logged and the watch lists again after a back-off.
    ///
    /// Semantics: after every list the current object is yielded, or `None` if the list did not
    /// contain it; afterwards each change yields the Secret as it is now (`None` once deleted).
    /// Snapshots the caller has not taken yet are replaced by newer ones, and a list may repeat a
    /// snapshot already seen: the first item after an outage is the Secret as it is now, even when
    /// it did not change, and that item is how the caller learns that the API server is reachable
    /// again. A watch that goes quiet past its bound, or that was opened before the API server
    /// stopped answering, is given up for a fresh list (a connection may die without a sign).
    pub fn watch(&self) -> impl Stream<Item = Option<SecretSnapshot>> + Send + 'static {
        let (tx, rx) = tokio::sync::watch::channel((0, BTreeMap::new()));
        let lw = crate::k8s::watch::KubeListWatch::named(self.api.clone(), &self.secret.name);
        let pump = tokio::spawn(crate::k8s::watch::pump(lw, format!("secret {}", self.describe()), tx));
        let name = self.secret.name.clone();
        // The pump ends by itself once the receiver is gone; the guard ends it at once.
        let state = (rx, name, AbortOnDrop(pump));
        futures::stream::unfold(state, |(mut rx, name, guard)| async move {
            loop {
                rx.changed().await.ok()?;
                let secret = rx.borrow_and_update().1.get(&name).cloned();
                let Some(secret) = secret else { return Some((None, (rx, name, guard))) };
                match SecretSnapshot::from_secret(secret) {
                    Ok(snapshot) => return Some((Some(snapshot), (rx, name, guard))),
                    Err(e) => tracing::warn!(secret = %name, error = %e, "ignoring an unusable secret"),
                }
            }
        })
    }

    /// Orchestrator side (`nodeplan plan push|pause|resume|cancel|reset`, tests): a JSON merge patch
    /// without any precondition.
    pub async fn orchestrator_patch(&self, patch: serde_json::Value) -> Result<SecretSnapshot, String> {
        let secret = self
            .api
            .patch(&self.secret.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| format!("patch secret {}: {}", self.describe(), kube_error_line(&e)))?;
        SecretSnapshot::from_secret(secret)
    }

    /// Orchestrator side (`nodeplan plan push` of a Secret that does not exist yet, tests): create
    /// the Secret with type `rke.cattle.io/machine-plan`.
    pub async fn create(
        &self,
        data: BTreeMap<String, Vec<u8>>,
        annotations: BTreeMap<String, String>,
    ) -> Result<SecretSnapshot, String> {
        let mut secret = Secret::default();
        secret.metadata.name = Some(self.secret.name.clone());
        secret.metadata.namespace = Some(self.secret.namespace.clone());
        secret.metadata.annotations = Some(annotations);
        secret.type_ = Some(MACHINE_PLAN_SECRET_TYPE.to_string());
        secret.data = Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect());
        let created = self
            .api
            .create(&PostParams::default(), &secret)
            .await
            .map_err(|e| format!("create secret {}: {}", self.describe(), kube_error_line(&e)))?;
        SecretSnapshot::from_secret(created)
    }

    /// Orchestrator side (tests only): delete the Secret. Deleting a Secret that does not exist is
    /// Ok.
    pub async fn delete(&self) -> Result<(), String> {
        match self.api.delete(&self.secret.name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(format!("delete secret {}: {}", self.describe(), kube_error_line(&e))),
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!("{}/{}", self.secret.namespace, self.secret.name)
    }
}

/// The kubeconfig parsed and turned into a client configuration, with nothing run: kube runs a
/// user's `exec` or `auth-provider` command only when a client is built from the configuration.
async fn config_from_kubeconfig_yaml(yaml: &str) -> Result<(Kubeconfig, kube::Config), String> {
    // The kubeconfig holds tokens and keys, and the YAML parser's message can quote (or show a
    // snippet of) the text: a parse error gives the position only.
    let kubeconfig = Kubeconfig::from_yaml(yaml).map_err(|e| match e {
        kube::config::KubeconfigError::Parse(p) => match p.location() {
            Some(l) => format!("kubeconfig: invalid YAML at line {} column {}", l.line(), l.column()),
            None => "kubeconfig: invalid YAML (the text is not shown: it may hold credentials)".to_string(),
        },
        other => format!("kubeconfig: {}", crate::error_line(&other)),
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("kubeconfig: {}", crate::error_line(&e)))?;
    if config.accept_invalid_certs {
        return Err("kubeconfig: insecure-skip-tls-verify is not supported".to_string());
    }
    Ok((kubeconfig, config))
}

/// What [`check_kubeconfig_yaml`] does with a user's credential plugin (`exec`, `auth-provider`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugins {
    /// Refused: the kubeconfig came from a server (Rancher's answer), and a plugin is a command
    /// that root would run.
    Refuse,
    /// Allowed (the operator's own kubeconfig), but never run by the check.
    NotRun,
}

/// Checks kubeconfig YAML as the agent's start does (contexts, credentials, TLS settings: a client
/// is made) without running anything: the current user's `exec` or `auth-provider` plugin is
/// left out of the client the check makes. With [`Plugins::Refuse`] a user with a plugin (any
/// user of the file) is an error. Returns a note when a plugin was present and not run.
pub async fn check_kubeconfig_yaml(yaml: &str, plugins: Plugins) -> Result<Option<String>, String> {
    let (kubeconfig, mut config) = config_from_kubeconfig_yaml(yaml).await?;
    if plugins == Plugins::Refuse {
        for named in &kubeconfig.auth_infos {
            let Some(a) = &named.auth_info else { continue };
            let what = match (&a.exec, &a.auth_provider) {
                (Some(_), _) => "an exec credential plugin",
                (None, Some(_)) => "an auth-provider",
                (None, None) => continue,
            };
            return Err(format!(
                "kubeconfig: user {} has {what}, a command root would run: refused in connection info from a server \
                 (Rancher's own answer carries a token)",
                crate::quoted(&named.name)
            ));
        }
    }
    let note = match (config.auth_info.exec.take(), config.auth_info.auth_provider.take()) {
        (Some(_), _) => Some("its user's exec credential plugin was not run".to_string()),
        (None, Some(_)) => Some("its user's auth-provider was not run".to_string()),
        (None, None) => None,
    };
    crate::k8s::client(config).map(drop).map_err(|e| format!("kube client: {}", kube_error_line(&e)))?;
    Ok(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kube's YAML parser shows a snippet of the text around an error; the token in it must not
    /// reach the error line.
    #[tokio::test]
    async fn a_broken_kubeconfig_error_shows_the_position_not_the_token() {
        let yaml = "apiVersion: v1\nusers:\n- name: u\n  user:\n    token: S3CRET-T0KEN\n   bad: [S3CRET-T0KEN\n";
        let Err(e) = SecretClient::client_from_kubeconfig_yaml(yaml).await else {
            panic!("a broken kubeconfig loaded")
        };
        assert!(!e.contains("S3CRET"), "{e}");
        assert!(e.contains("line") && e.contains("column"), "{e}");
    }

    #[test]
    fn an_update_changes_the_named_data_keys_and_carries_everything_else_back() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};
        let mut read = Secret::default();
        read.metadata.uid = Some("u".into());
        read.metadata.resource_version = Some("42".into());
        read.metadata.labels = Some([("rke.cattle.io/machine-name".to_string(), "m1".to_string())].into());
        read.metadata.annotations = Some([("a".to_string(), "b".to_string())].into());
        read.metadata.finalizers = Some(vec!["keep".into()]);
        read.metadata.owner_references = Some(vec![OwnerReference { name: "machine".into(), ..Default::default() }]);
        read.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        read.type_ = Some(MACHINE_PLAN_SECRET_TYPE.into());
        read.data = Some(
            [("plan", "p"), ("plan-state", "pending"), ("probe-statuses", "x")]
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .into(),
        );
        let base = SecretSnapshot::from_secret(read.clone()).unwrap();
        let mut updates = BTreeMap::new();
        updates.insert("plan-state".to_string(), Some(b"in-progress".to_vec()));
        updates.insert("plan-checkpoint".to_string(), Some(Vec::new()));
        updates.insert("probe-statuses".to_string(), None);
        let r = SecretRef { namespace: "ns".into(), name: "machine-plan".into() };
        let sent = put_body(&r, &base, &updates);
        let mut want = read;
        want.metadata.name = Some("machine-plan".into());
        want.metadata.namespace = Some("ns".into());
        want.metadata.managed_fields = None;
        want.data = Some(
            [("plan", "p"), ("plan-state", "in-progress"), ("plan-checkpoint", "")]
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .into(),
        );
        assert_eq!(sent, want);
    }

    #[test]
    fn snapshot_requires_uid_and_resource_version() {
        let mut secret = Secret::default();
        assert!(SecretSnapshot::from_secret(secret.clone()).is_err());
        secret.metadata.uid = Some("u".into());
        assert!(SecretSnapshot::from_secret(secret.clone()).is_err());
        secret.metadata.resource_version = Some("7".into());
        secret.data = Some([("k".to_string(), ByteString(b"v".to_vec()))].into());
        let snap = SecretSnapshot::from_secret(secret).expect("valid secret");
        assert_eq!(snap.uid, "u");
        assert_eq!(snap.resource_version, "7");
        assert_eq!(snap.data.get("k").map(Vec::as_slice), Some(&b"v"[..]));
    }
}
