//! StackInstall and ClusterStackInstall through the daemon binary (DESIGN.md §3.2, §3.4; issue 7).
//!
//! The host "runs" install Jobs with a scripted runner for the stackd image: it unpacks the sample
//! packages for real (`stackd::stacks::unpack`), or plays a broken package named by the image.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use sha2::{Digest, Sha256};
use stackd::api::stacks::{ClusterStackInstall, PermissionScope, Stack, StackInstall};
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use stackd::embedded::samples::repository_name;
use stackd::embedded::{ApiServer, ServerOptions};
use stackd::host::names::{NameKind, host_name, label_value};
use stackd::stacks::{crd_parent_label, stream, unpack};

use crate::harness::{Daemon, LastSeen, quiet, wait_until};

pub(crate) const STACKD_TEST_IMAGE: &str = "stackd:test";
pub(crate) const WIDGETS: &str = "widgets.samples.example.org";

/// A host, tenants with stackd's CRDs, sample packages (and broken variants) in a temp dir, and the
/// kubeconfigs a daemon reads.
pub(crate) struct StackFleet {
    /// Kept so the host server lives as long as the fleet.
    pub _host: ApiServer,
    pub host_client: Client,
    pub tenants: BTreeMap<String, (ApiServer, Client)>,
    pub dir: tempfile::TempDir,
}

impl StackFleet {
    pub(crate) async fn start(tenants: &[&str]) -> StackFleet {
        let host = ApiServer::start(ServerOptions {
            name: "host".into(),
            ..Default::default()
        })
        .await
        .expect("host");
        let dir = tempfile::tempdir().expect("temp dir");
        let packages = dir.path().join("packages");
        write_packages(&packages);
        host.runners()
            .register(ImageMatch::Exact(STACKD_TEST_IMAGE.into()), move |ctx: &JobContext| {
                unpack_runner(&packages, ctx)
            });
        std::fs::create_dir(dir.path().join("tenants")).expect("tenants dir");
        std::fs::write(dir.path().join("host.yaml"), host.kubeconfig_yaml()).expect("host kubeconfig");
        let host_client = host.client().await;
        let mut fleet = StackFleet {
            _host: host,
            host_client,
            tenants: BTreeMap::new(),
            dir,
        };
        for name in tenants {
            let server = ApiServer::start(ServerOptions {
                name: name.to_string(),
                ..Default::default()
            })
            .await
            .expect("tenant");
            let client = server.client().await;
            crate::harness::install_crds(&client).await;
            std::fs::write(
                fleet.dir.path().join("tenants").join(format!("{name}.yaml")),
                server.kubeconfig_yaml(),
            )
            .expect("tenant kubeconfig");
            fleet.tenants.insert(name.to_string(), (server, client));
        }
        fleet
    }

    pub(crate) fn daemon(&self, extra: &[&str]) -> Daemon {
        let mut args = vec![
            "--stackd-image",
            STACKD_TEST_IMAGE,
            "--allow-insecure-tenant-endpoint",
            "--sweep-interval",
            "1s",
        ];
        args.extend_from_slice(extra);
        Daemon::spawn(self.dir.path(), &args)
    }

    pub(crate) fn tenant(&self, name: &str) -> Client {
        self.tenants[name].1.clone()
    }

    pub(crate) fn host_jobs(&self, tenant: &str) -> Api<Job> {
        Api::namespaced(self.host_client.clone(), &format!("tenant-{tenant}-controllers"))
    }

    pub(crate) fn host_secrets(&self, tenant: &str) -> Api<Secret> {
        Api::namespaced(self.host_client.clone(), &format!("tenant-{tenant}-controllers"))
    }
}

/// Every object a watch of `api` has seen, each as first seen: install Jobs (and their pull-secret
/// copies) are removed once their package is applied, so a test looks at them here, from a watch
/// started before it acts, instead of reading them after the install finished.
pub(crate) struct Seen<K> {
    objects: std::sync::Arc<std::sync::Mutex<Vec<K>>>,
    _watch: tokio_util::task::AbortOnDropHandle<()>,
}

impl<K> Seen<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    pub(crate) fn start(api: Api<K>) -> Seen<K> {
        let objects = std::sync::Arc::new(std::sync::Mutex::new(Vec::<K>::new()));
        let seen = objects.clone();
        let task = tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).applied_objects().boxed();
            while let Some(event) = events.next().await {
                if let Ok(object) = event {
                    let mut seen = seen.lock().unwrap();
                    if !seen.iter().any(|o| o.uid() == object.uid()) {
                        seen.push(object);
                    }
                }
            }
        });
        Seen {
            objects,
            _watch: tokio_util::task::AbortOnDropHandle::new(task),
        }
    }

    /// Every object seen so far, each as first seen.
    pub(crate) fn all(&self) -> Vec<K> {
        self.objects.lock().unwrap().clone()
    }

    /// The first object named `name` the watch saw, waiting for it.
    pub(crate) async fn first(&self, name: &str, daemon: &Daemon) -> K {
        wait_until(
            &format!("{name} to be seen"),
            Duration::from_secs(20),
            daemon,
            || async { self.all().into_iter().find(|o| o.name_any() == name) },
        )
        .await
    }
}

/// Copies the example packages and writes the broken variants the tests install.
fn write_packages(dir: &Path) {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/packages");
    for name in ["sample-stack", "cluster-stack"] {
        copy_dir(&examples.join(name), &dir.join(name));
    }
    let sample = dir.join("sample-stack/.registry");
    let install = std::fs::read_to_string(sample.join("install.yaml")).expect("install.yaml");
    let crd = std::fs::read_to_string(sample.join("resources/widget.crd.yaml")).expect("crd");
    let variant = |name: &str, install: &str, crd: &str| {
        let root = dir.join(name).join(".registry");
        copy_dir(&sample, &root);
        std::fs::write(root.join("install.yaml"), install).expect("write install");
        std::fs::write(root.join("resources/widget.crd.yaml"), crd).expect("write crd");
    };
    let host_path = install.replace(
        "      containers:\n",
        "      volumes:\n      - name: root\n        hostPath:\n          path: /\n      containers:\n",
    );
    assert_ne!(host_path, install, "the sample install.yaml changed shape");
    variant("hostpath-stack", &host_path, &crd);
    let privileged = install.replace(
        "      - name: controller\n",
        "      - name: controller\n        securityContext:\n          privileged: true\n",
    );
    assert_ne!(privileged, install, "the sample install.yaml changed shape");
    variant("privileged-stack", &privileged, &crd);
    // The next version of the sample: its CRD also serves v1beta1.
    let next = crd.replace(
        "  versions:\n",
        "  versions:\n  - name: v1beta1\n    served: true\n    storage: false\n    schema:\n      openAPIV3Schema:\n        type: object\n        x-kubernetes-preserve-unknown-fields: true\n",
    );
    assert_ne!(next, crd, "the sample CRD changed shape");
    // ... and its controller runs with other arguments, so its Deployment rolls.
    let next_install = install.replace("--sync=1h", "--sync=30m");
    assert_ne!(next_install, install, "the sample install.yaml changed shape");
    variant("sample-stack-next", &next_install, &next);
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

/// What the stackd image "prints" in the install pod, chosen by the package image.
fn unpack_runner(packages: &Path, ctx: &JobContext) -> JobOutcome {
    // The install pod's first init container copies the binary for the package image's.
    if ctx.args.first().is_some_and(|a| a == "copy-self") {
        return JobOutcome::success("");
    }
    let package = ctx.env("STACK_IMAGE").unwrap_or_default().to_string();
    let scope = if ctx.args.iter().any(|a| a == "Cluster") {
        PermissionScope::Cluster
    } else {
        PermissionScope::Namespaced
    };
    let sample = || {
        let options = unpack::UnpackOptions {
            content_dir: packages.join("sample-stack/.registry"),
            permission_scope: PermissionScope::Namespaced,
            package_image: Some(package.clone()),
            templating_controller_image: unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
            stackd_image: ctx.image.clone(),
        };
        unpack::unpack(&options).expect("sample unpacks")
    };
    match repository_name(&package) {
        // The sample, but the install pod takes a while: room to kill the daemon mid-install.
        "slow-stack" => {
            JobOutcome::success(stream::encode(&sample()).expect("encode")).after(Duration::from_millis(1500))
        }
        "fails" => JobOutcome::failure(1, "error: /.registry/app.yaml: no such file or directory\n"),
        "truncated" => {
            let full = stream::encode(&sample()).expect("encode");
            JobOutcome::success(full[..full.len() * 2 / 3].to_string())
        }
        "two-stacks" => {
            let contents = sample();
            let stack = serde_json::to_value(&contents.stack).expect("stack");
            with_trailer(&[stack.clone(), stack])
        }
        "configmap" => with_trailer(&[json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}})]),
        // An install pod that claims Cluster scope whatever the install allowed.
        "forged-cluster" => {
            let mut contents = sample();
            contents.stack.spec.permission_scope = PermissionScope::Cluster;
            JobOutcome::success(stream::encode(&contents).expect("encode"))
        }
        name => {
            let options = unpack::UnpackOptions {
                content_dir: packages.join(name).join(".registry"),
                permission_scope: scope,
                package_image: Some(package.clone()),
                templating_controller_image: unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
                stackd_image: ctx.image.clone(),
            };
            match unpack::unpack(&options).map(|c| stream::encode(&c).expect("encode")) {
                Ok(log) => JobOutcome::success(log),
                Err(e) => JobOutcome::failure(1, format!("error: {e}\n")),
            }
        }
    }
}

/// A well-formed stream (valid trailer) of arbitrary documents.
fn with_trailer(documents: &[serde_json::Value]) -> JobOutcome {
    let body: String = documents
        .iter()
        .map(|d| format!("---\n{}", serde_saphyr::to_string(d).expect("yaml")))
        .collect();
    let digest = hex::encode(Sha256::digest(body.as_bytes()));
    JobOutcome::success(format!(
        "{body}# stackd-trailer v1 docs={} sha256={digest}\n",
        documents.len()
    ))
}

pub(crate) async fn create_namespace(client: &Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("ns");
    let _ = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await;
}

pub(crate) async fn create_install(
    client: &Client,
    namespace: &str,
    name: &str,
    spec: serde_json::Value,
) -> StackInstall {
    create_namespace(client, namespace).await;
    let install: StackInstall = serde_json::from_value(json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1",
        "kind": "StackInstall",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }))
    .expect("install");
    Api::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &install)
        .await
        .expect("create install")
}

/// The install's condition `type_` as (status, reason, message).
pub(crate) fn condition(install: &StackInstall, type_: &str) -> Option<(String, String, String)> {
    install
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Installs the sample stack as `team-a/sample` and waits until it is Ready (reason Available).
pub(crate) async fn install_sample(tenant: &Client, daemon: &Daemon) {
    create_install(
        tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(tenant, "team-a", "sample", daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
}

pub(crate) async fn wait_for_reason(
    client: &Client,
    namespace: &str,
    name: &str,
    daemon: &Daemon,
    reason: &str,
) -> (String, String, String) {
    let api: Api<StackInstall> = Api::namespaced(client.clone(), namespace);
    let last = LastSeen::new(daemon);
    let what = format!("{namespace}/{name} Ready reason {reason}");
    wait_until(&what, Duration::from_secs(20), &last, || async {
        let install = api.get_opt(name).await.ok()??;
        let ready = condition(&install, "Ready");
        last.saw(&ready);
        ready.filter(|(_, r, _)| r == reason)
    })
    .await
}

pub(crate) async fn events_of(client: &Client, namespace: &str, name: &str) -> Vec<(String, String)> {
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    let list = events.list(&ListParams::default()).await.expect("events");
    list.items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

pub(crate) async fn stacks_on(client: &Client) -> Vec<Stack> {
    Api::<Stack>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("stacks")
        .items
}

pub(crate) async fn crd_names(client: &Client) -> Vec<String> {
    Api::<CustomResourceDefinition>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("crds")
        .items
        .into_iter()
        .map(|c| c.name_any())
        .filter(|n| !n.ends_with(".stackd.dev") && !n.ends_with(".packages.crossplane.io"))
        .collect()
}

fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Established" && c.status == "True"))
}

#[tokio::test(flavor = "multi_thread")]
async fn install_runs_a_restricted_job_then_applies_crds_before_the_stack() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    // Watch from the start: the resourceVersion at which the CRD became Established must precede
    // the Stack's creation (one server, one resourceVersion sequence).
    let crd_events = watcher(
        Api::<CustomResourceDefinition>::all(tenant.clone()),
        watcher::Config::default(),
    )
    .applied_objects()
    .filter_map(|crd| async move { crd.ok().filter(|c| c.name_any() == WIDGETS && established(c)) })
    .boxed();
    let stack_events = watcher(Api::<Stack>::all(tenant.clone()), watcher::Config::default())
        .applied_objects()
        .filter_map(|stack| async move { stack.ok() })
        .boxed();
    let (seen_jobs, seen_secrets) = (
        Seen::start(fleet.host_jobs("acme")),
        Seen::start(fleet.host_secrets("acme")),
    );
    create_namespace(&tenant, "team-a").await;
    let pull: Secret = serde_json::from_value(json!({
        "metadata": {"name": "registry-credentials"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": "{\"auths\":{}}"}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), "team-a")
        .create(&PostParams::default(), &pull)
        .await
        .expect("pull secret");
    let daemon = fleet.daemon(&[]);
    let install = create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1", "source": "registry.example.com",
               "imagePullPolicy": "IfNotPresent", "imagePullSecrets": [{"name": "registry-credentials"}]}),
    )
    .await;
    let established_rv = tokio::time::timeout(Duration::from_secs(20), crd_events.into_future())
        .await
        .expect("CRD established")
        .0
        .expect("crd event")
        .resource_version()
        .expect("rv");
    let stack = tokio::time::timeout(Duration::from_secs(20), stack_events.into_future())
        .await
        .expect("Stack created")
        .0
        .expect("stack event");
    let stack_rv = stack.resource_version().expect("rv");
    assert!(
        established_rv.parse::<u64>().unwrap() < stack_rv.parse::<u64>().unwrap(),
        "the Stack (rv {stack_rv}) was created before the CRD was Established (rv {established_rv})"
    );

    // The host Job: mapped name, labels, identity, restricted, no token.
    let job = seen_jobs.first("team-a.sample-install", &daemon).await;
    let labels = job.labels();
    for (key, value) in [
        ("app.kubernetes.io/managed-by", "stackd"),
        ("stackd.dev/tenant", "acme"),
        ("stackd.dev/parent-kind", "StackInstall"),
        ("stackd.dev/parent-namespace", "team-a"),
        ("stackd.dev/parent-name", "sample"),
    ] {
        assert_eq!(labels.get(key).map(String::as_str), Some(value), "label {key}");
    }
    let annotations = job.annotations();
    assert_eq!(annotations["stackd.dev/tenant-kind"], "StackInstall");
    assert_eq!(annotations["stackd.dev/tenant-uid"], install.uid().unwrap());
    let spec = job.spec.as_ref().unwrap();
    assert_eq!(spec.backoff_limit, Some(0));
    assert!(spec.active_deadline_seconds.is_some());
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert_eq!(pod.service_account_name, None);
    let pod_security = pod.security_context.as_ref().unwrap();
    assert_eq!(pod_security.run_as_non_root, Some(true));
    assert_eq!(pod_security.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    // stackd's binary is copied first, and the package image runs it: a package image needs no `cp`.
    let inits = pod.init_containers.as_ref().unwrap();
    let (tools, init) = (&inits[0], &inits[1]);
    assert_eq!(tools.image.as_deref(), Some(STACKD_TEST_IMAGE));
    assert_eq!(tools.args.as_ref().unwrap()[..], ["copy-self", "/stackd-tools/stackd"]);
    assert_eq!(
        init.image.as_deref(),
        Some("registry.example.com/examples/sample-stack:v1")
    );
    assert_eq!(
        init.command.as_ref().unwrap()[..],
        ["/stackd-tools/stackd", "copy", "/.registry", "/ext-pkg/.registry"]
    );
    // The install asked for IfNotPresent: a tenant's image is pulled `Always` all the same, so no
    // tenant runs another's private image from the node's cache.
    assert_eq!(init.image_pull_policy.as_deref(), Some("Always"));
    let unpack = &pod.containers[0];
    assert_eq!(unpack.name, "unpack");
    assert_eq!(unpack.image.as_deref(), Some(STACKD_TEST_IMAGE));
    assert_eq!(
        unpack.args.as_ref().unwrap()[..],
        [
            "unpack",
            "--content-dir",
            "/ext-pkg/.registry",
            "--permission-scope",
            "Namespaced",
            "--stackd-image",
            STACKD_TEST_IMAGE
        ]
    );
    for container in [tools, init, unpack] {
        let security = container.security_context.as_ref().unwrap();
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(security.capabilities.as_ref().unwrap().drop.as_ref().unwrap(), &["ALL"]);
    }
    // The pull secret is copied under an unguessable name.
    let pull_refs = pod.image_pull_secrets.as_ref().unwrap();
    assert_eq!(pull_refs.len(), 1);
    assert!(
        pull_refs[0].name.starts_with("team-a.sample-pull-0-"),
        "{}",
        pull_refs[0].name
    );
    assert!(pull_refs[0].name.len() > "team-a.sample-pull-0-".len() + 8);
    let copy = seen_secrets.first(&pull_refs[0].name, &daemon).await;
    assert_eq!(copy.type_.as_deref(), Some("kubernetes.io/dockerconfigjson"));
    // Written before the Job, so unowned at first (its ownership by the Job: pod_troubles).
    assert_eq!(copy.metadata.owner_references, None);

    // The tenant: the CRD labelled for this stack, the Stack owned by the install.
    let crd = Api::<CustomResourceDefinition>::all(tenant.clone())
        .get(WIDGETS)
        .await
        .expect("crd");
    assert!(crd.labels().contains_key(&crd_parent_label("team-a", "sample")));
    let owner = &stack.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("StackInstall", install.uid().unwrap().as_str())
    );
    assert_eq!(owner.controller, Some(true));
    assert_eq!(stack.spec.permission_scope, PermissionScope::Namespaced);
    assert_eq!(stack.name_any(), "sample");

    // The install's status and Events tell the story.
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    let synced = wait_until("Synced", Duration::from_secs(10), &daemon, || {
        let installs = installs.clone();
        async move {
            installs
                .get("sample")
                .await
                .ok()
                .filter(|i| condition(i, "Synced").is_some())
        }
    })
    .await;
    let status = synced.status.as_ref().unwrap();
    assert_eq!(condition(&synced, "Synced").unwrap().1, "PackageApplied");
    assert_eq!(status.install_job.as_ref().unwrap().name, "team-a.sample-install");
    assert_eq!(
        status.install_job.as_ref().unwrap().namespace,
        "tenant-acme-controllers"
    );
    assert_eq!(status.stack_ref.as_ref().unwrap().name, "sample");
    assert!(synced.finalizers().contains(&"stacks.stackd.dev/install".to_string()));
    for reason in ["InstallJobCreated", "CRDsApplied", "StackCreated"] {
        wait_until(&format!("a {reason} Event"), Duration::from_secs(10), &daemon, || {
            let tenant = tenant.clone();
            async move {
                let events = events_of(&tenant, "team-a", "sample").await;
                events.iter().any(|(r, _)| r == reason).then_some(())
            }
        })
        .await;
    }

    // End to end: the Stack's controller runs on the host, and the install reports Ready.
    let ready = wait_until("Ready=True", Duration::from_secs(20), &daemon, || {
        let installs = installs.clone();
        async move {
            let install = installs.get("sample").await.ok()?;
            (condition(&install, "Ready")?.0 == "True").then_some(install)
        }
    })
    .await;
    assert_eq!(condition(&ready, "Ready").unwrap().1, "Available");
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    let deployment = deployments.get("team-a.sample").await.expect("host Deployment");
    assert_eq!(deployment.labels()["stackd.dev/parent-kind"], "Stack");
    let token = fleet
        .host_secrets("acme")
        .get("team-a.sample-token")
        .await
        .expect("host token Secret");
    assert_eq!(token.type_.as_deref(), Some("Opaque"));
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_stack_install_installs_a_cluster_scoped_stack() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let seen_jobs = Seen::start(fleet.host_jobs("acme"));
    let daemon = fleet.daemon(&[]);
    create_namespace(&tenant, "infra").await;
    let install: ClusterStackInstall = serde_json::from_value(json!({
        "metadata": {"name": "gadgets", "namespace": "infra"},
        "spec": {"package": "examples/cluster-stack:v1"},
    }))
    .expect("install");
    Api::<ClusterStackInstall>::namespaced(tenant.clone(), "infra")
        .create(&PostParams::default(), &install)
        .await
        .expect("create");
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "infra");
    let stack = wait_until("cluster Stack", Duration::from_secs(20), &daemon, || {
        let stacks = stacks.clone();
        async move { stacks.get_opt("gadgets").await.ok().flatten() }
    })
    .await;
    assert_eq!(stack.spec.permission_scope, PermissionScope::Cluster);
    let job = seen_jobs.first("infra.gadgets-install", &daemon).await;
    let args = job.spec.clone().unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    assert!(
        args.windows(2).any(|pair| pair == ["--permission-scope", "Cluster"]),
        "{args:?}"
    );
    assert_eq!(job.labels()["stackd.dev/parent-kind"], "ClusterStackInstall");
}

#[tokio::test(flavor = "multi_thread")]
async fn install_failures_are_clear_and_create_nothing() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let cases = [
        (
            "job-fails",
            "examples/fails:v1",
            "InstallJobFailed",
            "app.yaml: no such file",
        ),
        (
            "truncated",
            "examples/truncated:v1",
            "InvalidPackage",
            "no stackd trailer",
        ),
        ("two-stacks", "examples/two-stacks:v1", "InvalidPackage", "2 Stacks"),
        ("unexpected", "examples/configmap:v1", "InvalidPackage", "ConfigMap"),
        ("hostpath", "examples/hostpath-stack:v1", "PodSpecRefused", "hostPath"),
        (
            "privileged",
            "examples/privileged-stack:v1",
            "PodSpecRefused",
            "privileged",
        ),
        (
            "wrong-scope",
            "examples/cluster-stack:v1",
            "InstallJobFailed",
            "Cluster",
        ),
    ];
    for (name, package, _, _) in cases {
        create_install(&tenant, name, name, json!({"package": package})).await;
    }
    for (name, _, reason, fragment) in cases {
        let (status, _, message) = wait_for_reason(&tenant, name, name, &daemon, reason).await;
        assert_eq!(status, "False");
        assert!(message.contains(fragment), "{name}: {message:?} lacks {fragment:?}");
        // The Event follows the status write.
        wait_until(
            &format!("{name}: a {reason} Event"),
            Duration::from_secs(10),
            &daemon,
            || {
                let tenant = tenant.clone();
                async move {
                    let events = events_of(&tenant, name, name).await;
                    events.iter().any(|(r, _)| r == reason).then_some(())
                }
            },
        )
        .await;
    }
    assert!(stacks_on(&tenant).await.is_empty(), "a refused install created a Stack");
    assert!(crd_names(&tenant).await.is_empty(), "a refused install created a CRD");
    // A failed Job is retried with backoff: a later attempt replaces it.
    let jobs = fleet.host_jobs("acme");
    wait_until("a retried install Job", Duration::from_secs(20), &daemon, || {
        let jobs = jobs.clone();
        async move {
            let job = jobs.get_opt("job-fails.job-fails-install").await.ok()??;
            let attempt: u32 = job.annotations().get("stacks.stackd.dev/attempt")?.parse().ok()?;
            (attempt >= 2).then_some(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crds_that_would_lose_a_served_version_or_are_terminating_are_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    // An existing Widget CRD serving v1beta1 too, which the sample package does not serve.
    let mut existing: CustomResourceDefinition = serde_saphyr::from_str(
        &std::fs::read_to_string(
            fleet
                .dir
                .path()
                .join("packages/sample-stack-next/.registry/resources/widget.crd.yaml"),
        )
        .expect("crd"),
    )
    .expect("parse crd");
    // The install's own CRD, from a previous version of its package.
    existing.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    existing.metadata.labels = Some(BTreeMap::from([
        ("stacks.stackd.dev/managed".into(), "true".into()),
        (crd_parent_label("team-a", "sample"), "true".into()),
    ]));
    existing.metadata.annotations = Some(BTreeMap::from([(
        "stacks.stackd.dev/package-repository".into(),
        "examples/sample-stack".into(),
    )]));
    crds.create(&PostParams::default(), &existing)
        .await
        .expect("create crd");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "CRDConflict").await;
    assert!(message.contains("v1beta1"), "{message}");
    assert!(stacks_on(&tenant).await.is_empty());
    let unchanged = crds.get(WIDGETS).await.expect("crd");
    assert_eq!(unchanged.spec.versions.len(), 2, "the refused install changed the CRD");

    // The CRD is being deleted (held by a finalizer): the install waits and says why.
    crds.delete(WIDGETS, &DeleteParams::default())
        .await
        .expect("delete crd");
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "CRDTerminating").await;
    assert!(message.contains(WIDGETS), "{message}");
    assert!(stacks_on(&tenant).await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn long_names_hash_deterministically_and_a_strangers_object_is_never_touched() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    // A stranger's Job already sits at the name team-a's install maps to.
    create_namespace(&fleet.host_client, "tenant-acme-controllers").await;
    let foreign: Job = serde_json::from_value(json!({
        "metadata": {"name": "team-a.sample-install"},
        "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}}}
    }))
    .expect("job");
    let foreign = fleet
        .host_jobs("acme")
        .create(&PostParams::default(), &foreign)
        .await
        .expect("foreign job");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "HostObjectConflict").await;
    assert!(message.contains("team-a.sample-install"), "{message}");
    let after = fleet.host_jobs("acme").get("team-a.sample-install").await.expect("job");
    assert_eq!(after.uid(), foreign.uid(), "the stranger's Job was replaced");
    assert!(
        after.labels().is_empty() && after.annotations().is_empty(),
        "the stranger's Job was written to"
    );

    let namespace = "a-namespace-name-that-is-rather-long-x";
    let name = "and-an-install-name-that-is-long-as-well";
    assert!(namespace.len() + name.len() + 1 > 63);
    create_install(&tenant, namespace, name, json!({"package": "examples/sample-stack:v1"})).await;
    let expected = host_name(Some(namespace), name, "-install", NameKind::LabelBound);
    assert!(expected.len() <= 63);
    let jobs = fleet.host_jobs("acme");
    let job = wait_until("the hashed Job", Duration::from_secs(20), &daemon, || {
        let (jobs, expected) = (jobs.clone(), expected.clone());
        async move { jobs.get_opt(&expected).await.ok().flatten() }
    })
    .await;
    assert!(job.labels().values().all(|v| v.len() <= 63));
    assert_eq!(job.labels()["stackd.dev/parent-name"], label_value(name));
    assert_eq!(job.annotations()["stackd.dev/tenant-name"], name);
    assert_eq!(job.annotations()["stackd.dev/tenant-namespace"], namespace);
}

#[tokio::test(flavor = "multi_thread")]
async fn changing_the_package_upgrades_job_crds_and_stack() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let seen_jobs = Seen::start(fleet.host_jobs("acme"));
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("the first Stack", Duration::from_secs(20), &daemon, || {
        let stacks = stacks.clone();
        async move { stacks.get_opt("sample").await.ok().flatten() }
    })
    .await;
    let first_job = seen_jobs.first("team-a.sample-install", &daemon).await;
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    installs
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"package": "examples/sample-stack-next:v2"}})),
        )
        .await
        .expect("upgrade");
    let stack = wait_until("the upgraded Stack", Duration::from_secs(20), &daemon, || {
        let stacks = stacks.clone();
        async move {
            let stack = stacks.get_opt("sample").await.ok()??;
            (stack.annotations().get("stacks.stackd.dev/package")? == "examples/sample-stack-next:v2").then_some(stack)
        }
    })
    .await;
    assert_eq!(stack.name_any(), "sample");
    let jobs: Vec<Job> = seen_jobs.all();
    assert_eq!(jobs.len(), 2, "the install Job was not replaced: {jobs:?}");
    assert_ne!(jobs[1].uid(), first_job.uid(), "the install Job was not replaced");
    let package = jobs[1].annotations().get("stacks.stackd.dev/package").cloned();
    assert_eq!(package.as_deref(), Some("examples/sample-stack-next:v2"));
    let crd = Api::<CustomResourceDefinition>::all(tenant.clone())
        .get(WIDGETS)
        .await
        .expect("crd");
    let versions: Vec<&str> = crd.spec.versions.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(versions, ["v1beta1", "v1alpha1"], "the CRD was not updated");
    // The controller Deployment on the host rolls to the new package's spec.
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    wait_until("the Deployment rolled", Duration::from_secs(20), &daemon, || {
        let deployments = deployments.clone();
        async move {
            let deployment = deployments.get_opt("team-a.sample").await.ok()??;
            let args = deployment.spec?.template.spec?.containers.first()?.args.clone()?;
            args.contains(&"--sync=30m".to_string()).then_some(())
        }
    })
    .await;
}

/// Installs of one package share its CRD, and each adds its stack's label to it: a label wakes no
/// install or Stack but the labelled stack's (woken by every change, each of n installs and Stacks
/// would run once for every other's label, n² in all), and once their packages are applied a
/// change of the definition wakes no install (they read no CRD; their Stacks look at it).
#[tokio::test(flavor = "multi_thread")]
async fn a_change_of_a_shared_crd_wakes_only_the_installs_and_stacks_it_concerns() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let namespaces = ["team-a", "team-b", "team-c"];
    for namespace in namespaces {
        let spec = json!({"package": "examples/sample-stack:v1"});
        create_install(&tenant, namespace, "sample", spec).await;
    }
    for namespace in namespaces {
        let (status, _, message) = wait_for_reason(&tenant, namespace, "sample", &daemon, "Available").await;
        assert_eq!(status, "True", "{message}");
    }
    let controllers = [("acme", "StackInstall"), ("acme", "stack")];
    let servers = [&fleet._host, &fleet.tenants["acme"].0];
    let settle = || async { quiet(&daemon, &daemon.reconciles(&controllers), &servers).await };
    settle().await;
    let installs_before = daemon.reconciles_done("acme", "StackInstall");
    let stacks_before = daemon.reconciles_done("acme", "stack");
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let change = |patch: serde_json::Value| {
        let crds = crds.clone();
        async move {
            crds.patch(WIDGETS, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("change the CRD");
        }
    };
    // A label of no stack, as a tenant's user may add; what it wakes runs while the daemon settles.
    change(json!({"metadata": {"labels": {"example.org/owner": "platform"}}})).await;
    settle().await;
    // A new generation: the Stacks that own the CRD look at it, once each. The daemon hears of the
    // two changes in order, so once they have, it has heard of the label too.
    change(json!({"spec": {"names": {"shortNames": ["wdg"]}}})).await;
    wait_until(
        "the Stacks to look at the redefined CRD",
        Duration::from_secs(10),
        &daemon,
        || async { (daemon.reconciles_done("acme", "stack") >= stacks_before + 3).then_some(()) },
    )
    .await;
    settle().await;
    assert_eq!(
        daemon.reconciles_done("acme", "stack") - stacks_before,
        3,
        "Stack reconciles after the label and the new generation"
    );
    assert_eq!(
        daemon.reconciles_done("acme", "StackInstall") - installs_before,
        0,
        "install reconciles after the label and the new generation"
    );
}

/// Installs of one package made at once each add their stack's label to the one CRD they share:
/// none fails on another's write (a replace of the version cached would conflict, and the install
/// back off for a second or more at the default backoff), and the CRD carries every label.
#[tokio::test(flavor = "multi_thread")]
async fn installs_of_one_package_made_at_once_label_their_shared_crd_without_a_conflict() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let namespaces: Vec<String> = (0..8).map(|i| format!("team-{i}")).collect();
    futures::future::join_all(namespaces.iter().map(|namespace| {
        let spec = json!({"package": "examples/sample-stack:v1"});
        create_install(&tenant, namespace, "sample", spec)
    }))
    .await;
    for namespace in &namespaces {
        let (status, _, message) = wait_for_reason(&tenant, namespace, "sample", &daemon, "Available").await;
        assert_eq!(status, "True", "{message}");
    }
    let crd = Api::<CustomResourceDefinition>::all(tenant.clone())
        .get(WIDGETS)
        .await
        .expect("the shared CRD");
    for namespace in &namespaces {
        assert!(
            crd.labels().contains_key(&crd_parent_label(namespace, "sample")),
            "{namespace}'s label: {:?}",
            crd.labels()
        );
    }
    let errors = daemon.controller_metric("stackd_reconcile_errors_total", "acme", "StackInstall");
    assert_eq!(
        errors,
        0,
        "failed install reconciles; daemon log:\n{}",
        daemon.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn uninstall_removes_host_and_tenant_objects_and_shared_crds_go_with_the_last_install() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    for namespace in ["team-a", "team-b"] {
        create_install(
            &tenant,
            namespace,
            "sample",
            json!({"package": "examples/sample-stack:v1"}),
        )
        .await;
    }
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    wait_until("both stacks use the CRD", Duration::from_secs(20), &daemon, || {
        let crds = crds.clone();
        async move {
            let crd = crds.get_opt(WIDGETS).await.ok()??;
            let labels = crd.labels();
            (labels.contains_key(&crd_parent_label("team-a", "sample"))
                && labels.contains_key(&crd_parent_label("team-b", "sample")))
            .then_some(())
        }
    })
    .await;
    let uninstall = |namespace: &'static str| {
        let tenant = tenant.clone();
        async move {
            Api::<StackInstall>::namespaced(tenant, namespace)
                .delete("sample", &DeleteParams::default())
                .await
                .expect("delete install");
        }
    };
    uninstall("team-a").await;
    let installs_a: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("team-a's install gone", Duration::from_secs(20), &daemon, || {
        let installs = installs_a.clone();
        async move { installs.get_opt("sample").await.ok()?.is_none().then_some(()) }
    })
    .await;
    assert!(
        crds.get_opt(WIDGETS).await.expect("get").is_some(),
        "a CRD team-b uses was deleted"
    );
    assert!(
        Api::<Stack>::namespaced(tenant.clone(), "team-a")
            .get_opt("sample")
            .await
            .expect("get")
            .is_none()
    );
    let selector = "stackd.dev/parent-namespace=team-a";
    let jobs = fleet.host_jobs("acme");
    wait_until("team-a's host objects gone", Duration::from_secs(10), &daemon, || {
        let (jobs, secrets) = (jobs.clone(), fleet.host_secrets("acme"));
        async move {
            let params = ListParams::default().labels(selector);
            let left = jobs.list(&params).await.ok()?.items.len() + secrets.list(&params).await.ok()?.items.len();
            (left == 0).then_some(())
        }
    })
    .await;

    uninstall("team-b").await;
    wait_until(
        "the CRD deleted with the last install",
        Duration::from_secs(20),
        &daemon,
        || {
            let crds = crds.clone();
            async move { crds.get_opt(WIDGETS).await.ok()?.is_none().then_some(()) }
        },
    )
    .await;
    let params = ListParams::default().labels("stackd.dev/parent-kind");
    wait_until(
        "no host object with a parent label",
        Duration::from_secs(10),
        &daemon,
        || {
            let (jobs, secrets) = (jobs.clone(), fleet.host_secrets("acme"));
            let params = params.clone();
            async move {
                let left = jobs.list(&params).await.ok()?.items.len() + secrets.list(&params).await.ok()?.items.len();
                (left == 0).then_some(())
            }
        },
    )
    .await;
}

/// Installs of one package uninstalled at once: whichever goes last deletes the CRD they shared,
/// though each may judge it while its cache still shows another's label.
#[tokio::test(flavor = "multi_thread")]
async fn installs_of_one_package_uninstalled_at_once_leave_no_crd_behind() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let namespaces: Vec<String> = (0..6).map(|i| format!("team-{i}")).collect();
    for namespace in &namespaces {
        let spec = json!({"package": "examples/sample-stack:v1"});
        create_install(&tenant, namespace, "sample", spec).await;
    }
    for namespace in &namespaces {
        let (status, _, message) = wait_for_reason(&tenant, namespace, "sample", &daemon, "Available").await;
        assert_eq!(status, "True", "{message}");
    }
    futures::future::join_all(namespaces.iter().map(|namespace| {
        let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
        async move {
            installs
                .delete("sample", &DeleteParams::default())
                .await
                .expect("delete install");
        }
    }))
    .await;
    for namespace in &namespaces {
        let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
        wait_until("the install gone", Duration::from_secs(20), &daemon, || {
            let installs = installs.clone();
            async move { installs.get_opt("sample").await.ok()?.is_none().then_some(()) }
        })
        .await;
    }
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let left = crds.get_opt(WIDGETS).await.expect("get the CRD");
    assert!(
        left.is_none(),
        "the CRD outlived every install of its package: labels {:?}",
        left.map(|crd| crd.labels().clone())
    );
    let events = futures::future::join_all(
        namespaces
            .iter()
            .map(|namespace| events_of(&tenant, namespace, "sample")),
    )
    .await;
    let deleted = events
        .iter()
        .flatten()
        .filter(|(reason, _)| reason == "CRDsDeleted")
        .count();
    assert_eq!(deleted, 1, "Events of the installs: {events:?}");
}

/// Writes (not reads or watches) a server saw.
pub(crate) fn writes(counts: &stackd::embedded::counters::RequestCounts) -> Vec<String> {
    use stackd::embedded::Verb;
    counts
        .counts
        .iter()
        .filter(|(key, n)| {
            **n > 0
                && matches!(
                    key.verb,
                    Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection
                )
        })
        .map(|(key, n)| format!("{} {} in {:?} x{n}", key.verb.as_str(), key.resource, key.namespace))
        .collect()
}

async fn objects_of_kind(fleet: &StackFleet, kind: &str) -> (Vec<Job>, Vec<Secret>) {
    let params = ListParams::default().labels(&format!("stackd.dev/parent-kind={kind}"));
    let jobs = fleet.host_jobs("acme").list(&params).await.expect("jobs").items;
    let secrets = fleet.host_secrets("acme").list(&params).await.expect("secrets").items;
    (jobs, secrets)
}

pub(crate) async fn pull_secret(tenant: &Client, namespace: &str) {
    create_namespace(tenant, namespace).await;
    let pull: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": "{\"auths\":{}}"}
    }))
    .expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &pull)
        .await
        .expect("pull secret");
}

pub(crate) async fn wait_synced(tenant: &Client, namespace: &str, daemon: &Daemon) -> StackInstall {
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
    wait_until("Synced=True", Duration::from_secs(20), daemon, || {
        let installs = installs.clone();
        async move {
            let install = installs.get("sample").await.ok()?;
            (condition(&install, "Synced")?.0 == "True").then_some(install)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_killed_mid_install_converges_without_duplicates() {
    // Killed after the Job is created, after the CRDs, and after the token copy (DESIGN.md §3, issue 7).
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    pull_secret(&tenant, "team-a").await;
    let (seen_jobs, seen_secrets) = (
        Seen::start(fleet.host_jobs("acme")),
        Seen::start(fleet.host_secrets("acme")),
    );
    let first = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/slow-stack:v1", "imagePullSecrets": [{"name": "creds"}]}),
    )
    .await;
    // Killed while its Job runs.
    let jobs = fleet.host_jobs("acme");
    let job = wait_until("the install Job", Duration::from_secs(20), &first, || {
        let jobs = jobs.clone();
        async move { jobs.get_opt("team-a.sample-install").await.ok().flatten() }
    })
    .await;
    drop(first);
    let second = fleet.daemon(&[]);
    // Killed right after the CRDs appear.
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    wait_until("the CRD", Duration::from_secs(20), &second, || {
        let crds = crds.clone();
        async move { crds.get_opt(WIDGETS).await.ok().flatten() }
    })
    .await;
    drop(second);
    // Killed right after the stack's token is copied to the host.
    let third = fleet.daemon(&[]);
    let host_secrets = fleet.host_secrets("acme");
    wait_until("the host token copy", Duration::from_secs(20), &third, || {
        let host_secrets = host_secrets.clone();
        async move { host_secrets.get_opt("team-a.sample-token").await.ok().flatten() }
    })
    .await;
    drop(third);
    let fourth = fleet.daemon(&[]);
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("Ready=True", Duration::from_secs(20), &fourth, || {
        let installs = installs.clone();
        async move {
            let install = installs.get("sample").await.ok()?;
            (condition(&install, "Ready")?.0 == "True").then_some(())
        }
    })
    .await;
    let (stack_jobs, stack_secrets) = objects_of_kind(&fleet, "Stack").await;
    assert!(stack_jobs.is_empty(), "a Stack owns no Jobs");
    // The token copy and the controller's pull-secret copy, once each.
    assert_eq!(
        stack_secrets.len(),
        2,
        "duplicate host token or pull-secret copies: {:?}",
        stack_secrets.iter().map(|s| s.name_any()).collect::<Vec<_>>()
    );
    let host_deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    let params = ListParams::default().labels("stackd.dev/parent-kind=Stack");
    assert_eq!(
        host_deployments.list(&params).await.expect("list").items.len(),
        1,
        "duplicate Deployments"
    );
    // Every install Job and pull-secret copy there ever was (they go once the package is applied).
    let jobs = seen_jobs.all();
    assert_eq!(jobs.len(), 1, "duplicate Jobs: {jobs:?}");
    assert_eq!(
        jobs[0].uid(),
        job.uid(),
        "the running Job was replaced instead of awaited"
    );
    let copies: Vec<String> = seen_secrets
        .all()
        .iter()
        .filter(|s| s.labels().get("stackd.dev/parent-kind").map(String::as_str) == Some("StackInstall"))
        .map(|s| s.name_any())
        .collect();
    assert_eq!(copies.len(), 1, "duplicate pull-secret copies: {copies:?}");
    assert_eq!(stacks_on(&tenant).await.len(), 1);
}

/// The install creates its Stack with the Stack controller's finalizer, so nobody patches the
/// Stack's metadata on the way to Ready (issue 20: one request fewer per install).
#[tokio::test(flavor = "multi_thread")]
async fn an_installs_stack_is_born_with_its_finalizer_and_its_metadata_is_never_patched() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    let before = fleet.tenants["acme"].0.counters();
    install_sample(&tenant, &daemon).await;
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("the Stack");
    assert_eq!(stack.finalizers(), [stackd::stacks::STACK_FINALIZER]);
    let stack_patches: Vec<String> = writes(&fleet.tenants["acme"].0.counters().since(&before))
        .into_iter()
        .filter(|write| write.starts_with("patch stacks.stacks.stackd.dev in"))
        .collect();
    assert!(stack_patches.is_empty(), "Stack metadata patches: {stack_patches:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_reconcile_of_an_unchanged_install_writes_nothing() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    // Synced comes as soon as the Stack is applied; the Stack's own writes go on until it is
    // available, which the install's Ready reports.
    install_sample(&tenant, &daemon).await;
    // The install's Available Event is the last write of the reconcile that reported it; the
    // Stack's own Available Event (the same name) may come before or after it.
    wait_until("the Available Events", Duration::from_secs(10), &daemon, || async {
        let events: Api<Event> = Api::namespaced(tenant.clone(), "team-a");
        let events = events.list(&ListParams::default()).await.ok()?.items;
        let available = |kind: &str| {
            events.iter().any(|e| {
                e.reason.as_deref() == Some("Available")
                    && e.involved_object.kind.as_deref() == Some(kind)
                    && e.involved_object.name.as_deref() == Some("sample")
            })
        };
        (available("StackInstall") && available("Stack")).then_some(())
    })
    .await;
    let (host_before, tenant_before) = (fleet._host.counters(), fleet.tenants["acme"].0.counters());
    let reconciled = daemon.reconciles_done("acme", "StackInstall");
    // A label on the install is an event (a reconcile) that changes nothing stackd cares about.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .expect("label");
    // Judged once the reconcile the label caused has finished, not after a guessed pause.
    wait_until("the label's reconcile", Duration::from_secs(10), &daemon, || async {
        (daemon.reconciles_done("acme", "StackInstall") > reconciled).then_some(())
    })
    .await;
    let host_writes = writes(&fleet._host.counters().since(&host_before));
    let tenant_writes = writes(&fleet.tenants["acme"].0.counters().since(&tenant_before));
    assert!(
        host_writes.is_empty(),
        "host writes: {host_writes:?}\n{}",
        daemon.log_text()
    );
    assert_eq!(
        tenant_writes,
        ["patch stackinstalls.stacks.stackd.dev in \"team-a\" x1"],
        "tenant writes besides the test's own"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_uninstall_waits_out_an_unreachable_tenant_and_then_completes() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    // Ready: the Stack's controller and token copy are on the host (the install Job may be gone).
    wait_for_reason(&tenant, "team-a", "sample", &daemon, "Available").await;
    drop(daemon);
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    installs
        .delete("sample", &DeleteParams::default())
        .await
        .expect("delete");
    let server = &fleet.tenants["acme"].0;
    server
        .faults()
        .fail_next(1_000_000, stackd::embedded::faults::RequestMatch::any(), 503);
    let daemon = fleet.daemon(&[]);
    // The daemon has met the 503s: it reports the tenant down.
    daemon
        .wait_for(
            "/metrics",
            "stackd_tenant_down_cause{tenant=\"acme\",cause=\"server_busy\"} 1",
            Duration::from_secs(10),
        )
        .await;
    let (_, stack_secrets) = objects_of_kind(&fleet, "Stack").await;
    assert_eq!(
        stack_secrets.len(),
        1,
        "host objects were deleted while the tenant could not be read"
    );
    server.faults().clear();
    wait_until("the install gone", Duration::from_secs(30), &daemon, || {
        let installs = installs.clone();
        async move { installs.get_opt("sample").await.ok()?.is_none().then_some(()) }
    })
    .await;
    let (jobs, secrets) = objects_of_kind(&fleet, "StackInstall").await;
    assert!(jobs.is_empty() && secrets.is_empty());
    wait_until(
        "the Stack's host objects gone",
        Duration::from_secs(10),
        &daemon,
        || async { objects_of_kind(&fleet, "Stack").await.1.is_empty().then_some(()) },
    )
    .await;
    // The CRD is deleted with the install; its removal (custom-resource cleanup) may finish after.
    let crds = Api::<CustomResourceDefinition>::all(tenant.clone());
    wait_until("the package's CRD gone", Duration::from_secs(10), &daemon, || {
        let crds = crds.clone();
        async move { crds.get_opt(WIDGETS).await.ok()?.is_none().then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_removes_host_objects_of_an_install_deleted_while_the_daemon_was_down() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    pull_secret(&tenant, "team-a").await;
    let daemon = fleet.daemon(&[]);
    // Unpacked slowly: the daemon stops while the install Job and its pull-secret copy exist (a
    // completed Job goes once its package is applied).
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/slow-stack:v1", "imagePullSecrets": [{"name": "creds"}]}),
    )
    .await;
    wait_until(
        "the install Job and its pull-secret copy",
        Duration::from_secs(20),
        &daemon,
        || async {
            let (jobs, secrets) = objects_of_kind(&fleet, "StackInstall").await;
            (jobs.len() == 1 && secrets.len() == 1).then_some(())
        },
    )
    .await;
    drop(daemon);
    // The install vanishes without stackd's help (its finalizer stripped by hand).
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    installs
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("strip finalizer");
    installs
        .delete("sample", &DeleteParams::default())
        .await
        .expect("delete");
    let (jobs, secrets) = objects_of_kind(&fleet, "StackInstall").await;
    assert_eq!((jobs.len(), secrets.len()), (1, 1));
    let daemon = fleet.daemon(&[]);
    wait_until("the sweep", Duration::from_secs(20), &daemon, || async {
        let (jobs, secrets) = objects_of_kind(&fleet, "StackInstall").await;
        (jobs.is_empty() && secrets.is_empty()).then_some(())
    })
    .await;
}

/// One StackInstall the daemon cannot read (a field of the wrong type, written while the CRD took
/// anything) is logged and passed over; the tenant's other installs go on (issue 18).
#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_install_does_not_stop_a_valid_one() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    accept_anything_as_stack_installs(&tenant).await;
    create_namespace(&tenant, "team-a").await;
    let malformed = kube::api::DynamicObject::new("broken", &stackinstall_resource())
        .within("team-a")
        .data(json!({"spec": {"package": 42, "imagePullSecrets": "not-a-list"}}));
    Api::<kube::api::DynamicObject>::namespaced_with(tenant.clone(), "team-a", &stackinstall_resource())
        .create(&PostParams::default(), &malformed)
        .await
        .expect("the malformed install is stored");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample-stack",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let ready = wait_for_reason(&tenant, "team-a", "sample-stack", &daemon, "Available").await;
    assert_eq!(ready.0, "True");
    assert!(
        daemon.log_text().contains("does not match its schema"),
        "the malformed install is reported in the log"
    );
    wait_until(
        "a Warning Event on the malformed install",
        Duration::from_secs(10),
        &daemon,
        || {
            let tenant = tenant.clone();
            async move {
                let events = events_of(&tenant, "team-a", "broken").await;
                events.iter().any(|(reason, _)| reason == "InvalidObject").then_some(())
            }
        },
    )
    .await;
}

fn stackinstall_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::erase::<StackInstall>(&())
}

/// Replaces the StackInstall CRD's schema by one that takes any object, so that a malformed
/// install can be stored (a real server would have one from before a schema change).
async fn accept_anything_as_stack_installs(tenant: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let mut crd = crds
        .get("stackinstalls.stacks.stackd.dev")
        .await
        .expect("StackInstall CRD");
    for version in &mut crd.spec.versions {
        version.schema = Some(
            serde_json::from_value(json!({
                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
            }))
            .expect("schema"),
        );
    }
    crds.replace(&crd.name_any(), &PostParams::default(), &crd)
        .await
        .expect("a schema that takes anything");
}
