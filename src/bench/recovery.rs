//! Recovery after a tenant API server restart (issues 15, 30): the server goes away for a while and
//! comes back with a fresh watch cache (resumed watches get 410), as kube-apiserver does after an
//! upgrade. How long until the daemon reports the tenant up, and how long an install created at
//! that moment takes, against the same install on a tenant that never went away (same run); the
//! latency breakdown of both says where the difference goes (`pickup` is the daemon seeing the
//! install: its watches resuming).
//!
//! Then the host restarts (issue 47) with installs in flight, as a control plane does: its API away
//! for a while, back with a fresh watch cache, its kubelet (the install pods' logs) a moment later.
//! Every install must be Ready after it with exactly one install Job, and the daemon must tell the
//! outage in a few lines whatever is in flight.

use std::time::{Duration, Instant};

use kube::Client;
use kube::api::Api;
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::BENCH_STACKD_IMAGE;
use super::fleet::{DaemonProcess, Fleet};
use super::latency::percentile;
use super::timeline::{LatencyBreakdown, Recorder};
use crate::api::stacks::StackInstall;
use crate::embedded::samples::slow_down;
use crate::embedded::{RestartState, Verb};

/// How long each restarted server refuses connections.
const DOWNTIME: Duration = Duration::from_secs(2);

/// Installs in flight when the host restarts (the six), how long its API is away, how much
/// later its kubelet answers, and how long each install pod runs (so that the restart finds some
/// running and some just finished).
const HOST_RESTART_INSTALLS: usize = 6;
const HOST_DOWNTIME: Duration = Duration::from_secs(4);
const KUBELET_LAG: Duration = Duration::from_secs(2);
const INSTALL_POD_TIME: Duration = Duration::from_millis(1500);

/// A host restart with installs in flight.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HostRestartFigures {
    pub installs: usize,
    /// Seconds the host's API refused connections, and how much later its kubelet answered.
    pub downtime_s: f64,
    pub kubelet_lag_s: f64,
    /// Installs in flight at the restart that were Ready within a minute of it.
    pub ready: usize,
    /// Seconds from the host's API answering again until the last of them was Ready.
    pub all_ready_after_s: f64,
    /// Install Jobs made per install (goal: exactly 1).
    pub jobs_per_install: f64,
    /// The daemon's log lines from the restart until every install was Ready (the Stack
    /// controller's line per change of a Stack's readiness aside; goal: at most 5).
    pub log_lines: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RecoveryFigures {
    pub restarts: usize,
    /// Seconds each restarted server refused connections.
    pub downtime_s: f64,
    /// Seconds from the restarted server answering until the daemon reports the tenant up.
    pub up_after_restart_s_p50: f64,
    pub up_after_restart_s_max: f64,
    /// Seconds until an install created as the server answers again is Ready (slowest restart).
    pub install_after_restart_s: f64,
    /// Seconds until the same install is Ready on a tenant that did not restart.
    pub install_baseline_s: f64,
    /// `install_after_restart_s / install_baseline_s`.
    pub install_after_restart_ratio: f64,
    /// `install_after_restart_s - install_baseline_s` (goal: at most 1 s).
    #[serde(default)]
    pub install_after_restart_extra_s: f64,
    /// Where the time of the installs after a restart goes.
    #[serde(default)]
    pub after_restart_breakdown: LatencyBreakdown,
    /// Where the time of the install on the settled tenant goes.
    #[serde(default)]
    pub baseline_breakdown: LatencyBreakdown,
    /// A host restart with installs in flight.
    #[serde(default)]
    pub host_restart: HostRestartFigures,
}

pub(super) async fn measure(restarts: usize) -> Result<RecoveryFigures, BenchError> {
    let fleet = Fleet::start(1).await?;
    let daemon = fleet.daemon(&[])?;
    daemon.wait_tenants_up(1, Duration::from_secs(60)).await?;
    let (tenant, server) = &fleet.tenants[0];
    let timeline = Recorder::start(&fleet.host, &fleet.tenants);
    let install_baseline_s = install_ready_s(&server.client().await, "baseline", &daemon).await?;
    let mut up = Vec::new();
    let mut installs = Vec::new();
    for index in 0..restarts {
        server.restart_after(RestartState::FreshWatchCache, DOWNTIME).await?;
        let answered = Instant::now();
        let client = server.client().await;
        let namespace = format!("after-{index}");
        let install = install_ready_s(&client, &namespace, &daemon);
        let (install, up_s) = tokio::join!(install, tenant_up_s(&daemon, tenant, answered));
        up.push(up_s?);
        installs.push(install?);
    }
    let after_restart_breakdown = timeline.breakdown_of(|namespace| namespace.starts_with("after-"));
    let baseline_breakdown = timeline.breakdown_of(|namespace| namespace == "baseline");
    drop(timeline);
    let host_restart = host_restart(&fleet, &server.client().await, &daemon).await?;
    daemon.kill().await;
    fleet.shutdown().await;
    let install_after_restart_s = installs.iter().copied().fold(0.0, f64::max);
    Ok(RecoveryFigures {
        restarts,
        downtime_s: DOWNTIME.as_secs_f64(),
        up_after_restart_s_p50: percentile(&mut up.clone(), 0.5),
        up_after_restart_s_max: up.iter().copied().fold(0.0, f64::max),
        install_after_restart_s,
        install_baseline_s,
        install_after_restart_ratio: install_after_restart_s / install_baseline_s.max(1e-6),
        install_after_restart_extra_s: install_after_restart_s - install_baseline_s,
        after_restart_breakdown,
        baseline_breakdown,
        host_restart,
    })
}

/// Restarts the host with [`HOST_RESTART_INSTALLS`] installs of `client`'s tenant in flight.
async fn host_restart(
    fleet: &Fleet,
    client: &Client,
    daemon: &DaemonProcess,
) -> Result<HostRestartFigures, BenchError> {
    let host = &fleet.host;
    slow_down(&host.runners(), BENCH_STACKD_IMAGE, INSTALL_POD_TIME);
    let jobs_made = || host.counters().get(Verb::Create, "jobs", None);
    let (jobs_before, lines_before) = (jobs_made(), log_lines(daemon).len());
    let namespaces: Vec<String> = (0..HOST_RESTART_INSTALLS)
        .map(|i| format!("host-restart-{i}"))
        .collect();
    for namespace in &namespaces {
        super::stacks::create(client, namespace).await?;
    }
    let created = Instant::now();
    while jobs_made() < jobs_before + HOST_RESTART_INSTALLS as u64 {
        if created.elapsed() > Duration::from_secs(60) {
            return Err(not_ready("host-restart-*", daemon));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    host.restart_host(HOST_DOWNTIME, KUBELET_LAG).await?;
    let answered = Instant::now();
    let waits = namespaces.iter().map(|namespace| {
        let installs: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
        tokio::time::timeout(
            Duration::from_secs(60),
            super::stacks::wait_ready(installs, 1, answered),
        )
    });
    let ready: Vec<f64> = futures::future::join_all(waits)
        .await
        .into_iter()
        .filter_map(|ready| ready.ok().and_then(|seconds| seconds.first().copied()))
        .collect();
    let jobs = jobs_made() - jobs_before;
    Ok(HostRestartFigures {
        installs: HOST_RESTART_INSTALLS,
        downtime_s: HOST_DOWNTIME.as_secs_f64(),
        kubelet_lag_s: KUBELET_LAG.as_secs_f64(),
        ready: ready.len(),
        all_ready_after_s: ready.iter().copied().fold(0.0, f64::max),
        jobs_per_install: jobs as f64 / HOST_RESTART_INSTALLS as f64,
        log_lines: log_lines(daemon).len().saturating_sub(lines_before),
    })
}

/// The daemon's log lines so far, but for the Stack controller's line per change of a Stack's
/// readiness (each install's progress, outage or not).
fn log_lines(daemon: &DaemonProcess) -> Vec<String> {
    std::fs::read_to_string(&daemon.log)
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.contains("stackd::stacks::stack::status"))
        .map(str::to_string)
        .collect()
}

/// Seconds from `since` until the daemon's metrics say `tenant` is up.
async fn tenant_up_s(daemon: &DaemonProcess, tenant: &str, since: Instant) -> Result<f64, BenchError> {
    let up = format!("stackd_tenant_up{{tenant=\"{tenant}\"}} 1");
    while since.elapsed() < Duration::from_secs(60) {
        if daemon.metrics().await.lines().any(|line| line == up) {
            return Ok(since.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(BenchError::Timeout(format!(
        "tenant {tenant} not up 60 s after its server answered; daemon log {}",
        daemon.log.display()
    )))
}

/// Creates an install in `namespace` and returns the seconds until it is Ready.
async fn install_ready_s(client: &Client, namespace: &str, daemon: &DaemonProcess) -> Result<f64, BenchError> {
    let started = Instant::now();
    super::stacks::create(client, namespace).await?;
    let installs: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
    // Watched: an install takes tens of milliseconds, so a poll's interval would be most of the figure.
    let ready = tokio::time::timeout(Duration::from_secs(60), super::stacks::wait_ready(installs, 1, started)).await;
    match ready.ok().and_then(|ready| ready.first().copied()) {
        Some(seconds) => Ok(seconds),
        None => Err(not_ready(namespace, daemon)),
    }
}

fn not_ready(namespace: &str, daemon: &DaemonProcess) -> BenchError {
    BenchError::Timeout(format!(
        "install {namespace}/sample not Ready within 60 s; daemon log {}",
        daemon.log.display()
    ))
}
