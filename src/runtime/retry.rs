//! What a failed reconcile does next, by the root cause of its error: one rule for every
//! controller. A conflict is the normal end of an optimistic write and is retried quietly; a server
//! that does not answer is retried on the probe interval, so work resumes seconds after it is back;
//! anything else backs off per object and is reported.

use std::error::Error;
use std::time::Duration;

use tracing::{debug, warn};

use super::backoff::ObjectBackoff;
use super::cause::{CauseKind, diagnose};
use super::recovery::probe_delay;

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
    let delay = if cause.kind.is_unreachable() && !cause.kind.is_permanent() {
        delay.min(probe_delay())
    } else {
        delay
    };
    let quiet = match cause.kind {
        CauseKind::Conflict => failures < CONFLICTS_BEFORE_WARNING,
        CauseKind::Expired => true,
        // A server that stays away is retried often: say so at the first failure and now and then.
        kind if kind.is_unreachable() => failures > 1 && failures % UNREACHABLE_WARNING_EVERY != 0,
        _ => false,
    };
    if quiet {
        debug!(tenant, controller, object, %cause, retry_in = ?delay, "reconcile will be retried");
    } else {
        warn!(tenant, controller, object, %cause, failures, retry_in = ?delay, "reconcile failed");
    }
    delay
}
