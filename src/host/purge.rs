//! `stackd tenant purge`: the explicit decommission of a tenant's host objects.
//!
//! Removing a tenant's kubeconfig only suspends it, so a mistaken delete loses nothing; purge is the
//! deliberate step that deletes what stackd created for the tenant on the host.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, LimitRange, Namespace, ResourceQuota, Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, PropagationPolicy};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use super::labels::tenant_selector;
use super::names::label_value;
use super::namespace::ADOPTED_ANNOTATION;
use crate::host::labels::TENANT_LABEL;
use crate::runtime::api_errors::is_not_found;

#[derive(Debug, thiserror::Error)]
pub enum PurgeError {
    #[error("namespace {namespace} is labelled for tenant {owner:?}, not {tenant:?}; nothing was deleted")]
    OtherTenant {
        namespace: String,
        tenant: String,
        owner: String,
    },
    #[error("host API error: {0}")]
    Api(#[from] kube::Error),
}

/// What a purge did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Deleted objects, as `Kind/name`.
    pub deleted: Vec<String>,
    /// Whether the namespace itself was deleted (it is kept when stackd adopted it).
    pub namespace_deleted: bool,
}

/// Deletes every host object labelled for `tenant` in its namespace, then the namespace unless stackd
/// adopted it. Run it after removing the tenant's kubeconfig, or the daemon recreates the objects.
pub async fn purge(host: &Client, tenant: &str, namespace: &str) -> Result<PurgeReport, PurgeError> {
    let namespaces: Api<Namespace> = Api::all(host.clone());
    let Some(ns) = namespaces.get_opt(namespace).await? else {
        return Ok(PurgeReport::default());
    };
    if let Some(owner) = ns.labels().get(TENANT_LABEL)
        && *owner != label_value(tenant)
    {
        return Err(PurgeError::OtherTenant {
            namespace: namespace.to_string(),
            tenant: tenant.to_string(),
            owner: owner.clone(),
        });
    }
    let mut report = PurgeReport::default();
    delete_labelled::<Deployment>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<Job>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<Secret>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<ConfigMap>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<ServiceAccount>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<ResourceQuota>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<LimitRange>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<NetworkPolicy>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<RoleBinding>(host, tenant, namespace, &mut report).await?;
    delete_labelled::<Role>(host, tenant, namespace, &mut report).await?;
    let ours = ns.labels().get(TENANT_LABEL) == Some(&label_value(tenant));
    if ours && !ns.annotations().contains_key(ADOPTED_ANNOTATION) {
        namespaces.delete(namespace, &DeleteParams::background()).await?;
        report.namespace_deleted = true;
    }
    Ok(report)
}

/// Deletes this tenant's objects of one kind, one by one so the report names each; Jobs take their
/// pods with them (the API default would orphan them).
async fn delete_labelled<K>(
    host: &Client,
    tenant: &str,
    namespace: &str,
    report: &mut PurgeReport,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(host.clone(), namespace);
    let list = api
        .list(&ListParams::default().labels(&tenant_selector(tenant)))
        .await?;
    let params = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..Default::default()
    };
    for object in list {
        let name = object.name_any();
        match api.delete(&name, &params).await {
            Ok(_) => report.deleted.push(format!("{}/{name}", K::kind(&()))),
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}
