//! The controller-manager loops the daemon relies on (DESIGN §7): service-account token filling
//! ([`tokens`]), Job → Pod with scripted outcomes ([`jobs`]), Deployment → ReplicaSet → Pods
//! ([`deployments`]). Namespace deletion and garbage collection live in `namespaces` and `gc`.
//!
//! Each loop is a [`Controller`](crate::embedded::passes::Controller): a store event names the
//! objects worth a look (a Job for an event about one of its Pods, found through the store's owner
//! index), and a pass looks at those only; a pass that finds nothing to do writes nothing, so the
//! loops settle.

pub mod deployments;
pub mod jobs;
#[cfg(test)]
pub(crate) mod testing;
pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::{Value, json};

use super::discovery::{ResourceInfo, ResourceTable};
use super::status::ApiError;
use super::store::{GroupResource, ObjectKey, Store, StoreEvent, Write, owner_uids};

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
    /// The pod's emptyDir volumes (see [`JobContext::volume_path`]).
    pub(crate) volumes: Arc<PodVolumes>,
}

/// A pod's emptyDir volumes as directories of this machine, under one directory per pod that is
/// made on first use and removed with the pod's run: what the containers of a pod share.
pub(crate) struct PodVolumes {
    root: PathBuf,
}

impl PodVolumes {
    pub(crate) fn new(pod_uid: &str) -> PodVolumes {
        PodVolumes {
            root: std::env::temp_dir().join(format!("stackd-embedded-pod-{pod_uid}")),
        }
    }
}

impl Drop for PodVolumes {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl JobContext {
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }

    /// Where `path`, as the running container sees it, is on this machine when it is on an
    /// emptyDir volume the container mounts (the volume's directory is made then); `None` when it
    /// is in the container's image (or climbs out of its volume with `..`).
    pub fn volume_path(&self, path: &str) -> Option<PathBuf> {
        let list = if self.init_container {
            "initContainers"
        } else {
            "containers"
        };
        let spec = &self.pod["spec"];
        let container = spec[list]
            .as_array()?
            .iter()
            .find(|c| c["name"] == self.container.as_str())?;
        let path = Path::new(path);
        if path.components().any(|c| c == Component::ParentDir) {
            return None;
        }
        let (volume, rest) = container["volumeMounts"]
            .as_array()?
            .iter()
            .filter_map(|mount| {
                let rest = path.strip_prefix(mount["mountPath"].as_str()?).ok()?;
                Some((mount["name"].as_str()?, rest))
            })
            .max_by_key(|(_, rest)| std::cmp::Reverse(rest.components().count()))?;
        let is_empty_dir = spec["volumes"]
            .as_array()?
            .iter()
            .any(|v| v["name"] == volume && v["emptyDir"].is_object());
        let dir = self.volumes.root.join(volume);
        (is_empty_dir && std::fs::create_dir_all(&dir).is_ok()).then(|| dir.join(rest))
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
        if !self.store.contains(&secrets, namespace, name) {
            let info = info(&self.resources, "", "v1", "secrets")?;
            let body = json!({
                "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "type": "Opaque",
                "data": data.iter().map(|(k, v)| (k.clone(), encode(v))).collect::<serde_json::Map<_, _>>(),
            });
            let created = super::verbs::create(&self.store, &info, namespace, body, Default::default());
            return created.map(super::served::Served::into_value);
        }
        modify(&self.store, &secrets, namespace, name, |secret| {
            for (key, value) in data {
                secret["data"][key] = encode(value);
            }
        })
        .map(|(object, _)| Arc::unwrap_or_clone(object))
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
    without_user: RwLock<Vec<ImageMatch>>,
    faults: RwLock<Vec<(ImageMatch, PodFault)>>,
}

/// What the kubelet stand-in reports for a container of a matching image instead of running it,
/// in the fields a kubelet writes (`state.waiting`, `lastState.terminated`, `restartCount`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodFault {
    /// The image cannot be pulled: `ErrImagePull`, then `ImagePullBackOff`; the pod stays Pending.
    Unpullable,
    /// The container exits each time it starts: `CrashLoopBackOff`, the last run terminated with
    /// `exit_code` and `reason` (`Error`, or `OOMKilled` for a container over its memory limit).
    CrashLoop { exit_code: i32, reason: &'static str },
    /// No node has room for the pod: the scheduler leaves it Pending with `PodScheduled=False`
    /// (`Unschedulable`) and no container is created.
    Unschedulable,
    /// The kubelet cannot create the container as specified (`CreateContainerConfigError` with
    /// `message`, e.g. a root image under `runAsNonRoot`); the pod stays Pending.
    ConfigError { message: &'static str },
}

impl PodFault {
    /// The container's status fields for this fault (`attempt` 0 is the first the kubelet writes).
    pub fn status(&self, image: &str, pod_name: &str, container: &str, attempt: u32) -> Value {
        match self {
            PodFault::Unpullable if attempt == 0 => json!({
                "state": {"waiting": {"reason": "ErrImagePull", "message": format!(
                    "rpc error: code = NotFound desc = failed to pull and unpack image \"{image}\": not found")}},
                "restartCount": 0,
            }),
            PodFault::Unpullable => json!({
                "state": {"waiting": {"reason": "ImagePullBackOff",
                    "message": format!("Back-off pulling image \"{image}\"")}},
                "restartCount": 0,
            }),
            // Never reported: an unscheduled pod has no container statuses (see `unscheduled`).
            PodFault::Unschedulable => {
                json!({"state": {"waiting": {"reason": "ContainerCreating"}}, "restartCount": 0})
            }
            PodFault::ConfigError { message } => json!({
                "state": {"waiting": {"reason": "CreateContainerConfigError", "message": message}},
                "restartCount": 0,
            }),
            PodFault::CrashLoop { exit_code, reason } => json!({
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": format!(
                    "back-off 40s restarting failed container={container} pod={pod_name}")}},
                "lastState": {"terminated": {"exitCode": exit_code, "reason": reason}},
                "restartCount": 3,
            }),
        }
    }
}

/// The status the scheduler leaves a pod no node has room for.
pub(crate) fn unscheduled() -> Value {
    json!({"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "lastProbeTime": null, "lastTransitionTime": crate::embedded::object_meta::now_timestamp(),
        "message": "0/1 nodes are available: 1 Insufficient memory. preemption: 0/1 nodes are available: \
            1 No preemption victims found for incoming pod.",
    }]})
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

    /// Images built without `USER`: they run as root (uid 0) unless the pod names a user, so the
    /// kubelet refuses to start them under `runAsNonRoot` (see the deployments loop).
    pub fn without_user(&self, images: ImageMatch) {
        write(&self.without_user).push(images);
    }

    pub fn runs_as_root(&self, image: &str) -> bool {
        read(&self.without_user).iter().any(|m| m.matches(image))
    }

    /// Containers of a matching image, in Job and Deployment pods, do not run: the kubelet
    /// stand-in reports `fault` for them (a later registration wins).
    pub fn fault(&self, images: ImageMatch, fault: PodFault) {
        write(&self.faults).push((images, fault));
    }

    pub fn fault_of(&self, image: &str) -> Option<PodFault> {
        read(&self.faults)
            .iter()
            .rev()
            .find(|(images, _)| images.matches(image))
            .map(|(_, fault)| fault.clone())
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
) -> Result<(Arc<Value>, bool), ApiError> {
    store.write(resource, namespace, name, |current| {
        let Some(current) = current else {
            return Err(ApiError::not_found(&resource.group, &resource.resource, name));
        };
        let mut updated = current.clone();
        change(&mut updated);
        Ok(if updated == *current {
            Write::Keep
        } else {
            Write::Put(updated)
        })
    })
}

pub(crate) fn text<'a>(object: &'a Value, field: &str) -> &'a str {
    object["metadata"][field].as_str().unwrap_or("")
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

/// Where an event's object lives (namespace and name).
pub(crate) fn key_of(event: &StoreEvent) -> ObjectKey {
    (
        text(&event.object, "namespace").to_string(),
        text(&event.object, "name").to_string(),
    )
}

/// The objects of `owner_kind` (its storage key) that own the event's object, before or after the
/// change, found by uid as the garbage collector finds owners.
pub(crate) fn owners_of(store: &Store, event: &StoreEvent, owner_kind: &GroupResource) -> BTreeSet<ObjectKey> {
    let states = std::iter::once(&event.object).chain(event.previous.as_ref());
    let uids: BTreeSet<&str> = states.flat_map(|state| owner_uids(state)).collect();
    uids.into_iter()
        .filter_map(|uid| store.by_uid(uid))
        .filter(|(location, _)| location.resource == *owner_kind)
        .map(|(location, _)| (location.namespace, location.name))
        .collect()
}

/// Every object of a resource, by namespace and name.
pub(crate) fn all_keys(store: &Store, resource: &GroupResource) -> BTreeSet<ObjectKey> {
    store
        .project(resource, |object| {
            (text(object, "namespace").to_string(), text(object, "name").to_string())
        })
        .into_iter()
        .collect()
}
