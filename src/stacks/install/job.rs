//! The host install Job of DESIGN.md §3.2: stackd's image copies its binary into an emptyDir, the
//! package image runs that binary to copy its `.registry` into another (so a package image needs no
//! `cp`: one `stackd package build` wrote holds its files only), then stackd's image runs
//! `stackd unpack` over it and prints the install stream to its log.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, PodSecurityContext, PodSpec, PodTemplateSpec,
    SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use crate::api::stacks::{InstallSpec, PermissionScope};
use crate::host::Parent;
use crate::host::apply::stamp;
use crate::host::names::{NameKind, host_name};
use crate::stacks::copy::{copy_command, copy_self_container, tools_mount, tools_volume};
use crate::stacks::{NON_ROOT_ID, pull_secrets};

/// Annotation on the Job: the package image it installs (a different one means an upgrade).
pub const PACKAGE_ANNOTATION: &str = "stacks.stackd.dev/package";
/// Annotation on the Job: which attempt this is (drives the retry backoff).
pub const ATTEMPT_ANNOTATION: &str = "stacks.stackd.dev/attempt";
/// The container whose log is the install stream.
pub const UNPACK_CONTAINER: &str = "unpack";
/// Where the package's `.registry` is copied to.
const PACKAGE_MOUNT: &str = "/ext-pkg";
/// How long an install Job may run before Kubernetes fails it.
const ACTIVE_DEADLINE_SECONDS: i64 = 600;

/// Host name of an install's Job.
pub fn job_name(namespace: &str, install: &str) -> String {
    host_name(Some(namespace), install, "-install", NameKind::LabelBound)
}

/// The package image with `source` applied: an image without a registry host gets `source` prepended.
pub fn package_image(spec: &InstallSpec) -> String {
    let image = spec.package.trim();
    match spec.source.as_deref().map(|s| s.trim().trim_end_matches('/')) {
        Some(source) if !source.is_empty() && !has_registry(image) => format!("{source}/{image}"),
        _ => image.to_string(),
    }
}

/// Docker's rule: the first path component names a registry when it has a `.` or `:`, or is localhost.
fn has_registry(image: &str) -> bool {
    match image.split_once('/') {
        Some((first, _)) => first.contains('.') || first.contains(':') || first == "localhost",
        None => false,
    }
}

/// What the Job needs to be built.
pub struct JobInputs<'a> {
    pub tenant: &'a str,
    pub host_namespace: &'a str,
    pub parent: &'a Parent,
    pub spec: &'a InstallSpec,
    pub scope: PermissionScope,
    pub stackd_image: &'a str,
    pub attempt: u32,
    /// Host names of the copied pull secrets.
    pub pull_secrets: &'a [String],
}

pub fn desired_job(inputs: &JobInputs<'_>) -> Job {
    let namespace = inputs.parent.namespace.as_deref().unwrap_or_default();
    let package = package_image(inputs.spec);
    let mut job = Job {
        metadata: ObjectMeta {
            name: Some(job_name(namespace, &inputs.parent.name)),
            namespace: Some(inputs.host_namespace.to_string()),
            annotations: Some(BTreeMap::from([
                (PACKAGE_ANNOTATION.to_string(), package.clone()),
                (ATTEMPT_ANNOTATION.to_string(), inputs.attempt.to_string()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(ACTIVE_DEADLINE_SECONDS),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(inputs.parent.labels(inputs.tenant)),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod_spec(inputs, &package)),
            },
            ..JobSpec::default()
        }),
        status: None,
    };
    stamp(&mut job, inputs.tenant, inputs.parent);
    job
}

/// The install pod: stackd's binary is copied for the package image, which copies its `.registry` to
/// an emptyDir with it, then `stackd unpack` reads it; no service account token, restricted on every
/// level.
fn pod_spec(inputs: &JobInputs<'_>, package: &str) -> PodSpec {
    let mount = VolumeMount {
        name: "package".into(),
        mount_path: PACKAGE_MOUNT.into(),
        ..VolumeMount::default()
    };
    let tools = Container {
        security_context: Some(restricted_container()),
        ..copy_self_container(inputs.stackd_image)
    };
    let copy = Container {
        name: "package".into(),
        image: Some(package.to_string()),
        // Whatever the install asks for (DESIGN.md §8): the node's image cache is shared by every
        // tenant, so anything else would let one tenant run another's private package image.
        image_pull_policy: Some("Always".into()),
        command: Some(copy_command("/.registry", &format!("{PACKAGE_MOUNT}/.registry"))),
        volume_mounts: Some(vec![mount.clone(), tools_mount(true)]),
        security_context: Some(restricted_container()),
        ..Container::default()
    };
    let unpack = Container {
        name: UNPACK_CONTAINER.into(),
        image: Some(inputs.stackd_image.to_string()),
        args: Some(vec![
            "unpack".into(),
            "--content-dir".into(),
            format!("{PACKAGE_MOUNT}/.registry"),
            "--permission-scope".into(),
            inputs.scope.as_str().into(),
            "--stackd-image".into(),
            inputs.stackd_image.into(),
        ]),
        env: Some(vec![EnvVar {
            name: "STACK_IMAGE".into(),
            value: Some(package.to_string()),
            ..EnvVar::default()
        }]),
        volume_mounts: Some(vec![mount]),
        security_context: Some(restricted_container()),
        ..Container::default()
    };
    PodSpec {
        restart_policy: Some("Never".into()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        security_context: Some(restricted_pod()),
        image_pull_secrets: pull_secrets::references(inputs.pull_secrets),
        volumes: Some(vec![
            tools_volume(),
            Volume {
                name: "package".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            },
        ]),
        init_containers: Some(vec![tools, copy]),
        containers: vec![unpack],
        ..PodSpec::default()
    }
}

/// Pod-level settings of the restricted Pod Security profile.
pub fn restricted_pod() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NON_ROOT_ID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// Container-level settings of the restricted Pod Security profile.
pub fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        run_as_non_root: Some(true),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..SecurityContext::default()
    }
}

/// The owner reference of a pull-secret copy: the Job, so the copy goes with it.
pub fn owner_reference(job: &Job) -> OwnerReference {
    OwnerReference {
        api_version: "batch/v1".into(),
        kind: "Job".into(),
        name: job.metadata.name.clone().unwrap_or_default(),
        uid: job.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// Names of the pull secrets a Job refers to.
pub fn pull_secrets_of(job: &Job) -> Vec<String> {
    pull_secrets::referenced(job.spec.as_ref().and_then(|s| s.template.spec.as_ref()))
}

/// The annotation value `key` of a Job.
pub fn annotation<'a>(job: &'a Job, key: &str) -> Option<&'a str> {
    job.metadata.annotations.as_ref()?.get(key).map(String::as_str)
}

/// How a Job ended, if it has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    Running,
    Complete,
    Failed {
        message: String,
        at: Option<jiff::Timestamp>,
    },
}

pub fn state(job: &Job) -> JobState {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
    for condition in conditions.into_iter().flatten() {
        if condition.status != "True" {
            continue;
        }
        match condition.type_.as_str() {
            "Complete" => return JobState::Complete,
            "Failed" => {
                let message = match (&condition.reason, &condition.message) {
                    (Some(reason), Some(message)) => format!("{reason}: {message}"),
                    (Some(reason), None) => reason.clone(),
                    (None, Some(message)) => message.clone(),
                    (None, None) => "the Job failed".into(),
                };
                return JobState::Failed {
                    message,
                    at: condition.last_transition_time.as_ref().map(|t| t.0),
                };
            }
            _ => {}
        }
    }
    JobState::Running
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(package: &str, source: Option<&str>) -> InstallSpec {
        InstallSpec {
            package: package.into(),
            source: source.map(str::to_string),
            ..InstallSpec::default()
        }
    }

    #[test]
    fn source_applies_to_unqualified_images_only() {
        assert_eq!(
            package_image(&spec("org/stack:v1", Some("reg.example.com/"))),
            "reg.example.com/org/stack:v1"
        );
        assert_eq!(
            package_image(&spec("stack:v1", Some("reg.example.com"))),
            "reg.example.com/stack:v1"
        );
        assert_eq!(
            package_image(&spec("quay.io/org/stack:v1", Some("reg.example.com"))),
            "quay.io/org/stack:v1"
        );
        assert_eq!(
            package_image(&spec("localhost:5000/stack", Some("r.io"))),
            "localhost:5000/stack"
        );
        assert_eq!(package_image(&spec("org/stack", None)), "org/stack");
    }

    #[test]
    fn job_is_restricted_and_labelled() {
        let parent = Parent::new("StackInstall", Some("team"), "s", "u");
        let install = spec("org/stack:v1", None);
        let job = desired_job(&JobInputs {
            tenant: "acme",
            host_namespace: "tenant-acme-controllers",
            parent: &parent,
            spec: &install,
            scope: PermissionScope::Namespaced,
            stackd_image: "stackd:dev",
            attempt: 1,
            pull_secrets: &[],
        });
        assert_eq!(job.metadata.name.as_deref(), Some("team.s-install"));
        let pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.containers[0].name, UNPACK_CONTAINER);
        assert_eq!(state(&job), JobState::Running);
        // The package image needs no `cp`: stackd's binary is copied for it first.
        let init = pod.init_containers.as_deref().unwrap_or_default();
        let commands: Vec<(&str, Vec<String>)> = init
            .iter()
            .map(|c| {
                let command = c.command.iter().chain(&c.args).flatten().cloned().collect();
                (c.image.as_deref().unwrap_or_default(), command)
            })
            .collect();
        assert_eq!(
            commands,
            [
                ("stackd:dev", vec!["copy-self".into(), "/stackd-tools/stackd".into()]),
                ("org/stack:v1", copy_command("/.registry", "/ext-pkg/.registry")),
            ]
        );
        for container in init.iter().chain(&pod.containers) {
            assert_eq!(
                container.security_context,
                Some(restricted_container()),
                "{}",
                container.name
            );
        }
    }
}
