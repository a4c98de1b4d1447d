//! Capped host names (DESIGN.md §2; issue 28): two tenant namespaces sharing a long prefix are told
//! apart by the hash in their host names, now 80 bits (a 40-bit one could be collided on a GPU in
//! minutes, leaving the victim with `HostObjectConflict`). Host objects an older stackd named with
//! the 40-bit hash are moved to their current names when the tenant starts: never left behind
//! beside a second copy, and a Secret an installer filled keeps its data.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::pools::ClusterDeployment;
use stackd::api::stacks::StackInstall;
use stackd::host::Parent;
use stackd::host::names::{NameKind, host_name, legacy_host_name};

use crate::harness::{Daemon, until};
use crate::stacks_install::{StackFleet, create_install, wait_for_reason};

/// A namespace whose install Job names are capped at 63 characters.
const LONG_NS: &str = "a-namespace-long-enough-that-install-job-names-get-capped";
const HOST_NS: &str = "tenant-acme-controllers";

/// The host namespace as an older stackd left it.
async fn host_namespace(host: &Client) {
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": HOST_NS,
        "labels": {"app.kubernetes.io/managed-by": "stackd", "stackd.dev/tenant": "acme"}}}))
    .expect("namespace");
    Api::<Namespace>::all(host.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("host namespace");
}

fn stamped(parent: &Parent, name: &str) -> serde_json::Value {
    json!({"name": name, "namespace": HOST_NS, "labels": parent.labels("acme"), "annotations": parent.annotations()})
}

/// A ClusterDeployment with a name so long that its host Secrets' names are capped too.
async fn long_named_cluster(tenant: &Client) -> ClusterDeployment {
    let name = "c".repeat(250);
    let cd: ClusterDeployment = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": LONG_NS},
        "spec": {
            "clusterName": "c",
            "baseDomain": "example.com",
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "install-config"}, "installerImage": "example.com/installer:1"},
        },
    }))
    .expect("cluster");
    Api::<ClusterDeployment>::namespaced(tenant.clone(), LONG_NS)
        .create(&PostParams::default(), &cd)
        .await
        .expect("create cluster")
}

async fn job_names(jobs: &Api<Job>, install: &Parent) -> Vec<String> {
    let params = ListParams::default().labels(&install.selector("acme"));
    let mut names: Vec<String> = jobs
        .list(&params)
        .await
        .expect("jobs")
        .items
        .iter()
        .map(|j| j.name_any())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_objects_named_with_the_old_40_bit_hash_move_to_their_current_names_on_upgrade() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let install = create_install(
        &tenant,
        LONG_NS,
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let cluster = long_named_cluster(&tenant).await;

    // What an older stackd left on the host: the install's Job and the cluster's filled output
    // Secret under their 40-bit names.
    host_namespace(&fleet.host_client).await;
    let install_parent = Parent::new("StackInstall", Some(LONG_NS), "sample", &install.uid().unwrap());
    let old_job = legacy_host_name(Some(LONG_NS), "sample", "-install", NameKind::LabelBound).expect("capped");
    let job: Job = serde_json::from_value(json!({"metadata": stamped(&install_parent, &old_job), "spec": {
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "unpack", "image": "example.com/old:1"}]}},
    }}))
    .expect("job");
    let jobs = fleet.host_jobs("acme");
    jobs.create(&PostParams::default(), &job).await.expect("old job");
    let cluster_parent = Parent::new(
        "ClusterDeployment",
        Some(LONG_NS),
        &cluster.name_any(),
        &cluster.uid().unwrap(),
    );
    let old_output = legacy_host_name(Some(LONG_NS), &cluster.name_any(), "-output", NameKind::Object).expect("capped");
    let data = BTreeMap::from([(
        "metadata.json".to_string(),
        ByteString(br#"{"infraID":"c-1"}"#.to_vec()),
    )]);
    let output: Secret =
        serde_json::from_value(json!({"metadata": stamped(&cluster_parent, &old_output)})).expect("secret");
    let output = Secret {
        data: Some(data.clone()),
        ..output
    };
    let secrets = fleet.host_secrets("acme");
    secrets
        .create(&PostParams::default(), &output)
        .await
        .expect("old output");

    let daemon: Daemon = fleet.daemon(&[]);
    let (_, reason, message) = wait_for_reason(&tenant, LONG_NS, "sample", &daemon, "Available").await;
    assert_eq!(reason, "Available", "{message}");
    let new_job = host_name(Some(LONG_NS), "sample", "-install", NameKind::LabelBound);
    // The old Job is deleted and the install runs again under the current name; that Job is then
    // removed too, as every completed install Job is, so only the status keeps its name.
    until("the old Job gone", Duration::from_secs(10), &daemon, || async {
        job_names(&jobs, &install_parent).await.is_empty()
    })
    .await;
    let install = Api::<StackInstall>::namespaced(tenant.clone(), LONG_NS)
        .get("sample")
        .await
        .expect("install");
    let ran = install.status.and_then(|s| s.install_job).expect("installJob");
    assert_eq!(ran.name, new_job, "the install ran again under its current name");

    let new_output = host_name(Some(LONG_NS), &cluster.name_any(), "-output", NameKind::Object);
    let moved = secrets
        .get(&new_output)
        .await
        .expect("the output under its current name");
    assert_eq!(moved.data, Some(data), "what the installer wrote is kept");
    assert_eq!(moved.labels(), output.labels());
    assert!(
        secrets.get_opt(&old_output).await.expect("get").is_none(),
        "the old name is gone"
    );
    assert!(
        daemon
            .log_text()
            .contains("moved a host object named by an older stackd"),
        "{}",
        daemon.log_text()
    );
}
