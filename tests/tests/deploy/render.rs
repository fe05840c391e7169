//! Renders `deploy/chart` the way `helm template` does, without helm: the
//! templates are Go templates, executed by gtmpl with the few Sprig/Helm
//! functions the chart uses registered by hand.
//!
//! What is the same as helm: values.yaml deep-merged with the overrides, the
//! `.Values`/`.Release`/`.Chart` objects, templates rendered one by one,
//! empty results dropped, documents ordered by kind as helm installs them,
//! each behind `---` and `# Source: <chart>/templates/<file>`. What differs:
//! `toYaml` is serde_yaml's emitter, so a string that looks like a number or
//! a boolean is quoted `'true'` where helm writes `"true"`: the same YAML
//! values, other bytes. The chart uses no `include`/`tpl` (gtmpl functions
//! cannot reach the template set), and no `range` over maps (gtmpl walks a
//! map in hash order, Go in key order).

use std::{collections::HashMap, fmt::Write as _, path::Path};

use gtmpl::{Context, FuncError, Template, Value};

/// Kinds in the order helm installs (and `helm template` prints) them; the
/// chart renders no other kind.
const KIND_ORDER: &[&str] = &["ServiceAccount", "ConfigMap", "DaemonSet"];

/// The release a rendering is for: what `helm template NAME CHART
/// --namespace NAMESPACE -f OVERRIDES` gets on its command line.
pub struct Release<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    /// YAML merged over values.yaml (like `-f`).
    pub overrides: &'a str,
}

/// Renders the chart in `chart_dir` to one multi-document YAML text.
pub fn render(chart_dir: &Path, release: &Release<'_>) -> Result<String, String> {
    let read = |name: &str| {
        std::fs::read_to_string(chart_dir.join(name))
            .map_err(|e| format!("{}: {e}", chart_dir.join(name).display()))
    };
    let chart: serde_yaml::Value =
        serde_yaml::from_str(&read("Chart.yaml")?).map_err(|e| format!("Chart.yaml: {e}"))?;
    let mut values: serde_yaml::Value =
        serde_yaml::from_str(&read("values.yaml")?).map_err(|e| format!("values.yaml: {e}"))?;
    let overrides: serde_yaml::Value =
        serde_yaml::from_str(release.overrides).map_err(|e| format!("overrides: {e}"))?;
    check_known_keys(&values, &overrides, "")?;
    merge(&mut values, overrides);

    let chart_name = chart["name"].as_str().ok_or("Chart.yaml: no name")?;
    let chart_field = |key: &str| Value::from(chart[key].as_str().unwrap_or_default());
    let root = Value::Map(HashMap::from([
        ("Values".to_owned(), to_template_value(&values)),
        (
            "Release".to_owned(),
            Value::Map(HashMap::from([
                ("Name".to_owned(), Value::from(release.name)),
                ("Namespace".to_owned(), Value::from(release.namespace)),
                ("Service".to_owned(), Value::from("Helm")),
            ])),
        ),
        (
            "Chart".to_owned(),
            Value::Map(HashMap::from([
                ("Name".to_owned(), chart_field("name")),
                ("Version".to_owned(), chart_field("version")),
                ("AppVersion".to_owned(), chart_field("appVersion")),
            ])),
        ),
    ]));

    let mut files: Vec<_> = std::fs::read_dir(chart_dir.join("templates"))
        .map_err(|e| format!("templates: {e}"))?
        .map(|entry| entry.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("templates: {e}"))?;
    files.retain(|f| Path::new(f).extension().is_some_and(|e| e == "yaml"));
    files.sort();

    let mut documents = Vec::new();
    for file in files {
        let text = read(&format!("templates/{file}"))?;
        let mut template = Template::default();
        template.add_funcs(FUNCTIONS);
        template
            .parse(text)
            .map_err(|e| format!("templates/{file}: {e}"))?;
        let out = template
            .render(&Context::from(root.clone()))
            .map_err(|e| format!("templates/{file}: {e}"))?;
        if out.contains("<no value>") {
            return Err(format!(
                "templates/{file}: uses a value that is not in values.yaml"
            ));
        }
        let out = out.trim();
        if out.is_empty() {
            continue;
        }
        let kind = serde_yaml::from_str::<serde_yaml::Value>(out)
            .map_err(|e| format!("templates/{file} renders invalid YAML: {e}\n{out}"))?["kind"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("templates/{file}: no kind"))?;
        let rank = KIND_ORDER
            .iter()
            .position(|k| *k == kind)
            .ok_or_else(|| format!("templates/{file}: kind {kind} is not in KIND_ORDER"))?;
        documents.push((rank, file, out.to_owned()));
    }
    documents.sort();
    let mut text = String::new();
    for (_, file, body) in documents {
        let _ = write!(
            text,
            "---\n# Source: {chart_name}/templates/{file}\n{body}\n"
        );
    }
    Ok(text)
}

/// An override that names no value of values.yaml is a typo (helm would
/// ignore it silently; its values.schema.json is the same guard).
fn check_known_keys(
    values: &serde_yaml::Value,
    overrides: &serde_yaml::Value,
    path: &str,
) -> Result<(), String> {
    let (Some(values), Some(overrides)) = (values.as_mapping(), overrides.as_mapping()) else {
        return Ok(());
    };
    for (key, value) in overrides {
        let name = key.as_str().unwrap_or_default();
        let here = format!("{path}{name}");
        match values.get(key) {
            // A map of free-form entries (podAnnotations, localConfig) takes any key.
            Some(v) if v.as_mapping().is_some_and(serde_yaml::Mapping::is_empty) => {}
            Some(v) => check_known_keys(v, value, &format!("{here}."))?,
            None => return Err(format!("override {here} is not a value of the chart")),
        }
    }
    Ok(())
}

/// Helm's merge of values: maps merge key by key, anything else replaces.
fn merge(base: &mut serde_yaml::Value, over: serde_yaml::Value) {
    match (base, over) {
        (serde_yaml::Value::Mapping(base), serde_yaml::Value::Mapping(over)) => {
            for (key, value) in over {
                match base.get_mut(&key) {
                    Some(slot) => merge(slot, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (slot, over) if !over.is_null() => *slot = over,
        _ => {}
    }
}

fn to_template_value(v: &serde_yaml::Value) -> Value {
    match v {
        serde_yaml::Value::Null => Value::Nil,
        serde_yaml::Value::Bool(b) => Value::from(*b),
        serde_yaml::Value::Number(n) => n
            .as_u64()
            .map(Value::from)
            .or_else(|| n.as_i64().map(Value::from))
            .unwrap_or_else(|| Value::from(n.as_f64().unwrap_or_default())),
        serde_yaml::Value::String(s) => Value::from(s.as_str()),
        serde_yaml::Value::Sequence(items) => {
            Value::Array(items.iter().map(to_template_value).collect())
        }
        serde_yaml::Value::Mapping(map) => Value::Map(
            map.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().unwrap_or_default().to_owned(),
                        to_template_value(v),
                    )
                })
                .collect(),
        ),
        serde_yaml::Value::Tagged(t) => to_template_value(&t.value),
    }
}

/// Back to YAML, maps with their keys sorted (as Go's encoder writes them).
fn to_yaml_value(v: &Value) -> Result<serde_yaml::Value, FuncError> {
    Ok(match v {
        Value::Nil | Value::NoValue => serde_yaml::Value::Null,
        Value::Bool(b) => serde_yaml::Value::Bool(*b),
        Value::String(s) => serde_yaml::Value::String(s.clone()),
        Value::Number(n) => n
            .as_u64()
            .map(serde_yaml::Value::from)
            .or_else(|| n.as_i64().map(serde_yaml::Value::from))
            .or_else(|| n.as_f64().map(serde_yaml::Value::from))
            .ok_or(FuncError::UnableToConvertFromValue)?,
        Value::Array(items) => {
            serde_yaml::Value::Sequence(items.iter().map(to_yaml_value).collect::<Result<_, _>>()?)
        }
        Value::Map(map) | Value::Object(map) => {
            let mut keys: Vec<_> = map.keys().collect();
            keys.sort();
            let mut out = serde_yaml::Mapping::new();
            for key in keys {
                out.insert(key.as_str().into(), to_yaml_value(&map[key])?);
            }
            serde_yaml::Value::Mapping(out)
        }
        Value::Function(_) => return Err(FuncError::UnableToConvertFromValue),
    })
}

const FUNCTIONS: &[(&str, gtmpl::Func)] = &[
    ("toYaml", to_yaml),
    ("indent", indent),
    ("nindent", nindent),
    ("quote", quote),
    ("default", default),
    ("ternary", ternary),
    ("add", add),
    ("fail", fail),
];

fn arg<'a>(args: &'a [Value], i: usize, name: &str) -> Result<&'a Value, FuncError> {
    args.get(i)
        .ok_or_else(|| FuncError::ExactlyXArgs(name.to_owned(), i + 1))
}

/// Helm's `toYaml`: the YAML of a value, without the final newline.
fn to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let yaml = serde_yaml::to_string(&to_yaml_value(arg(args, 0, "toYaml")?)?)
        .map_err(|e| FuncError::Generic(e.to_string()))?;
    Ok(Value::from(yaml.trim_end_matches('\n')))
}

fn pad(width: &Value, text: &Value) -> Result<String, FuncError> {
    let Value::Number(n) = width else {
        return Err(FuncError::UnableToConvertFromValue);
    };
    let pad = " ".repeat(
        n.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or(FuncError::UnableToConvertFromValue)?,
    );
    Ok(format!(
        "{pad}{}",
        text.to_string().replace('\n', &format!("\n{pad}"))
    ))
}

/// Sprig's `indent N text`: every line indented by N spaces.
fn indent(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::from(pad(
        arg(args, 0, "indent")?,
        arg(args, 1, "indent")?,
    )?))
}

/// Sprig's `nindent N text`: a newline, then `indent`.
fn nindent(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::from(format!(
        "\n{}",
        pad(arg(args, 0, "nindent")?, arg(args, 1, "nindent")?)?
    )))
}

/// Sprig's `quote`: a double-quoted string (Go's `%q` for what the chart quotes).
fn quote(args: &[Value]) -> Result<Value, FuncError> {
    let text = arg(args, 0, "quote")?.to_string();
    Ok(Value::from(
        serde_json::to_string(&text).map_err(|e| FuncError::Generic(e.to_string()))?,
    ))
}

/// Sprig's `default DEFAULT value`: the value unless it is empty.
fn default(args: &[Value]) -> Result<Value, FuncError> {
    let fallback = arg(args, 0, "default")?;
    Ok(match args.get(1) {
        Some(v) if is_set(v) => v.clone(),
        _ => fallback.clone(),
    })
}

/// Sprig's `ternary IF_TRUE IF_FALSE condition`.
fn ternary(args: &[Value]) -> Result<Value, FuncError> {
    let condition = arg(args, 2, "ternary")?;
    Ok(if is_set(condition) {
        args[0].clone()
    } else {
        args[1].clone()
    })
}

/// Sprig's `add`: the sum of integers.
fn add(args: &[Value]) -> Result<Value, FuncError> {
    let mut sum = 0i64;
    for v in args {
        let Value::Number(n) = v else {
            return Err(FuncError::UnableToConvertFromValue);
        };
        sum += n.as_i64().ok_or(FuncError::UnableToConvertFromValue)?;
    }
    Ok(Value::from(sum))
}

/// Helm's `fail message`: stops the rendering with the message.
fn fail(args: &[Value]) -> Result<Value, FuncError> {
    Err(FuncError::Generic(arg(args, 0, "fail")?.to_string()))
}

/// Go template truth (Sprig's `empty`, negated).
fn is_set(v: &Value) -> bool {
    match v {
        Value::Nil | Value::NoValue => false,
        Value::Bool(b) => *b,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Map(m) | Value::Object(m) => !m.is_empty(),
        Value::Number(n) => n
            .as_u64()
            .map(|u| u != 0)
            .or_else(|| n.as_i64().map(|i| i != 0))
            .or_else(|| n.as_f64().map(|f| f != 0.0))
            .unwrap_or(true),
        Value::Function(_) => true,
    }
}
