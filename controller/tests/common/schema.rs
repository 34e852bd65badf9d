//! Checks an object against the real Kubernetes 1.36 OpenAPI v3 schemas in
//! `../shared/k8s-openapi-v1.36`, as the API server's strict field
//! validation does: a field the schema does not list is an error, and so is
//! a value of the wrong type or a missing required field.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/k8s-openapi-v1.36")
}

/// Every schema of every group, by name (`io.k8s.api.core.v1.Node`).
pub fn load() -> BTreeMap<String, Value> {
    let mut all = BTreeMap::new();
    let d = dir();
    let entries = std::fs::read_dir(&d).unwrap_or_else(|e| {
        panic!(
            "{}: the API schemas are needed beside the repository: {e}",
            d.display()
        )
    });
    for e in entries {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "json") || p.ends_with("version.json") {
            continue;
        }
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        if let Some(s) = doc["components"]["schemas"].as_object() {
            for (k, v) in s {
                all.insert(k.clone(), v.clone());
            }
        }
    }
    assert!(
        all.contains_key("io.k8s.api.core.v1.Node"),
        "no Node schema in {}",
        d.display()
    );
    all
}

/// The errors of `value` as a `name` (empty: the API server takes it).
/// `partial`: a patch body, whose required fields may be elsewhere and
/// whose nulls remove fields.
pub fn check(
    schemas: &BTreeMap<String, Value>,
    name: &str,
    value: &Value,
    partial: bool,
) -> Vec<String> {
    let mut errs = Vec::new();
    let s = schemas
        .get(name)
        .unwrap_or_else(|| panic!("no schema {name}"));
    walk(schemas, s, value, "", partial, &mut errs);
    errs
}

fn walk(
    all: &BTreeMap<String, Value>,
    s: &Value,
    v: &Value,
    path: &str,
    partial: bool,
    errs: &mut Vec<String>,
) {
    // In a merge patch, null removes the field (RFC 7386).
    if partial && v.is_null() && !path.is_empty() {
        return;
    }
    if let Some(r) = s["$ref"].as_str() {
        let name = r.trim_start_matches("#/components/schemas/");
        match all.get(name) {
            Some(t) => walk(all, t, v, path, partial, errs),
            None => errs.push(format!("{path}: unknown schema {name}")),
        }
        return;
    }
    if let Some(list) = s["allOf"].as_array() {
        for sub in list {
            walk(all, sub, v, path, partial, errs);
        }
    }
    if s["x-kubernetes-int-or-string"] == Value::Bool(true) {
        if !(v.is_string() || v.is_i64() || v.is_u64()) {
            errs.push(format!("{path}: not an int or a string"));
        }
        return;
    }
    // An object schema with neither properties nor additionalProperties is
    // free-form: the API server keeps what it is given (RawExtension, such
    // as a DRA config's opaque `parameters`; FieldsV1).
    let free_form = s["type"] == "object"
        && s.get("properties").is_none()
        && s.get("additionalProperties").is_none();
    let preserve = free_form || s["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
    match s["type"].as_str() {
        Some("object") => {
            let Some(obj) = v.as_object() else {
                errs.push(format!("{path}: not an object"));
                return;
            };
            let props = s["properties"].as_object();
            for (k, val) in obj {
                let at = format!("{path}.{k}");
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => walk(all, ps, val, &at, partial, errs),
                    None => match s.get("additionalProperties") {
                        Some(ap) if ap.is_object() => walk(all, ap, val, &at, partial, errs),
                        _ if preserve => {}
                        _ => errs.push(format!("{at}: unknown field")),
                    },
                }
            }
            if !partial {
                for r in s["required"].as_array().into_iter().flatten() {
                    let r = r.as_str().unwrap();
                    if !obj.contains_key(r) {
                        errs.push(format!("{path}.{r}: required"));
                    }
                }
            }
        }
        Some("array") => match v.as_array() {
            Some(items) => {
                for (n, item) in items.iter().enumerate() {
                    walk(
                        all,
                        &s["items"],
                        item,
                        &format!("{path}[{n}]"),
                        partial,
                        errs,
                    );
                }
            }
            None => errs.push(format!("{path}: not an array")),
        },
        Some("string") => {
            if !v.is_string() {
                errs.push(format!("{path}: not a string"));
            } else if s["format"] == "date-time"
                && v.as_str().unwrap().parse::<jiff::Timestamp>().is_err()
            {
                errs.push(format!("{path}: not an RFC 3339 time"));
            }
        }
        Some("integer") if !(v.is_i64() || v.is_u64()) => {
            errs.push(format!("{path}: not an integer"))
        }
        Some("number") if !v.is_number() => errs.push(format!("{path}: not a number")),
        Some("boolean") if !v.is_boolean() => errs.push(format!("{path}: not a boolean")),
        _ => {}
    }
}
