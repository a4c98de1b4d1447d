//! Host drift repair against a host that mutates what stackd writes (issue 17): a mutating webhook
//! that adds to stackd's Deployment is not drift, and one that changes back a field stackd sets is
//! reported once and retried with backoff, never replaced in a loop.
//!
//! The host's mutating webhooks are the embedded server's admission hooks; the daemon binary runs
//! against it and one tenant, installing the sample stack.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::stacks::Stack;
use stackd::embedded::Verb;
use stackd::embedded::counters::RequestCounts;
use stackd::embedded::faults::RequestMatch;

use super::stacks_install::{StackFleet, condition, create_install, wait_for_reason};
use crate::harness::Daemon;
use crate::harness::{holds_for, wait_until};

const HOST_NS: &str = "tenant-acme-controllers";
const NS: &str = "team-a";
const STACK: &str = "sample";
/// The Stack's controller Deployment and token copy on the host: `<namespace>.<name>[-token]`.
const DEPLOYMENT: &str = "team-a.sample";
const TOKEN_COPY: &str = "team-a.sample-token";
const PACKAGE: &str = "examples/sample-stack:v1";
/// The field stackd sets that [`registry_mirror`] changes back.
const FORCED_FIELD: &str = "spec.template.spec.containers[controller].image";
const SOON: Duration = Duration::from_secs(20);
/// How long the replaces of a reverted Deployment are counted: the rate, not an event, is asserted.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Long enough for a per-object backoff that doubled a handful of times from 100 ms.
const RECOVERY: Duration = Duration::from_secs(60);

fn host_deployments(fleet: &StackFleet) -> Api<Deployment> {
    Api::namespaced(fleet.host_client.clone(), HOST_NS)
}

/// Requests of `verb` on Deployments in the tenant's host namespace.
fn deployment_requests(counts: &RequestCounts, verb: Verb) -> u64 {
    counts.get(verb, "deployments", Some(HOST_NS))
}

fn pod_spec(deployment: &Deployment) -> Value {
    let spec = deployment.spec.as_ref().and_then(|s| s.template.spec.as_ref());
    serde_json::to_value(spec).unwrap_or_default()
}

fn container<'a>(pod: &'a Value, name: &str) -> Option<&'a Value> {
    pod["containers"].as_array()?.iter().find(|c| c["name"] == name)
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"].as_array()?.iter().find(|e| e["name"] == name)?["value"].as_str()
}

/// A service mesh's injector: a `mesh-proxy` sidecar, unless the pod has it, and a `MESH_ENDPOINT`
/// variable in every other container. The sidecar records when it was injected (a counter stands in
/// for the time), so a write that drops the sidecar gets a new one and changes the stored object.
fn mesh_injector() -> impl Fn(&mut Value) + Send + Sync + 'static {
    let injections = AtomicU64::new(0);
    move |deployment: &mut Value| {
        let Some(containers) = deployment["spec"]["template"]["spec"]["containers"].as_array_mut() else {
            return;
        };
        for container in containers.iter_mut() {
            let env = container
                .as_object_mut()
                .map(|c| c.entry("env").or_insert_with(|| json!([])));
            if let Some(env) = env.and_then(Value::as_array_mut)
                && !env.iter().any(|e| e["name"] == "MESH_ENDPOINT")
            {
                env.push(json!({"name": "MESH_ENDPOINT", "value": "127.0.0.1:15001"}));
            }
        }
        if containers.iter().any(|c| c["name"] == "mesh-proxy") {
            return;
        }
        let injected_at = injections.fetch_add(1, Ordering::SeqCst).to_string();
        containers.push(json!({
            "name": "mesh-proxy",
            "image": "mesh/proxy:1.0",
            "env": [{"name": "MESH_INJECTED_AT", "value": injected_at}],
        }));
    }
}

/// A registry policy: every container image is pulled through `mirror.local`. stackd sets the
/// controller's image, so the policy changes back every replace stackd makes.
fn registry_mirror(deployment: &mut Value) {
    let Some(containers) = deployment["spec"]["template"]["spec"]["containers"].as_array_mut() else {
        return;
    };
    for container in containers {
        if let Some(image) = container["image"].as_str()
            && !image.starts_with("mirror.local/")
        {
            container["image"] = json!(format!("mirror.local/{image}"));
        }
    }
}

/// The Stack's Ready condition as (status, reason, message).
async fn stack_ready(tenant: &Client) -> Option<(String, String, String)> {
    let stack = Api::<Stack>::namespaced(tenant.clone(), NS)
        .get_opt(STACK)
        .await
        .ok()??;
    let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
    Some((ready.status, ready.reason, ready.message))
}

async fn wait_for_stack_reason(tenant: &Client, daemon: &Daemon, reason: &str) -> (String, String, String) {
    wait_until(
        &format!("Stack {NS}/{STACK} Ready reason {reason}"),
        SOON,
        daemon,
        || async { stack_ready(tenant).await.filter(|(_, r, _)| r == reason) },
    )
    .await
}

/// The Stack's Events with `reason`.
async fn stack_events(tenant: &Client, reason: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(tenant.clone(), NS);
    events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(STACK))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

/// A host copy deleted right after stackd created it, before stackd heard back from that create
/// (its watch events came first, as on a busy daemon), is created again: a creation the cache has
/// already shown is not taken for one still pending (which would wait for an event already past).
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_deleted_before_its_creation_is_answered_is_created_again() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, NS, STACK, json!({"package": PACKAGE})).await;
    wait_for_reason(&tenant, NS, STACK, &daemon, "Available").await;
    let creates = RequestMatch::any().verb(Verb::Create).resource("secrets");
    fleet
        ._host
        .faults()
        .add_answer_latency(creates, Duration::from_millis(500));
    let secrets = fleet.host_secrets("acme");
    let mut copy = secrets.get(TOKEN_COPY).await.expect("token copy");
    for round in 0..3 {
        secrets
            .delete(TOKEN_COPY, &DeleteParams::default())
            .await
            .expect("delete the token copy");
        // Stored at once, answered half a second later: the next round deletes it in between.
        copy = wait_until(
            &format!("round {round}: the token copy created again"),
            SOON,
            &daemon,
            || async {
                let recreated = secrets.get_opt(TOKEN_COPY).await.ok()??;
                (recreated.uid() != copy.uid()).then_some(recreated)
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_and_a_variable_a_webhook_injects_are_not_drift() {
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.admission().mutate("apps", "deployments", mesh_injector());
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let start = fleet._host.counters();
    create_install(&tenant, NS, STACK, json!({"package": PACKAGE})).await;
    wait_for_reason(&tenant, NS, STACK, &daemon, "Available").await;

    let deployments = host_deployments(&fleet);
    let injected = pod_spec(&deployments.get(DEPLOYMENT).await.expect("host Deployment"));
    assert!(
        container(&injected, "mesh-proxy").is_some(),
        "the webhook injected its sidecar"
    );
    let controller = container(&injected, "controller").expect("the stack's controller");
    assert_eq!(env_value(controller, "MESH_ENDPOINT"), Some("127.0.0.1:15001"));
    let installing = fleet._host.counters().since(&start);
    assert_eq!(
        deployment_requests(&installing, Verb::Update),
        0,
        "stackd replaced a Deployment only the webhook had added to; daemon log:\n{}",
        daemon.log_text()
    );

    // Windows the daemon closes itself: the Stack's token copy deleted on the host is recreated by
    // a reconcile that first compares the Deployment with what the Stack wants.
    let secrets = fleet.host_secrets("acme");
    for round in 0..3 {
        let before = fleet._host.counters();
        let copy = secrets.get(TOKEN_COPY).await.expect("token copy");
        secrets
            .delete(TOKEN_COPY, &DeleteParams::default())
            .await
            .expect("delete the token copy");
        wait_until("the token copy to be recreated", SOON, &daemon, || async {
            let recreated = secrets.get_opt(TOKEN_COPY).await.ok()??;
            (recreated.uid() != copy.uid()).then_some(())
        })
        .await;
        let window = fleet._host.counters().since(&before);
        assert_eq!(
            (
                deployment_requests(&window, Verb::Update),
                deployment_requests(&window, Verb::Patch)
            ),
            (0, 0),
            "round {round}: stackd wrote the Deployment the webhook had added to; daemon log:\n{}",
            daemon.log_text()
        );
    }
    let pod = pod_spec(&deployments.get(DEPLOYMENT).await.expect("host Deployment"));
    assert_eq!(pod, injected, "the sidecar and the variable stay as injected");
    assert_eq!(
        stack_ready(&tenant).await.map(|(s, r, _)| (s, r)),
        Some(("True".into(), "Available".into()))
    );
    assert!(stack_events(&tenant, "HostObjectReverted").await.is_empty());
    assert!(stack_events(&tenant, "UpdatedDeployment").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_the_host_changes_back_is_reported_once_and_retried_with_backoff() {
    // The policy leaves the object as it was: stackd's replace is a no-op on the host.
    host_writes_back_off(registry_mirror).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replace_the_host_changes_back_and_stamps_is_not_retried_on_its_own_watch_event() {
    // The policy also records each mutation on the object: every replace stackd makes changes the
    // stored object, and its watch event would start the next replace at once.
    let mutations = AtomicU64::new(0);
    host_writes_back_off(move |deployment: &mut Value| {
        registry_mirror(deployment);
        let stamp = mutations.fetch_add(1, Ordering::SeqCst).to_string();
        deployment["metadata"]["annotations"]["policy.example.org/mutation"] = json!(stamp);
    })
    .await;
}

/// Installs the sample stack on a host whose `policy` changes back what stackd writes to the
/// Deployment; checks that stackd reports it once, retries with backoff, deletes nothing and takes
/// up again once the policy is gone.
async fn host_writes_back_off(policy: impl Fn(&mut Value) + Send + Sync + 'static) {
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.admission().mutate("apps", "deployments", policy);
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, NS, STACK, json!({"package": PACKAGE})).await;

    let (status, _, message) = wait_for_stack_reason(&tenant, &daemon, "HostObjectReverted").await;
    assert_eq!(status, "False");
    let object = format!("{HOST_NS}/{DEPLOYMENT}");
    assert!(message.contains(&object), "{message:?} does not name {object}");
    assert!(
        message.contains(FORCED_FIELD),
        "{message:?} does not name {FORCED_FIELD}"
    );
    assert!(message.contains("exempt"), "{message:?} does not say what to do");
    let (_, reason, install_message) =
        wait_until("the install to pass the Stack's state on", SOON, &daemon, || async {
            let install = Api::<stackd::api::stacks::StackInstall>::namespaced(tenant.clone(), NS)
                .get(STACK)
                .await
                .ok()?;
            condition(&install, "Ready").filter(|(_, _, m)| m.contains("changed back"))
        })
        .await;
    assert_eq!(reason, "WaitingForStack");
    assert!(install_message.contains("exempt"), "{install_message:?}; {reason}");

    // Retried with backoff: a few replaces over a few seconds, not one per event or a loop.
    let before = fleet._host.counters();
    let since = Instant::now();
    let first_uid = host_deployments(&fleet)
        .get(DEPLOYMENT)
        .await
        .expect("Deployment")
        .uid();
    wait_until("two retries", SOON, &daemon, || async {
        let replaces = deployment_requests(&fleet._host.counters().since(&before), Verb::Update);
        (replaces >= 2).then_some(())
    })
    .await;
    // A rate needs its window: the bound holds at every moment of it, not only at its end.
    let window = RATE_WINDOW.saturating_sub(since.elapsed());
    holds_for("replaces within the backoff's bound", window, &daemon, || async {
        let replaces = deployment_requests(&fleet._host.counters().since(&before), Verb::Update);
        replaces <= attempts_within(since.elapsed())
    })
    .await;
    let events = stack_events(&tenant, "HostObjectReverted").await;
    assert_eq!(events.len(), 1, "reported once: {events:?}");
    assert!(
        events[0].series.is_none(),
        "reported again: {:?}; daemon log:\n{}",
        events[0].series,
        daemon.log_text()
    );
    let note = events[0].note.clone().unwrap_or_default();
    assert!(note.contains(&object) && note.contains("exempt"), "{note:?}");

    // Nothing was deleted; once the policy is gone, the next retry (no event announces it, so the
    // backoff's, up to a few doublings later) sticks.
    fleet._host.admission().clear();
    wait_until("the Stack to recover", RECOVERY, &daemon, || async {
        stack_ready(&tenant).await.filter(|(_, r, _)| r == "Available")
    })
    .await;
    let deployment = host_deployments(&fleet).get(DEPLOYMENT).await.expect("Deployment");
    assert_eq!(deployment.uid(), first_uid, "the Deployment was replaced, not updated");
    let controller = container(&pod_spec(&deployment), "controller")
        .cloned()
        .expect("controller");
    assert_eq!(controller["image"], json!(PACKAGE));
    let all = fleet._host.counters();
    assert_eq!(deployment_requests(&all, Verb::Delete), 0);
    let health = daemon.http_get("/healthz").unwrap_or_default();
    assert!(health.contains("200"), "the daemon is not healthy: {health}");
}

/// The most replaces a per-object backoff starting at the daemon's `--backoff-base` (100 ms,
/// doubling, ±10%) allows within `elapsed`, plus a few reconciles that events start before the first
/// failure is recorded.
fn attempts_within(elapsed: Duration) -> u64 {
    let mut attempts = 0;
    let mut waited = Duration::ZERO;
    let mut delay = Duration::from_millis(90);
    while waited <= elapsed {
        attempts += 1;
        waited += delay;
        delay *= 2;
    }
    attempts + 3
}

/// The Stack's status writes a server saw since `before`.
fn stack_status_writes(counts: &RequestCounts) -> u64 {
    counts
        .counts
        .iter()
        .filter(|(key, _)| key.resource.starts_with("stacks.") && key.resource.ends_with("/status"))
        .filter(|(key, _)| matches!(key.verb, Verb::Patch | Verb::Update))
        .map(|(_, n)| n)
        .sum()
}

/// The defect behind a flaky `a_replace_the_host_changes_back_and_stamps_is_not_retried_on_its_own_watch_event`:
/// a failed reconcile started from the cached Stack's host references while it compared with the
/// status last written. Run on a cache one status write behind (the write's watch event not in yet),
/// it wrote the references back to what the cache said, undoing that write; each such write woke
/// the next reconcile on a cache one write behind again, so the Stack was rewritten (and its backoff
/// grew) once per event until the cache caught up. Here the daemon's Stack watch is held back while
/// the Deployment is created and changed back: the status keeps its `controllerRef`, and once the
/// watch delivers again the retries write no status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_on_a_cache_behind_its_own_status_write_does_not_undo_it() {
    use stackd::embedded::faults::RequestMatch;
    let fleet = StackFleet::start(&["acme"]).await;
    fleet._host.admission().mutate("apps", "deployments", registry_mirror);
    let tenant = fleet.tenant("acme");
    let server = &fleet.tenants["acme"].0;
    // The Stack's token Secret cannot be created yet: the Stack waits, with a status, for what follows.
    let token_creation = RequestMatch::any().verb(Verb::Create).resource("secrets").namespace(NS);
    // (500: kube's client retries a 503 itself.)
    server.faults().fail_next(1_000_000, token_creation, 500);
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, NS, STACK, json!({"package": PACKAGE})).await;
    wait_for_stack_reason(&tenant, &daemon, "TenantUnavailable").await;
    // From now on the daemon's cache of Stacks stays as it is: every status it writes is one it has
    // not seen.
    let held = server
        .faults()
        .pause_watches(RequestMatch::any().verb(Verb::Watch).resource("stacks"));
    server.faults().clear();
    let (_, _, message) = wait_for_stack_reason(&tenant, &daemon, "HostObjectReverted").await;
    assert!(message.contains(FORCED_FIELD), "{message}");
    let stack = Api::<Stack>::namespaced(tenant.clone(), NS)
        .get(STACK)
        .await
        .expect("Stack");
    let controller = stack.status.and_then(|s| s.controller_ref).map(|r| r.name);
    assert_eq!(
        controller.as_deref(),
        Some(DEPLOYMENT),
        "a reconcile on the stale cache wrote the status back; daemon log:\n{}",
        daemon.log_text()
    );

    // The cache catches up (the held events arrive one after another) while the replace is retried:
    // nothing about the Stack changed, so no status write.
    let (tenant_before, host_before) = (server.counters(), fleet._host.counters());
    held.resume();
    wait_until("two retries of the replace", SOON, &daemon, || async {
        let replaces = deployment_requests(&fleet._host.counters().since(&host_before), Verb::Update);
        (replaces >= 2).then_some(())
    })
    .await;
    let writes = stack_status_writes(&server.counters().since(&tenant_before));
    assert_eq!(
        writes,
        0,
        "the Stack's status was rewritten; daemon log:\n{}",
        daemon.log_text()
    );
}
