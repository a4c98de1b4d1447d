//! The lease thread: keeps this replica's member Lease, watches the others' and the shard map,
//! tells the daemon what the map gives this replica, hands tenants over once the daemon stopped
//! them, and, while this replica coordinates, places the tenants (`assign::plan`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::assign::{Epoch, ShardMap, plan};
use super::{
    Board, LEASE_ROLE_LABEL, MAP_KEY, MAP_NAME, MAP_SCHEME, SHARDS_ANNOTATION, ShardSettings, member_lease_name,
};
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::recovery::{WatchBackoff, retry_watch};

/// A Lease as last seen, and when it last changed as seen from here (never the holder's clock).
struct Observed {
    lease: Lease,
    changed: Instant,
}

/// This replica's member Lease.
struct Member {
    /// As the server stored it after our last write.
    lease: Lease,
    epoch: Epoch,
    /// When our last stored write was sent: the renew deadline runs from here.
    sent: Instant,
    /// No renewal attempt before this (after a failed one).
    next_try: Instant,
}

/// The shard map as last seen.
enum MapView {
    /// Not listed yet.
    Unknown,
    Absent,
    Present {
        map: ShardMap,
        version: String,
    },
    /// Cannot be read: nobody serves by it, and nobody overwrites it, until an admin fixes it.
    Broken {
        version: String,
        why: String,
    },
}

impl MapView {
    fn version(&self) -> Option<&str> {
        match self {
            MapView::Present { version, .. } | MapView::Broken { version, .. } => Some(version),
            MapView::Unknown | MapView::Absent => None,
        }
    }
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
    let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
    let maps: Api<ConfigMap> = Api::namespaced(client, &settings.namespace);
    let mut lease_events = retry_watch(
        watcher::watcher(leases.clone(), watcher::Config::default().labels(LEASE_ROLE_LABEL)).boxed(),
        None,
        WatchBackoff::default(),
    );
    let only_map = watcher::Config::default().fields(&format!("metadata.name={MAP_NAME}"));
    let mut map_events = retry_watch(
        watcher::watcher(maps.clone(), only_map).boxed(),
        None,
        WatchBackoff::default(),
    );
    let mut keeper = Keeper::new(settings, board.clone(), leases, maps);
    info!(identity = %keeper.settings.identity, "joining the shard leases");
    loop {
        let wake = keeper.next_wake();
        tokio::select! {
            _ = &mut shutdown => break,
            event = lease_events.next() => match event {
                Some(Ok(event)) => keeper.observe(event),
                Some(Err(err)) => debug!(%err, "shard lease watch failed; retrying"),
                None => break,
            },
            event = map_events.next() => match event {
                Some(Ok(event)) => keeper.observe_map(event),
                Some(Err(err)) => debug!(%err, "shard map watch failed; retrying"),
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
    leases: Api<Lease>,
    maps: Api<ConfigMap>,
    seen: BTreeMap<String, Observed>,
    /// Names seen since a (re)list of the Leases started; `None` outside of one.
    relisting: Option<BTreeSet<String>>,
    /// The first list of the Leases is done.
    listed: bool,
    /// When the Lease watch last delivered anything. Our own renewals come back through it at
    /// least once a renew interval, so a longer silence means the view of the others is stale.
    heard: Instant,
    map: MapView,
    /// Whether the map's (re)list found it; `None` outside of one.
    map_relisting: Option<bool>,
    member: Option<Member>,
    /// No member Lease write before this while `member` is unknown (after a failed one).
    member_retry: Instant,
    /// Why the member Lease could not be written, as last logged: not logged again on each retry.
    member_trouble: Option<String>,
    registered: Option<Instant>,
    /// Epochs known to be gone: their tenants may be given to others.
    dead: BTreeSet<Epoch>,
    /// Epochs whose Lease was found gone without being released, and when: the holder may serve
    /// until its deadline, so they count as gone a lease duration later.
    vanished: BTreeMap<Epoch, Instant>,
    /// Why this replica waits, as last logged.
    waiting: Option<String>,
    /// Why this replica, the one to coordinate, does not yet, as last logged.
    not_coordinating: Option<&'static str>,
}

impl Keeper {
    fn new(settings: ShardSettings, board: Arc<Board>, leases: Api<Lease>, maps: Api<ConfigMap>) -> Keeper {
        Keeper {
            settings,
            board,
            leases,
            maps,
            seen: BTreeMap::new(),
            relisting: None,
            listed: false,
            heard: Instant::now(),
            map: MapView::Unknown,
            map_relisting: None,
            member: None,
            member_retry: Instant::now(),
            member_trouble: None,
            registered: None,
            dead: BTreeSet::new(),
            vanished: BTreeMap::new(),
            waiting: None,
            not_coordinating: None,
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
                    self.seen.retain(|name, _| names.contains(name));
                }
                self.listed = true;
            }
            watcher::Event::Apply(lease) => self.remember(lease),
            watcher::Event::Delete(lease) => {
                self.seen.remove(&lease.metadata.name.unwrap_or_default());
            }
        }
    }

    fn observe_map(&mut self, event: watcher::Event<ConfigMap>) {
        match event {
            watcher::Event::Init => self.map_relisting = Some(false),
            watcher::Event::InitApply(map) => {
                self.map_relisting = Some(true);
                self.remember_map(&map);
            }
            watcher::Event::InitDone => {
                if self.map_relisting.take() == Some(false) {
                    self.map = MapView::Absent;
                }
            }
            watcher::Event::Apply(map) => self.remember_map(&map),
            watcher::Event::Delete(_) => self.map = MapView::Absent,
        }
    }

    fn remember_map(&mut self, stored: &ConfigMap) {
        let version = stored.metadata.resource_version.clone().unwrap_or_default();
        if let Some(known) = self.map.version()
            && older_version(&version, known)
        {
            return;
        }
        let text = stored
            .data
            .as_ref()
            .and_then(|data| data.get(MAP_KEY))
            .map_or("", String::as_str);
        self.map = match ShardMap::from_json(text) {
            Ok(map) => MapView::Present { map, version },
            Err(why) => {
                error!(
                    map = MAP_NAME,
                    %why,
                    "the shard map cannot be read; no replica serves by it until it is fixed (scale the replicas to zero and delete it)"
                );
                MapView::Broken { version, why }
            }
        };
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

    /// When the next step is due without an event: a renewal, the deadline, another replica's
    /// Lease running out, a vanished one counting as gone, or the end of the settling time.
    fn next_wake(&self) -> Instant {
        let now = Instant::now();
        let renew = self.settings.renew_interval();
        let mut wake = now + renew;
        match &self.member {
            Some(member) => {
                wake = wake.min((member.sent + renew).max(member.next_try));
                wake = wake.min(member.sent + self.settings.renew_deadline());
            }
            None => wake = wake.min(self.member_retry),
        }
        let expiries = self
            .seen
            .values()
            .map(|observed| observed.changed + self.expiry(&observed.lease));
        let gone = self.vanished.values().map(|at| *at + self.settings.duration());
        for at in expiries.chain(gone) {
            if at > now {
                wake = wake.min(at + Duration::from_millis(10));
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

    /// The renewal first; everything else (handing over, coordinating, collecting) only until
    /// the next renewal is due, so that a slow or hung request there never makes the Lease miss
    /// its renewal. Work cut short is safe to drop: every map write is one optimistic write.
    async fn step(&mut self) {
        self.renew_member().await;
        self.publish();
        let due = self.member.as_ref().map_or_else(Instant::now, |m| {
            (m.sent + self.settings.renew_interval()).max(m.next_try)
        });
        let budget = due.saturating_duration_since(Instant::now());
        let rest = async {
            self.hand_over().await;
            self.coordinate().await;
            self.collect().await;
        };
        if tokio::time::timeout(budget.max(Duration::from_millis(100)), rest)
            .await
            .is_err()
        {
            debug!("shard work cut short by a renewal due");
        }
        self.publish();
    }

    async fn renew_member(&mut self) {
        let now = Instant::now();
        let name = member_lease_name(&self.settings.identity);
        let due = match &self.member {
            None => now >= self.member_retry,
            Some(member) => now >= member.sent + self.settings.renew_interval() && now >= member.next_try,
        };
        if !due {
            return;
        }
        // Ours as last stored, else as the watch shows it (an earlier create whose answer was lost,
        // which a create again would find taken for ever), else a new one.
        let mut lease = match &self.member {
            Some(member) => member.lease.clone(),
            None => self
                .seen
                .get(&name)
                .map(|observed| observed.lease.clone())
                .unwrap_or_else(|| self.new_lease(&name)),
        };
        let create = lease.metadata.resource_version.is_none();
        stamp(&mut lease, &self.settings, create);
        let sent = Instant::now();
        match self.write(&name, &lease, create, self.settings.renew_interval()).await {
            Ok(stored) => {
                let epoch = Epoch {
                    id: self.settings.identity.clone(),
                    uid: stored.metadata.uid.clone().unwrap_or_default(),
                };
                if create {
                    info!(uid = %epoch.uid, "registered this replica's member lease");
                }
                self.remember(stored.clone());
                self.registered.get_or_insert(sent);
                self.member = Some(Member {
                    lease: stored,
                    epoch,
                    sent,
                    next_try: sent,
                });
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
                    // Deleted (or changed) by another replica, which found it expired: every
                    // tenant of this epoch is being given away. A new Lease is a new epoch.
                    if let Some(member) = self.member.take() {
                        error!("this replica's member lease was taken; stopping its tenants");
                        self.dead.insert(member.epoch);
                    }
                } else if let Some(member) = &mut self.member {
                    member.next_try = retry;
                }
            }
        }
    }

    fn retry_delay(&self) -> Duration {
        (self.settings.duration() / 12).max(Duration::from_millis(200))
    }

    /// The live replicas' epochs, this one's included, by identity; and why this replica must
    /// wait instead, if a replica of an earlier stackd (slot Leases) is alive.
    fn live_members(&self) -> (Vec<Epoch>, Option<String>) {
        let now = Instant::now();
        let mut live = Vec::new();
        let mut waiting = None;
        for observed in self.seen.values() {
            let lease = &observed.lease;
            if now >= observed.changed + self.expiry(lease) {
                continue;
            }
            let Some(holder) = holder(lease) else { continue };
            let announced = lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|annotations| annotations.get(SHARDS_ANNOTATION));
            if role(lease) != Some("member") || announced.map(String::as_str) != Some(MAP_SCHEME) {
                waiting = Some(format!(
                    "replica {holder} runs a stackd that shares tenants over shard slot Leases; this one serves no tenant until it is gone"
                ));
                continue;
            }
            if holder == self.settings.identity {
                continue;
            }
            live.push(Epoch {
                id: holder.to_string(),
                uid: lease.metadata.uid.clone().unwrap_or_default(),
            });
        }
        if let Some(member) = &self.member {
            live.push(member.epoch.clone());
        }
        live.sort();
        (live, waiting)
    }

    /// The board gets what the map gives this replica and until when it may serve it.
    fn publish(&mut self) {
        let (live, waiting) = self.live_members();
        if waiting != self.waiting {
            if let Some(why) = &waiting {
                warn!("{why}");
            }
            self.waiting = waiting.clone();
        }
        let deadline = self.settings.renew_deadline();
        {
            let mut table = self.board.lock();
            table.alive_until = self
                .member
                .as_ref()
                .filter(|_| waiting.is_none())
                .map(|member| member.sent + deadline);
            let (assigned, releasing) = match (&self.map, &self.member) {
                (MapView::Present { map, .. }, Some(member)) => map.owned_by(&member.epoch),
                _ => Default::default(),
            };
            table.assigned = assigned;
            table.releasing = releasing;
            table.live = live.len();
            table.unserved = match (&self.map, &table.known) {
                (MapView::Present { map, .. }, Some(known)) => map.unserved(&live, known),
                (_, Some(known)) => known.len(),
                (_, None) => 0,
            };
            table.waiting = match &self.map {
                MapView::Broken { why, .. } => Some(format!("the shard map {MAP_NAME} cannot be read: {why}")),
                _ => waiting,
            };
        }
        self.board.to_daemon.notify_one();
    }

    /// The owner's part of a handover: the tenants the map asks this replica to give, once the
    /// daemon stopped them, go where they were moving.
    async fn hand_over(&mut self) {
        let (Some(member), MapView::Present { map, version }) = (&self.member, &self.map) else {
            return;
        };
        let stopped: BTreeSet<String> = {
            let table = self.board.lock();
            let (_, moving) = map.owned_by(&member.epoch);
            moving.into_iter().filter(|t| !table.running.contains(t)).collect()
        };
        if stopped.is_empty() {
            return;
        }
        let mut next = map.clone();
        next.hand_over(&member.epoch, &stopped);
        let version = version.clone();
        if self.write_map(&next, Some(version)).await {
            info!(tenants = stopped.len(), "handed tenants over to their new replicas");
        }
    }

    /// While this replica is the live one with the least identity: confirms which owners are
    /// gone, and writes the plan if it differs from the map.
    async fn coordinate(&mut self) {
        let Some(registered) = self.registered else { return };
        let now = Instant::now();
        let (live, waiting) = self.live_members();
        if self.member.is_none()
            || waiting.is_some()
            || live.first().map(|epoch| epoch.id.as_str()) != Some(self.settings.identity.as_str())
        {
            self.not_coordinating = None;
            return;
        }
        let blocked = if !self.listed || now < registered + self.settings.settle() {
            Some("the other replicas' member Leases are not listed yet")
        } else if now > self.heard + self.settings.renew_interval() * 3 / 2 {
            // A stale view makes the others look dead: coordinate nothing until it catches up.
            Some("the member Lease watch is behind")
        } else if self.board.lock().known.is_none() {
            Some("the tenants are not read yet")
        } else if matches!(self.map, MapView::Unknown) {
            Some("the shard map is not read yet")
        } else {
            None
        };
        if blocked != self.not_coordinating {
            if let Some(why) = blocked {
                info!(why, "this replica coordinates the shard map, but not yet");
            }
            self.not_coordinating = blocked;
        }
        if blocked.is_some() {
            return;
        }
        let Some(known) = self.board.lock().known.clone() else {
            return;
        };
        let (current, version) = match &self.map {
            MapView::Present { map, version } => (map.clone(), Some(version.clone())),
            MapView::Absent => (ShardMap::default(), None),
            MapView::Unknown | MapView::Broken { .. } => return,
        };
        for suspect in current.suspects(&live, &self.dead) {
            self.confirm(&suspect).await;
        }
        let next = plan(&current, &live, &self.dead, &known);
        if next != current && self.write_map(&next, version).await {
            let placed = next.tenants.len();
            let moving = next.tenants.values().filter(|entry| entry.moving.is_some()).count();
            info!(placed, moving, live = live.len(), "wrote the shard map");
        }
        // What the map no longer names need not be remembered.
        let named: BTreeSet<&Epoch> = next.tenants.values().map(|entry| &entry.owner).collect();
        self.dead.retain(|epoch| named.contains(epoch));
        self.vanished.retain(|epoch, _| named.contains(epoch));
    }

    /// Finds out whether an owner the map names, not seen live, is gone: its Lease released, or
    /// deleted here once expired (with preconditions: a renewal in between keeps it), or not in
    /// view for a lease duration.
    async fn confirm(&mut self, suspect: &Epoch) {
        let name = member_lease_name(&suspect.id);
        let now = Instant::now();
        if let Some(observed) = self.seen.get(&name)
            && observed.lease.metadata.uid.as_deref() == Some(suspect.uid.as_str())
        {
            if holder(&observed.lease).is_none() {
                // Released by a replica that stopped its tenants first.
                self.dead.insert(suspect.clone());
            } else if now >= observed.changed + self.expiry(&observed.lease) {
                let params = DeleteParams {
                    preconditions: Some(Preconditions {
                        resource_version: observed.lease.metadata.resource_version.clone(),
                        uid: Some(suspect.uid.clone()),
                    }),
                    ..DeleteParams::default()
                };
                match self.leases.delete(&name, &params).await {
                    Ok(_) => {
                        warn!(replica = %suspect.id, "deleted the expired member lease of a replica; its tenants go to the others");
                        self.seen.remove(&name);
                        self.dead.insert(suspect.clone());
                    }
                    Err(err) if is_not_found(&err) => {
                        self.vanished.entry(suspect.clone()).or_insert(now);
                    }
                    Err(err) => debug!(lease = %name, %err, "expired member lease not deleted"),
                }
            }
            return;
        }
        // Not in view: deleted (or never seen, if the map came before its Lease). Its holder may
        // serve until its renew deadline, and the view, fresh within a renew interval and a half,
        // would show a Lease still renewed: after a lease duration unseen, it is gone.
        let since = *self.vanished.entry(suspect.clone()).or_insert(now);
        if now >= since + self.settings.duration() {
            self.dead.insert(suspect.clone());
        }
    }

    /// Member Leases of replicas gone for two lease durations and owning nothing, and the slot
    /// Leases of an earlier stackd that nobody holds, are deleted so that they do not pile up (any
    /// replica may; the precondition makes a late delete harmless).
    async fn collect(&mut self) {
        let now = Instant::now();
        let named: BTreeSet<String> = match &self.map {
            MapView::Present { map, .. } => map.tenants.values().map(|entry| entry.owner.id.clone()).collect(),
            MapView::Absent => BTreeSet::new(),
            MapView::Unknown | MapView::Broken { .. } => return,
        };
        let stale: Vec<(String, Option<String>)> = self
            .seen
            .iter()
            .filter(|(_, o)| now >= o.changed + self.expiry(&o.lease) * 2)
            .filter(|(_, o)| holder(&o.lease).is_none_or(|h| h != self.settings.identity && !named.contains(h)))
            .map(|(name, o)| (name.clone(), o.lease.metadata.resource_version.clone()))
            .collect();
        for (name, version) in stale {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: version,
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            match self.leases.delete(&name, &params).await {
                Ok(_) => info!(lease = %name, "deleted the lease of a replica gone for good"),
                Err(err) => debug!(lease = %name, %err, "lease not deleted"),
            }
            self.seen.remove(&name);
        }
    }

    /// On shutdown, after the daemon stopped every tenant: the member Lease is released (no
    /// holder), which tells the coordinator at once that this replica's tenants may go, then
    /// deleted.
    async fn leave(&mut self) {
        let Some(member) = self.member.take() else { return };
        {
            let mut table = self.board.lock();
            table.alive_until = None;
            table.assigned.clear();
            table.releasing.clear();
        }
        self.board.to_daemon.notify_one();
        let name = member_lease_name(&self.settings.identity);
        let mut lease = member.lease;
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        }
        match self.write(&name, &lease, false, Duration::from_secs(2)).await {
            Ok(_) => info!("released this replica's member lease; the others take its tenants"),
            Err(err) => warn!(%err, "cannot release this replica's member lease; it expires instead"),
        }
    }

    fn new_lease(&self, name: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(self.settings.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (LEASE_ROLE_LABEL.to_string(), "member".to_string()),
                    ("app.kubernetes.io/managed-by".to_string(), "stackd".to_string()),
                ])),
                annotations: Some(BTreeMap::from([(
                    SHARDS_ANNOTATION.to_string(),
                    MAP_SCHEME.to_string(),
                )])),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec::default()),
        }
    }

    /// One optimistic write of the map: at `version`, or a create when there is none. Whether it
    /// was stored (what was stored is remembered).
    async fn write_map(&mut self, map: &ShardMap, version: Option<String>) -> bool {
        let object = ConfigMap {
            metadata: ObjectMeta {
                name: Some(MAP_NAME.to_string()),
                namespace: Some(self.settings.namespace.clone()),
                resource_version: version.clone(),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    "stackd".to_string(),
                )])),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([(MAP_KEY.to_string(), map.to_json())])),
            ..ConfigMap::default()
        };
        let params = PostParams::default();
        let request = async {
            match version {
                Some(_) => self.maps.replace(MAP_NAME, &params, &object).await,
                None => self.maps.create(&params, &object).await,
            }
        };
        match tokio::time::timeout(self.settings.renew_interval(), request).await {
            Ok(Ok(stored)) => {
                self.remember_map(&stored);
                true
            }
            Ok(Err(err)) if is_conflict(&err) => {
                debug!("the shard map changed since it was read; trying again on the next change");
                false
            }
            Ok(Err(err)) => {
                warn!(%err, "cannot write the shard map; retrying");
                false
            }
            Err(_) => {
                warn!("the host did not answer a shard map write in time; retrying");
                false
            }
        }
    }

    /// One optimistic write: create, or replace at the resourceVersion the Lease carries.
    async fn write(&self, name: &str, lease: &Lease, create: bool, within: Duration) -> Result<Lease, WriteError> {
        let params = PostParams::default();
        let request = async {
            if create {
                self.leases.create(&params, lease).await
            } else {
                self.leases.replace(name, &params, lease).await
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

/// Sets us as holder with a fresh renew time; a create also sets the acquire time.
fn stamp(lease: &mut Lease, settings: &ShardSettings, create: bool) {
    let now = MicroTime(jiff::Timestamp::now());
    let spec = lease.spec.get_or_insert_default();
    if create {
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
/// was remembered).
fn older(lease: &Lease, known: &Lease) -> bool {
    match (&lease.metadata.resource_version, &known.metadata.resource_version) {
        (Some(a), Some(b)) => older_version(a, b),
        _ => false,
    }
}

/// Resource versions are opaque, but both come from one server: compare as numbers when they
/// are, else take the newer event.
fn older_version(version: &str, known: &str) -> bool {
    matches!((version.parse::<u64>(), known.parse::<u64>()), (Ok(a), Ok(b)) if a < b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(identity: &str) -> ShardSettings {
        ShardSettings {
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
                ..LeaseSpec::default()
            }),
        }
    }

    fn keeper(identity: &str) -> Keeper {
        let settings = settings(identity);
        let client = kube::Client::try_from(settings.host.clone()).expect("a client");
        Keeper::new(
            settings,
            Arc::new(Board::default()),
            Api::namespaced(client.clone(), "stackd-system"),
            Api::namespaced(client, "stackd-system"),
        )
    }

    fn member_lease(holder: &str, role: &str, scheme: Option<&str>) -> Lease {
        let mut held = lease(Some(holder), "5");
        held.metadata.name = Some(member_lease_name(holder));
        held.metadata.uid = Some(format!("uid-{holder}"));
        held.metadata.labels = Some(BTreeMap::from([(LEASE_ROLE_LABEL.to_string(), role.to_string())]));
        held.metadata.annotations = scheme.map(|s| BTreeMap::from([(SHARDS_ANNOTATION.to_string(), s.to_string())]));
        held
    }

    #[tokio::test]
    async fn live_replicas_are_those_renewing_and_one_of_an_earlier_stackd_makes_this_one_wait() {
        let mut keeper = keeper("a");
        keeper.observe(watcher::Event::Apply(member_lease("b", "member", Some(MAP_SCHEME))));
        let (live, waiting) = keeper.live_members();
        assert_eq!(live.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["b"]);
        assert!(waiting.is_none());
        if let Some(observed) = keeper.seen.get_mut(&member_lease_name("b")) {
            observed.changed -= keeper.settings.duration();
        }
        assert!(keeper.live_members().0.is_empty(), "not renewed for a lease duration");
        keeper.observe(watcher::Event::Apply(member_lease("old", "member", Some("32"))));
        assert!(keeper.live_members().1.is_some(), "a replica announcing slots");
        let mut keeper = self::keeper("a");
        keeper.observe(watcher::Event::Apply(member_lease("old", "slot", None)));
        assert!(keeper.live_members().1.is_some(), "a slot Lease held");
    }

    #[test]
    fn a_released_lease_has_no_holder_and_a_late_watch_event_is_older() {
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
