//! The Stack controller (DESIGN.md §3.3, and the Stack half of §3.4): per tenant, it gives each Stack
//! its identity and permissions on the tenant, copies the controller's token to the host and runs the
//! controller Deployment there, repairing drift on either side as the watches report it.

pub mod deployment;
pub mod origin;
pub mod rbac;
pub mod tenant;
pub mod token;
pub mod token_watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt, predicates, watcher};
use kube::{Api, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use self::origin::Installs;
use self::tenant::{TenantIdentity, TenantWriteError, stack_of};
use super::pull_secrets;
use super::unpack::split_dependency;
use super::{STACK_FINALIZER, crd_parent_label};
use crate::api::common::HostObjectRef;
use crate::api::stacks::{ClusterStackInstall, Stack, StackInstall, StackStatus};
use crate::context::endpoint::TenantEndpoint;
use crate::context::tenant::{TenantContext, TenantError};
use crate::host::apply::{self, Applied, HostWriteError, Update, stamp};
use crate::host::labels::{
    MANAGED_BY, MANAGED_BY_LABEL, Parent, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
};
use crate::host::names::{NameKind, host_name};
use crate::runtime::api_errors::is_not_found;
use crate::runtime::conditions::{DesiredCondition, set_condition};
use crate::runtime::controller::{Permit, ReconcileError, Scaffold};
use crate::runtime::finalizer::{self, Cleanup, FinalizerError};
use crate::runtime::informers::SharedCache;
use crate::runtime::panics::ReconcilePanic;
use crate::runtime::status_writer::apply_status;
use crate::runtime::written::Written;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "stack";
/// The field manager of the Stack controller's writes to tenant objects.
const FIELD_MANAGER: &str = "stackd/stack";
/// The tenant kind named in host objects' parent labels.
pub const KIND: &str = "Stack";
/// How often a Stack with pull secrets reads them again: the tenant's Secrets are not watched (only
/// stackd's own are), so a rotated credential or a missing one created later is found this way.
const PULL_SECRET_RESYNC: Duration = Duration::from_secs(300);

/// Cached copies of everything the controller writes, kept current by the watches that also
/// trigger reconciles: a write is decided from these, never from a fresh GET.
struct Caches {
    service_accounts: Store<ServiceAccount>,
    /// The Stacks' token Secrets only, by metadata; their data read when they change.
    token_secrets: token_watch::TokenSecrets,
    cluster_roles: Store<ClusterRole>,
    role_bindings: Store<RoleBinding>,
    cluster_role_bindings: Store<ClusterRoleBinding>,
    crds: Store<CustomResourceDefinition>,
    deployments: Store<Deployment>,
    host_secrets: Store<Secret>,
}

struct StackContext {
    tenant: Arc<TenantContext>,
    caches: Caches,
    installs: Installs,
    reported: ReportedReadiness,
    /// The last status written to each Stack.
    written: Written<StackStatus>,
}

/// The Ready condition (status, reason) this process last wrote per Stack. A reconcile starts from
/// the cached Stack, which can predate the status write of the reconcile just before it (its watch
/// event not in yet): judged by that copy alone, one transition would be announced twice.
#[derive(Default)]
struct ReportedReadiness(Mutex<HashMap<String, (bool, String)>>);

impl ReportedReadiness {
    fn get(&self, key: &str) -> Option<(bool, String)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    fn set(&self, key: &str, ready: bool, reason: &str) {
        let mut reported = self.0.lock().unwrap_or_else(|p| p.into_inner());
        reported.insert(key.to_string(), (ready, reason.to_string()));
    }

    fn forget(&self, key: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(transparent)]
    Host(#[from] HostWriteError),
    #[error(transparent)]
    Tenant(#[from] TenantWriteError),
    #[error(transparent)]
    Finalizer(#[from] FinalizerError),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

impl StackError {
    fn reason(&self) -> &'static str {
        match self {
            StackError::Host(err) => err.reason(),
            StackError::Tenant(TenantWriteError::Conflict { .. }) => "TenantObjectConflict",
            StackError::Tenant(TenantWriteError::Api(_)) => "TenantUnavailable",
            StackError::Finalizer(_) => "ReconcileError",
            StackError::Panicked(_) => "ReconcilePanicked",
        }
    }
}

impl ReconcileError for StackError {
    fn metric_label(&self) -> &'static str {
        match self {
            StackError::Host(_) => "host_write",
            StackError::Tenant(TenantWriteError::Conflict { .. }) => "tenant_conflict",
            StackError::Tenant(TenantWriteError::Api(_)) => "tenant_api",
            StackError::Finalizer(_) => "finalizer",
            StackError::Panicked(_) => "panic",
        }
    }
}

impl From<kube::Error> for StackError {
    fn from(err: kube::Error) -> Self {
        StackError::Tenant(TenantWriteError::Api(err))
    }
}

/// Runs the Stack controller of one tenant until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) -> Result<(), TenantError> {
    let shared = &context.caches;
    let ours = format!("{MANAGED_BY_LABEL}={MANAGED_BY}");
    let service_accounts = shared.tenant::<ServiceAccount>(&ours);
    // Not a shared cache of Secrets: any user can label a Secret as stackd's (see `token_watch`).
    let (token_secrets, token_events) = token_watch::watch(context.client.clone(), &ours, context.reachability.back());
    let cluster_roles = shared.tenant::<ClusterRole>(&ours);
    let role_bindings = shared.tenant::<RoleBinding>(&ours);
    let cluster_role_bindings = shared.tenant::<ClusterRoleBinding>(&ours);
    let crds = shared.tenant_crds();
    let (deployments, host_secrets) = (shared.host::<Deployment>(), shared.host::<Secret>());
    let stack_installs = shared.tenant_guarded::<StackInstall>();
    let cluster_stack_installs = shared.tenant_guarded::<ClusterStackInstall>();
    let stacks = shared.tenant_guarded::<Stack>();
    let stack_store = stacks.store();
    // Every event of a host object means the cache has shown it: a creation is no longer pending.
    let (on_deployment, on_secret) = (context.clone(), context.clone());
    let scaffold = Scaffold::new(CONTROLLER, context.clone(), &stacks)
        .watches(&service_accounts, |o| stack_of(o.as_ref()))
        .watches_ready_stream(token_secrets.readiness(), token_events, |o| stack_of(&o))
        .watches(&cluster_roles, |o| stack_of(o.as_ref()))
        .watches(&role_bindings, |o| stack_of(o.as_ref()))
        .watches(&cluster_role_bindings, |o| stack_of(o.as_ref()))
        .watches(&crds, move |crd| stacks_using(&stack_store, &crd))
        .watches(&deployments, move |o| {
            on_deployment.host_writes.seen(o.as_ref());
            host_parent(o.as_ref())
        })
        .watches(&host_secrets, move |o| {
            on_secret.host_writes.seen(o.as_ref());
            host_parent(o.as_ref())
        })
        // A Stack is judged by its install: a new one decides whether it runs. (One that goes takes
        // its Stack with it, or leaves it without the owner reference, which is a Stack event.)
        .watches_stream(&stack_installs, new_generations(&stack_installs), |o| {
            Some(stack_at(&o))
        })
        .watches_stream(&cluster_stack_installs, new_generations(&cluster_stack_installs), |o| {
            Some(stack_at(&o))
        });
    let ctx = Arc::new(StackContext {
        tenant: context,
        reported: ReportedReadiness::default(),
        written: Written::default(),
        caches: Caches {
            service_accounts: service_accounts.store(),
            token_secrets,
            cluster_roles: cluster_roles.store(),
            role_bindings: role_bindings.store(),
            cluster_role_bindings: cluster_role_bindings.store(),
            crds: crds.store(),
            deployments: deployments.store(),
            host_secrets: host_secrets.store(),
        },
        installs: Installs {
            stack_installs: stack_installs.store(),
            cluster_stack_installs: cluster_stack_installs.store(),
        },
    });
    scaffold.run(ctx, reconcile, &cancel).await;
    Ok(())
}

/// The Stack a host object belongs to, from its identity annotations.
fn host_parent<K: Resource>(object: &K) -> Option<ObjectRef<Stack>> {
    let annotations = object.annotations();
    if annotations.get(TENANT_KIND_ANNOTATION).map(String::as_str) != Some(KIND) {
        return None;
    }
    let namespace = annotations.get(TENANT_NAMESPACE_ANNOTATION)?;
    let name = annotations.get(TENANT_NAME_ANNOTATION)?;
    Some(ObjectRef::new(name).within(namespace))
}

/// Install events that can change a Stack's standing (a new install), not its every status write.
fn new_generations<K>(
    installs: &SharedCache<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    installs
        .touched()
        .map(|install| Ok(install.as_ref().clone()))
        .predicate_filter(predicates::generation, PredicateConfig::default())
}

/// The Stack an install creates: the one at its own namespace and name.
fn stack_at<K: Resource>(install: &K) -> ObjectRef<Stack> {
    ObjectRef::new(&install.name_any()).within(&install.namespace().unwrap_or_default())
}

/// The Stacks that own a CRD (by group and kind), depend on its group (whose permissions depend on
/// who created the group's CRDs), or carry its parent label.
fn stacks_using(stacks: &Store<Stack>, crd: &CustomResourceDefinition) -> Vec<ObjectRef<Stack>> {
    let labels = crd.labels();
    let group = crd.spec.group.as_str();
    stacks
        .state()
        .iter()
        .filter(|stack| {
            let owns = stack
                .spec
                .customresourcedefinitions
                .iter()
                .any(|r| r.kind == crd.spec.names.kind && r.api_version.split('/').next() == Some(group));
            let depends =
                stack.spec.metadata.depends_on.iter().any(|dependency| {
                    dependency.crd.as_deref().and_then(split_dependency).map(|(_, g)| g) == Some(group)
                });
            owns || depends
                || labels.contains_key(&crd_parent_label(
                    &stack.namespace().unwrap_or_default(),
                    &stack.name_any(),
                ))
        })
        .map(|stack| ObjectRef::from(stack.as_ref()))
        .collect()
}

fn stack_key(stack: &Stack) -> String {
    format!("stack/{}/{}", stack.namespace().unwrap_or_default(), stack.name_any())
}

async fn reconcile(stack: Arc<Stack>, ctx: Arc<StackContext>, _permit: Permit) -> Result<Action, StackError> {
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

/// What a reconcile found, for the Stack's status.
#[derive(Clone)]
struct Outcome {
    ready: bool,
    reason: &'static str,
    message: String,
    /// False when the spec could not be applied (refused, or an error).
    synced: bool,
    /// A wait that ends within moments as a rule (a token Secret just created, which the
    /// tenant's token controller fills at once): not reported unless it lasts, so the usual install
    /// costs no status write and Event for it.
    brief: bool,
}

impl Outcome {
    fn refused(reason: &'static str, message: String) -> Self {
        Outcome {
            ready: false,
            reason,
            message,
            synced: false,
            brief: false,
        }
    }

    fn waiting(reason: &'static str, message: String) -> Self {
        Outcome {
            ready: false,
            reason,
            message,
            synced: true,
            brief: false,
        }
    }
}

/// Notes gathered during a reconcile, published as Events on the Stack at its end.
#[derive(Default)]
struct Notes {
    events: Vec<(EventType, &'static str, String)>,
    controller_ref: Option<HostObjectRef>,
    token_secret_ref: Option<HostObjectRef>,
}

impl Notes {
    fn normal(&mut self, reason: &'static str, note: String) {
        self.events.push((EventType::Normal, reason, note));
    }
}

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
    if stack.spec.controller.image_pull_secrets.is_empty() {
        Ok(Action::await_change())
    } else {
        Ok(Action::requeue(PULL_SECRET_RESYNC))
    }
}

/// §3.3 in order: validate, the tenant identity and permissions, wait for the token, read the pull
/// secrets, the host Deployment, the host token and pull-secret copies, readiness.
async fn converge(stack: &Stack, ctx: &StackContext, notes: &mut Notes) -> Result<Outcome, StackError> {
    // 1. Validate everything before writing anything.
    let controller = match validate(stack, &ctx.tenant, &ctx.installs, &ctx.caches.crds.state()) {
        Ok(controller) => controller,
        Err(refused) => {
            if refused.reason == "NotInstalled" && !ctx.installs.has_install(stack) {
                // A Stack no install controls that was reconciled once (by an older stackd, or
                // before its owner reference changed): what it was given goes, not only what it
                // would get next.
                cleanup(stack, ctx).await?;
                notes.controller_ref = None;
                notes.token_secret_ref = None;
            }
            return Ok(refused);
        }
    };
    // The pull secrets are read before anything is written: one that cannot be copied leaves
    // everything as it is.
    let pull_sources = match pull_sources(stack, ctx, controller.as_ref()).await? {
        Ok(sources) => sources,
        Err(err) => return Ok(Outcome::refused(err.reason(), err.to_string())),
    };
    // 2. The controller's identity and permissions on the tenant, and its filled token.
    let token_data = match ensure_tenant_objects(stack, ctx, notes).await? {
        Ok(data) => data,
        Err(waiting) => return Ok(waiting),
    };
    let Some(controller) = controller else {
        // A controller dropped from the spec does not keep running on the host.
        let host = HostNames::of(stack, &ctx.tenant);
        delete_host_objects(ctx, &host.parent).await?;
        notes.controller_ref = None;
        notes.token_secret_ref = None;
        return Ok(Outcome {
            ready: true,
            reason: "NoController",
            message: "the stack has no controller Deployment; its CRDs and permissions are installed".into(),
            synced: true,
            brief: false,
        });
    };
    // 3–4. The controller Deployment on the host, then the token and pull-secret copies (owned by it).
    let host = HostNames::of(stack, &ctx.tenant);
    let pull_copies = pull_copy_names(ctx, &host, &pull_sources);
    let deployment = match ensure_deployment(ctx, &host, &controller, &pull_copies, notes).await? {
        Ok(deployment) => deployment,
        Err(waiting) => return Ok(waiting),
    };
    ensure_token_copy(ctx, &host, token_data, &deployment, notes).await?;
    ensure_pull_copies(ctx, &host, &pull_copies, &pull_sources, &deployment, notes).await?;
    // 5. Ready when the Deployment has an available replica.
    Ok(readiness(&host, &deployment))
}

/// The tenant pull secrets the controller's pods pull with (none without a controller).
async fn pull_sources(
    stack: &Stack,
    ctx: &StackContext,
    controller: Option<&CheckedController<'_>>,
) -> Result<Result<Vec<Secret>, pull_secrets::PullSecretError>, StackError> {
    let Some(controller) = controller.filter(|c| !c.pull_secrets.is_empty()) else {
        return Ok(Ok(Vec::new()));
    };
    let namespace = stack.namespace().unwrap_or_default();
    let api = Api::namespaced(ctx.tenant.client.clone(), &namespace);
    Ok(pull_secrets::sources(&api, &namespace, &controller.pull_secrets).await?)
}

/// A stack's controller as validated: what the host Deployment is built from.
struct CheckedController<'a> {
    spec: DeploymentSpec,
    endpoint: &'a TenantEndpoint,
    /// The tenant pull secrets (in the Stack's namespace) its pods pull with.
    pull_secrets: Vec<String>,
}

/// Refuses what stackd will not run: a Stack no install created or with a scope its install does not
/// allow, permissions beyond the stack's API, a pod spec that is not a DeploymentSpec or reaches the
/// host, a pull secret that is not named as a Secret of the Stack's namespace, an endpoint host pods
/// cannot use. Returns the checked controller (none for a stack without a controller).
fn validate<'a>(
    stack: &Stack,
    tenant: &'a TenantContext,
    installs: &Installs,
    tenant_crds: &[Arc<CustomResourceDefinition>],
) -> Result<Option<CheckedController<'a>>, Outcome> {
    let refused = |refusal: origin::Refusal| Outcome::refused(refusal.reason(), refusal.to_string());
    let scope = installs.scope_of(stack).map_err(refused)?;
    origin::check_scope(stack, scope).map_err(refused)?;
    let settings = &tenant.shared.settings;
    if !settings.insecure_allow_all_apigroups
        && let Err(message) = rbac::validate_permissions(&stack.spec, tenant_crds)
    {
        return Err(Outcome::refused("PermissionsRefused", message));
    }
    let Some(controller) = &stack.spec.controller.deployment else {
        return Ok(None);
    };
    let spec = deployment::parse(&controller.spec)
        .and_then(|spec| {
            if !settings.insecure_pass_full_deployment {
                deployment::check_safe(&spec, &settings.stack_pod_policy)?;
            }
            deployment::check_images(&spec, &settings.allowed_registries)?;
            Ok(spec)
        })
        .map_err(|err| Outcome::refused(err.reason(), err.to_string()))?;
    let namespace = stack.namespace().unwrap_or_default();
    let pull_secrets = pull_secrets::checked_names(&stack.spec.controller.image_pull_secrets, &namespace)
        .map_err(|err| Outcome::refused(err.reason(), err.to_string()))?;
    let endpoint = tenant
        .endpoint
        .as_ref()
        .map_err(|err| err.clone())
        .and_then(|endpoint| {
            endpoint
                .check_usable_by_pods(settings.allow_insecure_tenant_endpoint)
                .map(|()| endpoint)
        })
        .map_err(|err| Outcome::refused("TenantEndpointUnusable", err.to_string()))?;
    Ok(Some(CheckedController {
        spec,
        endpoint,
        pull_secrets,
    }))
}

/// Tenant objects created or repaired in one reconcile, reported as one Event each.
#[derive(Default)]
struct TenantWrites {
    created: Vec<String>,
    repaired: Vec<String>,
}

impl TenantWrites {
    fn record(&mut self, what: String, applied: Applied) {
        match applied {
            Applied::Created => self.created.push(what),
            Applied::Updated => self.repaired.push(what),
            Applied::Unchanged => {}
        }
    }

    fn report(self, notes: &mut Notes) {
        if !self.created.is_empty() {
            notes.normal(
                "CreatedTenantObjects",
                format!("created on the tenant: {}", self.created.join(", ")),
            );
        }
        if !self.repaired.is_empty() {
            notes.normal(
                "RepairedTenantObjects",
                format!("brought back to the stack's spec: {}", self.repaired.join(", ")),
            );
        }
    }
}

/// ServiceAccount, system ClusterRole and its binding, persona roles, token Secret; then the token's
/// keys once the tenant's token controller filled them (the Secret watch brings the filled copy).
async fn ensure_tenant_objects(
    stack: &Stack,
    ctx: &StackContext,
    notes: &mut Notes,
) -> Result<Result<BTreeMap<String, ByteString>, Outcome>, StackError> {
    let mut writes = TenantWrites::default();
    let result = write_tenant_objects(stack, ctx, &mut writes).await;
    writes.report(notes);
    result
}

async fn write_tenant_objects(
    stack: &Stack,
    ctx: &StackContext,
    writes: &mut TenantWrites,
) -> Result<Result<BTreeMap<String, ByteString>, Outcome>, StackError> {
    let identity = TenantIdentity::of(stack);
    let Some(owner) = stack.controller_owner_ref(&()) else {
        return Ok(Err(Outcome::waiting("NotPersisted", "the Stack has no uid yet".into())));
    };
    let (client, caches) = (&ctx.tenant.client, &ctx.caches);
    let ns = identity.namespace.as_str();
    let sa = rbac::service_account(stack, &identity, &owner);
    let observed = caches.service_accounts.get(&in_namespace(&identity.name, ns));
    let applied = tenant::ensure(
        &Api::namespaced(client.clone(), ns),
        &identity,
        &sa,
        observed.as_deref(),
    )
    .await?;
    writes.record(format!("ServiceAccount {}", identity.name), applied);
    let role = rbac::system_role(stack, &identity);
    let applied = ensure_cluster_scoped(client, &identity, &role, &caches.cluster_roles).await?;
    writes.record(format!("ClusterRole {}", role.name_any()), applied);
    if rbac::binds_cluster_wide(stack) {
        let binding = rbac::cluster_role_binding(&identity);
        let applied = ensure_cluster_scoped(client, &identity, &binding, &caches.cluster_role_bindings).await?;
        writes.record(format!("ClusterRoleBinding {}", binding.name_any()), applied);
        // A stack whose scope changed keeps no binding of the other kind.
        let stale = caches.role_bindings.get(&in_namespace(&binding.name_any(), ns));
        if stale.is_some_and(|b| identity.owns(b.as_ref())) {
            delete_tenant(&Api::<RoleBinding>::namespaced(client.clone(), ns), &binding.name_any()).await?;
        }
    } else {
        let binding = rbac::role_binding(&identity, &owner);
        let observed = caches.role_bindings.get(&in_namespace(&binding.name_any(), ns));
        let api = Api::namespaced(client.clone(), ns);
        let applied = tenant::ensure(&api, &identity, &binding, observed.as_deref()).await?;
        writes.record(format!("RoleBinding {}", binding.name_any()), applied);
        let stale = caches.cluster_role_bindings.get(&ObjectRef::new(&binding.name_any()));
        if stale.is_some_and(|b| identity.owns(b.as_ref())) {
            delete_tenant(&Api::<ClusterRoleBinding>::all(client.clone()), &binding.name_any()).await?;
        }
    }
    let roles = match rbac::persona_roles(stack, &identity, &caches.crds.state()) {
        Ok(roles) => roles,
        Err(missing) => {
            return Ok(Err(Outcome::waiting(
                "WaitingForCrds",
                format!(
                    "waiting for the stack's CRDs to be served on the tenant: {}",
                    missing.join(", ")
                ),
            )));
        }
    };
    for role in roles {
        let applied = ensure_cluster_scoped(client, &identity, &role, &caches.cluster_roles).await?;
        writes.record(format!("ClusterRole {}", role.name_any()), applied);
    }
    let secret = token::tenant_secret(&identity, &owner);
    let api = Api::namespaced(client.clone(), ns);
    let observed = caches.token_secrets.current(&api, ns, &secret.name_any()).await?;
    let applied = tenant::ensure(&api, &identity, &secret, observed.as_deref()).await?;
    writes.record(format!("Secret {}", secret.name_any()), applied);
    let filled = observed.as_deref().and_then(|s| token::filled_keys(s, &identity));
    Ok(filled.ok_or_else(|| Outcome {
        // Created just now: its fill is a watch event away.
        brief: applied == Applied::Created,
        ..Outcome::waiting(
            "WaitingForToken",
            format!(
                "waiting for the tenant's token controller to fill Secret {ns}/{}",
                secret.name_any()
            ),
        )
    }))
}

fn in_namespace<K: Resource<DynamicType = ()>>(name: &str, namespace: &str) -> ObjectRef<K> {
    ObjectRef::new(name).within(namespace)
}

/// The Stack's host objects: their parent and mapped names.
struct HostNames {
    parent: Parent,
    tenant: String,
    namespace: String,
    tenant_namespace: String,
    deployment: String,
    secret: String,
}

impl HostNames {
    fn of(stack: &Stack, tenant: &TenantContext) -> Self {
        let ns = stack.namespace().unwrap_or_default();
        let name = stack.name_any();
        HostNames {
            parent: Parent::new(KIND, Some(&ns), &name, stack.meta().uid.as_deref().unwrap_or_default()),
            tenant: tenant.name.clone(),
            namespace: tenant.host_namespace.clone(),
            deployment: host_name(Some(&ns), &name, "", NameKind::LabelBound),
            secret: host_name(Some(&ns), &name, "-token", NameKind::Object),
            tenant_namespace: ns,
        }
    }

    fn deployment_ref(&self) -> HostObjectRef {
        HostObjectRef {
            namespace: self.namespace.clone(),
            name: self.deployment.clone(),
        }
    }
}

/// Creates or repairs the host Deployment; returns the cached copy, whose uid the token copy's owner
/// reference needs (after a create, the Deployment's watch event brings it).
async fn ensure_deployment(
    ctx: &StackContext,
    host: &HostNames,
    controller: &CheckedController<'_>,
    pull_copies: &[String],
    notes: &mut Notes,
) -> Result<Result<Arc<Deployment>, Outcome>, StackError> {
    let tenant = &ctx.tenant;
    let mut desired = deployment::build(
        &controller.spec,
        &deployment::Inputs {
            name: &host.deployment,
            host_namespace: &host.namespace,
            tenant: &host.tenant,
            parent: &host.parent,
            tenant_namespace: &host.tenant_namespace,
            endpoint: controller.endpoint,
            token_secret: &host.secret,
            pull_secrets: pull_copies,
            pass_full: tenant.shared.settings.insecure_pass_full_deployment,
        },
    );
    stamp(&mut desired, &host.tenant, &host.parent);
    let api: Api<Deployment> = Api::namespaced(tenant.host.clone(), &host.namespace);
    let observed = ctx
        .caches
        .deployments
        .get(&ObjectRef::new(&host.deployment).within(&host.namespace));
    let applied = apply::ensure(
        &api,
        &desired,
        observed.as_deref(),
        &host.tenant,
        &host.parent,
        Update::WhenDifferent(&tenant.host_writes),
    )
    .await
    .inspect_err(|err| conflict_note(notes, err))?;
    notes.controller_ref = Some(host.deployment_ref());
    let (namespace, name) = (&host.namespace, &host.deployment);
    match applied {
        Applied::Created => notes.normal(
            "CreatedDeployment",
            format!("created the controller Deployment {namespace}/{name} on the host"),
        ),
        Applied::Updated => notes.normal(
            "UpdatedDeployment",
            format!("brought the controller Deployment {namespace}/{name} on the host back to the stack's spec"),
        ),
        Applied::Unchanged => {}
    }
    match observed {
        Some(current) if applied != Applied::Created => Ok(Ok(current)),
        // Said as the Deployment's own first status will say it, so that seeing that status is no
        // second write.
        _ => Ok(Err(Outcome::waiting(
            "DeploymentUnavailable",
            unavailable_message(namespace, name, NO_REPLICA_YET),
        ))),
    }
}

/// Creates `copy` in the host namespace, or replaces the cached one when it differs (a replace the
/// host reverted waits out its backoff).
async fn ensure_host_secret(
    ctx: &StackContext,
    host: &HostNames,
    copy: &Secret,
    notes: &mut Notes,
) -> Result<Applied, StackError> {
    let api: Api<Secret> = Api::namespaced(ctx.tenant.host.clone(), &host.namespace);
    let observed = ctx
        .caches
        .host_secrets
        .get(&ObjectRef::new(&copy.name_any()).within(&host.namespace));
    let applied = apply::ensure(
        &api,
        copy,
        observed.as_deref(),
        &host.tenant,
        &host.parent,
        Update::WhenDifferent(&ctx.tenant.host_writes),
    )
    .await
    .inspect_err(|err| conflict_note(notes, err))?;
    Ok(applied)
}

/// Copies the tenant token to the host Secret the Deployment mounts, again whenever it changes.
async fn ensure_token_copy(
    ctx: &StackContext,
    host: &HostNames,
    data: BTreeMap<String, ByteString>,
    owner: &Deployment,
    notes: &mut Notes,
) -> Result<(), StackError> {
    let mut copy = token::host_secret(&host.secret, &host.namespace, data, owner);
    stamp(&mut copy, &host.tenant, &host.parent);
    let applied = ensure_host_secret(ctx, host, &copy, notes).await?;
    notes.token_secret_ref = Some(HostObjectRef {
        namespace: host.namespace.clone(),
        name: host.secret.clone(),
    });
    let (namespace, name) = (&host.namespace, &host.secret);
    match applied {
        Applied::Created => notes.normal(
            "CopiedToken",
            format!("copied the controller's token to the host Secret {namespace}/{name}"),
        ),
        Applied::Updated => notes.normal(
            "RecopiedToken",
            format!("copied the controller's changed token to the host Secret {namespace}/{name}"),
        ),
        Applied::Unchanged => {}
    }
    Ok(())
}

/// Host names of the pull-secret copies, one per source in order: those the Deployment already uses
/// are kept (a copy is re-synced in place), new ones are unguessable. A copy whose type no longer
/// matches its source gets a new name, as a Secret's type cannot change.
fn pull_copy_names(ctx: &StackContext, host: &HostNames, sources: &[Secret]) -> Vec<String> {
    let observed = ctx
        .caches
        .deployments
        .get(&ObjectRef::new(&host.deployment).within(&host.namespace));
    let in_use = pull_secrets::referenced(
        observed
            .as_ref()
            .and_then(|d| d.spec.as_ref())
            .and_then(|s| s.template.spec.as_ref()),
    );
    sources
        .iter()
        .enumerate()
        .map(|(index, source)| {
            let reusable = in_use.get(index).filter(|name| {
                let copy = ctx
                    .caches
                    .host_secrets
                    .get(&ObjectRef::new(name).within(&host.namespace));
                copy.is_none_or(|copy| copy.type_.as_deref() == pull_secrets::copy_type(source))
            });
            match reusable {
                Some(name) => name.clone(),
                None => pull_secrets::host_copy_name(&host.tenant_namespace, &host.parent.name, index),
            }
        })
        .collect()
}

/// Copies the tenant pull secrets to the host Secrets the Deployment's pods name (again whenever a
/// source changes), then deletes the copies of pull secrets the Stack no longer names.
async fn ensure_pull_copies(
    ctx: &StackContext,
    host: &HostNames,
    names: &[String],
    sources: &[Secret],
    owner: &Deployment,
    notes: &mut Notes,
) -> Result<(), StackError> {
    let (mut created, mut updated) = (Vec::new(), Vec::new());
    for (name, source) in names.iter().zip(sources) {
        let target = pull_secrets::CopyTarget {
            tenant: &host.tenant,
            parent: &host.parent,
            host_namespace: &host.namespace,
            name,
            owner: token::owner_reference(owner),
        };
        let copy = pull_secrets::host_copy(&target, source);
        let applied = ensure_host_secret(ctx, host, &copy, notes).await?;
        let copied = format!("{} as {}/{name}", source.name_any(), host.namespace);
        match applied {
            Applied::Created => created.push(copied),
            Applied::Updated => updated.push(copied),
            Applied::Unchanged => {}
        }
    }
    if !created.is_empty() {
        notes.normal(
            "CopiedPullSecrets",
            format!("copied imagePullSecret(s) to the host: {}", created.join(", ")),
        );
    }
    if !updated.is_empty() {
        notes.normal(
            "RecopiedPullSecrets",
            format!("copied changed imagePullSecret(s) to the host: {}", updated.join(", ")),
        );
    }
    let stale: Vec<Secret> = ctx
        .caches
        .host_secrets
        .state()
        .iter()
        .filter(|s| s.annotations().contains_key(pull_secrets::SOURCE_ANNOTATION) && !names.contains(&s.name_any()))
        .map(|s| (**s).clone())
        .collect();
    let api: Api<Secret> = Api::namespaced(ctx.tenant.host.clone(), &host.namespace);
    let removed = apply::delete_all(&api, &stale, &host.tenant, &host.parent)
        .await
        .map_err(HostWriteError::from)?;
    if removed > 0 {
        notes.normal(
            "DeletedPullSecrets",
            format!("deleted {removed} host copy(ies) of imagePullSecrets the stack no longer names"),
        );
    }
    Ok(())
}

fn readiness(host: &HostNames, current: &Deployment) -> Outcome {
    let (namespace, name) = (&host.namespace, &host.deployment);
    if deployment::is_available(current) {
        return Outcome {
            ready: true,
            reason: "Available",
            message: format!("the controller Deployment {namespace}/{name} has an available replica"),
            synced: true,
            brief: false,
        };
    }
    let why = current
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Available" || c.type_ == "Progressing"))
        .and_then(|c| c.message.clone())
        .unwrap_or_else(|| NO_REPLICA_YET.into());
    Outcome::waiting("DeploymentUnavailable", unavailable_message(namespace, name, &why))
}

const NO_REPLICA_YET: &str = "no replica is available yet";

fn unavailable_message(namespace: &str, name: &str, why: &str) -> String {
    format!("the controller Deployment {namespace}/{name} is not available: {why}")
}

fn conflict_note(notes: &mut Notes, err: &HostWriteError) {
    if let HostWriteError::Conflict { .. } = err {
        notes
            .events
            .push((EventType::Warning, "HostObjectConflict", err.to_string()));
    }
}

async fn ensure_cluster_scoped<K>(
    client: &kube::Client,
    identity: &TenantIdentity,
    desired: &K,
    cache: &Store<K>,
) -> Result<Applied, TenantWriteError>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + DeserializeOwned,
{
    let observed = cache.get(&ObjectRef::new(&desired.name_any()));
    tenant::ensure(&Api::all(client.clone()), identity, desired, observed.as_deref()).await
}

/// Writes the status when it changed, and publishes the reconcile's Events plus one for a change of
/// the Ready condition.
/// How long a brief wait goes unreported when nothing ends it sooner.
const BRIEF_WAIT: Duration = Duration::from_secs(2);

async fn publish_notes(stack: &Stack, ctx: &StackContext, events: Vec<(EventType, &'static str, String)>) {
    for (type_, reason, note) in events {
        publish(&ctx.tenant, stack, type_, reason, note).await;
    }
}

/// The Stack's status as this process last wrote it, until the cache shows that write; else the
/// cached one.
fn last_status(stack: &Stack, ctx: &StackContext) -> StackStatus {
    let uid = stack.uid().unwrap_or_default();
    let cached = stack.status.clone().unwrap_or_default();
    ctx.written.current(&uid, stack.resource_version().as_deref(), cached)
}

async fn report(stack: &Stack, ctx: &StackContext, outcome: &Outcome, mut notes: Notes) -> Result<(), StackError> {
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
        let type_ = if outcome.ready || outcome.synced {
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
async fn publish(tenant: &TenantContext, stack: &Stack, type_: EventType, reason: &str, note: String) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(err) = tenant.recorder.publish(&event, &stack.object_ref(&())).await {
        debug!(error = %err, "cannot publish an Event on the Stack");
    }
}

/// Deletes the Stack's host Deployment (in the background, so its ReplicaSets go too), then its host
/// Secrets: every cached object carrying the Stack's labels, never one stackd did not label.
async fn delete_host_objects(ctx: &StackContext, parent: &Parent) -> Result<usize, StackError> {
    let tenant = &ctx.tenant;
    let host_ns = tenant.host_namespace.as_str();
    let deployments: Vec<Deployment> = ctx.caches.deployments.state().iter().map(|d| (**d).clone()).collect();
    let api = Api::namespaced(tenant.host.clone(), host_ns);
    let removed = apply::delete_all(&api, &deployments, &tenant.name, parent)
        .await
        .map_err(HostWriteError::from)?;
    let secrets: Vec<Secret> = ctx.caches.host_secrets.state().iter().map(|s| (**s).clone()).collect();
    let api = Api::namespaced(tenant.host.clone(), host_ns);
    let removed = removed
        + apply::delete_all(&api, &secrets, &tenant.name, parent)
            .await
            .map_err(HostWriteError::from)?;
    Ok(removed)
}

/// §3.4, the Stack's half: host Deployment, host Secrets, tenant RBAC and persona roles, then this
/// Stack's label on its CRDs. The ServiceAccount, RoleBinding and token Secret go with the Stack by
/// their owner references.
async fn cleanup(stack: &Stack, ctx: &StackContext) -> Result<Cleanup, StackError> {
    let tenant = &ctx.tenant;
    let caches = &ctx.caches;
    let identity = TenantIdentity::of(stack);
    let removed = delete_host_objects(ctx, &HostNames::of(stack, tenant).parent).await?;
    if removed > 0 {
        let note = format!(
            "deleted the controller Deployment and its token and pull-secret copies from the host namespace {}",
            tenant.host_namespace
        );
        publish(tenant, stack, EventType::Normal, "DeletedHostObjects", note).await;
    }
    for role in caches
        .cluster_roles
        .state()
        .iter()
        .filter(|r| identity.owns(r.as_ref()))
    {
        delete_tenant(&Api::<ClusterRole>::all(tenant.client.clone()), &role.name_any()).await?;
    }
    for binding in caches
        .cluster_role_bindings
        .state()
        .iter()
        .filter(|b| identity.owns(b.as_ref()))
    {
        delete_tenant(
            &Api::<ClusterRoleBinding>::all(tenant.client.clone()),
            &binding.name_any(),
        )
        .await?;
    }
    let label = crd_parent_label(&identity.namespace, &identity.name);
    let crds: Api<CustomResourceDefinition> = Api::all(tenant.client.clone());
    for crd in caches.crds.state().iter().filter(|c| c.labels().contains_key(&label)) {
        let patch = json!({"metadata": {"labels": {label.clone(): null}}});
        match crds
            .patch(&crd.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(err.into()),
        }
    }
    ctx.caches
        .token_secrets
        .forget(&identity.namespace, &token::tenant_secret_name(&identity));
    ctx.reported.forget(&stack_key(stack));
    ctx.written.forget(&stack.uid().unwrap_or_default());
    info!(host_objects = removed, "stack uninstalled");
    Ok(Cleanup::Done)
}

async fn delete_tenant<K>(api: &Api<K>, name: &str) -> Result<(), StackError>
where
    K: Resource + Clone + std::fmt::Debug + DeserializeOwned,
{
    match api.delete(name, &Default::default()).await {
        Ok(_) => Ok(()),
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(err.into()),
    }
}
