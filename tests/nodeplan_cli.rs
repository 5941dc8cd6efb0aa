//! `nodeplan plan … --nodeplan NAMESPACE/NAME` and `nodeplan plan status --node NODE`: the CLI
//! binary run as a producer runs it (its own kubeconfig file) against a real kube-apiserver with
//! the CRD installed through the API, one namespace per test, checked through the test's own
//! client; and end to end with a real `nodeplan agent`. Bad arguments and an API server that never
//! answers need no control plane. Timeouts are hang guards.

mod common;
mod k8s_support;

use common::*;
use k8s_support::ControlPlane;
use kube::api::{Api, DynamicObject};
use nodeplan::nodeplan::source::{api_resource, node_label_value};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

macro_rules! control_plane {
    () => {
        match ControlPlane::shared_for_custom_resources().await {
            Some(cp) => cp,
            None => return,
        }
    };
}

/// What one run of the CLI gave.
#[derive(Debug)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    /// Failed with exit `code` and one line on stderr containing `want`, nothing on stdout.
    fn refused(&self, code: i32, want: &str) {
        assert_eq!(self.code, Some(code), "{self:?}");
        assert_eq!(self.stderr.trim_end().lines().count(), 1, "one line: {self:?}");
        assert!(self.stderr.contains(want), "{want:?} not in {self:?}");
        assert_eq!(self.stdout, "", "{self:?}");
    }
}

fn nodeplan_cli(args: &[&str]) -> Out {
    let out = Command::new(NODEPLAN).args(args).env_remove("KUBECONFIG").output().unwrap();
    Out {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn sh(name: &str, script: &str) -> Value {
    json!({"name": name, "command": "sh", "args": ["-c", script], "saveOutput": true})
}

/// One test's namespace, the CLI aimed at it through a kubeconfig file, and the test's own view
/// of the NodePlans there.
struct Producer {
    dir: tempfile::TempDir,
    kubeconfig: String,
    namespace: String,
    api: Api<DynamicObject>,
}

impl Producer {
    async fn new(cp: &ControlPlane, test: &str) -> Producer {
        cp.install_nodeplan_crd().await;
        let namespace = cp.new_namespace(test).await;
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig").to_string_lossy().into_owned();
        std::fs::write(&kubeconfig, cp.kubeconfig_yaml()).unwrap();
        let api = Api::namespaced_with(cp.client().await, &namespace, &api_resource());
        Producer { dir, kubeconfig, namespace, api }
    }

    fn p(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    /// `--nodeplan` for the NodePlan `name` of this test's namespace.
    fn target(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }

    fn plan_file(&self, file: &str, plan: &Value) -> String {
        let path = self.p(file);
        std::fs::write(&path, serde_json::to_vec(plan).unwrap()).unwrap();
        path
    }

    fn cli(&self, args: &[&str]) -> Out {
        let mut all = args.to_vec();
        all.extend(["--kubeconfig", &self.kubeconfig]);
        nodeplan_cli(&all)
    }

    /// Run the CLI, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        out.stdout
    }

    async fn get(&self, name: &str) -> DynamicObject {
        self.api.get(name).await.unwrap()
    }

    async fn spec(&self, name: &str) -> Value {
        self.get(name).await.data["spec"].clone()
    }

    /// `plan status --nodeplan` until its output has the line `line`; that output.
    fn wait_status(&self, name: &str, line: &str) -> String {
        let deadline = Instant::now() + GUARD;
        loop {
            let out = self.ok(&["plan", "status", "--nodeplan", &self.target(name)]);
            if out.lines().any(|l| l == line) {
                return out;
            }
            assert!(Instant::now() < deadline, "status of {name} never showed {line:?}:\n{out}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn label(o: &DynamicObject) -> Option<String> {
    o.metadata.labels.as_ref()?.get("cattle.io/node").cloned()
}

/// The first column of a table's rows (its header dropped).
fn first_column(table: &str) -> Vec<String> {
    table.lines().skip(1).filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

#[tokio::test]
async fn push_creates_then_replaces_the_plan_and_the_switches_flip() {
    let cp = control_plane!();
    let p = Producer::new(cp, "npcli-push").await;
    let target = p.target("web");
    let plan1 = json!({"instructions": [sh("one", "true")], "probes": {"ready": {"fileExists": {"path": "/tmp/x"}}}});
    let file1 = p.plan_file("one.plan", &plan1);

    // Creating needs the node.
    p.cli(&["plan", "push", &file1, "--nodeplan", &target]).refused(2, "give --node NODE to create it");
    assert!(p.api.get_opt("web").await.unwrap().is_none());

    let out = p.ok(&["plan", "push", &file1, "--nodeplan", &target, "--node", "node-a", "--priority", "3"]);
    let o = p.get("web").await;
    assert_eq!(label(&o).as_deref(), Some("node-a"));
    assert_eq!(
        o.data["spec"],
        json!({"plan": plan1, "priority": 3, "nodeName": "node-a"}),
        "the node named in the spec"
    );
    // The id every command shows: the file's (pretty-printed or not), not a checksum of bytes.
    let id = nodeplan::plan::id_of(&std::fs::read(&file1).unwrap()).unwrap();
    assert_eq!(id, nodeplan::plan::id_of(&serde_json::to_vec_pretty(&plan1).unwrap()).unwrap());
    assert_eq!(
        out,
        format!("pushed plan {id} to nodeplan {target}: created for node node-a (cattle.io/node=node-a)\n")
    );
    let status = p.ok(&["plan", "status", "--nodeplan", &target]);
    assert!(status.contains(&format!("plan:       {id} (1 instruction)\n")), "{status}");
    assert!(status.contains("phase:      - (the agent has not written a status yet)"), "{status}");

    for (action, field, value) in [
        ("pause", "paused", true),
        ("resume", "paused", false),
        ("pause", "paused", true),
        ("cancel", "canceled", true),
    ] {
        let out = p.ok(&["plan", action, "--nodeplan", &target]);
        assert!(out.starts_with(action) && out.contains(&format!("spec.{field}={value}")), "{out}");
        assert_eq!(p.spec("web").await[field], json!(value), "{action}");
    }
    let status = p.ok(&["plan", "status", "--nodeplan", &target]);
    assert!(status.contains("control:    paused=true canceled=true\n"), "{status}");

    // Another push replaces the whole plan (the probe the new one lacks is gone), clears the
    // cancel and keeps the rest of the spec.
    let plan2 = json!({"instructions": [sh("two", "true"), sh("three", "true")]});
    let file2 = p.plan_file("two.plan", &plan2);
    let out = p.ok(&["plan", "push", &file2, "--nodeplan", &target, "--node", "node-a"]);
    assert!(out.contains(": replaced spec.plan, cleared spec.canceled\n"), "{out}");
    assert_eq!(
        p.spec("web").await,
        json!({"plan": plan2, "priority": 3, "paused": true, "canceled": false, "nodeName": "node-a"})
    );
    let out = p.ok(&["plan", "push", &file2, "--nodeplan", &target, "--priority", "-1"]);
    assert!(out.ends_with(": replaced spec.plan, spec.priority=-1\n"), "{out}");
    assert_eq!(p.spec("web").await["priority"], json!(-1));

    // A push for another node, an invalid plan and a plan this agent would refuse change nothing.
    let before = p.get("web").await.metadata.resource_version;
    p.cli(&["plan", "push", &file1, "--nodeplan", &target, "--node", "node-b"])
        .refused(2, "is for node node-a, not node node-b: nothing pushed");
    let bad = p.plan_file("bad.plan", &json!({"files": [{"path": "relative"}]}));
    p.cli(&["plan", "push", &bad, "--nodeplan", &target, "--node", "node-a"]).refused(2, "files[0].path");
    let unknown = p.plan_file("unknown.plan", &json!({"instructions": [sh("a", "true")], "hooks": []}));
    p.cli(&["plan", "push", &unknown, "--nodeplan", &target])
        .refused(2, "as a NodePlan: unknown field spec.plan.hooks");
    assert_eq!(p.get("web").await.metadata.resource_version, before);

    // A NodePlan that does not exist is no such plan.
    for action in ["pause", "resume", "cancel", "status"] {
        p.cli(&["plan", action, "--nodeplan", &p.target("nope")])
            .refused(2, &format!("nodeplan {} does not exist", p.target("nope")));
    }
}

#[tokio::test]
async fn a_node_name_longer_than_a_label_is_hashed_into_the_label_and_named_in_the_spec() {
    let cp = control_plane!();
    let p = Producer::new(cp, "npcli-long").await;
    let node = format!("node-{}", "a".repeat(70));
    let other = format!("node-{}", "b".repeat(70));
    let file = p.plan_file("p.plan", &json!({"instructions": [sh("one", "true")]}));
    let target = p.target("long");
    let out = p.ok(&["plan", "push", &file, "--nodeplan", &target, "--node", &node]);
    assert!(out.contains(&format!("(cattle.io/node={})", node_label_value(&node))), "{out}");
    let o = p.get("long").await;
    assert_eq!(label(&o), Some(node_label_value(&node)));
    assert!(label(&o).is_some_and(|l| l.len() <= 63 && l.starts_with("h-")));
    assert_eq!(o.data["spec"]["nodeName"], json!(node));
    p.ok(&["plan", "push", &file, "--nodeplan", &target, "--node", &node]);
    p.cli(&["plan", "push", &file, "--nodeplan", &target, "--node", &other])
        .refused(2, &format!("is for node {node}, not node {other}"));
    let table = p.ok(&["plan", "status", "--node", &node, "--namespace", &p.namespace]);
    assert_eq!(first_column(&table), ["long"], "{table}");
    let table = p.ok(&["plan", "status", "--node", &other, "--namespace", &p.namespace]);
    assert_eq!(table, format!("no NodePlans for node {other} in namespace {}\n", p.namespace));
}

#[tokio::test]
async fn status_node_lists_a_nodes_plans_in_the_order_its_agent_runs_them() {
    let cp = control_plane!();
    let p = Producer::new(cp, "npcli-list").await;
    let file = p.plan_file("p.plan", &json!({"instructions": [sh("one", "true")]}));
    let push = |name: &str, node: &str, priority: &str| {
        p.ok(&["plan", "push", &file, "--nodeplan", &p.target(name), "--node", node, "--priority", priority]);
    };
    push("b-old", "node-a", "0");
    std::thread::sleep(Duration::from_millis(1100)); // creation timestamps have 1 s resolution
    push("a-new", "node-a", "0");
    push("c-new", "node-a", "0");
    push("z-high", "node-a", "5");
    push("elsewhere", "node-b", "9");
    let table = p.ok(&["plan", "status", "--node", "node-a", "--namespace", &p.namespace]);
    let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "PRIORITY", "PHASE", "PROGRESS", "ATTEMPTS", "AGE", "MESSAGE"], "{table}");
    assert_eq!(first_column(&table), ["z-high", "b-old", "a-new", "c-new"], "{table}");
    let row: Vec<&str> = table.lines().nth(1).unwrap_or_default().split_whitespace().collect();
    assert_eq!(&row[..5], ["z-high", "5", "-", "-", "0"], "no status yet: {table}");
    // kubectl's other shapes: wide adds the namespace and the plan id, a List document, names.
    let id = nodeplan::plan::id_of(&std::fs::read(&file).unwrap()).unwrap();
    let ns = p.namespace.as_str();
    let wide = p.ok(&["plan", "status", "--node", "node-a", "--namespace", ns, "-o", "wide"]);
    let words = |n: usize| wide.lines().nth(n).unwrap_or_default().split_whitespace().take(4).collect::<Vec<_>>();
    assert_eq!(words(0), ["NAMESPACE", "NAME", "PLAN", "PRIORITY"], "{wide}");
    assert_eq!(words(1), [ns, "z-high", &id, "5"], "{wide}");
    let list: serde_json::Value =
        serde_json::from_str(&p.ok(&["plan", "status", "--node", "node-a", "--namespace", ns, "-o", "json"])).unwrap();
    assert_eq!(list["kind"], "List");
    let names: Vec<&str> = list["items"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["z-high", "b-old", "a-new", "c-new"], "{list}");
    assert_eq!((&list["items"][0]["plan"], &list["items"][0]["priority"]), (&json!(id), &json!(5)), "{list}");
    let yaml = p.ok(&["plan", "status", "--node", "node-a", "--namespace", ns, "-o", "yaml"]);
    // The same document (the ages may have moved on by a second between the two commands).
    let ageless = |mut v: serde_json::Value| {
        for item in v["items"].as_array_mut().unwrap() {
            item.as_object_mut().unwrap().remove("age");
        }
        v
    };
    assert_eq!(ageless(serde_yaml_ng::from_str::<serde_json::Value>(&yaml).unwrap()), ageless(list.clone()));
    let names = p.ok(&["plan", "status", "--node", "node-a", "--namespace", ns, "-o", "name"]);
    assert_eq!(
        names,
        "nodeplan.agent.cattle.io/z-high\nnodeplan.agent.cattle.io/b-old\nnodeplan.agent.cattle.io/a-new\nnodeplan.agent.cattle.io/c-new\n"
    );
    // One NodePlan: its row, as `--selector --nodeplans` shows it.
    let one: serde_json::Value =
        serde_json::from_str(&p.ok(&["plan", "status", "--nodeplan", &p.target("z-high"), "-o", "json"])).unwrap();
    assert_eq!(
        (&one["kind"], &one["name"], &one["node"], &one["plan"]),
        (&json!("NodePlan"), &json!("z-high"), &json!("node-a"), &json!(id)),
        "{one}"
    );

    // Without --namespace: the kubeconfig context's namespace.
    let kubeconfig = p.p("kubeconfig-ns");
    std::fs::write(
        &kubeconfig,
        cp.kubeconfig_yaml().replace("namespace: default", &format!("namespace: {}", p.namespace)),
    )
    .unwrap();
    let out = nodeplan_cli(&["plan", "status", "--node", "node-a", "--kubeconfig", &kubeconfig]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(first_column(&out.stdout), first_column(&table), "{out:?}");
    // Every namespace: a NAMESPACE column first (other tests' namespaces may have rows too).
    let all = p.ok(&["plan", "status", "--node", "node-a", "-A"]);
    assert!(all.starts_with("NAMESPACE "), "{all}");
    let ours: Vec<&str> = all
        .lines()
        .filter(|l| l.starts_with(&format!("{} ", p.namespace)))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(ours, ["z-high", "b-old", "a-new", "c-new"], "{all}");
}

/// The CLI drives a real agent: a plan it pushes is applied, paused at a boundary, resumed, and
/// `status` shows what the agent recorded; a running plan is canceled; reset runs it again.
#[tokio::test]
async fn a_plan_pushed_with_the_cli_is_applied_by_the_agent_and_status_shows_it() {
    let cp = control_plane!();
    let p = Producer::new(cp, "npcli-e2e").await;
    let n = ClusterNode::new("nodePlanEnabled: true\nnodeName: node-a\n", &cp.kubeconfig_yaml(), &p.namespace);
    let (log, ready, gate) = (n.p("log"), n.fifo("ready"), n.fifo("gate"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {log}; echo > {ready}; read x < {gate}")),
        sh("two", &format!("echo two >> {log}")),
    ]});
    let file = p.plan_file("e2e.plan", &plan);
    let target = p.target("e2e");
    p.ok(&["plan", "push", &file, "--nodeplan", &target, "--node", "node-a"]);
    let mut agent = n.agent();
    read_fifo(&ready);
    p.ok(&["plan", "pause", "--nodeplan", &target]);
    agent.wait_log("pause requested");
    std::fs::write(&gate, b"go\n").unwrap();
    let status = p.wait_status("e2e", "phase:      Paused");
    assert!(status.contains("progress:   1/2 instructions done\n"), "{status}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\n", "two waits for the resume");
    p.ok(&["plan", "resume", "--nodeplan", &target]);
    let status = p.wait_status("e2e", "phase:      Applied");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\n", "one is not run again");
    let recorded = p.get("e2e").await.data["status"]["planChecksum"].as_str().unwrap_or_default().to_string();
    assert_eq!(recorded.len(), 64, "the agent's record");
    for line in [
        format!("plan:       {} (2 instructions)", nodeplan::plan::id_of(&std::fs::read(&file).unwrap()).unwrap()),
        "progress:   2/2 instructions done".into(),
        "control:    paused=false canceled=false".into(),
        "condition:  Applied=True (Applied): plan succeeded".into(),
        "result:     1/2 one: ok (exit 0)".into(),
        "result:     2/2 two: ok (exit 0)".into(),
    ] {
        assert!(status.lines().any(|l| l == line), "{line:?} not in:\n{status}");
    }
    assert!(
        status.lines().any(|l| l.starts_with("attempts:   1 (0 failed in a row, 1 succeeded); last 20")),
        "{status}"
    );
    let table = p.ok(&["plan", "status", "--node", "node-a", "--namespace", &p.namespace]);
    let row: Vec<&str> = table.lines().nth(1).unwrap_or_default().split_whitespace().collect();
    assert_eq!(
        (&row[..5], &row[6..]),
        (&["e2e", "0", "Applied", "2/2", "1"][..], &["plan", "succeeded"][..]),
        "{table}"
    );
    // The same plan again: the agent keeps its run final, and the push says so.
    let out = p.ok(&["plan", "push", &file, "--nodeplan", &target]);
    assert!(out.contains("note: this plan is unchanged and its run is over (phase Applied)"), "{out}");

    // Cancel a running plan.
    let (ready2, pid_file) = (n.fifo("ready2"), n.p("pid"));
    let long = json!({"instructions": [sh("long", &format!("echo $$ > {pid_file}; echo > {ready2}; exec sleep 300")), sh("never", "true")]});
    let file = p.plan_file("long.plan", &long);
    p.ok(&["plan", "push", &file, "--nodeplan", &p.target("long"), "--node", "node-a"]);
    read_fifo(&ready2);
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    p.ok(&["plan", "cancel", "--nodeplan", &p.target("long")]);
    let status = p.wait_status("long", "phase:      Cancelled");
    assert!(!alive(pid), "the canceled instruction still runs");
    assert!(status.contains("control:    paused=false canceled=true\n"), "{status}");
    // Reset runs the same plan again from its first instruction (a new run token).
    p.ok(&["plan", "reset", "--nodeplan", &p.target("long")]);
    read_fifo(&ready2);
    let again: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    assert_ne!(again, pid, "a new run");
    let status = p.wait_status("long", "phase:      Executing");
    assert!(status.contains("control:    paused=false canceled=false\n"), "{status}");
    assert_eq!(agent.stop(), 0);
}

/// Bad arguments are one line and exit 2 before anything is asked (no kubeconfig needed).
#[test]
fn bad_arguments_are_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.plan").to_string_lossy().into_owned();
    std::fs::write(&file, br#"{"instructions": [{"name": "a", "command": "true"}]}"#).unwrap();
    let bad = dir.path().join("bad.plan").to_string_lossy().into_owned();
    std::fs::write(&bad, br#"{"files": [{"path": "relative"}]}"#).unwrap();
    let no_kubeconfig = "/nonexistent/kubeconfig";
    let rows: [(&[&str], &str); 12] = [
        (&["plan", "pause", "--nodeplan", "foo"], "\"foo\": expected NAMESPACE/NAME"),
        (&["plan", "status", "--nodeplan", "Ns/p"], "not a namespace"),
        (&["plan", "status", "--nodeplan", "ns/p?watch=1"], "not a NodePlan name"),
        (&["plan", "pause", "--secret", "a/b", "--nodeplan", "c/d"], "cannot be used with"),
        (&["plan", "push", &file, "--secret", "a/b", "--nodeplan", "c/d"], "cannot be used with"),
        (&["plan", "cancel", &file, "--nodeplan", "ns/p"], "give one of a PLANFILE, --secret"),
        (&["plan", "status", "--node", "n", "--nodeplan", "ns/p"], "cannot be used with"),
        (&["plan", "status", "--namespace", "ns"], "--node"),
        (&["plan", "status", "--node", "n", "-A", "--namespace", "ns"], "cannot be used with"),
        (&["plan", "push", &file, "--node", "n"], "--nodeplan"),
        (&["plan", "push", &file, "--nodeplan", "ns/p", "--node", "a b"], "not a node name"),
        (&["plan", "push", &bad, "--nodeplan", "ns/p", "--node", "n", "--kubeconfig", no_kubeconfig], "files[0].path"),
    ];
    for (args, want) in rows {
        nodeplan_cli(args).refused(2, want);
    }
}

/// An API server that accepts connections and never answers: every command gives up after
/// `--request-timeout` with one line and exit 1 (kube has no read timeout of its own).
#[test]
fn an_api_server_that_never_answers_is_one_line_and_exit_1_within_the_timeout() {
    use base64::Engine as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().flatten() {
            held.push(c);
        }
    });
    let ca = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap().cert.pem();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig").to_string_lossy().into_owned();
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{port}\n    \
             certificate-authority-data: {}\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    \
             cluster: c\n    user: u\ncurrent-context: x\n",
            base64::engine::general_purpose::STANDARD.encode(ca)
        ),
    )
    .unwrap();
    let file = dir.path().join("p.plan").to_string_lossy().into_owned();
    std::fs::write(&file, br#"{"instructions": [{"name": "a", "command": "true"}]}"#).unwrap();
    let rows: [&[&str]; 6] = [
        &["plan", "push", &file, "--nodeplan", "ns/p", "--node", "n"],
        &["plan", "pause", "--nodeplan", "ns/p"],
        &["plan", "status", "--nodeplan", "ns/p"],
        &["plan", "status", "--node", "n"],
        &["plan", "cancel", "--secret", "ns/s"],
        &["plan", "push", &file, "--secret", "ns/s"],
    ];
    for args in rows {
        let mut all = args.to_vec();
        all.extend(["--kubeconfig", &kubeconfig, "--request-timeout", "1s"]);
        let t0 = Instant::now();
        let out = nodeplan_cli(&all);
        assert!(t0.elapsed() < Duration::from_secs(10), "{args:?} took {:?}", t0.elapsed());
        out.refused(
            1,
            &format!("no answer from the API server at https://127.0.0.1:{port} within 1s (--request-timeout)"),
        );
    }
    // Nothing listens there any more: the one line names the server it could not reach.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = closed.local_addr().unwrap().port();
    drop(closed);
    std::fs::write(
        &kubeconfig,
        std::fs::read_to_string(&kubeconfig).unwrap().replace(&format!(":{port}\n"), &format!(":{gone}\n")),
    )
    .unwrap();
    for args in [
        &["plan", "status", "--nodeplan", "ns/p"][..],
        &["plan", "status", "--secret", "ns/s"],
        &["plan", "status", "-l", "a=b"],
        &["rollout", "status", "-l", "a=b"],
    ] {
        let mut all = args.to_vec();
        all.extend(["--kubeconfig", &kubeconfig]);
        nodeplan_cli(&all).refused(1, &format!("cannot reach the API server at https://127.0.0.1:{gone}: "));
    }
}

/// `push --dry-run` compares the plan file with what the NodePlan holds and writes nothing: exit
/// 6 with the changes by path and name, 0 when it holds the plan already.
#[tokio::test]
async fn a_push_dry_run_shows_the_changes_and_writes_nothing() {
    let cp = control_plane!();
    let p = Producer::new(cp, "npcli-dry").await;
    let target = p.target("web");
    let plan1 = json!({"files": [{"path": "/etc/a", "content": "eA=="}], "instructions": [sh("one", "true")]});
    let file1 = p.plan_file("one.plan", &plan1);
    let out = p.cli(&["plan", "push", &file1, "--nodeplan", &target, "--node", "node-a", "--dry-run"]);
    assert_eq!(out.code, Some(6), "{out:?}");
    assert!(out.stdout.contains("new plan ") && out.stdout.contains("  + /etc/a"), "{out:?}");
    assert!(p.api.get_opt("web").await.unwrap().is_none(), "a dry run created the NodePlan");
    // Written by hand (spacing, key order): the same plan, with the id every command shows.
    let pretty = p.p("pretty.plan");
    std::fs::write(
        &pretty,
        "{\n  \"instructions\": [ {\"saveOutput\": true, \"command\": \"sh\", \"name\": \"one\", \"args\": [\"-c\", \"true\"]} ],\n  \"files\": [ {\"content\": \"eA==\", \"path\": \"/etc/a\"} ]\n}\n",
    )
    .unwrap();
    let pushed = p.ok(&["plan", "push", &pretty, "--nodeplan", &target, "--node", "node-a"]);
    let id = pushed.split_whitespace().nth(2).unwrap().to_string();
    assert_eq!(id.len(), 12, "{pushed}");
    let before = p.get("web").await.metadata.resource_version;
    for file in [&file1, &pretty] {
        let out = p.cli(&["plan", "push", file, "--nodeplan", &target, "--dry-run"]);
        assert_eq!(out.code, Some(0), "{out:?}");
        assert!(out.stdout.contains(&format!("holds plan {id} already")), "{out:?}");
    }
    assert_eq!(p.get("web").await.metadata.resource_version, before, "a dry run wrote");
    let status = p.ok(&["plan", "status", "--nodeplan", &target]);
    assert!(status.contains(&format!("plan:       {id} ")), "{status}");
    p.ok(&["plan", "reset", "--nodeplan", &target]);
    let status = p.ok(&["plan", "status", "--nodeplan", &target]);
    assert!(status.contains(&format!("plan:       {id} ")), "a reset runs the same plan: {status}");
    let before = p.get("web").await.metadata.resource_version;
    let plan2 = json!({"instructions": [sh("one", "true"), {"name": "two", "command": "x", "env": ["T=hidden"]}]});
    let file2 = p.plan_file("two.plan", &plan2);
    let out = p.cli(&["plan", "push", &file2, "--nodeplan", &target, "--dry-run"]);
    assert_eq!(out.code, Some(6), "{out:?}");
    for want in ["  - /etc/a", "  + two", "env T=(masked)"] {
        assert!(out.stdout.contains(want), "no {want:?} in {out:?}");
    }
    assert!(!out.stdout.contains("hidden"), "{out:?}");
    assert_eq!(p.get("web").await.metadata.resource_version, before, "a dry run wrote");
    // The same for a node's plan Secret: compared, never created.
    let secret = format!("{}/machine-plan", p.namespace);
    let out = p.cli(&["plan", "push", &file1, "--secret", &secret, "--dry-run"]);
    assert_eq!(out.code, Some(6), "{out:?}");
    assert!(out.stdout.contains("new plan ") && out.stdout.contains("  + /etc/a"), "{out:?}");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(cp.client().await, &p.namespace);
    assert!(secrets.get_opt("machine-plan").await.unwrap().is_none(), "a dry run created the Secret");
    p.ok(&["plan", "push", &file1, "--secret", &secret]);
    let out = p.cli(&["plan", "push", &file1, "--secret", &secret, "--dry-run"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains(&format!("holds plan {id} already")), "{out:?}");
    // The Secret's agent compares bytes (system-agent's checksum): the same plan written
    // differently runs again, and the dry run says so.
    let out = p.cli(&["plan", "push", &pretty, "--secret", &secret, "--dry-run"]);
    assert_eq!(out.code, Some(6), "{out:?}");
    assert!(out.stdout.contains(&format!("plan {id}: the same plan, written differently")), "{out:?}");
    let status = p.ok(&["plan", "status", "--secret", &secret]);
    assert!(status.contains(&format!("plan:       {id} ")), "{status}");
    let out = p.cli(&["plan", "push", &file2, "--secret", &secret, "--dry-run"]);
    assert!(out.code == Some(6) && out.stdout.contains("  + two"), "{out:?}");
}
