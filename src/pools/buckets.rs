//! Where each of a pool's clusters stands (DESIGN.md §4.3), decided once per reconcile as Hive's
//! `collections.go` does: every later rule decides from these buckets, never from the raw objects.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use super::{CDC_GENERATION_ANNOTATION, POOL_VERSION_ANNOTATION};
use crate::api::pools::{ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization};
use crate::runtime::conditions::is_true;

/// Where one of the pool's clusters stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bucket {
    Deleting,
    /// Claimed, and its claim is gone: delete it.
    Released,
    Claimed,
    Broken,
    Ready,
    Installing,
}

/// Why an unclaimed cluster is stale (§4.3.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stale {
    PoolVersion,
    EntryRemoved,
    EntryEdited,
}

/// The bucket of every cluster of the pool, by cluster name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Buckets(BTreeMap<String, Bucket>);

impl Buckets {
    /// Sorts `cds`; `deleted` are clusters this controller deleted that the cache still shows live.
    pub(super) fn sort(
        cds: &[Arc<ClusterDeployment>],
        claims: &BTreeMap<String, Arc<ClusterClaim>>,
        deleted: &BTreeSet<String>,
    ) -> Buckets {
        Buckets(
            cds.iter()
                .map(|cd| (cd.name_any(), bucket(cd, claims, deleted.contains(&cd.name_any()))))
                .collect(),
        )
    }

    /// The bucket of a cluster that was sorted (a member of the pool).
    pub(super) fn of(&self, cd: &ClusterDeployment) -> Bucket {
        self.0.get(&cd.name_any()).copied().unwrap_or(Bucket::Deleting)
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    pub(super) fn set(&mut self, name: &str, bucket: Bucket) {
        self.0.insert(name.to_string(), bucket);
    }

    pub(super) fn count(&self, bucket: Bucket) -> i64 {
        self.0.values().filter(|b| **b == bucket).count() as i64
    }

    /// Clusters in any of `buckets`.
    pub(super) fn count_in(&self, buckets: &[Bucket]) -> i64 {
        self.0.values().filter(|b| buckets.contains(b)).count() as i64
    }

    /// Clusters not being deleted: what counts against `maxSize`.
    pub(super) fn live(&self) -> i64 {
        self.0.values().filter(|b| **b != Bucket::Deleting).count() as i64
    }
}

fn bucket(cd: &ClusterDeployment, claims: &BTreeMap<String, Arc<ClusterClaim>>, deleted: bool) -> Bucket {
    let status = cd.status.clone().unwrap_or_default();
    if cd.metadata.deletion_timestamp.is_some() || deleted {
        return Bucket::Deleting;
    }
    if let Some(claim) = cd.spec.cluster_pool_ref.as_ref().and_then(|r| r.claim_name.as_ref()) {
        let gone = claims
            .get(claim)
            .is_none_or(|c| c.metadata.deletion_timestamp.is_some());
        return if gone { Bucket::Released } else { Bucket::Claimed };
    }
    if is_true(&status.conditions, "ProvisionStopped") {
        Bucket::Broken
    } else if status.installed {
        Bucket::Ready
    } else {
        Bucket::Installing
    }
}

/// Why `cd` is stale, if it is: built for another pool version, from an entry no longer `listed`,
/// or from an older generation of its CDC than `cdcs` shows.
pub(super) fn stale_reason(
    cd: &ClusterDeployment,
    version: &str,
    listed: &BTreeSet<&str>,
    cdcs: &BTreeMap<String, Arc<ClusterDeploymentCustomization>>,
) -> Option<Stale> {
    let annotations = cd.annotations();
    if annotations.get(POOL_VERSION_ANNOTATION).map(String::as_str) != Some(version) {
        return Some(Stale::PoolVersion);
    }
    let entry = cdc_of(cd)?;
    if !listed.contains(entry.as_str()) {
        return Some(Stale::EntryRemoved);
    }
    let generation = cdcs.get(&entry).and_then(|c| c.metadata.generation);
    let built_from = annotations
        .get(CDC_GENERATION_ANNOTATION)
        .and_then(|g| g.parse::<i64>().ok());
    (generation.is_some() && built_from.is_some() && generation != built_from).then_some(Stale::EntryEdited)
}

/// The inventory entry (CDC name) a cluster was built from.
pub(super) fn cdc_of(cd: &ClusterDeployment) -> Option<String> {
    cd.spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.cluster_deployment_customization.as_ref())
        .map(|r| r.name.clone())
}

pub(super) fn created(cd: &ClusterDeployment) -> Timestamp {
    cd.metadata.creation_timestamp.as_ref().map(|t| t.0).unwrap_or_default()
}

/// True when the cluster was stopped because its machines cannot be placed.
pub(super) fn invalid_machine_spec(cd: &ClusterDeployment) -> bool {
    cd.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "ProvisionStopped" && c.status == "True" && c.reason == "InvalidMachineSpec")
    })
}

#[cfg(test)]
pub(super) mod fixtures {
    //! Pool objects for the unit tests of the pure pool decisions.

    use std::sync::Arc;

    use serde_json::{Value, json};

    use crate::api::pools::{ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};

    pub(crate) const VERSION: &str = "v1";

    /// A pool in namespace `team` with the given spec fields over a minimal OpenStack spec.
    pub(crate) fn pool(name: &str, spec: Value) -> ClusterPool {
        let mut base = json!({"size": 0, "baseDomain": "example.com", "installerImage": "i",
                              "platform": {"openstack": {"cloud": "c", "credentialsSecretRef": {"name": "creds"}}}});
        if let (Some(base), Some(spec)) = (base.as_object_mut(), spec.as_object()) {
            base.extend(spec.clone());
        }
        serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
            "metadata": {"name": name, "namespace": "team", "uid": "pool-uid", "generation": 1},
            "spec": base,
        }))
        .expect("a valid pool")
    }

    /// A cluster of pool `p`, created at `created` (an RFC 3339 time), current with [`VERSION`].
    pub(crate) struct Cd(Value);

    impl Cd {
        pub(crate) fn new(name: &str, created: &str) -> Cd {
            Cd(json!({
                "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
                "metadata": {"name": name, "namespace": name, "uid": format!("uid-{name}"),
                             "creationTimestamp": created,
                             "annotations": {"pools.stackd.dev/pool-version": VERSION}},
                "spec": {"clusterName": name, "baseDomain": "example.com", "platform": {},
                         "clusterPoolRef": {"namespace": "team", "poolName": "p"}},
                "status": {"installed": false},
            }))
        }
        pub(crate) fn installed(mut self) -> Cd {
            self.0["status"]["installed"] = json!(true);
            self
        }
        pub(crate) fn stopped(mut self, reason: &str) -> Cd {
            self.0["status"]["conditions"] = json!([{"type": "ProvisionStopped", "status": "True", "reason": reason,
                "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z"}]);
            self
        }
        pub(crate) fn claimed_by(mut self, claim: &str) -> Cd {
            self.0["spec"]["clusterPoolRef"]["claimName"] = json!(claim);
            self
        }
        pub(crate) fn built_from(mut self, cdc: &str, generation: i64) -> Cd {
            self.0["spec"]["clusterPoolRef"]["clusterDeploymentCustomization"] = json!({"name": cdc});
            self.0["metadata"]["annotations"]["pools.stackd.dev/customization-generation"] =
                json!(generation.to_string());
            self
        }
        pub(crate) fn version(mut self, version: &str) -> Cd {
            self.0["metadata"]["annotations"]["pools.stackd.dev/pool-version"] = json!(version);
            self
        }
        pub(crate) fn deleting(mut self) -> Cd {
            self.0["metadata"]["deletionTimestamp"] = json!("2024-06-01T00:00:00Z");
            self
        }
        pub(crate) fn build(self) -> Arc<ClusterDeployment> {
            Arc::new(serde_json::from_value(self.0).expect("a valid cluster"))
        }
    }

    pub(crate) fn claim(name: &str, created: &str) -> Arc<ClusterClaim> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterClaim",
                "metadata": {"name": name, "namespace": "team", "creationTimestamp": created},
                "spec": {"clusterPoolName": "p"},
            }))
            .expect("a valid claim"),
        )
    }

    /// A CDC at generation `generation` with the given status conditions.
    pub(crate) fn cdc(name: &str, generation: i64, status: Value) -> Arc<ClusterDeploymentCustomization> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
                "metadata": {"name": name, "namespace": "team", "generation": generation},
                "spec": {"installConfigPatches": []},
                "status": status,
            }))
            .expect("a valid customization"),
        )
    }

    /// The status of a CDC leased by cluster `cd` of pool `pool`.
    pub(crate) fn leased(pool: &str, cd: &str) -> Value {
        json!({"conditions": [{"type": "Available", "status": "False", "reason": "Reserved", "message": "",
                               "lastTransitionTime": "2024-01-01T00:00:00Z"}],
               "clusterPoolRef": {"name": pool}, "clusterDeploymentRef": {"name": cd}})
    }

    /// The status of a CDC whose last verdict is `reason` (ApplySucceeded), reached at `at`.
    pub(crate) fn verdict(reason: &str, at: &str, generation: i64) -> Value {
        let ok = if reason == "Succeeded" { "True" } else { "False" };
        json!({"conditions": [{"type": "ApplySucceeded", "status": ok, "reason": reason, "message": "",
                               "lastTransitionTime": at, "observedGeneration": generation}]})
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;

    #[test]
    fn clusters_are_sorted_into_installing_ready_broken_claimed_released_and_deleting() {
        let cds = vec![
            Cd::new("installing", "2024-01-01T00:00:00Z").build(),
            Cd::new("ready", "2024-01-01T00:00:00Z").installed().build(),
            Cd::new("broken", "2024-01-01T00:00:00Z")
                .stopped("InstallAttemptsLimitReached")
                .build(),
            Cd::new("claimed", "2024-01-01T00:00:00Z")
                .installed()
                .claimed_by("c1")
                .build(),
            Cd::new("released", "2024-01-01T00:00:00Z")
                .installed()
                .claimed_by("gone")
                .build(),
            Cd::new("deleting", "2024-01-01T00:00:00Z")
                .installed()
                .deleting()
                .build(),
            Cd::new("deleted-by-us", "2024-01-01T00:00:00Z").installed().build(),
        ];
        let claims = BTreeMap::from([("c1".to_string(), claim("c1", "2024-01-01T00:00:00Z"))]);
        let buckets = Buckets::sort(&cds, &claims, &BTreeSet::from(["deleted-by-us".to_string()]));
        let got: Vec<Bucket> = cds.iter().map(|cd| buckets.of(cd)).collect();
        use Bucket::*;
        assert_eq!(got, [Installing, Ready, Broken, Claimed, Released, Deleting, Deleting]);
        assert_eq!(buckets.live(), 5);
    }

    #[test]
    fn a_claimed_cluster_whose_claim_is_deleting_is_released() {
        let cd = Cd::new("a", "2024-01-01T00:00:00Z").claimed_by("c1").build();
        let mut going = (*claim("c1", "2024-01-01T00:00:00Z")).clone();
        going.metadata.deletion_timestamp = cd.metadata.creation_timestamp.clone();
        let claims = BTreeMap::from([("c1".to_string(), Arc::new(going))]);
        let buckets = Buckets::sort(std::slice::from_ref(&cd), &claims, &BTreeSet::new());
        assert_eq!(buckets.of(&cd), Bucket::Released);
    }

    #[test]
    fn staleness_names_the_pool_version_a_removed_entry_or_an_edited_entry() {
        let listed = BTreeSet::from(["a"]);
        let cdcs = BTreeMap::from([("a".to_string(), cdc("a", 3, serde_json::json!({})))]);
        let stale = |cd: Cd| stale_reason(&cd.build(), VERSION, &listed, &cdcs);
        let cd = || Cd::new("x", "2024-01-01T00:00:00Z");
        assert_eq!(stale(cd()), None, "no inventory entry and the current version");
        assert_eq!(stale(cd().version("old")), Some(Stale::PoolVersion));
        assert_eq!(stale(cd().built_from("a", 3)), None);
        assert_eq!(stale(cd().built_from("a", 2)), Some(Stale::EntryEdited));
        assert_eq!(stale(cd().built_from("b", 3)), Some(Stale::EntryRemoved));
        assert_eq!(
            stale(cd().built_from("a", 2).version("old")),
            Some(Stale::PoolVersion),
            "the pool version is named first"
        );
    }
}
