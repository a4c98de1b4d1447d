//! The task that keeps one shared cache: it measures each object a watch brings, decodes those under
//! the size cap (large ones off the async workers), refuses the others, charges what it keeps to
//! the tenant's memory budget (stopping when the tenant is over it), writes the store and fans the
//! changes out to the subscribers.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tracing::debug;

use super::refusals::{Refusal, Refusals};
use super::report::Reporter;
use super::{Change, Subscribers, dispatch};
use crate::runtime::memory_budget::{Ledger, MemoryBudget};
use crate::runtime::parse_error::LocatedParseError;
use crate::runtime::raw_object::RawObject;
use crate::runtime::readiness::ReadySignal;

/// Objects at least this large (as JSON) are decoded on a blocking thread, not an async worker.
const DECODE_INLINE_MAX: usize = 64 * 1024;
/// What a refused object is charged (its record), so that floods of them count too.
const REFUSAL_BYTES: u64 = 512;

/// An object as a watch brings it: raw JSON to measure and decode, or decoded already (the slim
/// CRD cache, caches fed by tests).
pub enum Incoming<K> {
    Raw(Box<RawObject<K>>),
    Decoded(K),
}

impl<K: Resource> Incoming<K> {
    fn metadata(&self) -> &ObjectMeta {
        match self {
            Incoming::Raw(raw) => &raw.metadata,
            Incoming::Decoded(object) => object.meta(),
        }
    }
}

/// What a cache makes of an incoming object.
enum Read<K> {
    Object(K, u64),
    TooLarge(Box<(Refusal, ObjectMeta)>),
    Invalid(Box<InvalidObject>),
}

/// What bounds a cache: the size cap and the tenant's budget.
#[derive(Clone)]
pub struct CacheLimits {
    pub max_object_bytes: u64,
    pub budget: Option<Arc<MemoryBudget>>,
}

/// Everything a cache's task works with.
pub(super) struct Driver<K: Resource<DynamicType = ()> + Clone + 'static> {
    pub name: String,
    pub writer: Writer<K>,
    pub subscribers: Subscribers<K>,
    pub ready: Option<ReadySignal>,
    pub refusals: Refusals,
    pub limits: CacheLimits,
    pub reporter: Reporter,
    pub ledger: Ledger,
    /// What the cache held before a relist: objects gone from the new list are deletions too.
    pub before_relist: Vec<Arc<K>>,
}

/// Whether the cache goes on.
enum Flow<K> {
    Changes(Vec<Change<K>>),
    /// The tenant is over its memory budget: the watch stops (the tenant is being suspended).
    Stop,
}

impl<K> Driver<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Send + Sync + 'static,
{
    /// Keeps the store and the subscribers up to date with `events` until they end or the
    /// tenant goes over its budget.
    pub(super) async fn run(mut self, events: impl Stream<Item = Result<Event<Incoming<K>>, watcher::Error>>) {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(err) => {
                    // Retried with backoff; the tenant's CRD monitor reports an outage.
                    debug!(watch = %self.name, error = %err, cause = %crate::runtime::cause::diagnose(&err), "watch failed; retrying");
                    dispatch(&self.subscribers, vec![Change::Failed(Arc::new(err))]).await;
                    continue;
                }
            };
            match self.handle(event).await {
                Flow::Changes(changes) => dispatch(&self.subscribers, changes).await,
                Flow::Stop => {
                    debug!(watch = %self.name, "the tenant is over its memory budget; the watch stops");
                    return;
                }
            }
        }
    }

    async fn handle(&mut self, event: Event<Incoming<K>>) -> Flow<K> {
        match event {
            Event::Init => {
                self.before_relist = self.writer.as_reader().state();
                self.ledger.start_relist();
                self.refusals.start_relist();
                self.writer.apply_watcher_event(&Event::Init);
                Flow::Changes(Vec::new())
            }
            Event::InitApply(incoming) => match self.read(incoming).await {
                Read::Object(object, bytes) => {
                    let delta = self.ledger.hold(key_of(object.meta()), bytes);
                    if !self.charge(delta) {
                        return Flow::Stop;
                    }
                    self.writer.apply_watcher_event(&Event::InitApply(object));
                    Flow::Changes(Vec::new())
                }
                refused => self
                    .leave_out(refused)
                    .map_or(Flow::Stop, |_| Flow::Changes(Vec::new())),
            },
            Event::InitDone => self.relisted(),
            Event::Apply(incoming) => self.applied(incoming).await,
            Event::Delete(incoming) => self.deleted(incoming).await,
        }
    }

    fn relisted(&mut self) -> Flow<K> {
        self.writer.apply_watcher_event(&Event::InitDone);
        self.refusals.finish_relist();
        let delta = self.ledger.finish_relist();
        if !self.charge(delta) {
            return Flow::Stop;
        }
        if let Some(ready) = &self.ready {
            ready.ready();
        }
        let reader = self.writer.as_reader();
        let listed = reader.state();
        let gone = std::mem::take(&mut self.before_relist)
            .into_iter()
            .filter(|old| reader.get(&ObjectRef::from_obj(old.as_ref())).is_none());
        Flow::Changes(
            listed
                .into_iter()
                .chain(gone)
                .map(Change::Touched)
                .chain([Change::Synced])
                .collect(),
        )
    }

    async fn applied(&mut self, incoming: Incoming<K>) -> Flow<K> {
        let at = object_ref::<K>(incoming.metadata());
        match self.read(incoming).await {
            Read::Object(object, bytes) => {
                let meta = object.meta();
                self.refusals
                    .forget(meta.namespace.as_deref(), meta.name.as_deref().unwrap_or_default());
                let delta = self.ledger.hold(key_of(meta), bytes);
                if !self.charge(delta) {
                    return Flow::Stop;
                }
                self.writer.apply_watcher_event(&Event::Apply(object.clone()));
                let cached = self.writer.as_reader().get(&at);
                Flow::Changes(vec![Change::Touched(cached.unwrap_or_else(|| Arc::new(object)))])
            }
            refused => match self.leave_out(refused) {
                None => Flow::Stop,
                // The copy read before is stale now: out it goes (its readers see the object as
                // refused, not as gone).
                Some(true) => Flow::Changes(self.drop_cached(&at).into_iter().map(Change::Touched).collect()),
                // A malformed update leaves the last readable copy, as it always did.
                Some(false) => Flow::Changes(Vec::new()),
            },
        }
    }

    async fn deleted(&mut self, incoming: Incoming<K>) -> Flow<K> {
        let meta = incoming.metadata().clone();
        let at = object_ref::<K>(&meta);
        self.refusals
            .forget(meta.namespace.as_deref(), meta.name.as_deref().unwrap_or_default());
        let delta = self.ledger.release(&key_of(&meta));
        self.charge(delta);
        let last = match self.read(incoming).await {
            Read::Object(object, _) => Some(object),
            // The last copy that could be read goes with it.
            Read::TooLarge(_) | Read::Invalid(_) => self.writer.as_reader().get(&at).map(|o| o.as_ref().clone()),
        };
        let Some(last) = last else {
            return Flow::Changes(Vec::new());
        };
        self.writer.apply_watcher_event(&Event::Delete(last.clone()));
        Flow::Changes(vec![Change::Touched(Arc::new(last))])
    }

    /// Takes a stale copy out of the store, returning it.
    fn drop_cached(&mut self, at: &ObjectRef<K>) -> Option<Arc<K>> {
        let cached = self.writer.as_reader().get(at)?;
        self.writer.apply_watcher_event(&Event::Delete(cached.as_ref().clone()));
        Some(cached)
    }

    /// Records and reports an object that is not cached: whether a cached copy of it is stale now,
    /// `None` when the tenant is over its budget.
    fn leave_out(&mut self, read: Read<K>) -> Option<bool> {
        match read {
            Read::Object(..) => Some(false),
            Read::Invalid(invalid) => {
                self.reporter.invalid(&K::kind(&()), &K::api_version(&()), *invalid);
                Some(false)
            }
            Read::TooLarge(refused) => {
                let (refusal, metadata) = *refused;
                let key = key_of(&metadata);
                if self.refusals.refuse(refusal.clone()) {
                    let cap = self.limits.max_object_bytes;
                    self.reporter.too_large(&refusal, &K::api_version(&()), metadata, cap);
                }
                let delta = self.ledger.hold(key, REFUSAL_BYTES);
                self.charge(delta).then_some(true)
            }
        }
    }

    /// Measures and decodes one object.
    async fn read(&self, incoming: Incoming<K>) -> Read<K> {
        let raw = match incoming {
            Incoming::Decoded(object) => return Read::Object(object, 0),
            Incoming::Raw(raw) => raw,
        };
        let json_bytes = raw.json.len() as u64;
        if json_bytes > self.limits.max_object_bytes {
            let refusal = Refusal {
                kind: K::kind(&()).into_owned(),
                namespace: raw.metadata.namespace.clone(),
                name: raw.metadata.name.clone().unwrap_or_default(),
                uid: raw.metadata.uid.clone(),
                resource_version: raw.metadata.resource_version.clone(),
                json_bytes,
                holds: self.reporter.holds(&raw.metadata),
            };
            return Read::TooLarge(Box::new((refusal, raw.metadata)));
        }
        let bytes = raw.footprint.bytes();
        let decoded = if raw.json.len() < DECODE_INLINE_MAX {
            decode(*raw)
        } else {
            match tokio::task::spawn_blocking(move || decode(*raw)).await {
                Ok(decoded) => decoded,
                Err(join) => Err(Box::new(InvalidObject {
                    error: format!("decoding failed: {join}"),
                    metadata: ObjectMeta::default(),
                })),
            }
        };
        match decoded {
            Ok(object) => Read::Object(object, bytes),
            Err(invalid) => Read::Invalid(invalid),
        }
    }

    /// Charges `delta` bytes to the tenant's budget; false once it is over.
    fn charge(&self, delta: i64) -> bool {
        match &self.limits.budget {
            Some(budget) if delta != 0 => budget.charge(delta, &K::kind(&())),
            Some(budget) => !budget.is_exceeded(),
            None => true,
        }
    }
}

/// Decodes a raw object into its type; a Secret's error says where, never what.
fn decode<K: Resource<DynamicType = ()> + DeserializeOwned>(raw: RawObject<K>) -> Result<K, Box<InvalidObject>> {
    raw.decode().map_err(|err| {
        let error = if K::kind(&()) == "Secret" {
            LocatedParseError::json(&err).to_string()
        } else {
            err.to_string()
        };
        Box::new(InvalidObject {
            error,
            metadata: raw.metadata,
        })
    })
}

fn object_ref<K: Resource<DynamicType = ()>>(meta: &ObjectMeta) -> ObjectRef<K> {
    let at = ObjectRef::new(meta.name.as_deref().unwrap_or_default());
    match meta.namespace.as_deref() {
        Some(namespace) => at.within(namespace),
        None => at,
    }
}

fn key_of(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}
