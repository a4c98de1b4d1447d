//! One reconcile of an install not being deleted (§3.2 steps 2–6), as named steps: admission →
//! the applied package → the install Job settled to the current package → by the Job's state: still
//! running, failed (retried with backoff), or complete (its verified output judged, then applied by
//! `complete`). Each step hands the next its value, or the reconcile's result: when to look again
//! and the report for the status.

use std::ops::ControlFlow::{Break, Continue};

use k8s_openapi::api::batch::v1::Job;
use kube::ResourceExt;
use kube::runtime::controller::Action;

use super::job::{self, JobState};
use super::job_lifecycle::{Failure, completion_time, copy_pull_secrets, retry, running, settle_job};
use super::object::{Reconciled, Report, parent_of};
use super::unpacked::Read;
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET, admission, applied, complete, output};
use crate::api::common::HostObjectRef;
use crate::host::Parent;

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
    let detail = output::failure_detail(install, ctx, observed).await;
    failure.message = if detail.is_empty() {
        format!("install Job {job_name} failed: {}", failure.message)
    } else {
        format!("install Job {job_name} failed: {}: {detail}", failure.message)
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
    let (outline, kept) = match output::package_read(install, ctx, observed).await {
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
            (
                Read::Verified {
                    contents: Some(contents),
                    ..
                },
                _,
            ) => contents,
            (Read::Unreadable(message), _) => return retry(install, ctx, parent, observed, unreadable(message)).await,
            (_, _) => {
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
