//! `stackd unpack`: reads a stack package's `.registry` directory (Crossplane's layout) and produces
//! the CRDs and the one Stack the daemon applies to the tenant (DESIGN.md §3.2 step 3).
//!
//! Layout: `app.yaml` (required: title, version, permissionScope, …), `install.yaml` (the controller
//! Deployment), and any number of `*crd.yaml` files, in any subdirectory (`resources/<file>.crd.yaml`
//! and `resources/<group>/<plural>.crd.yaml` are both common). CRDs may be `apiextensions.k8s.io/v1`
//! or, as every Crossplane v0.x package ships them, `v1beta1`, converted to v1
//! ([`super::crd_v1beta1`]). The controller's permissions are generated from the CRDs it owns and
//! depends on, never taken from the package.
//!
//! Every problem of a package is reported in one go (up to [`MAX_PROBLEMS`]), so an author needs one
//! round trip, not one per problem.

use std::io::Write;
use std::path::{Path, PathBuf};

use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Deserialize;
use serde_json::Value;

use super::copy;
use super::crd_v1beta1::{self, ConversionError};
use super::rbac_verbs::ALLOWED_VERBS;
use super::stream::{self, PackageContents, StreamError};
use super::ui_metadata::{self, MetadataError, UiMetadata};
use crate::api::stacks::{
    AppMetadata, Behavior, Contributor, ControllerDeployment, ControllerSpec, CrdReference, Dependency,
    PermissionScope, Permissions, Stack, StackSpec,
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
    /// The controller of templating stacks whose behavior names none.
    pub templating_controller_image: String,
    /// stackd's image, whose binary a templating stack's pod copies its behaviors with.
    pub stackd_image: String,
}

/// `--templating-controller-image` when not given: the last templating controller Crossplane
/// released, which real templating packages name.
pub const DEFAULT_TEMPLATING_CONTROLLER_IMAGE: &str = "crossplane/templating-controller:v0.4.0";

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
    #[error(
        "{path} must hold one apps/v1 Deployment, the stack's controller; found {found} (job-based packages, Crossplane's 2019 extension format, are not supported)"
    )]
    NotDeployment { path: PathBuf, found: String },
    #[error(
        "{path}: container {container:?} names no image and no package image is known to fill it in: give the container an image, or run unpack with --package-image (env STACK_IMAGE; the install Job sets it)"
    )]
    MissingImage { path: PathBuf, container: String },
    #[error(
        "{path} holds {found}, not a CustomResourceDefinition (apiextensions.k8s.io/v1, or v1beta1, which is converted): keep only CRDs in *crd.yaml files"
    )]
    NotCrd { path: PathBuf, found: String },
    #[error("{path}: the v1beta1 CustomResourceDefinition cannot be converted to v1: {source}")]
    Conversion { path: PathBuf, source: ConversionError },
    #[error("{0}")]
    Metadata(#[from] MetadataError),
    #[error("{path}: {message}")]
    Behavior { path: PathBuf, message: String },
    #[error("{0}")]
    Stream(#[from] StreamError),
    #[error("cannot write the output: {0}")]
    Write(std::io::Error),
    #[error("{}", list_problems(.problems, *.more))]
    Several {
        problems: Vec<UnpackError>,
        /// Problems found past [`MAX_PROBLEMS`], counted only.
        more: usize,
    },
}

pub use crate::bounds::MAX_PACKAGE_PROBLEMS as MAX_PROBLEMS;

/// `the package has 3 problems:` and one line each.
fn list_problems(problems: &[UnpackError], more: usize) -> String {
    let total = problems.len() + more;
    let mut text = format!("the package has {total} problems:");
    for (i, problem) in problems.iter().enumerate() {
        text.push_str(&format!("\n  {}. {problem}", i + 1));
    }
    if more > 0 {
        text.push_str(&format!("\n  and {more} more: fix these first"));
    }
    text
}

/// The problems found so far, bounded in what is kept.
#[derive(Default)]
struct Problems {
    found: Vec<UnpackError>,
    more: usize,
}

impl Problems {
    fn push(&mut self, problem: UnpackError) {
        if self.found.len() < MAX_PROBLEMS {
            self.found.push(problem);
        } else {
            self.more += 1;
        }
    }

    /// The value, or `None` with its error kept.
    fn take<T>(&mut self, result: Result<T, UnpackError>) -> Option<T> {
        result.map_err(|problem| self.push(problem)).ok()
    }

    fn into_result(mut self) -> Result<(), UnpackError> {
        match (self.found.len(), self.more) {
            (0, _) => Ok(()),
            (1, 0) => Err(self.found.remove(0)),
            _ => Err(UnpackError::Several {
                problems: self.found,
                more: self.more,
            }),
        }
    }
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
    let mut problems = Problems::default();
    let app: AppFile = problems.take(parse_file(&app_path, "app.yaml")).unwrap_or_default();
    let declared = app.permission_scope.unwrap_or_default();
    if declared != options.permission_scope {
        let hint = match declared {
            PermissionScope::Cluster => "ClusterStackInstall",
            PermissionScope::Namespaced => "StackInstall",
        };
        problems.push(UnpackError::ScopeMismatch {
            declared,
            allowed: options.permission_scope,
            hint,
        });
    }
    let mut files = Vec::new();
    problems.take(collect_files(dir, &mut files));
    let files: Vec<PathBuf> = files
        .iter()
        .filter_map(|path| path.strip_prefix(dir).ok().map(Path::to_path_buf))
        .collect();
    let (ui, ui_problems) = ui_metadata::read(dir, &files, app.title.as_deref());
    for problem in ui_problems {
        problems.push(UnpackError::Metadata(problem));
    }
    let crds = read_crds(dir, &files, &ui, &mut problems);
    let install_path = dir.join("install.yaml");
    let behavior_path = dir.join("behavior.yaml");
    let behavior = if behavior_path.is_file() {
        problems.take(read_behavior(&behavior_path, &crds))
    } else {
        None
    };
    let deployment = match (&behavior, install_path.is_file()) {
        (Some(_), true) => {
            problems.push(UnpackError::Behavior {
                path: install_path,
                message: "a templating stack (behavior.yaml) runs the templating controller, not a Deployment of its own: remove install.yaml, or behavior.yaml".into(),
            });
            None
        }
        (Some(behavior), false) => Some(templating_deployment(behavior, options)),
        (None, true) => problems.take(read_deployment(&install_path, options.package_image.as_deref())),
        (None, false) => None,
    };
    problems.into_result()?;
    let mut stack = build_stack(app, declared, &crds, deployment, options.package_image.as_deref());
    stack.spec.behavior = behavior;
    Ok(PackageContents { crds, stack })
}

/// The permission scope the package in `dir` declares (the default when app.yaml cannot be read:
/// [`unpack`] reports why), for `stackd package check`, which judges a package as the install of
/// its own scope would.
pub fn declared_scope(dir: &Path) -> PermissionScope {
    parse_file::<AppFile>(&dir.join("app.yaml"), "app.yaml")
        .ok()
        .and_then(|app| app.permission_scope)
        .unwrap_or_default()
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

/// Annotation on a CRD converted from v1beta1: which file it came from, for the install's Event.
pub const CONVERTED_FROM_ANNOTATION: &str = "stacks.stackd.dev/converted-from-v1beta1";

/// Every `*crd.yaml` among `files` (relative to `dir`), sorted by path for a deterministic stream;
/// v1beta1 ones converted to v1 and marked with [`CONVERTED_FROM_ANNOTATION`], each with the UI
/// metadata that applies to it. Each document that is no CRD, or cannot be read or converted, is a
/// problem of its own.
fn read_crds(dir: &Path, files: &[PathBuf], ui: &UiMetadata, problems: &mut Problems) -> Vec<CustomResourceDefinition> {
    let mut paths: Vec<&PathBuf> = files
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("crd.yaml"))
        })
        .collect();
    paths.sort();
    let mut crds = Vec::new();
    for relative in paths {
        let path = dir.join(relative);
        let Some(documents) = problems.take(parse_documents(&path, "a CustomResourceDefinition")) else {
            continue;
        };
        for document in documents {
            let Some(mut crd) = problems.take(read_crd(&path, &relative.display().to_string(), document)) else {
                continue;
            };
            if problems
                .take(ui.annotate(&mut crd, relative).map_err(UnpackError::Metadata))
                .is_some()
            {
                crds.push(crd);
            }
        }
    }
    crds
}

/// One CRD document, converted to v1 when it is v1beta1.
fn read_crd(path: &Path, relative: &str, document: Value) -> Result<CustomResourceDefinition, UnpackError> {
    if document["kind"] != "CustomResourceDefinition" {
        return Err(UnpackError::NotCrd {
            found: describe(&document),
            path: path.to_path_buf(),
        });
    }
    let (document, converted) = match document["apiVersion"].as_str() {
        Some(crd_v1beta1::V1) => (document, false),
        Some(crd_v1beta1::V1BETA1) => {
            let converted = crd_v1beta1::convert(document).map_err(|source| UnpackError::Conversion {
                path: path.to_path_buf(),
                source,
            })?;
            (converted, true)
        }
        _ => {
            return Err(UnpackError::NotCrd {
                found: describe(&document),
                path: path.to_path_buf(),
            });
        }
    };
    let mut crd: CustomResourceDefinition = serde_json::from_value(document).map_err(|e| UnpackError::Parse {
        path: path.to_path_buf(),
        what: "a CustomResourceDefinition",
        message: e.to_string(),
    })?;
    if converted {
        crd.metadata
            .annotations
            .get_or_insert_default()
            .insert(CONVERTED_FROM_ANNOTATION.into(), relative.to_string());
    }
    Ok(crd)
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

/// The engines Crossplane's templating controller runs.
const TEMPLATING_ENGINES: [&str; 2] = ["kustomize", "helm3"];
/// Where the templating controller finds the package's resources.
const BEHAVIOR_DIR: &str = "/behaviors";

/// Reads behavior.yaml: the kind it reconciles must be one of the package's CRDs, its engine one
/// the templating controller runs, and its source a directory inside the package image.
fn read_behavior(path: &Path, crds: &[CustomResourceDefinition]) -> Result<Behavior, UnpackError> {
    let behavior: Behavior = parse_file(path, "a templating stack's behavior")?;
    let problem = |message: String| UnpackError::Behavior {
        path: path.to_path_buf(),
        message,
    };
    let (group, _) = behavior
        .crd
        .api_version
        .split_once('/')
        .unwrap_or((&behavior.crd.api_version, ""));
    if !crds
        .iter()
        .any(|crd| crd.spec.group == group && crd.spec.names.kind == behavior.crd.kind)
    {
        return Err(problem(format!(
            "crd names {} {}, which is none of the package's CRDs: a templating stack reconciles a kind its package installs",
            behavior.crd.api_version, behavior.crd.kind
        )));
    }
    if !TEMPLATING_ENGINES.contains(&behavior.engine.type_.as_str()) {
        return Err(problem(format!(
            "engine.type is {:?}: the templating controller runs {}",
            behavior.engine.type_,
            TEMPLATING_ENGINES.join(" and ")
        )));
    }
    let source = behavior.source.path.trim_end_matches('/');
    let inside = Path::new(source)
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::RootDir));
    if source.is_empty() || source == "." || !inside {
        return Err(problem(format!(
            "source.path {:?} is not a directory of the package image: name the directory holding the resources, e.g. kustomize",
            behavior.source.path
        )));
    }
    Ok(behavior)
}

/// The controller of a templating stack, as Crossplane's stack manager generated it: an init
/// container of the package image copies the behavior's resources into an emptyDir, where the
/// templating controller reads them; the controller finds its StackDefinition by the `SD_NAMESPACE`
/// and `SD_NAME` the Stack controller sets. The package image needs no `cp`: the copy runs stackd's
/// binary, which a first init container of stackd's image copies for it.
fn templating_deployment(behavior: &Behavior, options: &UnpackOptions) -> ControllerDeployment {
    let controller_image = behavior
        .engine
        .controller_image
        .clone()
        .filter(|image| !image.trim().is_empty())
        .unwrap_or_else(|| options.templating_controller_image.clone());
    let source_image = behavior
        .source
        .image
        .clone()
        .or_else(|| options.package_image.clone())
        .unwrap_or_default();
    let source = behavior.source.path.trim_end_matches('/');
    let spec = serde_json::json!({
        "replicas": 1,
        "selector": {},
        "template": {
            "metadata": {"labels": {"app": "stack-behavior-manager"}},
            "spec": {
                "volumes": [{"name": "behaviors", "emptyDir": {}}, copy::tools_volume()],
                "initContainers": [copy::copy_self_container(&options.stackd_image), {
                    "name": "stack-behavior-copy-to-manager",
                    "image": source_image,
                    "command": copy::copy_command(source, BEHAVIOR_DIR),
                    "volumeMounts": [{"name": "behaviors", "mountPath": BEHAVIOR_DIR}, copy::tools_mount(true)],
                }],
                "containers": [{
                    "name": "stack-behavior-manager",
                    "image": controller_image,
                    "args": ["--resources-dir", BEHAVIOR_DIR,
                             "--stack-definition-namespace", "$(SD_NAMESPACE)",
                             "--stack-definition-name", "$(SD_NAME)"],
                    "volumeMounts": [{"name": "behaviors", "mountPath": BEHAVIOR_DIR}],
                }],
            },
        },
    });
    ControllerDeployment {
        name: "stack-behavior-manager".into(),
        spec,
    }
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
        behavior: None,
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
    use kube::ResourceExt;

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

    fn package(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        dir
    }

    fn unpack_dir(dir: &Path) -> Result<PackageContents, UnpackError> {
        unpack(&UnpackOptions {
            content_dir: dir.to_path_buf(),
            permission_scope: PermissionScope::Namespaced,
            package_image: Some("example.org/stack:v1".into()),
            templating_controller_image: DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
            stackd_image: "stackd:test".into(),
        })
    }

    const V1BETA1_CRD: &str = "apiVersion: apiextensions.k8s.io/v1beta1
kind: CustomResourceDefinition
metadata:
  name: buckets.storage.example.org
spec:
  group: storage.example.org
  names: {kind: Bucket, plural: buckets}
  scope: ''
  version: v1alpha1
  additionalPrinterColumns:
  - {JSONPath: .status.phase, name: PHASE, type: string}
  validation:
    openAPIV3Schema:
      properties:
        spec:
          properties:
            size: {type: integer}
";

    #[test]
    fn v1beta1_crds_in_either_layout_are_converted_and_marked_with_their_file() {
        let dir = package(&[
            ("app.yaml", "title: t\n"),
            ("resources/bucket.crd.yaml", V1BETA1_CRD),
            (
                "resources/queue.example.org/queues.crd.yaml",
                &V1BETA1_CRD
                    .replace("buckets.storage.example.org", "queues.queue.example.org")
                    .replace("storage.example.org", "queue.example.org")
                    .replace("Bucket", "Queue")
                    .replace("buckets", "queues"),
            ),
        ]);
        let contents = unpack_dir(dir.path()).expect("unpacks");
        let converted: Vec<&str> = contents
            .crds
            .iter()
            .map(|crd| crd.annotations()[CONVERTED_FROM_ANNOTATION].as_str())
            .collect();
        assert_eq!(
            converted,
            [
                "resources/bucket.crd.yaml",
                "resources/queue.example.org/queues.crd.yaml"
            ]
        );
        let bucket = &contents.crds[0];
        assert_eq!(bucket.spec.scope, "Namespaced");
        let version = &bucket.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert_eq!(
            version.additional_printer_columns.as_ref().expect("columns")[0].json_path,
            ".status.phase"
        );
        assert_eq!(
            contents.stack.spec.customresourcedefinitions[0].api_version,
            "storage.example.org/v1alpha1"
        );
    }

    #[test]
    fn every_problem_of_a_package_is_reported_at_once() {
        let dir = package(&[
            ("app.yaml", "title: t\npermissionScope: Cluster\n"),
            ("resources/a.crd.yaml", "apiVersion: v1\nkind: ConfigMap\n"),
            (
                "resources/b.crd.yaml",
                "apiVersion: apiextensions.k8s.io/v1beta1\nkind: CustomResourceDefinition\nspec: {group: g.example.org}\n",
            ),
            ("install.yaml", "apiVersion: v1\nkind: Service\n"),
        ]);
        let err = unpack_dir(dir.path()).expect_err("refused");
        let UnpackError::Several { problems, more } = &err else {
            panic!("one problem only: {err}");
        };
        assert_eq!((problems.len(), *more), (4, 0), "{err}");
        let text = err.to_string();
        assert!(text.starts_with("the package has 4 problems:"), "{text}");
        for expected in [
            "permissionScope Cluster",
            "a.crd.yaml holds v1 ConfigMap",
            "b.crd.yaml: the v1beta1",
            "install.yaml must hold",
        ] {
            assert!(text.contains(expected), "{expected} missing from {text}");
        }
        assert_eq!(text.lines().count(), 5, "one line each, for the install's log");
    }

    #[test]
    fn problems_past_the_bound_are_counted_not_listed() {
        let mut files: Vec<(String, String)> = vec![("app.yaml".into(), "title: t\n".into())];
        for i in 0..(MAX_PROBLEMS + 5) {
            files.push((
                format!("resources/{i:02}.crd.yaml"),
                "apiVersion: v1\nkind: ConfigMap\n".into(),
            ));
        }
        let borrowed: Vec<(&str, &str)> = files.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
        let dir = package(&borrowed);
        let text = unpack_dir(dir.path()).expect_err("refused").to_string();
        assert!(
            text.starts_with(&format!("the package has {} problems:", MAX_PROBLEMS + 5)),
            "{text}"
        );
        assert!(text.ends_with("and 5 more: fix these first"), "{text}");
        assert_eq!(text.lines().count(), MAX_PROBLEMS + 2);
    }
}
