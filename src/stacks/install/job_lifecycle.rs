//! The install Job on the host (§3.2 steps 2–3, 6): settled to the current package (created, or
//! replaced on an upgrade), started with its pull-secret copies, and replaced with backoff after a
//! failed attempt. A step that cannot go on stops with the install's report and when to look again.

use std::ops::ControlFlow::{self, Break, Continue};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::info;

use super::job::{self, JobInputs};
use super::object::{Reconciled, Report, event};
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::host::Parent;
use crate::host::apply::{self, Applied};
use crate::host::quota_share;
use crate::stacks::pull_secrets;

/// Makes sure the install Job of the current package exists and is this install's: hands it on to
/// be judged by its state, or stops when it was created, replaced or is on its way out, or its name
/// is taken.
pub(super) async fn settle_job<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    package: &str,
) -> Result<ControlFlow<Reconciled, Box<Job>>, InstallError> {
    let tenant = &ctx.tenant;
    let job_name = job::job_name(&install.namespace().unwrap_or_default(), &install.name_any());
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let started = |start: ControlFlow<Report>| {
        let report = match start {
            Continue(()) => running(ctx, &job_name, package),
            Break(report) => report,
        };
        Break((Action::requeue(look_again(&report)), Some(report)))
    };
    let Some(observed) = ctx.jobs.get(&ObjectRef::new(&job_name).within(&tenant.host_namespace)) else {
        if tenant.host_writes.was_created::<Job>(&tenant.host_namespace, &job_name) {
            // Created by a reconcile moments ago: its watch event brings this install back.
            return Ok(Break((Action::await_change(), None)));
        }
        return Ok(started(start_job(install, ctx, parent, 1).await?));
    };
    if observed.metadata.deletion_timestamp.is_some() {
        // The old Job is going away (an upgrade or a retry); its deletion event brings us back.
        return Ok(Break((Action::await_change(), None)));
    }
    // The name may be taken by a stranger or by a previous incarnation: settle that first.
    let desired = desired_job(install, ctx, parent, 1, &job::pull_secrets_of(&observed));
    let (applied, observed) = match apply::ensure_created(&jobs, &desired, Some(&observed), &tenant.name, parent).await
    {
        Ok(created) => created,
        // Its owner's events wake this install (see `install_of`) when the name is free again.
        Err(err @ apply::HostWriteError::Conflict { .. }) => {
            let report = job_conflict(install, ctx, &err);
            return Ok(Break((Action::await_change(), Some(report))));
        }
        Err(err) => return Err(err.into()),
    };
    if applied == Applied::Created {
        return Ok(Break((Action::requeue(SAFETY_NET), None)));
    }
    if job::annotation(&observed, job::PACKAGE_ANNOTATION) == Some(package) {
        return Ok(Continue(Box::new(observed)));
    }
    // An upgrade (spec.package changed): replace the Job; Crossplane never did.
    apply::delete(&jobs, &observed).await.map_err(InstallError::HostApi)?;
    let note = format!("package changed to {package}; replacing the install Job");
    event(install, ctx, EventType::Normal, "Upgrading", note).await;
    Ok(started(start_job(install, ctx, parent, 1).await?))
}

/// The report of a running install Job.
pub(super) fn running(ctx: &InstallContext, job_name: &str, package: &str) -> Report {
    let mut report = Report::waiting(
        "InstallJobRunning",
        format!("install Job {job_name} is unpacking {package}"),
    );
    report.install_job = Some(HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: job_name.to_string(),
    });
    report
}

/// A failed attempt of the install Job.
pub(super) struct Failure {
    pub attempt: u32,
    pub at: Option<jiff::Timestamp>,
    pub reason: &'static str,
    pub message: String,
}

/// A failed attempt: report it, and once the backoff for this attempt has passed, replace the Job.
pub(super) async fn retry<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    failure: Failure,
) -> Result<Reconciled, InstallError> {
    let Failure {
        attempt,
        at: failed_at,
        reason,
        message,
    } = failure;
    let tenant = &ctx.tenant;
    let delay = tenant.shared.settings.backoff.delay(attempt);
    let elapsed = failed_at
        .map(|at| jiff::Timestamp::now().duration_since(at).unsigned_abs())
        .unwrap_or(Duration::MAX);
    let job_ref = HostObjectRef {
        namespace: tenant.host_namespace.clone(),
        name: observed.name_any(),
    };
    if elapsed < delay {
        let mut report = Report::failed(
            reason,
            format!("{message}; retrying in {}s", (delay - elapsed).as_secs().max(1)),
        );
        report.install_job = Some(job_ref);
        return Ok((Action::requeue(delay - elapsed), Some(report)));
    }
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    apply::delete(&jobs, observed).await.map_err(InstallError::HostApi)?;
    info!(attempt = attempt + 1, "retrying the install Job");
    let report = match start_job(install, ctx, parent, attempt + 1).await? {
        Continue(()) => {
            let mut report = Report::failed(reason, format!("{message}; retrying (attempt {})", attempt + 1));
            report.install_job = Some(job_ref);
            report
        }
        Break(report) => report,
    };
    Ok((Action::requeue(look_again(&report)), Some(report)))
}

/// When an install whose Job was started, or not, looks again: soon when its namespace's share of
/// the host quota was full (other namespaces' workloads going bring it no event of its own).
fn look_again(report: &Report) -> Duration {
    if report.ready.1 == quota_share::REASON {
        Duration::from_secs(30)
    } else {
        SAFETY_NET
    }
}

pub(super) fn completion_time(job: &Job) -> Option<jiff::Timestamp> {
    job.status.as_ref()?.completion_time.as_ref().map(|t| t.0)
}

fn desired_job<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    attempt: u32,
    pull: &[String],
) -> Job {
    job::desired_job(&JobInputs {
        tenant: &ctx.tenant.name,
        host_namespace: &ctx.tenant.host_namespace,
        parent,
        spec: install.install(),
        scope: K::SCOPE,
        stackd_image: &ctx.stackd_image,
        attempt,
        pull_secrets: pull,
    })
}

/// Creates the install Job and its pull-secret copies; stops with a report when the install cannot
/// start for a reason the user must fix.
async fn start_job<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    attempt: u32,
) -> Result<ControlFlow<Report>, InstallError> {
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let sources = match pull_secret_sources(install, ctx).await? {
        Continue(sources) => sources,
        Break(report) => return Ok(Break(report)),
    };
    let pull: Vec<String> = (0..sources.len())
        .map(|i| pull_secrets::host_copy_name(&namespace, &name, i))
        .collect();
    let desired = desired_job(install, ctx, parent, attempt, &pull);
    let what = format!("the install Job {}/{}", tenant.host_namespace, desired.name_any());
    if let Err(refused) = tenant.check_quota_share(&what, &namespace, &desired, None) {
        return Ok(Break(Report::failed(refused.reason(), refused.to_string())));
    }
    // The copies first, so the pod's first pull has its credentials; owned by the Job once it exists.
    let secrets: Api<Secret> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    for (host_name, source) in pull.iter().zip(&sources) {
        let copy = pull_secret_copy(ctx, parent, None, host_name, source);
        apply::ensure(&secrets, &copy, None, &tenant.name, parent, apply::Update::Never).await?;
    }
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    // Marked before the request: the Job's watch event may be handled before the response.
    tenant.host_writes.creating(&desired);
    let created = apply::ensure_created(&jobs, &desired, None, &tenant.name, parent).await;
    if !matches!(created, Ok((Applied::Created, _))) {
        tenant.host_writes.not_created(&desired);
    }
    let created = match created {
        Ok((_, job)) => job,
        Err(err @ apply::HostWriteError::Conflict { .. }) => return Ok(Break(job_conflict(install, ctx, &err))),
        Err(err) => return Err(err.into()),
    };
    for (host_name, source) in pull.iter().zip(&sources) {
        let copy = pull_secret_copy(ctx, parent, Some(&created), host_name, source);
        own_copy(&secrets, &copy).await?;
    }
    event(
        install,
        ctx,
        EventType::Normal,
        "InstallJobCreated",
        format!(
            "created install Job {}/{} for {} (attempt {attempt})",
            tenant.host_namespace,
            created.name_any(),
            job::package_image(install.install())
        ),
    )
    .await;
    Ok(Continue(()))
}

/// The install Job's host name is taken. When the other install kind of the same namespace and name
/// holds it, say so in the tenant's terms: both would install the same Stack, so only one may.
fn job_conflict<K: InstallKind>(install: &K, ctx: &InstallContext, err: &apply::HostWriteError) -> Report {
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let job_name = job::job_name(&namespace, &name);
    let holder = ctx
        .jobs
        .get(&ObjectRef::new(&job_name).within(&tenant.host_namespace))
        .and_then(|job| super::install_at(job.as_ref()))
        .filter(|at| at.kind != K::kind(&()) && at.namespace == namespace && at.name == name);
    let message = match holder {
        Some(super::InstallAt { kind, .. }) => format!(
            "the {kind} {namespace}/{name} already installs a stack named {name} here (its install Job {}/{job_name} is on the host); a StackInstall and a ClusterStackInstall of the same name in one namespace would share one Stack: delete one of them or install under another name",
            tenant.host_namespace
        ),
        None => err.to_string(),
    };
    Report::failed(err.reason(), message)
}

/// The tenant pull secrets the install names, or a report naming those that cannot be copied.
async fn pull_secret_sources<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
) -> Result<ControlFlow<Report, Vec<Secret>>, InstallError> {
    let namespace = install.namespace().unwrap_or_default();
    let refused = |err: pull_secrets::PullSecretError| Report::failed(err.reason(), err.to_string());
    let names = match pull_secrets::checked_names(&install.install().image_pull_secrets, &namespace) {
        Ok(names) => names,
        Err(err) => return Ok(Break(refused(err))),
    };
    let api: Api<Secret> = Api::namespaced(ctx.tenant.client.clone(), &namespace);
    let read = pull_secrets::read(&api, &names).await.map_err(InstallError::Tenant)?;
    Ok(match pull_secrets::check(&namespace, read) {
        Ok(sources) => Continue(sources),
        Err(err) => Break(refused(err)),
    })
}

/// The host copy of `source` for the install Job `job` (none while the Job is not created yet).
fn pull_secret_copy(
    ctx: &InstallContext,
    parent: &Parent,
    job: Option<&Job>,
    host_name: &str,
    source: &Secret,
) -> Secret {
    let target = pull_secrets::CopyTarget {
        tenant: &ctx.tenant.name,
        parent,
        host_namespace: &ctx.tenant.host_namespace,
        name: host_name,
        owner: job.map(job::owner_reference),
    };
    pull_secrets::host_copy(&target, source)
}

/// Gives the copy written before its Job that Job as owner (so it goes with the Job), and the
/// credentials read now: a copy left by an earlier attempt may hold older ones.
async fn own_copy(secrets: &Api<Secret>, copy: &Secret) -> Result<(), InstallError> {
    let patch = serde_json::json!({
        "metadata": {"ownerReferences": copy.metadata.owner_references},
        "data": copy.data,
    });
    match secrets
        .patch(&copy.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        // The earlier attempt's copy, gone with its Job meanwhile: made again, owned.
        Err(err) if crate::runtime::api_errors::is_not_found(&err) => {
            secrets
                .create(&Default::default(), copy)
                .await
                .map_err(InstallError::HostApi)?;
            Ok(())
        }
        Err(err) => Err(InstallError::HostApi(err)),
    }
}

/// Makes sure every pull secret a running Job refers to was copied (the daemon may have stopped
/// between creating the Job and copying them).
pub(super) async fn copy_pull_secrets<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
) -> Result<(), InstallError> {
    let names = job::pull_secrets_of(observed);
    if names.is_empty() {
        return Ok(());
    }
    let tenant = &ctx.tenant;
    let secrets: Api<Secret> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let mut absent = Vec::new();
    for name in &names {
        if secrets.get_opt(name).await.map_err(InstallError::HostApi)?.is_none() {
            absent.push(name);
        }
    }
    if absent.is_empty() {
        return Ok(());
    }
    let Continue(sources) = pull_secret_sources(install, ctx).await? else {
        return Ok(());
    };
    for (host_name, source) in names.iter().zip(&sources) {
        if absent.contains(&host_name) {
            let copy = pull_secret_copy(ctx, parent, Some(observed), host_name, source);
            apply::ensure(&secrets, &copy, None, &tenant.name, parent, apply::Update::Never).await?;
        }
    }
    Ok(())
}
