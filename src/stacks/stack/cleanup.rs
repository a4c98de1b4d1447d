//! Uninstalling a Stack (§3.4, the Stack's half), and what it was given when no install controls it
//! any more: host objects, tenant RBAC and persona roles, its label on CRDs, and what this process
//! remembers of it.

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::info;

use super::apply_host::delete_host_objects;
use super::apply_tenant::delete_tenant;
use super::build::HostNames;
use super::context::{StackContext, StackError};
use super::status::{publish, stack_key};
use super::tenant::TenantIdentity;
use super::token;
use crate::api::stacks::Stack;
use crate::runtime::api_errors::is_not_found;
use crate::runtime::finalizer::Cleanup;
use crate::stacks::crd_parent_label;

/// §3.4, the Stack's half: host Deployment, host Secrets, tenant RBAC and persona roles, then this
/// Stack's label on its CRDs. The ServiceAccount, RoleBinding and token Secret go with the Stack by
/// their owner references.
pub(super) async fn cleanup(stack: &Stack, ctx: &StackContext) -> Result<Cleanup, StackError> {
    let tenant = &ctx.tenant;
    let caches = &ctx.caches;
    let identity = TenantIdentity::of(stack);
    let removed = delete_host_objects(ctx, &HostNames::of(stack, &tenant.name, &tenant.host_namespace).parent).await?;
    if removed > 0 {
        let note = format!(
            "deleted the controller Deployment and its token and pull-secret copies from the host namespace {}",
            tenant.host_namespace
        );
        publish(tenant, stack, EventType::Normal, "DeletedHostObjects", note).await;
    }
    for role in caches
        .cluster_roles
        .state()
        .iter()
        .filter(|r| identity.owns(r.as_ref()))
    {
        delete_tenant(&Api::<ClusterRole>::all(tenant.client.clone()), &role.name_any()).await?;
    }
    for binding in caches
        .cluster_role_bindings
        .state()
        .iter()
        .filter(|b| identity.owns(b.as_ref()))
    {
        delete_tenant(
            &Api::<ClusterRoleBinding>::all(tenant.client.clone()),
            &binding.name_any(),
        )
        .await?;
    }
    let label = crd_parent_label(&identity.namespace, &identity.name);
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.client.clone());
    for crd in caches.crds.state().iter().filter(|c| c.labels().contains_key(&label)) {
        let patch = json!({"metadata": {"labels": {label.clone(): null}}});
        match crds
            .patch(&crd.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    ctx.caches
        .token_secrets
        .forget(&identity.namespace, &token::tenant_secret_name(&identity));
    ctx.reported.forget(&stack_key(stack));
    ctx.written.forget(&stack.uid().unwrap_or_default());
    info!(host_objects = removed, "stack uninstalled");
    Ok(Cleanup::Done)
}
