//! The finalizer adapter every controller holds deletions with (`stackd::runtime::finalizer`), against
//! the embedded server: a write made from a stale copy is no failure, a refusal of the current object
//! is one (backed off per object), a gone object is done.
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;

use std::sync::Arc;

use kube::Api;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::runtime::finalizer::{Cleanup, FinalizerError, reconcile};

const NAME: &str = "stackd.dev/test";

#[derive(Debug, thiserror::Error)]
enum TestError {
    #[error("{0}")]
    Finalizer(#[from] FinalizerError),
}

async fn config_map(server: &ApiServer) -> (Api<ConfigMap>, Arc<ConfigMap>) {
    let api: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
    let mut object = ConfigMap::default();
    object.metadata.name = Some("held".into());
    let created = api.create(&PostParams::default(), &object).await.expect("create");
    (api, Arc::new(created))
}

async fn run(api: &Api<ConfigMap>, object: Arc<ConfigMap>) -> Result<Action, TestError> {
    reconcile(
        api,
        NAME,
        object,
        |_| async { Ok(Action::await_change()) },
        |_| async { Ok(Cleanup::Done) },
    )
    .await
}

fn finalizer_patches() -> RequestMatch {
    RequestMatch::any().verb(Verb::Patch).resource("configmaps")
}

/// A reconcile can run on a cached copy older than the server's (the watch has not brought the
/// last write yet): kube's finalizer patch tests the finalizers it read and is refused. That is no
/// failure: the newer object's watch event brings the next reconcile, which adds the finalizer.
#[tokio::test]
async fn a_finalizer_write_made_from_a_stale_copy_waits_for_the_newer_one_without_failing() {
    let server = ApiServer::start(ServerOptions::default()).await.expect("server");
    let (api, stale) = config_map(&server).await;
    let patch = serde_json::json!({"metadata": {"finalizers": ["example.org/other"]}});
    let current = api
        .patch("held", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("another writer's finalizer");
    let action = run(&api, stale).await.expect("a stale copy is no failure");
    assert_eq!(action, Action::await_change());
    run(&api, Arc::new(current)).await.expect("the finalizer added");
    let held = api.get("held").await.expect("get");
    assert_eq!(
        held.metadata.finalizers,
        Some(vec!["example.org/other".to_string(), NAME.to_string()])
    );
}

/// The current object refused (a 422 that persists: the schema no longer accepts it) is a failure
/// for the retry, which backs it off per object: never a fixed quick requeue, which would turn it
/// into a request every 200 ms.
#[tokio::test]
async fn a_finalizer_write_refused_for_the_current_object_is_a_failure_for_the_retry() {
    let server = ApiServer::start(ServerOptions::default()).await.expect("server");
    let (api, object) = config_map(&server).await;
    server.faults().fail_next(1, finalizer_patches(), 422);
    let err = run(&api, object.clone()).await.expect_err("a refusal is a failure");
    assert!(matches!(err, TestError::Finalizer(FinalizerError::Add(_))), "{err}");
    // Once the server accepts it, the retry goes through.
    run(&api, object).await.expect("the finalizer added");
    let held = api.get("held").await.expect("get");
    assert_eq!(held.metadata.finalizers, Some(vec![NAME.to_string()]));
}

#[tokio::test]
async fn removing_the_finalizer_of_an_object_already_gone_is_done() {
    let server = ApiServer::start(ServerOptions::default()).await.expect("server");
    let (api, object) = config_map(&server).await;
    run(&api, object).await.expect("the finalizer added");
    api.delete("held", &DeleteParams::default()).await.expect("delete");
    let deleting = Arc::new(api.get("held").await.expect("held by its finalizer"));
    server.faults().fail_next(1, finalizer_patches(), 404);
    let action = run(&api, deleting).await.expect("a gone object is no failure");
    assert_eq!(action, Action::await_change());
}
