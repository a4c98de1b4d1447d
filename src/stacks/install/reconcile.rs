//! One reconcile of an install: finalizer, Job, output, CRDs, Stack, status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, LogParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::info;

use super::crd_policy::CrdRules;
use super::job::{self, JobInputs, JobState};
use super::object::{Report, event, installer_of, parent_of};
use super::package::{self, PackageError};
use super::{InstallContext, InstallError, InstallKind, SAFETY_NET};
use crate::api::common::HostObjectRef;
use crate::api::stacks::Stack;
use crate::host::Parent;
use crate::host::apply::{self, Applied};
use crate::stacks::pull_secrets;
use crate::stacks::stream::{self, LOG_LIMIT_BYTES, PackageContents};

/// §3.2 steps 2–6 for an install that is not being deleted (the finalizer is in place).
pub(super) async fn apply<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
) -> Result<(Action, Option<Report>), InstallError> {
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let parent = parent_of(install);
    let spec = install.install();
    let package = job::package_image(spec);
    let job_name = job::job_name(&namespace, &name);
    let job_ref = HostObjectRef {
        namespace: tenant.host_namespace.clone(),
        name: job_name.clone(),
    };
    let jobs: Api<Job> = Api::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let observed = ctx.jobs.get(&ObjectRef::new(&job_name).within(&tenant.host_namespace));
    let with_job = |mut report: Report| {
        report.install_job = Some(job_ref.clone());
        report
    };
    let started = |outcome: Result<(), Report>| match outcome {
        Ok(()) => with_job(Report::waiting(
            "InstallJobRunning",
            format!("install Job {job_name} is unpacking {package}"),
        )),
        Err(report) => report,
    };

    let Some(observed) = observed else {
        return Ok((
            Action::requeue(SAFETY_NET),
            Some(started(start_job(install, ctx, &parent, 1).await?)),
        ));
    };
    if observed.metadata.deletion_timestamp.is_some() {
        // The old Job is going away (an upgrade or a retry); its deletion event brings us back.
        return Ok((Action::await_change(), None));
    }
    // The name may be taken by a stranger or by a previous incarnation: settle that first.
    let desired = desired_job(install, ctx, &parent, 1, &job::pull_secrets_of(&observed));
    let (applied, observed) = match apply::ensure_created(&jobs, &desired, Some(&observed), &tenant.name, &parent).await
    {
        Ok(created) => created,
        // Its owner's events wake this install (see `install_of`) when the name is free again.
        Err(err @ apply::HostWriteError::Conflict { .. }) => {
            return Ok((Action::await_change(), Some(job_conflict(install, ctx, &err))));
        }
        Err(err) => return Err(err.into()),
    };
    if applied == Applied::Created {
        return Ok((Action::requeue(SAFETY_NET), None));
    }
    let attempt: u32 = job::annotation(&observed, job::ATTEMPT_ANNOTATION)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    if job::annotation(&observed, job::PACKAGE_ANNOTATION) != Some(package.as_str()) {
        // An upgrade (spec.package changed): replace the Job; Crossplane never did.
        apply::delete(&jobs, &observed).await.map_err(InstallError::HostApi)?;
        event(
            install,
            ctx,
            EventType::Normal,
            "Upgrading",
            format!("package changed to {package}; replacing the install Job"),
        )
        .await;
        return Ok((
            Action::requeue(SAFETY_NET),
            Some(started(start_job(install, ctx, &parent, 1).await?)),
        ));
    }

    match job::state(&observed) {
        JobState::Running => {
            copy_pull_secrets(install, ctx, &parent, &observed).await?;
            let report = with_job(Report::waiting(
                "InstallJobRunning",
                format!("install Job {job_name} is unpacking {package}"),
            ));
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
            retry(
                install,
                ctx,
                &parent,
                &observed,
                attempt,
                at,
                "InstallJobFailed",
                message,
            )
            .await
        }
        JobState::Complete => complete(install, ctx, &parent, &observed, attempt, &package).await,
    }
}

/// Output of a completed Job: verify, check, apply; then report the Stack's readiness.
async fn complete<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    attempt: u32,
    package: &str,
) -> Result<(Action, Option<Report>), InstallError> {
    let tenant = &ctx.tenant;
    let namespace = install.namespace().unwrap_or_default();
    let name = install.name_any();
    let job_ref = HostObjectRef {
        namespace: tenant.host_namespace.clone(),
        name: observed.name_any(),
    };
    let uid = install.meta().uid.clone().unwrap_or_default();
    let stack = ctx.stacks.get(&ObjectRef::new(&name).within(&namespace));
    let stack_current = stack
        .as_ref()
        .is_some_and(|s| package::stack_current(s, &uid, install.install(), package));
    if stack_current {
        // The Stack is created last: a current one means everything of this package is applied.
        ctx.unpacked.forget(&uid);
    } else {
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
                    let at = completion_time(observed);
                    return retry(install, ctx, parent, observed, attempt, at, "InvalidPackage", message).await;
                }
            },
        };
        if let Some(existing) = stack.as_ref().filter(|s| !package::controlled_by(s, &uid)) {
            // Another's Stack at our name: its CRDs carry the same Stack label as ours would, so
            // nothing may be written for this install.
            ctx.unpacked.forget(&uid);
            let mut report = stack_conflict(existing, &namespace, &name);
            report.install_job = Some(job_ref);
            return Ok((Action::await_change(), Some(report)));
        }
        let all_crds = ctx.crds.state();
        let existing: BTreeMap<String, _> = all_crds.iter().map(|c| (c.name_any(), c.as_ref())).collect();
        let settings = &tenant.shared.settings;
        let installer = installer_of(install);
        let inputs = package::CheckInputs {
            scope: K::SCOPE,
            installer: &installer,
            existing_crds: &existing,
            pass_full_deployment: settings.insecure_pass_full_deployment,
            crd_rules: CrdRules {
                groups: &settings.stack_crd_groups,
                allow_conversion_webhooks: settings.insecure_allow_conversion_webhooks,
            },
            pod_policy: &settings.stack_pod_policy,
        };
        if let Err(err) = package::check(&contents, &inputs) {
            ctx.unpacked.forget(&uid);
            return Ok(refused(err, job_ref));
        }
        let crd_api = Api::all(tenant.client.clone());
        let applied = package::apply_crds(&crd_api, &contents, &existing, &installer)
            .await
            .map_err(InstallError::Tenant)?;
        let writes = applied.writes;
        if writes > 0 {
            event(
                install,
                ctx,
                EventType::Normal,
                "CRDsApplied",
                format!("applied {writes} CustomResourceDefinition(s) of {package}"),
            )
            .await;
        }
        let waiting = package::not_established(&contents, &existing);
        if applied.definitions > 0 && !applied.raced {
            // Their Established events bring this install back to create the Stack, moments from
            // now: a WaitingForCRDs status would be one more write per install, stale at once. If
            // they are not established by the next look, that look says so.
            return Ok((Action::requeue(ESTABLISH_WAIT), None));
        }
        if applied.raced || !waiting.is_empty() {
            let names = if waiting.is_empty() {
                contents
                    .crds
                    .iter()
                    .map(|c| c.name_any())
                    .collect::<Vec<_>>()
                    .join(", ")
            } else {
                waiting.join(", ")
            };
            let mut report = Report::waiting(
                "WaitingForCRDs",
                format!("waiting for CustomResourceDefinition(s) {names} to be Established"),
            );
            report.install_job = Some(job_ref);
            // Each CRD carries our label now, so its Established update wakes this install; one
            // created by another install meanwhile does not, so that case looks again soon.
            let wait = if applied.raced {
                tenant.shared.settings.backoff.base
            } else {
                SAFETY_NET
            };
            return Ok((Action::requeue(wait), Some(report)));
        }
        let desired = package::desired_stack(&contents, install, install.install(), package);
        let stacks: Api<Stack> = Api::namespaced(tenant.client.clone(), &namespace);
        match &stack {
            Some(existing) if stack_matches(existing, &desired) => {}
            Some(existing) => {
                let mut replacement = desired.clone();
                replacement.metadata.resource_version = existing.metadata.resource_version.clone();
                replacement.metadata.uid = existing.metadata.uid.clone();
                replacement.metadata.finalizers = existing.metadata.finalizers.clone();
                replacement.status = None;
                stacks
                    .replace(&name, &PostParams::default(), &replacement)
                    .await
                    .map_err(InstallError::Tenant)?;
                event(
                    install,
                    ctx,
                    EventType::Normal,
                    "StackUpdated",
                    format!("updated Stack {name} to {package}"),
                )
                .await;
            }
            None => match stacks.create(&PostParams::default(), &desired).await {
                Ok(_) => {
                    event(
                        install,
                        ctx,
                        EventType::Normal,
                        "StackCreated",
                        format!("created Stack {name} from {package}"),
                    )
                    .await;
                }
                Err(kube::Error::Api(status)) if status.code == 409 => {}
                Err(err) => return Err(InstallError::Tenant(err)),
            },
        }
    }
    let mut report = match stack.as_ref().filter(|_| stack_current) {
        Some(stack) => stack_readiness(stack),
        None => stack_on_its_way(&name),
    };
    report.synced = Some((
        true,
        "PackageApplied",
        format!("{package} is applied: its CRDs and Stack {name}"),
    ));
    report.install_job = Some(job_ref);
    report.stack_ref = Some(name);
    Ok((Action::requeue(SAFETY_NET), Some(report)))
}

fn stack_matches(existing: &Stack, desired: &Stack) -> bool {
    let labels = existing.labels();
    existing.spec == desired.spec
        && existing.annotations().get(job::PACKAGE_ANNOTATION) == desired.annotations().get(job::PACKAGE_ANNOTATION)
        && desired.labels().iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn stack_conflict(existing: &Stack, namespace: &str, name: &str) -> Report {
    let owner = existing
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| format!(" (it belongs to the {} {namespace}/{})", o.kind, o.name))
        .unwrap_or_default();
    Report::failed(
        "StackConflict",
        format!(
            "a Stack named {name} already exists in namespace {namespace} and is not this install's{owner}; delete it or install under another name"
        ),
    )
}

/// The Stack's `Ready` reasons that only say which step it waits for: the install says that the
/// Stack is on its way, once, instead of a status write for each step (the Stack shows them).
const STACK_PROGRESS_REASONS: &[&str] = &["WaitingForCrds", "WaitingForToken", "DeploymentUnavailable"];

fn stack_readiness(stack: &Stack) -> Report {
    let ready = stack
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Report {
            ready: (true, "Available", format!("Stack {} is ready", stack.name_any())),
            ..Report::waiting("", String::new())
        },
        Some(c) if !STACK_PROGRESS_REASONS.contains(&c.reason.as_str()) => Report::waiting(
            "WaitingForStack",
            format!("Stack {} is not ready: {}", stack.name_any(), c.message),
        ),
        _ => stack_on_its_way(&stack.name_any()),
    }
}

fn stack_on_its_way(name: &str) -> Report {
    Report::waiting(
        "WaitingForStack",
        format!("Stack {name} is not ready yet (its status says which step it is at)"),
    )
}

fn refused(err: PackageError, job_ref: HostObjectRef) -> (Action, Option<Report>) {
    let action = if err.retry_later() {
        // CRD events wake an install refused for a CRD (see `installs_using`); this is the safety net.
        Action::requeue(SAFETY_NET)
    } else {
        // Nothing but a new package (an edit of the install, which is an event) changes the outcome.
        Action::await_change()
    };
    let mut report = Report::failed(err.reason(), err.to_string());
    report.install_job = Some(job_ref);
    (action, Some(report))
}

/// A failed attempt: report it, and once the backoff for this attempt has passed, replace the Job.
#[allow(clippy::too_many_arguments)]
async fn retry<K: InstallKind>(
    install: &K,
    ctx: &InstallContext,
    parent: &Parent,
    observed: &Job,
    attempt: u32,
    failed_at: Option<jiff::Timestamp>,
    reason: &'static str,
    message: String,
) -> Result<(Action, Option<Report>), InstallError> {
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
        Ok((_, job)) => job,
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

/// When a reconcile that created or changed CRDs looks again if their events have not brought it
/// back: an API server establishes a CRD within moments.
const ESTABLISH_WAIT: Duration = Duration::from_secs(2);

/// The verified package contents in a completed Job's log and the log's size, or why there are none.
async fn read_output(ctx: &InstallContext, job: &Job) -> Result<(PackageContents, usize), String> {
    let log = unpack_log(ctx, job).await?;
    let contents =
        stream::decode(&log).map_err(|err| format!("install Job {} output refused: {err}", job.name_any()))?;
    Ok((contents, log.len()))
}
