//! One reconcile of a Stack (DESIGN.md §3.3), as a sequence of named steps handing values forward:
//! validate → observe → build → apply (tenant, then host) → status. Each step is a function of its
//! own module; a step that must stop (refused, still waiting) hands back the [`Outcome`] the status
//! reports instead of a value.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use super::build::{self, HostNames, HostPlan};
use super::cleanup::cleanup;
use super::context::{StackContext, StackError};
use super::outcome::{Notes, Outcome, proceed};
use super::status::{BRIEF_WAIT, last_status, publish_notes, report};
use super::tenant::TenantIdentity;
use super::validate::{Judge, validate};
use super::{apply_host, apply_tenant, observe};
use crate::api::stacks::Stack;
use crate::host::apply::Applied;
use crate::host::quota_share;
use crate::runtime::controller::Permit;
use crate::runtime::finalizer;
use crate::stacks::STACK_FINALIZER;

/// How often a Stack with pull secrets reads them again: the tenant's Secrets are not watched (only
/// stackd's own are), so a rotated credential or a missing one created later is found this way.
const PULL_SECRET_RESYNC: Duration = Duration::from_secs(300);
/// How often a Stack refused for its namespace's share of the host quota looks again.
const QUOTA_SHARE_RECHECK: Duration = Duration::from_secs(30);

pub(super) async fn reconcile(
    stack: Arc<Stack>,
    ctx: Arc<StackContext>,
    _permit: Permit,
) -> Result<Action, StackError> {
    let tenant = &ctx.tenant;
    if let Err(refusal) = ctx.installs.scope_of(&stack)
        && !stack.finalizers().iter().any(|f| f == STACK_FINALIZER)
    {
        // A Stack made by hand gets no finalizer either: stackd holds nothing of it to clean up.
        let outcome = Outcome::refused(refusal.reason(), refusal.to_string());
        report(&stack, &ctx, &outcome, Notes::default()).await?;
        return Ok(Action::await_change());
    }
    let api: Api<Stack> = Api::namespaced(tenant.client.clone(), &stack.namespace().unwrap_or_default());
    let ctx = ctx.as_ref();
    finalizer::reconcile(
        &api,
        STACK_FINALIZER,
        stack,
        |stack| async move { apply(&stack, ctx).await },
        |stack| async move { cleanup(&stack, ctx).await },
    )
    .await
}

/// Converges the Stack, then reports the outcome (a brief wait unreported unless it lasts).
async fn apply(stack: &Stack, ctx: &StackContext) -> Result<Action, StackError> {
    // The host references a reconcile does not reach keep their last value: the one this process
    // last wrote, as `report` compares with, not the cached copy's. A cache one write behind would
    // otherwise undo that write, and each status write wakes the next reconcile, on a cache one
    // write behind again: a loop of writes that only ends when the cache catches up.
    let last = last_status(stack, ctx);
    let mut notes = Notes {
        controller_ref: last.controller_ref,
        token_secret_ref: last.token_secret_ref,
        ..Notes::default()
    };
    let result = converge(stack, ctx, &mut notes).await;
    let outcome = match &result {
        Ok(outcome) => outcome.clone(),
        Err(err) => Outcome::refused(err.reason(), err.to_string()),
    };
    if outcome.brief {
        // Reported only if it lasts: the event that ends it comes first as a rule.
        publish_notes(stack, ctx, notes.events).await;
        return Ok(Action::requeue(BRIEF_WAIT));
    }
    let reported = report(stack, ctx, &outcome, notes).await;
    // The reconcile's own error says more than a status write that failed for the same reason.
    result?;
    reported?;
    if outcome.reason == quota_share::REASON {
        // Other namespaces' workloads going bring this Stack no event of its own.
        Ok(Action::requeue(QUOTA_SHARE_RECHECK))
    } else if stack.spec.controller.image_pull_secrets.is_empty() {
        Ok(Action::await_change())
    } else {
        Ok(Action::requeue(PULL_SECRET_RESYNC))
    }
}

/// §3.3 in order: validate, read, build; the tenant identity and permissions and the filled token;
/// the token and pull-secret copies, then the host Deployment that owns them; readiness.
async fn converge(stack: &Stack, ctx: &StackContext, notes: &mut Notes) -> Result<Outcome, StackError> {
    let tenant = &ctx.tenant;
    // 1. Validate everything before writing anything.
    let judge = Judge {
        installs: &ctx.installs,
        settings: &tenant.shared.settings,
        endpoint: &tenant.endpoint,
        tenant_crds: &ctx.caches.crds.state(),
    };
    let controller = match validate(stack, &judge) {
        Ok(controller) => controller,
        Err(refused) => return refuse(stack, ctx, refused, notes).await,
    };
    // Everything the objects are built from is read first; building them writes nothing.
    let identity = TenantIdentity::of(stack);
    let host = HostNames::of(stack, &tenant.name, &tenant.host_namespace);
    let observed = observe::observe(ctx, &identity, controller.as_ref(), &host).await?;
    let pass_full = tenant.shared.settings.insecure_pass_full_deployment;
    let desired = proceed!(build::build(stack, controller.as_ref(), &observed, &host, pass_full));
    // 2. The controller's identity and permissions on the tenant, and its filled token.
    let observed_tenant = apply_tenant::Observed {
        token: observed.token_secret.as_deref(),
        stack_definition: observed.stack_definition.as_ref(),
    };
    let token_secret = proceed!(apply_tenant::write(ctx, &desired.tenant, observed_tenant, notes).await?);
    // A token Secret created just now: its fill is a watch event away.
    let just_created = token_secret == Applied::Created;
    let plan = proceed!(desired.host.map_break(|waiting| Outcome {
        brief: just_created,
        ..waiting
    }));
    let HostPlan::Run(objects) = plan else {
        return remove_controller(ctx, &host, notes).await;
    };
    // 3–4. Within its namespace's share of the tenant's host quota: the token and pull-secret
    // copies, then the controller Deployment that mounts them (so no pod waits on a missing volume).
    let observed_deployment = observed.deployment.as_deref();
    let what = format!(
        "the stack's controller Deployment {}/{}",
        host.namespace, host.deployment
    );
    let namespace = stack.namespace().unwrap_or_default();
    if let Err(refused) = tenant.check_quota_share(&what, &namespace, &objects.deployment, observed_deployment) {
        return Ok(Outcome::refused(refused.reason(), refused.to_string()));
    }
    // A Deployment created moments ago and not cached yet had its copies written just before it:
    // they are owned by it once its watch event brings its uid.
    let just_created = observed_deployment.is_none()
        && tenant
            .host_writes
            .was_created::<Deployment>(&host.namespace, &host.deployment);
    if !just_created {
        apply_host::write_copies(ctx, &host, &objects.copies, notes).await?;
    }
    proceed!(apply_host::write_deployment(ctx, &host, &objects.deployment, observed_deployment, notes).await?);
    // 5. Ready when the Deployment has an available replica.
    Ok(objects.readiness)
}

/// A refused Stack keeps what it has, except one no install controls that was reconciled once (by
/// an older stackd, or before its owner reference changed): what it was given goes, not only what
/// it would get next.
async fn refuse(stack: &Stack, ctx: &StackContext, refused: Outcome, notes: &mut Notes) -> Result<Outcome, StackError> {
    if refused.reason == "NotInstalled" && !ctx.installs.has_install(stack) {
        cleanup(stack, ctx).await?;
        notes.controller_ref = None;
        notes.token_secret_ref = None;
    }
    Ok(refused)
}

/// A controller dropped from the spec does not keep running on the host.
async fn remove_controller(ctx: &StackContext, host: &HostNames, notes: &mut Notes) -> Result<Outcome, StackError> {
    apply_host::delete_host_objects(ctx, &host.parent).await?;
    notes.controller_ref = None;
    notes.token_secret_ref = None;
    Ok(Outcome::ready(
        "NoController",
        "the stack has no controller Deployment; its CRDs and permissions are installed".into(),
    ))
}
