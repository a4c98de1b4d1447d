//! The Stack's status (one writer: server-side apply as the Stack controller's field manager),
//! written only when an outcome changes it, and its Events: the reconcile's notes plus one for each
//! change of the Ready condition.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};
use tracing::info;

use super::context::{FIELD_MANAGER, StackContext, StackError};
use super::outcome::{Notes, Outcome, POD_TROUBLE_REASONS};
use crate::api::common::HostObjectRef;
use crate::api::stacks::{Stack, StackStatus};
use crate::context::tenant::TenantContext;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::events;
use crate::runtime::status_writer::apply_status;

/// How long a brief wait goes unreported when nothing ends it sooner.
pub(super) const BRIEF_WAIT: Duration = Duration::from_secs(2);

/// The key under which what was reported of a Stack is remembered.
pub(super) fn stack_key(stack: &Stack) -> String {
    format!("stack/{}/{}", stack.namespace().unwrap_or_default(), stack.name_any())
}

pub(super) async fn publish_notes(stack: &Stack, ctx: &StackContext, events: Vec<(EventType, &'static str, String)>) {
    for (type_, reason, note) in events {
        publish(&ctx.tenant, stack, type_, reason, note).await;
    }
}

/// The Stack's status as this process last wrote it, until the cache shows that write; else the
/// cached one.
pub(super) fn last_status(stack: &Stack, ctx: &StackContext) -> StackStatus {
    let uid = stack.uid().unwrap_or_default();
    let cached = stack.status.clone().unwrap_or_default();
    ctx.written.current(&uid, stack.resource_version().as_deref(), cached)
}

/// Writes the status when it changed, and publishes the reconcile's Events plus one for a change of
/// the Ready condition.
pub(super) async fn report(
    stack: &Stack,
    ctx: &StackContext,
    outcome: &Outcome,
    mut notes: Notes,
) -> Result<(), StackError> {
    let tenant = &ctx.tenant;
    let uid = stack.uid().unwrap_or_default();
    let old = last_status(stack, ctx);
    let key = stack_key(stack);
    let previous_ready = ctx.reported.get(&key).or_else(|| {
        let ready = old.conditions.iter().find(|c| c.type_ == "Ready")?;
        Some((ready.status == "True", ready.reason.clone()))
    });
    let refs = (notes.controller_ref.take(), notes.token_secret_ref.take());
    let now = Time(jiff::Timestamp::now());
    let status = next_status(&old, outcome, refs, stack.metadata.generation, now);
    let ready_changed = previous_ready
        .as_ref()
        .is_none_or(|(ready, reason)| reason != outcome.reason || *ready != outcome.ready);
    // A conflict already has its own event with the host object named.
    if ready_changed && outcome.reason != "HostObjectConflict" {
        let type_ = if outcome.ready || (outcome.synced && !POD_TROUBLE_REASONS.contains(&outcome.reason)) {
            EventType::Normal
        } else {
            EventType::Warning
        };
        notes.events.push((type_, outcome.reason, outcome.message.clone()));
    }
    publish_notes(stack, ctx, notes.events).await;
    if status != old {
        let api: Api<Stack> = Api::namespaced(tenant.client.clone(), &stack.namespace().unwrap_or_default());
        // The whole status, as this controller owns it: a reference left out is removed.
        let body = serde_json::to_value(&status).map_err(kube::Error::SerdeError)?;
        let stored = apply_status(&api, stack, FIELD_MANAGER, &body, None).await?;
        ctx.written.record(&uid, stored.resource_version(), status);
        if ready_changed {
            info!(ready = outcome.ready, reason = outcome.reason, "stack status");
        }
    }
    ctx.reported.set(&key, outcome.ready, outcome.reason);
    Ok(())
}

/// The status an outcome makes of `old`: its `Ready` and `Synced` conditions, and the host
/// references (`controllerRef`, `tokenSecretRef`) that apply now.
fn next_status(
    old: &StackStatus,
    outcome: &Outcome,
    (controller_ref, token_secret_ref): (Option<HostObjectRef>, Option<HostObjectRef>),
    generation: Option<i64>,
    now: Time,
) -> StackStatus {
    let mut status = old.clone();
    let (synced_reason, synced_message) = if outcome.synced {
        ("ReconcileSuccess", "the stack's spec is applied".to_string())
    } else {
        (outcome.reason, outcome.message.clone())
    };
    let conditions = [
        ("Ready", outcome.ready, outcome.reason, outcome.message.clone()),
        ("Synced", outcome.synced, synced_reason, synced_message),
    ];
    for (type_, ok, reason, message) in conditions {
        let desired = DesiredCondition {
            type_,
            status: ok,
            reason,
            message,
            observed_generation: generation,
        };
        set_condition(&mut status.conditions, desired, now.clone());
    }
    status.controller_ref = controller_ref;
    status.token_secret_ref = token_secret_ref;
    status.observed_generation = generation;
    status
}

/// Publishes an Event on the Stack; one that cannot be published is only logged.
pub(super) async fn publish(tenant: &TenantContext, stack: &Stack, type_: EventType, reason: &str, note: String) {
    let event = events::event(type_, reason, "Reconcile", note);
    if let Err(err) = tenant.recorder.publish(&event, &stack.object_ref(&())).await {
        events::log_unpublished(&err);
    }
}
