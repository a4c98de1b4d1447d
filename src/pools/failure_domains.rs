//! Failure domains of a pool (DESIGN.md §6): the domains in effect (discovered zones, then explicit
//! definitions that override them by name), the deterministic spreading of a new cluster's
//! control-plane machines, each machine's resolved domain (the record frozen on the cluster), and
//! its OpenStack rendering.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::pools::{
    ClusterPoolSpec, FailureDomainStatus, FailureDomainType, HostRole, MachineFailureDomain, MachinePlacement,
};

/// Annotation on a ClusterDeployment: SHA-256 of its `status.failureDomains` record.
pub const HASH_ANNOTATION: &str = "pools.stackd.dev/failure-domains-hash";
/// Key of the install-config Secret holding the record (JSON), the source it is restored from.
pub const RECORD_KEY: &str = "failure-domains.json";
/// Key of the install-config Secret saying why the machines cannot be placed (`InvalidMachineSpec`).
pub const INVALID_KEY: &str = "invalid-machine-spec";

/// The domains in effect for a pool: discovered zones (`zones`, the failure domains of its
/// assets, plus `spec.availabilityZones`) of type `AvailabilityZone`, then the explicit
/// definitions of type `Cluster`, which replace a discovered zone of the same name.
pub fn pool_domains<'a>(
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
pub fn spread(
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
pub fn usage<'a>(records: impl IntoIterator<Item = &'a MachineFailureDomain>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for record in records {
        if record.role == HostRole::Master {
            *counts.entry(record.name.clone()).or_default() += 1;
        }
    }
    counts
}

/// Resolves each placed control-plane machine into its record (merge rules of §6): the domain's
/// ports before the pool's, the domain's storage zone only with a root volume, and an error when
/// it would contradict an explicit root-volume zone.
pub fn control_plane_records(
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
        let explicit = domains
            .get(name)
            .is_some_and(|d| d.domain_type == FailureDomainType::Cluster);
        let definition = spec.failure_domains.iter().find(|d| explicit && d.name == *name);
        let (compute, storage, mut ports) = match definition {
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
            (Some(volume), None) => volume.availability_zone.clone(),
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

/// SHA-256 (hex) of a record, as written in the cluster's annotation.
pub fn record_hash(records: &[MachineFailureDomain]) -> String {
    let text = serde_json::to_string(records).expect("records serialize");
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Writes the control-plane zones into an OpenStack install config: compute zones and root-volume
/// storage zones in machine order.
pub fn render_openstack(config: &mut Value, spec: &ClusterPoolSpec, records: &[MachineFailureDomain]) {
    let masters: Vec<&MachineFailureDomain> = records.iter().filter(|r| r.role == HostRole::Master).collect();
    // Zones go by machine index: a list is rendered only when every machine has its zone.
    let compute: Vec<&str> = masters
        .iter()
        .map(|r| r.compute_availability_zone.as_deref())
        .collect::<Option<_>>()
        .unwrap_or_default();
    let storage: Vec<&str> = masters
        .iter()
        .map(|r| r.storage_availability_zone.as_deref())
        .collect::<Option<_>>()
        .unwrap_or_default();
    let root_volume = spec.control_plane.as_ref().and_then(|c| c.root_volume.as_ref());
    if compute.is_empty() && root_volume.is_none() {
        return;
    }
    let Some(object) = config.as_object_mut() else { return };
    let control_plane = object
        .entry("controlPlane")
        .or_insert_with(|| json!({"name": "master"}));
    if !control_plane.is_object() {
        *control_plane = json!({"name": "master"});
    }
    let openstack = &mut control_plane["platform"]["openstack"];
    if !compute.is_empty() {
        openstack["zones"] = json!(compute);
    }
    if let Some(volume) = root_volume {
        let mut rendered = json!({});
        if let Some(size) = volume.size {
            rendered["size"] = json!(size);
        }
        if let Some(kind) = &volume.volume_type {
            rendered["type"] = json!(kind);
        }
        if !storage.is_empty() {
            rendered["zones"] = json!(storage);
        }
        openstack["rootVolume"] = rendered;
    }
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

    #[test]
    fn openstack_zones_and_root_volume_zones_follow_machine_order() {
        let mut s = spec();
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
                ..Default::default()
            }),
            ..Default::default()
        });
        let domains = pool_domains(&s, []);
        let records = control_plane_records(&s, &domains, &spread(3, &domains, &BTreeMap::new())).unwrap();
        let mut config = json!({"controlPlane": {"name": "master", "replicas": 3}});
        render_openstack(&mut config, &s, &records);
        let openstack = &config["controlPlane"]["platform"]["openstack"];
        assert_eq!(openstack["zones"], json!(["nova-fd-a", "nova-fd-b", "nova-fd-c"]));
        assert_eq!(
            openstack["rootVolume"]["zones"],
            json!(["cinder-fd-a", "cinder-fd-b", "cinder-fd-c"])
        );
        assert_eq!(openstack["rootVolume"]["size"], 50);
        assert_eq!(record_hash(&records), record_hash(&records.clone()));
        assert_ne!(record_hash(&records), record_hash(&records[..2]));
    }
}
