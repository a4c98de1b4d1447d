//! Pool fill under contention: two daemons fill one pool of size P from an inventory of P
//! customizations at once. Reports the time to fill, the customization status writes beyond the
//! two a correct fill needs per entry (a lease and its success mark: the rest are lost lease races),
//! and double leases (one customization backing two live clusters at once), which must be 0.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::ListParams;
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::Fleet;
use crate::api::pools::{ClusterDeployment, ClusterPool};
use crate::embedded::Verb;

const NAMESPACE: &str = "bench-pools";
const POOL: &str = "race";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PoolFigures {
    pub size: usize,
    pub daemons: usize,
    pub fill_s: f64,
    /// Customization status writes beyond a lease and a success mark per entry.
    pub lease_conflicts: u64,
    /// Observations of one customization backing two live clusters.
    pub double_leases: u64,
}

pub(super) async fn measure(size: usize) -> Result<PoolFigures, BenchError> {
    let fleet = Fleet::start(1).await?;
    let tenant = fleet.tenants[0].1.client().await;
    let names: Vec<String> = (0..size).map(|i| format!("cdc-{i:03}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let daemons = [fleet.daemon(&[])?, fleet.daemon(&[])?];
    for daemon in &daemons {
        daemon.wait_tenants_up(1, Duration::from_secs(60)).await?;
    }
    let before = fleet.tenants[0].1.counters();
    let started = Instant::now();
    crate::pools::sample::install_pool(&tenant, NAMESPACE, POOL, size as i32, &refs).await?;
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), NAMESPACE);
    let cds: Api<ClusterDeployment> = Api::all(tenant.clone());
    let deadline = Duration::from_secs(120 + 2 * size as u64);
    let mut double_leases = 0;
    loop {
        double_leases += count_double_leases(&cds).await?;
        let ready = pools.get(POOL).await?.status.map_or(0, |s| s.ready);
        if ready as usize >= size {
            break;
        }
        if started.elapsed() > deadline {
            return Err(BenchError::Timeout(format!(
                "the pool filled {ready} of {size} within {deadline:?}; daemon logs {} and {}",
                daemons[0].log.display(),
                daemons[1].log.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fill_s = started.elapsed().as_secs_f64();
    double_leases += count_double_leases(&cds).await?;
    let made = fleet.tenants[0].1.counters().since(&before);
    let status_writes: u64 = made
        .counts
        .iter()
        .filter(|(key, _)| {
            key.resource.starts_with("clusterdeploymentcustomizations")
                && key.resource.ends_with("/status")
                && matches!(key.verb, Verb::Update | Verb::Patch)
        })
        .map(|(_, n)| *n)
        .sum();
    for daemon in daemons {
        daemon.kill().await;
    }
    fleet.shutdown().await;
    Ok(PoolFigures {
        size,
        daemons: 2,
        fill_s,
        lease_conflicts: status_writes.saturating_sub(2 * size as u64),
        double_leases,
    })
}

/// Customizations backing more than one live cluster right now.
pub(super) async fn count_double_leases(cds: &Api<ClusterDeployment>) -> Result<u64, kube::Error> {
    let mut by_cdc: BTreeMap<String, usize> = BTreeMap::new();
    for cd in cds.list(&ListParams::default()).await?.items {
        if cd.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let cdc = cd.spec.cluster_pool_ref.as_ref().and_then(|r| {
            r.cluster_deployment_customization
                .as_ref()
                .map(|c| format!("{}/{}", r.namespace, c.name))
        });
        if let Some(cdc) = cdc {
            *by_cdc.entry(cdc).or_default() += 1;
        }
    }
    Ok(by_cdc.values().filter(|n| **n > 1).count() as u64)
}
