//! The indexes the store keeps beside its objects, updated under the store lock on every write:
//! where each uid lives, and which objects name each uid in their owner references. They let the
//! garbage collector and the Job and Deployment loops look up an owner's dependents, or whether an
//! owner exists, without scanning every object.

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

use super::GroupResource;

/// Where an object is stored: its resource, namespace ("" for cluster-scoped) and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    pub resource: GroupResource,
    pub namespace: String,
    pub name: String,
}

#[derive(Default)]
pub(super) struct Indexes {
    by_uid: HashMap<String, Location>,
    /// Owner uid → the objects whose `ownerReferences` name it (the owner need not exist).
    dependents: HashMap<String, BTreeSet<Location>>,
}

fn uid(object: &Value) -> Option<&str> {
    object["metadata"]["uid"].as_str().filter(|uid| !uid.is_empty())
}

/// The uids an object's owner references name, each once.
pub fn owner_uids(object: &Value) -> BTreeSet<&str> {
    object["metadata"]["ownerReferences"]
        .as_array()
        .map(|refs| refs.iter().filter_map(|r| r["uid"].as_str()).collect())
        .unwrap_or_default()
}

impl Indexes {
    /// Records that the object at `location` changed from `old` to `new` (`None`: absent).
    pub(super) fn replace(&mut self, location: &Location, old: Option<&Value>, new: Option<&Value>) {
        let (old_uid, new_uid) = (old.and_then(uid), new.and_then(uid));
        if old_uid != new_uid {
            if let Some(gone) = old_uid {
                self.by_uid.remove(gone);
            }
            if let Some(added) = new_uid {
                self.by_uid.insert(added.to_string(), location.clone());
            }
        }
        let (old_owners, new_owners) = (
            old.map(owner_uids).unwrap_or_default(),
            new.map(owner_uids).unwrap_or_default(),
        );
        for gone in old_owners.difference(&new_owners) {
            if let Some(set) = self.dependents.get_mut(*gone) {
                set.remove(location);
                if set.is_empty() {
                    self.dependents.remove(*gone);
                }
            }
        }
        for added in new_owners.difference(&old_owners) {
            let set = self.dependents.entry(added.to_string()).or_default();
            set.insert(location.clone());
        }
    }

    pub(super) fn clear(&mut self) {
        self.by_uid.clear();
        self.dependents.clear();
    }

    pub(super) fn locate(&self, uid: &str) -> Option<&Location> {
        self.by_uid.get(uid)
    }

    pub(super) fn dependents(&self, owner_uid: &str) -> impl Iterator<Item = &Location> {
        self.dependents.get(owner_uid).into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(name: &str) -> Location {
        Location {
            resource: GroupResource::new("", "pods"),
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn pod(uid: &str, owners: &[&str]) -> Value {
        let refs: Vec<Value> = owners.iter().map(|o| json!({"uid": o})).collect();
        json!({"metadata": {"uid": uid, "ownerReferences": refs}})
    }

    #[test]
    fn an_owner_change_moves_the_dependent_between_owners() {
        let mut indexes = Indexes::default();
        let (first, second) = (pod("p", &["a"]), pod("p", &["b"]));
        indexes.replace(&at("p"), None, Some(&first));
        assert_eq!(indexes.dependents("a").count(), 1);
        indexes.replace(&at("p"), Some(&first), Some(&second));
        assert_eq!(indexes.dependents("a").count(), 0);
        assert_eq!(indexes.dependents("b").collect::<Vec<_>>(), vec![&at("p")]);
        assert_eq!(indexes.locate("p"), Some(&at("p")));
    }

    #[test]
    fn a_removed_object_leaves_no_entry() {
        let mut indexes = Indexes::default();
        let object = pod("p", &["a", "a"]);
        indexes.replace(&at("p"), None, Some(&object));
        indexes.replace(&at("p"), Some(&object), None);
        assert!(indexes.locate("p").is_none());
        assert!(indexes.dependents.is_empty());
    }
}
