//! The reads a Stack's objects are built from (§3.3), all before anything is written: the caches
//! the watches keep, the token Secret's data when it moved, and the tenant pull secrets the
//! controller names.

use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::build::{HostNames, Observed};
use super::context::{StackContext, StackError};
use super::rbac;
use super::tenant::TenantIdentity;
use super::token;
use super::validate::CheckedController;
use crate::api::stacks::StackDefinition;
use crate::host::pod_trouble::PodTrouble;
use crate::stacks::pull_secrets;

/// Reads what [`super::build::build`] needs for `identity`'s Stack and its host objects `host`.
pub(super) async fn observe(
    ctx: &StackContext,
    identity: &TenantIdentity,
    controller: Option<&CheckedController<'_>>,
    host: &HostNames,
) -> Result<Observed, StackError> {
    let caches = &ctx.caches;
    let ns = identity.namespace.as_str();
    let binding = rbac::binding_name(identity);
    let tenant_secrets = Api::namespaced(ctx.tenant.client.clone(), ns);
    // The pull secrets only when there is a controller to pull with them.
    let pull_secrets = match controller.filter(|c| !c.pull_secrets.is_empty()) {
        Some(controller) => pull_secrets::read(&tenant_secrets, &controller.pull_secrets).await?,
        None => Vec::new(),
    };
    let token_secret = caches
        .token_secrets
        .current(&tenant_secrets, ns, &token::tenant_secret_name(identity))
        .await?;
    // Read, not watched: only templating stacks have one, and each reconcile of one reads it once.
    let stack_definition = match controller.filter(|c| c.stack_definition.is_some()) {
        Some(_) => {
            Api::<StackDefinition>::namespaced(ctx.tenant.client.clone(), ns)
                .get_opt(&identity.name)
                .await?
        }
        None => None,
    };
    let deployment = caches
        .deployments
        .get(&ObjectRef::new(&host.deployment).within(&host.namespace));
    let pod_trouble = deployment.as_ref().and_then(|d| pod_trouble(ctx, d));
    Ok(Observed {
        crds: caches.crds.state(),
        role_binding: caches.role_bindings.get(&ObjectRef::new(&binding).within(ns)),
        cluster_role_binding: caches.cluster_role_bindings.get(&ObjectRef::new(&binding)),
        token_secret,
        pull_secrets,
        deployment,
        pod_trouble,
        host_secrets: caches.host_secrets.state(),
        stack_definition,
    })
}

/// What the kubelet says of the newest of the Deployment's pods that has trouble, if one has.
fn pod_trouble(ctx: &StackContext, deployment: &Deployment) -> Option<PodTrouble> {
    let pods = ctx.caches.pods.state();
    let mut own: Vec<_> = pods
        .iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .filter(|pod| super::deployment_of(&ctx.caches.deployments, pod).is_some_and(|d| d.uid() == deployment.uid()))
        .collect();
    own.sort_by_key(|pod| std::cmp::Reverse(pod.metadata.creation_timestamp.clone().map(|t| t.0)));
    own.into_iter().find_map(|pod| PodTrouble::of(pod))
}
