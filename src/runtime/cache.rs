//! Reflector-backed caches: what every controller reads from instead of GETs, and the events that
//! trigger its reconciles.

use std::fmt::Debug;

use crate::runtime::recovery::WatchBackoff;
use futures::{Stream, StreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

/// A reflector over `api` and the stream of objects it saw change (deletions included): the store
/// is filled as the stream is polled, so give the stream to a controller.
pub fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
) -> (Store<K>, impl Stream<Item = Result<K, watcher::Error>> + Send + 'static)
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, config))
        .backoff(WatchBackoff::default())
        .touched_objects()
        .boxed();
    (store, stream)
}

/// [`reflect`] for every CRD of a server, cached slim (see [`crate::api::crds::slim`]).
pub fn reflect_crds(
    api: Api<CustomResourceDefinition>,
) -> (
    Store<CustomResourceDefinition>,
    impl Stream<Item = Result<CustomResourceDefinition, watcher::Error>> + Send + 'static,
) {
    let (store, writer) = reflector::store();
    let crds = watcher(api, watcher::Config::default()).modify(crate::api::crds::slim);
    let stream = reflector(writer, crds)
        .backoff(WatchBackoff::default())
        .touched_objects()
        .boxed();
    (store, stream)
}

/// True once a store completed its first list. Polling the store's ready future replaces the waker
/// of anyone else awaiting it (see [`super::readiness`]), so ask this only of stores nobody awaits,
/// or when that no longer matters (at shutdown).
pub fn is_filled<K: Resource + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}
