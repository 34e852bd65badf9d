//! Strict parsing of YAML files that people write (policies, node
//! descriptions, sharing configs): unknown keys and wrong types are errors
//! that name the file, the key's path and the line, e.g.
//! `policy.yaml: spec.devicePlugin.enabeld: unknown key (expected one of: enabled, config) at line 4 column 5`.

use serde::de::DeserializeOwned;

/// A YAML document that does not fit its schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {path}: {message}{}", location.map(|(l, c)| format!(" at line {l} column {c}")).unwrap_or_default())]
pub struct YamlError {
    /// The file (or other source) the text came from.
    pub origin: String,
    /// The key's path, e.g. `spec.devicePlugin.enabeld` or `gpus[3].uuid`;
    /// `(document)` for errors about the whole text.
    pub path: String,
    /// What is wrong, in plain words.
    pub message: String,
    /// 1-based line and column, when the parser knows them.
    pub location: Option<(usize, usize)>,
}

impl YamlError {
    /// An error found after parsing (a validation rule), without a location.
    pub fn invalid(origin: &str, path: impl Into<String>, message: impl Into<String>) -> Self {
        YamlError {
            origin: origin.to_string(),
            path: path.into(),
            message: message.into(),
            location: None,
        }
    }
}

/// Parses `text` into `T`, reporting the path of the offending key.
/// `origin` names the source in errors. An empty document parses as `T`'s
/// empty map (so that a file with only comments means "all defaults").
pub fn from_yaml<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, YamlError> {
    let text = if text
        .trim()
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        "{}"
    } else {
        text
    };
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        // serde_path_to_error writes `?` for a key it never got to read
        // (a syntax error): report the part of the path that is known.
        let path = e.path().to_string();
        let path = path.trim_end_matches('?').trim_end_matches('.').to_string();
        let inner = e.into_inner();
        let location = inner.location().map(|l| (l.line(), l.column()));
        YamlError {
            origin: origin.to_string(),
            path: if path.is_empty() {
                "(document)".into()
            } else {
                path
            },
            message: plain_message(&inner.to_string()),
            location,
        }
    })
}

/// Turns serde's message into plain words: drops the path prefix and the
/// location suffix (both reported separately) and rewords unknown fields.
fn plain_message(raw: &str) -> String {
    let mut msg = raw;
    if let Some(i) = msg.rfind(" at line ") {
        msg = &msg[..i];
    }
    // serde_yaml_ng prefixes nested errors with "path: ".
    if let Some((head, rest)) = msg.split_once(": ")
        && !head.contains(' ')
    {
        msg = rest;
    }
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        let expected = rest.split_once(", expected ").map(|(_, e)| choices(e));
        return match expected {
            Some(e) => format!("unknown key (expected one of: {e})"),
            None => "unknown key (this section takes no keys)".to_string(),
        };
    }
    if let Some(rest) = msg.strip_prefix("unknown variant `") {
        let (value, expected) = rest.split_once("`, expected ").unwrap_or((rest, ""));
        return format!(
            "unknown value {value:?} (expected one of: {})",
            choices(expected)
        );
    }
    // Rust type names mean nothing to the person editing the file.
    if let Some(i) = msg.find("expected struct ") {
        return format!("{}expected a mapping of keys", &msg[..i]);
    }
    for (rust, plain) in [
        ("expected u8", "expected a whole number from 0 to 255"),
        ("expected u16", "expected a whole number from 0 to 65535"),
        ("expected u32", "expected a whole number of 0 or more"),
        ("expected u64", "expected a whole number of 0 or more"),
        ("expected usize", "expected a whole number of 0 or more"),
        ("expected i32", "expected a whole number"),
        ("expected i64", "expected a whole number"),
    ] {
        if let Some(head) = msg.strip_suffix(rust) {
            return format!("{head}{plain}");
        }
    }
    msg.to_string()
}

/// serde's "one of `a`, `b`" / "`a` or `b`" as "a, b".
fn choices(expected: &str) -> String {
    expected
        .trim_start_matches("one of ")
        .replace(" or ", ", ")
        .replace('`', "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    struct Top {
        #[serde(default)]
        spec: Spec,
    }
    #[derive(Debug, Deserialize, PartialEq, Default)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    struct Spec {
        #[serde(default)]
        device_plugin: Plugin,
        #[serde(default)]
        mode: Option<Mode>,
    }
    #[derive(Debug, Deserialize, PartialEq, Default)]
    #[serde(deny_unknown_fields)]
    struct Plugin {
        #[serde(default)]
        enabled: bool,
    }
    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "lowercase")]
    enum Mode {
        Single,
        Mixed,
    }

    #[test]
    fn unknown_key_has_full_path_and_line() {
        let err =
            from_yaml::<Top>("spec:\n  devicePlugin:\n    enabeld: true\n", "p.yaml").unwrap_err();
        assert_eq!(err.path, "spec.devicePlugin.enabeld");
        assert_eq!(err.message, "unknown key (expected one of: enabled)");
        assert_eq!(err.location, Some((3, 5)));
        assert_eq!(
            err.to_string(),
            "p.yaml: spec.devicePlugin.enabeld: unknown key (expected one of: enabled) at line 3 column 5"
        );
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err =
            from_yaml::<Top>("spec:\n  devicePlugin:\n    enabled: maybe\n", "p.yaml").unwrap_err();
        assert_eq!(err.path, "spec.devicePlugin.enabled");
        assert!(
            err.message.contains("expected a boolean"),
            "{}",
            err.message
        );
    }

    #[test]
    fn section_of_the_wrong_shape_says_a_mapping_is_expected() {
        let err = from_yaml::<Top>("spec:\n  devicePlugin: true\n", "p.yaml").unwrap_err();
        assert_eq!(err.path, "spec.devicePlugin");
        assert_eq!(
            err.message,
            "invalid type: boolean `true`, expected a mapping of keys"
        );
    }

    #[test]
    fn unknown_enum_value_lists_choices() {
        let err = from_yaml::<Top>("spec:\n  mode: both\n", "p.yaml").unwrap_err();
        assert_eq!(err.path, "spec.mode");
        assert_eq!(
            err.message,
            "unknown value \"both\" (expected one of: single, mixed)"
        );
    }

    #[test]
    fn empty_and_comment_only_documents_are_defaults() {
        assert_eq!(
            from_yaml::<Top>("", "e").unwrap(),
            Top {
                spec: Spec::default()
            }
        );
        assert_eq!(
            from_yaml::<Top>("# nothing\n\n", "e").unwrap(),
            Top {
                spec: Spec::default()
            }
        );
    }

    #[test]
    fn syntax_error_has_a_location() {
        let err = from_yaml::<Top>("spec: [unclosed\n", "p.yaml").unwrap_err();
        assert!(err.location.is_some(), "{err}");
    }
}
