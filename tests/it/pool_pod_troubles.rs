//! What the kubelet and the host say of a pool's installer pod reaches the ClusterDeployment
//! (issue 52): an image that cannot be pulled, a container that cannot be created, a pod no node has
//! room for or the host's quota refuses (each the cluster's `Provisioned=False` condition, with what
//! to do, and a Warning Event once), and how an installer that ran ended (in its failed attempt).

use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use stackd::embedded::controller_manager::{ImageMatch, PodFault};

use crate::harness::{Daemon, Fleet, until};
use crate::pod_troubles::used_up_quota;
use crate::pools::{WITHIN, create_pool, daemon, events, pool_json, setup};
use crate::security_pools::{cluster, first_cluster, installed, installer_pool};

/// A daemon serving a pool `pool` of one cluster whose installer `image` meets `fault`; the name of
/// that cluster (also its namespace's).
async fn faulty_installer(pool: &str, image: &str, fault: PodFault) -> (Fleet, Client, Daemon, String) {
    let (fleet, tenant) = setup().await;
    fleet.host().runners().fault(ImageMatch::Exact(image.into()), fault);
    create_pool(&tenant, installer_pool(pool, image)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, pool, &daemon).await;
    (fleet, tenant, daemon, name)
}

/// Waits until cluster `name` is `Provisioned=False` for `reason`, saying every one of `said`.
async fn wait_not_provisioned(tenant: &Client, daemon: &Daemon, name: &str, reason: &str, said: &[&str]) {
    until(&format!("the cluster {reason}"), WITHIN, daemon, || async {
        cluster(tenant, name, name).await.is_some_and(|cd| {
            cd.status.unwrap_or_default().conditions.iter().any(|c| {
                c.type_ == "Provisioned"
                    && c.status == "False"
                    && c.reason == reason
                    && said.iter().all(|fragment| c.message.contains(fragment))
            })
        })
    })
    .await;
}

/// Waits until cluster `name` has an Event for `reason` saying every one of `said`.
async fn wait_for_event(tenant: &Client, daemon: &Daemon, name: &str, reason: &str, said: &[&str]) {
    until(&format!("a {reason} Event on the cluster"), WITHIN, daemon, || async {
        events(tenant, name, name)
            .await
            .iter()
            .any(|(r, note)| r == reason && said.iter().all(|fragment| note.contains(fragment)))
    })
    .await;
}

/// An installer image that cannot be pulled: the cluster says so, with what to do and a Warning
/// Event, instead of "Installer Job … is running".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_image_that_cannot_be_pulled_is_in_the_cluster_s_status() {
    let image = "quay.io/example/no-such-installer:1";
    let (_fleet, tenant, daemon, name) = faulty_installer("typo", image, PodFault::Unpullable).await;
    let said = [
        "the image cannot be pulled: check the pool's spec.installerImage",
        "ImagePullBackOff",
    ];
    wait_not_provisioned(&tenant, &daemon, &name, "InstallerPodWaiting", &said).await;
    // Told when the kubelet first said it (`ErrImagePull`, before the back-off).
    wait_for_event(&tenant, &daemon, &name, "InstallerPodWaiting", &said[..1]).await;
}

/// An installer container the kubelet cannot create (a root image under `runAsNonRoot`): the
/// cluster says so with the kubelet's words and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_container_that_cannot_be_created_is_in_the_cluster_s_status() {
    let fault = PodFault::ConfigError {
        message: "container has runAsNonRoot and image will run as root",
    };
    let image = "quay.io/example/root-installer:1";
    let (_fleet, tenant, daemon, name) = faulty_installer("rooted", image, fault).await;
    let said = [
        "build it with a numeric non-root USER",
        "CreateContainerConfigError: container has runAsNonRoot and image will run as root",
    ];
    wait_not_provisioned(&tenant, &daemon, &name, "InstallerPodWaiting", &said).await;
}

/// An installer pod no node has room for: the cluster says so, with what to do, and a Warning
/// Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_pod_that_cannot_be_scheduled_is_in_the_cluster_s_status() {
    let image = "quay.io/example/cramped-installer:1";
    let (_fleet, tenant, daemon, name) = faulty_installer("cramped", image, PodFault::Unschedulable).await;
    let said = ["the pod cannot be scheduled", "0/1 nodes are available"];
    wait_not_provisioned(&tenant, &daemon, &name, "InstallerPodWaiting", &said).await;
    wait_for_event(&tenant, &daemon, &name, "InstallerPodWaiting", &said).await;
}

/// An installer killed for its memory: the failed attempt says so, with the exit code and what to
/// do, not only "The installer failed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_killed_for_its_memory_says_so_in_the_failed_attempt() {
    let fault = PodFault::CrashLoop {
        exit_code: 137,
        reason: "OOMKilled",
    };
    let image = "quay.io/example/greedy-installer:1";
    let (_fleet, tenant, daemon, name) = faulty_installer("greedy", image, fault).await;
    let said = [
        "The installer failed (attempt 1 of",
        "the container ran out of memory: give it a larger memory limit",
        "container installer: OOMKilled (last exit code 137)",
    ];
    wait_for_event(&tenant, &daemon, &name, "InstallFailed", &said).await;
}

/// An installer that exits with an error: the failed attempt says how, with the exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_exiting_with_an_error_says_its_exit_code_in_the_failed_attempt() {
    let fault = PodFault::CrashLoop {
        exit_code: 3,
        reason: "Error",
    };
    let image = "quay.io/example/failing-installer:1";
    let (_fleet, tenant, daemon, name) = faulty_installer("failing", image, fault).await;
    let said = [
        "The installer failed (attempt 1 of",
        "container installer: Error (last exit code 3)",
    ];
    wait_for_event(&tenant, &daemon, &name, "InstallFailed", &said).await;
}

/// An installer Job whose pod the host's quota refuses (the Job controller's Warning Event
/// `FailedCreate` on the Job; the Job stays active with no pod): the cluster says so with the API
/// server's words and what to do, and a Warning Event once; with room again the pod is made and
/// the cluster installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_pod_the_host_quota_refuses_is_in_the_cluster_s_status() {
    let (fleet, tenant) = setup().await;
    let daemon = daemon(&fleet, &[]);
    let quotas = used_up_quota(&fleet.host_client, &daemon).await;
    create_pool(&tenant, pool_json("crowded", 1, None)).await;
    let name = first_cluster(&tenant, "crowded", &daemon).await;
    // The pod's name is the Job controller's new try each time: left out, so it reads the same.
    let forbidden = format!(
        "pods \"{name}.{name}-install-0-…\" is forbidden: exceeded quota: operator-pods, requested: pods=1, used: pods=0, limited: pods=0"
    );
    let said = [
        "The host refuses to create the pod of installer Job",
        "the tenant's host quota is used up",
        forbidden.as_str(),
    ];
    wait_not_provisioned(&tenant, &daemon, &name, "InstallerPodRefused", &said).await;
    wait_for_event(&tenant, &daemon, &name, "InstallerPodRefused", &said).await;
    // Room again: the pod is made and the cluster installed.
    let room = Patch::Merge(json!({"spec": {"hard": {"pods": "10"}}}));
    quotas
        .patch("operator-pods", &PatchParams::default(), &room)
        .await
        .unwrap();
    until("the cluster installed", WITHIN, &daemon, || async {
        cluster(&tenant, &name, &name).await.is_some_and(|cd| installed(&cd))
    })
    .await;
    // Told once, whatever the number of looks: one Event, never repeated as a series.
    let told: Api<Event> = Api::namespaced(tenant.clone(), &name);
    let refusals: i32 = told
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("InstallerPodRefused"))
        .map(|e| e.series.map_or(1, |series| series.count))
        .sum();
    assert_eq!(refusals, 1);
}
