//! The two sources of tenants, one registry (DESIGN.md §1 "Tenants"): the tenants directory and the
//! Tenant objects on the host. Each source says what changed for its names; this merges them into
//! the changes the registry applies. A name both define is refused, naming both: neither is started
//! while both exist, and one already running keeps running (as with a new invalid kubeconfig), so a
//! Tenant created for a tenant served from a file changes nothing until the file is removed; then
//! the tenant restarts on the object's kubeconfig.
//!
//! At the start both sources' first batches are awaited before anything is applied, so which one a
//! conflicting name comes from never depends on which source answered first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::directory::{TenantChange, TenantFile, TenantFileError};
use super::objects::TenantObjects;

/// Which source a change came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Directory,
    Objects,
}

/// What one source last said of a name.
#[derive(Clone, Debug, Default)]
struct Entry {
    /// Its latest valid kubeconfig.
    valid: Option<TenantFile>,
    /// Why its latest content is not used, if it is not.
    error: Option<TenantFileError>,
}

/// The merge of both sources' changes.
pub struct Merger {
    files: BTreeMap<String, Entry>,
    objects: BTreeMap<String, Entry>,
    /// What each running tenant runs on: the source and the digest.
    serving: BTreeMap<String, (Side, String)>,
    /// Names the registry was told cannot be started (and has not started since): when neither
    /// source has them any more, the registry forgets them.
    told_invalid: BTreeSet<String>,
    conflicts: BTreeSet<String>,
    view: Arc<TenantObjects>,
}

impl Merger {
    pub fn new(view: Arc<TenantObjects>) -> Self {
        Merger {
            files: BTreeMap::new(),
            objects: BTreeMap::new(),
            serving: BTreeMap::new(),
            told_invalid: BTreeSet::new(),
            conflicts: BTreeSet::new(),
            view,
        }
    }

    /// The registry's changes for one batch of `side`. A batch of the objects source may be empty:
    /// the set of Tenant names changed, and conflicts are judged again.
    pub fn apply(&mut self, side: Side, batch: Vec<TenantChange>) -> Vec<TenantChange> {
        let mut out = Vec::new();
        let mut names = BTreeSet::new();
        for change in batch {
            let name = change_name(&change).to_string();
            let entries = match side {
                Side::Directory => &mut self.files,
                Side::Objects => &mut self.objects,
            };
            let reported = match change {
                TenantChange::Start(file) | TenantChange::Restart(file) => {
                    let entry = entries.entry(name.clone()).or_default();
                    entry.valid = Some(*file);
                    entry.error = None;
                    false
                }
                TenantChange::Invalid { error, .. } => {
                    entries.entry(name.clone()).or_default().error = Some(error);
                    true
                }
                TenantChange::Suspend(_) => {
                    entries.remove(&name);
                    false
                }
            };
            self.resolve(&name, reported.then_some(side), &mut out);
            names.insert(name);
        }
        if side == Side::Objects {
            let others: Vec<String> = self.files.keys().filter(|n| !names.contains(*n)).cloned().collect();
            for name in others {
                self.resolve(&name, None, &mut out);
            }
        }
        out
    }

    /// Brings `name` in line with what the sources say; `reported` is the side whose new error is
    /// to be passed on.
    fn resolve(&mut self, name: &str, reported: Option<Side>, out: &mut Vec<TenantChange>) {
        let file = self.files.get(name);
        let object_defined = self.objects.contains_key(name) || self.view.defines(name);
        if let Some(file) = file.filter(|_| object_defined) {
            let path = file
                .valid
                .as_ref()
                .map_or_else(|| "a file".to_string(), |f| f.origin.to_string());
            if self.conflicts.insert(name.to_string()) {
                let kept_running = self.serving.contains_key(name);
                warn!(tenant = %name, file = %path, "tenant defined by a file and by a Tenant object; neither is started while both exist: delete one");
                self.view.set_conflict(name, Some(path.clone()));
                if !kept_running {
                    self.told_invalid.insert(name.to_string());
                }
                out.push(TenantChange::Invalid {
                    name: name.to_string(),
                    error: TenantFileError::Conflict {
                        name: name.to_string(),
                        path,
                    },
                    kept_running,
                });
            }
            return;
        }
        if self.conflicts.remove(name) {
            info!(tenant = %name, "tenant defined by one source again");
            self.view.set_conflict(name, None);
        }
        let (side, entry) = match (self.files.get(name), self.objects.get(name)) {
            (Some(entry), _) => (Side::Directory, entry.clone()),
            (None, Some(entry)) => (Side::Objects, entry.clone()),
            (None, None) => {
                let told = self.told_invalid.remove(name);
                if self.serving.remove(name).is_some() || told {
                    out.push(TenantChange::Suspend(name.to_string()));
                }
                return;
            }
        };
        let serving = self.serving.get(name).cloned();
        match entry.valid {
            Some(file) => {
                let wanted = (side, file.digest.clone());
                if serving.as_ref() != Some(&wanted) {
                    self.serving.insert(name.to_string(), wanted);
                    self.told_invalid.remove(name);
                    out.push(match serving {
                        Some(_) => TenantChange::Restart(Box::new(file)),
                        None => TenantChange::Start(Box::new(file)),
                    });
                }
            }
            None => {
                // Nothing valid here: a tenant running on the other source's kubeconfig stops.
                if serving.is_some() {
                    self.serving.remove(name);
                    out.push(TenantChange::Suspend(name.to_string()));
                }
            }
        }
        let pass_on = reported == Some(side) || (reported.is_none() && entry.error.is_some() && serving.is_none());
        if let (Some(error), true) = (entry.error, pass_on) {
            let kept_running = self.serving.contains_key(name);
            if !kept_running {
                self.told_invalid.insert(name.to_string());
            }
            out.push(TenantChange::Invalid {
                name: name.to_string(),
                error,
                kept_running,
            });
        }
    }
}

fn change_name(change: &TenantChange) -> &str {
    match change {
        TenantChange::Start(file) | TenantChange::Restart(file) => &file.name,
        TenantChange::Suspend(name) | TenantChange::Invalid { name, .. } => name,
    }
}

/// The changes of both sources, merged.
pub struct Sources {
    directory: Option<mpsc::Receiver<Vec<TenantChange>>>,
    objects: Option<mpsc::Receiver<Vec<TenantChange>>>,
    merger: Merger,
    started: bool,
    /// Each source's first batch, kept as it comes until both are in: [`Sources::next`] may be
    /// dropped between them (the daemon waits on it in a `select!`).
    first_files: Option<Vec<TenantChange>>,
    first_objects: Option<Vec<TenantChange>>,
}

impl Sources {
    pub fn new(
        directory: Option<mpsc::Receiver<Vec<TenantChange>>>,
        objects: mpsc::Receiver<Vec<TenantChange>>,
        view: Arc<TenantObjects>,
    ) -> Self {
        Sources {
            directory,
            objects: Some(objects),
            merger: Merger::new(view),
            started: false,
            first_files: None,
            first_objects: None,
        }
    }

    /// The next changes for the registry (possibly none); `None` once both sources ended.
    /// Cancel-safe: a call dropped before it returns loses no batch.
    pub async fn next(&mut self) -> Option<Vec<TenantChange>> {
        if !self.started {
            return Some(self.first().await);
        }
        loop {
            let (side, batch) = tokio::select! {
                batch = recv(&mut self.directory) => (Side::Directory, batch),
                batch = recv(&mut self.objects) => (Side::Objects, batch),
            };
            match batch {
                Some(batch) => return Some(self.merger.apply(side, batch)),
                None => {
                    match side {
                        Side::Directory => self.directory = None,
                        Side::Objects => self.objects = None,
                    }
                    if self.directory.is_none() && self.objects.is_none() {
                        return None;
                    }
                }
            }
        }
    }

    /// Both sources' first batches, merged: the directory's first, then the objects'.
    async fn first(&mut self) -> Vec<TenantChange> {
        while self.first_files.is_none() || self.first_objects.is_none() {
            tokio::select! {
                files = first(&mut self.directory), if self.first_files.is_none() => {
                    self.first_files = Some(files.unwrap_or_default());
                }
                objects = first(&mut self.objects), if self.first_objects.is_none() => {
                    self.first_objects = Some(objects.unwrap_or_default());
                }
            }
        }
        self.started = true;
        let mut out = self
            .merger
            .apply(Side::Directory, self.first_files.take().unwrap_or_default());
        out.extend(
            self.merger
                .apply(Side::Objects, self.first_objects.take().unwrap_or_default()),
        );
        out
    }
}

/// A source's first batch; none at once for a source that is absent.
async fn first(source: &mut Option<mpsc::Receiver<Vec<TenantChange>>>) -> Option<Vec<TenantChange>> {
    match source {
        Some(receiver) => receiver.recv().await,
        None => None,
    }
}

/// The next batch of a source; never, for a source that is absent or ended.
async fn recv(source: &mut Option<mpsc::Receiver<Vec<TenantChange>>>) -> Option<Vec<TenantChange>> {
    match source {
        Some(receiver) => receiver.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tenancy::KubeconfigSecretRef;
    use crate::context::namespace_template::NamespaceTemplate;
    use crate::tenancy::directory::TenantOrigin;

    fn file(name: &str, side: Side, digest: &str) -> Box<TenantFile> {
        let origin = match side {
            Side::Directory => TenantOrigin::File(format!("/tenants/{name}.yaml").into()),
            Side::Objects => TenantOrigin::Object(KubeconfigSecretRef {
                namespace: "stackd-system".into(),
                name: format!("{name}-kubeconfig"),
                key: "value".into(),
            }),
        };
        let host_namespace = NamespaceTemplate::default().namespace_for(name).expect("name");
        Box::new(TenantFile {
            name: name.into(),
            origin,
            connection: crate::tenancy::directory::TenantConnection::Kubeconfig(Default::default()),
            digest: digest.into(),
            host_namespace,
            endpoint: Err(crate::context::endpoint::EndpointError::NoCluster),
        })
    }

    fn said(changes: &[TenantChange]) -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                TenantChange::Start(f) => format!("start {} {}", f.name, f.digest),
                TenantChange::Restart(f) => format!("restart {} {}", f.name, f.digest),
                TenantChange::Suspend(n) => format!("suspend {n}"),
                TenantChange::Invalid {
                    name,
                    kept_running,
                    error,
                } => {
                    let what = if matches!(error, TenantFileError::Conflict { .. }) {
                        "conflict"
                    } else {
                        "invalid"
                    };
                    format!("{what} {name} kept={kept_running}")
                }
            })
            .collect()
    }

    fn merger() -> Merger {
        Merger::new(TenantObjects::detached())
    }

    #[tokio::test]
    async fn a_first_batch_is_kept_when_the_wait_for_the_other_one_is_dropped() {
        let (files_tx, files) = mpsc::channel(4);
        let (objects_tx, objects) = mpsc::channel(4);
        let mut sources = Sources::new(Some(files), objects, TenantObjects::detached());
        let start = vec![TenantChange::Start(file("a", Side::Directory, "1"))];
        files_tx.send(start).await.expect("sent");
        // The daemon's select! drops the call while the objects' first batch is still to come.
        let dropped = tokio::time::timeout(std::time::Duration::from_millis(50), sources.next()).await;
        assert!(dropped.is_err(), "no batch before both first ones are in");
        objects_tx.send(Vec::new()).await.expect("sent");
        let batch = sources.next().await.expect("a batch");
        assert_eq!(said(&batch), ["start a 1"], "the directory's first batch is not lost");
    }

    #[test]
    fn each_source_starts_its_own_names() {
        let mut merger = merger();
        let out = merger.apply(
            Side::Directory,
            vec![TenantChange::Start(file("a", Side::Directory, "1"))],
        );
        assert_eq!(said(&out), ["start a 1"]);
        let out = merger.apply(Side::Objects, vec![TenantChange::Start(file("b", Side::Objects, "2"))]);
        assert_eq!(said(&out), ["start b 2"]);
        let out = merger.apply(Side::Objects, vec![TenantChange::Suspend("b".into())]);
        assert_eq!(said(&out), ["suspend b"]);
    }

    #[test]
    fn a_name_in_both_is_refused_and_the_running_one_keeps_running() {
        let mut merger = merger();
        merger.apply(
            Side::Directory,
            vec![TenantChange::Start(file("a", Side::Directory, "1"))],
        );
        let out = merger.apply(Side::Objects, vec![TenantChange::Start(file("a", Side::Objects, "2"))]);
        assert_eq!(said(&out), ["conflict a kept=true"]);
        assert!(merger.view.conflict("a").is_some_and(|c| c.contains("/tenants/a.yaml")));
        // Removing the file hands the tenant over to the object: a restart on its kubeconfig.
        let out = merger.apply(Side::Directory, vec![TenantChange::Suspend("a".into())]);
        assert_eq!(said(&out), ["restart a 2"]);
        assert_eq!(merger.view.conflict("a"), None);
    }

    #[test]
    fn at_the_start_a_name_in_both_starts_neither() {
        let mut merger = merger();
        // The objects source's first batch comes once the Tenants are listed: they are known
        // before the directory's first batch is applied.
        merger.view.publish_names(["a".to_string()].into());
        let out = merger.apply(
            Side::Directory,
            vec![TenantChange::Start(file("a", Side::Directory, "1"))],
        );
        assert_eq!(
            said(&out),
            ["conflict a kept=false"],
            "the Tenant is listed before the files are applied"
        );
    }

    #[test]
    fn a_refused_name_that_goes_away_is_forgotten() {
        let mut merger = merger();
        let invalid = TenantChange::Invalid {
            name: "a".into(),
            error: TenantFileError::Object {
                name: "a".into(),
                reason: "SecretNotFound",
                message: "gone".into(),
            },
            kept_running: false,
        };
        assert_eq!(
            said(&merger.apply(Side::Objects, vec![invalid])),
            ["invalid a kept=false"]
        );
        let out = merger.apply(Side::Objects, vec![TenantChange::Suspend("a".into())]);
        assert_eq!(said(&out), ["suspend a"], "the registry forgets what it was told");
    }

    #[test]
    fn an_object_gone_while_in_conflict_leaves_the_file_running() {
        let mut merger = merger();
        merger.apply(
            Side::Directory,
            vec![TenantChange::Start(file("a", Side::Directory, "1"))],
        );
        merger.apply(Side::Objects, vec![TenantChange::Start(file("a", Side::Objects, "2"))]);
        let out = merger.apply(Side::Objects, vec![TenantChange::Suspend("a".into())]);
        assert!(out.is_empty(), "{:?}", said(&out));
        assert_eq!(merger.view.conflict("a"), None);
    }

    #[test]
    fn an_invalid_change_passes_through_once_with_what_keeps_running() {
        let mut merger = merger();
        merger.apply(Side::Objects, vec![TenantChange::Start(file("a", Side::Objects, "1"))]);
        let invalid = TenantChange::Invalid {
            name: "a".into(),
            error: TenantFileError::Object {
                name: "a".into(),
                reason: "InvalidKubeconfig",
                message: "bad".into(),
            },
            kept_running: true,
        };
        let out = merger.apply(Side::Objects, vec![invalid]);
        assert_eq!(said(&out), ["invalid a kept=true"]);
        let out = merger.apply(Side::Objects, vec![]);
        assert!(out.is_empty(), "{:?}", said(&out));
    }
}
