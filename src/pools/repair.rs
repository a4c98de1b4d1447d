//! Keeping a pool's leases true before it acts (DESIGN.md §4.3 items 2, 6, 9): its finalizer on
//! the CDCs it lists or holds, leases of clusters that never appeared released after the minimum
//! age, lost leases of live clusters restored, and CDCs of installed clusters marked Succeeded.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kube::{Api, ResourceExt};
use tracing::{info, warn};

use super::leases::{self, SUCCEEDED};
use super::pool::{PoolError, Round, cdc_of};
use super::{cdc_finalizer, set_finalizers};
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization};
use crate::context::events::publish;
use crate::context::tenant::TenantContext;
use crate::runtime::api_errors::{is_conflict, is_not_found};

type Cdc = ClusterDeploymentCustomization;

/// Repairs the leases of pool `name` and returns the CDCs as they are now. `cds` are the pool's
/// members; `live` names every cluster in a namespace the pool created (a lease of one of those is
/// never released, even when someone edited its reference away).
#[allow(clippy::too_many_arguments)]
pub(super) async fn leases(
    tenant: &TenantContext,
    name: &str,
    ns: &str,
    deleting_pool: bool,
    listed: &BTreeSet<&str>,
    cdcs: BTreeMap<String, Arc<Cdc>>,
    cds: &[Arc<ClusterDeployment>],
    live: &BTreeSet<String>,
    expected_created: &BTreeSet<String>,
    round: &mut Round,
) -> Result<BTreeMap<String, Arc<Cdc>>, PoolError> {
    let settings = &tenant.shared.settings;
    let cdc_api = Api::<Cdc>::namespaced(tenant.client.clone(), ns);
    let finalizer = cdc_finalizer(name);
    let held_by_us = |cdc: &Cdc| leases::lease_holder(cdc).is_some_and(|(p, _)| p.as_deref() == Some(name));
    // §4.3.9: our finalizer on every CDC we list; off every CDC we no longer hold and either no
    // longer list or that is being deleted (a leased CDC's deletion waits for its release).
    for cdc in cdcs.values() {
        let has = cdc.finalizers().contains(&finalizer);
        let deleting = cdc.metadata.deletion_timestamp.is_some();
        let want = !deleting_pool && listed.contains(cdc.name_any().as_str()) && !deleting || held_by_us(cdc);
        if has != want {
            let mut finalizers: Vec<String> = cdc.finalizers().iter().filter(|f| **f != finalizer).cloned().collect();
            if want {
                finalizers.push(finalizer.clone());
            }
            match set_finalizers(&cdc_api, cdc, finalizers).await {
                // Later writes in this pass must start from this copy, not the older cached one.
                Ok(written) => {
                    round.written.insert(cdc.name_any(), written);
                }
                Err(err) if is_conflict(&err) || is_not_found(&err) => round.soon(Duration::from_millis(200)),
                Err(err) => return Err(err.into()),
            }
        }
    }

    // §4.3.2 repair: a lease of ours for a CD that does not exist, older than the minimum age (so a
    // CD created moments ago and not yet in the cache is never mistaken for a leak).
    for cdc in cdcs.values() {
        let Some((Some(holder), cd)) = leases::lease_holder(cdc) else {
            continue;
        };
        if holder != name {
            continue;
        }
        let exists = cd
            .as_ref()
            .is_some_and(|cd| live.contains(cd) || expected_created.contains(cd));
        if exists {
            continue;
        }
        let age = leases::lease_age(cdc).unwrap_or_default();
        if age < settings.lease_min_age {
            round.soon(settings.lease_min_age - age);
            continue;
        }
        let cd = cd.unwrap_or_default();
        match leases::release(&cdc_api, cdc, &cd, name).await {
            Ok(true) => {
                info!(tenant = %tenant.name, pool = %name, cdc = %cdc.name_any(), cluster = %cd, "released a lease whose cluster does not exist");
                publish(
                    tenant,
                    &**cdc,
                    false,
                    "Released",
                    format!("Released: ClusterDeployment {cd} it was reserved for does not exist"),
                )
                .await;
            }
            Ok(false) => {}
            Err(err) if is_conflict(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
    }

    // Link repair: a live cluster whose CDC shows no lease (status lost or edited) leases it again
    // before anyone else can, so one CDC never backs two clusters.
    let mut relinked: BTreeMap<String, Cdc> = BTreeMap::new();
    for cd in cds {
        if cd.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(cdc) = cdc_of(cd).and_then(|n| cdcs.get(&n).cloned()) else {
            continue;
        };
        if leases::lease_holder(&cdc).is_some() {
            continue;
        }
        match leases::lease(&cdc_api, &cdc, &cd.name_any(), name).await {
            Ok(Some(written)) => {
                warn!(tenant = %tenant.name, pool = %name, cdc = %cdc.name_any(), cluster = %cd.name_any(), "restored the lease of a live cluster");
                publish(
                    tenant,
                    &written,
                    true,
                    "LeaseRestored",
                    format!(
                        "ClusterDeployment {} still uses this customization; its lease was restored",
                        cd.name_any()
                    ),
                )
                .await;
                relinked.insert(cdc.name_any(), written);
            }
            Ok(None) => {}
            Err(err) if is_conflict(&err) => round.soon(Duration::from_millis(200)),
            Err(err) => return Err(err.into()),
        }
    }
    let cdcs: BTreeMap<String, Arc<Cdc>> = cdcs
        .into_iter()
        .map(|(n, c)| match relinked.remove(&n) {
            Some(written) => (n, Arc::new(written)),
            None => (n, c),
        })
        .collect();

    // Installed clusters mark their CDC Succeeded.
    for cd in cds {
        let installed = cd.status.as_ref().is_some_and(|s| s.installed);
        let Some(cdc) = cdc_of(cd).and_then(|n| cdcs.get(&n).cloned()) else {
            continue;
        };
        let ours = leases::lease_holder(&cdc) == Some((Some(name.to_string()), Some(cd.name_any())));
        if installed && ours && leases::apply_reason(&cdc) != Some(SUCCEEDED) {
            let message = format!("Patches applied and cluster {} installed successfully", cd.name_any());
            match leases::set_apply_result(&cdc_api, &cdc, SUCCEEDED, message).await {
                Ok(Some(written)) => {
                    round.written.insert(cdc.name_any(), written);
                }
                Ok(None) => {}
                Err(err) if is_conflict(&err) => round.soon(Duration::from_millis(200)),
                Err(err) => return Err(err.into()),
            }
        }
    }

    Ok(cdcs)
}
