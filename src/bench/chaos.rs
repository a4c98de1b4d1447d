//! Chaos: installs and uninstalls run while the daemon is killed and restarted at random points, API
//! servers restart, watches drop and requests fail with 409/500/429. Afterwards the invariants must
//! hold: every install Ready or clearly failed, every uninstall finished, no host object without a
//! live tenant parent, no CDC leased twice.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::{ApiResource, DynamicObject};
use kube::{Client, ResourceExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::BenchError;
use super::fleet::Fleet;
use crate::api::stacks::StackInstall;
use crate::embedded::RestartState;
use crate::embedded::faults::RequestMatch;
use crate::host::labels::{
    PARENT_KIND_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
    TENANT_UID_ANNOTATION,
};

#[derive(Clone, Debug)]
pub struct ChaosOptions {
    pub seed: u64,
    pub tenants: usize,
    pub installs_per_tenant: usize,
    /// How long the faults go on.
    pub duration: Duration,
    /// Keep every daemon's log here (`--keep-logs`).
    pub keep_logs: Option<PathBuf>,
}

impl ChaosOptions {
    pub fn new(seed: u64, quick: bool) -> ChaosOptions {
        ChaosOptions {
            seed,
            tenants: if quick { 2 } else { 4 },
            installs_per_tenant: if quick { 3 } else { 8 },
            duration: Duration::from_secs(if quick { 8 } else { 60 }),
            keep_logs: None,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChaosReport {
    pub seed: u64,
    /// How often each fault was injected.
    pub faults: BTreeMap<String, u64>,
    pub installs: usize,
    pub ready: usize,
    pub clearly_failed: usize,
    /// Installs neither Ready nor clearly failed at the end.
    pub stuck: Vec<String>,
    pub uninstalls: usize,
    /// Uninstalled installs still present at the end.
    pub uninstalls_unfinished: Vec<String>,
    /// Host objects with a parent label whose tenant parent is gone.
    pub orphans: Vec<String>,
    pub double_leases: u64,
    /// Whether the pool that filled during the faults ended full.
    pub pool_filled: bool,
    /// Observations of one bare-metal asset backing two live clusters; must be 0.
    pub double_assignments: u64,
    /// Whether the baremetal pool ended full.
    pub metal_pool_filled: bool,
    /// Seconds from the end of the faults until everything settled (or the deadline).
    pub converge_s: f64,
    /// When something did not settle: the status of each unsettled object (pools, their
    /// ClusterDeployments, the host Jobs of their tenant).
    pub unsettled: Vec<String>,
    pub passed: bool,
}

pub async fn run(options: &ChaosOptions) -> Result<ChaosReport, BenchError> {
    let mut rng = StdRng::seed_from_u64(options.seed);
    let mut fleet = Fleet::start(options.tenants).await?;
    if let Some(dir) = &options.keep_logs {
        fleet.keep_logs(dir)?;
    }
    // A daemon killed between leasing a customization and creating its cluster leaves a lease whose
    // cluster never appears; it is released after --lease-min-age (DESIGN.md §4.3.2). The default
    // 5 min outlasts the settle window, so chaos uses the 10 s `stackd dev` uses: the repair runs
    // inside the window and the double-lease invariant checks it.
    let daemon_args = ["--sweep-interval", "2s", "--lease-min-age", "10s"];
    let mut daemon = Some(fleet.daemon(&daemon_args)?);
    let mut report = ChaosReport {
        seed: options.seed,
        ..ChaosReport::default()
    };
    let mut pending: Vec<(usize, String)> = Vec::new();
    for tenant in 0..fleet.tenants.len() {
        for index in 0..options.installs_per_tenant {
            pending.push((tenant, format!("team-{index}")));
        }
    }
    report.installs = pending.len();
    // A pool fills in the first tenant while everything else goes on.
    const POOL_SIZE: usize = 3;
    let pool_tenant = fleet.tenants[0].1.client().await;
    crate::pools::sample::install_pool(
        &pool_tenant,
        "chaos-pool",
        "pool",
        POOL_SIZE as i32,
        &["c0", "c1", "c2"],
    )
    .await?;
    let cluster_deployments: Api<crate::api::pools::ClusterDeployment> = Api::all(pool_tenant.clone());
    // ... and a baremetal pool draws hosts from assets in the last tenant.
    let metal_tenant = fleet.tenants[fleet.tenants.len() - 1].1.client().await;
    super::metal::install(&metal_tenant).await?;
    let mut created: Vec<(usize, String)> = Vec::new();
    let mut uninstalled: BTreeSet<(usize, String)> = BTreeSet::new();
    let faults_end = Instant::now() + options.duration;
    while Instant::now() < faults_end {
        // Keep installs flowing in while things break.
        for _ in 0..rng.random_range(1..=3) {
            if let Some((tenant, namespace)) = pending.pop() {
                let client = fleet.tenants[tenant].1.client().await;
                if create_install(&client, &namespace).await.is_ok() {
                    created.push((tenant, namespace));
                } else {
                    pending.push((tenant, namespace));
                }
            }
        }
        let fault = match rng.random_range(0..6) {
            0 => {
                // Kill the daemon mid-flight and start another.
                if let Some(old) = daemon.take() {
                    old.kill().await;
                }
                daemon = Some(fleet.daemon(&daemon_args)?);
                "daemon_restart"
            }
            1 => {
                // As kube-apiserver restarts: refused connections for a while, then a fresh watch
                // cache that answers resumed watches with 410.
                let tenant = rng.random_range(0..fleet.tenants.len());
                let downtime = Duration::from_millis(rng.random_range(0..2000));
                fleet.tenants[tenant]
                    .1
                    .restart_after(RestartState::FreshWatchCache, downtime)
                    .await?;
                "tenant_server_restart"
            }
            2 => {
                fleet.host.faults().drop_watches();
                for (_, server) in &fleet.tenants {
                    server.faults().drop_watches();
                }
                "watches_dropped"
            }
            3 => {
                // Uninstall one of the installs created so far.
                if let Some(at) = (!created.is_empty()).then(|| rng.random_range(0..created.len())) {
                    let (tenant, namespace) = created.remove(at);
                    let client = fleet.tenants[tenant].1.client().await;
                    let api: Api<StackInstall> = Api::namespaced(client, &namespace);
                    if api.delete("sample", &DeleteParams::default()).await.is_ok() {
                        uninstalled.insert((tenant, namespace));
                    } else {
                        created.push((tenant, namespace));
                    }
                }
                "uninstall"
            }
            _ => {
                let code = [409, 500, 429][rng.random_range(0..3)];
                let count = rng.random_range(1..=5);
                let server = rng.random_range(0..=fleet.tenants.len());
                let faults = if server == 0 {
                    fleet.host.faults()
                } else {
                    fleet.tenants[server - 1].1.faults()
                };
                faults.fail_next(count, RequestMatch::any(), code);
                match code {
                    409 => "injected_409",
                    500 => "injected_500",
                    _ => "injected_429",
                }
            }
        };
        *report.faults.entry(fault.to_string()).or_default() += 1;
        // The timeline, to read beside the daemons' logs (`--keep-logs`) when an invariant fails.
        eprintln!(
            "chaos: +{:.1}s {fault}",
            options.duration.as_secs_f64() - faults_end.saturating_duration_since(Instant::now()).as_secs_f64()
        );
        if let Ok(doubles) = super::pools::count_double_leases(&cluster_deployments).await {
            report.double_leases += doubles;
        }
        if let Ok(doubles) = super::metal::double_assignments(&metal_tenant).await {
            report.double_assignments += doubles;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1200))).await;
    }
    // Calm: no more faults; the remaining installs go in, and everything must settle.
    fleet.host.faults().clear();
    for (_, server) in &fleet.tenants {
        server.faults().clear();
    }
    for (tenant, namespace) in pending.drain(..) {
        let client = fleet.tenants[tenant].1.client().await;
        create_install(&client, &namespace).await?;
        created.push((tenant, namespace));
    }
    report.uninstalls = uninstalled.len();
    let calm = Instant::now();
    let deadline = calm + Duration::from_secs(90);
    let pools: Api<crate::api::pools::ClusterPool> = Api::namespaced(pool_tenant.clone(), "chaos-pool");
    loop {
        check(&fleet, &created, &uninstalled, &mut report).await;
        if let Ok(doubles) = super::pools::count_double_leases(&cluster_deployments).await {
            report.double_leases += doubles;
        }
        if let Ok(doubles) = super::metal::double_assignments(&metal_tenant).await {
            report.double_assignments += doubles;
        }
        report.metal_pool_filled = super::metal::filled(&metal_tenant).await;
        report.pool_filled = pools
            .get_opt("pool")
            .await
            .ok()
            .flatten()
            .and_then(|p| p.status)
            .is_some_and(|s| s.ready as usize >= POOL_SIZE);
        let settled = report.stuck.is_empty()
            && report.uninstalls_unfinished.is_empty()
            && report.orphans.is_empty()
            && report.pool_filled
            && report.metal_pool_filled;
        if settled || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    report.converge_s = calm.elapsed().as_secs_f64();
    report.passed = report.stuck.is_empty()
        && report.uninstalls_unfinished.is_empty()
        && report.orphans.is_empty()
        && report.double_leases == 0
        && report.double_assignments == 0
        && report.pool_filled
        && report.metal_pool_filled;
    if !report.pool_filled {
        let host = fleet.host.client().await;
        let (tenant, _) = &fleet.tenants[0];
        report
            .unsettled
            .extend(describe_pool(&pool_tenant, &host, tenant, "chaos-pool", "pool").await);
    }
    if !report.metal_pool_filled {
        let host = fleet.host.client().await;
        let (tenant, _) = &fleet.tenants[fleet.tenants.len() - 1];
        let (namespace, pool) = (super::metal::NAMESPACE, super::metal::POOL);
        report
            .unsettled
            .extend(describe_pool(&metal_tenant, &host, tenant, namespace, pool).await);
    }
    if !report.passed
        && let Some(daemon) = &daemon
    {
        eprintln!("chaos: invariants failed; the daemon's log is {}", daemon.log.display());
        for line in &report.unsettled {
            eprintln!("  {line}");
        }
        // The log lives in the fleet's temp dir, which goes with the fleet: show its end now.
        if let Ok(text) = std::fs::read_to_string(&daemon.log) {
            eprintln!(
                "{}",
                text.lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    if let Some(daemon) = daemon {
        daemon.kill().await;
    }
    fleet.shutdown().await;
    Ok(report)
}

async fn create_install(client: &Client, namespace: &str) -> Result<(), kube::Error> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("a valid Namespace");
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(err) => return Err(err),
    }
    let install: StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "sample", "namespace": namespace},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    }))
    .expect("a valid StackInstall");
    let installs = Api::<StackInstall>::namespaced(client.clone(), namespace);
    match installs.create(&PostParams::default(), &install).await {
        Ok(_) => Ok(()),
        // An injected 409 is no AlreadyExists: count the install only if it is really there.
        Err(kube::Error::Api(status)) if status.code == 409 => match installs.get_opt("sample").await? {
            Some(_) => Ok(()),
            None => Err(kube::Error::Api(status)),
        },
        Err(err) => Err(err),
    }
}

/// Fills the invariant fields of `report` from what the servers hold now.
async fn check(
    fleet: &Fleet,
    created: &[(usize, String)],
    uninstalled: &BTreeSet<(usize, String)>,
    report: &mut ChaosReport,
) {
    report.ready = 0;
    report.clearly_failed = 0;
    report.stuck.clear();
    report.uninstalls_unfinished.clear();
    report.orphans.clear();
    for (tenant, namespace) in created {
        let (name, server) = &fleet.tenants[*tenant];
        let api: Api<StackInstall> = Api::namespaced(server.client().await, namespace);
        let ready = match api.get_opt("sample").await {
            Ok(Some(install)) => install
                .status
                .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready")),
            Ok(None) => {
                report
                    .stuck
                    .push(format!("{name}/{namespace}: the StackInstall does not exist"));
                continue;
            }
            Err(_) => None,
        };
        match ready {
            Some(c) if c.status == "True" => report.ready += 1,
            Some(c) if crate::stacks::install::FAILURE_REASONS.contains(&c.reason.as_str()) => {
                report.clearly_failed += 1
            }
            other => report.stuck.push(format!(
                "{name}/{namespace}: {}",
                other.map_or("no Ready condition".to_string(), |c| format!(
                    "{}: {}",
                    c.reason, c.message
                ))
            )),
        }
    }
    for (tenant, namespace) in uninstalled {
        let (name, server) = &fleet.tenants[*tenant];
        let api: Api<StackInstall> = Api::namespaced(server.client().await, namespace);
        if !matches!(api.get_opt("sample").await, Ok(None)) {
            report.uninstalls_unfinished.push(format!("{name}/{namespace}"));
        }
    }
    report.orphans = orphans(fleet).await;
}

/// Host objects with a parent label whose tenant parent (same kind, namespace, name and uid) is gone.
async fn orphans(fleet: &Fleet) -> Vec<String> {
    let host = fleet.host.client().await;
    let mut found = Vec::new();
    for (tenant, server) in &fleet.tenants {
        let namespace = format!("tenant-{tenant}-controllers");
        let params = ListParams::default().labels(PARENT_KIND_LABEL);
        let mut objects: Vec<(String, std::collections::BTreeMap<String, String>)> = Vec::new();
        for kind in host_kinds() {
            let api: Api<DynamicObject> = Api::namespaced_with(host.clone(), &namespace, &kind);
            if let Ok(list) = api.list_metadata(&params).await {
                objects.extend(
                    list.items
                        .into_iter()
                        .map(|o| (format!("{} {}", kind.kind, o.name_any()), o.annotations().clone())),
                );
            }
        }
        let client = server.client().await;
        for (what, annotations) in objects {
            let (Some(kind), Some(ns), Some(name), Some(uid)) = (
                annotations.get(TENANT_KIND_ANNOTATION),
                annotations.get(TENANT_NAMESPACE_ANNOTATION),
                annotations.get(TENANT_NAME_ANNOTATION),
                annotations.get(TENANT_UID_ANNOTATION),
            ) else {
                found.push(format!("{tenant}: {what} has no parent identity"));
                continue;
            };
            let Some(resource) = parent_resource(kind) else {
                found.push(format!("{tenant}: {what} names an unknown parent kind {kind}"));
                continue;
            };
            let api: Api<DynamicObject> = if ns.is_empty() {
                Api::all_with(client.clone(), &resource)
            } else {
                Api::namespaced_with(client.clone(), ns, &resource)
            };
            match api.get_opt(name).await {
                Ok(Some(parent)) if parent.uid().as_deref() == Some(uid.as_str()) => {}
                Ok(_) => found.push(format!("{tenant}: {what} (parent {kind} {ns}/{name} is gone)")),
                Err(_) => {}
            }
        }
    }
    found
}

/// What a pool that did not fill looks like: its status and conditions, each of its
/// ClusterDeployments with theirs, and the host Jobs of its tenant.
async fn describe_pool(
    tenant_client: &Client,
    host: &Client,
    tenant: &str,
    namespace: &str,
    name: &str,
) -> Vec<String> {
    use crate::api::pools::{ClusterDeployment, ClusterPool};
    let mut lines = Vec::new();
    match Api::<ClusterPool>::namespaced(tenant_client.clone(), namespace)
        .get_opt(name)
        .await
    {
        Ok(Some(pool)) => {
            let status = pool.status.unwrap_or_default();
            // Which entry backs which cluster: a lease whose cluster never appeared holds its entry
            // for --lease-min-age.
            let inventory: Vec<String> = status
                .inventory
                .iter()
                .map(|e| {
                    format!(
                        "{}={:?}({})",
                        e.name,
                        e.status,
                        e.cluster_deployment.as_deref().unwrap_or("-")
                    )
                })
                .collect();
            lines.push(format!(
                "{tenant}: ClusterPool {namespace}/{name}: size {}, ready {}, standby {}; inventory [{}]; {}",
                pool.spec.size,
                status.ready,
                status.standby,
                inventory.join(", "),
                conditions_text(&status.conditions)
            ));
        }
        Ok(None) => lines.push(format!("{tenant}: ClusterPool {namespace}/{name} is gone")),
        Err(err) => lines.push(format!(
            "{tenant}: ClusterPool {namespace}/{name}: cannot read it: {err}"
        )),
    }
    if let Ok(cds) = Api::<ClusterDeployment>::all(tenant_client.clone())
        .list(&ListParams::default())
        .await
    {
        for cd in cds.items {
            let status = cd.status.clone().unwrap_or_default();
            lines.push(format!(
                "{tenant}: ClusterDeployment {}/{}{}: installed {}, install restarts {}; {}",
                cd.namespace().unwrap_or_default(),
                cd.name_any(),
                if cd.metadata.deletion_timestamp.is_some() {
                    " (deleting)"
                } else {
                    ""
                },
                status.installed,
                status.install_restarts,
                conditions_text(&status.conditions)
            ));
        }
    }
    let jobs: Api<Job> = Api::namespaced(host.clone(), &format!("tenant-{tenant}-controllers"));
    if let Ok(list) = jobs.list(&ListParams::default()).await {
        for job in list.items {
            let status = job.status.clone().unwrap_or_default();
            let conditions: Vec<String> = status
                .conditions
                .iter()
                .flatten()
                .map(|c| format!("{}={}", c.type_, c.status))
                .collect();
            lines.push(format!(
                "{tenant}: host Job {}: active {}, succeeded {}, failed {}, conditions [{}]",
                job.name_any(),
                status.active.unwrap_or(0),
                status.succeeded.unwrap_or(0),
                status.failed.unwrap_or(0),
                conditions.join(", ")
            ));
        }
    }
    lines
}

fn conditions_text(conditions: &[crate::api::common::Condition]) -> String {
    let parts: Vec<String> = conditions
        .iter()
        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
        .collect();
    format!("conditions [{}]", parts.join("; "))
}

/// Every host kind stackd creates for tenant objects.
fn host_kinds() -> Vec<ApiResource> {
    use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    vec![
        ApiResource::erase::<Job>(&()),
        ApiResource::erase::<Secret>(&()),
        ApiResource::erase::<Deployment>(&()),
        ApiResource::erase::<ServiceAccount>(&()),
        ApiResource::erase::<Role>(&()),
        ApiResource::erase::<RoleBinding>(&()),
        ApiResource::erase::<ConfigMap>(&()),
    ]
}

/// The tenant kind a host object's parent annotation names.
fn parent_resource(kind: &str) -> Option<ApiResource> {
    use crate::api::inventory::BareMetalAsset;
    use crate::api::pools::{ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};
    use crate::api::stacks::{ClusterStackInstall, Stack};
    Some(match kind {
        "StackInstall" => ApiResource::erase::<StackInstall>(&()),
        "ClusterStackInstall" => ApiResource::erase::<ClusterStackInstall>(&()),
        "Stack" => ApiResource::erase::<Stack>(&()),
        "ClusterPool" => ApiResource::erase::<ClusterPool>(&()),
        "ClusterDeployment" => ApiResource::erase::<ClusterDeployment>(&()),
        "ClusterClaim" => ApiResource::erase::<ClusterClaim>(&()),
        "ClusterDeploymentCustomization" => ApiResource::erase::<ClusterDeploymentCustomization>(&()),
        "BareMetalAsset" => ApiResource::erase::<BareMetalAsset>(&()),
        _ => return None,
    })
}

/// The human-readable summary of a chaos run.
pub fn table(report: &ChaosReport) -> String {
    let faults: Vec<String> = report.faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let mut out = format!(
        "chaos (seed {}): {}\nfaults: {}\ninstalls {}: {} Ready, {} clearly failed, {} stuck; uninstalls {}: {} unfinished\npools filled: {} (vSphere), {} (baremetal); orphaned host objects: {}; double leases: {}; assets assigned twice: {}; settled in {:.1} s\n",
        report.seed,
        if report.passed { "PASSED" } else { "FAILED" },
        faults.join(", "),
        report.installs,
        report.ready,
        report.clearly_failed,
        report.stuck.len(),
        report.uninstalls,
        report.uninstalls_unfinished.len(),
        report.pool_filled,
        report.metal_pool_filled,
        report.orphans.len(),
        report.double_leases,
        report.double_assignments,
        report.converge_s,
    );
    for line in report
        .stuck
        .iter()
        .chain(&report.uninstalls_unfinished)
        .chain(&report.orphans)
        .chain(&report.unsettled)
    {
        out.push_str(&format!("  {line}\n"));
    }
    out
}
