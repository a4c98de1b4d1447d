//! The tenant is untrusted (DESIGN.md §8, issue 16): a user who may write StackInstalls in one
//! namespace (and, as a namespace admin, Stacks) and who chooses the package tries to reach beyond
//! what they were given through stacks. Each attack is performed through the daemon binary and
//! refused with a condition and an Event naming what was refused, and leaves nothing behind.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::stacks::{ClusterStackInstall, Stack, StackInstall};
use stackd::embedded::Verb;
use stackd::embedded::faults::RequestMatch;

use super::stacks_install::{
    StackFleet, WIDGETS, condition, crd_names, create_install, create_namespace, events_of, install_sample, stacks_on,
    wait_for_reason, wait_synced,
};
use crate::harness::Daemon;
use crate::harness::wait_until;

const TENANT: &str = "acme";
const HOST_NS: &str = "tenant-acme-controllers";
const SOON: Duration = Duration::from_secs(20);

/// Writes package `name` into the fleet's package directory: the sample stack's app.yaml and
/// install.yaml with `crds` (YAML documents) as its only CRDs, and `scope` as its permission scope.
fn write_package(fleet: &StackFleet, name: &str, crds: &[Value], scope: &str) {
    let packages = fleet.dir.path().join("packages");
    let sample = packages.join("sample-stack/.registry");
    let root = packages.join(name).join(".registry");
    std::fs::create_dir_all(root.join("resources")).expect("package dir");
    let app = std::fs::read_to_string(sample.join("app.yaml")).expect("app.yaml");
    let app = app.replace("permissionScope: Namespaced", &format!("permissionScope: {scope}"));
    std::fs::write(root.join("app.yaml"), app).expect("app.yaml");
    std::fs::copy(sample.join("install.yaml"), root.join("install.yaml")).expect("install.yaml");
    for (i, crd) in crds.iter().enumerate() {
        let yaml = serde_saphyr::to_string(crd).expect("crd yaml");
        std::fs::write(root.join(format!("resources/{i}.crd.yaml")), yaml).expect("crd");
    }
}

/// The sample package's Widget CRD as JSON.
fn sample_widget_crd(fleet: &StackFleet) -> Value {
    let path = fleet
        .dir
        .path()
        .join("packages/sample-stack/.registry/resources/widget.crd.yaml");
    let crd: CustomResourceDefinition =
        serde_saphyr::from_str(&std::fs::read_to_string(path).expect("read crd")).expect("parse crd");
    serde_json::to_value(crd).expect("json")
}

/// A CRD `plural.group` with one served version and an open schema.
fn crd(plural: &str, group: &str, kind: &str) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.to_lowercase(), "kind": kind, "listKind": format!("{kind}List")},
            "versions": [{"name": "v1", "served": true, "storage": true,
                          "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
        }
    })
}

fn with_conversion_webhook(mut crd: Value) -> Value {
    crd["spec"]["conversion"] = json!({
        "strategy": "Webhook",
        "webhook": {
            "conversionReviewVersions": ["v1"],
            "clientConfig": {"url": "https://converter.attacker.example/convert"},
        },
    });
    crd
}

async fn crd_on(tenant: &Client, name: &str) -> Option<CustomResourceDefinition> {
    Api::<CustomResourceDefinition>::all(tenant.clone())
        .get_opt(name)
        .await
        .expect("get crd")
}

/// Waits for a Warning Event with `reason` on the object `name` whose message contains `fragment`.
async fn wait_for_event(tenant: &Client, namespace: &str, name: &str, reason: &str, fragment: &str, daemon: &Daemon) {
    wait_until(
        &format!("a {reason} Event on {namespace}/{name} naming {fragment}"),
        SOON,
        daemon,
        || async {
            let events = events_of(tenant, namespace, name).await;
            events
                .iter()
                .any(|(r, message)| r == reason && message.contains(fragment))
                .then_some(())
        },
    )
    .await;
}

/// Everything the Stack controller would have made for Stacks of `namespace`: tenant RBAC, service
/// accounts and token Secrets (by stackd's labels), and host Deployments and Secrets.
async fn granted_in(fleet: &StackFleet, namespace: &str) -> Vec<String> {
    let tenant = fleet.tenant(TENANT);
    let params = ListParams::default().labels(&format!(
        "app.kubernetes.io/managed-by=stackd,stacks.stackd.dev/stack-namespace={namespace}"
    ));
    let mut found = Vec::new();
    let roles = Api::<ClusterRole>::all(tenant.clone())
        .list(&params)
        .await
        .expect("roles");
    found.extend(named("ClusterRole", roles.items));
    let bindings = Api::<ClusterRoleBinding>::all(tenant.clone())
        .list(&params)
        .await
        .expect("bindings");
    found.extend(named("ClusterRoleBinding", bindings.items));
    let role_bindings = Api::<RoleBinding>::all(tenant.clone())
        .list(&params)
        .await
        .expect("role bindings");
    found.extend(named("RoleBinding", role_bindings.items));
    let accounts = Api::<ServiceAccount>::all(tenant.clone())
        .list(&params)
        .await
        .expect("accounts");
    found.extend(named("ServiceAccount", accounts.items));
    let secrets = Api::<Secret>::all(tenant.clone()).list(&params).await.expect("secrets");
    found.extend(named("Secret", secrets.items));
    let host = ListParams::default().labels(&format!(
        "stackd.dev/parent-kind=Stack,stackd.dev/parent-namespace={namespace}"
    ));
    let deployments = Api::<Deployment>::namespaced(fleet.host_client.clone(), HOST_NS)
        .list(&host)
        .await
        .expect("deployments");
    found.extend(named("host Deployment", deployments.items));
    let host_secrets = fleet.host_secrets(TENANT).list(&host).await.expect("host secrets");
    found.extend(named("host Secret", host_secrets.items));
    found
}

fn named<K: ResourceExt>(kind: &str, items: Vec<K>) -> Vec<String> {
    items.iter().map(|item| format!("{kind}/{}", item.name_any())).collect()
}

async fn cluster_role_bindings(tenant: &Client) -> Vec<String> {
    Api::<ClusterRoleBinding>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .expect("bindings")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_shipping_stackds_own_crd_is_refused_and_changes_nothing() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let own = "clusterstackinstalls.stacks.stackd.dev";
    let before = crd_on(&tenant, own).await.expect("stackd's CRD");
    // The package's copy serves one more version, whose persona roles would aggregate into `edit`.
    let mut hijack = serde_json::to_value(&before).expect("json");
    hijack["metadata"] = json!({"name": own});
    hijack["status"] = Value::Null;
    let mut extra = hijack["spec"]["versions"][0].clone();
    extra["name"] = json!("v1");
    extra["storage"] = json!(false);
    hijack["spec"]["versions"].as_array_mut().expect("versions").push(extra);
    write_package(&fleet, "hijack-stack", &[hijack], "Namespaced");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "hijack",
        json!({"package": "examples/hijack-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "hijack", &daemon, "CRDGroupReserved").await;
    assert_eq!(status, "False");
    assert!(message.contains(own) && message.contains("stackd"), "{message}");
    wait_for_event(&tenant, "team-a", "hijack", "CRDGroupReserved", own, &daemon).await;

    let after = crd_on(&tenant, own).await.expect("stackd's CRD");
    assert_eq!(
        after.resource_version(),
        before.resource_version(),
        "stackd's CRD was written"
    );
    assert!(stacks_on(&tenant).await.is_empty(), "a Stack was created");
    assert_eq!(granted_in(&fleet, "team-a").await, Vec::<String>::new());
}

/// With `--stack-crd-groups`, a package may take no API group outside the list, such as a
/// well-known operator's not installed yet; the sample's group, on the list, installs as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_package_taking_a_group_outside_the_daemons_list_is_refused() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    const CERTIFICATES: &str = "certificates.cert-manager.io";
    write_package(
        &fleet,
        "squat-stack",
        &[crd("certificates", "cert-manager.io", "Certificate")],
        "Namespaced",
    );
    let daemon = fleet.daemon(&["--stack-crd-groups", "*.example.org"]);
    create_install(
        &tenant,
        "team-b",
        "squat",
        json!({"package": "examples/squat-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-b", "squat", &daemon, "CRDGroupReserved").await;
    assert_eq!(status, "False");
    assert!(
        message.contains(CERTIFICATES) && message.contains("--stack-crd-groups *.example.org"),
        "{message}"
    );
    wait_for_event(&tenant, "team-b", "squat", "CRDGroupReserved", CERTIFICATES, &daemon).await;
    assert!(crd_on(&tenant, CERTIFICATES).await.is_none(), "the CRD was created");
    assert!(stacks_on(&tenant).await.is_empty(), "a Stack was created");
    install_sample(&tenant, &daemon).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_shipping_a_crd_another_install_created_is_refused() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    // Team-b's package replaces team-a's Widget CRD with its own schema; team-c's adds a CRD to
    // team-a's API group.
    let mut copycat = sample_widget_crd(&fleet);
    copycat["spec"]["versions"][0]["schema"]["openAPIV3Schema"] =
        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    write_package(&fleet, "copycat-stack", &[copycat], "Namespaced");
    write_package(
        &fleet,
        "squatter-stack",
        &[crd("sprockets", "samples.example.org", "Sprocket")],
        "Namespaced",
    );
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    let before = crd_on(&tenant, WIDGETS).await.expect("team-a's CRD");

    for (namespace, package) in [("team-b", "copycat-stack"), ("team-c", "squatter-stack")] {
        create_install(
            &tenant,
            namespace,
            "widgets",
            json!({"package": format!("examples/{package}:v1")}),
        )
        .await;
    }
    for namespace in ["team-b", "team-c"] {
        let (_, _, message) = wait_for_reason(&tenant, namespace, "widgets", &daemon, "CRDConflict").await;
        assert!(
            message.contains(WIDGETS) && message.contains("StackInstall team-a/sample"),
            "{namespace}: {message}"
        );
        wait_for_event(&tenant, namespace, "widgets", "CRDConflict", WIDGETS, &daemon).await;
    }
    let (_, _, message) = wait_for_reason(&tenant, "team-c", "widgets", &daemon, "CRDConflict").await;
    assert!(message.contains("sprockets.samples.example.org"), "{message}");

    let after = crd_on(&tenant, WIDGETS).await.expect("team-a's CRD");
    assert_eq!(
        after.resource_version(),
        before.resource_version(),
        "team-a's CRD was written"
    );
    assert!(crd_on(&tenant, "sprockets.samples.example.org").await.is_none());
    let stacks: Vec<String> = stacks_on(&tenant)
        .await
        .iter()
        .map(|s| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any()))
        .collect();
    assert_eq!(stacks, ["team-a/sample"]);
    for namespace in ["team-b", "team-c"] {
        assert_eq!(granted_in(&fleet, namespace).await, Vec::<String>::new(), "{namespace}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_shipping_a_crd_stackd_did_not_create_is_refused_whatever_it_changes() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let foreign = crd("certificates", "cert-manager.example.org", "Certificate");
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let before = crds
        .create(
            &PostParams::default(),
            &serde_json::from_value(foreign.clone()).expect("crd"),
        )
        .await
        .expect("the third party's CRD");
    // The package's copy adds a conversion webhook and a version; even with webhooks allowed, the
    // CRD is not stackd's to change.
    let mut hostile = with_conversion_webhook(foreign);
    let mut extra = hostile["spec"]["versions"][0].clone();
    extra["name"] = json!("v2");
    extra["storage"] = json!(false);
    hostile["spec"]["versions"]
        .as_array_mut()
        .expect("versions")
        .push(extra);
    write_package(&fleet, "foreign-stack", &[hostile], "Namespaced");
    let daemon = fleet.daemon(&["--insecure-allow-conversion-webhooks"]);
    create_install(
        &tenant,
        "team-a",
        "certs",
        json!({"package": "examples/foreign-stack:v1"}),
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "certs", &daemon, "CRDConflict").await;
    assert!(
        message.contains("certificates.cert-manager.example.org") && message.contains("not created by stackd"),
        "{message}"
    );
    wait_for_event(
        &tenant,
        "team-a",
        "certs",
        "CRDConflict",
        "certificates.cert-manager.example.org",
        &daemon,
    )
    .await;
    let after = crds.get("certificates.cert-manager.example.org").await.expect("crd");
    assert_eq!(
        after.resource_version(),
        before.resource_version(),
        "the CRD was written"
    );
    assert!(after.spec.conversion.as_ref().is_none_or(|c| c.webhook.is_none()));
    assert!(after.labels().is_empty(), "{:?}", after.labels());
    assert!(stacks_on(&tenant).await.is_empty());
    assert_eq!(granted_in(&fleet, "team-a").await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn conversion_webhooks_are_refused_unless_the_daemon_allows_them() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let hooks = "hooks.webhooks.example.org";
    write_package(
        &fleet,
        "webhook-stack",
        &[with_conversion_webhook(crd("hooks", "webhooks.example.org", "Hook"))],
        "Namespaced",
    );
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "hooks",
        json!({"package": "examples/webhook-stack:v1"}),
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "hooks", &daemon, "ConversionWebhookRefused").await;
    assert!(
        message.contains(hooks) && message.contains("--insecure-allow-conversion-webhooks"),
        "{message}"
    );
    wait_for_event(&tenant, "team-a", "hooks", "ConversionWebhookRefused", hooks, &daemon).await;
    assert!(crd_on(&tenant, hooks).await.is_none(), "the CRD was created");
    assert!(stacks_on(&tenant).await.is_empty());
    assert_eq!(granted_in(&fleet, "team-a").await, Vec::<String>::new());
    drop(daemon);

    // The operator opts in: the same install goes through.
    let daemon = fleet.daemon(&["--insecure-allow-conversion-webhooks"]);
    let crd = wait_until("the CRD with its webhook", SOON, &daemon, || async {
        crd_on(&tenant, hooks).await
    })
    .await;
    assert_eq!(crd.spec.conversion.map(|c| c.strategy).as_deref(), Some("Webhook"));
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("Synced=True", SOON, &daemon, || async {
        let install = installs.get("hooks").await.ok()?;
        (condition(&install, "Synced")?.0 == "True").then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stack_made_by_hand_gets_no_permissions_token_or_controller() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    let sample = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("install");
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    let installed = stacks.get("sample").await.expect("the install's Stack");
    // A plain one asking for everything, cluster-wide; and one dressed up as an install's, with
    // stackd's label and an owner reference to a real install of another name.
    let mut greedy = serde_json::to_value(&installed.spec).expect("spec");
    greedy["permissionScope"] = json!("Cluster");
    greedy["permissions"]["rules"] = json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]);
    let forged_owner = json!({
        "apiVersion": "stacks.stackd.dev/v1alpha1", "kind": "StackInstall",
        "name": "sample", "uid": sample.uid(), "controller": true,
    });
    for (name, metadata) in [
        ("by-hand", json!({"name": "by-hand"})),
        (
            "forged",
            json!({"name": "forged", "labels": {"app.kubernetes.io/managed-by": "stackd"},
                   "ownerReferences": [forged_owner]}),
        ),
    ] {
        let stack: Stack =
            serde_json::from_value(json!({"metadata": metadata, "spec": greedy.clone()})).expect("stack");
        stacks
            .create(&PostParams::default(), &stack)
            .await
            .expect("create stack");
        let refused = wait_until(&format!("{name}: Ready=False NotInstalled"), SOON, &daemon, || async {
            let stack = stacks.get(name).await.ok()?;
            let ready = stack
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")?
                .clone();
            (ready.reason == "NotInstalled").then_some((stack, ready))
        })
        .await;
        let (stack, ready) = refused;
        assert_eq!(ready.status, "False");
        assert!(ready.message.contains("StackInstall"), "{}", ready.message);
        assert!(stack.finalizers().is_empty(), "{name}: {:?}", stack.finalizers());
        wait_until(&format!("{name}: a NotInstalled Event"), SOON, &daemon, || async {
            let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(tenant.clone(), "team-a")
                .list(&ListParams::default())
                .await
                .ok()?;
            events
                .items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("NotInstalled")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                })
                .then_some(())
        })
        .await;
    }
    let granted: Vec<String> = granted_in(&fleet, "team-a")
        .await
        .into_iter()
        .filter(|object| !object.contains("sample"))
        .collect();
    assert_eq!(granted, Vec::<String>::new(), "made for a Stack no install created");
    assert!(
        cluster_role_bindings(&tenant)
            .await
            .iter()
            .all(|name| !name.starts_with("stackd:")),
        "a cluster-wide binding was made"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stack_cut_loose_from_its_install_loses_what_it_was_given() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    assert!(!granted_in(&fleet, "team-a").await.is_empty());
    // A namespace admin takes the install's Stack for their own, keeping its grants.
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    stacks
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"ownerReferences": null}})),
        )
        .await
        .expect("drop the owner reference");
    wait_until("Ready=False NotInstalled", SOON, &daemon, || async {
        let stack = stacks.get("sample").await.ok()?;
        let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.reason == "NotInstalled").then_some(())
    })
    .await;
    // What is left is owned by the Stack (ServiceAccount, RoleBinding, token Secret, collected with
    // it); the binding points at a role that is gone, so nothing is granted.
    let left = wait_until("the grants withdrawn", SOON, &daemon, || async {
        let left = granted_in(&fleet, "team-a").await;
        let withdrawn = left
            .iter()
            .all(|o| !o.starts_with("ClusterRole") && !o.starts_with("host "));
        withdrawn.then_some(left)
    })
    .await;
    assert!(left.iter().all(|o| !o.contains("ClusterRoleBinding")), "{left:?}");
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "StackConflict").await;
    assert!(message.contains("not this install's"), "{message}");
}

#[tokio::test(flavor = "multi_thread")]
async fn stack_rules_beyond_the_allow_list_are_refused_and_grant_nothing() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    let roles: Api<ClusterRole> = Api::all(tenant.clone());
    let system = "stackd:team-a:sample:system";
    let before = roles.get(system).await.expect("system role");
    for verb in ["get", "list", "watch", "create", "update", "patch", "delete"] {
        assert!(
            before
                .rules
                .iter()
                .flatten()
                .all(|r| r.verbs.contains(&verb.to_string())),
            "{verb}"
        );
    }
    assert!(
        before.rules.iter().flatten().all(|r| !r.verbs.iter().any(|v| v == "*")),
        "the generated rules grant *"
    );

    // A user who may write Stacks (no persona may; a custom role could grant it) edits the install's Stack.
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    let attacks = [
        (
            json!({"apiGroups": ["samples.example.org"], "resources": ["widgets"], "verbs": ["*"]}),
            "\"*\"",
        ),
        (
            json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "escalate"]}),
            "escalate",
        ),
        (
            json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["impersonate"]}),
            "impersonate",
        ),
        (
            json!({"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"], "verbs": ["bind"]}),
            "rbac.authorization.k8s.io",
        ),
        (
            json!({"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]}),
            "serviceaccounts/token",
        ),
    ];
    for (rule, named) in attacks {
        let mut rules =
            serde_json::to_value(&stacks.get("sample").await.expect("stack").spec.permissions.rules).expect("rules");
        rules.as_array_mut().expect("rules").truncate(2);
        rules.as_array_mut().expect("rules").push(rule);
        stacks
            .patch(
                "sample",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"permissions": {"rules": rules}}})),
            )
            .await
            .expect("edit the Stack");
        let message = wait_until(&format!("PermissionsRefused naming {named}"), SOON, &daemon, || async {
            let stack = stacks.get("sample").await.ok()?;
            let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
            (ready.reason == "PermissionsRefused" && ready.message.contains(named)).then_some(ready.message)
        })
        .await;
        assert!(message.contains("--insecure-allow-all-apigroups"), "{message}");
        let after = roles.get(system).await.expect("system role");
        assert_eq!(
            after.resource_version(),
            before.resource_version(),
            "{named}: rules were granted"
        );
    }
    wait_until("a PermissionsRefused Event", SOON, &daemon, || async {
        let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(tenant.clone(), "team-a")
            .list(&ListParams::default())
            .await
            .ok()?;
        events
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("PermissionsRefused"))
            .then_some(())
    })
    .await;
    assert!(
        cluster_role_bindings(&tenant)
            .await
            .iter()
            .all(|name| !name.starts_with("stackd:")),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stack_install_never_yields_a_cluster_wide_binding() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    // An install pod whose output claims Cluster scope for a StackInstall: refused before anything.
    create_install(
        &tenant,
        "team-b",
        "forged",
        json!({"package": "examples/forged-cluster:v1"}),
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-b", "forged", &daemon, "PermissionScopeMismatch").await;
    assert!(message.contains("ClusterStackInstall"), "{message}");
    wait_for_event(
        &tenant,
        "team-b",
        "forged",
        "PermissionScopeMismatch",
        "Cluster",
        &daemon,
    )
    .await;
    assert!(stacks_on(&tenant).await.is_empty());
    assert!(crd_names(&tenant).await.is_empty(), "a refused install created a CRD");

    // The Stack of a StackInstall edited to Cluster scope: refused, and its RoleBinding stays.
    install_sample(&tenant, &daemon).await;
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    stacks
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"permissionScope": "Cluster"}})),
        )
        .await
        .expect("edit scope");
    let message = wait_until("PermissionScopeMismatch", SOON, &daemon, || async {
        let stack = stacks.get("sample").await.ok()?;
        let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.reason == "PermissionScopeMismatch").then_some(ready.message)
    })
    .await;
    assert!(message.contains("StackInstall"), "{message}");
    assert!(
        cluster_role_bindings(&tenant)
            .await
            .iter()
            .all(|name| !name.starts_with("stackd:")),
        "a StackInstall's Stack was bound cluster-wide"
    );
    Api::<RoleBinding>::namespaced(tenant.clone(), "team-a")
        .get("stackd:team-a:sample")
        .await
        .expect("the namespaced binding stays");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stack_install_and_a_cluster_stack_install_of_one_name_do_not_fight() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, "team-a", "dup", json!({"package": "examples/sample-stack:v1"})).await;
    wait_for_reason(&tenant, "team-a", "dup", &daemon, "Available").await;
    let host_before = fleet._host.counters();
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("dup")
        .await
        .expect("stack");

    let cluster_installs: Api<ClusterStackInstall> = Api::namespaced(tenant.clone(), "team-a");
    let install: ClusterStackInstall = serde_json::from_value(json!({
        "metadata": {"name": "dup", "namespace": "team-a"},
        "spec": {"package": "examples/cluster-stack:v1"},
    }))
    .expect("install");
    cluster_installs
        .create(&PostParams::default(), &install)
        .await
        .expect("create");
    let refused = wait_until("the ClusterStackInstall refused", SOON, &daemon, || async {
        let install = cluster_installs.get("dup").await.ok()?;
        let ready = install.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
        (ready.reason == "HostObjectConflict").then_some(ready)
    })
    .await;
    assert_eq!(refused.status, "False");
    assert!(
        refused.message.contains("StackInstall team-a/dup"),
        "{}",
        refused.message
    );
    wait_for_event(
        &tenant,
        "team-a",
        "dup",
        "HostObjectConflict",
        "StackInstall team-a/dup",
        &daemon,
    )
    .await;

    // No retry loop: the refusal is settled, not an error retried with backoff. Another reconcile
    // (a label is an event that changes nothing) ends as the refusal did, without an error.
    let errors = metric(&daemon, "stackd_reconcile_errors_total", "ClusterStackInstall");
    let reconciled = daemon.reconciles_done(TENANT, "ClusterStackInstall");
    cluster_installs
        .patch(
            "dup",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .expect("label");
    wait_until("the label's reconcile", SOON, &daemon, || async {
        (daemon.reconciles_done(TENANT, "ClusterStackInstall") > reconciled).then_some(())
    })
    .await;
    let errors_later = metric(&daemon, "stackd_reconcile_errors_total", "ClusterStackInstall");
    assert_eq!(errors_later, errors, "the refused install is retried as an error");
    let params = ListParams::default().labels("stackd.dev/parent-kind=ClusterStackInstall");
    assert!(
        fleet
            .host_jobs(TENANT)
            .list(&params)
            .await
            .expect("jobs")
            .items
            .is_empty()
    );
    let job_writes = fleet._host.counters().since(&host_before);
    assert_eq!(
        job_writes.get(stackd::embedded::Verb::Create, "jobs", Some(HOST_NS)),
        0,
        "the ClusterStackInstall made an install Job"
    );
    let stack_after = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("dup")
        .await
        .expect("stack");
    assert_eq!(stack_after.resource_version(), stack.resource_version());
    assert!(crd_on(&tenant, "gadgets.cluster-samples.example.org").await.is_none());

    // Once the StackInstall is gone, the name is free and the ClusterStackInstall proceeds.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .delete("dup", &DeleteParams::default())
        .await
        .expect("delete the StackInstall");
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("the ClusterStackInstall's Stack", SOON, &daemon, || async {
        let stack = stacks.get_opt("dup").await.ok()??;
        let owner = stack.owner_references().first()?.kind.clone();
        (owner == "ClusterStackInstall").then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn service_account_annotations_of_an_install_land_on_the_stacks_service_account() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    create_namespace(&tenant, "team-a").await;
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({
            "package": "examples/sample-stack:v1",
            "serviceAccount": {"annotations": {
                "iam.example.com/role": "widgets-operator",
                // A key of stackd's own: it never replaces the one stackd sets.
                "stacks.stackd.dev/stack": "team-b/other",
            }},
        }),
    )
    .await;
    wait_synced(&tenant, "team-a", &daemon).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(tenant.clone(), "team-a");
    let annotations = |expected: &'static str| {
        let accounts = accounts.clone();
        move || {
            let accounts = accounts.clone();
            async move {
                let account = accounts.get_opt("sample").await.ok()??;
                let annotations: BTreeMap<String, String> = account.annotations().clone();
                (annotations.get("iam.example.com/role").map(String::as_str) == Some(expected)).then_some(annotations)
            }
        }
    };
    let found = wait_until(
        "the annotated ServiceAccount",
        SOON,
        &daemon,
        annotations("widgets-operator"),
    )
    .await;
    assert_eq!(found["stacks.stackd.dev/stack"], "team-a/sample");
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("stack");
    let on_stack = stack
        .spec
        .controller
        .service_account
        .expect("serviceAccount")
        .annotations;
    assert_eq!(on_stack["iam.example.com/role"], "widgets-operator");

    // A change on the install follows to the account.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .patch(
            "sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"serviceAccount": {"annotations": {"iam.example.com/role": "widgets-v2"}}}})),
        )
        .await
        .expect("edit");
    wait_until("the new annotation", SOON, &daemon, annotations("widgets-v2")).await;
    // The account keeps working for the controller.
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
}

/// The value of a per-controller counter on the daemon's /metrics.
fn metric(daemon: &Daemon, name: &str, controller: &str) -> u64 {
    daemon.controller_metric(name, TENANT, controller)
}

/// The Ready condition of Stack `namespace/name` once its reason is `reason`, as its message.
async fn stack_ready_message(tenant: &Client, namespace: &str, name: &str, reason: &str, daemon: &Daemon) -> String {
    let stacks: Api<Stack> = Api::namespaced(tenant.clone(), namespace);
    wait_until(
        &format!("Stack {namespace}/{name} Ready reason {reason}"),
        SOON,
        daemon,
        || async {
            let stack = stacks.get_opt(name).await.ok()??;
            let ready = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
            (ready.reason == reason).then_some(ready.message)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dependency_on_a_third_party_or_kubernetes_group_is_refused_and_binds_nothing() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    // A third party's CRD on the tenant, which tenant users must not reach through a stack.
    Api::<CustomResourceDefinition>::all(tenant.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(crd("policyexceptions", "kyverno.io", "PolicyException")).expect("crd"),
        )
        .await
        .expect("the third party's CRD");
    write_package(
        &fleet,
        "greedy-stack",
        &[crd("notes", "notes.example.org", "Note")],
        "Namespaced",
    );
    let app = fleet.dir.path().join("packages/greedy-stack/.registry/app.yaml");
    let mut yaml = std::fs::read_to_string(&app).expect("app.yaml");
    yaml.push_str("dependsOn:\n- crd: policyexceptions.kyverno.io/v1\n- crd: deployments.apps/v1\n");
    std::fs::write(&app, yaml).expect("app.yaml");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "greedy",
        json!({"package": "examples/greedy-stack:v1"}),
    )
    .await;

    let message = stack_ready_message(&tenant, "team-a", "greedy", "PermissionsRefused", &daemon).await;
    assert!(
        message.contains("\"kyverno.io\", which is neither on the host's list of platform groups"),
        "{message}"
    );
    assert!(message.contains("\"apps\", which belongs to Kubernetes"), "{message}");
    wait_for_event(&tenant, "team-a", "greedy", "PermissionsRefused", "kyverno.io", &daemon).await;
    // The install passes the Stack's refusal on (it may still show the Stack's earlier state).
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    let status = wait_until("the install's Ready naming kyverno.io", SOON, &daemon, || async {
        let ready = condition(&installs.get_opt("greedy").await.ok()??, "Ready")?;
        (ready.1 == "WaitingForStack" && ready.2.contains("kyverno.io")).then_some(ready.0)
    })
    .await;
    assert_eq!(status, "False");
    assert_eq!(granted_in(&fleet, "team-a").await, Vec::<String>::new());
    assert!(
        cluster_role_bindings(&tenant)
            .await
            .iter()
            .all(|name| !name.starts_with("stackd:")),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dependency_on_another_stacks_crds_is_granted_once_that_stack_installed_them() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    // The cluster stack depends on the sample stack's Widgets, which are not installed yet.
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
    let message = stack_ready_message(&tenant, "infra", "gadgets", "PermissionsRefused", &daemon).await;
    assert!(message.contains("\"samples.example.org\""), "{message}");
    assert_eq!(granted_in(&fleet, "infra").await, Vec::<String>::new());

    install_sample(&tenant, &daemon).await;
    stack_ready_message(&tenant, "infra", "gadgets", "Available", &daemon).await;
    let rules = Api::<ClusterRole>::all(tenant.clone())
        .get("stackd:infra:gadgets:system")
        .await
        .expect("system role")
        .rules
        .unwrap_or_default();
    assert!(
        rules
            .iter()
            .any(|r| r.api_groups.as_deref() == Some(&["samples.example.org".to_string()][..])),
        "{rules:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_crd_shared_with_another_install_is_not_taken_over_by_switching_the_package() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    // The Widget CRD from before CRDs named their package, used by team-b's Stack and team-a's.
    let mut old: CustomResourceDefinition = serde_json::from_value(sample_widget_crd(&fleet)).expect("crd");
    old.metadata.labels = Some(BTreeMap::from([
        ("stacks.stackd.dev/managed".to_string(), "true".to_string()),
        (stackd::stacks::crd_parent_label("team-a", "sample"), "true".to_string()),
        (stackd::stacks::crd_parent_label("team-b", "sample"), "true".to_string()),
    ]));
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let before = crds.create(&PostParams::default(), &old).await.expect("old CRD");
    // Team-a's install now names the attacker's package, whose Widget CRD has another schema.
    let mut rewritten = sample_widget_crd(&fleet);
    rewritten["spec"]["versions"][0]["schema"]["openAPIV3Schema"] =
        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    write_package(&fleet, "takeover-stack", &[rewritten], "Namespaced");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/takeover-stack:v1"}),
    )
    .await;

    let (status, _, message) = wait_for_reason(&tenant, "team-a", "sample", &daemon, "CRDConflict").await;
    assert_eq!(status, "False");
    assert!(message.contains(WIDGETS), "{message}");
    wait_for_event(&tenant, "team-a", "sample", "CRDConflict", WIDGETS, &daemon).await;
    let after = crd_on(&tenant, WIDGETS).await.expect("the CRD");
    assert_eq!(
        after.resource_version(),
        before.resource_version(),
        "the shared CRD was rewritten"
    );
    assert!(stacks_on(&tenant).await.is_empty(), "a Stack was created");
    assert_eq!(granted_in(&fleet, "team-a").await, Vec::<String>::new());
}

/// Installs of one package in two namespaces share its CRD, but only the install that created it
/// changes it: team-b moving to a version whose CRD differs is refused and the CRD stays as it
/// is, while team-a (its creator) upgrades it; then team-b's install, asking for what is there,
/// goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_crd_changes_only_through_the_install_that_created_it() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    const GADGETS: &str = "gadgets.shared.example.org";
    let v1 = crd("gadgets", "shared.example.org", "Gadget");
    let mut v2 = v1.clone();
    v2["spec"]["versions"]
        .as_array_mut()
        .expect("versions")
        .push(json!({"name": "v2", "served": true, "storage": false,
            "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}));
    write_package(&fleet, "shared-stack", &[v1], "Namespaced");
    let daemon = fleet.daemon(&[]);
    for namespace in ["team-a", "team-b"] {
        create_install(
            &tenant,
            namespace,
            "gadgets",
            json!({"package": "examples/shared-stack:v1"}),
        )
        .await;
        let (status, _, message) = wait_for_reason(&tenant, namespace, "gadgets", &daemon, "Available").await;
        assert_eq!(status, "True", "{namespace}: {message}");
    }
    let served = |crd: &CustomResourceDefinition| crd.spec.versions.iter().map(|v| v.name.clone()).collect::<Vec<_>>();
    let shared = crd_on(&tenant, GADGETS).await.expect("the shared CRD");
    assert_eq!(served(&shared), ["v1"]);

    // The package's next version: its CRD serves v2 too.
    write_package(&fleet, "shared-stack", &[v2], "Namespaced");
    let upgrade = |namespace: &str| {
        let api: Api<StackInstall> = Api::namespaced(tenant.clone(), namespace);
        async move {
            let patch = json!({"spec": {"package": "examples/shared-stack:v2"}});
            api.patch("gadgets", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("upgrade");
        }
    };
    upgrade("team-b").await;
    let (status, _, message) = wait_for_reason(&tenant, "team-b", "gadgets", &daemon, "CRDConflict").await;
    assert_eq!(status, "False");
    assert!(
        message.contains(GADGETS) && message.contains("StackInstall team-a/gadgets"),
        "{message}"
    );
    wait_for_event(&tenant, "team-b", "gadgets", "CRDConflict", GADGETS, &daemon).await;
    let after = crd_on(&tenant, GADGETS).await.expect("the shared CRD");
    assert_eq!(
        after.resource_version(),
        shared.resource_version(),
        "team-b changed the CRD team-a created"
    );

    upgrade("team-a").await;
    wait_until("team-a's upgrade serves v2", SOON, &daemon, || async {
        let crd = crd_on(&tenant, GADGETS).await?;
        (served(&crd) == ["v1", "v2"]).then_some(())
    })
    .await;
    for namespace in ["team-a", "team-b"] {
        let (status, _, message) = wait_for_reason(&tenant, namespace, "gadgets", &daemon, "Available").await;
        assert_eq!(status, "True", "{namespace}: {message}");
    }
}

// ---------------------------------------------------------------------------------------------
// Blast radius (issue 28): what one user's objects in one namespace cost the daemon and the tenant

/// The installs of `namespace` whose Ready reason is `reason`.
async fn installs_with_reason(tenant: &Client, namespace: &str, reason: &str) -> usize {
    Api::<StackInstall>::namespaced(tenant.clone(), namespace)
        .list(&ListParams::default())
        .await
        .map(|list| list.items)
        .unwrap_or_default()
        .iter()
        .filter(|install| condition(install, "Ready").is_some_and(|(_, r, _)| r == reason))
        .count()
}

/// Any user who may write Secrets can label one `app.kubernetes.io/managed-by=stackd`. The Stack
/// controller knows only the token Secrets it created, by their metadata: 60 labelled Secrets of
/// 0.7 MiB neither grow the daemon nor are read, and the sample stack still gets (and re-gets) its
/// token, event-driven. (0.7 MiB: the embedded server bounds a Secret's data by its base64 text.)
#[tokio::test(flavor = "multi_thread")]
async fn secrets_labelled_as_stackds_are_neither_cached_nor_read() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    let baseline = daemon.rss_kib();
    assert!(baseline > 0, "the daemon's memory cannot be read");
    create_namespace(&tenant, "team-x").await;
    let server = &fleet.tenants[TENANT].0;
    let before = server.counters();
    let labelled: Api<Secret> = Api::namespaced(tenant.clone(), "team-x");
    let blob = "x".repeat(700 * 1024);
    for i in 0..60 {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": format!("big-{i}"), "labels": {"app.kubernetes.io/managed-by": "stackd"}},
            "stringData": {"blob": blob},
        }))
        .expect("secret");
        labelled
            .create(&PostParams::default(), &secret)
            .await
            .expect("a labelled Secret");
    }
    // The sample's own token Secret changes after them: one watch delivers in resourceVersion order,
    // so the Stack's reconcile this starts comes after the daemon was sent every labelled Secret.
    let tokens: Api<Secret> = Api::namespaced(tenant.clone(), "team-a");
    let reconciled = daemon.reconciles_done(TENANT, "stack");
    let touch = json!({"metadata": {"annotations": {"example.org/touched": "yes"}}});
    tokens
        .patch("sample-token", &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .expect("touch the token Secret");
    wait_until(
        "the Stack's reconcile after the labelled Secrets",
        SOON,
        &daemon,
        || async { (daemon.reconciles_done(TENANT, "stack") > reconciled).then_some(()) },
    )
    .await;
    let grown = daemon.rss_kib().saturating_sub(baseline);
    assert!(
        grown < 20 * 1024,
        "the daemon grew by {} MiB for 42 MiB of Secrets it did not create",
        grown / 1024
    );
    let read = server.counters().since(&before);
    for verb in [Verb::Get, Verb::List] {
        assert_eq!(
            read.get(verb, "secrets", Some("team-x")),
            0,
            "the labelled Secrets were read ({verb:?})"
        );
    }
    // The token sync is still event-driven: a new token reaches the host copy.
    let rotated = json!({"data": {"token": "cm90YXRlZA=="}});
    tokens
        .patch("sample-token", &PatchParams::default(), &Patch::Merge(&rotated))
        .await
        .expect("rotate the token");
    let copies = fleet.host_secrets(TENANT);
    wait_until("the rotated token on the host", SOON, &daemon, || async {
        let copy = copies.get_opt("team-a.sample-token").await.ok()??;
        (copy.data?.get("token")?.0 == b"rotated").then_some(())
    })
    .await;
}

/// Installs parked because their package's CRD is another package's are judged again when that
/// CRD changes, from what their Job's output came to: 50 of them cost a CRD write no log reads.
#[tokio::test(flavor = "multi_thread")]
async fn parked_conflicting_installs_read_no_logs_when_a_crd_changes() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    // Another package shipping the sample's Widget CRD.
    write_package(&fleet, "squatter-stack", &[sample_widget_crd(&fleet)], "Namespaced");
    let daemon = fleet.daemon(&[]);
    install_sample(&tenant, &daemon).await;
    // Ten per namespace, the most one namespace may hold by default.
    const PARKED: usize = 50;
    let namespaces: Vec<String> = (0..PARKED / 10).map(|i| format!("attacker-{i}")).collect();
    for i in 0..PARKED {
        let namespace = &namespaces[i % namespaces.len()];
        create_install(
            &tenant,
            namespace,
            &format!("parked-{i}"),
            json!({"package": "examples/squatter-stack:v1"}),
        )
        .await;
    }
    let parked = || async {
        let mut count = 0;
        for namespace in &namespaces {
            count += installs_with_reason(&tenant, namespace, "CRDConflict").await;
        }
        count
    };
    wait_until(
        "every install parked in CRDConflict",
        Duration::from_secs(120),
        &daemon,
        || async { (parked().await == PARKED).then_some(()) },
    )
    .await;
    let (host_before, reconciled) = (fleet._host.counters(), daemon.reconciles_done(TENANT, "StackInstall"));
    let touch = json!({"metadata": {"labels": {"example.org/touched": "yes"}}});
    Api::<CustomResourceDefinition>::all(tenant.clone())
        .patch(WIDGETS, &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .expect("a write of the CRD they conflict with");
    wait_until("every parked install judged again", SOON, &daemon, || async {
        (daemon.reconciles_done(TENANT, "StackInstall") >= reconciled + PARKED as u64).then_some(())
    })
    .await;
    let spent = fleet._host.counters().since(&host_before);
    assert_eq!(
        (
            spent.get(Verb::Get, "pods/log", Some(HOST_NS)),
            spent.get(Verb::List, "pods", Some(HOST_NS))
        ),
        (0, 0),
        "a CRD write read install logs again"
    );
    assert_eq!(parked().await, PARKED);
}

/// A package may hold only so many CRDs (`--max-package-crds`): more are refused before the stream
/// is parsed, with a message naming the bound, and nothing is created.
#[tokio::test(flavor = "multi_thread")]
async fn a_package_with_more_crds_than_the_bound_is_refused_naming_it() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let crds: Vec<Value> = ["alphas", "betas", "gammas", "deltas"]
        .iter()
        .map(|plural| {
            crd(
                plural,
                "crowded.example.org",
                &plural[..plural.len() - 1].to_uppercase(),
            )
        })
        .collect();
    write_package(&fleet, "crowded-stack", &crds, "Namespaced");
    let daemon = fleet.daemon(&["--max-package-crds", "3"]);
    create_install(
        &tenant,
        "team-a",
        "crowded",
        json!({"package": "examples/crowded-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "crowded", &daemon, "TooManyCRDs").await;
    assert_eq!(status, "False");
    assert!(
        message.contains("4 CustomResourceDefinitions")
            && message.contains("the 3")
            && message.contains("--max-package-crds"),
        "{message}"
    );
    wait_for_event(
        &tenant,
        "team-a",
        "crowded",
        "TooManyCRDs",
        "--max-package-crds",
        &daemon,
    )
    .await;
    assert!(
        crd_names(&tenant)
            .await
            .iter()
            .all(|name| !name.ends_with("crowded.example.org")),
        "a CRD of the refused package was created"
    );
    assert!(stacks_on(&tenant).await.is_empty(), "a Stack was created");
}

/// Each `imagePullSecrets` name costs two host Secrets of the tenant's shared quota: the schema
/// bounds the list, and so does the daemon (for an install CRD from before the bound), before
/// anything is copied.
#[tokio::test(flavor = "multi_thread")]
async fn more_pull_secrets_than_the_bound_are_refused_by_the_schema_and_the_daemon() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    create_namespace(&tenant, "team-a").await;
    let names: Vec<String> = (0..5).map(|i| format!("creds-{i}")).collect();
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "team-a");
    for name in &names {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": name},
            "type": "kubernetes.io/dockerconfigjson",
            "stringData": {".dockerconfigjson": "{\"auths\":{}}"},
        }))
        .expect("secret");
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .expect("pull secret");
    }
    let refs: Vec<Value> = names.iter().map(|name| json!({"name": name})).collect();
    let install: StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "greedy", "namespace": "team-a"},
        "spec": {"package": "examples/sample-stack:v1", "imagePullSecrets": refs},
    }))
    .expect("install");
    let installs: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    match installs.create(&PostParams::default(), &install).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 422, "{status:?}"),
        other => panic!("the schema let 5 imagePullSecrets through: {other:?}"),
    }
    // An install CRD from before the bound: the daemon refuses the install itself.
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let mut old = serde_json::to_value(crds.get("stackinstalls.stacks.stackd.dev").await.expect("crd")).expect("json");
    let pulls = &mut old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["imagePullSecrets"];
    pulls
        .as_object_mut()
        .expect("the imagePullSecrets schema")
        .remove("maxItems");
    let old: CustomResourceDefinition = serde_json::from_value(old).expect("crd");
    crds.replace("stackinstalls.stacks.stackd.dev", &PostParams::default(), &old)
        .await
        .expect("an install CRD without the bound");
    let daemon = fleet.daemon(&[]);
    installs
        .create(&PostParams::default(), &install)
        .await
        .expect("an install the old CRD admits");
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "greedy", &daemon, "TooManyPullSecrets").await;
    assert_eq!(status, "False");
    assert!(message.contains("5") && message.contains("at most 4"), "{message}");
    wait_for_event(&tenant, "team-a", "greedy", "TooManyPullSecrets", "at most 4", &daemon).await;
    let host = ListParams::default().labels("stackd.dev/parent-kind=StackInstall");
    assert!(
        fleet
            .host_jobs(TENANT)
            .list(&host)
            .await
            .expect("jobs")
            .items
            .is_empty()
    );
    assert!(
        fleet
            .host_secrets(TENANT)
            .list(&host)
            .await
            .expect("copies")
            .items
            .is_empty()
    );
}

/// Install Jobs held one of the tenant's `count/jobs.batch` each for good. A completed Job and its
/// pull-secret copies go once the package is applied and the status says so; what the user saw
/// stays (status, Events), and neither another reconcile nor a restarted daemon runs the Job again.
#[tokio::test(flavor = "multi_thread")]
async fn a_completed_install_job_goes_keeping_what_the_user_sees_and_never_runs_again() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    create_namespace(&tenant, "team-a").await;
    let pull: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": "{\"auths\":{}}"},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), "team-a")
        .create(&PostParams::default(), &pull)
        .await
        .expect("pull secret");
    let daemon = fleet.daemon(&[]);
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/sample-stack:v1", "imagePullSecrets": [{"name": "creds"}]}),
    )
    .await;
    wait_for_reason(&tenant, "team-a", "sample", &daemon, "Available").await;
    let installed_by = ListParams::default().labels("stackd.dev/parent-kind=StackInstall");
    wait_until(
        "the install Job and its pull-secret copy gone",
        SOON,
        &daemon,
        || async {
            let jobs = fleet.host_jobs(TENANT).list(&installed_by).await.ok()?.items;
            let copies = fleet.host_secrets(TENANT).list(&installed_by).await.ok()?.items;
            (jobs.is_empty() && copies.is_empty()).then_some(())
        },
    )
    .await;
    wait_for_event(
        &tenant,
        "team-a",
        "sample",
        "InstallJobRemoved",
        "team-a.sample-install",
        &daemon,
    )
    .await;
    let install = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("install");
    assert_eq!(
        condition(&install, "Ready").map(|(s, r, _)| (s, r)),
        Some(("True".into(), "Available".into()))
    );
    assert_eq!(
        condition(&install, "Synced").map(|(_, r, _)| r).as_deref(),
        Some("PackageApplied")
    );
    let job_ref = install
        .status
        .as_ref()
        .and_then(|s| s.install_job.clone())
        .expect("installJob kept");
    assert_eq!(job_ref.name, "team-a.sample-install");
    let events = events_of(&tenant, "team-a", "sample").await;
    for reason in ["InstallJobCreated", "CRDsApplied", "StackCreated"] {
        assert!(
            events.iter().any(|(r, _)| r == reason),
            "the {reason} Event is gone: {events:?}"
        );
    }

    // Another reconcile (a label is an event), then a restarted daemon: no Job runs again.
    let host_before = fleet._host.counters();
    let reconciled = daemon.reconciles_done(TENANT, "StackInstall");
    let label = json!({"metadata": {"labels": {"touched": "yes"}}});
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .patch("sample", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .expect("label");
    wait_until("the label's reconcile", SOON, &daemon, || async {
        (daemon.reconciles_done(TENANT, "StackInstall") > reconciled).then_some(())
    })
    .await;
    drop(daemon);
    let daemon = fleet.daemon(&[]);
    wait_until("the restarted daemon's reconcile", SOON, &daemon, || async {
        (daemon.reconciles_done(TENANT, "StackInstall") > 0).then_some(())
    })
    .await;
    let spent = fleet._host.counters().since(&host_before);
    assert_eq!(
        spent.get(Verb::Create, "jobs", Some(HOST_NS)),
        0,
        "the install Job ran again"
    );
    let install = Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("install");
    assert_eq!(
        condition(&install, "Ready").map(|(_, r, _)| r).as_deref(),
        Some("Available")
    );
}

/// Installs made together tie on creation time (it has a second's resolution) and are then ranked by
/// uid, not by when they came: an install admitted holds its place before the cache shows it
/// started, so no namespace starts more installs than its bound, and each pair refuses one.
#[tokio::test(flavor = "multi_thread")]
async fn installs_made_in_the_same_second_never_start_more_than_their_namespace_bound() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let jobs = crate::stacks_install::Seen::start(fleet.host_jobs(TENANT));
    let daemon = fleet.daemon(&["--namespace-max-installs", "1"]);
    let package = json!({"package": "examples/sample-stack:v1"});
    let namespaces = make_pairs_while_jobs_are_slow(&fleet, &daemon, &jobs, |namespace, second| {
        let (tenant, package) = (tenant.clone(), package.clone());
        async move {
            let name = if second { "second" } else { "first" };
            create_install(&tenant, &namespace, name, package).await;
        }
    })
    .await;
    for namespace in &namespaces {
        let api = Api::<StackInstall>::namespaced(tenant.clone(), namespace);
        let reasons = wait_until(
            &format!("both installs of {namespace} judged"),
            SOON,
            &daemon,
            || async {
                let mut reasons = Vec::new();
                for name in ["first", "second"] {
                    reasons.push(condition(&api.get(name).await.ok()?, "Ready")?.1);
                }
                let settled = ["Available", "TooManyInstalls"];
                reasons.iter().all(|r| settled.contains(&r.as_str())).then_some(reasons)
            },
        )
        .await;
        let refused = reasons.iter().filter(|r| *r == "TooManyInstalls").count();
        assert_eq!(refused, 1, "{namespace}: {reasons:?}; log:\n{}", daemon.log_text());
        let started = jobs
            .all()
            .iter()
            .filter(|job| job.name_any().starts_with(&format!("{namespace}.")))
            .count();
        assert_eq!(
            started, 1,
            "{namespace} started {started} install Jobs past a bound of 1"
        );
    }
}

/// The same race between the two kinds of one name: the StackInstall, admitted first, holds the name
/// while it makes its Job, and the ClusterStackInstall made just after is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_stack_install_and_a_cluster_stack_install_made_in_the_same_second_do_not_both_start() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let jobs = crate::stacks_install::Seen::start(fleet.host_jobs(TENANT));
    let daemon = fleet.daemon(&[]);
    let namespaces = make_pairs_while_jobs_are_slow(&fleet, &daemon, &jobs, |namespace, second| {
        let tenant = tenant.clone();
        async move {
            if !second {
                create_install(
                    &tenant,
                    &namespace,
                    "dup",
                    json!({"package": "examples/sample-stack:v1"}),
                )
                .await;
                return;
            }
            let install: ClusterStackInstall = serde_json::from_value(json!({
                "metadata": {"name": "dup", "namespace": namespace},
                "spec": {"package": "examples/cluster-stack:v1"},
            }))
            .expect("install");
            Api::<ClusterStackInstall>::namespaced(tenant, &namespace)
                .create(&PostParams::default(), &install)
                .await
                .expect("create");
        }
    })
    .await;
    for namespace in &namespaces {
        let stack_installs = Api::<StackInstall>::namespaced(tenant.clone(), namespace);
        let cluster_installs = Api::<ClusterStackInstall>::namespaced(tenant.clone(), namespace);
        let (reasons, refusal) = wait_until(
            &format!("both installs of {namespace} judged"),
            SOON,
            &daemon,
            || async {
                let stack_install = condition(&stack_installs.get("dup").await.ok()?, "Ready")?.1;
                let cluster_install = cluster_installs.get("dup").await.ok()?.status?.conditions;
                let cluster_install = cluster_install.into_iter().find(|c| c.type_ == "Ready")?;
                let reasons = [stack_install, cluster_install.reason];
                let settled = ["Available", "HostObjectConflict"];
                reasons
                    .iter()
                    .all(|r| settled.contains(&r.as_str()))
                    .then_some((reasons, cluster_install.message))
            },
        )
        .await;
        assert_eq!(
            reasons,
            ["Available".to_string(), "HostObjectConflict".to_string()],
            "{namespace}: the StackInstall was admitted first; log:\n{}",
            daemon.log_text()
        );
        // Refused for the name the StackInstall holds, and told so.
        assert!(
            refusal.contains("the StackInstall") && refusal.contains("already installs a stack named dup"),
            "{namespace}: {refusal}"
        );
    }
}

/// Makes a pair of installs (`make(namespace, second)`) in each of eight namespaces, the second in
/// the window the admission ledger guards: the first has been admitted and its install Job made, but
/// the daemon hears of the Job's creation only 300 ms later, so the first's status (and the cache)
/// does not show it started yet. The second is made once the host has the first's Job, not after a
/// fixed pause, so under load the second never comes before the first was judged.
async fn make_pairs_while_jobs_are_slow<F, Fut>(
    fleet: &StackFleet,
    daemon: &Daemon,
    jobs: &crate::stacks_install::Seen<Job>,
    make: F,
) -> Vec<String>
where
    F: Fn(String, bool) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // The controllers are running before the pairs come.
    let tenant = fleet.tenant(TENANT);
    create_install(&tenant, "warm", "up", json!({"package": "examples/sample-stack:v1"})).await;
    wait_for_reason(&tenant, "warm", "up", daemon, "Available").await;
    fleet._host.faults().add_answer_latency(
        RequestMatch::any().verb(Verb::Create).resource("jobs"),
        Duration::from_millis(300),
    );
    let namespaces: Vec<String> = (0..8).map(|i| format!("pair-{i}")).collect();
    for namespace in &namespaces {
        create_namespace(&tenant, namespace).await;
        make(namespace.clone(), false).await;
        let prefix = format!("{namespace}.");
        wait_until(&format!("a Job of {namespace}"), SOON, daemon, || async {
            jobs.all()
                .iter()
                .any(|job| job.name_any().starts_with(&prefix))
                .then_some(())
        })
        .await;
        make(namespace.clone(), true).await;
    }
    fleet._host.faults().clear();
    namespaces
}

/// One namespace may hold only so many installs (`--namespace-max-installs`): its newest past the
/// bound is refused and makes nothing on the host, another namespace is unaffected, and the refused
/// one goes on once an older one is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_past_its_install_bound_gets_its_newest_refused_and_others_are_unaffected() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let jobs = crate::stacks_install::Seen::start(fleet.host_jobs(TENANT));
    let daemon = fleet.daemon(&["--namespace-max-installs", "2"]);
    for name in ["one", "two"] {
        create_install(&tenant, "team-a", name, json!({"package": "examples/sample-stack:v1"})).await;
        wait_for_reason(&tenant, "team-a", name, &daemon, "Available").await;
    }
    create_install(
        &tenant,
        "team-a",
        "three",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "three", &daemon, "TooManyInstalls").await;
    assert_eq!(status, "False");
    assert!(
        message.contains("namespace team-a") && message.contains("--namespace-max-installs 2"),
        "{message}"
    );
    wait_for_event(
        &tenant,
        "team-a",
        "three",
        "TooManyInstalls",
        "--namespace-max-installs",
        &daemon,
    )
    .await;
    create_install(
        &tenant,
        "team-b",
        "other",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    wait_for_reason(&tenant, "team-b", "other", &daemon, "Available").await;
    assert!(
        jobs.all().iter().all(|job| job.name_any() != "team-a.three-install"),
        "the refused install made its Job"
    );
    let host = ListParams::default().labels("stackd.dev/parent-namespace=team-a,stackd.dev/parent-name=three");
    assert!(
        fleet
            .host_secrets(TENANT)
            .list(&host)
            .await
            .expect("secrets")
            .items
            .is_empty()
    );
    for (namespace, name) in [("team-a", "one"), ("team-a", "two")] {
        let install = Api::<StackInstall>::namespaced(tenant.clone(), namespace)
            .get(name)
            .await
            .expect("install");
        assert_eq!(
            condition(&install, "Ready").map(|(_, r, _)| r).as_deref(),
            Some("Available")
        );
    }
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .delete("one", &DeleteParams::default())
        .await
        .expect("delete the oldest");
    wait_for_reason(&tenant, "team-a", "three", &daemon, "Available").await;
}

/// The install pod is found by the Job's `controller-uid` label, which anyone who may create pods in
/// the host namespace can put on a pod of their own: only a pod the Job controls is read.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_labelled_as_an_install_pod_that_the_job_does_not_control_is_not_read() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let daemon = fleet.daemon(&[]);
    // The sample package, unpacked slowly: room to plant a pod beside the Job's.
    create_install(
        &tenant,
        "team-a",
        "sample",
        json!({"package": "examples/slow-stack:v1"}),
    )
    .await;
    let jobs = fleet.host_jobs(TENANT);
    let job = wait_until("the install Job", SOON, &daemon, || async {
        jobs.get_opt("team-a.sample-install").await.ok().flatten()
    })
    .await;
    // A forged install stream: a valid trailer over a Stack of the forger's choosing.
    let sample = stackd::stacks::unpack::unpack(&stackd::stacks::unpack::UnpackOptions {
        content_dir: fleet.dir.path().join("packages/sample-stack/.registry"),
        permission_scope: stackd::api::stacks::PermissionScope::Namespaced,
        package_image: Some("examples/slow-stack:v1".into()),
        templating_controller_image: stackd::stacks::unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
        stackd_image: stackd::stacks::default_stackd_image(),
    })
    .expect("the sample unpacks");
    let mut forged = sample.clone();
    forged.stack.spec.title = Some("Forged".into());
    let forged_stream = stackd::stacks::stream::encode(&forged).expect("encode");
    let pods: Api<Pod> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let uid = job.uid().expect("uid");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "zzz-forged", "labels": {"controller-uid": uid, "job-name": "team-a.sample-install"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "unpack", "image": "stackd:test"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod).await.expect("the forged pod");
    let succeeded = json!({"status": {"phase": "Succeeded"}});
    pods.patch_status("zzz-forged", &PatchParams::default(), &Patch::Merge(&succeeded))
        .await
        .expect("the forged pod succeeded");
    fleet._host.set_pod_log(HOST_NS, "zzz-forged", "unpack", &forged_stream);
    wait_for_reason(&tenant, "team-a", "sample", &daemon, "Available").await;
    let stack = Api::<Stack>::namespaced(tenant.clone(), "team-a")
        .get("sample")
        .await
        .expect("the Stack");
    assert_eq!(
        stack.spec.title, sample.stack.spec.title,
        "the forged pod's output was applied"
    );
}

/// A shared CRD's creator role passes to the install still using it only within its package: an
/// install that joined from another namespace cannot wait for the creator to leave and then rewrite
/// the CRD (or take its API group) by pointing itself at another package; within the package it may
/// upgrade it.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_cannot_take_over_a_shared_crd_its_creator_left() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    const GADGETS: &str = "gadgets.shared.example.org";
    let v1 = crd("gadgets", "shared.example.org", "Gadget");
    let mut v2 = v1.clone();
    v2["spec"]["versions"]
        .as_array_mut()
        .expect("versions")
        .push(json!({"name": "v2", "served": true, "storage": false,
            "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}));
    let mut rewritten = v2.clone();
    rewritten["spec"]["versions"][1]["name"] = json!("v9");
    write_package(&fleet, "shared-stack", &[v1], "Namespaced");
    write_package(&fleet, "takeover-stack", &[rewritten], "Namespaced");
    let daemon = fleet.daemon(&[]);
    for namespace in ["team-a", "team-b"] {
        create_install(
            &tenant,
            namespace,
            "gadgets",
            json!({"package": "examples/shared-stack:v1"}),
        )
        .await;
        wait_for_reason(&tenant, namespace, "gadgets", &daemon, "Available").await;
    }
    // The creator leaves; team-b's Stack still uses the CRD, so it stays.
    Api::<StackInstall>::namespaced(tenant.clone(), "team-a")
        .delete("gadgets", &DeleteParams::default())
        .await
        .expect("uninstall the creator");
    let installs_a: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    wait_until("the creator gone", SOON, &daemon, || async {
        installs_a.get_opt("gadgets").await.ok()?.is_none().then_some(())
    })
    .await;
    let shared = crd_on(&tenant, GADGETS).await.expect("the CRD team-b uses");
    let installs_b: Api<StackInstall> = Api::namespaced(tenant.clone(), "team-b");
    let switch = |package: &'static str| {
        let installs_b = installs_b.clone();
        async move {
            let patch = json!({"spec": {"package": package}});
            installs_b
                .patch("gadgets", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("switch package");
        }
    };
    switch("examples/takeover-stack:v1").await;
    let (status, _, message) = wait_for_reason(&tenant, "team-b", "gadgets", &daemon, "CRDConflict").await;
    assert_eq!(status, "False");
    assert!(
        message.contains(GADGETS) && message.contains("shared-stack"),
        "{message}"
    );
    wait_for_event(&tenant, "team-b", "gadgets", "CRDConflict", GADGETS, &daemon).await;
    let after = crd_on(&tenant, GADGETS).await.expect("the CRD");
    assert_eq!(
        after.resource_version(),
        shared.resource_version(),
        "the CRD was rewritten"
    );

    // Within its package, the last user takes the CRD on: its upgrade goes through.
    write_package(&fleet, "shared-stack", &[v2], "Namespaced");
    switch("examples/shared-stack:v2").await;
    wait_until("team-b's upgrade serves v2", SOON, &daemon, || async {
        let crd = crd_on(&tenant, GADGETS).await?;
        let served: Vec<String> = crd.spec.versions.iter().map(|v| v.name.clone()).collect();
        (served == ["v1", "v2"]).then_some(crd)
    })
    .await;
    let crd = crd_on(&tenant, GADGETS).await.expect("the CRD");
    assert_eq!(
        crd.annotations()
            .get("stacks.stackd.dev/installed-by")
            .map(String::as_str),
        Some("StackInstall/team-b/gadgets")
    );
    wait_for_reason(&tenant, "team-b", "gadgets", &daemon, "Available").await;
}

/// `--allowed-registries` bounds where a package, a stack's controller images and a pool's
/// installer come from; each refused image is named, and nothing is made for it.
#[tokio::test(flavor = "multi_thread")]
async fn packages_and_controller_images_from_other_registries_are_refused() {
    let fleet = StackFleet::start(&[TENANT]).await;
    let tenant = fleet.tenant(TENANT);
    let sample = fleet.dir.path().join("packages/sample-stack/.registry");
    let foreign = fleet.dir.path().join("packages/foreign-controller/.registry");
    std::fs::create_dir_all(foreign.join("resources")).expect("package dir");
    for file in ["app.yaml", "resources/widget.crd.yaml"] {
        std::fs::copy(sample.join(file), foreign.join(file)).expect("copy");
    }
    let install = std::fs::read_to_string(sample.join("install.yaml")).expect("install.yaml");
    let pinned = install.replace(
        "      - name: controller\n",
        "      - name: controller\n        image: evil.example.org/controller:1\n",
    );
    assert_ne!(pinned, install, "the sample install.yaml changed shape");
    std::fs::write(foreign.join("install.yaml"), pinned).expect("install.yaml");
    let jobs = crate::stacks_install::Seen::start(fleet.host_jobs(TENANT));
    let daemon = fleet.daemon(&["--allowed-registries", "registry.example.com"]);
    let allowed = |package: &str| json!({"package": package, "source": "registry.example.com"});
    create_install(
        &tenant,
        "team-a",
        "elsewhere",
        allowed("evil.example.org/stacks/sample-stack:v1"),
    )
    .await;
    create_install(&tenant, "team-a", "foreign", allowed("examples/foreign-controller:v1")).await;
    create_install(&tenant, "team-a", "sample", allowed("examples/sample-stack:v1")).await;

    let (_, _, message) = wait_for_reason(&tenant, "team-a", "elsewhere", &daemon, "RegistryNotAllowed").await;
    assert!(
        message.contains("evil.example.org/stacks/sample-stack:v1") && message.contains("registry.example.com"),
        "{message}"
    );
    wait_for_event(
        &tenant,
        "team-a",
        "elsewhere",
        "RegistryNotAllowed",
        "evil.example.org",
        &daemon,
    )
    .await;
    let (_, _, message) = wait_for_reason(&tenant, "team-a", "foreign", &daemon, "RegistryNotAllowed").await;
    assert!(
        message.contains("container \"controller\"") && message.contains("evil.example.org/controller:1"),
        "{message}"
    );
    wait_for_reason(&tenant, "team-a", "sample", &daemon, "Available").await;
    let stacks: Vec<String> = stacks_on(&tenant).await.iter().map(|s| s.name_any()).collect();
    assert_eq!(stacks, ["sample"], "a refused install created a Stack");
    assert!(
        jobs.all()
            .iter()
            .all(|job| job.name_any() != "team-a.elsewhere-install"),
        "a package from another registry ran"
    );
}

/// A pool whose installer comes from a registry the host does not allow gets no clusters.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_installer_from_another_registry_is_refused() {
    use crate::pools::{NS, create_pool, daemon, events, pool_json, setup};
    let (fleet, tenant) = setup().await;
    let daemon = daemon(&fleet, &["--allowed-registries", "registry.example.com"]);
    create_pool(&tenant, pool_json("refused", 1, None)).await;
    let pools: Api<stackd::api::pools::ClusterPool> = Api::namespaced(tenant.clone(), NS);
    let refused = wait_until("the pool refused", SOON, &daemon, || async {
        let pool = pools.get("refused").await.ok()?;
        let capacity = pool
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "CapacityAvailable")?;
        (capacity.reason == "RegistryNotAllowed").then_some(capacity)
    })
    .await;
    assert_eq!(refused.status, "False");
    assert!(
        refused.message.contains(crate::pools::INSTALLER) && refused.message.contains("registry.example.com"),
        "{}",
        refused.message
    );
    wait_until("the refusal's Event", SOON, &daemon, || async {
        let events = events(&tenant, NS, "refused").await;
        events
            .iter()
            .any(|(reason, _)| reason == "RegistryNotAllowed")
            .then_some(())
    })
    .await;
    let clusters = Api::<stackd::api::pools::ClusterDeployment>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .expect("clusters");
    assert!(clusters.items.is_empty(), "a refused pool made clusters");
    let host_jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    assert!(
        host_jobs
            .list(&ListParams::default())
            .await
            .expect("jobs")
            .items
            .is_empty()
    );
}
