//! Exponential backoff with a cap and jitter, for tenant restarts and per-object retries.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rand::RngExt;

/// Doubles from `base` per failure up to `max`; ±10% jitter keeps tenants from retrying in step.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff { base, max }
    }

    /// The delay after `failures` consecutive failures (1 for the first).
    pub fn delay(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(20);
        let delay = self.base.saturating_mul(1 << exponent).min(self.max);
        let jitter = rand::rng().random_range(0.9..=1.1);
        delay.mul_f64(jitter).min(self.max)
    }
}

/// Consecutive failures per object, so each object backs off on its own (kube-runtime keeps none).
#[derive(Debug)]
pub struct ObjectBackoff {
    backoff: Backoff,
    failures: Mutex<HashMap<String, u32>>,
}

impl ObjectBackoff {
    pub fn new(backoff: Backoff) -> Self {
        ObjectBackoff {
            backoff,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Records a failure of `key` and returns how long to wait before retrying it.
    pub fn failed(&self, key: &str) -> Duration {
        self.failed_counted(key).1
    }

    /// Records a failure of `key`: how many in a row so far, and how long to wait.
    pub fn failed_counted(&self, key: &str) -> (u32, Duration) {
        let mut failures = self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = failures.entry(key.to_string()).or_insert(0);
        *count = count.saturating_add(1);
        (*count, self.backoff.delay(*count))
    }

    /// Failures of `key` in a row so far.
    pub fn failures(&self, key: &str) -> u32 {
        let failures = self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        failures.get(key).copied().unwrap_or(0)
    }

    /// Forgets the failures of `key` after it succeeded.
    pub fn succeeded(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_object_backs_off_on_its_own_and_resets_on_success() {
        let objects = ObjectBackoff::new(Backoff::new(Duration::from_secs(1), Duration::from_secs(60)));
        objects.failed("a");
        objects.failed("a");
        let third = objects.failed("a");
        assert!(third >= Duration::from_millis(3600), "{third:?}");
        let first_of_b = objects.failed("b");
        assert!(first_of_b <= Duration::from_millis(1100), "{first_of_b:?}");
        objects.succeeded("a");
        assert!(objects.failed("a") <= Duration::from_millis(1100));
    }

    #[test]
    fn delay_doubles_and_is_capped() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let first = backoff.delay(1);
        assert!(first >= Duration::from_millis(900) && first <= Duration::from_millis(1100));
        let fourth = backoff.delay(4);
        assert!(fourth >= Duration::from_millis(7200) && fourth <= Duration::from_millis(8800));
        assert!(backoff.delay(100) <= Duration::from_secs(60));
    }
}
