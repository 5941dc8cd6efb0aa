//! `image` instructions end to end: `nodeplan apply` staging an image from a registry served by
//! the test (token authentication, an image index, layers with whiteouts, digests checked) or
//! from a `docker save` tarball in the images directory, then running the image's `run.sh`.

mod common;

use common::*;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};

const USER: &str = "puller";
const PASS: &str = "s3cret";
const TOKEN: &str = "t0ken";

fn sha(b: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(b))
}

/// A tar (gzip-compressed when asked) of (path, content, mode) regular files owned by root.
fn tar_of(files: &[(&str, &[u8], u32)], gzip: bool) -> Vec<u8> {
    tar_owned(files, 0, gzip)
}

/// A tar (gzip-compressed when asked) of (path, content, mode) regular files owned by `uid`.
fn tar_owned(files: &[(&str, &[u8], u32)], uid: u64, gzip: bool) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, content, mode) in files {
        let mut h = tar::Header::new_gnu();
        h.set_mode(*mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_mtime(1_700_000_000);
        h.set_size(content.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, *content).unwrap();
    }
    let raw = b.into_inner().unwrap();
    if !gzip {
        return raw;
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    gz.finish().unwrap()
}

/// The request line and headers of an HTTP request on `c` (up to the blank line).
fn request_head(c: &std::net::TcpStream) -> String {
    let mut head = String::new();
    let mut r = BufReader::new(c.try_clone().unwrap());
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    head
}

/// The test image: run.sh proves what the stacked layers left.
fn layers() -> Vec<Vec<u8>> {
    let run = b"#!/bin/sh\nset -e\ntest ! -e old.txt\ntest ! -e dir/a\ncat dir/b > \"$OUT\"\necho \" from $CATTLE_AGENT_EXECUTION_PWD\" >> \"$OUT\"\n";
    vec![
        tar_of(&[("run.sh", run, 0o755), ("old.txt", b"old", 0o644), ("dir/a", b"a", 0o644)], true),
        tar_of(&[(".wh.old.txt", b"", 0o644), ("dir/.wh..wh..opq", b"", 0o644), ("dir/b", b"layered", 0o644)], false),
    ]
}

/// How the test registry misbehaves or what it checks (see [`registry`]).
#[derive(Default)]
struct Opts {
    corrupt: u8,
    stall: bool,
    /// Every blob but the first layer's waits for a message here before it is answered.
    gate: Option<mpsc::Receiver<()>>,
    /// The Bearer challenge's realm (default: this registry's own `/token`).
    realm: Option<String>,
    /// The manifest gives no layer sizes.
    no_size: bool,
}

struct Registry {
    port: u16,
    token_requests: Arc<AtomicUsize>,
    /// Sends the digest of every blob request before it is answered.
    blob_requests: mpsc::Receiver<String>,
}

/// A registry serving `repo` with tag `v1` (an index → this platform's manifest → `layers`),
/// behind a Bearer token that needs Basic credentials. `corrupt` 1 flips the second layer's last
/// byte (its digest no longer matches), 2 appends one (larger than the manifest says); with
/// `stall`, blob requests are never answered.
fn registry(repo: &str, layers: Vec<Vec<u8>>, corrupt: u8, stall: bool) -> Registry {
    registry_with(repo, layers, Opts { corrupt, stall, ..Default::default() })
}

fn registry_with(repo: &str, layers: Vec<Vec<u8>>, opts: Opts) -> Registry {
    let Opts { corrupt, stall, gate, realm, no_size } = opts;
    let first_layer = layers.first().map(|l| sha(l)).unwrap_or_default();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut blobs: HashMap<String, Vec<u8>> = HashMap::new();
    let config = br#"{"architecture":"amd64","os":"linux"}"#.to_vec();
    blobs.insert(sha(&config), config.clone());
    let mut descs = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        let digest = sha(layer);
        let mut served = layer.clone();
        if i == 1 {
            match corrupt {
                1 => *served.last_mut().unwrap() ^= 0xff,
                2 => served.push(0),
                _ => {}
            }
        }
        blobs.insert(digest.clone(), served);
        let mut desc = serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": layer.len()});
        if no_size {
            desc.as_object_mut().unwrap().remove("size");
        }
        descs.push(desc);
    }
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(&config), "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        a => a,
    };
    let other = if arch == "amd64" { "arm64" } else { "amd64" };
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": format!("sha256:{}", "0".repeat(64)), "size": 1, "platform": {"os": "linux", "architecture": other}},
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(&manifest), "size": manifest.len(), "platform": {"os": "linux", "architecture": arch}},
        ]
    }))
    .unwrap();
    let mut manifests: HashMap<String, (&str, Vec<u8>)> = HashMap::new();
    manifests.insert("v1".into(), ("application/vnd.oci.image.index.v1+json", index));
    manifests.insert(sha(&manifest), ("application/vnd.oci.image.manifest.v1+json", manifest));
    let token_requests = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let (tokens, repo) = (token_requests.clone(), repo.to_string());
    let held = Arc::new(Mutex::new(Vec::new()));
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let head = request_head(&c);
            let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
            let auth = head
                .lines()
                .find_map(|l| l.strip_prefix("authorization: ").or_else(|| l.strip_prefix("Authorization: ")))
                .unwrap_or("")
                .trim()
                .to_string();
            let reply = |c: &mut std::net::TcpStream, status: &str, headers: &str, body: &[u8]| {
                let _ = write!(
                    c,
                    "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = c.write_all(body);
            };
            use base64::Engine;
            let basic = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASS}")));
            if path.starts_with("/token?") {
                tokens.fetch_add(1, Ordering::SeqCst);
                if auth == basic && path.contains(&format!("repository%3A{}%3Apull", repo.replace('/', "%2F"))) {
                    reply(
                        &mut c,
                        "200 OK",
                        "Content-Type: application/json\r\n",
                        format!("{{\"token\":\"{TOKEN}\"}}").as_bytes(),
                    );
                } else {
                    reply(&mut c, "401 Unauthorized", "", b"");
                }
                continue;
            }
            if auth != format!("Bearer {TOKEN}") {
                let realm = realm.clone().unwrap_or_else(|| format!("http://127.0.0.1:{port}/token"));
                let challenge = format!(
                    "WWW-Authenticate: Bearer realm=\"{realm}\",service=\"test\",scope=\"repository:{repo}:pull\"\r\n"
                );
                reply(&mut c, "401 Unauthorized", &challenge, b"");
                continue;
            }
            if let Some(reference) = path.strip_prefix(&format!("/v2/{repo}/manifests/")) {
                match manifests.get(reference) {
                    Some((ct, body)) => reply(&mut c, "200 OK", &format!("Content-Type: {ct}\r\n"), body),
                    None => reply(&mut c, "404 Not Found", "", b""),
                }
            } else if let Some(digest) = path.strip_prefix(&format!("/v2/{repo}/blobs/")) {
                let _ = tx.send(digest.to_string());
                if stall {
                    held.lock().unwrap().push(c);
                    continue;
                }
                if let Some(g) = &gate
                    && digest != first_layer
                {
                    let _ = g.recv();
                }
                match blobs.get(digest) {
                    Some(body) => reply(&mut c, "200 OK", "", body),
                    None => reply(&mut c, "404 Not Found", "", b""),
                }
            } else {
                reply(&mut c, "404 Not Found", "", b"");
            }
        }
    });
    Registry { port, token_requests, blob_requests: rx }
}

struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        Env { dir: tempfile::tempdir().unwrap() }
    }
    fn p(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }
    /// A plan with one image instruction (no command: the image's run.sh).
    fn plan(&self, image: &str) -> String {
        self.plan_with(
            serde_json::json!({"name": "install", "image": image, "env": [format!("OUT={}", self.p("out"))]}),
        )
    }
    fn plan_with(&self, instruction: serde_json::Value) -> String {
        let path = self.p("image.plan");
        let plan = serde_json::json!({"instructions": [instruction]});
        std::fs::write(&path, serde_json::to_vec(&plan).unwrap()).unwrap();
        path
    }
    fn registries(&self, port: u16) -> String {
        let path = self.p("registries.yaml");
        let host = format!("127.0.0.1:{port}");
        std::fs::write(
            &path,
            format!(
                "mirrors:\n  \"{host}\":\n    endpoint: [\"http://{host}\"]\nconfigs:\n  \"{host}\":\n    auth: {{username: {USER}, password: {PASS}}}\n"
            ),
        )
        .unwrap();
        path
    }
    fn apply(&self, plan: &str, registries: &str) -> Command {
        let mut c = Command::new(NODEPLAN);
        c.args(["apply", plan, "--work-dir", &self.p("work"), "--pid-dir", &self.p("pids")])
            .args(["--images-dir", &self.p("images"), "--registries", registries])
            .env("NODEPLAN_LOG", "info");
        // The registry is on loopback: no proxy of the environment may stand in between.
        for v in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"] {
            c.env_remove(v);
        }
        c
    }
    fn out(&self) -> Option<String> {
        std::fs::read_to_string(self.p("out")).ok()
    }
}

#[test]
fn pulls_an_image_with_a_token_stacks_its_layers_and_runs_its_run_sh() {
    let e = Env::new();
    let reg = registry("team/installer", layers(), 0, false);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let out = e.apply(&e.plan(&image), &e.registries(reg.port)).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let got = e.out().expect("run.sh ran");
    assert!(got.starts_with("layered from ") && got.contains(&e.p("work")), "{got}");
    assert!(err.contains(&format!("staged image {image} pulled from http://127.0.0.1:{}", reg.port)), "{err}");
    assert_eq!(reg.token_requests.load(Ordering::SeqCst), 1, "one token for the whole pull");
    assert!(!std::fs::read_dir(e.p("work")).unwrap().flatten().any(|d| {
        std::fs::read_dir(d.path()).unwrap().flatten().any(|f| f.file_name().to_string_lossy().ends_with(".layer"))
    }));
}

#[test]
fn a_layer_that_does_not_match_its_digest_fails_before_anything_runs() {
    let e = Env::new();
    let digest = sha(&layers()[1]);
    for (corrupt, says) in [(1, "the registry sent content with digest"), (2, "the registry sent more than the")] {
        let reg = registry("team/installer", layers(), corrupt, false);
        let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
        let out = e.apply(&e.plan(&image), &e.registries(reg.port)).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("layer {digest}: {says}")), "{err}");
        assert!(e.out().is_none(), "run.sh must not run");
    }
}

#[test]
fn wrong_credentials_are_reported_with_the_endpoint() {
    let e = Env::new();
    let reg = registry("team/installer", layers(), 0, false);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let regs = e.registries(reg.port);
    std::fs::write(&regs, std::fs::read_to_string(&regs).unwrap().replace(PASS, "wrong")).unwrap();
    let out = e.apply(&e.plan(&image), &regs).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("http://127.0.0.1:{}: token from", reg.port)) && err.contains("401"), "{err}");
}

/// Rancher's plans name the script through a shell (`sh -c run.sh`): it is found through PATH,
/// which ends with the execution directory.
#[test]
fn rancher_style_sh_c_run_sh_finds_the_image_script() {
    let e = Env::new();
    let reg = registry("team/installer", layers(), 0, false);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let plan = e.plan_with(serde_json::json!({"name": "install", "image": image, "command": "sh",
        "args": ["-c", "run.sh"], "env": [format!("OUT={}", e.p("out"))]}));
    let out = e.apply(&plan, &e.registries(reg.port)).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(e.out().expect("run.sh ran").starts_with("layered from "));
}

#[test]
fn an_image_tarball_in_the_images_directory_needs_no_registry() {
    let e = Env::new();
    std::fs::create_dir(e.p("images")).unwrap();
    let ls = layers();
    let manifest = serde_json::json!([{"Config": "cfg.json", "RepoTags": ["example.invalid/team/installer:v1"],
        "Layers": ["l0/layer.tar", "l1/layer.tar"]}]);
    let files: Vec<(&str, &[u8], u32)> = vec![
        ("manifest.json", &[][..], 0o644),
        ("cfg.json", b"{}", 0o644),
        ("l0/layer.tar", &ls[0], 0o644),
        ("l1/layer.tar", &ls[1], 0o644),
    ];
    let m = serde_json::to_vec(&manifest).unwrap();
    let mut files = files;
    files[0].1 = &m;
    std::fs::write(e.p("images/installer.tar.gz"), tar_of(&files, true)).unwrap();
    std::fs::write(e.p("images/other.tar"), tar_of(&[("manifest.json", b"[]", 0o644)], false)).unwrap();
    let out = e.apply(&e.plan("example.invalid/team/installer:v1"), &e.p("no-registries.yaml")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(e.out().expect("run.sh ran").starts_with("layered from "));
    assert!(err.contains(&format!("from {}", e.p("images/installer.tar.gz"))), "{err}");
}

/// R7: a cancel while the image is being pulled abandons the pull; nothing runs.
#[test]
fn a_cancel_during_the_pull_abandons_it_and_runs_nothing() {
    let e = Env::new();
    let reg = registry("team/installer", layers(), 0, true);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let mut child =
        e.apply(&e.plan(&image), &e.registries(reg.port)).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let rx = lines_of(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    let mut wait_for = |needle: &str| loop {
        let l = rx.recv_timeout(GUARD).unwrap_or_else(|_| panic!("no line containing {needle:?}: {seen:?}"));
        seen.push(l.clone());
        if l.contains(needle) {
            break;
        }
    };
    reg.blob_requests.recv_timeout(GUARD).expect("the pull never asked for a layer");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    wait_for("pausing");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    wait_for("canceled after 0/1 instructions");
    let err = seen.join("\n");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(4), "{err}");
    assert!(e.out().is_none(), "run.sh must not run");
}

fn mode_and_owner(p: &str) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    (m.mode() & 0o7777, m.uid())
}

/// The one execution directory of the first instruction: `<work>/<stamp>/<checksum>_0`.
fn exec_dir(work: &str) -> String {
    for stamp in std::fs::read_dir(work).unwrap().flatten() {
        for d in std::fs::read_dir(stamp.path()).into_iter().flatten().flatten() {
            if d.file_name().to_string_lossy().ends_with("_0") {
                return d.path().to_string_lossy().into_owned();
            }
        }
    }
    panic!("no execution directory under {work}");
}

/// A local user (uid 1000) tries to rewrite the image's run.sh (mode 0777 and owned by uid 1000
/// in the image) while the next layer is still being pulled. The work and execution directories
/// are private to root and the file is root's without group/other write, so the attempt fails
/// and root runs the image's own script.
#[test]
fn a_local_user_cannot_rewrite_the_image_while_it_is_staged() {
    use std::os::unix::process::CommandExt;
    let e = Env::new();
    // The work directory's parent is world-searchable, as /var/lib/rancher/agent is.
    std::fs::set_permissions(e.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let run = b"#!/bin/sh\necho original > \"$OUT\"\n";
    let ls = vec![tar_owned(&[("run.sh", run, 0o777)], 1000, true), tar_owned(&[("data", b"x", 0o666)], 1000, false)];
    let (go, gate) = mpsc::channel();
    let reg = registry_with("team/installer", ls.clone(), Opts { gate: Some(gate), ..Default::default() });
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    // The execution directory is kept (a successful apply's goes at once) to check its modes.
    let child = e
        .apply(&e.plan(&image), &e.registries(reg.port))
        .arg("--preserve-work-dir")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The second layer is asked for once the first one is extracted.
    let second = sha(&ls[1]);
    while reg.blob_requests.recv_timeout(GUARD).expect("the pull never asked for the second layer") != second {}
    let run_sh = format!("{}/run.sh", exec_dir(&e.p("work")));
    assert!(std::path::Path::new(&run_sh).exists(), "the first layer is extracted");
    let attack = Command::new("/bin/sh")
        .args(["-c", "echo 'echo pwned > \"$OUT\"' >> \"$0\"", &run_sh])
        .uid(1000)
        .gid(1000)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    go.send(()).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!attack.success(), "a local user rewrote run.sh during the pull");
    assert_eq!(e.out().as_deref(), Some("original\n"));
    let dir = exec_dir(&e.p("work"));
    assert_eq!(mode_and_owner(&e.p("work")), (0o700, 0), "the work directory");
    assert_eq!(mode_and_owner(&dir), (0o700, 0), "the execution directory");
    assert_eq!(mode_and_owner(&run_sh), (0o755, 0), "run.sh: root's, no group/other write");
    assert_eq!(mode_and_owner(&format!("{dir}/data")), (0o644, 0));
}

/// A preserved work directory that another user owns, world-writable, is made private to the
/// agent before anything is put in it, and a warning says so.
#[test]
fn an_existing_work_dir_of_another_user_is_made_private_with_a_warning() {
    let e = Env::new();
    let work = e.p("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::set_permissions(&work, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&work, Some(1000), Some(1000)).unwrap();
    let plan = e.plan_with(serde_json::json!({"name": "x", "command": "true"}));
    let out = e.apply(&plan, &e.p("none.yaml")).arg("--preserve-work-dir").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(mode_and_owner(&work), (0o700, 0));
    assert!(err.contains(&format!("{work} was owned by uid 1000 gid 1000 with mode 0777; made private")), "{err}");
    assert_eq!(mode_and_owner(&exec_dir(&work)), (0o700, 0));
}

/// A token service on its own port that gives anyone the registry's token and records the
/// Authorization header of every request ("" when there was none).
fn foreign_realm() -> (u16, Arc<Mutex<Vec<String>>>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let head = request_head(&c);
            let auth = head
                .lines()
                .find(|l| l.to_ascii_lowercase().starts_with("authorization:"))
                .unwrap_or_default()
                .trim()
                .to_string();
            record.lock().unwrap().push(auth);
            let body = format!("{{\"token\":\"{TOKEN}\"}}");
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, seen)
}

/// A registry whose Bearer challenge points at a token service on another host:port (plain http)
/// does not get the registry's credentials there: the token is asked for anonymously, with a
/// warning. Once the registries file names that host, the credentials go to it.
#[test]
fn registry_credentials_never_go_to_a_foreign_token_realm() {
    let e = Env::new();
    let (foreign, seen) = foreign_realm();
    let realm = format!("http://127.0.0.1:{foreign}/token");
    let opts = Opts { realm: Some(realm.clone()), ..Default::default() };
    let reg = registry_with("team/installer", layers(), opts);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let out = e.apply(&e.plan(&image), &e.registries(reg.port)).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(*seen.lock().unwrap(), [""], "the foreign realm received credentials");
    assert!(err.contains(&format!("not sending its credentials to the token realm {realm}")), "{err}");
    assert!(!err.contains(PASS), "{err}");

    // Named in the registries file: trusted.
    let regs = e.registries(reg.port);
    let named = format!("{}  \"127.0.0.1:{foreign}\": {{}}\n", std::fs::read_to_string(&regs).unwrap());
    std::fs::write(&regs, named).unwrap();
    std::fs::remove_file(e.p("out")).unwrap();
    let out = e.apply(&e.plan(&image), &regs).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASS}"));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert!(seen[1].eq_ignore_ascii_case(&format!("authorization: Basic {basic}")), "{seen:?}");
}

/// A 6 KB layer that decompresses to 4 MiB, a layer of many entries, and a layer the manifest
/// gives no size for: each is refused with one line naming the cap and how to raise it, before
/// anything is extracted or run.
#[test]
fn layers_past_the_caps_are_refused_naming_the_cap() {
    let e = Env::new();
    let zeros = vec![0u8; 4 << 20];
    let bomb = tar_of(&[("run.sh", b"#!/bin/sh\ntouch \"$OUT\"\n", 0o755), ("bomb", &zeros, 0o644)], true);
    assert!(bomb.len() < 64 << 10, "{}", bomb.len());
    let reg = registry("team/installer", vec![bomb], 0, false);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let out =
        e.apply(&e.plan(&image), &e.registries(reg.port)).args(["--image-max-bytes", "1048576"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("decompresses to more than 1048576 bytes, the cap (raise imageMaxBytes"), "{err}");
    assert!(err.contains("--image-max-bytes"), "{err}");
    assert!(e.out().is_none() && !std::path::Path::new(&format!("{}/bomb", exec_dir(&e.p("work")))).exists());

    let names: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
    let many: Vec<(&str, &[u8], u32)> = names.iter().map(|n| (n.as_str(), &b""[..], 0o644)).collect();
    let reg = registry("team/installer", vec![tar_of(&many, true)], 0, false);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let out = e.apply(&e.plan(&image), &e.registries(reg.port)).args(["--image-max-entries", "10"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("more than 10 entries, the cap (raise imageMaxEntries"), "{err}");

    let big = tar_of(&[("big", &zeros[..2 << 20], 0o644)], false);
    let opts = Opts { no_size: true, ..Default::default() };
    let reg = registry_with("team/installer", vec![big.clone()], opts);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let out =
        e.apply(&e.plan(&image), &e.registries(reg.port)).args(["--image-max-bytes", "1048576"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let says = format!("layer {}: the manifest gives no size and the registry sent more than 1048576 bytes", sha(&big));
    assert!(err.contains(&says), "{err}");
}

/// Staging counts toward the instruction's timeoutSeconds: a registry that never sends the layer
/// fails the instruction as timed out, and nothing runs.
#[test]
fn a_pull_that_outlasts_the_timeout_fails_the_instruction_as_timed_out() {
    let e = Env::new();
    let reg = registry("team/installer", layers(), 0, true);
    let image = format!("127.0.0.1:{}/team/installer:v1", reg.port);
    let plan = e.plan_with(serde_json::json!({"name": "install", "image": image, "timeoutSeconds": 1,
        "env": [format!("OUT={}", e.p("out"))]}));
    let mut child =
        e.apply(&plan, &e.registries(reg.port)).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let rx = lines_of(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    loop {
        let Ok(l) = rx.recv_timeout(GUARD) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the instruction did not time out: {seen:?}");
        };
        seen.push(l.clone());
        if l.contains("instruction 1/1 install: FAILED") {
            break;
        }
    }
    let status = child.wait().unwrap();
    let err = seen.join("\n");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("timed out after 1s: not started"), "{err}");
    assert!(err.contains("used up the instruction's timeout"), "{err}");
    assert!(e.out().is_none(), "run.sh must not run");
}
