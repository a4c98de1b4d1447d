//! Checking an unpacked package against the tenant and applying it there (DESIGN.md §3.2 steps 4–5):
//! everything is checked before anything is written, so a refused package creates nothing.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::PostParams;
use kube::{Api, Resource, ResourceExt};

use crate::api::crds::{SPEC_HASH_ANNOTATION, is_established, spec_hash};
use crate::api::stacks::{PermissionScope, Stack};
use crate::stacks::crd_parent_label;
use crate::stacks::pod_policy::PodPolicy;
use crate::stacks::stack::deployment as stack_deployment;
use crate::stacks::stream::PackageContents;

/// Label on tenant CRDs that a stack install created: only these are ever deleted by stackd.
pub const MANAGED_CRD_LABEL: &str = "stacks.stackd.dev/managed";

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
    #[error("the package's {0}")]
    Controller(stack_deployment::SpecError),
    #[error(
        "the package's CRD {name} would stop serving version(s) {dropped} that the tenant's existing CRD serves; keep those versions in the package (or remove the old CRD by hand)"
    )]
    DropsServedVersion { name: String, dropped: String },
    #[error(
        "the tenant's CRD {0} is being deleted; the install continues once it is gone (remove any remaining custom resources of it)"
    )]
    CrdTerminating(String),
}

impl PackageError {
    pub fn reason(&self) -> &'static str {
        match self {
            PackageError::WrongScope { .. } => "PermissionScopeMismatch",
            PackageError::Controller(err) => err.reason(),
            PackageError::DropsServedVersion { .. } => "CRDConflict",
            PackageError::CrdTerminating(_) => "CRDTerminating",
        }
    }

    /// The tenant's CRDs change without an event this install hears of (a CRD finishing its deletion,
    /// a user fixing one by hand): look again later. The rest needs a new package (an event).
    pub fn retry_later(&self) -> bool {
        matches!(
            self,
            PackageError::CrdTerminating(_) | PackageError::DropsServedVersion { .. }
        )
    }
}

/// Checks a package before anything is written.
pub fn check(
    contents: &PackageContents,
    scope: PermissionScope,
    kind: &str,
    existing_crds: &BTreeMap<String, &CustomResourceDefinition>,
    pass_full_deployment: bool,
    pod_policy: &PodPolicy,
) -> Result<(), PackageError> {
    let found = contents.stack.spec.permission_scope;
    if found != scope {
        return Err(PackageError::WrongScope {
            found: found.as_str(),
            expected: scope.as_str(),
            kind: kind.to_string(),
            other: match found {
                PermissionScope::Cluster => "ClusterStackInstall",
                PermissionScope::Namespaced => "StackInstall",
            },
        });
    }
    if let Some(deployment) = &contents.stack.spec.controller.deployment {
        // The same rules the Stack controller applies, so a refused pod is refused before anything exists.
        let spec = stack_deployment::parse(&deployment.spec).map_err(PackageError::Controller)?;
        if !pass_full_deployment {
            stack_deployment::check_safe(&spec, pod_policy).map_err(PackageError::Controller)?;
        }
    }
    for crd in &contents.crds {
        let name = crd.name_any();
        let Some(existing) = existing_crds.get(&name) else {
            continue;
        };
        if existing.metadata.deletion_timestamp.is_some() {
            return Err(PackageError::CrdTerminating(name));
        }
        let dropped: Vec<String> = served_versions(existing)
            .difference(&served_versions(crd))
            .cloned()
            .collect();
        if !dropped.is_empty() {
            return Err(PackageError::DropsServedVersion {
                name,
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

/// The CRD as stackd wants it on the tenant: the package's, labelled as managed and as used by
/// this stack, keeping the labels of the other stacks that use it.
pub fn desired_crd(
    crd: &CustomResourceDefinition,
    existing: Option<&CustomResourceDefinition>,
    namespace: &str,
    stack: &str,
) -> CustomResourceDefinition {
    let mut desired = CustomResourceDefinition {
        metadata: Default::default(),
        spec: crd.spec.clone(),
        status: None,
    };
    desired.metadata.name = crd.metadata.name.clone();
    let mut labels = crd.metadata.labels.clone().unwrap_or_default();
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
    // A CRD that existed before any stack used it stays unmanaged: stackd never deletes it.
    if existing.is_none_or(|e| e.labels().contains_key(MANAGED_CRD_LABEL)) {
        labels.insert(MANAGED_CRD_LABEL.into(), "true".into());
    }
    labels.insert(crd_parent_label(namespace, stack), "true".into());
    desired.metadata.labels = Some(labels);
    let mut annotations = crd.metadata.annotations.clone().unwrap_or_default();
    annotations.insert(SPEC_HASH_ANNOTATION.into(), spec_hash(crd));
    desired.metadata.annotations = Some(annotations);
    desired
}

/// True when `existing` (a slim cached copy) already is `desired` as far as stackd cares: the
/// spec it wrote (by hash) and every label.
pub fn crd_up_to_date(existing: &CustomResourceDefinition, desired: &CustomResourceDefinition) -> bool {
    let same_spec = existing.annotations().get(SPEC_HASH_ANNOTATION) == desired.annotations().get(SPEC_HASH_ANNOTATION);
    let labels = existing.labels();
    same_spec && desired.labels().iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// What applying the CRDs did.
#[derive(Debug, Default)]
pub struct CrdWrites {
    pub writes: usize,
    /// A CRD was created by someone else between our cache and our create: it does not carry our
    /// label yet, so its events will not wake us; look again soon.
    pub raced: bool,
}

/// Creates or updates the CRDs.
pub async fn apply_crds(
    api: &Api<CustomResourceDefinition>,
    contents: &PackageContents,
    existing_crds: &BTreeMap<String, &CustomResourceDefinition>,
    namespace: &str,
    stack: &str,
) -> Result<CrdWrites, kube::Error> {
    let mut done = CrdWrites::default();
    for crd in &contents.crds {
        let name = crd.name_any();
        let existing = existing_crds.get(&name).copied();
        let desired = desired_crd(crd, existing, namespace, stack);
        match existing {
            None => match api.create(&PostParams::default(), &desired).await {
                Ok(_) => done.writes += 1,
                Err(kube::Error::Api(status)) if status.code == 409 => done.raced = true,
                Err(err) => return Err(err),
            },
            Some(existing) if crd_up_to_date(existing, &desired) => {}
            Some(_) => {
                api.replace(&name, &PostParams::default(), &desired).await?;
                done.writes += 1;
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
/// by the install so it is garbage collected with it.
pub fn desired_stack<K: Resource<DynamicType = ()>>(contents: &PackageContents, install: &K, package: &str) -> Stack {
    let mut stack = Stack::new(&install.name_any(), contents.stack.spec.clone());
    stack.metadata.namespace = install.namespace();
    stack.metadata.labels = contents.stack.metadata.labels.clone();
    stack.metadata.annotations = Some(BTreeMap::from([(
        super::job::PACKAGE_ANNOTATION.to_string(),
        package.to_string(),
    )]));
    stack.metadata.owner_references = Some(vec![owner_reference(install)]);
    stack
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
