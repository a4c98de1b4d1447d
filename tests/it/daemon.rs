//! The daemon binary against embedded host and tenant API servers (DESIGN.md §1, issue 6).

use std::time::{Duration, Instant};

use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;
use stackd::embedded::Verb;
use stackd::embedded::faults::RequestMatch;

use crate::harness::{Fleet, dead_address, holds_for, install_crds, settled, until};

const SOON: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_namespaces_appear_with_their_labels_and_role_binding() {
    let fleet = Fleet::start(&["acme", "globex", "initech"]).await;
    let daemon = fleet.daemon(&["--service-account", "stackd-system/stackd"]);
    for tenant in ["acme", "globex", "initech"] {
        let ns = fleet.wait_for_namespace(tenant, SOON).await;
        let labels = ns.metadata.labels.unwrap_or_default();
        assert_eq!(labels.get("stackd.dev/tenant").map(String::as_str), Some(tenant));
        assert_eq!(
            labels.get("app.kubernetes.io/managed-by").map(String::as_str),
            Some("stackd")
        );
        assert_eq!(
            labels.get("pod-security.kubernetes.io/enforce").map(String::as_str),
            Some("restricted")
        );
        let binding = fleet.binding(tenant).await.expect("binding");
        assert_eq!(binding.role_ref.kind, "ClusterRole");
        assert_eq!(binding.role_ref.name, "stackd-tenant-namespace");
        let subject = &binding.subjects.unwrap_or_default()[0];
        assert_eq!(
            (subject.kind.as_str(), subject.name.as_str()),
            ("ServiceAccount", "stackd")
        );
        assert_eq!(subject.namespace.as_deref(), Some("stackd-system"));
    }
    let ready = daemon.wait_for("/readyz?verbose", "[+]tenant initech", SOON).await;
    assert!(
        ready.starts_with("HTTP/1.0 200") || ready.starts_with("HTTP/1.1 200"),
        "{ready}"
    );
    // The tenants have stackd's CRDs? Not installed here, so each is degraded and says how to fix it.
    assert!(ready.contains("stackd crds | kubectl apply -f -"), "{ready}");
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", SOON)
        .await;
}

/// A tenant is shown up only once every controller of its start has filled its caches, not as
/// soon as its CRDs are served: whoever reads `ok` (an operator, a test about to stop the server)
/// may count on its watches being open and its host namespace written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_shown_up_only_once_every_controller_has_started() {
    let fleet = Fleet::start(&["acme"]).await;
    let acme = fleet.tenant_server("acme");
    install_crds(&acme.client().await).await;
    // The claim controller's cache cannot fill while ClusterClaims cannot be listed.
    let claims = RequestMatch::any().verb(Verb::List).resource("clusterclaims");
    acme.faults().fail_next(usize::MAX, claims, 500);
    let daemon = fleet.daemon(&[]);
    // The tenant answers and serves stackd's CRDs ...
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"acme\"} 1", SOON)
        .await;
    // ... but is not up while one controller has not started.
    holds_for("acme shown starting", Duration::from_secs(2), &daemon, || async {
        let ready = daemon.http_get("/readyz?verbose").unwrap_or_default();
        ready.contains("[-]tenant acme starting")
    })
    .await;
    acme.faults().clear();
    daemon.wait_for("/readyz?verbose", "[+]tenant acme ok", SOON).await;
    // At `ok` the start is complete: the host namespace records the tenant's cluster.
    let namespace = fleet.namespace("acme").await.expect("host namespace");
    let annotations = namespace.metadata.annotations.unwrap_or_default();
    assert!(
        annotations.contains_key("stackd.dev/tenant-cluster-uid"),
        "{annotations:?}"
    );
}

/// The host namespaces and their RoleBindings are watched once for all tenants (issue 32): a
/// namespace whose labels a host administrator strips (out of that watch's selection) and a
/// binding whose subject is edited are put back, each for its own tenant, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_watch_for_all_tenants_puts_back_a_stripped_namespace_and_an_edited_binding() {
    let fleet = Fleet::start(&["acme", "globex"]).await;
    let daemon = fleet.daemon(&["--service-account", "stackd-system/stackd", "--sweep-interval", "1h"]);
    for tenant in ["acme", "globex"] {
        fleet.wait_for_namespace(tenant, SOON).await;
        assert!(fleet.binding(tenant).await.is_some());
    }
    let strip = json!({"metadata": {"labels": {"stackd.dev/tenant": null, "app.kubernetes.io/managed-by": null}}});
    fleet
        .namespaces()
        .patch(
            "tenant-acme-controllers",
            &PatchParams::default(),
            &Patch::Merge(&strip),
        )
        .await
        .expect("strip the namespace's labels");
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-globex-controllers");
    let elsewhere = json!({"subjects": [{"kind": "ServiceAccount", "name": "intruder", "namespace": "default"}]});
    bindings
        .patch(
            "stackd-tenant-namespace",
            &PatchParams::default(),
            &Patch::Merge(&elsewhere),
        )
        .await
        .expect("edit the binding");
    until("acme's labels and globex's subject put back", SOON, &daemon, || async {
        let labels = fleet
            .namespace("acme")
            .await
            .and_then(|ns| ns.metadata.labels)
            .unwrap_or_default();
        let relabelled = labels.get("stackd.dev/tenant").map(String::as_str) == Some("acme")
            && labels.get("app.kubernetes.io/managed-by").map(String::as_str) == Some("stackd");
        let subject = fleet
            .binding("globex")
            .await
            .and_then(|b| b.subjects)
            .and_then(|s| s.into_iter().next())
            .map(|s| s.name);
        relabelled && subject.as_deref() == Some("stackd")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_file_added_at_runtime_starts_that_tenant() {
    let mut fleet = Fleet::start(&["acme"]).await;
    let _daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    fleet.add_tenant("latecomer").await;
    fleet.wait_for_namespace("latecomer", Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_tenant_file_suspends_the_tenant_and_keeps_its_namespace() {
    let fleet = Fleet::start(&["acme", "globex"]).await;
    let daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    fleet.wait_for_namespace("globex", SOON).await;
    daemon.wait_for("/readyz?verbose", "tenant globex", SOON).await;
    std::fs::remove_file(fleet.tenant_file("globex")).expect("remove");
    until("globex stopped", SOON, &daemon, || async {
        !daemon
            .http_get("/readyz?verbose")
            .unwrap_or_default()
            .contains("tenant globex")
    })
    .await;
    // Suspended: its namespace stays, and nothing repairs it any more.
    assert!(
        fleet.namespace("globex").await.is_some(),
        "a removed file never deletes host objects"
    );
    // Both bindings deleted: the daemon repairs acme's, and once it has and writes nothing more,
    // it has had its chance to repair globex's.
    let reconciled = daemon.reconciles(&[("acme", "host-namespace")]);
    for tenant in ["globex", "acme"] {
        let bindings: Api<RoleBinding> =
            Api::namespaced(fleet.host_client.clone(), &format!("tenant-{tenant}-controllers"));
        bindings
            .delete("stackd-tenant-namespace", &DeleteParams::default())
            .await
            .expect("delete binding");
    }
    settled(&daemon, &reconciled, &[fleet.host()]).await;
    assert!(
        fleet.binding("globex").await.is_none(),
        "a suspended tenant is not reconciled"
    );
    assert!(fleet.binding("acme").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_purge_removes_the_tenants_host_objects() {
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    drop(daemon);
    // The host API server runs in this process: the purge must not block its runtime.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_stackd"))
        .args(["tenant", "purge", "acme", "--host-kubeconfig"])
        .arg(fleet.dir.path().join("host.yaml"))
        .output()
        .await
        .expect("run purge");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("deleted RoleBinding/stackd-tenant-namespace"),
        "{stdout}"
    );
    assert!(stdout.contains("deleted namespace tenant-acme-controllers"), "{stdout}");
    let ns = fleet.namespace("acme").await;
    assert!(
        ns.is_none_or(|ns| ns.metadata.deletion_timestamp.is_some()),
        "the namespace is gone or going"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_tenant_is_reported_while_the_others_keep_being_reconciled() {
    let mut fleet = Fleet::start(&["acme", "globex", "initech"]).await;
    let daemon = fleet.daemon(&[]);
    for tenant in ["acme", "globex", "initech"] {
        fleet.wait_for_namespace(tenant, SOON).await;
    }
    fleet.stop_tenant_server("globex").await;
    daemon.wait_for("/readyz?verbose", "[-]tenant globex", SOON).await;
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"globex\"} 0", SOON)
        .await;
    // The others are untouched: delete acme's namespace and it comes back.
    fleet
        .namespaces()
        .delete("tenant-acme-controllers", &DeleteParams::default())
        .await
        .expect("delete");
    until("acme's namespace repaired", SOON, &daemon, || async {
        let ns = fleet.namespace("acme").await;
        let fresh = ns.as_ref().is_some_and(|ns| ns.metadata.deletion_timestamp.is_none());
        fresh && fleet.binding("acme").await.is_some()
    })
    .await;
    // initech comes up in its own time (beside a build, after acme's repair): it must, while globex
    // stays down.
    let ready = daemon.wait_for("/readyz?verbose", "[+]tenant initech", SOON).await;
    assert!(ready.contains("[-]tenant globex"), "{ready}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_failing_every_request_is_reported_and_recovers_when_the_faults_stop() {
    let fleet = Fleet::start(&["acme", "globex"]).await;
    let daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    fleet.wait_for_namespace("globex", SOON).await;
    let globex = fleet
        .tenants
        .iter()
        .find(|(n, _)| n == "globex")
        .and_then(|(_, s)| s.as_ref())
        .expect("server");
    globex.faults().fail_next(usize::MAX, RequestMatch::any(), 500);
    globex.faults().drop_watches();
    daemon.wait_for("/readyz?verbose", "[-]tenant globex", SOON).await;
    daemon
        .wait_for("/metrics", "stackd_tenant_up{tenant=\"globex\"} 0", SOON)
        .await;
    // acme is unaffected.
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    bindings
        .delete("stackd-tenant-namespace", &DeleteParams::default())
        .await
        .expect("delete binding");
    fleet.wait_for_namespace("acme", SOON).await;
    globex.faults().clear();
    daemon
        .wait_for("/readyz?verbose", "tenant globex degraded", Duration::from_secs(20))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_cannot_be_reached_at_start_is_retried_with_backoff() {
    let fleet = Fleet::start(&[]).await;
    // A kubeconfig pointing at a port nobody listens on.
    let dead = dead_address();
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {{cluster: k, user: u}}\nclusters:\n- name: k\n  cluster: {{server: \"http://{}\"}}\nusers:\n- name: u\n  user: {{token: t}}\n",
        dead.address
    );
    std::fs::write(fleet.tenant_file("ghost"), kubeconfig).expect("write");
    let daemon = fleet.daemon(&[]);
    daemon.wait_for("/readyz?verbose", "[-]tenant ghost down", SOON).await;
    let metrics = daemon
        .wait_for("/metrics", "stackd_tenant_restarts_total{tenant=\"ghost\"}", SOON)
        .await;
    assert!(metrics.contains("stackd_tenant_up{tenant=\"ghost\"} 0"), "{metrics}");
    assert!(
        fleet.namespace("ghost").await.is_none(),
        "nothing is created for a tenant that never answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_tenant_file_is_reported_and_a_running_tenant_keeps_running() {
    let fleet = Fleet::start(&["acme"]).await;
    std::fs::write(fleet.tenant_file("Bad_Name"), "apiVersion: v1\nkind: Config\n").expect("write");
    let daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    daemon
        .wait_for("/readyz?verbose", "[-]tenant Bad_Name invalid", SOON)
        .await;
    std::fs::write(fleet.tenant_file("acme"), "not: [a kubeconfig").expect("write");
    until("the bad file reported", SOON, &daemon, || async {
        daemon.log_text().contains("keeps running on the previous one")
    })
    .await;
    // Still reconciled: delete the binding and it comes back.
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    bindings
        .delete("stackd-tenant-namespace", &DeleteParams::default())
        .await
        .expect("delete binding");
    fleet.wait_for_namespace("acme", SOON).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line_with_tenant_fields() {
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&["--log-format", "json"]);
    fleet.wait_for_namespace("acme", SOON).await;
    let log = daemon.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "starting tenant" && l["tenant"] == "acme"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_daemon_with_exit_code_zero() {
    let fleet = Fleet::start(&["acme"]).await;
    let mut daemon = fleet.daemon(&[]);
    fleet.wait_for_namespace("acme", SOON).await;
    let started = Instant::now();
    daemon.terminate();
    let Some(status) = daemon.wait_exit(Duration::from_secs(5)).await else {
        panic!("still running 5 s after SIGTERM:\n{}", daemon.log_text());
    };
    assert!(status.success(), "exit status {status:?}\n{}", daemon.log_text());
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(daemon.log_text().contains("stackd stopped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_daemons_with_leader_election_only_one_reconciles_until_it_exits() {
    let fleet = Fleet::start(&["acme"]).await;
    fleet.leader_election_namespace().await;
    let args = ["--leader-elect", "--leader-elect-lease-duration", "3"];
    let mut first = fleet.daemon(&args);
    fleet.wait_for_namespace("acme", SOON).await;
    let second = fleet.daemon(&args);
    until("the second to wait for the lease", SOON, &second, || async {
        second.log_text().contains("waiting for the leader lease")
    })
    .await;
    // The second had its chance while the first renewed the lease twice.
    let before = fleet.host().counters();
    until("two renewals of the lease", SOON, &second, || async {
        let renewals = fleet.host().counters().since(&before);
        renewals.get(Verb::Update, "leases", Some("stackd-system"))
            + renewals.get(Verb::Patch, "leases", Some("stackd-system"))
            >= 2
    })
    .await;
    assert!(
        !second.log_text().contains("acquired the leader lease"),
        "only one leader:\n{}",
        second.log_text()
    );
    first.terminate();
    first.wait_exit(Duration::from_secs(5)).await.expect("first exits");
    until("the standby to take over", SOON, &second, || async {
        second.log_text().contains("acquired the leader lease")
    })
    .await;
    // The new leader reconciles: delete the binding and it comes back.
    let bindings: Api<RoleBinding> = Api::namespaced(fleet.host_client.clone(), "tenant-acme-controllers");
    bindings
        .delete("stackd-tenant-namespace", &DeleteParams::default())
        .await
        .expect("delete binding");
    fleet.wait_for_namespace("acme", SOON).await;
}

/// Issue 30: a leader-election namespace that does not exist is named, with the flag to fix it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_leader_election_namespace_is_named_in_the_error() {
    let fleet = Fleet::start(&["acme"]).await;
    let mut daemon = fleet.daemon(&["--leader-elect", "--leader-elect-namespace", "nowhere"]);
    let status = daemon.wait_exit(SOON).await.expect("the daemon exits");
    assert!(!status.success());
    let log = daemon.log_text();
    assert!(
        log.contains("the namespace nowhere of the leader Lease does not exist")
            && log.contains("--leader-elect-namespace"),
        "{log}"
    );
}

/// Issue 30: with `--shards`, a shard namespace that does not exist is named (once), not retried
/// forever as "the lease is gone".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_shard_namespace_is_named_in_the_error() {
    let fleet = Fleet::start(&["acme"]).await;
    let daemon = fleet.daemon(&["--shards", "--shard-namespace", "nowhere"]);
    let named = "the namespace nowhere of the shard Leases does not exist on the host";
    crate::harness::until("the missing namespace named", SOON, &daemon, || async {
        daemon.log_text().contains(named)
    })
    .await;
    // The namespace appears: the replica registers and serves its tenants.
    let nowhere: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "nowhere"}})).expect("ns");
    fleet
        .namespaces()
        .create(&Default::default(), &nowhere)
        .await
        .expect("create the namespace");
    fleet.wait_for_namespace("acme", Duration::from_secs(30)).await;
    let log = daemon.log_text();
    assert!(!log.contains("the lease is gone"), "{log}");
    assert_eq!(log.matches(named).count(), 1, "named once:\n{log}");
}
