//! What a pool reports: the per-entry inventory status of the status-revision seed, and the
//! per-pool metrics.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt;

use super::CDC_GENERATION_ANNOTATION;
use super::leases::{self, BROKEN_BY_CLOUD, BROKEN_BY_SYNTAX, SUCCEEDED};
use super::pool::{Bucket, Ctx, Round, Stale, cdc_of};
use crate::api::pools::{
    ClusterDeployment, ClusterDeploymentCustomization, ClusterPoolStatus, InventoryEntryState, InventoryEntryStatus,
};
use crate::runtime::metrics::PoolLabels;

type Cdc = ClusterDeploymentCustomization;

/// The per-entry inventory status of the status-revision seed.
pub(super) fn entry_statuses(
    base: &ClusterPoolStatus,
    inventory: &[String],
    cdc_now: &dyn Fn(&str) -> Option<Cdc>,
    cds: &BTreeMap<String, Arc<ClusterDeployment>>,
    round: &Round,
    stale: &[(&Arc<ClusterDeployment>, Stale)],
    pool_name: &str,
) -> Vec<InventoryEntryStatus> {
    let old: BTreeMap<String, InventoryEntryStatus> =
        base.inventory.iter().map(|e| (e.name.clone(), e.clone())).collect();
    let built_from = |entry: &str| -> Option<&Arc<ClusterDeployment>> {
        cds.values().find(|cd| cdc_of(cd).as_deref() == Some(entry))
    };
    let mut out = Vec::new();
    for entry in inventory {
        let previous = old.get(entry).cloned().unwrap_or_default();
        // The generation a live cluster was built from is the durable record of what was applied.
        let built = built_from(entry)
            .and_then(|cd| cd.annotations().get(CDC_GENERATION_ANNOTATION).cloned())
            .and_then(|g| g.parse::<i64>().ok());
        let mut status = InventoryEntryStatus {
            name: entry.clone(),
            version: round.leased.get(entry).copied().or(built).or(previous.version),
            attempts: previous.attempts + i32::from(round.broken_entries.contains(entry)),
            ..Default::default()
        };
        let Some(cdc) = cdc_now(entry) else {
            status.status = InventoryEntryState::Missing;
            out.push(status);
            continue;
        };
        let holder = leases::lease_holder(&cdc);
        let reason = leases::apply_reason(&cdc);
        if reason == Some(SUCCEEDED) {
            status.attempts = 0;
        }
        let edited = status.version.is_some() && status.version != cdc.metadata.generation;
        status.status = match &holder {
            Some((Some(p), _)) if p != pool_name => InventoryEntryState::Unavailable,
            Some((_, cd)) => {
                status.cluster_deployment = cd.clone();
                let stale_edit = stale
                    .iter()
                    .any(|(s, why)| *why == Stale::EntryEdited && cdc_of(s).as_deref() == Some(entry.as_str()));
                if edited || stale_edit {
                    InventoryEntryState::ToBeUpdated
                } else {
                    InventoryEntryState::Reserved
                }
            }
            None => {
                if edited {
                    // Edited since its last use: its failures no longer count.
                    status.attempts = 0;
                }
                match reason {
                    Some(BROKEN_BY_SYNTAX) => InventoryEntryState::BrokenBySyntax,
                    Some(BROKEN_BY_CLOUD) => InventoryEntryState::BrokenByCloud,
                    _ => InventoryEntryState::Available,
                }
            }
        };
        out.push(status);
    }
    // Entries removed from the inventory stay listed while a cluster built from them exists.
    for (entry, previous) in old {
        if inventory.contains(&entry) {
            continue;
        }
        if let Some(cd) = built_from(&entry) {
            out.push(InventoryEntryStatus {
                name: entry,
                status: InventoryEntryState::ToBeDeleted,
                cluster_deployment: Some(cd.name_any()),
                ..previous
            });
        }
    }
    out
}

pub(super) fn record_metrics(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    buckets: &BTreeMap<String, Bucket>,
    stale: &[(&Arc<ClusterDeployment>, Stale)],
    status: &ClusterPoolStatus,
) {
    let metrics = &ctx.tenant.shared.metrics;
    let count = |b: &[Bucket]| buckets.values().filter(|x| b.contains(x)).count() as i64;
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
