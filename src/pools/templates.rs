//! The install-config templates of a tenant's pools, parsed once per version of their Secret and
//! shared (issue 45: eight pools naming one 498 KB template parsed it on every pass of each).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use serde_json::{Map, Value};

use super::install_config;

/// The parsed install-config templates of a tenant's pools, by Secret and version: pools sharing
/// one template parse it once (and once per version), and hold one copy of it. A few entries: a
/// namespace's pools share one or two templates, and each entry is within the install config's
/// bound.
#[derive(Default)]
pub(super) struct Templates(Mutex<Kept>);

/// The parsed templates, oldest first, by their Secret's version.
type Kept = VecDeque<(TemplateKey, Template)>;

/// A parsed template, shared by the pools naming it.
type Template = Arc<Map<String, Value>>;

/// A template Secret's version: its uid and resourceVersion.
type TemplateKey = (String, String);

/// How many parsed templates a tenant keeps.
const TEMPLATES_KEPT: usize = 4;

impl Templates {
    /// The template of `secret`, parsed (on the blocking pool: up to a Secret's megabyte of tenant
    /// YAML) unless this version of it was.
    pub(super) async fn parsed(&self, secret: &Secret) -> Result<Template, install_config::TemplateError> {
        let key = (
            secret.uid().unwrap_or_default(),
            secret.resource_version().unwrap_or_default(),
        );
        if let Some(found) = self.lock().iter().find(|(k, _)| *k == key) {
            return Ok(found.1.clone());
        }
        let text = secret
            .data
            .as_ref()
            .and_then(|d| d.get("install-config.yaml"))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .unwrap_or_default();
        let template = Arc::new(super::off_the_async_workers(move || install_config::parse_template(&text)).await?);
        let mut kept = self.lock();
        kept.retain(|(k, _)| k.0 != key.0);
        if kept.len() >= TEMPLATES_KEPT {
            kept.pop_front();
        }
        kept.push_back((key, template.clone()));
        Ok(template)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    use super::*;

    fn template(uid: &str, version: &str, text: &str) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.uid = Some(uid.into());
        secret.metadata.resource_version = Some(version.into());
        secret.data = Some(BTreeMap::from([(
            "install-config.yaml".to_string(),
            ByteString(text.as_bytes().to_vec()),
        )]));
        secret
    }

    #[tokio::test]
    async fn a_template_is_parsed_once_per_version_and_shared() {
        let templates = Templates::default();
        let first = templates.parsed(&template("u", "1", "a: 1\n")).await.unwrap();
        let again = templates.parsed(&template("u", "1", "a: 1\n")).await.unwrap();
        assert!(Arc::ptr_eq(&first, &again), "parsed once, shared");
        let edited = templates.parsed(&template("u", "2", "a: 2\n")).await.unwrap();
        assert_eq!(edited["a"], 2);
        assert_eq!(templates.lock().len(), 1, "the older version is dropped");
        for uid in ["v", "w", "x", "y"] {
            templates.parsed(&template(uid, "1", "b: 1\n")).await.unwrap();
        }
        assert_eq!(templates.lock().len(), TEMPLATES_KEPT);
        assert!(templates.parsed(&template("z", "1", "[broken")).await.is_err());
    }
}
