//! Where an install's time goes. The servers run in the bench's process, so it reads their stores'
//! events as they happen and stamps the moments each install passes: created, first written by the
//! daemon, its Job made, the Job complete, its Stack made, the controller Deployment made and
//! available, the Stack Ready, the install Ready. The Job run and the Deployment rollout are the
//! embedded controller-manager's loops; every other phase is the daemon's (watch delivery, queue
//! wait and its own requests).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::broadcast::error::RecvError;

use super::latency::percentile;
use crate::embedded::ApiServer;
use crate::embedded::store::{EventType, StoreEvent};
use crate::host::labels::{PARENT_NAMESPACE_LABEL, TENANT_LABEL};

/// The moments of one install, in the order a healthy install passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Milestone {
    Created,
    Touched,
    JobCreated,
    JobComplete,
    StackCreated,
    DeploymentCreated,
    DeploymentAvailable,
    StackReady,
    InstallReady,
}

/// Each phase: its name, the milestones it spans, and whether the embedded loops own it.
const PHASES: [(&str, Milestone, Milestone, Owner); 8] = [
    ("pickup", Milestone::Created, Milestone::Touched, Owner::Daemon),
    ("job_created", Milestone::Touched, Milestone::JobCreated, Owner::Daemon),
    (
        "job_run",
        Milestone::JobCreated,
        Milestone::JobComplete,
        Owner::EmbeddedLoops,
    ),
    (
        "unpacked_to_stack",
        Milestone::JobComplete,
        Milestone::StackCreated,
        Owner::Daemon,
    ),
    (
        "stack_to_deployment",
        Milestone::StackCreated,
        Milestone::DeploymentCreated,
        Owner::Daemon,
    ),
    (
        "deployment_rollout",
        Milestone::DeploymentCreated,
        Milestone::DeploymentAvailable,
        Owner::EmbeddedLoops,
    ),
    (
        "stack_ready",
        Milestone::DeploymentAvailable,
        Milestone::StackReady,
        Owner::Daemon,
    ),
    (
        "install_ready",
        Milestone::StackReady,
        Milestone::InstallReady,
        Owner::Daemon,
    ),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    Daemon,
    EmbeddedLoops,
}

/// The breakdown of install time (seconds, p50 over the installs that passed every milestone).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LatencyBreakdown {
    pub phases_p50_s: BTreeMap<String, f64>,
    /// Time in the daemon's phases, per install.
    pub daemon_p50_s: f64,
    /// Time in the embedded controller-manager's phases (Job run, Deployment rollout), per install.
    pub embedded_loops_p50_s: f64,
    /// Installs that passed every milestone, of those created.
    pub complete_timelines: usize,
    /// Store events the recorder missed (a lagging subscription); the breakdown is partial if not 0.
    pub missed_events: u64,
}

/// (tenant, namespace): the bench makes one install per namespace.
type InstallKey = (String, String);

#[derive(Default)]
struct Stamps {
    first: BTreeMap<InstallKey, BTreeMap<Milestone, Instant>>,
}

impl Stamps {
    fn stamp(&mut self, key: InstallKey, milestone: Milestone, at: Instant) {
        self.first.entry(key).or_default().entry(milestone).or_insert(at);
    }
}

/// Records milestones from the host's and the tenants' stores until dropped.
pub(super) struct Recorder {
    stamps: Arc<Mutex<Stamps>>,
    missed: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Recorder {
    pub(super) fn start(host: &ApiServer, tenants: &[(String, ApiServer)]) -> Recorder {
        let stamps = Arc::new(Mutex::new(Stamps::default()));
        let missed = Arc::new(AtomicU64::new(0));
        let mut tasks = vec![spawn_listener(host, None, stamps.clone(), missed.clone())];
        for (name, server) in tenants {
            tasks.push(spawn_listener(
                server,
                Some(name.clone()),
                stamps.clone(),
                missed.clone(),
            ));
        }
        Recorder { stamps, missed, tasks }
    }

    pub(super) fn breakdown(&self) -> LatencyBreakdown {
        self.breakdown_of(|_| true)
    }

    /// The breakdown of the installs whose namespace `namespace` accepts.
    pub(super) fn breakdown_of(&self, namespace: impl Fn(&str) -> bool) -> LatencyBreakdown {
        let stamps = self.stamps.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut phases: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let (mut daemon, mut embedded) = (Vec::new(), Vec::new());
        let chosen = stamps.first.iter().filter(|((_, ns), _)| namespace(ns));
        for (_, milestones) in chosen {
            let Some(durations) = phase_durations(milestones) else {
                continue;
            };
            let (mut in_daemon, mut in_loops) = (0.0, 0.0);
            for ((name, _, _, owner), seconds) in PHASES.iter().zip(durations) {
                phases.entry(name).or_default().push(seconds);
                match owner {
                    Owner::Daemon => in_daemon += seconds,
                    Owner::EmbeddedLoops => in_loops += seconds,
                }
            }
            daemon.push(in_daemon);
            embedded.push(in_loops);
        }
        LatencyBreakdown {
            complete_timelines: daemon.len(),
            phases_p50_s: phases
                .into_iter()
                .map(|(name, mut values)| (name.to_string(), percentile(&mut values, 0.50)))
                .collect(),
            daemon_p50_s: percentile(&mut daemon, 0.50),
            embedded_loops_p50_s: percentile(&mut embedded, 0.50),
            missed_events: self.missed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Each phase's seconds, if the install passed every milestone.
fn phase_durations(milestones: &BTreeMap<Milestone, Instant>) -> Option<Vec<f64>> {
    PHASES
        .iter()
        .map(|(_, from, to, _)| {
            let (from, to) = (milestones.get(from)?, milestones.get(to)?);
            Some(to.saturating_duration_since(*from).as_secs_f64())
        })
        .collect()
}

/// `tenant` is None for the host.
fn spawn_listener(
    server: &ApiServer,
    tenant: Option<String>,
    stamps: Arc<Mutex<Stamps>>,
    missed: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let mut events = server.store().subscribe();
    tokio::spawn(async move {
        loop {
            let event = match events.recv().await {
                Ok(event) => event,
                Err(RecvError::Lagged(n)) => {
                    missed.fetch_add(n, Ordering::Relaxed);
                    continue;
                }
                Err(RecvError::Closed) => return,
            };
            let found = match &tenant {
                Some(tenant) => tenant_milestone(tenant, &event),
                None => host_milestone(&event),
            };
            if let Some((key, milestone)) = found {
                let mut stamps = stamps.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                stamps.stamp(key, milestone, Instant::now());
            }
        }
    })
}

fn tenant_milestone(tenant: &str, event: &StoreEvent) -> Option<(InstallKey, Milestone)> {
    let namespace = event.object["metadata"]["namespace"].as_str()?;
    let key = (tenant.to_string(), namespace.to_string());
    let milestone = match (event.resource.resource.as_str(), event.event_type) {
        ("stackinstalls", EventType::Added) => Milestone::Created,
        ("stackinstalls", _) if condition_true(&event.object, "Ready") => Milestone::InstallReady,
        ("stackinstalls", EventType::Modified) => Milestone::Touched,
        ("stacks", EventType::Added) => Milestone::StackCreated,
        ("stacks", _) if condition_true(&event.object, "Ready") => Milestone::StackReady,
        _ => return None,
    };
    Some((key, milestone))
}

fn host_milestone(event: &StoreEvent) -> Option<(InstallKey, Milestone)> {
    let labels = &event.object["metadata"]["labels"];
    let key = (
        labels[TENANT_LABEL].as_str()?.to_string(),
        labels[PARENT_NAMESPACE_LABEL].as_str()?.to_string(),
    );
    let milestone = match (event.resource.resource.as_str(), event.event_type) {
        ("jobs", EventType::Added) => Milestone::JobCreated,
        ("jobs", _) if condition_true(&event.object, "Complete") => Milestone::JobComplete,
        ("deployments", EventType::Added) => Milestone::DeploymentCreated,
        ("deployments", _) if event.object["status"]["availableReplicas"].as_i64() >= Some(1) => {
            Milestone::DeploymentAvailable
        }
        _ => return None,
    };
    Some((key, milestone))
}

fn condition_true(object: &Value, kind: &str) -> bool {
    object["status"]["conditions"]
        .as_array()
        .is_some_and(|conditions| conditions.iter().any(|c| c["type"] == kind && c["status"] == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn phases_follow_the_milestones_and_a_missing_one_drops_the_install() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let all = [
            (Milestone::Created, 0),
            (Milestone::Touched, 10),
            (Milestone::JobCreated, 30),
            (Milestone::JobComplete, 130),
            (Milestone::StackCreated, 180),
            (Milestone::DeploymentCreated, 200),
            (Milestone::DeploymentAvailable, 260),
            (Milestone::StackReady, 270),
            (Milestone::InstallReady, 300),
        ];
        let milestones: BTreeMap<_, _> = all.iter().map(|(m, ms)| (*m, at(*ms))).collect();
        let seconds = phase_durations(&milestones).expect("complete");
        let ms: Vec<u64> = seconds.iter().map(|s| (s * 1000.0).round() as u64).collect();
        assert_eq!(ms, [10, 20, 100, 50, 20, 60, 10, 30]);
        let embedded: f64 = PHASES
            .iter()
            .zip(&seconds)
            .filter(|((_, _, _, owner), _)| *owner == Owner::EmbeddedLoops)
            .map(|(_, s)| s)
            .sum();
        assert_eq!((embedded * 1000.0).round(), 160.0);

        let mut partial = milestones.clone();
        partial.remove(&Milestone::DeploymentAvailable);
        assert_eq!(phase_durations(&partial), None);
    }
}
