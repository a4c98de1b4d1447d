//! Objects a cache refused, because they are over the size cap or would take their namespace over
//! its share of the tenant's memory budget: never decoded nor cached, but remembered, so that no
//! controller takes one for gone. Absent from a cache usually means "does
//! not exist" (and so: create a replacement, release what it held, finish an uninstall); for a
//! refused object it means "cannot be read". So a refused object holds up the controllers reading
//! its kind in its namespace (`runtime::controller`) until it is made smaller or deleted; each
//! namespace (or every namespace) held up or released is signalled ([`Refusals::changes`]), so
//! that the objects there are told at once, and run again at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use crate::runtime::memory_budget::NamespaceOverage;

/// Why an object is not cached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Over `--max-cached-object-bytes`.
    TooLarge,
    /// Its namespace (or the tenant's namespaces together) would go over its memory share; it is
    /// read again when its namespace has `footprint` bytes of room.
    OverBudget { overage: NamespaceOverage, footprint: u64 },
}

/// One refused object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    /// Its size as compact JSON.
    pub json_bytes: u64,
    /// The tenant namespace whose work it holds up ("" for every namespace: a cluster-scoped
    /// object, or a host object whose tenant namespace cannot be told).
    pub holds: String,
    pub cause: Cause,
}

impl Refusal {
    /// `Kind namespace/name`, for messages.
    pub fn describe(&self) -> String {
        match &self.namespace {
            Some(namespace) => format!("{} {namespace}/{}", self.kind, self.name),
            None => format!("{} {}", self.kind, self.name),
        }
    }
}

type Key = (String, String);

fn key(namespace: Option<&str>, name: &str) -> Key {
    (namespace.unwrap_or_default().to_string(), name.to_string())
}

#[derive(Debug)]
struct Inner {
    by_object: BTreeMap<Key, Refusal>,
    /// How many refused objects hold up each tenant namespace.
    holding: BTreeMap<String, usize>,
    /// The objects a relist in progress refused again.
    relisted: Option<BTreeSet<Key>>,
    /// Counts the namespaces held up or released: bumped (under the lock) whenever the first
    /// refused object holding one up comes or the last goes.
    changes: watch::Sender<u64>,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            by_object: BTreeMap::new(),
            holding: BTreeMap::new(),
            relisted: None,
            changes: watch::Sender::new(0),
        }
    }
}

impl Inner {
    fn remove(&mut self, key: &Key) {
        if let Some(old) = self.by_object.remove(key)
            && let Some(count) = self.holding.get_mut(&old.holds)
        {
            *count -= 1;
            if *count == 0 {
                self.holding.remove(&old.holds);
                self.changes.send_modify(|changes| *changes += 1);
            }
        }
    }
}

/// The objects one cache refused; clones share them.
#[derive(Clone, Debug, Default)]
pub struct Refusals(Arc<RwLock<Inner>>);

impl Refusals {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes whenever a namespace is held up, or no longer held up, by objects of this cache.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.read().changes.subscribe()
    }

    /// Records a refused object; true when this is news (not the same version refused again, as
    /// a relist brings it), so that it is reported once.
    pub(crate) fn refuse(&self, refusal: Refusal) -> bool {
        let key = key(refusal.namespace.as_deref(), &refusal.name);
        let mut inner = self.write();
        if let Some(relisted) = &mut inner.relisted {
            relisted.insert(key.clone());
        }
        let known = inner.by_object.get(&key);
        let news =
            known.is_none_or(|known| known.uid != refusal.uid || known.resource_version != refusal.resource_version);
        // Counted before the old version is removed: refused again, it releases nothing.
        let holding = inner.holding.entry(refusal.holds.clone()).or_default();
        *holding += 1;
        if *holding == 1 {
            inner.changes.send_modify(|changes| *changes += 1);
        }
        inner.remove(&key);
        inner.by_object.insert(key, refusal);
        news
    }

    /// The object was read (it is small again) or deleted.
    pub(crate) fn forget(&self, namespace: Option<&str>, name: &str) {
        self.write().remove(&key(namespace, name));
    }

    pub(crate) fn start_relist(&self) {
        self.write().relisted = Some(BTreeSet::new());
    }

    /// Forgets the refused objects the relist no longer brought (deleted meanwhile).
    pub(crate) fn finish_relist(&self) {
        let mut inner = self.write();
        let Some(relisted) = inner.relisted.take() else {
            return;
        };
        let gone: Vec<Key> = inner
            .by_object
            .keys()
            .filter(|key| !relisted.contains(*key))
            .cloned()
            .collect();
        for key in gone {
            inner.remove(&key);
        }
    }

    /// Whether the object at `namespace/name` was refused.
    pub fn contains(&self, namespace: Option<&str>, name: &str) -> bool {
        self.read().by_object.contains_key(&key(namespace, name))
    }

    /// A refused object that holds up work in the tenant namespace `namespace`, if there is one.
    pub fn holding(&self, namespace: &str) -> Option<Refusal> {
        let inner = self.read();
        if inner.holding.is_empty() {
            return None;
        }
        let holds = |refusal: &&Refusal| refusal.holds == namespace || refusal.holds.is_empty();
        if !inner.holding.contains_key(namespace) && !inner.holding.contains_key("") {
            return None;
        }
        inner.by_object.values().find(holds).cloned()
    }

    /// The objects refused for their namespace's memory share.
    pub fn over_budget(&self) -> Vec<Refusal> {
        let inner = self.read();
        inner
            .by_object
            .values()
            .filter(|refusal| matches!(refusal.cause, Cause::OverBudget { .. }))
            .cloned()
            .collect()
    }

    /// How many objects are refused now.
    pub fn len(&self) -> usize {
        self.read().by_object.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(namespace: &str, name: &str, version: &str) -> Refusal {
        Refusal {
            kind: "ClusterDeploymentCustomization".into(),
            namespace: Some(namespace.into()),
            name: name.into(),
            uid: Some(format!("uid-{name}")),
            resource_version: Some(version.into()),
            json_bytes: 2 << 20,
            holds: namespace.into(),
            cause: Cause::TooLarge,
        }
    }

    #[test]
    fn a_refused_object_holds_up_its_namespace_only_until_it_is_forgotten() {
        let refusals = Refusals::default();
        assert!(refusals.refuse(refusal("team-a", "big", "1")));
        assert!(
            !refusals.refuse(refusal("team-a", "big", "1")),
            "the same version is no news"
        );
        assert!(refusals.refuse(refusal("team-a", "big", "2")), "a new version is");
        assert!(refusals.holding("team-a").is_some());
        assert!(refusals.holding("team-b").is_none());
        assert!(refusals.contains(Some("team-a"), "big"));
        refusals.forget(Some("team-a"), "big");
        assert!(refusals.holding("team-a").is_none());
        assert!(refusals.is_empty());
    }

    #[test]
    fn a_namespace_held_up_or_released_is_signalled_and_one_refused_again_is_not() {
        let refusals = Refusals::default();
        let mut released = refusals.changes();
        refusals.refuse(refusal("team-a", "big", "1"));
        assert!(released.has_changed().unwrap(), "held up");
        released.mark_unchanged();
        refusals.refuse(refusal("team-a", "other", "1"));
        refusals.refuse(refusal("team-a", "big", "2"));
        assert!(!released.has_changed().unwrap(), "still held up: nothing new");
        refusals.forget(Some("team-a"), "big");
        assert!(!released.has_changed().unwrap(), "`other` still holds team-a up");
        refusals.forget(Some("team-a"), "other");
        assert!(released.has_changed().unwrap());
    }

    #[test]
    fn a_relist_forgets_the_refused_objects_it_no_longer_brings() {
        let refusals = Refusals::default();
        refusals.refuse(refusal("team-a", "kept", "1"));
        refusals.refuse(refusal("team-a", "deleted", "1"));
        refusals.start_relist();
        assert!(!refusals.refuse(refusal("team-a", "kept", "1")));
        refusals.finish_relist();
        assert!(refusals.contains(Some("team-a"), "kept"));
        assert!(!refusals.contains(Some("team-a"), "deleted"));
    }

    #[test]
    fn an_object_of_no_known_namespace_holds_up_every_namespace() {
        let refusals = Refusals::default();
        refusals.refuse(Refusal {
            holds: String::new(),
            ..refusal("tenant-acme-controllers", "x", "1")
        });
        assert!(refusals.holding("anything").is_some());
    }
}
