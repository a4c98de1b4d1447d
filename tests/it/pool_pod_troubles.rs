//! What the kubelet and the host say of a pool's installer pod reaches the ClusterDeployment
//! (issue 52): an image that cannot be pulled, a pod no node has room for, a pod the host's quota
//! refuses, an installer killed for its memory. Each in the cluster's `Provisioned` condition, with
//! what to do, and a Warning Event once.

use std::time::Duration;

use k8s_openapi::api::core::v1::ResourceQuota;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use stackd::embedded::controller_manager::{ImageMatch, PodFault};

use crate::harness::{until, wait_until};
use crate::pools::{WITHIN, create_pool, daemon, events, setup};
use crate::security_pools::{HOST_NAMESPACE, cluster, first_cluster, installed, installer_pool};

const UNPULLABLE_INSTALLER: &str = "quay.io/example/no-such-installer:1";

/// An installer image that cannot be pulled: the cluster says so, with what to do and a Warning
/// Event, instead of "Installer Job … is running" (issue 52).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_image_that_cannot_be_pulled_is_in_the_cluster_s_status() {
    let (fleet, tenant) = setup().await;
    fleet
        .host()
        .runners()
        .fault(ImageMatch::Exact(UNPULLABLE_INSTALLER.into()), PodFault::Unpullable);
    create_pool(&tenant, installer_pool("typo", UNPULLABLE_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "typo", &daemon).await;
    until(
        "the cluster saying the installer image cannot be pulled",
        WITHIN,
        &daemon,
        || async {
            cluster(&tenant, &name, &name).await.is_some_and(|cd| {
                cd.status.unwrap_or_default().conditions.iter().any(|c| {
                    c.type_ == "Provisioned"
                        && c.status == "False"
                        && c.reason == "InstallerPodWaiting"
                        && c.message
                            .contains("the image cannot be pulled: check the pool's spec.installerImage")
                        && c.message.contains("ImagePullBackOff")
                })
            })
        },
    )
    .await;
    until(
        "an InstallerPodWaiting Event on the cluster",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, &name, &name)
                .await
                .iter()
                .any(|(r, n)| r == "InstallerPodWaiting" && n.contains("cannot be pulled"))
        },
    )
    .await;
}

const OOM_INSTALLER: &str = "quay.io/example/greedy-installer:1";

/// An installer killed for its memory: the failed attempt says so, with the exit code and what to
/// do, not only "The installer failed" (issue 52).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_killed_for_its_memory_says_so_in_the_failed_attempt() {
    let (fleet, tenant) = setup().await;
    fleet.host().runners().fault(
        ImageMatch::Exact(OOM_INSTALLER.into()),
        PodFault::CrashLoop {
            exit_code: 137,
            reason: "OOMKilled",
        },
    );
    create_pool(&tenant, installer_pool("greedy", OOM_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "greedy", &daemon).await;
    let said = |message: &str| {
        message.contains("The installer failed (attempt 1 of")
            && message.contains("the container ran out of memory: give it a larger memory limit")
            && message.contains("container installer: OOMKilled (last exit code 137)")
    };
    until(
        "the failed attempt saying how the installer ended",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, &name, &name)
                .await
                .iter()
                .any(|(r, n)| r == "InstallFailed" && said(n))
        },
    )
    .await;
}

const CRAMPED_INSTALLER: &str = "quay.io/example/cramped-installer:1";

/// An installer pod no node has room for: the cluster says so, with what to do, and a Warning
/// Event, instead of "Installer Job … is running".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_pod_that_cannot_be_scheduled_is_in_the_cluster_s_status() {
    let (fleet, tenant) = setup().await;
    fleet
        .host()
        .runners()
        .fault(ImageMatch::Exact(CRAMPED_INSTALLER.into()), PodFault::Unschedulable);
    create_pool(&tenant, installer_pool("cramped", CRAMPED_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "cramped", &daemon).await;
    until(
        "the cluster saying its installer pod cannot be scheduled",
        WITHIN,
        &daemon,
        || async {
            cluster(&tenant, &name, &name).await.is_some_and(|cd| {
                cd.status.unwrap_or_default().conditions.iter().any(|c| {
                    c.type_ == "Provisioned"
                        && c.status == "False"
                        && c.reason == "InstallerPodWaiting"
                        && c.message.contains("the pod cannot be scheduled")
                        && c.message.contains("0/1 nodes are available")
                })
            })
        },
    )
    .await;
    until(
        "an InstallerPodWaiting Event on the cluster",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, &name, &name)
                .await
                .iter()
                .any(|(r, n)| r == "InstallerPodWaiting" && n.contains("cannot be scheduled"))
        },
    )
    .await;
}

/// An installer Job whose pod the host's quota refuses (the Job controller's Warning Event
/// `FailedCreate` on the Job; the Job stays active with no pod): the cluster says so with the API
/// server's words and what to do, and a Warning Event once; with room again the pod is made and
/// the cluster installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_pod_the_host_quota_refuses_is_in_the_cluster_s_status() {
    let (fleet, tenant) = setup().await;
    let daemon = daemon(&fleet, &[]);
    // The operator's own quota in the tenant's host namespace, used up.
    let quotas: Api<ResourceQuota> = Api::namespaced(fleet.host_client.clone(), HOST_NAMESPACE);
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "operator-pods"}, "spec": {"hard": {"pods": "0"}}
    }))
    .unwrap();
    wait_until("the tenant's host namespace", Duration::from_secs(20), &daemon, || {
        let (quotas, quota) = (quotas.clone(), quota.clone());
        async move { quotas.create(&Default::default(), &quota).await.ok().map(|_| ()) }
    })
    .await;
    create_pool(&tenant, crate::pools::pool_json("crowded", 1, None)).await;
    let name = first_cluster(&tenant, "crowded", &daemon).await;
    let refused = |message: &str| {
        message.contains("The host refuses to create the pod of installer Job")
            && message.contains("the tenant's host quota is used up")
            && message.contains("exceeded quota: operator-pods, requested: pods=1, used: pods=0, limited: pods=0")
    };
    until(
        "the cluster saying the host refuses its installer pod",
        WITHIN,
        &daemon,
        || async {
            cluster(&tenant, &name, &name).await.is_some_and(|cd| {
                cd.status.unwrap_or_default().conditions.iter().any(|c| {
                    c.type_ == "Provisioned"
                        && c.status == "False"
                        && c.reason == "InstallerPodRefused"
                        && refused(&c.message)
                })
            })
        },
    )
    .await;
    until(
        "an InstallerPodRefused Event on the cluster",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, &name, &name)
                .await
                .iter()
                .any(|(r, n)| r == "InstallerPodRefused" && refused(n))
        },
    )
    .await;
    // Room again: the pod is made and the cluster installed.
    quotas
        .patch(
            "operator-pods",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"hard": {"pods": "10"}}})),
        )
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

const ROOT_INSTALLER: &str = "quay.io/example/root-installer:1";

/// An installer container the kubelet cannot create (a root image under `runAsNonRoot`): the
/// cluster says so with the kubelet's words and what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_container_that_cannot_be_created_is_in_the_cluster_s_status() {
    let (fleet, tenant) = setup().await;
    fleet.host().runners().fault(
        ImageMatch::Exact(ROOT_INSTALLER.into()),
        PodFault::ConfigError {
            message: "container has runAsNonRoot and image will run as root",
        },
    );
    create_pool(&tenant, installer_pool("rooted", ROOT_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "rooted", &daemon).await;
    until(
        "the cluster saying its installer container cannot be created",
        WITHIN,
        &daemon,
        || async {
            cluster(&tenant, &name, &name).await.is_some_and(|cd| {
                cd.status.unwrap_or_default().conditions.iter().any(|c| {
                    c.type_ == "Provisioned"
                        && c.reason == "InstallerPodWaiting"
                        && c.message.contains("build it with a numeric non-root USER")
                        && c.message.contains(
                            "CreateContainerConfigError: container has runAsNonRoot and image will run as root",
                        )
                })
            })
        },
    )
    .await;
}

const FAILING_INSTALLER: &str = "quay.io/example/failing-installer:1";

/// An installer that exits with an error: the failed attempt says how, with the exit code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_exiting_with_an_error_says_its_exit_code_in_the_failed_attempt() {
    let (fleet, tenant) = setup().await;
    fleet.host().runners().fault(
        ImageMatch::Exact(FAILING_INSTALLER.into()),
        PodFault::CrashLoop {
            exit_code: 3,
            reason: "Error",
        },
    );
    create_pool(&tenant, installer_pool("failing", FAILING_INSTALLER)).await;
    let daemon = daemon(&fleet, &[]);
    let name = first_cluster(&tenant, "failing", &daemon).await;
    until(
        "the failed attempt saying how the installer ended",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, &name, &name).await.iter().any(|(r, n)| {
                r == "InstallFailed"
                    && n.contains("The installer failed (attempt 1 of")
                    && n.contains("container installer: Error (last exit code 3)")
            })
        },
    )
    .await;
}
