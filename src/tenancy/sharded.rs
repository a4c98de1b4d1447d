//! With `--shards`: the tenants this replica runs are the directory's tenants whose shard slot it
//! holds (`runtime::shards`). A slot's tenants start only after its Lease is stored, stop before
//! it is given up, and are aborted at once when its renew deadline passes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::directory::{TenantChange, TenantFile};
use super::supervisor::Registry;
use crate::context::shared::Shared;
use crate::runtime::health::TenantHealth;
use crate::runtime::shards::{Board, SlotLease, slot_of};

/// The directory's tenants, and the registry running those of the held slots.
pub struct ShardedTenants {
    registry: Registry,
    shared: Arc<Shared>,
    board: Arc<Board>,
    shards: u32,
    /// The latest valid file of every tenant in the directory, served here or not.
    files: BTreeMap<String, TenantFile>,
    /// Why a tenant's file (with no valid one before it) cannot be used: the replica holding its
    /// slot reports it.
    invalid: BTreeMap<String, String>,
}

impl ShardedTenants {
    pub fn new(shared: Arc<Shared>, board: Arc<Board>, shards: u32) -> Self {
        ShardedTenants {
            registry: Registry::new(shared.clone()),
            shared,
            board,
            shards,
            files: BTreeMap::new(),
            invalid: BTreeMap::new(),
        }
    }

    fn slot(&self, tenant: &str) -> u32 {
        slot_of(tenant, self.shards)
    }

    /// The deadline of the tenant's slot while this replica serves it.
    fn serving(&self, tenant: &str) -> Option<Instant> {
        let table = self.board.lock();
        let entry = table.slots.get(&self.slot(tenant))?;
        let now = Instant::now();
        (entry.serving && entry.lease.may_serve(now))
            .then(|| entry.lease.deadline())
            .flatten()
    }

    /// A stop may take the tenant stop grace, but never past the slot's renew deadline, nor past
    /// any served slot's: the daemon must be back in time to abort a lost slot's tenants.
    fn grace_until(&self, deadline: Instant) -> Duration {
        let deadline = self.next_deadline().map_or(deadline, |next| next.min(deadline));
        let left = deadline.saturating_duration_since(Instant::now());
        self.shared.settings.tenant_stop_grace.min(left)
    }

    /// Applies one change from the tenants directory: recorded always, acted on only for a tenant
    /// whose slot this replica serves.
    pub async fn apply(&mut self, change: TenantChange) {
        match change {
            TenantChange::Start(file) | TenantChange::Restart(file) => {
                let name = file.name.clone();
                self.files.insert(name.clone(), (*file).clone());
                self.invalid.remove(&name);
                let Some(deadline) = self.serving(&name) else { return };
                if self.registry.is_running(&name) {
                    info!(tenant = %name, "tenant kubeconfig changed; restarting tenant");
                    let grace = self.grace_until(deadline);
                    self.registry.hand_over(std::slice::from_ref(&name), grace).await;
                    // The stop may have run up to the slot's deadline: look again before starting.
                    if self.serving(&name).is_none() {
                        return;
                    }
                }
                self.registry.start_tenant(*file);
            }
            TenantChange::Suspend(name) => {
                self.files.remove(&name);
                if self.registry.is_running(&name) {
                    info!(tenant = %name, "tenant kubeconfig removed; suspending tenant (its host objects stay)");
                    let grace = self.serving(&name).map_or(Duration::ZERO, |d| self.grace_until(d));
                    self.registry.hand_over(&[name], grace).await;
                } else if self.invalid.remove(&name).is_some() && self.serving(&name).is_some() {
                    // What was reported of a tenant never started goes with it.
                    self.shared.health.remove_tenant(&name);
                }
            }
            TenantChange::Invalid {
                ref name,
                ref error,
                kept_running,
            } => {
                if !kept_running {
                    self.invalid.insert(name.clone(), error.to_string());
                }
                if self.serving(name).is_some() {
                    self.registry.apply(change).await;
                }
            }
        }
    }

    /// When the daemon must act without being woken: the earliest renew deadline of a slot it
    /// serves.
    pub fn next_deadline(&self) -> Option<Instant> {
        let table = self.board.lock();
        table
            .slots
            .values()
            .filter(|entry| entry.serving)
            .filter_map(|entry| entry.lease.deadline())
            .min()
    }

    /// Brings the running tenants in line with the board: aborts the tenants of lost slots, stops
    /// those of slots being given up, starts those of newly held ones.
    pub async fn sync(&mut self) {
        let now = Instant::now();
        let mut start = Vec::new();
        let mut hand_over = Vec::new();
        let mut abort = Vec::new();
        {
            let mut table = self.board.lock();
            for (slot, entry) in table.slots.iter_mut() {
                match entry.lease {
                    SlotLease::Held { deadline } if deadline > now && !entry.serving => {
                        // Marked before any tenant starts: the lease thread gives up no slot
                        // marked serving.
                        entry.serving = true;
                        start.push(*slot);
                    }
                    SlotLease::Releasing { deadline } if deadline > now && entry.serving => {
                        hand_over.push((*slot, deadline));
                    }
                    lease if entry.serving && !lease.may_serve(now) => abort.push(*slot),
                    _ => {}
                }
            }
        }
        // Starts first: they only spawn, and the stops below may wait until a deadline, after
        // which a slot just marked served could be lost already.
        for slot in &start {
            for (name, error) in self.invalid.iter().filter(|(name, _)| self.slot(name) == *slot) {
                self.shared
                    .health
                    .set_tenant(name, TenantHealth::Invalid(error.clone()));
            }
            let files: Vec<TenantFile> = self
                .files
                .values()
                .filter(|file| self.slot(&file.name) == *slot && !self.registry.is_running(&file.name))
                .cloned()
                .collect();
            info!(slot, tenants = files.len(), "serving a shard slot");
            for file in files {
                self.registry.start_tenant(file);
            }
        }
        if !abort.is_empty() {
            warn!(slots = ?abort, "shard slots lost; aborting their tenants");
            let names = self.running_in(&abort);
            self.registry.abort_tenants(&names).await;
            self.forget_invalid(&abort);
            self.done_serving(&abort);
        }
        if let Some(deadline) = hand_over.iter().map(|(_, d)| *d).min() {
            let slots: Vec<u32> = hand_over.iter().map(|(s, _)| *s).collect();
            info!(?slots, "giving up shard slots; stopping their tenants");
            let names = self.running_in(&slots);
            let grace = self.grace_until(deadline);
            self.registry.hand_over(&names, grace).await;
            self.forget_invalid(&slots);
            self.done_serving(&slots);
        }
        self.report();
    }

    /// The invalid files of slots no longer served are reported by their new holder.
    fn forget_invalid(&self, slots: &[u32]) {
        for name in self.invalid.keys().filter(|name| slots.contains(&self.slot(name))) {
            self.shared.health.remove_tenant(name);
        }
    }

    fn running_in(&self, slots: &[u32]) -> Vec<String> {
        self.registry
            .running()
            .into_iter()
            .filter(|name| slots.contains(&self.slot(name)))
            .collect()
    }

    /// None of these slots' tenants runs any more: the lease thread may give them up.
    fn done_serving(&self, slots: &[u32]) {
        {
            let mut table = self.board.lock();
            for slot in slots {
                if let Some(entry) = table.slots.get_mut(slot) {
                    entry.serving = false;
                }
            }
        }
        self.board.to_keeper.notify_one();
    }

    /// `stackd_shard_held{slot}` and the `/readyz?verbose` shard lines.
    fn report(&self) {
        let table = self.board.snapshot();
        let now = Instant::now();
        let mut lines = vec![(
            true,
            format!(
                "shards {} held of {}, {} live replicas, fair share {}",
                held_count(&table, now),
                self.shards,
                table.live,
                table.cap
            ),
        )];
        for slot in 0..self.shards {
            let held = table.slots.get(&slot).filter(|entry| entry.lease.may_serve(now));
            match held {
                Some(entry) => {
                    self.shared.metrics.set_shard_held(slot, true);
                    let tenants: Vec<String> = self
                        .registry
                        .running()
                        .into_iter()
                        .filter(|name| self.slot(name) == slot)
                        .collect();
                    let state = if matches!(entry.lease, SlotLease::Releasing { .. }) {
                        "releasing"
                    } else {
                        "held"
                    };
                    lines.push((true, format!("shard {slot} {state}: tenants {}", tenants.join(","))));
                }
                None => self.shared.metrics.set_shard_held(slot, false),
            }
        }
        self.shared.health.set_shards(lines);
    }

    /// On shutdown: every tenant stops (in-flight reconciles finish, within the slots' deadlines).
    pub async fn stop_all(&mut self) {
        let deadline = self.next_deadline().unwrap_or_else(Instant::now);
        let names = self.registry.running();
        let grace = self.grace_until(deadline);
        self.registry.hand_over(&names, grace).await;
        let slots: Vec<u32> = (0..self.shards).collect();
        self.done_serving(&slots);
    }
}

fn held_count(table: &crate::runtime::shards::Table, now: Instant) -> usize {
    table.slots.values().filter(|entry| entry.lease.may_serve(now)).count()
}
