//! A store with a namespace and a resource table, for the loops' unit tests: objects are created
//! through the verbs, and the events they caused are collected as a loop's receiver sees them.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::embedded::discovery::ResourceTable;
use crate::embedded::passes::Controller;
use crate::embedded::store::{Store, StoreEvent};
use crate::embedded::verbs;

pub(crate) struct Fixture {
    pub store: Arc<Store>,
    pub resources: Arc<ResourceTable>,
    events: broadcast::Receiver<Arc<StoreEvent>>,
}

impl Fixture {
    /// A store holding namespaces `ns` and `other`.
    pub(crate) fn new() -> Fixture {
        let store = Arc::new(Store::new());
        let resources = Arc::new(ResourceTable::new(store.clone()));
        let events = store.subscribe();
        let fixture = Fixture {
            store,
            resources,
            events,
        };
        for namespace in ["ns", "other"] {
            fixture.create("", "v1", "namespaces", json!({"metadata": {"name": namespace}}));
        }
        fixture
    }

    /// Creates an object (in `ns` when namespaced) and returns it as stored.
    pub(crate) fn create(&self, group: &str, version: &str, plural: &str, body: Value) -> Value {
        let info = self.resources.current().find(group, version, plural).unwrap();
        let namespace = match info.namespaced {
            true => body["metadata"]["namespace"].as_str().unwrap_or("ns").to_string(),
            false => String::new(),
        };
        let created = verbs::create(&self.store, &info, &namespace, body, Default::default()).unwrap();
        created.stored().clone()
    }

    /// The keys the events since the last call name for `controller`.
    pub(crate) fn named<C: Controller>(&mut self, controller: &C) -> BTreeSet<C::Key> {
        let mut named = BTreeSet::new();
        while let Ok(event) = self.events.try_recv() {
            controller.keys_of(&event, &mut named);
        }
        named
    }
}

/// A namespace-and-name key.
pub(crate) fn key(namespace: &str, name: &str) -> (String, String) {
    (namespace.to_string(), name.to_string())
}
