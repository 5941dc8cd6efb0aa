//! The Windows agent end to end: `nodeplan.exe` (built for x86_64-pc-windows-gnu) under Wine 8,
//! in remote mode against the Linux kube-apiserver on loopback (see `k8s_support`). The
//! orchestrator's side is played by this test through its own client, as in
//! `tests/remote_agent.rs`; the instructions are the Windows test helper
//! (`tools/test-helper-windows.rs`). `tools/windows.sh` builds both programs and runs this file
//! with `NODEPLAN_WINDOWS_EXE` and `NODEPLAN_WINDOWS_HELPER` naming them; without them a plain
//! `cargo test` says so and does nothing, and with `NODEPLAN_CI` set the test fails.

mod common;
mod k8s_support;

use common::*;
use k8s_support::ControlPlane;
use nodeplan::plan::{self, Checkpoint};
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The Windows agent and helper, when `tools/windows.sh` named them.
fn programs() -> Option<(PathBuf, PathBuf)> {
    match (std::env::var_os("NODEPLAN_WINDOWS_EXE"), std::env::var_os("NODEPLAN_WINDOWS_HELPER")) {
        (Some(exe), Some(helper)) => Some((exe.into(), helper.into())),
        _ => {
            let why = "tests/windows_agent.rs runs from tools/windows.sh (it needs the Windows build under Wine)";
            assert!(std::env::var_os("NODEPLAN_CI").is_none(), "NODEPLAN_CI is set, so this must not skip: {why}");
            k8s_support::loud(&format!("*** SKIPPED: {why} ***"));
            None
        }
    }
}

/// A path as the Windows program sees it: Wine's `Z:` drive is the Linux root.
fn win(p: &Path) -> String {
    format!("Z:{}", p.display())
}

/// Wine's settings, as tools/windows.sh made them.
fn wine(program: &Path) -> std::process::Command {
    let mut c = std::process::Command::new("wine");
    c.arg(program)
        .env("WINEDEBUG", "-all")
        .env("WINEDLLOVERRIDES", "mscoree,mshtml=;bcryptprimitives=n")
        .env("DISPLAY", "");
    if std::env::var_os("WINEPREFIX").is_none() {
        c.env("WINEPREFIX", "/var/tmp/nodeplan-wine");
    }
    c
}

struct Node {
    dir: tempfile::TempDir,
    config: PathBuf,
    exe: PathBuf,
    helper: PathBuf,
    client: SecretClient,
}

impl Node {
    async fn new(cp: &ControlPlane, test: &str) -> Option<Node> {
        let (exe, helper) = programs()?;
        let namespace = cp.new_namespace(test).await;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let conn = json!({"kubeConfig": cp.kubeconfig_yaml(), "namespace": namespace, "secretName": "machine-plan"});
        std::fs::write(d.join("conn.json"), serde_json::to_vec(&conn).unwrap()).unwrap();
        let config = d.join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "remoteEnabled: true\nconnectionInfoFile: {c}\nworkDirectory: {w}\nappliedPlanDirectory: {a}\n\
                 pidDirectory: {p}\nstopTimeout: 2s\nkillTimeout: 5s\n",
                c = win(&d.join("conn.json")),
                w = win(&d.join("work")),
                a = win(&d.join("applied")),
                p = win(&d.join("pids")),
            ),
        )
        .unwrap();
        let client = SecretClient::new(cp.client().await, SecretRef { namespace, name: "machine-plan".into() });
        Some(Node { dir, config, exe, helper, client })
    }

    fn p(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The agent under Wine, its instructions' output logged (the handshakes below read it).
    fn agent(&self) -> AgentProc {
        AgentProc::spawn(wine(&self.exe), Path::new(&win(&self.config)), &[OUTPUT_LOGGED])
    }

    /// An instruction that runs the Windows helper with `args`.
    fn helper(&self, name: &str, args: &[&str]) -> serde_json::Value {
        json!({"name": name, "command": win(&self.helper), "args": args, "saveOutput": true})
    }

    /// Which of `pids` (Windows process ids) still run, as the helper sees them from inside Wine.
    fn alive(&self, pids: &[&str]) -> String {
        let out = wine(&self.helper).arg("alive").args(pids).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    async fn create(&self, plan: &serde_json::Value) -> String {
        let raw = serde_json::to_vec(plan).unwrap();
        let checksum = plan::checksum(&raw);
        let data = BTreeMap::from([("plan".to_string(), raw), ("plan-state".to_string(), b"pending".to_vec())]);
        self.client.create(data, BTreeMap::new()).await.unwrap();
        checksum
    }

    async fn annotate(&self, key: &str, value: Option<&str>) {
        self.client.orchestrator_patch(json!({"metadata": {"annotations": {key: value}}})).await.unwrap();
    }

    /// Poll the Secret (the observable outcome) until `pred` holds; a hang guard, not a sleep.
    async fn wait(&self, what: &str, pred: impl Fn(&SecretSnapshot) -> bool) -> SecretSnapshot {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let s = self.client.get().await.unwrap().expect("the secret exists");
            if pred(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "the secret never got {what}: {:?}", s.data.keys().collect::<Vec<_>>());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn val(s: &SecretSnapshot, key: &str) -> String {
    s.data.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

macro_rules! node {
    ($test:expr) => {{
        let Some(cp) = ControlPlane::shared().await else { return };
        match Node::new(cp, $test).await {
            Some(n) => n,
            None => return,
        }
    }};
}

#[tokio::test]
async fn the_windows_agent_applies_a_plan_and_reports_its_output_in_the_secret() {
    let n = node!("win-apply");
    let plan = json!({"instructions": [n.helper("hello", &["print", "0"])]});
    let checksum = n.create(&plan).await;
    let mut agent = n.agent();
    let s = n.wait("succeeded", |s| val(s, "plan-state") == "succeeded").await;
    assert_eq!(val(&s, "applied-checksum"), checksum);
    let outputs = plan::decode_one_time_output(&s.data["applied-output"]).unwrap();
    let hello = String::from_utf8_lossy(&outputs["hello"]);
    assert!(hello.contains("to stdout") && hello.contains("to stderr"), "{hello:?}");
    drop(agent.child.kill());
}

/// Cancel a plan while its first instruction runs a three-level tree (`mode`: `tree`, which ends
/// on Ctrl-C, or `tree-ignore`); returns what the agent logged of the instruction's end.
async fn cancel_a_running_tree(test: &str, mode: &str) -> Option<String> {
    let cp = ControlPlane::shared().await?;
    let n = Node::new(cp, test).await?;
    let after = n.p("after");
    let plan = json!({"instructions": [n.helper("tree", &[mode, "2"]), n.helper("after", &["touch", &win(&after)])]});
    let checksum = n.create(&plan).await;
    let mut agent = n.agent();
    let ready = agent.wait_log("ready ");
    let pids: Vec<&str> = ready.rsplit("ready ").next().unwrap().split_whitespace().collect();
    assert_eq!(pids.len(), 3, "a three-level tree: {ready}");
    assert_eq!(n.alive(&pids), pids.join(" "), "every level runs before the cancel");
    n.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = n.wait("canceled", |s| val(s, "plan-state") == "canceled").await;
    assert_eq!(n.alive(&pids), "", "no level of the tree survives the cancel");
    let c = Checkpoint::read(s.data.get("plan-checkpoint").map(Vec::as_slice), &checksum).unwrap();
    assert_eq!((c.completed_instructions, c.total_instructions), (0, 2));
    assert!(val(&s, "applied-checksum").is_empty());
    assert!(!after.exists(), "the instruction after the canceled one never runs");
    let ended = agent.wait_log("instruction 1/2 tree: canceled");
    drop(agent.child.kill());
    Some(ended)
}

#[tokio::test]
async fn a_cancel_ends_a_running_three_level_tree_through_ctrl_c() {
    if let Some(ended) = cancel_a_running_tree("win-cancel", "tree").await {
        assert!(ended.contains("exited after stop request"), "{ended}");
    }
}

#[tokio::test]
async fn a_cancel_of_a_tree_that_ignores_ctrl_c_ends_with_terminate_job_object_after_the_grace_period() {
    if let Some(ended) = cancel_a_running_tree("win-cancel-ignore", "tree-ignore").await {
        assert!(ended.contains("killed after 2s grace"), "{ended}");
    }
}

#[tokio::test]
async fn a_pause_holds_the_windows_agent_at_a_boundary_and_a_resume_goes_on() {
    let n = node!("win-pause");
    let (go, two) = (n.p("go"), n.p("two"));
    let plan = json!({"instructions": [
        n.helper("one", &["wait-file", &win(&go)]),
        n.helper("two", &["touch", &win(&two)]),
    ]});
    let checksum = n.create(&plan).await;
    let mut agent = n.agent();
    agent.wait_log("waiting");
    n.annotate(plan::ANNOTATION_PAUSED, Some("true")).await;
    agent.wait_log("pause requested");
    std::fs::write(&go, b"").unwrap();
    let s = n.wait("paused", |s| val(s, "plan-state") == "paused").await;
    let c = Checkpoint::read(s.data.get("plan-checkpoint").map(Vec::as_slice), &checksum).unwrap();
    assert_eq!((c.completed_instructions, c.total_instructions, c.paused), (1, 2, true));
    assert!(!two.exists(), "paused before the second instruction");
    n.annotate(plan::ANNOTATION_PAUSED, None).await;
    let s = n.wait("succeeded", |s| val(s, "plan-state") == "succeeded").await;
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert!(two.exists(), "the second instruction ran after the resume");
    drop(agent.child.kill());
}
