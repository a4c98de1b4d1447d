//! Each tenant namespace's share of the work of rendering install configs: reading a pool's
//! Secrets and applying ClusterDeploymentCustomization patches. Every bound on size holds for one
//! rendering, but a namespace editing large customizations many times a second pays for a full
//! one per edit: size × patches × edits. The work is counted as the Secret bytes read and the
//! install config measured after every patch, its bytes and the size of a value per value (what copying and checking a patched document
//! costs), and a namespace that used more than its share waits, its pools saying so, until it is
//! back.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The reason of a pool's `CapacityAvailable=False` while its namespace used its share.
pub(crate) const NAMESPACE_PATCH_SHARE_USED: &str = "NamespacePatchShareUsed";

/// The render work lately done per namespace, decaying at the share's rate
/// (`--namespace-render-bytes-per-second`, `--namespace-render-burst-bytes`).
#[derive(Debug)]
pub(crate) struct PatchShares {
    per_second: u64,
    burst: u64,
    used: Mutex<BTreeMap<String, Used>>,
}

#[derive(Debug, Clone, Copy)]
struct Used {
    bytes: f64,
    at: Instant,
}

impl Used {
    fn now(self, now: Instant, per_second: u64) -> f64 {
        let paid = now.saturating_duration_since(self.at).as_secs_f64() * per_second as f64;
        (self.bytes - paid).max(0.0)
    }
}

impl PatchShares {
    /// Shares of `per_second` bytes of work a second on average, `burst` at once (at least 1 each).
    pub(crate) fn new(per_second: u64, burst: u64) -> Self {
        PatchShares {
            per_second: per_second.max(1),
            burst: burst.max(1),
            used: Mutex::default(),
        }
    }

    /// Whether `namespace` may apply patches now; if not, how long until it may.
    pub(crate) fn admit(&self, namespace: &str) -> Result<(), Duration> {
        self.admit_at(namespace, Instant::now())
    }

    fn admit_at(&self, namespace: &str, now: Instant) -> Result<(), Duration> {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        // Namespaces whose work is paid off are forgotten: the map holds only those working.
        let per_second = self.per_second;
        used.retain(|_, u| u.now(now, per_second) > 0.0);
        let over = used.get(namespace).map_or(0.0, |u| u.now(now, per_second)) - self.burst as f64;
        if over < 0.0 {
            return Ok(());
        }
        Err(Duration::from_secs_f64(over / per_second as f64).max(Duration::from_millis(100)))
    }

    /// `namespace` read Secrets or applied patches that measured `bytes` in all.
    pub(crate) fn charge(&self, namespace: &str, bytes: u64) {
        self.charge_at(namespace, bytes, Instant::now());
    }

    fn charge_at(&self, namespace: &str, bytes: u64, now: Instant) {
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let before = used.get(namespace).map_or(0.0, |u| u.now(now, self.per_second));
        let bytes = before + bytes as f64;
        used.insert(namespace.to_string(), Used { bytes, at: now });
    }

    /// What a pool whose namespace used its share says (its `CapacityAvailable` condition). The
    /// same words for as long as it waits: a message that changed with the wait would be a status
    /// write per pass.
    pub(crate) fn share_used(&self, namespace: &str) -> String {
        format!(
            "Namespace {namespace} used its share of the work of rendering install configs \
             ({} MiB of Secrets read and patched install config a second, {} MiB at once); its pools render \
             again as soon as the share is back. Fewer or smaller patches, a smaller template, or fewer edits \
             of its customizations take less",
            mib(self.per_second),
            mib(self.burst),
        )
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
        .trim_end_matches(".0")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_past_its_burst_waits_until_its_work_is_paid_off_and_others_do_not() {
        let (per_second, burst) = (4 << 20, 32 << 20);
        let shares = PatchShares::new(per_second, burst);
        let start = Instant::now();
        assert_eq!(shares.admit_at("attacker", start), Ok(()));
        shares.charge_at("attacker", burst + 2 * per_second, start);
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
