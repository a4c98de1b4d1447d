//! The sample pool `stackd dev` creates: a vSphere pool of size 2 in namespace `pools-demo` with an
//! inventory of three ClusterDeploymentCustomizations, one DNS name each.

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::api::pools::{ClusterDeploymentCustomization, ClusterPool};
use crate::runtime::api_errors::is_conflict;

pub const NAMESPACE: &str = "pools-demo";
pub const POOL: &str = "vsphere-pool";

/// Creates the sample objects (those that exist already are kept).
pub async fn install(tenant: &Client) -> Result<(), kube::Error> {
    install_pool(tenant, NAMESPACE, POOL, 2, &["foo", "bar", "baz"]).await
}

/// A vSphere pool `pool` of `size` in `namespace` (created if missing) with its Secrets and one
/// ClusterDeploymentCustomization per name as its inventory (the benchmark sizes it).
pub async fn install_pool(
    tenant: &Client,
    namespace: &str,
    pool: &str,
    size: i32,
    customizations: &[&str],
) -> Result<(), kube::Error> {
    let post = PostParams::default();
    let ignore_exists = |r: Result<(), kube::Error>| match r {
        Err(err) if is_conflict(&err) => Ok(()),
        other => other,
    };
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": namespace}})).map_err(kube::Error::SerdeError)?;
    ignore_exists(
        Api::<Namespace>::all(tenant.clone())
            .create(&post, &ns)
            .await
            .map(|_| ()),
    )?;
    let secrets = Api::<Secret>::namespaced(tenant.clone(), namespace);
    for secret in [
        json!({"metadata": {"name": "vsphere-credentials"}, "stringData": {"username": "admin", "password": "sample"}}),
        json!({"metadata": {"name": "pull-secret"}, "type": "kubernetes.io/dockerconfigjson",
               "stringData": {".dockerconfigjson": "{\"auths\":{}}"}}),
        json!({"metadata": {"name": "install-config-template"}, "stringData": {"install-config.yaml":
            "apiVersion: v1\nnetworking:\n  networkType: OVNKubernetes\nplatform:\n  vsphere:\n    network: VM Network\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).map_err(kube::Error::SerdeError)?;
        ignore_exists(secrets.create(&post, &secret).await.map(|_| ()))?;
    }
    let cdcs = Api::<ClusterDeploymentCustomization>::namespaced(tenant.clone(), namespace);
    for (index, name) in customizations.iter().enumerate() {
        let cdc: ClusterDeploymentCustomization = serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
            "metadata": {"name": name},
            "spec": {"installConfigPatches": [
                {"op": "replace", "path": "/metadata/name", "value": name},
                {"op": "add", "path": "/platform/vsphere/apiVIP", "value": format!("192.168.{}.{}", 10 + index / 100, 2 * (index % 100) + 10)},
                {"op": "add", "path": "/platform/vsphere/ingressVIP", "value": format!("192.168.{}.{}", 10 + index / 100, 2 * (index % 100) + 11)},
            ]},
        }))
        .map_err(kube::Error::SerdeError)?;
        ignore_exists(cdcs.create(&post, &cdc).await.map(|_| ()))?;
    }
    let inventory: Vec<serde_json::Value> = customizations.iter().map(|name| json!({"name": name})).collect();
    let pool: ClusterPool = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
        "metadata": {"name": pool},
        "spec": {
            "size": size,
            "baseDomain": "vsphere.example.com",
            "installerImage": "quay.io/example/installer:4.14",
            "installConfigSecretTemplateRef": {"name": "install-config-template"},
            "pullSecretRef": {"name": "pull-secret"},
            "platform": {"vsphere": {
                "credentialsSecretRef": {"name": "vsphere-credentials"},
                "vCenter": "vcenter.example.com", "datacenter": "dc1", "defaultDatastore": "datastore1",
            }},
            "inventory": inventory,
        },
    }))
    .map_err(kube::Error::SerdeError)?;
    ignore_exists(
        Api::<ClusterPool>::namespaced(tenant.clone(), namespace)
            .create(&post, &pool)
            .await
            .map(|_| ()),
    )
}

/// Prints the sample pool's progress (`stackd dev`) each time its counts change, until `shutdown`.
pub async fn print_progress(tenant_name: String, tenant: Client, shutdown: tokio_util::sync::CancellationToken) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let api = Api::<ClusterPool>::namespaced(tenant, NAMESPACE);
    let config = watcher::Config::default().fields(&format!("metadata.name={POOL}"));
    let mut events = watcher(api, config).default_backoff().applied_objects().boxed();
    let mut last = None;
    loop {
        let pool = tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(pool)) => pool,
                Some(Err(_)) => continue,
                None => return,
            },
        };
        let status = pool.status.unwrap_or_default();
        let reserved = status
            .inventory
            .iter()
            .filter(|e| e.status == crate::api::pools::InventoryEntryState::Reserved)
            .count();
        let line = format!(
            "  [{tenant_name}] pool {NAMESPACE}/{POOL}: {} of {} ready, {} installing, {reserved} of {} customizations leased",
            status.ready,
            pool.spec.size,
            status.standby,
            status.inventory.len()
        );
        if last.as_ref() != Some(&line) {
            println!("{line}");
            last = Some(line);
        }
    }
}
