//! §3.3 step 2 written: the tenant objects [`super::build`] made, in order (ServiceAccount, system
//! ClusterRole, its binding, the other kind's binding removed, persona roles, token Secret), each
//! created or repaired from its cached copy; the created and repaired ones reported as one Event each.

use std::ops::ControlFlow::{Break, Continue};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::build::{Binding, TenantObjects};
use super::context::{StackContext, StackError};
use super::outcome::{Notes, Step};
use super::tenant::{self, TenantIdentity, TenantWriteError};
use crate::host::apply::Applied;
use crate::runtime::api_errors::is_not_found;

/// Writes `objects` up to where they stop to wait; hands forward how the token Secret was written
/// (`observed_token` is its copy as read before).
pub(super) async fn write(
    ctx: &StackContext,
    objects: &TenantObjects,
    observed_token: Option<&Secret>,
    notes: &mut Notes,
) -> Result<Step<Applied>, StackError> {
    let mut writes = TenantWrites::default();
    let result = write_in_order(ctx, objects, observed_token, &mut writes).await;
    writes.report(notes);
    result
}

async fn write_in_order(
    ctx: &StackContext,
    objects: &TenantObjects,
    observed_token: Option<&Secret>,
    writes: &mut TenantWrites,
) -> Result<Step<Applied>, StackError> {
    let identity = &objects.identity;
    let (client, caches) = (&ctx.tenant.client, &ctx.caches);
    let ns = identity.namespace.as_str();
    let observed = caches.service_accounts.get(&ObjectRef::new(&identity.name).within(ns));
    let api = Api::namespaced(client.clone(), ns);
    let applied = tenant::ensure(&api, identity, &objects.service_account, observed.as_deref()).await?;
    writes.record(format!("ServiceAccount {}", identity.name), applied);
    let role = &objects.system_role;
    let applied = ensure_cluster_scoped(client, identity, role, &caches.cluster_roles).await?;
    writes.record(format!("ClusterRole {}", role.name_any()), applied);
    write_binding(ctx, identity, &objects.binding, writes).await?;
    if let Some(stale) = &objects.stale_binding {
        delete_binding(ctx, stale).await?;
    }
    let roles = match &objects.persona_roles {
        Continue(roles) => roles,
        Break(waiting) => return Ok(Break(waiting.clone())),
    };
    for role in roles {
        let applied = ensure_cluster_scoped(client, identity, role, &caches.cluster_roles).await?;
        writes.record(format!("ClusterRole {}", role.name_any()), applied);
    }
    let secret = &objects.token_secret;
    let api = Api::namespaced(client.clone(), ns);
    let applied = tenant::ensure(&api, identity, secret, observed_token).await?;
    writes.record(format!("Secret {}", secret.name_any()), applied);
    Ok(Continue(applied))
}

async fn write_binding(
    ctx: &StackContext,
    identity: &TenantIdentity,
    binding: &Binding,
    writes: &mut TenantWrites,
) -> Result<(), StackError> {
    let (client, caches) = (&ctx.tenant.client, &ctx.caches);
    match binding {
        Binding::Cluster(binding) => {
            let applied = ensure_cluster_scoped(client, identity, binding, &caches.cluster_role_bindings).await?;
            writes.record(format!("ClusterRoleBinding {}", binding.name_any()), applied);
        }
        Binding::Namespaced(binding) => {
            let ns = identity.namespace.as_str();
            let observed = caches
                .role_bindings
                .get(&ObjectRef::new(&binding.name_any()).within(ns));
            let api = Api::namespaced(client.clone(), ns);
            let applied = tenant::ensure(&api, identity, binding, observed.as_deref()).await?;
            writes.record(format!("RoleBinding {}", binding.name_any()), applied);
        }
    }
    Ok(())
}

async fn delete_binding(ctx: &StackContext, stale: &Binding) -> Result<(), StackError> {
    let client = &ctx.tenant.client;
    match stale {
        Binding::Namespaced(binding) => {
            let ns = binding.namespace().unwrap_or_default();
            delete_tenant(
                &Api::<RoleBinding>::namespaced(client.clone(), &ns),
                &binding.name_any(),
            )
            .await
        }
        Binding::Cluster(binding) => {
            delete_tenant(&Api::<ClusterRoleBinding>::all(client.clone()), &binding.name_any()).await
        }
    }
}

/// Tenant objects created or repaired in one reconcile, reported as one Event each.
#[derive(Default)]
struct TenantWrites {
    created: Vec<String>,
    repaired: Vec<String>,
}

impl TenantWrites {
    fn record(&mut self, what: String, applied: Applied) {
        match applied {
            Applied::Created => self.created.push(what),
            Applied::Updated => self.repaired.push(what),
            Applied::Unchanged => {}
        }
    }

    fn report(self, notes: &mut Notes) {
        if !self.created.is_empty() {
            notes.normal(
                "CreatedTenantObjects",
                format!("created on the tenant: {}", self.created.join(", ")),
            );
        }
        if !self.repaired.is_empty() {
            notes.normal(
                "RepairedTenantObjects",
                format!("brought back to the stack's spec: {}", self.repaired.join(", ")),
            );
        }
    }
}

async fn ensure_cluster_scoped<K>(
    client: &kube::Client,
    identity: &TenantIdentity,
    desired: &K,
    cache: &Store<K>,
) -> Result<Applied, TenantWriteError>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned,
{
    let observed = cache.get(&ObjectRef::new(&desired.name_any()));
    tenant::ensure(&Api::all(client.clone()), identity, desired, observed.as_deref()).await
}

/// Deletes a tenant object of the Stack's; one already gone is fine.
pub(super) async fn delete_tenant<K>(api: &Api<K>, name: &str) -> Result<(), StackError>
where
    K: Resource + Clone + std::fmt::Debug + DeserializeOwned,
{
    match api.delete(name, &Default::default()).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}
