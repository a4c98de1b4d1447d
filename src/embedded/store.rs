//! In-memory object storage: one map per group/resource, one global resourceVersion counter, and the
//! bounded event history that watches resume from.
//!
//! Every write goes through [`Store::write`], whose closure sees the current object under the store
//! lock, so read-modify-write verbs (update, patch, delete with preconditions) are atomic. In-process
//! controllers use the same API as the HTTP layer.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use tokio::sync::broadcast;

use super::status::ApiError;

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
    pub object: Value,
    /// The previous state for MODIFIED, so filtered watches can tell entering from leaving.
    pub previous: Option<Value>,
}

/// What a write closure decided.
pub enum Write {
    /// Store this object (the store stamps `metadata.resourceVersion`).
    Put(Value),
    /// Remove the object; the value is its final state, reported in the DELETED event.
    Remove(Value),
    /// Nothing changes; return this object as the result.
    Unchanged(Value),
}

struct Inner {
    resource_version: u64,
    objects: HashMap<GroupResource, BTreeMap<ObjectKey, Value>>,
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
}

/// A watch subscription: the history to replay, then the live channel.
pub struct Subscription {
    pub backlog: Vec<Arc<StoreEvent>>,
    pub snapshot: Vec<Value>,
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
                history: VecDeque::new(),
                history_floor: 0,
                last_change: HashMap::new(),
                pod_logs: HashMap::new(),
            }),
            events,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a map half-written (all writes are single
        // inserts), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().resource_version
    }

    /// The resourceVersion of the latest write to `resource` (0: never written).
    pub fn last_change(&self, resource: &GroupResource) -> u64 {
        self.lock().last_change.get(resource).copied().unwrap_or(0)
    }

    pub fn get(&self, resource: &GroupResource, namespace: &str, name: &str) -> Option<Value> {
        let inner = self.lock();
        inner
            .objects
            .get(resource)?
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Objects of a resource (in one namespace, or all when `None`), ordered by namespace and name,
    /// with the resourceVersion the list is consistent at.
    pub fn list(&self, resource: &GroupResource, namespace: Option<&str>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        (Self::select(&inner, resource, namespace), inner.resource_version)
    }

    fn select(inner: &Inner, resource: &GroupResource, namespace: Option<&str>) -> Vec<Value> {
        let Some(map) = inner.objects.get(resource) else {
            return Vec::new();
        };
        map.iter()
            .filter(|((ns, _), _)| namespace.is_none_or(|want| want == ns))
            .map(|(_, obj)| obj.clone())
            .collect()
    }

    /// `project` of every object of `resource`, ordered by namespace and name, read in place.
    pub fn project<T>(&self, resource: &GroupResource, project: impl Fn(&Value) -> T) -> Vec<T> {
        let inner = self.lock();
        inner
            .objects
            .get(resource)
            .map(|map| map.values().map(project).collect())
            .unwrap_or_default()
    }

    /// Whether no object of any resource is left in `namespace`.
    pub fn namespace_is_empty(&self, namespace: &str) -> bool {
        let inner = self.lock();
        inner
            .objects
            .values()
            .all(|map| map.keys().all(|(ns, _)| ns != namespace))
    }

    /// Every object's identity and ownership metadata (name, namespace, uid, owner references,
    /// finalizers, deletion timestamp), as `{"metadata": …}`: what the garbage collector judges
    /// by, without copying every object whole on each of its passes.
    pub fn all_ownership(&self) -> Vec<(GroupResource, Value)> {
        const KEPT: [&str; 6] = [
            "name",
            "namespace",
            "uid",
            "ownerReferences",
            "finalizers",
            "deletionTimestamp",
        ];
        let inner = self.lock();
        let mut all = Vec::new();
        for (resource, map) in &inner.objects {
            all.extend(map.values().map(|object| {
                let metadata: serde_json::Map<String, Value> = KEPT
                    .iter()
                    .filter_map(|field| Some((field.to_string(), object["metadata"].get(*field)?.clone())))
                    .collect();
                (resource.clone(), serde_json::json!({ "metadata": metadata }))
            }));
        }
        all
    }

    /// All resources with objects in a namespace (for namespace deletion).
    pub fn resources_in_namespace(&self, namespace: &str) -> Vec<(GroupResource, String)> {
        let inner = self.lock();
        let mut found = Vec::new();
        for (resource, map) in &inner.objects {
            for (ns, name) in map.keys() {
                if ns == namespace {
                    found.push((resource.clone(), name.clone()));
                }
            }
        }
        found
    }

    /// Atomically read the current object and decide what to write. Returns the resulting object
    /// (for `Remove`, the removed object) and whether anything changed.
    pub fn write<F>(
        &self,
        resource: &GroupResource,
        namespace: &str,
        name: &str,
        decide: F,
    ) -> Result<(Value, bool), ApiError>
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
    ) -> Result<(Value, bool), ApiError>
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
    ) -> Result<(Value, bool), ApiError>
    where
        F: FnOnce(Option<&Value>) -> Result<Write, ApiError>,
    {
        let mut inner = self.lock();
        let key = (namespace.to_string(), name.to_string());
        let current = inner.objects.get(resource).and_then(|m| m.get(&key)).cloned();
        match decide(current.as_ref())? {
            Write::Unchanged(obj) => Ok((obj, false)),
            Write::Put(obj) if !commit => Ok((obj, true)),
            Write::Put(mut obj) => {
                inner.resource_version += 1;
                let rv = inner.resource_version;
                obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
                inner
                    .objects
                    .entry(resource.clone())
                    .or_default()
                    .insert(key, obj.clone());
                let event_type = if current.is_some() {
                    EventType::Modified
                } else {
                    EventType::Added
                };
                self.publish(&mut inner, event_type, resource, obj.clone(), current);
                Ok((obj, true))
            }
            Write::Remove(_) if current.is_none() => {
                Err(ApiError::not_found(&resource.group, &resource.resource, name))
            }
            Write::Remove(obj) if !commit => Ok((obj, true)),
            Write::Remove(mut obj) => {
                inner.objects.entry(resource.clone()).or_default().remove(&key);
                inner.resource_version += 1;
                let rv = inner.resource_version;
                obj["metadata"]["resourceVersion"] = Value::String(rv.to_string());
                self.publish(&mut inner, EventType::Deleted, resource, obj.clone(), None);
                Ok((obj, true))
            }
        }
    }

    fn publish(
        &self,
        inner: &mut Inner,
        event_type: EventType,
        resource: &GroupResource,
        object: Value,
        previous: Option<Value>,
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
        inner.history.clear();
        inner.history_floor = 0;
        inner.last_change.clear();
        inner.pod_logs.clear();
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
        let (_, changed) = store
            .write(&cm, "ns", "a", |cur| Ok(Write::Unchanged(cur.unwrap().clone())))
            .unwrap();
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
