//! Coming back after an outage. A server that is down is asked again on a short, capped, jittered
//! interval, apart from the restart backoff: a tenant API server restarting for an upgrade must be
//! served again seconds after it answers, not after a minute of accumulated backoff.

use std::time::Duration;

use kube::runtime::utils::Backoff;
use rand::RngExt;

/// The longest wait between two attempts to reach a server that is down (probes and watch retries).
pub const RECOVERY_INTERVAL: Duration = Duration::from_secs(4);
const FIRST_RETRY: Duration = Duration::from_millis(250);

/// The wait before the next `/version` probe of a server that is down: jittered so that many
/// tenants (or many assets of one cluster) do not probe in step.
pub fn probe_delay() -> Duration {
    RECOVERY_INTERVAL.mul_f64(rand::rng().random_range(0.5..=1.0))
}

/// Retry delays of a failed list or watch: doubling from 250 ms, capped at [`RECOVERY_INTERVAL`],
/// jittered. kube's default grows to 30 s and resets only after two quiet minutes, so after a few
/// restarts in a row a controller could sit out half a minute after its server was back.
#[derive(Clone, Debug)]
pub struct WatchBackoff {
    next: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: FIRST_RETRY }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(RECOVERY_INTERVAL);
        Some(delay.mul_f64(rand::rng().random_range(0.5..=1.0)))
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = FIRST_RETRY;
    }
}

/// The backoff of a controller's merged trigger stream: none. Each watch it merges retries on its
/// own [`WatchBackoff`]; a backoff on the merged stream (kube's default) would stop every trigger
/// whenever any one watch fails, so after a tenant restart, when each of a controller's watches
/// fails once in turn, the controller saw no event for the sum of all those delays (up to minutes).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTriggerBackoff;

impl Iterator for NoTriggerBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl Backoff for NoTriggerBackoff {
    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_retries_grow_but_never_past_the_recovery_interval() {
        let mut backoff = WatchBackoff::default();
        let delays: Vec<Duration> = (&mut backoff).take(20).collect();
        assert!(delays[0] <= FIRST_RETRY);
        assert!(delays.iter().all(|d| *d <= RECOVERY_INTERVAL), "{delays:?}");
        assert!(delays[19] >= RECOVERY_INTERVAL / 2);
        backoff.reset();
        assert!(backoff.next().is_some_and(|d| d <= FIRST_RETRY));
    }

    #[test]
    fn probes_are_jittered_within_the_interval() {
        for _ in 0..100 {
            let delay = probe_delay();
            assert!(delay >= RECOVERY_INTERVAL / 2 && delay <= RECOVERY_INTERVAL);
        }
    }
}
