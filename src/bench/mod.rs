//! `stackd bench`: what one daemon costs per tenant and how fast and how economically it installs,
//! measured against embedded API servers in this process and the daemon as a child process. Every
//! figure that depends on the machine is also given as a ratio to a floor measured in the same run.

pub mod blast_radius;
pub mod chaos;
mod cost;
pub mod crowd;
pub mod fleet;
mod idle;
mod latency;
mod metal;
pub mod partition;
mod pools;
mod recovery;
pub mod shards;
mod stacks;
mod timeline;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use blast_radius::BlastRadiusFigures;
pub use crowd::CrowdFigures;
use fleet::TenantTransport;
pub use idle::IdleFigures;
pub use latency::LatencyFloor;
pub use pools::PoolFigures;
pub use recovery::RecoveryFigures;
pub use shards::ShardFigures;
pub use stacks::StackFigures;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot start an embedded API server: {0}")]
    Server(#[from] crate::embedded::Error),
    #[error("API request failed: {0}")]
    Api(#[from] kube::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("cannot read {path}: {reason}")]
    Baseline { path: PathBuf, reason: String },
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// CI-sized: small sweeps and short idle windows (under a minute in all).
    pub quick: bool,
    /// Keep the stack-install daemon's log here (`--keep-logs`), to read beside the latency breakdown.
    pub keep_logs: Option<std::path::PathBuf>,
    /// How the stacks scenario's tenants are spoken to (`--tenant-transport`).
    pub tenant_transport: fleet::TenantTransport,
}

impl BenchOptions {
    fn tenant_sweep(&self) -> Vec<usize> {
        if self.quick { vec![1, 5] } else { vec![1, 10, 100, 300] }
    }

    fn idle_window(&self) -> std::time::Duration {
        std::time::Duration::from_secs(if self.quick { 3 } else { 20 })
    }

    fn pool_size(&self) -> usize {
        if self.quick { 4 } else { 20 }
    }

    /// Tenant server restarts in the recovery scenario.
    fn restarts(&self) -> usize {
        if self.quick { 2 } else { 5 }
    }

    /// The shards scenario: 3 replicas (a fourth joining); 60 tenants with 15 s Leases (the
    /// issue's figures), or a CI-sized 13 with 6 s Leases.
    pub fn shard_load(&self) -> shards::ShardLoad {
        let (tenants, lease, renewals) = if self.quick { (13, 6, 3) } else { (60, 15, 6) };
        // Whole renew intervals (5/9 of the lease), so each replica's renewals fall in it equally.
        let renew_interval = std::time::Duration::from_secs(lease) * 5 / 9;
        shards::ShardLoad {
            replicas: 3,
            tenants,
            lease_duration_s: lease,
            steady_window: renew_interval * renewals,
        }
    }

    /// Round trips timed for the latency floor.
    fn floor_samples(&self) -> usize {
        if self.quick { 100 } else { 500 }
    }

    /// The crowd scenario: 1,000 idle tenants watched for 10 minutes, or a CI-sized 20 for 6 s.
    pub fn crowd_load(&self) -> crowd::CrowdLoad {
        let (tenants, window, every) = if self.quick { (20, 6, 2) } else { (1000, 600, 30) };
        crowd::CrowdLoad {
            tenants,
            window: std::time::Duration::from_secs(window),
            sample_every: std::time::Duration::from_secs(every),
        }
    }

    /// The blast-radius scenario's attacks and tenant B's work.
    pub fn blast_load(&self) -> blast_radius::BlastLoad {
        blast_radius::BlastLoad::new(self.quick)
    }

    /// (tenants, installs per tenant) of the stacks scenario.
    fn stack_load(&self) -> (usize, usize) {
        if self.quick { (2, 3) } else { (5, 10) }
    }
}

/// Every figure of one run; `--json` prints it, `--compare` reads an earlier one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    pub machine: Machine,
    pub quick: bool,
    pub latency_floor: LatencyFloor,
    pub tenants: Vec<IdleFigures>,
    /// RSS growth per added idle tenant, from the smallest to the largest tenant count.
    pub marginal_rss_per_tenant_mb: f64,
    /// Host watches each added tenant opens (between the same two counts; issue 32's goal: ≤ 4),
    /// and the ones the replica holds for all its tenants.
    #[serde(default)]
    pub host_watches: HostWatches,
    pub stacks: StackFigures,
    /// Requests per install divided by the minimum a correct install needs.
    pub requests_per_install_ratio: f64,
    pub pools: PoolFigures,
    /// CDCs leased to two clusters at once (pool scenario); must be 0.
    pub double_leases: u64,
    /// Recovery after tenant API server restarts.
    pub recovery: RecoveryFigures,
    /// One install alone on a settled tenant (the recovery scenario's baseline) over the minimum
    /// sequential requests × the round-trip floor (goal: at most 20; absent, 0, before 2026-11-28).
    #[serde(default)]
    pub install_alone_floor_multiple: f64,
    /// Replicas sharing the tenants over shard Leases (absent in reports from before it).
    #[serde(default)]
    pub shards: Option<ShardFigures>,
    /// Many idle tenants on one replica, and their steady state (absent in reports from before it).
    #[serde(default)]
    pub crowd: Option<CrowdFigures>,
    /// One tenant attacking while another works (absent in reports from before it).
    #[serde(default)]
    pub blast_radius: Option<BlastRadiusFigures>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub os: String,
    pub stackd_version: String,
}

impl Machine {
    fn here() -> Machine {
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            os: std::env::consts::OS.to_string(),
            stackd_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

pub async fn run(options: &BenchOptions) -> Result<Report, BenchError> {
    eprintln!("bench: measuring the API round-trip floor");
    let latency_floor = latency::measure(options.floor_samples()).await?;
    let mut tenants = Vec::new();
    for count in options.tenant_sweep() {
        eprintln!("bench: {count} idle tenant(s)");
        let figures = idle::measure(count, options.idle_window()).await?;
        eprintln!(
            "bench:   up in {:.2} s, RSS {:.1} MiB, {:.1} watches per tenant, {:.1} host watches per tenant",
            figures.startup_s, figures.rss_mb, figures.watches_per_tenant, figures.host_watches_per_tenant
        );
        tenants.push(figures);
    }
    let (marginal_rss_per_tenant_mb, host_watches) = match (tenants.first(), tenants.last()) {
        (Some(small), Some(large)) if large.tenants > small.tenants => {
            let added = (large.tenants - small.tenants) as f64;
            let watches =
                HostWatches::between((small.tenants, small.host_watches), (large.tenants, large.host_watches));
            ((large.rss_mb - small.rss_mb) / added, watches)
        }
        _ => (0.0, HostWatches::default()),
    };
    let (stack_tenants, installs) = options.stack_load();
    eprintln!("bench: {installs} StackInstalls in each of {stack_tenants} tenants");
    let stacks = stacks::measure(stack_tenants, installs, &latency_floor, options).await?;
    eprintln!("bench: a pool of {} filled by two racing daemons", options.pool_size());
    let pools = pools::measure(options.pool_size()).await?;
    eprintln!("bench: {} tenant API server restarts", options.restarts());
    let recovery = recovery::measure(options.restarts()).await?;
    let load = options.shard_load();
    eprintln!(
        "bench: {} replicas sharing {} tenants, then one more",
        load.replicas, load.tenants
    );
    let shards = shards::measure(&load, options.keep_logs.as_deref()).await?;
    let crowd = run_crowd(options).await?;
    eprintln!("bench: blast radius: tenant A attacking while tenant B installs");
    let blast_radius = blast_radius::measure(&options.blast_load(), options.keep_logs.as_deref()).await?;
    let install_alone_floor_multiple = recovery.install_baseline_s * 1000.0
        / (stacks::MINIMUM_REQUESTS_PER_INSTALL * latency_floor.rtt_ms_p50.max(1e-6));
    Ok(Report {
        install_alone_floor_multiple,
        shards: Some(shards),
        crowd: Some(crowd),
        blast_radius: Some(blast_radius),
        machine: Machine::here(),
        quick: options.quick,
        latency_floor,
        tenants,
        marginal_rss_per_tenant_mb,
        host_watches,
        requests_per_install_ratio: stacks.requests_per_install / stacks.minimum_requests_per_install,
        stacks,
        double_leases: pools.double_leases,
        pools,
        recovery,
    })
}

/// The stacks scenario alone (`stackd bench --only stacks`), with its own latency floor.
pub async fn run_stacks(options: &BenchOptions) -> Result<StackFigures, BenchError> {
    let latency_floor = latency::measure(options.floor_samples()).await?;
    let (tenants, installs) = options.stack_load();
    stacks::measure(tenants, installs, &latency_floor, options).await
}

/// The crowd scenario (`stackd bench --only crowd`, and last in a whole run).
pub async fn run_crowd(options: &BenchOptions) -> Result<CrowdFigures, BenchError> {
    let load = options.crowd_load();
    eprintln!(
        "bench: {} idle tenants on one replica, watched for {:?}",
        load.tenants, load.window
    );
    crowd::measure(&load).await
}

/// The recovery scenario alone (`stackd bench --only recovery`).
pub async fn run_recovery(options: &BenchOptions) -> Result<RecoveryFigures, BenchError> {
    recovery::measure(options.restarts()).await
}

/// The blast-radius scenario alone (`stackd bench --only blast-radius`).
pub async fn run_blast_radius(options: &BenchOptions) -> Result<BlastRadiusFigures, BenchError> {
    blast_radius::measure(&options.blast_load(), options.keep_logs.as_deref()).await
}

/// Host watches as a line through two tenant counts: what each added tenant opens, and what the
/// replica holds for all of them (the shared watch of host namespaces and their RoleBindings).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HostWatches {
    pub per_tenant: f64,
    pub per_replica: f64,
}

impl HostWatches {
    /// The line through `(tenants, host watches)` at two tenant counts (`small.0 < large.0`).
    pub fn between(small: (usize, u64), large: (usize, u64)) -> HostWatches {
        let per_tenant = (large.1 as f64 - small.1 as f64) / (large.0 - small.0) as f64;
        HostWatches {
            per_tenant,
            per_replica: small.1 as f64 - per_tenant * small.0 as f64,
        }
    }
}

/// The figures compared between runs, by name (lower is better for all of them).
fn headline(report: &Report) -> BTreeMap<&'static str, f64> {
    let mut figures = BTreeMap::from([
        ("marginal_rss_per_tenant_mb", report.marginal_rss_per_tenant_mb),
        ("requests_per_install_ratio", report.requests_per_install_ratio),
        ("install_p50_floor_multiple", report.stacks.install_p50_floor_multiple),
        (
            "watches_per_tenant",
            report.tenants.last().map_or(0.0, |t| t.watches_per_tenant),
        ),
        ("host_watches_per_tenant", report.host_watches.per_tenant),
        (
            "install_after_restart_ratio",
            report.recovery.install_after_restart_ratio,
        ),
        (
            "daemon_cpu_ms_per_install",
            report.stacks.cost.daemon_cpu_ms_per_install,
        ),
        (
            "servers_cpu_ms_per_install",
            report.stacks.cost.servers_cpu_ms_per_install,
        ),
        ("install_p50_over_half_cpu_bound", p50_over_half_bound(&report.stacks)),
        (
            "crowd_marginal_rss_per_tenant_mb",
            report.crowd.as_ref().map_or(0.0, |c| c.marginal_rss_per_tenant_mb),
        ),
    ]);
    if let Some(blast) = &report.blast_radius {
        figures.insert("blast_radius_install_p50_ratio", blast.install_p50_ratio);
        figures.insert("blast_radius_peak_rss_of_limit", blast.peak_rss_of_limit);
    }
    figures
}

/// The install p50 over half the CPU bound (the median install cannot finish sooner); 0 unmeasured.
pub fn p50_over_half_bound(s: &StackFigures) -> f64 {
    let half = s.cost.cpu_bound_s / 2.0;
    if half > 0.0 { s.install_p50_s / half } else { 0.0 }
}

/// The crowd scenario's lines of the table.
pub fn crowd_lines(c: &CrowdFigures) -> String {
    let mut out = String::new();
    let r = &c.idle_requests_per_minute_per_tenant;
    line(
        &mut out,
        format!(
            "\ncrowd: {} idle tenants on one replica ({} asked; open-files limit {}, {:.0} sockets per tenant): answering in {:.2} s, started in {:.2} s, RSS {:.1} MiB ({:.1} with one), marginal {:.2} MiB per tenant; {:.1} watches per tenant, host watches {:.1} per added tenant and {:.1} per replica",
            c.tenants,
            c.tenants_asked,
            c.open_files_limit,
            c.sockets_per_tenant,
            c.startup_s,
            c.started_s,
            c.rss_mb,
            c.one_tenant_rss_mb,
            c.marginal_rss_per_tenant_mb,
            c.watches_per_tenant,
            c.host_watches.per_tenant,
            c.host_watches.per_replica
        ),
    );
    line(
        &mut out,
        format!(
            "crowd at rest for {:.0} s ({} samples): requests/min/tenant watch {:.3}, sweep {:.3}, lease {:.3}, probe {:.3}, other {:.3}; RSS spread {:.1}%, sockets spread {:.1}% (goal within 5%)",
            c.window_s,
            c.samples.len(),
            r.watch_renewals,
            r.sweeps,
            r.lease_renewals,
            r.probes,
            r.other,
            c.rss_spread * 100.0,
            c.sockets_spread * 100.0
        ),
    );
    let start = &c.start_requests;
    let rows: Vec<String> = start
        .by_request
        .iter()
        .filter(|(_, n)| **n >= 0.05)
        .map(|(request, n)| format!("{request} {n:.1}"))
        .collect();
    line(
        &mut out,
        format!(
            "crowd start: requests per tenant host {:.1}, tenant {:.1} ({})",
            start.host,
            start.tenant,
            rows.join(", ")
        ),
    );
    out
}

/// The shards scenario's line of the table.
pub fn shard_line(s: &ShardFigures) -> String {
    format!(
        "\nshards: {} replicas, {} tenants ({} s Leases): all up in {:.2} s; tenants per replica {:?} (max/min {:.2}); a replica joining: {:?}, {} tenants moved; after kill -9 of the busiest ({} tenants), {} moved, up elsewhere in {:.2} s (goal {} s); served twice: {} by records, {} by requests (scheduling lag up to {:.0} ms); Lease and map writes {:.1}/min ({:.2} per replica per lease duration)",
        s.replicas,
        s.tenants,
        s.lease_duration_s,
        s.all_up_s,
        s.tenants_per_replica,
        s.balance_max_over_min,
        s.tenants_per_replica_after_join,
        s.moved_on_join,
        s.killed_had,
        s.moved_on_kill,
        s.takeover_s,
        s.lease_duration_s + 5,
        s.served_twice_by_records,
        s.served_twice_by_requests,
        s.scheduling_lag_max_ms,
        s.lease_writes_per_minute,
        s.lease_writes_per_replica_per_lease_duration
    )
}

fn line(out: &mut String, text: String) {
    out.push_str(&text);
    out.push('\n');
}

/// The stacks scenario's lines of the table.
pub fn stacks_lines(s: &StackFigures) -> String {
    let mut out = String::new();
    line(
        &mut out,
        format!(
            "\nstacks: {} installs over {} tenants{}, all created in {:.2} s and Ready in {:.2} s; per install p50 {:.2} s, p99 {:.2} s ({:.1}x the floor of {} sequential round trips)",
            s.installs,
            s.tenants,
            match s.tenant_transport {
                Some(TenantTransport::Http2) => " (https, HTTP/2)",
                Some(TenantTransport::Http1) => " (https, HTTP/1.1)",
                Some(TenantTransport::Plain) => " (plain http)",
                None => "",
            },
            s.all_created_s,
            s.all_ready_s,
            s.install_p50_s,
            s.install_p99_s,
            s.install_p50_floor_multiple,
            s.minimum_requests_per_install
        ),
    );
    let verbs: Vec<String> = s
        .requests_per_install_by_verb
        .iter()
        .map(|(verb, n)| format!("{verb} {n:.1}"))
        .collect();
    line(
        &mut out,
        format!(
            "requests per install: {:.1} ({}); minimum {}; ratio {:.2}; plus {:.1} Events",
            s.requests_per_install,
            verbs.join(", "),
            s.minimum_requests_per_install,
            s.requests_per_install / s.minimum_requests_per_install,
            s.events_per_install
        ),
    );
    let resources: Vec<String> = s
        .requests_per_install_by_resource
        .iter()
        .map(|(request, n)| format!("{request} {n:.2}"))
        .collect();
    line(
        &mut out,
        format!("requests per install by resource: {}", resources.join(", ")),
    );
    let b = &s.latency_breakdown;
    let phases: Vec<String> = b
        .phases_p50_s
        .iter()
        .map(|(phase, seconds)| format!("{phase} {seconds:.3}"))
        .collect();
    line(
        &mut out,
        format!(
            "install time p50: daemon {:.3} s, embedded loops {:.3} s ({} of {} timelines; missed events {}); phases p50 s: {}",
            b.daemon_p50_s,
            b.embedded_loops_p50_s,
            b.complete_timelines,
            s.installs,
            b.missed_events,
            phases.join(", ")
        ),
    );
    let c = &s.cost;
    let per_controller: Vec<String> = c
        .reconciles_per_install
        .iter()
        .map(|(controller, n)| {
            let ms = c.reconcile_ms_per_install.get(controller).copied().unwrap_or_default();
            format!("{controller} {n:.1} ({ms:.0} ms)")
        })
        .collect();
    line(
        &mut out,
        format!(
            "cpu per install: daemon {:.0} ms, servers {:.0} ms ({:.0}% of {} cores busy); CPU bound {:.2} s, p50 {:.2}x half of it; reconciles per install (time in them): {}",
            c.daemon_cpu_ms_per_install,
            c.servers_cpu_ms_per_install,
            c.cores_busy_fraction * 100.0,
            c.cores,
            c.cpu_bound_s,
            p50_over_half_bound(s),
            per_controller.join(", ")
        ),
    );
    out
}

/// The recovery scenario's lines of the table.
pub fn recovery_lines(r: &RecoveryFigures) -> String {
    let mut out = String::new();
    line(
        &mut out,
        format!(
            "\nrecovery: {} tenant server restarts ({:.0} s down, fresh watch cache); tenant up {:.2} s (p50), {:.2} s (max) after the server answered; an install then Ready in {:.2} s vs {:.2} s without a restart ({:.2}x, {:+.2} s; goal at most 1 s more)",
            r.restarts,
            r.downtime_s,
            r.up_after_restart_s_p50,
            r.up_after_restart_s_max,
            r.install_after_restart_s,
            r.install_baseline_s,
            r.install_after_restart_ratio,
            r.install_after_restart_extra_s
        ),
    );
    let h = &r.host_restart;
    line(
        &mut out,
        format!(
            "recovery: a host restart ({:.0} s down, fresh watch cache, kubelet {:.0} s later) with {} installs in flight: {} Ready {:.2} s after the host answered; {:.2} install Jobs per install (goal exactly 1); {} daemon log lines (goal at most 5)",
            h.downtime_s, h.kubelet_lag_s, h.installs, h.ready, h.all_ready_after_s, h.jobs_per_install, h.log_lines
        ),
    );
    for (what, b) in [
        ("after a restart", &r.after_restart_breakdown),
        ("settled", &r.baseline_breakdown),
    ] {
        let phases: Vec<String> = b
            .phases_p50_s
            .iter()
            .map(|(phase, seconds)| format!("{phase} {seconds:.3}"))
            .collect();
        line(
            &mut out,
            format!(
                "install time {what} p50: daemon {:.3} s, embedded loops {:.3} s ({} timelines); phases s: {}",
                b.daemon_p50_s,
                b.embedded_loops_p50_s,
                b.complete_timelines,
                phases.join(", ")
            ),
        );
    }
    out
}

/// Reads an earlier `--json` report.
pub fn load(path: &PathBuf) -> Result<Report, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::Baseline {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| BenchError::Baseline {
        path: path.clone(),
        reason: e.to_string(),
    })
}

/// The idle-tenant lines of the table.
fn idle_lines(report: &Report) -> String {
    let mut out = String::new();
    line(
        &mut out,
        "\nidle tenants   startup s   RSS MiB   watches/tenant   requests/min/tenant (watch, sweep, lease, probe, other)   floor"
            .into(),
    );
    for t in &report.tenants {
        let r = &t.idle_requests_per_minute_per_tenant;
        let f = &t.floor_requests_per_minute_per_tenant;
        line(
            &mut out,
            format!(
                "{:>12}   {:>9.2}   {:>7.1}   {:>14.1}   {:>8.2} {:>6.2} {:>6.2} {:>6.2} {:>6.2}                      {:.2}",
                t.tenants,
                t.startup_s,
                t.rss_mb,
                t.watches_per_tenant,
                r.watch_renewals,
                r.sweeps,
                r.lease_renewals,
                r.probes,
                r.other,
                f.watch_renewals + f.sweeps + f.lease_renewals + f.probes + f.other,
            ),
        );
    }
    line(
        &mut out,
        format!("marginal RSS per tenant: {:.2} MiB", report.marginal_rss_per_tenant_mb),
    );
    line(
        &mut out,
        format!(
            "host watches: {:.1} per added tenant, {:.1} per replica",
            report.host_watches.per_tenant, report.host_watches.per_replica
        ),
    );
    out
}

/// The headline figures against a baseline's.
fn comparison_lines(report: &Report, baseline: &Report) -> String {
    let mut out = String::new();
    line(&mut out, "\ncompared with the baseline (this / baseline):".into());
    let before = headline(baseline);
    for (name, now) in headline(report) {
        let then = before.get(name).copied().unwrap_or(0.0);
        let ratio = if then > 0.0 { now / then } else { f64::NAN };
        line(
            &mut out,
            format!("  {name:<32} {now:>10.3} vs {then:>10.3}  = {ratio:.2}x"),
        );
    }
    out
}

/// The human-readable table of a report, with a comparison column when a baseline is given.
pub fn table(report: &Report, baseline: Option<&Report>) -> String {
    let mut out = String::new();
    line(
        &mut out,
        format!(
            "stackd bench ({}; {} cpus)",
            if report.quick { "quick" } else { "full" },
            report.machine.cpus
        ),
    );
    let floor = &report.latency_floor;
    line(
        &mut out,
        format!(
            "\nlatency floor: API round trip p50 {:.3} ms, p99 {:.3} ms ({} samples)",
            floor.rtt_ms_p50, floor.rtt_ms_p99, floor.samples
        ),
    );
    out.push_str(&idle_lines(report));
    out.push_str(&stacks_lines(&report.stacks));
    let p = &report.pools;
    line(
        &mut out,
        format!(
            "\npools: size {} filled by {} racing daemons in {:.2} s; lease conflicts {}; double leases {}",
            p.size, p.daemons, p.fill_s, p.lease_conflicts, p.double_leases
        ),
    );
    out.push_str(&recovery_lines(&report.recovery));
    line(
        &mut out,
        format!(
            "one install alone: Ready in {:.3} s, {:.1}x the floor of {} sequential round trips (goal at most 20x)",
            report.recovery.install_baseline_s,
            report.install_alone_floor_multiple,
            stacks::MINIMUM_REQUESTS_PER_INSTALL
        ),
    );
    if let Some(s) = &report.shards {
        line(&mut out, shard_line(s));
    }
    if let Some(c) = &report.crowd {
        out.push_str(&crowd_lines(c));
    }
    if let Some(blast) = &report.blast_radius {
        out.push_str(&blast_radius::lines(blast));
    }
    if let Some(baseline) = baseline {
        out.push_str(&comparison_lines(report, baseline));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_watches_split_into_each_tenants_and_the_replicas() {
        let watches = HostWatches::between((1, 6), (5, 22));
        assert_eq!((watches.per_tenant, watches.per_replica), (4.0, 2.0));
    }

    fn report(ratio: f64) -> Report {
        Report {
            machine: Machine::here(),
            quick: true,
            latency_floor: LatencyFloor {
                rtt_ms_p50: 1.0,
                rtt_ms_p99: 2.0,
                samples: 10,
            },
            tenants: Vec::new(),
            marginal_rss_per_tenant_mb: 2.0,
            host_watches: HostWatches::between((1, 6), (5, 22)),
            stacks: StackFigures {
                tenant_transport: None,
                tenants: 1,
                installs: 1,
                all_created_s: 0.1,
                all_ready_s: 1.0,
                install_p50_s: 1.0,
                install_p99_s: 1.0,
                install_p50_floor_multiple: 50.0,
                requests_per_install: 18.0 * ratio,
                requests_per_install_by_verb: BTreeMap::new(),
                requests_per_install_by_resource: BTreeMap::new(),
                events_per_install: 5.0,
                minimum_requests_per_install: 18.0,
                latency_breakdown: Default::default(),
                cost: Default::default(),
            },
            requests_per_install_ratio: ratio,
            pools: PoolFigures {
                size: 2,
                daemons: 2,
                fill_s: 1.0,
                lease_conflicts: 0,
                double_leases: 0,
            },
            double_leases: 0,
            recovery: RecoveryFigures {
                restarts: 1,
                downtime_s: 2.0,
                up_after_restart_s_p50: 1.0,
                up_after_restart_s_max: 1.0,
                install_after_restart_s: 1.0,
                install_baseline_s: 1.0,
                install_after_restart_ratio: 1.0,
                install_after_restart_extra_s: 0.0,
                after_restart_breakdown: Default::default(),
                baseline_breakdown: Default::default(),
                host_restart: Default::default(),
            },
            install_alone_floor_multiple: 10.0,
            shards: None,
            crowd: None,
            blast_radius: None,
        }
    }

    #[test]
    fn a_comparison_prints_each_headline_as_a_ratio_to_the_baseline() {
        let table = table(&report(3.0), Some(&report(1.5)));
        let line = table
            .lines()
            .find(|l| l.contains("requests_per_install_ratio"))
            .expect("the ratio is compared");
        assert!(line.trim_end().ends_with("= 2.00x"), "{line}");
    }

    #[test]
    fn a_saved_report_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        std::fs::write(&path, serde_json::to_string(&report(1.2)).unwrap()).unwrap();
        assert_eq!(load(&path).unwrap().requests_per_install_ratio, 1.2);
        assert!(load(&dir.path().join("missing.json")).is_err());
    }
}
