//! What the ClusterDeployment controller does next (DESIGN.md §4.2, §4.3 item 11), decided from
//! what it has read: the ClusterDeployment, its host Jobs and Secrets from the caches, and the
//! tenant Secrets it needs. Pure: no client.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;

use super::installer::{JobState, Names, deadline_exceeded, has_state, job_state, output_text};
use super::status::Outcome;
use crate::api::pools::ClusterDeployment;
use crate::bounds::{self, OUTPUT_KEYS};
use crate::pools::DEPROVISION_FINALIZER;
use crate::pools::failure_domains::INVALID_KEY;
use crate::runtime::conditions::is_true;
use crate::runtime::untrusted_kubeconfig::{UntrustedKubeconfigError, config_from_untrusted};

const DEFAULT_ATTEMPTS: i32 = 3;

/// Whether the deprovision finalizer is on: it goes on before anything is provisioned, so deletion
/// always runs the destroy Job.
pub(crate) fn has_finalizer(cd: &ClusterDeployment) -> bool {
    cd.finalizers().iter().any(|f| f == DEPROVISION_FINALIZER)
}

/// What provisioning reads from the host caches.
pub(crate) struct Snapshot<'a> {
    pub(crate) cd: &'a ClusterDeployment,
    pub(crate) names: &'a Names,
    /// This cluster's Jobs on the host.
    pub(crate) jobs: &'a [Job],
    /// The cached Job of the current attempt (by name).
    pub(crate) current: Option<&'a Job>,
}

#[derive(Debug, PartialEq)]
pub(crate) enum Provision<'a> {
    /// Installed, or stopped for good: nothing more to do.
    Settled,
    /// Work on the current attempt: delete `stale`, then do `next`.
    Attempt {
        /// Earlier attempts' Jobs (each attempt has its own Job, so a failure is counted once).
        stale: Vec<&'a Job>,
        next: AttemptStep,
    },
}

#[derive(Debug, PartialEq)]
pub(crate) enum AttemptStep {
    /// The installer runs; its Job's watch event brings the cluster back.
    Wait,
    /// The installer succeeded: copy the admin kubeconfig and record the cluster installed.
    Succeeded,
    /// The installer failed: count the attempt (retry, or stop at the limit).
    Failed(Outcome),
    /// No Job for this attempt yet: gather the inputs and start it.
    Start,
}

/// Which attempt the cluster is at; its Job is [`Names::install_job`] of it.
pub(crate) fn attempt(cd: &ClusterDeployment) -> i32 {
    cd.status.as_ref().map_or(0, |s| s.install_restarts)
}

pub(crate) fn provision<'a>(snapshot: &Snapshot<'a>) -> Provision<'a> {
    let status = snapshot.cd.status.clone().unwrap_or_default();
    if status.installed || is_true(&status.conditions, "ProvisionStopped") {
        return Provision::Settled;
    }
    let current = Names::install_job(snapshot.cd, attempt(snapshot.cd));
    let stale = snapshot
        .jobs
        .iter()
        .filter(|job| {
            let name = job.name_any();
            name != current && name != snapshot.names.destroy && job.metadata.deletion_timestamp.is_none()
        })
        .collect();
    let next = match snapshot.current.map(job_state) {
        None => AttemptStep::Start,
        Some(JobState::Running) => AttemptStep::Wait,
        Some(JobState::Succeeded) => AttemptStep::Succeeded,
        Some(JobState::Failed) => {
            let timed_out = snapshot.current.is_some_and(deadline_exceeded);
            AttemptStep::Failed(failed_attempt(snapshot.cd, timed_out))
        }
    };
    Provision::Attempt { stale, next }
}

/// The failed attempt counted against `installAttemptsLimit` (default 3, at least 1);
/// `timed_out` when its Job ran past the installer deadline.
fn failed_attempt(cd: &ClusterDeployment, timed_out: bool) -> Outcome {
    let limit = cd.spec.install_attempts_limit.unwrap_or(DEFAULT_ATTEMPTS).max(1);
    Outcome::InstallFailed {
        attempts: attempt(cd) + 1,
        limit,
        timed_out,
        ended: None,
    }
}

/// The tenant Secrets the installer needs, in the order they are read: `(what, name)`.
pub(crate) fn input_refs(cd: &ClusterDeployment) -> Vec<(&'static str, String)> {
    let config = cd
        .spec
        .provisioning
        .as_ref()
        .map(|p| p.install_config_secret_ref.name.clone());
    let pull = cd.spec.pull_secret_ref.as_ref().map(|r| r.name.clone());
    [
        ("install config", config),
        ("credentials", credentials_ref(cd)),
        ("pull secret", pull),
    ]
    .into_iter()
    .filter_map(|(what, name)| Some((what, name?)))
    .collect()
}

fn credentials_ref(cd: &ClusterDeployment) -> Option<String> {
    let p = &cd.spec.platform;
    p.vsphere
        .as_ref()
        .map(|v| v.credentials_secret_ref.name.clone())
        .or_else(|| p.openstack.as_ref().map(|o| o.credentials_secret_ref.name.clone()))
        .or_else(|| p.baremetal.as_ref().map(|b| b.credentials_secret_ref.name.clone()))
}

/// What the installer Job is started with.
#[derive(Debug, PartialEq)]
pub(crate) struct Inputs {
    /// The input Secret's data: every input Secret's keys, later ones winning.
    pub(crate) data: BTreeMap<String, ByteString>,
    pub(crate) installer_image: String,
}

/// The installer's inputs from the Secrets read for [`input_refs`] (`None`: it does not exist);
/// or why the installer cannot start.
pub(crate) fn inputs(
    cd: &ClusterDeployment,
    read: Vec<(&'static str, String, Option<Secret>)>,
    host_secret_limit: usize,
) -> Result<Inputs, Outcome> {
    let ns = cd.namespace().unwrap_or_default();
    // They are copied into one host Secret: measured before anything is copied.
    let total = read
        .iter()
        .filter_map(|(_, _, secret)| secret.as_ref())
        .map(bounds::secret_data_bytes)
        .fold(0, usize::saturating_add);
    let host_input = || {
        format!(
            "the installer's input Secret (the data of Secrets {})",
            input_names(&ns, &read)
        )
    };
    if let Err(refused) = bounds::host_secret_bytes(host_input, total, host_secret_limit) {
        return Err(Outcome::InputsTooLarge(refused.to_string()));
    }
    let mut input = BTreeMap::new();
    let mut missing = Vec::new();
    for (what, name, secret) in read {
        match secret {
            Some(secret) => input.extend(secret.data.unwrap_or_default()),
            None => missing.push(format!("{what} Secret {ns}/{name}")),
        }
    }
    let Some(provisioning) = &cd.spec.provisioning else {
        missing.push("spec.provisioning".into());
        return Err(Outcome::MissingInputs(missing));
    };
    if !missing.is_empty() {
        return Err(Outcome::MissingInputs(missing));
    }
    // The pool renders a configuration error (§6 merge rules) in place of the machines.
    if let Some(invalid) = input.get(INVALID_KEY) {
        return Err(Outcome::InvalidMachineSpec(
            String::from_utf8_lossy(&invalid.0).into_owned(),
        ));
    }
    Ok(Inputs {
        data: input,
        installer_image: provisioning.installer_image.clone(),
    })
}

/// `ns/a, ns/b` for the Secrets read.
fn input_names(ns: &str, read: &[(&'static str, String, Option<Secret>)]) -> String {
    let names: Vec<String> = read.iter().map(|(_, name, _)| format!("{ns}/{name}")).collect();
    names.join(", ")
}

/// What the installer's output says once its Job succeeded.
#[derive(Debug)]
pub(crate) enum Output {
    /// The cache may not have the installer's write yet; the Secret's watch event brings us back.
    Pending,
    /// The installer image is the tenant's choice, so its kubeconfig is as untrusted as the tenant.
    Refused(UntrustedKubeconfigError),
    /// A key larger than stackd reads (the refusal says which): nothing of it is parsed.
    TooLarge(String),
    /// A kubeconfig stackd may copy to the tenant.
    Accepted {
        kubeconfig: String,
        infra_id: Option<String>,
    },
}

pub(crate) fn output(secret: Option<&Secret>) -> Output {
    let data = secret.and_then(|s| s.data.as_ref());
    let oversized = OUTPUT_KEYS.iter().find_map(|(key, max)| {
        let len = data.and_then(|d| d.get(*key)).map_or(0, |b| b.0.len());
        (len > *max)
            .then(|| format!("key {key} of the installer's output Secret is {len} bytes; stackd reads at most {max}"))
    });
    if let Some(refusal) = oversized {
        return Output::TooLarge(refusal);
    }
    let (Some(kubeconfig), Some(metadata)) = (
        secret.and_then(|s| output_text(s, "kubeconfig")),
        secret.and_then(|s| output_text(s, "metadata.json")),
    ) else {
        return Output::Pending;
    };
    if let Err(refusal) = config_from_untrusted(&kubeconfig) {
        return Output::Refused(refusal);
    }
    let infra_id = serde_json::from_str::<serde_json::Value>(&metadata)
        .ok()
        .and_then(|m| m["infraID"].as_str().map(String::from));
    Output::Accepted { kubeconfig, infra_id }
}

/// What deprovisioning reads from the host caches.
pub(crate) struct Teardown<'a> {
    pub(crate) cd: &'a ClusterDeployment,
    pub(crate) names: &'a Names,
    /// This cluster's Jobs on the host.
    pub(crate) jobs: &'a [Job],
    /// The installer's output Secret (its `metadata.json` is what the destroy Job needs).
    pub(crate) output: Option<&'a Secret>,
    /// The cached destroy Job (by name).
    pub(crate) destroy: Option<&'a Job>,
}

#[derive(Debug, PartialEq)]
pub(crate) enum Deprovision<'a> {
    /// No finalizer of ours: nothing holds the deletion.
    NotHeld,
    /// Stop the installers (`stop`), then `next`.
    Proceed { stop: Vec<&'a Job>, next: Destroy<'a> },
}

#[derive(Debug, PartialEq)]
pub(crate) enum Destroy<'a> {
    /// Start the destroy Job with this installer image.
    Start(String),
    Wait,
    /// It failed: delete it and start again; the CDC must not be reused while the old cluster may
    /// exist.
    Retry(&'a Job),
    /// Destroyed, or nothing was ever created to destroy: release and clean up.
    Done,
}

/// Deletion (§4.3.11): the destroy Job runs and succeeds before anything else is let go.
pub(crate) fn deprovision<'a>(teardown: &Teardown<'a>) -> Deprovision<'a> {
    if !has_finalizer(teardown.cd) {
        return Deprovision::NotHeld;
    }
    let stop = teardown
        .jobs
        .iter()
        .filter(|job| job.name_any() != teardown.names.destroy && job.metadata.deletion_timestamp.is_none())
        .collect();
    let image = teardown
        .cd
        .spec
        .provisioning
        .as_ref()
        .map(|p| p.installer_image.clone());
    let next = match (has_state(teardown.output), image) {
        (true, Some(image)) => match teardown.destroy {
            None => Destroy::Start(image),
            Some(job) => match job_state(job) {
                JobState::Running => Destroy::Wait,
                JobState::Failed => Destroy::Retry(job),
                JobState::Succeeded => Destroy::Done,
            },
        },
        _ => Destroy::Done,
    };
    Deprovision::Proceed { stop, next }
}

/// What a destroyed cluster gives back (§4.3.6, §5, §8).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Release {
    /// The cluster names a pool that did not create it: say that nothing of the pool's is released.
    pub(crate) refused: bool,
    /// `(namespace, name, pool)` of the CDC to release.
    pub(crate) customization: Option<(String, String, String)>,
    /// Where the cluster's BareMetalAssets go back to the inventory.
    pub(crate) hosts_namespace: Option<String>,
}

/// `made_by_pool`: the pool its reference names created it (a reference alone is anyone's to write).
pub(crate) fn release(cd: &ClusterDeployment, made_by_pool: bool) -> Release {
    let pool_ref = cd.spec.cluster_pool_ref.as_ref();
    let customization = pool_ref.filter(|_| made_by_pool).and_then(|pool_ref| {
        let cdc = pool_ref.cluster_deployment_customization.as_ref()?;
        Some((pool_ref.namespace.clone(), cdc.name.clone(), pool_ref.pool_name.clone()))
    });
    // The pool's for a cluster the pool created, its own namespace's for one made by hand.
    let hosts_namespace = match pool_ref {
        Some(pool_ref) => made_by_pool.then(|| pool_ref.namespace.clone()),
        None => cd.namespace(),
    };
    Release {
        refused: pool_ref.is_some() && !made_by_pool,
        customization,
        hosts_namespace: hosts_namespace.filter(|_| !cd.spec.hosts.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use serde_json::json;

    use super::*;
    use crate::api::pools::ClusterDeploymentStatus;

    fn cd(spec: serde_json::Value) -> ClusterDeployment {
        let mut base = json!({"clusterName": "c1", "baseDomain": "example.com", "platform": {}});
        base.as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        let mut cd: ClusterDeployment = serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
            "metadata": {"name": "c1", "namespace": "c1", "uid": "uid-1", "finalizers": [DEPROVISION_FINALIZER]},
            "spec": base,
        }))
        .unwrap();
        cd.status = Some(ClusterDeploymentStatus::default());
        cd
    }

    fn provisioned() -> ClusterDeployment {
        cd(json!({
            "provisioning": {"installConfigSecretRef": {"name": "c1-install-config"}, "installerImage": "installer:1"},
            "pullSecretRef": {"name": "pull"},
            "platform": {"openstack": {"credentialsSecretRef": {"name": "creds"}, "cloud": "c", "externalNetwork": "e"}},
        }))
    }

    fn pool_cd(cdc: bool, hosts: bool) -> ClusterDeployment {
        let mut pool_ref = json!({"namespace": "team", "poolName": "p"});
        if cdc {
            pool_ref["clusterDeploymentCustomization"] = json!({"name": "cdc-1"});
        }
        let hosts = if hosts {
            json!([{"name": "host-1", "role": "master"}])
        } else {
            json!([])
        };
        cd(json!({"clusterPoolRef": pool_ref, "hosts": hosts}))
    }

    fn job(name: &str, state: Option<&str>) -> Job {
        Job {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(JobStatus {
                conditions: state.map(|t| {
                    vec![JobCondition {
                        type_: t.into(),
                        status: "True".into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn secret(data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn is_settled(cd: &ClusterDeployment) -> bool {
        let names = Names::of(cd);
        let snapshot = Snapshot {
            cd,
            names: &names,
            jobs: &[],
            current: None,
        };
        provision(&snapshot) == Provision::Settled
    }

    fn next_step(cd: &ClusterDeployment, current: Option<&Job>) -> AttemptStep {
        let names = Names::of(cd);
        let snapshot = Snapshot {
            cd,
            names: &names,
            jobs: &[],
            current,
        };
        match provision(&snapshot) {
            Provision::Attempt { next, .. } => next,
            Provision::Settled => panic!("settled"),
        }
    }

    fn set_status(cd: &mut ClusterDeployment, change: impl FnOnce(&mut ClusterDeploymentStatus)) {
        change(cd.status.get_or_insert_with(Default::default));
    }

    #[test]
    fn the_finalizer_goes_on_first() {
        let mut fresh = provisioned();
        fresh.metadata.finalizers = None;
        assert!(!has_finalizer(&fresh));
        assert!(has_finalizer(&provisioned()));
    }

    #[test]
    fn an_installed_or_stopped_cluster_is_settled() {
        let mut installed = provisioned();
        set_status(&mut installed, |s| s.installed = true);
        assert!(is_settled(&installed));
        let mut stopped = provisioned();
        set_status(&mut stopped, |s| {
            s.conditions.push(Condition {
                type_: "ProvisionStopped".into(),
                status: "True".into(),
                reason: "InstallAttemptsLimitReached".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
            })
        });
        assert!(is_settled(&stopped));
        assert!(!is_settled(&provisioned()));
    }

    #[test]
    fn the_installer_job_state_decides_the_next_step() {
        let cd = provisioned();
        assert_eq!(next_step(&cd, None), AttemptStep::Start);
        assert_eq!(next_step(&cd, Some(&job("j", None))), AttemptStep::Wait);
        assert_eq!(
            next_step(&cd, Some(&job("j", Some("Complete")))),
            AttemptStep::Succeeded
        );
        assert_eq!(
            next_step(&cd, Some(&job("j", Some("Failed")))),
            AttemptStep::Failed(Outcome::InstallFailed {
                attempts: 1,
                limit: 3,
                timed_out: false,
                ended: None,
            })
        );
        let mut late = job("j", Some("Failed"));
        late.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].reason = Some("DeadlineExceeded".into());
        assert_eq!(
            next_step(&cd, Some(&late)),
            AttemptStep::Failed(Outcome::InstallFailed {
                attempts: 1,
                limit: 3,
                timed_out: true,
                ended: None,
            })
        );
    }

    #[test]
    fn failed_attempts_count_up_to_the_limit_which_is_at_least_one() {
        let mut cd = provisioned();
        set_status(&mut cd, |s| s.install_restarts = 1);
        cd.spec.install_attempts_limit = Some(2);
        let failed = |attempts, limit| Outcome::InstallFailed {
            attempts,
            limit,
            timed_out: false,
            ended: None,
        };
        assert_eq!(failed_attempt(&cd, false), failed(2, 2));
        cd.spec.install_attempts_limit = Some(0);
        assert_eq!(failed_attempt(&cd, false), failed(2, 1));
    }

    #[test]
    fn earlier_attempts_jobs_go_and_the_current_and_destroy_jobs_stay() {
        let mut cd = provisioned();
        set_status(&mut cd, |s| s.install_restarts = 1);
        let names = Names::of(&cd);
        let mut leaving = job(&Names::install_job(&cd, 0), Some("Failed"));
        leaving.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        let jobs = [
            job(&Names::install_job(&cd, 0), Some("Failed")),
            job(&Names::install_job(&cd, 1), None),
            job(&names.destroy, None),
            leaving,
        ];
        let Provision::Attempt { stale, .. } = provision(&Snapshot {
            cd: &cd,
            names: &names,
            jobs: &jobs,
            current: Some(&jobs[1]),
        }) else {
            panic!("not settled");
        };
        assert_eq!(
            stale,
            vec![&jobs[0]],
            "only the earlier attempt not already being deleted"
        );
    }

    #[test]
    fn inputs_are_read_config_credentials_pull_secret_in_that_order() {
        assert_eq!(
            input_refs(&provisioned()),
            vec![
                ("install config", "c1-install-config".to_string()),
                ("credentials", "creds".to_string()),
                ("pull secret", "pull".to_string()),
            ]
        );
        assert!(input_refs(&cd(json!({}))).is_empty());
    }

    #[test]
    fn missing_inputs_stop_provisioning_and_name_each() {
        let cd = provisioned();
        let read = vec![
            (
                "install config",
                "c1-install-config".into(),
                Some(secret(&[("install-config.yaml", "x")])),
            ),
            ("credentials", "creds".into(), None),
            ("pull secret", "pull".into(), None),
        ];
        assert_eq!(
            inputs(&cd, read, usize::MAX),
            Err(Outcome::MissingInputs(vec![
                "credentials Secret c1/creds".into(),
                "pull secret Secret c1/pull".into()
            ]))
        );
    }

    #[test]
    fn a_cluster_without_provisioning_cannot_start() {
        let bare = cd(json!({"pullSecretRef": {"name": "pull"}}));
        let read = vec![("pull secret", "pull".into(), None)];
        assert_eq!(
            inputs(&bare, read, usize::MAX),
            Err(Outcome::MissingInputs(vec![
                "pull secret Secret c1/pull".into(),
                "spec.provisioning".into()
            ]))
        );
    }

    #[test]
    fn a_rendered_configuration_error_stops_provisioning() {
        let read = vec![(
            "install config",
            "c1-install-config".into(),
            Some(secret(&[(INVALID_KEY, "zone and root volume")])),
        )];
        assert_eq!(
            inputs(&provisioned(), read, usize::MAX),
            Err(Outcome::InvalidMachineSpec("zone and root volume".into()))
        );
    }

    #[test]
    fn present_inputs_are_merged_in_order() {
        let read = vec![
            (
                "install config",
                "a".into(),
                Some(secret(&[("install-config.yaml", "x"), ("k", "1")])),
            ),
            ("credentials", "b".into(), Some(secret(&[("k", "2")]))),
        ];
        let started = inputs(&provisioned(), read, usize::MAX).unwrap();
        assert_eq!(started.data["k"], ByteString(b"2".to_vec()));
        assert_eq!(started.data.len(), 2);
        assert_eq!(started.installer_image, "installer:1");
    }

    const KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: m\n  cluster:\n    server: https://api.c1:6443\n\
                              users:\n- name: m\n  user:\n    token: t\ncontexts:\n- name: m\n  context:\n    cluster: m\n    user: m\n\
                              current-context: m\n";

    #[test]
    fn a_succeeded_job_waits_for_both_output_keys() {
        assert!(matches!(output(None), Output::Pending));
        assert!(matches!(
            output(Some(&secret(&[("kubeconfig", KUBECONFIG)]))),
            Output::Pending
        ));
        assert!(matches!(
            output(Some(&secret(&[("metadata.json", "{}")]))),
            Output::Pending
        ));
    }

    #[test]
    fn an_inline_kubeconfig_is_accepted_with_the_infra_id() {
        let Output::Accepted { kubeconfig, infra_id } = output(Some(&secret(&[
            ("kubeconfig", KUBECONFIG),
            ("metadata.json", r#"{"infraID": "c1-abc"}"#),
        ]))) else {
            panic!("accepted");
        };
        assert_eq!(kubeconfig, KUBECONFIG);
        assert_eq!(infra_id.as_deref(), Some("c1-abc"));
        let Output::Accepted { infra_id, .. } = output(Some(&secret(&[
            ("kubeconfig", KUBECONFIG),
            ("metadata.json", "not json"),
        ]))) else {
            panic!("accepted");
        };
        assert_eq!(infra_id, None);
    }

    #[test]
    fn an_output_key_larger_than_stackd_reads_is_refused_unparsed() {
        let huge = format!("{KUBECONFIG}# {}\n", "x".repeat(300 * 1024));
        let found = secret(&[("kubeconfig", huge.as_str()), ("metadata.json", "{}")]);
        let Output::TooLarge(refusal) = output(Some(&found)) else {
            panic!("refused");
        };
        assert!(
            refusal.starts_with("key kubeconfig of the installer's output Secret is")
                && refusal.ends_with("stackd reads at most 262144"),
            "{refusal}"
        );
        let metadata = "m".repeat(65 * 1024);
        let found = secret(&[("kubeconfig", KUBECONFIG), ("metadata.json", metadata.as_str())]);
        assert!(matches!(output(Some(&found)), Output::TooLarge(r) if r.contains("metadata.json")));
    }

    #[test]
    fn an_installer_kubeconfig_that_runs_a_command_is_refused() {
        let exec = KUBECONFIG.replace(
            "    token: t\n",
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n",
        );
        let found = secret(&[("kubeconfig", exec.as_str()), ("metadata.json", "{}")]);
        let Output::Refused(refusal) = output(Some(&found)) else {
            panic!("refused");
        };
        assert!(refusal.to_string().contains("exec"));
    }

    fn teardown<'a>(
        cd: &'a ClusterDeployment,
        names: &'a Names,
        jobs: &'a [Job],
        output: Option<&'a Secret>,
        destroy: Option<&'a Job>,
    ) -> Deprovision<'a> {
        deprovision(&Teardown {
            cd,
            names,
            jobs,
            output,
            destroy,
        })
    }

    fn next_of(plan: Deprovision<'_>) -> Destroy<'_> {
        match plan {
            Deprovision::Proceed { next, .. } => next,
            Deprovision::NotHeld => panic!("held"),
        }
    }

    #[test]
    fn without_our_finalizer_deletion_is_not_ours_to_hold() {
        let mut cd = provisioned();
        cd.metadata.finalizers = None;
        let names = Names::of(&cd);
        assert_eq!(teardown(&cd, &names, &[], None, None), Deprovision::NotHeld);
    }

    #[test]
    fn deletion_stops_every_installer_but_the_destroy_job() {
        let cd = provisioned();
        let names = Names::of(&cd);
        let jobs = [job(&Names::install_job(&cd, 0), None), job(&names.destroy, None)];
        let Deprovision::Proceed { stop, .. } = teardown(&cd, &names, &jobs, None, None) else {
            panic!("held");
        };
        assert_eq!(stop, vec![&jobs[0]]);
    }

    #[test]
    fn a_cluster_with_installer_state_is_destroyed_before_anything_is_released() {
        let cd = provisioned();
        let names = Names::of(&cd);
        let state = secret(&[("metadata.json", "{}")]);
        assert_eq!(
            next_of(teardown(&cd, &names, &[], Some(&state), None)),
            Destroy::Start("installer:1".into())
        );
        let running = job(&names.destroy, None);
        assert_eq!(
            next_of(teardown(&cd, &names, &[], Some(&state), Some(&running))),
            Destroy::Wait
        );
        let failed = job(&names.destroy, Some("Failed"));
        assert_eq!(
            next_of(teardown(&cd, &names, &[], Some(&state), Some(&failed))),
            Destroy::Retry(&failed)
        );
        let done = job(&names.destroy, Some("Complete"));
        assert_eq!(
            next_of(teardown(&cd, &names, &[], Some(&state), Some(&done))),
            Destroy::Done
        );
    }

    #[test]
    fn a_cluster_the_installer_never_created_has_nothing_to_destroy() {
        let with_image = provisioned();
        let names = Names::of(&with_image);
        let empty = secret(&[]);
        assert_eq!(
            next_of(teardown(&with_image, &names, &[], Some(&empty), None)),
            Destroy::Done
        );
        assert_eq!(next_of(teardown(&with_image, &names, &[], None, None)), Destroy::Done);
        let no_image = cd(json!({}));
        let state = secret(&[("metadata.json", "{}")]);
        assert_eq!(
            next_of(teardown(&no_image, &names, &[], Some(&state), None)),
            Destroy::Done
        );
    }

    #[test]
    fn a_pool_cluster_releases_its_cdc_and_hosts_to_the_pool() {
        assert_eq!(
            release(&pool_cd(true, true), true),
            Release {
                refused: false,
                customization: Some(("team".into(), "cdc-1".into(), "p".into())),
                hosts_namespace: Some("team".into()),
            }
        );
    }

    #[test]
    fn a_pool_reference_alone_releases_nothing_and_says_so() {
        assert_eq!(
            release(&pool_cd(true, true), false),
            Release {
                refused: true,
                customization: None,
                hosts_namespace: None,
            }
        );
    }

    #[test]
    fn a_hand_made_cluster_releases_its_hosts_in_its_own_namespace() {
        let by_hand = cd(json!({"hosts": [{"name": "host-1", "role": "worker"}]}));
        assert_eq!(
            release(&by_hand, false),
            Release {
                refused: false,
                customization: None,
                hosts_namespace: Some("c1".into()),
            }
        );
    }

    #[test]
    fn a_cluster_without_hosts_or_cdc_releases_neither() {
        assert_eq!(
            release(&pool_cd(false, false), true),
            Release {
                refused: false,
                customization: None,
                hosts_namespace: None,
            }
        );
    }
}
