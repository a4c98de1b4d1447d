//! The `stackd` binary's own surface.

use std::process::Command;

fn stackd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(args)
        .output()
        .expect("run stackd")
}

#[test]
fn crds_command_prints_every_crd_a_tenant_serves() {
    let out = stackd(&["crds"]);
    assert!(out.status.success());
    let stream = String::from_utf8(out.stdout).expect("utf-8");
    let crds: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stream).expect("YAML stream");
    assert_eq!(crds.len(), 9, "stackd's eight and Crossplane's StackDefinition");
    assert!(crds.iter().all(|c| c["kind"] == "CustomResourceDefinition"));
}

#[test]
fn crds_out_writes_one_file_per_crd_and_the_hosts_in_host() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = stackd(&["crds", "--out", dir.path().to_str().expect("path")]);
    assert!(out.status.success());
    let files = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .expect("read dir")
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_file())
            .count()
    };
    assert_eq!(files(dir.path()), 9);
    assert!(dir.path().join("host/tenancy.stackd.dev_tenants.yaml").is_file());
    assert_eq!(files(&dir.path().join("host")), 1);
}

#[test]
fn crds_host_prints_the_tenant_crd_alone() {
    let out = stackd(&["crds", "--host"]);
    assert!(out.status.success());
    let stream = String::from_utf8(out.stdout).expect("utf-8");
    let crds: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stream).expect("YAML stream");
    assert_eq!(crds.len(), 1);
    assert_eq!(crds[0]["metadata"]["name"], "tenants.tenancy.stackd.dev");
}

#[test]
fn version_prints_the_package_version() {
    let out = stackd(&["version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("stackd {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn bench_refuses_an_unreadable_baseline_before_measuring() {
    let out = stackd(&["bench", "--quick", "--compare", "/nonexistent/baseline.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent/baseline.json"));
}

#[test]
fn bad_flags_are_refused_with_usage() {
    let out = stackd(&["unpack", "--content-dir", "x", "--permission-scope", "Everything"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Namespaced or Cluster"));
}

fn examples(path: &str) -> String {
    format!("{}/examples/packages/{path}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn unpack_prints_crds_then_one_stack_with_a_valid_trailer() {
    let out = stackd(&[
        "unpack",
        "--content-dir",
        &examples("sample-stack/.registry"),
        "--permission-scope",
        "Namespaced",
        "--package-image",
        "stackd-examples/sample-stack:v0.1.0",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let contents = stackd::stacks::stream::decode(&String::from_utf8(out.stdout).expect("utf-8"), usize::MAX)
        .expect("valid stream");
    assert_eq!(contents.crds.len(), 1);
    assert_eq!(contents.crds[0].spec.names.kind, "Widget");
    let spec = &contents.stack.spec;
    assert_eq!(spec.version.as_deref(), Some("0.1.0"));
    assert_eq!(
        spec.customresourcedefinitions[0].api_version,
        "samples.example.org/v1alpha1"
    );
    let rules = &spec.permissions.rules;
    assert_eq!(
        rules[0].resources.as_deref(),
        Some(&["configmaps".to_string(), "events".into(), "secrets".into()][..])
    );
    assert!(
        rules[1]
            .resources
            .as_deref()
            .unwrap_or_default()
            .contains(&"widgets/finalizers".to_string())
    );
    let deployment = spec.controller.deployment.as_ref().expect("controller");
    assert_eq!(
        deployment.spec["template"]["spec"]["containers"][0]["image"],
        "stackd-examples/sample-stack:v0.1.0"
    );
    assert!(deployment.spec["template"]["spec"].get("initContainers").is_none());
}

#[test]
fn unpack_of_a_cluster_package_generates_scale_and_dependency_rules() {
    let out = stackd(&[
        "unpack",
        "--content-dir",
        &examples("cluster-stack/.registry"),
        "--permission-scope",
        "Cluster",
        "--package-image",
        "stackd-examples/cluster-stack:v0.2.0",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let contents = stackd::stacks::stream::decode(&String::from_utf8(out.stdout).expect("utf-8"), usize::MAX)
        .expect("valid stream");
    let rules = &contents.stack.spec.permissions.rules;
    assert!(
        rules[1]
            .resources
            .as_deref()
            .unwrap_or_default()
            .contains(&"gadgets/scale".to_string())
    );
    assert_eq!(
        rules[2].resources.as_deref(),
        Some(&["widgets".to_string()][..]),
        "dependsOn grants the dependency"
    );
}

#[test]
fn unpack_refuses_a_package_of_another_scope() {
    let out = stackd(&[
        "unpack",
        "--content-dir",
        &examples("cluster-stack/.registry"),
        "--permission-scope",
        "Namespaced",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing is printed for the daemon to apply");
    assert!(String::from_utf8_lossy(&out.stderr).contains("use a ClusterStackInstall"));
}

#[test]
fn unpack_refuses_a_package_without_app_yaml() {
    let empty = tempfile::tempdir().expect("temp dir");
    let out = stackd(&[
        "unpack",
        "--content-dir",
        empty.path().to_str().expect("path"),
        "--permission-scope",
        "Namespaced",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no app.yaml"));
}

#[test]
fn unpack_says_every_problem_of_a_package_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("app.yaml"), "title: x\n").expect("write");
    std::fs::write(
        dir.path().join("old.crd.yaml"),
        "apiVersion: apiextensions.k8s.io/v1beta1\nkind: CustomResourceDefinition\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("install.yaml"), "apiVersion: batch/v1\nkind: Job\n").expect("write");
    let out = stackd(&[
        "unpack",
        "--content-dir",
        dir.path().to_str().expect("path"),
        "--permission-scope",
        "Namespaced",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing is printed for a refused package");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the package has 2 problems:"), "{stderr}");
    assert!(
        stderr.contains(
            "old.crd.yaml: the v1beta1 CustomResourceDefinition cannot be converted to v1: spec is not a mapping"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("must hold one apps/v1 Deployment, the stack's controller; found batch/v1 Job"),
        "{stderr}"
    );
}

#[test]
fn unpack_refuses_a_controller_container_without_an_image_when_no_package_image_is_known() {
    let registry = examples("sample-stack/.registry");
    let args = ["unpack", "--content-dir", &registry, "--permission-scope", "Namespaced"];
    let out = Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(args)
        .env_remove("STACK_IMAGE")
        .output()
        .expect("run stackd");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("container \"controller\" names no image") && stderr.contains("--package-image"),
        "{stderr}"
    );
}

#[test]
fn copy_copies_a_package_tree_and_refuses_a_link_out_of_it_naming_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dest) = (dir.path().join("src"), dir.path().join("dest"));
    std::fs::create_dir_all(src.join("resources")).unwrap();
    std::fs::write(src.join("app.yaml"), "title: t\n").unwrap();
    std::fs::write(src.join("resources/w.crd.yaml"), "kind: CRD\n").unwrap();
    let out = stackd(&["copy", src.to_str().unwrap(), dest.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(dest.join("resources/w.crd.yaml")).unwrap(),
        "kind: CRD\n"
    );

    std::os::unix::fs::symlink("../../etc-passwd", src.join("resources/secret")).unwrap();
    let out = stackd(&[
        "copy",
        src.to_str().unwrap(),
        dir.path().join("again").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("stackd copy: "), "{stderr}");
    assert!(
        stderr.contains("resources/secret") && stderr.contains("points outside the tree"),
        "{stderr}"
    );
}
