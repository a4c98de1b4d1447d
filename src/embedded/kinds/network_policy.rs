//! `networking.k8s.io/v1` NetworkPolicy: kube-apiserver's defaults and the basics of its validation
//! (selectors, peers, ports, policy types), with its field paths. Policies are stored, not enforced
//! (see `embedded` module docs).

use serde_json::{Value, json};

use super::{items, not_supported};
use crate::embedded::name_rules::{is_dns1123_label, validate_labels};
use crate::embedded::status::Cause;

const POLICY_TYPES: &[&str] = &["Ingress", "Egress"];
const PROTOCOLS: &[&str] = &["TCP", "UDP", "SCTP"];
const OPERATORS: &[&str] = &["In", "NotIn", "Exists", "DoesNotExist"];

/// `policyTypes` defaults to Ingress, plus Egress when there are egress rules; ports to TCP.
pub fn apply_defaults(policy: &mut Value) {
    let Some(spec) = policy.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    let has_egress = spec.get("egress").is_some_and(|e| !items(e).is_empty());
    if spec.get("policyTypes").is_none_or(|t| items(t).is_empty()) {
        let types = if has_egress {
            json!(["Ingress", "Egress"])
        } else {
            json!(["Ingress"])
        };
        spec.insert("policyTypes".into(), types);
    }
    for (rules, ports) in [("ingress", "ports"), ("egress", "ports")] {
        for rule in spec.get_mut(rules).and_then(Value::as_array_mut).into_iter().flatten() {
            for port in rule.get_mut(ports).and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(port) = port.as_object_mut() {
                    port.entry("protocol").or_insert_with(|| json!("TCP"));
                }
            }
        }
    }
}

pub fn validate(policy: &Value) -> Vec<Cause> {
    let spec = &policy["spec"];
    let mut causes = validate_selector("spec.podSelector", &spec["podSelector"]);
    for (rules, peers) in [("ingress", "from"), ("egress", "to")] {
        for (i, rule) in items(&spec[rules]).iter().enumerate() {
            let at = format!("spec.{rules}[{i}]");
            for (j, port) in items(&rule["ports"]).iter().enumerate() {
                causes.extend(validate_port(&format!("{at}.ports[{j}]"), port));
            }
            for (j, peer) in items(&rule[peers]).iter().enumerate() {
                causes.extend(validate_peer(&format!("{at}.{peers}[{j}]"), peer));
            }
        }
    }
    let types = items(&spec["policyTypes"]);
    for (i, policy_type) in types.iter().enumerate() {
        if !policy_type.as_str().is_some_and(|t| POLICY_TYPES.contains(&t)) {
            causes.push(not_supported(
                &format!("spec.policyTypes[{i}]"),
                policy_type,
                POLICY_TYPES,
            ));
        }
    }
    if types.len() > POLICY_TYPES.len() {
        let message = "Invalid value: \"\": may not have more than 2 policyTypes".to_string();
        causes.push(Cause::other("FieldValueInvalid", "spec.policyTypes", message));
    }
    causes
}

fn validate_selector(field: &str, selector: &Value) -> Vec<Cause> {
    let mut causes = validate_labels(&format!("{field}.matchLabels"), &selector["matchLabels"]);
    for (i, expression) in items(&selector["matchExpressions"]).iter().enumerate() {
        let at = format!("{field}.matchExpressions[{i}]");
        let operator = expression["operator"].as_str().unwrap_or_default();
        let values = items(&expression["values"]);
        match operator {
            "In" | "NotIn" if values.is_empty() => causes.push(Cause::required(
                &format!("{at}.values"),
                "must be specified when `operator` is 'In' or 'NotIn'",
            )),
            "Exists" | "DoesNotExist" if !values.is_empty() => causes.push(Cause::other(
                "FieldValueForbidden",
                &format!("{at}.values"),
                "Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'".into(),
            )),
            known if OPERATORS.contains(&known) => {}
            _ => causes.push(not_supported(
                &format!("{at}.operator"),
                &expression["operator"],
                OPERATORS,
            )),
        }
    }
    causes
}

fn validate_peer(field: &str, peer: &Value) -> Vec<Cause> {
    let has = |key: &str| peer.get(key).is_some_and(|v| !v.is_null());
    let selectors = ["podSelector", "namespaceSelector"].iter().filter(|k| has(k)).count();
    let mut causes = Vec::new();
    if has("ipBlock") {
        if selectors > 0 {
            let message = "Forbidden: may not specify more than 1 peer type".to_string();
            causes.push(Cause::other("FieldValueForbidden", field, message));
        }
        causes.extend(validate_ip_block(&format!("{field}.ipBlock"), &peer["ipBlock"]));
    } else if selectors == 0 {
        causes.push(Cause::required(field, "must specify a peer"));
    }
    for key in ["podSelector", "namespaceSelector"] {
        if has(key) {
            causes.extend(validate_selector(&format!("{field}.{key}"), &peer[key]));
        }
    }
    causes
}

fn validate_ip_block(field: &str, block: &Value) -> Vec<Cause> {
    let Some(cidr) = block["cidr"].as_str().filter(|c| !c.is_empty()) else {
        return vec![Cause::required(&format!("{field}.cidr"), "")];
    };
    let mut causes = Vec::new();
    if !is_cidr(cidr) {
        causes.push(Cause::invalid(
            &format!("{field}.cidr"),
            &block["cidr"],
            "must be a valid CIDR",
        ));
    }
    for (i, except) in items(&block["except"]).iter().enumerate() {
        if !except.as_str().is_some_and(is_cidr) {
            causes.push(Cause::invalid(
                &format!("{field}.except[{i}]"),
                except,
                "must be a valid CIDR",
            ));
        }
    }
    causes
}

fn is_cidr(text: &str) -> bool {
    let Some((address, bits)) = text.split_once('/') else {
        return false;
    };
    let Ok(address) = address.parse::<std::net::IpAddr>() else {
        return false;
    };
    let most = if address.is_ipv4() { 32 } else { 128 };
    bits.parse::<u8>().is_ok_and(|bits| bits <= most)
}

fn validate_port(field: &str, port: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    if let Some(protocol) = port.get("protocol").filter(|p| !p.is_null())
        && !protocol.as_str().is_some_and(|p| PROTOCOLS.contains(&p))
    {
        causes.push(not_supported(&format!("{field}.protocol"), protocol, PROTOCOLS));
    }
    let number = port["port"].as_i64();
    match &port["port"] {
        Value::Null => {}
        Value::Number(_) if number.is_some_and(|n| (1..=65535).contains(&n)) => {}
        Value::String(name) if name.len() <= 15 && is_dns1123_label(name) => {}
        other => causes.push(Cause::invalid(
            &format!("{field}.port"),
            other,
            "must be a port number between 1 and 65535 or an IANA service name",
        )),
    }
    if let Some(end) = port.get("endPort").and_then(Value::as_i64) {
        match number {
            Some(start) if end >= start && end <= 65535 => {}
            Some(_) => causes.push(Cause::invalid(
                &format!("{field}.endPort"),
                &port["endPort"],
                "must be greater than or equal to `port`",
            )),
            None => causes.push(Cause::required(
                &format!("{field}.port"),
                "must be specified when endPort is specified",
            )),
        }
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reasons(policy: Value) -> Vec<(String, String)> {
        validate(&policy)
            .into_iter()
            .map(|c| (c.field.clone(), c.reason.to_string()))
            .collect()
    }

    #[test]
    fn the_isolation_policy_is_valid_and_defaulted_to_ingress() {
        let mut policy = json!({"spec": {"podSelector": {}, "ingress": [{"from": [
            {"podSelector": {}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        ]}]}});
        assert!(reasons(policy.clone()).is_empty());
        apply_defaults(&mut policy);
        assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    }

    #[test]
    fn egress_rules_default_both_types_and_ports_default_to_tcp() {
        let mut policy = json!({"spec": {"podSelector": {}, "egress": [{"ports": [{"port": 443}]}]}});
        apply_defaults(&mut policy);
        assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
        assert_eq!(policy["spec"]["egress"][0]["ports"][0]["protocol"], "TCP");
    }

    #[test]
    fn bad_peers_ports_types_and_selectors_are_refused_with_their_paths() {
        let found = reasons(json!({"spec": {
            "podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]},
            "policyTypes": ["Sideways"],
            "ingress": [{
                "from": [{}, {"ipBlock": {"cidr": "10.0.0.0/99"}, "podSelector": {}}],
                "ports": [{"protocol": "ICMP", "port": 70000}, {"port": 80, "endPort": 79}],
            }],
        }}));
        let fields: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
        for expected in [
            "spec.podSelector.matchExpressions[0].operator",
            "spec.policyTypes[0]",
            "spec.ingress[0].from[0]",
            "spec.ingress[0].from[1]",
            "spec.ingress[0].from[1].ipBlock.cidr",
            "spec.ingress[0].ports[0].protocol",
            "spec.ingress[0].ports[0].port",
            "spec.ingress[0].ports[1].endPort",
        ] {
            assert!(fields.contains(&expected), "{expected} missing from {found:?}");
        }
    }
}
