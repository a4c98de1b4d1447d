//! Which CRDs a package may create or change on the tenant (DESIGN.md §8): only CRDs in API groups
//! no other package uses, never in stackd's or Kubernetes' groups, never a CRD stackd did not create,
//! and no conversion webhooks unless the daemon allows them.
//!
//! A CRD's API group belongs to the package (image repository, registry included) whose install
//! created it: installs of that same package in other namespaces share its CRDs, as Crossplane's
//! namespaced stacks did (each adds its Stack's parent label). Only the install that created a CRD
//! changes it, though: another namespace's install of the package — at another version, say —
//! shares it only as it is, so no user of one namespace can change what another namespace's stack
//! relies on. stackd's managed label and its package and installer annotations prove all this; a
//! package cannot forge them, because stackd drops every key in its own domain from what a package
//! ships.
//!
//! **Handoff.** When the creator's Stack goes and one install still uses the CRD, that install
//! takes its place (so the CRD can still be upgraded without deleting it, and its objects), but
//! only within the CRD's package. A CRD moves to another package (an image repository rename) only
//! with the install that created it in the first place, recorded at creation and never handed on,
//! and only while no other stack uses it. Otherwise whoever joined a shared CRD from another
//! namespace could wait for its creator to leave, point their install at an image of their own and
//! rewrite the CRD, then add CRDs of their choosing to its API group. Within one package, taking over
//! costs nothing anyone relied on: the new holder can only choose among the package's own versions,
//! exactly as if it had installed the package first.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;

use crate::api::crds::{SPEC_HASH_ANNOTATION, spec_hash};
use crate::context::crd_groups::CrdGroups;
pub use crate::stacks::MANAGED_CRD_LABEL;
use crate::stacks::{CRD_PARENT_LABEL_PREFIX, crd_parent_label, reserved_group_owner};

/// Annotation on tenant CRDs: the package (image repository) they belong to.
pub const PACKAGE_REPOSITORY_ANNOTATION: &str = "stacks.stackd.dev/package-repository";
/// Annotation on tenant CRDs: the install that changes them, `<kind>/<namespace>/<name>`: the one that
/// created them, or the one they were handed on to.
pub const INSTALLED_BY_ANNOTATION: &str = "stacks.stackd.dev/installed-by";
/// Annotation on tenant CRDs: the install that created them, set once (CRDs from before it fall back
/// to [`INSTALLED_BY_ANNOTATION`]); only it moves a CRD to another package.
pub const CREATED_BY_ANNOTATION: &str = "stacks.stackd.dev/created-by";

/// The install that created `crd`, `<kind>/<namespace>/<name>`.
pub fn original_creator(crd: &CustomResourceDefinition) -> Option<&String> {
    let annotations = crd.annotations();
    annotations
        .get(CREATED_BY_ANNOTATION)
        .or_else(|| annotations.get(INSTALLED_BY_ANNOTATION))
}

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

    /// True when this install may write `crd`: stackd made it for this install's package; or this
    /// install created it and its Stack alone uses it (the install moved to another repository); or
    /// it is a CRD from before CRDs named their package and this install's Stack alone uses it. A CRD
    /// of another package is never adopted by an install that joined it (see the handoff rule in the
    /// module doc), and a CRD without its package never while another Stack uses it: that Stack's
    /// install may be of another package.
    pub fn owns(&self, crd: &CustomResourceDefinition) -> bool {
        if !crd.labels().contains_key(MANAGED_CRD_LABEL) {
            return false;
        }
        match crd.annotations().get(PACKAGE_REPOSITORY_ANNOTATION) {
            Some(repository) if *repository == self.repository => true,
            Some(_) => self.only_user_of(crd) && original_creator(crd) == Some(&self.annotation()),
            None => self.only_user_of(crd),
        }
    }

    /// True when this install may change `crd`'s definition: stackd created it for this install, or
    /// it is this install's package's and this install's Stack is the only one using it (its creator
    /// is gone).
    pub fn may_change(&self, crd: &CustomResourceDefinition) -> bool {
        let created_here = crd
            .annotations()
            .get(INSTALLED_BY_ANNOTATION)
            .is_some_and(|creator| *creator == self.annotation());
        self.owns(crd) && (created_here || self.only_user_of(crd))
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

/// What of a package's CRD the checks against the tenant's CRDs need: kept for a refused package
/// instead of the CRD, so that it can be judged again when the tenant's CRDs change without reading
/// the package again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrdOutline {
    pub name: String,
    pub group: String,
    /// [`spec_hash`] of the package's CRD.
    pub spec_hash: String,
    /// The versions it serves.
    pub served: BTreeSet<String>,
}

impl CrdOutline {
    pub fn of(crd: &CustomResourceDefinition) -> CrdOutline {
        CrdOutline {
            name: crd.name_any(),
            group: crd.spec.group.clone(),
            spec_hash: spec_hash(crd),
            served: crd
                .spec
                .versions
                .iter()
                .filter(|v| v.served)
                .map(|v| v.name.clone())
                .collect(),
        }
    }
}

/// Checks one package CRD against the tenant's CRDs (by name): [`check_definition`], then
/// [`check_against`].
pub fn check(
    crd: &CustomResourceDefinition,
    existing: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
    rules: &CrdRules<'_>,
) -> Result<(), CrdRefusal> {
    check_definition(crd, rules)?;
    check_against(&CrdOutline::of(crd), existing, installer)
}

/// What a package CRD may be wherever it is installed: not in a reserved group or one the daemon
/// does not allow, no conversion webhook unless allowed.
pub fn check_definition(crd: &CustomResourceDefinition, rules: &CrdRules<'_>) -> Result<(), CrdRefusal> {
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
    if !rules.allow_conversion_webhooks && asks_for_conversion_webhook(crd) {
        return Err(CrdRefusal::ConversionWebhook { name });
    }
    Ok(())
}

/// Whether this install may write a package CRD (outlined) given the tenant's CRDs: the one of its
/// name must be this package's (and changed only by its creator), and no other package's CRD may be
/// in its group.
pub fn check_against(
    crd: &CrdOutline,
    existing: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
) -> Result<(), CrdRefusal> {
    let (name, group) = (&crd.name, &crd.group);
    if let Some(current) = existing.get(name) {
        if !installer.owns(current) {
            return Err(CrdRefusal::NotOurs {
                owner: describe_owner(current),
                name: name.clone(),
            });
        }
        let unchanged = current.annotations().get(SPEC_HASH_ANNOTATION) == Some(&crd.spec_hash);
        if !unchanged && !installer.may_change(current) {
            return Err(CrdRefusal::SharedChange {
                owner: describe_owner(current),
                name: name.clone(),
            });
        }
    }
    let taken = existing
        .values()
        .find(|other| other.spec.group == *group && !installer.owns(other));
    if let Some(other) = taken {
        return Err(CrdRefusal::GroupTaken {
            name: name.clone(),
            group: group.clone(),
            existing: other.name_any(),
            owner: describe_owner(other),
        });
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
        assert!(
            !me.owns(&other_package),
            "another package's, not created by this install, even while it alone uses it"
        );
    }

    #[test]
    fn a_crd_passes_to_its_last_user_only_within_its_package() {
        let creator = installer("team-a", "sample");
        let joiner = Installer {
            namespace: "team-b".into(),
            ..creator.clone()
        };
        let mut left_behind = made_by(crd("widgets.samples.example.org", "samples.example.org"), &creator);
        left_behind.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (joiner.parent_label(), "true".to_string()),
        ]));
        assert!(
            joiner.may_change(&left_behind),
            "the same package's last user upgrades it"
        );
        let desired = crate::stacks::install::package::desired_crd(&left_behind, Some(&left_behind), &joiner);
        assert_eq!(
            desired.annotations().get(INSTALLED_BY_ANNOTATION),
            Some(&joiner.annotation()),
            "and becomes its creator"
        );
        // Pointing the install at another image changes nothing: the CRD stays its package's.
        let switched = Installer {
            repository: "registry.example.com/attacker/stack".into(),
            ..joiner.clone()
        };
        assert!(!switched.owns(&left_behind));
        assert!(!switched.may_change(&left_behind));
        let existing = BTreeMap::from([(left_behind.name_any(), &left_behind)]);
        let mut rewritten = crd("widgets.samples.example.org", "samples.example.org");
        rewritten.spec.versions[0].name = "v9".into();
        let refusal = check(&rewritten, &existing, &switched, &rules(false)).expect_err("refused");
        assert!(matches!(refusal, CrdRefusal::NotOurs { .. }), "{refusal:?}");
        let squatter = crd("sprockets.samples.example.org", "samples.example.org");
        let refusal = check(&squatter, &existing, &switched, &rules(false)).expect_err("refused");
        assert!(matches!(refusal, CrdRefusal::GroupTaken { .. }), "{refusal:?}");
        // Once handed on, it stays the package's: the new holder moves it nowhere either.
        let mut handed_on = left_behind.clone();
        handed_on.metadata.annotations = desired.metadata.annotations.clone();
        assert!(!switched.owns(&handed_on), "the holder is not the creator");
        // Its creator, alone using it, moves it with its install to another repository.
        let moved = Installer {
            repository: "quay.io/team-a/stack".into(),
            ..creator.clone()
        };
        let mut own = made_by(crd("widgets.samples.example.org", "samples.example.org"), &creator);
        own.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (creator.parent_label(), "true".to_string()),
        ]));
        assert!(moved.owns(&own) && moved.may_change(&own));
        own.metadata
            .labels
            .get_or_insert_default()
            .insert(joiner.parent_label(), "true".into());
        assert!(!moved.owns(&own), "not while another stack uses it");
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
