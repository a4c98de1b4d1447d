//! A Tenant's kubeconfig, read from the Secret it names. Whoever may write Secrets in the given
//! namespaces (a tenant control-plane provider, its users) writes this text, not only the host
//! admin who wrote the Tenant: it passes the allow-list of inline data
//! (`runtime::untrusted_kubeconfig`) before kube's loader sees it, so that no Secret makes the
//! daemon run a command, read one of its own files (its host token) or use a proxy. Errors name the
//! Secret, the key and where in the text, never the text.

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use sha2::{Digest, Sha256};

use crate::api::tenancy::KubeconfigSecretRef;
use crate::context::endpoint::{EndpointSource, TenantEndpoint};
use crate::runtime::cause::diagnose;
use crate::runtime::untrusted_kubeconfig::{UntrustedKubeconfig, UntrustedKubeconfigError};
use crate::tenancy::directory::{TenantConnection, TenantFile, TenantOrigin};

/// The most bytes a kubeconfig may have. Real ones (a CA, a client certificate and key) are a few
/// KiB; a Secret may hold a MiB, which is not parsed.
pub const KUBECONFIG_MAX_BYTES: usize = 256 * 1024;
/// How many of a Secret's other keys a refusal names: the names reach conditions and Events.
const KEYS_NAMED: usize = 5;
/// How much of each named key is shown.
const KEY_SHOWN_CHARS: usize = 63;

/// Why a Tenant is not served from its Secret: `reason` is its `Served` condition's reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            reason,
            message: message.into(),
        }
    }
}

/// Why a Secret could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// It cannot be used as it is (missing, no such key, not readable): reported on the Tenant.
    Refused(Refusal),
    /// The host did not answer as it should; asked again later.
    Transient(String),
}

/// The kubeconfig bytes under the key `secret` names. The caller has checked the namespace.
pub async fn read(host: &Client, secret: &KubeconfigSecretRef) -> Result<Vec<u8>, ReadError> {
    let api: Api<Secret> = Api::namespaced(host.clone(), &secret.namespace);
    let found = match api.get(&secret.name).await {
        Ok(found) => found,
        Err(kube::Error::Api(status)) if status.code == 404 => {
            return Err(ReadError::Refused(Refusal::new(
                "SecretNotFound",
                format!("{secret} does not exist"),
            )));
        }
        Err(kube::Error::Api(status)) if status.code == 403 => {
            return Err(ReadError::Refused(Refusal::new(
                "SecretForbidden",
                format!(
                    "the daemon may not read {secret}: grant it get, list and watch on Secrets in {} (the controllers chart does for tenants.secretNamespaces)",
                    secret.namespace
                ),
            )));
        }
        Err(err) => return Err(ReadError::Transient(diagnose(&err).message)),
    };
    let mut data = found.data.unwrap_or_default();
    match data.remove(&secret.key) {
        Some(bytes) => Ok(bytes.0),
        None => {
            let keys = named_keys(data.keys());
            Err(ReadError::Refused(Refusal::new(
                "KeyNotFound",
                format!("{secret}: the Secret has no such key (its keys: {keys})"),
            )))
        }
    }
}

/// At most [`KEYS_NAMED`] of `keys`, each cut to [`KEY_SHOWN_CHARS`], and how many more there are.
fn named_keys<'a>(keys: impl ExactSizeIterator<Item = &'a String>) -> String {
    let total = keys.len();
    if total == 0 {
        return "none".to_string();
    }
    let shown: Vec<String> = keys
        .take(KEYS_NAMED)
        .map(|key| key.chars().take(KEY_SHOWN_CHARS).collect())
        .collect();
    match total - shown.len() {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

/// What a Tenant runs on, made from its kubeconfig's bytes.
pub struct Source<'a> {
    pub name: &'a str,
    pub secret: &'a KubeconfigSecretRef,
    pub in_cluster_server: Option<&'a str>,
    pub host_namespace: &'a str,
}

/// Checks and parses a Tenant's kubeconfig (CPU work on text of up to a MiB: run it off the async
/// workers).
pub fn parse(source: &Source<'_>, bytes: &[u8]) -> Result<TenantFile, Refusal> {
    let secret = source.secret;
    if bytes.len() > KUBECONFIG_MAX_BYTES {
        return Err(Refusal::new(
            "KubeconfigTooLarge",
            format!(
                "{secret}: {} bytes, more than a kubeconfig may have ({KUBECONFIG_MAX_BYTES})",
                bytes.len()
            ),
        ));
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|_| Refusal::new("InvalidKubeconfig", format!("{secret} is not UTF-8 text")))?;
    let kubeconfig = UntrustedKubeconfig::parse(text).map_err(|err| {
        let reason = match err {
            UntrustedKubeconfigError::Syntax(_) => "InvalidKubeconfig",
            UntrustedKubeconfigError::Refused { .. } | UntrustedKubeconfigError::Invalid { .. } => "KubeconfigRefused",
        };
        Refusal::new(reason, format!("{secret}: {err}"))
    })?;
    // What fails here is the way from the current context to a server.
    let config = kubeconfig.config().map_err(|_| {
        Refusal::new(
            "InvalidKubeconfig",
            format!("{secret}: the current context names no cluster with a server URL"),
        )
    })?;
    // The tenant's `spec.inClusterServer`, or the server the checked kubeconfig names (the
    // in-cluster extension is the tenants directory's; a Tenant says it in its spec).
    let endpoint = match source.in_cluster_server {
        Some(url) => TenantEndpoint::parse(url, EndpointSource::InClusterExtension),
        None => TenantEndpoint::parse(&config.cluster_url.to_string(), EndpointSource::ServerUrl),
    };
    Ok(TenantFile {
        name: source.name.to_string(),
        origin: TenantOrigin::Object(secret.clone()),
        connection: TenantConnection::Checked(Box::new(config)),
        digest: digest(bytes, source.in_cluster_server),
        host_namespace: source.host_namespace.to_string(),
        endpoint,
    })
}

/// What a restart is decided on: the kubeconfig and the endpoint override, and that they came from
/// an object (a tenant moving between a file and an object restarts).
fn digest(bytes: &[u8], in_cluster_server: Option<&str>) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"tenant object\n");
    hasher.update(in_cluster_server.unwrap_or_default().as_bytes());
    hasher.update(b"\n");
    hasher.update(bytes);
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "s3cr3t-t0ken-of-acme";

    fn kubeconfig(user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {{cluster: k, user: u}}\nclusters:\n- name: k\n  cluster: {{server: \"https://acme.example.com:6443\"}}\nusers:\n- name: u\n  user: {user}\n"
        )
    }

    fn secret() -> KubeconfigSecretRef {
        KubeconfigSecretRef {
            namespace: "stackd-system".into(),
            name: "vc-acme".into(),
            key: "config".into(),
        }
    }

    fn parsed(text: &str, in_cluster_server: Option<&str>) -> Result<TenantFile, Refusal> {
        let secret = secret();
        let source = Source {
            name: "acme",
            secret: &secret,
            in_cluster_server,
            host_namespace: "tenant-acme-controllers",
        };
        parse(&source, text.as_bytes())
    }

    #[test]
    fn a_kubeconfig_of_inline_data_is_a_tenant_with_its_endpoint() {
        let file = parsed(&kubeconfig(&format!("{{token: {TOKEN}}}")), None).expect("valid");
        assert_eq!(file.host_namespace, "tenant-acme-controllers");
        assert_eq!(file.origin, TenantOrigin::Object(secret()));
        let endpoint = file.endpoint.expect("endpoint");
        assert_eq!((endpoint.host.as_str(), endpoint.port), ("acme.example.com", 6443));
        // The client is built from what the allow-list checked, never by kube's loader.
        assert!(matches!(file.connection, TenantConnection::Checked(_)));
    }

    #[test]
    fn a_missing_key_names_a_few_of_the_others_each_cut_short() {
        let many: Vec<String> = (0..1000).map(|i| format!("{i:03}{}", "k".repeat(300))).collect();
        let named = named_keys(many.iter());
        assert!(named.ends_with(" and 995 more"), "{named}");
        assert!(named.len() < 5 * 70 + 20, "{named}");
        assert_eq!(named_keys([].iter()), "none");
        let few = ["config".to_string(), "value".to_string()];
        assert_eq!(named_keys(few.iter()), "config, value");
    }

    #[test]
    fn in_cluster_server_wins_and_a_change_of_it_is_a_restart() {
        let text = kubeconfig(&format!("{{token: {TOKEN}}}"));
        let plain = parsed(&text, None).expect("valid");
        let file = parsed(&text, Some("https://acme.tenants.svc")).expect("valid");
        let endpoint = file.endpoint.clone().expect("endpoint");
        assert_eq!((endpoint.host.as_str(), endpoint.port), ("acme.tenants.svc", 443));
        assert_ne!(plain.digest, file.digest);
    }

    #[test]
    fn exec_and_file_paths_are_refused_naming_the_field_not_the_value() {
        for user in [
            "{exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh, args: [-c, 'touch /tmp/x']}}",
            "{tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}",
        ] {
            let refusal = parsed(&kubeconfig(user), None).expect_err("refused");
            assert_eq!(refusal.reason, "KubeconfigRefused", "{user}");
            assert!(refusal.message.contains("users[0].user."), "{}", refusal.message);
            assert!(
                refusal.message.contains("Secret stackd-system/vc-acme"),
                "{}",
                refusal.message
            );
            assert!(!refusal.message.contains("/bin/sh") && !refusal.message.contains("/var/run"));
        }
    }

    #[test]
    fn a_malformed_kubeconfig_is_reported_by_line_without_its_token() {
        let broken = kubeconfig(&format!("{{token: \"{TOKEN}}}\n  - ["));
        let refusal = parsed(&broken, None).expect_err("refused");
        assert_eq!(refusal.reason, "InvalidKubeconfig");
        assert!(refusal.message.contains("line"), "{}", refusal.message);
        assert!(!refusal.message.contains(TOKEN), "{}", refusal.message);
    }

    #[test]
    fn a_kubeconfig_without_a_server_or_too_large_is_refused() {
        let refusal = parsed("apiVersion: v1\nkind: Config\n", None).expect_err("refused");
        assert!(
            refusal.message.contains("no cluster with a server URL"),
            "{}",
            refusal.message
        );
        let huge = format!("# {}\n", "x".repeat(KUBECONFIG_MAX_BYTES));
        assert_eq!(parsed(&huge, None).expect_err("refused").reason, "KubeconfigTooLarge");
    }
}
