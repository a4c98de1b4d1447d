//! Two `stackd run --leader-elect` daemons, each reaching the host and every tenant through proxies
//! of its own: cutting a daemon's host proxy partitions it from the host while its tenants still
//! answer, and the tenant proxies record when each daemon talked to each tenant. A daemon acts on
//! tenants during one leadership term at most (it exits when it loses the lease), so two daemons
//! whose traffic to one tenant overlaps in time served that tenant at once.

use std::path::PathBuf;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::super::BenchError;
use super::super::fleet::{DaemonProcess, Fleet, log_filter};
use super::super::partition::{Partition, Span, upstream_of};
use crate::runtime::api_errors::is_conflict;

/// Where the daemons hold their lease (the `--leader-elect-namespace` default).
const LEASE_NAMESPACE: &str = "stackd-system";
const LEASE_NAME: &str = "stackd-leader";
/// Daemons running at once.
const REPLICAS: usize = 2;

/// One daemon process and its proxies.
struct Member {
    /// Its `POD_NAME`: the lease holder identity is this, a dash and a random number.
    name: String,
    process: DaemonProcess,
    host: Partition,
    tenants: Vec<(String, Partition)>,
}

impl Member {
    fn holds(&self, holder: &str) -> bool {
        holder
            .strip_prefix(&self.name)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|suffix| !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()))
    }

    /// Whether it started serving: a daemon talks to tenants only once it holds the lease and saw
    /// its acquisition stored (the Lease names a new holder a moment before that).
    fn serving(&self) -> bool {
        self.tenants.iter().any(|(_, proxy)| proxy.sent().is_some())
    }

    /// Its proxies are cut (so its traffic record is final) and the process is killed.
    async fn retire(self) -> Retired {
        self.host.cut();
        for (_, proxy) in &self.tenants {
            proxy.cut();
        }
        self.process.kill().await;
        Retired {
            name: self.name,
            tenants: self.tenants,
        }
    }
}

/// A daemon gone, kept for its traffic record.
struct Retired {
    name: String,
    tenants: Vec<(String, Partition)>,
}

pub(super) struct LeaderElected {
    members: Vec<Member>,
    retired: Vec<Retired>,
    args: Vec<String>,
    spawned: usize,
    logs: Vec<PathBuf>,
}

impl LeaderElected {
    /// Creates the lease namespace on the host and starts the daemons with `args` (plus leader
    /// election with `lease_seconds`).
    pub(super) async fn start(
        fleet: &Fleet,
        host: &Client,
        args: &[&str],
        lease_seconds: u64,
    ) -> Result<LeaderElected, BenchError> {
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": LEASE_NAMESPACE}})).map_err(kube::Error::SerdeError)?;
        match Api::<Namespace>::all(host.clone())
            .create(&PostParams::default(), &namespace)
            .await
        {
            Ok(_) => {}
            Err(err) if is_conflict(&err) => {}
            Err(err) => return Err(err.into()),
        }
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.extend([
            "--leader-elect".to_string(),
            "--leader-elect-lease-duration".to_string(),
            lease_seconds.to_string(),
        ]);
        let mut daemons = LeaderElected {
            members: Vec::new(),
            retired: Vec::new(),
            args,
            spawned: 0,
            logs: Vec::new(),
        };
        for _ in 0..REPLICAS {
            daemons.spawn(fleet).await?;
        }
        Ok(daemons)
    }

    async fn spawn(&mut self, fleet: &Fleet) -> Result<(), BenchError> {
        self.spawned += 1;
        let name = format!("chaos-{}", self.spawned);
        let dir = fleet.dir().join("daemons").join(&name);
        std::fs::create_dir_all(dir.join("tenants"))?;
        let host = proxy(&fleet.host.url(), &fleet.host.kubeconfig_yaml(), &dir.join("host.yaml")).await?;
        let mut tenants = Vec::new();
        for (tenant, server) in &fleet.tenants {
            let file = dir.join("tenants").join(format!("{tenant}.yaml"));
            tenants.push((
                tenant.clone(),
                proxy(&server.url(), &server.kubeconfig_yaml(), &file).await?,
            ));
        }
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        // The sweep's deletions are read back from the log (see super::sweeps); plain text for that.
        // Lease renewals and leadership changes are logged, to read a takeover's timing in a kept log.
        let filter = format!(
            "{},stackd::host::sweep=info,stackd::daemon=info,stackd::runtime::leader=info,kube_lease_manager=debug",
            log_filter()
        );
        let env = [
            ("POD_NAME", name.clone()),
            ("RUST_LOG", filter),
            ("NO_COLOR", "1".to_string()),
        ];
        let process = DaemonProcess::spawn(&dir, fleet.log_dir(), &args, &env)?;
        self.logs.push(process.log.clone());
        self.members.push(Member {
            name,
            process,
            host,
            tenants,
        });
        Ok(())
    }

    /// Replaces every daemon that exited (a leader that lost its lease exits): the names of those.
    pub(super) async fn replace_exited(&mut self, fleet: &Fleet) -> Result<Vec<String>, BenchError> {
        let mut exited = Vec::new();
        let mut at = 0;
        while at < self.members.len() {
            if matches!(self.members[at].process.child.try_wait(), Ok(Some(_))) {
                let member = self.members.remove(at);
                exited.push(member.name.clone());
                self.retired.push(member.retire().await);
            } else {
                at += 1;
            }
        }
        while self.members.len() < REPLICAS {
            self.spawn(fleet).await?;
        }
        Ok(exited)
    }

    /// The lease holder's identity as the host stores it.
    pub(super) async fn holder(host: &Client) -> Option<String> {
        let leases: Api<Lease> = Api::namespaced(host.clone(), LEASE_NAMESPACE);
        leases
            .get_opt(LEASE_NAME)
            .await
            .ok()
            .flatten()
            .and_then(|lease| lease.spec?.holder_identity)
    }

    /// The running daemon, not cut off from the host, that holds the lease and serves (none for a
    /// while after a leader was killed or cut off: the standby takes over when the lease runs out).
    async fn leader(&self, host: &Client) -> Option<usize> {
        let holder = LeaderElected::holder(host).await?;
        self.members
            .iter()
            .position(|m| m.holds(&holder) && !m.host.is_cut() && m.serving())
    }

    /// Kills a daemon that is not cut off from the host (`pick` chooses which) and starts another.
    pub(super) async fn restart(&mut self, fleet: &Fleet, pick: usize) -> Result<String, BenchError> {
        let connected: Vec<usize> = (0..self.members.len())
            .filter(|at| !self.members[*at].host.is_cut())
            .collect();
        let index = match connected.is_empty() {
            true => pick % self.members.len(),
            false => connected[pick % connected.len()],
        };
        self.kill_and_replace(fleet, index).await
    }

    async fn kill_and_replace(&mut self, fleet: &Fleet, index: usize) -> Result<String, BenchError> {
        let member = self.members.remove(index);
        let name = member.name.clone();
        self.retired.push(member.retire().await);
        self.spawn(fleet).await?;
        Ok(name)
    }

    /// Kills the leader and starts another daemon: the leader's name, `None` if none leads now.
    pub(super) async fn restart_leader(&mut self, fleet: &Fleet, host: &Client) -> Result<Option<String>, BenchError> {
        match self.leader(host).await {
            Some(leader) => self.kill_and_replace(fleet, leader).await.map(Some),
            None => Ok(None),
        }
    }

    /// Cuts the leader off from the host; its tenants still answer it. Its name, `None` if none
    /// leads now.
    pub(super) async fn partition_leader(&self, host: &Client) -> Option<String> {
        let leader = &self.members[self.leader(host).await?];
        leader.host.cut();
        Some(leader.name.clone())
    }

    /// Tenants two daemons talked to at the same time, with the daemons and their spans.
    pub(super) fn served_twice(&self) -> Vec<String> {
        let all: Vec<(&str, &[(String, Partition)])> = self
            .retired
            .iter()
            .map(|r| (r.name.as_str(), r.tenants.as_slice()))
            .chain(self.members.iter().map(|m| (m.name.as_str(), m.tenants.as_slice())))
            .collect();
        let mut found = Vec::new();
        for (i, (first, first_tenants)) in all.iter().enumerate() {
            for (second, second_tenants) in &all[i + 1..] {
                for (tenant, proxy) in first_tenants.iter() {
                    let other = second_tenants.iter().find(|(t, _)| t == tenant);
                    let (Some(a), Some(b)) = (proxy.sent(), other.and_then(|(_, p)| p.sent())) else {
                        continue;
                    };
                    if a.overlaps(&b) {
                        found.push(format!(
                            "{tenant}: daemons {first} and {second} both sent it requests during the same {:.2} s",
                            overlap_seconds(&a, &b)
                        ));
                    }
                }
            }
        }
        found
    }

    /// Every daemon log so far, oldest first.
    pub(super) fn logs(&self) -> &[PathBuf] {
        &self.logs
    }

    /// The logs of the running daemons, with their names.
    pub(super) fn running_logs(&self) -> Vec<(String, PathBuf)> {
        self.members
            .iter()
            .map(|m| (m.name.clone(), m.process.log.clone()))
            .collect()
    }

    pub(super) async fn shutdown(self) {
        for member in self.members {
            member.retire().await;
        }
    }
}

fn overlap_seconds(a: &Span, b: &Span) -> f64 {
    let start = a.first.max(b.first);
    let end = a.last.min(b.last);
    end.saturating_duration_since(start).as_secs_f64()
}

/// A proxy in front of the server at `url`, and `kubeconfig` pointed at it written to `file`.
async fn proxy(url: &str, kubeconfig: &str, file: &std::path::Path) -> Result<Partition, BenchError> {
    let not_loopback = || {
        BenchError::Io(std::io::Error::other(format!(
            "cannot proxy {url}: not a loopback address"
        )))
    };
    let upstream = upstream_of(url).ok_or_else(not_loopback)?;
    let partition = Partition::start(upstream).await?;
    let proxied = partition.kubeconfig(kubeconfig).ok_or_else(not_loopback)?;
    std::fs::write(file, proxied)?;
    Ok(partition)
}
