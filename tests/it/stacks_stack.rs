//! The Stack controller through the daemon binary (DESIGN.md §3.3, §3.4): Stacks and their CRDs are
//! created directly on an embedded tenant, as the install controller would: each Stack is owned by an
//! install whose install pod is still running (it never finishes here), so the test, not the package,
//! decides the Stack's spec.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, ResourceQuota, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::stacks::Stack;
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome, PodFault};
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::store::GroupResource;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::host::names::{NameKind, host_name};
use stackd::stacks::{STACK_FINALIZER, crd_parent_label};

use crate::harness::{Daemon, LastSeen, quiet};

const TENANT: &str = "acme";
const HOST_NS: &str = "tenant-acme-controllers";
const NS: &str = "team-a";
const SOON: Duration = Duration::from_secs(15);
const SA_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// An embedded host and tenant, the tenant kubeconfig in a temp dir, and a `stackd run` process.
struct Env {
    host: ApiServer,
    tenant: ApiServer,
    host_client: Client,
    tenant_client: Client,
    dir: tempfile::TempDir,
    daemon: Option<Daemon>,
}

impl Env {
    async fn start(flags: &[&str]) -> Env {
        let mut env = Env::servers().await;
        env.start_daemon(flags);
        env
    }

    async fn servers() -> Env {
        let start = |name: &str| {
            ApiServer::start(ServerOptions {
                name: name.into(),
                ..Default::default()
            })
        };
        let host = start("host").await.expect("host");
        // The install pods of the installs that own the test's Stacks run until the test ends.
        host.runners().register(
            ImageMatch::Exact(stackd::stacks::default_stackd_image()),
            |_: &JobContext| JobOutcome::success("").after(Duration::from_secs(3600)),
        );
        let tenant = start(TENANT).await.expect("tenant");
        let (host_client, tenant_client) = (host.client().await, tenant.client().await);
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("tenants")).expect("tenants dir");
        std::fs::write(dir.path().join("host.yaml"), host.kubeconfig_yaml()).expect("host kubeconfig");
        std::fs::write(
            dir.path().join("tenants").join(format!("{TENANT}.yaml")),
            tenant.kubeconfig_yaml(),
        )
        .expect("tenant kubeconfig");
        crate::harness::install_crds(&tenant_client).await;
        let crds: Api<CustomResourceDefinition> = Api::all(tenant_client.clone());
        crds.create(&PostParams::default(), &widget_crd())
            .await
            .expect("widget CRD");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("ns");
        Api::<Namespace>::all(tenant_client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("tenant namespace");
        Env {
            host,
            tenant,
            host_client,
            tenant_client,
            dir,
            daemon: None,
        }
    }

    fn start_daemon(&mut self, flags: &[&str]) {
        self.daemon = Some(Daemon::spawn(self.dir.path(), flags));
    }

    fn stop_daemon(&mut self) {
        self.daemon = None;
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(Daemon::log_text).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        self.daemon
            .as_ref()
            .and_then(|d| d.http_get("/metrics"))
            .unwrap_or_default()
    }

    /// How many reconciles of the Stack controller have finished (the duration histogram's count).
    fn reconciles_done(&self) -> u64 {
        let needle = format!("stackd_reconcile_duration_seconds_count{{tenant=\"{TENANT}\",controller=\"stack\"}} ");
        self.metrics()
            .lines()
            .find_map(|line| line.strip_prefix(&needle).and_then(|n| n.trim().parse().ok()))
            .unwrap_or(0)
    }

    /// Pokes the Stack (an annotation: an event that changes nothing stackd acts on) and waits until
    /// a reconcile has finished since, so that what follows judges what that reconcile did.
    async fn reconcile_again(&self, name: &str, poke: &str) {
        let done = self.reconciles_done();
        let patch = json!({"metadata": {"annotations": {"example.org/poke": poke}}});
        self.stacks()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("poke");
        self.until("the poke's reconcile", || async { self.reconciles_done() > done })
            .await;
    }

    fn stacks(&self) -> Api<Stack> {
        Api::namespaced(self.tenant_client.clone(), NS)
    }

    fn host_deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.host_client.clone(), HOST_NS)
    }

    fn host_secrets(&self) -> Api<Secret> {
        Api::namespaced(self.host_client.clone(), HOST_NS)
    }

    /// Creates the install the Stack belongs to (a StackInstall for a Namespaced spec, else a
    /// ClusterStackInstall), labels the Widget CRD for the Stack, then creates the Stack as the
    /// install controller does: owned by the install, with stackd's label.
    async fn create_stack(&self, name: &str, spec: Value) -> Stack {
        let kind = if spec["permissionScope"] == "Cluster" {
            "ClusterStackInstall"
        } else {
            "StackInstall"
        };
        let install = create_owner_install(&self.tenant_client, kind, name).await;
        label_crd_for(self, name).await;
        let stack: Stack = serde_json::from_value(json!({
            "apiVersion": "stacks.stackd.dev/v1alpha1",
            "kind": "Stack",
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {"app.kubernetes.io/managed-by": "stackd"},
                "ownerReferences": [install_owner_reference(&install)],
            },
            "spec": spec,
        }))
        .expect("stack");
        self.stacks()
            .create(&PostParams::default(), &stack)
            .await
            .expect("create stack")
    }

    /// Waits until the Stack's Ready condition has `status` and `reason`.
    async fn wait_ready(&self, name: &str, status: &str, reason: &str) -> Stack {
        let daemon = self.daemon.as_ref().expect("a daemon runs");
        let last = LastSeen::new(daemon);
        let what = format!("stack {name} Ready={status} ({reason})");
        crate::harness::wait_until(&what, SOON, &last, || async {
            let stack = self.stacks().get_opt(name).await.ok().flatten()?;
            let holds = condition(&stack, "Ready").is_some_and(|r| r["status"] == status && r["reason"] == reason);
            last.saw(&stack.status);
            holds.then_some(stack)
        })
        .await
    }

    /// Waits until `check` holds, failing with `what` and the daemon log.
    async fn until<F, Fut>(&self, what: &str, check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let daemon = self.daemon.as_ref().expect("a daemon runs");
        crate::harness::until(what, SOON, daemon, check).await
    }

    async fn event_reasons(&self, stack: &str) -> Vec<String> {
        let events: Api<Event> = Api::namespaced(self.tenant_client.clone(), NS);
        events
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(stack))
            .filter_map(|e| e.reason)
            .collect()
    }

    /// How often an Event of `reason` was recorded for the Stack (a repeat is counted in its series).
    async fn event_count(&self, stack: &str, reason: &str) -> i32 {
        let events: Api<Event> = Api::namespaced(self.tenant_client.clone(), NS);
        let list = events.list(&ListParams::default()).await.expect("events").items;
        list.into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(stack))
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| e.series.map(|s| s.count).or(e.deprecated_count).unwrap_or(1).max(1))
            .sum()
    }

    /// Host objects of this tenant that name a parent: none may outlive their Stack.
    async fn parented_host_objects(&self) -> Vec<String> {
        let selector = format!("stackd.dev/tenant={TENANT},stackd.dev/parent-kind");
        let params = ListParams::default().labels(&selector);
        let mut found: Vec<String> = Vec::new();
        for d in self.host_deployments().list(&params).await.expect("list").items {
            if d.metadata.deletion_timestamp.is_none() {
                found.push(format!("Deployment/{}", d.name_any()));
            }
        }
        for s in self.host_secrets().list(&params).await.expect("list").items {
            found.push(format!("Secret/{}", s.name_any()));
        }
        found
    }
}

/// A StackInstall or ClusterStackInstall in the test namespace, as the tenant stores it.
pub(crate) async fn create_owner_install(client: &Client, kind: &str, name: &str) -> DynamicObject {
    let resource = ApiResource {
        group: "stacks.stackd.dev".into(),
        version: "v1alpha1".into(),
        api_version: "stacks.stackd.dev/v1alpha1".into(),
        kind: kind.into(),
        plural: format!("{}s", kind.to_lowercase()),
    };
    let install: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": {"package": "example/widgets-stack:1"},
    }))
    .expect("install");
    Api::<DynamicObject>::namespaced_with(client.clone(), NS, &resource)
        .create(&PostParams::default(), &install)
        .await
        .expect("create install")
}

/// The controller owner reference an install puts on its Stack.
pub(crate) fn install_owner_reference(install: &DynamicObject) -> Value {
    json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1",
        "kind": install.types.as_ref().map(|t| t.kind.clone()).unwrap_or_default(),
        "name": install.name_any(),
        "uid": install.uid().unwrap_or_default(),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

fn condition(stack: &Stack, type_: &str) -> Option<Value> {
    let status = serde_json::to_value(stack.status.as_ref()?).ok()?;
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

fn widget_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.samples.example.org"},
        "spec": {
            "group": "samples.example.org",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [{
                "name": "v1alpha1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }]
        }
    }))
    .expect("widget crd")
}

fn pod(extra: Value) -> Value {
    let mut pod = json!({
        "initContainers": [{"name": "migrate", "image": "example/widgets:1", "args": ["migrate"]}],
        "containers": [{"name": "manager", "image": "example/widgets:1",
                        "env": [{"name": "LOG_LEVEL", "value": "debug"}]}],
    });
    if let (Some(pod), Some(extra)) = (pod.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            pod.insert(k.clone(), v.clone());
        }
    }
    pod
}

fn stack_spec(scope: &str, pod: Value) -> Value {
    json!({
        "title": "Widgets",
        "version": "1.0.0",
        "permissionScope": scope,
        "customresourcedefinitions": [{"apiVersion": "samples.example.org/v1alpha1", "kind": "Widget"}],
        "permissions": {"rules": [
            {"apiGroups": [""], "resources": ["configmaps", "events", "secrets"], "verbs": ALL_VERBS},
            {"apiGroups": ["samples.example.org"], "resources": ["widgets", "widgets/status"], "verbs": ALL_VERBS},
        ]},
        "controller": {
            "serviceAccount": {"annotations": {"example.org/owner": "team-a"}},
            "deployment": {"name": "widgets-controller", "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "widgets"}},
                "template": {"metadata": {"labels": {"app": "widgets"}}, "spec": pod},
            }},
        },
    })
}

fn default_spec() -> Value {
    stack_spec("Namespaced", pod(json!({})))
}

const INSECURE: &[&str] = &["--allow-insecure-tenant-endpoint"];
/// Every verb a stack may be granted.
const ALL_VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "update",
    "patch",
    "delete",
    "deletecollection",
];

fn writes(counts: &stackd::embedded::counters::RequestCounts) -> Vec<String> {
    counts
        .counts
        .iter()
        .filter(|(key, _)| {
            matches!(
                key.verb,
                Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection
            )
        })
        .map(|(key, n)| format!("{} {} {} x{n}", key.verb.as_str(), key.resource, key.namespace))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_becomes_ready_with_its_tenant_identity_and_host_controller() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    let stack = env.wait_ready("widgets", "True", "Available").await;

    // The Stack's status names what was made.
    let status = stack.status.clone().expect("status");
    assert_eq!(condition(&stack, "Synced").expect("synced")["status"], "True");
    assert_eq!(status.observed_generation, stack.metadata.generation);
    let controller_ref = status.controller_ref.expect("controllerRef");
    assert_eq!(
        (controller_ref.namespace.as_str(), controller_ref.name.as_str()),
        (HOST_NS, "team-a.widgets")
    );
    let token_ref = status.token_secret_ref.expect("tokenSecretRef");
    assert_eq!(token_ref.name, "team-a.widgets-token");
    assert!(stack.finalizers().contains(&STACK_FINALIZER.to_string()));

    // Tenant: ServiceAccount, system role and binding, personas, token Secret.
    let t = env.tenant_client.clone();
    let uid = stack.metadata.uid.clone().expect("uid");
    let sa = Api::<ServiceAccount>::namespaced(t.clone(), NS)
        .get("widgets")
        .await
        .expect("sa");
    assert_eq!(sa.annotations()["example.org/owner"], "team-a");
    assert_eq!(sa.owner_references()[0].uid, uid);
    let system = Api::<ClusterRole>::all(t.clone())
        .get("stackd:team-a:widgets:system")
        .await
        .expect("system role");
    let rules = system.rules.expect("rules");
    assert_eq!(rules.len(), 2);
    assert_eq!(
        rules[1].api_groups.as_deref(),
        Some(&["samples.example.org".to_string()][..])
    );
    let binding = Api::<RoleBinding>::namespaced(t.clone(), NS)
        .get("stackd:team-a:widgets")
        .await
        .expect("role binding");
    assert_eq!(binding.role_ref.name, "stackd:team-a:widgets:system");
    let subject = &binding.subjects.clone().expect("subjects")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            subject.name.as_str(),
            subject.namespace.as_deref()
        ),
        ("ServiceAccount", "widgets", Some(NS))
    );
    assert_eq!(binding.owner_references()[0].uid, uid);
    assert!(
        Api::<ClusterRoleBinding>::all(t.clone())
            .get_opt("stackd:team-a:widgets")
            .await
            .expect("get")
            .is_none(),
        "a Namespaced stack gets no ClusterRoleBinding"
    );
    for persona in ["admin", "edit", "view"] {
        let role = Api::<ClusterRole>::all(t.clone())
            .get(&format!("stackd:team-a:widgets:{persona}"))
            .await
            .expect("persona role");
        assert_eq!(
            role.labels()[&format!("rbac.authorization.k8s.io/aggregate-to-{persona}")],
            "true"
        );
        let rule = &role.rules.expect("rules")[0];
        assert_eq!(rule.resources.as_deref(), Some(&["widgets".to_string()][..]));
        let writes = rule.verbs.contains(&"create".to_string());
        assert_eq!(writes, persona != "view", "{persona}");
    }
    let token = Api::<Secret>::namespaced(t.clone(), NS)
        .get("widgets-token")
        .await
        .expect("token secret");
    assert_eq!(token.type_.as_deref(), Some("kubernetes.io/service-account-token"));
    assert_eq!(token.annotations()["kubernetes.io/service-account.name"], "widgets");
    let tenant_data = token.data.clone().expect("filled");

    // Host: the token copy, owned by the Deployment.
    let deployment = env.host_deployments().get("team-a.widgets").await.expect("deployment");
    let copy = env
        .host_secrets()
        .get("team-a.widgets-token")
        .await
        .expect("host secret");
    assert_eq!(copy.type_.as_deref(), Some("Opaque"));
    let data = copy.data.clone().expect("data");
    assert_eq!(data.keys().collect::<Vec<_>>(), ["ca.crt", "namespace", "token"]);
    assert_eq!(data["token"], tenant_data["token"]);
    assert_eq!(data["namespace"].0, NS.as_bytes());
    let owner = &copy.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), Some(&owner.uid)),
        ("Deployment", "team-a.widgets", deployment.metadata.uid.as_ref())
    );
    for object_labels in [deployment.labels(), copy.labels()] {
        assert_eq!(object_labels["app.kubernetes.io/managed-by"], "stackd");
        assert_eq!(object_labels["stackd.dev/tenant"], TENANT);
        assert_eq!(object_labels["stackd.dev/parent-kind"], "Stack");
        assert_eq!(object_labels["stackd.dev/parent-namespace"], NS);
        assert_eq!(object_labels["stackd.dev/parent-name"], "widgets");
    }
    assert_eq!(deployment.annotations()["stackd.dev/tenant-uid"], uid);

    // Host: the Deployment talks to the tenant with the copied token and nothing of the host's.
    let spec = deployment.spec.expect("spec");
    let selector = spec.selector.match_labels.clone().expect("selector");
    assert_eq!(selector["stackd.dev/tenant"], TENANT);
    assert_eq!(selector["stackd.dev/parent-name"], "widgets");
    let template_labels = spec
        .template
        .metadata
        .clone()
        .and_then(|m| m.labels)
        .expect("pod labels");
    for (k, v) in &selector {
        assert_eq!(template_labels.get(k), Some(v));
    }
    let pod = spec.template.spec.expect("pod");
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert_eq!(pod.service_account_name, None);
    #[allow(deprecated)]
    let deprecated = pod.service_account.clone();
    assert_eq!(deprecated, None);
    let pod_security = pod.security_context.clone().expect("pod security");
    assert_eq!(pod_security.run_as_non_root, Some(true));
    assert_eq!(
        pod_security.seccomp_profile.map(|p| p.type_).as_deref(),
        Some("RuntimeDefault")
    );
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("team-a.widgets-token"))
        .expect("token volume");
    let tenant_url = env.tenant.url();
    let endpoint = tenant_url.trim_start_matches("http://");
    let (endpoint_host, endpoint_port) = endpoint.split_once(':').expect("host:port");
    let containers: Vec<_> = pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
        .collect();
    assert_eq!(containers.len(), 2);
    for container in containers {
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume.name)
            .expect("token mount");
        assert_eq!(
            (mount.mount_path.as_str(), mount.read_only),
            (SA_PATH, Some(true)),
            "{}",
            container.name
        );
        let env_vars: BTreeMap<_, _> = container
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect();
        assert_eq!(env_vars["KUBERNETES_SERVICE_HOST"], endpoint_host);
        assert_eq!(env_vars["KUBERNETES_SERVICE_PORT"], endpoint_port);
        assert_eq!(env_vars["POD_NAMESPACE"], NS);
        let security = container.security_context.clone().expect("security");
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(
            security.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_string()])
        );
    }
    assert!(
        pod.containers[0].env.iter().flatten().any(|e| e.name == "LOG_LEVEL"),
        "the package's own env is kept"
    );

    // What a user sees in `kubectl describe stack`.
    let reasons = env.event_reasons("widgets").await;
    for reason in ["CreatedTenantObjects", "CreatedDeployment", "CopiedToken", "Available"] {
        assert!(reasons.iter().any(|r| r == reason), "no {reason} event in {reasons:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scoped_stack_gets_a_cluster_role_binding() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", stack_spec("Cluster", pod(json!({})))).await;
    env.wait_ready("widgets", "True", "Available").await;
    let binding = Api::<ClusterRoleBinding>::all(env.tenant_client.clone())
        .get("stackd:team-a:widgets")
        .await
        .expect("cluster role binding");
    assert_eq!(binding.role_ref.name, "stackd:team-a:widgets:system");
    assert_eq!(binding.subjects.expect("subjects")[0].namespace.as_deref(), Some(NS));
    assert!(
        Api::<RoleBinding>::namespaced(env.tenant_client.clone(), NS)
            .get_opt("stackd:team-a:widgets")
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_or_invalid_pod_specs_are_refused_and_create_no_deployment() {
    let env = Env::start(INSECURE).await;
    let bad = [
        (
            "host-path",
            pod(json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]})),
        ),
        ("host-network", pod(json!({"hostNetwork": true}))),
        ("host-pid", pod(json!({"hostPID": true}))),
        ("host-ipc", pod(json!({"hostIPC": true}))),
        (
            "privileged",
            json!({"containers": [{"name": "c", "image": "i", "securityContext": {"privileged": true}}]}),
        ),
        (
            "capabilities",
            json!({"containers": [{"name": "c", "image": "i", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}),
        ),
        (
            "projected-token",
            pod(
                json!({"volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}]}),
            ),
        ),
    ];
    for (name, pod) in &bad {
        env.create_stack(name, stack_spec("Namespaced", pod.clone())).await;
    }
    let mut invalid = default_spec();
    invalid["controller"]["deployment"]["spec"]["replicas"] = json!("three");
    env.create_stack("not-a-spec", invalid).await;
    for (name, _) in &bad {
        let stack = env.wait_ready(name, "False", "PodSpecRefused").await;
        let ready = condition(&stack, "Ready").expect("ready");
        let message = ready["message"].as_str().unwrap_or_default();
        assert!(message.contains("--insecure-pass-full-deployment"), "{message}");
        assert_eq!(condition(&stack, "Synced").expect("synced")["status"], "False");
        assert!(
            env.event_reasons(name).await.iter().any(|r| r == "PodSpecRefused"),
            "{name}: no Warning event"
        );
    }
    let stack = env.wait_ready("not-a-spec", "False", "InvalidDeploymentSpec").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(message.contains("DeploymentSpec"), "{message}");
    assert!(
        env.host_deployments()
            .list(&ListParams::default())
            .await
            .expect("list")
            .items
            .is_empty(),
        "no Deployment is created for a refused spec"
    );
    let secrets = env
        .host_secrets()
        .list(&ListParams::default())
        .await
        .expect("list")
        .items;
    assert!(secrets.is_empty(), "{secrets:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_insecure_pass_full_deployment_flag_lets_a_host_access_spec_through() {
    let env = Env::start(&["--allow-insecure-tenant-endpoint", "--insecure-pass-full-deployment"]).await;
    env.create_stack(
        "host-network",
        stack_spec("Namespaced", pod(json!({"hostNetwork": true}))),
    )
    .await;
    env.wait_ready("host-network", "True", "Available").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_beyond_the_stacks_api_are_refused() {
    let env = Env::start(INSECURE).await;
    let mut spec = default_spec();
    spec["permissions"]["rules"] = json!([
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["*"]},
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
    ]);
    env.create_stack("greedy", spec).await;
    let stack = env.wait_ready("greedy", "False", "PermissionsRefused").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    for needle in [
        "rbac.authorization.k8s.io",
        "/metrics",
        "pods",
        "--insecure-allow-all-apigroups",
    ] {
        assert!(message.contains(needle), "{needle} not in {message}");
    }
    assert!(
        Api::<ClusterRole>::all(env.tenant_client.clone())
            .get_opt("stackd:team-a:greedy:system")
            .await
            .expect("get")
            .is_none(),
        "nothing is granted"
    );
    assert!(
        env.host_deployments()
            .get_opt("team-a.greedy")
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_http_tenant_endpoint_makes_the_stack_unready_unless_allowed() {
    let env = Env::start(&[]).await;
    env.create_stack("widgets", default_spec()).await;
    let stack = env.wait_ready("widgets", "False", "TenantEndpointUnusable").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(message.contains("--allow-insecure-tenant-endpoint"), "{message}");
    assert!(
        env.host_deployments()
            .get_opt("team-a.widgets")
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_names_give_valid_hashed_deployment_names_and_label_values() {
    let env = Env::start(INSECURE).await;
    let name = "stack-with-a-really-long-resource-name-so-long-that-it-will-be-truncated";
    env.create_stack(name, default_spec()).await;
    env.wait_ready(name, "True", "Available").await;
    let expected = host_name(Some(NS), name, "", NameKind::LabelBound);
    assert!(expected.len() <= 63 && expected != format!("{NS}.{name}"));
    let deployment = env.host_deployments().get(&expected).await.expect("hashed deployment");
    let labels = deployment.labels();
    assert!(labels.values().all(|v| v.len() <= 63), "{labels:?}");
    assert_eq!(deployment.annotations()["stackd.dev/tenant-name"], name);
    let selector = deployment
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.clone())
        .expect("selector");
    assert!(selector.values().all(|v| v.len() <= 63), "{selector:?}");
    assert_eq!(
        selector["stackd.dev/parent-name"],
        stackd::host::names::label_value(name)
    );
    let secret = host_name(Some(NS), name, "-token", NameKind::Object);
    assert_eq!(
        secret,
        format!("{NS}.{name}-token"),
        "253 leaves room for the whole name"
    );
    env.host_secrets().get(&secret).await.expect("token copy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_object_at_the_mapped_name_owned_by_someone_else_is_never_touched() {
    let mut env = Env::servers().await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": HOST_NS}})).expect("ns");
    Api::<Namespace>::all(env.host_client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("host ns");
    let stranger: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "team-a.widgets", "labels": {"app": "someone-elses"}},
        "spec": {
            "selector": {"matchLabels": {"app": "someone-elses"}},
            "template": {"metadata": {"labels": {"app": "someone-elses"}},
                         "spec": {"containers": [{"name": "c", "image": "theirs:1"}]}},
        },
    }))
    .expect("deployment");
    let stranger = env
        .host_deployments()
        .create(&PostParams::default(), &stranger)
        .await
        .expect("stranger");
    env.start_daemon(INSECURE);
    env.create_stack("widgets", default_spec()).await;
    let stack = env.wait_ready("widgets", "False", "HostObjectConflict").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(message.contains("team-a.widgets"), "{message}");
    env.until("a HostObjectConflict event", || async {
        env.event_reasons("widgets")
            .await
            .iter()
            .any(|r| r == "HostObjectConflict")
    })
    .await;
    env.reconcile_again("widgets", "1").await;
    let after = env.host_deployments().get("team-a.widgets").await.expect("still there");
    assert_eq!(after.metadata.uid, stranger.metadata.uid);
    // Its status moves (the host's Deployment controller), its spec and labels never do.
    assert_eq!(after.metadata.generation, stranger.metadata.generation, "never written");
    assert_eq!(after.labels(), stranger.labels());
    assert_eq!(
        serde_json::to_value(&after.spec).expect("json"),
        serde_json::to_value(&stranger.spec).expect("json")
    );
    assert_eq!(env.host.counters().get(Verb::Update, "deployments", Some(HOST_NS)), 0);
    assert_eq!(env.host.counters().get(Verb::Patch, "deployments", Some(HOST_NS)), 0);
    assert_eq!(env.host.counters().get(Verb::Delete, "deployments", Some(HOST_NS)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_drift_is_repaired() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    let deployments = env.host_deployments();
    let secrets = env.host_secrets();

    // An edited Deployment is put back.
    let patch = json!({"spec": {"template": {"spec": {"automountServiceAccountToken": true}}}});
    deployments
        .patch("team-a.widgets", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("edit");
    env.until("the edited Deployment to be repaired", || async {
        deployments
            .get("team-a.widgets")
            .await
            .ok()
            .and_then(|d| d.spec?.template.spec?.automount_service_account_token)
            == Some(false)
    })
    .await;

    // A deleted Deployment comes back, and the token copy follows its new uid.
    let old = deployments.get("team-a.widgets").await.expect("deployment");
    deployments
        .delete("team-a.widgets", &DeleteParams::background())
        .await
        .expect("delete");
    env.until("the deleted Deployment to be recreated", || async {
        let Ok(Some(new)) = deployments.get_opt("team-a.widgets").await else {
            return false;
        };
        let Ok(Some(copy)) = secrets.get_opt("team-a.widgets-token").await else {
            return false;
        };
        new.metadata.uid != old.metadata.uid
            && new.metadata.deletion_timestamp.is_none()
            && copy.owner_references().first().map(|o| &o.uid) == new.metadata.uid.as_ref()
    })
    .await;

    // An edited and a deleted token copy are put back.
    let original = secrets.get("team-a.widgets-token").await.expect("copy").data;
    let patch = json!({"data": {"token": "Zm9yZ2Vk"}});
    secrets
        .patch("team-a.widgets-token", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("edit");
    env.until("the edited token copy to be repaired", || async {
        secrets.get("team-a.widgets-token").await.ok().map(|s| s.data) == Some(original.clone())
    })
    .await;
    secrets
        .delete("team-a.widgets-token", &DeleteParams::default())
        .await
        .expect("delete");
    env.until("the deleted token copy to be recreated", || async {
        secrets
            .get_opt("team-a.widgets-token")
            .await
            .ok()
            .flatten()
            .map(|s| s.data)
            == Some(original.clone())
    })
    .await;
    env.wait_ready("widgets", "True", "Available").await;
    env.until("an UpdatedDeployment event", || async {
        env.event_reasons("widgets")
            .await
            .iter()
            .any(|r| r == "UpdatedDeployment")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_tenant_token_is_copied_again() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    let tenant_secrets: Api<Secret> = Api::namespaced(env.tenant_client.clone(), NS);
    // The tenant rotates the token (as a token controller re-issuing it would).
    let rotated = json!({"data": {"token": "cm90YXRlZC10b2tlbg=="}});
    tenant_secrets
        .patch("widgets-token", &PatchParams::default(), &Patch::Merge(&rotated))
        .await
        .expect("rotate");
    env.until("the rotated token on the host", || async {
        env.host_secrets()
            .get("team-a.widgets-token")
            .await
            .ok()
            .and_then(|s| s.data)
            .is_some_and(|d| d["token"].0 == b"rotated-token")
    })
    .await;
    env.until("a RecopiedToken event", || async {
        env.event_reasons("widgets").await.iter().any(|r| r == "RecopiedToken")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_stack_reconciles_again_with_zero_writes() {
    let mut env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    // The last events of the first reconciles are written before the poke.
    let daemon = env.daemon.as_ref().expect("a daemon runs");
    quiet(
        daemon,
        &daemon.reconciles(&[(TENANT, "stack")]),
        &[&env.host, &env.tenant],
    )
    .await;
    let before_reconciles = env.reconciles_done();
    let patch = json!({"metadata": {"annotations": {"example.org/poke": "1"}}});
    env.stacks()
        .patch("widgets", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("poke");
    let (host_before, tenant_before) = (env.host.counters(), env.tenant.counters());
    env.until("a second reconcile to finish", || async {
        env.reconciles_done() > before_reconciles
    })
    .await;
    let host_writes = writes(&env.host.counters().since(&host_before));
    let tenant_writes = writes(&env.tenant.counters().since(&tenant_before));
    assert!(host_writes.is_empty(), "host writes: {host_writes:?}");
    assert!(tenant_writes.is_empty(), "tenant writes: {tenant_writes:?}");

    // A restarted daemon reconciles every Stack from scratch, and still writes nothing.
    env.stop_daemon();
    let (host_before, tenant_before) = (env.host.counters(), env.tenant.counters());
    env.start_daemon(INSECURE);
    env.until("the restarted daemon's first reconcile to finish", || async {
        env.reconciles_done() > 0
    })
    .await;
    let host_writes = writes(&env.host.counters().since(&host_before));
    let tenant_writes = writes(&env.tenant.counters().since(&tenant_before));
    assert!(host_writes.is_empty(), "host writes after a restart: {host_writes:?}");
    assert!(
        tenant_writes.is_empty(),
        "tenant writes after a restart: {tenant_writes:?}"
    );
}

/// Marks the Widget CRD as used by the Stack, as the install controller does.
async fn label_crd_for(env: &Env, stack: &str) -> String {
    let label = crd_parent_label(NS, stack);
    let patch = json!({"metadata": {"labels": {label.clone(): "true"}}});
    Api::<CustomResourceDefinition>::all(env.tenant_client.clone())
        .patch(
            "widgets.samples.example.org",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("label CRD");
    label
}

async fn crd_labels(env: &Env) -> BTreeMap<String, String> {
    Api::<CustomResourceDefinition>::all(env.tenant_client.clone())
        .get("widgets.samples.example.org")
        .await
        .expect("crd")
        .labels()
        .clone()
}

async fn tenant_rbac_left(env: &Env) -> Vec<String> {
    let t = env.tenant_client.clone();
    let mut left = Vec::new();
    for role in Api::<ClusterRole>::all(t.clone())
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
    {
        if role.name_any().starts_with("stackd:team-a:widgets") {
            left.push(format!("ClusterRole/{}", role.name_any()));
        }
    }
    for binding in Api::<ClusterRoleBinding>::all(t)
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
    {
        if binding.name_any().starts_with("stackd:team-a:widgets") {
            left.push(format!("ClusterRoleBinding/{}", binding.name_any()));
        }
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_removes_host_objects_then_tenant_rbac_then_the_crd_label() {
    let env = Env::start(INSECURE).await;
    let label = label_crd_for(&env, "widgets").await;
    let other = label_crd_for(&env, "another-stack").await;
    env.create_stack("widgets", stack_spec("Cluster", pod(json!({})))).await;
    env.wait_ready("widgets", "True", "Available").await;
    assert_eq!(tenant_rbac_left(&env).await.len(), 5, "system, 3 personas, binding");

    // Tenant RBAC deletes fail for now: the host side must already be gone, the CRD label kept.
    env.tenant.faults().fail_next(
        usize::MAX,
        RequestMatch::any().verb(Verb::Delete).resource("clusterroles"),
        500,
    );
    env.stacks()
        .delete("widgets", &DeleteParams::default())
        .await
        .expect("delete stack");
    env.until("the host objects to go first", || async {
        env.parented_host_objects().await.is_empty()
    })
    .await;
    assert!(!tenant_rbac_left(&env).await.is_empty());
    assert!(
        crd_labels(&env).await.contains_key(&label),
        "the CRD label goes after the RBAC"
    );
    assert!(env.stacks().get_opt("widgets").await.expect("get").is_some());

    env.tenant.faults().clear();
    env.until("the Stack to be gone", || async {
        env.stacks().get_opt("widgets").await.expect("get").is_none()
    })
    .await;
    assert_eq!(tenant_rbac_left(&env).await, Vec::<String>::new());
    let labels = crd_labels(&env).await;
    assert!(!labels.contains_key(&label), "{labels:?}");
    assert!(labels.contains_key(&other), "another stack's label stays");
    assert_eq!(env.parented_host_objects().await, Vec::<String>::new());
    let t = env.tenant_client.clone();
    env.until("owned tenant objects to be collected", || async {
        Api::<ServiceAccount>::namespaced(t.clone(), NS)
            .get_opt("widgets")
            .await
            .ok()
            .flatten()
            .is_none()
            && Api::<Secret>::namespaced(t.clone(), NS)
                .get_opt("widgets-token")
                .await
                .ok()
                .flatten()
                .is_none()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uninstall_while_the_tenant_is_unreachable_completes_when_it_returns() {
    let mut env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    env.stop_daemon();
    env.stacks()
        .delete("widgets", &DeleteParams::default())
        .await
        .expect("delete stack");
    // The tenant answers nothing while the daemon comes back.
    env.tenant.faults().fail_next(usize::MAX, RequestMatch::any(), 503);
    env.start_daemon(INSECURE);
    // The daemon has met the 503s: it reports the tenant down.
    env.until("the tenant reported down", || async {
        env.metrics()
            .contains("stackd_tenant_down_cause{tenant=\"acme\",cause=\"server_busy\"} 1")
    })
    .await;
    assert_eq!(
        env.parented_host_objects().await.len(),
        2,
        "nothing is deleted while the tenant cannot be read"
    );
    env.tenant.faults().clear();
    env.until("the uninstall to finish", || async {
        env.stacks().get_opt("widgets").await.expect("get").is_none()
    })
    .await;
    assert_eq!(env.parented_host_objects().await, Vec::<String>::new());
    assert_eq!(tenant_rbac_left(&env).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_midway_converges_without_duplicates() {
    let mut env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    let t = env.tenant_client.clone();
    env.until("the tenant ServiceAccount", || async {
        Api::<ServiceAccount>::namespaced(t.clone(), NS)
            .get_opt("widgets")
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    env.stop_daemon();
    env.start_daemon(INSECURE);
    env.wait_ready("widgets", "True", "Available").await;
    // Kill it again after the token copy, and restart: still one of everything.
    env.stop_daemon();
    env.start_daemon(INSECURE);
    env.until("the restarted daemon's first reconcile to finish", || async {
        env.reconciles_done() > 0
    })
    .await;
    env.wait_ready("widgets", "True", "Available").await;
    let mut objects = env.parented_host_objects().await;
    objects.sort();
    assert_eq!(objects, ["Deployment/team-a.widgets", "Secret/team-a.widgets-token"]);
    let accounts = Api::<ServiceAccount>::namespaced(t.clone(), NS)
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=stackd"))
        .await
        .expect("list");
    assert_eq!(accounts.items.len(), 1);
    let tokens = Api::<Secret>::namespaced(t.clone(), NS)
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=stackd"))
        .await
        .expect("list");
    assert_eq!(tokens.items.len(), 1);
    assert_eq!(tenant_rbac_left(&env).await.len(), 4, "system and 3 personas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_drift_is_repaired_and_a_recreated_account_gets_its_new_token_copied() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    let t = env.tenant_client.clone();
    let roles: Api<ClusterRole> = Api::all(t.clone());

    // Edited rules and a deleted persona role come back.
    let patch = json!({"rules": []});
    roles
        .patch(
            "stackd:team-a:widgets:system",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("edit");
    roles
        .delete("stackd:team-a:widgets:view", &DeleteParams::default())
        .await
        .expect("delete");
    env.until("the tenant roles to be repaired", || async {
        let system = roles.get("stackd:team-a:widgets:system").await.ok();
        let view = roles.get_opt("stackd:team-a:widgets:view").await.ok().flatten();
        system.and_then(|r| r.rules).is_some_and(|r| r.len() == 2) && view.is_some()
    })
    .await;

    // A deleted ServiceAccount is recreated; its old token dies with it, and the new one is copied.
    let secrets: Api<Secret> = Api::namespaced(t.clone(), NS);
    let old_token = secrets.get("widgets-token").await.expect("token").data.expect("data")["token"].clone();
    Api::<ServiceAccount>::namespaced(t.clone(), NS)
        .delete("widgets", &DeleteParams::default())
        .await
        .expect("delete sa");
    env.until("a new token on tenant and host", || async {
        let tenant_token = secrets
            .get_opt("widgets-token")
            .await
            .ok()
            .flatten()
            .and_then(|s| s.data)
            .and_then(|d| d.get("token").cloned());
        let host_token = env
            .host_secrets()
            .get_opt("team-a.widgets-token")
            .await
            .ok()
            .flatten()
            .and_then(|s| s.data)
            .and_then(|d| d.get("token").cloned());
        tenant_token.is_some() && tenant_token != Some(old_token.clone()) && host_token == tenant_token
    })
    .await;

    // A spec change is reconciled, and the status says which generation it describes.
    let patch = json!({"spec": {"version": "1.0.1"}});
    env.stacks()
        .patch("widgets", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("version");
    env.until("the status to describe the new generation", || async {
        let Ok(stack) = env.stacks().get("widgets").await else {
            return false;
        };
        let ready = condition(&stack, "Ready");
        stack.status.as_ref().and_then(|s| s.observed_generation) == stack.metadata.generation
            && ready
                .is_some_and(|c| c["status"] == "True" && c["observedGeneration"] == json!(stack.metadata.generation))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_dropped_from_the_spec_stops_running_on_the_host() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    let patch = json!({"spec": {"controller": {"deployment": null}}});
    env.stacks()
        .patch("widgets", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("drop the controller");
    let stack = env.wait_ready("widgets", "True", "NoController").await;
    let status = stack.status.expect("status");
    assert_eq!((status.controller_ref, status.token_secret_ref), (None, None));
    env.until("the host objects to go", || async {
        env.parented_host_objects().await.is_empty()
    })
    .await;
    assert!(
        Api::<ClusterRole>::all(env.tenant_client.clone())
            .get_opt("stackd:team-a:widgets:system")
            .await
            .expect("get")
            .is_some(),
        "the permissions stay with the stack"
    );
}

/// The whole of issue 7's first promise, through both controllers: a StackInstall of the sample
/// package ends with its controller running on the host, and its deletion leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_install_ends_with_its_controller_available_on_the_host_and_uninstalls_cleanly() {
    use crate::stacks_install::{StackFleet, create_install, wait_for_reason};
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, NS, "sample", json!({"package": "examples/sample-stack:v1"})).await;
    let (status, _, message) = wait_for_reason(&tenant, NS, "sample", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
    let stack = Api::<Stack>::namespaced(tenant.clone(), NS)
        .get("sample")
        .await
        .expect("stack");
    assert_eq!(condition(&stack, "Ready").expect("ready")["status"], "True");
    let deployments: Api<Deployment> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let deployment = deployments.get("team-a.sample").await.expect("controller deployment");
    let pod = deployment.spec.and_then(|s| s.template.spec).expect("pod");
    assert_eq!(pod.automount_service_account_token, Some(false));
    let secrets = fleet.host_secrets(TENANT);
    secrets.get("team-a.sample-token").await.expect("token copy");

    Api::<stackd::api::stacks::StackInstall>::namespaced(tenant.clone(), NS)
        .delete("sample", &DeleteParams::default())
        .await
        .expect("delete install");
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), NS);
    let host = fleet.host_client.clone();
    crate::harness::wait_until("everything gone", SOON, &daemon, || {
        let (stacks, host) = (stacks.clone(), host.clone());
        async move {
            let params = ListParams::default().labels(&format!("stackd.dev/tenant={TENANT},stackd.dev/parent-kind"));
            let left_deployments = Api::<Deployment>::namespaced(host.clone(), HOST_NS)
                .list(&params)
                .await
                .ok()?
                .items
                .into_iter()
                .filter(|d| d.metadata.deletion_timestamp.is_none())
                .count();
            let left_secrets = Api::<Secret>::namespaced(host, HOST_NS)
                .list(&params)
                .await
                .ok()?
                .items
                .len();
            let stack_gone = stacks.get_opt("sample").await.ok()?.is_none();
            (stack_gone && left_deployments == 0 && left_secrets == 0).then_some(())
        }
    })
    .await;
    let roles = Api::<ClusterRole>::all(tenant.clone())
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=stackd"))
        .await
        .expect("roles");
    assert!(
        roles.items.is_empty(),
        "{:?}",
        roles.items.iter().map(|r| r.name_any()).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacks_waiting_together_for_a_starting_daemon_all_become_ready_promptly() {
    let mut env = Env::servers().await;
    let names: Vec<String> = (0..6).map(|i| format!("widgets-{i}")).collect();
    for name in &names {
        env.create_stack(name, default_spec()).await;
    }
    env.start_daemon(INSECURE);
    for name in &names {
        env.wait_ready(name, "True", "Available").await;
    }
    // Every first reconcile waits for the same watches to list, and the next ones may run on copies
    // older than their own last write (the finalizer's): neither is a failed reconcile.
    let errors = env
        .metrics()
        .lines()
        .find_map(|line| {
            line.strip_prefix(&format!(
                "stackd_reconcile_errors_total{{tenant=\"{TENANT}\",controller=\"stack\"}} "
            ))
            .map(str::to_string)
        })
        .unwrap_or_else(|| "0".into());
    assert_eq!(
        errors.trim(),
        "0",
        "a reconcile of a starting daemon failed\n{}",
        env.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_waits_for_its_crds_and_proceeds_when_they_appear() {
    let env = Env::start(INSECURE).await;
    let mut spec = default_spec();
    spec["customresourcedefinitions"] = json!([{"apiVersion": "gadgets.example.org/v1", "kind": "Gadget"}]);
    spec["permissions"]["rules"][1]["apiGroups"] = json!(["gadgets.example.org"]);
    spec["permissions"]["rules"][1]["resources"] = json!(["gadgets"]);
    env.create_stack("gadgets", spec).await;
    let stack = env.wait_ready("gadgets", "False", "WaitingForCrds").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(message.contains("Gadget.gadgets.example.org"), "{message}");
    let mut crd = serde_json::to_value(widget_crd()).expect("json");
    crd["metadata"]["name"] = json!("gadgets.gadgets.example.org");
    crd["metadata"]["labels"] = json!({crd_parent_label(NS, "gadgets"): "true"});
    crd["spec"]["group"] = json!("gadgets.example.org");
    crd["spec"]["names"] =
        json!({"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "listKind": "GadgetList"});
    crd["spec"]["versions"][0]["name"] = json!("v1");
    let crd: CustomResourceDefinition = serde_json::from_value(crd).expect("crd");
    Api::<CustomResourceDefinition>::all(env.tenant_client.clone())
        .create(&PostParams::default(), &crd)
        .await
        .expect("create CRD");
    env.wait_ready("gadgets", "True", "Available").await;
    let view = Api::<ClusterRole>::all(env.tenant_client.clone())
        .get("stackd:team-a:gadgets:view")
        .await
        .expect("persona role");
    let rule = &view.rules.expect("rules")[0];
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&["gadgets.example.org".to_string()][..])
    );
    assert_eq!(rule.resources.as_deref(), Some(&["gadgets".to_string()][..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_object_stackd_did_not_create_is_never_taken_over() {
    let env = Env::start(INSECURE).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(env.tenant_client.clone(), NS);
    let theirs: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "widgets", "labels": {"team": "a"}}})).expect("sa");
    let theirs = accounts.create(&PostParams::default(), &theirs).await.expect("sa");
    env.create_stack("widgets", default_spec()).await;
    let stack = env.wait_ready("widgets", "False", "TenantObjectConflict").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(message.contains("ServiceAccount team-a/widgets"), "{message}");
    // The ClusterRoles are written beside the ServiceAccount, and the Event names them; the token
    // Secret waits for its ServiceAccount.
    env.until(
        "the ClusterRoles written beside the refused ServiceAccount named in an Event",
        || async {
            let events: Api<Event> = Api::namespaced(env.tenant_client.clone(), NS);
            let events = events.list(&ListParams::default()).await.expect("events").items;
            events.iter().any(|event| {
                event.reason.as_deref() == Some("CreatedTenantObjects")
                    && event.note.as_deref().is_some_and(|note| {
                        note.contains("ClusterRole stackd:team-a:widgets:system")
                            && note.contains("ClusterRole stackd:team-a:widgets:view")
                            && !note.contains("ServiceAccount")
                    })
            })
        },
    )
    .await;
    let roles = Api::<ClusterRole>::all(env.tenant_client.clone());
    assert!(
        roles
            .get_opt("stackd:team-a:widgets:system")
            .await
            .expect("get")
            .is_some()
    );
    let secrets = Api::<Secret>::namespaced(env.tenant_client.clone(), NS);
    assert!(secrets.get_opt("widgets-token").await.expect("get").is_none());
    env.reconcile_again("widgets", "1").await;
    let after = accounts.get("widgets").await.expect("sa");
    assert_eq!(
        after.metadata.resource_version, theirs.metadata.resource_version,
        "never written"
    );
    assert!(
        env.host_deployments()
            .get_opt("team-a.widgets")
            .await
            .expect("get")
            .is_none()
    );
}

/// A registry login of type `kubernetes.io/dockerconfigjson` in the test namespace.
async fn create_pull_secret(env: &Env, name: &str) -> Secret {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": name},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": "{\"auths\":{\"registry.example.com\":{\"auth\":\"dzp3\"}}}"},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(env.tenant_client.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("pull secret")
}

fn with_pull_secrets(names: &[&str]) -> Value {
    let mut spec = default_spec();
    spec["controller"]["imagePullSecrets"] = names.iter().map(|name| json!({"name": name})).collect();
    spec
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

/// Nothing of the Stack exists yet: no host object, no ServiceAccount on the tenant.
async fn assert_nothing_made(env: &Env) {
    assert_eq!(env.parented_host_objects().await, Vec::<String>::new());
    let accounts: Api<ServiceAccount> = Api::namespaced(env.tenant_client.clone(), NS);
    assert!(
        accounts.get_opt("widgets").await.expect("get").is_none(),
        "a ServiceAccount was made"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_whose_pull_secret_is_missing_says_which_and_makes_nothing_until_it_exists() {
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", with_pull_secrets(&["creds"])).await;
    let stack = env.wait_ready("widgets", "False", "PullSecretMissing").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(
        message.contains("creds") && message.contains("namespace team-a"),
        "{message}"
    );
    env.until("an Event PullSecretMissing", || async {
        env.event_reasons("widgets")
            .await
            .contains(&"PullSecretMissing".to_string())
    })
    .await;
    assert_nothing_made(&env).await;

    // Once the Secret exists, the next change of the Stack finds it.
    let source = create_pull_secret(&env, "creds").await;
    env.stacks()
        .patch(
            "widgets",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"example.org/nudge": "1"}}})),
        )
        .await
        .expect("annotate");
    env.wait_ready("widgets", "True", "Available").await;
    let deployment = env.host_deployments().get("team-a.widgets").await.expect("deployment");
    let refs = pull_refs(&deployment);
    assert_eq!(refs.len(), 1, "{refs:?}");
    let copy = env.host_secrets().get(&refs[0]).await.expect("copy");
    assert_eq!(copy.data, source.data, "the copy holds the tenant Secret's credentials");
    assert_eq!(copy.owner_references()[0].uid, deployment.uid().expect("uid"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_naming_a_secret_outside_its_namespace_is_refused() {
    let env = Env::start(INSECURE).await;
    // Edited onto the Stack by a tenant user, past the install's checks.
    let attack = "../../kube-system/secrets/registry";
    env.create_stack("widgets", with_pull_secrets(&["creds", attack])).await;
    let stack = env.wait_ready("widgets", "False", "InvalidPullSecretName").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].to_string();
    assert!(
        message.contains(attack) && message.contains("namespace team-a"),
        "{message}"
    );
    env.until("an Event InvalidPullSecretName", || async {
        env.event_reasons("widgets")
            .await
            .contains(&"InvalidPullSecretName".to_string())
    })
    .await;
    assert_nothing_made(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_secret_dropped_from_the_stack_leaves_the_pod_spec_and_its_copy_is_deleted() {
    let env = Env::start(INSECURE).await;
    create_pull_secret(&env, "creds").await;
    create_pull_secret(&env, "mirror").await;
    env.create_stack("widgets", with_pull_secrets(&["creds", "mirror"]))
        .await;
    env.wait_ready("widgets", "True", "Available").await;
    let deployment = env.host_deployments().get("team-a.widgets").await.expect("deployment");
    let refs = pull_refs(&deployment);
    assert_eq!(refs.len(), 2, "{refs:?}");
    for name in &refs {
        env.host_secrets().get(name).await.expect("copy");
    }

    env.stacks()
        .patch(
            "widgets",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"controller": {"imagePullSecrets": [{"name": "creds"}]}}})),
        )
        .await
        .expect("drop mirror");
    let (kept, dropped) = (refs[0].clone(), refs[1].clone());
    env.until("mirror's copy gone from the pod spec and the host", || {
        let (kept, dropped) = (kept.clone(), dropped.clone());
        let (deployments, secrets) = (env.host_deployments(), env.host_secrets());
        async move {
            let Ok(deployment) = deployments.get("team-a.widgets").await else {
                return false;
            };
            pull_refs(&deployment) == [kept] && secrets.get_opt(&dropped).await.ok().flatten().is_none()
        }
    })
    .await;
    assert!(
        env.host_secrets().get_opt(&refs[0]).await.expect("get").is_some(),
        "creds' copy kept"
    );
    env.until("an Event DeletedPullSecrets", || async {
        env.event_reasons("widgets")
            .await
            .contains(&"DeletedPullSecrets".to_string())
    })
    .await;
}

/// Issue 30: a Stack gone while the daemon's cleanup finishes (its copy still showed the finalizer)
/// meets a 404 when the finalizer is removed: that is the end of the Stack, not a failed reconcile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_gone_while_its_cleanup_finishes_is_no_failed_reconcile() {
    use stackd::embedded::discovery::Resources;
    use stackd::embedded::{verb_options, verbs};
    let env = Env::start(INSECURE).await;
    env.create_stack("widgets", default_spec()).await;
    env.wait_ready("widgets", "True", "Available").await;
    let finalizer_patches = |env: &Env| {
        env.tenant
            .counters()
            .counts
            .iter()
            .filter(|(key, _)| key.verb == Verb::Patch && key.resource == "stacks.stacks.stackd.dev")
            .map(|(_, count)| *count)
            .sum::<u64>()
    };
    let errors = |env: &Env| {
        let needle = format!("stackd_reconcile_errors_total{{tenant=\"{TENANT}\",controller=\"stack\"}} ");
        env.metrics()
            .lines()
            .find_map(|line| line.strip_prefix(&needle).and_then(|n| n.trim().parse::<u64>().ok()))
            .unwrap_or(0)
    };
    // The daemon's removal of its finalizer is held up for a moment...
    let patches = RequestMatch::any().verb(Verb::Patch).resource("stacks");
    env.tenant.faults().add_latency(patches, Duration::from_secs(2));
    let before = finalizer_patches(&env);
    env.stacks()
        .delete("widgets", &DeleteParams::default())
        .await
        .expect("delete stack");
    env.until("the daemon removing its finalizer", || async {
        finalizer_patches(&env) > before
    })
    .await;
    let (done, failed) = (env.reconciles_done(), errors(&env));
    // ... while someone else removes it (in-process, past the latency): the Stack is gone.
    let store = env.tenant.store();
    let info = Resources::current(&store)
        .find("stacks.stackd.dev", "v1alpha1", "stacks")
        .expect("stacks");
    let unfinalized = json!({"metadata": {"finalizers": null}});
    let body = serde_json::to_vec(&unfinalized).expect("patch");
    let patch = stackd::embedded::patch::PatchBody {
        patch_type: stackd::embedded::patch::PatchType::Merge,
        body: &body,
    };
    verbs::patch(
        &store,
        &info,
        NS,
        "widgets",
        patch,
        verb_options::Subresource::Main,
        Default::default(),
    )
    .expect("finalizer removed");
    env.until("the reconcile that met the 404", || async {
        env.reconciles_done() > done
    })
    .await;
    env.tenant.faults().clear();
    assert!(env.stacks().get_opt("widgets").await.expect("get").is_none());
    assert_eq!(errors(&env), failed, "a failed reconcile:\n{}", env.log());
    assert!(!env.log().contains("reconcile failed"), "{}", env.log());
}

/// What the kubelet says of a controller pod that does not run is the Stack's status, with what to
/// do, and a Warning Event; never only "Deployment does not have minimum availability" (issue 52).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_kubelet_says_of_a_controller_pod_reaches_the_stack() {
    let env = Env::servers().await;
    let runners = env.host.runners();
    let image = |name: &str| ImageMatch::Exact(format!("example/{name}:1"));
    runners.fault(image("no-such"), PodFault::Unpullable);
    runners.fault(
        image("crashes"),
        PodFault::CrashLoop {
            exit_code: 2,
            reason: "Error",
        },
    );
    runners.fault(
        image("too-big"),
        PodFault::CrashLoop {
            exit_code: 137,
            reason: "OOMKilled",
        },
    );
    runners.without_user(image("runs-as-root"));
    runners.fault(image("no-room"), PodFault::Unschedulable);
    let mut env = env;
    // Only a pod passed unchecked can meet runAsNonRoot with an image that runs as root: stackd
    // otherwise names a non-root user for it.
    env.start_daemon(&[INSECURE[0], "--insecure-pass-full-deployment"]);
    let cases = [
        (
            "no-such",
            "ControllerImagePullFailed",
            "the image cannot be pulled",
            "ImagePullBackOff",
        ),
        (
            "crashes",
            "ControllerCrashLooping",
            "keeps exiting",
            "CrashLoopBackOff (last exit code 2)",
        ),
        ("too-big", "ControllerOutOfMemory", "ran out of memory", "OOMKilled"),
        (
            "runs-as-root",
            "ControllerConfigError",
            "the image runs as root, which runAsNonRoot forbids: build it with a numeric non-root USER",
            "CreateContainerConfigError: container has runAsNonRoot and image will run as root",
        ),
        (
            "no-room",
            "ControllerUnschedulable",
            "the pod cannot be scheduled",
            "Unschedulable: 0/1 nodes are available: 1 Insufficient memory",
        ),
    ];
    for (name, _, _, _) in cases {
        let pod = json!({"securityContext": {"runAsNonRoot": true},
            "containers": [{"name": "manager", "image": format!("example/{name}:1"),
            "env": [{"name": "API_KEY", "value": "host-secret-value"}]}]});
        env.create_stack(name, stack_spec("Namespaced", pod)).await;
    }
    for (name, reason, advice, said) in cases {
        let stack = env.wait_ready(name, "False", reason).await;
        let ready = condition(&stack, "Ready").expect("ready");
        let message = ready["message"].as_str().unwrap_or_default();
        assert!(message.contains(advice) && message.contains(said), "{name}: {message}");
        assert!(!message.contains("host-secret-value"), "{name}: {message}");
        env.until(&format!("{name}: a {reason} Event"), || async {
            env.event_reasons(name).await.iter().any(|r| r == reason)
        })
        .await;
    }
    // A trouble that does not change is told once, however often the Stack is reconciled.
    for (name, reason, _, _) in cases {
        for poke in ["1", "2"] {
            env.reconcile_again(name, poke).await;
        }
        assert_eq!(env.event_count(name, reason).await, 1, "{name}: {reason} Events");
        let ready = condition(&env.stacks().get(name).await.expect("stack"), "Ready").expect("ready");
        assert_eq!(ready["reason"], reason, "{name}");
    }
}

/// The controller's token and pull-secret copies exist on the host before its Deployment does, so
/// no pod of it waits on a missing volume (the kubelet's FailedMount, issue 52); once the
/// Deployment exists they are owned by it, which tells the user nothing new (no Recopied Event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copies_exist_before_the_controller_deployment_and_are_owned_by_it() {
    let mut env = Env::servers().await;
    // What the Deployment's pods would mount or pull with that is missing, at its creation (the
    // first write of it the host admits).
    let missing: Arc<Mutex<Option<Vec<String>>>> = Arc::default();
    let (store, seen) = (env.host.store(), missing.clone());
    env.host.admission().mutate("apps", "deployments", move |deployment| {
        let mut seen = seen.lock().unwrap();
        if seen.is_some() {
            return;
        }
        let pod = &deployment["spec"]["template"]["spec"];
        let names = |list: &str, field: &[&str]| -> Vec<String> {
            let all = pod[list].as_array().cloned().unwrap_or_default();
            let name = |v: &Value| field.iter().fold(v.clone(), |v, f| v[f].clone());
            all.iter().filter_map(|v| name(v).as_str().map(String::from)).collect()
        };
        let mut wanted = names("volumes", &["secret", "secretName"]);
        wanted.extend(names("imagePullSecrets", &["name"]));
        let secrets = GroupResource::new("", "secrets");
        *seen = Some(
            wanted
                .into_iter()
                .filter(|name| !store.contains(&secrets, HOST_NS, name))
                .collect(),
        );
    });
    env.start_daemon(INSECURE);
    create_pull_secret(&env, "regcred").await;
    env.create_stack("widgets", with_pull_secrets(&["regcred"])).await;
    env.wait_ready("widgets", "True", "Available").await;
    assert_eq!(
        missing.lock().unwrap().clone(),
        Some(vec![]),
        "Secrets the controller's pods use were missing when its Deployment was created"
    );
    let deployment = env.host_deployments().get("team-a.widgets").await.expect("deployment");
    let uid = deployment.uid().expect("uid");
    let copies = ListParams::default().labels("stackd.dev/parent-kind=Stack");
    env.until("the token and pull-secret copies owned by the Deployment", || async {
        let secrets = env.host_secrets().list(&copies).await.expect("list").items;
        secrets.len() == 2
            && secrets
                .iter()
                .all(|s| s.owner_references().iter().any(|o| o.uid == uid))
    })
    .await;
    let reasons = env.event_reasons("widgets").await;
    assert!(reasons.contains(&"CopiedToken".to_string()), "{reasons:?}");
    assert!(
        !reasons.iter().any(|r| r.starts_with("Recopied")),
        "owning the copies is no new copy: {reasons:?}"
    );
}

/// A controller pod the host's quota refuses (kube's ReplicaSet `ReplicaFailure` `FailedCreate`)
/// is the Stack's status, with the API server's words and what to do, and a Warning Event; not
/// "no replica is available yet" for ever (issue 52).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_pod_the_host_quota_refuses_is_in_the_stack_s_status() {
    let env = Env::start(&[
        INSECURE[0],
        "--tenant-quota",
        "pods=0,requests.cpu=8,requests.memory=16Gi,limits.cpu=16,limits.memory=32Gi",
    ])
    .await;
    let quotas: Api<ResourceQuota> = Api::namespaced(env.host_client.clone(), HOST_NS);
    env.until("the tenant's host quota", || async {
        quotas.get_opt("stackd-tenant-quota").await.ok().flatten().is_some()
    })
    .await;
    env.create_stack("widgets", default_spec()).await;
    let stack = env.wait_ready("widgets", "False", "ControllerPodRefused").await;
    let message = condition(&stack, "Ready").expect("ready")["message"].clone();
    let message = message.as_str().unwrap_or_default();
    assert!(
        message.contains("the host refuses to create its pod: if a quota is used up")
            && message
                .contains("exceeded quota: stackd-tenant-quota, requested: pods=1, used: pods=0, limited: pods=0"),
        "{message}"
    );
    env.until("a ControllerPodRefused Event", || async {
        env.event_reasons("widgets")
            .await
            .iter()
            .any(|r| r == "ControllerPodRefused")
    })
    .await;
    // Room again: the pod is made and the Stack is ready.
    quotas
        .patch(
            "stackd-tenant-quota",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"hard": {"pods": "10"}}})),
        )
        .await
        .expect("more room");
    env.wait_ready("widgets", "True", "Available").await;
    // The ReplicaSet's later tries (other pod names) are the same refusal: told once.
    assert_eq!(env.event_count("widgets", "ControllerPodRefused").await, 1);
}
