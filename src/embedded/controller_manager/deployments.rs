//! The Deployment and ReplicaSet controllers, simplified: a Deployment's current template gets a
//! ReplicaSet `<deployment>-<pod-template-hash>` with all the replicas at once (older ReplicaSets are
//! scaled to zero at the same moment), and each ReplicaSet keeps its Pods, which are Running and Ready
//! at once unless [`Runners::never_ready`] names their image. Deployment status then reports
//! `replicas`, `updatedReplicas`, `readyReplicas`, `availableReplicas` and `Available`/`Progressing`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::{Runners, controller_ref, info, is_deleting, modify, owned_by, run_loop, text};
use crate::embedded::discovery::ResourceTable;
use crate::embedded::store::{GroupResource, Store};
use crate::embedded::verbs::{self, DeleteOptions, now_timestamp};

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
    let pass_store = store.clone();
    run_loop(
        store,
        shutdown,
        RESCAN,
        &["deployments", "replicasets", "pods"],
        move || {
            sync_deployments(&pass_store, &resources);
            sync_replica_sets(&pass_store, &resources, &runners);
            sync_deployment_status(&pass_store);
        },
    )
    .await;
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

fn owned<'a>(all: &'a [Value], owner: &Value) -> Vec<&'a Value> {
    all.iter()
        .filter(|o| owned_by(o, text(owner, "uid")) && !is_deleting(o))
        .collect()
}

fn sync_deployments(store: &Store, resources: &ResourceTable) {
    let all_sets = store.list(&replica_sets(), None).0;
    for deployment in store.list(&deployments(), None).0 {
        if is_deleting(&deployment) {
            continue;
        }
        let (namespace, name) = (text(&deployment, "namespace"), text(&deployment, "name"));
        let hash = template_hash(&deployment["spec"]["template"]);
        let current = format!("{name}-{hash}");
        let desired = replicas(&deployment);
        let mine = owned(&all_sets, &deployment);
        if !mine.iter().any(|rs| text(rs, "name") == current) {
            let revision = mine.iter().filter_map(|rs| revision(rs)).max().unwrap_or(0) + 1;
            let rs = new_replica_set(&deployment, &current, &hash, desired, revision);
            let created = info(resources, "apps", "v1", "replicasets")
                .and_then(|info| verbs::create(store, &info, namespace, rs, Default::default()));
            if let Err(e) = created {
                tracing::warn!(namespace, deployment = name, error = %e.message, "creating the ReplicaSet");
            }
        }
        for rs in mine {
            let want = if text(rs, "name") == current { desired } else { 0 };
            let _ = modify(store, &replica_sets(), namespace, text(rs, "name"), |rs| {
                if replicas(rs) != want {
                    rs["spec"]["replicas"] = json!(want);
                    let generation = rs["metadata"]["generation"].as_i64().unwrap_or(1);
                    rs["metadata"]["generation"] = json!(generation + 1);
                }
            });
        }
    }
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

fn sync_replica_sets(store: &Store, resources: &ResourceTable, runners: &Runners) {
    let all_pods = store.list(&pods(), None).0;
    for rs in store.list(&replica_sets(), None).0 {
        if is_deleting(&rs) {
            continue;
        }
        let (namespace, name) = (text(&rs, "namespace"), text(&rs, "name"));
        let mine = owned(&all_pods, &rs);
        let want = replicas(&rs) as usize;
        for _ in mine.len()..want {
            if let Err(e) = create_pod(store, resources, runners, &rs) {
                tracing::warn!(namespace, replicaset = name, error = %e.message, "creating a pod");
                break;
            }
        }
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
            rs["status"] = status;
        });
    }
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
    let pod = verbs::create(
        store,
        &info(resources, "", "v1", "pods")?,
        text(rs, "namespace"),
        body,
        Default::default(),
    )?;
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
    let ready = images.iter().all(|(_, image)| runners.is_ready(image));
    let now = now_timestamp();
    let flag = if ready { "True" } else { "False" };
    let statuses: Vec<Value> = images
        .iter()
        .map(|(name, image)| {
            json!({
                "name": name, "image": image, "imageID": "", "ready": ready, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            })
        })
        .collect();
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
    modify(store, &pods(), text(&pod, "namespace"), text(&pod, "name"), |pod| {
        pod["status"] = json!({
            "phase": "Running", "startTime": now, "conditions": conditions, "containerStatuses": statuses,
        });
    })?;
    Ok(())
}

fn sync_deployment_status(store: &Store) {
    let all_sets = store.list(&replica_sets(), None).0;
    for deployment in store.list(&deployments(), None).0 {
        if is_deleting(&deployment) {
            continue;
        }
        let (namespace, name) = (text(&deployment, "namespace"), text(&deployment, "name"));
        let current = format!("{name}-{}", template_hash(&deployment["spec"]["template"]));
        let mine = owned(&all_sets, &deployment);
        let sum = |field: &str| {
            mine.iter()
                .map(|rs| rs["status"][field].as_i64().unwrap_or(0))
                .sum::<i64>()
        };
        let (total, ready, available) = (sum("replicas"), sum("readyReplicas"), sum("availableReplicas"));
        let updated = mine
            .iter()
            .find(|rs| text(rs, "name") == current)
            .map_or(0, |rs| rs["status"]["replicas"].as_i64().unwrap_or(0));
        let desired = replicas(&deployment);
        let is_available = available >= desired;
        let generation = deployment["metadata"]["generation"].clone();
        let _ = modify(store, &deployments(), namespace, name, |deployment| {
            let previous = deployment["status"]["conditions"].clone();
            let mut status = Map::new();
            status.insert("observedGeneration".into(), generation);
            for (field, value) in [
                ("replicas", total),
                ("updatedReplicas", updated),
                ("readyReplicas", ready),
                ("availableReplicas", available),
                ("unavailableReplicas", (desired - available).max(0)),
            ] {
                if value > 0 {
                    status.insert(field.into(), json!(value));
                }
            }
            let available_condition = if is_available {
                (
                    "True",
                    "MinimumReplicasAvailable",
                    "Deployment has minimum availability.".to_string(),
                )
            } else {
                (
                    "False",
                    "MinimumReplicasUnavailable",
                    "Deployment does not have minimum availability.".to_string(),
                )
            };
            let progressing = (
                "True",
                if updated >= desired && is_available {
                    "NewReplicaSetAvailable"
                } else {
                    "ReplicaSetUpdated"
                },
                format!("ReplicaSet \"{current}\" is progressing."),
            );
            let conditions: Vec<Value> = [("Available", available_condition), ("Progressing", progressing)]
                .into_iter()
                .map(|(kind, (flag, reason, message))| condition(&previous, kind, flag, reason, &message))
                .collect();
            status.insert("conditions".into(), json!(conditions));
            deployment["status"] = Value::Object(status);
        });
    }
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
mod tests {
    use super::*;

    #[test]
    fn template_hash_is_stable_safe_and_changes_with_the_template() {
        let a = json!({"spec": {"containers": [{"name": "c", "image": "x:1"}]}});
        let b = json!({"spec": {"containers": [{"name": "c", "image": "x:2"}]}});
        assert_eq!(template_hash(&a), template_hash(&a.clone()));
        assert_ne!(template_hash(&a), template_hash(&b));
        assert!(
            template_hash(&a)
                .chars()
                .all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c))
        );
    }
}
