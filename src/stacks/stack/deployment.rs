//! The stack's controller Deployment on the host (DESIGN.md §3.3 step 4): checked against
//! [`pod_policy`], then rebuilt to talk to the tenant with the copied token and
//! nothing of the host's. Pure: the controller writes what [`build`] returns.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, PodSecurityContext, PodSpec, SeccompProfile, SecretVolumeSource, SecurityContext,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ObjectMeta;
use serde_json::Value;

use crate::context::endpoint::TenantEndpoint;
use crate::context::pod_policy::PodPolicy;
use crate::context::registries::AllowedRegistries;
use crate::host::labels::{PARENT_KIND_LABEL, PARENT_NAME_LABEL, PARENT_NAMESPACE_LABEL, Parent, TENANT_LABEL};
use crate::stacks::pull_secrets;
use crate::stacks::{NON_ROOT_ID, pod_policy};

/// Where in-cluster clients look for their token, CA and namespace.
pub const SERVICE_ACCOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The volume holding the copied tenant token.
pub const TOKEN_VOLUME: &str = "stackd-tenant-token";
/// Annotation on the host Deployment: the host pull-secret copies its pods use, comma-separated. A
/// change in the list is a change stackd sees, so a dropped pull secret leaves the pod spec too.
pub const PULL_SECRETS_ANNOTATION: &str = "stacks.stackd.dev/pull-secrets";

/// Why a controller Deployment spec is not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// `controller.deployment.spec` is not a DeploymentSpec.
    #[error("controller.deployment.spec is not a valid apps/v1 DeploymentSpec: {0}")]
    Invalid(String),
    /// The pod asks for more than a stack's pod may have on the host.
    #[error("{0}")]
    Unsafe(String),
    /// A container image is not from a registry the host allows (`--allowed-registries`).
    #[error("{0}")]
    ImageNotAllowed(String),
}

impl SpecError {
    pub fn reason(&self) -> &'static str {
        match self {
            SpecError::Invalid(_) => "InvalidDeploymentSpec",
            SpecError::Unsafe(_) => "PodSpecRefused",
            SpecError::ImageNotAllowed(_) => "RegistryNotAllowed",
        }
    }
}

/// Reads `controller.deployment.spec`. The selector may be left out: stackd sets its own.
pub fn parse(spec: &Value) -> Result<DeploymentSpec, SpecError> {
    let mut spec = spec.clone();
    let Some(object) = spec.as_object_mut() else {
        return Err(SpecError::Invalid("it is not an object".into()));
    };
    object.entry("selector").or_insert_with(|| serde_json::json!({}));
    if !object.contains_key("template") {
        return Err(SpecError::Invalid("it has no template".into()));
    }
    let parsed: DeploymentSpec = serde_json::from_value(spec).map_err(|e| SpecError::Invalid(e.to_string()))?;
    let containers = parsed.template.spec.as_ref().map(|p| p.containers.len()).unwrap_or(0);
    if containers == 0 {
        return Err(SpecError::Invalid("the pod template has no containers".into()));
    }
    Ok(parsed)
}

/// Refuses a pod that asks for more than [`pod_policy`] allows. Checked on the package's spec, before
/// [`build`] adds stackd's own token volume.
pub fn check_safe(spec: &DeploymentSpec, policy: &PodPolicy) -> Result<(), SpecError> {
    let violations = pod_policy::violations(&spec.template, policy);
    if violations.is_empty() {
        Ok(())
    } else {
        Err(SpecError::Unsafe(pod_policy::refusal(&violations)))
    }
}

/// Refuses a pod whose container images (init containers included) are not from a registry the
/// host allows; the message names each such container and image. `stackd_image` (the daemon's
/// `--stackd-image`, whose binary copies a templating stack's behaviors) is the operator's own, which
/// every install Job runs already.
pub fn check_images(
    spec: &DeploymentSpec,
    registries: &AllowedRegistries,
    stackd_image: &str,
) -> Result<(), SpecError> {
    let Some(pod) = spec.template.spec.as_ref() else {
        return Ok(());
    };
    let containers = pod.init_containers.iter().flatten().chain(&pod.containers);
    let refused: Vec<String> = containers
        .filter_map(|c| {
            let image = c.image.as_deref().unwrap_or_default();
            if image == stackd_image {
                return None;
            }
            registries.refusal(&format!("container {:?} image", c.name), image)
        })
        .collect();
    if refused.is_empty() {
        Ok(())
    } else {
        Err(SpecError::ImageNotAllowed(format!(
            "the stack's controller is refused: {}",
            refused.join("; ")
        )))
    }
}

/// The labels selecting the stack's pods: unique per tenant and Stack.
pub fn selector_labels(tenant: &str, parent: &Parent) -> BTreeMap<String, String> {
    let mut labels = parent.labels(tenant);
    labels.retain(|key, _| {
        [
            TENANT_LABEL,
            PARENT_KIND_LABEL,
            PARENT_NAMESPACE_LABEL,
            PARENT_NAME_LABEL,
        ]
        .contains(&key.as_str())
    });
    labels
}

/// What the host Deployment is built from.
pub struct Inputs<'a> {
    pub name: &'a str,
    pub host_namespace: &'a str,
    pub tenant: &'a str,
    pub parent: &'a Parent,
    /// The Stack's namespace on the tenant (`POD_NAMESPACE`).
    pub tenant_namespace: &'a str,
    pub endpoint: &'a TenantEndpoint,
    pub token_secret: &'a str,
    /// Host names of the pull-secret copies, in the order of the Stack's `imagePullSecrets`.
    pub pull_secrets: &'a [String],
    /// Leave the security context as the package wrote it (`--insecure-pass-full-deployment`).
    pub pass_full: bool,
    /// A templating controller's StackDefinition (in `tenant_namespace`), which it finds by
    /// `SD_NAMESPACE` and `SD_NAME`, as Crossplane's stack manager told it.
    pub stack_definition: Option<&'a str>,
}

/// The host Deployment for a checked spec; the caller stamps it with the parent's labels.
pub fn build(spec: &DeploymentSpec, inputs: &Inputs<'_>) -> Deployment {
    let mut spec = spec.clone();
    let selector = selector_labels(inputs.tenant, inputs.parent);
    spec.selector = LabelSelector {
        match_labels: Some(selector.clone()),
        match_expressions: None,
    };
    let template_meta = spec.template.metadata.get_or_insert_with(ObjectMeta::default);
    template_meta.labels.get_or_insert_default().extend(selector);
    template_meta.name = None;
    template_meta.namespace = None;
    let pod = spec.template.spec.get_or_insert_with(PodSpec::default);
    pod.automount_service_account_token = Some(false);
    pod.service_account_name = None;
    #[allow(deprecated)]
    {
        pod.service_account = None;
    }
    let volumes = pod.volumes.get_or_insert_default();
    volumes.retain(|v| v.name != TOKEN_VOLUME);
    volumes.push(Volume {
        name: TOKEN_VOLUME.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(inputs.token_secret.into()),
            default_mode: Some(0o440),
            ..Default::default()
        }),
        ..Default::default()
    });
    // The package names no pull secret (the pod policy refuses it) unless its pod passes unchecked.
    let mut pulls = pod.image_pull_secrets.take().unwrap_or_default();
    pulls.retain(|r| !inputs.pull_secrets.contains(&r.name));
    pulls.extend(pull_secrets::references(inputs.pull_secrets).unwrap_or_default());
    pod.image_pull_secrets = (!pulls.is_empty()).then_some(pulls);
    if !inputs.pass_full {
        run_as_non_root_user(pod);
    }
    let mut env = vec![
        ("KUBERNETES_SERVICE_HOST", inputs.endpoint.host.clone()),
        ("KUBERNETES_SERVICE_PORT", inputs.endpoint.port.to_string()),
        ("POD_NAMESPACE", inputs.tenant_namespace.to_string()),
    ];
    if let Some(definition) = inputs.stack_definition {
        env.push(("SD_NAMESPACE", inputs.tenant_namespace.to_string()));
        env.push(("SD_NAME", definition.to_string()));
    }
    let init = pod.init_containers.iter_mut().flatten();
    for container in pod.containers.iter_mut().chain(init) {
        connect_to_tenant(container, &env);
        // The kubelet's image cache is shared by every tenant on a node: with any other policy a pod
        // without credentials could run another tenant's private image pulled there before.
        container.image_pull_policy = Some("Always".into());
        if !inputs.pass_full {
            restrict(container);
        }
    }
    Deployment {
        metadata: ObjectMeta {
            name: Some(inputs.name.into()),
            namespace: Some(inputs.host_namespace.into()),
            annotations: Some(BTreeMap::from([(
                PULL_SECRETS_ANNOTATION.to_string(),
                inputs.pull_secrets.join(","),
            )])),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// The pod half of the restricted Pod Security Standard. Many controller images name no `USER`
/// (they would run as root, which `runAsNonRoot` makes the kubelet refuse): a pod whose package
/// names no user runs as [`NON_ROOT_ID`], user and group; a package's own non-root user is kept
/// (`0` is refused before this). The volumes' group (`fsGroup`) makes the token Secret, mounted
/// `0440`, readable whichever user the package names.
fn run_as_non_root_user(pod: &mut PodSpec) {
    let init = pod.init_containers.iter().flatten();
    let names_a_user = pod.containers.iter().chain(init).any(|container| {
        container
            .security_context
            .as_ref()
            .is_some_and(|context| context.run_as_user.is_some() || context.run_as_group.is_some())
    });
    let context = pod.security_context.get_or_insert_with(PodSecurityContext::default);
    context.run_as_non_root = Some(true);
    context.seccomp_profile = Some(runtime_default());
    if context.run_as_user.is_none() {
        if !names_a_user && context.run_as_group.is_none() {
            context.run_as_group = Some(NON_ROOT_ID);
        }
        context.run_as_user = Some(NON_ROOT_ID);
    }
    context.fs_group.get_or_insert(NON_ROOT_ID);
}

/// Mounts the tenant token where in-cluster clients read it and points them at the tenant.
fn connect_to_tenant(container: &mut Container, env: &[(&str, String)]) {
    let mounts = container.volume_mounts.get_or_insert_default();
    mounts.retain(|m| m.name != TOKEN_VOLUME && m.mount_path.trim_end_matches('/') != SERVICE_ACCOUNT_PATH);
    mounts.push(VolumeMount {
        name: TOKEN_VOLUME.into(),
        mount_path: SERVICE_ACCOUNT_PATH.into(),
        read_only: Some(true),
        ..Default::default()
    });
    let vars = container.env.get_or_insert_default();
    vars.retain(|v| !env.iter().any(|(name, _)| v.name == *name));
    vars.extend(env.iter().map(|(name, value)| EnvVar {
        name: (*name).into(),
        value: Some(value.clone()),
        value_from: None,
    }));
}

/// The restricted Pod Security Standard, set explicitly so an edit on the host shows as drift.
fn restrict(container: &mut Container) {
    let context = container.security_context.get_or_insert_with(SecurityContext::default);
    context.allow_privilege_escalation = Some(false);
    context.privileged = None;
    context.run_as_non_root = Some(true);
    context.seccomp_profile = Some(runtime_default());
    context.capabilities = Some(Capabilities {
        add: None,
        drop: Some(vec!["ALL".into()]),
    });
}

fn runtime_default() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".into(),
        localhost_profile: None,
    }
}

/// True when the Deployment has an available replica.
pub fn is_available(deployment: &Deployment) -> bool {
    deployment
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .is_some_and(|n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::endpoint::EndpointSource;
    use serde_json::json;

    fn spec(pod: Value) -> Value {
        json!({"replicas": 1, "template": {"metadata": {"labels": {"app": "c"}}, "spec": pod}})
    }

    fn container() -> Value {
        json!({"name": "c", "image": "example/c:1"})
    }

    #[test]
    fn a_spec_that_is_not_a_deployment_spec_is_invalid() {
        assert!(matches!(parse(&json!("text")), Err(SpecError::Invalid(_))));
        assert!(matches!(parse(&json!({"replicas": 1})), Err(SpecError::Invalid(_))));
        assert!(matches!(
            parse(&json!({"replicas": "many", "template": {}})),
            Err(SpecError::Invalid(_))
        ));
        assert!(matches!(
            parse(&spec(json!({"containers": []}))),
            Err(SpecError::Invalid(_))
        ));
        assert!(parse(&spec(json!({"containers": [container()]}))).is_ok());
    }

    #[test]
    fn registries_judge_every_image_but_the_daemons_own_stackd_image() {
        let registries: AllowedRegistries = "registry.example.com".parse().expect("registries");
        let pod = json!({"initContainers": [{"name": "stackd-tools", "image": "ghcr.io/x/stackd:1"}],
                         "containers": [{"name": "c", "image": "registry.example.com/c:1"}]});
        let parsed = parse(&spec(pod)).expect("parses");
        assert!(check_images(&parsed, &registries, "ghcr.io/x/stackd:1").is_ok());
        let err = check_images(&parsed, &registries, "ghcr.io/x/stackd:2").expect_err("another stackd image");
        assert!(err.to_string().contains("\"stackd-tools\""), "{err}");
    }

    #[test]
    fn host_access_is_refused_each_way() {
        let cases = [
            json!({"containers": [container()], "hostNetwork": true}),
            json!({"containers": [container()], "hostPID": true}),
            json!({"containers": [container()], "hostIPC": true}),
            json!({"containers": [container()], "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}),
            json!({"containers": [container()], "volumes": [{"name": "p", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]}),
            json!({"containers": [{"name": "c", "image": "i", "securityContext": {"privileged": true}}]}),
            json!({"containers": [container()], "initContainers": [{"name": "i", "image": "i", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}]}),
            json!({"containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 80, "hostPort": 80}]}]}),
        ];
        for pod in cases {
            let parsed = parse(&spec(pod.clone())).expect("parses");
            let err = check_safe(&parsed, &PodPolicy::default()).expect_err(&pod.to_string());
            assert!(err.to_string().contains("--insecure-pass-full-deployment"), "{err}");
        }
    }

    #[test]
    fn the_built_pod_talks_to_the_tenant_with_the_copied_token_only() {
        let parsed = parse(&spec(json!({
            "serviceAccountName": "host-sa",
            "initContainers": [{"name": "i", "image": "i"}],
            "containers": [{"name": "c", "image": "i", "env": [{"name": "POD_NAMESPACE", "value": "wrong"}]}],
        })))
        .expect("parses");
        let parent = Parent::new("Stack", Some("team-a"), "s", "u");
        let endpoint = TenantEndpoint::parse("https://t.example:6443", EndpointSource::ServerUrl).expect("endpoint");
        let deployment = build(
            &parsed,
            &Inputs {
                name: "team-a.s",
                host_namespace: "tenant-acme-controllers",
                tenant: "acme",
                parent: &parent,
                tenant_namespace: "team-a",
                endpoint: &endpoint,
                token_secret: "team-a.s-token",
                pull_secrets: &["team-a.s-pull-0-abc".to_string()],
                pass_full: false,
                stack_definition: None,
            },
        );
        let spec = deployment.spec.expect("spec");
        let pod = spec.template.spec.expect("pod");
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.service_account_name, None);
        assert_eq!(
            pull_secrets::referenced(Some(&pod)),
            ["team-a.s-pull-0-abc"],
            "the pods pull with the copies only"
        );
        assert_eq!(
            spec.selector.match_labels.clone().expect("labels")[TENANT_LABEL],
            "acme"
        );
        let template_labels = spec.template.metadata.and_then(|m| m.labels).expect("labels");
        assert_eq!(template_labels["app"], "c");
        for (k, v) in spec.selector.match_labels.expect("labels") {
            assert_eq!(template_labels.get(&k), Some(&v));
        }
        for container in pod.containers.iter().chain(pod.init_containers.iter().flatten()) {
            let mount = container.volume_mounts.as_ref().expect("mounts");
            assert!(
                mount
                    .iter()
                    .any(|m| m.mount_path == SERVICE_ACCOUNT_PATH && m.read_only == Some(true))
            );
            let env: BTreeMap<_, _> = container
                .env
                .iter()
                .flatten()
                .map(|e| (e.name.as_str(), e.value.clone().unwrap_or_default()))
                .collect();
            assert_eq!(env["KUBERNETES_SERVICE_HOST"], "t.example");
            assert_eq!(env["KUBERNETES_SERVICE_PORT"], "6443");
            assert_eq!(env["POD_NAMESPACE"], "team-a");
            let context = container.security_context.as_ref().expect("context");
            assert_eq!(context.allow_privilege_escalation, Some(false));
            assert_eq!(container.image_pull_policy.as_deref(), Some("Always"));
        }
    }

    fn built_pod(pod: serde_json::Value) -> PodSpec {
        let parsed = parse(&spec(pod)).expect("parses");
        let parent = Parent::new("Stack", Some("team-a"), "s", "u");
        let endpoint = TenantEndpoint::parse("https://t.example:6443", EndpointSource::ServerUrl).expect("endpoint");
        let inputs = Inputs {
            name: "team-a.s",
            host_namespace: "tenant-acme-controllers",
            tenant: "acme",
            parent: &parent,
            tenant_namespace: "team-a",
            endpoint: &endpoint,
            token_secret: "team-a.s-token",
            pull_secrets: &[],
            pass_full: false,
            stack_definition: None,
        };
        build(&parsed, &inputs)
            .spec
            .and_then(|spec| spec.template.spec)
            .expect("pod")
    }

    #[test]
    fn a_package_that_names_no_user_runs_as_a_fixed_non_root_user_and_group() {
        let pod = built_pod(json!({"containers": [container()]}));
        let context = pod.security_context.expect("pod security context");
        assert_eq!(context.run_as_non_root, Some(true));
        assert_eq!(context.run_as_user, Some(NON_ROOT_ID));
        assert_eq!(context.run_as_group, Some(NON_ROOT_ID));
        assert_eq!(
            context.fs_group,
            Some(NON_ROOT_ID),
            "the 0440 token is readable by the pod's group"
        );
    }

    #[test]
    fn a_packages_own_non_root_user_is_kept() {
        let pod = built_pod(json!({"containers": [container()], "securityContext": {"runAsUser": 1000}}));
        let context = pod.security_context.expect("pod security context");
        assert_eq!(context.run_as_user, Some(1000));
        assert_eq!(context.run_as_group, None, "the image's group stays the package's");
        let pod =
            built_pod(json!({"containers": [{"name": "c", "image": "i", "securityContext": {"runAsUser": 2000}}]}));
        let context = pod.security_context.expect("pod security context");
        assert_eq!(context.run_as_group, None);
        let container = &pod.containers[0];
        assert_eq!(
            container.security_context.as_ref().and_then(|c| c.run_as_user),
            Some(2000),
            "the container's own user wins over the pod's default"
        );
    }
}
