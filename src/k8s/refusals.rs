//! Refusals no retry can cure: the API server answered, but with 401 (the agent's token) or 403
//! (what the agent's account may do with its plan objects). A connection that carries such answers is alive
//! ([`super::liveness`]), yet the agent achieves nothing, so these are kept apart: one entry per
//! kind of refusal (the token; a verb on a resource), since when, said in the log when it starts,
//! once a minute while it lasts and when it ends, shown by `nodeplan status` and in the metrics.
//!
//! Owns: the account of refusals. Pure apart from [`Refusals::answered`]'s log lines and its
//! reports to `board` and `metrics`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a refusal that lasts is said again in the log.
pub const RETELL: Duration = Duration::from_secs(60);

/// The resources whose 403 keeps the agent from its work: its plan objects. Leases and Events
/// have fallbacks of their own, each said once where it happens (a source without a Lease,
/// Events off): Rancher's per-machine role grants the plan Secret alone.
const NEEDED: [&str; 2] = ["secrets", "nodeplans"];

/// One kind of refusal: `401`, or `403 <verb> <resource>` for a resource the agent needs.
fn key(status: u16, what: &str) -> Option<String> {
    let resource = what.split_once(' ').map_or(what, |(_, r)| r);
    let needed = NEEDED.iter().any(|n| resource == *n || resource.starts_with(&format!("{n}/")));
    match status {
        401 => Some("401".into()),
        403 if needed => Some(format!("403 {what}")),
        _ => None,
    }
}

/// A request as a verb and a resource (`patch secrets`, `update leases`, `list nodeplans`,
/// `patch nodeplans/status`), from its method and path (`?watch=1` makes a list a watch).
pub fn what(method: &hyper::Method, path_and_query: &str) -> String {
    let (path, query) = path_and_query.split_once('?').unwrap_or((path_and_query, ""));
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    // /api/v1/… or /apis/<group>/<version>/…, then namespaces/<ns>/ for namespaced resources.
    let rest = match parts.first() {
        Some(&"api") => parts.get(2..),
        Some(&"apis") => parts.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    let rest = match rest {
        ["namespaces", _, more @ ..] if !more.is_empty() => more,
        _ => rest,
    };
    let (resource, named) = match rest {
        [r] => (r.to_string(), false),
        [r, _] => (r.to_string(), true),
        [r, _, sub, ..] => (format!("{r}/{sub}"), true),
        [] => (path.to_string(), true),
    };
    let watch = query.split('&').any(|q| q == "watch=1" || q == "watch=true");
    let verb = match (method.as_str(), named) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        (m, _) => m,
    };
    format!("{verb} {resource}")
}

/// The line an operator reads for a refusal of `what` with `status`.
fn said(status: u16, what: &str) -> String {
    match status {
        401 => "the API server refused the agent's token (401 Unauthorized): check the token in the connection \
                info (connectionInfoFile), or the kubeconfig"
            .into(),
        _ => format!(
            "the API server forbids the agent to {what} (403 Forbidden): grant it to the agent's account, or \
             remove the policy that refuses it"
        ),
    }
}

#[derive(Debug, Clone)]
struct Entry {
    status: u16,
    line: String,
    since: String,
    told: Instant,
}

/// What to say after an answer (the account decides, the caller logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tell {
    Nothing,
    /// A refusal began (or lasts another [`RETELL`]): its line and since when.
    Refused {
        line: String,
        since: String,
        again: bool,
    },
    /// Refusals of this kind ended: their line and since when they had lasted.
    Ended {
        line: String,
        since: String,
    },
}

/// The refusals in force.
#[derive(Debug, Default)]
pub struct Refusals {
    now: Mutex<BTreeMap<String, Entry>>,
}

impl Refusals {
    /// Account for an answer with `status` to a request for `what` ([`what`]), at `at` (now,
    /// RFC 3339) and `instant`: a 401 or a 403 is a refusal; a success ends the token's refusal
    /// and this request's kind of 403.
    pub fn account(&self, status: u16, what: &str, at: &str, instant: Instant) -> Vec<Tell> {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = key(status, what) {
            return vec![match now.get_mut(&k) {
                None => {
                    let line = said(status, what);
                    now.insert(k, Entry { status, line: line.clone(), since: at.into(), told: instant });
                    Tell::Refused { line, since: at.into(), again: false }
                }
                Some(e) if instant.duration_since(e.told) >= RETELL => {
                    e.told = instant;
                    Tell::Refused { line: e.line.clone(), since: e.since.clone(), again: true }
                }
                Some(_) => Tell::Nothing,
            }];
        }
        if !(200..300).contains(&status) {
            return Vec::new();
        }
        let ended: Vec<String> =
            ["401".to_string(), format!("403 {what}")].into_iter().filter(|k| now.contains_key(k)).collect();
        ended.iter().filter_map(|k| now.remove(k)).map(|e| Tell::Ended { line: e.line, since: e.since }).collect()
    }

    /// The 403s on the plan objects in force, by kind (`403 update secrets`), each with its line.
    pub fn forbidden(&self) -> Vec<(String, String)> {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        now.iter().filter(|(_, e)| e.status == 403).map(|(k, e)| (k.clone(), e.line.clone())).collect()
    }

    /// The refusals in force.
    pub fn in_force(&self) -> InForce {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        let count = |s: u16| now.values().filter(|e| e.status == s).count() as i64;
        InForce {
            lines: now.values().map(|e| (e.line.clone(), e.since.clone())).collect(),
            counts: [(401, count(401)), (403, count(403))],
        }
    }
}

/// Which 403s a plan object was told of (by an Event), so each is told once while it lasts.
#[derive(Debug, Default)]
pub struct Told(std::collections::BTreeSet<String>);

impl Told {
    /// The lines of the refusals in `now` ([`Refusals::forbidden`]) not told yet; ended ones are
    /// forgotten, so a refusal that comes back is told again.
    pub fn news(&mut self, now: &[(String, String)]) -> Vec<String> {
        self.0.retain(|k| now.iter().any(|(n, _)| n == k));
        now.iter().filter(|(k, _)| self.0.insert(k.clone())).map(|(_, line)| line.clone()).collect()
    }
}

/// The refusals in force: each one's line and since when, and how many there are per status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InForce {
    pub lines: Vec<(String, String)>,
    pub counts: [(u16, i64); 2],
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::Method;

    #[test]
    fn a_request_is_named_by_its_verb_and_resource() {
        let table = [
            (Method::GET, "/api/v1/namespaces/ns/secrets/plan", "get secrets"),
            (Method::GET, "/api/v1/namespaces/ns/secrets?fieldSelector=metadata.name%3Dplan", "list secrets"),
            (Method::GET, "/api/v1/namespaces/ns/secrets?watch=1&resourceVersion=5", "watch secrets"),
            (Method::GET, "/api/v1/namespaces/ns/secrets?watch=true", "watch secrets"),
            (Method::PATCH, "/api/v1/namespaces/ns/secrets/plan", "patch secrets"),
            (Method::PUT, "/apis/coordination.k8s.io/v1/namespaces/ns/leases/nodeplan-plan", "update leases"),
            (Method::POST, "/apis/coordination.k8s.io/v1/namespaces/ns/leases", "create leases"),
            (Method::POST, "/api/v1/namespaces/ns/events", "create events"),
            (Method::PATCH, "/apis/nodeplan.io/v1alpha1/nodeplans/a/status", "patch nodeplans/status"),
            (Method::GET, "/apis/nodeplan.io/v1alpha1/nodeplans?labelSelector=x", "list nodeplans"),
            (Method::GET, "/api/v1/nodes/node-a", "get nodes"),
            (Method::GET, "/version", "get /version"),
        ];
        for (m, p, want) in table {
            assert_eq!(what(&m, p), want, "{m} {p}");
        }
    }

    /// A 403 is told once by an Event while it lasts, again if it comes back after it ended.
    #[test]
    fn each_refusal_is_told_once_while_it_lasts() {
        let mut told = Told::default();
        let update = ("403 update secrets".to_string(), "forbids update".to_string());
        let patch = ("403 patch nodeplans/status".to_string(), "forbids patch".to_string());
        assert_eq!(told.news(std::slice::from_ref(&update)), ["forbids update"]);
        assert!(told.news(std::slice::from_ref(&update)).is_empty(), "told already");
        assert_eq!(told.news(&[update.clone(), patch.clone()]), ["forbids patch"]);
        assert!(told.news(&[]).is_empty(), "both ended");
        assert_eq!(told.news(&[update]), ["forbids update"], "back again");
        // Only 403s on the plan objects are kept; 401s have no Event (the token writes none).
        let r = Refusals::default();
        let now = Instant::now();
        r.account(401, "list secrets", "t", now);
        r.account(403, "update leases", "t", now);
        r.account(403, "update secrets", "t", now);
        let forbidden = r.forbidden();
        assert_eq!(forbidden.len(), 1, "{forbidden:?}");
        assert!(forbidden[0].1.contains("forbids the agent to update secrets"), "{forbidden:?}");
    }

    #[test]
    fn a_refusal_is_said_when_it_starts_each_minute_it_lasts_and_when_it_ends() {
        let r = Refusals::default();
        let t0 = Instant::now();
        let at = |s: u64| (format!("2026-12-07T12:00:{s:02}Z"), t0 + Duration::from_secs(s));
        let (a0, i0) = at(0);
        let told = r.account(401, "update leases", &a0, i0);
        let [Tell::Refused { line, again: false, .. }] = told.as_slice() else { panic!("{told:?}") };
        assert!(line.contains("refused the agent's token (401 Unauthorized)") && line.contains("connectionInfoFile"));
        // Every request is refused: one entry, said again only a minute later.
        let (a, i) = at(30);
        assert_eq!(r.account(401, "list secrets", &a, i), [Tell::Nothing]);
        let (a, i) = at(59);
        assert_eq!(r.account(401, "update leases", &a, i), [Tell::Nothing]);
        let i = t0 + RETELL;
        assert!(
            matches!(&r.account(401, "update leases", "later", i)[..], [Tell::Refused { again: true, since, .. }] if *since == a0)
        );
        // A 403 is one entry per verb and resource; errors that are not refusals change nothing.
        let (a, i) = at(61);
        let told = r.account(403, "patch secrets", &a, i);
        assert!(
            matches!(&told[..], [Tell::Refused { line, .. }] if line.contains("forbids the agent to patch secrets (403 Forbidden)"))
        );
        assert_eq!(r.account(500, "patch secrets", &a, i), []);
        // Leases and Events have their own fallbacks (Rancher's role grants the Secret alone).
        assert_eq!(r.account(403, "create events", &a, i), []);
        assert_eq!(r.account(403, "get leases", &a, i), []);

        assert_eq!(r.account(409, "patch secrets", &a, i), []);
        let now = r.in_force();
        assert_eq!((now.lines.len(), now.counts), (2, [(401, 1), (403, 1)]));
        // A success ends the token's refusal and its own kind of 403, not another kind.
        let ended = r.account(200, "update leases", &a, i);
        assert!(matches!(&ended[..], [Tell::Ended { since, .. }] if *since == a0), "{ended:?}");
        assert_eq!(r.in_force().counts, [(401, 0), (403, 1)]);
        assert_eq!(r.account(201, "create events", &a, i), []);
        assert!(matches!(&r.account(200, "patch secrets", &a, i)[..], [Tell::Ended { .. }]));
        assert_eq!(r.in_force(), InForce { lines: vec![], counts: [(401, 0), (403, 0)] });
        // A NodePlan's status subresource is a plan object too.
        assert!(matches!(&r.account(403, "patch nodeplans/status", &a, i)[..], [Tell::Refused { .. }]));
        assert!(matches!(&r.account(200, "patch nodeplans/status", &a, i)[..], [Tell::Ended { .. }]));
    }
}
