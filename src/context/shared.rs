//! What the daemon is configured with and what every tenant shares.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;

use super::crd_groups::CrdGroups;
use super::namespace_template::NamespaceTemplate;
use super::pod_policy::PodPolicy;
use super::registries::AllowedRegistries;
use super::stack_limits::StackLimits;
use crate::bounds::DocumentLimits;
use crate::host::namespace::ServiceAccountRef;
use crate::host::namespace_watch::NamespaceWatch;
use crate::host::quota::TenantQuota;
use crate::runtime::backoff::Backoff;
use crate::runtime::health::Health;
use crate::runtime::leader::LeaderElectionSettings;
use crate::runtime::memory_budget::ByteSize;
use crate::runtime::metrics::Metrics;
use crate::runtime::reachability::Reachability;
use crate::runtime::shards::ShardSettings;

/// Everything `stackd run` is configured with.
#[derive(Clone, Debug)]
pub struct DaemonSettings {
    /// The tenants directory (`--tenants-dir`); `None` serves Tenant objects only (`stackd dev`).
    pub tenants_dir: Option<PathBuf>,
    /// The namespaces whose Secrets Tenant objects may name (`--tenant-secret-namespaces`).
    pub tenant_secret_namespaces: BTreeSet<String>,
    /// This process among the replicas: the leader and shard Leases' holder identity, and the
    /// replica a Tenant's status names.
    pub identity: String,
    pub namespace_template: NamespaceTemplate,
    /// stackd's image: the install Job's, and the one whose binary templating stacks' pods copy
    /// (`--stackd-image`, else [`crate::stacks::default_stackd_image`]).
    pub stackd_image: String,
    pub allow_insecure_tenant_endpoint: bool,
    pub insecure_allow_all_apigroups: bool,
    pub insecure_pass_full_deployment: bool,
    /// What stack pods may ask for beyond the allow-list (`--stack-node-selector`, `--stack-toleration`).
    pub stack_pod_policy: PodPolicy,
    /// The ResourceQuota and LimitRange of every tenant's host namespace.
    pub tenant_quota: TenantQuota,
    /// The API groups packages may create CRDs in (`--stack-crd-groups`).
    pub stack_crd_groups: CrdGroups,
    /// The platform's API groups a stack may depend on without a stack having installed them
    /// (`--platform-dependency-groups`).
    pub platform_dependency_groups: CrdGroups,
    /// Let packages ship CRDs with conversion webhooks.
    pub insecure_allow_conversion_webhooks: bool,
    /// Bounds on packages and on installs per namespace (`--max-package-crds`,
    /// `--namespace-max-installs`).
    pub stack_limits: StackLimits,
    /// Where packages, stack controllers and pool installers may come from (`--allowed-registries`).
    pub allowed_registries: AllowedRegistries,
    pub metrics_addr: SocketAddr,
    /// A listener of its own for `/healthz` and `/readyz`; unset, they are served beside
    /// `/metrics`.
    pub health_addr: Option<SocketAddr>,
    pub leader_election: Option<LeaderElectionSettings>,
    /// `--shards`: run only the tenants of the shard slots this replica holds.
    pub shards: Option<ShardSettings>,
    /// The daemon's ServiceAccount, bound in every tenant namespace.
    pub rbac_subject: ServiceAccountRef,
    pub max_concurrent_reconciles: usize,
    pub lease_min_age: Duration,
    /// Bound on one request to a managed cluster (`--managed-cluster-timeout`).
    pub managed_cluster_timeout: Duration,
    /// `activeDeadlineSeconds` of every installer Job, install and destroy (`--installer-deadline`).
    pub installer_deadline: Duration,
    /// How long an install Job's pod may fail to pull its package image before the install says it
    /// failed (`PackagePullFailed`) and retries with backoff (`--pull-failure-grace`).
    pub pull_failure_grace: Duration,
    /// ClusterPools served per tenant namespace, the oldest first; 0 for no limit
    /// (`--namespace-max-pools`).
    pub namespace_max_pools: usize,
    /// Clusters the pools of one tenant namespace may have at once (`--namespace-max-clusters`;
    /// 0 for no limit).
    pub namespace_max_clusters: usize,
    /// Lookups of the Secrets a namespace's BareMetalAssets wait on, per recheck interval
    /// (`--namespace-secret-lookups`).
    pub namespace_secret_lookups: usize,
    pub sweep_interval: Duration,
    pub backoff: Backoff,
    pub debounce: Duration,
    pub rescan_interval: Duration,
    /// How long a stopping tenant may take to finish its in-flight reconciles.
    pub tenant_stop_grace: Duration,
    /// Objects larger than this (as JSON) are not cached (`--max-cached-object-bytes`).
    pub max_cached_object_bytes: ByteSize,
    /// What one tenant's caches may hold before it is suspended (`--tenant-memory-budget`).
    pub tenant_memory_budget: ByteSize,
    /// The bounds of the documents stackd builds from tenant input (`--max-render-secret-bytes`,
    /// `--max-render-bytes`, `--max-installer-output-bytes`, `--max-installer-output-keys`).
    pub document_limits: DocumentLimits,
    /// What the cached objects of one tenant namespace may take (`--namespace-memory-budget`).
    pub namespace_memory_budget: ByteSize,
    /// The objects of one tenant namespace stackd caches (`--namespace-max-objects`).
    pub namespace_max_objects: u64,
    /// The host namespace whose pods may reach tenant pods, to scrape them
    /// (`--monitoring-namespace`); none when unset.
    pub monitoring_namespace: Option<String>,
}

/// What every tenant shares.
pub struct Shared {
    pub host: Client,
    /// Whether the host API server answers, and the signal of its return; told once per change.
    pub host_reachability: Arc<Reachability>,
    /// Every tenant's host namespace and the daemon's RoleBinding there, one watch per replica.
    pub namespaces: Arc<NamespaceWatch>,
    pub settings: DaemonSettings,
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
}
