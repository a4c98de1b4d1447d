//! Daemons sharing the tenants (`stackd run --shards`, issues 19 and 48): real daemon binaries
//! against embedded servers, each replica talking to the host and to every tenant through proxies of its
//! own, so that a replica can be cut off from the host and every tenant server's requests can be
//! told apart by replica.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use stackd::bench::partition::{Partition, upstream_of};
use stackd::bench::shards::serving_intervals;

use crate::harness::{Daemon, Explain, Fleet, LastSeen, holds_for, until, wait_until};

/// `--shard-lease-duration`: short, so takeovers fit a test; long enough that a renewal on a
/// loaded machine is stored before the renew deadline.
const LEASE_SECONDS: u64 = 6;
const TENANTS: usize = 12;

fn lease() -> Duration {
    Duration::from_secs(LEASE_SECONDS)
}

/// How soon a member Lease is renewed (`ShardSettings::renew_interval`).
fn renew_interval() -> Duration {
    lease() * 5 / 9
}

/// Three daemons starting at once, their Leases and tenants settling.
const SETTLE: Duration = Duration::from_secs(30);
/// A tenant's controllers starting once the map gives it to a replica.
const TENANT_START: Duration = Duration::from_secs(10);

struct Replica {
    daemon: Daemon,
    dir: PathBuf,
    host_proxy: Partition,
    tenant_proxies: BTreeMap<String, Partition>,
    /// When it was killed, for the start/stop records.
    killed_at: Option<jiff::Timestamp>,
}

struct ShardedFleet {
    fleet: Fleet,
    replicas: Vec<Replica>,
    /// The tenants every replica's directory holds.
    tenants: usize,
}

fn tenant_names() -> Vec<String> {
    (0..TENANTS).map(|i| format!("t{i:02}")).collect()
}

impl Explain for ShardedFleet {
    fn explain(&self) -> String {
        self.logs()
    }
}

impl ShardedFleet {
    async fn start(replicas: usize) -> ShardedFleet {
        let names = tenant_names();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let fleet = Fleet::start(&refs).await;
        fleet.leader_election_namespace().await;
        let mut sharded = ShardedFleet {
            fleet,
            replicas: Vec::new(),
            tenants: TENANTS,
        };
        for index in 0..replicas {
            let replica = sharded.replica(index).await;
            sharded.replicas.push(replica);
        }
        sharded
    }

    async fn replica(&self, index: usize) -> Replica {
        self.replica_with(index, &daemon_args()).await
    }

    /// A replica's directory: its host kubeconfig and tenant kubeconfigs, each through a proxy.
    async fn replica_with(&self, index: usize, args: &[&str]) -> Replica {
        let dir = self.fleet.dir.path().join(format!("replica-{index}"));
        std::fs::create_dir_all(dir.join("tenants")).expect("replica dir");
        let host_yaml = self.fleet.host().kubeconfig_yaml();
        let host_proxy = proxy(&self.fleet.host().url()).await;
        let proxied = host_proxy
            .kubeconfig(&host_yaml)
            .expect("host kubeconfig names the host");
        std::fs::write(dir.join("host.yaml"), proxied).expect("host kubeconfig");
        let mut tenant_proxies = BTreeMap::new();
        for (name, server) in &self.fleet.tenants {
            let server = server.as_ref().expect("tenant server");
            let tenant_proxy = proxy(&server.url()).await;
            let yaml = tenant_proxy
                .kubeconfig(&server.kubeconfig_yaml())
                .expect("tenant kubeconfig");
            std::fs::write(dir.join("tenants").join(format!("{name}.yaml")), yaml).expect("tenant kubeconfig");
            tenant_proxies.insert(name.clone(), tenant_proxy);
        }
        let daemon = Daemon::spawn(&dir, args);
        Replica {
            daemon,
            dir,
            host_proxy,
            tenant_proxies,
            killed_at: None,
        }
    }

    /// Waits until every tenant is up on exactly one replica (of those not excluded), each
    /// serving its share (⌊N/R⌋ or ⌈N/R⌉); returns each replica's tenants.
    async fn wait_settled(&self, excluded: &[usize], within: Duration) -> Vec<BTreeSet<String>> {
        let last = LastSeen::new(self);
        let expected = self.tenants;
        let live = self.replicas.len() - excluded.len();
        let share = (expected / live)..=expected.div_ceil(live);
        wait_until(&format!("settled within {within:?}"), within, &last, || async {
            let served: Vec<BTreeSet<String>> = self
                .replicas
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    if excluded.contains(&i) {
                        BTreeSet::new()
                    } else {
                        tenants_up(&r.daemon)
                    }
                })
                .collect();
            let total: usize = served.iter().map(BTreeSet::len).sum();
            let union: BTreeSet<&String> = served.iter().flatten().collect();
            let balanced = served
                .iter()
                .enumerate()
                .all(|(i, s)| excluded.contains(&i) || share.contains(&s.len()));
            last.saw(&served);
            (total == expected && union.len() == expected && balanced).then_some(served)
        })
        .await
    }

    /// Waits until the replicas not excluded were given every tenant (started, not yet up);
    /// returns how long it took.
    async fn wait_all_given(&self, excluded: &[usize], within: Duration) -> Duration {
        let started = Instant::now();
        let last = LastSeen::new(self);
        wait_until("every tenant given to a replica", within, &last, || async {
            let given: usize = self
                .replicas
                .iter()
                .enumerate()
                .filter(|(i, _)| !excluded.contains(i))
                .map(|(_, r)| shard_tenants(&r.daemon))
                .sum();
            last.saw(&given);
            (given == self.tenants).then(|| started.elapsed())
        })
        .await
    }

    /// A new tenant server, and its file in every replica's directory (each through a proxy of
    /// its own); returns the proxies, by replica.
    async fn add_tenant_file(&mut self, name: &str) -> Vec<Partition> {
        let fleet_dir = self.fleet.dir.path().to_path_buf();
        self.fleet.add_tenant(name).await;
        // The harness wrote it for no daemon; each replica gets it through a proxy of its own.
        std::fs::remove_file(fleet_dir.join(format!("tenants/{name}.yaml"))).ok();
        let (_, server) = self.fleet.tenants.last().expect("the new tenant");
        let server = server.as_ref().expect("its server");
        let mut proxies = Vec::new();
        for replica in &self.replicas {
            let tenant_proxy = proxy(&server.url()).await;
            let yaml = tenant_proxy
                .kubeconfig(&server.kubeconfig_yaml())
                .expect("tenant kubeconfig");
            std::fs::write(replica.dir.join(format!("tenants/{name}.yaml")), yaml).expect("tenant file");
            proxies.push(tenant_proxy);
        }
        self.tenants += 1;
        proxies
    }

    fn logs(&self) -> String {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| format!("--- replica {i} ---\n{}", r.daemon.log_text()))
            .collect()
    }

    /// Every replica's serving intervals per tenant, from its own start/stop records; none may
    /// overlap another replica's for the same tenant.
    fn assert_never_served_twice(&self) {
        let now = jiff::Timestamp::now();
        let intervals: Vec<BTreeMap<String, Vec<(jiff::Timestamp, jiff::Timestamp)>>> = self
            .replicas
            .iter()
            .map(|r| serving_intervals(&r.daemon.log_text(), r.killed_at.unwrap_or(now)))
            .collect();
        let tenants: BTreeSet<&String> = intervals.iter().flat_map(BTreeMap::keys).collect();
        for tenant in tenants {
            for (a, mine) in intervals.iter().enumerate() {
                for (b, theirs) in intervals.iter().enumerate().skip(a + 1) {
                    for (start, stop) in mine.get(tenant).into_iter().flatten() {
                        for (their_start, their_stop) in theirs.get(tenant).into_iter().flatten() {
                            assert!(
                                !(start < their_stop && their_start < stop),
                                "{tenant} served by replicas {a} ({start}..{stop}) and {b} ({their_start}..{their_stop}) at once\n{}",
                                self.logs()
                            );
                        }
                    }
                }
            }
        }
    }
}

fn daemon_args() -> Vec<&'static str> {
    vec![
        "--shards",
        "--shard-lease-duration",
        "6",
        "--log-format",
        "json",
        "--tenant-stop-grace",
        "2s",
    ]
}

async fn proxy(url: &str) -> Partition {
    let upstream = upstream_of(url).expect("a loopback URL");
    Partition::start(upstream).await.expect("proxy")
}

/// Tenants the replica reports up (`stackd_tenant_up` exists only on the replica serving it).
fn tenants_up(daemon: &Daemon) -> BTreeSet<String> {
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    metrics
        .lines()
        .filter(|line| line.starts_with("stackd_tenant_up{") && line.ends_with(" 1"))
        .filter_map(|line| line.split('"').nth(1).map(str::to_string))
        .collect()
}

/// The tenants the shard map gives the replica and it runs (`stackd_shard_tenants`).
fn shard_tenants(daemon: &Daemon) -> usize {
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("stackd_shard_tenants "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

/// Tenants a replica started, by its own records, after `after`.
fn started_after(daemon: &Daemon, after: jiff::Timestamp) -> BTreeSet<String> {
    serving_intervals(&daemon.log_text(), jiff::Timestamp::MAX)
        .into_iter()
        .filter(|(_, intervals)| intervals.iter().any(|(start, _)| *start > after))
        .map(|(tenant, _)| tenant)
        .collect()
}

/// The `stopped` record time of `tenant` in a replica's log after `after`.
fn stopped_at(log: &str, tenant: &str) -> Option<jiff::Timestamp> {
    serving_intervals(log, jiff::Timestamp::MAX)
        .remove(tenant)?
        .into_iter()
        .map(|(_, stop)| stop)
        .filter(|stop| *stop != jiff::Timestamp::MAX)
        .max()
}

fn replica_dir_status(dir: &Path) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["status", "--host-kubeconfig"])
        .arg(dir.join("host.yaml"))
        .arg("--tenants-dir")
        .arg(dir.join("tenants"))
        .output()
        .expect("stackd status runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sharded_daemons_serve_four_of_twelve_tenants_each_and_five_four_four_of_thirteen() {
    let mut fleet = ShardedFleet::start(3).await;
    let served = fleet.wait_settled(&[], SETTLE).await;
    for (index, replica) in fleet.replicas.iter().enumerate() {
        assert_eq!(served[index].len(), 4, "replica {index}: {served:?}");
        let detail = replica.daemon.http_get("/readyz?verbose").unwrap_or_default();
        assert!(
            detail.contains("shards serving 4 of 12 tenants, 3 live replicas, fair share 4"),
            "{detail}"
        );
    }
    let status = replica_dir_status(&fleet.replicas[0].dir);
    assert!(status.starts_with("12 tenants over 3 replicas"), "{status}");
    let counts: Vec<&str> = status
        .lines()
        .skip(2)
        .filter_map(|line| line.split_whitespace().nth(3))
        .collect();
    assert_eq!(counts, ["4", "4", "4"], "{status}");
    for tenant in tenant_names() {
        assert!(status.contains(&tenant), "{tenant} listed:\n{status}");
    }

    // A thirteenth tenant goes to one replica; nothing else moves.
    let before = jiff::Timestamp::now();
    let _t12 = fleet.add_tenant_file("t12").await;
    let served = fleet.wait_settled(&[], SETTLE).await;
    let mut shares: Vec<usize> = served.iter().map(BTreeSet::len).collect();
    shares.sort_unstable();
    assert_eq!(shares, [4, 4, 5], "{served:?}");
    let started: BTreeSet<String> = fleet
        .replicas
        .iter()
        .flat_map(|r| started_after(&r.daemon, before))
        .collect();
    assert_eq!(
        started,
        BTreeSet::from(["t12".to_string()]),
        "only the new tenant started"
    );
    fleet.assert_never_served_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fourth_daemon_joining_moves_only_the_tenants_it_takes_and_a_stopping_one_hands_over_at_once() {
    let mut fleet = ShardedFleet::start(3).await;
    let before = fleet.wait_settled(&[], SETTLE).await;
    let joined_at = jiff::Timestamp::now();
    let joiner = fleet.replica(3).await;
    fleet.replicas.push(joiner);
    let after = fleet.wait_settled(&[], SETTLE).await;
    assert_eq!(after.iter().map(BTreeSet::len).collect::<Vec<_>>(), [3, 3, 3, 3]);
    for (old, new) in before.iter().zip(&after) {
        assert!(
            new.is_subset(old),
            "the others only gave tenants up: {before:?} -> {after:?}"
        );
    }
    let moved: BTreeSet<String> = fleet
        .replicas
        .iter()
        .flat_map(|r| started_after(&r.daemon, joined_at))
        .collect();
    assert_eq!(moved, after[3], "only the joiner's three moved");

    // SIGTERM: its tenants stop, its Lease is released and its tenants given at once, not after
    // the lease duration.
    let leaving = 0;
    fleet.replicas[leaving].daemon.terminate();
    let took = fleet.wait_all_given(&[leaving], lease()).await;
    eprintln!("tenants of the stopped replica given after {took:?}");
    fleet.replicas[leaving]
        .daemon
        .wait_exit(TENANT_START)
        .await
        .expect("it exits");
    let log = fleet.replicas[leaving].daemon.log_text();
    assert!(log.contains("released this replica's member lease"), "{log}");
    fleet.wait_settled(&[leaving], TENANT_START).await;
    fleet.assert_never_served_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_file_added_at_runtime_is_served_by_one_replica_and_suspended_by_it_when_removed() {
    let mut fleet = ShardedFleet::start(2).await;
    fleet.wait_settled(&[], SETTLE).await;
    let proxies = fleet.add_tenant_file("late").await;
    let servers = wait_until("the new tenant to come up", TENANT_START, &fleet, || async {
        let servers: Vec<usize> = (0..2)
            .filter(|i| tenants_up(&fleet.replicas[*i].daemon).contains("late"))
            .collect();
        (!servers.is_empty()).then_some(servers)
    })
    .await;
    assert_eq!(servers.len(), 1, "served by one replica");
    let holder = servers[0];
    let other = 1 - holder;
    assert!(proxies[other].sent().is_none(), "the other replica never talked to it");
    for replica in &fleet.replicas {
        std::fs::remove_file(replica.dir.join("tenants/late.yaml")).expect("removed");
    }
    until("the removed tenant to stop", TENANT_START, &fleet, || async {
        !tenants_up(&fleet.replicas[holder].daemon).contains("late")
    })
    .await;
    assert!(fleet.replicas[holder].daemon.log_text().contains("suspending tenant"));
    assert!(proxies[other].sent().is_none(), "the other replica never talked to it");
    // A file that cannot be used is reported by the replica it is given to alone.
    for replica in &fleet.replicas {
        std::fs::write(replica.dir.join("tenants/broken.yaml"), "not: [a kubeconfig").expect("broken file");
    }
    until("a replica to report the invalid file", TENANT_START, &fleet, || async {
        let reporting = fleet
            .replicas
            .iter()
            .filter(|r| {
                r.daemon
                    .http_get("/readyz?verbose")
                    .unwrap_or_default()
                    .contains("[-]tenant broken invalid")
            })
            .count();
        assert!(reporting <= 1, "both replicas report the invalid file");
        reporting == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_daemon_cut_off_from_the_host_takes_its_share_again_once_it_reaches_it() {
    let fleet = ShardedFleet::start(3).await;
    fleet.wait_settled(&[], SETTLE).await;
    fleet.replicas[0].host_proxy.pause();
    fleet
        .wait_all_given(&[0], lease() + renew_interval() + Duration::from_secs(1))
        .await;
    fleet.wait_settled(&[0], TENANT_START).await;
    fleet.replicas[0].host_proxy.heal();
    fleet.wait_settled(&[], SETTLE).await;
    fleet.assert_never_served_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_serve_nothing_while_a_replica_of_an_earlier_stackd_holds_slot_leases() {
    let fleet = ShardedFleet::start(2).await;
    fleet.wait_settled(&[], SETTLE).await;
    // An earlier stackd's replica, as a rolling update finds it: a slot Lease it keeps renewing.
    let host = fleet.fleet.host().client().await;
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(host, "stackd-system");
    let slot: k8s_openapi::api::coordination::v1::Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "stackd-shard-0", "labels": {"stackd.dev/shard-lease": "slot"}},
        "spec": {"holderIdentity": "stackd-old-0", "leaseDurationSeconds": LEASE_SECONDS},
    }))
    .expect("a Lease");
    leases
        .create(&kube::api::PostParams::default(), &slot)
        .await
        .expect("the old replica's slot Lease");
    let renewing = tokio::spawn({
        let leases = leases.clone();
        async move {
            let mut every = tokio::time::interval(renew_interval() / 2);
            loop {
                every.tick().await;
                let patch = serde_json::json!({"spec": {"renewTime": jiff::Timestamp::now().to_string()}});
                let _ = leases
                    .patch(
                        "stackd-shard-0",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(patch),
                    )
                    .await;
            }
        }
    });
    until("the replicas to stop serving", SETTLE, &fleet, || async {
        fleet
            .replicas
            .iter()
            .all(|r| tenants_up(&r.daemon).is_empty() && shard_tenants(&r.daemon) == 0)
    })
    .await;
    for replica in &fleet.replicas {
        let detail = replica.daemon.http_get("/readyz?verbose").unwrap_or_default();
        assert!(detail.contains("shard slot Leases"), "{detail}");
    }
    // The old replica is gone: its Lease runs out, and the tenants are served again.
    renewing.abort();
    fleet.wait_settled(&[], lease() + renew_interval() + TENANT_START).await;
    fleet.assert_never_served_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sharded_daemons_tenants_are_served_elsewhere_within_the_lease_duration() {
    let mut fleet = ShardedFleet::start(3).await;
    let served = fleet.wait_settled(&[], SETTLE).await;
    let victim = (0..3).max_by_key(|i| served[*i].len()).expect("a replica");
    fleet.replicas[victim].killed_at = Some(jiff::Timestamp::now());
    fleet.replicas[victim].daemon.kill();
    // Its member Lease runs out a lease duration after its last renewal was seen.
    let bound = lease() + renew_interval() + Duration::from_secs(1);
    let took = fleet.wait_all_given(&[victim], bound).await;
    eprintln!("tenants of the killed replica given after {took:?} (bound {bound:?})");
    let after = fleet.wait_settled(&[victim], TENANT_START).await;
    for tenant in &served[victim] {
        assert!(after.iter().any(|s| s.contains(tenant)), "{tenant} served again");
    }
    fleet.assert_never_served_twice();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_daemon_cut_off_from_the_host_stops_its_tenants_before_others_start_them() {
    let fleet = ShardedFleet::start(3).await;
    let served = fleet.wait_settled(&[], SETTLE).await;
    let cut = (0..3).max_by_key(|i| served[*i].len()).expect("a replica");
    let cut_at = Instant::now();
    fleet.replicas[cut].host_proxy.cut();
    let bound = lease() + renew_interval() + Duration::from_secs(1);
    fleet.wait_all_given(&[cut], bound).await;
    let after = fleet.wait_settled(&[cut], TENANT_START).await;
    let isolated = &fleet.replicas[cut];
    assert!(
        tenants_up(&isolated.daemon).is_empty(),
        "the cut-off replica serves nothing"
    );
    assert_eq!(shard_tenants(&isolated.daemon), 0, "and runs none");
    let log = isolated.daemon.log_text();
    for tenant in &served[cut] {
        let taker = after.iter().position(|s| s.contains(tenant)).expect("served elsewhere");
        let taker = &fleet.replicas[taker];
        // Its own records: stopped before the new replica started it.
        let stopped = stopped_at(&log, tenant).unwrap_or_else(|| panic!("{tenant} never stopped:\n{log}"));
        let started = serving_intervals(&taker.daemon.log_text(), jiff::Timestamp::MAX)
            .remove(tenant)
            .and_then(|intervals| intervals.last().map(|(start, _)| *start))
            .expect("the taker started it");
        assert!(
            stopped < started,
            "{tenant}: stopped at {stopped}, started elsewhere at {started}"
        );
        // The tenant server's requests: none from the cut-off replica after the new holder's first.
        let first_new = taker.tenant_proxies[tenant.as_str()]
            .first_sent_after(cut_at)
            .expect("the new holder talked to the tenant");
        let last_old = isolated.tenant_proxies[tenant.as_str()]
            .sent()
            .expect("it had talked")
            .last;
        assert!(
            last_old < first_new,
            "{tenant}: the cut-off replica sent {:?} after the new holder's first request",
            last_old - first_new
        );
    }
    // Nothing of a stopped tenant lives on: its server hears no more from the cut-off replica.
    let last: Vec<_> = served[cut]
        .iter()
        .map(|t| isolated.tenant_proxies[t.as_str()].sent())
        .collect();
    // Nothing marks that a stopped tenant makes no request: watch its servers for a renew interval.
    let what = format!("the cut-off replica silent to its former tenants {:?}", served[cut]);
    holds_for(&what, renew_interval(), &fleet, || async {
        let now: Vec<_> = served[cut]
            .iter()
            .map(|t| isolated.tenant_proxies[t.as_str()].sent())
            .collect();
        now == last
    })
    .await;
    fleet.assert_never_served_twice();
}
