//! A tenant's memory budget (`--tenant-memory-budget`, DESIGN.md §8): the tenant's task tree ends
//! when what no namespace owns takes its caches over it (its supervisor then suspends it and
//! retries later; a namespace over its share has only its own objects left out, see
//! `runtime::memory_budget`), and a restarted tenant that was suspended is resumed once its caches
//! have all filled within it.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::context::tenant::{TenantContext, TenantError};
use crate::runtime::memory_budget::ByteSize;

/// A cache that cannot fill (a forbidden watch) must not keep a tenant that runs within its
/// budget shown as suspended for ever.
const RESUME_AT_THE_LATEST: Duration = Duration::from_secs(60);

/// Fails the tenant when it goes over its budget; resumes it once its caches filled within it.
/// Start it with the controllers (nothing before them is charged).
pub(super) async fn watch(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let Some(budget) = context.caches.budget() else {
        return Ok(());
    };
    let resume = async {
        let _ = tokio::time::timeout(RESUME_AT_THE_LATEST, context.startup.completed()).await;
        let (health, metrics) = (&context.shared.health, &context.shared.metrics);
        if health.is_suspended(&context.name) && !budget.is_exceeded() {
            let used = ByteSize(budget.used());
            info!(tenant = %context.name, cached = %used, "tenant resumed: its caches are filled within its memory budget");
            health.resume(&context.name);
            metrics.clear_tenant_suspended(&context.name);
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = cancel.cancelled() => Ok(()),
        overage = budget.exceeded() => Err(TenantError::OverMemoryBudget(overage)),
        () = resume => Ok(()),
    }
}
