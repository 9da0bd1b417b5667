//! The JSON documents `--json` and `--json-out` write: the keys every one carries and the version
//! a reader checks. docs/cli.md is the reference.

use serde::Serialize;

/// Raised when a key is removed or changes meaning; keys may be added without raising it.
pub const SCHEMA_VERSION: u32 = 1;

/// One command's document: the shared keys, then the command's own keys beside them.
#[derive(Serialize)]
struct Document<'a, T> {
    schema_version: u32,
    command: &'static str,
    /// Null when the command did its job; otherwise why not, and the report's keys may be absent.
    error: Option<&'a str>,
    #[serde(flatten)]
    report: &'a T,
}

/// What a command that could not run reports beside its error.
#[derive(Serialize)]
pub struct Failure {
    /// The driver library the loader tried, so a missing driver is visible in the document.
    pub library_tried: String,
}

impl Failure {
    pub fn new() -> Self {
        Self { library_tried: cumempool::sys::library_to_open() }
    }
}

/// The document of `command`, pretty-printed.
pub fn document<T: Serialize>(command: &'static str, error: Option<&str>, report: &T) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&Document { schema_version: SCHEMA_VERSION, command, error, report })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_a_document_with_its_error_and_the_library_tried() {
        let failure = Failure { library_tried: "/nonexistent/libcuda.so.1".into() };
        let text = document("routes", Some("no driver"), &failure).unwrap_or_default();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(value["schema_version"], SCHEMA_VERSION);
        assert_eq!(value["command"], "routes");
        assert_eq!(value["error"], "no driver");
        assert_eq!(value["library_tried"], "/nonexistent/libcuda.so.1");
    }
}
