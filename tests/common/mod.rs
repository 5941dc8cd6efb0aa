//! Shared test support: the helper program, line handshakes, survivor scans, loud skips.
#![allow(dead_code)]

use nodeplan::process::{LineSink, MARKER_ENV, SpawnSpec, Stream, Supervisor};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

pub const HELPER: &str = env!("CARGO_BIN_EXE_nodeplan-test-helper");
pub const NODEPLAN: &str = env!("CARGO_BIN_EXE_nodeplan");

/// The lines `out` (a child's stdout or stderr) produces, read on a thread of their own: a test
/// waits on them with a timeout and never blocks on the pipe itself.
pub fn lines_of(out: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    rx
}

/// The lines of `rx`, each also appended to `file` (`NODEPLAN_TEST_AGENT_LOGS=<dir>` keeps every
/// agent's log there, one file per pid: for a failure that shows only under load).
fn copied(rx: std::sync::mpsc::Receiver<String>, file: std::path::PathBuf) -> std::sync::mpsc::Receiver<String> {
    use std::io::Write;
    let (tx, out) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut f = std::fs::File::create(&file).ok();
        for l in rx {
            if let Some(f) = f.as_mut() {
                let _ = writeln!(f, "{l}");
            }
            let _ = tx.send(l);
        }
    });
    out
}

/// `GET /metrics` from an agent's `metricsAddress` on loopback `port`: the whole answer.
pub fn scrape_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Hang guard for awaits that must finish: a failure message instead of a stuck test.
pub const GUARD: Duration = Duration::from_secs(30);

/// True when running under `.ci/run`: skips become failures there.
pub fn in_ci() -> bool {
    std::env::var_os("NODEPLAN_CI").is_some()
}

/// Skip loudly when a requirement is missing outside CI; fail in CI.
pub fn require(ok: bool, what: &str) -> bool {
    if ok {
        return true;
    }
    if in_ci() {
        panic!("required in CI but missing: {what}");
    }
    eprintln!("\n*** SKIPPED: {what} is not available on this machine ***\n");
    false
}

pub fn require_cgroup(sup: &Supervisor) -> bool {
    require(sup.cgroup_root().is_some(), "a writable cgroup v2 hierarchy")
}

/// A sink that forwards every line to a channel.
pub struct ChanSink(pub mpsc::UnboundedSender<(Stream, String)>);

impl LineSink for ChanSink {
    fn line(&self, stream: Stream, line: &[u8]) {
        let _ = self.0.send((stream, String::from_utf8_lossy(line).into_owned()));
    }
}

/// The receiving end of a [`ChanSink`], keeping lines it has not been asked for yet.
/// Pids announced by the helper (`ready N`, `child N`, `grandchild N`) are SIGKILLed when this is
/// dropped, if they are still ours, so a failing test leaves nothing behind.
pub struct Lines {
    rx: mpsc::UnboundedReceiver<(Stream, String)>,
    backlog: Vec<String>,
    pids: Vec<i32>,
}

impl Lines {
    fn note(&mut self, line: &str) {
        if let Some(pid) = line.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            self.pids.push(pid);
        }
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        for pid in &self.pids {
            let ours = std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|e| e.split(|b| *b == 0).any(|x| x.starts_with(format!("{MARKER_ENV}=").as_bytes())));
            if ours && alive(*pid) {
                kill_all(&[*pid]);
            }
        }
    }
}

pub fn chan_sink() -> (Arc<ChanSink>, Lines) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Arc::new(ChanSink(tx)), Lines { rx, backlog: Vec::new(), pids: Vec::new() })
}

pub fn helper(args: &[&str], sink: Arc<dyn LineSink>) -> SpawnSpec {
    let mut spec = SpawnSpec::new(HELPER, args.iter().copied());
    spec.sink = sink;
    spec.owner = nodeplan::process::Owner::supervise("test");
    spec
}

/// Wait for a line starting with `prefix` (lines seen earlier included, each used once); returns
/// the rest of it.
pub async fn wait_line(lines: &mut Lines, prefix: &str) -> String {
    if let Some(i) = lines.backlog.iter().position(|l| l.starts_with(prefix)) {
        return lines.backlog.remove(i)[prefix.len()..].trim().to_string();
    }
    let fut = async {
        while let Some((_, l)) = lines.rx.recv().await {
            lines.note(&l);
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
            lines.backlog.push(l);
        }
        panic!("output ended before a line starting with {prefix:?}");
    };
    tokio::time::timeout(GUARD, fut).await.unwrap_or_else(|_| panic!("no line starting with {prefix:?}"))
}

/// Live (non-zombie) processes with an environment entry for which `wanted` holds.
fn live_with_env(wanted: impl Fn(&[u8]) -> bool) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        if !alive(pid) {
            continue;
        }
        if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ"))
            && env.split(|b| *b == 0).any(&wanted)
        {
            out.push(pid);
        }
    }
    out
}

/// Live (non-zombie) processes whose environment carries `NODEPLAN_RUN=<marker>`.
pub fn survivors(marker: &str) -> Vec<i32> {
    let entry = format!("{MARKER_ENV}={marker}").into_bytes();
    live_with_env(|x| x == entry)
}

/// Live processes started by the agent with this pid (their run markers start with `np<pid>.`).
pub fn started_by(agent_pid: u32) -> Vec<i32> {
    let prefix = format!("{MARKER_ENV}=np{agent_pid}.").into_bytes();
    live_with_env(|x| x.starts_with(&prefix))
}

/// The start of an instruction script that notes `tag` in OVERLAP when the previous copy (its pid
/// in PIDFILE) is still alive (a zombie is dead: it cannot run anything), then records its own pid.
pub fn overlap_check(pidfile: &str, overlap: &str, tag: &str) -> String {
    format!(
        "old=$(cat {pidfile} 2>/dev/null); if [ -n \"$old\" ] && [ -e /proc/$old ] && ! grep -q ') Z' /proc/$old/stat; \
         then echo {tag} >> {overlap}; fi; echo $$ > {pidfile}"
    )
}

/// The process exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            s.rfind(')').and_then(|i| s[i + 1..].split_whitespace().next()).is_some_and(|st| st != "Z" && st != "X")
        }
        Err(_) => false,
    }
}

/// SIGKILL leftovers a failing test may have left, so they do not pile up.
pub fn kill_all(pids: &[i32]) {
    for p in pids {
        unsafe {
            libc::kill(*p, libc::SIGKILL);
        }
    }
}

/// A running `nodeplan agent` whose stderr is read line by line.
/// The agent's environment for a test that reads instruction output from its log: output lines
/// are logged at debug only, and this turns on just them (the rest stays at info).
pub const OUTPUT_LOGGED: (&str, &str) = ("NODEPLAN_LOG", "info,nodeplan::process::capture=debug");

pub struct AgentProc {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every line read so far (for failure messages and counting).
    pub seen: Vec<String>,
    /// Lines read but not matched by a `wait_log` yet.
    backlog: Vec<String>,
    /// Set by [`AgentProc::crash`]: leave what it started for the next agent to find.
    crashed: bool,
}

impl AgentProc {
    pub fn start(config: &std::path::Path) -> AgentProc {
        AgentProc::start_with(config, &[])
    }

    pub fn start_with(config: &std::path::Path, env: &[(&str, &str)]) -> AgentProc {
        AgentProc::start_program(std::path::Path::new(NODEPLAN), config, env)
    }

    /// The agent started as `program` (a copy of the binary, which a plan may replace).
    pub fn start_program(program: &std::path::Path, config: &std::path::Path, env: &[(&str, &str)]) -> AgentProc {
        AgentProc::spawn(std::process::Command::new(program), config, env)
    }

    /// The agent started through `wrapper` (a program and its arguments, the binary's path
    /// appended: `unshare --pid …`).
    pub fn start_wrapped(wrapper: &[&str], config: &std::path::Path) -> AgentProc {
        let mut command = std::process::Command::new(wrapper[0]);
        command.args(&wrapper[1..]).arg(NODEPLAN);
        AgentProc::spawn(command, config, &[])
    }

    /// `command` (the binary, or a wrapper whose last arguments name it) with `agent --config
    /// config` appended (`config` as that program names it: a Windows path for one under Wine).
    pub fn spawn(mut command: std::process::Command, config: &std::path::Path, env: &[(&str, &str)]) -> AgentProc {
        let mut child = command
            .args(["agent", "--config"])
            .arg(config)
            .env("NODEPLAN_LOG", "info")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut rx = lines_of(child.stderr.take().unwrap());
        if let Some(dir) = std::env::var_os("NODEPLAN_TEST_AGENT_LOGS") {
            rx = copied(rx, std::path::Path::new(&dir).join(format!("{}.log", child.id())));
        }
        AgentProc { child, lines: rx, seen: Vec::new(), backlog: Vec::new(), crashed: false }
    }

    /// Wait for a log line containing `needle` (lines already read included, each matched once).
    pub fn wait_log(&mut self, needle: &str) -> String {
        if let Some(i) = self.backlog.iter().position(|l| l.contains(needle)) {
            return self.backlog.remove(i);
        }
        loop {
            let l = self
                .lines
                .recv_timeout(GUARD)
                .unwrap_or_else(|_| panic!("agent never logged {needle:?}; saw:\n{}", self.seen.join("\n")));
            self.seen.push(l.clone());
            if l.contains(needle) {
                return l;
            }
            self.backlog.push(l);
        }
    }

    /// The next log line in order (lines already read but not matched first).
    pub fn next_line(&mut self) -> String {
        if !self.backlog.is_empty() {
            return self.backlog.remove(0);
        }
        let l = self
            .lines
            .recv_timeout(GUARD)
            .unwrap_or_else(|_| panic!("the agent logged nothing more; saw:\n{}", self.seen.join("\n")));
        self.seen.push(l.clone());
        l
    }

    pub fn signal(&self, sig: i32) {
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// SIGKILL the agent like a crash: what it started keeps running (for the next agent).
    pub fn crash(mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        self.crashed = true;
    }

    /// The lines logged so far that were not read yet.
    pub fn drain(&mut self) -> Vec<String> {
        let new: Vec<String> = self.lines.try_iter().collect();
        self.seen.extend(new.iter().cloned());
        self.backlog.extend(new.iter().cloned());
        new
    }

    /// Every line not read yet, up to the end of the agent's stderr (after it exited).
    pub fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(GUARD) {
            out.push(l);
        }
        self.seen.extend(out.iter().cloned());
        out
    }

    /// SIGTERM and wait; the exit code.
    pub fn stop(&mut self) -> i32 {
        self.signal(libc::SIGTERM);
        self.child.wait().unwrap().code().unwrap_or(-1)
    }

    /// [`AgentProc::stop`], which must exit 0; otherwise what the agent logged last says why.
    pub fn stop_cleanly(&mut self) {
        let code = self.stop();
        assert_eq!(code, 0, "the agent's last lines:\n{}", self.rest().join("\n"));
    }
}

impl Drop for AgentProc {
    /// SIGKILL the agent and, so that a failing test leaves nothing behind, every process it
    /// started (their run markers start with `np<agent pid>-`).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.crashed {
            kill_all(&started_by(self.child.id()));
        }
    }
}

/// Read a FIFO an instruction writes to (it blocks until we read), with a hang guard.
pub fn read_fifo(path: &str) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_string();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read_to_string(p).unwrap_or_default());
    });
    rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("nobody wrote {path}"))
}

/// Open a FIFO for writing (the instruction blocks reading it until then), with a hang guard.
pub fn release_fifo(path: &str) {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_string();
    std::thread::spawn(move || {
        use std::io::Write;
        let _ = std::fs::OpenOptions::new().write(true).open(p).and_then(|mut f| f.write_all(b"go"));
        let _ = tx.send(());
    });
    rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("nobody read {path}"))
}

pub fn mkfifo(path: &str) {
    let c = std::ffi::CString::new(path).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {path}");
}

/// A tiny HTTP server answering every request with the current status code.
pub fn http_server(status: std::sync::Arc<std::sync::atomic::AtomicU16>) -> u16 {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            let code = status.load(std::sync::atomic::Ordering::SeqCst);
            let _ = write!(c, "HTTP/1.1 {code} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    port
}

/// A node's files for an agent that talks to a cluster: a connection-info file (`kubeconfig`,
/// `namespace`, Secret name `machine-plan`) and a config (`mode`, e.g. `remoteEnabled: true`, plus
/// every directory under one temporary directory), both mode 0600.
/// A local-mode agent's config under `dir` (its `plans` directory made, the file 0600), with
/// `extra` lines appended; returns the config's path.
pub fn write_local_config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.join("plans")).unwrap();
    let cfg = format!(
        "localEnabled: true\nlocalPlanDirectory: {d}/plans\nworkDirectory: {d}/work\nappliedPlanDirectory: {d}/applied\n\
         interlockDirectory: {d}/interlock\npidDirectory: {d}/pids\nstopTimeout: 1s\nkillTimeout: 5s\n\
         rescanSeconds: 1\nprobePeriodSeconds: 1\nlocalRetrySeconds: 1\n{extra}",
        d = dir.display()
    );
    let path = dir.join("config.yaml");
    std::fs::write(&path, cfg).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

pub struct ClusterNode {
    pub dir: tempfile::TempDir,
    pub config: std::path::PathBuf,
}

impl ClusterNode {
    pub fn new(mode: &str, kubeconfig: &str, namespace: &str) -> ClusterNode {
        ClusterNode::for_secret(mode, kubeconfig, namespace, "machine-plan")
    }

    /// A node whose plan Secret is `secret` (several nodes in one namespace).
    pub fn for_secret(mode: &str, kubeconfig: &str, namespace: &str, secret: &str) -> ClusterNode {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let conn = dir.path().join("conn.json");
        let conn_json = serde_json::json!({"kubeConfig": kubeconfig, "namespace": namespace, "secretName": secret});
        std::fs::write(&conn, serde_json::to_vec(&conn_json).unwrap()).unwrap();
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "{mode}connectionInfoFile: {d}/conn.json\nworkDirectory: {d}/work\nappliedPlanDirectory: {d}/applied\n\
                 interlockDirectory: {d}/interlock\npidDirectory: {d}/pids\nnodePlanStateDirectory: {d}/nodeplans\n\
                 stopTimeout: 1s\nkillTimeout: 5s\n"
            ),
        )
        .unwrap();
        for f in [&conn, &config] {
            std::fs::set_permissions(f, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        }
        ClusterNode { dir, config }
    }

    pub fn p(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    pub fn fifo(&self, name: &str) -> String {
        let p = self.p(name);
        mkfifo(&p);
        p
    }

    pub fn agent(&self) -> AgentProc {
        AgentProc::start(&self.config)
    }

    /// Move the node's state directories (work, applied plans, interlock, NodePlan runs) onto
    /// `disk`; the pid directory stays (a tmpfs on a node).
    pub fn state_on(&self, disk: &StateDisk) {
        let (d, m) = (self.dir.path().display().to_string(), disk.mnt.display().to_string());
        let config = std::fs::read_to_string(&self.config).unwrap();
        let config = ["work", "applied", "interlock", "nodeplans"]
            .iter()
            .fold(config, |c, dir| c.replace(&format!("{d}/{dir}\n"), &format!("{m}/{dir}\n")));
        assert_eq!(config.matches(&m).count(), 4, "{config}");
        std::fs::write(&self.config, config).unwrap();
    }
}

/// Poll until `path` exists (an instruction's "I run" marker); a hang guard, not a sleep.
pub fn wait_for_file(path: &str) {
    let deadline = std::time::Instant::now() + GUARD;
    while !std::path::Path::new(path).exists() {
        assert!(std::time::Instant::now() < deadline, "{path} never appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `retrying in 4.2s` at the end of a "cannot write the outcome" line.
pub fn retrying_in(line: &str) -> Option<Duration> {
    if !line.contains("cannot write the outcome") {
        return None;
    }
    let d = line.rsplit("retrying in ").next()?.trim();
    match d.strip_suffix("ms") {
        Some(ms) => ms.parse().ok().map(Duration::from_millis),
        None => d.strip_suffix('s')?.parse().ok().map(Duration::from_secs_f64),
    }
}

/// The next "cannot write the outcome" line: when it was read, and the back-off it announces.
pub fn next_failure(agent: &mut AgentProc) -> (std::time::Instant, Duration) {
    loop {
        let l = agent.next_line();
        if let Some(d) = retrying_in(&l) {
            return (std::time::Instant::now(), d);
        }
    }
}

/// The exit code of `child`, which must end within the hang guard.
pub fn exit_code(child: &mut std::process::Child, what: &str) -> Option<i32> {
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code();
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} never ended");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// R23's upgrade instruction: note `upgrade` in `runs`, replace `program` by a wrapper that runs
/// the shell line `on_start` and then the real binary, and ask for a restart.
pub fn upgrade_script(program: &str, runs: &str, on_start: &str) -> String {
    format!(
        "echo upgrade >> {runs}; cp {program} {program}.real; \
         printf '#!/bin/sh\n{on_start}\nexec {program}.real \"$@\"\n' > {program}.new; \
         chmod 755 {program}.new; mv {program}.new {program}; touch \"$NODEPLAN_RESTART_REQUEST\""
    )
}

/// A local-mode node in a temporary directory: its config (`write_local_config` with the lines
/// `extra` gives for the directory), its plan directory, and what tests read there.
pub struct LocalNode {
    pub dir: tempfile::TempDir,
}

impl LocalNode {
    pub fn new(extra: impl FnOnce(&std::path::Path) -> String) -> LocalNode {
        let n = LocalNode { dir: tempfile::tempdir().unwrap() };
        write_local_config(n.dir.path(), &extra(n.dir.path()));
        n
    }
    pub fn p(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }
    pub fn config(&self) -> std::path::PathBuf {
        self.dir.path().join("config.yaml")
    }
    pub fn plan_path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join("plans").join(format!("{name}.plan"))
    }
    /// Write the plan `name`; its bytes.
    pub fn plan(&self, name: &str, json: serde_json::Value) -> Vec<u8> {
        let raw = serde_json::to_vec(&json).unwrap();
        std::fs::write(self.plan_path(name), &raw).unwrap();
        raw
    }
    pub fn fifo(&self, name: &str) -> String {
        let p = self.p(name);
        mkfifo(&p);
        p
    }
    pub fn pos(&self, name: &str) -> nodeplan::local::pos::Pos {
        nodeplan::local::pos::read_pos(&self.dir.path().join("plans").join(format!("{name}.pos"))).unwrap()
    }
    /// Poll the observable outcome (the .pos file) until `pred` holds; a hang guard, not a sleep.
    pub fn wait_pos(
        &self,
        name: &str,
        what: &str,
        pred: impl Fn(&nodeplan::local::pos::Pos) -> bool,
    ) -> nodeplan::local::pos::Pos {
        let deadline = std::time::Instant::now() + GUARD;
        loop {
            let p = self.pos(name);
            if pred(&p) {
                return p;
            }
            assert!(std::time::Instant::now() < deadline, "{name}.pos never got {what}: {p:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A TCP relay on loopback to `127.0.0.1:target` that the test can break the ways networks break,
/// while the server behind it (and the test's own client, which does not go through it) go on.
/// It runs on a thread and runtime of its own, so the test's blocking handshakes never hold it up.
/// - [`Relay::cut`]: every connection through it is closed, new ones are closed at once (a FIN:
///   the peer knows at once); [`Relay::heal`] carries new connections again.
/// - [`Relay::reset`]: the same with an RST instead of a FIN (`SO_LINGER` 0), as a firewall or a
///   peer that lost the connection's state answers; [`Relay::heal`] ends it.
/// - [`Relay::silence`]: packets stop, without a FIN or an RST, as at a NAT timeout or a load
///   balancer's failover: the open connections stop moving bytes for good (their sockets are
///   kept open and never read again), and new connections are accepted and then never carried;
///   [`Relay::heal`] carries new connections again, and the connections opened before stay dead.
/// - [`Relay::slow`]: bytes trickle, one every [`TRICKLE`] each way, on every open connection and
///   every new one (a path that degraded: a lossy link, a congested tunnel); nothing is lost or
///   closed. [`Relay::heal`] carries new connections at full speed again; the ones that were slow
///   stay slow.
///
/// [`Relay::start_proxy`] makes it an HTTP proxy instead (each connection begins with a `CONNECT`,
/// answered 200), for a client that reaches the API server through one.
pub struct Relay {
    pub port: u16,
    state: std::sync::Arc<RelayState>,
}

/// How fast a slow connection moves bytes: one each way every so often (20 bytes a second).
pub const TRICKLE: Duration = Duration::from_millis(50);

/// What befalls the connections open when it happens (and, until the relay is healed,
/// every new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Closed with a FIN.
    Cut,
    /// Closed with an RST.
    Reset,
    /// Never moves a byte again, never closed.
    Silence,
    /// Moves a byte each way every [`TRICKLE`], for good.
    Slow,
}

/// Which fault befell the open connections last, numbered.
type Hits = tokio::sync::watch::Sender<(u64, Option<Fault>)>;

struct RelayState {
    /// The fault new connections meet (`None`: carried at full speed).
    now: std::sync::Mutex<Option<Fault>>,
    /// Connections carried so far (CONNECTs answered, for a proxy).
    carried: std::sync::atomic::AtomicUsize,
    /// Moves at every fault: what befalls the connections open then.
    hit: Hits,
}

impl Relay {
    pub fn start(target: u16) -> Relay {
        Relay::start_as(target, false)
    }

    /// An HTTP proxy (`CONNECT` only) that relays to `127.0.0.1:target` whatever host is asked.
    pub fn start_proxy(target: u16) -> Relay {
        Relay::start_as(target, true)
    }

    fn start_as(target: u16, proxy: bool) -> Relay {
        use std::sync::atomic::Ordering::SeqCst;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new(RelayState {
            now: std::sync::Mutex::new(None),
            carried: Default::default(),
            hit: tokio::sync::watch::channel((0u64, None)).0,
        });
        let st = state.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let mut parked = Vec::new();
                while let Ok((inbound, _)) = listener.accept().await {
                    let fault = *st.now.lock().unwrap();
                    match fault {
                        Some(Fault::Cut) => continue, // closed: the peer sees the connection end
                        Some(Fault::Reset) => {
                            let _ = inbound.set_zero_linger(); // closed with an RST
                            continue;
                        }
                        Some(Fault::Silence) => {
                            parked.push(inbound); // open, never read, never closed
                            continue;
                        }
                        Some(Fault::Slow) | None => {}
                    }
                    let mut moved = st.hit.subscribe();
                    moved.mark_unchanged();
                    let st = st.clone();
                    tokio::spawn(async move {
                        let mut inbound = inbound;
                        if proxy && !connect_request(&mut inbound).await {
                            return;
                        }
                        st.carried.fetch_add(1, SeqCst);
                        let Ok(out) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else { return };
                        carry(inbound, out, fault == Some(Fault::Slow), moved).await;
                    });
                }
            });
        });
        Relay { port, state }
    }

    fn befall(&self, fault: Option<Fault>) {
        *self.state.now.lock().unwrap() = fault;
        if let Some(f) = fault {
            self.state.hit.send_modify(|(n, what)| {
                *n += 1;
                *what = Some(f);
            });
        }
    }

    /// Close every connection through the relay and close new ones.
    pub fn cut(&self) {
        self.befall(Some(Fault::Cut));
    }

    /// Reset every connection through the relay and reset new ones.
    pub fn reset(&self) {
        self.befall(Some(Fault::Reset));
    }

    /// Stop moving bytes on every connection, without closing any (see [`Relay`]).
    pub fn silence(&self) {
        self.befall(Some(Fault::Silence));
    }

    /// Move bytes at a trickle on every connection, and on new ones (see [`Relay`]).
    pub fn slow(&self) {
        self.befall(Some(Fault::Slow));
    }

    /// Carry new connections at full speed again (after [`Relay::cut`] and [`Relay::reset`] as
    /// well); the ones silenced or slowed stay so.
    pub fn heal(&self) {
        self.befall(None);
    }

    /// How many connections the relay has carried (a proxy: `CONNECT`s answered).
    pub fn carried(&self) -> usize {
        self.state.carried.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `kubeconfig` with its server `server` replaced by this relay.
    pub fn kubeconfig(&self, kubeconfig: &str, server: &str) -> String {
        kubeconfig.replace(server, &format!("https://127.0.0.1:{}", self.port))
    }

    /// `kubeconfig` (whose cluster's `server:` line is indented four spaces) reaching its server
    /// through this relay as its `proxy-url`.
    pub fn proxied_kubeconfig(&self, kubeconfig: &str, server: &str) -> String {
        let line = format!("    server: {server}\n");
        assert!(kubeconfig.contains(&line), "no server line in {kubeconfig}");
        kubeconfig.replace(&line, &format!("{line}    proxy-url: http://127.0.0.1:{}\n", self.port))
    }
}

/// Carry one connection both ways (at a trickle once `slow`) until either side ends it or a fault
/// befalls it.
async fn carry(
    mut inbound: tokio::net::TcpStream,
    mut out: tokio::net::TcpStream,
    slow: bool,
    mut moved: tokio::sync::watch::Receiver<(u64, Option<Fault>)>,
) {
    let slow = tokio::sync::watch::channel(slow).0;
    let fault = {
        let (ri, wi) = inbound.split();
        let (ro, wo) = out.split();
        let (up, down) = (pump(ri, wo, slow.subscribe()), pump(ro, wi, slow.subscribe()));
        let (mut up, mut down) = (std::pin::pin!(up), std::pin::pin!(down));
        let (mut up_done, mut down_done) = (false, false);
        loop {
            tokio::select! {
                () = &mut up, if !up_done => up_done = true,
                () = &mut down, if !down_done => down_done = true,
                r = moved.changed() => match r.ok().and_then(|_| moved.borrow().1) {
                    Some(Fault::Slow) => {
                        slow.send_replace(true);
                        continue;
                    }
                    other => break other,
                },
            }
            if up_done && down_done {
                return;
            }
        }
    };
    match fault {
        Some(Fault::Silence) => std::future::pending::<()>().await, // both sockets open, moving nothing
        Some(Fault::Reset) => {
            let _ = inbound.set_zero_linger();
        }
        _ => {}
    }
}

/// Copy `from` to `to` until `from` ends (then end `to`'s writing side), a byte at a time with a
/// [`TRICKLE`] after each while `slow` says so. Nothing read is lost when `slow` changes.
async fn pump<R, W>(mut from: R, mut to: W, slow: tokio::sync::watch::Receiver<bool>)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        let mut sent = 0;
        while sent < n {
            let step = if *slow.borrow() { 1 } else { n - sent };
            if to.write_all(&buf[sent..sent + step]).await.is_err() {
                return;
            }
            sent += step;
            if *slow.borrow() {
                tokio::time::sleep(TRICKLE).await;
            }
        }
    }
}

/// A fault the partition tests put on a [`Relay`] for a while, and how it ends.
#[allow(dead_code)]
#[derive(Clone, Copy, Debug)]
pub enum Hole {
    /// [`Relay::silence`], ended by [`Relay::heal`].
    Silence,
    /// [`Relay::slow`], ended by [`Relay::heal`].
    Slow,
    /// [`Relay::reset`], ended by [`Relay::heal`].
    Reset,
}

#[allow(dead_code)]
impl Hole {
    pub fn open(self, relay: &Relay) {
        match self {
            Hole::Silence => relay.silence(),
            Hole::Slow => relay.slow(),
            Hole::Reset => relay.reset(),
        }
    }

    pub fn close(self, relay: &Relay) {
        relay.heal();
    }
}

/// Read an HTTP `CONNECT` request's head from `conn` and answer 200; `false` for anything else.
async fn connect_request(conn: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > 8192 || !matches!(conn.read(&mut byte).await, Ok(1)) {
            return false;
        }
        head.push(byte[0]);
    }
    head.starts_with(b"CONNECT ") && conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.is_ok()
}

/// `nodeplan status --config CONFIG`, again until its table says what `pred` wants (the agent
/// writes its record within a moment of each change; a hang guard, not a sleep). The table.
#[allow(dead_code)]
pub fn agent_status_until(config: &std::path::Path, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        let out = std::process::Command::new(NODEPLAN).args(["status", "--config"]).arg(config).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && pred(&text) {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nodeplan status never showed {what}: {:?} {text} {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A filesystem of its own for an agent's state directories, which a test freezes the way a
/// snapshot tool (`fsfreeze`) or a hung disk stops answering: a 16 MiB ext4 image on a loop
/// device, mounted in a private mount namespace that only the agent started with
/// [`StateDisk::agent`] sees. The namespace is held by a holder process that thaws the filesystem
/// as soon as its stdin closes (this value dropped, or the test process killed): a failing test
/// never leaves it frozen, and the loop device goes with the namespace's last process.
pub struct StateDisk {
    _dir: tempfile::TempDir,
    /// Where the filesystem is mounted, inside the namespace (an empty directory outside it).
    pub mnt: std::path::PathBuf,
    holder: std::process::Child,
}

impl StateDisk {
    /// `None` (after a loud skip outside CI) where loop devices or the tools are missing.
    pub fn new() -> Option<StateDisk> {
        let tools = ["mkfs.ext4", "fsfreeze", "nsenter", "unshare", "mount"].iter().all(|t| {
            std::process::Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        let loops = std::path::Path::new("/dev/loop-control").exists() && unsafe { libc::geteuid() } == 0;
        if !require(tools && loops, "loop devices, root, mkfs.ext4, fsfreeze, nsenter and unshare (a freezable disk)") {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("state.img");
        std::fs::File::create(&image).unwrap().set_len(16 << 20).unwrap();
        // No blocks reserved for root (the agent is root): `fill` leaves nothing to write.
        let mkfs = std::process::Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&image).output().unwrap();
        assert!(mkfs.status.success(), "mkfs.ext4: {}", String::from_utf8_lossy(&mkfs.stderr));
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mut holder = std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg("mount -o loop \"$0\" \"$1\" && echo ready && read x; fsfreeze -u \"$1\" 2>/dev/null; exit 0")
            .arg(&image)
            .arg(&mnt)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut ready).unwrap();
        assert_eq!(ready.trim(), "ready", "the state disk was not mounted");
        Some(StateDisk { _dir: dir, mnt, holder })
    }

    fn inside(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new("nsenter")
            .args(["-t", &self.holder.id().to_string(), "-m", "--"])
            .args(args)
            .output()
            .unwrap()
    }

    /// Stop the filesystem answering writes: whoever writes to it sleeps in the kernel until
    /// [`StateDisk::thaw`], where no signal reaches it.
    pub fn freeze(&self) {
        let out = self.inside(&["fsfreeze", "-f", &self.mnt.to_string_lossy()]);
        assert!(out.status.success(), "fsfreeze -f: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn thaw(&self) {
        let out = self.inside(&["fsfreeze", "-u", &self.mnt.to_string_lossy()]);
        assert!(out.status.success(), "fsfreeze -u: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Write `bytes` to `rel` on the filesystem (mode 0600, owned by root, its directories made
    /// 0700): a plan a local-mode agent trusts.
    pub fn write(&self, rel: &str, bytes: &[u8]) {
        let path = self.mnt.join(rel);
        let mut child = std::process::Command::new("nsenter")
            .args(["-t", &self.holder.id().to_string(), "-m", "--", "sh", "-c"])
            .arg("umask 077 && mkdir -p \"$(dirname \"$0\")\" && cat > \"$0\"")
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), bytes).unwrap();
        assert!(child.wait().unwrap().success(), "cannot write {}", path.display());
    }

    /// Fill the filesystem to its last block (root's reserve included) with the file `rel`.
    pub fn fill(&self, rel: &str) {
        // dd stops at ENOSPC (and says so); the second one fills what the first left of its
        // last 64 KiB.
        for (n, bs) in [(1, "64k"), (2, "1k")] {
            let of = format!("of={}{n}", self.mnt.join(rel).display());
            let out = self.inside(&["dd", "if=/dev/zero", &of, &format!("bs={bs}")]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("No space left on device"), "the disk did not fill: {err}");
        }
    }

    /// Remove what [`StateDisk::fill`] wrote as `rel`.
    pub fn unfill(&self, rel: &str) {
        for n in 1..=2 {
            let out = self.inside(&["rm", "-f", &format!("{}{n}", self.mnt.join(rel).display())]);
            assert!(out.status.success(), "rm: {}", String::from_utf8_lossy(&out.stderr));
        }
    }

    /// The bytes of `rel` on the filesystem; `None` if it cannot be read.
    pub fn read(&self, rel: &str) -> Option<Vec<u8>> {
        let out = self.inside(&["cat", &self.mnt.join(rel).to_string_lossy()]);
        out.status.success().then_some(out.stdout)
    }

    /// The names in a directory of the filesystem (`rel` to its root; empty if it is not there).
    pub fn list(&self, rel: &str) -> Vec<String> {
        let out = self.inside(&["ls", "-A", &self.mnt.join(rel).to_string_lossy()]);
        String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
    }

    /// `nodeplan agent --config config` inside the namespace. The filesystem is thawed before the
    /// agent is killed when the value is dropped (a process asleep on a frozen filesystem cannot
    /// be reaped).
    pub fn agent(&self, config: &std::path::Path) -> DiskAgent {
        let mut nsenter = std::process::Command::new("nsenter");
        nsenter.args(["-t", &self.holder.id().to_string(), "-m", "--", NODEPLAN]);
        let agent = AgentProc::spawn(nsenter, config, &[]);
        DiskAgent { _thaw: Thaw(self.holder.id(), self.mnt.clone()), agent }
    }
}

impl Drop for StateDisk {
    fn drop(&mut self) {
        // Closing its stdin makes the holder thaw and exit.
        drop(self.holder.stdin.take());
        let _ = self.holder.wait();
    }
}

/// Thaws the state disk when dropped (before the agent it is declared with).
struct Thaw(u32, std::path::PathBuf);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = std::process::Command::new("nsenter")
            .args(["-t", &self.0.to_string(), "-m", "--", "fsfreeze", "-u"])
            .arg(&self.1)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// An agent on a [`StateDisk`]: the disk is thawed before the agent is killed.
pub struct DiskAgent {
    _thaw: Thaw,
    pub agent: AgentProc,
}

impl std::ops::Deref for DiskAgent {
    type Target = AgentProc;
    fn deref(&self) -> &AgentProc {
        &self.agent
    }
}

impl std::ops::DerefMut for DiskAgent {
    fn deref_mut(&mut self) -> &mut AgentProc {
        &mut self.agent
    }
}
