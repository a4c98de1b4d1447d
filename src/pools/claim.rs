//! ClusterClaims (DESIGN.md §4.3 item 10): the lifetime a claim gets, and its status writes. The
//! pool controller assigns clusters to claims, oldest claim first.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::buckets::{Bucket, Buckets, created};
use super::pass::{AFTER_A_LOST_RACE, PoolError, Wake};
use crate::api::pools::{ClusterClaim, ClusterClaimStatus, ClusterDeployment, ClusterPool, ClusterPoolSpec};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::status_writer::apply_status;

/// The controller's name, as its metrics and its tenant's start know it.
pub(crate) const CONTROLLER: &str = "clusterclaim";

/// The field manager of claim status writes (made by the claim and the pool controllers alike).
pub(crate) const FIELD_MANAGER: &str = "stackd/claim";

struct Ctx {
    tenant: Arc<TenantContext>,
    pools: Store<ClusterPool>,
}

/// Reports claims whose pool does not exist (the pool controller handles every other claim).
pub(crate) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let pools = context.caches.tenant_guarded::<ClusterPool>();
    let claims = context.caches.tenant_guarded::<ClusterClaim>();
    let claims_of_pool = claims.store();
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        pools: pools.store(),
    });
    Scaffold::new(CONTROLLER, context, &claims)
        .watches(&pools, move |pool| {
            let ns = pool.namespace();
            claims_of_pool
                .state()
                .into_iter()
                .filter(|c| c.namespace() == ns && c.spec.cluster_pool_name == pool.name_any())
                .map(|c| ObjectRef::from_obj(&*c))
                .collect::<Vec<_>>()
        })
        .run(ctx, reconcile, &cancel)
        .await;
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClaimError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[from] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl ReconcileError for ClaimError {
    fn metric_label(&self) -> &'static str {
        match self {
            ClaimError::Tenant(_) => "tenant_api",
            ClaimError::Panicked(_) => "panic",
        }
    }
}

async fn reconcile(claim: Arc<ClusterClaim>, ctx: Arc<Ctx>, _permit: Permit) -> Result<Action, ClaimError> {
    Ok(reconcile_claim(claim, ctx).await?)
}

/// A claim whose pool is missing says so; claims of existing pools are the pool's to assign.
async fn reconcile_claim(claim: Arc<ClusterClaim>, ctx: Arc<Ctx>) -> Result<Action, kube::Error> {
    if claim.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = claim.namespace().unwrap_or_default();
    let pool = &claim.spec.cluster_pool_name;
    if ctx.pools.get(&ObjectRef::new(pool).within(&ns)).is_some() {
        return Ok(Action::await_change());
    }
    let api = Api::<ClusterClaim>::namespaced(ctx.tenant.client.clone(), &ns);
    let message = format!("ClusterPool {pool} does not exist in namespace {ns}; create it or fix spec.clusterPoolName");
    let status = claim.status.clone().unwrap_or_default();
    let lifetime = status.lifetime.as_deref().and_then(parse_duration);
    if set_status(
        &api,
        &claim,
        status.namespace,
        lifetime,
        true,
        "ClusterPoolNotFound",
        message.clone(),
    )
    .await?
    {
        publish(&ctx.tenant, &*claim, true, "ClusterPoolNotFound", message).await;
    }
    Ok(Action::await_change())
}

/// The longest duration a claim lifetime may name (ten years): anything longer is refused, as it
/// would overflow the clock arithmetic of the requeue that waits for it.
pub(crate) const LONGEST_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Parses a Go duration (`8h`, `90m`, `1h30m`, `1.5h`) of at most [`LONGEST_DURATION`].
pub(crate) fn parse_duration(text: &str) -> Option<Duration> {
    let re = regex::Regex::new(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)").ok()?;
    let mut total = 0f64;
    let mut consumed = 0;
    for capture in re.captures_iter(text) {
        let whole = capture.get(0)?;
        if whole.start() != consumed {
            return None;
        }
        consumed = whole.end();
        let number: f64 = capture[1].parse().ok()?;
        let unit = match &capture[2] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            _ => 3600.0,
        };
        total += number * unit;
    }
    if consumed != text.len() || consumed == 0 {
        return None;
    }
    Duration::try_from_secs_f64(total)
        .ok()
        .filter(|duration| *duration <= LONGEST_DURATION)
}

/// The claim's lifetime: its own, else the pool's default, capped by the pool's maximum.
pub(crate) fn lifetime(claim: &ClusterClaim, pool: &ClusterPoolSpec) -> Option<Duration> {
    let limits = pool.claim_lifetime.clone().unwrap_or_default();
    let wanted = claim
        .spec
        .lifetime
        .as_deref()
        .or(limits.default.as_deref())
        .and_then(parse_duration);
    let maximum = limits.maximum.as_deref().and_then(parse_duration);
    match (wanted, maximum) {
        (Some(w), Some(m)) => Some(w.min(m)),
        (w, m) => w.or(m),
    }
}

/// Time left before a claim assigned at `claimed` expires (zero when past).
pub(crate) fn remaining(lifetime: Duration, claimed: &Time) -> Duration {
    let elapsed = Duration::try_from(Timestamp::now().duration_since(claimed.0)).unwrap_or_default();
    lifetime.saturating_sub(elapsed)
}

/// Writes the claim's status when it differs (merge patch of the status subresource).
pub(crate) async fn set_status(
    api: &Api<ClusterClaim>,
    claim: &ClusterClaim,
    namespace: Option<String>,
    lifetime: Option<Duration>,
    pending: bool,
    reason: &str,
    message: String,
) -> Result<bool, kube::Error> {
    let mut status: ClusterClaimStatus = claim.status.clone().unwrap_or_default();
    let mut changed = set_condition(
        &mut status.conditions,
        DesiredCondition {
            type_: "Pending",
            status: pending,
            reason,
            message,
            observed_generation: claim.metadata.generation,
        },
        Time(Timestamp::now()),
    );
    let lifetime = lifetime.map(|l| humantime::format_duration(l).to_string().replace(' ', ""));
    if status.namespace != namespace || status.lifetime != lifetime {
        status.namespace = namespace;
        status.lifetime = lifetime;
        changed = true;
    }
    if !changed {
        return Ok(false);
    }
    apply_status(api, claim, FIELD_MANAGER, &status, None).await?;
    Ok(true)
}

/// Which waiting claim gets which ready cluster (§4.3.10): the oldest claim the oldest ready
/// cluster. Claims left over wait for one; the pool adds a cluster for each.
pub(super) struct Matching<'a> {
    pub(super) pairs: Vec<(&'a Arc<ClusterClaim>, Arc<ClusterDeployment>)>,
    pub(super) waiting: Vec<&'a Arc<ClusterClaim>>,
    /// The clusters already claimed, by claim name.
    pub(super) claimed: BTreeMap<String, Arc<ClusterDeployment>>,
}

pub(super) fn match_claims<'a>(
    cds: &[Arc<ClusterDeployment>],
    claims: &'a BTreeMap<String, Arc<ClusterClaim>>,
    buckets: &Buckets,
) -> Matching<'a> {
    let mut claimed: BTreeMap<String, Arc<ClusterDeployment>> = BTreeMap::new();
    for cd in cds {
        if let Some(claim) = cd.spec.cluster_pool_ref.as_ref().and_then(|r| r.claim_name.clone())
            && buckets.of(cd) == Bucket::Claimed
        {
            claimed.insert(claim, cd.clone());
        }
    }
    let mut ready: Vec<Arc<ClusterDeployment>> = cds
        .iter()
        .filter(|cd| buckets.of(cd) == Bucket::Ready)
        .cloned()
        .collect();
    ready.sort_by_key(|cd| (created(cd), cd.name_any()));
    ready.reverse();
    let mut waiting: Vec<&Arc<ClusterClaim>> = claims
        .values()
        .filter(|c| c.metadata.deletion_timestamp.is_none() && !claimed.contains_key(&c.name_any()))
        .collect();
    waiting.sort_by_key(|c| (c.metadata.creation_timestamp.as_ref().map(|t| t.0), c.name_any()));
    let mut pairs = Vec::new();
    let mut left = Vec::new();
    for claim in waiting {
        match ready.pop() {
            Some(cd) => pairs.push((claim, cd)),
            None => left.push(claim),
        }
    }
    Matching {
        pairs,
        waiting: left,
        claimed,
    }
}

/// What assigning clusters to claims leaves behind.
pub(super) struct Assigned {
    /// The buckets with the clusters claimed in this pass moved to `Claimed`.
    pub(super) buckets: Buckets,
    /// How many claims still wait (the pool adds a cluster for each).
    pub(super) pending_claims: i64,
    pub(super) wake: Wake,
}

/// Assigns ready clusters to waiting claims as [`match_claims`] pairs them; keeps each assigned
/// claim's status; deletes claims past their lifetime.
pub(super) async fn assign(
    tenant: &TenantContext,
    pool: &ClusterPool,
    cds: &[Arc<ClusterDeployment>],
    claims: &BTreeMap<String, Arc<ClusterClaim>>,
    mut buckets: Buckets,
) -> Result<Assigned, PoolError> {
    let mut wake = Wake::default();
    let claims_api = Api::<ClusterClaim>::namespaced(tenant.client.clone(), &pool.namespace().unwrap_or_default());
    let Matching {
        pairs,
        waiting,
        mut claimed,
    } = match_claims(cds, claims, &buckets);
    let mut pending_claims = 0;
    for (claim, cd) in pairs {
        match claim_cluster(tenant, claim, &cd).await? {
            Some(written) => {
                buckets.set(&cd.name_any(), Bucket::Claimed);
                claimed.insert(claim.name_any(), Arc::new(written));
            }
            None => {
                pending_claims += 1;
                wake.soon(AFTER_A_LOST_RACE);
            }
        }
    }
    for claim in waiting {
        pending_claims += 1;
        let message = format!(
            "No ready cluster in ClusterPool {} yet; the pool adds one for this claim",
            pool.name_any()
        );
        let lifetime = lifetime(claim, &pool.spec);
        set_status(&claims_api, claim, None, lifetime, true, "NoClusters", message).await?;
    }
    for (claim_name, cd) in &claimed {
        let Some(claim) = claims.get(claim_name) else { continue };
        if claim.metadata.deletion_timestamp.is_none()
            && let Some(left) = keep_claimed(tenant, pool, &claims_api, claim, cd).await?
        {
            wake.soon(left);
        }
    }
    Ok(Assigned {
        buckets,
        pending_claims,
        wake,
    })
}

/// Writes the claim into `cd`'s pool reference; `None` when someone else changed `cd` first.
async fn claim_cluster(
    tenant: &TenantContext,
    claim: &ClusterClaim,
    cd: &ClusterDeployment,
) -> Result<Option<ClusterDeployment>, PoolError> {
    let mut assigned = cd.clone();
    let pool_ref = assigned.spec.cluster_pool_ref.get_or_insert_with(Default::default);
    pool_ref.claim_name = Some(claim.name_any());
    pool_ref.claimed_timestamp = Some(Time(Timestamp::now()));
    assigned.metadata.managed_fields = None;
    let cd_api = Api::<ClusterDeployment>::namespaced(tenant.client.clone(), &cd.name_any());
    match cd_api.replace(&cd.name_any(), &PostParams::default(), &assigned).await {
        Ok(written) => {
            publish(
                tenant,
                claim,
                false,
                "ClusterClaimed",
                format!("Assigned ClusterDeployment {0} (namespace {0})", cd.name_any()),
            )
            .await;
            Ok(Some(written))
        }
        Err(err) if is_conflict(&err) => Ok(None),
        Err(err) => Err(err.into()),
    }
}

/// An assigned claim: deleted once past its lifetime, else its status names its cluster. Returns
/// how long the claim has left, when it has a lifetime.
async fn keep_claimed(
    tenant: &TenantContext,
    pool: &ClusterPool,
    claims_api: &Api<ClusterClaim>,
    claim: &ClusterClaim,
    cd: &ClusterDeployment,
) -> Result<Option<Duration>, PoolError> {
    let claim_name = claim.name_any();
    let lifetime = lifetime(claim, &pool.spec);
    let mut left_over = None;
    let claimed = cd
        .spec
        .cluster_pool_ref
        .as_ref()
        .and_then(|r| r.claimed_timestamp.clone());
    if let (Some(lifetime), Some(claimed)) = (lifetime, claimed) {
        let left = remaining(lifetime, &claimed);
        if left.is_zero() {
            info!(pool = %pool.name_any(), claim = %claim_name, "claim lifetime expired; deleting the claim");
            publish(
                tenant,
                pool,
                false,
                "ClaimExpired",
                format!("ClusterClaim {claim_name} passed its lifetime and was deleted"),
            )
            .await;
            return match claims_api.delete(&claim_name, &DeleteParams::default()).await {
                Ok(_) => Ok(None),
                Err(err) if is_not_found(&err) => Ok(None),
                Err(err) => Err(err.into()),
            };
        }
        left_over = Some(left);
    }
    let message = format!(
        "Cluster {0} assigned; its admin kubeconfig is in Secret {0}-admin-kubeconfig in namespace {0}",
        cd.name_any()
    );
    set_status(
        claims_api,
        claim,
        Some(cd.name_any()),
        lifetime,
        false,
        "ClusterClaimed",
        message,
    )
    .await?;
    Ok(left_over)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ClaimLifetime, ClusterClaimSpec};

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_duration("8h"), Some(Duration::from_secs(8 * 3600)));
        assert_eq!(parse_duration("1h30m"), Some(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1500ms"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2x"), None);
        assert_eq!(parse_duration(""), None);
    }

    #[test]
    fn absurd_durations_are_refused_not_a_panic() {
        assert_eq!(parse_duration("99999999999999999999h"), None);
        assert_eq!(parse_duration(&format!("{}h", "9".repeat(400))), None);
        assert_eq!(parse_duration("87601h"), None);
        assert_eq!(parse_duration("87600h"), Some(LONGEST_DURATION));
    }

    #[test]
    fn the_oldest_claim_gets_the_oldest_ready_cluster_and_the_rest_wait() {
        use crate::pools::buckets::fixtures::{Cd, claim};
        use std::collections::BTreeSet;
        let cds: Vec<Arc<ClusterDeployment>> = vec![
            Cd::new("p-new", "2024-03-01T00:00:00Z").installed().build(),
            Cd::new("p-old", "2024-01-01T00:00:00Z").installed().build(),
            Cd::new("p-installing", "2023-01-01T00:00:00Z").build(),
            Cd::new("p-held", "2023-01-01T00:00:00Z")
                .installed()
                .claimed_by("held")
                .build(),
        ];
        let mut going = (*claim("going", "2020-01-01T00:00:00Z")).clone();
        going.metadata.deletion_timestamp = going.metadata.creation_timestamp.clone();
        let claims: BTreeMap<String, Arc<ClusterClaim>> = [
            claim("second", "2024-05-01T00:00:00Z"),
            claim("first", "2024-04-01T00:00:00Z"),
            claim("third", "2024-06-01T00:00:00Z"),
            claim("held", "2020-01-01T00:00:00Z"),
            Arc::new(going),
        ]
        .into_iter()
        .map(|c| (c.name_any(), c))
        .collect();
        let buckets = Buckets::sort(&cds, &claims, &BTreeSet::new());
        let matching = match_claims(&cds, &claims, &buckets);
        let pairs: Vec<(String, String)> = matching
            .pairs
            .iter()
            .map(|(claim, cd)| (claim.name_any(), cd.name_any()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("first".to_string(), "p-old".to_string()),
                ("second".to_string(), "p-new".to_string())
            ]
        );
        let waiting: Vec<String> = matching.waiting.iter().map(|c| c.name_any()).collect();
        assert_eq!(waiting, ["third"], "a deleting claim and an assigned one do not wait");
        assert_eq!(matching.claimed.keys().collect::<Vec<_>>(), ["held"]);
    }

    #[test]
    fn lifetime_defaults_and_is_capped() {
        let claim = |lifetime: Option<&str>| {
            ClusterClaim::new(
                "c",
                ClusterClaimSpec {
                    cluster_pool_name: "p".into(),
                    lifetime: lifetime.map(String::from),
                },
            )
        };
        let pool = ClusterPoolSpec {
            claim_lifetime: Some(ClaimLifetime {
                default: Some("1h".into()),
                maximum: Some("2h".into()),
            }),
            ..Default::default()
        };
        assert_eq!(lifetime(&claim(None), &pool), Some(Duration::from_secs(3600)));
        assert_eq!(lifetime(&claim(Some("5h")), &pool), Some(Duration::from_secs(7200)));
        assert_eq!(
            lifetime(&claim(Some("30m")), &ClusterPoolSpec::default()),
            Some(Duration::from_secs(1800))
        );
    }
}
