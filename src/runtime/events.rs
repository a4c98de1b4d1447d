//! What every Event stackd publishes has in common: a note kube-apiserver accepts, and a refusal
//! that is seen.
//!
//! events.k8s.io/v1 refuses a `note` over 1,024 bytes (422), and an Event refused is an Event
//! nobody reads: a long condition message (every problem of a package) keeps its whole text in the
//! condition, and its Event carries the first 1,024 bytes, cut on a character boundary.

use kube::runtime::events::{Event, EventType};
use tracing::{debug, warn};

pub use crate::runtime::text_bounds::MAX_EVENT_NOTE_BYTES as MAX_NOTE_BYTES;

/// An Event whose note fits kube-apiserver's limit.
pub fn event(type_: EventType, reason: &str, action: &str, note: impl Into<String>) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(fit_note(note.into())),
        action: action.into(),
        secondary: None,
    }
}

/// `note` itself when it fits, else its longest prefix that fits with a mark of the cut after it
/// (the object's conditions say it whole).
pub fn fit_note(note: String) -> String {
    crate::runtime::text_bounds::fit_text(note, MAX_NOTE_BYTES)
}

/// Logs an Event that could not be published: a refusal (the Event itself was wrong) is a warning,
/// anything else (the API server is away, a conflict) is for debugging only, since publishing never
/// fails a reconcile and the object's status says the same.
pub fn log_unpublished(error: &kube::Error) {
    match error {
        kube::Error::Api(status) if status.code == 400 || status.code == 422 => {
            warn!(error = %error, "an Event was refused by the API server")
        }
        _ => debug!(error = %error, "cannot publish an Event"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::text_bounds::CUT_MARK;

    #[test]
    fn a_note_that_fits_is_kept_whole() {
        let note = "x".repeat(MAX_NOTE_BYTES);
        assert_eq!(fit_note(note.clone()), note);
    }

    #[test]
    fn a_long_note_is_cut_on_a_character_boundary_to_the_limit() {
        for filler in ["x", "é", "€", "𝄞"] {
            let note = filler.repeat(2000);
            let fitted = fit_note(note.clone());
            assert!(fitted.len() <= MAX_NOTE_BYTES, "{filler}: {}", fitted.len());
            assert!(
                fitted.len() > MAX_NOTE_BYTES - CUT_MARK.len() - 4,
                "{filler}: {}",
                fitted.len()
            );
            assert!(fitted.ends_with(CUT_MARK));
            assert!(note.starts_with(fitted.trim_end_matches(CUT_MARK)));
        }
    }

    #[test]
    fn events_carry_a_fitted_note() {
        let event = event(EventType::Warning, "Refused", "Install", "é".repeat(600));
        assert!(event.note.is_some_and(|note| note.len() <= MAX_NOTE_BYTES));
    }
}
