//! Image pull secrets of a stack through the daemon binary (issue 21; DESIGN.md §3.2, §3.3, §8): an
//! install's `imagePullSecrets` reach its Stack and are copied for the stack's controller Deployment
//! on the host, owned by it and gone with it; a name that could reach beyond the install's namespace,
//! or a Secret that holds no pull credentials, is refused before anything is made.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::stacks::{Stack, StackInstall};

use super::stacks_install::{
    Seen, StackFleet, condition, create_install, create_namespace, events_of, stacks_on, wait_for_reason,
};
use crate::harness::Daemon;
use crate::harness::wait_until;

const HOST_NS: &str = "tenant-acme-controllers";
const WITHIN: Duration = Duration::from_secs(20);
const CREDENTIALS: &str = r#"{"auths":{"registry.example.com":{"auth":"dGVhbS1hOnNlY3JldA=="}}}"#;

/// A pull secret of `type_` in `namespace` holding `credentials` and a key the kubelet never reads.
async fn create_secret(tenant: &Client, namespace: &str, name: &str, type_: &str, credentials: &str) {
    create_namespace(tenant, namespace).await;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name},
        "type": type_,
        "stringData": {".dockerconfigjson": credentials, "note": "not a credential"},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");
}

fn host_deployments(fleet: &StackFleet) -> Api<Deployment> {
    Api::namespaced(fleet.host_client.clone(), HOST_NS)
}

/// The host Secrets of the tenant that stackd made for a parent of `kind`.
async fn host_secrets_of(fleet: &StackFleet, kind: &str) -> Vec<Secret> {
    let params = ListParams::default().labels(&format!("stackd.dev/tenant=acme,stackd.dev/parent-kind={kind}"));
    fleet
        .host_secrets("acme")
        .list(&params)
        .await
        .expect("host secrets")
        .items
}

fn pull_refs(deployment: &Deployment) -> Vec<String> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.image_pull_secrets.as_ref())
        .map(|refs| refs.iter().map(|r| r.name.clone()).collect())
        .unwrap_or_default()
}

fn credentials_of(secret: &Secret) -> BTreeMap<String, ByteString> {
    secret.data.clone().unwrap_or_default()
}

async fn wait_install_ready(tenant: &Client, daemon: &Daemon) -> StackInstall {
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("team-a/sample Ready=True", WITHIN, daemon, || {
        let installs = installs.clone();
        async move {
            let install = installs.get_opt("sample").await.ok()??;
            (condition(&install, "Ready")?.0 == "True").then_some(install)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installs_pull_secret_is_copied_for_the_stack_controller_and_goes_with_it() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    create_secret(
        &tenant,
        "team-a",
        "creds",
        "kubernetes.io/dockerconfigjson",
        CREDENTIALS,
    )
    .await;
    let seen_jobs = Seen::start(fleet.host_jobs("acme"));
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1", "imagePullSecrets": [{"name": "creds"}]}),
    )
    .await;
    wait_install_ready(&tenant, &daemon).await;

    // The Stack carries the install's pull secrets.
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("stack");
    let named: Vec<&str> = stack
        .spec
        .controller
        .image_pull_secrets
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(named, ["creds"]);

    // The controller's pods pull with a host copy of their own, not the install Job's.
    let deployment = host_deployments(&fleet)
        .get("team-a.sample")
        .await
        .expect("host Deployment");
    let refs = pull_refs(&deployment);
    assert_eq!(refs.len(), 1, "{refs:?}");
    assert!(refs[0].starts_with("team-a.sample-pull-0-"), "{}", refs[0]);
    assert!(
        refs[0].len() > "team-a.sample-pull-0-".len() + 8,
        "guessable: {}",
        refs[0]
    );
    let job = seen_jobs.first("team-a.sample-install", &daemon).await;
    let job_refs: Vec<String> = job
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.image_pull_secrets.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(job_refs.len(), 1);
    assert_ne!(job_refs[0], refs[0], "the Deployment uses the Job's copy");

    // The copy: the same credentials (and nothing else of the tenant's Secret), owned by the Deployment,
    // labelled for the Stack.
    let copy = fleet.host_secrets("acme").get(&refs[0]).await.expect("pull copy");
    assert_eq!(copy.type_.as_deref(), Some("kubernetes.io/dockerconfigjson"));
    let source = Api::<Secret>::namespaced(tenant.clone(), "team-a")
        .get("creds")
        .await
        .expect("source");
    let data = credentials_of(&copy);
    assert_eq!(data.keys().collect::<Vec<_>>(), [".dockerconfigjson"]);
    assert_eq!(data[".dockerconfigjson"], credentials_of(&source)[".dockerconfigjson"]);
    let owners = copy.owner_references();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].uid.as_str(), owners[0].controller),
        ("Deployment", deployment.uid().unwrap().as_str(), Some(true))
    );
    let labels = copy.labels();
    for (key, value) in [
        ("stackd.dev/tenant", "acme"),
        ("stackd.dev/parent-kind", "Stack"),
        ("stackd.dev/parent-namespace", "team-a"),
        ("stackd.dev/parent-name", "sample"),
    ] {
        assert_eq!(labels.get(key).map(String::as_str), Some(value), "label {key}");
    }
    assert_eq!(copy.annotations()["stacks.stackd.dev/pull-secret-source"], "creds");
    wait_for_event(&tenant, &daemon, "CopiedPullSecrets", &refs[0]).await;
    let events = events_of(&tenant, "team-a", "sample").await;
    assert!(
        events
            .iter()
            .all(|(_, message)| !message.contains("dGVhbS1hOnNlY3JldA")),
        "an Event shows the credentials: {events:?}"
    );

    // Rotated credentials reach the host when the copy is repaired: a deleted copy comes back under its
    // name, with what the tenant's Secret holds now.
    let rotated = CREDENTIALS.replace("registry.example.com", "registry.example.org");
    Api::<Secret>::namespaced(tenant.clone(), "team-a")
        .patch(
            "creds",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {".dockerconfigjson": rotated}})),
        )
        .await
        .expect("rotate");
    fleet
        .host_secrets("acme")
        .delete(&refs[0], &DeleteParams::default())
        .await
        .expect("delete copy");
    let host_secrets = fleet.host_secrets("acme");
    let name = refs[0].clone();
    wait_until(
        "the copy repaired with the rotated credentials",
        WITHIN,
        &daemon,
        || {
            let (host_secrets, name, rotated) = (host_secrets.clone(), name.clone(), rotated.clone());
            async move {
                let copy = host_secrets.get_opt(&name).await.ok()??;
                (credentials_of(&copy)[".dockerconfigjson"].0 == rotated.as_bytes()).then_some(())
            }
        },
    )
    .await;

    // Uninstalled: the Deployment and every copy go.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .delete("sample", &DeleteParams::default())
        .await
        .expect("delete install");
    wait_until("the host objects gone", WITHIN, &daemon, || async {
        let deployment = host_deployments(&fleet).get_opt("team-a.sample").await.ok()?;
        let left = [
            host_secrets_of(&fleet, "Stack").await,
            host_secrets_of(&fleet, "StackInstall").await,
        ]
        .concat();
        (deployment.is_none() && left.is_empty()).then_some(())
    })
    .await;
}

/// Waits for an Event on team-a/sample (the install or its Stack) with `reason` and `detail` in its
/// message: an Event is published after the status it tells of.
async fn wait_for_event(tenant: &Client, daemon: &Daemon, reason: &str, detail: &str) {
    wait_until(
        &format!("an Event {reason} naming {detail}"),
        WITHIN,
        daemon,
        || async {
            let events = events_of(tenant, "team-a", "sample").await;
            events
                .iter()
                .any(|(r, message)| r == reason && message.contains(detail))
                .then_some(())
        },
    )
    .await;
}

/// What the host holds for the tenant after a refused install: nothing of the install, and nowhere
/// the Secret of another namespace.
async fn assert_nothing_made(fleet: &StackFleet, tenant: &Client) {
    assert!(
        fleet
            .host_jobs("acme")
            .get_opt("team-a.sample-install")
            .await
            .expect("get")
            .is_none(),
        "an install Job was created"
    );
    let params = ListParams::default().labels("stackd.dev/tenant=acme");
    let secrets = fleet.host_secrets("acme").list(&params).await.expect("list").items;
    assert!(
        secrets.is_empty(),
        "host Secrets were made: {:?}",
        secrets.iter().map(|s| s.name_any()).collect::<Vec<_>>()
    );
    assert!(stacks_on(tenant).await.is_empty(), "a Stack was made");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_secret_name_reaching_into_another_namespace_is_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    // team-b's registry login: what a team-a user is after.
    create_secret(
        &tenant,
        "team-b",
        "creds",
        "kubernetes.io/dockerconfigjson",
        CREDENTIALS,
    )
    .await;
    let daemon = fleet.daemon(&[]);
    let attack = "../../team-b/secrets/creds";
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1", "imagePullSecrets": [{"name": attack}]}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "InvalidPullSecretName").await;
    assert_eq!(status, "False");
    assert!(
        message.contains(attack) && message.contains("namespace team-a"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "InvalidPullSecretName", attack).await;
    assert_nothing_made(&fleet, &tenant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_without_pull_credentials_is_not_copied() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    // Any Secret of the namespace could be named: only the kubelet's pull-secret types are copied.
    create_secret(&tenant, "team-a", "app-config", "Opaque", CREDENTIALS).await;
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1", "imagePullSecrets": [{"name": "app-config"}]}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "PullSecretRefused").await;
    assert_eq!(status, "False");
    assert!(
        message.contains("app-config") && message.contains("kubernetes.io/dockerconfigjson"),
        "{message}"
    );
    wait_for_event(&tenant, &daemon, "PullSecretRefused", "app-config").await;
    assert_nothing_made(&fleet, &tenant).await;
}
