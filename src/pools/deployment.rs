//! The ClusterDeployment controller (DESIGN.md §4.2, §4.3 item 11): provisions each cluster with an
//! installer Job on the host, copies its admin kubeconfig to the tenant, retries a failed install up
//! to `installAttemptsLimit`, and on deletion runs the destroy Job, then releases the CDC, then
//! removes its finalizer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::PostParams;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::failure_domains::INVALID_KEY;
use super::hosts;
use super::inventory;
use super::membership;
use super::record;
use super::{DEPROVISION_FINALIZER, is_conflict, is_not_found, publish, set_finalizers};
use crate::api::common::LocalObjectReference;
use crate::api::inventory::BareMetalAsset;
use crate::api::pools::{ClusterDeployment, ClusterDeploymentCustomization, ClusterDeploymentStatus};
use crate::host::Parent;
use crate::host::apply::{self, HostWriteError, Update, ensure, stamp};
use crate::host::labels::{
    MANAGED_BY, MANAGED_BY_LABEL, TENANT_KIND_ANNOTATION, TENANT_NAME_ANNOTATION, TENANT_NAMESPACE_ANNOTATION,
};
use crate::host::names::{NameKind, host_name};
use crate::host::ownership::{self, Ownership};
use crate::runtime::cache::{is_filled, reflect};
use crate::runtime::conditions::{DesiredCondition, is_true, set_condition};
use crate::runtime::metrics::Metrics;
use crate::runtime::panics::{self, ReconcilePanic};
use crate::runtime::readiness::Readiness;
use crate::runtime::recovery::NoTriggerBackoff;
use crate::runtime::retry;
use crate::runtime::shutdown::run_controller;
use crate::tenancy::tenant::TenantContext;
use crate::tenancy::untrusted_kubeconfig::{UntrustedKubeconfigError, config_from_untrusted};

const KIND: &str = "ClusterDeployment";
const DEFAULT_ATTEMPTS: i32 = 3;
/// Where the installer finds its inputs and writes its state.
const INSTALL_DIR: &str = "/installer";

/// Label naming the ClusterDeployment on the admin kubeconfig Secret stackd creates.
pub const CLUSTER_DEPLOYMENT_LABEL: &str = "pools.stackd.dev/cluster-deployment";
/// The uid of that ClusterDeployment: with the labels, it proves stackd made the Secret for it.
pub const CLUSTER_DEPLOYMENT_UID_ANNOTATION: &str = "pools.stackd.dev/cluster-deployment-uid";

#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    #[error("tenant API request failed: {0}")]
    Tenant(#[source] kube::Error),
    #[error(transparent)]
    Host(#[from] HostWriteError),
    #[error("host API request failed: {0}")]
    HostApi(#[source] kube::Error),
    #[error(transparent)]
    Panicked(#[from] ReconcilePanic),
}

struct Ctx {
    tenant: Arc<TenantContext>,
    jobs: Store<Job>,
    secrets: Store<Secret>,
    /// Decisions need the host caches too: with an empty one a deleted cluster would look as if it
    /// never had an installer, and be let go without its destroy Job.
    caches_filled: Readiness,
}

/// Runs the controller until `cancel` fires.
pub async fn run(context: Arc<TenantContext>, cancel: CancellationToken) {
    let host_config = context.host_watch_config();
    let (cds, cd_stream) = reflect(
        Api::<ClusterDeployment>::all(context.client.clone()),
        Default::default(),
    );
    let (jobs, job_stream) = reflect(
        Api::<Job>::namespaced(context.host.clone(), &context.host_namespace),
        host_config.clone(),
    );
    let (secrets, secret_stream) = reflect(
        Api::<Secret>::namespaced(context.host.clone(), &context.host_namespace),
        host_config,
    );
    // Not the ClusterDeployment store: the controller awaits its own main store, and a second
    // waiter on a store is never woken (see runtime::readiness).
    let caches_filled = {
        let caches = (jobs.clone(), secrets.clone());
        Readiness::after(async move {
            let (jobs, secrets) = caches;
            jobs.wait_until_ready().await.is_ok() && secrets.wait_until_ready().await.is_ok()
        })
    };
    let ctx = Arc::new(Ctx {
        tenant: context.clone(),
        jobs,
        secrets,
        caches_filled,
    });
    let shutdown = cancel.clone();
    let main_store = cds.clone();
    let run = Controller::for_stream(cd_stream, cds)
        .trigger_backoff(NoTriggerBackoff)
        .watches_stream(job_stream, owner_of)
        .watches_stream(secret_stream, owner_of)
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, error_policy, ctx)
        .for_each(|_| std::future::ready(()));
    run_controller(run, &cancel, || is_filled(&main_store)).await;
}

/// The ClusterDeployment a host object was made for, from its identity annotations.
fn owner_of<K: Resource>(object: K) -> Option<ObjectRef<ClusterDeployment>> {
    let annotations = object.meta().annotations.as_ref()?;
    if annotations.get(TENANT_KIND_ANNOTATION).map(String::as_str) != Some(KIND) {
        return None;
    }
    let name = annotations.get(TENANT_NAME_ANNOTATION)?;
    let namespace = annotations.get(TENANT_NAMESPACE_ANNOTATION)?;
    Some(ObjectRef::new(name).within(namespace))
}

fn error_policy(cd: Arc<ClusterDeployment>, err: &DeploymentError, ctx: Arc<Ctx>) -> Action {
    let key = format!("cd/{}/{}", cd.namespace().unwrap_or_default(), cd.name_any());
    let logged = (ctx.tenant.name.as_str(), "clusterdeployment", key.as_str());
    Action::requeue(retry::after_failure(&ctx.tenant.object_backoff, &key, logged, err))
}

/// Host names of one cluster's objects.
struct Names {
    input: String,
    output: String,
    installer: String,
    destroy: String,
}

impl Names {
    fn of(cd: &ClusterDeployment) -> Names {
        let (ns, name) = (cd.namespace().unwrap_or_default(), cd.name_any());
        let object = |suffix: &str| host_name(Some(&ns), &name, suffix, NameKind::Object);
        Names {
            input: object("-install-config"),
            output: object("-output"),
            installer: object("-installer"),
            destroy: host_name(Some(&ns), &name, "-destroy", NameKind::LabelBound),
        }
    }

    fn install_job(cd: &ClusterDeployment, attempt: i32) -> String {
        let (ns, name) = (cd.namespace().unwrap_or_default(), cd.name_any());
        host_name(Some(&ns), &name, &format!("-install-{attempt}"), NameKind::LabelBound)
    }
}

fn parent(cd: &ClusterDeployment) -> Parent {
    Parent::new(
        KIND,
        cd.namespace().as_deref(),
        &cd.name_any(),
        cd.metadata.uid.as_deref().unwrap_or_default(),
    )
}

async fn reconcile(cd: Arc<ClusterDeployment>, ctx: Arc<Ctx>) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let labels = Metrics::controller(&tenant.name, "clusterdeployment");
    tenant.shared.metrics.reconciles.get_or_create(&labels).inc();
    // Not `Store::wait_until_ready` from concurrent reconciles: it wakes only its last waiter.
    if !ctx.caches_filled.wait().await {
        return Ok(Action::await_change());
    }
    let Ok(_permit) = tenant.reconcile_permits.acquire().await else {
        return Ok(Action::await_change());
    };
    let result = if cd.metadata.deletion_timestamp.is_some() {
        panics::contain(deprovision(&cd, &ctx)).await
    } else {
        panics::contain(provision(&cd, &ctx)).await
    };
    match &result {
        Ok(_) => {
            tenant
                .object_backoff
                .succeeded(&format!("cd/{}/{}", cd.namespace().unwrap_or_default(), cd.name_any()))
        }
        Err(_) => {
            tenant.shared.metrics.reconcile_errors.get_or_create(&labels).inc();
        }
    }
    result
}

fn cd_api(ctx: &Ctx, cd: &ClusterDeployment) -> Api<ClusterDeployment> {
    Api::namespaced(ctx.tenant.client.clone(), &cd.namespace().unwrap_or_default())
}

/// Cached host objects of this cluster.
fn owned<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>, parent: &Parent, tenant: &str) -> Vec<K> {
    let wanted = parent.labels(tenant);
    store
        .state()
        .into_iter()
        .filter(|o| {
            let labels = o.meta().labels.clone().unwrap_or_default();
            wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
        })
        .map(|o| (*o).clone())
        .collect()
}

fn job_state(job: &Job) -> JobState {
    let conditions = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let done = |t: &str| conditions.iter().any(|c| c.type_ == t && c.status == "True");
    if done("Complete") {
        JobState::Succeeded
    } else if done("Failed") {
        JobState::Failed
    } else {
        JobState::Running
    }
}

#[derive(Debug, PartialEq, Eq)]
enum JobState {
    Running,
    Succeeded,
    Failed,
}

async fn provision(cd: &ClusterDeployment, ctx: &Ctx) -> Result<Action, DeploymentError> {
    let api = cd_api(ctx, cd);
    if !cd.finalizers().iter().any(|f| f == DEPROVISION_FINALIZER) {
        let mut finalizers = cd.finalizers().to_vec();
        finalizers.push(DEPROVISION_FINALIZER.into());
        return match set_finalizers(&api, cd, finalizers).await {
            Ok(_) => Ok(Action::await_change()),
            Err(err) if is_conflict(&err) => Ok(Action::await_change()),
            Err(err) => Err(DeploymentError::Tenant(err)),
        };
    }
    let names = Names::of(cd);
    if keep_record(cd, ctx, &names).await? {
        return Ok(Action::await_change());
    }
    let status = cd.status.clone().unwrap_or_default();
    if status.installed || is_true(&status.conditions, "ProvisionStopped") {
        return Ok(Action::await_change());
    }
    let tenant = &ctx.tenant;
    let parent = parent(cd);
    let ns = cd.namespace().unwrap_or_default();
    let attempt = status.install_restarts;
    let job_name = Names::install_job(cd, attempt);
    let jobs = Api::<Job>::namespaced(tenant.host.clone(), &tenant.host_namespace);

    // Earlier attempts' Jobs go (each attempt has its own Job, so a failure is counted once).
    for job in owned(&ctx.jobs, &parent, &tenant.name) {
        let name = job.name_any();
        if name != job_name && name != names.destroy && job.metadata.deletion_timestamp.is_none() {
            apply::delete(&jobs, &job).await.map_err(DeploymentError::HostApi)?;
        }
    }
    let observed = ctx.jobs.get(&ObjectRef::new(&job_name).within(&tenant.host_namespace));
    if let Some(job) = observed.as_deref() {
        match job_state(job) {
            JobState::Running => return Ok(Action::await_change()),
            JobState::Succeeded => return installed(cd, ctx, &names).await,
            JobState::Failed => return install_failed(cd, ctx).await,
        }
    }

    // Inputs: the rendered install config, the pull secret and the platform credentials.
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &ns);
    let mut input: BTreeMap<String, ByteString> = BTreeMap::new();
    let provisioning = cd.spec.provisioning.clone();
    let mut missing = Vec::new();
    let config_ref = provisioning.as_ref().map(|p| p.install_config_secret_ref.name.clone());
    let credentials = credentials_ref(cd);
    let pull = cd.spec.pull_secret_ref.as_ref().map(|r| r.name.clone());
    for (what, name) in [
        ("install config", config_ref),
        ("credentials", credentials),
        ("pull secret", pull),
    ] {
        let Some(name) = name else { continue };
        match secrets.get_opt(&name).await.map_err(DeploymentError::Tenant)? {
            Some(secret) => input.extend(secret.data.unwrap_or_default()),
            None => missing.push(format!("{what} Secret {ns}/{name}")),
        }
    }
    let Some(provisioning) = provisioning else {
        missing.push("spec.provisioning".into());
        return stopped_on_inputs(cd, ctx, &missing).await;
    };
    if !missing.is_empty() {
        return stopped_on_inputs(cd, ctx, &missing).await;
    }
    if let Some(invalid) = input.get(INVALID_KEY) {
        let message = String::from_utf8_lossy(&invalid.0).into_owned();
        return stopped_on_machine_spec(cd, ctx, message).await;
    }

    let host = tenant.host.clone();
    let host_ns = tenant.host_namespace.as_str();
    let mut secret = Secret {
        metadata: meta(&names.input, host_ns),
        data: Some(input),
        ..Default::default()
    };
    stamp(&mut secret, &tenant.name, &parent);
    let host_secrets = Api::<Secret>::namespaced(host.clone(), host_ns);
    let cached = |name: &str| ctx.secrets.get(&ObjectRef::new(name).within(host_ns));
    ensure(
        &host_secrets,
        &secret,
        cached(&names.input).as_deref(),
        &tenant.name,
        &parent,
        Update::WhenDifferent(&tenant.reverted_replaces),
    )
    .await?;
    // The installer fills the output Secret; stackd only makes sure it exists.
    let mut output = Secret {
        metadata: meta(&names.output, host_ns),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    stamp(&mut output, &tenant.name, &parent);
    ensure(
        &host_secrets,
        &output,
        cached(&names.output).as_deref(),
        &tenant.name,
        &parent,
        Update::Never,
    )
    .await?;
    ensure_installer_identity(ctx, &parent, &names).await?;
    let job = installer_job(
        &job_name,
        host_ns,
        &names,
        &provisioning.installer_image,
        &cd.spec.cluster_name,
        false,
    );
    let mut job: Job = job;
    stamp(&mut job, &tenant.name, &parent);
    if ensure(&jobs, &job, None, &tenant.name, &parent, Update::Never)
        .await?
        .wrote()
    {
        info!(tenant = %tenant.name, cluster = %cd.name_any(), attempt = attempt + 1, "installer Job started");
        publish(
            tenant,
            cd,
            false,
            "InstallStarted",
            format!("Installer Job {job_name} started (attempt {})", attempt + 1),
        )
        .await;
    }
    set_status(cd, ctx, |status, now| {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: false,
                reason: "Provisioning",
                message: format!(
                    "Installer Job {host_ns}/{job_name} is running (attempt {})",
                    attempt + 1
                ),
                observed_generation: cd.metadata.generation,
            },
            now,
        )
    })
    .await?;
    Ok(Action::await_change())
}

fn credentials_ref(cd: &ClusterDeployment) -> Option<String> {
    let p = &cd.spec.platform;
    p.vsphere
        .as_ref()
        .map(|v| v.credentials_secret_ref.name.clone())
        .or_else(|| p.openstack.as_ref().map(|o| o.credentials_secret_ref.name.clone()))
        .or_else(|| p.baremetal.as_ref().map(|b| b.credentials_secret_ref.name.clone()))
}

fn meta(name: &str, namespace: &str) -> kube::api::ObjectMeta {
    kube::api::ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        ..Default::default()
    }
}

async fn stopped_on_inputs(cd: &ClusterDeployment, ctx: &Ctx, missing: &[String]) -> Result<Action, DeploymentError> {
    let message = format!(
        "Cannot start the installer: missing {}; create them in the cluster's namespace",
        missing.join(", ")
    );
    let changed = set_status(cd, ctx, |status, now| {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: false,
                reason: "MissingInputs",
                message: message.clone(),
                observed_generation: cd.metadata.generation,
            },
            now,
        )
    })
    .await?;
    if changed {
        publish(&ctx.tenant, cd, true, "MissingInputs", message).await;
    }
    Ok(Action::requeue(Duration::from_secs(10)))
}

/// Writes the failure-domain record into the status when it is missing or was edited (§6).
/// Returns whether it wrote (the write's watch event brings the cluster back).
async fn keep_record(cd: &ClusterDeployment, ctx: &Ctx, names: &Names) -> Result<bool, DeploymentError> {
    let tenant = &ctx.tenant;
    let host_input = ctx
        .secrets
        .get(&ObjectRef::new(&names.input).within(&tenant.host_namespace));
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &cd.namespace().unwrap_or_default());
    let Some(wanted) = record::wanted(cd, host_input.as_deref(), &secrets)
        .await
        .map_err(DeploymentError::Tenant)?
    else {
        return Ok(false);
    };
    let edited = cd.status.as_ref().is_some_and(|s| !s.failure_domains.is_empty());
    let written = set_status(cd, ctx, |status, _| {
        status.failure_domains = wanted;
        true
    })
    .await?;
    if written && edited {
        publish(
            tenant,
            cd,
            true,
            "FailureDomainsRestored",
            "status.failureDomains was edited; it is recorded once when the cluster is created and was restored".into(),
        )
        .await;
    }
    Ok(written)
}

/// The machines cannot be placed as configured: stop for good, saying why (§6 merge rules).
async fn stopped_on_machine_spec(cd: &ClusterDeployment, ctx: &Ctx, detail: String) -> Result<Action, DeploymentError> {
    let message = format!("The machine configuration is invalid: {detail}");
    let changed = set_status(cd, ctx, |status, now| {
        let generation = cd.metadata.generation;
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: false,
                reason: "InvalidMachineSpec",
                message: message.clone(),
                observed_generation: generation,
            },
            now.clone(),
        );
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "ProvisionStopped",
                status: true,
                reason: "InvalidMachineSpec",
                message: message.clone(),
                observed_generation: generation,
            },
            now,
        );
        true
    })
    .await?;
    if changed {
        publish(&ctx.tenant, cd, true, "InvalidMachineSpec", message).await;
    }
    Ok(Action::await_change())
}

/// The ServiceAccount the installer runs as, allowed only get/update/patch on its output Secret.
async fn ensure_installer_identity(ctx: &Ctx, parent: &Parent, names: &Names) -> Result<(), HostWriteError> {
    let tenant = &ctx.tenant;
    let ns = tenant.host_namespace.as_str();
    let mut sa = ServiceAccount {
        metadata: meta(&names.installer, ns),
        automount_service_account_token: Some(true),
        ..Default::default()
    };
    stamp(&mut sa, &tenant.name, parent);
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": names.installer, "namespace": ns},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [names.output], "verbs": ["get", "update", "patch"]}],
    }))
    .expect("static shape");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": names.installer, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.installer},
        "subjects": [{"kind": "ServiceAccount", "name": names.installer, "namespace": ns}],
    }))
    .expect("static shape");
    let (mut role, mut binding) = (role, binding);
    stamp(&mut role, &tenant.name, parent);
    stamp(&mut binding, &tenant.name, parent);
    let host = &tenant.host;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &sa,
        None,
        &tenant.name,
        parent,
        Update::Never,
    )
    .await?;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &role,
        None,
        &tenant.name,
        parent,
        Update::Never,
    )
    .await?;
    ensure(
        &Api::namespaced(host.clone(), ns),
        &binding,
        None,
        &tenant.name,
        parent,
        Update::Never,
    )
    .await?;
    Ok(())
}

/// The install (`create cluster`) or destroy (`destroy cluster`) Job of §4.2.
fn installer_job(name: &str, namespace: &str, names: &Names, image: &str, cluster: &str, destroy: bool) -> Job {
    let args = if destroy {
        vec!["destroy", "cluster", "--dir", INSTALL_DIR]
    } else {
        vec!["create", "cluster", "--dir", INSTALL_DIR]
    };
    // The destroy Job gets `metadata.json` back from the output Secret.
    let volumes = if destroy {
        json!([
            {"name": "input", "secret": {"secretName": names.input}},
            {"name": "state", "secret": {"secretName": names.output, "items": [{"key": "metadata.json", "path": "metadata.json"}]}},
        ])
    } else {
        json!([{"name": "input", "secret": {"secretName": names.input}}])
    };
    let mounts = if destroy {
        json!([
            {"name": "input", "mountPath": format!("{INSTALL_DIR}/input"), "readOnly": true},
            {"name": "state", "mountPath": format!("{INSTALL_DIR}/state"), "readOnly": true},
        ])
    } else {
        json!([{"name": "input", "mountPath": format!("{INSTALL_DIR}/input"), "readOnly": true}])
    };
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": names.installer,
                    "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "installer",
                        "image": image,
                        "args": args,
                        "env": [
                            {"name": "STACKD_OUTPUT_SECRET", "value": names.output},
                            {"name": "STACKD_OUTPUT_NAMESPACE", "value": namespace},
                            {"name": "STACKD_CLUSTER_NAME", "value": cluster},
                        ],
                        "volumeMounts": mounts,
                        "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                    }],
                    "volumes": volumes,
                }
            }
        }
    }))
    .expect("static shape")
}

fn secret_text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

/// The installer succeeded: copy the admin kubeconfig to the tenant and record the cluster installed.
async fn installed(cd: &ClusterDeployment, ctx: &Ctx, names: &Names) -> Result<Action, DeploymentError> {
    let tenant = &ctx.tenant;
    let output = ctx
        .secrets
        .get(&ObjectRef::new(&names.output).within(&tenant.host_namespace));
    let (Some(kubeconfig), Some(metadata)) = (
        output.as_deref().and_then(|s| secret_text(s, "kubeconfig")),
        output.as_deref().and_then(|s| secret_text(s, "metadata.json")),
    ) else {
        // The cache may not have the installer's write yet; the Secret's watch event brings us back.
        return Ok(Action::requeue(Duration::from_secs(5)));
    };
    let admin_name = format!("{}-admin-kubeconfig", cd.name_any());
    // The installer image is the tenant's choice, so its kubeconfig is as untrusted as the tenant.
    if let Err(refusal) = config_from_untrusted(&kubeconfig) {
        return stopped_on_refused_kubeconfig(cd, ctx, &admin_name, &refusal).await;
    }
    let infra_id = serde_json::from_str::<serde_json::Value>(&metadata)
        .ok()
        .and_then(|m| m["infraID"].as_str().map(String::from));
    let secrets = Api::<Secret>::namespaced(tenant.client.clone(), &cd.namespace().unwrap_or_default());
    if copy_admin_kubeconfig(cd, &secrets, &admin_name, kubeconfig).await? == AdminSecret::Foreign {
        return admin_kubeconfig_conflict(cd, ctx, &admin_name).await;
    }
    let changed = set_status(cd, ctx, |status, now| {
        status.installed = true;
        status.infra_id = infra_id.clone();
        status.admin_kubeconfig_secret_ref = Some(LocalObjectReference {
            name: admin_name.clone(),
        });
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: true,
                reason: "Provisioned",
                message: format!("Installed; the admin kubeconfig is in Secret {admin_name}"),
                observed_generation: cd.metadata.generation,
            },
            now,
        );
        true
    })
    .await?;
    if changed {
        info!(tenant = %tenant.name, cluster = %cd.name_any(), "cluster installed");
        publish(
            tenant,
            cd,
            false,
            "Installed",
            format!("Cluster installed; admin kubeconfig in Secret {admin_name}"),
        )
        .await;
    }
    Ok(Action::await_change())
}

#[derive(Debug, PartialEq, Eq)]
enum AdminSecret {
    /// Created, updated, or already holding the kubeconfig.
    Written,
    /// A Secret of that name that stackd did not make for this ClusterDeployment.
    Foreign,
}

fn admin_secret(cd: &ClusterDeployment, name: &str, kubeconfig: ByteString) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: cd.namespace(),
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.into(), MANAGED_BY.into()),
                (CLUSTER_DEPLOYMENT_LABEL.into(), cd.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                CLUSTER_DEPLOYMENT_UID_ANNOTATION.into(),
                cd.metadata.uid.clone().unwrap_or_default(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("kubeconfig".into(), kubeconfig)])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// True when stackd created `secret` for this very ClusterDeployment (not for an earlier one of
/// the same name, and not someone else).
fn made_for(secret: &Secret, cd: &ClusterDeployment) -> bool {
    let labels = secret.labels();
    let uid = secret.annotations().get(CLUSTER_DEPLOYMENT_UID_ANNOTATION);
    labels.get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
        && labels.get(CLUSTER_DEPLOYMENT_LABEL) == Some(&cd.name_any())
        && uid.is_some()
        && uid == cd.metadata.uid.as_ref()
}

/// Creates the tenant Secret `<cd>-admin-kubeconfig`, or updates the one stackd made for this
/// cluster; any other Secret of that name is left untouched.
async fn copy_admin_kubeconfig(
    cd: &ClusterDeployment,
    secrets: &Api<Secret>,
    name: &str,
    kubeconfig: String,
) -> Result<AdminSecret, DeploymentError> {
    let kubeconfig = ByteString(kubeconfig.into_bytes());
    let wanted = admin_secret(cd, name, kubeconfig.clone());
    let exists = match secrets.create(&PostParams::default(), &wanted).await {
        Ok(_) => return Ok(AdminSecret::Written),
        Err(err) if is_conflict(&err) => err,
        Err(err) => return Err(DeploymentError::Tenant(err)),
    };
    // Gone again since: the error's retry creates it.
    let Some(mut existing) = secrets.get_opt(name).await.map_err(DeploymentError::Tenant)? else {
        return Err(DeploymentError::Tenant(exists));
    };
    if !made_for(&existing, cd) {
        return Ok(AdminSecret::Foreign);
    }
    let data = existing.data.get_or_insert_with(Default::default);
    if data.get("kubeconfig") == Some(&kubeconfig) {
        return Ok(AdminSecret::Written);
    }
    data.insert("kubeconfig".into(), kubeconfig);
    existing.metadata.managed_fields = None;
    secrets
        .replace(name, &PostParams::default(), &existing)
        .await
        .map_err(DeploymentError::Tenant)?;
    Ok(AdminSecret::Written)
}

/// A Secret of the admin kubeconfig's name belongs to someone else: wait until it is gone.
async fn admin_kubeconfig_conflict(cd: &ClusterDeployment, ctx: &Ctx, name: &str) -> Result<Action, DeploymentError> {
    let message = format!(
        "Secret {name} already exists and was not created by stackd for this ClusterDeployment, so the admin \
         kubeconfig was not copied and the Secret is left untouched; delete or rename it and stackd copies the \
         admin kubeconfig there"
    );
    let changed = set_status(cd, ctx, |status, now| {
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: false,
                reason: "AdminKubeconfigConflict",
                message: message.clone(),
                observed_generation: cd.metadata.generation,
            },
            now,
        )
    })
    .await?;
    if changed {
        publish(&ctx.tenant, cd, true, "AdminKubeconfigConflict", message).await;
    }
    // Tenant Secrets are not watched (there are too many); look again now and then.
    let settings = &ctx.tenant.shared.settings;
    Ok(Action::requeue(
        settings.backoff.base.saturating_mul(10).min(Duration::from_secs(30)),
    ))
}

/// The installer wrote a kubeconfig stackd will not use or hand on: stop for good, naming the field.
async fn stopped_on_refused_kubeconfig(
    cd: &ClusterDeployment,
    ctx: &Ctx,
    name: &str,
    refusal: &UntrustedKubeconfigError,
) -> Result<Action, DeploymentError> {
    let message = format!(
        "The installer's admin kubeconfig was refused and not copied to Secret {name}: {refusal}. \
         The installer image must write a kubeconfig with inline credentials only"
    );
    let changed = set_status(cd, ctx, |status, now| {
        let mut changed = false;
        for type_ in ["Provisioned", "ProvisionStopped"] {
            changed |= set_condition(
                &mut status.conditions,
                DesiredCondition {
                    type_,
                    status: type_ == "ProvisionStopped",
                    reason: "AdminKubeconfigRefused",
                    message: message.clone(),
                    observed_generation: cd.metadata.generation,
                },
                now.clone(),
            );
        }
        changed
    })
    .await?;
    if changed {
        warn!(tenant = %ctx.tenant.name, cluster = %cd.name_any(), %refusal, "installer kubeconfig refused");
        publish(&ctx.tenant, cd, true, "AdminKubeconfigRefused", message).await;
    }
    Ok(Action::await_change())
}

/// The installer failed: count the attempt; retry, or stop at the limit (the pool replaces it).
async fn install_failed(cd: &ClusterDeployment, ctx: &Ctx) -> Result<Action, DeploymentError> {
    let limit = cd.spec.install_attempts_limit.unwrap_or(DEFAULT_ATTEMPTS).max(1);
    let attempts = cd.status.as_ref().map_or(0, |s| s.install_restarts) + 1;
    let stop = attempts >= limit;
    let message = if stop {
        format!(
            "The installer failed {attempts} times (installAttemptsLimit {limit}); the cluster is broken and its pool replaces it"
        )
    } else {
        format!("The installer failed (attempt {attempts} of {limit}); retrying")
    };
    let counted = set_status(cd, ctx, |status, now| {
        status.install_restarts = attempts;
        let generation = cd.metadata.generation;
        set_condition(
            &mut status.conditions,
            DesiredCondition {
                type_: "Provisioned",
                status: false,
                reason: if stop { "ProvisionFailed" } else { "InstallFailed" },
                message: message.clone(),
                observed_generation: generation,
            },
            now.clone(),
        );
        if stop {
            set_condition(
                &mut status.conditions,
                DesiredCondition {
                    type_: "ProvisionStopped",
                    status: true,
                    reason: "InstallAttemptsLimitReached",
                    message: message.clone(),
                    observed_generation: generation,
                },
                now,
            );
        }
        true
    })
    .await?;
    if !counted {
        // A newer copy exists; its watch event brings this attempt back to be counted once.
        return Ok(Action::await_change());
    }
    publish(
        &ctx.tenant,
        cd,
        true,
        if stop { "ProvisionStopped" } else { "InstallFailed" },
        message,
    )
    .await;
    Ok(Action::await_change())
}

/// Writes the CD's status with its resourceVersion as precondition; a conflict is left to the
/// watch event that caused it. Returns whether anything was written.
async fn set_status(
    cd: &ClusterDeployment,
    ctx: &Ctx,
    change: impl FnOnce(&mut ClusterDeploymentStatus, Time) -> bool,
) -> Result<bool, DeploymentError> {
    let mut updated = cd.clone();
    let status = updated.status.get_or_insert_with(Default::default);
    if !change(status, Time(Timestamp::now())) {
        return Ok(false);
    }
    updated.metadata.managed_fields = None;
    match cd_api(ctx, cd)
        .replace_status(&cd.name_any(), &PostParams::default(), &updated)
        .await
    {
        Ok(_) => Ok(true),
        Err(err) if is_conflict(&err) => Ok(false),
        Err(err) => Err(DeploymentError::Tenant(err)),
    }
}

/// Deletes the host object `name` if it is this cluster's (ownership proof, uid precondition).
async fn delete_owned<K>(
    api: &Api<K>,
    name: &str,
    tenant: &TenantContext,
    parent: &Parent,
) -> Result<(), DeploymentError>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let Some(object) = api.get_opt(name).await.map_err(DeploymentError::HostApi)? else {
        return Ok(());
    };
    if ownership::check(object.labels(), object.annotations(), &tenant.name, parent) == Ownership::Ours {
        apply::delete(api, &object).await.map_err(DeploymentError::HostApi)?;
    }
    Ok(())
}

/// Deletion (§4.3.11): stop the installer, run the destroy Job when there is something to destroy,
/// then release the CDC, clean up the host, and let the ClusterDeployment go.
async fn deprovision(cd: &ClusterDeployment, ctx: &Ctx) -> Result<Action, DeploymentError> {
    if !cd.finalizers().iter().any(|f| f == DEPROVISION_FINALIZER) {
        return Ok(Action::await_change());
    }
    let tenant = &ctx.tenant;
    let parent = parent(cd);
    let names = Names::of(cd);
    let host_ns = tenant.host_namespace.as_str();
    let jobs = Api::<Job>::namespaced(tenant.host.clone(), host_ns);
    for job in owned(&ctx.jobs, &parent, &tenant.name) {
        if job.name_any() != names.destroy && job.metadata.deletion_timestamp.is_none() {
            apply::delete(&jobs, &job).await.map_err(DeploymentError::HostApi)?;
        }
    }
    let output = ctx.secrets.get(&ObjectRef::new(&names.output).within(host_ns));
    let has_state = output
        .as_deref()
        .and_then(|s| secret_text(s, "metadata.json"))
        .is_some();
    let image = cd.spec.provisioning.as_ref().map(|p| p.installer_image.clone());
    if let (true, Some(image)) = (has_state, image) {
        let observed = ctx.jobs.get(&ObjectRef::new(&names.destroy).within(host_ns));
        match observed.as_deref().map(job_state) {
            None => {
                ensure_installer_identity(ctx, &parent, &names).await?;
                let mut job = installer_job(&names.destroy, host_ns, &names, &image, &cd.spec.cluster_name, true);
                stamp(&mut job, &tenant.name, &parent);
                if ensure(&jobs, &job, None, &tenant.name, &parent, Update::Never)
                    .await?
                    .wrote()
                {
                    publish(
                        tenant,
                        cd,
                        false,
                        "DeprovisionStarted",
                        format!("Destroy Job {} started", names.destroy),
                    )
                    .await;
                }
                return Ok(Action::await_change());
            }
            Some(JobState::Running) => return Ok(Action::await_change()),
            Some(JobState::Failed) => {
                // Retry the destroy: the CDC must not be reused while the old cluster may exist.
                if let Some(job) = observed.as_deref() {
                    apply::delete(&jobs, job).await.map_err(DeploymentError::HostApi)?;
                }
                publish(
                    tenant,
                    cd,
                    true,
                    "DeprovisionFailed",
                    format!("Destroy Job {} failed; retrying", names.destroy),
                )
                .await;
                return Ok(Action::requeue(Duration::from_secs(5)));
            }
            Some(JobState::Succeeded) => {}
        }
    }
    // Deprovisioned: now (and only now) the CDC may be leased again, and only by a cluster its
    // pool created (a reference alone is anyone's to write).
    let made_by_pool = membership::created_by_named_pool(&tenant.client, cd)
        .await
        .map_err(DeploymentError::Tenant)?;
    if cd.spec.cluster_pool_ref.is_some() && !made_by_pool {
        let message = membership::release_refused_message(cd);
        publish(tenant, cd, true, membership::RELEASE_REFUSED, message).await;
    }
    if made_by_pool
        && let Some(pool_ref) = &cd.spec.cluster_pool_ref
        && let Some(cdc_ref) = &pool_ref.cluster_deployment_customization
    {
        let cdcs = Api::<ClusterDeploymentCustomization>::namespaced(tenant.client.clone(), &pool_ref.namespace);
        if let Some(cdc) = cdcs.get_opt(&cdc_ref.name).await.map_err(DeploymentError::Tenant)? {
            match inventory::release(&cdcs, &cdc, &cd.name_any(), &pool_ref.pool_name).await {
                Ok(true) => {
                    publish(
                        tenant,
                        &cdc,
                        false,
                        "Released",
                        format!("Released by ClusterDeployment {} after its deprovision", cd.name_any()),
                    )
                    .await;
                }
                Ok(false) => {}
                Err(err) if is_conflict(&err) => return Ok(Action::requeue(Duration::from_millis(200))),
                Err(err) => return Err(DeploymentError::Tenant(err)),
            }
        }
    }
    // Its hosts go back to the inventory (the cluster they ran is gone or going): the pool's for a
    // cluster the pool created, its own namespace's for one made by hand.
    let hosts_namespace = match &cd.spec.cluster_pool_ref {
        Some(pool_ref) => made_by_pool.then(|| pool_ref.namespace.clone()),
        None => cd.namespace(),
    };
    if let Some(ns) = hosts_namespace.filter(|_| !cd.spec.hosts.is_empty()) {
        let assets = Api::<BareMetalAsset>::namespaced(tenant.client.clone(), &ns);
        let released = hosts::release_all(&assets, &cd.name_any())
            .await
            .map_err(DeploymentError::Tenant)?;
        if released > 0 {
            info!(tenant = %tenant.name, cluster = %cd.name_any(), released, "bare-metal hosts released");
        }
    }
    let secrets = Api::<Secret>::namespaced(tenant.host.clone(), host_ns);
    apply::delete_all(&jobs, &owned(&ctx.jobs, &parent, &tenant.name), &tenant.name, &parent)
        .await
        .map_err(DeploymentError::HostApi)?;
    apply::delete_all(
        &secrets,
        &owned(&ctx.secrets, &parent, &tenant.name),
        &tenant.name,
        &parent,
    )
    .await
    .map_err(DeploymentError::HostApi)?;
    let host = &tenant.host;
    delete_owned(
        &Api::<ServiceAccount>::namespaced(host.clone(), host_ns),
        &names.installer,
        tenant,
        &parent,
    )
    .await?;
    delete_owned(
        &Api::<Role>::namespaced(host.clone(), host_ns),
        &names.installer,
        tenant,
        &parent,
    )
    .await?;
    delete_owned(
        &Api::<RoleBinding>::namespaced(host.clone(), host_ns),
        &names.installer,
        tenant,
        &parent,
    )
    .await?;
    let finalizers: Vec<String> = cd
        .finalizers()
        .iter()
        .filter(|f| *f != DEPROVISION_FINALIZER)
        .cloned()
        .collect();
    match set_finalizers(&cd_api(ctx, cd), cd, finalizers).await {
        Ok(_) => {}
        Err(err) if is_conflict(&err) || is_not_found(&err) => {}
        Err(err) => return Err(DeploymentError::Tenant(err)),
    }
    info!(tenant = %tenant.name, cluster = %cd.name_any(), "cluster deprovisioned");
    Ok(Action::await_change())
}
