//! The one conditional writer: every write of plan state to a Kubernetes object (the plan Secret's
//! data, a NodePlan's status) goes through [`write`].
//!
//! A write carries the resourceVersion of its base as the precondition. Each answer is handled
//! the same way whatever the object:
//! - 409: the object is read again. An outcome (`reapply`) is written again on the fresh object
//!   when it still belongs to the same run. A state transition decided from the old object is
//!   abandoned, so the loop decides afresh (R13: a resume never overwrites an update made
//!   meanwhile).
//! - 404: the object is gone, so the write is abandoned.
//! - 429: the write fails with the server's `retryAfterSeconds` hint, for the loop's back-off to
//!   honour.
//! - Anything else, or no answer within [`API_TIMEOUT`]: the write fails with one line. The loop
//!   keeps an outcome and writes it again.
//!
//! Owns: the write/reread cycle and its bounds. The [`Target`] (a source's adapter) owns what a
//! write means for its object: what to send on a base, whether a fresh object still belongs to
//! the run, and where the object's newest version is remembered.

use super::error_line;
use crate::metrics::{self, RetryReason, WriteTarget};
use std::time::Duration;

/// Every request of a write is bounded: kube has no overall deadline of its own.
pub const API_TIMEOUT: Duration = Duration::from_secs(15);
/// Conflicts in a row before a write gives up (the object keeps changing under it).
const MAX_CONFLICTS: usize = 8;

/// Why a write did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// 409: the resourceVersion precondition did not hold (someone else wrote first).
    #[error("conflict: the object was modified since the resourceVersion given")]
    Conflict,
    /// 404: the object (or its namespace) does not exist.
    #[error("not found: the object does not exist")]
    NotFound,
    /// 429: the API server asks clients to slow down, with its hint when the answer is a Status
    /// carrying `details.retryAfterSeconds`. The API server's own throttling (max-in-flight,
    /// priority and fairness) sends its hint only as a `Retry-After` header with a plain-text body;
    /// kube keeps only the body of an error answer, so that hint is not seen (`None`).
    #[error("too many requests: the API server asked to slow down")]
    TooManyRequests { retry_after: Option<Duration> },
    /// Anything else (transport, auth, validation, a malformed answer).
    #[error("{0}")]
    Other(String),
}

impl From<kube::Error> for WriteError {
    fn from(err: kube::Error) -> WriteError {
        match &err {
            kube::Error::Api(status) if status.code == 409 => WriteError::Conflict,
            kube::Error::Api(status) if status.code == 404 => WriteError::NotFound,
            kube::Error::Api(status) if status.code == 429 => WriteError::TooManyRequests {
                retry_after: status
                    .details
                    .as_ref()
                    .map(|d| d.retry_after_seconds)
                    .filter(|s| *s > 0)
                    .map(|s| Duration::from_secs(u64::from(s))),
            },
            _ => WriteError::Other(error_line(&err)),
        }
    }
}

/// How a write ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// It landed, or there was nothing left to write.
    Done,
    /// It must not land: the object is gone, or changed in a way that calls for a fresh decision
    /// (another plan, a concurrent update): look again now.
    Abandoned,
    /// It did not land (an outage, a refusal, throttling); an outcome is kept and written again.
    /// `retry_after` is the server's own hint, if it gave one (HTTP 429).
    Failed { error: String, retry_after: Option<Duration> },
}

impl Written {
    pub fn failed(error: impl Into<String>) -> Written {
        Written::Failed { error: error.into(), retry_after: None }
    }
}

/// What to send on a base.
pub enum Prepared<P> {
    /// The base already holds everything: nothing to send.
    Nothing,
    /// Send this.
    Send(P),
    /// It cannot be sent (the write fails with this line).
    Fail(String),
}

/// One object as a write target: a source's thin adapter.
pub trait Target {
    /// The object as the API server returns it.
    type Object: Clone + Send;
    /// What one request sends (a patch, a whole status).
    type Payload: Send;

    /// Which metric series its retries count in.
    const METRIC: WriteTarget;

    /// The object named for messages (`secret ns/name`, `nodeplan ns/name`).
    fn what(&self) -> String;
    /// Whether `object` (the base, or what a read after a conflict returned) still belongs to the
    /// run being written for.
    fn belongs(&self, object: &Self::Object) -> bool;
    /// What to send on `base`.
    fn prepare(&self, base: &Self::Object) -> Prepared<Self::Payload>;
    /// The conditional write of `payload` on `base` (its resourceVersion is the precondition).
    fn send(
        &self,
        base: &Self::Object,
        payload: Self::Payload,
    ) -> impl Future<Output = Result<Self::Object, WriteError>> + Send;
    /// A fresh read (`None`: the object is gone).
    fn read(&self) -> impl Future<Output = Result<Option<Self::Object>, String>> + Send;
    /// The watch's sequence number now: an event that arrives after a request was sent is newer
    /// than that request's answer.
    fn seq(&self) -> u64;
    /// `new` is the newest object: the answer to a request sent at `sent`, which replaced `older`;
    /// `written` when it is the answer to this writer's own write (not a read after a conflict).
    fn remember(&mut self, new: Self::Object, sent: u64, older: &Self::Object, written: bool);
}

/// Write conditionally on `base`, reading again after a conflict: `reapply` says whether the
/// write is an outcome (written again on the fresh object while it belongs to the run) or a
/// transition (abandoned after a conflict).
pub async fn write<T: Target>(target: &mut T, mut base: T::Object, reapply: bool) -> Written {
    for _ in 0..MAX_CONFLICTS {
        if !target.belongs(&base) {
            return Written::Abandoned;
        }
        let payload = match target.prepare(&base) {
            Prepared::Nothing => return Written::Done,
            Prepared::Send(p) => p,
            Prepared::Fail(e) => return Written::failed(format!("{}: {e}", target.what())),
        };
        let sent = target.seq();
        match tokio::time::timeout(API_TIMEOUT, target.send(&base, payload)).await {
            Ok(Ok(new)) => {
                target.remember(new, sent, &base, true);
                return Written::Done;
            }
            Ok(Err(WriteError::Conflict)) => {
                tracing::info!("{}: write conflicted (409); reading it again", target.what());
                let sent = target.seq();
                match tokio::time::timeout(API_TIMEOUT, target.read()).await {
                    Ok(Ok(Some(fresh))) => {
                        // Never act on anything older than what was just read.
                        target.remember(fresh.clone(), sent, &base, false);
                        if !reapply {
                            return Written::Abandoned;
                        }
                        base = fresh;
                        metrics::write_retried(T::METRIC, RetryReason::Conflict);
                    }
                    Ok(Ok(None)) => return Written::Abandoned,
                    Ok(Err(e)) => return Written::failed(e),
                    Err(_) => return Written::failed(format!("{}: timed out reading it", target.what())),
                }
            }
            Ok(Err(WriteError::NotFound)) => return Written::Abandoned,
            Ok(Err(WriteError::TooManyRequests { retry_after })) => {
                return Written::Failed { error: "the API server asked to slow down (429)".into(), retry_after };
            }
            Ok(Err(WriteError::Other(e))) => return Written::failed(format!("{}: {e}", target.what())),
            Err(_) => return Written::failed(format!("{}: timed out writing it", target.what())),
        }
    }
    Written::failed(format!("{}: it kept changing under every write", target.what()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// A scripted object: versions are numbers, the "plan" is a string.
    #[derive(Clone, Debug, PartialEq)]
    struct Obj {
        rv: u32,
        plan: &'static str,
        value: u32,
    }

    struct Scripted {
        answers: Mutex<VecDeque<Result<Obj, WriteError>>>,
        reads: Mutex<VecDeque<Result<Option<Obj>, String>>>,
        plan: &'static str,
        want: u32,
        sent: Mutex<Vec<(u32, u32)>>,
        remembered: Vec<(u32, u32, bool)>,
    }

    impl Scripted {
        fn new(answers: Vec<Result<Obj, WriteError>>, reads: Vec<Result<Option<Obj>, String>>) -> Scripted {
            Scripted {
                answers: Mutex::new(answers.into()),
                reads: Mutex::new(reads.into()),
                plan: "p",
                want: 7,
                sent: Mutex::default(),
                remembered: Vec::new(),
            }
        }
    }

    impl Target for Scripted {
        type Object = Obj;
        type Payload = u32;
        const METRIC: WriteTarget = WriteTarget::Secret;

        fn what(&self) -> String {
            "thing t".into()
        }
        fn belongs(&self, o: &Obj) -> bool {
            o.plan == self.plan
        }
        fn prepare(&self, base: &Obj) -> Prepared<u32> {
            if base.value == self.want { Prepared::Nothing } else { Prepared::Send(self.want) }
        }
        async fn send(&self, base: &Obj, payload: u32) -> Result<Obj, WriteError> {
            self.sent.lock().unwrap().push((base.rv, payload));
            self.answers.lock().unwrap().pop_front().unwrap_or_else(|| Err(WriteError::Other("unscripted".into())))
        }
        async fn read(&self) -> Result<Option<Obj>, String> {
            self.reads.lock().unwrap().pop_front().unwrap_or_else(|| Err("unscripted read".into()))
        }
        fn seq(&self) -> u64 {
            0
        }
        fn remember(&mut self, new: Obj, _sent: u64, older: &Obj, written: bool) {
            self.remembered.push((older.rv, new.rv, written));
        }
    }

    fn obj(rv: u32, plan: &'static str, value: u32) -> Obj {
        Obj { rv, plan, value }
    }

    /// Every answer, one row each: what the writer returns, what it sent on which base, and what
    /// it remembered as the newest object.
    #[tokio::test]
    async fn every_answer_is_handled_the_same_way_for_every_object() {
        let conflict = || Err(WriteError::Conflict);
        let slow = WriteError::TooManyRequests { retry_after: Some(Duration::from_secs(7)) };
        struct Row {
            name: &'static str,
            reapply: bool,
            base: Obj,
            answers: Vec<Result<Obj, WriteError>>,
            reads: Vec<Result<Option<Obj>, String>>,
            want: Written,
            sent: Vec<(u32, u32)>,
            remembered: Vec<(u32, u32, bool)>,
        }
        let rows = vec![
            Row {
                name: "lands",
                reapply: false,
                base: obj(1, "p", 0),
                answers: vec![Ok(obj(2, "p", 7))],
                reads: vec![],
                want: Written::Done,
                sent: vec![(1, 7)],
                remembered: vec![(1, 2, true)],
            },
            Row {
                name: "nothing to write",
                reapply: true,
                base: obj(1, "p", 7),
                answers: vec![],
                reads: vec![],
                want: Written::Done,
                sent: vec![],
                remembered: vec![],
            },
            Row {
                name: "another run's object",
                reapply: true,
                base: obj(1, "q", 0),
                answers: vec![],
                reads: vec![],
                want: Written::Abandoned,
                sent: vec![],
                remembered: vec![],
            },
            Row {
                name: "an outcome is written again on the fresh object",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![conflict(), Ok(obj(4, "p", 7))],
                reads: vec![Ok(Some(obj(3, "p", 0)))],
                want: Written::Done,
                sent: vec![(1, 7), (3, 7)],
                remembered: vec![(1, 3, false), (3, 4, true)],
            },
            Row {
                name: "a transition is abandoned after a conflict",
                reapply: false,
                base: obj(1, "p", 0),
                answers: vec![conflict()],
                reads: vec![Ok(Some(obj(3, "p", 0)))],
                want: Written::Abandoned,
                sent: vec![(1, 7)],
                remembered: vec![(1, 3, false)],
            },
            Row {
                name: "an outcome for a plan replaced meanwhile is abandoned",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![conflict()],
                reads: vec![Ok(Some(obj(3, "q", 0)))],
                want: Written::Abandoned,
                sent: vec![(1, 7)],
                remembered: vec![(1, 3, false)],
            },
            Row {
                name: "the fresh object already holds it",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![conflict()],
                reads: vec![Ok(Some(obj(3, "p", 7)))],
                want: Written::Done,
                sent: vec![(1, 7)],
                remembered: vec![(1, 3, false)],
            },
            Row {
                name: "gone at the reread",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![conflict()],
                reads: vec![Ok(None)],
                want: Written::Abandoned,
                sent: vec![(1, 7)],
                remembered: vec![],
            },
            Row {
                name: "the reread fails",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![conflict()],
                reads: vec![Err("get thing t: refused".into())],
                want: Written::Failed { error: "get thing t: refused".into(), retry_after: None },
                sent: vec![(1, 7)],
                remembered: vec![],
            },
            Row {
                name: "gone",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![Err(WriteError::NotFound)],
                reads: vec![],
                want: Written::Abandoned,
                sent: vec![(1, 7)],
                remembered: vec![],
            },
            Row {
                name: "throttled, with the server's hint",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![Err(slow)],
                reads: vec![],
                want: Written::Failed {
                    error: "the API server asked to slow down (429)".into(),
                    retry_after: Some(Duration::from_secs(7)),
                },
                sent: vec![(1, 7)],
                remembered: vec![],
            },
            Row {
                name: "refused",
                reapply: true,
                base: obj(1, "p", 0),
                answers: vec![Err(WriteError::Other("the API server answered 403 Forbidden: no".into()))],
                reads: vec![],
                want: Written::Failed {
                    error: "thing t: the API server answered 403 Forbidden: no".into(),
                    retry_after: None,
                },
                sent: vec![(1, 7)],
                remembered: vec![],
            },
        ];
        for r in rows {
            let mut t = Scripted::new(r.answers, r.reads);
            let got = write(&mut t, r.base, r.reapply).await;
            assert_eq!(got, r.want, "{}", r.name);
            assert_eq!(*t.sent.lock().unwrap(), r.sent, "{}: sent", r.name);
            assert_eq!(t.remembered, r.remembered, "{}: remembered", r.name);
        }
    }

    /// An object that changes under every write is given up after a bound, not for ever.
    #[tokio::test]
    async fn a_write_gives_up_on_an_object_that_keeps_changing() {
        let n = MAX_CONFLICTS;
        let answers = (0..n).map(|_| Err(WriteError::Conflict)).collect();
        let reads = (0..n).map(|i| Ok(Some(obj(10 + i as u32, "p", 0)))).collect();
        let mut t = Scripted::new(answers, reads);
        let got = write(&mut t, obj(1, "p", 0), true).await;
        assert_eq!(got, Written::failed("thing t: it kept changing under every write"));
        assert_eq!(t.sent.lock().unwrap().len(), n);
    }

    /// A write that gets no answer fails within the bound (paused time: no real wait).
    #[tokio::test(start_paused = true)]
    async fn a_write_without_an_answer_fails_within_its_bound() {
        struct Silent;
        impl Target for Silent {
            type Object = Obj;
            type Payload = ();
            const METRIC: WriteTarget = WriteTarget::NodePlan;
            fn what(&self) -> String {
                "thing s".into()
            }
            fn belongs(&self, _: &Obj) -> bool {
                true
            }
            fn prepare(&self, _: &Obj) -> Prepared<()> {
                Prepared::Send(())
            }
            async fn send(&self, _: &Obj, _: ()) -> Result<Obj, WriteError> {
                std::future::pending().await
            }
            async fn read(&self) -> Result<Option<Obj>, String> {
                std::future::pending().await
            }
            fn seq(&self) -> u64 {
                0
            }
            fn remember(&mut self, _: Obj, _: u64, _: &Obj, _: bool) {}
        }
        let started = tokio::time::Instant::now();
        let got = write(&mut Silent, obj(1, "p", 0), true).await;
        assert_eq!(got, Written::failed("thing s: timed out writing it"));
        assert_eq!(started.elapsed(), API_TIMEOUT);
    }

    #[test]
    fn kube_errors_map_to_write_errors() {
        let status = |code: u16| kube::Error::Api(kube::core::Status::failure("m", "R").with_code(code).boxed());
        assert_eq!(WriteError::from(status(409)), WriteError::Conflict);
        assert_eq!(WriteError::from(status(404)), WriteError::NotFound);
        let mut throttled = kube::core::Status::failure("m", "TooManyRequests").with_code(429);
        assert_eq!(
            WriteError::from(kube::Error::Api(throttled.clone().boxed())),
            WriteError::TooManyRequests { retry_after: None }
        );
        throttled.details = serde_json::from_value(serde_json::json!({"retryAfterSeconds": 7})).ok();
        assert_eq!(
            WriteError::from(kube::Error::Api(throttled.boxed())),
            WriteError::TooManyRequests { retry_after: Some(Duration::from_secs(7)) }
        );
        match WriteError::from(status(422)) {
            WriteError::Other(msg) => assert!(msg.contains("422"), "{msg}"),
            other => panic!("expected Other, got {other:?}"),
        }
    }
}
