//! Crossplane v0.x packages as their authors published them (issue 46, DESIGN.md §10): v1beta1 CRDs in
//! both layouts, `dependsOn` on the platform's claim groups, Crossplane's pod label, controller
//! images without `USER`, UI metadata, templating stacks (behavior.yaml), and refusals that are
//! seen. The packages are written here in the shapes the real ones have; the install Job runs
//! `stackd unpack` on them for real.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::stacks::{Stack, StackDefinition, StackInstall};
use stackd::embedded::controller_manager::ImageMatch;
use stackd::runtime::events::MAX_NOTE_BYTES;
use stackd::stacks::NON_ROOT_ID;

use crate::harness::{Daemon, wait_until};
use crate::stacks_install::{STACKD_TEST_IMAGE, StackFleet, condition, create_install, events_of, wait_for_reason};

const TENANT: &str = "acme";
const HOST_NS: &str = "tenant-acme-controllers";
const SOON: Duration = Duration::from_secs(20);

/// A v1beta1 CRD as kubebuilder v2 wrote them for Crossplane v0.x: top-level version, validation,
/// subresources and printer columns with `JSONPath`, an empty scope, a `status` block, and a
/// schema whose objects name no `type`.
fn v1beta1_crd(group: &str, kind: &str, plural: &str) -> String {
    format!(
        "
---
apiVersion: apiextensions.k8s.io/v1beta1
kind: CustomResourceDefinition
metadata:
  creationTimestamp: null
  name: {plural}.{group}
spec:
  additionalPrinterColumns:
  - JSONPath: .status.bindingPhase
    name: STATUS
    type: string
  - JSONPath: .metadata.creationTimestamp
    name: AGE
    type: date
  group: {group}
  names:
    kind: {kind}
    listKind: {kind}List
    plural: {plural}
    singular: {}
  scope: ''
  subresources:
    status: {{}}
  validation:
    openAPIV3Schema:
      description: A {kind} is a managed resource.
      properties:
        apiVersion:
          type: string
        spec:
          properties:
            tier:
              type: string
            labels:
              additionalProperties:
                type: string
          required:
          - tier
  version: v1alpha1
  versions:
  - name: v1alpha1
    served: true
    storage: true
status:
  acceptedNames:
    kind: ''
    plural: ''
  conditions: []
  storedVersions: []
",
        kind.to_lowercase()
    )
}

fn write(root: &Path, files: &[(&str, &str)]) {
    for (path, text) in files {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }
}

/// A provider package: CRDs in `resources/<group>/<plural>.crd.yaml` and `resources/<file>.crd.yaml`,
/// a dependency on the types chart's claim groups, Crossplane's label in the template and the
/// selector, no image (the package image runs), and UI metadata.
pub(crate) fn write_provider(fleet: &StackFleet) {
    let root = fleet.dir.path().join("packages/xp-provider/.registry");
    write(
        &root,
        &[
            (
                "app.yaml",
                "title: Example provider\nversion: 0.1.0\npermissionScope: Namespaced\ndependsOn:\n- crd: '*.database.crossplane.io/v1alpha1'\n- crd: '*.core.crossplane.io/v1alpha1'\n",
            ),
            (
                "install.yaml",
                "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: provider-example\n  labels:\n    core.crossplane.io/name: \"provider-example\"\nspec:\n  selector:\n    matchLabels:\n      core.crossplane.io/name: \"provider-example\"\n  replicas: 1\n  template:\n    metadata:\n      name: \"provider-example-controller\"\n      labels:\n        core.crossplane.io/name: \"provider-example\"\n    spec:\n      containers:\n      - name: \"provider-example-controller\"\n        args: [\"--debug\"]\n",
            ),
            (
                "resources/database.example.org/cloudsqlinstances.crd.yaml",
                &v1beta1_crd("database.example.org", "CloudSQLInstance", "cloudsqlinstances"),
            ),
            (
                "resources/database.example.org/cloudsqlinstance.resource.yaml",
                "id: cloudsqlinstance\ntitle: CloudSQL Instance\ntitlePlural: CloudSQL Instances\ncategory: Database\n",
            ),
            (
                "resources/database.example.org/cloudsqlinstance.ui-schema.yaml",
                "version: 0.4\nconfigSections: []\n",
            ),
            (
                "resources/buckets.crd.yaml",
                &v1beta1_crd("storage.example.org", "Bucket", "buckets"),
            ),
            ("icon.svg", "<svg/>"),
        ],
    );
}

/// The claim kinds Crossplane's types chart puts into every tenant: not a stack's.
pub(crate) async fn install_platform_types(tenant: &Client) {
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "mysqlinstances.database.crossplane.io"},
        "spec": {"group": "database.crossplane.io", "scope": "Namespaced",
            "names": {"kind": "MySQLInstance", "plural": "mysqlinstances"},
            "versions": [{"name": "v1alpha1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]},
    }))
    .expect("crd");
    Api::<CustomResourceDefinition>::all(tenant.clone())
        .create(&PostParams::default(), &crd)
        .await
        .expect("types chart CRD");
}

async fn host_deployment(fleet: &StackFleet, name: &str, daemon: &Daemon) -> Deployment {
    let deployments: Api<Deployment> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    wait_until("the host Deployment", SOON, daemon, || {
        let deployments = deployments.clone();
        async move { deployments.get_opt(name).await.ok().flatten() }
    })
    .await
}

async fn system_role(tenant: &Client, namespace: &str, stack: &str) -> ClusterRole {
    Api::<ClusterRole>::all(tenant.clone())
        .get(&format!("stackd:{namespace}:{stack}:system"))
        .await
        .expect("system role")
}

/// Uninstalls `namespace/name` and waits until nothing of it is left: the install, the package's
/// CRDs and every host object with a parent label.
async fn uninstall_leaves_nothing(fleet: &StackFleet, namespace: &str, name: &str, crds: &[&str], daemon: &Daemon) {
    let tenant = fleet.tenant(TENANT);
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
    installs
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete install");
    let definitions: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let host = fleet.host_client.clone();
    wait_until("the install, its CRDs and its host objects gone", SOON, daemon, || {
        let (installs, definitions, host) = (installs.clone(), definitions.clone(), host.clone());
        async move {
            installs.get_opt(name).await.ok()?.is_none().then_some(())?;
            for crd in crds {
                definitions.get_opt(crd).await.ok()?.is_none().then_some(())?;
            }
            let params = ListParams::default().labels("stackd.dev/parent-kind");
            let deployments = Api::<Deployment>::namespaced(host.clone(), HOST_NS)
                .list(&params)
                .await
                .ok()?;
            let jobs = Api::<k8s_openapi::api::batch::v1::Job>::namespaced(host.clone(), HOST_NS)
                .list(&params)
                .await
                .ok()?;
            let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(host, HOST_NS)
                .list(&params)
                .await
                .ok()?;
            (deployments.items.is_empty() && jobs.items.is_empty() && secrets.items.is_empty()).then_some(())
        }
    })
    .await;
}

/// Installs `package` as `team-a/name` on a tenant with the types chart's CRDs, the image
/// `image_without_user` built without USER (under runAsNonRoot the kubelet refuses it unless the pod
/// names a non-root user), and waits until the install is Ready.
async fn install_until_available(
    fleet: &StackFleet,
    image_without_user: &str,
    name: &str,
    package: &str,
) -> (Client, Daemon) {
    fleet
        ._host
        .runners()
        .without_user(ImageMatch::Prefix(image_without_user.into()));
    let tenant = fleet.tenant(TENANT);
    install_platform_types(&tenant).await;
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, "team-a", name, json!({ "package": package })).await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", name, &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
    (tenant, daemon)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crossplane_provider_package_installs_as_published_and_uninstalls_cleanly() {
    let fleet = StackFleet::start(&[TENANT]).await;
    write_provider(&fleet);
    let (tenant, daemon) =
        install_until_available(&fleet, "examples/xp-provider", "provider", "examples/xp-provider:v1").await;

    // The v1beta1 CRDs of both layouts are served as v1, as the API server itself converted them.
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let sql = crds
        .get("cloudsqlinstances.database.example.org")
        .await
        .expect("converted CRD");
    assert_eq!(sql.spec.scope, "Namespaced");
    let version = &sql.spec.versions[0];
    let columns = version.additional_printer_columns.clone().expect("columns");
    assert_eq!(columns[0].json_path, ".status.bindingPhase");
    let schema = serde_json::to_value(&version.schema).expect("schema");
    assert_eq!(schema["openAPIV3Schema"]["properties"]["spec"]["type"], "object");
    assert_eq!(schema["openAPIV3Schema"]["x-kubernetes-preserve-unknown-fields"], true);
    let annotations = sql.annotations();
    assert_eq!(
        annotations["stacks.stackd.dev/converted-from-v1beta1"],
        "resources/database.example.org/cloudsqlinstances.crd.yaml"
    );
    assert_eq!(annotations["stacks.crossplane.io/resource-title"], "CloudSQL Instance");
    assert_eq!(
        annotations["stacks.crossplane.io/ui-schema"],
        "version: 0.4\nconfigSections: []"
    );
    assert_eq!(
        annotations["stacks.crossplane.io/icon-data-uri"],
        "data:image/svg+xml;base64,PHN2Zy8+"
    );
    assert_eq!(annotations["stacks.crossplane.io/stack-title"], "Example provider");
    assert!(
        crds.get_opt("buckets.storage.example.org")
            .await
            .expect("get")
            .is_some()
    );
    let events = events_of(&tenant, "team-a", "provider").await;
    let applied = events
        .iter()
        .find(|(reason, _)| reason == "CRDsApplied")
        .map(|(_, note)| note.clone())
        .expect("a CRDsApplied Event");
    assert!(
        applied.contains(
            "converted from apiextensions.k8s.io/v1beta1 to v1: resources/buckets.crd.yaml, resources/database.example.org/cloudsqlinstances.crd.yaml"
        ),
        "{applied}"
    );

    // The dependency on the types chart's groups is granted, for the groups named only.
    let role = system_role(&tenant, "team-a", "provider").await;
    let groups: Vec<String> = role
        .rules
        .unwrap_or_default()
        .into_iter()
        .flat_map(|rule| rule.api_groups.unwrap_or_default())
        .collect();
    for group in [
        "database.crossplane.io",
        "core.crossplane.io",
        "database.example.org",
        "storage.example.org",
    ] {
        assert!(groups.iter().any(|g| g == group), "{group} missing from {groups:?}");
    }
    assert!(!groups.iter().any(|g| g == "compute.crossplane.io"), "{groups:?}");

    // The pod keeps Crossplane's label and runs as a non-root user the image does not name.
    let deployment = host_deployment(&fleet, "team-a.provider", &daemon).await;
    let template = deployment.spec.expect("spec").template;
    let labels = template.metadata.and_then(|m| m.labels).expect("labels");
    assert_eq!(labels["core.crossplane.io/name"], "provider-example");
    let security = template
        .spec
        .and_then(|p| p.security_context)
        .expect("security context");
    assert_eq!(security.run_as_user, Some(NON_ROOT_ID));
    assert_eq!(security.run_as_group, Some(NON_ROOT_ID));

    uninstall_leaves_nothing(
        &fleet,
        "team-a",
        "provider",
        &["cloudsqlinstances.database.example.org", "buckets.storage.example.org"],
        &daemon,
    )
    .await;
    assert!(
        crds.get_opt("mysqlinstances.database.crossplane.io")
            .await
            .expect("get")
            .is_some(),
        "the platform's CRD is not the stack's to delete"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dependency_the_host_does_not_list_is_refused_once_with_the_fix() {
    let fleet = StackFleet::start(&[TENANT]).await;
    write_provider(&fleet);
    let tenant = fleet.tenant(TENANT);
    install_platform_types(&tenant).await;
    // The host's operators allow no platform group: a tenant user cannot change that.
    let daemon = fleet.daemon(&["--platform-dependency-groups="]);
    create_install(
        &tenant,
        "team-a",
        "provider",
        json!({"package": "examples/xp-provider:v1"}),
    )
    .await;
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    let message = wait_until("the Stack refused", SOON, &daemon, || {
        let stacks = stacks.clone();
        async move {
            let stack = stacks.get_opt("provider").await.ok()??;
            let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
            (ready.reason == "PermissionsRefused").then_some(ready.message)
        }
    })
    .await;
    for group in ["database.crossplane.io", "core.crossplane.io"] {
        assert_eq!(message.matches(&format!("{group:?}")).count(), 1, "{message}");
    }
    assert!(message.contains("--platform-dependency-groups"), "{message}");
    let roles: Api<ClusterRole> = Api::all(tenant.clone());
    assert!(
        roles
            .get_opt("stackd:team-a:provider:system")
            .await
            .expect("get")
            .is_none(),
        "nothing is granted before the permissions are accepted"
    );
}

/// A kustomize templating stack as stack-gcp-sample published it: behavior.yaml names the kind to
/// reconcile and the templating controller; the CRD (`resources/<group>_<plural>.crd.yaml`) keeps
/// unknown fields and has no schema.
pub(crate) fn write_templating_stack(fleet: &StackFleet) {
    let root = fleet.dir.path().join("packages/xp-sample/.registry");
    write(
        &root,
        &[
            (
                "app.yaml",
                "title: Sample stack\npermissionScope: Namespaced\ndependsOn:\n- crd: '*.database.crossplane.io/v1alpha1'\n",
            ),
            (
                "behavior.yaml",
                "source:\n  path: \"kustomize\"\ncrd:\n  kind: GCPSample\n  apiVersion: gcp.stacks.example.org/v1alpha1\nengine:\n  type: kustomize\n  controllerImage: crossplane/templating-controller:v0.4.0\n  kustomize:\n    overlays:\n    - apiVersion: database.crossplane.io/v1alpha1\n      kind: MySQLInstance\n      name: db\n      bindings:\n      - from: spec.region\n        to: spec.region\n",
            ),
            (
                "resources/gcp.stacks.example.org_gcpsamples.crd.yaml",
                "apiVersion: apiextensions.k8s.io/v1beta1\nkind: CustomResourceDefinition\nmetadata:\n  name: gcpsamples.gcp.stacks.example.org\nspec:\n  group: gcp.stacks.example.org\n  names:\n    kind: GCPSample\n    plural: gcpsamples\n  scope: Namespaced\n  preserveUnknownFields: true\n  version: v1alpha1\n",
            ),
        ],
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_templating_stack_runs_the_templating_controller_with_its_stack_definition() {
    let fleet = StackFleet::start(&[TENANT]).await;
    write_templating_stack(&fleet);
    // The templating controller v0.2 was built without USER.
    let (tenant, daemon) = install_until_available(
        &fleet,
        "crossplane/templating-controller",
        "sample",
        "examples/xp-sample:v2",
    )
    .await;

    // The controller finds its behavior where Crossplane put it: a StackDefinition of the Stack's.
    let definition = Api::<StackDefinition>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("StackDefinition");
    let behavior = &definition.spec.behavior;
    assert_eq!(behavior.crd.kind, "GCPSample");
    assert_eq!(behavior.engine.type_, "kustomize");
    assert_eq!(
        behavior.engine.kustomize.as_ref().expect("kustomize")["overlays"][0]["kind"],
        "MySQLInstance"
    );
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("stack");
    assert_eq!(definition.owner_references()[0].uid, stack.uid().expect("uid"));

    // It may read that StackDefinition and no other, reconcile its kind and render what it depends on.
    let rules = system_role(&tenant, "team-a", "sample").await.rules.unwrap_or_default();
    let read_own = rules
        .iter()
        .find(|rule| rule.resources.as_deref() == Some(&["stackdefinitions".to_string()][..]))
        .expect("the StackDefinition rule");
    assert_eq!(read_own.resource_names.as_deref(), Some(&["sample".to_string()][..]));
    assert_eq!(read_own.verbs, ["get", "list", "watch"]);
    for group in ["gcp.stacks.example.org", "database.crossplane.io"] {
        assert!(
            rules
                .iter()
                .any(|rule| rule.api_groups.as_deref() == Some(&[group.to_string()][..])),
            "{group}: {rules:?}"
        );
    }

    // On the host: the package image copies the resources, the behavior's controller reads them.
    let deployment = host_deployment(&fleet, "team-a.sample", &daemon).await;
    let pod = deployment.spec.expect("spec").template.spec.expect("pod");
    // stackd's image copies its binary first: the package image may have no `cp`.
    let inits = pod.init_containers.as_ref().expect("init containers");
    assert_eq!(inits[0].image.as_deref(), Some(STACKD_TEST_IMAGE), "{inits:?}");
    assert_eq!(
        inits[0].args.as_deref(),
        Some(&["copy-self", "/stackd-tools/stackd"].map(String::from)[..])
    );
    let init = &inits[1];
    assert!(
        init.image
            .as_deref()
            .is_some_and(|i| i.ends_with("examples/xp-sample:v2")),
        "{init:?}"
    );
    assert_eq!(
        init.command.as_deref(),
        Some(&["/stackd-tools/stackd", "copy", "kustomize", "/behaviors"].map(String::from)[..])
    );
    for container in inits {
        let context = container.security_context.as_ref().expect("security context");
        assert_eq!(context.allow_privilege_escalation, Some(false), "{}", container.name);
        assert_eq!(context.run_as_non_root, Some(true), "{}", container.name);
    }
    let manager = &pod.containers[0];
    assert!(
        manager
            .image
            .as_deref()
            .is_some_and(|i| i.ends_with("crossplane/templating-controller:v0.4.0")),
        "{manager:?}"
    );
    let env: Vec<(String, String)> = manager
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name, v.value.unwrap_or_default()))
        .collect();
    assert!(env.contains(&("SD_NAMESPACE".into(), "team-a".into())), "{env:?}");
    assert!(env.contains(&("SD_NAME".into(), "sample".into())), "{env:?}");
    assert!(
        manager
            .args
            .clone()
            .unwrap_or_default()
            .join(" ")
            .contains("--stack-definition-name $(SD_NAME)"),
        "{manager:?}"
    );
    assert_eq!(
        pod.security_context.and_then(|c| c.run_as_user),
        Some(NON_ROOT_ID),
        "the templating controller without USER runs as non-root"
    );

    uninstall_leaves_nothing(
        &fleet,
        "team-a",
        "sample",
        &["gcpsamples.gcp.stacks.example.org"],
        &daemon,
    )
    .await;
    let definitions: Api<StackDefinition> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("the StackDefinition gone with its Stack", SOON, &daemon, || {
        let definitions = definitions.clone();
        async move { definitions.get_opt("sample").await.ok()?.is_none().then_some(()) }
    })
    .await;
}

/// A package with more problems than an Event may carry: the install's condition says every one,
/// and its Event (which kube-apiserver refuses over 1,024 bytes) is published, cut.
#[tokio::test(flavor = "multi_thread")]
async fn every_problem_of_a_package_is_said_at_once_and_its_event_is_published() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let root = fleet.dir.path().join("packages/many-problems/.registry");
    let mut files = vec![("app.yaml".to_string(), "title: t\n".to_string())];
    for i in 0..12 {
        files.push((
            format!("resources/not-a-crd-{i:02}-with-a-long-enough-name.crd.yaml"),
            "apiVersion: v1\nkind: ConfigMap\n".to_string(),
        ));
    }
    let borrowed: Vec<(&str, &str)> = files.iter().map(|(p, t)| (p.as_str(), t.as_str())).collect();
    write(&root, &borrowed);
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "broken",
        json!({"package": "examples/many-problems:v1"}),
    )
    .await;
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    let message = wait_until("the install failed with every problem", SOON, &daemon, || {
        let installs = installs.clone();
        async move {
            let install = installs.get_opt("broken").await.ok()??;
            let (_, _, message) = condition(&install, "Ready")?;
            message.contains("the package has 12 problems").then_some(message)
        }
    })
    .await;
    assert!(message.len() > MAX_NOTE_BYTES, "{message}");
    for i in 0..12 {
        assert!(
            message.contains(&format!("not-a-crd-{i:02}")),
            "{i} missing from {message}"
        );
    }
    let note = wait_until("its Event", SOON, &daemon, || {
        let tenant = tenant.clone();
        async move {
            events_of(&tenant, "team-a", "broken")
                .await
                .into_iter()
                .find(|(_, note)| note.contains("the package has 12 problems"))
                .map(|(_, note)| note)
        }
    })
    .await;
    assert!(
        note.len() <= MAX_NOTE_BYTES && note.ends_with(" …"),
        "{} bytes: {note}",
        note.len()
    );
}
