//! Reflector stores: asking whether one is filled without awaiting it.

use kube::Resource;
use kube::runtime::reflector::Store;

/// True once a store completed its first list. Polling the store's ready future replaces the waker
/// of anyone else awaiting it (see [`super::readiness`]), so ask this only of stores nobody awaits,
/// or when that no longer matters (at shutdown).
pub fn is_filled<K: Resource + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}
