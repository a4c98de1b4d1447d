//! What a pool does in one reconcile (DESIGN.md §4.3 items 3, 5, 7, 8, 9, 10), decided without any
//! request from the buckets of its clusters: which clusters go and why, how many are added and
//! from which inventory entries in which order, the one stale replacement, and what the status says
//! about capacity. `execute` carries the plan out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;

use super::buckets::{Bucket, Buckets, Stale, cdc_of, created, invalid_machine_spec, stale_reason};
use super::host_selection as hosts;
use super::judgement;
use super::lease_state as leases;
use super::pass::Fresh;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, ClusterPoolStatus};
use crate::runtime::backoff::Backoff;

type Cdc = ClusterDeploymentCustomization;

/// What the plan is made from: the pool, and what the caches showed once the leases were repaired
/// and the claims assigned.
pub(super) struct Inputs<'a> {
    pub(super) pool: &'a ClusterPool,
    pub(super) version: &'a str,
    /// The pool's inventory entries, each once, in spec order.
    pub(super) inventory: &'a [String],
    /// The pool's clusters (members only, §8).
    pub(super) cds: &'a [Arc<ClusterDeployment>],
    /// Clusters this controller created that the cache does not show yet.
    pub(super) expected_created: &'a BTreeSet<String>,
    /// The CDCs of the pool's namespace after the lease repair.
    pub(super) cdcs: &'a BTreeMap<String, Arc<Cdc>>,
    /// Copies of CDCs written this pass, newer than `cdcs`.
    pub(super) fresh: &'a Fresh,
    /// The pool's status as last known (the entries' `attempts`).
    pub(super) previous: &'a ClusterPoolStatus,
    /// How long a broken entry waits before it is leased again, growing with its attempts.
    pub(super) backoff: Backoff,
    /// The BareMetalAssets the pool selects.
    pub(super) assets: &'a [Arc<BareMetalAsset>],
    /// Claims still waiting for a cluster: each grows the pool by one.
    pub(super) pending_claims: i64,
    /// The pool's failure domains contradict themselves (§6 merge rules): it adds no cluster.
    pub(super) contradiction: bool,
    /// Clusters the pools of the pool's namespace may still make (`--namespace-max-clusters`).
    pub(super) namespace_room: i64,
}

/// Why the plan deletes a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Why {
    /// Its claim was deleted (§4.3.10).
    ClaimDeleted,
    /// Its install failed `installAttemptsLimit` times (§4.3.7). `mark` is the CDC leased for it,
    /// marked BrokenByCloud before the cluster is deleted.
    Broken { mark: Option<String> },
    /// It was stopped because its machines cannot be placed (`InvalidMachineSpec`): it would never
    /// install, so it does not keep its inventory entry; not the entry's fault (no mark).
    InvalidMachineSpec,
    /// The pool has more unclaimed clusters than it needs.
    Excess,
    /// Built from an older configuration (§4.3.8).
    Stale(Stale),
}

impl Why {
    /// The reason written to the log.
    pub(super) fn logged(&self) -> &'static str {
        match self {
            Why::ClaimDeleted => "its claim was deleted",
            Why::Broken { .. } => "its install failed installAttemptsLimit times",
            Why::InvalidMachineSpec => "its machines cannot be placed",
            Why::Excess => "excess",
            Why::Stale(_) => "stale",
        }
    }

    /// The Event on the pool: reason, whether it is a warning, and its note.
    pub(super) fn event(&self, cd: &str) -> (&'static str, bool, String) {
        match self {
            Why::ClaimDeleted | Why::Broken { .. } => (
                "ClusterDeleted",
                matches!(self, Why::Broken { .. }),
                format!("Deleted ClusterDeployment {cd}: {}", self.logged()),
            ),
            Why::InvalidMachineSpec => (
                "ClusterDeleted",
                true,
                format!(
                    "Deleted ClusterDeployment {cd}: it was stopped because its machines cannot be placed (InvalidMachineSpec) and would never install; its inventory entry is released after its deprovision"
                ),
            ),
            Why::Excess => (
                "ClusterDeleted",
                false,
                format!("Deleted ClusterDeployment {cd}: the pool has more clusters than it needs"),
            ),
            Why::Stale(stale) => {
                let reason = match stale {
                    Stale::PoolVersion => "the pool's configuration changed",
                    Stale::EntryRemoved => "its inventory entry was removed",
                    Stale::EntryEdited => "its ClusterDeploymentCustomization was edited",
                };
                (
                    "StaleClusterReplaced",
                    false,
                    format!("Deleted ClusterDeployment {cd}: {reason}; a current one replaces it"),
                )
            }
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Delete {
    pub(super) cd: Arc<ClusterDeployment>,
    pub(super) why: Why,
}

/// Clusters to add, and the inventory entries to try leasing for them, best first (§4.3.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Add {
    pub(super) count: i64,
    pub(super) leases: Vec<String>,
}

/// The figures of §4.3.5 the status reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Capacity {
    /// Unclaimed clusters wanted: `size` plus pending claims.
    pub(super) wanted: i64,
    /// Unclaimed clusters the inventory can back once deletions finish.
    pub(super) backed: i64,
    /// Clusters counting against `maxSize`, claimed or not, including ones being created.
    pub(super) live: i64,
    /// Unclaimed clusters the pool aims for: `wanted`, capped by the free inventory.
    pub(super) target: i64,
    /// Unclaimed clusters (and ones being created) minus `target`.
    pub(super) drift: i64,
    /// Clusters installing, including ones being created.
    pub(super) installing: i64,
    /// Installs and deletions `maxConcurrent` still allows after the deletions planned.
    pub(super) room: i64,
    /// Clusters the pools of the pool's namespace may still make (`--namespace-max-clusters`).
    pub(super) namespace_room: i64,
}

/// What one reconcile does.
#[derive(Clone, Debug)]
pub(super) struct Plan {
    /// In order: clusters whose claim was deleted, broken ones, then excess or one stale cluster.
    pub(super) deletes: Vec<Delete>,
    pub(super) add: Option<Add>,
    /// Entries whose `attempts` grow by one: a cluster built from them broke.
    pub(super) broken_entries: BTreeSet<String>,
    /// Every stale unclaimed cluster, for `AllClustersCurrent` (only one is replaced at a time).
    pub(super) stale: Vec<(Arc<ClusterDeployment>, Stale)>,
    pub(super) capacity: Capacity,
    /// Why the free BareMetalAssets cannot back the clusters to add.
    pub(super) insufficient_hosts: Option<String>,
    /// When the backoff of the first broken entry ends: the pool looks again then.
    pub(super) wake: Option<Duration>,
}

/// What earlier plans of this pass did: a plan is made again when a broken cluster's BrokenByCloud
/// mark loses a race, from the buckets as the deletions done so far left them.
#[derive(Clone, Debug, Default)]
pub(super) struct Progress {
    /// Broken clusters whose mark lost a race: they stay for the next pass.
    pub(super) kept: BTreeSet<String>,
    /// Clusters deleted so far (their claim was deleted, or they broke).
    pub(super) removed: usize,
    /// Entries whose attempts grew so far.
    pub(super) broken_entries: BTreeSet<String>,
}

impl Progress {
    /// Notes what executing `plan` did before the mark of broken cluster `kept` lost its race:
    /// the clusters in `deleted` are gone, and only their entries' attempts grow (the kept
    /// cluster's grow in the pass that deletes it).
    pub(super) fn record(&mut self, plan: &Plan, deleted: &[String], kept: String) {
        let broken_gone = plan
            .deletes
            .iter()
            .filter(|d| matches!(d.why, Why::Broken { .. }) && deleted.contains(&d.cd.name_any()));
        self.broken_entries.extend(broken_gone.filter_map(|d| cdc_of(&d.cd)));
        self.kept.insert(kept);
        self.removed = deleted.len();
    }
}

/// The plan for the pool's clusters as `buckets` sort them.
pub(super) fn plan(inputs: &Inputs, buckets: &Buckets, progress: &Progress) -> Plan {
    let spec = &inputs.pool.spec;
    let pending_created = inputs.expected_created.iter().filter(|c| !buckets.contains(c)).count() as i64;
    let installing = buckets.count(Bucket::Installing) + pending_created;
    let mut room = spec.max_concurrent.map_or(i64::MAX, |m| {
        i64::from(m) - installing - buckets.count(Bucket::Deleting)
    });
    let mut after = buckets.clone();
    let (mut deletes, mut broken_entries) = removals(inputs, &mut after, &mut room, &progress.kept);
    broken_entries.extend(progress.broken_entries.iter().cloned());
    let ranking = rank_entries(inputs, &broken_entries);
    let capacity = capacity(inputs, &after, &ranking, pending_created, installing, room);
    let unclaimed = unclaimed(inputs.cds, &after);
    let listed: BTreeSet<&str> = inputs.inventory.iter().map(String::as_str).collect();
    let stale: Vec<(Arc<ClusterDeployment>, Stale)> = unclaimed
        .iter()
        .filter_map(|cd| stale_reason(cd, inputs.version, &listed, inputs.cdcs).map(|why| ((*cd).clone(), why)))
        .collect();
    let mut plan = Plan {
        deletes: Vec::new(),
        add: None,
        broken_entries,
        stale,
        capacity,
        insufficient_hosts: None,
        wake: ranking.wake,
    };
    let steady = progress.removed == 0 && deletes.is_empty();
    if capacity.drift < 0 && inputs.contradiction {
        // While the failure domains contradict themselves every new cluster would be stopped.
    } else if capacity.drift < 0 {
        (plan.add, plan.insufficient_hosts) = additions(inputs, &capacity, ranking.free);
    } else if capacity.drift > 0 && room > 0 {
        deletes.extend(excess(&unclaimed, &after, capacity.drift.min(room)));
    } else if capacity.drift == 0 && installing == 0 && room > 0 && steady {
        // One stale cluster at a time, and only while the pool is otherwise steady (§4.3.8).
        let mut oldest = plan.stale.clone();
        oldest.sort_by_key(|(cd, _)| created(cd));
        if let Some((cd, why)) = oldest.into_iter().next() {
            deletes.push(Delete {
                cd,
                why: Why::Stale(why),
            });
        }
    }
    plan.deletes = deletes;
    plan
}

/// Clusters whose claim was deleted, then broken ones, oldest first, while `room` lasts; they
/// move to `Deleting` in `buckets`. Returns them and the entries whose attempts grow.
fn removals(
    inputs: &Inputs,
    buckets: &mut Buckets,
    room: &mut i64,
    kept: &BTreeSet<String>,
) -> (Vec<Delete>, BTreeSet<String>) {
    let name = inputs.pool.name_any();
    let mut deletes = Vec::new();
    let mut broken_entries = BTreeSet::new();
    for wanted in [Bucket::Released, Bucket::Broken] {
        let mut victims: Vec<&Arc<ClusterDeployment>> =
            inputs.cds.iter().filter(|cd| buckets.of(cd) == wanted).collect();
        victims.sort_by_key(|cd| created(cd));
        for cd in victims {
            if *room <= 0 {
                break;
            }
            if kept.contains(&cd.name_any()) {
                continue;
            }
            let why = if wanted == Bucket::Broken && invalid_machine_spec(cd) {
                Why::InvalidMachineSpec
            } else if wanted == Bucket::Broken {
                let entry = cdc_of(cd);
                broken_entries.extend(entry.clone());
                let holder = Some((Some(name.clone()), Some(cd.name_any())));
                let mark = entry.filter(|e| inputs.cdcs.get(e).is_some_and(|c| leases::lease_holder(c) == holder));
                Why::Broken { mark }
            } else {
                Why::ClaimDeleted
            };
            buckets.set(&cd.name_any(), Bucket::Deleting);
            deletes.push(Delete { cd: cd.clone(), why });
            *room -= 1;
        }
    }
    (deletes, broken_entries)
}

/// The inventory entries that could back an unclaimed cluster (`backing`) and those free to lease
/// now, best first.
#[derive(Default)]
struct Ranking {
    backing: i64,
    free: Vec<String>,
    wake: Option<Duration>,
}

/// §4.3.3: an entry counts when it backs a cluster as [`judgement::of`] judges it (as the status
/// reports it); it is free when the pool may lease it and no backoff keeps it.
fn rank_entries(inputs: &Inputs, broken_entries: &BTreeSet<String>) -> Ranking {
    let mut ranking = Ranking::default();
    if inputs.pool.spec.inventory.is_none() {
        return ranking;
    }
    let name = inputs.pool.name_any();
    let mut free: Vec<(leases::Rank, String)> = Vec::new();
    for entry in inputs.inventory {
        let cdc = inputs.fresh.get(entry).or_else(|| inputs.cdcs.get(entry).map(|c| &**c));
        let judged = judgement::of(cdc, &name);
        if !judged.backs_a_cluster() {
            continue;
        }
        ranking.backing += 1;
        let Some(cdc) = cdc.filter(|_| judged.leasable()) else {
            continue;
        };
        let attempts = attempts(inputs.previous, entry) + i32::from(broken_entries.contains(entry));
        let wait = entry_backoff(inputs.backoff, attempts);
        match leases::rank(cdc, || wait) {
            Some(rank) => free.push((rank, entry.clone())),
            None => {
                let since = leases::apply_since(cdc).unwrap_or_default();
                let left = wait.saturating_sub(since);
                ranking.wake = Some(ranking.wake.map_or(left, |w| w.min(left)));
            }
        }
    }
    free.sort();
    ranking.free = free.into_iter().map(|(_, entry)| entry).collect();
    ranking
}

fn attempts(previous: &ClusterPoolStatus, entry: &str) -> i32 {
    previous
        .inventory
        .iter()
        .find(|e| e.name == entry)
        .map_or(0, |e| e.attempts)
}

/// How long an entry that broke `attempts` times waits before it is leased again.
pub(super) fn entry_backoff(backoff: Backoff, attempts: i32) -> Duration {
    backoff
        .base
        .saturating_mul(1u32 << attempts.clamp(0, 16) as u32)
        .min(backoff.max)
}

/// §4.3.5: drift is measured against `min(size + pending claims, leasable inventory)`.
fn capacity(
    inputs: &Inputs,
    buckets: &Buckets,
    ranking: &Ranking,
    pending_created: i64,
    installing: i64,
    room: i64,
) -> Capacity {
    let spec = &inputs.pool.spec;
    let listed: BTreeSet<&str> = inputs.inventory.iter().map(String::as_str).collect();
    let holding = |these: &[Bucket]| {
        inputs
            .cds
            .iter()
            .filter(|cd| these.contains(&buckets.of(cd)))
            .filter(|cd| cdc_of(cd).is_some_and(|e| listed.contains(e.as_str())))
            .count() as i64
    };
    // Entries held by clusters that are claimed or going away are not available to unclaimed ones.
    let held_elsewhere = holding(&[Bucket::Claimed, Bucket::Released, Bucket::Deleting]);
    let held_by_claims = holding(&[Bucket::Claimed]);
    let wanted = i64::from(spec.size) + inputs.pending_claims;
    let target = if spec.inventory.is_some() {
        wanted.min((ranking.backing - held_elsewhere).max(0))
    } else {
        wanted
    };
    let unclaimed = unclaimed(inputs.cds, buckets).len() as i64;
    Capacity {
        wanted,
        backed: (ranking.backing - held_by_claims).max(0),
        live: buckets.live() + pending_created,
        target,
        drift: unclaimed + pending_created - target,
        installing,
        room,
        namespace_room: inputs.namespace_room.saturating_sub(pending_created),
    }
}

fn unclaimed<'a>(cds: &'a [Arc<ClusterDeployment>], buckets: &Buckets) -> Vec<&'a Arc<ClusterDeployment>> {
    cds.iter()
        .filter(|cd| matches!(buckets.of(cd), Bucket::Installing | Bucket::Ready | Bucket::Broken))
        .collect()
}

/// How many clusters to add within `maxSize`, `maxConcurrent` and, on bare metal, the free hosts;
/// with the reason when the hosts fall short.
fn additions(inputs: &Inputs, capacity: &Capacity, leases: Vec<String>) -> (Option<Add>, Option<String>) {
    let pool = inputs.pool;
    let missing = -capacity.drift;
    let size_room = pool.spec.max_size.map_or(i64::MAX, |m| i64::from(m) - capacity.live);
    let mut count = missing.min(size_room).min(capacity.room).min(capacity.namespace_room);
    let mut insufficient = None;
    if pool.spec.platform.baremetal.is_some() {
        // Capacity on bare metal: only as many clusters as the free assets can back.
        let hosts = hosts::capacity(pool, inputs.assets);
        let backable = hosts.clusters.min(i64::MAX as usize) as i64;
        if backable < count {
            let (masters, workers) = hosts::needed(pool);
            insufficient = Some(format!(
                "The pool needs {missing} more clusters; its free BareMetalAssets back {backable}, and a cluster needs {masters} control-plane and {workers} worker hosts where the rest can fill only {} and {} (control-plane hosts have role master or none, workers role worker or none); add assets matching spec.hostSelector or lower spec.size",
                hosts.next_masters, hosts.next_workers
            ));
            count = backable;
        }
    }
    let add = (count > 0).then_some(Add { count, leases });
    (add, insufficient)
}

/// Excess unclaimed clusters: installing ones (newest first), then ready ones (newest first).
fn excess(unclaimed: &[&Arc<ClusterDeployment>], buckets: &Buckets, count: i64) -> Vec<Delete> {
    let mut excess: Vec<&Arc<ClusterDeployment>> = unclaimed.to_vec();
    excess.sort_by_key(|cd| (buckets.of(cd) != Bucket::Installing, std::cmp::Reverse(created(cd))));
    excess
        .into_iter()
        .take(count.max(0) as usize)
        .map(|cd| Delete {
            cd: cd.clone(),
            why: Why::Excess,
        })
        .collect()
}

/// §4.3.9 pool deletion: the unclaimed clusters (and released ones) to delete now, within
/// `maxConcurrent`; deleting an installing cluster frees an installing slot as it takes a deleting
/// one, so it is not limited.
pub(super) fn deletions_of_deleted_pool(
    pool: &ClusterPool,
    cds: &[Arc<ClusterDeployment>],
    buckets: &Buckets,
) -> Vec<Arc<ClusterDeployment>> {
    let busy = buckets.count_in(&[Bucket::Installing, Bucket::Deleting]);
    let mut room = pool.spec.max_concurrent.map_or(i64::MAX, |m| i64::from(m) - busy);
    let mut deletes = Vec::new();
    for cd in cds {
        let bucket = buckets.of(cd);
        if !matches!(
            bucket,
            Bucket::Installing | Bucket::Ready | Bucket::Broken | Bucket::Released
        ) {
            continue;
        }
        if bucket != Bucket::Installing {
            if room <= 0 {
                continue;
            }
            room -= 1;
        }
        deletes.push(cd.clone());
    }
    deletes
}

#[cfg(test)]
mod tests;
