//! Which slot a tenant belongs to and which slots a replica wants: pure functions, the same in
//! every replica, so that replicas agree without talking to each other beyond the Leases.

use sha2::{Digest, Sha256};

/// The slot of a tenant: FNV-1a (64 bit) of its name modulo the slot count. Fixed on purpose:
/// std's hasher is seeded per process, and changing this function would move every tenant at
/// once during an upgrade, while old and new replicas disagree.
pub fn slot_of(tenant: &str, shards: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in tenant.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u32
}

/// Rendezvous (highest-random-weight) weight of a slot for a member: each replica prefers other
/// free slots first (fewer races for the same Lease) and gives up its least preferred ones.
pub fn weight(slot: u32, member: &str) -> u64 {
    let digest = Sha256::new()
        .chain_update(slot.to_be_bytes())
        .chain_update(member.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The most slots one replica may hold: `ceil(shards / live)`.
pub fn fair_share(shards: u32, live: usize) -> usize {
    (shards as usize).div_ceil(live.max(1))
}

/// The held slots to give up to get down to `cap`: the least preferred first.
pub fn surplus(held: &[u32], member: &str, cap: usize) -> Vec<u32> {
    let mut ranked = held.to_vec();
    ranked.sort_by_key(|slot| (weight(*slot, member), *slot));
    let extra = held.len().saturating_sub(cap);
    ranked.truncate(extra);
    ranked
}

/// The free slots to try to take, most preferred first, at most `room` of them.
pub fn wanted(free: &[u32], member: &str, room: usize) -> Vec<u32> {
    let mut ranked = free.to_vec();
    ranked.sort_by_key(|slot| (std::cmp::Reverse(weight(*slot, member)), *slot));
    ranked.truncate(room);
    ranked
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn a_tenant_maps_to_the_same_slot_in_every_process() {
        // Fixed values: a change here moves tenants between replicas during an upgrade.
        assert_eq!(slot_of("acme", 32), slot_of("acme", 32));
        assert_eq!(slot_of("", 32), (0xcbf2_9ce4_8422_2325u64 % 32) as u32);
        assert_eq!(slot_of("a", 1000), (0xaf63_dc4c_8601_ec8c_u64 % 1000) as u32);
        assert_eq!(slot_of("anything", 1), 0);
    }

    #[test]
    fn tenants_spread_over_the_slots() {
        let mut counts = BTreeMap::new();
        for index in 0..640 {
            *counts.entry(slot_of(&format!("t{index:03}"), 32)).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 32, "every slot gets tenants");
        assert!(counts.values().all(|count| (8..=34).contains(count)), "{counts:?}");
    }

    #[test]
    fn the_fair_share_is_the_ceiling_of_slots_per_live_replica() {
        assert_eq!(fair_share(32, 3), 11);
        assert_eq!(fair_share(32, 2), 16);
        assert_eq!(fair_share(32, 0), 32);
        assert_eq!(fair_share(4, 8), 1);
    }

    /// Every member takes free slots up to its share, in turn, as the Leases would let them.
    fn settle(holders: &mut BTreeMap<u32, String>, members: &[&str], shards: u32) -> usize {
        let cap = fair_share(shards, members.len());
        let mut moves = 0;
        holders.retain(|_, holder| members.contains(&holder.as_str()));
        for member in members {
            let held: Vec<u32> = holders.iter().filter(|(_, h)| h == member).map(|(s, _)| *s).collect();
            for slot in surplus(&held, member, cap) {
                holders.remove(&slot);
            }
        }
        for member in members {
            let held = holders.values().filter(|h| h == member).count();
            let free: Vec<u32> = (0..shards).filter(|s| !holders.contains_key(s)).collect();
            for slot in wanted(&free, member, cap.saturating_sub(held)) {
                holders.insert(slot, member.to_string());
                moves += 1;
            }
        }
        moves
    }

    #[test]
    fn a_joining_or_leaving_replica_moves_only_its_share_of_slots() {
        let mut holders = BTreeMap::new();
        settle(&mut holders, &["a", "b", "c"], 32);
        assert_eq!(holders.len(), 32);
        let joined = settle(&mut holders, &["a", "b", "c", "d"], 32);
        assert_eq!(joined, 8, "the new replica takes its share, nothing else moves");
        assert_eq!(holders.values().filter(|h| *h == "d").count(), 8);
        let before = holders.clone();
        let left = settle(&mut holders, &["a", "b", "d"], 32);
        assert_eq!(left, 8, "only the leaver's slots move");
        let moved = before.iter().filter(|(s, h)| holders.get(*s) != Some(*h)).count();
        assert_eq!(moved, 8);
    }
}
