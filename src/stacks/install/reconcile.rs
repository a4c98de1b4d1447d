//! One reconcile of an install not being deleted (§3.2 steps 2–6), as named steps: admission →
//! the applied package → the install Job settled to the current package → by the Job's state: still
//! running (or its pod not starting, see `pod_wait`), failed (retried with backoff), or complete (its verified output judged, then applied by
//! `complete`). Each step hands the next its value, or the reconcile's result: when to look again
//! and the report for the status. A Job whose output the host or its node does not answer for is
//! kept: only a Job that failed, whose pod is gone or whose package changed is made again.

use std::ops::ControlFlow::{Break, Continue};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::job::{self, JobState};
use super::job_lifecycle::{Failure, completion_time, copy_pull_secrets, retry, running, settle_job};
use super::object::{Reconciled, Report, parent_of};
use super::output::Unanswered;
use super::unpacked::Read;
use super::{
    InstallContext, InstallError, InstallKind, SAFETY_NET, admission, applied, complete, output, pod_wait, status,
};
use crate::api::common::HostObjectRef;
use crate::host::Parent;
use crate::host::pod_trouble::{self, JobEnd, TroubleKind};

/// §3.2 steps 2–6 for an install that is not being deleted (the finalizer is in place).
pub(super) async fn apply<K: InstallKind>(install: &K, ctx: &InstallContext) -> Result<Reconciled, InstallError> {
    let parent = parent_of(install);
    let package = job::package_image(install.install());
    // 1. Admission: whether the install may make anything on the host at all.
    if let Some(report) = admission::refusal(install, ctx, &package) {
        // Nothing is made on the host; an edit, or an older install's deletion, is an event.
        return Ok((Action::await_change(), Some(report)));
    }
    // 2. A package already applied: its Stack is reported and kept in step, no Job runs.
    if let Some(stack) = applied::applied_stack(install, ctx, &package) {
        return applied::run(install, ctx, &stack, &package).await;
    }
    // 3. The install Job of the current package, and this install's.
    let observed = match settle_job(install, ctx, &parent, &package).await? {
        Continue(observed) => observed,
        Break(reconciled) => return Ok(reconciled),
    };
    // 4. By the Job's state: still unpacking, failed (replaced after a backoff), or complete.
    let attempt: u32 = job::annotation(&observed, job::ATTEMPT_ANNOTATION)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    match job::state(&observed) {
        JobState::Running => {
            copy_pull_secrets(install, ctx, &parent, &observed).await?;
            if let Some(reconciled) = pod_wait::not_starting(install, ctx, &parent, &observed, attempt).await? {
                return Ok(reconciled);
            }
            let report = running(ctx, &observed.name_any(), &package);
            Ok((Action::requeue(SAFETY_NET), Some(report)))
        }
        JobState::Failed { message, at } => {
            let failure = Failure {
                attempt,
                at,
                reason: "InstallJobFailed",
                message,
            };
            failed(install, ctx, &parent, &observed, failure).await
        }
        JobState::Complete => complete(install, ctx, &parent, &observed, attempt, &package).await,
    }
}

/// A failed install Job: reported with what its log says, and retried once the backoff for this
/// attempt has passed.
async fn failed<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    mut failure: Failure,
) -> Result<Reconciled, InstallError> {
    let job_name = observed.name_any();
    // How its pod ended is part of the failure, told once: not before the cache shows it (the
    // pod's event brings the install back).
    let ended = match pod_trouble::end_of_job(&ctx.pods, observed) {
        // Woken by the pod's event; looked at again after the grace should the pod be gone.
        JobEnd::Pending => return Ok((Action::requeue(pod_trouble::POD_CACHE_GRACE), None)),
        JobEnd::Ended(trouble) => trouble,
    };
    let detail = output::failure_detail(install, ctx, observed).await;
    failure.message = match ended {
        Some(trouble) if trouble.kind == TroubleKind::OutOfMemory => {
            failure.reason = pod_wait::INSTALL_OUT_OF_MEMORY;
            format!(
                "install Job {job_name} ran out of memory unpacking the package: make the package smaller (fewer or smaller resources), or ask the operator for a larger install Job memory limit ({})",
                trouble.said()
            )
        }
        _ if detail.is_empty() => format!("install Job {job_name} failed: {}", failure.message),
        _ => format!("install Job {job_name} failed: {}: {detail}", failure.message),
    };
    retry(install, ctx, parent, observed, failure).await
}

/// A completed Job whose package is not applied yet: what its output came to (read once per Job),
/// judged against the tenant's CRDs, then applied.
async fn complete<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    attempt: u32,
    package: &str,
) -> Result<Reconciled, InstallError> {
    let job_ref = HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: observed.name_any(),
    };
    let unreadable = |message| Failure {
        attempt,
        at: completion_time(observed),
        reason: "InvalidPackage",
        message,
    };
    let read = match output::package_read(install, ctx, observed).await {
        Ok(read) => read,
        Err(unanswered) => return unanswered_read(install, ctx, observed, unanswered).await,
    };
    let (outline, kept) = match read {
        Read::Verified { outline, contents } => (outline, contents),
        Read::Refused { reason, message } => {
            let mut report = Report::failed(reason, message);
            report.install_job = Some(job_ref);
            // Only a new package (an edit of the install, which is an event) changes the outcome.
            return Ok((Action::await_change(), Some(report)));
        }
        Read::Unreadable(message) | Read::JobFailed(message) => {
            return retry(install, ctx, parent, observed, unreadable(message)).await;
        }
    };
    if let Some(refused) = complete::judge(install, ctx, &outline, &job_ref) {
        return Ok(refused);
    }
    // Judged applicable: the contents, read again if they were past what is kept.
    let contents = match kept {
        Some(contents) => contents,
        None => match output::read_package::<K>(ctx, observed).await {
            Err(unanswered) => return unanswered_read(install, ctx, observed, unanswered).await,
            Ok((
                Read::Verified {
                    contents: Some(contents),
                    ..
                },
                _,
            )) => contents,
            Ok((Read::Unreadable(message), _)) => {
                return retry(install, ctx, parent, observed, unreadable(message)).await;
            }
            Ok((_, _)) => {
                let message = format!(
                    "the output of install Job {} changed since it was read",
                    observed.name_any()
                );
                return retry(install, ctx, parent, observed, unreadable(message)).await;
            }
        },
    };
    complete::run(install, ctx, contents, job_ref, package).await
}

/// The shortest and longest wait before the output of a Job is read again after the kubelet did
/// not answer.
const READ_AGAIN_MIN: Duration = Duration::from_secs(1);
const READ_AGAIN_MAX: Duration = Duration::from_secs(60);

/// The completed Job's output went unanswered: the Job is kept, the install says what does not
/// answer, and the output is read again. When the host API server does not answer, the reconcile
/// fails with its error, so that it is the host's outage to tell and the install runs again the
/// moment the host answers; when only the kubelet does not, it is read again after a wait that
/// grows with the time since the Job completed (half of it): no state to keep, and no log line.
async fn unanswered_read<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    observed: &Job,
    unanswered: Unanswered,
) -> Result<Reconciled, InstallError> {
    let mut report = Report::waiting(unanswered.reason, unanswered.message);
    report.install_job = Some(HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: observed.name_any(),
    });
    if unanswered.reason == output::HOST_UNREACHABLE {
        status::publish(install, ctx, report).await?;
        return Err(InstallError::HostApi(unanswered.error));
    }
    let since_completion = completion_time(observed)
        .map(|at| jiff::Timestamp::now().duration_since(at).unsigned_abs())
        .unwrap_or_default();
    tracing::debug!(reason = unanswered.reason, error = %unanswered.error, "install output unanswered; reading it again");
    let again = (since_completion / 2).clamp(READ_AGAIN_MIN, READ_AGAIN_MAX);
    Ok((Action::requeue(again), Some(report)))
}
