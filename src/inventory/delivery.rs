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

use super::asset::role_label;
use super::{CLUSTER_LABEL, ROLE_LABEL};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::ClusterDeployment;
use crate::pools::{is_conflict, is_not_found};
use crate::tenancy::untrusted_kubeconfig::{UntrustedKubeconfigError, config_from_untrusted};

/// Namespace of BareMetalHosts on a managed cluster.
pub const MACHINE_API_NAMESPACE: &str = "openshift-machine-api";

#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("the admin kubeconfig of cluster {0} is missing or unreadable: {1}")]
    Kubeconfig(String, String),
    /// The tenant-writable admin kubeconfig asks for something stackd never does for a tenant.
    #[error("the admin kubeconfig of cluster {cluster} in Secret {secret} was refused: {reason}")]
    KubeconfigRefused {
        cluster: String,
        secret: String,
        #[source]
        reason: UntrustedKubeconfigError,
    },
    #[error("managed cluster request failed: {0}")]
    Remote(#[source] kube::Error),
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
}

impl DeliveryError {
    /// The condition and Event reason for this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            DeliveryError::KubeconfigRefused { .. } => "AdminKubeconfigRefused",
            _ => "DeliveryFailed",
        }
    }
}

fn bmh_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("metal3.io", "v1alpha1", "BareMetalHost"),
        "baremetalhosts",
    )
}

/// Name of the BMC Secret on the managed cluster.
pub fn remote_secret_name(asset: &BareMetalAsset) -> String {
    format!("{}-bmc-secret", asset.name_any())
}

/// A client for the cluster, from its admin kubeconfig Secret in the tenant. The Secret is
/// tenant-writable, so only the allow-listed inline data of the kubeconfig is used.
pub async fn cluster_client(tenant: &Client, cd: &ClusterDeployment) -> Result<Client, DeliveryError> {
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
    let mut config = config_from_untrusted(&text).map_err(|reason| DeliveryError::KubeconfigRefused {
        cluster: name.clone(),
        secret: secret_name.clone(),
        reason,
    })?;
    config.connect_timeout = Some(Duration::from_secs(5));
    Client::try_from(config).map_err(|e| bad(e.to_string()))
}

/// Creates or updates the host's Secret and BareMetalHost on the cluster. Returns true once the
/// BareMetalHost is there as the asset says (false: a stale one was removed, come back).
pub async fn deliver(
    remote: &Client,
    asset: &BareMetalAsset,
    credentials: &BTreeMap<String, ByteString>,
    cluster: &str,
) -> Result<bool, DeliveryError> {
    let secrets = Api::<Secret>::namespaced(remote.clone(), MACHINE_API_NAMESPACE);
    let secret_name = remote_secret_name(asset);
    let data: BTreeMap<String, ByteString> = credentials
        .iter()
        .filter(|(k, _)| matches!(k.as_str(), "username" | "password"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match secrets.get_opt(&secret_name).await.map_err(DeliveryError::Remote)? {
        None => {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": secret_name, "namespace": MACHINE_API_NAMESPACE},
                "type": "Opaque",
            }))
            .expect("static shape");
            let secret = Secret {
                data: Some(data),
                ..secret
            };
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(DeliveryError::Remote)?;
        }
        Some(existing) if existing.data.as_ref() != Some(&data) => {
            let mut updated = existing.clone();
            updated.data = Some(data);
            updated.metadata.managed_fields = None;
            match secrets.replace(&secret_name, &PostParams::default(), &updated).await {
                Ok(_) => {}
                Err(err) if is_conflict(&err) => return Ok(false),
                Err(err) => return Err(DeliveryError::Remote(err)),
            }
        }
        Some(_) => {}
    }

    let hosts = Api::<DynamicObject>::namespaced_with(remote.clone(), MACHINE_API_NAMESPACE, &bmh_resource());
    let mut spec = json!({
        "bmc": {"address": asset.spec.bmc.address, "credentialsName": secret_name},
        "bootMACAddress": asset.spec.boot_mac_address,
    });
    if let Some(profile) = &asset.spec.hardware_profile {
        spec["hardwareProfile"] = json!(profile);
    }
    let labels = json!({ROLE_LABEL: role_label(asset.spec.role), CLUSTER_LABEL: cluster});
    let name = asset.name_any();
    match hosts.get_opt(&name).await.map_err(DeliveryError::Remote)? {
        None => {
            // `online: true` only on create: afterwards the cluster owns the power state.
            let mut create_spec = spec.clone();
            create_spec["online"] = json!(true);
            let object: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "metal3.io/v1alpha1", "kind": "BareMetalHost",
                "metadata": {"name": name, "namespace": MACHINE_API_NAMESPACE, "labels": labels},
                "spec": create_spec,
            }))
            .expect("static shape");
            hosts
                .create(&PostParams::default(), &object)
                .await
                .map_err(DeliveryError::Remote)?;
            Ok(true)
        }
        Some(existing) => {
            if existing.metadata.deletion_timestamp.is_some() {
                return Ok(false);
            }
            let current_mac = existing.data["spec"]["bootMACAddress"].as_str().unwrap_or_default();
            if !current_mac.eq_ignore_ascii_case(&asset.spec.boot_mac_address) {
                // metal3 refuses a boot MAC edit: replace the host.
                delete_and_ignore_missing(&hosts, &name).await?;
                return Ok(false);
            }
            let up_to_date = ["bmc", "hardwareProfile"]
                .iter()
                .all(|k| existing.data["spec"].get(k) == spec.get(k))
                && labels
                    .as_object()
                    .expect("object")
                    .iter()
                    .all(|(k, v)| existing.labels().get(k).map(|s| json!(s)).as_ref() == Some(v));
            if !up_to_date {
                // Adopts a host the installer made, and carries later BMC or profile changes.
                let mut patch = json!({"metadata": {"labels": labels}, "spec": spec});
                if asset.spec.hardware_profile.is_none() {
                    patch["spec"]["hardwareProfile"] = Value::Null;
                }
                hosts
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(DeliveryError::Remote)?;
            }
            Ok(true)
        }
    }
}

async fn delete_and_ignore_missing<K>(api: &Api<K>, name: &str) -> Result<(), DeliveryError>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(DeliveryError::Remote(err)),
    }
}

/// Removes the BareMetalHost (metal3 deprovisions it) and its Secret from the cluster. Returns true
/// once both are gone.
pub async fn detach(remote: &Client, asset: &BareMetalAsset) -> Result<bool, DeliveryError> {
    let hosts = Api::<DynamicObject>::namespaced_with(remote.clone(), MACHINE_API_NAMESPACE, &bmh_resource());
    let secrets = Api::<Secret>::namespaced(remote.clone(), MACHINE_API_NAMESPACE);
    let name = asset.name_any();
    let secret_name = remote_secret_name(asset);
    delete_and_ignore_missing(&hosts, &name).await?;
    delete_and_ignore_missing(&secrets, &secret_name).await?;
    let host_gone = hosts.get_opt(&name).await.map_err(DeliveryError::Remote)?.is_none();
    let secret_gone = secrets
        .get_opt(&secret_name)
        .await
        .map_err(DeliveryError::Remote)?
        .is_none();
    Ok(host_gone && secret_gone)
}
