//! The generated CRDs: what they declare, that they are structural, and that `crds/` matches them
//! (the tenants' CRDs at its top, the host's in `crds/host/`).

use std::collections::BTreeSet;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;
use stackd::api::crds;

/// Every CRD: the tenants' and the host's.
fn every_crd() -> Vec<CustomResourceDefinition> {
    crds::all().into_iter().chain(crds::host()).collect()
}

fn crd(kind: &str) -> CustomResourceDefinition {
    every_crd()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD for {kind}"))
}

fn schema(kind: &str) -> Value {
    let crd = crd(kind);
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("schema");
    serde_json::to_value(schema).expect("schema as JSON")
}

/// Follows `properties`/`items` through a dotted path such as `spec.inventory[].name`.
fn node<'a>(root: &'a Value, path: &str) -> &'a Value {
    let mut current = root;
    for part in path.split('.') {
        let (name, items) = part.strip_suffix("[]").map_or((part, false), |n| (n, true));
        current = &current["properties"][name];
        assert!(!current.is_null(), "no schema node at {path} ({name})");
        if items {
            current = &current["items"];
        }
    }
    current
}

#[test]
fn stackds_eight_crds_have_their_group_kind_scope_and_version() {
    let expected = [
        ("stacks.stackd.dev", "StackInstall", "stackinstalls"),
        ("stacks.stackd.dev", "ClusterStackInstall", "clusterstackinstalls"),
        ("stacks.stackd.dev", "Stack", "stacks"),
        ("pools.stackd.dev", "ClusterPool", "clusterpools"),
        (
            "pools.stackd.dev",
            "ClusterDeploymentCustomization",
            "clusterdeploymentcustomizations",
        ),
        ("pools.stackd.dev", "ClusterDeployment", "clusterdeployments"),
        ("pools.stackd.dev", "ClusterClaim", "clusterclaims"),
        ("inventory.stackd.dev", "BareMetalAsset", "baremetalassets"),
    ];
    let all = crds::all();
    assert_eq!(all.len(), expected.len() + 1);
    let compatibility = &all[expected.len()];
    assert_eq!(
        compatibility.metadata.name.as_deref(),
        Some("stackdefinitions.packages.crossplane.io"),
        "Crossplane's StackDefinition comes last"
    );
    for (crd, (group, kind, plural)) in all.iter().zip(expected) {
        assert_eq!(crd.spec.group, group);
        assert_eq!(crd.spec.names.kind, kind);
        assert_eq!(crd.spec.names.plural, plural);
        assert_eq!(crd.metadata.name.as_deref(), Some(format!("{plural}.{group}").as_str()));
        assert_eq!(crd.spec.scope, "Namespaced", "{kind} scope");
        assert_eq!(crd.spec.versions.len(), 1);
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(version.served && version.storage);
        let subresources = version.subresources.as_ref().expect("subresources");
        assert!(subresources.status.is_some(), "{kind} has a status subresource");
        let columns = version.additional_printer_columns.as_deref().unwrap_or_default();
        assert!(columns.iter().any(|c| c.name == "Age"), "{kind} prints its age");
        assert!(
            crd.spec
                .names
                .categories
                .as_deref()
                .unwrap_or_default()
                .contains(&"stackd".to_string())
        );
    }
}

#[test]
fn short_names_are_the_ones_users_type() {
    let short = |kind: &str| crd(kind).spec.names.short_names.unwrap_or_default();
    assert_eq!(short("ClusterPool"), ["cp"]);
    assert_eq!(short("ClusterDeploymentCustomization"), ["cdc"]);
    assert_eq!(short("ClusterDeployment"), ["cd"]);
    assert_eq!(short("StackInstall"), ["si"]);
    assert_eq!(short("BareMetalAsset"), ["bma"]);
}

#[test]
fn cluster_pool_scales_on_size() {
    let crd = crd("ClusterPool");
    let scale = crd.spec.versions[0]
        .subresources
        .as_ref()
        .and_then(|s| s.scale.as_ref())
        .expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.size");
    assert_eq!(scale.status_replicas_path, ".status.size");
}

#[test]
fn stack_installs_print_ready_package_and_age() {
    for kind in ["StackInstall", "ClusterStackInstall"] {
        let crd = crd(kind);
        let columns: Vec<_> = crd.spec.versions[0]
            .additional_printer_columns
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|c| (c.name.to_uppercase(), c.json_path.clone()))
            .collect();
        assert_eq!(
            columns,
            [
                (
                    "READY".to_string(),
                    r#".status.conditions[?(@.type=="Ready")].status"#.to_string()
                ),
                ("PACKAGE".to_string(), ".spec.package".to_string()),
                ("AGE".to_string(), ".metadata.creationTimestamp".to_string()),
            ]
        );
    }
}

#[test]
fn cluster_pool_names_are_at_most_57_characters() {
    assert_eq!(
        schema("ClusterPool")["properties"]["metadata"]["properties"]["name"]["maxLength"],
        57
    );
}

#[test]
fn enums_are_declared_in_the_schema() {
    let cases = [
        (
            "ClusterDeploymentCustomization",
            "spec.installConfigPatches[].op",
            vec!["add", "remove", "replace", "move", "copy", "test"],
        ),
        ("Stack", "spec.permissionScope", vec!["Namespaced", "Cluster"]),
        (
            "StackInstall",
            "spec.imagePullPolicy",
            vec!["Always", "IfNotPresent", "Never"],
        ),
        (
            "ClusterPool",
            "spec.inventory[].kind",
            vec!["ClusterDeploymentCustomization"],
        ),
        (
            "ClusterPool",
            "spec.failureDomains[].machinePlacement",
            vec!["All", "NoControlPlane"],
        ),
        (
            "ClusterPool",
            "status.inventory[].status",
            vec![
                "Available",
                "Reserved",
                "BrokenBySyntax",
                "BrokenByCloud",
                "Missing",
                "Deleting",
                "Unavailable",
                "ToBeDeleted",
                "ToBeUpdated",
            ],
        ),
        ("BareMetalAsset", "spec.role", vec!["master", "worker", ""]),
        ("ClusterDeployment", "spec.hosts[].role", vec!["master", "worker"]),
    ];
    for (kind, path, values) in cases {
        let root = schema(kind);
        let declared: Vec<&str> = node(&root, path)["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("{kind} {path} has an enum"))
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(declared, values, "{kind} {path}");
    }
}

#[test]
fn patterns_are_anchored() {
    let cdc = schema("ClusterDeploymentCustomization");
    for field in ["path", "from"] {
        let node = node(&cdc, &format!("spec.installConfigPatches[].{field}"));
        assert_eq!(node["pattern"], "^/");
        let description = node["description"].as_str().unwrap_or_default();
        assert!(
            description.contains("/metadata/name"),
            "{field} description says to write /metadata/name"
        );
    }
    let mac = node(&schema("BareMetalAsset"), "spec.bootMACAddress")["pattern"]
        .as_str()
        .expect("MAC pattern")
        .to_string();
    assert!(mac.starts_with('^') && mac.ends_with('$'));
    let mac = regex::Regex::new(&mac).expect("valid regex");
    assert!(mac.is_match("00:1B:44:11:3A:B7"));
    assert!(!mac.is_match("x00:1B:44:11:3A:B7"));
    assert!(!mac.is_match("00:1B:44:11:3A:B7:00"));
}

#[test]
fn minimums_and_min_items_are_declared() {
    let pool = schema("ClusterPool");
    // JSONSchemaProps stores `minimum` as a float.
    let minimum = |path: &str| node(&pool, path)["minimum"].as_f64();
    for path in ["spec.size", "spec.maxSize", "spec.maxConcurrent"] {
        assert_eq!(minimum(path), Some(0.0), "{path}");
    }
    assert_eq!(minimum("spec.installAttemptsLimit"), Some(1.0));
    assert_eq!(node(&pool, "spec.inventory")["minItems"], 1);
    assert_eq!(node(&pool, "spec.platform")["maxProperties"], 1);
    assert_eq!(node(&pool, "spec.platform")["minProperties"], 1);
}

#[test]
fn list_maps_are_keyed() {
    let cases = [
        ("ClusterPool", "spec.inventory", "name"),
        ("ClusterPool", "spec.failureDomains", "name"),
        ("ClusterPool", "status.inventory", "name"),
        ("ClusterPool", "status.conditions", "type"),
        ("ClusterDeployment", "spec.hosts", "name"),
        ("ClusterDeployment", "status.failureDomains", "machine"),
        ("ClusterDeploymentCustomization", "status.conditions", "type"),
        ("StackInstall", "status.conditions", "type"),
        ("Stack", "status.conditions", "type"),
        ("ClusterClaim", "status.conditions", "type"),
        ("BareMetalAsset", "status.conditions", "type"),
    ];
    for (kind, path, key) in cases {
        let root = schema(kind);
        let list = node(&root, path);
        assert_eq!(list["x-kubernetes-list-type"], "map", "{kind} {path}");
        assert_eq!(
            list["x-kubernetes-list-map-keys"],
            serde_json::json!([key]),
            "{kind} {path}"
        );
        let item = &list["items"];
        let required: BTreeSet<&str> = item["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            required.contains(key) || !item["properties"][key]["default"].is_null(),
            "{kind} {path}: list-map key {key} must be required or defaulted"
        );
    }
}

#[test]
fn free_form_fields_preserve_unknown_fields() {
    let value = node(
        &schema("ClusterDeploymentCustomization"),
        "spec.installConfigPatches[].value",
    )
    .clone();
    assert_eq!(value["x-kubernetes-preserve-unknown-fields"], true);
    assert!(value.get("type").is_none(), "a patch value may be any JSON type");
    let spec = node(&schema("Stack"), "spec.controller.deployment.spec").clone();
    assert_eq!(spec["x-kubernetes-preserve-unknown-fields"], true);
    assert_eq!(spec["type"], "object");
    assert!(
        spec.get("properties").is_none(),
        "the DeploymentSpec schema is not inlined"
    );
}

/// Walks a schema and lists every violation of the structural-schema rules a 1.24 API server applies.
fn structural_violations(node: &Value, path: &str, out: &mut Vec<String>) {
    let Some(map) = node.as_object() else {
        out.push(format!("{path}: schema node is not an object"));
        return;
    };
    let preserved = map.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    let int_or_string = map.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    if map.get("type").and_then(Value::as_str).is_none_or(str::is_empty) && !preserved && !int_or_string {
        out.push(format!("{path}: no type"));
    }
    for forbidden in [
        "uniqueItems",
        "$ref",
        "x-kubernetes-validations",
        "allOf",
        "oneOf",
        "anyOf",
        "not",
    ] {
        if map.contains_key(forbidden) {
            out.push(format!("{path}: has {forbidden}"));
        }
    }
    if map.contains_key("properties") && map.contains_key("additionalProperties") {
        out.push(format!("{path}: additionalProperties beside properties"));
    }
    if let Some(Value::Object(properties)) = map.get("properties") {
        for (name, child) in properties {
            structural_violations(child, &format!("{path}.{name}"), out);
        }
    }
    if let Some(items) = map.get("items") {
        structural_violations(items, &format!("{path}[]"), out);
    }
    if let Some(additional @ Value::Object(_)) = map.get("additionalProperties") {
        structural_violations(additional, &format!("{path}{{}}"), out);
    }
}

#[test]
fn every_schema_is_structural() {
    for crd in every_crd() {
        let root = schema(&crd.spec.names.kind);
        let mut violations = Vec::new();
        structural_violations(&root, &crd.spec.names.kind, &mut violations);
        if let Some(metadata) = root["properties"]["metadata"].as_object() {
            let fields: BTreeSet<&String> = metadata
                .get("properties")
                .and_then(Value::as_object)
                .into_iter()
                .flat_map(|p| p.keys())
                .collect();
            assert!(
                fields.iter().all(|f| *f == "name" || *f == "generateName"),
                "metadata may only constrain name"
            );
        }
        assert!(
            violations.is_empty(),
            "{} is not structural:\n{}",
            crd.spec.names.kind,
            violations.join("\n")
        );
    }
}

#[test]
fn every_crd_is_smaller_than_256_kib() {
    for crd in every_crd() {
        let json = serde_json::to_vec(&crd).expect("serialise");
        let yaml = crds::to_yaml(&crd).expect("yaml");
        assert!(
            json.len() < 256 * 1024 && yaml.len() < 256 * 1024,
            "{} is too large",
            crd.spec.names.kind
        );
    }
}

/// The YAML files of `dir`, by name.
fn yaml_files(dir: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{} exists: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn committed_crds_match_the_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    for (dir, crds) in [(dir.clone(), crds::all()), (dir.join(crds::HOST_DIR), crds::host())] {
        let expected: BTreeSet<String> = crds.iter().map(crds::file_name).collect();
        assert_eq!(
            yaml_files(&dir),
            expected,
            "{} has other files than the types produce; run `cargo run -- crds --out crds`",
            dir.display()
        );
        for crd in crds {
            let committed = std::fs::read_to_string(dir.join(crds::file_name(&crd))).expect("read CRD file");
            assert!(
                committed == crds::to_yaml(&crd).expect("yaml"),
                "{}/{} differs from the Rust types; run `cargo run -- crds --out crds` and commit",
                dir.display(),
                crds::file_name(&crd)
            );
        }
    }
}

/// Issue 31: the host's Tenant kind, cluster-scoped, printing what `kubectl get tenants` shows.
#[test]
fn the_tenant_crd_is_cluster_scoped_and_prints_the_operators_columns() {
    let host = crds::host();
    assert_eq!(host.len(), 1, "Tenant alone lives on the host");
    let tenant = &host[0];
    assert_eq!(tenant.metadata.name.as_deref(), Some("tenants.tenancy.stackd.dev"));
    assert_eq!(tenant.spec.scope, "Cluster");
    assert!(
        !crds::all().iter().any(|crd| crd.spec.group == "tenancy.stackd.dev"),
        "the tenants' CRDs (stackd-types) do not carry it"
    );
    let version = &tenant.spec.versions[0];
    assert!(version.subresources.as_ref().is_some_and(|s| s.status.is_some()));
    let columns: Vec<(String, String)> = version
        .additional_printer_columns
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|c| (c.name.to_uppercase(), c.json_path.clone()))
        .collect();
    let expected = [
        ("READY", r#".status.conditions[?(@.type=="Ready")].status"#),
        ("REASON", r#".status.conditions[?(@.type=="Ready")].reason"#),
        ("REPLICA", ".status.servedBy"),
        ("NAMESPACE", ".status.hostNamespace"),
        ("VERSION", ".status.serverVersion"),
        ("AGE", ".metadata.creationTimestamp"),
    ];
    let expected: Vec<(String, String)> = expected.iter().map(|(n, p)| (n.to_string(), p.to_string())).collect();
    assert_eq!(columns, expected);
    let root = schema("Tenant");
    assert_eq!(root["properties"]["metadata"]["properties"]["name"]["maxLength"], 63);
    let secret = node(&root, "spec.kubeconfigSecretRef");
    let required: BTreeSet<&str> = secret["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(required, BTreeSet::from(["namespace", "name", "key"]));
    assert_eq!(
        node(&root, "status.conditions")["x-kubernetes-list-map-keys"],
        serde_json::json!(["type"])
    );
}

#[test]
fn printed_stream_parses_back_into_the_eight_crds() {
    let stream = crds::to_yaml_stream(&crds::all()).expect("yaml");
    let parsed: Vec<CustomResourceDefinition> = serde_saphyr::from_multiple(&stream).expect("parse stream");
    assert_eq!(parsed, crds::all());
}
