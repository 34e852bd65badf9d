//! Small helpers every layer uses: the time in Unix seconds, and an error
//! with its causes in words.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// An error and its causes, `: `-joined; a cause whose words the message
/// already carries (`{path}: {source}` errors) is not said twice. A
/// transport error's own message is only "transport error": its causes say
/// what happened.
pub fn error_words(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let words = c.to_string();
        if !text.contains(&words) {
            text.push_str(": ");
            text.push_str(&words);
        }
        cause = c.source();
    }
    text
}
