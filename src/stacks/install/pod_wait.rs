//! An install Job whose pod does not start (§3.2 step 4; issue 52): what the kubelet says about it
//! (an unpullable package image, a container it cannot create, no node to run on) is the install's
//! status, with what to do, instead of "unpacking". A package image that cannot be pulled for
//! `--pull-failure-grace` fails the attempt (`PackagePullFailed`), which is retried with backoff, or
//! at once when the install is edited.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::job_lifecycle::{Failure, retry};
use super::object::{Reconciled, Report};
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::host::Parent;
use crate::host::pod_trouble::{self, PodRefusal, TroubleKind};

/// `Ready=False` while the install Job's pod does not start (a Warning Event per change).
pub const INSTALL_POD_WAITING: &str = "InstallPodWaiting";
/// `Ready=False` while the host refuses to create the install Job's pod (a used-up quota).
pub const INSTALL_POD_REFUSED: &str = "InstallPodRefused";
/// `Ready=False` once the package image could not be pulled for `--pull-failure-grace`.
pub const PACKAGE_PULL_FAILED: &str = "PackagePullFailed";
/// `Ready=False` when the install Job's container was killed for its memory (`OOMKilled`).
pub const INSTALL_OUT_OF_MEMORY: &str = "InstallOutOfMemory";

/// The install's report when its running Job's pod does not start; none while it starts or runs.
pub(super) async fn not_starting<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    attempt: u32,
) -> Result<Option<Reconciled>, InstallError> {
    let Some(trouble) = pod_trouble::of_job(&ctx.pods, observed) else {
        return pod_refused(ctx, observed).await;
    };
    let job_name = observed.name_any();
    // The install Job's security context is stackd's: only the package image can change.
    let advice = if trouble.kind == TroubleKind::Config && trouble.message.contains("runAsNonRoot") {
        "the package image runs as root, which the install Job forbids: build it with a numeric non-root USER".into()
    } else {
        trouble.advice("spec.package")
    };
    let message = format!("install Job {job_name} cannot start: {advice} ({})", trouble.said());
    let job_ref = HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: job_name,
    };
    if trouble.kind != TroubleKind::Pull {
        // The pod's events bring the install back when the kubelet says something else.
        let mut report = Report::waiting(INSTALL_POD_WAITING, message);
        report.install_job = Some(job_ref);
        return Ok(Some((Action::requeue(SAFETY_NET), Some(report))));
    }
    let created = observed.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let grace = ctx.tenant.shared.settings.pull_failure_grace;
    let gives_up_at = created.map_or_else(jiff::Timestamp::now, |created| {
        created.checked_add(grace).unwrap_or(created)
    });
    let left = jiff::Timestamp::now().duration_until(gives_up_at);
    let left = Duration::try_from(left).unwrap_or_default();
    let failed_before = ready_reason(install) == Some(PACKAGE_PULL_FAILED);
    // An edit after the failure (a new package is a new Job anyway; new pull secrets are not)
    // is worth a new attempt at once.
    let edited = failed_before && observed_generation(install) != install.meta().generation;
    if left.is_zero() || edited {
        let failure = Failure {
            attempt,
            at: if edited { None } else { Some(gives_up_at) },
            reason: PACKAGE_PULL_FAILED,
            message,
        };
        return retry(install, ctx, parent, observed, failure).await.map(Some);
    }
    let mut report = if failed_before {
        // A later attempt that cannot pull either: still failed, not back to waiting.
        Report::failed(
            PACKAGE_PULL_FAILED,
            format!("{message}; attempt {attempt} gives up at {gives_up_at:.0}"),
        )
    } else {
        Report::waiting(
            INSTALL_POD_WAITING,
            format!("{message}; the install fails at {gives_up_at:.0} unless the image can be pulled by then"),
        )
    };
    report.install_job = Some(job_ref);
    Ok(Some((Action::requeue(left), Some(report))))
}

/// The install's report while its Job has no pod: the host's refusal of it (see
/// [`pod_trouble::refusal_of_job`]); none while it has a pod.
async fn pod_refused(ctx: &InstallContext, observed: &Job) -> Result<Option<Reconciled>, InstallError> {
    let refusal = pod_trouble::refusal_of_job(&ctx.tenant.host, &ctx.pods, observed)
        .await
        .map_err(InstallError::HostApi)?;
    let job_name = observed.name_any();
    let package = super::job::annotation(observed, super::job::PACKAGE_ANNOTATION).unwrap_or_default();
    let running = super::job_lifecycle::running(ctx, &job_name, package);
    let (again, report) = match refusal {
        PodRefusal::HasPod => return Ok(None),
        PodRefusal::TooSoon(again) => (again, running),
        PodRefusal::Unsaid => (pod_trouble::REFUSAL_LOOK_EVERY, running),
        PodRefusal::Refused(said) => {
            let mut report = Report::waiting(
                INSTALL_POD_REFUSED,
                format!("the host refuses to create install Job {job_name}'s pod: {said}"),
            );
            report.install_job = running.install_job;
            (pod_trouble::REFUSAL_LOOK_EVERY, report)
        }
    };
    Ok(Some((Action::requeue(again), Some(report))))
}

fn ready_reason<K: InstallKind>(install: &K) -> Option<&str> {
    let conditions = &install.install_status()?.conditions;
    let ready = conditions.iter().find(|c| c.type_ == "Ready")?;
    Some(ready.reason.as_str())
}

fn observed_generation<K: InstallKind>(install: &K) -> Option<i64> {
    install.install_status()?.observed_generation
}
