//! Cluster pools with an inventory (DESIGN.md §4.3 items 1–11, issue 8), through the daemon binary
//! against embedded host and tenant servers; the host's JobRunner plays the installer.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::pools::{
    ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, InventoryEntryState,
};
use stackd::embedded::controller_manager::{ImageMatch, JobContext, JobOutcome};
use stackd::embedded::samples::{SampleImages, create_cluster, register_sample_runners};
use stackd::runtime::status_writer::apply_status;

use crate::harness::{Daemon, Fleet, Reconciles, settled, until};

pub(crate) const NS: &str = "team";
const HOST_NS: &str = "tenant-acme-controllers";
pub(crate) const INSTALLER: &str = "quay.io/example/installer:4.14";
pub(crate) const WITHIN: Duration = Duration::from_secs(20);

type Cdc = ClusterDeploymentCustomization;

/// A host, tenant `acme` with the stackd CRDs, the pool's Secrets in namespace `team`.
pub(crate) async fn setup() -> (Fleet, Client) {
    let fleet = Fleet::start(&["acme"]).await;
    register_sample_runners(&fleet.host().runners(), &SampleImages::new("stackd:dev"));
    let tenant = fleet.tenants[0].1.as_ref().expect("tenant server").client().await;
    prepare(&tenant).await;
    (fleet, tenant)
}

/// The stackd CRDs, namespace `team` and the Secrets a pool there installs from.
pub(crate) async fn prepare(tenant: &Client) {
    crate::harness::install_crds(tenant).await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("ns");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), NS);
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

pub(crate) fn daemon(fleet: &Fleet, extra: &[&str]) -> Daemon {
    let mut args = vec!["--lease-min-age", "2s", "--sweep-interval", "1h"];
    args.extend_from_slice(extra);
    fleet.daemon(&args)
}

pub(crate) fn pool_json(name: &str, size: i32, inventory: Option<&[&str]>) -> Value {
    let mut pool = json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "size": size,
            "baseDomain": "example.com",
            "installerImage": INSTALLER,
            "installConfigSecretTemplateRef": {"name": "template"},
            "pullSecretRef": {"name": "pull"},
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
        },
    });
    if let Some(entries) = inventory {
        pool["spec"]["inventory"] = json!(entries.iter().map(|n| json!({"name": n})).collect::<Vec<_>>());
    }
    pool
}

pub(crate) async fn create_pool(tenant: &Client, pool: Value) -> ClusterPool {
    let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
    pools(tenant)
        .create(&PostParams::default(), &pool)
        .await
        .expect("create pool")
}

pub(crate) async fn create_cdc(tenant: &Client, name: &str, patches: Value) {
    let cdc: Cdc = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"installConfigPatches": patches},
    }))
    .expect("cdc");
    cdcs(tenant)
        .create(&PostParams::default(), &cdc)
        .await
        .expect("create cdc");
}

/// A CDC naming its cluster `name` (the DNS name the inventory was made for).
pub(crate) async fn named_cdc(tenant: &Client, name: &str) {
    create_cdc(
        tenant,
        name,
        json!([{"op": "replace", "path": "/metadata/name", "value": name}]),
    )
    .await;
}

pub(crate) fn pools(tenant: &Client) -> Api<ClusterPool> {
    Api::namespaced(tenant.clone(), NS)
}

pub(crate) fn cdcs(tenant: &Client) -> Api<Cdc> {
    Api::namespaced(tenant.clone(), NS)
}

pub(crate) fn claims(tenant: &Client) -> Api<ClusterClaim> {
    Api::namespaced(tenant.clone(), NS)
}

pub(crate) async fn pool(tenant: &Client, name: &str) -> ClusterPool {
    pools(tenant).get(name).await.expect("get pool")
}

pub(crate) async fn cdc(tenant: &Client, name: &str) -> Cdc {
    cdcs(tenant).get(name).await.expect("get cdc")
}

/// The pool's ClusterDeployments, deleting ones included.
pub(crate) async fn cds(tenant: &Client, pool: &str) -> Vec<ClusterDeployment> {
    Api::<ClusterDeployment>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .expect("list cds")
        .items
        .into_iter()
        .filter(|cd| cd.spec.cluster_pool_ref.as_ref().is_some_and(|r| r.pool_name == pool))
        .collect()
}

pub(crate) fn live(cds: &[ClusterDeployment]) -> Vec<&ClusterDeployment> {
    cds.iter()
        .filter(|cd| cd.metadata.deletion_timestamp.is_none())
        .collect()
}

pub(crate) fn cdc_of(cd: &ClusterDeployment) -> Option<String> {
    cd.spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.cluster_deployment_customization.as_ref())
        .map(|r| r.name.clone())
}

fn condition<'a>(
    conditions: &'a [k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

pub(crate) fn pool_condition(pool: &ClusterPool, type_: &str) -> Option<(String, String, String)> {
    let conditions = pool.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
    condition(&conditions, type_).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

pub(crate) fn cdc_condition(cdc: &Cdc, type_: &str) -> Option<(String, String, String)> {
    let conditions = cdc.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
    condition(&conditions, type_).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// What the pool controller reconciled so far: taken before a change, for [`pool_settled`].
pub(crate) fn pool_reconciles(daemon: &Daemon) -> Reconciles {
    daemon.reconciles(&[("acme", "clusterpool")])
}

/// Waits until the pool controller reconciled after `since` and the host and tenant servers saw no
/// write for a moment: what a test checks next, the daemon had its chance to change.
pub(crate) async fn pool_settled(fleet: &Fleet, daemon: &Daemon, since: &Reconciles) {
    let tenant_server = fleet.tenants[0].1.as_ref().expect("tenant server");
    settled(daemon, since, &[fleet.host(), tenant_server]).await;
}

/// Waits until the lease on the CDC `name` is older than `--lease-min-age` (2 s, as [`daemon`]
/// sets it), by its Available=False transition: from then on a repair may release it.
async fn lease_past_min_age(tenant: &Client, name: &str, daemon: &Daemon) {
    let leased = cdc(tenant, name).await;
    let conditions = leased.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
    let since = condition(&conditions, "Available")
        .filter(|c| c.status == "False")
        .map(|c| c.last_transition_time.0)
        .expect("a leased CDC");
    let aged = since + jiff::SignedDuration::from_secs(2);
    until("the lease older than --lease-min-age", WITHIN, daemon, || async {
        jiff::Timestamp::now() > aged
    })
    .await;
}

pub(crate) fn lease(cdc: &Cdc) -> Option<String> {
    let reserved = cdc_condition(cdc, "Available").is_some_and(|(s, _, _)| s == "False");
    reserved
        .then(|| {
            cdc.status
                .as_ref()?
                .cluster_deployment_ref
                .as_ref()
                .map(|r| r.name.clone())
        })
        .flatten()
}

pub(crate) fn entry(pool: &ClusterPool, name: &str) -> Option<stackd::api::pools::InventoryEntryStatus> {
    pool.status.as_ref()?.inventory.iter().find(|e| e.name == name).cloned()
}

pub(crate) async fn ready(tenant: &Client, name: &str) -> i32 {
    pools(tenant)
        .get_opt(name)
        .await
        .expect("get pool")
        .and_then(|p| p.status)
        .map_or(0, |s| s.ready)
}

pub(crate) async fn install_config(tenant: &Client, cd: &str) -> String {
    let secret = Api::<Secret>::namespaced(tenant.clone(), cd)
        .get(&format!("{cd}-install-config"))
        .await
        .expect("install-config secret");
    let data = secret.data.unwrap_or_default();
    String::from_utf8(data["install-config.yaml"].0.clone()).expect("utf-8")
}

pub(crate) async fn events(tenant: &Client, namespace: &str, object: &str) -> Vec<(String, String)> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(tenant.clone(), namespace);
    let core: Api<Event> = Api::namespaced(tenant.clone(), namespace);
    let mut out: Vec<(String, String)> = api
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(object))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect();
    out.extend(
        core.list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(object))
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default())),
    );
    out
}

/// §4.3 items 1, 2 and 11, and the rendering of §4.2: a pool of 2 from an inventory of 3 fills
/// through installer Jobs; each cluster's install config carries its CDC's patches.
/// What stackd wrote when woken without cause (issue 18 part 5): labels `name` through `api` (an
/// event that changes nothing stackd acts on), waits until each of `controllers` finished a
/// reconcile after it, and returns the writes the tenant server saw meanwhile besides the label's
/// own patch, and those the host and `others` servers saw.
pub(crate) async fn writes_when_woken<K>(
    fleet: &Fleet,
    daemon: &Daemon,
    api: &Api<K>,
    name: &str,
    controllers: &[&str],
    others: &[&stackd::embedded::ApiServer],
) -> (Vec<String>, Vec<String>)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let tenant_server = fleet.tenants[0].1.as_ref().expect("tenant server");
    let servers: Vec<&stackd::embedded::ApiServer> =
        std::iter::once(fleet.host()).chain(others.iter().copied()).collect();
    let before: Vec<_> = servers.iter().map(|s| s.counters()).collect();
    let tenant_before = tenant_server.counters();
    let reconciled: Vec<u64> = controllers.iter().map(|c| daemon.reconciles_done("acme", c)).collect();
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let label = since_epoch.map(|d| d.as_nanos()).unwrap_or_default().to_string();
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": label}}})),
    )
    .await
    .expect("label");
    until("the label's reconciles", WITHIN, daemon, || async {
        controllers
            .iter()
            .zip(&reconciled)
            .all(|(c, before)| daemon.reconciles_done("acme", c) > *before)
    })
    .await;
    let own = format!("patch {}", K::plural(&()));
    let mut tenant = crate::stacks_install::writes(&tenant_server.counters().since(&tenant_before));
    // Only the label's own patch: one more of the same kind shows as x2 and stays.
    if let Some(position) = tenant.iter().position(|w| w.starts_with(&own) && w.ends_with(" x1")) {
        tenant.remove(position);
    }
    let elsewhere = servers
        .iter()
        .zip(&before)
        .flat_map(|(server, before)| crate::stacks_install::writes(&server.counters().since(before)))
        .collect();
    (tenant, elsewhere)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_fills_from_its_inventory_through_installer_jobs() {
    let (fleet, tenant) = setup().await;
    create_cdc(
        &tenant,
        "foo",
        json!([
            {"op": "replace", "path": "/metadata/name", "value": "foo"},
            {"op": "add", "path": "/platform/vsphere/apiVIP", "value": "on"},
            {"op": "add", "path": "/platform/vsphere/ingressVIP", "value": "no"},
            {"op": "add", "path": "/networking", "value": {"clusterNetworkMTU": "1e3", "real": 1000}},
        ]),
    )
    .await;
    named_cdc(&tenant, "bar").await;
    named_cdc(&tenant, "zed").await;
    create_pool(&tenant, pool_json("vsphere", 2, Some(&["foo", "bar", "zed"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters", WITHIN, &daemon, || async {
        ready(&tenant, "vsphere").await == 2
    })
    .await;

    let all = cds(&tenant, "vsphere").await;
    assert_eq!(live(&all).len(), 2);
    let mut used = BTreeSet::new();
    for cd in &all {
        let status = cd.status.clone().unwrap_or_default();
        assert!(status.installed, "{cd:?}");
        assert!(status.infra_id.is_some());
        assert_eq!(
            cd.namespace().as_deref(),
            Some(cd.name_any().as_str()),
            "name == namespace"
        );
        assert!(cd.name_any().starts_with("vsphere-") && cd.name_any().len() == "vsphere-".len() + 5);
        let entry_name = cdc_of(cd).expect("built from a CDC");
        used.insert(entry_name.clone());
        // The install config has the CDC's cluster name, the pool's base domain and platform.
        let config = install_config(&tenant, &cd.name_any()).await;
        assert!(config.contains(&format!("name: {entry_name}")), "{config}");
        if entry_name == "foo" {
            // YAML 1.1 readers must read these back as the strings they are.
            for quoted in [
                "apiVIP: \"on\"",
                "ingressVIP: \"no\"",
                "clusterNetworkMTU: \"1e3\"",
                "real: 1000\n",
            ] {
                assert!(config.contains(quoted), "{quoted} in\n{config}");
            }
        }
        assert!(config.contains("baseDomain: example.com"), "{config}");
        assert!(config.contains("vCenter: vc.example.com"), "{config}");
        assert!(
            config.contains("network: \"VM Network\""),
            "template fields stay: {config}"
        );
        // The admin kubeconfig was copied from the installer's output to the tenant.
        let admin = status.admin_kubeconfig_secret_ref.expect("admin kubeconfig").name;
        let secret = Api::<Secret>::namespaced(tenant.clone(), &cd.name_any())
            .get(&admin)
            .await
            .expect("admin kubeconfig secret");
        let kubeconfig = String::from_utf8(secret.data.unwrap_or_default()["kubeconfig"].0.clone()).unwrap();
        assert!(kubeconfig.contains(&status.infra_id.clone().unwrap()), "{kubeconfig}");
        // The lease names the CD, the pool and the configuration applied.
        let leased = cdc(&tenant, &entry_name).await;
        assert_eq!(lease(&leased).as_deref(), Some(cd.name_any().as_str()));
        let leased_status = leased.status.clone().unwrap();
        assert_eq!(leased_status.cluster_pool_ref.unwrap().name, "vsphere");
        assert!(
            leased_status
                .last_applied_configuration
                .unwrap()
                .contains("/metadata/name")
        );
        assert_eq!(cdc_condition(&leased, "ApplySucceeded").unwrap().1, "Succeeded");
        assert!(leased.finalizers().contains(&"pools.stackd.dev/vsphere".to_string()));
        assert!(
            events(&tenant, NS, &entry_name)
                .await
                .iter()
                .any(|(r, _)| r == "Leased"),
            "a Leased event on {entry_name}"
        );
    }
    // Never-used entries go by name: bar, then foo.
    assert_eq!(used, BTreeSet::from(["bar".to_string(), "foo".to_string()]));
    // The pool's per-entry status.
    let pool = pool(&tenant, "vsphere").await;
    let status = pool.status.clone().unwrap();
    assert_eq!((status.size, status.ready), (2, 2));
    assert_eq!(entry(&pool, "zed").unwrap().status, InventoryEntryState::Available);
    for name in ["bar", "foo"] {
        let e = entry(&pool, name).unwrap();
        assert_eq!(e.status, InventoryEntryState::Reserved);
        assert_eq!(e.version, Some(1));
        assert!(e.cluster_deployment.is_some());
    }
    assert_eq!(pool_condition(&pool, "InventoryValid").unwrap().0, "True");
    assert_eq!(pool_condition(&pool, "CapacityAvailable").unwrap().0, "True");
    assert_eq!(pool_condition(&pool, "AllClustersCurrent").unwrap().0, "True");
    assert_eq!(pool_condition(&pool, "MissingDependencies").unwrap().0, "False");
    // On the host: the installer ran as its own ServiceAccount with its inputs and output Secret.
    let cd = &all[0];
    let prefix = format!("{0}.{0}", cd.name_any());
    let jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let job = jobs.get(&format!("{prefix}-install-0")).await.expect("install job");
    let pod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.service_account_name.as_deref(),
        Some(format!("{prefix}-installer").as_str())
    );
    // The installer image is the tenant's choice: pulled every time, so that no tenant runs another
    // tenant's private image from a node's cache; no Service of the host namespace in its env.
    assert_eq!(pod.enable_service_links, Some(false));
    let container = &pod.containers[0];
    assert_eq!(container.image_pull_policy.as_deref(), Some("Always"));
    assert_eq!(
        container.args.clone().unwrap(),
        ["create", "cluster", "--dir", "/installer"]
    );
    let env: BTreeMap<String, String> = container
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    assert_eq!(env["STACKD_OUTPUT_SECRET"], format!("{prefix}-output"));
    let host_secrets: Api<Secret> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let input = host_secrets
        .get(&format!("{prefix}-install-config"))
        .await
        .expect("input");
    let keys: BTreeSet<String> = input.data.unwrap().keys().cloned().collect();
    for key in ["install-config.yaml", ".dockerconfigjson", "username", "password"] {
        assert!(keys.contains(key), "{key} in {keys:?}");
    }
    let labels = input.metadata.labels.unwrap();
    assert_eq!(labels["stackd.dev/tenant"], "acme");
    assert_eq!(labels["stackd.dev/parent-kind"], "ClusterDeployment");
    let role: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    let rule = &role
        .get(&format!("{prefix}-installer"))
        .await
        .expect("role")
        .rules
        .unwrap()[0];
    assert_eq!(rule.resource_names.clone().unwrap(), [format!("{prefix}-output")]);
    assert_eq!(rule.verbs, ["get", "update", "patch"]);
    daemon
        .wait_for(
            "/metrics",
            "stackd_pool_clusters{tenant=\"acme\",namespace=\"team\",pool=\"vsphere\",state=\"ready\"} 2",
            WITHIN,
        )
        .await;
    let metrics = daemon
        .wait_for(
            "/metrics",
            "stackd_pool_clusters{tenant=\"acme\",namespace=\"team\",pool=\"vsphere\",state=\"reserved\"} 2",
            WITHIN,
        )
        .await;
    for line in [
        "state=\"available\"} 1",
        "state=\"installing\"} 0",
        "state=\"stale\"} 0",
        "state=\"cdc_broken\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    // A lease wiped while its cluster lives is restored for that cluster, never handed to another.
    let holder = lease(&cdc(&tenant, "bar").await).unwrap();
    let mut wiped = cdc(&tenant, "bar").await;
    wiped.status = None;
    cdcs(&tenant)
        .replace_status("bar", &PostParams::default(), &wiped)
        .await
        .expect("wipe the lease");
    until("the lease restored", WITHIN, &daemon, || async {
        lease(&cdc(&tenant, "bar").await).as_deref() == Some(holder.as_str())
    })
    .await;
    // Judged after the pool's next reconcile, not a guessed pause.
    writes_when_woken(&fleet, &daemon, &pools(&tenant), "vsphere", &["clusterpool"], &[]).await;
    let backing: Vec<Option<String>> = live(&cds(&tenant, "vsphere").await)
        .iter()
        .map(|cd| cdc_of(cd))
        .collect();
    assert_eq!(backing.len(), 2);
    assert_eq!(
        backing.iter().filter(|c| c.as_deref() == Some("bar")).count(),
        1,
        "{backing:?}"
    );
}

/// Tenant namespaces the pool created for its clusters.
pub(crate) async fn pool_namespaces(tenant: &Client, pool: &str) -> Vec<Namespace> {
    Api::<Namespace>::all(tenant.clone())
        .list(&ListParams::default().labels(&format!("pools.stackd.dev/clusterpool-name={pool}")))
        .await
        .expect("namespaces")
        .items
        .into_iter()
        .filter(|ns| ns.metadata.deletion_timestamp.is_none())
        .collect()
}

/// §4.3 item 4: a failing patch marks its CDC BrokenBySyntax and the pool InventoryValid=False,
/// leaves nothing behind, and the pool fills from the other entries in the same pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_patch_marks_its_cdc_and_the_pool_fills_from_the_others() {
    let (fleet, tenant) = setup().await;
    // The seed's verbatim CDC (no leading `/`) is refused with the fix in the message.
    let seed: Cdc = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": "seed", "namespace": NS},
        "spec": {"installConfigPatches": [{"op": "replace", "path": "metadata/name", "value": "foo"}]},
    }))
    .unwrap();
    let err = cdcs(&tenant).create(&PostParams::default(), &seed).await.unwrap_err();
    assert!(err.to_string().contains("^/"), "{err}");
    // Sorted first by name, so it is tried first.
    create_cdc(
        &tenant,
        "aaa-broken",
        json!([{"op": "replace", "path": "/broken/path", "value": "x"}]),
    )
    .await;
    named_cdc(&tenant, "good1").await;
    named_cdc(&tenant, "good2").await;
    create_pool(
        &tenant,
        pool_json("p", 2, Some(&["aaa-broken", "good1", "good2", "ghost"])),
    )
    .await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2
    })
    .await;

    let broken = cdc(&tenant, "aaa-broken").await;
    let (status, reason, message) = cdc_condition(&broken, "ApplySucceeded").expect("ApplySucceeded");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "BrokenBySyntax"));
    assert!(message.contains("/broken/path"), "{message}");
    assert_eq!(lease(&broken), None, "a broken CDC stays unleased");
    assert!(broken.status.as_ref().unwrap().cluster_deployment_ref.is_none());
    let pool = pool(&tenant, "p").await;
    let (status, _, message) = pool_condition(&pool, "InventoryValid").unwrap();
    assert_eq!(status, "False");
    assert!(message.contains("BrokenBySyntax: aaa-broken"), "{message}");
    assert_eq!(
        entry(&pool, "aaa-broken").unwrap().status,
        InventoryEntryState::BrokenBySyntax
    );
    assert!(message.contains("Missing: ghost"), "{message}");
    assert_eq!(entry(&pool, "ghost").unwrap().status, InventoryEntryState::Missing);
    let live_cds: BTreeSet<String> = live(&cds(&tenant, "p").await).iter().map(|cd| cd.name_any()).collect();
    let namespaces: BTreeSet<String> = pool_namespaces(&tenant, "p")
        .await
        .iter()
        .map(|ns| ns.name_any())
        .collect();
    assert_eq!(namespaces, live_cds, "no namespace without a cluster");
    assert!(
        events(&tenant, NS, "aaa-broken")
            .await
            .iter()
            .any(|(r, _)| r == "BrokenBySyntax"),
        "an Event on the CDC"
    );
    // Fixing the patch makes the entry usable again.
    let fixed =
        json!({"spec": {"installConfigPatches": [{"op": "replace", "path": "/metadata/name", "value": "fixed"}]}});
    cdcs(&tenant)
        .patch("aaa-broken", &PatchParams::default(), &Patch::Merge(&fixed))
        .await
        .expect("fix");
    until("the fixed entry to be valid", WITHIN, &daemon, || async {
        let pool = pools(&tenant).get("p").await.unwrap();
        entry(&pool, "aaa-broken").is_some_and(|e| e.status == InventoryEntryState::Available)
            && pool_condition(&pool, "InventoryValid").is_some_and(|c| !c.2.contains("aaa-broken"))
    })
    .await;
}

/// §4.3 item 1: two daemons fill one pool from one inventory at once; each CDC is leased once.
/// Repeated, counting every observation of one CDC backing two live clusters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_racing_for_one_inventory_never_lease_a_cdc_twice() {
    let (fleet, tenant) = setup().await;
    let names: Vec<String> = (0..6).map(|i| format!("c{i}")).collect();
    for name in &names {
        named_cdc(&tenant, name).await;
    }
    let entries: Vec<&str> = names.iter().map(String::as_str).collect();
    let first = daemon(&fleet, &[]);
    let second = daemon(&fleet, &[]);
    let (double_leases, observations) = (Cell::new(0), Cell::new(0));
    for round in 0..3 {
        create_pool(&tenant, pool_json("race", 6, Some(&entries))).await;
        // Two daemons and twelve installs per round: allow for a loaded machine.
        let what = format!("round {round} to fill");
        until(&what, 2 * WITHIN, &(&first, &second), || async {
            let all = cds(&tenant, "race").await;
            let mut by_cdc: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for cd in live(&all) {
                by_cdc
                    .entry(cdc_of(cd).unwrap_or_default())
                    .or_default()
                    .push(cd.name_any());
            }
            let doubled = by_cdc.values().filter(|cds| cds.len() > 1).count();
            double_leases.set(double_leases.get() + doubled);
            observations.set(observations.get() + 1);
            ready(&tenant, "race").await == 6
        })
        .await;
        // Every lease names a live cluster built from that very CDC.
        let all = cds(&tenant, "race").await;
        let mut leases = BTreeMap::new();
        for name in &names {
            leases.insert(name.clone(), lease(&cdc(&tenant, name).await));
        }
        let summary: Vec<(String, Option<String>, bool, bool)> = all
            .iter()
            .map(|cd| {
                let installed = cd.status.as_ref().is_some_and(|s| s.installed);
                (
                    cd.name_any(),
                    cdc_of(cd),
                    installed,
                    cd.metadata.deletion_timestamp.is_some(),
                )
            })
            .collect();
        for name in &names {
            let Some(holder) = leases[name].clone() else {
                panic!(
                    "{name} is not leased: leases {leases:?}, clusters {summary:?}\nFIRST:\n{}\nSECOND:\n{}",
                    first.log_text(),
                    second.log_text()
                );
            };
            let cd = all
                .iter()
                .find(|cd| cd.name_any() == holder)
                .expect("the lease names a cluster");
            assert_eq!(cdc_of(cd).as_deref(), Some(name.as_str()));
        }
        assert_eq!(live(&all).len(), 6, "never more clusters than the inventory backs");
        pools(&tenant)
            .delete("race", &DeleteParams::default())
            .await
            .expect("delete pool");
        until("the pool to go", WITHIN, &second, || async {
            pools(&tenant).get_opt("race").await.unwrap().is_none() && cds(&tenant, "race").await.is_empty()
        })
        .await;
    }
    assert_eq!(
        double_leases.get(),
        0,
        "CDCs leased twice over {} observations",
        observations.get()
    );
    // Every CDC was released and lost the deleted pool's finalizer.
    for name in &names {
        let cdc = cdc(&tenant, name).await;
        assert_eq!(lease(&cdc), None);
        assert!(cdc.finalizers().is_empty(), "{:?}", cdc.finalizers());
    }
}

/// An installer image that fails `fail_first` times (then succeeds), with destroys taking `destroy_for`.
pub(crate) fn scripted_installer(
    fleet: &Fleet,
    image: &str,
    fail_first: usize,
    destroy_for: Duration,
) -> Arc<AtomicUsize> {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(image.into()), move |ctx: &JobContext| {
            if ctx.args.first().map(String::as_str) == Some("destroy") {
                return JobOutcome::success("destroyed\n").after(destroy_for);
            }
            if counter.fetch_add(1, Ordering::SeqCst) < fail_first {
                return JobOutcome::failure(1, "level=error msg=\"cloud said no\"\n");
            }
            create_cluster(ctx)
        });
    runs
}

/// §4.3 items 5 and 7 and Hive's livelock: size 3 over an inventory of 2 whose clusters all break.
/// The broken clusters are replaced after each entry's backoff, and the pool says it is exhausted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_clusters_are_replaced_after_a_backoff_when_the_inventory_is_exhausted() {
    let (fleet, tenant) = setup().await;
    let image = "quay.io/example/broken-installer:1";
    scripted_installer(&fleet, image, usize::MAX, Duration::ZERO);
    named_cdc(&tenant, "x").await;
    named_cdc(&tenant, "y").await;
    let mut spec = pool_json("p", 3, Some(&["x", "y"]));
    spec["spec"]["installerImage"] = json!(image);
    spec["spec"]["installAttemptsLimit"] = json!(1);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    let started = Instant::now();
    let (saw_invalid, saw_broken_entry) = (Cell::new(false), Cell::new(false));
    until("broken clusters replaced", WITHIN, &daemon, || async {
        let all = cds(&tenant, "p").await;
        assert!(live(&all).len() <= 2, "never more clusters than entries");
        let pool = pool(&tenant, "p").await;
        saw_invalid.set(
            saw_invalid.get()
                | pool_condition(&pool, "InventoryValid")
                    .is_some_and(|(status, _, message)| status == "False" && message.contains("BrokenByCloud")),
        );
        saw_broken_entry.set(
            saw_broken_entry.get()
                | ["x", "y"]
                    .iter()
                    .any(|n| entry(&pool, n).is_some_and(|e| e.status == InventoryEntryState::BrokenByCloud)),
        );
        let attempts = |name| entry(&pool, name).map_or(0, |e| e.attempts);
        attempts("x") >= 2 && attempts("y") >= 2
    })
    .await;
    let elapsed = started.elapsed();
    let pool = pool(&tenant, "p").await;
    let (status, reason, message) = pool_condition(&pool, "CapacityAvailable").unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "InventoryExhausted"),
        "{message}"
    );
    assert!(message.contains("can back only 2"), "{message}");
    assert!(
        saw_invalid.get(),
        "InventoryValid=False named the BrokenByCloud entries"
    );
    assert!(
        saw_broken_entry.get(),
        "an entry showed BrokenByCloud between its attempts"
    );
    // No install storm: the per-entry backoff (from --backoff-base, doubling) spaces the retries.
    let created = events(&tenant, NS, "p")
        .await
        .iter()
        .filter(|(r, _)| r == "ClusterCreated")
        .count();
    let attempts: i32 = ["x", "y"].iter().map(|n| entry(&pool, n).unwrap().attempts).sum();
    assert!(
        created <= attempts as usize + 2,
        "{created} clusters for {attempts} attempts in {elapsed:?}"
    );
    assert!(
        attempts <= 8,
        "{attempts} attempts in {elapsed:?}: the backoff did not hold"
    );
    let broken = cdc(&tenant, "x").await;
    assert!(
        events(&tenant, NS, "x").await.iter().any(|(r, _)| r == "BrokenByCloud"),
        "{:?}",
        broken.status
    );
}

/// Sets a CDC's lease as if a pool had written it `age` ago for a cluster that never appeared.
pub(crate) async fn reserve(tenant: &Client, name: &str, pool: &str, cd: &str, age: Duration) {
    let mut cdc = cdc(tenant, name).await;
    let at = jiff::Timestamp::now() - jiff::SignedDuration::try_from(age).unwrap();
    cdc.status = Some(
        serde_json::from_value(json!({
            "clusterDeploymentRef": {"name": cd},
            "clusterPoolRef": {"name": pool},
            "conditions": [{"type": "Available", "status": "False", "reason": "Reserved", "message": "", "lastTransitionTime": at.to_string()}],
        }))
        .unwrap(),
    );
    cdcs(tenant)
        .replace_status(name, &PostParams::default(), &cdc)
        .await
        .expect("reserve");
}

/// §4.3 item 2 repair: a CDC reserved for a CD that never got created is released once the lease is
/// older than `--lease-min-age`, one reserved moments ago only later; a lease held by another pool
/// is never touched; an empty pool namespace is reaped after the same age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_without_a_cluster_are_released_after_the_minimum_age_and_empty_namespaces_reaped() {
    let (fleet, tenant) = setup().await;
    for name in ["old", "fresh", "other"] {
        named_cdc(&tenant, name).await;
    }
    let created = create_pool(&tenant, pool_json("p", 0, Some(&["old", "fresh", "other"]))).await;
    let min_age = Duration::from_secs(3);
    reserve(&tenant, "old", "p", "p-ghost1", Duration::from_secs(3600)).await;
    reserve(&tenant, "other", "q", "q-ghost", Duration::from_secs(3600)).await;
    // As the pool creates its clusters' namespaces (a cluster whose creation failed left it empty).
    let empty: Namespace = serde_json::from_value(json!({"metadata": {"name": "p-empty",
        "labels": {"pools.stackd.dev/clusterpool-namespace": NS, "pools.stackd.dev/clusterpool-name": "p"},
        "annotations": {"pools.stackd.dev/clusterpool-uid": created.uid().unwrap()}}}))
    .unwrap();
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &empty)
        .await
        .expect("namespace");
    let daemon = fleet.daemon(&["--lease-min-age", "3s"]);
    reserve(&tenant, "fresh", "p", "p-ghost2", Duration::ZERO).await;
    let fresh_at = Instant::now();
    until("the old lease to be released", WITHIN, &daemon, || async {
        lease(&cdc(&tenant, "old").await).is_none()
    })
    .await;
    assert!(fresh_at.elapsed() < min_age);
    assert_eq!(
        lease(&cdc(&tenant, "fresh").await).as_deref(),
        Some("p-ghost2"),
        "reserved moments ago"
    );
    assert!(
        !pool_namespaces(&tenant, "p").await.is_empty(),
        "the namespace is younger than the minimum age"
    );
    until("the fresh lease to be released", WITHIN, &daemon, || async {
        lease(&cdc(&tenant, "fresh").await).is_none()
    })
    .await;
    // Condition times have one-second precision.
    assert!(
        fresh_at.elapsed() >= min_age - Duration::from_secs(1),
        "{:?}",
        fresh_at.elapsed()
    );
    until("the empty namespace to be reaped", WITHIN, &daemon, || async {
        pool_namespaces(&tenant, "p").await.is_empty()
    })
    .await;
    // Another pool's lease is never released by this one.
    assert_eq!(lease(&cdc(&tenant, "other").await).as_deref(), Some("q-ghost"));
    let pool = pool(&tenant, "p").await;
    assert_eq!(entry(&pool, "other").unwrap().status, InventoryEntryState::Unavailable);
    assert!(
        events(&tenant, NS, "old")
            .await
            .iter()
            .any(|(r, n)| r == "Released" && n.contains("p-ghost1")),
        "a Released event"
    );
}

/// An upgrade from a stackd that wrote CDC status with merge patches (no field manager): its
/// `Update` entry co-owned the lease fields, so a release by server-side apply left the
/// `clusterDeploymentRef` behind. The status writer takes those fields over first: the released
/// CDC shows no cluster and no pool, and no status `Update` entry is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_written_by_an_older_stackd_is_released_completely() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "old").await;
    create_pool(&tenant, pool_json("p", 0, Some(&["old"]))).await;
    let long_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    let legacy = json!({"status": {
        "clusterDeploymentRef": {"name": "p-ghost"},
        "clusterPoolRef": {"name": "p"},
        "conditions": [{"type": "Available", "status": "False", "reason": "Reserved", "message": "",
            "lastTransitionTime": long_ago.to_string()}],
    }});
    let written = cdcs(&tenant)
        .patch_status("old", &PatchParams::default(), &Patch::Merge(legacy))
        .await
        .expect("legacy lease");
    assert_eq!(status_updates(&written), 1, "{:?}", written.metadata.managed_fields);
    let daemon = daemon(&fleet, &[]);
    until("the legacy lease to be released", WITHIN, &daemon, || async {
        cdc_condition(&cdc(&tenant, "old").await, "Available").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    let released = cdc(&tenant, "old").await;
    let status = released.status.clone().unwrap_or_default();
    assert_eq!(status.cluster_deployment_ref, None, "{status:?}");
    assert_eq!(status.cluster_pool_ref, None, "{status:?}");
    assert_eq!(status_updates(&released), 0, "{:?}", released.metadata.managed_fields);
    assert!(released.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some("stackd/cdc-lease")
            && m.operation.as_deref() == Some("Apply")
            && m.subresource.as_deref() == Some("status")
    }));
}

/// The CDC `old` with a lease written as an older stackd wrote it: a merge patch of its status,
/// which leaves a status `Update` entry in its managed fields.
async fn legacy_status_cdc(tenant: &Client) -> (Api<Cdc>, Cdc) {
    named_cdc(tenant, "old").await;
    let legacy = json!({"status": {"clusterDeploymentRef": {"name": "p-ghost"}, "clusterPoolRef": {"name": "p"}}});
    let api = cdcs(tenant);
    let patched = api
        .patch_status("old", &PatchParams::default(), &Patch::Merge(legacy))
        .await
        .expect("legacy status");
    (api, patched)
}

/// A takeover on a stale cached object is a 409 Conflict, as a stale lease write is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_takeover_on_a_stale_object_conflicts() {
    let (_fleet, tenant) = setup().await;
    let (api, again) = legacy_status_cdc(&tenant).await;
    let released = stackd::api::pools::ClusterDeploymentCustomizationStatus::default();
    api.patch(
        "old",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .expect("a change meanwhile");
    let version = again.metadata.resource_version.as_deref();
    let stale = apply_status(&api, &again, "stackd/cdc-lease", &released, version)
        .await
        .expect_err("stale takeover");
    assert!(matches!(stale, kube::Error::Api(ref s) if s.code == 409), "{stale:?}");
}

/// The daemon's caches keep no `managedFields`: a legacy status entry the cached copy does not show
/// is taken over from the answer to the apply, which is then made again, so a field the status no
/// longer has goes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_legacy_status_entry_the_cached_copy_does_not_show_is_taken_over_after_the_apply() {
    let (_fleet, tenant) = setup().await;
    let (api, mut cached) = legacy_status_cdc(&tenant).await;
    assert_eq!(status_updates(&cached), 1);
    cached.metadata.managed_fields = None;
    let released = stackd::api::pools::ClusterDeploymentCustomizationStatus::default();
    let version = cached.metadata.resource_version.clone();
    let written = apply_status(&api, &cached, "stackd/cdc-lease", &released, version.as_deref())
        .await
        .expect("apply");
    let status = written.status.clone().unwrap_or_default();
    assert_eq!(status.cluster_deployment_ref, None, "{status:?}");
    assert_eq!(status.cluster_pool_ref, None, "{status:?}");
    assert_eq!(status_updates(&written), 0, "{:?}", written.metadata.managed_fields);
    assert_eq!(
        cdc(&tenant, "old")
            .await
            .status
            .unwrap_or_default()
            .cluster_deployment_ref,
        None
    );
}

/// Status `Update` entries in `managedFields`: writes of the status not made by server-side apply.
fn status_updates(cdc: &Cdc) -> usize {
    let entries = cdc.metadata.managed_fields.as_deref().unwrap_or_default();
    entries
        .iter()
        .filter(|m| m.subresource.as_deref() == Some("status") && m.operation.as_deref() == Some("Update"))
        .count()
}

pub(crate) async fn create_claim(tenant: &Client, name: &str, pool: &str, lifetime: Option<&str>) {
    let mut claim = json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"clusterPoolName": pool},
    });
    if let Some(lifetime) = lifetime {
        claim["spec"]["lifetime"] = json!(lifetime);
    }
    let claim: ClusterClaim = serde_json::from_value(claim).unwrap();
    claims(tenant)
        .create(&PostParams::default(), &claim)
        .await
        .expect("claim");
}

pub(crate) async fn claimed_namespace(tenant: &Client, claim: &str) -> Option<String> {
    claims(tenant).get_opt(claim).await.unwrap()?.status?.namespace
}

/// §4.3 item 10 and item 6: the oldest claim gets the oldest ready cluster and its admin
/// kubeconfig; pending claims grow the pool; deleting the claim deletes the cluster, whose CDC is
/// released only after the destroy Job finished; a claim past its lifetime is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_get_the_oldest_ready_cluster_and_release_it_after_the_destroy_job() {
    let (fleet, tenant) = setup().await;
    let image = "quay.io/example/slow-destroy-installer:1";
    scripted_installer(&fleet, image, 0, Duration::from_millis(1500));
    for name in ["a", "b", "c", "d"] {
        named_cdc(&tenant, name).await;
    }
    let mut spec = pool_json("p", 1, Some(&["a", "b", "c", "d"]));
    spec["spec"]["installerImage"] = json!(image);
    spec["spec"]["claimLifetime"] = json!({"maximum": "1h"});
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("one ready cluster", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let oldest = live(&cds(&tenant, "p").await)[0].name_any();

    // Two claims on a pool of one: the first (oldest) gets the ready cluster, the second makes the
    // pool add one and gets that.
    // Claims created in one second go by name: "first" is the older either way.
    create_claim(&tenant, "first", "p", None).await;
    create_claim(&tenant, "second", "p", Some("3s")).await;
    until("both claims assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "first").await.is_some() && claimed_namespace(&tenant, "second").await.is_some()
    })
    .await;
    assert_eq!(
        claimed_namespace(&tenant, "first").await.as_deref(),
        Some(oldest.as_str())
    );
    let second = claims(&tenant).get("second").await.unwrap();
    let second_status = second.status.unwrap();
    let second_cd = second_status.namespace.clone().unwrap();
    assert_eq!(second_status.lifetime.as_deref(), Some("3s"));
    let first = claims(&tenant).get("first").await.unwrap();
    let pending = condition(&first.status.clone().unwrap().conditions, "Pending")
        .unwrap()
        .clone();
    assert_eq!(
        (pending.status.as_str(), pending.reason.as_str()),
        ("False", "ClusterClaimed")
    );
    let admin = Api::<Secret>::namespaced(tenant.clone(), &oldest)
        .get(&format!("{oldest}-admin-kubeconfig"))
        .await
        .expect("the claimed cluster's admin kubeconfig");
    assert!(admin.data.unwrap().contains_key("kubeconfig"));
    // The pool refills to one unclaimed cluster besides the two claimed ones.
    until("the pool refilled", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;

    // Deleting the claim deletes its cluster; the CDC stays leased while the destroy Job runs.
    let cd = cds(&tenant, "p")
        .await
        .into_iter()
        .find(|cd| cd.name_any() == oldest)
        .unwrap();
    let entry_name = cdc_of(&cd).unwrap();
    claims(&tenant)
        .delete("first", &DeleteParams::default())
        .await
        .expect("delete claim");
    let destroy = format!("{oldest}.{oldest}-destroy");
    let jobs: Api<Job> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
    until("the destroy Job", WITHIN, &daemon, || async {
        jobs.get_opt(&destroy).await.unwrap().is_some()
    })
    .await;
    assert_eq!(
        lease(&cdc(&tenant, &entry_name).await).as_deref(),
        Some(oldest.as_str()),
        "still leased while the destroy Job runs"
    );
    let job = jobs.get(&destroy).await.unwrap();
    assert_eq!(
        job.spec.unwrap().template.spec.unwrap().containers[0]
            .args
            .clone()
            .unwrap(),
        ["destroy", "cluster", "--dir", "/installer"]
    );
    until("the CDC released", WITHIN, &daemon, || async {
        lease(&cdc(&tenant, &entry_name).await) != Some(oldest.clone())
    })
    .await;
    let cluster_gone = Api::<ClusterDeployment>::namespaced(tenant.clone(), &oldest)
        .get_opt(&oldest)
        .await
        .unwrap();
    assert!(cluster_gone.is_none_or(|cd| cd.metadata.deletion_timestamp.is_some()));
    // The cluster's host objects go with it.
    let prefix = format!("{oldest}.{oldest}");
    until("the cluster's host objects deleted", WITHIN, &daemon, || async {
        let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
        let role: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
        let secrets: Api<Secret> = Api::namespaced(fleet.host_client.clone(), HOST_NS);
        sa.get_opt(&format!("{prefix}-installer")).await.unwrap().is_none()
            && role.get_opt(&format!("{prefix}-installer")).await.unwrap().is_none()
            && secrets.get_opt(&format!("{prefix}-output")).await.unwrap().is_none()
            && jobs.get_opt(&destroy).await.unwrap().is_none()
    })
    .await;
    until("a Released event naming the deprovision", WITHIN, &daemon, || async {
        events(&tenant, NS, &entry_name)
            .await
            .iter()
            .any(|(r, n)| r == "Released" && n.contains("deprovision"))
    })
    .await;

    // The second claim outlives its 3 s lifetime and is deleted with its cluster.
    until("the expired claim deleted", WITHIN, &daemon, || async {
        claims(&tenant).get_opt("second").await.unwrap().is_none()
    })
    .await;
    until("its cluster deleted", WITHIN, &daemon, || async {
        Api::<ClusterDeployment>::namespaced(tenant.clone(), &second_cd)
            .get_opt(&second_cd)
            .await
            .unwrap()
            .is_none_or(|cd| cd.metadata.deletion_timestamp.is_some())
    })
    .await;
}

/// §4.3 item 8 with entries: reordering the inventory changes nothing; editing one CDC's patches or
/// removing one entry replaces only the unclaimed cluster built from it; claimed ones are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_or_removing_an_entry_replaces_only_its_unclaimed_cluster() {
    let (fleet, tenant) = setup().await;
    for name in ["a", "b", "c", "d", "e"] {
        named_cdc(&tenant, name).await;
    }
    create_pool(&tenant, pool_json("p", 2, Some(&["a", "b", "c", "d", "e"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2
    })
    .await;
    create_claim(&tenant, "mine", "p", None).await;
    until("the claim assigned and the pool refilled", WITHIN, &daemon, || async {
        // The claim's status is written before the pool's: until the refill shows in the pool's
        // status, `ready` may still count the claimed cluster, so count the clusters as well.
        let all = cds(&tenant, "p").await;
        let installed = live(&all)
            .iter()
            .filter(|cd| cd.status.as_ref().is_some_and(|s| s.installed))
            .count();
        claimed_namespace(&tenant, "mine").await.is_some() && installed == 3 && ready(&tenant, "p").await == 2
    })
    .await;
    let claimed = claimed_namespace(&tenant, "mine").await.unwrap();
    let by_entry = |all: &[ClusterDeployment]| -> BTreeMap<String, String> {
        live(all)
            .iter()
            .map(|cd| (cdc_of(cd).unwrap(), cd.name_any()))
            .collect()
    };
    let before = by_entry(&cds(&tenant, "p").await);
    assert_eq!(before.len(), 3);
    let claimed_entry = before.iter().find(|(_, cd)| **cd == claimed).unwrap().0.clone();
    let mut unclaimed: Vec<(String, String)> = before
        .iter()
        .filter(|(_, cd)| **cd != claimed)
        .map(|(e, c)| (e.clone(), c.clone()))
        .collect();
    let (edited_entry, edited_cd) = unclaimed.remove(0);
    let (removed_entry, removed_cd) = unclaimed.remove(0);

    // Reordering: nothing becomes stale.
    let reversed: Vec<Value> = ["e", "d", "c", "b", "a"].iter().map(|n| json!({"name": n})).collect();
    let reordered = pool_reconciles(&daemon);
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": reversed}})),
        )
        .await
        .unwrap();
    pool_settled(&fleet, &daemon, &reordered).await;
    assert_eq!(
        by_entry(&cds(&tenant, "p").await),
        before,
        "reordering replaces nothing"
    );
    assert_eq!(
        pool_condition(&pool(&tenant, "p").await, "AllClustersCurrent")
            .unwrap()
            .0,
        "True"
    );

    // Editing the claimed cluster's CDC leaves that cluster alone.
    let edit = |name: &str| json!({"spec": {"installConfigPatches": [{"op": "replace", "path": "/metadata/name", "value": format!("{name}-v2")}]}});
    cdcs(&tenant)
        .patch(
            &claimed_entry,
            &PatchParams::default(),
            &Patch::Merge(edit(&claimed_entry)),
        )
        .await
        .unwrap();
    // Editing an unclaimed cluster's CDC replaces that cluster only.
    cdcs(&tenant)
        .patch(
            &edited_entry,
            &PatchParams::default(),
            &Patch::Merge(edit(&edited_entry)),
        )
        .await
        .unwrap();
    until("the edited entry's cluster replaced", WITHIN, &daemon, || async {
        let now = by_entry(&cds(&tenant, "p").await);
        !now.values().any(|cd| *cd == edited_cd) && ready(&tenant, "p").await == 2
    })
    .await;
    let now = by_entry(&cds(&tenant, "p").await);
    assert!(now.values().any(|cd| *cd == claimed), "the claimed cluster stays");
    assert!(
        now.values().any(|cd| *cd == removed_cd),
        "the other unclaimed cluster stays"
    );
    let pool_now = pool(&tenant, "p").await;
    assert_eq!(
        entry(&pool_now, &claimed_entry).unwrap().status,
        InventoryEntryState::ToBeUpdated
    );

    // Removing an entry replaces its unclaimed cluster.
    let remaining: Vec<Value> = ["a", "b", "c", "d", "e"]
        .iter()
        .filter(|n| **n != removed_entry)
        .map(|n| json!({"name": n}))
        .collect();
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": remaining}})),
        )
        .await
        .unwrap();
    until("the removed entry's cluster replaced", WITHIN, &daemon, || async {
        let now = by_entry(&cds(&tenant, "p").await);
        !now.values().any(|cd| *cd == removed_cd) && ready(&tenant, "p").await == 2
    })
    .await;
    let now = by_entry(&cds(&tenant, "p").await);
    assert!(now.values().any(|cd| *cd == claimed), "the claimed cluster stays");
    assert!(!now.contains_key(&removed_entry));
    // A CDC no longer listed and no longer leased loses the pool's finalizer.
    until("the removed entry's finalizer gone", WITHIN, &daemon, || async {
        cdc(&tenant, &removed_entry).await.finalizers().is_empty()
    })
    .await;

    // Removing the claimed cluster's entry leaves that cluster alone; the entry shows ToBeDeleted.
    let remaining: Vec<Value> = ["a", "b", "c", "d", "e"]
        .iter()
        .filter(|n| **n != removed_entry && **n != claimed_entry)
        .map(|n| json!({"name": n}))
        .collect();
    let shrunk = pool_reconciles(&daemon);
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": remaining}})),
        )
        .await
        .unwrap();
    until("the claimed entry ToBeDeleted", WITHIN, &daemon, || async {
        let pool = pools(&tenant).get("p").await.unwrap();
        entry(&pool, &claimed_entry).is_some_and(|e| e.status == InventoryEntryState::ToBeDeleted)
    })
    .await;
    pool_settled(&fleet, &daemon, &shrunk).await;
    assert!(
        by_entry(&cds(&tenant, "p").await).values().any(|cd| *cd == claimed),
        "the claimed cluster stays"
    );
    assert_eq!(
        lease(&cdc(&tenant, &claimed_entry).await).as_deref(),
        Some(claimed.as_str())
    );
}

/// §4.3 item 8: adding or removing the inventory makes every unclaimed cluster stale; they are
/// replaced one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_or_removing_the_inventory_replaces_unclaimed_clusters_one_at_a_time() {
    let (fleet, tenant) = setup().await;
    for name in ["a", "b", "c"] {
        named_cdc(&tenant, name).await;
    }
    create_pool(&tenant, pool_json("p", 2, None)).await;
    let daemon = daemon(&fleet, &[]);
    until("two ready clusters", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 2
    })
    .await;
    assert!(live(&cds(&tenant, "p").await).iter().all(|cd| cdc_of(cd).is_none()));
    let entries: Vec<Value> = ["a", "b", "c"].iter().map(|n| json!({"name": n})).collect();
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": entries}})),
        )
        .await
        .unwrap();
    let saw_stale = Cell::new(false);
    until("the stale clusters replaced", WITHIN, &daemon, || async {
        let all = cds(&tenant, "p").await;
        let deleting = all.iter().filter(|cd| cd.metadata.deletion_timestamp.is_some()).count();
        assert!(deleting <= 1, "stale clusters are replaced one at a time");
        let stale = pool_condition(&pool(&tenant, "p").await, "AllClustersCurrent").is_some_and(|c| c.0 == "False");
        saw_stale.set(saw_stale.get() | stale);
        let current = live(&all).iter().filter(|cd| cdc_of(cd).is_some()).count();
        current == 2 && live(&all).len() == 2 && ready(&tenant, "p").await == 2
    })
    .await;
    assert!(
        saw_stale.get(),
        "AllClustersCurrent=False while stale clusters remained"
    );
    // Removing the inventory makes them stale again.
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": null}})),
        )
        .await
        .unwrap();
    until("clusters without an inventory", WITHIN, &daemon, || async {
        let all = cds(&tenant, "p").await;
        live(&all).len() == 2 && live(&all).iter().all(|cd| cdc_of(cd).is_none()) && ready(&tenant, "p").await == 2
    })
    .await;
    until("every CDC released", WITHIN, &daemon, || async {
        let mut free = true;
        for name in ["a", "b", "c"] {
            free &= lease(&cdc(&tenant, name).await).is_none();
        }
        free
    })
    .await;
}

/// §4.3 item 3 and Hive's bug 9: a CDC listed by two pools is only ever used and released by the
/// pool holding it; the other shows it Unavailable and fills from its own entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdc_listed_by_two_pools_is_never_released_by_the_pool_not_holding_it() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "shared").await;
    named_cdc(&tenant, "own").await;
    create_pool(&tenant, pool_json("alpha", 1, Some(&["shared"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("alpha ready", WITHIN, &daemon, || async {
        ready(&tenant, "alpha").await == 1
    })
    .await;
    let holder = lease(&cdc(&tenant, "shared").await).expect("alpha holds it");
    create_pool(&tenant, pool_json("beta", 1, Some(&["shared", "own"]))).await;
    until("beta ready", WITHIN, &daemon, || async {
        ready(&tenant, "beta").await == 1
    })
    .await;
    let beta = live(&cds(&tenant, "beta").await)
        .iter()
        .map(|cd| cdc_of(cd))
        .collect::<Vec<_>>();
    assert_eq!(beta, [Some("own".to_string())]);
    // Once the lease is older than --lease-min-age, beta's repair pass never touches alpha's lease.
    lease_past_min_age(&tenant, "shared", &daemon).await;
    let woken = pool_reconciles(&daemon);
    pools(&tenant)
        .patch(
            "beta",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"touched": "after-min-age"}}})),
        )
        .await
        .unwrap();
    pool_settled(&fleet, &daemon, &woken).await;
    let shared = cdc(&tenant, "shared").await;
    assert_eq!(lease(&shared).as_deref(), Some(holder.as_str()));
    assert_eq!(shared.status.unwrap().cluster_pool_ref.unwrap().name, "alpha");
    let beta_pool = pool(&tenant, "beta").await;
    assert_eq!(
        entry(&beta_pool, "shared").unwrap().status,
        InventoryEntryState::Unavailable
    );
    // The merged seed: an entry another pool holds makes the inventory invalid, and says who.
    let (valid, _, message) = pool_condition(&beta_pool, "InventoryValid").unwrap();
    assert_eq!(valid, "False");
    assert!(
        message.contains("Unavailable: shared (leased by ClusterPool alpha)"),
        "{message}"
    );
    // Deleting beta removes only beta's finalizer from the shared CDC.
    pools(&tenant).delete("beta", &DeleteParams::default()).await.unwrap();
    until("beta gone", WITHIN, &daemon, || async {
        pools(&tenant).get_opt("beta").await.unwrap().is_none()
    })
    .await;
    let shared = cdc(&tenant, "shared").await;
    assert_eq!(lease(&shared).as_deref(), Some(holder.as_str()));
    assert_eq!(shared.finalizers(), ["pools.stackd.dev/alpha"]);
    assert!(cdc(&tenant, "own").await.finalizers().is_empty());
}

/// §4.3 item 9: deleting a leased CDC waits for its release; deleting the pool strips the pool's
/// finalizer from every CDC that has it, listed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_cdc_is_deleted_only_after_its_release_and_pool_deletion_strips_finalizers() {
    let (fleet, tenant) = setup().await;
    for name in ["x", "y", "z"] {
        named_cdc(&tenant, name).await;
    }
    create_pool(&tenant, pool_json("p", 1, Some(&["x", "y", "z"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("one ready cluster", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let leased = cdc_of(live(&cds(&tenant, "p").await)[0]).unwrap();
    // Drop `z` from the inventory: it loses the finalizer (Hive kept it dangling).
    let entries: Vec<Value> = ["x", "y"].iter().map(|n| json!({"name": n})).collect();
    pools(&tenant)
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"inventory": entries}})),
        )
        .await
        .unwrap();
    let deleted = pool_reconciles(&daemon);
    cdcs(&tenant).delete(&leased, &DeleteParams::default()).await.unwrap();
    pool_settled(&fleet, &daemon, &deleted).await;
    let held = cdc(&tenant, &leased).await;
    assert!(held.metadata.deletion_timestamp.is_some());
    assert!(lease(&held).is_some(), "still leased, so still there");
    pools(&tenant).delete("p", &DeleteParams::default()).await.unwrap();
    until(
        "the pool, its clusters and the deleted CDC gone",
        WITHIN,
        &daemon,
        || async {
            pools(&tenant).get_opt("p").await.unwrap().is_none()
                && cds(&tenant, "p").await.is_empty()
                && cdcs(&tenant).get_opt(&leased).await.unwrap().is_none()
        },
    )
    .await;
    for name in ["x", "y", "z"] {
        if let Some(cdc) = cdcs(&tenant).get_opt(name).await.unwrap() {
            assert!(cdc.finalizers().is_empty(), "{name}: {:?}", cdc.finalizers());
        }
    }
}

/// Hive's ClusterPool case of a CDC deleted while a finalizer still holds it (issue 48): the pool
/// never leases it and fills from its other entry, and every part of its status says the same:
/// the entry is `Deleting`, `InventoryValid` names it, and `CapacityAvailable` counts it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdc_being_deleted_is_neither_leased_nor_reported_usable() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "going").await;
    named_cdc(&tenant, "kept").await;
    // Someone else's finalizer keeps it while it is being deleted.
    cdcs(&tenant)
        .patch(
            "going",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/keep"]}})),
        )
        .await
        .expect("a finalizer");
    cdcs(&tenant).delete("going", &DeleteParams::default()).await.unwrap();
    assert!(cdc(&tenant, "going").await.metadata.deletion_timestamp.is_some());
    create_pool(&tenant, pool_json("p", 2, Some(&["going", "kept"]))).await;
    let daemon = daemon(&fleet, &[]);
    until(
        "one cluster, from kept, and the inventory said to back only 1",
        WITHIN,
        &daemon,
        || async {
            let clusters = cds(&tenant, "p").await;
            let from: Vec<Option<String>> = live(&clusters).iter().map(|cd| cdc_of(cd)).collect();
            let capacity = pool_condition(&pool(&tenant, "p").await, "CapacityAvailable");
            from == [Some("kept".to_string())]
                && capacity.is_some_and(|(_, r, m)| r == "InventoryExhausted" && m.contains("can back only 1"))
        },
    )
    .await;
    let p = pool(&tenant, "p").await;
    let states: Vec<(String, InventoryEntryState)> = ["going", "kept"]
        .iter()
        .map(|name| (name.to_string(), entry(&p, name).expect("an entry").status))
        .collect();
    assert_eq!(
        states,
        [
            ("going".to_string(), InventoryEntryState::Deleting),
            ("kept".to_string(), InventoryEntryState::Reserved)
        ]
    );
    let (valid, reason, message) = pool_condition(&p, "InventoryValid").expect("InventoryValid");
    assert_eq!((valid.as_str(), reason.as_str()), ("False", "Invalid"), "{message}");
    assert!(
        message.contains("(Deleting: going)") && message.contains("being deleted and will not be used"),
        "{message}"
    );
    assert!(lease(&cdc(&tenant, "going").await).is_none());
    assert_eq!(
        cdc(&tenant, "going").await.finalizers(),
        ["example.com/keep"],
        "the pool adds no finalizer"
    );
}

/// §4.3 items 7 and 11: a failing installer is retried up to `installAttemptsLimit`; past it the
/// cluster is broken, deleted and replaced, and its CDC is BrokenByCloud with one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_installer_is_retried_up_to_the_limit_then_the_cluster_is_replaced() {
    let (fleet, tenant) = setup().await;
    let flaky = "quay.io/example/flaky-installer:1";
    scripted_installer(&fleet, flaky, 2, Duration::ZERO);
    named_cdc(&tenant, "a").await;
    let mut spec = pool_json("flaky", 1, Some(&["a"]));
    spec["spec"]["installerImage"] = json!(flaky);
    spec["spec"]["installAttemptsLimit"] = json!(3);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until(
        "the cluster installed on its third attempt",
        WITHIN,
        &daemon,
        || async { ready(&tenant, "flaky").await == 1 },
    )
    .await;
    let cd = live(&cds(&tenant, "flaky").await)[0].clone();
    assert_eq!(cd.status.clone().unwrap().install_restarts, 2);
    let failures = events(&tenant, &cd.name_any(), &cd.name_any()).await;
    assert_eq!(
        failures.iter().filter(|(r, _)| r == "InstallFailed").count(),
        2,
        "{failures:?}"
    );

    // A limit of 2 with an installer that always fails: broken, replaced, CDC BrokenByCloud.
    let broken = "quay.io/example/failing-installer:1";
    scripted_installer(&fleet, broken, usize::MAX, Duration::ZERO);
    named_cdc(&tenant, "b").await;
    let mut spec = pool_json("broken", 1, Some(&["b"]));
    spec["spec"]["installerImage"] = json!(broken);
    spec["spec"]["installAttemptsLimit"] = json!(2);
    create_pool(&tenant, spec).await;
    until("the first cluster", WITHIN, &daemon, || async {
        !cds(&tenant, "broken").await.is_empty()
    })
    .await;
    let first = cds(&tenant, "broken").await[0].name_any();
    until("the broken cluster replaced", WITHIN, &daemon, || async {
        let all = cds(&tenant, "broken").await;
        let pool = pools(&tenant).get("broken").await.unwrap();
        entry(&pool, "b").is_some_and(|e| e.attempts >= 1) && all.iter().any(|cd| cd.name_any() != first)
    })
    .await;
    let pool_events = events(&tenant, NS, "broken").await;
    assert!(
        pool_events
            .iter()
            .any(|(r, n)| r == "ClusterDeleted" && n.contains(&first) && n.contains("installAttemptsLimit")),
        "{pool_events:?}"
    );
    assert!(events(&tenant, NS, "b").await.iter().any(|(r, _)| r == "BrokenByCloud"));
}

/// `stackd dev` creates a sample pool of size 2 with three CDCs in its first tenant, and prints
/// it filling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stackd_dev_fills_a_sample_pool_and_shows_its_progress() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["dev", "--tenants", "1", "--kubeconfig-dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn stackd dev");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push(line.clone());
            if line.contains("pool pools-demo/vsphere-pool: 2 of 2 ready") {
                return true;
            }
        }
        false
    })
    .await;
    assert!(matches!(found, Ok(true)), "no progress line in:\n{}", seen.join("\n"));
    assert!(
        seen.iter()
            .any(|l| l.contains("Sample pool pools-demo/vsphere-pool created in tenant acme"))
    );
    assert!(
        seen.iter()
            .any(|l| l.contains("of 2 ready") && !l.contains("2 of 2 ready")),
        "progress is shown while it fills:\n{}",
        seen.join("\n")
    );
    let kubeconfig = kube::config::Kubeconfig::read_from(dir.path().join("tenants/acme.yaml")).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    let tenant = Client::try_from(config).expect("client");
    let cdcs: Api<Cdc> = Api::namespaced(tenant, "pools-demo");
    assert_eq!(cdcs.list(&ListParams::default()).await.expect("list").items.len(), 3);
    let pid = child.id().expect("pid").to_string();
    let _ = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await;
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits")
        .expect("wait");
    assert!(status.success());
}

/// §4.3 item 5 bounds and dependencies: a missing Secret stops the pool with MissingDependencies
/// naming it; once it exists the pool adds clusters one at a time (`maxConcurrent: 1`) up to
/// `maxSize`, and says it is at capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_waits_for_its_secrets_then_fills_within_max_concurrent_and_max_size() {
    let (fleet, tenant) = setup().await;
    let image = "quay.io/example/slow-installer:1";
    fleet
        .host()
        .runners()
        .register(ImageMatch::Exact(image.into()), |ctx: &JobContext| {
            if ctx.args.first().map(String::as_str) == Some("destroy") {
                return JobOutcome::success("");
            }
            create_cluster(ctx).after(Duration::from_millis(300))
        });
    let mut spec = pool_json("p", 3, None);
    spec["spec"]["installerImage"] = json!(image);
    spec["spec"]["pullSecretRef"] = json!({"name": "late-pull"});
    spec["spec"]["maxSize"] = json!(2);
    spec["spec"]["maxConcurrent"] = json!(1);
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("MissingDependencies", WITHIN, &daemon, || async {
        pool_condition(&pool(&tenant, "p").await, "MissingDependencies")
            .is_some_and(|(status, _, message)| status == "True" && message.contains("pull Secret late-pull"))
    })
    .await;
    assert!(cds(&tenant, "p").await.is_empty());
    assert!(pool_namespaces(&tenant, "p").await.is_empty());
    // Waiting writes nothing (issue 18 part 5); it reads the Secrets again, which are not watched.
    writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    let (tenant_writes, host_writes) =
        writes_when_woken(&fleet, &daemon, &pools(&tenant), "p", &["clusterpool"], &[]).await;
    assert!(
        tenant_writes.is_empty() && host_writes.is_empty(),
        "tenant writes {tenant_writes:?}, host writes {host_writes:?}"
    );
    let secret: Secret =
        serde_json::from_value(json!({"metadata": {"name": "late-pull"}, "stringData": {".dockerconfigjson": "{}"}}))
            .unwrap();
    Api::<Secret>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    until("the pool to fill", WITHIN, &daemon, || async {
        let all = cds(&tenant, "p").await;
        let installing = all
            .iter()
            .filter(|cd| !cd.status.as_ref().is_some_and(|s| s.installed))
            .count();
        assert!(installing <= 1, "maxConcurrent 1: {installing} installing at once");
        assert!(all.len() <= 2, "maxSize 2: {} clusters", all.len());
        ready(&tenant, "p").await == 2
    })
    .await;
    until("MaxCapacity", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "p").await;
        pool_condition(&pool, "CapacityAvailable").is_some_and(|(s, r, _)| s == "False" && r == "MaxCapacity")
            && pool_condition(&pool, "MissingDependencies").is_some_and(|(s, _, _)| s == "False")
    })
    .await;
}

/// Bad input is reported, not acted on: a claim naming a pool that does not exist, and a pool whose
/// name leaves no room for its clusters' names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_without_a_pool_and_a_pool_with_a_too_long_name_are_reported() {
    let (fleet, tenant) = setup().await;
    create_claim(&tenant, "orphan", "nowhere", None).await;
    let long = "p".repeat(58);
    create_pool(&tenant, pool_json(&long, 1, None)).await;
    let daemon = daemon(&fleet, &[]);
    until("the claim reported", WITHIN, &daemon, || async {
        let claim = claims(&tenant).get("orphan").await.unwrap();
        let conditions = claim.status.map(|s| s.conditions).unwrap_or_default();
        condition(&conditions, "Pending").is_some_and(|c| {
            c.status == "True"
                && c.reason == "ClusterPoolNotFound"
                && c.message.contains("ClusterPool nowhere does not exist")
        })
    })
    .await;
    until("an Event on the claim", WITHIN, &daemon, || async {
        events(&tenant, NS, "orphan")
            .await
            .iter()
            .any(|(r, _)| r == "ClusterPoolNotFound")
    })
    .await;
    until("the long name reported", WITHIN, &daemon, || async {
        pool_condition(&pool(&tenant, &long).await, "CapacityAvailable")
            .is_some_and(|(s, r, m)| s == "False" && r == "InvalidName" && m.contains("at most 57"))
    })
    .await;
    assert!(cds(&tenant, &long).await.is_empty());
    // Once the pool exists, the claim is served by it.
    create_pool(&tenant, pool_json("nowhere", 0, None)).await;
    until("the claim served", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "orphan").await.is_some()
    })
    .await;
}

/// Issue 17: a lifetime too long for any clock is refused, not a panic that restarts the tenant;
/// one too long for the schema never gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_claim_lifetime_neither_panics_nor_stops_the_tenant() {
    let (fleet, tenant) = setup().await;
    for name in ["a", "b"] {
        named_cdc(&tenant, name).await;
    }
    let mut spec = pool_json("p", 1, Some(&["a", "b"]));
    spec["spec"]["claimLifetime"] = json!({"maximum": "1h"});
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet, &[]);
    until("one ready cluster", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let too_long_for_the_schema = format!("{}h", "9".repeat(40));
    let claim: ClusterClaim = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterClaim",
        "metadata": {"name": "endless", "namespace": NS},
        "spec": {"clusterPoolName": "p", "lifetime": too_long_for_the_schema},
    }))
    .unwrap();
    let refused = claims(&tenant).create(&PostParams::default(), &claim).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(status)) if status.code == 422),
        "{refused:?}"
    );
    create_claim(&tenant, "absurd", "p", Some("99999999999999999999h")).await;
    until("the claim assigned", WITHIN, &daemon, || async {
        claimed_namespace(&tenant, "absurd").await.is_some()
    })
    .await;
    let status = claims(&tenant).get("absurd").await.unwrap().status.unwrap();
    assert_eq!(status.lifetime.as_deref(), Some("1h"), "the pool's maximum applies");
    until("the pool refilled", WITHIN, &daemon, || async {
        ready(&tenant, "p").await == 1
    })
    .await;
    let log = daemon.log_text();
    assert!(!log.contains("panicked"), "{log}");
    assert!(!log.contains("restarting it"), "the tenant was restarted:\n{log}");
}

/// A second reconcile of an unchanged pool and of its installed cluster writes nothing (issue 18
/// part 5): a label on the ClusterDeployment wakes the deployment and the pool controllers, and
/// neither the tenant nor the host sees a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_pool_and_its_installed_cluster_write_nothing_when_woken() {
    let (fleet, tenant) = setup().await;
    named_cdc(&tenant, "foo").await;
    create_pool(&tenant, pool_json("steady", 1, Some(&["foo"]))).await;
    let daemon = daemon(&fleet, &[]);
    until("a ready cluster built from foo", WITHIN, &daemon, || async {
        let applied = cdc_condition(&cdc(&tenant, "foo").await, "ApplySucceeded");
        ready(&tenant, "steady").await == 1 && applied.is_some_and(|(s, r, _)| s == "True" && r == "Succeeded")
    })
    .await;
    let cd = live(&cds(&tenant, "steady").await)[0].name_any();
    let cd_api = Api::<ClusterDeployment>::namespaced(tenant.clone(), &cd);
    let controllers = ["clusterdeployment", "clusterpool"];
    // The first wake-up lets whatever the last transition still had in flight land; the second is
    // the steady state.
    writes_when_woken(&fleet, &daemon, &cd_api, &cd, &controllers, &[]).await;
    let (tenant_writes, host_writes) = writes_when_woken(&fleet, &daemon, &cd_api, &cd, &controllers, &[]).await;
    assert!(
        tenant_writes.is_empty() && host_writes.is_empty(),
        "tenant writes {tenant_writes:?}, host writes {host_writes:?}\n{}",
        daemon.log_text()
    );
    // A label on the pool itself wakes only the pool controller.
    let (tenant_writes, host_writes) =
        writes_when_woken(&fleet, &daemon, &pools(&tenant), "steady", &["clusterpool"], &[]).await;
    assert!(
        tenant_writes.is_empty() && host_writes.is_empty(),
        "tenant writes {tenant_writes:?}, host writes {host_writes:?}"
    );
}
