//! One namespace holds only its own work (DESIGN.md §10, issue 45): a tenant namespace over its
//! share of the tenant's memory budget has its own objects left out, never its tenant suspended
//! (attack 3). Each attack runs through the daemon binary against embedded servers.

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use stackd::api::pools::{ClusterDeploymentCustomization, ClusterPool};
use stackd::embedded::samples::{SampleImages, register_sample_runners};

use super::tenant_objects::{
    HostKubectl, SECRETS_NAMESPACE, condition, install_tenant_crd, registration, wait_condition,
};
use crate::harness::{Fleet, install_crds, until};
use crate::pools::{WITHIN, events, pool_json};

const ATTACKER: &str = "attacker";
const VICTIM: &str = "victim2";

/// Namespace `namespace` with the Secrets a pool there installs from.
async fn pool_namespace(tenant: &Client, namespace: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("ns");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), namespace);
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml":
            "apiVersion: v1\nplatform:\n  vsphere:\n    network: VM Network\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
}

fn cdcs(tenant: &Client, namespace: &str) -> Api<ClusterDeploymentCustomization> {
    Api::namespaced(tenant.clone(), namespace)
}

async fn create_cdc(tenant: &Client, namespace: &str, name: &str, elements: usize) {
    let cdc: ClusterDeploymentCustomization = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"installConfigPatches": [
            {"op": "replace", "path": "/metadata/name", "value": name},
            {"op": "add", "path": "/bulk", "value": (0..elements).map(|i| i % 10).collect::<Vec<_>>()},
        ]},
    }))
    .expect("cdc");
    cdcs(tenant, namespace)
        .create(&PostParams::default(), &cdc)
        .await
        .expect("create cdc");
}

/// A pool of one in `namespace` from the CDC `cdc`; waits until it is filled.
async fn fill_pool(tenant: &Client, namespace: &str, cdc: &str, daemon: &crate::harness::Daemon) {
    let mut pool = pool_json("p", 1, Some(&[cdc]));
    pool["metadata"]["namespace"] = json!(namespace);
    let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), namespace);
    pools.create(&PostParams::default(), &pool).await.expect("create pool");
    let what = format!("the pool in {namespace} is filled");
    until(&what, WITHIN, daemon, || async {
        let pool = pools.get_opt("p").await.ok().flatten();
        pool.and_then(|p| p.status).is_some_and(|s| s.ready == 1)
    })
    .await;
}

async fn over_budget(tenant: &Client, name: &str) -> bool {
    events(tenant, ATTACKER, name)
        .await
        .iter()
        .any(|(reason, note)| reason == "NamespaceOverBudget" && note.contains("--namespace-memory-budget"))
}

/// Attack 3 at CI size: CDCs of some 330 KiB decoded each in namespace `attacker` take it past its
/// 1 MiB share of a 4 MiB tenant budget. Only the attacker's objects past the share are left out
/// (each with a `NamespaceOverBudget` Event naming the flag): the tenant stays Up on its Tenant
/// object and is never suspended, a pool in namespace `victim2` fills at once, and once the
/// attacker's namespace shrinks, what was left out is read again and the namespace is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_over_its_memory_share_holds_only_its_own_objects() {
    let mut fleet = Fleet::start(&[]).await;
    register_sample_runners(&fleet.host().runners(), &SampleImages::new("stackd:dev"));
    let kubeconfig = fleet.add_tenant_server("acme").await;
    let acme = fleet.tenant_server("acme").client().await;
    install_crds(&acme).await;
    for namespace in [ATTACKER, VICTIM] {
        pool_namespace(&acme, namespace).await;
    }
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "vc-acme",
            "config",
            &kubeconfig,
        ))
        .await;
    let daemon = fleet.daemon(&[
        "--tenant-memory-budget",
        "4Mi",
        "--namespace-memory-budget",
        "1Mi",
        "--lease-min-age",
        "2s",
        "--sweep-interval",
        "1h",
    ]);
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;

    const FLOOD: usize = 6;
    let flood: Vec<String> = (0..FLOOD).map(|i| format!("big-{i}")).collect();
    for name in &flood {
        create_cdc(&acme, ATTACKER, name, 8 * 1024).await;
    }
    until(
        "a NamespaceOverBudget Event in the attacker's namespace",
        WITHIN,
        &daemon,
        || async {
            for name in &flood {
                if over_budget(&acme, name).await {
                    return true;
                }
            }
            false
        },
    )
    .await;

    // The tenant's other namespace is served at once, and the tenant was never suspended.
    create_cdc(&acme, VICTIM, "small", 1).await;
    fill_pool(&acme, VICTIM, "small", &daemon).await;
    assert_eq!(
        condition(&fleet, "acme", "Ready").await.map(|c| c.1),
        Some("Up".to_string()),
        "the tenant stays Up"
    );
    let log = daemon.log_text();
    assert!(!log.contains("tenant suspended"), "{log}");
    let metrics = daemon.http_get("/metrics").unwrap_or_default();
    assert!(
        !metrics.contains("stackd_tenant_suspended{tenant=\"acme\""),
        "{metrics}"
    );

    // The attacker deletes what was cached and all but one of what was left out: the last is read
    // again (a pool made from it fills), and the namespace is served.
    let mut refused = Vec::new();
    for name in &flood {
        if over_budget(&acme, name).await {
            refused.push(name.clone());
        }
    }
    let kept = refused.pop().expect("one left out");
    for name in flood.iter().filter(|name| **name != kept) {
        cdcs(&acme, ATTACKER)
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    fill_pool(&acme, ATTACKER, &kept, &daemon).await;
    assert!(
        cdcs(&acme, ATTACKER).get_opt(&kept).await.expect("get").is_some(),
        "nothing of the attacker's was deleted by stackd"
    );
}

/// What no namespace owns, grown past a tenant budget of 2 MiB: `count` tenant Namespaces stackd
/// caches (labelled for a pool), each with an annotation of 200 KiB. Returns their names.
pub(crate) async fn flood_unowned(tenant: &Client, count: usize) -> Vec<String> {
    let api = Api::<Namespace>::all(tenant.clone());
    let mut names = Vec::new();
    for i in 0..count {
        let name = format!("unowned-{i}");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {
            "name": name,
            "labels": {stackd::api::pools::POOL_NAME_LABEL: "none"},
            "annotations": {"bulk": "x".repeat(200 * 1024)},
        }}))
        .expect("namespace");
        api.create(&PostParams::default(), &ns).await.expect("namespace");
        names.push(name);
    }
    names
}

/// Deletes the Namespaces [`flood_unowned`] made.
pub(crate) async fn remove_unowned(tenant: &Client, names: &[String]) {
    let api = Api::<Namespace>::all(tenant.clone());
    for name in names {
        api.delete(name, &DeleteParams::default())
            .await
            .expect("delete namespace");
    }
}
