//! Stack installs at scale: M StackInstalls in each of N tenants, created at once; how long until
//! each is Ready, and how many API requests each cost against the minimum a correct install needs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::cost::{CostFigures, Snapshot};
use super::fleet::{Fleet, TenantTransport};
use super::latency::{LatencyFloor, percentile};
use super::timeline::{LatencyBreakdown, Recorder};
use super::{BenchError, BenchOptions};
use crate::api::stacks::StackInstall;
use crate::embedded::counters::RequestCounts;
use crate::runtime::conditions::is_true;

/// The requests a correct install of the sample stack (one CRD) cannot do without, from DESIGN.md §3:
/// on the tenant the install's finalizer and status, the CRD, the Stack (created with its
/// finalizer), the ServiceAccount, the system ClusterRole, its binding, three persona roles, the
/// token Secret, one GET of it once filled (tenant Secrets are watched by metadata only: any user
/// can label a Secret as stackd's) and the Stack's status; on the host the Job, the list of its pods,
/// the pod's log, the Deployment, the token Secret and the completed Job's deletion (it would hold
/// the tenant's Job quota). Everything else is read from watches, so no other GET is needed.
/// (18 until issue 20: the Stack's finalizer was a patch of its own; 17 until issue 28.)
pub(super) const MINIMUM_REQUESTS_PER_INSTALL: f64 = 19.0;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StackFigures {
    pub tenants: usize,
    /// How the tenants were spoken to (absent in runs before it could be chosen: plain http
    /// before 2026-11-27, https with HTTP/2 after).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_transport: Option<TenantTransport>,
    pub installs: usize,
    /// Seconds until the bench had created every namespace and install (one after another per
    /// tenant, tenants in turn): the p50 counts from the start, so this is part of it. Absent
    /// (0) in runs before 2026-11-27.
    #[serde(default)]
    pub all_created_s: f64,
    pub all_ready_s: f64,
    pub install_p50_s: f64,
    pub install_p99_s: f64,
    /// p50 install time divided by (minimum sequential requests × the round-trip floor).
    pub install_p50_floor_multiple: f64,
    /// API requests per install, Events not counted.
    pub requests_per_install: f64,
    pub requests_per_install_by_verb: BTreeMap<String, f64>,
    /// The same by "verb resource" (the host's and every tenant's summed), to trace what is spent.
    #[serde(default)]
    pub requests_per_install_by_resource: BTreeMap<String, f64>,
    /// Event writes per install (one per state change a user would want to see).
    pub events_per_install: f64,
    pub minimum_requests_per_install: f64,
    /// Where install time goes: the daemon's phases against the embedded loops'.
    #[serde(default)]
    pub latency_breakdown: LatencyBreakdown,
    /// Where the CPU went while the installs ran.
    #[serde(default)]
    pub cost: CostFigures,
}

pub(super) async fn measure(
    tenants: usize,
    per_tenant: usize,
    floor: &LatencyFloor,
    options: &BenchOptions,
) -> Result<StackFigures, BenchError> {
    let mut fleet = Fleet::start_with(tenants, options.tenant_transport).await?;
    if let Some(dir) = options.keep_logs.as_deref() {
        fleet.keep_logs(dir)?;
    }
    let daemon = fleet.daemon(&[])?;
    daemon.wait_tenants_up(tenants, Duration::from_secs(60)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = fleet.counters();
    let cost_before = Snapshot::take(&daemon).await;
    let timeline = Recorder::start(&fleet.host, &fleet.tenants);
    let started = Instant::now();
    let mut waits = Vec::new();
    for (_, server) in &fleet.tenants {
        let client = server.client().await;
        waits.push(tokio::spawn(wait_ready(Api::all(client.clone()), per_tenant, started)));
        for index in 0..per_tenant {
            create(&client, &format!("team-{index}")).await?;
        }
    }
    let all_created_s = started.elapsed().as_secs_f64();
    let deadline = Duration::from_secs(120 + (tenants * per_tenant) as u64);
    let mut times = Vec::new();
    for wait in waits {
        match tokio::time::timeout(deadline, wait).await {
            Ok(Ok(found)) => times.extend(found),
            _ => {
                return Err(BenchError::Timeout(format!(
                    "installs not Ready within {deadline:?}; daemon log {}",
                    daemon.log.display()
                )));
            }
        }
    }
    let all_ready_s = started.elapsed().as_secs_f64();
    let after = fleet.counters();
    let cost = Snapshot::take(&daemon).await.since(&cost_before, tenants * per_tenant);
    let latency_breakdown = timeline.breakdown();
    drop(timeline);
    daemon.kill().await;
    fleet.shutdown().await;

    let installs = tenants * per_tenant;
    let spent = Spent::between(&before, &after, tenants, installs);
    let install_p50_s = percentile(&mut times, 0.50);
    Ok(StackFigures {
        tenants,
        tenant_transport: Some(options.tenant_transport),
        installs,
        all_created_s,
        all_ready_s,
        install_p50_s,
        install_p99_s: percentile(&mut times, 0.99),
        install_p50_floor_multiple: install_p50_s * 1000.0
            / (MINIMUM_REQUESTS_PER_INSTALL * floor.rtt_ms_p50.max(1e-6)),
        requests_per_install: spent.by_resource.values().sum(),
        requests_per_install_by_verb: spent.by_verb(),
        requests_per_install_by_resource: spent.by_resource,
        events_per_install: spent.events,
        minimum_requests_per_install: MINIMUM_REQUESTS_PER_INSTALL,
        latency_breakdown,
        cost,
    })
}

/// The requests the daemon spent on the installs, per install: by "verb resource" (the host's and
/// every tenant's summed, the benchmark's own left out), and Event writes apart.
struct Spent {
    by_resource: BTreeMap<String, f64>,
    events: f64,
}

impl Spent {
    fn between(before: &[RequestCounts], after: &[RequestCounts], tenants: usize, installs: usize) -> Spent {
        let share = |n: f64| n / installs as f64;
        let mut by_resource: BTreeMap<String, f64> = BTreeMap::new();
        let mut events = 0.0;
        for (now, then) in after.iter().zip(before) {
            for (key, n) in &now.since(then).counts {
                if key.resource.starts_with("events") {
                    events += share(*n as f64);
                } else {
                    let request = format!("{} {}", key.verb.as_str(), key.resource);
                    *by_resource.entry(request).or_default() += share(*n as f64);
                }
            }
        }
        // The benchmark's own: a namespace and an install per install, a list and watch per tenant.
        let installs_key = format!("{}.{}", StackInstall::plural(&()), StackInstall::group(&()));
        for (request, own) in [
            ("create namespaces".to_string(), 1.0),
            (format!("create {installs_key}"), 1.0),
            (format!("list {installs_key}"), share(tenants as f64)),
            (format!("watch {installs_key}"), share(tenants as f64)),
        ] {
            if let Some(value) = by_resource.get_mut(&request) {
                *value -= own;
            }
        }
        by_resource.retain(|_, value| *value > 1e-9);
        Spent { by_resource, events }
    }

    fn by_verb(&self) -> BTreeMap<String, f64> {
        let mut by_verb: BTreeMap<String, f64> = BTreeMap::new();
        for (request, n) in &self.by_resource {
            let verb = request.split(' ').next().unwrap_or_default();
            *by_verb.entry(verb.to_string()).or_default() += n;
        }
        by_verb
    }
}

pub(super) async fn create(client: &Client, namespace: &str) -> Result<(), BenchError> {
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": namespace}})).map_err(std::io::Error::other)?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let install: StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "sample", "namespace": namespace},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    }))
    .map_err(std::io::Error::other)?;
    Api::<StackInstall>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &install)
        .await?;
    Ok(())
}

/// Seconds from `started` until each of `count` installs of `installs` was first seen Ready, by
/// watching them (polling would add up to its interval to each figure).
pub(super) async fn wait_ready(installs: Api<StackInstall>, count: usize, started: Instant) -> Vec<f64> {
    let mut ready = BTreeMap::new();
    let mut events = watcher(installs, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while ready.len() < count {
        let Some(event) = events.next().await else { break };
        let Ok(install) = event else { continue };
        let is_ready = install.status.as_ref().is_some_and(|s| is_true(&s.conditions, "Ready"));
        if is_ready {
            let key = format!("{}/{}", install.namespace().unwrap_or_default(), install.name_any());
            ready.entry(key).or_insert_with(|| started.elapsed().as_secs_f64());
        }
    }
    ready.into_values().collect()
}
