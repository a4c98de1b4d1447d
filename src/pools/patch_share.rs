//! Each tenant namespace's share of the work of applying ClusterDeploymentCustomization patches.
//! Every bound on size holds for one application, but a namespace editing large customizations
//! many times a second pays for a full application per edit: size × patches × edits. The work is
//! counted as the install-config bytes measured after every patch (what copying and checking a
//! patched document costs), and a namespace that used more than its share waits, its pools
//! saying so, until it is back.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The patch work a namespace may cause per second, on average.
pub(crate) const PATCH_BYTES_PER_SECOND: u64 = 4 << 20;
/// The patch work a namespace may cause at once: a third of one application of 100 patches to a
/// 1 MiB install config, some hundred applications of a usual customization.
pub(crate) const PATCH_BYTES_BURST: u64 = 32 << 20;

/// The reason of a pool's `CapacityAvailable=False` while its namespace used its share.
pub(crate) const NAMESPACE_PATCH_SHARE_USED: &str = "NamespacePatchShareUsed";

/// The patch work lately done per namespace, decaying at [`PATCH_BYTES_PER_SECOND`].
#[derive(Debug, Default)]
pub(crate) struct PatchShares {
    used: Mutex<BTreeMap<String, Used>>,
}

#[derive(Debug, Clone, Copy)]
struct Used {
    bytes: f64,
    at: Instant,
}

impl Used {
    fn now(self, now: Instant) -> f64 {
        let paid = now.saturating_duration_since(self.at).as_secs_f64() * PATCH_BYTES_PER_SECOND as f64;
        (self.bytes - paid).max(0.0)
    }
}

impl PatchShares {
    /// Whether `namespace` may apply patches now; if not, how long until it may.
    pub(crate) fn admit(&self, namespace: &str) -> Result<(), Duration> {
        self.admit_at(namespace, Instant::now())
    }

    fn admit_at(&self, namespace: &str, now: Instant) -> Result<(), Duration> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        // Namespaces whose work is paid off are forgotten: the map holds only those working.
        used.retain(|_, u| u.now(now) > 0.0);
        let over = used.get(namespace).map_or(0.0, |u| u.now(now)) - PATCH_BYTES_BURST as f64;
        if over < 0.0 {
            return Ok(());
        }
        Err(Duration::from_secs_f64(over / PATCH_BYTES_PER_SECOND as f64).max(Duration::from_millis(100)))
    }

    /// `namespace` applied patches that measured `bytes` in all.
    pub(crate) fn charge(&self, namespace: &str, bytes: u64) {
        self.charge_at(namespace, bytes, Instant::now());
    }

    fn charge_at(&self, namespace: &str, bytes: u64, now: Instant) {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let before = used.get(namespace).map_or(0.0, |u| u.now(now));
        let bytes = before + bytes as f64;
        used.insert(namespace.to_string(), Used { bytes, at: now });
    }
}

/// What a pool whose namespace used its share says (its `CapacityAvailable` condition).
pub(crate) fn share_used(namespace: &str, wait: Duration) -> String {
    format!(
        "Namespace {namespace} used its share of the work of applying ClusterDeploymentCustomization patches \
         ({} MiB of patched install config a second, {} MiB at once); the pool applies patches again in {}s. \
         Fewer or smaller patches, or fewer edits of its customizations, take less",
        PATCH_BYTES_PER_SECOND >> 20,
        PATCH_BYTES_BURST >> 20,
        wait.as_secs().max(1)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_past_its_burst_waits_until_its_work_is_paid_off_and_others_do_not() {
        let shares = PatchShares::default();
        let start = Instant::now();
        assert_eq!(shares.admit_at("attacker", start), Ok(()));
        shares.charge_at("attacker", PATCH_BYTES_BURST + 2 * PATCH_BYTES_PER_SECOND, start);
        let wait = shares.admit_at("attacker", start).expect_err("over its share");
        assert_eq!(wait, Duration::from_secs(2));
        assert_eq!(shares.admit_at("other", start), Ok(()), "another namespace is not held");
        assert!(shares.admit_at("attacker", start + Duration::from_secs(1)).is_err());
        assert_eq!(shares.admit_at("attacker", start + Duration::from_millis(2001)), Ok(()));
        assert!(shares.used.lock().unwrap().contains_key("attacker"));
        assert_eq!(shares.admit_at("other", start + Duration::from_secs(20)), Ok(()));
        assert!(
            shares.used.lock().unwrap().is_empty(),
            "paid-off namespaces are forgotten"
        );
    }
}
