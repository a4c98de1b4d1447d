//! `metav1.Condition` helpers: set a condition the way kube-apiserver users expect, keeping
//! `lastTransitionTime` unless the status changes, so rewriting an unchanged condition is a no-op.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::text_bounds::{MAX_CONDITION_MESSAGE_BYTES, fit_text};

/// What a condition should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredCondition<'a> {
    pub type_: &'a str,
    pub status: bool,
    /// A stable PascalCase word.
    pub reason: &'a str,
    /// A sentence a user can act on.
    pub message: String,
    pub observed_generation: Option<i64>,
}

/// Sets `desired` in `conditions`, its message cut to what kube-apiserver accepts; returns whether
/// anything changed.
pub fn set_condition(conditions: &mut Vec<Condition>, mut desired: DesiredCondition<'_>, now: Time) -> bool {
    desired.message = fit_text(desired.message, MAX_CONDITION_MESSAGE_BYTES);
    let status = if desired.status { "True" } else { "False" };
    match conditions.iter_mut().find(|c| c.type_ == desired.type_) {
        Some(existing) => {
            let unchanged = existing.status == status
                && existing.reason == desired.reason
                && existing.message == desired.message
                && existing.observed_generation == desired.observed_generation;
            if unchanged {
                return false;
            }
            if existing.status != status {
                existing.last_transition_time = now;
            }
            existing.status = status.to_string();
            existing.reason = desired.reason.to_string();
            existing.message = desired.message;
            existing.observed_generation = desired.observed_generation;
            true
        }
        None => {
            conditions.push(Condition {
                type_: desired.type_.to_string(),
                status: status.to_string(),
                reason: desired.reason.to_string(),
                message: desired.message,
                observed_generation: desired.observed_generation,
                last_transition_time: now,
            });
            true
        }
    }
}

/// Whether the condition `type_` is True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions.iter().any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn time(seconds: i64) -> Time {
        Time(jiff::Timestamp::from_second(seconds).unwrap_or_default())
    }

    fn ready(status: bool, reason: &str) -> DesiredCondition<'_> {
        DesiredCondition {
            type_: "Ready",
            status,
            reason,
            message: format!("{reason}."),
            observed_generation: Some(1),
        }
    }

    #[test]
    fn a_new_condition_is_added() {
        let mut conditions = Vec::new();
        assert!(set_condition(&mut conditions, ready(false, "Installing"), time(10)));
        assert_eq!(conditions.len(), 1);
        assert!(!is_true(&conditions, "Ready"));
    }

    #[test]
    fn a_message_past_what_kube_apiserver_accepts_is_cut_and_rewriting_it_is_a_no_op() {
        let mut conditions = Vec::new();
        let long = || DesiredCondition {
            message: "problem; ".repeat(10_000),
            ..ready(false, "InvalidPackage")
        };
        set_condition(&mut conditions, long(), time(10));
        assert!(conditions[0].message.len() <= MAX_CONDITION_MESSAGE_BYTES);
        assert!(!set_condition(&mut conditions, long(), time(20)));
    }

    #[test]
    fn an_unchanged_condition_is_a_no_op() {
        let mut conditions = Vec::new();
        set_condition(&mut conditions, ready(true, "Available"), time(10));
        assert!(!set_condition(&mut conditions, ready(true, "Available"), time(20)));
        assert_eq!(conditions[0].last_transition_time, time(10));
    }

    #[test]
    fn transition_time_moves_only_when_the_status_changes() {
        let mut conditions = Vec::new();
        set_condition(&mut conditions, ready(false, "Installing"), time(10));
        assert!(set_condition(&mut conditions, ready(false, "WaitingForCrds"), time(20)));
        assert_eq!(conditions[0].last_transition_time, time(10), "same status, new reason");
        assert!(set_condition(&mut conditions, ready(true, "Available"), time(30)));
        assert_eq!(conditions[0].last_transition_time, time(30));
        assert!(is_true(&conditions, "Ready"));
    }
}
