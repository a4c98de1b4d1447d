//! Where host pods reach a tenant's API server (DESIGN.md §1 "Tenant endpoint for host pods").
//!
//! The address in a tenant kubeconfig is how the daemon reaches the tenant; pods on the host may need
//! another one (an in-cluster Service), given by the cluster extension `stackd.dev/in-cluster-server`.

use http::Uri;
use kube::config::Kubeconfig;
use serde_json::Value;

/// Name of the kubeconfig cluster extension that overrides the endpoint for host pods.
pub const IN_CLUSTER_SERVER_EXTENSION: &str = "stackd.dev/in-cluster-server";

/// The tenant API endpoint given to host pods as `KUBERNETES_SERVICE_HOST`/`_PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantEndpoint {
    /// Host name or IP address (IPv6 without brackets, as `KUBERNETES_SERVICE_HOST` expects).
    pub host: String,
    pub port: u16,
    /// Whether the endpoint speaks https; in-cluster clients speak nothing else.
    pub https: bool,
    /// Where the endpoint came from, for messages.
    pub source: EndpointSource,
}

/// Which part of the kubeconfig named the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointSource {
    ServerUrl,
    InClusterExtension,
}

/// Why no usable endpoint could be derived.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("the kubeconfig has no current context, or its context names no cluster")]
    NoCluster,
    #[error("cluster {0:?} has no server URL")]
    NoServer(String),
    #[error("extension {IN_CLUSTER_SERVER_EXTENSION} must be a URL string or {{server: URL}}, found {0}")]
    BadExtension(String),
    #[error("{url:?} is not a URL with a scheme and host: {reason}")]
    BadUrl { url: String, reason: String },
    #[error(
        "{url:?} has the path {path:?}: in-cluster clients cannot use a path prefix; point {IN_CLUSTER_SERVER_EXTENSION} at an address serving the API at /"
    )]
    PathPrefix { url: String, path: String },
    #[error(
        "the tenant endpoint {host}:{port} is not https; in-cluster clients only speak https. Serve the tenant API over https (set {IN_CLUSTER_SERVER_EXTENSION}), or run with --allow-insecure-tenant-endpoint for local development"
    )]
    NotHttps { host: String, port: u16 },
}

impl TenantEndpoint {
    /// Derives the endpoint from a tenant kubeconfig: the in-cluster extension if present, else the
    /// server URL of the current context's cluster.
    pub fn from_kubeconfig(kubeconfig: &Kubeconfig) -> Result<Self, EndpointError> {
        let cluster_name = kubeconfig
            .current_context
            .as_deref()
            .and_then(|current| kubeconfig.contexts.iter().find(|c| c.name == current))
            .and_then(|c| c.context.as_ref())
            .map(|c| c.cluster.clone())
            .ok_or(EndpointError::NoCluster)?;
        let cluster = kubeconfig
            .clusters
            .iter()
            .find(|c| c.name == cluster_name)
            .and_then(|c| c.cluster.as_ref())
            .ok_or(EndpointError::NoCluster)?;
        let extension = cluster
            .extensions
            .iter()
            .flatten()
            .find(|e| e.name == IN_CLUSTER_SERVER_EXTENSION);
        match extension {
            Some(extension) => Self::parse(
                &extension_url(&extension.extension)?,
                EndpointSource::InClusterExtension,
            ),
            None => {
                let server = cluster
                    .server
                    .as_deref()
                    .ok_or_else(|| EndpointError::NoServer(cluster_name.clone()))?;
                Self::parse(server, EndpointSource::ServerUrl)
            }
        }
    }

    /// Parses an endpoint URL; the port defaults to the scheme's (443 for https).
    pub fn parse(url: &str, source: EndpointSource) -> Result<Self, EndpointError> {
        let bad = |reason: &str| EndpointError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            Some(other) => return Err(bad(&format!("scheme {other:?} is neither https nor http"))),
            None => return Err(bad("no scheme")),
        };
        let host = uri.host().filter(|h| !h.is_empty()).ok_or_else(|| bad("no host"))?;
        let path = uri.path();
        if !(path.is_empty() || path == "/") || uri.query().is_some() {
            return Err(EndpointError::PathPrefix {
                url: url.to_string(),
                path: path.to_string(),
            });
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        Ok(TenantEndpoint {
            host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
            port,
            https,
            source,
        })
    }

    /// Refuses plain http unless `allow_insecure` (only `stackd dev` sets it).
    pub fn check_usable_by_pods(&self, allow_insecure: bool) -> Result<(), EndpointError> {
        if self.https || allow_insecure {
            Ok(())
        } else {
            Err(EndpointError::NotHttps {
                host: self.host.clone(),
                port: self.port,
            })
        }
    }
}

/// The extension's value: a URL string, or an object with a `server` URL.
fn extension_url(value: &Value) -> Result<String, EndpointError> {
    match value {
        Value::String(url) => Ok(url.clone()),
        Value::Object(map) => match map.get("server") {
            Some(Value::String(url)) => Ok(url.clone()),
            _ => Err(EndpointError::BadExtension(value.to_string())),
        },
        _ => Err(EndpointError::BadExtension(value.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubeconfig(cluster: &str) -> Kubeconfig {
        let yaml = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\ncontexts:\n- name: t\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user:\n    token: x\nclusters:\n- name: c\n  cluster:\n{cluster}"
        );
        Kubeconfig::from_yaml(&yaml).expect("test kubeconfig parses")
    }

    #[test]
    fn server_url_gives_host_and_port() {
        let endpoint =
            TenantEndpoint::from_kubeconfig(&kubeconfig("    server: https://api.t.example:6443\n")).expect("endpoint");
        assert_eq!(
            (endpoint.host.as_str(), endpoint.port, endpoint.https),
            ("api.t.example", 6443, true)
        );
        assert_eq!(endpoint.source, EndpointSource::ServerUrl);
    }

    #[test]
    fn https_port_defaults_to_443() {
        let endpoint = TenantEndpoint::parse("https://api.t.example", EndpointSource::ServerUrl).expect("endpoint");
        assert_eq!(endpoint.port, 443);
    }

    #[test]
    fn in_cluster_extension_wins_as_string_or_object() {
        for value in ["https://t-api.t.svc:443", "{server: https://t-api.t.svc:443}"] {
            let cluster = format!(
                "    server: https://outside:6443\n    extensions:\n    - name: stackd.dev/in-cluster-server\n      extension: {value}\n"
            );
            let endpoint = TenantEndpoint::from_kubeconfig(&kubeconfig(&cluster)).expect("endpoint");
            assert_eq!((endpoint.host.as_str(), endpoint.port), ("t-api.t.svc", 443), "{value}");
            assert_eq!(endpoint.source, EndpointSource::InClusterExtension);
        }
    }

    #[test]
    fn malformed_extension_is_an_error() {
        let cluster = "    server: https://outside\n    extensions:\n    - name: stackd.dev/in-cluster-server\n      extension: {url: 1}\n";
        assert!(matches!(
            TenantEndpoint::from_kubeconfig(&kubeconfig(cluster)),
            Err(EndpointError::BadExtension(_))
        ));
    }

    #[test]
    fn path_prefix_is_refused_with_a_clear_error() {
        let err =
            TenantEndpoint::parse("https://proxy.example/k8s/clusters/t", EndpointSource::ServerUrl).expect_err("path");
        assert!(matches!(err, EndpointError::PathPrefix { .. }));
        assert!(err.to_string().contains("path prefix"));
        assert!(TenantEndpoint::parse("https://proxy.example/", EndpointSource::ServerUrl).is_ok());
    }

    #[test]
    fn plain_http_is_refused_unless_allowed() {
        let endpoint = TenantEndpoint::parse("http://127.0.0.1:8080", EndpointSource::ServerUrl).expect("endpoint");
        assert!(!endpoint.https);
        let err = endpoint.check_usable_by_pods(false).expect_err("insecure");
        assert!(err.to_string().contains("--allow-insecure-tenant-endpoint"));
        assert!(endpoint.check_usable_by_pods(true).is_ok());
    }

    #[test]
    fn ipv6_hosts_lose_their_brackets() {
        let endpoint = TenantEndpoint::parse("https://[fd00::1]:6443", EndpointSource::ServerUrl).expect("endpoint");
        assert_eq!(endpoint.host, "fd00::1");
    }

    #[test]
    fn missing_context_or_server_is_reported() {
        let mut config = kubeconfig("    server: https://x\n");
        config.current_context = None;
        assert_eq!(TenantEndpoint::from_kubeconfig(&config), Err(EndpointError::NoCluster));
        assert!(matches!(
            TenantEndpoint::from_kubeconfig(&kubeconfig("    insecure-skip-tls-verify: true\n")),
            Err(EndpointError::NoServer(_))
        ));
        assert!(TenantEndpoint::parse("ftp://x", EndpointSource::ServerUrl).is_err());
    }
}
