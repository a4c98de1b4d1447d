//! Prometheus metrics. Labels stay bounded: tenant and controller, never an object.

use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub tenant: String,
    pub controller: String,
}

/// The daemon's metrics and their registry.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// 1 while the tenant's API server answers, 0 otherwise.
    pub tenant_up: Family<TenantLabels, Gauge>,
    /// Restarts of a tenant's task tree after an error or panic.
    pub tenant_restarts: Family<TenantLabels, Counter>,
    /// Reconciles run, per tenant and controller.
    pub reconciles: Family<ControllerLabels, Counter>,
    /// Reconciles that failed, per tenant and controller.
    pub reconcile_errors: Family<ControllerLabels, Counter>,
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
        let tenant_restarts = Family::<TenantLabels, Counter>::default();
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "tenant_up",
            "Whether the tenant API server answers (1) or not (0)",
            tenant_up.clone(),
        );
        registry.register(
            "tenant_restarts",
            "Restarts of a tenant's controllers after a failure",
            tenant_restarts.clone(),
        );
        registry.register("reconciles", "Reconciles run", reconciles.clone());
        registry.register("reconcile_errors", "Reconciles that failed", reconcile_errors.clone());
        Metrics {
            registry: Mutex::new(registry),
            tenant_up,
            tenant_restarts,
            reconciles,
            reconcile_errors,
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

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
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
        assert!(
            text.contains("stackd_tenant_restarts_total{tenant=\"acme\"} 1"),
            "{text}"
        );
    }
}
