//! The partition benchmark (issue 21): how long after a network heals does remote mode act
//! again? One real kube-apiserver, one agent reaching it through a loopback relay
//! (`tests/common::Relay`). Each round breaks the relay for a hole (NODEPLAN_BENCH_HOLE_SECS,
//! default 30 s) while an instruction runs, heals it, writes a cancel and times heal → `canceled`;
//! then breaks it again, heals, writes a new plan and times heal → `succeeded`. Two faults side
//! by side, with and without the Lease:
//!
//! - **cut** (the baseline): the relay closes every connection (a FIN), as a restarted load
//!   balancer or API server does; the agent sees it at once;
//! - **silence**: packets stop with no FIN or RST, and afterwards only new connections are
//!   carried (a NAT entry timed out, a failover): only the agent's own bounds can notice.
//!
//! Prints each figure and the ratio silence / cut. The goal (docs/benchmarks.md) is under 15 s for silence.
//! Not a test: it asserts nothing. Run: `cargo bench --bench partition` (needs the cache built by
//! tools/build-kube-apiserver.sh); NODEPLAN_BENCH_ROUNDS (default 1) repeats the rounds.

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
#[path = "../tests/k8s_support/mod.rs"]
mod k8s_support;

use common::{ClusterNode, Relay};
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn state(s: &SecretSnapshot) -> String {
    s.data.get("plan-state").map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

async fn until(c: &SecretClient, pred: impl Fn(&SecretSnapshot) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        if let Ok(Some(s)) = c.get().await
            && pred(&s)
        {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "partition: nothing happened for 5 minutes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn plan_json(script: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"instructions": [{"name": "a", "command": "sh", "args": ["-c", script]}]}))
        .expect("json")
}

/// One round of one fault kind: (heal → canceled, heal → applied).
async fn round(cp: &k8s_support::ControlPlane, silent: bool, lease: bool, hole: Duration) -> (Duration, Duration) {
    let relay = Relay::start(cp.server_url().rsplit(':').next().and_then(|p| p.parse().ok()).expect("port"));
    let ns = cp.new_namespace("partition").await;
    let client = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: "machine-plan".into() });
    let mode = if lease { "remoteEnabled: true\n" } else { "remoteEnabled: true\nleaseDuration: 0s\n" };
    let node = ClusterNode::new(mode, &relay.kubeconfig(&cp.kubeconfig_yaml(), &cp.server_url()), &ns);
    let data = BTreeMap::from([
        ("plan".to_string(), plan_json("exec sleep 600")),
        ("plan-state".to_string(), b"pending".to_vec()),
    ]);
    client.create(data, BTreeMap::new()).await.expect("create");
    let mut agent = std::process::Command::new(common::NODEPLAN)
        .args(["agent", "--config"])
        .arg(&node.config)
        .env("NODEPLAN_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("agent");
    until(&client, |s| state(s) == "in-progress").await;
    let fault = |relay: &Relay| if silent { relay.silence() } else { relay.cut() };

    fault(&relay);
    tokio::time::sleep(hole).await;
    relay.heal();
    let healed = Instant::now();
    client
        .orchestrator_patch(serde_json::json!({"metadata": {"annotations": {"plan.cattle.io/canceled": "true"}}}))
        .await
        .expect("cancel");
    until(&client, |s| state(s) == "canceled").await;
    let canceled = healed.elapsed();

    fault(&relay);
    tokio::time::sleep(hole).await;
    relay.heal();
    let healed = Instant::now();
    let raw = plan_json("true");
    let checksum = nodeplan::plan::checksum(&raw);
    client.orchestrator_patch(nodeplan::remote::wire::push_patch(&raw)).await.expect("push");
    until(&client, |s| {
        state(s) == "succeeded" && s.data.get("applied-checksum").map(Vec::as_slice) == Some(checksum.as_bytes())
    })
    .await;
    let applied = healed.elapsed();
    let _ = agent.kill();
    let _ = agent.wait();
    (canceled, applied)
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::var("NODEPLAN_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let hole =
        Duration::from_secs(std::env::var("NODEPLAN_BENCH_HOLE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(30));
    let Some(cp) = k8s_support::ControlPlane::start().await else {
        eprintln!("partition: no kube-apiserver cache; run tools/build-kube-apiserver.sh first");
        return;
    };
    println!("partition: holes of {}s, {rounds} round(s); heal → canceled / heal → applied", hole.as_secs());
    for lease in [true, false] {
        for _ in 0..rounds {
            let (cut_c, cut_a) = round(&cp, false, lease, hole).await;
            let (sil_c, sil_a) = round(&cp, true, lease, hole).await;
            println!(
                "{}: cut {:.1}s / {:.1}s; silence {:.1}s / {:.1}s (silence/cut {:.1}x / {:.1}x; goal for silence under 15s)",
                if lease { "with the Lease" } else { "without a Lease" },
                cut_c.as_secs_f64(),
                cut_a.as_secs_f64(),
                sil_c.as_secs_f64(),
                sil_a.as_secs_f64(),
                sil_c.as_secs_f64() / cut_c.as_secs_f64().max(0.001),
                sil_a.as_secs_f64() / cut_a.as_secs_f64().max(0.001),
            );
        }
    }
}
