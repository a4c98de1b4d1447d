//! Tenants registered as Tenant objects on the host (issue 31): applied with kubectl, served,
//! their state in `kubectl get tenants` and `kubectl wait`, Down with the root cause when their
//! server stops, suspended when deleted, a changed Secret taking effect at once, and a name in
//! both sources refused.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, DeleteParams, ListParams};
use stackd::api::tenancy::Tenant;
use stackd::embedded::Verb;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::harness::{self, Daemon, Fleet, dead_address, install_crds, until, wait_until};

const SOON: Duration = Duration::from_secs(20);
/// The namespace the daemon reads Tenant Secrets in by default (`--tenant-secret-namespaces`).
pub(crate) const SECRETS_NAMESPACE: &str = "stackd-system";

/// kubectl against the fleet's host, as a host administrator.
pub(crate) struct HostKubectl {
    kubeconfig: PathBuf,
    cache: PathBuf,
    binary: PathBuf,
}

impl HostKubectl {
    pub(crate) fn new(fleet: &Fleet) -> HostKubectl {
        HostKubectl {
            kubeconfig: fleet.dir.path().join("host.yaml"),
            cache: fleet.dir.path().join("kubectl-cache"),
            binary: harness::kubectl(),
        }
    }

    pub(crate) async fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new(&self.binary)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("kubectl runs");
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes()).await.expect("stdin written");
        }
        child.wait_with_output().await.expect("kubectl finishes")
    }

    /// Runs kubectl, requires success and returns its stdout.
    pub(crate) async fn ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let output = self.run(args, stdin).await;
        assert!(
            output.status.success(),
            "kubectl {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// `kubectl apply` of a YAML stream.
    pub(crate) async fn apply(&self, yaml: &str) -> String {
        self.ok(&["apply", "-f", "-"], Some(yaml)).await
    }
}

/// The Tenant CRD on the host, applied with kubectl from `crds/host/` as an administrator would.
pub(crate) async fn install_tenant_crd(kubectl: &HostKubectl) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/host/tenancy.stackd.dev_tenants.yaml");
    let crd = std::fs::read_to_string(path).expect("the Tenant CRD file");
    kubectl.apply(&crd).await;
}

/// A namespace, a Secret holding `kubeconfig` under `key`, and a Tenant naming it, as YAML.
pub(crate) fn registration(tenant: &str, namespace: &str, secret: &str, key: &str, kubeconfig: &str) -> String {
    let indented: String = kubeconfig.lines().map(|line| format!("    {line}\n")).collect();
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: {secret}\n  namespace: {namespace}\nstringData:\n  {key}: |\n{indented}---\napiVersion: tenancy.stackd.dev/v1alpha1\nkind: Tenant\nmetadata:\n  name: {tenant}\nspec:\n  kubeconfigSecretRef:\n    namespace: {namespace}\n    name: {secret}\n    key: {key}\n"
    )
}

/// The Secret alone, as YAML (to change it).
fn secret_yaml(namespace: &str, secret: &str, key: &str, kubeconfig: &str) -> String {
    let indented: String = kubeconfig.lines().map(|line| format!("    {line}\n")).collect();
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {secret}\n  namespace: {namespace}\nstringData:\n  {key}: |\n{indented}"
    )
}

pub(crate) fn tenants(fleet: &Fleet) -> Api<Tenant> {
    Api::all(fleet.host_client.clone())
}

/// A condition of a Tenant as (status, reason, message).
pub(crate) async fn condition(fleet: &Fleet, tenant: &str, type_: &str) -> Option<(String, String, String)> {
    let tenant = tenants(fleet).get_opt(tenant).await.expect("get Tenant")?;
    let status = tenant.status?;
    let condition = status.conditions.into_iter().find(|c| c.type_ == type_)?;
    Some((condition.status, condition.reason, condition.message))
}

/// Waits until a Tenant's condition has this status and reason; its message.
pub(crate) async fn wait_condition(
    fleet: &Fleet,
    daemon: &Daemon,
    tenant: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> String {
    let what = format!("Tenant {tenant} {type_}={status} {reason}");
    wait_until(&what, SOON, daemon, || async {
        condition(fleet, tenant, type_)
            .await
            .filter(|(s, r, _)| s == status && r == reason)
            .map(|(_, _, message)| message)
    })
    .await
}

/// The reasons of the Events on a Tenant, oldest first.
pub(crate) async fn event_reasons(fleet: &Fleet, tenant: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(fleet.host_client.clone(), "default");
    let mut found: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .expect("list Events")
        .items
        .into_iter()
        .filter(|e| {
            e.regarding
                .as_ref()
                .is_some_and(|r| r.kind.as_deref() == Some("Tenant") && r.name.as_deref() == Some(tenant))
        })
        .collect();
    found.sort_by_key(|e| e.metadata.resource_version.as_ref().and_then(|v| v.parse::<u64>().ok()));
    found.into_iter().filter_map(|e| e.reason).collect()
}

/// A fleet with one tenant server `acme` (stackd's CRDs installed) registered by a Tenant whose
/// Secret is in the default secret namespace, and a daemon serving it, Ready.
async fn served_acme() -> (Fleet, HostKubectl, Daemon) {
    let mut fleet = Fleet::start(&[]).await;
    let kubeconfig = fleet.add_tenant_server("acme").await;
    install_crds(&fleet.tenant_server("acme").client().await).await;
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "vc-acme",
            "config",
            &kubeconfig,
        ))
        .await;
    let daemon = fleet.daemon(&[]);
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
    (fleet, kubectl, daemon)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_applied_with_kubectl_is_served_and_kubectl_shows_it_ready() {
    let (fleet, kubectl, daemon) = served_acme().await;
    fleet.wait_for_namespace("acme", SOON).await;
    let waited = kubectl
        .ok(&["wait", "--for=condition=Ready", "tenant/acme", "--timeout=20s"], None)
        .await;
    assert!(
        waited.contains("tenant.tenancy.stackd.dev/acme condition met"),
        "{waited}"
    );

    let table = kubectl.ok(&["get", "tenants"], None).await;
    let lines: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        lines[0],
        ["NAME", "READY", "REASON", "REPLICA", "NAMESPACE", "VERSION", "AGE"],
        "{table}"
    );
    let row = &lines[1];
    assert_eq!(row[..3], ["acme", "True", "Up"], "{table}");
    assert!(row[3].starts_with("stackd-"), "the replica's identity: {table}");
    assert_eq!(row[4], "tenant-acme-controllers", "{table}");
    assert!(row[5].starts_with('v'), "the tenant API server's version: {table}");

    let tenant = tenants(&fleet).get("acme").await.expect("Tenant");
    let status = tenant.status.clone().expect("status");
    assert_eq!(status.observed_generation, tenant.metadata.generation);
    let served = condition(&fleet, "acme", "Served").await.expect("Served");
    assert_eq!((served.0.as_str(), served.1.as_str()), ("True", "Served"));
    assert!(
        served.2.contains(status.served_by.as_deref().unwrap_or("?")),
        "{served:?}"
    );
    until("the counts of the tenant's objects", SOON, &daemon, || async {
        let status = tenants(&fleet).get("acme").await.ok().and_then(|t| t.status);
        status.is_some_and(|s| s.installs.is_some() && s.stacks.is_some() && s.pools.is_some())
    })
    .await;
    let reasons = event_reasons(&fleet, "acme").await;
    assert!(
        reasons.contains(&"Up".to_string()) && reasons.contains(&"Served".to_string()),
        "{reasons:?}"
    );

    // `stackd status` reads the Tenants too.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["status", "--host-kubeconfig"])
        .arg(fleet.dir.path().join("host.yaml"))
        .output()
        .await
        .expect("stackd status");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let acme: Vec<&str> = printed
        .lines()
        .find(|l| l.starts_with("acme"))
        .expect("a line for acme")
        .split_whitespace()
        .collect();
    assert_eq!(acme[..3], ["acme", "True", "Up"], "{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_tenant_gets_no_status_write_and_no_event() {
    let (fleet, kubectl, daemon) = served_acme().await;
    until("the counts in the status", SOON, &daemon, || async {
        tenants(&fleet)
            .get("acme")
            .await
            .ok()
            .and_then(|t| t.status)
            .is_some_and(|s| s.installs.is_some())
    })
    .await;
    let status_writes = || tenant_patches(&fleet, "tenants.tenancy.stackd.dev/status");
    let (writes, events) = (status_writes(), event_reasons(&fleet, "acme").await.len());
    let passes = daemon.reconciles_done("acme", "tenant-object");
    // A change of the Tenant that its status does not depend on: the writer looks again.
    kubectl.ok(&["label", "tenant/acme", "team=platform"], None).await;
    until("a pass over the relabelled Tenant", SOON, &daemon, || async {
        daemon.reconciles_done("acme", "tenant-object") > passes
    })
    .await;
    assert_eq!(status_writes(), writes, "nothing changed: no status write");
    assert_eq!(
        event_reasons(&fleet, "acme").await.len(),
        events,
        "no transition: no Event"
    );
}

/// Patches the host has answered on `resource` (Tenants, or their status subresource).
fn tenant_patches(fleet: &Fleet, resource: &str) -> u64 {
    fleet.host().counters().get(Verb::Patch, resource, None)
}

/// Another manager's status write (`kubectl edit --subresource status`) is an `Update` entry the
/// general status writer would take over with a patch of the object itself; the chart grants the
/// daemon only `tenants/status`, so the Tenant writer applies its status alone and never patches
/// the Tenant (on a real cluster that patch is a 403, retried forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_another_manager_edited_is_rewritten_through_the_status_subresource_alone() {
    let (fleet, _kubectl, daemon) = served_acme().await;
    let served_by = tenants(&fleet)
        .get("acme")
        .await
        .expect("Tenant")
        .status
        .and_then(|s| s.served_by)
        .expect("servedBy");
    let object_patches = || tenant_patches(&fleet, "tenants.tenancy.stackd.dev");
    let before = object_patches();
    let edit = serde_json::json!({"status": {"servedBy": "someone-else"}});
    let params = kube::api::PatchParams {
        field_manager: Some("kubectl-edit".into()),
        ..Default::default()
    };
    tenants(&fleet)
        .patch_status("acme", &params, &kube::api::Patch::Merge(&edit))
        .await
        .expect("edit the status");
    until("stackd's status back", SOON, &daemon, || async {
        let status = tenants(&fleet).get("acme").await.ok().and_then(|t| t.status);
        status.and_then(|s| s.served_by).as_deref() == Some(served_by.as_str())
    })
    .await;
    assert_eq!(object_patches(), before, "the Tenant itself was patched");
}

/// Tenant users drive the object counts in the Tenant's status; the host pays for each write. A
/// change that is no transition is written at most once per 10 s, however fast they create objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_counts_a_tenant_user_drives_are_written_at_most_once_per_ten_seconds() {
    const DETAIL_INTERVAL: Duration = Duration::from_secs(10);
    let (fleet, _kubectl, daemon) = served_acme().await;
    let acme = fleet.tenant_server("acme").client().await;
    until("the counts in the status", SOON, &daemon, || async {
        let status = tenants(&fleet).get("acme").await.ok().and_then(|t| t.status);
        status.is_some_and(|s| s.installs.is_some())
    })
    .await;
    let status_writes = || tenant_patches(&fleet, "tenants.tenancy.stackd.dev/status");
    let (before, started) = (status_writes(), std::time::Instant::now());
    let changes = 4;
    for i in 0..changes {
        let spec = serde_json::json!({"package": format!("registry.example.org/widgets:{i}")});
        crate::stacks_install::create_install(&acme, "team-a", &format!("widgets-{i}"), spec).await;
        // The daemon counted it: the status writer was told of a change.
        let needle = format!(
            "stackd_tenant_objects{{tenant=\"acme\",kind=\"StackInstall\",ready=\"false\"}} {}",
            i + 1
        );
        daemon.wait_for("/metrics", &needle, SOON).await;
    }
    until(
        "the last count in the status",
        SOON + DETAIL_INTERVAL,
        &daemon,
        || async {
            let status = tenants(&fleet).get("acme").await.ok().and_then(|t| t.status);
            status.and_then(|s| s.installs).is_some_and(|c| c.not_ready == changes)
        },
    )
    .await;
    let periods = started.elapsed().as_secs_f64() / DETAIL_INTERVAL.as_secs_f64();
    let allowed = 1 + periods.ceil() as u64;
    let writes = status_writes() - before;
    assert!(
        writes <= allowed,
        "{writes} status writes for {changes} count changes in {:?} (at most {allowed})",
        started.elapsed()
    );
}

/// The host holding one Tenant's Secret read open holds up another Tenant's registration for the
/// read's time limit (10 s) at most, not until the host answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_read_the_host_never_answers_holds_up_no_other_tenant() {
    let mut fleet = Fleet::start(&[]).await;
    let stuck = fleet.add_tenant_server("aaa").await;
    let kubeconfig = fleet.add_tenant_server("bbb").await;
    install_crds(&fleet.tenant_server("bbb").client().await).await;
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    let never = stackd::embedded::faults::RequestMatch::any()
        .verb(Verb::Get)
        .resource("secrets")
        .namespace("slow");
    kubectl
        .apply(&registration("aaa", "slow", "vc-aaa", "config", &stuck))
        .await;
    fleet.host().faults().add_latency(never, Duration::from_secs(120));
    let daemon = fleet.daemon(&["--tenant-secret-namespaces", &format!("{SECRETS_NAMESPACE},slow")]);
    until("the daemon reading aaa's Secret", SOON, &daemon, || async {
        fleet.host().counters().get(Verb::Get, "secrets", Some("slow")) > 0
    })
    .await;
    kubectl
        .apply(&registration("bbb", SECRETS_NAMESPACE, "vc-bbb", "config", &kubeconfig))
        .await;
    wait_condition(&fleet, &daemon, "bbb", "Ready", "True", "Up").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_server_stops_is_down_with_the_root_cause() {
    let (mut fleet, kubectl, daemon) = served_acme().await;
    fleet.stop_tenant_server("acme").await;
    let message = wait_condition(&fleet, &daemon, "acme", "Ready", "False", "Down").await;
    assert!(message.contains("connection refused"), "{message}");
    let table = kubectl.ok(&["get", "tenants"], None).await;
    assert!(
        table
            .lines()
            .nth(1)
            .is_some_and(|row| row.contains("False") && row.contains("Down")),
        "{table}"
    );
    until("a Down Event", SOON, &daemon, || async {
        event_reasons(&fleet, "acme").await.contains(&"Down".to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_tenant_suspends_it_and_keeps_its_host_objects() {
    let (fleet, kubectl, daemon) = served_acme().await;
    fleet.wait_for_namespace("acme", SOON).await;
    kubectl.ok(&["delete", "tenant", "acme"], None).await;
    until("acme no longer served", SOON, &daemon, || async {
        !daemon
            .http_get("/readyz?verbose")
            .unwrap_or_default()
            .contains("tenant acme")
    })
    .await;
    assert!(
        daemon
            .log_text()
            .contains("Tenant object deleted; suspending the tenant")
    );
    assert!(
        fleet.namespace("acme").await.is_some(),
        "a deleted Tenant never deletes host objects"
    );
    // Suspended: nothing repairs its host objects any more.
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    bindings
        .delete("stackd-tenant-namespace", &DeleteParams::default())
        .await
        .expect("delete binding");
    // The tenant's task tree is gone (readiness forgets it only after): nothing puts it back.
    assert!(
        fleet.binding("acme").await.is_none(),
        "a suspended tenant is not reconciled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_secret_takes_effect_at_once_and_a_broken_one_keeps_the_old_kubeconfig_running() {
    let mut fleet = Fleet::start(&[]).await;
    let new = fleet.add_tenant_server("acme").await;
    install_crds(&fleet.tenant_server("acme").client().await).await;
    // First the Secret names an address nobody listens on.
    let dead = dead_address();
    let mut old: serde_json::Value = serde_saphyr::from_str(&new).expect("kubeconfig YAML");
    old["clusters"][0]["cluster"]["server"] = format!("http://{}", dead.address).into();
    let old = serde_saphyr::to_string(&old).expect("YAML");
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "acme-kubeconfig",
            "value",
            &old,
        ))
        .await;
    let daemon = fleet.daemon(&[]);
    let down = wait_condition(&fleet, &daemon, "acme", "Ready", "False", "Down").await;
    assert!(down.contains("connection refused"), "{down}");
    kubectl
        .apply(&secret_yaml(SECRETS_NAMESPACE, "acme-kubeconfig", "value", &new))
        .await;
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;

    let broken = new.replace("current-context:", "current-context: [oops");
    kubectl
        .apply(&secret_yaml(SECRETS_NAMESPACE, "acme-kubeconfig", "value", &broken))
        .await;
    let message = wait_condition(
        &fleet,
        &daemon,
        "acme",
        "Served",
        "True",
        "ServedWithPreviousKubeconfig",
    )
    .await;
    assert!(
        message.contains("Secret stackd-system/acme-kubeconfig key \"value\""),
        "{message}"
    );
    assert!(message.contains("line"), "where in the text: {message}");
    assert!(!message.contains("token"), "never the text: {message}");
    assert_eq!(
        condition(&fleet, "acme", "Ready").await.map(|c| c.1),
        Some("Up".to_string())
    );
    // Still served on the previous kubeconfig: its host objects are repaired.
    fleet.wait_for_namespace("acme", SOON).await;
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    bindings
        .delete("stackd-tenant-namespace", &DeleteParams::default())
        .await
        .expect("delete binding");
    fleet.wait_for_namespace("acme", SOON).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_in_both_sources_is_refused_naming_both_until_one_goes() {
    let fleet = Fleet::start(&["acme"]).await;
    install_crds(&fleet.tenant_server("acme").client().await).await;
    let kubeconfig = std::fs::read_to_string(fleet.tenant_file("acme")).expect("acme's file");
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "vc-acme",
            "config",
            &kubeconfig,
        ))
        .await;
    let daemon = fleet.daemon(&[]);
    let message = wait_condition(&fleet, &daemon, "acme", "Served", "False", "NameConflict").await;
    let file = fleet.tenant_file("acme").display().to_string();
    assert!(message.contains(&file), "names the file: {message}");
    let ready = daemon.wait_for("/readyz?verbose", "[-]tenant acme invalid", SOON).await;
    assert!(ready.contains("defined twice") && ready.contains(&file), "{ready}");
    assert!(daemon.log_text().contains("defined by a file and by a Tenant object"));
    assert!(fleet.namespace("acme").await.is_none(), "neither is started");
    // The file goes: the Tenant is served.
    std::fs::remove_file(fleet.tenant_file("acme")).expect("remove the file");
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
    fleet.wait_for_namespace("acme", SOON).await;
}

/// A tenant the daemon suspends for outgrowing `--tenant-memory-budget` says so on its Tenant
/// (`Ready=False OverMemoryBudget`, with an Event), and is Up there again once it has cleaned up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_memory_budget_is_not_ready_on_its_tenant_until_it_cleaned_up() {
    let mut fleet = Fleet::start(&[]).await;
    let kubeconfig = fleet.add_tenant_server("acme").await;
    let acme = fleet.tenant_server("acme").client().await;
    crate::pools::prepare(&acme).await;
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "vc-acme",
            "config",
            &kubeconfig,
        ))
        .await;
    let daemon = fleet.daemon(&["--tenant-memory-budget", "2Mi", "--sweep-interval", "1h"]);
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
    // Many mid-sized objects no namespace owns, each under the size cap.
    let unowned = crate::security_namespaces::flood_unowned(&acme, 12).await;
    let message = wait_condition(&fleet, &daemon, "acme", "Ready", "False", "OverMemoryBudget").await;
    assert!(message.contains("--tenant-memory-budget"), "{message}");
    assert_eq!(
        condition(&fleet, "acme", "Served").await.map(|c| c.1),
        Some("Served".to_string()),
        "still this replica's to serve"
    );
    until("an OverMemoryBudget Event", SOON, &daemon, || async {
        event_reasons(&fleet, "acme")
            .await
            .contains(&"OverMemoryBudget".to_string())
    })
    .await;
    crate::security_namespaces::remove_unowned(&acme, &unowned).await;
    wait_condition(&fleet, &daemon, "acme", "Ready", "True", "Up").await;
}
