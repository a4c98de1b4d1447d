//! Tenant objects on the host (DESIGN.md §1 "Tenants" (b)): the second source of tenants, beside the
//! tenants directory. A cluster-scoped `Tenant` names the Secret holding the tenant's kubeconfig.
//!
//! - Secrets are read only in the namespaces the daemon is given (`--tenant-secret-namespaces`): an
//!   allow-list checked before any request, so a Tenant cannot make the daemon read a Secret
//!   elsewhere. The namespaces Tenants name are watched by Secret metadata only; a Secret a Tenant
//!   names is read with one GET when it changes, so a new kubeconfig takes effect at once.
//! - The same rules as files: the name is a DNS label fitting the host namespace template; a
//!   deleted (or `spec.suspend`ed) Tenant suspends its tenant and keeps its host objects; a
//!   kubeconfig that becomes unusable keeps the tenant running on the one before, and is reported.
//! - What became of each Tenant ([`Registration`]) is shared with the status writer (`status`),
//!   which the replica serving the tenant runs.

pub mod kubeconfig;
mod secrets;
pub mod status;
pub mod table;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store, store::Writer};
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::kubeconfig::{ReadError, Refusal, Source};
use self::secrets::{Listing, SecretVersion, SecretWatches};
use super::directory::{TenantChange, TenantFile, TenantFileError};
use crate::api::tenancy::{KubeconfigSecretRef, Tenant};
use crate::context::namespace_template::NamespaceTemplate;
use crate::runtime::cause::diagnose;
use crate::runtime::deadline::sleep_until;
use crate::runtime::reachability::Reachability;
use crate::runtime::recovery::{WatchBackoff, retry_watch};
use crate::runtime::retry::is_quiet_watch_failure;

/// How long the first batch waits for the Secrets of the namespaces Tenants name to be listed.
const FIRST_BATCH_WAIT: Duration = Duration::from_secs(10);
/// When a Secret could not be read for a passing reason, it is read again after this.
const READ_RETRY: Duration = Duration::from_secs(5);
/// The longest a Secret's read may take: a pass waits for its reads, and a host that holds one open
/// must not hold up every other Tenant's registration for longer.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How many Secrets a pass reads at once.
const READS_AT_ONCE: usize = 8;
/// The longest wait between attempts to list Tenants, or the Secrets of a namespace: a list the
/// host refuses (the CRD not installed, the list not permitted) stays refused until an admin acts.
const LIST_RETRY_MAX: Duration = Duration::from_secs(30);

/// What the Tenant objects source is given.
#[derive(Clone, Debug)]
pub struct ObjectSettings {
    /// The namespaces whose Secrets Tenants may name (`--tenant-secret-namespaces`).
    pub secret_namespaces: BTreeSet<String>,
    pub template: NamespaceTemplate,
}

/// What became of one Tenant object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Registration {
    /// Its Secret's namespace is not listed yet.
    Pending,
    /// Served from its Secret. `kept`: why the Secret's current kubeconfig is not used (the tenant
    /// keeps running on the one before).
    Accepted { kept: Option<Refusal> },
    /// `spec.suspend`: not served, host objects kept.
    Suspended,
    /// Not served, and why.
    Refused(Refusal),
}

/// The Tenant objects and what became of each, shared by the source, the merge of the sources
/// (which records name conflicts here) and the status writer.
pub struct TenantObjects {
    store: Store<Tenant>,
    names: Mutex<BTreeSet<String>>,
    registrations: Mutex<BTreeMap<String, Registration>>,
    /// Names a file of the tenants directory defines too, with that file.
    conflicts: Mutex<BTreeMap<String, String>>,
    changed: watch::Sender<u64>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl TenantObjects {
    fn new(store: Store<Tenant>) -> Arc<TenantObjects> {
        Arc::new(TenantObjects {
            store,
            names: Mutex::default(),
            registrations: Mutex::default(),
            conflicts: Mutex::default(),
            changed: watch::Sender::new(0),
        })
    }

    /// A view fed by no watch (for tests of what reads it).
    pub fn detached() -> Arc<TenantObjects> {
        let (store, _writer) = reflector::store();
        TenantObjects::new(store)
    }

    /// The Tenants as last listed or watched.
    pub fn store(&self) -> Store<Tenant> {
        self.store.clone()
    }

    /// Whether a Tenant object of this name exists (as the source last judged them).
    pub fn defines(&self, name: &str) -> bool {
        lock(&self.names).contains(name)
    }

    pub fn registration(&self, name: &str) -> Registration {
        lock(&self.registrations)
            .get(name)
            .cloned()
            .unwrap_or(Registration::Pending)
    }

    /// The file that defines `name` too, if one does.
    pub fn conflict(&self, name: &str) -> Option<String> {
        lock(&self.conflicts).get(name).cloned()
    }

    pub fn set_conflict(&self, name: &str, file: Option<String>) {
        {
            let mut conflicts = lock(&self.conflicts);
            match file {
                Some(file) => conflicts.insert(name.to_string(), file),
                None => conflicts.remove(name),
            };
        }
        self.signal();
    }

    /// Changes whenever the Tenants or what became of them change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Records the Tenant names; whether they changed.
    pub fn publish_names(&self, names: BTreeSet<String>) -> bool {
        let mut current = lock(&self.names);
        let changed = *current != names;
        *current = names;
        changed
    }

    fn publish_registrations(&self, registrations: BTreeMap<String, Registration>) {
        let changed = {
            let mut current = lock(&self.registrations);
            let changed = *current != registrations;
            *current = registrations;
            changed
        };
        if changed {
            self.signal();
        }
    }

    fn signal(&self) {
        self.changed.send_modify(|version| *version = version.wrapping_add(1));
    }
}

/// Starts the source: its changes arrive on the receiver, the first batch once the Tenants are
/// listed (or could not be, so that the tenants directory is not held up).
/// Failures to reach the host while `host_reachability` is in doubt are its to tell.
pub fn start(
    host: Client,
    settings: ObjectSettings,
    host_reachability: Option<Arc<Reachability>>,
    cancel: CancellationToken,
) -> (
    Arc<TenantObjects>,
    mpsc::Receiver<Vec<TenantChange>>,
    tokio::task::JoinHandle<()>,
) {
    let (store, writer) = reflector::store();
    let view = TenantObjects::new(store);
    let (changes_tx, changes) = mpsc::channel(16);
    let wake = Arc::new(Notify::new());
    let source = ObjectSource {
        secrets: SecretWatches::new(host.clone(), wake.clone(), host_reachability.clone()),
        host,
        host_reachability,
        settings,
        view: view.clone(),
        wake,
        read: BTreeMap::new(),
        unread: BTreeMap::new(),
        running: BTreeMap::new(),
        reported: BTreeMap::new(),
        retry_at: None,
    };
    let task = tokio::spawn(source.run(writer, changes_tx, cancel));
    (view, changes, task)
}

/// What a Tenant's kubeconfig was last read from, and what came of it.
struct Read {
    basis: ReadBasis,
    outcome: Result<TenantFile, Refusal>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ReadBasis {
    secret: KubeconfigSecretRef,
    version: SecretVersion,
    in_cluster_server: Option<String>,
    host_namespace: String,
}

/// What one Tenant should come to now.
enum Verdict {
    Run(Box<TenantFile>),
    Refuse(Refusal),
    Stop,
    /// Not known yet (its Secrets are not listed, or its Secret could not be read just now).
    Undecided,
}

struct ObjectSource {
    host: Client,
    host_reachability: Option<Arc<Reachability>>,
    settings: ObjectSettings,
    view: Arc<TenantObjects>,
    secrets: SecretWatches,
    wake: Arc<Notify>,
    read: BTreeMap<String, Read>,
    /// Reads the host did not answer as it should, by Tenant: not asked again on the same basis
    /// before the time given (a pass would wait for them again otherwise).
    unread: BTreeMap<String, (ReadBasis, Instant)>,
    /// Running tenants by name, with the digest they run on.
    running: BTreeMap<String, String>,
    /// Errors already told, so that a pass does not repeat them.
    reported: BTreeMap<String, TenantFileError>,
    retry_at: Option<Instant>,
}

/// What the Tenant watch has come to.
#[derive(Default)]
struct WatchState {
    listed_at: Option<Instant>,
    first_sent: bool,
    failing: bool,
}

impl WatchState {
    /// Notes a watch event; whether the Tenants may have changed. A failure while the host is in
    /// doubt (`host`) is its outage, told by its probe.
    fn note(&mut self, event: Result<Event<Tenant>, watcher::Error>, host: Option<&Reachability>) -> bool {
        match event {
            // Before every attempt to list: nothing is known yet.
            Ok(Event::Init) => false,
            Ok(event) => {
                if self.failing {
                    info!("Tenant objects are listed again");
                }
                self.failing = false;
                if matches!(event, Event::InitDone) && self.listed_at.is_none() {
                    self.listed_at = Some(Instant::now());
                }
                true
            }
            Err(err) => {
                let cause = diagnose(&err);
                if self.failing || host.is_some_and(|host| is_quiet_watch_failure(&err, &[host])) {
                    debug!(%cause, "cannot watch Tenant objects; retrying");
                } else {
                    warn!(%cause, "cannot list Tenant objects on the host; until it can, only the tenants directory is served (install the Tenant CRD with the controllers chart or `stackd crds --host | kubectl apply -f -`, and let the daemon list and watch tenants.tenancy.stackd.dev)");
                    self.failing = true;
                }
                false
            }
        }
    }
}

impl ObjectSource {
    async fn run(
        mut self,
        writer: Writer<Tenant>,
        changes: mpsc::Sender<Vec<TenantChange>>,
        cancel: CancellationToken,
    ) {
        let api: Api<Tenant> = Api::all(self.host.clone());
        // Retried ever more slowly: a host without the Tenant CRD lists again every 30 s at most.
        let events = watcher(api, watcher::Config::default()).reflect(writer).boxed();
        let back = self.host_reachability.as_ref().map(|host| host.back());
        let mut events = retry_watch(events, back, WatchBackoff::up_to(LIST_RETRY_MAX));
        let mut state = WatchState::default();
        loop {
            let retry_at = self.retry_at;
            let mut touched = false;
            tokio::select! {
                _ = cancel.cancelled() => return,
                event = events.next() => match event {
                    Some(event) => touched = state.note(event, self.host_reachability.as_deref()),
                    None => return,
                },
                _ = self.wake.notified() => {}
                _ = sleep_until(retry_at) => self.retry_at = None,
            }
            // A burst of events makes one pass.
            while let Some(Some(event)) = events.next().now_or_never() {
                touched |= state.note(event, self.host_reachability.as_deref());
            }
            if state.failing && !state.first_sent {
                state.first_sent = true;
                if changes.send(Vec::new()).await.is_err() {
                    return;
                }
            }
            let Some(listed_at) = state.listed_at else { continue };
            let (batch, names_changed, pending) = self.evaluate().await;
            if touched {
                // A Tenant changed (its generation, say): its status is looked at again.
                self.view.signal();
            }
            let hold = !state.first_sent && pending && listed_at.elapsed() < FIRST_BATCH_WAIT;
            if hold {
                self.retry_at = Some(
                    self.retry_at
                        .map_or(listed_at + FIRST_BATCH_WAIT, |at| at.min(listed_at + FIRST_BATCH_WAIT)),
                );
                continue;
            }
            if (!state.first_sent || !batch.is_empty() || names_changed) && changes.send(batch).await.is_err() {
                return;
            }
            state.first_sent = true;
        }
    }

    /// Judges every Tenant: the changes for the registry, whether the set of names changed, and
    /// whether some Tenant is still undecided for want of its namespace's Secret list.
    async fn evaluate(&mut self) -> (Vec<TenantChange>, bool, bool) {
        let tenants = self.view.store.state();
        let named: BTreeSet<String> = tenants
            .iter()
            .filter(|tenant| !tenant.spec.suspend)
            .map(|tenant| tenant.spec.kubeconfig_secret_ref.namespace.clone())
            .filter(|namespace| self.settings.secret_namespaces.contains(namespace))
            .collect();
        self.secrets.watch_only(&named);
        let mut batch = Vec::new();
        let mut registrations = BTreeMap::new();
        let mut present = BTreeSet::new();
        let mut pending = false;
        let judged: Vec<(String, Judged)> = tenants.iter().map(|t| (t.name_any(), self.judge(t))).collect();
        self.read_all(&judged).await;
        for (name, judged) in judged {
            let verdict = match judged {
                Judged::Verdict(verdict) => verdict,
                Judged::Read(basis) => match self.read.get(&name).filter(|read| read.basis == basis) {
                    Some(read) => verdict_of(&read.outcome),
                    None => Verdict::Undecided,
                },
            };
            let registration = self.tell(&name, verdict, &mut batch);
            pending |= registration == Registration::Pending;
            registrations.insert(name.clone(), registration);
            present.insert(name);
        }
        let gone: Vec<String> = self
            .running
            .keys()
            .chain(self.reported.keys())
            .filter(|name| !present.contains(*name))
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for name in gone {
            self.reported.remove(&name);
            if self.running.remove(&name).is_some() {
                info!(tenant = %name, "Tenant object deleted; suspending the tenant (its host objects stay)");
            }
            // Also for a Tenant never started: what was reported of it goes.
            batch.push(TenantChange::Suspend(name));
        }
        self.read.retain(|name, _| present.contains(name));
        self.unread.retain(|name, _| present.contains(name));
        let names_changed = self.view.publish_names(present);
        self.view.publish_registrations(registrations);
        (batch, names_changed, pending)
    }

    /// Turns a verdict into changes for the registry (once each) and the Tenant's registration.
    fn tell(&mut self, name: &str, verdict: Verdict, batch: &mut Vec<TenantChange>) -> Registration {
        match verdict {
            Verdict::Run(file) => {
                self.reported.remove(name);
                match self.running.insert(name.to_string(), file.digest.clone()) {
                    Some(digest) if digest == file.digest => {}
                    Some(_) => batch.push(TenantChange::Restart(file)),
                    None => batch.push(TenantChange::Start(file)),
                }
                Registration::Accepted { kept: None }
            }
            Verdict::Refuse(refusal) => {
                let error = TenantFileError::Object {
                    name: name.to_string(),
                    reason: refusal.reason,
                    message: refusal.message.clone(),
                };
                let kept_running = self.running.contains_key(name);
                if self.reported.get(name) != Some(&error) {
                    self.reported.insert(name.to_string(), error.clone());
                    batch.push(TenantChange::Invalid {
                        name: name.to_string(),
                        error,
                        kept_running,
                    });
                }
                if kept_running {
                    Registration::Accepted { kept: Some(refusal) }
                } else {
                    Registration::Refused(refusal)
                }
            }
            Verdict::Stop => {
                self.reported.remove(name);
                if self.running.remove(name).is_some() {
                    info!(tenant = %name, "Tenant suspended (spec.suspend); stopping the tenant (its host objects stay)");
                    batch.push(TenantChange::Suspend(name.to_string()));
                }
                Registration::Suspended
            }
            Verdict::Undecided => self.view.registration(name),
        }
    }

    /// What `tenant` should come to, or the read of its Secret that decides it.
    fn judge(&self, tenant: &Tenant) -> Judged {
        let name = tenant.name_any();
        let host_namespace = match self.settings.template.namespace_for(&name) {
            Ok(namespace) => namespace,
            Err(err) => return Judged::Verdict(Verdict::Refuse(Refusal::new("InvalidName", err.to_string()))),
        };
        if tenant.spec.suspend {
            return Judged::Verdict(Verdict::Stop);
        }
        let secret = &tenant.spec.kubeconfig_secret_ref;
        // The allow-list, before anything is asked of the host.
        if !self.settings.secret_namespaces.contains(&secret.namespace) {
            let refusal = namespace_not_given(secret, &self.settings.secret_namespaces);
            return Judged::Verdict(Verdict::Refuse(refusal));
        }
        let versions = match self.secrets.index().listing(&secret.namespace) {
            Listing::Pending => return Judged::Verdict(Verdict::Undecided),
            Listing::Failed(message) => {
                return Judged::Verdict(Verdict::Refuse(Refusal::new(
                    "SecretsUnreadable",
                    format!("cannot list the Secrets of namespace {}: {message}", secret.namespace),
                )));
            }
            Listing::Listed(versions) => versions,
        };
        let Some(version) = versions.get(&secret.name) else {
            let refusal = Refusal::new("SecretNotFound", format!("{secret} does not exist"));
            return Judged::Verdict(Verdict::Refuse(refusal));
        };
        let basis = ReadBasis {
            secret: secret.clone(),
            version: version.clone(),
            in_cluster_server: tenant.spec.in_cluster_server.clone(),
            host_namespace,
        };
        if let Some(read) = self.read.get(&name).filter(|read| read.basis == basis) {
            return Judged::Verdict(verdict_of(&read.outcome));
        }
        let retry_later = self
            .unread
            .get(&name)
            .is_some_and(|(unread, due)| *unread == basis && *due > Instant::now());
        if retry_later {
            return Judged::Verdict(Verdict::Undecided);
        }
        Judged::Read(basis)
    }

    /// Reads the Secrets `judged` asks for, several at once, each within [`READ_TIMEOUT`]; one the
    /// host did not answer is asked again after [`READ_RETRY`].
    async fn read_all(&mut self, judged: &[(String, Judged)]) {
        let wanted: Vec<(String, ReadBasis)> = judged
            .iter()
            .filter_map(|(name, judged)| match judged {
                Judged::Read(basis) => Some((name.clone(), basis.clone())),
                Judged::Verdict(_) => None,
            })
            .collect();
        let host = &self.host;
        let outcomes: Vec<_> = futures::stream::iter(wanted)
            .map(|(name, basis)| async move {
                let outcome = read_kubeconfig(host, &name, &basis).await;
                (name, basis, outcome)
            })
            .buffer_unordered(READS_AT_ONCE)
            .collect()
            .await;
        for (name, basis, outcome) in outcomes {
            match outcome {
                Some(outcome) => {
                    self.unread.remove(&name);
                    self.read.insert(name, Read { basis, outcome });
                }
                None => {
                    let at = Instant::now() + READ_RETRY;
                    self.retry_at = Some(self.retry_at.map_or(at, |current| current.min(at)));
                    self.unread.insert(name, (basis, at));
                }
            }
        }
    }
}

/// What judging a Tenant without asking the host came to.
enum Judged {
    /// Decided, or decided by a read made before on the same basis.
    Verdict(Verdict),
    /// Its Secret's kubeconfig decides, to be read on this basis.
    Read(ReadBasis),
}

/// Reads and checks the kubeconfig; `None` when the host did not answer as it should.
async fn read_kubeconfig(host: &Client, name: &str, basis: &ReadBasis) -> Option<Result<TenantFile, Refusal>> {
    let read = tokio::time::timeout(READ_TIMEOUT, kubeconfig::read(host, &basis.secret)).await;
    let read = read.unwrap_or_else(|_| {
        Err(ReadError::Transient(format!(
            "the host did not answer within {READ_TIMEOUT:?}"
        )))
    });
    let bytes = match read {
        Ok(bytes) => bytes,
        Err(ReadError::Refused(refusal)) => return Some(Err(refusal)),
        Err(ReadError::Transient(message)) => {
            debug!(tenant = %name, %message, "cannot read the Tenant's Secret; retrying");
            return None;
        }
    };
    let (name, basis) = (name.to_string(), basis.clone());
    let basis_secret = basis.secret.to_string();
    let parsed = tokio::task::spawn_blocking(move || {
        let source = Source {
            name: &name,
            secret: &basis.secret,
            in_cluster_server: basis.in_cluster_server.as_deref(),
            host_namespace: &basis.host_namespace,
        };
        kubeconfig::parse(&source, &bytes)
    })
    .await;
    // A parser panic's message may quote the text: the condition says only that it failed.
    Some(parsed.unwrap_or_else(|_| {
        Err(Refusal::new(
            "InvalidKubeconfig",
            format!("{basis_secret}: the kubeconfig could not be parsed"),
        ))
    }))
}

fn verdict_of(outcome: &Result<TenantFile, Refusal>) -> Verdict {
    match outcome {
        Ok(file) => Verdict::Run(Box::new(file.clone())),
        Err(refusal) => Verdict::Refuse(refusal.clone()),
    }
}

/// The refusal of a Secret outside the given namespaces.
fn namespace_not_given(secret: &KubeconfigSecretRef, given: &BTreeSet<String>) -> Refusal {
    let given = if given.is_empty() {
        "none".to_string()
    } else {
        given.iter().cloned().collect::<Vec<_>>().join(", ")
    };
    Refusal::new(
        "SecretNamespaceNotAllowed",
        format!(
            "{secret} is in a namespace the daemon does not read Secrets in (--tenant-secret-namespaces: {given}); keep the kubeconfig Secret in one of those, or add {} to the controllers chart's tenants.secretNamespaces",
            secret.namespace
        ),
    )
}
