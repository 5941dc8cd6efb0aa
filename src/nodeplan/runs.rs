//! The NodePlan runs in progress, kept on the node (`nodePlanStateDirectory`): when a run
//! begins, the spec it runs is saved, so that an agent restarted while the run was in progress
//! recovers the plan it was running, not whatever the newest spec says (a producer may have
//! changed `spec.plan` meanwhile).
//!
//! When the run ends, its outcome (the status to write) is added to the same file before the
//! status write, and the file is removed once the write lands: an agent restarted after a crash
//! that left the outcome unwritten writes it instead of running the plan again (R17).
//!
//! Trust: the directory is the agent's own (made 0700, walked without following links); a file
//! is read only as a regular file of bounded size, and is believed only when the run identity
//! computed from its content is the one the NodePlan's status names. Anything else is ignored
//! with a warning: the newest spec runs instead, which is what an agent without this store does.

use super::resource::{NodePlanSpec, NodePlanStatus};
use super::wire;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The largest saved spec read back (a plan's files are inline: the object limit is 1.5 MiB).
const MAX_BYTES: u64 = 4 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Saved {
    namespace: String,
    name: String,
    run: String,
    spec: NodePlanSpec,
    /// The run's outcome, once it ended (kept until it is written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outcome: Option<NodePlanStatus>,
}

/// The saved runs of one namespace's NodePlans. `None` directory: nothing is kept.
#[derive(Debug, Clone)]
pub struct RunStore {
    dir: Option<PathBuf>,
    namespace: String,
}

impl RunStore {
    pub fn new(dir: Option<PathBuf>, namespace: &str) -> RunStore {
        RunStore { dir, namespace: namespace.to_string() }
    }

    /// Namespaces and names cannot hold `_` (DNS labels and subdomains): the file name is unique.
    fn path(&self, name: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{}_{name}.json", self.namespace)))
    }

    /// Save the spec of a run that begins (`run`: its identity).
    pub async fn save(&self, name: &str, run: &str, spec: &NodePlanSpec) -> Result<(), String> {
        self.write(name, run, spec, None).await
    }

    /// Keep the outcome of a run that ended beside its spec, until [`RunStore::remove`].
    pub async fn keep_outcome(
        &self,
        name: &str,
        run: &str,
        spec: &NodePlanSpec,
        outcome: &NodePlanStatus,
    ) -> Result<(), String> {
        self.write(name, run, spec, Some(outcome.clone())).await
    }

    async fn write(
        &self,
        name: &str,
        run: &str,
        spec: &NodePlanSpec,
        outcome: Option<NodePlanStatus>,
    ) -> Result<(), String> {
        let (Some(dir), Some(path)) = (self.dir.clone(), self.path(name)) else { return Ok(()) };
        let saved = Saved {
            namespace: self.namespace.clone(),
            name: name.to_string(),
            run: run.to_string(),
            spec: NodePlanSpec { paused: false, canceled: false, ..spec.clone() },
            outcome,
        };
        let v = serde_json::to_value(&saved).map_err(|e| e.to_string())?;
        let bytes =
            serde_json::to_vec(&crate::formats::stamp(v, crate::formats::SAVED_RUN)).map_err(|e| e.to_string())?;
        let shown = path.display().to_string();
        // R31: a disk that does not answer is an error here (the write goes on in its turn).
        let written = crate::disk::within(crate::disk::PATIENCE, move || {
            crate::safefs::make_dir(&dir, 0o700, None)?;
            crate::safefs::write_atomic(&path, &bytes, 0o600)
        })
        .await;
        match written {
            Some(r) => r.map_err(|e| format!("{shown}: {e}")),
            None => {
                Err(format!("{shown}: the disk did not answer in {}", crate::duration::human(crate::disk::PATIENCE)))
            }
        }
    }

    /// The saved spec of run `run` of `name`, if it is there and is that run.
    pub async fn load(&self, name: &str, run: &str) -> Option<NodePlanSpec> {
        self.read(name, run).await.map(|s| s.spec)
    }

    /// The kept outcome of run `run` of `name`, if it ended and the outcome is not written yet.
    pub async fn outcome(&self, name: &str, run: &str) -> Option<NodePlanStatus> {
        self.read(name, run).await.and_then(|s| s.outcome)
    }

    async fn read(&self, name: &str, run: &str) -> Option<Saved> {
        let path = self.path(name)?;
        let read_path = path.clone();
        let bytes = match crate::disk::run(move || crate::safefs::read_small(&read_path, MAX_BYTES)).await {
            Ok(Some(b)) => b,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!("{}: {e}; the newest spec runs instead", path.display());
                return None;
            }
        };
        match check(&bytes, &self.namespace, name, run) {
            Ok(saved) => Some(saved),
            Err(e) => {
                tracing::warn!("{}: {e}; the newest spec runs instead", path.display());
                None
            }
        }
    }

    /// Forget the run of `name` (it ended): in its turn on the disk lane, after the writes it
    /// follows, without waiting for it (R31).
    pub fn remove(&self, name: &str) {
        let Some(path) = self.path(name) else { return };
        crate::disk::queue(move || {
            if let Err(e) = crate::safefs::remove(&path, false) {
                tracing::warn!("{}: cannot remove it: {e}", path.display());
            }
        });
    }
}

/// A saved run, believed only when it names this NodePlan and its content is the run `run`.
fn check(bytes: &[u8], namespace: &str, name: &str, run: &str) -> Result<Saved, String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not a saved run: {e}"))?;
    crate::formats::check(&v, "saved run", crate::formats::SAVED_RUN)?;
    let saved: Saved = serde_json::from_value(v).map_err(|e| format!("not a saved run: {e}"))?;
    if saved.namespace != namespace || saved.name != name {
        return Err(format!("saved for {}/{}, not {namespace}/{name}", saved.namespace, saved.name));
    }
    let computed = wire::plan_checksum(&saved.spec).unwrap_or_default();
    if computed != saved.run {
        return Err("its content does not match its run (damaged)".into());
    }
    if saved.run != run {
        return Err(format!("it holds run {}, not {}", crate::plan::short(&saved.run), crate::plan::short(run)));
    }
    if saved.outcome.as_ref().is_some_and(|o| o.plan_checksum != saved.run) {
        return Err("its outcome is of another run (damaged)".into());
    }
    Ok(saved)
}

/// Where a config's directory puts the store (empty: none).
pub fn dir_of(p: &Path) -> Option<PathBuf> {
    (!p.as_os_str().is_empty()).then(|| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(cmd: &str) -> NodePlanSpec {
        NodePlanSpec { plan: Some(json!({"instructions": [{"name": "a", "command": cmd}]})), ..Default::default() }
    }

    #[tokio::test]
    async fn a_saved_run_comes_back_only_as_itself() {
        let d = tempfile::tempdir().unwrap();
        let store = RunStore::new(Some(d.path().join("runs")), "ns");
        let old = spec("old");
        let run = wire::plan_checksum(&old).unwrap();
        store.save("p", &run, &NodePlanSpec { paused: true, ..old.clone() }).await.unwrap();
        let back = store.load("p", &run).await.unwrap();
        assert_eq!(back, old, "pause and cancel are not saved: they come from the live spec");
        assert_eq!(store.load("p", "another-run").await, None);
        assert_eq!(store.load("q", &run).await, None, "another NodePlan has nothing saved");
        // A damaged or planted file is not believed.
        let path = d.path().join("runs/ns_p.json");
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v["spec"]["plan"]["instructions"][0]["command"] = json!("evil");
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(store.load("p", &run).await, None);
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(store.load("p", &run).await, None);
        store.remove("p");
        crate::disk::run(|| Ok(())).await.unwrap();
        assert!(!path.exists(), "removed in its turn on the lane");
        // The outcome of a run that ended is kept beside its spec, for that run only.
        store.save("p", &run, &old).await.unwrap();
        assert_eq!(store.outcome("p", &run).await, None, "a run in progress has no outcome");
        let done = NodePlanStatus { plan_checksum: run.clone(), phase: "Applied".into(), ..Default::default() };
        store.keep_outcome("p", &run, &old, &done).await.unwrap();
        assert_eq!(store.outcome("p", &run).await, Some(done.clone()));
        assert_eq!(store.load("p", &run).await, Some(old.clone()), "the spec stays readable");
        assert_eq!(store.outcome("p", "another-run").await, None);
        let other = NodePlanStatus { plan_checksum: "another-run".into(), ..done };
        store.keep_outcome("p", &run, &old, &other).await.unwrap();
        assert_eq!(store.outcome("p", &run).await, None, "an outcome of another run is not believed");
        store.remove("p");
        // No directory configured: nothing is kept, nothing fails.
        let none = RunStore::new(None, "ns");
        none.save("p", &run, &old).await.unwrap();
        assert_eq!(none.load("p", &run).await, None);
    }

    #[test]
    fn a_saved_run_for_another_object_is_refused() {
        let s = spec("x");
        let run = wire::plan_checksum(&s).unwrap();
        let saved = Saved { namespace: "a".into(), name: "p".into(), run: run.clone(), spec: s, outcome: None };
        let bytes = serde_json::to_vec(&saved).unwrap();
        assert!(check(&bytes, "a", "p", &run).is_ok());
        assert!(check(&bytes, "b", "p", &run).unwrap_err().contains("not b/p"));
    }
}
