//! `stacks.stackd.dev/v1alpha1`: StackInstall, ClusterStackInstall and Stack (DESIGN.md §3.1).
//!
//! The shapes follow Crossplane's v0.10 stack manager; the install is namespaced for both kinds and
//! "Cluster" names the permission scope of the stack being installed.

use std::collections::BTreeMap;

use k8s_openapi::api::rbac::v1::PolicyRule;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, HostObjectRef, LocalObjectReference, conditions_schema, free_form_object_schema};

/// The most `imagePullSecrets` an install (and so its Stack) may name. Each is copied to the tenant's
/// host namespace twice (for the install Job and for the controller Deployment), where all of the
/// tenant's namespaces share one `secrets` quota; a stack pulls its package and its controllers from
/// a registry or two, and 4 leaves room for a mirror and for rotating credentials under a new name.
pub const MAX_IMAGE_PULL_SECRETS: u32 = 4;

/// What to install and how to pull it; shared by StackInstall and ClusterStackInstall.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstallSpec {
    /// The stack package image, e.g. `crossplane/sample-stack:v0.2.0`. It must contain the stack's
    /// `.registry` directory (app.yaml, CRDs, install.yaml).
    #[schemars(length(min = 1))]
    pub package: String,
    /// Registry prepended to an unqualified `package` image, e.g. `registry.example.com`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Kept for compatibility with Crossplane's StackInstall and ignored: stackd pulls every
    /// package and controller image with `Always`, because a node's image cache is shared by all
    /// tenants and any other policy would let one tenant run another's private image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,
    /// Secrets in this namespace used to pull the package and controller images, at most 4. stackd
    /// copies them to the host under names that cannot be guessed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IMAGE_PULL_SECRETS))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Settings for the ServiceAccount the stack's controller runs as: stackd copies them to the
    /// Stack's `controller.serviceAccount`, and its annotations land on that ServiceAccount in this
    /// namespace (stackd's own annotations win over keys of the same name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountOptions>,
}

/// When the kubelet pulls an image.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ImagePullPolicy {
    Always,
    IfNotPresent,
    Never,
}

/// Extra metadata for a ServiceAccount stackd creates.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountOptions {
    /// Annotations added to the ServiceAccount.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Desired state of a StackInstall.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "stacks.stackd.dev",
    version = "v1alpha1",
    kind = "StackInstall",
    namespaced,
    derive = "PartialEq",
    status = "StackInstallStatus",
    shortname = "si",
    category = "stackd",
    doc = "StackInstall installs a namespaced stack: stackd runs its install Job on the host, creates its CRDs and the Stack here, and runs its controller on the host.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Package", type_ = "string", json_path = ".spec.package"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct StackInstallSpec {
    #[serde(flatten)]
    pub install: InstallSpec,
}

/// Desired state of a ClusterStackInstall.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "stacks.stackd.dev",
    version = "v1alpha1",
    kind = "ClusterStackInstall",
    namespaced,
    derive = "PartialEq",
    status = "StackInstallStatus",
    shortname = "csi",
    category = "stackd",
    doc = "ClusterStackInstall installs a stack with cluster-wide permissions; the object itself is namespaced.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Package", type_ = "string", json_path = ".spec.package"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStackInstallSpec {
    #[serde(flatten)]
    pub install: InstallSpec,
}

/// Observed state of a StackInstall or ClusterStackInstall.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StackInstallStatus {
    /// `Ready` says whether the stack is installed and its controller available; `Synced` whether the
    /// last reconcile succeeded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The install Job on the host cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_job: Option<HostObjectRef>,
    /// The Stack this install created, in the same namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_ref: Option<LocalObjectReference>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Desired state of a Stack.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "stacks.stackd.dev",
    version = "v1alpha1",
    kind = "Stack",
    namespaced,
    derive = "PartialEq",
    status = "StackStatus",
    category = "stackd",
    doc = "Stack is an installed stack: its CRDs, the permissions its controller needs, and the controller Deployment stackd runs on the host. StackInstalls and ClusterStackInstalls create Stacks; stackd runs no Stack created by hand.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".spec.version"),
    printcolumn(name = "Scope", type_ = "string", json_path = ".spec.permissionScope"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct StackSpec {
    /// Human-readable name of the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Version of the stack, as its package declares it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Whether the controller's permissions apply to the Stack's namespace only (`Namespaced`) or to
    /// the whole tenant cluster (`Cluster`).
    #[serde(default)]
    pub permission_scope: PermissionScope,
    /// The CRDs this stack owns. Its controller gets full access to them, and users get persona roles
    /// (admin, edit, view) for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub customresourcedefinitions: Vec<CrdReference>,
    /// Permissions the stack's controller needs on the tenant cluster.
    #[serde(default)]
    pub permissions: Permissions,
    /// The stack's controller, which stackd runs on the host cluster.
    #[serde(default)]
    pub controller: ControllerSpec,
    /// A templating stack's behavior (its package's behavior.yaml): the controller is a generic
    /// templating controller that renders the package's resources for every object of the CRD the
    /// behavior names. stackd gives it the behavior in a StackDefinition of the Stack's name, as
    /// Crossplane's stack manager did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behavior: Option<Behavior>,
    /// Package metadata copied from the stack's app.yaml.
    #[serde(flatten)]
    pub metadata: AppMetadata,
}

/// The scope of a stack's permissions.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum PermissionScope {
    #[default]
    Namespaced,
    Cluster,
}

impl PermissionScope {
    pub fn as_str(self) -> &'static str {
        match self {
            PermissionScope::Namespaced => "Namespaced",
            PermissionScope::Cluster => "Cluster",
        }
    }
}

impl std::fmt::Display for PermissionScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PermissionScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Namespaced" => Ok(PermissionScope::Namespaced),
            "Cluster" => Ok(PermissionScope::Cluster),
            other => Err(format!("permission scope must be Namespaced or Cluster, not {other:?}")),
        }
    }
}

/// Identifies a CRD by the apiVersion and kind of the objects it serves.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CrdReference {
    /// `group/version` of the custom resources, e.g. `samples.example.org/v1alpha1`.
    #[schemars(length(min = 1))]
    pub api_version: String,
    /// Kind of the custom resources, e.g. `Widget`.
    #[schemars(length(min = 1))]
    pub kind: String,
}

/// Permissions of a stack's controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Permissions {
    /// RBAC rules granted to the controller's ServiceAccount on the tenant cluster, generated by
    /// stackd from the package's CRDs and dependencies. Rules beyond those API groups, core resources
    /// other than configmaps, events and secrets, and verbs other than get, list, watch, create,
    /// update, patch, delete and deletecollection are refused.
    #[serde(default)]
    pub rules: Vec<PolicyRule>,
}

/// The controller stackd runs on the host cluster for a stack.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControllerSpec {
    /// Settings for the controller's ServiceAccount on the tenant cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountOptions>,
    /// The controller Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<ControllerDeployment>,
    /// Secrets in this namespace used to pull the controller's images: the install's
    /// `imagePullSecrets`, set by the install (at most 4). stackd copies them to the host under names
    /// that cannot be guessed, owned by the controller Deployment, and gives its pods those copies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IMAGE_PULL_SECRETS))]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

/// What a templating stack's controller does (Crossplane's behavior.yaml, v0.8 and later).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Behavior {
    /// The kind the controller reconciles: one of the stack's own CRDs.
    pub crd: CrdReference,
    /// How it renders resources for each object of that kind.
    pub engine: BehaviorEngine,
    /// Where the package image holds the resources it renders.
    pub source: BehaviorSource,
}

/// A templating stack's rendering engine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BehaviorEngine {
    /// `kustomize` or `helm3`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The templating controller's image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_image: Option<String>,
    /// Kustomize overlays and kustomization, passed to the controller as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_object_schema")]
    pub kustomize: Option<serde_json::Value>,
}

/// Where a templating stack's resources are.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BehaviorSource {
    /// The directory in the package image (relative to its root) holding the resources.
    #[schemars(length(min = 1))]
    pub path: String,
    /// The image holding them; the package image when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// A Deployment template for a stack's controller.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControllerDeployment {
    /// Name of the Deployment; informational, the host name is derived from the Stack.
    #[schemars(length(min = 1))]
    pub name: String,
    /// An apps/v1 DeploymentSpec. It is checked when stackd builds the host Deployment rather than by
    /// the API server, because the full schema would make this CRD too large for `kubectl apply`.
    #[schemars(schema_with = "free_form_object_schema")]
    pub spec: serde_json::Value,
}

/// Descriptive package metadata (Crossplane's app.yaml fields).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppMetadata {
    /// One-line summary of the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overview_short: Option<String>,
    /// Longer description of the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overview: Option<String>,
    /// Free-form readme text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readme: Option<String>,
    /// Category, e.g. `Infrastructure`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
    /// Search keywords.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keywords: Vec<String>,
    /// Home page of the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub website: Option<String>,
    /// Where the stack's source lives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// SPDX licence identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub license: Option<String>,
    /// Company or organisation publishing the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub company: Option<String>,
    /// People who maintain the stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub maintainers: Vec<Contributor>,
    /// People who own the stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owners: Vec<Contributor>,
    /// CRDs of other stacks this stack needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depends_on: Vec<Dependency>,
}

/// A person named in a package.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Contributor {
    /// Full name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Email address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub email: Option<String>,
}

/// A CRD another stack provides, written `kind.group/version`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Dependency {
    /// The required CRD as `kind.group/version`, e.g. `widgets.samples.example.org/v1alpha1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crd: Option<String>,
}

/// Observed state of a Stack.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StackStatus {
    /// `Ready` is True when the controller Deployment on the host has an available replica.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The controller Deployment on the host cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_ref: Option<HostObjectRef>,
    /// The copy of the controller's service-account token on the host cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<HostObjectRef>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// What a templating controller reads at its start (Crossplane's StackDefinition, as its templating
/// controller v0.4 reads it): stackd writes one for each templating stack, named and owned by the
/// Stack, in the Stack's namespace. Only stackd writes them.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "packages.crossplane.io",
    version = "v1alpha1",
    kind = "StackDefinition",
    namespaced,
    derive = "PartialEq",
    doc = "StackDefinition tells a templating stack's controller what to render: stackd writes one for each Stack installed from a templating package (behavior.yaml), as Crossplane's stack manager did."
)]
#[serde(rename_all = "camelCase")]
pub struct StackDefinitionSpec {
    /// The Stack's behavior.
    pub behavior: Behavior,
    /// The Stack's permission scope: a `Namespaced` controller watches its namespace only.
    pub permission_scope: PermissionScope,
    /// The Stack's title.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The Stack's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}
