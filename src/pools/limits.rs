//! What a ClusterPool may ask of the daemon before any work is done for it (DESIGN.md §8, "Blast
//! radius"): a name that leaves room for its clusters' names, lists within the maxima of its schema
//! (checked here too: a pool written before the schema had them, or to a server that does not
//! validate, gets a clear refusal instead of unbounded work), and a place among the oldest
//! `--namespace-max-pools` pools of its namespace, so that one namespace cannot take the tenant's
//! controllers, quota and API calls from the others. A refused pool creates, repairs and deletes
//! nothing; its `CapacityAvailable` condition and an Event say why. Pure: no client.

use std::sync::Arc;

use kube::ResourceExt;

use crate::api::pools::{
    ClusterPool, MAX_CONTROL_PLANE_REPLICAS, MAX_FAILURE_DOMAINS, MAX_INVENTORY_ENTRIES, MAX_PORTS, MAX_VIPS,
};

/// Longest pool name: its clusters are named `<pool>-<5 characters>`, a namespace name (63).
pub(crate) const MAX_POOL_NAME: usize = 57;

/// Why a pool gets no work done, as its condition says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// The pool condition set to False.
    pub(crate) condition: &'static str,
    /// Its reason, also the Event's.
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// The first reason the pool's own spec gives to refuse it.
pub(crate) fn spec_refusal(pool: &ClusterPool) -> Option<Refusal> {
    let name = pool.name_any();
    if name.len() > MAX_POOL_NAME {
        return Some(Refusal {
            condition: "CapacityAvailable",
            reason: "InvalidName",
            message: format!(
                "The pool name is {} characters long; at most {MAX_POOL_NAME} leave room for the cluster names <pool>-<5 characters>: recreate the pool with a shorter name",
                name.len()
            ),
        });
    }
    let inventory = pool.spec.inventory.as_ref().map_or(0, Vec::len);
    if inventory > MAX_INVENTORY_ENTRIES {
        return Some(Refusal {
            condition: "InventoryValid",
            reason: "TooManyEntries",
            message: over("spec.inventory", inventory, MAX_INVENTORY_ENTRIES, "entries"),
        });
    }
    list_over_bound(pool).map(|message| Refusal {
        condition: "CapacityAvailable",
        reason: "SpecTooLarge",
        message,
    })
}

/// The first list (or count) of the spec past its schema maximum.
fn list_over_bound(pool: &ClusterPool) -> Option<String> {
    let spec = &pool.spec;
    let domain_ports = spec.failure_domains.iter().map(|d| d.ports.len()).max().unwrap_or(0);
    let control_plane = spec.control_plane.as_ref();
    let baremetal = spec.platform.baremetal.as_ref();
    let lists = [
        ("spec.failureDomains", spec.failure_domains.len(), MAX_FAILURE_DOMAINS),
        (
            "spec.availabilityZones",
            spec.availability_zones.len(),
            MAX_FAILURE_DOMAINS,
        ),
        (
            "spec.controlPlaneAvailabilityZones",
            spec.control_plane_availability_zones.len(),
            MAX_FAILURE_DOMAINS,
        ),
        ("spec.failureDomains[].ports", domain_ports, MAX_PORTS),
        (
            "spec.controlPlane.ports",
            control_plane.map_or(0, |c| c.ports.len()),
            MAX_PORTS,
        ),
        (
            "spec.platform.baremetal.apiVIPs",
            baremetal.map_or(0, |b| b.api_vips.len()),
            MAX_VIPS,
        ),
        (
            "spec.platform.baremetal.ingressVIPs",
            baremetal.map_or(0, |b| b.ingress_vips.len()),
            MAX_VIPS,
        ),
    ];
    if let Some((field, len, max)) = lists.into_iter().find(|(_, len, max)| len > max) {
        return Some(over(field, len, max, "items"));
    }
    let replicas = control_plane.and_then(|c| c.replicas).unwrap_or(0);
    (replicas > MAX_CONTROL_PLANE_REPLICAS).then(|| {
        format!(
            "spec.controlPlane.replicas is {replicas}; a cluster has at most {MAX_CONTROL_PLANE_REPLICAS} control-plane machines: lower it"
        )
    })
}

fn over(field: &str, len: usize, max: usize, what: &str) -> String {
    format!("{field} has {len} {what}, more than the {max} stackd works with: remove some")
}

/// Refuses the pool when `limit` (0: none) older pools of its namespace are live: pools are
/// served oldest first (creation time, then name), and a pool being deleted no longer counts.
pub(crate) fn namespace_refusal(pool: &ClusterPool, pools: &[Arc<ClusterPool>], limit: usize) -> Option<Refusal> {
    if limit == 0 {
        return None;
    }
    let namespace = pool.namespace().unwrap_or_default();
    let live: Vec<&ClusterPool> = pools
        .iter()
        .map(|p| &**p)
        .filter(|p| p.namespace().as_deref() == Some(namespace.as_str()) && p.metadata.deletion_timestamp.is_none())
        .collect();
    let older = live.iter().filter(|p| age_order(p) < age_order(pool)).count();
    (older >= limit).then(|| Refusal {
        condition: "CapacityAvailable",
        reason: "TooManyPools",
        message: format!(
            "Namespace {namespace} has {} ClusterPools and stackd serves at most {limit} per namespace (--namespace-max-pools), the oldest first; this pool creates no clusters until an older one is deleted: delete a pool in namespace {namespace}, or ask the operator to raise the limit",
            live.len().max(older + 1)
        ),
    })
}

/// Oldest first; pools created in the same second go by name.
fn age_order(pool: &ClusterPool) -> (Option<jiff::Timestamp>, String) {
    let created = pool.metadata.creation_timestamp.as_ref().map(|t| t.0);
    (created, pool.name_any())
}

/// The pools a pool being deleted may let in: those of its namespace newer than it that are now
/// among the oldest `limit` (at most `limit` pools, whatever the namespace holds).
pub(crate) fn admitted_by_deletion(
    changed: &ClusterPool,
    pools: &[Arc<ClusterPool>],
    limit: usize,
) -> Vec<Arc<ClusterPool>> {
    if limit == 0 || changed.metadata.deletion_timestamp.is_none() {
        return Vec::new();
    }
    let namespace = changed.namespace();
    let mut live: Vec<&Arc<ClusterPool>> = pools
        .iter()
        .filter(|p| p.namespace() == namespace && p.metadata.deletion_timestamp.is_none())
        .collect();
    live.sort_by_key(|p| age_order(p));
    let gone = age_order(changed);
    live.into_iter()
        .take(limit)
        .filter(|p| age_order(p) > gone)
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    use super::*;

    fn pool(namespace: &str, name: &str, second: i64, spec: serde_json::Value) -> Arc<ClusterPool> {
        let mut full = json!({"size": 1, "baseDomain": "example.com", "installerImage": "i",
            "platform": {"openstack": {"credentialsSecretRef": {"name": "c"}, "cloud": "c"}}});
        for (k, v) in spec.as_object().cloned().unwrap_or_default() {
            full[k] = v;
        }
        let mut pool: ClusterPool = serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
            "metadata": {"name": name, "namespace": namespace}, "spec": full,
        }))
        .unwrap();
        pool.metadata.creation_timestamp = Some(Time(jiff::Timestamp::from_second(second).unwrap()));
        Arc::new(pool)
    }

    #[test]
    fn the_newest_pools_past_the_namespace_limit_are_refused() {
        let all = [
            pool("team", "c", 30, json!({})),
            pool("team", "a", 10, json!({})),
            pool("team", "b", 10, json!({})),
            pool("other", "z", 1, json!({})),
        ];
        assert_eq!(namespace_refusal(&all[1], &all, 2), None);
        assert_eq!(namespace_refusal(&all[2], &all, 2), None, "same second: by name");
        let refused = namespace_refusal(&all[0], &all, 2).expect("the newest is refused");
        assert_eq!(
            (refused.condition, refused.reason),
            ("CapacityAvailable", "TooManyPools")
        );
        assert!(
            refused.message.contains("Namespace team has 3 ClusterPools")
                && refused
                    .message
                    .contains("at most 2 per namespace (--namespace-max-pools)"),
            "{}",
            refused.message
        );
        assert_eq!(namespace_refusal(&all[0], &all, 0), None, "0 is no limit");
        assert_eq!(
            namespace_refusal(&all[3], &all, 1),
            None,
            "other namespaces are not counted"
        );
    }

    #[test]
    fn a_pool_being_deleted_frees_its_place_and_wakes_the_next() {
        let mut deleting = (*pool("team", "a", 10, json!({}))).clone();
        deleting.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::from_second(40).unwrap()));
        let deleting = Arc::new(deleting);
        let all = [
            deleting.clone(),
            pool("team", "b", 20, json!({})),
            pool("team", "c", 30, json!({})),
            pool("team", "d", 40, json!({})),
        ];
        assert_eq!(namespace_refusal(&all[2], &all, 2), None);
        let woken: Vec<String> = admitted_by_deletion(&deleting, &all, 2)
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(woken, ["b", "c"], "the ones now among the oldest two");
        assert!(admitted_by_deletion(&all[1], &all, 1).is_empty(), "not being deleted");
    }

    #[test]
    fn lists_past_their_maxima_are_refused_naming_the_field() {
        let zones: Vec<String> = (0..=MAX_FAILURE_DOMAINS).map(|i| format!("z{i}")).collect();
        let refused = spec_refusal(&pool("team", "p", 1, json!({"availabilityZones": zones}))).unwrap();
        assert_eq!(refused.reason, "SpecTooLarge");
        assert!(
            refused
                .message
                .starts_with("spec.availabilityZones has 65 items, more than the 64")
        );
        let entries: Vec<_> = (0..=MAX_INVENTORY_ENTRIES)
            .map(|i| json!({"name": format!("e{i}")}))
            .collect();
        let refused = spec_refusal(&pool("team", "p", 1, json!({"inventory": entries}))).unwrap();
        assert_eq!(
            (refused.condition, refused.reason),
            ("InventoryValid", "TooManyEntries")
        );
        let refused = spec_refusal(&pool("team", "p", 1, json!({"controlPlane": {"replicas": 2147483647}}))).unwrap();
        assert!(
            refused.message.contains("replicas is 2147483647"),
            "{}",
            refused.message
        );
        assert_eq!(
            spec_refusal(&pool("team", "p", 1, json!({"availabilityZones": ["a"]}))),
            None
        );
    }

    #[test]
    fn a_name_too_long_for_cluster_names_is_refused() {
        let refused = spec_refusal(&pool("team", &"p".repeat(58), 1, json!({}))).unwrap();
        assert_eq!(refused.reason, "InvalidName");
    }
}
