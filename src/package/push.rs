//! `stackd package push`: an archive `build` wrote, pushed to an OCI registry as it is (the same
//! manifest bytes, so the same digest), with the credentials of a docker config file. The
//! distribution protocol, including the bearer token flow a registry asks for, is `oci-client`'s.
//! Plain HTTP only to a registry on loopback.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use serde::Deserialize;

use super::build::{self, Image, MANIFEST_MEDIA_TYPE};

/// What `push` needs.
#[derive(Clone, Debug)]
pub struct PushOptions {
    /// The archive `stackd package build` wrote.
    pub archive: PathBuf,
    /// Where to push: `registry/repository:tag`.
    pub image: String,
    /// The docker config file with the registry's credentials; `~/.docker/config.json` when not
    /// given (no file: anonymous).
    pub registry_config: Option<PathBuf>,
    /// Speak plain HTTP (only to a registry on loopback).
    pub plain_http: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("{0:?} is not an image reference: name it as registry.example.com/org/name:tag")]
    Reference(String),
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Archive(#[from] build::BuildError),
    #[error("{path} is not a docker config file: {message}")]
    Config { path: PathBuf, message: String },
    #[error(
        "--plain-http sends the package and the credentials unencrypted: it is allowed only for a registry on loopback (localhost, 127.0.0.1, [::1]), not {0}"
    )]
    PlainHttpRemote(String),
    #[error("the registry {registry} refused the push: {message}")]
    Registry { registry: String, message: String },
}

/// A docker config file: what `docker login` writes.
#[derive(Deserialize, Default)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize, Default)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    /// A bearer token the registry accepts as it is.
    registrytoken: Option<String>,
}

/// The host part of a docker config `auths` key (`https://host/v1/` or `host`).
fn auth_key_host(key: &str) -> &str {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    key.split('/').next().unwrap_or(key)
}

/// The credentials for `registry` in the docker config at `path` (anonymous when it has none).
fn credentials(path: &Path, registry: &str, must_exist: bool) -> Result<RegistryAuth, PushError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound && !must_exist => return Ok(RegistryAuth::Anonymous),
        Err(source) => {
            return Err(PushError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let invalid = |message: String| PushError::Config {
        path: path.to_path_buf(),
        message,
    };
    let config: DockerConfig = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    // Docker Hub's credentials are kept under its index's address.
    let wanted = if registry == "docker.io" {
        "index.docker.io"
    } else {
        registry
    };
    let Some(entry) = config
        .auths
        .iter()
        .find(|(key, _)| auth_key_host(key) == wanted)
        .map(|(_, entry)| entry)
    else {
        return Ok(RegistryAuth::Anonymous);
    };
    if let Some(token) = entry.registrytoken.as_ref().filter(|t| !t.is_empty()) {
        return Ok(RegistryAuth::Bearer(token.clone()));
    }
    if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
        return Ok(RegistryAuth::Basic(user.clone(), password.clone()));
    }
    let Some(encoded) = entry.auth.as_ref().filter(|a| !a.is_empty()) else {
        return Ok(RegistryAuth::Anonymous);
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| invalid(format!("the auth of {registry} is not base64 of user:password")))?;
    let (user, password) = decoded
        .split_once(':')
        .ok_or_else(|| invalid(format!("the auth of {registry} is not base64 of user:password")))?;
    Ok(RegistryAuth::Basic(user.to_string(), password.to_string()))
}

/// True when `registry` (`host[:port]`) is on loopback.
fn on_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(host, _)| host),
    };
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A client for `registry`, speaking plain HTTP to it when allowed and asked for.
pub fn client(registry: &str, plain_http: bool) -> Result<Client, PushError> {
    if plain_http && !on_loopback(registry) {
        return Err(PushError::PlainHttpRemote(registry.to_string()));
    }
    // oci-client leaves the crypto provider to us: ring, as the rest of stackd (already installed
    // is fine).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let protocol = if plain_http {
        ClientProtocol::HttpsExcept(vec![registry.to_string()])
    } else {
        ClientProtocol::Https
    };
    Ok(Client::new(ClientConfig {
        protocol,
        ..ClientConfig::default()
    }))
}

/// The docker config `push` reads by default.
fn default_config() -> PathBuf {
    std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker")))
        .unwrap_or_default()
        .join("config.json")
}

/// The image reference and credentials `options` name.
pub fn target(options: &PushOptions) -> Result<(Reference, RegistryAuth), PushError> {
    let reference: Reference = options
        .image
        .parse()
        .map_err(|_| PushError::Reference(options.image.clone()))?;
    let auth = match &options.registry_config {
        Some(path) => credentials(path, reference.resolve_registry(), true)?,
        None => credentials(&default_config(), reference.resolve_registry(), false)?,
    };
    Ok((reference, auth))
}

/// The registry's answer, with what to do about the usual ones.
fn with_hint(message: String, registry: &str, plain_http: bool) -> String {
    let hint = if ["401", "403", "UNAUTHORIZED", "DENIED"]
        .iter()
        .any(|m| message.contains(m))
    {
        "; give the registry's credentials in a docker config file (--registry-config, default ~/.docker/config.json), e.g. with `docker login`"
    } else if !plain_http && on_loopback(registry) && message.contains("error sending request") {
        "; a registry on loopback that speaks plain HTTP needs --plain-http"
    } else {
        ""
    };
    format!("{message}{hint}")
}

/// Pushes the archive's image; its digest.
pub async fn push(options: &PushOptions) -> Result<String, PushError> {
    let bytes = std::fs::read(&options.archive).map_err(|source| PushError::Read {
        path: options.archive.clone(),
        source,
    })?;
    let image: Image = build::read_archive(&bytes)?;
    let (reference, auth) = target(options)?;
    let registry = reference.resolve_registry().to_string();
    let client = client(&registry, options.plain_http)?;
    let refused = |err: oci_client::errors::OciDistributionError| PushError::Registry {
        registry: registry.clone(),
        message: with_hint(err.to_string(), &registry, options.plain_http),
    };
    client
        .auth(&reference, &auth, RegistryOperation::Push)
        .await
        .map_err(refused)?;
    for blob in [&image.layer, &image.config] {
        client
            .push_blob(&reference, blob.clone(), &build::digest(blob))
            .await
            .map_err(refused)?;
    }
    // The manifest as built, byte for byte: its digest is the one `build` printed.
    let content_type = http::HeaderValue::from_static(MANIFEST_MEDIA_TYPE);
    client
        .push_manifest_raw(&reference, image.manifest.clone(), content_type)
        .await
        .map_err(refused)?;
    Ok(image.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_read_as_docker_writes_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("config.json");
        let basic = base64::engine::general_purpose::STANDARD.encode("ann:secret");
        std::fs::write(
            &path,
            format!(
                r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{basic}"}},
                    "registry.example.com": {{"registrytoken": "tok"}},
                    "127.0.0.1:5000": {{"username": "bob", "password": "pw"}}}}}}"#
            ),
        )
        .expect("write");
        let found = |registry: &str| credentials(&path, registry, true).expect("read");
        assert_eq!(found("docker.io"), RegistryAuth::Basic("ann".into(), "secret".into()));
        assert_eq!(found("registry.example.com"), RegistryAuth::Bearer("tok".into()));
        assert_eq!(found("127.0.0.1:5000"), RegistryAuth::Basic("bob".into(), "pw".into()));
        assert_eq!(found("quay.io"), RegistryAuth::Anonymous);
        assert!(credentials(&dir.path().join("none.json"), "quay.io", true).is_err());
        assert!(credentials(&dir.path().join("none.json"), "quay.io", false).is_ok());
    }

    #[test]
    fn plain_http_goes_to_loopback_only() {
        for registry in ["localhost:5000", "127.0.0.1:5000", "[::1]:5000", "localhost"] {
            assert!(on_loopback(registry), "{registry}");
        }
        for registry in ["registry.example.com", "10.0.0.1:5000", "localhost.example.com:5000"] {
            assert!(!on_loopback(registry), "{registry}");
        }
        assert!(matches!(
            client("registry.example.com", true),
            Err(PushError::PlainHttpRemote(_))
        ));
    }
}
