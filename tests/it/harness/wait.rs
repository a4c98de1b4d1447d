//! Waiting for what a user would see, failing with the daemon's log when it does not come.

use std::future::Future;
use std::time::{Duration, Instant};

use super::Daemon;

/// How often a condition is looked at again.
const POLL: Duration = Duration::from_millis(50);

/// Polls `check` until it returns something, failing with the daemon's log after `within`.
pub(crate) async fn wait_until<T, F, Fut>(what: &str, within: Duration, daemon: &Daemon, mut check: F) -> T
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
            "{what}: not within {within:?}; daemon log:\n{}",
            daemon.log_text()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it holds, failing with the daemon's log after `within`.
pub(crate) async fn until<F, Fut>(what: &str, within: Duration, daemon: &Daemon, mut check: F)
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
