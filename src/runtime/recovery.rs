//! Coming back after an outage. A server that is down is asked again on a short, capped, jittered
//! interval, apart from the restart backoff: a tenant API server restarting for an upgrade must be
//! served again seconds after it answers, not after a minute of accumulated backoff. And the moment
//! its probe finds it answering ([`super::reachability::Reachability::back`]), the tenant's watches
//! stop waiting out their retry delay ([`retry_watch`]) and the reconciles that failed while it was
//! down run again ([`HeldForReturn`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use kube::Resource;
use kube::runtime::reflector::Store;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::Event;
use rand::RngExt;
use tokio::sync::watch;

use super::cause::{CauseKind, diagnose};
use super::reachability::{RECOVERY_INTERVAL, Reachability};

const FIRST_RETRY: Duration = Duration::from_millis(250);

/// Retry delays of a failed list or watch: doubling from 250 ms, capped at [`RECOVERY_INTERVAL`]
/// (or a longer cap, [`WatchBackoff::up_to`]), jittered. kube's default grows to 30 s and resets
/// only after two quiet minutes, so after a few restarts in a row a controller could sit out half a
/// minute after its server was back.
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    next: Duration,
    max: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff::up_to(RECOVERY_INTERVAL)
    }
}

impl WatchBackoff {
    /// Delays growing to `max`: for a watch whose server is up but may refuse it for good (a kind
    /// not installed, a list not permitted), which need not be asked as often as a returning one.
    pub fn up_to(max: Duration) -> Self {
        WatchBackoff { next: FIRST_RETRY, max }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        Some(delay.mul_f64(rand::rng().random_range(0.5..=1.0)))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = FIRST_RETRY;
    }
}

/// The backoff of a controller's merged trigger stream: none. Each watch it merges retries on its
/// own [`WatchBackoff`]; a backoff on the merged stream (kube's default) would stop every trigger
/// whenever any one watch fails, so after a tenant restart, when each of a controller's watches
/// fails once in turn, the controller saw no event for the sum of all those delays (up to minutes).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTriggerBackoff;

impl Iterator for NoTriggerBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl Backoff for NoTriggerBackoff {
    fn reset(&mut self) {}
}

/// A watch retried on `backoff`, whose wait ends early when the tenant answers again (`back`
/// changes): the watch resumes as soon as its server serves, not after the rest of its delay. The
/// first 410 after a success (or a return) is retried at once: the server answered and the watch
/// only has to relist; a server answering nothing but 410 still gets the backoff.
///
/// Only what the server sent counts as a success: the watcher's `Init` comes before every attempt
/// to list, and starting the backoff over on it (as kube's `StreamBackoff` does) retries a list the
/// server refuses for good (a kind not installed, a list not permitted) every quarter second.
pub fn retry_watch<T, E>(
    events: BoxStream<'static, Result<Event<T>, E>>,
    back: Option<watch::Receiver<u64>>,
    backoff: WatchBackoff,
) -> BoxStream<'static, Result<Event<T>, E>>
where
    T: Send + 'static,
    E: std::error::Error + Send + 'static,
{
    let state = RetriedWatch {
        events,
        backoff,
        back,
        wait: None,
        fresh: true,
    };
    futures::stream::unfold(state, |mut watch| async move {
        if let Some(delay) = watch.wait.take()
            && wait_or_return(delay, &mut watch.back).await
        {
            watch.backoff.reset();
            watch.fresh = true;
        }
        let item = watch.events.next().await?;
        match &item {
            Ok(Event::Init) => {}
            Ok(_) => {
                watch.backoff.reset();
                watch.fresh = true;
                // A return signalled while the watch was fine is old news at its next failure.
                if let Some(back) = &mut watch.back {
                    back.borrow_and_update();
                }
            }
            Err(err) => {
                let delay = watch.backoff.next().unwrap_or(RECOVERY_INTERVAL);
                let relist = watch.fresh && diagnose(err).kind == CauseKind::Expired;
                watch.wait = Some(if relist { Duration::ZERO } else { delay });
                watch.fresh = false;
            }
        }
        Some((item, watch))
    })
    .boxed()
}

struct RetriedWatch<T, E> {
    events: BoxStream<'static, Result<Event<T>, E>>,
    backoff: WatchBackoff,
    back: Option<watch::Receiver<u64>>,
    /// The delay before the next attempt, after a failure.
    wait: Option<Duration>,
    /// No failure since the last success or return.
    fresh: bool,
}

/// Waits `delay`, or less if the tenant answers again first: whether it did.
async fn wait_or_return(delay: Duration, back: &mut Option<watch::Receiver<u64>>) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    if let Some(receiver) = back {
        tokio::select! {
            _ = &mut sleep => return false,
            changed = receiver.changed() => if changed.is_ok() { return true },
        }
        // The tenant is gone: nothing will signal any more.
        *back = None;
    }
    sleep.await;
    false
}

/// The objects of one controller that wait for a signal instead of their backoff: those whose
/// reconcile failed because their tenant was down run again the moment it answers; those held off
/// by an object a cache refused in their namespace run again the moment it is released.
#[derive(Debug, Default)]
pub struct HeldForReturn {
    keys: Mutex<HashSet<String>>,
}

impl HeldForReturn {
    fn keys(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.keys.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Holds the object under `key` for the tenant's return if the tenant is down now; whether it
    /// was held. Checked and held under one lock, so a return cannot slip in between unseen.
    pub fn hold(&self, reachability: &Reachability, key: &str) -> bool {
        let mut keys = self.keys();
        if !reachability.is_down() {
            return false;
        }
        keys.insert(key.to_string());
        true
    }

    /// Holds the object under `key` if `still_held()` says so once it is recorded: a release
    /// signalled between the caller's look and the hold is then seen, not missed. Whether it is
    /// held, and whether it was not already.
    pub fn hold_while(&self, key: &str, still_held: impl FnOnce() -> bool) -> Option<bool> {
        let newly = self.keys().insert(key.to_string());
        if still_held() {
            return Some(newly);
        }
        if newly {
            self.keys().remove(key);
        }
        None
    }

    /// Lets go of the object under `key` without running it.
    pub fn forget(&self, key: &str) {
        self.keys().remove(key);
    }

    /// At each return of the tenant (`back` changes), the held objects still in `store`, each
    /// after `forget(key)` (its backoff starts over).
    pub fn on_return<K>(
        self: Arc<Self>,
        back: watch::Receiver<u64>,
        store: Store<K>,
        key_of: fn(&K) -> String,
        forget: impl Fn(&str) + Send + 'static,
    ) -> impl Stream<Item = Arc<K>> + Send + 'static
    where
        K: Resource + Clone + Send + Sync + 'static,
        K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
    {
        let returns = tokio_stream::wrappers::WatchStream::from_changes(back).map(|_| ());
        let held = move |object: &K, keys: &HashSet<String>| keys.contains(&key_of(object));
        self.on_signal(returns, store, held, forget)
    }

    /// At each item of `signal`, the objects of `store` that `pick` picks, given the keys held
    /// until then (which it lets go of, each after `forget(key)`).
    pub fn on_signal<K>(
        self: Arc<Self>,
        signal: impl Stream<Item = ()> + Send + 'static,
        store: Store<K>,
        pick: impl Fn(&K, &HashSet<String>) -> bool + Send + 'static,
        forget: impl Fn(&str) + Send + 'static,
    ) -> impl Stream<Item = Arc<K>> + Send + 'static
    where
        K: Resource + Clone + Send + Sync + 'static,
        K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
    {
        futures::stream::unfold(
            (signal.boxed(), self, store, (pick, forget)),
            move |(mut signal, held, store, (pick, forget))| async move {
                signal.next().await?;
                let keys = std::mem::take(&mut *held.keys());
                for key in &keys {
                    forget(key);
                }
                let returned: Vec<Arc<K>> = store.state().into_iter().filter(|object| pick(object, &keys)).collect();
                Some((futures::stream::iter(returned), (signal, held, store, (pick, forget))))
            },
        )
        .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_retries_grow_but_never_past_the_recovery_interval() {
        let mut backoff = WatchBackoff::default();
        let delays: Vec<Duration> = (&mut backoff).take(20).collect();
        assert!(delays[0] <= FIRST_RETRY);
        assert!(delays.iter().all(|d| *d <= RECOVERY_INTERVAL), "{delays:?}");
        assert!(delays[19] >= RECOVERY_INTERVAL / 2);
        backoff.reset();
        assert!(backoff.next().is_some_and(|d| d <= FIRST_RETRY));
    }

    fn expired() -> kube::Error {
        let mut status = kube::core::Status::failure("too old resource version", "Expired");
        status.code = 410;
        kube::Error::Api(Box::new(status))
    }

    fn refused() -> kube::Error {
        kube::Error::Service(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused",
        )))
    }

    #[tokio::test]
    async fn a_failing_watch_retries_at_once_when_its_tenant_answers_again() {
        use crate::runtime::health::Health;
        use crate::runtime::metrics::Metrics;
        let reachability = Reachability::new("acme", Arc::new(Metrics::new()), Arc::new(Health::default()));
        let failures = futures::stream::repeat_with(|| Err::<Event<()>, _>(refused())).boxed();
        let mut watch = retry_watch(failures, Some(reachability.back()), WatchBackoff::default());
        // Four failures in a row: the next attempt waits 0.5 to 1 s.
        for _ in 0..4 {
            assert!(watch.next().await.is_some_and(|item| item.is_err()));
        }
        let returned = tokio::time::Instant::now();
        reachability.report_down(crate::runtime::cause::diagnose(&refused()));
        reachability.report_answering();
        assert!(watch.next().await.is_some());
        assert!(
            returned.elapsed() < Duration::from_millis(200),
            "the watch waited {:?} after its tenant answered",
            returned.elapsed()
        );
    }

    #[tokio::test]
    async fn the_first_expired_watch_relists_at_once_but_a_server_answering_only_410_waits() {
        let events = futures::stream::iter([
            Ok(Event::<k8s_openapi::api::core::v1::ConfigMap>::InitDone),
            Err(expired()),
            Err(expired()),
            Ok(Event::InitDone),
        ])
        .boxed();
        let mut watch = retry_watch(events, None, WatchBackoff::default());
        let mut gaps = Vec::new();
        let mut last = tokio::time::Instant::now();
        while let Some(_item) = watch.next().await {
            gaps.push(last.elapsed());
            last = tokio::time::Instant::now();
        }
        assert_eq!(gaps.len(), 4);
        assert!(gaps[2] < Duration::from_millis(50), "{gaps:?}");
        assert!(gaps[3] >= FIRST_RETRY / 2, "{gaps:?}");
    }

    /// The watcher's `Init` before each attempt to list is no success: a list refused for good
    /// is asked ever more slowly, not every quarter second.
    #[tokio::test]
    async fn a_list_refused_for_good_backs_off_though_each_attempt_begins_with_init() {
        let events = futures::stream::iter([
            Ok(Event::<k8s_openapi::api::core::v1::ConfigMap>::Init),
            Err(refused()),
            Ok(Event::Init),
            Err(refused()),
            Ok(Event::Init),
            Err(refused()),
            Ok(Event::Init),
        ])
        .boxed();
        let mut watch = retry_watch(events, None, WatchBackoff::default());
        let mut last = tokio::time::Instant::now();
        let mut gaps = Vec::new();
        while let Some(_item) = watch.next().await {
            gaps.push(last.elapsed());
            last = tokio::time::Instant::now();
        }
        // The third failure's wait is the third delay (0.5 to 1 s), not the first (at most 250 ms).
        assert!(gaps[6] >= FIRST_RETRY * 2 - Duration::from_millis(50), "{gaps:?}");
    }

    #[tokio::test]
    async fn objects_held_while_the_tenant_is_down_return_with_it() {
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::reflector::store::Writer;
        use kube::runtime::watcher::Event;

        use crate::runtime::health::Health;
        use crate::runtime::metrics::Metrics;
        let config_map = |name: &str| ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut writer = Writer::<ConfigMap>::default();
        for name in ["a", "b"] {
            writer.apply_watcher_event(&Event::Apply(config_map(name)));
        }
        let key_of = |object: &ConfigMap| object.metadata.name.clone().unwrap_or_default();
        let reachability = Reachability::new("acme", Arc::new(Metrics::new()), Arc::new(Health::default()));
        let held = Arc::new(HeldForReturn::default());
        assert!(!held.hold(&reachability, "a"), "nothing is held while the tenant is up");
        reachability.report_down(crate::runtime::cause::diagnose(&refused()));
        assert!(held.hold(&reachability, "a"));
        let forgotten = Arc::new(Mutex::new(Vec::new()));
        let forget = {
            let forgotten = forgotten.clone();
            move |key: &str| forgotten.lock().unwrap().push(key.to_string())
        };
        let mut returned = Box::pin(
            held.clone()
                .on_return(reachability.back(), writer.as_reader(), key_of, forget),
        );
        reachability.report_answering();
        let object = tokio::time::timeout(Duration::from_secs(5), returned.next())
            .await
            .expect("the held object returns")
            .expect("an object");
        assert_eq!(object.metadata.name.as_deref(), Some("a"));
        assert_eq!(*forgotten.lock().unwrap(), vec!["a".to_string()]);
    }
}
