//! The YAML stream an install Job prints and the daemon reads back from the pod log.
//!
//! Pod logs are a lossy transport (Crossplane #1402: rotated logs cut CRDs off), so the stream ends
//! with a trailer that counts the documents and hashes everything before it:
//! `# stackd-trailer v1 docs=<N> sha256=<hex>`. A stream without a valid trailer creates nothing.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::api::stacks::Stack;

pub use crate::bounds::MAX_INSTALL_STREAM_BYTES as MAX_STREAM_BYTES;
/// `limitBytes` for reading the install log: just over the cap, so an over-long log is detected.
pub const LOG_LIMIT_BYTES: i64 = MAX_STREAM_BYTES as i64 + 4096;
const TRAILER_PREFIX: &str = "# stackd-trailer v1 ";

/// What a package contains, ready to apply to the tenant.
#[derive(Clone, Debug, PartialEq)]
pub struct PackageContents {
    /// CRDs, in the order they are applied.
    pub crds: Vec<CustomResourceDefinition>,
    pub stack: Stack,
}

/// Why a stream was refused; each message says what to do.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StreamError {
    #[error("the install output is {0} bytes, more than the 8 MiB limit; reduce the size of the package's CRDs")]
    TooLarge(usize),
    #[error(
        "the install output has no stackd trailer: the log was cut short (rotated or truncated) or the unpack container is not stackd's; the install Job will be retried"
    )]
    MissingTrailer,
    #[error("the install output's trailer is malformed: {0}")]
    BadTrailer(String),
    #[error(
        "the install output does not match its trailer (expected {expected}, found {found}): the log was altered or truncated"
    )]
    Mismatch { expected: String, found: String },
    #[error("the install output is not valid YAML: {0}")]
    Parse(String),
    #[error(
        "the install output contains a {kind} ({api_version}); only CustomResourceDefinitions and one Stack are allowed"
    )]
    UnexpectedKind { api_version: String, kind: String },
    #[error("the install output contains {0} Stacks; a package holds exactly one")]
    StackCount(usize),
    #[error(
        "the package holds {found} CustomResourceDefinitions, more than the {max} this host admits in one package (--max-package-crds); split the package, or ask the host's operators to raise the limit"
    )]
    TooManyCrds { found: usize, max: usize },
    #[error("cannot render the install output: {0}")]
    Render(String),
}

/// Renders CRDs and the Stack as the stream with its trailer.
pub fn encode(contents: &PackageContents) -> Result<String, StreamError> {
    let mut body = String::new();
    for crd in &contents.crds {
        body.push_str("---\n");
        body.push_str(&to_yaml(crd)?);
    }
    body.push_str("---\n");
    body.push_str(&to_yaml(&contents.stack)?);
    if !body.ends_with('\n') {
        body.push('\n');
    }
    let docs = contents.crds.len() + 1;
    let trailer = format!("{TRAILER_PREFIX}docs={docs} sha256={}\n", sha256_hex(&body));
    let total = body.len() + trailer.len();
    if total > MAX_STREAM_BYTES {
        return Err(StreamError::TooLarge(total));
    }
    body.push_str(&trailer);
    Ok(body)
}

/// Verifies the trailer and parses the stream, refusing more than `max_crds` CRDs before any YAML is
/// parsed (the trailer's count is verified against what is parsed). Nothing is returned unless
/// everything checks out. CPU-bound on up to 8 MiB of tenant input: call it off the async workers.
pub fn decode(log: &str, max_crds: usize) -> Result<PackageContents, StreamError> {
    if log.len() > MAX_STREAM_BYTES {
        return Err(StreamError::TooLarge(log.len()));
    }
    let trimmed = log.trim_end_matches('\n');
    let (body, trailer) = match trimmed.rfind('\n') {
        Some(at) => (&log[..at + 1], &trimmed[at + 1..]),
        None => ("", trimmed),
    };
    let fields = trailer
        .strip_prefix(TRAILER_PREFIX)
        .ok_or(StreamError::MissingTrailer)?;
    let (docs, digest) = parse_trailer(fields)?;
    // One of the documents is the Stack.
    if docs.saturating_sub(1) > max_crds {
        return Err(StreamError::TooManyCrds {
            found: docs - 1,
            max: max_crds,
        });
    }
    let found = sha256_hex(body);
    if found != digest {
        return Err(StreamError::Mismatch {
            expected: format!("sha256 {digest}"),
            found: format!("sha256 {found}"),
        });
    }
    let documents: Vec<Value> = serde_saphyr::from_multiple(body).map_err(|e| StreamError::Parse(e.to_string()))?;
    let documents: Vec<Value> = documents.into_iter().filter(|d| !d.is_null()).collect();
    if documents.len() != docs {
        return Err(StreamError::Mismatch {
            expected: format!("{docs} documents"),
            found: format!("{} documents", documents.len()),
        });
    }
    classify(documents)
}

fn parse_trailer(fields: &str) -> Result<(usize, String), StreamError> {
    let bad = || StreamError::BadTrailer(fields.to_string());
    let mut docs = None;
    let mut digest = None;
    for field in fields.split_whitespace() {
        match field.split_once('=') {
            Some(("docs", n)) => docs = Some(n.parse::<usize>().map_err(|_| bad())?),
            Some(("sha256", hex)) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
                digest = Some(hex.to_ascii_lowercase())
            }
            _ => return Err(bad()),
        }
    }
    Ok((docs.ok_or_else(bad)?, digest.ok_or_else(bad)?))
}

fn classify(documents: Vec<Value>) -> Result<PackageContents, StreamError> {
    let mut crds = Vec::new();
    let mut stacks = Vec::new();
    for document in documents {
        let api_version = document["apiVersion"].as_str().unwrap_or_default().to_string();
        let kind = document["kind"].as_str().unwrap_or_default().to_string();
        match (api_version.as_str(), kind.as_str()) {
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => crds.push(
                serde_json::from_value(document)
                    .map_err(|e| StreamError::Parse(format!("CustomResourceDefinition: {e}")))?,
            ),
            ("stacks.stackd.dev/v1alpha1", "Stack") => stacks.push(
                serde_json::from_value::<Stack>(document).map_err(|e| StreamError::Parse(format!("Stack: {e}")))?,
            ),
            _ => return Err(StreamError::UnexpectedKind { api_version, kind }),
        }
    }
    if stacks.len() != 1 {
        return Err(StreamError::StackCount(stacks.len()));
    }
    let stack = stacks.remove(0);
    Ok(PackageContents { crds, stack })
}

fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn to_yaml<T: serde::Serialize>(document: &T) -> Result<String, StreamError> {
    serde_saphyr::to_string(document).map_err(|e| StreamError::Render(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::stacks::StackSpec;

    /// Without a bound on CRDs.
    fn decode(log: &str) -> Result<PackageContents, StreamError> {
        super::decode(log, usize::MAX)
    }

    fn contents() -> PackageContents {
        let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.samples.example.org"},
            "spec": {
                "group": "samples.example.org",
                "names": {"kind": "Widget", "plural": "widgets"},
                "scope": "Namespaced",
                "versions": [{"name": "v1alpha1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
            }
        }))
        .expect("crd");
        let stack = Stack::new(
            "",
            StackSpec {
                title: Some("Sample".into()),
                ..Default::default()
            },
        );
        PackageContents { crds: vec![crd], stack }
    }

    #[test]
    fn encoded_stream_decodes_to_the_same_contents() {
        let stream = encode(&contents()).expect("encode");
        assert!(
            stream
                .lines()
                .last()
                .unwrap_or_default()
                .starts_with("# stackd-trailer v1 docs=2 sha256=")
        );
        assert_eq!(decode(&stream), Ok(contents()));
    }

    #[test]
    fn truncated_log_is_refused() {
        let stream = encode(&contents()).expect("encode");
        assert_eq!(decode(&stream[..stream.len() / 2]), Err(StreamError::MissingTrailer));
        // A cut anywhere, even inside the trailer, is refused.
        for cut in 0..stream.len() - 1 {
            assert!(decode(&stream[..cut]).is_err(), "cut at {cut} was accepted");
        }
    }

    #[test]
    fn altered_body_is_refused() {
        let stream = encode(&contents()).expect("encode");
        let altered = stream.replace("Sample", "Simple");
        assert!(matches!(decode(&altered), Err(StreamError::Mismatch { .. })));
    }

    #[test]
    fn wrong_document_count_is_refused() {
        let stream = encode(&contents()).expect("encode");
        let wrong = stream.replace("docs=2", "docs=3");
        assert!(matches!(decode(&wrong), Err(StreamError::Mismatch { .. })));
    }

    fn with_trailer(body: &str, docs: usize) -> String {
        format!("{body}{TRAILER_PREFIX}docs={docs} sha256={}\n", sha256_hex(body))
    }

    #[test]
    fn unexpected_kind_is_refused() {
        let body = "---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n";
        assert!(
            matches!(decode(&with_trailer(body, 1)), Err(StreamError::UnexpectedKind { ref kind, .. }) if kind == "ConfigMap")
        );
    }

    #[test]
    fn two_stacks_are_refused() {
        let stack = "---\napiVersion: stacks.stackd.dev/v1alpha1\nkind: Stack\nmetadata: {}\nspec: {}\n";
        assert_eq!(
            decode(&with_trailer(&format!("{stack}{stack}"), 2)),
            Err(StreamError::StackCount(2))
        );
        assert_eq!(decode(&with_trailer("", 0)), Err(StreamError::StackCount(0)));
    }

    #[test]
    fn unparsable_yaml_is_refused() {
        let body = "---\nkind: [unclosed\n";
        assert!(matches!(decode(&with_trailer(body, 1)), Err(StreamError::Parse(_))));
    }

    #[test]
    fn malformed_trailer_is_refused() {
        assert!(matches!(
            decode("---\n# stackd-trailer v1 docs=x sha256=00\n"),
            Err(StreamError::BadTrailer(_))
        ));
    }

    #[test]
    fn more_crds_than_the_bound_are_refused_before_parsing() {
        let stream = encode(&contents()).expect("encode");
        assert_eq!(super::decode(&stream, 1), Ok(contents()));
        assert_eq!(
            super::decode(&stream, 0),
            Err(StreamError::TooManyCrds { found: 1, max: 0 })
        );
        // The count comes from the trailer, checked before the (here unparsable) body is read.
        let unparsable = with_trailer("---\nkind: [unclosed\n", 5001);
        assert_eq!(
            super::decode(&unparsable, 1000),
            Err(StreamError::TooManyCrds { found: 5000, max: 1000 })
        );
    }

    #[test]
    fn oversized_stream_is_refused_both_ways() {
        let mut big = contents();
        big.stack.spec.metadata.readme = Some("r".repeat(MAX_STREAM_BYTES));
        assert!(matches!(encode(&big), Err(StreamError::TooLarge(_))));
        assert!(matches!(
            decode(&"x".repeat(MAX_STREAM_BYTES + 1)),
            Err(StreamError::TooLarge(_))
        ));
    }
}
