//! Ownership proof: before stackd writes to a host object it already finds at a mapped name, it checks
//! that the object's labels and annotations name this tenant and this parent.

use std::collections::BTreeMap;

use super::labels::{
    MANAGED_BY, MANAGED_BY_LABEL, PARENT_KIND_LABEL, PARENT_NAME_LABEL, PARENT_NAMESPACE_LABEL, Parent,
    TENANT_KIND_ANNOTATION, TENANT_LABEL, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION, TENANT_UID_ANNOTATION,
};
use super::names::label_value;

/// What stackd may do with an existing host object at a name it wants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// Ours, for this very parent: it may be updated (with a uid precondition).
    Ours,
    /// Ours for a parent of the same kind and name that was deleted and recreated: replace it.
    PreviousIncarnation { recorded_uid: String },
    /// Someone else's (another tenant, another parent, or not stackd's at all): never touch it.
    Foreign { reason: String },
}

/// Decides who owns a host object from its labels and annotations.
pub fn check(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    tenant: &str,
    parent: &Parent,
) -> Ownership {
    let expected = parent.labels(tenant);
    for key in [
        MANAGED_BY_LABEL,
        TENANT_LABEL,
        PARENT_KIND_LABEL,
        PARENT_NAMESPACE_LABEL,
        PARENT_NAME_LABEL,
    ] {
        let found = labels.get(key).map(String::as_str);
        if found != expected.get(key).map(String::as_str) {
            return Ownership::Foreign {
                reason: mismatch(key, found, expected.get(key)),
            };
        }
    }
    let identity = [
        (TENANT_KIND_ANNOTATION, parent.kind.as_str()),
        (
            TENANT_NAMESPACE_ANNOTATION,
            parent.namespace.as_deref().unwrap_or_default(),
        ),
        (TENANT_NAME_ANNOTATION, parent.name.as_str()),
    ];
    for (key, want) in identity {
        let found = annotations.get(key).map(String::as_str);
        if found != Some(want) {
            // Labels match but the full identity does not: two long names hashed alike, or a forgery.
            return Ownership::Foreign {
                reason: mismatch(key, found, Some(&want.to_string())),
            };
        }
    }
    match annotations.get(TENANT_UID_ANNOTATION) {
        Some(uid) if *uid == parent.uid => Ownership::Ours,
        Some(uid) if !uid.is_empty() => Ownership::PreviousIncarnation {
            recorded_uid: uid.clone(),
        },
        _ => Ownership::Foreign {
            reason: format!("annotation {TENANT_UID_ANNOTATION} is missing"),
        },
    }
}

fn mismatch(key: &str, found: Option<&str>, expected: Option<&String>) -> String {
    let expected = expected.map(String::as_str).unwrap_or_default();
    match found {
        Some(found) => format!("{key} is {found:?}, not {expected:?}"),
        None => format!("{key} is missing (expected {expected:?})"),
    }
}

/// True when labels carry this tenant's label: the only objects stackd ever deletes.
pub fn belongs_to_tenant(labels: &BTreeMap<String, String>, tenant: &str) -> bool {
    labels.get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
        && labels.get(TENANT_LABEL) == Some(&label_value(tenant))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent() -> Parent {
        Parent::new("StackInstall", Some("team-a"), "sample", "uid-1")
    }

    #[test]
    fn own_object_is_ours() {
        let p = parent();
        assert_eq!(check(&p.labels("acme"), &p.annotations(), "acme", &p), Ownership::Ours);
    }

    #[test]
    fn another_tenants_object_is_foreign() {
        let p = parent();
        let verdict = check(&p.labels("other"), &p.annotations(), "acme", &p);
        assert!(
            matches!(verdict, Ownership::Foreign { ref reason } if reason.contains("stackd.dev/tenant")),
            "{verdict:?}"
        );
    }

    #[test]
    fn another_parents_object_is_foreign() {
        let p = parent();
        let other = Parent::new("StackInstall", Some("team-a"), "other", "uid-2");
        assert!(matches!(
            check(&other.labels("acme"), &other.annotations(), "acme", &p),
            Ownership::Foreign { .. }
        ));
    }

    #[test]
    fn unlabelled_object_is_foreign() {
        let verdict = check(&BTreeMap::new(), &BTreeMap::new(), "acme", &parent());
        assert!(matches!(verdict, Ownership::Foreign { .. }));
    }

    #[test]
    fn recreated_parent_replaces_previous_incarnation() {
        let old = parent();
        let new = Parent {
            uid: "uid-2".into(),
            ..parent()
        };
        assert_eq!(
            check(&old.labels("acme"), &old.annotations(), "acme", &new),
            Ownership::PreviousIncarnation {
                recorded_uid: "uid-1".into()
            }
        );
    }

    #[test]
    fn hashed_label_collision_is_caught_by_annotations() {
        let p = Parent::new("Stack", Some("ns"), &"a".repeat(80), "u");
        let mut annotations = p.annotations();
        annotations.insert(TENANT_NAME_ANNOTATION.into(), "something-else".into());
        assert!(matches!(
            check(&p.labels("t"), &annotations, "t", &p),
            Ownership::Foreign { .. }
        ));
    }

    #[test]
    fn missing_uid_annotation_is_not_a_guess_to_act_on() {
        let p = parent();
        let mut annotations = p.annotations();
        annotations.remove(TENANT_UID_ANNOTATION);
        assert!(matches!(
            check(&p.labels("acme"), &annotations, "acme", &p),
            Ownership::Foreign { .. }
        ));
    }

    #[test]
    fn tenant_membership_needs_managed_by_and_tenant() {
        let p = parent();
        assert!(belongs_to_tenant(&p.labels("acme"), "acme"));
        assert!(!belongs_to_tenant(&p.labels("acme"), "other"));
        let mut labels = p.labels("acme");
        labels.remove(MANAGED_BY_LABEL);
        assert!(!belongs_to_tenant(&labels, "acme"));
    }
}
