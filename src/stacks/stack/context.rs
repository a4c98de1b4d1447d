//! What every step of a Stack reconcile shares: the controller's names, its caches, what it last
//! wrote and reported, and its error type. A leaf: it imports no step of the controller.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::reflector::Store;

use super::origin::Installs;
use super::tenant::TenantWriteError;
use super::token_watch;
use crate::api::stacks::StackStatus;
use crate::context::tenant::TenantContext;
use crate::host::apply::HostWriteError;
use crate::runtime::controller::ReconcileError;
use crate::runtime::finalizer::FinalizerError;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::written::Written;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "stack";
/// The field manager of the Stack controller's writes to tenant objects.
pub(super) const FIELD_MANAGER: &str = "stackd/stack";
/// The tenant kind named in host objects' parent labels.
pub const KIND: &str = "Stack";

/// Cached copies of everything the controller writes, kept current by the watches that also
/// trigger reconciles: a write is decided from these, never from a fresh GET.
pub(super) struct Caches {
    pub service_accounts: Store<ServiceAccount>,
    /// The Stacks' token Secrets only, by metadata; their data read when they change.
    pub token_secrets: token_watch::TokenSecrets,
    pub cluster_roles: Store<ClusterRole>,
    pub role_bindings: Store<RoleBinding>,
    pub cluster_role_bindings: Store<ClusterRoleBinding>,
    pub crds: Store<CustomResourceDefinition>,
    pub deployments: Store<Deployment>,
    pub host_secrets: Store<Secret>,
    /// The pods of the tenant's host objects (see [`crate::host::pod_trouble::pods_selector`]).
    pub pods: Store<Pod>,
}

pub(super) struct StackContext {
    pub tenant: Arc<TenantContext>,
    pub caches: Caches,
    pub installs: Installs,
    pub reported: ReportedReadiness,
    /// The last status written to each Stack.
    pub written: Arc<Written<StackStatus>>,
}

/// The Ready condition (status, reason) this process last wrote per Stack. A reconcile starts from
/// the cached Stack, which can predate the status write of the reconcile just before it (its watch
/// event not in yet): judged by that copy alone, one transition would be announced twice.
#[derive(Default)]
pub(super) struct ReportedReadiness(Mutex<HashMap<String, (bool, String)>>);

impl ReportedReadiness {
    pub(super) fn get(&self, key: &str) -> Option<(bool, String)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    pub(super) fn set(&self, key: &str, ready: bool, reason: &str) {
        let mut reported = self.0.lock().unwrap_or_else(|p| p.into_inner());
        reported.insert(key.to_string(), (ready, reason.to_string()));
    }

    pub(super) fn forget(&self, key: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum StackError {
    #[error(transparent)]
    Host(#[from] HostWriteError),
    #[error(transparent)]
    Tenant(#[from] TenantWriteError),
    /// Not transparent: the retry reads the finalizer error itself in the chain.
    #[error("{0}")]
    Finalizer(#[from] FinalizerError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl StackError {
    pub(super) fn reason(&self) -> &'static str {
        match self {
            StackError::Host(err) => err.reason(),
            StackError::Tenant(TenantWriteError::Conflict { .. }) => "TenantObjectConflict",
            StackError::Tenant(TenantWriteError::Api(_)) => "TenantUnavailable",
            StackError::Finalizer(_) => "ReconcileError",
            StackError::Panicked(_) => "ReconcilePanicked",
        }
    }
}

impl ReconcileError for StackError {
    fn metric_label(&self) -> &'static str {
        match self {
            StackError::Host(_) => "host_write",
            StackError::Tenant(TenantWriteError::Conflict { .. }) => "tenant_conflict",
            StackError::Tenant(TenantWriteError::Api(_)) => "tenant_api",
            StackError::Finalizer(_) => "finalizer",
            StackError::Panicked(_) => "panic",
        }
    }
}

impl From<kube::Error> for StackError {
    fn from(err: kube::Error) -> Self {
        StackError::Tenant(TenantWriteError::Api(err))
    }
}
