//! Delivering an asset to its installed cluster (DESIGN.md §5): a `metal3.io/v1alpha1`
//! BareMetalHost with the asset's name (created, or adopted when the installer made it) and its
//! BMC Secret in `openshift-machine-api`, later changes propagated, a new boot MAC replacing the
//! host; and the one detach path that removes both before the asset lets go.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use super::remote_host::{DeliveryError, MACHINE_API_NAMESPACE};
use super::{CLUSTER_LABEL, ROLE_LABEL, role_label};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::ClusterDeployment;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::untrusted_kubeconfig::config_from_untrusted;
use crate::runtime::untrusted_server;

fn bmh_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("metal3.io", "v1alpha1", "BareMetalHost"),
        "baremetalhosts",
    )
}

/// Name of the BMC Secret on the managed cluster.
pub(crate) fn remote_secret_name(asset: &BareMetalAsset) -> String {
    format!("{}-bmc-secret", asset.name_any())
}

/// A managed cluster as the tenant's admin kubeconfig describes it: every exchange with it is
/// bounded in time and size, and its answers are sanitised, because the address is the tenant's.
pub(crate) struct ManagedCluster {
    client: Client,
    /// Bound on one whole delivery or detach, each a handful of requests.
    deadline: Duration,
}

/// Requests one delivery or detach makes at most.
const REQUESTS_PER_EXCHANGE: u32 = 6;

/// A client for the cluster, from its admin kubeconfig Secret in the tenant. The Secret is
/// tenant-writable, so only the allow-listed inline data of the kubeconfig is used.
pub(crate) async fn cluster_client(
    tenant: &Client,
    cd: &ClusterDeployment,
    timeout: Duration,
) -> Result<ManagedCluster, DeliveryError> {
    let name = cd.name_any();
    let bad = |e: String| DeliveryError::Kubeconfig(name.clone(), e);
    let secret_name = cd
        .status
        .as_ref()
        .and_then(|s| s.admin_kubeconfig_secret_ref.as_ref())
        .map(|r| r.name.clone())
        .ok_or_else(|| bad("not recorded yet".into()))?;
    let secret = Api::<Secret>::namespaced(tenant.clone(), &cd.namespace().unwrap_or_default())
        .get_opt(&secret_name)
        .await
        .map_err(DeliveryError::Tenant)?
        .ok_or_else(|| bad(format!("Secret {secret_name} does not exist")))?;
    let text = secret
        .data
        .as_ref()
        .and_then(|d| d.get("kubeconfig"))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .ok_or_else(|| bad(format!("Secret {secret_name} has no key kubeconfig")))?;
    let config = config_from_untrusted(&text).map_err(|reason| DeliveryError::KubeconfigRefused {
        cluster: name.clone(),
        secret: secret_name.clone(),
        reason,
    })?;
    let client = untrusted_server::client(config, timeout).map_err(|e| bad(e.to_string()))?;
    Ok(ManagedCluster {
        client,
        deadline: timeout * REQUESTS_PER_EXCHANGE,
    })
}

/// A failed request to the managed cluster, with nothing of a non-Kubernetes answer left in it.
fn remote_failure(err: kube::Error) -> DeliveryError {
    DeliveryError::Remote(untrusted_server::sanitize(err))
}

/// Creates or updates the host's Secret and BareMetalHost on the cluster. Returns true once the
/// BareMetalHost is there as the asset says (false: a stale one was removed, come back).
pub(crate) async fn deliver(
    managed: &ManagedCluster,
    asset: &BareMetalAsset,
    credentials: &BTreeMap<String, ByteString>,
    cluster: &str,
) -> Result<bool, DeliveryError> {
    let remote = &managed.client;
    let exchange = async {
        if !deliver_secret(remote, asset, credentials).await? {
            return Ok(false);
        }
        deliver_host(remote, asset, cluster).await
    };
    within(managed.deadline, exchange).await
}

/// `exchange`, or [`DeliveryError::TimedOut`] when it takes longer than `deadline`: a server can
/// trickle an answer a byte at a time, which no per-read timeout notices.
async fn within<T>(
    deadline: Duration,
    exchange: impl Future<Output = Result<T, DeliveryError>>,
) -> Result<T, DeliveryError> {
    tokio::time::timeout(deadline, exchange)
        .await
        .unwrap_or(Err(DeliveryError::TimedOut(deadline)))
}

/// Only the BMC credentials are copied to the cluster, whatever else the tenant's Secret holds.
fn remote_credentials(credentials: &BTreeMap<String, ByteString>) -> BTreeMap<String, ByteString> {
    credentials
        .iter()
        .filter(|(k, _)| matches!(k.as_str(), "username" | "password"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Creates or updates the BMC Secret; false when someone changed it meanwhile (come back).
async fn deliver_secret(
    remote: &Client,
    asset: &BareMetalAsset,
    credentials: &BTreeMap<String, ByteString>,
) -> Result<bool, DeliveryError> {
    let secrets = Api::<Secret>::namespaced(remote.clone(), MACHINE_API_NAMESPACE);
    let secret_name = remote_secret_name(asset);
    let data = remote_credentials(credentials);
    match secrets.get_opt(&secret_name).await.map_err(remote_failure)? {
        None => {
            let secret = Secret {
                metadata: kube::api::ObjectMeta {
                    name: Some(secret_name),
                    namespace: Some(MACHINE_API_NAMESPACE.into()),
                    ..Default::default()
                },
                type_: Some("Opaque".into()),
                data: Some(data),
                ..Default::default()
            };
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(remote_failure)?;
        }
        Some(existing) if existing.data.as_ref() != Some(&data) => {
            let mut updated = existing.clone();
            updated.data = Some(data);
            updated.metadata.managed_fields = None;
            match secrets.replace(&secret_name, &PostParams::default(), &updated).await {
                Ok(_) => {}
                Err(err) if is_conflict(&err) => return Ok(false),
                Err(err) => return Err(remote_failure(err)),
            }
        }
        Some(_) => {}
    }
    Ok(true)
}

/// The BareMetalHost spec fields stackd keeps in line with the asset.
fn host_spec(asset: &BareMetalAsset) -> Value {
    let mut spec = json!({
        "bmc": {"address": asset.spec.bmc.address, "credentialsName": remote_secret_name(asset)},
        "bootMACAddress": asset.spec.boot_mac_address,
    });
    if let Some(profile) = &asset.spec.hardware_profile {
        spec["hardwareProfile"] = json!(profile);
    }
    spec
}

fn host_labels(asset: &BareMetalAsset, cluster: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (ROLE_LABEL.to_string(), role_label(asset.spec.role).to_string()),
        (CLUSTER_LABEL.to_string(), cluster.to_string()),
    ])
}

/// A new BareMetalHost; `online: true` only on create: afterwards the cluster owns the power state.
fn new_host(asset: &BareMetalAsset, cluster: &str) -> DynamicObject {
    let mut spec = host_spec(asset);
    spec["online"] = json!(true);
    let mut host = DynamicObject::new(&asset.name_any(), &bmh_resource())
        .within(MACHINE_API_NAMESPACE)
        .data(json!({"spec": spec}));
    host.metadata.labels = Some(host_labels(asset, cluster));
    host
}

/// What an existing BareMetalHost needs to match the asset.
#[derive(Debug, PartialEq)]
enum HostChange {
    /// metal3 refuses a boot MAC edit: delete it, to be created anew once gone.
    Replace,
    /// Adopts a host the installer made, and carries later BMC, profile or label changes.
    Patch(Value),
    UpToDate,
}

fn host_change(existing: &DynamicObject, asset: &BareMetalAsset, cluster: &str) -> HostChange {
    let current_mac = existing.data["spec"]["bootMACAddress"].as_str().unwrap_or_default();
    if !current_mac.eq_ignore_ascii_case(&asset.spec.boot_mac_address) {
        return HostChange::Replace;
    }
    let spec = host_spec(asset);
    let labels = host_labels(asset, cluster);
    let up_to_date = ["bmc", "hardwareProfile"]
        .iter()
        .all(|k| existing.data["spec"].get(k) == spec.get(k))
        && labels.iter().all(|(k, v)| existing.labels().get(k) == Some(v));
    if up_to_date {
        return HostChange::UpToDate;
    }
    let mut patch = json!({"metadata": {"labels": labels}, "spec": spec});
    if asset.spec.hardware_profile.is_none() {
        patch["spec"]["hardwareProfile"] = Value::Null;
    }
    HostChange::Patch(patch)
}

/// Creates, adopts or updates the BareMetalHost; false while a stale one is going.
async fn deliver_host(remote: &Client, asset: &BareMetalAsset, cluster: &str) -> Result<bool, DeliveryError> {
    let hosts = Api::<DynamicObject>::namespaced_with(remote.clone(), MACHINE_API_NAMESPACE, &bmh_resource());
    let name = asset.name_any();
    let Some(existing) = hosts.get_opt(&name).await.map_err(remote_failure)? else {
        hosts
            .create(&PostParams::default(), &new_host(asset, cluster))
            .await
            .map_err(remote_failure)?;
        return Ok(true);
    };
    if existing.metadata.deletion_timestamp.is_some() {
        return Ok(false);
    }
    match host_change(&existing, asset, cluster) {
        HostChange::Replace => {
            delete_and_ignore_missing(&hosts, &name).await?;
            Ok(false)
        }
        HostChange::Patch(patch) => {
            hosts
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(remote_failure)?;
            Ok(true)
        }
        HostChange::UpToDate => Ok(true),
    }
}

async fn delete_and_ignore_missing<K>(api: &Api<K>, name: &str) -> Result<(), DeliveryError>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(remote_failure(err)),
    }
}

/// Removes the BareMetalHost (metal3 deprovisions it) and its Secret from the cluster. Returns true
/// once both are gone.
pub(crate) async fn detach(managed: &ManagedCluster, asset: &BareMetalAsset) -> Result<bool, DeliveryError> {
    within(managed.deadline, detach_from(&managed.client, asset)).await
}

async fn detach_from(remote: &Client, asset: &BareMetalAsset) -> Result<bool, DeliveryError> {
    let hosts = Api::<DynamicObject>::namespaced_with(remote.clone(), MACHINE_API_NAMESPACE, &bmh_resource());
    let secrets = Api::<Secret>::namespaced(remote.clone(), MACHINE_API_NAMESPACE);
    let name = asset.name_any();
    let secret_name = remote_secret_name(asset);
    delete_and_ignore_missing(&hosts, &name).await?;
    delete_and_ignore_missing(&secrets, &secret_name).await?;
    let host_gone = hosts.get_opt(&name).await.map_err(remote_failure)?.is_none();
    let secret_gone = secrets.get_opt(&secret_name).await.map_err(remote_failure)?.is_none();
    Ok(host_gone && secret_gone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::inventory::{AssetRole, BareMetalAssetSpec, BmcDetails};

    fn asset(mac: &str, profile: Option<&str>) -> BareMetalAsset {
        let mut a = BareMetalAsset::new(
            "host-1",
            BareMetalAssetSpec {
                bmc: BmcDetails {
                    address: "ipmi://10.0.0.1".into(),
                    credentials_name: "host-1-bmc".into(),
                },
                boot_mac_address: mac.into(),
                hardware_profile: profile.map(String::from),
                role: Some(AssetRole::Worker),
                cluster_name: Some("c1".into()),
                ..Default::default()
            },
        );
        a.metadata.namespace = Some("lab".into());
        a
    }

    /// The host as stackd would create it for `asset`.
    fn delivered(asset: &BareMetalAsset) -> DynamicObject {
        new_host(asset, "c1")
    }

    #[test]
    fn only_username_and_password_go_to_the_cluster() {
        let credentials = BTreeMap::from([
            ("username".to_string(), ByteString(b"u".to_vec())),
            ("password".to_string(), ByteString(b"p".to_vec())),
            ("notes".to_string(), ByteString(b"n".to_vec())),
        ]);
        let copied: Vec<String> = remote_credentials(&credentials).into_keys().collect();
        assert_eq!(copied, vec!["password", "username"]);
    }

    #[test]
    fn a_new_host_is_created_online_with_the_assets_name_labels_and_bmc() {
        let host = serde_json::to_value(new_host(&asset("00:00:00:00:00:01", Some("dell")), "c1")).unwrap();
        assert_eq!(host["apiVersion"], json!("metal3.io/v1alpha1"));
        assert_eq!(host["kind"], json!("BareMetalHost"));
        assert_eq!(host["metadata"]["name"], json!("host-1"));
        assert_eq!(host["metadata"]["namespace"], json!(MACHINE_API_NAMESPACE));
        assert_eq!(
            host["metadata"]["labels"],
            json!({ROLE_LABEL: "worker", CLUSTER_LABEL: "c1"})
        );
        assert_eq!(host["spec"]["online"], json!(true));
        assert_eq!(
            host["spec"]["bmc"],
            json!({"address": "ipmi://10.0.0.1", "credentialsName": "host-1-bmc-secret"})
        );
        assert_eq!(host["spec"]["hardwareProfile"], json!("dell"));
    }

    #[test]
    fn a_host_as_the_asset_says_is_left_alone_whatever_the_mac_case_or_power_state() {
        let a = asset("aa:bb:cc:dd:ee:ff", None);
        let mut host = delivered(&a);
        host.data["spec"]["bootMACAddress"] = json!("AA:BB:CC:DD:EE:FF");
        host.data["spec"]["online"] = json!(false);
        assert_eq!(host_change(&host, &a, "c1"), HostChange::UpToDate);
    }

    #[test]
    fn a_changed_boot_mac_replaces_the_host() {
        let host = delivered(&asset("00:00:00:00:00:01", None));
        assert_eq!(
            host_change(&host, &asset("00:00:00:00:00:02", None), "c1"),
            HostChange::Replace
        );
    }

    #[test]
    fn bmc_and_profile_changes_are_patched_without_touching_the_power_state() {
        let before = asset("00:00:00:00:00:01", Some("dell"));
        let host = delivered(&before);
        let mut moved = asset("00:00:00:00:00:01", Some("dell"));
        moved.spec.bmc.address = "ipmi://10.0.0.2".into();
        let HostChange::Patch(patch) = host_change(&host, &moved, "c1") else {
            panic!("patched");
        };
        assert_eq!(patch["spec"]["bmc"]["address"], json!("ipmi://10.0.0.2"));
        assert!(patch["spec"].get("online").is_none());
        let HostChange::Patch(patch) = host_change(&host, &asset("00:00:00:00:00:01", None), "c1") else {
            panic!("patched");
        };
        assert_eq!(
            patch["spec"]["hardwareProfile"],
            Value::Null,
            "a removed profile is removed"
        );
    }

    #[test]
    fn a_host_the_installer_made_without_our_labels_is_adopted() {
        let a = asset("00:00:00:00:00:01", None);
        let mut host = delivered(&a);
        host.metadata.labels = None;
        let HostChange::Patch(patch) = host_change(&host, &a, "c1") else {
            panic!("adopted");
        };
        assert_eq!(patch["metadata"]["labels"][CLUSTER_LABEL], json!("c1"));
    }
}
