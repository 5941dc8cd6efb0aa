//! The node's state disk, one operation at a time, off the agent's threads (R31).
//!
//! The agent's state directories (the work directory and its lock, the interlock, the applied-plan
//! directory with its kept outcomes, the NodePlan runs) usually share one filesystem, and that
//! filesystem can stop answering: frozen for a snapshot (`fsfreeze`), a hung network disk, a
//! dying device. A process that touches it then sleeps in the kernel where no signal reaches it.
//! So every operation on those directories goes to the *lane*, off the agent's threads, which runs
//! them one at a time in the order they were handed over. A caller waits for its own operation
//! only as long as it must ([`run`]: until it is done, [`within`]: up to a limit, [`queue`]: not
//! at all), and an operation a caller stopped waiting for still runs, in its place: whatever comes
//! after it (a clear after a save, the next apply's wipe after an interrupted one's preparation, a
//! lock's release and the next take of it) runs after it. A value whose drop touches the disk (a
//! lock file, the interlock) is dropped on the lane ([`Later`]).
//!
//! Owns: the lane (the order of the operations). Must not: know what the operations mean, or run
//! anything that waits on something other than the disk (an operation that waits for another
//! holds every one behind it).

use std::collections::VecDeque;
use std::io;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long the agent waits for the disk where it can go on without it (a record that only guards
/// a restart, a clean-up) before it goes on, or, where it cannot, before it says that it waits.
pub const PATIENCE: Duration = Duration::from_secs(5);

/// An operation handed to the lane, with the sending of its result.
type Job = Box<dyn FnOnce() + Send>;

/// The operations handed over and not yet run, in order, and whether a worker runs them.
struct Lane {
    jobs: VecDeque<Job>,
    worker: bool,
}

static LANE: Mutex<Lane> = Mutex::new(Lane { jobs: VecDeque::new(), worker: false });

fn lane() -> MutexGuard<'static, Lane> {
    LANE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hand `f` to the lane. The returned future gives its result once it ran; dropping the future
/// does not stop `f`, which runs in its turn all the same.
///
/// One worker at a time runs the operations, a task of the runtime's blocking pool that ends when
/// none is left (so tokio's paused clock in tests sees the work in flight, as it sees any blocking
/// task). A disk that does not answer holds that one thread: what waits behind it is a queue
/// entry, not a thread each, however long the disk takes.
pub fn run<T: Send + 'static>(f: impl FnOnce() -> io::Result<T> + Send + 'static) -> Pending<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        // A panicking operation is that operation's error (its caller hears the sender go), never
        // the end of the lane.
        if let Ok(r) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            let _ = tx.send(r);
        }
    });
    let start = {
        let mut lane = lane();
        lane.jobs.push_back(job);
        !std::mem::replace(&mut lane.worker, true)
    };
    if start {
        start_worker();
    }
    Pending(rx)
}

/// The worker's place: a worker that never ran (its runtime shut down first and dropped it, or no
/// thread could be started) gives it up when dropped, and the next operation starts another one,
/// which runs what was left in order.
struct Worker {
    done: bool,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if !self.done {
            lane().worker = false;
        }
    }
}

fn start_worker() {
    let worker = Worker { done: false };
    let work = move || {
        // The whole value moves in (not only the field it sets), so its drop is the worker's.
        let mut worker = worker;
        loop {
            let job = {
                let mut lane = lane();
                match lane.jobs.pop_front() {
                    Some(job) => job,
                    None => {
                        lane.worker = false;
                        worker.done = true;
                        return;
                    }
                }
            };
            job();
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(work)),
        // Outside a runtime (a value dropped late by a test): a thread of its own.
        Err(_) => {
            if let Err(e) = std::thread::Builder::new().name("nodeplan-disk".into()).spawn(work) {
                tracing::error!("cannot start a thread for the disk: {e}");
            }
        }
    }
}

/// Hand `f` to the lane without waiting for it (a clean-up, a removal): it runs in its turn.
pub fn queue(f: impl FnOnce() + Send + 'static) {
    drop(run(move || {
        f();
        Ok(())
    }));
}

/// [`run`], waited for at most `limit`: `None` when the disk did not answer in time (`f` still
/// runs in its turn).
pub async fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> Option<io::Result<T>> {
    tokio::time::timeout(limit, run(f)).await.ok()
}

/// Wait, at most `limit`, until every operation handed to the lane so far has run: a command's
/// last step, since the runtime drops the operations it has not started when it goes (a successful
/// apply's execution directory would stay, a kept outcome would not be cleared). `false` when the
/// disk did not answer in time.
pub async fn settle(limit: Duration) -> bool {
    if !lane().worker {
        return true;
    }
    within(limit, || Ok(())).await.is_some()
}

/// The result of an operation handed to the lane.
pub struct Pending<T>(tokio::sync::oneshot::Receiver<io::Result<T>>);

impl<T> std::future::Future for Pending<T> {
    type Output = io::Result<T>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(io::Error::other("the disk operation did not finish (it panicked)"))))
    }
}

/// A value whose drop touches the state disk (a lock file removed, the interlock left): dropped on
/// the lane, after every operation handed to it before, so the agent's threads never wait for it.
pub struct Later<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> Later<T> {
    pub fn new(value: T) -> Later<T> {
        Later(Some(value))
    }
}

impl<T: Send + 'static> Drop for Later<T> {
    fn drop(&mut self) {
        if let Some(v) = self.0.take() {
            queue(move || drop(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex, mpsc};

    /// A disk that does not answer until told to: the operation blocks on a channel.
    fn stalled() -> (mpsc::Sender<()>, impl FnOnce() -> io::Result<&'static str> + Send + 'static) {
        let (go, wait) = mpsc::channel::<()>();
        (go, move || {
            let _ = wait.recv();
            Ok("saved")
        })
    }

    #[tokio::test]
    async fn operations_run_in_order_even_when_their_callers_stopped_waiting() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (go, save) = stalled();
        let s = seen.clone();
        let waited = within(Duration::from_millis(50), move || {
            let r = save();
            s.lock().unwrap().push("save");
            r
        })
        .await;
        assert!(waited.is_none(), "the stalled save is given up by its caller");
        let s = seen.clone();
        let clear = run(move || {
            s.lock().unwrap().push("clear");
            Ok(())
        });
        go.send(()).unwrap();
        clear.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), ["save", "clear"], "the clear runs after the save it follows");
    }

    #[tokio::test]
    async fn a_value_dropped_later_is_dropped_in_its_turn() {
        struct Noted(Arc<Mutex<Vec<&'static str>>>);
        impl Drop for Noted {
            fn drop(&mut self) {
                self.0.lock().unwrap().push("released");
            }
        }
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (go, save) = stalled();
        let first = run(save);
        drop(Later::new(Noted(seen.clone())));
        assert!(seen.lock().unwrap().is_empty(), "the drop waits for the operation before it");
        let s = seen.clone();
        let after = run(move || {
            s.lock().unwrap().push("next");
            Ok(())
        });
        go.send(()).unwrap();
        assert_eq!(first.await.unwrap(), "saved");
        after.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), ["released", "next"]);
    }

    #[tokio::test]
    async fn settling_waits_for_everything_handed_over_as_long_as_the_disk_answers() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (go, save) = stalled();
        let s = seen.clone();
        queue(move || {
            let _ = save();
            s.lock().unwrap().push("save");
        });
        let s = seen.clone();
        queue(move || s.lock().unwrap().push("remove"));
        assert!(
            !settle(Duration::from_millis(50)).await,
            "a disk that does not answer is not waited for past the limit"
        );
        assert!(seen.lock().unwrap().is_empty());
        go.send(()).unwrap();
        assert!(settle(Duration::from_secs(60)).await);
        assert_eq!(*seen.lock().unwrap(), ["save", "remove"], "both ran before settle returned");
    }

    /// The threads of this process (a test runs in a process of its own).
    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").unwrap().count()
    }

    #[tokio::test]
    async fn a_disk_that_does_not_answer_holds_one_thread_however_much_waits_behind_it() {
        let (go, save) = stalled();
        // The worker's thread is started by `run` itself (the blocking pool spawns it at once), so
        // it is counted here.
        let first = run(save);
        let before = threads();
        let seen = Arc::new(Mutex::new(0));
        for _ in 0..64 {
            let s = seen.clone();
            queue(move || *s.lock().unwrap() += 1);
        }
        assert!(threads() <= before + 1, "64 operations waiting: {} threads, {before} before", threads());
        go.send(()).unwrap();
        assert_eq!(first.await.unwrap(), "saved");
        assert!(settle(Duration::from_secs(60)).await);
        assert_eq!(*seen.lock().unwrap(), 64, "every operation ran once the disk answered");
    }

    #[tokio::test]
    async fn a_panicking_operation_is_its_callers_error_and_the_lane_goes_on() {
        let r = run(|| -> io::Result<()> { panic!("boom") }).await;
        assert!(r.unwrap_err().to_string().contains("did not finish"));
        assert_eq!(run(|| Ok(7)).await.unwrap(), 7);
        assert_eq!(within(Duration::from_secs(60), || Ok(8)).await.unwrap().unwrap(), 8);
    }
}
