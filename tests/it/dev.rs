//! `stackd dev`: the embedded servers a new user starts first.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

use crate::harness::{self, NoDaemon, until};

/// How long `stackd dev` may take to write its kubeconfigs and set a tenant up.
const DEV_WITHIN: Duration = Duration::from_secs(20);

async fn client_for(path: &std::path::Path) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    kube::Client::try_from(config).expect("client")
}

async fn wait_for_file(path: &std::path::Path) {
    until(
        &format!("{} written", path.display()),
        DEV_WITHIN,
        &NoDaemon,
        || async { path.exists() },
    )
    .await;
}

/// `stackd dev <args> --kubeconfig-dir <dir>`, its output dropped unless the test pipes it.
fn dev(args: &[&str], dir: &std::path::Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"));
    command
        .arg("dev")
        .args(args)
        .arg("--kubeconfig-dir")
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

async fn stop(mut child: tokio::process::Child) -> std::process::ExitStatus {
    let pid = child.id().expect("pid").to_string();
    let _ = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await;
    tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits in time")
        .expect("wait")
}

#[tokio::test]
async fn dev_no_daemon_serves_tenants_with_the_crds_installed_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("temp dir");
    let child = dev(&["--no-daemon", "--tenants", "2"], dir.path())
        .spawn()
        .expect("spawn stackd dev");
    let second = dir.path().join("tenants/globex.yaml");
    wait_for_file(&second).await;
    // The kubeconfig is written after the CRDs are installed.
    let tenant = client_for(&second).await;
    let crds: Api<CustomResourceDefinition> = Api::all(tenant);
    let names: Vec<String> = crds
        .list(&Default::default())
        .await
        .expect("list")
        .iter()
        .filter_map(|c| c.metadata.name.clone())
        .collect();
    assert!(
        names.contains(&"clusterpools.pools.stackd.dev".to_string()),
        "{names:?}"
    );
    assert_eq!(names.len(), 9, "stackd's eight and Crossplane's StackDefinition");
    let host = client_for(&dir.path().join("host.yaml")).await;
    let namespaces: Api<Namespace> = Api::all(host);
    assert!(namespaces.get_opt("default").await.expect("get").is_some());
    assert!(stop(child).await.success());
}

/// The commands `stackd dev` prints work as printed, also from a script: kubectl with a tenant's
/// kubeconfig finds credentials in it and asks for none (it would ask for a username and password
/// on an https server whose kubeconfig user has none, and fail with no terminal to ask on).
#[tokio::test]
async fn kubectl_reads_a_dev_tenant_with_the_printed_kubeconfig_and_no_terminal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let child = dev(&["--no-daemon", "--tenants", "1"], dir.path())
        .spawn()
        .expect("spawn stackd dev");
    let tenant = dir.path().join("tenants/acme.yaml");
    wait_for_file(&tenant).await;
    let output = tokio::process::Command::new(harness::kubectl())
        .arg("--kubeconfig")
        .arg(&tenant)
        .args(["get", "crds", "-o", "name"])
        .env("HOME", dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run kubectl");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "kubectl failed: {stderr}");
    assert!(
        stdout.contains("customresourcedefinition.apiextensions.k8s.io/clusterpools.pools.stackd.dev"),
        "{stdout}"
    );
    assert!(stop(child).await.success());
}

#[tokio::test]
async fn dev_runs_the_daemon_which_creates_each_tenants_host_namespace() {
    let dir = tempfile::tempdir().expect("temp dir");
    let child = dev(&["--tenants", "1"], dir.path()).spawn().expect("spawn stackd dev");
    let host_file = dir.path().join("host.yaml");
    wait_for_file(&dir.path().join("tenants/acme.yaml")).await;
    let namespaces: Api<Namespace> = Api::all(client_for(&host_file).await);
    until(
        "the daemon to create the host namespace",
        DEV_WITHIN,
        &NoDaemon,
        || async {
            namespaces
                .get_opt("tenant-acme-controllers")
                .await
                .expect("get")
                .is_some()
        },
    )
    .await;
    // The tenant is registered as a Tenant object on the host, and its status says it is up.
    let tenants: Api<stackd::api::tenancy::Tenant> = Api::all(client_for(&host_file).await);
    let ready = |tenant: &stackd::api::tenancy::Tenant| {
        tenant.status.as_ref().is_some_and(|status| {
            status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    };
    until("the Tenant acme to show Ready", DEV_WITHIN, &NoDaemon, || async {
        tenants
            .get_opt("acme")
            .await
            .expect("get Tenant")
            .is_some_and(|t| ready(&t))
    })
    .await;
    let acme = tenants.get("acme").await.expect("Tenant");
    let secret = acme.spec.kubeconfig_secret_ref;
    assert_eq!(
        (secret.namespace.as_str(), secret.key.as_str()),
        ("stackd-system", "value")
    );
    assert!(stop(child).await.success());
}

#[tokio::test]
async fn dev_installs_the_sample_stack_and_prints_it_becoming_ready() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = dev(&["--tenants", "1"], dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn stackd dev");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains("StackInstall team-a/sample-stack: Ready=True");
            seen.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        ready,
        Ok(true),
        "the sample stack never showed Ready; output:\n{}",
        seen.join("\n")
    );
    let progress = seen.join("\n");
    for step in [
        "[acme] Tenant acme: Ready=True Up",
        "created StackInstall team-a/sample-stack",
        "InstallJobRunning",
        "Stack team-a/sample-stack: Ready=True",
    ] {
        assert!(progress.contains(step), "no {step:?} in:\n{progress}");
    }
    assert!(stop(child).await.success());
}

/// Issue 30: the terminal shows `stackd dev`'s progress lines only, through its demo restart of
/// the second tenant's server; the daemon's log goes to the file it names.
#[tokio::test]
async fn dev_shows_progress_lines_only_and_writes_the_daemon_log_to_a_file() {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = dev(&["--tenants", "2"], dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn stackd dev");
    let mut stderr = child.stderr.take().expect("stderr");
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    // The second tenant's sample install becomes Ready after its server's restart.
    let done = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains("[globex] StackInstall team-a/sample-stack: Ready=True");
            seen.push(line);
            if done {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(done, Ok(true), "output:\n{}", seen.join("\n"));
    assert!(stop(child).await.success());
    let output = seen.join("\n");
    assert!(output.contains("[globex] restarting the API server"), "{output}");
    let log_file = dir.path().join("stackd.log");
    assert!(
        output.contains(&log_file.display().to_string()),
        "the log file is named:\n{output}"
    );
    for level in [" INFO ", " WARN ", " ERROR ", "kube_client"] {
        assert!(
            !output.contains(level),
            "a log line among the progress lines:\n{output}"
        );
    }
    let errors = errors.await.expect("stderr read");
    assert!(errors.trim().is_empty(), "the terminal got the log:\n{errors}");
    let log = std::fs::read_to_string(&log_file).expect("the log file");
    assert!(log.contains("stackd running"), "{log}");
    assert!(
        log.contains("tenant API server unavailable"),
        "the restart is in the log:\n{log}"
    );
}
