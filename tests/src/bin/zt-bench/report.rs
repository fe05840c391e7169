//! The report of one benchmark run: the targets (evaluated on the
//! cross-node medians, ratios within the run) and the markdown table.
//! `cargo xtask bench` draws its chart from the same `targets` list in the
//! JSON, so the three views never disagree.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::SCENARIOS;

/// Which way a target points.
#[derive(Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

/// One target of the issue, as a ratio between two scenarios (or an
/// absolute figure of `mesh-ebpf` when `over` is `None`).
struct Target {
    name: &'static str,
    metric: &'static str,
    over: Option<&'static str>,
    bound: Bound,
}

const TARGETS: [Target; 6] = [
    Target {
        name: "conn/s, mesh-ebpf / mesh-iptables",
        metric: "conn_per_s",
        over: Some("mesh-iptables"),
        bound: Bound::AtLeast(1.3),
    },
    Target {
        name: "RR p50, mesh-ebpf / mesh-iptables",
        metric: "rr_p50_us",
        over: Some("mesh-iptables"),
        bound: Bound::AtMost(0.8),
    },
    Target {
        name: "throughput, mesh-ebpf / mesh-iptables",
        metric: "throughput_gbps",
        over: Some("mesh-iptables"),
        bound: Bound::AtLeast(1.0),
    },
    Target {
        name: "throughput, mesh-ebpf / direct",
        metric: "throughput_gbps",
        over: Some("direct"),
        bound: Bound::AtLeast(0.5),
    },
    Target {
        name: "ztunnel CPU per 1k rps (busier ztunnel, cores)",
        metric: "cpu_per_1k_rps_one",
        over: None,
        bound: Bound::AtMost(0.03),
    },
    Target {
        name: "ztunnel RSS idle (MiB)",
        metric: "rss_idle_mb",
        over: None,
        bound: Bound::AtMost(8.0),
    },
];

/// The targets evaluated on `scenarios` (cross-node), as JSON objects
/// `{name, value, op, target, met}`; `value` is null when a figure is
/// missing (a filtered run), and then `met` is false.
pub fn targets(scenarios: &Value) -> Value {
    let get = |s: &str, k: &str| scenarios[s]["cross_node"][k].as_f64();
    let list: Vec<Value> = TARGETS
        .iter()
        .map(|t| {
            let value = match t.over {
                Some(base) => get("mesh-ebpf", t.metric)
                    .zip(get(base, t.metric))
                    .filter(|(_, b)| *b > 0.0)
                    .map(|(a, b)| a / b),
                None => get("mesh-ebpf", t.metric),
            };
            let (op, bound) = match t.bound {
                Bound::AtLeast(v) => (">=", v),
                Bound::AtMost(v) => ("<=", v),
            };
            let met = value.is_some_and(|v| match t.bound {
                Bound::AtLeast(b) => v >= b,
                Bound::AtMost(b) => v <= b,
            });
            json!({
                "name": t.name,
                "value": value.map(|v| (v * 1000.0).round() / 1000.0),
                "op": op,
                "target": bound,
                "ratio": t.over.is_some(),
                "met": met,
            })
        })
        .collect();
    Value::Array(list)
}

/// The markdown table (every scenario and placement) and the target list.
pub fn markdown(result: &Value) -> String {
    let mut out = String::new();
    let sc = &result["scenarios"];
    let hold = result["hold_connections"].as_u64().unwrap_or(0);
    let columns: [(&str, &str); 15] = [
        ("throughput_gbps", "Gbit/s 1 stream"),
        ("throughput4_gbps", "Gbit/s 4 streams"),
        ("rr_p50_us", "RR p50 µs"),
        ("rr_p99_us", "RR p99 µs"),
        ("rr_p999_us", "RR p999 µs"),
        ("rr_fixed_p50_us", "RR@1k/s p50 µs"),
        ("rr_fixed_p99_us", "RR@1k/s p99 µs"),
        ("rr_fixed_p999_us", "RR@1k/s p999 µs"),
        ("conn_per_s", "conn/s"),
        ("cpu_per_1k_rps_one", "CPU per 1k rps, busier ztunnel"),
        ("cpu_per_1k_rps", "CPU per 1k rps, both ztunnels"),
        (
            "cpu_per_1k_rps_max_rate",
            "CPU per 1k rps at max rate, both",
        ),
        (
            "cpu_per_1k_rps_max_rate_one",
            "CPU per 1k rps at max rate, busier",
        ),
        ("rss_idle_mb", "RSS idle MiB"),
        ("rss_10k_conns_mb", ""),
    ];
    let hold_header = format!("RSS with {hold} conns MiB");
    out.push_str("| scenario | placement |");
    for (key, header) in columns {
        let header = if key == "rss_10k_conns_mb" {
            hold_header.as_str()
        } else {
            header
        };
        let _ = write!(out, " {header} |");
    }
    out.push_str("\n|---|---|");
    out.push_str(&"---|".repeat(columns.len()));
    out.push('\n');
    for scenario in SCENARIOS {
        for placement in ["same_node", "cross_node"] {
            let m = &sc[scenario][placement];
            let _ = write!(out, "| {scenario} | {placement} |");
            for (key, _) in columns {
                let cell = m[key].as_f64().map_or("-".to_owned(), |v| format!("{v}"));
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }
    out.push_str("\nTargets (cross-node, same run):\n\n");
    for t in result["targets"].as_array().into_iter().flatten() {
        let value = t["value"]
            .as_f64()
            .map_or("-".to_owned(), |v| format!("{v:.3}"));
        let unit = if t["ratio"].as_bool() == Some(true) {
            "x"
        } else {
            ""
        };
        let verdict = if t["met"].as_bool() == Some(true) {
            "met"
        } else {
            "missed"
        };
        let _ = writeln!(
            out,
            "- {}: {value}{unit} (target {} {}{unit}): {verdict}",
            t["name"].as_str().unwrap_or_default(),
            t["op"].as_str().unwrap_or_default(),
            t["target"],
        );
    }
    out
}
