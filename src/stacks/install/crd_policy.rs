//! Which CRDs a package may create or change on the tenant (DESIGN.md §8): only CRDs in API groups
//! no other package uses, never in stackd's or Kubernetes' groups, never a CRD stackd did not create,
//! and no conversion webhooks unless the daemon allows them.
//!
//! A CRD's API group belongs to the package (image repository, registry included) whose install
//! created it: installs of that same package in other namespaces share its CRDs, as Crossplane's
//! namespaced stacks did (each adds its Stack's parent label). Only the install that created a CRD
//! changes it, though (or, once its creator is gone, the one install still using it): another
//! namespace's install of the package — at another version, say — shares it only as it is, so no
//! user of one namespace can change what another namespace's stack relies on. stackd's managed
//! label and its package and installer annotations prove all this; a package cannot forge them,
//! because stackd drops every key in its own domain from what a package ships.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;

use crate::api::crds::{SPEC_HASH_ANNOTATION, spec_hash};
use crate::context::crd_groups::CrdGroups;
use crate::stacks::{CRD_PARENT_LABEL_PREFIX, crd_parent_label, reserved_group_owner};

/// Label on tenant CRDs that a stack install created: only these are ever changed or deleted by stackd.
pub const MANAGED_CRD_LABEL: &str = "stacks.stackd.dev/managed";
/// Annotation on tenant CRDs: the package (image repository) they belong to.
pub const PACKAGE_REPOSITORY_ANNOTATION: &str = "stacks.stackd.dev/package-repository";
/// Annotation on tenant CRDs: the install that created them, `<kind>/<namespace>/<name>`, for people.
pub const INSTALLED_BY_ANNOTATION: &str = "stacks.stackd.dev/installed-by";

/// The install applying a package.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installer {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    /// The package image's repository (registry and path, no tag or digest).
    pub repository: String,
}

impl Installer {
    /// The value of [`INSTALLED_BY_ANNOTATION`] on the CRDs this install creates.
    pub fn annotation(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }

    /// The parent label of the Stack this install creates.
    pub fn parent_label(&self) -> String {
        crd_parent_label(&self.namespace, &self.name)
    }

    /// True when this install may write `crd`: stackd made it for this install's package, or this
    /// install's Stack is the only one using it (an install whose package moved to another
    /// repository, or a CRD from before CRDs named their package). A CRD without its package is
    /// never adopted while another Stack uses it: that Stack's install may be of another package, and
    /// whoever can edit this install could point it at their own image and rewrite the CRD.
    pub fn owns(&self, crd: &CustomResourceDefinition) -> bool {
        if !crd.labels().contains_key(MANAGED_CRD_LABEL) {
            return false;
        }
        let same_package = crd
            .annotations()
            .get(PACKAGE_REPOSITORY_ANNOTATION)
            .is_some_and(|repository| *repository == self.repository);
        same_package || self.only_user_of(crd)
    }

    /// True when this install may change `crd`'s definition: stackd created it for this install, or
    /// this install's Stack is the only one using it (its creator is gone).
    pub fn may_change(&self, crd: &CustomResourceDefinition) -> bool {
        let created_here = crd
            .annotations()
            .get(INSTALLED_BY_ANNOTATION)
            .is_some_and(|creator| *creator == self.annotation());
        crd.labels().contains_key(MANAGED_CRD_LABEL) && (created_here || self.only_user_of(crd))
    }

    /// True when this install's Stack is the only one using `crd`.
    pub fn only_user_of(&self, crd: &CustomResourceDefinition) -> bool {
        let own = self.parent_label();
        let mut parents = crd
            .labels()
            .keys()
            .filter(|key| key.starts_with(CRD_PARENT_LABEL_PREFIX));
        parents.next() == Some(&own) && parents.next().is_none()
    }
}

/// The repository of an image reference: without digest and tag.
pub fn repository_of(image: &str) -> String {
    let without_digest = image.split('@').next().unwrap_or(image);
    match without_digest.rsplit_once('/') {
        Some((path, last)) => format!("{path}/{}", last.split(':').next().unwrap_or(last)),
        None => without_digest.split(':').next().unwrap_or(without_digest).to_string(),
    }
}

/// Why a package's CRD is refused; the message says what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CrdRefusal {
    #[error(
        "the package's CRD {name} is in API group {group}, which belongs to {owner}; packages may not create CRDs there: move the CRD to an API group of your own"
    )]
    ReservedGroup {
        name: String,
        group: String,
        owner: &'static str,
    },
    #[error(
        "the package's CRD {name} already exists on the tenant and {owner}; stackd never lets a package change a CRD it did not create for that package: remove the CRD from the package, or rename it into an API group of your own"
    )]
    NotOurs { name: String, owner: String },
    #[error(
        "the package's CRD {name} differs from the one on the tenant, which {owner} and other installs use too; only the install that created a CRD changes it, so that no namespace changes what another's stack relies on: install the package at the version that install runs, or have it upgraded first"
    )]
    SharedChange { name: String, owner: String },
    #[error(
        "the package's CRD {name} is in API group {group}, where CRD {existing} already exists and {owner}; a package may create CRDs only in API groups no one else uses: move the CRD to an API group of your own"
    )]
    GroupTaken {
        name: String,
        group: String,
        existing: String,
        owner: String,
    },
    #[error(
        "the package's CRD {name} asks for a conversion webhook (spec.conversion.strategy: Webhook), which would let the package's service rewrite every {name} object the tenant API server serves; stackd refuses it unless the daemon runs with --insecure-allow-conversion-webhooks"
    )]
    ConversionWebhook { name: String },
    #[error(
        "the package's CRD {name} is in API group {group}, which the daemon does not let packages use (--stack-crd-groups {allowed}): move the CRD to an allowed API group, or ask the host's operators to allow this one"
    )]
    GroupNotAllowed {
        name: String,
        group: String,
        allowed: String,
    },
}

impl CrdRefusal {
    pub fn reason(&self) -> &'static str {
        match self {
            CrdRefusal::ReservedGroup { .. } | CrdRefusal::GroupNotAllowed { .. } => "CRDGroupReserved",
            CrdRefusal::NotOurs { .. } | CrdRefusal::GroupTaken { .. } | CrdRefusal::SharedChange { .. } => {
                "CRDConflict"
            }
            CrdRefusal::ConversionWebhook { .. } => "ConversionWebhookRefused",
        }
    }

    /// Ownership changes when the other install goes away: worth looking again then. A reserved group
    /// or a webhook needs another package.
    pub fn retry_later(&self) -> bool {
        matches!(
            self,
            CrdRefusal::NotOurs { .. } | CrdRefusal::GroupTaken { .. } | CrdRefusal::SharedChange { .. }
        )
    }
}

/// What the daemon's flags allow packages' CRDs.
#[derive(Clone, Copy, Debug)]
pub struct CrdRules<'a> {
    /// `--stack-crd-groups`.
    pub groups: &'a CrdGroups,
    /// `--insecure-allow-conversion-webhooks`.
    pub allow_conversion_webhooks: bool,
}

/// Checks one package CRD against the tenant's CRDs (by name).
pub fn check(
    crd: &CustomResourceDefinition,
    existing: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
    rules: &CrdRules<'_>,
) -> Result<(), CrdRefusal> {
    let name = crd.name_any();
    let group = &crd.spec.group;
    if let Some(owner) = reserved_group_owner(group) {
        return Err(CrdRefusal::ReservedGroup {
            name,
            group: group.clone(),
            owner,
        });
    }
    if !rules.groups.allows(group) {
        return Err(CrdRefusal::GroupNotAllowed {
            name,
            group: group.clone(),
            allowed: rules.groups.to_string(),
        });
    }
    if let Some(current) = existing.get(&name) {
        if !installer.owns(current) {
            return Err(CrdRefusal::NotOurs {
                owner: describe_owner(current),
                name,
            });
        }
        let unchanged = current.annotations().get(SPEC_HASH_ANNOTATION) == Some(&spec_hash(crd));
        if !unchanged && !installer.may_change(current) {
            return Err(CrdRefusal::SharedChange {
                owner: describe_owner(current),
                name,
            });
        }
    }
    let taken = existing
        .values()
        .find(|other| other.spec.group == *group && !installer.owns(other));
    if let Some(other) = taken {
        return Err(CrdRefusal::GroupTaken {
            name,
            group: group.clone(),
            existing: other.name_any(),
            owner: describe_owner(other),
        });
    }
    if !rules.allow_conversion_webhooks && asks_for_conversion_webhook(crd) {
        return Err(CrdRefusal::ConversionWebhook { name });
    }
    Ok(())
}

fn asks_for_conversion_webhook(crd: &CustomResourceDefinition) -> bool {
    crd.spec
        .conversion
        .as_ref()
        .is_some_and(|c| c.strategy == "Webhook" || c.webhook.is_some())
}

/// Who a CRD belongs to, for a message.
fn describe_owner(crd: &CustomResourceDefinition) -> String {
    if !crd.labels().contains_key(MANAGED_CRD_LABEL) {
        return "was not created by stackd".into();
    }
    let annotations = crd.annotations();
    let package = annotations
        .get(PACKAGE_REPOSITORY_ANNOTATION)
        .map(|repository| format!("belongs to the package {repository}"))
        .unwrap_or_else(|| "belongs to another stack".into());
    match annotations
        .get(INSTALLED_BY_ANNOTATION)
        .and_then(|owner| owner.split_once('/'))
    {
        Some((kind, at)) => format!("{package}, installed by the {kind} {at}"),
        None => package,
    }
}

/// The labels and annotations of `keys` a package may set: none in stackd's domain.
pub fn without_stackd_keys(keys: Option<&BTreeMap<String, String>>) -> BTreeMap<String, String> {
    keys.into_iter()
        .flatten()
        .filter(|(key, _)| !crate::stacks::is_stackd_key(key))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn installer(namespace: &str, name: &str) -> Installer {
        Installer {
            kind: "StackInstall".into(),
            namespace: namespace.into(),
            name: name.into(),
            repository: format!("registry.example.com/{namespace}/stack"),
        }
    }

    fn crd(name: &str, group: &str) -> CustomResourceDefinition {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "group": group,
                "names": {"kind": "Thing", "plural": name.split('.').next().unwrap_or_default()},
                "scope": "Namespaced",
                "versions": [{"name": "v1", "served": true, "storage": true}],
            }
        }))
        .expect("crd")
    }

    fn made_by(mut crd: CustomResourceDefinition, installer: &Installer) -> CustomResourceDefinition {
        crd.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (installer.parent_label(), "true".to_string()),
        ]));
        crd.metadata.annotations = Some(BTreeMap::from([
            (INSTALLED_BY_ANNOTATION.to_string(), installer.annotation()),
            (PACKAGE_REPOSITORY_ANNOTATION.to_string(), installer.repository.clone()),
            (SPEC_HASH_ANNOTATION.to_string(), spec_hash(&crd)),
        ]));
        crd
    }

    fn rules(allow_conversion_webhooks: bool) -> CrdRules<'static> {
        static ANY: std::sync::LazyLock<CrdGroups> = std::sync::LazyLock::new(CrdGroups::default);
        CrdRules {
            groups: &ANY,
            allow_conversion_webhooks,
        }
    }

    fn check_against(
        package: &CustomResourceDefinition,
        tenant: &[CustomResourceDefinition],
    ) -> Result<(), CrdRefusal> {
        let existing = tenant.iter().map(|c| (c.name_any(), c)).collect();
        check(package, &existing, &installer("team-a", "sample"), &rules(false))
    }

    #[test]
    fn a_new_crd_in_a_free_group_and_the_installs_own_crd_pass() {
        let package = crd("widgets.samples.example.org", "samples.example.org");
        assert_eq!(check_against(&package, &[]), Ok(()));
        let own = made_by(package.clone(), &installer("team-a", "sample"));
        let sibling = made_by(
            crd("gizmos.samples.example.org", "samples.example.org"),
            &installer("team-a", "sample"),
        );
        assert_eq!(check_against(&package, &[own, sibling]), Ok(()));
    }

    #[test]
    fn stackd_and_kubernetes_groups_are_refused() {
        let own = crd("clusterstackinstalls.stacks.stackd.dev", "stacks.stackd.dev");
        let refusal = check_against(&own, &[]).expect_err("refused");
        assert_eq!(refusal.reason(), "CRDGroupReserved");
        assert!(refusal.to_string().contains("stackd"), "{refusal}");
        let k8s = crd("things.apps.k8s.io", "apps.k8s.io");
        assert_eq!(
            check_against(&k8s, &[]).expect_err("refused").reason(),
            "CRDGroupReserved"
        );
    }

    #[test]
    fn another_installs_crd_or_group_is_refused() {
        let theirs = made_by(
            crd("widgets.samples.example.org", "samples.example.org"),
            &installer("team-b", "sample"),
        );
        let same = crd("widgets.samples.example.org", "samples.example.org");
        let refusal = check_against(&same, std::slice::from_ref(&theirs)).expect_err("refused");
        assert_eq!(refusal.reason(), "CRDConflict");
        assert!(refusal.to_string().contains("StackInstall team-b/sample"), "{refusal}");
        let squatter = crd("sprockets.samples.example.org", "samples.example.org");
        let refusal = check_against(&squatter, &[theirs]).expect_err("refused");
        assert!(
            matches!(&refusal, CrdRefusal::GroupTaken { existing, .. } if existing == "widgets.samples.example.org"),
            "{refusal:?}"
        );
    }

    #[test]
    fn a_crd_stackd_did_not_create_is_refused_even_when_unchanged() {
        let foreign = crd("certificates.cert-manager.io", "cert-manager.io");
        let refusal = check_against(&foreign, std::slice::from_ref(&foreign)).expect_err("refused");
        assert!(refusal.to_string().contains("was not created by stackd"), "{refusal}");
        // A package annotation without stackd's managed label proves nothing.
        let mut forged = foreign.clone();
        forged.metadata.annotations = Some(BTreeMap::from([(
            PACKAGE_REPOSITORY_ANNOTATION.to_string(),
            installer("team-a", "sample").repository,
        )]));
        assert!(check_against(&foreign, &[forged]).is_err());
    }

    #[test]
    fn installs_of_the_same_package_share_its_crds() {
        let elsewhere = Installer {
            namespace: "team-b".into(),
            name: "widgets".into(),
            ..installer("team-a", "sample")
        };
        let shared = made_by(
            crd("widgets.samples.example.org", "samples.example.org"),
            &installer("team-a", "sample"),
        );
        assert!(elsewhere.owns(&shared));
        let sprockets = crd("sprockets.samples.example.org", "samples.example.org");
        let existing = BTreeMap::from([(shared.name_any(), &shared)]);
        assert_eq!(check(&sprockets, &existing, &elsewhere, &rules(false)), Ok(()));
    }

    #[test]
    fn only_the_creating_install_changes_a_shared_crd_the_others_take_it_as_it_is() {
        let creator = installer("team-a", "sample");
        let elsewhere = Installer {
            namespace: "team-b".into(),
            ..creator.clone()
        };
        let mut shared = made_by(crd("widgets.samples.example.org", "samples.example.org"), &creator);
        shared
            .metadata
            .labels
            .get_or_insert_default()
            .insert(elsewhere.parent_label(), "true".into());
        let existing = BTreeMap::from([(shared.name_any(), &shared)]);
        let same = crd("widgets.samples.example.org", "samples.example.org");
        assert_eq!(
            check(&same, &existing, &elsewhere, &rules(false)),
            Ok(()),
            "joins as it is"
        );
        let mut other_version = same.clone();
        other_version.spec.versions[0].name = "v2".into();
        let refusal = check(&other_version, &existing, &elsewhere, &rules(false)).expect_err("refused");
        assert!(matches!(refusal, CrdRefusal::SharedChange { .. }), "{refusal:?}");
        assert_eq!(refusal.reason(), "CRDConflict");
        assert!(refusal.to_string().contains("StackInstall team-a/sample"), "{refusal}");
        assert_eq!(
            check(&other_version, &existing, &creator, &rules(false)),
            Ok(()),
            "the creator upgrades"
        );
        // Once the creator's Stack is gone, the one install still using it may change it.
        let mut left = shared.clone();
        left.metadata
            .labels
            .get_or_insert_default()
            .remove(&creator.parent_label());
        let existing = BTreeMap::from([(left.name_any(), &left)]);
        assert_eq!(check(&other_version, &existing, &elsewhere, &rules(false)), Ok(()));
    }

    #[test]
    fn repositories_drop_tag_and_digest_but_keep_the_registry() {
        assert_eq!(repository_of("quay.io/acme/widgets:v1"), "quay.io/acme/widgets");
        assert_eq!(
            repository_of("localhost:5000/widgets@sha256:abc"),
            "localhost:5000/widgets"
        );
        assert_eq!(repository_of("widgets:v1"), "widgets");
        assert_eq!(repository_of("acme/widgets"), "acme/widgets");
    }

    #[test]
    fn without_the_package_a_crd_is_ours_only_while_our_stack_alone_uses_it() {
        let me = installer("team-a", "sample");
        let mut legacy = crd("widgets.samples.example.org", "samples.example.org");
        let stranger = installer("team-c", "x");
        legacy.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (me.parent_label(), "true".to_string()),
        ]));
        assert!(me.owns(&legacy));
        assert!(!stranger.owns(&legacy), "never used it");
        // From before CRDs named their package and shared with team-b's Stack: whoever edits one of
        // the two installs could switch its package and rewrite the other's CRD, so neither adopts it.
        legacy
            .metadata
            .labels
            .get_or_insert_default()
            .insert(crd_parent_label("team-b", "sample"), "true".into());
        assert!(!me.owns(&legacy), "shared with team-b, package unknown");
        assert!(
            !installer("team-b", "sample").owns(&legacy),
            "shared with team-a, package unknown"
        );
        let mut other_package = legacy.clone();
        other_package.metadata.annotations = Some(BTreeMap::from([(
            PACKAGE_REPOSITORY_ANNOTATION.to_string(),
            "quay.io/someone/else".to_string(),
        )]));
        assert!(!me.owns(&other_package), "shared with team-b, of another package");
        other_package.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (me.parent_label(), "true".to_string()),
        ]));
        assert!(me.owns(&other_package), "used by this install alone");
    }

    #[test]
    fn conversion_webhooks_are_refused_unless_allowed() {
        let mut hooked = crd("widgets.samples.example.org", "samples.example.org");
        hooked.spec.conversion = serde_json::from_value(serde_json::json!({
            "strategy": "Webhook",
            "webhook": {"conversionReviewVersions": ["v1"], "clientConfig": {"url": "https://evil.example/convert"}}
        }))
        .expect("conversion");
        let refusal = check_against(&hooked, &[]).expect_err("refused");
        assert_eq!(refusal.reason(), "ConversionWebhookRefused");
        assert!(refusal.to_string().contains("--insecure-allow-conversion-webhooks"));
        let existing = BTreeMap::new();
        assert_eq!(
            check(&hooked, &existing, &installer("team-a", "sample"), &rules(true)),
            Ok(())
        );
    }

    #[test]
    fn stackd_keys_are_dropped_from_package_metadata() {
        let keys = BTreeMap::from([
            ("app".to_string(), "widgets".to_string()),
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (crd_parent_label("team-b", "x"), "true".to_string()),
            (PACKAGE_REPOSITORY_ANNOTATION.to_string(), "quay.io/x".to_string()),
        ]);
        let kept = without_stackd_keys(Some(&keys));
        assert_eq!(kept.keys().collect::<Vec<_>>(), ["app"]);
    }
}
