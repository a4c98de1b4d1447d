//! The CustomResourceDefinitions generated from the types, as `stackd crds` prints them.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use super::inventory::BareMetalAsset;
use super::pools::{ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};
use super::stacks::{ClusterStackInstall, Stack, StackDefinition, StackInstall};
use super::tenancy::Tenant;

/// Longest ClusterPool name: the pool name plus `-` and a 5-character suffix names each cluster's
/// namespace, which must stay a DNS label of at most 63 characters.
pub const CLUSTER_POOL_NAME_MAX: usize = 57;

/// Every CRD stackd serves in a tenant API server, in a stable order (what `stackd crds` prints and
/// the stackd-types chart installs): stackd's own ([`names`]) and Crossplane's StackDefinition,
/// which templating stacks' controllers read (a tenant without it runs every other stack).
pub fn all() -> Vec<CustomResourceDefinition> {
    // Generated once: a schema costs milliseconds, and the bench and tests install them into every
    // tenant API server they start.
    static ALL: LazyLock<Vec<CustomResourceDefinition>> = LazyLock::new(|| {
        [
            StackInstall::crd(),
            ClusterStackInstall::crd(),
            Stack::crd(),
            with_max_name_length(ClusterPool::crd(), CLUSTER_POOL_NAME_MAX),
            ClusterDeploymentCustomization::crd(),
            ClusterDeployment::crd(),
            ClusterClaim::crd(),
            BareMetalAsset::crd(),
            StackDefinition::crd(),
        ]
        .into_iter()
        .map(without_null_enum_values)
        .collect()
    });
    ALL.clone()
}

/// The names of [`all`]'s CRDs, without generating their schemas (which costs milliseconds: every
/// tenant's start needs only the names, to see that they are served).
pub fn names() -> [&'static str; 8] {
    [
        StackInstall::crd_name(),
        ClusterStackInstall::crd_name(),
        Stack::crd_name(),
        ClusterPool::crd_name(),
        ClusterDeploymentCustomization::crd_name(),
        ClusterDeployment::crd_name(),
        ClusterClaim::crd_name(),
        BareMetalAsset::crd_name(),
    ]
}

/// The CRDs stackd serves on the host cluster: Tenant (what `stackd crds --host` prints and the
/// controllers chart installs). `stackd crds --out DIR` writes them into `DIR/host/`.
pub fn host() -> Vec<CustomResourceDefinition> {
    [with_max_name_length(Tenant::crd(), TENANT_NAME_MAX)]
        .into_iter()
        .map(without_null_enum_values)
        .collect()
}

/// Longest Tenant name: a tenant's name is a DNS label (and must also fit the host namespace
/// template, which the daemon checks).
pub const TENANT_NAME_MAX: usize = 63;

/// The subdirectory of `stackd crds --out` holding [`host`]'s CRDs: `cp crds/*.yaml` copies the
/// tenant CRDs alone.
pub const HOST_DIR: &str = "host";

/// Why CRDs could not be written out.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    #[error("cannot render a CRD as YAML: {0}")]
    Yaml(#[from] serde_saphyr::ser::Error),
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// The CRDs as one YAML stream, each document starting with `---`.
pub fn to_yaml_stream(crds: &[CustomResourceDefinition]) -> Result<String, CrdError> {
    let mut out = String::new();
    for crd in crds {
        out.push_str("---\n");
        out.push_str(&to_yaml(crd)?);
    }
    Ok(out)
}

/// One CRD as YAML.
pub fn to_yaml(crd: &CustomResourceDefinition) -> Result<String, CrdError> {
    Ok(serde_saphyr::to_string(crd)?)
}

/// Writes one file per CRD into `dir` (created if missing), named by [`file_name`].
pub fn write_files(crds: &[CustomResourceDefinition], dir: &Path) -> Result<(), CrdError> {
    std::fs::create_dir_all(dir).map_err(|source| CrdError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for crd in crds {
        let path = dir.join(file_name(crd));
        std::fs::write(&path, to_yaml(crd)?).map_err(|source| CrdError::Io { path, source })?;
    }
    Ok(())
}

/// The file name `stackd crds --out` writes a CRD to: `<group>_<plural>.yaml`.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural)
}

/// Drops the `null` that optional enums add to `enum`: `nullable: true` already admits null, and a
/// null enum value is not of the schema's type.
fn without_null_enum_values(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    fn visit(node: &mut Value) {
        match node {
            Value::Object(map) => {
                if let Some(Value::Array(values)) = map.get_mut("enum") {
                    values.retain(|v| !v.is_null());
                }
                map.values_mut().for_each(visit);
            }
            Value::Array(items) => items.iter_mut().for_each(visit),
            _ => {}
        }
    }
    let Ok(mut value) = serde_json::to_value(&crd) else {
        return crd;
    };
    visit(&mut value);
    serde_json::from_value(value).unwrap_or(crd)
}

/// Restricts `metadata.name` length in the schema; the only metadata constraint a CRD may declare.
fn with_max_name_length(mut crd: CustomResourceDefinition, max: usize) -> CustomResourceDefinition {
    for version in &mut crd.spec.versions {
        let Some(schema) = version.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) else {
            continue;
        };
        let metadata = json!({
            "type": "object",
            "properties": { "name": { "type": "string", "maxLength": max } },
        });
        if let Ok(metadata) = serde_json::from_value(metadata) {
            schema
                .properties
                .get_or_insert_with(Default::default)
                .insert("metadata".to_string(), metadata);
        }
    }
    crd
}

/// True once the API server serves a CRD (its `Established` condition is True).
pub fn is_established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// Annotation on a CRD stackd wrote: the SHA-256 of the spec it wrote, so a cached copy (kept
/// without schemas, `runtime::raw_object`) can be compared with a package's CRD.
pub const SPEC_HASH_ANNOTATION: &str = "stacks.stackd.dev/spec-sha256";

/// The value of [`SPEC_HASH_ANNOTATION`] for `crd`'s spec.
pub fn spec_hash(crd: &CustomResourceDefinition) -> String {
    use sha2::{Digest, Sha256};
    let bytes = serde_json::to_vec(&crd.spec).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_are_those_of_the_generated_crds() {
        let generated: Vec<String> = all().into_iter().filter_map(|crd| crd.metadata.name).collect();
        let (own, compatibility) = generated.split_at(names().len());
        assert_eq!(own, names().map(String::from));
        assert_eq!(compatibility, ["stackdefinitions.packages.crossplane.io"]);
    }
}
