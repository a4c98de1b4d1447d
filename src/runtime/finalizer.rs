//! kube's finalizer idiom, once for every controller that holds a deletion: the finalizer goes on
//! before anything else is done, `apply` runs while the object lives, `cleanup` once it is being
//! deleted, and the finalizer comes off when the cleanup is [`Cleanup::Done`]. A cleanup still
//! waiting is [`Cleanup::Pending`], a value, not an error: it keeps the finalizer and is neither
//! counted nor backed off as a failure.
//!
//! A finalizer write that finds the object gone (404) is done: there is nothing left to hold. One
//! refused with 409 or 422 may have been made from a stale cached copy (kube's finalizer patch
//! tests the finalizers it read, and a reconcile can run before the watch brought our own last
//! write): one GET tells. A newer object is no failure: its watch event brings the next reconcile.
//! The same object refused is: the server does not accept it as it is (a CRD tightened since it was
//! written), and that failure goes to the retry, backed off per object, never asked every 200 ms.

use std::error::Error;
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use kube::runtime::controller::Action;
use kube::runtime::finalizer::{self, Event};
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::api_errors::{is_conflict, is_not_found, is_unprocessable};

/// How far the cleanup of a deleted object got.
#[derive(Debug)]
pub enum Cleanup {
    /// Everything is let go: the finalizer may come off.
    Done,
    /// Something is still to wait for: the finalizer stays and the object is looked at again as
    /// `Action` says.
    Pending(Action),
}

/// A finalizer write that failed (one made from a stale copy excepted), kube's error kept whole
/// for the retry's diagnosis.
#[derive(Debug, thiserror::Error)]
pub enum FinalizerError {
    #[error("cannot add the finalizer: {0}")]
    Add(#[source] kube::Error),
    #[error("cannot remove the finalizer: {0}")]
    Remove(#[source] kube::Error),
    /// The object has no name: its finalizers cannot be written.
    #[error("the object has no name")]
    Unnamed,
    /// The finalizer's name does not make a JSON pointer (a constant of ours: a bug).
    #[error("the finalizer name is not a valid JSON pointer")]
    InvalidName,
}

/// One step of a reconcile inside kube's finalizer: kube keeps the finalizer only on an error, so
/// a pending cleanup travels as one as far as [`reconcile`], which turns it back into a value.
#[derive(Debug, thiserror::Error)]
enum Step<E: Error + 'static> {
    #[error(transparent)]
    Failed(E),
    #[error("the cleanup is not finished")]
    Pending(Action),
}

/// Reconciles `object` under the finalizer `name`: `apply` while it lives, `cleanup` once it is
/// being deleted (see the module docs).
pub async fn reconcile<K, E, A, C>(
    api: &Api<K>,
    name: &str,
    object: Arc<K>,
    apply: impl FnOnce(Arc<K>) -> A,
    cleanup: impl FnOnce(Arc<K>) -> C,
) -> Result<Action, E>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    E: Error + From<FinalizerError> + 'static,
    A: Future<Output = Result<Action, E>>,
    C: Future<Output = Result<Cleanup, E>>,
{
    let copy = object.clone();
    let outcome = finalizer::finalizer(api, name, object, |event| async move {
        match event {
            Event::Apply(object) => apply(object).await.map_err(Step::Failed),
            Event::Cleanup(object) => match cleanup(object).await.map_err(Step::Failed)? {
                Cleanup::Done => Ok(Action::await_change()),
                Cleanup::Pending(action) => Err(Step::Pending(action)),
            },
        }
    })
    .await;
    match outcome {
        Ok(action) => Ok(action),
        Err(finalizer::Error::ApplyFailed(step) | finalizer::Error::CleanupFailed(step)) => match step {
            Step::Failed(err) => Err(err),
            Step::Pending(action) => Ok(action),
        },
        Err(finalizer::Error::AddFinalizer(err) | finalizer::Error::RemoveFinalizer(err)) if is_not_found(&err) => {
            Ok(Action::await_change())
        }
        Err(finalizer::Error::AddFinalizer(err) | finalizer::Error::RemoveFinalizer(err))
            if (is_conflict(&err) || is_unprocessable(&err)) && copy_is_stale(api, copy.as_ref()).await =>
        {
            Ok(Action::await_change())
        }
        Err(finalizer::Error::AddFinalizer(err)) => Err(FinalizerError::Add(err).into()),
        Err(finalizer::Error::RemoveFinalizer(err)) => Err(FinalizerError::Remove(err).into()),
        Err(finalizer::Error::UnnamedObject) => Err(FinalizerError::Unnamed.into()),
        Err(finalizer::Error::InvalidFinalizer) => Err(FinalizerError::InvalidName.into()),
    }
}

/// Whether the server holds a newer `copy` than ours (or none at all). A failed GET says no: the
/// write's own failure is then what the retry diagnoses.
async fn copy_is_stale<K>(api: &Api<K>, copy: &K) -> bool
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let Some(name) = copy.meta().name.as_deref() else {
        return false;
    };
    match api.get_opt(name).await {
        Ok(Some(current)) => current.meta().resource_version != copy.meta().resource_version,
        Ok(None) => true,
        Err(_) => false,
    }
}
