//! `stackd run`: one host client, one task tree per tenant kubeconfig, until told to stop.

use std::net::SocketAddr;
use std::sync::Arc;

use kube::Client;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::context::shared::{DaemonSettings, Shared};
use crate::runtime::admin;
use crate::runtime::health::Health;
use crate::runtime::leader;
use crate::runtime::metrics::Metrics;
use crate::tenancy::directory::{self, TenantDirectory, WatchTiming};
use crate::tenancy::supervisor::Registry;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot serve {addr}: {source}")]
    Admin { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Leader(#[from] leader::LeaderError),
    #[error("lost the leader lease; exiting so that another replica takes over")]
    LostLease,
}

/// Runs until `shutdown` fires: then readiness goes false, no new reconciles start, in-flight ones
/// finish, and the function returns.
pub async fn run(host: Client, settings: DaemonSettings, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let admin_cancel = CancellationToken::new();
    let mut listeners = vec![(
        settings.metrics_addr,
        if settings.health_addr.is_some() {
            admin::Endpoints::Metrics
        } else {
            admin::Endpoints::All
        },
    )];
    listeners.extend(settings.health_addr.map(|addr| (addr, admin::Endpoints::Health)));
    let mut admin_tasks = Vec::new();
    for (addr, endpoints) in listeners {
        let (bound, task) = admin::serve(addr, endpoints, metrics.clone(), health.clone(), admin_cancel.clone())
            .await
            .map_err(|source| DaemonError::Admin { addr, source })?;
        info!(admin_addr = %bound, ?endpoints, "admin server listening");
        admin_tasks.push(task);
    }
    info!(tenants_dir = %settings.tenants_dir.display(), "stackd running");
    health.set_ready(true);

    let result = run_controllers(host, settings, metrics, health.clone(), &shutdown).await;

    health.set_ready(false);
    admin_cancel.cancel();
    for task in admin_tasks {
        let _ = task.await;
    }
    info!("stackd stopped");
    result
}

async fn run_controllers(
    host: Client,
    settings: DaemonSettings,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: &CancellationToken,
) -> Result<(), DaemonError> {
    let mut leadership = match &settings.leader_election {
        None => None,
        Some(election) => {
            info!(lease = %election.lease_name, namespace = %election.namespace, identity = %election.identity, "waiting for the leader lease");
            match leader::acquire(election, shutdown).await? {
                Some(leadership) => {
                    info!("acquired the leader lease; starting controllers");
                    Some(leadership)
                }
                None => return Ok(()),
            }
        }
    };
    let directory = TenantDirectory::new(settings.tenants_dir.clone(), settings.namespace_template.clone());
    let timing = WatchTiming {
        debounce: settings.debounce,
        rescan: settings.rescan_interval,
    };
    let shared = Arc::new(Shared {
        host,
        settings,
        metrics,
        health,
    });
    let mut registry = Registry::new(shared);
    let (changes_tx, mut changes) = mpsc::channel(16);
    let watch_cancel = shutdown.child_token();
    let watch = tokio::spawn(directory::watch(directory, timing, changes_tx, watch_cancel.clone()));

    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = lost(&mut leadership) => {
                error!("lost the leader lease; stopping controllers");
                break Err(DaemonError::LostLease);
            }
            batch = changes.recv() => match batch {
                Some(batch) => {
                    // A tenant's stop may take its whole grace, longer than the lease lasts.
                    let applied = async { for change in batch { registry.apply(change).await } };
                    if !while_leading(applied, &mut leadership).await {
                        break Err(DaemonError::LostLease);
                    }
                }
                None => break Ok(()),
            },
        }
    };
    if matches!(outcome, Err(DaemonError::LostLease)) {
        // Stop at once: a standby may take the lease soon, and it must find no one acting.
        registry.abort_all().await;
    }
    watch_cancel.cancel();
    let _ = watch.await;
    if outcome.is_ok() && !while_leading(registry.stop_all(), &mut leadership).await {
        registry.abort_all().await;
    }
    // Released, so a standby takes over at once.
    if let Some(leadership) = leadership {
        leadership.release().await;
    }
    outcome
}

/// Runs `work` unless the leader lease is lost first (then `work` is dropped): whether it finished.
async fn while_leading(
    work: impl std::future::Future<Output = ()>,
    leadership: &mut Option<leader::Leadership>,
) -> bool {
    tokio::select! {
        _ = work => true,
        _ = lost(leadership) => {
            error!("lost the leader lease; stopping controllers");
            false
        }
    }
}

async fn lost(leadership: &mut Option<leader::Leadership>) {
    match leadership {
        Some(leadership) => leadership.lost().await,
        None => std::future::pending().await,
    }
}
