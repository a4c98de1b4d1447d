//! The `stackd` binary's own surface.

use std::process::Command;

fn stackd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(args)
        .output()
        .expect("run stackd")
}

#[test]
fn crds_command_prints_the_eight_crds() {
    let out = stackd(&["crds"]);
    assert!(out.status.success());
    let stream = String::from_utf8(out.stdout).expect("utf-8");
    let crds: Vec<serde_json::Value> = serde_saphyr::from_multiple(&stream).expect("YAML stream");
    assert_eq!(crds.len(), 8);
    assert!(crds.iter().all(|c| c["kind"] == "CustomResourceDefinition"));
}

#[test]
fn crds_out_writes_one_file_per_crd() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = stackd(&["crds", "--out", dir.path().to_str().expect("path")]);
    assert!(out.status.success());
    assert_eq!(std::fs::read_dir(dir.path()).expect("read dir").count(), 8);
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
fn unfinished_commands_say_what_they_wait_for() {
    let out = stackd(&["bench", "--quick"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not available yet"));
}

#[test]
fn bad_flags_are_refused_with_usage() {
    let out = stackd(&["unpack", "--content-dir", "x", "--permission-scope", "Everything"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Namespaced or Cluster"));
}
