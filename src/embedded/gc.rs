//! The garbage collector's loop: owner references across one server's objects.
//!
//! - an object whose owners are all gone is deleted (background propagation);
//! - an owner deleting with the `orphan` finalizer has its dependents' references to it removed, then
//!   the finalizer;
//! - an owner deleting with `foregroundDeletion` has its dependents deleted (in the foreground too,
//!   as kube-controller-manager does), and loses the finalizer once no dependent whose reference has
//!   `blockOwnerDeletion: true` is left.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use super::discovery::{ResourceInfo, Resources};
use super::store::{GroupResource, Store, Write};
use super::validation::finalizers;
use super::verbs::{self, DeleteOptions, FOREGROUND_FINALIZER, ORPHAN_FINALIZER};

/// One stored object, located, with its ownership metadata (`Store::all_ownership`).
struct Located {
    resource: GroupResource,
    namespace: String,
    name: String,
    object: Value,
}

impl Located {
    fn new(resource: GroupResource, object: Value) -> Located {
        let text = |field: &str| object["metadata"][field].as_str().unwrap_or("").to_string();
        Located {
            resource,
            namespace: text("namespace"),
            name: text("name"),
            object,
        }
    }

    fn owner_uids(&self) -> Vec<String> {
        self.object["metadata"]["ownerReferences"]
            .as_array()
            .map(|refs| {
                refs.iter()
                    .filter_map(|r| r["uid"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether this object's reference to `owner_uid` blocks the owner's foreground deletion.
    fn blocks(&self, owner_uid: &str) -> bool {
        self.object["metadata"]["ownerReferences"]
            .as_array()
            .is_some_and(|refs| {
                refs.iter()
                    .any(|r| r["uid"].as_str() == Some(owner_uid) && r["blockOwnerDeletion"] == json!(true))
            })
    }

    fn uid(&self) -> &str {
        self.object["metadata"]["uid"].as_str().unwrap_or("")
    }

    fn is_deleting(&self) -> bool {
        self.object["metadata"]["deletionTimestamp"].is_string()
    }
}

/// One pass over all objects. Errors (an object changed or vanished meanwhile) are settled by the
/// next pass, which the resulting events trigger.
pub fn collect(store: &Store, resources: &Resources) {
    let objects: Vec<Located> = store
        .all_ownership()
        .into_iter()
        .map(|(r, o)| Located::new(r, o))
        .collect();
    let existing: HashSet<&str> = objects.iter().map(Located::uid).collect();
    let mut dependents: HashMap<&str, Vec<&Located>> = HashMap::new();
    for object in &objects {
        for owner in object.owner_uids() {
            if let Some(owner) = existing.get(owner.as_str()) {
                dependents.entry(owner).or_default().push(object);
            }
        }
    }
    let gc = Collector { store, resources };
    for object in &objects {
        let owners = object.owner_uids();
        let orphaned = !owners.is_empty() && owners.iter().all(|uid| !existing.contains(uid.as_str()));
        if orphaned && !object.is_deleting() {
            gc.delete(object, "Background");
            continue;
        }
        if !object.is_deleting() {
            continue;
        }
        let mine = dependents.get(object.uid()).map(Vec::as_slice).unwrap_or_default();
        let held_by = finalizers(&object.object);
        if held_by.iter().any(|f| f == ORPHAN_FINALIZER) {
            mine.iter().for_each(|d| drop_owner_reference(store, d, object.uid()));
            gc.remove_finalizer(object, ORPHAN_FINALIZER);
        } else if held_by.iter().any(|f| f == FOREGROUND_FINALIZER) {
            // Dependents go in the foreground too; the owner waits only for those that block it.
            mine.iter()
                .filter(|d| !d.is_deleting())
                .for_each(|d| gc.delete(d, "Foreground"));
            if !mine.iter().any(|d| d.blocks(object.uid())) {
                gc.remove_finalizer(object, FOREGROUND_FINALIZER);
            }
        }
    }
}

/// Writes through the verbs, so finalizers and events behave as for any client.
struct Collector<'a> {
    store: &'a Store,
    resources: &'a Resources,
}

impl Collector<'_> {
    fn info(&self, object: &Located) -> Option<&ResourceInfo> {
        self.resources.all.iter().find(|r| r.storage_key() == object.resource)
    }

    fn delete(&self, object: &Located, propagation: &str) {
        let Some(info) = self.info(object) else {
            return;
        };
        let options = DeleteOptions {
            propagation_policy: Some(propagation.into()),
            ..Default::default()
        };
        // Gone meanwhile or held by finalizers: the next pass sees it.
        let _ = verbs::delete(self.store, info, &object.namespace, &object.name, &options);
    }

    fn remove_finalizer(&self, object: &Located, finalizer: &str) {
        let Some(info) = self.info(object) else {
            return;
        };
        let _ = verbs::remove_finalizer(self.store, info, &object.namespace, &object.name, finalizer);
    }
}

fn drop_owner_reference(store: &Store, dependent: &Located, owner_uid: &str) {
    let _ = store.write(&dependent.resource, &dependent.namespace, &dependent.name, |current| {
        let Some(current) = current else {
            return Ok(Write::Unchanged(Value::Null));
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
            Write::Unchanged(updated)
        } else {
            Write::Put(updated)
        })
    });
}
