//! `plan status --selector` and `plan pause|resume|cancel|reset --selector`: every node's plan
//! object (plan Secret, or NodePlan with `--nodeplans`) a label selector picks, at once. Rows come
//! from [`crate::fleet`]; the objects are read, watched and written through
//! [`crate::fleet::objects`]; each write is the same patch as for one `--secret` or `--nodeplan`,
//! bounded by `--request-timeout`, at most [`objects::PARALLEL`] at a time.

use super::{Acting, Failure, NodeList, Output, PlanAction, RemoteTarget};
use crate::fleet::objects::{self, Change, Kind, Scope, Tracker, Write};
use crate::fleet::{self, Rows};
use futures::StreamExt as _;
use std::time::Duration;

/// The selection: `kind`'s objects in `-n` (else the context's namespace), or in every namespace.
pub fn scope(kube: &kube::Client, kind: Kind, selector: &str, namespace: Option<&String>, all: bool) -> Scope {
    Scope {
        kind,
        namespace: (!all).then(|| namespace.cloned().unwrap_or_else(|| kube.default_namespace().to_string())),
        selector: selector.to_string(),
    }
}

fn kind(nodeplans: bool) -> Kind {
    if nodeplans { Kind::NodePlans } else { Kind::Secrets }
}

/// `status --selector S [--nodeplans] [--watch] [-o FORMAT]`.
pub(super) async fn status(selector: &str, l: &NodeList, t: &RemoteTarget) -> Result<(), Failure> {
    let kube = super::kube_client(t).await?;
    let scope = scope(&kube, kind(l.nodeplans), selector, l.namespace.as_ref(), l.all_namespaces);
    if !l.watch {
        let found = objects::list(kube, &scope, t.request_timeout).await?;
        let rows = fleet::sorted(found.iter().map(|(key, o)| o.row(&scope, key)).collect());
        if rows.is_empty() {
            super::super::say(&format!("nodeplan: no objects: {} (none)", scope.describe()));
        }
        print_rows(&rows, l.output);
        return Ok(());
    }
    watch(kube, &scope, l.output, t.request_timeout).await
}

/// `logs --selector S [--nodeplans]`: each selected node's logs after a `== node ==` line.
pub(super) async fn logs(a: &Acting) -> Result<(), Failure> {
    let t = &a.target.remote;
    let kube = super::kube_client(t).await?;
    let selector = a.selector.as_deref().unwrap_or_default();
    let scope = scope(&kube, kind(a.nodeplans), selector, a.namespace.as_ref(), a.all_namespaces);
    let found = objects::list(kube, &scope, t.request_timeout).await?;
    if found.is_empty() {
        super::super::say(&format!("nodeplan: no objects: {} (none)", scope.describe()));
    }
    for (key, o) in &found {
        crate::cli::out!("== {} ==", crate::plan::failure::shown_line(&o.standing(key).node));
        match fleet::logs::of_object(o) {
            Ok(lines) => super::print_lines(lines),
            Err(e) => crate::cli::out!("{e}"),
        }
    }
    Ok(())
}

fn print_rows(rows: &[fleet::Row], output: Output) {
    match output {
        Output::Table | Output::Wide if !rows.is_empty() => {
            crate::cli::out!("{}", fleet::table(rows, output == Output::Wide));
            crate::cli::out!("{}", fleet::summary(rows));
        }
        Output::Table | Output::Wide => {}
        _ => crate::cli::format::print(rows, false, output, fleet::Row::kube_name),
    }
}

/// Follow the selected objects until Ctrl-C (or SIGTERM): JSON, YAML and names show each node's
/// row when it changes (every transition once); the table is printed again after each change (in
/// a terminal, in place of the last one).
async fn watch(kube: kube::Client, scope: &Scope, output: Output, request_timeout: Duration) -> Result<(), Failure> {
    let each = !output.text();
    let show = |row: &fleet::Row| match output {
        Output::Name => row.kube_name(),
        _ => crate::cli::format::change(row, output),
    };
    use std::io::IsTerminal as _;
    let redraw = std::io::stdout().is_terminal();
    let mut rows = Rows::default();
    let mut tracker = Tracker::default();
    let mut stream = objects::watch(kube, scope);
    let stop = crate::cli::interrupted();
    let mut stop = std::pin::pin!(stop);
    // The first list is one request's work: an API server that cannot be read ends the watch
    // (exit 1) after --request-timeout rather than being retried for ever. Later outages are
    // ridden out (the watch lists again).
    let first_list = tokio::time::sleep(request_timeout);
    let mut first_list = std::pin::pin!(first_list);
    loop {
        let event = tokio::select! {
            () = &mut stop => return Ok(()),
            () = &mut first_list, if !tracker.listed => {
                return Err(Failure::Failed(format!(
                    "cannot read the API server: {} could not be listed within {} (--request-timeout)",
                    scope.describe(),
                    crate::duration::show(request_timeout)
                )));
            }
            e = stream.next() => e,
        };
        let Some(event) = event else { return Err(Failure::Failed("the watch ended".into())) };
        let mut forget = |key: &str| {
            let gone = rows.remove(key);
            if let Some(row) = &gone
                && each
            {
                crate::cli::out!("{}", show(&fleet::Row { state: "deleted".into(), ..row.clone() }));
            }
            gone.is_some()
        };
        let changed = match tracker.apply(event) {
            Change::Is(key) => {
                let Some(o) = tracker.objects.get(&key) else { continue };
                let row = o.row(scope, &key);
                let line = show(&row);
                let changed = rows.set(&key, row);
                if changed && each {
                    crate::cli::out!("{line}");
                }
                changed
            }
            Change::Gone(key) => forget(&key),
            Change::Listed(gone) => {
                for key in gone {
                    forget(&key);
                }
                true
            }
            Change::None => false,
        };
        if changed && tracker.listed && !each {
            if redraw {
                crate::cli::out_raw!("\x1b[H\x1b[2J");
            }
            let all = rows.all();
            if all.is_empty() {
                crate::cli::out!("none of {} (watching)", scope.describe());
            } else {
                crate::cli::out!("{}\n{}\n", fleet::table(&all, output == Output::Wide), fleet::summary(&all));
            }
        }
    }
}

/// The merge patch an orchestrator writes to a plan Secret for `action`, and what it did.
pub(super) fn action_patch(action: &PlanAction) -> Option<(serde_json::Value, &'static str)> {
    use crate::plan::{ANNOTATION_CANCELED, ANNOTATION_PAUSED};
    use crate::remote::wire;
    Some(match action {
        PlanAction::Pause(_) => (wire::annotation_patch(ANNOTATION_PAUSED, Some("true")), "paused"),
        PlanAction::Resume(_) => (wire::annotation_patch(ANNOTATION_PAUSED, None), "resumed"),
        PlanAction::Cancel(_) => (wire::annotation_patch(ANNOTATION_CANCELED, Some("true")), "canceled"),
        PlanAction::Reset(_) => (wire::reset_patch(), "reset"),
        PlanAction::Push { .. } | PlanAction::Status { .. } | PlanAction::Logs(_) => return None,
    })
}

/// The spec patch written to a NodePlan for `action` (as `--nodeplan` writes it), and what it did.
fn nodeplan_patch(action: &PlanAction) -> Option<(serde_json::Value, &'static str)> {
    use crate::nodeplan::cli_wire::{self, Control};
    Some(match action {
        PlanAction::Pause(_) => (Control::Pause.patch(), "paused"),
        PlanAction::Resume(_) => (Control::Resume.patch(), "resumed"),
        PlanAction::Cancel(_) => (Control::Cancel.patch(), "canceled"),
        PlanAction::Reset(_) => {
            let token = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
            (cli_wire::reset_patch(&token), "reset")
        }
        PlanAction::Push { .. } | PlanAction::Status { .. } | PlanAction::Logs(_) => return None,
    })
}

/// `pause|resume|cancel|reset --selector S [--nodeplans]`: one pass over the selected objects,
/// [`objects::PARALLEL`] writes at a time; one line per node, then a summary. Exit 1 when any
/// write failed.
pub(super) async fn fan_out(action: &PlanAction, a: &Acting) -> Result<(), Failure> {
    let patch = if a.nodeplans { nodeplan_patch(action) } else { action_patch(action) };
    let (Some(selector), Some((patch, done))) = (a.selector.as_deref(), patch) else {
        return Err(Failure::Usage("no selector given".into()));
    };
    let t = &a.target.remote;
    let kube = super::kube_client(t).await?;
    let scope = scope(&kube, kind(a.nodeplans), selector, a.namespace.as_ref(), a.all_namespaces);
    let found = objects::list(kube.clone(), &scope, t.request_timeout).await?;
    if found.is_empty() {
        super::super::say(&format!("nodeplan: none of {}; nothing {done}", scope.describe()));
        return Ok(());
    }
    let total = found.len();
    let writes = found.into_iter().map(|(key, _)| (key, Write::Merge(patch.clone()))).collect();
    let results = objects::write_all(&kube, &scope, writes, t.request_timeout).await;
    let failed = tell_writes(&scope, results, done);
    if failed > 0 {
        return Err(Failure::Failed(format!("{failed} of {total} could not be {done}")));
    }
    crate::cli::out!("{done} {total} {}", scope.describe().trim_start_matches("the "));
    Ok(())
}

/// A line per node written (`{done} NAMESPACE/NAME`) and an error line per node that was not;
/// how many were not.
pub(in crate::cli) fn tell_writes(
    scope: &Scope,
    answers: Vec<(String, Result<objects::Object, String>)>,
    done: &str,
) -> usize {
    let mut failed = 0;
    for (key, r) in answers {
        let (ns, name) = scope.locate(&key);
        match r {
            Ok(_) => crate::cli::out!("{done} {ns}/{name}"),
            Err(e) => {
                failed += 1;
                super::super::say(&format!("nodeplan: {ns}/{name}: {e}"));
            }
        }
    }
    failed
}
