//! Talking to a server whose address a tenant wrote (a provisioned cluster's admin kubeconfig,
//! DESIGN.md §8). The address may be anything the daemon can reach: a host-internal service, a
//! cloud metadata endpoint, a server that never answers or answers without end. So every request
//! is bounded in time and size, and what such a server answered is reported by its HTTP code and,
//! for a genuine Kubernetes `Status`, its message — never an arbitrary body, which would read the
//! daemon's network back to the tenant through conditions and Events.

use std::time::Duration;

use http_body_util::Limited;
use kube::client::ClientBuilder;
use kube::core::Status;
use kube::{Client, Config};
use tower::util::MapResponseLayer;

use super::parse_error::LocatedParseError;

/// Largest answer read from such a server: a BareMetalHost or a Secret is a few KiB.
pub const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// Longest Status message passed on; a real API server's fit easily.
const MAX_MESSAGE_CHARS: usize = 300;
/// `StatusReason`s a Kubernetes API server sends (k8s.io/apimachinery metav1): a body claiming
/// another reason is not one of its answers.
const KUBERNETES_REASONS: &[&str] = &[
    "AlreadyExists",
    "BadRequest",
    "Conflict",
    "Expired",
    "Forbidden",
    "Gone",
    "InternalError",
    "Invalid",
    "MethodNotAllowed",
    "NotAcceptable",
    "NotFound",
    "RequestEntityTooLarge",
    "ServerTimeout",
    "ServiceUnavailable",
    "Timeout",
    "TooManyRequests",
    "Unauthorized",
    "UnsupportedMediaType",
];

/// A client for `config` whose connects, reads and writes each give up after `timeout` and whose
/// answers are cut off past [`MAX_ANSWER_BYTES`]. Callers bound whole exchanges with
/// [`tokio::time::timeout`] as well: a server can trickle an answer a byte at a time.
pub fn client(mut config: Config, timeout: Duration) -> Result<Client, kube::Error> {
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    let limit = MapResponseLayer::new(|answer: http::Response<Box<kube::client::DynBody>>| {
        answer.map(|body| Limited::new(body, MAX_ANSWER_BYTES))
    });
    Ok(ClientBuilder::try_from(config)?.with_layer(&limit).build())
}

/// `err` with nothing of the answer's body left in it but a genuine Kubernetes Status: its code,
/// reason and a bounded message. Every other detail (the connection failure, the timeout) stays.
pub fn sanitize(err: kube::Error) -> kube::Error {
    match err {
        kube::Error::Api(status) => kube::Error::Api(Box::new(sanitize_status(*status))),
        kube::Error::SerdeError(parse) => {
            let located = LocatedParseError::json(&parse);
            kube::Error::SerdeError(serde::de::Error::custom(format!(
                "the server's answer is not the Kubernetes object asked for ({located}); not shown"
            )))
        }
        other => other,
    }
}

fn sanitize_status(status: Status) -> Status {
    let genuine = status.is_failure() && KUBERNETES_REASONS.contains(&status.reason.as_str());
    if !genuine {
        return Status::failure(
            &format!(
                "the server answered HTTP {} without a Kubernetes Status (its answer is not shown): is the kubeconfig's server a Kubernetes API server?",
                status.code
            ),
            "NotKubernetes",
        )
        .with_code(status.code);
    }
    let message = match status.message.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}…", &status.message[..cut]),
        None => status.message,
    };
    Status::failure(&message, &status.reason).with_code(status.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(err: kube::Error) -> Status {
        match sanitize(err) {
            kube::Error::Api(status) => *status,
            other => panic!("not an API error: {other}"),
        }
    }

    #[test]
    fn a_body_that_is_no_kubernetes_status_is_reduced_to_its_code() {
        // kube turns a non-Status error body into a Status carrying the whole body as message.
        let html =
            Status::failure("<html>metadata: iam-role-secret</html>", "Failed to parse error data").with_code(404);
        let status = api_error(kube::Error::Api(Box::new(html)));
        assert_eq!((status.code, status.reason.as_str()), (404, "NotKubernetes"));
        assert!(!status.message.contains("iam-role-secret"), "{}", status.message);
        assert!(status.message.contains("HTTP 404"), "{}", status.message);
    }

    #[test]
    fn a_json_body_that_merely_parses_as_a_status_is_not_passed_on() {
        let forged: Status = serde_json::from_str(r#"{"message": "db-password", "code": 500}"#).unwrap();
        let status = api_error(kube::Error::Api(Box::new(forged)));
        assert!(!status.message.contains("db-password"));
    }

    #[test]
    fn a_kubernetes_status_keeps_its_reason_and_a_bounded_message() {
        let forbidden = Status::failure("baremetalhosts.metal3.io is forbidden", "Forbidden").with_code(403);
        let status = api_error(kube::Error::Api(Box::new(forbidden.clone())));
        assert_eq!(status, forbidden);
        let long = Status::failure(&"x".repeat(5000), "Invalid").with_code(422);
        let status = api_error(kube::Error::Api(Box::new(long)));
        assert!(status.message.chars().count() <= MAX_MESSAGE_CHARS + 1);
    }

    #[test]
    fn an_unexpected_answer_is_located_not_quoted() {
        let parse = serde_json::from_str::<k8s_openapi::api::core::v1::Secret>(r#""planted-value""#).unwrap_err();
        assert!(parse.to_string().contains("planted-value"), "serde quotes the value");
        let text = sanitize(kube::Error::SerdeError(parse)).to_string();
        assert!(!text.contains("planted-value"), "{text}");
        assert!(text.contains("line 1"), "{text}");
    }
}
