//! Which clusters a BareMetalAsset may reach (DESIGN.md §8, "References"): a reference never crosses
//! namespaces on a user's word. An asset is delivered to, and detached from, only a cluster that a
//! pool of its own namespace created, or a ClusterDeployment in its own namespace. `spec.clusterName`
//! and the `delivered-to` annotation are anyone's to write who may edit the asset; the proof is the
//! cluster's namespace, which a pool creates with its own namespace in a label and its uid in an
//! annotation — metadata of a cluster-scoped object that a namespaced `edit` user can neither create
//! nor change. Pure: no client.

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;

use crate::api::pools::{ClusterDeployment, POOL_NAMESPACE_LABEL, POOL_UID_ANNOTATION};

/// The condition reason (and Event reason) of an asset naming a cluster it may not reach.
pub(crate) const FOREIGN_CLUSTER: &str = "ForeignCluster";
/// The Event reason of a delivery record naming a cluster the asset may not reach.
pub(crate) const RECORD_REFUSED: &str = "DeliveryRecordRefused";

/// Whether an asset in `asset_namespace` may reach `cd`, whose namespace object (cached, if it is
/// labelled for a pool) is `cd_namespace`; `Err` says why not.
pub(crate) fn check(
    asset_namespace: &str,
    cd: &ClusterDeployment,
    cd_namespace: Option<&Namespace>,
) -> Result<(), String> {
    let namespace = cd.namespace().unwrap_or_default();
    if namespace == asset_namespace {
        return Ok(());
    }
    let created_for_asset_namespace = cd_namespace.is_some_and(|ns| {
        ns.name_any() == namespace
            && ns.labels().get(POOL_NAMESPACE_LABEL).map(String::as_str) == Some(asset_namespace)
            && ns
                .annotations()
                .get(POOL_UID_ANNOTATION)
                .is_some_and(|uid| !uid.is_empty())
    });
    if created_for_asset_namespace {
        return Ok(());
    }
    Err(format!(
        "ClusterDeployment {} is in namespace {namespace}, which no ClusterPool of namespace {asset_namespace} created: \
         an asset is delivered only to a cluster a pool of its own namespace created, or to a ClusterDeployment in \
         namespace {asset_namespace}",
        cd.name_any()
    ))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kube::api::ObjectMeta;
    use serde_json::json;

    use super::*;

    fn cd(namespace: &str, name: &str) -> ClusterDeployment {
        serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterName": name, "baseDomain": "example.com", "platform": {}},
        }))
        .unwrap()
    }

    fn namespace(name: &str, pool_namespace: Option<&str>, uid: Option<&str>) -> Namespace {
        let labels = pool_namespace.map(|ns| BTreeMap::from([(POOL_NAMESPACE_LABEL.to_string(), ns.to_string())]));
        let annotations = uid.map(|uid| BTreeMap::from([(POOL_UID_ANNOTATION.to_string(), uid.to_string())]));
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels,
                annotations,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_cluster_of_a_pool_of_the_assets_namespace_is_reachable() {
        let made = namespace("p-x7k2p", Some("team"), Some("pool-uid"));
        assert_eq!(check("team", &cd("p-x7k2p", "p-x7k2p"), Some(&made)), Ok(()));
    }

    #[test]
    fn a_cluster_in_the_assets_own_namespace_is_reachable() {
        assert_eq!(check("team", &cd("team", "team"), None), Ok(()));
    }

    #[test]
    fn a_cluster_of_another_namespaces_pool_is_not() {
        let victims = namespace("v-x7k2p", Some("victim"), Some("pool-uid"));
        let err = check("attacker", &cd("v-x7k2p", "v-x7k2p"), Some(&victims)).unwrap_err();
        assert!(
            err.contains(
                "ClusterDeployment v-x7k2p is in namespace v-x7k2p, which no ClusterPool of namespace attacker created"
            ),
            "{err}"
        );
        assert!(
            check("attacker", &cd("v-x7k2p", "v-x7k2p"), None).is_err(),
            "not cached: not proven"
        );
        let unannotated = namespace("v-x7k2p", Some("attacker"), None);
        assert!(
            check("attacker", &cd("v-x7k2p", "v-x7k2p"), Some(&unannotated)).is_err(),
            "a label alone is no proof"
        );
        let other = namespace("elsewhere", Some("attacker"), Some("uid"));
        assert!(
            check("attacker", &cd("v-x7k2p", "v-x7k2p"), Some(&other)).is_err(),
            "another namespace's markers"
        );
    }
}
