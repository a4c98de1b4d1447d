//! Recovery after a tenant API server restart (issues 15, 30): the server goes away for a while and
//! comes back with a fresh watch cache (resumed watches get 410), as kube-apiserver does after an
//! upgrade. How long until the daemon reports the tenant up, and how long an install created at
//! that moment takes, against the same install on a tenant that never went away (same run); the
//! latency breakdown of both says where the difference goes (`pickup` is the daemon seeing the
//! install: its watches resuming).

use std::time::{Duration, Instant};

use kube::Client;
use kube::api::Api;
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::{DaemonProcess, Fleet};
use super::latency::percentile;
use super::timeline::{LatencyBreakdown, Recorder};
use crate::api::stacks::StackInstall;
use crate::embedded::RestartState;

/// How long each restarted server refuses connections.
const DOWNTIME: Duration = Duration::from_secs(2);

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
    })
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
