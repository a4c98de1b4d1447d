//! The controller-manager loops a real cluster runs beside its API server, as one in-process task
//! working on the store directly: namespace deletion, CRD cleanup, garbage collection.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::discovery::ResourceTable;
use super::store::Store;
use super::{crd, gc, namespaces};

/// Safety-net rescan, for changes that raced a pass.
const RESCAN: Duration = Duration::from_millis(250);

/// Runs a pass after every burst of store events (and every `RESCAN`) until shutdown. Each pass
/// is idempotent and writes nothing when nothing is pending, so the loop settles.
pub async fn run(store: Arc<Store>, resources: Arc<ResourceTable>, shutdown: CancellationToken) {
    let mut events = store.subscribe();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = events.recv() => {}
            _ = tokio::time::sleep(RESCAN) => {}
        }
        while events.try_recv().is_ok() {}
        let resources = resources.current();
        namespaces::finish_terminating_namespaces(&store, &resources);
        crd::finish_terminating_crds(&store, &resources);
        gc::collect(&store, &resources);
    }
}
