//! The keys a plan's JSON may have, at every level (system-agent's plan types): what a plan file or
//! a NodePlan's `spec.plan` holds beyond them is a key no agent reads (a misspelt `instrutions` makes
//! an empty plan). Plan files keep system-agent's rule (unknown keys are ignored) and the commands
//! warn about them; a NodePlan refuses them ([`crate::nodeplan::resource::check_spec`]). Pure.

use serde_json::Value;

pub const PLAN_FIELDS: &[&str] = &["files", "instructions", "periodicInstructions", "probes"];
pub const FILE_FIELDS: &[&str] =
    &["path", "content", "directory", "uid", "gid", "permissions", "action", "dynamic", "minor"];
pub const INSTRUCTION_FIELDS: &[&str] = &["name", "image", "command", "args", "env", "saveOutput", "timeoutSeconds"];
pub const PERIODIC_FIELDS: &[&str] =
    &["name", "image", "command", "args", "env", "timeoutSeconds", "periodSeconds", "saveStderrOutput"];
pub const PROBE_FIELDS: &[&str] =
    &["initialDelaySeconds", "timeoutSeconds", "successThreshold", "failureThreshold", "httpGet", "fileExists"];

/// The keys of the object `v` not in `known`, each as `at.key`.
pub fn unknown_in(v: &Value, at: &str, known: &[&str]) -> Vec<String> {
    let Some(m) = v.as_object() else { return Vec::new() };
    m.keys().filter(|k| !known.contains(&k.as_str())).map(|k| format!("{at}.{k}")).collect()
}

/// [`unknown_in`] of every item of the array `v`, as `at[i].key`.
pub fn unknown_in_items(v: Option<&Value>, at: &str, known: &[&str]) -> Vec<String> {
    let Some(items) = v.and_then(Value::as_array) else { return Vec::new() };
    items.iter().enumerate().flat_map(|(i, item)| unknown_in(item, &format!("{at}[{i}]"), known)).collect()
}

/// Every key of the plan `plan` (its JSON, at `at`) that no agent reads, in document order of the
/// levels: the plan's own, then its files', instructions', periodic instructions' and probes'.
pub fn unknown_plan_keys(plan: &Value, at: &str) -> Vec<String> {
    let mut out = unknown_in(plan, at, PLAN_FIELDS);
    out.extend(unknown_in_items(plan.get("files"), &format!("{at}.files"), FILE_FIELDS));
    out.extend(unknown_in_items(plan.get("instructions"), &format!("{at}.instructions"), INSTRUCTION_FIELDS));
    out.extend(unknown_in_items(
        plan.get("periodicInstructions"),
        &format!("{at}.periodicInstructions"),
        PERIODIC_FIELDS,
    ));
    if let Some(probes) = plan.get("probes").and_then(Value::as_object) {
        for (name, p) in probes {
            out.extend(unknown_in(p, &format!("{at}.probes.{name}"), PROBE_FIELDS));
        }
    }
    out
}

/// A plan file's warning line about keys no agent reads (`None` when there are none, or when the
/// bytes are not a JSON object: parsing says why).
pub fn unknown_keys_warning(raw: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(raw).ok()?;
    let keys = unknown_plan_keys(&v, "plan");
    (!keys.is_empty()).then(|| {
        let shown: Vec<String> = keys.iter().take(5).map(|k| crate::quoted(k)).collect();
        let more = if keys.len() > 5 { format!(" and {} more", keys.len() - 5) } else { String::new() };
        format!("unknown plan key(s) {}{more}: ignored, as system-agent ignores them (a typo?)", shown.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_no_agent_reads_are_named_at_every_level() {
        let plan = json!({
            "instrutions": [],
            "instructions": [{"name": "a", "command": "true", "retries": 3}],
            "periodicInstructions": [{"name": "p", "periodSeconds": 5, "period": 5}],
            "files": [{"path": "/x", "mode": "0644"}],
            "probes": {"web": {"httpGet": {"url": "http://x"}, "threshold": 1}}
        });
        assert_eq!(
            unknown_plan_keys(&plan, "plan"),
            [
                "plan.instrutions",
                "plan.files[0].mode",
                "plan.instructions[0].retries",
                "plan.periodicInstructions[0].period",
                "plan.probes.web.threshold"
            ]
        );
        let line = unknown_keys_warning(serde_json::to_vec(&plan).unwrap().as_slice()).unwrap();
        assert!(line.starts_with("unknown plan key(s) \"plan.instrutions\", \"plan.files[0].mode\""), "{line}");
        assert_eq!(unknown_keys_warning(br#"{"instructions": []}"#), None);
        assert_eq!(unknown_keys_warning(b"not json"), None);
    }
}
