//! The per-pool gauges (`pool_clusters`, on `/metrics`): how many of a pool's clusters and inventory
//! entries are in each state, set once per pass from its buckets and the status just built.

use std::sync::Arc;

use super::buckets::{Bucket, Buckets, Stale};
use super::pass::Ctx;
use crate::api::pools::{ClusterDeployment, ClusterPoolStatus, InventoryEntryState};
use crate::runtime::metrics::PoolLabels;

pub(super) fn record_metrics(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    buckets: &Buckets,
    stale: &[(Arc<ClusterDeployment>, Stale)],
    status: &ClusterPoolStatus,
) {
    let metrics = &ctx.tenant.shared.metrics;
    let count = |b: &[Bucket]| buckets.count_in(b);
    let entries = |s: &[InventoryEntryState]| status.inventory.iter().filter(|e| s.contains(&e.status)).count() as i64;
    let values = [
        ("installing", count(&[Bucket::Installing])),
        ("ready", count(&[Bucket::Ready])),
        ("claimed", count(&[Bucket::Claimed, Bucket::Released])),
        ("broken", count(&[Bucket::Broken])),
        ("deleting", count(&[Bucket::Deleting])),
        ("stale", stale.len() as i64),
        ("available", entries(&[InventoryEntryState::Available])),
        (
            "reserved",
            entries(&[
                InventoryEntryState::Reserved,
                InventoryEntryState::ToBeUpdated,
                InventoryEntryState::ToBeDeleted,
            ]),
        ),
        (
            "cdc_broken",
            entries(&[InventoryEntryState::BrokenByCloud, InventoryEntryState::BrokenBySyntax]),
        ),
    ];
    for (state, value) in values {
        metrics
            .pool_clusters
            .get_or_create(&PoolLabels::new(&ctx.tenant.name, ns, name, state))
            .set(value);
    }
}
