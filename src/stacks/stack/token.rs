//! The controller's credentials (DESIGN.md §3.3 steps 2–3): a service-account token Secret on the
//! tenant, filled by the tenant's token controller, and its copy on the host for the Deployment to
//! mount. Never `serviceaccount.secrets[0]`: Kubernetes stopped creating those in 1.24.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use super::tenant::TenantIdentity;
use crate::bounds;

pub const TOKEN_SECRET_TYPE: &str = "kubernetes.io/service-account-token";
pub const SERVICE_ACCOUNT_NAME_ANNOTATION: &str = "kubernetes.io/service-account.name";

/// `<stack>-token` on the tenant, which the tenant's token controller fills.
pub fn tenant_secret_name(identity: &TenantIdentity) -> String {
    format!("{}-token", identity.name)
}

pub fn tenant_secret(identity: &TenantIdentity, owner: &OwnerReference) -> Secret {
    let mut metadata = identity.meta(&tenant_secret_name(identity), Some(owner));
    metadata
        .annotations
        .get_or_insert_default()
        .insert(SERVICE_ACCOUNT_NAME_ANNOTATION.into(), identity.name.clone());
    Secret {
        metadata,
        type_: Some(TOKEN_SECRET_TYPE.into()),
        ..Default::default()
    }
}

/// The keys to copy once the token controller has filled the Secret; `None` while `token` is empty,
/// refused when they are more than a token copy holds (measured before they are copied).
pub fn filled_keys(
    secret: &Secret,
    identity: &TenantIdentity,
) -> Option<Result<BTreeMap<String, ByteString>, bounds::Refused>> {
    let data = secret.data.as_ref()?;
    let token = data.get("token").filter(|t| !t.0.is_empty())?;
    let copied = ["token", "ca.crt", "namespace"]
        .iter()
        .filter_map(|key| data.get(*key))
        .map(|value| value.0.len())
        .fold(0, usize::saturating_add);
    let field = || {
        format!(
            "the token Secret {}/{}",
            identity.namespace,
            tenant_secret_name(identity)
        )
    };
    if let Err(refused) = bounds::token_copy(field, copied) {
        return Some(Err(refused));
    }
    let mut keys = BTreeMap::from([("token".to_string(), token.clone())]);
    if let Some(ca) = data.get("ca.crt") {
        keys.insert("ca.crt".into(), ca.clone());
    }
    let namespace = data
        .get("namespace")
        .cloned()
        .unwrap_or_else(|| ByteString(identity.namespace.clone().into_bytes()));
    keys.insert("namespace".into(), namespace);
    Some(Ok(keys))
}

/// The host copy: Opaque, owned by the host Deployment so it goes with it (once the Deployment
/// exists: the copy is written first, so its pods never wait on the volume).
pub fn host_secret(
    name: &str,
    namespace: &str,
    data: BTreeMap<String, ByteString>,
    owner: Option<&Deployment>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            owner_references: owner.map(|owner| vec![owner_reference(owner)]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    }
}

/// The owner reference of a host copy the Deployment's pods use: the Deployment, so it goes with it.
pub fn owner_reference(owner: &Deployment) -> OwnerReference {
    OwnerReference {
        api_version: "apps/v1".into(),
        kind: "Deployment".into(),
        name: owner.name_any(),
        uid: owner.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> TenantIdentity {
        TenantIdentity {
            namespace: "team-a".into(),
            name: "s".into(),
        }
    }

    #[test]
    fn an_unfilled_secret_has_nothing_to_copy() {
        let secret = tenant_secret(&identity(), &OwnerReference::default());
        assert!(filled_keys(&secret, &identity()).is_none());
        let mut empty = secret.clone();
        empty.data = Some(BTreeMap::from([("token".into(), ByteString(vec![]))]));
        assert!(filled_keys(&empty, &identity()).is_none());
    }

    #[test]
    fn a_filled_secret_gives_token_ca_and_namespace() {
        let mut secret = tenant_secret(&identity(), &OwnerReference::default());
        secret.data = Some(BTreeMap::from([
            ("token".into(), ByteString(b"t".to_vec())),
            ("ca.crt".into(), ByteString(b"c".to_vec())),
            ("extra".into(), ByteString(b"x".to_vec())),
        ]));
        let Some(Ok(keys)) = filled_keys(&secret, &identity()) else {
            panic!("a filled token within bounds is copied");
        };
        assert_eq!(keys.keys().collect::<Vec<_>>(), ["ca.crt", "namespace", "token"]);
        assert_eq!(keys["namespace"].0, b"team-a");
    }

    #[test]
    fn a_token_secret_padded_by_a_tenant_user_is_refused_before_it_is_copied() {
        let mut secret = tenant_secret(&identity(), &OwnerReference::default());
        secret.data = Some(BTreeMap::from([
            ("token".into(), ByteString(b"t".to_vec())),
            ("ca.crt".into(), ByteString(vec![b'c'; bounds::MAX_TOKEN_COPY_BYTES])),
        ]));
        let Some(Err(refused)) = filled_keys(&secret, &identity()) else {
            panic!("a padded token copied");
        };
        assert!(
            refused.to_string().contains("the token Secret team-a/s-token"),
            "{refused}"
        );
        // What is not copied costs nothing: an extra key of any size is left on the tenant.
        secret.data = Some(BTreeMap::from([
            ("token".into(), ByteString(b"t".to_vec())),
            ("extra".into(), ByteString(vec![b'x'; bounds::MAX_TOKEN_COPY_BYTES])),
        ]));
        assert!(matches!(filled_keys(&secret, &identity()), Some(Ok(_))));
    }
}
