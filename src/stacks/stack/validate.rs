//! §3.3 step 1, before anything is written (pure): what stackd will not run. A Stack no install
//! created or with a scope its install does not allow, permissions beyond the stack's API, a pod
//! spec that is not a DeploymentSpec or reaches the host, a pull secret that is not named as a
//! Secret of the Stack's namespace, an endpoint host pods cannot use.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::DeploymentSpec;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;

use super::origin::{self, Installs};
use super::outcome::Outcome;
use super::{deployment, rbac};
use crate::api::stacks::Stack;
use crate::context::endpoint::{EndpointError, TenantEndpoint};
use crate::context::shared::DaemonSettings;
use crate::stacks::pull_secrets;

/// A stack's controller as validated: what the host Deployment is built from.
pub(super) struct CheckedController<'a> {
    pub spec: DeploymentSpec,
    pub endpoint: &'a TenantEndpoint,
    /// The tenant pull secrets (in the Stack's namespace) its pods pull with.
    pub pull_secrets: Vec<String>,
    /// A templating controller's StackDefinition (in the Stack's namespace), which it reads.
    pub stack_definition: Option<String>,
}

/// What a Stack is judged against besides itself.
pub(super) struct Judge<'a> {
    pub installs: &'a Installs,
    pub settings: &'a DaemonSettings,
    pub endpoint: &'a Result<TenantEndpoint, EndpointError>,
    pub tenant_crds: &'a [Arc<CustomResourceDefinition>],
}

/// Refuses what stackd will not run (the outcome says why and what to do); returns the checked
/// controller (none for a stack without a controller).
pub(super) fn validate<'a>(stack: &Stack, judge: &Judge<'a>) -> Result<Option<CheckedController<'a>>, Outcome> {
    let refused = |refusal: origin::Refusal| Outcome::refused(refusal.reason(), refusal.to_string());
    let scope = judge.installs.scope_of(stack).map_err(refused)?;
    origin::check_scope(stack, scope).map_err(refused)?;
    let settings = judge.settings;
    if !settings.insecure_allow_all_apigroups
        && let Err(message) =
            rbac::validate_permissions(&stack.spec, judge.tenant_crds, &settings.platform_dependency_groups)
    {
        return Err(Outcome::refused("PermissionsRefused", message));
    }
    if stack.spec.behavior.is_some() && !serves_stack_definitions(judge.tenant_crds) {
        return Err(Outcome::refused(
            "StackDefinitionsNotServed",
            format!(
                "the stack is a templating stack, whose controller reads a StackDefinition, and the tenant serves no {STACK_DEFINITIONS_CRD}: install that CRD with this stackd's stackd-types chart (or `stackd crds`)"
            ),
        ));
    }
    let Some(controller) = &stack.spec.controller.deployment else {
        return Ok(None);
    };
    let spec = deployment::parse(&controller.spec)
        .and_then(|spec| {
            if !settings.insecure_pass_full_deployment {
                deployment::check_safe(&spec, &settings.stack_pod_policy)?;
            }
            deployment::check_images(&spec, &settings.allowed_registries, &settings.stackd_image)?;
            Ok(spec)
        })
        .map_err(|err| Outcome::refused(err.reason(), err.to_string()))?;
    let namespace = stack.namespace().unwrap_or_default();
    let pull_secrets = pull_secrets::checked_names(&stack.spec.controller.image_pull_secrets, &namespace)
        .map_err(|err| Outcome::refused(err.reason(), err.to_string()))?;
    let endpoint = judge
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
        stack_definition: stack.spec.behavior.as_ref().map(|_| stack.name_any()),
    }))
}

/// The CRD of the StackDefinitions templating controllers read.
const STACK_DEFINITIONS_CRD: &str = "stackdefinitions.packages.crossplane.io";

fn serves_stack_definitions(tenant_crds: &[Arc<CustomResourceDefinition>]) -> bool {
    tenant_crds.iter().any(|crd| crd.name_any() == STACK_DEFINITIONS_CRD)
}
