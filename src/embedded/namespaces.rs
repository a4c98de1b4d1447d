//! The namespace controller's deletion loop: a terminating namespace has its contents deleted (objects
//! with finalizers wait for them), then its `kubernetes` finalizer cleared, which removes it.
//!
//! A pass looks at the namespaces named by events since the last one: a namespace being deleted,
//! and the namespace of any object removed or being deleted (its namespace may be waiting for it).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Value, json};

use super::discovery::{ResourceTable, Resources};
use super::passes::{Controller, settled};
use super::store::{EventType, GroupResource, Store, StoreEvent, Write};
use super::verb_options::DeleteOptions;
use super::verbs;

fn namespaces() -> GroupResource {
    GroupResource::new("", "namespaces")
}

fn is_deleting(object: &Value) -> bool {
    object["metadata"]["deletionTimestamp"].is_string()
}

pub(crate) struct NamespaceController {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
}

impl NamespaceController {
    pub(crate) fn new(store: Arc<Store>, resources: Arc<ResourceTable>) -> NamespaceController {
        NamespaceController { store, resources }
    }
}

impl Controller for NamespaceController {
    /// A namespace's name.
    type Key = String;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<String>) {
        let metadata = &event.object["metadata"];
        if event.event_type != EventType::Deleted && !is_deleting(&event.object) {
            return;
        }
        let namespace = if event.resource == namespaces() {
            metadata["name"].as_str()
        } else {
            metadata["namespace"].as_str()
        };
        if let Some(namespace) = namespace.filter(|ns| !ns.is_empty()) {
            pending.insert(namespace.to_string());
        }
    }

    fn all_keys(&self) -> BTreeSet<String> {
        let names = self
            .store
            .project(&namespaces(), |ns| ns["metadata"]["name"].as_str().map(String::from));
        names.into_iter().flatten().collect()
    }

    fn pass(&mut self, keys: BTreeSet<String>) -> BTreeSet<String> {
        let resources = self.resources.current();
        keys.into_iter()
            .filter(|namespace| !finish_terminating_namespace(&self.store, &resources, namespace))
            .collect()
    }
}

/// Deletes a terminating namespace's contents, or finalizes it once they are gone; false when a
/// write failed (other than on an object gone meanwhile), for the loop to look again.
pub fn finish_terminating_namespace(store: &Store, resources: &Resources, namespace: &str) -> bool {
    let terminating = store
        .get_shared(&namespaces(), "", namespace)
        .is_some_and(|ns| is_deleting(&ns));
    if !terminating {
        return true;
    }
    if store.namespace_is_empty(namespace) {
        finalize(store, namespace)
    } else {
        delete_contents(store, resources, namespace)
    }
}

fn delete_contents(store: &Store, resources: &Resources, namespace: &str) -> bool {
    let mut all_settled = true;
    for (resource, name) in store.resources_in_namespace(namespace) {
        let info = resources.all.iter().find(|r| r.storage_key() == resource);
        let Some(info) = info else {
            // Objects of a resource nobody serves any more (CRD gone): drop them directly.
            let dropped = store.write(&resource, namespace, &name, |cur| {
                Ok(Write::Remove(cur.cloned().unwrap_or_default()))
            });
            all_settled &= settled(dropped);
            continue;
        };
        // Held by finalizers: their removal's events bring the namespace back.
        let background = DeleteOptions {
            propagation_policy: Some("Background".into()),
            ..Default::default()
        };
        all_settled &= settled(verbs::delete(store, info, namespace, &name, &background));
    }
    all_settled
}

/// Clears `spec.finalizers`; with no `metadata.finalizers` left the namespace is removed.
fn finalize(store: &Store, namespace: &str) -> bool {
    let written = store.write(&namespaces(), "", namespace, |current| {
        let Some(current) = current else {
            return Ok(Write::Keep);
        };
        let mut done = current.clone();
        done["spec"]["finalizers"] = json!([]);
        let held = done["metadata"]["finalizers"].as_array().is_some_and(|f| !f.is_empty());
        Ok(match held {
            false => Write::Remove(done),
            true if done == *current => Write::Keep,
            true => Write::Put(done),
        })
    });
    settled(written)
}
