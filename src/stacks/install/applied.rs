//! An install whose package is applied (DESIGN.md §3.2, after step 5): its Stack, which the install
//! creates last, is this install's and carries the package of the current `spec.package`. Nothing of
//! the package is read again: the install reports its Stack's readiness, keeps the Stack's
//! install-level settings (service account, pull secrets) in step with its spec, and removes the
//! completed install Job (its pull-secret copies go with it, as the Job owns them) once its status
//! records the applied package. A Job left behind would hold one of the tenant's `count/jobs.batch`
//! and its copies `secrets` for good, so that a namespace of installs could fill the quota.
//!
//! What the user saw stays: the status keeps its `installJob` reference and `Synced=True
//! PackageApplied`, and the Job's Events remain. A missing Stack (deleted by hand) or a new package
//! is no longer applied: the install runs a new Job.

use std::sync::Arc;

use k8s_openapi::api::batch::v1::Job;
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};

use super::complete::applied_report;
use super::job::{self, JobState};
use super::object::{Reconciled, event};
use super::package;
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::api::stacks::Stack;
use crate::host::apply;
use crate::runtime::api_errors::is_conflict;

/// The install's Stack when its package is applied: controlled by the install, from `package`.
pub(super) fn applied_stack<K: InstallKind>(install: &K, ctx: &InstallContext, package: &str) -> Option<Stack> {
    cached_applied_stack(install, &ctx.stacks, package).map(|stack| stack.as_ref().clone())
}

/// [`applied_stack`] as `stacks` holds it.
pub(super) fn cached_applied_stack<K: InstallKind>(
    install: &K,
    stacks: &Store<Stack>,
    package: &str,
) -> Option<Arc<Stack>> {
    let uid = install.meta().uid.clone().unwrap_or_default();
    let at = ObjectRef::new(&install.name_any()).within(&install.namespace().unwrap_or_default());
    stacks
        .get(&at)
        .filter(|stack| package::stack_applied(stack, &uid, package))
}

/// Reports the applied package, brings the Stack's install-level settings in step and removes the
/// completed install Job once the status shows the package applied.
pub(super) async fn run<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    stack: &Stack,
    package: &str,
) -> Result<Reconciled, InstallError> {
    let uid = install.meta().uid.clone().unwrap_or_default();
    ctx.unpacked.forget(&uid);
    let name = install.name_any();
    let job_name = job::job_name(&install.namespace().unwrap_or_default(), &name);
    let job = ctx
        .jobs
        .get(&ObjectRef::new(&job_name).within(&ctx.tenant.host_namespace));
    let job_ref = job.as_ref().map(|job| HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: job.name_any(),
    });
    if !package::stack_current(stack, &uid, install.install(), package) {
        refresh_settings(install, ctx, stack).await?;
        let report = applied_report(None, job_ref, package, &name);
        return Ok((Action::requeue(SAFETY_NET), Some(report)));
    }
    if let Some(job) = job.filter(|job| finished_with(job, package) && recorded(install)) {
        remove_job(install, ctx, &job).await?;
    }
    // Without a Job, the status keeps the reference it has: what the user saw stays.
    let report = applied_report(Some(stack), job_ref, package, &name);
    Ok((Action::requeue(SAFETY_NET), Some(report)))
}

/// The Stack with the install's current service-account and pull-secret settings (an edit of the
/// install that is not an upgrade needs no new Job).
async fn refresh_settings<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    stack: &Stack,
) -> Result<(), InstallError> {
    let mut replacement = stack.clone();
    replacement.spec.controller.service_account = install.install().service_account.clone();
    replacement.spec.controller.image_pull_secrets = install.install().image_pull_secrets.clone();
    replacement.metadata.managed_fields = None;
    replacement.status = None;
    let stacks: Api<Stack> = Api::namespaced(ctx.tenant.client.clone(), &install.namespace().unwrap_or_default());
    match stacks
        .replace(&stack.name_any(), &PostParams::default(), &replacement)
        .await
    {
        Ok(_) => {}
        // Our cached Stack is behind: its watch event brings this install back.
        Err(err) if is_conflict(&err) => return Ok(()),
        Err(err) => return Err(InstallError::Tenant(err)),
    }
    let note = format!(
        "updated Stack {} to the install's service account and pull secrets",
        stack.name_any()
    );
    event(install, ctx, EventType::Normal, "StackUpdated", note).await;
    Ok(())
}

/// A completed install Job of `package`, not on its way out already.
fn finished_with(job: &Job, package: &str) -> bool {
    job.metadata.deletion_timestamp.is_none()
        && job::state(job) == JobState::Complete
        && job::annotation(job, job::PACKAGE_ANNOTATION) == Some(package)
}

/// True when the install's status (as cached) says its current generation's package is applied.
fn recorded<K: InstallKind>(install: &K) -> bool {
    let generation = install.meta().generation;
    install.install_status().is_some_and(|status| {
        status.observed_generation == generation
            && status
                .conditions
                .iter()
                .any(|c| c.type_ == "Synced" && c.status == "True" && c.reason == "PackageApplied")
    })
}

/// Deletes the completed Job in the background: its pods and pull-secret copies (owned by it) go too.
async fn remove_job<K: InstallKind>(install: &K, ctx: &InstallContext, job: &Job) -> Result<(), InstallError> {
    let tenant = &ctx.tenant;
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    apply::delete(&jobs, job).await.map_err(InstallError::HostApi)?;
    let note = format!(
        "removed the completed install Job {}/{} and its pull-secret copies: the package is applied",
        tenant.host_namespace,
        job.name_any()
    );
    event(install, ctx, EventType::Normal, "InstallJobRemoved", note).await;
    Ok(())
}
