//! §3.3 step 2 written: the tenant objects [`super::build`] made, in two rounds of concurrent writes
//! (the ServiceAccount and the ClusterRoles; then the binding, the other kind's binding removed, and
//! the token Secret), each created or repaired from its cached copy; the created and repaired ones
//! reported as one Event each.

use std::ops::ControlFlow::{Break, Continue};

use futures::future::join_all;
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
use crate::api::stacks::StackDefinition;
use crate::host::apply::Applied;
use crate::runtime::api_errors::is_not_found;

/// Writes `objects` up to where they stop to wait; hands forward how the token Secret was written
/// (`observed_token` is its copy as read before).
pub(super) async fn write(
    ctx: &StackContext,
    objects: &TenantObjects,
    observed: Observed<'_>,
    notes: &mut Notes,
) -> Result<Step<Applied>, StackError> {
    let mut writes = TenantWrites::default();
    let result = write_in_order(ctx, objects, observed, &mut writes).await;
    writes.report(notes);
    result
}

/// The copies of the tenant objects read before, where no cache has them.
pub(super) struct Observed<'a> {
    pub token: Option<&'a Secret>,
    pub stack_definition: Option<&'a StackDefinition>,
}

/// Two rounds of concurrent writes: first what names nothing (the ServiceAccount, the system
/// ClusterRole, the persona roles once the stack's CRDs are there, a templating stack's
/// StackDefinition), then what names those (the
/// binding, which grants its role; the token Secret, which a tenant's token controller deletes while
/// its ServiceAccount is missing). Every write of a round is made and recorded before the round's
/// first error is returned, so the Event names all that was written.
async fn write_in_order(
    ctx: &StackContext,
    objects: &TenantObjects,
    observed: Observed<'_>,
    writes: &mut TenantWrites,
) -> Result<Step<Applied>, StackError> {
    let observed_token = observed.token;
    let identity = &objects.identity;
    let (client, caches) = (&ctx.tenant.client, &ctx.caches);
    let ns = identity.namespace.as_str();
    let (persona_roles, waiting) = match &objects.persona_roles {
        Continue(roles) => (roles.as_slice(), None),
        Break(waiting) => (&[][..], Some(waiting)),
    };

    let service_account = async {
        let observed = caches.service_accounts.get(&ObjectRef::new(&identity.name).within(ns));
        let api = Api::namespaced(client.clone(), ns);
        tenant::ensure(&api, identity, &objects.service_account, observed.as_deref()).await
    };
    let stack_definition = async {
        match &objects.stack_definition {
            Some(definition) => {
                let api = Api::namespaced(client.clone(), ns);
                Some(tenant::ensure(&api, identity, definition, observed.stack_definition).await)
            }
            None => None,
        }
    };
    let roles = || std::iter::once(&objects.system_role).chain(persona_roles);
    let ensure_roles = roles().map(|role| ensure_cluster_scoped(client, identity, role, &caches.cluster_roles));
    let (service_account, applied_roles, stack_definition) =
        futures::join!(service_account, join_all(ensure_roles), stack_definition);
    let mut first_error = writes.keep(format!("ServiceAccount {}", identity.name), service_account);
    if let Some(applied) = stack_definition {
        let error = writes.keep(format!("StackDefinition {}", identity.name), applied);
        first_error = first_error.or(error);
    }
    for (role, applied) in roles().zip(applied_roles) {
        let error = writes.keep(format!("ClusterRole {}", role.name_any()), applied);
        first_error = first_error.or(error);
    }
    if let Some(err) = first_error {
        return Err(err.into());
    }

    let binding = async {
        let (what, applied) = write_binding(ctx, identity, &objects.binding).await;
        // The other kind's binding goes once this one grants the role.
        let stale = match (&applied, &objects.stale_binding) {
            (Ok(_), Some(stale)) => delete_binding(ctx, stale).await,
            _ => Ok(()),
        };
        (what, applied, stale)
    };
    let secret = &objects.token_secret;
    let token = async {
        match waiting {
            Some(waiting) => Ok(Break(waiting.clone())),
            None => {
                let api = Api::namespaced(client.clone(), ns);
                tenant::ensure(&api, identity, secret, observed_token)
                    .await
                    .map(Continue)
            }
        }
    };
    let ((what, binding, stale), token) = futures::join!(binding, token);
    let binding_error = writes.keep(what, binding).map(StackError::from);
    let token = token.inspect(|step| {
        if let Continue(applied) = step {
            writes.record(format!("Secret {}", secret.name_any()), *applied);
        }
    });
    if let Some(err) = binding_error {
        return Err(err);
    }
    stale?;
    Ok(token?)
}

/// The binding of the system ClusterRole, written; what it is, for the Event.
async fn write_binding(
    ctx: &StackContext,
    identity: &TenantIdentity,
    binding: &Binding,
) -> (String, Result<Applied, TenantWriteError>) {
    let (client, caches) = (&ctx.tenant.client, &ctx.caches);
    match binding {
        Binding::Cluster(binding) => (
            format!("ClusterRoleBinding {}", binding.name_any()),
            ensure_cluster_scoped(client, identity, binding, &caches.cluster_role_bindings).await,
        ),
        Binding::Namespaced(binding) => {
            let ns = identity.namespace.as_str();
            let observed = caches
                .role_bindings
                .get(&ObjectRef::new(&binding.name_any()).within(ns));
            let api = Api::namespaced(client.clone(), ns);
            (
                format!("RoleBinding {}", binding.name_any()),
                tenant::ensure(&api, identity, binding, observed.as_deref()).await,
            )
        }
    }
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

    /// Records a write that succeeded; hands back the error of one that did not.
    fn keep(&mut self, what: String, written: Result<Applied, TenantWriteError>) -> Option<TenantWriteError> {
        match written {
            Ok(applied) => {
                self.record(what, applied);
                None
            }
            Err(err) => Some(err),
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
