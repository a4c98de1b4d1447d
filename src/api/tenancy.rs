//! `tenancy.stackd.dev/v1alpha1`: Tenant (DESIGN.md §1 "Tenants" (b)), a tenant registered by an
//! object on the **host**, naming the Secret that holds its kubeconfig. Its status is written by the
//! replica serving it, so `kubectl get tenants` is the operator's view of every tenant.
//!
//! Unlike every other kind here, Tenant lives on the host cluster, not in the tenants: its CRD ships
//! with the controllers chart (`stackd crds --host`), never with stackd-types.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, conditions_schema};

/// Longest key of a kubeconfig Secret (a ConfigMap/Secret key is at most 253 characters).
pub const SECRET_KEY_MAX: u32 = 253;

/// Desired state of a Tenant.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "tenancy.stackd.dev",
    version = "v1alpha1",
    kind = "Tenant",
    derive = "PartialEq",
    status = "TenantStatus",
    category = "stackd",
    doc = "Tenant registers a tenant API server with stackd on the host: the daemon reads its kubeconfig from the named Secret and serves its stacks and pools; the status says whether it is up and which replica serves it.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(name = "Replica", type_ = "string", json_path = ".status.servedBy"),
    printcolumn(name = "Namespace", type_ = "string", json_path = ".status.hostNamespace"),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.serverVersion"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct TenantSpec {
    /// The Secret holding the daemon's kubeconfig for this tenant. It must be in a namespace the
    /// daemon is given (`--tenant-secret-namespaces`, the chart's `tenants.secretNamespaces`);
    /// any other is refused. A change to the Secret takes effect at once.
    pub kubeconfig_secret_ref: KubeconfigSecretRef,
    /// Where pods on the host reach this tenant's API server (`https://host:port`), when the
    /// kubeconfig's server URL is not reachable from the host's pods; the same as the kubeconfig
    /// cluster extension `stackd.dev/in-cluster-server`, and it wins over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_cluster_server: Option<String>,
    /// Stop serving the tenant: its controllers stop and its host objects are kept, as when the
    /// Tenant is deleted. Set it back to false to serve it again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
}

/// A key of a Secret on the host.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KubeconfigSecretRef {
    /// Namespace of the Secret.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key whose value is the kubeconfig (vcluster: `config`; Kamaji: `admin.conf`; Cluster
    /// API: `value`).
    #[schemars(length(min = 1, max = SECRET_KEY_MAX))]
    pub key: String,
}

impl std::fmt::Display for KubeconfigSecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret {}/{} key {:?}", self.namespace, self.name, self.key)
    }
}

/// Observed state of a Tenant, written by the replica serving it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantStatus {
    /// `Ready`: whether the tenant API server answers (reason `Up`, `Degraded` saying what to fix,
    /// `Down` with the root cause, or why it is not served). `Served`: which replica serves the
    /// tenant, or why none does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The replica serving the tenant (its pod name and a suffix, as in its Leases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
    /// The tenant's namespace on the host, where its stacks' controllers and installers run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_namespace: Option<String>,
    /// The tenant API server's version (`gitVersion`), as it last answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    /// StackInstalls and ClusterStackInstalls of the tenant by readiness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub installs: Option<ReadinessCount>,
    /// Stacks of the tenant by readiness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stacks: Option<ReadinessCount>,
    /// ClusterPools of the tenant by readiness (ready: as many ready clusters as its size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<ReadinessCount>,
}

/// How many objects of a kind are ready and how many are not.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessCount {
    #[schemars(range(min = 0))]
    pub ready: i32,
    #[schemars(range(min = 0))]
    pub not_ready: i32,
}
