//! `stackd package init`: a new package directory whose `.registry` passes `stackd package check`
//! and installs as it is: app.yaml, one CRD of the package's own API group, and the controller
//! (install.yaml), or, for a templating stack, behavior.yaml and a kustomization it renders.

use std::path::{Path, PathBuf};

use crate::api::stacks::PermissionScope;

/// What `init` writes.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// The package directory; its name names the package (a DNS label).
    pub dir: PathBuf,
    pub scope: PermissionScope,
    /// A templating stack (behavior.yaml) instead of a controller of its own (install.yaml).
    pub templating: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(
        "{0:?} cannot name a package: use a directory named as a DNS label (lowercase letters, digits and '-', starting with a letter), e.g. my-stack"
    )]
    BadName(String),
    #[error("{0} exists already and is not empty: init writes a new package only, and overwrites nothing")]
    NotEmpty(PathBuf),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// `my-stack` → `MyStack`.
fn kind_of(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect()
}

fn valid_name(name: &str) -> bool {
    name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The files of the new package, relative to its directory.
pub fn files(name: &str, scope: PermissionScope, templating: bool) -> Vec<(String, String)> {
    let kind = kind_of(name);
    let plural = format!("{}s", kind.to_ascii_lowercase());
    let group = format!("{name}.example.org");
    let crd_scope = match scope {
        PermissionScope::Namespaced => "Namespaced",
        PermissionScope::Cluster => "Cluster",
    };
    let install_kind = match scope {
        PermissionScope::Namespaced => "StackInstall",
        PermissionScope::Cluster => "ClusterStackInstall",
    };
    let app = format!(
        "# What the stack is: stackd reads title, version and permissionScope; the rest is shown to users.
title: {kind}
overviewShort: {kind}s, served by the {name} stack.
version: 0.1.0
# Namespaced: installed by a StackInstall, its controller sees its namespace; Cluster: by a
# ClusterStackInstall.
permissionScope: {scope}
license: Apache-2.0
# Other stacks' kinds this stack uses, e.g. `- crd: buckets.storage.example.org/v1alpha1`.
dependsOn: []
",
        scope = scope.as_str()
    );
    let crd = format!(
        "apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {plural}.{group}
spec:
  group: {group}
  names:
    kind: {kind}
    listKind: {kind}List
    plural: {plural}
    singular: {singular}
  scope: {crd_scope}
  versions:
  - name: v1alpha1
    served: true
    storage: true
    subresources:
      status: {{}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size:
                type: integer
                minimum: 1
          status:
            type: object
            x-kubernetes-preserve-unknown-fields: true
",
        singular = kind.to_ascii_lowercase()
    );
    let mut files = vec![
        (".registry/app.yaml".to_string(), app),
        (format!(".registry/resources/{plural}.crd.yaml"), crd),
    ];
    if templating {
        files.push((
            ".registry/behavior.yaml".into(),
            format!(
                "# A templating stack: the templating controller renders kustomize/ for each {kind}.
crd:
  apiVersion: {group}/v1alpha1
  kind: {kind}
engine:
  type: kustomize
source:
  path: /.registry/kustomize
"
            ),
        ));
        files.push((
            ".registry/kustomize/kustomization.yaml".into(),
            "resources:\n- configmap.yaml\n".into(),
        ));
        files.push((
            ".registry/kustomize/configmap.yaml".into(),
            format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\ndata:\n  rendered: \"true\"\n"),
        ));
    } else {
        files.push((
            ".registry/install.yaml".into(),
            format!(
                "# The stack's controller. A container without an image runs the package image; stackd
# gives the pod the tenant's API server and a token for the stack's permissions.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}-controller
spec:
  replicas: 1
  selector:
    matchLabels:
      app: {name}-controller
  template:
    metadata:
      labels:
        app: {name}-controller
    spec:
      containers:
      - name: controller
        resources:
          requests:
            cpu: 10m
            memory: 32Mi
"
            ),
        ));
    }
    files.push((
        "README.md".into(),
        format!(
            "# {name}

A stack package for stackd. `.registry/` is what the package image holds at `/.registry`.

    stackd package check {name}
    stackd package build {name} -t registry.example.com/{name}:v0.1.0 -o {name}.oci.tar
    stackd package push {name}.oci.tar registry.example.com/{name}:v0.1.0

Then install it with a {install_kind} whose `spec.package` is `registry.example.com/{name}:v0.1.0`.
"
        ),
    ));
    files
}

/// Writes a new package into `options.dir` (created; an existing one must be empty).
pub fn init(options: &InitOptions) -> Result<Vec<PathBuf>, InitError> {
    let dir = &options.dir;
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    if !valid_name(&name) {
        return Err(InitError::BadName(name));
    }
    if dir.exists() && std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(InitError::NotEmpty(dir.clone()));
    }
    let mut written = Vec::new();
    for (relative, text) in files(&name, options.scope, options.templating) {
        let path = dir.join(&relative);
        let failed = |source| InitError::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new("."))).map_err(failed)?;
        std::fs::write(&path, text).map_err(failed)?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::package::check::{CheckOptions, check};

    #[test]
    fn every_kind_of_new_package_passes_check() {
        for (scope, templating) in [
            (PermissionScope::Namespaced, false),
            (PermissionScope::Cluster, false),
            (PermissionScope::Namespaced, true),
        ] {
            let parent = tempfile::tempdir().expect("temp dir");
            let dir = parent.path().join("my-stack");
            init(&InitOptions {
                dir: dir.clone(),
                scope,
                templating,
            })
            .expect("init");
            let report = check(&CheckOptions::new(&dir));
            assert!(report.passed(), "{scope:?} {templating}: {}", report.to_text());
            assert_eq!(report.scope, scope);
            let again = init(&InitOptions { dir, scope, templating });
            assert!(matches!(again, Err(InitError::NotEmpty(_))), "nothing is overwritten");
        }
    }

    #[test]
    fn a_directory_that_cannot_name_a_package_is_refused() {
        let parent = tempfile::tempdir().expect("temp dir");
        let err = init(&InitOptions {
            dir: parent.path().join("My_Stack"),
            scope: PermissionScope::Namespaced,
            templating: false,
        })
        .expect_err("refused");
        assert!(matches!(err, InitError::BadName(_)), "{err}");
        assert_eq!(kind_of("my-stack2"), "MyStack2");
    }
}
