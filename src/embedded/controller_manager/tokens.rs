//! The token controller: a Secret of type `kubernetes.io/service-account-token` annotated with an
//! existing ServiceAccount's name gets `token`, `ca.crt`, `namespace` and the account's uid; one whose
//! ServiceAccount is missing (or was recreated with another uid) is deleted. Tokens this controller
//! minted are valid bearer tokens on this server for as long as their Secret exists; a token written
//! into a Secret by a client is never accepted (on a real server its signature would not verify).

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use rand::RngExt;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{is_deleting, modify, run_loop, text};
use crate::embedded::discovery::ResourceTable;
use crate::embedded::store::{GroupResource, Store};
use crate::embedded::verbs::{self, DeleteOptions};

pub const TOKEN_SECRET_TYPE: &str = "kubernetes.io/service-account-token";
pub const SERVICE_ACCOUNT_NAME: &str = "kubernetes.io/service-account.name";
pub const SERVICE_ACCOUNT_UID: &str = "kubernetes.io/service-account.uid";

/// `ca.crt` of servers without TLS: clients of such a server never verify it.
pub const PLACEHOLDER_CA: &str =
    "-----BEGIN CERTIFICATE-----\nc3RhY2tkIGVtYmVkZGVkIEFQSSBzZXJ2ZXIgd2l0aG91dCBUTFM=\n-----END CERTIFICATE-----\n";

const RESCAN: Duration = Duration::from_millis(500);

/// Bearer tokens of filled token Secrets, accepted besides the server's own token.
#[derive(Default)]
pub struct TokenRegistry {
    tokens: RwLock<HashSet<String>>,
    minted: RwLock<HashSet<String>>,
}

impl TokenRegistry {
    pub fn contains(&self, token: &str) -> bool {
        self.tokens
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(token)
    }

    fn replace(&self, tokens: HashSet<String>) {
        *self.tokens.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = tokens;
    }

    fn minted(&self, token: &str) -> bool {
        self.minted
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(token)
    }

    fn mint(&self, token: &str) {
        self.minted
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(token.to_string());
    }
}

pub async fn run(
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
    registry: Arc<TokenRegistry>,
    ca_pem: Option<String>,
    shutdown: CancellationToken,
) {
    let ca = ca_pem.unwrap_or_else(|| PLACEHOLDER_CA.to_string());
    let pass_store = store.clone();
    run_loop(store, shutdown, RESCAN, &["secrets", "serviceaccounts"], move || {
        let tokens = sync_token_secrets(&pass_store, &resources, &ca, &registry);
        registry.replace(tokens);
    })
    .await;
}

/// One pass; returns the tokens now valid.
pub fn sync_token_secrets(
    store: &Store,
    resources: &ResourceTable,
    ca_pem: &str,
    registry: &TokenRegistry,
) -> HashSet<String> {
    let secrets = GroupResource::new("", "secrets");
    let accounts = GroupResource::new("", "serviceaccounts");
    let mut valid = HashSet::new();
    for secret in store.list(&secrets, None).0 {
        if secret["type"].as_str() != Some(TOKEN_SECRET_TYPE) || is_deleting(&secret) {
            continue;
        }
        let namespace = text(&secret, "namespace").to_string();
        let name = text(&secret, "name").to_string();
        let annotations = &secret["metadata"]["annotations"];
        let account_name = annotations[SERVICE_ACCOUNT_NAME].as_str().unwrap_or("");
        let account = store.get(&accounts, &namespace, account_name);
        let recorded_uid = annotations[SERVICE_ACCOUNT_UID].as_str();
        let account = match account {
            Some(account) if recorded_uid.is_none_or(|uid| uid == text(&account, "uid")) => account,
            _ => {
                if let Ok(info) = super::info(resources, "", "v1", "secrets") {
                    let _ = verbs::delete(store, &info, &namespace, &name, &DeleteOptions::default());
                }
                continue;
            }
        };
        if let Some(token) = decoded(&secret["data"]["token"]) {
            if registry.minted(&token) {
                valid.insert(token);
            }
            if secret["data"]["ca.crt"].is_string() && secret["data"]["namespace"].is_string() {
                continue;
            }
        }
        let token = decoded(&secret["data"]["token"]).unwrap_or_else(|| {
            let token = new_token(&namespace, &name, &account);
            registry.mint(&token);
            token
        });
        let filled = modify(store, &secrets, &namespace, &name, |secret| {
            if !secret["data"].is_object() {
                secret["data"] = json!({});
            }
            secret["data"]["token"] = json!(STANDARD.encode(&token));
            secret["data"]["ca.crt"] = json!(STANDARD.encode(ca_pem));
            secret["data"]["namespace"] = json!(STANDARD.encode(&namespace));
            secret["metadata"]["annotations"][SERVICE_ACCOUNT_UID] = json!(text(&account, "uid"));
        });
        if filled.is_ok() && registry.minted(&token) {
            valid.insert(token);
        }
    }
    valid
}

fn decoded(value: &Value) -> Option<String> {
    let bytes = STANDARD.decode(value.as_str()?).ok()?;
    String::from_utf8(bytes).ok().filter(|t| !t.is_empty())
}

/// A token shaped like the legacy service-account JWT (its signature is random: only this server,
/// which remembers it, accepts it).
fn new_token(namespace: &str, secret: &str, account: &Value) -> String {
    let header = json!({"alg": "RS256", "kid": "stackd-embedded"});
    let claims = json!({
        "iss": "kubernetes/serviceaccount",
        "kubernetes.io/serviceaccount/namespace": namespace,
        "kubernetes.io/serviceaccount/secret.name": secret,
        "kubernetes.io/serviceaccount/service-account.name": text(account, "name"),
        "kubernetes.io/serviceaccount/service-account.uid": text(account, "uid"),
        "sub": format!("system:serviceaccount:{namespace}:{}", text(account, "name")),
    });
    let signature: [u8; 32] = rand::rng().random();
    format!(
        "{}.{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string()),
        URL_SAFE_NO_PAD.encode(signature)
    )
}
