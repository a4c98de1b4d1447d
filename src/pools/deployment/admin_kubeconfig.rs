//! The tenant Secret `<cd>-admin-kubeconfig` (DESIGN.md §4.2, §8): the Secret stackd creates for
//! a ClusterDeployment, the proof that an existing one is that Secret, and whether it needs the
//! new kubeconfig. A Secret of that name that anyone else made is never touched. Pure: no client.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;

use super::{CLUSTER_DEPLOYMENT_LABEL, CLUSTER_DEPLOYMENT_UID_ANNOTATION};
use crate::api::pools::ClusterDeployment;
use crate::host::labels::{MANAGED_BY, MANAGED_BY_LABEL};

/// The Secret's name.
pub(crate) fn name(cd: &ClusterDeployment) -> String {
    format!("{}-admin-kubeconfig", cd.name_any())
}

/// The Secret as stackd creates it, labelled and annotated for this very ClusterDeployment.
pub(crate) fn secret(cd: &ClusterDeployment, kubeconfig: ByteString) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name(cd)),
            namespace: cd.namespace(),
            labels: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.into(), MANAGED_BY.into()),
                (CLUSTER_DEPLOYMENT_LABEL.into(), cd.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                CLUSTER_DEPLOYMENT_UID_ANNOTATION.into(),
                cd.metadata.uid.clone().unwrap_or_default(),
            )])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("kubeconfig".into(), kubeconfig)])),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

/// True when stackd created `secret` for this very ClusterDeployment (not for an earlier one of
/// the same name, and not someone else).
fn made_for(secret: &Secret, cd: &ClusterDeployment) -> bool {
    let labels = secret.labels();
    let uid = secret.annotations().get(CLUSTER_DEPLOYMENT_UID_ANNOTATION);
    labels.get(MANAGED_BY_LABEL).map(String::as_str) == Some(MANAGED_BY)
        && labels.get(CLUSTER_DEPLOYMENT_LABEL) == Some(&cd.name_any())
        && uid.is_some()
        && uid == cd.metadata.uid.as_ref()
}

/// What to do with the Secret found under the admin kubeconfig's name.
#[derive(Debug, PartialEq)]
pub(crate) enum Existing {
    /// Someone else's: leave it alone.
    Foreign,
    /// Ours and holding the kubeconfig already.
    Current,
    /// Ours with another kubeconfig: replace it with this copy (resourceVersion kept).
    Replace(Box<Secret>),
}

pub(crate) fn existing(mut found: Secret, cd: &ClusterDeployment, kubeconfig: ByteString) -> Existing {
    if !made_for(&found, cd) {
        return Existing::Foreign;
    }
    let data = found.data.get_or_insert_with(Default::default);
    if data.get("kubeconfig") == Some(&kubeconfig) {
        return Existing::Current;
    }
    data.insert("kubeconfig".into(), kubeconfig);
    found.metadata.managed_fields = None;
    Existing::Replace(Box::new(found))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cd(uid: &str) -> ClusterDeployment {
        serde_json::from_value(json!({
            "apiVersion": "pools.stackd.dev/v1alpha1", "kind": "ClusterDeployment",
            "metadata": {"name": "c1", "namespace": "c1", "uid": uid},
            "spec": {"clusterName": "c1", "baseDomain": "example.com", "platform": {}},
        }))
        .unwrap()
    }

    fn kubeconfig(text: &str) -> ByteString {
        ByteString(text.as_bytes().to_vec())
    }

    #[test]
    fn the_copy_is_labelled_and_annotated_for_its_cluster() {
        let copy = secret(&cd("uid-1"), kubeconfig("k"));
        assert_eq!(copy.metadata.name.as_deref(), Some("c1-admin-kubeconfig"));
        assert_eq!(copy.metadata.namespace.as_deref(), Some("c1"));
        assert_eq!(
            copy.labels().get(CLUSTER_DEPLOYMENT_LABEL).map(String::as_str),
            Some("c1")
        );
        assert_eq!(
            copy.labels().get(MANAGED_BY_LABEL).map(String::as_str),
            Some(MANAGED_BY)
        );
        assert_eq!(
            copy.annotations()
                .get(CLUSTER_DEPLOYMENT_UID_ANNOTATION)
                .map(String::as_str),
            Some("uid-1")
        );
    }

    #[test]
    fn our_copy_is_left_as_it_is_when_current_and_updated_otherwise() {
        let ours = secret(&cd("uid-1"), kubeconfig("old"));
        assert_eq!(
            existing(ours.clone(), &cd("uid-1"), kubeconfig("old")),
            Existing::Current
        );
        let Existing::Replace(updated) = existing(ours, &cd("uid-1"), kubeconfig("new")) else {
            panic!("ours is updated");
        };
        assert_eq!(updated.data.unwrap()["kubeconfig"], kubeconfig("new"));
    }

    #[test]
    fn a_secret_someone_else_made_is_never_touched() {
        let mut foreign = secret(&cd("uid-1"), kubeconfig("theirs"));
        foreign.metadata.labels = None;
        assert_eq!(existing(foreign, &cd("uid-1"), kubeconfig("k")), Existing::Foreign);
        let mut unannotated = secret(&cd("uid-1"), kubeconfig("theirs"));
        unannotated.metadata.annotations = None;
        assert_eq!(existing(unannotated, &cd("uid-1"), kubeconfig("k")), Existing::Foreign);
    }

    #[test]
    fn a_copy_made_for_an_earlier_cluster_of_the_same_name_is_foreign() {
        let earlier = secret(&cd("uid-old"), kubeconfig("k"));
        assert_eq!(existing(earlier, &cd("uid-new"), kubeconfig("k")), Existing::Foreign);
    }

    #[test]
    fn a_cluster_without_a_uid_owns_no_secret() {
        let copy = secret(&cd(""), kubeconfig("k"));
        let mut no_uid = cd("");
        no_uid.metadata.uid = None;
        assert_eq!(existing(copy, &no_uid, kubeconfig("k")), Existing::Foreign);
    }
}
