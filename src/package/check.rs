//! `stackd package check`: every verdict the daemon would give an install of a package, judged on
//! the author's machine, each problem with its file, field and fix, all at once.
//!
//! Nothing here is a rule of its own: each verdict is the daemon's function, called in the order an
//! install meets them — the registry allow-list at admission ([`AllowedRegistries::refusal`]), the
//! install Job's `stackd unpack` ([`unpack::unpack`], the v1beta1 conversion included, and the
//! stream it prints, [`stream::encode`]), the daemon's reading of that stream with its limits
//! ([`stream::decode`]), the package's scope, controller and CRDs ([`package::package_problems`]),
//! and the Stack controller's permission rules ([`rbac::validate_permissions`]). What depends on the
//! tenant's CRDs (who owns a group already) is not judged; dependencies on groups another stack
//! installed are named with `--installed-group`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionSpec,
};
use kube::api::ObjectMeta;
use serde::Serialize;

use crate::api::stacks::PermissionScope;
use crate::context::crd_groups::CrdGroups;
use crate::context::pod_policy::PodPolicy;
use crate::context::registries::AllowedRegistries;
use crate::stacks::MANAGED_CRD_LABEL;
use crate::stacks::install::crd_policy::{CrdRefusal, CrdRules};
use crate::stacks::install::package::{self, PackageError, PackageRules};
use crate::stacks::stack::deployment::SpecError;
use crate::stacks::stack::rbac;
use crate::stacks::stream::{self, StreamError};
use crate::stacks::unpack::{self, UnpackError, UnpackOptions};

/// What the package is judged against: the daemon's flags of the same names.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The package directory (holding `.registry`) or its `.registry` directory.
    pub dir: PathBuf,
    /// The install's scope; the one app.yaml declares when not given.
    pub scope: Option<PermissionScope>,
    /// The package image the install will name: judged against the registries, run by controller
    /// containers that name no image.
    pub image: Option<String>,
    /// `--allowed-registries`.
    pub registries: AllowedRegistries,
    /// `--stack-crd-groups`.
    pub crd_groups: CrdGroups,
    /// `--platform-dependency-groups`: the platform's types stacks may depend on.
    pub types: CrdGroups,
    /// API groups whose CRDs other stacks installed on the tenant (dependencies on them are allowed).
    pub installed_groups: Vec<String>,
    /// `--max-package-crds`.
    pub max_crds: usize,
    pub pod_policy: PodPolicy,
    pub pass_full_deployment: bool,
    pub allow_conversion_webhooks: bool,
    pub allow_all_apigroups: bool,
}

/// Controller containers naming no image run the package image; without `--image`, this stands in
/// for it (and is not judged against the registries).
const UNNAMED_PACKAGE_IMAGE: &str = "package-image:check";

/// One reason the daemon would refuse the package.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The install's `Ready` reason (or, for permissions, the Stack's) the daemon would give.
    pub reason: &'static str,
    /// The file, relative to the `.registry` directory (empty when it is none of them).
    pub file: String,
    /// The field within it, when one is to blame.
    pub field: String,
    pub message: String,
    pub fix: String,
}

/// The verdict on a package: every problem, in the order an install meets them.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub registry_dir: PathBuf,
    pub scope: PermissionScope,
    pub problems: Vec<Problem>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }

    /// The reason the daemon would give first, `None` when it would install the package.
    pub fn first_reason(&self) -> Option<&'static str> {
        self.problems.first().map(|problem| problem.reason)
    }

    /// One block per problem, for a terminal.
    pub fn to_text(&self) -> String {
        if self.passed() {
            return format!(
                "{}: the package passes every check the daemon makes of a {} install\n",
                self.registry_dir.display(),
                self.scope.as_str()
            );
        }
        let mut text = format!(
            "{}: {} problem(s) the daemon would refuse the install for:\n",
            self.registry_dir.display(),
            self.problems.len()
        );
        for (i, problem) in self.problems.iter().enumerate() {
            let place = match (problem.file.as_str(), problem.field.as_str()) {
                ("", "") => String::new(),
                (file, "") => format!(" {file}"),
                ("", field) => format!(" ({field})"),
                (file, field) => format!(" {file} ({field})"),
            };
            text.push_str(&format!(
                "{}. [{}]{place}\n   {}\n   fix: {}\n",
                i + 1,
                problem.reason,
                problem.message,
                problem.fix
            ));
        }
        text
    }
}

/// The `.registry` directory of a package directory, or `dir` itself.
pub fn registry_dir(dir: &Path) -> PathBuf {
    let inner = dir.join(".registry");
    if inner.is_dir() { inner } else { dir.to_path_buf() }
}

/// Judges the package as the daemon would judge an install of it.
pub fn check(options: &CheckOptions) -> Report {
    let dir = registry_dir(&options.dir);
    let scope = options.scope.unwrap_or_else(|| unpack::declared_scope(&dir));
    let mut report = Report {
        registry_dir: dir.clone(),
        scope,
        problems: Vec::new(),
    };
    let problems = &mut report.problems;
    if let Some(image) = &options.image
        && let Some(message) = options.registries.refusal("the package image", image)
    {
        problems.push(Problem {
            reason: "RegistryNotAllowed",
            file: String::new(),
            field: "spec.package".into(),
            message,
            fix: "push the package to a registry the host allows".into(),
        });
    }
    let unpacked = unpack::unpack(&UnpackOptions {
        content_dir: dir.clone(),
        permission_scope: scope,
        package_image: Some(options.image.clone().unwrap_or_else(|| UNNAMED_PACKAGE_IMAGE.into())),
        templating_controller_image: unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
        stackd_image: crate::stacks::default_stackd_image(),
    });
    // The Job prints the stream; the daemon reads it back with its limits.
    let contents = match unpacked.and_then(|contents| Ok(stream::encode(&contents)?)) {
        Err(err) => {
            unpack_problems(&dir, err, problems);
            return report;
        }
        Ok(log) => match stream::decode(&log, options.max_crds) {
            Err(err) => {
                problems.push(stream_problem(err));
                return report;
            }
            Ok(contents) => contents,
        },
    };
    let kind = match scope {
        PermissionScope::Namespaced => "StackInstall",
        PermissionScope::Cluster => "ClusterStackInstall",
    };
    let rules = PackageRules {
        scope,
        kind,
        pass_full_deployment: options.pass_full_deployment,
        crd_rules: CrdRules {
            groups: &options.crd_groups,
            allow_conversion_webhooks: options.allow_conversion_webhooks,
        },
        pod_policy: &options.pod_policy,
        registries: &options.registries,
        stackd_image: &crate::stacks::default_stackd_image(),
    };
    let crd_files = CrdFiles::read(&dir);
    for err in package::package_problems(&contents, &rules) {
        problems.push(package_problem(err, &crd_files));
    }
    if !options.allow_all_apigroups {
        let installed: Vec<Arc<CustomResourceDefinition>> = options
            .installed_groups
            .iter()
            .map(|group| installed_crd(group))
            .collect();
        if let Err(message) = rbac::validate_permissions(&contents.stack.spec, &installed, &options.types) {
            problems.push(Problem {
                reason: "PermissionsRefused",
                file: "app.yaml".into(),
                field: "dependsOn".into(),
                message,
                fix: "depend only on the platform's types (--types) and groups other stacks install (--installed-group), and keep CRDs out of stackd's and Kubernetes' groups".into(),
            });
        }
    }
    report
}

/// A CRD another stack installed in `group`, as the tenant would show it to the Stack controller.
fn installed_crd(group: &str) -> Arc<CustomResourceDefinition> {
    let crd = CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(format!("installed.{group}")),
            labels: Some([(MANAGED_CRD_LABEL.to_string(), "true".to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: group.to_string(),
            ..Default::default()
        },
        status: None,
    };
    Arc::new(crd)
}

fn relative(dir: &Path, path: &Path) -> String {
    path.strip_prefix(dir).unwrap_or(path).display().to_string()
}

/// Each of unpack's problems, with its file and field.
fn unpack_problems(dir: &Path, err: UnpackError, problems: &mut Vec<Problem>) {
    let problem = |file: String, field: &str, message: String, fix: &str| Problem {
        reason: "InstallJobFailed",
        file,
        field: field.into(),
        message,
        fix: fix.into(),
    };
    let message = err.to_string();
    let found = match err {
        UnpackError::Several { problems: all, more } => {
            for one in all {
                unpack_problems(dir, one, problems);
            }
            if more > 0 {
                problems.push(problem(
                    String::new(),
                    "",
                    format!("and {more} more problems unpack stops listing at"),
                    "fix the problems above and check again",
                ));
            }
            return;
        }
        UnpackError::MissingApp(_) => problem(
            "app.yaml".into(),
            "",
            message,
            "add app.yaml (`stackd package init` writes one)",
        ),
        UnpackError::Read { path, .. } => problem(relative(dir, &path), "", message, "make the file readable"),
        UnpackError::Parse { path, .. } => problem(relative(dir, &path), "", message, "fix the YAML"),
        UnpackError::ScopeMismatch { .. } => problem(
            "app.yaml".into(),
            "permissionScope",
            message,
            "declare the scope of the install kind that will install the package",
        ),
        UnpackError::NotDeployment { path, .. } => problem(
            relative(dir, &path),
            "kind",
            message,
            "keep exactly one apps/v1 Deployment in install.yaml",
        ),
        UnpackError::MissingImage { path, container } => problem(
            relative(dir, &path),
            &format!("spec.template.spec.containers[{container}].image"),
            message,
            "name an image, or pass --image to check as the install will run it",
        ),
        UnpackError::NotCrd { path, .. } => problem(
            relative(dir, &path),
            "kind",
            message,
            "keep only CustomResourceDefinitions in *crd.yaml files",
        ),
        UnpackError::Conversion { path, .. } => problem(
            relative(dir, &path),
            "spec",
            message,
            "fix the v1beta1 CRD, or write it as apiextensions.k8s.io/v1",
        ),
        UnpackError::Metadata(_) => problem(String::new(), "", message, "fix the UI metadata file named"),
        UnpackError::Behavior { path, .. } => problem(
            relative(dir, &path),
            "",
            message,
            "fix behavior.yaml as the message says",
        ),
        UnpackError::Stream(_) | UnpackError::Write(_) => {
            problem(String::new(), "", message, "shrink the package's CRDs and metadata")
        }
    };
    problems.push(found);
}

fn stream_problem(err: StreamError) -> Problem {
    let reason = match err {
        StreamError::TooManyCrds { .. } => "TooManyCRDs",
        _ => "InvalidPackage",
    };
    Problem {
        reason,
        file: String::new(),
        field: String::new(),
        message: err.to_string(),
        fix: "split the package, or shrink its CRDs".into(),
    }
}

fn package_problem(err: PackageError, crd_files: &CrdFiles) -> Problem {
    let reason = err.reason();
    let (file, field, fix) = match &err {
        PackageError::WrongScope { .. } => (
            "app.yaml".to_string(),
            "permissionScope",
            "declare the scope of the install kind that will install the package",
        ),
        PackageError::Controller(SpecError::Invalid(_)) => {
            ("install.yaml".into(), "spec", "write spec as an apps/v1 DeploymentSpec")
        }
        PackageError::Controller(SpecError::Unsafe(_)) => (
            "install.yaml".into(),
            "spec.template",
            "remove each field the message names from the pod template",
        ),
        PackageError::Controller(SpecError::ImageNotAllowed(_)) => (
            "install.yaml".into(),
            "spec.template.spec.containers[].image",
            "use images from a registry the host allows",
        ),
        PackageError::Crd(refusal) => {
            let name = match refusal {
                CrdRefusal::ReservedGroup { name, .. }
                | CrdRefusal::NotOurs { name, .. }
                | CrdRefusal::SharedChange { name, .. }
                | CrdRefusal::GroupTaken { name, .. }
                | CrdRefusal::ConversionWebhook { name }
                | CrdRefusal::GroupNotAllowed { name, .. } => name,
            };
            let field = match refusal {
                CrdRefusal::ConversionWebhook { .. } => "spec.conversion",
                _ => "spec.group",
            };
            let fix = match refusal {
                CrdRefusal::ConversionWebhook { .. } => "remove spec.conversion (or use strategy: None)",
                _ => "move the CRD to an API group of your own that the host allows",
            };
            (crd_files.file_of(name), field, fix)
        }
        PackageError::DropsServedVersion { .. } | PackageError::CrdTerminating(_) => {
            (String::new(), "", "see the message")
        }
    };
    Problem {
        reason,
        file,
        field: field.into(),
        message: err.to_string(),
        fix: fix.into(),
    }
}

/// Which `*crd.yaml` file holds which CRD (by name), to point a CRD's problem at its file.
struct CrdFiles(Vec<(String, String)>);

impl CrdFiles {
    /// The package was unpacked already: its files are known to be readable and within bounds.
    fn read(dir: &Path) -> CrdFiles {
        let mut found = Vec::new();
        let mut pending = vec![dir.to_path_buf()];
        while let Some(at) = pending.pop() {
            let Ok(entries) = std::fs::read_dir(&at) else { continue };
            for path in entries.flatten().map(|entry| entry.path()) {
                if path.is_dir() {
                    pending.push(path);
                } else if path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with("crd.yaml"))
                {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).unwrap_or_default();
                    for document in documents {
                        if let Some(name) = document["metadata"]["name"].as_str() {
                            found.push((name.to_string(), relative(dir, &path)));
                        }
                    }
                }
            }
        }
        CrdFiles(found)
    }

    fn file_of(&self, name: &str) -> String {
        self.0
            .iter()
            .find(|(crd, _)| crd == name)
            .map(|(_, file)| file.clone())
            .unwrap_or_default()
    }
}

impl CheckOptions {
    /// The daemon's defaults for a package in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> CheckOptions {
        CheckOptions {
            dir: dir.into(),
            scope: None,
            image: None,
            registries: AllowedRegistries::default(),
            crd_groups: CrdGroups::default(),
            types: CrdGroups::platform_types(),
            installed_groups: Vec::new(),
            max_crds: crate::context::stack_limits::DEFAULT_MAX_PACKAGE_CRDS,
            pod_policy: PodPolicy::default(),
            pass_full_deployment: false,
            allow_conversion_webhooks: false,
            allow_all_apigroups: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
    }

    fn sample() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/packages/sample-stack")
    }

    #[test]
    fn the_sample_packages_pass() {
        let report = check(&CheckOptions::new(sample()));
        assert!(report.passed(), "{}", report.to_text());
        // The cluster stack depends on the sample's Widgets: allowed once a stack installed them.
        let mut options = CheckOptions::new(sample().with_file_name("cluster-stack"));
        assert_eq!(check(&options).first_reason(), Some("PermissionsRefused"));
        options.installed_groups = vec!["samples.example.org".into()];
        let report = check(&options);
        assert!(report.passed(), "{}", report.to_text());
        assert_eq!(report.scope, PermissionScope::Cluster);
    }

    #[test]
    fn a_broken_package_lists_every_problem_in_one_run() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join(".registry");
        write(
            &root,
            &[
                ("app.yaml", "title: t\n"),
                ("resources/a.crd.yaml", "apiVersion: v1\nkind: ConfigMap\n"),
                (
                    "resources/b.crd.yaml",
                    "apiVersion: apiextensions.k8s.io/v1beta1\nkind: CustomResourceDefinition\nspec: {group: g.example.org}\n",
                ),
                ("install.yaml", "apiVersion: v1\nkind: Service\n"),
            ],
        );
        let report = check(&CheckOptions::new(dir.path()));
        let found: Vec<(&str, &str, &str)> = report
            .problems
            .iter()
            .map(|p| (p.reason, p.file.as_str(), p.field.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("InstallJobFailed", "resources/a.crd.yaml", "kind"),
                ("InstallJobFailed", "resources/b.crd.yaml", "spec"),
                ("InstallJobFailed", "install.yaml", "kind"),
            ],
            "{}",
            report.to_text()
        );
    }

    #[test]
    fn package_policy_problems_are_all_listed_with_their_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join(".registry");
        let from = sample().join(".registry");
        let app = std::fs::read_to_string(from.join("app.yaml")).expect("app")
            + "dependsOn:\n- crd: gadgets.elsewhere.example.net/v1\n";
        let install = std::fs::read_to_string(from.join("install.yaml"))
            .expect("install")
            .replace(
                "      - name: controller\n",
                "      - name: controller\n        securityContext:\n          privileged: true\n",
            );
        let crd = std::fs::read_to_string(from.join("resources/widget.crd.yaml")).expect("crd");
        let reserved = crd
            .replace("widgets.samples.example.org", "widgets.stacks.stackd.dev")
            .replace("group: samples.example.org", "group: stacks.stackd.dev");
        write(
            &root,
            &[
                ("app.yaml", &app),
                ("install.yaml", &install),
                ("resources/widget.crd.yaml", &crd),
                ("resources/reserved.crd.yaml", &reserved),
            ],
        );
        let mut options = CheckOptions::new(dir.path());
        options.image = Some("evil.example.com/stack:v1".into());
        options.registries = "quay.io".parse().expect("registries");
        let report = check(&options);
        let found: Vec<(&str, &str, &str)> = report
            .problems
            .iter()
            .map(|p| (p.reason, p.file.as_str(), p.field.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("RegistryNotAllowed", "", "spec.package"),
                ("PodSpecRefused", "install.yaml", "spec.template"),
                (
                    "RegistryNotAllowed",
                    "install.yaml",
                    "spec.template.spec.containers[].image"
                ),
                ("CRDGroupReserved", "resources/reserved.crd.yaml", "spec.group"),
                ("PermissionsRefused", "app.yaml", "dependsOn"),
            ],
            "{}",
            report.to_text()
        );
        assert!(
            report.problems[1].message.contains("privileged"),
            "{}",
            report.to_text()
        );
        let mut installed = options.clone();
        installed.installed_groups = vec!["elsewhere.example.net".into()];
        let report = check(&installed);
        let permissions = &report.problems.last().expect("problems").message;
        assert!(
            permissions.contains("stacks.stackd.dev") && !permissions.contains("elsewhere.example.net"),
            "{permissions}"
        );
    }

    #[test]
    fn the_install_kind_and_the_crd_bound_are_the_daemons() {
        let mut options = CheckOptions::new(sample());
        options.scope = Some(PermissionScope::Cluster);
        let report = check(&options);
        assert_eq!(report.first_reason(), Some("InstallJobFailed"), "{}", report.to_text());
        assert_eq!(report.problems[0].field, "permissionScope");
        let mut options = CheckOptions::new(sample());
        options.max_crds = 0;
        assert_eq!(check(&options).first_reason(), Some("TooManyCRDs"));
    }
}
