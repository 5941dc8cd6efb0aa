//! `SecretClient` against a real kube-apiserver + etcd (see `k8s_support`; 1.20.2 and the current
//! release, one run each).
//!
//! All tests but the restart one share the binary's control plane, each in its own namespace.
//! Timeouts below are hang guards only; nothing waits for time to pass.

mod k8s_support;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_support::{ControlPlane, map};
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot, WriteError};

/// Hang guard for anything a watch should deliver.
const GUARD: Duration = Duration::from_secs(30);

type Snapshots = Pin<Box<dyn Stream<Item = Option<SecretSnapshot>> + Send>>;

async fn secret_client(cp: &ControlPlane, test: &str) -> SecretClient {
    let namespace = cp.new_namespace(test).await;
    SecretClient::new(cp.client().await, SecretRef { namespace, name: "machine-plan".into() })
}

fn bytes_map(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
}

/// Read the watch until `want` holds for an item; panics if the guard expires or the stream ends.
async fn wait_for(
    stream: &mut Snapshots,
    what: &str,
    want: impl Fn(&Option<SecretSnapshot>) -> bool,
) -> Option<SecretSnapshot> {
    let found = tokio::time::timeout(GUARD, async {
        while let Some(item) = stream.next().await {
            if want(&item) {
                return Some(item);
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(item)) => item,
        Ok(None) => panic!("watch stream ended while waiting for {what}"),
        Err(_) => panic!("no {what} from the watch within {GUARD:?}"),
    }
}

/// The control plane is the version this run means to test: what the server reports at
/// `/version` is what its binary says, and, when `tools/test.sh` names the version a run is for
/// (`NODEPLAN_K8S_EXPECT_VERSION`: 1.20.2 for the first run, tools/k8s-current/go.mod's for the
/// second), that one. Without it a second run silently against the first run's cache would pass.
#[tokio::test]
async fn the_control_plane_is_the_version_under_test() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let served = cp.client().await.apiserver_version().await.expect("GET /version");
    let binary = cp.version();
    assert_eq!(served.git_version, binary.git, "the server is the binary the cache holds");
    assert_eq!(served.minor.trim_end_matches('+'), binary.minor.to_string(), "{served:?}");
    if let Some(want) = std::env::var_os("NODEPLAN_K8S_EXPECT_VERSION").filter(|v| !v.is_empty()) {
        assert_eq!(served.git_version, want.to_string_lossy(), "the kube-apiserver NODEPLAN_K8S_BIN names");
    }
}

#[tokio::test]
async fn create_then_get_returns_the_same_snapshot() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "create-get").await;
    assert_eq!(sc.get().await.expect("get before create"), None);
    let created = sc
        .create(bytes_map(&[("plan", "{}"), ("plan-state", "pending")]), map(&[("rke.cattle.io/x", "1".to_string())]))
        .await
        .expect("create");
    assert!(!created.uid.is_empty() && !created.resource_version.is_empty());
    assert_eq!(created.data.get("plan-state").map(Vec::as_slice), Some(&b"pending"[..]));
    assert_eq!(created.annotations.get("rke.cattle.io/x").map(String::as_str), Some("1"));
    let got = sc.get().await.expect("get").expect("secret exists");
    assert_eq!(got, created);
}

#[tokio::test]
async fn update_data_with_current_rv_succeeds_and_bumps_rv() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "patch-current").await;
    let created = sc.create(bytes_map(&[("plan", "{}")]), BTreeMap::new()).await.expect("create");
    let updates = map(&[("plan-state", Some(b"in-progress".to_vec())), ("plan-checkpoint", Some(Vec::new()))]);
    let patched = sc.update_data(&created, &updates).await.expect("patch with current rv");
    assert_ne!(patched.resource_version, created.resource_version);
    assert_eq!(patched.uid, created.uid);
    assert_eq!(patched.data.get("plan-state").map(Vec::as_slice), Some(&b"in-progress"[..]));
    assert_eq!(
        patched.data.get("plan-checkpoint").map(Vec::as_slice),
        Some(&b""[..]),
        "empty value is kept, not deleted"
    );
    assert_eq!(patched.data.get("plan").map(Vec::as_slice), Some(&b"{}"[..]), "untouched keys survive");
    assert_eq!(sc.get().await.expect("get"), Some(patched));
}

#[tokio::test]
async fn update_data_with_stale_rv_conflicts_and_changes_nothing() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "patch-stale").await;
    let created = sc.create(bytes_map(&[("plan-state", "pending")]), BTreeMap::new()).await.expect("create");
    // The orchestrator writes in between, so `created.resource_version` is stale.
    let current =
        sc.orchestrator_patch(serde_json::json!({"metadata": {"annotations": {"a": "b"}}})).await.expect("patch");
    assert_ne!(current.resource_version, created.resource_version);
    let updates = map(&[("plan-state", Some(b"in-progress".to_vec()))]);
    let err = sc.update_data(&created, &updates).await.expect_err("stale rv must not apply");
    assert_eq!(err, WriteError::Conflict);
    assert_eq!(sc.get().await.expect("get"), Some(current), "a rejected update changes nothing");
}

#[tokio::test]
async fn update_data_none_deletes_the_key() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "patch-delete").await;
    let created =
        sc.create(bytes_map(&[("plan", "{}"), ("probe-statuses", "{}")]), BTreeMap::new()).await.expect("create");
    let updates = map(&[("probe-statuses", None), ("never-existed", None)]);
    let patched = sc.update_data(&created, &updates).await.expect("patch");
    assert!(!patched.data.contains_key("probe-statuses"));
    assert!(!patched.data.contains_key("never-existed"));
    assert_eq!(patched.data.get("plan").map(Vec::as_slice), Some(&b"{}"[..]));
}

#[tokio::test]
async fn update_data_on_a_missing_secret_is_refused() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "patch-missing").await;
    let gone = SecretSnapshot { uid: "u".into(), resource_version: "1".into(), ..SecretSnapshot::default() };
    let err = sc.update_data(&gone, &map(&[("k", Some(b"v".to_vec()))])).await.expect_err("no secret");
    // Its uid precondition fails first (409); either answer makes the writer read and give up.
    assert!(matches!(err, WriteError::Conflict | WriteError::NotFound), "{err:?}");
}

#[tokio::test]
async fn watch_delivers_an_annotation_change() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "watch-annotation").await;
    let created = sc.create(bytes_map(&[("plan", "{}")]), BTreeMap::new()).await.expect("create");
    let mut stream: Snapshots = Box::pin(sc.watch());
    wait_for(&mut stream, "the initial snapshot", |s| s.as_ref() == Some(&created)).await;
    let patched = sc
        .orchestrator_patch(
            serde_json::json!({"metadata": {"annotations": {"rke.cattle.io/plan-last-updated": "now"}}}),
        )
        .await
        .expect("annotate");
    let seen = wait_for(&mut stream, "the annotation change", |s| {
        s.as_ref().is_some_and(|s| s.annotations.contains_key("rke.cattle.io/plan-last-updated"))
    })
    .await;
    assert_eq!(seen, Some(patched));
}

#[tokio::test]
async fn watch_started_before_the_secret_exists_yields_none_then_the_snapshot() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let sc = secret_client(cp, "watch-before-create").await;
    let mut stream: Snapshots = Box::pin(sc.watch());
    let first = tokio::time::timeout(GUARD, stream.next()).await.expect("watch yields within the guard");
    assert_eq!(first, Some(None), "first item says the secret does not exist");
    let created = sc.create(bytes_map(&[("plan", "{}")]), BTreeMap::new()).await.expect("create");
    let seen = wait_for(&mut stream, "the created secret", |s| s.is_some()).await;
    assert_eq!(seen, Some(created));
    sc.delete().await.expect("delete");
    wait_for(&mut stream, "the deletion", Option::is_none).await;
}

#[tokio::test]
async fn watch_keeps_delivering_after_an_apiserver_restart() {
    // Its own control plane: stopping the shared apiserver would break the other tests.
    let Some(mut cp) = ControlPlane::start().await else { return };
    k8s_support::loud(&format!("control plane (own) started in {:?}", cp.started_in()));
    let sc = secret_client(&cp, "watch-restart").await;
    let created = sc.create(bytes_map(&[("plan", "{}")]), BTreeMap::new()).await.expect("create");
    let mut stream: Snapshots = Box::pin(sc.watch());
    wait_for(&mut stream, "the initial snapshot", |s| s.as_ref() == Some(&created)).await;
    // A change seen through the watch: the watch itself (not only the list) is established. From
    // here on the stream is read all the time, as the agent reads it.
    let before = sc
        .orchestrator_patch(serde_json::json!({"metadata": {"annotations": {"before-restart": "yes"}}}))
        .await
        .expect("annotate before restart");
    wait_for(&mut stream, "the update made before the restart", |s| s.as_ref() == Some(&before)).await;
    let (tx, mut items) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Some(item) = stream.next().await {
            if tx.send(item).is_err() {
                break;
            }
        }
    });

    let t0 = std::time::Instant::now();
    cp.stop_apiserver().await;
    cp.start_apiserver().await;
    k8s_support::loud(&format!("apiserver stop + start took {:?}", t0.elapsed()));
    // The watch lists again after the outage: the unchanged Secret is the first item (how the
    // agent learns that the apiserver is back; resuming from the last resourceVersion would say
    // nothing until the next change).
    let again = tokio::time::timeout(GUARD, items.recv()).await.expect("an item after the restart");
    assert_eq!(again, Some(Some(before.clone())), "the unchanged secret, listed again");

    let patched = sc
        .orchestrator_patch(serde_json::json!({"metadata": {"annotations": {"after-restart": "yes"}}}))
        .await
        .expect("annotate after restart");
    let t1 = std::time::Instant::now();
    let seen = tokio::time::timeout(GUARD, async {
        loop {
            match items.recv().await {
                Some(Some(s)) if s.annotations.contains_key("after-restart") => return s,
                Some(_) => {}
                None => panic!("the watch stream ended"),
            }
        }
    })
    .await
    .expect("the update made after the restart");
    k8s_support::loud(&format!("the update after the restart arrived {:?} after the patch", t1.elapsed()));
    assert_eq!(seen, patched);
    reader.abort();
}

#[tokio::test]
async fn client_from_kubeconfig_yaml_trusts_only_the_given_ca() {
    let Some(cp) = ControlPlane::shared().await else { return };
    let namespace = cp.new_namespace("kubeconfig").await;
    let secret = SecretRef { namespace, name: "machine-plan".into() };

    let good = SecretClient::client_from_kubeconfig_yaml(&cp.kubeconfig_yaml()).await.expect("client");
    let sc = SecretClient::new(good, secret.clone());
    assert_eq!(sc.get().await.expect("get over the kubeconfig's CA"), None);

    // The same kubeconfig with a CA that did not sign the server's certificate.
    let other_ca = k8s_support::throwaway_ca_pem(cp.dir());
    let yaml = cp.kubeconfig_yaml_with_ca(&other_ca);
    let bad = SecretClient::client_from_kubeconfig_yaml(&yaml).await.expect("client builds");
    let err = SecretClient::new(bad, secret).get().await.expect_err("wrong CA must fail the TLS handshake");
    k8s_support::loud(&format!("wrong CA: {err}"));
    assert!(err.to_lowercase().contains("certificate") || err.to_lowercase().contains("tls"), "{err}");

    let insecure: String = cp
        .kubeconfig_yaml()
        .lines()
        .map(|l| if l.contains("certificate-authority-data:") { "    insecure-skip-tls-verify: true" } else { l })
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(SecretClient::client_from_kubeconfig_yaml(&insecure).await.is_err(), "insecure-skip-tls-verify is refused");
}
