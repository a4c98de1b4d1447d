//! The orphan sweep must never delete a host object whose tenant parent exists (DESIGN.md §2).
//! Observed from the daemons' own account: each sweep deletion is logged at info with the parent's
//! kind, namespace, name and uid, and the parent is then asked for on its tenant. One found with
//! that uid existed when the sweep deleted its object (a uid is never reused), so the sweep took a
//! live object. A parent gone by the time it is asked for proves nothing and is not counted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use kube::ResourceExt;
use kube::api::Api;
use kube::core::DynamicObject;

use super::{Clients, parent_resource};

const SWEPT: &str = "sweep: deleted a host object whose tenant parent is gone";

#[derive(Default)]
pub(super) struct SweepAudit {
    /// Log lines already judged.
    judged: BTreeSet<String>,
}

impl SweepAudit {
    /// Sweep deletions in `logs` not judged yet whose tenant parent still exists.
    pub(super) async fn live_objects_swept(&mut self, logs: &[PathBuf], clients: &Clients) -> Vec<String> {
        let mut found = Vec::new();
        for log in logs {
            let Ok(text) = std::fs::read_to_string(log) else {
                continue;
            };
            for line in text.lines().filter(|l| l.contains(SWEPT)) {
                if self.judged.contains(line) {
                    continue;
                }
                match judge(line, clients).await {
                    Some(None) => {}
                    Some(Some(live)) => found.push(live),
                    // The tenant did not answer: ask again next time.
                    None => continue,
                }
                self.judged.insert(line.to_string());
            }
        }
        found
    }
}

/// `Some(Some(what))` when the parent exists, `Some(None)` when it is gone (or the line names none),
/// `None` when the tenant could not be asked.
async fn judge(line: &str, clients: &Clients) -> Option<Option<String>> {
    let fields = fields(line);
    let field = |key: &str| fields.get(key).copied().unwrap_or("");
    let (tenant, kind, uid) = (field("tenant"), field("parent_kind"), field("parent_uid"));
    let Some(client) = clients.named(tenant) else {
        return Some(None);
    };
    let Some(resource) = parent_resource(kind).filter(|_| !uid.is_empty()) else {
        return Some(None);
    };
    let client = client.clone();
    let (namespace, name) = (field("parent_namespace"), field("parent_name"));
    let api: Api<DynamicObject> = if namespace.is_empty() {
        Api::all_with(client, &resource)
    } else {
        Api::namespaced_with(client, namespace, &resource)
    };
    let parent = api.get_opt(name).await.ok()?;
    Some(parent.filter(|p| p.uid().as_deref() == Some(uid)).map(|_| {
        format!(
            "{tenant}: the sweep deleted {} {} although its parent {kind} {namespace}/{name} (uid {uid}) exists",
            field("kind"),
            field("name")
        )
    }))
}

/// The `key=value` fields of a plain-text log line.
fn fields(line: &str) -> BTreeMap<&str, &str> {
    line.split_whitespace()
        .filter_map(|token| token.split_once('='))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_line_reads_back_its_parent() {
        let line = "2025-01-01T00:00:00.000000Z  INFO stackd::host::sweep::run: sweep: deleted a host object whose tenant parent is gone tenant=t000 kind=Job name=team-0.sample-install parent_kind=StackInstall parent_namespace= parent_name=sample parent_uid=u-1";
        let fields = fields(line);
        assert_eq!(fields["tenant"], "t000");
        assert_eq!(fields["parent_namespace"], "");
        assert_eq!(fields["parent_uid"], "u-1");
    }
}
