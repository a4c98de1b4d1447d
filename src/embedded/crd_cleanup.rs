//! The cleanup controller of deleted CustomResourceDefinitions, as kube-apiserver's: a terminating
//! CRD's objects are deleted (waiting for their finalizers), then its cleanup finalizer goes.

use super::crd::{CLEANUP_FINALIZER, crd_resource, is_crd};
use super::discovery::{Resources, crd_resources};
use super::object_meta::meta_str;
use super::store::Store;
use super::validation::finalizers;
use super::verbs::{self, DeleteOptions};

/// One pass of the cleanup controller: terminating CRDs have their objects deleted, then lose the
/// cleanup finalizer once none is left.
pub fn finish_terminating_crds(store: &Store, resources: &Resources) {
    let Some(crd_info) = resources.all.iter().find(|r| is_crd(r)) else {
        return;
    };
    for crd in store.list(&crd_resource(), None).0 {
        let held = finalizers(&crd).iter().any(|f| f == CLEANUP_FINALIZER);
        if !crd["metadata"]["deletionTimestamp"].is_string() || !held {
            continue;
        }
        let Some(info) = crd_resources(&crd).into_iter().next() else {
            continue;
        };
        let objects = store.list(&info.storage_key(), None).0;
        if objects.is_empty() {
            let name = meta_str(&crd, "name").unwrap_or("");
            let _ = verbs::remove_finalizer(store, crd_info, "", name, CLEANUP_FINALIZER);
            continue;
        }
        let background = DeleteOptions {
            propagation_policy: Some("Background".into()),
            ..Default::default()
        };
        for object in objects
            .iter()
            .filter(|o| !o["metadata"]["deletionTimestamp"].is_string())
        {
            let ns = meta_str(object, "namespace").unwrap_or("");
            let name = meta_str(object, "name").unwrap_or("");
            // Gone meanwhile or held by finalizers: the next pass looks again.
            let _ = verbs::delete(store, &info, ns, name, &background);
        }
    }
}
