//! Work on managed clusters, off the reconcile (DESIGN.md §8, "Blast radius"). A delivery or a
//! detach talks to a server whose address a tenant wrote, and which may stall for minutes. It runs
//! as a background task that holds no reconcile permit and no controller slot: at most
//! [`OPERATIONS_PER_TENANT`] at once per tenant and one at a time per cluster (so one stalled
//! cluster holds one of them at most). The asset is reconciled again when its operation ends and
//! reads the outcome then. A cluster that keeps timing out or not answering is tried again only
//! after a delay that doubles with every failure, for all its assets at once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::api::inventory::BareMetalAsset;
use crate::inventory::remote_host::DeliveryError;
use crate::runtime::backoff::Backoff;
use crate::runtime::cause::diagnose;
use crate::runtime::panics;

/// Managed-cluster operations running at once for one tenant. Each is a handful of requests; a
/// stalled one holds its place for up to six times `--managed-cluster-timeout`.
pub(crate) const OPERATIONS_PER_TENANT: usize = 4;
/// How long an outcome nobody came to read is kept (its asset was deleted meanwhile, say).
const UNREAD_OUTCOME_KEPT: Duration = Duration::from_secs(600);
/// Longest wait before a cluster that stopped answering is tried again.
const CLUSTER_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// What an asset wants done on a cluster; an outcome is read only by the same intent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Intent {
    pub(crate) detach: bool,
    pub(crate) cluster: String,
    /// What the operation was started from (the asset's generation, its credentials' version, the
    /// cluster's uid): an outcome for an older one is dropped and the operation started again.
    pub(crate) basis: String,
}

/// `Ok(true)`: done; `Ok(false)`: not yet (a host being replaced or still going); or the failure.
pub(crate) type Outcome = Result<bool, DeliveryError>;

/// Where an asset's operation stands.
#[derive(Debug)]
pub(crate) enum Poll {
    /// It ended, with this outcome.
    Done(Outcome),
    /// It runs (or was just started); the asset is reconciled again when it ends.
    Running,
    /// The cluster stopped answering `failures` times in a row and is left alone for `left`.
    ClusterBackingOff { failures: u32, left: Duration },
}

enum Entry {
    Running(Intent),
    /// `None`: it never ran, the cluster was backing off by the time its turn came.
    Done(Intent, Option<Outcome>, Instant),
}

/// The managed-cluster operations of one tenant's assets.
pub(crate) struct RemoteWork {
    slots: Arc<Semaphore>,
    entries: Arc<Mutex<HashMap<ObjectRef<BareMetalAsset>, Entry>>>,
    /// One operation at a time per cluster, by name.
    clusters: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    pub(crate) backoff: Arc<ClusterBackoff>,
    wake: mpsc::UnboundedSender<ObjectRef<BareMetalAsset>>,
    cancel: CancellationToken,
}

impl RemoteWork {
    /// Operations end by sending their asset on `wake`; all stop when `cancel` fires.
    pub(crate) fn new(
        backoff: Backoff,
        wake: mpsc::UnboundedSender<ObjectRef<BareMetalAsset>>,
        cancel: CancellationToken,
    ) -> Self {
        RemoteWork {
            slots: Arc::new(Semaphore::new(OPERATIONS_PER_TENANT)),
            entries: Arc::default(),
            clusters: Arc::default(),
            backoff: Arc::new(ClusterBackoff::new(Backoff::new(backoff.base, CLUSTER_BACKOFF_MAX))),
            wake,
            cancel,
        }
    }

    /// The outcome of `asset`'s operation for `intent` if it ended; else starts the operation
    /// `start` makes (unless one of the asset's runs, or the cluster is backing off) and says so.
    pub(crate) fn poll<F>(&self, asset: ObjectRef<BareMetalAsset>, intent: Intent, start: impl FnOnce() -> F) -> Poll
    where
        F: Future<Output = Outcome> + Send + 'static,
    {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.retain(|_, e| !matches!(e, Entry::Done(_, _, at) if at.elapsed() > UNREAD_OUTCOME_KEPT));
        match entries.remove(&asset) {
            Some(Entry::Running(running)) => {
                entries.insert(asset, Entry::Running(running));
                return Poll::Running;
            }
            Some(Entry::Done(done, Some(outcome), _)) if done == intent => return Poll::Done(outcome),
            _ => {}
        }
        if let Some((failures, left)) = self.backoff.waiting(&intent.cluster) {
            return Poll::ClusterBackingOff { failures, left };
        }
        entries.insert(asset.clone(), Entry::Running(intent.clone()));
        drop(entries);
        self.spawn(asset, intent, start());
        Poll::Running
    }

    fn spawn<F>(&self, asset: ObjectRef<BareMetalAsset>, intent: Intent, operation: F)
    where
        F: Future<Output = Outcome> + Send + 'static,
    {
        let cluster_lock = {
            let mut clusters = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
            clusters.entry(intent.cluster.clone()).or_default().clone()
        };
        let (slots, entries, clusters) = (self.slots.clone(), self.entries.clone(), self.clusters.clone());
        let (backoff, wake, cancel) = (self.backoff.clone(), self.wake.clone(), self.cancel.clone());
        tokio::spawn(async move {
            let run = async {
                let _cluster_turn = cluster_lock.lock().await;
                // An operation queued behind one that found the cluster gone quiet does not try it.
                if backoff.waiting(&intent.cluster).is_some() {
                    return None;
                }
                let _slot = slots.acquire().await.ok()?;
                // A panic is this asset's failure: its entry must not stay Running for good.
                let outcome = panics::contain(operation).await;
                backoff.record(&intent.cluster, &outcome);
                Some(outcome)
            };
            let outcome = tokio::select! {
                _ = cancel.cancelled() => return,
                outcome = run => outcome,
            };
            {
                let mut clusters = clusters.lock().unwrap_or_else(|p| p.into_inner());
                // This task's and the map's are the last references: nothing queues for the cluster.
                if Arc::strong_count(&cluster_lock) <= 2 {
                    clusters.remove(&intent.cluster);
                }
            }
            let mut all = entries.lock().unwrap_or_else(|p| p.into_inner());
            all.insert(asset.clone(), Entry::Done(intent, outcome, Instant::now()));
            drop(all);
            let _ = wake.send(asset);
        });
    }
}

/// True when the failure is the cluster's: it timed out or cannot be reached.
pub(crate) fn cluster_at_fault(err: &DeliveryError) -> bool {
    match err {
        DeliveryError::TimedOut(_) => true,
        DeliveryError::Remote(err) => diagnose(err).kind.is_unreachable(),
        _ => false,
    }
}

/// Consecutive failures of each managed cluster and when it may be tried again.
pub(crate) struct ClusterBackoff {
    backoff: Backoff,
    clusters: Mutex<HashMap<String, (u32, Instant)>>,
}

impl ClusterBackoff {
    fn new(backoff: Backoff) -> Self {
        ClusterBackoff {
            backoff,
            clusters: Mutex::default(),
        }
    }

    /// `(failures, time left)` while `cluster` is left alone.
    pub(crate) fn waiting(&self, cluster: &str) -> Option<(u32, Duration)> {
        let clusters = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        let (failures, retry_at) = clusters.get(cluster)?;
        let left = retry_at.checked_duration_since(Instant::now())?;
        Some((*failures, left))
    }

    /// Counts a failure of the cluster's (the delay doubles), or forgets them on an answer.
    fn record(&self, cluster: &str, outcome: &Outcome) {
        let mut clusters = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        match outcome {
            Err(err) if cluster_at_fault(err) => {
                let failures = clusters.get(cluster).map_or(0, |(f, _)| *f).saturating_add(1);
                let retry_at = Instant::now() + self.backoff.delay(failures);
                clusters.insert(cluster.to_string(), (failures, retry_at));
            }
            _ => {
                clusters.remove(cluster);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn intent(cluster: &str, basis: &str) -> Intent {
        Intent {
            detach: false,
            cluster: cluster.into(),
            basis: basis.into(),
        }
    }

    fn work() -> (RemoteWork, mpsc::UnboundedReceiver<ObjectRef<BareMetalAsset>>) {
        let (wake, woken) = mpsc::unbounded_channel();
        let backoff = Backoff::new(Duration::from_secs(60), Duration::from_secs(60));
        (RemoteWork::new(backoff, wake, CancellationToken::new()), woken)
    }

    fn asset(name: &str) -> ObjectRef<BareMetalAsset> {
        ObjectRef::new(name).within("team")
    }

    #[tokio::test]
    async fn an_operation_runs_in_the_background_and_wakes_its_asset_with_the_outcome() {
        let (work, mut woken) = work();
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let operation = async move {
            let _ = held.await;
            Ok(true)
        };
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "1"), || operation),
            Poll::Running
        ));
        let never = async { panic!("a second operation of the same asset must not start") };
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "1"), || never),
            Poll::Running
        ));
        release.send(()).unwrap();
        assert_eq!(woken.recv().await, Some(asset("a")));
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "1"), || async { Ok(false) }),
            Poll::Done(Ok(true))
        ));
    }

    #[tokio::test]
    async fn an_outcome_for_an_older_intent_is_dropped_and_the_operation_started_again() {
        let (work, mut woken) = work();
        work.poll(asset("a"), intent("c1", "1"), || async { Ok(true) });
        woken.recv().await;
        let started = Arc::new(AtomicUsize::new(0));
        let counted = started.clone();
        let again = async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(false)
        };
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "2"), || again),
            Poll::Running
        ));
        woken.recv().await;
        assert_eq!(started.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_cluster_that_timed_out_is_left_alone_for_all_its_assets_with_a_growing_delay() {
        let (work, mut woken) = work();
        let timed_out = async { Err(DeliveryError::TimedOut(Duration::from_secs(1))) };
        work.poll(asset("a"), intent("c1", "1"), || timed_out);
        woken.recv().await;
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "1"), || async { Ok(true) }),
            Poll::Done(Err(DeliveryError::TimedOut(_)))
        ));
        let Poll::ClusterBackingOff { failures, left } =
            work.poll(asset("b"), intent("c1", "1"), || async { Ok(true) })
        else {
            panic!("the cluster backs off");
        };
        assert_eq!(failures, 1);
        assert!(left > Duration::from_secs(50), "{left:?}");
        assert!(matches!(
            work.poll(asset("c"), intent("c2", "1"), || async { Ok(true) }),
            Poll::Running
        ));
    }

    #[tokio::test]
    async fn a_panicking_operation_ends_as_a_failure_of_its_asset() {
        let (work, mut woken) = work();
        work.poll(asset("a"), intent("c1", "1"), || async { panic!("a bug") });
        assert_eq!(woken.recv().await, Some(asset("a")));
        assert!(matches!(
            work.poll(asset("a"), intent("c1", "1"), || async { Ok(true) }),
            Poll::Done(Err(DeliveryError::Panicked(_)))
        ));
    }

    #[tokio::test]
    async fn one_stalled_cluster_holds_one_slot_however_many_assets_wait_for_it() {
        let (work, mut woken) = work();
        for name in ["a", "b", "c", "d", "e"] {
            work.poll(asset(name), intent("stalled", "1"), std::future::pending);
        }
        work.poll(asset("healthy"), intent("c2", "1"), || async { Ok(true) });
        assert_eq!(woken.recv().await, Some(asset("healthy")));
        assert_eq!(work.slots.available_permits(), OPERATIONS_PER_TENANT - 1);
    }
}
