//! Fairness on a shared host (DESIGN.md §8): every tenant's host namespace gets a ResourceQuota
//! (`--tenant-quota`) and a LimitRange giving containers default requests and limits
//! (`--tenant-container-defaults`), so one tenant's stacks and installers cannot take the host from
//! the others, and pods that set no resources still fit a quota on CPU and memory. Both objects are
//! written with the ownership proof of DESIGN.md §2 and put back when edited or deleted (looked at
//! every sweep interval).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::str::FromStr;

use k8s_openapi::api::core::v1::{LimitRange, LimitRangeItem, LimitRangeSpec, ResourceQuota, ResourceQuotaSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::apply::Applied;
use super::labels::{MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL, tenant_selector};
use super::names::label_value;
use crate::runtime::api_errors::is_conflict;

/// Name of the ResourceQuota in every tenant's host namespace.
pub const QUOTA_NAME: &str = "stackd-tenant-quota";
/// Name of the LimitRange in every tenant's host namespace.
pub const LIMIT_RANGE_NAME: &str = "stackd-tenant-limits";
/// `--tenant-quota` when not given.
/// Node disk (`ephemeral-storage`: emptyDirs, logs, writable layers) is shared like CPU and memory.
pub const DEFAULT_QUOTA: &str = "pods=50,requests.cpu=8,requests.memory=16Gi,requests.ephemeral-storage=20Gi,\
     limits.cpu=16,limits.memory=32Gi,limits.ephemeral-storage=50Gi,count/jobs.batch=50,secrets=200";
/// `--tenant-container-defaults` when not given.
pub const DEFAULT_CONTAINER_DEFAULTS: &str = "requests.cpu=100m,requests.memory=128Mi,requests.ephemeral-storage=100Mi,\
     limits.cpu=1,limits.memory=512Mi,limits.ephemeral-storage=1Gi";

/// What every tenant's host namespace is limited to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantQuota {
    /// The ResourceQuota's `spec.hard`.
    pub hard: ResourceList,
    pub container_defaults: ContainerDefaults,
    /// What one tenant namespace's host workloads may request of it (`--namespace-max-cpu`,
    /// `--namespace-max-memory`; see [`super::quota_share`]).
    pub namespace_share: NamespaceShare,
}

impl Default for TenantQuota {
    fn default() -> Self {
        TenantQuota {
            hard: DEFAULT_QUOTA.parse().unwrap_or_default(),
            container_defaults: DEFAULT_CONTAINER_DEFAULTS.parse().unwrap_or_default(),
            namespace_share: NamespaceShare::default(),
        }
    }
}

/// `--namespace-max-cpu` and `--namespace-max-memory`: quantities, or `None` for half of the
/// tenant quota's `requests.cpu` and `requests.memory`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceShare {
    pub cpu: Option<String>,
    pub memory: Option<String>,
}

impl NamespaceShare {
    pub(crate) fn of(&self, resource: &str) -> Option<&str> {
        match resource {
            "cpu" => self.cpu.as_deref(),
            _ => self.memory.as_deref(),
        }
    }
}

/// A `--namespace-max-*` value, checked.
pub fn share_quantity(text: &str) -> Result<String, String> {
    let text = text.trim();
    match nanos(text) {
        Some(amount) if amount > 0 => Ok(text.to_string()),
        _ => Err(format!(
            "{text:?} is not a Kubernetes quantity above zero such as 4, 500m or 8Gi"
        )),
    }
}

/// `NAME=QUANTITY,...`, e.g. `pods=50,requests.cpu=8`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceList(pub BTreeMap<String, String>);

impl FromStr for ResourceList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut list = BTreeMap::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((name, quantity)) = entry.split_once('=') else {
                return Err(format!("expected NAME=QUANTITY, got {entry:?}"));
            };
            let (name, quantity) = (name.trim(), quantity.trim());
            if name.is_empty() || name.contains(char::is_whitespace) {
                return Err(format!("{entry:?} names no resource"));
            }
            if nanos(quantity).is_none() {
                return Err(format!(
                    "{quantity:?} (for {name}) is not a Kubernetes quantity such as 8, 500m or 16Gi"
                ));
            }
            if list.insert(name.to_string(), quantity.to_string()).is_some() {
                return Err(format!("{name} is given twice"));
            }
        }
        if list.is_empty() {
            return Err("expected at least one NAME=QUANTITY".into());
        }
        Ok(ResourceList(list))
    }
}

/// `requests.NAME=QUANTITY,limits.NAME=QUANTITY,...`: the LimitRange's default requests and limits of
/// a container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerDefaults {
    pub requests: BTreeMap<String, String>,
    pub limits: BTreeMap<String, String>,
}

impl FromStr for ContainerDefaults {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ResourceList(all) = s.parse()?;
        let mut defaults = ContainerDefaults::default();
        for (name, quantity) in all {
            if let Some(resource) = name.strip_prefix("requests.") {
                defaults.requests.insert(resource.to_string(), quantity);
            } else if let Some(resource) = name.strip_prefix("limits.") {
                defaults.limits.insert(resource.to_string(), quantity);
            } else {
                return Err(format!("{name} must start with requests. or limits."));
            }
        }
        for (resource, request) in &defaults.requests {
            let limit = defaults.limits.get(resource);
            if limit.is_some_and(|limit| nanos(request) > nanos(limit)) {
                return Err(format!(
                    "the default request of {resource} ({request}) is above its default limit"
                ));
            }
        }
        Ok(defaults)
    }
}

/// A Kubernetes quantity (`8`, `500m`, `16Gi`, `1e3`) in billionths, to compare quantities the API
/// server may have rewritten in canonical form (`0.5` comes back as `500m`).
pub fn nanos(quantity: &str) -> Option<i128> {
    let split = quantity
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(quantity.len());
    let (number, suffix) = quantity.split_at(split);
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty()) || !all_digits(whole) || !all_digits(fraction) || fraction.len() > 9 {
        return None;
    }
    let whole: i128 = if whole.is_empty() { 0 } else { whole.parse().ok()? };
    let fraction: i128 = format!("{fraction:0<9}").parse().ok()?;
    let value = whole.checked_mul(1_000_000_000)?.checked_add(fraction)?;
    let scaled = scale(value, suffix)?;
    Some(if negative { -scaled } else { scaled })
}

fn scale(value: i128, suffix: &str) -> Option<i128> {
    let binary = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if let Some(power) = binary.iter().position(|s| *s == suffix) {
        return value.checked_mul(1i128 << (10 * (power + 1)));
    }
    let exponent: i32 = match suffix {
        "n" => -9,
        "u" => -6,
        "m" => -3,
        "" => 0,
        "k" => 3,
        "M" => 6,
        "G" => 9,
        "T" => 12,
        "P" => 15,
        "E" => 18,
        _ => suffix.strip_prefix(['e', 'E'])?.parse().ok()?,
    };
    let factor = 10i128.checked_pow(exponent.unsigned_abs())?;
    if exponent >= 0 {
        value.checked_mul(factor)
    } else {
        Some(value / factor)
    }
}

fn quantities(list: &BTreeMap<String, String>) -> BTreeMap<String, Quantity> {
    list.iter().map(|(k, v)| (k.clone(), Quantity(v.clone()))).collect()
}

/// True when both lists name the same resources with equal amounts.
fn same_amounts(a: Option<&BTreeMap<String, Quantity>>, b: Option<&BTreeMap<String, Quantity>>) -> bool {
    let (a, b) = (a.cloned().unwrap_or_default(), b.cloned().unwrap_or_default());
    a.len() == b.len()
        && a.iter().all(|(k, v)| {
            b.get(k)
                .is_some_and(|w| nanos(&v.0).is_some() && nanos(&v.0) == nanos(&w.0))
        })
}

fn labels(tenant: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (TENANT_LABEL.to_string(), label_value(tenant)),
    ])
}

/// The metadata of a per-tenant object of the host namespace (quota, limits, network policy).
pub(super) fn metadata(name: &str, namespace: &str, tenant: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(namespace.to_string()),
        labels: Some(labels(tenant)),
        ..ObjectMeta::default()
    }
}

/// The tenant's ResourceQuota.
pub fn desired_quota(tenant: &str, namespace: &str, quota: &TenantQuota) -> ResourceQuota {
    ResourceQuota {
        metadata: metadata(QUOTA_NAME, namespace, tenant),
        spec: Some(ResourceQuotaSpec {
            hard: Some(quantities(&quota.hard.0)),
            ..ResourceQuotaSpec::default()
        }),
        status: None,
    }
}

/// The tenant's LimitRange: default requests and limits for containers that set none.
pub fn desired_limit_range(tenant: &str, namespace: &str, quota: &TenantQuota) -> LimitRange {
    let defaults = &quota.container_defaults;
    LimitRange {
        metadata: metadata(LIMIT_RANGE_NAME, namespace, tenant),
        spec: Some(LimitRangeSpec {
            limits: vec![LimitRangeItem {
                type_: "Container".into(),
                default: (!defaults.limits.is_empty()).then(|| quantities(&defaults.limits)),
                default_request: (!defaults.requests.is_empty()).then(|| quantities(&defaults.requests)),
                ..LimitRangeItem::default()
            }],
        }),
    }
}

fn same_quota(existing: &ResourceQuota, desired: &ResourceQuota) -> bool {
    let hard = |q: &ResourceQuota| q.spec.as_ref().and_then(|s| s.hard.clone());
    let others = |q: &ResourceQuota| q.spec.as_ref().map(|s| (s.scopes.clone(), s.scope_selector.clone()));
    same_amounts(hard(existing).as_ref(), hard(desired).as_ref())
        && others(existing).unwrap_or_default() == others(desired).unwrap_or_default()
}

fn same_limit_range(existing: &LimitRange, desired: &LimitRange) -> bool {
    let items = |l: &LimitRange| l.spec.as_ref().map(|s| s.limits.clone()).unwrap_or_default();
    let (existing, desired) = (items(existing), items(desired));
    existing.len() == desired.len()
        && existing.iter().zip(&desired).all(|(e, d)| {
            e.type_ == d.type_
                && same_amounts(e.default.as_ref(), d.default.as_ref())
                && same_amounts(e.default_request.as_ref(), d.default_request.as_ref())
                && [&e.max, &e.min, &e.max_limit_request_ratio].iter().all(|m| m.is_none())
        })
}

#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error(
        "{kind} {namespace}/{name} exists but was not created by stackd for this tenant; remove it so stackd can set the tenant's limits and isolation"
    )]
    Foreign {
        kind: String,
        namespace: String,
        name: String,
    },
    #[error("host API error: {0}")]
    Api(#[from] kube::Error),
}

/// Creates `desired`, or brings our existing copy (`observed`, from the watch cache) back to it with
/// its uid and resourceVersion as preconditions; an object at that name that is not ours is left
/// alone.
pub(super) async fn ensure<K>(
    api: &Api<K>,
    desired: &K,
    observed: Option<&K>,
    tenant: &str,
    same: fn(&K, &K) -> bool,
) -> Result<Applied, QuotaError>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let params = PostParams {
        field_manager: Some("stackd/tenant".into()),
        ..PostParams::default()
    };
    let existing = match observed {
        Some(existing) => existing.clone(),
        None => match api.create(&params, desired).await {
            Ok(_) => return Ok(Applied::Created),
            Err(err) if is_conflict(&err) => api.get(&desired.name_any()).await?,
            Err(err) => return Err(err.into()),
        },
    };
    let wanted = labels(tenant);
    let found = existing.labels();
    if found.get(MANAGED_BY_LABEL) != wanted.get(MANAGED_BY_LABEL)
        || found.get(TENANT_LABEL) != wanted.get(TENANT_LABEL)
    {
        return Err(QuotaError::Foreign {
            kind: K::kind(&()).into_owned(),
            namespace: existing.namespace().unwrap_or_default(),
            name: existing.name_any(),
        });
    }
    if same(&existing, desired) {
        return Ok(Applied::Unchanged);
    }
    let mut replacement = desired.clone();
    replacement.meta_mut().uid = existing.meta().uid.clone();
    replacement.meta_mut().resource_version = existing.meta().resource_version.clone();
    api.replace(&desired.name_any(), &params, &replacement).await?;
    Ok(Applied::Updated)
}

/// The LimitRange first: once the quota counts CPU and memory, a pod without defaults is refused.
/// Both are read here, not from a watch (one label-selected list each, the objects the orphan
/// sweep's lists would see): only a host administrator changes them, and a watch of each per
/// tenant cost the host 2,000 watches at 1,000 tenants (issue 32).
pub async fn ensure_both(
    host: &Client,
    tenant: &str,
    namespace: &str,
    settings: &TenantQuota,
) -> Result<usize, QuotaError> {
    let ours = ListParams::default().labels(&tenant_selector(tenant));
    let api: Api<LimitRange> = Api::namespaced(host.clone(), namespace);
    let observed = named(api.list(&ours).await?.items, LIMIT_RANGE_NAME);
    let desired = desired_limit_range(tenant, namespace, settings);
    let limits = ensure(&api, &desired, observed.as_ref(), tenant, same_limit_range).await?;
    let api: Api<ResourceQuota> = Api::namespaced(host.clone(), namespace);
    let observed = named(api.list(&ours).await?.items, QUOTA_NAME);
    let desired = desired_quota(tenant, namespace, settings);
    let quota = ensure(&api, &desired, observed.as_ref(), tenant, same_quota).await?;
    Ok([limits, quota].iter().filter(|a| a.wrote()).count())
}

/// The object called `name` among `items`.
fn named<K: Resource>(items: Vec<K>, name: &str) -> Option<K> {
    items.into_iter().find(|item| item.meta().name.as_deref() == Some(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_compare_by_amount_not_spelling() {
        assert_eq!(nanos("0.5"), nanos("500m"));
        assert_eq!(nanos("1Gi"), nanos("1024Mi"));
        assert_eq!(nanos("1k"), nanos("1e3"));
        assert_eq!(nanos("16"), Some(16_000_000_000));
        assert_eq!(nanos("1E"), Some(1_000_000_000_000_000_000_000_000_000));
        for bad in ["", "abc", "1.2.3", "5 Gi", "1Q", "."] {
            assert_eq!(nanos(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_default_flags_parse() {
        let quota = TenantQuota::default();
        assert_eq!(quota.hard.0["pods"], "50");
        assert_eq!(quota.hard.0["count/jobs.batch"], "50");
        assert_eq!(quota.container_defaults.requests["cpu"], "100m");
        assert_eq!(quota.container_defaults.limits["memory"], "512Mi");
    }

    #[test]
    fn bad_flags_say_what_is_wrong() {
        let err = "pods=many".parse::<ResourceList>().unwrap_err();
        assert!(err.contains("pods"), "{err}");
        assert!("pods".parse::<ResourceList>().is_err());
        assert!("".parse::<ResourceList>().is_err());
        assert!("pods=1,pods=2".parse::<ResourceList>().is_err());
        let err = "cpu=1".parse::<ContainerDefaults>().unwrap_err();
        assert!(err.contains("requests."), "{err}");
        let err = "requests.cpu=2,limits.cpu=1".parse::<ContainerDefaults>().unwrap_err();
        assert!(err.contains("above"), "{err}");
    }

    #[test]
    fn a_canonicalised_copy_is_unchanged_and_an_edited_one_is_not() {
        let quota = TenantQuota {
            hard: "requests.cpu=0.5,pods=10".parse().unwrap(),
            container_defaults: "requests.memory=1024Mi".parse().unwrap(),
            ..TenantQuota::default()
        };
        let desired = desired_quota("acme", "ns", &quota);
        let mut canonical = desired.clone();
        let hard = |q: &mut ResourceQuota| q.spec.as_mut().and_then(|s| s.hard.as_mut()).cloned().unwrap();
        let mut edited = hard(&mut canonical);
        edited.insert("requests.cpu".into(), Quantity("500m".into()));
        canonical.spec.as_mut().unwrap().hard = Some(edited.clone());
        assert!(same_quota(&canonical, &desired));
        edited.insert("pods".into(), Quantity("11".into()));
        canonical.spec.as_mut().unwrap().hard = Some(edited);
        assert!(!same_quota(&canonical, &desired));

        let desired = desired_limit_range("acme", "ns", &quota);
        let mut canonical = desired.clone();
        canonical.spec.as_mut().unwrap().limits[0].default_request =
            Some(BTreeMap::from([("memory".to_string(), Quantity("1Gi".into()))]));
        assert!(same_limit_range(&canonical, &desired));
        canonical.spec.as_mut().unwrap().limits[0].max = Some(BTreeMap::new());
        assert!(!same_limit_range(&canonical, &desired));
    }
}
