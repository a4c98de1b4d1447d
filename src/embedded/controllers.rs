//! The controller-manager loops a real cluster runs beside its API server, as in-process tasks
//! working on the store directly: namespace deletion, CRD cleanup, garbage collection. Each is a
//! [`passes::Controller`]: most writes (a ConfigMap created, a status updated) name nothing for
//! them, which keeps bulk writes from paying for whole-store scans.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::discovery::ResourceTable;
use super::passes;
use super::store::Store;
use super::{crd_cleanup, gc, namespaces};

/// How soon a pass looks again at what it could not finish.
const RETRY: Duration = Duration::from_secs(1);

/// Runs the loops until shutdown.
pub async fn run(store: Arc<Store>, resources: Arc<ResourceTable>, shutdown: CancellationToken) {
    let namespaces = namespaces::NamespaceController::new(store.clone(), resources.clone());
    let definitions = crd_cleanup::CleanupController::new(store.clone(), resources.clone());
    let collector = gc::GarbageCollector::new(store.clone(), resources);
    tokio::join!(
        passes::run(store.clone(), shutdown.clone(), RETRY, namespaces),
        passes::run(store.clone(), shutdown.clone(), RETRY, definitions),
        passes::run(store, shutdown, RETRY, collector),
    );
}
