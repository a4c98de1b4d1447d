//! The sample-image Job runners `stackd dev` uses: stack install Jobs and the installer.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, LogParams, PostParams};
use serde_json::json;
use stackd::embedded::samples::{SampleImages, register_sample_runners};
use stackd::stacks::stream;

use crate::harness::{self, NoDaemon, TestServer, wait_until};

/// How long a sample Job may take to finish (200 polls of 50 ms before).
const JOB_WITHIN: Duration = Duration::from_secs(10);

const STACKD_IMAGE: &str = "stackd.dev/stackd:dev";

async fn with_samples() -> TestServer {
    let t = harness::start().await;
    register_sample_runners(&t.server.runners(), &SampleImages::new(STACKD_IMAGE));
    t.namespace("ns").await;
    t
}

/// An install Job as the daemon builds it (src/stacks/install/job.rs): stackd's binary is copied
/// for the package image, which copies its `.registry` out with it.
fn install_job(name: &str, package: &str, scope: &str) -> Job {
    let copy = json!(stackd::stacks::copy::copy_command("/.registry", "/ext-pkg/.registry"));
    job_copying_with(name, package, scope, copy)
}

fn job_copying_with(name: &str, package: &str, scope: &str, command: serde_json::Value) -> Job {
    let tools = json!({"name": "stackd-tools", "mountPath": "/stackd-tools"});
    let pkg = json!({"name": "package", "mountPath": "/ext-pkg"});
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": 600, "template": {"spec": {
            "restartPolicy": "Never",
            "volumes": [{"name": "stackd-tools", "emptyDir": {}}, {"name": "package", "emptyDir": {}}],
            "initContainers": [
                {"name": "stackd-tools", "image": STACKD_IMAGE, "args": ["copy-self", "/stackd-tools/stackd"],
                 "volumeMounts": [tools]},
                {"name": "package", "image": package, "command": command, "volumeMounts": [pkg, tools]},
            ],
            "containers": [{"name": "unpack", "image": STACKD_IMAGE,
                "args": ["unpack", "--content-dir", "/ext-pkg/.registry", "--permission-scope", scope],
                "env": [{"name": "STACK_IMAGE", "value": package}],
                "volumeMounts": [pkg]}],
        }}},
    }))
    .unwrap()
}

/// Waits for the Job to finish; returns its only pod and whether it succeeded.
async fn finished(t: &TestServer, name: &str) -> (Pod, bool) {
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let (job, complete) = wait_until(&format!("Job {name} to finish"), JOB_WITHIN, &NoDaemon, || async {
        let job = jobs.get(name).await.unwrap();
        let conditions = job
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let finished = conditions.iter().find(|c| c.status == "True")?;
        Some((job, finished.type_ == "Complete"))
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let uid = job.metadata.uid.unwrap();
    let mut found = pods
        .list(&ListParams::default().labels(&format!("controller-uid={uid}")))
        .await
        .unwrap()
        .items;
    (found.remove(0), complete)
}

async fn log(t: &TestServer, pod: &Pod, container: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(t.client.clone(), "ns");
    let params = LogParams {
        container: Some(container.into()),
        limit_bytes: Some(stream::LOG_LIMIT_BYTES),
        ..LogParams::default()
    };
    pods.logs(pod.metadata.name.as_deref().unwrap(), &params).await.unwrap()
}

#[tokio::test]
async fn sample_runners_turn_the_sample_package_job_into_a_log_the_stream_decoder_accepts() {
    let t = with_samples().await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(
        &PostParams::default(),
        &install_job("sample-install", "stackd-examples/sample-stack:v0.1.0", "Namespaced"),
    )
    .await
    .unwrap();
    let (pod, succeeded) = finished(&t, "sample-install").await;
    let text = log(&t, &pod, "unpack").await;
    assert!(succeeded, "{text}");
    let contents = stream::decode(&text, usize::MAX).expect("the log is a valid install stream");
    assert!(!contents.crds.is_empty());
    assert_eq!(
        log(&t, &pod, "package").await,
        "",
        "the copying init container succeeded silently"
    );
}

#[tokio::test]
async fn a_package_image_has_no_cp_so_only_stackds_copy_gets_its_files_out() {
    let t = with_samples().await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let cp = json!(["cp", "-R", "/.registry", "/ext-pkg/"]);
    let package = "stackd-examples/sample-stack:v0.1.0";
    jobs.create(
        &PostParams::default(),
        &job_copying_with("cp", package, "Namespaced", cp),
    )
    .await
    .unwrap();
    let (pod, succeeded) = finished(&t, "cp").await;
    assert!(!succeeded);
    let status = &pod.status.clone().unwrap().init_container_statuses.unwrap()[1];
    let terminated = status.state.as_ref().unwrap().terminated.as_ref().unwrap();
    assert_eq!(terminated.exit_code, 128);
    assert!(log(&t, &pod, "package").await.contains("\"cp\""));
}

#[tokio::test]
async fn sample_cluster_stack_installs_only_with_the_cluster_scope() {
    let t = with_samples().await;
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    let package = "registry.local:5000/stackd-examples/cluster-stack:v1";
    jobs.create(&PostParams::default(), &install_job("wrong", package, "Namespaced"))
        .await
        .unwrap();
    jobs.create(&PostParams::default(), &install_job("right", package, "Cluster"))
        .await
        .unwrap();
    let (wrong, succeeded) = finished(&t, "wrong").await;
    assert!(!succeeded);
    assert!(log(&t, &wrong, "unpack").await.contains("permissionScope"));
    let (right, succeeded) = finished(&t, "right").await;
    assert!(succeeded);
    stream::decode(&log(&t, &right, "unpack").await, usize::MAX).unwrap();
}

fn installer_job(name: &str, args: &[&str]) -> Job {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "installer", "image": "quay.io/example/installer:4.14", "args": args,
                "env": [{"name": "STACKD_OUTPUT_SECRET", "value": "cd-output"},
                        {"name": "STACKD_OUTPUT_NAMESPACE", "value": "ns"}]}],
        }}},
    }))
    .unwrap()
}

#[tokio::test]
async fn sample_installer_writes_kubeconfig_and_metadata_into_its_output_secret_and_destroys() {
    let t = with_samples().await;
    let secrets: Api<Secret> = Api::namespaced(t.client.clone(), "ns");
    let jobs: Api<Job> = Api::namespaced(t.client.clone(), "ns");
    jobs.create(
        &PostParams::default(),
        &installer_job("early", &["create", "cluster", "--dir", "/installer"]),
    )
    .await
    .unwrap();
    let (_, succeeded) = finished(&t, "early").await;
    assert!(!succeeded, "the output Secret must be pre-created");

    let output: Secret = serde_json::from_value(json!({"metadata": {"name": "cd-output"}})).unwrap();
    secrets.create(&PostParams::default(), &output).await.unwrap();
    jobs.create(
        &PostParams::default(),
        &installer_job("cd-install", &["create", "cluster", "--dir", "/installer"]),
    )
    .await
    .unwrap();
    let (_, succeeded) = finished(&t, "cd-install").await;
    assert!(succeeded);
    let data = secrets.get("cd-output").await.unwrap().data.unwrap();
    let metadata: serde_json::Value = serde_json::from_slice(&data["metadata.json"].0).unwrap();
    assert!(metadata["infraID"].as_str().unwrap().starts_with("cd-install-"));
    let kubeconfig: kube::config::Kubeconfig =
        serde_saphyr::from_str(std::str::from_utf8(&data["kubeconfig"].0).unwrap()).unwrap();
    assert_eq!(kubeconfig.clusters.len(), 1);

    jobs.create(
        &PostParams::default(),
        &installer_job("cd-destroy", &["destroy", "cluster"]),
    )
    .await
    .unwrap();
    assert!(finished(&t, "cd-destroy").await.1);
}
