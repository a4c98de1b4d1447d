//! Request counters per verb, resource and namespace, for tests that assert how many requests a
//! controller made. A watch counts once, when it is opened.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::verb::Verb;

impl Verb {
    /// The Kubernetes verb name (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection`).
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
        }
    }
}

/// One counted key: the verb, the resource as `plural` or `plural.group` (a subresource as
/// `plural/sub`), and the namespace ("" for cluster-wide and cluster-scoped requests).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestKey {
    pub verb: Verb,
    pub resource: String,
    pub namespace: String,
}

/// A snapshot of the counters; take one before and one after, and diff them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub counts: BTreeMap<RequestKey, u64>,
}

impl PartialOrd for Verb {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Verb {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for Verb {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl RequestCounts {
    /// Requests with this verb to this resource (`plural` or `plural.group`, also matched by the
    /// plural alone) in this namespace (`None`: any namespace).
    pub fn get(&self, verb: Verb, resource: &str, namespace: Option<&str>) -> u64 {
        self.counts
            .iter()
            .filter(|(key, _)| key.verb == verb)
            .filter(|(key, _)| key.resource == resource || key.resource.split('.').next() == Some(resource))
            .filter(|(key, _)| namespace.is_none_or(|ns| key.namespace == ns))
            .map(|(_, count)| count)
            .sum()
    }

    /// Requests of any verb to any resource in `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> u64 {
        self.counts
            .iter()
            .filter(|(key, _)| key.namespace == namespace)
            .map(|(_, count)| count)
            .sum()
    }

    /// All requests counted.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// What happened between `earlier` and this snapshot (keys with no new requests left out).
    pub fn since(&self, earlier: &RequestCounts) -> RequestCounts {
        let counts = self
            .counts
            .iter()
            .filter_map(|(key, count)| {
                let before = earlier.counts.get(key).copied().unwrap_or(0);
                (count > &before).then(|| (key.clone(), count - before))
            })
            .collect();
        RequestCounts { counts }
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    counts: Mutex<BTreeMap<RequestKey, u64>>,
}

impl Counters {
    pub(crate) fn record(&self, key: RequestKey) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        *counts.entry(key).or_default() += 1;
    }

    pub(crate) fn snapshot(&self) -> RequestCounts {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner()).clone();
        RequestCounts { counts }
    }
}
