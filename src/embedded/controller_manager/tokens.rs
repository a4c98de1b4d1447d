//! The token controller: a Secret of type `kubernetes.io/service-account-token` annotated with an
//! existing ServiceAccount's name gets `token`, `ca.crt`, `namespace` and the account's uid; one whose
//! ServiceAccount is missing (or was recreated with another uid) is deleted. Tokens this controller
//! minted are valid bearer tokens on this server for as long as their Secret exists; a token written
//! into a Secret by a client is never accepted (on a real server its signature would not verify).
//!
//! A pass looks at the Secrets whose events arrived since the last one, and at the token Secrets
//! of a namespace whose ServiceAccounts changed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use rand::RngExt;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::{all_keys, is_deleting, key_of, modify, text};
use crate::embedded::discovery::ResourceTable;
use crate::embedded::passes::{self, Controller};
use crate::embedded::store::{GroupResource, ObjectKey, Store, StoreEvent};
use crate::embedded::verb_options::DeleteOptions;
use crate::embedded::verbs;

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
    valid: RwLock<ValidTokens>,
    minted: RwLock<HashSet<String>>,
}

/// The valid tokens and the Secrets holding them (a token copied into a second Secret stays valid
/// while either holds it).
#[derive(Default)]
struct ValidTokens {
    by_secret: HashMap<ObjectKey, String>,
    holders: HashMap<String, usize>,
}

impl ValidTokens {
    fn set(&mut self, secret: ObjectKey, token: Option<String>) {
        let old = match token {
            Some(token) => {
                *self.holders.entry(token.clone()).or_default() += 1;
                self.by_secret.insert(secret, token)
            }
            None => self.by_secret.remove(&secret),
        };
        if let Some(old) = old
            && let Some(count) = self.holders.get_mut(&old)
        {
            *count -= 1;
            if *count == 0 {
                self.holders.remove(&old);
            }
        }
    }
}

impl TokenRegistry {
    pub fn contains(&self, token: &str) -> bool {
        self.valid
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .holders
            .contains_key(token)
    }

    /// The Secrets tokens are valid through.
    fn holders(&self) -> Vec<ObjectKey> {
        let valid = self.valid.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        valid.by_secret.keys().cloned().collect()
    }

    /// Records the token `secret` makes valid now (`None`: none).
    fn set(&self, secret: ObjectKey, token: Option<String>) {
        let mut valid = self.valid.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        valid.set(secret, token);
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
    let controller = TokenController {
        store: store.clone(),
        resources,
        registry,
        ca_pem: ca_pem.unwrap_or_else(|| PLACEHOLDER_CA.to_string()),
    };
    passes::run(store, shutdown, RESCAN, controller).await;
}

fn secrets() -> GroupResource {
    GroupResource::new("", "secrets")
}

fn service_accounts() -> GroupResource {
    GroupResource::new("", "serviceaccounts")
}

/// What a pass looks at.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Secret(ObjectKey),
    /// The token Secrets naming this ServiceAccount.
    Account(ObjectKey),
}

struct TokenController {
    store: Arc<Store>,
    resources: Arc<ResourceTable>,
    registry: Arc<TokenRegistry>,
    ca_pem: String,
}

impl Controller for TokenController {
    type Key = Key;

    fn keys_of(&self, event: &StoreEvent, pending: &mut BTreeSet<Key>) {
        if event.resource == secrets() {
            pending.insert(Key::Secret(key_of(event)));
        } else if event.resource == service_accounts() {
            pending.insert(Key::Account(key_of(event)));
        }
    }

    /// Every Secret, and every Secret a token is valid through (gone ones lose their token).
    fn all_keys(&self) -> BTreeSet<Key> {
        let mut keys = all_keys(&self.store, &secrets());
        keys.extend(self.registry.holders());
        keys.into_iter().map(Key::Secret).collect()
    }

    fn pass(&mut self, keys: BTreeSet<Key>) -> BTreeSet<Key> {
        let mut secrets = BTreeSet::new();
        for key in keys {
            match key {
                Key::Secret(secret) => secrets.insert(secret),
                Key::Account(account) => {
                    secrets.extend(token_secrets_of(&self.store, &account));
                    false
                }
            };
        }
        for secret in secrets {
            let token = sync_token_secret(&self.store, &self.resources, &self.ca_pem, &self.registry, &secret);
            self.registry.set(secret, token);
        }
        BTreeSet::new()
    }
}

/// The token Secrets in the account's namespace that name it.
fn token_secrets_of(store: &Store, (namespace, account): &ObjectKey) -> Vec<ObjectKey> {
    let (in_namespace, _) = store.list_shared(&secrets(), Some(namespace));
    in_namespace
        .iter()
        .filter(|secret| secret["metadata"]["annotations"][SERVICE_ACCOUNT_NAME].as_str() == Some(account))
        .map(|secret| (namespace.clone(), text(secret, "name").to_string()))
        .collect()
}

/// Looks at one Secret; returns the token it makes valid, if any. A token Secret whose account is
/// gone (or was recreated) is deleted; one not yet filled is filled.
fn sync_token_secret(
    store: &Store,
    resources: &ResourceTable,
    ca_pem: &str,
    registry: &TokenRegistry,
    (namespace, name): &ObjectKey,
) -> Option<String> {
    let secret = store.get_shared(&secrets(), namespace, name)?;
    if secret["type"].as_str() != Some(TOKEN_SECRET_TYPE) || is_deleting(&secret) {
        return None;
    }
    let annotations = &secret["metadata"]["annotations"];
    let account_name = annotations[SERVICE_ACCOUNT_NAME].as_str().unwrap_or("");
    let account = store.get_shared(&service_accounts(), namespace, account_name);
    let recorded_uid = annotations[SERVICE_ACCOUNT_UID].as_str();
    let account = match account {
        Some(account) if recorded_uid.is_none_or(|uid| uid == text(&account, "uid")) => account,
        _ => {
            if let Ok(info) = super::info(resources, "", "v1", "secrets") {
                let _ = verbs::delete(store, &info, namespace, name, &DeleteOptions::default());
            }
            return None;
        }
    };
    let present = decoded(&secret["data"]["token"]);
    if let Some(token) = &present
        && secret["data"]["ca.crt"].is_string()
        && secret["data"]["namespace"].is_string()
    {
        return registry.minted(token).then(|| token.clone());
    }
    let token = present.unwrap_or_else(|| {
        let token = new_token(namespace, name, &account);
        registry.mint(&token);
        token
    });
    let filled = modify(store, &secrets(), namespace, name, |secret| {
        if !secret["data"].is_object() {
            secret["data"] = json!({});
        }
        secret["data"]["token"] = json!(STANDARD.encode(&token));
        secret["data"]["ca.crt"] = json!(STANDARD.encode(ca_pem));
        secret["data"]["namespace"] = json!(STANDARD.encode(namespace));
        secret["metadata"]["annotations"][SERVICE_ACCOUNT_UID] = json!(text(&account, "uid"));
    });
    (filled.is_ok() && registry.minted(&token)).then_some(token)
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

#[cfg(test)]
mod tests;
