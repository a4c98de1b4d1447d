//! The pool version of DESIGN.md §4.3.8: what every cluster of a pool is built from, hashed; a
//! cluster built at another version is stale.

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::api::pools::ClusterPool;

/// The pool version of §4.3.8: a hash of what every cluster is built from, plus a marker when the
/// pool has an inventory (so editing entries never changes it).
pub fn pool_version(pool: &ClusterPool) -> String {
    let s = &pool.spec;
    let fields = json!([
        s.platform,
        s.base_domain,
        s.installer_image,
        s.install_config_secret_template_ref,
        s.pull_secret_ref,
        s.control_plane,
        s.compute,
        s.failure_domains,
        s.availability_zones,
        s.control_plane_availability_zones,
        s.control_plane_omit_availability_zone,
        s.host_selector,
    ]);
    let mut hasher = Sha256::new();
    hasher.update(fields.to_string().as_bytes());
    if s.inventory.is_some() {
        hasher.update(b"hasInventory");
    }
    hex::encode(hasher.finalize())[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ClusterPoolSpec, InventoryEntry};

    fn pool(spec: ClusterPoolSpec) -> ClusterPool {
        ClusterPool::new("p", spec)
    }

    #[test]
    fn the_version_changes_with_the_inventory_marker_but_not_with_its_entries() {
        let base = ClusterPoolSpec {
            base_domain: "example.com".into(),
            installer_image: "installer:1".into(),
            ..Default::default()
        };
        let without = pool_version(&pool(base.clone()));
        let entry = |n: &str| InventoryEntry {
            name: n.into(),
            ..Default::default()
        };
        let one = pool_version(&pool(ClusterPoolSpec {
            inventory: Some(vec![entry("a")]),
            ..base.clone()
        }));
        let two = pool_version(&pool(ClusterPoolSpec {
            inventory: Some(vec![entry("b"), entry("a")]),
            ..base.clone()
        }));
        assert_ne!(without, one);
        assert_eq!(one, two);
        let resized = pool_version(&pool(ClusterPoolSpec {
            size: 7,
            ..base.clone()
        }));
        assert_eq!(without, resized, "size is not part of the version");
        let other = pool_version(&pool(ClusterPoolSpec {
            base_domain: "other.com".into(),
            ..base
        }));
        assert_ne!(without, other);
    }
}
