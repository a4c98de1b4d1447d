//! Kubeconfigs a tenant can write (a ClusterDeployment's admin kubeconfig, an installer's output):
//! an allow-list of inline data (DESIGN.md §8). kube would run `exec` commands and `auth-provider`
//! helpers, read any file a path names, send requests through a proxy and impersonate others, all
//! inside the daemon; so the kube `Config` is built here from the allowed fields only, never by
//! handing the tenant's text to kube's loader.
//!
//! Accepted: cluster `server` (http or https), `certificate-authority-data`, `tls-server-name`,
//! `insecure-skip-tls-verify`; user `token`, `client-certificate-data` with `client-key-data`,
//! `username` with `password`; context `cluster`, `user`, `namespace`; `current-context`; and the
//! inert `extensions`, `preferences`, `apiVersion`, `kind`, `name`. Everything else is refused,
//! naming the field by its path (`users[0].user.exec`) and never its value.
//!
//! `insecure-skip-tls-verify` is accepted because it only weakens the tenant's own connection: the
//! daemon sends that cluster nothing but the tenant's own credentials and BMC data, and a plain
//! `http://` server (which the allow-list must accept for local clusters) is no safer.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;

use base64::Engine;
use kube::config::AuthInfo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Map, Value};

use super::parse_error::LocatedParseError;

const TOP_LEVEL: &[&str] = &[
    "apiVersion",
    "kind",
    "clusters",
    "users",
    "contexts",
    "current-context",
    "preferences",
    "extensions",
];
const CLUSTER_FIELDS: &[&str] = &[
    "server",
    "certificate-authority-data",
    "tls-server-name",
    "insecure-skip-tls-verify",
    "disable-compression",
    "extensions",
];
const USER_FIELDS: &[&str] = &[
    "token",
    "client-certificate-data",
    "client-key-data",
    "username",
    "password",
    "extensions",
];
const CONTEXT_FIELDS: &[&str] = &["cluster", "user", "namespace", "extensions"];

/// Why a tenant's kubeconfig is not used. Messages name fields, never their values.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UntrustedKubeconfigError {
    #[error("the kubeconfig cannot be parsed: {0}")]
    Syntax(LocatedParseError),
    #[error(
        "{field} is not allowed: stackd accepts only inline data from a tenant (server, certificate-authority-data, \
         tls-server-name, insecure-skip-tls-verify, token, client-certificate-data and client-key-data, \
         username and password, contexts and current-context), never exec, auth-provider, file paths, \
         proxy-url or impersonation"
    )]
    Refused { field: String },
    #[error("{field} must be {expected}")]
    Invalid { field: String, expected: &'static str },
}

impl UntrustedKubeconfigError {
    /// The path of the refused or invalid field, if the error is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            UntrustedKubeconfigError::Syntax(_) => None,
            UntrustedKubeconfigError::Refused { field } | UntrustedKubeconfigError::Invalid { field, .. } => {
                Some(field)
            }
        }
    }
}

type Checked<T> = Result<T, UntrustedKubeconfigError>;

fn invalid(field: impl Into<String>, expected: &'static str) -> UntrustedKubeconfigError {
    UntrustedKubeconfigError::Invalid {
        field: field.into(),
        expected,
    }
}

/// A cluster entry's allowed data.
#[derive(Clone, Default)]
struct AllowedCluster {
    server: Option<http::Uri>,
    root_certs: Option<Vec<Vec<u8>>>,
    tls_server_name: Option<String>,
    insecure_skip_tls_verify: bool,
}

/// A user entry's allowed data (the client identity as checked base64 of PEM).
#[derive(Clone, Default)]
struct AllowedUser {
    token: Option<String>,
    client_certificate_data: Option<String>,
    client_key_data: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

#[derive(Clone, Default)]
struct AllowedContext {
    cluster: String,
    user: Option<String>,
    namespace: Option<String>,
}

/// A tenant's kubeconfig that passed the allow-list.
#[derive(Clone, Default)]
pub struct UntrustedKubeconfig {
    clusters: BTreeMap<String, AllowedCluster>,
    users: BTreeMap<String, AllowedUser>,
    contexts: BTreeMap<String, AllowedContext>,
    current_context: Option<String>,
}

// Credentials stay out of debug output.
impl fmt::Debug for UntrustedKubeconfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UntrustedKubeconfig")
            .field("clusters", &self.clusters.keys().collect::<Vec<_>>())
            .field("users", &self.users.keys().collect::<Vec<_>>())
            .field("contexts", &self.contexts.keys().collect::<Vec<_>>())
            .field("current_context", &self.current_context)
            .finish()
    }
}

impl UntrustedKubeconfig {
    /// Parses and checks `text`; the first field outside the allow-list is refused.
    pub fn parse(text: &str) -> Checked<UntrustedKubeconfig> {
        let document: Value = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_saphyr::from_str(text).map_err(|e| UntrustedKubeconfigError::Syntax(LocatedParseError::yaml(&e)))?
        };
        let top = mapping(&document, "the kubeconfig")?;
        only_allowed(top, "", TOP_LEVEL)?;
        let mut kubeconfig = UntrustedKubeconfig {
            current_context: string(top, "", "current-context")?,
            ..Default::default()
        };
        for (index, entry) in list(top, "clusters")?.iter().enumerate() {
            let path = format!("clusters[{index}]");
            let (name, body) = named(entry, &path, "cluster")?;
            let cluster = cluster(body, &format!("{path}.cluster"))?;
            kubeconfig.clusters.entry(name).or_insert(cluster);
        }
        for (index, entry) in list(top, "users")?.iter().enumerate() {
            let path = format!("users[{index}]");
            let (name, body) = named(entry, &path, "user")?;
            let user = user(body, &format!("{path}.user"))?;
            kubeconfig.users.entry(name).or_insert(user);
        }
        for (index, entry) in list(top, "contexts")?.iter().enumerate() {
            let path = format!("contexts[{index}]");
            let (name, body) = named(entry, &path, "context")?;
            let context = context(body, &format!("{path}.context"))?;
            kubeconfig.contexts.entry(name).or_insert(context);
        }
        Ok(kubeconfig)
    }

    /// A kube `Config` for the current context, made of the allowed data only.
    pub fn config(&self) -> Checked<kube::Config> {
        let context_name = self
            .current_context
            .as_deref()
            .ok_or_else(|| invalid("current-context", "set to the name of one of the contexts"))?;
        let context = self
            .contexts
            .get(context_name)
            .ok_or_else(|| invalid("current-context", "the name of one of the contexts"))?;
        let cluster = self
            .clusters
            .get(&context.cluster)
            .ok_or_else(|| invalid("the current context's cluster", "the name of one of the clusters"))?;
        let server = cluster
            .server
            .clone()
            .ok_or_else(|| invalid("the current context's cluster server", "set"))?;
        // Like client-go, a context without a user (or naming none that exists) is anonymous.
        let user = context
            .user
            .as_ref()
            .and_then(|name| self.users.get(name))
            .cloned()
            .unwrap_or_default();
        let mut config = kube::Config::new(server);
        config.default_namespace = context.namespace.clone().unwrap_or_else(|| "default".into());
        config.root_cert = cluster.root_certs.clone();
        config.accept_invalid_certs = cluster.insecure_skip_tls_verify;
        config.tls_server_name = cluster.tls_server_name.clone();
        config.auth_info = AuthInfo {
            token: user.token.map(Into::into),
            username: user.username,
            password: user.password.map(Into::into),
            client_certificate_data: user.client_certificate_data,
            client_key_data: user.client_key_data.map(Into::into),
            ..AuthInfo::default()
        };
        Ok(config)
    }
}

/// Checks a tenant-writable kubeconfig and builds its client `Config`.
pub fn config_from_untrusted(text: &str) -> Checked<kube::Config> {
    UntrustedKubeconfig::parse(text)?.config()
}

/// The field's path, with a key the tenant chose shown only when it looks like a field name.
fn join(path: &str, key: &str) -> String {
    let plain = key.len() <= 64 && key.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    let key = if plain {
        key.to_string()
    } else {
        "<a key that is not a field name>".to_string()
    };
    if path.is_empty() { key } else { format!("{path}.{key}") }
}

fn mapping<'a>(value: &'a Value, path: &str) -> Checked<&'a Map<String, Value>> {
    static EMPTY: LazyLock<Map<String, Value>> = LazyLock::new(Map::new);
    match value {
        Value::Object(map) => Ok(map),
        Value::Null => Ok(&EMPTY),
        _ => Err(invalid(path, "a mapping")),
    }
}

fn only_allowed(map: &Map<String, Value>, path: &str, allowed: &[&str]) -> Checked<()> {
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(UntrustedKubeconfigError::Refused { field: join(path, key) }),
        None => Ok(()),
    }
}

fn list<'a>(map: &'a Map<String, Value>, key: &str) -> Checked<&'a [Value]> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(invalid(key, "a list")),
    }
}

fn string(map: &Map<String, Value>, path: &str, key: &str) -> Checked<Option<String>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(_) => Err(invalid(join(path, key), "a string")),
    }
}

fn boolean(map: &Map<String, Value>, path: &str, key: &str) -> Checked<bool> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(_) => Err(invalid(join(path, key), "true or false")),
    }
}

/// `{name, <body key>}` of a list entry.
fn named<'a>(entry: &'a Value, path: &str, body_key: &str) -> Checked<(String, &'a Value)> {
    let map = mapping(entry, path)?;
    if let Some(key) = map.keys().find(|k| k.as_str() != "name" && k.as_str() != body_key) {
        return Err(UntrustedKubeconfigError::Refused { field: join(path, key) });
    }
    let name = string(map, path, "name")?.ok_or_else(|| invalid(join(path, "name"), "set"))?;
    Ok((name, map.get(body_key).unwrap_or(&Value::Null)))
}

fn cluster(body: &Value, path: &str) -> Checked<AllowedCluster> {
    let map = mapping(body, path)?;
    only_allowed(map, path, CLUSTER_FIELDS)?;
    let server = match string(map, path, "server")? {
        None => None,
        Some(text) => Some(server_url(&text).ok_or_else(|| {
            invalid(
                join(path, "server"),
                "an http or https URL with a host (https://api.example.com:6443)",
            )
        })?),
    };
    let root_certs = match string(map, path, "certificate-authority-data")? {
        None => None,
        Some(data) => Some(certificates(&data).ok_or_else(|| {
            invalid(
                join(path, "certificate-authority-data"),
                "base64 of one or more PEM certificates",
            )
        })?),
    };
    boolean(map, path, "disable-compression")?;
    Ok(AllowedCluster {
        server,
        root_certs,
        tls_server_name: string(map, path, "tls-server-name")?,
        insecure_skip_tls_verify: boolean(map, path, "insecure-skip-tls-verify")?,
    })
}

fn server_url(text: &str) -> Option<http::Uri> {
    let uri: http::Uri = text.parse().ok()?;
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let host_ok = uri.host().is_some_and(|h| !h.is_empty());
    (scheme_ok && host_ok).then_some(uri)
}

fn decode(data: &str) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD.decode(data.trim()).ok()
}

/// DER certificates from base64 of PEM.
fn certificates(data: &str) -> Option<Vec<Vec<u8>>> {
    let pem = decode(data)?;
    let certs: Vec<Vec<u8>> = CertificateDer::pem_slice_iter(&pem)
        .map(|cert| cert.ok().map(|c| c.to_vec()))
        .collect::<Option<_>>()?;
    (!certs.is_empty()).then_some(certs)
}

fn user(body: &Value, path: &str) -> Checked<AllowedUser> {
    let map = mapping(body, path)?;
    only_allowed(map, path, USER_FIELDS)?;
    // Checked here so that kube never reports (and quotes) bad key material later.
    let pem = |key: &str, valid: fn(&[u8]) -> bool, expected: &'static str| -> Checked<Option<String>> {
        match string(map, path, key)? {
            None => Ok(None),
            Some(data) => match decode(&data) {
                Some(bytes) if valid(&bytes) => Ok(Some(data.trim().to_string())),
                _ => Err(invalid(join(path, key), expected)),
            },
        }
    };
    let client_certificate_data = pem(
        "client-certificate-data",
        |bytes| CertificateDer::pem_slice_iter(bytes).next().is_some_and(|c| c.is_ok()),
        "base64 of a PEM certificate",
    )?;
    let client_key_data = pem(
        "client-key-data",
        |bytes| PrivateKeyDer::from_pem_slice(bytes).is_ok(),
        "base64 of a PEM private key",
    )?;
    if client_certificate_data.is_some() != client_key_data.is_some() {
        let missing = if client_key_data.is_none() {
            "client-key-data"
        } else {
            "client-certificate-data"
        };
        return Err(invalid(
            join(path, missing),
            "set together with the other half of the client identity",
        ));
    }
    let username = string(map, path, "username")?;
    let password = string(map, path, "password")?;
    if username.is_some() != password.is_some() {
        let missing = if password.is_none() { "password" } else { "username" };
        return Err(invalid(
            join(path, missing),
            "set together with the other half of basic auth",
        ));
    }
    Ok(AllowedUser {
        token: string(map, path, "token")?,
        client_certificate_data,
        client_key_data,
        username,
        password,
    })
}

fn context(body: &Value, path: &str) -> Checked<AllowedContext> {
    let map = mapping(body, path)?;
    only_allowed(map, path, CONTEXT_FIELDS)?;
    Ok(AllowedContext {
        cluster: string(map, path, "cluster")?.ok_or_else(|| invalid(join(path, "cluster"), "set"))?,
        user: string(map, path, "user")?,
        namespace: string(map, path, "namespace")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "s3cr3t-t0k3n-value";

    fn b64(text: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(text)
    }

    /// A kubeconfig with one cluster, user and context; `user` and `cluster` are extra YAML lines
    /// (indented 4) added to their entries.
    fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\npreferences: {{}}\ncurrent-context: admin\n\
             clusters:\n- name: c\n  cluster:\n    server: https://api.example.com:6443\n{cluster}\
             users:\n- name: u\n  user:\n    token: {TOKEN}\n{user}\
             contexts:\n- name: admin\n  context:\n    cluster: c\n    user: u\n    namespace: team\n"
        )
    }

    fn refused_field(text: &str) -> String {
        match UntrustedKubeconfig::parse(text) {
            Err(err @ UntrustedKubeconfigError::Refused { .. }) => {
                let message = err.to_string();
                assert!(!message.contains(TOKEN), "{message}");
                err.field().unwrap_or_default().to_string()
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn inline_server_token_and_ca_data_make_a_config() {
        let ca = rcgen::generate_simple_self_signed(vec!["api.example.com".to_string()]).unwrap();
        let text = kubeconfig(
            &format!(
                "    certificate-authority-data: {}\n    tls-server-name: api.internal\n",
                b64(&ca.cert.pem())
            ),
            "",
        );
        let config = config_from_untrusted(&text).unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://api.example.com:6443/");
        assert_eq!(config.default_namespace, "team");
        assert_eq!(config.root_cert, Some(vec![ca.cert.der().to_vec()]));
        assert_eq!(config.tls_server_name.as_deref(), Some("api.internal"));
        assert!(!config.accept_invalid_certs);
        let auth = &config.auth_info;
        assert!(auth.token.is_some());
        assert!(auth.exec.is_none() && auth.auth_provider.is_none() && auth.token_file.is_none());
        assert!(config.proxy_url.is_none());
    }

    #[test]
    fn a_client_certificate_inline_is_accepted_and_one_half_alone_is_not() {
        let identity = rcgen::generate_simple_self_signed(vec!["admin".to_string()]).unwrap();
        let cert = b64(&identity.cert.pem());
        let key = b64(&identity.signing_key.serialize_pem());
        let text = kubeconfig(
            "",
            &format!("    client-certificate-data: {cert}\n    client-key-data: {key}\n"),
        );
        let config = config_from_untrusted(&text).unwrap();
        assert_eq!(config.auth_info.client_certificate_data.as_deref(), Some(cert.as_str()));
        assert!(config.auth_info.client_key_data.is_some());

        let half = kubeconfig("", &format!("    client-certificate-data: {cert}\n"));
        let err = UntrustedKubeconfig::parse(&half).unwrap_err();
        assert_eq!(err.field(), Some("users[0].user.client-key-data"));
    }

    #[test]
    fn the_embedded_servers_own_kubeconfig_is_accepted() {
        let text = "apiVersion: v1\nkind: Config\nclusters:\n- name: m\n  cluster:\n    server: http://127.0.0.1:4321\n\
                    users:\n- name: m\n  user: {}\ncontexts:\n- name: m\n  context:\n    cluster: m\n    user: m\n\
                    current-context: m\n";
        let config = config_from_untrusted(text).unwrap();
        assert_eq!(config.cluster_url.to_string(), "http://127.0.0.1:4321/");
        assert!(config.auth_info.token.is_none());
    }

    #[test]
    fn code_execution_files_proxies_and_impersonation_are_refused_by_path() {
        let user_cases = [
            (
                "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n",
                "exec",
            ),
            (
                "    auth-provider:\n      name: gcp\n      config: {cmd-path: /bin/sh}\n",
                "auth-provider",
            ),
            (
                "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
                "tokenFile",
            ),
            ("    token-file: /etc/shadow\n", "token-file"),
            ("    client-certificate: /etc/stackd/host.crt\n", "client-certificate"),
            ("    client-key: /etc/stackd/host.key\n", "client-key"),
            ("    as: system:admin\n", "as"),
            ("    as-groups: [system:masters]\n", "as-groups"),
            ("    as-uid: \"0\"\n", "as-uid"),
            ("    as-user-extra: {scopes: [all]}\n", "as-user-extra"),
            ("    color: blue\n", "color"),
        ];
        for (line, field) in user_cases {
            assert_eq!(refused_field(&kubeconfig("", line)), format!("users[0].user.{field}"));
        }
        let cluster_cases = [
            ("    certificate-authority: /etc/ssl/ca.crt\n", "certificate-authority"),
            ("    proxy-url: http://attacker.example.com:3128\n", "proxy-url"),
            ("    colour: red\n", "colour"),
        ];
        for (line, field) in cluster_cases {
            assert_eq!(
                refused_field(&kubeconfig(line, "")),
                format!("clusters[0].cluster.{field}")
            );
        }
    }

    #[test]
    fn a_refused_field_in_an_unused_entry_is_refused_too() {
        let two_users = kubeconfig("", "- name: other\n  user:\n    exec: {command: /bin/sh}\n");
        assert_eq!(refused_field(&two_users), "users[1].user.exec");
    }

    #[test]
    fn unknown_keys_at_every_level_are_refused() {
        let top = format!("{}extra: 1\n", kubeconfig("", ""));
        assert_eq!(refused_field(&top), "extra");
        let entry = kubeconfig("", "").replace("- name: u\n", "- name: u\n  extra: 1\n");
        assert_eq!(refused_field(&entry), "users[0].extra");
        let context = kubeconfig("", "").replace("    namespace: team\n", "    namespace: team\n    extra: 1\n");
        assert_eq!(refused_field(&context), "contexts[0].context.extra");
        let odd_key = kubeconfig("", &format!("    \"{TOKEN} with spaces\": x\n"));
        let field = refused_field(&odd_key);
        assert!(field.starts_with("users[0].user."), "{field}");
        assert!(!field.contains(TOKEN), "{field}");
    }

    #[test]
    fn invalid_values_are_named_without_their_content() {
        let cases = [
            (kubeconfig("", "    username: admin\n"), "users[0].user.password"),
            (
                kubeconfig(
                    "",
                    &format!("    client-key-data: {TOKEN}\n    client-certificate-data: {TOKEN}\n"),
                ),
                "users[0].user.client-certificate-data",
            ),
            (
                kubeconfig(&format!("    certificate-authority-data: {TOKEN}\n"), ""),
                "clusters[0].cluster.certificate-authority-data",
            ),
            (
                kubeconfig("", "").replace("https://api.example.com:6443", &format!("file:///{TOKEN}")),
                "clusters[0].cluster.server",
            ),
            (
                kubeconfig("", "").replace(&format!("token: {TOKEN}"), &format!("token: [{TOKEN}]")),
                "users[0].user.token",
            ),
            (
                kubeconfig("    insecure-skip-tls-verify: yes-please\n", ""),
                "clusters[0].cluster.insecure-skip-tls-verify",
            ),
        ];
        for (text, field) in cases {
            let err = UntrustedKubeconfig::parse(&text).unwrap_err();
            let message = err.to_string();
            assert!(!message.contains(TOKEN), "{message}");
            assert_eq!(err.field(), Some(field), "{message}");
        }
    }

    #[test]
    fn a_config_needs_its_current_context_and_cluster() {
        let no_current = kubeconfig("", "").replace("current-context: admin\n", "");
        let err = config_from_untrusted(&no_current).unwrap_err();
        assert_eq!(err.field(), Some("current-context"));
        let unknown_cluster = kubeconfig("", "").replace("    cluster: c\n", "    cluster: elsewhere\n");
        assert!(config_from_untrusted(&unknown_cluster).is_err());
    }

    #[test]
    fn insecure_skip_tls_verify_is_accepted() {
        let text = kubeconfig("    insecure-skip-tls-verify: true\n", "");
        assert!(config_from_untrusted(&text).unwrap().accept_invalid_certs);
    }

    #[test]
    fn malformed_yaml_reports_a_line_and_never_the_token() {
        let text = kubeconfig("", "").replace(&format!("token: {TOKEN}"), &format!("token: \"{TOKEN}\n  ]: ["));
        let err = UntrustedKubeconfig::parse(&text).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, UntrustedKubeconfigError::Syntax(_)), "{message}");
        assert!(message.contains("line"), "{message}");
        assert!(!message.contains(TOKEN), "{message}");
        assert!(!format!("{err:?}").contains(TOKEN));
    }
}
