//! The lease thread: watches the sharding Leases, keeps this replica's member Lease, takes free
//! slots up to its fair share, renews what it holds, gives up extras once the daemon has stopped
//! their tenants, and marks a slot lost when its renew deadline passes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::assign::{fair_share, surplus, wanted};
use super::{
    Board, LEASE_ROLE_LABEL, SHARDS_ANNOTATION, ShardSettings, Slot, SlotLease, member_lease_name, slot_lease_name,
};
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::recovery::{WatchBackoff, retry_watch};

/// A Lease as last seen, and when it last changed as seen from here (never the holder's clock).
struct Observed {
    lease: Lease,
    changed: Instant,
}

/// A Lease this replica holds.
struct Holding {
    /// As the server stored it after our last write.
    lease: Lease,
    /// When our last stored write was sent: the renew deadline runs from here.
    sent: Instant,
    /// No renewal attempt before this (after a failed one).
    next_try: Instant,
}

pub(super) fn run_thread(settings: ShardSettings, board: Arc<Board>, shutdown: oneshot::Receiver<()>) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            error!(%err, "no runtime for the shard leases; this replica serves no tenant");
            return;
        }
    };
    runtime.block_on(run(settings, board, shutdown));
}

async fn run(settings: ShardSettings, board: Arc<Board>, mut shutdown: oneshot::Receiver<()>) {
    let client = match Client::try_from(settings.host.clone()) {
        Ok(client) => client,
        Err(err) => {
            error!(%err, "no client for the shard leases; this replica serves no tenant");
            return;
        }
    };
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let config = watcher::Config::default().labels(LEASE_ROLE_LABEL);
    let mut events = retry_watch(
        watcher::watcher(api.clone(), config).boxed(),
        None,
        WatchBackoff::default(),
    );
    let mut keeper = Keeper::new(settings, board.clone(), api);
    info!(identity = %keeper.settings.identity, shards = keeper.settings.shards, "joining the shard leases");
    loop {
        let wake = keeper.next_wake();
        tokio::select! {
            _ = &mut shutdown => break,
            event = events.next() => match event {
                Some(Ok(event)) => keeper.observe(event),
                Some(Err(err)) => debug!(%err, "shard lease watch failed; retrying"),
                None => break,
            },
            _ = board.to_keeper.notified() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
        keeper.step().await;
    }
    keeper.leave().await;
}

struct Keeper {
    settings: ShardSettings,
    board: Arc<Board>,
    api: Api<Lease>,
    seen: BTreeMap<String, Observed>,
    /// Slot Leases seen deleted (or gone from a relist), and when: the holder may serve until its
    /// next renewal finds the Lease gone, so the slot counts as taken for a lease duration more.
    vanished: BTreeMap<String, Instant>,
    /// Names seen since a (re)list started; `None` outside of one.
    relisting: Option<BTreeSet<String>>,
    /// The first list is done: free slots are known.
    listed: bool,
    /// When the watch last delivered anything. Our own writes come back through it at least once
    /// a renew interval, so a longer silence means the view of the others is stale.
    heard: Instant,
    member: Option<Holding>,
    /// No member Lease write before this while `member` is unknown (after a failed one).
    member_retry: Instant,
    /// Why the member Lease could not be written, as last logged: the same reason is not logged
    /// again on every retry.
    member_trouble: Option<String>,
    registered: Option<Instant>,
    held: BTreeMap<u32, Holding>,
    /// Slots being given up: renewed until the daemon stops their tenants.
    releasing: BTreeSet<u32>,
}

impl Keeper {
    fn new(settings: ShardSettings, board: Arc<Board>, api: Api<Lease>) -> Keeper {
        Keeper {
            settings,
            board,
            api,
            seen: BTreeMap::new(),
            vanished: BTreeMap::new(),
            relisting: None,
            listed: false,
            heard: Instant::now(),
            member: None,
            member_retry: Instant::now(),
            member_trouble: None,
            registered: None,
            held: BTreeMap::new(),
            releasing: BTreeSet::new(),
        }
    }

    fn observe(&mut self, event: watcher::Event<Lease>) {
        self.heard = Instant::now();
        match event {
            watcher::Event::Init => self.relisting = Some(BTreeSet::new()),
            watcher::Event::InitApply(lease) => {
                if let Some(names) = &mut self.relisting {
                    names.insert(lease.metadata.name.clone().unwrap_or_default());
                }
                self.remember(lease);
            }
            watcher::Event::InitDone => {
                if let Some(names) = self.relisting.take() {
                    let gone: Vec<String> = self
                        .seen
                        .keys()
                        .filter(|name| !names.contains(*name))
                        .cloned()
                        .collect();
                    for name in gone {
                        self.forget(&name);
                    }
                }
                self.listed = true;
            }
            watcher::Event::Apply(lease) => self.remember(lease),
            watcher::Event::Delete(lease) => self.forget(&lease.metadata.name.unwrap_or_default()),
        }
    }

    /// A Lease gone from the server: one that had a holder leaves a tombstone (see `vanished`).
    fn forget(&mut self, name: &str) {
        if let Some(observed) = self.seen.remove(name)
            && holder(&observed.lease).is_some()
        {
            self.vanished.insert(name.to_string(), Instant::now());
        }
    }

    /// How long after its last change another's Lease may be taken: the longer of our duration and
    /// the one written in it (a replica started with another `--shard-lease-duration` serves by its own).
    fn expiry(&self, lease: &Lease) -> Duration {
        let written = lease
            .spec
            .as_ref()
            .and_then(|spec| spec.lease_duration_seconds)
            .and_then(|seconds| u64::try_from(seconds).ok())
            .map(Duration::from_secs)
            .unwrap_or_default();
        self.settings.duration().max(written)
    }

    fn remember(&mut self, lease: Lease) {
        let name = lease.metadata.name.clone().unwrap_or_default();
        self.vanished.remove(&name);
        let version = lease.metadata.resource_version.clone();
        match self.seen.get_mut(&name) {
            Some(known) if known.lease.metadata.resource_version == version => {}
            Some(known) if older(&lease, &known.lease) => {}
            _ => {
                self.seen.insert(
                    name,
                    Observed {
                        lease,
                        changed: Instant::now(),
                    },
                );
            }
        }
    }

    /// When the next step is due without an event: a renewal, a deadline, another replica's
    /// Lease running out, or the end of the settling time.
    fn next_wake(&self) -> Instant {
        let now = Instant::now();
        let renew = self.settings.renew_interval();
        let deadline = self.settings.renew_deadline();
        let duration = self.settings.duration();
        let mut wake = now + renew;
        for holding in self.held.values() {
            wake = wake.min((holding.sent + renew).max(holding.next_try));
            wake = wake.min(holding.sent + deadline);
        }
        match &self.member {
            Some(member) => wake = wake.min((member.sent + self.member_interval()).max(member.next_try)),
            None => wake = wake.min(self.member_retry),
        }
        for observed in self.seen.values() {
            let expires = observed.changed + self.expiry(&observed.lease);
            if expires > now {
                wake = wake.min(expires + Duration::from_millis(10));
            }
        }
        for vanished in self.vanished.values() {
            let expires = *vanished + duration;
            if expires > now {
                wake = wake.min(expires + Duration::from_millis(10));
            }
        }
        if let Some(registered) = self.registered {
            let settled = registered + self.settings.settle();
            if settled > now {
                wake = wake.min(settled);
            }
        }
        wake.max(now + Duration::from_millis(10))
    }

    /// Renewals first; everything else (member Lease, taking and giving up slots, collecting)
    /// only until the next renewal is due, so that a slow or hung request there never makes a
    /// held slot miss its renewal. Work cut short is safe to drop: a slot counts as held only
    /// after its write returned, and is taken off the books before its release is sent.
    async fn step(&mut self) {
        self.expire();
        self.renew_slots().await;
        let budget = self.next_renewal().saturating_duration_since(Instant::now());
        let rest = async {
            self.renew_member().await;
            self.rebalance().await;
            self.settle_board().await;
        };
        if tokio::time::timeout(budget.max(Duration::from_millis(100)), rest)
            .await
            .is_err()
        {
            debug!("shard lease work cut short by a renewal due");
        }
        self.publish();
    }

    /// When the next renewal of a held slot is due (or retried).
    fn next_renewal(&self) -> Instant {
        let renew = self.settings.renew_interval();
        self.held
            .values()
            .map(|holding| (holding.sent + renew).max(holding.next_try))
            .min()
            .unwrap_or_else(|| Instant::now() + renew)
    }

    /// Slots whose renew deadline passed are lost: the daemon aborts their tenants at once.
    fn expire(&mut self) {
        let now = Instant::now();
        let duration = self.settings.duration();
        self.vanished.retain(|_, vanished| now < *vanished + duration);
        let deadline = self.settings.renew_deadline();
        let expired: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, holding)| holding.sent + deadline <= now)
            .map(|(slot, _)| *slot)
            .collect();
        if expired.is_empty() {
            return;
        }
        let mut table = self.board.lock();
        for slot in expired {
            error!(
                slot,
                ?deadline,
                "shard lease not renewed within its renew deadline; stopping its tenants"
            );
            self.held.remove(&slot);
            self.releasing.remove(&slot);
            if let Some(entry) = table.slots.get_mut(&slot) {
                entry.lease = SlotLease::Lost;
            }
        }
    }

    async fn renew_member(&mut self) {
        let now = Instant::now();
        let name = member_lease_name(&self.settings.identity);
        let due = match &self.member {
            None => now >= self.member_retry,
            Some(member) => now >= member.sent + self.member_interval() && now >= member.next_try,
        };
        if !due {
            return;
        }
        // Ours as last stored, else as the watch shows it (an earlier create that timed out, or
        // after a conflict), else a new one.
        let known = self.member.as_ref().map(|m| m.lease.clone());
        let known = known.or_else(|| self.seen.get(&name).map(|o| o.lease.clone()));
        let mut lease = known.unwrap_or_else(|| self.new_lease(&name, "member"));
        let create = lease.metadata.resource_version.is_none();
        lease
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(SHARDS_ANNOTATION.to_string(), self.settings.shards.to_string());
        stamp(&mut lease, &self.settings, create);
        let sent = Instant::now();
        match self.write(&name, &lease, create, self.settings.renew_interval()).await {
            Ok(stored) => {
                self.remember(stored.clone());
                self.registered.get_or_insert(sent);
                self.member = Some(held_from(&stored, sent));
                self.member_trouble = None;
            }
            Err(err) => {
                let trouble = err.to_string();
                if self.member_trouble.as_ref() == Some(&trouble) {
                    debug!(%err, "cannot renew this replica's member lease; retrying");
                } else {
                    warn!(%err, "cannot renew this replica's member lease; retrying");
                    self.member_trouble = Some(trouble);
                }
                let retry = Instant::now() + self.retry_delay();
                self.member_retry = retry;
                if matches!(err, WriteError::Conflict | WriteError::NotFound) {
                    // Changed or deleted by another replica (collected while this one was cut
                    // off): start again from what the watch shows.
                    self.member = None;
                } else if let Some(member) = &mut self.member {
                    member.next_try = retry;
                }
            }
        }
    }

    async fn renew_slots(&mut self) {
        let now = Instant::now();
        let renew = self.settings.renew_interval();
        let due: Vec<(u32, Lease, Instant)> = self
            .held
            .iter()
            .filter(|(_, h)| now >= h.sent + renew && now >= h.next_try)
            .map(|(slot, h)| (*slot, h.lease.clone(), h.sent + self.settings.renew_deadline()))
            .collect();
        let keeper = &*self;
        let writes = due.into_iter().map(|(slot, mut lease, deadline)| {
            stamp(&mut lease, &keeper.settings, false);
            async move {
                let sent = Instant::now();
                let within = deadline.saturating_duration_since(sent);
                let outcome = keeper.write(&slot_lease_name(slot), &lease, false, within).await;
                (slot, sent, outcome)
            }
        });
        let outcomes = futures::future::join_all(writes).await;
        for (slot, sent, outcome) in outcomes {
            match outcome {
                Ok(stored) => {
                    self.remember(stored.clone());
                    if let Some(holding) = self.held.get_mut(&slot) {
                        holding.lease = stored;
                        holding.sent = sent;
                    }
                }
                Err(WriteError::Conflict | WriteError::NotFound) => {
                    // Someone else wrote or deleted it: we no longer hold it, whatever we believed.
                    error!(slot, "shard lease was taken by another replica; stopping its tenants");
                    self.lose(slot);
                }
                Err(err) => {
                    warn!(slot, %err, "cannot renew a shard lease; retrying");
                    let retry = Instant::now() + self.retry_delay();
                    if let Some(holding) = self.held.get_mut(&slot) {
                        holding.next_try = retry;
                    }
                }
            }
        }
    }

    fn lose(&mut self, slot: u32) {
        self.held.remove(&slot);
        self.releasing.remove(&slot);
        if let Some(entry) = self.board.lock().slots.get_mut(&slot) {
            entry.lease = SlotLease::Lost;
        }
    }

    /// A replica holding slots is seen live through their renewals, so its member Lease (which
    /// keeps announcing its `--shards`) is not renewed then: Lease writes stay at 1.8 per slot
    /// per lease duration. Without slots (joining, or all given up) it is renewed like a slot.
    fn member_interval(&self) -> Duration {
        if self.held.is_empty() {
            self.settings.renew_interval()
        } else {
            Duration::from_secs(86_400)
        }
    }

    fn retry_delay(&self) -> Duration {
        (self.settings.duration() / 12).max(Duration::from_millis(200))
    }

    /// The live replicas' identities, this one included: holders of member or slot Leases seen
    /// changing within a lease duration; and whether all of them announce our slot count.
    fn live_members(&self) -> (BTreeSet<String>, bool) {
        let now = Instant::now();
        let mut live = BTreeSet::from([self.settings.identity.clone()]);
        for observed in self.seen.values() {
            if now < observed.changed + self.settings.duration()
                && let Some(holder) = holder(&observed.lease)
            {
                live.insert(holder.to_string());
            }
        }
        let ours = self.settings.shards.to_string();
        let agree = self
            .seen
            .values()
            .filter(|o| role(&o.lease) == Some("member"))
            .filter(|o| holder(&o.lease).is_some_and(|h| live.contains(h)))
            .filter_map(|o| o.lease.metadata.annotations.as_ref()?.get(SHARDS_ANNOTATION))
            .all(|shards| *shards == ours);
        (live, agree)
    }

    /// Gives up slots over the fair share, takes free ones under it.
    async fn rebalance(&mut self) {
        let Some(registered) = self.registered else { return };
        let now = Instant::now();
        if !self.listed || now < registered + self.settings.settle() {
            return;
        }
        if now > self.heard + self.settings.renew_interval() * 3 / 2 {
            // A stale view makes the others look dead: take nothing, give nothing up, collect
            // no member Lease until the watch catches up (held slots are still renewed).
            debug!("the shard lease watch is behind; not rebalancing");
            return;
        }
        let (live, agree) = self.live_members();
        let cap = if agree {
            fair_share(self.settings.shards, live.len())
        } else {
            // Replicas with another --shards map tenants to other slots: holding nothing is the
            // only way to never serve a tenant twice (during a change of --shards).
            warn!("a live replica uses another --shards; holding no slot until it is gone");
            0
        };
        {
            let mut table = self.board.lock();
            table.live = live.len();
            table.cap = cap;
        }
        let kept: Vec<u32> = self
            .held
            .keys()
            .filter(|slot| !self.releasing.contains(slot))
            .copied()
            .collect();
        for slot in surplus(&kept, &self.settings.identity, cap) {
            info!(
                slot,
                cap,
                live = live.len(),
                "giving up a shard slot over this replica's fair share"
            );
            self.releasing.insert(slot);
        }
        let room = cap.saturating_sub(self.held.len());
        if room > 0 {
            self.acquire(room).await;
        }
        self.collect_dead_members(&live).await;
    }

    fn free_slots(&self) -> Vec<u32> {
        let now = Instant::now();
        let busy = self.board.lock().slots.keys().copied().collect::<BTreeSet<u32>>();
        (0..self.settings.shards)
            .filter(|slot| !self.held.contains_key(slot) && !busy.contains(slot))
            .filter(|slot| {
                let name = slot_lease_name(*slot);
                match self.seen.get(&name) {
                    None => self
                        .vanished
                        .get(&name)
                        .is_none_or(|vanished| now >= *vanished + self.settings.duration()),
                    Some(observed) => match holder(&observed.lease) {
                        None => true,
                        Some(holder) if holder == self.settings.identity => true,
                        Some(_) => now >= observed.changed + self.expiry(&observed.lease),
                    },
                }
            })
            .collect()
    }

    async fn acquire(&mut self, room: usize) {
        let candidates = wanted(&self.free_slots(), &self.settings.identity, room);
        let keeper = &*self;
        let attempts = candidates.into_iter().map(|slot| {
            let name = slot_lease_name(slot);
            let previous = keeper.seen.get(&name).map(|o| o.lease.clone());
            let create = previous.is_none();
            let mut lease = previous.unwrap_or_else(|| keeper.new_lease(&name, "slot"));
            stamp(&mut lease, &keeper.settings, true);
            async move {
                let sent = Instant::now();
                let outcome = keeper
                    .write(&name, &lease, create, keeper.settings.renew_interval())
                    .await;
                (slot, sent, outcome)
            }
        });
        let outcomes = futures::future::join_all(attempts).await;
        for (slot, sent, outcome) in outcomes {
            match outcome {
                Ok(stored) => {
                    info!(slot, "acquired a shard slot");
                    self.remember(stored.clone());
                    self.held.insert(slot, held_from(&stored, sent));
                }
                Err(WriteError::Conflict) => debug!(slot, "another replica took the shard slot first"),
                Err(err) => warn!(slot, %err, "cannot take a shard slot"),
            }
        }
    }

    /// Member Leases of replicas gone for two lease durations are deleted, so that restarts do
    /// not pile them up (any replica may; the precondition makes a late delete harmless).
    async fn collect_dead_members(&mut self, live: &BTreeSet<String>) {
        let now = Instant::now();
        let dead: Vec<(String, Option<String>)> = self
            .seen
            .iter()
            .filter(|(_, o)| role(&o.lease) == Some("member"))
            .filter(|(_, o)| holder(&o.lease).is_none_or(|h| !live.contains(h)))
            .filter(|(_, o)| now >= o.changed + self.settings.duration() * 2)
            .map(|(name, o)| (name.clone(), o.lease.metadata.resource_version.clone()))
            .collect();
        for (name, version) in dead {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: version,
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match self.api.delete(&name, &params).await {
                Ok(_) => info!(lease = %name, "deleted the member lease of a replica gone for good"),
                Err(err) => debug!(lease = %name, %err, "member lease not deleted"),
            }
            self.seen.remove(&name);
        }
    }

    /// Slots the daemon no longer serves: lost ones are forgotten, released ones given back.
    async fn settle_board(&mut self) {
        let mut release = Vec::new();
        {
            let mut table = self.board.lock();
            table
                .slots
                .retain(|_, entry| entry.serving || entry.lease != SlotLease::Lost);
            for slot in self.releasing.clone() {
                let serving = table.slots.get(&slot).is_some_and(|entry| entry.serving);
                if !serving {
                    table.slots.remove(&slot);
                    self.releasing.remove(&slot);
                    if let Some(holding) = self.held.remove(&slot) {
                        release.push((slot, holding.lease));
                    }
                }
            }
        }
        let writes = release.into_iter().map(|(slot, lease)| self.release(slot, lease));
        futures::future::join_all(writes).await;
    }

    /// Clears the holder so that another replica takes the slot at once.
    async fn release(&self, slot: u32, mut lease: Lease) {
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        match self
            .write(&slot_lease_name(slot), &lease, false, Duration::from_secs(2))
            .await
        {
            Ok(_) => info!(slot, "released a shard slot"),
            Err(err) => warn!(slot, %err, "cannot release a shard slot; it expires instead"),
        }
    }

    /// The board gets the held slots and their deadlines; the daemon is woken.
    fn publish(&self) {
        let deadline = self.settings.renew_deadline();
        {
            let mut table = self.board.lock();
            for (slot, holding) in &self.held {
                let until = holding.sent + deadline;
                let lease = if self.releasing.contains(slot) {
                    SlotLease::Releasing { deadline: until }
                } else {
                    SlotLease::Held { deadline: until }
                };
                table
                    .slots
                    .entry(*slot)
                    .and_modify(|entry| entry.lease = lease)
                    .or_insert(Slot { lease, serving: false });
            }
        }
        self.board.to_daemon.notify_one();
    }

    /// On shutdown, after the daemon stopped every tenant: every slot and the member Lease go.
    async fn leave(&mut self) {
        self.releasing.extend(self.held.keys().copied());
        self.settle_board().await;
        let name = member_lease_name(&self.settings.identity);
        let params = DeleteParams::default();
        let deleted = tokio::time::timeout(Duration::from_secs(2), self.api.delete(&name, &params)).await;
        if !matches!(deleted, Ok(Ok(_))) {
            warn!("cannot delete this replica's member lease; it expires instead");
        }
        self.publish();
    }

    fn new_lease(&self, name: &str, role: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(self.settings.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (LEASE_ROLE_LABEL.to_string(), role.to_string()),
                    ("app.kubernetes.io/managed-by".to_string(), "stackd".to_string()),
                ])),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec::default()),
        }
    }

    /// One optimistic write: create, or replace at the resourceVersion the Lease carries.
    async fn write(&self, name: &str, lease: &Lease, create: bool, within: Duration) -> Result<Lease, WriteError> {
        let params = PostParams::default();
        let request = async {
            if create {
                self.api.create(&params, lease).await
            } else {
                self.api.replace(name, &params, lease).await
            }
        };
        match tokio::time::timeout(within, request).await {
            Err(_) => Err(WriteError::Timeout),
            Ok(Ok(stored)) => Ok(stored),
            Ok(Err(err)) if is_conflict(&err) => Err(WriteError::Conflict),
            // Nothing to find but the namespace: a create's 404 says it does not exist.
            Ok(Err(err)) if is_not_found(&err) && create => {
                Err(WriteError::NoNamespace(self.settings.namespace.clone()))
            }
            Ok(Err(err)) if is_not_found(&err) => Err(WriteError::NotFound),
            Ok(Err(err)) => Err(WriteError::Api(err.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error("the lease changed since it was read")]
    Conflict,
    #[error("the lease is gone")]
    NotFound,
    #[error(
        "the namespace {0} of the shard Leases does not exist on the host: create it, or pass --shard-namespace with one that does"
    )]
    NoNamespace(String),
    #[error("the host did not answer in time")]
    Timeout,
    #[error("{0}")]
    Api(String),
}

fn held_from(lease: &Lease, sent: Instant) -> Holding {
    Holding {
        lease: lease.clone(),
        sent,
        next_try: sent,
    }
}

/// Sets us as holder with a fresh renew time; `acquire` also sets the acquire time and counts a
/// transition when the holder changes.
fn stamp(lease: &mut Lease, settings: &ShardSettings, acquire: bool) {
    let now = MicroTime(jiff::Timestamp::now());
    let spec = lease.spec.get_or_insert_default();
    if acquire {
        if spec.holder_identity.as_deref() != Some(settings.identity.as_str()) {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.acquire_time = Some(now.clone());
    }
    spec.holder_identity = Some(settings.identity.clone());
    spec.lease_duration_seconds = Some(i32::try_from(settings.duration_seconds).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
}

fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|spec| spec.holder_identity.as_deref())
        .filter(|holder| !holder.is_empty())
}

fn role(lease: &Lease) -> Option<&str> {
    lease
        .metadata
        .labels
        .as_ref()?
        .get(LEASE_ROLE_LABEL)
        .map(String::as_str)
}

/// Whether `lease` is an older version than `known` (a watch event arriving after our own write
/// was remembered). Resource versions are opaque, but both come from one server: compare as
/// numbers when they are, else take the event.
fn older(lease: &Lease, known: &Lease) -> bool {
    let number = |l: &Lease| {
        l.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
    };
    matches!((number(lease), number(known)), (Some(a), Some(b)) if a < b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(identity: &str) -> ShardSettings {
        ShardSettings {
            shards: 8,
            namespace: "stackd-system".to_string(),
            identity: identity.to_string(),
            duration_seconds: 6,
            host: kube::Config::new("https://127.0.0.1:6443".parse().expect("a URL")),
        }
    }

    fn lease(holder: Option<&str>, version: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                resource_version: Some(version.to_string()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                lease_transitions: Some(2),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn taking_a_slot_from_another_holder_counts_a_transition_and_a_renewal_does_not() {
        let mut taken = lease(Some("b"), "7");
        stamp(&mut taken, &settings("a"), true);
        let spec = taken.spec.expect("a spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("a"));
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(spec.lease_duration_seconds, Some(6));
        assert!(spec.acquire_time.is_some() && spec.renew_time.is_some());
        let mut renewed = lease(Some("a"), "8");
        stamp(&mut renewed, &settings("a"), false);
        let spec = renewed.spec.expect("a spec");
        assert_eq!(spec.lease_transitions, Some(2));
        assert!(spec.acquire_time.is_none(), "a renewal keeps the acquire time");
    }

    fn keeper(identity: &str) -> Keeper {
        let settings = settings(identity);
        let client = kube::Client::try_from(settings.host.clone()).expect("a client");
        Keeper::new(
            settings,
            Arc::new(Board::default()),
            Api::namespaced(client, "stackd-system"),
        )
    }

    fn slot_lease(slot: u32, holder: &str, duration_seconds: i32) -> Lease {
        let mut held = lease(Some(holder), "5");
        held.metadata.name = Some(slot_lease_name(slot));
        if let Some(spec) = held.spec.as_mut() {
            spec.lease_duration_seconds = Some(duration_seconds);
        }
        held
    }

    #[tokio::test]
    async fn a_deleted_slot_lease_stays_taken_for_a_lease_duration() {
        let mut keeper = keeper("a");
        keeper.observe(watcher::Event::Apply(slot_lease(3, "b", 6)));
        keeper.observe(watcher::Event::Delete(slot_lease(3, "b", 6)));
        assert!(
            !keeper.free_slots().contains(&3),
            "b may serve until its renewal finds it gone"
        );
        if let Some(vanished) = keeper.vanished.get_mut(&slot_lease_name(3)) {
            *vanished -= keeper.settings.duration();
        }
        assert!(keeper.free_slots().contains(&3));
    }

    #[tokio::test]
    async fn a_lease_written_with_a_longer_duration_is_waited_out_in_full() {
        let mut keeper = keeper("a");
        keeper.observe(watcher::Event::Apply(slot_lease(2, "b", 30)));
        if let Some(observed) = keeper.seen.get_mut(&slot_lease_name(2)) {
            observed.changed -= Duration::from_secs(10);
        }
        assert!(
            !keeper.free_slots().contains(&2),
            "b serves by its own 30 s, not our 6 s"
        );
        if let Some(observed) = keeper.seen.get_mut(&slot_lease_name(2)) {
            observed.changed -= Duration::from_secs(21);
        }
        assert!(keeper.free_slots().contains(&2));
    }

    #[test]
    fn a_released_slot_has_no_holder_and_a_late_watch_event_is_older() {
        assert_eq!(holder(&lease(None, "1")), None);
        assert_eq!(holder(&lease(Some(""), "1")), None);
        assert_eq!(holder(&lease(Some("a"), "1")), Some("a"));
        assert!(older(&lease(None, "9"), &lease(None, "10")));
        assert!(!older(&lease(None, "10"), &lease(None, "9")));
        assert!(
            !older(&lease(None, "opaque"), &lease(None, "10")),
            "opaque versions: take the event"
        );
    }
}
