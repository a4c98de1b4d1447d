//! What the kubelet says about the pods stackd runs for a tenant reaches the tenant object that
//! caused them (issue 52): the host's controller manager reports the kubelet's waiting reasons for
//! images the test names (`Runners::fault`), in the fields a kubelet writes.

use std::time::Duration;

use kube::Api;
use serde_json::json;
use stackd::api::stacks::StackInstall;
use stackd::embedded::controller_manager::{ImageMatch, PodFault};

use crate::harness::{LastSeen, wait_until};
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

#[tokio::test(flavor = "multi_thread")]
async fn an_install_whose_package_cannot_be_pulled_says_so_then_fails_and_is_retried() {
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.runners().fault(
        ImageMatch::Predicate(std::sync::Arc::new(|image| image.contains("no-such-package"))),
        PodFault::Unpullable,
    );
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&["--pull-failure-grace", "3s"]);
    create_install(
        &tenant,
        "team-a",
        "typo",
        json!({"package": "examples/no-such-package:v1"}),
    )
    .await;
    let at = ("team-a", "typo");
    // Not "unpacking": what the kubelet says, and what to do about it.
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodWaiting", "ImagePullBackOff").await;
    assert!(
        message.contains("the image cannot be pulled: check spec.package and its imagePullSecrets"),
        "{message}"
    );
    assert!(message.contains("examples/no-such-package:v1"), "{message}");
    wait_until("a Warning Event for the pull", Duration::from_secs(10), &daemon, || {
        let tenant = tenant.clone();
        async move {
            let events = events_of(&tenant, "team-a", "typo").await;
            events
                .iter()
                .any(|(reason, note)| reason == "InstallPodWaiting" && note.contains("the image cannot be pulled"))
                .then_some(())
        }
    })
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
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.runners().fault(
        ImageMatch::Predicate(std::sync::Arc::new(|image| image.contains("huge-package"))),
        PodFault::Unschedulable,
    );
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "huge",
        json!({"package": "examples/huge-package:v1"}),
    )
    .await;
    let at = ("team-a", "huge");
    let message = wait_for_message(&fleet, &daemon, at, "InstallPodWaiting", "Unschedulable").await;
    assert!(
        message.contains("the pod cannot be scheduled") && message.contains("0/1 nodes are available"),
        "{message}"
    );
    wait_until("a Warning Event for the pod", Duration::from_secs(10), &daemon, || {
        let tenant = tenant.clone();
        async move {
            let events = events_of(&tenant, "team-a", "huge").await;
            events
                .iter()
                .any(|(reason, note)| reason == "InstallPodWaiting" && note.contains("cannot be scheduled"))
                .then_some(())
        }
    })
    .await;
}
