//! The Job controller, scripted: a Job gets a Pod (`<job>-<5 random>`, labels `controller-uid` and
//! `job-name`, controller owner reference), whose containers are "run" by the [`JobRunner`] registered
//! for their image — init containers first (an init container without a runner succeeds), then the
//! main ones (one without a runner fails with "no runner for image X"). The Pod then ends Succeeded or
//! Failed with terminated container statuses and the scripted logs, and the Job gets `succeeded`/
//! `failed` counts and a `Complete` or `Failed` condition, retrying up to `backoffLimit` and stopping
//! at `activeDeadlineSeconds`. A container whose image [`Runners::fault`] names does not run: an
//! unpullable one leaves the pod Pending with the kubelet's pull errors, a crashing one fails it, an
//! unschedulable one leaves it Pending with the scheduler's `Unschedulable`, one the kubelet cannot
//! create leaves it Pending with `CreateContainerConfigError`. A pod the API server refuses (a
//! used-up quota) is a Warning Event `FailedCreate` on the Job, which stays active with no pod. A
//! pod's emptyDir volumes are directories of this machine while it runs, so its containers hand
//! each other files as real ones do ([`super::JobContext::volume_path`]).
//!
//! A pass looks at the Jobs whose events (or whose Pods' events) arrived since the last one, and at
//! still-running Jobs with a deadline every [`RESCAN`]; each Job's Pods come from the store's owner
//! index, never from a list of every Pod.
//!
//! Simplifications: one pod at a time (`parallelism` is ignored; `completions` are run one after
//! another), `restartPolicy: OnFailure` behaves like `Never` (a new pod per retry), no pod backoff delay.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{
    JobContext, JobOutcome, PodFault, Runners, all_keys, controller_ref, info, is_deleting, key_of, modify, owners_of,
    text,
};
use crate::embedded::discovery::ResourceTable;
use crate::embedded::object_meta::now_timestamp;
use crate::embedded::passes::{self, Controller};
use crate::embedded::store::{GroupResource, ObjectKey, Store, StoreEvent};
use crate::embedded::verbs;

const RESCAN: Duration = Duration::from_millis(200);
const DEFAULT_BACKOFF_LIMIT: i64 = 6;
/// How often a repeated refusal of a Job's pod is counted again on its Event.
const FAILED_CREATE_EVERY: Duration = Duration::from_secs(10);

fn jobs() -> GroupResource {
    GroupResource::new("batch", "jobs")
}

fn pods() -> GroupResource {
    GroupResource::new("", "pods")
}

struct JobController {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
    runners: Arc<Runners>,
    /// Pods (by uid) whose containers are being run now.
    running: Arc<Mutex<HashSet<String>>>,
}

pub async fn run(store: Arc<Store>, resources: Arc<ResourceTable>, runners: Arc<Runners>, shutdown: CancellationToken) {
    let controller = JobController {
        store: store.clone(),
        resources,
        runners,
        running: Arc::default(),
    };
    passes::run(store, shutdown, RESCAN, controller).await;
}

fn phase(pod: &Value) -> &str {
    pod["status"]["phase"].as_str().unwrap_or("Pending")
}

fn is_finished(job: &Value) -> bool {
    job["status"]["conditions"].as_array().is_some_and(|conditions| {
        conditions
            .iter()
            .any(|c| matches!(c["type"].as_str(), Some("Complete" | "Failed")) && c["status"] == "True")
    })
}

fn seconds_since(timestamp: &str) -> Option<i64> {
    let then: jiff::Timestamp = timestamp.parse().ok()?;
    Some(jiff::Timestamp::now().duration_since(then).as_secs())
}

impl Controller for JobController {
    type Key = ObjectKey;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<ObjectKey>) {
        if event.resource == jobs() {
            pending.insert(key_of(event));
        } else if event.resource == pods() {
            pending.extend(owners_of(&self.store, event, &jobs()));
        }
    }

    fn all_keys(&self) -> BTreeSet<ObjectKey> {
        all_keys(&self.store, &jobs())
    }

    fn pass(&mut self, keys: BTreeSet<ObjectKey>) -> BTreeSet<ObjectKey> {
        keys.into_iter()
            .filter(|(namespace, name)| self.look_at(namespace, name) == Again::Later)
            .collect()
    }
}

/// Whether a Job needs another look though no event may come for it.
#[derive(Debug, PartialEq, Eq)]
enum Again {
    Later,
    OnEvent,
}

impl JobController {
    fn look_at(&self, namespace: &str, name: &str) -> Again {
        let Some(job) = self.store.get_shared(&jobs(), namespace, name) else {
            return Again::OnEvent;
        };
        if is_deleting(&job) || is_finished(&job) {
            return Again::OnEvent;
        }
        let mine = self.store.dependents(text(&job, "uid"), Some(&pods()));
        let mine: Vec<&Value> = mine.iter().map(|(_, pod)| pod.as_ref()).collect();
        self.reconcile(&job, &mine)
    }

    /// Runs the Job one step on; [`Again::Later`] while its pod could not be created or its
    /// deadline is still ahead.
    fn reconcile(&self, job: &Value, pods: &[&Value]) -> Again {
        let (namespace, name) = (text(job, "namespace"), text(job, "name"));
        let count = |wanted: &str| pods.iter().filter(|p| phase(p) == wanted).count() as i64;
        let (succeeded, failed) = (count("Succeeded"), count("Failed"));
        let active: Vec<&Value> = pods
            .iter()
            .copied()
            .filter(|p| !matches!(phase(p), "Succeeded" | "Failed") && !is_deleting(p))
            .collect();
        let start_time = job["status"]["startTime"]
            .as_str()
            .map(String::from)
            .unwrap_or_else(now_timestamp);
        let outcome = job_outcome(job, succeeded, failed, &start_time);
        let mut active_count = active.len() as i64;
        // A deadline passes without an event: look again until the Job ends.
        let mut again = if job["spec"]["activeDeadlineSeconds"].is_i64() && outcome.is_none() {
            Again::Later
        } else {
            Again::OnEvent
        };
        if outcome.is_none() && active.is_empty() {
            match self.create_pod(job) {
                Ok(pod) => {
                    active_count = 1;
                    self.launch(job.clone(), pod);
                }
                Err(e) => {
                    tracing::warn!(namespace, job = name, error = %e.message, "creating the Job's pod");
                    self.failed_create(job, &e.message);
                    again = Again::Later;
                }
            }
        }
        if let Some(("Failed", _, _)) = outcome {
            for pod in &active {
                kill(&self.store, pod, outcome.map_or("", |o| o.1));
            }
            active_count = 0;
        }
        let failed_now = failed
            + if outcome.is_some_and(|o| o.0 == "Failed") {
                active.len() as i64
            } else {
                0
            };
        let counts = (active_count, succeeded, failed_now);
        let _ = modify(&self.store, &jobs(), namespace, name, |job| {
            write_status(job, &start_time, counts, outcome)
        });
        again
    }

    /// kube's Job controller records a refused pod create (e.g. a used-up quota) as a Warning Event
    /// `FailedCreate` on the Job; a repeat counts on the same Event, at most every
    /// [`FAILED_CREATE_EVERY`] like kube's event aggregation.
    fn failed_create(&self, job: &Value, message: &str) {
        let Ok(info) = info(&self.resources, "", "v1", "events") else {
            return;
        };
        let (namespace, name, uid) = (text(job, "namespace"), text(job, "name"), text(job, "uid"));
        let event_name = format!("{name}.{}", uid.get(..8).unwrap_or(uid));
        let note = format!("Error creating: {message}");
        let now = now_timestamp();
        let events = GroupResource::new("", "events");
        if let Some(existing) = self.store.get_shared(&events, namespace, &event_name) {
            let recent = existing["lastTimestamp"]
                .as_str()
                .and_then(seconds_since)
                .is_some_and(|s| s < FAILED_CREATE_EVERY.as_secs() as i64);
            if recent && existing["message"] == note.as_str() {
                return;
            }
            let _ = modify(&self.store, &events, namespace, &event_name, |event| {
                event["count"] = json!(event["count"].as_i64().unwrap_or(1) + 1);
                event["message"] = json!(note);
                event["lastTimestamp"] = json!(now);
            });
            return;
        }
        let event = json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": event_name, "namespace": namespace},
            "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "namespace": namespace, "name": name, "uid": uid},
            "reason": "FailedCreate", "message": note, "type": "Warning", "count": 1,
            "source": {"component": "job-controller"}, "reportingComponent": "job-controller",
            "firstTimestamp": now, "lastTimestamp": now,
        });
        let _ = verbs::create(&self.store, &info, namespace, event, Default::default());
    }

    fn create_pod(&self, job: &Value) -> Result<Value, crate::embedded::status::ApiError> {
        let template = &job["spec"]["template"];
        let mut labels = template["metadata"]["labels"].as_object().cloned().unwrap_or_default();
        labels.insert("controller-uid".into(), json!(text(job, "uid")));
        labels.insert("job-name".into(), json!(text(job, "name")));
        let mut metadata = json!({
            "generateName": format!("{}-", text(job, "name")),
            "labels": labels,
            "ownerReferences": [controller_ref("batch/v1", "Job", job)],
        });
        if template["metadata"]["annotations"].is_object() {
            metadata["annotations"] = template["metadata"]["annotations"].clone();
        }
        let body = json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"],
            "status": {"phase": "Pending"},
        });
        let info = info(&self.resources, "", "v1", "pods")?;
        let pod = verbs::create(&self.store, &info, text(job, "namespace"), body, Default::default())?;
        let pod = pod.stored();
        let (pod, _) = modify(&self.store, &pods(), text(pod, "namespace"), text(pod, "name"), |pod| {
            pod["status"] = json!({"phase": "Pending"});
        })?;
        Ok(Arc::unwrap_or_clone(pod))
    }

    /// Runs the pod's containers on a task of its own.
    fn launch(&self, job: Value, pod: Value) {
        let uid = text(&pod, "uid").to_string();
        {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if !running.insert(uid.clone()) {
                return;
            }
        }
        let (store, resources, runners, running) = (
            self.store.clone(),
            self.resources.clone(),
            self.runners.clone(),
            self.running.clone(),
        );
        tokio::spawn(async move {
            run_pod(&store, &resources, &runners, job, pod).await;
            running.lock().unwrap_or_else(|p| p.into_inner()).remove(&uid);
        });
    }
}

/// How the Job ended, if it did: (condition type, reason, message).
fn job_outcome(
    job: &Value,
    succeeded: i64,
    failed: i64,
    start_time: &str,
) -> Option<(&'static str, &'static str, &'static str)> {
    let completions = job["spec"]["completions"].as_i64().unwrap_or(1).max(1);
    let backoff_limit = job["spec"]["backoffLimit"].as_i64().unwrap_or(DEFAULT_BACKOFF_LIMIT);
    let past_deadline = job["spec"]["activeDeadlineSeconds"]
        .as_i64()
        .is_some_and(|deadline| seconds_since(start_time).is_some_and(|elapsed| elapsed >= deadline));
    if succeeded >= completions {
        Some(("Complete", "", ""))
    } else if failed > backoff_limit {
        Some((
            "Failed",
            "BackoffLimitExceeded",
            "Job has reached the specified backoff limit",
        ))
    } else if past_deadline {
        Some((
            "Failed",
            "DeadlineExceeded",
            "Job was active longer than specified deadline",
        ))
    } else {
        None
    }
}

/// Writes the Job's status: its start, (active, succeeded, failed) counts and its outcome.
fn write_status(
    job: &mut Value,
    start_time: &str,
    (active, succeeded, failed): (i64, i64, i64),
    outcome: Option<(&str, &str, &str)>,
) {
    let status = &mut job["status"];
    if !status.is_object() {
        *status = json!({});
    }
    status["startTime"] = json!(start_time);
    set_count(status, "active", active);
    set_count(status, "succeeded", succeeded);
    set_count(status, "failed", failed);
    if let Some((kind, reason, message)) = outcome {
        let now = now_timestamp();
        let mut condition = json!({
            "type": kind, "status": "True", "lastProbeTime": now, "lastTransitionTime": now,
        });
        if !reason.is_empty() {
            condition["reason"] = json!(reason);
            condition["message"] = json!(message);
        }
        status["conditions"] = json!([condition]);
        if kind == "Complete" {
            status["completionTime"] = json!(now);
        }
    }
}

fn set_count(status: &mut Value, field: &str, count: i64) {
    if count > 0 {
        status[field] = json!(count);
    } else if let Some(map) = status.as_object_mut() {
        map.remove(field);
    }
}

/// Ends a still-running pod as Failed (deadline or a failed Job).
fn kill(store: &Store, pod: &Value, reason: &str) {
    let _ = modify(store, &pods(), text(pod, "namespace"), text(pod, "name"), |pod| {
        if matches!(phase(pod), "Succeeded" | "Failed") {
            return;
        }
        pod["status"]["phase"] = json!("Failed");
        pod["status"]["reason"] = json!(reason);
    });
}

struct Container {
    name: String,
    image: String,
    init: bool,
    spec: Value,
}

fn containers(pod: &Value) -> Vec<Container> {
    let list = |field: &str, init: bool| -> Vec<Container> {
        pod["spec"][field]
            .as_array()
            .map(|all| {
                all.iter()
                    .map(|c| Container {
                        name: c["name"].as_str().unwrap_or("").to_string(),
                        image: c["image"].as_str().unwrap_or("").to_string(),
                        init,
                        spec: c.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut all = list("initContainers", true);
    all.extend(list("containers", false));
    all
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// A container's `env` entries with literal values (no `valueFrom`), by name.
fn literal_env(env: &Value) -> BTreeMap<String, String> {
    env.as_array()
        .map(|env| {
            env.iter()
                .filter_map(|e| Some((e["name"].as_str()?.to_string(), e["value"].as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The statuses of a pod's (non-init) containers, all running since `started`.
fn running_statuses(pod: &Value, started: &str) -> Vec<Value> {
    containers(pod)
        .iter()
        .filter(|c| !c.init)
        .map(|c| {
            json!({
                "name": c.name, "image": c.image, "imageID": "", "ready": true, "started": true,
                "restartCount": 0, "state": {"running": {"startedAt": started}},
            })
        })
        .collect()
}

/// A pod whose container cannot be pulled (or created) stays Pending: that container waits with the
/// kubelet's `ErrImagePull`, then `ImagePullBackOff` (or `CreateContainerConfigError`), and those
/// after it wait on it (`PodInitializing` behind an init container, `ContainerCreating` otherwise).
/// False when every container can start.
async fn stay_unpulled(store: &Store, runners: &Runners, pod: &Value) -> bool {
    let all = containers(pod);
    let stuck_fault = |c: &Container| {
        runners
            .fault_of(&c.image)
            .filter(|f| matches!(f, PodFault::Unpullable | PodFault::ConfigError { .. }))
    };
    let Some((stuck, fault)) = all.iter().enumerate().find_map(|(i, c)| Some((i, stuck_fault(c)?))) else {
        return false;
    };
    let (namespace, name) = (text(pod, "namespace"), text(pod, "name"));
    for attempt in 0..2 {
        let status = |i: usize, c: &Container| {
            let mut status = if i == stuck {
                fault.status(&c.image, name, &c.name, attempt)
            } else {
                let waiting = if all[stuck].init {
                    "PodInitializing"
                } else {
                    "ContainerCreating"
                };
                json!({"state": {"waiting": {"reason": waiting}}, "restartCount": 0})
            };
            status["name"] = json!(c.name);
            status["image"] = json!(c.image);
            status["imageID"] = json!("");
            status["ready"] = json!(false);
            status
        };
        let statuses = |init: bool| -> Vec<Value> {
            all.iter()
                .enumerate()
                .filter(|(i, c)| c.init == init && (!init || *i <= stuck))
                .map(|(i, c)| status(i, c))
                .collect()
        };
        let (init_statuses, main_statuses) = (statuses(true), statuses(false));
        let _ = modify(store, &pods(), namespace, name, |pod| {
            if phase(pod) != "Pending" {
                return;
            }
            if !init_statuses.is_empty() {
                pod["status"]["initContainerStatuses"] = json!(init_statuses);
            }
            pod["status"]["containerStatuses"] = json!(main_statuses);
        });
        // The kubelet backs off after the first failed pull.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    true
}

async fn run_pod(store: &Arc<Store>, resources: &Arc<ResourceTable>, runners: &Runners, job: Value, pod: Value) {
    let unschedulable = |c: &Container| runners.fault_of(&c.image) == Some(PodFault::Unschedulable);
    if containers(&pod).iter().any(unschedulable) {
        // No node takes it: it stays Pending until the Job's deadline ends it.
        let _ = modify(store, &pods(), text(&pod, "namespace"), text(&pod, "name"), |pod| {
            if phase(pod) == "Pending" {
                pod["status"] = super::unscheduled();
            }
        });
        return;
    }
    if stay_unpulled(store, runners, &pod).await {
        return;
    }
    let (namespace, name) = (text(&pod, "namespace").to_string(), text(&pod, "name").to_string());
    let started = now_timestamp();
    let running = running_statuses(&pod, &started);
    let _ = modify(store, &pods(), &namespace, &name, |pod| {
        if phase(pod) == "Pending" {
            pod["status"]["phase"] = json!("Running");
            pod["status"]["startTime"] = json!(started);
            pod["status"]["containerStatuses"] = json!(running);
        }
    });
    let mut init_statuses = Vec::new();
    let mut statuses = Vec::new();
    let mut failed = false;
    let volumes = Arc::new(super::PodVolumes::new(text(&pod, "uid")));
    for container in containers(&pod) {
        if failed {
            break;
        }
        let ctx = JobContext {
            job: job.clone(),
            pod: pod.clone(),
            namespace: namespace.clone(),
            container: container.name.clone(),
            init_container: container.init,
            image: container.image.clone(),
            command: strings(&container.spec["command"]),
            args: strings(&container.spec["args"]),
            env: literal_env(&container.spec["env"]),
            store: store.clone(),
            resources: resources.clone(),
            volumes: volumes.clone(),
        };
        let runner = match runners.runner_for(&container.image) {
            Some(runner) => Some(runner),
            None if container.init => None,
            None => runners.default_runner(),
        };
        let crash = match runners.fault_of(&container.image) {
            Some(PodFault::CrashLoop { exit_code, reason }) => Some((exit_code, reason)),
            _ => None,
        };
        let outcome = match runner {
            // A Job's pod does not restart: the crash ends it (`restartPolicy: Never`).
            _ if crash.is_some() => JobOutcome::failure(crash.map_or(1, |c| c.0), ""),
            Some(runner) => tokio::task::spawn_blocking(move || runner.run(&ctx))
                .await
                .unwrap_or_else(|e| JobOutcome::failure(2, format!("the runner for this image panicked: {e}\n"))),
            None if container.init => JobOutcome::success(""),
            None => JobOutcome::failure(1, format!("no runner for image {}\n", container.image)),
        };
        tokio::time::sleep(outcome.delay).await;
        store.set_pod_log(&namespace, &name, &container.name, &outcome.log);
        failed = outcome.exit_code != 0;
        let finished = now_timestamp();
        let status = json!({
            "name": container.name, "image": container.image, "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {
                "exitCode": outcome.exit_code,
                "reason": crash.map_or(if failed { "Error" } else { "Completed" }, |c| c.1),
                "startedAt": started, "finishedAt": finished,
            }},
        });
        if container.init {
            init_statuses.push(status);
        } else {
            statuses.push(status);
        }
    }
    let _ = modify(store, &pods(), &namespace, &name, |pod| {
        if matches!(phase(pod), "Succeeded" | "Failed") {
            return;
        }
        pod["status"]["phase"] = json!(if failed { "Failed" } else { "Succeeded" });
        if !init_statuses.is_empty() {
            pod["status"]["initContainerStatuses"] = json!(init_statuses);
        }
        pod["status"]["containerStatuses"] = json!(statuses);
    });
}

#[cfg(test)]
mod tests;
