//! The controller-manager loops the daemon relies on (DESIGN §7): service-account token filling
//! ([`tokens`]), Job → Pod with scripted outcomes ([`jobs`]), Deployment → ReplicaSet → Pods
//! ([`deployments`]). Namespace deletion and garbage collection live in `namespaces` and `gc`.
//!
//! Each loop runs a pass over the store on every store event (a burst is one pass) and on a short
//! rescan as a safety net; a pass that finds nothing to do writes nothing, so the loops settle.

pub mod deployments;
pub mod jobs;
pub mod tokens;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::discovery::{ResourceInfo, ResourceTable};
use super::status::ApiError;
use super::store::{GroupResource, Store, Write};

/// How a runner or readiness rule picks the images it answers.
#[derive(Clone)]
pub enum ImageMatch {
    /// The whole image reference, tag included.
    Exact(String),
    /// Images starting with this text (e.g. a repository without its tag).
    Prefix(String),
    /// Any rule over the image reference.
    Predicate(Arc<dyn Fn(&str) -> bool + Send + Sync>),
}

impl ImageMatch {
    pub fn matches(&self, image: &str) -> bool {
        match self {
            ImageMatch::Exact(exact) => image == exact,
            ImageMatch::Prefix(prefix) => image.starts_with(prefix.as_str()),
            ImageMatch::Predicate(rule) => rule(image),
        }
    }
}

impl std::fmt::Debug for ImageMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageMatch::Exact(image) => write!(f, "Exact({image})"),
            ImageMatch::Prefix(prefix) => write!(f, "Prefix({prefix})"),
            ImageMatch::Predicate(_) => write!(f, "Predicate"),
        }
    }
}

/// What one container of a Job's pod sees when it "runs".
#[derive(Clone)]
pub struct JobContext {
    pub job: Value,
    pub pod: Value,
    pub namespace: String,
    /// The container being run (an init container or a main one).
    pub container: String,
    pub init_container: bool,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    /// Literal `env` values (`valueFrom` entries are not resolved).
    pub env: BTreeMap<String, String>,
    /// The server's store, for side effects (see [`JobContext::write_secret_data`]).
    pub store: Arc<Store>,
    pub(crate) resources: Arc<ResourceTable>,
}

impl JobContext {
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// Merges `data` (plain text values) into a Secret, creating it when missing — what a container
    /// with `update`/`create` on that Secret would do.
    pub fn write_secret_data(
        &self,
        namespace: &str,
        name: &str,
        data: &BTreeMap<String, String>,
    ) -> Result<Value, ApiError> {
        use base64::Engine;
        let encode = |v: &String| json!(base64::engine::general_purpose::STANDARD.encode(v));
        let secrets = GroupResource::new("", "secrets");
        if self.store.get(&secrets, namespace, name).is_none() {
            let info = info(&self.resources, "", "v1", "secrets")?;
            let body = json!({
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "type": "Opaque",
                "data": data.iter().map(|(k, v)| (k.clone(), encode(v))).collect::<serde_json::Map<_, _>>(),
            });
            return super::verbs::create(&self.store, &info, namespace, body, Default::default());
        }
        modify(&self.store, &secrets, namespace, name, |secret| {
            for (key, value) in data {
                secret["data"][key] = encode(value);
            }
        })
        .map(|(object, _)| object)
    }
}

/// One container's scripted run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobOutcome {
    pub exit_code: i32,
    /// The container's log, served by `pods/log`.
    pub log: String,
    /// How long the container "runs" before terminating.
    pub delay: Duration,
}

impl JobOutcome {
    pub fn success(log: impl Into<String>) -> JobOutcome {
        JobOutcome {
            exit_code: 0,
            log: log.into(),
            delay: Duration::ZERO,
        }
    }

    pub fn failure(exit_code: i32, log: impl Into<String>) -> JobOutcome {
        JobOutcome {
            exit_code,
            log: log.into(),
            delay: Duration::ZERO,
        }
    }

    pub fn after(mut self, delay: Duration) -> JobOutcome {
        self.delay = delay;
        self
    }
}

/// Decides how a container of a given image behaves. Runs on a blocking thread, so it may read files
/// or write to the store directly.
pub trait JobRunner: Send + Sync {
    fn run(&self, ctx: &JobContext) -> JobOutcome;
}

impl<F> JobRunner for F
where
    F: Fn(&JobContext) -> JobOutcome + Send + Sync,
{
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        self(ctx)
    }
}

/// The per-image hooks of one server: Job runners and Deployment pod readiness.
///
/// A main container whose image no runner matches runs the default runner if one is set, else it
/// fails with exit code 1 and the log `no runner for image X`; an init container without a runner
/// succeeds silently.
#[derive(Default)]
pub struct Runners {
    runners: RwLock<Vec<(ImageMatch, Arc<dyn JobRunner>)>>,
    fallback: RwLock<Option<Arc<dyn JobRunner>>>,
    never_ready: RwLock<Vec<ImageMatch>>,
}

impl Runners {
    /// Registers a runner; a later registration wins over an earlier one matching the same image.
    pub fn register(&self, images: ImageMatch, runner: impl JobRunner + 'static) {
        self.register_arc(images, Arc::new(runner));
    }

    pub fn register_arc(&self, images: ImageMatch, runner: Arc<dyn JobRunner>) {
        write(&self.runners).push((images, runner));
    }

    /// The runner for images no registered runner matches.
    pub fn set_default(&self, runner: impl JobRunner + 'static) {
        *write(&self.fallback) = Some(Arc::new(runner));
    }

    /// The runner registered for an image, if any (the default runner not included).
    pub fn runner_for(&self, image: &str) -> Option<Arc<dyn JobRunner>> {
        read(&self.runners)
            .iter()
            .rev()
            .find(|(images, _)| images.matches(image))
            .map(|(_, runner)| runner.clone())
    }

    pub fn default_runner(&self) -> Option<Arc<dyn JobRunner>> {
        read(&self.fallback).clone()
    }

    /// Deployment pods whose containers use a matching image stay Running but never Ready.
    pub fn never_ready(&self, images: ImageMatch) {
        write(&self.never_ready).push(images);
    }

    pub fn is_ready(&self, image: &str) -> bool {
        !read(&self.never_ready).iter().any(|m| m.matches(image))
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The served resource, or a 404 when the table lacks it (cannot happen for built-ins).
pub(crate) fn info(
    resources: &ResourceTable,
    group: &str,
    version: &str,
    plural: &str,
) -> Result<ResourceInfo, ApiError> {
    resources
        .current()
        .find(group, version, plural)
        .ok_or_else(ApiError::path_not_found)
}

/// Changes a stored object in place (status included, generation untouched); writes nothing when
/// the change is a no-op.
pub(crate) fn modify(
    store: &Store,
    resource: &GroupResource,
    namespace: &str,
    name: &str,
    change: impl FnOnce(&mut Value),
) -> Result<(Value, bool), ApiError> {
    store.write(resource, namespace, name, |current| {
        let Some(current) = current else {
            return Err(ApiError::not_found(&resource.group, &resource.resource, name));
        };
        let mut updated = current.clone();
        change(&mut updated);
        Ok(if updated == *current {
            Write::Unchanged(updated)
        } else {
            Write::Put(updated)
        })
    })
}

pub(crate) fn text<'a>(object: &'a Value, field: &str) -> &'a str {
    object["metadata"][field].as_str().unwrap_or("")
}

/// Whether `object` names `owner_uid` among its owner references.
pub(crate) fn owned_by(object: &Value, owner_uid: &str) -> bool {
    object["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| refs.iter().any(|r| r["uid"].as_str() == Some(owner_uid)))
}

pub(crate) fn is_deleting(object: &Value) -> bool {
    object["metadata"]["deletionTimestamp"].is_string()
}

/// A controller owner reference to `owner`.
pub(crate) fn controller_ref(api_version: &str, kind: &str, owner: &Value) -> Value {
    json!({
        "apiVersion": api_version, "kind": kind, "name": text(owner, "name"), "uid": text(owner, "uid"),
        "controller": true, "blockOwnerDeletion": true,
    })
}

/// Runs `pass` on every burst of store events about the `watched` resources (plurals) and every
/// `rescan`, until shutdown.
pub(crate) async fn run_loop(
    store: Arc<Store>,
    shutdown: CancellationToken,
    rescan: Duration,
    watched: &'static [&'static str],
    mut pass: impl FnMut() + Send,
) {
    let mut events = store.subscribe();
    loop {
        pass();
        let next_rescan = tokio::time::Instant::now() + rescan;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                received = events.recv() => match received {
                    Ok(event) if !watched.contains(&event.resource.resource.as_str()) => continue,
                    // Relevant, or events were missed: a pass settles both.
                    _ => break,
                },
                _ = tokio::time::sleep_until(next_rescan) => break,
            }
        }
        while events.try_recv().is_ok() {}
    }
}
