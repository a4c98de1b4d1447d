//! Deletion (DESIGN.md §4.3 items 6 and 11): stop the installer, run the destroy Job when there is
//! something to destroy, then release the CDC and the hosts, clean up the host and let the
//! ClusterDeployment go — decided by [`plan::deprovision`] and [`plan::release`].

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use tracing::info;

use super::installer::{self, Names};
use super::output::{self, Found, Look};
use super::plan::{self, Deprovision, Destroy, Release, Teardown};
use super::provision::ensure_installer_identity;
use super::{Ctx, DeploymentError, owned, parent};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::host::Parent;
use crate::host::apply::{self, Update, ensure, stamp};
use crate::host::ownership::{self, Ownership};
use crate::pools::{hosts, leases, membership};
use crate::runtime::api_errors::is_conflict;
use crate::runtime::finalizer::Cleanup;

/// Deprovisions a deleted cluster: done once everything is let go (its finalizer may then come
/// off), pending while something is still to wait for.
pub(super) async fn deprovision(cd: &ClusterDeployment, ctx: &Ctx) -> Result<Cleanup, DeploymentError> {
    let tenant = &ctx.tenant;
    let parent = parent(cd);
    let names = Names::of(cd);
    let host_ns = tenant.host_namespace.as_str();
    let jobs = owned(&ctx.jobs, &parent, &tenant.name);
    // Over the cache's cap, the output is not read: no state for the destroy Job, and it is
    // deleted unread.
    let refused = ctx.refused_secrets.contains(Some(host_ns), &names.output);
    let found = if refused {
        Found::Missing
    } else {
        output::find(ctx, cd, &parent, &names, Look::Cached).await?
    };
    let output = match found {
        Found::Trusted(secret) => Some(secret),
        // Its `metadata.json` is read once the cache shows it restored.
        Found::Restored { .. } => return Ok(Cleanup::Pending(Action::requeue(Duration::from_secs(5)))),
        Found::Missing | Found::Foreign(_) => None,
    };
    let destroy = ctx.jobs.get(&ObjectRef::new(&names.destroy).within(host_ns));
    let teardown = Teardown {
        cd,
        names: &names,
        jobs: &jobs,
        output: output.as_deref(),
        destroy: destroy.as_deref(),
    };
    let (stop, next) = match plan::deprovision(&teardown) {
        Deprovision::NotHeld => return Ok(Cleanup::Done),
        Deprovision::Proceed { stop, next } => (stop, next),
    };
    let host_jobs = Api::<Job>::namespaced(tenant.host.clone(), host_ns);
    for job in stop {
        apply::delete(&host_jobs, job).await.map_err(DeploymentError::HostApi)?;
    }
    let pending = match next {
        Destroy::Start(image) => start_destroy(cd, ctx, &parent, &names, &image).await?,
        Destroy::Wait => Action::await_change(),
        Destroy::Retry(job) => {
            apply::delete(&host_jobs, job).await.map_err(DeploymentError::HostApi)?;
            let note = format!("Destroy Job {} failed; retrying", names.destroy);
            publish(tenant, cd, true, "DeprovisionFailed", note).await;
            Action::requeue(Duration::from_secs(5))
        }
        Destroy::Done => return let_go(cd, ctx, &parent, &names).await,
    };
    Ok(Cleanup::Pending(pending))
}

async fn start_destroy(
    cd: &ClusterDeployment,
    ctx: &Ctx,
    parent: &Parent,
    names: &Names,
    image: &str,
) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let host_ns = tenant.host_namespace.as_str();
    ensure_installer_identity(ctx, parent, names).await?;
    let deadline = tenant.shared.settings.installer_deadline;
    let mut job = installer::installer_job(
        &names.destroy,
        host_ns,
        names,
        image,
        &cd.spec.cluster_name,
        true,
        deadline,
    );
    stamp(&mut job, &tenant.name, parent);
    installer::label_pods(&mut job);
    let jobs = Api::<Job>::namespaced(tenant.host.clone(), host_ns);
    if ensure(&jobs, &job, None, &tenant.name, parent, Update::Never)
        .await?
        .wrote()
    {
        let note = format!("Destroy Job {} started", names.destroy);
        publish(tenant, cd, false, "DeprovisionStarted", note).await;
    }
    Ok(Action::await_change())
}

/// Deprovisioned: now (and only now) the CDC may be leased again and the hosts reused, and only
/// for a cluster its pool created; then the host objects go and so does the finalizer.
async fn let_go(cd: &ClusterDeployment, ctx: &Ctx, parent: &Parent, names: &Names) -> Result<Cleanup, DeploymentError> {
    let tenant = &ctx.tenant;
    let made_by_pool = membership::created_by_named_pool(&tenant.client, cd)
        .await
        .map_err(DeploymentError::Tenant)?;
    let release = plan::release(cd, made_by_pool);
    if release.refused {
        let message = membership::release_refused_message(cd);
        publish(tenant, cd, true, membership::RELEASE_REFUSED, message).await;
    }
    if let Some(retry) = release_customization(cd, tenant, &release).await? {
        return Ok(Cleanup::Pending(Action::requeue(retry)));
    }
    if let Some(ns) = &release.hosts_namespace {
        let assets = Api::<BareMetalAsset>::namespaced(tenant.client.clone(), ns);
        let released = hosts::release_all(&assets, &cd.name_any())
            .await
            .map_err(DeploymentError::Tenant)?;
        if released > 0 {
            info!(released, "bare-metal hosts released");
        }
    }
    clean_host(ctx, parent, names).await?;
    info!("cluster deprovisioned");
    Ok(Cleanup::Done)
}

/// Releases the CDC the cluster was built from (only if it still points at this cluster and pool).
/// `Some(retry)` when its lease changed meanwhile.
async fn release_customization(
    cd: &ClusterDeployment,
    tenant: &TenantContext,
    release: &Release,
) -> Result<Option<Duration>, DeploymentError> {
    let Some((namespace, name, pool)) = &release.customization else {
        return Ok(None);
    };
    let cdcs = Api::<ClusterDeploymentCustomization>::namespaced(tenant.client.clone(), namespace);
    let Some(cdc) = cdcs.get_opt(name).await.map_err(DeploymentError::Tenant)? else {
        return Ok(None);
    };
    match leases::release(&cdcs, &cdc, &cd.name_any(), pool).await {
        Ok(true) => {
            let note = format!("Released by ClusterDeployment {} after its deprovision", cd.name_any());
            publish(tenant, &cdc, false, "Released", note).await;
            Ok(None)
        }
        Ok(false) => Ok(None),
        Err(err) if is_conflict(&err) => Ok(Some(Duration::from_millis(200))),
        Err(err) => Err(DeploymentError::Tenant(err)),
    }
}

/// Deletes the cluster's host objects: its Jobs as cached now, its output Secret by name (the
/// installer may have relabelled it) then its input Secret, and the installer's identity after
/// proving it is this cluster's. A Secret labelled for this cluster under another name is another
/// installer's writing, not this cluster's: it is left alone.
async fn clean_host(ctx: &Ctx, parent: &Parent, names: &Names) -> Result<(), DeploymentError> {
    let tenant = &ctx.tenant;
    let (host, host_ns) = (&tenant.host, tenant.host_namespace.as_str());
    let jobs = Api::<Job>::namespaced(host.clone(), host_ns);
    apply::delete_all(&jobs, &owned(&ctx.jobs, parent, &tenant.name), &tenant.name, parent)
        .await
        .map_err(DeploymentError::HostApi)?;
    // Before the input Secret, which records the output's uid.
    output::delete(ctx, parent, names).await?;
    let secrets = Api::<Secret>::namespaced(host.clone(), host_ns);
    let inputs: Vec<Secret> = owned(&ctx.secrets, parent, &tenant.name)
        .into_iter()
        .filter(|s| s.name_any() == names.input)
        .collect();
    apply::delete_all(&secrets, &inputs, &tenant.name, parent)
        .await
        .map_err(DeploymentError::HostApi)?;
    let name = &names.installer;
    delete_owned(
        &Api::<ServiceAccount>::namespaced(host.clone(), host_ns),
        name,
        tenant,
        parent,
    )
    .await?;
    delete_owned(&Api::<Role>::namespaced(host.clone(), host_ns), name, tenant, parent).await?;
    delete_owned(
        &Api::<RoleBinding>::namespaced(host.clone(), host_ns),
        name,
        tenant,
        parent,
    )
    .await?;
    Ok(())
}

/// Deletes the host object `name` if it is this cluster's (ownership proof, uid precondition).
async fn delete_owned<K>(
    api: &Api<K>,
    name: &str,
    tenant: &TenantContext,
    parent: &Parent,
) -> Result<(), DeploymentError>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let Some(object) = api.get_opt(name).await.map_err(DeploymentError::HostApi)? else {
        return Ok(());
    };
    if ownership::check(object.labels(), object.annotations(), &tenant.name, parent) == Ownership::Ours {
        apply::delete(api, &object).await.map_err(DeploymentError::HostApi)?;
    }
    Ok(())
}
