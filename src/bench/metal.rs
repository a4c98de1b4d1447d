//! The bare-metal part of chaos: a baremetal pool drawing hosts from an inventory of assets while
//! the faults go on; no asset may ever back two live clusters.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterPool};
use crate::runtime::api_errors::is_conflict;

pub(super) const NAMESPACE: &str = "chaos-metal";
pub(super) const POOL: &str = "metal";
/// Clusters in the pool; each takes one control-plane host.
pub(super) const SIZE: i32 = 2;
/// Assets in the inventory: one spare.
const ASSETS: usize = 3;

/// Creates the namespace, Secrets, assets and the pool (existing ones are kept).
pub(super) async fn install(tenant: &Client) -> Result<(), kube::Error> {
    create(
        &Api::<Namespace>::all(tenant.clone()),
        json!({"metadata": {"name": NAMESPACE}}),
    )
    .await?;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), NAMESPACE);
    create(
        &secrets,
        json!({"metadata": {"name": "creds"}, "stringData": {"ssh-privatekey": "k"}}),
    )
    .await?;
    create(
        &secrets,
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
    )
    .await?;
    let assets: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), NAMESPACE);
    for index in 0..ASSETS {
        let name = format!("host-{index}");
        create(
            &secrets,
            json!({"metadata": {"name": format!("bmc-{name}")}, "stringData": {"username": "admin", "password": "chaos"}}),
        )
        .await?;
        create(
            &assets,
            json!({"apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
                "metadata": {"name": name, "labels": {"site": "chaos"}},
                "spec": {"bmc": {"address": format!("ipmi://10.0.0.1/{name}"), "credentialsName": format!("bmc-{name}")},
                         "bootMACAddress": format!("00:1B:44:11:3A:{index:02X}")}}),
        )
        .await?;
    }
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), NAMESPACE);
    create(
        &pools,
        json!({"apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
            "metadata": {"name": POOL},
            "spec": {"size": SIZE, "baseDomain": "example.com", "installerImage": "quay.io/example/installer:4.14",
                     "pullSecretRef": {"name": "pull"},
                     "platform": {"baremetal": {"credentialsSecretRef": {"name": "creds"}, "apiVIPs": ["10.0.0.5"]}},
                     "controlPlane": {"replicas": 1}, "compute": {"replicas": 0},
                     "hostSelector": {"matchLabels": {"site": "chaos"}}}}),
    )
    .await
}

async fn create<K>(api: &Api<K>, object: Value) -> Result<(), kube::Error>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    let object: K = serde_json::from_value(object).map_err(kube::Error::SerdeError)?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(err) if is_conflict(&err) => Ok(()),
        Err(err) => Err(err),
    }
}

/// Assets listed as a host by more than one live cluster right now.
pub(super) async fn double_assignments(tenant: &Client) -> Result<u64, kube::Error> {
    let cds: Api<ClusterDeployment> = Api::all(tenant.clone());
    let mut by_asset: BTreeMap<String, usize> = BTreeMap::new();
    for cd in cds.list(&ListParams::default()).await?.items {
        if cd.metadata.deletion_timestamp.is_some() {
            continue;
        }
        for host in &cd.spec.hosts {
            *by_asset.entry(host.name.clone()).or_default() += 1;
        }
    }
    Ok(by_asset.values().filter(|n| **n > 1).count() as u64)
}

/// Whether the baremetal pool is full.
pub(super) async fn filled(tenant: &Client) -> bool {
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), NAMESPACE);
    pools
        .get_opt(POOL)
        .await
        .ok()
        .flatten()
        .and_then(|p| p.status)
        .is_some_and(|s| s.ready >= SIZE)
}
