//! Blast radius (issues 28 and 45): one daemon serves tenants A and B; B, and a neighbour namespace
//! of A's own, install stacks and fill a pool twice, first with A's attacker idle, then while A's
//! attacker (a user with `edit` in A's other namespaces) runs every attack of issues 28 and 45 at
//! once (and keeps rewriting them). The daemon runs as a pod would: its address space capped,
//! restarted when it exits. Reported: its restarts (goal 0), its peak resident memory against the
//! chart's memory limit (goal at most the limit), the install p50 of B and of A's neighbour
//! namespace under attack against the same with the attacker idle in the same run (goal at most
//! 2× each); and what the daemon refused of each attack.

mod attacks;
mod costs;
mod fixtures;
mod supervisor;
mod victim;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kube::Client;
use kube::api::Api;
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::Fleet;
use crate::api::stacks::StackInstall;
use crate::runtime::conditions::is_true;
use crate::runtime::memory_budget::ByteSize;
pub use attacks::AttackLoad;
pub use costs::{CostFigures, CostLoad};
pub use victim::VictimTimes;

/// The daemon's address space, as in the patch-bomb test: an unbounded allocation aborts it (as a
/// pod's limit would) instead of taking the machine's memory.
const ADDRESS_SPACE: u64 = 3 << 30;
/// The controllers chart's values, whose `resources.limits.memory` the peak is judged against.
const CHART_VALUES: &str = include_str!("../../../charts/stackd-controllers/values.yaml");

/// How large a run is.
#[derive(Clone, Copy, Debug)]
pub struct BlastLoad {
    pub attacks: AttackLoad,
    /// Issue 51's three costs, measured alone before the other attacks.
    pub costs: CostLoad,
    /// B's installs per round.
    pub installs: usize,
    /// B's pool size per round.
    pub pool_size: usize,
    /// How long the attacks may take to be refused before B's round starts anyway.
    pub refusal_wait: Duration,
}

impl BlastLoad {
    /// The figures (30 large CDCs, 200 pull Secrets, 50 parked installs), or a CI size.
    pub fn new(quick: bool) -> BlastLoad {
        let attacks = if quick {
            AttackLoad {
                large_cdcs: 2,
                labelled_secrets: 4,
                pull_secrets: 200,
                parked_installs: 10,
                bmc_assets: 40,
                bmc_password_bytes: 200_000,
                template_pools: 4,
                template_pool_size: 2,
                template_bytes: 300_000,
            }
        } else {
            AttackLoad {
                large_cdcs: 30,
                labelled_secrets: 100,
                pull_secrets: 200,
                parked_installs: 50,
                bmc_assets: 400,
                bmc_password_bytes: 1_000_000,
                template_pools: 8,
                template_pool_size: 10,
                template_bytes: 498_000,
            }
        };
        BlastLoad {
            attacks,
            costs: CostLoad::new(quick),
            installs: if quick { 3 } else { 10 },
            pool_size: if quick { 1 } else { 5 },
            refusal_wait: Duration::from_secs(if quick { 90 } else { 240 }),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BlastRadiusFigures {
    /// Per attack: objects made, and how many of them the daemon refused before B's round.
    pub attacks: BTreeMap<String, (usize, usize)>,
    /// Writes of A's attack objects while B's attacked round ran.
    pub attack_writes_during_round: usize,
    /// Times the daemon exited and was started again (goal 0), and how each ended.
    pub daemon_restarts: usize,
    pub daemon_exits: Vec<String>,
    /// Peak resident memory of the daemon over the whole run (`VmHWM`), in MiB.
    pub daemon_peak_rss_mib: f64,
    /// The chart's `resources.limits.memory`, in MiB.
    pub chart_memory_limit_mib: f64,
    /// `daemon_peak_rss_mib / chart_memory_limit_mib` (goal at most 1).
    pub peak_rss_of_limit: f64,
    /// Whether A ended suspended for its memory budget (B must not be).
    pub tenant_a_suspended: bool,
    pub tenant_b_suspended: bool,
    /// B's round with A idle, and under A's attacks.
    pub idle: VictimTimes,
    pub attacked: VictimTimes,
    /// `attacked.install_p50_s / idle.install_p50_s` (goal at most 2).
    pub install_p50_ratio: f64,
    /// `attacked.pool_fill_s / idle.pool_fill_s`.
    pub pool_fill_ratio: f64,
    /// The same rounds in a namespace of A's that the attacker cannot write: with the attacker idle,
    /// and under its attacks.
    #[serde(default)]
    pub neighbour_idle: VictimTimes,
    #[serde(default)]
    pub neighbour_attacked: VictimTimes,
    /// `neighbour_attacked.install_p50_s / neighbour_idle.install_p50_s` (goal at most 2).
    #[serde(default)]
    pub neighbour_install_p50_ratio: f64,
    #[serde(default)]
    pub neighbour_pool_fill_ratio: f64,
    /// What package CRDs, heavily edited customizations and assets naming a missing Secret cost
    /// (issue 51).
    #[serde(default)]
    pub costs: CostFigures,
}

pub async fn measure(load: &BlastLoad, keep_logs: Option<&std::path::Path>) -> Result<BlastRadiusFigures, BenchError> {
    let mut fleet = Fleet::start(2).await?;
    if let Some(dir) = keep_logs {
        fleet.keep_logs(dir)?;
    }
    fixtures::serve_packages(&fleet.host, &fleet.dir().join("packages"))?;
    fixtures::serve_padding_installer(&fleet.host);
    let attacker = fleet.tenants[0].1.client().await;
    let victim = fleet.tenants[1].1.client().await;
    let (a_name, b_name) = (fleet.tenants[0].0.clone(), fleet.tenants[1].0.clone());
    attacks::prepare(&attacker).await?;
    let daemon = supervisor::Supervised::start(fleet.dir(), fleet.log_dir(), &[], Some(ADDRESS_SPACE))?;
    daemon.wait_tenants_up(2, Duration::from_secs(60)).await?;
    install_ready(&attacker, "team", &daemon).await?;

    eprintln!("bench:   tenant B's round, and A's neighbour namespace's, with A's attacker idle");
    let (idle, neighbour_idle) = tokio::join!(
        victim::run(&victim, "idle", load.installs, load.pool_size),
        victim::run(&attacker, "nb-idle", load.installs, load.pool_size),
    );
    let (idle, neighbour_idle) = (idle?, neighbour_idle?);
    eprintln!("bench:   what tenant A's objects cost over time, each alone");
    let stop = Arc::new(AtomicBool::new(false));
    let (costs, edits) = costs::measure(
        &attacker,
        &fleet.tenants[0].1,
        &a_name,
        &daemon,
        load.costs,
        stop.clone(),
    )
    .await?;
    eprintln!("bench:   tenant A's attacks");
    attacks::launch(&attacker, load.attacks).await?;
    let refused = attacks::wait_refused(&attacker, load.attacks, load.refusal_wait).await?;
    eprintln!("bench:   refused before B's round: {refused:?}");
    eprintln!("bench:   tenant B's round, and A's neighbour namespace's, under attack");
    let churn = tokio::spawn(attacks::churn(attacker.clone(), load.attacks, stop.clone()));
    let (attacked, neighbour_attacked) = tokio::join!(
        victim::run(&victim, "attacked", load.installs, load.pool_size),
        victim::run(&attacker, "nb-attacked", load.installs, load.pool_size),
    );
    stop.store(true, Ordering::SeqCst);
    let attack_writes_during_round = churn.await.map_err(std::io::Error::other)??;
    edits.await.map_err(std::io::Error::other)??;
    let (attacked, neighbour_attacked) = (attacked?, neighbour_attacked?);

    let metrics = daemon.metrics().await;
    let suspended = |tenant: &str| metrics.contains(&format!("stackd_tenant_suspended{{tenant=\"{tenant}\""));
    let (tenant_a_suspended, tenant_b_suspended) = (suspended(&a_name), suspended(&b_name));
    let (daemon_exits, daemon_peak_rss_mib) = daemon.stop().await;
    fleet.shutdown().await;
    let chart_memory_limit_mib = chart_memory_limit_mib()?;
    Ok(BlastRadiusFigures {
        attacks: refused,
        attack_writes_during_round,
        daemon_restarts: daemon_exits.len(),
        daemon_exits,
        daemon_peak_rss_mib,
        chart_memory_limit_mib,
        peak_rss_of_limit: daemon_peak_rss_mib / chart_memory_limit_mib,
        tenant_a_suspended,
        tenant_b_suspended,
        install_p50_ratio: attacked.install_p50_s / idle.install_p50_s.max(1e-6),
        pool_fill_ratio: attacked.pool_fill_s / idle.pool_fill_s.max(1e-6),
        idle,
        attacked,
        neighbour_install_p50_ratio: neighbour_attacked.install_p50_s / neighbour_idle.install_p50_s.max(1e-6),
        neighbour_pool_fill_ratio: neighbour_attacked.pool_fill_s / neighbour_idle.pool_fill_s.max(1e-6),
        neighbour_idle,
        neighbour_attacked,
        costs,
    })
}

/// Waits until the install `namespace/sample` is Ready.
async fn install_ready(tenant: &Client, namespace: &str, daemon: &supervisor::Supervised) -> Result<(), BenchError> {
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        let install = installs.get_opt("sample").await?;
        if install
            .and_then(|i| i.status)
            .is_some_and(|s| is_true(&s.conditions, "Ready"))
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(BenchError::Timeout(format!(
        "install {namespace}/sample not Ready within 120 s; daemon log {}",
        daemon.log().await.display()
    )))
}

/// The controllers chart's memory limit, in MiB.
fn chart_memory_limit_mib() -> Result<f64, BenchError> {
    let values: serde_json::Value = serde_saphyr::from_str(CHART_VALUES).map_err(std::io::Error::other)?;
    let limit = values["resources"]["limits"]["memory"]
        .as_str()
        .ok_or_else(|| std::io::Error::other("the chart's values set no resources.limits.memory"))?;
    let bytes: ByteSize = limit.parse().map_err(std::io::Error::other)?;
    Ok(bytes.0 as f64 / (1024.0 * 1024.0))
}

/// The scenario's lines of the table.
pub fn lines(f: &BlastRadiusFigures) -> String {
    let refused: Vec<String> = f
        .attacks
        .iter()
        .map(|(attack, (made, refused))| format!("{attack} {refused}/{made}"))
        .collect();
    let exits = if f.daemon_exits.is_empty() {
        String::new()
    } else {
        format!(" ({})", f.daemon_exits.join("; "))
    };
    format!(
        "\nblast radius: tenant A attacking ({} attack writes during B's round), tenant B installing {} stacks and filling a pool of {}\n\
         refused (of made): {}\n\
         daemon restarts {} (goal 0){exits}; peak RSS {:.1} MiB of the chart's {:.0} MiB limit ({:.2}; goal at most 1); A suspended: {}, B suspended: {}\n\
         tenant B install p50 {:.2} s under attack vs {:.2} s with A idle ({:.2}x; goal at most 2x); slowest {:.2} s vs {:.2} s; pool filled in {:.2} s vs {:.2} s ({:.2}x)\n\
         tenant A's neighbour namespace install p50 {:.2} s under attack vs {:.2} s idle ({:.2}x; goal at most 2x); pool filled in {:.2} s vs {:.2} s ({:.2}x)\n\
         {} package CRDs: charged {:.2} MiB, the daemon grew {:.2} MiB ({:.2}x; goal at most 2x)\n\
         customizations edited {:.0} times a second: {:.3} cores over {:.3} idle (goal at most {:.2})\n\
         {} assets naming a missing Secret ({} served, the rest past the namespace's memory share): {:.2} requests a second in their namespace (bound {:.0})\n",
        f.attack_writes_during_round,
        f.idle.installs,
        f.idle.pool_size,
        refused.join(", "),
        f.daemon_restarts,
        f.daemon_peak_rss_mib,
        f.chart_memory_limit_mib,
        f.peak_rss_of_limit,
        f.tenant_a_suspended,
        f.tenant_b_suspended,
        f.attacked.install_p50_s,
        f.idle.install_p50_s,
        f.install_p50_ratio,
        f.attacked.install_max_s,
        f.idle.install_max_s,
        f.attacked.pool_fill_s,
        f.idle.pool_fill_s,
        f.pool_fill_ratio,
        f.neighbour_attacked.install_p50_s,
        f.neighbour_idle.install_p50_s,
        f.neighbour_install_p50_ratio,
        f.neighbour_attacked.pool_fill_s,
        f.neighbour_idle.pool_fill_s,
        f.neighbour_pool_fill_ratio,
        f.costs.crds,
        f.costs.crd_charged_mib,
        f.costs.crd_rss_growth_mib,
        f.costs.crd_growth_of_charged,
        f.costs.edits_per_s,
        f.costs.edit_cores,
        f.costs.idle_cores,
        f.costs.edit_cores_bound,
        f.costs.assets,
        f.costs.assets_served,
        f.costs.asset_requests_per_s,
        f.costs.asset_requests_bound_per_s,
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_chart_memory_limit_is_read_from_its_values() {
        assert_eq!(super::chart_memory_limit_mib().unwrap(), 512.0);
    }
}
