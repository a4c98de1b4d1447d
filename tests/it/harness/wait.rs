//! Waiting for what a user would see, failing with the daemon's log when it does not come.

use std::future::Future;
use std::time::{Duration, Instant};

use super::Daemon;

/// How often a condition is looked at again.
const POLL: Duration = Duration::from_millis(50);

/// What a wait that timed out prints to explain itself.
pub(crate) trait Explain {
    fn explain(&self) -> String;
}

impl Explain for Daemon {
    fn explain(&self) -> String {
        format!("daemon log:\n{}", self.log_text())
    }
}

/// For waits with no daemon to blame: the embedded server's own tests, a Helm or kubectl run.
pub(crate) struct NoDaemon;

impl Explain for NoDaemon {
    fn explain(&self) -> String {
        "(no daemon)".into()
    }
}

/// A wait that says what it saw last when it fails, besides what its daemon explains.
pub(crate) struct LastSeen<'a, D> {
    daemon: &'a D,
    seen: std::cell::RefCell<String>,
}

impl<'a, D: Explain> LastSeen<'a, D> {
    pub(crate) fn new(daemon: &'a D) -> Self {
        LastSeen {
            daemon,
            seen: Default::default(),
        }
    }

    /// Remembers `seen` as the last thing looked at.
    pub(crate) fn saw(&self, seen: &impl std::fmt::Debug) {
        *self.seen.borrow_mut() = format!("{seen:?}");
    }
}

impl<D: Explain> Explain for LastSeen<'_, D> {
    fn explain(&self) -> String {
        format!("last seen: {}; {}", self.seen.borrow(), self.daemon.explain())
    }
}

/// Two daemons, say racing each other.
impl<A: Explain, B: Explain> Explain for (A, B) {
    fn explain(&self) -> String {
        format!("{}\nSECOND: {}", self.0.explain(), self.1.explain())
    }
}

impl<T: Explain + ?Sized> Explain for &T {
    fn explain(&self) -> String {
        (**self).explain()
    }
}

/// Polls `check` until it returns something, failing with the daemon's log after `within`.
pub(crate) async fn wait_until<T, F, Fut>(what: &str, within: Duration, daemon: &impl Explain, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {within:?}; {}",
            daemon.explain()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it holds, failing with the daemon's log after `within`.
pub(crate) async fn until<F, Fut>(what: &str, within: Duration, daemon: &impl Explain, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_until(what, within, daemon, || {
        let holds = check();
        async move { holds.await.then_some(()) }
    })
    .await
}

/// Watches `check` for all of `window`, failing as soon as it stops holding: for a test whose
/// point is that nothing happens over a stretch of time (an idle watch, a rate over a window).
pub(crate) async fn holds_for<F, Fut>(what: &str, window: Duration, daemon: &impl Explain, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + window;
    loop {
        assert!(check().await, "{what}: broken within {window:?}; {}", daemon.explain());
        if Instant::now() >= end {
            return;
        }
        tokio::time::sleep(POLL.min(end.saturating_duration_since(Instant::now()))).await;
    }
}
