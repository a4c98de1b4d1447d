//! The namespace controller's deletion loop: a terminating namespace has its contents deleted (objects
//! with finalizers wait for them), then its `kubernetes` finalizer cleared, which removes it.

use serde_json::{Value, json};

use super::discovery::Resources;
use super::store::{GroupResource, Store, Write};
use super::verbs::{self, DeleteOptions};

fn terminating(store: &Store) -> Vec<String> {
    let namespaces = GroupResource::new("", "namespaces");
    store
        .list(&namespaces, None)
        .0
        .iter()
        .filter(|ns| ns["metadata"]["deletionTimestamp"].is_string())
        .filter_map(|ns| ns["metadata"]["name"].as_str().map(String::from))
        .collect()
}

pub fn finish_terminating_namespaces(store: &Store, resources: &Resources) {
    for namespace in terminating(store) {
        if store.namespace_is_empty(&namespace) {
            finalize(store, &namespace);
        } else {
            delete_contents(store, resources, &namespace);
        }
    }
}

fn delete_contents(store: &Store, resources: &Resources, namespace: &str) {
    for (resource, name) in store.resources_in_namespace(namespace) {
        let info = resources.all.iter().find(|r| r.storage_key() == resource);
        let Some(info) = info else {
            // Objects of a resource nobody serves any more (CRD gone): drop them directly.
            let _ = store.write(&resource, namespace, &name, |cur| {
                Ok(Write::Remove(cur.cloned().unwrap_or_default()))
            });
            continue;
        };
        // Gone already or held by finalizers: both settle on a later pass.
        let background = DeleteOptions {
            propagation_policy: Some("Background".into()),
            ..Default::default()
        };
        let _ = verbs::delete(store, info, namespace, &name, &background);
    }
}

/// Clears `spec.finalizers`; with no `metadata.finalizers` left the namespace is removed.
fn finalize(store: &Store, namespace: &str) {
    let resource = GroupResource::new("", "namespaces");
    let _ = store.write(&resource, "", namespace, |current| {
        let Some(current) = current else {
            return Ok(Write::Unchanged(Value::Null));
        };
        let mut done = current.clone();
        done["spec"]["finalizers"] = json!([]);
        let held = done["metadata"]["finalizers"].as_array().is_some_and(|f| !f.is_empty());
        Ok(match held {
            false => Write::Remove(done),
            true if done == *current => Write::Unchanged(done),
            true => Write::Put(done),
        })
    });
}
