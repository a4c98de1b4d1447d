//! What a failed reconcile does next, by the root cause of its error: one rule for every
//! controller. A conflict is the normal end of an optimistic write and is retried quietly; a server
//! that does not answer is retried on the probe interval, so work resumes seconds after it is back;
//! anything else backs off per object and is reported. A tenant that does not answer is its
//! probe's to tell (`runtime::reachability`): its reconciles' failures meanwhile are debug, and
//! while it is down they wait for its return instead of their backoff.

use std::error::Error;
use std::time::Duration;

use tracing::{debug, warn};

use super::backoff::ObjectBackoff;
use super::cause::{Cause, CauseKind, diagnose};
use super::reachability::{Reachability, probe_delay};

/// Conflicts in a row on one object before they are worth a warning.
const CONFLICTS_BEFORE_WARNING: u32 = 3;
/// Of the failures in a row to reach a server, every how many is logged as a warning.
const UNREACHABLE_WARNING_EVERY: u32 = 10;

/// Records the failure of the reconcile of `object` under its backoff `key`, logs it at the level
/// it deserves and returns how long to wait before retrying.
pub fn after_failure(
    backoff: &ObjectBackoff,
    key: &str,
    (tenant, controller, object): (&str, &str, &str),
    err: &(dyn Error + 'static),
) -> Duration {
    let cause = diagnose(err);
    let (failures, delay) = backoff.failed_counted(key);
    report(cause, failures, delay, (tenant, controller, object))
}

/// [`after_failure`] of a reconcile of the tenant's own objects (and the tenant's host objects).
/// While a server it talks to (the tenant's, or the host's) is in doubt (down, or a request just
/// failed to reach it and its probe is on it), a failure that waiting can end is debug: the probe
/// tells the outage once. While one is down, `hold` puts the object on the list run again at its
/// return, and it waits its own backoff meanwhile instead of asking a server known to be down
/// every few seconds.
pub fn after_tenant_failure(
    backoff: &ObjectBackoff,
    key: &str,
    (tenant, controller, object): (&str, &str, &str),
    err: &(dyn Error + 'static),
    (servers, hold): (&[&Reachability], impl FnOnce() -> bool),
) -> Duration {
    let cause = diagnose(err);
    let (failures, delay) = backoff.failed_counted(key);
    let in_doubt = servers.iter().any(|server| server.in_doubt());
    if !(cause.kind.is_outage() && in_doubt) {
        return report(cause, failures, delay, (tenant, controller, object));
    }
    let delay = if hold() { delay } else { delay.min(probe_delay()) };
    debug!(tenant, controller, object, %cause, retry_in = ?delay, "reconcile will be retried when the server answers");
    delay
}

/// Whether a watch's failure `err` is worth no line of its own: a 410 (the watch relists at once;
/// no outage), or trouble waiting can end while a server it may be watching (`servers`) is in
/// doubt, whose probe tells the outage once.
pub fn is_quiet_watch_failure(err: &(dyn Error + 'static), servers: &[&Reachability]) -> bool {
    let kind = diagnose(err).kind;
    kind == CauseKind::Expired || (kind.is_outage() && servers.iter().any(|server| server.in_doubt()))
}

/// Logs a failure at the level it deserves; returns the wait before the retry.
fn report(cause: Cause, failures: u32, delay: Duration, (tenant, controller, object): (&str, &str, &str)) -> Duration {
    let delay = if cause.kind.is_unreachable() && !cause.kind.is_permanent() {
        delay.min(probe_delay())
    } else {
        delay
    };
    let quiet = match cause.kind {
        CauseKind::Conflict => failures < CONFLICTS_BEFORE_WARNING,
        CauseKind::Expired => true,
        // A server that stays away is retried often: say so at the first failure and now and then.
        kind if kind.is_unreachable() => failures > 1 && !failures.is_multiple_of(UNREACHABLE_WARNING_EVERY),
        _ => false,
    };
    if quiet {
        debug!(tenant, controller, object, %cause, retry_in = ?delay, "reconcile will be retried");
    } else {
        warn!(tenant, controller, object, %cause, failures, retry_in = ?delay, "reconcile failed");
    }
    delay
}
