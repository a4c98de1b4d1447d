//! The root cause of a failed request, in words a user can act on. A client error is a chain
//! (`ServiceError: client error (Connect)` → `tcp connect error` → `Connection refused`); what
//! matters is at its end, and whether waiting can help.

use std::error::Error;
use std::fmt;

/// What kind of trouble a request ran into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CauseKind {
    /// Nothing listens at the address (yet): the server is down or restarting.
    Refused,
    /// The server's host name does not resolve.
    Dns,
    /// No answer in time.
    Timeout,
    /// The connection broke mid-request.
    Reset,
    /// The server's certificate is not signed by the CA the kubeconfig trusts.
    Certificate,
    /// 401: the credentials were rejected.
    Unauthorized,
    /// 403: the credentials are accepted but lack a permission.
    Forbidden,
    /// 409: someone else wrote first (a stale resourceVersion, or a name taken); retry on a fresh copy.
    Conflict,
    /// 410: a watch resumed from a resourceVersion the server no longer has; the watch relists.
    Expired,
    /// 5xx or 429: the server answered but could not serve the request now.
    ServerBusy,
    /// Anything else: the message says what.
    Other,
}

impl CauseKind {
    /// Every [`CauseKind::label`], plus the words for failures that are no request's (`config`,
    /// `controller`).
    pub const LABELS: [&'static str; 13] = [
        "refused",
        "dns",
        "timeout",
        "reset",
        "certificate",
        "unauthorized",
        "forbidden",
        "conflict",
        "expired",
        "server_busy",
        "other",
        "config",
        "controller",
    ];

    /// A stable word for metrics (`stackd_tenant_down_cause{cause}`).
    pub fn label(self) -> &'static str {
        match self {
            CauseKind::Refused => "refused",
            CauseKind::Dns => "dns",
            CauseKind::Timeout => "timeout",
            CauseKind::Reset => "reset",
            CauseKind::Certificate => "certificate",
            CauseKind::Unauthorized => "unauthorized",
            CauseKind::Forbidden => "forbidden",
            CauseKind::Conflict => "conflict",
            CauseKind::Expired => "expired",
            CauseKind::ServerBusy => "server_busy",
            CauseKind::Other => "other",
        }
    }

    /// A kubeconfig with this trouble never works by waiting: back off instead of probing.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            CauseKind::Certificate | CauseKind::Unauthorized | CauseKind::Forbidden
        )
    }

    /// Trouble of the whole server, not of one request, which waiting can end: it did not answer
    /// (refused, unresolvable, timed out, cut off), or answered that it cannot serve now (5xx, 429).
    pub fn is_outage(self) -> bool {
        matches!(
            self,
            CauseKind::Refused | CauseKind::Dns | CauseKind::Timeout | CauseKind::Reset | CauseKind::ServerBusy
        )
    }

    /// The server did not answer at all (as opposed to answering with an error).
    pub fn is_unreachable(self) -> bool {
        matches!(
            self,
            CauseKind::Refused | CauseKind::Dns | CauseKind::Timeout | CauseKind::Reset | CauseKind::Certificate
        )
    }
}

/// The kind of trouble and a sentence naming its root cause and what to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub kind: CauseKind,
    pub message: String,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Diagnoses `err` from its whole source chain.
pub fn diagnose(err: &(dyn Error + 'static)) -> Cause {
    let mut chain: Vec<&(dyn Error + 'static)> = vec![err];
    let mut link = err;
    while let Some(next) = link.source() {
        chain.push(next);
        link = next;
    }
    if let Some(status) = chain.iter().find_map(|e| status_of(*e)) {
        return from_status(status.code, &status.reason, &status.message);
    }
    // io::Error hides its inner error from `source()` but shows it in its text: read every link.
    let texts: Vec<String> = chain.iter().map(|e| e.to_string()).collect();
    let root = texts.last().cloned().unwrap_or_default();
    let all = texts.join(" | ").to_lowercase();
    let io_kind = chain
        .iter()
        .find_map(|e| e.downcast_ref::<std::io::Error>())
        .map(std::io::Error::kind);
    let (kind, message) = if all.contains("certificate") || all.contains("unknownissuer") {
        (
            CauseKind::Certificate,
            format!(
                "the server's TLS certificate is not trusted ({root}): check certificate-authority-data in the kubeconfig"
            ),
        )
    } else if io_kind == Some(std::io::ErrorKind::ConnectionRefused) || all.contains("connection refused") {
        (
            CauseKind::Refused,
            format!("connection refused ({root}): the API server is not running at the kubeconfig's server address"),
        )
    } else if all.contains("dns error") || all.contains("failed to lookup address") {
        (
            CauseKind::Dns,
            format!("the server's host name does not resolve ({root}): check the kubeconfig's server address"),
        )
    } else if io_kind == Some(std::io::ErrorKind::TimedOut) || all.contains("timed out") || all.contains("elapsed") {
        (CauseKind::Timeout, format!("no answer in time ({root})"))
    } else if matches!(
        io_kind,
        Some(std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::UnexpectedEof)
    ) || all.contains("connection reset")
        || all.contains("connection closed")
        || all.contains("broken pipe")
    {
        (CauseKind::Reset, format!("the connection broke ({root})"))
    } else {
        (CauseKind::Other, root)
    };
    Cause { kind, message }
}

fn status_of<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a kube::core::Status> {
    if let Some(kube::Error::Api(status)) = err.downcast_ref::<kube::Error>() {
        return Some(status);
    }
    err.downcast_ref::<kube::core::Status>()
        .or_else(|| err.downcast_ref::<Box<kube::core::Status>>().map(|status| &**status))
}

fn from_status(code: u16, reason: &str, message: &str) -> Cause {
    let (kind, message) = match code {
        401 => (
            CauseKind::Unauthorized,
            "401 Unauthorized: the API server rejected the kubeconfig's credentials; check its token or client certificate"
                .to_string(),
        ),
        403 => (
            CauseKind::Forbidden,
            format!("403 Forbidden ({message}): grant the kubeconfig's user the permission"),
        ),
        409 => (CauseKind::Conflict, format!("409 Conflict: {message}")),
        410 => (
            CauseKind::Expired,
            format!("410 Expired ({message}): the watch relists"),
        ),
        429 | 500..=599 => (CauseKind::ServerBusy, format!("{code} {reason}: {message}")),
        _ => (CauseKind::Other, format!("{code} {reason}: {message}")),
    };
    Cause { kind, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_refused_connection_is_named_from_the_end_of_the_chain() {
        let err = Outer(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        ));
        let cause = diagnose(&err);
        assert_eq!(cause.kind, CauseKind::Refused);
        assert!(cause.message.contains("Connection refused (os error 111)"), "{cause}");
        assert!(!cause.kind.is_permanent());
    }

    #[test]
    fn an_untrusted_certificate_says_to_check_the_ca() {
        let err = Outer(std::io::Error::other("invalid peer certificate: UnknownIssuer"));
        let cause = diagnose(&err);
        assert_eq!(cause.kind, CauseKind::Certificate);
        assert!(cause.message.contains("UnknownIssuer"), "{cause}");
        assert!(cause.message.contains("certificate-authority-data"), "{cause}");
        assert!(cause.kind.is_permanent());
    }

    #[test]
    fn api_statuses_are_classified_by_code() {
        let status = |code: u16| {
            let mut status = kube::core::Status::failure("denied", "Forbidden");
            status.code = code;
            kube::Error::Api(Box::new(status))
        };
        assert_eq!(diagnose(&status(401)).kind, CauseKind::Unauthorized);
        assert_eq!(diagnose(&status(403)).kind, CauseKind::Forbidden);
        assert_eq!(diagnose(&status(409)).kind, CauseKind::Conflict);
        assert_eq!(diagnose(&status(410)).kind, CauseKind::Expired);
        assert_eq!(diagnose(&status(503)).kind, CauseKind::ServerBusy);
        assert!(!CauseKind::Expired.is_unreachable());
        assert!(CauseKind::ServerBusy.is_outage() && CauseKind::Refused.is_outage());
        assert!(!CauseKind::Certificate.is_outage() && !CauseKind::Expired.is_outage());
    }
}
