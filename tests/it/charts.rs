//! The Helm charts (issue 10): `stackd-types` for every tenant API server and `stackd-controllers`
//! for the host. helm lints and renders them, kubectl applies them server-side to embedded servers,
//! and the daemon's real requests are checked against the RBAC they grant: each request allowed,
//! and each permission used by the scenario that needs it.

mod rbac;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use stackd::embedded::store::GroupResource;
use stackd::embedded::{ApiServer, ServerOptions};
use stackd::host::Parent;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::harness::{Daemon, LastSeen, NoDaemon, tool, until, wait_until};
use rbac::{Authorizer, Permission, Request, Subject};

/// The release namespace in the host and in each tenant.
const RELEASE_NAMESPACE: &str = "stackd-system";

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart(name: &str) -> String {
    repository().join("charts").join(name).display().to_string()
}

/// Runs a tool; `Ok(stdout)` on success, `Err(stdout + stderr)` otherwise.
async fn run(name: &str, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
    let mut child = Command::new(tool(name))
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{name} runs: {e}"));
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await.expect("stdin written");
    }
    let output = child.wait_with_output().await.expect("tool finishes");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    if output.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{stdout}{}", String::from_utf8_lossy(&output.stderr)))
    }
}

async fn ok(name: &str, args: &[&str], stdin: Option<&str>) -> String {
    run(name, args, stdin)
        .await
        .unwrap_or_else(|e| panic!("{name} {} failed:\n{e}", args.join(" ")))
}

/// `helm template` of one chart with a values file; the YAML stream.
async fn template(chart_name: &str, values: &str) -> Result<String, String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("values.yaml");
    std::fs::write(&file, values).expect("values written");
    let file = file.display().to_string();
    let path = chart(chart_name);
    let args = [
        "template",
        "stackd",
        &path,
        "--namespace",
        RELEASE_NAMESPACE,
        "-f",
        &file,
    ];
    run("helm", &args, None).await
}

fn documents(yaml: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).expect("helm output is YAML");
    docs.into_iter().filter(|d| d.is_object()).collect()
}

async fn render(chart_name: &str, values: &str) -> (String, Vec<Value>) {
    let yaml = template(chart_name, values)
        .await
        .unwrap_or_else(|e| panic!("helm template {chart_name} failed:\n{e}"));
    let objects = documents(&yaml);
    (yaml, objects)
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

/// `kubectl apply --server-side` of a YAML stream to an embedded server.
async fn apply(server: &ApiServer, yaml: &str) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig_yaml()).expect("kubeconfig written");
    let kubeconfig = kubeconfig.display().to_string();
    let cache = dir.path().join("cache").display().to_string();
    let args = [
        "--kubeconfig",
        &kubeconfig,
        "--cache-dir",
        &cache,
        "apply",
        "--server-side",
        "-f",
        "-",
    ];
    ok("kubectl", &args, Some(yaml)).await
}

/// An embedded server over https (kubectl sends tokens only there) that wants a bearer token: the
/// admin's (in its kubeconfig), or a filled service-account token.
async fn start_server(name: &str) -> ApiServer {
    let server = ApiServer::start(ServerOptions {
        name: name.into(),
        tls: true,
        token: Some(format!("admin-of-{name}")),
        ..Default::default()
    })
    .await
    .expect("embedded server");
    let namespaces: Api<Namespace> = Api::all(server.client().await);
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": RELEASE_NAMESPACE}})).expect("namespace");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("release namespace");
    server
}

// ---------------------------------------------------------------------------------------------
// helm lint and template

#[tokio::test]
async fn both_charts_pass_helm_lint_strict() {
    for name in ["stackd-types", "stackd-controllers"] {
        let path = chart(name);
        let output = ok("helm", &["lint", "--strict", &path], None).await;
        assert!(output.contains("0 chart(s) failed"), "{output}");
    }
}

#[tokio::test]
async fn both_charts_render_with_their_default_values() {
    let (_, types) = render("stackd-types", "").await;
    assert_eq!(
        types.iter().filter(|o| o["kind"] == "CustomResourceDefinition").count(),
        9,
        "stackd's eight and Crossplane's StackDefinition"
    );
    find(&types, "ClusterRole", "stackd-daemon");
    find(&types, "ClusterRoleBinding", "stackd-daemon");
    let (_, controllers) = render("stackd-controllers", "").await;
    let deployment = find(&controllers, "Deployment", "stackd");
    let args = deployment_args(deployment);
    assert!(
        !args.iter().any(|a| a == "--leader-elect"),
        "one replica, no election: {args:?}"
    );
    // Tenant objects: the CRD, and Secrets read in the release namespace alone.
    find(&controllers, "CustomResourceDefinition", "tenants.tenancy.stackd.dev");
    assert!(
        args.iter().any(|a| a == "--tenant-secret-namespaces=stackd-system"),
        "{args:?}"
    );
    let secret_roles: Vec<&str> = controllers
        .iter()
        .filter(|o| o["kind"] == "Role" && o["metadata"]["name"] == "stackd-tenant-secrets")
        .filter_map(|o| o["metadata"]["namespace"].as_str())
        .collect();
    assert_eq!(secret_roles, ["stackd-system"]);
    for kind in ["ServiceMonitor", "PrometheusRule", "ConfigMap"] {
        assert!(
            !controllers.iter().any(|o| o["kind"] == kind),
            "no {kind} unless asked for"
        );
    }
    assert_eq!(
        deployment["spec"]["strategy"]["type"], "Recreate",
        "never two daemons at once"
    );
    assert!(
        !controllers
            .iter()
            .any(|o| o["kind"] == "Role" && o["rules"][0]["resources"] == json!(["leases"])),
        "no Lease permissions without leader election"
    );
}

#[tokio::test]
async fn the_host_chart_with_sharding_runs_replicas_on_a_shard_map_without_a_leader() {
    let values = "replicas: 3\nsharding: {enabled: true, leaseDuration: 12}\n";
    let (_, controllers) = render("stackd-controllers", values).await;
    let deployment = find(&controllers, "Deployment", "stackd");
    let args = deployment_args(deployment);
    for expected in [
        "--shards",
        "--shard-namespace=stackd-system",
        "--shard-lease-duration=12",
    ] {
        assert!(args.iter().any(|a| a == expected), "{expected} in {args:?}");
    }
    assert!(
        !args.iter().any(|a| a == "--leader-elect"),
        "shards, not a leader: {args:?}"
    );
    assert_ne!(
        deployment["spec"]["strategy"]["type"], "Recreate",
        "replicas on shard leases may overlap in a rollout"
    );
    let role = find(&controllers, "Role", "stackd-shards");
    assert_eq!(role["rules"][0]["resources"], json!(["leases"]));
    assert_eq!(role["rules"][1]["resources"], json!(["configmaps"]));
    assert_eq!(role["rules"][1]["verbs"], json!(["create", "list", "watch", "update"]));
    find(&controllers, "RoleBinding", "stackd-shards");
    assert!(
        !controllers
            .iter()
            .any(|o| o["metadata"]["name"] == "stackd-leader-election"),
        "no leader Lease permissions with sharding"
    );
    let path = chart("stackd-controllers");
    let output = ok(
        "helm",
        &[
            "lint",
            "--strict",
            &path,
            "--set",
            "sharding.enabled=true",
            "--set",
            "replicas=3",
        ],
        None,
    )
    .await;
    assert!(output.contains("0 chart(s) failed"), "{output}");
}

/// The daemon's pod admits nothing by default (tenant pods must not read /metrics), the metrics port
/// from the monitoring namespace's pods when one is named (which also reaches the tenant namespaces'
/// policies through --monitoring-namespace), the health port from listed node addresses; the policy
/// can be left out. The chart lints either way.
#[tokio::test]
async fn the_daemons_network_policy_admits_only_monitoring_and_can_be_left_out() {
    let (_, controllers) = render("stackd-controllers", "").await;
    let policy = find(&controllers, "NetworkPolicy", "stackd");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "stackd"
    );
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(policy["spec"]["ingress"], json!([]), "nothing admitted");
    let args = deployment_args(find(&controllers, "Deployment", "stackd"));
    assert!(
        !args.iter().any(|a| a.starts_with("--monitoring-namespace")),
        "{args:?}"
    );

    let values = "networkPolicy: {monitoringNamespace: monitoring, nodeCIDRs: [10.0.0.0/16]}\n";
    let (_, controllers) = render("stackd-controllers", values).await;
    let policy = find(&controllers, "NetworkPolicy", "stackd");
    assert_eq!(
        policy["spec"]["ingress"],
        json!([
            {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                "ports": [{"port": "metrics", "protocol": "TCP"}]},
            {"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}], "ports": [{"port": "health", "protocol": "TCP"}]},
        ])
    );
    let args = deployment_args(find(&controllers, "Deployment", "stackd"));
    assert!(
        args.iter().any(|a| a == "--monitoring-namespace=monitoring"),
        "{args:?}"
    );

    let (_, controllers) = render("stackd-controllers", "networkPolicy: {enabled: false}\n").await;
    assert!(!controllers.iter().any(|o| o["kind"] == "NetworkPolicy"));
    let path = chart("stackd-controllers");
    for set in [
        "networkPolicy.enabled=false",
        "networkPolicy.monitoringNamespace=monitoring",
    ] {
        let output = ok("helm", &["lint", "--strict", &path, "--set", set], None).await;
        assert!(output.contains("0 chart(s) failed"), "{set}: {output}");
    }
}

/// scripts/image tags the image with the crate version; the charts run that tag unless told otherwise.
#[tokio::test]
async fn the_charts_default_image_is_the_one_this_version_builds() {
    let version = env!("CARGO_PKG_VERSION");
    for name in ["stackd-types", "stackd-controllers"] {
        let path = repository().join("charts").join(name).join("Chart.yaml");
        let text = std::fs::read_to_string(&path).expect("Chart.yaml");
        let metadata: Value = serde_saphyr::from_str(&text).expect("Chart.yaml is YAML");
        assert_eq!(metadata["appVersion"], version, "{name}'s appVersion");
    }
    let (_, controllers) = render("stackd-controllers", "").await;
    let deployment = find(&controllers, "Deployment", "stackd");
    let image = format!("ghcr.io/stackd-dev/stackd:{version}");
    assert_eq!(deployment["spec"]["template"]["spec"]["containers"][0]["image"], image);
    // The install Jobs' `unpack` container runs the daemon's own image.
    let args = deployment_args(deployment);
    assert!(args.contains(&format!("--stackd-image={image}")), "{args:?}");
}

#[tokio::test]
async fn optional_parts_of_the_charts_can_be_left_out() {
    let values = "crds: {install: false}\npersonas: {create: false}\ndaemon: {serviceAccount: {tokenSecret: false}}";
    let (_, types) = render("stackd-types", values).await;
    let kinds: BTreeSet<&str> = types.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["ClusterRole", "ClusterRoleBinding", "ServiceAccount"])
    );
    assert_eq!(
        types.iter().filter(|o| o["kind"] == "ClusterRole").count(),
        1,
        "only the daemon's"
    );

    let values = "tenants: {existingSecret: my-tenants, kubeconfigs: {\"a.yaml\": x}}\nmetrics: {service: false}";
    let (_, controllers) = render("stackd-controllers", values).await;
    assert!(
        !controllers
            .iter()
            .any(|o| o["kind"] == "Secret" || o["kind"] == "Service")
    );
    let deployment = find(&controllers, "Deployment", "stackd");
    assert_eq!(
        deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
        "my-tenants"
    );
}

#[tokio::test]
async fn bad_values_fail_rendering_with_a_message_that_names_the_fix() {
    let no_subject = "daemon: {serviceAccount: {create: false}, subjects: []}";
    let err = template("stackd-types", no_subject).await.expect_err("no subject");
    assert!(
        err.contains("daemon.serviceAccount.create or list daemon.subjects"),
        "{err}"
    );
    let bad_key = "tenants: {kubeconfigs: {\"Acme.json\": \"x\"}}";
    let err = template("stackd-controllers", bad_key).await.expect_err("bad key");
    assert!(err.contains("must be <tenant>.yaml"), "{err}");
}

/// The chart's CRDs without what the chart adds (its labels and the keep annotation).
fn without_chart_metadata(mut crd: Value) -> Value {
    let metadata = crd["metadata"].as_object_mut().expect("metadata");
    metadata.remove("labels");
    metadata.remove("annotations");
    crd
}

/// Every number as a float: helm's YAML round trip writes `1.0` as `1`, the same JSON number to
/// the API server.
fn numbers_as_floats(value: Value) -> Value {
    match value {
        Value::Number(n) => n.as_f64().map_or(Value::Number(n), |f| json!(f)),
        Value::Array(items) => Value::Array(items.into_iter().map(numbers_as_floats).collect()),
        Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, numbers_as_floats(v))).collect()),
        other => other,
    }
}

#[tokio::test]
async fn the_types_chart_carries_exactly_the_crds_directory_kept_on_uninstall() {
    let crds_dir = repository().join("crds");
    let copies = repository().join("charts/stackd-types/files/crds");
    let mut expected = BTreeMap::new();
    // The tenants' CRDs are the files of crds/; crds/host/ is the host chart's.
    for entry in std::fs::read_dir(&crds_dir).expect("crds/") {
        let path = entry.expect("entry").path();
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("CRD file");
        let name = path.file_name().expect("file name").to_owned();
        let copy = std::fs::read_to_string(copies.join(&name)).unwrap_or_default();
        assert_eq!(
            copy,
            text,
            "charts/stackd-types/files/crds/{} differs from crds/: run `cp crds/*.yaml charts/stackd-types/files/crds/`",
            name.to_string_lossy()
        );
        let crd: Value = serde_saphyr::from_str(&text).expect("CRD YAML");
        let name = crd["metadata"]["name"].as_str().expect("name").to_string();
        expected.insert(name, numbers_as_floats(crd));
    }
    assert_eq!(
        std::fs::read_dir(&copies).expect("copies").count(),
        expected.len(),
        "files/crds/ holds a CRD that crds/ does not"
    );
    let (_, objects) = render("stackd-types", "").await;
    let rendered: BTreeMap<String, Value> = objects
        .into_iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .map(|crd| {
            assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
            let name = crd["metadata"]["name"].as_str().expect("name").to_string();
            (name, numbers_as_floats(without_chart_metadata(crd)))
        })
        .collect();
    assert_eq!(rendered.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>());
    for (name, crd) in &expected {
        pretty_assertions::assert_eq!(&rendered[name], crd, "{name}");
    }
}

/// Issue 31: the host chart carries the host's CRDs (crds/host/: Tenant), kept on uninstall.
#[tokio::test]
async fn the_controllers_chart_carries_exactly_the_host_crds_kept_on_uninstall() {
    let host_dir = repository().join("crds/host");
    let copies = repository().join("charts/stackd-controllers/files/crds");
    let mut expected = BTreeMap::new();
    for entry in std::fs::read_dir(&host_dir).expect("crds/host/") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("CRD file");
        let name = path.file_name().expect("file name").to_owned();
        let copy = std::fs::read_to_string(copies.join(&name)).unwrap_or_default();
        assert_eq!(
            copy,
            text,
            "charts/stackd-controllers/files/crds/{} differs from crds/host/: run `cp crds/host/*.yaml charts/stackd-controllers/files/crds/`",
            name.to_string_lossy()
        );
        let crd: Value = serde_saphyr::from_str(&text).expect("CRD YAML");
        let name = crd["metadata"]["name"].as_str().expect("name").to_string();
        expected.insert(name, numbers_as_floats(crd));
    }
    assert_eq!(std::fs::read_dir(&copies).expect("copies").count(), expected.len());
    let (_, objects) = render("stackd-controllers", "").await;
    let rendered: BTreeMap<String, Value> = objects
        .into_iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .map(|crd| {
            assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
            let name = crd["metadata"]["name"].as_str().expect("name").to_string();
            (name, numbers_as_floats(without_chart_metadata(crd)))
        })
        .collect();
    assert_eq!(rendered, expected);
    let (_, objects) = render("stackd-controllers", "crds: {install: false}").await;
    assert!(!objects.iter().any(|o| o["kind"] == "CustomResourceDefinition"));
}

const MONITORING_VALUES: &str = r#"
metrics:
  serviceMonitor: {enabled: true, interval: 15s, labels: {release: prometheus}}
  prometheusRule: {enabled: true, labels: {release: prometheus}, tenantDownFor: 7m}
  dashboard: {enabled: true, namespace: monitoring}
tenants: {secretNamespaces: [stackd-system, vcluster-tenants]}
"#;

/// Issue 31: the ServiceMonitor, PrometheusRule and dashboard, each off by default, and the
/// Secret grants in the namespaces given and nowhere else.
#[tokio::test]
async fn the_host_chart_renders_monitoring_and_secret_grants_when_asked() {
    let (_, objects) = render("stackd-controllers", MONITORING_VALUES).await;
    let monitor = find(&objects, "ServiceMonitor", "stackd");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["endpoints"][0]["interval"], "15s");
    let service = find(&objects, "Service", "stackd-metrics");
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(
            &service["metadata"]["labels"][key], value,
            "the ServiceMonitor selects the Service"
        );
    }
    let rule = find(&objects, "PrometheusRule", "stackd");
    let alerts: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert_eq!(
        alerts,
        [
            "StackdTenantDown",
            "StackdReconcileErrorsRising",
            "StackdShardTenantsUnserved",
            "StackdInstallNotReady"
        ]
    );
    assert_eq!(rule["spec"]["groups"][0]["rules"][0]["for"], "7m");
    let dashboard = find(&objects, "ConfigMap", "stackd-dashboard");
    assert_eq!(dashboard["metadata"]["namespace"], "monitoring");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dashboard["data"]["stackd.json"].as_str().expect("JSON")).expect("dashboard JSON");
    assert_eq!(json["title"], "stackd");
    let args = deployment_args(find(&objects, "Deployment", "stackd"));
    assert!(
        args.iter()
            .any(|a| a == "--tenant-secret-namespaces=stackd-system,vcluster-tenants"),
        "{args:?}"
    );
    let daemon = Subject::service_account(RELEASE_NAMESPACE, "stackd");
    let rbac = Authorizer::for_subject(&objects, &daemon);
    for namespace in ["stackd-system", "vcluster-tenants"] {
        for verb in ["get", "list", "watch"] {
            assert!(
                rbac.allows(&Request::new(verb, "", "secrets", namespace)),
                "{verb} secrets in {namespace}"
            );
        }
    }
    for request in [
        Request::new("get", "", "secrets", "kube-system"),
        Request::new("list", "", "secrets", ""),
        Request::new("create", "", "secrets", "stackd-system"),
        Request::new("update", "tenancy.stackd.dev", "tenants", ""),
    ] {
        assert!(!rbac.allows(&request), "{request} allowed");
    }
    let path = chart("stackd-controllers");
    let dir = tempfile::tempdir().expect("temp dir");
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, MONITORING_VALUES).expect("values");
    let values = values.display().to_string();
    let output = ok("helm", &["lint", "--strict", &path, "-f", &values], None).await;
    assert!(output.contains("0 chart(s) failed"), "{output}");
    let err = template(
        "stackd-controllers",
        "metrics: {service: false, serviceMonitor: {enabled: true}}",
    )
    .await
    .expect_err("a ServiceMonitor without its Service");
    assert!(
        err.contains("metrics.serviceMonitor.enabled needs metrics.service"),
        "{err}"
    );
}

/// The metric names in `text`: every `stackd_…` word.
fn metric_names(text: &str) -> BTreeSet<String> {
    regex::Regex::new(r"stackd_[a-z_]+[a-z]")
        .expect("regex")
        .find_iter(text)
        .map(|m| m.as_str().to_string())
        .collect()
}

/// Whether `/metrics` has `name`: as a sample, or (a family with no sample yet, such as the shard
/// gauges without sharding) as a family whose samples are so named: a counter's `_total`, a
/// histogram's `_bucket`, `_sum` and `_count`.
fn exposes(metrics: &str, name: &str) -> bool {
    let sample = metrics.lines().any(|line| {
        line.strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
    });
    let family = |base: &str, kind: &str| metrics.lines().any(|line| line == format!("# TYPE {base} {kind}"));
    let counter = name.strip_suffix("_total").is_some_and(|base| family(base, "counter"));
    let histogram = ["_bucket", "_sum", "_count"]
        .iter()
        .any(|suffix| name.strip_suffix(suffix).is_some_and(|base| family(base, "histogram")));
    sample || counter || histogram || family(name, "gauge")
}

/// Issue 31: every metric the alerts and the dashboard use is one a running daemon serves, in the
/// situations they watch for: a tenant served with its objects counted, one down (restarted, its
/// cause told), a reconcile failing, and the tenants shared (`--shards`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_and_the_dashboard_use_is_on_a_running_daemons_metrics() {
    let (yaml, _) = render("stackd-controllers", MONITORING_VALUES).await;
    let used = metric_names(&yaml);
    assert!(used.len() >= 8, "{used:?}");
    let fleet = crate::harness::Fleet::start(&["acme"]).await;
    fleet.leader_election_namespace().await;
    crate::harness::install_crds(&fleet.tenant_server("acme").client().await).await;
    let dead = crate::harness::dead_address();
    let ghost = fleet
        .tenant_server("acme")
        .kubeconfig_yaml()
        .replace(&fleet.tenant_server("acme").url(), &format!("http://{}", dead.address));
    std::fs::write(fleet.tenant_file("ghost"), ghost).expect("ghost's kubeconfig");
    // acme's host namespace cannot be made at first: a reconcile fails.
    let create_namespace = stackd::embedded::faults::RequestMatch::any()
        .verb(stackd::embedded::Verb::Create)
        .resource("namespaces");
    fleet.host().faults().fail_next(1, create_namespace, 500);
    let daemon = fleet.daemon(&["--shards", "--shard-namespace", "stackd-system"]);
    until(
        "every metric the alerts and dashboard use on /metrics",
        Duration::from_secs(30),
        &daemon,
        || async {
            let metrics = daemon.http_get("/metrics").unwrap_or_default();
            used.iter().all(|name| exposes(&metrics, name))
        },
    )
    .await;
}

fn deployment_args(deployment: &Value) -> Vec<String> {
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Applied to embedded servers

const HOST_VALUES: &str = r#"
image: {repository: registry.example.com/stackd, tag: "1.2.3"}
replicas: 2
leaderElection: {leaseDuration: 9}
serviceAccount: {name: stackd-daemon, annotations: {team: platform}}
tenants:
  mountPath: /var/lib/stackd/tenants
  namespaceTemplate: "t-{tenant}"
  kubeconfigs:
    acme.yaml: |
      apiVersion: v1
      kind: Config
metrics: {port: 9090}
health: {port: 9091}
resources: {requests: {cpu: 50m, memory: 64Mi}, limits: {memory: 256Mi}}
tenantQuota: {pods: "9", secrets: null}
stackPods: {nodeSelector: {pool: stacks}, tolerations: ["dedicated=stacks:NoSchedule"]}
stackCrdGroups: ["*.example.org", "widgets.acme.io"]
platformDependencyGroups: ["database.crossplane.io", "*.platform.example.org"]
stackLimits: {maxPackageCrds: 200, namespaceMaxInstalls: 5}
allowedRegistries: ["quay.io/acme", "registry.example.com:5000"]
"#;

const TENANT_VALUES: &str = r#"
daemon:
  serviceAccount: {name: stackd-daemon}
  subjects:
  - {kind: User, apiGroup: rbac.authorization.k8s.io, name: stackd-client-cert}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_chart_applied_to_a_host_is_what_the_values_say() {
    let host = start_server("host").await;
    let (yaml, _) = render("stackd-controllers", HOST_VALUES).await;
    let output = apply(&host, &yaml).await;
    assert!(output.contains("deployment.apps/stackd serverside-applied"), "{output}");
    let client = host.client().await;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let deployment = serde_json::to_value(deployments.get("stackd").await.expect("Deployment")).expect("JSON");
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"], 2);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "stackd-daemon");
    // What the `restricted` Pod Security level asks of a pod.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let container = &pod["containers"][0];
    assert_eq!(container["image"], "registry.example.com/stackd:1.2.3");
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(container["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(container["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(container["resources"]["limits"]["memory"], "256Mi");
    assert_eq!(container["resources"]["requests"]["cpu"], "50m");
    assert_eq!(container["ports"][0]["name"], "metrics");
    assert_eq!(container["ports"][0]["containerPort"], 9090);
    // The probes have a listener of their own; the metrics one, behind the Service, answers
    // /metrics alone.
    assert_eq!(container["ports"][1]["name"], "health");
    assert_eq!(container["ports"][1]["containerPort"], 9091);
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["livenessProbe"]["httpGet"]["port"], "health");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["readinessProbe"]["httpGet"]["port"], "health");
    let args = deployment_args(&deployment);
    for expected in [
        "--tenants-dir=/var/lib/stackd/tenants",
        "--tenant-namespace-template=t-{tenant}",
        "--service-account=stackd-system/stackd-daemon",
        "--metrics-addr=0.0.0.0:9090",
        "--health-addr=0.0.0.0:9091",
        "--leader-elect",
        "--leader-elect-namespace=stackd-system",
        "--leader-elect-lease-duration=9",
        "--stackd-image=registry.example.com/stackd:1.2.3",
        "--tenant-quota=count/jobs.batch=50,limits.cpu=16,limits.ephemeral-storage=50Gi,limits.memory=32Gi,pods=9,requests.cpu=8,requests.ephemeral-storage=20Gi,requests.memory=16Gi",
        "--tenant-container-defaults=limits.cpu=1,limits.ephemeral-storage=1Gi,limits.memory=512Mi,requests.cpu=100m,requests.ephemeral-storage=100Mi,requests.memory=128Mi",
        "--stack-node-selector=pool=stacks",
        "--stack-toleration=dedicated=stacks:NoSchedule",
        "--stack-crd-groups=*.example.org,widgets.acme.io",
        "--platform-dependency-groups=database.crossplane.io,*.platform.example.org",
        "--max-package-crds=200",
        "--namespace-max-installs=5",
        "--allowed-registries=quay.io/acme,registry.example.com:5000",
    ] {
        assert!(args.iter().any(|a| a == expected), "{expected} missing from {args:?}");
    }
    let mount = &container["volumeMounts"][0];
    assert_eq!(mount["mountPath"], "/var/lib/stackd/tenants");
    assert_eq!(mount["readOnly"], true);
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "stackd-tenants");
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never sees Secret updates"
    );

    let services: Api<Service> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let service = serde_json::to_value(services.get("stackd-metrics").await.expect("metrics Service")).expect("JSON");
    assert_eq!(
        service["spec"]["ports"],
        json!([{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]),
        "the Service reaches the metrics listener and nothing else"
    );

    let secrets: Api<Secret> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let tenants = secrets.get("stackd-tenants").await.expect("tenants Secret");
    let data = tenants.data.expect("data");
    assert_eq!(
        String::from_utf8_lossy(&data["acme.yaml"].0),
        "apiVersion: v1\nkind: Config\n"
    );

    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    let tenant_role = cluster_roles
        .get("stackd-tenant-namespace")
        .await
        .expect("fixed role name");
    assert!(!tenant_role.rules.unwrap_or_default().is_empty());
    let daemon_role = serde_json::to_value(cluster_roles.get("stackd").await.expect("daemon role")).expect("JSON");
    let bind = daemon_role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .find(|r| r["verbs"] == json!(["bind"]))
        .expect("a bind rule");
    assert_eq!(bind["resourceNames"], json!(["stackd-tenant-namespace"]));
    let bindings: Api<ClusterRoleBinding> = Api::all(client);
    let binding = bindings.get("stackd").await.expect("binding");
    let subject = &binding.subjects.expect("subjects")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            subject.name.as_str(),
            subject.namespace.as_deref()
        ),
        ("ServiceAccount", "stackd-daemon", Some(RELEASE_NAMESPACE))
    );
    host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_types_chart_applied_to_a_tenant_is_what_the_values_say() {
    let tenant = start_server("acme").await;
    let (yaml, _) = render("stackd-types", TENANT_VALUES).await;
    apply(&tenant, &yaml).await;
    let client = tenant.client().await;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let established: BTreeSet<String> = crds
        .list(&Default::default())
        .await
        .expect("CRDs")
        .items
        .into_iter()
        .filter(|crd| {
            crd.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Established" && c.status == "True"))
        })
        .filter_map(|crd| crd.metadata.name)
        .collect();
    let expected: BTreeSet<String> = stackd::api::crds::all()
        .into_iter()
        .filter_map(|crd| crd.metadata.name)
        .collect();
    assert_eq!(established, expected);

    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let binding = bindings.get("stackd-daemon").await.expect("daemon binding");
    assert_eq!(binding.role_ref.name, "stackd-daemon");
    let subjects: Vec<(String, String)> = binding
        .subjects
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.kind, s.name))
        .collect();
    assert_eq!(
        subjects,
        [
            ("User".to_string(), "stackd-client-cert".to_string()),
            ("ServiceAccount".to_string(), "stackd-daemon".to_string())
        ]
    );

    let roles: Api<ClusterRole> = Api::all(client.clone());
    for persona in ["admin", "edit", "view"] {
        let role = roles.get(&format!("stackd-{persona}")).await.expect("persona role");
        let labels = role.metadata.labels.unwrap_or_default();
        assert_eq!(
            labels
                .get(&format!("rbac.authorization.k8s.io/aggregate-to-{persona}"))
                .map(String::as_str),
            Some("true"),
            "{persona}"
        );
        // A ClusterStackInstall's stack is bound cluster-wide: no persona, admin included (often
        // granted per namespace), may write one.
        let writes_cluster_installs = role.rules.unwrap_or_default().iter().any(|rule| {
            rule.resources
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|r| r == "clusterstackinstalls" || r == "*")
                && rule.verbs.iter().any(|v| v == "create" || v == "*")
        });
        assert!(!writes_cluster_installs, "{persona} may create ClusterStackInstalls");
    }
    let installer = roles
        .get("stackd-cluster-stack-installer")
        .await
        .expect("the ClusterStackInstall role");
    assert!(
        !installer
            .metadata
            .labels
            .unwrap_or_default()
            .keys()
            .any(|k| k.starts_with("rbac.authorization.k8s.io/aggregate-to-")),
        "the ClusterStackInstall role is bound on purpose, never aggregated"
    );
    let role = roles.get("stackd-daemon").await.expect("daemon role");
    let escalates = role.rules.unwrap_or_default().iter().any(|r| {
        r.resources
            .as_deref()
            .unwrap_or_default()
            .contains(&"clusterroles".to_string())
            && r.verbs.contains(&"escalate".to_string())
            && r.verbs.contains(&"bind".to_string())
    });
    assert!(escalates, "the daemon grants each stack its own rules");

    // The token controller fills the daemon's long-lived token: what a token kubeconfig is made of.
    let secrets: Api<Secret> = Api::namespaced(client, RELEASE_NAMESPACE);
    until("the token Secret filled", Duration::from_secs(5), &NoDaemon, || async {
        let secret = secrets.get("stackd-daemon-token").await.expect("token Secret");
        secret.data.as_ref().is_some_and(|d| d.contains_key("token"))
    })
    .await;
    tenant.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Least privilege: the daemon's requests against the rendered RBAC

/// Situations in which the daemon uses a permission. Each permission the charts grant names the
/// scenario that needs it (`HOST_USES`, `TENANT_USES`); the scenarios run below must use every
/// permission they are named for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    /// The daemon starts: it watches each tenant's CRDs and makes each tenant's host namespace
    /// and the RoleBinding of `stackd-tenant-namespace` there.
    DaemonStartup,
    /// A tenant's RoleBinding whose subject was edited is put back.
    BindingRepair,
    /// A tenant's ResourceQuota, LimitRange and NetworkPolicy, edited by hand, are put back.
    QuotaRepair,
    /// Host objects whose tenant parent is gone are deleted.
    OrphanSweep,
    /// Replicas elect a leader on a Lease.
    LeaderElection,
    /// Replicas share the tenants (`sharding.enabled`): one places them in the shard map, another
    /// joins, the first is killed and the second deletes its expired member Lease and takes its
    /// tenants.
    Sharding,
    /// A create answered AlreadyExists reads the object instead (src/host/namespace.rs): another
    /// writer was first, or the daemon's own earlier write had not reached its watch cache yet.
    /// It happens in some startup runs and not others, so no run can require it.
    CreateRace,
    /// StackInstall and ClusterStackInstall → install Job and its pod log → CRDs and Stack → stack
    /// RBAC, token, host Deployment; uninstall.
    StackInstall,
    /// A pool's clusters claimed, expired, replaced or deprovisioned and its empty namespaces
    /// reaped: tested in tests/it/pools.rs, not run here.
    PoolLifecycle,
    /// The bare-metal asset controller and baremetal pools: tested in tests/it/inventory.rs, not run
    /// here.
    BareMetal,
    /// Paths no run here takes, each tested with its controller (tests/it/stacks_*.rs): tenant
    /// objects edited by hand and replaced, upgrades that change a CRD or a Stack, a stack changing
    /// its permission scope (its old binding deleted), a templating stack's StackDefinition, and
    /// `<owner>/finalizers` updates that only the OwnerReferencesPermissionEnforcement admission
    /// plugin asks for.
    RarePaths,
    /// A stack's host Deployment and token Secret, edited by hand, are put back.
    HostDriftRepair,
    /// A ClusterPool fills from its inventory: leases, namespaces, ClusterDeployments, installer
    /// Jobs with their output ServiceAccount, Role and RoleBinding. Runs once the pool controllers
    /// land.
    PoolFill,
    /// A tenant registered by a Tenant object naming a Secret of the release namespace: the
    /// namespace's Secrets watched by metadata, that one read, the Tenant's status written, Events
    /// on it.
    TenantObjects,
}

use Scenario::*;

/// Some verbs on some resources of one role, and the scenario that uses them.
struct Use {
    role: &'static str,
    group: &'static str,
    resources: &'static [&'static str],
    verbs: &'static [&'static str],
    scenario: Scenario,
}

const fn uses(
    role: &'static str,
    group: &'static str,
    resources: &'static [&'static str],
    verbs: &'static [&'static str],
    scenario: Scenario,
) -> Use {
    Use {
        role,
        group,
        resources,
        verbs,
        scenario,
    }
}

const HOST_ROLE: &str = "ClusterRole/stackd";
const NAMESPACE_ROLE: &str = "ClusterRole/stackd-tenant-namespace";
const LEADER_ROLE: &str = "Role/stackd-system/stackd-leader-election";
const SHARDS_ROLE: &str = "Role/stackd-system/stackd-shards";
const TENANT_SECRETS_ROLE: &str = "Role/stackd-system/stackd-tenant-secrets";
const TENANT_EVENTS_ROLE: &str = "Role/default/stackd-tenant-events";
const TENANCY: &str = "tenancy.stackd.dev";
const RBAC: &str = "rbac.authorization.k8s.io";

/// Every permission of stackd-controllers, and who uses it.
#[rustfmt::skip]
const HOST_USES: &[Use] = &[
    uses(HOST_ROLE, "", &["namespaces"], &["list", "watch", "create", "patch"], DaemonStartup),
    uses(HOST_ROLE, "", &["namespaces"], &["get"], CreateRace),
    uses(HOST_ROLE, RBAC, &["rolebindings"], &["list", "watch", "create"], DaemonStartup),
    uses(HOST_ROLE, RBAC, &["rolebindings"], &["update"], BindingRepair),
    uses(HOST_ROLE, RBAC, &["rolebindings"], &["get"], CreateRace),
    uses(HOST_ROLE, RBAC, &["clusterroles"], &["bind"], DaemonStartup),
    uses(HOST_ROLE, TENANCY, &["tenants"], &["list", "watch"], DaemonStartup),
    uses(HOST_ROLE, TENANCY, &["tenants/status"], &["patch"], TenantObjects),
    uses(TENANT_SECRETS_ROLE, "", &["secrets"], &["get", "list", "watch"], TenantObjects),
    uses(TENANT_EVENTS_ROLE, "events.k8s.io", &["events"], &["create"], TenantObjects),
    // A repeat of the same Event within minutes is a patch of the first.
    uses(TENANT_EVENTS_ROLE, "events.k8s.io", &["events"], &["patch"], RarePaths),
    uses(LEADER_ROLE, "coordination.k8s.io", &["leases"], &["get", "list", "watch", "create", "patch"], LeaderElection),
    uses(SHARDS_ROLE, "coordination.k8s.io", &["leases"], &["list", "watch", "create", "update", "delete"], Sharding),
    uses(SHARDS_ROLE, "", &["configmaps"], &["create", "list", "watch", "update"], Sharding),
    uses(NAMESPACE_ROLE, "batch", &["jobs"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, "batch", &["jobs"], &["watch", "create"], StackInstall),
    uses(NAMESPACE_ROLE, "batch", &["jobs"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, "", &["pods"], &["list", "watch"], StackInstall),
    uses(NAMESPACE_ROLE, "", &["pods/log"], &["get"], StackInstall),
    // Only while an install Job's pod is refused.
    uses(NAMESPACE_ROLE, "", &["events"], &["list"], RarePaths),
    uses(NAMESPACE_ROLE, "apps", &["deployments"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, "apps", &["deployments"], &["watch", "create"], StackInstall),
    uses(NAMESPACE_ROLE, "apps", &["deployments"], &["update"], HostDriftRepair),
    uses(NAMESPACE_ROLE, "apps", &["deployments"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, "", &["secrets"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, "", &["secrets"], &["watch", "create"], StackInstall),
    uses(NAMESPACE_ROLE, "", &["secrets"], &["update"], HostDriftRepair),
    uses(NAMESPACE_ROLE, "", &["secrets"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, "", &["secrets"], &["patch"], PoolFill),
    uses(NAMESPACE_ROLE, "", &["serviceaccounts"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, "", &["serviceaccounts"], &["create"], PoolFill),
    uses(NAMESPACE_ROLE, "", &["serviceaccounts"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, "", &["serviceaccounts"], &["update"], RarePaths),
    uses(NAMESPACE_ROLE, RBAC, &["roles", "rolebindings"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, RBAC, &["roles", "rolebindings"], &["create"], PoolFill),
    uses(NAMESPACE_ROLE, RBAC, &["rolebindings"], &["update"], PoolFill),
    uses(NAMESPACE_ROLE, RBAC, &["roles", "rolebindings"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, RBAC, &["roles"], &["update"], RarePaths),
    uses(NAMESPACE_ROLE, "", &["configmaps"], &["list", "delete"], OrphanSweep),
    uses(NAMESPACE_ROLE, "", &["resourcequotas", "limitranges"], &["list", "create"], DaemonStartup),
    uses(NAMESPACE_ROLE, "", &["resourcequotas", "limitranges"], &["update"], QuotaRepair),
    uses(NAMESPACE_ROLE, "", &["resourcequotas", "limitranges"], &["get"], CreateRace),
    uses(NAMESPACE_ROLE, "networking.k8s.io", &["networkpolicies"], &["list", "watch", "create"], DaemonStartup),
    uses(NAMESPACE_ROLE, "networking.k8s.io", &["networkpolicies"], &["update"], QuotaRepair),
    uses(NAMESPACE_ROLE, "networking.k8s.io", &["networkpolicies"], &["get"], CreateRace),
];

const DAEMON_ROLE: &str = "ClusterRole/stackd-daemon";
const STACK_STATUS: &[&str] = &["stackinstalls/status", "clusterstackinstalls/status", "stacks/status"];
const STACK_FINALIZERS: &[&str] = &[
    "stackinstalls/finalizers",
    "clusterstackinstalls/finalizers",
    "stacks/finalizers",
];
const POOL_KINDS: &[&str] = &[
    "clusterpools",
    "clusterdeploymentcustomizations",
    "clusterdeployments",
    "clusterclaims",
];

/// Every permission of the daemon's tenant ClusterRole in stackd-types, and who uses it.
#[rustfmt::skip]
const TENANT_USES: &[Use] = &[
    uses(DAEMON_ROLE, "apiextensions.k8s.io", &["customresourcedefinitions"], &["list", "watch"], DaemonStartup),
    uses(DAEMON_ROLE, "apiextensions.k8s.io", &["customresourcedefinitions"], &["create", "patch", "delete"], StackInstall),
    uses(DAEMON_ROLE, "apiextensions.k8s.io", &["customresourcedefinitions"], &["update"], RarePaths),
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["stackinstalls", "clusterstackinstalls", "stacks"], &["list"], OrphanSweep),
    // The sweep asks for an orphan's parent by name before deleting (tests/it/sweep.rs); this run's
    // orphans are of StackInstalls.
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["stackinstalls"], &["get"], OrphanSweep),
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["clusterstackinstalls", "stacks"], &["get"], RarePaths),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterpools", "clusterdeployments", "clusterclaims"], &["get"], RarePaths),
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["stackinstalls", "clusterstackinstalls"], &["watch", "patch"], StackInstall),
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["stacks"], &["watch", "create", "patch", "delete"], StackInstall),
    uses(DAEMON_ROLE, "stacks.stackd.dev", &["stacks"], &["update"], RarePaths),
    // A templating stack's StackDefinition, read and written by its Stack (tests/it/stacks_crossplane.rs).
    uses(DAEMON_ROLE, "packages.crossplane.io", &["stackdefinitions"], &["get", "create", "update"], RarePaths),
    uses(DAEMON_ROLE, "stacks.stackd.dev", STACK_STATUS, &["patch"], StackInstall),
    uses(DAEMON_ROLE, "stacks.stackd.dev", STACK_FINALIZERS, &["update"], RarePaths),
    uses(DAEMON_ROLE, "pools.stackd.dev", POOL_KINDS, &["list"], OrphanSweep),
    uses(DAEMON_ROLE, "pools.stackd.dev", POOL_KINDS, &["watch"], PoolFill),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterpools", "clusterdeploymentcustomizations", "clusterdeployments"], &["patch"], PoolFill),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterclaims"], &["patch"], PoolLifecycle),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterdeployments"], &["create"], PoolFill),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterdeployments"], &["update", "delete"], PoolLifecycle),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterclaims"], &["delete"], PoolLifecycle),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterdeploymentcustomizations"], &["get"], PoolLifecycle),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterpools/status"], &["patch"], PoolFill),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterclaims/status"], &["patch"], PoolLifecycle),
    uses(DAEMON_ROLE, "pools.stackd.dev", &["clusterdeploymentcustomizations/status", "clusterdeployments/status"], &["patch"], PoolFill),
    uses(DAEMON_ROLE, "inventory.stackd.dev", &["baremetalassets"], &["list"], OrphanSweep),
    uses(DAEMON_ROLE, "inventory.stackd.dev", &["baremetalassets"], &["get", "watch", "update", "patch"], BareMetal),
    uses(DAEMON_ROLE, "inventory.stackd.dev", &["baremetalassets/status"], &["update", "patch"], BareMetal),
    uses(DAEMON_ROLE, "", &["namespaces"], &["list", "watch", "create"], PoolFill),
    uses(DAEMON_ROLE, "", &["namespaces"], &["delete"], PoolLifecycle),
    uses(DAEMON_ROLE, "", &["secrets", "serviceaccounts"], &["list", "watch", "create"], StackInstall),
    uses(DAEMON_ROLE, "", &["secrets", "serviceaccounts"], &["get"], CreateRace),
    uses(DAEMON_ROLE, "", &["secrets", "serviceaccounts"], &["update"], RarePaths),
    uses(DAEMON_ROLE, RBAC, &["clusterroles"], &["list", "watch", "create", "delete"], StackInstall),
    uses(DAEMON_ROLE, RBAC, &["clusterroles"], &["escalate", "bind"], StackInstall),
    uses(DAEMON_ROLE, RBAC, &["clusterroles", "clusterrolebindings", "rolebindings"], &["get"], CreateRace),
    uses(DAEMON_ROLE, RBAC, &["clusterroles", "clusterrolebindings", "rolebindings"], &["update"], RarePaths),
    uses(DAEMON_ROLE, RBAC, &["clusterrolebindings"], &["list", "watch", "create", "delete"], StackInstall),
    uses(DAEMON_ROLE, RBAC, &["rolebindings"], &["list", "watch", "create"], StackInstall),
    uses(DAEMON_ROLE, RBAC, &["rolebindings"], &["delete"], RarePaths),
    uses(DAEMON_ROLE, "events.k8s.io", &["events"], &["create", "patch"], StackInstall),
];

fn expand(table: &[Use]) -> BTreeMap<Permission, Scenario> {
    let mut all = BTreeMap::new();
    for entry in table {
        for resource in entry.resources {
            for verb in entry.verbs {
                let permission = Permission {
                    role: entry.role.to_string(),
                    group: entry.group.to_string(),
                    resource: resource.to_string(),
                    verb: verb.to_string(),
                };
                assert!(
                    all.insert(permission.clone(), entry.scenario).is_none(),
                    "{permission} is listed twice"
                );
            }
        }
    }
    all
}

/// A host, one tenant API server serving two tenants (`acme` and `globex` share it), both charts
/// applied, and the daemon's directory (`host.yaml`, `tenants/`).
struct Installation {
    host: ApiServer,
    tenant: ApiServer,
    dir: tempfile::TempDir,
    /// The rendered Deployment's `stackd run` arguments.
    daemon_args: Vec<String>,
    host_subject: Subject,
    tenant_subject: Subject,
}

const LEAST_PRIVILEGE_HOST_VALUES: &str = "replicas: 2\n";

impl Installation {
    async fn new() -> Installation {
        let host = start_server("host").await;
        let tenant = start_server("tenant").await;
        let (host_yaml, host_objects) = render("stackd-controllers", LEAST_PRIVILEGE_HOST_VALUES).await;
        let (tenant_yaml, _) = render("stackd-types", "").await;
        apply(&host, &host_yaml).await;
        apply(&tenant, &tenant_yaml).await;
        // On the host the daemon's pod would get its ServiceAccount's token mounted; here a token
        // Secret stands in. On the tenant it uses the token Secret of the chart, as
        // kubeconfigs/README.md says.
        let host_token = json!({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
            "metadata": {"name": "stackd-token", "namespace": RELEASE_NAMESPACE,
                "annotations": {"kubernetes.io/service-account.name": "stackd"}}});
        apply(&host, &host_token.to_string()).await;
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(dir.path().join("tenants")).expect("tenants dir");
        let host_kubeconfig = service_account_kubeconfig(&host, "stackd-token").await;
        std::fs::write(dir.path().join("host.yaml"), host_kubeconfig).expect("host kubeconfig");
        let tenant_kubeconfig = service_account_kubeconfig(&tenant, "stackd-token").await;
        for name in ["acme", "globex"] {
            let file = dir.path().join("tenants").join(format!("{name}.yaml"));
            std::fs::write(file, &tenant_kubeconfig).expect("tenant kubeconfig");
        }
        Installation {
            daemon_args: deployment_args(find(&host_objects, "Deployment", "stackd")),
            host,
            tenant,
            dir,
            host_subject: Subject::service_account(RELEASE_NAMESPACE, "stackd"),
            tenant_subject: Subject::service_account(RELEASE_NAMESPACE, "stackd"),
        }
    }

    /// The chart's `stackd run` arguments, with fast timing and what the harness sets itself
    /// (kubeconfigs, tenants directory, admin address, and so the probes' own address) left out.
    fn daemon(&self, timing: &[&str]) -> Daemon {
        self.daemon_with(&self.daemon_args, timing)
    }

    /// Like [`Installation::daemon`], with the arguments of another rendering of the chart.
    fn daemon_with(&self, chart_args: &[String], timing: &[&str]) -> Daemon {
        let harness_sets = [
            "run",
            "--tenants-dir",
            "--metrics-addr",
            "--health-addr",
            "--backoff-base",
            "--sweep-interval",
            "--leader-elect-lease-duration",
            "--shard-lease-duration",
        ];
        let mut args: Vec<&str> = chart_args
            .iter()
            .map(String::as_str)
            .filter(|a| !harness_sets.iter().any(|h| a.split('=').next() == Some(h)))
            .collect();
        args.extend(timing);
        Daemon::spawn(self.dir.path(), &args)
    }

    fn host_has(&self, group: &str, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        self.host
            .store()
            .get(&GroupResource::new(group, resource), namespace, name)
    }
}

/// A kubeconfig of `server` with the token of the service-account-token Secret `secret` in the
/// release namespace, once the token controller has filled it.
async fn service_account_kubeconfig(server: &ApiServer, secret: &str) -> String {
    use base64::Engine;
    let secrets = GroupResource::new("", "secrets");
    let what = format!("the token Secret {secret} filled");
    let token = wait_until(&what, Duration::from_secs(10), &NoDaemon, || async {
        let filled = server.store().get(&secrets, RELEASE_NAMESPACE, secret);
        let token = filled.as_ref().and_then(|s| s["data"]["token"].as_str())?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(token)
            .expect("base64 token");
        Some(String::from_utf8(decoded).expect("UTF-8 token"))
    })
    .await;
    let mut kubeconfig = server.kubeconfig();
    for user in &mut kubeconfig.auth_infos {
        if let Some(auth) = user.auth_info.as_mut() {
            auth.token = Some(token.clone().into());
        }
    }
    serde_saphyr::to_string(&kubeconfig).expect("kubeconfig YAML")
}

/// The RBAC objects a server holds, and the ones written after `since` (a store resourceVersion).
fn rbac_objects(server: &ApiServer, since: u64) -> (Vec<Value>, Vec<Value>) {
    let kinds = [
        ("roles", "Role"),
        ("clusterroles", "ClusterRole"),
        ("rolebindings", "RoleBinding"),
        ("clusterrolebindings", "ClusterRoleBinding"),
    ];
    let mut all = Vec::new();
    let mut written = Vec::new();
    for (resource, kind) in kinds {
        let (objects, _) = server.store().list(&GroupResource::new(RBAC, resource), None);
        for mut object in objects {
            object["kind"] = json!(kind);
            let version: u64 = object["metadata"]["resourceVersion"]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if version > since {
                written.push(object.clone());
            }
            all.push(object);
        }
    }
    (all, written)
}

/// What the daemon asked one server during a scenario (no other client talks to the servers
/// meanwhile: the test reads the stores directly), including the escalation checks its writes of
/// roles and bindings met, and the server's RBAC objects at the end.
struct Observed {
    requests: Vec<Request>,
    rbac: Vec<Value>,
}

/// Counters and store position of a server at the start of a scenario.
struct Window {
    counts: stackd::embedded::counters::RequestCounts,
    version: u64,
}

impl Window {
    fn open(server: &ApiServer) -> Window {
        Window {
            counts: server.counters(),
            version: server.store().resource_version(),
        }
    }

    fn close(self, server: &ApiServer, subject: &Subject) -> Observed {
        let mut requests = Request::from_counts(&server.counters().since(&self.counts));
        let (rbac, written) = rbac_objects(server, self.version);
        requests.extend(rbac::escalation_checks(&rbac, &written, subject));
        Observed { requests, rbac }
    }
}

/// What a scenario covered, per server.
struct ScenarioRun {
    covers: &'static [Scenario],
    host: Observed,
    tenant: Observed,
}

/// Labels of a host object left behind by a StackInstall of `tenant` that no longer exists.
fn orphan_metadata(tenant: &str, name: &str, namespace: &str) -> Value {
    let parent = Parent::new("StackInstall", Some("team-a"), "gone", "uid-of-a-deleted-install");
    json!({"name": name, "namespace": namespace, "labels": parent.labels(tenant), "annotations": parent.annotations()})
}

/// The host kinds the sweep judges, as (group, plural, object).
fn orphans(tenant: &str, namespace: &str) -> Vec<(&'static str, &'static str, Value)> {
    let meta = |name: &str| orphan_metadata(tenant, name, namespace);
    let pod = json!({"restartPolicy": "Never", "containers": [{"name": "c", "image": "example.com/orphan:1"}]});
    vec![
        (
            "",
            "configmaps",
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("cm")}),
        ),
        (
            "",
            "secrets",
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta("secret")}),
        ),
        (
            "",
            "serviceaccounts",
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("sa")}),
        ),
        (
            RBAC,
            "roles",
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta("role"), "rules": []}),
        ),
        (
            RBAC,
            "rolebindings",
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta("binding"),
                "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": "role"}, "subjects": []}),
        ),
        (
            "batch",
            "jobs",
            json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta("job"),
                "spec": {"backoffLimit": 0, "template": {"spec": pod}}}),
        ),
        (
            "apps",
            "deployments",
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta("deployment"), "spec": {
                "selector": {"matchLabels": {"app": "orphan"}},
                "template": {"metadata": {"labels": {"app": "orphan"}}, "spec": {"containers": [{"name": "c", "image": "example.com/orphan:1"}]}}}}),
        ),
    ]
}

/// Daemon startup with two tenants: `acme` gets a new host namespace; `globex` already has one
/// (missing its Pod Security label), holding a RoleBinding whose subject someone edited and one
/// orphan of every host kind the sweep judges. Two replicas, as the chart runs them: the first
/// takes the Lease, the second waits on it and takes over when the first stops.
async fn daemon_startup_repair_sweep_and_leader_election(installation: &Installation) -> ScenarioRun {
    let globex = "tenant-globex-controllers";
    let client = installation.host.client().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace = json!({"metadata": {"name": globex, "labels": {"app.kubernetes.io/managed-by": "stackd", "stackd.dev/tenant": "globex"}}});
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(namespace).expect("namespace"),
        )
        .await
        .expect("globex namespace");
    let mut planted = orphans("globex", globex);
    planted.push((
        RBAC,
        "rolebindings",
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "stackd-tenant-namespace", "namespace": globex,
                "labels": {"app.kubernetes.io/managed-by": "stackd", "stackd.dev/tenant": "globex"}},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "stackd-tenant-namespace"},
            "subjects": [{"kind": "ServiceAccount", "name": "someone-else", "namespace": RELEASE_NAMESPACE}]}),
    ));
    let stackd_labels = json!({"app.kubernetes.io/managed-by": "stackd", "stackd.dev/tenant": "globex"});
    planted.push((
        "",
        "resourcequotas",
        json!({"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "stackd-tenant-quota", "namespace": globex, "labels": stackd_labels},
            "spec": {"hard": {"pods": "5000"}}}),
    ));
    planted.push((
        "",
        "limitranges",
        json!({"apiVersion": "v1", "kind": "LimitRange",
            "metadata": {"name": "stackd-tenant-limits", "namespace": globex, "labels": stackd_labels},
            "spec": {"limits": [{"type": "Container", "default": {"cpu": "64"}}]}}),
    ));
    planted.push((
        "networking.k8s.io",
        "networkpolicies",
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "stackd-tenant-isolation", "namespace": globex, "labels": stackd_labels},
            "spec": {"podSelector": {}, "ingress": [{}]}}),
    ));
    for (group, plural, object) in &planted {
        let version = if group.is_empty() {
            "v1".to_string()
        } else {
            format!("{group}/v1")
        };
        let resource = kube::api::ApiResource {
            group: group.to_string(),
            version: "v1".into(),
            api_version: version,
            kind: object["kind"].as_str().expect("kind").into(),
            plural: plural.to_string(),
        };
        let api: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), globex, &resource);
        let object: kube::api::DynamicObject = serde_json::from_value(object.clone()).expect("object");
        api.create(&PostParams::default(), &object).await.expect("planted");
    }

    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let timing = ["--sweep-interval", "300ms", "--leader-elect-lease-duration", "2"];
    let mut daemon = installation.daemon(&timing);
    let last = LastSeen::new(&daemon);
    until(
        "namespaces ready, orphans swept, lease taken",
        Duration::from_secs(20),
        &last,
        || async {
            let namespaces_ready = ["acme", "globex"].iter().all(|tenant| {
                let name = format!("tenant-{tenant}-controllers");
                let ns = installation.host_has("", "namespaces", "", &name);
                let binding = installation.host_has(RBAC, "rolebindings", &name, "stackd-tenant-namespace");
                let quota = installation.host_has("", "resourcequotas", &name, "stackd-tenant-quota");
                let limits = installation.host_has("", "limitranges", &name, "stackd-tenant-limits");
                let policy =
                    installation.host_has("networking.k8s.io", "networkpolicies", &name, "stackd-tenant-isolation");
                ns.is_some_and(|ns| ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted")
                    && binding.is_some_and(|b| b["subjects"][0]["name"] == "stackd")
                    && quota.is_some_and(|q| q["spec"]["hard"]["pods"] == "50")
                    && limits.is_some_and(|l| l["spec"]["limits"][0]["default"]["cpu"] == "1")
                    && policy.is_some_and(|p| p["spec"]["ingress"][0]["from"][0]["podSelector"] == json!({}))
            });
            let swept = orphans("globex", globex).iter().all(|(group, plural, object)| {
                let name = object["metadata"]["name"].as_str().expect("name");
                installation.host_has(group, plural, globex, name).is_none()
            });
            let leader = installation
                .host_has("coordination.k8s.io", "leases", RELEASE_NAMESPACE, "stackd-leader")
                .is_some();
            last.saw(&(
                ("namespaces ready", namespaces_ready),
                ("orphans swept", swept),
                ("lease taken", leader),
            ));
            namespaces_ready && swept && leader
        },
    )
    .await;
    let mut standby = installation.daemon(&timing);
    wait_for_log(&standby, "waiting for the leader lease").await;
    stop(&mut daemon).await;
    wait_for_log(&standby, "acquired the leader lease").await;
    stop(&mut standby).await;
    ScenarioRun {
        covers: &[DaemonStartup, BindingRepair, QuotaRepair, OrphanSweep, LeaderElection],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    }
}

/// Two replicas with the chart's sharding on: the first places the tenants in the shard map, the
/// second joins, the first is killed, and the second deletes its expired member Lease and takes
/// its tenants.
async fn sharding(installation: &Installation) -> ScenarioRun {
    let values = format!("{LEAST_PRIVILEGE_HOST_VALUES}sharding: {{enabled: true}}\n");
    let (yaml, objects) = render("stackd-controllers", &values).await;
    apply(&installation.host, &yaml).await;
    let args = deployment_args(find(&objects, "Deployment", "stackd"));
    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let timing = ["--shard-lease-duration", "3"];
    let mut first = installation.daemon_with(&args, &timing);
    wait_for_log(&first, "wrote the shard map").await;
    let mut second = installation.daemon_with(&args, &timing);
    wait_for_log(&second, "registered this replica's member lease").await;
    first.kill();
    wait_for_log(&second, "deleted the expired member lease of a replica").await;
    wait_for_log(&second, "serving tenants the shard map gives this replica").await;
    stop(&mut second).await;
    ScenarioRun {
        covers: &[Sharding],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    }
}

async fn wait_for_log(daemon: &Daemon, needle: &str) {
    until(
        &format!("{needle:?} logged"),
        Duration::from_secs(15),
        daemon,
        || async { daemon.log_text().contains(needle) },
    )
    .await;
}

/// SIGTERM, and a clean exit.
async fn stop(daemon: &mut Daemon) {
    daemon.terminate();
    let status = daemon.wait_exit(Duration::from_secs(15)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "daemon exits cleanly:\n{}",
        daemon.log_text()
    );
}

/// Checks one server's requests across all runs against the RBAC its chart grants: every request
/// allowed; every permission explained by `table`; every permission of a scenario that ran, used.
fn check_least_privilege(
    server: &str,
    runs: &[&Observed],
    covered: &BTreeSet<Scenario>,
    subject: &Subject,
    table: &[Use],
) {
    let rbac = &runs.last().expect("a run").rbac;
    let authorizer = Authorizer::for_subject(rbac, subject);
    let roles = rbac::bound_roles(rbac, subject);
    let granted = rbac::permissions(rbac, &roles);
    let explained = expand(table);

    let unexplained: Vec<String> = granted
        .iter()
        .filter(|p| !explained.contains_key(p))
        .map(|p| p.to_string())
        .collect();
    assert!(
        unexplained.is_empty(),
        "{server}: granted but in no scenario of the table:\n  {}",
        unexplained.join("\n  ")
    );
    let stale: Vec<String> = explained
        .keys()
        .filter(|p| !granted.contains(p))
        .map(|p| p.to_string())
        .collect();
    assert!(
        stale.is_empty(),
        "{server}: in the table but not granted (roles bound: {roles:?}):\n  {}",
        stale.join("\n  ")
    );

    let mut denied = BTreeSet::new();
    let mut used = BTreeSet::new();
    for request in runs.iter().flat_map(|o| &o.requests) {
        let through = authorizer.used_by(request);
        if through.is_empty() {
            denied.insert(request.to_string());
        }
        used.extend(through);
    }
    assert!(
        denied.is_empty(),
        "{server}: the daemon made requests its RBAC does not allow:\n  {}",
        denied.into_iter().collect::<Vec<_>>().join("\n  ")
    );
    let unused: Vec<String> = explained
        .iter()
        .filter(|(p, scenario)| covered.contains(scenario) && !used.contains(*p))
        .map(|(p, scenario)| format!("{p} ({scenario:?})"))
        .collect();
    assert!(
        unused.is_empty(),
        "{server}: granted for a scenario that ran, never used:\n  {}",
        unused.join("\n  ")
    );
}

/// A StackInstall of the sample package in tenant `acme` becomes Ready (install Job and its log,
/// CRDs, Stack, the stack's tenant RBAC and token, host Deployment), then is uninstalled. `globex`
/// shares acme's API server here, so its file goes first: two tenants must not serve one server's
/// installs. The install is created and deleted between windows, so only the daemon's requests
/// are counted.
async fn stack_install_and_uninstall(installation: &Installation) -> Vec<ScenarioRun> {
    // The chart passes its own image as --stackd-image: the host "runs" install Jobs with it.
    let image = installation
        .daemon_args
        .iter()
        .find_map(|a| a.strip_prefix("--stackd-image="))
        .expect("the chart sets --stackd-image")
        .to_string();
    stackd::embedded::samples::register_sample_runners(
        &installation.host.runners(),
        &stackd::embedded::samples::SampleImages::new(&image),
    );
    std::fs::remove_file(installation.dir.path().join("tenants/globex.yaml")).expect("remove globex");
    let tenant = installation.tenant.client().await;
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": "team-a"}})).expect("namespace");
    Api::<Namespace>::all(tenant.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("team-a");
    let install: stackd::api::stacks::StackInstall = serde_json::from_value(json!({
        "metadata": {"name": "sample", "namespace": "team-a"},
        "spec": {"package": "stackd-examples/sample-stack:v0.1.0"},
    }))
    .expect("install");
    let installs: Api<stackd::api::stacks::StackInstall> = Api::namespaced(tenant.clone(), "team-a");
    installs
        .create(&PostParams::default(), &install)
        .await
        .expect("install");
    let cluster_install: stackd::api::stacks::ClusterStackInstall = serde_json::from_value(json!({
        "metadata": {"name": "gadgets", "namespace": "team-a"},
        "spec": {"package": "stackd-examples/cluster-stack:v0.1.0"},
    }))
    .expect("cluster install");
    let cluster_installs: Api<stackd::api::stacks::ClusterStackInstall> = Api::namespaced(tenant.clone(), "team-a");
    cluster_installs
        .create(&PostParams::default(), &cluster_install)
        .await
        .expect("cluster install");
    let installed = GroupResource::new("stacks.stackd.dev", "stackinstalls");
    let cluster_installed = GroupResource::new("stacks.stackd.dev", "clusterstackinstalls");
    let ready = |server: &ApiServer| {
        [(&installed, "sample"), (&cluster_installed, "gadgets")]
            .iter()
            .all(|(kind, name)| {
                server.store().get(kind, "team-a", name).is_some_and(|install| {
                    install["status"]["conditions"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
                })
            })
    };

    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let mut daemon = installation.daemon(&[]);
    until("the install Ready", Duration::from_secs(30), &daemon, || async {
        ready(&installation.tenant)
    })
    .await;
    let install_run = ScenarioRun {
        covers: &[StackInstall],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    };
    // While the daemon is down, someone edits the stack's host Deployment and token Secret; the
    // next daemon puts both back.
    stop(&mut daemon).await;
    let host = installation.host.client().await;
    let host_namespace = "tenant-acme-controllers";
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(host.clone(), host_namespace);
    deployments
        .patch(
            "team-a.sample",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 7}})),
        )
        .await
        .expect("edit the Deployment");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(host, host_namespace);
    secrets
        .patch(
            "team-a.sample-token",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"token": "forged"}})),
        )
        .await
        .expect("edit the token Secret");
    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let mut daemon = installation.daemon(&[]);
    let deployed = GroupResource::new("apps", "deployments");
    let tokens = GroupResource::new("", "secrets");
    until("the host drift repaired", Duration::from_secs(30), &daemon, || async {
        let replicas = installation
            .host
            .store()
            .get(&deployed, host_namespace, "team-a.sample")
            .map(|d| d["spec"]["replicas"].clone());
        let token = installation
            .host
            .store()
            .get(&tokens, host_namespace, "team-a.sample-token")
            .map(|s| s["data"]["token"].clone());
        let forged = json!(base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            "forged"
        ));
        replicas.is_some_and(|r| r != json!(7)) && token.is_some_and(|t| t != forged)
    })
    .await;
    let drift_run = ScenarioRun {
        covers: &[HostDriftRepair, StackInstall],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    };

    // The uninstall is asked for while the daemon is down: the window counts every client's
    // requests, and a running daemon could answer the deletes before the window opened.
    stop(&mut daemon).await;
    installs.delete("sample", &Default::default()).await.expect("uninstall");
    cluster_installs
        .delete("gadgets", &Default::default())
        .await
        .expect("uninstall");
    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let mut daemon = installation.daemon(&[]);
    until("the uninstall finished", Duration::from_secs(30), &daemon, || async {
        let tenant = installation.tenant.store();
        tenant.get(&installed, "team-a", "sample").is_none()
            && tenant.get(&cluster_installed, "team-a", "gadgets").is_none()
    })
    .await;
    stop(&mut daemon).await;
    let uninstall_run = ScenarioRun {
        covers: &[StackInstall],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    };
    vec![install_run, drift_run, uninstall_run]
}

/// The sample pool (size 2, three ClusterDeploymentCustomizations) fills in tenant `acme`:
/// leases, cluster namespaces, ClusterDeployments, installer Jobs with their output
/// ServiceAccount, Role and RoleBinding, and the admin kubeconfigs copied back. Runs after the
/// stack scenario, which registered the sample runners (the installer among them).
async fn pool_fill(installation: &Installation) -> ScenarioRun {
    let tenant = installation.tenant.client().await;
    stackd::pools::sample::install(&tenant).await.expect("sample pool");
    let pools = GroupResource::new("pools.stackd.dev", "clusterpools");
    let filled = |server: &ApiServer| {
        server
            .store()
            .get(&pools, stackd::pools::sample::NAMESPACE, stackd::pools::sample::POOL)
            .is_some_and(|pool| pool["status"]["ready"] == json!(2))
    };
    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let mut daemon = installation.daemon(&[]);
    until("the pool filled", Duration::from_secs(45), &daemon, || async {
        filled(&installation.tenant)
    })
    .await;
    stop(&mut daemon).await;
    ScenarioRun {
        covers: &[PoolFill],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    }
}

/// `acme` moves from the tenants directory to a Tenant object, its kubeconfig in a Secret of the
/// release namespace (created by an administrator before the window opens): the daemon watches
/// that namespace's Secrets by metadata, reads the one named, serves acme, writes its status and
/// puts Events on it.
async fn tenant_objects(installation: &Installation) -> ScenarioRun {
    let file = installation.dir.path().join("tenants/acme.yaml");
    let kubeconfig = std::fs::read_to_string(&file).expect("acme's kubeconfig");
    std::fs::remove_file(&file).expect("remove acme's file");
    let host = installation.host.client().await;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "acme-kubeconfig", "namespace": RELEASE_NAMESPACE},
        "stringData": {"value": kubeconfig},
    }))
    .expect("Secret");
    Api::<Secret>::namespaced(host.clone(), RELEASE_NAMESPACE)
        .create(&PostParams::default(), &secret)
        .await
        .expect("the kubeconfig Secret");
    let tenant: stackd::api::tenancy::Tenant = serde_json::from_value(json!({
        "metadata": {"name": "acme"},
        "spec": {"kubeconfigSecretRef": {"namespace": RELEASE_NAMESPACE, "name": "acme-kubeconfig", "key": "value"}},
    }))
    .expect("Tenant");
    Api::<stackd::api::tenancy::Tenant>::all(host)
        .create(&PostParams::default(), &tenant)
        .await
        .expect("the Tenant");
    let (host_window, tenant_window) = (Window::open(&installation.host), Window::open(&installation.tenant));
    let mut daemon = installation.daemon(&[]);
    let tenants = GroupResource::new(TENANCY, "tenants");
    until(
        "the Tenant Ready with an Event",
        Duration::from_secs(30),
        &daemon,
        || async {
            let ready = installation
                .host
                .store()
                .get(&tenants, "", "acme")
                .is_some_and(|tenant| {
                    tenant["status"]["conditions"]
                        .as_array()
                        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"))
                });
            let events = installation.host.counters().since(&host_window.counts).get(
                stackd::embedded::Verb::Create,
                "events",
                Some("default"),
            );
            ready && events > 0
        },
    )
    .await;
    stop(&mut daemon).await;
    ScenarioRun {
        covers: &[TenantObjects],
        host: host_window.close(&installation.host, &installation.host_subject),
        tenant: tenant_window.close(&installation.tenant, &installation.tenant_subject),
    }
}

/// Each scenario function plants what it needs, runs the daemon with the chart's arguments
/// against `installation`, waits (reading the stores, never through the API) until the daemon has
/// done its part, stops it and returns what each server saw. A stack install and a pool fill join
/// the list as one function each, covering `StackInstall` and `PoolFill`; from then on every
/// permission the tables name for them must be used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_daemon_request_is_allowed_by_the_charts_and_every_permission_is_used() {
    let installation = Installation::new().await;
    let mut runs = vec![daemon_startup_repair_sweep_and_leader_election(&installation).await];
    runs.push(sharding(&installation).await);
    runs.extend(stack_install_and_uninstall(&installation).await);
    runs.push(pool_fill(&installation).await);
    runs.push(tenant_objects(&installation).await);
    let covered: BTreeSet<Scenario> = runs.iter().flat_map(|r| r.covers.iter().copied()).collect();
    let host: Vec<&Observed> = runs.iter().map(|r| &r.host).collect();
    let tenant: Vec<&Observed> = runs.iter().map(|r| &r.tenant).collect();
    check_least_privilege("host", &host, &covered, &installation.host_subject, HOST_USES);
    check_least_privilege("tenant", &tenant, &covered, &installation.tenant_subject, TENANT_USES);
    installation.host.shutdown().await;
    installation.tenant.shutdown().await;
}

#[tokio::test]
async fn the_host_chart_alone_lets_the_daemon_bind_its_namespace_role_and_nothing_more() {
    let (_, objects) = render("stackd-controllers", "").await;
    let daemon = Subject::service_account(RELEASE_NAMESPACE, "stackd");
    let chart_only = Authorizer::for_subject(&objects, &daemon);
    let ns = "tenant-new-controllers";
    // What the host namespace controller needs before its RoleBinding exists.
    for request in [
        Request::new("get", "", "namespaces", ""),
        Request::new("list", "", "namespaces", ""),
        Request::new("watch", "", "namespaces", ""),
        // One watch per replica of every tenant namespace's binding.
        Request::new("list", RBAC, "rolebindings", ""),
        Request::new("watch", RBAC, "rolebindings", ""),
        Request::new("create", "", "namespaces", ""),
        Request::new("patch", "", "namespaces", ""),
        Request::new("list", RBAC, "rolebindings", ns),
        Request::new("watch", RBAC, "rolebindings", ns),
        Request::new("create", RBAC, "rolebindings", ns),
        Request::new("update", RBAC, "rolebindings", ns),
        Request::new("bind", RBAC, "clusterroles", ns).named("stackd-tenant-namespace"),
    ] {
        assert!(chart_only.allows(&request), "{request} denied");
    }
    for request in [
        Request::new("bind", RBAC, "clusterroles", ns).named("cluster-admin"),
        Request::new("delete", "", "namespaces", ""),
        Request::new("delete", RBAC, "rolebindings", "kube-system"),
        Request::new("list", "", "secrets", ""),
        Request::new("create", "batch", "jobs", ns),
        Request::new("escalate", RBAC, "clusterroles", ""),
    ] {
        assert!(!chart_only.allows(&request), "{request} allowed");
    }
}

// ---------------------------------------------------------------------------------------------
// kubeconfigs/examples

#[test]
fn the_kubeconfig_examples_are_tenant_files_naming_the_documented_endpoints() {
    use stackd::context::endpoint::EndpointSource;
    use stackd::context::namespace_template::NamespaceTemplate;
    use stackd::tenancy::directory::scan;

    let examples = repository().join("kubeconfigs/examples");
    let dir = tempfile::tempdir().expect("temp dir");
    for (example, tenant) in [
        ("token.yaml", "acme"),
        ("client-certificate.yaml", "globex"),
        ("direct.yaml", "initech"),
    ] {
        std::fs::copy(examples.join(example), dir.path().join(format!("{tenant}.yaml"))).expect("copied");
    }
    let secret: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(examples.join("tenants-secret.yaml")).expect("read"))
            .expect("Secret YAML");
    let in_secret = secret["stringData"]["acme.yaml"].as_str().expect("acme.yaml key");
    std::fs::write(dir.path().join("umbrella.yaml"), in_secret).expect("written");

    let tenants = scan(dir.path(), &NamespaceTemplate::default()).expect("scan");
    let endpoint = |tenant: &str| {
        let file = tenants[tenant].as_ref().unwrap_or_else(|e| panic!("{tenant}: {e}"));
        let endpoint = file.endpoint.as_ref().unwrap_or_else(|e| panic!("{tenant}: {e}"));
        (endpoint.host.clone(), endpoint.port, endpoint.https, endpoint.source)
    };
    assert_eq!(
        endpoint("acme"),
        (
            "acme-apiserver.tenant-acme.svc".into(),
            443,
            true,
            EndpointSource::InClusterExtension
        )
    );
    assert_eq!(
        endpoint("globex"),
        (
            "globex-apiserver.tenant-globex.svc".into(),
            443,
            true,
            EndpointSource::InClusterExtension
        )
    );
    assert_eq!(
        endpoint("initech"),
        ("initech-api.example.com".into(), 443, true, EndpointSource::ServerUrl)
    );
    assert_eq!(
        endpoint("umbrella"),
        ("acme.example.com".into(), 6443, true, EndpointSource::ServerUrl)
    );
}
