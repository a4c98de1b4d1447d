//! Assigning bare-metal hosts to a pool's clusters (DESIGN.md §5 "Assignment by pools", §6
//! rendering): the chosen assets (see [`super::host_selection`]) are assigned with optimistic
//! concurrency and released on failure, on the cluster's deletion, or when the cluster never
//! appeared; and `platform.baremetal.hosts` is rendered with each host's BMC credentials.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::host_selection::{ASSIGNED_AT_ANNOTATION, ASSIGNED_BY_ANNOTATION, assigned_age, choose, free};
use super::install_config;
use super::machines;
use super::pass::{Ctx, PoolError, Wake};
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterPool, FailureDomainStatus, HostRole};
use crate::bounds::{DocumentLimits, Refused, RenderBudget};
use crate::inventory::CLUSTER_LABEL;
use crate::runtime::api_errors::{is_conflict, is_not_found};

/// Assigns `asset` to cluster `cd` of `pool` with an update carrying the cached resourceVersion:
/// `Ok(None)` when someone else changed it first (409).
pub(crate) async fn assign(
    api: &Api<BareMetalAsset>,
    asset: &BareMetalAsset,
    cd: &str,
    pool: &str,
) -> Result<Option<BareMetalAsset>, kube::Error> {
    let mut updated = asset.clone();
    updated.metadata.managed_fields = None;
    updated.spec.cluster_name = Some(cd.into());
    updated.labels_mut().insert(CLUSTER_LABEL.into(), cd.into());
    let annotations = updated.annotations_mut();
    annotations.insert(ASSIGNED_BY_ANNOTATION.into(), pool.into());
    annotations.insert(ASSIGNED_AT_ANNOTATION.into(), Timestamp::now().to_string());
    match api.replace(&asset.name_any(), &PostParams::default(), &updated).await {
        Ok(written) => Ok(Some(written)),
        Err(err) if is_conflict(&err) => Ok(None),
        Err(err) => Err(err),
    }
}

/// Unassigns `asset` if it is still assigned to `cd`, retrying on conflict with a fresh copy.
/// Returns whether it wrote.
pub(crate) async fn release(api: &Api<BareMetalAsset>, asset: &BareMetalAsset, cd: &str) -> Result<bool, kube::Error> {
    let mut current = asset.clone();
    for _ in 0..5 {
        if current.spec.assigned_cluster() != Some(cd) {
            return Ok(false);
        }
        let mut updated = current.clone();
        updated.metadata.managed_fields = None;
        updated.spec.cluster_name = None;
        updated.labels_mut().remove(CLUSTER_LABEL);
        updated.annotations_mut().remove(ASSIGNED_BY_ANNOTATION);
        updated.annotations_mut().remove(ASSIGNED_AT_ANNOTATION);
        match api.replace(&current.name_any(), &PostParams::default(), &updated).await {
            Ok(_) => return Ok(true),
            Err(err) if is_not_found(&err) => return Ok(false),
            Err(err) if is_conflict(&err) => match api.get_opt(&current.name_any()).await? {
                Some(fresh) => current = fresh,
                None => return Ok(false),
            },
            Err(err) => return Err(err),
        }
    }
    Ok(false)
}

/// Releases every asset in `namespace` assigned to `cd` (the cluster is being deleted).
pub(crate) async fn release_all(api: &Api<BareMetalAsset>, cd: &str) -> Result<usize, kube::Error> {
    let assigned = api
        .list(&ListParams::default().labels(&format!("{CLUSTER_LABEL}={cd}")))
        .await?;
    let mut released = 0;
    // The label may lag the spec; the spec decides.
    let all = api.list(&ListParams::default()).await?;
    let names: BTreeSet<String> = assigned.items.iter().map(|a| a.name_any()).collect();
    for asset in all.items {
        if names.contains(&asset.name_any()) || asset.spec.assigned_cluster() == Some(cd) {
            released += usize::from(release(api, &asset, cd).await?);
        }
    }
    Ok(released)
}

/// The BMC keys of a credentials Secret that go into the install config.
const BMC_KEYS: [&str; 2] = ["username", "password"];

/// The BMC credentials one render inlines, read from the tenant's Secrets within the bounds: each
/// Secret is read once and held to `--max-render-secret-bytes` as it is read (only its BMC keys are
/// kept), and what each host inlines is charged to the render's budget (`--max-render-bytes`)
/// before anything of it is copied: many assets may name one large Secret.
struct BmcCredentials<'a> {
    secrets: &'a Api<Secret>,
    namespace: String,
    limits: &'a DocumentLimits,
    budget: RenderBudget,
    read: BTreeMap<String, BTreeMap<&'static str, String>>,
}

impl<'a> BmcCredentials<'a> {
    fn new(secrets: &'a Api<Secret>, limits: &'a DocumentLimits) -> Self {
        BmcCredentials {
            secrets,
            namespace: secrets.namespace().unwrap_or_default().to_string(),
            limits,
            budget: limits.render_budget(),
            read: BTreeMap::new(),
        }
    }

    /// The credentials `asset` inlines, charged to the render.
    async fn of(&mut self, asset: &BareMetalAsset) -> Result<Option<&BTreeMap<&'static str, String>>, Unrendered> {
        let name = &asset.spec.bmc.credentials_name;
        if !self.read.contains_key(name) {
            let credentials = match self.secrets.get_opt(name).await? {
                Some(secret) => bmc_keys(&self.namespace, secret, self.limits).map_err(Unrendered::Refused)?,
                None => BTreeMap::new(),
            };
            self.read.insert(name.clone(), credentials);
        }
        let credentials = self.read.get(name);
        let inlined = credentials.map_or(0, |c| c.values().map(String::len).sum());
        let namespace = &self.namespace;
        let field = || {
            format!(
                "the BMC credentials of BareMetalAsset {namespace}/{} (Secret {name}) with those of the hosts before it",
                asset.name_any()
            )
        };
        self.budget.charge(inlined, field).map_err(Unrendered::Refused)?;
        Ok(credentials)
    }
}

/// Why the hosts' credentials were not rendered.
#[derive(Debug)]
pub(crate) enum Unrendered {
    /// A bound refused them; nothing is rendered.
    Refused(Refused),
    /// A credentials Secret could not be read.
    Unreadable(kube::Error),
}

impl From<kube::Error> for Unrendered {
    fn from(err: kube::Error) -> Self {
        Unrendered::Unreadable(err)
    }
}

/// The BMC keys of a credentials Secret, once the Secret is within `--max-render-secret-bytes`;
/// the rest of the Secret is dropped here.
fn bmc_keys(
    namespace: &str,
    secret: Secret,
    limits: &DocumentLimits,
) -> Result<BTreeMap<&'static str, String>, Refused> {
    limits.render_secret(namespace, &secret)?;
    let data = secret.data.unwrap_or_default();
    Ok(BMC_KEYS
        .into_iter()
        .filter_map(|key| Some((key, String::from_utf8_lossy(&data.get(key)?.0).into_owned())))
        .collect())
}

/// Whether the credentials of `chosen` fit the render's bounds, read and added up without building
/// anything: checked before the lease and the hosts are taken, so a pool refused for them writes
/// nothing, pass after pass.
async fn check_credentials(
    chosen: &[(Arc<BareMetalAsset>, HostRole)],
    secrets: &Api<Secret>,
    limits: &DocumentLimits,
) -> Result<(), Unrendered> {
    let mut credentials = BmcCredentials::new(secrets, limits);
    for (asset, _) in chosen {
        credentials.of(asset).await?;
    }
    Ok(())
}

/// The bound the credentials of the hosts cluster `cd` would get pass, if they pass one: the hosts
/// are chosen as [`take`] would, nothing is written.
pub(super) async fn precheck(
    pool: &ClusterPool,
    ctx: &Ctx,
    placement: (&BTreeMap<String, FailureDomainStatus>, &BTreeMap<String, usize>),
    taken: &BTreeSet<String>,
) -> Result<Option<Refused>, PoolError> {
    let (domains, usage) = placement;
    let assets = machines::pool_assets(pool, ctx);
    // Short of hosts: `take` says so.
    let Ok(chosen) = choose(pool, &assets, taken, domains, usage) else {
        return Ok(None);
    };
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let limits = &ctx.tenant.shared.settings.document_limits;
    match check_credentials(&chosen, &secrets, limits).await {
        Ok(()) => Ok(None),
        Err(Unrendered::Refused(refused)) => Ok(Some(refused)),
        Err(Unrendered::Unreadable(err)) => Err(err.into()),
    }
}

/// `platform.baremetal.hosts` of the install config: each host with its BMC (credentials from its
/// Secret when it exists, within the bounds of [`BmcCredentials`]) and boot MAC.
pub(crate) async fn render(
    config: &mut Value,
    chosen: &[(Arc<BareMetalAsset>, HostRole)],
    secrets: &Api<Secret>,
    limits: &DocumentLimits,
) -> Result<(), Unrendered> {
    let mut credentials = BmcCredentials::new(secrets, limits);
    let mut hosts = Vec::new();
    for (asset, role) in chosen {
        let inlined = credentials.of(asset).await?;
        let mut bmc = json!({"address": asset.spec.bmc.address});
        for (key, value) in inlined.into_iter().flatten() {
            bmc[*key] = json!(value);
        }
        let mut host = json!({
            "name": asset.name_any(),
            "role": match role { HostRole::Master => "master", HostRole::Worker => "worker" },
            "bmc": bmc,
            "bootMACAddress": asset.spec.boot_mac_address,
        });
        if let Some(profile) = &asset.spec.hardware_profile {
            host["hardwareProfile"] = json!(profile);
        }
        hosts.push(host);
    }
    if let Some(object) = config.as_object_mut() {
        let platform = install_config::mapping_at(object, "platform");
        install_config::mapping_at(platform, "baremetal").insert("hosts".into(), json!(hosts));
    }
    Ok(())
}

/// What taking a new cluster's hosts came to.
pub(super) enum Taken {
    Hosts(Vec<(Arc<BareMetalAsset>, HostRole)>),
    /// The pool lacks hosts (the message says why); nothing stays assigned. `retry`: other writers
    /// kept winning the races, so look again after it.
    Short {
        why: String,
        retry: Option<Duration>,
    },
}

/// Chooses and assigns the hosts of new cluster `cd` (§5), among the pool's assets but those
/// `taken` for other clusters in this pass: on a lost race (409) whatever this attempt took is
/// released and the choice is made again without the lost asset.
pub(super) async fn take(
    pool: &ClusterPool,
    ctx: &Ctx,
    cd: &str,
    placement: (&BTreeMap<String, FailureDomainStatus>, &BTreeMap<String, usize>),
    taken: &BTreeSet<String>,
) -> Result<Taken, PoolError> {
    let (domains, usage) = placement;
    let name = pool.name_any();
    let api = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let mut unavailable = taken.clone();
    for _ in 0..8 {
        let assets = machines::pool_assets(pool, ctx);
        let chosen = match choose(pool, &assets, &unavailable, domains, usage) {
            Ok(chosen) => chosen,
            Err(why) => return Ok(Taken::Short { why, retry: None }),
        };
        let mut done: Vec<BareMetalAsset> = Vec::new();
        let mut race = None;
        for (asset, _) in &chosen {
            match assign_fresh(&api, asset, cd, &name).await {
                Ok(Some(written)) => done.push(written),
                Ok(None) => {
                    race = Some(asset.name_any());
                    break;
                }
                Err(err) => {
                    undo(&api, &done, cd).await;
                    return Err(err.into());
                }
            }
        }
        let Some(asset) = race else {
            return Ok(Taken::Hosts(chosen));
        };
        info!(asset = %asset, "lost an asset race; choosing again");
        undo(&api, &done, cd).await;
        unavailable.insert(asset);
    }
    Ok(Taken::Short {
        why: "Other writers kept taking the chosen BareMetalAssets; retrying".into(),
        retry: Some(Duration::from_millis(500)),
    })
}

/// Assigns `asset`; a 409 from a write that did not take it (the asset controller mirroring
/// labels, say) is retried with a fresh copy while the asset is still free. `None`: taken.
async fn assign_fresh(
    api: &Api<BareMetalAsset>,
    asset: &BareMetalAsset,
    cd: &str,
    pool: &str,
) -> Result<Option<BareMetalAsset>, kube::Error> {
    let mut current = asset.clone();
    for _ in 0..4 {
        if let Some(written) = assign(api, &current, cd, pool).await? {
            return Ok(Some(written));
        }
        match api.get_opt(&asset.name_any()).await? {
            Some(fresh) if free(&fresh) => current = fresh,
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// Releases the hosts taken for cluster `cd` of `pool`, which will not be created after all.
pub(super) async fn give_back(pool: &ClusterPool, ctx: &Ctx, cd: &str, chosen: &[(Arc<BareMetalAsset>, HostRole)]) {
    let api = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    for (asset, _) in chosen {
        // The cached copy predates the assignment: release the server's.
        let released = match api.get_opt(&asset.name_any()).await {
            Ok(Some(fresh)) => release(&api, &fresh, cd).await.map(drop),
            Ok(None) => Ok(()),
            Err(err) => Err(err),
        };
        if let Err(err) = released {
            warn!(asset = %asset.name_any(), error = %err, "cannot release an asset; the repair will");
        }
    }
}

/// Releases what a failed attempt assigned; a failure here is left to the repair.
async fn undo(api: &Api<BareMetalAsset>, done: &[BareMetalAsset], cd: &str) {
    for asset in done {
        if let Err(err) = release(api, asset, cd).await {
            warn!(asset = %asset.name_any(), error = %err, "cannot release an asset; the repair will");
        }
    }
}

/// §4.3.2 repair for assets: one this pool assigned to a cluster that does not exist is released
/// once the assignment is older than the minimum lease age. `clusters`: every cluster that exists
/// or is being created; `taken`: the assets assigned in this pass. Returns when to look again.
pub(super) async fn repair(
    pool: &ClusterPool,
    ctx: &Ctx,
    assets: &[Arc<BareMetalAsset>],
    clusters: (&BTreeSet<String>, &BTreeSet<String>),
    taken: &BTreeSet<String>,
) -> Result<Wake, PoolError> {
    let (live, expected) = clusters;
    let mut wake = Wake::default();
    let name = pool.name_any();
    let min_age = ctx.tenant.shared.settings.lease_min_age;
    let api = Api::<BareMetalAsset>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    for asset in assets {
        let Some(cd) = asset.spec.assigned_cluster() else {
            continue;
        };
        if live.contains(cd) || expected.contains(cd) || taken.contains(&asset.name_any()) {
            continue;
        }
        let Some(age) = assigned_age(asset, &name) else {
            continue;
        };
        if age < min_age {
            wake.soon(min_age - age);
            continue;
        }
        if release(&api, asset, cd).await? {
            info!(asset = %asset.name_any(), cluster = %cd, "released an asset whose cluster never appeared");
        }
    }
    Ok(wake)
}
