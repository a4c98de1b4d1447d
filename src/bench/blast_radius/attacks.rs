//! Tenant A's attacks (issue 28), made at once through what a tenant user may write, each in a
//! namespace of its own: CDC patch bombs and deep nesting in a pool's inventory, more pools than
//! one namespace is served, a flood of ClusterDeploymentCustomizations over the cache's size cap and
//! of large Secrets labelled `app.kubernetes.io/managed-by=stackd`, an install naming 200 pull
//! Secrets (on an install CRD from before its `maxItems`), and installs parked in `CRDConflict`, some
//! past the namespace's install bound. And issue 45's five: one BMC Secret with a huge password
//! named by many assets of a baremetal pool, pools sharing one large install-config template, a
//! namespace whose CDCs take more than its memory share, an installer padding and stripping its
//! output Secret, and a stack asking for nearly all of the tenant's host CPU. Then, while tenant B
//! and a neighbour namespace of A are measured, [`churn`] keeps rewriting them, so the daemon has
//! A's work to do the whole time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::super::BenchError;
use super::fixtures::{GREEDY_PACKAGE, PADDING_INSTALLER, SQUATTER_PACKAGE};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};
use crate::api::stacks::{Stack, StackInstall};

/// The sample's CRD, which the squatter package ships too.
const WIDGETS: &str = "widgets.samples.example.org";
const INSTALL_CRD: &str = "stackinstalls.stacks.stackd.dev";
/// The daemon's defaults (`--namespace-max-installs`, `--namespace-max-pools`): the bench runs them.
const NAMESPACE_MAX_INSTALLS: usize = crate::context::stack_limits::DEFAULT_NAMESPACE_MAX_INSTALLS;
const NAMESPACE_MAX_POOLS: usize = 50;
/// Installs and pools made past those bounds, each to be refused.
const PAST_THE_BOUND: usize = 2;
/// Elements of a flooding CDC's patch value: two bytes of JSON each, about 1 MiB in all.
const FLOOD_ELEMENTS: usize = 512 * 1024;
/// A labelled Secret's data (the embedded server bounds a Secret by its base64 text).
const SECRET_BYTES: usize = 700 * 1024;

/// How many of each attack.
#[derive(Clone, Copy, Debug)]
pub struct AttackLoad {
    pub large_cdcs: usize,
    pub labelled_secrets: usize,
    pub pull_secrets: usize,
    /// Installs parked in `CRDConflict`, at most `NAMESPACE_MAX_INSTALLS` per namespace.
    pub parked_installs: usize,
    /// BareMetalAssets naming one BMC Secret whose password has `bmc_password_bytes`.
    pub bmc_assets: usize,
    pub bmc_password_bytes: usize,
    /// Pools sharing one install-config template of `template_bytes`, each with as many one-patch
    /// CDCs in its inventory as its size.
    pub template_pools: usize,
    pub template_pool_size: usize,
    pub template_bytes: usize,
}

/// A namespace's CDCs under the cache's size cap that together take more than its memory share
/// (`--namespace-memory-budget`, a quarter of the default 16 MiB tenant budget): two of 240,000
/// small numbers, each some 9 MiB decoded, as the attack of issue 45 used.
const HOG_CDCS: usize = 2;
const HOG_ELEMENTS: usize = 240_000;

/// Each attack: how many objects it made, and how many the daemon has refused so far (a condition
/// or an Event saying why); an attack the daemon ignores by design counts as refused (`refused`
/// equals `made`).
pub(super) type Outcomes = BTreeMap<String, (usize, usize)>;

/// Tenant A before the attacks: the sample stack installed in `team`, whose Widget CRD the
/// squatters conflict with; and an install CRD without the pull Secrets' `maxItems`, as a tenant
/// whose CRDs predate it has (so the daemon's own bound is what refuses).
pub(super) async fn prepare(tenant: &Client) -> Result<(), BenchError> {
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let mut old = serde_json::to_value(crds.get(INSTALL_CRD).await?).map_err(std::io::Error::other)?;
    let pulls = &mut old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["imagePullSecrets"];
    if let Some(schema) = pulls.as_object_mut() {
        schema.remove("maxItems");
    }
    crds.replace(INSTALL_CRD, &PostParams::default(), &from_json(old)?)
        .await?;
    super::super::stacks::create(tenant, "team").await
}

/// Makes every attack at once.
pub(super) async fn launch(tenant: &Client, load: AttackLoad) -> Result<(), BenchError> {
    tokio::try_join!(
        patch_bombs_and_pools(tenant),
        flood(tenant, load),
        pull_secrets(tenant, load.pull_secrets),
        parked_installs(tenant, load.parked_installs),
        bmc_credentials(tenant, load),
        shared_template(tenant, load),
        namespace_hog(tenant),
        padded_output(tenant),
        greedy_stack(tenant),
    )?;
    Ok(())
}

/// What the daemon has refused of each attack so far.
pub(super) async fn outcomes(tenant: &Client, load: AttackLoad) -> Result<Outcomes, BenchError> {
    let bombs = cdc_reasons(tenant, "bombs").await?;
    let refused_bombs = ["bomb", "deep"]
        .iter()
        .filter(|name| bombs.get(**name).map(String::as_str) == Some("BrokenBySyntax"))
        .count();
    let pools = reasons::<ClusterPool>(tenant, "bombs", "CapacityAvailable").await?;
    let too_many_pools = pools.values().filter(|r| *r == "TooManyPools").count();
    let too_large = events_with_reason(tenant, "flood", "ObjectTooLarge").await?;
    let greedy = reasons::<StackInstall>(tenant, "pulls", "Ready").await?;
    let mut parked = 0;
    let mut too_many_installs = 0;
    for namespace in parked_namespaces(load.parked_installs) {
        for reason in reasons::<StackInstall>(tenant, &namespace, "Ready").await?.values() {
            parked += usize::from(reason == "CRDConflict");
            too_many_installs += usize::from(reason == "TooManyInstalls");
        }
    }
    let metal = reasons::<ClusterPool>(tenant, "bmc", "CapacityAvailable").await?;
    let metal_refused = usize::from(metal.get("metal").map(String::as_str) == Some("DocumentTooLarge"));
    let hogged = events_with_reason(tenant, "hog", "NamespaceOverBudget").await?;
    let padded = reasons::<ClusterDeployment>(tenant, "evil", "ProvisionStopped").await?;
    let padded = usize::from(padded.get("evil").map(String::as_str) == Some("InstallerOutputRefused"));
    let greedy_stack = reasons::<Stack>(tenant, "greedy", "Ready").await?;
    let greedy_stack =
        usize::from(greedy_stack.get("greedy").map(String::as_str) == Some("NamespaceQuotaShareExceeded"));
    Ok(BTreeMap::from([
        ("bmc_secret_inlined_for_every_asset".into(), (1, metal_refused)),
        // Served within their bounds, not refused: what they may cost is what the figures show.
        (
            "pools_sharing_a_large_template".into(),
            (load.template_pools, load.template_pools),
        ),
        (
            "cdcs_past_the_namespace_memory_share".into(),
            (HOG_CDCS, hogged.min(HOG_CDCS)),
        ),
        ("installer_output_padded_and_stripped".into(), (1, padded)),
        ("stack_taking_the_tenant_host_cpu".into(), (1, greedy_stack)),
        ("patch_bomb_and_deep_nesting".into(), (2, refused_bombs)),
        ("pools_past_namespace_bound".into(), (PAST_THE_BOUND, too_many_pools)),
        ("large_cdcs".into(), (load.large_cdcs, too_large.min(load.large_cdcs))),
        // Never read, so never refused by name: the daemon only caches Secrets it created.
        (
            "labelled_secrets".into(),
            (load.labelled_secrets, load.labelled_secrets),
        ),
        (
            "install_with_200_pull_secrets".into(),
            (
                1,
                usize::from(greedy.get("greedy").map(String::as_str) == Some("TooManyPullSecrets")),
            ),
        ),
        ("installs_parked_in_crd_conflict".into(), (load.parked_installs, parked)),
        (
            "installs_past_namespace_bound".into(),
            (PAST_THE_BOUND, too_many_installs),
        ),
    ]))
}

/// Waits until every attack is refused (or `within` passes: the caller reports what was).
pub(super) async fn wait_refused(tenant: &Client, load: AttackLoad, within: Duration) -> Result<Outcomes, BenchError> {
    let started = Instant::now();
    loop {
        let seen = outcomes(tenant, load).await?;
        if seen.values().all(|(made, refused)| refused >= made) || started.elapsed() > within {
            return Ok(seen);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Ticks of [`churn`] between rewrites of a large object: writing and storing a megabyte costs the
/// bench process's embedded servers (B's among them) far more CPU than it costs the daemon, which
/// measures it and reads no further.
const LARGE_REWRITE_EVERY: usize = 10;

/// Rewrites A's attacks every 200 ms until `stop`: a CRD event (what any install applying a package
/// makes) that wakes every parked install, the patch bomb with a new value, and the install naming
/// 200 pull Secrets; every `LARGE_REWRITE_EVERY` ticks a labelled Secret or a large CDC again.
/// Returns the writes made.
pub(super) async fn churn(tenant: Client, load: AttackLoad, stop: Arc<AtomicBool>) -> Result<usize, BenchError> {
    let merge = PatchParams::default();
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.clone());
    let bombs: Api<ClusterDeploymentCustomization> = Api::namespaced(tenant.clone(), "bombs");
    let greedy: Api<StackInstall> = Api::namespaced(tenant.clone(), "pulls");
    let flood_cdcs: Api<ClusterDeploymentCustomization> = Api::namespaced(tenant.clone(), "flood");
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "flood");
    let (mut tick, mut writes) = (0usize, 0usize);
    while !stop.load(Ordering::SeqCst) {
        let touch = json!({"metadata": {"labels": {"bench.stackd.dev/tick": tick.to_string()}}});
        crds.patch(WIDGETS, &merge, &Patch::Merge(&touch)).await?;
        greedy.patch("greedy", &merge, &Patch::Merge(&touch)).await?;
        let bomb = json!({"spec": {"installConfigPatches": patch_bomb(tick)}});
        bombs.patch("bomb", &merge, &Patch::Merge(&bomb)).await?;
        writes += 3;
        let large = tick / LARGE_REWRITE_EVERY;
        if tick % LARGE_REWRITE_EVERY == LARGE_REWRITE_EVERY - 1 && load.labelled_secrets > 0 && load.large_cdcs > 0 {
            if large.is_multiple_of(2) {
                let blob = json!({"stringData": {"blob": filler(SECRET_BYTES, tick)}});
                let name = format!("big-{}", large / 2 % load.labelled_secrets);
                secrets.patch(&name, &merge, &Patch::Merge(&blob)).await?;
            } else {
                let patches = json!({"spec": {"installConfigPatches": bulky_patches(FLOOD_ELEMENTS, tick)}});
                let name = format!("big-{}", large / 2 % load.large_cdcs);
                flood_cdcs.patch(&name, &merge, &Patch::Merge(&patches)).await?;
            }
            writes += 1;
        }
        tick += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(writes)
}

/// `bombs`: a pool whose inventory holds a patch bomb, a deep nesting and one good entry, then
/// more pools than the namespace is served (size 0: within the bound they cost nothing).
async fn patch_bombs_and_pools(tenant: &Client) -> Result<(), BenchError> {
    pool_namespace(tenant, "bombs").await?;
    create_cdc(tenant, "bombs", "bomb", patch_bomb(0)).await?;
    create_cdc(tenant, "bombs", "deep", deep_nesting()).await?;
    let good = json!([{"op": "replace", "path": "/metadata/name", "value": "good"}]);
    create_cdc(tenant, "bombs", "good", good).await?;
    create_pool(tenant, "bombs", "a-bombed", 1, &["bomb", "deep", "good"]).await?;
    for index in 1..NAMESPACE_MAX_POOLS + PAST_THE_BOUND {
        create_pool(tenant, "bombs", &format!("z-{index:03}"), 0, &[]).await?;
    }
    Ok(())
}

/// `flood`: CDCs of about 1 MiB of small numbers (some 20 MiB each decoded), over the cache's size
/// cap, and Secrets of 0.7 MiB labelled as stackd's.
async fn flood(tenant: &Client, load: AttackLoad) -> Result<(), BenchError> {
    create_namespace(tenant, "flood").await?;
    for index in 0..load.large_cdcs {
        create_cdc(
            tenant,
            "flood",
            &format!("big-{index}"),
            bulky_patches(FLOOD_ELEMENTS, 0),
        )
        .await?;
    }
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "flood");
    for index in 0..load.labelled_secrets {
        let secret = json!({
            "metadata": {"name": format!("big-{index}"), "labels": {"app.kubernetes.io/managed-by": "stackd"}},
            "stringData": {"blob": filler(SECRET_BYTES, 0)},
        });
        secrets.create(&PostParams::default(), &from_json(secret)?).await?;
    }
    Ok(())
}

/// `pulls`: `count` pull Secrets and one install naming them all.
async fn pull_secrets(tenant: &Client, count: usize) -> Result<(), BenchError> {
    create_namespace(tenant, "pulls").await?;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "pulls");
    for index in 0..count {
        let secret = json!({
            "metadata": {"name": format!("creds-{index}")},
            "type": "kubernetes.io/dockerconfigjson",
            "stringData": {".dockerconfigjson": "{\"auths\":{}}"},
        });
        secrets.create(&PostParams::default(), &from_json(secret)?).await?;
    }
    let refs: Vec<Value> = (0..count).map(|i| json!({"name": format!("creds-{i}")})).collect();
    let spec = json!({"package": "stackd-examples/sample-stack:v0.1.0", "imagePullSecrets": refs});
    create_install(tenant, "pulls", "greedy", spec).await
}

/// `parked-N`: installs of the squatter package, as many per namespace as the bound admits, and
/// `PAST_THE_BOUND` more in the last namespace.
async fn parked_installs(tenant: &Client, count: usize) -> Result<(), BenchError> {
    let namespaces = parked_namespaces(count);
    for namespace in &namespaces {
        create_namespace(tenant, namespace).await?;
    }
    let spec = json!({"package": SQUATTER_PACKAGE});
    for index in 0..count + PAST_THE_BOUND {
        let namespace = if index < count {
            &namespaces[index / NAMESPACE_MAX_INSTALLS]
        } else {
            namespaces.last().map_or("parked-0", String::as_str)
        };
        create_install(tenant, namespace, &format!("parked-{index:03}"), spec.clone()).await?;
    }
    Ok(())
}

fn parked_namespaces(count: usize) -> Vec<String> {
    let full = count.div_ceil(NAMESPACE_MAX_INSTALLS).max(1);
    (0..full).map(|i| format!("parked-{i}")).collect()
}

/// `bmc`: a BMC Secret with a password of `bmc_password_bytes`, `bmc_assets` assets naming it, and
/// a baremetal pool of one cluster taking them all: rendering would inline the password once per
/// host.
async fn bmc_credentials(tenant: &Client, load: AttackLoad) -> Result<(), BenchError> {
    pool_namespace(tenant, "bmc").await?;
    let secret = json!({"metadata": {"name": "bmc"},
        "stringData": {"username": "admin", "password": filler(load.bmc_password_bytes, 0)}});
    Api::<Secret>::namespaced(tenant.clone(), "bmc")
        .create(&PostParams::default(), &from_json(secret)?)
        .await?;
    let assets: Api<BareMetalAsset> = Api::namespaced(tenant.clone(), "bmc");
    for index in 0..load.bmc_assets {
        let asset = from_json(json!({
            "apiVersion": "inventory.stackd.dev/v1alpha1", "kind": "BareMetalAsset",
            "metadata": {"name": format!("host-{index:03}"), "labels": {"site": "lab"}},
            "spec": {"bmc": {"address": format!("ipmi://10.0.{}.{}", index / 250, index % 250), "credentialsName": "bmc"},
                "bootMACAddress": format!("00:1b:44:11:{:02x}:{:02x}", index / 256, index % 256)},
        }))?;
        assets.create(&PostParams::default(), &asset).await?;
    }
    let workers = load.bmc_assets.saturating_sub(3) as i64;
    let mut pool = pool_json("metal", 1);
    pool["spec"]["platform"] =
        json!({"baremetal": {"credentialsSecretRef": {"name": "creds"}, "apiVIPs": ["10.0.0.5"]}});
    pool["spec"]["controlPlane"] = json!({"replicas": 3});
    pool["spec"]["compute"] = json!({"replicas": workers});
    pool["spec"]["hostSelector"] = json!({"matchLabels": {"site": "lab"}});
    Api::<ClusterPool>::namespaced(tenant.clone(), "bmc")
        .create(&PostParams::default(), &from_json(pool)?)
        .await?;
    Ok(())
}

/// `template`: `template_pools` pools naming one install-config template of `template_bytes`, each
/// filled from an inventory of one-patch CDCs of its own.
async fn shared_template(tenant: &Client, load: AttackLoad) -> Result<(), BenchError> {
    create_namespace(tenant, "template").await?;
    let template = format!(
        "apiVersion: v1\nplatform:\n  vsphere:\n    network: VM Network\nadditionalTrustBundle: \"{}\"\n",
        filler(load.template_bytes, 0)
    );
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), "template");
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml": template}}),
    ] {
        secrets.create(&PostParams::default(), &from_json(secret)?).await?;
    }
    for pool in 0..load.template_pools {
        let mut names = Vec::new();
        for entry in 0..load.template_pool_size {
            let name = format!("t{pool}-{entry}");
            let patch = json!([{"op": "replace", "path": "/metadata/name", "value": name}]);
            create_cdc(tenant, "template", &name, patch).await?;
            names.push(name);
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        create_pool(
            tenant,
            "template",
            &format!("t{pool}"),
            load.template_pool_size as i32,
            &refs,
        )
        .await?;
    }
    Ok(())
}

/// `hog`: CDCs under the cache's size cap that take the namespace past its memory share.
async fn namespace_hog(tenant: &Client) -> Result<(), BenchError> {
    pool_namespace(tenant, "hog").await?;
    for index in 0..HOG_CDCS {
        create_cdc(
            tenant,
            "hog",
            &format!("hog-{index}"),
            bulky_patches(HOG_ELEMENTS, index),
        )
        .await?;
    }
    Ok(())
}

/// `evil`: a ClusterDeployment of the user's own whose installer pads and strips its output.
async fn padded_output(tenant: &Client) -> Result<(), BenchError> {
    pool_namespace(tenant, "evil").await?;
    let cd = from_json::<ClusterDeployment>(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
        "metadata": {"name": "evil"},
        "spec": {
            "clusterName": "evil",
            "baseDomain": "example.com",
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
            "pullSecretRef": {"name": "pull"},
            "provisioning": {"installConfigSecretRef": {"name": "template"}, "installerImage": PADDING_INSTALLER},
        },
    }))?;
    Api::<ClusterDeployment>::namespaced(tenant.clone(), "evil")
        .create(&PostParams::default(), &cd)
        .await?;
    Ok(())
}

/// `greedy`: an install of a stack whose controller asks for nearly all of the tenant's host CPU.
async fn greedy_stack(tenant: &Client) -> Result<(), BenchError> {
    create_namespace(tenant, "greedy").await?;
    create_install(tenant, "greedy", "greedy", json!({"package": GREEDY_PACKAGE})).await
}

/// `add /b` then thirty copies of `/b` into itself: 2 KiB doubled thirty times.
fn patch_bomb(variant: usize) -> Value {
    let seed = format!("{variant}-{}", "x".repeat(2048));
    let mut patches = vec![json!({"op": "add", "path": "/b", "value": [seed]})];
    patches.extend((0..30).map(|_| json!({"op": "copy", "from": "/b", "path": "/b/-"})));
    Value::Array(patches)
}

/// `/a` nested 30 levels, then pairs of moves that nest it one level deeper each.
fn deep_nesting() -> Value {
    let mut nested = json!({});
    for _ in 0..30 {
        nested = json!({ "a": nested });
    }
    let mut patches = vec![
        json!({"op": "add", "path": "/a", "value": nested}),
        json!({"op": "add", "path": "/s", "value": vec![json!({}); 45]}),
    ];
    for _ in 0..45 {
        patches.push(json!({"op": "move", "from": "/a", "path": "/s/0/a"}));
        patches.push(json!({"op": "move", "from": "/s/0", "path": "/a"}));
    }
    Value::Array(patches)
}

/// A patch list whose one value is an array of `elements` small numbers.
fn bulky_patches(elements: usize, variant: usize) -> Value {
    let numbers: Vec<usize> = (0..elements).map(|i| (i + variant) % 10).collect();
    json!([
        {"op": "replace", "path": "/metadata/name", "value": "c"},
        {"op": "add", "path": "/bulk", "value": numbers},
    ])
}

fn filler(bytes: usize, variant: usize) -> String {
    let letter = char::from(b'a' + (variant % 26) as u8);
    std::iter::repeat_n(letter, bytes).collect()
}

pub(super) fn from_json<T: DeserializeOwned>(value: Value) -> Result<T, BenchError> {
    serde_json::from_value(value).map_err(|e| BenchError::Io(std::io::Error::other(e)))
}

pub(super) async fn create_namespace(tenant: &Client, name: &str) -> Result<(), BenchError> {
    let namespace: Namespace = from_json(json!({"metadata": {"name": name}}))?;
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await?;
    Ok(())
}

/// A namespace with the Secrets a vSphere pool names.
pub(super) async fn pool_namespace(tenant: &Client, name: &str) -> Result<(), BenchError> {
    create_namespace(tenant, name).await?;
    let secrets: Api<Secret> = Api::namespaced(tenant.clone(), name);
    for secret in [
        json!({"metadata": {"name": "creds"}, "stringData": {"username": "u", "password": "p"}}),
        json!({"metadata": {"name": "pull"}, "stringData": {".dockerconfigjson": "{}"}}),
        json!({"metadata": {"name": "template"}, "stringData": {"install-config.yaml":
            "apiVersion: v1\nplatform:\n  vsphere:\n    network: VM Network\n"}}),
    ] {
        secrets.create(&PostParams::default(), &from_json(secret)?).await?;
    }
    Ok(())
}

pub(super) async fn create_cdc(tenant: &Client, namespace: &str, name: &str, patches: Value) -> Result<(), BenchError> {
    let cdc: ClusterDeploymentCustomization = from_json(json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeploymentCustomization",
        "metadata": {"name": name},
        "spec": {"installConfigPatches": patches},
    }))?;
    Api::<ClusterDeploymentCustomization>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &cdc)
        .await?;
    Ok(())
}

/// A vSphere pool of `size` named `name`, from the Secrets [`pool_namespace`] makes.
pub(super) fn pool_json(name: &str, size: i32) -> Value {
    json!({
        "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterPool",
        "metadata": {"name": name},
        "spec": {
            "size": size,
            "baseDomain": "example.com",
            "installerImage": "quay.io/example/installer:4.14",
            "installConfigSecretTemplateRef": {"name": "template"},
            "pullSecretRef": {"name": "pull"},
            "platform": {"vsphere": {"credentialsSecretRef": {"name": "creds"},
                "vCenter": "vc.example.com", "datacenter": "dc1", "defaultDatastore": "ds1"}},
        },
    })
}

pub(super) async fn create_pool(
    tenant: &Client,
    namespace: &str,
    name: &str,
    size: i32,
    inventory: &[&str],
) -> Result<(), BenchError> {
    let mut pool = pool_json(name, size);
    if !inventory.is_empty() {
        pool["spec"]["inventory"] = json!(inventory.iter().map(|n| json!({"name": n})).collect::<Vec<_>>());
    }
    let pool: ClusterPool = from_json(pool)?;
    Api::<ClusterPool>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &pool)
        .await?;
    Ok(())
}

async fn create_install(tenant: &Client, namespace: &str, name: &str, spec: Value) -> Result<(), BenchError> {
    let install: StackInstall = from_json(json!({"metadata": {"name": name}, "spec": spec}))?;
    Api::<StackInstall>::namespaced(tenant.clone(), namespace)
        .create(&PostParams::default(), &install)
        .await?;
    Ok(())
}

/// The reason of each object's `condition_type` condition in `namespace`, by name.
async fn reasons<K>(
    tenant: &Client,
    namespace: &str,
    condition_type: &str,
) -> Result<BTreeMap<String, String>, BenchError>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let objects = Api::<K>::namespaced(tenant.clone(), namespace)
        .list(&ListParams::default())
        .await?;
    let mut out = BTreeMap::new();
    for object in objects.items {
        let value = serde_json::to_value(&object).map_err(std::io::Error::other)?;
        let name = value["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let conditions = value["status"]["conditions"].as_array().cloned().unwrap_or_default();
        if let Some(found) = conditions.iter().find(|c| c["type"] == condition_type) {
            out.insert(name, found["reason"].as_str().unwrap_or_default().to_string());
        }
    }
    Ok(out)
}

async fn cdc_reasons(tenant: &Client, namespace: &str) -> Result<BTreeMap<String, String>, BenchError> {
    reasons::<ClusterDeploymentCustomization>(tenant, namespace, "ApplySucceeded").await
}

/// How many objects of `namespace` have an Event (events.k8s.io or core) with `reason`.
async fn events_with_reason(tenant: &Client, namespace: &str, reason: &str) -> Result<usize, BenchError> {
    let mut objects = std::collections::BTreeSet::new();
    for (group, version, kind, regarding) in [
        ("events.k8s.io", "v1", "Event", "regarding"),
        ("", "v1", "Event", "involvedObject"),
    ] {
        let resource = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(group, version, kind));
        let api: Api<DynamicObject> = Api::namespaced_with(tenant.clone(), namespace, &resource);
        for event in api.list(&ListParams::default()).await?.items {
            if event.data["reason"] == reason
                && let Some(name) = event.data[regarding]["name"].as_str()
            {
                objects.insert(name.to_string());
            }
        }
    }
    Ok(objects.len())
}
