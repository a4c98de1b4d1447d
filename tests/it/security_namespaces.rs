//! One namespace holds only its own work (DESIGN.md §10, issue 45): a tenant namespace over its
//! share of the tenant's memory budget has its own objects left out, never its tenant suspended
//! (attack 3); a stack whose controller asks for more than its namespace's share of the tenant's
//! host quota is refused before its Deployment is made, and another namespace still installs
//! (attack 5). Each attack runs through the daemon binary against embedded servers.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::pools::POOL_NAMESPACE_LABEL;
use stackd::api::pools::{ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};
use stackd::api::stacks::Stack;
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use stackd::embedded::samples::{SampleImages, register_sample_runners};
use stackd::host::quota_share::SHARE_NAMESPACE_LABEL;

use super::security_pods::write_package;
use super::stacks_install::{StackFleet, create_install, events_of, wait_for_reason};
use super::tenant_objects::{
    HostKubectl, SECRETS_NAMESPACE, condition, install_tenant_crd, registration, wait_condition,
};
use crate::harness::{Fleet, install_crds, until, wait_until};
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

/// A pool of one in `namespace` from the CDC `cdc`.
async fn create_pool(tenant: &Client, namespace: &str, cdc: &str) -> Api<ClusterPool> {
    let mut pool = pool_json("p", 1, Some(&[cdc]));
    pool["metadata"]["namespace"] = json!(namespace);
    let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
    let pools: Api<ClusterPool> = Api::namespaced(tenant.clone(), namespace);
    pools.create(&PostParams::default(), &pool).await.expect("create pool");
    pools
}

/// The pool's `Held` condition as (status, reason, message).
async fn pool_held(pools: &Api<ClusterPool>) -> Option<(String, String, String)> {
    let pool = pools.get_opt("p").await.ok().flatten()?;
    let held = pool.status?.conditions.into_iter().find(|c| c.type_ == "Held")?;
    Some((held.status, held.reason, held.message))
}

/// [`create_pool`], then waits until it is filled.
async fn fill_pool(tenant: &Client, namespace: &str, cdc: &str, daemon: &crate::harness::Daemon) {
    let pools = create_pool(tenant, namespace, cdc).await;
    wait_filled(&pools, namespace, daemon).await;
}

async fn wait_filled(pools: &Api<ClusterPool>, namespace: &str, daemon: &crate::harness::Daemon) {
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
/// 1 MiB share, and would take the tenant past its 4 MiB budget (which suspended the whole tenant
/// before namespaces had shares). Only the attacker's objects past the share are left out
/// (each with a `NamespaceOverBudget` Event naming the flag): the tenant stays Up on its Tenant
/// object and is never suspended, a pool in namespace `victim2` fills at once, and once the
/// attacker's namespace shrinks, what was left out is read again and the namespace is served. A
/// pool of the attacker's namespace made meanwhile says it is held, and why, in a `Held` condition
/// and an Event, and is served the moment the namespace has room (no poll: at its release).
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

    // Some 4.6 MiB in all: past the tenant's budget too, as the attack was.
    const FLOOD: usize = 14;
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
    let pools = create_pool(&acme, ATTACKER, &kept).await;
    let held = wait_until("the attacker's pool is Held", WITHIN, &daemon, || async {
        pool_held(&pools).await.filter(|held| held.0 == "True")
    })
    .await;
    assert_eq!(held.1, "NamespaceOverBudget", "{held:?}");
    assert!(
        held.2.contains("namespace attacker") && held.2.contains("--namespace-memory-budget"),
        "names the namespace and the budget: {held:?}"
    );
    let pool_events = events(&acme, ATTACKER, "p").await;
    assert!(
        pool_events
            .iter()
            .any(|(reason, note)| reason == "NamespaceOverBudget" && note.contains("Delete or shrink")),
        "{pool_events:?}"
    );
    for name in flood.iter().filter(|name| **name != kept) {
        cdcs(&acme, ATTACKER)
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    wait_filled(&pools, ATTACKER, &daemon).await;
    until("the Held condition is gone", WITHIN, &daemon, || async {
        pool_held(&pools).await.is_none()
    })
    .await;
    assert!(
        cdcs(&acme, ATTACKER).get_opt(&kept).await.expect("get").is_some(),
        "nothing of the attacker's was deleted by stackd"
    );
}

/// Objects are counted per namespace as well as their bytes: a namespace with as many objects as
/// `--namespace-max-objects` has the next one left out (an Event naming the flag) and its pool
/// that reads it held, while another namespace of the tenant is served; once some of its objects
/// are deleted, what was left out is read and the pool fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_with_as_many_objects_as_it_may_holds_only_its_own_objects() {
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
    let registration = registration("acme", SECRETS_NAMESPACE, "vc-acme", "config", &kubeconfig);
    kubectl.apply(&registration).await;
    let daemon = fleet.daemon(&["--namespace-max-objects", "5", "--sweep-interval", "1h"]);
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;

    // The pool (one object) waits for its customization, made last: four more fill the namespace.
    let pools = create_pool(&acme, ATTACKER, "last").await;
    for name in ["c1", "c2", "c3", "c4", "last"] {
        create_cdc(&acme, ATTACKER, name, 1).await;
    }
    let held = wait_until("the attacker's pool is Held", WITHIN, &daemon, || async {
        pool_held(&pools).await.filter(|held| held.0 == "True")
    })
    .await;
    assert_eq!(held.1, "NamespaceOverBudget", "{held:?}");
    assert!(held.2.contains("--namespace-max-objects 5"), "{held:?}");
    let left_out = events(&acme, ATTACKER, "last").await;
    assert!(
        left_out
            .iter()
            .any(|(reason, note)| reason == "NamespaceOverBudget" && note.contains("--namespace-max-objects")),
        "{left_out:?}"
    );
    create_cdc(&acme, VICTIM, "small", 1).await;
    fill_pool(&acme, VICTIM, "small", &daemon).await;

    for name in ["c1", "c2", "c3"] {
        cdcs(&acme, ATTACKER)
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    wait_filled(&pools, ATTACKER, &daemon).await;
}

/// The Ready condition of Stack `namespace/name` as (status, reason, message).
async fn stack_ready(tenant: &Client, namespace: &str, name: &str) -> Option<(String, String, String)> {
    let stack = Api::<Stack>::namespaced(tenant.clone(), namespace)
        .get_opt(name)
        .await
        .ok()??;
    let status = serde_json::to_value(&stack).ok()?["status"].clone();
    let conditions = status["conditions"].as_array()?.clone();
    let ready: &Value = conditions.iter().find(|c| c["type"] == "Ready")?;
    let text = |key: &str| ready[key].as_str().unwrap_or_default().to_string();
    Some((text("status"), text("reason"), text("message")))
}

/// Attack 5: a stack whose controller asks `requests.cpu: 7900m`, in a tenant whose host quota has
/// 8 CPUs, is refused before its Deployment is made (`NamespaceQuotaShareExceeded`, naming the
/// share and the flag, with an Event); an install in another namespace of the tenant reaches Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_asking_for_more_than_its_namespace_share_of_the_host_quota_is_refused() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    write_greedy_package(&fleet, "greedy", "greedy.example.org", "7900m");
    create_install(&tenant, ATTACKER, "greedy", json!({"package": "examples/greedy:v1"})).await;
    let message = wait_until("the greedy stack refused for its share", WITHIN, &daemon, || async {
        stack_ready(&tenant, ATTACKER, "greedy")
            .await
            .filter(|(_, reason, _)| reason == "NamespaceQuotaShareExceeded")
            .map(|(status, _, message)| (status, message))
    })
    .await;
    assert_eq!(message.0, "False");
    for needle in ["7900m", "--namespace-max-cpu", "4 of cpu", ATTACKER] {
        assert!(message.1.contains(needle), "{needle:?} not in {:?}", message.1);
    }
    until(
        "a NamespaceQuotaShareExceeded Event on the stack",
        WITHIN,
        &daemon,
        || async {
            events(&tenant, ATTACKER, "greedy")
                .await
                .iter()
                .any(|(reason, note)| reason == "NamespaceQuotaShareExceeded" && note.contains("--namespace-max-cpu"))
        },
    )
    .await;
    let deployments: Api<Deployment> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    let names: Vec<String> = deployments
        .list(&ListParams::default())
        .await
        .expect("deployments")
        .items
        .iter()
        .map(|d| d.name_any())
        .collect();
    assert!(!names.iter().any(|n| n.contains("greedy")), "{names:?}");

    create_install(
        &tenant,
        VICTIM,
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, VICTIM, "sample", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
}

/// Writes package `name`: the sample stack in API group `group`, its controller requesting `cpu`.
fn write_greedy_package(fleet: &StackFleet, name: &str, group: &str, cpu: &str) {
    write_package(fleet, name, |pod| {
        pod["containers"][0]["resources"] = json!({"requests": {"cpu": cpu}});
    });
    // Its own CRD group, so that it and the sample in another namespace install side by side.
    let crd = fleet
        .dir
        .path()
        .join(format!("packages/{name}/.registry/resources/widget.crd.yaml"));
    let renamed = std::fs::read_to_string(&crd)
        .expect("crd")
        .replace("samples.example.org", group);
    std::fs::write(&crd, renamed).expect("write crd");
}

/// Attack 5 through an install: a stack whose controller requests 3950m of its namespace's 4 CPUs
/// runs; the next install in that namespace has no share left for its install Job (100m by the
/// LimitRange default) and waits (`NamespaceQuotaShareExceeded`, with a Warning Event), creating
/// no Job; an install in another namespace reaches Ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_install_job_past_its_namespace_share_waits_and_another_namespace_installs() {
    let fleet = StackFleet::start(&["acme"]).await;
    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    write_greedy_package(&fleet, "hungry", "hungry.example.org", "3950m");
    create_install(&tenant, ATTACKER, "hungry", json!({"package": "examples/hungry:v1"})).await;
    let (status, _, message) = wait_for_reason(&tenant, ATTACKER, "hungry", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");

    create_install(
        &tenant,
        ATTACKER,
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (status, _, message) =
        wait_for_reason(&tenant, ATTACKER, "sample", &daemon, "NamespaceQuotaShareExceeded").await;
    assert_eq!(status, "False");
    for needle in ["install Job", "100m", "3950m", "--namespace-max-cpu"] {
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
    until(
        "a NamespaceQuotaShareExceeded Event on the install",
        WITHIN,
        &daemon,
        || async {
            events_of(&tenant, ATTACKER, "sample")
                .await
                .iter()
                .any(|(reason, _)| reason == "NamespaceQuotaShareExceeded")
        },
    )
    .await;
    let jobs = fleet
        .host_jobs("acme")
        .list(&ListParams::default())
        .await
        .expect("jobs");
    assert!(
        !jobs
            .items
            .iter()
            .any(|job| job.name_any().starts_with("attacker.sample")),
        "no install Job was made for it"
    );

    create_install(
        &tenant,
        VICTIM,
        "sample",
        json!({"package": "examples/sample-stack:v1"}),
    )
    .await;
    let (status, _, message) = wait_for_reason(&tenant, VICTIM, "sample", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
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

/// Attack 5 through a pool: an installer Job of a pool of namespace `attacker` that runs (100m by
/// the LimitRange default) leaves the namespace no share (`--namespace-max-cpu 150m`) for a second,
/// though each cluster has a namespace of its own (made by stackd, charged to its pool's): that
/// cluster waits (`NamespaceQuotaShareExceeded` on its ClusterDeployment, no Job made for it), while
/// a pool in namespace `victim2` of the same tenant gets its installer Job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_installer_past_its_namespace_share_waits_and_another_namespace_provisions() {
    const SLOW: &str = "quay.io/example/slow-installer:1";
    let fleet = Fleet::start(&["acme"]).await;
    let runners = fleet.host().runners();
    register_sample_runners(&runners, &SampleImages::new("stackd:dev"));
    runners.register(ImageMatch::Exact(SLOW.into()), |_: &JobContext| {
        JobOutcome::success("").after(Duration::from_secs(3600))
    });
    let acme = fleet.tenants[0].1.as_ref().expect("tenant server").client().await;
    install_crds(&acme).await;
    for (namespace, size) in [(ATTACKER, 2), (VICTIM, 1)] {
        pool_namespace(&acme, namespace).await;
        let mut pool = pool_json("p", size, None);
        pool["metadata"]["namespace"] = json!(namespace);
        pool["spec"]["installerImage"] = json!(SLOW);
        let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
        Api::<ClusterPool>::namespaced(acme.clone(), namespace)
            .create(&PostParams::default(), &pool)
            .await
            .expect("create pool");
    }
    let daemon = fleet.daemon(&["--namespace-max-cpu", "150m", "--sweep-interval", "1h"]);

    let cds: Api<ClusterDeployment> = Api::all(acme.clone());
    let attackers = ListParams::default().labels(&format!("{POOL_NAMESPACE_LABEL}={ATTACKER}"));
    let message = wait_until(
        "a cluster of the attacker's waits for its share",
        WITHIN,
        &daemon,
        || async {
            let listed = cds.list(&attackers).await.ok()?;
            let conditions = listed
                .items
                .into_iter()
                .flat_map(|cd| cd.status.into_iter().flat_map(|s| s.conditions));
            conditions
                .into_iter()
                .find(|c| c.reason == "NamespaceQuotaShareExceeded")
                .map(|c| c.message)
        },
    )
    .await;
    for needle in ["installer Job", "100m", "--namespace-max-cpu"] {
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
    let host_jobs: Api<Job> = Api::namespaced(fleet.host().client().await, "tenant-acme-controllers");
    let jobs_of = |namespace: &'static str| {
        let host_jobs = host_jobs.clone();
        async move {
            let jobs = host_jobs
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            jobs.iter()
                .filter(|job| job.labels().get(SHARE_NAMESPACE_LABEL).map(String::as_str) == Some(namespace))
                .count()
        }
    };
    until("the other namespace's installer Job", WITHIN, &daemon, || async {
        jobs_of(VICTIM).await == 1
    })
    .await;
    assert_eq!(jobs_of(ATTACKER).await, 1, "no Job for the cluster past the share");
}

/// A pool's clusters each have a namespace of their own, but count against their pool's namespace:
/// with `--namespace-max-clusters 2`, a pool of size 3 makes two and says why it makes no third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_has_at_most_its_clusters_however_large_its_pools() {
    let (fleet, tenant) = crate::pools::setup().await;
    crate::pools::create_pool(&tenant, pool_json("p", 3, None)).await;
    let daemon = crate::pools::daemon(&fleet, &["--namespace-max-clusters", "2"]);
    let message = wait_until("the pool says its namespace is full", WITHIN, &daemon, || async {
        let pool = crate::pools::pool(&tenant, "p").await;
        crate::pools::pool_condition(&pool, "CapacityAvailable")
            .filter(|(status, reason, _)| status == "False" && reason == "NamespaceMaxClusters")
            .map(|(_, _, message)| message)
    })
    .await;
    assert!(message.contains("--namespace-max-clusters"), "{message}");
    assert_eq!(crate::pools::cds(&tenant, "p").await.len(), 2);
}
