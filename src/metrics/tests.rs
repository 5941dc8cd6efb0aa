use super::*;

fn text(m: &Metrics) -> String {
    m.encode(server::Format::Text)
}

#[test]
fn plan_info_names_each_known_plan_once_and_goes_with_it() {
    let m = Metrics::new(Directories::default());
    let series = |id: &str, name: &str| format!("nodeplan_plan_info{{plan=\"{id}\",name=\"{name}\"}} 1");
    let mut a = PlanInfo::default();
    a.set_in(&m, "0123456789ab", "secret ns/node-a");
    a.set_in(&m, "0123456789ab", "secret ns/node-a");
    let mut b = PlanInfo::default();
    b.set_in(&m, "abcdefabcdef", "/var/lib/rancher/agent/plans/x.plan");
    let t = text(&m);
    assert_eq!(t.lines().filter(|l| l.starts_with("nodeplan_plan_info{")).count(), 2, "{t}");
    assert!(t.lines().any(|l| l == series("0123456789ab", "secret ns/node-a")), "{t}");
    // A new plan in the same place replaces the series; a plan forgotten takes its series along.
    a.set_in(&m, "ffffffffffff", "secret ns/node-a");
    b.clear_in(&m);
    let t = text(&m);
    let lines: Vec<&str> = t.lines().filter(|l| l.starts_with("nodeplan_plan_info{")).collect();
    assert_eq!(lines, [series("ffffffffffff", "secret ns/node-a")], "{t}");
    // A name from outside is bounded like a probe's.
    a.set_in(&m, "ffffffffffff", &"n".repeat(300));
    let t = text(&m);
    let line = t.lines().find(|l| l.starts_with("nodeplan_plan_info{")).unwrap();
    assert!(line.len() < 150, "{line}");
}

#[test]
fn counters_show_under_their_documented_names() {
    let m = Metrics::new(Directories::default());
    m.plan_recorded(PlanResult::Succeeded);
    m.plan_recorded(PlanResult::Succeeded);
    m.plan_recorded(PlanResult::Canceled);
    m.stop_ladder(Ladder::Survivors(3));
    m.write_retried(WriteTarget::NodePlan, RetryReason::Conflict);
    m.pid_record_recovered(Recovery::Gone);
    m.instruction_finished(true, InstructionResult::Ok, Duration::from_millis(20));
    let t = text(&m);
    for line in [
        "nodeplan_plans_total{result=\"succeeded\"} 2",
        "nodeplan_plans_total{result=\"canceled\"} 1",
        "nodeplan_stop_ladder_total{outcome=\"survivors\"} 1",
        "nodeplan_stop_survivors_total 3",
        "nodeplan_write_retries_total{target=\"nodeplan\",reason=\"conflict\"} 1",
        "nodeplan_pid_record_recoveries_total{result=\"gone\"} 1",
        "nodeplan_instruction_duration_seconds_bucket{kind=\"periodic\",result=\"ok\",le=\"0.05\"} 1",
        "nodeplan_instruction_duration_seconds_bucket{kind=\"periodic\",result=\"ok\",le=\"0.01\"} 0",
        "nodeplan_instruction_duration_seconds_count{kind=\"periodic\",result=\"ok\"} 1",
        "# TYPE nodeplan_cancel_latency_seconds histogram",
        "# TYPE nodeplan_image_pull_bytes_total counter",
    ] {
        assert!(t.lines().any(|l| l == line), "no line {line:?} in:\n{t}");
    }
    assert!(!t.contains("in_progress") && !t.contains("pending"), "{t}");
}

#[test]
fn probe_gauges_follow_the_plans_probes() {
    let m = Metrics::new(Directories::default());
    let id = "0123456789ab";
    let mut h = ProbeHealth::default();
    h.set_in(&m, id, [("web", true), ("db", false)]);
    let t = text(&m);
    assert!(t.contains("nodeplan_probe_healthy{plan=\"0123456789ab\",probe=\"web\"} 1"), "{t}");
    assert!(t.contains("nodeplan_probe_healthy{plan=\"0123456789ab\",probe=\"db\"} 0"), "{t}");
    // `db` went away, `web` turned unhealthy.
    h.set_in(&m, id, [("web", false)]);
    let t = text(&m);
    assert!(t.contains("nodeplan_probe_healthy{plan=\"0123456789ab\",probe=\"web\"} 0"), "{t}");
    assert!(!t.contains("probe=\"db\""), "{t}");
    // The plan changed: the old plan's gauges go.
    h.set_in(&m, "fedcba987654", [("web", true)]);
    let t = text(&m);
    assert!(!t.contains("0123456789ab"), "{t}");
    assert!(t.contains("nodeplan_probe_healthy{plan=\"fedcba987654\",probe=\"web\"} 1"), "{t}");
    h.clear_in(&m);
    assert!(!text(&m).contains("nodeplan_probe_healthy{"), "{}", text(&m));
}

#[test]
fn long_probe_names_are_cut_and_stay_distinct() {
    let m = Metrics::new(Directories::default());
    let mut h = ProbeHealth::default();
    let common = "p".repeat(MAX_LABEL_CHARS);
    let (a, b) = (format!("{common}-a"), format!("{common}-b"));
    let exact = "q".repeat(MAX_LABEL_CHARS);
    h.set_in(&m, "abc", [(a.as_str(), false), (b.as_str(), true), (exact.as_str(), true)]);
    let t = text(&m);
    let series: Vec<&str> = t.lines().filter(|l| l.starts_with("nodeplan_probe_healthy{")).collect();
    assert_eq!(series.len(), 3, "one series per probe:\n{t}");
    let label = |l: &str| l.split("probe=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or_default().to_string();
    let labels: Vec<String> = series.iter().map(|l| label(l)).collect();
    for l in &labels {
        assert!(l.chars().count() <= MAX_LABEL_CHARS, "{l}");
    }
    // A name of exactly the limit is shown as it is; longer ones are cut with a hash of the name.
    assert!(labels.contains(&exact), "{t}");
    let cut_a = label_text(&a);
    assert_eq!(cut_a.chars().count(), MAX_LABEL_CHARS);
    assert!(cut_a.starts_with(&"p".repeat(MAX_LABEL_CHARS - LABEL_HASH_CHARS - 1)), "{cut_a}");
    assert_ne!(cut_a, label_text(&b));
    assert_eq!(cut_a, label_text(&a), "the same name, the same label");
    assert!(t.contains(&format!("probe=\"{cut_a}\"}} 0")), "{t}");
    assert!(t.contains(&format!("probe=\"{}\"}} 1", label_text(&b))), "{t}");
    assert!(!t.contains(&"p".repeat(MAX_LABEL_CHARS + 1)), "{t}");
    h.clear_in(&m);
}

#[cfg(unix)]
#[test]
fn directory_sizes_are_measured_at_scrape_time() {
    let t = tempfile::tempdir().unwrap();
    let work = t.path().join("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::write(work.join("f"), vec![7u8; 256 * 1024]).unwrap();
    let m = Metrics::new(Directories { work: Some(work), applied: Some(t.path().join("missing")), images: None });
    let text = text(&m);
    let bytes = text
        .lines()
        .find_map(|l| l.strip_prefix("nodeplan_directory_size_bytes{directory=\"work\"} "))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no work size in:\n{text}"));
    assert!(bytes >= 256 * 1024, "{bytes}");
    assert!(text.contains("nodeplan_directory_size_bytes{directory=\"applied\"} 0"), "{text}");
    assert!(text.contains("nodeplan_directory_size_complete{directory=\"work\"} 1"), "{text}");
    assert!(!text.contains("directory=\"images\""), "not configured, not shown: {text}");
}
