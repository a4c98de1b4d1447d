//! Choosing a new cluster's bare-metal hosts (DESIGN.md §5 "Assignment by pools", §6), without a
//! request: the hosts a pool's clusters need, what its free BareMetalAssets can back, which free
//! assets a new cluster gets by role spread over failure domains, and what the choice records. The
//! writes that assign the chosen assets are in `hosts.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;

use super::machines::DEFAULT_CONTROL_PLANE;
use crate::api::inventory::{AssetRole, BareMetalAsset};
use crate::api::pools::{ClusterHost, ClusterPool, FailureDomainStatus, HostRole, MachineFailureDomain};

/// Annotations on an asset a pool assigned: which pool, and when (for the §4.3.2 repair).
pub(crate) const ASSIGNED_BY_ANNOTATION: &str = "pools.stackd.dev/assigned-by";
pub(crate) const ASSIGNED_AT_ANNOTATION: &str = "pools.stackd.dev/assigned-at";

/// Hosts of each role a cluster of this pool needs.
pub(crate) fn needed(pool: &ClusterPool) -> (usize, usize) {
    let masters = pool
        .spec
        .control_plane
        .as_ref()
        .and_then(|c| c.replicas)
        .unwrap_or(DEFAULT_CONTROL_PLANE);
    let workers = pool.spec.compute.as_ref().and_then(|c| c.replicas).unwrap_or(0);
    (masters.max(0) as usize, workers.max(0) as usize)
}

/// Whether `asset` is assigned to no cluster and not being deleted.
pub(super) fn free(asset: &BareMetalAsset) -> bool {
    asset.spec.assigned_cluster().is_none() && asset.metadata.deletion_timestamp.is_none()
}

/// What the pool's free assets can back: whole clusters, and how many control-plane and worker hosts
/// the next cluster would get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostCapacity {
    pub(crate) clusters: usize,
    pub(crate) next_masters: usize,
    pub(crate) next_workers: usize,
}

/// How many more clusters the pool's free assets can back, each taking `needed(pool)` hosts by the
/// same role rules as `choose`: the pool's capacity on bare metal.
pub(crate) fn capacity(pool: &ClusterPool, assets: &[Arc<BareMetalAsset>]) -> HostCapacity {
    let (masters, workers) = needed(pool);
    let free_of = |role: AssetRole| {
        assets
            .iter()
            .filter(|a| free(a) && a.spec.role.unwrap_or_default() == role)
            .count()
    };
    let (mut m, mut w, mut any) = (
        free_of(AssetRole::Master),
        free_of(AssetRole::Worker),
        free_of(AssetRole::Unspecified),
    );
    let mut clusters = 0;
    loop {
        let from_masters = m.min(masters);
        let from_workers = w.min(workers);
        let from_any = (masters - from_masters) + (workers - from_workers);
        if from_any > any || masters + workers == 0 {
            let next_masters = (from_masters + any).min(masters);
            let spare = any.saturating_sub(masters - from_masters);
            let next_workers = (from_workers + spare).min(workers);
            let clusters = if masters + workers == 0 { usize::MAX } else { clusters };
            return HostCapacity {
                clusters,
                next_masters,
                next_workers,
            };
        }
        m -= from_masters;
        w -= from_workers;
        any -= from_any;
        clusters += 1;
    }
}

/// Chooses `masters` control-plane and `workers` worker hosts among the free `assets`: each role
/// takes assets of that role first, then role-less ones, never the other role. Control-plane hosts
/// are spread like control-plane machines (§6): fewest of this cluster in the domain, then fewest
/// across the pool (`usage`), then by name; hosts outside eligible domains come last.
pub(crate) fn select(
    assets: &[Arc<BareMetalAsset>],
    masters: usize,
    workers: usize,
    domains: &BTreeMap<String, FailureDomainStatus>,
    usage: &BTreeMap<String, usize>,
) -> Result<Vec<(Arc<BareMetalAsset>, HostRole)>, String> {
    let tier = |asset: &BareMetalAsset, role: AssetRole| -> Option<u8> {
        match asset.spec.role.unwrap_or_default() {
            r if r == role => Some(0),
            AssetRole::Unspecified => Some(1),
            _ => None,
        }
    };
    let mut chosen: Vec<(Arc<BareMetalAsset>, HostRole)> = Vec::new();
    let mut taken: BTreeSet<String> = BTreeSet::new();
    let mut mine: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..masters {
        let best = assets
            .iter()
            .filter(|a| free(a) && !taken.contains(&a.name_any()))
            .filter_map(|a| {
                let tier = tier(a, AssetRole::Master)?;
                let domain = a.spec.failure_domain.clone().unwrap_or_default();
                let eligible = domains.get(&domain).is_some_and(|d| d.control_plane);
                Some((
                    (
                        tier,
                        !eligible,
                        mine.get(&domain).copied().unwrap_or(0),
                        usage.get(&domain).copied().unwrap_or(0),
                        domain.clone(),
                        a.name_any(),
                    ),
                    a,
                ))
            })
            .min_by(|x, y| x.0.cmp(&y.0));
        let Some((_, asset)) = best else { break };
        let domain = asset.spec.failure_domain.clone().unwrap_or_default();
        *mine.entry(domain).or_default() += 1;
        taken.insert(asset.name_any());
        chosen.push((asset.clone(), HostRole::Master));
    }
    let mut worker_candidates: Vec<(u8, String, &Arc<BareMetalAsset>)> = assets
        .iter()
        .filter(|a| free(a) && !taken.contains(&a.name_any()))
        .filter_map(|a| Some((tier(a, AssetRole::Worker)?, a.name_any(), a)))
        .collect();
    worker_candidates.sort_by(|x, y| (x.0, &x.1).cmp(&(y.0, &y.1)));
    let got_masters = chosen.len();
    chosen.extend(
        worker_candidates
            .into_iter()
            .take(workers)
            .map(|(_, _, a)| (a.clone(), HostRole::Worker)),
    );
    let got_workers = chosen.len() - got_masters;
    if got_masters < masters || got_workers < workers {
        return Err(format!(
            "A cluster needs {masters} control-plane and {workers} worker hosts; the free BareMetalAssets the pool selects can fill only {got_masters} and {got_workers} (control-plane hosts have role master or none, workers role worker or none); add assets or lower the replicas"
        ));
    }
    Ok(chosen)
}

/// The hosts a new cluster of `pool` gets among `assets`, leaving out the `unavailable` ones (taken
/// for another cluster in this pass, or lost to another writer): see [`select`].
pub(crate) fn choose(
    pool: &ClusterPool,
    assets: &[Arc<BareMetalAsset>],
    unavailable: &BTreeSet<String>,
    domains: &BTreeMap<String, FailureDomainStatus>,
    usage: &BTreeMap<String, usize>,
) -> Result<Vec<(Arc<BareMetalAsset>, HostRole)>, String> {
    let (masters, workers) = needed(pool);
    let candidates: Vec<Arc<BareMetalAsset>> = assets
        .iter()
        .filter(|a| !unavailable.contains(&a.name_any()))
        .cloned()
        .collect();
    select(&candidates, masters, workers, domains, usage)
}

/// The records of hosts in a failure domain, in host order.
pub(crate) fn records(chosen: &[(Arc<BareMetalAsset>, HostRole)]) -> Vec<MachineFailureDomain> {
    chosen
        .iter()
        .filter_map(|(asset, role)| {
            let domain = asset.spec.failure_domain.clone()?;
            Some(MachineFailureDomain {
                machine: asset.name_any(),
                role: *role,
                name: domain.clone(),
                compute_availability_zone: Some(domain),
                ..Default::default()
            })
        })
        .collect()
}

pub(crate) fn cluster_hosts(chosen: &[(Arc<BareMetalAsset>, HostRole)]) -> Vec<ClusterHost> {
    chosen
        .iter()
        .map(|(asset, role)| ClusterHost {
            name: asset.name_any(),
            role: *role,
            failure_domain: asset.spec.failure_domain.clone(),
        })
        .collect()
}

/// How long ago the pool assigned `asset`, if it did.
pub(crate) fn assigned_age(asset: &BareMetalAsset, pool: &str) -> Option<Duration> {
    let annotations = asset.annotations();
    if annotations.get(ASSIGNED_BY_ANNOTATION).map(String::as_str) != Some(pool) {
        return None;
    }
    let at: Timestamp = annotations.get(ASSIGNED_AT_ANNOTATION)?.parse().ok()?;
    Duration::try_from(Timestamp::now().duration_since(at)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::inventory::{BareMetalAssetSpec, BmcDetails};

    fn asset(name: &str, role: Option<AssetRole>, domain: Option<&str>) -> Arc<BareMetalAsset> {
        let mut a = BareMetalAsset::new(
            name,
            BareMetalAssetSpec {
                bmc: BmcDetails {
                    address: "ipmi://x".into(),
                    credentials_name: "c".into(),
                },
                boot_mac_address: "00:00:00:00:00:01".into(),
                role,
                failure_domain: domain.map(String::from),
                ..Default::default()
            },
        );
        a.metadata.namespace = Some("team".into());
        Arc::new(a)
    }

    fn names(chosen: &[(Arc<BareMetalAsset>, HostRole)]) -> Vec<(String, HostRole)> {
        chosen.iter().map(|(a, r)| (a.name_any(), *r)).collect()
    }

    #[test]
    fn a_new_cluster_never_gets_a_host_taken_earlier_in_the_pass_or_lost_in_a_race() {
        let pool: ClusterPool = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "team"},
            "spec": {"size": 2, "baseDomain": "example.com", "installerImage": "i",
                     "platform": {"baremetal": {"credentialsSecretRef": {"name": "creds"}}},
                     "controlPlane": {"replicas": 1}, "compute": {"replicas": 0}}
        }))
        .unwrap();
        let m = Some(AssetRole::Master);
        let assets = vec![asset("m1", m, None), asset("m2", m, None), asset("m3", m, None)];
        let none = BTreeSet::new();
        let first = choose(&pool, &assets, &none, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        assert_eq!(names(&first), vec![("m1".into(), HostRole::Master)]);
        let unavailable: BTreeSet<String> = ["m1".to_string(), "m2".to_string()].into();
        let next = choose(&pool, &assets, &unavailable, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        assert_eq!(names(&next), vec![("m3".into(), HostRole::Master)]);
        let all: BTreeSet<String> = assets.iter().map(|a| a.name_any()).collect();
        let short = choose(&pool, &assets, &all, &BTreeMap::new(), &BTreeMap::new()).unwrap_err();
        assert!(short.contains("can fill only 0 and 0"), "{short}");
    }

    #[test]
    fn an_assignment_is_dated_only_for_the_pool_that_made_it() {
        let mut a = (*asset("m1", None, None)).clone();
        assert_eq!(assigned_age(&a, "p"), None);
        let annotations = a.annotations_mut();
        annotations.insert(ASSIGNED_BY_ANNOTATION.into(), "p".into());
        annotations.insert(ASSIGNED_AT_ANNOTATION.into(), "2024-01-01T00:00:00Z".into());
        assert!(assigned_age(&a, "p").is_some_and(|age| age > Duration::from_secs(3600)));
        assert_eq!(assigned_age(&a, "q"), None, "another pool's assignment");
    }

    #[test]
    fn capacity_counts_the_clusters_the_free_assets_can_back() {
        let pool: ClusterPool = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "team"},
            "spec": {"size": 3, "baseDomain": "example.com", "installerImage": "i", "pullSecretRef": {"name": "pull"},
                     "platform": {"baremetal": {"credentialsSecretRef": {"name": "creds"}}},
                     "controlPlane": {"replicas": 1}, "compute": {"replicas": 1}}
        }))
        .unwrap();
        let m = Some(AssetRole::Master);
        let w = Some(AssetRole::Worker);
        // Two masters, one worker, one role-less: two clusters (the second's worker is role-less).
        let assets = vec![
            asset("m1", m, None),
            asset("m2", m, None),
            asset("w1", w, None),
            asset("x1", None, None),
        ];
        assert_eq!(capacity(&pool, &assets).clusters, 2);
        // Workers never stand in for masters.
        let workers = vec![asset("w1", w, None), asset("w2", w, None)];
        let none = capacity(&pool, &workers);
        assert_eq!((none.clusters, none.next_masters, none.next_workers), (0, 0, 1));
    }

    #[test]
    fn roles_fall_back_to_role_less_assets_and_never_cross() {
        let m = Some(AssetRole::Master);
        let w = Some(AssetRole::Worker);
        let assets = vec![
            asset("m1", m, None),
            asset("m2", m, None),
            asset("m3", m, None),
            asset("w1", w, None),
            asset("x1", None, None),
            asset("x2", None, None),
        ];
        let chosen = select(&assets, 3, 2, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        use HostRole::*;
        let expected: Vec<(String, HostRole)> = [
            ("m1", Master),
            ("m2", Master),
            ("m3", Master),
            ("w1", Worker),
            ("x1", Worker),
        ]
        .iter()
        .map(|(n, r)| (n.to_string(), *r))
        .collect();
        assert_eq!(names(&chosen), expected);
        // Four masters: the role-less fill in, a worker never does.
        let chosen = select(&assets, 4, 1, &BTreeMap::new(), &BTreeMap::new()).unwrap();
        assert_eq!(chosen[3].0.name_any(), "x1");
        assert_eq!(chosen[4].0.name_any(), "w1");
        let err = select(&assets, 6, 0, &BTreeMap::new(), &BTreeMap::new()).unwrap_err();
        assert!(err.contains("only 5 and 0"), "{err}");
    }

    #[test]
    fn control_plane_hosts_spread_over_failure_domains() {
        let m = Some(AssetRole::Master);
        let assets = vec![
            asset("a1", m, Some("rack-a")),
            asset("a2", m, Some("rack-a")),
            asset("b1", m, Some("rack-b")),
            asset("c1", m, Some("rack-c")),
        ];
        let domains = crate::pools::failure_domains::pool_domains(&Default::default(), ["rack-a", "rack-b", "rack-c"]);
        let chosen = select(&assets, 3, 0, &domains, &BTreeMap::new()).unwrap();
        let racks: Vec<String> = records(&chosen).into_iter().map(|r| r.name).collect();
        assert_eq!(racks, ["rack-a", "rack-b", "rack-c"]);
        let used = BTreeMap::from([("rack-a".to_string(), 1)]);
        let chosen = select(&assets, 2, 0, &domains, &used).unwrap();
        let racks: Vec<String> = records(&chosen).into_iter().map(|r| r.name).collect();
        assert_eq!(racks, ["rack-b", "rack-c"], "ties go to the less used domains");
    }
}
