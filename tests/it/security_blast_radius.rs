//! Blast radius by construction (DESIGN.md §8, §10; issue 45): every document stackd builds from
//! tenant input is bounded before it is built, and what one namespace's objects do fails only
//! them. Each attack of the issue runs through the daemon binary against embedded host and tenant
//! servers, as a tenant user (or the installer image they chose) could perform it, at sizes CI can
//! afford; each test checks what a user sees: the condition and Event naming the limit, the daemon
//! alive, another namespace of the tenant served, nothing left behind.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::{ClusterDeployment, ClusterPool};
use stackd::embedded::controller_manager::ImageMatch;

use crate::harness::{Daemon, Fleet, until};
use crate::pools::{NS, WITHIN, create_pool, events, pool, pool_condition, pool_json, pool_namespaces, setup};

const HOST_NAMESPACE: &str = "tenant-acme-controllers";
/// The address space the daemon is capped at, as a pod's memory limit would: an unbounded
/// allocation aborts it (and spares the machine running the tests).
const DAEMON_ADDRESS_SPACE: u64 = 3 << 30;
/// The chart's memory limit: the daemon's peak stays well under it through each attack.
const CHART_MEMORY_LIMIT: u64 = 512 << 20;

/// A namespace of the same tenant with the Secrets `pool_json` names, and a pool of one cluster
/// there: the neighbour each attack must not stall.
async fn neighbour(tenant: &Client) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "other"}})).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "other");
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
}

async fn create_neighbour_pool(tenant: &Client) {
    let mut other = pool_json("q", 1, None);
    other["metadata"]["namespace"] = json!("other");
    let other: ClusterPool = serde_json::from_value(other).expect("pool");
    Api::<ClusterPool>::namespaced(tenant.clone(), "other")
        .create(&PostParams::default(), &other)
        .await
        .expect("create pool");
}

/// The neighbour's cluster got its host installer Job and installed.
async fn neighbour_installed(tenant: &Client, host: &Client) -> bool {
    let Ok(Some(pool)) = Api::<ClusterPool>::namespaced(tenant.clone(), "other")
        .get_opt("q")
        .await
    else {
        return false;
    };
    if pool.status.is_none_or(|s| s.ready != 1) {
        return false;
    }
    let jobs: Api<Job> = Api::namespaced(host.clone(), HOST_NAMESPACE);
    let listed = jobs
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    listed.iter().any(|job| job.name_any().starts_with("q-"))
}

fn daemon_up(daemon: &mut Daemon) {
    assert!(daemon.is_running(), "the daemon died:\n{}", daemon.log_text());
    let peak = daemon.peak_resident_bytes().expect("the daemon's memory");
    assert!(peak < CHART_MEMORY_LIMIT, "peak resident memory {} MiB", peak >> 20);
}

fn capacity(pool: &ClusterPool) -> Option<(String, String, String)> {
    pool_condition(pool, "CapacityAvailable")
}

/// Attack 1 of issue 45, scaled down: one BMC Secret with a 200 KB password, 40 BareMetalAssets
/// naming it and a baremetal pool whose cluster takes all 40. Rendering would inline 8 MB of
/// credentials (400 × 1 MB aborted the daemon); the render adds them up before it builds anything
/// and stops at `--max-render-bytes`: the pool says so (condition and Event naming the limit and
/// the Secret), takes no lease, host, namespace or cluster, and another namespace's pool installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_bmc_secret_named_by_many_assets_is_refused_before_the_render() {
    let (fleet, tenant) = setup().await;
    neighbour(&tenant).await;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), NS);
    let bmc: Secret = serde_json::from_value(json!({"metadata": {"name": "bmc"},
        "stringData": {"username": "admin", "password": "p".repeat(200_000)}}))
    .expect("secret");
    secrets.create(&PostParams::default(), &bmc).await.expect("bmc secret");
    let assets: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), NS);
    for i in 0..40 {
        let asset: BareMetalAsset = serde_json::from_value(json!({
            "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
            "metadata": {"name": format!("host-{i:02}"), "namespace": NS, "labels": {"site": "lab"}},
            "spec": {"bmc": {"address": format!("ipmi://10.0.0.{i}"), "credentialsName": "bmc"},
                "bootMACAddress": "00:1B:44:11:3A:B7"},
        }))
        .expect("asset");
        assets.create(&PostParams::default(), &asset).await.expect("asset");
    }
    let mut metal = pool_json("metal", 1, None);
    metal["spec"]["platform"] =
        json!({"baremetal": {"credentialsSecretRef": {"name": "creds"}, "apiVIPs": ["10.0.0.5"]}});
    metal["spec"]["controlPlane"] = json!({"replicas": 3});
    metal["spec"]["compute"] = json!({"replicas": 37});
    metal["spec"]["hostSelector"] = json!({"matchLabels": {"site": "lab"}});
    create_pool(&tenant, metal).await;
    let mut daemon = fleet.daemon_with_address_space(
        &["--lease-min-age", "2s", "--sweep-interval", "1h"],
        DAEMON_ADDRESS_SPACE,
    );
    create_neighbour_pool(&tenant).await;

    until("the pool refused naming the render bound", WITHIN, &daemon, || async {
        capacity(&pool(&tenant, "metal").await).is_some_and(|(s, r, m)| {
            s == "False" && r == "DocumentTooLarge" && m.contains("--max-render-bytes") && m.contains("Secret bmc")
        })
    })
    .await;
    until("a DocumentTooLarge Event on the pool", WITHIN, &daemon, || async {
        events(&tenant, NS, "metal")
            .await
            .iter()
            .any(|(r, n)| r == "DocumentTooLarge" && n.contains("--max-render-bytes"))
    })
    .await;
    until("another namespace's cluster installed", WITHIN, &daemon, || async {
        neighbour_installed(&tenant, &fleet.host_client).await
    })
    .await;
    // Nothing was built or taken for the refused pool.
    assert!(
        pool_namespaces(&tenant, "metal").await.is_empty(),
        "a namespace was created"
    );
    let taken: Vec<String> = assets
        .list(&ListParams::default())
        .await
        .expect("assets")
        .items
        .into_iter()
        .filter(|a| a.spec.cluster_name.is_some())
        .map(|a| a.name_any())
        .collect();
    assert!(taken.is_empty(), "assets assigned: {taken:?}");
    let message = capacity(&pool(&tenant, "metal").await).map(|c| c.2).unwrap_or_default();
    assert!(!message.contains("ppppp"), "never the value: {message}");
    daemon_up(&mut daemon);

    // An operator's lower bound on one Secret reaches the controllers: the Secret is refused as
    // it is read, naming its largest key.
    daemon.kill();
    let daemon = fleet.daemon(&[
        "--lease-min-age",
        "2s",
        "--sweep-interval",
        "1h",
        "--max-render-secret-bytes",
        "100Ki",
    ]);
    until("the pool refused naming the Secret bound", WITHIN, &daemon, || async {
        capacity(&pool(&tenant, "metal").await).is_some_and(|(s, r, m)| {
            s == "False"
                && r == "DocumentTooLarge"
                && m.contains("--max-render-secret-bytes")
                && m.contains("Secret team/bmc (its largest key password)")
        })
    })
    .await;
    assert!(
        pool_namespaces(&tenant, "metal").await.is_empty(),
        "a namespace was created"
    );
}

/// Attack 2 of issue 45, scaled down: four pools of one namespace share one 300 KB install-config
/// template, each filling from two one-operation customizations. The template is parsed once per
/// version for all of them, every cluster is created whole (each namespace the pools made holds its
/// cluster), the daemon stays within its memory, another namespace's pool installs, and once the
/// pools are deleted none of the namespaces they created is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_sharing_a_large_template_fill_and_leave_no_namespace_behind() {
    let (fleet, tenant) = setup().await;
    neighbour(&tenant).await;
    let template = format!(
        "apiVersion: v1\nadditionalTrustBundle: {}\nplatform:\n  vsphere:\n    network: VM Network\n",
        "x".repeat(300_000)
    );
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), NS);
    secrets
        .patch(
            "template",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"install-config.yaml": template}})),
        )
        .await
        .expect("template");
    let names: Vec<String> = (0..4).map(|i| format!("p{i}")).collect();
    for name in &names {
        let entries = [format!("{name}-a"), format!("{name}-b")];
        for entry in &entries {
            crate::pools::named_cdc(&tenant, entry).await;
        }
        let entries: Vec<&str> = entries.iter().map(String::as_str).collect();
        create_pool(&tenant, pool_json(name, 2, Some(&entries))).await;
    }
    let mut daemon = fleet.daemon_with_address_space(
        &["--lease-min-age", "2s", "--sweep-interval", "1h"],
        DAEMON_ADDRESS_SPACE,
    );
    create_neighbour_pool(&tenant).await;

    let within = WITHIN * 3;
    until("every pool ready", within, &daemon, || async {
        for name in &names {
            if crate::pools::ready(&tenant, name).await != 2 {
                return false;
            }
        }
        true
    })
    .await;
    until("another namespace's cluster installed", WITHIN, &daemon, || async {
        neighbour_installed(&tenant, &fleet.host_client).await
    })
    .await;
    for name in &names {
        for namespace in pool_namespaces(&tenant, name).await {
            let cds: Api<ClusterDeployment> = Api::namespaced(tenant.clone(), &namespace.name_any());
            let held = cds.list(&ListParams::default()).await.expect("cds").items.len();
            assert_eq!(held, 1, "namespace {} of pool {name}", namespace.name_any());
        }
    }
    daemon_up(&mut daemon);

    for name in &names {
        crate::pools::pools(&tenant)
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete pool");
    }
    until(
        "the pools and every namespace they created gone",
        within,
        &daemon,
        || async {
            for name in &names {
                let gone = crate::pools::pools(&tenant)
                    .get_opt(name)
                    .await
                    .ok()
                    .flatten()
                    .is_none();
                if !gone || !pool_namespaces(&tenant, name).await.is_empty() {
                    return false;
                }
            }
            true
        },
    )
    .await;
    daemon_up(&mut daemon);
}

const PADDING_INSTALLER: &str = "quay.io/example/padding-installer:1";

/// The installer [`PADDING_INSTALLER`] plays, with its own token's rights on its output Secret: it
/// installs like the sample installer, then pads the Secret to 600 KB (over the cache's 512 KiB)
/// and removes stackd's tenant-namespace annotation.
fn padding_installer(fleet: &Fleet) {
    fleet.host().runners().register(
        ImageMatch::Exact(PADDING_INSTALLER.into()),
        stackd::embedded::samples::padding_installer(600_000),
    );
}

/// A user's namespace `evil` with what a cluster installs from, and a ClusterDeployment `evil` of
/// their own there (no pool replaces it) whose installer is [`PADDING_INSTALLER`].
async fn hand_made_padded_cluster(tenant: &Client) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": "evil"}})).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "evil");
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "install-config"}, "stringData": {"install-config.yaml": "apiVersion: v1\n"}}),
    ] {
        let secret: Secret = serde_json::from_value(secret).expect("secret");
        secrets.create(&PostParams::default(), &secret).await.expect("secret");
    }
    let cd: ClusterDeployment = serde_json::from_value(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": "evil", "namespace": "evil"},
        "spec": {
            "clusterName": "evil",
            "baseDomain": "example.com",
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "install-config"}, "installerImage": PADDING_INSTALLER},
        },
    }))
    .expect("cluster deployment");
    Api::<ClusterDeployment>::namespaced(tenant.clone(), "evil")
        .create(&PostParams::default(), &cd)
        .await
        .expect("create cluster deployment");
}

/// Attack 4 of issue 45: an installer pads its output Secret past the cache's cap and strips its
/// tenant-namespace annotation. Its own cluster is refused (condition and Event naming the limit),
/// another namespace's cluster of the same tenant gets its host Job and installs meanwhile, and
/// once the attacker's cluster and namespace are gone while the daemon was down, the orphan sweep
/// after the restart removes the padded Secret, proved stackd's by the uid its input Secret
/// records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_padded_and_stripped_installer_output_fails_only_its_cluster_and_goes_with_it() {
    let (fleet, tenant) = setup().await;
    neighbour(&tenant).await;
    padding_installer(&fleet);
    hand_made_padded_cluster(&tenant).await;
    let mut daemon = crate::pools::daemon(&fleet, &[]);
    let name = "evil";
    let output = format!("{name}.{name}-output");
    let host_secrets: Api<Secret> = Api::namespaced(fleet.host_client.clone(), HOST_NAMESPACE);
    until("the installer padded its output", WITHIN, &daemon, || async {
        let found = host_secrets.get_opt(&output).await.ok().flatten();
        found.is_some_and(|s| s.data.is_some_and(|d| d.contains_key("pad")))
    })
    .await;
    // Another namespace's cluster installs while the padded Secret is on the host (an older stackd
    // held off every namespace's clusters for it).
    create_neighbour_pool(&tenant).await;
    until("another namespace's cluster installed", WITHIN, &daemon, || async {
        neighbour_installed(&tenant, &fleet.host_client).await
    })
    .await;
    let clusters: Api<ClusterDeployment> = Api::namespaced(tenant.clone(), name);
    until(
        "the cluster refused naming the cache's cap",
        WITHIN,
        &daemon,
        || async {
            let cd = clusters.get_opt(name).await.ok().flatten();
            cd.and_then(|cd| cd.status).is_some_and(|s| {
                !s.installed
                    && s.conditions.iter().any(|c| {
                        // Over the cache's cap, or (read from the server once the installer ended)
                        // over the output's own bound.
                        c.type_ == "ProvisionStopped"
                            && c.reason == "InstallerOutputRefused"
                            && (c.message.contains("--max-cached-object-bytes")
                                || c.message.contains("--max-installer-output-bytes"))
                    })
            })
        },
    )
    .await;
    until("an InstallerOutputRefused Event on it", WITHIN, &daemon, || async {
        events(&tenant, name, name)
            .await
            .iter()
            .any(|(r, n)| r == "InstallerOutputRefused" && n.contains("-bytes)"))
    })
    .await;
    daemon_up(&mut daemon);

    // The daemon goes down; the attacker's cluster and namespace go meanwhile (its finalizer
    // removed by hand, as an admin cleaning up would).
    daemon.kill();
    assert!(host_secrets.get_opt(&output).await.expect("output").is_some());
    let unfinalize = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    clusters
        .patch(name, &PatchParams::default(), &unfinalize)
        .await
        .expect("cluster finalizers");
    clusters
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete cluster");
    Api::<Namespace>::all(tenant.clone())
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete namespace");

    let restarted = fleet.daemon(&["--lease-min-age", "2s", "--sweep-interval", "2s"]);
    until(
        "the padded output Secret removed by the sweep",
        WITHIN,
        &restarted,
        || async { host_secrets.get_opt(&output).await.ok().flatten().is_none() },
    )
    .await;
}
