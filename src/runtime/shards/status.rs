//! `stackd status`: the replica → tenants table, read from the member Leases and the shard map.

use std::collections::BTreeMap;
use std::fmt::Write;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ListParams;
use kube::{Api, Client};

use super::assign::{Move, ShardMap};
use super::{LEASE_ROLE_LABEL, MAP_KEY, MAP_NAME};

/// One replica's line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaRow {
    pub replica: String,
    /// Seconds since its last renewal, by its own clock; `None`: no member Lease (gone).
    pub renewed_ago: Option<i64>,
    pub tenants: Vec<String>,
    /// Tenants it is handing over, and to whom (`-` when they are dropped).
    pub moving: Vec<(String, String)>,
}

/// The sharding table: one row per replica in the map or with a member Lease, and the tenants
/// of `tenants` the map gives to nobody. `None` when nothing is sharded in `namespace`.
pub struct ShardTable {
    pub rows: Vec<ReplicaRow>,
    pub unplaced: Vec<String>,
}

/// Reads the member Leases and the shard map in `namespace`.
pub async fn read(host: Client, namespace: &str, tenants: &[String]) -> Result<Option<ShardTable>, String> {
    let leases: Api<Lease> = Api::namespaced(host.clone(), namespace);
    let leases = leases
        .list(&ListParams::default().labels(LEASE_ROLE_LABEL))
        .await
        .map_err(|err| err.to_string())?
        .items;
    let maps: Api<ConfigMap> = Api::namespaced(host, namespace);
    let stored = maps.get_opt(MAP_NAME).await.map_err(|err| err.to_string())?;
    let Some(stored) = stored else {
        return Ok(None);
    };
    let text = stored
        .data
        .as_ref()
        .and_then(|d| d.get(MAP_KEY))
        .map_or("", String::as_str);
    let map = ShardMap::from_json(text).map_err(|why| format!("the shard map {MAP_NAME} cannot be read: {why}"))?;
    let now = jiff::Timestamp::now();
    let mut rows: BTreeMap<String, ReplicaRow> = BTreeMap::new();
    let row = |rows: &mut BTreeMap<String, ReplicaRow>, replica: &str| {
        rows.entry(replica.to_string())
            .or_insert_with(|| ReplicaRow {
                replica: replica.to_string(),
                renewed_ago: None,
                tenants: Vec::new(),
                moving: Vec::new(),
            })
            .replica
            .clone()
    };
    for lease in &leases {
        let Some(spec) = &lease.spec else { continue };
        let Some(holder) = spec.holder_identity.as_deref().filter(|h| !h.is_empty()) else {
            continue;
        };
        let key = row(&mut rows, holder);
        if let Some(entry) = rows.get_mut(&key) {
            entry.renewed_ago = spec.renew_time.as_ref().map(|t| now.duration_since(t.0).as_secs());
        }
    }
    for (tenant, entry) in &map.tenants {
        let key = row(&mut rows, &entry.owner.id);
        if let Some(owner) = rows.get_mut(&key) {
            owner.tenants.push(tenant.clone());
            match &entry.moving {
                None => {}
                Some(Move::To(to)) => owner.moving.push((tenant.clone(), to.id.clone())),
                Some(Move::Drop) => owner.moving.push((tenant.clone(), "-".to_string())),
            }
        }
    }
    let unplaced = tenants
        .iter()
        .filter(|tenant| !map.tenants.contains_key(*tenant))
        .cloned()
        .collect();
    Ok(Some(ShardTable {
        rows: rows.into_values().collect(),
        unplaced,
    }))
}

/// The table as `stackd status` prints it.
pub fn render(table: &ShardTable) -> String {
    let total: usize = table.rows.iter().map(|row| row.tenants.len()).sum();
    let mut out = format!(
        "{} tenants over {} replicas\n{:<32} {:>9} {:>7}  TENANTS\n",
        total,
        table.rows.iter().filter(|row| row.renewed_ago.is_some()).count(),
        "REPLICA",
        "RENEWED",
        "COUNT"
    );
    for row in &table.rows {
        let renewed = row.renewed_ago.map_or("gone".to_string(), |s| format!("{s}s ago"));
        let tenants = if row.tenants.is_empty() {
            "-".to_string()
        } else {
            row.tenants.join(",")
        };
        let _ = writeln!(
            out,
            "{:<32} {:>9} {:>7}  {tenants}",
            row.replica,
            renewed,
            row.tenants.len()
        );
        for (tenant, to) in &row.moving {
            let _ = writeln!(out, "  handing {tenant} over to {to}");
        }
    }
    if !table.unplaced.is_empty() {
        let _ = writeln!(out, "served by no replica: {}", table.unplaced.join(","));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_replica_its_tenants_and_what_moves() {
        let table = ShardTable {
            rows: vec![
                ReplicaRow {
                    replica: "a-1".into(),
                    renewed_ago: Some(2),
                    tenants: vec!["acme".into(), "globex".into()],
                    moving: vec![("globex".into(), "b-2".into())],
                },
                ReplicaRow {
                    replica: "b-2".into(),
                    renewed_ago: Some(1),
                    tenants: vec![],
                    moving: vec![],
                },
            ],
            unplaced: vec!["initech".into()],
        };
        let text = render(&table);
        assert!(text.starts_with("2 tenants over 2 replicas"), "{text}");
        assert!(text.contains("acme,globex"), "{text}");
        assert!(text.contains("handing globex over to b-2"), "{text}");
        assert!(text.contains("served by no replica: initech"), "{text}");
    }
}
