//! The garbage collector's loop: owner references across one server's objects.
//!
//! - an object whose owners are all gone is deleted (background propagation);
//! - an owner deleting with the `orphan` finalizer has its dependents' references to it removed, then
//!   the finalizer;
//! - an owner deleting with `foregroundDeletion` has its dependents deleted (in the foreground too,
//!   as kube-controller-manager does), and loses the finalizer once no dependent whose reference has
//!   `blockOwnerDeletion: true` is left.
//!
//! A pass judges only the objects events named since the last one, through the store's uid and
//! owner indexes: an object with owner references that changed (are its owners gone?), an object
//! being deleted (its finalizers), the dependents of an object removed (orphaned now?), and the
//! owners of a dependent that changed (a foreground deletion may be done).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Value, json};

use super::discovery::{ResourceInfo, ResourceTable, Resources};
use super::passes::{Controller, settled};
use super::store::{EventType, Location, Store, StoreEvent, Write, owner_uids};
use super::validation::finalizers;
use super::verb_options::DeleteOptions;
use super::verbs::{self, FOREGROUND_FINALIZER, ORPHAN_FINALIZER};

/// What a garbage-collection pass judges.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Key {
    Object(Location),
    /// The object with this uid, if it still exists.
    Uid(String),
    /// Every object naming this uid as an owner.
    DependentsOf(String),
}

pub(crate) struct GarbageCollector {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
}

impl GarbageCollector {
    pub(crate) fn new(store: Arc<Store>, resources: Arc<ResourceTable>) -> GarbageCollector {
        GarbageCollector { store, resources }
    }

    /// The objects the keys stand for, each once.
    fn locate(&self, keys: BTreeSet<Key>) -> BTreeSet<Location> {
        let mut found = BTreeSet::new();
        for key in keys {
            match key {
                Key::Object(location) => {
                    found.insert(location);
                }
                Key::Uid(uid) => found.extend(self.store.by_uid(&uid).map(|(location, _)| location)),
                Key::DependentsOf(uid) => {
                    let dependents = self.store.dependents(&uid, None);
                    found.extend(dependents.into_iter().map(|(location, _)| location));
                }
            }
        }
        found
    }
}

fn is_deleting(object: &Value) -> bool {
    object["metadata"]["deletionTimestamp"].is_string()
}

fn has_owners(object: &Value) -> bool {
    object["metadata"].get("ownerReferences").is_some()
}

fn uid(object: &Value) -> &str {
    object["metadata"]["uid"].as_str().unwrap_or("")
}

fn location_of(event: &StoreEvent) -> Location {
    let text = |field: &str| event.object["metadata"][field].as_str().unwrap_or("").to_string();
    Location {
        resource: event.resource.clone(),
        namespace: text("namespace"),
        name: text("name"),
    }
}

impl Controller for GarbageCollector {
    type Key = Key;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<Key>) {
        let object = &event.object;
        if event.event_type == EventType::Deleted {
            pending.insert(Key::DependentsOf(uid(object).to_string()));
        } else if has_owners(object) || is_deleting(object) {
            pending.insert(Key::Object(location_of(event)));
        }
        let states = std::iter::once(object).chain(event.previous.as_ref());
        for owner in states.flat_map(|state| owner_uids(state)) {
            pending.insert(Key::Uid(owner.to_string()));
        }
    }

    fn all_keys(&self) -> BTreeSet<Key> {
        let judged = self
            .store
            .locations_where(|object| has_owners(object) || is_deleting(object));
        judged.into_iter().map(Key::Object).collect()
    }

    fn pass(&mut self, keys: BTreeSet<Key>) -> BTreeSet<Key> {
        let resources = self.resources.current();
        let gc = Collector {
            store: &self.store,
            resources: &resources,
        };
        let mut retries = BTreeSet::new();
        for location in self.locate(keys) {
            if !gc.judge(&location) {
                retries.insert(Key::Object(location));
            }
        }
        retries
    }
}

/// Writes through the verbs, so finalizers and events behave as for any client.
struct Collector<'a> {
    store: &'a Store,
    resources: &'a Resources,
}

impl Collector<'_> {
    /// Deletes the object if its owners are all gone, or works on its deletion's finalizers;
    /// false when a write failed (other than on an object gone meanwhile): the object is looked at
    /// again after the retry delay, though no event may name it.
    fn judge(&self, location: &Location) -> bool {
        let Some(object) = self
            .store
            .get_shared(&location.resource, &location.namespace, &location.name)
        else {
            return true;
        };
        let owners = owner_uids(&object);
        let orphaned = !owners.is_empty() && owners.iter().all(|uid| !self.store.has_uid(uid));
        if orphaned && !is_deleting(&object) {
            return self.delete(location, "Background");
        }
        if !is_deleting(&object) {
            return true;
        }
        let mine = self.store.dependents(uid(&object), None);
        let held_by = finalizers(&object);
        if held_by.iter().any(|f| f == ORPHAN_FINALIZER) {
            let dropped = mine
                .iter()
                .map(|(dependent, _)| drop_owner_reference(self.store, dependent, uid(&object)))
                .filter(|done| !done)
                .count()
                == 0;
            dropped && self.remove_finalizer(location, ORPHAN_FINALIZER)
        } else if held_by.iter().any(|f| f == FOREGROUND_FINALIZER) {
            // Dependents go in the foreground too; the owner waits only for those that block it.
            let deleted = mine
                .iter()
                .filter(|(_, dependent)| !is_deleting(dependent))
                .map(|(dependent, _)| self.delete(dependent, "Foreground"))
                .filter(|done| !done)
                .count()
                == 0;
            let unblocked = !mine.iter().any(|(_, dependent)| blocks(dependent, uid(&object)));
            deleted && (!unblocked || self.remove_finalizer(location, FOREGROUND_FINALIZER))
        } else {
            true
        }
    }

    fn info(&self, location: &Location) -> Option<&ResourceInfo> {
        self.resources.all.iter().find(|r| r.storage_key() == location.resource)
    }

    fn delete(&self, location: &Location, propagation: &str) -> bool {
        let Some(info) = self.info(location) else {
            return true;
        };
        let options = DeleteOptions {
            propagation_policy: Some(propagation.into()),
            ..Default::default()
        };
        // Held by finalizers: its events bring it back.
        settled(verbs::delete(
            self.store,
            info,
            &location.namespace,
            &location.name,
            &options,
        ))
    }

    fn remove_finalizer(&self, location: &Location, finalizer: &str) -> bool {
        let Some(info) = self.info(location) else {
            return true;
        };
        settled(verbs::remove_finalizer(
            self.store,
            info,
            &location.namespace,
            &location.name,
            finalizer,
        ))
    }
}

/// Whether this object's reference to `owner_uid` blocks the owner's foreground deletion.
fn blocks(object: &Value, owner_uid: &str) -> bool {
    object["metadata"]["ownerReferences"].as_array().is_some_and(|refs| {
        refs.iter()
            .any(|r| r["uid"].as_str() == Some(owner_uid) && r["blockOwnerDeletion"] == json!(true))
    })
}

fn drop_owner_reference(store: &Store, dependent: &Location, owner_uid: &str) -> bool {
    let written = store.write(&dependent.resource, &dependent.namespace, &dependent.name, |current| {
        let Some(current) = current else {
            return Ok(Write::Keep);
        };
        let mut updated = current.clone();
        let kept: Vec<Value> = current["metadata"]["ownerReferences"]
            .as_array()
            .map(|refs| {
                refs.iter()
                    .filter(|r| r["uid"].as_str() != Some(owner_uid))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if kept.is_empty() {
            if let Some(meta) = updated["metadata"].as_object_mut() {
                meta.remove("ownerReferences");
            }
        } else {
            updated["metadata"]["ownerReferences"] = json!(kept);
        }
        Ok(if updated == *current {
            Write::Keep
        } else {
            Write::Put(updated)
        })
    });
    settled(written)
}

#[cfg(test)]
mod tests;
