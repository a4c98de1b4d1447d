//! What the kubelet says about the pods stackd runs for a tenant reaches the tenant object that
//! caused them (issue 52): the host's controller manager reports the kubelet's waiting reasons for
//! images the test names (`Runners::fault`), in the fields a kubelet writes.

use std::time::Duration;

use k8s_openapi::api::core::v1::ResourceQuota;
use kube::Api;
use serde_json::json;
use stackd::api::stacks::StackInstall;
use stackd::embedded::controller_manager::{ImageMatch, PodFault};

use crate::harness::{Daemon, LastSeen, holds_for, wait_until};
use crate::stacks_install::{StackFleet, condition, create_install, events_of, wait_for_reason};

/// Waits until the install's `Ready` condition has `reason` and a message containing `fragment`.
async fn wait_for_message(
    fleet: &StackFleet,
    daemon: &crate::harness::Daemon,
    (namespace, name): (&str, &str),
    reason: &str,
    fragment: &str,
) -> String {
    let api: Api<StackInstall> = Api::namespaced(fleet.tenant("acme"), namespace);
    let last = LastSeen::new(daemon);
    wait_until(
        &format!("{namespace}/{name} Ready {reason} saying {fragment:?}"),
        Duration::from_secs(20),
        &last,
        || async {
            let ready = condition(&api.get_opt(name).await.ok()??, "Ready");
            last.saw(&ready);
            let (status, got, message) = ready?;
            (status == "False" && got == reason && message.contains(fragment)).then_some(message)
        },
    )
    .await
}

/// A daemon (with `args`) serving acme, and its install team-a/`name` of `package`, an image whose
/// pod meets `fault`.
async fn faulty_install(
    name: &str,
    package: &str,
    fault: PodFault,
    args: &[&str],
) -> (StackFleet, kube::Client, Daemon) {
    let fleet = StackFleet::start(&["acme"]).await;
    // The Job names the image as the host pulls it (with the default registry, if any).
    let named = package.to_string();
    let image = ImageMatch::Predicate(std::sync::Arc::new(move |image| image.ends_with(&named)));
    fleet._host.runners().fault(image, fault);
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(args);
    create_install(&tenant, "team-a", name, json!({ "package": package })).await;
    (fleet, tenant, daemon)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_package_cannot_be_pulled_says_so_then_fails_and_is_retried() {
    let args = ["--pull-failure-grace", "3s"];
    let package = "examples/no-such-package:v1";
    let (fleet, tenant, daemon) = faulty_install("typo", package, PodFault::Unpullable, &args).await;
    let at = ("team-a", "typo");
    // Not "unpacking": what the kubelet says, and what to do about it.
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodWaiting", "ImagePullBackOff").await;
    assert!(
        message.contains("the image cannot be pulled: check spec.package and its imagePullSecrets"),
        "{message}"
    );
    assert!(message.contains("examples/no-such-package:v1"), "{message}");
    wait_for_event(
        &tenant,
        &daemon,
        "typo",
        "InstallPodWaiting",
        "the image cannot be pulled",
    )
    .await;
    // After the grace, the attempt is final, with its own reason, and retried with backoff.
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "typo", &daemon, "PackagePullFailed").await;
    assert_eq!(status, "False");
    assert!(message.contains("check spec.package"), "{message}");
    let install = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .get("typo")
        .await
        .unwrap();
    let synced = condition(&install, "Synced").expect("Synced");
    assert_eq!((synced.0.as_str(), synced.1.as_str()), ("False", "PackagePullFailed"));
    let jobs = fleet.host_jobs("acme");
    wait_until("a retried install Job", Duration::from_secs(20), &daemon, || {
        let jobs = jobs.clone();
        async move {
            let job = jobs.get_opt("team-a.typo-install").await.ok()??;
            let attempt: u32 = kube::ResourceExt::annotations(&job)
                .get("stacks.stackd.dev/attempt")?
                .parse()
                .ok()?;
            (attempt >= 2).then_some(())
        }
    })
    .await;
    // A later attempt that cannot pull either stays failed: it does not go back to waiting.
    wait_for_message(&fleet, &daemon, at, "PackagePullFailed", "gives up at").await;
    // Fixing the package installs it.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .patch(
            "typo",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"package": "examples/sample-stack:v1"}})),
        )
        .await
        .unwrap();
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "typo", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
    // The waiting was told once (ErrImagePull then ImagePullBackOff is no change of reason), and
    // each attempt's pull failure was not told again on every reconcile.
    let events = events_of(&tenant, "team-a", "typo").await;
    let told = |reason: &str| events.iter().filter(|(r, _)| r == reason).count();
    assert_eq!(told("InstallPodWaiting"), 1, "{events:?}");
}

/// An install Job whose pod no node has room for says so, with what to do, and a Warning Event,
/// not "unpacking" (issue 52).
#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_pod_cannot_be_scheduled_says_so() {
    let package = "examples/huge-package:v1";
    let (fleet, tenant, daemon) = faulty_install("huge", package, PodFault::Unschedulable, &[]).await;
    let at = ("team-a", "huge");
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodWaiting", "Unschedulable").await;
    assert!(
        message.contains("the pod cannot be scheduled") && message.contains("0/1 nodes are available"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "huge", "InstallPodWaiting", "cannot be scheduled").await;
}

/// Waits until the install's Events hold one of `reason` whose note contains `fragment`.
async fn wait_for_event(
    tenant: &kube::Client,
    daemon: &crate::harness::Daemon,
    name: &str,
    reason: &str,
    fragment: &str,
) {
    wait_until(&format!("a {reason} Event"), Duration::from_secs(10), daemon, || {
        let tenant = tenant.clone();
        async move {
            let events = events_of(&tenant, "team-a", name).await;
            events
                .iter()
                .any(|(r, note)| r == reason && note.contains(fragment))
                .then_some(())
        }
    })
    .await;
}

/// An install Job whose container the kubelet cannot create (a root package image under the
/// Job's runAsNonRoot) says so with what to do, not "unpacking", and tells it once (issue 52).
#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_container_cannot_be_created_says_so() {
    let fault = PodFault::ConfigError {
        message: "container has runAsNonRoot and image will run as root (pod: \"x\", container: package)",
    };
    let (fleet, tenant, daemon) = faulty_install("rooted", "examples/rooted-package:v1", fault, &[]).await;
    let at = ("team-a", "rooted");
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodWaiting", "CreateContainerConfigError").await;
    assert!(
        message.contains("the package image runs as root") && message.contains("non-root USER"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "rooted", "InstallPodWaiting", "runs as root").await;
    // Reconciled again (an edit of its labels), the same trouble is not told again.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .patch(
            "rooted",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    holds_for("the trouble told once", Duration::from_millis(500), &daemon, || {
        let tenant = tenant.clone();
        async move {
            let events = events_of(&tenant, "team-a", "rooted").await;
            events.iter().filter(|(r, _)| r == "InstallPodWaiting").count() == 1
        }
    })
    .await;
}

/// An install Job whose unpack container is killed for its memory fails as `InstallOutOfMemory`
/// with what to do, not with an empty log (retried with backoff like any failed attempt).
#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_unpack_runs_out_of_memory_says_so() {
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.runners().fault(
        ImageMatch::Exact(crate::stacks_install::STACKD_TEST_IMAGE.into()),
        PodFault::CrashLoop {
            exit_code: 137,
            reason: "OOMKilled",
        },
    );
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, "team-a", "big", json!({"package": "examples/sample-stack:v1"})).await;
    let at = ("team-a", "big");
    let message = wait_for_message(&fleet, &daemon, at, "InstallOutOfMemory", "OOMKilled").await;
    assert!(
        message.contains("ran out of memory") && message.contains("ask the operator") && message.contains("137"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "big", "InstallOutOfMemory", "ran out of memory").await;
    let install = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .get("big")
        .await
        .unwrap();
    let synced = condition(&install, "Synced").expect("Synced");
    assert_eq!((synced.0.as_str(), synced.1.as_str()), ("False", "InstallOutOfMemory"));
}

/// The install Job's pull-secret copies exist before the Job does, so its pod's first pull has
/// its credentials (issue 52); once the Job exists they are owned by it.
#[tokio::test(flavor = "multi_thread")]
async fn the_pull_secret_copies_exist_before_the_install_job_and_are_owned_by_it() {
    use stackd::embedded::store::GroupResource;
    use std::sync::{Arc, Mutex};
    let fleet = StackFleet::start(&["acme"]).await;
    // The pull secrets the Job's pod names that are missing at the Job's creation.
    let missing: Arc<Mutex<Option<Vec<String>>>> = Arc::default();
    let (store, seen) = (fleet._host.store(), missing.clone());
    fleet._host.admission().mutate("batch", "jobs", move |job| {
        let mut seen = seen.lock().unwrap();
        if seen.is_some() {
            return;
        }
        let names = job["spec"]["template"]["spec"]["imagePullSecrets"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let secrets = GroupResource::new("", "secrets");
        *seen = Some(
            names
                .iter()
                .filter_map(|n| n["name"].as_str())
                .filter(|name| !store.contains(&secrets, "tenant-acme-controllers", name))
                .map(String::from)
                .collect(),
        );
    });
    // Each (copy, owner uid) the host stored: the copy goes with its Job once the package is applied.
    let owned: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let record = owned.clone();
    fleet._host.admission().mutate("", "secrets", move |secret| {
        for owner in secret["metadata"]["ownerReferences"].as_array().into_iter().flatten() {
            let name = secret["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let uid = owner["uid"].as_str().unwrap_or_default().to_string();
            record.lock().unwrap().push((name, uid));
        }
    });
    let tenant = fleet.tenant("acme");
    crate::stacks_install::pull_secret(&tenant, "team-a").await;
    let seen_secrets = crate::stacks_install::Seen::start(fleet.host_secrets("acme"));
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "private",
        json!({"package": "examples/sample-stack:v1", "imagePullSecrets": [{"name": "creds"}]}),
    )
    .await;
    let job = fleet.host_jobs("acme");
    let job = wait_until("the install Job", Duration::from_secs(20), &daemon, || {
        let job = job.clone();
        async move { job.get_opt("team-a.private-install").await.ok()? }
    })
    .await;
    assert_eq!(
        missing.lock().unwrap().clone(),
        Some(vec![]),
        "pull secrets the install Job's pod uses were missing when the Job was created"
    );
    let uid = kube::ResourceExt::uid(&job).unwrap();
    let name = job.spec.unwrap().template.spec.unwrap().image_pull_secrets.unwrap()[0]
        .name
        .clone();
    wait_until("the copy owned by the Job", Duration::from_secs(20), &daemon, || {
        let owned = owned.lock().unwrap().contains(&(name.clone(), uid.clone()));
        async move { owned.then_some(()) }
    })
    .await;
    assert!(
        seen_secrets
            .all()
            .iter()
            .any(|s| kube::ResourceExt::name_any(s) == name)
    );
}

/// The operator's own quota in acme's host namespace (`operator-pods`), used up: made once the
/// daemon has made the namespace.
pub(crate) async fn used_up_quota(host: &kube::Client, daemon: &Daemon) -> Api<ResourceQuota> {
    let quotas: Api<ResourceQuota> = Api::namespaced(host.clone(), "tenant-acme-controllers");
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "operator-pods"}, "spec": {"hard": {"pods": "0"}}
    }))
    .expect("a quota");
    wait_until("the tenant's host namespace", Duration::from_secs(20), daemon, || {
        let (quotas, quota) = (quotas.clone(), quota.clone());
        async move { quotas.create(&Default::default(), &quota).await.ok().map(|_| ()) }
    })
    .await;
    quotas
}

/// An install Job whose pod the host's quota refuses (the Job controller's Warning Event
/// `FailedCreate` on the Job; the Job stays active with no pod) says so in the install's status
/// with the API server's words and what to do, and a Warning Event once; with room again the
/// pod is made and the install goes on (issue 52).
#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_pod_the_host_quota_refuses_says_so() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let quotas = used_up_quota(&fleet.host_client, &daemon).await;
    create_install(
        &tenant,
        "team-a",
        "crowded",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let at = ("team-a", "crowded");
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodRefused", "exceeded quota").await;
    assert!(
        message.contains("the tenant's host quota is used up: remove workloads")
            && message.contains("ask the operator to raise it")
            && message.contains("exceeded quota: operator-pods, requested: pods=1, used: pods=0, limited: pods=0"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "crowded", "InstallPodRefused", "quota is used up").await;
    // Room again: the pod is made and the package installed.
    quotas
        .patch(
            "operator-pods",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"hard": {"pods": "10"}}})),
        )
        .await
        .unwrap();
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "crowded", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
    let events = events_of(&tenant, "team-a", "crowded").await;
    assert_eq!(
        events.iter().filter(|(r, _)| r == "InstallPodRefused").count(),
        1,
        "{events:?}"
    );
}
