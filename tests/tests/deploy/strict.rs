//! Strict parsing of Kubernetes manifests into k8s-openapi's types.
//!
//! k8s-openapi's types ignore fields they do not know, like the API server
//! without `--validate=strict` does: `readinesProbe:` would parse and
//! vanish. So each document is parsed into its type, serialized back, and
//! compared with the YAML it came from: any field the type dropped (a typo,
//! a field of another object, a `null`) or changed (a string where a number
//! belongs) is reported with its path.

use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, ServiceAccount},
    },
    serde::{Deserialize as _, Serialize, de::DeserializeOwned},
};
use serde_json::Value as Json;

/// One parsed document.
#[derive(Debug)]
pub enum Object {
    ServiceAccount(Box<ServiceAccount>),
    ConfigMap(Box<ConfigMap>),
    DaemonSet(Box<DaemonSet>),
}

/// Parses every document of a multi-document YAML text strictly; the error
/// lists every problem of every document.
pub fn parse_all(text: &str) -> Result<Vec<Object>, String> {
    let mut objects = Vec::new();
    let mut problems = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                problems.push(format!("document {i}: not YAML: {e}"));
                continue;
            }
        };
        match parse(&value) {
            Ok(object) => objects.push(object),
            Err(e) => problems.push(format!("document {i}: {e}")),
        }
    }
    if problems.is_empty() {
        Ok(objects)
    } else {
        Err(problems.join("\n"))
    }
}

/// Parses one document by its `apiVersion` and `kind`.
pub fn parse(doc: &serde_yaml::Value) -> Result<Object, String> {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    match (api_version, kind) {
        ("v1", "ServiceAccount") => typed(doc).map(|o| Object::ServiceAccount(Box::new(o))),
        ("v1", "ConfigMap") => typed(doc).map(|o| Object::ConfigMap(Box::new(o))),
        ("apps/v1", "DaemonSet") => typed(doc).map(|o| Object::DaemonSet(Box::new(o))),
        _ => Err(format!(
            "{api_version} {kind}: not a kind this check knows; add its type to strict.rs"
        )),
    }
}

fn typed<T: DeserializeOwned + Serialize>(doc: &serde_yaml::Value) -> Result<T, String> {
    let name = format!(
        "{} {}",
        doc["kind"].as_str().unwrap_or_default(),
        doc["metadata"]["name"].as_str().unwrap_or("(no name)")
    );
    let object: T = serde_yaml::from_value(doc.clone()).map_err(|e| format!("{name}: {e}"))?;
    let back = serde_json::to_value(&object).map_err(|e| format!("{name}: {e}"))?;
    let source = serde_json::to_value(doc).map_err(|e| format!("{name}: {e}"))?;
    let mut problems = Vec::new();
    compare("", &source, &back, &mut problems);
    if problems.is_empty() {
        Ok(object)
    } else {
        Err(format!("{name}:\n  {}", problems.join("\n  ")))
    }
}

/// Walks `source` (the YAML) and `typed` (what the API type kept) together.
fn compare(path: &str, source: &Json, typed: &Json, problems: &mut Vec<String>) {
    match (source, typed) {
        (Json::Object(s), Json::Object(t)) => {
            for (key, value) in s {
                let here = format!("{path}.{key}");
                match t.get(key) {
                    Some(kept) => compare(&here, value, kept, problems),
                    None => problems.push(format!(
                        "{here}: unknown field (misspelt, misplaced or null): the API type drops it"
                    )),
                }
            }
            for key in t.keys().filter(|k| !s.contains_key(*k)) {
                problems.push(format!(
                    "{path}.{key}: added by the API type, not in the manifest"
                ));
            }
        }
        (Json::Array(s), Json::Array(t)) if s.len() == t.len() => {
            for (i, (s, t)) in s.iter().zip(t).enumerate() {
                compare(&format!("{path}[{i}]"), s, t, problems);
            }
        }
        (s, t) if s == t => {}
        (s, t) => problems.push(format!("{path}: {s} in the manifest, {t} after parsing")),
    }
}
