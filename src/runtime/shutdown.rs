//! Stopping a kube-runtime controller. Its graceful shutdown finishes in-flight reconciles, but a
//! controller whose own cache never filled (the tenant lacks the CRD, or its watch keeps failing)
//! holds its runner until the cache is ready and so would never return.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How long in-flight reconciles get to finish after `cancel`.
pub const GRACE: Duration = Duration::from_secs(10);

/// Runs `controller` (built with `graceful_shutdown_on(cancel)`) to its end; after `cancel` it gets
/// [`GRACE`] to finish, or none at all when `started()` says its runner never started.
pub async fn run_controller(
    controller: impl Future<Output = ()>,
    cancel: &CancellationToken,
    started: impl Fn() -> bool,
) {
    let deadline = async {
        cancel.cancelled().await;
        if started() {
            tokio::time::sleep(GRACE).await;
        }
    };
    tokio::select! {
        _ = controller => {}
        _ = deadline => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_controller_that_never_started_stops_at_once() {
        let cancel = CancellationToken::new();
        cancel.cancel();
        let stopped = tokio::time::timeout(
            Duration::from_secs(1),
            run_controller(std::future::pending(), &cancel, || false),
        );
        assert!(stopped.await.is_ok());
    }

    #[tokio::test]
    async fn a_running_controller_may_finish_its_reconciles() {
        let cancel = CancellationToken::new();
        cancel.cancel();
        let finished = std::sync::atomic::AtomicBool::new(false);
        let in_flight = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            finished.store(true, std::sync::atomic::Ordering::SeqCst);
        };
        run_controller(in_flight, &cancel, || true).await;
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
    }
}
