//! Remote mode end to end: the real `nodeplan agent` binary against a real kube-apiserver + etcd
//! (see `k8s_support`; 1.20.2 and the current release), one namespace per test. The orchestrator's
//! side is played by the test through its own client. Timeouts are hang guards; the only deliberate
//! waits are the bounded observation windows that prove something does NOT happen.

mod common;
mod k8s_support;

use common::*;
use k8s_support::{ControlPlane, wait_events};
use nodeplan::plan::{self, Checkpoint, PlanState};
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

struct Remote {
    node: ClusterNode,
    client: SecretClient,
}

impl std::ops::Deref for Remote {
    type Target = ClusterNode;
    fn deref(&self) -> &ClusterNode {
        &self.node
    }
}

impl Remote {
    async fn new(cp: &ControlPlane, test: &str) -> Remote {
        Remote::new_with(cp, test, &cp.kubeconfig_yaml()).await
    }

    /// The agent connects with `kubeconfig` (the test's own client stays the admin's).
    async fn new_with(cp: &ControlPlane, test: &str, kubeconfig: &str) -> Remote {
        let namespace = cp.new_namespace(test).await;
        let client = SecretClient::new(
            cp.client().await,
            SecretRef { namespace: namespace.clone(), name: "machine-plan".into() },
        );
        Remote { node: ClusterNode::new("remoteEnabled: true\n", kubeconfig, &namespace), client }
    }

    /// Create the plan Secret the way an orchestrator does.
    async fn create(&self, plan: &serde_json::Value, state: Option<&str>, annotations: &[(&str, &str)]) -> String {
        let raw = serde_json::to_vec(plan).unwrap();
        let checksum = plan::checksum(&raw);
        let mut data = BTreeMap::from([("plan".to_string(), raw), ("probe-period-seconds".to_string(), b"1".to_vec())]);
        if let Some(s) = state {
            data.insert("plan-state".into(), s.as_bytes().to_vec());
        }
        let ann = annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.client.create(data, ann).await.unwrap();
        checksum
    }

    /// Give the Secret a new plan to apply (`plan-state: pending`), as Rancher does.
    async fn new_plan(&self, plan: &serde_json::Value) -> SecretSnapshot {
        self.patch(json!({"data": {"plan": b64(&serde_json::to_vec(plan).unwrap()), "plan-state": b64(b"pending")}}))
            .await
    }

    async fn patch(&self, patch: serde_json::Value) -> SecretSnapshot {
        self.client.orchestrator_patch(patch).await.unwrap()
    }

    async fn annotate(&self, key: &str, value: Option<&str>) {
        self.patch(json!({"metadata": {"annotations": {key: value}}})).await;
    }

    async fn set_state(&self, state: &str) {
        use base64::Engine as _;
        self.patch(json!({"data": {"plan-state": base64::engine::general_purpose::STANDARD.encode(state)}})).await;
    }

    async fn get(&self) -> SecretSnapshot {
        self.client.get().await.unwrap().expect("the secret exists")
    }

    /// Poll the Secret (the observable outcome) until `pred` holds.
    async fn wait(&self, what: &str, pred: impl Fn(&SecretSnapshot) -> bool) -> SecretSnapshot {
        self.wait_within(GUARD, what, pred).await
    }

    async fn wait_within(&self, guard: Duration, what: &str, pred: impl Fn(&SecretSnapshot) -> bool) -> SecretSnapshot {
        let deadline = Instant::now() + guard;
        loop {
            let s = self.get().await;
            if pred(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "the secret never got {what}: {}", describe(&s));
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn val(s: &SecretSnapshot, key: &str) -> String {
    s.data.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

/// The checksum of the plan the Secret carries.
fn wire_checksum(s: &SecretSnapshot) -> String {
    plan::checksum(&s.data["plan"])
}

fn state(s: &SecretSnapshot) -> String {
    val(s, "plan-state")
}

fn checkpoint(s: &SecretSnapshot, checksum: &str) -> Option<Checkpoint> {
    Checkpoint::read(s.data.get("plan-checkpoint").map(Vec::as_slice), checksum)
}

fn describe(s: &SecretSnapshot) -> String {
    let keys: Vec<String> = s
        .data
        .iter()
        .filter(|(k, _)| k.as_str() != "plan" && !k.contains("output"))
        .map(|(k, v)| format!("{k}={}", String::from_utf8_lossy(v)))
        .collect();
    format!("rv {} {keys:?} annotations {:?}", s.resource_version, s.annotations)
}

fn sh(name: &str, script: &str) -> serde_json::Value {
    json!({"name": name, "command": "sh", "args": ["-c", script], "saveOutput": true})
}

macro_rules! control_plane {
    () => {
        match ControlPlane::shared().await {
            Some(cp) => cp,
            None => return,
        }
    };
}

#[tokio::test]
async fn pending_to_in_progress_to_succeeded_with_decoded_outputs() {
    let cp = control_plane!();
    let r = Remote::new(cp, "succeed").await;
    let marker = r.p("marker");
    let plan = json!({"instructions": [sh("one", &format!("echo one >> {marker}; echo out-one")), sh("two", "echo err-two >&2")]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "plan-revision"), "1");
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert_eq!(val(&s, "success-count"), "1");
    assert_eq!(val(&s, "failure-count"), "0");
    assert_eq!(val(&s, "plan-checkpoint"), "", "cleared with an empty value");
    let out = plan::decode_one_time_output(&s.data["applied-output"]).unwrap();
    assert_eq!(out["one"], b"out-one\n");
    assert_eq!(out["two"], b"err-two\n", "saveOutput keeps stderr too");
    assert!(plan::parse_unix_date(&val(&s, "last-apply-time")).is_some());
    // Succeeded is terminal: the agent's own writes echoing back never re-run it.
    agent.wait_log("succeeded (2/2 instructions)");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\n");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn failure_counters_and_pending_again_reruns_from_the_first_instruction() {
    let cp = control_plane!();
    let r = Remote::new(cp, "fail").await;
    let (log, ok) = (r.p("log"), r.p("ok"));
    let plan = json!({"instructions": [
        sh("first", &format!("echo first-$CATTLE_AGENT_ATTEMPT_NUMBER >> {log}")),
        sh("check", &format!("echo checking; test -e {ok}")),
    ]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    let s = r.wait("failed", |s| state(s) == "failed").await;
    assert_eq!(val(&s, "failure-count"), "1");
    assert_eq!(val(&s, "failed-checksum"), checksum);
    assert_eq!(val(&s, "success-count"), "0");
    assert!(val(&s, "applied-checksum").is_empty());
    assert_eq!(plan::decode_one_time_output(&s.data["failed-output"]).unwrap()["check"], b"checking\n");
    // failed is terminal until the orchestrator writes pending again.
    std::fs::write(&ok, b"").unwrap();
    r.set_state("pending").await;
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "plan-revision"), "2");
    assert_eq!(val(&s, "failure-count"), "0");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "first-1\nfirst-1\n", "re-run from the first instruction");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn checksum_flow_counts_failures_and_waits_out_the_cooldown() {
    let cp = control_plane!();
    let r = Remote::new(cp, "legacy").await;
    let plan = json!({"instructions": [sh("fails", "exit 3")]});
    let raw = serde_json::to_vec(&plan).unwrap();
    let checksum = plan::checksum(&raw);
    r.client
        .create(
            BTreeMap::from([
                ("plan".into(), raw),
                ("max-failures".into(), b"2".to_vec()),
                ("probe-period-seconds".into(), b"1".to_vec()),
            ]),
            BTreeMap::from([(plan::ANNOTATION_PAUSED.to_string(), "true".to_string())]),
        )
        .await
        .unwrap();
    let mut agent = r.agent();
    let first = r.wait("a first failure", |s| val(s, "failure-count") == "1").await;
    agent.wait_log("annotations are ignored without plan-state");
    assert_eq!(val(&first, "failed-checksum"), checksum);
    assert!(!first.data.contains_key("plan-state"), "the checksum flow never writes plan-state");
    let second =
        r.wait_within(GUARD * 3, "a second failure after the cooldown", |s| val(s, "failure-count") == "2").await;
    let t1 = plan::parse_unix_date(&val(&first, "last-apply-time")).unwrap();
    let t2 = plan::parse_unix_date(&val(&second, "last-apply-time")).unwrap();
    assert!(t2 - t1 >= chrono::TimeDelta::seconds(30), "retried {} s after the failure", (t2 - t1).num_seconds());
    // Retried when its cooldown is over, as system-agent does (30-35 s), not at the loop's
    // 60 s re-check.
    assert!(t2 - t1 <= chrono::TimeDelta::seconds(45), "retried {} s after the failure", (t2 - t1).num_seconds());
    assert_eq!(agent.stop(), 0);
}

/// Pause mid-plan, then resume (by removing the annotation or setting "false").
async fn pause_and_resume(release_by_false: bool) {
    let cp = control_plane!();
    let r = Remote::new(cp, if release_by_false { "pause-false" } else { "pause" }).await;
    let (ready, go, marker) = (r.fifo("ready"), r.fifo("go"), r.p("marker"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {marker}")),
        sh("two", &format!("echo two >> {marker}; echo > {ready}; cat {go} > /dev/null")),
        sh("three", &format!("echo three >> {marker}")),
    ]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    read_fifo(&ready);
    r.annotate(plan::ANNOTATION_PAUSED, Some("true")).await;
    agent.wait_log("pause requested");
    release_fifo(&go);
    let s = r.wait("paused", |s| state(s) == "paused").await;
    let cp1 = checkpoint(&s, &checksum).unwrap();
    assert_eq!((cp1.completed_instructions, cp1.total_instructions, cp1.paused), (2, 3, true));
    assert_eq!(cp1.resume_state, Some(PlanState::InProgress));
    assert!(val(&s, "applied-checksum").is_empty(), "no applied-checksum until done");
    assert!(plan::decode_one_time_output(&s.data["applied-output"]).unwrap().contains_key("two"), "outputs kept (R12)");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\n");
    r.annotate(plan::ANNOTATION_PAUSED, if release_by_false { Some("false") } else { None }).await;
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\nthree\n", "finished instructions are not re-run");
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn pause_mid_plan_then_resume_without_rerunning() {
    pause_and_resume(false).await;
}

#[tokio::test]
async fn false_releases_a_pause_like_removal() {
    pause_and_resume(true).await;
}

/// A plan of two instructions and a probe, `paused` by its annotation, with the checkpoint
/// `checkpoint(checksum)` written as `plan-checkpoint`, and an agent started on it that has read
/// it (its probe statuses are its first write). Returns the node, the instructions' marker file,
/// the agent and the Secret then.
async fn held_with_checkpoint(
    cp: &ControlPlane,
    test: &str,
    checkpoint: impl Fn(&str) -> String,
) -> (Remote, String, AgentProc, SecretSnapshot) {
    let r = Remote::new(cp, test).await;
    let marker = r.p("marker");
    let port = http_server(Arc::new(AtomicU16::new(200)));
    let plan = json!({
        "instructions": [sh("one", &format!("echo one >> {marker}")), sh("two", &format!("echo two >> {marker}"))],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}}}
    });
    let checksum = r.create(&plan, Some("paused"), &[(plan::ANNOTATION_PAUSED, "true")]).await;
    r.patch(json!({"data": {"plan-checkpoint": b64(checkpoint(&checksum).as_bytes())}})).await;
    let agent = r.agent();
    let s = r.wait("probe statuses", |s| s.data.contains_key("probe-statuses")).await;
    (r, marker, agent, s)
}

#[tokio::test]
async fn a_pause_survives_an_agent_restart() {
    let cp = control_plane!();
    // A checkpoint says one instruction is done.
    let checkpoint = |checksum: &str| {
        Checkpoint {
            checksum: checksum.to_string(),
            completed_instructions: 1,
            total_instructions: 2,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        }
        .to_json()
    };
    let (r, marker, mut first, _) = held_with_checkpoint(cp, "pause-restart", checkpoint).await;
    assert_eq!(first.stop(), 0);
    r.patch(json!({"data": {"probe-statuses": null}})).await;
    let mut second = r.agent();
    let s = r.wait("probe statuses from the restarted agent", |s| s.data.contains_key("probe-statuses")).await;
    assert_eq!(state(&s), "paused");
    assert!(!Path::new(&marker).exists(), "nothing runs while the pause holds, across restarts");
    r.annotate(plan::ANNOTATION_PAUSED, None).await;
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "two\n", "resumed from the checkpoint");
    assert_eq!(second.stop(), 0);
}

/// Rancher's checkpoint struct leaves zero fields out: a pending plan it paused before it started
/// carries no `completedInstructions`. The agent takes that checkpoint as it is (no rewrite
/// without `resumeState`), and the resume starts the plan as Rancher's pending plan: at
/// revision 1, from its first instruction.
#[tokio::test]
async fn a_checkpoint_without_its_zero_fields_is_taken_as_written() {
    let cp = control_plane!();
    let rancher = |checksum: &str| {
        format!(r#"{{"checksum":"{checksum}","totalInstructions":2,"resumeState":"pending","paused":true}}"#)
    };
    let (r, marker, mut agent, s) = held_with_checkpoint(cp, "omitempty", rancher).await;
    let rancher = rancher(&wire_checksum(&s));
    assert_eq!(state(&s), "paused");
    assert_eq!(val(&s, "plan-checkpoint"), rancher, "Rancher's checkpoint is kept as written");
    assert!(!Path::new(&marker).exists(), "nothing runs while the pause holds");
    r.annotate(plan::ANNOTATION_PAUSED, None).await;
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "plan-revision"), "1", "resumed into pending: the run gets its revision");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\n");
    assert_eq!(agent.stop(), 0);
}

/// Rancher's store deletes `probe-statuses` at every assignment and judges a plan successful
/// only once the key is back and healthy: a plan without probes must say `{}` (system-agent
/// does), at its first assignment and at every new one.
#[tokio::test]
async fn a_plan_without_probes_reports_empty_probe_statuses() {
    let cp = control_plane!();
    let r = Remote::new(cp, "no-probes").await;
    let plan = json!({"instructions": [sh("one", "true")]});
    r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "probe-statuses"), "{}", "{}", describe(&s));
    // A new assignment, as Rancher's store writes it: the plan, pending, probe statuses deleted.
    let raw = serde_json::to_vec(&json!({"instructions": [sh("two", "true")]})).unwrap();
    let checksum = plan::checksum(&raw);
    r.patch(nodeplan::remote::wire::push_patch(&raw)).await;
    let s =
        r.wait("the new plan succeeded", |s| val(s, "applied-checksum") == checksum && state(s) == "succeeded").await;
    assert_eq!(val(&s, "probe-statuses"), "{}", "{}", describe(&s));
    assert_eq!(agent.stop(), 0);
}

/// How long the relay stays silent in the partition tests: long enough for the agent's Lease
/// renewal and its watch to be caught in the hole.
const HOLE: Duration = Duration::from_secs(12);
/// What "within 30 s of the heal" allows (issue 21).
const AFTER_HEAL: Duration = Duration::from_secs(30);

/// The port of the control plane's API server.
fn apiserver_port(cp: &ControlPlane) -> u16 {
    cp.server_url().rsplit(':').next().and_then(|p| p.parse().ok()).expect("the server URL ends in a port")
}

/// A silent partition (packets stop without a FIN or an RST; afterwards new connections are
/// carried while the old ones stay dead) never needs a restart of the agent: a cancel written
/// right after the heal stops the running instruction's tree, and a new plan written right after
/// a second heal is applied, each within 30 s of the heal, and nothing runs twice. The agent holds
/// its Lease (the default), whose renewals see the comeback first.
#[tokio::test]
async fn a_silent_partition_heals_without_a_restart() {
    heals_through_a_relay("silence", Hole::Silence).await;
}

/// The same through an HTTP proxy that goes silent: the tunnel carries the same HTTP/2
/// connection, PINGed, as a direct one (it was kube's HTTP/1.1 client, without PINGs or
/// `TCP_NODELAY`).
#[tokio::test]
async fn a_silent_partition_heals_without_a_restart_behind_a_proxy() {
    let cp = control_plane!();
    let relay = Relay::start_proxy(apiserver_port(cp));
    let kubeconfig = relay.proxied_kubeconfig(&cp.kubeconfig_yaml(), &cp.server_url());
    let r = Remote::new_with(cp, "silence-proxied", &kubeconfig).await;
    heals_after(&r, &relay, "HTTP/2, PINGed", Hole::Silence).await;
    assert!(relay.carried() >= 2, "the agent went through the proxy, again after each hole: {}", relay.carried());
}

/// The same when the path slows to a trickle (a byte each way every 50 ms) instead of going
/// silent, and the connections that were slow stay slow after the heal: nothing is lost or closed,
/// so only the client's own liveness checks (a PING answered too late behind the trickling bytes,
/// a Lease renewal that gets no answer in time) move it to a new connection.
#[tokio::test]
async fn a_slow_path_heals_without_a_restart() {
    heals_through_a_relay("slow", Hole::Slow).await;
}

/// The same when every connection is reset (an RST, as from a firewall that lost its state) and
/// new ones are reset until the network is restored.
#[tokio::test]
async fn connections_reset_heal_without_a_restart() {
    heals_through_a_relay("reset", Hole::Reset).await;
}

/// [`heals_after`] for an agent `name` that reaches the API server through a relay (HTTP/2).
async fn heals_through_a_relay(name: &str, hole: Hole) {
    let cp = control_plane!();
    let relay = Relay::start(apiserver_port(cp));
    let r = Remote::new_with(cp, name, &relay.kubeconfig(&cp.kubeconfig_yaml(), &cp.server_url())).await;
    heals_after(&r, &relay, "HTTP/2, PINGed", hole).await;
}

/// A plan runs; the relay has a `hole` for [`HOLE`]; a cancel written right after the heal stops
/// it; again a hole; a plan written right after the heal is applied: each within [`AFTER_HEAL`],
/// nothing twice, by the same agent. `nodeplan status` says how the agent talks to the API
/// server (`over`) and, during the hole, since when its requests fail.
async fn heals_after(r: &Remote, relay: &Relay, over: &str, hole: Hole) {
    let (ready, pid, marker) = (r.fifo("ready"), r.p("pid"), r.p("marker"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {marker}")),
        sh("long", &format!("echo long >> {marker}; echo $$ > {pid}; echo > {ready}; exec sleep 600")),
    ]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    read_fifo(&ready);
    let long: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();
    r.wait("in-progress", |s| state(s) == "in-progress").await;
    let answering =
        |t: &str| t.contains("api server: https://127.0.0.1:") && t.contains(over) && !t.contains("failing");
    agent_status_until(&r.config, &format!("the API server answering over {over}"), answering);

    hole.open(relay);
    let opened = Instant::now();
    agent_status_until(&r.config, "requests failing", |t| t.contains("requests failing since"));
    tokio::time::sleep(HOLE.saturating_sub(opened.elapsed())).await; // the fault itself: the hole lasts this long
    hole.close(relay);
    let healed = Instant::now();
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait_within(AFTER_HEAL, "canceled after the heal", |s| state(s) == "canceled").await;
    let canceled = healed.elapsed();
    assert!(!alive(long), "the running instruction was stopped");
    agent_status_until(&r.config, "the API server answering again", answering);
    assert_eq!(checkpoint(&s, &checksum).map(|c| c.completed_instructions), Some(1));

    hole.open(relay);
    tokio::time::sleep(HOLE).await;
    hole.close(relay);
    let healed = Instant::now();
    let raw = serde_json::to_vec(&json!({"instructions": [sh("next", &format!("echo next >> {marker}"))]})).unwrap();
    let next = plan::checksum(&raw);
    r.patch(nodeplan::remote::wire::push_patch(&raw)).await;
    r.wait_within(AFTER_HEAL, "the new plan applied after the heal", |s| {
        val(s, "applied-checksum") == next && state(s) == "succeeded"
    })
    .await;
    eprintln!("heal to canceled: {canceled:?}; heal to applied: {:?}", healed.elapsed());
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\nlong\nnext\n", "nothing ran twice");
    assert_eq!(agent.stop(), 0, "the same agent all along");
}

/// The fleet's watch (`plan status --selector --watch`, as `rollout` follows its nodes) outlives
/// a silent partition: a state written right after the heal is reported within 30 s of it, by
/// the same process. The command reaches the API server only through the relay; the test writes
/// through its own client.
#[tokio::test]
async fn a_fleet_watch_outlives_a_silent_partition() {
    let cp = control_plane!();
    let relay = Relay::start(apiserver_port(cp));
    let ns = cp.new_namespace("fleet-silence").await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, relay.kubeconfig(&cp.kubeconfig_yaml(), &cp.server_url())).unwrap();
    let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: "w1".into() });
    let raw = serde_json::to_vec(&json!({"instructions": [sh("one", "true")]})).unwrap();
    c.create(BTreeMap::from([("plan".into(), raw), ("plan-state".into(), b"pending".to_vec())]), BTreeMap::new())
        .await
        .unwrap();
    c.orchestrator_patch(json!({"metadata": {"labels": {"pool": "quiet"}}})).await.unwrap();
    let mut watch = std::process::Command::new(NODEPLAN)
        .args(["plan", "status", "-l", "pool=quiet", "--watch", "-o", "json", "-n", &ns, "--kubeconfig"])
        .arg(&kubeconfig)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = lines_of(watch.stdout.take().unwrap());
    let state_of = |line: &str| serde_json::from_str::<serde_json::Value>(line).unwrap()["state"].clone();
    assert_eq!(state_of(&lines.recv_timeout(GUARD).expect("the watch lists the node")), "pending");

    relay.silence();
    tokio::time::sleep(HOLE).await; // the fault itself: the hole lasts this long
    relay.heal();
    let healed = Instant::now();
    c.orchestrator_patch(json!({"data": {"plan-state": b64(b"in-progress")}})).await.unwrap();
    let line = lines.recv_timeout(AFTER_HEAL).expect("a state written after the heal is reported within 30 s");
    assert_eq!(state_of(&line), "in-progress", "{line}");
    eprintln!("heal to reported: {:?}", healed.elapsed());
    assert!(watch.try_wait().unwrap().is_none(), "the same process all along");
    let _ = watch.kill();
    let _ = watch.wait();
}

/// R31: the filesystem of the agent's state directories stops answering writes (frozen for a
/// snapshot, a hung disk) while a plan runs. The outcome of the run that finishes meanwhile still
/// reaches the Secret (its record on the node waits for the disk, the write does not), a new plan
/// written meanwhile waits saying so, and a cancel of it is written at once; nothing of that plan
/// happens after the thaw, and the records that waited are written and removed in order.
#[tokio::test]
async fn a_frozen_state_disk_holds_neither_an_outcome_nor_a_cancel() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let r = Remote::new(cp, "frozen-disk").await;
    r.state_on(&disk);
    let (go, started) = (r.fifo("go"), r.p("started"));
    let plan_a = json!({"instructions": [sh("a", &format!("touch {started}; read x < {go}; echo a"))]});
    r.create(&plan_a, Some("pending"), &[]).await;
    let mut agent = disk.agent(&r.config);
    r.wait("in-progress", |s| state(s) == "in-progress").await;
    // Frozen once the instruction runs (its execution directory made), not merely committed.
    wait_for_file(&started);
    disk.freeze();
    // The instruction reads the FIFO: it ends as soon as it is opened, and the disk stays frozen.
    release_fifo(&go);
    let s = r.wait("succeeded while the disk is frozen", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "success-count"), "1");
    agent.wait_log("the disk did not answer in 5s; the outcome goes to the Secret");
    // A new plan meanwhile: committed, then waiting for the disk; a cancel ends the wait.
    let (ran, file) = (r.p("ran-b"), r.p("file-b"));
    let plan_b = json!({
        "files": [{"path": file, "content": b64(b"b"), "permissions": "0600"}],
        "instructions": [sh("b", &format!("touch {ran}"))]
    });
    r.new_plan(&plan_b).await;
    r.wait("plan b in-progress", |s| state(s) == "in-progress").await;
    agent.wait_log("the disk has not answered for 5s; waiting for it");
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    r.wait("canceled while the disk is frozen", |s| state(s) == "canceled").await;
    disk.thaw();
    // After the thaw: what waited runs in order, and a plan runs as usual.
    r.annotate(plan::ANNOTATION_CANCELED, None).await;
    let done = r.p("ran-c");
    let plan_c = json!({"instructions": [sh("c", &format!("touch {done}"))]});
    r.new_plan(&plan_c).await;
    r.wait("plan c succeeded after the thaw", |s| state(s) == "succeeded").await;
    assert!(Path::new(&done).exists());
    assert!(!Path::new(&ran).exists(), "plan b's instruction never ran");
    assert!(!Path::new(&file).exists(), "plan b's file was never written");
    let deadline = Instant::now() + GUARD;
    while disk.list("applied").iter().any(|n| n.starts_with("kept-outcome")) {
        assert!(Instant::now() < deadline, "a kept outcome stayed on the node: {:?}", disk.list("applied"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(disk.list("interlock").iter().all(|n| n != "applyinator-active"), "{:?}", disk.list("interlock"));
    assert_eq!(agent.stop(), 0);
}

/// R31 with R15: an instruction asleep on the frozen disk (it writes into its execution directory)
/// cannot be stopped before the thaw. A cancel meanwhile is recorded without waiting for it, and
/// says that the termination is incomplete; once the disk answers the process goes, and the next
/// plan runs.
#[tokio::test]
async fn an_instruction_asleep_on_a_frozen_disk_is_canceled_and_gone_after_the_thaw() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let r = Remote::new(cp, "frozen-instruction").await;
    r.state_on(&disk);
    let (go, started) = (r.fifo("go"), r.p("started"));
    let plan_a = json!({"instructions": [sh("a", &format!("touch {started}; read x < {go}; echo x > written-here"))]});
    let checksum = r.create(&plan_a, Some("pending"), &[]).await;
    let mut agent = disk.agent(&r.config);
    r.wait("in-progress", |s| state(s) == "in-progress").await;
    wait_for_file(&started);
    disk.freeze();
    // The shell goes on to create a file in its execution directory, and sleeps there.
    release_fifo(&go);
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait("canceled while the instruction sleeps on the frozen disk", |s| state(s) == "canceled").await;
    let cp_a = checkpoint(&s, &checksum).expect("a checkpoint of the canceled run");
    assert!(cp_a.termination_incomplete, "the instruction could not be stopped: {cp_a:?}");
    disk.thaw();
    r.annotate(plan::ANNOTATION_CANCELED, None).await;
    let done = r.p("ran-b");
    let plan_b = json!({"instructions": [sh("b", &format!("touch {done}"))]});
    r.new_plan(&plan_b).await;
    r.wait("plan b succeeded after the thaw", |s| state(s) == "succeeded").await;
    assert!(Path::new(&done).exists());
    agent.stop_cleanly();
}

/// A full state disk (ENOSPC, the disk fault nodes meet most): a new plan cannot prepare its work
/// directory. The agent says so in its log and once in a `NotStarted` Event on the Secret, tries
/// again with back-off, the plan keeps its state, and it runs once there is room again; nothing
/// of it runs before.
#[tokio::test]
async fn a_full_state_disk_holds_a_plan_until_there_is_room() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let r = Remote::new(cp, "full-disk").await;
    let ns = r.client.secret_ref().namespace.clone();
    r.state_on(&disk);
    r.create(&json!({"instructions": [sh("a", "true")]}), Some("pending"), &[]).await;
    let mut agent = disk.agent(&r.config);
    r.wait("plan a succeeded", |s| state(s) == "succeeded").await;
    disk.fill("filler");
    let (ran, file) = (r.p("ran-b"), r.p("file-b"));
    let plan_b = json!({
        "files": [{"path": file, "content": b64(b"b"), "permissions": "0600"}],
        "instructions": [sh("b", &format!("touch {ran}"))]
    });
    r.new_plan(&plan_b).await;
    let line = agent.wait_log("No space left on device");
    assert!(line.contains("retrying in"), "{line}");
    // A second try says the same: one Event for the reason, not one per try.
    agent.wait_log("No space left on device");
    let client = cp.client().await;
    let said =
        wait_events(&client, &ns, "machine-plan", "NotStarted", |ev| ev.iter().any(|e| e.0 == "NotStarted")).await;
    let not_started: Vec<_> = said.iter().filter(|e| e.0 == "NotStarted").collect();
    assert!(not_started.len() == 1 && not_started[0].2 == 1, "{said:?}");
    assert!(not_started[0].1.contains("cannot start") && not_started[0].1.contains("No space left"), "{said:?}");
    assert!(!Path::new(&ran).exists(), "nothing of plan b ran on a full disk");
    disk.unfill("filler");
    let s = r.wait("plan b succeeded once there is room", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "success-count"), "2", "plan a's success and plan b's one: {}", describe(&s));
    assert!(Path::new(&ran).exists() && Path::new(&file).exists());
    agent.stop_cleanly();
}

/// R31 in an agent with both modes, the local plan directory on a filesystem that stops answering
/// (the state directories elsewhere). A local plan that finishes while it is frozen cannot record
/// its outcome in its `.pos`: the agent waits 5 s for that write, says so, and holds that plan
/// alone until the write lands; the Secret's plan runs and is reported meanwhile. After the thaw
/// the outcome lands and the local plan never runs again.
#[tokio::test]
async fn a_frozen_plan_directory_holds_its_own_plan_and_nothing_else() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let r = Remote::new(cp, "frozen-plans").await;
    let local =
        format!("localEnabled: true\nlocalPlanDirectory: {}\nrescanSeconds: 1\n", disk.mnt.join("plans").display());
    std::fs::write(&r.config, std::fs::read_to_string(&r.config).unwrap() + &local).unwrap();
    let (go, runs) = (r.fifo("go"), r.p("runs"));
    let plan_l = json!({"instructions": [sh("l", &format!("echo run >> {runs}; read x < {go}; echo l"))]});
    disk.write("plans/l.plan", &serde_json::to_vec(&plan_l).unwrap());
    r.create(&json!({"instructions": [sh("first", "true")]}), Some("pending"), &[]).await;
    let mut agent = disk.agent(&r.config);
    let ran = |runs: &str| std::fs::read_to_string(runs).unwrap_or_default();
    wait_for_file(&runs);
    disk.freeze();
    release_fifo(&go);
    agent.wait_log("the disk did not answer in 5s; nothing else of the plan is decided until that write lands");
    let done = r.p("ran-r");
    let plan_r = json!({"instructions": [sh("r", &format!("touch {done}"))]});
    r.new_plan(&plan_r).await;
    r.wait("the Secret's plan succeeded while the plan directory is frozen", |s| state(s) == "succeeded").await;
    assert!(Path::new(&done).exists());
    disk.thaw();
    let deadline = Instant::now() + GUARD;
    loop {
        let pos = disk.read("plans/l.pos").and_then(|b| nodeplan::local::pos::parse_pos(&b).ok());
        if pos.as_ref().is_some_and(|p| p.success_count == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "the local plan's outcome never landed: {pos:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Never twice: one more Secret plan after the thaw, by when a second run would have begun.
    let plan_s = json!({"instructions": [sh("s", "true")]});
    r.new_plan(&plan_s).await;
    r.wait("one more Secret plan succeeded after the thaw", |s| state(s) == "succeeded").await;
    assert_eq!(ran(&runs), "run\n", "the local plan ran once");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn an_invalid_value_writes_nothing() {
    let cp = control_plane!();
    let r = Remote::new(cp, "invalid").await;
    let ran = r.p("ran");
    r.create(
        &json!({"instructions": [sh("a", &format!("touch {ran}"))]}),
        Some("pending"),
        &[(plan::ANNOTATION_PAUSED, "yes")],
    )
    .await;
    let before = r.get().await;
    let mut agent = r.agent();
    agent.wait_log("invalid value \"yes\"");
    // An observation window: ten reconcile periods (probe-period-seconds is 1) pass.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = r.get().await;
    assert_eq!(after.resource_version, before.resource_version, "R3: nothing written");
    assert!(!Path::new(&ran).exists(), "R3: nothing runs");
    assert_eq!(agent.seen.iter().filter(|l| l.contains("invalid value \"yes\"")).count(), 1, "logged once");
    // A valid cancel wins over the invalid pause (R2).
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait("canceled", |s| state(s) == "canceled").await;
    let c = checkpoint(&s, &plan::checksum(&s.data["plan"])).unwrap();
    assert_eq!((c.completed_instructions, c.total_instructions, c.paused), (0, 1, false));
    assert!(!Path::new(&ran).exists());
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn cancel_in_flight_kills_the_whole_tree_including_a_setsid_grandchild() {
    let cp = control_plane!();
    let r = Remote::new(cp, "cancel").await;
    let after = r.p("after");
    let status = Arc::new(AtomicU16::new(200));
    let port = http_server(status.clone());
    let plan = json!({
        "instructions": [
            {"name": "escape", "command": HELPER, "args": ["setsid-wait"], "saveOutput": true},
            sh("after", &format!("touch {after}"))
        ],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}, "successThreshold": 1, "failureThreshold": 1}}
    });
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = AgentProc::start_with(&r.config, &[OUTPUT_LOGGED]);
    let gc: i32 = agent.wait_log("grandchild ").split_whitespace().last().unwrap().parse().unwrap();
    let leader: i32 = agent.wait_log("ready ").split_whitespace().last().unwrap().parse().unwrap();
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait("canceled", |s| state(s) == "canceled").await;
    let (gc_alive, leader_alive) = (alive(gc), alive(leader));
    kill_all(&[gc, leader]);
    assert!(!leader_alive && !gc_alive, "the tree survived: leader {leader_alive}, grandchild {gc_alive}");
    let c = checkpoint(&s, &checksum).unwrap();
    assert!(!c.paused && c.resume_state.is_none());
    assert_eq!((c.completed_instructions, c.total_instructions), (0, 2));
    assert!(val(&s, "applied-checksum").is_empty());
    assert!(!Path::new(&after).exists(), "later instructions never run");
    agent.wait_log("the node may be left partly changed");
    // `plan logs --secret` tells the instruction stopped while it ran from the one never run.
    let kubeconfig = r.p("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig_yaml()).unwrap();
    let secret = r.client.secret_ref();
    let logs = std::process::Command::new(NODEPLAN)
        .args(["plan", "logs", "--secret", &format!("{}/{}", secret.namespace, secret.name)])
        .args(["--kubeconfig", kubeconfig.as_str()])
        .output()
        .unwrap();
    let logs = String::from_utf8_lossy(&logs.stdout);
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines.first(), Some(&"instruction 1/2 escape: stopped while running (canceled)"), "{logs}");
    assert!(lines.iter().any(|l| l.starts_with("  | ready ")), "its output: {logs}");
    assert_eq!(lines.last(), Some(&"instruction 2/2 after: not run (canceled)"), "{logs}");
    // Terminal: removing the annotation does not resume (R8)...
    r.annotate(plan::ANNOTATION_CANCELED, None).await;
    status.store(500, Ordering::SeqCst);
    let unhealthy = |s: &SecretSnapshot| {
        String::from_utf8_lossy(s.data.get("probe-statuses").map(Vec::as_slice).unwrap_or(b"")).contains("failureCount")
    };
    let s = r.wait("a reconcile after the annotation's removal (probes see the new status)", unhealthy).await;
    assert_eq!(state(&s), "canceled");
    assert!(!agent.drain().iter().any(|l| l.contains("grandchild ")), "nothing ran again");
    // ...only pending does, from the first instruction.
    r.set_state("pending").await;
    agent.wait_log("grandchild ");
    agent.wait_log("ready ");
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    r.wait("canceled again", |s| state(s) == "canceled").await;
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn cancel_of_a_pending_plan_before_anything_runs() {
    let cp = control_plane!();
    let r = Remote::new(cp, "cancel-pending").await;
    let ran = r.p("ran");
    let checksum = r
        .create(
            &json!({"instructions": [sh("a", &format!("touch {ran}"))]}),
            Some("pending"),
            &[(plan::ANNOTATION_CANCELED, "true")],
        )
        .await;
    let mut agent = r.agent();
    let s = r.wait("canceled", |s| state(s) == "canceled").await;
    let c = checkpoint(&s, &checksum).unwrap();
    assert_eq!((c.completed_instructions, c.total_instructions, c.paused), (0, 1, false));
    assert!(!Path::new(&ran).exists());
    assert!(!s.data.contains_key("plan-revision"), "never moved to in-progress");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn cancel_of_a_succeeded_plan_stops_its_periodic_instructions() {
    let cp = control_plane!();
    let r = Remote::new(cp, "cancel-periodic").await;
    let ticks = r.p("ticks");
    let plan = json!({
        "instructions": [sh("a", "true")],
        "periodicInstructions": [{"name": "tick", "command": "sh", "args": ["-c", format!("echo tick >> {ticks}")], "periodSeconds": 1}]
    });
    r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    let count = || std::fs::read_to_string(&ticks).map(|t| t.lines().count()).unwrap_or(0);
    let deadline = Instant::now() + GUARD;
    while count() < 3 {
        assert!(Instant::now() < deadline, "periodic instruction never ran 3 times");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait("canceled", |s| state(s) == "canceled").await;
    let at_cancel = count();
    canceled_after_it_succeeded(cp, &r, &s).await;
    r.annotate(plan::ANNOTATION_CANCELED, None).await;
    // Observation window: several periods pass without a tick.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        count() <= at_cancel + 1,
        "periodic instructions kept running after the cancel ({at_cancel} → {})",
        count()
    );
    assert_eq!(state(&r.get().await), "canceled", "permanently");
    assert_eq!(agent.stop(), 0);
}

/// The same cancel landing while a periodic pass runs (a handshake: the pass says it started, then
/// waits): it stops the pass and is recorded as the cancel between passes is, every one-time
/// instruction done (it once recorded 0/0 and the Event said "canceled (0/1 instructions)").
#[tokio::test]
async fn cancel_during_a_periodic_pass_of_a_succeeded_plan_records_it_done() {
    let cp = control_plane!();
    let r = Remote::new(cp, "cancel-in-pass").await;
    let (ready, first) = (r.fifo("ready"), r.p("first"));
    // The first pass (part of the run that succeeds) only leaves a mark; a later one waits.
    let tick = format!("if [ -e {first} ]; then echo > {ready}; exec sleep 300; fi; touch {first}");
    let plan = json!({
        "instructions": [sh("a", "true")],
        "periodicInstructions": [{"name": "tick", "command": "sh", "args": ["-c", tick], "periodSeconds": 1}]
    });
    r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    read_fifo(&ready);
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    let s = r.wait("canceled", |s| state(s) == "canceled").await;
    canceled_after_it_succeeded(cp, &r, &s).await;
    assert_eq!(agent.stop(), 0);
}

/// A canceled one-instruction plan that had succeeded is reported as what it is: its instruction
/// done (1/1, not 0/1), and its Event says so.
async fn canceled_after_it_succeeded(cp: &ControlPlane, r: &Remote, s: &SecretSnapshot) {
    let mark = Checkpoint::read(s.data.get("plan-checkpoint").map(Vec::as_slice), &plan::checksum(&s.data["plan"]));
    assert_eq!(mark.map(|c| (c.completed_instructions, c.total_instructions)), Some((1, 1)));
    let ns = r.client.secret_ref().namespace.clone();
    let client = cp.client().await;
    let id = plan::id_of(&s.data["plan"]).unwrap();
    let want = format!("plan {id}: canceled after it succeeded (1/1 instructions): its periodic instructions stop");
    wait_events(&client, &ns, "machine-plan", &want, |ev| ev.iter().any(|e| e.0 == "Canceled" && e.1 == want)).await;
}

#[tokio::test]
async fn a_pause_pending_while_the_instruction_fails_records_a_failure() {
    let cp = control_plane!();
    let r = Remote::new(cp, "pause-fail").await;
    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    let plan =
        json!({"instructions": [sh("a", &format!("echo > {ready}; cat {go} > /dev/null; exit 4")), sh("b", "true")]});
    r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    read_fifo(&ready);
    r.annotate(plan::ANNOTATION_PAUSED, Some("true")).await;
    agent.wait_log("pause requested");
    release_fifo(&go);
    let s = r.wait("the failure recorded", |s| val(s, "failure-count") == "1").await;
    assert_eq!(val(&s, "success-count"), "0", "R5: the pause never masks the failure");
    // The failure is recorded first; the pause that is still set may then be recorded on top of
    // the failed state (it resumes into failed, not into in-progress).
    let checksum = plan::checksum(&s.data["plan"]);
    let s = r.wait("failed, or paused on top of failed", |s| state(s) == "failed" || state(s) == "paused").await;
    if state(&s) == "paused" {
        assert_eq!(checkpoint(&s, &checksum).unwrap().resume_state, Some(PlanState::Failed));
    }
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn probe_statuses_keep_updating_while_paused_and_canceled() {
    let cp = control_plane!();
    let r = Remote::new(cp, "probes").await;
    let status = Arc::new(AtomicU16::new(200));
    let port = http_server(status.clone());
    let plan = json!({
        "instructions": [sh("a", "true")],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}, "successThreshold": 1, "failureThreshold": 1}}
    });
    r.create(&plan, Some("pending"), &[(plan::ANNOTATION_PAUSED, "true")]).await;
    let healthy = |want: bool| {
        move |s: &SecretSnapshot| {
            let p: BTreeMap<String, plan::ProbeStatus> =
                serde_json::from_slice(s.data.get("probe-statuses").map(Vec::as_slice).unwrap_or(b"{}"))
                    .unwrap_or_default();
            p.get("web").is_some_and(|w| w.healthy == want)
        }
    };
    let mut agent = r.agent();
    r.wait("paused and healthy", |s| state(s) == "paused" && healthy(true)(s)).await;
    status.store(500, Ordering::SeqCst);
    r.wait("unhealthy while paused", healthy(false)).await;
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    r.wait("canceled", |s| state(s) == "canceled").await;
    status.store(200, Ordering::SeqCst);
    r.wait("healthy while canceled", healthy(true)).await;
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn an_orchestrator_writing_meanwhile_loses_nothing() {
    let cp = control_plane!();
    let r = Remote::new(cp, "concurrent").await;
    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    let plan = json!({"instructions": [sh("a", &format!("echo > {ready}; cat {go} > /dev/null"))]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    read_fifo(&ready);
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    r.patch(json!({
        "metadata": {"annotations": {"rke.cattle.io/plan-last-updated": "now"}},
        "data": {"failure-threshold": b64("5"), "orchestrator-note": b64("keep me")}
    }))
    .await;
    release_fifo(&go);
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "failure-threshold"), "5");
    assert_eq!(val(&s, "orchestrator-note"), "keep me");
    assert_eq!(s.annotations.get("rke.cattle.io/plan-last-updated").map(String::as_str), Some("now"));
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert_eq!(agent.stop(), 0);
}

/// The orchestrator's view of a run: every version of the Secret its watch delivers (distinct
/// resourceVersions, in order, other than `last`, the version the previous call ended on: the
/// watch lists again whenever it ends, and a list repeats the current version) until `done`
/// holds, then for `quiet` more. Updates `last`.
async fn versions_until(
    watch: &mut std::pin::Pin<Box<dyn futures::Stream<Item = Option<SecretSnapshot>> + Send>>,
    last: &mut String,
    done: impl Fn(&SecretSnapshot) -> bool,
    quiet: Duration,
) -> Vec<SecretSnapshot> {
    use futures::StreamExt as _;
    let mut seen: Vec<SecretSnapshot> = Vec::new();
    let before = last.clone();
    let push = |seen: &mut Vec<SecretSnapshot>, s: Option<SecretSnapshot>| {
        let s = s.expect("the secret is not deleted");
        let newest = seen.last().map_or(before.as_str(), |l| l.resource_version.as_str());
        if newest != s.resource_version {
            seen.push(s);
        }
    };
    while !seen.last().is_some_and(&done) {
        let next = tokio::time::timeout(GUARD, watch.next()).await;
        let states: Vec<String> = seen.iter().map(state).collect();
        push(&mut seen, next.unwrap_or_else(|_| panic!("the run never ended: {states:?}")).expect("the watch goes on"));
    }
    // An observation window: nothing more is written after the outcome. Without one (`quiet` 0)
    // nothing more is taken: a version already buffered (the agent's next write, on a fast
    // machine) belongs to the next call.
    while !quiet.is_zero()
        && let Ok(next) = tokio::time::timeout(quiet, watch.next()).await
    {
        push(&mut seen, next.expect("the watch goes on"));
    }
    if let Some(l) = seen.last() {
        *last = l.resource_version.clone();
    }
    seen
}

/// The fleet's 409s: a run costs exactly its state writes, and the agent's own writes never
/// conflict with each other (each is based on what the previous one returned, not on the watch's
/// older snapshot). Several quick instructions, so the run ends before the watch has delivered the
/// in-progress echo; twice, the second time after the orchestrator writes `pending` again. With a
/// probe, its statuses go with the outcome (no write of their own).
async fn a_run_costs_exactly_its_state_writes(with_probe: bool) {
    let cp = control_plane!();
    let r = Remote::new(cp, if with_probe { "writes-probe" } else { "writes" }).await;
    let status = Arc::new(AtomicU16::new(200));
    let port = http_server(status.clone());
    let steps: Vec<serde_json::Value> = (0..5).map(|i| sh(&format!("s{i}"), &format!("echo {i}"))).collect();
    let mut plan = json!({ "instructions": steps });
    if with_probe {
        plan["probes"] =
            json!({"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}, "successThreshold": 1}});
    }
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut watch: std::pin::Pin<Box<dyn futures::Stream<Item = Option<SecretSnapshot>> + Send>> =
        Box::pin(r.client.watch());
    let mut last = String::new();
    let created = versions_until(&mut watch, &mut last, |s| state(s) == "pending", Duration::ZERO).await;
    assert_eq!(created.len(), 1, "{:?}", created.iter().map(describe).collect::<Vec<_>>());
    let mut agent = r.agent();
    let succeeded = |s: &SecretSnapshot| state(s) == "succeeded";
    // With a probe, its period (1 s) may come round in the window: only unchanged statuses then.
    let quiet = Duration::from_secs(3);
    for round in 1..=2 {
        let run = versions_until(&mut watch, &mut last, succeeded, quiet).await;
        let states: Vec<String> = run.iter().map(state).collect();
        let shown: Vec<String> = run.iter().map(describe).collect();
        assert_eq!(states, ["in-progress", "succeeded"], "round {round}: exactly the state writes: {shown:#?}");
        assert_eq!(val(&run[1], "applied-checksum"), checksum);
        assert_eq!(val(&run[1], "plan-revision"), round.to_string());
        // Written with the outcome, in the same write; a plan without probes says `{}` (Rancher
        // counts probes as passed only once the key is there).
        assert!(run[1].data.contains_key("probe-statuses"), "probe statuses are written with the outcome");
        assert_eq!(val(&run[1], "probe-statuses") == "{}", !with_probe);
        if round == 1 {
            r.set_state("pending").await;
            let again = versions_until(&mut watch, &mut last, |s| state(s) == "pending", Duration::ZERO).await;
            let shown: Vec<String> = again.iter().map(describe).collect();
            assert_eq!(again.len(), 1, "only the orchestrator's write: {shown:#?}");
        }
    }
    agent.wait_log("succeeded (5/5 instructions)");
    agent.wait_log("succeeded (5/5 instructions)");
    assert_eq!(agent.stop(), 0);
    agent.rest();
    let conflicts: Vec<&String> = agent.seen.iter().filter(|l| l.contains("write conflicted (409)")).collect();
    assert!(conflicts.is_empty(), "the agent conflicted with its own writes: {conflicts:#?}");
}

#[tokio::test]
async fn a_run_costs_exactly_its_state_writes_and_no_conflict() {
    a_run_costs_exactly_its_state_writes(false).await;
}

#[tokio::test]
async fn a_run_with_a_probe_writes_its_statuses_with_the_outcome() {
    a_run_costs_exactly_its_state_writes(true).await;
}

/// Update the Secret as the agent's user (as the agent writes it) until the authorizer's answer
/// is `allowed` (it picks a role change up asynchronously); `touch` also changes a data key of
/// the test's own.
async fn until_allowed(as_agent: &SecretClient, touch: bool, allowed: bool) {
    let deadline = Instant::now() + GUARD;
    let updates: BTreeMap<String, Option<Vec<u8>>> = if touch {
        BTreeMap::from([("nodeplan-test-touch".to_string(), Some(b"1".to_vec()))])
    } else {
        BTreeMap::new()
    };
    loop {
        let base = as_agent.get().await.ok().flatten().unwrap_or_default();
        match as_agent.update_data(&base, &updates).await {
            Ok(_) if allowed => return,
            Err(e) if !allowed && format!("{e:?}").contains("403") => return,
            Ok(_) | Err(_) => assert!(Instant::now() < deadline, "the role change never took effect"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// R17: a run that finished while its outcome could not be written is recorded on the node, and an
/// agent started after a crash writes that outcome instead of running the plan a second time.
/// The agent's writes are refused (its role loses `update`, its watch goes on) while the
/// instruction finishes; once the refusal is logged, the agent is SIGKILLed, `update` comes back
/// and a new agent starts. Then, the same again, but the orchestrator reassigns the plan
/// (`pending`) while no agent runs: the kept outcome is dropped and the plan runs again.
#[tokio::test]
async fn a_finished_run_is_written_after_a_crash_not_run_again() {
    let cp = control_plane!();
    let r = Remote::new_with(cp, "kept", &cp.kubeconfig_yaml_as_agent()).await;
    let ns = r.client.secret_ref().namespace.clone();
    let as_agent = SecretClient::new(cp.agent_client().await, r.client.secret_ref().clone());
    cp.grant_agent(&ns, &["get", "list", "watch", "update"]).await;
    // It may publish Events: the refusal is told on the Secret too.
    let events: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
        "metadata": {"name": "events", "namespace": ns},
        "rules": [{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "get", "patch"]}],
    }))
    .unwrap();
    kube::Api::namespaced(cp.client().await, &ns).create(&Default::default(), &events).await.unwrap();
    cp.bind_agent(&ns, "events").await;
    let admin = cp.client().await;
    let (ready, go, marker) = (r.fifo("ready"), r.fifo("go"), r.p("marker"));
    let plan = json!({"instructions": [
        sh("a", &format!("echo ran >> {marker}; echo > {ready}; cat {go} > /dev/null; echo done")),
    ]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;

    // Finished, not written, crashed.
    let finish_unwritten = async |mut agent: AgentProc| {
        read_fifo(&ready);
        cp.grant_agent(&ns, &["get", "list", "watch"]).await;
        until_allowed(&as_agent, false, false).await;
        release_fifo(&go);
        next_failure(&mut agent);
        wait_events(&admin, &ns, "machine-plan", "Refused", |ev| {
            ev.iter().any(|e| e.0 == "Refused" && e.1.contains("forbids the agent to update secrets (403"))
        })
        .await;
        agent.crash();
        cp.grant_agent(&ns, &["get", "list", "watch", "update"]).await;
        until_allowed(&as_agent, false, true).await;
    };
    finish_unwritten(r.agent()).await;
    assert_eq!(state(&r.get().await), "in-progress", "the outcome did not land before the crash");

    let mut agent = r.agent();
    agent.wait_log("was kept on the node by a previous agent");
    let s = r.wait("succeeded from the kept outcome", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert_eq!(plan::decode_one_time_output(&s.data["applied-output"]).unwrap()["a"], b"done\n");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\n", "the finished run did not run again");
    assert_eq!(agent.stop(), 0);

    // A reassignment while no agent runs wins over the kept outcome.
    r.set_state("pending").await;
    finish_unwritten(r.agent()).await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\nran\n");
    r.set_state("pending").await;
    let mut agent = r.agent();
    agent.wait_log("dropping the outcome kept on the node");
    read_fifo(&ready);
    release_fifo(&go);
    r.wait("succeeded after the rerun", |s| state(s) == "succeeded").await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\nran\nran\n", "the reassigned plan ran");
    assert_eq!(agent.stop(), 0);
}

/// An outcome kept through an outage is written as soon as the agent's watch is back, not at its
/// back-off's next step. Deterministic handshakes on the agent's log, not timing:
/// - the agent's own writes are refused first (its role loses `update`; its watch goes on), so the
///   outcome's back-off grows (1, 2, 4 s...) while the watch is healthy;
/// - then the API server restarts: the watch breaks and lists again ("is back"), and the kept
///   outcome is tried at once: its failure announces the remaining time to the deadline already
///   set (no more than the previous step), where an attempt of the back-off's own would announce
///   a doubled one;
/// - then `update` is given back and the Secret changes: the outcome lands at once, seconds before
///   the back-off's next step.
#[tokio::test]
async fn the_outcome_is_written_once_the_apiserver_is_back() {
    let Some(mut own) = ControlPlane::start().await else { return };
    let r = Remote::new_with(&own, "outage", &own.kubeconfig_yaml_as_agent()).await;
    let ns = r.client.secret_ref().namespace.clone();
    let as_agent = SecretClient::new(own.agent_client().await, r.client.secret_ref().clone());
    own.grant_agent(&ns, &["get", "list", "watch", "update"]).await;
    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    let plan = json!({"instructions": [sh("a", &format!("echo > {ready}; cat {go} > /dev/null; echo done"))]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    read_fifo(&ready);
    own.grant_agent(&ns, &["get", "list", "watch"]).await;
    until_allowed(&as_agent, false, false).await;
    release_fifo(&go);
    let (mut at, mut step) = next_failure(&mut agent);
    while step < Duration::from_secs(4) {
        (at, step) = next_failure(&mut agent);
    }
    let _ = at;

    own.stop_apiserver().await;
    own.start_apiserver().await;
    let mut back = false;
    let mut after_back = Vec::new();
    let (mut at, mut remaining) = loop {
        let l = agent.next_line();
        if l.contains("the watch of secret") && l.contains("is back") {
            back = true;
        }
        let Some(d) = retrying_in(&l) else { continue };
        // An attempt that announces no more than the step already set was not the back-off's own
        // (that one announces a doubled step): a change brought it, the watch's fresh list after
        // the restart. Whether that list logs "is back" depends on how the old watch ended (a
        // clean close relists without a failure first), so the line is not waited for.
        if d <= step {
            break (Instant::now(), d);
        }
        if back {
            after_back.push(l);
            assert!(after_back.len() < 2, "no attempt when the watch came back: {after_back:#?}");
        }
        step = d;
    };
    // The next step of the back-off must be far enough off to tell the two apart.
    while at + remaining < Instant::now() + Duration::from_secs(3) {
        (at, remaining) = next_failure(&mut agent);
    }

    own.grant_agent(&ns, &["get", "list", "watch", "update"]).await;
    until_allowed(&as_agent, true, true).await;
    let s = r.wait("succeeded after the outage", |s| state(s) == "succeeded").await;
    assert!(
        Instant::now() + Duration::from_millis(500) < at + remaining,
        "written at the change, not at the back-off's next step"
    );
    assert_eq!(val(&s, "applied-checksum"), checksum);
    assert_eq!(plan::decode_one_time_output(&s.data["applied-output"]).unwrap()["a"], b"done\n");
    let late: Vec<String> = agent.drain().into_iter().filter(|l| retrying_in(l).is_some()).collect();
    assert!(late.is_empty(), "{late:#?}");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn a_killed_agent_stops_the_leftover_before_the_rerun() {
    let cp = control_plane!();
    let r = Remote::new(cp, "crash").await;
    let (ready, starts, overlap, pidfile) = (r.fifo("ready"), r.p("starts"), r.p("overlap"), r.p("pid"));
    let script = format!(
        "{}; echo start >> {starts}; echo > {ready}; exec sleep 300",
        overlap_check(&pidfile, &overlap, "overlap")
    );
    r.create(&json!({"instructions": [sh("long", &script)]}), Some("pending"), &[]).await;
    let mut first = r.agent();
    read_fifo(&ready);
    let leftover: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    first.signal(libc::SIGKILL);
    let _ = first.child.wait();
    assert_eq!(state(&r.get().await), "in-progress");
    let mut second = r.agent();
    read_fifo(&ready);
    let was_alive = alive(leftover);
    kill_all(&[leftover]);
    assert!(!was_alive, "the leftover is stopped before the re-run (R17)");
    assert!(!Path::new(&overlap).exists(), "two copies ran at once");
    assert_eq!(std::fs::read_to_string(&starts).unwrap(), "start\nstart\n");
    assert_eq!(second.stop(), 0);
    assert_eq!(state(&r.get().await), "in-progress", "a shutdown leaves in-progress for the next start");
}

#[tokio::test]
async fn the_plan_commands_drive_a_node_without_rancher() {
    let cp = control_plane!();
    let r = Remote::new(cp, "cli").await;
    let ns = r.client.secret_ref().namespace.clone();
    let target = format!("{ns}/machine-plan");
    let kubeconfig = r.p("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig_yaml()).unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(NODEPLAN)
            .args(args)
            .args(["--secret", &target, "--kubeconfig", &kubeconfig])
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (ready, marker) = (r.fifo("ready"), r.p("marker"));
    let plan_file = r.p("test.plan");
    let plan = json!({"instructions": [sh("one", &format!("echo one >> {marker}; echo > {ready}")), sh("two", &format!("echo two >> {marker}"))]});
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    // A bad plan is refused before anything is written.
    std::fs::write(r.p("bad.plan"), br#"{"files":[{"path":"rel"}]}"#).unwrap();
    let bad = std::process::Command::new(NODEPLAN)
        .args(["plan", "push", &r.p("bad.plan"), "--secret", &target, "--kubeconfig", &kubeconfig])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("files[0].path"));
    assert!(r.client.get().await.unwrap().is_none());

    cli(&["plan", "push", &plan_file]);
    cli(&["plan", "pause"]);
    let mut agent = r.agent();
    let s = r.wait("paused", |s| state(s) == "paused").await;
    assert!(!Path::new(&marker).exists());
    assert_eq!(val(&s, "plan-state"), "paused");
    let status = cli(&["plan", "status"]);
    assert!(status.contains("state:      paused") && status.contains("paused=\"true\""), "{status}");
    // Nothing counted yet reads as none, not as blanks (issue 43).
    assert!(status.contains("attempts:   0 failed, 0 succeeded; applied no; last never"), "{status}");
    cli(&["plan", "resume"]);
    read_fifo(&ready);
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert!(cli(&["plan", "status"]).contains("2/2 instructions done"));
    cli(&["plan", "cancel"]);
    r.wait("canceled", |s| state(s) == "canceled").await;
    // Reset does what it says: a pause asked meanwhile does not hold the plan run again.
    cli(&["plan", "pause"]);
    assert!(cli(&["plan", "reset"]).contains("plan.cattle.io/paused removed"));
    read_fifo(&ready);
    r.wait("succeeded again", |s| state(s) == "succeeded" && val(s, "plan-revision") == "2").await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\ntwo\none\ntwo\n");
    // A long value is shown cut to its first characters, with its length.
    let long = "x".repeat(500);
    r.annotate(plan::ANNOTATION_PAUSED, Some(&long)).await;
    let status = cli(&["plan", "status"]);
    assert!(status.contains(&format!("paused={}", plan::shown_value(&long))), "{status}");
    assert!(status.contains("(500 bytes)") && !status.contains(&long), "{status}");
    assert_eq!(agent.stop(), 0);
}

/// Remote mode publishes Events regarding the plan Secret: a plan held paused, then released and
/// succeeding, shows Paused and Succeeded on `secret/machine-plan` (`kubectl get events`). An agent
/// that may not create events nor use Leases (Rancher's per-machine role grants the Secret only)
/// says so once for each and applies all the same.
#[tokio::test]
async fn events_regarding_the_secret_and_an_agent_forbidden_to_publish_them() {
    let cp = control_plane!();
    let r = Remote::new(cp, "events").await;
    let ns = r.client.secret_ref().namespace.clone();
    let plan = json!({"instructions": [sh("one", "echo one")]});
    r.create(&plan, Some("pending"), &[(plan::ANNOTATION_PAUSED, "true")]).await;
    let mut agent = r.agent();
    r.wait("paused", |s| state(s) == "paused").await;
    r.annotate(plan::ANNOTATION_PAUSED, None).await;
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    let client = cp.client().await;
    wait_events(&client, &ns, "machine-plan", "Paused and Succeeded", |ev| {
        ev.iter().any(|e| e.0 == "Paused") && ev.iter().any(|e| e.0 == "Succeeded" && e.1.contains("1/1"))
    })
    .await;
    let out = cp.kubectl().args(["get", "events", "-n", &ns]).output().unwrap();
    let events = String::from_utf8_lossy(&out.stdout);
    assert!(events.contains("Succeeded") && events.contains("secret/machine-plan"), "{events}");
    assert_eq!(agent.stop(), 0);

    let r = Remote::new_with(cp, "events-forbidden", &cp.kubeconfig_yaml_as_agent()).await;
    let ns = r.client.secret_ref().namespace.clone();
    cp.grant_agent(&ns, &["get", "list", "watch", "update"]).await;
    r.create(&plan, Some("pending"), &[]).await;
    let mut agent = r.agent();
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    agent.wait_log("running without the Lease");
    agent.wait_log("Kubernetes events are off");
    assert!(k8s_support::events_regarding(&client, &ns, "machine-plan").await.is_empty());
    assert_eq!(agent.stop(), 0);
}

/// Two agents given one plan Secret (a cloned machine image carries the same connection info):
/// the first holds the Secret's Lease and applies; the second waits, saying who holds it, and
/// runs nothing. A clean stop releases the Lease and the waiting agent takes it at once and acts;
/// an agent whose Lease another writer takes stops (exit 1) instead of acting beside it.
#[tokio::test]
async fn a_second_agent_on_one_secret_waits_for_the_lease() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    let r = Remote::new(cp, "lease").await;
    let ns = r.client.secret_ref().namespace.clone();
    let twin = ClusterNode::new("remoteEnabled: true\nleaseDuration: 4s\n", &cp.kubeconfig_yaml(), &ns);
    let (runs, ready, go) = (r.p("runs"), r.fifo("ready"), r.fifo("go"));
    let plan =
        json!({"instructions": [sh("one", &format!("echo first >> {runs}; echo > {ready}; cat {go} > /dev/null"))]});
    r.create(&plan, Some("pending"), &[]).await;
    let mut first = r.agent();
    first.wait_log("holding the Lease");
    read_fifo(&ready);
    let mut second = twin.agent();
    let line = second.wait_log("waiting for the Lease");
    assert!(line.contains(&format!("/{}", first.child.id())) && line.contains("machine-plan"), "{line}");
    // A measured duration is shown for people (`3.9s`), never to the nanosecond.
    let shown = line.rsplit(' ').next().unwrap_or_default();
    assert!(shown.ends_with('s') && shown.len() <= 6, "{line}");
    release_fifo(&go);
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(first.stop(), 0);
    second.wait_log("holding the Lease");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "first\n", "the waiting agent ran nothing");

    // The second agent now acts on the Secret.
    let plan = json!({"instructions": [sh("two", &format!("echo second >> {runs}"))]});
    r.new_plan(&plan).await;
    r.wait("the new plan succeeded", |s| state(s) == "succeeded" && val(s, "plan-revision") == "2").await;
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "first\nsecond\n");

    // Another writer takes the Lease: the holder stops rather than act beside it.
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &ns);
    let mut l = leases.get("nodeplan-machine-plan").await.unwrap();
    l.spec.as_mut().unwrap().holder_identity = Some("elsewhere/boot/1".into());
    leases.replace("nodeplan-machine-plan", &Default::default(), &l).await.unwrap();
    second.wait_log("lost the Lease");
    assert_eq!(second.child.wait().unwrap().code(), Some(1));
}

/// Issue 41, item 4: two agents in separate PID namespaces on one host (a containerized agent
/// beside another), each pid 1 in its own, are two holders to the Lease: the second waits and
/// the plan runs once. Both were `node/boot/1`, both renewed, and both ran the plan.
#[tokio::test]
async fn agents_in_separate_pid_namespaces_are_told_apart_by_the_lease() {
    let cp = control_plane!();
    let r = Remote::new(cp, "pidns").await;
    let ns = r.client.secret_ref().namespace.clone();
    let twin = ClusterNode::new("remoteEnabled: true\nleaseDuration: 1h\n", &cp.kubeconfig_yaml(), &ns);
    let runs = r.p("runs");
    r.create(&json!({"instructions": [sh("one", &format!("echo run >> {runs}"))]}), Some("pending"), &[]).await;
    // A PID namespace of its own, its /proc, and the agent killed with the wrapper.
    let unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"];
    let mut first = AgentProc::start_wrapped(&unshare, &r.config);
    let held = first.wait_log("holding the Lease");
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    let mut second = AgentProc::start_wrapped(&unshare, &twin.config);
    let waiting = second.wait_log("waiting for the Lease");
    assert!(waiting.contains("/1/"), "the holder is pid 1 of its namespace: {waiting} ({held})");
    // A new plan: the holder runs it, once.
    r.new_plan(&json!({"instructions": [sh("two", &format!("echo again >> {runs}"))]})).await;
    r.wait("the second plan succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "run\nagain\n", "each plan ran once");
    assert!(second.drain().iter().all(|l| !l.contains("holding the Lease")), "{:?}", second.seen);
}

/// A plan Secret whose agent holds the Lease and has applied its plan, and a twin (a cloned
/// machine: the same connection info, a ten-minute Lease) waiting for the Lease.
/// Two nodes of one configuration (`mode`) for one plan Secret in a new namespace (a cloned
/// machine): the first with the test's Secret client; and the namespace.
async fn twins(cp: &ControlPlane, prefix: &str, mode: &str) -> (Remote, ClusterNode, String) {
    let namespace = cp.new_namespace(prefix).await;
    let client =
        SecretClient::new(cp.client().await, SecretRef { namespace: namespace.clone(), name: "machine-plan".into() });
    let r = Remote { node: ClusterNode::new(mode, &cp.kubeconfig_yaml(), &namespace), client };
    let twin = ClusterNode::new(mode, &cp.kubeconfig_yaml(), &namespace);
    (r, twin, namespace)
}

async fn a_holder_and_a_waiting_twin(cp: &ControlPlane, test: &str) -> (Remote, ClusterNode, AgentProc, AgentProc) {
    let r = Remote::new(cp, test).await;
    let ns = r.client.secret_ref().namespace.clone();
    let twin = ClusterNode::new("remoteEnabled: true\nleaseDuration: 10m\n", &cp.kubeconfig_yaml(), &ns);
    let (first, second) = holding_and_waiting(&r, &twin).await;
    (r, twin, first, second)
}

/// The first node's agent runs a plan of one instruction and holds the Lease; the twin's waits.
async fn holding_and_waiting(r: &Remote, twin: &ClusterNode) -> (AgentProc, AgentProc) {
    r.create(&json!({"instructions": [sh("one", "true")]}), Some("pending"), &[]).await;
    let mut first = r.agent();
    first.wait_log("holding the Lease");
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    let mut second = twin.agent();
    second.wait_log("waiting for the Lease");
    (first, second)
}

/// A waiting agent watches the Lease (the one list/watch): with a Lease of ten minutes, which it
/// would otherwise read again only every quarter of that (2.5 min), the holder's clean stop hands
/// the Lease over as it happens (the holder was an agent of this machine, now gone).
#[tokio::test]
async fn a_waiting_agent_hears_the_release_through_its_watch_of_the_lease() {
    let (_r, _twin, mut first, mut second) = a_holder_and_a_waiting_twin(control_plane!(), "lease-watch").await;
    assert_eq!(first.stop(), 0);
    second.wait_log("holding the Lease");
    assert_eq!(second.stop(), 0);
}

/// R26: a third party deletes the Lease while its holder acts and another agent waits (and
/// watches it). The waiting agent does not take the gap: a Lease that vanished counts as emptied,
/// taken only once gone for the whole duration; the holder takes it back at its next renewal and
/// keeps acting.
#[tokio::test]
async fn a_lease_deleted_under_its_holder_is_not_taken_by_the_waiting_agent() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    let (r, _twin, mut first, mut second) = a_holder_and_a_waiting_twin(cp, "lease-deleted").await;
    let ns = r.client.secret_ref().namespace.clone();
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &ns);
    leases.delete("nodeplan-machine-plan", &Default::default()).await.unwrap();
    second.wait_log("it has no holder");
    first.wait_log("was emptied or deleted by someone else; taken back");
    second.wait_log("another agent");
    assert_eq!(first.stop(), 0, "the holder was never displaced");
    second.wait_log("holding the Lease");
    assert_eq!(second.stop(), 0);
}

/// R26, the Lease fences: two agents for one Secret (a cloned machine) while a third party
/// rewrites the Lease at the worst moments, right after the holder's renewals: it empties the
/// holder (three times), states a 1 s duration, then names another holder. At no instant do both
/// agents execute an instruction (each instruction notes a copy of another still running), no
/// finished instruction runs again, and the holder displaced at the end records where it stopped,
/// so the other agent goes on there.
#[tokio::test]
async fn the_lease_fences_two_agents_against_a_third_party_writing_it() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    // 16 s: renewals every 4 s, and 8 s of acting after each (stop and kill timeouts 6 s).
    let mode = "remoteEnabled: true\nleaseDuration: 16s\n";
    let (r, twin, namespace) = twins(cp, "fence", mode).await;
    let (runs, overlap, pidfile) = (r.p("runs"), r.p("overlap"), r.p("pid"));
    let steps: Vec<serde_json::Value> = (1..=8)
        .map(|i| {
            let check = overlap_check(&pidfile, &overlap, &format!("i{i}"));
            sh(&format!("i{i}"), &format!("{check}; echo start-i{i} >> {runs}; sleep 2; echo done-i{i} >> {runs}"))
        })
        .collect();
    r.create(&json!({"instructions": steps}), Some("pending"), &[]).await;
    let mut agents = vec![r.agent(), twin.agent()];
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &namespace);
    let lease = "nodeplan-machine-plan";

    // Right after a renewal by the holder: the holder and the version that renewal wrote.
    let after_renewal = |leases: kube::Api<Lease>| async move {
        let first = leases.get(lease).await.ok().and_then(|l| l.metadata.resource_version);
        let deadline = Instant::now() + GUARD;
        loop {
            assert!(Instant::now() < deadline, "the holder never renewed the Lease");
            if let Ok(l) = leases.get(lease).await {
                let holder = l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();
                if !holder.is_empty() && l.metadata.resource_version != first {
                    return l;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let write = |mut l: Lease, f: &dyn Fn(&mut k8s_openapi::api::coordination::v1::LeaseSpec)| {
        f(l.spec.as_mut().unwrap());
        l
    };
    r.wait("in-progress", |s| state(s) == "in-progress").await;
    for _ in 0..3 {
        let l = after_renewal(leases.clone()).await;
        let l = write(l, &|s| s.holder_identity = None);
        leases.replace(lease, &Default::default(), &l).await.unwrap();
    }
    let l = after_renewal(leases.clone()).await;
    let l = write(l, &|s| s.lease_duration_seconds = Some(1));
    leases.replace(lease, &Default::default(), &l).await.unwrap();
    let l = after_renewal(leases.clone()).await;
    let displaced = l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap();
    let l = write(l, &|s| s.holder_identity = Some("elsewhere/boot/1".into()));
    leases.replace(lease, &Default::default(), &l).await.unwrap();

    let s = r.wait_within(Duration::from_secs(90), "succeeded", |s| state(s) == "succeeded").await;
    let log = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(std::fs::read_to_string(&overlap).unwrap_or_default(), "", "two agents executed at once: {log}");
    // An instruction stopped by the fence starts again; one that finished never does.
    let lines: Vec<&str> = log.lines().collect();
    for i in 1..=8 {
        let (start, done) = (format!("start-i{i}"), format!("done-i{i}"));
        let finished: Vec<usize> = (0..lines.len()).filter(|&n| lines[n] == done).collect();
        assert_eq!(finished.len(), 1, "instruction {i} finished {} times: {log}", finished.len());
        let last_start = (0..lines.len()).rfind(|&n| lines[n] == start);
        assert!(last_start < Some(finished[0]), "instruction {i} started again after it finished: {log}");
    }
    assert_eq!(val(&s, "plan-revision"), "1", "one run, resumed where the displaced holder stopped");
    // The displaced holder said why it stopped and exited for systemd to start it again.
    // The identity ends in `<pid>/<start time>`.
    let pid: u32 = displaced.rsplit('/').nth(1).unwrap().parse().unwrap();
    let mut gone = agents.iter().position(|a| a.child.id() == pid).map(|i| agents.remove(i)).expect("the holder");
    gone.wait_log("lost the Lease");
    assert_eq!(gone.child.wait().unwrap().code(), Some(1));
    assert_eq!(agents[0].stop(), 0);
}

/// Issue 41, item 5: agents of different `leaseDuration`s (120 s holding, 12 s waiting) while a
/// third party states 12 s in the Lease right after the holder took it. The waiter counts 12 s
/// from that write; the holder, which acts up to 120 s from its own last renewal, saw the write
/// and renewed on top of it at once, so the waiter's count started over with 120 s. The plan runs
/// once, never on two agents at once (before: the waiter took over after 12 s and started the
/// plan again beside the holder).
#[tokio::test]
async fn a_lease_writer_cannot_make_agents_of_different_durations_overlap() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    let (r, _, namespace) = twins(cp, "fence-durations", "remoteEnabled: true\nleaseDuration: 120s\n").await;
    let twin = ClusterNode::new("remoteEnabled: true\nleaseDuration: 12s\n", &cp.kubeconfig_yaml(), &namespace);
    let (runs, overlap, pidfile) = (r.p("runs"), r.p("overlap"), r.p("pid"));
    let step = |i: u32, secs: u32| {
        let check = overlap_check(&pidfile, &overlap, &format!("i{i}"));
        sh(&format!("i{i}"), &format!("{check}; echo start-i{i} >> {runs}; sleep {secs}; echo done-i{i} >> {runs}"))
    };
    r.create(&json!({"instructions": [step(1, 20), step(2, 1)]}), Some("pending"), &[]).await;
    let mut holder = r.agent();
    holder.wait_log("holding the Lease");
    r.wait("in-progress", |s| state(s) == "in-progress").await;
    let mut waiter = twin.agent();
    waiter.wait_log("waiting for the Lease");
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &namespace);
    let mut l = leases.get("nodeplan-machine-plan").await.unwrap();
    l.spec.as_mut().unwrap().lease_duration_seconds = Some(12);
    leases.replace("nodeplan-machine-plan", &Default::default(), &l).await.unwrap();
    holder.wait_log("was written by someone else");
    let s = r.wait_within(Duration::from_secs(60), "succeeded", |s| state(s) == "succeeded").await;
    let log = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(std::fs::read_to_string(&overlap).unwrap_or_default(), "", "two agents executed at once: {log}");
    assert_eq!(log, "start-i1\ndone-i1\nstart-i2\ndone-i2\n", "the plan ran once");
    assert_eq!(val(&s, "plan-revision"), "1");
    assert!(waiter.drain().iter().all(|l| !l.contains("holding the Lease")), "{:?}", waiter.seen);
    assert_eq!(holder.stop(), 0);
}

/// R24: an idle agent states its Lease's idle duration (24 times its own) and renews it a 48th
/// as often; a plan that starts has it renewed with the agent's own duration at once, kept while
/// the plan runs; a clean stop releases it stating the agent's own duration, so a waiting agent
/// is not made to wait out the idle one.
#[tokio::test]
async fn an_idle_agent_states_a_longer_lease_until_a_plan_runs() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    // 12 s: the shortest safe for the tests' stop and kill timeouts (6 s) is 11 s; idle, 288 s.
    let namespace = cp.new_namespace("lease-idle").await;
    let client =
        SecretClient::new(cp.client().await, SecretRef { namespace: namespace.clone(), name: "machine-plan".into() });
    let r = Remote {
        node: ClusterNode::new("remoteEnabled: true\nleaseDuration: 12s\n", &cp.kubeconfig_yaml(), &namespace),
        client,
    };
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &namespace);
    let stated = |within: Duration, want: i32, what: &'static str| {
        let leases = leases.clone();
        async move {
            let deadline = Instant::now() + within;
            loop {
                let l = leases.get("nodeplan-machine-plan").await.unwrap();
                let spec = l.spec.unwrap_or_default();
                if spec.lease_duration_seconds == Some(want) {
                    return spec;
                }
                assert!(Instant::now() < deadline, "{what}: the Lease states {:?}", spec.lease_duration_seconds);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    r.create(&json!({"instructions": [sh("one", "true")]}), Some("pending"), &[]).await;
    let mut agent = r.agent();
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    stated(GUARD, 288, "idle after a quiet duration").await;
    // Changes that bring no new plan (a label, as other controllers add) are looked at and run
    // nothing: no periodic pass without a periodic instruction due, so the Lease stays idle (a
    // pass used to begin a run, which renewed the Lease as a busy agent's at once). No event
    // tells "nothing happened": each change gets a second to show otherwise.
    for i in 0..3 {
        r.patch(json!({"metadata": {"labels": {"touched": i.to_string()}}})).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        stated(Duration::ZERO, 288, "still idle after a change without a new plan").await;
    }

    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    let raw =
        serde_json::to_vec(&json!({"instructions": [sh("two", &format!("echo > {ready}; cat {go} > /dev/null"))]}))
            .unwrap();
    r.patch(nodeplan::remote::wire::push_patch(&raw)).await;
    read_fifo(&ready);
    // At once (the idle renewals come every 130 to 144 s).
    stated(Duration::from_secs(2), 12, "renewed as the plan starts").await;
    release_fifo(&go);
    r.wait("the second plan succeeded", |s| state(s) == "succeeded" && val(s, "plan-revision") == "2").await;
    stated(GUARD, 288, "idle again").await;

    assert_eq!(agent.stop(), 0);
    let released = stated(Duration::from_secs(2), 12, "released").await;
    assert_eq!(released.holder_identity, None);
}

/// R26 with R24: a third party empties an idle holder's Lease and states 1 s in it, right after
/// an idle renewal (its idle Lease said 288 s). The waiting agent would take it once unchanged for
/// its own 12 s, well before the idle holder's next renewal (72 s after its last); but the holder
/// watches its own Lease (issue 41): it sees the write, stops acting until a renewal lands, and
/// takes the Lease back at once, so the waiter's count starts over and it never takes it. A plan
/// written then is run once, by the holder.
#[tokio::test]
async fn an_idle_holder_whose_lease_was_rewritten_takes_it_back_at_once() {
    use k8s_openapi::api::coordination::v1::Lease;
    let cp = control_plane!();
    let mode = "remoteEnabled: true\nleaseDuration: 12s\n";
    let (r, twin, namespace) = twins(cp, "lease-idle-rewritten", mode).await;
    let leases: kube::Api<Lease> = kube::Api::namespaced(cp.client().await, &namespace);
    let lease = "nodeplan-machine-plan";
    let (mut holder, mut waiter) = holding_and_waiting(&r, &twin).await;
    // Idle: the holder states 288 s. Right after the renewal that says so, the third party writes.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut l = loop {
        let l = leases.get(lease).await.unwrap();
        let spec = l.spec.clone().unwrap_or_default();
        if spec.lease_duration_seconds == Some(288) {
            break l;
        }
        assert!(Instant::now() < deadline, "no idle renewal: {spec:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let held_by = l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap();
    let spec = l.spec.as_mut().unwrap();
    (spec.holder_identity, spec.lease_duration_seconds) = (None, Some(1));
    let rewritten = leases.replace(lease, &Default::default(), &l).await.unwrap().metadata.resource_version;
    holder.wait_log("was written by someone else");
    // Taken back, in a write of its own after the third party's.
    let deadline = Instant::now() + GUARD;
    loop {
        let l = leases.get(lease).await.unwrap();
        let h = l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
        if h == held_by && l.metadata.resource_version != rewritten {
            break;
        }
        assert!(h.is_empty() || h == held_by, "another agent took it: {h}");
        assert!(Instant::now() < deadline, "the holder never took its Lease back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A plan now: the holder runs it, once; the waiter goes on waiting.
    let (runs, overlap, pidfile) = (r.p("runs"), r.p("overlap"), r.p("pid"));
    let check = overlap_check(&pidfile, &overlap, "after-rewrite");
    let raw = serde_json::to_vec(&json!({"instructions": [sh(
        "after-rewrite",
        &format!("{check}; echo start >> {runs}; sleep 14; echo done >> {runs}")
    )]}))
    .unwrap();
    r.patch(nodeplan::remote::wire::push_patch(&raw)).await;
    r.wait_within(Duration::from_secs(60), "the new plan succeeded", |s| {
        state(s) == "succeeded" && val(s, "plan-revision") == "2"
    })
    .await;
    assert_eq!(std::fs::read_to_string(&overlap).unwrap_or_default(), "", "both agents ran it");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "start\ndone\n", "run once");
    holder.wait_log("after-rewrite: started");
    assert!(waiter.drain().iter().all(|l| !l.contains("holding the Lease")), "{:?}", waiter.seen);
    assert_eq!(holder.stop(), 0);
}

/// R23 in remote mode: an upgrade instruction that asks for a restart has its progress written
/// to the Secret (in-progress, a suspended checkpoint) before the agent executes its new program;
/// the restarted agent goes on at the next instruction and the plan succeeds, nothing run twice.
#[tokio::test]
async fn a_plan_that_upgrades_the_agent_goes_on_after_the_restart() {
    let cp = control_plane!();
    let r = Remote::new(cp, "upgrade").await;
    let program = r.p("nodeplan");
    std::fs::copy(NODEPLAN, &program).unwrap();
    let (runs, starts) = (r.p("runs"), r.p("starts"));
    let upgrade = upgrade_script(&program, &runs, &format!("echo started >> {starts}"));
    let plan = json!({"instructions": [sh("upgrade", &upgrade), sh("after", &format!("echo after >> {runs}"))]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = AgentProc::start_program(Path::new(&program), &r.config, &[]);
    agent.wait_log("starting again as an instruction asked");
    agent.wait_log("resuming at instruction 2/2");
    let s = r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(val(&s, "success-count"), "1");
    assert!(checkpoint(&s, &checksum).is_none(), "a finished plan has no checkpoint");
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "upgrade\nafter\n", "nothing ran twice");
    assert_eq!(std::fs::read_to_string(&starts).unwrap(), "started\n");
    assert_eq!(agent.stop(), 0);
}

/// R23 with R4: a pause asked while the agent restarts (its Secret holds the restart's suspended
/// checkpoint, still `in-progress`) is recorded by the restarted agent at that boundary: the plan
/// shows `paused` with one instruction done, runs nothing more, and once resumed goes on at the
/// next instruction, nothing run twice. The new program waits on a gate (a FIFO) so the pause is
/// written before it starts.
#[tokio::test]
async fn a_pause_during_the_agents_restart_is_recorded_at_the_restart_point() {
    let cp = control_plane!();
    let r = Remote::new(cp, "upgrade-pause").await;
    let program = r.p("nodeplan");
    std::fs::copy(NODEPLAN, &program).unwrap();
    let (runs, gate) = (r.p("runs"), r.fifo("gate"));
    let upgrade = upgrade_script(&program, &runs, &format!("cat {gate} > /dev/null"));
    let plan = json!({"instructions": [sh("upgrade", &upgrade), sh("after", &format!("echo after >> {runs}"))]});
    let checksum = r.create(&plan, Some("pending"), &[]).await;
    let mut agent = AgentProc::start_program(Path::new(&program), &r.config, &[]);
    let s = r.wait("the restart's checkpoint", |s| checkpoint(s, &checksum).is_some_and(|c| c.paused)).await;
    assert_eq!(state(&s), "in-progress");
    r.annotate(plan::ANNOTATION_PAUSED, Some("true")).await;
    release_fifo(&gate);
    let s = r.wait("paused at the restart point", |s| state(s) == "paused").await;
    let c = checkpoint(&s, &checksum).expect("a checkpoint");
    assert_eq!((c.completed_instructions, c.resume_state, c.paused), (1, Some(plan::PlanState::InProgress), true));
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "upgrade\n", "nothing more runs while paused");
    r.annotate(plan::ANNOTATION_PAUSED, None).await;
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    assert_eq!(std::fs::read_to_string(&runs).unwrap(), "upgrade\nafter\n", "nothing ran twice");
    assert_eq!(agent.stop(), 0);
}

/// A cgroup named as a program's systemd unit (`system.slice/<program>.service`, in the cgroup2
/// hierarchy), made for one test and removed after it: a stand-in joins it as systemd starts the
/// unit. What the test made is all it removes.
struct UnitCgroup {
    made: Vec<PathBuf>,
}

impl UnitCgroup {
    fn new(program: &str) -> UnitCgroup {
        let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount = mi
            .lines()
            .find_map(|l| {
                let (pre, post) = l.split_once(" - ")?;
                let mount = pre.split_whitespace().nth(4)?;
                (post.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount))
            })
            .expect("a cgroup2 hierarchy");
        let mut made = Vec::new();
        let mut dir = mount;
        for part in ["system.slice".to_string(), format!("{program}.service")] {
            dir = dir.join(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap();
                made.push(dir.clone());
            }
        }
        UnitCgroup { made }
    }

    fn join(&self, pid: u32) {
        std::fs::write(self.made.last().expect("the unit's cgroup").join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for UnitCgroup {
    fn drop(&mut self) {
        for d in self.made.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Rancher's `system-agent-upgrader` starts `rancher-system-agent` on the node, which takes no
/// Lease: remote mode waits while it runs (saying so, acting on nothing), applies once it is gone,
/// and stops (exit 1) when it starts again as its systemd unit, so the two never act on one
/// Secret. The program looked for is given a name of this test's own, so that no other test's
/// agent sees the stand-in; it starts in a cgroup named as its unit, as systemd starts it.
/// One whose own config and connection info name another Secret holds nothing.
/// Meanwhile an impostor runs: another user's process of that name with an effective uid of 0 (a
/// setuid-root program run through a link of that name); it makes nothing wait (it used to hold
/// remote mode for as long as it ran).
#[tokio::test]
async fn remote_mode_never_acts_beside_rancher_system_agent() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let cp = control_plane!();
    let r = Remote::new(cp, "rival").await;
    let name = format!("rsa{}", std::process::id());
    let stand_in = r.p(&name);
    std::fs::copy("/bin/sleep", &stand_in).unwrap();
    let (setuid, links) = (r.p("setuid-sleep"), r.p("links"));
    std::fs::copy("/bin/sleep", &setuid).unwrap();
    std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::fs::create_dir(&links).unwrap();
    for d in [r.dir.path(), Path::new(&links)] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let link = Path::new(&links).join(&name);
    std::os::unix::fs::symlink(&setuid, &link).unwrap();
    /// A child killed when the test ends, however it ends.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut impostor = Reaped(std::process::Command::new(&link).arg("300").uid(65534).gid(65534).spawn().unwrap());
    // Its config names this Secret (or another) through its connection info, as Rancher's does.
    let secret = r.client.secret_ref().clone();
    let config_for = |name: &str, secret_name: &str| {
        let info = r.p(&format!("{name}.json"));
        std::fs::write(&info, json!({"namespace": secret.namespace, "secretName": secret_name}).to_string()).unwrap();
        let config = r.p(&format!("{name}.yaml"));
        std::fs::write(&config, format!("remoteEnabled: true\nconnectionInfoFile: {info}\n")).unwrap();
        config
    };
    let (ours, others) = (config_for("ours", &secret.name), config_for("others", "another-machine-plan"));
    let start_as = |config: &str| {
        Reaped(std::process::Command::new(&stand_in).arg("300").env("CATTLE_AGENT_CONFIG", config).spawn().unwrap())
    };
    let start_rival = || start_as(&ours);
    let rival = start_rival();
    r.create(&json!({"instructions": [sh("one", "echo one")]}), Some("pending"), &[]).await;
    let mut agent = AgentProc::start_with(&r.config, &[("NODEPLAN_RIVAL_PROGRAM", &name)]);
    let line = agent.wait_log("may act on this plan Secret");
    assert!(line.contains(&format!("pid {}", rival.0.id())) && line.contains("rivalCheck: false"), "{line}");
    assert_eq!(state(&r.get().await), "pending", "nothing is done while it runs");
    drop(rival);
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    let unit = UnitCgroup::new(&name);
    let rival = start_rival();
    unit.join(rival.0.id());
    let line = agent.wait_log("started on this node");
    assert!(line.contains(&format!("pid {}", rival.0.id())), "{line}");
    assert_eq!(agent.child.wait().unwrap().code(), Some(1));
    // An operator who knows it serves another Secret turns the check off: the agent acts beside it.
    let ns = r.client.secret_ref().namespace.clone();
    let unchecked = ClusterNode::new("remoteEnabled: true\nrivalCheck: false\n", &cp.kubeconfig_yaml(), &ns);
    let mut agent = AgentProc::start_with(&unchecked.config, &[("NODEPLAN_RIVAL_PROGRAM", &name)]);
    agent.wait_log("not looking for rancher-system-agent on this node (rivalCheck: false)");
    r.new_plan(&json!({"instructions": [sh("two", "echo two")]})).await;
    r.wait("the second plan succeeded beside it", |s| state(s) == "succeeded").await;
    assert!(
        rival.0.id() > 0 && agent.seen.iter().all(|l| !l.contains("may act on this plan Secret")),
        "{:?}",
        agent.seen
    );
    agent.stop_cleanly();
    // One that serves another Secret (its files say so) holds nothing, checked or not.
    drop(rival);
    let beside = start_as(&others);
    unit.join(beside.0.id());
    let mut agent = AgentProc::start_with(&r.config, &[("NODEPLAN_RIVAL_PROGRAM", &name)]);
    let line = agent.wait_log("not this one: acting beside it");
    assert!(line.contains(&format!("pid {}", beside.0.id())) && line.contains("another-machine-plan"), "{line}");
    r.new_plan(&json!({"instructions": [sh("three", "echo three")]})).await;
    r.wait("the third plan succeeded beside it", |s| state(s) == "succeeded").await;
    assert!(agent.seen.iter().all(|l| !l.contains("may act on this plan Secret")), "{:?}", agent.seen);
    agent.stop_cleanly();
    drop(beside);
    drop(unit);
    let impostor_ran = impostor.0.try_wait().unwrap().is_none();
    assert!(impostor_ran, "the impostor ran all along");
}

/// Many nodes at once (issue 14): four agents, each with its plan Secret labelled `pool=workers`
/// (and one `pool=db` Secret the selector must not touch). `plan status --selector --watch
/// --output json` reports every node's transitions, each once; `plan cancel --selector` reaches
/// every running node in one pass; `plan status --selector` shows them, as a table (failures
/// first) and as JSON.
#[tokio::test]
async fn fleet_status_and_cancel_fan_out_by_selector() {
    let cp = control_plane!();
    let ns = cp.new_namespace("fleet").await;
    let kubeconfig_path = cp.kubeconfig_path();
    let kubeconfig = kubeconfig_path.to_string_lossy().to_string();
    let cli = |args: &[&str]| {
        std::process::Command::new(NODEPLAN)
            .args(args)
            .args(["-n", &ns, "--kubeconfig", &kubeconfig])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let names = ["w1", "w2", "w3", "w4"];
    let mut nodes = Vec::new();
    for (name, pool) in names.iter().map(|n| (*n, "workers")).chain([("d1", "db")]) {
        let node = ClusterNode::for_secret("remoteEnabled: true\n", &cp.kubeconfig_yaml(), &ns, name);
        let ready = node.fifo("ready");
        let plan = json!({"instructions": [sh("long", &format!("echo > {ready}; exec sleep 300"))]});
        let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: name.into() });
        let raw = serde_json::to_vec(&plan).unwrap();
        c.create(BTreeMap::from([("plan".into(), raw), ("plan-state".into(), b"pending".to_vec())]), BTreeMap::new())
            .await
            .unwrap();
        c.orchestrator_patch(json!({"metadata": {"labels": {"pool": pool}}})).await.unwrap();
        nodes.push((name, node, ready, c));
    }
    // The watch starts with every selected node's row (a handshake: nothing runs before it).
    let mut watch = std::process::Command::new(NODEPLAN)
        .args(["plan", "status", "-l", "pool=workers", "--watch", "-o", "json", "-n", &ns, "--kubeconfig", &kubeconfig])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = lines_of(watch.stdout.take().unwrap());
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    let mut note = |line: String, seen: &mut BTreeMap<String, Vec<String>>| {
        let row: serde_json::Value = serde_json::from_str(&line).unwrap();
        let node = row["node"].as_str().unwrap().to_string();
        assert_ne!(last.insert(node.clone(), line.clone()).as_deref(), Some(line.as_str()), "a row reported twice");
        let states = seen.entry(node).or_default();
        let st = row["state"].as_str().unwrap().to_string();
        if states.last() != Some(&st) {
            states.push(st);
        }
    };
    for _ in 0..4 {
        note(lines.recv_timeout(GUARD).expect("the watch lists the selected nodes"), &mut seen);
    }
    assert!(seen.values().all(|s| s == &["pending"]) && seen.len() == 4, "{seen:?}");
    let mut agents: Vec<AgentProc> = nodes.iter().map(|(_, n, _, _)| n.agent()).collect();
    for (_, _, ready, _) in &nodes {
        read_fifo(ready);
    }
    let out = cli(&["plan", "cancel", "-l", "pool=workers"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("canceled 4 plan Secrets"), "{stdout}");
    for (name, _, _, c) in &nodes[..4] {
        let deadline = Instant::now() + GUARD;
        while state(&c.get().await.unwrap().unwrap()) != "canceled" {
            assert!(Instant::now() < deadline, "{name} never canceled");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    let db = nodes[4].3.get().await.unwrap().unwrap();
    assert!(!db.annotations.contains_key(plan::ANNOTATION_CANCELED), "the selector picked db");
    assert_eq!(state(&db), "in-progress");

    let out = cli(&["plan", "status", "-l", "pool=workers"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.starts_with("NODE") && table.contains("4 nodes: 4 canceled"), "{table}");
    assert!(!table.lines().any(|l| l.starts_with("d1 ")), "the db node is not selected: {table}");
    // kubectl's shapes: one List document (JSON or YAML), names for xargs, wide names the objects.
    let out = cli(&["plan", "status", "-l", "pool=workers", "-o", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((&list["apiVersion"], &list["kind"]), (&json!("v1"), &json!("List")), "{list}");
    let rows = list["items"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(
        rows.iter()
            .all(|r| r["state"] == "canceled" && r["total"] == 1 && r["kind"] == "Secret" && r["namespace"] == ns),
        "{rows:?}"
    );
    let out = cli(&["plan", "status", "-l", "pool=workers", "-o", "yaml"]);
    let yaml: serde_json::Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(yaml, list);
    let out = cli(&["plan", "status", "-l", "pool=workers", "-o", "name"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "secret/w1\nsecret/w2\nsecret/w3\nsecret/w4\n");
    let out = cli(&["plan", "status", "-l", "pool=workers", "-o", "wide"]);
    let wide = String::from_utf8_lossy(&out.stdout);
    assert!(wide.lines().next().is_some_and(|h| h.contains("OBJECT")), "{wide}");
    assert!(wide.contains(&format!("{ns}/w1")), "{wide}");
    // One plan: the row itself, in the same shape.
    let out = std::process::Command::new(NODEPLAN)
        .args(["plan", "status", "--secret", &format!("{ns}/w1"), "-o", "json", "--kubeconfig", &kubeconfig])
        .output()
        .unwrap();
    let one: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(one, rows[0], "{}", String::from_utf8_lossy(&out.stderr));

    // The watch saw each worker go pending → in-progress → canceled, each transition once.
    while seen.values().filter(|s| s.last().map(String::as_str) == Some("canceled")).count() < 4 {
        note(lines.recv_timeout(GUARD).expect("the watch reported every node canceled"), &mut seen);
    }
    for name in &names[..] {
        assert_eq!(seen[*name], ["pending", "in-progress", "canceled"], "{name}");
    }
    assert!(!seen.contains_key("d1"));
    unsafe { libc::kill(watch.id() as i32, libc::SIGINT) };
    assert_eq!(watch.wait().unwrap().code(), Some(0));
    for a in &mut agents {
        a.stop();
    }
}

/// Nodes for a rollout: one agent each, its plan Secret `NAME` (no plan yet) labelled `pool`.
async fn fleet_of(cp: &ControlPlane, ns: &str, names: &[String], pool: &str) -> Vec<(ClusterNode, AgentProc)> {
    let mut out = Vec::new();
    for name in names {
        let node = ClusterNode::for_secret("remoteEnabled: true\n", &cp.kubeconfig_yaml(), ns, name);
        let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.to_string(), name: name.clone() });
        c.create(BTreeMap::new(), BTreeMap::new()).await.unwrap();
        c.orchestrator_patch(json!({"metadata": {"labels": {"pool": pool}}})).await.unwrap();
        let agent = node.agent();
        out.push((node, agent));
    }
    out
}

/// `nodeplan rollout` with the test's kubeconfig and namespace.
fn rollout_cmd(cp: &ControlPlane, ns: &str, plan: &str, extra: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(NODEPLAN);
    c.args(["rollout", plan, "-n", ns, "--kubeconfig"]).arg(cp.kubeconfig_path()).args(extra);
    c.stdin(std::process::Stdio::null());
    c
}

/// Issue 43: a rollout (and `plan status -l --watch`) against an API server that does not answer
/// ends with exit 1 once its first list has waited --request-timeout, saying why and writing
/// nothing (each retried for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_or_a_watch_against_an_api_server_that_cannot_be_read_ends_with_exit_1() {
    let cp = control_plane!();
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kubeconfig = dir.path().join("dead.kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig_yaml().replace(&cp.server_url(), &format!("https://127.0.0.1:{port}")))
        .unwrap();
    let plan = dir.path().join("p.plan");
    std::fs::write(&plan, r#"{"instructions":[{"name":"a","command":"true"}]}"#).unwrap();
    // Each command's exit code and stderr.
    let run = |args: &[&str]| {
        let mut child = std::process::Command::new(NODEPLAN)
            .args(args)
            .args(["-n", "default", "--request-timeout", "2s", "--kubeconfig"])
            .arg(&kubeconfig)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let code = exit_code(&mut child, &format!("nodeplan {args:?} against a closed port"));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        (code, err)
    };
    let (code, err) = run(&["rollout", &plan.to_string_lossy(), "-l", "fleet=none"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nodeplan: cannot read the API server: "), "{err}");
    assert!(err.contains("could not be listed within 2s (--request-timeout); nothing was written"), "{err}");
    // `plan status -l --watch` too (it relisted for ever).
    let (code, err) = run(&["plan", "status", "-l", "fleet=none", "--watch"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nodeplan: cannot read the API server: "), "{err}");
    assert!(err.contains("could not be listed within 2s (--request-timeout)"), "{err}");
}

/// Issue 14: 20 agents, `--max-concurrent 5`. Each node's instruction waits on a gate of its own
/// (a FIFO beside its work directory) that the test opens. The rollout is interrupted with five
/// nodes in flight (exit 8; they finish without it), and the same command continues without
/// running any node twice (exit 0). A watch of the test's own checks from the Secrets' state
/// history that never more than 5 nodes were in flight. While it runs, a second rollout over the
/// same or overlapping nodes is refused (exit 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_keeps_its_concurrency_and_continues_after_an_interruption() {
    let cp = control_plane!();
    let ns = cp.new_namespace("rollout").await;
    let names: Vec<String> = (0..20).map(|i| format!("r{i:02}")).collect();
    let mut fleet = fleet_of(cp, &ns, &names, "roll").await;
    let gates: Vec<String> = fleet.iter().map(|(n, _)| n.fifo("gate")).collect();
    let runs: Vec<String> = fleet.iter().map(|(n, _)| n.p("runs")).collect();
    let plan_file = fleet[0].0.p("rollout.plan");
    let script = r#"d="$CATTLE_AGENT_EXECUTION_PWD/../../.."; echo run >> "$d/runs"; cat "$d/gate" > /dev/null"#;
    std::fs::write(&plan_file, serde_json::to_vec(&json!({"instructions": [sh("gated", script)]})).unwrap()).unwrap();
    let raw = std::fs::read(&plan_file).unwrap();
    let checksum = plan::checksum(&raw);

    // The state history, from a watch of the test's own: nodes in flight after every event.
    let (listed_tx, listed) = std::sync::mpsc::channel();
    let history = {
        let client = cp.client().await;
        let (ns, checksum) = (ns.clone(), checksum.clone());
        tokio::spawn(async move {
            use futures::StreamExt as _;
            use nodeplan::fleet::objects::{Kind, Object, Scope, Selected};
            let scope = Scope { kind: Kind::Secrets, namespace: Some(ns), selector: "pool=roll".into() };
            let mut stream = nodeplan::fleet::objects::watch(client, &scope);
            let mut flying: BTreeMap<String, bool> = BTreeMap::new();
            let mut most = 0;
            while let Some(e) = stream.next().await {
                if let Selected::Listed = e {
                    let _ = listed_tx.send(());
                }
                if let Selected::Is(name, Object::Secret(s)) = e {
                    let ours = s.data.get("plan").is_some_and(|p| plan::checksum(p) == checksum);
                    flying.insert(name, ours && matches!(state(&s).as_str(), "pending" | "in-progress"));
                    most = most.max(flying.values().filter(|f| **f).count());
                    if flying.len() == 20 && flying.values().all(|f| !f) && most > 0 {
                        return most;
                    }
                }
            }
            most
        })
    };

    listed.recv_timeout(GUARD).expect("the history watch listed the nodes");
    let mut first = rollout_cmd(cp, &ns, &plan_file, &["-l", "pool=roll", "--max-concurrent", "5"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(first.stdout.take().unwrap());
    let mut printed = Vec::new();
    let mut wait_line = |needle: &str| loop {
        let l =
            lines.recv_timeout(GUARD).unwrap_or_else(|_| panic!("the rollout never printed {needle:?}: {printed:#?}"));
        printed.push(l.clone());
        if l.contains(needle) {
            return l;
        }
    };
    // The first five start (by name); releasing them lets the next five start.
    for gate in &gates[..5] {
        release_fifo(gate);
    }
    wait_line("r09: starting");
    for (node, _) in &fleet[5..10] {
        read_fifo_started(&node.p("runs"));
    }
    // While it runs, the same rollout again, or one over a selection that shares a node with it,
    // is refused (its Lease is held) and writes nothing.
    let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: "r15".into() });
    c.orchestrator_patch(json!({"metadata": {"labels": {"extra": "yes"}}})).await.unwrap();
    for selector in ["pool=roll", "extra=yes"] {
        let out = rollout_cmd(cp, &ns, &plan_file, &["-l", selector]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(5), "{selector}: {err}");
        assert!(err.contains("running"), "{selector}: {err}");
    }
    assert!(!c.get().await.unwrap().unwrap().data.contains_key("plan"), "the refused rollout wrote nothing");
    unsafe { libc::kill(first.id() as i32, libc::SIGINT) };
    assert_eq!(exit_code(&mut first, "the interrupted rollout"), Some(8), "interrupted");
    // The nodes in flight finish without the rollout.
    for gate in &gates[5..10] {
        release_fifo(gate);
    }
    let mut second = rollout_cmd(cp, &ns, &plan_file, &["-l", "pool=roll", "--max-concurrent", "5"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = lines_of(second.stdout.take().unwrap());
    for gate in &gates[10..] {
        release_fifo(gate);
    }
    let _ = &out;
    assert_eq!(exit_code(&mut second, "the continued rollout"), Some(0), "every node succeeded");
    for (name, r) in names.iter().zip(&runs) {
        assert_eq!(std::fs::read_to_string(r).unwrap(), "run\n", "{name} ran once");
    }
    let most = tokio::time::timeout(GUARD, history).await.expect("the history watch ended").unwrap();
    assert_eq!(most, 5, "never more than 5 in flight, and 5 at some point");
    for (_, a) in &mut fleet {
        a.stop();
    }
}

/// Issue 14: `rollout pause|resume|cancel` act on a running rollout through the objects alone.
/// Paused, the rollout starts no new node and its nodes in flight pause at their boundary (here
/// they finish their last instruction, which is a success); resumed, it goes on; canceled, its
/// nodes in flight are canceled and it ends with exit 4, starting nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_pause_resume_and_cancel() {
    let cp = control_plane!();
    let ns = cp.new_namespace("rollctl").await;
    let names: Vec<String> = (0..4).map(|i| format!("p{i:02}")).collect();
    let mut fleet = fleet_of(cp, &ns, &names, "ctl").await;
    let gates: Vec<String> = fleet.iter().map(|(n, _)| n.fifo("gate")).collect();
    let script = |tag: &str| {
        format!(r#"d="$CATTLE_AGENT_EXECUTION_PWD/../../.."; echo {tag} >> "$d/runs"; cat "$d/gate" > /dev/null"#)
    };
    let write_plan = |file: &str, tag: &str| {
        let path = fleet[0].0.p(file);
        std::fs::write(&path, serde_json::to_vec(&json!({"instructions": [sh("gated", &script(tag))]})).unwrap())
            .unwrap();
        path
    };
    let (one, two) = (write_plan("one.plan", "one"), write_plan("two.plan", "two"));
    let ctl = |verb: &str| {
        let out = rollout_cmd(cp, &ns, verb, &["-l", "pool=ctl"]).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{verb}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let client = cp.client().await;
    let secret = |name: &str| SecretClient::new(client.clone(), SecretRef { namespace: ns.clone(), name: name.into() });

    let mut run = rollout_cmd(cp, &ns, &one, &["-l", "pool=ctl", "--max-concurrent", "2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(run.stdout.take().unwrap());
    let wait_line = |needle: &str| loop {
        let l = lines.recv_timeout(GUARD).unwrap_or_else(|_| panic!("the rollout never printed {needle:?}"));
        if l.contains(needle) {
            return l;
        }
    };
    wait_line("p01: starting");
    for (node, _) in &fleet[..2] {
        read_fifo_started(&node.p("runs"));
    }
    assert!(ctl("pause").contains("(2 of its nodes paused)"));
    wait_line("paused: no new node starts");
    // `rollout status` (issue 24; it was read as a plan file named "status"): the rollout is paused
    // and running, with its plan, and the nodes' table.
    let status = ctl("status");
    let one_id = plan::id_of(&std::fs::read(&one).unwrap()).unwrap();
    assert!(status.starts_with(&format!("rollout:    paused (running), plan {one_id}, held by ")), "{status}");
    assert!(status.contains("NODE") && status.contains("p00") && status.contains("p03"), "{status}");
    let out = rollout_cmd(cp, &ns, "status", &["-l", "pool=ctl", "-o", "json"]).output().unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&doc["state"], &doc["running"], &doc["plan"]),
        (&json!("paused"), &json!(true), &json!(one_id)),
        "{doc}"
    );
    let nodes: Vec<&str> = doc["nodes"].as_array().unwrap().iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(nodes.len(), 4, "{doc}");
    for gate in &gates[..2] {
        release_fifo(gate);
    }
    wait_line("[2/4 done");
    for name in ["p02", "p03"] {
        assert!(!secret(name).get().await.unwrap().unwrap().data.contains_key("plan"), "paused: {name} not started");
    }
    assert!(ctl("resume").contains("(2 of its nodes resumed)"), "the finished nodes lose their pause too");
    for gate in &gates[2..] {
        release_fifo(gate);
    }
    assert_eq!(exit_code(&mut run, "the resumed rollout"), Some(0));

    let mut run = rollout_cmd(cp, &ns, &two, &["-l", "pool=ctl", "--max-concurrent", "2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines2 = lines_of(run.stdout.take().unwrap());
    loop {
        let l = lines2.recv_timeout(GUARD).expect("the second rollout started two nodes");
        if l.contains("p01: starting") {
            break;
        }
    }
    for (node, _) in &fleet[..2] {
        let deadline = Instant::now() + GUARD;
        while !std::fs::read_to_string(node.p("runs")).unwrap_or_default().contains("two") {
            assert!(Instant::now() < deadline, "the second plan never started");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(ctl("cancel").contains("(2 of its nodes canceled)"));
    assert_eq!(exit_code(&mut run, "the canceled rollout"), Some(4));
    assert!(ctl("status").starts_with("rollout:    canceled (not running), plan "), "a canceled rollout's status");
    for (name, want) in [("p00", "canceled"), ("p01", "canceled"), ("p02", "succeeded"), ("p03", "succeeded")] {
        assert_eq!(state(&secret(name).get().await.unwrap().unwrap()), want, "{name}");
    }
    for (_, a) in &mut fleet {
        a.stop();
    }
}

/// Wait until an instruction noted its start in `runs` (it then blocks on its gate).
fn read_fifo_started(runs: &str) {
    let deadline = Instant::now() + GUARD;
    while std::fs::read_to_string(runs).map_or(true, |r| r.is_empty()) {
        assert!(Instant::now() < deadline, "{runs}: the instruction never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 14: `--max-errors 2` with one node at a time: the first three nodes fail, and after the
/// third failure no new node starts; the rollout exits 7 (the error budget), the other nodes never
/// got the plan. The table names the failing instruction and its exit status.
#[tokio::test]
async fn rollout_stops_at_the_error_budget() {
    let cp = control_plane!();
    let ns = cp.new_namespace("budget").await;
    let names: Vec<String> = (0..8).map(|i| format!("b{i:02}")).collect();
    let mut fleet = fleet_of(cp, &ns, &names, "budget").await;
    for (node, _) in &fleet[..4] {
        std::fs::write(node.p("fail"), b"").unwrap();
    }
    let plan_file = fleet[0].0.p("rollout.plan");
    let script = r#"test ! -e "$CATTLE_AGENT_EXECUTION_PWD/../../../fail""#;
    std::fs::write(&plan_file, serde_json::to_vec(&json!({"instructions": [sh("check", script)]})).unwrap()).unwrap();
    // --dry-run: the order and the waves, and nothing written.
    let dry = rollout_cmd(cp, &ns, &plan_file, &["-l", "pool=budget", "--max-concurrent", "3", "--dry-run"])
        .output()
        .unwrap();
    let dry = String::from_utf8_lossy(&dry.stdout).into_owned();
    let id = plan::id_of(&std::fs::read(&plan_file).unwrap()).unwrap();
    assert!(dry.starts_with(&format!("dry run: roll plan {id} out to 8 nodes (")), "{dry}");
    assert!(dry.ends_with("wave 1: b00, b01, b02\nwave 2: b03, b04, b05\nwave 3: b06, b07\n"), "{dry}");
    for name in &names {
        let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: name.clone() });
        assert!(!c.get().await.unwrap().unwrap().data.contains_key("plan"), "the dry run wrote {name}");
    }
    // In a terminal (script(1) gives it one), the rollout redraws the fleet table with a bar.
    let cmd = rollout_cmd(cp, &ns, &plan_file, &["-l", "pool=budget", "--max-concurrent", "1", "--max-errors", "2"]);
    let line: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| format!("'{}'", a.to_string_lossy()))
        .collect();
    let out = std::process::Command::new("script").args(["-qec", &line.join(" "), "/dev/null"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{stdout}");
    assert!(stdout.contains("stopped by the error budget (more than 2 failed)"), "{stdout}");
    assert!(stdout.contains("NODE") && stdout.contains("b00") && stdout.contains("failed"), "the table: {stdout}");
    // What made each node fail, in the table (issue 24).
    assert!(stdout.contains("1 failure: instruction 1/1 check: exit status 1"), "the table: {stdout}");
    assert!(stdout.contains("[") && stdout.contains("xxx") && stdout.contains("] 0/8"), "the bar: {stdout}");
    let mut with_plan = Vec::new();
    for name in &names {
        let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: name.clone() });
        let s = c.get().await.unwrap().unwrap();
        if s.data.contains_key("plan") {
            with_plan.push((name.clone(), state(&s)));
        }
    }
    let failed: Vec<(String, String)> = names[..3].iter().map(|n| (n.clone(), "failed".to_string())).collect();
    assert_eq!(with_plan, failed, "three failures, then nothing new started");
    for (_, a) in &mut fleet {
        a.stop();
    }
}

#[tokio::test]
async fn checksum_flow_stops_at_max_failures() {
    let cp = control_plane!();
    let r = Remote::new(cp, "maxfail").await;
    let status = Arc::new(AtomicU16::new(200));
    let port = http_server(status.clone());
    let plan = json!({
        "instructions": [sh("fails", "exit 3")],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}, "successThreshold": 1, "failureThreshold": 1}}
    });
    let raw = serde_json::to_vec(&plan).unwrap();
    r.client
        .create(
            BTreeMap::from([
                ("plan".into(), raw),
                ("max-failures".into(), b"1".to_vec()),
                ("probe-period-seconds".into(), b"1".to_vec()),
            ]),
            BTreeMap::new(),
        )
        .await
        .unwrap();
    let mut agent = r.agent();
    r.wait("the first failure", |s| val(s, "failure-count") == "1").await;
    // The orchestrator moves the last attempt a minute back: the cooldown is over, so only
    // max-failures can keep the agent from trying again.
    use base64::Engine as _;
    let old = plan::format_unix_date(chrono::Utc::now() - chrono::TimeDelta::seconds(60));
    r.patch(json!({"data": {"last-apply-time": base64::engine::general_purpose::STANDARD.encode(&old)}})).await;
    // Probes prove the agent keeps reconciling meanwhile.
    status.store(500, Ordering::SeqCst);
    r.wait("a reconcile (the probe turns unhealthy)", |s| {
        String::from_utf8_lossy(s.data.get("probe-statuses").map(Vec::as_slice).unwrap_or(b"")).contains("failureCount")
    })
    .await;
    status.store(200, Ordering::SeqCst);
    r.wait("another reconcile (healthy again)", |s| {
        String::from_utf8_lossy(s.data.get("probe-statuses").map(Vec::as_slice).unwrap_or(b"")).contains("healthy")
    })
    .await;
    let s = r.get().await;
    assert_eq!(val(&s, "failure-count"), "1", "max-failures reached: no further attempt");
    assert_eq!(val(&s, "last-apply-time"), old);
    assert_eq!(agent.stop(), 0);
}

/// Faults (`docs/rules.md#proof-faults`), remote mode: the agent SIGKILLed at pseudo-random points
/// of a plan and restarted. The plan ends succeeded, no instruction ran while its previous copy was
/// alive, and nothing any of the agents started is left running.
#[tokio::test]
async fn sigkill_at_random_points_then_restart() {
    let cp = control_plane!();
    let r = Remote::new(cp, "faults").await;
    let (log, overlap, pidfile) = (r.p("log"), r.p("overlap"), r.p("pid"));
    let steps: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            sh(
                &format!("s{i}"),
                &format!(
                    "{}; echo start-{i} >> {log}; sleep 0.15; echo end-{i} >> {log}",
                    overlap_check(&pidfile, &overlap, &format!("overlap-{i}"))
                ),
            )
        })
        .collect();
    r.create(&json!({ "instructions": steps }), Some("pending"), &[]).await;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut agents = Vec::new();
    for _ in 0..6 {
        let agent = r.agent();
        agents.push(agent.child.id());
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // The fault's timing (not a wait for anything): 0.2–0.8 s into the agent's life.
        tokio::time::sleep(Duration::from_millis(200 + seed % 600)).await;
        agent.crash();
    }
    let mut last = r.agent();
    agents.push(last.child.id());
    let s = r.wait("succeeded after the faults", |s| state(s) == "succeeded").await;
    assert_eq!(last.stop(), 0);
    assert_eq!(val(&s, "plan-state"), "succeeded");
    assert!(!Path::new(&overlap).exists(), "an instruction ran while its previous copy was alive");
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!((0..4).all(|i| log.contains(&format!("end-{i}"))), "{log}");
    assert!(log.matches("start-").count() > 4, "the faults hit the plan mid-way (it re-ran from the start): {log}");
    let left: Vec<i32> = agents.iter().flat_map(|a| started_by(*a)).collect();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// A plan that fails at its second instruction (issue 24): the operator finds the instruction, its
/// exit status and its last output lines, with the instruction's env value masked, in
/// `plan status --secret`, in the Failed Event's note and in the fleet table (`plan status -l`);
/// `plan logs` (one Secret, and `-l`) shows each instruction's output and outcome, `nodeplan status`
/// the last result; the Secret keeps the failure in nodeplan's own key `failed-instruction`.
#[tokio::test]
async fn a_failure_names_its_instruction_exit_status_and_last_lines_where_the_operator_looks() {
    let cp = control_plane!();
    let r = Remote::new(cp, "failure-detail").await;
    let ns = r.client.secret_ref().namespace.clone();
    let kubeconfig = r.p("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig_yaml()).unwrap();
    let plan = json!({"instructions": [
        sh("prepare", "echo ready"),
        {"name": "boom", "command": "sh", "args": ["-c", "echo disk full; echo token $TOKEN; exit 3"],
         "env": ["TOKEN=hunter2-secret"], "saveOutput": true}
    ]});
    r.create(&plan, Some("pending"), &[]).await;
    // Rancher names the machine in a label: the fleet views show it as the node.
    r.patch(json!({"metadata": {"labels": {"failure-detail": "yes", "rke.cattle.io/machine-name": "pool-a-m1"}}}))
        .await;
    let mut agent = r.agent();
    let s = r.wait("failed", |s| state(s) == "failed").await;
    let key = val(&s, "failed-instruction");
    assert!(key.contains(r#""instruction":2"#) && key.contains(r#""outcome":"exit status 3""#), "{key}");
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(NODEPLAN)
            .args(args)
            .args(["--kubeconfig", kubeconfig.as_str()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let status = cli(&["plan", "status", "--secret", &format!("{ns}/machine-plan")]);
    assert!(status.contains("failure:    instruction 2/2 boom: exit status 3"), "{status}");
    assert!(status.contains("| disk full") && status.contains("| token ***"), "{status}");
    assert!(!status.contains("hunter2"), "the env value is masked: {status}");
    let logs = cli(&["plan", "logs", "--secret", &format!("{ns}/machine-plan")]);
    let want = "instruction 1/2 prepare: ok\n  | ready\ninstruction 2/2 boom: FAILED (exit status 3)\n  | disk full\n  | token ***\n";
    assert_eq!(logs, want);
    let fleet_logs = cli(&["plan", "logs", "-l", "failure-detail=yes", "-n", &ns]);
    assert_eq!(fleet_logs, format!("== pool-a-m1 ==\n{want}"));
    let table = cli(&["plan", "status", "-l", "failure-detail=yes", "-n", &ns]);
    assert!(table.lines().nth(1).is_some_and(|l| l.starts_with("pool-a-m1 ")), "{table}");
    assert!(
        table.contains("1 failure: instruction 2/2 boom: exit status 3; last output: disk full | token ***"),
        "{table}"
    );
    let client = cp.client().await;
    let ev = wait_events(&client, &ns, "machine-plan", "Failed", |ev| ev.iter().any(|e| e.0 == "Failed")).await;
    let note = &ev.iter().find(|e| e.0 == "Failed").unwrap().1;
    assert!(
        note.contains(
            "failed (1/2 instructions): instruction 2/2 boom: exit status 3; last output: disk full | token ***"
        ),
        "{note}"
    );
    assert!(!note.contains("hunter2"), "{note}");
    // `nodeplan status`: the source, its Lease held, and the last result.
    let out =
        agent_status_until(&r.config, "the failure", |o| o.contains("failed: instruction 2/2 boom: exit status 3"));
    assert!(out.contains(&format!("source:     secret: secret {ns}/machine-plan (Lease: held as ")), "{out}");
    assert!(out.contains("applying:   nothing"), "{out}");
    assert_eq!(agent.stop(), 0);
}

/// What one plan costs the API server (issue 40): through the watch it already has, the agent
/// writes `in-progress` and the outcome (system-agent's two requests), renews its Lease only when
/// the Lease could have lapsed (not here: the plan before renewed it), and publishes at most one
/// Event request per Event, after the outcome (the same Event again is one PATCH of its count).
/// Counted from the API server's own audit log.
#[tokio::test]
async fn a_plan_costs_two_writes_and_no_lease_write_while_the_lease_is_fresh() {
    let Some(cp) = ControlPlane::start_audited().await else { return };
    let r = Remote::new(&cp, "requests").await;
    // No renewal falls due by itself in the window (every quarter of an hour).
    let config = std::fs::read_to_string(&r.config).unwrap();
    std::fs::write(&r.config, format!("{config}leaseDuration: 1h\n")).unwrap();
    r.create(&json!({"instructions": [sh("one", "true")]}), Some("pending"), &[]).await;
    let mut agent = r.agent();
    r.wait("the first plan succeeded", |s| state(s) == "succeeded").await;
    let ns = &r.client.secret_ref().namespace;
    let admin = cp.client().await;
    wait_events(&admin, ns, "machine-plan", "the first plan's outcome", |ev| {
        ev.iter().any(|e| e.0 == "Succeeded" && e.1.contains("1/1"))
    })
    .await;
    // A plan of three instructions, then the same plan again (Rancher's retry writes pending): its
    // Events are the first run's again.
    let plan = json!({"instructions": [sh("a", "true"), sh("b", "true"), sh("c", "true")]});
    for (n, seen) in [(2, 1), (3, 2)] {
        let before = cp.audited(ns, "nodeplan/").len();
        if n == 2 {
            r.new_plan(&plan).await;
        } else {
            r.set_state("pending").await;
        }
        // Read after the write that made it pending: succeeded is this plan's.
        r.wait("the plan succeeded", |s| state(s) == "succeeded").await;
        wait_events(&admin, ns, "machine-plan", "the plan's outcome", |ev| {
            ev.iter().any(|e| e.0 == "Succeeded" && e.1.contains("3/3") && e.2 == seen)
        })
        .await;
        let requests: Vec<_> = cp.audited(ns, "nodeplan/").split_off(before);
        let shown: Vec<String> =
            requests.iter().map(|a| format!("{} {}/{} {}", a.verb, a.resource, a.name, a.code)).collect();
        let count = |resource: &str, verbs: &[&str]| {
            requests.iter().filter(|a| a.resource == resource && verbs.contains(&a.verb.as_str())).count()
        };
        let writes = ["create", "update", "patch"];
        assert_eq!(count("secrets", &writes), 2, "plan {n}: in-progress and the outcome: {shown:#?}");
        assert_eq!(count("secrets", &["get", "list"]), 0, "plan {n}: the watch carries every read: {shown:#?}");
        assert_eq!(count("leases", &writes), 0, "plan {n}: renewed for the plan before, a moment ago: {shown:#?}");
        let events = requests.iter().filter(|a| a.resource == "events").count();
        let published = count("events", &writes);
        assert_eq!(events, published, "plan {n}: an Event again is written without reading it: {shown:#?}");
        assert!(published <= 2, "plan {n}: one request per Event: {shown:#?}");
    }
    assert_eq!(agent.stop(), 0);
}

/// Issue 41, item 7: values a third party writes into a plan Secret (`plan-state`,
/// `failure-count`, `last-apply-time`, a label) reach no terminal raw: `plan status --secret`, the
/// fleet table, its summary and its wide form escape every control character (an OSC 52
/// clipboard write, a screen clear); JSON and YAML keep the values exact.
#[tokio::test]
async fn values_a_third_party_writes_reach_no_terminal_raw() {
    let cp = control_plane!();
    let ns = cp.new_namespace("hostile").await;
    let kubeconfig = cp.kubeconfig_path().to_string_lossy().to_string();
    let hostile = "failed\x1b]52;c;ZXZpbA==\x07\x1b[2J";
    let c = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: "h1".into() });
    let plan = serde_json::to_vec(&json!({"instructions": [sh("one", "true")]})).unwrap();
    let data = BTreeMap::from([
        ("plan".to_string(), plan),
        ("plan-state".to_string(), hostile.as_bytes().to_vec()),
        ("failure-count".to_string(), b"3\x1b[2J".to_vec()),
        ("last-apply-time".to_string(), b"\x1b]0;title\x07".to_vec()),
    ]);
    c.create(data, BTreeMap::new()).await.unwrap();
    c.orchestrator_patch(json!({"metadata": {"labels": {"pool": "hostile"}}})).await.unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(NODEPLAN)
            .args(args)
            .args(["--kubeconfig", &kubeconfig])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let raw = |c: char| c.is_control() && c != '\n';
    let secret = format!("{ns}/h1");
    for args in [
        &["plan", "status", "--secret", &secret][..],
        &["plan", "status", "-l", "pool=hostile", "-n", &ns],
        &["plan", "status", "-l", "pool=hostile", "-n", &ns, "-o", "wide"],
    ] {
        let shown = cli(args);
        assert!(shown.contains("failed"), "{args:?}: {shown}");
        assert!(!shown.chars().any(raw), "{args:?} printed a raw control character: {shown:?}");
        assert!(shown.contains("\\u{1b}"), "{args:?}: the escape shows as text: {shown}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&cli(&["plan", "status", "-l", "pool=hostile", "-n", &ns, "-o", "json"])).unwrap();
    assert_eq!(json["items"][0]["state"], hostile, "JSON keeps the value exact: {json}");
    let yaml: serde_json::Value =
        serde_yaml_ng::from_str(&cli(&["plan", "status", "-l", "pool=hostile", "-n", &ns, "-o", "yaml"])).unwrap();
    assert_eq!(yaml["items"][0]["state"], hostile, "YAML keeps the value exact");
}

/// Issue 43: an agent whose token the API server refuses (401) is not shown as healthy. The
/// connection answers, so it is not "failing"; the refusal is said once in the log (not at every
/// retry), shown by `nodeplan status` with the fix, and counted in the metrics; the agent never
/// holds the Lease.
#[tokio::test]
async fn a_refused_token_is_said_in_the_log_the_status_and_the_metrics() {
    let cp = control_plane!();
    let namespace = cp.new_namespace("refused").await;
    let wrong: String = cp
        .kubeconfig_yaml()
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("token:") {
                "    token: not-the-token\n".to_string()
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let port = free_port();
    let node =
        ClusterNode::new(&format!("remoteEnabled: true\nmetricsAddress: 127.0.0.1:{port}\n"), &wrong, &namespace);
    let mut agent = AgentProc::start(&node.config);
    agent.wait_log("metrics: serving GET /metrics");
    let said = agent.wait_log("refused the agent's token (401 Unauthorized)");
    assert!(said.contains("ERROR") && said.contains("connectionInfoFile"), "{said}");
    let status = agent_status_until(&node.config, "the refusal", |t| t.contains("refused:"));
    assert!(
        status.contains("refused:    the API server refused the agent's token (401 Unauthorized)")
            && !status.contains("requests failing"),
        "{status}"
    );
    let body = scrape_metrics(port);
    for line in
        ["nodeplan_api_refusals{status=\"401\"} 1", "nodeplan_api_refusals{status=\"403\"} 0", "nodeplan_build_info{"]
    {
        assert!(body.contains(line), "{line} in:\n{body}");
    }
    agent.drain();
    let told = agent.seen.iter().filter(|l| l.contains("refused the agent's token")).count();
    assert_eq!(told, 1, "said once while it lasts under a minute: {:?}", agent.seen);
    assert!(agent.seen.iter().all(|l| !l.contains("holding the Lease")), "{:?}", agent.seen);
    agent.stop_cleanly();
}

/// Issue 43: an agent whose plan Secret does not exist says so (it held its Lease and said
/// nothing more): in its log and in `nodeplan status`, until the Secret is created; then it says
/// the Secret exists, the status line goes, and the plan runs. Its metrics say it holds the Lease.
#[tokio::test]
async fn a_plan_secret_that_does_not_exist_is_said_until_it_is_created() {
    let cp = control_plane!();
    let namespace = cp.new_namespace("absent").await;
    let secret = SecretRef { namespace: namespace.clone(), name: "machine-plan".into() };
    let port = free_port();
    let mode = format!("remoteEnabled: true\nmetricsAddress: 127.0.0.1:{port}\n");
    let r = Remote {
        node: ClusterNode::new(&mode, &cp.kubeconfig_yaml(), &namespace),
        client: SecretClient::new(cp.client().await, secret),
    };
    let mut agent = r.agent();
    agent.wait_log("holding the Lease");
    let held = format!("nodeplan_lease_held{{source=\"secret {namespace}/machine-plan\"}} 1");
    let metrics = scrape_metrics(port);
    assert!(metrics.contains(&held), "{held} in:\n{metrics}");
    let said = agent.wait_log("does not exist: nothing to apply until it is created");
    assert!(said.contains("/machine-plan") && said.contains("secretName"), "{said}");
    agent_status_until(&r.config, "the absent Secret", |t| t.contains("; the Secret does not exist, since"));
    let missing = format!("nodeplan_source_problem{{source=\"secret {namespace}/machine-plan\",reason=\"missing\"}}");
    // The exposition is rendered at most once a second: scraped until it shows the change.
    let scraped = |want: &str| {
        let deadline = std::time::Instant::now() + GUARD;
        loop {
            let metrics = scrape_metrics(port);
            if metrics.contains(want) {
                return metrics;
            }
            assert!(std::time::Instant::now() < deadline, "{want} in:\n{metrics}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let metrics = scraped(&format!("{missing} 1"));
    assert!(metrics.contains("nodeplan_api_failing 0"), "the API server answers:\n{metrics}");
    r.create(&json!({"instructions": [sh("one", "true")]}), Some("pending"), &[]).await;
    agent.wait_log("exists now");
    r.wait("succeeded", |s| state(s) == "succeeded").await;
    agent_status_until(&r.config, "no problem", |t| t.contains("source:") && !t.contains("does not exist"));
    scraped(&format!("{missing} 0"));
    agent.stop_cleanly();
}

/// Issue 43: an invalid `plan.cattle.io/paused` written while a plan runs is shown by `plan status
/// --secret` at once (the run goes on, R3; the agent's Event came only after the run).
#[tokio::test]
async fn plan_status_shows_an_invalid_control_value_while_the_plan_runs() {
    let cp = control_plane!();
    let r = Remote::new(cp, "invalid-running").await;
    let ns = r.client.secret_ref().namespace.clone();
    let kubeconfig = r.p("kubeconfig");
    std::fs::write(&kubeconfig, cp.kubeconfig_yaml()).unwrap();
    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    r.create(
        &json!({"instructions": [sh("waits", &format!("echo > {ready}; cat {go} > /dev/null"))]}),
        Some("pending"),
        &[],
    )
    .await;
    let _agent = r.agent();
    read_fifo(&ready);
    r.annotate(plan::ANNOTATION_PAUSED, Some("yes")).await;
    let out = std::process::Command::new(NODEPLAN)
        .args(["plan", "status", "--secret", &format!("{ns}/machine-plan"), "--kubeconfig", &kubeconfig])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(status.contains("state:      in-progress"), "{status}");
    assert!(
        status.contains("invalid: ") && status.contains("\"yes\"") && status.contains("neither pauses nor cancels"),
        "{status}"
    );
    release_fifo(&go);
    r.wait("succeeded: the run went on", |s| state(s) == "succeeded").await;
}

/// Rancher's per-machine Role, as rancher/rancher creates it with each machine's plan Secret,
/// grants `get`, `list`, `watch` and `update` on that one Secret and nothing else: no `patch`, no
/// Leases, no Events (system-agent writes with an update). The agent does all of its work under
/// it: a plan applied and recorded, a cancel of a running one recorded, no refusal said.
#[tokio::test]
async fn the_agent_works_under_ranchers_per_machine_role() {
    use k8s_openapi::api::core::v1::Secret;
    use k8s_openapi::api::rbac::v1::Role;
    use kube::api::{Api, PostParams};
    let cp = control_plane!();
    let r = Remote::new_with(cp, "machine-role", &cp.kubeconfig_yaml_as_agent()).await;
    let ns = r.client.secret_ref().namespace.clone();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "machine-plan", "namespace": ns},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["machine-plan"],
                   "verbs": ["watch", "get", "update", "list"]}],
    }))
    .unwrap();
    Api::<Role>::namespaced(cp.client().await, &ns).create(&PostParams::default(), &role).await.unwrap();
    cp.bind_agent(&ns, "machine-plan").await;
    r.create(&json!({"instructions": [sh("one", "echo one")]}), Some("pending"), &[]).await;
    // The authorizer picks the binding up asynchronously: wait until the agent may read it.
    let as_agent: Api<Secret> = Api::namespaced(cp.agent_client().await, &ns);
    let deadline = std::time::Instant::now() + GUARD;
    while as_agent.get("machine-plan").await.is_err() {
        assert!(std::time::Instant::now() < deadline, "the binding never took effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut agent = r.agent();
    r.wait("succeeded under the role", |s| state(s) == "succeeded").await;
    agent.wait_log("running without the Lease");
    let (ready, go) = (r.fifo("ready"), r.fifo("go"));
    // Held on a FIFO nobody writes: only the cancel ends it.
    r.new_plan(&json!({"instructions": [sh("wait", &format!("echo > {ready}; cat {go} > /dev/null"))]})).await;
    read_fifo(&ready);
    r.annotate(plan::ANNOTATION_CANCELED, Some("true")).await;
    r.wait("canceled under the role", |s| state(s) == "canceled").await;
    agent.drain();
    let refused: Vec<&String> = agent.seen.iter().filter(|l| l.contains("forbids the agent")).collect();
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(agent.stop(), 0);
}
