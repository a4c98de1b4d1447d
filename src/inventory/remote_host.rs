//! The BareMetalHost an asset becomes on a managed cluster, as the rest of the inventory sees it
//! (DESIGN.md §5): where it lives, and how delivering or detaching it fails. No requests: the
//! exchanges with the managed cluster are in `delivery.rs`.

use std::time::Duration;

use crate::runtime::cause::diagnose;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::untrusted_kubeconfig::UntrustedKubeconfigError;

/// Namespace of BareMetalHosts on a managed cluster.
pub(crate) const MACHINE_API_NAMESPACE: &str = "openshift-machine-api";

#[derive(Debug, thiserror::Error)]
pub(crate) enum DeliveryError {
    #[error("the admin kubeconfig of cluster {0} is missing or unreadable: {1}")]
    Kubeconfig(String, String),
    /// The tenant-writable admin kubeconfig asks for something stackd never does for a tenant.
    #[error("the admin kubeconfig of cluster {cluster} in Secret {secret} was refused: {reason}")]
    KubeconfigRefused {
        cluster: String,
        secret: String,
        #[source]
        reason: UntrustedKubeconfigError,
    },
    /// What the cluster answered, reduced by [`crate::runtime::untrusted_server::sanitize`]: its address came
    /// from the tenant.
    #[error("managed cluster request failed: {}", diagnose(.0))]
    Remote(#[source] kube::Error),
    #[error("the managed cluster timed out: one delivery took longer than {0:?} (see --managed-cluster-timeout)")]
    TimedOut(Duration),
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
    /// A bug in stackd's delivery code, contained to this asset.
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl DeliveryError {
    /// The condition and Event reason for this failure.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            DeliveryError::KubeconfigRefused { .. } => "AdminKubeconfigRefused",
            _ => "DeliveryFailed",
        }
    }
}
