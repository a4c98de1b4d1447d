//! What a tenant's shared caches may hold (DESIGN.md §8, blast radius): a size cap per object
//! (`--max-cached-object-bytes`) and a memory budget per tenant (`--tenant-memory-budget`).
//!
//! Every object a tenant's caches keep is charged to its [`MemoryBudget`] at the estimated cost of
//! its decoded form ([`super::raw_object::Footprint`]); a tenant that goes over it is suspended by its
//! supervisor (its watches stop, its caches are freed), instead of the daemon growing until the
//! kernel kills it for every tenant.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

/// `--max-cached-object-bytes` when not given: far above what stackd's own objects need (a Stack
/// with a large controller Deployment, a rendered install config: tens of KiB), a third of what an
/// API server stores, and at most ~10 MiB decoded even as arrays of small numbers.
pub const DEFAULT_MAX_OBJECT_BYTES: &str = "512Ki";
/// `--tenant-memory-budget` when not given: with the controllers chart's 512 MiB limit, 24 tenants
/// each at their full budget (384 MiB) leave 128 MiB for the daemon itself (README, "Sizing").
pub const DEFAULT_TENANT_BUDGET: &str = "16Mi";

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
            "its cached objects take an estimated {}, over the {} budget of a tenant (--tenant-memory-budget); the last to grow were its {}",
            ByteSize(self.used),
            ByteSize(self.budget),
            self.kind
        )
    }
}

/// The estimated bytes one tenant's caches hold, against its budget.
pub struct MemoryBudget {
    budget: u64,
    used: AtomicI64,
    /// The first overage; later ones change nothing (the tenant is on its way out).
    exceeded: watch::Sender<Option<Overage>>,
    /// `stackd_tenant_cached_bytes{tenant}`.
    gauge: Option<Gauge>,
}

impl MemoryBudget {
    pub fn new(budget: ByteSize, gauge: Option<Gauge>) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            budget: budget.0,
            used: AtomicI64::new(0),
            exceeded: watch::Sender::new(None),
            gauge,
        })
    }

    /// Adds `delta` bytes held by the cache of `kind`; false once the tenant is over its budget.
    pub fn charge(&self, delta: i64, kind: &str) -> bool {
        let used = self
            .used
            .fetch_add(delta, Ordering::SeqCst)
            .saturating_add(delta)
            .max(0);
        if let Some(gauge) = &self.gauge {
            gauge.set(used);
        }
        let used = used as u64;
        if used <= self.budget {
            return !self.is_exceeded();
        }
        self.exceeded.send_if_modified(|exceeded| {
            if exceeded.is_some() {
                return false;
            }
            *exceeded = Some(Overage {
                used,
                budget: self.budget,
                kind: kind.to_string(),
            });
            true
        });
        false
    }

    pub fn is_exceeded(&self) -> bool {
        self.exceeded.borrow().is_some()
    }

    /// The estimated bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst).max(0) as u64
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

/// What one cache has charged to the budget, per object, so that an object replaced or deleted gives
/// its bytes back; a relist's objects are charged while the old ones are still held, as they are
/// in memory (kube's store swaps them in at the end of the list).
#[derive(Default)]
pub struct Ledger {
    held: HashMap<String, u64>,
    relisting: Option<HashMap<String, u64>>,
}

impl Ledger {
    /// The change in bytes held when the cache holds `bytes` for `key`.
    pub fn hold(&mut self, key: String, bytes: u64) -> i64 {
        if let Some(relisting) = &mut self.relisting {
            let before = relisting.insert(key, bytes).unwrap_or(0);
            return bytes as i64 - before as i64;
        }
        let before = self.held.insert(key, bytes).unwrap_or(0);
        bytes as i64 - before as i64
    }

    /// The change in bytes held when the cache lets go of `key`.
    pub fn release(&mut self, key: &str) -> i64 {
        let relisted = self.relisting.as_mut().and_then(|r| r.remove(key)).unwrap_or(0);
        -((self.held.remove(key).unwrap_or(0) + relisted) as i64)
    }

    pub fn start_relist(&mut self) {
        self.relisting = Some(HashMap::new());
    }

    /// The relist is in: the objects held before it are let go. Returns the change in bytes.
    pub fn finish_relist(&mut self) -> i64 {
        let Some(relisted) = self.relisting.take() else {
            return 0;
        };
        let before: u64 = std::mem::replace(&mut self.held, relisted).values().sum();
        -(before as i64)
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

    #[tokio::test]
    async fn going_over_the_budget_is_told_once_with_the_kind_that_grew() {
        let budget = MemoryBudget::new(ByteSize(1000), None);
        assert!(budget.charge(600, "Secret"));
        assert!(budget.charge(300, "Job"));
        assert!(!budget.charge(200, "ClusterDeploymentCustomization"));
        assert!(!budget.charge(-900, "Secret"), "an exceeded budget stays exceeded");
        let overage = budget.exceeded().await;
        assert_eq!(overage.kind, "ClusterDeploymentCustomization");
        assert_eq!(overage.used, 1100);
        assert!(overage.to_string().contains("--tenant-memory-budget"), "{overage}");
    }

    #[test]
    fn a_relist_holds_both_copies_until_it_is_in() {
        let mut ledger = Ledger::default();
        assert_eq!(ledger.hold("a".into(), 100), 100);
        assert_eq!(ledger.hold("a".into(), 150), 50);
        ledger.start_relist();
        assert_eq!(ledger.hold("a".into(), 150), 150);
        assert_eq!(ledger.hold("b".into(), 10), 10);
        assert_eq!(ledger.finish_relist(), -150);
        assert_eq!(ledger.release("a"), -150);
        assert_eq!(ledger.release("missing"), 0);
    }
}
