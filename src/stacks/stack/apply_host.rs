//! §3.3 steps 3–4 written: the host objects [`super::build`] made (the token and pull-secret copies,
//! the copies of pull secrets no longer named removed, then the controller Deployment that mounts
//! and owns them), each created or repaired from its cached copy, and the removal of them all.

use std::ops::ControlFlow::{Break, Continue};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::build::{Copies, HostNames};
use super::context::{StackContext, StackError};
use super::outcome::{Notes, Step, not_running_yet};
use crate::host::apply::{self, Applied, HostWriteError, Update};
use crate::host::labels::Parent;

/// Creates or repairs the host Deployment (`observed`: its cached copy); stops when it was just
/// created (its watch event brings the uid the copies' owner reference needs).
pub(super) async fn write_deployment(
    ctx: &StackContext,
    host: &HostNames,
    desired: &Deployment,
    observed: Option<&Deployment>,
    notes: &mut Notes,
) -> Result<Step<()>, StackError> {
    let tenant = &ctx.tenant;
    let api: Api<Deployment> = Api::namespaced(tenant.host.clone(), &host.namespace);
    let applied = apply::ensure(
        &api,
        desired,
        observed,
        &host.tenant,
        &host.parent,
        Update::WhenDifferent(&tenant.host_writes),
    )
    .await
    .inspect_err(|err| notes.conflict(err))?;
    notes.controller_ref = Some(host.deployment_ref());
    let (namespace, name) = (&host.namespace, &host.deployment);
    match applied {
        Applied::Created => notes.normal(
            "CreatedDeployment",
            format!("created the controller Deployment {namespace}/{name} on the host"),
        ),
        Applied::Updated => notes.normal(
            "UpdatedDeployment",
            format!("brought the controller Deployment {namespace}/{name} on the host back to the stack's spec"),
        ),
        Applied::Unchanged => {}
    }
    if applied == Applied::Created {
        return Ok(Break(not_running_yet(namespace, name)));
    }
    Ok(Continue(()))
}

/// Copies the tenant token and pull secrets to the host Secrets the Deployment's pods use (again
/// whenever a source changes), then deletes the copies of pull secrets the Stack no longer names.
pub(super) async fn write_copies(
    ctx: &StackContext,
    host: &HostNames,
    copies: &Copies,
    notes: &mut Notes,
) -> Result<(), StackError> {
    write_token_copy(ctx, host, &copies.token_copy, notes).await?;
    let (mut created, mut updated) = (Vec::new(), Vec::new());
    for (source, copy) in &copies.pull_copies {
        let copied = format!("{source} as {}/{}", host.namespace, copy.name_any());
        match ensure_host_secret(ctx, host, copy, notes).await? {
            Copied::Created => created.push(copied),
            Copied::Updated => updated.push(copied),
            Copied::Owned | Copied::Unchanged => {}
        }
    }
    if !created.is_empty() {
        notes.normal(
            "CopiedPullSecrets",
            format!("copied imagePullSecret(s) to the host: {}", created.join(", ")),
        );
    }
    if !updated.is_empty() {
        notes.normal(
            "RecopiedPullSecrets",
            format!("copied changed imagePullSecret(s) to the host: {}", updated.join(", ")),
        );
    }
    let api: Api<Secret> = Api::namespaced(ctx.tenant.host.clone(), &host.namespace);
    let removed = apply::delete_all(&api, &copies.stale_pull_copies, &host.tenant, &host.parent)
        .await
        .map_err(HostWriteError::from)?;
    if removed > 0 {
        notes.normal(
            "DeletedPullSecrets",
            format!("deleted {removed} host copy(ies) of imagePullSecrets the stack no longer names"),
        );
    }
    Ok(())
}

/// Copies the tenant token to the host Secret the Deployment mounts, again whenever it changes.
async fn write_token_copy(
    ctx: &StackContext,
    host: &HostNames,
    copy: &Secret,
    notes: &mut Notes,
) -> Result<(), StackError> {
    let copied = ensure_host_secret(ctx, host, copy, notes).await?;
    notes.token_secret_ref = Some(host.token_copy_ref());
    let (namespace, name) = (&host.namespace, &host.secret);
    match copied {
        Copied::Created => notes.normal(
            "CopiedToken",
            format!("copied the controller's token to the host Secret {namespace}/{name}"),
        ),
        Copied::Updated => notes.normal(
            "RecopiedToken",
            format!("copied the controller's changed token to the host Secret {namespace}/{name}"),
        ),
        Copied::Owned | Copied::Unchanged => {}
    }
    Ok(())
}

/// What writing a host copy did.
enum Copied {
    Created,
    /// Its content changed.
    Updated,
    /// Only its owner reference was added (the Deployment exists now): nothing to tell the user.
    Owned,
    Unchanged,
}

/// Creates `copy` in the host namespace, or replaces the cached one when it differs (a replace the
/// host reverted waits out its backoff).
async fn ensure_host_secret(
    ctx: &StackContext,
    host: &HostNames,
    copy: &Secret,
    notes: &mut Notes,
) -> Result<Copied, StackError> {
    let api: Api<Secret> = Api::namespaced(ctx.tenant.host.clone(), &host.namespace);
    let observed = ctx
        .caches
        .host_secrets
        .get(&ObjectRef::new(&copy.name_any()).within(&host.namespace));
    let applied = apply::ensure(
        &api,
        copy,
        observed.as_deref(),
        &host.tenant,
        &host.parent,
        Update::WhenDifferent(&ctx.tenant.host_writes),
    )
    .await
    .inspect_err(|err| notes.conflict(err))?;
    let unowned = Secret {
        metadata: ObjectMeta {
            owner_references: None,
            ..copy.metadata.clone()
        },
        ..copy.clone()
    };
    let only_owner = observed.is_some_and(|observed| apply::changed_field(observed.as_ref(), &unowned).is_none());
    Ok(match applied {
        Applied::Created => Copied::Created,
        Applied::Updated if only_owner => Copied::Owned,
        Applied::Updated => Copied::Updated,
        Applied::Unchanged => Copied::Unchanged,
    })
}

/// Deletes the Stack's host Deployment (in the background, so its ReplicaSets go too), then its host
/// Secrets: every cached object carrying the Stack's labels, never one stackd did not label.
pub(super) async fn delete_host_objects(ctx: &StackContext, parent: &Parent) -> Result<usize, StackError> {
    let tenant = &ctx.tenant;
    let host_ns = tenant.host_namespace.as_str();
    let deployments: Vec<Deployment> = ctx.caches.deployments.state().iter().map(|d| (**d).clone()).collect();
    let api = Api::namespaced(tenant.host.clone(), host_ns);
    let removed = apply::delete_all(&api, &deployments, &tenant.name, parent)
        .await
        .map_err(HostWriteError::from)?;
    let secrets: Vec<Secret> = ctx.caches.host_secrets.state().iter().map(|s| (**s).clone()).collect();
    let api = Api::namespaced(tenant.host.clone(), host_ns);
    let removed = removed
        + apply::delete_all(&api, &secrets, &tenant.name, parent)
            .await
            .map_err(HostWriteError::from)?;
    Ok(removed)
}
