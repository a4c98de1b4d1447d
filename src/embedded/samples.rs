//! Job runners for the sample images `stackd dev` serves (DESIGN §3.2, §4.2), so install and
//! provisioning Jobs complete without a container runtime.
//!
//! The mapping from images to behaviour, with a pod's emptyDir volumes as real directories
//! ([`JobContext::volume_path`]):
//! - **Stack package images** — an image whose repository's last path segment names a directory of
//!   the packages directory (`stackd-examples/sample-stack:v0.1.0` → `examples/packages/sample-stack`,
//!   which holds `.registry`) has that directory as its root filesystem, and nothing else: no `cp`,
//!   as in an image `stackd package build` wrote. A command is found on the pod's volumes or in that
//!   root (else the container fails as a runtime fails it, exit 128); the one it runs is stackd's
//!   binary as `stackd-tools` copied it: `copy SRC DEST`, run by [`crate::stacks::copy::copy_tree`].
//! - **The stackd image** (the daemon's `--stackd-image`): `copy-self DEST` puts a stand-in for
//!   the binary at DEST (the real one would copy this whole process's executable); `unpack
//!   --content-dir DIR --permission-scope S` unpacks what the package container copied to DIR with
//!   [`crate::stacks::unpack`], the package image being `STACK_IMAGE`. The log is the stream the real
//!   container prints (exit 0), or the error it would print (exit 1).
//! - **Installer images** — by default an image whose repository's last segment is `installer`
//!   (`quay.io/example/installer:4.14`, as in `examples/pools`): `create cluster --dir /installer` writes
//!   `kubeconfig` and `metadata.json` (with `infraID`) into the existing Secret named by
//!   `STACKD_OUTPUT_SECRET` in `STACKD_OUTPUT_NAMESPACE` and exits 0; `destroy cluster` exits 0.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::RngExt;
use serde_json::json;

use super::controller_manager::{ImageMatch, JobContext, JobOutcome, JobRunner, Runners};
use super::store::GroupResource;
use crate::api::stacks::PermissionScope;
use crate::stacks::{copy, stream, unpack};

/// Which images the sample runners answer, and where the packages are.
#[derive(Clone)]
pub struct SampleImages {
    /// Directory holding one package directory (with its `.registry`) per package name.
    pub packages_dir: PathBuf,
    /// The image of the install Job's `unpack` container.
    pub stackd_image: String,
    pub installer_images: ImageMatch,
}

impl SampleImages {
    /// The repository's `examples/packages`, the given stackd image, and `.../installer:<tag>` images.
    pub fn new(stackd_image: &str) -> SampleImages {
        SampleImages {
            packages_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join("packages"),
            stackd_image: stackd_image.to_string(),
            installer_images: ImageMatch::Predicate(Arc::new(|image| repository_name(image) == "installer")),
        }
    }
}

/// Makes the pods of Jobs running `image` take `delay` (run as the runner registered for it now
/// runs them): for a restart to find installs in flight. False when no runner answers `image`.
pub fn slow_down(runners: &Runners, image: &str, delay: std::time::Duration) -> bool {
    let Some(inner) = runners.runner_for(image) else {
        return false;
    };
    // The main container takes it: the pod's init containers (copy-self) do not add to it.
    let slowed = move |ctx: &JobContext| {
        let outcome = inner.run(ctx);
        if ctx.init_container {
            outcome
        } else {
            outcome.after(delay)
        }
    };
    runners.register(ImageMatch::Exact(image.to_string()), slowed);
    true
}

/// `registry:5000/org/name:tag@sha256:…` → `name`.
pub fn repository_name(image: &str) -> &str {
    let without_digest = image.split('@').next().unwrap_or(image);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    last.split(':').next().unwrap_or(last)
}

/// The runners for the sample images, most specific last (as [`Runners::register`] wants them).
pub fn sample_runners(images: &SampleImages) -> Vec<(ImageMatch, Arc<dyn JobRunner>)> {
    let dir = images.packages_dir.clone();
    let is_package = ImageMatch::Predicate(Arc::new(move |image| package_dir(&dir, image).is_some()));
    vec![
        (
            is_package,
            Arc::new(PackageImage {
                packages_dir: images.packages_dir.clone(),
            }),
        ),
        (images.installer_images.clone(), Arc::new(Installer)),
        (ImageMatch::Exact(images.stackd_image.clone()), Arc::new(StackdImage)),
    ]
}

/// Registers [`sample_runners`] on a server's runners.
pub fn register_sample_runners(runners: &Runners, images: &SampleImages) {
    for (matching, runner) in sample_runners(images) {
        runners.register_arc(matching, runner);
    }
}

/// The root filesystem of a package image: the package directory holding its `.registry`.
fn package_dir(packages_dir: &Path, image: &str) -> Option<PathBuf> {
    let name = repository_name(image);
    if name.is_empty() || name.starts_with('.') {
        return None;
    }
    let root = packages_dir.join(name);
    root.join(".registry").is_dir().then_some(root)
}

/// What [`StackdImage`]'s `copy-self` leaves where the binary would be.
const STACKD_STAND_IN: &str = "#!stackd (stand-in written by the embedded server's copy-self)\n";

/// A package image: its package directory and nothing else.
struct PackageImage {
    packages_dir: PathBuf,
}

impl JobRunner for PackageImage {
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        let Some(root) = package_dir(&self.packages_dir, &ctx.image) else {
            return JobOutcome::failure(128, format!("no sample package for {}\n", ctx.image));
        };
        // In the image or on a volume: `/x` is `root/x` unless a volume is mounted there.
        let locate = |path: &str| {
            ctx.volume_path(path)
                .unwrap_or_else(|| root.join(path.trim_start_matches('/')))
        };
        let mut argv = ctx.command.iter().chain(&ctx.args);
        let program = argv.next().map(String::as_str).unwrap_or_default();
        let is_stackd = std::fs::read_to_string(locate(program)).is_ok_and(|text| text == STACKD_STAND_IN);
        if !is_stackd {
            return JobOutcome::failure(
                128,
                format!("exec: {program:?}: executable file not found: the image holds only its package\n"),
            );
        }
        let rest: Vec<&str> = argv.map(String::as_str).collect();
        let ["copy", from, to] = rest.as_slice() else {
            return JobOutcome::failure(
                2,
                format!("the sample package image runs only `stackd copy SRC DEST`, not {rest:?}\n"),
            );
        };
        match copy::copy_tree(&locate(from), &locate(to), &copy::Limits::PACKAGE) {
            Ok(_) => JobOutcome::success(""),
            Err(e) => JobOutcome::failure(1, format!("stackd copy: {e}\n")),
        }
    }
}

/// stackd's image: `copy-self` and `unpack`.
struct StackdImage;

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).map(String::as_str)
}

impl JobRunner for StackdImage {
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        let args: Vec<String> = ctx.command.iter().chain(&ctx.args).cloned().collect();
        match args.first().map(String::as_str) {
            Some("copy-self") => copy_self(ctx, &args),
            Some("unpack") => unpack(ctx, &args),
            _ => JobOutcome::failure(
                2,
                format!("the sample stackd image runs `copy-self` and `unpack`, not {args:?}\n"),
            ),
        }
    }
}

fn copy_self(ctx: &JobContext, args: &[String]) -> JobOutcome {
    let Some(dest) = args.get(1).and_then(|dest| ctx.volume_path(dest)) else {
        return JobOutcome::failure(
            1,
            "stackd copy-self: the destination is on no volume: the root filesystem is read-only\n",
        );
    };
    match std::fs::write(&dest, STACKD_STAND_IN) {
        Ok(()) => JobOutcome::success(""),
        Err(e) => JobOutcome::failure(1, format!("stackd copy-self: cannot copy {}: {e}\n", dest.display())),
    }
}

fn unpack(ctx: &JobContext, args: &[String]) -> JobOutcome {
    let scope = match flag(args, "--permission-scope").map(str::parse::<PermissionScope>) {
        Some(Ok(scope)) => scope,
        Some(Err(e)) => return JobOutcome::failure(2, format!("error: invalid --permission-scope: {e}\n")),
        None => return JobOutcome::failure(2, "error: --permission-scope is required\n"),
    };
    let Some(content_dir) = flag(args, "--content-dir").and_then(|dir| ctx.volume_path(dir)) else {
        return JobOutcome::failure(
            1,
            "stackd unpack: --content-dir names no volume of this pod: stackd's image holds no package\n",
        );
    };
    let options = unpack::UnpackOptions {
        content_dir,
        permission_scope: scope,
        package_image: flag(args, "--package-image")
            .or(ctx.env("STACK_IMAGE"))
            .map(str::to_string),
        templating_controller_image: unpack::DEFAULT_TEMPLATING_CONTROLLER_IMAGE.into(),
        stackd_image: flag(args, "--stackd-image").unwrap_or(&ctx.image).to_string(),
    };
    match unpack::unpack(&options)
        .map_err(|e| e.to_string())
        .and_then(|contents| stream::encode(&contents).map_err(|e| e.to_string()))
    {
        Ok(log) => JobOutcome::success(log),
        Err(e) => JobOutcome::failure(1, format!("stackd unpack: {e}\n")),
    }
}

struct Installer;

impl JobRunner for Installer {
    fn run(&self, ctx: &JobContext) -> JobOutcome {
        let args: Vec<&str> = ctx.args.iter().map(String::as_str).collect();
        match args.as_slice() {
            ["create", "cluster", ..] => create_cluster(ctx),
            ["destroy", "cluster", ..] => JobOutcome::success("level=info msg=\"Uninstallation complete!\"\n"),
            other => JobOutcome::failure(2, format!("unknown installer command {other:?}\n")),
        }
    }
}

/// An installer that creates its cluster as the sample one does, then pads its output Secret with
/// `padding` bytes and removes stackd's tenant-namespace annotation from it: what an installer
/// holding the token for that Secret can do (issue 45's attack 4, in tests and the bench).
pub fn padding_installer(padding: usize) -> impl JobRunner {
    move |ctx: &JobContext| {
        if ctx.args.iter().any(|a| a == "destroy") {
            return JobOutcome::success("destroyed\n");
        }
        let outcome = create_cluster(ctx);
        let (Some(namespace), Some(name)) = (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET"))
        else {
            return JobOutcome::failure(1, "no output Secret named\n");
        };
        use base64::Engine;
        let pad = base64::engine::general_purpose::STANDARD.encode(vec![b'x'; padding]);
        let padded = super::controller_manager::modify(
            &ctx.store,
            &GroupResource::new("", "secrets"),
            namespace,
            name,
            |secret| {
                if let Some(annotations) = secret["metadata"]["annotations"].as_object_mut() {
                    annotations.remove("stackd.dev/tenant-namespace");
                }
                secret["data"]["pad"] = json!(pad);
            },
        );
        match padded {
            Ok(_) => outcome,
            Err(e) => JobOutcome::failure(1, format!("{e:?}\n")),
        }
    }
}

/// What the sample installer's `create cluster` does; tests wrap it to script failures.
pub fn create_cluster(ctx: &JobContext) -> JobOutcome {
    let (Some(namespace), Some(secret)) = (ctx.env("STACKD_OUTPUT_NAMESPACE"), ctx.env("STACKD_OUTPUT_SECRET")) else {
        return JobOutcome::failure(
            1,
            "error: STACKD_OUTPUT_SECRET and STACKD_OUTPUT_NAMESPACE must be set\n",
        );
    };
    // The installer may only update its pre-created output Secret (DESIGN §4.2), never create one.
    if !ctx
        .store
        .contains(&GroupResource::new("", "secrets"), namespace, secret)
    {
        return JobOutcome::failure(1, format!("error: secrets \"{secret}\" not found in {namespace}\n"));
    }
    let cluster = ctx
        .env("STACKD_CLUSTER_NAME")
        .unwrap_or_else(|| ctx.job["metadata"]["name"].as_str().unwrap_or("cluster"))
        .to_string();
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    let suffix: String = (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    let base: String = cluster.chars().take(21).collect();
    let infra_id = format!("{}-{suffix}", base.trim_end_matches(['-', '.']));
    let metadata = json!({"clusterName": cluster, "clusterID": crate::embedded::verbs::new_uid(), "infraID": infra_id});
    let kubeconfig = [
        "apiVersion: v1",
        "kind: Config",
        "clusters:",
        &format!("- name: {infra_id}"),
        "  cluster:",
        &format!("    server: https://api.{infra_id}.example:6443"),
        "contexts:",
        "- name: admin",
        "  context:",
        &format!("    cluster: {infra_id}"),
        "    user: admin",
        "current-context: admin",
        "users:",
        "- name: admin",
        "  user:",
        "    token: sample-admin-token",
        "",
    ]
    .join("\n");
    let data = BTreeMap::from([
        ("kubeconfig".to_string(), kubeconfig),
        ("metadata.json".to_string(), metadata.to_string()),
    ]);
    match ctx.write_secret_data(namespace, secret, &data) {
        Ok(_) => JobOutcome::success(format!("level=info msg=\"Install complete!\" infraID={infra_id}\n")),
        Err(e) => JobOutcome::failure(1, format!("error: writing the output Secret: {}\n", e.message)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_name_drops_registry_tag_and_digest() {
        assert_eq!(repository_name("stackd-examples/sample-stack:v0.1.0"), "sample-stack");
        assert_eq!(repository_name("localhost:5000/x/installer@sha256:ab"), "installer");
        assert_eq!(repository_name("cluster-stack"), "cluster-stack");
    }
}
