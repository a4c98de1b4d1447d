//! The tenant is untrusted (DESIGN.md §8, issue 16): a user who may write StackInstalls in one
//! namespace (and, as a namespace admin, Stacks) and who chooses the package tries to reach beyond
//! what they were given through stacks. Each attack is performed through the daemon binary and
//! refused with a condition and an Event naming what was refused, and leaves nothing behind.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::stacks::{ClusterStackInstall, Stack, StackInstall};

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
    let job = fleet
        .host_jobs(TENANT)
        .get("team-a.dup-install")
        .await
        .expect("the StackInstall's Job");
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
    let job_after = fleet.host_jobs(TENANT).get("team-a.dup-install").await.expect("job");
    assert_eq!(job_after.uid(), job.uid(), "the StackInstall's Job was replaced");
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
        message.contains("\"kyverno.io\", whose CRDs no stack installed"),
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
