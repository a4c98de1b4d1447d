//! `stackd package push` to a registry that wants a bearer token (issue 49): the CNCF distribution
//! registry with `auth: token`, and a token server of the test's own that signs the registry's JWTs
//! (ES256, the key named by its libtrust key id, as Docker's token servers do) for the user who
//! gave the right password. The push takes the credentials from a docker config file, as for basic
//! auth; the token flow is the client's.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::package::{LocalRegistry, PUSHER, build, init, stackd, text};

const ISSUER: &str = "stackd-test-token-issuer";
const SERVICE: &str = "stackd-test-registry";

/// A token server on a free loopback port: `GET /token?service=…&scope=…` with the pusher's basic
/// credentials answers a JWT granting the scopes asked for; anything else is refused.
struct TokenServer {
    address: SocketAddr,
    /// The certificate of the signing key, the registry's `rootcertbundle`.
    certificate_pem: String,
    _serve: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Signer {
    pkcs8: Vec<u8>,
    key_id: String,
}

impl TokenServer {
    async fn start() -> TokenServer {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let params = rcgen::CertificateParams::new(vec!["token.stackd.test".to_string()]).expect("params");
        let certificate = params.self_signed(&key).expect("certificate");
        let signer = Signer {
            pkcs8: key.serialize_der(),
            key_id: libtrust_key_id(&rcgen::PublicKeyData::subject_public_key_info(&key)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let address = listener.local_addr().expect("address");
        let app = axum::Router::new()
            .route("/token", axum::routing::get(token))
            .with_state(signer);
        let serve = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        TokenServer {
            address,
            certificate_pem: certificate.pem(),
            _serve: serve,
        }
    }

    fn realm(&self) -> String {
        format!("http://{}/token", self.address)
    }
}

/// The key id the distribution registry gives a trusted key (libtrust's): the first 240 bits of
/// the SHA-256 of its DER public key, base32, in groups of four.
fn libtrust_key_id(public_key_der: &[u8]) -> String {
    let digest = Sha256::digest(public_key_der);
    let encoded = base32(&digest[..30]);
    let groups: Vec<&str> = (0..encoded.len())
        .step_by(4)
        .map(|i| &encoded[i..(i + 4).min(encoded.len())])
        .collect();
    groups.join(":")
}

/// RFC 4648 base32 without padding (30 bytes make 48 characters).
fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let (mut out, mut buffer, mut bits) = (String::new(), 0u32, 0);
    for byte in bytes {
        buffer = (buffer << 8) | u32::from(*byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(char::from(ALPHABET[((buffer >> bits) & 31) as usize]));
        }
    }
    if bits > 0 {
        out.push(char::from(ALPHABET[((buffer << (5 - bits)) & 31) as usize]));
    }
    out
}

#[derive(serde::Deserialize)]
struct TokenQuery {
    service: Option<String>,
    scope: Option<String>,
}

async fn token(State(signer): State<Signer>, Query(query): Query<TokenQuery>, headers: HeaderMap) -> Response {
    let expected = format!("Basic {}", STANDARD.encode(format!("{}:{}", PUSHER.0, PUSHER.1)));
    let authorized = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == expected);
    if !authorized || query.service.as_deref() != Some(SERVICE) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    // `repository:team/my-stack:pull,push`, one per scope parameter the client sent.
    let access: Vec<Value> = query
        .scope
        .iter()
        .filter_map(|scope| {
            let mut parts = scope.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
        })
        .collect();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("time").as_secs();
    let header = json!({"typ": "JWT", "alg": "ES256", "kid": signer.key_id});
    let claims = json!({
        "iss": ISSUER, "sub": PUSHER.0, "aud": SERVICE,
        "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("{now}"),
        "access": access,
    });
    let signed = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let rng = ring::rand::SystemRandom::new();
    let key = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &signer.pkcs8,
        &rng,
    )
    .expect("signing key");
    let signature = key.sign(&rng, signed.as_bytes()).expect("sign");
    let jwt = format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()));
    axum::Json(json!({"token": jwt, "access_token": jwt, "expires_in": 300})).into_response()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_is_pushed_to_a_registry_that_wants_a_bearer_token() {
    let tokens = TokenServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let bundle = dir.path().join("token.pem");
    std::fs::write(&bundle, &tokens.certificate_pem).expect("bundle");
    let auth = format!(
        "auth:\n  token:\n    realm: {}\n    service: {SERVICE}\n    issuer: {ISSUER}\n    rootcertbundle: {}\n",
        tokens.realm(),
        bundle.display()
    );
    let registry = LocalRegistry::start_with(&auth, &format!("realm=\"{}\"", tokens.realm())).await;

    let package = dir.path().join("my-stack");
    init(&package, &[]);
    let image = format!("{}/team/my-stack:v0.1.0", registry.address);
    let archive = dir.path().join("my-stack.oci.tar");
    let path = |p: &std::path::Path| p.to_str().expect("utf-8").to_string();
    let out = build(&package, &image, &archive);
    assert!(out.status.success(), "build: {}", text(&out.stderr));
    let digest = text(&out.stdout)
        .trim_end()
        .rsplit('@')
        .next()
        .expect("digest")
        .to_string();
    let push = |password: &str| {
        let config = dir.path().join(format!("config-{password}.json"));
        let basic = STANDARD.encode(format!("{}:{password}", PUSHER.0));
        let auths = json!({"auths": {registry.address.clone(): {"auth": basic}}});
        std::fs::write(&config, auths.to_string()).expect("config");
        stackd(&[
            "package",
            "push",
            &path(&archive),
            &image,
            "--registry-config",
            &path(&config),
            "--plain-http",
        ])
    };

    // A wrong password gets no token, and the push says so without the password.
    let out = push("wrong-password");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(!text(&out.stderr).contains("wrong-password"), "{}", text(&out.stderr));

    let out = push(PUSHER.1);
    assert!(out.status.success(), "push: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim_end(), format!("{image}@{digest}"));

    // Pulled back through the same token flow: the manifest the push stored.
    let client = stackd::package::push::client(&registry.address, true).expect("client");
    let reference: oci_client::Reference = image.parse().expect("reference");
    let auth = oci_client::secrets::RegistryAuth::Basic(PUSHER.0.into(), PUSHER.1.into());
    let (_, pulled) = tokio::time::timeout(
        Duration::from_secs(30),
        client.pull_manifest_raw(&reference, &auth, &[stackd::package::build::MANIFEST_MEDIA_TYPE]),
    )
    .await
    .expect("pulled in time")
    .expect("pull the manifest");
    assert_eq!(pulled, digest);
}
