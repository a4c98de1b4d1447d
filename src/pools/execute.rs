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
use super::create::{
    Inputs, NewCluster, Read, cluster_name, config_data, create_cluster, missing_recheck, read_inputs,
};
use super::host_selection;
use super::hosts::{self, Taken, Unrendered};
use super::install_config;
use super::lease_state::{BROKEN_BY_CLOUD, BROKEN_BY_SYNTAX};
use super::leases;
use super::machines::{self, MachinePlan};
use super::membership::{self, PoolIdentity};
use super::pass::{AFTER_A_LOST_RACE, Ctx, Executed, FIELD_MANAGER, Fresh, Observed, PoolError, RESYNC, Wake};
use super::plan::{self, Delete, Plan, Why};
use super::set_finalizers;
use super::status;
use super::version::pool_version;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization, ClusterPool, HostRole};
use crate::bounds::{self, INSTALL_CONFIG};
use crate::context::events::publish;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::finalizer::Cleanup;
use crate::runtime::metrics::{Metrics, PoolLabels};
use crate::runtime::status_writer::apply_status;

type Cdc = ClusterDeploymentCustomization;

/// What the planned deletions did.
pub(super) struct Deletions {
    /// Clusters deleted, in order.
    pub(super) deleted: Vec<String>,
    /// The broken cluster whose BrokenByCloud mark lost a race (409), if any: it is left for the
    /// next pass, and nothing after it was done, so the plan can be made again.
    pub(super) kept: Option<String>,
    pub(super) fresh: Fresh,
    pub(super) wake: Wake,
}

/// Deletes the planned clusters in order; a broken cluster's CDC is marked BrokenByCloud first.
/// Clusters whose claim was deleted or that broke move to `Deleting` in `buckets`. `fresh`: the
/// CDC copies the pass wrote so far, returned with this step's.
pub(super) async fn deletes(
    ctx: &Ctx,
    pool: &ClusterPool,
    deletes: &[Delete],
    cdcs: &BTreeMap<String, Arc<Cdc>>,
    buckets: &mut Buckets,
    fresh: Fresh,
) -> Result<Deletions, PoolError> {
    let tenant = &ctx.tenant;
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let mut done = Deletions {
        deleted: Vec::new(),
        kept: None,
        fresh,
        wake: Wake::default(),
    };
    for Delete { cd, why } in deletes {
        let cd_name = cd.name_any();
        if let Why::Broken { mark: Some(entry) } = why
            && let Some(cdc) = done.fresh.newest(entry, cdcs.get(entry))
        {
            let message = format!(
                "Cluster {cd_name} failed to install; this may or may not be the fault of the patches. It is retried after a backoff"
            );
            match leases::set_apply_result(&cdc_api, &cdc, BROKEN_BY_CLOUD, message.clone()).await {
                Ok(written) => {
                    if let Some(written) = written {
                        done.fresh.record(written);
                    }
                    publish(tenant, &*cdc, true, BROKEN_BY_CLOUD, message).await;
                }
                Err(err) if is_conflict(&err) => {
                    done.wake.soon(AFTER_A_LOST_RACE);
                    done.kept = Some(cd_name);
                    return Ok(done);
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
        done.deleted.push(cd_name);
    }
    Ok(done)
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

/// Carries out the rest of `plan` once its deletions are `done`: adds up to `add.count` clusters
/// (§4.3.2 order: name → lease → hosts → namespace, Secrets, ClusterDeployment), leasing the entries
/// in `add.leases` in order; stops at the first cluster that gets no lease or no hosts.
pub(super) async fn run(
    ctx: &Ctx,
    pool: &ClusterPool,
    plan: &Plan,
    observed: &Observed,
    done: Deletions,
) -> Result<Executed, PoolError> {
    let mut executed = Executed {
        deleted: done.deleted,
        fresh: done.fresh,
        wake: done.wake,
        ..Executed::default()
    };
    // Counted on every pass: it also forgets the planned records of clusters that are gone.
    let mut usage = machines::usage(ctx, &observed.cds, &observed.expected_created);
    let Some(add) = &plan.add else {
        return Ok(executed);
    };
    // Reading the pool's Secrets and rendering from them is the namespace's work as much as
    // applying patches is: a namespace past its share reads nothing until it is back.
    let ns = pool.namespace().unwrap_or_default();
    if let Err(wait) = ctx.patch_shares.admit(&ns) {
        executed.patch_share_used = Some(ctx.patch_shares.share_used(&ns));
        executed.wake.soon(wait);
        return Ok(executed);
    }
    let inputs = match read_inputs(pool, ctx).await? {
        Read::Found(inputs) => {
            ctx.patch_shares.charge(&ns, inputs.read_bytes);
            inputs
        }
        Read::Missing(missing) => {
            executed.missing_dependencies = missing;
            executed.wake.soon(missing_recheck(ctx));
            return Ok(executed);
        }
        Read::TooLarge(refused) => {
            refuse_document(&mut executed, ctx, refused);
            return Ok(executed);
        }
    };
    let version = pool_version(pool);
    let mut leases = add.leases.iter();
    for _ in 0..add.count {
        let cd_name = cluster_name(&pool.name_any());
        let mut config = install_config::generate(&inputs.template, &pool.spec, &cd_name);
        let mut cluster_usage = usage.clone();
        let mut machines: MachinePlan = machines::plan(pool, &observed.domains, &mut cluster_usage, &mut config);
        if let Some(invalid) = machines.invalid.take() {
            // Every cluster would be stopped on its machines: none is made (§6, issue 29).
            executed.contradiction = Some(invalid);
            return Ok(executed);
        }
        if pool.spec.platform.baremetal.is_some() {
            // Before anything is written for the cluster: a refused pool writes nothing.
            let placement = (&observed.domains, &cluster_usage);
            if let Some(refused) = hosts::precheck(pool, ctx, placement, &executed.hosts_taken).await? {
                refuse_document(&mut executed, ctx, refused.to_string());
                return Ok(executed);
            }
        }
        let mut leased: Option<Cdc> = None;
        if pool.spec.inventory.is_some() {
            // Try entries in order until one applies and its lease write wins.
            let generated = Arc::new(config);
            let Some((cdc, patched)) = lease_entry(
                pool,
                ctx,
                &cd_name,
                (&generated, inputs.config_limit),
                &mut leases,
                &mut executed,
            )
            .await?
            else {
                return Ok(executed);
            };
            config = patched;
            leased = Some(cdc);
        }
        let mut chosen = Vec::new();
        if pool.spec.platform.baremetal.is_some() {
            // §4.3.2 order: after the lease, before the namespace and the ClusterDeployment.
            let placement = (&observed.domains, &cluster_usage);
            chosen = match hosts::take(pool, ctx, &cd_name, placement, &executed.hosts_taken).await? {
                Taken::Hosts(chosen) => chosen,
                Taken::Short { why, retry } => {
                    executed.insufficient_hosts = Some(why);
                    if let Some(retry) = retry {
                        executed.wake.soon(retry);
                    }
                    give_back(pool, ctx, &cd_name, leased.as_ref()).await?;
                    return Ok(executed);
                }
            };
            executed.hosts_taken.extend(chosen.iter().map(|(a, _)| a.name_any()));
            if let Placement::Refused(refused) = place_on_hosts(pool, ctx, &mut config, &chosen, &mut machines).await? {
                // The Secrets changed since the precheck.
                hosts::give_back(pool, ctx, &cd_name, &chosen).await;
                give_back(pool, ctx, &cd_name, leased.as_ref()).await?;
                refuse_document(&mut executed, ctx, refused);
                return Ok(executed);
            }
            machines::commit(&mut cluster_usage, &machines.records);
        }
        // Rendered before anything of the cluster is made (up to a MiB of YAML: on the blocking
        // pool); one past what its Secrets hold is refused here.
        let plan_now = machines.clone();
        let limit = inputs.config_limit;
        let rendered = match super::off_the_async_workers(move || config_data(&config, &plan_now, limit)).await {
            Ok(rendered) => rendered,
            Err(refused) => {
                hosts::give_back(pool, ctx, &cd_name, &chosen).await;
                give_back(pool, ctx, &cd_name, leased.as_ref()).await?;
                refuse_document(&mut executed, ctx, refused.to_string());
                return Ok(executed);
            }
        };
        ctx.expect_created(pool, &cd_name);
        usage = cluster_usage;
        machines::remember(ctx, &cd_name, &machines.records);
        let new = NewCluster {
            name: &cd_name,
            version: &version,
            cdc: leased.as_ref(),
            plan: &machines,
        };
        create(pool, ctx, &inputs, new, rendered).await?;
    }
    Ok(executed)
}

/// Nothing is built for the pass: a document would pass a bound (`why`). Looked at again as soon as
/// a missing Secret would be: tenant Secrets are not watched, and the fix is often a smaller one.
fn refuse_document(executed: &mut Executed, ctx: &Ctx, why: String) {
    executed.too_large = Some(why);
    executed.wake.soon(missing_recheck(ctx));
}

/// Leases the first entry of `leases` whose patches apply to `config` and whose lease write wins;
/// returns the leased CDC and the patched config. Entries whose patches fail are marked
/// BrokenBySyntax (§4.3.4) and skipped.
async fn lease_entry(
    pool: &ClusterPool,
    ctx: &Ctx,
    cd_name: &str,
    (config, config_limit): (&Arc<Value>, usize),
    leases: &mut std::slice::Iter<'_, String>,
    executed: &mut Executed,
) -> Result<Option<(Cdc, Value)>, PoolError> {
    let tenant = &ctx.tenant;
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    for entry in leases {
        let cached = ctx.cdcs.get(&ObjectRef::new(entry).within(&ns));
        let Some(cdc) = executed.fresh.newest(entry, cached.as_ref()) else {
            continue;
        };
        if let Err(wait) = ctx.patch_shares.admit(&ns) {
            // Tried again, the newest generation then, once the namespace's share is back.
            executed.patch_share_used = Some(ctx.patch_shares.share_used(&ns));
            executed.wake.soon(wait);
            return Ok(None);
        }
        let (patched, work) = patch(config, config_limit, &cdc).await;
        ctx.patch_shares.charge(&ns, work);
        let metrics = &tenant.shared.metrics;
        metrics
            .patch_bytes
            .get_or_create(&Metrics::tenant(&tenant.name))
            .inc_by(work);
        let patched = match patched {
            Ok(patched) => patched,
            Err(error) => {
                refuse_patches(pool, ctx, &cdc_api, &cdc, error, executed).await?;
                continue;
            }
        };
        match leases::lease(&cdc_api, &cdc, cd_name, &name).await {
            // Leased by someone else since this pass began.
            Ok(None) => continue,
            Ok(Some(written)) => {
                executed
                    .leased
                    .insert(entry.clone(), cdc.metadata.generation.unwrap_or_default());
                executed.fresh.record(written.clone());
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
                info!(cdc = %entry, "lost the lease race; trying the next entry");
                continue;
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(None)
}

/// The generated `config` with `cdc`'s patches applied, on the blocking pool: tenant-sized work;
/// and what it cost (the bytes measured after each patch).
async fn patch(config: &Arc<Value>, config_limit: usize, cdc: &Cdc) -> (Result<Value, String>, u64) {
    let patches = &cdc.spec.install_config_patches;
    if let Err(refused) = install_config::count_patches(patches) {
        return (Err(refused), 0);
    }
    let (config, patches) = (config.clone(), patches.clone());
    super::off_the_async_workers(move || {
        let mut patched = Value::clone(&config);
        let mut work = 0;
        if let Err(failed) = install_config::apply_patches_counted(&mut patched, &patches, &mut work) {
            return (Err(failed), work);
        }
        // Within the install config's bounds as JSON, it may still be too long as YAML (deep
        // lists) for the Secrets it goes into: refused here, before the lease, as the patches'
        // doing.
        if install_config::to_yaml(&patched, config_limit).is_none() {
            let refused = bounds::rendered_too_long("the patched install config".into(), config_limit);
            return (Err(refused.to_string()), work);
        }
        (Ok(patched), work)
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
    executed: &mut Executed,
) -> Result<(), PoolError> {
    let entry = cdc.name_any();
    executed.syntax_errors.insert(entry.clone(), error.clone());
    match leases::set_apply_result(cdc_api, cdc, BROKEN_BY_SYNTAX, error.clone()).await {
        Ok(Some(written)) => {
            executed.fresh.record(written);
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

/// Whether a new cluster's hosts went into its install config.
enum Placement {
    Placed,
    /// A bound refused the config with its hosts (why).
    Refused(String),
}

/// Renders the chosen hosts into the install config and the cluster's machine plan.
async fn place_on_hosts(
    pool: &ClusterPool,
    ctx: &Ctx,
    config: &mut Value,
    chosen: &[(Arc<BareMetalAsset>, HostRole)],
    plan: &mut MachinePlan,
) -> Result<Placement, PoolError> {
    let secrets = Api::<Secret>::namespaced(ctx.tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let limits = &ctx.tenant.shared.settings.document_limits;
    match hosts::render(config, chosen, &secrets, limits).await {
        Ok(()) => {}
        Err(Unrendered::Refused(refused)) => return Ok(Placement::Refused(refused.to_string())),
        Err(Unrendered::Unreadable(err)) => return Err(err.into()),
    }
    // The hosts grew the config: measured again before it is rendered as YAML.
    if let Err(exceeded) = bounds::measure(config, INSTALL_CONFIG) {
        return Ok(Placement::Refused(format!(
            "The install config with its hosts is refused: {exceeded}"
        )));
    }
    plan.records = host_selection::records(chosen);
    plan.hosts = host_selection::cluster_hosts(chosen);
    Ok(Placement::Placed)
}

/// Creates the cluster `new` with its `rendered` install-config Secret.
async fn create(
    pool: &ClusterPool,
    ctx: &Ctx,
    inputs: &Inputs,
    new: NewCluster<'_>,
    rendered: BTreeMap<String, String>,
) -> Result<(), PoolError> {
    let cd_name = new.name;
    let created = create_cluster(pool, ctx, inputs, &new, rendered).await;
    if let Err(err) = created {
        // Not coming: stop counting it. Its lease is repaired after the minimum age.
        ctx.forget_created(pool, cd_name);
        return Err(err);
    }
    let tenant = &ctx.tenant;
    let cdc = new.cdc.map(|c| c.name_any());
    info!(cluster = %cd_name, cdc = ?cdc, "cluster created");
    let note = match &cdc {
        Some(cdc) => format!("Created ClusterDeployment {cd_name} from ClusterDeploymentCustomization {cdc}"),
        None => format!("Created ClusterDeployment {cd_name}"),
    };
    publish(tenant, pool, false, "ClusterCreated", note).await;
    Ok(())
}

/// Deletes the namespaces this pool created that hold no ClusterDeployment (of anyone's) once they
/// are older than the minimum age; a namespace merely labelled like the pool's is never deleted.
/// Returns when to look again.
pub(super) async fn reap_namespaces(
    ctx: &Ctx,
    pool: &PoolIdentity,
    expected_created: &BTreeSet<String>,
    min_age: Duration,
) -> Result<Wake, PoolError> {
    let mut wake = Wake::default();
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
            wake.soon(min_age - age);
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
                info!(namespace = %ns_name, "reaped an empty pool namespace")
            }
            Err(err) if is_not_found(&err) || is_conflict(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(wake)
}

/// Whether the tenant's server lists a ClusterDeployment in `namespace`.
async fn holds_a_cluster(ctx: &Ctx, namespace: &str) -> Result<bool, PoolError> {
    let api = Api::<ClusterDeployment>::namespaced(ctx.tenant.client.clone(), namespace);
    let listed = api.list_metadata(&ListParams::default().limit(1)).await?;
    Ok(!listed.items.is_empty())
}

/// Pool deletion (§4.3.9): delete the unclaimed clusters, keep the pool until every cluster is
/// gone, and strip this pool's finalizer from every CDC that carries it. Pending while something
/// is left (the pool's own finalizer is removed by the caller once this is done).
pub(super) async fn deleted_pool(
    pool: &ClusterPool,
    ctx: &Ctx,
    cds: &[Arc<ClusterDeployment>],
    buckets: &Buckets,
    cdcs: &BTreeMap<String, Arc<Cdc>>,
) -> Result<Cleanup, PoolError> {
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
        return Ok(Cleanup::Pending(Action::requeue(RESYNC)));
    }
    // §4.3.4, no namespace left behind: once the pool is gone nobody would reap the namespaces it
    // created, so the empty ones go now (none is being created: the pool is deleted).
    reap_namespaces(ctx, &PoolIdentity::of(pool), &BTreeSet::new(), Duration::ZERO).await?;
    let finalizer = super::cdc_finalizer(&name);
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), &ns);
    for cdc in cdcs.values().filter(|c| c.finalizers().contains(&finalizer)) {
        let rest: Vec<String> = cdc.finalizers().iter().filter(|f| **f != finalizer).cloned().collect();
        if let Some(again) = finalizers_written(set_finalizers(&cdc_api, cdc, rest).await)? {
            return Ok(Cleanup::Pending(again));
        }
    }
    forget_metrics(ctx, &ns, &name);
    Ok(Cleanup::Done)
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
