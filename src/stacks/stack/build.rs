//! §3.3 steps 2–4 as objects (pure): from a validated Stack and what was observed, the tenant
//! objects (identity, permissions, token Secret, and which binding kind stays and which goes) and
//! the host objects (the controller Deployment and the token and pull-secret copies its pods use),
//! with the places where the writes stop to wait. The apply steps write what [`build`] returns.

use std::collections::BTreeMap;
use std::ops::ControlFlow::{Break, Continue};
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};

use super::context::KIND;
use super::outcome::{Outcome, Step, not_running_yet, readiness};
use super::tenant::TenantIdentity;
use super::validate::CheckedController;
use super::{deployment, rbac, token};
use crate::api::common::HostObjectRef;
use crate::api::stacks::{Stack, StackDefinition};
use crate::bounds::DOCUMENT_TOO_LARGE;
use crate::host::apply::stamp;
use crate::host::labels::Parent;
use crate::host::names::{NameKind, host_name};
use crate::host::pod_trouble::PodTrouble;
use crate::stacks::pull_secrets;

/// What the Stack's objects are built from, read before anything is written.
#[derive(Default)]
pub(super) struct Observed {
    /// The tenant's CRDs: the persona roles aggregate the stack's own.
    pub crds: Vec<Arc<CustomResourceDefinition>>,
    /// The cached bindings at the Stack's binding name, of each kind.
    pub role_binding: Option<Arc<RoleBinding>>,
    pub cluster_role_binding: Option<Arc<ClusterRoleBinding>>,
    /// The Stack's token Secret on the tenant, as it is now.
    pub token_secret: Option<Arc<Secret>>,
    /// The tenant pull secrets the controller names, in order: `None` for one that does not exist.
    pub pull_secrets: Vec<(String, Option<Secret>)>,
    /// The cached host Deployment and host Secrets.
    pub deployment: Option<Arc<Deployment>>,
    pub host_secrets: Vec<Arc<Secret>>,
    /// What the kubelet says of the controller Deployment's pods, when one does not run.
    pub pod_trouble: Option<PodTrouble>,
    /// A templating Stack's StackDefinition on the tenant, as it is now.
    pub stack_definition: Option<StackDefinition>,
}

/// The Stack's host objects: their parent and mapped names.
pub(super) struct HostNames {
    pub parent: Parent,
    pub tenant: String,
    pub namespace: String,
    pub tenant_namespace: String,
    pub deployment: String,
    pub secret: String,
}

impl HostNames {
    pub(super) fn of(stack: &Stack, tenant: &str, host_namespace: &str) -> Self {
        let ns = stack.namespace().unwrap_or_default();
        let name = stack.name_any();
        HostNames {
            parent: Parent::new(KIND, Some(&ns), &name, stack.meta().uid.as_deref().unwrap_or_default()),
            tenant: tenant.to_string(),
            namespace: host_namespace.to_string(),
            deployment: host_name(Some(&ns), &name, "", NameKind::LabelBound),
            secret: host_name(Some(&ns), &name, "-token", NameKind::Object),
            tenant_namespace: ns,
        }
    }

    pub(super) fn deployment_ref(&self) -> HostObjectRef {
        HostObjectRef {
            namespace: self.namespace.clone(),
            name: self.deployment.clone(),
        }
    }

    pub(super) fn token_copy_ref(&self) -> HostObjectRef {
        HostObjectRef {
            namespace: self.namespace.clone(),
            name: self.secret.clone(),
        }
    }
}

/// Everything the Stack should have, tenant side then host side.
pub(super) struct Desired {
    pub tenant: TenantObjects,
    /// What runs on the host, once the tenant's token controller has filled the token (it is
    /// copied there); until then, the wait for it.
    pub host: Step<HostPlan>,
}

/// The Stack's identity and permissions on the tenant, in the order they are written.
pub(super) struct TenantObjects {
    pub identity: TenantIdentity,
    pub service_account: ServiceAccount,
    pub system_role: ClusterRole,
    /// The binding of the Stack's permission scope: it stays.
    pub binding: Binding,
    /// This Stack's binding of the other kind, as cached: it goes, as a stack whose scope changed
    /// keeps no binding of the other kind.
    pub stale_binding: Option<Binding>,
    /// The persona roles, or the wait for the stack's CRDs (the writes stop before these).
    pub persona_roles: Step<Vec<ClusterRole>>,
    pub token_secret: Secret,
    /// A templating Stack's StackDefinition, which its controller reads at its start.
    pub stack_definition: Option<StackDefinition>,
}

/// The binding of the system ClusterRole to the Stack's ServiceAccount.
#[derive(Debug, PartialEq)]
pub(super) enum Binding {
    /// A Namespaced stack's: its rules apply in the Stack's namespace only.
    Namespaced(RoleBinding),
    /// A Cluster stack's.
    Cluster(ClusterRoleBinding),
}

/// What the host should run for the Stack.
pub(super) enum HostPlan {
    /// The Stack has no controller: a controller dropped from the spec does not keep running.
    Remove,
    Run(Box<HostObjects>),
}

/// The controller Deployment and what its pods use.
pub(super) struct HostObjects {
    pub deployment: Deployment,
    /// The copies its pods mount, written before it (a pod never starts on a missing volume).
    pub copies: Copies,
    /// Its readiness once the cache shows it; until then, the wait for it.
    pub readiness: Outcome,
}

/// The host copies the Deployment's pods use: owned by the Deployment once the cache shows it (its
/// uid), and until then by no one (their labels are what cleanup and the sweep go by).
pub(super) struct Copies {
    pub token_copy: Secret,
    /// Each pull-secret copy, with the name of the tenant Secret it copies.
    pub pull_copies: Vec<(String, Secret)>,
    /// Host copies of pull secrets the Stack no longer names.
    pub stale_pull_copies: Vec<Secret>,
}

/// Builds the Stack's objects, or stops: a pull secret that cannot be copied or a Stack without a
/// uid (nothing can be owned by it yet) leaves everything as it is.
pub(super) fn build(
    stack: &Stack,
    controller: Option<&CheckedController<'_>>,
    observed: &Observed,
    host: &HostNames,
    pass_full: bool,
) -> Step<Desired> {
    let pull_sources = match pull_secrets::check(&host.tenant_namespace, observed.pull_secrets.clone()) {
        Ok(sources) => sources,
        Err(err) => return Break(Outcome::refused(err.reason(), err.to_string())),
    };
    let Some(owner) = stack.controller_owner_ref(&()) else {
        return Break(Outcome::waiting("NotPersisted", "the Stack has no uid yet".into()));
    };
    let identity = TenantIdentity::of(stack);
    let tenant = tenant_objects(stack, &identity, &owner, observed);
    let host = match observed
        .token_secret
        .as_deref()
        .and_then(|s| token::filled_keys(s, &identity))
    {
        None => Break(waiting_for_token(&tenant.token_secret)),
        Some(Err(refused)) => Break(Outcome::refused(DOCUMENT_TOO_LARGE, refused.to_string())),
        Some(Ok(token)) => Continue(match controller {
            None => HostPlan::Remove,
            Some(controller) => {
                let sources = HostSources {
                    token,
                    pull: pull_sources,
                };
                HostPlan::Run(Box::new(host_objects(controller, host, observed, sources, pass_full)))
            }
        }),
    };
    Continue(Desired { tenant, host })
}

fn tenant_objects(
    stack: &Stack,
    identity: &TenantIdentity,
    owner: &OwnerReference,
    observed: &Observed,
) -> TenantObjects {
    let ours = |binding: &Binding| match binding {
        Binding::Namespaced(b) => identity.owns(b),
        Binding::Cluster(b) => identity.owns(b),
    };
    let namespaced = || observed.role_binding.as_deref().cloned().map(Binding::Namespaced);
    let cluster = || observed.cluster_role_binding.as_deref().cloned().map(Binding::Cluster);
    let (binding, stale_binding) = if rbac::binds_cluster_wide(stack) {
        (Binding::Cluster(rbac::cluster_role_binding(identity)), namespaced())
    } else {
        (Binding::Namespaced(rbac::role_binding(identity, owner)), cluster())
    };
    let persona_roles = match rbac::persona_roles(stack, identity, &observed.crds) {
        Ok(roles) => Continue(roles),
        Err(missing) => Break(Outcome::waiting(
            "WaitingForCrds",
            format!(
                "waiting for the stack's CRDs to be served on the tenant: {}",
                missing.join(", ")
            ),
        )),
    };
    TenantObjects {
        identity: identity.clone(),
        service_account: rbac::service_account(stack, identity, owner),
        system_role: rbac::system_role(stack, identity),
        binding,
        stale_binding: stale_binding.filter(ours),
        persona_roles,
        token_secret: token::tenant_secret(identity, owner),
        stack_definition: rbac::stack_definition(stack, identity, owner),
    }
}

fn waiting_for_token(secret: &Secret) -> Outcome {
    Outcome::waiting(
        "WaitingForToken",
        format!(
            "waiting for the tenant's token controller to fill Secret {}/{}",
            secret.namespace().unwrap_or_default(),
            secret.name_any()
        ),
    )
}

/// The tenant data the host copies are made of.
struct HostSources {
    token: BTreeMap<String, ByteString>,
    pull: Vec<Secret>,
}

fn host_objects(
    controller: &CheckedController<'_>,
    host: &HostNames,
    observed: &Observed,
    sources: HostSources,
    pass_full: bool,
) -> HostObjects {
    let pull_names = pull_copy_names(host, observed, &sources.pull);
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
            pull_secrets: &pull_names,
            pass_full,
            stack_definition: controller.stack_definition.as_deref(),
        },
    );
    stamp(&mut desired, &host.tenant, &host.parent);
    let current = observed.deployment.as_deref();
    let readiness = match current {
        None => not_running_yet(&host.namespace, &host.deployment),
        Some(current) => readiness(
            &host.namespace,
            &host.deployment,
            current,
            observed.pod_trouble.as_ref(),
        ),
    };
    HostObjects {
        deployment: desired,
        copies: copies(host, observed, current, sources, &pull_names),
        readiness,
    }
}

/// The copies, owned by the cached Deployment `current` when there is one.
fn copies(
    host: &HostNames,
    observed: &Observed,
    current: Option<&Deployment>,
    sources: HostSources,
    pull_names: &[String],
) -> Copies {
    let mut token_copy = token::host_secret(&host.secret, &host.namespace, sources.token, current);
    stamp(&mut token_copy, &host.tenant, &host.parent);
    let pull_copies = pull_names
        .iter()
        .zip(&sources.pull)
        .map(|(name, source)| {
            let target = pull_secrets::CopyTarget {
                tenant: &host.tenant,
                parent: &host.parent,
                host_namespace: &host.namespace,
                name,
                owner: current.map(token::owner_reference),
            };
            (source.name_any(), pull_secrets::host_copy(&target, source))
        })
        .collect();
    let stale_pull_copies = observed
        .host_secrets
        .iter()
        .filter(|s| {
            s.annotations().contains_key(pull_secrets::SOURCE_ANNOTATION) && !pull_names.contains(&s.name_any())
        })
        .map(|s| (**s).clone())
        .collect();
    Copies {
        token_copy,
        pull_copies,
        stale_pull_copies,
    }
}

/// Host names of the pull-secret copies, one per source in order: those the Deployment already uses
/// are kept (a copy is re-synced in place), new ones are unguessable. A copy whose type no longer
/// matches its source gets a new name, as a Secret's type cannot change.
fn pull_copy_names(host: &HostNames, observed: &Observed, sources: &[Secret]) -> Vec<String> {
    let in_use = pull_secrets::referenced(
        observed
            .deployment
            .as_ref()
            .and_then(|d| d.spec.as_ref())
            .and_then(|s| s.template.spec.as_ref()),
    );
    sources
        .iter()
        .enumerate()
        .map(|(index, source)| {
            let reusable = in_use.get(index).filter(|name| {
                let copy = observed
                    .host_secrets
                    .iter()
                    .find(|s| s.name_any() == **name && s.namespace().as_deref() == Some(host.namespace.as_str()));
                copy.is_none_or(|copy| copy.type_.as_deref() == pull_secrets::copy_type(source))
            });
            match reusable {
                Some(name) => name.clone(),
                None => pull_secrets::host_copy_name(&host.tenant_namespace, &host.parent.name, index),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::DeploymentStatus;
    use serde_json::json;

    use super::*;
    use crate::api::stacks::PermissionScope;
    use crate::context::endpoint::{EndpointSource, TenantEndpoint};
    use crate::stacks::crd_parent_label;

    const HOST_NAMESPACE: &str = "tenant-acme-controllers";

    fn stack(scope: PermissionScope) -> Stack {
        let mut stack = Stack::new(
            "db",
            serde_json::from_value(json!({
                "customresourcedefinitions": [{"apiVersion": "samples.example.org/v1alpha1", "kind": "Widget"}],
            }))
            .expect("spec"),
        );
        stack.spec.permission_scope = scope;
        stack.metadata.namespace = Some("team-a".into());
        stack.metadata.uid = Some("stack-uid".into());
        stack
    }

    fn host(stack: &Stack) -> HostNames {
        HostNames::of(stack, "acme", HOST_NAMESPACE)
    }

    /// The stack's own CRD, labelled for it by its install.
    fn widgets() -> Arc<CustomResourceDefinition> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": "widgets.samples.example.org", "labels": {crd_parent_label("team-a", "db"): "true"}},
                "spec": {
                    "group": "samples.example.org",
                    "names": {"kind": "Widget", "plural": "widgets"},
                    "scope": "Namespaced",
                    "versions": [{"name": "v1alpha1", "served": true, "storage": true}],
                }
            }))
            .expect("crd"),
        )
    }

    fn filled_token(identity: &TenantIdentity) -> Arc<Secret> {
        let mut secret = token::tenant_secret(identity, &OwnerReference::default());
        secret.data = Some(BTreeMap::from([("token".into(), ByteString(b"t".to_vec()))]));
        Arc::new(secret)
    }

    fn pull_secret(name: &str) -> Secret {
        Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("team-a".into()),
                ..Default::default()
            },
            type_: Some("kubernetes.io/dockerconfigjson".into()),
            data: Some(BTreeMap::from([(
                ".dockerconfigjson".into(),
                ByteString(b"{}".to_vec()),
            )])),
            ..Default::default()
        }
    }

    /// What a Stack whose token is filled and whose CRDs are installed observes.
    fn settled(stack: &Stack) -> Observed {
        Observed {
            crds: vec![widgets()],
            token_secret: Some(filled_token(&TenantIdentity::of(stack))),
            ..Observed::default()
        }
    }

    fn endpoint() -> TenantEndpoint {
        TenantEndpoint::parse("https://t.example:6443", EndpointSource::ServerUrl).expect("endpoint")
    }

    fn controller<'a>(endpoint: &'a TenantEndpoint, pull_secrets: &[&str]) -> CheckedController<'a> {
        CheckedController {
            spec: deployment::parse(&json!({"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}))
                .expect("spec"),
            endpoint,
            pull_secrets: pull_secrets.iter().map(|s| s.to_string()).collect(),
            stack_definition: None,
        }
    }

    fn desired(step: Step<Desired>) -> Desired {
        match step {
            Continue(desired) => desired,
            Break(outcome) => panic!("stopped: {outcome:?}"),
        }
    }

    fn stopped_with<T>(step: Step<T>) -> Outcome {
        match step {
            Break(outcome) => outcome,
            Continue(_) => panic!("did not stop"),
        }
    }

    fn host_objects(desired: Desired) -> HostObjects {
        match desired.host {
            Continue(HostPlan::Run(objects)) => *objects,
            Continue(HostPlan::Remove) => panic!("removes the host objects"),
            Break(outcome) => panic!("stopped: {outcome:?}"),
        }
    }

    /// `binding` as the cache shows it, for `identity`'s Stack or a stranger's.
    fn cached<K: Resource>(mut binding: K, ours: bool) -> Arc<K> {
        if !ours {
            binding.meta_mut().annotations = None;
        }
        Arc::new(binding)
    }

    #[test]
    fn a_namespaced_stack_keeps_a_role_binding_and_drops_only_its_own_cluster_role_binding() {
        let stack = stack(PermissionScope::Namespaced);
        let identity = TenantIdentity::of(&stack);
        let mut observed = settled(&stack);
        observed.cluster_role_binding = Some(cached(rbac::cluster_role_binding(&identity), true));
        let tenant = desired(build(&stack, None, &observed, &host(&stack), false)).tenant;
        assert!(matches!(tenant.binding, Binding::Namespaced(_)));
        assert!(matches!(tenant.stale_binding, Some(Binding::Cluster(_))));
        observed.cluster_role_binding = Some(cached(rbac::cluster_role_binding(&identity), false));
        let tenant = desired(build(&stack, None, &observed, &host(&stack), false)).tenant;
        assert_eq!(
            tenant.stale_binding, None,
            "another's binding of the name is never removed"
        );
    }

    #[test]
    fn a_cluster_stack_keeps_a_cluster_role_binding_and_drops_its_own_role_binding() {
        let stack = stack(PermissionScope::Cluster);
        let identity = TenantIdentity::of(&stack);
        let owner = stack.controller_owner_ref(&()).expect("owner");
        let mut observed = settled(&stack);
        observed.role_binding = Some(cached(rbac::role_binding(&identity, &owner), true));
        let tenant = desired(build(&stack, None, &observed, &host(&stack), false)).tenant;
        assert!(matches!(tenant.binding, Binding::Cluster(_)));
        assert!(matches!(tenant.stale_binding, Some(Binding::Namespaced(_))));
        observed.role_binding = None;
        let tenant = desired(build(&stack, None, &observed, &host(&stack), false)).tenant;
        assert_eq!(tenant.stale_binding, None);
    }

    #[test]
    fn the_tenant_writes_stop_before_the_persona_roles_while_the_stacks_crds_are_missing() {
        let stack = stack(PermissionScope::Namespaced);
        let observed = Observed {
            crds: Vec::new(),
            ..settled(&stack)
        };
        let tenant = desired(build(&stack, None, &observed, &host(&stack), false)).tenant;
        let waiting = stopped_with(tenant.persona_roles);
        assert_eq!(
            (waiting.reason, waiting.ready, waiting.synced),
            ("WaitingForCrds", false, true)
        );
        assert!(
            waiting.message.contains("Widget.samples.example.org"),
            "{}",
            waiting.message
        );
        let tenant = desired(build(&stack, None, &settled(&stack), &host(&stack), false)).tenant;
        let Continue(roles) = tenant.persona_roles else {
            panic!("the CRDs are installed");
        };
        assert_eq!(roles.len(), 3, "admin, edit and view");
    }

    #[test]
    fn nothing_is_built_for_the_host_until_the_token_is_filled() {
        let stack = stack(PermissionScope::Namespaced);
        let endpoint = endpoint();
        let controller = controller(&endpoint, &[]);
        let observed = Observed {
            token_secret: None,
            ..settled(&stack)
        };
        let desired = desired(build(&stack, Some(&controller), &observed, &host(&stack), false));
        let waiting = stopped_with(desired.host);
        assert_eq!(waiting.reason, "WaitingForToken");
        assert!(waiting.message.contains("team-a/db-token"), "{}", waiting.message);
        assert!(
            !waiting.brief,
            "only the apply step knows whether the Secret was just created"
        );
    }

    #[test]
    fn a_stack_without_a_controller_has_its_host_objects_removed() {
        let stack = stack(PermissionScope::Namespaced);
        let desired = desired(build(&stack, None, &settled(&stack), &host(&stack), false));
        assert!(matches!(desired.host, Continue(HostPlan::Remove)));
    }

    #[test]
    fn the_copies_come_before_the_deployment_and_are_owned_by_it_once_cached() {
        let stack = stack(PermissionScope::Namespaced);
        let host = host(&stack);
        let endpoint = endpoint();
        let controller = controller(&endpoint, &[]);
        let first = host_objects(desired(build(
            &stack,
            Some(&controller),
            &settled(&stack),
            &host,
            false,
        )));
        assert_eq!(
            first.deployment.metadata.name.as_deref(),
            Some(host.deployment.as_str())
        );
        assert_eq!(first.readiness.reason, "DeploymentUnavailable");
        assert_eq!(
            first.copies.token_copy.metadata.name.as_deref(),
            Some(host.secret.as_str())
        );
        assert_eq!(first.copies.token_copy.metadata.owner_references, None);
        let mut cached = first.deployment.clone();
        cached.metadata.uid = Some("deployment-uid".into());
        cached.status = Some(DeploymentStatus {
            available_replicas: Some(1),
            ..Default::default()
        });
        let observed = Observed {
            deployment: Some(Arc::new(cached)),
            ..settled(&stack)
        };
        let objects = host_objects(desired(build(&stack, Some(&controller), &observed, &host, false)));
        let owner = &objects
            .copies
            .token_copy
            .metadata
            .owner_references
            .as_ref()
            .expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Deployment", "deployment-uid")
        );
        assert_eq!(objects.readiness.reason, "Available", "{:?}", objects.readiness);
    }

    #[test]
    fn a_pull_secret_that_cannot_be_copied_stops_the_build_before_anything_is_written() {
        let stack = stack(PermissionScope::Namespaced);
        let endpoint = endpoint();
        let controller = controller(&endpoint, &["regcred"]);
        let observed = Observed {
            pull_secrets: vec![("regcred".into(), None)],
            ..settled(&stack)
        };
        let refused = stopped_with(build(&stack, Some(&controller), &observed, &host(&stack), false));
        assert_eq!((refused.reason, refused.synced), ("PullSecretMissing", false));
    }

    #[test]
    fn a_pull_copy_in_use_keeps_its_name_and_copies_no_longer_named_go() {
        let stack = stack(PermissionScope::Namespaced);
        let host = host(&stack);
        let endpoint = endpoint();
        let controller = controller(&endpoint, &["regcred"]);
        let copy = |name: &str| {
            let mut copy = pull_secret(name);
            copy.metadata.namespace = Some(HOST_NAMESPACE.into());
            copy.metadata.annotations = Some(BTreeMap::from([(
                pull_secrets::SOURCE_ANNOTATION.to_string(),
                "regcred".to_string(),
            )]));
            Arc::new(copy)
        };
        let mut cached = host_objects(desired(build(
            &stack,
            Some(&controller),
            &settled(&stack),
            &host,
            false,
        )))
        .deployment;
        cached.metadata.uid = Some("deployment-uid".into());
        let pod = cached
            .spec
            .as_mut()
            .and_then(|s| s.template.spec.as_mut())
            .expect("pod");
        pod.image_pull_secrets = pull_secrets::references(&["in-use".to_string()]);
        let observed = Observed {
            pull_secrets: vec![("regcred".into(), Some(pull_secret("regcred")))],
            deployment: Some(Arc::new(cached)),
            host_secrets: vec![copy("in-use"), copy("dropped")],
            ..settled(&stack)
        };
        let objects = host_objects(desired(build(&stack, Some(&controller), &observed, &host, false)));
        let pod = objects.deployment.spec.and_then(|s| s.template.spec).expect("pod");
        assert_eq!(pull_secrets::referenced(Some(&pod)), ["in-use"]);
        let copies: Vec<_> = objects
            .copies
            .pull_copies
            .iter()
            .map(|(source, c)| (source.as_str(), c.name_any()))
            .collect();
        assert_eq!(copies, [("regcred", "in-use".to_string())]);
        let stale: Vec<_> = objects.copies.stale_pull_copies.iter().map(|s| s.name_any()).collect();
        assert_eq!(stale, ["dropped"]);
    }

    #[test]
    fn a_stack_without_a_uid_waits_before_anything_is_written() {
        let mut stack = stack(PermissionScope::Namespaced);
        stack.metadata.uid = None;
        let waiting = stopped_with(build(&stack, None, &settled(&stack), &host(&stack), false));
        assert_eq!(waiting.reason, "NotPersisted");
    }
}
