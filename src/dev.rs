//! `stackd dev`: embedded host and tenant API servers on loopback, their kubeconfigs on disk, the
//! stackd CRDs installed in every tenant, and (unless `--no-daemon`) the daemon serving them,
//! registered as Tenant objects on the host (their kubeconfigs in Secrets of `stackd-system`), as
//! a platform team would register them. The terminal shows progress lines only; the daemon's log
//! goes to a file (`--log-file`), or between them with `--verbose`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;

use crate::api::tenancy::{KubeconfigSecretRef, Tenant, TenantSpec};
use crate::context::crd_groups::CrdGroups;
use crate::context::shared::DaemonSettings;
use crate::daemon;

mod sample_stack;
use crate::context::namespace_template::NamespaceTemplate;
use crate::embedded::samples::{SampleImages, register_sample_runners};
use crate::embedded::{ApiServer, ServerOptions};
use crate::host::labels::{MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL};
use crate::host::namespace::ServiceAccountRef;
use crate::runtime::backoff::Backoff;

/// The image `stackd dev` gives install Jobs for their unpack container.
const STACKD_DEV_IMAGE: &str = "stackd:dev";

/// The host namespace of the tenants' kubeconfig Secrets, the one the daemon is given.
pub const TENANT_SECRETS_NAMESPACE: &str = "stackd-system";
/// The key of each kubeconfig Secret (Cluster API's, `<cluster>-kubeconfig` key `value`).
const KUBECONFIG_KEY: &str = "value";

/// Names given to the first tenants; later ones are `tenant-<n>`.
const TENANT_NAMES: [&str; 6] = ["acme", "globex", "initech", "umbrella", "hooli", "stark"];

#[derive(Clone, Debug)]
pub struct DevOptions {
    pub tenants: u16,
    pub no_daemon: bool,
    pub kubeconfig_dir: PathBuf,
    /// Where the daemon's log goes; `None` when it is shown in the terminal.
    pub log_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error("cannot start an embedded API server: {0}")]
    Server(#[from] crate::embedded::Error),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot install the CRDs into tenant {tenant}: {source}")]
    Crds { tenant: String, source: kube::Error },
    #[error("cannot register the tenants as Tenant objects on the host: {0}")]
    Register(kube::Error),
    #[error(transparent)]
    Daemon(#[from] daemon::DaemonError),
}

/// The name of the `index`th tenant (from 0).
pub fn tenant_name(index: usize) -> String {
    TENANT_NAMES
        .get(index)
        .map_or_else(|| format!("tenant-{}", index + 1), |name| name.to_string())
}

/// Runs until `shutdown` fires.
pub async fn run(options: DevOptions, shutdown: CancellationToken) -> Result<(), DevError> {
    let host = ApiServer::start(ServerOptions {
        name: "host".into(),
        ..Default::default()
    })
    .await?;
    // The host "runs" install and installer Jobs through scripted runners for the sample images.
    register_sample_runners(&host.runners(), &SampleImages::new(STACKD_DEV_IMAGE));
    let tenants_dir = options.kubeconfig_dir.join("tenants");
    prepare_tenants_dir(&tenants_dir)?;
    write(&options.kubeconfig_dir.join("host.yaml"), &host.kubeconfig_yaml())?;
    let mut tenants = Vec::new();
    for index in 0..usize::from(options.tenants) {
        let name = tenant_name(index);
        // https with HTTP/2 offered, as a real tenant's kube-apiserver: the daemon's watches and
        // requests of a tenant share one connection. A bearer token, as a real tenant's kubeconfig
        // carries credentials: kubectl asks for a username and password on an https server whose
        // kubeconfig user has none, and fails without a terminal.
        let server = ApiServer::start(ServerOptions {
            name: name.clone(),
            tls: true,
            token: Some(format!("dev-{}", crate::embedded::verbs::new_uid())),
            ..Default::default()
        })
        .await?;
        install_crds(&server, &name).await?;
        write(&tenants_dir.join(format!("{name}.yaml")), &server.kubeconfig_yaml())?;
        tenants.push((name, server));
    }
    print_usage(&options, &host, &tenants);

    // A sample pool of size 2 over three ClusterDeploymentCustomizations fills in the first tenant.
    let mut sample_progress = None;
    if let Some((name, server)) = tenants.first().filter(|_| !options.no_daemon) {
        let client = server.client().await;
        match crate::pools::sample::install(&client).await {
            Ok(()) => {
                println!(
                    "\nSample pool {}/{} created in tenant {name}.",
                    crate::pools::sample::NAMESPACE,
                    crate::pools::sample::POOL
                );
                sample_progress = Some(tokio::spawn(crate::pools::sample::print_progress(
                    name.clone(),
                    client,
                    shutdown.clone(),
                )));
            }
            Err(err) => eprintln!("cannot create the sample pool in tenant {name}: {err}"),
        }
    }
    let result = if options.no_daemon {
        println!("\nServing the API servers only (--no-daemon). Ctrl-C stops them.");
        shutdown.cancelled().await;
        Ok(())
    } else {
        match register_tenants(&host, &tenants).await {
            Ok(()) => run_daemon(&host, &tenants, shutdown).await,
            Err(err) => Err(err),
        }
    };
    if let Some(progress) = sample_progress {
        progress.abort();
    }
    for (_, server) in tenants {
        server.shutdown().await;
    }
    host.shutdown().await;
    result
}

/// Tenant files of an earlier run with more tenants would start tenants whose servers are gone.
fn prepare_tenants_dir(dir: &Path) -> Result<(), DevError> {
    std::fs::create_dir_all(dir).map_err(|source| DevError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let entries = std::fs::read_dir(dir).map_err(|source| DevError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::remove_file(&path).map_err(|source| DevError::Write { path, source })?;
        }
    }
    Ok(())
}

/// Writes `path` whole or not at all (a file renamed into place): the daemon and the user's kubectl
/// read these files as soon as they appear.
fn write(path: &Path, content: &str) -> Result<(), DevError> {
    let failed = |source: std::io::Error| DevError::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut file = tempfile::NamedTempFile::new_in(dir).map_err(failed)?;
    std::io::Write::write_all(&mut file, content.as_bytes()).map_err(failed)?;
    file.persist(path).map_err(|err| failed(err.error))?;
    Ok(())
}

/// Registers every tenant on the host as a platform team would: its kubeconfig in a Secret of
/// [`TENANT_SECRETS_NAMESPACE`] and a Tenant naming it.
async fn register_tenants(host: &ApiServer, tenants: &[(String, ApiServer)]) -> Result<(), DevError> {
    let client = host.client().await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crate::api::crds::host() {
        crds.create(&PostParams::default(), &crd)
            .await
            .map_err(DevError::Register)?;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(TENANT_SECRETS_NAMESPACE.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    namespaces
        .create(&PostParams::default(), &namespace)
        .await
        .map_err(DevError::Register)?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), TENANT_SECRETS_NAMESPACE);
    let objects: Api<Tenant> = Api::all(client);
    for (name, server) in tenants {
        let secret_name = format!("{name}-kubeconfig");
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(secret_name.clone()),
                ..Default::default()
            },
            string_data: Some(BTreeMap::from([(KUBECONFIG_KEY.to_string(), server.kubeconfig_yaml())])),
            ..Default::default()
        };
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .map_err(DevError::Register)?;
        let spec = TenantSpec {
            kubeconfig_secret_ref: KubeconfigSecretRef {
                namespace: TENANT_SECRETS_NAMESPACE.to_string(),
                name: secret_name,
                key: KUBECONFIG_KEY.to_string(),
            },
            ..Default::default()
        };
        objects
            .create(&PostParams::default(), &Tenant::new(name, spec))
            .await
            .map_err(DevError::Register)?;
    }
    Ok(())
}

async fn install_crds(server: &ApiServer, tenant: &str) -> Result<(), DevError> {
    let api: Api<CustomResourceDefinition> = Api::all(server.client().await);
    for crd in crate::api::crds::all() {
        api.create(&PostParams::default(), &crd)
            .await
            .map_err(|source| DevError::Crds {
                tenant: tenant.to_string(),
                source,
            })?;
    }
    Ok(())
}

fn print_usage(options: &DevOptions, host: &ApiServer, tenants: &[(String, ApiServer)]) {
    let dir = options.kubeconfig_dir.display();
    println!("stackd dev: embedded API servers on loopback\n");
    println!("  host     {}   kubeconfig {dir}/host.yaml", host.url());
    for (name, server) in tenants {
        println!(
            "  {name:<8} {}   kubeconfig {dir}/tenants/{name}.yaml (stackd CRDs installed)",
            server.url()
        );
    }
    if let Some(log_file) = &options.log_file {
        println!(
            "\n  log      {} (the daemon's; --verbose shows it here instead)",
            log_file.display()
        );
    }
    if let Some((name, _)) = tenants.first() {
        println!("\nTry:");
        if !options.no_daemon {
            println!("  kubectl --kubeconfig {dir}/host.yaml get tenants");
        }
        println!("  kubectl --kubeconfig {dir}/tenants/{name}.yaml get crds");
        println!("  kubectl --kubeconfig {dir}/tenants/{name}.yaml apply -f examples/pools/clusterpool-vsphere.yaml");
        println!("  kubectl --kubeconfig {dir}/host.yaml get namespaces -l app.kubernetes.io/managed-by=stackd");
    }
}

async fn run_daemon(
    host: &ApiServer,
    tenants: &[(String, ApiServer)],
    shutdown: CancellationToken,
) -> Result<(), DevError> {
    // The daemon serves the Tenant objects; the files in the tenants directory are for kubectl.
    let settings = DaemonSettings {
        tenants_dir: None,
        tenant_secret_namespaces: [TENANT_SECRETS_NAMESPACE.to_string()].into(),
        identity: "stackd-dev".to_string(),
        namespace_template: NamespaceTemplate::default(),
        stackd_image: STACKD_DEV_IMAGE.to_string(),
        allow_insecure_tenant_endpoint: true,
        insecure_allow_all_apigroups: false,
        insecure_pass_full_deployment: false,
        stack_pod_policy: Default::default(),
        tenant_quota: Default::default(),
        stack_crd_groups: Default::default(),
        platform_dependency_groups: CrdGroups::platform_types(),
        insecure_allow_conversion_webhooks: false,
        stack_limits: Default::default(),
        allowed_registries: Default::default(),
        metrics_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        health_addr: None,
        leader_election: None,
        shards: None,
        rbac_subject: ServiceAccountRef {
            namespace: "stackd-system".into(),
            name: "stackd".into(),
        },
        max_concurrent_reconciles: 4,
        lease_min_age: Duration::from_secs(10),
        managed_cluster_timeout: Duration::from_secs(15),
        installer_deadline: Duration::from_secs(3 * 60 * 60),
        pull_failure_grace: Duration::from_secs(3 * 60),
        namespace_max_pools: 50,
        namespace_max_clusters: 100,
        namespace_secret_lookups: crate::inventory::LOOKUPS_PER_NAMESPACE,
        sweep_interval: Duration::from_secs(60),
        backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(30)),
        debounce: Duration::from_millis(200),
        rescan_interval: Duration::from_secs(30),
        tenant_stop_grace: Duration::from_secs(20),
        max_cached_object_bytes: crate::runtime::memory_budget::ByteSize::DEFAULT_MAX_OBJECT,
        tenant_memory_budget: crate::runtime::memory_budget::ByteSize::DEFAULT_TENANT_BUDGET,
        document_limits: crate::bounds::DocumentLimits::default(),
        namespace_memory_budget: crate::runtime::memory_budget::default_namespace_share(
            crate::runtime::memory_budget::ByteSize::DEFAULT_TENANT_BUDGET,
        ),
        namespace_max_objects: crate::runtime::memory_budget::DEFAULT_NAMESPACE_MAX_OBJECTS,
        monitoring_namespace: None,
    };
    println!("\nThe daemon is serving every tenant; progress follows. Ctrl-C stops everything.\n");
    let progress = tokio::spawn(print_progress(host.client().await, shutdown.clone()));
    let tenant_states = tokio::spawn(print_tenant_states(host.client().await, shutdown.clone()));
    let mut samples = Vec::new();
    if let Some((name, server)) = tenants.first() {
        samples.push(tokio::spawn(sample_stack::run(
            name.clone(),
            server.client().await,
            shutdown.clone(),
        )));
    }
    let restart = restart_and_install(tenants.get(1), shutdown.clone());
    let (result, ()) = tokio::join!(daemon::run(host.config().await, settings, shutdown), restart);
    progress.abort();
    tenant_states.abort();
    for sample in samples {
        sample.abort();
    }
    Ok(result?)
}

/// How long after the start the second tenant's API server restarts.
const RESTART_AFTER: Duration = Duration::from_secs(8);
/// How long its restart refuses connections.
const RESTART_DOWNTIME: Duration = Duration::from_secs(3);

/// Shows recovery: restarts the second tenant's API server as an upgrade would (down a few seconds,
/// then a fresh watch cache that answers resumed watches 410) and installs the sample stack there
/// as soon as it answers; the daemon serves it again within seconds.
async fn restart_and_install(tenant: Option<&(String, ApiServer)>, shutdown: CancellationToken) {
    let Some((name, server)) = tenant else { return };
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = tokio::time::sleep(RESTART_AFTER) => {}
    }
    println!(
        "  [{name}] restarting the API server: {} s down, then a fresh watch cache (resumed watches get 410 Expired)",
        RESTART_DOWNTIME.as_secs()
    );
    if let Err(err) = server
        .restart_after(crate::embedded::RestartState::FreshWatchCache, RESTART_DOWNTIME)
        .await
    {
        println!("  [{name}] the API server did not come back: {err}");
        return;
    }
    println!("  [{name}] API server answering again; installing the sample stack there");
    sample_stack::run(name.clone(), server.client().await, shutdown).await;
}

/// Prints each Tenant's `Ready` condition when its reason changes, as its status says it.
async fn print_tenant_states(host: kube::Client, shutdown: CancellationToken) {
    let tenants: Api<Tenant> = Api::all(host);
    let mut events = watcher(tenants, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut told: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let tenant = tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(tenant)) => tenant,
                Some(Err(_)) => continue,
                None => return,
            },
        };
        let name = tenant.metadata.name.clone().unwrap_or_default();
        let status = tenant.status.unwrap_or_default();
        let Some(ready) = status.conditions.iter().find(|c| c.type_ == "Ready") else {
            continue;
        };
        let state = format!("Ready={} {}", ready.status, ready.reason);
        if told.get(&name) != Some(&state) {
            println!("  [{name}] Tenant {name}: {state}: {}", ready.message);
            told.insert(name, state);
        }
    }
}

/// Prints each tenant's host namespace as the daemon creates it.
async fn print_progress(host: kube::Client, shutdown: CancellationToken) {
    let namespaces: Api<Namespace> = Api::all(host);
    let config = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"));
    let mut events = watcher(namespaces, config).default_backoff().applied_objects().boxed();
    let mut seen = std::collections::BTreeSet::new();
    loop {
        let namespace = tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(namespace)) => namespace,
                Some(Err(_)) => continue,
                None => return,
            },
        };
        let name = namespace.metadata.name.clone().unwrap_or_default();
        let tenant = namespace
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(TENANT_LABEL))
            .cloned()
            .unwrap_or_default();
        if seen.insert(name.clone()) {
            println!("  [{tenant}] host namespace {name} ready");
        }
    }
}
