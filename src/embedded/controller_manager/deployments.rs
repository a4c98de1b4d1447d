//! The Deployment and ReplicaSet controllers, simplified: a Deployment's current template gets a
//! ReplicaSet `<deployment>-<pod-template-hash>` with all the replicas at once (older ReplicaSets are
//! scaled to zero at the same moment), and each ReplicaSet keeps its Pods, which are Running and Ready
//! at once unless [`Runners::never_ready`] names their image (or [`Runners::fault`], whose pods
//! report the kubelet's waiting reason instead). Deployment status then reports
//! `replicas`, `updatedReplicas`, `readyReplicas`, `availableReplicas` and `Available`/`Progressing`,
//! and `ReplicaFailure` (`FailedCreate`) while its ReplicaSet cannot create a pod (e.g. a quota
//! refuses it).
//!
//! A pass looks at the Deployments and ReplicaSets whose events arrived since the last one (a Pod's
//! event names its ReplicaSet, a ReplicaSet's its Deployment), each one's dependents coming from the
//! store's owner index.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::{PodFault, Runners, all_keys, controller_ref, info, is_deleting, key_of, modify, owners_of, text};
use crate::embedded::discovery::ResourceTable;
use crate::embedded::object_meta::now_timestamp;
use crate::embedded::passes::{self, Controller};
use crate::embedded::store::{GroupResource, ObjectKey, Store, StoreEvent};
use crate::embedded::verb_options::DeleteOptions;
use crate::embedded::verbs;

const RESCAN: Duration = Duration::from_millis(500);
pub const POD_TEMPLATE_HASH: &str = "pod-template-hash";

fn deployments() -> GroupResource {
    GroupResource::new("apps", "deployments")
}

fn replica_sets() -> GroupResource {
    GroupResource::new("apps", "replicasets")
}

fn pods() -> GroupResource {
    GroupResource::new("", "pods")
}

pub async fn run(store: Arc<Store>, resources: Arc<ResourceTable>, runners: Arc<Runners>, shutdown: CancellationToken) {
    let controller = DeploymentController {
        store: store.clone(),
        resources,
        runners,
    };
    passes::run(store, shutdown, RESCAN, controller).await;
}

/// What a pass looks at.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Deployment(ObjectKey),
    ReplicaSet(ObjectKey),
}

struct DeploymentController {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
    runners: Arc<Runners>,
}

impl Controller for DeploymentController {
    type Key = Key;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<Key>) {
        if event.resource == deployments() {
            pending.insert(Key::Deployment(key_of(event)));
        } else if event.resource == replica_sets() {
            pending.insert(Key::ReplicaSet(key_of(event)));
            let owners = owners_of(&self.store, event, &deployments());
            pending.extend(owners.into_iter().map(Key::Deployment));
        } else if event.resource == pods() {
            let owners = owners_of(&self.store, event, &replica_sets());
            pending.extend(owners.into_iter().map(Key::ReplicaSet));
        }
    }

    fn all_keys(&self) -> BTreeSet<Key> {
        let deployments = all_keys(&self.store, &deployments()).into_iter().map(Key::Deployment);
        let sets = all_keys(&self.store, &replica_sets()).into_iter().map(Key::ReplicaSet);
        deployments.chain(sets).collect()
    }

    /// Deployments first (their ReplicaSets join the pass), then ReplicaSets (their Deployments
    /// join it), then the Deployments' status, so one pass carries a change all the way through.
    fn pass(&mut self, keys: BTreeSet<Key>) -> BTreeSet<Key> {
        let (store, resources) = (&self.store, &self.resources);
        let (mut deployment_keys, mut set_keys) = (BTreeSet::new(), BTreeSet::new());
        for key in keys {
            match key {
                Key::Deployment(key) => deployment_keys.insert(key),
                Key::ReplicaSet(key) => set_keys.insert(key),
            };
        }
        let mut retries = BTreeSet::new();
        for key in &deployment_keys {
            let (sets, again) = sync_deployment(store, resources, key);
            set_keys.extend(sets);
            if again {
                retries.insert(Key::Deployment(key.clone()));
            }
        }
        for key in &set_keys {
            let (owners, again) = sync_replica_set(store, resources, &self.runners, key);
            deployment_keys.extend(owners);
            if again {
                retries.insert(Key::ReplicaSet(key.clone()));
            }
        }
        deployment_keys
            .iter()
            .for_each(|key| sync_deployment_status(store, key));
        retries
    }
}

/// kube's pod-template-hash: FNV-32a of the template, as decimal digits in the safe alphabet.
pub fn template_hash(template: &Value) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut hash: u32 = 0x811c9dc5;
    for byte in template.to_string().bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x01000193);
    }
    hash.to_string()
        .bytes()
        .map(|b| ALPHANUMS[usize::from(b) % ALPHANUMS.len()] as char)
        .collect()
}

fn replicas(object: &Value) -> i64 {
    object["spec"]["replicas"].as_i64().unwrap_or(1).max(0)
}

/// The objects of `resource` that `owner` owns and that are not being deleted, from the owner index.
fn owned(store: &Store, owner: &Value, resource: &GroupResource) -> Vec<Arc<Value>> {
    let dependents = store.dependents(text(owner, "uid"), Some(resource));
    dependents
        .into_iter()
        .map(|(_, object)| object)
        .filter(|object| !is_deleting(object))
        .collect()
}

/// Gives the Deployment a ReplicaSet for its current template and scales the others to zero.
/// Returns its ReplicaSets, and whether to look again (the ReplicaSet could not be created).
fn sync_deployment(store: &Store, resources: &ResourceTable, (namespace, name): &ObjectKey) -> (Vec<ObjectKey>, bool) {
    let Some(deployment) = store.get_shared(&deployments(), namespace, name) else {
        return (Vec::new(), false);
    };
    if is_deleting(&deployment) {
        return (Vec::new(), false);
    }
    let hash = template_hash(&deployment["spec"]["template"]);
    let current = format!("{name}-{hash}");
    let desired = replicas(&deployment);
    let mine = owned(store, &deployment, &replica_sets());
    let mut again = false;
    let mut sets: Vec<ObjectKey> = mine
        .iter()
        .map(|rs| (namespace.clone(), text(rs, "name").to_string()))
        .collect();
    if !mine.iter().any(|rs| text(rs, "name") == current) {
        let revision = mine.iter().filter_map(|rs| revision(rs)).max().unwrap_or(0) + 1;
        let rs = new_replica_set(&deployment, &current, &hash, desired, revision);
        let created = info(resources, "apps", "v1", "replicasets")
            .and_then(|info| verbs::create(store, &info, namespace, rs, Default::default()).map(|_| ()));
        match created {
            Ok(()) => sets.push((namespace.clone(), current.clone())),
            Err(e) => {
                tracing::warn!(namespace, deployment = name, error = %e.message, "creating the ReplicaSet");
                again = true;
            }
        }
    }
    for rs in &mine {
        let want = if text(rs, "name") == current { desired } else { 0 };
        let _ = modify(store, &replica_sets(), namespace, text(rs, "name"), |rs| {
            if replicas(rs) != want {
                rs["spec"]["replicas"] = json!(want);
                let generation = rs["metadata"]["generation"].as_i64().unwrap_or(1);
                rs["metadata"]["generation"] = json!(generation + 1);
            }
        });
    }
    (sets, again)
}

const REVISION: &str = "deployment.kubernetes.io/revision";

fn revision(rs: &Value) -> Option<u64> {
    rs["metadata"]["annotations"][REVISION].as_str()?.parse().ok()
}

fn new_replica_set(deployment: &Value, name: &str, hash: &str, replicas: i64, revision: u64) -> Value {
    let mut template = deployment["spec"]["template"].clone();
    template["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(hash);
    let mut selector = deployment["spec"]["selector"].clone();
    selector["matchLabels"][POD_TEMPLATE_HASH] = json!(hash);
    json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "labels": template["metadata"]["labels"],
            "annotations": {REVISION: revision.to_string()},
            "ownerReferences": [controller_ref("apps/v1", "Deployment", deployment)],
        },
        "spec": {"replicas": replicas, "selector": selector, "template": template},
    })
}

/// Gives the ReplicaSet its pods (creating missing ones, deleting extra ones) and its status.
/// Returns the Deployments owning it, and whether to look again (a pod could not be created).
fn sync_replica_set(
    store: &Store,
    resources: &ResourceTable,
    runners: &Runners,
    (namespace, name): &ObjectKey,
) -> (Vec<ObjectKey>, bool) {
    let Some(rs) = store.get_shared(&replica_sets(), namespace, name) else {
        return (Vec::new(), false);
    };
    if is_deleting(&rs) {
        return (Vec::new(), false);
    }
    let mine = owned(store, &rs, &pods());
    let want = replicas(&rs) as usize;
    let mut refused = None;
    for _ in mine.len()..want {
        if let Err(e) = create_pod(store, resources, runners, &rs) {
            tracing::warn!(namespace, replicaset = name, error = %e.message, "creating a pod");
            refused = Some(e.message);
            break;
        }
    }
    let again = refused.is_some();
    if let Ok(pod_info) = info(resources, "", "v1", "pods") {
        for pod in mine.iter().skip(want) {
            let _ = verbs::delete(
                store,
                &pod_info,
                namespace,
                text(pod, "name"),
                &DeleteOptions::default(),
            );
        }
    }
    let count = mine.len().min(want) as i64;
    let ready = mine.iter().take(want).filter(|p| pod_ready(p)).count() as i64;
    let generation = rs["metadata"]["generation"].clone();
    let _ = modify(store, &replica_sets(), namespace, name, |rs| {
        let mut status = json!({
            "replicas": count, "fullyLabeledReplicas": count, "observedGeneration": generation,
        });
        if ready > 0 {
            status["readyReplicas"] = json!(ready);
            status["availableReplicas"] = json!(ready);
        }
        // kube's ReplicaSet controller says why it could not create a pod (e.g. a quota refused
        // it) until a pass creates what it wants; as kube's, it keeps the first failure's words
        // (the pod name of that try included) while the condition stands.
        if let Some(message) = &refused {
            status["conditions"] = match replica_failure(&rs["status"]) {
                Some(failure) => json!([failure]),
                None => json!([{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                    "message": message, "lastTransitionTime": now_timestamp()}]),
            };
        }
        rs["status"] = status;
    });
    (owning_deployments(store, &rs), again)
}

/// The `ReplicaFailure` condition of a ReplicaSet's (or Deployment's) status.
fn replica_failure(status: &Value) -> Option<&Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "ReplicaFailure" && c["status"] == "True")
}

/// The Deployments among an object's owners.
fn owning_deployments(store: &Store, object: &Value) -> Vec<ObjectKey> {
    crate::embedded::store::owner_uids(object)
        .into_iter()
        .filter_map(|uid| store.by_uid(uid))
        .filter(|(location, _)| location.resource == deployments())
        .map(|(location, _)| (location.namespace, location.name))
        .collect()
}

fn pod_ready(pod: &Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
}

fn create_pod(
    store: &Store,
    resources: &ResourceTable,
    runners: &Runners,
    rs: &Value,
) -> Result<(), crate::embedded::status::ApiError> {
    let template = &rs["spec"]["template"];
    let mut metadata = json!({
        "generateName": format!("{}-", text(rs, "name")),
        "labels": template["metadata"]["labels"],
        "ownerReferences": [controller_ref("apps/v1", "ReplicaSet", rs)],
    });
    if template["metadata"]["annotations"].is_object() {
        metadata["annotations"] = template["metadata"]["annotations"].clone();
    }
    let body = json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]});
    let pod_info = info(resources, "", "v1", "pods")?;
    let created = verbs::create(store, &pod_info, text(rs, "namespace"), body, Default::default())?;
    let pod = created.stored();
    let images: Vec<(String, String)> = pod["spec"]["containers"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| {
                    let field = |f: &str| c[f].as_str().unwrap_or("").to_string();
                    (field("name"), field("image"))
                })
                .collect()
        })
        .unwrap_or_default();
    let refused: Vec<bool> = images
        .iter()
        .enumerate()
        .map(|(i, (_, image))| runners.runs_as_root(image) && refuses_root(&pod["spec"], i))
        .collect();
    let faults: Vec<Option<PodFault>> = images.iter().map(|(_, image)| runners.fault_of(image)).collect();
    if faults.contains(&Some(PodFault::Unschedulable)) {
        modify(store, &pods(), text(pod, "namespace"), text(pod, "name"), |pod| {
            pod["status"] = super::unscheduled();
        })?;
        return Ok(());
    }
    let ready = images.iter().all(|(_, image)| runners.is_ready(image))
        && !refused.contains(&true)
        && faults.iter().all(Option::is_none);
    let now = now_timestamp();
    let flag = if ready { "True" } else { "False" };
    let pod_name = text(pod, "name");
    let statuses: Vec<Value> = images
        .iter()
        .zip(refused.iter().zip(&faults))
        .map(|((name, image), (refused, fault))| {
            let mut status = match fault {
                // A Deployment's pod is past its first pull, or has restarted a few times.
                Some(fault) => fault.status(image, pod_name, name, 1),
                // The kubelet's words for an image without USER under runAsNonRoot.
                None if *refused => json!({"state": {"waiting": {"reason": "CreateContainerConfigError",
                    "message": "container has runAsNonRoot and image will run as root"}}, "restartCount": 0}),
                None => json!({"state": {"running": {"startedAt": now}}, "restartCount": 0}),
            };
            let started = !refused && fault.is_none();
            for (field, value) in [
                ("name", json!(name)),
                ("image", json!(image)),
                ("imageID", json!("")),
                ("ready", json!(ready && started)),
                ("started", json!(started)),
            ] {
                status[field] = value;
            }
            status
        })
        .collect();
    let unpulled = faults.contains(&Some(PodFault::Unpullable));
    let conditions: Vec<Value> = ["Initialized", "Ready", "ContainersReady", "PodScheduled"]
        .iter()
        .map(|t| {
            let status = if matches!(*t, "Ready" | "ContainersReady") {
                flag
            } else {
                "True"
            };
            json!({"type": t, "status": status, "lastProbeTime": null, "lastTransitionTime": now})
        })
        .collect();
    modify(store, &pods(), text(pod, "namespace"), text(pod, "name"), |pod| {
        pod["status"] = json!({
            "phase": if unpulled { "Pending" } else { "Running" },
            "startTime": now, "conditions": conditions, "containerStatuses": statuses,
        });
    })?;
    Ok(())
}

/// Whether the kubelet refuses to run container `index` of `pod` from an image whose user is root:
/// `runAsNonRoot` (the container's, else the pod's) with no `runAsUser` to run as instead.
fn refuses_root(pod: &Value, index: usize) -> bool {
    let container = &pod["containers"][index]["securityContext"];
    let field = |name: &str| {
        let own = &container[name];
        if own.is_null() {
            &pod["securityContext"][name]
        } else {
            own
        }
    };
    field("runAsNonRoot") == &Value::Bool(true) && field("runAsUser").as_i64().is_none()
}

/// What a Deployment's ReplicaSets add up to.
struct Rollout {
    /// The current template's ReplicaSet.
    current: String,
    desired: i64,
    total: i64,
    updated: i64,
    ready: i64,
    available: i64,
    /// The current ReplicaSet's `ReplicaFailure`, which kube's Deployment controller copies.
    failure: Option<Value>,
}

impl Rollout {
    fn of(store: &Store, deployment: &Value) -> Rollout {
        let name = text(deployment, "name");
        let current = format!("{name}-{}", template_hash(&deployment["spec"]["template"]));
        let mine = owned(store, deployment, &replica_sets());
        let sum = |field: &str| {
            mine.iter()
                .map(|rs| rs["status"][field].as_i64().unwrap_or(0))
                .sum::<i64>()
        };
        let newest = mine.iter().find(|rs| text(rs, "name") == current);
        let updated = newest.map_or(0, |rs| rs["status"]["replicas"].as_i64().unwrap_or(0));
        let failure = newest.and_then(|rs| replica_failure(&rs["status"]).cloned());
        Rollout {
            current,
            desired: replicas(deployment),
            total: sum("replicas"),
            updated,
            ready: sum("readyReplicas"),
            available: sum("availableReplicas"),
            failure,
        }
    }

    /// The Deployment's status, keeping its conditions' times while they hold.
    fn status(&self, generation: Value, previous: &Value) -> Value {
        let mut status = Map::new();
        status.insert("observedGeneration".into(), generation);
        for (field, value) in [
            ("replicas", self.total),
            ("updatedReplicas", self.updated),
            ("readyReplicas", self.ready),
            ("availableReplicas", self.available),
            ("unavailableReplicas", (self.desired - self.available).max(0)),
        ] {
            if value > 0 {
                status.insert(field.into(), json!(value));
            }
        }
        let is_available = self.available >= self.desired;
        let available = if is_available {
            (
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
            )
        } else {
            (
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
            )
        };
        let progressing_reason = if self.updated >= self.desired && is_available {
            "NewReplicaSetAvailable"
        } else {
            "ReplicaSetUpdated"
        };
        let progressing = format!("ReplicaSet \"{}\" is progressing.", self.current);
        let mut conditions = vec![
            condition(previous, "Available", available.0, available.1, available.2),
            condition(previous, "Progressing", "True", progressing_reason, &progressing),
        ];
        if let Some(failure) = &self.failure {
            let message = failure["message"].as_str().unwrap_or_default();
            conditions.push(condition(previous, "ReplicaFailure", "True", "FailedCreate", message));
        }
        status.insert("conditions".into(), json!(conditions));
        Value::Object(status)
    }
}

fn sync_deployment_status(store: &Store, (namespace, name): &ObjectKey) {
    let Some(deployment) = store.get_shared(&deployments(), namespace, name) else {
        return;
    };
    if is_deleting(&deployment) {
        return;
    }
    let rollout = Rollout::of(store, &deployment);
    let generation = deployment["metadata"]["generation"].clone();
    let _ = modify(store, &deployments(), namespace, name, |deployment| {
        let status = rollout.status(generation, &deployment["status"]["conditions"]);
        deployment["status"] = status;
    });
}

/// A condition, keeping its transition time while its status stays the same.
fn condition(previous: &Value, kind: &str, status: &str, reason: &str, message: &str) -> Value {
    let old = previous
        .as_array()
        .and_then(|all| all.iter().find(|c| c["type"] == kind));
    let now = now_timestamp();
    let keep = |field: &str| {
        old.filter(|c| c["status"] == status && c["reason"] == reason)
            .map_or(json!(now), |c| c[field].clone())
    };
    json!({
        "type": kind, "status": status, "reason": reason, "message": message,
        "lastUpdateTime": keep("lastUpdateTime"), "lastTransitionTime": keep("lastTransitionTime"),
    })
}

#[cfg(test)]
mod tests;
