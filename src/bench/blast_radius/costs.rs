//! Issue 51's three costs, each made by tenant A's attacker in a namespace of its own and measured
//! alone, after B's idle round and before the other attacks, so no other work is counted with it;
//! then kept for B's attacked round. Package-sized CRDs: the daemon's resident memory grows by no
//! more than twice what A's budget is charged for them. Customizations of 100 heavy patches edited
//! four times a second: the daemon's CPU while only they are edited stays within a namespace's
//! share. Thousands of BareMetalAssets naming one missing Secret: the requests they cause on A's
//! API server stay within the lookups one namespace may cause.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::super::BenchError;
use super::attacks::{create_cdc, create_namespace, create_pool, from_json};
use super::supervisor::Supervised;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::ClusterDeploymentCustomization;
use crate::embedded::ApiServer;

/// A package CRD as the attacker's installs ship them: the ClusterPool CRD (some 40 KiB of schema)
/// in a group of its own.
const PACKAGE_CRD: &str = include_str!("../../../crds/pools.stackd.dev_clusterpools.yaml");
/// Customizations edited (the attack: 8, each four times a second).
const EDITED_CDCS: usize = 8;
/// The install-config subtree each edited customization copies and drops 49 times: a list of
/// small numbers, some 0.3 MB of YAML (a list is what costs: every element is copied).
const SUBTREE_ELEMENTS: usize = 100_000;
/// The most of one core the daemon may spend on one namespace's edits: its render share
/// (`--namespace-render-bytes-per-second`) is milliseconds of copying a second, the rest is the
/// edits' events and the pool passes they wake. Unpaced, the attack took 1.22 cores.
const EDIT_CORES_BOUND: f64 = 0.5;
/// The bench daemon's `--backoff-base` (see `fleet`), from which the Secret recheck interval follows.
const BENCH_BACKOFF_BASE: Duration = Duration::from_millis(100);
/// How long a wait for the daemon to take in what was made may last: each asset served gets a
/// status write and an Event, some minutes for thousands on a loaded machine.
const SETTLE_WITHIN: Duration = Duration::from_secs(600);

/// How large the three are.
#[derive(Clone, Copy, Debug)]
pub struct CostLoad {
    pub crds: usize,
    pub assets: usize,
    /// How often each customization is edited: the four times a second, or once in CI (a
    /// debug build's cost per event is larger, and the pacing is what is measured).
    pub edit_every: Duration,
    /// How long the CPU and request rates are measured over.
    pub window: Duration,
}

impl CostLoad {
    /// The figures (168 CRDs, 3,000 assets), or a CI size.
    pub fn new(quick: bool) -> CostLoad {
        CostLoad {
            crds: if quick { 30 } else { 168 },
            assets: if quick { 300 } else { 3000 },
            edit_every: Duration::from_millis(if quick { 1000 } else { 250 }),
            window: Duration::from_secs(if quick { 10 } else { 30 }),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CostFigures {
    /// CRDs the attacker's tenant serves more, what A's budget was charged for them, the daemon's
    /// resident growth meanwhile, and the ratio (goal at most 2).
    pub crds: usize,
    pub crd_charged_mib: f64,
    pub crd_rss_growth_mib: f64,
    pub crd_growth_of_charged: f64,
    /// The daemon's CPU (in cores) with nothing made yet, and while only the customizations are
    /// edited, less that idle figure (goal at most `edit_cores_bound`).
    pub idle_cores: f64,
    pub edits_per_s: f64,
    pub edit_cores: f64,
    pub edit_cores_bound: f64,
    /// Requests per second to A's API server in the assets' namespace once they were all told
    /// their Secret is missing, and the bound (`LOOKUPS_PER_NAMESPACE` per recheck interval).
    pub assets: usize,
    /// Assets the daemon served (told their Secret is missing); the rest were past the namespace's
    /// memory share, left out.
    pub assets_served: usize,
    pub asset_requests_per_s: f64,
    pub asset_requests_bound_per_s: f64,
}

/// Measures the three in turn; the customizations are edited on until `stop` (the returned task
/// counts the edits).
pub(super) async fn measure(
    tenant: &Client,
    server: &ApiServer,
    tenant_name: &str,
    daemon: &Supervised,
    load: CostLoad,
    stop: Arc<AtomicBool>,
) -> Result<(CostFigures, JoinHandle<Result<usize, BenchError>>), BenchError> {
    let mut figures = CostFigures {
        edit_cores_bound: EDIT_CORES_BOUND,
        ..CostFigures::default()
    };
    let (cpu, _) = daemon.usage().await;
    tokio::time::sleep(load.window).await;
    figures.idle_cores = (daemon.usage().await.0 - cpu) / load.window.as_secs_f64();

    eprintln!("bench:   {} package CRDs", load.crds);
    crds(tenant, tenant_name, daemon, load.crds, &mut figures).await?;
    eprintln!("bench:   {} assets naming a missing Secret", load.assets);
    assets(tenant, server, load, &mut figures).await?;
    eprintln!(
        "bench:   {EDITED_CDCS} heavy customizations edited every {:?}",
        load.edit_every
    );
    prepare_edits(tenant).await?;
    let edits = tokio::spawn(edit(tenant.clone(), load.edit_every, stop));
    // The first edits start the namespace's share from nothing: measured once it is in use.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu, _) = daemon.usage().await;
    tokio::time::sleep(load.window).await;
    let busy = (daemon.usage().await.0 - cpu) / load.window.as_secs_f64();
    figures.edit_cores = (busy - figures.idle_cores).max(0.0);
    figures.edits_per_s = EDITED_CDCS as f64 / load.edit_every.as_secs_f64();
    Ok((figures, edits))
}

/// Creates `count` package CRDs; the daemon's resident growth against the charge they add, once
/// the charge has stopped moving.
async fn crds(
    tenant: &Client,
    tenant_name: &str,
    daemon: &Supervised,
    count: usize,
    figures: &mut CostFigures,
) -> Result<(), BenchError> {
    let charged = || async { cached_bytes(&daemon.metrics().await, tenant_name) };
    let before = charged().await;
    let (_, rss_before) = daemon.usage().await;
    let api: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let template: Value = serde_saphyr::from_str(PACKAGE_CRD).map_err(std::io::Error::other)?;
    for index in 0..count {
        let mut crd = template.clone();
        let group = format!("g{index}.attack.example.org");
        crd["metadata"] = json!({"name": format!("clusterpools.{group}")});
        crd["spec"]["group"] = json!(group);
        api.create(&PostParams::default(), &from_json(crd)?).await?;
    }
    // Settled: the charge unchanged over three looks a second apart.
    let started = Instant::now();
    let (mut last, mut same) = (before, 0);
    while same < 3 && started.elapsed() < SETTLE_WITHIN {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = charged().await;
        same = if now == last && now > before { same + 1 } else { 0 };
        last = now;
    }
    let (_, rss_after) = daemon.usage().await;
    figures.crds = count;
    figures.crd_charged_mib = (last - before) / MIB;
    figures.crd_rss_growth_mib = (rss_after - rss_before).max(0.0);
    figures.crd_growth_of_charged = figures.crd_rss_growth_mib / figures.crd_charged_mib.max(1e-6);
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

/// `stackd_tenant_cached_bytes` of `tenant`.
fn cached_bytes(metrics: &str, tenant: &str) -> f64 {
    let label = format!("tenant=\"{tenant}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("stackd_tenant_cached_bytes{") && l.contains(&label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// `assets` BareMetalAssets in namespace `assets` naming Secret `missing`; once each says so, the
/// requests to A's API server in that namespace over the window.
async fn assets(
    tenant: &Client,
    server: &ApiServer,
    load: CostLoad,
    figures: &mut CostFigures,
) -> Result<(), BenchError> {
    create_namespace(tenant, "assets").await?;
    let api: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), "assets");
    for index in 0..load.assets {
        let asset = from_json(json!({
            "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
            "metadata": {"name": format!("a-{index:04}")},
            "spec": {"bmc": {"address": format!("ipmi://10.1.{}.{}", index / 250, index % 250), "credentialsName": "missing"},
                "bootMACAddress": format!("00:1c:44:11:{:02x}:{:02x}", index / 256, index % 256)},
        }))?;
        api.create(&PostParams::default(), &asset).await?;
    }
    // Every asset told, or as many as the namespace's memory share holds (the rest are left out,
    // never reconciled): the count still for ten seconds.
    let started = Instant::now();
    let (mut told_before, mut still_since) = (0, Instant::now());
    loop {
        let listed = api.list(&ListParams::default()).await?;
        let told = listed
            .items
            .iter()
            .filter(|a| {
                let conditions = a.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
                conditions
                    .iter()
                    .any(|c| c.type_ == "CredentialsFound" && c.status == "False")
            })
            .count();
        if told != told_before {
            (told_before, still_since) = (told, Instant::now());
        }
        if told == load.assets || (told > 0 && still_since.elapsed() >= Duration::from_secs(10)) {
            figures.assets_served = told;
            break;
        }
        if started.elapsed() > SETTLE_WITHIN {
            return Err(BenchError::Timeout(format!(
                "{told} of {} assets told their Secret is missing",
                load.assets
            )));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let before = server.counters();
    tokio::time::sleep(load.window).await;
    let requests = server.counters().since(&before).in_namespace("assets");
    let recheck = crate::inventory::credentials_recheck(BENCH_BACKOFF_BASE);
    figures.assets = load.assets;
    figures.asset_requests_per_s = requests as f64 / load.window.as_secs_f64();
    figures.asset_requests_bound_per_s = crate::inventory::LOOKUPS_PER_NAMESPACE as f64 / recheck.as_secs_f64();
    Ok(())
}

/// Namespace `edits`: an install-config template with a large subtree, and a pool whose inventory
/// is [`EDITED_CDCS`] customizations of [`heavy_patches`].
async fn prepare_edits(tenant: &Client) -> Result<(), BenchError> {
    create_namespace(tenant, "edits").await?;
    let subtree: Vec<String> = (0..SUBTREE_ELEMENTS).map(|i| (i % 10).to_string()).collect();
    let template = format!(
        "apiVersion: v1\nplatform:\n  vsphere:\n    network: VM Network\nsubtree: [{}]\n",
        subtree.join(", ")
    );
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "edits");
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml": template}}),
    ] {
        secrets.create(&PostParams::default(), &from_json(secret)?).await?;
    }
    let names: Vec<String> = (0..EDITED_CDCS).map(|i| format!("e{i}")).collect();
    for name in &names {
        create_cdc(tenant, "edits", name, heavy_patches(0)).await?;
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    create_pool(tenant, "edits", "edits", EDITED_CDCS as i32, &refs).await
}

/// Edits every customization each `every` until `stop`; returns the edits made.
async fn edit(tenant: Client, every: Duration, stop: Arc<AtomicBool>) -> Result<usize, BenchError> {
    let api: Api<ClusterDeploymentCustomization> = Api::namespaced(tenant, "edits");
    let mut edits = 0;
    while !stop.load(Ordering::SeqCst) {
        let tick = Instant::now();
        for index in 0..EDITED_CDCS {
            let patches = json!({"spec": {"installConfigPatches": heavy_patches(edits + 1)}});
            api.patch(&format!("e{index}"), &PatchParams::default(), &Patch::Merge(&patches))
                .await?;
        }
        edits += EDITED_CDCS;
        tokio::time::sleep(every.saturating_sub(tick.elapsed())).await;
    }
    Ok(edits)
}

/// 100 patches that copy the template's large subtree and drop the copy 49 times, then fail a
/// `test` (so the customization is never leased and every edit would be applied in full again).
fn heavy_patches(edit: usize) -> Value {
    let mut patches = Vec::new();
    for _ in 0..49 {
        patches.push(json!({"op": "copy", "from": "/subtree", "path": "/c"}));
        patches.push(json!({"op": "remove", "path": "/c"}));
    }
    patches.push(json!({"op": "add", "path": "/edit", "value": edit}));
    patches.push(json!({"op": "test", "path": "/edit", "value": "never"}));
    Value::Array(patches)
}
