//! The install Job of an install not being deleted (§3.2 steps 2–4, 6): create it, copy its pull
//! secrets, replace it on an upgrade or after a failure (with backoff), and read a completed one's
//! verified output, which `complete` applies.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, LogParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::info;

use super::complete;
use super::job::{self, JobInputs, JobState};
use super::object::{Report, event, parent_of};
use super::package;
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::host::Parent;
use crate::host::apply::{self, Applied};
use crate::stacks::pull_secrets;
use crate::stacks::stream::{self, LOG_LIMIT_BYTES, PackageContents};

/// §3.2 steps 2–6 for an install that is not being deleted (the finalizer is in place).
pub(super) async fn apply<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
) -> Result<(Action, Option<Report>), InstallError> {
    let parent = parent_of(install);
    let package = job::package_image(install.install());
    let observed = match settle_job(install, ctx, &parent, &package).await? {
        Settled::Current(observed) => observed,
        Settled::Acted(action, report) => return Ok((action, report)),
    };
    let attempt: u32 = job::annotation(&observed, job::ATTEMPT_ANNOTATION)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let job_name = observed.name_any();
    match job::state(&observed) {
        JobState::Running => {
            copy_pull_secrets(install, ctx, &parent, &observed).await?;
            let report = running(ctx, &job_name, &package);
            Ok((Action::requeue(SAFETY_NET), Some(report)))
        }
        JobState::Failed { message, at } => {
            let log = unpack_log(ctx, &observed).await.unwrap_or_default();
            let detail = last_lines(&log, 5);
            let message = if detail.is_empty() {
                format!("install Job {job_name} failed: {message}")
            } else {
                format!("install Job {job_name} failed: {message}: {detail}")
            };
            let failure = Failure {
                attempt,
                at,
                reason: "InstallJobFailed",
                message,
            };
            retry(install, ctx, &parent, &observed, failure).await
        }
        JobState::Complete => complete(install, ctx, &parent, &observed, attempt, &package).await,
    }
}

/// The install Job as it stands after `settle_job`.
enum Settled {
    /// This install's Job for the current package, to be judged by its state.
    Current(Box<Job>),
    /// The Job was created, replaced or is on its way out, or its name is taken: nothing more now.
    Acted(Action, Option<Report>),
}

/// Makes sure the install Job of the current package exists and is this install's.
async fn settle_job<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    package: &str,
) -> Result<Settled, InstallError> {
    let tenant = &ctx.tenant;
    let job_name = job::job_name(&install.namespace().unwrap_or_default(), &install.name_any());
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let started = |outcome: Result<(), Report>| {
        let report = outcome.map_or_else(|report| report, |()| running(ctx, &job_name, package));
        Settled::Acted(Action::requeue(SAFETY_NET), Some(report))
    };
    let Some(observed) = ctx.jobs.get(&ObjectRef::new(&job_name).within(&tenant.host_namespace)) else {
        if tenant.host_writes.was_created::<Job>(&tenant.host_namespace, &job_name) {
            // Created by a reconcile moments ago: its watch event brings this install back.
            return Ok(Settled::Acted(Action::await_change(), None));
        }
        return Ok(started(start_job(install, ctx, parent, 1).await?));
    };
    if observed.metadata.deletion_timestamp.is_some() {
        // The old Job is going away (an upgrade or a retry); its deletion event brings us back.
        return Ok(Settled::Acted(Action::await_change(), None));
    }
    // The name may be taken by a stranger or by a previous incarnation: settle that first.
    let desired = desired_job(install, ctx, parent, 1, &job::pull_secrets_of(&observed));
    let (applied, observed) = match apply::ensure_created(&jobs, &desired, Some(&observed), &tenant.name, parent).await
    {
        Ok(created) => created,
        // Its owner's events wake this install (see `install_of`) when the name is free again.
        Err(err @ apply::HostWriteError::Conflict { .. }) => {
            let report = job_conflict(install, ctx, &err);
            return Ok(Settled::Acted(Action::await_change(), Some(report)));
        }
        Err(err) => return Err(err.into()),
    };
    if applied == Applied::Created {
        return Ok(Settled::Acted(Action::requeue(SAFETY_NET), None));
    }
    if job::annotation(&observed, job::PACKAGE_ANNOTATION) == Some(package) {
        return Ok(Settled::Current(Box::new(observed)));
    }
    // An upgrade (spec.package changed): replace the Job; Crossplane never did.
    apply::delete(&jobs, &observed).await.map_err(InstallError::HostApi)?;
    let note = format!("package changed to {package}; replacing the install Job");
    event(install, ctx, EventType::Normal, "Upgrading", note).await;
    Ok(started(start_job(install, ctx, parent, 1).await?))
}

/// The report of a running install Job.
fn running(ctx: &InstallContext, job_name: &str, package: &str) -> Report {
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

/// A completed Job: once its package is applied (the Stack is created last, so a current Stack
/// means everything is), the Stack's readiness; before that, its verified output applied.
async fn complete<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    attempt: u32,
    package: &str,
) -> Result<(Action, Option<Report>), InstallError> {
    let (namespace, name) = (install.namespace().unwrap_or_default(), install.name_any());
    let job_ref = HostObjectRef {
        namespace: ctx.tenant.host_namespace.clone(),
        name: observed.name_any(),
    };
    let uid = install.meta().uid.clone().unwrap_or_default();
    let stack = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace));
    if let Some(current) = stack.filter(|s| package::stack_current(s, &uid, install.install(), package)) {
        ctx.unpacked.forget(&uid);
        let report = complete::applied_report(Some(&current), job_ref, package, &name);
        return Ok((Action::requeue(SAFETY_NET), Some(report)));
    }
    // Only now is the log read: once per Job, or when the Stack went missing.
    let job_uid = observed.uid().unwrap_or_default();
    let contents = match ctx.unpacked.get(&uid, &job_uid) {
        Some(contents) => contents,
        None => match read_output(ctx, observed).await {
            Ok((contents, bytes)) => {
                let contents = Arc::new(contents);
                ctx.unpacked.keep(&uid, &job_uid, bytes, contents.clone());
                contents
            }
            Err(message) => {
                let failure = Failure {
                    attempt,
                    at: completion_time(observed),
                    reason: "InvalidPackage",
                    message,
                };
                return retry(install, ctx, parent, observed, failure).await;
            }
        },
    };
    complete::run(install, ctx, contents, job_ref, package).await
}

/// A failed attempt of the install Job.
struct Failure {
    attempt: u32,
    at: Option<jiff::Timestamp>,
    reason: &'static str,
    message: String,
}

/// A failed attempt: report it, and once the backoff for this attempt has passed, replace the Job.
async fn retry<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    failure: Failure,
) -> Result<(Action, Option<Report>), InstallError> {
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
    info!(tenant = %tenant.name, install = %install.name_any(), attempt = attempt + 1, "retrying the install Job");
    let report = match start_job(install, ctx, parent, attempt + 1).await? {
        Ok(()) => {
            let mut report = Report::failed(reason, format!("{message}; retrying (attempt {})", attempt + 1));
            report.install_job = Some(job_ref);
            report
        }
        Err(report) => report,
    };
    Ok((Action::requeue(SAFETY_NET), Some(report)))
}

fn completion_time(job: &Job) -> Option<jiff::Timestamp> {
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

/// Creates the install Job and its pull-secret copies. `Ok(Err(report))` when the install cannot
/// start for a reason the user must fix.
async fn start_job<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    attempt: u32,
) -> Result<Result<(), Report>, InstallError> {
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let sources = match pull_secret_sources(install, ctx).await? {
        Ok(sources) => sources,
        Err(report) => return Ok(Err(report)),
    };
    let pull: Vec<String> = (0..sources.len())
        .map(|i| pull_secrets::host_copy_name(&namespace, &name, i))
        .collect();
    let desired = desired_job(install, ctx, parent, attempt, &pull);
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let created = match apply::ensure_created(&jobs, &desired, None, &tenant.name, parent).await {
        Ok((applied, job)) => {
            if applied == Applied::Created {
                tenant.host_writes.created(&job);
            }
            job
        }
        Err(err @ apply::HostWriteError::Conflict { .. }) => return Ok(Err(job_conflict(install, ctx, &err))),
        Err(err) => return Err(err.into()),
    };
    let secrets: Api<Secret> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    for (host_name, source) in job::pull_secrets_of(&created).iter().zip(&sources) {
        let copy = pull_secret_copy(ctx, parent, &created, host_name, source);
        apply::ensure(&secrets, &copy, None, &tenant.name, parent, apply::Update::Never).await?;
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
    Ok(Ok(()))
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
) -> Result<Result<Vec<Secret>, Report>, InstallError> {
    let namespace = install.namespace().unwrap_or_default();
    let refused = |err: pull_secrets::PullSecretError| Report::failed(err.reason(), err.to_string());
    let names = match pull_secrets::checked_names(&install.install().image_pull_secrets, &namespace) {
        Ok(names) => names,
        Err(err) => return Ok(Err(refused(err))),
    };
    let api: Api<Secret> = Api::namespaced(ctx.tenant.client.clone(), &namespace);
    let sources = pull_secrets::sources(&api, &namespace, &names)
        .await
        .map_err(InstallError::Tenant)?;
    Ok(sources.map_err(refused))
}

/// The host copy of `source` for the install Job `job`.
fn pull_secret_copy(ctx: &InstallContext, parent: &Parent, job: &Job, host_name: &str, source: &Secret) -> Secret {
    let target = pull_secrets::CopyTarget {
        tenant: &ctx.tenant.name,
        parent,
        host_namespace: &ctx.tenant.host_namespace,
        name: host_name,
        owner: job::owner_reference(job),
    };
    pull_secrets::host_copy(&target, source)
}

/// Makes sure every pull secret a running Job refers to was copied (the daemon may have stopped
/// between creating the Job and copying them).
async fn copy_pull_secrets<K: InstallKind>(
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
    let Ok(sources) = pull_secret_sources(install, ctx).await? else {
        return Ok(());
    };
    for (host_name, source) in names.iter().zip(&sources) {
        if absent.contains(&host_name) {
            let copy = pull_secret_copy(ctx, parent, observed, host_name, source);
            apply::ensure(&secrets, &copy, None, &tenant.name, parent, apply::Update::Never).await?;
        }
    }
    Ok(())
}

/// The log of the Job's `unpack` container, found through the Job's `controller-uid` label.
async fn unpack_log(ctx: &InstallContext, job: &Job) -> Result<String, String> {
    let tenant = &ctx.tenant;
    let pods: Api<Pod> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let list = pods
        .list(&ListParams::default().labels(&format!("controller-uid={uid}")))
        .await
        .map_err(|e| format!("cannot list the install Job's pods: {e}"))?;
    let mut candidates: Vec<&Pod> = list.items.iter().collect();
    // The succeeded pod when there is one, else the newest.
    candidates.sort_by_key(|p| {
        let succeeded = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded");
        (succeeded, p.metadata.creation_timestamp.clone().map(|t| t.0))
    });
    let Some(pod) = candidates.last() else {
        return Err(format!(
            "the pod of install Job {} is gone, so its output cannot be read; the Job will be retried",
            job.name_any()
        ));
    };
    let params = LogParams {
        container: Some(job::UNPACK_CONTAINER.into()),
        limit_bytes: Some(LOG_LIMIT_BYTES),
        ..LogParams::default()
    };
    pods.logs(&pod.name_any(), &params)
        .await
        .map_err(|e| format!("cannot read the log of install pod {}: {e}", pod.name_any()))
}

fn last_lines(log: &str, count: usize) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(count)..].join(" | ")
}

/// The verified package contents in a completed Job's log and the log's size, or why there are none.
async fn read_output(ctx: &InstallContext, job: &Job) -> Result<(PackageContents, usize), String> {
    let log = unpack_log(ctx, job).await?;
    let contents =
        stream::decode(&log).map_err(|err| format!("install Job {} output refused: {err}", job.name_any()))?;
    Ok((contents, log.len()))
}
