//! The Deployment loop looks only at what events name, carrying a change from a Deployment to its
//! ReplicaSet, Pods and status in one pass, with dependents found by owner.

use serde_json::json;

use super::*;
use crate::embedded::controller_manager::testing::{Fixture, key};

fn controller(fixture: &Fixture) -> DeploymentController {
    DeploymentController {
        store: fixture.store.clone(),
        resources: fixture.resources.clone(),
        runners: Arc::default(),
    }
}

fn deployment(name: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "x"}]}},
        },
    })
}

#[test]
fn template_hash_is_stable_safe_and_changes_with_the_template() {
    let a = json!({"spec": {"containers": [{"name": "c", "image": "x:1"}]}});
    let b = json!({"spec": {"containers": [{"name": "c", "image": "x:2"}]}});
    assert_eq!(template_hash(&a), template_hash(&a.clone()));
    assert_ne!(template_hash(&a), template_hash(&b));
    assert!(
        template_hash(&a)
            .chars()
            .all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c))
    );
}

#[test]
fn passes_over_what_events_name_roll_out_one_deployment_and_leave_the_other_alone() {
    let mut fixture = Fixture::new();
    let mut controller = controller(&fixture);
    fixture.create("apps", "v1", "deployments", deployment("web"));
    let idle = fixture.create("apps", "v1", "deployments", deployment("idle"));
    fixture.named(&controller);
    let mut named = BTreeSet::from([Key::Deployment(key("ns", "web"))]);
    for _ in 0..5 {
        assert!(controller.pass(named).is_empty());
        named = fixture.named(&controller);
        let idle_named = named
            .iter()
            .any(|k| matches!(k, Key::Deployment((_, n)) if n == "idle"));
        assert!(!idle_named, "{named:?}");
    }
    assert!(named.is_empty(), "the passes settle: {named:?}");
    let web = fixture.store.get(&deployments(), "ns", "web").unwrap();
    assert_eq!(web["status"]["availableReplicas"], json!(2), "{web:#}");
    let sets = fixture.store.dependents(text(&web, "uid"), Some(&replica_sets()));
    assert_eq!(sets.len(), 1);
    let pods = fixture.store.dependents(text(&sets[0].1, "uid"), Some(&pods()));
    assert_eq!(pods.len(), 2);
    assert_eq!(fixture.store.get(&deployments(), "ns", "idle").unwrap(), idle);
    assert!(
        fixture
            .store
            .dependents(text(&idle, "uid"), Some(&replica_sets()))
            .is_empty()
    );
}

#[test]
fn a_pod_event_names_its_replica_set_and_a_replica_set_event_its_deployment() {
    let mut fixture = Fixture::new();
    let mut controller = controller(&fixture);
    fixture.create("apps", "v1", "deployments", deployment("web"));
    fixture.create("apps", "v1", "deployments", deployment("idle"));
    controller.pass(BTreeSet::from([Key::Deployment(key("ns", "web"))]));
    fixture.named(&controller);
    let web = fixture.store.get(&deployments(), "ns", "web").unwrap();
    let (set, _) = fixture
        .store
        .dependents(text(&web, "uid"), Some(&replica_sets()))
        .remove(0);
    let (pod, _) = fixture
        .store
        .dependents(&set_uid(&fixture, &set.name), Some(&pods()))
        .remove(0);
    let pod_info = fixture.resources.current().find("", "v1", "pods").unwrap();
    verbs::delete(&fixture.store, &pod_info, "ns", &pod.name, &DeleteOptions::default()).unwrap();
    let named = fixture.named(&controller);
    assert_eq!(named, BTreeSet::from([Key::ReplicaSet(key("ns", &set.name))]));
    controller.pass(named);
    let named = fixture.named(&controller);
    assert!(named.contains(&Key::Deployment(key("ns", "web"))), "{named:?}");
    assert!(!named.contains(&Key::Deployment(key("ns", "idle"))), "{named:?}");
}

fn set_uid(fixture: &Fixture, name: &str) -> String {
    let set = fixture.store.get(&replica_sets(), "ns", name).unwrap();
    text(&set, "uid").to_string()
}
