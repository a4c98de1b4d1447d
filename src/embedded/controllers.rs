//! The controller-manager loops a real cluster runs beside its API server, as one in-process task
//! working on the store directly: namespace deletion, CRD cleanup, garbage collection.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio_util::sync::CancellationToken;

use super::discovery::ResourceTable;
use super::store::{EventType, Store, StoreEvent};
use super::{crd, crd_cleanup, gc, namespaces};

/// Safety-net full pass, for anything a lagging event receiver missed.
const RESCAN: Duration = Duration::from_secs(1);

/// Which passes a burst of store events calls for. Most writes (a ConfigMap created, a status
/// updated) call for none, which keeps bulk writes from paying for whole-store scans. A new loop
/// adds a flag here and says in [`Work::note`] which events wake it.
#[derive(Debug, Default)]
struct Work {
    deletions: bool,
    ownership: bool,
    definitions: bool,
}

impl Work {
    fn everything() -> Work {
        Work {
            deletions: true,
            ownership: true,
            definitions: true,
        }
    }

    fn note(&mut self, event: &StoreEvent) {
        let metadata = &event.object["metadata"];
        let deleting = event.event_type == EventType::Deleted || metadata["deletionTimestamp"].is_string();
        self.deletions |= deleting;
        self.ownership |= deleting || metadata.get("ownerReferences").is_some();
        self.definitions |= deleting || event.resource == crd::crd_resource();
    }
}

/// Runs the passes each burst of store events calls for, until shutdown. Each pass is idempotent
/// and writes nothing when nothing is pending, so the loop settles.
pub async fn run(store: Arc<Store>, resources: Arc<ResourceTable>, shutdown: CancellationToken) {
    let mut events = store.subscribe();
    loop {
        let mut work = Work::default();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            received = events.recv() => match received {
                Ok(event) => work.note(&event),
                Err(RecvError::Lagged(_)) => work = Work::everything(),
                Err(RecvError::Closed) => return,
            },
            _ = tokio::time::sleep(RESCAN) => work = Work::everything(),
        }
        loop {
            match events.try_recv() {
                Ok(event) => work.note(&event),
                Err(TryRecvError::Lagged(_)) => work = Work::everything(),
                Err(_) => break,
            }
        }
        let resources = resources.current();
        if work.deletions {
            namespaces::finish_terminating_namespaces(&store, &resources);
        }
        if work.definitions {
            crd_cleanup::finish_terminating_crds(&store, &resources);
        }
        if work.ownership {
            gc::collect(&store, &resources);
        }
    }
}
