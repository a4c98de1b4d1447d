//! What a change of a tenant CRD means to the installs and Stacks that use it.
//!
//! Installs of one package share its CRDs, and each adds its stack's label to them: woken by every
//! change, each of n installs and Stacks on their way would run once for every other's label, n²
//! reconciles in all (the installs of one package in every team namespace, made at once, is an
//! ordinary rollout). What they wait for in a CRD is what a label of another stack does not change:
//! the CRD created or redefined (a new uid or generation), Established (its conditions), going (its
//! deletion), made by stackd (its managed label), and a Stack's own label coming or going.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use super::{CRD_PARENT_LABEL_PREFIX, MANAGED_CRD_LABEL};

/// What a controller last saw of each tenant CRD, by name.
#[derive(Default)]
pub(crate) struct CrdChanges {
    seen: Mutex<HashMap<String, Seen>>,
}

struct Seen {
    content: Content,
    /// The stacks' parent labels it carries.
    parents: BTreeSet<String>,
}

/// The parts of a CRD that users of it wait for, but for the stacks' labels.
#[derive(PartialEq, Eq)]
struct Content {
    uid: Option<String>,
    generation: Option<i64>,
    deleting: bool,
    managed: bool,
    /// Each condition's type and status.
    conditions: Vec<(String, String)>,
}

impl Content {
    fn of(crd: &CustomResourceDefinition) -> Content {
        let conditions = crd.status.as_ref().and_then(|s| s.conditions.as_ref());
        Content {
            uid: crd.metadata.uid.clone(),
            generation: crd.metadata.generation,
            deleting: crd.metadata.deletion_timestamp.is_some(),
            managed: crd.labels().contains_key(MANAGED_CRD_LABEL),
            conditions: conditions
                .into_iter()
                .flatten()
                .map(|c| (c.type_.clone(), c.status.clone()))
                .collect(),
        }
    }
}

/// What changed in a CRD since it was last seen.
pub(crate) struct CrdChange {
    /// Anything but the stacks' labels (or the CRD is new to the controller, or gone).
    pub(crate) content: bool,
    /// The stacks' parent labels it gained or lost.
    pub(crate) relabelled: BTreeSet<String>,
}

impl CrdChanges {
    /// Notes `crd`, whose change a watch of `cache` brought, as seen and says what changed since
    /// it was last seen. One the cache no longer holds (or holds a new one of its name) is gone.
    pub(crate) fn note(&self, cache: &Store<CustomResourceDefinition>, crd: &CustomResourceDefinition) -> CrdChange {
        let current = cache.get(&ObjectRef::from_obj(crd));
        let gone = current.is_none_or(|current| current.metadata.uid != crd.metadata.uid);
        self.note_seen(crd, gone)
    }

    fn note_seen(&self, crd: &CustomResourceDefinition, gone: bool) -> CrdChange {
        let mut seen = self.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let name = crd.name_any();
        if gone {
            let parents = seen.remove(&name).map(|s| s.parents).unwrap_or_default();
            return CrdChange {
                content: true,
                relabelled: parents,
            };
        }
        let content = Content::of(crd);
        let parents: BTreeSet<String> = crd
            .labels()
            .keys()
            .filter(|key| key.starts_with(CRD_PARENT_LABEL_PREFIX))
            .cloned()
            .collect();
        let change = match seen.get(&name) {
            None => CrdChange {
                content: true,
                relabelled: parents.clone(),
            },
            Some(before) => CrdChange {
                content: before.content != content,
                relabelled: parents.symmetric_difference(&before.parents).cloned().collect(),
            },
        };
        seen.insert(name, Seen { content, parents });
        change
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinitionCondition, CustomResourceDefinitionStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn parent(stack: &str) -> String {
        format!("{CRD_PARENT_LABEL_PREFIX}{stack}")
    }

    fn crd(stacks: &[&str], established: Option<&str>) -> CustomResourceDefinition {
        let mut crd = CustomResourceDefinition::default();
        crd.metadata.name = Some("widgets.example.org".into());
        crd.metadata.uid = Some("uid-1".into());
        crd.metadata.generation = Some(1);
        crd.metadata.labels = Some(stacks.iter().map(|s| (parent(s), "true".to_string())).collect());
        crd.status = established.map(|status| CustomResourceDefinitionStatus {
            conditions: Some(vec![CustomResourceDefinitionCondition {
                type_: "Established".into(),
                status: status.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        crd
    }

    #[test]
    fn a_stacks_label_is_no_change_of_content_and_names_only_that_stack() {
        let changes = CrdChanges::default();
        let first = changes.note_seen(&crd(&["a"], None), false);
        assert!(first.content, "first seen");
        assert_eq!(first.relabelled, BTreeSet::from([parent("a")]));
        let established = changes.note_seen(&crd(&["a"], Some("True")), false);
        assert!(established.content && established.relabelled.is_empty());
        let labelled = changes.note_seen(&crd(&["a", "b"], Some("True")), false);
        assert!(!labelled.content);
        assert_eq!(labelled.relabelled, BTreeSet::from([parent("b")]));
        let unlabelled = changes.note_seen(&crd(&["b"], Some("True")), false);
        assert!(!unlabelled.content);
        assert_eq!(unlabelled.relabelled, BTreeSet::from([parent("a")]));
        let mut other = crd(&["b"], Some("True"));
        other.labels_mut().insert("example.org/owner".into(), "platform".into());
        let other = changes.note_seen(&other, false);
        assert!(!other.content && other.relabelled.is_empty(), "a label of no stack");
    }

    #[test]
    fn a_new_generation_the_managed_label_deletion_a_new_uid_and_going_are_changes() {
        let changes = CrdChanges::default();
        changes.note_seen(&crd(&["a"], Some("True")), false);
        let mut redefined = crd(&["a"], Some("True"));
        redefined.metadata.generation = Some(2);
        assert!(changes.note_seen(&redefined, false).content);
        redefined.labels_mut().insert(MANAGED_CRD_LABEL.into(), "true".into());
        assert!(changes.note_seen(&redefined, false).content, "managed by stackd");
        redefined.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::now()));
        assert!(changes.note_seen(&redefined, false).content, "deleting");
        let gone = changes.note_seen(&redefined, true);
        assert!(gone.content && gone.relabelled == BTreeSet::from([parent("a")]));
        let mut recreated = crd(&["a"], Some("True"));
        changes.note_seen(&recreated, false);
        recreated.metadata.uid = Some("uid-2".into());
        assert!(
            changes.note_seen(&recreated, false).content,
            "a new CRD of the same name"
        );
    }
}
