//! What the installer writes, as pure functions: the binary prefix, the Cattle id, the config
//! file, the unit rendered from `deploy/nodeplan.service`, the installer's block of the unit's
//! environment file, the list of [`Step`]s, whether an existing file may be replaced
//! ([`decide`]), and the [`Manifest`] that lets uninstall remove exactly what install wrote.
//!
//! No I/O here: the executor ([`super::run`]) reads what is on disk and hands it in.

use super::settings::{FALLBACK_BIN_PREFIX, Settings, Source};
use super::tree::Existing;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One thing to put in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A directory (made with `mode` when missing; an existing one is left as it is).
    Dir { path: PathBuf, mode: u32 },
    /// A file with this content and mode, subject to [`decide`].
    File { path: PathBuf, content: Vec<u8>, mode: u32, what: &'static str },
    /// The installer's block of an environment file ([`merge_env`]).
    EnvFile { path: PathBuf, vars: Vec<(String, String)> },
    /// A symlink (the unit's `enable` link inside a tree).
    Link { path: PathBuf, target: PathBuf },
}

/// What to do with a file that may already exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Create,
    Unchanged,
    Replace,
    /// Not without `--force` (or never, for a directory): why.
    Refuse(String),
}

/// Whether the file install wants to write may be written over what is there: what install wrote
/// last (`recorded`, from the manifest) or the same content may; anything else only with `force`,
/// and a directory never.
pub fn decide(existing: &Existing, planned_sha256: &str, recorded: Option<&str>, force: bool) -> Action {
    match existing {
        Existing::Absent => Action::Create,
        Existing::File { sha256 } if sha256 == planned_sha256 => Action::Unchanged,
        Existing::File { sha256 } if recorded == Some(sha256.as_str()) => Action::Replace,
        Existing::File { .. } if force => Action::Replace,
        Existing::File { .. } => Action::Refuse("holds content nodeplan install did not write (use --force)".into()),
        Existing::Other("a directory") => Action::Refuse("is a directory".into()),
        // The rename replaces a link itself; it is never followed.
        Existing::Other(_) if force => Action::Replace,
        Existing::Other(kind) => Action::Refuse(format!("is {kind}, not a file nodeplan install wrote (use --force)")),
    }
}

/// The binary's prefix: the one asked for, else `/usr/local`, else (read-only `/usr/local`)
/// [`FALLBACK_BIN_PREFIX`].
pub fn choose_prefix(asked: Option<&Path>, usr_local_read_only: bool) -> PathBuf {
    match asked {
        Some(p) => p.into(),
        None if usr_local_read_only => FALLBACK_BIN_PREFIX.into(),
        None => super::settings::DEFAULT_BIN_PREFIX.into(),
    }
}

/// Where the Cattle id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdOrigin {
    Env,
    Kept,
    MachineId,
    /// No machine id to derive one from: random (and kept like a derived one).
    Random,
}

/// The Cattle id: `CATTLE_ID`, else the one kept in the config directory by an earlier install,
/// else the SHA-256 of the machine id file's bytes (as `sha256sum /etc/machine-id` prints it).
/// `None` when there is none of the three.
pub fn cattle_id(env: Option<&str>, kept: Option<&[u8]>, machine_id: Option<&[u8]>) -> Option<(String, IdOrigin)> {
    if let Some(id) = env {
        return Some((id.to_string(), IdOrigin::Env));
    }
    let kept = kept.and_then(|k| std::str::from_utf8(k).ok()).map(str::trim).filter(|k| {
        !k.is_empty() && k.len() <= 256 && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    });
    if let Some(k) = kept {
        return Some((k.to_string(), IdOrigin::Kept));
    }
    let m = machine_id.filter(|m| !m.iter().all(u8::is_ascii_whitespace))?;
    Some((super::sha256_hex(m), IdOrigin::MachineId))
}

/// The unit for `binary` and `config`: the template with its `ExecStart=` binary and its
/// `CATTLE_AGENT_CONFIG=` value replaced (both must be there exactly once).
pub fn render_unit(template: &str, binary: &Path, config: &Path) -> Result<String, String> {
    let mut exec = 0;
    let mut conf = 0;
    let mut out = String::with_capacity(template.len() + 64);
    for line in template.lines() {
        if let Some(rest) = line.strip_prefix("ExecStart=") {
            let args = rest.split_once(' ').map_or("", |(_, a)| a);
            out.push_str(format!("ExecStart={} {args}", binary.display()).trim_end());
            exec += 1;
        } else if line.starts_with("Environment=CATTLE_AGENT_CONFIG=") {
            out.push_str(&format!("Environment=CATTLE_AGENT_CONFIG={}", config.display()));
            conf += 1;
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    if exec != 1 || conf != 1 {
        return Err(
            "the unit template must have exactly one ExecStart= and one Environment=CATTLE_AGENT_CONFIG= line".into()
        );
    }
    for p in [binary, config] {
        let s = p.display().to_string();
        if s.chars().any(|c| c.is_whitespace() || c.is_control() || c == '%' || c == '"' || c == '\\') {
            return Err(format!("{} cannot be written in a unit file (spaces, %, quotes)", crate::quoted(&s)));
        }
    }
    Ok(out)
}

/// A YAML scalar for a string (a JSON string is valid YAML).
fn y(s: &str) -> String {
    serde_json::Value::String(s.into()).to_string()
}

fn yp(p: &Path) -> String {
    y(&p.display().to_string())
}

/// The config file for these settings (system-agent's installer's keys and values, plus the
/// NodePlan keys in that mode).
pub fn render_config(s: &Settings) -> String {
    let v = &s.var_dir;
    let (remote, nodeplan) = match &s.source {
        Source::Rancher(_) => (true, false),
        Source::Kubeconfig { nodeplan, .. } => (!nodeplan, *nodeplan),
        Source::Local => (false, false),
    };
    let mut out = String::from(
        "# Written by `nodeplan install`. `nodeplan uninstall` removes it unless it was changed;\n\
         # a changed file is not overwritten by the next install without --force.\n",
    );
    let mut kv = |k: &str, val: String| out.push_str(&format!("{k}: {val}\n"));
    kv("workDirectory", yp(&v.join("work")));
    kv("localEnabled", s.local_enabled.to_string());
    kv("localPlanDirectory", yp(&v.join("plans")));
    kv("appliedPlanDirectory", yp(&v.join("applied")));
    kv("remoteEnabled", remote.to_string());
    kv("nodePlanEnabled", nodeplan.to_string());
    if remote || nodeplan {
        kv("connectionInfoFile", yp(&s.connection_path()));
    }
    if nodeplan {
        kv("nodePlanStateDirectory", yp(&v.join("nodeplans")));
        if let Some(n) = &s.node_name {
            kv("nodeName", y(n));
        }
    }
    kv("preserveWorkDirectory", s.preserve_work_dir.to_string());
    kv("interlockDirectory", yp(&v.join("interlock")));
    out
}

const BEGIN: &str = "# BEGIN nodeplan install";
const BEGIN_LINE: &str = "# BEGIN nodeplan install (rewritten by `nodeplan install`, removed by `nodeplan uninstall`; lines outside this block are yours and are kept)";
const END: &str = "# END nodeplan install";

/// The variables of an environment-file line (`KEY=…` or `export KEY=…`), else `None`.
fn env_key(line: &str) -> Option<&str> {
    let l = line.trim_start();
    let l = l.strip_prefix("export ").unwrap_or(l).trim_start();
    let (k, _) = l.split_once('=')?;
    (!k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')).then_some(k.trim())
}

/// The result of [`merge_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvMerge {
    /// The new file; `None`: nothing left, the file goes (or is not made).
    pub text: Option<String>,
    /// Variables not put in the block because a line of the user's sets them already.
    pub kept_users: Vec<String>,
}

/// The environment file with the installer's block holding `vars` (in place of an earlier block;
/// at the top when there was none, so the user's own lines, later in the file, win). Lines
/// outside the block are kept byte for byte, and a variable they set already is left out of
/// the block. With no variables the block goes; a file left empty goes.
pub fn merge_env(existing: Option<&str>, vars: &[(String, String)]) -> EnvMerge {
    let (before, after) = split_block(existing.unwrap_or(""));
    let users: Vec<&str> = before.lines().chain(after.lines()).filter_map(env_key).collect();
    let mut kept_users = Vec::new();
    let mut block = String::new();
    for (k, v) in vars {
        if users.contains(&k.as_str()) {
            kept_users.push(k.clone());
            continue;
        }
        let escaped = v.replace('\\', "\\\\").replace('"', "\\\"");
        block.push_str(&format!("{k}=\"{escaped}\"\n"));
    }
    let mut text = String::new();
    text.push_str(&before);
    if !block.is_empty() {
        text.push_str(&format!("{BEGIN_LINE}\n{block}{END}\n"));
    }
    text.push_str(&after);
    let text = (!text.trim().is_empty()).then_some(text);
    EnvMerge { text, kept_users }
}

/// The file without the installer's block: the lines before it (and where it was), the lines
/// after. Without a block, everything is "after" (the block goes first).
fn split_block(text: &str) -> (String, String) {
    let mut before = String::new();
    let mut after = String::new();
    let mut state = 0; // 0: before the block, 1: in it, 2: after it
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        match state {
            0 if bare.starts_with(BEGIN) => state = 1,
            0 => before.push_str(line),
            1 if bare == END => state = 2,
            1 => {}
            _ => after.push_str(line),
        }
    }
    if state == 0 {
        // No block: the user's whole file comes after the new block.
        return (String::new(), before);
    }
    // (A block never closed ends the file: nothing after it is kept, since it was ours.)
    (before, after)
}

/// The inputs the executor gathered for [`steps`].
pub struct Inputs<'a> {
    pub settings: &'a Settings,
    pub prefix: &'a Path,
    pub binary: Vec<u8>,
    /// The connection info's JSON (`None` in local mode).
    pub connection: Option<Vec<u8>>,
    /// The Cattle id to keep (Rancher source only).
    pub cattle_id: Option<String>,
}

/// The binary's path under `prefix`.
pub fn binary_path(prefix: &Path) -> PathBuf {
    prefix.join("bin/nodeplan")
}

/// Everything install puts in place, in order.
pub fn steps(i: Inputs<'_>) -> Result<Vec<Step>, String> {
    let s = i.settings;
    let bin = binary_path(i.prefix);
    let unit = render_unit(super::UNIT_TEMPLATE, &bin, &s.config_path())?;
    let mut out = vec![
        Step::Dir { path: s.config_dir.clone(), mode: 0o755 },
        Step::Dir { path: s.var_dir.clone(), mode: 0o700 },
        Step::Dir { path: s.var_dir.join("interlock"), mode: 0o700 },
        Step::Dir { path: i.prefix.join("bin"), mode: 0o755 },
        Step::Dir { path: "/etc/systemd/system".into(), mode: 0o755 },
    ];
    if s.local_enabled {
        out.push(Step::Dir { path: s.var_dir.join("plans"), mode: 0o700 });
    }
    if let Some(id) = i.cattle_id {
        out.push(Step::File {
            path: s.config_dir.join(super::CATTLE_ID_NAME),
            content: format!("{id}\n").into_bytes(),
            mode: 0o600,
            what: "Cattle id",
        });
    }
    if let Some(c) = i.connection {
        out.push(Step::File { path: s.connection_path(), content: c, mode: 0o600, what: "connection info" });
    }
    out.push(Step::File { path: s.config_path(), content: render_config(s).into_bytes(), mode: 0o600, what: "config" });
    out.push(Step::File { path: bin, content: i.binary, mode: 0o755, what: "binary" });
    out.push(Step::File { path: super::UNIT_PATH.into(), content: unit.into_bytes(), mode: 0o644, what: "unit" });
    let mut vars = Vec::new();
    if let Some(l) = &s.log_level {
        vars.push(("CATTLE_LOGLEVEL".to_string(), l.clone()));
    }
    if s.strict_verify {
        vars.push(("CATTLE_AGENT_STRICT_VERIFY".to_string(), "true".to_string()));
    }
    vars.extend(s.proxy.iter().cloned());
    out.push(Step::EnvFile { path: super::ENV_PATH.into(), vars });
    if !s.is_host() {
        // What `systemctl --root DIR enable` makes; on this machine systemctl does it.
        out.push(Step::Dir { path: "/etc/systemd/system/multi-user.target.wants".into(), mode: 0o755 });
        out.push(Step::Link { path: super::WANTS_LINK.into(), target: super::UNIT_PATH.into() });
    }
    Ok(out)
}

/// What install wrote, kept in the config directory so uninstall removes exactly that.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub version: u32,
    /// Files install wrote, with the SHA-256 of what it wrote.
    pub files: Vec<FileEntry>,
    /// Symlinks install made.
    #[serde(default)]
    pub links: Vec<LinkEntry>,
    /// The environment file install keeps a block in.
    #[serde(default)]
    pub env_file: Option<PathBuf>,
    /// Directories install made (they are removed when empty), outermost first.
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: PathBuf,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkEntry {
    pub path: PathBuf,
    pub target: PathBuf,
}

impl Manifest {
    pub fn recorded(&self, p: &Path) -> Option<&str> {
        self.files.iter().find(|f| f.path == p).map(|f| f.sha256.as_str())
    }

    /// Parses a manifest; every path must be absolute without `..` (it was written by install,
    /// but it sits on disk: it is checked like any file).
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| crate::config::json_location(&e))?;
        if m.version != 1 {
            return Err(format!("version {} is not known (expected 1)", m.version));
        }
        let ok = |p: &Path| p.is_absolute() && !p.components().any(|c| matches!(c, std::path::Component::ParentDir));
        let all =
            m.files.iter().map(|f| &f.path).chain(m.links.iter().map(|l| &l.path)).chain(&m.dirs).chain(&m.env_file);
        for p in all {
            if !ok(p) {
                return Err(format!("path {} is not absolute or holds \"..\"", p.display()));
            }
        }
        if m.files.iter().any(|f| f.sha256.len() != 64) {
            return Err("a file entry has no SHA-256".into());
        }
        Ok(m)
    }
}

/// What uninstall does with one recorded file, from what is there now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Removal {
    Remove,
    /// Already gone.
    Gone,
    /// Changed since install wrote it (or replaced by something else): kept, with why.
    Keep(String),
}

pub fn removal(existing: &Existing, recorded: &str) -> Removal {
    match existing {
        Existing::Absent => Removal::Gone,
        Existing::File { sha256 } if sha256 == recorded => Removal::Remove,
        Existing::File { .. } => Removal::Keep("changed since nodeplan install wrote it".into()),
        Existing::Other(kind) => Removal::Keep(format!("is now {kind}")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::settings::Flags;
    use super::*;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const C: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    #[test]
    fn decide_table() {
        let file = |s: &str| Existing::File { sha256: s.into() };
        let refuse = |a: &Action| matches!(a, Action::Refuse(_));
        // (existing, planned, recorded, force) -> expected
        let rows: Vec<(Existing, Option<&str>, bool, Action)> = vec![
            (Existing::Absent, None, false, Action::Create),
            (Existing::Absent, Some(B), false, Action::Create),
            (file(A), None, false, Action::Unchanged),
            (file(A), Some(C), false, Action::Unchanged),
            (file(B), Some(B), false, Action::Replace),
            (file(B), None, true, Action::Replace),
            (file(B), Some(C), true, Action::Replace),
            (Existing::Other("a symlink"), None, true, Action::Replace),
        ];
        for (existing, recorded, force, want) in rows {
            assert_eq!(decide(&existing, A, recorded, force), want, "{existing:?} {recorded:?} {force}");
        }
        assert!(refuse(&decide(&file(B), A, None, false)));
        assert!(refuse(&decide(&file(B), A, Some(C), false)));
        assert!(refuse(&decide(&Existing::Other("a symlink"), A, None, false)));
        assert!(refuse(&decide(&Existing::Other("a FIFO"), A, None, false)));
        assert!(refuse(&decide(&Existing::Other("a directory"), A, None, true)), "a directory never");
    }

    #[test]
    fn removal_table() {
        assert_eq!(removal(&Existing::Absent, A), Removal::Gone);
        assert_eq!(removal(&Existing::File { sha256: A.into() }, A), Removal::Remove);
        assert!(matches!(removal(&Existing::File { sha256: B.into() }, A), Removal::Keep(_)));
        assert!(matches!(removal(&Existing::Other("a symlink"), A), Removal::Keep(_)));
    }

    #[test]
    fn prefix_and_cattle_id() {
        assert_eq!(choose_prefix(None, false), Path::new("/usr/local"));
        assert_eq!(choose_prefix(None, true), Path::new("/opt/nodeplan"));
        assert_eq!(choose_prefix(Some(Path::new("/x")), true), Path::new("/x"));
        let mid = b"0123456789abcdef0123456789abcdef\n";
        // sha256sum of that file, as system-agent's installer computes it.
        let derived = crate::install::sha256_hex(mid);
        assert_eq!(cattle_id(Some("env"), Some(b"kept\n"), Some(mid)), Some(("env".into(), IdOrigin::Env)));
        assert_eq!(cattle_id(None, Some(b"kept\n"), Some(mid)), Some(("kept".into(), IdOrigin::Kept)));
        assert_eq!(cattle_id(None, None, Some(mid)), Some((derived.clone(), IdOrigin::MachineId)));
        assert_eq!(cattle_id(None, Some(b"bad id\r\n"), Some(mid)), Some((derived, IdOrigin::MachineId)));
        assert_eq!(cattle_id(None, None, Some(b"\n")), None);
        assert_eq!(cattle_id(None, None, None), None);
    }

    #[test]
    fn unit_is_rendered_from_the_one_template() {
        let u = render_unit(
            crate::install::UNIT_TEMPLATE,
            Path::new("/opt/nodeplan/bin/nodeplan"),
            Path::new("/c/config.yaml"),
        )
        .unwrap();
        assert!(u.contains("\nExecStart=/opt/nodeplan/bin/nodeplan agent\n"), "{u}");
        assert!(u.contains("\nEnvironment=CATTLE_AGENT_CONFIG=/c/config.yaml\n"), "{u}");
        for needed in [
            "Delegate=yes",
            "KillMode=mixed",
            "Restart=always",
            "RuntimeDirectoryPreserve=yes",
            "EnvironmentFile=-/etc/systemd/system/nodeplan.env",
        ] {
            assert!(u.contains(needed), "{needed}");
        }
        assert_eq!(u.lines().count(), crate::install::UNIT_TEMPLATE.lines().count());
        assert!(render_unit("[Service]\n", Path::new("/b"), Path::new("/c")).is_err());
        assert!(render_unit(crate::install::UNIT_TEMPLATE, Path::new("/a b/nodeplan"), Path::new("/c")).is_err());
    }

    #[test]
    fn env_merge_keeps_the_users_lines() {
        let vars = |v: &[(&str, &str)]| v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let proxy = vars(&[("HTTPS_PROXY", "http://p:3128"), ("NO_PROXY", "10.0.0.0/8")]);
        // Fresh file.
        let m = merge_env(None, &proxy);
        let t = m.text.clone().unwrap();
        assert!(
            t.starts_with(BEGIN) && t.contains("HTTPS_PROXY=\"http://p:3128\"\n") && t.ends_with(&format!("{END}\n")),
            "{t}"
        );
        // The user's own lines (before and after) survive byte for byte; a variable they set is theirs.
        let user = "# mine\nFOO=bar\nexport NO_PROXY=mine\n";
        let m = merge_env(Some(user), &proxy);
        let t = m.text.unwrap();
        assert!(t.ends_with(user), "{t}");
        assert!(t.contains("HTTPS_PROXY=") && !t.contains("NO_PROXY=\"10.0.0.0/8\""), "{t}");
        assert_eq!(m.kept_users, vec!["NO_PROXY".to_string()]);
        // Re-merging replaces the block in place, idempotently.
        let again = merge_env(Some(&t), &proxy).text.unwrap();
        assert_eq!(again, t);
        let changed = merge_env(Some(&t), &vars(&[("HTTPS_PROXY", "http://q")])).text.unwrap();
        assert!(
            changed.contains("HTTPS_PROXY=\"http://q\"")
                && changed.ends_with(user)
                && changed.matches(BEGIN).count() == 1
        );
        // No variables: the block goes, the user's lines stay; nothing left: no file.
        assert_eq!(merge_env(Some(&t), &[]).text.as_deref(), Some(user));
        assert_eq!(merge_env(Some(&merge_env(None, &proxy).text.unwrap()), &[]).text, None);
        assert_eq!(merge_env(None, &[]).text, None);
        // Quotes and backslashes are escaped for systemd.
        let t = merge_env(None, &vars(&[("HTTP_PROXY", "a\"b\\c")])).text.unwrap();
        assert!(t.contains("HTTP_PROXY=\"a\\\"b\\\\c\""), "{t}");
    }

    #[test]
    fn config_and_steps() {
        let env = |k: &str| match k {
            "CATTLE_SERVER" => Some("https://r".to_string()),
            "CATTLE_TOKEN" => Some("t".to_string()),
            "CATTLE_AGENT_VAR_DIR" => Some("/v".to_string()),
            _ => None,
        };
        let s = Settings::resolve(env, &Flags { root: Some("/tree".into()), ..Flags::default() }).unwrap();
        let c = render_config(&s);
        assert!(
            c.contains("remoteEnabled: true\n")
                && c.contains("connectionInfoFile: \"/v/rancher2_connection_info.json\"\n"),
            "{c}"
        );
        assert!(
            c.contains("workDirectory: \"/v/work\"\n") && c.contains("interlockDirectory: \"/v/interlock\"\n"),
            "{c}"
        );
        let steps = steps(Inputs {
            settings: &s,
            prefix: Path::new("/usr/local"),
            binary: b"bin".to_vec(),
            connection: Some(b"{}".to_vec()),
            cattle_id: Some("id".into()),
        })
        .unwrap();
        let files: Vec<(&Path, u32)> = steps
            .iter()
            .filter_map(|s| match s {
                Step::File { path, mode, .. } => Some((path.as_path(), *mode)),
                _ => None,
            })
            .collect();
        assert_eq!(
            files,
            vec![
                (Path::new("/etc/rancher/agent/cattle-id"), 0o600),
                (Path::new("/v/rancher2_connection_info.json"), 0o600),
                (Path::new("/etc/rancher/agent/config.yaml"), 0o600),
                (Path::new("/usr/local/bin/nodeplan"), 0o755),
                (Path::new("/etc/systemd/system/nodeplan.service"), 0o644),
            ]
        );
        assert!(
            steps.iter().any(|s| matches!(s, Step::Link { path, .. } if path == Path::new(crate::install::WANTS_LINK)))
        );
    }

    #[test]
    fn manifest_is_checked() {
        let m = Manifest {
            version: 1,
            files: vec![FileEntry { path: "/a".into(), sha256: A.into() }],
            ..Manifest::default()
        };
        let text = serde_json::to_vec(&m).unwrap();
        assert_eq!(Manifest::parse(&text), Ok(m));
        assert!(Manifest::parse(br#"{"version":1,"files":[{"path":"../x","sha256":"a"}]}"#).is_err());
        assert!(Manifest::parse(br#"{"version":2,"files":[]}"#).is_err());
        assert!(Manifest::parse(b"not json").is_err());
    }
}
