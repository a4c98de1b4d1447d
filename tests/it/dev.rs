//! `stackd dev`: the embedded servers a new user starts first.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

async fn client_for(path: &std::path::Path) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    kube::Client::try_from(config).expect("client")
}

async fn wait_for_file(path: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} was not written", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["dev", "--no-daemon", "--tenants", "2", "--kubeconfig-dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
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
    assert_eq!(names.len(), 8);
    let host = client_for(&dir.path().join("host.yaml")).await;
    let namespaces: Api<Namespace> = Api::all(host);
    assert!(namespaces.get_opt("default").await.expect("get").is_some());
    assert!(stop(child).await.success());
}

#[tokio::test]
async fn dev_runs_the_daemon_which_creates_each_tenants_host_namespace() {
    let dir = tempfile::tempdir().expect("temp dir");
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["dev", "--tenants", "1", "--kubeconfig-dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn stackd dev");
    let host_file = dir.path().join("host.yaml");
    wait_for_file(&dir.path().join("tenants/acme.yaml")).await;
    let namespaces: Api<Namespace> = Api::all(client_for(&host_file).await);
    let deadline = Instant::now() + Duration::from_secs(20);
    while namespaces
        .get_opt("tenant-acme-controllers")
        .await
        .expect("get")
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the daemon did not create the host namespace"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(stop(child).await.success());
}

#[tokio::test]
async fn dev_installs_the_sample_stack_and_prints_it_becoming_ready() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["dev", "--tenants", "1", "--kubeconfig-dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
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
        "created StackInstall team-a/sample-stack",
        "InstallJobRunning",
        "Stack team-a/sample-stack: Ready=True",
    ] {
        assert!(progress.contains(step), "no {step:?} in:\n{progress}");
    }
    assert!(stop(child).await.success());
}
