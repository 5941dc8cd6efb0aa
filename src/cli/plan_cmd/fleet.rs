//! `plan status --selector` and `plan pause|resume|cancel|reset --selector`: every node's plan
//! Secret a label selector picks, at once. Rows come from [`crate::fleet`]; the Secrets are read
//! and watched through `remote::client`; each write is the same orchestrator patch as for one
//! `--secret`, bounded by `--request-timeout`, at most [`PARALLEL`] at a time.

use super::{Acting, Failure, NodeList, Output, PlanAction, RemoteTarget};
use crate::fleet::{self, Rows};
use crate::remote::client::{self, SecretClient, SecretRef, Selected};
use futures::StreamExt as _;

/// Writes in flight at once in a fan-out: enough to reach 500 nodes in a few seconds, few enough
/// not to trip the API server's own flow control.
pub const PARALLEL: usize = 16;

fn namespace_of(client: &kube::Client, given: Option<&String>) -> String {
    given.cloned().unwrap_or_else(|| client.default_namespace().to_string())
}

/// `status --selector S [--watch] [--output json]`.
pub(super) async fn status(selector: &str, l: &NodeList, t: &RemoteTarget) -> Result<(), Failure> {
    let kube = super::kube_client(t).await?;
    let ns = namespace_of(&kube, l.namespace.as_ref());
    let json = l.output == Output::Json;
    if !l.watch {
        let found = super::bounded(t, "list the plan Secrets", client::list_selected(kube, &ns, selector)).await?;
        let rows = fleet::sorted(found.iter().map(|(name, s)| fleet::row_of(name, s)).collect());
        if rows.is_empty() {
            super::super::say(&format!("nodeplan: no plan Secrets in namespace {ns} match {selector:?}"));
        }
        print_rows(&rows, json);
        return Ok(());
    }
    watch(kube, &ns, selector, json).await
}

fn print_rows(rows: &[fleet::Row], json: bool) {
    if json {
        for r in rows {
            crate::cli::out!("{}", r.json());
        }
    } else if !rows.is_empty() {
        crate::cli::out!("{}", fleet::table(rows));
        crate::cli::out!("{}", fleet::summary(rows));
    }
}

/// Follow the selected Secrets until Ctrl-C (or SIGTERM): JSON prints each node's row when it
/// changes (every transition once); the table is printed again after each change (in a terminal,
/// in place of the last one).
async fn watch(kube: kube::Client, ns: &str, selector: &str, json: bool) -> Result<(), Failure> {
    use std::io::IsTerminal as _;
    let redraw = std::io::stdout().is_terminal();
    let mut rows = Rows::default();
    let mut listed = false;
    let mut failing = false;
    let stream = client::watch_selected(kube, ns, selector);
    let mut stream = std::pin::pin!(stream);
    let stop = crate::cli::interrupted();
    let mut stop = std::pin::pin!(stop);
    loop {
        let event = tokio::select! {
            () = &mut stop => return Ok(()),
            e = stream.next() => e,
        };
        let Some(event) = event else { return Err(Failure::Failed("the watch ended".into())) };
        let changed = match event {
            Selected::Is(name, snap) => {
                failing = false;
                let row = fleet::row_of(&name, &snap);
                let line = row.json();
                let changed = rows.set(row);
                if changed && json {
                    crate::cli::out!("{line}");
                }
                changed
            }
            Selected::Gone(name) => {
                let changed = rows.remove(&name);
                if changed && json {
                    crate::cli::out!("{}", serde_json::json!({"node": name, "state": "deleted"}));
                }
                changed
            }
            Selected::Listed => {
                listed = true;
                true
            }
            Selected::Failed(e) => {
                if !failing {
                    super::super::say(&format!("nodeplan: watching the plan Secrets: {e}; trying again"));
                }
                failing = true;
                false
            }
        };
        if changed && listed && !json {
            if redraw {
                crate::cli::out!("\x1b[H\x1b[2J");
            }
            let all = rows.all();
            if all.is_empty() {
                crate::cli::out!("no plan Secrets in namespace {ns} match {selector:?} (watching)");
            } else {
                crate::cli::out!("{}\n{}\n", fleet::table(&all), fleet::summary(&all));
            }
        }
    }
}

/// The merge patch an orchestrator writes for `action`, and what it did, for the report.
pub(super) fn action_patch(action: &PlanAction) -> Option<(serde_json::Value, &'static str)> {
    use crate::plan::{ANNOTATION_CANCELED, ANNOTATION_PAUSED};
    use crate::remote::wire;
    Some(match action {
        PlanAction::Pause(_) => (wire::annotation_patch(ANNOTATION_PAUSED, Some("true")), "paused"),
        PlanAction::Resume(_) => (wire::annotation_patch(ANNOTATION_PAUSED, None), "resumed"),
        PlanAction::Cancel(_) => (wire::annotation_patch(ANNOTATION_CANCELED, Some("true")), "canceled"),
        PlanAction::Reset(_) => (wire::reset_patch(), "reset"),
        PlanAction::Push { .. } | PlanAction::Status { .. } => return None,
    })
}

/// `pause|resume|cancel|reset --selector S`: one pass over the selected Secrets, [`PARALLEL`]
/// writes at a time; one line per node, then a summary. Exit 1 when any write failed.
pub(super) async fn fan_out(action: &PlanAction, a: &Acting) -> Result<(), Failure> {
    let (Some(selector), Some((patch, done))) = (a.selector.as_deref(), action_patch(action)) else {
        return Err(Failure::Usage("no selector given".into()));
    };
    let t = &a.target.remote;
    let kube = super::kube_client(t).await?;
    let ns = namespace_of(&kube, a.namespace.as_ref());
    let found = super::bounded(t, "list the plan Secrets", client::list_selected(kube.clone(), &ns, selector)).await?;
    if found.is_empty() {
        super::super::say(&format!("nodeplan: no plan Secrets in namespace {ns} match {selector:?}; nothing {done}"));
        return Ok(());
    }
    let total = found.len();
    let results: Vec<(String, Result<(), String>)> = futures::stream::iter(found.into_iter().map(|(name, _)| {
        let c = SecretClient::new(kube.clone(), SecretRef { namespace: ns.clone(), name: name.clone() });
        let patch = patch.clone();
        async move {
            let r = super::bounded(t, "patch the secret", c.orchestrator_patch(patch)).await.map(|_| ());
            (name, r)
        }
    }))
    .buffer_unordered(PARALLEL)
    .collect()
    .await;
    let mut failed = 0;
    let mut results = results;
    results.sort_by(|x, y| x.0.cmp(&y.0));
    for (name, r) in &results {
        match r {
            Ok(()) => crate::cli::out!("{done} {ns}/{name}"),
            Err(e) => {
                failed += 1;
                super::super::say(&format!("nodeplan: {ns}/{name}: {e}"));
            }
        }
    }
    if failed > 0 {
        return Err(Failure::Failed(format!("{failed} of {total} plan Secrets could not be {done}")));
    }
    crate::cli::out!("{done} {total} plan Secrets matching {selector:?} in namespace {ns}");
    Ok(())
}
