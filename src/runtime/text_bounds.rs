//! What stackd tells users fits what kube-apiserver accepts: a condition message or an Event note past
//! its limit is cut on a character boundary, with a mark of the cut, instead of being refused (a
//! refused status write or Event is one nobody reads). Listed with every other bound in
//! `crate::bounds`.

/// kube-apiserver's limit on an events.k8s.io/v1 Event's `note`, in bytes: a longer one is refused
/// (422), and an Event refused is one nobody reads.
pub const MAX_EVENT_NOTE_BYTES: usize = 1024;
/// kube-apiserver's limit on a `metav1.Condition` message, in bytes.
pub const MAX_CONDITION_MESSAGE_BYTES: usize = 32 * 1024;
/// What a cut text ends with, so a reader knows there was more.
pub const CUT_MARK: &str = " …";

/// `text` itself when it is at most `max` bytes, else its longest prefix that fits with a mark of
/// the cut after it, cut on a character boundary.
pub fn fit_text(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max.saturating_sub(CUT_MARK.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push_str(CUT_MARK);
    text
}
