//! Which cluster a tenant is. A tenant file re-pointed at another cluster (a restore, a new
//! cluster behind an old name) would make every tenant parent look deleted, and the orphan sweep
//! would take all of the tenant's host objects. The uid of the tenant's `kube-system` namespace is
//! recorded on its host namespace, and a tenant whose uid differs is stopped with the reason.

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;

/// Annotation on the host namespace: the uid of the tenant's `kube-system` namespace.
pub const TENANT_CLUSTER_ANNOTATION: &str = "stackd.dev/tenant-cluster-uid";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "the tenant kubeconfig now points at another cluster (its kube-system namespace has uid {found}, host namespace {host_namespace} recorded {recorded}); stackd stopped the tenant so that its host objects are not swept as orphans. If the move is intended, remove the annotation {TENANT_CLUSTER_ANNOTATION} from namespace {host_namespace}"
    )]
    OtherCluster {
        found: String,
        recorded: String,
        host_namespace: String,
    },
    #[error("the tenant has no kube-system namespace to identify it by")]
    NoSystemNamespace,
    #[error("reading the cluster identity failed: {0}")]
    Api(#[from] kube::Error),
}

/// The uid of the tenant's `kube-system` namespace (a list by name: the daemon may list
/// namespaces on the tenant, not get them).
pub async fn tenant_cluster_uid(tenant: &Client) -> Result<String, IdentityError> {
    let by_name = ListParams::default().fields("metadata.name=kube-system");
    let listed = Api::<Namespace>::all(tenant.clone()).list_metadata(&by_name).await?;
    listed
        .items
        .into_iter()
        .find_map(|ns| ns.metadata.uid)
        .ok_or(IdentityError::NoSystemNamespace)
}

/// Records `uid` on the host namespace the first time, and refuses a different one after.
pub async fn check(host: &Client, host_namespace: &str, uid: &str) -> Result<(), IdentityError> {
    let api = Api::<Namespace>::all(host.clone());
    let namespace = api.get(host_namespace).await?;
    match judge(
        namespace.annotations().get(TENANT_CLUSTER_ANNOTATION),
        uid,
        host_namespace,
    ) {
        Judgement::Same => Ok(()),
        Judgement::Record => {
            let patch = json!({"metadata": {"annotations": {TENANT_CLUSTER_ANNOTATION: uid}}});
            api.patch(host_namespace, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(())
        }
        Judgement::Other(err) => Err(err),
    }
}

enum Judgement {
    Same,
    Record,
    Other(IdentityError),
}

fn judge(recorded: Option<&String>, found: &str, host_namespace: &str) -> Judgement {
    match recorded {
        None => Judgement::Record,
        Some(recorded) if recorded == found => Judgement::Same,
        Some(recorded) => Judgement::Other(IdentityError::OtherCluster {
            found: found.to_string(),
            recorded: recorded.clone(),
            host_namespace: host_namespace.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_uid_is_recorded_and_the_same_one_accepted() {
        assert!(matches!(judge(None, "a", "ns"), Judgement::Record));
        assert!(matches!(judge(Some(&"a".to_string()), "a", "ns"), Judgement::Same));
    }

    #[test]
    fn another_cluster_is_refused_with_how_to_accept_it() {
        let Judgement::Other(err) = judge(Some(&"old".to_string()), "new", "tenant-a-controllers") else {
            panic!("another cluster was accepted");
        };
        let message = err.to_string();
        assert!(message.contains("another cluster"), "{message}");
        assert!(message.contains(TENANT_CLUSTER_ANNOTATION), "{message}");
    }
}
