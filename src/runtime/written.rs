//! What a controller last wrote to an object's status, so that a reconcile running on a cache that
//! has not yet seen that write does not write it again. The cache lags the server by a watch event
//! or more: a reconcile woken by another change right after a status write can still read a status
//! from before it, and comparing against that would repeat the write (and its Events).
//!
//! A reconcile's copy of the object lags the cache too: it is taken when the reconcile starts. So
//! the write's own watch event, which wakes nothing ([`Written::take_own_write`]), does not end
//! what the write stands for: a reconcile already running on the copy from before the write would
//! then judge its next status against the old one, skip the write that changes it back, and
//! nothing would wake it again. The write stands until the reconcile's copy is the written
//! version, or the cache shows a later change (whose event wakes a reconcile that reads it).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a write stands for the status while the cache has not shown it. A cache catches up in
/// moments; one that never shows the write's own version (it relisted past it) is trusted again
/// after this.
const STANDS_FOR: Duration = Duration::from_secs(10);

/// Per object (by uid): the resourceVersion a status write produced, when, and that status.
pub struct Written<S> {
    entries: Mutex<HashMap<String, Entry<S>>>,
}

struct Entry<S> {
    produced: Option<String>,
    at: Instant,
    status: S,
    /// The cache has shown the version the write produced (its own event came).
    shown: bool,
}

impl<S> Default for Written<S> {
    fn default() -> Self {
        Written {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<S: Clone> Written<S> {
    /// The status the object has: the last one written, until the cache shows the version that
    /// write produced (resourceVersions are opaque: a cached version other than that one may be
    /// older or newer), or for [`STANDS_FOR`] at most; then `cached`. Start a new status from this.
    pub fn current(&self, uid: &str, cached_version: Option<&str>, cached: S) -> S {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let caught_up = match entries.get(uid) {
            None => return cached,
            Some(entry) => entry.produced.as_deref() == cached_version || entry.at.elapsed() > STANDS_FOR,
        };
        if caught_up {
            entries.remove(uid);
            return cached;
        }
        entries.get(uid).map_or(cached, |entry| entry.status.clone())
    }

    /// Whether the object at resourceVersion `version` is what this controller's last status write
    /// made of it: the write's own watch event, which tells its writer nothing new. Called with
    /// every version the cache shows, in order: the write goes on standing after its own event (a
    /// reconcile may be running on a copy from before it), and is forgotten at the first later
    /// version, whose event is not swallowed and so wakes a reconcile that reads it.
    pub fn take_own_write(&self, uid: &str, version: Option<&str>) -> bool {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(entry) = entries.get_mut(uid) else {
            return false;
        };
        if version.is_some() && entry.produced.as_deref() == version {
            entry.shown = true;
            return true;
        }
        if entry.shown {
            entries.remove(uid);
        }
        false
    }

    /// Records that `status` was written and produced resourceVersion `produced`.
    pub fn record(&self, uid: &str, produced: Option<String>, status: S) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let at = Instant::now();
        let entry = Entry {
            produced,
            at,
            status,
            shown: false,
        };
        entries.insert(uid.to_string(), entry);
    }

    /// Keeps only the objects whose uid `keep` accepts (the others are gone).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.retain(|uid, _| keep(uid));
    }

    /// Forgets a deleted object.
    pub fn forget(&self, uid: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        entries.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_stands_for_the_status_until_the_cache_shows_it() {
        let written = Written::default();
        written.record("uid-1", Some("9".into()), "Available");
        assert_eq!(written.current("uid-1", Some("7"), "Pending"), "Available");
        assert_eq!(
            written.current("uid-1", Some("8"), "Pending"),
            "Available",
            "another change, from before the write or after it"
        );
        assert_eq!(written.current("uid-1", Some("9"), "Available"), "Available");
        assert_eq!(
            written.current("uid-1", Some("8"), "Pending"),
            "Pending",
            "once seen, the cache is the truth"
        );
        assert_eq!(written.current("uid-2", Some("7"), "Pending"), "Pending");
        written.record("uid-3", Some("4".into()), "Available");
        assert!(written.take_own_write("uid-3", Some("4")));
        assert!(!written.take_own_write("uid-3", Some("5")), "a later change");
        assert_eq!(
            written.current("uid-3", Some("5"), "Pending"),
            "Pending",
            "the cache showed a change after the write: it is the truth again"
        );
        written.record("uid-3", Some("4".into()), "Available");
        assert!(
            !written.take_own_write("uid-3", Some("5")),
            "another change, after the write"
        );
        assert!(!written.take_own_write("uid-3", None));
        written.forget("uid-3");
        assert!(!written.take_own_write("uid-3", Some("4")));
        assert_eq!(written.current("uid-3", Some("3"), "Pending"), "Pending");
    }

    #[test]
    fn a_write_stands_after_its_own_event_for_a_reconcile_on_an_older_copy() {
        let written = Written::default();
        written.record("uid-1", Some("9".into()), "Unavailable");
        assert!(written.take_own_write("uid-1", Some("9")), "the write's own event");
        assert_eq!(
            written.current("uid-1", Some("7"), "Available"),
            "Unavailable",
            "a reconcile that began before the cache showed the write"
        );
        assert_eq!(written.current("uid-1", Some("9"), "Unavailable"), "Unavailable");
        assert_eq!(written.current("uid-1", Some("7"), "Available"), "Available");
    }

    #[test]
    fn a_write_the_cache_never_shows_stops_standing_after_a_while() {
        let written = Written::default();
        written.record("uid-1", Some("9".into()), "Available");
        if let Some(entry) = written.entries.lock().unwrap().get_mut("uid-1") {
            entry.at -= STANDS_FOR + Duration::from_secs(1);
        }
        assert_eq!(written.current("uid-1", Some("12"), "Pending"), "Pending");
    }
}
