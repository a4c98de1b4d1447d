//! Carrying out a pool's [`Plan`]: the requests of DESIGN.md §4.3 in the order it prescribes —
//! deletions (a broken cluster's CDC marked first), then new clusters (name → lease → hosts →
//! namespace, Secrets, ClusterDeployment) — and the pool-deletion steps of §4.3.9.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, ListParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use serde_json::Value;
use tracing::info;

use super::buckets::{Bucket, Buckets};
use super::create::{Inputs, cluster_name, config_data, create_cluster, read_inputs};
use super::hosts;
use super::install_config;
use super::leases::{self, BROKEN_BY_CLOUD, BROKEN_BY_SYNTAX};
use super::machines::{self, MachinePlan};
use super::membership::{self, PoolIdentity};
use super::plan::{self, Add, Delete, Why};
use super::pool::{Ctx, FIELD_MANAGER, PoolError, RESYNC, Round};
use super::set_finalizers;
use super::status;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{
    ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, FailureDomainStatus, HostRole,
};
use crate::context::events::publish;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::metrics::PoolLabels;
use crate::runtime::status_writer::apply_status;

type Cdc = ClusterDeploymentCustomization;

/// Deletes the planned clusters in order; a broken cluster's CDC is marked BrokenByCloud first.
/// Clusters whose claim was deleted or that broke move to `Deleting` in `buckets`; every deleted
/// one is added to `deleted`. Returns the broken cluster whose mark lost a race (409), if any: it
/// is left for the next pass, and nothing after it is done, so the plan can be made again.
pub(super) async fn deletes(
    ctx: &Ctx,
    pool: &ClusterPool,
    deletes: &[Delete],
    cdcs: &BTreeMap<String, Arc<Cdc>>,
    buckets: &mut Buckets,
    round: &mut Round,
    deleted: &mut Vec<String>,
) -> Result<Option<String>, PoolError> {
    let tenant = &ctx.tenant;
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &pool.namespace().unwrap_or_default());
    for Delete { cd, why } in deletes {
        let cd_name = cd.name_any();
        if let Why::Broken { mark: Some(entry) } = why
            && let Some(cdc) = newest(round.written.get(entry).cloned(), cdcs.get(entry).cloned())
        {
            let message = format!(
                "Cluster {cd_name} failed to install; this may or may not be the fault of the patches. It is retried after a backoff"
            );
            match leases::set_apply_result(&cdc_api, &cdc, BROKEN_BY_CLOUD, message.clone()).await {
                Ok(written) => {
                    if let Some(written) = written {
                        round.written.insert(entry.clone(), written);
                    }
                    publish(tenant, &*cdc, true, BROKEN_BY_CLOUD, message).await;
                }
                Err(err) if is_conflict(&err) => {
                    round.soon(Duration::from_millis(200));
                    return Ok(Some(cd_name));
                }
                Err(err) => return Err(err.into()),
            }
        }
        let api = Api::<ClusterDeployment>::namespaced(tenant.client.clone(), &cd_name);
        delete_cd(&api, cd, why.logged()).await?;
        let (reason, warning, note) = why.event(&cd_name);
        publish(tenant, pool, warning, reason, note).await;
        if matches!(why, Why::ClaimDeleted | Why::Broken { .. } | Why::InvalidMachineSpec) {
            buckets.set(&cd_name, Bucket::Deleting);
        }
        deleted.push(cd_name);
    }
    Ok(None)
}

async fn delete_cd(api: &Api<ClusterDeployment>, cd: &ClusterDeployment, why: &str) -> Result<(), PoolError> {
    info!(cluster = %cd.name_any(), reason = why, "deleting cluster");
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: cd.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&cd.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) || is_conflict(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The pool's failure domains and their use so far, for placing new clusters' machines.
pub(super) struct Placement<'a> {
    pub(super) domains: &'a BTreeMap<String, FailureDomainStatus>,
    pub(super) usage: &'a mut BTreeMap<String, usize>,
}

/// Adds up to `add.count` clusters (§4.3.2 order: name → lease → hosts → namespace, Secrets,
/// ClusterDeployment), leasing the entries in `add.leases` in order; stops at the first cluster
/// that gets no lease or no hosts.
pub(super) async fn add_clusters(
    pool: &ClusterPool,
    ctx: &Ctx,
    version: &str,
    add: &Add,
    placement: Placement<'_>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let Some(inputs) = read_inputs(pool, ctx, round).await? else {
        return Ok(());
    };
    let mut leases = add.leases.iter();
    for _ in 0..add.count {
        let cd_name = cluster_name(&pool.name_any());
        let mut config = install_config::generate(&inputs.template, &pool.spec, &cd_name);
        let mut usage = placement.usage.clone();
        let mut plan: MachinePlan = machines::plan(pool, placement.domains, &mut usage, &mut config);
        if let Some(invalid) = plan.invalid.take() {
            // Every cluster would be stopped on its machines: none is made (§6, issue 29).
            round.contradiction = Some(invalid);
            return Ok(());
        }
        let mut leased: Option<Cdc> = None;
        if pool.spec.inventory.is_some() {
            // Try entries in order until one applies and its lease write wins.
            let generated = Arc::new(config);
            let Some((cdc, patched)) = lease_entry(pool, ctx, &cd_name, &generated, &mut leases, round).await? else {
                return Ok(());
            };
            config = patched;
            leased = Some(cdc);
        }
        if pool.spec.platform.baremetal.is_some() {
            // §4.3.2 order: after the lease, before the namespace and the ClusterDeployment.
            let Some(chosen) = hosts::take(pool, ctx, &cd_name, placement.domains, &usage, round).await? else {
                give_back(pool, ctx, &cd_name, leased.as_ref()).await?;
                return Ok(());
            };
            place_on_hosts(pool, ctx, &mut config, &chosen, &mut plan).await?;
            machines::commit(&mut usage, &plan.records);
        }
        ctx.expect_created(pool, &cd_name);
        *placement.usage = usage;
        machines::remember(ctx, &cd_name, &plan.records);
        let new = NewCluster {
            name: &cd_name,
            version,
            config,
            cdc: leased.as_ref(),
            plan: &plan,
        };
        create(pool, ctx, &inputs, new).await?;
    }
    Ok(())
}

/// Leases the first entry of `leases` whose patches apply to `config` and whose lease write wins;
/// returns the leased CDC and the patched config. Entries whose patches fail are marked
/// BrokenBySyntax (§4.3.4) and skipped.
async fn lease_entry(
    pool: &ClusterPool,
    ctx: &Ctx,
    cd_name: &str,
    config: &Arc<Value>,
    leases: &mut std::slice::Iter<'_, String>,
    round: &mut Round,
) -> Result<Option<(Cdc, Value)>, PoolError> {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    for entry in leases {
        let cached = ctx.cdcs.get(&ObjectRef::new(entry).within(&ns));
        let Some(cdc) = newest(round.written.get(entry).cloned(), cached) else {
            continue;
        };
        let patched = match patch(config, &cdc).await {
            Ok(patched) => patched,
            Err(error) => {
                refuse_patches(pool, ctx, &cdc_api, &cdc, error, round).await?;
                continue;
            }
        };
        match leases::lease(&cdc_api, &cdc, cd_name, &name).await {
            // Leased by someone else since this pass began.
            Ok(None) => continue,
            Ok(Some(written)) => {
                round
                    .leased
                    .insert(entry.clone(), cdc.metadata.generation.unwrap_or_default());
                round.written.insert(entry.clone(), written.clone());
                publish(
                    tenant,
                    &written,
                    false,
                    "Leased",
                    format!("Leased for ClusterDeployment {cd_name} of ClusterPool {name}"),
                )
                .await;
                return Ok(Some((written, patched)));
            }
            // Someone else leased it first: take the next one.
            Err(err) if is_conflict(&err) => {
                info!(tenant = %tenant.name, pool = %name, cdc = %entry, "lost the lease race; trying the next entry");
                continue;
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(None)
}

/// The generated `config` with `cdc`'s patches applied, on the blocking pool: tenant-sized work.
async fn patch(config: &Arc<Value>, cdc: &Cdc) -> Result<Value, String> {
    let patches = &cdc.spec.install_config_patches;
    install_config::count_patches(patches)?;
    let (config, patches) = (config.clone(), patches.clone());
    super::off_the_async_workers(move || {
        let mut patched = Value::clone(&config);
        install_config::apply_patches(&mut patched, &patches).map(|()| patched)
    })
    .await
}

/// A CDC whose patches do not apply: `ApplySucceeded=False/BrokenBySyntax` with the error, and
/// the pool says so; the CDC stays unleased.
async fn refuse_patches(
    pool: &ClusterPool,
    ctx: &Ctx,
    cdc_api: &Api<Cdc>,
    cdc: &Cdc,
    error: String,
    round: &mut Round,
) -> Result<(), PoolError> {
    let entry = cdc.name_any();
    round.syntax_errors.insert(entry.clone(), error.clone());
    match leases::set_apply_result(cdc_api, cdc, BROKEN_BY_SYNTAX, error.clone()).await {
        Ok(Some(written)) => {
            round.written.insert(entry.clone(), written);
            publish(
                &ctx.tenant,
                cdc,
                true,
                BROKEN_BY_SYNTAX,
                format!("Patches do not apply: {error}"),
            )
            .await;
            publish(
                &ctx.tenant,
                pool,
                true,
                "InventoryInvalid",
                format!("ClusterDeploymentCustomization {entry}: {error}"),
            )
            .await;
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(err) if is_conflict(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// The copy of a CDC to decide from: the one this pass wrote, else the cached one. The cache may lag
/// our write; a copy another writer changed since is answered with 409 by the next status write
/// (resourceVersions are opaque: they are never ordered here).
fn newest(written: Option<Cdc>, cached: Option<Arc<Cdc>>) -> Option<Arc<Cdc>> {
    written.map(Arc::new).or(cached)
}

/// Releases the lease taken for a cluster that will not be created (its hosts are missing).
async fn give_back(pool: &ClusterPool, ctx: &Ctx, cd_name: &str, leased: Option<&Cdc>) -> Result<(), PoolError> {
    let Some(cdc) = leased else { return Ok(()) };
    let cdc_api = Api::<Cdc>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    match leases::release(&cdc_api, cdc, cd_name, &pool.name_any()).await {
        Ok(_) => Ok(()),
        // Left to the repair after the minimum age.
        Err(err) if is_conflict(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// Renders the chosen hosts into the install config and the cluster's machine plan.
async fn place_on_hosts(
    pool: &ClusterPool,
    ctx: &Ctx,
    config: &mut Value,
    chosen: &[(Arc<BareMetalAsset>, HostRole)],
    plan: &mut MachinePlan,
) -> Result<(), PoolError> {
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    hosts::render(config, chosen, &secrets).await?;
    plan.records = hosts::records(chosen);
    plan.hosts = hosts::cluster_hosts(chosen);
    Ok(())
}

/// One cluster to create, with what it is built from.
struct NewCluster<'a> {
    name: &'a str,
    version: &'a str,
    config: Value,
    cdc: Option<&'a Cdc>,
    plan: &'a MachinePlan,
}

async fn create(pool: &ClusterPool, ctx: &Ctx, inputs: &Inputs, new: NewCluster<'_>) -> Result<(), PoolError> {
    let cd_name = new.name;
    // Rendering up to a 1 MiB document is tenant-sized work.
    let (config, plan) = (new.config, new.plan.clone());
    let rendered = super::off_the_async_workers(move || config_data(&config, &plan)).await;
    let created = create_cluster(pool, ctx, inputs, cd_name, new.version, rendered, new.cdc, new.plan).await;
    if let Err(err) = created {
        // Not coming: stop counting it. Its lease and namespace are repaired after the minimum age.
        ctx.forget_created(pool, cd_name);
        return Err(err);
    }
    let tenant = &ctx.tenant;
    let cdc = new.cdc.map(|c| c.name_any());
    info!(tenant = %tenant.name, pool = %pool.name_any(), cluster = %cd_name, cdc = ?cdc, "cluster created");
    let note = match &cdc {
        Some(cdc) => format!("Created ClusterDeployment {cd_name} from ClusterDeploymentCustomization {cdc}"),
        None => format!("Created ClusterDeployment {cd_name}"),
    };
    publish(tenant, pool, false, "ClusterCreated", note).await;
    Ok(())
}

/// Deletes the namespaces this pool created that hold no ClusterDeployment (of anyone's) once they
/// are older than the minimum age; a namespace merely labelled like the pool's is never deleted.
pub(super) async fn reap_namespaces(
    ctx: &Ctx,
    pool: &PoolIdentity,
    expected_created: &BTreeSet<String>,
    round: &mut Round,
) -> Result<(), PoolError> {
    let min_age = ctx.tenant.shared.settings.lease_min_age;
    let api = Api::<Namespace>::all(ctx.tenant.client.clone());
    let inhabited: BTreeSet<String> = ctx.cds.state().iter().filter_map(|cd| cd.namespace()).collect();
    for namespace in ctx.namespaces.state() {
        if !membership::created_by(&namespace, pool) || namespace.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let ns_name = namespace.name_any();
        if inhabited.contains(&ns_name) || expected_created.contains(&ns_name) {
            continue;
        }
        let created = namespace
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0)
            .unwrap_or_default();
        // Creation timestamps have whole seconds: count the age from the end of that second.
        let age = Duration::try_from(Timestamp::now().duration_since(created))
            .unwrap_or_default()
            .saturating_sub(Duration::from_secs(1));
        if age < min_age {
            round.soon(min_age - age);
            continue;
        }
        // The cache of clusters can lag behind their creation (another daemon's, or ours under
        // load): a namespace is empty only if the server says so.
        if holds_a_cluster(ctx, &ns_name).await? {
            continue;
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: namespace.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&ns_name, &params).await {
            Ok(_) => {
                info!(tenant = %ctx.tenant.name, pool = %pool.name, namespace = %ns_name, "reaped an empty pool namespace")
            }
            Err(err) if is_not_found(&err) || is_conflict(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

/// Whether the tenant's server lists a ClusterDeployment in `namespace`.
async fn holds_a_cluster(ctx: &Ctx, namespace: &str) -> Result<bool, PoolError> {
    let api = Api::<ClusterDeployment>::namespaced(ctx.tenant.client.clone(), namespace);
    let listed = api.list_metadata(&ListParams::default().limit(1)).await?;
    Ok(!listed.items.is_empty())
}

/// Pool deletion (§4.3.9): delete the unclaimed clusters, keep the pool until every cluster is
/// gone, and strip this pool's finalizer from every CDC that carries it. `CleanupPending` while
/// something is left (the pool's own finalizer is removed by the caller once this returns `Ok`).
pub(super) async fn deleted_pool(
    pool: &ClusterPool,
    ctx: &Ctx,
    cds: &[Arc<ClusterDeployment>],
    buckets: &Buckets,
    cdcs: &BTreeMap<String, Arc<Cdc>>,
) -> Result<(), PoolError> {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    for cd in plan::deletions_of_deleted_pool(pool, cds, buckets) {
        let api = Api::<ClusterDeployment>::namespaced(tenant.client.clone(), &cd.name_any());
        delete_cd(&api, &cd, "pool deleted").await?;
    }
    if !cds.is_empty() {
        let names: Vec<String> = cds.iter().map(|cd| cd.name_any()).collect();
        if let Some(status) = status::deletion_pending(pool, &names, Time(Timestamp::now())) {
            let pools = Api::<ClusterPool>::namespaced(tenant.client.clone(), &ns);
            apply_status(&pools, pool, FIELD_MANAGER, &status, None).await?;
        }
        return Err(PoolError::CleanupPending(Action::requeue(RESYNC)));
    }
    let finalizer = super::cdc_finalizer(&name);
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    for cdc in cdcs.values().filter(|c| c.finalizers().contains(&finalizer)) {
        let rest: Vec<String> = cdc.finalizers().iter().filter(|f| **f != finalizer).cloned().collect();
        if let Some(again) = finalizers_written(set_finalizers(&cdc_api, cdc, rest).await)? {
            return Err(PoolError::CleanupPending(again));
        }
    }
    forget_metrics(ctx, &ns, &name);
    Ok(())
}

/// The outcome of a finalizer write: a conflict means looking again soon; gone is done.
fn finalizers_written<K>(result: Result<K, kube::Error>) -> Result<Option<Action>, PoolError> {
    match result {
        Ok(_) => Ok(None),
        Err(err) if is_not_found(&err) => Ok(None),
        Err(err) if is_conflict(&err) => Ok(Some(Action::requeue(Duration::from_millis(200)))),
        Err(err) => Err(err.into()),
    }
}

fn forget_metrics(ctx: &Ctx, ns: &str, name: &str) {
    let tenant = &ctx.tenant;
    for state in [
        "installing",
        "ready",
        "claimed",
        "broken",
        "stale",
        "deleting",
        "available",
        "reserved",
        "cdc_broken",
    ] {
        tenant
            .shared
            .metrics
            .pool_clusters
            .remove(&PoolLabels::new(&tenant.name, ns, name, state));
    }
}
