//! What one reconcile of a Stack comes to (pure): the [`Outcome`] its status reports, the
//! [`Notes`] published as Events at its end, and [`Step`], how a step hands a value forward or stops
//! the reconcile with an outcome ("still waiting", "refused") that is no error.

use std::ops::ControlFlow;

use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::events::EventType;

use super::deployment;
use crate::api::common::HostObjectRef;
use crate::host::apply::HostWriteError;
use crate::host::pod_trouble::{self, PodTrouble, TroubleKind};

/// A step's result: the value handed to the next step, or the outcome the reconcile stops with.
pub(super) type Step<T> = ControlFlow<Outcome, T>;

/// The value a [`Step`] hands forward; a stop returns its outcome from the enclosing function
/// (which returns `Result<Outcome, _>`).
macro_rules! proceed {
    ($step:expr) => {
        match $step {
            std::ops::ControlFlow::Continue(value) => value,
            std::ops::ControlFlow::Break(outcome) => return Ok(outcome),
        }
    };
}
pub(super) use proceed;

/// What a reconcile found, for the Stack's status.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Outcome {
    pub ready: bool,
    pub reason: &'static str,
    pub message: String,
    /// False when the spec could not be applied (refused, or an error).
    pub synced: bool,
    /// A wait that ends within moments as a rule (a token Secret just created, which the
    /// tenant's token controller fills at once): not reported unless it lasts, so the usual install
    /// costs no status write and Event for it.
    pub brief: bool,
}

impl Outcome {
    pub(super) fn refused(reason: &'static str, message: String) -> Self {
        Outcome {
            ready: false,
            reason,
            message,
            synced: false,
            brief: false,
        }
    }

    pub(super) fn waiting(reason: &'static str, message: String) -> Self {
        Outcome {
            ready: false,
            reason,
            message,
            synced: true,
            brief: false,
        }
    }

    pub(super) fn ready(reason: &'static str, message: String) -> Self {
        Outcome {
            ready: true,
            ..Outcome::waiting(reason, message)
        }
    }
}

/// Notes gathered during a reconcile, published as Events on the Stack at its end.
#[derive(Default)]
pub(super) struct Notes {
    pub events: Vec<(EventType, &'static str, String)>,
    pub controller_ref: Option<HostObjectRef>,
    pub token_secret_ref: Option<HostObjectRef>,
}

impl Notes {
    pub(super) fn normal(&mut self, reason: &'static str, note: String) {
        self.events.push((EventType::Normal, reason, note));
    }

    /// A host object of the name is not the Stack's: a Warning naming it.
    pub(super) fn conflict(&mut self, err: &HostWriteError) {
        if let HostWriteError::Conflict { .. } = err {
            self.events
                .push((EventType::Warning, "HostObjectConflict", err.to_string()));
        }
    }
}

/// Ready when the controller Deployment `namespace/name` has an available replica; else what the
/// kubelet says of its pod when it says something (`trouble`), else what the Deployment says.
pub(super) fn readiness(namespace: &str, name: &str, current: &Deployment, trouble: Option<&PodTrouble>) -> Outcome {
    if deployment::is_available(current) {
        return Outcome::ready(
            "Available",
            format!("the controller Deployment {namespace}/{name} has an available replica"),
        );
    }
    if let Some(refused) = pod_refused(current) {
        let why = format!(
            "the host refuses to create its pod: if a quota is used up, free some of it or ask the platform team for more ({refused})"
        );
        return Outcome::waiting("ControllerPodRefused", unavailable_message(namespace, name, &why));
    }
    if let Some(trouble) = trouble {
        let why = trouble.describe("the controller image of the stack's package");
        return Outcome::waiting(
            pod_trouble_reason(trouble.kind),
            unavailable_message(namespace, name, &why),
        );
    }
    let why = current
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Available" || c.type_ == "Progressing"))
        .and_then(|c| c.message.clone())
        .unwrap_or_else(|| NO_REPLICA_YET.into());
    Outcome::waiting("DeploymentUnavailable", unavailable_message(namespace, name, &why))
}

/// Why the Deployment's ReplicaSet cannot create a pod (its `ReplicaFailure` condition, e.g. a
/// ResourceQuota's `exceeded quota`), bounded like what the kubelet says.
fn pod_refused(deployment: &Deployment) -> Option<String> {
    let conditions = deployment.status.as_ref()?.conditions.as_ref()?;
    let failure = conditions
        .iter()
        .find(|c| c.type_ == "ReplicaFailure" && c.status == "True")?;
    Some(pod_trouble::bounded(failure.message.as_deref().unwrap_or_default()))
}

/// The wait for a Deployment the cache does not show yet, said as the Deployment's own first
/// status will say it, so that seeing that status is no second write.
pub(super) fn not_running_yet(namespace: &str, name: &str) -> Outcome {
    Outcome::waiting(
        "DeploymentUnavailable",
        unavailable_message(namespace, name, NO_REPLICA_YET),
    )
}

/// The Stack's `Ready` reasons for a controller pod the kubelet does not run (Warning Events).
pub(super) const POD_TROUBLE_REASONS: &[&str] = &[
    "ControllerImagePullFailed",
    "ControllerConfigError",
    "ControllerCrashLooping",
    "ControllerOutOfMemory",
    "ControllerUnschedulable",
    "ControllerNotStarting",
    "ControllerPodRefused",
];

fn pod_trouble_reason(kind: TroubleKind) -> &'static str {
    match kind {
        TroubleKind::Pull => "ControllerImagePullFailed",
        TroubleKind::Config => "ControllerConfigError",
        TroubleKind::Crash => "ControllerCrashLooping",
        TroubleKind::OutOfMemory => "ControllerOutOfMemory",
        TroubleKind::Unschedulable => "ControllerUnschedulable",
        TroubleKind::Other => "ControllerNotStarting",
    }
}

const NO_REPLICA_YET: &str = "no replica is available yet";

fn unavailable_message(namespace: &str, name: &str, why: &str) -> String {
    format!("the controller Deployment {namespace}/{name} is not available: {why}")
}
