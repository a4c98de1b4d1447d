//! The installer contract on the host (DESIGN.md §4.2): the names of one cluster's host objects,
//! the input and output Secrets, the installer's ServiceAccount and Role, the install and destroy
//! Jobs, and what a Job's conditions say. Pure: the controller stamps and writes them.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, KeyToPath, PodSecurityContext, PodSpec, PodTemplateSpec, SeccompProfile, Secret,
    SecretVolumeSource, SecurityContext, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::ResourceExt;

use crate::api::pools::ClusterDeployment;
use crate::host::names::{NameKind, host_name};

/// Where the installer finds its inputs and writes its state.
const INSTALL_DIR: &str = "/installer";

/// Host names of one cluster's objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Names {
    pub(crate) input: String,
    pub(crate) output: String,
    /// The installer's ServiceAccount, Role and RoleBinding.
    pub(crate) installer: String,
    pub(crate) destroy: String,
}

impl Names {
    pub(crate) fn of(cd: &ClusterDeployment) -> Names {
        let (ns, name) = (cd.namespace().unwrap_or_default(), cd.name_any());
        let object = |suffix: &str| host_name(Some(&ns), &name, suffix, NameKind::Object);
        Names {
            input: object("-install-config"),
            output: object("-output"),
            installer: object("-installer"),
            destroy: host_name(Some(&ns), &name, "-destroy", NameKind::LabelBound),
        }
    }

    /// Each attempt has its own Job, so a failure is counted once.
    pub(crate) fn install_job(cd: &ClusterDeployment, attempt: i32) -> String {
        let (ns, name) = (cd.namespace().unwrap_or_default(), cd.name_any());
        host_name(Some(&ns), &name, &format!("-install-{attempt}"), NameKind::LabelBound)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JobState {
    Running,
    Succeeded,
    Failed,
}

/// The reason Kubernetes gives a Job it stopped at its `activeDeadlineSeconds`.
const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";

pub(crate) fn job_state(job: &Job) -> JobState {
    if finished(job, "Complete").is_some() {
        JobState::Succeeded
    } else if finished(job, "Failed").is_some() {
        JobState::Failed
    } else {
        JobState::Running
    }
}

/// The reason of the Job's condition `type_`, when that condition is True.
fn finished(job: &Job, type_: &str) -> Option<String> {
    let conditions = job.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")
        .map(|c| c.reason.clone().unwrap_or_default())
}

/// Whether the Job failed because it ran past its deadline (`--installer-deadline`).
pub(crate) fn deadline_exceeded(job: &Job) -> bool {
    finished(job, "Failed").as_deref() == Some(DEADLINE_EXCEEDED)
}

fn meta(name: &str, namespace: &str) -> kube::api::ObjectMeta {
    kube::api::ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        ..Default::default()
    }
}

/// Annotation on the input Secret (which only stackd writes): the uid of the output Secret stackd
/// created for the installer, the proof that a Secret of that name is still that one (the orphan
/// sweep's too).
pub(crate) use crate::host::labels::OUTPUT_UID_ANNOTATION;

/// The installer's inputs: the rendered install config, the pull secret and the credentials; and
/// the uid of the output Secret made for it.
pub(crate) fn input_secret(
    names: &Names,
    namespace: &str,
    data: BTreeMap<String, ByteString>,
    output_uid: &str,
) -> Secret {
    let mut metadata = meta(&names.input, namespace);
    metadata.annotations = Some(BTreeMap::from([(
        OUTPUT_UID_ANNOTATION.to_string(),
        output_uid.to_string(),
    )]));
    Secret {
        metadata,
        data: Some(data),
        ..Default::default()
    }
}

/// The Secret the installer fills; stackd only makes sure it exists.
pub(crate) fn output_secret(names: &Names, namespace: &str) -> Secret {
    Secret {
        metadata: meta(&names.output, namespace),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// The ServiceAccount the installer runs as, allowed only get/update/patch on its output Secret.
pub(crate) fn identity(names: &Names, namespace: &str) -> (ServiceAccount, Role, RoleBinding) {
    let account = ServiceAccount {
        metadata: meta(&names.installer, namespace),
        automount_service_account_token: Some(true),
        ..Default::default()
    };
    let role = Role {
        metadata: meta(&names.installer, namespace),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["secrets".into()]),
            resource_names: Some(vec![names.output.clone()]),
            verbs: vec!["get".into(), "update".into(), "patch".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: meta(&names.installer, namespace),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: names.installer.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: names.installer.clone(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    (account, role, binding)
}

/// The install (`create cluster`) or destroy (`destroy cluster`) Job of §4.2. The installer is the
/// tenant's image: it runs at most `deadline` (`--installer-deadline`) before Kubernetes stops it.
pub(crate) fn installer_job(
    name: &str,
    namespace: &str,
    names: &Names,
    image: &str,
    cluster: &str,
    destroy: bool,
    deadline: Duration,
) -> Job {
    let (volumes, mounts) = installer_volumes(names, destroy);
    let pod = PodSpec {
        restart_policy: Some("Never".into()),
        service_account_name: Some(names.installer.clone()),
        // The host namespace's Services are none of the installer's business.
        enable_service_links: Some(false),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        containers: vec![installer_container(namespace, names, image, cluster, destroy, mounts)],
        volumes: Some(volumes),
        ..Default::default()
    };
    Job {
        metadata: meta(name, namespace),
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            active_deadline_seconds: Some(i64::try_from(deadline.as_secs().max(1)).unwrap_or(i64::MAX)),
            template: PodTemplateSpec {
                metadata: None,
                spec: Some(pod),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Gives the Job's pods the Job's (stamped) labels, so that the tenant's pod watch sees them and
/// what the kubelet says of them reaches the cluster's status.
pub(crate) fn label_pods(job: &mut Job) {
    let labels = job.metadata.labels.clone();
    if let Some(spec) = job.spec.as_mut() {
        spec.template.metadata.get_or_insert_default().labels = labels;
    }
}

/// The installer's container: the tenant's image, told where its output Secret is.
fn installer_container(
    namespace: &str,
    names: &Names,
    image: &str,
    cluster: &str,
    destroy: bool,
    mounts: Vec<VolumeMount>,
) -> Container {
    let verb = if destroy { "destroy" } else { "create" };
    let env = |name: &str, value: &str| EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..Default::default()
    };
    Container {
        name: "installer".into(),
        image: Some(image.into()),
        // The image is the tenant's choice: pulled with the Job's own credentials every time,
        // never run from a node's cache of another tenant's pull.
        image_pull_policy: Some("Always".into()),
        args: Some([verb, "cluster", "--dir", INSTALL_DIR].map(String::from).to_vec()),
        env: Some(vec![
            env("STACKD_OUTPUT_SECRET", &names.output),
            env("STACKD_OUTPUT_NAMESPACE", namespace),
            env("STACKD_CLUSTER_NAME", cluster),
        ]),
        volume_mounts: Some(mounts),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The input Secret, read-only; the destroy Job also gets `metadata.json` back from the output
/// Secret.
fn installer_volumes(names: &Names, destroy: bool) -> (Vec<Volume>, Vec<VolumeMount>) {
    let volume = |name: &str, secret: &str, items: Option<Vec<KeyToPath>>| Volume {
        name: name.into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            items,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mount = |name: &str| VolumeMount {
        name: name.into(),
        mount_path: format!("{INSTALL_DIR}/{name}"),
        read_only: Some(true),
        ..Default::default()
    };
    let mut volumes = vec![volume("input", &names.input, None)];
    let mut mounts = vec![mount("input")];
    if destroy {
        let state = KeyToPath {
            key: "metadata.json".into(),
            path: "metadata.json".into(),
            ..Default::default()
        };
        volumes.push(volume("state", &names.output, Some(vec![state])));
        mounts.push(mount("state"));
    }
    (volumes, mounts)
}

/// A key of the installer's output Secret, as text.
pub(crate) fn output_text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

/// Whether the installer left state a destroy Job needs (`metadata.json`).
pub(crate) fn has_state(output: Option<&Secret>) -> bool {
    output
        .and_then(|s| s.data.as_ref())
        .and_then(|d| d.get("metadata.json"))
        .is_some_and(|b| std::str::from_utf8(&b.0).is_ok())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use serde_json::json;

    use super::*;

    fn job_with(conditions: &[(&str, &str)]) -> Job {
        Job {
            status: Some(JobStatus {
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(type_, status)| JobCondition {
                            type_: type_.to_string(),
                            status: status.to_string(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn names() -> Names {
        Names {
            input: "in".into(),
            output: "out".into(),
            installer: "sa".into(),
            destroy: "destroy".into(),
        }
    }

    #[test]
    fn a_job_stopped_at_its_deadline_says_so() {
        let mut job = job_with(&[("Failed", "True")]);
        assert!(!deadline_exceeded(&job));
        job.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].reason = Some("DeadlineExceeded".into());
        assert!(deadline_exceeded(&job));
        assert_eq!(job_state(&job), JobState::Failed);
    }

    #[test]
    fn a_job_is_running_until_complete_or_failed_is_true() {
        assert_eq!(job_state(&Job::default()), JobState::Running);
        assert_eq!(job_state(&job_with(&[("Complete", "False")])), JobState::Running);
        assert_eq!(job_state(&job_with(&[("Complete", "True")])), JobState::Succeeded);
        assert_eq!(job_state(&job_with(&[("Failed", "True")])), JobState::Failed);
    }

    #[test]
    fn the_install_job_creates_and_the_destroy_job_destroys_with_the_state_mounted() {
        let hours = Duration::from_secs(3 * 3600);
        let install = serde_json::to_value(installer_job("j", "host", &names(), "img", "c1", false, hours)).unwrap();
        let pod = &install["spec"]["template"]["spec"];
        assert_eq!(
            pod["containers"][0]["args"],
            json!(["create", "cluster", "--dir", "/installer"])
        );
        assert_eq!(pod["volumes"].as_array().unwrap().len(), 1);
        assert_eq!(pod["serviceAccountName"], json!("sa"));
        assert_eq!(install["spec"]["backoffLimit"], json!(0));
        assert_eq!(install["spec"]["activeDeadlineSeconds"], json!(10800));
        let destroy = serde_json::to_value(installer_job("d", "host", &names(), "img", "c1", true, hours)).unwrap();
        assert_eq!(destroy["spec"]["activeDeadlineSeconds"], json!(10800));
        let pod = &destroy["spec"]["template"]["spec"];
        assert_eq!(
            pod["containers"][0]["args"],
            json!(["destroy", "cluster", "--dir", "/installer"])
        );
        assert_eq!(
            pod["volumes"][1]["secret"],
            json!({"secretName": "out", "items": [{"key": "metadata.json", "path": "metadata.json"}]})
        );
        let env = &pod["containers"][0]["env"];
        assert_eq!(env[0], json!({"name": "STACKD_OUTPUT_SECRET", "value": "out"}));
        assert_eq!(env[1], json!({"name": "STACKD_OUTPUT_NAMESPACE", "value": "host"}));
    }

    #[test]
    fn the_installer_may_only_touch_its_output_secret() {
        let (account, role, binding) = identity(&names(), "host");
        assert_eq!(account.metadata.name.as_deref(), Some("sa"));
        let rule = &role.rules.unwrap()[0];
        assert_eq!(rule.resource_names.as_deref(), Some(&["out".to_string()][..]));
        assert_eq!(rule.verbs, vec!["get", "update", "patch"]);
        assert_eq!(binding.role_ref.name, "sa");
    }

    #[test]
    fn only_an_output_with_metadata_json_has_state_to_destroy() {
        assert!(!has_state(None));
        assert!(!has_state(Some(&output_secret(&names(), "host"))));
        let mut output = output_secret(&names(), "host");
        output.data = Some(BTreeMap::from([(
            "metadata.json".to_string(),
            ByteString(br#"{"infraID":"x"}"#.to_vec()),
        )]));
        assert!(has_state(Some(&output)));
    }
}
