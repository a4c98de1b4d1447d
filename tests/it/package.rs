//! `stackd package` (issue 49): a new package installs as it is, `check` gives the daemon's verdict
//! on every package the suite installs, and a built image unpacks as the install Job unpacks it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use stackd::api::stacks::{ClusterStackInstall, PermissionScope, Stack, StackInstall};
use stackd::embedded::controller_manager::ImageMatch;
use stackd::embedded::samples::{SampleImages, register_sample_runners};
use stackd::package::check::{CheckOptions, check};
use stackd::stacks::install::FAILURE_REASONS;
use stackd::stacks::stream;

use super::stacks_crossplane::{install_platform_types, write_provider, write_templating_stack};
use super::stacks_install::{
    STACKD_TEST_IMAGE, StackFleet, crd_names, create_install, create_namespace, wait_for_reason,
};
use crate::harness::{Daemon, NoDaemon, wait_until};

const REGISTRY: &str = "registry.example.com";

pub(crate) fn stackd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(args)
        .output()
        .expect("run stackd")
}

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `stackd package build DIR -t IMAGE -o OUT`: its output, whatever it came to.
pub(crate) fn build(dir: &Path, image: &str, out: &Path) -> Output {
    let (dir, out) = (dir.to_str().expect("utf-8"), out.to_str().expect("utf-8"));
    stackd(&["package", "build", dir, "-t", image, "-o", out])
}

pub(crate) fn init(dir: &Path, extra: &[&str]) {
    let mut args = vec!["package", "init", dir.to_str().expect("utf-8")];
    args.extend_from_slice(extra);
    let out = stackd(&args);
    assert!(out.status.success(), "init: {}", text(&out.stderr));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_package_passes_check_and_a_tenant_installs_it_as_is() {
    let fleet = StackFleet::start(&["acme"]).await;
    fleet
        ._host
        .runners()
        .without_user(ImageMatch::Prefix("crossplane/templating-controller".into()));
    let packages = fleet.dir.path().join("packages");
    let tenant = fleet.tenant("acme");
    for (name, extra) in [("my-stack", &[][..]), ("my-templates", &["--templating"][..])] {
        let dir = packages.join(name);
        init(&dir, extra);
        let out = stackd(&["package", "check", dir.to_str().expect("utf-8")]);
        assert!(out.status.success(), "check: {}", text(&out.stdout));
        assert!(
            text(&out.stdout).contains("passes every check"),
            "{}",
            text(&out.stdout)
        );
    }
    let daemon = fleet.daemon(&[]);
    for name in ["my-stack", "my-templates"] {
        let package = format!("{REGISTRY}/{name}:v0.1.0");
        create_install(&tenant, "team-a", name, json!({ "package": package })).await;
    }
    for name in ["my-stack", "my-templates"] {
        let (status, _, message) = wait_for_reason(&tenant, "team-a", name, &daemon, "Available").await;
        assert_eq!(status, "True", "{name}: {message}");
    }
    let crds = crd_names(&tenant).await;
    for crd in ["mystacks.my-stack.example.org", "mytemplatess.my-templates.example.org"] {
        assert!(crds.iter().any(|c| c == crd), "{crd} missing from {crds:?}");
    }
}

/// Copies the sample package to `name` with `edit` applied to each file's text (by relative path).
fn variant(packages: &Path, name: &str, edit: impl Fn(&str, String) -> String) {
    let from = packages.join("sample-stack/.registry");
    let to = packages.join(name).join(".registry");
    for file in ["app.yaml", "install.yaml", "resources/widget.crd.yaml"] {
        let text = std::fs::read_to_string(from.join(file)).expect("read sample");
        let path = to.join(file);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, edit(file, text)).expect("write");
    }
}

/// The sample's CRD moved to API group `group`.
fn regroup(text: String, group: &str) -> String {
    text.replace("samples.example.org", group)
}

/// The packages this test adds to the suite's, each refused (or not) for another reason.
fn write_crafted(packages: &Path) {
    variant(packages, "reserved-stack", |file, text| {
        if file.ends_with("crd.yaml") {
            regroup(text, "stacks.stackd.dev")
        } else {
            text
        }
    });
    variant(packages, "webhook-stack", |file, text| {
        if file.ends_with("crd.yaml") {
            regroup(text, "hooks.example.org")
                + "  conversion:\n    strategy: Webhook\n    webhook:\n      conversionReviewVersions: [v1]\n      clientConfig:\n        url: https://converter.example/convert\n"
        } else {
            text
        }
    });
    variant(packages, "depends-stack", |file, text| match file {
        "app.yaml" => text + "dependsOn:\n- crd: gadgets.elsewhere.example.net/v1\n",
        "resources/widget.crd.yaml" => regroup(text, "deps.example.org"),
        _ => text,
    });
    variant(packages, "foreign-image-stack", |file, text| {
        if file == "install.yaml" {
            text.replace(
                "      - name: controller\n",
                "      - name: controller\n        image: evil.example.com/controller:v1\n",
            )
        } else {
            regroup(text, "foreign.example.org")
        }
    });
    variant(packages, "many-crds-stack", |file, text| {
        if file.ends_with("crd.yaml") {
            let crd = regroup(text, "many.example.org");
            let more = |plural: &str, kind: &str| crd.replace("widget", plural).replace("Widget", kind);
            [crd.clone(), more("gadget", "Gadget"), more("gizmo", "Gizmo")].join("---\n")
        } else {
            text
        }
    });
    let beta = packages.join("beta-stack/.registry");
    std::fs::create_dir_all(beta.join("resources")).expect("mkdir");
    std::fs::write(beta.join("app.yaml"), "title: Buckets\npermissionScope: Namespaced\n").expect("app");
    std::fs::write(
        beta.join("resources/bucket.crd.yaml"),
        "apiVersion: apiextensions.k8s.io/v1beta1\nkind: CustomResourceDefinition\nmetadata:\n  name: buckets.storage.example.org\nspec:\n  group: storage.example.org\n  names: {kind: Bucket, plural: buckets}\n  scope: Namespaced\n  version: v1alpha1\n  validation:\n    openAPIV3Schema:\n      type: object\n      properties:\n        spec:\n          type: object\n          properties:\n            size: {type: integer}\n",
    )
    .expect("crd");
    let broken = packages.join("broken-stack/.registry");
    std::fs::create_dir_all(broken.join("resources")).expect("mkdir");
    std::fs::write(broken.join("app.yaml"), "title: Broken\n").expect("app");
    std::fs::write(broken.join("resources/a.crd.yaml"), "apiVersion: v1\nkind: ConfigMap\n").expect("crd");
    std::fs::write(broken.join("install.yaml"), "apiVersion: v1\nkind: Service\n").expect("install");
}

/// The daemon's flags in this test, and `check`'s options of the same meaning.
const DAEMON_FLAGS: [&str; 4] = ["--allowed-registries", REGISTRY, "--max-package-crds", "2"];

fn check_options(dir: PathBuf, image: &str, installed: &[&str]) -> CheckOptions {
    let mut options = CheckOptions::new(dir);
    options.image = Some(image.to_string());
    options.registries = REGISTRY.parse().expect("registries");
    options.max_crds = 2;
    options.installed_groups = installed.iter().map(|g| g.to_string()).collect();
    options
}

/// The daemon's verdict on an install: `Available`, or the reason it refuses it for (the Stack's,
/// when the Stack controller refuses the permissions).
async fn daemon_verdict(tenant: &Client, cluster: bool, name: &str, daemon: &Daemon) -> (String, String) {
    wait_until(
        &format!("the daemon's verdict on {name}"),
        Duration::from_secs(30),
        daemon,
        || async {
            let install: Value = if cluster {
                let api: Api<ClusterStackInstall> = Api::namespaced(tenant.clone(), name);
                serde_json::to_value(api.get_opt(name).await.ok()??).ok()?
            } else {
                let api: Api<StackInstall> = Api::namespaced(tenant.clone(), name);
                serde_json::to_value(api.get_opt(name).await.ok()??).ok()?
            };
            let conditions = install["status"]["conditions"].as_array()?.clone();
            let ready = conditions.into_iter().find(|c| c["type"] == "Ready")?;
            let (status, reason) = (ready["status"].as_str()?, ready["reason"].as_str()?);
            let message = ready["message"].as_str().unwrap_or_default().to_string();
            if status == "True" {
                return Some(("Available".to_string(), message));
            }
            if FAILURE_REASONS.contains(&reason) {
                return Some((reason.to_string(), message));
            }
            let stack = Api::<Stack>::namespaced(tenant.clone(), name)
                .get_opt(name)
                .await
                .ok()??;
            let refused = stack.status?.conditions.into_iter().find(|c| c.type_ == "Ready")?;
            (refused.reason == "PermissionsRefused").then_some((refused.reason, refused.message))
        },
    )
    .await
}

async fn install(tenant: &Client, cluster: bool, name: &str, package: &str) {
    create_namespace(tenant, name).await;
    if cluster {
        let install: ClusterStackInstall = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": name},
            "spec": {"package": package},
        }))
        .expect("install");
        Api::<ClusterStackInstall>::namespaced(tenant.clone(), name)
            .create(&PostParams::default(), &install)
            .await
            .expect("create");
    } else {
        create_install(tenant, name, name, json!({ "package": package })).await;
    }
}

/// Installs each package and compares the daemon's verdict with `check`'s: the same reason (or
/// both accept), and the daemon's message holds check's first.
async fn agree(fleet: &StackFleet, tenant: &str, daemon: &Daemon, cases: &[(&str, &str, &[&str])]) {
    let client = fleet.tenant(tenant);
    let packages = fleet.dir.path().join("packages");
    let mut expected = Vec::new();
    for (name, image, installed) in cases {
        let report = check(&check_options(packages.join(name), image, installed));
        let cluster = report.scope == PermissionScope::Cluster;
        install(&client, cluster, name, image).await;
        expected.push((name, cluster, report));
    }
    for (name, cluster, report) in expected {
        let (reason, message) = daemon_verdict(&client, cluster, name, daemon).await;
        assert_eq!(
            report.first_reason().unwrap_or("Available"),
            reason,
            "{name}: the daemon says {message}\ncheck says {}",
            report.to_text()
        );
        if let Some(first) = report.problems.first() {
            let head: String = first.message.chars().take(120).collect();
            assert!(
                message.contains(&head),
                "{name}: the daemon says {message}\ncheck: {head}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn check_gives_the_daemons_verdict_on_every_package_of_the_suite() {
    let fleet = StackFleet::start(&["acme", "beta"]).await;
    let packages = fleet.dir.path().join("packages");
    write_crafted(&packages);
    let daemon = fleet.daemon(&DAEMON_FLAGS);
    let image = |name: &str| format!("{REGISTRY}/{name}:v1");
    // The sample first: the cluster stack depends on its Widgets, which a stack must have installed.
    agree(
        &fleet,
        "acme",
        &daemon,
        &[("sample-stack", &image("sample-stack"), &[])],
    )
    .await;
    let images: Vec<(&str, String)> = [
        "cluster-stack",
        "hostpath-stack",
        "privileged-stack",
        "reserved-stack",
        "webhook-stack",
        "depends-stack",
        "foreign-image-stack",
        "many-crds-stack",
        "beta-stack",
        "broken-stack",
    ]
    .into_iter()
    .map(|name| (name, image(name)))
    .collect();
    let cases: Vec<(&str, &str, &[&str])> = images
        .iter()
        .map(|(name, image)| (*name, image.as_str(), &["samples.example.org"][..]))
        .collect();
    agree(&fleet, "acme", &daemon, &cases).await;
    // The sample from a registry the host does not allow.
    let client = fleet.tenant("acme");
    let foreign = "evil.example.com/sample-stack:v1";
    let report = check(&check_options(packages.join("sample-stack"), foreign, &[]));
    install(&client, false, "foreign-package", foreign).await;
    let (reason, message) = daemon_verdict(&client, false, "foreign-package", &daemon).await;
    assert_eq!(
        report.first_reason(),
        Some(reason.as_str()),
        "{message}\n{}",
        report.to_text()
    );
    // The next version of the sample, and the Crossplane packages (whose CRDs share groups with
    // packages above), in a tenant of their own: in acme another package holds their groups.
    write_provider(&fleet);
    write_templating_stack(&fleet);
    install_platform_types(&fleet.tenant("beta")).await;
    let beta: Vec<String> = ["sample-stack-next", "xp-provider", "xp-sample"]
        .into_iter()
        .map(image)
        .collect();
    agree(
        &fleet,
        "beta",
        &daemon,
        &[
            ("sample-stack-next", &beta[0], &[]),
            ("xp-provider", &beta[1], &[]),
            ("xp-sample", &beta[2], &[]),
        ],
    )
    .await;
}

#[test]
fn check_lists_every_problem_of_a_broken_package_as_json_for_ci() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_crafted(&{
        let packages = dir.path().join("packages");
        let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/packages/sample-stack/.registry");
        for file in ["app.yaml", "install.yaml", "resources/widget.crd.yaml"] {
            let to = packages.join("sample-stack/.registry").join(file);
            std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
            std::fs::copy(sample.join(file), to).expect("copy");
        }
        packages
    });
    let broken = dir.path().join("packages/broken-stack");
    let out = stackd(&["package", "check", broken.to_str().expect("utf-8"), "--output", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let found: Vec<(String, String)> = report["problems"]
        .as_array()
        .expect("problems")
        .iter()
        .map(|p| {
            (
                p["file"].as_str().unwrap_or("").into(),
                p["field"].as_str().unwrap_or("").into(),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            ("resources/a.crd.yaml".to_string(), "kind".to_string()),
            ("install.yaml".into(), "kind".into())
        ]
    );
    for problem in report["problems"].as_array().expect("problems") {
        assert!(!problem["fix"].as_str().unwrap_or("").is_empty(), "{problem}");
    }
}

/// The files of `layer` (a gzipped tar) written under `dir`.
fn extract(layer: &[u8], dir: &Path) {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    archive.unpack(dir).expect("unpack the layer");
}

#[test]
fn a_built_image_is_reproducible_and_unpacks_as_the_install_job_unpacks_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let package = dir.path().join("my-stack");
    init(&package, &[]);
    let image = format!("{REGISTRY}/my-stack:v0.1.0");
    let built = |out: &Path| {
        let out = build(&package, &image, out);
        assert!(
            out.status.success(),
            "build: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    };
    let (first, second) = (dir.path().join("first.oci.tar"), dir.path().join("second.oci.tar"));
    let printed = built(&first);
    let later = std::time::SystemTime::now() + Duration::from_secs(7200);
    for file in ["app.yaml", "install.yaml"] {
        let file = std::fs::File::options()
            .append(true)
            .open(package.join(".registry").join(file))
            .expect("open");
        file.set_modified(later).expect("touch");
    }
    assert_eq!(built(&second), printed.replace("first", "second"), "the same digest");
    let bytes = std::fs::read(&first).expect("archive");
    assert_eq!(bytes, std::fs::read(&second).expect("archive"), "the same bytes");
    let built = stackd::package::build::read_archive(&bytes).expect("an OCI archive");
    assert!(
        printed.trim_end().ends_with(&format!("{image}@{}", built.digest())),
        "{printed}"
    );
    assert_eq!(built.name, image);

    // The install Job copies /.registry out of the package image and runs `stackd unpack` on it.
    let root = tempfile::tempdir().expect("temp dir");
    extract(&built.layer, root.path());
    let out = stackd(&[
        "unpack",
        "--content-dir",
        root.path().join(".registry").to_str().expect("utf-8"),
        "--permission-scope",
        "Namespaced",
        "--package-image",
        &image,
    ]);
    assert!(out.status.success(), "unpack: {}", text(&out.stderr));
    let contents = stream::decode(&text(&out.stdout), 10).expect("the install output");
    assert_eq!(contents.crds.len(), 1);
    assert_eq!(contents.stack.spec.version.as_deref(), Some("0.1.0"));

    // A package that fails its check is not built.
    std::fs::write(
        package.join(".registry/install.yaml"),
        "apiVersion: v1\nkind: Service\n",
    )
    .expect("break");
    let refused = dir.path().join("refused.oci.tar");
    let out = build(&package, &image, &refused);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("install.yaml"), "{}", text(&out.stderr));
    assert!(!refused.exists(), "nothing was built");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_built_image_holding_only_its_package_installs_through_the_install_job() {
    let fleet = StackFleet::start(&["acme"]).await;
    let packages = fleet.dir.path().join("packages");
    // The host runs images as a node does: a package image's root filesystem is its layer, no `cp`.
    let images = SampleImages {
        packages_dir: packages.clone(),
        stackd_image: STACKD_TEST_IMAGE.into(),
        installer_images: ImageMatch::Exact("no-installer".into()),
    };
    register_sample_runners(&fleet._host.runners(), &images);
    let source = fleet.dir.path().join("authoring").join("built-stack");
    init(&source, &[]);
    let image = format!("{REGISTRY}/built-stack:v0.1.0");
    let archive = fleet.dir.path().join("built.oci.tar");
    let out = build(&source, &image, &archive);
    assert!(out.status.success(), "build: {}", text(&out.stderr));
    let built = stackd::package::build::read_archive(&std::fs::read(&archive).expect("archive")).expect("OCI archive");
    extract(&built.layer, &packages.join("built-stack"));

    let tenant = fleet.tenant("acme");
    let daemon = fleet.daemon(&[]);
    create_install(&tenant, "team-a", "built", json!({ "package": image })).await;
    let (status, _, message) = wait_for_reason(&tenant, "team-a", "built", &daemon, "Available").await;
    assert_eq!(status, "True", "{message}");
    let crds = crd_names(&tenant).await;
    assert!(
        crds.iter().any(|c| c == "builtstacks.built-stack.example.org"),
        "{crds:?}"
    );
}

/// The distribution registry Debian packages (`docker-registry`), which scripts/test installs.
const REGISTRY_BINARY: &str = "/usr/bin/docker-registry";
/// The user that may push, and a bcrypt hash of its password (`mkpasswd -m bcrypt`).
pub(crate) const PUSHER: (&str, &str, &str) = (
    "pusher",
    "stackd-push-test",
    "$2b$05$D3Ui50eVf9PEt1RLqjvpxORVvvCmXYybpz87A6Nt9QtTITsIhuOi2",
);

/// A registry on a free loopback port, with its storage and config in a temp dir; stopped on drop.
pub(crate) struct LocalRegistry {
    child: std::process::Child,
    pub(crate) address: String,
    _dir: tempfile::TempDir,
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LocalRegistry {
    /// Starts the registry, with htpasswd (basic) auth.
    async fn start() -> LocalRegistry {
        let dir = tempfile::tempdir().expect("temp dir");
        let htpasswd = dir.path().join("htpasswd");
        std::fs::write(&htpasswd, format!("{}:{}\n", PUSHER.0, PUSHER.2)).expect("htpasswd");
        let realm = realm();
        let auth = format!(
            "auth:\n  htpasswd:\n    realm: {realm}\n    path: {}\n",
            htpasswd.display()
        );
        LocalRegistry::start_in(dir, &auth, &format!("realm=\"{realm}\"")).await
    }

    /// Starts the registry with `auth` (its config's `auth:` section), told from whatever else
    /// listens on its port by `challenge` in the credentials it asks for.
    pub(crate) async fn start_with(auth: &str, challenge: &str) -> LocalRegistry {
        LocalRegistry::start_in(tempfile::tempdir().expect("temp dir"), auth, challenge).await
    }

    /// A port taken between being found free and the registry binding it makes the registry exit:
    /// then another port is tried.
    async fn start_in(dir: tempfile::TempDir, auth: &str, challenge: &str) -> LocalRegistry {
        assert!(
            Path::new(REGISTRY_BINARY).exists(),
            "{REGISTRY_BINARY} is missing: run scripts/test, which installs Debian's docker-registry package"
        );
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let address = format!("127.0.0.1:{port}");
            let config = format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}\nhttp:\n  addr: {address}\n  secret: stackd-test\n{auth}",
                root = dir.path().join("storage").display(),
            );
            let config_path = dir.path().join("config.yml");
            std::fs::write(&config_path, config).expect("config");
            let log = std::fs::File::create(dir.path().join("registry.log")).expect("log");
            let mut child = Command::new(REGISTRY_BINARY)
                .arg("serve")
                .arg(&config_path)
                .stdout(log.try_clone().expect("log"))
                .stderr(log)
                .spawn()
                .expect("start the registry");
            if answers(&mut child, &address, challenge).await {
                return LocalRegistry {
                    child,
                    address,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("the registry did not start on any of 5 free ports");
    }
}

/// The basic-auth registry's realm: its own, so that it is told from another listener on its port.
fn realm() -> String {
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let started = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("stackd-test-{}-{started}", std::process::id())
}

/// Waits until the registry takes connections and asks for credentials with `challenge`; false
/// when it exited (its port was taken).
async fn answers(child: &mut std::process::Child, address: &str, challenge: &str) -> bool {
    wait_until("the registry answering", Duration::from_secs(10), &NoDaemon, || {
        let exited = child.try_wait().ok().flatten().is_some();
        let (address, challenge) = (address.to_string(), challenge.to_string());
        async move {
            if exited {
                return Some(false);
            }
            // Ours, not whatever else took the port: it asks for credentials in its own realm.
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut stream = tokio::net::TcpStream::connect(&address).await.ok()?;
            let mut answer = String::new();
            let asked = stream.write_all(b"GET /v2/ HTTP/1.0\r\n\r\n").await.is_ok()
                && stream.read_to_string(&mut answer).await.is_ok();
            (asked && answer.contains(&challenge)).then_some(true)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_goes_from_init_to_a_registry_and_back_to_unpack() {
    let registry = LocalRegistry::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let package = dir.path().join("my-stack");
    init(&package, &[]);
    let out = stackd(&["package", "check", package.to_str().expect("utf-8")]);
    assert!(out.status.success(), "check: {}", text(&out.stdout));
    let image = format!("{}/team/my-stack:v0.1.0", registry.address);
    let archive = dir.path().join("my-stack.oci.tar");
    let out = build(&package, &image, &archive);
    assert!(out.status.success(), "build: {}", text(&out.stderr));
    let built = text(&out.stdout);
    let digest = built.trim_end().rsplit('@').next().expect("digest").to_string();

    // Without credentials the registry refuses, and says so.
    let push = |config: &Path| {
        stackd(&[
            "package",
            "push",
            archive.to_str().expect("utf-8"),
            &image,
            "--registry-config",
            config.to_str().expect("utf-8"),
            "--plain-http",
        ])
    };
    let anonymous = dir.path().join("anonymous.json");
    std::fs::write(&anonymous, r#"{"auths": {}}"#).expect("config");
    let out = push(&anonymous);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let refused = text(&out.stderr);
    assert!(
        refused.contains(&registry.address) && refused.contains("--registry-config"),
        "{refused}"
    );

    // With the credentials `docker login` would have written.
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", PUSHER.0, PUSHER.1));
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        json!({"auths": {registry.address.clone(): {"auth": basic}}}).to_string(),
    )
    .expect("config");
    let out = push(&config);
    assert!(out.status.success(), "push: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim_end(), format!("{image}@{digest}"));
    assert!(!text(&out.stderr).contains(PUSHER.1), "no secret in the output");

    // Pulled back: the same manifest, and a layer the install Job unpacks.
    let client = stackd::package::push::client(&registry.address, true).expect("client");
    let reference: oci_client::Reference = image.parse().expect("reference");
    let auth = oci_client::secrets::RegistryAuth::Basic(PUSHER.0.into(), PUSHER.1.into());
    let (manifest, pulled_digest) = client
        .pull_manifest_raw(&reference, &auth, &[stackd::package::build::MANIFEST_MEDIA_TYPE])
        .await
        .expect("pull the manifest");
    assert_eq!(pulled_digest, digest);
    let manifest: Value = serde_json::from_slice(&manifest).expect("manifest");
    let layer_digest = manifest["layers"][0]["digest"].as_str().expect("layer").to_string();
    let mut layer = Vec::new();
    client
        .pull_blob(&reference, layer_digest.as_str(), &mut layer)
        .await
        .expect("pull the layer");
    let root = tempfile::tempdir().expect("temp dir");
    extract(&layer, root.path());
    let out = stackd(&[
        "unpack",
        "--content-dir",
        root.path().join(".registry").to_str().expect("utf-8"),
        "--permission-scope",
        "Namespaced",
        "--package-image",
        &image,
    ]);
    assert!(out.status.success(), "unpack: {}", text(&out.stderr));
    let contents = stream::decode(&text(&out.stdout), 10).expect("the install output");
    assert_eq!(contents.crds.len(), 1);
}
