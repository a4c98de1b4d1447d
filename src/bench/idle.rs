//! Idle tenants: what N tenants that ask for nothing cost the daemon (memory, watches) and the API
//! servers (requests per minute), against the floor the design implies.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::Fleet;
use crate::embedded::Verb;
use crate::embedded::counters::RequestCounts;

/// Seconds a cache's watch stays open before it is renewed, on average: its server-side timeout,
/// spread over 200–290 s by tenant and cache (`runtime::informers`).
const WATCH_RENEWAL_SECONDS: f64 = 245.0;
/// The daemon's default `--sweep-interval` (10m).
const SWEEP_INTERVAL_SECONDS: f64 = 600.0;
/// Lists one sweep interval brings: the orphan sweep's (the tenant's 8 parent kinds and the host's 7
/// kinds) and the quota check's (the ResourceQuota and the LimitRange).
const LISTS_PER_SWEEP: f64 = 17.0;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IdleFigures {
    pub tenants: usize,
    /// From the daemon's start until every tenant answered with stackd's CRDs served.
    pub startup_s: f64,
    pub rss_mb: f64,
    /// Watches open on each tenant server (mean).
    pub watches_per_tenant: f64,
    /// Watches open on the host server.
    pub host_watches: u64,
    /// Watches open on the host server per tenant (mean); the daemon's own, if any, included.
    #[serde(default)]
    pub host_watches_per_tenant: f64,
    pub idle_requests_per_minute_per_tenant: RequestRates,
    pub floor_requests_per_minute_per_tenant: RequestRates,
}

/// Requests per minute by what causes them.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestRates {
    pub watch_renewals: f64,
    pub sweeps: f64,
    pub lease_renewals: f64,
    /// Reachability probes (`runtime::reachability`, a one-item CRD list over a new connection): what
    /// watching the tenant for an outage costs while it is up. Asked only when something says the
    /// server may be gone (a failed request, a GOAWAY), so 0 at rest.
    #[serde(default)]
    pub probes: f64,
    /// Everything else: safety-net requeues and reconciles nothing asked for.
    pub other: f64,
}

pub(super) async fn measure(tenants: usize, window: Duration) -> Result<IdleFigures, BenchError> {
    let fleet = Fleet::start(tenants).await?;
    let started = Instant::now();
    let daemon = fleet.daemon(&[])?;
    daemon
        .wait_tenants_answering(tenants, Duration::from_secs(60 + tenants as u64))
        .await?;
    let startup_s = started.elapsed().as_secs_f64();
    // A tenant answers once its CRDs are seen; its start (host namespace, quota, the controllers'
    // first lists) and its first sweep go on after that, longer on a loaded machine.
    wait_until_quiet(&fleet, Duration::from_secs(2), Duration::from_secs(60)).await?;
    let before = fleet.counters();
    let window_started = Instant::now();
    tokio::time::sleep(window).await;
    let after = fleet.counters();
    let minutes = window_started.elapsed().as_secs_f64() / 60.0;
    let rss_mb = daemon.rss_mib().unwrap_or(0.0);
    let tenant_watches: u64 = fleet.tenants.iter().map(|(_, s)| s.open_watches()).sum();
    let host_watches = fleet.host.open_watches();
    let mut rates = RequestRates::default();
    for (now, then) in after.iter().zip(&before) {
        add_rates(&mut rates, &now.since(then));
    }
    let per = (tenants as f64) * minutes;
    let idle = RequestRates {
        watch_renewals: rates.watch_renewals / per,
        sweeps: rates.sweeps / per,
        lease_renewals: rates.lease_renewals / per,
        probes: rates.probes / per,
        other: rates.other / per,
    };
    let watches_per_tenant = tenant_watches as f64 / tenants as f64;
    let host_watches_per_tenant = host_watches as f64 / tenants as f64;
    let floor = RequestRates {
        watch_renewals: (watches_per_tenant + host_watches_per_tenant) * 60.0 / WATCH_RENEWAL_SECONDS,
        sweeps: LISTS_PER_SWEEP * 60.0 / SWEEP_INTERVAL_SECONDS,
        lease_renewals: 0.0,
        probes: 0.0,
        other: 0.0,
    };
    daemon.kill().await;
    fleet.shutdown().await;
    Ok(IdleFigures {
        tenants,
        startup_s,
        rss_mb,
        watches_per_tenant,
        host_watches,
        host_watches_per_tenant,
        idle_requests_per_minute_per_tenant: idle,
        floor_requests_per_minute_per_tenant: floor,
    })
}

/// Waits until no server has answered anything but watches for `quiet`.
pub(super) async fn wait_until_quiet(fleet: &Fleet, quiet: Duration, within: Duration) -> Result<(), BenchError> {
    let deadline = Instant::now() + within;
    let mut quiet_since = Instant::now();
    let mut before = fleet.counters();
    while quiet_since.elapsed() < quiet {
        if Instant::now() > deadline {
            return Err(BenchError::Timeout(format!(
                "the idle tenants' start-up requests did not stop within {within:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = fleet.counters();
        let busy = now.iter().zip(&before).any(|(now, then)| {
            now.since(then)
                .counts
                .iter()
                .any(|(key, n)| *n > 0 && key.verb != Verb::Watch)
        });
        if busy {
            quiet_since = Instant::now();
        }
        before = now;
    }
    Ok(())
}

/// Adds `counts` to `rates` by what caused each request.
pub(super) fn add_rates(rates: &mut RequestRates, counts: &RequestCounts) {
    for (key, n) in &counts.counts {
        let n = *n as f64;
        if key.resource.starts_with("leases") {
            rates.lease_renewals += n;
        } else if key.verb == Verb::Watch {
            rates.watch_renewals += n;
        } else if key.verb == Verb::List && key.resource.starts_with("customresourcedefinitions") {
            // The CRD cache lists only when it starts (or its watch expired): at rest, a probe.
            rates.probes += n;
        } else if key.verb == Verb::List {
            rates.sweeps += n;
        } else {
            rates.other += n;
        }
    }
}
