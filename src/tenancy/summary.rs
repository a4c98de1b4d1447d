//! A tenant's objects by readiness, counted from the caches its controllers share (no request of its
//! own): `stackd_tenant_objects{tenant,kind,ready}` (bounded: tenant × kind × ready, never per
//! object) and the counts in its Tenant object's status. Counted at most once a second, however
//! many objects change.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::pools::ClusterPool;
use crate::api::stacks::{ClusterStackInstall, Stack, StackInstall};
use crate::api::tenancy::ReadinessCount;
use crate::context::tenant::{TenantContext, TenantError};
use crate::runtime::conditions::is_true;
use crate::runtime::deadline::sleep_until;
use crate::runtime::health::ObjectCounts;
use crate::runtime::readiness::Readiness;

/// The quiet time between a change and the count it leads to.
const COUNT_DELAY: Duration = Duration::from_secs(1);

/// Per kind: (ready, not ready).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct KindCounts {
    stack_installs: ReadinessCount,
    cluster_stack_installs: ReadinessCount,
    stacks: ReadinessCount,
    pools: ReadinessCount,
}

/// Counts the tenant's objects whenever they change, until `cancel`.
pub(super) async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let caches = &context.caches;
    let (installs, cluster_installs) = (
        caches.tenant_guarded::<StackInstall>(),
        caches.tenant_guarded::<ClusterStackInstall>(),
    );
    let (stacks, pools) = (caches.tenant_guarded::<Stack>(), caches.tenant_guarded::<ClusterPool>());
    let filled = Readiness::all(vec![
        installs.readiness(),
        cluster_installs.readiness(),
        stacks.readiness(),
        pools.readiness(),
    ]);
    let streams: Vec<BoxStream<'static, ()>> = vec![
        installs.changes().map(|_| ()).boxed(),
        cluster_installs.changes().map(|_| ()).boxed(),
        stacks.changes().map(|_| ()).boxed(),
        pools.changes().map(|_| ()).boxed(),
    ];
    let mut changes = futures::stream::select_all(streams);
    let mut due: Option<Instant> = None;
    let mut last = None;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            change = changes.next() => match change {
                Some(()) => {
                    due.get_or_insert_with(|| Instant::now() + COUNT_DELAY);
                    continue;
                }
                None => return Ok(()),
            },
            _ = sleep_until(due) => due = None,
        }
        if !filled.is_ready() {
            continue;
        }
        let counts = KindCounts {
            stack_installs: count(&installs.store().state(), |i| {
                i.status
                    .as_ref()
                    .is_some_and(|status| is_true(&status.conditions, "Ready"))
            }),
            cluster_stack_installs: count(&cluster_installs.store().state(), |i| {
                i.status
                    .as_ref()
                    .is_some_and(|status| is_true(&status.conditions, "Ready"))
            }),
            stacks: count(&stacks.store().state(), |s| {
                s.status
                    .as_ref()
                    .is_some_and(|status| is_true(&status.conditions, "Ready"))
            }),
            pools: count(&pools.store().state(), |p| {
                p.status.as_ref().is_some_and(|status| status.ready >= p.spec.size)
            }),
        };
        if last != Some(counts) {
            publish(&context, &counts);
            last = Some(counts);
        }
    }
}

fn count<K>(objects: &[Arc<K>], ready: impl Fn(&K) -> bool) -> ReadinessCount {
    let ready_count = objects.iter().filter(|object| ready(object)).count();
    let to_i32 = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    ReadinessCount {
        ready: to_i32(ready_count),
        not_ready: to_i32(objects.len() - ready_count),
    }
}

fn publish(context: &TenantContext, counts: &KindCounts) {
    let metrics = &context.shared.metrics;
    for (kind, count) in [
        ("StackInstall", counts.stack_installs),
        ("ClusterStackInstall", counts.cluster_stack_installs),
        ("Stack", counts.stacks),
        ("ClusterPool", counts.pools),
    ] {
        metrics.set_tenant_objects(&context.name, kind, true, i64::from(count.ready));
        metrics.set_tenant_objects(&context.name, kind, false, i64::from(count.not_ready));
    }
    let installs = ReadinessCount {
        ready: counts
            .stack_installs
            .ready
            .saturating_add(counts.cluster_stack_installs.ready),
        not_ready: counts
            .stack_installs
            .not_ready
            .saturating_add(counts.cluster_stack_installs.not_ready),
    };
    let objects = ObjectCounts {
        installs,
        stacks: counts.stacks,
        pools: counts.pools,
    };
    context.shared.health.set_counts(&context.name, objects);
}
