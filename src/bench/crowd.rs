//! A crowd of idle tenants on one replica (issue 32): how long one daemon takes to bring them all
//! up, what they cost in memory (in all and per tenant), the requests they make at rest, and
//! whether that rest is steady: the daemon's RSS and open sockets sampled over a window (10 minutes
//! in the full run).
//!
//! Every watch is a socket on both sides (kube's client speaks HTTP/1.1, one request a
//! connection), so the crowd is bounded by the open-files limit of the daemon and of this process,
//! which serves every tenant: a run asked for more tenants than fit says so
//! (`tenants_asked` against `tenants`) instead of failing half-way.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::fleet::{DaemonProcess, Fleet};
use super::idle::{RequestRates, add_rates, wait_until_quiet};
use super::{BenchError, HostWatches};
use crate::embedded::Verb;
use crate::embedded::counters::RequestCounts;

/// What to run.
#[derive(Clone, Debug)]
pub struct CrowdLoad {
    pub tenants: usize,
    /// How long the idle crowd is watched.
    pub window: Duration,
    /// How often the steady state is sampled within the window.
    pub sample_every: Duration,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CrowdFigures {
    pub tenants_asked: usize,
    /// Tenants run: `tenants_asked`, or fewer when the open-files limit cannot hold their sockets.
    pub tenants: usize,
    /// The open-files limit (the daemon's, inherited from this process).
    pub open_files_limit: u64,
    /// Sockets each tenant adds to the daemon (watches on both servers, pooled connections).
    pub sockets_per_tenant: f64,
    /// From the daemon's start until every tenant answered with stackd's CRDs served
    /// (`stackd_tenant_up`), as measured since issue 32.
    pub startup_s: f64,
    /// From the daemon's start until every tenant had started: every controller's caches filled,
    /// `[+]tenant … ok` on `/readyz?verbose` (0 in reports from before it was measured).
    #[serde(default)]
    pub started_s: f64,
    /// The daemon's RSS with every tenant up and settled.
    pub rss_mb: f64,
    /// The daemon's RSS with one tenant, measured the same way.
    pub one_tenant_rss_mb: f64,
    /// (rss_mb − one_tenant_rss_mb) / (tenants − 1).
    pub marginal_rss_per_tenant_mb: f64,
    pub watches_per_tenant: f64,
    /// Host watches per added tenant and per replica, between one tenant and the crowd.
    #[serde(default)]
    pub host_watches: HostWatches,
    /// All the host's watches over the tenants (the per-replica ones spread over them).
    pub host_watches_per_tenant: f64,
    /// Over the whole window, per tenant.
    pub idle_requests_per_minute_per_tenant: RequestRates,
    pub window_s: f64,
    pub samples: Vec<SteadySample>,
    /// Requests (watches left out) from the daemon's start until the crowd was quiet, per tenant:
    /// what a start costs each server, by `server verb resource` (issue 50).
    #[serde(default)]
    pub start_requests: StartRequests,
    /// Largest RSS over the smallest, minus 1, across the samples (goal: within 0.05).
    pub rss_spread: f64,
    /// The same for the daemon's open sockets.
    pub sockets_spread: f64,
}

/// What starting the crowd cost the servers, per tenant (watches left out: they are counted as
/// watches per tenant).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StartRequests {
    pub host: f64,
    pub tenant: f64,
    /// `host list jobs` → requests per tenant; every row of both servers.
    pub by_request: std::collections::BTreeMap<String, f64>,
}

impl StartRequests {
    /// Counts of the host (first) and tenant servers since `before`, over `tenants`.
    fn between(now: &[RequestCounts], before: &[RequestCounts], tenants: usize) -> StartRequests {
        let mut start = StartRequests::default();
        let per = tenants.max(1) as f64;
        for (at, (now, then)) in now.iter().zip(before).enumerate() {
            let server = if at == 0 { "host" } else { "tenant" };
            for (key, n) in now.since(then).counts {
                if key.verb == Verb::Watch {
                    continue;
                }
                let share = n as f64 / per;
                *start
                    .by_request
                    .entry(format!("{server} {} {}", key.verb.as_str(), key.resource))
                    .or_default() += share;
                if at == 0 {
                    start.host += share;
                } else {
                    start.tenant += share;
                }
            }
        }
        start
    }
}

/// The steady state at one moment of the window.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SteadySample {
    /// Seconds into the window.
    pub at_s: f64,
    pub rss_mb: f64,
    pub sockets: u64,
    /// Watches open on every server.
    pub watches: u64,
    /// Requests other than watches since the window began, every server.
    pub requests: u64,
}

pub async fn measure(load: &CrowdLoad) -> Result<CrowdFigures, BenchError> {
    let one = settle(1).await?;
    let (one_rss_mb, one_sockets) = (one.rss_mb, one.sockets);
    let one_host_watches = one.fleet.host.open_watches();
    one.stop().await;
    // Sockets grow by the same count with every tenant: measured between one and a few.
    let few = settle(PROBE_TENANTS).await?;
    let per_tenant = (few.sockets.saturating_sub(one_sockets) as f64 / (PROBE_TENANTS - 1) as f64).max(1.0);
    let fixed = one_sockets as f64 - per_tenant;
    few.stop().await;
    let limit = open_files_limit();
    let tenants = load.tenants.min(fitting(limit, fixed, per_tenant)).max(2);
    if tenants < load.tenants {
        eprintln!(
            "bench:   {} tenants need about {:.0} sockets on each side; the open-files limit is {limit}: running {tenants}",
            load.tenants,
            fixed + per_tenant * load.tenants as f64
        );
    }
    let crowd = settle(tenants).await?;
    let (samples, rates, window_s) = steady(&crowd, load).await;
    let per = tenants as f64 * window_s / 60.0;
    let figures = CrowdFigures {
        tenants_asked: load.tenants,
        tenants,
        open_files_limit: limit,
        sockets_per_tenant: per_tenant,
        startup_s: crowd.startup_s,
        started_s: crowd.started_s,
        rss_mb: crowd.rss_mb,
        one_tenant_rss_mb: one_rss_mb,
        marginal_rss_per_tenant_mb: (crowd.rss_mb - one_rss_mb) / (tenants - 1) as f64,
        watches_per_tenant: crowd.tenant_watches as f64 / tenants as f64,
        host_watches: HostWatches::between((1, one_host_watches), (tenants, crowd.fleet.host.open_watches())),
        host_watches_per_tenant: crowd.fleet.host.open_watches() as f64 / tenants as f64,
        idle_requests_per_minute_per_tenant: RequestRates {
            watch_renewals: rates.watch_renewals / per,
            sweeps: rates.sweeps / per,
            lease_renewals: rates.lease_renewals / per,
            probes: rates.probes / per,
            other: rates.other / per,
        },
        window_s,
        start_requests: crowd.start_requests.clone(),
        rss_spread: spread(samples.iter().map(|s| s.rss_mb)),
        sockets_spread: spread(samples.iter().map(|s| s.sockets as f64)),
        samples,
    };
    crowd.stop().await;
    Ok(figures)
}

/// Tenants of the run that measures what each adds in sockets.
const PROBE_TENANTS: usize = 6;

/// Tenants whose sockets fit the limit, beside `fixed` ones and room for this process's own files.
/// A fifth is kept spare: the probe counts pooled connections at one moment, and a crowd that runs
/// out of files cannot even read the daemon's `/proc` figures (a run of 811 on a 23-socket estimate
/// did, and sampled nothing for its first 270 s).
fn fitting(limit: u64, fixed: f64, sockets_per_tenant: f64) -> usize {
    const OWN_FILES: f64 = 512.0;
    const SPARE: f64 = 1.2;
    // The servers' side also holds a listener per tenant.
    ((limit as f64 - OWN_FILES - fixed) / ((sockets_per_tenant + 1.0) * SPARE)).max(0.0) as usize
}

/// A fleet of `tenants` with its daemon up and quiet.
struct Settled {
    fleet: Fleet,
    daemon: DaemonProcess,
    startup_s: f64,
    started_s: f64,
    rss_mb: f64,
    sockets: u64,
    tenant_watches: u64,
    start_requests: StartRequests,
}

impl Settled {
    async fn stop(self) {
        self.daemon.kill().await;
        self.fleet.shutdown().await;
    }
}

async fn settle(tenants: usize) -> Result<Settled, BenchError> {
    eprintln!("bench:   starting {tenants} tenant API server(s)");
    let fleet = Fleet::start(tenants).await?;
    let before = fleet.counters();
    let started = Instant::now();
    let daemon = fleet.daemon(&[])?;
    let within = Duration::from_secs(60 + tenants as u64 / 4);
    daemon.wait_tenants_answering(tenants, within).await?;
    let startup_s = started.elapsed().as_secs_f64();
    daemon.wait_tenants_up(tenants, within).await?;
    let started_s = started.elapsed().as_secs_f64();
    eprintln!("bench:   {tenants} tenant(s) answering in {startup_s:.2} s, started in {started_s:.2} s");
    wait_until_quiet(&fleet, Duration::from_secs(2), within).await?;
    let start_requests = StartRequests::between(&fleet.counters(), &before, tenants);
    Ok(Settled {
        start_requests,
        startup_s,
        started_s,
        rss_mb: daemon.rss_mib().unwrap_or(0.0),
        sockets: daemon_sockets(&daemon),
        tenant_watches: fleet.tenants.iter().map(|(_, s)| s.open_watches()).sum(),
        fleet,
        daemon,
    })
}

/// Samples the settled crowd over the window: the samples, the requests by cause, and the
/// window's length in seconds.
async fn steady(crowd: &Settled, load: &CrowdLoad) -> (Vec<SteadySample>, RequestRates, f64) {
    let before = crowd.fleet.counters();
    let started = Instant::now();
    let mut samples = Vec::new();
    loop {
        let now = crowd.fleet.counters();
        let requests = now
            .iter()
            .zip(&before)
            .flat_map(|(now, then)| now.since(then).counts.into_iter())
            .filter(|(key, _)| key.verb != Verb::Watch)
            .map(|(_, n)| n)
            .sum();
        let watches =
            crowd.fleet.host.open_watches() + crowd.fleet.tenants.iter().map(|(_, s)| s.open_watches()).sum::<u64>();
        samples.push(SteadySample {
            at_s: started.elapsed().as_secs_f64(),
            rss_mb: crowd.daemon.rss_mib().unwrap_or(0.0),
            sockets: daemon_sockets(&crowd.daemon),
            watches,
            requests,
        });
        if started.elapsed() >= load.window {
            break;
        }
        tokio::time::sleep(load.sample_every.min(load.window.saturating_sub(started.elapsed()))).await;
    }
    let window_s = started.elapsed().as_secs_f64();
    let mut rates = RequestRates::default();
    for (now, then) in crowd.fleet.counters().iter().zip(&before) {
        add_rates(&mut rates, &now.since(then));
    }
    (samples, rates, window_s)
}

/// Largest over smallest, minus 1; 0 without samples.
fn spread(values: impl Iterator<Item = f64>) -> f64 {
    // A sample that could not be read is 0: left out rather than taken for the smallest.
    let (low, high) = values
        .filter(|v| *v > 0.0)
        .fold((f64::MAX, 0.0_f64), |(low, high), v| (low.min(v), high.max(v)));
    if low > 0.0 && low < f64::MAX {
        high / low - 1.0
    } else {
        0.0
    }
}

/// Sockets the daemon holds open, from `/proc/<pid>/fd`; 0 where there is no procfs.
fn daemon_sockets(daemon: &DaemonProcess) -> u64 {
    let Some(pid) = daemon.child.id() else { return 0 };
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| std::fs::read_link(entry.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("socket:"))
        .count() as u64
}

/// This process's soft open-files limit (its children inherit it), from `/proc/self/limits`.
fn open_files_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| line.split_whitespace().nth(3))
        .and_then(|soft| soft.parse().ok())
        .unwrap_or(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crowd_fits_the_open_files_limit() {
        assert_eq!(fitting(20_000, 8.0, 22.0), 705);
        assert_eq!(fitting(100, 8.0, 22.0), 0);
    }

    #[test]
    fn spread_is_the_largest_over_the_smallest() {
        assert!((spread([100.0, 104.0, 102.0].into_iter()) - 0.04).abs() < 1e-9);
        assert_eq!(spread(std::iter::empty()), 0.0);
        assert!(
            (spread([0.0, 100.0, 110.0].into_iter()) - 0.1).abs() < 1e-9,
            "unread samples left out"
        );
    }

    #[test]
    fn this_process_has_an_open_files_limit() {
        assert!(open_files_limit() > 0);
    }
}
