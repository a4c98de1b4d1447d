//! One watch per replica of every tenant's host namespace and of the daemon's RoleBinding in each
//! (issue 32): per tenant they were two host watches, 2,000 at 1,000 tenants, for objects that
//! change only when a host administrator edits them. The daemon's ClusterRole already reads both
//! cluster-wide (it must read and repair a binding where it holds nothing yet), so one shared
//! watch of each widens nothing. Each tenant's host-namespace controller reads the shared caches
//! and is woken only by events about its own namespace (one `watch` channel per namespace, so an
//! event costs one lookup, not one look per tenant, and a burst of them one reconcile).

use std::collections::HashMap;
use std::future::ready;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::labels::{MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL};
use super::namespace::TENANT_NAMESPACE_ROLE;
use crate::runtime::cache::is_filled;
use crate::runtime::cause::diagnose;
use crate::runtime::reachability::Reachability;
use crate::runtime::recovery::{WatchBackoff, retry_watch};
use crate::runtime::retry::is_quiet_watch_failure;

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
    /// By host namespace, the channel its controller listens on.
    listeners: Arc<Listeners>,
}

/// The channel of each host namespace whose controller listens.
#[derive(Default)]
struct Listeners(Mutex<HashMap<String, watch::Sender<()>>>);

impl Listeners {
    fn tell(&self, change: &Changed) {
        let mut listeners = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match change {
            Changed::Namespace(name) => {
                if let Some(sender) = listeners.get(name) {
                    sender.send_replace(());
                }
            }
            Changed::All => {
                // A stopped tenant's channel goes here and when one listens, not on every event.
                listeners.retain(|_, sender| sender.receiver_count() > 0);
                listeners.values().for_each(|sender| {
                    sender.send_replace(());
                });
            }
        }
    }

    fn listen(&self, namespace: &str) -> watch::Receiver<()> {
        let mut listeners = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        listeners.retain(|_, sender| sender.receiver_count() > 0);
        listeners
            .entry(namespace.to_string())
            .or_insert_with(|| watch::channel(()).0)
            .subscribe()
    }
}

impl NamespaceWatch {
    /// Starts both watches on `host`, until `cancel`: the namespaces stackd labelled as a tenant's,
    /// and every RoleBinding named [`TENANT_NAMESPACE_ROLE`] (by name, so one whose labels were
    /// stripped is still seen and repaired).
    pub fn start(host: &Client, reachability: &Arc<Reachability>, cancel: &CancellationToken) -> Arc<Self> {
        let listeners = Arc::new(Listeners::default());
        let tenant_namespaces = format!("{MANAGED_BY_LABEL}={MANAGED_BY},{TENANT_LABEL}");
        let (namespaces, namespace_events) = shared_cache(
            Api::<Namespace>::all(host.clone()),
            watcher::Config::default().labels(&tenant_namespaces),
            "tenant host namespaces",
            |ns: &Namespace| ns.name_any(),
            reachability.clone(),
        );
        let (bindings, binding_events) = shared_cache(
            Api::<RoleBinding>::all(host.clone()),
            watcher::Config::default().fields(&format!("metadata.name={TENANT_NAMESPACE_ROLE}")),
            "tenant namespace RoleBindings",
            |rb: &RoleBinding| rb.namespace().unwrap_or_default(),
            reachability.clone(),
        );
        for events in [namespace_events.boxed(), binding_events.boxed()] {
            let (listeners, cancel) = (listeners.clone(), cancel.clone());
            tokio::spawn(async move {
                let forward = events.for_each(|change| {
                    listeners.tell(&change);
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
            listeners,
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
    /// and then after changes to `namespace` or its RoleBinding, or when a cache is refilled (changes
    /// that come while the controller works are one item).
    pub fn changes_of(&self, namespace: &str) -> impl Stream<Item = Result<(), watcher::Error>> + Send + 'static {
        let mut receiver = self.listeners.listen(namespace);
        receiver.mark_changed();
        WatchStream::from_changes(receiver).map(Ok)
    }
}

/// A reflector of `api` under `config`, retried on the default backoff; its stream names the
/// namespace (by `namespace_of`) of every changed object, and says [`Changed::All`] whenever a list
/// (re)filled it. Failures are logged here, once per failing spell, not once per tenant; while the
/// host is in doubt (a failure to reach it makes it so) they are its probe's to tell. It retries at
/// once when the host answers again.
fn shared_cache<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    namespace_of: fn(&K) -> String,
    reachability: Arc<Reachability>,
) -> (Store<K>, impl Stream<Item = Changed> + Send + 'static)
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let events = retry_watch(
        reflector(writer, watcher(api, config)).boxed(),
        Some(reachability.back()),
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
                // A watch that broke off says nothing to the host's client layer: the probe hears it here.
                let kind = diagnose(&err).kind;
                if kind.is_unreachable() && !kind.is_permanent() {
                    reachability.suspect();
                }
                if is_quiet_watch_failure(&err, &[&reachability]) {
                    debug!(watch = what, error = %err, "host watch failed; retrying");
                } else if !std::mem::replace(&mut failing, true) {
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
