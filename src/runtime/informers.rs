//! One cache per kind, scope and selector per tenant, shared by every controller that reads it: one
//! watch and one store, whose changes are fanned out to each subscriber, deletions included (kube's
//! `store_shared` subscribers never hear of a deletion; the install controller's uninstall and the
//! Job replacement wait for them).
//!
//! Each subscriber has a bounded channel and the watch waits for the slowest one, so a busy
//! controller slows the watch instead of losing events. A subscriber that joins late first gets
//! every object already cached.
//!
//! What a tenant can make the daemon hold is bounded (DESIGN.md §8): each object is measured as
//! raw JSON before it is decoded ([`super::raw_object`]); one over `--max-cached-object-bytes` is
//! refused ([`refusals`]: not cached, remembered, reported with an `ObjectTooLarge` Event), and
//! what the caches keep is charged to the tenant's memory budget and to the object's tenant
//! namespace ([`super::memory_budget`]): one its namespace has no share left for is refused the
//! same way (a `NamespaceOverBudget` Event) and read again once the namespace has room. Lists
//! come in pages of [`LIST_PAGE_SIZE`] objects, so a list holds at most that many objects' JSON at
//! once whatever the tenant stored.

use std::any::Any;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{Store, store::Writer};
use kube::runtime::watcher::watcher;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::AbortOnDropHandle;

use super::memory_budget::{ByteSize, Ledger, MemoryBudget};
use super::raw_object::RawObject;
use super::readiness::Readiness;
use super::recovery::{WatchBackoff, retry_watch};

mod driver;
pub mod refusals;
pub mod report;

use driver::Driver;
pub use driver::{CacheLimits, Incoming};
use refusals::Refusals;
use report::{HostParentOf, Reporter};

/// Objects per list page: a list holds at most this many objects' JSON in memory at once.
pub const LIST_PAGE_SIZE: u32 = 50;
/// CRDs per list page: a package's CRD may be hundreds of KiB as JSON, of which a few are kept.
pub const CRD_LIST_PAGE_SIZE: u32 = 10;

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
    refusals: Refusals,
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
            refusals: self.refusals.clone(),
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

    /// The objects this cache refused as too large: absent from the store, yet not gone.
    pub fn refusals(&self) -> Refusals {
        self.refusals.clone()
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
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static,
{
    let (feed, events) = mpsc::unbounded_channel::<Result<Event<K>, watcher::Error>>();
    let (cache, driver) = start(
        "test".into(),
        CacheParts::default(),
        tokio_stream::wrappers::UnboundedReceiverStream::new(events)
            .map(|event| event.map(|event| map_event(event, Incoming::Decoded))),
    );
    (feed, cache, driver)
}

/// What a cache is made with besides its watch.
#[derive(Clone)]
struct CacheParts {
    limits: CacheLimits,
    reporter: Reporter,
    /// Reads again what the cache left out for its namespace's share (none in tests).
    client: Option<Client>,
}

impl Default for CacheParts {
    fn default() -> Self {
        CacheParts {
            limits: CacheLimits {
                max_object_bytes: ByteSize::DEFAULT_MAX_OBJECT.0,
                budget: None,
            },
            reporter: Reporter::default(),
            client: None,
        }
    }
}

/// A cache kept up to date with `events` by the returned task.
fn start<K, S>(name: String, parts: CacheParts, events: S) -> (SharedCache<K>, tokio::task::JoinHandle<()>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static,
    S: Stream<Item = Result<Event<Incoming<K>>, watcher::Error>> + Send + 'static,
{
    let writer = Writer::<K>::default();
    let (signal, ready) = Readiness::signal();
    let cache = SharedCache {
        store: writer.as_reader(),
        ready,
        subscribers: Subscribers::default(),
        refusals: Refusals::default(),
    };
    let driver = Driver {
        name,
        writer,
        subscribers: cache.subscribers.clone(),
        ready: Some(signal),
        refusals: cache.refusals.clone(),
        limits: parts.limits,
        reporter: parts.reporter,
        ledger: Ledger::default(),
        before_relist: Vec::new(),
        client: parts.client,
    };
    (cache, tokio::spawn(driver.run(events)))
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

/// A tenant's shared caches, started on first use. Dropping it stops their watches.
pub struct Informers {
    tenant: Client,
    host: Client,
    host_namespace: String,
    /// Selects this tenant's objects among the host namespace's.
    host_selector: String,
    caches: Mutex<HashMap<String, Box<dyn Any + Send + Sync>>>,
    drivers: Mutex<Vec<AbortOnDropHandle<()>>>,
    limits: CacheLimits,
    /// Where left-out tenant objects are reported.
    recorder: Option<Recorder>,
    /// Finds the tenant object a host object was made for.
    host_parent: Option<HostParentOf>,
    /// Changes when the tenant answers again after an outage: its watches retry at once.
    tenant_back: Option<tokio::sync::watch::Receiver<u64>>,
    /// The same for the host and the host watches.
    host_back: Option<tokio::sync::watch::Receiver<u64>>,
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
            limits: CacheParts::default().limits,
            recorder: None,
            host_parent: None,
            tenant_back: None,
            host_back: None,
        }
    }

    /// Tenant watches waiting to retry do so at once when `back` changes (the tenant answers again).
    pub fn resuming_on(self, back: tokio::sync::watch::Receiver<u64>) -> Informers {
        Informers {
            tenant_back: Some(back),
            ..self
        }
    }

    /// Host watches waiting to retry do so at once when `back` changes (the host answers again).
    pub fn resuming_host_on(self, back: tokio::sync::watch::Receiver<u64>) -> Informers {
        Informers {
            host_back: Some(back),
            ..self
        }
    }

    /// Left-out tenant objects get a Warning Event from `recorder`; left-out host objects one on
    /// the tenant object `host_parent` finds for them.
    pub fn reporting_to(self, recorder: Recorder, host_parent: HostParentOf) -> Informers {
        Informers {
            recorder: Some(recorder),
            host_parent: Some(host_parent),
            ..self
        }
    }

    /// Objects over `max_object_bytes` are refused; what is cached is charged to `budget`.
    pub fn limited(self, max_object_bytes: ByteSize, budget: Option<Arc<MemoryBudget>>) -> Informers {
        Informers {
            limits: CacheLimits {
                max_object_bytes: max_object_bytes.0,
                budget,
            },
            ..self
        }
    }

    /// The tenant's memory budget, when it has one.
    pub fn budget(&self) -> Option<Arc<MemoryBudget>> {
        self.limits.budget.clone()
    }

    fn parts(&self, host: bool) -> CacheParts {
        CacheParts {
            limits: self.limits.clone(),
            reporter: Reporter {
                recorder: self.recorder.clone(),
                host_parent: if host { self.host_parent } else { None },
            },
            client: Some(if host { self.host.clone() } else { self.tenant.clone() }),
        }
    }

    /// Tenant objects of a built-in kind, in every namespace, selected by `labels` ("" for all):
    /// malformed and oversized ones are left out and reported.
    pub fn tenant<K>(&self, labels: &str) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    {
        let key = format!("tenant {}/{} {labels}", K::api_version(&()), K::plural(&()));
        let api = Api::<RawObject<K>>::all(self.tenant.clone());
        let config = self.renewed(&key, selected(labels));
        self.cache(key, self.parts(false), raw_watch(api, config))
    }

    /// Tenant objects of a stackd kind, every namespace: malformed and oversized ones are left out
    /// and reported.
    pub fn tenant_guarded<K>(&self) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    {
        let key = format!("tenant {}/{} (guarded)", K::api_version(&()), K::plural(&()));
        let api = Api::<RawObject<K>>::all(self.tenant.clone());
        let config = self.renewed(&key, watcher::Config::default());
        self.cache(key, self.parts(false), raw_watch(api, config))
    }

    /// The tenant's CRDs, without their schemas (see [`super::raw_object`]): charged as they are
    /// kept and never decoded whole, in pages of [`CRD_LIST_PAGE_SIZE`]. No size cap: a package's
    /// CRDs are bounded by its package, and one left out would hold the work of every install.
    pub fn tenant_crds(&self) -> SharedCache<CustomResourceDefinition> {
        let api = Api::<RawObject<CustomResourceDefinition>>::all(self.tenant.clone());
        let config = self.renewed("tenant crds", watcher::Config::default());
        let mut parts = self.parts(false);
        parts.limits.max_object_bytes = u64::MAX;
        let events = raw_watch_paged(api, config, CRD_LIST_PAGE_SIZE);
        self.cache("tenant crds".to_string(), parts, events)
    }

    /// This tenant's objects of a kind in its host namespace: malformed and oversized ones are
    /// left out (the oversized reported on their tenant parent).
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
        let api = Api::<RawObject<K>>::namespaced(self.host.clone(), &self.host_namespace);
        let config = self.renewed(&key, selected(&self.host_selector));
        self.cache(key, self.parts(true), raw_watch(api, config))
    }

    /// This tenant's objects of a kind in its host namespace selected by `labels` instead of
    /// stackd's own: the pods a Job or Deployment makes carry only their template's labels.
    pub fn host_selected<K>(&self, labels: &str) -> SharedCache<K>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
            + Clone
            + Debug
            + DeserializeOwned
            + Send
            + Sync
            + 'static,
    {
        let key = format!("host {}/{} {labels}", K::api_version(&()), K::plural(&()));
        let api = Api::<RawObject<K>>::namespaced(self.host.clone(), &self.host_namespace);
        let config = self.renewed(&key, selected(labels));
        self.cache(key, self.parts(true), raw_watch(api, config))
    }

    /// `config` with its watch's server-side timeout spread by tenant and cache: a watch is
    /// renewed when it times out, and a replica's tenants, started together, would otherwise
    /// renew every watch in the same second every 290 s (client-go's reflector picks its
    /// timeouts at random for the same reason).
    fn renewed(&self, key: &str, config: watcher::Config) -> watcher::Config {
        config.timeout(watch_timeout(&self.host_namespace, key))
    }

    /// The cache under `key`, started from `events` when it is the first.
    fn cache<K>(
        &self,
        key: String,
        parts: CacheParts,
        events: BoxStream<'static, Result<Event<Incoming<K>>, watcher::Error>>,
    ) -> SharedCache<K>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static,
    {
        let mut caches = self.caches.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cache) = caches.get(&key).and_then(|c| c.downcast_ref::<SharedCache<K>>()) {
            return cache.clone();
        }
        // Retried with backoff; at once when its server (the tenant's, the host's) answers again.
        let back = if key.starts_with("tenant ") {
            self.tenant_back.clone()
        } else {
            self.host_back.clone()
        };
        let (cache, driver) = start(key.clone(), parts, retry_watch(events, back, WatchBackoff::default()));
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

/// A watch of raw objects, in pages of [`LIST_PAGE_SIZE`] (retried by [`Informers::cache`]).
fn raw_watch<K>(
    api: Api<RawObject<K>>,
    config: watcher::Config,
) -> BoxStream<'static, Result<Event<Incoming<K>>, watcher::Error>>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    raw_watch_paged(api, config, LIST_PAGE_SIZE)
}

/// A watch of raw objects, in pages of `page_size`.
fn raw_watch_paged<K>(
    api: Api<RawObject<K>>,
    config: watcher::Config,
    page_size: u32,
) -> BoxStream<'static, Result<Event<Incoming<K>>, watcher::Error>>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    watcher(api, config.page_size(page_size))
        .map(|event| event.map(|event| map_event(event, |raw| Incoming::Raw(Box::new(raw)))))
        .boxed()
}

/// The same event about `f` of its objects.
fn map_event<A, B>(event: Event<A>, f: impl Fn(A) -> B) -> Event<B> {
    match event {
        Event::Apply(object) => Event::Apply(f(object)),
        Event::Delete(object) => Event::Delete(f(object)),
        Event::Init => Event::Init,
        Event::InitApply(object) => Event::InitApply(f(object)),
        Event::InitDone => Event::InitDone,
    }
}

/// Seconds a watch asks the server to hold it: 200 to 290 (kube's default, under the five minutes
/// after which load balancers commonly cut an idle connection), the same for a cache on every start.
fn watch_timeout(host_namespace: &str, key: &str) -> u32 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    (host_namespace, key).hash(&mut hasher);
    200 + (hasher.finish() % 91) as u32
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
