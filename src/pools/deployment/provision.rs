//! Provisioning (DESIGN.md §4.2, §4.3 item 11): the finalizer, the failure-domain record, then the
//! current install attempt — observed from the caches, decided by [`plan::provision`], carried
//! out on the host and reported in the status.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::{info, warn};

use super::admin_kubeconfig::{self, Existing};
use super::installer::{self, Names};
use super::output::{self, Found, Look};
use super::plan::{self, AttemptStep, Inputs, Output, Provision, Snapshot};
use super::status::Outcome;
use super::{Ctx, DeploymentError, REFUSED_RECHECK, owned, parent, refused_host_secret, report, tenant_secret_recheck};
use crate::api::pools::ClusterDeployment;
use crate::bounds;
use crate::context::events::publish;
use crate::host::Parent;
use crate::host::apply::{self, HostWriteError, Update, ensure, ensure_created, stamp};
use crate::host::pod_trouble::{self, JobEnd, PodRefusal, TroubleKind};
use crate::host::quota_share::SHARE_NAMESPACE_LABEL;
use crate::pools::{POOL_NAME_LABEL, POOL_NAMESPACE_LABEL, record};

pub(super) async fn provision(cd: &ClusterDeployment, ctx: &Ctx) -> Result<Action, DeploymentError> {
    let names = Names::of(cd);
    if let Some(refused) = refused_host_secret(ctx, &names) {
        report(cd, ctx, &refused).await?;
        return Ok(Action::requeue(REFUSED_RECHECK));
    }
    if keep_record(cd, ctx, &names).await? {
        return Ok(Action::await_change());
    }
    let tenant = &ctx.tenant;
    let jobs = owned(&ctx.jobs, &parent(cd), &tenant.name);
    let job_name = Names::install_job(cd, plan::attempt(cd));
    let current = ctx.jobs.get(&ObjectRef::new(&job_name).within(&tenant.host_namespace));
    let snapshot = Snapshot {
        cd,
        names: &names,
        jobs: &jobs,
        current: current.as_deref(),
    };
    let (stale, next) = match plan::provision(&snapshot) {
        Provision::Settled => return Ok(Action::await_change()),
        Provision::Attempt { stale, next } => (stale, next),
    };
    let host_jobs = Api::<Job>::namespaced(tenant.host.clone(), &tenant.host_namespace);
    for job in stale {
        apply::delete(&host_jobs, job).await.map_err(DeploymentError::HostApi)?;
    }
    match next {
        AttemptStep::Wait => {
            let Some(job) = current.as_deref() else {
                return Ok(Action::await_change());
            };
            // The pod's events bring the cluster back when the kubelet says something else.
            if let Some(trouble) = pod_trouble::of_job(&ctx.pods, job) {
                let message = format!(
                    "Installer Job {}/{job_name} cannot start: {}",
                    tenant.host_namespace,
                    trouble.describe("the pool's spec.installerImage and spec.pullSecretRef")
                );
                report(cd, ctx, &Outcome::InstallerPodWaiting(message)).await?;
                return Ok(Action::await_change());
            }
            let refusal = pod_trouble::refusal_of_job(&tenant.host, &ctx.pods, job)
                .await
                .map_err(DeploymentError::HostApi)?;
            match refusal {
                PodRefusal::HasPod => Ok(Action::await_change()),
                PodRefusal::TooSoon(again) => Ok(Action::requeue(again)),
                PodRefusal::Unsaid => Ok(Action::requeue(pod_trouble::REFUSAL_LOOK_EVERY)),
                PodRefusal::Refused(said) => {
                    let message = format!(
                        "The host refuses to create the pod of installer Job {}/{job_name}: {said}",
                        tenant.host_namespace
                    );
                    report(cd, ctx, &Outcome::InstallerPodRefused(message)).await?;
                    Ok(Action::requeue(pod_trouble::REFUSAL_LOOK_EVERY))
                }
            }
        }
        AttemptStep::Succeeded => installed(cd, ctx, &names).await,
        // Not written (a newer copy exists): its watch event brings this attempt back to be
        // counted once.
        AttemptStep::Failed(mut outcome) => {
            // How its pod ended is part of the failure: counted once, so not before the cache
            // shows it (the pod's event brings the cluster back).
            let end = current.as_deref().map(|job| pod_trouble::end_of_job(&ctx.pods, job));
            if end == Some(JobEnd::Pending) {
                // Woken by the pod's event; looked at again after the grace should it be gone.
                return Ok(Action::requeue(pod_trouble::POD_CACHE_GRACE));
            }
            if let (Outcome::InstallFailed { ended, .. }, Some(JobEnd::Ended(Some(trouble)))) = (&mut outcome, end) {
                *ended = Some(match trouble.kind {
                    TroubleKind::OutOfMemory => trouble.describe(""),
                    _ => trouble.said(),
                });
            }
            report(cd, ctx, &outcome).await.map(|_| Action::await_change())
        }
        AttemptStep::Start => start(cd, ctx, &names, &job_name).await,
    }
}

/// Writes the failure-domain record into the status when it is missing or was edited (§6).
/// Returns whether it wrote (the write's watch event brings the cluster back).
async fn keep_record(cd: &ClusterDeployment, ctx: &Ctx, names: &Names) -> Result<bool, DeploymentError> {
    let tenant = &ctx.tenant;
    let host_input = ctx
        .secrets
        .get(&ObjectRef::new(&names.input).within(&tenant.host_namespace));
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &cd.namespace().unwrap_or_default());
    let Some(record) = record::wanted(cd, host_input.as_deref(), &secrets)
        .await
        .map_err(DeploymentError::Tenant)?
    else {
        return Ok(false);
    };
    let edited = cd.status.as_ref().is_some_and(|s| !s.failure_domains.is_empty());
    report(cd, ctx, &Outcome::RecordRestored { record, edited }).await
}

/// Gathers the inputs and starts the installer Job `job_name` of the current attempt.
async fn start(cd: &ClusterDeployment, ctx: &Ctx, names: &Names, job_name: &str) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &cd.namespace().unwrap_or_default());
    let mut read = Vec::new();
    for (what, name) in plan::input_refs(cd) {
        let secret = secrets.get_opt(&name).await.map_err(DeploymentError::Tenant)?;
        read.push((what, name, secret));
    }
    let limit = bounds::host_secret_limit(tenant.shared.settings.max_cached_object_bytes);
    let inputs = match plan::inputs(cd, read, limit) {
        Ok(inputs) => inputs,
        Err(outcome) => {
            report(cd, ctx, &outcome).await?;
            return Ok(match outcome {
                // Tenant Secrets are not watched: look for the missing ones again.
                Outcome::MissingInputs(_) => Action::requeue(Duration::from_secs(10)),
                _ => Action::await_change(),
            });
        }
    };
    let parent = parent(cd);
    let host_ns = tenant.host_namespace.as_str();
    let image = inputs.installer_image.clone();
    let registries = &tenant.shared.settings.allowed_registries;
    if let Some(refusal) = registries.refusal("the installer image", &image) {
        // Checked where the Job is made, so a ClusterDeployment made by hand is bounded too.
        report(cd, ctx, &Outcome::InstallerImageRefused(refusal)).await?;
        return Ok(Action::await_change());
    }
    let deadline = tenant.shared.settings.installer_deadline;
    let mut job = installer::installer_job(job_name, host_ns, names, &image, &cd.spec.cluster_name, false, deadline);
    stamp(&mut job, &tenant.name, &parent);
    installer::label_pods(&mut job);
    // Before anything is written for it: a Job its namespace has no share of the host quota for.
    let what = format!("the installer Job {host_ns}/{job_name}");
    let namespace = share_namespace(cd, ctx);
    if Some(&namespace) != cd.metadata.namespace.as_ref() {
        job.labels_mut().insert(SHARE_NAMESPACE_LABEL.into(), namespace.clone());
    }
    if let Err(refused) = tenant.check_quota_share(&what, &namespace, &job, None) {
        report(cd, ctx, &Outcome::QuotaShareExceeded(refused.to_string())).await?;
        // The namespace's other workloads going bring this cluster no event of its own.
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    write_installer_inputs(ctx, cd, &parent, names, inputs).await?;
    ensure_installer_identity(ctx, &parent, names).await?;
    let jobs = Api::<Job>::namespaced(tenant.host.clone(), host_ns);
    let attempt = plan::attempt(cd);
    if ensure(&jobs, &job, None, &tenant.name, &parent, Update::Never)
        .await?
        .wrote()
    {
        info!(attempt = attempt + 1, "installer Job started");
        let note = format!("Installer Job {job_name} started (attempt {})", attempt + 1);
        publish(tenant, cd, false, "InstallStarted", note).await;
    }
    let running = Outcome::Provisioning {
        host_namespace: host_ns.into(),
        job: job_name.into(),
        attempt,
    };
    report(cd, ctx, &running).await?;
    Ok(Action::await_change())
}

/// The tenant namespace whose share of the host quota a cluster's installer takes: its pool's when
/// stackd made the cluster's namespace for a pool (the Namespace's labels say so, which no
/// namespaced role can write), else its own.
fn share_namespace(cd: &ClusterDeployment, ctx: &Ctx) -> String {
    let own = cd.namespace().unwrap_or_default();
    let namespaces = ctx.tenant.caches.tenant::<Namespace>(POOL_NAME_LABEL).store();
    let made_for_pool = namespaces.get(&ObjectRef::new(&own));
    let pool_namespace = made_for_pool.and_then(|namespace| namespace.labels().get(POOL_NAMESPACE_LABEL).cloned());
    pool_namespace.unwrap_or(own)
}

/// The output Secret the installer fills, then the input Secret (updated when the inputs change)
/// recording the output's uid.
async fn write_installer_inputs(
    ctx: &Ctx,
    cd: &ClusterDeployment,
    parent: &Parent,
    names: &Names,
    inputs: Inputs,
) -> Result<(), DeploymentError> {
    let tenant = &ctx.tenant;
    let host_ns = tenant.host_namespace.as_str();
    let host_secrets = Api::<Secret>::namespaced(tenant.host.clone(), host_ns);
    let output_uid = ensure_output(ctx, cd, parent, names).await?;
    let mut input = installer::input_secret(names, host_ns, inputs.data, &output_uid);
    stamp(&mut input, &tenant.name, parent);
    let reverts = Update::WhenDifferent(&tenant.host_writes);
    let observed = ctx.secrets.get(&ObjectRef::new(&names.input).within(host_ns));
    ensure(
        &host_secrets,
        &input,
        observed.as_deref(),
        &tenant.name,
        parent,
        reverts,
    )
    .await?;
    Ok(())
}

/// The output Secret stackd made for the installer (created now if there is none); its uid.
async fn ensure_output(
    ctx: &Ctx,
    cd: &ClusterDeployment,
    parent: &Parent,
    names: &Names,
) -> Result<String, DeploymentError> {
    let tenant = &ctx.tenant;
    let host_ns = tenant.host_namespace.as_str();
    match output::find(ctx, cd, parent, names, Look::Cached).await? {
        Found::Trusted(secret) => Ok(secret.uid().unwrap_or_default()),
        Found::Restored { uid } => Ok(uid),
        Found::Missing => {
            let mut output = installer::output_secret(names, host_ns);
            stamp(&mut output, &tenant.name, parent);
            let host_secrets = Api::<Secret>::namespaced(tenant.host.clone(), host_ns);
            let (_, made) = ensure_created(&host_secrets, &output, None, &tenant.name, parent).await?;
            Ok(made.uid().unwrap_or_default())
        }
        Found::Foreign(reason) => Err(HostWriteError::Conflict {
            kind: "Secret".into(),
            namespace: host_ns.into(),
            name: names.output.clone(),
            reason,
        }
        .into()),
    }
}

/// The ServiceAccount the installer runs as, with its Role and RoleBinding.
pub(super) async fn ensure_installer_identity(ctx: &Ctx, parent: &Parent, names: &Names) -> Result<(), HostWriteError> {
    let tenant = &ctx.tenant;
    let ns = tenant.host_namespace.as_str();
    let (mut account, mut role, mut binding) = installer::identity(names, ns);
    stamp(&mut account, &tenant.name, parent);
    stamp(&mut role, &tenant.name, parent);
    stamp(&mut binding, &tenant.name, parent);
    let host = &tenant.host;
    let never = Update::Never;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &account,
        None,
        &tenant.name,
        parent,
        never,
    )
    .await?;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &role,
        None,
        &tenant.name,
        parent,
        never,
    )
    .await?;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &binding,
        None,
        &tenant.name,
        parent,
        never,
    )
    .await?;
    Ok(())
}

/// The installer succeeded: copy the admin kubeconfig to the tenant and record the cluster installed.
async fn installed(cd: &ClusterDeployment, ctx: &Ctx, names: &Names) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let mut output = finished_output(cd, ctx, names, Look::Cached).await?;
    if output.accepted() {
        // About to be read for good, so as the server has it: the installer's last change (its
        // labels stripped, say) may not have reached the cache, whose watch is not the Job's. One
        // GET per finished installer: the cluster is installed next.
        output = finished_output(cd, ctx, names, Look::Server).await?;
    }
    let output = match output {
        FinishedOutput::Readable(found) => Some(found),
        FinishedOutput::Missing => None,
        // The Secret's watch event brings us back; the requeue is a safety net.
        FinishedOutput::Restoring => return Ok(Action::requeue(Duration::from_secs(5))),
        FinishedOutput::Refused => return Ok(Action::await_change()),
    };
    let secret = admin_kubeconfig::name(cd);
    let (kubeconfig, infra_id) = match plan::output(output.as_deref()) {
        // The Secret's watch event brings us back; the requeue is a safety net.
        Output::Pending => return Ok(Action::requeue(Duration::from_secs(5))),
        Output::TooLarge(refusal) => {
            report(cd, ctx, &Outcome::OutputRefused(refusal)).await?;
            return Ok(Action::await_change());
        }
        Output::Refused(refusal) => {
            let stopped = Outcome::KubeconfigRefused {
                secret,
                refusal: refusal.to_string(),
            };
            if report(cd, ctx, &stopped).await? {
                warn!(%refusal, "installer kubeconfig refused");
            }
            return Ok(Action::await_change());
        }
        Output::Accepted { kubeconfig, infra_id } => (kubeconfig, infra_id),
    };
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &cd.namespace().unwrap_or_default());
    if !copy_admin_kubeconfig(cd, &secrets, kubeconfig).await? {
        report(cd, ctx, &Outcome::KubeconfigConflict { secret }).await?;
        // Waits until the Secret is gone.
        return Ok(Action::requeue(tenant_secret_recheck(ctx)));
    }
    if report(cd, ctx, &Outcome::Installed { secret, infra_id }).await? {
        info!("cluster installed");
    }
    Ok(Action::await_change())
}

/// What a finished installer left, as `look` finds it.
enum FinishedOutput {
    /// Its output Secret, stackd's own and within its bound: to be read.
    Readable(Arc<Secret>),
    /// There is no output Secret.
    Missing,
    /// The output Secret is being restored: wait for it.
    Restoring,
    /// Refused (too large, or not stackd's) and reported: nothing to do until it changes.
    Refused,
}

impl FinishedOutput {
    /// Whether it holds what an installed cluster needs.
    fn accepted(&self) -> bool {
        let FinishedOutput::Readable(secret) = self else {
            return false;
        };
        matches!(plan::output(Some(secret)), Output::Accepted { .. })
    }
}

/// The finished installer's output Secret as `look` finds it; one that is refused is reported.
async fn finished_output(
    cd: &ClusterDeployment,
    ctx: &Ctx,
    names: &Names,
    look: Look,
) -> Result<FinishedOutput, DeploymentError> {
    match output::find(ctx, cd, &parent(cd), names, look).await? {
        Found::Trusted(secret) => {
            // Measured before anything of it is read.
            let limits = &ctx.tenant.shared.settings.document_limits;
            if let Err(refused) = limits.installer_output(&ctx.tenant.host_namespace, &secret) {
                report(cd, ctx, &Outcome::OutputRefused(refused.to_string())).await?;
                return Ok(FinishedOutput::Refused);
            }
            Ok(FinishedOutput::Readable(secret))
        }
        Found::Restored { .. } => Ok(FinishedOutput::Restoring),
        Found::Missing => Ok(FinishedOutput::Missing),
        Found::Foreign(reason) => {
            let refusal = format!("host Secret {}/{}: {reason}", ctx.tenant.host_namespace, names.output);
            report(cd, ctx, &Outcome::OutputRefused(refusal)).await?;
            Ok(FinishedOutput::Refused)
        }
    }
}

/// Creates the tenant Secret `<cd>-admin-kubeconfig`, or updates the one stackd made for this
/// cluster. False when a Secret of that name belongs to someone else (it is left untouched).
async fn copy_admin_kubeconfig(
    cd: &ClusterDeployment,
    secrets: &Api<Secret>,
    kubeconfig: String,
) -> Result<bool, DeploymentError> {
    let kubeconfig = ByteString(kubeconfig.into_bytes());
    let name = admin_kubeconfig::name(cd);
    let wanted = admin_kubeconfig::secret(cd, kubeconfig.clone());
    // Read first: a Secret in conflict is rechecked until it goes, and a recheck must not write.
    let Some(found) = secrets.get_opt(&name).await.map_err(DeploymentError::Tenant)? else {
        // Made meanwhile (409): the error's retry reads it.
        secrets
            .create(&PostParams::default(), &wanted)
            .await
            .map_err(DeploymentError::Tenant)?;
        return Ok(true);
    };
    match admin_kubeconfig::existing(found, cd, kubeconfig) {
        Existing::Foreign => Ok(false),
        Existing::Current => Ok(true),
        Existing::Replace(updated) => {
            secrets
                .replace(&name, &PostParams::default(), &updated)
                .await
                .map_err(DeploymentError::Tenant)?;
            Ok(true)
        }
    }
}
