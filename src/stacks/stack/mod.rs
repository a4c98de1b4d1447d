//! The Stack controller (DESIGN.md §3.3, and the Stack half of §3.4): per tenant, it gives each Stack
//! its identity and permissions on the tenant, copies the controller's token to the host and runs the
//! controller Deployment there, repairing drift on either side as the watches report it.
//!
//! This file wires the watches; [`reconcile`] is the driver, one named step per module: [`validate`],
//! [`observe`], [`build`] (pure), [`apply_tenant`] and [`apply_host`], [`status`]; [`cleanup`] on
//! deletion.

mod apply_host;
mod apply_tenant;
mod build;
mod cleanup;
mod context;
pub mod deployment;
mod observe;
pub mod origin;
mod outcome;
pub mod rbac;
mod reconcile;
mod status;
pub mod tenant;
pub mod token;
pub mod token_watch;
mod validate;

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt, predicates, watcher};
use kube::{Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

pub use self::context::{CONTROLLER, KIND};
use self::context::{Caches, StackContext};
use self::origin::Installs;
use self::reconcile::reconcile;
use self::tenant::stack_of;
use super::crd_changes::{CrdChange, CrdChanges};
use super::crd_parent_label;
use super::unpack::split_dependency;
use crate::api::stacks::{ClusterStackInstall, Stack, StackInstall};
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::labels::{
    MANAGED_BY, MANAGED_BY_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
};
use crate::runtime::controller::Scaffold;
use crate::runtime::informers::SharedCache;
use crate::runtime::written::Written;

/// Runs the Stack controller of one tenant until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let shared = &context.caches;
    let ours = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    let service_accounts = shared.tenant::<ServiceAccount>(&ours);
    // Not a shared cache of Secrets: any user can label a Secret as stackd's (see `token_watch`).
    let (token_secrets, token_events) = token_watch::watch(context.client.clone(), &ours, context.reachability.back());
    let cluster_roles = shared.tenant::<ClusterRole>(&ours);
    let role_bindings = shared.tenant::<RoleBinding>(&ours);
    let cluster_role_bindings = shared.tenant::<ClusterRoleBinding>(&ours);
    let crds = shared.tenant_crds();
    let (deployments, host_secrets) = (shared.host::<Deployment>(), shared.host::<Secret>());
    let pods = shared.host_selected::<Pod>(&crate::host::pod_trouble::pods_selector(&context.name));
    let pod_deployments = deployments.store();
    let stack_installs = shared.tenant_guarded::<StackInstall>();
    let cluster_stack_installs = shared.tenant_guarded::<ClusterStackInstall>();
    let stacks = shared.tenant_guarded::<Stack>();
    let (stack_store, crd_store) = (stacks.store(), crds.store());
    let crd_changes = CrdChanges::default();
    // Every event of a host object means the cache has shown it: a creation is no longer pending.
    let (on_deployment, on_secret) = (context.clone(), context.clone());
    let written = Arc::new(Written::default());
    let scaffold = Scaffold::ignoring_own_writes(CONTROLLER, context.clone(), &stacks, written.clone())
        .watches(&service_accounts, |o| stack_of(o.as_ref()))
        .watches_ready_stream(token_secrets.readiness(), token_events, |o| stack_of(&o))
        .watches(&cluster_roles, |o| stack_of(o.as_ref()))
        .watches(&role_bindings, |o| stack_of(o.as_ref()))
        .watches(&cluster_role_bindings, |o| stack_of(o.as_ref()))
        .watches(&crds, move |crd| {
            let change = crd_changes.note(&crd_store, &crd);
            stacks_using(&stack_store, &crd, &change)
        })
        .watches(&deployments, move |o| {
            on_deployment.host_writes.seen(o.as_ref());
            host_parent(o.as_ref())
        })
        // What the kubelet says of a controller pod is its Stack's status.
        .watches(&pods, move |pod| {
            deployment_of(&pod_deployments, pod.as_ref()).and_then(|d| host_parent(d.as_ref()))
        })
        .watches(&host_secrets, move |o| {
            on_secret.host_writes.seen(o.as_ref());
            host_parent(o.as_ref())
        })
        // A Stack is judged by its install: a new one decides whether it runs. (One that goes takes
        // its Stack with it, or leaves it without the owner reference, which is a Stack event.)
        .watches_stream(&stack_installs, new_generations(&stack_installs), |o| {
            Some(stack_at(&o))
        })
        .watches_stream(&cluster_stack_installs, new_generations(&cluster_stack_installs), |o| {
            Some(stack_at(&o))
        });
    let ctx = Arc::new(StackContext {
        tenant: context,
        reported: Default::default(),
        written,
        caches: Caches {
            service_accounts: service_accounts.store(),
            token_secrets,
            cluster_roles: cluster_roles.store(),
            role_bindings: role_bindings.store(),
            cluster_role_bindings: cluster_role_bindings.store(),
            crds: crds.store(),
            deployments: deployments.store(),
            host_secrets: host_secrets.store(),
            pods: pods.store(),
        },
        installs: Installs {
            stack_installs: stack_installs.store(),
            cluster_stack_installs: cluster_stack_installs.store(),
        },
    });
    scaffold.run(ctx, reconcile, &cancel).await;
    Ok(())
}

/// The cached controller Deployment whose pod `pod` is: its controller is the ReplicaSet
/// `<deployment>-<pod-template-hash>`, and it carries the Deployment's selector labels. (No
/// ReplicaSet is cached to prove more: a pod only adds words to its Stack's status.)
pub(super) fn deployment_of(deployments: &Store<Deployment>, pod: &Pod) -> Option<Arc<Deployment>> {
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "ReplicaSet" && o.api_version == "apps/v1")?;
    let hash = pod.labels().get("pod-template-hash")?;
    let name = owner.name.strip_suffix(hash.as_str())?.strip_suffix('-')?;
    let deployment = deployments.get(&ObjectRef::new(name).within(&pod.namespace().unwrap_or_default()))?;
    let selector = deployment.spec.as_ref()?.selector.match_labels.as_ref()?;
    let labels = pod.labels();
    selector
        .iter()
        .all(|(key, value)| labels.get(key) == Some(value))
        .then_some(deployment)
}

/// The Stack a host object belongs to, from its identity annotations.
fn host_parent<K: Resource>(object: &K) -> Option<ObjectRef<Stack>> {
    let annotations = object.annotations();
    if annotations.get(TENANT_KIND_ANNOTATION).map(String::as_str) != Some(KIND) {
        return None;
    }
    let namespace = annotations.get(TENANT_NAMESPACE_ANNOTATION)?;
    let name = annotations.get(TENANT_NAME_ANNOTATION)?;
    Some(ObjectRef::new(name).within(namespace))
}

/// Install events that can change a Stack's standing (a new install), not its every status write.
fn new_generations<K>(
    installs: &SharedCache<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    installs
        .touched()
        .map(|install| Ok(install.as_ref().clone()))
        .predicate_filter(predicates::generation, PredicateConfig::default())
}

/// The Stack an install creates: the one at its own namespace and name.
fn stack_at<K: Resource>(install: &K) -> ObjectRef<Stack> {
    ObjectRef::new(&install.name_any()).within(&install.namespace().unwrap_or_default())
}

/// The Stacks a change of `crd` concerns (see [`crate::stacks::crd_changes`]): when anything but the
/// stacks' labels changed, those that own it (by group and kind), depend on its group (whose
/// permissions depend on who created the group's CRDs) or carry its parent label; and on any change,
/// those whose own label it gained or lost.
fn stacks_using(stacks: &Store<Stack>, crd: &CustomResourceDefinition, change: &CrdChange) -> Vec<ObjectRef<Stack>> {
    if !change.content && change.relabelled.is_empty() {
        return Vec::new();
    }
    let labels = crd.labels();
    let group = crd.spec.group.as_str();
    stacks
        .state()
        .iter()
        .filter(|stack| {
            let label = crd_parent_label(&stack.namespace().unwrap_or_default(), &stack.name_any());
            if change.relabelled.contains(&label) {
                return true;
            }
            let owns = stack
                .spec
                .customresourcedefinitions
                .iter()
                .any(|r| r.kind == crd.spec.names.kind && r.api_version.split('/').next() == Some(group));
            let depends =
                stack.spec.metadata.depends_on.iter().any(|dependency| {
                    dependency.crd.as_deref().and_then(split_dependency).map(|(_, g)| g) == Some(group)
                });
            change.content && (owns || depends || labels.contains_key(&label))
        })
        .map(|stack| ObjectRef::from(stack.as_ref()))
        .collect()
}
