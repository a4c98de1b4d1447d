//! The installer's output Secret (DESIGN.md §4.2, §8). The installer runs the tenant's image with a
//! token that may get, update and patch this one Secret — its metadata included: it can strip
//! stackd's labels (which hides the Secret from the label-filtered cache, the orphan sweep and
//! label-based cleanup) or write another parent's. So stackd records the uid of the Secret it
//! created on the input Secret, which only stackd writes; before anything is read from the output
//! it proves the Secret is that one and puts its own labels and annotations back (reading it only
//! once they are); and it deletes it by the name it created, after the same proof, whatever its
//! labels say.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::installer::{Names, OUTPUT_UID_ANNOTATION};
use super::{Ctx, DeploymentError};
use crate::api::pools::ClusterDeployment;
use crate::context::events::publish;
use crate::host::Parent;
use crate::host::apply::{self, stamp};
use crate::host::ownership::{self, Ownership};
use crate::runtime::api_errors::{is_conflict, is_not_found};

/// Event reason on a ClusterDeployment whose installer changed its output Secret's metadata.
pub(crate) const OUTPUT_RESTORED: &str = "InstallerOutputRestored";

/// Where [`find`] looks first.
#[derive(Clone, Copy)]
pub(super) enum Look {
    /// The cache (the server when stackd recorded a Secret the cache does not show).
    Cached,
    /// The server: the installer has finished, and its last change may not have reached the cache
    /// yet (a Job's watch and a Secret's watch are separate streams), so what is read then — once
    /// per finished installer — must be the Secret as it ended.
    Server,
}

/// The Secret found at the output's name.
pub(super) enum Found {
    /// The one stackd made, with stackd's metadata: its content may be read.
    Trusted(Arc<Secret>),
    /// The one stackd made (this uid), whose metadata the installer had changed: restored now (or
    /// changed again meanwhile), read once the cache shows it restored — that watch event brings
    /// the cluster back.
    Restored { uid: String },
    /// There is none.
    Missing,
    /// Not the one stackd made (why): never read, written or deleted.
    Foreign(String),
}

/// The output Secret as it stands, restored to stackd's metadata when the installer changed it
/// (an Event on the cluster says so).
pub(super) async fn find(
    ctx: &Ctx,
    cd: &ClusterDeployment,
    parent: &Parent,
    names: &Names,
    look: Look,
) -> Result<Found, DeploymentError> {
    let tenant = &ctx.tenant;
    let recorded = recorded_uid(ctx, names);
    let Some(found) = candidate(ctx, names, recorded.as_deref(), look).await? else {
        return Ok(Found::Missing);
    };
    let ours = ownership::check(found.labels(), found.annotations(), &tenant.name, parent) == Ownership::Ours;
    if let Err(why) = proven(&found, recorded.as_deref(), ours) {
        return Ok(Found::Foreign(why));
    }
    if ours {
        return Ok(Found::Trusted(found));
    }
    if restore(ctx, &found, parent).await? {
        let note = format!(
            "The installer changed the labels or annotations of its output Secret {}/{}; stackd restored them, and reads the Secret only as restored",
            tenant.host_namespace, names.output
        );
        publish(tenant, cd, true, OUTPUT_RESTORED, note).await;
    }
    Ok(Found::Restored {
        uid: found.uid().unwrap_or_default(),
    })
}

/// Deletes the output Secret stackd made for the cluster, by its name, whatever its labels say:
/// the uid stackd recorded proves it without reading it (it may be too large to read).
pub(super) async fn delete(ctx: &Ctx, parent: &Parent, names: &Names) -> Result<(), DeploymentError> {
    let tenant = &ctx.tenant;
    let recorded = recorded_uid(ctx, names);
    if let Some(uid) = &recorded {
        let api = Api::<Secret>::namespaced(tenant.host.clone(), &tenant.host_namespace);
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        return match api.delete(&names.output, &params).await {
            Ok(_) => Ok(()),
            // Gone, or another Secret by that name now: not stackd's to delete.
            Err(err) if is_not_found(&err) || is_conflict(&err) => Ok(()),
            Err(err) => Err(DeploymentError::HostApi(err)),
        };
    }
    let Some(found) = candidate(ctx, names, recorded.as_deref(), Look::Cached).await? else {
        return Ok(());
    };
    let ours = ownership::check(found.labels(), found.annotations(), &tenant.name, parent) == Ownership::Ours;
    if proven(&found, recorded.as_deref(), ours).is_ok() {
        let api = Api::<Secret>::namespaced(tenant.host.clone(), &tenant.host_namespace);
        apply::delete(&api, &*found).await.map_err(DeploymentError::HostApi)?;
    }
    Ok(())
}

/// The uid of the output Secret stackd made, as the (cached) input Secret records it.
fn recorded_uid(ctx: &Ctx, names: &Names) -> Option<String> {
    let input = ctx
        .secrets
        .get(&ObjectRef::new(&names.input).within(&ctx.tenant.host_namespace))?;
    input.annotations().get(OUTPUT_UID_ANNOTATION).cloned()
}

/// The Secret at the output's name: the cached copy, else — when stackd recorded having made one,
/// whose labels may have been stripped out of the cache's sight, or when `look` asks — the server's.
async fn candidate(
    ctx: &Ctx,
    names: &Names,
    recorded: Option<&str>,
    look: Look,
) -> Result<Option<Arc<Secret>>, DeploymentError> {
    let tenant = &ctx.tenant;
    if matches!(look, Look::Cached) {
        let cached = ctx
            .secrets
            .get(&ObjectRef::new(&names.output).within(&tenant.host_namespace));
        if cached.is_some() || recorded.is_none() {
            return Ok(cached);
        }
    }
    let api = Api::<Secret>::namespaced(tenant.host.clone(), &tenant.host_namespace);
    let found = api.get_opt(&names.output).await.map_err(DeploymentError::HostApi)?;
    Ok(found.map(Arc::new))
}

/// Whether `found` is the Secret stackd made: the uid it recorded, or (a Secret made before stackd
/// recorded uids) its labels and annotations.
fn proven(found: &Secret, recorded: Option<&str>, ours: bool) -> Result<(), String> {
    match recorded {
        Some(uid) if found.uid().as_deref() == Some(uid) => Ok(()),
        Some(_) => Err("its uid is not the one stackd recorded when it created the output Secret".into()),
        None if ours => Ok(()),
        None => Err("its labels and annotations are not those stackd created the output Secret with".into()),
    }
}

/// Puts stackd's labels and annotations back on `found` (uid and resourceVersion as
/// preconditions); false when it changed or went meanwhile.
async fn restore(ctx: &Ctx, found: &Secret, parent: &Parent) -> Result<bool, DeploymentError> {
    let tenant = &ctx.tenant;
    let mut fixed = found.clone();
    fixed.metadata.managed_fields = None;
    stamp(&mut fixed, &tenant.name, parent);
    let api = Api::<Secret>::namespaced(tenant.host.clone(), &tenant.host_namespace);
    match api.replace(&found.name_any(), &PostParams::default(), &fixed).await {
        Ok(_) => Ok(true),
        Err(err) if is_conflict(&err) || is_not_found(&err) => Ok(false),
        Err(err) => Err(DeploymentError::HostApi(err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(uid: &str) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.uid = Some(uid.into());
        secret
    }

    #[test]
    fn the_recorded_uid_proves_the_secret_whatever_its_labels() {
        assert_eq!(proven(&secret("u1"), Some("u1"), false), Ok(()));
        assert!(
            proven(&secret("u2"), Some("u1"), true).is_err(),
            "labels never outweigh the uid"
        );
    }

    #[test]
    fn without_a_recorded_uid_only_stackds_labels_prove_it() {
        assert_eq!(proven(&secret("u1"), None, true), Ok(()));
        let err = proven(&secret("u1"), None, false).unwrap_err();
        assert!(err.contains("labels and annotations"), "{err}");
    }
}
