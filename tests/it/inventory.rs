//! Failure domains (DESIGN.md §6) and the bare-metal inventory (§5), issue 9, through the daemon
//! binary against embedded host and tenant servers; the host's JobRunner plays the installer.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::{ClusterDeployment, ClusterPool, MachineFailureDomain};
use stackd::embedded::samples::{SampleImages, register_sample_runners};

use crate::harness::{self, Daemon, Fleet, until, wait_until};

pub(crate) const NS: &str = "team";
const HOST_NS: &str = "tenant-acme-controllers";
const INSTALLER: &str = "quay.io/example/installer:4.14";
pub(crate) const WITHIN: Duration = Duration::from_secs(20);

/// A host, tenant `acme` with the stackd CRDs, the pool's Secrets in namespace `team`.
pub(crate) async fn setup() -> (Fleet, Client) {
    let fleet = Fleet::start(&["acme"]).await;
    register_sample_runners(&fleet.host().runners(), &SampleImages::new("stackd:dev"));
    let tenant = fleet.tenant_server("acme").client().await;
    harness::install_crds(&tenant).await;
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("ns");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"clouds.yaml": "clouds: {}", "ssh-privatekey": "k"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
    ] {
        create_secret(&tenant, secret).await;
    }
    (fleet, tenant)
}

pub(crate) async fn create_secret(tenant: &Client, secret: Value) {
    let secret: Secret = serde_json::from_value(secret).expect("secret");
    Api::<Secret>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
}

pub(crate) fn daemon(fleet: &Fleet) -> Daemon {
    fleet.daemon(&["--lease-min-age", "2s", "--sweep-interval", "1h"])
}

pub(crate) fn pool_json(name: &str, size: i32, platform: Value) -> Value {
    json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "size": size,
            "baseDomain": "example.com",
            "installerImage": INSTALLER,
            "pullSecretRef": {"name": "pull"},
            "platform": platform,
        },
    })
}

fn openstack() -> Value {
    json!({"openstack": {"credentialsSecretRef": {"name": "creds"}, "cloud": "mycloud"}})
}

pub(crate) async fn create_pool(tenant: &Client, pool: Value) {
    let pool: ClusterPool = serde_json::from_value(pool).expect("pool");
    pools(tenant)
        .create(&PostParams::default(), &pool)
        .await
        .expect("create pool");
}

pub(crate) fn pools(tenant: &Client) -> Api<ClusterPool> {
    Api::namespaced(tenant.clone(), NS)
}

async fn pool(tenant: &Client, name: &str) -> ClusterPool {
    pools(tenant).get(name).await.expect("get pool")
}

/// The pool's ClusterDeployments, live ones only.
pub(crate) async fn cds(tenant: &Client, pool: &str) -> Vec<ClusterDeployment> {
    Api::<ClusterDeployment>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .expect("list cds")
        .items
        .into_iter()
        .filter(|cd| cd.spec.cluster_pool_ref.as_ref().is_some_and(|r| r.pool_name == pool))
        .filter(|cd| cd.metadata.deletion_timestamp.is_none())
        .collect()
}

pub(crate) fn condition_of(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<(String, String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn pool_condition(pool: &ClusterPool, type_: &str) -> Option<(String, String, String)> {
    condition_of(&pool.status.clone().unwrap_or_default().conditions, type_)
}

fn records(cd: &ClusterDeployment) -> Vec<MachineFailureDomain> {
    cd.status.clone().unwrap_or_default().failure_domains
}

fn domains_of(cd: &ClusterDeployment) -> Vec<String> {
    records(cd).into_iter().map(|r| r.name).collect()
}

async fn install_config(tenant: &Client, cd: &str) -> Value {
    let secret = Api::<Secret>::namespaced(tenant.clone(), cd)
        .get(&format!("{cd}-install-config"))
        .await
        .expect("install-config secret");
    let data = secret.data.unwrap_or_default();
    serde_saphyr::from_str(&String::from_utf8(data["install-config.yaml"].0.clone()).expect("utf-8")).expect("yaml")
}

/// Whether an Event of `object` has `reason` and a note containing `text`.
pub(crate) async fn events_say(tenant: &Client, namespace: &str, object: &str, reason: &str, text: &str) -> bool {
    events(tenant, namespace, object)
        .await
        .iter()
        .any(|(r, n)| r == reason && n.contains(text))
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

fn openstack_domains_pool(name: &str, size: i32) -> Value {
    let mut pool = pool_json(name, size, openstack());
    pool["spec"]["availabilityZones"] = json!(["fd-a", "az9"]);
    pool["spec"]["controlPlaneOmitAvailabilityZone"] = json!(true);
    pool["spec"]["failureDomains"] = json!([
        {"name": "fd-a", "computeAvailabilityZone": "nova-a", "storageAvailabilityZone": "cinder-a",
         "ports": [{"tags": ["domain-a"]}]},
        {"name": "fd-b", "computeAvailabilityZone": "nova-b", "storageAvailabilityZone": "cinder-b"},
        {"name": "fd-c", "machinePlacement": "NoControlPlane", "computeAvailabilityZone": "nova-c"},
    ]);
    pool["spec"]["controlPlane"] = json!({"replicas": 3, "rootVolume": {"size": 50}, "ports": [{"tags": ["pool"]}]});
    pool
}

/// §6: the pool's domains (discovered, omitted, overridden, NoControlPlane), three control-plane
/// machines over two eligible domains as 2+1 with the second cluster leaning the other way, the
/// records with domain ports first, the OpenStack zones in machine order, and the frozen record:
/// unchanged by a pool edit, restored after a user edit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openstack_control_planes_spread_over_failure_domains_and_keep_their_record() {
    let (fleet, tenant) = setup().await;
    create_pool(&tenant, openstack_domains_pool("os", 2)).await;
    let daemon = daemon(&fleet);
    until("two clusters with their records", WITHIN, &daemon, || async {
        let all = cds(&tenant, "os").await;
        all.len() == 2 && all.iter().all(|cd| records(cd).len() == 3)
    })
    .await;

    let status = pool(&tenant, "os").await.status.unwrap_or_default();
    let domains: Vec<(String, bool, String)> = status
        .failure_domains
        .iter()
        .map(|(n, d)| {
            let kind = serde_json::to_value(d.domain_type).unwrap();
            (n.clone(), d.control_plane, kind.as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(
        domains,
        [
            ("az9".to_string(), false, "AvailabilityZone".to_string()),
            ("fd-a".to_string(), true, "Cluster".to_string()),
            ("fd-b".to_string(), true, "Cluster".to_string()),
            ("fd-c".to_string(), false, "Cluster".to_string()),
        ],
        "discovered az9 is omitted; the explicit fd-a overrides the discovered one, flag and type"
    );

    let all = cds(&tenant, "os").await;
    let spreads: BTreeSet<Vec<String>> = all.iter().map(domains_of).collect();
    let expected: BTreeSet<Vec<String>> = [["fd-a", "fd-b", "fd-a"], ["fd-b", "fd-a", "fd-b"]]
        .iter()
        .map(|s| s.iter().map(|x| x.to_string()).collect())
        .collect();
    assert_eq!(spreads, expected, "2+1, the second cluster toward the less used domain");
    for cd in &all {
        let recorded = records(cd);
        let first = &recorded[0];
        assert_eq!(first.machine, "master-0");
        if first.name == "fd-a" {
            let tags: Vec<String> = first.ports.iter().flat_map(|p| p.tags.clone()).collect();
            assert_eq!(tags, ["domain-a", "pool"], "domain ports before the pool's");
        }
        // Machines with ports: openshift-install's TechPreview failureDomains, one per machine in
        // machine order, the domain's ports before the pool's, and no zones beside them.
        let config = install_config(&tenant, &cd.name_any()).await;
        assert_eq!(config["featureSet"], "TechPreviewNoUpgrade", "{config}");
        let openstack = &config["controlPlane"]["platform"]["openstack"];
        assert!(openstack.get("zones").is_none(), "{config}");
        assert_eq!(openstack["rootVolume"], json!({"size": 50}), "{config}");
        let rendered: Vec<Value> = recorded
            .iter()
            .map(|r| {
                let suffix = &r.name[3..];
                let mut ports = if suffix == "a" {
                    vec![json!({"id": "domain-a"})]
                } else {
                    vec![]
                };
                ports.push(json!({"id": "pool"}));
                json!({"computeAvailabilityZone": format!("nova-{suffix}"),
                       "storageAvailabilityZone": format!("cinder-{suffix}"), "portTargets": ports})
            })
            .collect();
        assert_eq!(openstack["failureDomains"], json!(rendered), "{config}");
        // Workers go to every domain, the NoControlPlane one and the omitted zone included.
        let workers: Vec<&str> = config["compute"][0]["platform"]["openstack"]["failureDomains"]
            .as_array()
            .expect("the compute pool's failure domains")
            .iter()
            .filter_map(|d| d["computeAvailabilityZone"].as_str())
            .collect();
        assert_eq!(workers, ["az9", "nova-a", "nova-b", "nova-c"], "{config}");
        assert!(cd.annotations().contains_key("pools.stackd.dev/failure-domains-hash"));
    }

    // Claim one cluster so a pool edit leaves it in place, then change the pool's definitions.
    until("a ready cluster", WITHIN, &daemon, || async {
        pool(&tenant, "os").await.status.is_some_and(|s| s.ready >= 1)
    })
    .await;
    let claim: stackd::api::pools::ClusterClaim = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterClaim",
        "metadata": {"name": "mine", "namespace": NS}, "spec": {"clusterPoolName": "os"},
    }))
    .unwrap();
    Api::<stackd::api::pools::ClusterClaim>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &claim)
        .await
        .expect("claim");
    let claimed = wait_until("the claim is assigned", WITHIN, &daemon, || async {
        cds(&tenant, "os")
            .await
            .into_iter()
            .find(|cd| cd.spec.cluster_pool_ref.as_ref().unwrap().claim_name.as_deref() == Some("mine"))
    })
    .await;
    let before = records(&claimed);
    pools(&tenant)
        .patch(
            "os",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"failureDomains": [
                {"name": "fd-a", "computeAvailabilityZone": "nova-z", "ports": [{"tags": ["other"]}]},
                {"name": "fd-b", "computeAvailabilityZone": "nova-b"},
            ]}})),
        )
        .await
        .expect("edit pool");
    let cd_api = Api::<ClusterDeployment>::namespaced(tenant.clone(), &claimed.name_any());
    until("the pool reports its new domains", WITHIN, &daemon, || async {
        !pool(&tenant, "os")
            .await
            .status
            .unwrap_or_default()
            .failure_domains
            .contains_key("fd-c")
    })
    .await;
    // Judged once the pool and its clusters were reconciled again, not after a guessed pause.
    let controllers = ["clusterpool", "clusterdeployment"];
    crate::pools::writes_when_woken(&fleet, &daemon, &cd_api, &claimed.name_any(), &controllers, &[]).await;
    assert_eq!(
        records(&cd_api.get(&claimed.name_any()).await.unwrap()),
        before,
        "the record is frozen"
    );

    // A user edit of the record is restored.
    let mut edited = cd_api.get(&claimed.name_any()).await.unwrap();
    edited.status.as_mut().unwrap().failure_domains.truncate(1);
    edited.status.as_mut().unwrap().failure_domains[0].name = "elsewhere".into();
    cd_api
        .replace_status(&claimed.name_any(), &PostParams::default(), &edited)
        .await
        .expect("edit status");
    until("the record is restored", WITHIN, &daemon, || async {
        records(&cd_api.get(&claimed.name_any()).await.unwrap()) == before
    })
    .await;
    // The Event follows the status write that restored the record.
    until("the restore told", WITHIN, &daemon, || async {
        let seen = events(&tenant, &claimed.name_any(), &claimed.name_any()).await;
        seen.iter().any(|(r, _)| r == "FailureDomainsRestored")
    })
    .await;
}

/// Issue 29 item 6 (the CAPO seed's merge rules, openshift-install's shape): without ports, the
/// control plane's compute zones and root-volume zones go to `zones` and `rootVolume.zones` in
/// machine order, a root volume without a zone of its own in its machine's compute zone; workers
/// spread over every domain, `NoControlPlane` ones included, as `compute[0]...zones`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openstack_install_config_places_root_volumes_and_workers_in_the_domains() {
    let (fleet, tenant) = setup().await;
    let mut spec = pool_json("os", 1, openstack());
    spec["spec"]["failureDomains"] = json!([
        {"name": "fd-a", "computeAvailabilityZone": "nova-a", "storageAvailabilityZone": "cinder-a"},
        {"name": "fd-b", "computeAvailabilityZone": "nova-b"},
        {"name": "fd-w", "machinePlacement": "NoControlPlane", "computeAvailabilityZone": "nova-w"},
    ]);
    spec["spec"]["controlPlane"] = json!({"replicas": 3, "rootVolume": {"size": 100, "type": "ssd"}});
    spec["spec"]["compute"] = json!({"replicas": 5});
    create_pool(&tenant, spec).await;
    let daemon = daemon(&fleet);
    let cd = wait_until("a cluster with its record", WITHIN, &daemon, || async {
        cds(&tenant, "os").await.into_iter().find(|cd| records(cd).len() == 3)
    })
    .await;
    assert_eq!(domains_of(&cd), ["fd-a", "fd-b", "fd-a"]);
    let config = install_config(&tenant, &cd.name_any()).await;
    assert!(config.get("featureSet").is_none(), "no ports, no TechPreview: {config}");
    let openstack = &config["controlPlane"]["platform"]["openstack"];
    assert_eq!(openstack["zones"], json!(["nova-a", "nova-b", "nova-a"]), "{config}");
    assert_eq!(
        openstack["rootVolume"],
        json!({"size": 100, "type": "ssd", "zones": ["cinder-a", "nova-b", "cinder-a"]}),
        "fd-b has no storage zone: its machine's volume goes to its compute zone"
    );
    assert!(openstack.get("failureDomains").is_none());
    assert_eq!(
        records(&cd)[1].storage_availability_zone.as_deref(),
        Some("nova-b"),
        "the record says where the volume went"
    );
    assert_eq!(config["compute"][0]["replicas"], 5);
    assert_eq!(
        config["compute"][0]["platform"]["openstack"]["zones"],
        json!(["nova-a", "nova-b", "nova-w"]),
        "{config}"
    );
}

/// Writes what an older stackd left: cluster `name` of pool `pool` (its namespace marked as the
/// pool marks them), built from CDC `cdc`, whose install-config Secret says its machines cannot be
/// placed, and the CDC leased for it.
async fn cluster_of_an_older_stackd(tenant: &Client, pool: &ClusterPool, name: &str, cdc: &str) {
    let uid = pool.uid().expect("uid");
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {"pools.stackd.dev/clusterpool-namespace": NS, "pools.stackd.dev/clusterpool-name": pool.name_any()},
        "annotations": {"pools.stackd.dev/clusterpool-uid": uid}}}))
    .expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("namespace");
    let secrets = Api::<Secret>::namespaced(tenant.clone(), name);
    for secret in [
        json!({"metadata": {"name": format!("{name}-install-config")}, "stringData": {
            "install-config.yaml": "apiVersion: v1\n",
            "invalid-machine-spec": "machine master-0: failure domain fd-a sets storageAvailabilityZone cinder-a and controlPlane.rootVolume.availabilityZone is cinder-x; remove one of them"}}),
        json!({"metadata": {"name": format!("{name}-credentials")}, "stringData": {"clouds.yaml": "clouds: {}"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
    let version = stackd::pools::pool::pool_version(pool);
    let cd: ClusterDeployment = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": name, "namespace": name,
            "labels": {"pools.stackd.dev/clusterpool-namespace": NS, "pools.stackd.dev/clusterpool-name": pool.name_any()},
            "annotations": {"pools.stackd.dev/pool-version": version, "pools.stackd.dev/customization-generation": "1"}},
        "spec": {"clusterName": name, "baseDomain": "example.com",
            "platform": {"openstack": {"credentialsSecretRef": {"name": format!("{name}-credentials")}, "cloud": "mycloud"}},
            "provisioning": {"installConfigSecretRef": {"name": format!("{name}-install-config")}, "installerImage": INSTALLER},
            "clusterPoolRef": {"namespace": NS, "poolName": pool.name_any(), "clusterDeploymentCustomization": {"name": cdc}}},
    }))
    .expect("cluster");
    Api::<ClusterDeployment>::namespaced(tenant.clone(), name)
        .create(&PostParams::default(), &cd)
        .await
        .expect("cluster");
    crate::pools::reserve(tenant, cdc, &pool.name_any(), name, Duration::ZERO).await;
}

/// §6 merge rules and issue 29 item 7: a domain storage zone with an explicit root-volume zone is a
/// contradiction of the pool's: `FailureDomainsValid=False` names it, `CapacityAvailable=False`, one
/// Event, and no cluster is made while it stands. A cluster an older stackd made with it (stopped
/// `InvalidMachineSpec`, no installer Job) does not keep its inventory entry: it is deleted and its
/// CDC released. Fixed, the pool fills. vSphere pools with failure domains say
/// `FailureDomainsUnsupported`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contradicting_failure_domains_are_the_pools_to_report_and_hold_no_inventory_entry() {
    let (fleet, tenant) = setup().await;
    crate::pools::named_cdc(&tenant, "a").await;
    let mut pool_value = openstack_domains_pool("bad", 1);
    pool_value["spec"]["controlPlane"]["rootVolume"]["availabilityZone"] = json!("cinder-x");
    pool_value["spec"]["inventory"] = json!([{"name": "a"}]);
    create_pool(&tenant, pool_value).await;
    cluster_of_an_older_stackd(&tenant, &pool(&tenant, "bad").await, "bad-old00", "a").await;
    let mut vsphere = pool_json(
        "vs",
        0,
        json!({"vsphere": {"credentialsSecretRef": {"name": "creds"},
            "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}}),
    );
    vsphere["spec"]["availabilityZones"] = json!(["az1"]);
    create_pool(&tenant, vsphere).await;
    let daemon = daemon(&fleet);
    until("the pool names the contradiction", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "bad").await;
        let valid = pool_condition(&pool, "FailureDomainsValid").is_some_and(|(s, r, m)| {
            s == "False"
                && r == "InvalidMachineSpec"
                && m.contains("failure domain fd-a sets storageAvailabilityZone cinder-a")
                && m.contains("controlPlane.rootVolume.availabilityZone is cinder-x")
        });
        let capacity = pool_condition(&pool, "CapacityAvailable")
            .is_some_and(|(s, r, _)| s == "False" && r == "InvalidMachineSpec");
        valid && capacity
    })
    .await;
    // The older stackd's cluster is stopped, deleted, and gives its entry back.
    until(
        "the stopped cluster gone and its CDC released",
        WITHIN,
        &daemon,
        || async {
            let released = crate::pools::cdc_condition(&crate::pools::cdc(&tenant, "a").await, "Available")
                .is_some_and(|(s, _, _)| s == "True");
            cds(&tenant, "bad").await.is_empty() && released
        },
    )
    .await;
    // Published right after the delete call, so it may trail the cluster's disappearance.
    until("the pool's Event on the deleted cluster", WITHIN, &daemon, || {
        events_say(&tenant, NS, "bad", "ClusterDeleted", "bad-old00")
    })
    .await;
    let deleted = events(&tenant, NS, "bad").await;
    assert!(
        deleted
            .iter()
            .any(|(r, n)| r == "ClusterDeleted" && n.contains("bad-old00") && n.contains("InvalidMachineSpec")),
        "{deleted:?}"
    );
    until("vSphere refuses failure domains", WITHIN, &daemon, || async {
        pool_condition(&pool(&tenant, "vs").await, "FailureDomainsUnsupported").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    // Judged after the pool's next reconciles, not a guessed pause: nothing is made meanwhile.
    for _ in 0..2 {
        crate::pools::writes_when_woken(&fleet, &daemon, &pools(&tenant), "bad", &["clusterpool"], &[]).await;
    }
    let made = Api::<ClusterDeployment>::all(tenant.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        made.items.is_empty(),
        "{:?}",
        made.items.iter().map(|cd| cd.name_any()).collect::<Vec<_>>()
    );
    let jobs = Api::<Job>::namespaced(fleet.host().client().await, HOST_NS)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        jobs.items.iter().all(|j| !j.name_any().contains("-install-")),
        "no installer Job: {:?}",
        jobs.items.iter().map(|j| j.name_any()).collect::<Vec<_>>()
    );
    assert_eq!(
        crate::pools_seeds::event_count(&tenant, NS, "bad", "InvalidMachineSpec").await,
        1,
        "told once"
    );

    // Fixed: the condition says so and the pool fills from its entry.
    pools(&tenant)
        .patch(
            "bad",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"controlPlane": {"rootVolume": {"availabilityZone": null}}}})),
        )
        .await
        .expect("fix the pool");
    until("a cluster from a, the domains valid", WITHIN, &daemon, || async {
        let pool = pool(&tenant, "bad").await;
        let valid = pool_condition(&pool, "FailureDomainsValid").is_some_and(|(s, _, _)| s == "True");
        let from_a = cds(&tenant, "bad")
            .await
            .iter()
            .any(|cd| crate::pools::cdc_of(cd).as_deref() == Some("a"));
        valid && from_a
    })
    .await;
}

pub(crate) fn assets(tenant: &Client) -> Api<BareMetalAsset> {
    Api::namespaced(tenant.clone(), NS)
}

pub(crate) async fn create_asset(tenant: &Client, name: &str, spec: Value) {
    let mut full = json!({"bmc": {"address": format!("ipmi://10.0.0.1/{name}"), "credentialsName": format!("bmc-{name}")},
        "bootMACAddress": "00:1B:44:11:3A:B7"});
    for (k, v) in spec.as_object().unwrap() {
        full[k] = v.clone();
    }
    let asset: BareMetalAsset = serde_json::from_value(json!({
        "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
        "metadata": {"name": name, "namespace": NS}, "spec": full,
    }))
    .expect("asset");
    assets(tenant)
        .create(&PostParams::default(), &asset)
        .await
        .expect("create asset");
}

pub(crate) async fn bmc_secret(tenant: &Client, name: &str) {
    create_secret(
        tenant,
        json!({"metadata": {"name": format!("bmc-{name}")}, "stringData": {"username": "admin", "password": "s3cret"}}),
    )
    .await;
}

pub(crate) fn asset_condition(asset: &BareMetalAsset, type_: &str) -> Option<(String, String, String)> {
    condition_of(&asset.status.clone().unwrap_or_default().conditions, type_)
}

/// §5: labels follow role and cluster; a missing credentials Secret is named in
/// `CredentialsFound=False` (with an Event) and recovers when it appears; the asset owns its
/// Secret only when nobody else does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assets_mirror_labels_check_credentials_and_own_only_unowned_secrets() {
    let (fleet, tenant) = setup().await;
    create_asset(&tenant, "a1", json!({"role": "master"})).await;
    create_asset(&tenant, "a2", json!({})).await;
    // The Secret of a2 belongs to something else (a real object, or the garbage collector takes it).
    let owner: k8s_openapi::api::core::v1::ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "inventory-sync"}})).unwrap();
    let owner = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(tenant.clone(), NS)
        .create(&PostParams::default(), &owner)
        .await
        .expect("configmap");
    create_secret(
        &tenant,
        json!({"metadata": {"name": "bmc-a2", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
            "name": "inventory-sync", "uid": owner.metadata.uid}]},
            "stringData": {"username": "admin", "password": "s3cret"}}),
    )
    .await;
    let daemon = daemon(&fleet);
    until("a1 says its Secret is missing", WITHIN, &daemon, || async {
        let a1 = assets(&tenant).get("a1").await.unwrap();
        asset_condition(&a1, "CredentialsFound")
            .is_some_and(|(s, r, m)| s == "False" && r == "SecretNotFound" && m.contains("bmc-a1"))
    })
    .await;
    let a1 = assets(&tenant).get("a1").await.unwrap();
    assert_eq!(
        a1.labels().get("inventory.stackd.dev/role").map(String::as_str),
        Some("master")
    );
    assert!(!a1.labels().contains_key("inventory.stackd.dev/cluster"));
    assert_eq!(
        asset_condition(&a1, "ClusterDeploymentFound").map(|c| c.1),
        Some("NoneSpecified".to_string())
    );
    // The daemon writes the status first, then its Events.
    until("a1's Event names the missing Secret", WITHIN, &daemon, || {
        events_say(&tenant, NS, "a1", "CredentialsNotFound", "bmc-a1")
    })
    .await;

    bmc_secret(&tenant, "a1").await;
    until("a1 finds its Secret", WITHIN, &daemon, || async {
        let a1 = assets(&tenant).get("a1").await.unwrap();
        asset_condition(&a1, "CredentialsFound").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    let secrets = Api::<Secret>::namespaced(tenant.clone(), NS);
    until("a1 owns its Secret", WITHIN, &daemon, || async {
        let owners = secrets.get("bmc-a1").await.unwrap().owner_references().to_vec();
        owners.len() == 1 && owners[0].name == "a1" && owners[0].controller == Some(true)
    })
    .await;
    until("a2 finds its Secret", WITHIN, &daemon, || async {
        let a2 = assets(&tenant).get("a2").await.unwrap();
        asset_condition(&a2, "CredentialsFound").is_some_and(|(s, _, _)| s == "True")
    })
    .await;
    let owners = secrets.get("bmc-a2").await.unwrap().owner_references().to_vec();
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].kind, "ConfigMap", "a Secret owned elsewhere is not re-owned");
    let a2 = assets(&tenant).get("a2").await.unwrap();
    assert_eq!(
        a2.labels().get("inventory.stackd.dev/role").map(String::as_str),
        Some("")
    );

    // Assigned, the cluster label follows (and says the ClusterDeployment is missing); unassigned
    // it goes; a role change follows.
    let set = |spec: Value| {
        let api = assets(&tenant);
        async move {
            api.patch("a1", &PatchParams::default(), &Patch::Merge(json!({"spec": spec})))
                .await
                .expect("patch asset");
        }
    };
    set(json!({"clusterName": "c1"})).await;
    until("a1 carries its cluster label", WITHIN, &daemon, || async {
        let a1 = assets(&tenant).get("a1").await.unwrap();
        a1.labels().get("inventory.stackd.dev/cluster").map(String::as_str) == Some("c1")
            && asset_condition(&a1, "ClusterDeploymentFound")
                .is_some_and(|(s, r, _)| s == "False" && r == "ClusterDeploymentNotFound")
    })
    .await;
    set(json!({"clusterName": "", "role": "worker"})).await;
    until("a1's labels follow the spec", WITHIN, &daemon, || async {
        let a1 = assets(&tenant).get("a1").await.unwrap();
        !a1.labels().contains_key("inventory.stackd.dev/cluster")
            && a1.labels().get("inventory.stackd.dev/role").map(String::as_str) == Some("worker")
    })
    .await;
}

pub(crate) fn baremetal_pool(name: &str, size: i32, masters: i32, workers: i32) -> Value {
    let mut pool = pool_json(
        name,
        size,
        json!({"baremetal": {"credentialsSecretRef": {"name": "creds"}, "apiVIPs": ["10.0.0.5"]}}),
    );
    pool["spec"]["controlPlane"] = json!({"replicas": masters});
    pool["spec"]["compute"] = json!({"replicas": workers});
    pool["spec"]["hostSelector"] = json!({"matchLabels": {"site": "lab"}});
    pool
}

pub(crate) async fn lab_asset(tenant: &Client, name: &str, role: Option<&str>, domain: Option<&str>) {
    let mut spec = json!({});
    if let Some(role) = role {
        spec["role"] = json!(role);
    }
    if let Some(domain) = domain {
        spec["failureDomain"] = json!(domain);
    }
    create_asset(tenant, name, spec).await;
    bmc_secret(tenant, name).await;
    assets(tenant)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"site": "lab"}}})),
        )
        .await
        .expect("label asset");
}

/// Asset name → the cluster it is assigned to.
async fn assignments(tenant: &Client) -> std::collections::BTreeMap<String, String> {
    assets(tenant)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|a| Some((a.name_any(), a.spec.assigned_cluster()?.to_string())))
        .collect()
}

/// §5 selection and §6 rendering for baremetal: 3 masters and 2 workers from 3 master, 1 worker
/// and 2 role-less assets (a role-less one only for the missing worker), spread over the assets'
/// domains, rendered as `platform.baremetal.hosts`; scaling the pool to 0 deletes the cluster and
/// its hosts go back to the inventory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baremetal_pool_takes_hosts_by_role_and_releases_them_with_the_cluster() {
    let (fleet, tenant) = setup().await;
    for (name, role, domain) in [
        ("m1", Some("master"), Some("rack-a")),
        ("m2", Some("master"), Some("rack-b")),
        ("m3", Some("master"), Some("rack-c")),
        ("w1", Some("worker"), None),
        ("x1", None, None),
        ("x2", None, None),
    ] {
        lab_asset(&tenant, name, role, domain).await;
    }
    // Not selected by the pool.
    create_asset(&tenant, "other", json!({"role": "worker"})).await;
    create_pool(&tenant, baremetal_pool("metal", 1, 3, 2)).await;
    let daemon = daemon(&fleet);
    let cd = wait_until("a cluster with its hosts", WITHIN, &daemon, || async {
        cds(&tenant, "metal")
            .await
            .into_iter()
            .find(|cd| records(cd).len() == 3)
    })
    .await;
    let hosts: Vec<(String, String)> = cd
        .spec
        .hosts
        .iter()
        .map(|h| {
            (
                h.name.clone(),
                serde_json::to_value(h.role).unwrap().as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = [
        ("m1", "master"),
        ("m2", "master"),
        ("m3", "master"),
        ("w1", "worker"),
        ("x1", "worker"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(hosts, expected);
    let taken = assignments(&tenant).await;
    assert_eq!(
        taken.keys().map(String::as_str).collect::<Vec<_>>(),
        ["m1", "m2", "m3", "w1", "x1"]
    );
    assert!(taken.values().all(|c| *c == cd.name_any()));
    let m1 = assets(&tenant).get("m1").await.unwrap();
    assert_eq!(
        m1.labels().get("inventory.stackd.dev/cluster"),
        Some(&cd.name_any()),
        "the assignment labels the asset"
    );
    let racks: Vec<String> = records(&cd).into_iter().map(|r| r.name).collect();
    assert_eq!(racks, ["rack-a", "rack-b", "rack-c"]);
    let status = pool(&tenant, "metal").await.status.unwrap_or_default();
    assert_eq!(
        status.failure_domains.keys().map(String::as_str).collect::<Vec<_>>(),
        ["rack-a", "rack-b", "rack-c"]
    );
    let config = install_config(&tenant, &cd.name_any()).await;
    let rendered = config["platform"]["baremetal"]["hosts"]
        .as_array()
        .expect("hosts")
        .clone();
    assert_eq!(rendered.len(), 5, "{config}");
    assert_eq!(rendered[0]["name"], "m1");
    assert_eq!(rendered[0]["role"], "master");
    assert_eq!(rendered[0]["bootMACAddress"], "00:1B:44:11:3A:B7");
    assert_eq!(rendered[0]["bmc"]["address"], "ipmi://10.0.0.1/m1");
    assert_eq!(rendered[4]["role"], "worker");
    assert_eq!(config["platform"]["baremetal"]["apiVIPs"], json!(["10.0.0.5"]));

    pools(&tenant)
        .patch(
            "metal",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 0}})),
        )
        .await
        .unwrap();
    until("the hosts are released with the cluster", WITHIN, &daemon, || async {
        cds(&tenant, "metal").await.is_empty() && assignments(&tenant).await.is_empty()
    })
    .await;
    let m1 = assets(&tenant).get("m1").await.unwrap();
    assert!(!m1.labels().contains_key("inventory.stackd.dev/cluster"));

    // A failure domain that goes leaves the pool's status too.
    let zones = |zones: Value| {
        let api = pools(&tenant);
        async move {
            let patch = json!({"spec": {"availabilityZones": zones}});
            api.patch("metal", &PatchParams::default(), &Patch::Merge(patch))
                .await
                .expect("zones");
        }
    };
    let domains = || async {
        let status = pool(&tenant, "metal").await.status.unwrap_or_default();
        status.failure_domains.into_keys().collect::<Vec<_>>()
    };
    zones(json!(["zone-z"])).await;
    until("zone-z is a failure domain", WITHIN, &daemon, || async {
        domains().await.contains(&"zone-z".to_string())
    })
    .await;
    zones(Value::Null).await;
    until("zone-z is no failure domain any more", WITHIN, &daemon, || async {
        domains().await == ["rack-a", "rack-b", "rack-c"]
    })
    .await;
}

/// §5: with too few hosts no cluster is made, nothing stays assigned and the pool says
/// `InsufficientHosts`; one more master lets it proceed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_hosts_leave_nothing_assigned_and_say_insufficient_hosts() {
    let (fleet, tenant) = setup().await;
    for (name, role) in [("m1", Some("master")), ("m2", Some("master")), ("w1", Some("worker"))] {
        lab_asset(&tenant, name, role, None).await;
    }
    create_pool(&tenant, baremetal_pool("metal", 1, 3, 1)).await;
    let daemon = daemon(&fleet);
    until("the pool says InsufficientHosts", WITHIN, &daemon, || async {
        pool_condition(&pool(&tenant, "metal").await, "CapacityAvailable")
            .is_some_and(|(s, r, m)| s == "False" && r == "InsufficientHosts" && m.contains("only 2 and 1"))
    })
    .await;
    assert!(assignments(&tenant).await.is_empty(), "nothing stays assigned");
    assert!(cds(&tenant, "metal").await.is_empty());
    lab_asset(&tenant, "x1", None, None).await;
    until("a cluster once a role-less host fills in", WITHIN, &daemon, || async {
        assignments(&tenant).await.len() == 4 && cds(&tenant, "metal").await.len() == 1
    })
    .await;
}

/// §5: two daemons filling one baremetal pool at once never assign one asset twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_racing_daemons_never_assign_one_asset_twice() {
    let (fleet, tenant) = setup().await;
    for i in 0..7 {
        lab_asset(&tenant, &format!("h{i}"), None, None).await;
    }
    create_pool(&tenant, baremetal_pool("metal", 2, 3, 0)).await;
    let first = daemon(&fleet);
    let second = daemon(&fleet);
    until("two ready clusters", Duration::from_secs(40), &first, || async {
        let all = cds(&tenant, "metal").await;
        all.len() == 2 && all.iter().all(|cd| cd.status.as_ref().is_some_and(|s| s.installed))
    })
    .await;
    // Settle: a losing daemon's extra cluster (if any) is deleted and its hosts released.
    until(
        "every assignment belongs to a live cluster listing it",
        WITHIN,
        &second,
        || async {
            let all = cds(&tenant, "metal").await;
            let taken = assignments(&tenant).await;
            taken.len() == 6
                && taken.iter().all(|(asset, cd)| {
                    all.iter()
                        .any(|c| c.name_any() == *cd && c.spec.hosts.iter().any(|h| h.name == *asset))
                })
        },
    )
    .await;
    let all = cds(&tenant, "metal").await;
    let mut seen = BTreeSet::new();
    for cd in &all {
        for host in &cd.spec.hosts {
            assert!(seen.insert(host.name.clone()), "{} is in two clusters", host.name);
        }
    }
    assert_eq!(seen.len(), 6);
}

/// The embedded "managed cluster" an installed cluster's kubeconfig points at, with the fixtures a
/// real one has: a minimal BareMetalHost CRD and the `openshift-machine-api` namespace.
pub(crate) async fn managed_cluster() -> (stackd::embedded::ApiServer, Client) {
    let server = stackd::embedded::ApiServer::start(stackd::embedded::ServerOptions {
        name: "managed".into(),
        ..Default::default()
    })
    .await
    .expect("managed cluster");
    let client = server.client().await;
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": "baremetalhosts.metal3.io"},
        "spec": {
            "group": "metal3.io",
            "names": {"kind": "BareMetalHost", "listKind": "BareMetalHostList", "plural": "baremetalhosts",
                "singular": "baremetalhost", "shortNames": ["bmh"]},
            "scope": "Namespaced",
            "versions": [{"name": "v1alpha1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    }))
    .unwrap();
    Api::<CustomResourceDefinition>::all(client.clone())
        .create(&PostParams::default(), &crd)
        .await
        .expect("bmh crd");
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "openshift-machine-api"}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("machine api namespace");
    (server, client)
}

pub(crate) fn bmh_api(client: &Client) -> Api<kube::api::DynamicObject> {
    let resource = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("metal3.io", "v1alpha1", "BareMetalHost"),
        "baremetalhosts",
    );
    Api::namespaced_with(client.clone(), "openshift-machine-api", &resource)
}

pub(crate) async fn bmh(client: &Client, name: &str) -> Option<kube::api::DynamicObject> {
    bmh_api(client).get_opt(name).await.expect("get bmh")
}

pub(crate) async fn remote_secret(client: &Client, name: &str) -> Option<Secret> {
    Api::<Secret>::namespaced(client.clone(), "openshift-machine-api")
        .get_opt(&format!("{name}-bmc-secret"))
        .await
        .expect("get secret")
}

pub(crate) const METAL_IMAGE: &str = "quay.io/example/metal-installer:4.14";

/// The installer [`METAL_IMAGE`] plays: its clusters are all `managed`.
pub(crate) fn metal_installer(fleet: &Fleet, managed: &stackd::embedded::ApiServer) {
    cluster_installer(fleet, METAL_IMAGE, managed.kubeconfig_yaml());
}

/// An installer `image` whose clusters' admin kubeconfig is `kubeconfig`.
pub(crate) fn cluster_installer(fleet: &Fleet, image: &str, kubeconfig: String) {
    fleet.host().runners().register(
        stackd::embedded::controller_manager::ImageMatch::Exact(image.into()),
        move |ctx: &stackd::embedded::controller_manager::JobContext| {
            use stackd::embedded::controller_manager::JobOutcome;
            if ctx.pod.to_string().contains("\"destroy\"") {
                return JobOutcome::success("destroyed\n");
            }
            let (Some(ns), Some(secret)) = (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET")) else {
                return JobOutcome::failure(1, "no output secret\n");
            };
            let data = std::collections::BTreeMap::from([
                ("kubeconfig".to_string(), kubeconfig.clone()),
                ("metadata.json".to_string(), json!({"infraID": "metal-x1"}).to_string()),
            ]);
            match ctx.write_secret_data(ns, secret, &data) {
                Ok(_) => JobOutcome::success("Install complete!\n"),
                Err(e) => JobOutcome::failure(1, format!("{}\n", e.message)),
            }
        },
    );
}

/// §5 delivery: the installed cluster gets a BareMetalHost per asset with its Secret (one the
/// installer made is adopted, its power state left alone); BMC address, credentials and a new boot
/// MAC follow; unassigning or deleting an asset removes both there before the asset lets go; an
/// asset assigned by hand is delivered; deleting the cluster releases its assets without touching
/// the destroyed cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assets_are_delivered_to_the_installed_cluster_and_detached_from_it() {
    let (fleet, tenant) = setup().await;
    let (_managed, remote) = managed_cluster().await;
    metal_installer(&fleet, &_managed);
    // The installer made m1's host already (not online); it is adopted, not recreated.
    let made: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "metal3.io/v1alpha1", "kind": "BareMetalHost",
        "metadata": {"name": "m1", "namespace": "openshift-machine-api"},
        "spec": {"bootMACAddress": "00:1B:44:11:3A:B7", "online": false, "bmc": {"address": "ipmi://old"}},
    }))
    .unwrap();
    let made = bmh_api(&remote).create(&PostParams::default(), &made).await.unwrap();
    lab_asset(&tenant, "m1", Some("master"), None).await;
    lab_asset(&tenant, "w1", Some("worker"), None).await;
    let mut pool_value = baremetal_pool("metal", 1, 1, 1);
    pool_value["spec"]["installerImage"] = json!(METAL_IMAGE);
    create_pool(&tenant, pool_value).await;
    let daemon = daemon(&fleet);

    until(
        "both hosts are on the cluster with their Secrets",
        WITHIN,
        &daemon,
        || async {
            let m1 = bmh(&remote, "m1").await;
            let w1 = bmh(&remote, "w1").await;
            m1.is_some_and(|h| h.data["spec"]["bmc"]["credentialsName"] == "m1-bmc-secret")
                && w1.is_some()
                && remote_secret(&remote, "m1").await.is_some()
                && remote_secret(&remote, "w1").await.is_some()
        },
    )
    .await;
    let cd = cds(&tenant, "metal").await.remove(0);
    let m1 = bmh(&remote, "m1").await.unwrap();
    assert_eq!(m1.metadata.uid, made.metadata.uid, "adopted, not recreated");
    assert_eq!(m1.data["spec"]["online"], false, "the power state stays the cluster's");
    assert_eq!(m1.data["spec"]["bmc"]["address"], "ipmi://10.0.0.1/m1");
    assert_eq!(m1.labels().get("inventory.stackd.dev/cluster"), Some(&cd.name_any()));
    let w1 = bmh(&remote, "w1").await.unwrap();
    assert_eq!(w1.data["spec"]["online"], true, "online on create");
    let secret = remote_secret(&remote, "w1").await.unwrap();
    assert_eq!(secret.data.unwrap()["password"].0, b"s3cret");
    until("w1 says HostCreated", WITHIN, &daemon, || async {
        let w1 = assets(&tenant).get("w1").await.unwrap();
        asset_condition(&w1, "HostCreated").is_some_and(|(s, _, _)| s == "True")
            && w1.finalizers().iter().any(|f| f == "inventory.stackd.dev/delivery")
    })
    .await;

    // Changes follow: BMC address, credentials; a new boot MAC replaces the host.
    let patch_asset = |name: &'static str, spec: Value| {
        let api = assets(&tenant);
        async move {
            api.patch(name, &PatchParams::default(), &Patch::Merge(json!({"spec": spec})))
                .await
                .expect("patch asset");
        }
    };
    patch_asset("w1", json!({"bmc": {"address": "redfish://10.0.0.9/w1"}})).await;
    Api::<Secret>::namespaced(tenant.clone(), NS)
        .patch(
            "bmc-w1",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"password": "rotated"}})),
        )
        .await
        .unwrap();
    until("the address and credentials follow", WITHIN, &daemon, || async {
        let address = bmh(&remote, "w1")
            .await
            .map(|h| h.data["spec"]["bmc"]["address"].clone());
        let password = remote_secret(&remote, "w1")
            .await
            .and_then(|s| s.data)
            .map(|d| d["password"].0.clone());
        address == Some(json!("redfish://10.0.0.9/w1")) && password.as_deref() == Some(&b"rotated"[..])
    })
    .await;
    patch_asset("w1", json!({"bootMACAddress": "00:1B:44:11:3A:C8"})).await;
    until("a new boot MAC replaces the host", WITHIN, &daemon, || async {
        bmh(&remote, "w1").await.is_some_and(|h| {
            h.metadata.uid != w1.metadata.uid && h.data["spec"]["bootMACAddress"] == "00:1B:44:11:3A:C8"
        })
    })
    .await;

    // Unassigning detaches: gone from the cluster, then the asset lets go.
    patch_asset("w1", json!({"clusterName": ""})).await;
    until("w1 is detached", WITHIN, &daemon, || async {
        let asset = assets(&tenant).get("w1").await.unwrap();
        bmh(&remote, "w1").await.is_none()
            && remote_secret(&remote, "w1").await.is_none()
            && asset.finalizers().is_empty()
            && !asset.labels().contains_key("inventory.stackd.dev/cluster")
    })
    .await;

    // An asset assigned by hand to the installed cluster is delivered; deleting it detaches it.
    lab_asset(&tenant, "h1", Some("worker"), None).await;
    patch_asset("h1", json!({"clusterName": cd.name_any()})).await;
    until("h1 is delivered", WITHIN, &daemon, || async {
        bmh(&remote, "h1").await.is_some()
    })
    .await;
    assets(&tenant).delete("h1", &Default::default()).await.unwrap();
    until("h1 is gone from both sides", WITHIN, &daemon, || async {
        bmh(&remote, "h1").await.is_none() && assets(&tenant).get_opt("h1").await.unwrap().is_none()
    })
    .await;

    // Deleting the cluster releases its assets; the destroyed cluster is not touched.
    pools(&tenant)
        .patch(
            "metal",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 0}})),
        )
        .await
        .unwrap();
    until("m1 is released", WITHIN, &daemon, || async {
        let asset = assets(&tenant).get("m1").await.unwrap();
        cds(&tenant, "metal").await.is_empty()
            && asset.spec.assigned_cluster().is_none()
            && asset.finalizers().is_empty()
    })
    .await;
    assert!(
        bmh(&remote, "m1").await.is_some(),
        "removal on a destroyed cluster is skipped"
    );
    let seen = events(&tenant, NS, "m1").await;
    assert!(seen.iter().any(|(r, _)| r == "ClusterDestroyed"), "{seen:?}");
}

/// §4.3.2 repair for assets: one the pool assigned to a cluster that never appeared is released
/// after the minimum lease age; one assigned by hand (not by the pool) is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assets_assigned_to_a_cluster_that_never_appeared_are_released() {
    let (fleet, tenant) = setup().await;
    lab_asset(&tenant, "g1", Some("worker"), None).await;
    lab_asset(&tenant, "g2", Some("worker"), None).await;
    for (name, annotations) in [
        (
            "g1",
            json!({"pools.stackd.dev/assigned-by": "metal", "pools.stackd.dev/assigned-at": "2020-01-01T00:00:00Z"}),
        ),
        ("g2", json!({})),
    ] {
        assets(&tenant)
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": annotations}, "spec": {"clusterName": "metal-ghost"}}),
                ),
            )
            .await
            .unwrap();
    }
    // The pool needs more than it has, so it never assigns anything itself.
    create_pool(&tenant, baremetal_pool("metal", 1, 3, 0)).await;
    let daemon = daemon(&fleet);
    until("g1 is released", WITHIN, &daemon, || async {
        assets(&tenant)
            .get("g1")
            .await
            .unwrap()
            .spec
            .assigned_cluster()
            .is_none()
    })
    .await;
    let g2 = assets(&tenant).get("g2").await.unwrap();
    assert_eq!(
        g2.spec.assigned_cluster(),
        Some("metal-ghost"),
        "a hand assignment is not the pool's"
    );
}

/// A delivered asset makes no write when woken (issue 18 part 5): with its host on the installed
/// cluster, a label on the asset wakes the asset and pool controllers; the tenant, the host and the
/// managed cluster see no write. (Delivery re-reads the host on the managed cluster each time by
/// design: that cluster is not watched, and its BareMetalHost may have been edited there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivered_asset_writes_nothing_when_woken() {
    let (fleet, tenant) = setup().await;
    let (managed, remote) = managed_cluster().await;
    metal_installer(&fleet, &managed);
    lab_asset(&tenant, "m1", Some("master"), None).await;
    let mut pool_value = baremetal_pool("metal", 1, 1, 0);
    pool_value["spec"]["installerImage"] = json!(METAL_IMAGE);
    create_pool(&tenant, pool_value).await;
    let daemon = daemon(&fleet);
    until("m1 is delivered and says HostCreated", WITHIN, &daemon, || async {
        let m1 = assets(&tenant).get("m1").await.unwrap();
        bmh(&remote, "m1").await.is_some()
            && asset_condition(&m1, "HostCreated").is_some_and(|(s, _, _)| s == "True")
            && m1.finalizers().iter().any(|f| f == "inventory.stackd.dev/delivery")
    })
    .await;
    let controllers = ["baremetalasset", "clusterpool"];
    let (api, others) = (assets(&tenant), [&managed]);
    // The first wake-up lets whatever the delivery still had in flight land.
    crate::pools::writes_when_woken(&fleet, &daemon, &api, "m1", &controllers, &others).await;
    let (tenant_writes, elsewhere) =
        crate::pools::writes_when_woken(&fleet, &daemon, &api, "m1", &controllers, &others).await;
    assert!(
        tenant_writes.is_empty() && elsewhere.is_empty(),
        "tenant writes {tenant_writes:?}, host and managed cluster writes {elsewhere:?}\n{}",
        daemon.log_text()
    );
}
