//! Image pull secrets of a stack (DESIGN.md §3.2, §3.3, §8): the tenant Secrets an install names in
//! `imagePullSecrets` are copied into the tenant's host namespace for the pods that pull the stack's
//! images, the install Job and the stack's controller Deployment, each copy owned by that pod's owner.
//!
//! A tenant is hostile, so the copy is narrow: only Secrets of the install's (the Stack's) own
//! namespace, named by a valid Secret name (no path tricks reach another namespace), only the two
//! Secret types the kubelet reads pull credentials from, and only their credentials key. The host
//! names are unguessable, so no other pod in the shared host namespace can name a copy by chance.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, PodSpec, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use rand::RngExt;

use crate::api::stacks::MAX_IMAGE_PULL_SECRETS;
use crate::host::Parent;
use crate::host::apply::stamp;
use crate::host::names::{NameKind, host_name};

/// Annotation on a host copy: the tenant Secret (in the parent's namespace) it was copied from.
pub const SOURCE_ANNOTATION: &str = "stacks.stackd.dev/pull-secret-source";

/// The Secret types the kubelet takes pull credentials from, each with the one key it reads.
const PULL_SECRET_KEYS: &[(&str, &str)] = &[
    ("kubernetes.io/dockerconfigjson", ".dockerconfigjson"),
    ("kubernetes.io/dockercfg", ".dockercfg"),
];

/// Why the named pull secrets cannot be copied; the message says what to fix (never a value).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PullSecretError {
    #[error(
        "imagePullSecrets name(s) {names} are not Secret names (lowercase letters, digits, '-' and '.', at most 253 characters); name Secrets of namespace {namespace} only"
    )]
    InvalidName { names: String, namespace: String },
    #[error(
        "imagePullSecrets names {count} Secrets, more than the {max} an install may name; name at most {max} (one per registry the stack pulls from)"
    )]
    TooMany { count: usize, max: usize },
    #[error(
        "imagePullSecret(s) {names} not found in namespace {namespace}; create them or remove them from the install's spec.imagePullSecrets"
    )]
    Missing { names: String, namespace: String },
    #[error(
        "imagePullSecret(s) {names} in namespace {namespace} are not image pull secrets: their type must be kubernetes.io/dockerconfigjson (or kubernetes.io/dockercfg) with that key filled"
    )]
    NotPullSecret { names: String, namespace: String },
}

impl PullSecretError {
    pub fn reason(&self) -> &'static str {
        match self {
            PullSecretError::InvalidName { .. } => "InvalidPullSecretName",
            PullSecretError::TooMany { .. } => "TooManyPullSecrets",
            PullSecretError::Missing { .. } => "PullSecretMissing",
            PullSecretError::NotPullSecret { .. } => "PullSecretRefused",
        }
    }
}

/// The names as given, once each, after checking that every one is a Secret name: a name is only
/// ever looked up in the parent's own namespace, and one with `/` or `..` must not reach further.
pub fn checked_names(refs: &[LocalObjectReference], namespace: &str) -> Result<Vec<String>, PullSecretError> {
    // Bounded before anything is looked up: the schema says so too, but a CRD from before the bound
    // (or a server that does not check it) lets more through.
    let max = MAX_IMAGE_PULL_SECRETS as usize;
    if refs.len() > max {
        return Err(PullSecretError::TooMany { count: refs.len(), max });
    }
    let invalid: Vec<String> = refs
        .iter()
        .filter(|r| !is_secret_name(&r.name))
        .map(|r| format!("{:?}", r.name))
        .collect();
    if !invalid.is_empty() {
        return Err(PullSecretError::InvalidName {
            names: invalid.join(", "),
            namespace: namespace.into(),
        });
    }
    let mut names: Vec<String> = Vec::new();
    for reference in refs {
        if !names.contains(&reference.name) {
            names.push(reference.name.clone());
        }
    }
    Ok(names)
}

/// A DNS-1123 subdomain, as Kubernetes requires of Secret names.
fn is_secret_name(name: &str) -> bool {
    let label_ok = |label: &str| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    };
    name.len() <= 253 && name.split('.').all(label_ok)
}

/// The tenant Secrets `names` (in `api`'s namespace) as they are now, in order: `None` for one that
/// does not exist. [`check`] judges them.
pub async fn read(api: &Api<Secret>, names: &[String]) -> Result<Vec<(String, Option<Secret>)>, kube::Error> {
    let mut read = Vec::with_capacity(names.len());
    for name in names {
        read.push((name.clone(), api.get_opt(name).await?));
    }
    Ok(read)
}

/// The pull secrets [`read`] found, in order; an error names every one missing or not a pull secret.
pub fn check(namespace: &str, read: Vec<(String, Option<Secret>)>) -> Result<Vec<Secret>, PullSecretError> {
    let mut found = Vec::new();
    let (mut missing, mut refused) = (Vec::new(), Vec::new());
    for (name, secret) in read {
        match secret {
            Some(secret) if credentials(&secret).is_some() => found.push(secret),
            Some(_) => refused.push(name),
            None => missing.push(name),
        }
    }
    if !missing.is_empty() {
        return Err(PullSecretError::Missing {
            names: missing.join(", "),
            namespace: namespace.into(),
        });
    }
    if !refused.is_empty() {
        return Err(PullSecretError::NotPullSecret {
            names: refused.join(", "),
            namespace: namespace.into(),
        });
    }
    Ok(found)
}

/// The type and the one filled key of a pull secret; `None` for any other Secret.
fn credentials(secret: &Secret) -> Option<(&'static str, &'static str)> {
    let type_ = secret.type_.as_deref()?;
    let (type_, key) = PULL_SECRET_KEYS.iter().find(|(t, _)| *t == type_)?;
    let filled = secret.data.as_ref()?.get(*key).is_some_and(|v| !v.0.is_empty());
    filled.then_some((type_, key))
}

/// The type a copy of `source` has (a source that is no pull secret never gets that far).
pub fn copy_type(source: &Secret) -> Option<&'static str> {
    credentials(source).map(|(type_, _)| type_)
}

/// A fresh, unguessable host name for the `index`th pull secret of the tenant object `namespace/name`.
pub fn host_copy_name(namespace: &str, name: &str, index: usize) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    let random: String = (0..10)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    host_name(
        Some(namespace),
        name,
        &format!("-pull-{index}-{random}"),
        NameKind::Object,
    )
}

/// Where a host copy goes and who owns it.
pub struct CopyTarget<'a> {
    pub tenant: &'a str,
    pub parent: &'a Parent,
    pub host_namespace: &'a str,
    pub name: &'a str,
    /// None while the pod's owner does not exist yet (the copy comes first).
    pub owner: Option<OwnerReference>,
}

/// The host copy of a pull secret: its type and credentials key only, owned by `target.owner` so it
/// goes with the pod's owner.
pub fn host_copy(target: &CopyTarget<'_>, source: &Secret) -> Secret {
    let (type_, key) = credentials(source).unwrap_or(PULL_SECRET_KEYS[0]);
    let data = source
        .data
        .as_ref()
        .and_then(|data| data.get(key))
        .map(|value| BTreeMap::from([(key.to_string(), value.clone())]));
    let mut copy = Secret {
        metadata: ObjectMeta {
            name: Some(target.name.into()),
            namespace: Some(target.host_namespace.into()),
            annotations: Some(BTreeMap::from([(
                SOURCE_ANNOTATION.to_string(),
                source.metadata.name.clone().unwrap_or_default(),
            )])),
            owner_references: target.owner.clone().map(|owner| vec![owner]),
            ..ObjectMeta::default()
        },
        type_: Some(type_.into()),
        data,
        ..Secret::default()
    };
    stamp(&mut copy, target.tenant, target.parent);
    copy
}

/// Names of the pull secrets a pod spec refers to, in order.
pub fn referenced(pod: Option<&PodSpec>) -> Vec<String> {
    pod.and_then(|p| p.image_pull_secrets.as_ref())
        .map(|refs| refs.iter().map(|r| r.name.clone()).collect())
        .unwrap_or_default()
}

/// References to the host copies `names`, for a pod spec.
pub fn references(names: &[String]) -> Option<Vec<LocalObjectReference>> {
    (!names.is_empty()).then(|| {
        names
            .iter()
            .map(|name| LocalObjectReference { name: name.clone() })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn named(names: &[&str]) -> Vec<LocalObjectReference> {
        names
            .iter()
            .map(|n| LocalObjectReference { name: n.to_string() })
            .collect()
    }

    fn secret(type_: &str, data: &[(&str, &str)]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some("creds".into()),
                ..ObjectMeta::default()
            },
            type_: Some(type_.into()),
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn names_that_could_leave_the_namespace_are_refused() {
        for bad in [
            "../other/secrets/creds",
            "other/creds",
            "Creds",
            "",
            "-creds",
            "creds.",
            "a..b",
        ] {
            let err = checked_names(&named(&["ok", bad]), "team-a").expect_err(bad);
            assert_eq!(err.reason(), "InvalidPullSecretName");
            assert!(err.to_string().contains("namespace team-a"), "{err}");
        }
        assert_eq!(
            checked_names(&named(&["creds", "reg.example-1", "creds"]), "team-a").expect("valid"),
            ["creds", "reg.example-1"]
        );
    }

    #[test]
    fn only_the_credentials_key_of_a_pull_secret_is_copied() {
        let source = secret(
            "kubernetes.io/dockerconfigjson",
            &[(".dockerconfigjson", "{}"), ("note", "x")],
        );
        let parent = Parent::new("Stack", Some("team-a"), "s", "u");
        let copy = host_copy(
            &CopyTarget {
                tenant: "acme",
                parent: &parent,
                host_namespace: "tenant-acme-controllers",
                name: "team-a.s-pull-0-abc",
                owner: None,
            },
            &source,
        );
        assert_eq!(copy.type_.as_deref(), Some("kubernetes.io/dockerconfigjson"));
        let data = copy.data.expect("data");
        assert_eq!(data.keys().collect::<Vec<_>>(), [".dockerconfigjson"]);
        assert_eq!(
            copy.metadata.annotations.expect("annotations")[SOURCE_ANNOTATION],
            "creds"
        );
    }

    #[test]
    fn other_secrets_are_no_pull_secrets() {
        assert!(credentials(&secret("Opaque", &[(".dockerconfigjson", "{}")])).is_none());
        assert!(credentials(&secret("kubernetes.io/service-account-token", &[("token", "t")])).is_none());
        assert!(credentials(&secret("kubernetes.io/dockerconfigjson", &[(".dockerconfigjson", "")])).is_none());
        assert!(credentials(&secret("kubernetes.io/dockercfg", &[(".dockercfg", "{}")])).is_some());
    }

    #[test]
    fn a_check_names_every_missing_secret_before_any_that_is_no_pull_secret() {
        let pull = secret("kubernetes.io/dockerconfigjson", &[(".dockerconfigjson", "{}")]);
        let opaque = secret("Opaque", &[("password", "x")]);
        let read = |entries: &[(&str, Option<&Secret>)]| -> Vec<(String, Option<Secret>)> {
            entries.iter().map(|(n, s)| (n.to_string(), s.cloned())).collect()
        };
        let found = check("team-a", read(&[("a", Some(&pull)), ("b", Some(&pull))])).expect("pull secrets");
        assert_eq!(found.len(), 2);
        let err = check("team-a", read(&[("a", None), ("b", Some(&opaque)), ("c", None)])).expect_err("missing");
        assert_eq!(err.reason(), "PullSecretMissing");
        assert!(err.to_string().contains("a, c not found in namespace team-a"), "{err}");
        let err = check("team-a", read(&[("a", Some(&pull)), ("b", Some(&opaque))])).expect_err("refused");
        assert_eq!(err.reason(), "PullSecretRefused");
        assert!(
            err.to_string().contains("imagePullSecret(s) b in namespace team-a"),
            "{err}"
        );
    }

    #[test]
    fn host_copy_names_are_unguessable() {
        let a = host_copy_name("ns", "s", 0);
        let b = host_copy_name("ns", "s", 0);
        assert_ne!(a, b);
        assert!(a.starts_with("ns.s-pull-0-"));
    }
}
