//! The sample stack `stackd dev` installs into the first tenant, with its progress printed as the
//! install moves through the Job, the CRDs, the Stack and the host controller.

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::api::stacks::{Stack, StackInstall};
use crate::runtime::api_errors::is_conflict;

/// The install from `examples/stacks/stackinstall.yaml`, applied as a user would.
const SAMPLE_INSTALL: &str = include_str!("../../examples/stacks/stackinstall.yaml");

/// Creates the sample install (with its namespace and pull secret) and prints its progress.
pub(super) async fn run(tenant: String, client: Client, shutdown: CancellationToken) {
    let install: StackInstall = match serde_saphyr::from_str(SAMPLE_INSTALL) {
        Ok(install) => install,
        Err(err) => {
            println!("  [{tenant}] cannot read the sample StackInstall: {err}");
            return;
        }
    };
    if let Err(err) = create(&client, &install).await {
        println!("  [{tenant}] cannot create the sample StackInstall: {err}");
        return;
    }
    let namespace = install.namespace().unwrap_or_default();
    println!(
        "  [{tenant}] created StackInstall {namespace}/{} ({})",
        install.name_any(),
        install.spec.install.package
    );
    let installs: Api<StackInstall> = Api::namespaced(client.clone(), &namespace);
    let stacks: Api<Stack> = Api::namespaced(client, &namespace);
    let install_events = watcher(installs, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .map(|event| {
            event.map(|i| {
                (
                    "StackInstall",
                    i.name_any(),
                    conditions_of(i.status.map(|s| s.conditions)),
                )
            })
        });
    let stack_events = watcher(stacks, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .map(|event| event.map(|s| ("Stack", s.name_any(), conditions_of(s.status.map(|s| s.conditions)))));
    let mut events = futures::stream::select(install_events, stack_events).boxed();
    let mut last = std::collections::BTreeMap::new();
    loop {
        let (kind, name, line) = tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(event)) => event,
                Some(Err(_)) => continue,
                None => return,
            },
        };
        if !line.is_empty() && last.insert((kind, name.clone()), line.clone()) != Some(line.clone()) {
            println!("  [{tenant}] {kind} {namespace}/{name}: {line}");
        }
    }
}

fn conditions_of(conditions: Option<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>>) -> String {
    conditions
        .unwrap_or_default()
        .iter()
        .filter(|c| c.type_ == "Ready")
        .map(|c| format!("Ready={} {}: {}", c.status, c.reason, c.message))
        .collect()
}

async fn create(client: &Client, install: &StackInstall) -> Result<(), kube::Error> {
    let namespace = install.namespace().unwrap_or_default();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut ns = Namespace::default();
    ns.metadata.name = Some(namespace.clone());
    ignore_exists(namespaces.create(&PostParams::default(), &ns).await)?;
    // The pull secret the sample names; its content is a placeholder registry login.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    for pull in &install.spec.install.image_pull_secrets {
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": pull.name},
            "type": "kubernetes.io/dockerconfigjson",
            "stringData": {".dockerconfigjson": "{\"auths\":{\"registry.example.com\":{\"auth\":\"ZGV2OmRldg==\"}}}"}
        }))
        .map_err(kube::Error::SerdeError)?;
        ignore_exists(secrets.create(&PostParams::default(), &secret).await)?;
    }
    let installs: Api<StackInstall> = Api::namespaced(client.clone(), &namespace);
    ignore_exists(installs.create(&PostParams::default(), install).await)
}

fn ignore_exists<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match result {
        Ok(_) => Ok(()),
        Err(err) if is_conflict(&err) => Ok(()),
        Err(err) => Err(err),
    }
}
