//! `stackd status`: the slot → replica → tenants table, read from the Leases.

use std::collections::BTreeMap;
use std::fmt::Write;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::ListParams;
use kube::{Api, Client};

use super::{LEASE_ROLE_LABEL, SHARDS_ANNOTATION, slot_of};

/// One slot's line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRow {
    pub slot: u32,
    /// The holder, if the Lease names one (it may have expired: see `renewed`).
    pub holder: Option<String>,
    /// Seconds since the holder's last renewal, by the holder's clock.
    pub renewed_ago: Option<i64>,
    pub tenants: Vec<String>,
}

/// Reads the member and slot Leases in `namespace`; `tenants` are mapped to slots with the slot
/// count the members announce (or `shards` when given).
pub async fn read(
    host: Client,
    namespace: &str,
    shards: Option<u32>,
    tenants: &[String],
) -> Result<(u32, Vec<SlotRow>), kube::Error> {
    let api: Api<Lease> = Api::namespaced(host, namespace);
    let leases = api.list(&ListParams::default().labels(LEASE_ROLE_LABEL)).await?.items;
    let role = |l: &Lease| {
        l.metadata
            .labels
            .as_ref()
            .and_then(|m| m.get(LEASE_ROLE_LABEL))
            .cloned()
    };
    let announced = leases
        .iter()
        .filter(|l| role(l).as_deref() == Some("member"))
        .filter_map(|l| l.metadata.annotations.as_ref()?.get(SHARDS_ANNOTATION)?.parse().ok())
        .max();
    let shards = shards.or(announced).unwrap_or(0);
    let mut by_slot: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for tenant in tenants {
        by_slot.entry(slot_of(tenant, shards)).or_default().push(tenant.clone());
    }
    let now = jiff::Timestamp::now();
    let rows = (0..shards)
        .map(|slot| {
            let lease = leases
                .iter()
                .find(|l| l.metadata.name.as_deref() == Some(super::slot_lease_name(slot).as_str()));
            let spec = lease.and_then(|l| l.spec.clone()).unwrap_or_default();
            SlotRow {
                slot,
                holder: spec.holder_identity.filter(|h| !h.is_empty()),
                renewed_ago: spec.renew_time.map(|t| now.duration_since(t.0).as_secs()),
                tenants: by_slot.remove(&slot).unwrap_or_default(),
            }
        })
        .collect();
    Ok((shards, rows))
}

/// The table as `stackd status` prints it.
pub fn render(shards: u32, rows: &[SlotRow]) -> String {
    let mut out = format!(
        "{shards} shard slots\n{:<6} {:<32} {:>9}  TENANTS\n",
        "SLOT", "HOLDER", "RENEWED"
    );
    for row in rows {
        let holder = row.holder.as_deref().unwrap_or("-");
        let renewed = row.renewed_ago.map_or("-".to_string(), |s| format!("{s}s ago"));
        let tenants = if row.tenants.is_empty() {
            "-".to_string()
        } else {
            row.tenants.join(",")
        };
        let _ = writeln!(out, "{:<6} {:<32} {:>9}  {tenants}", row.slot, holder, renewed);
    }
    let mut per_holder: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for row in rows {
        let entry = per_holder.entry(row.holder.as_deref().unwrap_or("(none)")).or_default();
        entry.0 += 1;
        entry.1 += row.tenants.len();
    }
    for (holder, (slots, tenants)) in per_holder {
        let _ = writeln!(out, "{holder}: {slots} slots, {tenants} tenants");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_slots_holder_and_tenants() {
        let rows = vec![
            SlotRow {
                slot: 0,
                holder: Some("a-1".into()),
                renewed_ago: Some(2),
                tenants: vec!["acme".into(), "globex".into()],
            },
            SlotRow {
                slot: 1,
                holder: None,
                renewed_ago: None,
                tenants: vec![],
            },
        ];
        let text = render(2, &rows);
        assert!(text.contains("0      a-1"), "{text}");
        assert!(text.contains("acme,globex"), "{text}");
        assert!(text.contains("a-1: 1 slots, 2 tenants"), "{text}");
        assert!(text.contains("(none): 1 slots, 0 tenants"), "{text}");
    }
}
