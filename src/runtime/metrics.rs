//! Prometheus metrics. Labels stay bounded: tenant and controller, never an object, except pools
//! (one small set of series per ClusterPool, removed when the pool goes). The controllers chart's
//! alerts and dashboard use these names (a test checks each exists on `/metrics`).

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

/// Why a tenant is down: `cause` is one word of [`crate::runtime::cause::CauseKind::label`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantCauseLabels {
    pub tenant: String,
    pub cause: String,
}

/// Why a tenant is suspended: `reason` is one of [`SUSPENSION_REASONS`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantReasonLabels {
    pub tenant: String,
    pub reason: String,
}

/// The reasons a tenant is suspended for.
pub const SUSPENSION_REASONS: &[&str] = &["memory_budget"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub tenant: String,
    pub controller: String,
}

/// A failed reconcile: `kind` is its error's stable label (the controller's error `metric_label`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub tenant: String,
    pub controller: String,
    pub kind: String,
}

/// A tenant's objects of one kind by readiness: `kind` is a stackd kind (StackInstall,
/// ClusterStackInstall, Stack, ClusterPool), `ready` is `true` or `false`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantObjectLabels {
    pub tenant: String,
    pub kind: String,
    pub ready: String,
}

/// The kinds `stackd_tenant_objects` counts.
pub const COUNTED_KINDS: [&str; 4] = ["StackInstall", "ClusterStackInstall", "Stack", "ClusterPool"];

/// One pool's gauge: `state` is a cluster bucket (installing, ready, claimed, broken, deleting,
/// stale) or an inventory state (available, reserved, cdc_broken).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub tenant: String,
    pub namespace: String,
    pub pool: String,
    pub state: String,
}

impl PoolLabels {
    pub fn new(tenant: &str, namespace: &str, pool: &str, state: &str) -> Self {
        PoolLabels {
            tenant: tenant.into(),
            namespace: namespace.into(),
            pool: pool.into(),
            state: state.into(),
        }
    }
}

/// The daemon's metrics and their registry.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// 1 while the tenant's API server answers, 0 otherwise.
    pub tenant_up: Family<TenantLabels, Gauge>,
    /// 1 for the root cause of a tenant being down (one series at a time), none while it is up.
    pub tenant_down_cause: Family<TenantCauseLabels, Gauge>,
    /// 1 while the host API server answers, 0 otherwise.
    pub host_up: Gauge,
    /// 1 for the root cause of the host being down (one series at a time), none while it is up.
    pub host_down_cause: Family<CauseLabels, Gauge>,
    /// Restarts of a tenant's task tree after an error or panic.
    pub tenant_restarts: Family<TenantLabels, Counter>,
    /// 1 while a tenant is suspended (its controllers and watches stopped), by reason.
    pub tenant_suspended: Family<TenantReasonLabels, Gauge>,
    /// The estimated bytes a tenant's caches hold (what `--tenant-memory-budget` bounds).
    pub tenant_cached_bytes: Family<TenantLabels, Gauge>,
    /// Reconciles run, per tenant and controller.
    pub reconciles: Family<ControllerLabels, Counter>,
    /// Reconciles that failed, per tenant and controller.
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    /// Reconciles that failed, per tenant, controller and kind of error.
    pub reconcile_errors_by_kind: Family<ErrorLabels, Counter>,
    /// How long reconciles take, per tenant and controller (waits for a permit excluded).
    pub reconcile_duration: Family<ControllerLabels, Histogram, fn() -> Histogram>,
    /// Per pool: clusters by state and inventory entries by state.
    pub pool_clusters: Family<PoolLabels, Gauge>,
    /// With `--shards`: the tenants this replica serves.
    pub shard_tenants: Gauge,
    /// With `--shards`: the tenants this replica knows of that no live replica owns.
    pub shard_unserved_tenants: Gauge,
    /// A tenant's objects by kind and readiness, from its caches.
    pub tenant_objects: Family<TenantObjectLabels, Gauge>,
    /// The daemon's resident memory, read when `/metrics` is asked for.
    pub resident_memory: Gauge,
    /// Lookups of tenant Secrets objects wait on (paced per Secret and namespace, not per object).
    pub secret_lookups: Family<TenantLabels, Counter>,
    /// The work of applying ClusterDeploymentCustomization patches: install-config bytes measured
    /// after each patch (each namespace's share of it is bounded).
    pub patch_bytes: Family<TenantLabels, Counter>,
}

fn duration_histogram() -> Histogram {
    // 5 ms to about 80 s.
    Histogram::new(exponential_buckets(0.005, 2.5, 12))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("stackd");
        let tenant_up = Family::<TenantLabels, Gauge>::default();
        let tenant_down_cause = Family::<TenantCauseLabels, Gauge>::default();
        let tenant_restarts = Family::<TenantLabels, Counter>::default();
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "tenant_up",
            "Whether the tenant API server answers (1) or not (0)",
            tenant_up.clone(),
        );
        registry.register(
            "tenant_down_cause",
            "Why a tenant is down (1 for the root cause of the last failure; absent while it is up)",
            tenant_down_cause.clone(),
        );
        let host_up = Gauge::default();
        registry.register(
            "host_up",
            "Whether the host API server answers (1) or not (0)",
            host_up.clone(),
        );
        let host_down_cause = Family::<CauseLabels, Gauge>::default();
        registry.register(
            "host_down_cause",
            "Why the host is down (1 for the root cause; absent while it is up)",
            host_down_cause.clone(),
        );
        registry.register(
            "tenant_restarts",
            "Restarts of a tenant's controllers after a failure",
            tenant_restarts.clone(),
        );
        let tenant_suspended = Family::<TenantReasonLabels, Gauge>::default();
        registry.register(
            "tenant_suspended",
            "Tenants suspended by the daemon (1), with why; absent while a tenant runs",
            tenant_suspended.clone(),
        );
        let tenant_cached_bytes = Family::<TenantLabels, Gauge>::default();
        registry.register(
            "tenant_cached_bytes",
            "Estimated bytes a tenant's cached objects take (bounded by --tenant-memory-budget)",
            tenant_cached_bytes.clone(),
        );
        registry.register("reconciles", "Reconciles run", reconciles.clone());
        registry.register("reconcile_errors", "Reconciles that failed", reconcile_errors.clone());
        let reconcile_errors_by_kind = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "reconcile_errors_by_kind",
            "Reconciles that failed, by kind of error",
            reconcile_errors_by_kind.clone(),
        );
        let reconcile_duration =
            Family::<ControllerLabels, Histogram>::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register(
            "reconcile_duration_seconds",
            "How long reconciles take",
            reconcile_duration.clone(),
        );
        let pool_clusters = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_clusters",
            "Clusters of a pool by state, and its inventory entries by state",
            pool_clusters.clone(),
        );
        let shard_tenants = Gauge::default();
        registry.register(
            "shard_tenants",
            "Tenants the shard map gives this replica and it serves (--shards)",
            shard_tenants.clone(),
        );
        let shard_unserved_tenants = Gauge::default();
        registry.register(
            "shard_unserved_tenants",
            "Tenants this replica knows of that the shard map gives to no live replica (--shards)",
            shard_unserved_tenants.clone(),
        );
        let tenant_objects = Family::<TenantObjectLabels, Gauge>::default();
        registry.register(
            "tenant_objects",
            "A tenant's StackInstalls, ClusterStackInstalls, Stacks and ClusterPools by readiness",
            tenant_objects.clone(),
        );
        let resident_memory = Gauge::default();
        registry.register(
            "process_resident_memory_bytes",
            "Resident memory of the daemon process",
            resident_memory.clone(),
        );
        let secret_lookups = Family::<TenantLabels, Counter>::default();
        registry.register(
            "secret_lookups",
            "Lookups of tenant Secrets that objects wait on (at most 10 per namespace per interval)",
            secret_lookups.clone(),
        );
        let patch_bytes = Family::<TenantLabels, Counter>::default();
        registry.register(
            "patch_bytes",
            "Install-config bytes measured after each ClusterDeploymentCustomization patch applied (the work patches cost)",
            patch_bytes.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            secret_lookups,
            patch_bytes,
            shard_tenants,
            shard_unserved_tenants,
            tenant_objects,
            resident_memory,
            tenant_up,
            tenant_down_cause,
            host_up,
            host_down_cause,
            tenant_restarts,
            tenant_suspended,
            tenant_cached_bytes,
            reconciles,
            reconcile_errors,
            reconcile_errors_by_kind,
            reconcile_duration,
            pool_clusters,
        }
    }

    pub fn tenant(tenant: &str) -> TenantLabels {
        TenantLabels {
            tenant: tenant.to_string(),
        }
    }

    pub fn controller(tenant: &str, controller: &str) -> ControllerLabels {
        ControllerLabels {
            tenant: tenant.to_string(),
            controller: controller.to_string(),
        }
    }

    /// The tenant answers: up, with no down cause.
    pub fn set_tenant_up(&self, tenant: &str) {
        self.tenant_up.get_or_create(&Metrics::tenant(tenant)).set(1);
        self.clear_down_causes(tenant);
    }

    /// The tenant is down for `cause` (a [`crate::runtime::cause::CauseKind::label`]).
    pub fn set_tenant_down(&self, tenant: &str, cause: &str) {
        self.tenant_up.get_or_create(&Metrics::tenant(tenant)).set(0);
        self.clear_down_causes(tenant);
        let labels = TenantCauseLabels {
            tenant: tenant.to_string(),
            cause: cause.to_string(),
        };
        self.tenant_down_cause.get_or_create(&labels).set(1);
    }

    /// The host answers (`down` none), or is down for a cause (a
    /// [`crate::runtime::cause::CauseKind::label`]).
    pub fn set_host_up(&self, down: Option<&str>) {
        self.host_up.set(i64::from(down.is_none()));
        self.host_down_cause.clear();
        if let Some(cause) = down {
            let labels = CauseLabels {
                cause: cause.to_string(),
            };
            self.host_down_cause.get_or_create(&labels).set(1);
        }
    }

    /// Sets a tenant's count of `kind` objects that are (not) ready.
    pub fn set_tenant_objects(&self, tenant: &str, kind: &str, ready: bool, count: i64) {
        let labels = TenantObjectLabels {
            tenant: tenant.to_string(),
            kind: kind.to_string(),
            ready: ready.to_string(),
        };
        self.tenant_objects.get_or_create(&labels).set(count);
    }

    /// Forgets a tenant that is no longer served.
    pub fn remove_tenant(&self, tenant: &str) {
        self.tenant_up.remove(&Metrics::tenant(tenant));
        self.tenant_cached_bytes.remove(&Metrics::tenant(tenant));
        self.secret_lookups.remove(&Metrics::tenant(tenant));
        self.patch_bytes.remove(&Metrics::tenant(tenant));
        self.clear_down_causes(tenant);
        self.clear_tenant_suspended(tenant);
        for kind in COUNTED_KINDS {
            for ready in [true, false] {
                self.tenant_objects.remove(&TenantObjectLabels {
                    tenant: tenant.to_string(),
                    kind: kind.to_string(),
                    ready: ready.to_string(),
                });
            }
        }
    }

    /// The tenant is suspended for `reason` (one of [`SUSPENSION_REASONS`]).
    pub fn set_tenant_suspended(&self, tenant: &str, reason: &str) {
        let labels = TenantReasonLabels {
            tenant: tenant.to_string(),
            reason: reason.to_string(),
        };
        self.tenant_suspended.get_or_create(&labels).set(1);
    }

    pub fn clear_tenant_suspended(&self, tenant: &str) {
        for reason in SUSPENSION_REASONS {
            self.tenant_suspended.remove(&TenantReasonLabels {
                tenant: tenant.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    fn clear_down_causes(&self, tenant: &str) {
        for cause in crate::runtime::cause::CauseKind::LABELS {
            self.tenant_down_cause.remove(&TenantCauseLabels {
                tenant: tenant.to_string(),
                cause: cause.to_string(),
            });
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        if let Some(bytes) = resident_bytes() {
            self.resident_memory.set(bytes);
        }
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// The process's resident memory (`VmRSS` of `/proc/self/status`; Linux only).
fn resident_bytes() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: i64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_metrics_are_exposed_by_tenant() {
        let metrics = Metrics::new();
        metrics.tenant_up.get_or_create(&Metrics::tenant("acme")).set(1);
        metrics.tenant_restarts.get_or_create(&Metrics::tenant("acme")).inc();
        let text = metrics.encode();
        assert!(text.contains("stackd_tenant_up{tenant=\"acme\"} 1"), "{text}");
        metrics.set_tenant_down("acme", "certificate");
        let text = metrics.encode();
        assert!(
            text.contains("stackd_tenant_down_cause{tenant=\"acme\",cause=\"certificate\"} 1"),
            "{text}"
        );
        metrics.set_tenant_up("acme");
        assert!(
            !metrics.encode().contains("stackd_tenant_down_cause{"),
            "the cause goes when the tenant is up"
        );
        assert!(
            text.contains("stackd_tenant_restarts_total{tenant=\"acme\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn tenant_objects_and_memory_are_exposed_and_a_tenant_is_forgotten_whole() {
        let metrics = Metrics::new();
        metrics.set_tenant_objects("acme", "StackInstall", false, 2);
        let text = metrics.encode();
        assert!(
            text.contains("stackd_tenant_objects{tenant=\"acme\",kind=\"StackInstall\",ready=\"false\"} 2"),
            "{text}"
        );
        assert!(text.contains("stackd_process_resident_memory_bytes "), "{text}");
        metrics.remove_tenant("acme");
        assert!(!metrics.encode().contains("tenant=\"acme\""));
    }
}
