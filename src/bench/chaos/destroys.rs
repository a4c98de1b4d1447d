//! Every cluster the installer created must be destroyed before its ClusterDeployment goes
//! (DESIGN.md §4.3 item 11). Observed at the installer itself: the host's installer runner is
//! wrapped so that each `create cluster` and `destroy cluster` it runs is recorded under the
//! ClusterDeployment named in the Job's identity annotations. A destroy is recorded when its Job
//! runs, before the Job completes, so before the ClusterDeployment controller can let the cluster
//! go: a ClusterDeployment that is gone with a create but no destroy recorded leaked its cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::Value;

use super::Clients;
use crate::api::pools::ClusterDeployment;
use crate::embedded::ApiServer;
use crate::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome, JobRunner};
use crate::host::labels::{TENANT_LABEL, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION, TENANT_UID_ANNOTATION};

/// The installer image the chaos pools use.
const INSTALLER_IMAGE: &str = "quay.io/example/installer:4.14";

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Cluster {
    tenant: String,
    namespace: String,
    name: String,
}

#[derive(Default)]
struct Ledger {
    /// By ClusterDeployment uid.
    created: BTreeMap<String, Cluster>,
    destroyed: BTreeSet<String>,
    /// Gone and judged: not asked about again.
    judged: BTreeSet<String>,
}

#[derive(Clone, Default)]
pub(super) struct InstallerLedger {
    ledger: Arc<Mutex<Ledger>>,
}

fn lock(ledger: &Mutex<Ledger>) -> std::sync::MutexGuard<'_, Ledger> {
    ledger.lock().unwrap_or_else(|p| p.into_inner())
}

impl InstallerLedger {
    /// Wraps the installer runner registered on `host` (the sample one).
    pub(super) fn install(host: &ApiServer) -> Option<InstallerLedger> {
        let runners = host.runners();
        let inner = runners.runner_for(INSTALLER_IMAGE)?;
        let ledger = InstallerLedger::default();
        let recording = Recording {
            inner,
            ledger: ledger.clone(),
        };
        runners.register(ImageMatch::Exact(INSTALLER_IMAGE.to_string()), recording);
        Some(ledger)
    }

    /// Whether the installer created the cluster of the ClusterDeployment with this uid.
    pub(super) fn created(&self, uid: &str) -> bool {
        lock(&self.ledger).created.contains_key(uid)
    }

    /// ClusterDeployments gone since the last call whose created cluster was never destroyed.
    pub(super) async fn gone_without_destroy(&self, clients: &Clients) -> Vec<String> {
        let pending: Vec<(String, Cluster)> = {
            let ledger = lock(&self.ledger);
            ledger
                .created
                .iter()
                .filter(|(uid, _)| !ledger.judged.contains(*uid))
                .map(|(uid, cluster)| (uid.clone(), cluster.clone()))
                .collect()
        };
        let mut found = Vec::new();
        for (tenant, client) in &clients.tenants {
            if !pending.iter().any(|(_, c)| &c.tenant == tenant) {
                continue;
            }
            let Ok(list) = Api::<ClusterDeployment>::all(client.clone())
                .list_metadata(&ListParams::default())
                .await
            else {
                continue;
            };
            let live: BTreeSet<String> = list.items.iter().filter_map(|cd| cd.uid()).collect();
            // Read after the list: a destroy that ran before the cluster went is in it.
            let mut ledger = lock(&self.ledger);
            for (uid, cluster) in pending.iter().filter(|(_, c)| &c.tenant == tenant) {
                if live.contains(uid) {
                    continue;
                }
                ledger.judged.insert(uid.clone());
                if !ledger.destroyed.contains(uid) {
                    found.push(format!(
                        "{tenant}: ClusterDeployment {}/{} (uid {uid}) is gone, but the cluster its installer created was never destroyed",
                        cluster.namespace, cluster.name
                    ));
                }
            }
        }
        found
    }
}

struct Recording {
    inner: Arc<dyn JobRunner>,
    ledger: InstallerLedger,
}

impl JobRunner for Recording {
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        let outcome = self.inner.run(ctx);
        let Some((uid, cluster)) = cluster_of(&ctx.job) else {
            return outcome;
        };
        let mut ledger = lock(&self.ledger.ledger);
        match ctx.args.first().map(String::as_str) {
            Some("create") if outcome.exit_code == 0 => {
                ledger.created.insert(uid, cluster);
            }
            Some("destroy") if outcome.exit_code == 0 => {
                ledger.destroyed.insert(uid);
            }
            _ => {}
        }
        outcome
    }
}

/// The ClusterDeployment a host Job was made for, from its tenant label and identity annotations.
fn cluster_of(job: &Value) -> Option<(String, Cluster)> {
    let metadata = &job["metadata"];
    let annotation = |key: &str| metadata["annotations"][key].as_str().map(str::to_string);
    let cluster = Cluster {
        tenant: metadata["labels"][TENANT_LABEL].as_str()?.to_string(),
        namespace: annotation(TENANT_NAMESPACE_ANNOTATION)?,
        name: annotation(TENANT_NAME_ANNOTATION)?,
    };
    Some((annotation(TENANT_UID_ANNOTATION)?, cluster))
}
