//! Chaos: installs and uninstalls run while two leader-elected daemons are killed, restarted and cut
//! off from the host at random points, API servers (the host's too) restart, watches drop and requests fail with
//! 409/500/429. Every fault comes once (those that kill or cut the leader first, the rest in a seeded
//! order), then at random. Those that drive issue 17's races:
//! - a daemon restarted right before a ClusterDeployment is deleted (the leader is killed and an
//!   installed pool cluster deleted the moment the standby takes over, before its caches can have
//!   filled);
//! - the leader partitioned from the host while its tenants still answer;
//! - bursts of new StackInstalls, created while sweeps run (every 2 s);
//! - two installs of the sample stack, which share its CRD, uninstalled at once while others stay.
//!
//! Checked during the faults and after: no cluster's ClusterDeployment gone without its destroy
//! Job having run (`destroys`), no tenant served by two daemons at once (`daemons`), no host
//! object of a live parent swept (`sweeps`), no shared CRD (or its custom resources) deleted while
//! an install of it lives (`crds`), no install Job made twice for one package (`install_jobs`), no
//! CDC leased twice, no asset assigned twice. Afterwards:
//! every install Ready or clearly failed, every uninstall and cluster deletion finished, no host
//! object without a live tenant parent, both pools full.

mod crds;
mod daemons;
mod destroys;
mod install_jobs;
mod sweeps;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::{ApiResource, DynamicObject};
use kube::{Client, ResourceExt};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::task::JoinHandle;

use super::BenchError;
use super::fleet::Fleet;
use crate::api::pools::ClusterDeployment;
use crate::api::stacks::StackInstall;
use crate::embedded::RestartState;
use crate::embedded::faults::RequestMatch;
use crate::host::labels::{
    PARENT_KIND_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
    TENANT_UID_ANNOTATION,
};
use crate::runtime::api_errors::is_conflict;
use crds::SharedCrdWatch;
use daemons::LeaderElected;
use destroys::InstallerLedger;
use install_jobs::InstallJobLedger;
use sweeps::SweepAudit;

#[derive(Clone, Debug)]
pub struct ChaosOptions {
    pub seed: u64,
    pub tenants: usize,
    pub installs_per_tenant: usize,
    /// How long the faults go on.
    pub duration: Duration,
    /// Keep every daemon's log here (`--keep-logs`).
    pub keep_logs: Option<PathBuf>,
    /// The daemons' leader lease (`--leader-elect-lease-duration`), in seconds: short, so that
    /// takeovers fit the run; long enough that a loaded leader still renews it (a renewal has
    /// half of it to be stored, see `runtime::leader`).
    pub lease_seconds: u64,
}

impl ChaosOptions {
    pub fn new(seed: u64, quick: bool) -> ChaosOptions {
        ChaosOptions {
            seed,
            tenants: if quick { 2 } else { 4 },
            installs_per_tenant: if quick { 3 } else { 8 },
            duration: Duration::from_secs(if quick { 8 } else { 60 }),
            keep_logs: None,
            lease_seconds: if quick { 3 } else { 10 },
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
    /// ClusterDeployments deleted by the chaos, still there at the end.
    pub cluster_deletions_unfinished: Vec<String>,
    /// ClusterDeployments gone although the cluster their installer created was never destroyed.
    pub clusters_gone_without_destroy: Vec<String>,
    /// Tenants two daemons sent requests to at the same time.
    pub tenants_served_twice: Vec<String>,
    /// Host objects the orphan sweep deleted while their tenant parent existed.
    pub live_objects_swept: Vec<String>,
    /// The sample stack's shared CRD, or a custom resource of it, deleted while an install of it lived.
    pub shared_crds_deleted: Vec<String>,
    /// Install Jobs made more than once for one package (a host that did not answer taken for a
    /// broken package).
    #[serde(default)]
    pub install_jobs_made_twice: Vec<String>,
    /// Seconds from the end of the faults until everything settled (or the deadline).
    pub converge_s: f64,
    /// When something did not settle: the status of each unsettled object (pools, their
    /// ClusterDeployments, the host Jobs of their tenant).
    pub unsettled: Vec<String>,
    pub passed: bool,
}

impl ChaosReport {
    /// No invariant broken so far (settling aside).
    fn invariants_hold(&self) -> bool {
        self.double_leases == 0
            && self.double_assignments == 0
            && self.clusters_gone_without_destroy.is_empty()
            && self.tenants_served_twice.is_empty()
            && self.live_objects_swept.is_empty()
            && self.shared_crds_deleted.is_empty()
            && self.install_jobs_made_twice.is_empty()
    }

    fn settled(&self) -> bool {
        self.stuck.is_empty()
            && self.uninstalls_unfinished.is_empty()
            && self.cluster_deletions_unfinished.is_empty()
            && self.orphans.is_empty()
            && self.pool_filled
            && self.metal_pool_filled
    }
}

/// StackInstalls created at once by a burst.
const BURST: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    DaemonRestart,
    ClusterDeletedAfterRestart,
    LeaderPartitioned,
    TenantServerRestart,
    HostRestart,
    WatchesDropped,
    Uninstall,
    ConcurrentUninstalls,
    ParentsBurst,
    InjectedError,
}

/// How long the calm waits for everything to settle.
const CALM_LIMIT: Duration = Duration::from_secs(90);

/// How long past the faults' duration the first round may take to inject every fault once.
const FIRST_ROUND_GRACE: Duration = CALM_LIMIT;

/// Each fault once (in a seeded order), then these at random.
const EVERY_FAULT: [Fault; 10] = [
    Fault::DaemonRestart,
    Fault::ClusterDeletedAfterRestart,
    Fault::LeaderPartitioned,
    Fault::TenantServerRestart,
    Fault::HostRestart,
    Fault::WatchesDropped,
    Fault::Uninstall,
    Fault::ConcurrentUninstalls,
    Fault::ParentsBurst,
    Fault::InjectedError,
];

/// One client per server, made once: each new client builds its TLS setup and opens new connections.
struct Clients {
    host: Client,
    /// By tenant index, with the tenant's name.
    tenants: Vec<(String, Client)>,
}

impl Clients {
    async fn of(fleet: &Fleet) -> Clients {
        let mut tenants = Vec::new();
        for (name, server) in &fleet.tenants {
            tenants.push((name.clone(), server.client().await));
        }
        Clients {
            host: fleet.host.client().await,
            tenants,
        }
    }

    fn tenant(&self, index: usize) -> &Client {
        &self.tenants[index].1
    }

    fn named(&self, name: &str) -> Option<&Client> {
        self.tenants.iter().find(|(n, _)| n == name).map(|(_, c)| c)
    }
}

/// A ClusterDeployment the chaos deleted: tenant index, namespace, name, uid.
type DeletedCluster = (usize, String, String, String);

/// Everything a run holds besides the report.
struct Chaos {
    fleet: Fleet,
    clients: Clients,
    daemons: LeaderElected,
    rng: StdRng,
    pending: Vec<(usize, String)>,
    created: Vec<(usize, String)>,
    uninstalled: BTreeSet<(usize, String)>,
    bursts: usize,
    deletions: Vec<JoinHandle<Option<DeletedCluster>>>,
    deleted_clusters: Vec<DeletedCluster>,
    ledger: InstallerLedger,
    install_jobs: InstallJobLedger,
    sweeps: SweepAudit,
    crds: SharedCrdWatch,
    started: Instant,
    /// How long a cluster deletion waits for a standby to take over.
    takeover_within: Duration,
}

pub async fn run(options: &ChaosOptions) -> Result<ChaosReport, BenchError> {
    let mut fleet = Fleet::start(options.tenants).await?;
    if let Some(dir) = &options.keep_logs {
        fleet.keep_logs(dir)?;
    }
    let ledger = InstallerLedger::install(&fleet.host)
        .ok_or_else(|| BenchError::Io(std::io::Error::other("the host has no installer runner to record")))?;
    let install_jobs = InstallJobLedger::install(&fleet.host)
        .ok_or_else(|| BenchError::Io(std::io::Error::other("the host has no unpack runner to record")))?;
    // A daemon killed between leasing a customization and creating its cluster leaves a lease whose
    // cluster never appears; it is released after --lease-min-age (DESIGN.md §4.3.2). The default
    // 5 min outlasts the settle window, so chaos uses the 10 s `stackd dev` uses: the repair runs
    // inside the window and the double-lease invariant checks it.
    let daemon_args = ["--sweep-interval", "2s", "--lease-min-age", "10s"];
    let clients = Clients::of(&fleet).await;
    let daemons = LeaderElected::start(&fleet, &clients.host, &daemon_args, options.lease_seconds).await?;
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
    crate::pools::sample::install_pool(
        clients.tenant(0),
        "chaos-pool",
        "pool",
        POOL_SIZE as i32,
        &["c0", "c1", "c2"],
    )
    .await?;
    // ... and a baremetal pool draws hosts from assets in the last tenant.
    super::metal::install(clients.tenant(fleet.tenants.len() - 1)).await?;
    let mut chaos = Chaos {
        fleet,
        clients,
        daemons,
        rng: StdRng::seed_from_u64(options.seed),
        pending,
        created: Vec::new(),
        uninstalled: BTreeSet::new(),
        bursts: 0,
        deletions: Vec::new(),
        deleted_clusters: Vec::new(),
        ledger,
        install_jobs,
        sweeps: SweepAudit::default(),
        crds: SharedCrdWatch::default(),
        started: Instant::now(),
        takeover_within: Duration::from_secs(3 * options.lease_seconds + 2),
    };
    let result = chaos.faults_then_calm(options, &mut report).await;
    chaos.daemons.shutdown().await;
    chaos.fleet.shutdown().await;
    result.map(|_| report)
}

/// Clusters in the vSphere pool.
const POOL_SIZE: usize = 3;

impl Chaos {
    fn pool_tenant(&self) -> &Client {
        self.clients.tenant(0)
    }

    fn metal_index(&self) -> usize {
        self.clients.tenants.len() - 1
    }

    fn metal_tenant(&self) -> &Client {
        self.clients.tenant(self.metal_index())
    }

    async fn faults_then_calm(&mut self, options: &ChaosOptions, report: &mut ChaosReport) -> Result<(), BenchError> {
        // The faults that kill or cut the leader go first: each leaves the tenants without a leader
        // until the lease runs out, and that wait overlaps the other faults instead of the calm.
        let mut first_round: VecDeque<Fault> = {
            let needs_leader = |f: &Fault| matches!(f, Fault::LeaderPartitioned | Fault::ClusterDeletedAfterRestart);
            let (mut leader, mut others): (Vec<Fault>, Vec<Fault>) = EVERY_FAULT.iter().partition(|f| needs_leader(f));
            leader.shuffle(&mut self.rng);
            others.shuffle(&mut self.rng);
            leader.into_iter().chain(others).collect()
        };
        // Past the duration only to finish the first round. A fault that needs an installed cluster
        // waits for one: on a loaded machine the first installer finishes well after the faults'
        // duration, and a run that skipped the fault would test less than it says.
        let faults_end = Instant::now() + options.duration;
        let first_round_end = faults_end + FIRST_ROUND_GRACE;
        while Instant::now() < faults_end || (!first_round.is_empty() && Instant::now() < first_round_end) {
            // Keep installs flowing in while things break.
            for _ in 0..self.rng.random_range(1..=3) {
                if let Some((tenant, namespace)) = self.pending.pop() {
                    if create_install(self.clients.tenant(tenant), &namespace).await.is_ok() {
                        self.created.push((tenant, namespace));
                    } else {
                        self.pending.push((tenant, namespace));
                    }
                }
            }
            let fault = match first_round.pop_front() {
                Some(fault) => fault,
                None => EVERY_FAULT[self.rng.random_range(0..EVERY_FAULT.len())],
            };
            match self.inject(fault, report).await? {
                Some(name) => {
                    *report.faults.entry(name.to_string()).or_default() += 1;
                    self.timeline(name);
                }
                // Not possible yet (too few installs, no installed cluster, no leader serving): again
                // after the next.
                None => first_round.insert(first_round.len().min(1), fault),
            }
            self.replace_exited_daemons().await?;
            self.observe(report).await;
            let pause = self.rng.random_range(200..1200);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        self.calm(report).await
    }

    /// The timeline, to read beside the daemons' logs (`--keep-logs`) when an invariant fails.
    fn timeline(&self, what: &str) {
        eprintln!("chaos: +{:.1}s {what}", self.started.elapsed().as_secs_f64());
    }

    async fn replace_exited_daemons(&mut self) -> Result<(), BenchError> {
        for name in self.daemons.replace_exited(&self.fleet).await? {
            self.timeline(&format!("daemon {name} exited; another started"));
        }
        Ok(())
    }

    /// Kills the leader and deletes an installed cluster the moment the standby takes over;
    /// false when there is no installed cluster or leader yet.
    async fn delete_a_cluster_at_the_takeover(&mut self) -> Result<bool, BenchError> {
        let metal = self.rng.random_bool(0.5);
        let pick = self.rng.random_range(0..16);
        let index = if metal { self.metal_index() } else { 0 };
        let tenant = self.clients.tenant(index).clone();
        let Some((namespace, name, uid)) = an_installed_cluster(&tenant, &self.ledger, pick).await else {
            return Ok(false);
        };
        let host = self.clients.host.clone();
        let Some(leader) = self.daemons.restart_leader(&self.fleet, &host).await? else {
            return Ok(false);
        };
        self.timeline(&format!(
            "killed leader {leader}; ClusterDeployment {namespace}/{name}, installed, goes at the takeover"
        ));
        let cluster = (index, namespace, name, uid);
        let within = self.takeover_within;
        self.deletions.push(tokio::spawn(delete_after_takeover(
            host, tenant, leader, cluster, within,
        )));
        Ok(true)
    }

    /// Makes the next few requests to one server fail with a 409, 500 or 429.
    fn inject_errors(&mut self) -> &'static str {
        let code = [409, 500, 429][self.rng.random_range(0..3)];
        let count = self.rng.random_range(1..=5);
        let server = self.rng.random_range(0..=self.fleet.tenants.len());
        let faults = if server == 0 {
            self.fleet.host.faults()
        } else {
            self.fleet.tenants[server - 1].1.faults()
        };
        faults.fail_next(count, RequestMatch::any(), code);
        match code {
            409 => "injected_409",
            500 => "injected_500",
            _ => "injected_429",
        }
    }

    /// Injects one fault: its name, or `None` when it cannot be injected yet.
    async fn inject(&mut self, fault: Fault, report: &mut ChaosReport) -> Result<Option<&'static str>, BenchError> {
        let name = match fault {
            Fault::DaemonRestart => {
                // Kill a daemon mid-flight (the leader or the standby) and start another.
                let pick = self.rng.random_range(0..2);
                let name = self.daemons.restart(&self.fleet, pick).await?;
                self.timeline(&format!("killed daemon {name}"));
                "daemon_restart"
            }
            Fault::ClusterDeletedAfterRestart => {
                if !self.delete_a_cluster_at_the_takeover().await? {
                    return Ok(None);
                }
                "daemon_restart_then_cluster_deleted"
            }
            Fault::LeaderPartitioned => {
                let Some(name) = self.daemons.partition_leader(&self.clients.host).await else {
                    return Ok(None);
                };
                self.timeline(&format!("cut daemon {name} off from the host"));
                "leader_partitioned"
            }
            Fault::TenantServerRestart => {
                // As kube-apiserver restarts: refused connections for a while, then a fresh watch
                // cache that answers resumed watches with 410.
                let tenant = self.rng.random_range(0..self.fleet.tenants.len());
                let downtime = Duration::from_millis(self.rng.random_range(0..2000));
                self.fleet.tenants[tenant]
                    .1
                    .restart_after(RestartState::FreshWatchCache, downtime)
                    .await?;
                "tenant_server_restart"
            }
            Fault::HostRestart => {
                // A control-plane restart: the API away for a while, back with a fresh watch cache,
                // the node's kubelet (install pods' logs) a moment after it.
                let downtime = Duration::from_millis(self.rng.random_range(0..2000));
                let kubelet_lag = Duration::from_millis(self.rng.random_range(0..2000));
                self.fleet.host.restart_host(downtime, kubelet_lag).await?;
                "host_restart"
            }
            Fault::WatchesDropped => {
                self.fleet.host.faults().drop_watches();
                for (_, server) in &self.fleet.tenants {
                    server.faults().drop_watches();
                }
                "watches_dropped"
            }
            Fault::Uninstall => {
                if self.created.is_empty() {
                    return Ok(None);
                }
                let at = self.rng.random_range(0..self.created.len());
                let install = self.created.remove(at);
                self.uninstall(vec![install]).await;
                "uninstall"
            }
            Fault::ConcurrentUninstalls => {
                if !self.uninstall_two_of_a_tenant().await {
                    return Ok(None);
                }
                "concurrent_uninstalls"
            }
            Fault::ParentsBurst => {
                self.burst(report).await;
                "parents_burst"
            }
            Fault::InjectedError => self.inject_errors(),
        };
        Ok(Some(name))
    }

    /// Deletes the installs at once; those whose delete failed stay installed.
    async fn uninstall(&mut self, installs: Vec<(usize, String)>) {
        let mut deletes = Vec::new();
        for (tenant, namespace) in &installs {
            let api: Api<StackInstall> = Api::namespaced(self.clients.tenant(*tenant).clone(), namespace);
            deletes.push(async move { api.delete("sample", &DeleteParams::default()).await.is_ok() });
        }
        let outcomes = futures::future::join_all(deletes).await;
        for (install, deleted) in installs.into_iter().zip(outcomes) {
            if deleted {
                self.uninstalled.insert(install);
            } else {
                self.created.push(install);
            }
        }
    }

    /// Two installs of one tenant uninstalled at once while at least one other stays: whether a
    /// tenant had enough.
    async fn uninstall_two_of_a_tenant(&mut self) -> bool {
        let tenants: BTreeSet<usize> = self.created.iter().map(|(t, _)| *t).collect();
        let crowded: Vec<usize> = tenants
            .into_iter()
            .filter(|t| self.created.iter().filter(|(c, _)| c == t).count() >= 3)
            .collect();
        let Some(&tenant) = crowded.get(self.rng.random_range(0..crowded.len().max(1))) else {
            return false;
        };
        let mut picked = Vec::new();
        for _ in 0..2 {
            let of_tenant: Vec<usize> = (0..self.created.len())
                .filter(|at| self.created[*at].0 == tenant)
                .collect();
            let at = of_tenant[self.rng.random_range(0..of_tenant.len())];
            picked.push(self.created.remove(at));
        }
        self.uninstall(picked).await;
        true
    }

    /// New StackInstalls in new namespaces of one tenant, all at once, so that some of their host
    /// objects appear while a sweep runs.
    async fn burst(&mut self, report: &mut ChaosReport) {
        let tenant = self.rng.random_range(0..self.fleet.tenants.len());
        let client = self.clients.tenant(tenant).clone();
        let namespaces: Vec<String> = (0..BURST)
            .map(|_| {
                self.bursts += 1;
                format!("burst-{}", self.bursts)
            })
            .collect();
        let outcomes = futures::future::join_all(namespaces.iter().map(|ns| create_install(&client, ns))).await;
        report.installs += BURST;
        for (namespace, outcome) in namespaces.into_iter().zip(outcomes) {
            match outcome {
                Ok(()) => self.created.push((tenant, namespace)),
                Err(_) => self.pending.push((tenant, namespace)),
            }
        }
    }

    /// The invariants checked during the faults and after them.
    async fn observe(&mut self, report: &mut ChaosReport) {
        let cluster_deployments: Api<ClusterDeployment> = Api::all(self.pool_tenant().clone());
        if let Ok(doubles) = super::pools::count_double_leases(&cluster_deployments).await {
            report.double_leases += doubles;
        }
        if let Ok(doubles) = super::metal::double_assignments(self.metal_tenant()).await {
            report.double_assignments += doubles;
        }
        report
            .clusters_gone_without_destroy
            .extend(self.ledger.gone_without_destroy(&self.clients).await);
        report.tenants_served_twice = self.daemons.served_twice();
        let logs = self.daemons.logs().to_vec();
        report
            .live_objects_swept
            .extend(self.sweeps.live_objects_swept(&logs, &self.clients).await);
        report.shared_crds_deleted.extend(self.crds.check(&self.clients).await);
        report.install_jobs_made_twice = self.install_jobs.made_twice();
    }

    /// No more faults: the remaining installs go in, and everything must settle.
    async fn calm(&mut self, report: &mut ChaosReport) -> Result<(), BenchError> {
        self.fleet.host.faults().clear();
        for (_, server) in &self.fleet.tenants {
            server.faults().clear();
        }
        for (tenant, namespace) in std::mem::take(&mut self.pending) {
            create_install(self.clients.tenant(tenant), &namespace).await?;
            self.created.push((tenant, namespace));
        }
        for deletion in std::mem::take(&mut self.deletions) {
            if let Ok(Some(deleted)) = deletion.await {
                self.deleted_clusters.push(deleted);
            }
        }
        report.uninstalls = self.uninstalled.len();
        let calm = Instant::now();
        let deadline = calm + CALM_LIMIT;
        let pools: Api<crate::api::pools::ClusterPool> = Api::namespaced(self.pool_tenant().clone(), "chaos-pool");
        loop {
            self.replace_exited_daemons().await?;
            check(&self.clients, &self.created, &self.uninstalled, report).await;
            self.observe(report).await;
            report.cluster_deletions_unfinished = self.deletions_unfinished().await;
            report.metal_pool_filled = super::metal::filled(self.metal_tenant()).await;
            report.pool_filled = pools
                .get_opt("pool")
                .await
                .ok()
                .flatten()
                .and_then(|p| p.status)
                .is_some_and(|s| s.ready as usize >= POOL_SIZE);
            if report.settled() || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        report.converge_s = calm.elapsed().as_secs_f64();
        report.passed = report.settled() && report.invariants_hold();
        if !report.passed {
            self.explain(report).await;
        }
        Ok(())
    }

    /// ClusterDeployments the chaos deleted that still exist.
    async fn deletions_unfinished(&self) -> Vec<String> {
        let mut unfinished = Vec::new();
        for (tenant, namespace, name, uid) in &self.deleted_clusters {
            let (tenant_name, client) = &self.clients.tenants[*tenant];
            let api: Api<ClusterDeployment> = Api::namespaced(client.clone(), namespace);
            match api.get_opt(name).await {
                Ok(Some(cd)) if cd.uid().as_deref() == Some(uid.as_str()) => {
                    unfinished.push(format!("{tenant_name}: ClusterDeployment {namespace}/{name}"))
                }
                Ok(_) => {}
                Err(err) => unfinished.push(format!("{tenant_name}: ClusterDeployment {namespace}/{name}: {err}")),
            }
        }
        unfinished
    }

    /// What did not settle, and the end of each running daemon's log.
    async fn explain(&self, report: &mut ChaosReport) {
        let host = &self.clients.host;
        if !report.pool_filled {
            let (tenant, client) = &self.clients.tenants[0];
            report
                .unsettled
                .extend(describe_pool(client, host, tenant, "chaos-pool", "pool").await);
        }
        if !report.metal_pool_filled {
            let (tenant, client) = &self.clients.tenants[self.metal_index()];
            let (namespace, pool) = (super::metal::NAMESPACE, super::metal::POOL);
            report
                .unsettled
                .extend(describe_pool(client, host, tenant, namespace, pool).await);
        }
        eprintln!("chaos: invariants failed");
        for line in &report.unsettled {
            eprintln!("  {line}");
        }
        // The logs live in the fleet's temp dir (unless --keep-logs), which goes with the fleet.
        for (name, log) in self.daemons.running_logs() {
            eprintln!("chaos: the end of daemon {name}'s log {}:", log.display());
            if let Ok(text) = std::fs::read_to_string(&log) {
                let lines: Vec<&str> = text.lines().collect();
                eprintln!("{}", lines[lines.len().saturating_sub(30)..].join("\n"));
            }
        }
    }
}

/// A live ClusterDeployment of `tenant` whose installer ran (so its deletion must run the destroy
/// Job), `pick` choosing which: namespace, name, uid.
async fn an_installed_cluster(
    tenant: &Client,
    ledger: &InstallerLedger,
    pick: usize,
) -> Option<(String, String, String)> {
    let clusters = Api::<ClusterDeployment>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .ok()?;
    let installed: Vec<ClusterDeployment> = clusters
        .items
        .into_iter()
        .filter(|cd| cd.metadata.deletion_timestamp.is_none())
        .filter(|cd| cd.uid().is_some_and(|uid| ledger.created(&uid)))
        .collect();
    let cd = installed.get(pick % installed.len().max(1))?;
    Some((cd.namespace()?, cd.name_any(), cd.uid()?))
}

/// Waits until a daemon other than the killed one holds the lease, then at once deletes `cluster`:
/// the new leader's controllers have just started, their caches still filling.
async fn delete_after_takeover(
    host: Client,
    tenant: Client,
    killed: String,
    cluster: DeletedCluster,
    within: Duration,
) -> Option<DeletedCluster> {
    let deadline = Instant::now() + within;
    loop {
        let holder = LeaderElected::holder(&host).await;
        if holder.is_some_and(|h| !h.starts_with(&format!("{killed}-"))) {
            break;
        }
        if Instant::now() > deadline {
            eprintln!("chaos: no daemon took the lease over within {within:?}; no cluster deleted");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, namespace, name, uid) = &cluster;
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(uid.clone()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match Api::<ClusterDeployment>::namespaced(tenant, namespace)
        .delete(name, &params)
        .await
    {
        Ok(_) => {
            eprintln!("chaos: deleted ClusterDeployment {namespace}/{name} right after the takeover");
            Some(cluster)
        }
        Err(err) => {
            eprintln!("chaos: could not delete ClusterDeployment {namespace}/{name} after the takeover: {err}");
            None
        }
    }
}

async fn create_install(client: &Client, namespace: &str) -> Result<(), kube::Error> {
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": namespace}})).map_err(kube::Error::SerdeError)?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => {}
        Err(err) if is_conflict(&err) => {}
        Err(err) => return Err(err),
    }
    let install: StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "sample", "namespace": namespace},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    }))
    .map_err(kube::Error::SerdeError)?;
    let installs = Api::<StackInstall>::namespaced(client.clone(), namespace);
    match installs.create(&PostParams::default(), &install).await {
        Ok(_) => Ok(()),
        // An injected 409 is no AlreadyExists: count the install only if it is really there.
        Err(err) if is_conflict(&err) => match installs.get_opt("sample").await? {
            Some(_) => Ok(()),
            None => Err(err),
        },
        Err(err) => Err(err),
    }
}

/// Fills the invariant fields of `report` from what the servers hold now.
async fn check(
    clients: &Clients,
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
        let (name, client) = &clients.tenants[*tenant];
        let api: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
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
        let (name, client) = &clients.tenants[*tenant];
        let api: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
        if !matches!(api.get_opt("sample").await, Ok(None)) {
            report.uninstalls_unfinished.push(format!("{name}/{namespace}"));
        }
    }
    report.orphans = orphans(clients).await;
}

/// Host objects with a parent label whose tenant parent (same kind, namespace, name and uid) is gone.
async fn orphans(clients: &Clients) -> Vec<String> {
    let host = &clients.host;
    let mut found = Vec::new();
    for (tenant, client) in &clients.tenants {
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
    lines.extend(describe_host_jobs(host, tenant).await);
    lines
}

/// The host Jobs of `tenant` with their counts and conditions.
async fn describe_host_jobs(host: &Client, tenant: &str) -> Vec<String> {
    let mut lines = Vec::new();
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
        "chaos (seed {}): {}\nfaults: {}\ninstalls {}: {} Ready, {} clearly failed, {} stuck; uninstalls {}: {} unfinished; cluster deletions unfinished: {}\npools filled: {} (vSphere), {} (baremetal); orphaned host objects: {}; double leases: {}; assets assigned twice: {}; settled in {:.1} s\nclusters gone without their destroy Job: {}; tenants served by two daemons at once: {}; live objects swept: {}; shared CRDs deleted under a live install: {}; install Jobs made twice: {}\n",
        report.seed,
        if report.passed { "PASSED" } else { "FAILED" },
        faults.join(", "),
        report.installs,
        report.ready,
        report.clearly_failed,
        report.stuck.len(),
        report.uninstalls,
        report.uninstalls_unfinished.len(),
        report.cluster_deletions_unfinished.len(),
        report.pool_filled,
        report.metal_pool_filled,
        report.orphans.len(),
        report.double_leases,
        report.double_assignments,
        report.converge_s,
        report.clusters_gone_without_destroy.len(),
        report.tenants_served_twice.len(),
        report.live_objects_swept.len(),
        report.shared_crds_deleted.len(),
        report.install_jobs_made_twice.len(),
    );
    for line in report
        .stuck
        .iter()
        .chain(&report.uninstalls_unfinished)
        .chain(&report.cluster_deletions_unfinished)
        .chain(&report.orphans)
        .chain(&report.clusters_gone_without_destroy)
        .chain(&report.tenants_served_twice)
        .chain(&report.live_objects_swept)
        .chain(&report.shared_crds_deleted)
        .chain(&report.install_jobs_made_twice)
        .chain(&report.unsettled)
    {
        out.push_str(&format!("  {line}\n"));
    }
    out
}
