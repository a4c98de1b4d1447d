//! Which CRDs a package may create or change on the tenant (DESIGN.md §8): only CRDs in API groups
//! no one else uses, never in stackd's or Kubernetes' groups, never a CRD stackd did not create for
//! this install, and no conversion webhooks unless the daemon allows them. A CRD is an install's when
//! stackd's managed label and installed-by annotation say so; a package cannot forge either, because
//! stackd drops every key in its own domain from what a package ships.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;

use crate::stacks::{CRD_PARENT_LABEL_PREFIX, crd_parent_label, reserved_group_owner};

/// Label on tenant CRDs that a stack install created: only these are ever changed or deleted by stackd.
pub const MANAGED_CRD_LABEL: &str = "stacks.stackd.dev/managed";
/// Annotation on tenant CRDs: the install that created them, `<kind>/<namespace>/<name>`.
pub const INSTALLED_BY_ANNOTATION: &str = "stacks.stackd.dev/installed-by";

/// The install applying a package.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installer {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl Installer {
    /// The value of [`INSTALLED_BY_ANNOTATION`] on this install's CRDs.
    pub fn annotation(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }

    /// The parent label of the Stack this install creates.
    pub fn parent_label(&self) -> String {
        crd_parent_label(&self.namespace, &self.name)
    }

    /// True when `crd` was created by stackd for this install. CRDs from before the installed-by
    /// annotation count when they carry this install's Stack label and no other Stack's.
    pub fn owns(&self, crd: &CustomResourceDefinition) -> bool {
        if !crd.labels().contains_key(MANAGED_CRD_LABEL) {
            return false;
        }
        match crd.annotations().get(INSTALLED_BY_ANNOTATION) {
            Some(owner) => *owner == self.annotation(),
            None => {
                let own = self.parent_label();
                let mut parents = crd
                    .labels()
                    .keys()
                    .filter(|key| key.starts_with(CRD_PARENT_LABEL_PREFIX));
                parents.next() == Some(&own) && parents.next().is_none()
            }
        }
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
        "the package's CRD {name} already exists on the tenant and {owner}; stackd never changes a CRD it did not create for this install: remove the CRD from the package, or install under the name that created it"
    )]
    NotOurs { name: String, owner: String },
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
}

impl CrdRefusal {
    pub fn reason(&self) -> &'static str {
        match self {
            CrdRefusal::ReservedGroup { .. } => "CRDGroupReserved",
            CrdRefusal::NotOurs { .. } | CrdRefusal::GroupTaken { .. } => "CRDConflict",
            CrdRefusal::ConversionWebhook { .. } => "ConversionWebhookRefused",
        }
    }

    /// Ownership changes when the other install goes away: worth looking again then. A reserved group
    /// or a webhook needs another package.
    pub fn retry_later(&self) -> bool {
        matches!(self, CrdRefusal::NotOurs { .. } | CrdRefusal::GroupTaken { .. })
    }
}

/// Checks one package CRD against the tenant's CRDs (by name).
pub fn check(
    crd: &CustomResourceDefinition,
    existing: &BTreeMap<String, &CustomResourceDefinition>,
    installer: &Installer,
    allow_conversion_webhooks: bool,
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
    if let Some(current) = existing.get(&name)
        && !installer.owns(current)
    {
        return Err(CrdRefusal::NotOurs {
            owner: describe_owner(current),
            name,
        });
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
    if !allow_conversion_webhooks && asks_for_conversion_webhook(crd) {
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
    match crd
        .annotations()
        .get(INSTALLED_BY_ANNOTATION)
        .and_then(|owner| owner.split_once('/'))
    {
        Some((kind, at)) => format!("was created by the {kind} {at}"),
        None => "was created by stackd for another install".into(),
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
        crd.metadata.annotations = Some(BTreeMap::from([(
            INSTALLED_BY_ANNOTATION.to_string(),
            installer.annotation(),
        )]));
        crd
    }

    fn check_against(
        package: &CustomResourceDefinition,
        tenant: &[CustomResourceDefinition],
    ) -> Result<(), CrdRefusal> {
        let existing = tenant.iter().map(|c| (c.name_any(), c)).collect();
        check(package, &existing, &installer("team-a", "sample"), false)
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
        // A forged installed-by annotation without stackd's managed label proves nothing.
        let mut forged = foreign.clone();
        forged.metadata.annotations = Some(BTreeMap::from([(
            INSTALLED_BY_ANNOTATION.to_string(),
            installer("team-a", "sample").annotation(),
        )]));
        assert!(check_against(&foreign, &[forged]).is_err());
    }

    #[test]
    fn a_crd_from_before_the_annotation_is_ours_only_with_our_label_alone() {
        let me = installer("team-a", "sample");
        let mut legacy = crd("widgets.samples.example.org", "samples.example.org");
        legacy.metadata.labels = Some(BTreeMap::from([
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (me.parent_label(), "true".to_string()),
        ]));
        assert!(me.owns(&legacy));
        let mut shared = legacy.clone();
        shared
            .metadata
            .labels
            .get_or_insert_default()
            .insert(crd_parent_label("team-b", "sample"), "true".into());
        assert!(!me.owns(&shared));
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
        assert_eq!(check(&hooked, &existing, &installer("team-a", "sample"), true), Ok(()));
    }

    #[test]
    fn stackd_keys_are_dropped_from_package_metadata() {
        let keys = BTreeMap::from([
            ("app".to_string(), "widgets".to_string()),
            (MANAGED_CRD_LABEL.to_string(), "true".to_string()),
            (crd_parent_label("team-b", "x"), "true".to_string()),
            (INSTALLED_BY_ANNOTATION.to_string(), "StackInstall/team-b/x".to_string()),
        ]);
        let kept = without_stackd_keys(Some(&keys));
        assert_eq!(kept.keys().collect::<Vec<_>>(), ["app"]);
    }
}
