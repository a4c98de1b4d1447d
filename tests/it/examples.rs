//! The manifests under `examples/` round-trip through the Rust types without losing a field.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use stackd::api::inventory::BareMetalAsset;
use stackd::api::pools::{ClusterClaim, ClusterDeployment, ClusterDeploymentCustomization, ClusterPool};
use stackd::api::stacks::{ClusterStackInstall, Stack, StackInstall};

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

fn load(relative: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(examples_dir().join(relative)).unwrap_or_else(|e| panic!("{relative}: {e}"));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{relative}: {e}"))
}

/// Parses a manifest as `K` and serialises it back; the result must equal the manifest.
fn assert_round_trips<K: DeserializeOwned + Serialize>(relative: &str) {
    for document in load(relative) {
        let typed: K = serde_json::from_value(document.clone()).unwrap_or_else(|e| panic!("{relative}: {e}"));
        let back = serde_json::to_value(&typed).expect("serialise");
        pretty_assertions::assert_eq!(back, document, "{relative} changed in a round trip");
    }
}

#[test]
fn stack_examples_round_trip() {
    assert_round_trips::<StackInstall>("stacks/stackinstall.yaml");
    assert_round_trips::<ClusterStackInstall>("stacks/clusterstackinstall.yaml");
    assert_round_trips::<Stack>("stacks/stack.yaml");
}

#[test]
fn pool_examples_round_trip() {
    assert_round_trips::<ClusterPool>("pools/clusterpool-vsphere.yaml");
    assert_round_trips::<ClusterPool>("pools/clusterpool-openstack.yaml");
    assert_round_trips::<ClusterPool>("pools/clusterpool-baremetal.yaml");
    assert_round_trips::<ClusterDeploymentCustomization>("pools/clusterdeploymentcustomization.yaml");
    assert_round_trips::<ClusterDeployment>("pools/clusterdeployment.yaml");
    assert_round_trips::<ClusterClaim>("pools/clusterclaim.yaml");
}

#[test]
fn inventory_examples_round_trip() {
    assert_round_trips::<BareMetalAsset>("inventory/baremetalasset.yaml");
}

#[test]
fn patch_values_keep_their_json_type() {
    let cdc: ClusterDeploymentCustomization =
        serde_json::from_value(load("pools/clusterdeploymentcustomization.yaml").remove(0)).expect("parse");
    let values: Vec<_> = cdc
        .spec
        .install_config_patches
        .iter()
        .map(|p| p.value.clone().unwrap_or_default())
        .collect();
    assert_eq!(values[0], Value::String("foo".into()));
    assert!(values[3].is_array(), "a patch value may be a list");
}

#[test]
fn verbatim_seed_customization_fails_the_path_pattern() {
    let seed = load("invalid/cdc-seed-verbatim.yaml").remove(0);
    let path = seed["spec"]["installConfigPatches"][0]["path"]
        .as_str()
        .expect("path")
        .to_string();
    assert_eq!(path, "metadata/name", "the seed is kept verbatim");
    let crd = stackd::api::crds::all()
        .into_iter()
        .find(|c| c.spec.names.kind == "ClusterDeploymentCustomization")
        .expect("CRD");
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).expect("schema");
    let pattern = schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["installConfigPatches"]["items"]["properties"]["path"]
        ["pattern"]
        .as_str()
        .expect("pattern")
        .to_string();
    let pattern = regex::Regex::new(&pattern).expect("regex");
    assert!(!pattern.is_match(&path), "the seed's path is refused");
    assert!(pattern.is_match("/metadata/name"), "the corrected path is accepted");
}
