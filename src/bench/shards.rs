//! Sharding (issues 19 and 48): replicas of the daemon share the tenants (`--shards`). Each
//! replica reaches the host and every tenant through proxies of its own, so every tenant server's
//! requests are known by replica. Figures: time until every tenant is up, tenants per replica
//! (each must come to ⌊N/R⌋ or ⌈N/R⌉), tenants moved when a fourth replica joins and when the
//! busiest is `kill -9`ed, the time until its tenants are up elsewhere, tenants served by two
//! replicas at once (from the daemons' own start/stop records and from the tenant servers'
//! requests), and Lease writes on the host.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use serde::{Deserialize, Serialize};

use super::BenchError;
use super::fleet::{DaemonProcess, Fleet};
use super::partition::{Partition, upstream_of};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardFigures {
    pub replicas: usize,
    pub tenants: usize,
    pub lease_duration_s: u64,
    /// Seconds from starting the replicas until every tenant is up on exactly one of them, each
    /// replica serving ⌊N/R⌋ or ⌈N/R⌉.
    pub all_up_s: f64,
    /// Tenants each replica serves once all are up, largest first.
    pub tenants_per_replica: Vec<usize>,
    /// Largest over smallest of `tenants_per_replica`.
    pub balance_max_over_min: f64,
    /// Once a replica more joined: tenants each serves, largest first.
    #[serde(default)]
    pub tenants_per_replica_after_join: Vec<usize>,
    /// Tenants started anew when it joined (goal: only those it takes, ⌊N/(R+1)⌋ or one more).
    #[serde(default)]
    pub moved_on_join: usize,
    /// Tenants started anew when the busiest replica was killed (goal: only those it had).
    #[serde(default)]
    pub moved_on_kill: usize,
    /// The tenants the killed replica had.
    #[serde(default)]
    pub killed_had: usize,
    /// Seconds from `kill -9` of the busiest replica until its tenants are up elsewhere (goal ≤
    /// the lease duration + 5 s).
    pub takeover_s: f64,
    /// Tenants two replicas served at once by their own start/stop records (must be 0).
    pub served_twice_by_records: usize,
    /// Tenants that a replica sent requests to outside its own serving records (must be 0):
    /// with the records never overlapping, no two replicas' requests interleave.
    pub served_twice_by_requests: usize,
    /// The longest this process's runtime was late to run a task: a proxy notes a request when
    /// it reads it, up to this late, so requests are matched to records with this much slack.
    #[serde(default)]
    pub scheduling_lag_max_ms: f64,
    /// Writes (create, update) to Leases and the shard map on the host per minute while nothing
    /// moves.
    pub lease_writes_per_minute: f64,
    /// The same per replica per lease duration (goal < 2).
    #[serde(default)]
    pub lease_writes_per_replica_per_lease_duration: f64,
}

/// What one run is made of.
pub struct ShardLoad {
    pub replicas: usize,
    pub tenants: usize,
    pub lease_duration_s: u64,
    /// How long Lease writes are counted while nothing moves.
    pub steady_window: Duration,
}

struct Replica {
    daemon: Option<DaemonProcess>,
    log: PathBuf,
    proxies: BTreeMap<String, Partition>,
    /// The host proxy, kept open as long as the replica.
    _host: Partition,
    killed_at: Option<jiff::Timestamp>,
}

pub async fn measure(load: &ShardLoad, keep_logs: Option<&Path>) -> Result<ShardFigures, BenchError> {
    let mut fleet = Fleet::start(load.tenants).await?;
    if let Some(dir) = keep_logs {
        fleet.keep_logs(&dir.join("shards"))?;
    }
    let host = fleet.host.client().await;
    let system: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": "stackd-system"}}))
        .map_err(|e| BenchError::Timeout(e.to_string()))?;
    Api::<Namespace>::all(host)
        .create(&PostParams::default(), &system)
        .await?;
    let clock = Clock::now();
    let lag = LagProbe::start();
    let started = Instant::now();
    let mut replicas = Vec::new();
    for index in 0..load.replicas {
        replicas.push(replica(&fleet, index, load).await?);
    }
    let served = wait_served(&replicas, load.tenants, Duration::from_secs(120)).await?;
    let all_up_s = started.elapsed().as_secs_f64();
    let per_replica = largest_first(&served);
    let balance =
        per_replica.first().copied().unwrap_or(0) as f64 / per_replica.last().copied().unwrap_or(1).max(1) as f64;

    let before = fleet.host.counters();
    tokio::time::sleep(load.steady_window).await;
    let after = fleet.host.counters().since(&before);
    let writes = ["create", "update"]
        .iter()
        .map(|verb| write_count(&after, verb))
        .sum::<u64>() as f64;
    let minutes = load.steady_window.as_secs_f64() / 60.0;
    let durations = load.steady_window.as_secs_f64() / load.lease_duration_s as f64;

    let joined_at = jiff::Timestamp::now();
    replicas.push(replica(&fleet, load.replicas, load).await?);
    let joined = wait_served(&replicas, load.tenants, Duration::from_secs(120)).await?;
    let moved_on_join = started_after(&replicas, joined_at);

    let victim = (0..joined.len()).max_by_key(|i| joined[*i].len()).unwrap_or(0);
    let killed = Instant::now();
    let killed_wall = jiff::Timestamp::now();
    replicas[victim].killed_at = Some(killed_wall);
    if let Some(daemon) = replicas[victim].daemon.take() {
        daemon.kill().await;
    }
    wait_served(&replicas, load.tenants, Duration::from_secs(120)).await?;
    let takeover_s = killed.elapsed().as_secs_f64();
    let moved_on_kill = started_after(&replicas, killed_wall);

    let lag_max = lag.max();
    let (by_records, by_requests) = served_twice(&replicas, &clock, lag_max + Duration::from_millis(50));
    let figures = ShardFigures {
        replicas: load.replicas,
        tenants: load.tenants,
        lease_duration_s: load.lease_duration_s,
        all_up_s,
        tenants_per_replica: per_replica,
        balance_max_over_min: balance,
        tenants_per_replica_after_join: largest_first(&joined),
        moved_on_join,
        moved_on_kill,
        killed_had: joined[victim].len(),
        takeover_s,
        served_twice_by_records: by_records,
        served_twice_by_requests: by_requests,
        scheduling_lag_max_ms: lag_max.as_secs_f64() * 1000.0,
        lease_writes_per_minute: writes / minutes,
        lease_writes_per_replica_per_lease_duration: writes / load.replicas as f64 / durations,
    };
    drop(replicas);
    fleet.shutdown().await;
    Ok(figures)
}

/// Writes to the sharding objects: Leases and the shard map's ConfigMap (the host has no other).
fn write_count(counts: &crate::embedded::counters::RequestCounts, verb: &str) -> u64 {
    counts
        .counts
        .iter()
        .filter(|(key, _)| key.verb.as_str() == verb)
        .filter(|(key, _)| key.resource.starts_with("leases") || key.resource.starts_with("configmaps"))
        .map(|(_, n)| *n)
        .sum()
}

fn largest_first(served: &[BTreeSet<String>]) -> Vec<usize> {
    let mut counts: Vec<usize> = served.iter().map(BTreeSet::len).filter(|n| *n > 0).collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    counts
}

/// Tenants some replica started, by its own records, after `after`.
fn started_after(replicas: &[Replica], after: jiff::Timestamp) -> usize {
    let mut started = BTreeSet::new();
    for replica in replicas {
        let text = std::fs::read_to_string(&replica.log).unwrap_or_default();
        for (tenant, intervals) in serving_intervals(&text, jiff::Timestamp::MAX) {
            if intervals.iter().any(|(start, _)| *start > after) {
                started.insert(tenant);
            }
        }
    }
    started.len()
}

/// A replica's directory (its host kubeconfig and tenant kubeconfigs, each through a proxy of its
/// own) and its daemon.
async fn replica(fleet: &Fleet, index: usize, load: &ShardLoad) -> Result<Replica, BenchError> {
    let dir: PathBuf = fleet.dir().join(format!("replica-{index}"));
    std::fs::create_dir_all(dir.join("tenants"))?;
    let host = proxy(&fleet.host.url()).await?;
    let host_yaml = fleet.host.kubeconfig_yaml();
    std::fs::write(dir.join("host.yaml"), host.kubeconfig(&host_yaml).unwrap_or(host_yaml))?;
    let mut proxies = BTreeMap::new();
    for (name, server) in &fleet.tenants {
        let tenant = proxy(&server.url()).await?;
        let yaml = server.kubeconfig_yaml();
        std::fs::write(
            dir.join("tenants").join(format!("{name}.yaml")),
            tenant.kubeconfig(&yaml).unwrap_or(yaml),
        )?;
        proxies.insert(name.clone(), tenant);
    }
    let lease = load.lease_duration_s.to_string();
    let args = [
        "--shards",
        "--shard-lease-duration",
        &lease,
        "--log-format",
        "json",
        "--tenant-stop-grace",
        "2s",
    ];
    let env = [("RUST_LOG", "warn,stackd=info".to_string())];
    let daemon = DaemonProcess::spawn(&dir, fleet.log_dir(), &args, &env)?;
    Ok(Replica {
        log: daemon.log.clone(),
        daemon: Some(daemon),
        proxies,
        _host: host,
        killed_at: None,
    })
}

async fn proxy(url: &str) -> Result<Partition, BenchError> {
    let upstream = upstream_of(url).ok_or_else(|| BenchError::Timeout(format!("not a loopback URL: {url}")))?;
    Ok(Partition::start(upstream).await?)
}

/// Waits until every tenant is up on exactly one live replica, each serving ⌊N/R⌋ or ⌈N/R⌉ of
/// them; returns each replica's tenants.
async fn wait_served(
    replicas: &[Replica],
    tenants: usize,
    within: Duration,
) -> Result<Vec<BTreeSet<String>>, BenchError> {
    let started = Instant::now();
    loop {
        let mut served = Vec::new();
        for replica in replicas {
            served.push(match &replica.daemon {
                Some(daemon) => tenants_up(&daemon.metrics().await),
                None => BTreeSet::new(),
            });
        }
        let total: usize = served.iter().map(BTreeSet::len).sum();
        let union: BTreeSet<&String> = served.iter().flatten().collect();
        let live = replicas.iter().filter(|r| r.daemon.is_some()).count().max(1);
        let share = (tenants / live)..=tenants.div_ceil(live);
        let balanced = replicas
            .iter()
            .zip(&served)
            .all(|(replica, served)| replica.daemon.is_none() || share.contains(&served.len()));
        if total == tenants && union.len() == tenants && balanced {
            return Ok(served);
        }
        if started.elapsed() > within {
            let counts: Vec<usize> = served.iter().map(BTreeSet::len).collect();
            return Err(BenchError::Timeout(format!(
                "{} of {tenants} tenants up ({total} servings, per replica {counts:?}, each to serve {share:?}) after {within:?}",
                union.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tenants_up(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter(|line| line.starts_with("stackd_tenant_up{") && line.ends_with(" 1"))
        .filter_map(|line| line.split('"').nth(1).map(str::to_string))
        .collect()
}

/// How late this process's runtime runs a task that asked to wake: the proxies (and servers) in
/// it are as late, on a loaded machine.
struct LagProbe {
    max: std::sync::Arc<std::sync::Mutex<Duration>>,
    task: tokio::task::JoinHandle<()>,
}

impl LagProbe {
    fn start() -> LagProbe {
        let max = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
        let seen = max.clone();
        let task = tokio::spawn(async move {
            let period = Duration::from_millis(20);
            loop {
                let due = Instant::now() + period;
                tokio::time::sleep_until(due.into()).await;
                let late = Instant::now().saturating_duration_since(due);
                let mut max = seen.lock().unwrap_or_else(|p| p.into_inner());
                *max = (*max).max(late);
            }
        });
        LagProbe { max, task }
    }

    fn max(&self) -> Duration {
        *self.max.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for LagProbe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Converts the proxies' monotonic instants to the wall clock of the daemons' log records.
struct Clock {
    instant: Instant,
    wall: jiff::Timestamp,
}

impl Clock {
    fn now() -> Clock {
        Clock {
            instant: Instant::now(),
            wall: jiff::Timestamp::now(),
        }
    }

    fn wall(&self, at: Instant) -> jiff::Timestamp {
        let since = at.saturating_duration_since(self.instant);
        self.wall.checked_add(since).unwrap_or(self.wall)
    }
}

type Intervals = BTreeMap<String, Vec<(jiff::Timestamp, jiff::Timestamp)>>;

/// Per tenant, `[starting tenant, tenant stopped]` from a daemon's JSON log; an open one ends at
/// `end`.
pub fn serving_intervals(log: &str, end: jiff::Timestamp) -> Intervals {
    let mut open: BTreeMap<String, jiff::Timestamp> = BTreeMap::new();
    let mut intervals = Intervals::new();
    for line in log.lines() {
        let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let time = record["timestamp"]
            .as_str()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok());
        let (Some(message), Some(tenant), Some(time)) = (record["message"].as_str(), record["tenant"].as_str(), time)
        else {
            continue;
        };
        match message {
            "starting tenant" => {
                open.entry(tenant.to_string()).or_insert(time);
            }
            "tenant stopped" => {
                if let Some(start) = open.remove(tenant) {
                    intervals.entry(tenant.to_string()).or_default().push((start, time));
                }
            }
            _ => {}
        }
    }
    for (tenant, start) in open {
        intervals.entry(tenant).or_default().push((start, end));
    }
    intervals
}

/// Tenants served twice: by overlapping records of two replicas, and by a replica's requests
/// outside its own records.
fn served_twice(replicas: &[Replica], clock: &Clock, slack: Duration) -> (usize, usize) {
    let now = jiff::Timestamp::now();
    let records: Vec<Intervals> = replicas
        .iter()
        .map(|r| {
            let text = std::fs::read_to_string(&r.log).unwrap_or_default();
            serving_intervals(&text, r.killed_at.unwrap_or(now))
        })
        .collect();
    let mut by_records = BTreeSet::new();
    for (a, mine) in records.iter().enumerate() {
        for theirs in records.iter().skip(a + 1) {
            for (tenant, intervals) in mine {
                let clash = intervals.iter().any(|(start, stop)| {
                    theirs
                        .get(tenant)
                        .into_iter()
                        .flatten()
                        .any(|(their_start, their_stop)| start < their_stop && their_start < stop)
                });
                if clash {
                    by_records.insert(tenant.clone());
                }
            }
        }
    }
    // A proxy notes a request when its task reads it, which is late by up to the runtime's
    // scheduling lag: a request is inside its record when within `slack` of it.
    let mut by_requests = BTreeSet::new();
    for (replica, intervals) in replicas.iter().zip(&records) {
        for (tenant, proxy) in &replica.proxies {
            let inside = |at: jiff::Timestamp| {
                intervals.get(tenant).into_iter().flatten().any(|(start, stop)| {
                    start.checked_sub(slack).is_ok_and(|s| s <= at) && stop.checked_add(slack).is_ok_and(|s| at <= s)
                })
            };
            if let Some(at) = proxy
                .sent_times()
                .into_iter()
                .map(|at| clock.wall(at))
                .find(|at| !inside(*at))
            {
                let records = intervals.get(tenant).cloned().unwrap_or_default();
                eprintln!(
                    "bench: {tenant} got a request at {at} from {} outside its serving records {records:?}",
                    replica.log.display()
                );
                by_requests.insert(tenant.clone());
            }
        }
    }
    (by_records.len(), by_requests.len())
}
