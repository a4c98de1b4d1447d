//! Parse errors of secret material (kubeconfigs, install configs) say where, never what
//! (DESIGN.md §8). serde-saphyr quotes the lines around an error and serde reports the offending
//! value ("invalid type: string \"<token>\""), so their messages would carry a token or a password
//! into logs, conditions and `/readyz?verbose`; only the position and a fixed description survive.

use std::fmt;

/// A parse error reduced to its format, position and a description that quotes nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocatedParseError {
    format: &'static str,
    problem: &'static str,
    /// 1-based line and column, when the parser knew them.
    position: Option<(u64, u64)>,
}

impl LocatedParseError {
    /// The location of a serde-saphyr error, without its snippet or message.
    pub fn yaml(err: &serde_saphyr::Error) -> LocatedParseError {
        let problem = match err.without_snippet() {
            serde_saphyr::Error::MultipleDocuments { .. } => "more than one YAML document",
            serde_saphyr::Error::Eof { .. } => "unexpected end of the text",
            _ => "invalid YAML or an unexpected shape",
        };
        LocatedParseError {
            format: "YAML",
            problem,
            position: err
                .location()
                .map(|l| (l.line(), l.column()))
                .filter(|(line, _)| *line > 0),
        }
    }

    /// The location of a serde_json error, without its message.
    pub fn json(err: &serde_json::Error) -> LocatedParseError {
        let problem = match err.classify() {
            serde_json::error::Category::Syntax => "invalid JSON",
            serde_json::error::Category::Eof => "unexpected end of the text",
            serde_json::error::Category::Data => "an unexpected shape",
            serde_json::error::Category::Io => "a read error",
        };
        LocatedParseError {
            format: "JSON",
            problem,
            position: (err.line() > 0).then(|| (err.line() as u64, err.column() as u64)),
        }
    }

    /// The 1-based line and column, when known.
    pub fn position(&self) -> Option<(u64, u64)> {
        self.position
    }
}

impl fmt::Display for LocatedParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Some((line, column)) => write!(f, "{} at line {line}, column {column}", self.problem)?,
            None => write!(f, "{} (position unknown)", self.problem)?,
        }
        write!(
            f,
            " ({} text is not quoted in errors because it may hold secrets)",
            self.format
        )
    }
}

impl std::error::Error for LocatedParseError {}

/// The message of a kube kubeconfig error, with parse errors reduced to their location.
pub fn kubeconfig_error_message(err: &kube::config::KubeconfigError) -> String {
    match err {
        kube::config::KubeconfigError::Parse(inner) => {
            format!("not a valid kubeconfig: {}", LocatedParseError::yaml(inner))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.s3cr3t-t0k3n-value";

    #[test]
    fn malformed_yaml_never_quotes_the_token_it_holds() {
        for text in [
            format!("users:\n- name: a\n  user:\n    token: {TOKEN}\n   bad: [\n"),
            format!("users: [{{name: a, user: {{token: \"{TOKEN}\"}}]\n"),
            format!("key: \"{TOKEN}\n"),
            format!("- {TOKEN}\n: : :\n"),
        ] {
            let err = serde_saphyr::from_str::<serde_json::Value>(&text).unwrap_err();
            assert!(
                err.to_string().contains("s3cr3t"),
                "the raw error quotes the text: {err}"
            );
            let message = LocatedParseError::yaml(&err).to_string();
            assert!(message.contains("line"), "{message}");
            assert!(!message.contains("s3cr3t"), "{message}");
            assert!(!message.contains("eyJ"), "{message}");
        }
    }

    #[test]
    fn a_typed_parse_error_names_the_line_not_the_value() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Shape {
            enabled: bool,
        }
        let err = serde_saphyr::from_str::<Shape>(&format!("\nenabled: {TOKEN}\n")).unwrap_err();
        let located = LocatedParseError::yaml(&err);
        assert_eq!(located.position().map(|(line, _)| line), Some(2));
        assert!(!located.to_string().contains("s3cr3t"), "{located}");
        assert!(located.to_string().contains("line 2"), "{located}");
    }

    #[test]
    fn json_errors_say_where_and_never_the_value() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Shape {
            count: u32,
        }
        let err = serde_json::from_str::<Shape>(&format!("{{\n\"count\": \"{TOKEN}\"}}")).unwrap_err();
        let message = LocatedParseError::json(&err).to_string();
        assert!(message.contains("line 2"), "{message}");
        assert!(!message.contains("s3cr3t"), "{message}");
    }

    #[test]
    fn kubeconfig_parse_errors_are_reduced_to_their_location() {
        let text = format!("users:\n- name: a\n  user: {{token: [{TOKEN}\n");
        let err = kube::config::Kubeconfig::from_yaml(&text).unwrap_err();
        let message = kubeconfig_error_message(&err);
        assert!(!message.contains("s3cr3t"), "{message}");
        assert!(message.contains("line"), "{message}");
    }
}
