//! The task that keeps one shared cache: it measures each object a watch brings, decodes those under
//! the size cap (large ones off the async workers), refuses the others, charges what it keeps to
//! the tenant's memory budget and to the object's tenant namespace (leaving out what its namespace
//! has no share left for, and reading it again once it has; stopping when the tenant is over its
//! budget with what no namespace owns), writes the store and fans the changes out to the
//! subscribers.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::reflector::{ObjectRef, store::Writer};
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use tracing::debug;

use super::refusals::{Cause, Refusal, Refusals};
use super::report::Reporter;
use super::{Change, Subscribers, dispatch};
use crate::runtime::memory_budget::{Charges, Ledger, MemoryBudget, Verdict};
use crate::runtime::parse_error::LocatedParseError;
use crate::runtime::raw_object::RawObject;
use crate::runtime::readiness::ReadySignal;

/// Objects at least this large (as JSON) are decoded on a blocking thread, not an async worker.
const DECODE_INLINE_MAX: usize = 64 * 1024;
/// What a refused object is charged (its record), so that floods of them count too.
const REFUSAL_BYTES: u64 = 512;

/// An object as a watch brings it: raw JSON to measure and decode, or decoded already (caches fed
/// by tests).
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
    Refused(Box<(Refusal, ObjectMeta)>),
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
    /// Reads again the objects left out for their namespace's share (none in tests).
    pub client: Option<kube::Client>,
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
        let mut room = self.limits.budget.as_ref().map(|budget| budget.room_changes());
        loop {
            let event = tokio::select! {
                event = events.next() => match event {
                    Some(event) => event,
                    None => return,
                },
                () = room_changed(&mut room) => {
                    match self.readmit().await {
                        Flow::Changes(changes) => dispatch(&self.subscribers, changes).await,
                        Flow::Stop => return,
                    }
                    continue;
                }
            };
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
                    let holds = self.reporter.holds(object.meta());
                    let charges = self.ledger.hold(key_of(object.meta()), &holds, bytes);
                    if !self.charge(&charges) {
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
        let charges = self.ledger.finish_relist();
        if !self.charge(&charges) {
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
                let holds = self.reporter.holds(meta);
                let charges = self.ledger.hold(key_of(meta), &holds, bytes);
                if !self.charge(&charges) {
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
        let charges = self.ledger.release(&key_of(&meta));
        self.charge(&charges);
        let last = match self.read(incoming).await {
            Read::Object(object, _) => Some(object),
            // The last copy that could be read goes with it.
            Read::Refused(_) | Read::Invalid(_) => self.writer.as_reader().get(&at).map(|o| o.as_ref().clone()),
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
            Read::Refused(refused) => {
                let (refusal, metadata) = *refused;
                let key = key_of(&metadata);
                let holds = refusal.holds.clone();
                if let (Cause::OverBudget { .. }, Some(budget)) = (&refusal.cause, &self.limits.budget) {
                    budget.refused_in(&holds);
                }
                if self.refusals.refuse(refusal.clone()) {
                    let api_version = K::api_version(&());
                    match &refusal.cause {
                        Cause::TooLarge => {
                            let cap = self.limits.max_object_bytes;
                            self.reporter.too_large(&refusal, &api_version, metadata, cap);
                        }
                        Cause::OverBudget { overage, .. } => {
                            self.reporter.over_budget(&refusal, &api_version, metadata, overage);
                        }
                    }
                }
                let charges = self.ledger.hold(key, &holds, REFUSAL_BYTES);
                self.charge(&charges).then_some(true)
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
        let holds = self.reporter.holds(&raw.metadata);
        let bytes = raw.footprint.bytes();
        let cause = if json_bytes > self.limits.max_object_bytes {
            Some(Cause::TooLarge)
        } else {
            // Judged before it is decoded: what its namespace has no share for is never built.
            self.over_budget(&raw.metadata, &holds, bytes)
        };
        if let Some(cause) = cause {
            let refusal = Refusal {
                kind: K::kind(&()).into_owned(),
                namespace: raw.metadata.namespace.clone(),
                name: raw.metadata.name.clone().unwrap_or_default(),
                uid: raw.metadata.uid.clone(),
                resource_version: raw.metadata.resource_version.clone(),
                json_bytes,
                holds,
                cause,
            };
            return Read::Refused(Box::new((refusal, raw.metadata)));
        }
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

    /// Why an object of `holds` that takes `bytes` is not to be cached: its namespace has no
    /// share left for it.
    fn over_budget(&self, metadata: &ObjectMeta, holds: &str, bytes: u64) -> Option<Cause> {
        let budget = self.limits.budget.as_ref()?;
        let charges = self.ledger.charges(&key_of(metadata), holds, bytes);
        let overage = budget.admits(&charges).err()?;
        Some(Cause::OverBudget {
            overage,
            footprint: bytes,
        })
    }

    /// Charges what the cache holds to the tenant's budget; false once the tenant is over it.
    fn charge(&self, charges: &Charges) -> bool {
        let Some(budget) = &self.limits.budget else {
            return true;
        };
        budget.charge(charges, &K::kind(&())) != Verdict::Suspended
    }

    /// Reads again the objects left out for their namespace's share that fit in it now (their
    /// namespace shrank); one that still does not fit is left out again, one deleted meanwhile is
    /// forgotten.
    async fn readmit(&mut self) -> Flow<K> {
        let (Some(budget), Some(client)) = (self.limits.budget.clone(), self.client.clone()) else {
            return Flow::Changes(Vec::new());
        };
        let mut changes = Vec::new();
        for refusal in self.refusals.over_budget() {
            let Cause::OverBudget { footprint, .. } = refusal.cause else {
                continue;
            };
            if budget.room_in(&refusal.holds) < footprint.saturating_sub(REFUSAL_BYTES) {
                continue;
            }
            match read_again::<K>(&client, &refusal).await {
                Ok(Some(raw)) => match self.applied(Incoming::Raw(Box::new(raw))).await {
                    Flow::Changes(more) => changes.extend(more),
                    Flow::Stop => return Flow::Stop,
                },
                Ok(None) => {
                    self.refusals.forget(refusal.namespace.as_deref(), &refusal.name);
                    let key = format!("{}/{}", refusal.namespace.as_deref().unwrap_or_default(), refusal.name);
                    let charges = self.ledger.release(&key);
                    if !self.charge(&charges) {
                        return Flow::Stop;
                    }
                }
                Err(err) => {
                    // Its next change, or the next room made in its namespace, brings it back.
                    debug!(watch = %self.name, object = %refusal.describe(), error = %err, "cannot read a refused object again");
                }
            }
        }
        Flow::Changes(changes)
    }
}

/// Resolves when a namespace that had an object refused shrinks; never without a budget.
async fn room_changed(room: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    let Some(room) = room else {
        return std::future::pending().await;
    };
    if room.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The refused object as the API server has it now; `None` when it is gone.
async fn read_again<K: Resource<DynamicType = ()>>(
    client: &kube::Client,
    refusal: &Refusal,
) -> Result<Option<RawObject<K>>, kube::Error> {
    let url = format!("{}/{}", K::url_path(&(), refusal.namespace.as_deref()), refusal.name);
    let request = http::Request::get(url)
        .body(Vec::new())
        .map_err(kube::Error::HttpError)?;
    match client.request::<RawObject<K>>(request).await {
        Ok(raw) => Ok(Some(raw)),
        Err(err) if crate::runtime::api_errors::is_not_found(&err) => Ok(None),
        Err(err) => Err(err),
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
