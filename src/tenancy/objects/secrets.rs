//! The Secrets Tenant objects name, watched by their metadata only, one watch per namespace that is
//! both given to the daemon (`--tenant-secret-namespaces`) and named by a Tenant. Their data is read
//! with one GET when a Secret a Tenant names changes: the daemon keeps no Secret it did not create.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::Notify;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

use super::LIST_RETRY_MAX;
use crate::runtime::cause::diagnose;
use crate::runtime::reachability::Reachability;
use crate::runtime::recovery::{WatchBackoff, retry_watch};
use crate::runtime::retry::is_quiet_watch_failure;

/// A Secret's identity and version: a change of either means its data may have changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SecretVersion {
    pub uid: String,
    pub resource_version: String,
}

/// What is known of one namespace's Secrets.
#[derive(Clone, Debug, Default)]
pub(super) enum Listing {
    /// The first list has not completed.
    #[default]
    Pending,
    /// Listed: every Secret's version, by name.
    Listed(BTreeMap<String, SecretVersion>),
    /// The list failed (before any succeeded); the message says why.
    Failed(String),
}

/// The namespaces watched and what each holds.
#[derive(Default)]
pub(super) struct SecretIndex {
    namespaces: Mutex<BTreeMap<String, Listing>>,
}

impl SecretIndex {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Listing>> {
        self.namespaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What is known of `namespace`'s Secrets.
    pub(super) fn listing(&self, namespace: &str) -> Listing {
        self.lock().get(namespace).cloned().unwrap_or_default()
    }

    fn set(&self, namespace: &str, listing: Listing) {
        self.lock().insert(namespace.to_string(), listing);
    }

    fn update(&self, namespace: &str, name: String, version: Option<SecretVersion>) {
        let mut namespaces = self.lock();
        let listing = namespaces.entry(namespace.to_string()).or_default();
        if let Listing::Listed(versions) = listing {
            match version {
                Some(version) => versions.insert(name, version),
                None => versions.remove(&name),
            };
        }
    }
}

/// The metadata watches of the namespaces Tenants name, started and stopped as they are named.
pub(super) struct SecretWatches {
    host: Client,
    /// Whose probe tells a failure to reach the host (none: each namespace's watch tells its own).
    host_reachability: Option<Arc<Reachability>>,
    index: Arc<SecretIndex>,
    /// Woken whenever a watched Secret changes.
    wake: Arc<Notify>,
    watches: BTreeMap<String, AbortOnDropHandle<()>>,
}

impl SecretWatches {
    pub(super) fn new(host: Client, wake: Arc<Notify>, host_reachability: Option<Arc<Reachability>>) -> Self {
        SecretWatches {
            host,
            host_reachability,
            index: Arc::default(),
            wake,
            watches: BTreeMap::new(),
        }
    }

    pub(super) fn index(&self) -> &SecretIndex {
        &self.index
    }

    /// Watches exactly `namespaces` (each one given to the daemon: the caller checks).
    pub(super) fn watch_only(&mut self, namespaces: &std::collections::BTreeSet<String>) {
        self.watches.retain(|namespace, _| namespaces.contains(namespace));
        let index = &self.index;
        index.lock().retain(|namespace, _| namespaces.contains(namespace));
        for namespace in namespaces {
            if self.watches.contains_key(namespace) {
                continue;
            }
            // Metadata only: no Secret's data reaches the daemon through the watch.
            let api: Api<PartialObjectMeta<Secret>> = Api::namespaced(self.host.clone(), namespace);
            let task = tokio::spawn(watch_namespace(
                api,
                namespace.clone(),
                self.index.clone(),
                self.wake.clone(),
                self.host_reachability.clone(),
            ));
            self.watches.insert(namespace.clone(), AbortOnDropHandle::new(task));
        }
    }
}

/// Keeps `namespace`'s entry of `index` in line with its Secrets' metadata, waking `wake` on
/// every change, until aborted.
async fn watch_namespace(
    api: Api<PartialObjectMeta<Secret>>,
    namespace: String,
    index: Arc<SecretIndex>,
    wake: Arc<Notify>,
    host: Option<Arc<Reachability>>,
) {
    // Retried ever more slowly: a namespace the daemon may not list stays so until an admin acts
    // (at once when the host answers again after an outage).
    let events = watcher(api, watcher::Config::default()).boxed();
    let back = host.as_ref().map(|host| host.back());
    let mut events = retry_watch(events, back, WatchBackoff::up_to(LIST_RETRY_MAX));
    let mut listing = BTreeMap::new();
    let mut failures_told = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listing.clear(),
            Ok(Event::InitApply(secret)) => {
                listing.insert(secret.name_any(), version_of(&secret.metadata));
            }
            Ok(Event::InitDone) => {
                failures_told = false;
                index.set(&namespace, Listing::Listed(std::mem::take(&mut listing)));
                wake.notify_one();
            }
            Ok(Event::Apply(secret)) => {
                index.update(&namespace, secret.name_any(), Some(version_of(&secret.metadata)));
                wake.notify_one();
            }
            Ok(Event::Delete(secret)) => {
                index.update(&namespace, secret.name_any(), None);
                wake.notify_one();
            }
            Err(err) => {
                let cause = diagnose(&err);
                let host_away = host
                    .as_deref()
                    .is_some_and(|host| is_quiet_watch_failure(&err, &[host]));
                if failures_told || host_away {
                    debug!(%namespace, %cause, "cannot watch the Secrets of Tenant objects; retrying");
                } else {
                    warn!(%namespace, %cause, "cannot watch the Secrets of Tenant objects; retrying");
                    failures_told = true;
                }
                // A namespace never listed says why; one listed before keeps what it had.
                if !matches!(index.listing(&namespace), Listing::Listed(_)) {
                    index.set(&namespace, Listing::Failed(cause.message));
                    wake.notify_one();
                }
            }
        }
    }
}

fn version_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> SecretVersion {
    SecretVersion {
        uid: meta.uid.clone().unwrap_or_default(),
        resource_version: meta.resource_version.clone().unwrap_or_default(),
    }
}
