//! Checking an unpacked package against the tenant and applying it there (DESIGN.md §3.2 steps 4–5,
//! §8): everything is checked before anything is written, so a refused package creates nothing.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

pub use super::crd_policy::MANAGED_CRD_LABEL;
use super::crd_policy::{
    self, CREATED_BY_ANNOTATION, CrdOutline, CrdRefusal, CrdRules, INSTALLED_BY_ANNOTATION, Installer,
    PACKAGE_REPOSITORY_ANNOTATION, original_creator, without_stackd_keys,
};
use crate::api::crds::{SPEC_HASH_ANNOTATION, is_established, spec_hash};
use crate::api::stacks::{InstallSpec, PermissionScope, Stack};
use crate::context::pod_policy::PodPolicy;
use crate::context::registries::AllowedRegistries;
use crate::host::labels::{MANAGED_BY, MANAGED_BY_LABEL};
use crate::runtime::api_errors::is_conflict;
use crate::stacks::stack::deployment as stack_deployment;
use crate::stacks::stream::PackageContents;
use crate::stacks::unpack::{CONVERTED_FROM_ANNOTATION, generated_rules};

/// Why a package cannot be applied; the message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error(
        "the package's Stack has permissionScope {found}, but a {kind} installs {expected} stacks; use a {other} for this package"
    )]
    WrongScope {
        found: &'static str,
        expected: &'static str,
        kind: String,
        other: &'static str,
    },
    /// Its message names the stack's controller already.
    #[error(transparent)]
    Controller(stack_deployment::SpecError),
    #[error(
        "the package's CRD {name} would stop serving version(s) {dropped} that the tenant's existing CRD serves; keep those versions in the package (or remove the old CRD by hand)"
    )]
    DropsServedVersion { name: String, dropped: String },
    #[error(
        "the tenant's CRD {0} is being deleted; the install continues once it is gone (remove any remaining custom resources of it)"
    )]
    CrdTerminating(String),
    #[error(transparent)]
    Crd(CrdRefusal),
}

impl PackageError {
    pub fn reason(&self) -> &'static str {
        match self {
            PackageError::WrongScope { .. } => "PermissionScopeMismatch",
            PackageError::Controller(err) => err.reason(),
            PackageError::DropsServedVersion { .. } => "CRDConflict",
            PackageError::CrdTerminating(_) => "CRDTerminating",
            PackageError::Crd(refusal) => refusal.reason(),
        }
    }

    /// The tenant's CRDs change without an event this install hears of (a CRD finishing its deletion,
    /// a user fixing one by hand): look again later. The rest needs a new package (an event).
    pub fn retry_later(&self) -> bool {
        match self {
            PackageError::CrdTerminating(_) | PackageError::DropsServedVersion { .. } => true,
            PackageError::Crd(refusal) => refusal.retry_later(),
            _ => false,
        }
    }
}

/// What a package is checked against wherever it is installed: the install's kind and the
/// daemon's flags.
pub struct PackageRules<'a> {
    pub scope: PermissionScope,
    /// The install's kind, for messages.
    pub kind: &'a str,
    pub pass_full_deployment: bool,
    pub crd_rules: CrdRules<'a>,
    pub pod_policy: &'a PodPolicy,
    pub registries: &'a AllowedRegistries,
    /// The daemon's `--stackd-image`, which registries do not judge.
    pub stackd_image: &'a str,
}

/// Checks what a package is, before anything is written: its scope, its controller, its CRDs'
/// definitions. Nothing the tenant holds changes the outcome, so a refusal stands until the package
/// changes. The first of [`package_problems`].
pub fn check_package(contents: &PackageContents, rules: &PackageRules<'_>) -> Result<(), PackageError> {
    match package_problems(contents, rules).into_iter().next() {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

/// Every reason [`check_package`] has to refuse a package, in the order it judges them (one per
/// check: its scope, its controller's spec, pod and images, each CRD); `stackd package check` lists
/// them all.
pub fn package_problems(contents: &PackageContents, rules: &PackageRules<'_>) -> Vec<PackageError> {
    let mut problems = Vec::new();
    let found = contents.stack.spec.permission_scope;
    if found != rules.scope {
        problems.push(PackageError::WrongScope {
            found: found.as_str(),
            expected: rules.scope.as_str(),
            kind: rules.kind.to_string(),
            other: match found {
                PermissionScope::Cluster => "ClusterStackInstall",
                PermissionScope::Namespaced => "StackInstall",
            },
        });
    }
    if let Some(deployment) = &contents.stack.spec.controller.deployment {
        // The same rules the Stack controller applies, so a refused pod is refused before anything exists.
        match stack_deployment::parse(&deployment.spec) {
            Err(err) => problems.push(PackageError::Controller(err)),
            Ok(spec) => {
                if !rules.pass_full_deployment
                    && let Err(err) = stack_deployment::check_safe(&spec, rules.pod_policy)
                {
                    problems.push(PackageError::Controller(err));
                }
                if let Err(err) = stack_deployment::check_images(&spec, rules.registries, rules.stackd_image) {
                    problems.push(PackageError::Controller(err));
                }
            }
        }
    }
    for crd in &contents.crds {
        if let Err(refusal) = crd_policy::check_definition(crd, &rules.crd_rules) {
            problems.push(PackageError::Crd(refusal));
        }
    }
    problems
}

/// What the checks against the tenant's CRDs need of a package: its CRDs, outlined.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outline {
    pub crds: Vec<CrdOutline>,
}

impl Outline {
    pub fn of(contents: &PackageContents) -> Outline {
        Outline {
            crds: contents.crds.iter().map(CrdOutline::of).collect(),
        }
    }

    /// True when the package has a CRD of this name or in this API group: a change of such a tenant
    /// CRD may change how the package is judged.
    pub fn concerns(&self, name: &str, group: &str) -> bool {
        self.crds.iter().any(|crd| crd.name == name || crd.group == group)
    }
}

/// Checks a package (outlined) against the tenant's CRDs: each must be this package's to share or
/// change, not being deleted, and keep serving what the tenant's serves. The outcome changes with
/// the tenant's CRDs.
pub fn check_tenant(
    outline: &Outline,
    existing_crds: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
) -> Result<(), PackageError> {
    for crd in &outline.crds {
        crd_policy::check_against(crd, existing_crds, installer).map_err(PackageError::Crd)?;
    }
    for crd in &outline.crds {
        let Some(existing) = existing_crds.get(&crd.name) else {
            continue;
        };
        if existing.metadata.deletion_timestamp.is_some() {
            return Err(PackageError::CrdTerminating(crd.name.clone()));
        }
        let dropped: Vec<String> = served_versions(existing).difference(&crd.served).cloned().collect();
        if !dropped.is_empty() {
            return Err(PackageError::DropsServedVersion {
                name: crd.name.clone(),
                dropped: dropped.join(", "),
            });
        }
    }
    Ok(())
}

fn served_versions(crd: &CustomResourceDefinition) -> BTreeSet<String> {
    crd.spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| v.name.clone())
        .collect()
}

/// The CRD as stackd wants it on the tenant: the package's (without keys in stackd's domain), marked
/// as managed, as the package's, and as used by this install's stack, keeping the labels of the
/// other stacks of the package that use it and the name of the install that created it.
pub fn desired_crd(
    crd: &CustomResourceDefinition,
    existing: Option<&CustomResourceDefinition>,
    installer: &Installer,
) -> CustomResourceDefinition {
    let mut desired = CustomResourceDefinition {
        metadata: Default::default(),
        spec: crd.spec.clone(),
        status: None,
    };
    desired.metadata.name = crd.metadata.name.clone();
    let mut labels = without_stackd_keys(crd.metadata.labels.as_ref());
    if let Some(existing) = existing {
        labels.extend(
            existing
                .labels()
                .iter()
                .filter(|(k, _)| k.starts_with(crate::stacks::CRD_PARENT_LABEL_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        desired.metadata.uid = existing.metadata.uid.clone();
        desired.metadata.resource_version = existing.metadata.resource_version.clone();
    }
    labels.insert(MANAGED_CRD_LABEL.into(), "true".into());
    labels.insert(installer.parent_label(), "true".into());
    desired.metadata.labels = Some(labels);
    let mut annotations = without_stackd_keys(crd.metadata.annotations.as_ref());
    // Written by stackd's own unpack, not the package: kept for whoever reads the CRD.
    if let Some(file) = crd.annotations().get(CONVERTED_FROM_ANNOTATION) {
        annotations.insert(CONVERTED_FROM_ANNOTATION.into(), file.clone());
    }
    annotations.insert(SPEC_HASH_ANNOTATION.into(), spec_hash(crd));
    annotations.insert(PACKAGE_REPOSITORY_ANNOTATION.into(), installer.repository.clone());
    // The creator changes the CRD; once it is gone, the one install still using it takes its place.
    let created_by = existing
        .filter(|e| !installer.only_user_of(e))
        .and_then(|e| e.annotations().get(INSTALLED_BY_ANNOTATION).cloned())
        .unwrap_or_else(|| installer.annotation());
    annotations.insert(INSTALLED_BY_ANNOTATION.into(), created_by);
    let original = existing
        .and_then(original_creator)
        .cloned()
        .unwrap_or_else(|| installer.annotation());
    annotations.insert(CREATED_BY_ANNOTATION.into(), original);
    desired.metadata.annotations = Some(annotations);
    desired
}

/// The package's files whose CRDs `stackd unpack` converted from v1beta1.
pub fn converted_files(contents: &PackageContents) -> Vec<&str> {
    contents
        .crds
        .iter()
        .filter_map(|crd| crd.annotations().get(CONVERTED_FROM_ANNOTATION))
        .map(String::as_str)
        .collect()
}

/// True when `existing` (a slim cached copy) already is `desired` as far as stackd cares: the
/// spec it wrote (by hash), its owner, and every label.
pub fn crd_up_to_date(existing: &CustomResourceDefinition, desired: &CustomResourceDefinition) -> bool {
    same_definition_and_owner(existing, desired) && missing_labels(existing, desired).is_empty()
}

/// The same spec (by its hash) and the same package and installer recorded.
fn same_definition_and_owner(existing: &CustomResourceDefinition, desired: &CustomResourceDefinition) -> bool {
    let annotation = |crd: &CustomResourceDefinition, key: &str| crd.annotations().get(key).cloned();
    let same_spec = annotation(existing, SPEC_HASH_ANNOTATION) == annotation(desired, SPEC_HASH_ANNOTATION);
    let same_owner = annotation(existing, PACKAGE_REPOSITORY_ANNOTATION)
        == annotation(desired, PACKAGE_REPOSITORY_ANNOTATION)
        && annotation(existing, INSTALLED_BY_ANNOTATION) == annotation(desired, INSTALLED_BY_ANNOTATION);
    same_spec && same_owner
}

/// The labels `desired` has and `existing` has not (or with another value).
fn missing_labels(existing: &CustomResourceDefinition, desired: &CustomResourceDefinition) -> BTreeMap<String, String> {
    let labels = existing.labels();
    desired
        .labels()
        .iter()
        .filter(|(k, v)| labels.get(*k) != Some(*v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// What applying the CRDs did.
#[derive(Debug, Default)]
pub struct CrdWrites {
    pub writes: usize,
    /// A CRD was created by someone else between our cache and our create: it does not carry our
    /// label yet, so its events will not wake us; look again soon.
    pub raced: bool,
    /// Of the writes, those that created a CRD or changed its definition: the API server must
    /// establish it (again) before the Stack may use it. The rest only relabelled it.
    pub definitions: usize,
}

/// Creates or updates the CRDs.
pub async fn apply_crds(
    api: &Api<CustomResourceDefinition>,
    contents: &PackageContents,
    existing_crds: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
) -> Result<CrdWrites, kube::Error> {
    let mut done = CrdWrites::default();
    for crd in &contents.crds {
        let name = crd.name_any();
        let existing = existing_crds.get(&name).copied();
        let desired = desired_crd(crd, existing, installer);
        match existing {
            None => match api.create(&PostParams::default(), &desired).await {
                Ok(_) => {
                    done.writes += 1;
                    done.definitions += 1;
                }
                Err(err) if is_conflict(&err) => done.raced = true,
                Err(err) => return Err(err),
            },
            Some(existing) if crd_up_to_date(existing, &desired) => {}
            // Another install of the package made it: only this stack's label (and any other
            // missing one) to add, by a merge patch, which the other installs adding theirs at the
            // same time cannot make conflict as a replace of the version cached would.
            Some(existing) if same_definition_and_owner(existing, &desired) => {
                let labels = json!({"metadata": {"labels": missing_labels(existing, &desired)}});
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&labels))
                    .await?;
                done.writes += 1;
            }
            Some(existing) => {
                api.replace(&name, &PostParams::default(), &desired).await?;
                done.writes += 1;
                if existing.annotations().get(SPEC_HASH_ANNOTATION) != desired.annotations().get(SPEC_HASH_ANNOTATION) {
                    done.definitions += 1;
                }
            }
        }
    }
    Ok(done)
}

/// CRD names of the package that are not yet Established on the tenant.
pub fn not_established(
    contents: &PackageContents,
    existing_crds: &BTreeMap<String, &CustomResourceDefinition>,
) -> Vec<String> {
    contents
        .crds
        .iter()
        .map(|crd| crd.name_any())
        .filter(|name| !existing_crds.get(name).is_some_and(|crd| is_established(crd)))
        .collect()
}

/// The Stack as the install wants it: the package's, at the install's namespace and name, controlled
/// by the install so it is garbage collected with it and so the Stack controller knows it is real,
/// and carrying the Stack controller's finalizer.
/// Its permissions are generated here, from the package's CRDs and dependencies, whatever the stream
/// says; its controller's ServiceAccount gets the install's `serviceAccount` settings and its pods the
/// install's `imagePullSecrets` (never the package's: a package names no tenant Secret).
pub fn desired_stack<K: Resource<DynamicType = ()>>(
    contents: &PackageContents,
    install: &K,
    spec: &InstallSpec,
    package: &str,
) -> Stack {
    let mut stack_spec = contents.stack.spec.clone();
    stack_spec.permissions.rules = generated_rules(&contents.crds, &stack_spec.metadata.depends_on);
    stack_spec.controller.service_account = spec.service_account.clone();
    stack_spec.controller.image_pull_secrets = spec.image_pull_secrets.clone();
    let mut stack = Stack::new(&install.name_any(), stack_spec);
    stack.metadata.namespace = install.namespace();
    let mut labels = without_stackd_keys(contents.stack.metadata.labels.as_ref());
    labels.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    stack.metadata.labels = Some(labels);
    stack.metadata.annotations = Some(BTreeMap::from([(
        super::job::PACKAGE_ANNOTATION.to_string(),
        package.to_string(),
    )]));
    stack.metadata.owner_references = Some(vec![owner_reference(install)]);
    // Born with the Stack controller's finalizer: that controller adds it first thing anyway, and
    // a Stack created with it saves every install that patch (and its races with a stale cache).
    stack.metadata.finalizers = Some(vec![crate::stacks::STACK_FINALIZER.to_string()]);
    stack
}

/// True when a Stack is this install's package applied: controlled by the install (`uid`), made
/// from `package`, with stackd's label.
pub fn stack_applied(stack: &Stack, uid: &str, package: &str) -> bool {
    controlled_by(stack, uid)
        && stack
            .annotations()
            .get(super::job::PACKAGE_ANNOTATION)
            .map(String::as_str)
            == Some(package)
        && stack.labels().get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
}

/// True when a Stack already carries what the install sets without reading the package again: its
/// package applied ([`stack_applied`]) and the install's service-account and pull-secret settings.
pub fn stack_current(stack: &Stack, uid: &str, spec: &InstallSpec, package: &str) -> bool {
    stack_applied(stack, uid, package)
        && stack.spec.controller.service_account == spec.service_account
        && stack.spec.controller.image_pull_secrets == spec.image_pull_secrets
}

/// A controller owner reference to `owner`.
pub fn owner_reference<K: Resource<DynamicType = ()>>(owner: &K) -> OwnerReference {
    OwnerReference {
        api_version: K::api_version(&()).into_owned(),
        kind: K::kind(&()).into_owned(),
        name: owner.name_any(),
        uid: owner.meta().uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// True when `stack` is controlled by the object with `uid`.
pub fn controlled_by(stack: &Stack, uid: &str) -> bool {
    stack
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}
