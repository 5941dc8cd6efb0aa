//! Config and connection-info files: formats, defaults, file checks, value errors, validation.
//! Runs as root (the owner tests chown files to another uid).

use nodeplan::config::{
    self, AgentConfig, ConfigError, ConnectionInfo, DEFAULT_CONFIG_PATH, KEYS, MAX_FILE_BYTES, load, load_connection,
    validate,
};
use std::fs;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tempfile::TempDir;

/// Writes `content` to `dir/name` with mode 0600.
fn write(dir: &TempDir, name: &str, content: &str) -> PathBuf {
    write_mode(dir, name, content, 0o600)
}

fn write_mode(dir: &TempDir, name: &str, content: &str, mode: u32) -> PathBuf {
    let p = dir.path().join(name);
    fs::write(&p, content).expect("write test file");
    fs::set_permissions(&p, fs::Permissions::from_mode(mode)).expect("chmod test file");
    p
}

/// The error as text, checked to be one line that names the file.
fn err_line(e: ConfigError, path: &Path) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "not one line: {s}");
    assert!(s.contains(&path.display().to_string()), "does not name {}: {s}", path.display());
    s
}

const FULL_YAML: &str = r#"
workDirectory: /w/work
localEnabled: true
localPlanDirectory: /w/plans
appliedPlanDirectory: /w/applied
remoteEnabled: true
connectionInfoFile: /w/conn.json
nodePlanEnabled: true
nodeName: worker-7
nodePlanStateDirectory: /w/nodeplans
leaseDuration: 1m
rivalCheck: false
preserveWorkDirectory: true
imagesDirectory: /w/images
agentRegistriesFile: /w/registries.yaml
imageCredentialProviderConfig: /w/cp.yaml
imageCredentialProviderBinDirectory: /w/cpbin
imageMaxBytes: 1000
imageMaxEntries: 10
interlockDirectory: /w/interlock
stopTimeout: 30s
killTimeout: 250ms
noKill: true
outputCap: 4096
cgroupRoot: /sys/fs/cgroup/np
pidDirectory: /w/pids
probePeriodSeconds: 7
rescanSeconds: 9
localRetrySeconds: 11
metricsAddress: 127.0.0.1:9100
"#;

const FULL_JSON: &str = r#"{
  "workDirectory": "/w/work",
  "localEnabled": true,
  "localPlanDirectory": "/w/plans",
  "appliedPlanDirectory": "/w/applied",
  "remoteEnabled": true,
  "connectionInfoFile": "/w/conn.json",
  "nodePlanEnabled": true,
  "nodeName": "worker-7",
  "nodePlanStateDirectory": "/w/nodeplans",
  "leaseDuration": "1m",
  "rivalCheck": false,
  "preserveWorkDirectory": true,
  "imagesDirectory": "/w/images",
  "agentRegistriesFile": "/w/registries.yaml",
  "imageCredentialProviderConfig": "/w/cp.yaml",
  "imageCredentialProviderBinDirectory": "/w/cpbin",
  "imageMaxBytes": 1000,
  "imageMaxEntries": 10,
  "interlockDirectory": "/w/interlock",
  "stopTimeout": "30s",
  "killTimeout": "250ms",
  "noKill": true,
  "outputCap": 4096,
  "cgroupRoot": "/sys/fs/cgroup/np",
  "pidDirectory": "/w/pids",
  "probePeriodSeconds": 7,
  "rescanSeconds": 9,
  "localRetrySeconds": 11,
  "metricsAddress": "127.0.0.1:9100"
}"#;

fn full() -> AgentConfig {
    AgentConfig {
        work_directory: "/w/work".into(),
        local_enabled: true,
        local_plan_directory: "/w/plans".into(),
        applied_plan_directory: "/w/applied".into(),
        remote_enabled: true,
        connection_info_file: "/w/conn.json".into(),
        node_plan_enabled: true,
        node_name: "worker-7".into(),
        node_plan_state_directory: "/w/nodeplans".into(),
        lease_duration: Duration::from_secs(60),
        rival_check: false,
        preserve_work_directory: true,
        images_directory: "/w/images".into(),
        agent_registries_file: "/w/registries.yaml".into(),
        image_credential_provider_config: "/w/cp.yaml".into(),
        image_credential_provider_bin_directory: "/w/cpbin".into(),
        image_max_bytes: 1000,
        image_max_entries: 10,
        interlock_directory: "/w/interlock".into(),
        stop_timeout: Duration::from_secs(30),
        kill_timeout: Duration::from_millis(250),
        no_kill: true,
        output_cap: 4096,
        cgroup_root: "/sys/fs/cgroup/np".into(),
        pid_directory: "/w/pids".into(),
        probe_period_seconds: 7,
        rescan_seconds: 9,
        local_retry_seconds: 11,
        metrics_address: "127.0.0.1:9100".into(),
        unknown_keys: vec![],
    }
}

#[test]
fn every_key_in_yaml_and_json() {
    let dir = TempDir::new().unwrap();
    for (name, text) in [("config.yaml", FULL_YAML), ("config.json", FULL_JSON)] {
        let p = write(&dir, name, text);
        let c = load(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c, full(), "{name}");
        assert_ne!(c, AgentConfig::default(), "{name}: every key differs from its default");
    }
    // Every key of the full files is a known key, and every known key is in them.
    for k in KEYS {
        assert!(FULL_YAML.contains(&format!("\n{k}:")), "{k} missing from FULL_YAML");
        assert!(FULL_JSON.contains(&format!("\"{k}\":")), "{k} missing from FULL_JSON");
    }
}

#[test]
fn absent_keys_take_the_defaults() {
    let dir = TempDir::new().unwrap();
    let remote_only = AgentConfig { remote_enabled: true, ..AgentConfig::default() };
    let rows: &[(&str, &str, &AgentConfig)] = &[
        ("empty.yaml", "", &AgentConfig::default()),
        ("comment.yaml", "# nothing\n", &AgentConfig::default()),
        ("null.json", "null", &AgentConfig::default()),
        ("empty.json", "{}", &AgentConfig::default()),
        ("remote.yaml", "remoteEnabled: true\n", &remote_only),
        ("remote.json", r#"{"remoteEnabled": true}"#, &remote_only),
        // null (or a YAML key without a value) is the same as absent, as with Go's decoder.
        ("nulls.yaml", "remoteEnabled: true\nworkDirectory:\nstopTimeout: null\n", &remote_only),
    ];
    for (name, text, want) in rows {
        let c = load(&write(&dir, name, text)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(&c, *want, "{name}");
    }
    let d = AgentConfig::default();
    assert_eq!(d.work_directory, Path::new("/var/lib/rancher/agent/work"));
    assert_eq!(d.local_plan_directory, Path::new("/var/lib/rancher/agent/plans"));
    assert_eq!(d.applied_plan_directory, Path::new("/var/lib/rancher/agent/applied"));
    assert_eq!(d.interlock_directory, Path::new("/var/lib/rancher/agent/interlock"));
    assert_eq!(d.connection_info_file, Path::new("/var/lib/rancher/agent/rancher2_connection_info.json"));
    assert_eq!(d.images_directory, Path::new("/var/lib/rancher/agent/images"));
    assert_eq!(d.pid_directory, Path::new("/run/nodeplan/pids"));
    assert_eq!((d.stop_timeout, d.kill_timeout), (Duration::from_secs(10), Duration::from_secs(5)));
    assert_eq!((d.no_kill, d.output_cap, d.cgroup_root.as_str()), (false, 65536, "auto"));
    assert_eq!((d.probe_period_seconds, d.rescan_seconds), (5, 5));
    assert_eq!((d.local_enabled, d.remote_enabled, d.preserve_work_directory), (false, false, false));
}

#[test]
fn what_install_sh_writes_loads_and_validates() {
    let dir = TempDir::new().unwrap();
    let conn = write(&dir, "rancher2_connection_info.json", r#"{"kubeConfig":"k","namespace":"n","secretName":"s"}"#);
    let text = format!(
        "workDirectory: /var/lib/rancher/agent/work\nlocalEnabled: false\nlocalPlanDirectory: /var/lib/rancher/agent/plans\n\
         remoteEnabled: true\nappliedPlanDirectory: /var/lib/rancher/agent/applied\npreserveWorkDirectory: false\n\
         connectionInfoFile: {}\ninterlockDirectory: /var/lib/rancher/agent/interlock\n",
        conn.display()
    );
    let c = load(&write(&dir, "config.yaml", &text)).unwrap();
    assert_eq!(c, AgentConfig { remote_enabled: true, connection_info_file: conn, ..AgentConfig::default() });
    assert_eq!(validate(&c).unwrap(), Vec::<String>::new());
}

#[test]
fn unknown_keys_are_ignored_and_warned_about() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "config.yaml", "remoteEnabled: true\nfoo: 1\nnested: {a: [1, 2]}\nlocalEnable: true\n");
    let c = load(&p).unwrap();
    assert!(c.remote_enabled && !c.local_enabled);
    assert_eq!(c.unknown_keys, ["foo", "localEnable", "nested"]);
    let w = validate(&AgentConfig { connection_info_file: p.clone(), ..c }).unwrap();
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(w.iter().any(|w| w.contains("\"localEnable\"")), "{w:?}");
    let j = write(&dir, "config.json", r#"{"remoteEnabled": true, "extra": {"x": null}}"#);
    assert_eq!(load(&j).unwrap().unknown_keys, ["extra"]);
}

#[test]
fn keys_match_case_insensitively_like_go() {
    let dir = TempDir::new().unwrap();
    let c = load(&write(&dir, "config.yaml", "LocalEnabled: true\nSTOPTIMEOUT: 1s\nworkdirectory: /x\n")).unwrap();
    assert!(c.local_enabled);
    assert_eq!(c.stop_timeout, Duration::from_secs(1));
    assert_eq!(c.work_directory, Path::new("/x"));
    assert!(c.unknown_keys.is_empty());
    // The exact spelling wins over another case.
    let c = load(&write(&dir, "c.json", r#"{"WORKDIRECTORY": "/upper", "workDirectory": "/exact"}"#)).unwrap();
    assert_eq!(c.work_directory, Path::new("/exact"));
}

#[test]
fn format_is_chosen_by_the_name_containing_json_or_yaml() {
    let dir = TempDir::new().unwrap();
    // JSON content, JSON decoder.
    for name in ["agent.json.conf", "config.json", "x.json.yaml", "a.jsonl"] {
        let c = load(&write(&dir, name, r#"{"localEnabled": true}"#)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(c.local_enabled, "{name}");
    }
    // YAML-only content under a name containing ".json" goes to the JSON decoder and fails.
    for name in ["agent.json.conf", "x.json.yaml"] {
        let p = write(&dir, name, "localEnabled: true\n");
        let e = err_line(load(&p).unwrap_err(), &p);
        assert!(e.contains("invalid JSON"), "{name}: {e}");
    }
    for name in ["agent.yaml.conf", "config.yaml", "config.yaml.d"] {
        let c = load(&write(&dir, name, "localEnabled: true\n")).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(c.local_enabled, "{name}");
    }
    for name in ["config.yml", "config", "config.YAML", "config.toml", "yaml", "json"] {
        let p = write(&dir, name, "localEnabled: true\n");
        let e = load(&p).unwrap_err();
        assert!(matches!(e, ConfigError::Format { .. }), "{name}: {e:?}");
        let e = err_line(e, &p);
        assert!(e.contains(".json") && e.contains(".yaml") && e.contains(".yml"), "{e}");
    }
    // Only the file name counts, not the directories.
    let sub = dir.path().join("d.yaml");
    fs::create_dir(&sub).unwrap();
    let p = sub.join("config");
    fs::write(&p, "localEnabled: true\n").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
    assert!(matches!(load(&p), Err(ConfigError::Format { .. })));
}

#[test]
fn mode_must_be_exactly_0600() {
    let dir = TempDir::new().unwrap();
    let ok = write_mode(&dir, "ok.yaml", "localEnabled: true\n", 0o600);
    assert!(load(&ok).unwrap().local_enabled);
    for mode in [0o644, 0o640, 0o400, 0o700, 0o666, 0o4600, 0o1600] {
        let p = write_mode(&dir, &format!("m{mode:o}.yaml"), "localEnabled: true\n", mode);
        let e = load(&p).unwrap_err();
        assert!(matches!(e, ConfigError::Mode { found, .. } if found == mode), "{mode:o}: {e:?}");
        let e = err_line(e, &p);
        assert!(e.contains(&format!("{mode:04o}")) && e.contains("0600"), "{e}");
    }
}

#[test]
fn owner_must_be_the_effective_uid_and_gid() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "config.yaml", "localEnabled: true\n");
    chown(&p, Some(1234), None).expect("chown (tests run as root)");
    let e = load(&p).unwrap_err();
    assert!(matches!(e, ConfigError::Owner { uid: 1234, .. }), "{e:?}");
    let e = err_line(e, &p);
    assert!(e.contains("uid 1234") && e.contains("expected uid 0 gid 0"), "{e}");

    let p = write(&dir, "gid.yaml", "localEnabled: true\n");
    chown(&p, None, Some(1234)).unwrap();
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("gid 1234"), "{e}");

    let p = write(&dir, "conn.json", r#"{"kubeConfig":"k","namespace":"n","secretName":"s"}"#);
    chown(&p, Some(1234), Some(1234)).unwrap();
    assert!(matches!(load_connection(&p), Err(ConfigError::Owner { .. })));
}

#[test]
fn missing_and_odd_files() {
    let dir = TempDir::new().unwrap();
    let p = dir.path().join("absent.yaml");
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("does not exist"), "{e}");
    let p = dir.path().join("absent.json");
    let e = err_line(load_connection(&p).unwrap_err(), &p);
    assert!(e.contains("connection info file") && e.contains("install.sh"), "{e}");
    assert!(matches!(load(Path::new("")), Err(ConfigError::EmptyPath { .. })));

    let d = dir.path().join("dir.yaml");
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o600)).unwrap();
    assert!(matches!(load(&d), Err(ConfigError::NotAFile { .. })));

    // A FIFO is refused without blocking on the open.
    let f = dir.path().join("fifo.yaml");
    let c = std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert!(matches!(load(&f), Err(ConfigError::NotAFile { .. })));

    let big = write(&dir, "big.yaml", &format!("# {}\n", "x".repeat(MAX_FILE_BYTES as usize)));
    let e = err_line(load(&big).unwrap_err(), &big);
    assert!(e.contains("larger than"), "{e}");
}

#[test]
fn wrong_value_types_name_the_key() {
    let dir = TempDir::new().unwrap();
    let rows = [
        ("localEnabled: \"yes\"", "localEnabled", "expected true or false, found the string \"yes\""),
        ("localEnabled: yes", "localEnabled", "YAML 1.1"),
        ("remoteEnabled: 1", "remoteEnabled", "found the number 1"),
        ("preserveWorkDirectory: [true]", "preserveWorkDirectory", "found a list"),
        ("noKill: {a: 1}", "noKill", "found a mapping"),
        ("workDirectory: 5", "workDirectory", "expected a string"),
        ("connectionInfoFile: true", "connectionInfoFile", "expected a string"),
        ("cgroupRoot: [a]", "cgroupRoot", "expected a string"),
        ("outputCap: \"64k\"", "outputCap", "whole number"),
        ("outputCap: -1", "outputCap", "whole number"),
        ("probePeriodSeconds: 1.5", "probePeriodSeconds", "whole number"),
        ("rescanSeconds: \"5\"", "rescanSeconds", "whole number"),
        ("stopTimeout: true", "stopTimeout", "expected a duration"),
        ("killTimeout: -3", "killTimeout", "duration"),
        ("stopTimeout: ten", "stopTimeout", "not a duration"),
    ];
    for (line, key, expected) in rows {
        let p = write(&dir, "config.yaml", &format!("{line}\n"));
        let e = load(&p).unwrap_err();
        assert!(matches!(&e, ConfigError::Value { key: k, .. } if *k == key), "{line}: {e:?}");
        let e = err_line(e, &p);
        assert!(e.contains(&format!(": {key}: ")) && e.contains(expected), "{line}: {e}");
    }
    let p = write(&dir, "config.json", r#"{"localEnabled": "true"}"#);
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("localEnabled") && e.contains("expected true or false"), "{e}");
}

#[test]
fn durations_in_the_file() {
    let dir = TempDir::new().unwrap();
    let rows = [
        ("\"10s\"", Duration::from_secs(10)),
        ("\"250ms\"", Duration::from_millis(250)),
        ("\"5m\"", Duration::from_secs(300)),
        ("\"1h\"", Duration::from_secs(3600)),
        ("\"1.5s\"", Duration::from_millis(1500)),
        ("7", Duration::from_secs(7)),
        ("\"7\"", Duration::from_secs(7)),
        ("0.5", Duration::from_millis(500)),
    ];
    for (v, want) in rows {
        for (name, text) in [
            ("config.yaml", format!("stopTimeout: {v}\nkillTimeout: {v}\n")),
            ("config.json", format!(r#"{{"stopTimeout": {v}, "killTimeout": {v}}}"#)),
        ] {
            let c = load(&write(&dir, name, &text)).unwrap_or_else(|e| panic!("{name} {v}: {e}"));
            assert_eq!((c.stop_timeout, c.kill_timeout), (want, want), "{name} {v}");
        }
    }
    for v in ["\"ten\"", "\"5d\"", "\"-5s\"", "\"\"", "-1", "true"] {
        let p = write(&dir, "config.json", &format!(r#"{{"killTimeout": {v}}}"#));
        let e = err_line(load(&p).unwrap_err(), &p);
        assert!(e.contains("killTimeout"), "{v}: {e}");
    }
}

#[test]
fn malformed_files_give_one_line_with_the_position() {
    let dir = TempDir::new().unwrap();
    let rows = [
        ("bad.yaml", "localEnabled: true\n  remoteEnabled: [\n", "invalid YAML"),
        ("tab.yaml", "a:\n\t- b\n", "invalid YAML"),
        ("bad.json", "{\"localEnabled\": true,\n}", "invalid JSON"),
        ("trunc.json", "{\"localEnabled\": ", "invalid JSON"),
        ("empty.json", "", "invalid JSON"),
    ];
    for (name, text, want) in rows {
        let p = write(&dir, name, text);
        let e = load(&p).unwrap_err();
        assert!(matches!(e, ConfigError::Parse { .. }), "{name}: {e:?}");
        let e = err_line(e, &p);
        assert!(e.contains(want) && e.contains("line"), "{name}: {e}");
    }
    let p = write(&dir, "inf.yaml", "stopTimeout: .inf\n");
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("infinite or NaN"), "{e}");
    for (name, text) in [("list.yaml", "- a\n- b\n"), ("scalar.json", "42"), ("str.yaml", "hello\n")] {
        let p = write(&dir, name, text);
        let e = err_line(load(&p).unwrap_err(), &p);
        assert!(e.contains("expected a mapping"), "{name}: {e}");
    }
    // A repeated key: an error (no position from the parser here).
    let p = write(&dir, "dup.yaml", "localEnabled: true\nlocalEnabled: false\n");
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("invalid YAML") && e.contains("duplicate") && e.contains("localEnabled"), "{e}");
    let p = write(&dir, "bin.yaml", "");
    fs::write(&p, b"a: \xff\xfe\n").unwrap();
    let e = err_line(load(&p).unwrap_err(), &p);
    assert!(e.contains("UTF-8"), "{e}");
}

#[test]
fn yaml_merge_keys_and_anchors() {
    let dir = TempDir::new().unwrap();
    let text = "base: &b\n  localEnabled: true\n  stopTimeout: 3s\n<<: *b\nremoteEnabled: true\n";
    let c = load(&write(&dir, "config.yaml", text)).unwrap();
    assert!(c.local_enabled && c.remote_enabled);
    assert_eq!(c.stop_timeout, Duration::from_secs(3));
}

#[test]
fn empty_strings() {
    let dir = TempDir::new().unwrap();
    let text = "remoteEnabled: true\nappliedPlanDirectory: \"\"\ninterlockDirectory: \"\"\nimagesDirectory: \"\"\n\
                agentRegistriesFile: \"\"\nimageCredentialProviderConfig: \"\"\nimageCredentialProviderBinDirectory: \"\"\n";
    let c = load(&write(&dir, "config.yaml", text)).unwrap();
    let d = AgentConfig::default();
    // Empty means "disabled" for the archive and the interlock (system-agent's meaning)...
    assert_eq!(c.applied_plan_directory, Path::new(""));
    assert_eq!(c.interlock_directory, Path::new(""));
    // ...and "the default" for the image keys (system-agent's image code does the same).
    assert_eq!(c.images_directory, d.images_directory);
    assert_eq!(c.agent_registries_file, d.agent_registries_file);
    assert_eq!(c.image_credential_provider_config, d.image_credential_provider_config);
    assert_eq!(c.image_credential_provider_bin_directory, d.image_credential_provider_bin_directory);
}

fn problems(c: &AgentConfig) -> String {
    let e = validate(c).expect_err("invalid");
    assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
    let s = e.to_string();
    assert!(!s.contains('\n'), "{s}");
    s
}

#[test]
fn validate_rules() {
    let dir = TempDir::new().unwrap();
    let plans = dir.path().join("plans");
    fs::create_dir(&plans).unwrap();
    let conn = write(&dir, "conn.json", "{}");
    let local = AgentConfig { local_enabled: true, local_plan_directory: plans.clone(), ..AgentConfig::default() };
    let remote = AgentConfig { remote_enabled: true, connection_info_file: conn.clone(), ..AgentConfig::default() };
    assert_eq!(validate(&local).unwrap(), Vec::<String>::new());
    assert_eq!(validate(&remote).unwrap(), Vec::<String>::new());
    let both = AgentConfig { remote_enabled: true, connection_info_file: conn.clone(), ..local.clone() };
    assert_eq!(validate(&both).unwrap(), Vec::<String>::new());

    let e = problems(&AgentConfig::default());
    assert!(e.contains("localEnabled") && e.contains("remoteEnabled"), "{e}");
    let e = problems(&AgentConfig { connection_info_file: "".into(), ..remote.clone() });
    assert!(e.contains("connectionInfoFile"), "{e}");
    let e = problems(&AgentConfig { local_plan_directory: "".into(), ..local.clone() });
    assert!(e.contains("localPlanDirectory"), "{e}");

    let rows: Vec<(AgentConfig, &str)> = vec![
        (AgentConfig { cgroup_root: "relative/dir".into(), ..local.clone() }, "cgroupRoot"),
        (AgentConfig { cgroup_root: "".into(), ..local.clone() }, "cgroupRoot"),
        (AgentConfig { stop_timeout: Duration::ZERO, ..local.clone() }, "stopTimeout"),
        (AgentConfig { kill_timeout: Duration::ZERO, ..local.clone() }, "killTimeout"),
        (AgentConfig { probe_period_seconds: 0, ..local.clone() }, "probePeriodSeconds"),
        (AgentConfig { rescan_seconds: 0, ..local.clone() }, "rescanSeconds"),
        (AgentConfig { output_cap: 1023, ..local.clone() }, "outputCap"),
        (AgentConfig { work_directory: "".into(), ..local.clone() }, "workDirectory"),
        (AgentConfig { pid_directory: "".into(), ..local.clone() }, "pidDirectory"),
        (AgentConfig { lease_duration: Duration::from_secs(3), ..local.clone() }, "leaseDuration"),
        (AgentConfig { lease_duration: Duration::from_secs(3601), ..local.clone() }, "leaseDuration"),
    ];
    for (c, key) in rows {
        let e = problems(&c);
        assert!(e.contains(key), "{key}: {e}");
    }
    assert!(validate(&AgentConfig { output_cap: 1024, cgroup_root: "off".into(), ..local.clone() }).is_ok());
    assert!(validate(&AgentConfig { cgroup_root: "/sys/fs/cgroup/x".into(), ..local.clone() }).is_ok());
    for ok in [0, 4, 3600] {
        assert!(validate(&AgentConfig { lease_duration: Duration::from_secs(ok), ..local.clone() }).is_ok(), "{ok}");
    }

    // Every problem is in the one error.
    let e = problems(&AgentConfig { output_cap: 10, stop_timeout: Duration::ZERO, ..AgentConfig::default() });
    assert!(e.contains("outputCap") && e.contains("stopTimeout") && e.contains("remoteEnabled"), "{e}");
}

#[test]
fn validate_warnings_only() {
    let dir = TempDir::new().unwrap();
    let missing = dir.path().join("no-such-plans");
    let c = AgentConfig { local_enabled: true, local_plan_directory: missing.clone(), ..AgentConfig::default() };
    let w = validate(&c).expect("a missing plan directory is only a warning");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("localPlanDirectory") && w[0].contains(&missing.display().to_string()), "{w:?}");

    let file = write(&dir, "plans", "");
    let w = validate(&AgentConfig { local_plan_directory: file, ..c.clone() }).unwrap();
    assert!(w[0].contains("not a directory"), "{w:?}");

    // Remote mode with a connection file that is not there (yet): a warning.
    let c =
        AgentConfig { remote_enabled: true, connection_info_file: missing.join("c.json"), ..AgentConfig::default() };
    let w = validate(&c).unwrap();
    assert!(w.len() == 1 && w[0].contains("connectionInfoFile"), "{w:?}");

    // Relative paths: warnings.
    let c = AgentConfig {
        local_enabled: true,
        local_plan_directory: dir.path().into(),
        work_directory: "work".into(),
        ..AgentConfig::default()
    };
    let w = validate(&c).unwrap();
    assert!(w.len() == 1 && w[0].contains("workDirectory") && w[0].contains("relative"), "{w:?}");
}

#[test]
fn config_path_precedence() {
    let env = |pairs: Vec<(&'static str, &'static str)>| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| std::ffi::OsString::from(v))
    };
    let all = vec![("NODEPLAN_CONFIG", "/np.yaml"), ("CATTLE_AGENT_CONFIG", "/cattle.yaml")];
    assert_eq!(config::config_path_from(Some(Path::new("/flag.yaml")), env(all.clone())), Path::new("/flag.yaml"));
    assert_eq!(config::config_path_from(None, env(all)), Path::new("/np.yaml"));
    assert_eq!(
        config::config_path_from(None, env(vec![("CATTLE_AGENT_CONFIG", "/cattle.yaml")])),
        Path::new("/cattle.yaml")
    );
    assert_eq!(config::config_path_from(None, env(vec![])), Path::new(DEFAULT_CONFIG_PATH));
    assert_eq!(DEFAULT_CONFIG_PATH, "/etc/rancher/agent/config.yaml");
    // The real environment: the flag still wins.
    assert_eq!(config::config_path(Some(Path::new("/f.json"))), Path::new("/f.json"));
}

#[test]
fn connection_info() {
    let dir = TempDir::new().unwrap();
    let good = r#"{"kubeConfig": "apiVersion: v1\nkind: Config\n", "namespace": "fleet-default", "secretName": "custom-1-machine-plan", "extra": 1}"#;
    let p = write(&dir, "rancher2_connection_info.json", good);
    let c = load_connection(&p).unwrap();
    assert_eq!(
        c,
        ConnectionInfo {
            kube_config: "apiVersion: v1\nkind: Config\n".into(),
            namespace: "fleet-default".into(),
            secret_name: "custom-1-machine-plan".into(),
        }
    );
    // The serde form uses the same keys.
    let back: ConnectionInfo = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
    assert!(serde_json::to_string(&c).unwrap().contains("\"secretName\""));

    let y = write(&dir, "conn.yaml", "kubeConfig: k\nnamespace: n\nsecretName: s\n");
    assert_eq!(load_connection(&y).unwrap().secret_name, "s");

    for key in ["kubeConfig", "namespace", "secretName"] {
        let mut v: serde_json::Value = serde_json::from_str(good).unwrap();
        v.as_object_mut().unwrap().remove(key);
        let p = write(&dir, "missing.json", &v.to_string());
        let e = load_connection(&p).unwrap_err();
        assert!(matches!(e, ConfigError::Missing { key: k, .. } if k == key), "{key}: {e:?}");
        let e = err_line(e, &p);
        assert!(e.contains(key), "{e}");

        v[key] = "".into();
        let p = write(&dir, "empty.json", &v.to_string());
        let e = err_line(load_connection(&p).unwrap_err(), &p);
        assert!(e.contains(key) && e.contains("empty"), "{e}");

        v[key] = serde_json::Value::Null;
        let p = write(&dir, "null.json", &v.to_string());
        assert!(matches!(load_connection(&p), Err(ConfigError::Missing { .. })), "{key}");

        v[key] = serde_json::json!({"token": "s3cret"});
        let p = write(&dir, "type.json", &v.to_string());
        let e = err_line(load_connection(&p).unwrap_err(), &p);
        assert!(e.contains(key) && e.contains("expected a string") && !e.contains("s3cret"), "{e}");
    }
    let p = write_mode(&dir, "open.json", good, 0o644);
    assert!(matches!(load_connection(&p), Err(ConfigError::Mode { found: 0o644, .. })));
    let p = write(&dir, "conn.yml", "kubeConfig: k\nnamespace: n\nsecretName: s\n");
    assert!(matches!(load_connection(&p), Err(ConfigError::Format { .. })));
    let p = write(&dir, "bad.json", "{\"kubeConfig\": ");
    assert!(matches!(load_connection(&p), Err(ConfigError::Parse { .. })));
}

/// docs/local-mode.md (or, in the development crate, CONFIG.md) shows exactly the table the code has.
/// A malformed `metricsAddress` is one problem line naming the key and the value; a number is a
/// wrong type; empty means off.
#[test]
fn metrics_address_values() {
    let dir = TempDir::new().unwrap();
    let base = format!("localEnabled: true\nlocalPlanDirectory: {}\n", dir.path().display());
    for bad in ["localhost:9100", "9100x", ":0", "127.0.0.1:99999", "[::1]"] {
        let p = write(&dir, "config.yaml", &format!("{base}metricsAddress: \"{bad}\"\n"));
        let c = load(&p).unwrap();
        let e = validate(&c).expect_err(bad).to_string();
        assert!(e.contains("metricsAddress") && e.contains(bad) && !e.contains('\n'), "{e}");
    }
    let p = write(&dir, "config.yaml", &format!("{base}metricsAddress: 9100\n"));
    let e = err_line(load(&p).expect_err("a number"), &p);
    assert!(e.contains("metricsAddress: expected a string"), "{e}");
    let p = write(&dir, "config.yaml", &format!("{base}metricsAddress: \"\"\n"));
    let c = load(&p).unwrap();
    assert!(validate(&c).is_ok());
    assert_eq!(c.metrics_address().unwrap(), None);
}

#[test]
fn docs_show_the_defaults_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let table = config::defaults_markdown();
    let docs: Vec<PathBuf> =
        ["README.md", "CONFIG.md", "docs/local-mode.md"].iter().map(|n| root.join(n)).filter(|p| p.exists()).collect();
    assert!(!docs.is_empty(), "neither README.md nor CONFIG.md in {}", root.display());
    let found = docs.iter().any(|p| fs::read_to_string(p).is_ok_and(|t| t.contains(&table)));
    assert!(found, "{docs:?} do not contain the current defaults table; paste this:\n{table}");
}

/// A kubeconfig with a token and a YAML syntax error: the error (and `nodeplan validate-connection`)
/// names the file, `kubeConfig`, the line and the column, never the text.
#[test]
fn a_broken_kubeconfig_is_reported_by_position_never_by_content() {
    let dir = TempDir::new().unwrap();
    let token = "eyJhbGciOi.S3CRET-T0KEN-VALUE";
    let kubeconfig = format!(
        "apiVersion: v1\nclusters:\n- cluster:\n    server: https://10.0.0.1:6443\n  name: c\nusers:\n- name: u\n  user:\n    token: {token}\n   bad: [\"{token}\"\n"
    );
    let conn = serde_json::json!({"kubeConfig": kubeconfig, "namespace": "n", "secretName": "s"});
    let p = write(&dir, "conn.json", &conn.to_string());
    let e = err_line(load_connection(&p).unwrap_err(), &p);
    assert!(!e.contains("S3CRET") && !e.contains("eyJhbG"), "{e}");
    assert!(e.contains("kubeConfig") && e.contains("line 10") && e.contains("column"), "{e}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
        .args(["validate-connection", p.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("S3CRET") && !stderr.contains("eyJhbG"), "{stderr}");
    assert!(
        stderr.contains(&p.display().to_string()) && stderr.contains("line 10") && stderr.contains("column"),
        "{stderr}"
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

/// A connection-info file in YAML whose parser error would quote a value gives the position only.
#[test]
fn connection_info_parse_errors_never_quote_the_text() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "conn.yaml", "kubeConfig: \"S3CRET\"\nkubeConfig: \"S3CRET\"\nnamespace: [\n");
    let e = err_line(load_connection(&p).unwrap_err(), &p);
    assert!(!e.contains("S3CRET") && e.contains("line"), "{e}");
}

/// `validate-connection` turns the kubeconfig into a client exactly as the agent's start does: a
/// well-formed YAML the agent cannot use (a missing context, TLS verification switched off) is
/// not called valid.
#[test]
fn validate_connection_checks_the_kubeconfig_as_the_agent_will() {
    let dir = TempDir::new().unwrap();
    let kubeconfig = |extra: &str, context: &str| {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: https://10.0.0.1:6443\n{extra}  name: c\n\
             contexts:\n- context:\n    cluster: c\n    user: u\n  name: ctx\ncurrent-context: {context}\n\
             users:\n- name: u\n  user:\n    token: abc\n"
        )
    };
    let run = |name: &str, kc: String| {
        let conn = serde_json::json!({"kubeConfig": kc, "namespace": "n", "secretName": "s"});
        let p = write(&dir, name, &conn.to_string());
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
            .args(["validate-connection", p.to_str().unwrap()])
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    assert_eq!(run("ok.json", kubeconfig("", "ctx")).0, Some(0));
    let (code, err) = run("nocontext.json", kubeconfig("", "elsewhere"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("nocontext.json: kubeConfig: kubeconfig:") && err.contains("elsewhere"), "{err}");
    let (code, err) = run("insecure.json", kubeconfig("    insecure-skip-tls-verify: true\n", "ctx"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("insecure-skip-tls-verify is not supported"), "{err}");
}

/// A duration the user wrote is shown back exactly in the one error line (issue 23, item 11): in
/// integer arithmetic, never through a float (which showed 2147483646.999999999 s as `2147483647s`,
/// and others as `2147483646.9999971s`).
#[test]
fn a_duration_in_an_error_is_shown_as_written() {
    let dir = TempDir::new().unwrap();
    let p = write(&dir, "config.yaml", "localEnabled: true\nleaseDuration: 2147483646.999999999s\n");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
        .args(["validate-config", p.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("leaseDuration must be 0 (no Lease) or between 4s and 3600s, found 2147483646.999999999s"),
        "{stderr}"
    );
}

/// Issue 43: `validate-config` checks what the agent's start checks. A remote config whose
/// connection-info file is missing (or unreadable as one) is invalid (exit 1, the file named): the
/// agent would exit 2 on it, a crash loop under `Restart=always`.
#[test]
fn validate_config_refuses_a_remote_config_whose_connection_info_the_agent_could_not_read() {
    let dir = TempDir::new().unwrap();
    let missing = dir.path().join("absent.json");
    let run = |config: &Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
            .args(["validate-config", config.to_str().unwrap()])
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let cfg = write(&dir, "config.yaml", &format!("remoteEnabled: true\nconnectionInfoFile: {}\n", missing.display()));
    let (code, err) = run(&cfg);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("Validation failed") && err.contains("absent.json"), "{err}");
    // Present but not a connection-info file: refused the same way.
    write(&dir, "absent.json", "{}");
    let (code, err) = run(&cfg);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kubeConfig"), "{err}");
}
