//! The versions of the files nodeplan keeps on the node, and the rule for reading them across
//! upgrades and downgrades (R25 in `docs/rules.md`).
//!
//! Every JSON record nodeplan writes for itself carries `"nodeplanFormat": N`: the `.pos` file
//! beside a local plan ([`POS`]), the PID records ([`PID_RECORD`]), the saved NodePlan runs
//! ([`SAVED_RUN`]) and the Secret's kept outcome ([`KEPT_OUTCOME`]). A record without the field was written before it existed and is format 1. A
//! reader takes every format up to its own; a newer one is never guessed at: the record is kept
//! as it is and what it describes is held (the plan does not run, the leftover is not signalled)
//! with one error line naming the format. A new optional field that older readers may ignore does
//! not change the number; a change of meaning does.
//!
//! The checkpoint and the plan itself are system-agent's wire format (in the Secret, the `.pos`
//! file and the archive) and are not versioned here. The archive's entries are versioned by
//! their name (`<seq>-<UTC>Z-applied.plan` is format 1): a name the archive does not recognise is
//! never pruned.
//!
//! This module reads no files; the modules that own each format call [`check`].

use serde_json::Value;

/// The field that carries the format.
pub const FIELD: &str = "nodeplanFormat";
/// `.pos` files (local mode).
pub const POS: u64 = 1;
/// PID records (the supervisor).
pub const PID_RECORD: u64 = 1;
/// Saved NodePlan runs (`nodePlanStateDirectory`).
pub const SAVED_RUN: u64 = 1;
/// The Secret's kept outcome (`appliedPlanDirectory`, R17).
pub const KEPT_OUTCOME: u64 = 1;

/// Whether a record `v` (a JSON object) of `what`, read by a build that knows formats up to
/// `supported`, may be read. The error is one line.
pub fn check(v: &Value, what: &str, supported: u64) -> Result<(), String> {
    match v.get(FIELD) {
        None => Ok(()),
        Some(n) => match n.as_u64() {
            Some(n) if (1..=supported).contains(&n) => Ok(()),
            Some(n) if n > supported => Err(format!(
                "{what} written by a newer nodeplan (format {n}; this one reads formats up to {supported}): kept as it is and held (see the downgrade rule, R25)"
            )),
            _ => Err(format!("{what}: {FIELD} is {}, not a format number", crate::plan::shown_value(&n.to_string()))),
        },
    }
}

/// `v` (a JSON object) with the current format `n` set.
pub fn stamp(mut v: Value, n: u64) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.insert(FIELD.to_string(), Value::from(n));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_up_to_the_supported_one_are_read() {
        let rows = [
            (json!({}), true),
            (json!({"nodeplanFormat": 1}), true),
            (json!({"nodeplanFormat": 2}), false),
            (json!({"nodeplanFormat": 0}), false),
            (json!({"nodeplanFormat": "1"}), false),
            (json!({"nodeplanFormat": -1}), false),
        ];
        for (v, ok) in rows {
            let r = check(&v, ".pos file", 1);
            assert_eq!(r.is_ok(), ok, "{v}: {r:?}");
            if let Err(e) = r {
                assert!(e.starts_with(".pos file") && !e.contains('\n'), "{e}");
            }
        }
        assert!(check(&json!({"nodeplanFormat": 2}), "x", 1).unwrap_err().contains("newer nodeplan (format 2"));
        assert_eq!(stamp(json!({"a": 1}), 3), json!({"a": 1, "nodeplanFormat": 3}));
    }
}
