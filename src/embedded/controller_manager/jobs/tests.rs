//! The Job loop looks only at the Jobs events name, and finds each Job's Pods by owner.

use serde_json::json;

use super::*;
use crate::embedded::controller_manager::testing::{Fixture, key};

fn controller(fixture: &Fixture) -> JobController {
    JobController {
        store: fixture.store.clone(),
        resources: fixture.resources.clone(),
        runners: Arc::default(),
        running: Arc::default(),
    }
}

fn job(name: &str) -> Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}},
    })
}

fn pods_of(fixture: &Fixture, job: &Value) -> usize {
    fixture.store.dependents(text(job, "uid"), Some(&pods())).len()
}

#[tokio::test]
async fn a_pod_event_names_only_the_job_owning_it() {
    let mut fixture = Fixture::new();
    let controller = controller(&fixture);
    let (first, _second) = (
        fixture.create("batch", "v1", "jobs", job("first")),
        fixture.create("batch", "v1", "jobs", job("second")),
    );
    fixture.named(&controller);
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "p", "ownerReferences": [controller_ref("batch/v1", "Job", &first)],
    }, "spec": {"containers": [{"name": "c", "image": "x"}]}});
    fixture.create("", "v1", "pods", pod);
    assert_eq!(fixture.named(&controller), BTreeSet::from([key("ns", "first")]));
}

#[tokio::test]
async fn a_pass_looks_only_at_the_jobs_it_is_given() {
    let fixture = Fixture::new();
    let mut controller = controller(&fixture);
    let (first, second) = (
        fixture.create("batch", "v1", "jobs", job("first")),
        fixture.create("batch", "v1", "jobs", job("second")),
    );
    let retries = controller.pass(BTreeSet::from([key("ns", "first")]));
    assert!(retries.is_empty());
    assert_eq!(pods_of(&fixture, &first), 1, "the named Job got its pod");
    assert_eq!(pods_of(&fixture, &second), 0, "the other Job was not looked at");
    let second_now = fixture.store.get(&jobs(), "ns", "second").unwrap();
    assert_eq!(second_now, second, "nor written to");
}

#[tokio::test]
async fn a_job_with_a_deadline_is_looked_at_again_until_it_ends() {
    let fixture = Fixture::new();
    let mut controller = controller(&fixture);
    let mut timed = job("timed");
    timed["spec"]["activeDeadlineSeconds"] = json!(600);
    fixture.create("batch", "v1", "jobs", timed);
    let retries = controller.pass(BTreeSet::from([key("ns", "timed")]));
    assert_eq!(retries, BTreeSet::from([key("ns", "timed")]));
}
