//! The tenant is untrusted (DESIGN.md §8): what a package's controller pod may ask for on the host,
//! and the quota every tenant's host namespace gets. Each attack is performed through a real
//! StackInstall of a crafted package and must end refused, named and harmless.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, LimitRange, Namespace, ResourceQuota};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::stacks::Stack;

use super::stacks_install::{Seen, StackFleet, create_install, install_sample, wait_for_reason};
use crate::harness::wait_until;
use crate::harness::{Daemon, Fleet};

const HOST_NS: &str = "tenant-acme-controllers";
const SOON: Duration = Duration::from_secs(20);

/// Writes package `name`: the sample stack, with `edit` applied to its controller's pod spec.
pub(crate) fn write_package(fleet: &StackFleet, name: &str, edit: impl FnOnce(&mut Value)) {
    write_template_package(fleet, name, |template| edit(&mut template["spec"]));
}

/// Writes package `name`: the sample stack, with `edit` applied to its controller's pod template.
fn write_template_package(fleet: &StackFleet, name: &str, edit: impl FnOnce(&mut Value)) {
    let packages = fleet.dir.path().join("packages");
    let root = packages.join(name).join(".registry");
    copy_dir(&packages.join("sample-stack/.registry"), &root);
    let install = root.join("install.yaml");
    let mut deployment: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&install).expect("install.yaml")).expect("YAML");
    edit(&mut deployment["spec"]["template"]);
    std::fs::write(&install, serde_saphyr::to_string(&deployment).expect("YAML")).expect("write install.yaml");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// A change to a package's pod spec.
type PodEdit = Box<dyn FnOnce(&mut Value)>;

/// Sets `field` of the pod spec.
fn pod_field(field: &'static str, value: Value) -> impl FnOnce(&mut Value) {
    move |pod| pod[field] = value
}

/// Sets `field` of the controller container.
fn container_field(field: &'static str, value: Value) -> impl FnOnce(&mut Value) {
    move |pod| pod["containers"][0][field] = value
}

async fn host_deployments(client: &Client) -> Vec<String> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), HOST_NS);
    match api.list(&ListParams::default()).await {
        Ok(list) => list.items.iter().map(|d| d.name_any()).collect(),
        Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
        Err(err) => panic!("list host Deployments: {err}"),
    }
}

async fn stacks_in(client: &Client, namespace: &str) -> Vec<String> {
    let api: Api<Stack> = Api::namespaced(client.clone(), namespace);
    let list = api.list(&ListParams::default()).await.expect("stacks");
    list.items.iter().map(|s| s.name_any()).collect()
}

/// Waits for the install's PodSpecRefused Event and returns its message.
async fn refusal_event(tenant: &Client, namespace: &str, name: &str, daemon: &Daemon) -> String {
    wait_until(
        &format!("{namespace}/{name}: a PodSpecRefused Event"),
        SOON,
        daemon,
        || {
            let events: Api<Event> = Api::namespaced(tenant.clone(), namespace);
            async move {
                let list = events.list(&ListParams::default()).await.ok()?;
                list.items
                    .into_iter()
                    .filter(|e| e.involved_object.name.as_deref() == Some(name))
                    .find(|e| e.reason.as_deref() == Some("PodSpecRefused"))
                    .and_then(|e| e.message)
            }
        },
    )
    .await
}

/// Installs `package` in `namespace` and checks it is refused: Ready=False PodSpecRefused, with the
/// condition and an Event both naming `field`, and no Stack.
async fn assert_refused(tenant: &Client, namespace: &str, package: &str, field: &str, daemon: &Daemon) -> String {
    let (status, _, message) = wait_for_reason(tenant, namespace, package, daemon, "PodSpecRefused").await;
    assert_eq!(status, "False");
    assert!(
        message.contains(field),
        "{package}: {message:?} does not name {field:?}"
    );
    let event = refusal_event(tenant, namespace, package, daemon).await;
    assert!(
        event.contains(field),
        "{package}: the Event {event:?} does not name {field:?}"
    );
    assert!(
        stacks_in(tenant, namespace).await.is_empty(),
        "{package}: a refused install created a Stack"
    );
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_package_mounting_another_stacks_token_is_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    // The victim: a stack in team-a whose token copy is on the host at a predictable name.
    install_sample(&tenant, &daemon).await;
    let victim = fleet
        .host_secrets("acme")
        .get_opt("team-a.sample-token")
        .await
        .expect("get");
    assert!(victim.is_some(), "the victim's token copy is on the host");

    write_package(
        &fleet,
        "steal-token",
        pod_field(
            "volumes",
            json!([{"name": "loot", "secret": {"secretName": "team-a.sample-token"}}]),
        ),
    );
    create_install(
        &tenant,
        "team-b",
        "steal-token",
        json!({"package": "examples/steal-token:v1"}),
    )
    .await;
    let message = assert_refused(
        &tenant,
        "team-b",
        "steal-token",
        "spec.template.spec.volumes[0].secret",
        &daemon,
    )
    .await;
    assert!(message.contains("team-a.sample-token"), "{message}");
    assert_eq!(
        host_deployments(&fleet.host_client).await,
        ["team-a.sample"],
        "only the victim runs on the host"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_naming_host_secrets_or_placing_themselves_are_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let output = json!({"name": "team-a.cluster-1-output", "key": "kubeconfig"});
    let cases: Vec<(&str, PodEdit, &str)> = vec![
        (
            "output-env",
            Box::new(container_field(
                "env",
                json!([{"name": "KUBECONFIG_DATA", "valueFrom": {"secretKeyRef": output}}]),
            )),
            "spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef",
        ),
        (
            "output-env-from",
            Box::new(container_field(
                "envFrom",
                json!([{"secretRef": {"name": "team-a.cluster-1-output"}}]),
            )),
            "spec.template.spec.containers[0].envFrom[0].secretRef",
        ),
        (
            "projected-secret",
            Box::new(pod_field(
                "volumes",
                json!([{"name": "p", "projected": {"sources": [{"secret": {"name": "team-a.cluster-1-install-config"}}]}}]),
            )),
            "spec.template.spec.volumes[0].projected.sources[0].secret",
        ),
        (
            "node-name",
            Box::new(pod_field("nodeName", json!("control-plane-1"))),
            "spec.template.spec.nodeName",
        ),
        (
            "node-selector",
            Box::new(pod_field(
                "nodeSelector",
                json!({"node-role.kubernetes.io/control-plane": ""}),
            )),
            "spec.template.spec.nodeSelector[node-role.kubernetes.io/control-plane]",
        ),
        (
            "tolerations",
            Box::new(pod_field("tolerations", json!([{"operator": "Exists"}]))),
            "spec.template.spec.tolerations[0]",
        ),
        (
            "priority-class",
            Box::new(pod_field("priorityClassName", json!("system-node-critical"))),
            "spec.template.spec.priorityClassName",
        ),
        (
            "runtime-class",
            Box::new(pod_field("runtimeClassName", json!("unconfined-runtime"))),
            "spec.template.spec.runtimeClassName",
        ),
        (
            "host-network",
            Box::new(pod_field("hostNetwork", json!(true))),
            "spec.template.spec.hostNetwork",
        ),
        (
            "privileged",
            Box::new(container_field("securityContext", json!({"privileged": true}))),
            "spec.template.spec.containers[0].securityContext.privileged",
        ),
        (
            "host-path",
            Box::new(pod_field(
                "volumes",
                json!([{"name": "root", "hostPath": {"path": "/var/lib/kubelet"}}]),
            )),
            "spec.template.spec.volumes[0].hostPath",
        ),
    ];
    let mut expected = Vec::new();
    for (name, edit, field) in cases {
        write_package(&fleet, name, edit);
        expected.push((name, field));
    }
    let daemon = fleet.daemon(&[]);
    for (name, _) in &expected {
        create_install(&tenant, name, name, json!({"package": format!("examples/{name}:v1")})).await;
    }
    for (name, field) in &expected {
        assert_refused(&tenant, name, name, field, &daemon).await;
    }
    assert!(
        host_deployments(&fleet.host_client).await.is_empty(),
        "a refused package runs nothing on the host"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_network_annotations_host_policy_labels_and_a_localhost_apparmor_profile_are_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    // A label the host's policies select pods by (or stackd's own) would let the pod pass for another.
    let label = "stackd.dev/tenant";
    write_template_package(&fleet, "labels", |template| {
        template["metadata"]["labels"][label] = json!("globex");
    });
    // Multus would attach the pod to the node's networks; the value names them.
    let networks = "k8s.v1.cni.cncf.io/networks";
    let value = "kube-system/host-bridge-network";
    write_template_package(&fleet, "multus", |template| {
        template["metadata"]["annotations"] = json!({networks: value});
    });
    let localhost = json!({"appArmorProfile": {"type": "Localhost", "localhostProfile": "unconfined-on-node"}});
    write_package(&fleet, "apparmor", container_field("securityContext", localhost));
    let daemon = fleet.daemon(&[]);
    for name in ["multus", "apparmor", "labels"] {
        create_install(&tenant, name, name, json!({"package": format!("examples/{name}:v1")})).await;
    }
    let message = assert_refused(
        &tenant,
        "multus",
        "multus",
        &format!("spec.template.metadata.annotations[{networks}]"),
        &daemon,
    )
    .await;
    assert!(!message.contains(value), "the annotation's value is echoed: {message}");
    let event = refusal_event(&tenant, "multus", "multus", &daemon).await;
    assert!(!event.contains(value), "the annotation's value is echoed: {event}");
    assert_refused(
        &tenant,
        "labels",
        "labels",
        &format!("spec.template.metadata.labels[{label}]"),
        &daemon,
    )
    .await;
    assert_refused(
        &tenant,
        "apparmor",
        "apparmor",
        "spec.template.spec.containers[0].securityContext.appArmorProfile.type",
        &daemon,
    )
    .await;
    assert!(
        host_deployments(&fleet.host_client).await.is_empty(),
        "a refused package runs nothing on the host"
    );
}

/// Issue 28: pod fields that reach past the tenant's quota or into the host's selectors. An
/// extended resource (a GPU) or hugepages are granted outside the quota; a grace period of a year
/// keeps an uninstalled stack's pod (and its quota) for that long; a mesh's injection label or
/// revision label puts the pod into the host's mesh and the policies that select it. Each is refused
/// by name, and the sample stack, which asks for none of them, still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_resources_long_grace_periods_and_mesh_labels_are_refused_by_name() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    write_package(&fleet, "gpu", |pod| {
        pod["containers"][0]["resources"] = json!({
            "requests": {"cpu": "10m", "nvidia.com/gpu": "8"},
            "limits": {"hugepages-1Gi": "16Gi"},
        });
    });
    write_package(
        &fleet,
        "lingering",
        pod_field("terminationGracePeriodSeconds", json!(31_536_000)),
    );
    let (inject, revision) = ("sidecar.istio.io/inject", "istio.io/rev");
    write_template_package(&fleet, "meshed", |template| {
        template["metadata"]["labels"][inject] = json!("true");
        template["metadata"]["labels"][revision] = json!("canary");
    });
    let daemon = fleet.daemon(&[]);
    for name in ["gpu", "lingering", "meshed"] {
        create_install(&tenant, name, name, json!({"package": format!("examples/{name}:v1")})).await;
    }
    let message = assert_refused(
        &tenant,
        "gpu",
        "gpu",
        "spec.template.spec.containers[0].resources.requests[nvidia.com/gpu]",
        &daemon,
    )
    .await;
    assert!(
        message.contains("resources.limits[hugepages-1Gi]") && message.contains("cpu, memory, ephemeral-storage"),
        "{message}"
    );
    let message = assert_refused(
        &tenant,
        "lingering",
        "lingering",
        "spec.template.spec.terminationGracePeriodSeconds",
        &daemon,
    )
    .await;
    assert!(message.contains("300"), "the refusal names the bound: {message}");
    let message = assert_refused(
        &tenant,
        "meshed",
        "meshed",
        &format!("spec.template.metadata.labels[{inject}]"),
        &daemon,
    )
    .await;
    assert!(message.contains(&format!("labels[{revision}]")), "{message}");
    assert!(
        host_deployments(&fleet.host_client).await.is_empty(),
        "a refused package runs nothing on the host"
    );
    // The sample stack and the test packages built from it pass as they are.
    install_sample(&tenant, &daemon).await;
    assert_eq!(host_deployments(&fleet.host_client).await, ["team-a.sample"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemons_flags_allow_exactly_their_node_selector_and_tolerations() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    write_package(&fleet, "on-stack-nodes", |pod| {
        pod["nodeSelector"] = json!({"pool": "stacks"});
        pod["tolerations"] =
            json!([{"key": "dedicated", "operator": "Equal", "value": "stacks", "effect": "NoSchedule"}]);
    });
    write_package(
        &fleet,
        "on-gpu-nodes",
        pod_field("nodeSelector", json!({"pool": "gpu"})),
    );
    let daemon = fleet.daemon(&[
        "--stack-node-selector",
        "pool=stacks",
        "--stack-toleration",
        "dedicated=stacks:NoSchedule",
    ]);
    create_install(
        &tenant,
        "team-a",
        "on-stack-nodes",
        json!({"package": "examples/on-stack-nodes:v1"}),
    )
    .await;
    create_install(
        &tenant,
        "team-b",
        "on-gpu-nodes",
        json!({"package": "examples/on-gpu-nodes:v1"}),
    )
    .await;
    let message = assert_refused(
        &tenant,
        "team-b",
        "on-gpu-nodes",
        "spec.template.spec.nodeSelector[pool]",
        &daemon,
    )
    .await;
    assert!(
        message.contains("pool=stacks"),
        "the refusal names what is allowed: {message}"
    );
    wait_for_reason(&tenant, "team-a", "on-stack-nodes", &daemon, "Available").await;
    let api: Api<Deployment> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let deployment = api.get("team-a.on-stack-nodes").await.expect("host Deployment");
    let pod = deployment.spec.and_then(|s| s.template.spec).expect("pod");
    assert_eq!(
        pod.node_selector,
        Some(BTreeMap::from([("pool".to_string(), "stacks".to_string())]))
    );
    assert_eq!(pod.tolerations.map(|t| t.len()), Some(1));
    assert_eq!(host_deployments(&fleet.host_client).await, ["team-a.on-stack-nodes"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stacks_images_are_always_pulled_whatever_the_install_asks() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    write_package(&fleet, "cached", container_field("imagePullPolicy", json!("Never")));
    let seen_jobs = Seen::start(fleet.host_jobs("acme"));
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "cached",
        json!({"package": "examples/cached:v1", "imagePullPolicy": "IfNotPresent"}),
    )
    .await;
    wait_for_reason(&tenant, "team-a", "cached", &daemon, "Available").await;
    let job = seen_jobs.first("team-a.cached-install", &daemon).await;
    let job_pod = job.spec.and_then(|s| s.template.spec).expect("Job pod");
    let inits = job_pod.init_containers.as_ref().expect("init containers");
    let package = inits
        .iter()
        .find(|c| c.name == "package")
        .expect("the package container");
    assert_eq!(package.image.as_deref(), Some("examples/cached:v1"));
    assert_eq!(package.image_pull_policy.as_deref(), Some("Always"));
    let api: Api<Deployment> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let deployment = api.get("team-a.cached").await.expect("host Deployment");
    let pod = deployment.spec.and_then(|s| s.template.spec).expect("pod");
    for container in pod.containers.iter().chain(pod.init_containers.iter().flatten()) {
        assert_eq!(
            container.image_pull_policy.as_deref(),
            Some("Always"),
            "{}",
            container.name
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Fairness: every tenant's host namespace has a ResourceQuota and a LimitRange from the flags

const QUOTA: &str = "stackd-tenant-quota";
const LIMITS: &str = "stackd-tenant-limits";

fn quota_flags(pods: &str) -> Vec<String> {
    vec![
        "--tenant-quota".into(),
        format!("pods={pods},requests.cpu=2,limits.memory=4Gi"),
        "--tenant-container-defaults".into(),
        "requests.cpu=50m,limits.cpu=500m,limits.memory=256Mi".into(),
        // The quota and LimitRange are looked at every sweep interval, not watched.
        "--sweep-interval".into(),
        "1s".into(),
    ]
}

fn hard(quota: &ResourceQuota) -> BTreeMap<String, String> {
    let hard = quota.spec.as_ref().and_then(|s| s.hard.clone()).unwrap_or_default();
    hard.into_iter().map(|(k, v)| (k, v.0)).collect()
}

fn amounts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Waits until the tenant's quota says `pods` pods, and returns it.
async fn quota_with_pods(fleet: &Fleet, daemon: &Daemon, pods: &str) -> ResourceQuota {
    let quotas: Api<ResourceQuota> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    wait_until(&format!("a ResourceQuota of {pods} pods"), SOON, daemon, || {
        let quotas = quotas.clone();
        async move {
            let quota = quotas.get_opt(QUOTA).await.ok()??;
            (hard(&quota).get("pods").map(String::as_str) == Some(pods)).then_some(quota)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_namespace_gets_the_flags_quota_and_limits_which_are_kept_and_follow_the_flag() {
    let fleet = Fleet::start(&["acme"]).await;
    let flags = quota_flags("7");
    let daemon = fleet.daemon(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let quota = quota_with_pods(&fleet, &daemon, "7").await;
    assert_eq!(
        hard(&quota),
        amounts(&[("pods", "7"), ("requests.cpu", "2"), ("limits.memory", "4Gi")])
    );
    let limit_ranges: Api<LimitRange> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let limits = limit_ranges.get(LIMITS).await.expect("LimitRange");
    for labels in [quota.labels(), limits.labels()] {
        assert_eq!(labels["app.kubernetes.io/managed-by"], "stackd");
        assert_eq!(labels["stackd.dev/tenant"], "acme");
        assert!(
            !labels.contains_key("stackd.dev/parent-kind"),
            "the orphan sweep must never judge it"
        );
    }
    let item = &limits.spec.clone().expect("spec").limits[0];
    assert_eq!(item.type_, "Container");
    let as_strings = |m: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        m.clone()
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(
        as_strings(&item.default),
        amounts(&[("cpu", "500m"), ("memory", "256Mi")])
    );
    assert_eq!(as_strings(&item.default_request), amounts(&[("cpu", "50m")]));

    // Edited on the host: put back within the sweep interval. Deleted: made again.
    let quotas: Api<ResourceQuota> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    quotas
        .patch(
            QUOTA,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"hard": {"pods": "1000"}}})),
        )
        .await
        .expect("edit the quota");
    quota_with_pods(&fleet, &daemon, "7").await;
    limit_ranges
        .delete(LIMITS, &DeleteParams::default())
        .await
        .expect("delete the LimitRange");
    wait_until("the LimitRange made again", SOON, &daemon, || {
        let limit_ranges = limit_ranges.clone();
        async move { limit_ranges.get_opt(LIMITS).await.ok()? }
    })
    .await;

    // A changed flag updates the same object.
    drop(daemon);
    let flags = quota_flags("9");
    let daemon = fleet.daemon(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let updated = quota_with_pods(&fleet, &daemon, "9").await;
    assert_eq!(updated.metadata.uid, quota.metadata.uid, "updated in place");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_at_stackds_name_that_is_not_stackds_is_never_touched() {
    let fleet = Fleet::start(&["acme"]).await;
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": HOST_NS}})).expect("ns");
    Api::<Namespace>::all(fleet.host_client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("host namespace");
    let quotas: Api<ResourceQuota> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let theirs: ResourceQuota =
        serde_json::from_value(json!({"metadata": {"name": QUOTA}, "spec": {"hard": {"pods": "3"}}})).expect("quota");
    let theirs = quotas
        .create(&PostParams::default(), &theirs)
        .await
        .expect("their quota");
    let daemon = fleet.daemon(&[]);
    wait_until("the conflict reported", SOON, &daemon, || {
        let log = daemon.log_text();
        async move { log.contains("was not created by stackd for this tenant").then_some(()) }
    })
    .await;
    let after = quotas.get(QUOTA).await.expect("still there");
    assert_eq!(
        after.metadata.resource_version, theirs.metadata.resource_version,
        "never written"
    );
    assert_eq!(hard(&after), amounts(&[("pods", "3")]));
}
