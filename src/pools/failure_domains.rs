//! Failure domains of a pool (DESIGN.md §6): the domains in effect (discovered zones, then explicit
//! definitions that override them by name), the deterministic spreading of a new cluster's
//! control-plane machines, each machine's resolved domain (the record frozen on the cluster), the
//! contradictions a pool reports instead of creating clusters, and the OpenStack rendering in
//! openshift-install's own install-config shape.
//!
//! What openshift-install's OpenStack machine pools take (`controlPlane.platform.openstack`,
//! `compute[].platform.openstack`): `zones` (machine `i` goes to `zones[i % len]`; the compute
//! pool gets one MachineSet per zone) and `rootVolume.zones` (one zone for all, or as many as
//! `zones`); or, only with `featureSet: TechPreviewNoUpgrade` and never together with those two,
//! `failureDomains` (machine `i` goes to `failureDomains[i % len]`), each
//! `{computeAvailabilityZone, storageAvailabilityZone, portTargets}` where a port target is
//! `{id, network: {id, name}, fixedIPs: [{subnet: {id, name}}]}` and the one with id
//! `control-plane` replaces the machine's primary network. Ports exist only in the second shape, so
//! a pool whose machines have ports renders it.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::pools::{
    ClusterPoolSpec, FailureDomainDefinition, FailureDomainStatus, FailureDomainType, HostRole, MachineFailureDomain,
    MachinePlacement, PortOpts, ResourceFilter,
};

/// Annotation on a ClusterDeployment: SHA-256 of its `status.failureDomains` record.
pub(crate) const HASH_ANNOTATION: &str = "pools.stackd.dev/failure-domains-hash";
/// Key of the install-config Secret holding the record (JSON), the source it is restored from.
pub(crate) const RECORD_KEY: &str = "failure-domains.json";
/// Key of the install-config Secret saying why the machines cannot be placed (`InvalidMachineSpec`).
pub(crate) const INVALID_KEY: &str = "invalid-machine-spec";

/// The domains in effect for a pool: discovered zones (`zones`, the failure domains of its
/// assets, plus `spec.availabilityZones`) of type `AvailabilityZone`, then the explicit
/// definitions of type `Cluster`, which replace a discovered zone of the same name.
pub(crate) fn pool_domains<'a>(
    spec: &ClusterPoolSpec,
    zones: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<String, FailureDomainStatus> {
    let listed = &spec.control_plane_availability_zones;
    let omit = spec.control_plane_omit_availability_zone.unwrap_or(false);
    let mut domains = BTreeMap::new();
    let zones: Vec<&str> = zones.into_iter().collect();
    for zone in zones
        .into_iter()
        .chain(spec.availability_zones.iter().map(String::as_str))
    {
        if zone.is_empty() {
            continue;
        }
        // A non-empty list decides alone; otherwise the omit flag does.
        let control_plane = if listed.is_empty() {
            !omit
        } else {
            listed.iter().any(|z| z == zone)
        };
        domains.insert(
            zone.to_string(),
            FailureDomainStatus {
                control_plane,
                domain_type: FailureDomainType::AvailabilityZone,
            },
        );
    }
    for definition in &spec.failure_domains {
        domains.insert(
            definition.name.clone(),
            FailureDomainStatus {
                control_plane: definition.machine_placement == MachinePlacement::All,
                domain_type: FailureDomainType::Cluster,
            },
        );
    }
    domains
}

/// The domain of each of `count` control-plane machines: each next machine goes to the eligible
/// domain with the fewest machines of this cluster, then the fewest recorded across the pool
/// (`usage`), then the first by name. `None` when no domain is eligible.
pub(crate) fn spread(
    count: usize,
    domains: &BTreeMap<String, FailureDomainStatus>,
    usage: &BTreeMap<String, usize>,
) -> Vec<Option<String>> {
    let eligible: Vec<&String> = domains
        .iter()
        .filter(|(_, d)| d.control_plane)
        .map(|(n, _)| n)
        .collect();
    let mut mine: BTreeMap<&String, usize> = BTreeMap::new();
    (0..count)
        .map(|_| {
            let chosen = eligible.iter().min_by_key(|name| {
                (
                    mine.get(**name).copied().unwrap_or(0),
                    usage.get(name.as_str()).copied().unwrap_or(0),
                    name.as_str(),
                )
            })?;
            *mine.entry(chosen).or_default() += 1;
            Some((*chosen).clone())
        })
        .collect()
}

/// Control-plane machines recorded per domain across `records`.
pub(crate) fn usage<'a>(records: impl IntoIterator<Item = &'a MachineFailureDomain>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for record in records {
        if record.role == HostRole::Master {
            *counts.entry(record.name.clone()).or_default() += 1;
        }
    }
    counts
}

/// The feature set openshift-install accepts `failureDomains` in.
pub(crate) const TECH_PREVIEW: &str = "TechPreviewNoUpgrade";
/// Tags that make a port the machine's primary network (openshift-install's `control-plane` target).
const PRIMARY_TAGS: &[&str] = &["control_plane", "control-plane"];

/// The explicit definition behind domain `name`, if it is one (type `Cluster`).
fn definition<'a>(
    spec: &'a ClusterPoolSpec,
    domains: &BTreeMap<String, FailureDomainStatus>,
    name: &str,
) -> Option<&'a FailureDomainDefinition> {
    let explicit = domains
        .get(name)
        .is_some_and(|d| d.domain_type == FailureDomainType::Cluster);
    spec.failure_domains.iter().find(|d| explicit && d.name == name)
}

/// Why the pool's failure domains contradict themselves, if they do (§6 merge rules): a domain
/// control-plane machines may be placed in sets a storage zone while
/// `controlPlane.rootVolume.availabilityZone` is set, so such a machine's root volume would have
/// two zones. A pool in this state creates no cluster (each would be stopped with
/// `InvalidMachineSpec`) and says so.
pub(crate) fn contradiction(spec: &ClusterPoolSpec, domains: &BTreeMap<String, FailureDomainStatus>) -> Option<String> {
    spec.platform.openstack.as_ref()?;
    let volume = spec.control_plane.as_ref()?.root_volume.as_ref()?;
    let explicit = volume.availability_zone.as_ref()?;
    let clashing: Vec<String> = domains
        .iter()
        .filter(|(_, d)| d.control_plane)
        .filter_map(|(name, _)| definition(spec, domains, name))
        .filter_map(|d| {
            let zone = d.storage_availability_zone.as_ref()?;
            Some(format!("failure domain {} sets storageAvailabilityZone {zone}", d.name))
        })
        .collect();
    if clashing.is_empty() {
        return None;
    }
    Some(format!(
        "{} and controlPlane.rootVolume.availabilityZone is {explicit}: a control-plane machine placed there would have two root-volume zones; remove one of them",
        clashing.join(", ")
    ))
}

/// Resolves each placed control-plane machine into its record (merge rules of §6): the domain's
/// ports before the pool's, the domain's storage zone only with a root volume, and an error when
/// it would contradict an explicit root-volume zone.
pub(crate) fn control_plane_records(
    spec: &ClusterPoolSpec,
    domains: &BTreeMap<String, FailureDomainStatus>,
    placements: &[Option<String>],
) -> Result<Vec<MachineFailureDomain>, String> {
    let control_plane = spec.control_plane.clone().unwrap_or_default();
    let root_volume = control_plane.root_volume.as_ref();
    let mut records = Vec::new();
    for (index, placement) in placements.iter().enumerate() {
        let Some(name) = placement else { continue };
        let machine = format!("master-{index}");
        let (compute, storage, mut ports) = match definition(spec, domains, name) {
            Some(d) => (
                d.compute_availability_zone.clone(),
                d.storage_availability_zone.clone(),
                d.ports.clone(),
            ),
            None => (Some(name.clone()), None, Vec::new()),
        };
        let storage = match (root_volume, storage) {
            // Without a root volume there is nothing to place in a storage zone.
            (None, _) => None,
            (Some(volume), Some(zone)) => {
                if let Some(explicit) = &volume.availability_zone {
                    return Err(format!(
                        "machine {machine}: failure domain {name} sets storageAvailabilityZone {zone} and controlPlane.rootVolume.availabilityZone is {explicit}; remove one of them"
                    ));
                }
                Some(zone)
            }
            // Neither zone said: the volume goes where the machine goes (CAPO's fallback, and
            // what openshift-install wants written out when compute zones are).
            (Some(volume), None) => volume.availability_zone.clone().or_else(|| compute.clone()),
        };
        ports.extend(control_plane.ports.iter().cloned());
        records.push(MachineFailureDomain {
            machine,
            role: HostRole::Master,
            name: name.clone(),
            compute_availability_zone: compute,
            storage_availability_zone: storage,
            ports,
        });
    }
    Ok(records)
}

/// The record as JSON text, as kept in the install-config Secret.
#[allow(
    clippy::expect_used,
    reason = "derived Serialize of strings, enums and lists with no map keys cannot fail"
)]
pub(crate) fn record_text(records: &[MachineFailureDomain]) -> String {
    serde_json::to_string(records).expect("records serialize")
}

/// SHA-256 (hex) of a record, as written in the cluster's annotation.
pub(crate) fn record_hash(records: &[MachineFailureDomain]) -> String {
    hex::encode(Sha256::digest(record_text(records).as_bytes()))
}

/// Writes the machines' domains into an OpenStack install config in openshift-install's shape
/// (see the module doc): the control plane's `records` in machine order, and the compute pool spread
/// over every domain in name order (`NoControlPlane` ones included). An error when the shape needs
/// a feature set the install-config template refuses.
pub(crate) fn render_openstack(
    config: &mut Value,
    spec: &ClusterPoolSpec,
    domains: &BTreeMap<String, FailureDomainStatus>,
    records: &[MachineFailureDomain],
) -> Result<(), String> {
    let masters: Vec<&MachineFailureDomain> = records.iter().filter(|r| r.role == HostRole::Master).collect();
    let workers = worker_domains(spec, domains);
    let ports = masters.iter().any(|r| !r.ports.is_empty()) || workers.iter().any(|w| !w.ports.is_empty());
    if ports {
        require_tech_preview(config)?;
    }
    let Some(object) = config.as_object_mut() else {
        return Ok(());
    };
    if !masters.is_empty() || spec.control_plane.as_ref().is_some_and(|c| c.root_volume.is_some()) {
        let control_plane = object
            .entry("controlPlane")
            .or_insert_with(|| json!({"name": "master"}));
        if !control_plane.is_object() {
            *control_plane = json!({"name": "master"});
        }
        render_control_plane(&mut control_plane["platform"]["openstack"], spec, &masters);
    }
    if !workers.is_empty() {
        let compute = object.entry("compute").or_insert_with(|| json!([]));
        if !compute
            .as_array()
            .is_some_and(|c| c.first().is_some_and(Value::is_object))
        {
            *compute = json!([{"name": "worker"}]);
        }
        render_workers(&mut compute[0]["platform"]["openstack"], &workers);
    }
    Ok(())
}

/// `failureDomains` is a TechPreviewNoUpgrade feature of openshift-install: a template that sets no
/// feature set gets that one; one that sets another contradicts the pool's ports.
fn require_tech_preview(config: &mut Value) -> Result<(), String> {
    match config.get("featureSet") {
        None | Some(Value::Null) => {
            if let Some(object) = config.as_object_mut() {
                object.insert("featureSet".into(), json!(TECH_PREVIEW));
            }
            Ok(())
        }
        Some(Value::String(set)) if set == TECH_PREVIEW => Ok(()),
        Some(other) => {
            // The template is a Secret: only a plain feature-set word is echoed.
            let named = other
                .as_str()
                .filter(|w| w.len() <= 40 && w.chars().all(|c| c.is_ascii_alphanumeric()))
                .map_or_else(|| "another featureSet".to_string(), |w| format!("featureSet {w}"));
            Err(format!(
                "the pool's failure domains or controlPlane have ports, which openshift-install takes only as failureDomains[].portTargets with featureSet {TECH_PREVIEW}, and the install-config template sets {named}: remove the ports, or set featureSet: {TECH_PREVIEW} in the template (such clusters cannot be upgraded)"
            ))
        }
    }
}

/// The control plane: `rootVolume` (size, type), then either `failureDomains` (its machines have
/// ports) or `zones` and `rootVolume.zones`; the shape not used is removed (openshift-install
/// refuses both at once).
fn render_control_plane(openstack: &mut Value, spec: &ClusterPoolSpec, masters: &[&MachineFailureDomain]) {
    if !openstack.is_object() {
        *openstack = json!({});
    }
    let root_volume = spec.control_plane.as_ref().and_then(|c| c.root_volume.as_ref());
    if let Some(volume) = root_volume {
        let mut rendered = json!({});
        if let Some(size) = volume.size {
            rendered["size"] = json!(size);
        }
        if let Some(kind) = &volume.volume_type {
            rendered["type"] = json!(kind);
        }
        openstack["rootVolume"] = rendered;
    }
    let zone = |z: &Option<String>| json!(z.clone().unwrap_or_default());
    if masters.iter().any(|r| !r.ports.is_empty()) {
        let entries: Vec<Value> = masters
            .iter()
            .map(|r| {
                let mut entry = json!({
                    "computeAvailabilityZone": zone(&r.compute_availability_zone),
                    "portTargets": port_targets(&r.ports),
                });
                if root_volume.is_some() {
                    entry["storageAvailabilityZone"] = zone(&r.storage_availability_zone);
                }
                entry
            })
            .collect();
        openstack["failureDomains"] = json!(entries);
        return;
    }
    let placed = masters
        .iter()
        .any(|r| r.compute_availability_zone.is_some() || r.storage_availability_zone.is_some());
    if !placed {
        return;
    }
    // One zone per machine, in machine order ("" lets Nova or Cinder choose for that machine).
    openstack["zones"] = json!(
        masters
            .iter()
            .map(|r| zone(&r.compute_availability_zone))
            .collect::<Vec<_>>()
    );
    if root_volume.is_some() {
        let storage: Vec<Value> = masters.iter().map(|r| zone(&r.storage_availability_zone)).collect();
        openstack["rootVolume"]["zones"] = json!(storage);
    }
}

/// A domain workers may go to, as the compute pool renders it.
struct WorkerDomain {
    compute_zone: Option<String>,
    ports: Vec<PortOpts>,
}

/// Every domain in name order: workers may use any, `NoControlPlane` ones included (§6).
fn worker_domains(spec: &ClusterPoolSpec, domains: &BTreeMap<String, FailureDomainStatus>) -> Vec<WorkerDomain> {
    domains
        .keys()
        .map(|name| match definition(spec, domains, name) {
            Some(d) => WorkerDomain {
                compute_zone: d.compute_availability_zone.clone(),
                ports: d.ports.clone(),
            },
            None => WorkerDomain {
                compute_zone: Some(name.clone()),
                ports: Vec::new(),
            },
        })
        .collect()
}

/// The compute pool: `failureDomains`, one per domain, when domains have ports; otherwise `zones`,
/// each compute zone once (openshift-install makes one MachineSet per zone and spreads the
/// replicas over them).
fn render_workers(openstack: &mut Value, workers: &[WorkerDomain]) {
    if !openstack.is_object() {
        *openstack = json!({});
    }
    if workers.iter().any(|w| !w.ports.is_empty()) {
        let entries: Vec<Value> = workers
            .iter()
            .map(|w| {
                json!({
                    "computeAvailabilityZone": w.compute_zone.clone().unwrap_or_default(),
                    "portTargets": port_targets(&w.ports),
                })
            })
            .collect();
        openstack["failureDomains"] = json!(entries);
        return;
    }
    let mut seen = BTreeSet::new();
    let zones: Vec<&str> = workers
        .iter()
        .filter_map(|w| w.compute_zone.as_deref())
        .filter(|z| seen.insert(*z))
        .collect();
    if !zones.is_empty() {
        openstack["zones"] = json!(zones);
    }
}

/// A machine's ports as openshift-install's port targets, in order: a port tagged `control_plane`
/// (or `control-plane`) is the machine's primary network (target id `control-plane`); the others
/// are named by their first tag, else `port-<index>`. openshift-install takes a port's network and
/// the subnets of its fixed IPs; its other fields stay in the cluster's record only.
fn port_targets(ports: &[PortOpts]) -> Vec<Value> {
    let mut used: BTreeSet<String> = BTreeSet::new();
    ports
        .iter()
        .enumerate()
        .map(|(index, port)| {
            let primary = port.tags.iter().any(|t| PRIMARY_TAGS.contains(&t.as_str()));
            let named = port
                .tags
                .first()
                .filter(|t| !used.contains(*t) && *t != "control-plane");
            let id = match (primary && !used.contains("control-plane"), named) {
                (true, _) => "control-plane".to_string(),
                (false, Some(tag)) => tag.clone(),
                (false, None) => format!("port-{index}"),
            };
            used.insert(id.clone());
            let mut target = json!({"id": id});
            if let Some(network) = &port.network {
                target["network"] = filter(network);
            }
            if !port.fixed_ips.is_empty() {
                let subnets: Vec<Value> = port
                    .fixed_ips
                    .iter()
                    .map(|ip| json!({"subnet": ip.subnet.as_ref().map_or_else(|| json!({}), filter)}))
                    .collect();
                target["fixedIPs"] = json!(subnets);
            }
            target
        })
        .collect()
}

fn filter(resource: &ResourceFilter) -> Value {
    let mut out = json!({});
    if let Some(name) = &resource.name {
        out["name"] = json!(name);
    }
    if let Some(id) = &resource.id {
        out["id"] = json!(id);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::pools::{ControlPlaneMachines, FailureDomainDefinition, PortOpts, RootVolume};

    fn spec() -> ClusterPoolSpec {
        ClusterPoolSpec::default()
    }

    fn defined(name: &str, placement: MachinePlacement) -> FailureDomainDefinition {
        FailureDomainDefinition {
            name: name.into(),
            machine_placement: placement,
            ..Default::default()
        }
    }

    fn eligible(domains: &BTreeMap<String, FailureDomainStatus>) -> Vec<&str> {
        domains
            .iter()
            .filter(|(_, d)| d.control_plane)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    #[test]
    fn discovered_zones_are_control_plane_eligible_unless_omitted() {
        let mut s = spec();
        s.availability_zones = vec!["az1".into()];
        let domains = pool_domains(&s, ["rack-a", ""]);
        assert_eq!(eligible(&domains), ["az1", "rack-a"]);
        assert!(
            domains
                .values()
                .all(|d| d.domain_type == FailureDomainType::AvailabilityZone)
        );
        s.control_plane_omit_availability_zone = Some(true);
        assert!(eligible(&pool_domains(&s, ["rack-a"])).is_empty());
        assert_eq!(pool_domains(&s, ["rack-a"]).len(), 2, "omitted zones are still domains");
    }

    #[test]
    fn a_control_plane_zone_list_overrides_omit() {
        let mut s = spec();
        s.availability_zones = vec!["az1".into(), "az2".into()];
        s.control_plane_omit_availability_zone = Some(true);
        s.control_plane_availability_zones = vec!["az2".into()];
        assert_eq!(eligible(&pool_domains(&s, [])), ["az2"]);
        s.control_plane_omit_availability_zone = Some(false);
        assert_eq!(eligible(&pool_domains(&s, [])), ["az2"], "the list alone decides");
    }

    #[test]
    fn an_explicit_domain_overrides_a_discovered_one_flag_and_type_included() {
        let mut s = spec();
        s.availability_zones = vec!["az1".into(), "az2".into()];
        s.failure_domains = vec![
            defined("az1", MachinePlacement::NoControlPlane),
            defined("fd3", MachinePlacement::All),
        ];
        let domains = pool_domains(&s, []);
        assert_eq!(
            domains["az1"],
            FailureDomainStatus {
                control_plane: false,
                domain_type: FailureDomainType::Cluster
            }
        );
        assert_eq!(domains["az2"].domain_type, FailureDomainType::AvailabilityZone);
        assert_eq!(domains["fd3"].domain_type, FailureDomainType::Cluster);
        assert_eq!(eligible(&domains), ["az2", "fd3"]);
    }

    fn names(placements: &[Option<String>]) -> Vec<&str> {
        placements.iter().map(|p| p.as_deref().unwrap_or("-")).collect()
    }

    #[test]
    fn three_machines_over_three_domains_one_each_over_two_domains_two_and_one() {
        let mut s = spec();
        s.availability_zones = vec!["c".into(), "a".into(), "b".into()];
        let domains = pool_domains(&s, []);
        let none = BTreeMap::new();
        assert_eq!(names(&spread(3, &domains, &none)), ["a", "b", "c"]);
        s.availability_zones = vec!["b".into(), "a".into()];
        let two = pool_domains(&s, []);
        for _ in 0..5 {
            assert_eq!(
                names(&spread(3, &two, &none)),
                ["a", "b", "a"],
                "identical on every run"
            );
        }
    }

    #[test]
    fn no_control_plane_domains_get_no_control_plane_machine() {
        let mut s = spec();
        s.failure_domains = vec![
            defined("a", MachinePlacement::NoControlPlane),
            defined("b", MachinePlacement::All),
        ];
        let domains = pool_domains(&s, []);
        assert_eq!(names(&spread(3, &domains, &BTreeMap::new())), ["b", "b", "b"]);
        s.failure_domains = vec![defined("a", MachinePlacement::NoControlPlane)];
        assert_eq!(names(&spread(2, &pool_domains(&s, []), &BTreeMap::new())), ["-", "-"]);
    }

    #[test]
    fn a_second_cluster_breaks_ties_toward_the_less_used_domain() {
        let mut s = spec();
        s.availability_zones = vec!["a".into(), "b".into()];
        let domains = pool_domains(&s, []);
        let first = spread(3, &domains, &BTreeMap::new());
        let records = control_plane_records(&s, &domains, &first).unwrap();
        let used = usage(&records);
        assert_eq!(used, BTreeMap::from([("a".to_string(), 2), ("b".to_string(), 1)]));
        assert_eq!(names(&spread(3, &domains, &used)), ["b", "a", "b"]);
        assert_eq!(names(&spread(1, &domains, &used)), ["b"]);
    }

    fn port(tag: &str) -> PortOpts {
        PortOpts {
            tags: vec![tag.into()],
            ..Default::default()
        }
    }

    #[test]
    fn records_put_domain_ports_first_and_apply_the_storage_rules() {
        let mut s = spec();
        s.failure_domains = vec![FailureDomainDefinition {
            compute_availability_zone: Some("nova-1".into()),
            storage_availability_zone: Some("cinder-1".into()),
            ports: vec![port("domain")],
            ..defined("fd1", MachinePlacement::All)
        }];
        s.availability_zones = vec!["az2".into()];
        s.control_plane = Some(ControlPlaneMachines {
            replicas: Some(2),
            ports: vec![port("pool")],
            ..Default::default()
        });
        let domains = pool_domains(&s, []);
        let placed = spread(2, &domains, &BTreeMap::new());
        assert_eq!(names(&placed), ["az2", "fd1"]);
        let records = control_plane_records(&s, &domains, &placed).unwrap();
        assert_eq!(records[1].ports, vec![port("domain"), port("pool")]);
        assert_eq!(records[0].ports, vec![port("pool")]);
        assert_eq!(records[1].compute_availability_zone.as_deref(), Some("nova-1"));
        assert_eq!(records[0].compute_availability_zone.as_deref(), Some("az2"));
        assert_eq!(
            records[1].storage_availability_zone, None,
            "a storage zone without a root volume is ignored"
        );

        s.control_plane.as_mut().unwrap().root_volume = Some(RootVolume {
            size: Some(100),
            ..Default::default()
        });
        let records = control_plane_records(&s, &domains, &placed).unwrap();
        assert_eq!(records[1].storage_availability_zone.as_deref(), Some("cinder-1"));

        s.control_plane.as_mut().unwrap().root_volume = Some(RootVolume {
            size: Some(100),
            availability_zone: Some("cinder-9".into()),
            ..Default::default()
        });
        let err = control_plane_records(&s, &domains, &placed).unwrap_err();
        assert!(
            err.contains("storageAvailabilityZone cinder-1") && err.contains("cinder-9"),
            "{err}"
        );
    }

    /// Three explicit domains with compute and storage zones, three control-plane machines with a
    /// root volume, placed and rendered into an install config with a control plane of 3.
    fn rendered(s: &ClusterPoolSpec) -> (Result<(), String>, Value, Vec<MachineFailureDomain>) {
        let domains = pool_domains(s, []);
        let records = control_plane_records(s, &domains, &spread(3, &domains, &BTreeMap::new())).unwrap();
        let mut config = json!({"apiVersion": "v1", "controlPlane": {"name": "master", "replicas": 3}});
        let result = render_openstack(&mut config, s, &domains, &records);
        (result, config, records)
    }

    fn three_domains() -> ClusterPoolSpec {
        let mut s = spec();
        s.platform.openstack = Some(Default::default());
        s.failure_domains = ["fd-b", "fd-a", "fd-c"]
            .iter()
            .map(|n| FailureDomainDefinition {
                compute_availability_zone: Some(format!("nova-{n}")),
                storage_availability_zone: Some(format!("cinder-{n}")),
                ..defined(n, MachinePlacement::All)
            })
            .collect();
        s.control_plane = Some(ControlPlaneMachines {
            replicas: Some(3),
            root_volume: Some(RootVolume {
                size: Some(50),
                volume_type: Some("ssd".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        s
    }

    #[test]
    fn openstack_zones_and_root_volume_zones_follow_machine_order() {
        let (result, config, records) = rendered(&three_domains());
        assert_eq!(result, Ok(()));
        let openstack = &config["controlPlane"]["platform"]["openstack"];
        assert_eq!(openstack["zones"], json!(["nova-fd-a", "nova-fd-b", "nova-fd-c"]));
        assert_eq!(
            openstack["rootVolume"],
            json!({"size": 50, "type": "ssd", "zones": ["cinder-fd-a", "cinder-fd-b", "cinder-fd-c"]})
        );
        assert!(openstack.get("failureDomains").is_none(), "never with zones");
        assert!(config.get("featureSet").is_none(), "zones need no feature set");
        assert_eq!(record_hash(&records), record_hash(&records.clone()));
        assert_ne!(record_hash(&records), record_hash(&records[..2]));
    }

    #[test]
    fn a_root_volume_without_a_zone_of_its_own_goes_to_the_machines_compute_zone() {
        let mut s = three_domains();
        for domain in &mut s.failure_domains {
            domain.storage_availability_zone = None;
        }
        let (result, config, records) = rendered(&s);
        assert_eq!(result, Ok(()));
        let storage: Vec<Option<&str>> = records.iter().map(|r| r.storage_availability_zone.as_deref()).collect();
        assert_eq!(storage, [Some("nova-fd-a"), Some("nova-fd-b"), Some("nova-fd-c")]);
        assert_eq!(
            config["controlPlane"]["platform"]["openstack"]["rootVolume"]["zones"],
            json!(["nova-fd-a", "nova-fd-b", "nova-fd-c"]),
            "openshift-install wants rootVolume.zones wherever zones are set"
        );
        // An explicit root-volume zone wins over the compute zone.
        s.control_plane
            .as_mut()
            .unwrap()
            .root_volume
            .as_mut()
            .unwrap()
            .availability_zone = Some("cinder-x".into());
        let (_, _, records) = rendered(&s);
        assert!(
            records
                .iter()
                .all(|r| r.storage_availability_zone.as_deref() == Some("cinder-x"))
        );
        // Without a root volume there is no volume zone to choose.
        s.control_plane.as_mut().unwrap().root_volume = None;
        let (_, config, records) = rendered(&s);
        assert!(records.iter().all(|r| r.storage_availability_zone.is_none()));
        assert!(
            config["controlPlane"]["platform"]["openstack"]
                .get("rootVolume")
                .is_none()
        );
    }

    fn subnet_port(tag: &str, subnet: &str) -> PortOpts {
        PortOpts {
            tags: vec![tag.into()],
            network: Some(ResourceFilter {
                name: Some(format!("{subnet}-net")),
                id: None,
            }),
            fixed_ips: vec![crate::api::pools::FixedIp {
                subnet: Some(ResourceFilter {
                    name: Some(subnet.into()),
                    id: None,
                }),
                ip_address: Some("10.0.0.5".into()),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn domain_ports_render_as_tech_preview_failure_domains_with_port_targets_and_no_zones() {
        let mut s = three_domains();
        s.failure_domains[1].ports = vec![subnet_port("control_plane", "cp-a"), subnet_port("storage", "st-a")];
        s.control_plane.as_mut().unwrap().ports = vec![port("extra")];
        let (result, config, _) = rendered(&s);
        assert_eq!(result, Ok(()));
        assert_eq!(config["featureSet"], "TechPreviewNoUpgrade");
        let openstack = &config["controlPlane"]["platform"]["openstack"];
        assert!(openstack.get("zones").is_none(), "{openstack}");
        assert_eq!(
            openstack["rootVolume"],
            json!({"size": 50, "type": "ssd"}),
            "no rootVolume.zones"
        );
        let domains = openstack["failureDomains"].as_array().expect("one per machine");
        assert_eq!(domains.len(), 3);
        assert_eq!(
            domains[0],
            json!({
                "computeAvailabilityZone": "nova-fd-a",
                "storageAvailabilityZone": "cinder-fd-a",
                "portTargets": [
                    {"id": "control-plane", "network": {"name": "cp-a-net"}, "fixedIPs": [{"subnet": {"name": "cp-a"}}]},
                    {"id": "storage", "network": {"name": "st-a-net"}, "fixedIPs": [{"subnet": {"name": "st-a"}}]},
                    {"id": "extra"},
                ],
            }),
            "the domain's ports first, then the pool's"
        );
        assert_eq!(domains[1]["computeAvailabilityZone"], "nova-fd-b");
        assert_eq!(domains[1]["portTargets"], json!([{"id": "extra"}]));
        // The workers' pool takes every domain's ports the same way, one entry per domain.
        let workers = &config["compute"][0]["platform"]["openstack"];
        assert_eq!(config["compute"][0]["name"], "worker");
        assert_eq!(workers["failureDomains"].as_array().map(Vec::len), Some(3));
        assert!(workers.get("zones").is_none());
    }

    #[test]
    fn ports_with_a_template_of_another_feature_set_are_a_contradiction() {
        let mut s = three_domains();
        s.failure_domains[0].ports = vec![port("x")];
        let domains = pool_domains(&s, []);
        let records = control_plane_records(&s, &domains, &spread(3, &domains, &BTreeMap::new())).unwrap();
        let mut config = json!({"featureSet": "Default"});
        let err = render_openstack(&mut config, &s, &domains, &records).unwrap_err();
        assert!(
            err.contains("featureSet Default") && err.contains("TechPreviewNoUpgrade"),
            "{err}"
        );
        let mut config = json!({"featureSet": "TechPreviewNoUpgrade"});
        assert_eq!(render_openstack(&mut config, &s, &domains, &records), Ok(()));
    }

    #[test]
    fn workers_spread_over_every_domain_no_control_plane_ones_included() {
        let mut s = three_domains();
        s.failure_domains[2].machine_placement = MachinePlacement::NoControlPlane;
        s.availability_zones = vec!["az-9".into(), "nova-fd-a".into()];
        s.control_plane_omit_availability_zone = Some(true);
        let domains = pool_domains(&s, []);
        let placed = spread(3, &domains, &BTreeMap::new());
        assert!(placed.iter().all(|p| p.as_deref() != Some("fd-c")), "{placed:?}");
        let records = control_plane_records(&s, &domains, &placed).unwrap();
        let mut config = json!({"compute": [{"name": "worker", "replicas": 4}]});
        render_openstack(&mut config, &s, &domains, &records).unwrap();
        assert_eq!(
            config["compute"][0]["replicas"], 4,
            "the template's compute pool is kept"
        );
        assert_eq!(
            config["compute"][0]["platform"]["openstack"]["zones"],
            json!(["az-9", "nova-fd-a", "nova-fd-b", "nova-fd-c"]),
            "every domain in name order, each zone once"
        );
    }

    #[test]
    fn a_storage_zone_against_an_explicit_root_volume_zone_is_a_contradiction_of_the_pool() {
        let mut s = three_domains();
        assert_eq!(contradiction(&s, &pool_domains(&s, [])), None);
        s.control_plane
            .as_mut()
            .unwrap()
            .root_volume
            .as_mut()
            .unwrap()
            .availability_zone = Some("cinder-x".into());
        let message = contradiction(&s, &pool_domains(&s, [])).expect("a contradiction");
        assert!(
            message.starts_with("failure domain fd-a sets storageAvailabilityZone cinder-fd-a, failure domain fd-b"),
            "{message}"
        );
        assert!(
            message.contains("controlPlane.rootVolume.availabilityZone is cinder-x"),
            "{message}"
        );
        // Domains no control-plane machine goes to cannot contradict the control plane's volume.
        for domain in &mut s.failure_domains {
            domain.machine_placement = MachinePlacement::NoControlPlane;
        }
        assert_eq!(contradiction(&s, &pool_domains(&s, [])), None);
    }
}
