//! The executor: gathers what the plan needs (the manifest, whether `/usr/local` is read-only,
//! the Cattle id, the connection info, the binary), checks every file against [`plan::decide`]
//! before writing any, holds system-agent's upgrade interlock while it writes, writes through
//! [`Tree`], records the [`Manifest`] and enables the unit. [`uninstall`] undoes exactly what a
//! manifest lists.
//!
//! Owns the order of I/O; every decision is a function of [`plan`].

use super::fetch::{self, Bounds};
use super::plan::{self, Action, IdOrigin, Inputs, Manifest, Removal, Step};
use super::settings::{Settings, Source};
use super::tree::{Existing, READ_CAP, Tree};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why install or uninstall stopped.
#[derive(Debug)]
pub enum Error {
    /// Bad input: settings, the binary, the kubeconfig, the root directory (exit 2).
    Bad(String),
    /// Files nodeplan install did not write are in the way; nothing was written (exit 3).
    Refused(Vec<String>),
    /// The server, a write or systemctl failed (exit 1).
    Failed(String),
}

/// What was done, one line per thing, and whether anything changed.
#[derive(Debug, Default)]
pub struct Outcome {
    pub lines: Vec<String>,
    pub changed: bool,
}

fn failed(e: impl std::fmt::Display) -> Error {
    Error::Failed(e.to_string())
}

const MANIFEST_CAP: u64 = 1 << 20;
const ENV_CAP: u64 = 1 << 20;

fn read_manifest(tree: &Tree, config_dir: &Path) -> Result<Option<Manifest>, Error> {
    let p = config_dir.join(super::MANIFEST_NAME);
    match tree.read(&p, MANIFEST_CAP).map_err(failed)? {
        None => Ok(None),
        Some(b) => {
            Manifest::parse(&b).map(Some).map_err(|e| Error::Failed(format!("{}: {e}", tree.shown(&p).display())))
        }
    }
}

/// Whether `/usr/local` (or, when it does not exist yet, the nearest directory above it) is on a
/// read-only filesystem.
fn usr_local_read_only(tree: &Tree) -> Result<bool, Error> {
    for p in ["/usr/local", "/usr"] {
        if tree.existing(Path::new(p)).map_err(failed)? == Existing::Other("a directory") {
            return tree.read_only(Path::new(p)).map_err(failed);
        }
    }
    tree.read_only(Path::new("/")).map_err(failed)
}

/// A random id for a machine without a machine id (kept like a derived one).
fn random_id() -> Result<String, Error> {
    let mut s = String::new();
    for _ in 0..4 {
        s.push_str(&format!("{:016x}", crate::safefs::random_u64().map_err(failed)?));
    }
    Ok(s)
}

/// Install as `s` says.
pub async fn install(s: &Settings) -> Result<Outcome, Error> {
    let host = s.root == Path::new("/");
    if !host && let Some(parent) = s.root.parent().filter(|p| p.exists()) {
        let uid = rustix::process::geteuid().as_raw();
        match crate::safefs::changeable_by_others_beneath(parent, &[0, uid]) {
            Ok(None) => {}
            Ok(Some(why)) => {
                return Err(Error::Bad(format!(
                    "--root {}: refused: {why}, so another user could change what root installs",
                    shown(&s.root)
                )));
            }
            Err(e) => return Err(Error::Bad(format!("--root {}: {e}", shown(&s.root)))),
        }
    }
    let tree = Tree::open(&s.root, true).map_err(|e| Error::Bad(format!("--root: {e}")))?;
    // The root is judged as opened, not by its path again: in a sticky directory (/tmp) another
    // user could put a directory of theirs there between a check and the open.
    if !host {
        let uid = rustix::process::geteuid().as_raw();
        if let Some(why) = tree.root_changeable_by_others(&[0, uid]).map_err(failed)? {
            return Err(Error::Bad(format!(
                "--root {}: refused: {why}, so another user could change what root installs",
                shown(&s.root)
            )));
        }
    }
    let mut out = Outcome::default();
    let old = read_manifest(&tree, &s.config_dir)?.unwrap_or_default();

    let prefix = match &s.bin_prefix {
        Some(p) => p.clone(),
        None => {
            let ro = usr_local_read_only(&tree)?;
            let p = plan::choose_prefix(None, ro);
            if ro {
                out.lines.push(format!("/usr/local is read-only: installing the binary under {}", p.display()));
            }
            p
        }
    };

    let source = match &s.binary {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| Error::Bad(format!("cannot find the running binary: {e}")))?,
    };
    if s.binary.is_some() {
        refuse_if_others_can_change("--binary", &source)?;
    }
    let binary = crate::safefs::read_named(&source, READ_CAP)
        .map_err(|e| Error::Bad(format!("binary {}: {e}", shown(&source))))?;

    let (connection, cattle_id) = match &s.source {
        Source::Rancher(r) => {
            let kept = tree.read(&s.config_dir.join(super::CATTLE_ID_NAME), 4096).map_err(failed)?;
            let machine = tree.read(Path::new("/etc/machine-id"), 4096).map_err(failed)?;
            let (id, origin) = match plan::cattle_id(r.id.as_deref(), kept.as_deref(), machine.as_deref()) {
                Some(x) => x,
                None => (random_id()?, IdOrigin::Random),
            };
            out.lines.push(format!(
                "Cattle id {id} ({})",
                match origin {
                    IdOrigin::Env => "CATTLE_ID",
                    IdOrigin::Kept => "kept from an earlier install",
                    IdOrigin::MachineId => "derived from /etc/machine-id",
                    IdOrigin::Random => "random: no /etc/machine-id to derive it from",
                }
            ));
            let bounds = Bounds { retries: s.retries, interval: s.retry_interval, timeout: s.request_timeout };
            let info = fetch::connection_info(r, &id, s.node_name.as_deref(), bounds).await.map_err(Error::Failed)?;
            let json = serde_json::to_vec(&info).map_err(failed)?;
            (Some(json), Some(id))
        }
        Source::Kubeconfig { kubeconfig, namespace, name, .. } => {
            let kc = crate::safefs::read_named(kubeconfig, crate::config::MAX_FILE_BYTES)
                .map_err(|e| Error::Bad(format!("--kubeconfig {}: {e}", shown(kubeconfig))))?;
            let kc = String::from_utf8(kc)
                .map_err(|_| Error::Bad(format!("--kubeconfig {}: not UTF-8 text", shown(kubeconfig))))?;
            let info = crate::config::ConnectionInfo {
                kube_config: kc,
                namespace: namespace.clone(),
                secret_name: name.clone(),
            };
            let json = serde_json::to_vec(&info).map_err(failed)?;
            let bad = |e: String| {
                Error::Bad(format!("--kubeconfig {}: {}", shown(kubeconfig), e.replace("the answer's ", "")))
            };
            fetch::parse_connection(&json).map_err(bad)?;
            // The operator's kubeconfig may use a credential plugin (the agent runs it), but
            // install never runs it.
            if let Some(note) = fetch::check_client(&info, fetch::Plugins::NotRun).await.map_err(bad)? {
                out.lines
                    .push(format!("--kubeconfig {}: {note} (the agent runs it when it starts)", shown(kubeconfig)));
            }
            (Some(json), None)
        }
        Source::Local => (None, None),
    };

    let steps =
        plan::steps(Inputs { settings: s, prefix: &prefix, binary, connection, cattle_id }).map_err(Error::Bad)?;

    // Every file is checked before anything is written: a refusal leaves the machine as it was.
    let mut actions = Vec::new();
    let mut refused = Vec::new();
    for step in &steps {
        if let Step::File { path, content, .. } = step {
            let sha = super::sha256_hex(content);
            let existing = tree.existing(path).map_err(failed)?;
            let a = plan::decide(&existing, &sha, old.recorded(path), s.force);
            if let Action::Refuse(why) = &a {
                refused.push(format!("{} {why}", tree.shown(path).display()));
            }
            actions.push((path.clone(), a, sha));
        }
    }
    if !refused.is_empty() {
        return Err(Error::Refused(refused));
    }
    // The environment file is read now too: one that cannot be read (a FIFO, a link, too large)
    // stops the install before anything is written.
    let mut env_now = None;
    for step in &steps {
        if let Step::EnvFile { path, .. } = step {
            let bytes = tree.read(path, ENV_CAP).map_err(failed)?;
            env_now = Some(bytes.map(|b| String::from_utf8_lossy(&b).into_owned()));
        }
    }
    let anything_to_write = actions.iter().any(|(_, a, _)| *a != Action::Unchanged);
    let _pending = if anything_to_write {
        interlock(&tree, &s.var_dir.join("interlock"), s.interlock_timeout).await?
    } else {
        None
    };

    let mut manifest = Manifest { version: 1, ..Manifest::default() };
    manifest.dirs = old.dirs.clone();
    let written = write_steps(&tree, &steps, actions, env_now, &mut manifest, &mut out);
    // What an earlier install wrote and this one did not (the connection info of a mode left
    // behind) stays listed, so uninstall still removes it.
    for f in &old.files {
        if manifest.recorded(&f.path).is_none() {
            manifest.files.push(f.clone());
        }
    }
    for l in &old.links {
        if !manifest.links.iter().any(|m| m.path == l.path) {
            manifest.links.push(l.clone());
        }
    }
    let mpath = s.config_dir.join(super::MANIFEST_NAME);
    let mut text = serde_json::to_vec_pretty(&manifest).map_err(failed)?;
    text.push(b'\n');
    // The manifest is written even when a step failed, so what was written is known next time.
    let saved = tree.write(&mpath, &text, 0o600);
    let unit_changed = written?;
    saved.map_err(failed)?;

    if tree.is_host() {
        if unit_changed {
            systemctl(&["daemon-reload"])?;
        }
        systemctl(&["enable", "nodeplan.service"])?;
        let verb = if out.changed { "restart" } else { "start" };
        systemctl(&[verb, "nodeplan.service"])?;
        out.lines.push(format!("systemctl {verb} nodeplan.service: done"));
    }
    // Both agents on one plan source never act at once (remote mode waits while Rancher's runs):
    // say so when Rancher's is installed here.
    let rancher_unit = Path::new("/etc/systemd/system/rancher-system-agent.service");
    if tree.existing(rancher_unit).map_err(failed)? != Existing::Absent {
        out.lines.push(format!(
            "warning: {} is installed too: nodeplan's remote mode waits while rancher-system-agent runs; \
             disable it (systemctl disable --now rancher-system-agent) to hand the node to nodeplan",
            tree.shown(rancher_unit).display()
        ));
    }
    if !out.changed {
        out.lines.push("nothing changed: everything was already installed as asked".into());
    }
    Ok(out)
}

/// Root installs from `--binary` and into `--root` only what no other user can change: the path
/// and every directory above it must be root's (or the installer's user's) and not writable by
/// group or others (a sticky directory such as `/tmp` is accepted on the way). One line says
/// which path fails and why.
fn refuse_if_others_can_change(flag: &str, path: &Path) -> Result<(), Error> {
    let uid = rustix::process::geteuid().as_raw();
    match crate::safefs::changeable_by_others(path, &[0, uid]) {
        Ok(None) => Ok(()),
        Ok(Some(why)) => Err(Error::Bad(format!(
            "{flag} {}: refused: {why}, so another user could change what root installs",
            shown(path)
        ))),
        Err(e) => Err(Error::Bad(format!("{flag} {}: {e}", shown(path)))),
    }
}

/// Carries out `steps` (with the [`Action`]s decided for their files, in order), recording in
/// `manifest` what it wrote; returns whether the unit or its environment changed.
fn write_steps(
    tree: &Tree,
    steps: &[Step],
    actions: Vec<(PathBuf, Action, String)>,
    mut env_now: Option<Option<String>>,
    manifest: &mut Manifest,
    out: &mut Outcome,
) -> Result<bool, Error> {
    let mut actions = actions.into_iter();
    let mut unit_changed = false;
    for step in steps {
        match step {
            Step::Dir { path, mode } => {
                for d in tree.ensure_dir(path, *mode).map_err(failed)? {
                    out.lines.push(format!("created directory {}", tree.shown(&d).display()));
                    out.changed = true;
                    if !manifest.dirs.contains(&d) {
                        manifest.dirs.push(d);
                    }
                }
            }
            Step::File { path, content, mode, what } => {
                let Some((_, action, sha)) = actions.next() else {
                    return Err(failed("internal: steps and actions differ"));
                };
                let shown = tree.shown(path);
                match action {
                    Action::Unchanged => {
                        // Content as wanted: the owner and mode are set again all the same, and a
                        // file someone else owned (or with another mode) is said to have changed.
                        let before = tree.owner_mode(path).map_err(failed)?;
                        tree.write(path, content, *mode).map_err(failed)?;
                        let uid = rustix::process::geteuid().as_raw();
                        match before {
                            Some((u, m)) if (u, m) != (uid, *mode) => {
                                out.lines.push(format!(
                                    "unchanged {what} {}: owner set to uid {uid} (was {u}), mode {:04o} (was {m:04o})",
                                    shown.display(),
                                    *mode
                                ));
                                out.changed = true;
                            }
                            _ => out.lines.push(format!("unchanged {what} {}", shown.display())),
                        }
                    }
                    Action::Create | Action::Replace => {
                        tree.write(path, content, *mode).map_err(failed)?;
                        let verb = if action == Action::Create { "created" } else { "updated" };
                        out.lines.push(format!("{verb} {what} {}", shown.display()));
                        out.changed = true;
                        unit_changed |= path == Path::new(super::UNIT_PATH);
                    }
                    Action::Refuse(_) => unreachable_refusal()?,
                }
                manifest.files.push(plan::FileEntry { path: path.clone(), sha256: sha });
            }
            Step::EnvFile { path, vars } => {
                let text = env_now.take().flatten();
                let m = plan::merge_env(text.as_deref(), vars);
                for k in &m.kept_users {
                    out.lines
                        .push(format!("{k} is set by your own line in {}: kept as it is", tree.shown(path).display()));
                }
                if m.text.as_deref() != text.as_deref() {
                    match &m.text {
                        Some(t) => tree.write(path, t.as_bytes(), 0o600).map_err(failed)?,
                        None => tree.remove_file(path).map(|()| true).map_err(failed)?,
                    };
                    out.lines.push(format!("updated environment file {}", tree.shown(path).display()));
                    out.changed = true;
                    unit_changed = true;
                }
                manifest.env_file = Some(path.clone());
            }
            Step::Link { path, target } => {
                let shown = tree.shown(path);
                match tree.link_target(path).map_err(failed)? {
                    Some(t) if &t == target => out.lines.push(format!("unchanged link {}", shown.display())),
                    current => {
                        if current.is_none() && tree.existing(path).map_err(failed)? != Existing::Absent {
                            return Err(Error::Failed(format!(
                                "{} is in the way of the unit's enable link",
                                shown.display()
                            )));
                        }
                        tree.symlink(path, target).map_err(failed)?;
                        out.lines.push(format!("enabled: link {} -> {}", shown.display(), target.display()));
                        out.changed = true;
                    }
                }
                manifest.links.push(plan::LinkEntry { path: path.clone(), target: target.clone() });
            }
        }
    }
    Ok(unit_changed)
}

fn unreachable_refusal() -> Result<(), Error> {
    Err(failed("internal: a refused file reached the writer"))
}

/// Removes `restart-pending` when the install is done (or gives up).
struct Pending<'a> {
    tree: &'a Tree,
    path: PathBuf,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let _ = self.tree.remove_file(&self.path);
    }
}

/// system-agent's upgrade interlock, the installer's half: when the agent's interlock directory
/// exists, `restart-pending` asks the agent to start no new apply, and the install waits (at most
/// `timeout`) while `applyinator-active` says one is running.
async fn interlock<'a>(tree: &'a Tree, dir: &Path, timeout: Duration) -> Result<Option<Pending<'a>>, Error> {
    if tree.existing(dir).map_err(failed)? != Existing::Other("a directory") {
        return Ok(None);
    }
    let pending = dir.join("restart-pending");
    tree.write(&pending, b"", 0o600).map_err(failed)?;
    let guard = Pending { tree, path: pending };
    let active = dir.join("applyinator-active");
    let deadline = tokio::time::Instant::now() + timeout;
    let mut said = false;
    while tree.existing(&active).map_err(failed)? != Existing::Absent {
        if !said {
            tracing::info!("a plan is being applied ({} exists): waiting for it to end", tree.shown(&active).display());
            said = true;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Failed(format!(
                "a plan is still being applied ({} exists) after {}: nothing was installed (if no agent runs, remove that file)",
                tree.shown(&active).display(),
                crate::duration::show(timeout)
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Some(guard))
}

fn systemctl(args: &[&str]) -> Result<(), Error> {
    let out = std::process::Command::new("systemctl")
        .args(args)
        .output()
        .map_err(|e| Error::Failed(format!("systemctl {}: {e}", args.join(" "))))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        let first = err.lines().next().unwrap_or("").trim();
        Err(Error::Failed(format!("systemctl {}: {} {}", args.join(" "), out.status, crate::quoted(first))))
    }
}

/// Remove what the manifest in `config_dir` lists, file by file, keeping (and naming) every file
/// changed since install wrote it.
pub fn uninstall(root: &Path, config_dir: &Path) -> Result<Outcome, Error> {
    let tree = Tree::open(root, false).map_err(|e| Error::Bad(format!("--root: {e}")))?;
    let mut out = Outcome::default();
    let mpath = config_dir.join(super::MANIFEST_NAME);
    let Some(m) = read_manifest(&tree, config_dir)? else {
        out.lines
            .push(format!("nothing to uninstall: no {} (nodeplan install writes it)", tree.shown(&mpath).display()));
        return Ok(out);
    };
    if tree.is_host() {
        // A unit that is already gone is no reason to stop.
        if let Err(Error::Failed(e)) = systemctl(&["disable", "--now", "nodeplan.service"]) {
            out.lines.push(format!("warning: {e}"));
        }
    }
    for l in &m.links {
        let shown = tree.shown(&l.path);
        match tree.link_target(&l.path).map_err(failed)? {
            Some(t) if t == l.target => {
                tree.remove_file(&l.path).map_err(failed)?;
                out.lines.push(format!("removed link {}", shown.display()));
                out.changed = true;
            }
            Some(_) => out.lines.push(format!("kept {}: the link was changed", shown.display())),
            None => {}
        }
    }
    for f in m.files.iter().rev() {
        let shown = tree.shown(&f.path);
        match plan::removal(&tree.existing(&f.path).map_err(failed)?, &f.sha256) {
            Removal::Remove => {
                tree.remove_file(&f.path).map_err(failed)?;
                out.lines.push(format!("removed {}", shown.display()));
                out.changed = true;
            }
            Removal::Gone => {}
            Removal::Keep(why) => out.lines.push(format!("kept {}: {why}", shown.display())),
        }
    }
    if let Some(p) = &m.env_file
        && let Some(bytes) = tree.read(p, ENV_CAP).map_err(failed)?
    {
        let text = String::from_utf8_lossy(&bytes);
        let merged = plan::merge_env(Some(&text), &[]);
        match merged.text {
            None => {
                tree.remove_file(p).map_err(failed)?;
                out.lines.push(format!("removed {}", tree.shown(p).display()));
                out.changed = true;
            }
            Some(t) if t != text => {
                tree.write(p, t.as_bytes(), 0o600).map_err(failed)?;
                out.lines.push(format!(
                    "removed the installer's block from {} (your lines are kept)",
                    tree.shown(p).display()
                ));
                out.changed = true;
            }
            Some(_) => {}
        }
    }
    tree.remove_file(&mpath).map_err(failed)?;
    let mut dirs = m.dirs.clone();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    let mut kept: Vec<PathBuf> = Vec::new();
    for d in dirs {
        let shown = tree.shown(&d);
        if tree.remove_empty_dir(&d).map_err(failed)? {
            out.lines.push(format!("removed directory {}", shown.display()));
        } else {
            // Named once: a directory kept because a kept one is inside it goes without a line.
            if !kept.iter().any(|k| k.starts_with(&d)) {
                out.lines.push(format!("kept directory {}: not empty", shown.display()));
            }
            kept.push(d);
        }
    }
    if tree.is_host() {
        let _ = systemctl(&["daemon-reload"]);
    }
    out.lines.push("uninstalled".into());
    Ok(out)
}

/// A path typed by the operator, for a one-line message (control characters escaped).
fn shown(p: &Path) -> String {
    p.display().to_string().escape_debug().to_string()
}
