//! The tenant Secrets the Stack controller knows of (DESIGN.md §3.3 step 2, §8): the token Secrets
//! it created, and nothing else, and their data only when they change.
//!
//! A label proves nothing: any user who may write Secrets in a namespace can label theirs
//! `app.kubernetes.io/managed-by=stackd`, and a cache of every such Secret, data included, let one
//! user grow the daemon by each Secret's megabyte until it crashed for every tenant. So the watch
//! is metadata-only (`PartialObjectMetadata`: a Secret's data never reaches the daemon through it),
//! and of what it sees only a Secret that is a Stack's token Secret by its shape is kept: named
//! `<stack>-token`, controlled by the Stack `<stack>` of its namespace, annotated as that Stack's
//! (at most one per Stack; the Stack controller checks the rest, its labels and owner's uid, before it
//! trusts one). Its data is read with one GET when its `resourceVersion` moves past the copy held,
//! so the token sync stays event-driven and an unchanged Secret costs no request.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event, watcher as list_and_watch};
use kube::{Client, ResourceExt};

use super::tenant::STACK_ANNOTATION;
use crate::runtime::readiness::Readiness;
use crate::runtime::recovery::{WatchBackoff, retry_watch};

/// The metadata of a tenant Secret.
pub type SecretMeta = PartialObjectMeta<Secret>;

/// The data keys of a token Secret the controller copies; others are not kept.
const TOKEN_KEYS: &[&str] = &["token", "ca.crt", "namespace"];

/// The Stacks' token Secrets: their metadata as watched, and the data last read of each.
pub struct TokenSecrets {
    store: Store<SecretMeta>,
    readiness: Readiness,
    /// By `namespace/name`: the resourceVersion read and the Secret, data trimmed to [`TOKEN_KEYS`].
    read: Mutex<HashMap<String, (String, Arc<Secret>)>>,
}

/// Watches the tenant's Secrets selected by `labels`, by metadata, keeping only Stacks' token
/// Secrets. The returned stream must be polled (the controller's trigger) for the store to fill; it
/// yields every kept Secret that changed or went.
pub fn watch(
    client: Client,
    labels: &str,
    tenant_back: tokio::sync::watch::Receiver<u64>,
) -> (
    TokenSecrets,
    impl Stream<Item = Result<SecretMeta, watcher::Error>> + Send + 'static,
) {
    let writer = reflector::store::Writer::<SecretMeta>::default();
    let store = writer.as_reader();
    let kept = writer.as_reader();
    let api = Api::<SecretMeta>::all(client);
    // Like the shared caches, the watch resumes the moment the tenant answers again.
    let events = retry_watch(
        list_and_watch(api, watcher::Config::default().labels(labels)).boxed(),
        Some(tenant_back),
        WatchBackoff::default(),
    )
    .try_filter_map(move |event| futures::future::ready(Ok(ours_only(event, &kept))));
    let stream = reflector::reflector(writer, events).touched_objects();
    let waiting = store.clone();
    let readiness = Readiness::after(async move { waiting.wait_until_ready().await.is_ok() });
    let secrets = TokenSecrets {
        store,
        readiness,
        read: Mutex::default(),
    };
    (secrets, stream.boxed())
}

impl TokenSecrets {
    /// Resolves once the first list is in.
    pub fn readiness(&self) -> Readiness {
        self.readiness.clone()
    }

    /// The token Secret `name` of `namespace` as it is now, its data trimmed to [`TOKEN_KEYS`]:
    /// `None` when the watch has not seen it; read again only when its resourceVersion moved.
    pub async fn current(
        &self,
        api: &Api<Secret>,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<Secret>>, kube::Error> {
        let Some(meta) = self.store.get(&ObjectRef::new(name).within(namespace)) else {
            return Ok(None);
        };
        let key = format!("{namespace}/{name}");
        let version = meta.metadata.resource_version.clone().unwrap_or_default();
        if let Some((read, secret)) = self.lock().get(&key)
            && *read == version
        {
            return Ok(Some(secret.clone()));
        }
        let Some(secret) = api.get_opt(name).await? else {
            return Ok(None);
        };
        let secret = Arc::new(trimmed(secret));
        let version = secret.metadata.resource_version.clone().unwrap_or_default();
        self.lock().insert(key, (version, secret.clone()));
        Ok(Some(secret))
    }

    /// Forgets what was read of a Stack's token Secret (the Stack is gone).
    pub fn forget(&self, namespace: &str, name: &str) {
        self.lock().remove(&format!("{namespace}/{name}"));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Arc<Secret>)>> {
        self.read.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The Secret with only the data keys a token copy takes.
fn trimmed(mut secret: Secret) -> Secret {
    let data: BTreeMap<String, ByteString> = secret
        .data
        .take()
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| TOKEN_KEYS.contains(&key.as_str()))
        .collect();
    secret.data = Some(data);
    secret.string_data = None;
    secret.metadata.managed_fields = None;
    secret
}

/// The watch's events for the store: Stacks' token Secrets only, their metadata slimmed; a kept
/// Secret that stops looking like one is removed.
fn ours_only(event: Event<SecretMeta>, kept: &Store<SecretMeta>) -> Option<Event<SecretMeta>> {
    let known = |meta: &SecretMeta| kept.get(&ObjectRef::from_obj(meta)).is_some();
    match event {
        Event::Apply(meta) if is_token_secret(&meta) => Some(Event::Apply(slim(meta))),
        Event::Apply(meta) | Event::Delete(meta) if known(&meta) => Some(Event::Delete(slim(meta))),
        Event::Delete(meta) if is_token_secret(&meta) => Some(Event::Delete(slim(meta))),
        Event::InitApply(meta) if is_token_secret(&meta) => Some(Event::InitApply(slim(meta))),
        Event::Apply(_) | Event::Delete(_) | Event::InitApply(_) => None,
        Event::Init => Some(Event::Init),
        Event::InitDone => Some(Event::InitDone),
    }
}

/// A Stack's token Secret by its shape: `<stack>-token`, controlled by the Stack `<stack>`, and
/// annotated as that Stack's.
fn is_token_secret(meta: &SecretMeta) -> bool {
    let name = meta.name_any();
    let Some(stack) = name.strip_suffix("-token") else {
        return false;
    };
    let namespace = meta.namespace().unwrap_or_default();
    let controlled = meta.owner_references().iter().any(|owner| {
        owner.controller == Some(true)
            && owner.kind == "Stack"
            && owner.api_version == format!("{}/{}", crate::api::STACKS_GROUP, crate::api::VERSION)
            && owner.name == stack
    });
    let annotated = meta.annotations().get(STACK_ANNOTATION) == Some(&format!("{namespace}/{stack}"));
    controlled && annotated
}

/// What the controller reads of a token Secret's metadata: identity, version, the Stack annotation
/// (its trigger) and deletion; not what else its writers put there.
fn slim(meta: SecretMeta) -> SecretMeta {
    let mut slim = meta;
    let metadata = &mut slim.metadata;
    metadata.managed_fields = None;
    metadata.labels = None;
    metadata.owner_references = None;
    metadata.finalizers = None;
    metadata.annotations = metadata
        .annotations
        .take()
        .and_then(|annotations| annotations.get(STACK_ANNOTATION).cloned())
        .map(|stack| BTreeMap::from([(STACK_ANNOTATION.to_string(), stack)]));
    slim
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use kube::core::PartialObjectMetaExt;
    use serde_json::json;

    fn meta(name: &str, owner: Option<&str>, annotation: Option<&str>) -> SecretMeta {
        let mut metadata: ObjectMeta = serde_json::from_value(json!({"name": name, "namespace": "team-a"})).unwrap();
        metadata.owner_references = owner.map(|stack| {
            vec![
                serde_json::from_value(json!({
                    "apiVersion": "stacks.stackd.dev/v1alpha1", "kind": "Stack", "name": stack,
                    "uid": "u", "controller": true,
                }))
                .unwrap(),
            ]
        });
        metadata.annotations = annotation.map(|a| BTreeMap::from([(STACK_ANNOTATION.to_string(), a.to_string())]));
        metadata.into_response_partial::<Secret>()
    }

    #[test]
    fn only_a_stacks_own_token_secret_is_one() {
        assert!(is_token_secret(&meta("db-token", Some("db"), Some("team-a/db"))));
        assert!(!is_token_secret(&meta("db-token", None, Some("team-a/db"))), "no owner");
        assert!(
            !is_token_secret(&meta("db-token", Some("other"), Some("team-a/db"))),
            "another's"
        );
        assert!(
            !is_token_secret(&meta("db-token", Some("db"), Some("team-b/db"))),
            "another namespace"
        );
        assert!(
            !is_token_secret(&meta("db-creds", Some("db"), Some("team-a/db"))),
            "not a token's name"
        );
        assert!(!is_token_secret(&meta("big-1", None, None)), "only labelled");
    }

    #[test]
    fn a_labelled_secret_of_another_shape_never_enters_the_store_and_a_kept_one_leaves_when_it_changes_shape() {
        let (store, mut writer) = reflector::store::<SecretMeta>();
        let stranger = meta("big-1", None, None);
        assert!(ours_only(Event::Apply(stranger.clone()), &store).is_none());
        assert!(ours_only(Event::InitApply(stranger.clone()), &store).is_none());
        assert!(ours_only(Event::Delete(stranger), &store).is_none());
        let token = meta("db-token", Some("db"), Some("team-a/db"));
        let kept = ours_only(Event::Apply(token.clone()), &store).expect("kept");
        writer.apply_watcher_event(&kept);
        let Event::Apply(slimmed) = kept else {
            panic!("an apply")
        };
        assert_eq!(slimmed.metadata.owner_references, None);
        let mut unowned = token;
        unowned.metadata.owner_references = None;
        assert!(matches!(
            ours_only(Event::Apply(unowned), &store),
            Some(Event::Delete(_))
        ));
    }
}
