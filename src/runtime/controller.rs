//! The scaffold every tenant controller is built with, so that each does the same around its
//! reconcile: it waits until all of its caches (tenant and host) are filled, holds off objects of a
//! namespace where one of those caches refused an object (absent is not gone: see
//! [`super::informers::refusals`]; each held object is told so in a `Held` condition and an Event,
//! [`held`], and runs again the moment the namespace is released), then takes one of the tenant's reconcile permits, shared
//! fairly between its namespaces ([`FairPermits`]; a controller waiting for its caches must not
//! hold a permit the tenant's other controllers need), contains panics, records metrics, backs off
//! per object (an object that failed while its tenant was down runs again the moment it answers)
//! and stops through [`run_controller`] (in-flight reconciles get their grace).
//!
//! kube's own runner is given no concurrency limit: every object due is handed to the scaffold at
//! once and waits for a permit in its namespace's queue, instead of in kube's single queue where
//! one namespace's backlog would come first.

use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kube::runtime::controller::{Action, Config, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, debug, error_span};

use super::backoff::ObjectBackoff;
use super::informers::SharedCache;
use super::informers::refusals::{Refusal, Refusals};
use super::metrics::{ErrorLabels, Metrics};
use super::panics::{self, ReconcilePanic};
use super::reachability::Reachability;
use super::readiness::Readiness;
use super::recovery::{HeldForReturn, NoTriggerBackoff};
use super::retry;
use super::shutdown::run_controller;
use super::startup::Startup;
use super::written::Written;

pub mod held;
mod permits;
mod singleton;
pub use permits::{FairPermit, FairPermits};
pub use singleton::Singleton;

/// How soon an object held off looks again when the tenant did not take its `Held` condition.
const HELD_UNTOLD_RETRY: Duration = Duration::from_secs(10);

/// A controller's error: retried with the object's backoff and counted by `metric_label`.
pub trait ReconcileError: std::error::Error + From<ReconcilePanic> + Send + Sync + 'static {
    /// A stable word for the `kind` label of `stackd_reconcile_errors_by_kind`.
    fn metric_label(&self) -> &'static str;
}

/// What the scaffold needs of the tenant a controller serves.
pub trait Tenant: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn metrics(&self) -> &Metrics;
    /// Bounds the reconciles running at once for this tenant, across its controllers, shared
    /// fairly between its namespaces.
    fn permits(&self) -> Arc<FairPermits>;
    fn object_backoff(&self) -> &ObjectBackoff;
    /// Whether the tenant's API server answers, and the signal of its return.
    fn reachability(&self) -> &Reachability;
    /// Whether the host API server answers, and the signal of its return (none where the host
    /// is not watched).
    fn host_reachability(&self) -> Option<&Reachability> {
        None
    }
    /// The tenant's start, which each controller joins as it starts.
    fn startup(&self) -> &Startup;
    /// Where the scaffold writes what it tells users itself (the `Held` condition and its Event);
    /// none in tests of the scaffold alone.
    fn publisher(&self) -> Option<(&Client, &Recorder)> {
        None
    }
}

/// The tenant's reconcile permit a reconcile holds; [`Permit::release`] gives it back early (before
/// a wait that must not starve the tenant's other controllers).
pub struct Permit {
    _held: FairPermit,
}

impl Permit {
    pub fn release(self) {}
}

/// The objects `mapper` names that the cache of reconciled objects holds. kube's runner would queue
/// any other and drop it as not found (most events of a watched kind name an object of the other
/// install kind, or a Stack not made yet); one cached later brings its own event.
fn cached_only<K, O, I>(main: Store<K>, mapper: impl Fn(O) -> I) -> impl Fn(O) -> Vec<ObjectRef<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
    I: IntoIterator<Item = ObjectRef<K>>,
{
    move |object| {
        mapper(object)
            .into_iter()
            .filter(|found| main.get(found).is_some())
            .collect()
    }
}

/// A controller of `K` for one tenant, being put together.
pub struct Scaffold<K: Resource + Clone + Debug + 'static, T>
where
    K::DynamicType: Hash + Eq,
{
    name: String,
    tenant: Arc<T>,
    controller: Controller<K>,
    caches: Vec<Readiness>,
    /// The cache of the objects reconciled.
    main: Store<K>,
    refusals: Vec<Refusals>,
}

impl<K, T> Scaffold<K, T>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    T: Tenant,
{
    /// A controller named `name` (its `controller` metric label) reconciling the objects of `main`.
    pub fn new(name: impl Into<String>, tenant: Arc<T>, main: &SharedCache<K>) -> Self {
        Self::from_triggers(name, tenant, main, main.touched())
    }

    /// [`Self::new`] for a controller that records its status writes in `written`: the watch event
    /// of its own write wakes nothing (the object changed only as the reconcile that wrote it
    /// knows), which is most of the events an object of a busy controller gets.
    pub fn ignoring_own_writes<S: Clone + Send + 'static>(
        name: impl Into<String>,
        tenant: Arc<T>,
        main: &SharedCache<K>,
        written: Arc<Written<S>>,
    ) -> Self {
        let triggers = main.touched().filter(move |object| {
            let meta = object.meta();
            let own = written.take_own_write(
                meta.uid.as_deref().unwrap_or_default(),
                meta.resource_version.as_deref(),
            );
            futures::future::ready(!own)
        });
        Self::from_triggers(name, tenant, main, triggers)
    }

    fn from_triggers(
        name: impl Into<String>,
        tenant: Arc<T>,
        main: &SharedCache<K>,
        triggers: impl Stream<Item = Arc<K>> + Send + 'static,
    ) -> Self {
        let controller = Controller::for_shared_stream(triggers, main.store())
            // Unbounded here: the tenant's fair permits bound what runs (see the module docs).
            .with_config(Config::default().concurrency(0))
            // Each shared watch retries on its own backoff; one on the merged triggers would pause
            // them all whenever one watch failed (runtime::recovery).
            .trigger_backoff(NoTriggerBackoff);
        Scaffold {
            name: name.into(),
            tenant,
            controller,
            caches: vec![main.readiness()],
            main: main.store(),
            refusals: vec![main.refusals()],
        }
    }

    /// Reconciles the objects `mapper` names whenever an object of `cache` changes or goes.
    pub fn watches<O, I>(mut self, cache: &SharedCache<O>, mapper: impl Fn(Arc<O>) -> I + Send + Sync + 'static) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.caches.push(cache.readiness());
        self.refusals.push(cache.refusals());
        let mapper = cached_only(self.main.clone(), mapper);
        self.controller = self.controller.watches_shared_stream(cache.touched(), mapper);
        self
    }

    /// [`Self::watches`] for a cache whose refused objects the controller handles itself, object by
    /// object (it reads their names in the cache's [`Refusals`]), instead of being held off in their
    /// namespace: one refused object then fails only the object it belongs to. For the host Secrets
    /// an installer writes into with the tenant's token, and may pad past the cap or strip of the
    /// marks that tell their namespace.
    pub fn watches_unheld<O, I>(
        mut self,
        cache: &SharedCache<O>,
        mapper: impl Fn(Arc<O>) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.caches.push(cache.readiness());
        let mapper = cached_only(self.main.clone(), mapper);
        self.controller = self.controller.watches_shared_stream(cache.touched(), mapper);
        self
    }

    /// [`Self::watches`] for a stream derived from `cache` (filtered, say).
    pub fn watches_stream<O, I>(
        mut self,
        cache: &SharedCache<O>,
        stream: impl Stream<Item = Result<O, watcher::Error>> + Send + 'static,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.caches.push(cache.readiness());
        self.refusals.push(cache.refusals());
        let mapper = cached_only(self.main.clone(), mapper);
        self.controller = self.controller.watches_stream(stream, mapper);
        self
    }

    /// Reconciles the objects `trigger` names: work the controller started outside a reconcile
    /// (on a managed cluster, say) has ended, and its result waits to be read.
    pub fn reconcile_on(mut self, trigger: impl Stream<Item = ObjectRef<K>> + Send + 'static) -> Self {
        self.controller = self.controller.reconcile_on(trigger);
        self
    }

    /// [`Self::watches_stream`] for a stream of a cache of the controller's own (not a shared one):
    /// the first reconcile waits for `ready`.
    pub fn watches_ready_stream<O, I>(
        mut self,
        ready: Readiness,
        stream: impl Stream<Item = Result<O, watcher::Error>> + Send + 'static,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
        I::IntoIter: Send,
    {
        self.caches.push(ready);
        let mapper = cached_only(self.main.clone(), mapper);
        self.controller = self.controller.watches_stream(stream, mapper);
        self
    }

    /// Waits for `cache` before the first reconcile: the controller reads it without watching it.
    pub fn reads<O>(mut self, cache: &SharedCache<O>) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        self.caches.push(cache.readiness());
        self.refusals.push(cache.refusals());
        self
    }

    /// Runs the controller until `cancel`, each reconcile through `reconcile`.
    pub async fn run<C, F, Fut, E>(self, context: Arc<C>, reconcile: F, cancel: &CancellationToken)
    where
        K: Serialize,
        C: Send + Sync + 'static,
        F: Fn(Arc<K>, Arc<C>, Permit) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let ready = Readiness::all(self.caches);
        self.tenant.startup().controller_started(&self.name, ready.clone());
        let (held, held_for_host) = (Arc::new(HeldForReturn::default()), Arc::new(HeldForReturn::default()));
        let forget = |tenant: Arc<T>| move |key: &str| tenant.object_backoff().succeeded(key);
        let returned = held.clone().on_return(
            self.tenant.reachability().back(),
            self.main.clone(),
            backoff_key,
            forget(self.tenant.clone()),
        );
        let host_back = self.tenant.host_reachability().map(Reachability::back);
        let host_returned = host_back.map(|back| {
            held_for_host
                .clone()
                .on_return(back, self.main.clone(), backoff_key, forget(self.tenant.clone()))
        });
        let returned = futures::stream::select(returned, futures::stream::iter(host_returned).flatten());
        // A namespace held up or released by a cache this controller reads runs its objects
        // again: the held look again, and the others are held (and told so).
        let held_up = Arc::new(HeldForReturn::default());
        let changes = self
            .refusals
            .iter()
            .map(|refusals| tokio_stream::wrappers::WatchStream::from_changes(refusals.changes()).map(|_| ()));
        let refusals = self.refusals.clone();
        let newly_held = move |object: &K| {
            let namespace = object.meta().namespace.as_deref().unwrap_or_default();
            refusals.iter().any(|refusals| refusals.holding(namespace).is_some())
        };
        let pick = move |object: &K, held: &std::collections::HashSet<String>| {
            held.contains(&backoff_key(object)) || newly_held(object)
        };
        let released = held_up
            .clone()
            .on_signal(futures::stream::select_all(changes), self.main, pick, |_| {});
        let runner = Arc::new(Runner {
            name: self.name,
            tenant: self.tenant,
            context,
            ready: ready.clone(),
            refusals: self.refusals,
            cancel: cancel.clone(),
            reconcile,
            held,
            held_for_host,
            held_up,
        });
        let (tenant, name) = (runner.tenant.name().to_string(), runner.name.clone());
        let run = self
            .controller
            .watches_shared_stream(futures::stream::select(returned, released), |object: Arc<K>| {
                Some(ObjectRef::from_obj(object.as_ref()))
            })
            .graceful_shutdown_on(cancel.clone().cancelled_owned())
            .run(
                |object, runner| {
                    let runner: Arc<Runner<T, C, F>> = runner;
                    async move { runner.reconcile(object).await }
                },
                |object, err, runner| runner.error_policy(object.as_ref(), err),
                runner,
            )
            .for_each(move |result| {
                if let Err(err) = result {
                    debug!(tenant = %tenant, controller = %name, error = %err, cause = %super::cause::diagnose(&err), "controller event");
                }
                std::future::ready(())
            });
        // Until the caches are filled no reconcile runs: nothing to give a grace.
        run_controller(run, cancel, || ready.is_ready()).await;
    }
}

/// What every reconcile of one controller is run with.
struct Runner<T, C, F> {
    name: String,
    tenant: Arc<T>,
    context: Arc<C>,
    ready: Readiness,
    /// What the caches this controller reads refused.
    refusals: Vec<Refusals>,
    cancel: CancellationToken,
    reconcile: F,
    /// Objects that failed while the tenant was down, run again at its return.
    held: Arc<HeldForReturn>,
    /// Objects that failed while the host was down, run again at its return.
    held_for_host: Arc<HeldForReturn>,
    /// Objects held off by a refused object in their namespace, run again at its release.
    held_up: Arc<HeldForReturn>,
}

impl<T: Tenant, C, F> Runner<T, C, F> {
    /// One reconcile of `object`, every line logged inside it in its [`reconcile_span`].
    async fn reconcile<K, Fut, E>(&self, object: Arc<K>) -> Result<Action, E>
    where
        K: Resource<DynamicType = ()> + Serialize,
        F: Fn(Arc<K>, Arc<C>, Permit) -> Fut,
        Fut: Future<Output = Result<Action, E>>,
        E: ReconcileError,
    {
        let span = reconcile_span(self.tenant.name(), &self.name, &shown(object.as_ref()));
        self.reconcile_in_span(object).instrument(span).await
    }

    async fn reconcile_in_span<K, Fut, E>(&self, object: Arc<K>) -> Result<Action, E>
    where
        K: Resource<DynamicType = ()> + Serialize,
        F: Fn(Arc<K>, Arc<C>, Permit) -> Fut,
        Fut: Future<Output = Result<Action, E>>,
        E: ReconcileError,
    {
        // Decisions (above all, what to delete) need complete caches, not a half-finished first
        // list; a cache that cannot fill (a forbidden watch) must not hold up shutdown.
        let filled = tokio::select! {
            _ = self.cancel.cancelled() => false,
            filled = self.ready.wait() => filled,
        };
        if !filled {
            return Ok(Action::await_change());
        }
        let namespace = object.meta().namespace.clone().unwrap_or_default();
        if let Some(refused) = self.held_up(&namespace) {
            let key = backoff_key(object.as_ref());
            let still_held = || self.held_up(&namespace).is_some();
            if let Some(newly) = self.held_up.hold_while(&key, still_held) {
                debug!(refused = %refused.describe(), "held up by an object stackd could not cache (too large, or over its namespace's memory share)");
                if newly {
                    // Telling writes to the tenant: it waits for its namespace's turn as a reconcile
                    // does, so a namespace of thousands of held objects cannot crowd out the others.
                    let _permit = self.tenant.permits().acquire(&namespace).await;
                    if !held::tell(self.tenant.as_ref(), object.as_ref(), &refused).await {
                        // Told at the next look, which nothing else would bring.
                        self.held_up.forget(&key);
                        return Ok(Action::requeue(HELD_UNTOLD_RETRY));
                    }
                }
                return Ok(Action::await_change());
            }
        }
        let permit = self.tenant.permits().acquire(&namespace).await;
        held::clear(self.tenant.as_ref(), object.as_ref()).await;
        let started = Instant::now();
        let result = panics::contain((self.reconcile)(
            object.clone(),
            self.context.clone(),
            Permit { _held: permit },
        ))
        .await;
        observe(self.tenant.as_ref(), &self.name, started, result.as_ref().err());
        if result.is_ok() {
            self.tenant.object_backoff().succeeded(&backoff_key(object.as_ref()));
        }
        result
    }

    /// A refused object that holds up work in `namespace`, from any cache this controller reads.
    fn held_up(&self, namespace: &str) -> Option<Refusal> {
        self.refusals.iter().find_map(|refusals| refusals.holding(namespace))
    }

    fn error_policy<K, E>(&self, object: &K, err: &E) -> Action
    where
        K: Resource<DynamicType = ()>,
        E: ReconcileError,
    {
        let shown = shown(object);
        let logged = (self.tenant.name(), self.name.as_str(), shown.as_str());
        let (backoff, key) = (self.tenant.object_backoff(), backoff_key(object));
        let (reachability, host) = (self.tenant.reachability(), self.tenant.host_reachability());
        // Held for each server that is down, run again at whichever returns first.
        let hold = || {
            let for_host = host.is_some_and(|host| self.held_for_host.hold(host, &key));
            self.held.hold(reachability, &key) | for_host
        };
        let servers = servers(self.tenant.as_ref());
        Action::requeue(retry::after_tenant_failure(
            backoff,
            &key,
            logged,
            err,
            (&servers, hold),
        ))
    }
}

/// The span of one reconcile: every line logged inside it carries the tenant, the controller and
/// the object, so no log call repeats them. At error level, so that it is on whenever any line of
/// the controller is (a span filtered out would take its fields with it).
pub fn reconcile_span(tenant: &str, controller: &str, object: &str) -> Span {
    error_span!("reconcile", tenant = %tenant, controller = %controller, object = %object)
}

/// `namespace/name`, or the name of a cluster-scoped object.
fn shown<K: Resource>(object: &K) -> String {
    match object.namespace() {
        Some(namespace) => format!("{namespace}/{}", object.name_any()),
        None => object.name_any(),
    }
}

/// Records one reconcile of `controller` that began at `started`: its count, duration and error.
fn observe<T: Tenant, E: ReconcileError>(tenant: &T, controller: &str, started: Instant, error: Option<&E>) {
    let metrics = tenant.metrics();
    let labels = Metrics::controller(tenant.name(), controller);
    metrics.reconciles.get_or_create(&labels).inc();
    let seconds = started.elapsed().as_secs_f64();
    metrics.reconcile_duration.get_or_create(&labels).observe(seconds);
    if let Some(err) = error {
        metrics.reconcile_errors.get_or_create(&labels).inc();
        let by_kind = ErrorLabels {
            tenant: labels.tenant,
            controller: labels.controller,
            kind: err.metric_label().to_string(),
        };
        metrics.reconcile_errors_by_kind.get_or_create(&by_kind).inc();
    }
}

/// The servers a tenant's controller talks to: the tenant's, and the host's where it is watched.
fn servers<T: Tenant>(tenant: &T) -> Vec<&Reachability> {
    [Some(tenant.reachability()), tenant.host_reachability()]
        .into_iter()
        .flatten()
        .collect()
}

/// Failures are counted per object (its kind included: controllers share the tenant's backoff).
fn backoff_key<K: Resource<DynamicType = ()>>(object: &K) -> String {
    ObjectRef::from_obj(object).to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use kube::api::ObjectMeta;
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::runtime::backoff::Backoff;
    use crate::runtime::informers::{Feed, fed};

    struct TestTenant {
        metrics: Metrics,
        permits: Arc<FairPermits>,
        backoff: ObjectBackoff,
        reachability: Arc<Reachability>,
        host: Arc<Reachability>,
        startup: Startup,
    }

    impl Tenant for TestTenant {
        fn name(&self) -> &str {
            "acme"
        }
        fn metrics(&self) -> &Metrics {
            &self.metrics
        }
        fn permits(&self) -> Arc<FairPermits> {
            self.permits.clone()
        }
        fn object_backoff(&self) -> &ObjectBackoff {
            &self.backoff
        }
        fn reachability(&self) -> &Reachability {
            &self.reachability
        }
        fn host_reachability(&self) -> Option<&Reachability> {
            Some(&self.host)
        }
        fn startup(&self) -> &Startup {
            &self.startup
        }
    }

    fn tenant() -> Arc<TestTenant> {
        Arc::new(TestTenant {
            metrics: Metrics::new(),
            permits: FairPermits::new(1),
            backoff: ObjectBackoff::new(Backoff::new(Duration::from_secs(60), Duration::from_secs(60))),
            reachability: Reachability::new("acme", Arc::new(Metrics::new()), Arc::default()),
            host: Reachability::for_host(Arc::new(Metrics::new()), Arc::default()),
            startup: Startup::default(),
        })
    }

    #[derive(Debug, thiserror::Error)]
    enum TestError {
        #[error(transparent)]
        Panicked(#[from] ReconcilePanic),
        #[error("client error (Connect)")]
        Unreachable(#[source] std::io::Error),
    }

    impl ReconcileError for TestError {
        fn metric_label(&self) -> &'static str {
            match self {
                TestError::Panicked(_) => "panic",
                TestError::Unreachable(_) => "unreachable",
            }
        }
    }

    fn listed<K: Clone>(feed: &Feed<K>, objects: &[K]) {
        feed.send(Ok(Event::Init)).unwrap();
        for object in objects {
            feed.send(Ok(Event::InitApply(object.clone()))).unwrap();
        }
        feed.send(Ok(Event::InitDone)).unwrap();
    }

    fn config_map(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Runs `scaffold` with a reconcile that only counts its calls (and waits for a change).
    fn run_counting(
        scaffold: Scaffold<ConfigMap, TestTenant>,
        cancel: &CancellationToken,
    ) -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
        let reconciled = Arc::new(AtomicUsize::new(0));
        let run = tokio::spawn({
            let (reconciled, cancel) = (reconciled.clone(), cancel.clone());
            async move {
                let reconcile = |_: Arc<ConfigMap>, count: Arc<AtomicUsize>, _permit: Permit| async move {
                    count.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, TestError>(Action::await_change())
                };
                scaffold.run(reconciled, reconcile, &cancel).await
            }
        });
        (reconciled, run)
    }

    async fn eventually(what: &str, check: impl Fn() -> bool) {
        for _ in 0..200 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{what}: not within 5 s");
    }

    #[test]
    fn a_watched_object_wakes_only_the_objects_the_main_cache_holds() {
        let (store, mut writer) = kube::runtime::reflector::store::<ConfigMap>();
        writer.apply_watcher_event(&Event::Apply(config_map("present")));
        let mapper = cached_only(store, |names: Vec<&str>| {
            names
                .into_iter()
                .map(|name| ObjectRef::<ConfigMap>::new(name).within("ns"))
                .collect::<Vec<_>>()
        });
        let woken = mapper(vec!["present", "not-made-yet"]);
        assert_eq!(woken, vec![ObjectRef::new("present").within("ns")]);
    }

    #[tokio::test]
    async fn the_first_reconcile_waits_for_every_cache_and_only_then_takes_a_permit() {
        let (main_feed, main, _main_driver) = fed::<ConfigMap>();
        let (other_feed, other, _other_driver) = fed::<Secret>();
        listed(&main_feed, &[config_map("a")]);
        let tenant = tenant();
        let cancel = CancellationToken::new();
        let scaffold = Scaffold::new("test", tenant.clone(), &main).reads(&other);
        let (reconciled, run) = run_counting(scaffold, &cancel);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            reconciled.load(Ordering::SeqCst),
            0,
            "reconciled before every cache was filled"
        );
        assert_eq!(tenant.permits.available(), 1, "a waiting reconcile holds no permit");
        listed(&other_feed, &[]);
        eventually("the reconcile after the caches filled", || {
            reconciled.load(Ordering::SeqCst) == 1
        })
        .await;
        cancel.cancel();
        run.await.unwrap();
    }

    #[tokio::test]
    async fn a_panicking_reconcile_is_counted_by_kind_and_backs_off() {
        let (feed, main, _driver) = fed::<ConfigMap>();
        listed(&feed, &[config_map("a")]);
        let tenant = tenant();
        let cancel = CancellationToken::new();
        let scaffold = Scaffold::new("test", tenant.clone(), &main);
        let run = tokio::spawn({
            let cancel = cancel.clone();
            async move {
                let reconcile = |_: Arc<ConfigMap>, _: Arc<()>, _permit: Permit| async move {
                    if true {
                        panic!("a bug");
                    }
                    Ok::<_, TestError>(Action::await_change())
                };
                scaffold.run(Arc::new(()), reconcile, &cancel).await
            }
        });
        let needle = "stackd_reconcile_errors_by_kind_total{tenant=\"acme\",controller=\"test\",kind=\"panic\"} 1";
        eventually("the panic counted", || tenant.metrics.encode().contains(needle)).await;
        let text = tenant.metrics.encode();
        assert!(
            text.contains("stackd_reconcile_duration_seconds_count{tenant=\"acme\",controller=\"test\"} 1"),
            "{text}"
        );
        // The object's backoff counted the failure (its retry waits the 60 s base).
        let key = backoff_key(&config_map("a"));
        eventually("the failure counted", || tenant.backoff.failures(&key) == 1).await;
        assert_eq!(
            tenant.permits.available(),
            1,
            "the panicked reconcile gave its permit back"
        );
        cancel.cancel();
        run.await.unwrap();
    }

    /// The watch event of the controller's own status write wakes nothing; any other change of
    /// the object (another resourceVersion) does.
    #[tokio::test]
    async fn the_event_of_a_controllers_own_status_write_wakes_nothing() {
        let (feed, main, _driver) = fed::<ConfigMap>();
        let at = |version: &str| ConfigMap {
            metadata: ObjectMeta {
                uid: Some("uid-a".into()),
                resource_version: Some(version.into()),
                ..config_map("a").metadata
            },
            ..Default::default()
        };
        listed(&feed, &[at("1")]);
        let tenant = tenant();
        let written = Arc::new(Written::<String>::default());
        let cancel = CancellationToken::new();
        let scaffold = Scaffold::ignoring_own_writes("test", tenant.clone(), &main, written.clone());
        let (reconciled, run) = run_counting(scaffold, &cancel);
        eventually("the first reconcile", || reconciled.load(Ordering::SeqCst) == 1).await;
        written.record("uid-a", Some("2".into()), "Ready".into());
        feed.send(Ok(Event::Apply(at("2")))).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            reconciled.load(Ordering::SeqCst),
            1,
            "the own write's event woke a reconcile"
        );
        feed.send(Ok(Event::Apply(at("3")))).unwrap();
        eventually("the reconcile of the other change", || {
            reconciled.load(Ordering::SeqCst) == 2
        })
        .await;
        cancel.cancel();
        run.await.unwrap();
    }

    /// A reconcile that failed while its tenant was down waits for the tenant, not its backoff
    /// (60 s here): it runs again the moment the tenant answers.
    #[tokio::test]
    async fn a_reconcile_failed_while_the_tenant_was_down_runs_again_at_its_return() {
        runs_again_at_the_return_of(|tenant| &tenant.reachability).await;
    }

    /// The same for the host: a reconcile that failed while the host was down (a tenant's host
    /// objects) runs again the moment the host answers.
    #[tokio::test]
    async fn a_reconcile_failed_while_the_host_was_down_runs_again_at_its_return() {
        runs_again_at_the_return_of(|tenant| &tenant.host).await;
    }

    async fn runs_again_at_the_return_of(server: fn(&TestTenant) -> &Arc<Reachability>) {
        let (feed, main, _driver) = fed::<ConfigMap>();
        listed(&feed, &[config_map("a")]);
        let tenant = tenant();
        server(&tenant).report_down(crate::runtime::cause::Cause {
            kind: crate::runtime::cause::CauseKind::Refused,
            message: "connection refused".into(),
        });
        let attempts = Arc::new(AtomicUsize::new(0));
        let cancel = CancellationToken::new();
        let scaffold = Scaffold::new("test", tenant.clone(), &main);
        let run = tokio::spawn({
            let (attempts, cancel) = (attempts.clone(), cancel.clone());
            async move {
                let reconcile = |_: Arc<ConfigMap>, attempts: Arc<AtomicUsize>, _permit: Permit| async move {
                    if attempts.fetch_add(1, Ordering::SeqCst) == 0 {
                        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
                        return Err(TestError::Unreachable(refused));
                    }
                    Ok(Action::await_change())
                };
                scaffold.run(attempts, reconcile, &cancel).await
            }
        });
        let key = backoff_key(&config_map("a"));
        eventually("the failure counted", || tenant.backoff.failures(&key) == 1).await;
        let returned = Instant::now();
        server(&tenant).report_answering();
        eventually("the retry at the return", || attempts.load(Ordering::SeqCst) == 2).await;
        // Not the probe interval's 2 to 4 s, not the 60 s backoff.
        assert!(returned.elapsed() < Duration::from_secs(1), "{:?}", returned.elapsed());
        assert_eq!(tenant.backoff.failures(&key), 0, "its backoff starts over");
        cancel.cancel();
        run.await.unwrap();
    }

    /// A singleton reconciles once every cache has listed, even empty ones (it exists to create
    /// what is missing), retries a failure on its own after the tenant's backoff, and counts both.
    #[tokio::test]
    async fn a_singleton_reconciles_after_every_cache_listed_and_retries_a_failure_on_its_own() {
        use kube::runtime::reflector::{self, reflector};
        let (first_feed, first_events) =
            tokio::sync::mpsc::unbounded_channel::<Result<Event<ConfigMap>, watcher::Error>>();
        let (second_feed, second_events) =
            tokio::sync::mpsc::unbounded_channel::<Result<Event<Secret>, watcher::Error>>();
        let (first, first_writer) = reflector::store();
        let (second, second_writer) = reflector::store();
        let first_stream = reflector(
            first_writer,
            tokio_stream::wrappers::UnboundedReceiverStream::new(first_events),
        )
        .map(|e| e.map(|_| ()));
        let second_stream = reflector(
            second_writer,
            tokio_stream::wrappers::UnboundedReceiverStream::new(second_events),
        )
        .map(|e| e.map(|_| ()));
        let tenant = Arc::new(TestTenant {
            backoff: ObjectBackoff::new(Backoff::new(Duration::from_millis(200), Duration::from_millis(200))),
            ..Arc::into_inner(tenant()).unwrap()
        });
        let attempts = Arc::new(AtomicUsize::new(0));
        let cancel = CancellationToken::new();
        let singleton = Singleton::new("single", tenant.clone())
            .watches(first, first_stream)
            .watches(second, second_stream);
        let run = tokio::spawn({
            let (attempts, cancel) = (attempts.clone(), cancel.clone());
            async move {
                let reconcile = |_permit: Permit| {
                    let attempt = attempts.fetch_add(1, Ordering::SeqCst);
                    async move {
                        if attempt == 0 {
                            panic!("the first attempt fails");
                        }
                        Ok::<_, TestError>(())
                    }
                };
                singleton.run(reconcile, &cancel).await
            }
        });
        first_feed.send(Ok(Event::Init)).unwrap();
        first_feed.send(Ok(Event::InitDone)).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            attempts.load(Ordering::SeqCst),
            0,
            "reconciled before every cache listed"
        );
        second_feed.send(Ok(Event::Init)).unwrap();
        second_feed.send(Ok(Event::InitDone)).unwrap();
        // The failed first attempt is retried after the backoff without any new event.
        eventually("the retry after the failure", || attempts.load(Ordering::SeqCst) == 2).await;
        let text = tenant.metrics.encode();
        assert!(
            text.contains("stackd_reconcile_duration_seconds_count{tenant=\"acme\",controller=\"single\"} 2"),
            "{text}"
        );
        assert!(
            text.contains(
                "stackd_reconcile_errors_by_kind_total{tenant=\"acme\",controller=\"single\",kind=\"panic\"} 1"
            ),
            "{text}"
        );
        assert_eq!(tenant.backoff.failures("single"), 0, "the success reset the backoff");
        cancel.cancel();
        run.await.unwrap();
    }
}
