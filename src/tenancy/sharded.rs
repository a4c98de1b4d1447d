//! With `--shards`: the tenants this replica runs are the directory's tenants the shard map gives
//! it (`runtime::shards`). A tenant starts only after the board says it is this replica's, stops
//! before it is handed over, and every tenant is aborted at once when the member Lease's renew
//! deadline passes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::directory::{TenantChange, TenantFile};
use super::supervisor::Registry;
use crate::context::shared::Shared;
use crate::runtime::health::TenantHealth;
use crate::runtime::shards::Board;

/// The directory's tenants, and the registry running those the map gives this replica.
pub struct ShardedTenants {
    registry: Registry,
    shared: Arc<Shared>,
    board: Arc<Board>,
    /// The latest valid file of every tenant in the directory, served here or not.
    files: BTreeMap<String, TenantFile>,
    /// Why a tenant's file (with no valid one before it) cannot be used: the replica serving it
    /// reports it.
    invalid: BTreeMap<String, String>,
    /// The invalid files this replica reports.
    reported: BTreeSet<String>,
    /// The sources were read once: the board may be told every tenant.
    loaded: bool,
}

impl ShardedTenants {
    pub fn new(shared: Arc<Shared>, board: Arc<Board>) -> Self {
        ShardedTenants {
            registry: Registry::new(shared.clone()),
            shared,
            board,
            files: BTreeMap::new(),
            invalid: BTreeMap::new(),
            reported: BTreeSet::new(),
            loaded: false,
        }
    }

    /// The deadline of this replica's Lease while the tenant may run here.
    fn serving(&self, tenant: &str) -> Option<Instant> {
        let table = self.board.lock();
        table
            .may_run(tenant, Instant::now())
            .then_some(table.alive_until)
            .flatten()
    }

    /// A stop may take the tenant stop grace, but never past the Lease's renew deadline: the
    /// daemon must be back in time to abort every tenant if it is not renewed.
    fn grace_until(&self, deadline: Option<Instant>) -> Duration {
        let deadline = deadline.or_else(|| self.next_deadline()).unwrap_or_else(Instant::now);
        let left = deadline.saturating_duration_since(Instant::now());
        self.shared.settings.tenant_stop_grace.min(left)
    }

    /// The sources' first changes were applied: from now on the coordinator may place (and drop)
    /// tenants by what this replica knows.
    pub fn loaded(&mut self) {
        self.loaded = true;
        self.tell_tenants();
    }

    fn tell_tenants(&self) {
        if !self.loaded {
            return;
        }
        let known: BTreeSet<String> = self.files.keys().chain(self.invalid.keys()).cloned().collect();
        let changed = {
            let mut table = self.board.lock();
            let changed = table.known.as_ref() != Some(&known);
            table.known = Some(known);
            changed
        };
        if changed {
            self.board.to_keeper.notify_one();
        }
    }

    /// Applies one change from the tenants directory: recorded always, acted on only for a tenant
    /// this replica serves.
    pub async fn apply(&mut self, change: TenantChange) {
        match change {
            TenantChange::Start(file) | TenantChange::Restart(file) => {
                let name = file.name.clone();
                self.files.insert(name.clone(), (*file).clone());
                self.invalid.remove(&name);
                self.reported.remove(&name);
                self.tell_tenants();
                let Some(deadline) = self.serving(&name) else { return };
                if self.registry.is_running(&name) {
                    info!(tenant = %name, "tenant kubeconfig changed; restarting tenant");
                    let grace = self.grace_until(Some(deadline));
                    self.registry.hand_over(std::slice::from_ref(&name), grace).await;
                    // The stop may have run up to the deadline: look again before starting.
                    if self.serving(&name).is_none() {
                        self.done_running(std::slice::from_ref(&name));
                        return;
                    }
                }
                self.board.lock().running.insert(name);
                self.registry.start_tenant(*file);
            }
            TenantChange::Suspend(name) => {
                self.files.remove(&name);
                if self.registry.is_running(&name) {
                    info!(tenant = %name, "tenant kubeconfig removed; suspending tenant (its host objects stay)");
                    let grace = self.grace_until(self.serving(&name));
                    self.registry.hand_over(std::slice::from_ref(&name), grace).await;
                    self.done_running(std::slice::from_ref(&name));
                } else if self.invalid.remove(&name).is_some() && self.reported.remove(&name) {
                    // What was reported of a tenant never started goes with it.
                    self.shared.health.remove_tenant(&name);
                }
                self.tell_tenants();
            }
            TenantChange::Invalid {
                ref name,
                ref error,
                kept_running,
            } => {
                if !kept_running {
                    self.invalid.insert(name.clone(), error.to_string());
                }
                self.tell_tenants();
                if self.serving(name).is_some() {
                    if !kept_running {
                        self.reported.insert(name.clone());
                    }
                    self.registry.apply(change).await;
                }
            }
        }
    }

    /// When the daemon must act without being woken: the Lease's renew deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.board.lock().alive_until
    }

    /// Brings the running tenants in line with the board: aborts every tenant when the Lease was
    /// not renewed in time, stops those to hand over, starts those newly given.
    pub async fn sync(&mut self) {
        let now = Instant::now();
        let mut start = Vec::new();
        let mut report = Vec::new();
        let mut hand_over = Vec::new();
        let abort;
        let alive_until;
        {
            let mut table = self.board.lock();
            alive_until = table.alive_until.filter(|until| *until > now);
            if alive_until.is_some() {
                abort = Vec::new();
                for name in table.assigned.clone() {
                    if !table.may_run(&name, now) || table.running.contains(&name) {
                        continue;
                    }
                    if let Some(file) = self.files.get(&name) {
                        // Marked before it starts: the lease thread hands over no tenant marked.
                        table.running.insert(name.clone());
                        start.push(file.clone());
                    } else if self.invalid.contains_key(&name) && !self.reported.contains(&name) {
                        report.push(name);
                    }
                }
                hand_over = table
                    .running
                    .iter()
                    .filter(|name| !table.may_run(name, now))
                    .cloned()
                    .collect();
            } else {
                abort = table.running.iter().cloned().collect::<Vec<_>>();
            }
        }
        // Starts first: they only spawn, and the stops below may wait until the deadline.
        if !start.is_empty() {
            info!(
                tenants = start.len(),
                "serving tenants the shard map gives this replica"
            );
        }
        for file in start {
            self.registry.start_tenant(file);
        }
        for name in report {
            if let Some(error) = self.invalid.get(&name) {
                self.shared
                    .health
                    .set_tenant(&name, TenantHealth::Invalid(error.clone()));
                self.reported.insert(name);
            }
        }
        if !abort.is_empty() {
            warn!(
                tenants = abort.len(),
                "member lease not renewed in time; aborting every tenant"
            );
            let running: Vec<String> = abort.iter().filter(|n| self.registry.is_running(n)).cloned().collect();
            self.registry.abort_tenants(&running).await;
            self.done_running(&abort);
        }
        if !hand_over.is_empty() {
            info!(tenants = ?hand_over, "handing tenants over; stopping them");
            let running: Vec<String> = hand_over
                .iter()
                .filter(|n| self.registry.is_running(n))
                .cloned()
                .collect();
            let grace = self.grace_until(alive_until);
            self.registry.hand_over(&running, grace).await;
            self.done_running(&hand_over);
        }
        self.forget_reported();
        self.report();
    }

    /// The invalid files of tenants no longer served here are reported by their new replica.
    fn forget_reported(&mut self) {
        let now = Instant::now();
        let gone: Vec<String> = {
            let table = self.board.lock();
            self.reported
                .iter()
                .filter(|name| !table.may_run(name, now))
                .cloned()
                .collect()
        };
        for name in gone {
            self.shared.health.remove_tenant(&name);
            self.reported.remove(&name);
        }
    }

    /// These tenants no longer run: the lease thread may hand them over.
    fn done_running(&self, names: &[String]) {
        {
            let mut table = self.board.lock();
            for name in names {
                table.running.remove(name);
            }
        }
        self.board.to_keeper.notify_one();
    }

    /// `stackd_shard_tenants`, `stackd_shard_unserved_tenants` and the `/readyz?verbose` shard
    /// lines.
    fn report(&self) {
        let table = self.board.snapshot();
        let now = Instant::now();
        let serving: Vec<&String> = table.running.iter().filter(|name| table.may_run(name, now)).collect();
        let known = table.known.as_ref().map_or(0, BTreeSet::len);
        let metrics = &self.shared.metrics;
        metrics
            .shard_tenants
            .set(i64::try_from(serving.len()).unwrap_or(i64::MAX));
        metrics
            .shard_unserved_tenants
            .set(i64::try_from(table.unserved).unwrap_or(i64::MAX));
        let live = table.live.max(1);
        let mut lines = vec![(
            table.alive_until.is_some_and(|until| until > now) && table.waiting.is_none(),
            format!(
                "shards serving {} of {known} tenants, {} live replicas, fair share {}",
                serving.len(),
                table.live,
                fair_share(known, live)
            ),
        )];
        if let Some(why) = &table.waiting {
            lines.push((false, format!("shards waiting: {why}")));
        }
        if table.unserved > 0 {
            lines.push((
                false,
                format!("shards: {} tenants served by no live replica", table.unserved),
            ));
        }
        if !table.releasing.is_empty() {
            let names: Vec<&str> = table.releasing.iter().map(String::as_str).collect();
            lines.push((true, format!("shards handing over: {}", names.join(","))));
        }
        let names: Vec<&str> = serving.iter().map(|name| name.as_str()).collect();
        lines.push((true, format!("shards tenants: {}", names.join(","))));
        self.shared.health.set_shards(lines);
    }

    /// On shutdown: every tenant stops (in-flight reconciles finish, within the Lease's deadline).
    pub async fn stop_all(&mut self) {
        let names = self.registry.running();
        let grace = self.grace_until(None);
        self.registry.hand_over(&names, grace).await;
        let marked: Vec<String> = self.board.lock().running.iter().cloned().collect();
        self.done_running(&marked);
    }
}

/// What each replica serves when balanced: `⌊known/live⌋`, or one more, as a range.
fn fair_share(known: usize, live: usize) -> String {
    let (low, high) = (known / live, known.div_ceil(live));
    if low == high {
        low.to_string()
    } else {
        format!("{low}-{high}")
    }
}
