//! Exponential backoff with a cap and jitter, for tenant restarts and per-object retries.

use std::time::Duration;

use rand::Rng;

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

#[cfg(test)]
mod tests {
    use super::*;

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
