//! Each tenant namespace's share of its tenant's host quota (DESIGN.md §8, fairness): the host pods
//! stackd runs for one tenant namespace (stack controllers, install Jobs, pool installer Jobs) may
//! request at most a share of the tenant's ResourceQuota (`--namespace-max-cpu`,
//! `--namespace-max-memory`; half of `--tenant-quota` by default), so that one namespace cannot
//! fill the quota and leave the tenant's other namespaces' installs pending for ever.
//!
//! Checked by stackd before it creates (or grows) a Deployment or Job, against what the namespace's
//! other host workloads request now, as the tenant's host caches show them. Containers that set no
//! request count at the LimitRange's default (`--tenant-container-defaults`), as the host's quota
//! counts them.

use std::collections::HashSet;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use kube::ResourceExt;

use super::labels::PARENT_NAMESPACE_LABEL;
use super::quota::{ContainerDefaults, TenantQuota, nanos};
use crate::runtime::memory_budget::ByteSize;

/// The resources shared: those a pod's requests take from the quota.
const RESOURCES: [Resource; 2] = [
    Resource {
        name: "cpu",
        flag: "--namespace-max-cpu",
    },
    Resource {
        name: "memory",
        flag: "--namespace-max-memory",
    },
];

/// The reason of the condition and Event of a workload refused for its namespace's share.
pub const REASON: &str = "NamespaceQuotaShareExceeded";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Resource {
    name: &'static str,
    flag: &'static str,
}

/// A namespace's share of `resource` in billionths: the flag, or half of the tenant quota's request
/// bound (`None` when the tenant quota bounds no requests of it).
fn share_of(quota: &TenantQuota, resource: &str) -> Option<i128> {
    if let Some(flag) = quota.namespace_share.of(resource) {
        return nanos(flag);
    }
    let hard = &quota.hard.0;
    let tenant = hard
        .get(&format!("requests.{resource}"))
        .or_else(|| hard.get(resource))
        .and_then(|q| nanos(q))?;
    Some(tenant / 2)
}

/// What a pod's containers request of each shared resource, in billionths (indexed as
/// [`RESOURCES`]).
pub type Requests = [i128; 2];

/// What one container requests of `resource`: its request, else its limit (the API server sets
/// the request to the limit), else the LimitRange's default.
fn container_request(container: &Container, resource: &str, defaults: &ContainerDefaults) -> i128 {
    let resources = container.resources.as_ref();
    let set = |list: Option<
        &std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { list.and_then(|l| l.get(resource)).and_then(|q| nanos(&q.0)) };
    set(resources.and_then(|r| r.requests.as_ref()))
        .or_else(|| set(resources.and_then(|r| r.limits.as_ref())))
        .or_else(|| defaults.requests.get(resource).and_then(|q| nanos(q)))
        .unwrap_or(0)
        .max(0)
}

/// What one pod requests, as the scheduler and the quota count it: its containers together, or its
/// largest init container if that is more.
pub fn pod_requests(pod: &PodSpec, defaults: &ContainerDefaults) -> Requests {
    RESOURCES.map(|resource| {
        let containers: i128 = pod
            .containers
            .iter()
            .map(|c| container_request(c, resource.name, defaults))
            .sum();
        let init = pod
            .init_containers
            .iter()
            .flatten()
            .map(|c| container_request(c, resource.name, defaults))
            .max()
            .unwrap_or(0);
        containers.max(init)
    })
}

fn times(requests: Requests, pods: i128) -> Requests {
    requests.map(|amount| amount.saturating_mul(pods))
}

/// What a Deployment's pods request: its replicas' worth.
pub fn deployment_requests(deployment: &Deployment, defaults: &ContainerDefaults) -> Requests {
    let Some(spec) = &deployment.spec else {
        return [0; 2];
    };
    let pod = spec.template.spec.as_ref().map(|p| pod_requests(p, defaults));
    times(pod.unwrap_or_default(), i128::from(spec.replicas.unwrap_or(1).max(0)))
}

/// What a Job's pods request while it runs; nothing once it finished.
pub fn job_requests(job: &Job, defaults: &ContainerDefaults) -> Requests {
    let finished = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True")
        });
    let Some(spec) = job.spec.as_ref().filter(|_| !finished) else {
        return [0; 2];
    };
    let pod = spec.template.spec.as_ref().map(|p| pod_requests(p, defaults));
    times(
        pod.unwrap_or_default(),
        i128::from(spec.parallelism.unwrap_or(1).max(0)),
    )
}

/// A workload refused because its namespace's host workloads would request more than the
/// namespace's share of the tenant's host quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareExceeded {
    /// What was refused, e.g. "the stack's controller Deployment".
    pub what: String,
    pub namespace: String,
    resource: Resource,
    wanted: i128,
    others: i128,
    share: i128,
}

impl ShareExceeded {
    pub fn reason(&self) -> &'static str {
        REASON
    }
}

impl fmt::Display for ShareExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Resource { name, flag } = self.resource;
        write!(
            f,
            "{} requests {} of {name}, and the other host workloads of namespace {} request {}: over the namespace's share of the tenant's host quota, {} of {name} ({flag}), so stackd does not create it. Lower its requests or remove other workloads of the namespace (the tenant's other namespaces install as before); the host's operator sets the share",
            self.what,
            shown(name, self.wanted),
            self.namespace,
            shown(name, self.others),
            shown(name, self.share)
        )
    }
}

/// A quantity for people: CPU in cores or millicores, memory in binary units.
fn shown(resource: &str, amount: i128) -> String {
    if resource == "cpu" {
        return if amount % 1_000_000_000 == 0 {
            format!("{}", amount / 1_000_000_000)
        } else {
            format!("{}m", amount / 1_000_000)
        };
    }
    ByteSize(u64::try_from(amount / 1_000_000_000).unwrap_or(u64::MAX)).to_string()
}

/// The tenant namespace whose share a host workload takes, when it is not its parent's: the
/// installer of a pool's cluster, whose namespace stackd made for the pool, takes its pool's
/// namespace's share (else a pool would get one share per cluster it makes).
pub const SHARE_NAMESPACE_LABEL: &str = "stackd.dev/share-namespace";

/// The tenant namespace whose share a workload labelled `labels` takes.
fn share_label(labels: &std::collections::BTreeMap<String, String>) -> Option<String> {
    labels
        .get(SHARE_NAMESPACE_LABEL)
        .or_else(|| labels.get(PARENT_NAMESPACE_LABEL))
        .cloned()
}

/// One host workload of the tenant: its name, tenant namespace (label) and requests.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    pub namespace_label: Option<String>,
    pub requests: Requests,
}

/// Whether a workload of tenant namespace `namespace` (labelled `label`) named `own` requesting
/// `wanted` fits the namespace's share beside `others` (the tenant's host workloads; `own`'s
/// current copy among them is not counted).
pub fn admit(
    quota: &TenantQuota,
    what: &str,
    namespace: &str,
    label: &str,
    own: &str,
    wanted: Requests,
    others: &[Workload],
) -> Result<(), Box<ShareExceeded>> {
    let same_namespace: Vec<&Workload> = others
        .iter()
        .filter(|w| w.namespace_label.as_deref() == Some(label) && w.name != own)
        .collect();
    for (index, resource) in RESOURCES.iter().enumerate() {
        let Some(share) = share_of(quota, resource.name) else {
            continue;
        };
        let others: i128 = same_namespace.iter().map(|w| w.requests[index]).sum();
        if wanted[index] > 0 && others.saturating_add(wanted[index]) > share {
            return Err(Box::new(ShareExceeded {
                what: what.to_string(),
                namespace: namespace.to_string(),
                resource: *resource,
                wanted: wanted[index],
                others,
                share,
            }));
        }
    }
    Ok(())
}

/// One host workload of the tenant as a cache shows it.
pub fn workload<K: kube::Resource + RunsPods>(object: &K, defaults: &ContainerDefaults) -> Workload {
    let meta = object.meta();
    Workload {
        name: meta.name.clone().unwrap_or_default(),
        namespace_label: meta.labels.as_ref().and_then(share_label),
        requests: object.requests(defaults),
    }
}

/// How long a workload admitted counts on its own if the caches never show it (its create failed).
const ADMITTED_KEPT: Duration = Duration::from_secs(30);

/// The workloads one tenant's controllers admitted lately: counted with those the caches show, since
/// a create takes a moment to come back through the watch, and two admitted in that moment (two
/// clusters of one pool) must not both take the last of a share. Checks are made one at a time.
#[derive(Default)]
pub struct Admitted(Mutex<Vec<(Instant, Workload)>>);

impl Admitted {
    /// Whether `desired` (a Deployment or Job stackd is about to create, or to replace `current`
    /// with, for tenant namespace `namespace`, stamped with its parent's labels) fits the
    /// namespace's share of the tenant's host quota beside the tenant's host workloads: those
    /// `cached` shows (read only when it grows), and those admitted lately that it does not show
    /// yet. What asks no more than it has now is never refused; what is admitted is recorded.
    /// `what` names it in the refusal.
    pub fn check<K>(
        &self,
        quota: &TenantQuota,
        cached: impl FnOnce() -> Vec<Workload>,
        what: &str,
        namespace: &str,
        desired: &K,
        current: Option<&K>,
    ) -> Result<(), Box<ShareExceeded>>
    where
        K: kube::Resource + RunsPods,
    {
        let wanted = desired.requests(&quota.container_defaults);
        if let Some(current) = current {
            let has = current.requests(&quota.container_defaults);
            if wanted.iter().zip(has).all(|(wanted, has)| *wanted <= has) {
                return Ok(());
            }
        }
        let mut admitted = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        admitted.retain(|(at, _)| now.duration_since(*at) < ADMITTED_KEPT);
        let mut others = cached();
        let shown: HashSet<String> = others.iter().map(|w| w.name.clone()).collect();
        let pending = admitted.iter().filter(|(_, w)| !shown.contains(&w.name));
        others.extend(pending.map(|(_, w)| w.clone()));
        let label = share_label(desired.labels()).unwrap_or_default();
        let name = desired.name_any();
        admit(quota, what, namespace, &label, &name, wanted, &others)?;
        admitted.retain(|(_, w)| w.name != name);
        admitted.push((now, workload(desired, &quota.container_defaults)));
        Ok(())
    }

    /// The caches showed the workload `name` (made, changed or gone): from now on they tell what it
    /// takes, so the record of its admission is dropped.
    pub fn seen(&self, name: &str) {
        let mut admitted = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !admitted.is_empty() {
            admitted.retain(|(_, w)| w.name != name);
        }
    }
}

/// A host object that runs pods.
pub trait RunsPods {
    fn requests(&self, defaults: &ContainerDefaults) -> Requests;
}

impl RunsPods for Deployment {
    fn requests(&self, defaults: &ContainerDefaults) -> Requests {
        deployment_requests(self, defaults)
    }
}

impl RunsPods for Job {
    fn requests(&self, defaults: &ContainerDefaults) -> Requests {
        job_requests(self, defaults)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::*;

    fn container(requests: &[(&str, &str)], limits: &[(&str, &str)]) -> Container {
        let list = |pairs: &[(&str, &str)]| {
            (!pairs.is_empty()).then(|| {
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect::<BTreeMap<_, _>>()
            })
        };
        Container {
            name: "c".into(),
            resources: Some(ResourceRequirements {
                requests: list(requests),
                limits: list(limits),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn quota() -> TenantQuota {
        TenantQuota::default()
    }

    const CPU: i128 = 1_000_000_000;
    const MI: i128 = (1 << 20) * 1_000_000_000;

    #[test]
    fn containers_that_set_no_request_count_at_the_limit_range_default() {
        let defaults = quota().container_defaults;
        let pod = PodSpec {
            containers: vec![
                container(&[("cpu", "7900m")], &[]),
                container(&[], &[("memory", "1Gi")]),
                container(&[], &[]),
            ],
            init_containers: Some(vec![container(&[("cpu", "9")], &[])]),
            ..Default::default()
        };
        let [cpu, memory] = pod_requests(&pod, &defaults);
        assert_eq!(cpu, 9 * CPU, "the largest init container is more than the containers");
        assert_eq!(memory, 128 * MI + 1024 * MI + 128 * MI);
        let pod = PodSpec {
            containers: vec![container(&[], &[]), container(&[], &[])],
            ..Default::default()
        };
        assert_eq!(pod_requests(&pod, &defaults), [200 * CPU / 1000, 256 * MI]);
    }

    #[test]
    fn the_default_share_is_half_the_tenant_quota_and_the_flags_set_it() {
        let mut quota = quota();
        assert_eq!(share_of(&quota, "cpu"), Some(4 * CPU));
        assert_eq!(share_of(&quota, "memory"), Some(8 * 1024 * MI));
        quota.namespace_share.cpu = Some("500m".into());
        assert_eq!(share_of(&quota, "cpu"), Some(CPU / 2));
        assert!(super::super::quota::share_quantity("0").is_err());
        assert!(super::super::quota::share_quantity("lots").is_err());
        assert_eq!(super::super::quota::share_quantity(" 2 "), Ok("2".into()));
    }

    fn workload(name: &str, namespace: &str, cpu: i128) -> Workload {
        Workload {
            name: name.into(),
            namespace_label: Some(namespace.into()),
            requests: [cpu, 0],
        }
    }

    #[test]
    fn a_namespace_is_refused_past_its_share_and_other_namespaces_are_not() {
        let quota = quota();
        let others = [
            workload("team.a", "team", 3 * CPU),
            workload("team.b", "team", CPU / 2),
            workload("other.c", "other", 3 * CPU),
        ];
        let what = "the stack's controller Deployment";
        let refused = admit(&quota, what, "team", "team", "team.new", [CPU, 0], &others).unwrap_err();
        let message = refused.to_string();
        assert!(message.contains("requests 1 of cpu"), "{message}");
        assert!(message.contains("request 3500m"), "{message}");
        assert!(message.contains("4 of cpu (--namespace-max-cpu)"), "{message}");
        assert_eq!(refused.reason(), "NamespaceQuotaShareExceeded");
        assert_eq!(
            admit(&quota, what, "team", "team", "team.a", [3 * CPU, 0], &others),
            Ok(()),
            "its own current copy is not counted twice"
        );
        assert_eq!(
            admit(&quota, what, "fresh", "fresh", "fresh.x", [CPU, 0], &others),
            Ok(())
        );
        let refused = admit(&quota, what, "fresh", "fresh", "fresh.x", [7900 * CPU / 1000, 0], &[]).unwrap_err();
        assert!(refused.to_string().contains("7900m"), "{refused}");
    }

    #[test]
    fn finished_jobs_and_scaled_down_deployments_request_nothing() {
        let defaults = quota().container_defaults;
        let pod = PodSpec {
            containers: vec![container(&[("cpu", "1")], &[])],
            ..Default::default()
        };
        let mut job = Job {
            spec: Some(k8s_openapi::api::batch::v1::JobSpec {
                template: k8s_openapi::api::core::v1::PodTemplateSpec {
                    spec: Some(pod.clone()),
                    ..Default::default()
                },
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(job_requests(&job, &defaults)[0], CPU);
        job.status = Some(k8s_openapi::api::batch::v1::JobStatus {
            conditions: Some(vec![k8s_openapi::api::batch::v1::JobCondition {
                type_: "Complete".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert_eq!(job_requests(&job, &defaults), [0, 0]);
        let deployment = Deployment {
            spec: Some(k8s_openapi::api::apps::v1::DeploymentSpec {
                replicas: Some(3),
                template: k8s_openapi::api::core::v1::PodTemplateSpec {
                    spec: Some(pod),
                    ..Default::default()
                },
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(deployment_requests(&deployment, &defaults)[0], 3 * CPU);
    }
}
