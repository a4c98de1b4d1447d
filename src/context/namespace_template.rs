//! Tenant names and the host namespace each tenant's objects live in.

use std::fmt;

/// Placeholder in `--tenant-namespace-template` replaced by the tenant's name.
pub const TENANT_PLACEHOLDER: &str = "{tenant}";
/// The default template, as in the seed design.
pub const DEFAULT_NAMESPACE_TEMPLATE: &str = "tenant-{tenant}-controllers";
const DNS_LABEL_MAX: usize = 63;

/// A validated `--tenant-namespace-template`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceTemplate(String);

/// Why a tenant name or namespace template is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("namespace template {0:?} must contain {TENANT_PLACEHOLDER}")]
    NoPlaceholder(String),
    #[error(
        "tenant name {name:?} is not a DNS-1123 label: use lowercase letters, digits and '-', starting and ending with a letter or digit"
    )]
    NotDnsLabel { name: String },
    #[error(
        "tenant name {name:?} makes the host namespace {namespace:?} {len} characters long; namespaces are at most 63: shorten the file name"
    )]
    NamespaceTooLong {
        name: String,
        namespace: String,
        len: usize,
    },
    #[error("namespace template {template:?} gives {namespace:?}, which is not a DNS-1123 label")]
    BadTemplate { template: String, namespace: String },
}

impl NamespaceTemplate {
    pub fn new(template: &str) -> Result<Self, NameError> {
        if !template.contains(TENANT_PLACEHOLDER) {
            return Err(NameError::NoPlaceholder(template.to_string()));
        }
        let sample = template.replace(TENANT_PLACEHOLDER, "a");
        if !is_dns_label(&sample) {
            return Err(NameError::BadTemplate {
                template: template.to_string(),
                namespace: sample,
            });
        }
        Ok(NamespaceTemplate(template.to_string()))
    }

    /// The host namespace of `tenant`, after checking the tenant name.
    pub fn namespace_for(&self, tenant: &str) -> Result<String, NameError> {
        if !is_dns_label(tenant) {
            return Err(NameError::NotDnsLabel {
                name: tenant.to_string(),
            });
        }
        let namespace = self.0.replace(TENANT_PLACEHOLDER, tenant);
        if namespace.len() > DNS_LABEL_MAX {
            return Err(NameError::NamespaceTooLong {
                name: tenant.to_string(),
                len: namespace.len(),
                namespace,
            });
        }
        Ok(namespace)
    }
}

impl Default for NamespaceTemplate {
    fn default() -> Self {
        NamespaceTemplate(DEFAULT_NAMESPACE_TEMPLATE.to_string())
    }
}

impl fmt::Display for NamespaceTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// RFC 1123 label: 1–63 of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn is_dns_label(value: &str) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= DNS_LABEL_MAX
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_template_is_the_seeds() {
        assert_eq!(
            NamespaceTemplate::default().namespace_for("n").as_deref(),
            Ok("tenant-n-controllers")
        );
    }

    #[test]
    fn tenant_names_must_be_dns_labels() {
        let template = NamespaceTemplate::default();
        for bad in ["", "Upper", "a.b", "-a", "a-", "a_b"] {
            assert!(
                matches!(template.namespace_for(bad), Err(NameError::NotDnsLabel { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tenant_names_must_fit_the_template() {
        let template = NamespaceTemplate::default();
        // "tenant-" + name + "-controllers" = 19 + name
        assert!(template.namespace_for(&"a".repeat(44)).is_ok());
        let err = template.namespace_for(&"a".repeat(45)).expect_err("64 characters");
        assert!(err.to_string().contains("shorten the file name"), "{err}");
    }

    #[test]
    fn templates_need_the_placeholder_and_a_valid_result() {
        assert!(matches!(
            NamespaceTemplate::new("fixed"),
            Err(NameError::NoPlaceholder(_))
        ));
        assert!(matches!(
            NamespaceTemplate::new("Tenant-{tenant}"),
            Err(NameError::BadTemplate { .. })
        ));
        assert_eq!(
            NamespaceTemplate::new("t-{tenant}").and_then(|t| t.namespace_for("x")),
            Ok("t-x".to_string())
        );
    }
}
