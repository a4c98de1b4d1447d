//! Where a new cluster's machines go (DESIGN.md §6), seen from the pool controller: the domains in
//! effect for the pool, how many control-plane machines each already holds across the pool's
//! clusters, and the plan (records, rendering) of one new cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};
use serde_json::Value;

use super::failure_domains::{self, control_plane_records, pool_domains, render_openstack, spread};
use super::pool::Ctx;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterHost, ClusterPool, FailureDomainStatus, MachineFailureDomain};

/// Control-plane machines of a cluster when the pool does not say.
pub const DEFAULT_CONTROL_PLANE: i32 = 3;

/// What a new cluster's machines were resolved to: the record frozen on it, or why they cannot be
/// placed (the pool then creates no cluster and says why; a cluster an older stackd created with
/// such a plan is stopped with `InvalidMachineSpec`).
#[derive(Clone, Debug, Default)]
pub struct MachinePlan {
    pub records: Vec<MachineFailureDomain>,
    pub invalid: Option<String>,
    /// Bare-metal hosts assigned to the cluster.
    pub hosts: Vec<ClusterHost>,
}

/// The BareMetalAssets in the pool's namespace its `hostSelector` selects (none for other platforms).
pub(super) fn pool_assets(pool: &ClusterPool, ctx: &Ctx) -> Vec<Arc<BareMetalAsset>> {
    if pool.spec.platform.baremetal.is_none() {
        return Vec::new();
    }
    let ns = pool.namespace().unwrap_or_default();
    let selector: Option<Selector> = match pool.spec.host_selector.clone() {
        None => None,
        // An invalid selector selects nothing rather than everything.
        Some(s) => match Selector::try_from(s) {
            Ok(s) => Some(s),
            Err(_) => return Vec::new(),
        },
    };
    let mut assets: Vec<Arc<BareMetalAsset>> = ctx
        .assets
        .state()
        .into_iter()
        .filter(|a| a.namespace().as_deref() == Some(ns.as_str()))
        .filter(|a| selector.as_ref().is_none_or(|s| s.matches(a.labels())))
        .collect();
    assets.sort_by_key(|a| a.name_any());
    assets
}

/// The pool's failure domains: its assets' domains and `availabilityZones`, then its definitions.
pub(super) fn domains(pool: &ClusterPool, assets: &[Arc<BareMetalAsset>]) -> BTreeMap<String, FailureDomainStatus> {
    let zones: BTreeSet<&str> = assets.iter().filter_map(|a| a.spec.failure_domain.as_deref()).collect();
    pool_domains(&pool.spec, zones)
}

/// Control-plane machines per domain across the pool's clusters: their recorded status, or what
/// this controller planned for clusters whose record is not written yet.
pub(super) fn usage(ctx: &Ctx, cds: &[Arc<ClusterDeployment>], expected: &BTreeSet<String>) -> BTreeMap<String, usize> {
    let mut planned = ctx.records.lock().unwrap_or_else(|p| p.into_inner());
    let live: BTreeSet<String> = cds.iter().map(|cd| cd.name_any()).collect();
    planned.retain(|cd, _| live.contains(cd) || expected.contains(cd));
    let mut all: Vec<MachineFailureDomain> = Vec::new();
    for cd in cds {
        let recorded = cd
            .status
            .as_ref()
            .map(|s| s.failure_domains.clone())
            .unwrap_or_default();
        if recorded.is_empty() {
            all.extend(planned.get(&cd.name_any()).cloned().unwrap_or_default());
        } else {
            all.extend(recorded);
        }
    }
    for cd in expected.iter().filter(|c| !live.contains(*c)) {
        all.extend(planned.get(cd).cloned().unwrap_or_default());
    }
    failure_domains::usage(&all)
}

/// Places the control plane of a new OpenStack cluster and renders its machines into `config`
/// (vSphere pools with failure domains are refused elsewhere and get no placement; bare-metal hosts
/// are placed by `hosts`). `invalid` says why the machines cannot be placed: the pool then creates
/// no cluster.
pub(super) fn plan(
    pool: &ClusterPool,
    domains: &BTreeMap<String, FailureDomainStatus>,
    usage: &mut BTreeMap<String, usize>,
    config: &mut Value,
) -> MachinePlan {
    let spec = &pool.spec;
    if spec.platform.openstack.is_none() {
        return MachinePlan::default();
    }
    let replicas = spec
        .control_plane
        .as_ref()
        .and_then(|c| c.replicas)
        .unwrap_or(DEFAULT_CONTROL_PLANE)
        .max(0) as usize;
    let placements = spread(replicas, domains, usage);
    let rendered = control_plane_records(spec, domains, &placements)
        .and_then(|records| render_openstack(config, spec, domains, &records).map(|()| records));
    match rendered {
        Ok(records) => {
            commit(usage, &records);
            MachinePlan {
                records,
                ..Default::default()
            }
        }
        Err(message) => MachinePlan {
            invalid: Some(message),
            ..Default::default()
        },
    }
}

/// Counts a new cluster's records so the next cluster of this pass sees them.
pub(super) fn commit(usage: &mut BTreeMap<String, usize>, records: &[MachineFailureDomain]) {
    for (name, count) in failure_domains::usage(records) {
        *usage.entry(name).or_default() += count;
    }
}

/// Remembers a planned record until the cluster's status shows it.
pub(super) fn remember(ctx: &Ctx, cd: &str, records: &[MachineFailureDomain]) {
    if records.is_empty() {
        return;
    }
    let mut planned = ctx.records.lock().unwrap_or_else(|p| p.into_inner());
    planned.insert(cd.to_string(), records.to_vec());
}
