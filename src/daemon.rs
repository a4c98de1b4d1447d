//! `stackd run`: one host client, one task tree per tenant (from the tenants directory and from
//! Tenant objects on the host, whose status the replica serving each writes), until told to stop.

use std::net::SocketAddr;
use std::sync::Arc;

use kube::Client;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::context::shared::{DaemonSettings, Shared};
use crate::host::namespace_watch::NamespaceWatch;
use crate::runtime::admin;
use crate::runtime::deadline::sleep_until;
use crate::runtime::health::Health;
use crate::runtime::leader;
use crate::runtime::metrics::Metrics;
use crate::runtime::reachability::Reachability;
use crate::runtime::shards::{self, Shards};
use crate::runtime::transport;
use crate::tenancy::directory::{self, TenantChange, TenantDirectory, WatchTiming};
use crate::tenancy::objects::status::{Serving, StatusWriter};
use crate::tenancy::objects::{self, ObjectSettings, TenantObjects};
use crate::tenancy::sharded::ShardedTenants;
use crate::tenancy::sources::Sources;
use crate::tenancy::supervisor::Registry;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot serve {addr}: {source}")]
    Admin { addr: SocketAddr, source: std::io::Error },
    #[error("cannot make a client of the host API server: {0}")]
    HostClient(#[source] kube::Error),
    #[error(transparent)]
    Leader(#[from] leader::LeaderError),
    #[error(transparent)]
    Shards(#[from] shards::ShardError),
    #[error("lost the leader lease; exiting so that another replica takes over")]
    LostLease,
    #[error("the shard leases stopped; exiting so that this replica starts again")]
    ShardsStopped,
}

/// Runs until `shutdown` fires: then readiness goes false, no new reconciles start, in-flight ones
/// finish, and the function returns. Every request to the host (`host_config`) tells the host's
/// reachability whether it answered, as a tenant's do.
pub async fn run(
    host_config: kube::Config,
    settings: DaemonSettings,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let host_reachability = Reachability::for_host(metrics.clone(), health.clone());
    let host = transport::host_client_builder(host_config)
        .map_err(DaemonError::HostClient)?
        .with_layer(&host_reachability.layer())
        .build();
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
    info!(
        tenants_dir = ?settings.tenants_dir,
        tenant_secret_namespaces = ?settings.tenant_secret_namespaces,
        "stackd running"
    );
    health.set_ready(true);
    let host_probe = tokio::spawn({
        let (reachability, host, cancel) = (host_reachability.clone(), host.clone(), admin_cancel.clone());
        async move { reachability.run_probes(&host, &cancel).await }
    });

    let host = (host, host_reachability);
    let result = if settings.shards.is_some() {
        run_sharded(host, settings, metrics, health.clone(), &shutdown).await
    } else {
        run_controllers(host, settings, metrics, health.clone(), &shutdown).await
    };

    health.set_ready(false);
    admin_cancel.cancel();
    let _ = host_probe.await;
    for task in admin_tasks {
        let _ = task.await;
    }
    info!("stackd stopped");
    result
}

async fn run_controllers(
    (host, host_reachability): (Client, Arc<Reachability>),
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
    let watch_cancel = shutdown.child_token();
    let (mut sources, view, watches) = start_sources((&host, &host_reachability), &settings, watch_cancel.clone());
    let shared = Arc::new(Shared {
        namespaces: NamespaceWatch::start(&host, &host_reachability, &watch_cancel),
        host,
        host_reachability,
        settings,
        metrics,
        health,
    });
    let status = start_status_writer(&shared, view, Serving::All, watch_cancel.clone());
    let mut registry = Registry::new(shared);

    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = lost(&mut leadership) => {
                error!("lost the leader lease; stopping controllers");
                break Err(DaemonError::LostLease);
            }
            batch = sources.next() => match batch {
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
        status.abort();
        registry.abort_all().await;
    }
    watch_cancel.cancel();
    let _ = status.await;
    for watch in watches {
        let _ = watch.await;
    }
    if outcome.is_ok() && !while_leading(registry.stop_all(), &mut leadership).await {
        registry.abort_all().await;
    }
    // Released, so a standby takes over at once.
    if let Some(leadership) = leadership {
        leadership.release().await;
    }
    outcome
}

/// Starts both sources of tenants: the tenants directory (when there is one) and the Tenant
/// objects; their merged changes come from the [`Sources`].
fn start_sources(
    (host, host_reachability): (&Client, &Arc<Reachability>),
    settings: &DaemonSettings,
    cancel: CancellationToken,
) -> (Sources, Arc<TenantObjects>, Vec<tokio::task::JoinHandle<()>>) {
    let mut tasks = Vec::new();
    let directory = settings.tenants_dir.as_ref().map(|dir| {
        let (changes, task) = watch_directory(dir, settings, cancel.clone());
        tasks.push(task);
        changes
    });
    let object_settings = ObjectSettings {
        secret_namespaces: settings.tenant_secret_namespaces.clone(),
        template: settings.namespace_template.clone(),
    };
    let (view, objects, task) = objects::start(host.clone(), object_settings, Some(host_reachability.clone()), cancel);
    tasks.push(task);
    (Sources::new(directory, objects, view.clone()), view, tasks)
}

/// Starts writing the status of the Tenants `serving` says this replica serves.
fn start_status_writer(
    shared: &Shared,
    view: Arc<TenantObjects>,
    serving: Serving,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let writer = StatusWriter {
        host: shared.host.clone(),
        host_reachability: Some(shared.host_reachability.clone()),
        view,
        health: shared.health.clone(),
        metrics: shared.metrics.clone(),
        template: shared.settings.namespace_template.clone(),
        replica: shared.settings.identity.clone(),
        serving,
    };
    tokio::spawn(writer.run(cancel))
}

/// Starts watching the tenants directory: batches of changes arrive on the receiver.
fn watch_directory(
    dir: &std::path::Path,
    settings: &DaemonSettings,
    cancel: CancellationToken,
) -> (mpsc::Receiver<Vec<TenantChange>>, tokio::task::JoinHandle<()>) {
    let directory = TenantDirectory::new(dir.to_path_buf(), settings.namespace_template.clone());
    let timing = WatchTiming {
        debounce: settings.debounce,
        rescan: settings.rescan_interval,
    };
    let (changes_tx, changes) = mpsc::channel(16);
    let watch = tokio::spawn(directory::watch(directory, timing, changes_tx, cancel));
    (changes, watch)
}

/// With `--shards`: the tenants the shard map gives this replica, until `shutdown`; then every
/// tenant stops and the member Lease is released so that the other replicas take them at once.
async fn run_sharded(
    (host, host_reachability): (Client, Arc<Reachability>),
    settings: DaemonSettings,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: &CancellationToken,
) -> Result<(), DaemonError> {
    let Some(shard_settings) = settings.shards.clone() else {
        return Ok(());
    };
    info!(namespace = %shard_settings.namespace, identity = %shard_settings.identity, "sharing the tenants with the other replicas");
    let mut shards = Shards::start(shard_settings)?;
    let board = shards.board.clone();
    let watch_cancel = shutdown.child_token();
    let (mut sources, view, watches) = start_sources((&host, &host_reachability), &settings, watch_cancel.clone());
    let shared = Arc::new(Shared {
        namespaces: NamespaceWatch::start(&host, &host_reachability, &watch_cancel),
        host,
        host_reachability,
        settings,
        metrics,
        health,
    });
    let serving = Serving::Shards { board: board.clone() };
    let status = start_status_writer(&shared, view, serving, watch_cancel.clone());
    let mut tenants = ShardedTenants::new(shared, board.clone());
    let outcome = loop {
        let wake = tenants.next_deadline();
        tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            _ = shards.ended() => break Err(DaemonError::ShardsStopped),
            batch = sources.next() => match batch {
                // Synced after each change: a long batch must not delay aborting every tenant
                // when the Lease is not renewed.
                Some(batch) => {
                    for change in batch {
                        tenants.apply(change).await;
                        tenants.sync().await;
                    }
                    tenants.loaded();
                }
                None => break Ok(()),
            },
            _ = board.to_daemon.notified() => {}
            _ = sleep_until(wake) => {}
        }
        tenants.sync().await;
    };
    watch_cancel.cancel();
    let _ = status.await;
    for watch in watches {
        let _ = watch.await;
    }
    tenants.stop_all().await;
    shards.release().await;
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
