//! The cleanup controller of deleted CustomResourceDefinitions, as kube-apiserver's: a terminating
//! CRD's objects are deleted (waiting for their finalizers), then its cleanup finalizer goes.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::crd::{CLEANUP_FINALIZER, is_crd};
use super::discovery::{ResourceTable, Resources, crd_resource, crd_resources};
use super::object_meta::meta_str;
use super::passes::{Controller, settled};
use super::store::{EventType, Store, StoreEvent};
use super::validation::finalizers;
use super::verb_options::DeleteOptions;
use super::verbs;

/// The cleanup controller: a pass looks at the CRDs named by events since the last one (a CRD
/// being deleted, or one whose custom resource was removed or is being deleted).
pub(crate) struct CleanupController {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
}

impl CleanupController {
    pub(crate) fn new(store: Arc<Store>, resources: Arc<ResourceTable>) -> CleanupController {
        CleanupController { store, resources }
    }
}

impl Controller for CleanupController {
    /// A CRD's name (`<plural>.<group>`).
    type Key = String;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<String>) {
        let deleting = event.object["metadata"]["deletionTimestamp"].is_string();
        if event.event_type != EventType::Deleted && !deleting {
            return;
        }
        if event.resource == crd_resource() {
            pending.extend(meta_str(&event.object, "name").map(String::from));
        } else if !event.resource.group.is_empty() {
            pending.insert(format!("{}.{}", event.resource.resource, event.resource.group));
        }
    }

    fn all_keys(&self) -> BTreeSet<String> {
        let names = self
            .store
            .project(&crd_resource(), |crd| meta_str(crd, "name").map(String::from));
        names.into_iter().flatten().collect()
    }

    fn pass(&mut self, keys: BTreeSet<String>) -> BTreeSet<String> {
        let resources = self.resources.current();
        keys.into_iter()
            .filter(|name| !finish_terminating_crd(&self.store, &resources, name))
            .collect()
    }
}

/// A terminating CRD has its objects deleted, then loses the cleanup finalizer once none is left;
/// false when a write failed (other than on an object gone meanwhile), for the loop to look again.
pub(super) fn finish_terminating_crd(store: &Store, resources: &Resources, name: &str) -> bool {
    let Some(crd_info) = resources.all.iter().find(|r| is_crd(r)) else {
        return true;
    };
    let Some(crd) = store.get_shared(&crd_resource(), "", name) else {
        return true;
    };
    let held = finalizers(&crd).iter().any(|f| f == CLEANUP_FINALIZER);
    if !crd["metadata"]["deletionTimestamp"].is_string() || !held {
        return true;
    }
    let Some(info) = crd_resources(&crd).into_iter().next() else {
        return true;
    };
    let objects = store.list_shared(&info.storage_key(), None).0;
    if objects.is_empty() {
        return settled(verbs::remove_finalizer(store, crd_info, "", name, CLEANUP_FINALIZER));
    }
    let background = DeleteOptions {
        propagation_policy: Some("Background".into()),
        ..Default::default()
    };
    let mut all_settled = true;
    for object in objects
        .iter()
        .filter(|o| !o["metadata"]["deletionTimestamp"].is_string())
    {
        let ns = meta_str(object, "namespace").unwrap_or("");
        let name = meta_str(object, "name").unwrap_or("");
        // Held by finalizers: their removal's events bring the CRD back.
        all_settled &= settled(verbs::delete(store, &info, ns, name, &background));
    }
    all_settled
}
