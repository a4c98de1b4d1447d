//! The controller-manager loops of the embedded API server: tokens, namespace deletion, Jobs run by
//! per-image runners, Deployments.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::json;
use stackd::embedded::ServerOptions;
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};

use crate::harness::{self, NoDaemon, TestServer, api_error, eventually, wait_until};

/// How long a Job may take to reach a condition (200 polls of 50 ms before).
const JOB_WITHIN: Duration = Duration::from_secs(10);

fn object<K: serde::de::DeserializeOwned>(value: serde_json::Value) -> K {
    serde_json::from_value(value).expect("test object deserialises")
}

async fn token_secret(t: &TestServer, name: &str, account: &str) {
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let secret = object(json!({
        "metadata": {"name": name, "annotations": {"kubernetes.io/service-account.name": account}},
        "type": "kubernetes.io/service-account-token",
    }));
    secrets.create(&PostParams::default(), &secret).await.unwrap();
}

async fn service_account(t: &TestServer, name: &str) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(t.client.clone(), "ns");
    let account = accounts
        .create(&PostParams::default(), &object(json!({"metadata": {"name": name}})))
        .await
        .unwrap();
    account.metadata.uid.unwrap()
}

async fn filled(secrets: &Api<Secret>, name: &str) -> Option<Secret> {
    let secret = secrets.get_opt(name).await.ok()??;
    let data = secret.data.as_ref()?;
    (data.contains_key("token") && data.contains_key("ca.crt") && data.contains_key("namespace")).then_some(secret)
}

#[tokio::test]
async fn token_secret_is_filled_and_deleted_with_its_service_account() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let uid = service_account(&t, "robot").await;
    token_secret(&t, "robot-token", "robot").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    eventually("the token filled", || async {
        filled(&secrets, "robot-token").await.is_some()
    })
    .await;
    let secret = filled(&secrets, "robot-token").await.unwrap();
    let data = secret.data.unwrap();
    assert_eq!(data["namespace"].0, b"ns");
    assert!(String::from_utf8_lossy(&data["ca.crt"].0).contains("BEGIN CERTIFICATE"));
    assert_eq!(
        secret.metadata.annotations.unwrap()["kubernetes.io/service-account.uid"],
        uid
    );

    let accounts: Api<ServiceAccount> = Api::namespaced(t.client.clone(), "ns");
    accounts.delete("robot", &DeleteParams::default()).await.unwrap();
    eventually("the token secret deleted", || async {
        secrets.get_opt("robot-token").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn token_secret_of_a_missing_service_account_is_deleted() {
    let t = harness::start().await;
    t.namespace("ns").await;
    token_secret(&t, "ghost-token", "ghost").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    eventually("the token secret deleted", || async {
        secrets.get_opt("ghost-token").await.unwrap().is_none()
    })
    .await;
}

#[tokio::test]
async fn filled_token_is_accepted_as_a_bearer_token_over_tls() {
    let t = harness::start_with(ServerOptions {
        tls: true,
        token: Some("admin-token".into()),
        ..ServerOptions::default()
    })
    .await;
    t.namespace("ns").await;
    service_account(&t, "robot").await;
    token_secret(&t, "robot-token", "robot").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    eventually("the token filled", || async {
        filled(&secrets, "robot-token").await.is_some()
    })
    .await;
    let data = filled(&secrets, "robot-token").await.unwrap().data.unwrap();
    let token = String::from_utf8(data["token"].0.clone()).unwrap();
    let ca = String::from_utf8(data["ca.crt"].0.clone()).unwrap();
    assert!(ca.contains("BEGIN CERTIFICATE"));

    let mut kubeconfig = t.server.kubeconfig();
    kubeconfig.auth_infos[0].auth_info.as_mut().unwrap().token = Some(token.into());
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let pod_client = kube::Client::try_from(config).unwrap();
    let as_pod: Api<ConfigMap> = Api::namespaced(pod_client, "ns");
    as_pod
        .list(&ListParams::default())
        .await
        .expect("the pod's token authenticates");

    let mut kubeconfig = t.server.kubeconfig();
    kubeconfig.auth_infos[0].auth_info.as_mut().unwrap().token = Some("forged".to_string().into());
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let forged: Api<ConfigMap> = Api::namespaced(kube::Client::try_from(config).unwrap(), "ns");
    assert_eq!(
        api_error(forged.list(&ListParams::default()).await.unwrap_err()).code,
        401
    );
}

#[tokio::test]
async fn namespace_deletion_empties_the_namespace_then_removes_it() {
    let t = harness::start().await;
    t.namespace("doomed").await;
    let cms = t.configmaps("doomed");
    for name in ["a", "b"] {
        cms.create(&PostParams::default(), &harness::configmap(name, json!({})))
            .await
            .unwrap();
    }
    let mut held = harness::configmap("held", json!({}));
    held.metadata.finalizers = Some(vec!["x.dev/hold".into()]);
    cms.create(&PostParams::default(), &held).await.unwrap();
    let namespaces: Api<Namespace> = Api::all(t.client.clone());
    namespaces.delete("doomed", &DeleteParams::default()).await.unwrap();
    eventually("unheld contents deleted", || async {
        cms.list(&ListParams::default()).await.unwrap().items.len() == 1
    })
    .await;
    assert!(
        namespaces.get("doomed").await.is_ok(),
        "held content keeps the namespace"
    );
    cms.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually("the namespace removed", || async {
        namespaces.get_opt("doomed").await.unwrap().is_none()
    })
    .await;
}

fn job(name: &str, image: &str, backoff_limit: i32) -> Job {
    object(json!({
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": backoff_limit,
            "template": {
                "metadata": {"labels": {"app": "scripted"}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": image, "args": ["go"]}]},
            },
        },
    }))
}

async fn wait_for_condition(jobs: &Api<Job>, name: &str, kind: &str) -> Job {
    wait_until(&format!("Job {name} to be {kind}"), JOB_WITHIN, &NoDaemon, || async {
        let job = jobs.get(name).await.unwrap();
        let done = job
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"));
        done.then_some(job)
    })
    .await
}

async fn job_pods(t: &TestServer, job: &Job) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let uid = job.metadata.uid.clone().unwrap();
    pods.list(&ListParams::default().labels(&format!("controller-uid={uid}")))
        .await
        .unwrap()
        .items
}

#[tokio::test]
async fn job_completes_and_pods_log_returns_the_scripted_log_honouring_limit_bytes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/ok:1".into()), |ctx: &JobContext| {
            JobOutcome::success(format!(
                "hello from {} with {:?}\nsecond line\n",
                ctx.container, ctx.args
            ))
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &job("ok", "example/ok:1", 0))
        .await
        .unwrap();
    let done = wait_for_condition(&jobs, "ok", "Complete").await;
    let status = done.status.clone().unwrap();
    assert_eq!(status.succeeded, Some(1));
    assert!(status.start_time.is_some() && status.completion_time.is_some());

    let pods = job_pods(&t, &done).await;
    assert_eq!(pods.len(), 1);
    let pod = &pods[0];
    let name = pod.metadata.name.clone().unwrap();
    assert!(name.starts_with("ok-") && name.len() == "ok-".len() + 5, "{name}");
    let labels = pod.metadata.labels.clone().unwrap();
    assert_eq!(labels["job-name"], "ok");
    assert_eq!(labels["app"], "scripted");
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.controller), ("Job", Some(true)));
    let pod_status = pod.status.clone().unwrap();
    assert_eq!(pod_status.phase.as_deref(), Some("Succeeded"));
    let terminated = pod_status.container_statuses.unwrap()[0]
        .state
        .clone()
        .unwrap()
        .terminated
        .unwrap();
    assert_eq!(terminated.exit_code, 0);

    let pods_api: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let log = pods_api.logs(&name, &LogParams::default()).await.unwrap();
    assert_eq!(log, "hello from main with [\"go\"]\nsecond line\n");
    let limited = LogParams {
        limit_bytes: Some(5),
        ..LogParams::default()
    };
    assert_eq!(pods_api.logs(&name, &limited).await.unwrap(), "hello");
    let tail = LogParams {
        tail_lines: Some(1),
        ..LogParams::default()
    };
    assert_eq!(pods_api.logs(&name, &tail).await.unwrap(), "second line\n");
}

#[tokio::test]
async fn failing_job_is_retried_up_to_its_backoff_limit_then_fails() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Prefix("example/broken".into()), |_: &JobContext| {
            JobOutcome::failure(3, "boom\n")
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &job("broken", "example/broken:2", 2))
        .await
        .unwrap();
    let failed = wait_for_condition(&jobs, "broken", "Failed").await;
    let status = failed.status.clone().unwrap();
    assert_eq!(status.failed, Some(3), "the first pod and backoffLimit=2 retries");
    let condition = &status.conditions.unwrap()[0];
    assert_eq!(condition.reason.as_deref(), Some("BackoffLimitExceeded"));
    assert_eq!(
        condition.message.as_deref(),
        Some("Job has reached the specified backoff limit")
    );
    let pods = job_pods(&t, &failed).await;
    assert_eq!(pods.len(), 3);
    let pods_api: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    for pod in pods {
        let status = pod.status.unwrap();
        assert_eq!(status.phase.as_deref(), Some("Failed"));
        let code = status.container_statuses.unwrap()[0]
            .state
            .clone()
            .unwrap()
            .terminated
            .unwrap()
            .exit_code;
        assert_eq!(code, 3);
        let log = pods_api
            .logs(&pod.metadata.name.unwrap(), &LogParams::default())
            .await
            .unwrap();
        assert_eq!(log, "boom\n");
    }
}

#[tokio::test]
async fn job_of_an_image_without_a_runner_fails_with_a_clear_log() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &job("unknown", "example/nobody:1", 0))
        .await
        .unwrap();
    let failed = wait_for_condition(&jobs, "unknown", "Failed").await;
    let pod = job_pods(&t, &failed).await.remove(0);
    let pods_api: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let log = pods_api
        .logs(&pod.metadata.name.unwrap(), &LogParams::default())
        .await
        .unwrap();
    assert_eq!(log, "no runner for image example/nobody:1\n");
}

#[tokio::test]
async fn job_past_its_active_deadline_fails_with_deadline_exceeded() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/slow:1".into()), |_: &JobContext| {
            JobOutcome::success("done\n").after(Duration::from_secs(30))
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let mut slow = job("slow", "example/slow:1", 6);
    slow.spec.as_mut().unwrap().active_deadline_seconds = Some(1);
    jobs.create(&PostParams::default(), &slow).await.unwrap();
    let failed = wait_for_condition(&jobs, "slow", "Failed").await;
    let condition = &failed.status.unwrap().conditions.unwrap()[0];
    assert_eq!(condition.reason.as_deref(), Some("DeadlineExceeded"));
}

#[tokio::test]
async fn job_runner_side_effect_writes_a_secret_and_init_containers_run_first() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/writer:1".into()), |ctx: &JobContext| {
            let (Some(ns), Some(name)) = (ctx.env("OUT_NAMESPACE"), ctx.env("OUT_SECRET")) else {
                return JobOutcome::failure(2, "missing env\n");
            };
            let data = BTreeMap::from([("result".to_string(), format!("written by {}", ctx.container))]);
            match ctx.write_secret_data(ns, name, &data) {
                Ok(_) => JobOutcome::success("wrote it\n"),
                Err(e) => JobOutcome::failure(1, format!("{}\n", e.message)),
            }
        });
    let writer: Job = object(json!({
        "metadata": {"name": "writer"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "initContainers": [{"name": "prepare", "image": "example/anything:1"}],
            "containers": [
                {"name": "write", "image": "example/writer:1",
                 "env": [{"name": "OUT_NAMESPACE", "value": "ns"}, {"name": "OUT_SECRET", "value": "output"}]},
                {"name": "sidecar", "image": "example/sidecar:1"},
            ],
        }}},
    }));
    t.server
        .runners()
        .register(ImageMatch::Exact("example/sidecar:1".into()), |_: &JobContext| {
            JobOutcome::success("")
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &writer).await.unwrap();
    let done = wait_for_condition(&jobs, "writer", "Complete").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let output = secrets.get("output").await.unwrap();
    assert_eq!(output.data.unwrap()["result"].0, b"written by write");

    let pod = job_pods(&t, &done).await.remove(0);
    let status = pod.status.unwrap();
    assert_eq!(status.init_container_statuses.unwrap()[0].name, "prepare");
    let pods_api: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let name = pod.metadata.name.unwrap();
    let unnamed = pods_api.logs(&name, &LogParams::default()).await.unwrap_err();
    assert_eq!(api_error(unnamed).code, 400, "two containers and none named");
    let named = LogParams {
        container: Some("write".into()),
        ..LogParams::default()
    };
    assert_eq!(pods_api.logs(&name, &named).await.unwrap(), "wrote it\n");
}

#[tokio::test]
async fn deleting_a_job_in_the_background_collects_its_pods() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/ok:1".into()), |_: &JobContext| {
            JobOutcome::success("ok\n")
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &job("ok", "example/ok:1", 0))
        .await
        .unwrap();
    let done = wait_for_condition(&jobs, "ok", "Complete").await;
    assert_eq!(job_pods(&t, &done).await.len(), 1);
    jobs.delete("ok", &DeleteParams::background()).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    eventually("the job's pod collected", || async {
        pods.list(&ListParams::default()).await.unwrap().items.is_empty()
    })
    .await;
}

fn deployment(name: &str, image: &str, replicas: i32) -> Deployment {
    object(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "c", "image": image}]},
            },
        },
    }))
}

fn available(d: &Deployment) -> Option<String> {
    d.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Available")
        .map(|c| c.status.clone())
}

#[tokio::test]
async fn deployment_becomes_available_and_rolls_a_new_replica_set_when_its_template_changes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    let deployments: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    deployments
        .create(&PostParams::default(), &deployment("web", "example/web:1", 2))
        .await
        .unwrap();
    eventually("the deployment available with 2 replicas", || async {
        let d = deployments.get("web").await.unwrap();
        let s = d.status.clone().unwrap_or_default();
        available(&d).as_deref() == Some("True")
            && s.available_replicas == Some(2)
            && s.ready_replicas == Some(2)
            && s.updated_replicas == Some(2)
            && s.observed_generation == d.metadata.generation
    })
    .await;
    let sets: Api<ReplicaSet> = Api::namespaced(t.client.clone(), "ns");
    let first = sets.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(first.len(), 1);
    let hash = first[0].metadata.labels.as_ref().unwrap()["pod-template-hash"].clone();
    assert_eq!(first[0].metadata.name.as_deref(), Some(format!("web-{hash}").as_str()));
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let running = pods.list(&ListParams::default().labels("app=web")).await.unwrap().items;
    assert_eq!(running.len(), 2);
    assert!(
        running
            .iter()
            .all(|p| p.status.as_ref().unwrap().phase.as_deref() == Some("Running"))
    );

    let patch = json!({"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "example/web:2"}]}}}});
    deployments
        .patch("web", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    eventually("the new ReplicaSet has the pods", || async {
        let d = deployments.get("web").await.unwrap();
        let sets = sets.list(&ListParams::default()).await.unwrap().items;
        let pods = pods.list(&ListParams::default().labels("app=web")).await.unwrap().items;
        let s = d.status.clone().unwrap_or_default();
        sets.len() == 2
            && s.observed_generation == Some(2)
            && s.updated_replicas == Some(2)
            && s.replicas == Some(2)
            && pods.len() == 2
            && pods
                .iter()
                .all(|p| p.spec.as_ref().unwrap().containers[0].image.as_deref() == Some("example/web:2"))
    })
    .await;

    let revisions: Vec<String> = sets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|rs| rs.metadata.annotations.as_ref().unwrap()["deployment.kubernetes.io/revision"].clone())
        .collect();
    assert_eq!(revisions.iter().filter(|r| *r == "2").count(), 1, "{revisions:?}");
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .unwrap();
    eventually("scaled to zero", || async {
        let d = deployments.get("web").await.unwrap();
        let s = d.status.clone().unwrap_or_default();
        pods.list(&ListParams::default()).await.unwrap().items.is_empty()
            && s.replicas.unwrap_or(0) == 0
            && available(&d).as_deref() == Some("True")
    })
    .await;
}

#[tokio::test]
async fn deployment_whose_pods_never_become_ready_is_not_available() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .never_ready(ImageMatch::Prefix("example/stuck".into()));
    let deployments: Api<Deployment> = Api::namespaced(t.client.clone(), "ns");
    deployments
        .create(&PostParams::default(), &deployment("stuck", "example/stuck:1", 1))
        .await
        .unwrap();
    eventually("the deployment reported unavailable", || async {
        let d = deployments.get("stuck").await.unwrap();
        let s = d.status.clone().unwrap_or_default();
        available(&d).as_deref() == Some("False") && s.replicas == Some(1) && s.available_replicas.is_none()
    })
    .await;
}

#[tokio::test]
async fn token_written_into_a_secret_by_a_client_is_never_accepted() {
    let t = harness::start_with(ServerOptions {
        token: Some("admin-token".into()),
        ..ServerOptions::default()
    })
    .await;
    t.namespace("ns").await;
    service_account(&t, "robot").await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let preset = object(json!({
        "metadata": {"name": "preset", "annotations": {"kubernetes.io/service-account.name": "robot"}},
        "type": "kubernetes.io/service-account-token",
        "stringData": {"token": "chosen-by-the-client"},
    }));
    secrets.create(&PostParams::default(), &preset).await.unwrap();
    eventually("the preset secret completed", || async {
        filled(&secrets, "preset").await.is_some()
    })
    .await;
    let mut kubeconfig = t.server.kubeconfig();
    kubeconfig.auth_infos[0].auth_info.as_mut().unwrap().token = Some("chosen-by-the-client".to_string().into());
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(kube::Client::try_from(config).unwrap(), "ns");
    assert_eq!(api_error(api.list(&ListParams::default()).await.unwrap_err()).code, 401);
}

#[tokio::test]
async fn job_with_two_completions_runs_two_pods_one_after_the_other() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/ok:1".into()), |_: &JobContext| {
            JobOutcome::success("ok\n")
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let mut twice = job("twice", "example/ok:1", 0);
    twice.spec.as_mut().unwrap().completions = Some(2);
    jobs.create(&PostParams::default(), &twice).await.unwrap();
    let done = wait_for_condition(&jobs, "twice", "Complete").await;
    assert_eq!(done.status.as_ref().unwrap().succeeded, Some(2));
    assert_eq!(job_pods(&t, &done).await.len(), 2);
}

#[tokio::test]
async fn running_job_pod_reports_running_containers_until_its_runner_finishes() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .register(ImageMatch::Exact("example/slow:1".into()), |_: &JobContext| {
            JobOutcome::success("late\n").after(Duration::from_millis(500))
        });
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let created = jobs
        .create(&PostParams::default(), &job("slow", "example/slow:1", 0))
        .await
        .unwrap();
    eventually("the pod running", || async {
        job_pods(&t, &created).await.first().is_some_and(|p| {
            let status = p.status.clone().unwrap_or_default();
            status.phase.as_deref() == Some("Running")
                && status.container_statuses.unwrap_or_default()[0]
                    .state
                    .as_ref()
                    .is_some_and(|s| s.running.is_some())
        })
    })
    .await;
    let active = jobs.get("slow").await.unwrap().status.unwrap().active;
    assert_eq!(active, Some(1));
    wait_for_condition(&jobs, "slow", "Complete").await;
}

#[tokio::test]
async fn default_runner_answers_images_no_runner_matches() {
    let t = harness::start().await;
    t.namespace("ns").await;
    t.server
        .runners()
        .set_default(|ctx: &JobContext| JobOutcome::success(format!("default ran {}\n", ctx.image)));
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(&PostParams::default(), &job("any", "example/any:1", 0))
        .await
        .unwrap();
    let done = wait_for_condition(&jobs, "any", "Complete").await;
    let pod = job_pods(&t, &done).await.remove(0);
    let pods_api: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let log = pods_api
        .logs(&pod.metadata.name.unwrap(), &LogParams::default())
        .await
        .unwrap();
    assert_eq!(log, "default ran example/any:1\n");
}
