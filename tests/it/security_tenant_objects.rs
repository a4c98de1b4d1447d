//! Tenant objects (issue 31): a Tenant names a Secret, and the daemon must read Secrets only in the
//! namespaces it is given, and nothing a Secret holds may make it run a command or read its own
//! files. Each attack is performed and its refusal observed on the Tenant.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use stackd::embedded::Verb;

use stackd::context::namespace_template::NamespaceTemplate;
use stackd::runtime::health::Health;
use stackd::runtime::metrics::Metrics;
use stackd::tenancy::objects::status::{Serving, StatusWriter};
use stackd::tenancy::objects::{self, ObjectSettings, Registration};
use tokio_util::sync::CancellationToken;

use crate::harness::{Fleet, NoDaemon, until, wait_until};
use crate::tenant_objects::{
    HostKubectl, SECRETS_NAMESPACE, condition, event_reasons, install_tenant_crd, registration, wait_condition,
};

const SOON: Duration = Duration::from_secs(20);

/// A host with the Tenant CRD and Tenant `acme`, whose working kubeconfig is in a Secret in
/// `kube-system`, a namespace the daemon is not given.
async fn acme_registered_from_kube_system() -> Fleet {
    let mut fleet = Fleet::start(&[]).await;
    let kubeconfig = fleet.add_tenant_server("acme").await;
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            "kube-system",
            "admin-kubeconfig",
            "value",
            &kubeconfig,
        ))
        .await;
    fleet
}

/// A Tenant naming a Secret in `kube-system` (not given to the daemon), which holds a working
/// kubeconfig: the daemon refuses it before asking the host anything, and says so on the Tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_naming_a_secret_outside_the_given_namespaces_never_has_it_read() {
    let fleet = acme_registered_from_kube_system().await;
    let before = fleet.host().counters();
    let daemon = fleet.daemon(&["--tenant-secret-namespaces", SECRETS_NAMESPACE]);
    let message = wait_condition(&fleet, &daemon, "acme", "Served", "False", "SecretNamespaceNotAllowed").await;
    assert!(
        message.contains("kube-system") && message.contains("--tenant-secret-namespaces: stackd-system"),
        "{message}"
    );
    let ready = wait_condition(&fleet, &daemon, "acme", "Ready", "False", "SecretNamespaceNotAllowed").await;
    assert!(ready.starts_with("not served: "), "{ready}");
    until("a Warning Event naming the refusal", SOON, &daemon, || async {
        event_reasons(&fleet, "acme")
            .await
            .contains(&"SecretNamespaceNotAllowed".to_string())
    })
    .await;
    let asked = fleet.host().counters().since(&before);
    for verb in [Verb::Get, Verb::List, Verb::Watch] {
        assert_eq!(
            asked.get(verb, "secrets", Some("kube-system")),
            0,
            "{verb:?} of a Secret in kube-system"
        );
    }
    assert!(fleet.namespace("acme").await.is_none(), "nothing is made for it");
}

/// The leader's status writer starts after the Tenant source, which may have judged every Tenant by
/// then (it did, beside a build, and the test above waited in vain): the writer looks at the
/// Tenants when it starts, not first at the next change or its safety pass a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_refused_before_the_status_writer_starts_has_its_status_written_at_once() {
    let fleet = acme_registered_from_kube_system().await;
    let cancel = CancellationToken::new();
    let settings = ObjectSettings {
        secret_namespaces: [SECRETS_NAMESPACE.to_string()].into(),
        template: NamespaceTemplate::default(),
    };
    let (view, _changes, _source) = objects::start(fleet.host_client.clone(), settings, None, cancel.clone());
    until("the source to refuse the Tenant", SOON, &NoDaemon, || async {
        matches!(view.registration("acme"), Registration::Refused(_))
    })
    .await;
    let writer = StatusWriter {
        host: fleet.host_client.clone(),
        host_reachability: None,
        view,
        health: Arc::new(Health::default()),
        metrics: Arc::new(Metrics::new()),
        template: NamespaceTemplate::default(),
        replica: "stackd-0".to_string(),
        serving: Serving::All,
    };
    let _writer = tokio::spawn(writer.run(cancel.clone()));
    let (status, reason) = wait_until(
        "the Tenant's status written within 10 s of the writer's start",
        Duration::from_secs(10),
        &NoDaemon,
        || async {
            let served = condition(&fleet, "acme", "Served").await;
            served.map(|(status, reason, _)| (status, reason))
        },
    )
    .await;
    cancel.cancel();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "SecretNamespaceNotAllowed")
    );
}

/// Whoever may write Secrets in a given namespace writes a kubeconfig whose user runs a command
/// (`exec`), or sends the daemon's own service-account token (`tokenFile`): refused by field, the
/// command never runs, and the text is never logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_kubeconfig_that_runs_a_command_or_reads_a_file_is_refused() {
    let mut fleet = Fleet::start(&[]).await;
    let kubeconfig = fleet.add_tenant_server("acme").await;
    let marker = fleet.dir.path().join("exec-ran");
    let credential =
        r#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"x"}}"#;
    let exec = json!({"exec": {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "/bin/sh",
        "args": ["-c", format!("touch {} && echo '{credential}'", marker.display())],
    }});
    let with_exec = with_user(&kubeconfig, exec);
    let token_file = json!({"tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"});
    let with_token_file = with_user(&kubeconfig, token_file);
    let kubectl = HostKubectl::new(&fleet);
    install_tenant_crd(&kubectl).await;
    kubectl
        .apply(&registration(
            "acme",
            SECRETS_NAMESPACE,
            "acme-kubeconfig",
            "value",
            &with_exec,
        ))
        .await;
    kubectl
        .apply(&registration(
            "globex",
            SECRETS_NAMESPACE,
            "globex-kubeconfig",
            "value",
            &with_token_file,
        ))
        .await;
    let daemon = fleet.daemon(&[]);
    let message = wait_condition(&fleet, &daemon, "acme", "Served", "False", "KubeconfigRefused").await;
    assert!(message.contains("users[0].user.exec"), "{message}");
    let message = wait_condition(&fleet, &daemon, "globex", "Served", "False", "KubeconfigRefused").await;
    assert!(message.contains("users[0].user.tokenFile"), "{message}");
    assert!(!marker.exists(), "the command ran");
    let log = daemon.log_text();
    assert!(
        !log.contains("/bin/sh") && !log.contains("serviceaccount/token"),
        "{log}"
    );
    assert!(fleet.namespace("acme").await.is_none() && fleet.namespace("globex").await.is_none());
}

/// The embedded server's kubeconfig with its user replaced by `user`.
fn with_user(kubeconfig: &str, user: Value) -> String {
    let mut value: Value = serde_saphyr::from_str(kubeconfig).expect("kubeconfig YAML");
    value["users"][0]["user"] = user;
    serde_saphyr::to_string(&value).expect("YAML")
}
