//! The failure-domain record a ClusterDeployment keeps (DESIGN.md §6): written once from the
//! install-config Secret the pool rendered, never recomputed, and restored from the copy on the
//! host when someone edits it.

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};

use super::failure_domains::{HASH_ANNOTATION, RECORD_KEY, record_hash};
use crate::api::pools::{ClusterDeployment, MachineFailureDomain};

/// The record the cluster's status should hold, when it holds something else: read from the
/// rendered install config on the host (`host_input`), or the tenant's Secret before the host copy
/// exists. `None` when the status is right or the cluster has no record.
pub(crate) async fn wanted(
    cd: &ClusterDeployment,
    host_input: Option<&Secret>,
    tenant_secrets: &Api<Secret>,
) -> Result<Option<Vec<MachineFailureDomain>>, kube::Error> {
    let Some(hash) = cd.annotations().get(HASH_ANNOTATION) else {
        return Ok(None);
    };
    let current = cd
        .status
        .as_ref()
        .map(|s| s.failure_domains.clone())
        .unwrap_or_default();
    if record_hash(&current) == *hash {
        return Ok(None);
    }
    let from_host = host_input.and_then(parse);
    let record = match from_host {
        Some(record) => Some(record),
        None => {
            let name = cd
                .spec
                .provisioning
                .as_ref()
                .map(|p| p.install_config_secret_ref.name.clone())
                .unwrap_or_default();
            tenant_secrets.get_opt(&name).await?.as_ref().and_then(parse)
        }
    };
    // Only a source that matches the annotation is trusted; anything else is left as it is.
    Ok(record.filter(|r| record_hash(r) == *hash && *r != current))
}

fn parse(secret: &Secret) -> Option<Vec<MachineFailureDomain>> {
    let bytes = secret.data.as_ref()?.get(RECORD_KEY)?;
    serde_json::from_slice(&bytes.0).ok()
}
