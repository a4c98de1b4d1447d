//! The garbage collector judges only what events name, through the uid and owner indexes.

use serde_json::json;

use super::*;
use crate::embedded::controller_manager::testing::Fixture;
use crate::embedded::store::GroupResource;

fn config_map(name: &str, owner_uid: Option<&str>) -> Value {
    let mut object = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}});
    if let Some(uid) = owner_uid {
        object["metadata"]["ownerReferences"] =
            json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": uid}]);
    }
    object
}

fn exists(fixture: &Fixture, name: &str) -> bool {
    fixture
        .store
        .contains(&GroupResource::new("", "configmaps"), "ns", name)
}

#[test]
fn a_removed_owner_names_its_dependents_and_a_pass_deletes_only_them() {
    let mut fixture = Fixture::new();
    let mut collector = GarbageCollector::new(fixture.store.clone(), fixture.resources.clone());
    let owner = fixture.create("", "v1", "configmaps", config_map("owner", None));
    let owner_uid = uid(&owner).to_string();
    fixture.create("", "v1", "configmaps", config_map("child", Some(&owner_uid)));
    // An orphan from the start: a whole-store pass would delete it too.
    fixture.create("", "v1", "configmaps", config_map("stray", Some("gone-long-ago")));
    fixture.named(&collector);
    let info = fixture.resources.current().find("", "v1", "configmaps").unwrap();
    verbs::delete(&fixture.store, &info, "ns", "owner", &DeleteOptions::default()).unwrap();
    let named = fixture.named(&collector);
    assert_eq!(named, BTreeSet::from([Key::DependentsOf(owner_uid)]));
    collector.pass(named);
    assert!(!exists(&fixture, "child"), "the owner's dependent is collected");
    assert!(exists(&fixture, "stray"), "an object no event named is not judged");
}

#[test]
fn a_dependent_created_with_a_missing_owner_is_collected() {
    let mut fixture = Fixture::new();
    let mut collector = GarbageCollector::new(fixture.store.clone(), fixture.resources.clone());
    fixture.named(&collector);
    fixture.create("", "v1", "configmaps", config_map("stray", Some("gone-long-ago")));
    let named = fixture.named(&collector);
    collector.pass(named);
    assert!(!exists(&fixture, "stray"));
}
