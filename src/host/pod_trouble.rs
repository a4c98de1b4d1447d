//! What the kubelet says about a pod stackd runs for a tenant (an install Job's, a stack
//! controller's, a pool installer's) that does not start or keeps stopping, in words the tenant can
//! act on. Only the fields a kubelet or scheduler sets for that purpose are read (a container's
//! `state.waiting` / `lastState.terminated` reason, message and exit code, the `PodScheduled`
//! condition): never a pod's spec, env or args, so no host secret can reach the tenant. What comes
//! from the host is cut to [`MAX_POD_MESSAGE_BYTES`] before it is put in a message.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ContainerStatus, Event, Pod};
use kube::api::ListParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};

use crate::host::labels::TENANT_LABEL;
use crate::host::names::label_value;
use crate::runtime::text_bounds::fit_text;

/// The selector of the pods stackd's Jobs and Deployments make for `tenant` in its host namespace:
/// every pod template stackd writes carries the tenant label (not always stackd's own).
pub fn pods_selector(tenant: &str) -> String {
    format!("{TENANT_LABEL}={}", label_value(tenant))
}

/// The most of one kubelet message (or reason) stackd passes on.
pub const MAX_POD_MESSAGE_BYTES: usize = 512;

/// Waiting reasons of a container on its way to start, not a trouble.
const STARTING: &[&str] = &["ContainerCreating", "PodInitializing"];

/// What kind of trouble the kubelet reports, for what the user should do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TroubleKind {
    /// `ErrImagePull`, `ImagePullBackOff`, `InvalidImageName`, `ErrImageNeverPull`.
    Pull,
    /// `CreateContainerConfigError`, `CreateContainerError`, `RunContainerError`.
    Config,
    /// `CrashLoopBackOff`, or a container terminated with an error.
    Crash,
    /// The last run was killed for its memory (`OOMKilled`).
    OutOfMemory,
    /// The scheduler cannot place the pod (`Unschedulable`).
    Unschedulable,
    /// Any other waiting reason.
    Other,
}

/// One pod's trouble as the kubelet (or scheduler) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTrouble {
    pub kind: TroubleKind,
    pub pod: String,
    pub container: Option<String>,
    /// The kubelet's reason, e.g. `ImagePullBackOff` (bounded).
    pub reason: String,
    /// The kubelet's message (bounded; may be empty).
    pub message: String,
    /// The exit code of the container's last run, when it ran.
    pub last_exit_code: Option<i32>,
}

impl PodTrouble {
    /// The first trouble of `pod`: its init containers in order, then its containers, then its
    /// scheduling; none while it is starting, running or finished.
    pub fn of(pod: &Pod) -> Option<PodTrouble> {
        let status = pod.status.as_ref()?;
        let statuses = status.init_container_statuses.iter().flatten();
        let statuses = statuses.chain(status.container_statuses.iter().flatten());
        if let Some(trouble) = statuses.filter_map(|c| container_trouble(&pod.name_any(), c)).next() {
            return Some(trouble);
        }
        let unschedulable = status.conditions.iter().flatten().find(|c| {
            c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
        })?;
        Some(PodTrouble {
            kind: TroubleKind::Unschedulable,
            pod: pod.name_any(),
            container: None,
            reason: "Unschedulable".into(),
            message: bounded(unschedulable.message.as_deref().unwrap_or_default()),
            last_exit_code: None,
        })
    }

    /// The first container of an ended `pod` that failed: its reason (`Error`, `OOMKilled`) and
    /// exit code.
    pub fn failed_run(pod: &Pod) -> Option<PodTrouble> {
        let status = pod.status.as_ref()?;
        let statuses = status.init_container_statuses.iter().flatten();
        let mut statuses = statuses.chain(status.container_statuses.iter().flatten());
        statuses.find_map(|container| {
            let ended = container.state.as_ref()?.terminated.as_ref()?;
            if ended.exit_code == 0 {
                return None;
            }
            let reason = ended.reason.as_deref().unwrap_or("Error");
            Some(PodTrouble {
                kind: if reason == "OOMKilled" {
                    TroubleKind::OutOfMemory
                } else {
                    TroubleKind::Crash
                },
                pod: pod.name_any(),
                container: Some(bounded(&container.name)),
                reason: bounded(reason),
                message: bounded(ended.message.as_deref().unwrap_or_default()),
                last_exit_code: Some(ended.exit_code),
            })
        })
    }

    /// What to do, in the words of the object the pod runs for: `image_field` names where the
    /// tenant set the image (e.g. `spec.package`).
    pub fn advice(&self, image_field: &str) -> String {
        match self.kind {
            TroubleKind::Pull => format!("the image cannot be pulled: check {image_field} and its imagePullSecrets"),
            TroubleKind::Config if self.message.contains("runAsNonRoot") => {
                "the image runs as root, which runAsNonRoot forbids: build it with a numeric non-root USER, or set runAsUser in the pod's securityContext".into()
            }
            TroubleKind::Config => {
                "the container cannot be created as specified: fix what the kubelet names (e.g. an image that runs as root under runAsNonRoot needs a USER)".into()
            }
            TroubleKind::Crash => "the container keeps exiting: check its log and its configuration".into(),
            TroubleKind::OutOfMemory => "the container ran out of memory: give it a larger memory limit".into(),
            TroubleKind::Unschedulable => {
                "the pod cannot be scheduled: the host has no node with room for it (ask the platform team)".into()
            }
            TroubleKind::Other => "the container does not start".into(),
        }
    }

    /// What the kubelet said, e.g. `container unpack-package: ImagePullBackOff: Back-off pulling
    /// image "x"` (with the last exit code when the container ran).
    pub fn said(&self) -> String {
        let mut said = match &self.container {
            Some(container) => format!("pod {} container {container}: {}", self.pod, self.reason),
            None => format!("pod {}: {}", self.pod, self.reason),
        };
        if let Some(code) = self.last_exit_code {
            said.push_str(&format!(" (last exit code {code})"));
        }
        if !self.message.is_empty() {
            said.push_str(": ");
            said.push_str(&self.message);
        }
        said
    }

    /// Advice first, then what the kubelet said.
    pub fn describe(&self, image_field: &str) -> String {
        format!("{} ({})", self.advice(image_field), self.said())
    }
}

/// True when `pod` is controlled by the Job with `job_uid` (a label alone proves nothing: whoever
/// may create pods in the host namespace can set it).
pub fn made_by_job(pod: &Pod, job_uid: &str) -> bool {
    pod.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.kind == "Job" && o.api_version == "batch/v1" && o.uid == job_uid)
}

/// The trouble of the newest unfinished pod `job` made, from a pod cache.
pub fn of_job(pods: &Store<Pod>, job: &Job) -> Option<PodTrouble> {
    let uid = job.metadata.uid.as_deref()?;
    let pods = pods.state();
    let finished = |pod: &Pod| {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        matches!(phase, Some("Succeeded" | "Failed"))
    };
    let newest = pods
        .iter()
        .filter(|pod| made_by_job(pod, uid) && !finished(pod))
        .max_by_key(|pod| pod.metadata.creation_timestamp.clone().map(|t| t.0))?;
    PodTrouble::of(newest)
}

/// How a failed Job's newest pod ended, as the cache shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEnd {
    /// The cache does not show that pod ended yet: its event comes.
    Pending,
    /// What the kubelet said of its failed container, if anything (a pod gone says nothing).
    Ended(Option<PodTrouble>),
}

/// How long after a Job ended its pod is waited for in the pod cache: its watch lags the Job's.
pub const POD_CACHE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether `job` reached its Failed or Complete condition less than `grace` ago.
fn ended_within(job: &Job, grace: std::time::Duration) -> bool {
    let conditions = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    conditions
        .iter()
        .filter(|c| matches!(c.type_.as_str(), "Failed" | "Complete") && c.status == "True")
        .filter_map(|c| c.last_transition_time.as_ref())
        .any(|at| {
            let age = jiff::Timestamp::now().duration_since(at.0);
            age < jiff::SignedDuration::try_from(grace).unwrap_or(jiff::SignedDuration::MAX)
        })
}

/// How the failed `job` ended: the exit code (or OOM kill) of its newest pod's failed container.
pub fn end_of_job(pods: &Store<Pod>, job: &Job) -> JobEnd {
    let Some(uid) = job.metadata.uid.as_deref() else {
        return JobEnd::Ended(None);
    };
    let pods = pods.state();
    let Some(newest) = pods
        .iter()
        .filter(|pod| made_by_job(pod, uid))
        .max_by_key(|pod| pod.metadata.creation_timestamp.clone().map(|t| t.0))
    else {
        // The Job's watch may be ahead of the Pods': a Job that ended lately whose pod is not
        // cached yet is waited for (its event wakes the caller), one that ended long ago lost it.
        return if ended_within(job, POD_CACHE_GRACE) {
            JobEnd::Pending
        } else {
            JobEnd::Ended(None)
        };
    };
    let phase = newest.status.as_ref().and_then(|s| s.phase.as_deref());
    if !matches!(phase, Some("Succeeded" | "Failed")) {
        return JobEnd::Pending;
    }
    JobEnd::Ended(PodTrouble::failed_run(newest))
}

/// How long a Job may have no pod before the host's Events on it are read: a pod is created in
/// moments unless the host refuses it.
const NO_POD_GRACE: Duration = Duration::from_secs(2);
/// How often the Events of a Job that still has no pod are read again.
pub const REFUSAL_LOOK_EVERY: Duration = Duration::from_secs(15);
/// The most Events of one Job read at a look.
const REFUSAL_EVENTS: u32 = 5;

/// Whether the host refuses to create a Job's pod, as its Job controller said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodRefusal {
    /// The Job has a pod (the kubelet's words are [`of_job`]'s).
    HasPod,
    /// The Job is too young to tell: looked at again after this.
    TooSoon(Duration),
    /// No pod and no refusal said yet: looked at again after [`REFUSAL_LOOK_EVERY`].
    Unsaid,
    /// The host refuses it: what to do, then its words (bounded).
    Refused(String),
}

/// Whether the host refuses to create `job`'s pod (an exceeded quota, an admission webhook): the
/// Job controller's newest Warning Event `FailedCreate` on the Job, read from the host only when
/// the pod cache shows the Job has had no pod for [`NO_POD_GRACE`], at most [`REFUSAL_EVENTS`] of
/// them (field-selected by the Job's uid, so another object's Events cannot pose as its).
pub async fn refusal_of_job(host: &Client, pods: &Store<Pod>, job: &Job) -> Result<PodRefusal, kube::Error> {
    let (Some(uid), Some(namespace)) = (job.metadata.uid.as_deref(), job.metadata.namespace.as_deref()) else {
        return Ok(PodRefusal::Unsaid);
    };
    if pods.state().iter().any(|pod| made_by_job(pod, uid)) {
        return Ok(PodRefusal::HasPod);
    }
    let created = job.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let age = created.map_or(Duration::MAX, |created| {
        Duration::try_from(created.duration_until(jiff::Timestamp::now())).unwrap_or_default()
    });
    if age < NO_POD_GRACE {
        return Ok(PodRefusal::TooSoon(NO_POD_GRACE - age));
    }
    let events: Api<Event> = Api::namespaced(host.clone(), namespace);
    let params = ListParams::default()
        .fields(&format!("involvedObject.uid={uid},reason=FailedCreate"))
        .limit(REFUSAL_EVENTS);
    let listed = events.list(&params).await?;
    let newest = listed
        .items
        .iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .max_by_key(|e| e.last_timestamp.as_ref().map(|t| t.0));
    let Some(said) = newest.and_then(|e| e.message.as_deref()) else {
        return Ok(PodRefusal::Unsaid);
    };
    let advice = if said.contains("exceeded quota") {
        "the tenant's host quota is used up: remove workloads (Stacks, installs, clusters being installed) or ask the operator to raise it"
    } else {
        "ask the operator what the host refuses"
    };
    let said = without_pod_names(&bounded(said), &job.name_any());
    Ok(PodRefusal::Refused(format!("{advice} ({said})")))
}

/// `said` with the names of `job`'s pods (the Job's name, `-` and a random suffix, new at each of
/// the Job controller's tries) as `job-…`: the same refusal reads the same, and is told once.
fn without_pod_names(said: &str, job: &str) -> String {
    let prefix = format!("{job}-");
    let mut out = String::with_capacity(said.len());
    let mut rest = said;
    while let Some(at) = rest.find(&prefix) {
        let after = &rest[at + prefix.len()..];
        let suffix = after.bytes().take_while(u8::is_ascii_alphanumeric).count();
        out.push_str(&rest[..at + prefix.len()]);
        if suffix > 0 {
            out.push('…');
        }
        rest = &after[suffix..];
    }
    out.push_str(rest);
    out
}

/// The cached Job that controls `pod`, for waking the Job's tenant object on a pod's event.
pub fn job_of(jobs: &Store<Job>, pod: &Pod) -> Option<Arc<Job>> {
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Job" && o.api_version == "batch/v1")?;
    let job = jobs.get(&ObjectRef::new(&owner.name).within(&pod.namespace().unwrap_or_default()))?;
    (job.metadata.uid.as_deref() == Some(owner.uid.as_str())).then_some(job)
}

fn container_trouble(pod: &str, container: &ContainerStatus) -> Option<PodTrouble> {
    let state = container.state.as_ref()?;
    let last = container.last_state.as_ref().and_then(|last| last.terminated.as_ref());
    let trouble = |kind, reason: &str, message: Option<&str>, last_exit_code| PodTrouble {
        kind,
        pod: pod.to_string(),
        container: Some(bounded(&container.name)),
        reason: bounded(reason),
        message: bounded(message.unwrap_or_default()),
        last_exit_code,
    };
    if let Some(waiting) = &state.waiting {
        let reason = waiting.reason.as_deref().unwrap_or_default();
        if reason.is_empty() || STARTING.contains(&reason) {
            return None;
        }
        let out_of_memory = last.is_some_and(|t| t.reason.as_deref() == Some("OOMKilled"));
        let kind = match reason {
            "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull" => TroubleKind::Pull,
            "CreateContainerConfigError" | "CreateContainerError" | "RunContainerError" => TroubleKind::Config,
            "CrashLoopBackOff" if out_of_memory => TroubleKind::OutOfMemory,
            "CrashLoopBackOff" => TroubleKind::Crash,
            _ => TroubleKind::Other,
        };
        let reason = if out_of_memory {
            format!("{reason}, last terminated OOMKilled")
        } else {
            reason.to_string()
        };
        return Some(trouble(
            kind,
            &reason,
            waiting.message.as_deref(),
            last.map(|t| t.exit_code),
        ));
    }
    let terminated = state.terminated.as_ref()?;
    match terminated.reason.as_deref() {
        Some("OOMKilled") => Some(trouble(
            TroubleKind::OutOfMemory,
            "OOMKilled",
            terminated.message.as_deref(),
            Some(terminated.exit_code),
        )),
        _ => None,
    }
}

/// Host text cut to [`MAX_POD_MESSAGE_BYTES`] before it goes anywhere.
pub fn bounded(text: &str) -> String {
    // Copied no further than one character past the bound: enough for `fit_text` to see the cut.
    let end = text
        .char_indices()
        .map(|(at, _)| at)
        .find(|&at| at > MAX_POD_MESSAGE_BYTES)
        .unwrap_or(text.len());
    fit_text(text[..end].to_string(), MAX_POD_MESSAGE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
    }

    #[test]
    fn a_refusal_reads_the_same_whichever_pod_the_job_controller_tried() {
        let said = |pod: &str| {
            format!("Error creating: pods \"x.x-install-0-{pod}\" is forbidden: exceeded quota: q, requested: pods=1")
        };
        let stable = without_pod_names(&said("fkfv2"), "x.x-install-0");
        assert_eq!(stable, without_pod_names(&said("9qwd7"), "x.x-install-0"));
        assert_eq!(
            stable,
            "Error creating: pods \"x.x-install-0-…\" is forbidden: exceeded quota: q, requested: pods=1"
        );
        assert_eq!(without_pod_names("job- and job-", "job"), "job- and job-");
    }

    #[test]
    fn a_pull_back_off_of_an_init_container_is_a_pull_trouble() {
        let pod = pod(json!({"phase": "Pending",
            "initContainerStatuses": [{"name": "package", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}}],
            "containerStatuses": [{"name": "unpack", "image": "s", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "PodInitializing"}}}]}));
        let trouble = PodTrouble::of(&pod).unwrap();
        assert_eq!(trouble.kind, TroubleKind::Pull);
        assert_eq!(
            trouble.describe("spec.package"),
            "the image cannot be pulled: check spec.package and its imagePullSecrets (pod p container package: ImagePullBackOff: Back-off pulling image \"x\")"
        );
    }

    #[test]
    fn a_crash_loop_says_its_last_exit_code_and_an_oom_kill_is_named() {
        let crashing = |reason: &str| {
            pod(
                json!({"containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                "lastState": {"terminated": {"exitCode": 137, "reason": reason}}}]}),
            )
        };
        let crash = PodTrouble::of(&crashing("Error")).unwrap();
        assert_eq!((crash.kind, crash.last_exit_code), (TroubleKind::Crash, Some(137)));
        assert!(crash.said().contains("CrashLoopBackOff (last exit code 137)"));
        let oom = PodTrouble::of(&crashing("OOMKilled")).unwrap();
        assert_eq!(oom.kind, TroubleKind::OutOfMemory);
        assert!(oom.said().contains("OOMKilled"), "{}", oom.said());
    }

    #[test]
    fn a_starting_or_running_pod_has_no_trouble_and_host_text_is_bounded() {
        let starting = pod(
            json!({"containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
        );
        assert_eq!(PodTrouble::of(&starting), None);
        let long = "é".repeat(4096);
        let unschedulable = pod(json!({"conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": long}]}));
        let trouble = PodTrouble::of(&unschedulable).unwrap();
        assert_eq!(trouble.kind, TroubleKind::Unschedulable);
        assert!(trouble.message.len() <= MAX_POD_MESSAGE_BYTES);
    }

    #[test]
    fn a_job_that_failed_lately_waits_for_its_pod_in_the_cache_and_one_long_failed_does_not() {
        let failed_at = |at: jiff::Timestamp| -> Job {
            serde_json::from_value(json!({"metadata": {"name": "j", "uid": "u"}, "status": {"conditions": [
                {"type": "Failed", "status": "True", "lastTransitionTime": at.to_string()}]}}))
            .unwrap()
        };
        let (no_pods, _writer) = kube::runtime::reflector::store::<Pod>();
        let lately = failed_at(jiff::Timestamp::now());
        assert_eq!(
            end_of_job(&no_pods, &lately),
            JobEnd::Pending,
            "its pod may not be cached yet"
        );
        let long_ago = failed_at(jiff::Timestamp::now() - jiff::SignedDuration::from_secs(60));
        assert_eq!(end_of_job(&no_pods, &long_ago), JobEnd::Ended(None), "its pod is gone");
    }
}
