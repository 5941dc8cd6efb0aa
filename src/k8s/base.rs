//! The base of an agent's next write to one Kubernetes object (the plan Secret, a NodePlan): the
//! object its own last write returned, unless the watch has delivered something newer since.
//!
//! Kubernetes resourceVersions are opaque: they are only compared for equality. What makes a
//! watched version "not newer" is that the agent has moved past it already (it was the base of one
//! of its writes, or what a write replaced), and what makes it newer is arriving after the write
//! was sent (the watch's sequence number then).

use std::collections::VecDeque;

/// How many resourceVersions the agent has moved past are remembered (a watch lags a few events
/// behind at most).
const PASSED_KEPT: usize = 16;

/// What the agent knows of its own writes to one object.
#[derive(Debug, Clone)]
pub struct WriteBase<T> {
    /// The object the last write (or a read after a conflict) returned, and the watch's sequence
    /// number when that write was sent.
    own: Option<(u64, T)>,
    passed: VecDeque<String>,
}

impl<T> Default for WriteBase<T> {
    fn default() -> Self {
        WriteBase { own: None, passed: VecDeque::new() }
    }
}

impl<T: Clone> WriteBase<T> {
    /// The newest view: the own write's object, unless the watch (now at `seq`, holding
    /// `watched`) delivered an event after that write was sent that the agent has not moved past.
    pub fn current(&self, seq: u64, watched: Option<T>, rv: impl Fn(&T) -> &str) -> Option<T> {
        match &self.own {
            Some((at, own)) if *at >= seq => Some(own.clone()),
            Some((_, own)) if watched.as_ref().is_some_and(|w| self.passed.iter().any(|p| p == rv(w))) => {
                Some(own.clone())
            }
            _ => watched,
        }
    }

    fn pass(&mut self, version: &str) {
        if !self.passed.iter().any(|p| p == version) {
            if self.passed.len() == PASSED_KEPT {
                self.passed.pop_front();
            }
            self.passed.push_back(version.to_string());
        }
    }

    /// `new` is the newest object: what a write (or a read) sent when the watch's sequence number
    /// was `sent` returned, replacing `older` (the write's base).
    pub fn remember(&mut self, new: T, sent: u64, older: &str, rv: impl Fn(&T) -> &str) {
        if let Some((_, old)) = self.own.take()
            && rv(&old) != rv(&new)
        {
            let old = rv(&old).to_string();
            self.pass(&old);
        }
        if older != rv(&new) {
            self.pass(older);
        }
        self.own = Some((sent, new));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rv<'a>(s: &'a (String, &'static str)) -> &'a str {
        &s.0
    }

    fn obj(version: &str, what: &'static str) -> (String, &'static str) {
        (version.to_string(), what)
    }

    #[test]
    fn own_writes_win_over_a_lagging_watch_and_lose_to_newer_events() {
        let mut b = WriteBase::default();
        assert_eq!(b.current(1, Some(obj("5", "watched")), rv), Some(obj("5", "watched")));
        b.remember(obj("6", "first"), 1, "5", rv);
        assert_eq!(b.current(1, Some(obj("5", "watched")), rv), Some(obj("6", "first")), "nothing newer yet");
        b.remember(obj("7", "second"), 1, "6", rv);
        // The echoes of the writes and of their base arrive late: not newer.
        for old in ["5", "6"] {
            assert_eq!(b.current(2, Some(obj(old, "echo")), rv), Some(obj("7", "second")), "{old}");
        }
        // An unknown version delivered after the write was sent is newer (another writer's).
        assert_eq!(b.current(3, Some(obj("9", "theirs")), rv), Some(obj("9", "theirs")));
        assert_eq!(b.current(3, None, rv), None, "gone");
    }
}
