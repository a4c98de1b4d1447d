//! One tenant's task tree: its client, its host namespace, and its controllers.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::rbac::v1::RoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::ApiResource;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, Config};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::directory::{TenantConnection, TenantFile};
use crate::api::crds::is_established;
use crate::context::shared::Shared;
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::apply::HostWrites;
use crate::host::cluster_identity;
use crate::host::labels::tenant_selector;
use crate::host::sweep::run::sweep_once;
use crate::runtime::backoff::ObjectBackoff;
use crate::runtime::cause::{CauseKind, diagnose};
use crate::runtime::controller::FairPermits;
use crate::runtime::health::TenantHealth;
use crate::runtime::informers::{Change, Informers};
use crate::runtime::memory_budget::MemoryBudget;
use crate::runtime::metrics::Metrics;
use crate::runtime::reachability::Reachability;
use crate::runtime::startup::Startup;
use crate::runtime::transport;

/// The CRDs every tenant must serve for stackd to work there.
fn required_crds() -> BTreeSet<String> {
    crate::api::crds::names().into_iter().map(String::from).collect()
}

/// Runs a tenant until `cancel` fires (Ok) or something fails (Err). Every request to the tenant
/// tells `reachability` whether it reached the server.
pub async fn run(
    file: TenantFile,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    reachability: Arc<Reachability>,
) -> Result<(), TenantError> {
    let name = file.name.clone();
    let TenantClients {
        client,
        probe: probe_client,
    } = tenant_clients(&file, &reachability).await?;
    reachability.restarting();
    let version = tokio::select! {
        _ = cancel.cancelled() => return Ok(()),
        version = client.apiserver_version() => version.map_err(|e| TenantError::Unreachable(diagnose(&e)))?,
    };
    info!(tenant = %name, version = %version.git_version, "tenant API server reached");
    shared.health.set_server_version(&name, &version.git_version);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "stackd".into(),
            instance: std::env::var("POD_NAME").ok(),
        },
    );
    let context = Arc::new(TenantContext {
        name: name.clone(),
        client: client.clone(),
        host: shared.host.clone(),
        host_namespace: file.host_namespace.clone(),
        endpoint: file.endpoint.clone(),
        reconcile_permits: FairPermits::new(shared.settings.max_concurrent_reconciles),
        recorder: recorder.clone(),
        object_backoff: ObjectBackoff::new(shared.settings.backoff),
        host_writes: HostWrites::new(shared.settings.backoff),
        caches: Informers::new(
            client.clone(),
            shared.host.clone(),
            &file.host_namespace,
            &tenant_selector(&name),
        )
        .reporting_to(recorder, crate::host::labels::parent_of_host_object)
        .limited(
            shared.settings.max_cached_object_bytes,
            Some(memory_budget(&shared, &name)),
        )
        .resuming_on(reachability.back())
        .resuming_host_on(shared.host_reachability.back()),
        shared,
        reachability,
        startup: Startup::default(),
        quota_admitted: Default::default(),
    });
    let _caches = StopCaches(context.clone());
    if let Err(err) = &context.endpoint {
        warn!(tenant = %name, error = %err, "host pods cannot reach this tenant; stacks will not become ready");
    }
    let mut controllers = tokio::task::JoinSet::new();
    controllers.spawn(probe(context.clone(), probe_client, cancel.clone()));
    let (host_ready, host_namespace_ready) = tokio::sync::watch::channel(false);
    controllers.spawn(super::host_namespace::run(context.clone(), cancel.clone(), host_ready));
    controllers.spawn(crd_monitor(context.clone(), cancel.clone()));
    // Everything else watches or writes the host namespace: on a real cluster, requests made before
    // the daemon's RoleBinding there takes effect are refused 403.
    if let Some(stopped) = wait_until_ready(host_namespace_ready, &mut controllers, &cancel).await {
        return stopped;
    }
    // Host objects are judged by the tenant's uids (the sweep): only for the cluster they came from.
    let cluster_uid = cluster_identity::tenant_cluster_uid(&client).await?;
    cluster_identity::check(&context.host, &context.host_namespace, &cluster_uid).await?;
    // No pod of the tenant's is created before its quota and container defaults are in place.
    let (quota_applied, quota_ready) = tokio::sync::watch::channel(false);
    controllers.spawn(super::quota::run(context.clone(), cancel.clone(), quota_applied));
    if let Some(stopped) = wait_until_ready(quota_ready, &mut controllers, &cancel).await {
        return stopped;
    }
    move_legacy_names(&context).await?;
    // Ends with the caches (or `cancel`): not one of the controllers whose end stops the tenant.
    tokio::spawn(context.clone().forget_admitted_when_seen(cancel.clone()));
    controllers.spawn(super::budget::watch(context.clone(), cancel.clone()));
    controllers.spawn(orphan_sweeper(context.clone(), cancel.clone()));
    controllers.spawn(crate::stacks::install::run(context.clone(), cancel.clone()));
    controllers.spawn(crate::stacks::stack::run(context.clone(), cancel.clone()));
    controllers.spawn(crate::pools::run(context.clone(), cancel.clone()));
    controllers.spawn(crate::inventory::run(context.clone(), cancel.clone()));
    controllers.spawn(super::summary::run(context.clone(), cancel.clone()));
    controllers.spawn(started(context.clone(), cancel.clone()));
    while let Some(result) = controllers.join_next().await {
        match result {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(err),
            Err(join) => return Err(TenantError::Controller(join.to_string())),
        }
    }
    Ok(())
}

/// The controllers of a run, as their metrics name them.
fn controllers() -> Vec<&'static str> {
    let stacks = [crate::stacks::stack::CONTROLLER];
    [
        &crate::stacks::install::CONTROLLERS[..],
        &stacks,
        &crate::pools::CONTROLLERS,
        &crate::inventory::CONTROLLERS,
    ]
    .concat()
}

/// Shows the tenant up once every controller has filled its caches: whoever sees it up (an
/// operator, a test about to stop its server) may count on the whole start having happened.
async fn started(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let controllers = controllers();
    tokio::select! {
        _ = cancel.cancelled() => {}
        complete = context.startup.complete(&controllers) => if complete {
            debug!(tenant = %context.name, "tenant started: every controller's caches are filled");
            context.reachability.set_started();
        },
    }
    Ok(())
}

/// Host objects an older stackd named move to their current names before a controller looks.
async fn move_legacy_names(context: &TenantContext) -> Result<(), TenantError> {
    let (host, namespace) = (&context.host, &context.host_namespace);
    crate::host::legacy_names::move_to_current_names(host, &context.name, namespace, &host_kinds())
        .await
        .map(drop)
        .map_err(TenantError::LegacyNames)
}

/// A fresh budget for one run of the tenant, reported as `stackd_tenant_cached_bytes`.
fn memory_budget(shared: &Shared, name: &str) -> Arc<MemoryBudget> {
    let gauge = shared
        .metrics
        .tenant_cached_bytes
        .get_or_create(&Metrics::tenant(name))
        .clone();
    let settings = &shared.settings;
    MemoryBudget::new(
        settings.tenant_memory_budget,
        settings.namespace_memory_budget,
        settings.namespace_max_objects,
        Some(gauge),
    )
}

/// Stops the tenant's shared watches when its task tree ends, however it ends.
struct StopCaches(Arc<TenantContext>);

impl Drop for StopCaches {
    fn drop(&mut self) {
        self.0.caches.stop();
    }
}

/// Waits until `ready` turns true; returns how the tenant ends instead when it is cancelled or a
/// controller stops first.
async fn wait_until_ready(
    mut ready: tokio::sync::watch::Receiver<bool>,
    controllers: &mut tokio::task::JoinSet<Result<(), TenantError>>,
    cancel: &CancellationToken,
) -> Option<Result<(), TenantError>> {
    tokio::select! {
        _ = cancel.cancelled() => Some(Ok(())),
        _ = ready.wait_for(|ready| *ready) => None,
        Some(result) = controllers.join_next() => Some(match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(err),
            Err(join) => Err(TenantError::Controller(join.to_string())),
        }),
    }
}

/// The tenant's clients, as its kubeconfig file says: `client`, whose every request tells
/// `reachability` whether it reached the server (and a GOAWAY on its connection, that the server
/// may be going), and `probe`, which asks over a new connection each time
/// ([`Reachability::run_probes`]).
pub async fn tenant_clients(file: &TenantFile, reachability: &Arc<Reachability>) -> Result<TenantClients, TenantError> {
    let config = tenant_config(file).await?;
    let going_away = {
        let (reachability, tenant) = (reachability.clone(), file.name.clone());
        Arc::new(move || {
            debug!(%tenant, "the tenant API server sent GOAWAY or closed a connection; asking it over a new one");
            reachability.suspect();
        })
    };
    let client = transport::tenant_client_builder(config.clone(), going_away)
        .map_err(|e| TenantError::Config(e.to_string()))?
        .with_layer(&reachability.layer())
        .build();
    let probe = transport::new_connection_client(config).map_err(|e| TenantError::Config(e.to_string()))?;
    Ok(TenantClients { client, probe })
}

/// See [`tenant_clients`].
pub struct TenantClients {
    pub client: Client,
    pub probe: Client,
}

/// The tenant's probe client alone (see [`tenant_clients`]): for a tenant whose run ended.
pub async fn probe_client(file: &TenantFile) -> Result<Client, TenantError> {
    transport::new_connection_client(tenant_config(file).await?).map_err(|e| TenantError::Config(e.to_string()))
}

/// The tenant's kubeconfig as a client configuration, with the daemon's timeouts and no retries.
async fn tenant_config(file: &TenantFile) -> Result<Config, TenantError> {
    let mut config = match &file.connection {
        TenantConnection::Kubeconfig(kubeconfig) => {
            let options = kube::config::KubeConfigOptions::default();
            Config::from_custom_kubeconfig(kubeconfig.as_ref().clone(), &options)
                .await
                .map_err(|e| TenantError::Config(e.to_string()))?
        }
        TenantConnection::Checked(config) => config.as_ref().clone(),
    };
    // A dead tenant must fail fast instead of holding its task for minutes.
    config.connect_timeout = Some(Duration::from_secs(5));
    // kube retries a 503 up to 15 times, minutes in all: every request to a tenant answering
    // nothing else would hang, its probe included. stackd retries itself (per object, per watch).
    config.default_retry = false;
    Ok(config)
}

/// Runs the tenant's probe: down and up are its verdicts (`runtime::reachability`).
async fn probe(context: Arc<TenantContext>, probe: Client, cancel: CancellationToken) -> Result<(), TenantError> {
    context.reachability.run_probes(&probe, &cancel).await;
    Ok(())
}

/// Tenant kinds that own host objects.
fn parent_kinds() -> Vec<ApiResource> {
    use crate::api::{inventory::*, pools::*, stacks::*};
    vec![
        ApiResource::erase::<StackInstall>(&()),
        ApiResource::erase::<ClusterStackInstall>(&()),
        ApiResource::erase::<Stack>(&()),
        ApiResource::erase::<ClusterPool>(&()),
        ApiResource::erase::<ClusterDeploymentCustomization>(&()),
        ApiResource::erase::<ClusterDeployment>(&()),
        ApiResource::erase::<ClusterClaim>(&()),
        ApiResource::erase::<BareMetalAsset>(&()),
    ]
}

/// Host kinds stackd creates for tenant objects.
fn host_kinds() -> Vec<ApiResource> {
    use k8s_openapi::api::{apps::v1::Deployment, batch::v1::Job, core::v1::*, rbac::v1::Role};
    vec![
        ApiResource::erase::<Deployment>(&()),
        ApiResource::erase::<Job>(&()),
        ApiResource::erase::<Secret>(&()),
        ApiResource::erase::<ConfigMap>(&()),
        ApiResource::erase::<ServiceAccount>(&()),
        ApiResource::erase::<Role>(&()),
        ApiResource::erase::<RoleBinding>(&()),
    ]
}

/// Deletes host objects whose tenant parent is gone, once the tenant has started and every
/// `--sweep-interval` after (at the tenant's own point of it): the backstop for deletions the
/// daemon missed while it was down.
async fn orphan_sweeper(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let (parents, hosts) = (parent_kinds(), host_kinds());
    let mut sweeps = context.sweeps();
    // Not in the way of the start (its fifteen lists are a good part of one): a thousand tenants
    // starting at once are up sooner. One whose start never completes (no CRDs) is swept at its
    // interval.
    let mut at_start = true;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = context.startup.completed(), if at_start => {}
            _ = sweeps.tick() => {}
        }
        at_start = false;
        if context.reachability.is_down() || context.shared.host_reachability.is_down() {
            debug!(tenant = %context.name, "orphan sweep skipped: the tenant or host API server is down");
            continue;
        }
        let sweep = sweep_once(
            &context.host,
            &context.client,
            &context.name,
            &context.host_namespace,
            &parents,
            &hosts,
        );
        if let Err(err) = sweep.await {
            let cause = diagnose(&err);
            // It reads both servers: an outage of either is its probe's to tell.
            let servers = [&context.reachability, &context.shared.host_reachability];
            if cause.kind.is_outage() && servers.iter().any(|server| server.in_doubt()) {
                debug!(tenant = %context.name, %cause, "orphan sweep failed; retrying at the next interval");
            } else {
                warn!(tenant = %context.name, error = %err, "orphan sweep failed; retrying at the next interval");
            }
        }
    }
}

/// Watches the tenant's CRDs: the tenant is up, or degraded while stackd's own CRDs are not served
/// there (shown unless it is down). A failing watch starts the probe, which alone says down and up:
/// a stopping server keeps open watches delivering while it refuses everything new. A 410 is no
/// outage: the server answered, and the watch relists.
async fn crd_monitor(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let crds = context.caches.tenant_crds();
    let (store, ready) = (crds.store(), crds.readiness());
    let mut events = crds.changes();
    let required = required_crds();
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            event = events.next() => event,
        };
        match event {
            None => return Err(TenantError::Controller("tenant CRD watch ended".into())),
            Some(Change::Failed(err)) => {
                let cause = diagnose(err.as_ref());
                debug!(tenant = %context.name, %cause, "tenant CRD watch failed; retrying");
                if cause.kind != CauseKind::Expired {
                    context.reachability.suspect();
                }
                continue;
            }
            Some(Change::Touched(_) | Change::Synced) => {}
        }
        if ready.is_ready() {
            context.reachability.set_serving(crd_health(&store.state(), &required));
        }
    }
}

/// Up when every stackd CRD is established on the tenant, degraded (saying how to fix it) otherwise.
fn crd_health(crds: &[Arc<CustomResourceDefinition>], required: &BTreeSet<String>) -> TenantHealth {
    let served: BTreeSet<String> = crds
        .iter()
        .filter(|crd| is_established(crd))
        .filter_map(|crd| crd.metadata.name.clone())
        .collect();
    let missing: Vec<&str> = required.difference(&served).map(String::as_str).collect();
    if missing.is_empty() {
        TenantHealth::Up
    } else {
        TenantHealth::Degraded(format!(
            "stackd's CRDs are not installed: {}; install them with `stackd crds | kubectl apply -f -` or the stackd-types chart",
            missing.join(", ")
        ))
    }
}
