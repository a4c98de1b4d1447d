//! The shard map (which replica serves each tenant) and the coordinator's plan that balances it:
//! pure functions, the same in every replica.
//!
//! An entry names the *epoch* of its owner, a replica's identity with the uid of its member Lease,
//! so that a replica whose Lease was taken from it (it was cut off, and the others gave its tenants
//! away) never serves by an entry of its earlier life. Entries change owner in two ways only:
//! the owner hands a tenant over after it stopped it (the plan asked for it with `moving`), or the
//! coordinator gives away the tenants of an epoch known to be gone.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The most bytes the map may take in its ConfigMap, under kube-apiserver's 1 MiB for an object:
/// about 13,000 tenants with names of 63 characters, more with shorter ones. Tenants past it are
/// served by no replica, and said so (`stackd_shard_unserved_tenants`, `/readyz?verbose`).
pub const MAX_MAP_BYTES: usize = 900 * 1024;

/// One life of a replica: its identity and the uid of its member Lease.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch {
    pub id: String,
    pub uid: String,
}

/// A handover the plan asks of an entry's owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Move {
    /// Stop the tenant, then make this epoch its owner.
    To(Epoch),
    /// Stop the tenant, then remove the entry (the tenant is gone).
    Drop,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub owner: Epoch,
    pub moving: Option<Move>,
}

impl Entry {
    fn owned_by(owner: &Epoch) -> Entry {
        Entry {
            owner: owner.clone(),
            moving: None,
        }
    }

    /// Where the tenant is, or is going: the epoch it counts for in the balance.
    fn destination(&self) -> Option<&Epoch> {
        match &self.moving {
            None => Some(&self.owner),
            Some(Move::To(to)) => Some(to),
            Some(Move::Drop) => None,
        }
    }
}

/// Tenant name to entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardMap {
    pub tenants: BTreeMap<String, Entry>,
}

/// The map as stored: owners by their index in `members`, so that each tenant costs its name and a
/// few bytes.
#[derive(Default, Serialize, Deserialize)]
struct Stored {
    #[serde(default)]
    members: Vec<(String, String)>,
    #[serde(default)]
    tenants: BTreeMap<String, usize>,
    /// Index of the epoch a tenant moves to; `null`: it is dropped.
    #[serde(default)]
    moving: BTreeMap<String, Option<usize>>,
}

impl ShardMap {
    pub fn to_json(&self) -> String {
        let mut members: Vec<(String, String)> = Vec::new();
        let mut index = BTreeMap::<Epoch, usize>::new();
        let mut index_of = |epoch: &Epoch, members: &mut Vec<(String, String)>| -> usize {
            *index.entry(epoch.clone()).or_insert_with(|| {
                members.push((epoch.id.clone(), epoch.uid.clone()));
                members.len() - 1
            })
        };
        let mut stored = Stored::default();
        for (tenant, entry) in &self.tenants {
            stored
                .tenants
                .insert(tenant.clone(), index_of(&entry.owner, &mut members));
            match &entry.moving {
                None => {}
                Some(Move::Drop) => {
                    stored.moving.insert(tenant.clone(), None);
                }
                Some(Move::To(to)) => {
                    let to = index_of(to, &mut members);
                    stored.moving.insert(tenant.clone(), Some(to));
                }
            }
        }
        stored.members = members;
        serde_json::to_string(&stored).unwrap_or_default()
    }

    /// The map from its stored text; an error says what is wrong (it is never guessed at: a map
    /// that cannot be read serves nobody until fixed).
    pub fn from_json(text: &str) -> Result<ShardMap, String> {
        if text.len() > MAX_MAP_BYTES * 2 {
            return Err(format!("it is {} bytes", text.len()));
        }
        let stored: Stored = serde_json::from_str(text).map_err(|err| err.to_string())?;
        let epoch = |index: usize| {
            stored
                .members
                .get(index)
                .map(|(id, uid)| Epoch {
                    id: id.clone(),
                    uid: uid.clone(),
                })
                .ok_or_else(|| format!("member index {index} is out of range"))
        };
        let mut map = ShardMap::default();
        for (tenant, owner) in &stored.tenants {
            let moving = match stored.moving.get(tenant) {
                None => None,
                Some(None) => Some(Move::Drop),
                Some(Some(to)) => Some(Move::To(epoch(*to)?)),
            };
            map.tenants.insert(
                tenant.clone(),
                Entry {
                    owner: epoch(*owner)?,
                    moving,
                },
            );
        }
        Ok(map)
    }

    /// The tenants `epoch` owns, and of those the ones it is asked to hand over.
    pub fn owned_by(&self, epoch: &Epoch) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut owned = BTreeSet::new();
        let mut moving = BTreeSet::new();
        for (tenant, entry) in &self.tenants {
            if entry.owner == *epoch {
                owned.insert(tenant.clone());
                if entry.moving.is_some() {
                    moving.insert(tenant.clone());
                }
            }
        }
        (owned, moving)
    }

    /// The owner's part of a handover: the tenants given (stopped by it) go to where they were
    /// moving, or out of the map.
    pub fn hand_over(&mut self, owner: &Epoch, tenants: &BTreeSet<String>) {
        for tenant in tenants {
            let Some(entry) = self.tenants.get(tenant) else {
                continue;
            };
            if entry.owner != *owner {
                continue;
            }
            match entry.moving.clone() {
                None => {}
                Some(Move::Drop) => {
                    self.tenants.remove(tenant);
                }
                Some(Move::To(to)) => {
                    self.tenants.insert(tenant.clone(), Entry::owned_by(&to));
                }
            }
        }
    }

    /// Tenants of `known` that no live epoch owns (nobody serves them now).
    pub fn unserved(&self, live: &[Epoch], known: &BTreeSet<String>) -> usize {
        known
            .iter()
            .filter(|tenant| {
                self.tenants
                    .get(*tenant)
                    .is_none_or(|entry| !live.contains(&entry.owner))
            })
            .count()
    }

    /// Owners named by the map that are neither live nor known gone: their Leases must be looked at.
    pub fn suspects(&self, live: &[Epoch], dead: &BTreeSet<Epoch>) -> BTreeSet<Epoch> {
        self.tenants
            .values()
            .map(|entry| &entry.owner)
            .filter(|owner| !live.contains(owner) && !dead.contains(*owner))
            .cloned()
            .collect()
    }
}

/// The map the coordinator wants, from the `current` one: each of the `live` epochs gets
/// ⌊N/R⌋ or ⌈N/R⌉ of the N tenants it may place (`tenants`, less those of owners not known to be
/// alive or gone, which stay where they are), moving no more tenants than that needs: new tenants
/// and those of `dead` epochs are placed at once; a replica over its share is asked to hand the
/// surplus over. The tenants it keeps are those it has; the ones it gives are the last by name.
pub fn plan(current: &ShardMap, live: &[Epoch], dead: &BTreeSet<Epoch>, tenants: &BTreeSet<String>) -> ShardMap {
    let mut next = ShardMap::default();
    let is_live = |epoch: &Epoch| live.contains(epoch);
    let mut unplaced: Vec<String> = Vec::new();
    let mut stuck = 0usize;
    for (tenant, entry) in &current.tenants {
        let known = tenants.contains(tenant);
        if dead.contains(&entry.owner) {
            if known {
                unplaced.push(tenant.clone());
            }
            continue;
        }
        if !is_live(&entry.owner) {
            // Maybe alive and serving: only its owner or the proof that it is gone may move it.
            next.tenants.insert(tenant.clone(), entry.clone());
            stuck += usize::from(known);
            continue;
        }
        let moving = match &entry.moving {
            _ if !known => Some(Move::Drop),
            Some(Move::To(to)) if is_live(to) => Some(Move::To(to.clone())),
            // A move to a replica gone, or a drop of a tenant that came back: stays put.
            _ => None,
        };
        next.tenants.insert(
            tenant.clone(),
            Entry {
                owner: entry.owner.clone(),
                moving,
            },
        );
    }
    unplaced.extend(tenants.iter().filter(|t| !current.tenants.contains_key(*t)).cloned());
    unplaced.sort();
    if live.is_empty() {
        return next;
    }

    // Shares: the placeable tenants split evenly; those already holding more get the larger ones.
    let placeable = tenants.len().saturating_sub(stuck);
    let mut count: BTreeMap<&Epoch, usize> = live.iter().map(|epoch| (epoch, 0)).collect();
    for entry in next.tenants.values() {
        if let Some(destination) = entry.destination()
            && let Some(n) = count.get_mut(destination)
        {
            *n += 1;
        }
    }
    let mut ranked: Vec<&Epoch> = live.iter().collect();
    ranked.sort_by(|a, b| count[b].cmp(&count[a]).then_with(|| a.id.cmp(&b.id)));
    let (base, extra) = (placeable / live.len(), placeable % live.len());
    let share: BTreeMap<&Epoch, usize> = ranked
        .iter()
        .enumerate()
        .map(|(rank, epoch)| (*epoch, base + usize::from(rank < extra)))
        .collect();

    // Surplus: the tenants each replica over its share gives, the last by name first.
    let mut surplus: Vec<String> = Vec::new();
    for epoch in &ranked {
        let over = count[epoch].saturating_sub(share[epoch]);
        if over == 0 {
            continue;
        }
        let mine: Vec<String> = next
            .tenants
            .iter()
            .filter(|(_, entry)| entry.destination() == Some(*epoch))
            .map(|(tenant, _)| tenant.clone())
            .collect();
        surplus.extend(mine.into_iter().rev().take(over));
    }

    // New and orphaned tenants first (they cost no handover), then the surplus.
    let mut budget = MAX_MAP_BYTES.saturating_sub(next.to_json().len());
    let mut receivers = ranked.iter().flat_map(|epoch| {
        let room = share[epoch].saturating_sub(count[epoch]);
        std::iter::repeat_n(*epoch, room)
    });
    for tenant in unplaced {
        // A stored entry costs its quoted name, an index and separators.
        let cost = tenant.len() + 12;
        if cost > budget {
            continue;
        }
        let Some(to) = receivers.next() else { break };
        budget -= cost;
        next.tenants.insert(tenant, Entry::owned_by(to));
    }
    for tenant in surplus {
        let Some(to) = receivers.next() else { break };
        if let Some(entry) = next.tenants.get_mut(&tenant) {
            entry.moving = (entry.owner != *to).then(|| Move::To(to.clone()));
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(id: &str) -> Epoch {
        Epoch {
            id: id.to_string(),
            uid: format!("uid-{id}"),
        }
    }

    fn names(n: usize) -> BTreeSet<String> {
        (0..n).map(|i| format!("t{i:02}")).collect()
    }

    /// Plans and lets every owner hand over at once, until nothing changes; the tenants each
    /// live epoch then serves, and how many changed owner on the way.
    fn settle(map: &mut ShardMap, live: &[Epoch], dead: &BTreeSet<Epoch>, tenants: &BTreeSet<String>) -> usize {
        let before = map.clone();
        for _ in 0..4 {
            *map = plan(map, live, dead, tenants);
            for owner in live {
                let (_, moving) = map.owned_by(owner);
                map.hand_over(owner, &moving);
            }
        }
        assert_eq!(plan(map, live, dead, tenants), *map, "settled");
        map.tenants
            .iter()
            .filter(|(tenant, entry)| before.tenants.get(*tenant).is_some_and(|b| b.owner != entry.owner))
            .count()
    }

    fn shares(map: &ShardMap, live: &[Epoch]) -> Vec<usize> {
        live.iter().map(|epoch| map.owned_by(epoch).0.len()).collect()
    }

    #[test]
    fn tenants_are_shared_to_within_one_whatever_their_names() {
        let live = [epoch("a"), epoch("b"), epoch("c")];
        for (tenants, want) in [(12, [4, 4, 4]), (13, [5, 4, 4]), (2, [1, 1, 0]), (0, [0, 0, 0])] {
            let mut map = ShardMap::default();
            settle(&mut map, &live, &BTreeSet::new(), &names(tenants));
            assert_eq!(shares(&map, &live), want, "{tenants} tenants");
        }
    }

    #[test]
    fn a_joining_replica_moves_only_what_it_takes_and_a_leaving_one_only_what_it_had() {
        let three = [epoch("a"), epoch("b"), epoch("c")];
        let mut map = ShardMap::default();
        settle(&mut map, &three, &BTreeSet::new(), &names(12));
        let four = [epoch("a"), epoch("b"), epoch("c"), epoch("d")];
        let moved = settle(&mut map, &four, &BTreeSet::new(), &names(12));
        assert_eq!(shares(&map, &four), [3, 3, 3, 3]);
        assert_eq!(moved, 3, "only the joiner's three move");
        let dead = BTreeSet::from([epoch("b")]);
        let left = [epoch("a"), epoch("c"), epoch("d")];
        let moved = settle(&mut map, &left, &dead, &names(12));
        assert_eq!(shares(&map, &left), [4, 4, 4]);
        assert_eq!(moved, 3, "only the leaver's three move");
    }

    #[test]
    fn an_owner_not_known_alive_or_gone_keeps_its_tenants_and_a_new_epoch_gets_none_of_them() {
        let mut map = ShardMap::default();
        settle(&mut map, &[epoch("a"), epoch("b")], &BTreeSet::new(), &names(4));
        let reborn = Epoch {
            id: "b".to_string(),
            uid: "uid-b-2".to_string(),
        };
        let live = [epoch("a"), reborn.clone()];
        let planned = plan(&map, &live, &BTreeSet::new(), &names(4));
        assert_eq!(planned.owned_by(&epoch("b")).0.len(), 2, "b's first life keeps its two");
        assert!(planned.owned_by(&reborn).0.is_empty());
        assert_eq!(planned.suspects(&live, &BTreeSet::new()), BTreeSet::from([epoch("b")]));
        let dead = BTreeSet::from([epoch("b")]);
        settle(&mut map, &live, &dead, &names(4));
        assert_eq!(shares(&map, &live), [2, 2]);
    }

    #[test]
    fn a_removed_tenant_is_dropped_by_its_owner_and_a_returning_one_stays_put() {
        let live = [epoch("a"), epoch("b")];
        let mut map = ShardMap::default();
        settle(&mut map, &live, &BTreeSet::new(), &names(4));
        let fewer: BTreeSet<String> = names(3);
        let planned = plan(&map, &live, &BTreeSet::new(), &fewer);
        assert_eq!(planned.tenants["t03"].moving, Some(Move::Drop));
        let back = plan(&planned, &live, &BTreeSet::new(), &names(4));
        assert_eq!(back.tenants["t03"].moving, None, "the drop is called off");
        let mut map = planned;
        let owner = map.tenants["t03"].owner.clone();
        map.hand_over(&owner, &BTreeSet::from(["t03".to_string()]));
        assert!(!map.tenants.contains_key("t03"));
    }

    #[test]
    fn the_stored_map_reads_back_and_a_broken_one_is_refused() {
        let mut map = ShardMap::default();
        settle(&mut map, &[epoch("a"), epoch("b")], &BTreeSet::new(), &names(5));
        map.tenants.get_mut("t01").expect("an entry").moving = Some(Move::To(epoch("c")));
        map.tenants.get_mut("t02").expect("an entry").moving = Some(Move::Drop);
        assert_eq!(ShardMap::from_json(&map.to_json()), Ok(map));
        assert!(ShardMap::from_json(r#"{"members":[],"tenants":{"x":3}}"#).is_err());
        assert!(ShardMap::from_json("not json").is_err());
    }

    #[test]
    fn tenants_past_the_map_size_are_left_unplaced() {
        let live = [epoch("a")];
        let long: BTreeSet<String> = (0..20_000).map(|i| format!("{i:0>60}")).collect();
        let map = plan(&ShardMap::default(), &live, &BTreeSet::new(), &long);
        assert!(map.to_json().len() <= MAX_MAP_BYTES, "{}", map.to_json().len());
        assert!(map.tenants.len() > 12_000, "{}", map.tenants.len());
        assert_eq!(map.unserved(&live, &long), 20_000 - map.tenants.len());
    }
}
