//! kubectl 1.33 against an embedded API server with stackd's CRDs installed: the commands users
//! and the Helm tests run, on built-in kinds and on our custom resources.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use stackd::embedded::Verb;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::timeout;

use crate::harness::{self, NoDaemon, TestServer, until};

/// How long kubectl may take to open its watch, and then to print a change.
const WATCH_WITHIN: Duration = Duration::from_secs(10);

struct Kubectl {
    /// Kept alive for as long as kubectl talks to it.
    _server: TestServer,
    dir: tempfile::TempDir,
    binary: PathBuf,
}

/// An embedded server with the `default` and `my-project` namespaces and stackd's CRDs.
async fn start() -> Kubectl {
    let t = harness::start().await;
    t.namespace("my-project").await;
    harness::install_crds(&t.client).await;
    let dir = tempfile::tempdir().expect("temporary directory");
    std::fs::write(dir.path().join("kubeconfig"), t.server.kubeconfig_yaml()).expect("kubeconfig written");
    Kubectl {
        _server: t,
        dir,
        binary: harness::kubectl(),
    }
}

impl Kubectl {
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command
            .arg("--kubeconfig")
            .arg(self.dir.path().join("kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().await.expect("kubectl runs")
    }

    /// Runs kubectl, requires success and returns its stdout.
    async fn ok(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert!(
            output.status.success(),
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs kubectl with `manifest` on stdin (for `-f -`).
    async fn run_with(&self, args: &[&str], manifest: &str) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl starts");
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(manifest.as_bytes()).await.expect("manifest written");
        }
        child.wait_with_output().await.expect("kubectl runs")
    }

    /// Runs kubectl with `manifest` on stdin, requiring success; returns its stdout.
    async fn ok_with(&self, args: &[&str], manifest: &str) -> String {
        let output = self.run_with(args, manifest).await;
        assert!(
            output.status.success(),
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn example(&self, relative: &str) -> String {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples")
            .join(relative)
            .to_string_lossy()
            .into_owned()
    }
}

/// The header and the cells of row `name` of `kubectl get` output, cut at the header's column
/// starts (cells may be empty).
fn header_and_row(table: &str, name: &str) -> (Vec<String>, Vec<String>) {
    let mut lines = table.lines();
    let header_line = lines.next().unwrap_or("");
    let header: Vec<String> = header_line.split_whitespace().map(String::from).collect();
    let mut starts = Vec::new();
    let mut previous = ' ';
    for (i, c) in header_line.char_indices() {
        if c != ' ' && previous == ' ' {
            starts.push(i);
        }
        previous = c;
    }
    let line = lines
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no row {name} in:\n{table}"));
    let row = starts
        .iter()
        .enumerate()
        .map(|(i, start)| {
            let end = starts.get(i + 1).copied().unwrap_or(line.len()).min(line.len());
            line.get((*start).min(end)..end).unwrap_or("").trim().to_string()
        })
        .collect();
    (header, row)
}

#[tokio::test]
async fn kubectl_get_shows_printer_columns_of_a_cluster_pool() {
    let k = start().await;
    k.ok(&["create", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    let table = k.ok(&["get", "clusterpools", "-n", "my-project"]).await;
    let (header, row) = header_and_row(&table, "vsphere-pool");
    assert_eq!(
        header,
        ["NAME", "SIZE", "STANDBY", "READY", "BASEDOMAIN", "AGE"],
        "{table}"
    );
    assert_eq!(&row[..2], ["vsphere-pool", "2"], "{table}");
    assert_eq!(row[4], "vsphere.example.com", "{table}");

    let wide = k.ok(&["get", "clusterpools", "-n", "my-project", "-o", "wide"]).await;
    assert!(wide.lines().next().unwrap_or("").contains("PLATFORM"), "{wide}");
}

#[tokio::test]
async fn kubectl_get_shows_the_usual_columns_of_built_in_kinds() {
    let k = start().await;
    let settings = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\ndata:\n  a: \"1\"\n  b: \"2\"\n";
    k.ok_with(&["create", "-f", "-"], settings).await;
    let table = k.ok(&["get", "configmaps"]).await;
    let (header, row) = header_and_row(&table, "settings");
    assert_eq!(header, ["NAME", "DATA", "AGE"]);
    assert_eq!(row[1], "2");

    let namespaces = k.ok(&["get", "namespaces"]).await;
    let (header, row) = header_and_row(&namespaces, "my-project");
    assert_eq!(header, ["NAME", "STATUS", "AGE"]);
    assert_eq!(row[1], "Active");
}

#[tokio::test]
async fn kubectl_get_o_yaml_prints_the_stored_object() {
    let k = start().await;
    k.ok(&["create", "-f", &k.example("pools/clusterdeploymentcustomization.yaml")])
        .await;
    let yaml = k
        .ok(&[
            "get",
            "cdc",
            "foo-cluster-deployment-customization",
            "-n",
            "my-project",
            "-o",
            "yaml",
        ])
        .await;
    assert!(yaml.contains("kind: ClusterDeploymentCustomization"), "{yaml}");
    assert!(yaml.contains("path: /metadata/name"), "{yaml}");
    assert!(yaml.contains("resourceVersion:"), "{yaml}");
}

const CONFIGMAP: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: app
data:
  mode: fast
";

#[tokio::test]
async fn kubectl_apply_twice_client_side_then_server_side_on_a_configmap() {
    let k = start().await;
    let first = k.ok_with(&["apply", "-f", "-"], CONFIGMAP).await;
    assert!(first.contains("configmap/app created"), "{first}");
    let second = k.ok_with(&["apply", "-f", "-"], CONFIGMAP).await;
    assert!(second.contains("configmap/app unchanged"), "{second}");
    let changed = CONFIGMAP.replace("mode: fast", "mode: slow");
    let third = k.ok_with(&["apply", "-f", "-"], &changed).await;
    assert!(third.contains("configmap/app configured"), "{third}");

    let server_side = k
        .ok_with(&["apply", "--server-side", "--force-conflicts", "-f", "-"], &changed)
        .await;
    assert!(
        server_side.contains("configmap/app serverside-applied"),
        "{server_side}"
    );
    let managers = k
        .ok(&["get", "configmap", "app", "--show-managed-fields", "-o", "yaml"])
        .await;
    assert!(managers.contains("manager: kubectl"), "{managers}");
    assert!(managers.contains("operation: Apply"), "{managers}");
}

#[tokio::test]
async fn kubectl_apply_twice_and_server_side_on_a_cluster_pool() {
    let k = start().await;
    let pool = k.example("pools/clusterpool-vsphere.yaml");
    let first = k.ok(&["apply", "-f", &pool]).await;
    assert!(
        first.contains("clusterpool.pools.stackd.dev/vsphere-pool created"),
        "{first}"
    );
    let second = k.ok(&["apply", "-f", &pool]).await;
    assert!(second.contains("unchanged"), "{second}");
    let server_side = k
        .ok(&["apply", "--server-side", "--force-conflicts", "-f", &pool])
        .await;
    assert!(server_side.contains("serverside-applied"), "{server_side}");
}

#[tokio::test]
async fn kubectl_patch_merges_and_strategic_merges() {
    let k = start().await;
    k.ok_with(&["create", "-f", "-"], CONFIGMAP).await;
    k.ok(&[
        "patch",
        "configmap",
        "app",
        "--type",
        "merge",
        "-p",
        r#"{"data":{"extra":"1"}}"#,
    ])
    .await;
    k.ok(&["patch", "configmap", "app", "-p", r#"{"data":{"more":"2"}}"#])
        .await;
    let data = k.ok(&["get", "configmap", "app", "-o", "jsonpath={.data}"]).await;
    assert!(
        data.contains("\"extra\":\"1\"") && data.contains("\"more\":\"2\""),
        "{data}"
    );

    k.ok(&["create", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    k.ok(&[
        "patch",
        "clusterpool",
        "vsphere-pool",
        "-n",
        "my-project",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"size":3}}"#,
    ])
    .await;
    let size = k
        .ok(&[
            "get",
            "clusterpool",
            "vsphere-pool",
            "-n",
            "my-project",
            "-o",
            "jsonpath={.spec.size}",
        ])
        .await;
    assert_eq!(size, "3");
    let strategic = k
        .run(&[
            "patch",
            "clusterpool",
            "vsphere-pool",
            "-n",
            "my-project",
            "-p",
            r#"{"spec":{"size":1}}"#,
        ])
        .await;
    assert!(
        !strategic.status.success(),
        "strategic merge on a custom resource must fail"
    );
}

#[tokio::test]
async fn kubectl_delete_removes_built_in_and_custom_objects() {
    let k = start().await;
    k.ok_with(&["create", "-f", "-"], CONFIGMAP).await;
    k.ok(&["create", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    let deleted = k.ok(&["delete", "configmap", "app"]).await;
    assert!(deleted.contains("configmap \"app\" deleted"), "{deleted}");
    k.ok(&["delete", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    let left = k.run(&["get", "clusterpool", "vsphere-pool", "-n", "my-project"]).await;
    assert!(!left.status.success());
    assert!(String::from_utf8_lossy(&left.stderr).contains("NotFound"));
}

#[tokio::test]
async fn kubectl_get_watch_picks_up_a_change() {
    let k = start().await;
    k.ok(&["create", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    let mut watch = k
        .command(&["get", "clusterpools", "-n", "my-project", "-w", "--output-watch-events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl starts");
    // The watch listed and started before the pool changes.
    until("kubectl's watch to open", WATCH_WITHIN, &NoDaemon, || async {
        k._server
            .server
            .counters()
            .get(Verb::Watch, "clusterpools", Some("my-project"))
            > 0
    })
    .await;
    k.ok(&[
        "patch",
        "clusterpool",
        "vsphere-pool",
        "-n",
        "my-project",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"size":7}}"#,
    ])
    .await;
    let mut lines = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let mut text = String::new();
    let modified = loop {
        let line = timeout(WATCH_WITHIN, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no MODIFIED event within {WATCH_WITHIN:?} in:\n{text}"))
            .expect("kubectl's output")
            .unwrap_or_else(|| panic!("the watch ended without a MODIFIED event:\n{text}"));
        text.push_str(&line);
        text.push('\n');
        if line.starts_with("MODIFIED") {
            break line;
        }
    };
    let _ = watch.start_kill();
    let _ = watch.wait().await;
    assert_eq!(modified.split_whitespace().nth(2), Some("7"), "{text}");
}

#[tokio::test]
async fn kubectl_explain_shows_the_description_of_a_crd_field() {
    let k = start().await;
    let text = k
        .ok(&[
            "explain",
            "clusterdeploymentcustomizations.spec.installConfigPatches.path",
        ])
        .await;
    assert!(text.contains("/metadata/name"), "{text}");
}

#[tokio::test]
async fn kubectl_describe_shows_events_of_a_configmap_and_a_cluster_pool() {
    let k = start().await;
    k.ok_with(&["create", "-f", "-"], CONFIGMAP).await;
    k.ok(&["create", "-f", &k.example("pools/clusterpool-vsphere.yaml")])
        .await;
    let uid = k
        .ok(&[
            "get",
            "clusterpool",
            "vsphere-pool",
            "-n",
            "my-project",
            "-o",
            "jsonpath={.metadata.uid}",
        ])
        .await;
    let cm_uid = k
        .ok(&["get", "configmap", "app", "-o", "jsonpath={.metadata.uid}"])
        .await;
    let event = |name: &str, namespace: &str, kind: &str, api_version: &str, object: &str, uid: &str, reason: &str| {
        format!(
            "apiVersion: v1
kind: Event
metadata:
  name: {name}
  namespace: {namespace}
involvedObject:
  apiVersion: {api_version}
  kind: {kind}
  name: {object}
  namespace: {namespace}
  uid: {uid}
reason: {reason}
message: Something {reason} happened
type: Normal
source:
  component: stackd
firstTimestamp: \"2026-01-01T00:00:00Z\"
lastTimestamp: \"2026-01-01T00:00:00Z\"
count: 1
"
        )
    };
    let pool_event = event(
        "pool-event",
        "my-project",
        "ClusterPool",
        "pools.stackd.dev/v1alpha1",
        "vsphere-pool",
        &uid,
        "PoolResized",
    );
    k.ok_with(&["create", "-f", "-"], &pool_event).await;
    let cm_event = event("cm-event", "default", "ConfigMap", "v1", "app", &cm_uid, "Configured");
    k.ok_with(&["create", "-f", "-"], &cm_event).await;

    let pool = k
        .ok(&["describe", "clusterpool", "vsphere-pool", "-n", "my-project"])
        .await;
    assert!(pool.contains("Events:") && pool.contains("PoolResized"), "{pool}");
    let cm = k.ok(&["describe", "configmap", "app"]).await;
    assert!(cm.contains("Events:") && cm.contains("Configured"), "{cm}");
}

#[tokio::test]
async fn kubectl_create_refuses_an_unknown_field_of_a_custom_resource() {
    let k = start().await;
    let manifest = "apiVersion: pools.stackd.dev/v1alpha1
kind: ClusterDeploymentCustomization
metadata:
  name: typo
  namespace: my-project
spec:
  installConfigPatchez: []
";
    let output = k.run_with(&["create", "-f", "-"], manifest).await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown field \"spec.installConfigPatchez\""),
        "{stderr}"
    );
}

fn deployment(image: &str) -> String {
    format!(
        "apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
spec:
  replicas: 2
  selector:
    matchLabels:
      app: web
  template:
    metadata:
      labels:
        app: web
    spec:
      containers:
      - name: web
        image: {image}
        env:
        - name: MODE
          value: fast
      - name: sidecar
        image: sidecar:1
"
    )
}

#[tokio::test]
async fn kubectl_apply_updates_a_deployment_container_by_strategic_merge() {
    let k = start().await;
    let first = k.ok_with(&["apply", "-f", "-"], &deployment("web:1")).await;
    assert!(first.contains("deployment.apps/web created"), "{first}");
    let unchanged = k.ok_with(&["apply", "-f", "-"], &deployment("web:1")).await;
    assert!(unchanged.contains("deployment.apps/web unchanged"), "{unchanged}");
    let configured = k.ok_with(&["apply", "-f", "-"], &deployment("web:2")).await;
    assert!(configured.contains("deployment.apps/web configured"), "{configured}");
    let images = k
        .ok(&[
            "get",
            "deployment",
            "web",
            "-o",
            "jsonpath={.spec.template.spec.containers[*].image}",
        ])
        .await;
    assert_eq!(images, "web:2 sidecar:1");
    let table = k.ok(&["get", "deployments"]).await;
    let (header, _) = header_and_row(&table, "web");
    assert_eq!(header, ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]);
    let explained = k.ok(&["explain", "deployments"]).await;
    assert!(explained.contains("Deployment"), "{explained}");
}

#[tokio::test]
async fn kubectl_server_side_apply_reports_a_conflict_with_a_client_side_apply() {
    let k = start().await;
    k.ok_with(&["apply", "-f", "-"], CONFIGMAP).await;
    // Same values: the server-side applier shares the fields, no conflict.
    let shared = k.ok_with(&["apply", "--server-side", "-f", "-"], CONFIGMAP).await;
    assert!(shared.contains("serverside-applied"), "{shared}");
    let changed = CONFIGMAP.replace("mode: fast", "mode: slow");
    let output = k
        .run_with(
            &["apply", "--server-side", "--field-manager", "other", "-f", "-"],
            &changed,
        )
        .await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("Apply failed with") && stderr.contains(".data.mode"),
        "{stderr}"
    );
}

#[tokio::test]
async fn kubectl_diff_and_server_dry_run_change_nothing() {
    let k = start().await;
    let pool = k.example("pools/clusterpool-vsphere.yaml");
    let dry = k.ok(&["apply", "--dry-run=server", "-f", &pool]).await;
    assert!(dry.contains("created (server dry run)"), "{dry}");
    assert!(
        !k.run(&["get", "clusterpool", "vsphere-pool", "-n", "my-project"])
            .await
            .status
            .success()
    );
    k.ok(&["apply", "-f", &pool]).await;
    let same = k.run(&["diff", "-f", &pool]).await;
    assert_eq!(same.status.code(), Some(0), "{}", String::from_utf8_lossy(&same.stderr));
    let changed = std::fs::read_to_string(&pool)
        .expect("example")
        .replace("size: 2", "size: 5");
    let different = k.run_with(&["diff", "-f", "-"], &changed).await;
    let diff = String::from_utf8_lossy(&different.stdout);
    assert_eq!(
        different.status.code(),
        Some(1),
        "{diff}{}",
        String::from_utf8_lossy(&different.stderr)
    );
    assert!(diff.contains("+  size: 5"), "{diff}");
    let size = k
        .ok(&[
            "get",
            "clusterpool",
            "vsphere-pool",
            "-n",
            "my-project",
            "-o",
            "jsonpath={.spec.size}",
        ])
        .await;
    assert_eq!(size, "2");
}

#[tokio::test]
async fn kubectl_typed_creates_send_protobuf_that_the_server_decodes() {
    let k = start().await;
    k.ok(&["create", "namespace", "typed"]).await;
    k.ok(&["create", "configmap", "settings", "-n", "typed", "--from-literal=a=1"])
        .await;
    k.ok(&[
        "create",
        "secret",
        "generic",
        "token",
        "-n",
        "typed",
        "--from-literal=t=s3cr3t",
    ])
    .await;
    let data = k
        .ok(&[
            "get",
            "configmap",
            "settings",
            "-n",
            "typed",
            "-o",
            "jsonpath={.data.a}",
        ])
        .await;
    assert_eq!(data, "1");
    let secret = k
        .ok(&["get", "secret", "token", "-n", "typed", "-o", "jsonpath={.data.t}"])
        .await;
    assert_eq!(secret, "czNjcjN0");
    let deleted = k.ok(&["delete", "secret", "token", "-n", "typed"]).await;
    assert!(deleted.contains("deleted"), "{deleted}");

    k.ok(&["create", "serviceaccount", "robot", "-n", "typed"]).await;
    k.ok(&[
        "create",
        "role",
        "reader",
        "-n",
        "typed",
        "--verb=get,list",
        "--resource=configmaps",
    ])
    .await;
    k.ok(&[
        "create",
        "rolebinding",
        "robot-reads",
        "-n",
        "typed",
        "--role=reader",
        "--serviceaccount=typed:robot",
    ])
    .await;
    k.ok(&[
        "create",
        "clusterrole",
        "pool-reader",
        "--verb=get",
        "--resource=clusterpools.pools.stackd.dev",
    ])
    .await;
    let rule = k
        .ok(&[
            "get",
            "role",
            "reader",
            "-n",
            "typed",
            "-o",
            "jsonpath={.rules[0].verbs}",
        ])
        .await;
    assert_eq!(rule, r#"["get","list"]"#);
    let binding = k
        .ok(&[
            "get",
            "rolebinding",
            "robot-reads",
            "-n",
            "typed",
            "-o",
            "jsonpath={.roleRef.name} {.subjects[0].kind} {.subjects[0].name}",
        ])
        .await;
    assert_eq!(binding, "reader ServiceAccount robot");
    let resources = k
        .ok(&[
            "get",
            "clusterrole",
            "pool-reader",
            "-o",
            "jsonpath={.rules[0].apiGroups[0]} {.rules[0].resources[0]}",
        ])
        .await;
    assert_eq!(resources, "pools.stackd.dev clusterpools");
}

const CHART: &str = "apiVersion: v2
name: probe
version: 0.1.0
";

const CHART_TEMPLATE: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: probe
data:
  value: {{ .Values.value | quote }}
---
apiVersion: pools.stackd.dev/v1alpha1
kind: ClusterDeploymentCustomization
metadata:
  name: probe
spec:
  installConfigPatches:
  - op: add
    path: /x
    value: {{ .Values.value | quote }}
";

#[tokio::test]
async fn helm_installs_upgrades_and_uninstalls_a_chart_with_releases_in_secrets() {
    let k = start().await;
    let chart = k.dir.path().join("chart");
    std::fs::create_dir_all(chart.join("templates")).expect("chart directory");
    std::fs::write(chart.join("Chart.yaml"), CHART).expect("Chart.yaml");
    std::fs::write(chart.join("values.yaml"), "value: one\n").expect("values.yaml");
    std::fs::write(chart.join("templates/objects.yaml"), CHART_TEMPLATE).expect("template");
    let helm_binary = harness::tool("helm");
    let helm = |args: &[&str]| {
        let mut command = Command::new(&helm_binary);
        command
            .args(args)
            .arg("--kubeconfig")
            .arg(k.dir.path().join("kubeconfig"))
            .env("HELM_CACHE_HOME", k.dir.path().join("helm-cache"))
            .env("HELM_CONFIG_HOME", k.dir.path().join("helm-config"))
            .env("HELM_DATA_HOME", k.dir.path().join("helm-data"))
            .kill_on_drop(true);
        command
    };
    let chart_path = chart.to_string_lossy().into_owned();
    for args in [
        vec!["install", "probe", chart_path.as_str()],
        vec!["upgrade", "probe", chart_path.as_str(), "--set", "value=two"],
    ] {
        let output = helm(&args).output().await.expect("helm runs");
        assert!(
            output.status.success(),
            "helm {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let value = k
        .ok(&["get", "configmap", "probe", "-o", "jsonpath={.data.value}"])
        .await;
    assert_eq!(value, "two");
    let releases = k.ok(&["get", "secrets", "-l", "owner=helm", "-o", "name"]).await;
    assert_eq!(releases.lines().count(), 2, "{releases}");
    let output = helm(&["uninstall", "probe"]).output().await.expect("helm runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let left = k.ok(&["get", "secrets,configmaps,cdc", "-o", "name"]).await;
    assert!(left.trim().is_empty(), "{left}");
}
