//! What a tenant's shared caches may hold (DESIGN.md §8, blast radius): a size cap per object
//! (`--max-cached-object-bytes`), a memory budget per tenant (`--tenant-memory-budget`), a share
//! of it per tenant namespace (`--namespace-memory-budget`) and a count of objects per tenant
//! namespace (`--namespace-max-objects`: each object cached is also work, reconciled and
//! rechecked, whatever its size).
//!
//! Every object a tenant's caches keep is charged to its [`MemoryBudget`] at the estimated cost of
//! its decoded form ([`super::raw_object::Footprint`]), and to its tenant namespace. An object that
//! would take its namespace over its share (or the tenant's namespaces together over the tenant's
//! budget) is not cached: only that namespace's work is held, never the tenant's other namespaces.
//! What no namespace owns (cluster-scoped objects, host objects of no known tenant namespace) taking
//! the tenant over its budget suspends the tenant (its watches stop, its caches are freed), instead
//! of the daemon growing until the kernel kills it for every tenant.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// `--max-cached-object-bytes` when not given: far above what stackd's own objects need (a Stack
/// with a large controller Deployment, a rendered install config: tens of KiB), a third of what an
/// API server stores, and at most ~10 MiB decoded even as arrays of small numbers.
pub const DEFAULT_MAX_OBJECT_BYTES: &str = "512Ki";
/// `--tenant-memory-budget` when not given: with the controllers chart's 512 MiB limit, 24 tenants
/// each at their full budget (384 MiB) leave 128 MiB for the daemon itself (README, "Sizing").
pub const DEFAULT_TENANT_BUDGET: &str = "16Mi";

/// `--namespace-memory-budget` when not given: a quarter of the tenant's budget, so that one
/// namespace can hold its own work only, and four namespaces at their share still fit the tenant.
pub fn default_namespace_share(tenant_budget: ByteSize) -> ByteSize {
    ByteSize((tenant_budget.0 / 4).max(1))
}

/// `--namespace-max-objects` when not given: some ten times what a large team's namespace holds
/// of the kinds stackd reads (pools, claims, customizations, assets, installs, their Secrets).
pub const DEFAULT_NAMESPACE_MAX_OBJECTS: u64 = 2000;

/// A size in bytes, written as a number with an optional binary suffix (`512Ki`, `16Mi`, `1Gi`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// [`DEFAULT_MAX_OBJECT_BYTES`].
    pub const DEFAULT_MAX_OBJECT: ByteSize = ByteSize(512 << 10);
    /// [`DEFAULT_TENANT_BUDGET`].
    pub const DEFAULT_TENANT_BUDGET: ByteSize = ByteSize(16 << 20);
}

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (number, suffix) = s.split_at(split);
        let shift = match suffix {
            "" => 0,
            "Ki" => 10,
            "Mi" => 20,
            "Gi" => 30,
            _ => return Err(format!("{s:?} is not a size such as 512Ki, 16Mi or 1Gi")),
        };
        let number: u64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a size such as 512Ki, 16Mi or 1Gi"))?;
        number
            .checked_mul(1 << shift)
            .filter(|bytes| *bytes > 0)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} must be above zero and below 16 EiB"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bytes = self.0;
        let units = [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
        for (size, unit) in units {
            if bytes >= size {
                let tenths = bytes * 10 / size;
                return if tenths.is_multiple_of(10) {
                    write!(f, "{} {unit}", tenths / 10)
                } else {
                    write!(f, "{}.{} {unit}", tenths / 10, tenths % 10)
                };
            }
        }
        write!(f, "{bytes} bytes")
    }
}

/// Why a tenant went over its budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overage {
    pub used: u64,
    pub budget: u64,
    /// The kind whose cache went over (the one that grew last, not necessarily the largest).
    pub kind: String,
}

impl fmt::Display for Overage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "its cached objects that belong to no namespace (cluster-scoped ones, host objects of no known tenant namespace) take it to an estimated {}, over the {} budget of a tenant (--tenant-memory-budget); the last to grow were its {}",
            ByteSize(self.used),
            ByteSize(self.budget),
            self.kind
        )
    }
}

/// Why an object of a tenant namespace is not cached: it would take its namespace over its share,
/// or the tenant over its budget (the tenant's namespaces together), while its namespace's other
/// objects stay cached and its tenant's other namespaces are served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceOverage {
    pub namespace: String,
    /// What the namespace's cached objects take now, and how many they are.
    pub used: u64,
    pub objects: u64,
    /// The estimated bytes the object would take.
    pub wanted: u64,
    /// The bound it would cross, and the flag that sets it.
    pub limit: u64,
    pub flag: &'static str,
}

/// The flag of the share of one tenant namespace.
pub const NAMESPACE_BUDGET_FLAG: &str = "--namespace-memory-budget";
/// The flag of the objects of one tenant namespace.
pub const NAMESPACE_OBJECTS_FLAG: &str = "--namespace-max-objects";
/// The flag of the budget of a tenant.
pub const TENANT_BUDGET_FLAG: &str = "--tenant-memory-budget";

impl fmt::Display for NamespaceOverage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (used, wanted, limit) = (ByteSize(self.used), ByteSize(self.wanted), ByteSize(self.limit));
        let namespace = &self.namespace;
        if self.flag == NAMESPACE_OBJECTS_FLAG {
            write!(
                f,
                "namespace {namespace} has {} objects of the kinds stackd reads cached already, as many as one namespace may have ({NAMESPACE_OBJECTS_FLAG} {})",
                self.objects, self.limit
            )
        } else if self.flag == NAMESPACE_BUDGET_FLAG {
            write!(
                f,
                "it would take an estimated {wanted} more in stackd's memory, and namespace {namespace}'s {} cached objects take {used} already, over the {limit} share of one namespace ({NAMESPACE_BUDGET_FLAG})",
                self.objects
            )
        } else {
            write!(
                f,
                "it would take an estimated {wanted} more in stackd's memory, over the {limit} budget of the tenant's namespaces together ({TENANT_BUDGET_FLAG}; namespace {namespace}'s {} cached objects take {used})",
                self.objects
            )
        }
    }
}

/// What one tenant namespace's cached objects take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    bytes: u64,
    objects: u64,
}

/// The cached bytes of each tenant namespace, as the caches will hold them once a relist in
/// progress is in ("" for what no namespace owns).
#[derive(Default)]
struct Namespaces {
    usage: HashMap<String, Usage>,
    /// Over every namespace, "" included.
    total: u64,
    /// Namespaces that had an object refused for their share: told when they shrink.
    held: HashSet<String>,
}

impl Namespaces {
    fn usage(&self, namespace: &str) -> Usage {
        self.usage.get(namespace).copied().unwrap_or_default()
    }

    fn apply(&mut self, charge: &NamespaceCharge) {
        let usage = self.usage.entry(charge.namespace.clone()).or_default();
        usage.bytes = usage.bytes.saturating_add_signed(charge.bytes);
        usage.objects = usage.objects.saturating_add_signed(charge.objects);
        self.total = self.total.saturating_add_signed(charge.bytes);
        if *usage == Usage::default() {
            self.usage.remove(&charge.namespace);
        }
    }
}

/// The estimated bytes one tenant's caches hold, against its budget and its namespaces' share.
pub struct MemoryBudget {
    budget: u64,
    namespace_share: u64,
    namespace_objects: u64,
    used: AtomicI64,
    namespaces: Mutex<Namespaces>,
    /// The first overage; later ones change nothing (the tenant is on its way out).
    exceeded: watch::Sender<Option<Overage>>,
    /// Counts the times a namespace that had an object refused shrank: its caches look again.
    room: watch::Sender<u64>,
    /// `stackd_tenant_cached_bytes{tenant}`.
    gauge: Option<Gauge>,
}

/// What the budget says to a cache that charged it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Cached,
    /// The tenant is over its budget (with what no namespace owns): its caches stop.
    Suspended,
}

impl MemoryBudget {
    /// A tenant's budget, each of its namespaces' share of it being `namespace_share` and at most
    /// `namespace_objects` objects.
    pub fn new(
        budget: ByteSize,
        namespace_share: ByteSize,
        namespace_objects: u64,
        gauge: Option<Gauge>,
    ) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            budget: budget.0,
            namespace_share: namespace_share.0,
            namespace_objects,
            used: AtomicI64::new(0),
            namespaces: Mutex::default(),
            exceeded: watch::Sender::new(None),
            room: watch::Sender::new(0),
            gauge,
        })
    }

    fn namespaces(&self) -> std::sync::MutexGuard<'_, Namespaces> {
        self.namespaces.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the growth `charges` brings to a namespace fits its share and the tenant's budget;
    /// what does not is refused for that namespace alone. What no namespace owns is never refused:
    /// the tenant goes over its budget with it, and is suspended.
    pub fn admits(&self, charges: &Charges) -> Result<(), NamespaceOverage> {
        let namespaces = self.namespaces();
        for charge in charges
            .namespaces
            .iter()
            .filter(|c| (c.bytes > 0 || c.objects > 0) && !c.namespace.is_empty())
        {
            let usage = namespaces.usage(&charge.namespace);
            let wanted = charge.bytes.max(0) as u64;
            let over = |limit: u64, flag| NamespaceOverage {
                namespace: charge.namespace.clone(),
                used: usage.bytes,
                objects: usage.objects,
                wanted,
                limit,
                flag,
            };
            if charge.objects > 0 && usage.objects.saturating_add(charge.objects as u64) > self.namespace_objects {
                return Err(over(self.namespace_objects, NAMESPACE_OBJECTS_FLAG));
            }
            if usage.bytes.saturating_add(wanted) > self.namespace_share {
                return Err(over(self.namespace_share, NAMESPACE_BUDGET_FLAG));
            }
            if namespaces.total.saturating_add(wanted) > self.budget {
                return Err(over(self.budget, TENANT_BUDGET_FLAG));
            }
        }
        Ok(())
    }

    /// Records that a namespace had an object refused: its caches look again when it shrinks.
    pub fn refused_in(&self, namespace: &str) {
        self.namespaces().held.insert(namespace.to_string());
    }

    /// Adds what a cache holds now; `Suspended` once the tenant is over its budget with what no
    /// namespace owns (an object of a namespace is checked by [`Self::admits`] first).
    pub fn charge(&self, charges: &Charges, kind: &str) -> Verdict {
        let used = self
            .used
            .fetch_add(charges.memory, Ordering::SeqCst)
            .saturating_add(charges.memory)
            .max(0);
        if let Some(gauge) = &self.gauge {
            gauge.set(used);
        }
        let (total, unowned_grew, shrank) = {
            let mut namespaces = self.namespaces();
            for charge in &charges.namespaces {
                namespaces.apply(charge);
            }
            let unowned_grew = charges.namespaces.iter().any(|c| c.namespace.is_empty() && c.bytes > 0);
            let shrank = charges
                .namespaces
                .iter()
                .any(|c| c.bytes < 0 && namespaces.held.contains(&c.namespace));
            (namespaces.total, unowned_grew, shrank)
        };
        if shrank {
            self.room.send_modify(|count| *count += 1);
        }
        if !(unowned_grew && total > self.budget) {
            return if self.is_exceeded() {
                Verdict::Suspended
            } else {
                Verdict::Cached
            };
        }
        self.exceeded.send_if_modified(|exceeded| {
            if exceeded.is_some() {
                return false;
            }
            *exceeded = Some(Overage {
                used: total,
                budget: self.budget,
                kind: kind.to_string(),
            });
            true
        });
        Verdict::Suspended
    }

    /// The bytes an object of `namespace` may grow by now and be cached (none while the namespace
    /// has as many objects as it may: a refused object counts as one already).
    pub fn room_in(&self, namespace: &str) -> u64 {
        let namespaces = self.namespaces();
        let usage = namespaces.usage(namespace);
        if usage.objects > self.namespace_objects {
            return 0;
        }
        let share = self.namespace_share.saturating_sub(usage.bytes);
        share.min(self.budget.saturating_sub(namespaces.total))
    }

    /// Changes whenever a namespace that had an object refused shrinks.
    pub fn room_changes(&self) -> watch::Receiver<u64> {
        self.room.subscribe()
    }

    pub fn is_exceeded(&self) -> bool {
        self.exceeded.borrow().is_some()
    }

    /// The estimated bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst).max(0) as u64
    }

    /// The estimated bytes `namespace`'s cached objects take, and how many they are.
    pub fn used_in(&self, namespace: &str) -> (u64, u64) {
        let usage = self.namespaces().usage(namespace);
        (usage.bytes, usage.objects)
    }

    /// Resolves when the tenant first goes over its budget.
    pub async fn exceeded(&self) -> Overage {
        let mut receiver = self.exceeded.subscribe();
        loop {
            if let Some(overage) = receiver.borrow_and_update().clone() {
                return overage;
            }
            if receiver.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// The change one cache's holding brings to one tenant namespace ("" for none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceCharge {
    pub namespace: String,
    pub bytes: i64,
    pub objects: i64,
}

/// The change in what a cache holds: in memory (both copies while a relist is in progress), and
/// per tenant namespace as the cache will hold it once the relist is in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Charges {
    pub memory: i64,
    pub namespaces: Vec<NamespaceCharge>,
}

/// One object a cache holds: its bytes, charged to its tenant namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    namespace: String,
    bytes: u64,
}

/// The change in a namespace's holding when the object held goes from `before` to `after`.
fn difference(before: Option<&Held>, after: Option<&Held>) -> Vec<NamespaceCharge> {
    let charge = |held: &Held, sign: i64| NamespaceCharge {
        namespace: held.namespace.clone(),
        bytes: sign * held.bytes as i64,
        objects: sign,
    };
    match (before, after) {
        (Some(before), Some(after)) if before.namespace == after.namespace => {
            let bytes = after.bytes as i64 - before.bytes as i64;
            if bytes == 0 {
                return Vec::new();
            }
            vec![NamespaceCharge {
                namespace: after.namespace.clone(),
                bytes,
                objects: 0,
            }]
        }
        (before, after) => before
            .map(|b| charge(b, -1))
            .into_iter()
            .chain(after.map(|a| charge(a, 1)))
            .collect(),
    }
}

/// What one cache has charged to the budget, per object, so that an object replaced or deleted gives
/// its bytes back; a relist's objects are charged while the old ones are still held, as they are
/// in memory (kube's store swaps them in at the end of the list). A namespace is charged the copy
/// it will keep: a relist does not count its objects twice against its share.
#[derive(Default)]
pub struct Ledger {
    held: HashMap<String, Held>,
    relisting: Option<HashMap<String, Held>>,
}

impl Ledger {
    /// The copy of `key` the cache will keep once a relist in progress is in.
    fn kept(&self, key: &str) -> Option<&Held> {
        match &self.relisting {
            Some(relisting) => relisting.get(key).or_else(|| self.held.get(key)),
            None => self.held.get(key),
        }
    }

    /// What holding `bytes` for `key` (of tenant namespace `namespace`) would change.
    pub fn charges(&self, key: &str, namespace: &str, bytes: u64) -> Charges {
        let in_memory = match &self.relisting {
            Some(relisting) => relisting.get(key),
            None => self.held.get(key),
        };
        let after = Held {
            namespace: namespace.to_string(),
            bytes,
        };
        Charges {
            memory: bytes as i64 - in_memory.map_or(0, |h| h.bytes as i64),
            namespaces: difference(self.kept(key), Some(&after)),
        }
    }

    /// The change when the cache holds `bytes` for `key`, of tenant namespace `namespace`.
    pub fn hold(&mut self, key: String, namespace: &str, bytes: u64) -> Charges {
        let charges = self.charges(&key, namespace, bytes);
        let held = Held {
            namespace: namespace.to_string(),
            bytes,
        };
        match &mut self.relisting {
            Some(relisting) => relisting.insert(key, held),
            None => self.held.insert(key, held),
        };
        charges
    }

    /// The change when the cache lets go of `key`.
    pub fn release(&mut self, key: &str) -> Charges {
        let namespaces = difference(self.kept(key), None);
        let relisted = self
            .relisting
            .as_mut()
            .and_then(|r| r.remove(key))
            .map_or(0, |h| h.bytes);
        let held = self.held.remove(key).map_or(0, |h| h.bytes);
        Charges {
            memory: -((held + relisted) as i64),
            namespaces,
        }
    }

    pub fn start_relist(&mut self) {
        self.relisting = Some(HashMap::new());
    }

    /// The relist is in: the objects held before it are let go. Returns the change.
    pub fn finish_relist(&mut self) -> Charges {
        let Some(relisted) = self.relisting.take() else {
            return Charges::default();
        };
        let before = std::mem::replace(&mut self.held, relisted);
        let memory = -(before.values().map(|h| h.bytes).sum::<u64>() as i64);
        let namespaces = before
            .iter()
            .filter(|(key, _)| !self.held.contains_key(*key))
            .flat_map(|(_, gone)| difference(Some(gone), None))
            .collect();
        Charges { memory, namespaces }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!("512Ki".parse::<ByteSize>(), Ok(ByteSize(512 * 1024)));
        assert_eq!("16Mi".parse::<ByteSize>(), Ok(ByteSize(16 << 20)));
        assert_eq!("1Gi".parse::<ByteSize>(), Ok(ByteSize(1 << 30)));
        assert_eq!("4096".parse::<ByteSize>(), Ok(ByteSize(4096)));
        for bad in ["", "0", "16MB", "1.5Mi", "-1", "Mi", "99999999999999999999Gi"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad:?}");
        }
        assert_eq!(ByteSize(512 * 1024).to_string(), "512 KiB");
        assert_eq!(ByteSize(1_300_000).to_string(), "1.2 MiB");
        assert_eq!(ByteSize(12).to_string(), "12 bytes");
    }

    #[test]
    fn the_defaults_parse_to_their_constants() {
        assert_eq!(DEFAULT_MAX_OBJECT_BYTES.parse(), Ok(ByteSize::DEFAULT_MAX_OBJECT));
        assert_eq!(DEFAULT_TENANT_BUDGET.parse(), Ok(ByteSize::DEFAULT_TENANT_BUDGET));
    }

    fn charges(namespace: &str, bytes: i64) -> Charges {
        Charges {
            memory: bytes,
            namespaces: vec![NamespaceCharge {
                namespace: namespace.into(),
                bytes,
                objects: bytes.signum(),
            }],
        }
    }

    #[tokio::test]
    async fn going_over_the_budget_with_what_no_namespace_owns_is_told_once_with_the_kind_that_grew() {
        let budget = MemoryBudget::new(ByteSize(1000), ByteSize(1000), 100, None);
        assert_eq!(budget.charge(&charges("", 600), "Secret"), Verdict::Cached);
        assert_eq!(budget.charge(&charges("team", 300), "Job"), Verdict::Cached);
        assert_eq!(
            budget.charge(&charges("", 200), "ClusterStackInstall"),
            Verdict::Suspended
        );
        assert_eq!(
            budget.charge(&charges("", -900), "Secret"),
            Verdict::Suspended,
            "an exceeded budget stays exceeded"
        );
        let overage = budget.exceeded().await;
        assert_eq!(overage.kind, "ClusterStackInstall");
        assert_eq!(overage.used, 1100);
        assert!(overage.to_string().contains("--tenant-memory-budget"), "{overage}");
    }

    #[test]
    fn a_namespace_with_as_many_objects_as_it_may_is_refused_more_until_one_goes() {
        let budget = MemoryBudget::new(ByteSize(100_000), ByteSize(50_000), 2, None);
        for _ in 0..2 {
            assert_eq!(budget.admits(&charges("attacker", 10)), Ok(()));
            budget.charge(&charges("attacker", 10), "Secret");
        }
        let refused = budget.admits(&charges("attacker", 10)).unwrap_err();
        assert_eq!(refused.flag, NAMESPACE_OBJECTS_FLAG);
        assert!(refused.to_string().contains("--namespace-max-objects 2"), "{refused}");
        assert_eq!(
            budget.admits(&charges("victim", 10)),
            Ok(()),
            "another namespace is served"
        );
        // The refused object's record counts: no room until one of the others goes.
        budget.charge(&charges("attacker", 1), "Secret");
        assert_eq!(budget.room_in("attacker"), 0);
        budget.charge(&charges("attacker", -10), "Secret");
        assert!(budget.room_in("attacker") > 0);
    }

    #[test]
    fn a_namespace_over_its_share_is_refused_alone_and_the_tenant_is_not_suspended() {
        let budget = MemoryBudget::new(ByteSize(1000), ByteSize(400), 100, None);
        assert_eq!(budget.admits(&charges("attacker", 300)), Ok(()));
        budget.charge(&charges("attacker", 300), "ClusterDeploymentCustomization");
        let refused = budget.admits(&charges("attacker", 200)).unwrap_err();
        assert_eq!(refused.flag, NAMESPACE_BUDGET_FLAG);
        assert_eq!((refused.used, refused.objects, refused.limit), (300, 1, 400));
        assert!(refused.to_string().contains("--namespace-memory-budget"), "{refused}");
        assert_eq!(
            budget.admits(&charges("victim", 200)),
            Ok(()),
            "another namespace is served"
        );
        assert_eq!(budget.admits(&charges("attacker", -300)), Ok(()), "shrinking always is");
        assert!(!budget.is_exceeded());
        assert_eq!(budget.room_in("attacker"), 100);
    }

    #[test]
    fn the_namespaces_together_stay_within_the_tenant_budget() {
        let budget = MemoryBudget::new(ByteSize(1000), ByteSize(400), 100, None);
        for namespace in ["a", "b"] {
            budget.charge(&charges(namespace, 400), "Secret");
        }
        let refused = budget.admits(&charges("c", 300)).unwrap_err();
        assert_eq!(refused.flag, TENANT_BUDGET_FLAG);
        assert_eq!(budget.admits(&charges("c", 200)), Ok(()));
        assert!(!budget.is_exceeded());
    }

    #[test]
    fn a_namespace_that_had_an_object_refused_is_told_when_it_shrinks() {
        let budget = MemoryBudget::new(ByteSize(1000), ByteSize(400), 100, None);
        let room = budget.room_changes();
        budget.charge(&charges("attacker", 400), "Secret");
        budget.refused_in("attacker");
        budget.charge(&charges("victim", 100), "Secret");
        budget.charge(&charges("victim", -100), "Secret");
        assert!(!room.has_changed().unwrap(), "another namespace's room is no news");
        budget.charge(&charges("attacker", -400), "Secret");
        assert!(room.has_changed().unwrap());
        assert_eq!(budget.used_in("attacker"), (0, 0));
    }

    #[test]
    fn a_relist_holds_both_copies_until_it_is_in() {
        let mut ledger = Ledger::default();
        assert_eq!(ledger.hold("a".into(), "ns", 100).memory, 100);
        assert_eq!(ledger.hold("a".into(), "ns", 150).memory, 50);
        ledger.start_relist();
        assert_eq!(ledger.hold("a".into(), "ns", 150).memory, 150);
        assert_eq!(ledger.hold("b".into(), "ns", 10).memory, 10);
        assert_eq!(ledger.finish_relist().memory, -150);
        assert_eq!(ledger.release("a").memory, -150);
        assert_eq!(ledger.release("missing"), Charges::default());
    }

    #[test]
    fn a_relist_charges_a_namespace_only_the_copy_it_keeps() {
        let mut ledger = Ledger::default();
        ledger.hold("a".into(), "ns", 100);
        ledger.hold("gone".into(), "ns", 30);
        ledger.start_relist();
        let relisted = ledger.hold("a".into(), "ns", 120);
        assert_eq!(relisted.memory, 120, "both copies are in memory");
        assert_eq!(
            relisted.namespaces,
            [NamespaceCharge {
                namespace: "ns".into(),
                bytes: 20,
                objects: 0
            }],
            "the namespace keeps one"
        );
        let done = ledger.finish_relist();
        assert_eq!(done.memory, -130);
        assert_eq!(
            done.namespaces,
            [NamespaceCharge {
                namespace: "ns".into(),
                bytes: -30,
                objects: -1
            }]
        );
        let moved = ledger.hold("a".into(), "other", 120);
        assert_eq!(moved.namespaces.len(), 2, "{moved:?}");
    }
}
