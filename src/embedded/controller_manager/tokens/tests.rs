//! The token loop looks only at the Secrets events name, and at the token Secrets naming a
//! ServiceAccount that changed.

use serde_json::json;

use super::*;
use crate::embedded::controller_manager::testing::{Fixture, key};

fn controller(fixture: &Fixture) -> TokenController {
    TokenController {
        store: fixture.store.clone(),
        resources: fixture.resources.clone(),
        registry: Arc::default(),
        ca_pem: PLACEHOLDER_CA.to_string(),
    }
}

fn token_secret(namespace: &str, name: &str, account: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Secret", "type": TOKEN_SECRET_TYPE,
        "metadata": {"name": name, "namespace": namespace, "annotations": {SERVICE_ACCOUNT_NAME: account}},
    })
}

fn token_of(fixture: &Fixture, namespace: &str, name: &str) -> Option<String> {
    let secret = fixture.store.get(&secrets(), namespace, name)?;
    decoded(&secret["data"]["token"])
}

#[test]
fn a_service_account_event_names_only_the_token_secrets_naming_it() {
    let mut fixture = Fixture::new();
    let mut controller = controller(&fixture);
    fixture.create("", "v1", "secrets", token_secret("ns", "builder-token", "builder"));
    // Its account is missing: looked at, it would be deleted.
    fixture.create("", "v1", "secrets", token_secret("other", "builder-token", "builder"));
    fixture.named(&controller);
    fixture.create("", "v1", "serviceaccounts", json!({"metadata": {"name": "builder"}}));
    let named = fixture.named(&controller);
    assert_eq!(named, BTreeSet::from([Key::Account(key("ns", "builder"))]));
    controller.pass(named);
    let token = token_of(&fixture, "ns", "builder-token").expect("the token Secret is filled");
    assert!(controller.registry.contains(&token));
    assert!(fixture.store.get(&secrets(), "other", "builder-token").is_some());
}

#[test]
fn a_deleted_token_secret_takes_its_token_with_it() {
    let mut fixture = Fixture::new();
    let mut controller = controller(&fixture);
    fixture.create("", "v1", "serviceaccounts", json!({"metadata": {"name": "builder"}}));
    fixture.create("", "v1", "secrets", token_secret("ns", "builder-token", "builder"));
    let named = fixture.named(&controller);
    controller.pass(named);
    let token = token_of(&fixture, "ns", "builder-token").expect("filled");
    let info = fixture.resources.current().find("", "v1", "secrets").unwrap();
    verbs::delete(&fixture.store, &info, "ns", "builder-token", &DeleteOptions::default()).unwrap();
    let named = fixture.named(&controller);
    controller.pass(named);
    assert!(!controller.registry.contains(&token));
}

#[test]
fn a_reset_store_leaves_no_token_valid() {
    let mut fixture = Fixture::new();
    let mut controller = controller(&fixture);
    fixture.create("", "v1", "serviceaccounts", json!({"metadata": {"name": "builder"}}));
    fixture.create("", "v1", "secrets", token_secret("ns", "builder-token", "builder"));
    let named = fixture.named(&controller);
    controller.pass(named);
    let token = token_of(&fixture, "ns", "builder-token").expect("filled");
    fixture.store.reset();
    let everything = controller.all_keys();
    controller.pass(everything);
    assert!(!controller.registry.contains(&token));
}
