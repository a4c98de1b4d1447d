//! Keeping a pool's leases true (DESIGN.md §4.3 items 1, 2, 6, 9). Before it acts: its finalizer on
//! the CDCs it lists or holds, leases of clusters that never appeared and interrupted leases (no
//! cluster named) released after the minimum age, lost leases of live clusters restored, CDCs of
//! installed clusters marked Succeeded. After it leased: the free CDCs of its inventory read
//! `Available=True`.
//!
//! Who makes a free CDC read `Available=True`: the pools that list it, as the seeds have the
//! ClusterPool controller keep the lease state of the customizations in its inventory ("update
//! inventory resource Available condition to true", "Periodically and on usage ClusterPool will
//! update the Status.Inventory"). A CDC that no pool lists is in nobody's inventory: stackd has no
//! business writing it (a namespace may hold any number of them, made for other purposes), and it
//! gets the condition on the first pass of a pool that lists it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::{Api, ResourceExt};
use tracing::{info, warn};

use super::buckets::cdc_of;
use super::leases::{self, SUCCEEDED};
use super::pool::{PoolError, Round};
use super::{cdc_finalizer, set_finalizers};
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};

type Cdc = ClusterDeploymentCustomization;

/// The pool whose leases are repaired, and what it sees.
pub(super) struct Scope<'a> {
    pub(super) name: &'a str,
    pub(super) ns: &'a str,
    pub(super) deleting_pool: bool,
    /// The pool's inventory entries.
    pub(super) listed: &'a BTreeSet<&'a str>,
    /// Every pool of the namespace: an interrupted lease naming one of them is that pool's to
    /// repair.
    pub(super) pools: &'a BTreeSet<String>,
    /// The pool's members.
    pub(super) cds: &'a [Arc<ClusterDeployment>],
    /// Every cluster in a namespace the pool created (a lease of one of those is never released,
    /// even when someone edited its reference away).
    pub(super) live: &'a BTreeSet<String>,
    pub(super) expected_created: &'a BTreeSet<String>,
}

/// Repairs the leases of the pool and returns the CDCs as they are now (copies written in this
/// pass are in `round.written`).
pub(super) async fn leases(
    tenant: &TenantContext,
    scope: &Scope<'_>,
    cdcs: BTreeMap<String, Arc<Cdc>>,
    round: &mut Round,
) -> Result<BTreeMap<String, Arc<Cdc>>, PoolError> {
    let pool = Pool {
        tenant,
        name: scope.name,
        api: Api::<Cdc>::namespaced(tenant.client.clone(), scope.ns),
    };
    for cdc in cdcs.values() {
        if let Some(finalizers) = finalizers_wanted(cdc, scope.name, scope.deleting_pool, scope.listed) {
            pool.set_finalizers(cdc, finalizers, round).await?;
        }
    }
    let min_age = tenant.shared.settings.lease_min_age;
    for cdc in cdcs.values() {
        match orphaned(cdc, scope, min_age) {
            Orphan::No => {}
            Orphan::Young(left) => round.soon(left),
            Orphan::Release(cd) => pool.release_orphan(&newest(cdc, round), &cd, round).await?,
            Orphan::Interrupted => pool.release_interrupted(&newest(cdc, round), min_age, round).await?,
        }
    }
    let mut relinked: BTreeMap<String, Cdc> = BTreeMap::new();
    for (cd, cdc) in scope
        .cds
        .iter()
        .filter_map(|cd| unlinked(cd, &cdcs).map(|cdc| (cd, cdc)))
    {
        if let Some(written) = pool.relink(cd, cdc, round).await? {
            relinked.insert(cdc.name_any(), written);
        }
    }
    let cdcs: BTreeMap<String, Arc<Cdc>> = cdcs
        .into_iter()
        .map(|(n, c)| match relinked.remove(&n) {
            Some(written) => (n, Arc::new(written)),
            None => (n, c),
        })
        .collect();
    for cd in scope.cds {
        if let Some(cdc) = cdc_of(cd).and_then(|n| cdcs.get(&n))
            && needs_success_mark(cd, cdc, scope.name)
        {
            pool.mark_succeeded(cd, cdc, round).await?;
        }
    }
    Ok(cdcs)
}

/// §4.3.1: the CDCs of the pool's inventory that no pool holds read `Available=True`. Run after the
/// pass's leases, so that an entry leased in this pass is written once, not made available first.
pub(super) async fn mark_free(
    tenant: &TenantContext,
    scope: &Scope<'_>,
    cdcs: &BTreeMap<String, Arc<Cdc>>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let pool = Pool {
        tenant,
        name: scope.name,
        api: Api::<Cdc>::namespaced(tenant.client.clone(), scope.ns),
    };
    let listed = scope.listed.iter().filter_map(|entry| cdcs.get(*entry));
    for cdc in listed.filter(|c| c.metadata.deletion_timestamp.is_none()) {
        pool.mark_available(&newest(cdc, round), round).await?;
    }
    Ok(())
}

/// The copy of `cdc` to write from: the one this pass wrote, else the cached one.
fn newest(cdc: &Arc<Cdc>, round: &Round) -> Arc<Cdc> {
    round
        .written
        .get(&cdc.name_any())
        .map_or_else(|| cdc.clone(), |written| Arc::new(written.clone()))
}

/// §4.3.9: our finalizer on every CDC we list; off every CDC we no longer hold and either no
/// longer list or that is being deleted (a leased CDC's deletion waits for its release). The
/// finalizers `cdc` should have, when they differ from what it has.
fn finalizers_wanted(cdc: &Cdc, name: &str, deleting_pool: bool, listed: &BTreeSet<&str>) -> Option<Vec<String>> {
    let finalizer = cdc_finalizer(name);
    let held_by_us = leases::lease_holder(cdc).is_some_and(|(p, _)| p.as_deref() == Some(name));
    let has = cdc.finalizers().contains(&finalizer);
    let deleting = cdc.metadata.deletion_timestamp.is_some();
    let want = !deleting_pool && listed.contains(cdc.name_any().as_str()) && !deleting || held_by_us;
    if has == want {
        return None;
    }
    let mut finalizers: Vec<String> = cdc.finalizers().iter().filter(|f| **f != finalizer).cloned().collect();
    if want {
        finalizers.push(finalizer);
    }
    Some(finalizers)
}

/// Whether a lease of pool `name` is for a cluster that does not exist (§4.3.2 repair).
#[derive(Debug, PartialEq, Eq)]
enum Orphan {
    /// Not our lease, or its cluster exists (or is being created).
    No,
    /// Its cluster does not exist, but the lease is younger than the minimum age (a CD created
    /// moments ago and not yet in the cache is never mistaken for a leak): look again then.
    Young(Duration),
    /// Release the lease held for this (missing) cluster.
    Release(String),
    /// Release an interrupted lease (no cluster named at all) older than the minimum age.
    Interrupted,
}

fn orphaned(cdc: &Cdc, scope: &Scope, min_age: Duration) -> Orphan {
    let Some((holder, cd)) = leases::lease_holder(cdc) else {
        return Orphan::No;
    };
    let Some(cd) = cd else {
        return interrupted(cdc, holder.as_deref(), scope, min_age);
    };
    let exists = scope.live.contains(&cd) || scope.expected_created.contains(&cd);
    if holder.as_deref() != Some(scope.name) || exists {
        return Orphan::No;
    }
    match young(cdc, min_age) {
        Some(left) => Orphan::Young(left),
        None => Orphan::Release(cd),
    }
}

/// An interrupted lease (§4.3.1) is repaired by the pool it names; one naming no pool, or a pool
/// that is gone, by the pools listing it. Whoever repairs it waits out the minimum age first, as for
/// any orphaned lease: the writer may be finishing it.
fn interrupted(cdc: &Cdc, holder: Option<&str>, scope: &Scope, min_age: Duration) -> Orphan {
    let ours = match holder {
        Some(pool) if pool == scope.name => true,
        Some(pool) if scope.pools.contains(pool) => false,
        _ => !scope.deleting_pool && scope.listed.contains(cdc.name_any().as_str()),
    };
    if !ours {
        return Orphan::No;
    }
    match young(cdc, min_age) {
        Some(left) => Orphan::Young(left),
        None => Orphan::Interrupted,
    }
}

/// How long the lease still has to go before it is older than `min_age`, if it is younger.
fn young(cdc: &Cdc, min_age: Duration) -> Option<Duration> {
    let age = leases::lease_age(cdc).unwrap_or_default();
    (age < min_age).then(|| min_age - age)
}

/// Link repair: the CDC of a live cluster that shows no lease (status lost or edited); it is
/// leased again before anyone else can, so one CDC never backs two clusters.
fn unlinked<'a>(cd: &ClusterDeployment, cdcs: &'a BTreeMap<String, Arc<Cdc>>) -> Option<&'a Arc<Cdc>> {
    if cd.metadata.deletion_timestamp.is_some() {
        return None;
    }
    cdc_of(cd)
        .and_then(|n| cdcs.get(&n))
        .filter(|cdc| leases::lease_holder(cdc).is_none())
}

/// Installed clusters mark the CDC leased for them Succeeded.
fn needs_success_mark(cd: &ClusterDeployment, cdc: &Cdc, name: &str) -> bool {
    let installed = cd.status.as_ref().is_some_and(|s| s.installed);
    let ours = leases::lease_holder(cdc) == Some((Some(name.to_string()), Some(cd.name_any())));
    installed && ours && leases::apply_reason(cdc) != Some(SUCCEEDED)
}

/// The writes of the repair, for one pool.
struct Pool<'a> {
    tenant: &'a TenantContext,
    name: &'a str,
    api: Api<Cdc>,
}

impl Pool<'_> {
    async fn set_finalizers(&self, cdc: &Cdc, finalizers: Vec<String>, round: &mut Round) -> Result<(), PoolError> {
        match set_finalizers(&self.api, cdc, finalizers).await {
            // Later writes in this pass must start from this copy, not the older cached one.
            Ok(written) => {
                round.written.insert(cdc.name_any(), written);
            }
            Err(err) if is_conflict(&err) || is_not_found(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }

    async fn release_orphan(&self, cdc: &Cdc, cd: &str, round: &mut Round) -> Result<(), PoolError> {
        let (tenant, name) = (self.tenant, self.name);
        match leases::release(&self.api, cdc, cd, name).await {
            Ok(true) => {
                info!(tenant = %tenant.name, pool = %name, cdc = %cdc.name_any(), cluster = %cd, "released a lease whose cluster does not exist");
                publish(
                    tenant,
                    cdc,
                    false,
                    "Released",
                    format!("Released: ClusterDeployment {cd} it was reserved for does not exist"),
                )
                .await;
            }
            Ok(false) => {}
            Err(err) if is_conflict(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }

    async fn release_interrupted(&self, cdc: &Cdc, min_age: Duration, round: &mut Round) -> Result<(), PoolError> {
        let (tenant, name) = (self.tenant, self.name);
        match leases::release_interrupted(&self.api, cdc).await {
            Ok(Some(written)) => {
                warn!(tenant = %tenant.name, pool = %name, cdc = %cdc.name_any(), "released an interrupted lease");
                let note = format!(
                    "Released: it read Available=False with no clusterDeploymentRef (an interrupted lease) for longer than --lease-min-age ({min_age:?}); ClusterPool {name} may lease it again"
                );
                publish(tenant, &written, true, "Released", note).await;
                round.written.insert(cdc.name_any(), written);
            }
            Ok(None) => {}
            Err(err) if is_conflict(&err) || is_not_found(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }

    /// §4.3.1: a CDC of the inventory that no pool holds reads `Available=True`.
    async fn mark_available(&self, cdc: &Cdc, round: &mut Round) -> Result<(), PoolError> {
        match leases::mark_available(&self.api, cdc).await {
            Ok(Some(written)) => {
                round.written.insert(cdc.name_any(), written);
            }
            Ok(None) => {}
            Err(err) if is_conflict(&err) || is_not_found(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }

    async fn relink(&self, cd: &ClusterDeployment, cdc: &Cdc, round: &mut Round) -> Result<Option<Cdc>, PoolError> {
        let (tenant, name) = (self.tenant, self.name);
        match leases::lease(&self.api, cdc, &cd.name_any(), name).await {
            Ok(Some(written)) => {
                warn!(tenant = %tenant.name, pool = %name, cdc = %cdc.name_any(), cluster = %cd.name_any(), "restored the lease of a live cluster");
                publish(
                    tenant,
                    &written,
                    true,
                    "LeaseRestored",
                    format!(
                        "ClusterDeployment {} still uses this customization; its lease was restored",
                        cd.name_any()
                    ),
                )
                .await;
                Ok(Some(written))
            }
            Ok(None) => Ok(None),
            Err(err) if is_conflict(&err) => {
                round.soon(Duration::from_millis(200));
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }

    async fn mark_succeeded(&self, cd: &ClusterDeployment, cdc: &Cdc, round: &mut Round) -> Result<(), PoolError> {
        let message = format!("Patches applied and cluster {} installed successfully", cd.name_any());
        match leases::set_apply_result(&self.api, cdc, SUCCEEDED, message).await {
            Ok(Some(written)) => {
                round.written.insert(cdc.name_any(), written);
            }
            Ok(None) => {}
            Err(err) if is_conflict(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pools::buckets::fixtures::{Cd, cdc, leased, verdict};

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_pool_puts_its_finalizer_on_every_cdc_it_lists_and_takes_it_off_when_done() {
        let listed = BTreeSet::from(["a"]);
        let free = cdc("a", 1, serde_json::json!({}));
        assert_eq!(
            finalizers_wanted(&free, "p", false, &listed),
            Some(vec!["pools.stackd.dev/p".to_string()])
        );
        let mut with = (*free).clone();
        with.metadata.finalizers = Some(vec!["other".into(), "pools.stackd.dev/p".into()]);
        assert_eq!(finalizers_wanted(&with, "p", false, &listed), None, "already there");
        assert_eq!(
            finalizers_wanted(&with, "p", true, &listed),
            Some(vec!["other".to_string()]),
            "a deleted pool strips its finalizer"
        );
        assert_eq!(
            finalizers_wanted(&with, "p", false, &BTreeSet::new()),
            Some(vec!["other".to_string()]),
            "an entry removed from the inventory loses it"
        );
    }

    #[test]
    fn a_leased_cdc_keeps_the_finalizer_of_its_holder_while_it_is_deleted() {
        let mut held = (*cdc("a", 1, leased("p", "p-1"))).clone();
        held.metadata.finalizers = Some(vec!["pools.stackd.dev/p".into()]);
        held.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::UNIX_EPOCH,
        ));
        assert_eq!(finalizers_wanted(&held, "p", false, &BTreeSet::from(["a"])), None);
        assert_eq!(finalizers_wanted(&held, "p", true, &BTreeSet::new()), None);
        let mut released = held.clone();
        released.status = None;
        assert_eq!(
            finalizers_wanted(&released, "p", false, &BTreeSet::from(["a"])),
            Some(vec![])
        );
    }

    /// What pool `p` of namespace `team` (pools `p` and `q` there) sees, listing `listed`.
    struct World {
        listed: BTreeSet<&'static str>,
        pools: BTreeSet<String>,
        live: BTreeSet<String>,
        expected: BTreeSet<String>,
        deleting_pool: bool,
    }

    impl World {
        fn new(listed: &[&'static str]) -> World {
            World {
                listed: listed.iter().copied().collect(),
                pools: names(&["p", "q"]),
                live: BTreeSet::new(),
                expected: BTreeSet::new(),
                deleting_pool: false,
            }
        }

        fn orphaned(&self, cdc: &Cdc, min_age: Duration) -> Orphan {
            let scope = Scope {
                name: "p",
                ns: "team",
                deleting_pool: self.deleting_pool,
                listed: &self.listed,
                pools: &self.pools,
                cds: &[],
                live: &self.live,
                expected_created: &self.expected,
            };
            orphaned(cdc, &scope, min_age)
        }
    }

    #[test]
    fn a_lease_whose_cluster_is_missing_is_released_only_after_the_minimum_age() {
        let lease = cdc("a", 1, leased("p", "p-1"));
        let min_age = Duration::from_secs(300);
        let mut world = World::new(&["a"]);
        assert_eq!(
            world.orphaned(&lease, min_age),
            Orphan::Release("p-1".into()),
            "held since 2024"
        );
        let forever = Duration::from_secs(1 << 40);
        assert!(matches!(world.orphaned(&lease, forever), Orphan::Young(_)));
        world.expected = names(&["p-1"]);
        assert_eq!(
            world.orphaned(&lease, min_age),
            Orphan::No,
            "created moments ago by this controller"
        );
        world.expected.clear();
        world.live = names(&["p-1"]);
        assert_eq!(world.orphaned(&lease, min_age), Orphan::No);
    }

    #[test]
    fn a_lease_held_by_another_pool_is_never_repaired() {
        let theirs = cdc("a", 1, leased("q", "q-1"));
        assert_eq!(World::new(&["a"]).orphaned(&theirs, Duration::ZERO), Orphan::No);
        let cd = Cd::new("p-1", "2024-01-01T00:00:00Z").built_from("a", 1).build();
        let cdcs = BTreeMap::from([("a".to_string(), theirs)]);
        assert!(unlinked(&cd, &cdcs).is_none(), "leased: not relinked");
    }

    /// `Available=False` since 2024 without a `clusterDeploymentRef`, naming `pool` if any.
    fn interrupted_by(pool: Option<&str>) -> Arc<Cdc> {
        let mut status = leased(pool.unwrap_or_default(), "");
        let refs = status.as_object_mut().expect("a status");
        refs.remove("clusterDeploymentRef");
        if pool.is_none() {
            refs.remove("clusterPoolRef");
        }
        cdc("a", 1, status)
    }

    #[test]
    fn an_interrupted_lease_is_released_after_the_minimum_age_by_the_pool_it_names_or_one_listing_it() {
        let min_age = Duration::from_secs(300);
        let world = World::new(&["a"]);
        for cdc in [
            interrupted_by(None),
            interrupted_by(Some("p")),
            interrupted_by(Some("gone")),
        ] {
            assert!(leases::interrupted(&cdc));
            assert_eq!(world.orphaned(&cdc, min_age), Orphan::Interrupted, "{:?}", cdc.status);
            let forever = Duration::from_secs(1 << 40);
            assert!(matches!(world.orphaned(&cdc, forever), Orphan::Young(_)));
        }
        assert_eq!(
            world.orphaned(&interrupted_by(Some("q")), min_age),
            Orphan::No,
            "pool q repairs its own"
        );
        let not_listed = World::new(&[]);
        assert_eq!(not_listed.orphaned(&interrupted_by(None), min_age), Orphan::No);
        assert_eq!(
            not_listed.orphaned(&interrupted_by(Some("p")), min_age),
            Orphan::Interrupted,
            "named: ours even when no longer listed"
        );
        let mut deleting = World::new(&["a"]);
        deleting.deleting_pool = true;
        assert_eq!(deleting.orphaned(&interrupted_by(None), min_age), Orphan::No);
    }

    #[test]
    fn a_live_cluster_whose_cdc_lost_its_lease_leases_it_again() {
        let cdcs = BTreeMap::from([("a".to_string(), cdc("a", 1, serde_json::json!({})))]);
        let cd = Cd::new("p-1", "2024-01-01T00:00:00Z").built_from("a", 1);
        assert!(unlinked(&cd.build(), &cdcs).is_some());
        let deleting = Cd::new("p-1", "2024-01-01T00:00:00Z").built_from("a", 1).deleting();
        assert!(unlinked(&deleting.build(), &cdcs).is_none());
    }

    #[test]
    fn an_installed_cluster_marks_its_own_cdc_succeeded_once() {
        let cd = Cd::new("p-1", "2024-01-01T00:00:00Z")
            .built_from("a", 1)
            .installed()
            .build();
        let ours = cdc("a", 1, leased("p", "p-1"));
        assert!(needs_success_mark(&cd, &ours, "p"));
        let installing = Cd::new("p-1", "2024-01-01T00:00:00Z").built_from("a", 1).build();
        assert!(!needs_success_mark(&installing, &ours, "p"));
        assert!(!needs_success_mark(&cd, &cdc("a", 1, leased("p", "p-2")), "p"));
        let mut status = leased("p", "p-1");
        status["conditions"].as_array_mut().expect("a list").extend(
            verdict("Succeeded", "2024-01-01T00:00:00Z", 1)["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        );
        assert!(!needs_success_mark(&cd, &cdc("a", 1, status), "p"), "already marked");
    }
}
