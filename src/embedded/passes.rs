//! The loop every in-process controller runs: the store's events name the objects a pass must
//! look at (a Job for an event about one of its Pods, a namespace for a deletion inside it, …),
//! and a pass looks at those only. Everything is looked at once when the loop starts, and again
//! when its event receiver fell behind and missed events, or the store was reset (which removes
//! every object without an event).
//!
//! A pass returns the keys to look at again though no event will name them (a write that failed,
//! a deadline that has not passed yet): they join the next pass, which runs on the next relevant
//! event or after `retry_after`, whichever comes first. With nothing to retry the loop sleeps
//! until an event names something, so an idle server costs its loops nothing.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio_util::sync::CancellationToken;

use super::status::ApiError;
use super::store::{Store, StoreEvent};

/// One in-process controller, keyed by what it reconciles.
pub trait Controller: Send {
    type Key: Ord + Send;

    /// Adds the keys this event makes worth a look.
    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<Self::Key>);

    /// Every key there is (at start, and after missed events).
    fn all_keys(&self) -> BTreeSet<Self::Key>;

    /// Looks at each key; returns those to look at again without an event.
    fn pass(&mut self, keys: BTreeSet<Self::Key>) -> BTreeSet<Self::Key>;
}

/// Whether a write is done with: it succeeded, or its object is gone.
pub(super) fn settled<T>(result: Result<T, ApiError>) -> bool {
    match result {
        Ok(_) => true,
        Err(err) => err.code == 404,
    }
}

/// Runs `controller` until shutdown.
pub async fn run<C: Controller>(
    store: Arc<Store>,
    shutdown: CancellationToken,
    retry_after: Duration,
    mut controller: C,
) {
    let mut events = store.subscribe();
    let mut resets = store.resets();
    let mut retries = controller.pass(controller.all_keys());
    loop {
        let retry_at = (!retries.is_empty()).then(|| tokio::time::Instant::now() + retry_after);
        let mut named = BTreeSet::new();
        while named.is_empty() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                received = events.recv() => match received {
                    Ok(event) => controller.keys_of(&event, &mut named),
                    Err(RecvError::Lagged(_)) => named = controller.all_keys(),
                    Err(RecvError::Closed) => return,
                },
                _ = resets.changed() => named = controller.all_keys(),
                _ = sleep_until(retry_at) => break,
            }
        }
        loop {
            match events.try_recv() {
                Ok(event) => controller.keys_of(&event, &mut named),
                Err(TryRecvError::Lagged(_)) => named = controller.all_keys(),
                Err(_) => break,
            }
        }
        named.append(&mut retries);
        retries = controller.pass(named);
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
