//! One watch per replica of every tenant's host namespace and of the daemon's RoleBinding in each
//! (issue 32): per tenant they were two host watches, 2,000 at 1,000 tenants, for objects that
//! change only when a host administrator edits them. The daemon's ClusterRole already reads both
//! cluster-wide (it must read and repair a binding where it holds nothing yet), so one shared
//! watch of each widens nothing. Each tenant's host-namespace controller reads the shared caches
//! and is woken only by events about its own namespace.

use std::future::ready;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::labels::{MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL};
use super::namespace::TENANT_NAMESPACE_ROLE;
use crate::runtime::cache::is_filled;
use crate::runtime::recovery::{WatchBackoff, retry_watch};

/// How many changes a slow tenant may fall behind before it is told to look at everything (a
/// lagging receiver reconciles once, which is all it needs).
const CHANGES_BUFFERED: usize = 256;

/// Which host namespaces a change concerns.
#[derive(Clone, Debug)]
enum Changed {
    /// The namespace of this name, or the RoleBinding in it.
    Namespace(String),
    /// Every one: a cache was (re)filled from a list, which may have missed deletions.
    All,
}

/// The shared caches of tenant host namespaces and of the daemon's RoleBindings in them.
pub struct NamespaceWatch {
    namespaces: Store<Namespace>,
    bindings: Store<RoleBinding>,
    changed: broadcast::Sender<Changed>,
}

impl NamespaceWatch {
    /// Starts both watches on `host`, until `cancel`: the namespaces stackd labelled as a tenant's,
    /// and every RoleBinding named [`TENANT_NAMESPACE_ROLE`] (by name, so one whose labels were
    /// stripped is still seen and repaired).
    pub fn start(host: &Client, cancel: &CancellationToken) -> Arc<Self> {
        let (changed, _) = broadcast::channel(CHANGES_BUFFERED);
        let tenant_namespaces = format!("{MANAGED_BY_LABEL}={MANAGED_BY},{TENANT_LABEL}");
        let (namespaces, namespace_events) = shared_cache(
            Api::<Namespace>::all(host.clone()),
            watcher::Config::default().labels(&tenant_namespaces),
            "tenant host namespaces",
            |ns: &Namespace| ns.name_any(),
        );
        let (bindings, binding_events) = shared_cache(
            Api::<RoleBinding>::all(host.clone()),
            watcher::Config::default().fields(&format!("metadata.name={TENANT_NAMESPACE_ROLE}")),
            "tenant namespace RoleBindings",
            |rb: &RoleBinding| rb.namespace().unwrap_or_default(),
        );
        for events in [namespace_events.boxed(), binding_events.boxed()] {
            let (changed, cancel) = (changed.clone(), cancel.clone());
            tokio::spawn(async move {
                let forward = events.for_each(|change| {
                    // No receiver (no tenant running) is no error.
                    let _ = changed.send(change);
                    ready(())
                });
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = forward => {}
                }
            });
        }
        Arc::new(NamespaceWatch {
            namespaces,
            bindings,
            changed,
        })
    }

    /// The cached namespace `name`, when it carries stackd's tenant labels (else the caller reads
    /// it from the server: it may exist unlabelled, or have had its labels stripped).
    pub fn namespace(&self, name: &str) -> Option<Arc<Namespace>> {
        self.namespaces.get(&ObjectRef::new(name))
    }

    /// The cached RoleBinding [`TENANT_NAMESPACE_ROLE`] in `namespace`.
    pub fn binding(&self, namespace: &str) -> Option<Arc<RoleBinding>> {
        self.bindings
            .get(&ObjectRef::new(TENANT_NAMESPACE_ROLE).within(namespace))
    }

    /// Whether both caches have been filled from their first list.
    pub fn filled(&self) -> bool {
        is_filled(&self.namespaces) && is_filled(&self.bindings)
    }

    /// A stream that yields once at once (a tenant starting after the caches filled must look once)
    /// and then on every change to `namespace` or its RoleBinding, or when a cache is refilled.
    pub fn changes_of(&self, namespace: &str) -> impl Stream<Item = Result<(), watcher::Error>> + Send + 'static {
        let namespace = namespace.to_string();
        let changes = BroadcastStream::new(self.changed.subscribe()).filter_map(move |change| {
            let concerns = match change {
                Ok(Changed::Namespace(name)) => name == namespace,
                Ok(Changed::All) => true,
                // Fell behind: something may have concerned it.
                Err(_) => true,
            };
            ready(concerns.then_some(Ok(())))
        });
        futures::stream::once(ready(Ok(()))).chain(changes)
    }
}

/// A reflector of `api` under `config`, retried on the default backoff; its stream names the
/// namespace (by `namespace_of`) of every changed object, and says [`Changed::All`] whenever a list
/// (re)filled it. Failures are logged here, once per outage, not once per tenant.
fn shared_cache<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    namespace_of: fn(&K) -> String,
) -> (Store<K>, impl Stream<Item = Changed> + Send + 'static)
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let events = retry_watch(
        reflector(writer, watcher(api, config)).boxed(),
        None,
        WatchBackoff::default(),
    );
    let mut failing = false;
    let changes = events.filter_map(move |event| {
        let change = match event {
            // Comes before every attempt to list, the failing ones too.
            Ok(Event::Init | Event::InitApply(_)) => return ready(None),
            Ok(Event::Apply(object) | Event::Delete(object)) => Changed::Namespace(namespace_of(&object)),
            Ok(Event::InitDone) => Changed::All,
            Err(err) => {
                if !std::mem::replace(&mut failing, true) {
                    warn!(watch = what, error = %err, "host watch failed; retrying");
                }
                return ready(None);
            }
        };
        if std::mem::take(&mut failing) {
            info!(watch = what, "host watch resumed");
        }
        ready(Some(change))
    });
    (store, changes)
}
