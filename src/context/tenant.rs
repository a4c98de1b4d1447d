//! What each of a tenant's controllers is given, and why a tenant's task tree stops.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use kube::Client;
use kube::runtime::events::Recorder;
use kube::runtime::watcher;

use super::endpoint::{EndpointError, TenantEndpoint};
use super::shared::Shared;
use crate::host::apply::HostWrites;
use crate::host::cluster_identity::IdentityError;
use crate::host::labels::tenant_selector;
use crate::host::namespace::NamespaceError;
use crate::host::quota_share::{self, RunsPods, ShareExceeded};
use crate::runtime::backoff::ObjectBackoff;
use crate::runtime::cause::{Cause, diagnose};
use crate::runtime::controller::{FairPermits, Tenant};
use crate::runtime::informers::Informers;
use crate::runtime::memory_budget::Overage;
use crate::runtime::metrics::Metrics;
use crate::runtime::reachability::Reachability;
use crate::runtime::startup::Startup;

/// Everything a tenant's controllers need.
pub struct TenantContext {
    pub name: String,
    /// Client of the tenant API server.
    pub client: Client,
    /// Client of the host cluster (shared by all tenants).
    pub host: Client,
    pub host_namespace: String,
    pub endpoint: Result<TenantEndpoint, EndpointError>,
    pub shared: Arc<Shared>,
    /// Bounds the reconciles running at once for this tenant, shared fairly between its
    /// namespaces.
    pub reconcile_permits: Arc<FairPermits>,
    /// Publishes Events on tenant objects.
    pub recorder: Recorder,
    /// Retry delays of failed reconciles, per object.
    pub object_backoff: ObjectBackoff,
    /// Host replaces the host changed back, held until their backoff has passed.
    pub host_writes: HostWrites,
    /// One cache per kind the tenant's controllers read, tenant and host, shared by them all.
    pub caches: Informers,
    /// Whether the tenant API server answers; told once per change.
    pub reachability: Arc<Reachability>,
    /// This run's start: complete once every controller's caches are filled.
    pub startup: Startup,
    /// Host workloads admitted to their namespace's share of the host quota lately.
    pub quota_admitted: quota_share::Admitted,
}

impl Tenant for TenantContext {
    fn name(&self) -> &str {
        &self.name
    }

    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    fn permits(&self) -> Arc<FairPermits> {
        self.reconcile_permits.clone()
    }

    fn object_backoff(&self) -> &ObjectBackoff {
        &self.object_backoff
    }

    fn reachability(&self) -> &Reachability {
        &self.reachability
    }

    fn host_reachability(&self) -> Option<&Reachability> {
        Some(&self.shared.host_reachability)
    }

    fn startup(&self) -> &Startup {
        &self.startup
    }

    fn publisher(&self) -> Option<(&Client, &Recorder)> {
        Some((&self.client, &self.recorder))
    }
}

impl TenantContext {
    /// Whether `desired`, a host Deployment or Job for tenant namespace `namespace` (replacing
    /// `current`), fits the namespace's share of the tenant's host quota beside the tenant's host
    /// workloads as its caches show them ([`crate::host::quota_share`]).
    pub fn check_quota_share<K>(
        &self,
        what: &str,
        namespace: &str,
        desired: &K,
        current: Option<&K>,
    ) -> Result<(), Box<ShareExceeded>>
    where
        K: kube::Resource + RunsPods,
    {
        let quota = &self.shared.settings.tenant_quota;
        let defaults = &quota.container_defaults;
        let workloads = || {
            let deployments = self.caches.host::<Deployment>().store().state();
            let jobs = self.caches.host::<Job>().store().state();
            let deployments = deployments.iter().map(|d| quota_share::workload(d.as_ref(), defaults));
            deployments
                .chain(jobs.iter().map(|j| quota_share::workload(j.as_ref(), defaults)))
                .collect()
        };
        self.quota_admitted
            .check(quota, workloads, what, namespace, desired, current)
    }

    /// Drops the record of each workload admitted to its share once the host caches show it
    /// ([`quota_share::Admitted`]); runs until `cancel`.
    pub async fn forget_admitted_when_seen(self: Arc<Self>, cancel: tokio_util::sync::CancellationToken) {
        use futures::StreamExt;
        use kube::ResourceExt;
        let jobs = self.caches.host::<Job>().touched().map(|job| job.name_any());
        let deployments = self.caches.host::<Deployment>().touched().map(|d| d.name_any());
        let mut seen = futures::stream::select(jobs, deployments);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                name = seen.next() => match name {
                    Some(name) => self.quota_admitted.seen(&name),
                    None => return,
                },
            }
        }
    }

    /// Watches of host objects see only this tenant's (label selector), never another tenant's.
    pub fn host_watch_config(&self) -> watcher::Config {
        watcher::Config::default().labels(&tenant_selector(&self.name))
    }

    /// Ticks every `--sweep-interval`, at this tenant's own point of it: tenants that start
    /// together do not list together (a replica of 300 swept 5,100 lists within a minute). The
    /// first tick is half an interval to a whole one away; what is read at the tenant's start is
    /// read by its own caller.
    pub fn sweeps(&self) -> tokio::time::Interval {
        let every = self.shared.settings.sweep_interval;
        let first = tokio::time::Instant::now() + every.mul_f64(0.5 + 0.5 * spread_of(&self.name));
        let mut sweeps = tokio::time::interval_at(first, every);
        sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        sweeps
    }
}

/// Where in `[0, 1)` the tenant's sweeps fall, the same on every start.
fn spread_of(tenant: &str) -> f64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    tenant.hash(&mut hasher);
    (hasher.finish() % 1_000) as f64 / 1_000.0
}

/// Why a tenant's task tree stopped; the supervisor restarts it with backoff.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("the kubeconfig cannot be used: {0}")]
    Config(String),
    #[error("the tenant API server does not answer: {0}")]
    Unreachable(Cause),
    #[error("cannot prepare the host namespace: {0}")]
    HostNamespace(#[from] NamespaceError),
    #[error("a controller stopped: {0}")]
    Controller(String),
    #[error(transparent)]
    ClusterIdentity(#[from] IdentityError),
    #[error("cannot move host objects named by an older stackd to their current names: {0}")]
    LegacyNames(kube::Error),
    /// Its caches outgrew `--tenant-memory-budget`: the supervisor suspends it.
    #[error("suspended: {0}")]
    OverMemoryBudget(Overage),
}

impl TenantError {
    /// The word for `stackd_tenant_down_cause`.
    pub fn cause_label(&self) -> &'static str {
        match self {
            TenantError::Config(_) => "config",
            TenantError::Unreachable(cause) => cause.kind.label(),
            TenantError::ClusterIdentity(IdentityError::OtherCluster { .. }) => "other-cluster",
            TenantError::ClusterIdentity(IdentityError::Api(err)) if diagnose(err).kind.is_outage() => {
                diagnose(err).kind.label()
            }
            TenantError::OverMemoryBudget(_) => "controller",
            TenantError::HostNamespace(_)
            | TenantError::Controller(_)
            | TenantError::ClusterIdentity(_)
            | TenantError::LegacyNames(_) => "controller",
        }
    }

    /// The outage behind this error, when waiting can help (the server is down, restarting, or
    /// answers 5xx): the supervisor then reports the tenant down and restarts it as soon as its
    /// server answers instead of after the restart backoff.
    pub fn outage(&self) -> Option<Cause> {
        match self {
            TenantError::Unreachable(cause) if !cause.kind.is_permanent() => Some(cause.clone()),
            TenantError::ClusterIdentity(IdentityError::Api(err)) => Some(diagnose(err)).filter(|c| c.kind.is_outage()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_sweep_at_their_own_points_of_the_interval() {
        let points: std::collections::BTreeSet<u64> = ["acme", "globex", "initech", "umbrella"]
            .iter()
            .map(|tenant| (spread_of(tenant) * 1_000.0) as u64)
            .collect();
        assert_eq!(points.len(), 4);
        assert!(points.iter().all(|p| *p < 1_000));
        assert_eq!(spread_of("acme"), spread_of("acme"));
    }
}
