//! Creating one pool cluster: its name, the Secrets it is built from, and its namespace, Secrets
//! and ClusterDeployment in the tenant (DESIGN.md §4.3 item 2, after the lease).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::{Api, ResourceExt};
use rand::RngExt;
use serde_json::{Map, Value};
use tracing::warn;

use super::failure_domains::{HASH_ANNOTATION, INVALID_KEY, RECORD_KEY, record_hash, record_text};
use super::install_config;
use super::machines::MachinePlan;
use super::membership::{POOL_UID_ANNOTATION, PoolIdentity, namespace_markers};
use super::pass::{Ctx, PoolError};
use super::{CDC_GENERATION_ANNOTATION, POOL_NAME_LABEL, POOL_NAMESPACE_LABEL, POOL_VERSION_ANNOTATION};
use crate::api::common::LocalObjectReference;
use crate::api::pools::{
    ClusterDeployment, ClusterDeploymentCustomization, ClusterDeploymentSpec, ClusterPool, ClusterPoolReference,
    Platform, Provisioning,
};
use crate::bounds::{self, Refused};

type Cdc = ClusterDeploymentCustomization;

/// A new cluster's name: `<pool>-<5 random characters>` (the pool name is at most 57 characters).
pub(super) fn cluster_name(pool: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    let suffix: String = (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("{pool}-{suffix}")
}

/// The Secrets every cluster is built from, read from the pool's namespace.
pub(super) struct Inputs {
    /// Parsed once per version of the template Secret, shared by every pool naming it.
    pub(super) template: Arc<Map<String, Value>>,
    /// The most bytes a cluster's rendered install config may take: what the installer's input
    /// Secret on the host holds ([`bounds::host_secret_limit`]) less the pull secret and the
    /// credentials copied beside it.
    pub(super) config_limit: usize,
    /// The bytes of the three Secrets read (and the template's rendered for each cluster): work
    /// charged to the namespace's share.
    pub(super) read_bytes: u64,
    pull: Option<Secret>,
    credentials: Option<Secret>,
}

/// What the pool's Secrets give: every cluster's inputs, or what is missing.
pub(super) enum Read {
    Found(Box<Inputs>),
    /// The Secrets (or their contents) the pool needs and lacks.
    Missing(Vec<String>),
    /// A Secret past a bound of [`crate::bounds`] (which, and how to fix it): nothing is read from it.
    TooLarge(String),
}

/// How soon a pool lacking Secrets looks again: tenant Secrets are not watched (too many).
pub(super) fn missing_recheck(ctx: &Ctx) -> Duration {
    let settings = &ctx.tenant.shared.settings;
    settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30))
}

pub(super) async fn read_inputs(pool: &ClusterPool, ctx: &Ctx) -> Result<Read, PoolError> {
    let ns = pool.namespace().unwrap_or_default();
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &ns);
    let spec = &pool.spec;
    let credentials_name = spec
        .platform
        .vsphere
        .as_ref()
        .map(|v| v.credentials_secret_ref.name.clone())
        .or_else(|| {
            spec.platform
                .openstack
                .as_ref()
                .map(|o| o.credentials_secret_ref.name.clone())
        })
        .or_else(|| {
            spec.platform
                .baremetal
                .as_ref()
                .map(|b| b.credentials_secret_ref.name.clone())
        });
    let mut missing = Vec::new();
    let mut get = async |what: &str, name: Option<String>| -> Result<Option<Secret>, PoolError> {
        let Some(name) = name else { return Ok(None) };
        let found = secrets.get_opt(&name).await?;
        if found.is_none() {
            missing.push(format!("{what} Secret {name}"));
        }
        Ok(found)
    };
    let template_secret = get(
        "install-config template",
        spec.install_config_secret_template_ref.as_ref().map(|r| r.name.clone()),
    )
    .await?;
    let pull = get("pull", spec.pull_secret_ref.as_ref().map(|r| r.name.clone())).await?;
    let credentials = get("credentials", credentials_name).await?;
    if !missing.is_empty() {
        return Ok(Read::Missing(missing));
    }
    // Every cluster of the pool carries all three: each within its bound, and together within a
    // render's.
    let limits = &ctx.tenant.shared.settings.document_limits;
    let mut budget = limits.render_budget();
    for secret in [&template_secret, &pull, &credentials].into_iter().flatten() {
        let checked = limits.render_secret(&ns, secret).and_then(|bytes| {
            budget.charge(bytes, || {
                format!("Secret {ns}/{} with the pool's other Secrets", secret.name_any())
            })
        });
        if let Err(refused) = checked {
            return Ok(Read::TooLarge(refused.to_string()));
        }
    }
    // Each cluster's installer gets all three in one host Secret, which its cache must read back.
    let host_limit = bounds::host_secret_limit(ctx.tenant.shared.settings.max_cached_object_bytes);
    let copied = [&pull, &credentials]
        .into_iter()
        .flatten()
        .map(bounds::secret_data_bytes)
        .fold(0, usize::saturating_add);
    let template_bytes = template_secret.as_ref().map_or(0, bounds::secret_data_bytes);
    let input = || {
        format!(
            "The installer's input Secret of each cluster of the pool (the template, pull secret and credentials of namespace {ns})"
        )
    };
    if let Err(refused) = bounds::host_secret_bytes(input, template_bytes.saturating_add(copied), host_limit) {
        return Ok(Read::TooLarge(refused.to_string()));
    }
    let template = match &template_secret {
        None => Arc::new(Map::new()),
        Some(secret) => match ctx.templates.parsed(secret).await {
            Ok(template) => template,
            Err(err) => {
                return Ok(Read::Missing(vec![format!(
                    "a valid install-config.yaml in the template Secret ({err})"
                )]));
            }
        },
    };
    Ok(Read::Found(Box::new(Inputs {
        template,
        config_limit: host_limit.saturating_sub(copied),
        read_bytes: template_bytes.saturating_add(copied) as u64,
        pull,
        credentials,
    })))
}

/// One cluster to create, with what it is built from.
pub(super) struct NewCluster<'a> {
    pub(super) name: &'a str,
    /// The pool version it is built at.
    pub(super) version: &'a str,
    /// The CDC leased for it, if the pool has an inventory.
    pub(super) cdc: Option<&'a Cdc>,
    pub(super) plan: &'a MachinePlan,
}

/// Creates the cluster's namespace, Secrets (`rendered` is its install config) and
/// ClusterDeployment.
pub(super) async fn create_cluster(
    pool: &ClusterPool,
    ctx: &Ctx,
    inputs: &Inputs,
    new: &NewCluster<'_>,
    rendered: BTreeMap<String, String>,
) -> Result<(), PoolError> {
    let (cd_name, version, cdc, plan) = (new.name, new.version, new.cdc, new.plan);
    let client = &ctx.tenant.client;
    // The namespace is the proof that this pool created the cluster (see membership).
    let identity = PoolIdentity::of(pool);
    let (namespace_labels, namespace_annotations) = namespace_markers(&identity);
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(cd_name.into()),
            labels: Some(namespace_labels),
            annotations: Some(namespace_annotations),
            ..Default::default()
        },
        ..Default::default()
    };
    let namespaces = Api::<Namespace>::all(client.clone());
    let made = namespaces.create(&PostParams::default(), &namespace).await?;
    let filled = async {
        let copies = create_secrets(pool, ctx, inputs, cd_name, rendered).await?;
        let cd = cluster_deployment(pool, &identity, cd_name, version, cdc, plan, copies);
        Api::<ClusterDeployment>::namespaced(client.clone(), cd_name)
            .create(&PostParams::default(), &cd)
            .await?;
        Ok::<(), PoolError>(())
    }
    .await;
    if let Err(err) = filled {
        // §4.3.4: no namespace left behind by a cluster that is not coming (the repair after the
        // minimum age stays the backstop when this delete fails too).
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: made.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        if let Err(cleanup) = namespaces.delete(cd_name, &params).await {
            warn!(namespace = %cd_name, error = %cleanup, "cannot delete the namespace of a cluster that failed to be created; the repair will");
        }
        return Err(err);
    }
    Ok(())
}

/// The Secrets a new cluster gets in its namespace, and the platform pointing at its copies.
struct Copies {
    config_name: String,
    pull: Option<LocalObjectReference>,
    platform: Platform,
}

/// Creates the cluster's install-config Secret and its copies of the pool's pull and credentials
/// Secrets.
async fn create_secrets(
    pool: &ClusterPool,
    ctx: &Ctx,
    inputs: &Inputs,
    cd_name: &str,
    rendered: BTreeMap<String, String>,
) -> Result<Copies, PoolError> {
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), cd_name);
    let config_name = format!("{cd_name}-install-config");
    let config_secret = Secret {
        metadata: ObjectMeta {
            name: Some(config_name.clone()),
            ..Default::default()
        },
        string_data: Some(rendered),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    bounds::written_secret(cd_name, &config_secret).map_err(PoolError::TooLarge)?;
    secrets.create(&PostParams::default(), &config_secret).await?;
    let copy = |source: &Secret, new_name: String| Secret {
        metadata: ObjectMeta {
            name: Some(new_name),
            ..Default::default()
        },
        data: source.data.clone(),
        type_: source.type_.clone(),
        ..Default::default()
    };
    let mut pull = None;
    if let Some(source) = &inputs.pull {
        let copy_name = format!("{cd_name}-pull-secret");
        let copied = copy(source, copy_name.clone());
        bounds::written_secret(cd_name, &copied).map_err(PoolError::TooLarge)?;
        secrets.create(&PostParams::default(), &copied).await?;
        pull = Some(LocalObjectReference { name: copy_name });
    }
    let mut platform = pool.spec.platform.clone();
    if let Some(credentials) = &inputs.credentials {
        let copy_name = format!("{cd_name}-credentials");
        let copied = copy(credentials, copy_name.clone());
        bounds::written_secret(cd_name, &copied).map_err(PoolError::TooLarge)?;
        secrets.create(&PostParams::default(), &copied).await?;
        let reference = LocalObjectReference { name: copy_name };
        if let Some(v) = platform.vsphere.as_mut() {
            v.credentials_secret_ref = reference.clone();
        }
        if let Some(o) = platform.openstack.as_mut() {
            o.credentials_secret_ref = reference.clone();
        }
        if let Some(b) = platform.baremetal.as_mut() {
            b.credentials_secret_ref = reference;
        }
    }
    Ok(Copies {
        config_name,
        pull,
        platform,
    })
}

/// The new cluster: the pool's labels and annotations plus the marks that tie it to the pool, the
/// pool version and the CDC generation it is built from (§4.3.8).
fn cluster_deployment(
    pool: &ClusterPool,
    identity: &PoolIdentity,
    cd_name: &str,
    version: &str,
    cdc: Option<&Cdc>,
    plan: &MachinePlan,
    copies: Copies,
) -> ClusterDeployment {
    let mut annotations = pool.spec.annotations.clone();
    if plan.invalid.is_none() && !plan.records.is_empty() {
        annotations.insert(HASH_ANNOTATION.into(), record_hash(&plan.records));
    }
    annotations.insert(POOL_VERSION_ANNOTATION.into(), version.into());
    annotations.insert(POOL_UID_ANNOTATION.into(), identity.uid.clone());
    if let Some(generation) = cdc.and_then(|c| c.metadata.generation) {
        annotations.insert(CDC_GENERATION_ANNOTATION.into(), generation.to_string());
    }
    let mut labels = pool.spec.labels.clone();
    labels.insert(POOL_NAMESPACE_LABEL.into(), identity.namespace.clone());
    labels.insert(POOL_NAME_LABEL.into(), identity.name.clone());
    let mut cd = ClusterDeployment::new(
        cd_name,
        ClusterDeploymentSpec {
            cluster_name: cd_name.into(),
            base_domain: pool.spec.base_domain.clone(),
            platform: copies.platform,
            pull_secret_ref: copies.pull,
            provisioning: Some(Provisioning {
                install_config_secret_ref: LocalObjectReference {
                    name: copies.config_name,
                },
                installer_image: pool.spec.installer_image.clone(),
            }),
            install_attempts_limit: pool.spec.install_attempts_limit,
            cluster_pool_ref: Some(ClusterPoolReference {
                namespace: identity.namespace.clone(),
                pool_name: identity.name.clone(),
                claim_name: None,
                claimed_timestamp: None,
                cluster_deployment_customization: cdc.map(|c| LocalObjectReference { name: c.name_any() }),
            }),
            hosts: plan.hosts.clone(),
        },
    );
    cd.metadata.namespace = Some(cd_name.into());
    cd.metadata.annotations = Some(annotations);
    cd.metadata.labels = Some(labels);
    cd
}

/// The install-config Secret's keys: the config, and the machines' failure-domain record (the
/// source a user-edited record is restored from) or why the machines cannot be placed.
/// `limit`: [`Inputs::config_limit`].
pub(super) fn config_data(
    config: &Value,
    plan: &MachinePlan,
    limit: usize,
) -> Result<BTreeMap<String, String>, Refused> {
    let yaml = install_config::to_yaml(config, limit)
        .ok_or_else(|| bounds::rendered_too_long("The rendered install-config.yaml".into(), limit))?;
    let mut data = BTreeMap::from([("install-config.yaml".to_string(), yaml)]);
    if let Some(invalid) = &plan.invalid {
        data.insert(INVALID_KEY.into(), invalid.clone());
    } else if !plan.records.is_empty() {
        data.insert(RECORD_KEY.into(), record_text(&plan.records));
    }
    let bytes = data.iter().map(|(k, v)| k.len() + v.len()).sum();
    let field = || "The install-config Secret with its failure-domain record".into();
    bounds::host_secret_bytes(field, bytes, limit)?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pools::buckets::fixtures::{cdc, pool};
    use serde_json::json;

    #[test]
    fn a_new_cluster_carries_the_pool_marks_version_and_customization_generation() {
        let pool = pool(
            "p",
            json!({"labels": {"team": "a"}, "annotations": {"note": "n"}, "installAttemptsLimit": 2}),
        );
        let identity = PoolIdentity::of(&pool);
        let copies = Copies {
            config_name: "p-abcde-install-config".into(),
            pull: None,
            platform: pool.spec.platform.clone(),
        };
        let from = cdc("a", 3, json!({}));
        let cd = cluster_deployment(
            &pool,
            &identity,
            "p-abcde",
            "v9",
            Some(&from),
            &MachinePlan::default(),
            copies,
        );
        assert_eq!(cd.namespace().as_deref(), Some("p-abcde"));
        let labels = cd.labels();
        assert_eq!(labels.get("team").map(String::as_str), Some("a"));
        assert_eq!(labels.get(POOL_NAME_LABEL).map(String::as_str), Some("p"));
        assert_eq!(labels.get(POOL_NAMESPACE_LABEL).map(String::as_str), Some("team"));
        let annotations = cd.annotations();
        assert_eq!(annotations.get("note").map(String::as_str), Some("n"));
        assert_eq!(annotations.get(POOL_VERSION_ANNOTATION).map(String::as_str), Some("v9"));
        assert_eq!(
            annotations.get(POOL_UID_ANNOTATION).map(String::as_str),
            Some("pool-uid")
        );
        assert_eq!(
            annotations.get(CDC_GENERATION_ANNOTATION).map(String::as_str),
            Some("3")
        );
        assert!(!annotations.contains_key(HASH_ANNOTATION), "no failure-domain record");
        let pool_ref = cd.spec.cluster_pool_ref.expect("a pool reference");
        assert_eq!(
            (pool_ref.namespace.as_str(), pool_ref.pool_name.as_str()),
            ("team", "p")
        );
        assert_eq!(
            pool_ref.cluster_deployment_customization.map(|r| r.name).as_deref(),
            Some("a")
        );
        assert_eq!(cd.spec.install_attempts_limit, Some(2));
    }
}
