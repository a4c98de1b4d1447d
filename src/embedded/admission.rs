//! Mutating admission: what a `MutatingWebhookConfiguration` gives a real cluster (a service mesh
//! injecting its sidecar, a policy engine forcing a field). Tests register hooks per resource; a
//! hook changes the object of every create and update of that resource arriving over HTTP (a patch
//! or server-side apply is an update), after defaulting and before validation and storage, so the
//! stored object, the answer to the write and the watch events all carry its change.
//!
//! As with a webhook's `rules`, a hook on `deployments` sees neither `deployments/status` nor
//! `deployments/scale`. Writes of the in-process loops (the Deployment loop's ReplicaSets and pods,
//! status updates) bypass admission: they do not pass the HTTP pipeline.

use std::fmt;
use std::sync::{Arc, RwLock};

use serde_json::Value;

use super::discovery::ResourceInfo;

type Mutation = Arc<dyn Fn(&mut Value) + Send + Sync>;

struct Hook {
    group: String,
    plural: String,
    mutation: Mutation,
}

/// The mutating hooks of one server, in the order they were registered (the order they run in).
#[derive(Default)]
pub struct Admission {
    hooks: RwLock<Vec<Hook>>,
}

/// What a hook may not change: the object's identity and the server's bookkeeping.
const SERVER_OWNED: &[&str] = &["name", "namespace", "uid", "resourceVersion", "creationTimestamp"];

impl Admission {
    /// Runs `mutation` on every object of `group`/`plural` (`""` for the core group) created or
    /// updated from now on, as a mutating webhook would.
    pub fn mutate<F>(&self, group: &str, plural: &str, mutation: F)
    where
        F: Fn(&mut Value) + Send + Sync + 'static,
    {
        let hook = Hook {
            group: group.to_string(),
            plural: plural.to_string(),
            mutation: Arc::new(mutation),
        };
        self.hooks.write().unwrap_or_else(|p| p.into_inner()).push(hook);
    }

    /// Removes every hook (the webhook configuration deleted).
    pub fn clear(&self) {
        self.hooks.write().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Runs the hooks matching `info` on `object`; true when at least one ran. Hooks run outside the
    /// lock, so one may register or clear hooks; identity and bookkeeping metadata are kept as they
    /// were, as kube-apiserver refuses a webhook's change to them.
    pub(super) fn run(&self, info: &ResourceInfo, object: &mut Value) -> bool {
        let matching: Vec<Mutation> = self
            .hooks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|hook| hook.group == info.group && hook.plural == info.plural)
            .map(|hook| hook.mutation.clone())
            .collect();
        if matching.is_empty() {
            return false;
        }
        let kept: Vec<(&str, Option<Value>)> = SERVER_OWNED
            .iter()
            .map(|field| (*field, object["metadata"].get(*field).cloned()))
            .collect();
        for mutation in matching {
            mutation(object);
        }
        restore(object, kept);
        true
    }
}

/// Puts `kept` metadata back; an object a hook broke is left to validation to refuse.
fn restore(object: &mut Value, kept: Vec<(&str, Option<Value>)>) {
    let Some(object) = object.as_object_mut() else {
        return;
    };
    let metadata = object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Default::default()));
    let Some(metadata) = metadata.as_object_mut() else {
        return;
    };
    for (field, value) in kept {
        match value {
            Some(value) => metadata.insert(field.to_string(), value),
            None => metadata.remove(field),
        };
    }
}

impl fmt::Debug for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hooks = self.hooks.read().unwrap_or_else(|p| p.into_inner());
        let resources: Vec<String> = hooks.iter().map(|h| format!("{}/{}", h.group, h.plural)).collect();
        f.debug_struct("Admission").field("hooks", &resources).finish()
    }
}
