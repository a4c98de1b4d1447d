//! Tenant supervision: each tenant runs in its own task tree, restarted with backoff after an error
//! or a panic, and never able to stall another tenant.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{error, info, warn};

use super::directory::{TenantChange, TenantFile};
use super::tenant;
use crate::context::shared::Shared;
use crate::context::tenant::TenantError;
use crate::runtime::health::TenantHealth;
use crate::runtime::memory_budget::Overage;
use crate::runtime::metrics::Metrics;
use crate::runtime::panics;
use crate::runtime::reachability::Reachability;

struct RunningTenant {
    cancel: CancellationToken,
    /// Dropping it aborts the tenant: a stop cut short (the leader lease running out) must not
    /// leave the tenant running detached.
    task: AbortOnDropHandle<()>,
}

/// The running tenants.
pub struct Registry {
    shared: Arc<Shared>,
    tenants: BTreeMap<String, RunningTenant>,
}

impl Registry {
    pub fn new(shared: Arc<Shared>) -> Self {
        Registry {
            shared,
            tenants: BTreeMap::new(),
        }
    }

    /// Applies one change from the tenants directory.
    pub async fn apply(&mut self, change: TenantChange) {
        match change {
            TenantChange::Start(file) => {
                info!(tenant = %file.name, from = %file.origin, "starting tenant");
                self.stop(&file.name).await;
                self.start(*file);
            }
            TenantChange::Restart(file) => {
                info!(tenant = %file.name, "tenant kubeconfig changed; restarting tenant");
                self.stop(&file.name).await;
                self.start(*file);
            }
            TenantChange::Suspend(name) => {
                if self.is_running(&name) {
                    info!(tenant = %name, "tenant kubeconfig removed; suspending tenant (its host objects stay)");
                }
                self.stop(&name).await;
                self.shared.health.remove_tenant(&name);
                self.shared.metrics.remove_tenant(&name);
            }
            TenantChange::Invalid {
                name,
                error,
                kept_running,
            } => {
                if kept_running {
                    warn!(tenant = %name, %error, "tenant kubeconfig is invalid; the tenant keeps running on the previous one");
                } else {
                    warn!(tenant = %name, %error, "tenant kubeconfig is invalid; the tenant is not started");
                    self.shared
                        .health
                        .set_tenant(&name, TenantHealth::Invalid(error.to_string()));
                }
            }
        }
    }

    fn start(&mut self, file: TenantFile) {
        let cancel = CancellationToken::new();
        let name = file.name.clone();
        self.shared.health.set_tenant(&name, TenantHealth::Starting);
        let task = AbortOnDropHandle::new(tokio::spawn(supervise(file, self.shared.clone(), cancel.clone())));
        self.tenants.insert(name, RunningTenant { cancel, task });
    }

    async fn stop(&mut self, name: &str) {
        if let Some(running) = self.tenants.remove(name) {
            stop_running(name, running, self.shared.settings.tenant_stop_grace).await;
        }
    }

    /// Starts a tenant that is not running (a shard slot of this replica's was taken).
    pub fn start_tenant(&mut self, file: TenantFile) {
        info!(tenant = %file.name, from = %file.origin, "starting tenant");
        self.start(file);
    }

    pub fn is_running(&self, name: &str) -> bool {
        self.tenants.contains_key(name)
    }

    /// The names of the running tenants.
    pub fn running(&self) -> Vec<String> {
        self.tenants.keys().cloned().collect()
    }

    /// Stops tenants that this replica no longer serves (their shard slot goes), letting in-flight
    /// reconciles finish within `grace`, and forgets their health and metrics: only the replica
    /// serving a tenant reports it.
    pub async fn hand_over(&mut self, names: &[String], grace: Duration) {
        let stopping: Vec<(String, RunningTenant)> = names
            .iter()
            .filter_map(|name| self.tenants.remove(name).map(|running| (name.clone(), running)))
            .collect();
        for (_, running) in &stopping {
            running.cancel.cancel();
        }
        futures::future::join_all(stopping.into_iter().map(|(name, running)| async move {
            stop_running(&name, running, grace).await;
            info!(tenant = %name, "tenant stopped");
            name
        }))
        .await;
        for name in names {
            self.shared.health.remove_tenant(name);
            self.shared.metrics.remove_tenant(name);
        }
    }

    /// Stops tenants at once, in-flight reconciles included (their shard slot is lost).
    pub async fn abort_tenants(&mut self, names: &[String]) {
        let aborted: Vec<RunningTenant> = names.iter().filter_map(|name| self.tenants.remove(name)).collect();
        for running in &aborted {
            running.cancel.cancel();
            running.task.abort();
        }
        for running in aborted {
            let _ = running.task.await;
        }
        for name in names {
            info!(tenant = %name, "tenant stopped");
            self.shared.health.remove_tenant(name);
            self.shared.metrics.remove_tenant(name);
        }
    }

    /// Stops every tenant at once, in-flight reconciles included: for a daemon that may no longer
    /// act (its leader lease is running out), waiting for them would be acting.
    pub async fn abort_all(&mut self) {
        let tenants = std::mem::take(&mut self.tenants);
        for running in tenants.values() {
            running.cancel.cancel();
            running.task.abort();
        }
        for (_, running) in tenants {
            let _ = running.task.await;
        }
    }

    /// Stops every tenant, letting in-flight reconciles finish.
    pub async fn stop_all(&mut self) {
        let tenants = std::mem::take(&mut self.tenants);
        for running in tenants.values() {
            running.cancel.cancel();
        }
        let grace = self.shared.settings.tenant_stop_grace;
        futures::future::join_all(tenants.into_iter().map(|(name, running)| async move {
            stop_running(&name, running, grace).await;
        }))
        .await;
    }
}

/// Stops a tenant, letting its in-flight reconciles finish within `grace`; returns once its task
/// tree is gone, so a tenant started after it never runs beside it.
async fn stop_running(name: &str, mut running: RunningTenant, grace: Duration) {
    running.cancel.cancel();
    if tokio::time::timeout(grace, &mut running.task).await.is_err() {
        warn!(tenant = %name, ?grace, "tenant did not stop in time; aborting it");
        running.task.abort();
        let _ = running.task.await;
    }
}

/// A run this long counts as healthy: the restart backoff starts over after it.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// Runs the tenant, restarting it when it fails or panics: with exponential backoff, or, when its
/// API server merely does not answer, as soon as a probe finds it answering again. An outage is
/// the tenant's [`Reachability`]'s to tell, once however many runs it ends.
async fn supervise(file: TenantFile, shared: Arc<Shared>, cancel: CancellationToken) {
    let name = file.name.clone();
    let labels = Metrics::tenant(&name);
    let reachability = Reachability::new(&name, shared.metrics.clone(), shared.health.clone());
    let mut failures = 0u32;
    let mut suspensions = 0u32;
    loop {
        let started = tokio::time::Instant::now();
        // A panic in the tenant's task surfaces as a JoinError here: it fails this tenant only.
        // The handle aborts the tenant's task tree when this task is aborted: a detached tree
        // would go on reconciling beside the one started after it.
        let run = tokio::spawn(tenant::run(
            file.clone(),
            shared.clone(),
            cancel.child_token(),
            reachability.clone(),
        ));
        let outcome = AbortOnDropHandle::new(run).await;
        if cancel.is_cancelled() {
            return;
        }
        if let Ok(Err(TenantError::OverMemoryBudget(overage))) = &outcome {
            if started.elapsed() >= HEALTHY_RUN {
                suspensions = 0;
            }
            suspensions += 1;
            let delay = suspend(&shared, &name, overage, suspensions);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(delay) => continue,
            }
        }
        let (reason, cause, outage) = match outcome {
            Ok(Ok(())) => ("its controllers stopped".to_string(), "controller", None),
            Ok(Err(err)) => (err.to_string(), err.cause_label(), err.outage()),
            Err(join) if join.is_panic() => (
                format!("panicked: {}", panics::message(join.into_panic())),
                "controller",
                None,
            ),
            Err(join) => (join.to_string(), "controller", None),
        };
        if started.elapsed() >= HEALTHY_RUN {
            failures = 0;
        }
        failures += 1;
        shared.metrics.tenant_restarts.get_or_create(&labels).inc();
        let delay = shared.settings.backoff.delay(failures);
        let wait = async {
            match outage {
                // Restarted when it answers, whatever the backoff: only then can the run get further.
                Some(cause) => {
                    reachability.report_down(cause);
                    answers_again(&file, &reachability, delay).await;
                }
                None => {
                    shared.metrics.set_tenant_down(&name, cause);
                    shared.health.set_tenant(&name, TenantHealth::Down(reason.clone()));
                    error!(tenant = %name, %reason, retry_in = ?delay, "tenant failed; restarting it");
                    tokio::time::sleep(delay).await;
                }
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = wait => {}
        }
    }
}

/// The least a suspended tenant waits before it is tried again: it relists everything it caches.
const SUSPENDED_RETRY_MIN: Duration = Duration::from_secs(2);

/// Suspends a tenant over its memory budget (its task tree has ended, its caches are freed): shown
/// on `/readyz?verbose` and `stackd_tenant_suspended` until it runs within its budget again, told
/// in one log line per suspension (not per retry). Returns when to try it again.
fn suspend(shared: &Shared, name: &str, overage: &Overage, suspensions: u32) -> Duration {
    let delay = shared.settings.backoff.delay(suspensions).max(SUSPENDED_RETRY_MIN);
    let reason = format!(
        "{overage}; delete or shrink objects (stackd_tenant_cached_bytes shows the total), or raise the budget; retried with backoff"
    );
    if shared.health.is_suspended(name) {
        info!(tenant = %name, %overage, retry_in = ?delay, "tenant still over its memory budget; it stays suspended");
    } else {
        warn!(tenant = %name, %overage, retry_in = ?delay, "tenant suspended: over its memory budget; its controllers and watches are stopped");
    }
    shared.health.suspend(name, &reason);
    shared.metrics.set_tenant_suspended(name, "memory_budget");
    // Its caches are gone with its task tree.
    shared
        .metrics
        .tenant_cached_bytes
        .get_or_create(&Metrics::tenant(name))
        .set(0);
    delay
}

/// Returns once the tenant's API server answers the probe, asking every few seconds (after
/// `delay` if no client can be made to ask it).
async fn answers_again(file: &TenantFile, reachability: &Arc<Reachability>, delay: Duration) {
    match tenant::probe_client(file).await {
        Ok(client) => reachability.until_answering(&client).await,
        Err(_) => tokio::time::sleep(delay).await,
    }
}
