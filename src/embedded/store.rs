//! In-memory object storage: one map per group/resource, one global resourceVersion counter, and the
//! bounded event history that watches resume from.
//!
//! Every write goes through [`Store::write`], whose closure sees the current object under the store
//! lock, so read-modify-write verbs (update, patch, delete with preconditions) are atomic. In-process
//! controllers use the same API as the HTTP layer.
//!
//! Each stored object is kept once, behind an `Arc`, and never changed in place: a write builds the
//! new value and swaps the `Arc`. Reads, the watch history and every watcher share that one value
//! (copy on write), so a read or an event costs no copy of the object.

mod index;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use tokio::sync::broadcast;

use super::status::ApiError;
use index::Indexes;
pub use index::{Location, owner_uids};

/// How many past events a watch can resume from before it gets `410 Expired`.
pub const HISTORY_WINDOW: usize = 1000;
const BROADCAST_CAPACITY: usize = 4096;

/// Storage key of a resource: objects are kept once per group/resource whatever version served them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupResource {
    pub group: String,
    pub resource: String,
}

impl GroupResource {
    pub fn new(group: &str, resource: &str) -> GroupResource {
        GroupResource {
            group: group.to_string(),
            resource: resource.to_string(),
        }
    }
}

/// Namespace ("" for cluster-scoped) and name.
pub type ObjectKey = (String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as stored in the history and fanned out to watchers.
#[derive(Debug, Clone)]
pub struct StoreEvent {
    pub event_type: EventType,
    pub resource: GroupResource,
    pub resource_version: u64,
    /// The new state (for DELETED: the last state, stamped with the deletion's resourceVersion).
    pub object: Arc<Value>,
    /// The previous state for MODIFIED, so filtered watches can tell entering from leaving.
    pub previous: Option<Arc<Value>>,
}

/// What a write closure decided.
pub enum Write {
    /// Store this object (the store stamps `metadata.resourceVersion`).
    Put(Value),
    /// Remove the object; the value is its final state, reported in the DELETED event.
    Remove(Value),
    /// Nothing changes; the result is the current object (`null` when there is none).
    Keep,
}

/// One resource's objects by namespace and name.
type Objects = BTreeMap<ObjectKey, Arc<Value>>;

struct Inner {
    resource_version: u64,
    objects: HashMap<GroupResource, Objects>,
    indexes: Indexes,
    history: VecDeque<Arc<StoreEvent>>,
    /// Highest resourceVersion whose event has fallen out of `history`.
    history_floor: u64,
    /// resourceVersion of the latest write per resource, so derived views know when to rebuild.
    last_change: HashMap<GroupResource, u64>,
    pod_logs: HashMap<(String, String, String), String>,
}

pub struct Store {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Arc<StoreEvent>>,
    /// Counts [`Store::reset`]s, which remove every object without an event.
    resets: tokio::sync::watch::Sender<u64>,
}

/// A watch subscription: the history to replay, then the live channel.
pub struct Subscription {
    pub backlog: Vec<Arc<StoreEvent>>,
    pub snapshot: Vec<Arc<Value>>,
    pub live: broadcast::Receiver<Arc<StoreEvent>>,
    /// The resourceVersion the backlog or snapshot is complete up to.
    pub resource_version: u64,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Store {
    pub fn new() -> Store {
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        Store {
            inner: Mutex::new(Inner {
                // Start above zero: "0" means "any version" to clients.
                resource_version: 1,
                objects: HashMap::new(),
                indexes: Indexes::default(),
                history: VecDeque::new(),
                history_floor: 0,
                last_change: HashMap::new(),
                pod_logs: HashMap::new(),
            }),
            events,
            resets: tokio::sync::watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a map half-written (a write stamps its object,
        // the one step that can panic, before it touches any map), so a poisoned lock is still
        // consistent.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().resource_version
    }

    /// The resourceVersion of the latest write to `resource` (0: never written).
    pub fn last_change(&self, resource: &GroupResource) -> u64 {
        self.lock().last_change.get(resource).copied().unwrap_or(0)
    }

    /// A copy of one object, for tests and setup; the server's own paths share it with
    /// [`Store::get_shared`].
    pub fn get(&self, resource: &GroupResource, namespace: &str, name: &str) -> Option<Value> {
        self.get_shared(resource, namespace, name).map(Arc::unwrap_or_clone)
    }

    /// One object, shared with the store (no copy).
    pub fn get_shared(&self, resource: &GroupResource, namespace: &str, name: &str) -> Option<Arc<Value>> {
        let inner = self.lock();
        inner
            .objects
            .get(resource)?
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    pub fn contains(&self, resource: &GroupResource, namespace: &str, name: &str) -> bool {
        let inner = self.lock();
        inner
            .objects
            .get(resource)
            .is_some_and(|map| map.contains_key(&(namespace.to_string(), name.to_string())))
    }

    /// Copies of the objects [`Store::list_shared`] returns, for tests and setup.
    pub fn list(&self, resource: &GroupResource, namespace: Option<&str>) -> (Vec<Value>, u64) {
        let (objects, version) = self.list_shared(resource, namespace);
        (objects.into_iter().map(Arc::unwrap_or_clone).collect(), version)
    }

    /// Objects of a resource (in one namespace, or all when `None`), ordered by namespace and name,
    /// with the resourceVersion the list is consistent at; shared with the store (no copies).
    pub fn list_shared(&self, resource: &GroupResource, namespace: Option<&str>) -> (Vec<Arc<Value>>, u64) {
        let inner = self.lock();
        (Self::select(&inner, resource, namespace), inner.resource_version)
    }

    fn select(inner: &Inner, resource: &GroupResource, namespace: Option<&str>) -> Vec<Arc<Value>> {
        let Some(map) = inner.objects.get(resource) else {
            return Vec::new();
        };
        match namespace {
            None => map.values().cloned().collect(),
            Some(namespace) => in_namespace(map, namespace).map(|(_, obj)| obj.clone()).collect(),
        }
    }

    /// `project` of every object of `resource`, ordered by namespace and name, read in place.
    pub fn project<T>(&self, resource: &GroupResource, project: impl Fn(&Value) -> T) -> Vec<T> {
        let inner = self.lock();
        inner
            .objects
            .get(resource)
            .map(|map| map.values().map(|object| project(object)).collect())
            .unwrap_or_default()
    }

    /// Whether no object of any resource is left in `namespace`.
    pub fn namespace_is_empty(&self, namespace: &str) -> bool {
        let inner = self.lock();
        inner
            .objects
            .values()
            .all(|map| in_namespace(map, namespace).next().is_none())
    }

    /// All resources with objects in a namespace (for namespace deletion).
    pub fn resources_in_namespace(&self, namespace: &str) -> Vec<(GroupResource, String)> {
        let inner = self.lock();
        let mut found = Vec::new();
        for (resource, map) in &inner.objects {
            found.extend(in_namespace(map, namespace).map(|((_, name), _)| (resource.clone(), name.clone())));
        }
        found
    }

    /// Where every object `keep` accepts is stored (a whole-store scan: for a loop's first pass).
    pub fn locations_where(&self, keep: impl Fn(&Value) -> bool) -> Vec<Location> {
        let inner = self.lock();
        let mut found = Vec::new();
        for (resource, map) in &inner.objects {
            let kept = map.iter().filter(|(_, object)| keep(object));
            found.extend(kept.map(|(key, _)| location(resource, key)));
        }
        found
    }

    /// The object with this uid, where it is stored.
    pub fn by_uid(&self, uid: &str) -> Option<(Location, Arc<Value>)> {
        let inner = self.lock();
        let location = inner.indexes.locate(uid)?;
        let object = Self::at(&inner, location)?;
        Some((location.clone(), object))
    }

    /// Whether an object with this uid is stored.
    pub fn has_uid(&self, uid: &str) -> bool {
        self.lock().indexes.locate(uid).is_some()
    }

    /// The objects whose owner references name `owner_uid` (whether or not that owner exists), of
    /// one resource or of all when `resource` is `None`, ordered by resource, namespace and name.
    pub fn dependents(&self, owner_uid: &str, resource: Option<&GroupResource>) -> Vec<(Location, Arc<Value>)> {
        let inner = self.lock();
        inner
            .indexes
            .dependents(owner_uid)
            .filter(|location| resource.is_none_or(|wanted| *wanted == location.resource))
            .filter_map(|location| Some((location.clone(), Self::at(&inner, location)?)))
            .collect()
    }

    fn at(inner: &Inner, location: &Location) -> Option<Arc<Value>> {
        let key = (location.namespace.clone(), location.name.clone());
        inner.objects.get(&location.resource)?.get(&key).cloned()
    }

    /// Atomically read the current object and decide what to write. Returns the resulting object
    /// (for `Remove`, the removed object) and whether anything changed.
    pub fn write<F>(
        &self,
        resource: &GroupResource,
        namespace: &str,
        name: &str,
        decide: F,
    ) -> Result<(Arc<Value>, bool), ApiError>
    where
        F: FnOnce(Option<&Value>) -> Result<Write, ApiError>,
    {
        self.transact(resource, namespace, name, true, decide)
    }

    /// Like [`Store::write`], but nothing is stored: what a dry-run request answers.
    pub fn preview<F>(
        &self,
        resource: &GroupResource,
        namespace: &str,
        name: &str,
        decide: F,
    ) -> Result<(Arc<Value>, bool), ApiError>
    where
        F: FnOnce(Option<&Value>) -> Result<Write, ApiError>,
    {
        self.transact(resource, namespace, name, false, decide)
    }

    fn transact<F>(
        &self,
        resource: &GroupResource,
        namespace: &str,
        name: &str,
        commit: bool,
        decide: F,
    ) -> Result<(Arc<Value>, bool), ApiError>
    where
        F: FnOnce(Option<&Value>) -> Result<Write, ApiError>,
    {
        let mut inner = self.lock();
        let key = (namespace.to_string(), name.to_string());
        let current = inner.objects.get(resource).and_then(|m| m.get(&key)).cloned();
        match decide(current.as_deref())? {
            Write::Keep => Ok((current.unwrap_or_else(|| Arc::new(Value::Null)), false)),
            Write::Put(obj) if !commit => Ok((Arc::new(obj), true)),
            Write::Put(obj) => Ok((self.put(&mut inner, resource, key, obj, current), true)),
            Write::Remove(_) if current.is_none() => {
                Err(ApiError::not_found(&resource.group, &resource.resource, name))
            }
            Write::Remove(obj) if !commit => Ok((Arc::new(obj), true)),
            Write::Remove(obj) => Ok((self.remove(&mut inner, resource, key, obj, current), true)),
        }
    }

    /// Stores `obj` at the next resourceVersion in place of `current`, and announces it.
    fn put(
        &self,
        inner: &mut Inner,
        resource: &GroupResource,
        key: ObjectKey,
        mut obj: Value,
        current: Option<Arc<Value>>,
    ) -> Arc<Value> {
        inner.resource_version += 1;
        obj["metadata"]["resourceVersion"] = Value::String(inner.resource_version.to_string());
        let obj = Arc::new(obj);
        inner
            .indexes
            .replace(&location(resource, &key), current.as_deref(), Some(&obj));
        let objects = inner.objects.entry(resource.clone()).or_default();
        objects.insert(key, obj.clone());
        let event_type = if current.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.publish(inner, event_type, resource, obj.clone(), current);
        obj
    }

    /// Removes the object at `key` (`current`), announcing `last` as its final state.
    fn remove(
        &self,
        inner: &mut Inner,
        resource: &GroupResource,
        key: ObjectKey,
        mut last: Value,
        current: Option<Arc<Value>>,
    ) -> Arc<Value> {
        // Stamped before any map changes: the maps, the counter and the event change together.
        inner.resource_version += 1;
        last["metadata"]["resourceVersion"] = Value::String(inner.resource_version.to_string());
        let last = Arc::new(last);
        inner
            .indexes
            .replace(&location(resource, &key), current.as_deref(), None);
        inner.objects.entry(resource.clone()).or_default().remove(&key);
        self.publish(inner, EventType::Deleted, resource, last.clone(), None);
        last
    }

    fn publish(
        &self,
        inner: &mut Inner,
        event_type: EventType,
        resource: &GroupResource,
        object: Arc<Value>,
        previous: Option<Arc<Value>>,
    ) {
        let event = Arc::new(StoreEvent {
            event_type,
            resource: resource.clone(),
            resource_version: inner.resource_version,
            object,
            previous,
        });
        inner.last_change.insert(resource.clone(), inner.resource_version);
        inner.history.push_back(event.clone());
        while inner.history.len() > HISTORY_WINDOW {
            if let Some(old) = inner.history.pop_front() {
                inner.history_floor = old.resource_version;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = self.events.send(event);
    }

    /// Forgets every object, log and event, and starts the resourceVersion counter over — what a
    /// server whose storage was lost looks like (see [`Store::subscribe_since`]).
    pub fn reset(&self) {
        let mut inner = self.lock();
        inner.resource_version = 1;
        inner.objects.clear();
        inner.indexes.clear();
        inner.history.clear();
        inner.history_floor = 0;
        inner.last_change.clear();
        inner.pod_logs.clear();
        drop(inner);
        self.resets.send_modify(|count| *count += 1);
    }

    /// Changes on every [`Store::reset`]: what in-process loops must look at everything again on.
    pub fn resets(&self) -> tokio::sync::watch::Receiver<u64> {
        self.resets.subscribe()
    }

    /// Forgets the watch history but keeps the objects: watches resuming from any version older
    /// than the current one get 410 Expired and must relist (kube-apiserver after a restart).
    pub fn forget_history(&self) {
        let mut inner = self.lock();
        inner.history.clear();
        inner.history_floor = inner.resource_version;
    }

    /// Subscribe to changes after `since`. `Err` carries the oldest resumable version when `since`
    /// has fallen out of the history window, or lies ahead of the counter (a version from before
    /// [`Store::reset`]).
    pub fn subscribe_since(&self, since: u64) -> Result<Subscription, u64> {
        let inner = self.lock();
        if since < inner.history_floor || since > inner.resource_version {
            return Err(inner.history_floor);
        }
        let backlog = inner
            .history
            .iter()
            .filter(|e| e.resource_version > since)
            .cloned()
            .collect();
        Ok(Subscription {
            backlog,
            snapshot: Vec::new(),
            live: self.events.subscribe(),
            resource_version: inner.resource_version,
        })
    }

    /// Subscribe with a snapshot of the current objects (watch without a resourceVersion).
    pub fn subscribe_with_snapshot(&self, resource: &GroupResource, namespace: Option<&str>) -> Subscription {
        let inner = self.lock();
        Subscription {
            backlog: Vec::new(),
            snapshot: Self::select(&inner, resource, namespace),
            live: self.events.subscribe(),
            resource_version: inner.resource_version,
        }
    }

    /// Live events only, for in-process controllers.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<StoreEvent>> {
        self.events.subscribe()
    }

    pub fn set_pod_log(&self, namespace: &str, pod: &str, container: &str, text: &str) {
        let key = (namespace.to_string(), pod.to_string(), container.to_string());
        self.lock().pod_logs.insert(key, text.to_string());
    }

    pub fn pod_log(&self, namespace: &str, pod: &str, container: &str) -> Option<String> {
        let key = (namespace.to_string(), pod.to_string(), container.to_string());
        self.lock().pod_logs.get(&key).cloned()
    }
}

fn location(resource: &GroupResource, (namespace, name): &ObjectKey) -> Location {
    Location {
        resource: resource.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
    }
}

/// The entries of one namespace, found by range rather than by scanning every namespace.
fn in_namespace<'a>(map: &'a Objects, namespace: &'a str) -> impl Iterator<Item = (&'a ObjectKey, &'a Arc<Value>)> {
    let start = (namespace.to_string(), String::new());
    map.range((Bound::Included(start), Bound::Unbounded))
        .take_while(move |((ns, _), _)| ns == namespace)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unchanged_write_keeps_the_resource_version() {
        let store = Store::new();
        let cm = GroupResource::new("", "configmaps");
        let (created, _) = store
            .write(&cm, "ns", "a", |_| Ok(Write::Put(json!({"metadata": {"name": "a"}}))))
            .unwrap();
        let before = store.resource_version();
        let (_, changed) = store.write(&cm, "ns", "a", |_| Ok(Write::Keep)).unwrap();
        assert!(!changed);
        assert_eq!(store.resource_version(), before);
        assert_eq!(created["metadata"]["resourceVersion"], json!(before.to_string()));
    }

    #[test]
    fn resuming_from_before_the_window_is_refused() {
        let store = Store::new();
        let cm = GroupResource::new("", "configmaps");
        for i in 0..HISTORY_WINDOW + 5 {
            let name = format!("c{i}");
            store
                .write(&cm, "ns", &name, |_| Ok(Write::Put(json!({"metadata": {}}))))
                .unwrap();
        }
        assert!(store.subscribe_since(1).is_err());
        assert!(store.subscribe_since(store.resource_version() - 10).is_ok());
    }

    #[test]
    fn a_forgotten_history_expires_every_older_version_but_keeps_the_objects() {
        let store = Store::new();
        let cm = GroupResource::new("", "configmaps");
        for name in ["a", "b"] {
            store
                .write(&cm, "ns", name, |_| Ok(Write::Put(json!({"metadata": {}}))))
                .unwrap();
        }
        let now = store.resource_version();
        store.forget_history();
        assert!(store.subscribe_since(now - 1).is_err());
        assert!(store.subscribe_since(now).is_ok());
        assert_eq!(store.subscribe_with_snapshot(&cm, None).snapshot.len(), 2);
    }
}
