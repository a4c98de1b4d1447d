//! Observing one pool (DESIGN.md §4.3): what the caches show of it — its members (after the
//! membership check of §8), claims, inventory, CDCs, assets and failure domains — corrected by
//! this controller's own writes they do not show yet.

use std::collections::BTreeSet;

use kube::ResourceExt;

use super::failure_domains;
use super::machines;
use super::membership::{self, PoolIdentity};
use super::pass::{Ctx, Observed, PoolError};
use crate::api::pools::{ClusterPool, ClusterPoolStatus};

/// What the caches show of `pool`; asks the server only about a cluster whose namespace the
/// cache lacks (see [`membership::clusters`]).
pub(super) async fn observe(pool: &ClusterPool, ctx: &Ctx) -> Result<Observed, PoolError> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let previous = last_status(ctx, pool);
    let (expected_created, expected_deleted) = ctx.expectations_of(pool);
    let identity = PoolIdentity::of(pool);
    let clusters = membership::clusters(&ctx.tenant, &ctx.cds, &ctx.namespaces, &ctx.refusals, &identity).await?;
    let claims = ctx
        .claims
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()) && c.spec.cluster_pool_name == name)
        .map(|c| (c.name_any(), c))
        .collect();
    let mut seen_entries = BTreeSet::new();
    let inventory = pool
        .spec
        .inventory
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .filter(|n| seen_entries.insert(n.clone()))
        .collect();
    let cdcs = ctx
        .cdcs
        .state()
        .into_iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()))
        .map(|c| (c.name_any(), c))
        .collect();
    let pools = ctx
        .pools
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .map(|p| p.name_any())
        .collect();
    let assets = machines::pool_assets(pool, ctx);
    let domains = machines::domains(pool, &assets);
    let contradiction = failure_domains::contradiction(&pool.spec, &domains);
    Ok(Observed {
        previous,
        expected_created,
        expected_deleted,
        cds: clusters.members,
        live: clusters.live,
        claims,
        inventory,
        cdcs,
        pools,
        assets,
        domains,
        contradiction,
    })
}

/// The pool's status as last known: the cached one, unless this controller wrote one the cache
/// does not show yet (so counters such as `attempts` are never lost to a stale cache).
fn last_status(ctx: &Ctx, pool: &ClusterPool) -> ClusterPoolStatus {
    let cached = pool.status.clone().unwrap_or_default();
    let uid = pool.uid().unwrap_or_default();
    ctx.written
        .current(&uid, pool.metadata.resource_version.as_deref(), cached)
}
