//! The baremetal platform of pools (DESIGN.md §5 "Assignment by pools", §6 rendering): choosing a
//! new cluster's hosts from the pool's free BareMetalAssets by role, spread over failure domains;
//! assigning them with optimistic concurrency and releasing them on failure, on the cluster's
//! deletion, or when the cluster never appeared; and `platform.baremetal.hosts`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::machines;
use super::pool::{Ctx, PoolError, Round};
use crate::api::inventory::{AssetRole, BareMetalAsset};
use crate::api::pools::{ClusterHost, ClusterPool, FailureDomainStatus, HostRole, MachineFailureDomain};
use crate::inventory::CLUSTER_LABEL;
use crate::runtime::api_errors::{is_conflict, is_not_found};

/// Annotations on an asset a pool assigned: which pool, and when (for the §4.3.2 repair).
pub const ASSIGNED_BY_ANNOTATION: &str = "pools.stackd.dev/assigned-by";
pub const ASSIGNED_AT_ANNOTATION: &str = "pools.stackd.dev/assigned-at";

/// Hosts of each role a cluster of this pool needs.
pub fn needed(pool: &ClusterPool) -> (usize, usize) {
    let masters = pool
        .spec
        .control_plane
        .as_ref()
        .and_then(|c| c.replicas)
        .unwrap_or(super::machines::DEFAULT_CONTROL_PLANE);
    let workers = pool.spec.compute.as_ref().and_then(|c| c.replicas).unwrap_or(0);
    (masters.max(0) as usize, workers.max(0) as usize)
}

fn free(asset: &BareMetalAsset) -> bool {
    asset.spec.assigned_cluster().is_none() && asset.metadata.deletion_timestamp.is_none()
}

/// What the pool's free assets can back: whole clusters, and how many control-plane and worker hosts
/// the next cluster would get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCapacity {
    pub clusters: usize,
    pub next_masters: usize,
    pub next_workers: usize,
}

/// How many more clusters the pool's free assets can back, each taking `needed(pool)` hosts by the
/// same role rules as `choose`: the pool's capacity on bare metal.
pub fn capacity(pool: &ClusterPool, assets: &[Arc<BareMetalAsset>]) -> HostCapacity {
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
pub fn select(
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

/// The records of hosts in a failure domain, in host order.
pub fn records(chosen: &[(Arc<BareMetalAsset>, HostRole)]) -> Vec<MachineFailureDomain> {
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

pub fn cluster_hosts(chosen: &[(Arc<BareMetalAsset>, HostRole)]) -> Vec<ClusterHost> {
    chosen
        .iter()
        .map(|(asset, role)| ClusterHost {
            name: asset.name_any(),
            role: *role,
            failure_domain: asset.spec.failure_domain.clone(),
        })
        .collect()
}

/// Assigns `asset` to cluster `cd` of `pool` with an update carrying the cached resourceVersion:
/// `Ok(None)` when someone else changed it first (409).
pub async fn assign(
    api: &Api<BareMetalAsset>,
    asset: &BareMetalAsset,
    cd: &str,
    pool: &str,
) -> Result<Option<BareMetalAsset>, kube::Error> {
    let mut updated = asset.clone();
    updated.metadata.managed_fields = None;
    updated.spec.cluster_name = Some(cd.into());
    updated.labels_mut().insert(CLUSTER_LABEL.into(), cd.into());
    let annotations = updated.annotations_mut();
    annotations.insert(ASSIGNED_BY_ANNOTATION.into(), pool.into());
    annotations.insert(ASSIGNED_AT_ANNOTATION.into(), Timestamp::now().to_string());
    match api.replace(&asset.name_any(), &PostParams::default(), &updated).await {
        Ok(written) => Ok(Some(written)),
        Err(err) if is_conflict(&err) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Unassigns `asset` if it is still assigned to `cd`, retrying on conflict with a fresh copy.
/// Returns whether it wrote.
pub async fn release(api: &Api<BareMetalAsset>, asset: &BareMetalAsset, cd: &str) -> Result<bool, kube::Error> {
    let mut current = asset.clone();
    for _ in 0..5 {
        if current.spec.assigned_cluster() != Some(cd) {
            return Ok(false);
        }
        let mut updated = current.clone();
        updated.metadata.managed_fields = None;
        updated.spec.cluster_name = None;
        updated.labels_mut().remove(CLUSTER_LABEL);
        updated.annotations_mut().remove(ASSIGNED_BY_ANNOTATION);
        updated.annotations_mut().remove(ASSIGNED_AT_ANNOTATION);
        match api.replace(&current.name_any(), &PostParams::default(), &updated).await {
            Ok(_) => return Ok(true),
            Err(err) if is_not_found(&err) => return Ok(false),
            Err(err) if is_conflict(&err) => match api.get_opt(&current.name_any()).await? {
                Some(fresh) => current = fresh,
                None => return Ok(false),
            },
            Err(err) => return Err(err),
        }
    }
    Ok(false)
}

/// Releases every asset in `namespace` assigned to `cd` (the cluster is being deleted).
pub async fn release_all(api: &Api<BareMetalAsset>, cd: &str) -> Result<usize, kube::Error> {
    let assigned = api
        .list(&ListParams::default().labels(&format!("{CLUSTER_LABEL}={cd}")))
        .await?;
    let mut released = 0;
    // The label may lag the spec; the spec decides.
    let all = api.list(&ListParams::default()).await?;
    let names: BTreeSet<String> = assigned.items.iter().map(|a| a.name_any()).collect();
    for asset in all.items {
        if names.contains(&asset.name_any()) || asset.spec.assigned_cluster() == Some(cd) {
            released += usize::from(release(api, &asset, cd).await?);
        }
    }
    Ok(released)
}

/// How long ago the pool assigned `asset`, if it did.
pub fn assigned_age(asset: &BareMetalAsset, pool: &str) -> Option<Duration> {
    let annotations = asset.annotations();
    if annotations.get(ASSIGNED_BY_ANNOTATION).map(String::as_str) != Some(pool) {
        return None;
    }
    let at: Timestamp = annotations.get(ASSIGNED_AT_ANNOTATION)?.parse().ok()?;
    Duration::try_from(Timestamp::now().duration_since(at)).ok()
}

/// `platform.baremetal.hosts` of the install config: each host with its BMC (credentials from its
/// Secret when it exists) and boot MAC.
pub async fn render(
    config: &mut Value,
    chosen: &[(Arc<BareMetalAsset>, HostRole)],
    secrets: &Api<Secret>,
) -> Result<(), kube::Error> {
    let mut hosts = Vec::new();
    for (asset, role) in chosen {
        let mut bmc = json!({"address": asset.spec.bmc.address});
        if let Some(secret) = secrets.get_opt(&asset.spec.bmc.credentials_name).await? {
            let data = secret.data.unwrap_or_default();
            for key in ["username", "password"] {
                if let Some(value) = data.get(key) {
                    bmc[key] = json!(String::from_utf8_lossy(&value.0));
                }
            }
        }
        let mut host = json!({
            "name": asset.name_any(),
            "role": match role { HostRole::Master => "master", HostRole::Worker => "worker" },
            "bmc": bmc,
            "bootMACAddress": asset.spec.boot_mac_address,
        });
        if let Some(profile) = &asset.spec.hardware_profile {
            host["hardwareProfile"] = json!(profile);
        }
        hosts.push(host);
    }
    if let Some(object) = config.as_object_mut() {
        let platform = object.entry("platform").or_insert_with(|| json!({}));
        if !platform.is_object() {
            *platform = json!({});
        }
        let baremetal = platform
            .as_object_mut()
            .expect("checked above")
            .entry("baremetal")
            .or_insert_with(|| json!({}));
        if !baremetal.is_object() {
            *baremetal = json!({});
        }
        baremetal["hosts"] = json!(hosts);
    }
    Ok(())
}

/// Chooses and assigns the hosts of new cluster `cd` (§5): on a lost race (409) whatever this
/// attempt took is released and the choice is made again without the lost asset. `None` when the
/// pool lacks hosts (`round.insufficient_hosts` says why); nothing stays assigned then.
pub(super) async fn take(
    pool: &ClusterPool,
    ctx: &Ctx,
    cd: &str,
    domains: &BTreeMap<String, FailureDomainStatus>,
    usage: &BTreeMap<String, usize>,
    round: &mut Round,
) -> Result<Option<Vec<(Arc<BareMetalAsset>, HostRole)>>, PoolError> {
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let api = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &ns);
    let (masters, workers) = needed(pool);
    let mut lost: BTreeSet<String> = BTreeSet::new();
    for _ in 0..8 {
        let assets: Vec<Arc<BareMetalAsset>> = machines::pool_assets(pool, ctx)
            .into_iter()
            .filter(|a| !round.hosts_taken.contains(&a.name_any()) && !lost.contains(&a.name_any()))
            .collect();
        let chosen = match select(&assets, masters, workers, domains, usage) {
            Ok(chosen) => chosen,
            Err(message) => {
                round.insufficient_hosts = Some(message);
                return Ok(None);
            }
        };
        let mut done: Vec<BareMetalAsset> = Vec::new();
        let mut race = None;
        for (asset, _) in &chosen {
            match assign_fresh(&api, asset, cd, &name).await {
                Ok(Some(written)) => done.push(written),
                Ok(None) => {
                    race = Some(asset.name_any());
                    break;
                }
                Err(err) => {
                    undo(&api, &done, cd).await;
                    return Err(err.into());
                }
            }
        }
        match race {
            None => {
                round.hosts_taken.extend(chosen.iter().map(|(a, _)| a.name_any()));
                return Ok(Some(chosen));
            }
            Some(asset) => {
                info!(asset = %asset, "lost an asset race; choosing again");
                undo(&api, &done, cd).await;
                lost.insert(asset);
            }
        }
    }
    round.insufficient_hosts = Some("Other writers kept taking the chosen BareMetalAssets; retrying".into());
    round.soon(Duration::from_millis(500));
    Ok(None)
}

/// Assigns `asset`; a 409 from a write that did not take it (the asset controller mirroring
/// labels, say) is retried with a fresh copy while the asset is still free. `None`: taken.
async fn assign_fresh(
    api: &Api<BareMetalAsset>,
    asset: &BareMetalAsset,
    cd: &str,
    pool: &str,
) -> Result<Option<BareMetalAsset>, kube::Error> {
    let mut current = asset.clone();
    for _ in 0..4 {
        if let Some(written) = assign(api, &current, cd, pool).await? {
            return Ok(Some(written));
        }
        match api.get_opt(&asset.name_any()).await? {
            Some(fresh) if free(&fresh) => current = fresh,
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// Releases what a failed attempt assigned; a failure here is left to the repair.
async fn undo(api: &Api<BareMetalAsset>, done: &[BareMetalAsset], cd: &str) {
    for asset in done {
        if let Err(err) = release(api, asset, cd).await {
            warn!(asset = %asset.name_any(), error = %err, "cannot release an asset; the repair will");
        }
    }
}

/// §4.3.2 repair for assets: one this pool assigned to a cluster that does not exist is released
/// once the assignment is older than the minimum lease age.
pub(super) async fn repair(
    pool: &ClusterPool,
    ctx: &Ctx,
    assets: &[Arc<BareMetalAsset>],
    live: &BTreeSet<String>,
    expected: &BTreeSet<String>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let name = pool.name_any();
    let min_age = ctx.tenant.shared.settings.lease_min_age;
    let api = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    for asset in assets {
        let Some(cd) = asset.spec.assigned_cluster() else {
            continue;
        };
        if live.contains(cd) || expected.contains(cd) || round.hosts_taken.contains(&asset.name_any()) {
            continue;
        }
        let Some(age) = assigned_age(asset, &name) else {
            continue;
        };
        if age < min_age {
            round.soon(min_age - age);
            continue;
        }
        if release(&api, asset, cd).await? {
            info!(asset = %asset.name_any(), cluster = %cd, "released an asset whose cluster never appeared");
        }
    }
    Ok(())
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
