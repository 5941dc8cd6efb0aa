//! Bad input never panics and always gives one line: a deterministic mutation fuzzer over every
//! parser that reads something a user or another program wrote (plans, `.pos` files, PID records,
//! checkpoints, output codecs, timestamps, annotation values, config and connection files).

use nodeplan::local::pos::parse_pos;
use nodeplan::plan::failure::{Failure, Mask};
use nodeplan::plan::{self, Annotations, Checkpoint};
use nodeplan::process::PidRecord;
use std::os::unix::fs::PermissionsExt;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn word(&mut self, alphabet: &[u8], len: usize) -> String {
        (0..len).map(|_| alphabet[self.below(alphabet.len())] as char).collect()
    }
}

const INTERESTING: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"null",
    b"-1",
    b"1e999",
    b"\"\\u0000\"",
    b"\xff\xfe",
    b"99999999999999999999",
    b"true",
    b"\"0999\"",
    b"\"../\"",
    b"\n",
    b"\\",
    b"0x",
    b"\t",
    b"!!binary",
    b"&a *a",
    b"- ",
    b"~",
];

/// One random mutation: flip, delete, insert or duplicate a span, or splice an interesting token.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..=rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let end = (at + rng.below(8)).min(v.len());
                v.drain(at.min(end)..end);
            }
            2 => {
                let tok = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(at..at, tok.iter().copied());
            }
            3 if !v.is_empty() => {
                let start = rng.below(v.len());
                let end = (start + rng.below(16)).min(v.len());
                let span = v[start..end].to_vec();
                v.splice(at..at, span);
            }
            _ => v.truncate(at),
        }
    }
    v
}

fn one_line(e: &str, what: &str, input: &[u8]) {
    assert!(!e.contains('\n'), "{what}: a multi-line error for {:?}: {e:?}", String::from_utf8_lossy(input));
    assert!(!e.is_empty(), "{what}: an empty error");
}

const ROUNDS: usize = 3000;

fn fuzz(seeds: &[&[u8]], what: &str, mut check: impl FnMut(&[u8])) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ what.len() as u64);
    for seed in seeds {
        check(seed);
        for _ in 0..ROUNDS {
            let input = mutate(&mut rng, seed);
            check(&input);
        }
    }
}

#[test]
fn plans() {
    let seeds: &[&[u8]] = &[
        br#"{"files":[{"path":"/etc/x","content":"aGk=","permissions":"0644","uid":1}],"instructions":[{"name":"a","command":"sh","args":["-c","true"],"env":["A=1"],"saveOutput":true,"timeoutSeconds":5}],"periodicInstructions":[{"name":"p","command":"true","periodSeconds":60}],"probes":{"k":{"httpGet":{"url":"http://127.0.0.1/"}}}}"#,
        br#"{"files":[{"path":"/d","directory":true},{"path":"/x","action":"delete"}]}"#,
    ];
    let mut ok = 0;
    fuzz(seeds, "plan", |input| match plan::parse(input) {
        Ok(v) => {
            ok += 1;
            assert_eq!(v.files.len(), v.plan.files.len());
        }
        Err(e) => one_line(&e.to_string(), "plan", input),
    });
    assert!(ok > 0, "some mutations stay valid");
}

#[test]
fn pos_files() {
    let seeds: &[&[u8]] = &[br#"{"appliedChecksum":"abc","output":"H4sI","probeStatus":{"p":{"healthy":true,"successCount":1}},"planState":"paused","checkpoint":{"checksum":"abc","completedInstructions":1,"totalInstructions":3,"paused":true},"failureCount":2}"#];
    fuzz(seeds, "pos", |input| {
        if let Err(e) = parse_pos(input) {
            one_line(&e, "pos", input);
        }
    });
}

#[test]
fn pid_records() {
    let seeds: &[&[u8]] = &[
        br#"{"pid":123,"startTime":456,"bootId":"0b0e-1","cgroup":"/sys/fs/cgroup/np/m","marker":"np1-2-3","owner":"local:/p.plan:0","command":"sh"}"#,
        b"{\"pid\":0,\"startTime\":0,\"bootId\":\"b\",\"marker\":\"np1-2-4\",\"owner\":\"o\",\"command\":\"sh\"}\n{\"pid\":77,\"startTime\":9}\n",
    ];
    fuzz(seeds, "pid record", |input| {
        if let Err(e) = PidRecord::parse(input) {
            one_line(&e, "pid record", input);
        }
    });
}

#[test]
fn checkpoints_codecs_dates_and_annotations() {
    let cp = br#"{"checksum":"c","completedInstructions":1,"totalInstructions":3,"resumeState":"in-progress","paused":true}"#;
    fuzz(&[cp], "checkpoint", |input| {
        if let Some(c) = Checkpoint::read(Some(input), "c") {
            assert_eq!(c.checksum, "c");
        }
    });
    let out = plan::encode_one_time_output(&[("a".to_string(), b"x".to_vec())].into_iter().collect());
    fuzz(&[&out], "one-time output", |input| {
        if let Err(e) = plan::decode_one_time_output(input) {
            one_line(&e.to_string(), "output", input);
        }
    });
    let periodic = plan::encode_periodic_output(&Default::default());
    fuzz(&[&periodic], "periodic output", |input| {
        if let Err(e) = plan::decode_periodic_output(input) {
            one_line(&e.to_string(), "periodic", input);
        }
    });
    fuzz(&[b"Mon Nov 30 05:29:24 UTC 2026"], "date", |input| {
        let _ = plan::parse_unix_date(&String::from_utf8_lossy(input));
    });
    fuzz(&[b"true", b"false"], "annotation", |input| {
        let v = String::from_utf8_lossy(input).into_owned();
        if let Err(e) = plan::resolve_annotations(&Annotations { paused: Some(&v), canceled: None }) {
            one_line(&e.to_string(), "annotation", input);
        }
    });
}

#[test]
fn config_and_connection_files() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = b"localEnabled: true\nlocalPlanDirectory: /p\nstopTimeout: 10s\noutputCap: 4096\ncgroupRoot: auto\n";
    let json = br#"{"kubeConfig":"apiVersion: v1","namespace":"n","secretName":"s"}"#;
    let write = |name: &str, input: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, input).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    };
    let mut rng = Rng(7);
    for _ in 0..600 {
        let y = mutate(&mut rng, yaml);
        if let Err(e) =
            nodeplan::config::load(&write("c.yaml", &y)).and_then(|c| nodeplan::config::validate(&c).map(|_| ()))
        {
            one_line(&e.to_string(), "config", &y);
        }
        let j = mutate(&mut rng, json);
        if let Err(e) = nodeplan::config::load_connection(&write("conn.json", &j)) {
            one_line(&e.to_string(), "connection", &j);
        }
    }
}

#[test]
fn image_references_and_registries_files() {
    let seeds: &[&[u8]] = &[
        b"registry.example:5000/team/app:v1.2@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        b"rancher/system-agent-installer-rke2:v1.30.1-rke2r1",
    ];
    fuzz(seeds, "image reference", |input| {
        if let Err(e) = nodeplan::image::ImageRef::parse(&String::from_utf8_lossy(input)) {
            one_line(&e, "image reference", input);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("registries.yaml");
    let yaml = b"mirrors:\n  docker.io:\n    endpoint: [\"https://m:5000\"]\nconfigs:\n  \"m:5000\":\n    auth: {username: u, password: p}\n    tls: {insecure_skip_verify: true}\n";
    let mut rng = Rng(11);
    for _ in 0..600 {
        let y = mutate(&mut rng, yaml);
        std::fs::write(&path, &y).unwrap();
        if let Err(e) = nodeplan::image::Registries::load(&path) {
            one_line(&e, "registries file", &y);
        }
    }
}

#[test]
fn install_manifests_server_answers_env_files_and_settings() {
    use nodeplan::install::{fetch, plan, settings};
    let manifest: &[u8] = br#"{"version":1,"files":[{"path":"/etc/rancher/agent/config.yaml","sha256":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}],"links":[{"path":"/etc/systemd/system/multi-user.target.wants/nodeplan.service","target":"/etc/systemd/system/nodeplan.service"}],"envFile":"/etc/systemd/system/nodeplan.env","dirs":["/etc/rancher"]}"#;
    fuzz(&[manifest], "install manifest", |input| {
        if let Err(e) = plan::Manifest::parse(input) {
            one_line(&e, "install manifest", input);
        }
    });
    let answer: &[u8] = br#"{"kubeConfig":"apiVersion: v1\nusers:\n- name: u\n  user: {token: s3cret-token}\n","namespace":"fleet-default","secretName":"m-plan"}"#;
    fuzz(&[answer], "connection answer", |input| {
        if let Err(e) = fetch::parse_connection(input) {
            one_line(&e, "connection answer", input);
            assert!(!e.contains("s3cret"), "an answer's content is never shown: {e}");
        }
    });
    // The environment file: whatever is there, merging never panics, keeps a line the user wrote
    // outside the block, and merging twice gives what merging once gave.
    let env: &[u8] = b"# BEGIN nodeplan install (x)\nHTTPS_PROXY=\"http://old\"\n# END nodeplan install\nFOO=bar\nexport NO_PROXY=x\n";
    let vars =
        vec![("HTTPS_PROXY".to_string(), "http://p:3128".to_string()), ("NO_PROXY".to_string(), "y".to_string())];
    fuzz(&[env], "environment file", |input| {
        let text = String::from_utf8_lossy(input);
        let once = plan::merge_env(Some(&text), &vars);
        let twice = plan::merge_env(once.text.as_deref(), &vars);
        assert_eq!(once.text, twice.text, "{text:?}");
        let _ = plan::merge_env(Some(&text), &[]);
    });
    // Installer variables with mutated values: one-line errors, never a panic.
    let names = [
        "CATTLE_SERVER",
        "CATTLE_CA_CHECKSUM",
        "CATTLE_LABELS",
        "CATTLE_ROLE_ETCD",
        "CATTLE_AGENT_VAR_DIR",
        "HTTPS_PROXY",
    ];
    let base: &[u8] = b"https://rancher.example:8443/sub";
    fuzz(&[base], "installer variable", |input| {
        let value = String::from_utf8_lossy(input).into_owned();
        for name in names {
            let env = |k: &str| match k {
                "CATTLE_TOKEN" => Some("t".to_string()),
                "CATTLE_SERVER" if name != "CATTLE_SERVER" => Some("https://r".to_string()),
                k if k == name => Some(value.clone()),
                _ => None,
            };
            if let Err(e) = settings::Settings::resolve(env, &settings::Flags::default()) {
                one_line(&e, name, input);
            }
        }
    });
}

/// Issue 41: what an instruction printed is masked by one function wherever it is shown
/// (`plan::failure::Mask`). For random values (of several lines, overlapping each other) printed in random output, no
/// substring of 6 characters of a value survives in what any place shows of it.
#[test]
fn no_six_characters_of_an_env_value_survive_the_mask_in_random_output() {
    // Values from upper case and digits, the rest of the output from lower case: any 6
    // characters of a value that show came from a value.
    const VALUE: &[u8] = b"ABCDEFGH0123";
    const FILLER: &[u8] = b"abcdefgh -:=";
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for case in 0..400 {
        let mut values: Vec<String> = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let len = 4 + rng.below(60);
            let mut v = rng.word(VALUE, len);
            if rng.below(4) == 0 {
                let len = 4 + rng.below(30);
                v = format!("{v}\n{}", rng.word(VALUE, len));
            }
            // Sometimes a value that begins with the end of another.
            if let Some(prev) = values.last().filter(|_| rng.below(3) == 0) {
                let tail: String = prev.chars().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect();
                v = format!("{tail}{v}");
            }
            values.push(v);
        }
        let mut out = String::new();
        for _ in 0..1 + rng.below(30) {
            let len = rng.below(700);
            let filler = rng.word(FILLER, len);
            out.push_str(&filler);
            if rng.below(2) == 0 {
                let v = &values[rng.below(values.len())];
                out.push_str(v);
            }
            if rng.below(3) == 0 {
                out.push('\n');
            }
        }
        let env: Vec<String> = values.iter().enumerate().map(|(i, v)| format!("V{i}={v}")).collect();
        let m = Mask::of_env(&env);
        let f = Failure::instruction("c", 0, 1, "x", "exit status 1".into(), out.as_bytes(), &env);
        let places = [f.last_lines.join("\n"), f.note(), m.lines(out.as_bytes()).join("\n"), m.text(&out)];
        for v in values.iter().filter(|v| v.chars().count() >= 6) {
            let chars: Vec<char> = v.chars().collect();
            for w in chars.windows(6) {
                let part: String = w.iter().collect();
                if part.contains('\n') {
                    continue;
                }
                for p in &places {
                    assert!(!p.contains(&part), "case {case}: {part:?} of {v:?} survives in {p:?}");
                }
            }
        }
    }
}
