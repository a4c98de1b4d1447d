//! The finalizer adapter every controller holds deletions with (`stackd::runtime::finalizer`), against
//! the embedded server: a stale-copy answer is a conflict the retry backs off, a gone object is done.
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::controller::Action;

use std::sync::Arc;

use kube::Api;
use stackd::embedded::faults::RequestMatch;
use stackd::embedded::{ApiServer, ServerOptions, Verb};
use stackd::runtime::cause::{CauseKind, diagnose};
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

/// A 422 on the finalizer write (its test failed, or the schema no longer accepts the object)
/// is a conflict-kind failure for the retry, which backs it off: never a fixed quick requeue,
/// which an answer that persists would turn into a request every 200 ms.
#[tokio::test]
async fn a_finalizer_write_answered_422_is_a_conflict_for_the_retry_to_back_off() {
    let server = ApiServer::start(ServerOptions::default()).await.expect("server");
    let (api, object) = config_map(&server).await;
    server.faults().fail_next(1, finalizer_patches(), 422);
    let err = run(&api, object.clone())
        .await
        .expect_err("a stale copy is retried as a failure");
    assert!(
        matches!(err, TestError::Finalizer(FinalizerError::StaleCopy(_))),
        "{err}"
    );
    assert_eq!(diagnose(&err).kind, CauseKind::Conflict, "{err}");
    // The retry on a fresh copy goes through.
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
