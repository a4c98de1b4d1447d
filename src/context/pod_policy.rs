//! What the daemon's flags let stack pods ask for on the host beyond the allow-list of
//! `crate::stacks::pod_policy` (`--stack-node-selector`, `--stack-toleration`), parsed from the flags.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// What the daemon's flags let stack pods ask for beyond the allow-list (`--stack-node-selector`,
/// `--stack-toleration`): without flags, no node selector and no toleration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodPolicy {
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<AllowedToleration>,
}

/// One `--stack-node-selector KEY=VALUE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLabel {
    pub key: String,
    pub value: String,
}

impl FromStr for NodeLabel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => Ok(NodeLabel {
                key: key.trim().to_string(),
                value: value.trim().to_string(),
            }),
            _ => Err(format!("expected KEY=VALUE, got {s:?}")),
        }
    }
}

/// One `--stack-toleration KEY[=VALUE][:EFFECT]`: `Equal` with a value, `Exists` without; no effect
/// means every effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedToleration {
    pub key: String,
    pub value: Option<String>,
    pub effect: Option<String>,
}

const EFFECTS: &[&str] = &["NoSchedule", "PreferNoSchedule", "NoExecute"];

impl FromStr for AllowedToleration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (taint, effect) = match s.rsplit_once(':') {
            Some((taint, effect)) if EFFECTS.contains(&effect) => (taint, Some(effect.to_string())),
            Some((_, effect)) => {
                return Err(format!(
                    "unknown taint effect {effect:?} in {s:?}; use one of {}",
                    EFFECTS.join(", ")
                ));
            }
            None => (s, None),
        };
        let (key, value) = match taint.split_once('=') {
            Some((key, value)) => (key, Some(value.to_string())),
            None => (taint, None),
        };
        if key.is_empty() {
            return Err(format!("expected KEY[=VALUE][:EFFECT], got {s:?}"));
        }
        Ok(AllowedToleration {
            key: key.to_string(),
            value,
            effect,
        })
    }
}

impl fmt::Display for AllowedToleration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)?;
        if let Some(value) = &self.value {
            write!(f, "={value}")?;
        }
        if let Some(effect) = &self.effect {
            write!(f, ":{effect}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_and_say_what_is_wrong() {
        assert_eq!(
            "pool=stacks".parse::<NodeLabel>(),
            Ok(NodeLabel {
                key: "pool".into(),
                value: "stacks".into()
            })
        );
        assert!("pool".parse::<NodeLabel>().is_err());
        let toleration: AllowedToleration = "k=v:NoExecute".parse().unwrap();
        assert_eq!(toleration.to_string(), "k=v:NoExecute");
        let err = "k:Sometimes".parse::<AllowedToleration>().unwrap_err();
        assert!(err.contains("NoSchedule"), "{err}");
    }
}
