use super::*;
use chrono::{TimeZone, Utc};

const WIRE: &str = r#"{
 "files":[{"content":"aGVsbG8K","path":"/etc/x.conf","permissions":"0644","uid":1,"gid":2,"dynamic":true,"unknownField":7},
          {"directory":true,"path":"/opt/d"},
          {"path":"/tmp/gone","action":"delete"}],
 "instructions":[{"name":"install","image":"rancher/system-agent-installer-rke2:v1","env":["A=1"],"args":["-c","echo"],"command":"sh","saveOutput":true,"timeoutSeconds":30}],
 "periodicInstructions":[{"name":"etcd-snap","command":"true","periodSeconds":60,"saveStderrOutput":true}],
 "probes":{"kubelet":{"initialDelaySeconds":1,"timeoutSeconds":5,"successThreshold":1,"failureThreshold":2,"httpGet":{"url":"https://127.0.0.1:10248/healthz","caCert":"/ca.pem","clientCert":"/c.pem","clientKey":"/k.pem"}}},
 "futureTopLevel":{"x":1}
}"#;

#[test]
fn parses_the_wire_example_and_ignores_unknown_fields() {
    let v = parse(WIRE.as_bytes()).unwrap();
    let p = &v.plan;
    assert_eq!(p.files.len(), 3);
    assert_eq!(p.files[0].uid, 1);
    assert!(p.files[0].dynamic);
    assert_eq!(
        v.files[0],
        FileOp::Write { path: "/etc/x.conf".into(), content: b"hello\n".to_vec(), mode: 0o644, uid: 1, gid: 2 }
    );
    assert_eq!(v.files[1], FileOp::Directory { path: "/opt/d".into(), mode: 0o755, uid: 0, gid: 0 });
    assert_eq!(v.files[2], FileOp::Delete { path: "/tmp/gone".into(), directory: false });
    let i = &p.instructions[0];
    assert_eq!(i.common.name, "install");
    assert_eq!(i.common.timeout_seconds, 30);
    assert!(i.save_output);
    assert_eq!(p.periodic_instructions[0].period(), std::time::Duration::from_secs(60));
    let probe = &p.probes["kubelet"];
    assert_eq!(probe.name, "kubelet", "name is overwritten by the map key");
    assert_eq!(probe.http_get.ca_cert, "/ca.pem");
    assert_eq!(v.checksum, checksum(WIRE.as_bytes()));
}

#[test]
fn reserialises_with_go_omitempty_rules() {
    let v = parse(WIRE.as_bytes()).unwrap();
    let out = serde_json::to_string(&v.plan.instructions[0]).unwrap();
    assert_eq!(
        out,
        r#"{"name":"install","image":"rancher/system-agent-installer-rke2:v1","env":["A=1"],"args":["-c","echo"],"command":"sh","timeoutSeconds":30,"saveOutput":true}"#
    );
    assert_eq!(serde_json::to_string(&File { path: "/a".into(), ..Default::default() }).unwrap(), r#"{"path":"/a"}"#);
    let again: Plan = serde_json::from_str(&serde_json::to_string(&v.plan).unwrap()).unwrap();
    assert_eq!(again, v.plan);
    assert_eq!(serde_json::to_string(&Plan::default()).unwrap(), "{}");
}

#[test]
fn go_nulls_read_as_empty() {
    let v =
        parse(br#"{"files":null,"instructions":[{"name":"n","command":"x","env":null,"args":null}],"probes":null}"#)
            .unwrap();
    assert!(v.plan.files.is_empty());
    assert!(v.plan.instructions[0].common.env.is_empty());
}

#[test]
fn checksum_is_lowercase_hex_sha256_of_raw_bytes() {
    assert_eq!(checksum(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    assert_ne!(checksum(b"{}"), checksum(b"{ }"), "whitespace matters");
}

#[test]
fn one_plan_has_one_id_however_it_is_formatted() {
    let a = br#"{"instructions":[{"name":"a","command":"true"}],"files":[{"path":"/x","content":"aGk="}]}"#;
    // Other whitespace, other key order, a key this agent does not read, an explicit default.
    let b = br#"{
      "files": [ {"content": "aGk=", "path": "/x"} ],
      "instructions": [ {"command": "true", "name": "a", "saveOutput": false} ],
      "somethingElse": 1
    }"#;
    let (pa, pb) = (parse(a).unwrap(), parse(b).unwrap());
    assert_ne!(pa.checksum, pb.checksum, "the wire checksum is of the bytes");
    assert_eq!(pa.id(), pb.id());
    assert_eq!(pa.id().len(), ID_LEN);
    assert!(pa.id().bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    // As a NodePlan's spec holds it (canonical JSON of the value), the same id.
    let value: serde_json::Value = serde_json::from_slice(b).unwrap();
    assert_eq!(id_of(&serde_json::to_vec(&value).unwrap()).as_deref(), Some(pa.id().as_str()));
    // Anything that changes what runs changes the id.
    for other in [
        &br#"{"instructions":[{"name":"a","command":"false"}],"files":[{"path":"/x","content":"aGk="}]}"#[..],
        br#"{"instructions":[{"name":"a","command":"true"}],"files":[{"path":"/x","content":"aGo="}]}"#,
        br#"{"instructions":[{"name":"a","command":"true","saveOutput":true}],"files":[{"path":"/x","content":"aGk="}]}"#,
    ] {
        assert_ne!(parse(other).unwrap().id(), pa.id(), "{}", String::from_utf8_lossy(other));
    }
    assert_eq!(id_of(b"not json"), None);
    assert_eq!(short("0123456789abcdef"), "0123456789ab");
    assert_eq!(short("abc"), "abc");
}

#[test]
fn validation_names_the_field_and_index() {
    let cases: &[(&str, &str)] = &[
        ("{", "malformed JSON"),
        (r#"{"files":[{"path":"/a","content":"!!"}]}"#, "files[0].content: bad base64"),
        (r#"{"files":[{"path":"/a","permissions":"0z44"}]}"#, "files[0].permissions"),
        (r#"{"files":[{"path":"/a","permissions":"99"}]}"#, "files[0].permissions"),
        (r#"{"files":[{"path":"/a"},{"path":"rel/x"}]}"#, "files[1].path: \"rel/x\" is not an absolute path"),
        (r#"{"files":[{"content":""}]}"#, "files[0].path: is empty"),
        (r#"{"files":[{"path":"/a/../b"}]}"#, "files[0].path"),
        (r#"{"files":[{"path":"/a","uid":-1}]}"#, "files[0].uid"),
        (
            r#"{"instructions":[{"name":"a","command":"a"},{"name":"x"}]}"#,
            "instructions[1].command: neither command nor image",
        ),
        (r#"{"periodicInstructions":[{"name":"p"}]}"#, "periodicInstructions[0].command"),
        (r#"{"instructions":[{"name":"a","command":"a","env":["NOEQUALS"]}]}"#, "instructions[0].env[0]"),
        (r#"{"instructions":[{"name":"a","command":"a","timeoutSeconds":-1}]}"#, "instructions[0].timeoutSeconds"),
        (r#"{"probes":{"p":{"httpGet":{}}}}"#, "probes[\"p\"].httpGet.url"),
        (r#"{"files":"nope"}"#, "malformed JSON"),
        // Paths must be normalised absolute paths, each once per plan.
        (
            r#"{"files":[{"path":"/a","content":""},{"path":"/","content":"eA=="}]}"#,
            "files[1].path: \"/\" is the root directory",
        ),
        (
            r#"{"files":[{"path":"/","directory":true,"action":"delete"}]}"#,
            "files[0].path: \"/\" is the root directory",
        ),
        (r#"{"files":[{"path":"//","directory":true,"action":"delete"}]}"#, "files[0].path: \"//\" contains \"//\""),
        (
            r#"{"files":[{"path":"/x/./","directory":true,"action":"delete"}]}"#,
            "files[0].path: \"/x/./\" contains a \".\" component",
        ),
        (r#"{"files":[{"path":"/x/.","directory":true}]}"#, "files[0].path: \"/x/.\" contains a \".\" component"),
        (r#"{"files":[{"path":"/x/.."}]}"#, "files[0].path: \"/x/..\" contains a \"..\" component"),
        (r#"{"files":[{"path":"/x//y"}]}"#, "files[0].path: \"/x//y\" contains \"//\""),
        (r#"{"files":[{"path":"/x/","content":""}]}"#, "files[0].path: \"/x/\" ends with \"/\""),
        (r#"{"files":[{"path":"/x/","action":"delete"}]}"#, "files[0].path: \"/x/\" ends with \"/\""),
        (r#"{"files":[{"path":"/x//","directory":true}]}"#, "files[0].path: \"/x//\" contains \"//\""),
        (r#"{"files":[{"path":"/a\u0000b"}]}"#, "files[0].path: \"/a\\0b\" contains a NUL byte"),
        (
            r#"{"files":[{"path":"/d","directory":true},{"path":"/e"},{"path":"/d/","directory":true,"action":"delete"}]}"#,
            "files[2].path: \"/d\" is also files[0].path",
        ),
        (r#"{"files":[{"path":"/e"},{"path":"/e"}]}"#, "files[1].path: \"/e\" is also files[0].path"),
        // Other fields.
        (r#"{"files":[{"path":"/a","permissions":"+644"}]}"#, "files[0].permissions: \"+644\" is not an octal"),
        (r#"{"files":[{"path":"/a","permissions":"77777"}]}"#, "files[0].permissions: \"77777\" is larger than 07777"),
        (r#"{"instructions":[{"name":"a","command":"a"},{"command":"b"}]}"#, "instructions[1].name: is empty"),
        (r#"{"periodicInstructions":[{"name":"","command":"b"}]}"#, "periodicInstructions[0].name: is empty"),
        (
            r#"{"periodicInstructions":[{"name":"p","command":"b","periodSeconds":-5}]}"#,
            "periodicInstructions[0].periodSeconds: -5 is negative",
        ),
        (
            r#"{"probes":{"p":{"httpGet":{"url":"not a url"}}}}"#,
            "probes[\"p\"].httpGet.url: \"not a url\" is not a URL",
        ),
        (
            r#"{"probes":{"p":{"httpGet":{"url":"ftp://h/x"}}}}"#,
            "probes[\"p\"].httpGet.url: \"ftp://h/x\": the scheme must be http or https",
        ),
        // The plan itself.
        ("[]", "the plan must be a JSON object"),
        (" \n[{\"files\":[]}]", "not an array"),
        ("null", "not null"),
        ("\"x\"", "not a string"),
        ("7", "not a number"),
        ("true", "not a boolean"),
        ("", "not empty"),
        ("\u{feff}{}", "byte order mark"),
    ];
    for (raw, want) in cases {
        let err = parse(raw.as_bytes()).expect_err(raw).to_string();
        assert!(err.contains(want), "{raw}: got {err:?}, want it to contain {want:?}");
        assert!(!err.contains('\n'), "one line: {err:?}");
    }
}

#[test]
fn normalised_paths_are_kept_and_a_directory_may_end_with_one_slash() {
    let v = parse(
        br#"{"files":[{"path":"/opt/d/","directory":true},{"path":"/var/gone/","directory":true,"action":"delete"},{"path":"/opt/d/f.conf"},{"path":"/opt/..x"}]}"#,
    )
    .unwrap();
    let paths: Vec<&str> = v.files.iter().map(FileOp::path).collect();
    assert_eq!(paths, ["/opt/d", "/var/gone", "/opt/d/f.conf", "/opt/..x"]);
}

#[test]
fn permission_strings() {
    for (s, default, want) in
        [("0644", 0, Ok(0o644)), ("644", 0, Ok(0o644)), ("", 0o600, Ok(0o600)), ("4755", 0, Ok(0o4755))]
    {
        assert_eq!(parse_permissions(s, default), want, "{s}");
    }
    assert!(parse_permissions("8", 0).is_err());
    assert!(parse_permissions("-1", 0).is_err());
    assert!(parse_permissions("17777", 0).is_err());
    assert!(parse_permissions("+644", 0).is_err());
    assert!(parse_permissions(" 644", 0).is_err());
    assert_eq!(parse_permissions("00644", 0), Ok(0o644));
}

#[test]
fn checkpoint_pins_field_order_and_omits_empty_fields() {
    let full = Checkpoint {
        checksum: "abc".into(),
        completed_instructions: 1,
        total_instructions: 3,
        resume_state: Some(PlanState::InProgress),
        paused: true,
        termination_incomplete: true,
    };
    assert_eq!(
        full.to_json(),
        r#"{"checksum":"abc","completedInstructions":1,"totalInstructions":3,"resumeState":"in-progress","paused":true,"terminationIncomplete":true}"#
    );
    let cancel =
        Checkpoint { checksum: "abc".into(), completed_instructions: 0, total_instructions: 1, ..Default::default() };
    assert_eq!(cancel.to_json(), r#"{"checksum":"abc","completedInstructions":0,"totalInstructions":1}"#);
    assert_eq!(Checkpoint::read(Some(full.to_json().as_bytes()), "abc"), Some(full.clone()));
}

/// Rancher's checkpoint struct marks every field `omitempty`: what it writes leaves zero counts
/// and `false` flags out, and each such checkpoint reads as the one it stands for.
#[test]
fn checkpoint_read_takes_rancher_s_omitted_zero_fields() {
    let cp = |completed, total, resume_state, paused| Checkpoint {
        checksum: "abc".into(),
        completed_instructions: completed,
        total_instructions: total,
        resume_state,
        paused,
        termination_incomplete: false,
    };
    for (raw, want) in [
        (
            r#"{"checksum":"abc","totalInstructions":2,"resumeState":"pending","paused":true}"#,
            cp(0, 2, Some(PlanState::Pending), true),
        ),
        (r#"{"checksum":"abc","totalInstructions":2}"#, cp(0, 2, None, false)),
        (r#"{"checksum":"abc","completedInstructions":1}"#, cp(1, 0, None, false)),
        (r#"{"checksum":"abc"}"#, cp(0, 0, None, false)),
        (
            r#"{"checksum":"abc","completedInstructions":1,"totalInstructions":3,"resumeState":"in-progress","paused":true}"#,
            cp(1, 3, Some(PlanState::InProgress), true),
        ),
    ] {
        assert_eq!(Checkpoint::read(Some(raw.as_bytes()), "abc"), Some(want), "{raw}");
    }
    // Without a checksum it is no plan's checkpoint.
    assert_eq!(Checkpoint::read(Some(br#"{"totalInstructions":2}"#), "abc"), None);
}

#[test]
fn checkpoint_read_treats_junk_as_absent() {
    for raw in [
        None,
        Some(&b""[..]),
        Some(b"{"),
        Some(b"[1]"),
        Some(br#"{"checksum":"other","completedInstructions":1,"totalInstructions":2}"#),
    ] {
        assert_eq!(Checkpoint::read(raw, "abc"), None, "{raw:?}");
    }
}

#[test]
fn plan_states_round_trip() {
    for s in ["pending", "in-progress", "succeeded", "failed", "canceled", "paused", "weird"] {
        assert_eq!(PlanState::parse(s).as_str(), s);
    }
    assert!(PlanState::Succeeded.is_terminal() && PlanState::Canceled.is_terminal() && PlanState::Failed.is_terminal());
    assert!(!PlanState::Paused.is_terminal() && !PlanState::InProgress.is_terminal());
}

#[test]
fn annotation_values_r1_r2() {
    use Hold::{Cancel, Pause};
    let ok: &[(Option<&str>, Option<&str>, Hold)] = &[
        (None, None, Hold::None),
        (Some("false"), Some("false"), Hold::None),
        (Some("true"), None, Pause),
        (Some("true"), Some("false"), Pause),
        (None, Some("true"), Cancel),
        (Some("true"), Some("true"), Cancel),
        (Some("True"), Some("true"), Cancel),
        (Some(""), Some("true"), Cancel),
    ];
    for (p, c, want) in ok {
        assert_eq!(resolve_annotations(&Annotations { paused: *p, canceled: *c }), Ok(*want), "{p:?} {c:?}");
    }
    for bad in ["True", "1", "yes", "", "true ", "FALSE", "t"] {
        let err = resolve_annotations(&Annotations { paused: Some(bad), canceled: None }).unwrap_err();
        assert_eq!(err.0, vec![(ANNOTATION_PAUSED.to_string(), bad.to_string())]);
        assert!(err.to_string().contains(&format!("{bad:?}")));
        let err = resolve_annotations(&Annotations { paused: Some("true"), canceled: Some(bad) }).unwrap_err();
        assert_eq!(err.0[0].0, ANNOTATION_CANCELED, "an invalid canceled is never a pause");
    }
    let both = resolve_annotations(&Annotations { paused: Some("1"), canceled: Some("0") }).unwrap_err();
    assert_eq!(both.0.len(), 2);
}

#[test]
fn one_time_output_codec_round_trip() {
    let mut m = BTreeMap::new();
    m.insert("a".to_string(), b"out\nerr\n".to_vec());
    m.insert("b".to_string(), vec![0, 255]);
    let enc = encode_one_time_output(&m);
    assert_eq!(&enc[..2], &[0x1f, 0x8b], "gzip magic");
    assert_eq!(decode_one_time_output(&enc).unwrap(), m);
    // The JSON inside is a map of base64 strings, as Go's map[string][]byte.
    let mut json = String::new();
    flate2::read::GzDecoder::new(&enc[..]).read_to_string(&mut json).unwrap();
    assert_eq!(json, r#"{"a":"b3V0CmVycgo=","b":"AP8="}"#);
    assert!(decode_one_time_output(b"").unwrap().is_empty());
    assert!(matches!(decode_one_time_output(b"junk"), Err(CodecError::Gzip(_))));
    use std::io::Read as _;
}

#[test]
fn periodic_output_codec_has_no_omitempty() {
    let mut m = BTreeMap::new();
    m.insert(
        "p".to_string(),
        PeriodicInstructionOutput { name: "p".into(), stdout: b"hi".to_vec(), exit_code: 0, ..Default::default() },
    );
    let enc = encode_periodic_output(&m);
    let mut json = String::new();
    use std::io::Read as _;
    flate2::read::GzDecoder::new(&enc[..]).read_to_string(&mut json).unwrap();
    assert_eq!(
        json,
        r#"{"p":{"name":"p","stdout":"aGk=","stderr":"","exitCode":0,"lastSuccessfulRunTime":"","failures":0,"lastFailedRunTime":""}}"#
    );
    assert_eq!(decode_periodic_output(&enc).unwrap(), m);
    let go_nil = br#"{"p":{"name":"p","stdout":null,"stderr":null,"exitCode":1,"lastSuccessfulRunTime":"","failures":2,"lastFailedRunTime":"Mon Nov 30 05:29:24 UTC 2026"}}"#;
    let parsed: BTreeMap<String, PeriodicInstructionOutput> = serde_json::from_slice(go_nil).unwrap();
    assert_eq!(parsed["p"].failures, 2);
}

#[test]
fn unix_date_matches_go() {
    let t = Utc.with_ymd_and_hms(2026, 11, 3, 5, 9, 4).unwrap();
    assert_eq!(format_unix_date(t), "Tue Nov  3 05:09:04 UTC 2026");
    assert_eq!(parse_unix_date("Tue Nov  3 05:09:04 UTC 2026"), Some(t));
    assert_eq!(parse_unix_date(&format_unix_date(t)), Some(t));
    assert_eq!(parse_unix_date("Mon Nov 30 05:29:24 UTC 2026").unwrap().to_rfc3339(), "2026-11-30T05:29:24+00:00");
    for bad in ["", "yesterday", "Mon Nov 30 25:29:24 UTC 2026", "Mon Foo 30 05:29:24 UTC 2026"] {
        assert_eq!(parse_unix_date(bad), None, "{bad}");
    }
}

#[test]
fn file_exists_probes_need_one_kind_and_an_absolute_path() {
    let plan = |probe: &str| format!(r#"{{"probes": {{"p": {probe}}}}}"#);
    assert!(parse(plan(r#"{"fileExists": {"path": "/run/ready"}}"#).as_bytes()).is_ok());
    let e = parse(plan(r#"{"fileExists": {"path": "run/ready"}}"#).as_bytes()).unwrap_err().to_string();
    assert!(e.contains("fileExists.path") && e.contains("not an absolute path"), "{e}");
    let both = r#"{"fileExists": {"path": "/r"}, "httpGet": {"url": "http://x"}}"#;
    let e = parse(plan(both).as_bytes()).unwrap_err().to_string();
    assert!(e.contains("both httpGet and fileExists"), "{e}");
}
