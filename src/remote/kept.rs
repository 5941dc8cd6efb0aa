//! The Secret's outcome, kept on the node until it is written (R17): a finished run is recorded
//! in `appliedPlanDirectory` before its outcome is written to the Secret, and forgotten once the
//! write lands. An agent restarted before that (SIGTERM, SIGKILL, a reboot while the API server
//! was unreachable) writes the recorded outcome instead of running the plan a second time.
//!
//! The file is `kept-outcome_<namespace>_<name>.json`, mode 0600, in the agent's own directory
//! (made 0700). It carries the Secret's uid and the plan's checksum. It is believed only when it
//! names this Secret, this uid and this plan, and only while the Secret still shows that run
//! `in-progress` (or, for a Secret without `plan-state`, still carries that plan). Anything else is
//! dropped with one line, and the plan is decided as it would be without the file. It is read as
//! a regular file of bounded size, without following links.

use super::client::SecretRef;
use super::wire::Keys;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The largest kept outcome read back (outputs are capped well below the Secret's 1 MiB).
const MAX_BYTES: u64 = 8 << 20;

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    namespace: String,
    name: String,
    uid: String,
    checksum: String,
    /// Data keys to set (base64) or delete (null).
    keys: BTreeMap<String, Option<String>>,
}

/// An outcome read back from the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub uid: String,
    pub checksum: String,
    pub keys: Keys,
}

/// Where the Secret's kept outcome lives. `None` directory: nothing is kept on the node.
#[derive(Debug, Clone)]
pub struct KeptStore {
    path: Option<PathBuf>,
    secret: SecretRef,
}

impl KeptStore {
    pub fn new(dir: Option<&Path>, secret: &SecretRef) -> KeptStore {
        // Namespaces and names cannot hold `_` (DNS labels and subdomains): the name is unique.
        let path = dir.map(|d| d.join(format!("kept-outcome_{}_{}.json", secret.namespace, secret.name)));
        KeptStore { path, secret: secret.clone() }
    }

    /// Record `keys` for the plan `checksum` of the Secret with `uid`, before they are written.
    /// A failure is one warning: the write itself goes on.
    pub async fn save(&self, uid: &str, checksum: &str, keys: &Keys) {
        let Some(path) = self.path.clone() else { return };
        let record = Record {
            namespace: self.secret.namespace.clone(),
            name: self.secret.name.clone(),
            uid: uid.to_string(),
            checksum: checksum.to_string(),
            keys: keys.iter().map(|(k, v)| (k.clone(), v.as_ref().map(|b| BASE64.encode(b)))).collect(),
        };
        let shown = path.display().to_string();
        let bytes = serde_json::to_value(&record)
            .and_then(|v| serde_json::to_vec(&crate::formats::stamp(v, crate::formats::KEPT_OUTCOME)));
        let Ok(bytes) = bytes else { return };
        let saved = crate::disk::within(crate::disk::PATIENCE, move || {
            if let Some(dir) = path.parent() {
                crate::safefs::make_dir(dir, 0o700, None)?;
            }
            crate::safefs::write_atomic(&path, &bytes, 0o600)
        })
        .await;
        match saved {
            Some(Ok(())) => {}
            Some(Err(e)) => tracing::warn!("{shown}: cannot keep the outcome on the node: {e}"),
            // R31: the record only guards a restart; the Secret is the other copy.
            None => tracing::warn!(
                "{shown}: the disk did not answer in {}; the outcome goes to the Secret without waiting to be kept on the node",
                crate::duration::human(crate::disk::PATIENCE)
            ),
        }
    }

    /// Forget the kept outcome (it landed, or no longer applies): in its turn on the disk lane,
    /// after the save it follows, without waiting for it (R31).
    pub fn clear(&self) {
        let Some(path) = self.path.clone() else { return };
        crate::disk::queue(move || {
            if let Err(e) = crate::safefs::remove(&path, false) {
                tracing::warn!("{}: cannot remove the kept outcome: {e}", path.display());
            }
        });
    }

    /// The kept outcome, if there is one that names this Secret.
    pub async fn load(&self) -> Option<Kept> {
        let path = self.path.clone()?;
        let read = path.clone();
        let bytes = match crate::disk::run(move || crate::safefs::read_small(&read, MAX_BYTES)).await {
            Ok(Some(b)) => b,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!("{}: {e}; ignored", path.display());
                return None;
            }
        };
        match parse(&bytes, &self.secret) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!("{}: {e}; ignored", path.display());
                None
            }
        }
    }
}

fn parse(bytes: &[u8], secret: &SecretRef) -> Result<Kept, String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not a kept outcome: {e}"))?;
    crate::formats::check(&v, "kept outcome", crate::formats::KEPT_OUTCOME)?;
    let r: Record = serde_json::from_value(v).map_err(|e| format!("not a kept outcome: {e}"))?;
    if r.namespace != secret.namespace || r.name != secret.name {
        return Err(format!("names secret {}/{}, not {}/{}", r.namespace, r.name, secret.namespace, secret.name));
    }
    let mut keys = Keys::new();
    for (k, v) in r.keys {
        let v = match v {
            Some(s) => Some(BASE64.decode(s).map_err(|e| format!("key {}: {e}", crate::quoted(&k)))?),
            None => None,
        };
        keys.insert(k, v);
    }
    Ok(Kept { uid: r.uid, checksum: r.checksum, keys })
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn secret(ns: &str, name: &str) -> SecretRef {
        SecretRef { namespace: ns.into(), name: name.into() }
    }

    #[tokio::test]
    async fn an_outcome_is_kept_read_back_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeptStore::new(Some(&dir.path().join("applied")), &secret("ns", "machine-plan"));
        assert_eq!(store.load().await, None);
        let keys = Keys::from([("plan-state".to_string(), Some(b"succeeded".to_vec())), ("gone".to_string(), None)]);
        store.save("u1", "abc", &keys).await;
        let got = store.load().await.expect("kept");
        assert_eq!(got, Kept { uid: "u1".into(), checksum: "abc".into(), keys });
        let file = dir.path().join("applied/kept-outcome_ns_machine-plan.json");
        let mode = std::fs::metadata(&file).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
        store.clear();
        assert_eq!(store.load().await, None);
        assert!(!file.exists());
        // Nothing kept without a directory.
        let none = KeptStore::new(None, &secret("ns", "machine-plan"));
        none.save("u", "c", &Keys::new()).await;
        assert_eq!(none.load().await, None);
    }

    #[test]
    fn a_record_is_believed_only_for_its_secret_and_format() {
        let mine = secret("ns", "p");
        let ok = br#"{"nodeplanFormat":1,"namespace":"ns","name":"p","uid":"u","checksum":"c","keys":{"k":"eA=="}}"#;
        assert_eq!(parse(ok, &mine).unwrap().keys, Keys::from([("k".to_string(), Some(b"x".to_vec()))]));
        let other = br#"{"nodeplanFormat":1,"namespace":"ns","name":"q","uid":"u","checksum":"c","keys":{}}"#;
        assert!(parse(other, &mine).unwrap_err().contains("names secret ns/q"));
        let newer = br#"{"nodeplanFormat":9,"namespace":"ns","name":"p","uid":"u","checksum":"c","keys":{}}"#;
        assert!(parse(newer, &mine).is_err());
        let bad = br#"{"nodeplanFormat":1,"namespace":"ns","name":"p","uid":"u","checksum":"c","keys":{"k":"%%"}}"#;
        assert!(parse(bad, &mine).unwrap_err().contains("key \"k\""));
        assert!(parse(b"\x00garbage", &mine).is_err());
    }
}
