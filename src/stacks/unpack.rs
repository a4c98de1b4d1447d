//! `stackd unpack`: reads a stack package's `.registry` directory (Crossplane's layout) and produces
//! the CRDs and the one Stack the daemon applies to the tenant (DESIGN.md §3.2 step 3).
//!
//! Layout: `app.yaml` (required: title, version, permissionScope, …), `install.yaml` (the controller
//! Deployment), and any number of `*crd.yaml` files, in any subdirectory. The controller's permissions
//! are generated from the CRDs it owns and depends on, never taken from the package.

use std::io::Write;
use std::path::{Path, PathBuf};

use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;
use serde_json::Value;

use super::rbac_verbs::ALLOWED_VERBS;
use super::stream::{self, PackageContents, StreamError};
use crate::api::stacks::{
    AppMetadata, Contributor, ControllerDeployment, ControllerSpec, CrdReference, Dependency, PermissionScope,
    Permissions, Stack, StackSpec,
};

/// What `stackd unpack` needs.
#[derive(Clone, Debug)]
pub struct UnpackOptions {
    /// The `.registry` directory.
    pub content_dir: PathBuf,
    /// The only permission scope the install allows.
    pub permission_scope: PermissionScope,
    /// The package image: its tag is the version when app.yaml has none, and it is the image of
    /// controller containers that name none.
    pub package_image: Option<String>,
}

/// Why a package could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("{0} has no app.yaml: every stack package needs one at the top of its .registry directory")]
    MissingApp(PathBuf),
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid YAML for {what}: {message}")]
    Parse {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error(
        "the package declares permissionScope {declared}, but this install allows only {allowed}: use a {hint} for this package"
    )]
    ScopeMismatch {
        declared: PermissionScope,
        allowed: PermissionScope,
        hint: &'static str,
    },
    #[error("{path} must hold one apps/v1 Deployment, found {found}")]
    NotDeployment { path: PathBuf, found: String },
    #[error(
        "{path}: container {container:?} names no image and no package image is known to fill it in: give the container an image, or run unpack with --package-image (env STACK_IMAGE; the install Job sets it)"
    )]
    MissingImage { path: PathBuf, container: String },
    #[error(
        "{path} holds {found}, not an apiextensions.k8s.io/v1 CustomResourceDefinition (v1beta1 CRDs were removed in Kubernetes 1.22; convert them)"
    )]
    NotCrd { path: PathBuf, found: String },
    #[error("{0} is a templating-stack behavior file; stackd installs only stacks with a controller Deployment")]
    Templating(PathBuf),
    #[error("{0}")]
    Stream(#[from] StreamError),
    #[error("cannot write the output: {0}")]
    Write(std::io::Error),
}

/// Unpacks the package and writes the stream with its trailer to `out`.
pub fn run(options: &UnpackOptions, out: &mut impl Write) -> Result<(), UnpackError> {
    let contents = unpack(options)?;
    let stream = stream::encode(&contents)?;
    out.write_all(stream.as_bytes())
        .and_then(|()| out.flush())
        .map_err(UnpackError::Write)
}

/// Reads the package into CRDs (sorted by file path) and its Stack.
pub fn unpack(options: &UnpackOptions) -> Result<PackageContents, UnpackError> {
    let dir = &options.content_dir;
    let app_path = dir.join("app.yaml");
    if !app_path.is_file() {
        return Err(UnpackError::MissingApp(dir.clone()));
    }
    if dir.join("behavior.yaml").exists() {
        return Err(UnpackError::Templating(dir.join("behavior.yaml")));
    }
    let app: AppFile = parse_file(&app_path, "app.yaml")?;
    let declared = app.permission_scope.unwrap_or_default();
    if declared != options.permission_scope {
        let hint = match declared {
            PermissionScope::Cluster => "ClusterStackInstall",
            PermissionScope::Namespaced => "StackInstall",
        };
        return Err(UnpackError::ScopeMismatch {
            declared,
            allowed: options.permission_scope,
            hint,
        });
    }
    let crds = read_crds(dir)?;
    let install_path = dir.join("install.yaml");
    let deployment = if install_path.is_file() {
        Some(read_deployment(&install_path, options.package_image.as_deref())?)
    } else {
        None
    };
    let stack = build_stack(app, declared, &crds, deployment, options.package_image.as_deref());
    Ok(PackageContents { crds, stack })
}

/// app.yaml as Crossplane defined it; unknown fields (icons, ...) are ignored.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AppFile {
    title: Option<String>,
    version: Option<String>,
    permission_scope: Option<PermissionScope>,
    overview_short: Option<String>,
    overview: Option<String>,
    readme: Option<String>,
    category: Option<String>,
    #[serde(default)]
    keywords: Vec<String>,
    website: Option<String>,
    source: Option<String>,
    license: Option<String>,
    company: Option<String>,
    #[serde(default)]
    maintainers: Vec<Contributor>,
    #[serde(default)]
    owners: Vec<Contributor>,
    #[serde(default)]
    depends_on: Vec<Dependency>,
}

fn parse_file<T: for<'de> Deserialize<'de>>(path: &Path, what: &'static str) -> Result<T, UnpackError> {
    let text = std::fs::read_to_string(path).map_err(|source| UnpackError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_saphyr::from_str(&text).map_err(|e| UnpackError::Parse {
        path: path.to_path_buf(),
        what,
        message: e.to_string(),
    })
}

fn parse_documents(path: &Path, what: &'static str) -> Result<Vec<Value>, UnpackError> {
    let text = std::fs::read_to_string(path).map_err(|source| UnpackError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let documents: Vec<Value> = serde_saphyr::from_multiple(&text).map_err(|e| UnpackError::Parse {
        path: path.to_path_buf(),
        what,
        message: e.to_string(),
    })?;
    Ok(documents.into_iter().filter(|d| !d.is_null()).collect())
}

fn describe(document: &Value) -> String {
    format!(
        "{} {}",
        document["apiVersion"].as_str().unwrap_or("(no apiVersion)"),
        document["kind"].as_str().unwrap_or("(no kind)")
    )
}

/// Every `*crd.yaml` under `dir`, sorted by relative path for a deterministic stream.
fn read_crds(dir: &Path) -> Result<Vec<CustomResourceDefinition>, UnpackError> {
    let mut paths = Vec::new();
    collect_files(dir, &mut paths)?;
    paths.retain(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with("crd.yaml"))
    });
    paths.sort();
    let mut crds = Vec::new();
    for path in paths {
        for document in parse_documents(&path, "a CustomResourceDefinition")? {
            if document["apiVersion"] != "apiextensions.k8s.io/v1" || document["kind"] != "CustomResourceDefinition" {
                return Err(UnpackError::NotCrd {
                    found: describe(&document),
                    path,
                });
            }
            let crd = serde_json::from_value(document).map_err(|e| UnpackError::Parse {
                path: path.clone(),
                what: "a CustomResourceDefinition",
                message: e.to_string(),
            })?;
            crds.push(crd);
        }
    }
    Ok(crds)
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), UnpackError> {
    let entries = std::fs::read_dir(dir).map_err(|source| UnpackError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| UnpackError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

fn read_deployment(path: &Path, package_image: Option<&str>) -> Result<ControllerDeployment, UnpackError> {
    let mut documents = parse_documents(path, "a Deployment")?;
    let found = documents.iter().map(describe).collect::<Vec<_>>().join(", ");
    let is_deployment = |d: &Value| d["apiVersion"] == "apps/v1" && d["kind"] == "Deployment";
    if documents.len() != 1 || !is_deployment(&documents[0]) {
        let found = if found.is_empty() { "nothing".to_string() } else { found };
        return Err(UnpackError::NotDeployment {
            path: path.to_path_buf(),
            found,
        });
    }
    let mut deployment = documents.remove(0);
    let name = deployment["metadata"]["name"]
        .as_str()
        .unwrap_or("controller")
        .to_string();
    let mut spec = deployment["spec"].take();
    if let Some(image) = package_image {
        fill_missing_images(&mut spec, image);
    }
    // kube-apiserver refuses a container without an image (422): say so now, not on the host.
    if let Some(container) = containers_without_image(&spec).into_iter().next() {
        return Err(UnpackError::MissingImage {
            path: path.to_path_buf(),
            container,
        });
    }
    Ok(ControllerDeployment { name, spec })
}

/// Names of the pod template's containers (init containers too) that name no image.
fn containers_without_image(spec: &Value) -> Vec<String> {
    ["initContainers", "containers"]
        .iter()
        .filter_map(|list| spec.pointer(&format!("/template/spec/{list}")))
        .filter_map(Value::as_array)
        .flatten()
        .filter(|c| {
            c.get("image")
                .and_then(Value::as_str)
                .is_none_or(|i| i.trim().is_empty())
        })
        .map(|c| c["name"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Containers that name no image run the package image, as in Crossplane.
fn fill_missing_images(spec: &mut Value, image: &str) {
    for list in ["containers", "initContainers"] {
        let pointer = format!("/template/spec/{list}");
        if let Some(containers) = spec.pointer_mut(&pointer).and_then(Value::as_array_mut) {
            for container in containers {
                if container.get("image").and_then(Value::as_str).is_none_or(str::is_empty) {
                    container["image"] = Value::String(image.to_string());
                }
            }
        }
    }
}

fn build_stack(
    app: AppFile,
    scope: PermissionScope,
    crds: &[CustomResourceDefinition],
    deployment: Option<ControllerDeployment>,
    package_image: Option<&str>,
) -> Stack {
    let version = app.version.or_else(|| package_image.and_then(image_tag));
    let spec = StackSpec {
        title: app.title,
        version,
        permission_scope: scope,
        customresourcedefinitions: crds.iter().map(crd_reference).collect(),
        permissions: Permissions {
            rules: generated_rules(crds, &app.depends_on),
        },
        // The install sets the service account and pull secrets: a package names no tenant Secret.
        controller: ControllerSpec {
            service_account: None,
            deployment,
            image_pull_secrets: Vec::new(),
        },
        metadata: AppMetadata {
            overview_short: app.overview_short,
            overview: app.overview,
            readme: app.readme,
            category: app.category,
            keywords: app.keywords,
            website: app.website,
            source: app.source,
            license: app.license,
            company: app.company,
            maintainers: app.maintainers,
            owners: app.owners,
            depends_on: app.depends_on,
        },
    };
    Stack {
        metadata: Default::default(),
        spec,
        status: None,
    }
}

fn crd_reference(crd: &CustomResourceDefinition) -> CrdReference {
    let version = crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .or_else(|| crd.spec.versions.first())
        .map(|v| v.name.clone())
        .unwrap_or_default();
    CrdReference {
        api_version: format!("{}/{version}", crd.spec.group),
        kind: crd.spec.names.kind.clone(),
    }
}

/// The default core rule, full access to each owned CRD (with its subresources and finalizers, which
/// blockOwnerDeletion needs), and full access to each CRD the stack depends on. "Full" is every verb
/// the Stack controller grants, spelled out: `*` would also grant verbs such as `escalate` and `bind`.
pub fn generated_rules(crds: &[CustomResourceDefinition], depends_on: &[Dependency]) -> Vec<PolicyRule> {
    let rule = |group: &str, resources: Vec<String>| PolicyRule {
        api_groups: Some(vec![group.to_string()]),
        resources: Some(resources),
        verbs: ALLOWED_VERBS.iter().map(|verb| verb.to_string()).collect(),
        ..Default::default()
    };
    let mut rules = vec![rule("", vec!["configmaps".into(), "events".into(), "secrets".into()])];
    for crd in crds {
        let plural = &crd.spec.names.plural;
        let mut resources = vec![
            plural.clone(),
            format!("{plural}/status"),
            format!("{plural}/finalizers"),
        ];
        let has_scale = crd
            .spec
            .versions
            .iter()
            .any(|v| v.subresources.as_ref().is_some_and(|s| s.scale.is_some()));
        if has_scale {
            resources.push(format!("{plural}/scale"));
        }
        rules.push(rule(&crd.spec.group, resources));
    }
    for dependency in depends_on {
        let Some((plural, group)) = dependency.crd.as_deref().and_then(split_dependency) else {
            continue;
        };
        rules.push(rule(group, vec![plural.to_string()]));
    }
    rules
}

/// `widgets.samples.example.org/v1alpha1` → (`widgets`, `samples.example.org`).
pub fn split_dependency(crd: &str) -> Option<(&str, &str)> {
    let without_version = crd.split('/').next()?;
    let (plural, group) = without_version.split_once('.')?;
    (!plural.is_empty() && !group.is_empty()).then_some((plural, group))
}

/// The tag of an image reference, if it has one (not a digest).
fn image_tag(image: &str) -> Option<String> {
    let last = image.rsplit('/').next()?;
    let (_, tag) = last.split_once(':')?;
    (!image.contains('@')).then(|| tag.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dependencies_name_plural_and_group() {
        assert_eq!(
            split_dependency("widgets.samples.example.org/v1alpha1"),
            Some(("widgets", "samples.example.org"))
        );
        assert_eq!(split_dependency("nogroup/v1"), None);
    }

    #[test]
    fn image_tags_are_read_from_the_last_path_segment() {
        assert_eq!(image_tag("registry:5000/org/stack:v1.2").as_deref(), Some("v1.2"));
        assert_eq!(image_tag("registry:5000/org/stack"), None);
        assert_eq!(image_tag("org/stack@sha256:abc"), None);
    }
}
