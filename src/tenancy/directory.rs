//! The tenants directory: one kubeconfig file per tenant, watched for changes (DESIGN.md §1 "Tenants").
//!
//! The directory is watched rather than the files, because a mounted Secret swaps a `..data` symlink
//! instead of writing files; a periodic full rescan backs up missed events. A file that becomes
//! invalid never stops a running tenant, and a removed file only suspends its tenant.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::Kubeconfig;
use notify::RecursiveMode;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::context::endpoint::{EndpointError, TenantEndpoint};
use crate::context::namespace_template::NamespaceTemplate;
use crate::runtime::parse_error::kubeconfig_error_message;

/// File name extensions of tenant kubeconfigs.
pub const EXTENSIONS: [&str; 3] = ["yaml", "yml", "kubeconfig"];

/// A valid tenant kubeconfig: a file of the tenants directory, or the Secret a Tenant object names
/// (`tenancy::objects`).
#[derive(Clone, Debug)]
pub struct TenantFile {
    /// The file stem, or the Tenant object's name.
    pub name: String,
    /// Where the kubeconfig came from.
    pub origin: TenantOrigin,
    /// How the daemon reaches the tenant API server.
    pub connection: TenantConnection,
    /// SHA-256 of what the tenant runs on (the file's bytes; an object's kubeconfig and endpoint):
    /// a changed digest restarts the tenant.
    pub digest: String,
    /// The tenant's host namespace.
    pub host_namespace: String,
    /// Where host pods reach the tenant, or why they cannot.
    pub endpoint: Result<TenantEndpoint, EndpointError>,
}

/// How a tenant's client is made, by who wrote its kubeconfig.
#[derive(Clone, Debug)]
pub enum TenantConnection {
    /// A file of the tenants directory: the host admin's own, read by kube's loader as written.
    Kubeconfig(Box<Kubeconfig>),
    /// A Secret's text, which others may write: the client configuration the allow-list built
    /// (`runtime::untrusted_kubeconfig`); kube's loader never sees that text.
    Checked(Box<kube::Config>),
}

/// Where a tenant's kubeconfig came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantOrigin {
    /// A file of the tenants directory.
    File(PathBuf),
    /// The Secret a Tenant object on the host names.
    Object(crate::api::tenancy::KubeconfigSecretRef),
}

impl std::fmt::Display for TenantOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TenantOrigin::File(path) => write!(f, "file {}", path.display()),
            TenantOrigin::Object(secret) => write!(f, "Tenant object ({secret})"),
        }
    }
}

/// Why a tenant's kubeconfig (a file, or a Tenant object's Secret) is not used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TenantFileError {
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path} is not a kubeconfig: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Name { path: PathBuf, message: String },
    #[error("{path}: the current context names no cluster with a server URL")]
    NoServer { path: PathBuf },
    #[error("tenant {name:?} has several files ({paths}); keep one")]
    Ambiguous { name: String, paths: String },
    /// A Tenant object that cannot be served; `reason` is its `Served` condition's reason.
    #[error("Tenant {name}: {message}")]
    Object {
        name: String,
        reason: &'static str,
        message: String,
    },
    /// A name both sources define (`tenancy::sources`).
    #[error(
        "tenant {name:?} is defined twice, by {path} in the tenants directory and by the Tenant object {name}; neither is started while both exist: delete one"
    )]
    Conflict { name: String, path: String },
}

/// A change to the set of tenants.
#[derive(Clone, Debug)]
pub enum TenantChange {
    /// A new tenant, or a suspended or invalid one whose file is now valid.
    Start(Box<TenantFile>),
    /// A running tenant whose file changed.
    Restart(Box<TenantFile>),
    /// A running tenant whose file is gone: its controllers stop, its host objects stay.
    Suspend(String),
    /// A file that cannot be used; `kept_running` when the tenant keeps running on its previous file.
    Invalid {
        name: String,
        error: TenantFileError,
        kept_running: bool,
    },
}

/// The directory and what was last made of it.
#[derive(Debug)]
pub struct TenantDirectory {
    dir: PathBuf,
    template: NamespaceTemplate,
    /// Running tenants by name, with the digest of the file they run on.
    running: BTreeMap<String, String>,
    /// Errors already reported, so a rescan does not repeat them.
    reported: BTreeMap<String, TenantFileError>,
}

impl TenantDirectory {
    pub fn new(dir: impl Into<PathBuf>, template: NamespaceTemplate) -> Self {
        TenantDirectory {
            dir: dir.into(),
            template,
            running: BTreeMap::new(),
            reported: BTreeMap::new(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the directory and returns what changed since the last call.
    pub fn rescan(&mut self) -> Vec<TenantChange> {
        let scanned = match scan(&self.dir, &self.template) {
            Ok(scanned) => scanned,
            Err(err) => {
                // An unreadable directory says nothing about the tenants: keep them all running.
                warn!(dir = %self.dir.display(), error = %err, "cannot read the tenants directory");
                return Vec::new();
            }
        };
        let mut changes = Vec::new();
        for (name, result) in &scanned {
            match result {
                Ok(file) => {
                    self.reported.remove(name);
                    match self.running.get(name) {
                        Some(digest) if *digest == file.digest => {}
                        Some(_) => changes.push(TenantChange::Restart(Box::new(file.clone()))),
                        None => changes.push(TenantChange::Start(Box::new(file.clone()))),
                    }
                    self.running.insert(name.clone(), file.digest.clone());
                }
                Err(error) => {
                    if self.reported.get(name) != Some(error) {
                        self.reported.insert(name.clone(), error.clone());
                        let kept_running = self.running.contains_key(name);
                        changes.push(TenantChange::Invalid {
                            name: name.clone(),
                            error: error.clone(),
                            kept_running,
                        });
                    }
                }
            }
        }
        let removed: Vec<String> = self
            .running
            .keys()
            .filter(|name| !scanned.contains_key(*name))
            .cloned()
            .collect();
        for name in removed {
            self.running.remove(&name);
            self.reported.remove(&name);
            changes.push(TenantChange::Suspend(name));
        }
        // An invalid file removed: what was reported of it goes too.
        let forgotten: Vec<String> = self
            .reported
            .keys()
            .filter(|name| !scanned.contains_key(*name) && !self.running.contains_key(*name))
            .cloned()
            .collect();
        for name in forgotten {
            self.reported.remove(&name);
            changes.push(TenantChange::Suspend(name));
        }
        changes
    }
}

/// Reads every tenant file of `dir`, by tenant name.
pub fn scan(
    dir: &Path,
    template: &NamespaceTemplate,
) -> std::io::Result<BTreeMap<String, Result<TenantFile, TenantFileError>>> {
    let mut by_name: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if let Some(name) = tenant_name(&path) {
            by_name.entry(name).or_default().push(path);
        }
    }
    Ok(by_name
        .into_iter()
        .map(|(name, mut paths)| {
            paths.sort();
            let result = match paths.as_slice() {
                [path] => read_tenant_file(&name, path, template),
                _ => Err(TenantFileError::Ambiguous {
                    name: name.clone(),
                    paths: paths
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
            };
            (name, result)
        })
        .collect())
}

/// The tenant names in `dir` (file stems of kubeconfig files), sorted, without reading the files.
pub fn tenant_names(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir)? {
        names.extend(tenant_name(&entry?.path()));
    }
    Ok(names.into_iter().collect())
}

/// The tenant a path names: regular (or linked) files with a kubeconfig extension, not dotfiles.
fn tenant_name(path: &Path) -> Option<String> {
    let file_name = path.file_name()?.to_str()?;
    if file_name.starts_with('.') || !path.is_file() {
        return None;
    }
    let (stem, extension) = file_name.rsplit_once('.')?;
    EXTENSIONS.contains(&extension).then(|| stem.to_string())
}

fn read_tenant_file(name: &str, path: &Path, template: &NamespaceTemplate) -> Result<TenantFile, TenantFileError> {
    let bytes = std::fs::read(path).map_err(|e| TenantFileError::Read {
        path: path.into(),
        message: e.to_string(),
    })?;
    let host_namespace = template.namespace_for(name).map_err(|e| TenantFileError::Name {
        path: path.into(),
        message: e.to_string(),
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let kubeconfig = Kubeconfig::from_yaml(&text).map_err(|e| TenantFileError::Parse {
        path: path.into(),
        message: kubeconfig_error_message(&e),
    })?;
    let endpoint = TenantEndpoint::from_kubeconfig(&kubeconfig);
    if matches!(endpoint, Err(EndpointError::NoCluster | EndpointError::NoServer(_))) {
        return Err(TenantFileError::NoServer { path: path.into() });
    }
    Ok(TenantFile {
        name: name.to_string(),
        origin: TenantOrigin::File(path.to_path_buf()),
        connection: TenantConnection::Kubeconfig(Box::new(kubeconfig)),
        digest: hex::encode(Sha256::digest(&bytes)),
        host_namespace,
        endpoint,
    })
}

/// Timing of the directory watch.
#[derive(Clone, Copy, Debug)]
pub struct WatchTiming {
    /// Quiet time after a change before the directory is read.
    pub debounce: Duration,
    /// Full rescan interval.
    pub rescan: Duration,
}

/// Watches the directory and sends the first scan (empty or not) and then each non-empty batch of
/// changes, until `cancel` fires or the receiver is dropped.
pub async fn watch(
    mut directory: TenantDirectory,
    timing: WatchTiming,
    changes: mpsc::Sender<Vec<TenantChange>>,
    cancel: CancellationToken,
) {
    let (wake_tx, mut wake_rx) = mpsc::channel::<()>(1);
    let mut watcher = None;
    let mut rescan = tokio::time::interval(timing.rescan);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first scan is sent even when empty: it says what the directory holds at the start.
    let mut first = true;
    loop {
        if watcher.is_none() {
            watcher = start_watcher(directory.dir(), timing.debounce, wake_tx.clone());
        }
        let batch = directory.rescan();
        if (first || !batch.is_empty()) && changes.send(batch).await.is_err() {
            return;
        }
        first = false;
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = rescan.tick() => {}
            Some(()) = wake_rx.recv() => debug!("tenants directory changed"),
        }
    }
}

type Debouncer = notify_debouncer_full::Debouncer<notify::RecommendedWatcher, notify_debouncer_full::RecommendedCache>;

/// A debounced watch of the directory itself; `None` (retried at the next rescan) if it cannot start.
fn start_watcher(dir: &Path, debounce: Duration, wake: mpsc::Sender<()>) -> Option<Debouncer> {
    let handler = move |result: notify_debouncer_full::DebounceEventResult| {
        // Reading the files on a rescan produces access events; only changes may wake us, or each
        // rescan would trigger the next.
        let changed = result.is_ok_and(|events| events.iter().any(|e| !matches!(e.kind, notify::EventKind::Access(_))));
        if changed {
            // A full channel already holds a wake-up; one is enough.
            let _ = wake.try_send(());
        }
    };
    let mut debouncer = match notify_debouncer_full::new_debouncer(debounce, None, handler) {
        Ok(debouncer) => debouncer,
        Err(err) => {
            warn!(error = %err, "cannot start watching the tenants directory; relying on rescans");
            return None;
        }
    };
    if let Err(err) = debouncer.watch(dir, RecursiveMode::NonRecursive) {
        warn!(dir = %dir.display(), error = %err, "cannot watch the tenants directory; relying on rescans");
        return None;
    }
    Some(debouncer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubeconfig(server: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {{cluster: k, user: u}}\nclusters:\n- name: k\n  cluster: {{server: \"{server}\"}}\nusers:\n- name: u\n  user: {{token: t}}\n"
        )
    }

    fn directory() -> (tempfile::TempDir, TenantDirectory) {
        let dir = tempfile::tempdir().expect("temp dir");
        let directory = TenantDirectory::new(dir.path(), NamespaceTemplate::default());
        (dir, directory)
    }

    fn names(changes: &[TenantChange]) -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                TenantChange::Start(f) => format!("start {}", f.name),
                TenantChange::Restart(f) => format!("restart {}", f.name),
                TenantChange::Suspend(n) => format!("suspend {n}"),
                TenantChange::Invalid { name, kept_running, .. } => format!("invalid {name} kept={kept_running}"),
            })
            .collect()
    }

    #[test]
    fn each_kubeconfig_file_is_a_tenant_named_by_its_stem() {
        let (dir, mut directory) = directory();
        for file in ["a.yaml", "b.yml", "c.kubeconfig"] {
            std::fs::write(dir.path().join(file), kubeconfig("https://x:6443")).expect("write");
        }
        std::fs::write(dir.path().join("notes.txt"), "ignored").expect("write");
        std::fs::write(dir.path().join(".hidden.yaml"), kubeconfig("https://x")).expect("write");
        std::fs::create_dir(dir.path().join("..data")).expect("mkdir");
        assert_eq!(names(&directory.rescan()), ["start a", "start b", "start c"]);
        assert!(directory.rescan().is_empty(), "an unchanged directory changes nothing");
    }

    #[test]
    fn host_namespace_and_endpoint_come_with_the_file() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("acme.yaml"), kubeconfig("http://127.0.0.1:8080")).expect("write");
        let changes = directory.rescan();
        let TenantChange::Start(file) = &changes[0] else {
            panic!("{changes:?}")
        };
        assert_eq!(file.host_namespace, "tenant-acme-controllers");
        assert_eq!(file.endpoint.as_ref().map(|e| e.port), Ok(8080));
    }

    #[test]
    fn a_changed_file_restarts_only_that_tenant() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("a.yaml"), kubeconfig("https://x")).expect("write");
        std::fs::write(dir.path().join("b.yaml"), kubeconfig("https://y")).expect("write");
        directory.rescan();
        std::fs::write(dir.path().join("a.yaml"), kubeconfig("https://z")).expect("write");
        assert_eq!(names(&directory.rescan()), ["restart a"]);
    }

    #[test]
    fn an_invalid_new_file_keeps_the_old_tenant_running_and_is_reported_once() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("a.yaml"), kubeconfig("https://x")).expect("write");
        directory.rescan();
        std::fs::write(dir.path().join("a.yaml"), "clusters: [oops").expect("write");
        assert_eq!(names(&directory.rescan()), ["invalid a kept=true"]);
        assert!(directory.rescan().is_empty(), "reported once");
        std::fs::write(dir.path().join("a.yaml"), kubeconfig("https://x")).expect("write");
        assert!(
            directory.rescan().is_empty(),
            "the running file came back: nothing to restart"
        );
    }

    #[test]
    fn a_malformed_file_is_reported_by_line_without_its_token() {
        let (dir, mut directory) = directory();
        let broken = kubeconfig("https://x").replace("{token: t}", "{token: \"t0ken-of-acme}\n  - [");
        std::fs::write(dir.path().join("acme.yaml"), broken).expect("write");
        let changes = directory.rescan();
        let [TenantChange::Invalid { error, .. }] = changes.as_slice() else {
            panic!("{changes:?}")
        };
        let message = error.to_string();
        assert!(message.contains("line"), "{message}");
        assert!(!message.contains("t0ken-of-acme"), "{message}");
    }

    #[test]
    fn removing_an_invalid_file_forgets_it() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("a.yaml"), "clusters: [oops").expect("write");
        assert_eq!(names(&directory.rescan()), ["invalid a kept=false"]);
        std::fs::remove_file(dir.path().join("a.yaml")).expect("remove");
        assert_eq!(names(&directory.rescan()), ["suspend a"]);
        assert!(directory.rescan().is_empty());
    }

    #[test]
    fn removing_a_file_suspends_its_tenant() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("a.yaml"), kubeconfig("https://x")).expect("write");
        directory.rescan();
        std::fs::remove_file(dir.path().join("a.yaml")).expect("remove");
        assert_eq!(names(&directory.rescan()), ["suspend a"]);
    }

    #[test]
    fn bad_names_and_ambiguous_files_are_reported() {
        let (dir, mut directory) = directory();
        std::fs::write(dir.path().join("Bad_Name.yaml"), kubeconfig("https://x")).expect("write");
        std::fs::write(dir.path().join("twin.yaml"), kubeconfig("https://x")).expect("write");
        std::fs::write(dir.path().join("twin.yml"), kubeconfig("https://x")).expect("write");
        std::fs::write(dir.path().join("noserver.yaml"), "apiVersion: v1\nkind: Config\n").expect("write");
        let changes = directory.rescan();
        assert_eq!(
            names(&changes),
            [
                "invalid Bad_Name kept=false",
                "invalid noserver kept=false",
                "invalid twin kept=false"
            ]
        );
        let messages: Vec<String> = changes
            .iter()
            .filter_map(|c| match c {
                TenantChange::Invalid { error, .. } => Some(error.to_string()),
                _ => None,
            })
            .collect();
        assert!(messages[0].contains("DNS-1123"), "{}", messages[0]);
        assert!(messages[2].contains("keep one"), "{}", messages[2]);
    }

    async fn next_batch(rx: &mut mpsc::Receiver<Vec<TenantChange>>) -> Vec<TenantChange> {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("in time")
            .expect("batch")
    }

    #[tokio::test]
    async fn watch_picks_up_a_file_added_at_runtime() {
        let (dir, directory) = directory();
        let (tx, mut rx) = mpsc::channel(8);
        let cancel = CancellationToken::new();
        let timing = WatchTiming {
            debounce: Duration::from_millis(50),
            rescan: Duration::from_secs(3600),
        };
        let task = tokio::spawn(watch(directory, timing, tx, cancel.clone()));
        // The first scan comes first, empty: the watch started before it.
        assert!(
            next_batch(&mut rx).await.is_empty(),
            "the first scan is sent even when empty"
        );
        std::fs::write(dir.path().join("late.yaml"), kubeconfig("https://x")).expect("write");
        assert_eq!(names(&next_batch(&mut rx).await), ["start late"]);
        cancel.cancel();
        task.await.expect("watch ends");
    }

    #[tokio::test]
    async fn rescan_finds_changes_the_watch_missed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let tenants = dir.path().join("tenants");
        let directory = TenantDirectory::new(&tenants, NamespaceTemplate::default());
        let (tx, mut rx) = mpsc::channel(8);
        let cancel = CancellationToken::new();
        // The directory does not exist yet: no watch can start, only rescans find the file.
        let timing = WatchTiming {
            debounce: Duration::from_millis(50),
            rescan: Duration::from_millis(100),
        };
        let task = tokio::spawn(watch(directory, timing, tx, cancel.clone()));
        std::fs::create_dir(&tenants).expect("mkdir");
        std::fs::write(tenants.join("a.yaml"), kubeconfig("https://x")).expect("write");
        // The first scan may have run before the file was there (an empty batch) or after it.
        let mut batch = next_batch(&mut rx).await;
        if batch.is_empty() {
            batch = next_batch(&mut rx).await;
        }
        assert_eq!(names(&batch), ["start a"]);
        cancel.cancel();
        task.await.expect("watch ends");
    }
}
