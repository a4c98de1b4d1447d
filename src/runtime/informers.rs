//! One cache per kind, scope and selector per tenant, shared by every controller that reads it: one
//! watch and one store, whose changes are fanned out to each subscriber, deletions included (kube's
//! `store_shared` subscribers never hear of a deletion; the install controller's uninstall and the
//! Job replacement wait for them).
//!
//! Each subscriber has a bounded channel and the watch waits for the slowest one, so a busy
//! controller slows the watch instead of losing events. A subscriber that joins late first gets
//! every object already cached.

use std::any::Any;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::events::{self, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store, store::Writer};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher::watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

use super::readiness::{Readiness, ReadySignal};
use super::recovery::retry_watch;

/// Changes a subscriber may fall behind by before the watch waits for it.
const SUBSCRIBER_BUFFER: usize = 1024;

/// What a subscriber hears from a shared cache.
pub enum Change<K> {
    /// An object was added, changed or deleted (the cache no longer holds a deleted one).
    Touched(Arc<K>),
    /// A (re)list completed: the cache holds everything the server has.
    Synced,
    /// The watch failed; it is retried with backoff.
    Failed(Arc<watcher::Error>),
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        match self {
            Change::Touched(object) => Change::Touched(object.clone()),
            Change::Synced => Change::Synced,
            Change::Failed(err) => Change::Failed(err.clone()),
        }
    }
}

type Subscribers<K> = Arc<Mutex<Vec<mpsc::Sender<Change<K>>>>>;

/// A cache of one kind: its store, when it is filled, and subscriptions to its changes.
pub struct SharedCache<K: Resource + 'static>
where
    K::DynamicType: Hash + Eq,
{
    store: Store<K>,
    ready: Readiness,
    subscribers: Subscribers<K>,
}

impl<K: Resource + 'static> Clone for SharedCache<K>
where
    K::DynamicType: Hash + Eq,
{
    fn clone(&self) -> Self {
        SharedCache {
            store: self.store.clone(),
            ready: self.ready.clone(),
            subscribers: self.subscribers.clone(),
        }
    }
}

impl<K> SharedCache<K>
where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Hash + Eq + Clone,
{
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// Resolves once the first list completed (never await the store's own `wait_until_ready`).
    pub fn readiness(&self) -> Readiness {
        self.ready.clone()
    }

    /// Every change from now on, after the objects cached already (and `Synced` if it is filled).
    pub fn changes(&self) -> BoxStream<'static, Change<K>> {
        let (sender, receiver) = mpsc::channel(SUBSCRIBER_BUFFER);
        let mut subscribers = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        // Taken after the store was written and before the change is sent: at worst a subscriber
        // hears of an object twice, never not at all.
        let mut replay: Vec<Change<K>> = self.store.state().into_iter().map(Change::Touched).collect();
        if self.ready.is_ready() {
            replay.push(Change::Synced);
        }
        subscribers.push(sender);
        futures::stream::iter(replay)
            .chain(ReceiverStream::new(receiver))
            .boxed()
    }

    /// The objects touched from now on (after those cached already), deletions included.
    pub fn touched(&self) -> impl Stream<Item = Arc<K>> + Send + 'static {
        self.changes().filter_map(|change| {
            futures::future::ready(match change {
                Change::Touched(object) => Some(object),
                Change::Synced | Change::Failed(_) => None,
            })
        })
    }
}

/// Where a test feeds a cache made by [`fed`].
#[cfg(test)]
pub(crate) type Feed<K> = mpsc::UnboundedSender<Result<Event<K>, watcher::Error>>;

/// A cache fed by hand, and the task that keeps it: for tests of what reads shared caches.
#[cfg(test)]
pub(crate) fn fed<K>() -> (Feed<K>, SharedCache<K>, tokio::task::JoinHandle<()>)
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    let (feed, events) = mpsc::unbounded_channel();
    let (cache, driver) = start("test".into(), |_| {
        tokio_stream::wrappers::UnboundedReceiverStream::new(events)
    });
    (feed, cache, driver)
}

/// A cache kept up to date with `events` by the returned task.
fn start<K, S>(name: String, events: impl FnOnce(Store<K>) -> S) -> (SharedCache<K>, tokio::task::JoinHandle<()>)
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    S: Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
{
    let writer = Writer::<K>::default();
    let events = events(writer.as_reader());
    let (signal, ready) = Readiness::signal();
    let cache = SharedCache {
        store: writer.as_reader(),
        ready,
        subscribers: Subscribers::default(),
    };
    let driver = tokio::spawn(drive(name, events, writer, cache.subscribers.clone(), signal));
    (cache, driver)
}

/// Keeps a store and its subscribers up to date with `events`.
async fn drive<K>(
    name: String,
    events: impl Stream<Item = Result<Event<K>, watcher::Error>>,
    mut writer: Writer<K>,
    subscribers: Subscribers<K>,
    ready: ReadySignal,
) where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Hash + Eq + Clone + Default,
{
    let reader = writer.as_reader();
    let mut events = std::pin::pin!(events);
    // What the cache held before a relist: objects gone from the new list are deletions too.
    let mut before_relist: Vec<Arc<K>> = Vec::new();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                // Retried with backoff; the tenant's CRD monitor reports an outage.
                debug!(watch = %name, error = %err, cause = %super::cause::diagnose(&err), "watch failed; retrying");
                dispatch(&subscribers, vec![Change::Failed(Arc::new(err))]).await;
                continue;
            }
        };
        if matches!(event, Event::Init) {
            before_relist = reader.state();
        }
        writer.apply_watcher_event(&event);
        let changes = match event {
            Event::Apply(object) => {
                let cached = reader.get(&ObjectRef::from_obj(&object));
                vec![Change::Touched(cached.unwrap_or_else(|| Arc::new(object)))]
            }
            Event::Delete(object) => vec![Change::Touched(Arc::new(object))],
            Event::Init | Event::InitApply(_) => continue,
            Event::InitDone => {
                ready.ready();
                let listed = reader.state();
                let gone = std::mem::take(&mut before_relist)
                    .into_iter()
                    .filter(|old| reader.get(&ObjectRef::from_obj(old.as_ref())).is_none());
                listed
                    .into_iter()
                    .chain(gone)
                    .map(Change::Touched)
                    .chain([Change::Synced])
                    .collect()
            }
        };
        dispatch(&subscribers, changes).await;
    }
}

/// Sends `changes` to every subscriber, waiting while one is full; forgets those that left.
async fn dispatch<K>(subscribers: &Subscribers<K>, changes: Vec<Change<K>>) {
    let senders = subscribers.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for change in changes {
        for sender in &senders {
            let _ = sender.send(change.clone()).await;
        }
    }
    subscribers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|sender| !sender.is_closed());
}

/// Tenant objects whose body does not decode are logged, reported and left out, so that one
/// malformed object cannot stop the watch of its kind (and with it every controller reading it).
/// The deletion of one still goes through, with the last copy that could be read.
fn valid_only<K>(event: Event<DeserializeGuard<K>>, recorder: Option<&Recorder>, cached: &Store<K>) -> Option<Event<K>>
where
    K: Resource<DynamicType = ()> + Clone,
{
    let valid = |guard: DeserializeGuard<K>| match guard.0 {
        Ok(object) => Some(object),
        Err(invalid) => {
            report_invalid::<K>(invalid, recorder);
            None
        }
    };
    Some(match event {
        Event::Apply(guard) => Event::Apply(valid(guard)?),
        Event::Delete(DeserializeGuard(Ok(object))) => Event::Delete(object),
        Event::Delete(DeserializeGuard(Err(invalid))) => {
            let name = invalid.metadata.name.as_deref()?;
            let at = ObjectRef::<K>::new(name);
            let at = match invalid.metadata.namespace.as_deref() {
                Some(namespace) => at.within(namespace),
                None => at,
            };
            Event::Delete(cached.get(&at)?.as_ref().clone())
        }
        Event::InitApply(guard) => Event::InitApply(valid(guard)?),
        Event::Init => Event::Init,
        Event::InitDone => Event::InitDone,
    })
}

/// Logs a malformed object and, given a recorder, tells its owner with a Warning Event on it.
fn report_invalid<K: Resource<DynamicType = ()>>(invalid: InvalidObject, recorder: Option<&Recorder>) {
    let metadata = invalid.metadata;
    warn!(
        kind = %K::kind(&()),
        namespace = metadata.namespace.as_deref().unwrap_or_default(),
        name = metadata.name.as_deref().unwrap_or_default(),
        error = %invalid.error,
        "ignoring an object that does not match its schema; fix or delete it"
    );
    let Some(recorder) = recorder.cloned() else {
        return;
    };
    let reference = ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        namespace: metadata.namespace,
        name: metadata.name,
        uid: metadata.uid,
        ..Default::default()
    };
    let event = events::Event {
        type_: EventType::Warning,
        reason: "InvalidObject".into(),
        note: Some(format!(
            "stackd cannot read this object and ignores it until it is fixed: {}",
            invalid.error
        )),
        action: "Read".into(),
        secondary: None,
    };
    tokio::spawn(async move {
        if let Err(err) = recorder.publish(&event, &reference).await {
            debug!(error = %err, "cannot publish an event");
        }
    });
}

/// A tenant's shared caches, started on first use. Dropping it stops their watches.
pub struct Informers {
    tenant: Client,
    host: Client,
    host_namespace: String,
    /// Selects this tenant's objects among the host namespace's.
    host_selector: String,
    caches: Mutex<HashMap<String, Box<dyn Any + Send + Sync>>>,
    drivers: Mutex<Vec<AbortOnDropHandle<()>>>,
    /// Where malformed tenant objects are reported.
    recorder: Option<Recorder>,
    /// Changes when the tenant answers again after an outage: its watches retry at once.
    tenant_back: Option<tokio::sync::watch::Receiver<u64>>,
}

impl Informers {
    pub fn new(tenant: Client, host: Client, host_namespace: &str, host_selector: &str) -> Informers {
        Informers {
            tenant,
            host,
            host_namespace: host_namespace.to_string(),
            host_selector: host_selector.to_string(),
            caches: Mutex::default(),
            drivers: Mutex::default(),
            recorder: None,
            tenant_back: None,
        }
    }

    /// Tenant watches waiting to retry do so at once when `back` changes (the tenant answers again).
    pub fn resuming_on(self, back: tokio::sync::watch::Receiver<u64>) -> Informers {
        Informers {
            tenant_back: Some(back),
            ..self
        }
    }

    /// Malformed tenant objects get a Warning Event from `recorder`.
    pub fn reporting_to(self, recorder: Recorder) -> Informers {
        Informers {
            recorder: Some(recorder),
            ..self
        }
    }

    /// Tenant objects of a built-in kind, in every namespace, selected by `labels` ("" for all).
    pub fn tenant<K>(&self, labels: &str) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    {
        let config = selected(labels);
        let key = format!("tenant {}/{} {labels}", K::api_version(&()), K::plural(&()));
        let api = Api::<K>::all(self.tenant.clone());
        self.cache(key, move |_| watcher(api, config).boxed())
    }

    /// Tenant objects of a stackd kind, every namespace: malformed ones are left out and logged.
    pub fn tenant_guarded<K>(&self) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    {
        let key = format!("tenant {}/{} (guarded)", K::api_version(&()), K::plural(&()));
        let api = Api::<DeserializeGuard<K>>::all(self.tenant.clone());
        let recorder = self.recorder.clone();
        self.cache(key, move |cached| {
            watcher(api, watcher::Config::default())
                .filter_map(move |event| {
                    let event = event.map(|event| valid_only(event, recorder.as_ref(), &cached));
                    futures::future::ready(event.transpose())
                })
                .boxed()
        })
    }

    /// The tenant's CRDs, cached slim (see [`crate::api::crds::slim`]).
    pub fn tenant_crds(&self) -> SharedCache<CustomResourceDefinition> {
        let api = Api::<CustomResourceDefinition>::all(self.tenant.clone());
        self.cache("tenant crds".to_string(), move |_| {
            watcher(api, watcher::Config::default())
                .modify(crate::api::crds::slim)
                .boxed()
        })
    }

    /// This tenant's objects of a kind in its host namespace.
    pub fn host<K>(&self) -> SharedCache<K>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
            + Clone
            + Debug
            + DeserializeOwned
            + Send
            + Sync
            + 'static,
    {
        let key = format!("host {}/{}", K::api_version(&()), K::plural(&()));
        let api = Api::<K>::namespaced(self.host.clone(), &self.host_namespace);
        let config = selected(&self.host_selector);
        self.cache(key, move |_| watcher(api, config).boxed())
    }

    /// The cache under `key`, started from `watch` when it is the first.
    fn cache<K>(
        &self,
        key: String,
        watch: impl FnOnce(Store<K>) -> BoxStream<'static, Result<Event<K>, watcher::Error>>,
    ) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let mut caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cache) = caches.get(&key).and_then(|c| c.downcast_ref::<SharedCache<K>>()) {
            return cache.clone();
        }
        let back = self.tenant_back.clone().filter(|_| key.starts_with("tenant "));
        let (cache, driver) = start(key.clone(), |cached| retry_watch(watch(cached), back));
        self.drivers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(AbortOnDropHandle::new(driver));
        caches.insert(key, Box::new(cache.clone()));
        cache
    }

    /// Stops every watch: the tenant stopped, and a task that still holds its context must not
    /// keep them open.
    pub fn stop(&self) {
        self.drivers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.caches.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// How many watches are open: (tenant, host).
    pub fn watches(&self) -> (usize, usize) {
        let caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
        let host = caches.keys().filter(|key| key.starts_with("host ")).count();
        (caches.len() - host, host)
    }
}

fn selected(labels: &str) -> watcher::Config {
    if labels.is_empty() {
        watcher::Config::default()
    } else {
        watcher::Config::default().labels(labels)
    }
}

#[cfg(test)]
mod tests;
