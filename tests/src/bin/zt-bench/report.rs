//! The report of one benchmark run: the targets of issue 15 (ratios to the
//! direct path of the same run, cross-node unless named), information lines
//! that are not targets, the A/B comparison of two builds, and the markdown
//! tables. `cargo xtask bench` draws its chart from the same `targets`
//! list in the JSON, so the views never disagree.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::METRICS;

/// Which way a target points.
#[derive(Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Bound {
    fn met(self, v: f64) -> bool {
        match self {
            Self::AtLeast(b) => v >= b,
            Self::AtMost(b) => v <= b,
        }
    }

    fn op_and_value(self) -> (&'static str, f64) {
        match self {
            Self::AtLeast(v) => (">=", v),
            Self::AtMost(v) => ("<=", v),
        }
    }
}

/// One target: the scenario's figure over direct's (`ratio`), or the
/// figure itself.
struct Target {
    what: &'static str,
    metric: &'static str,
    placement: &'static str,
    ratio: bool,
    bound: Bound,
}

const CROSS: &str = "cross_node";
const SAME: &str = "same_node";

/// Issue 15's targets.
const TARGETS: [Target; 8] = [
    Target {
        what: "Gbit/s 1 stream",
        metric: "throughput_gbps",
        placement: CROSS,
        ratio: true,
        bound: Bound::AtLeast(0.5),
    },
    Target {
        what: "Gbit/s 4 streams",
        metric: "throughput4_gbps",
        placement: CROSS,
        ratio: true,
        bound: Bound::AtLeast(0.4),
    },
    Target {
        what: "RR p50",
        metric: "rr_p50_us",
        placement: CROSS,
        ratio: true,
        bound: Bound::AtMost(1.6),
    },
    Target {
        what: "RR p99",
        metric: "rr_p99_us",
        placement: CROSS,
        ratio: true,
        bound: Bound::AtMost(1.4),
    },
    Target {
        what: "conn/s",
        metric: "conn_per_s",
        placement: CROSS,
        ratio: true,
        bound: Bound::AtLeast(0.45),
    },
    Target {
        what: "same-node Gbit/s",
        metric: "throughput_gbps",
        placement: SAME,
        ratio: true,
        bound: Bound::AtLeast(0.8),
    },
    Target {
        what: "same-node RR p50",
        metric: "rr_p50_us",
        placement: SAME,
        ratio: true,
        bound: Bound::AtMost(1.3),
    },
    Target {
        what: "ztunnel RSS idle (MiB)",
        metric: "rss_idle_mb",
        placement: CROSS,
        ratio: false,
        bound: Bound::AtMost(8.0),
    },
];

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// `a`'s figure over `b`'s, when both exist and `b`'s is not 0.
fn ratio(scenarios: &Value, a: &str, b: &str, placement: &str, metric: &str) -> Option<f64> {
    let get = |s: &str| scenarios[s][placement][metric].as_f64();
    get(a)
        .zip(get(b))
        .filter(|(_, d)| *d > 0.0)
        .map(|(x, d)| x / d)
}

/// The targets evaluated for `scenario` (`mesh-ebpf`, or the baseline's),
/// as JSON objects `{name, placement, value, op, target, ratio, met,
/// bare_relay}`; `value` is null when a figure is missing (a filtered run),
/// and then `met` is false. `bare_relay` is the relay's ratio to direct:
/// the floor a userspace proxy reaches in the same run.
pub fn targets(scenarios: &Value, scenario: &str) -> Value {
    let list: Vec<Value> = TARGETS
        .iter()
        .map(|t| {
            let (value, floor) = if t.ratio {
                (
                    ratio(scenarios, scenario, "direct", t.placement, t.metric),
                    ratio(scenarios, "bare-relay", "direct", t.placement, t.metric),
                )
            } else {
                (scenarios[scenario][t.placement][t.metric].as_f64(), None)
            };
            let name = if t.ratio {
                format!("{}, {scenario} / direct", t.what)
            } else {
                format!("{}, {scenario}", t.what)
            };
            let (op, bound) = t.bound.op_and_value();
            json!({
                "name": name,
                "placement": t.placement,
                "value": value.map(round3),
                "op": op,
                "target": bound,
                "ratio": t.ratio,
                "met": value.is_some_and(|v| t.bound.met(v)),
                "bare_relay": floor.map(round3),
            })
        })
        .collect();
    Value::Array(list)
}

/// Lines that are not targets (cross-node): the older mesh-ebpf /
/// mesh-iptables ratios, and the proxy CPU per request (both nodes' proxies
/// at 1,000 requests/s; `cpu_per_1k_rps` is cores per 1,000 requests/s,
/// so ×1000 gives µs per request). A line whose figures are missing is
/// left out.
pub fn information(scenarios: &Value) -> Value {
    let mut list = Vec::new();
    for (what, metric) in [
        ("conn/s", "conn_per_s"),
        ("RR p50", "rr_p50_us"),
        ("Gbit/s 1 stream", "throughput_gbps"),
    ] {
        if let Some(v) = ratio(scenarios, "mesh-ebpf", "mesh-iptables", CROSS, metric) {
            list.push(json!({
                "name": format!("{what}, mesh-ebpf / mesh-iptables"),
                "value": round3(v),
                "unit": "x",
            }));
        }
    }
    for scenario in ["mesh-ebpf", "mesh-ebpf@baseline", "bare-relay"] {
        if let Some(v) = scenarios[scenario][CROSS]["cpu_per_1k_rps"].as_f64() {
            list.push(json!({
                "name": format!("proxy CPU per request at 1,000/s, both nodes, {scenario}"),
                "value": round3(v * 1000.0),
                "unit": " µs",
            }));
        }
    }
    Value::Array(list)
}

/// The A/B comparison: for each placement and metric, `{current, baseline,
/// current_over_baseline, current_over_direct, baseline_over_direct,
/// bare_relay_over_direct}` (null where a figure is missing).
pub fn ab(scenarios: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for placement in [SAME, CROSS] {
        let mut metrics = serde_json::Map::new();
        for metric in METRICS {
            let r = |a: &str, b: &str| ratio(scenarios, a, b, placement, metric).map(round3);
            metrics.insert(
                metric.into(),
                json!({
                    "current": scenarios["mesh-ebpf"][placement][metric],
                    "baseline": scenarios["mesh-ebpf@baseline"][placement][metric],
                    "current_over_baseline": r("mesh-ebpf", "mesh-ebpf@baseline"),
                    "current_over_direct": r("mesh-ebpf", "direct"),
                    "baseline_over_direct": r("mesh-ebpf@baseline", "direct"),
                    "bare_relay_over_direct": r("bare-relay", "direct"),
                }),
            );
        }
        out.insert(placement.into(), Value::Object(metrics));
    }
    Value::Object(out)
}

/// Column headers of the metrics (the hold count is filled in).
fn header(metric: &str, hold: u64) -> String {
    match metric {
        "throughput_gbps" => "Gbit/s 1 stream".into(),
        "throughput4_gbps" => "Gbit/s 4 streams".into(),
        "throughput_rev_gbps" => "Gbit/s 1 stream, download".into(),
        "rr_p50_us" => "RR p50 µs".into(),
        "rr_p99_us" => "RR p99 µs".into(),
        "rr_p999_us" => "RR p999 µs".into(),
        "rr_fixed_p50_us" => "RR@1k/s p50 µs".into(),
        "rr_fixed_p99_us" => "RR@1k/s p99 µs".into(),
        "rr_fixed_p999_us" => "RR@1k/s p999 µs".into(),
        "conn_per_s" => "conn/s".into(),
        "cpu_per_1k_rps_one" => "CPU per 1k rps, busier proxy".into(),
        "cpu_per_1k_rps" => "CPU per 1k rps, both proxies".into(),
        "cpu_per_1k_rps_max_rate" => "CPU per 1k rps at max rate, both".into(),
        "cpu_per_1k_rps_max_rate_one" => "CPU per 1k rps at max rate, busier".into(),
        "rss_idle_mb" => "RSS idle MiB".into(),
        "rss_idle_anon_mb" => "RSS idle, own (anon) MiB".into(),
        "rss_10k_conns_mb" => format!("RSS with {hold} conns MiB"),
        other => other.into(),
    }
}

/// The order of the table's columns (the headline figures first).
const COLUMNS: [&str; 17] = [
    "throughput_gbps",
    "throughput4_gbps",
    "throughput_rev_gbps",
    "rr_p50_us",
    "rr_p99_us",
    "rr_p999_us",
    "rr_fixed_p50_us",
    "rr_fixed_p99_us",
    "rr_fixed_p999_us",
    "conn_per_s",
    "cpu_per_1k_rps_one",
    "cpu_per_1k_rps",
    "cpu_per_1k_rps_max_rate",
    "cpu_per_1k_rps_max_rate_one",
    "rss_idle_mb",
    "rss_idle_anon_mb",
    "rss_10k_conns_mb",
];

fn cell(v: &Value) -> String {
    v.as_f64().map_or("-".to_owned(), |v| format!("{v}"))
}

fn ratio_cell(v: &Value) -> String {
    v.as_f64().map_or("-".to_owned(), |v| format!("{v:.3}x"))
}

/// The markdown report: every scenario and placement, the targets, the
/// information lines and, in an A/B run, the comparison table.
pub fn markdown(result: &Value) -> String {
    let mut out = String::new();
    let sc = &result["scenarios"];
    let hold = result["hold_connections"].as_u64().unwrap_or(0);
    let label = result["baseline"]["label"].as_str();
    out.push_str("| scenario | placement |");
    for key in COLUMNS {
        let _ = write!(out, " {} |", header(key, hold));
    }
    out.push_str("\n|---|---|");
    out.push_str(&"---|".repeat(COLUMNS.len()));
    out.push('\n');
    for scenario in result["scenario_order"].as_array().into_iter().flatten() {
        let scenario = scenario.as_str().unwrap_or_default();
        let shown = match label {
            Some(l) if scenario == "mesh-ebpf@baseline" => format!("mesh-ebpf@{l}"),
            _ => scenario.to_owned(),
        };
        for placement in [SAME, CROSS] {
            let m = &sc[scenario][placement];
            let _ = write!(out, "| {shown} | {placement} |");
            for key in COLUMNS {
                let _ = write!(out, " {} |", cell(&m[key]));
            }
            out.push('\n');
        }
    }
    out.push_str(
        "\nbare-relay: a minimal TCP relay in the client's and the server's pod (no TLS, no mesh), \
         the floor of a two-hop userspace proxy; its CPU figures are the two relays'.\n",
    );
    out.push_str("\nTargets (ratios to direct in the same run; cross-node unless named):\n\n");
    target_lines(
        &mut out,
        &result["targets"],
        &result["baseline"]["targets"],
        label,
    );
    let info = result["information"].as_array().into_iter().flatten();
    let mut first = true;
    for line in info {
        if first {
            out.push_str("\nInformation (cross-node, not targets):\n\n");
            first = false;
        }
        let _ = writeln!(
            out,
            "- {}: {}{}",
            line["name"].as_str().unwrap_or_default(),
            cell(&line["value"]),
            line["unit"].as_str().unwrap_or_default(),
        );
    }
    if let Some(label) = label {
        ab_table(&mut out, &result["baseline"]["ab"], label, hold);
    }
    out
}

fn target_lines(out: &mut String, targets: &Value, baseline: &Value, label: Option<&str>) {
    for (i, t) in targets.as_array().into_iter().flatten().enumerate() {
        let unit = if t["ratio"].as_bool() == Some(true) {
            "x"
        } else {
            ""
        };
        let show = |v: &Value| {
            v.as_f64()
                .map_or("-".to_owned(), |v| format!("{v:.3}{unit}"))
        };
        let verdict = if t["met"].as_bool() == Some(true) {
            "met"
        } else {
            "missed"
        };
        let mut context = Vec::new();
        if let Some(label) = label {
            context.push(format!("{label}: {}", show(&baseline[i]["value"])));
        }
        if !t["bare_relay"].is_null() {
            context.push(format!("bare-relay: {}", show(&t["bare_relay"])));
        }
        let context = if context.is_empty() {
            String::new()
        } else {
            format!(" [{}]", context.join(", "))
        };
        let _ = writeln!(
            out,
            "- {}: {} (target {} {}{unit}): {verdict}{context}",
            t["name"].as_str().unwrap_or_default(),
            show(&t["value"]),
            t["op"].as_str().unwrap_or_default(),
            t["target"],
        );
    }
}

fn ab_table(out: &mut String, ab: &Value, label: &str, hold: u64) {
    let _ = write!(
        out,
        "\nA/B: current (this working tree) vs baseline {label}, mesh-ebpf, same run \
         (current / baseline below 1 is better for µs, CPU and MiB, above 1 for Gbit/s and conn/s):\n\n\
         | measure | placement | current | {label} | current / {label} | current / direct | \
         {label} / direct | bare-relay / direct |\n|---|---|---|---|---|---|---|---|\n"
    );
    for placement in [CROSS, SAME] {
        for key in COLUMNS {
            let m = &ab[placement][key];
            let _ = writeln!(
                out,
                "| {} | {placement} | {} | {} | {} | {} | {} | {} |",
                header(key, hold),
                cell(&m["current"]),
                cell(&m["baseline"]),
                ratio_cell(&m["current_over_baseline"]),
                ratio_cell(&m["current_over_direct"]),
                ratio_cell(&m["baseline_over_direct"]),
                ratio_cell(&m["bare_relay_over_direct"]),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    fn scenarios() -> serde_json::Value {
        let f = |t: f64, p50: f64, rss: Option<f64>| {
            let m = json!({"throughput_gbps": t, "throughput4_gbps": t, "rr_p50_us": p50,
                           "rr_p99_us": p50 * 2.0, "conn_per_s": 1000.0 * t,
                           "cpu_per_1k_rps": 0.1, "rss_idle_mb": rss});
            json!({"same_node": m, "cross_node": m})
        };
        json!({
            "direct": f(10.0, 20.0, None),
            "bare-relay": f(8.0, 25.0, None),
            "mesh-ebpf": f(6.0, 30.0, Some(7.5)),
            "mesh-ebpf@baseline": f(3.0, 40.0, Some(8.5)),
        })
    }

    #[test]
    fn targets_are_ratios_to_direct_with_the_relay_as_context() {
        let t = super::targets(&scenarios(), "mesh-ebpf");
        let by_name = |n: &str| {
            t.as_array()
                .expect("list")
                .iter()
                .find(|x| x["name"] == n)
                .cloned()
                .unwrap_or_else(|| panic!("no {n} in {t}"))
        };
        let one = by_name("Gbit/s 1 stream, mesh-ebpf / direct");
        assert_eq!(one["value"], json!(0.6));
        assert_eq!(one["met"], json!(true));
        assert_eq!(one["bare_relay"], json!(0.8));
        let p50 = by_name("RR p50, mesh-ebpf / direct");
        assert_eq!(p50["value"], json!(1.5));
        assert_eq!(p50["met"], json!(true));
        let same = by_name("same-node RR p50, mesh-ebpf / direct");
        assert_eq!(same["met"], json!(false), "1.5x misses <= 1.3x");
        let rss = by_name("ztunnel RSS idle (MiB), mesh-ebpf");
        assert_eq!(rss["value"], json!(7.5));
        assert_eq!(rss["met"], json!(true));
        let base = super::targets(&scenarios(), "mesh-ebpf@baseline");
        assert_eq!(base[0]["value"], json!(0.3));
        assert_eq!(base[0]["met"], json!(false));
    }

    #[test]
    fn ab_table_shows_both_builds_and_their_ratio() {
        let sc = scenarios();
        let ab = super::ab(&sc);
        assert_eq!(
            ab["cross_node"]["throughput_gbps"]["current_over_baseline"],
            json!(2.0)
        );
        let result = json!({
            "hold_connections": 1000,
            "scenario_order": ["direct", "bare-relay", "mesh-ebpf", "mesh-ebpf@baseline"],
            "targets": super::targets(&sc, "mesh-ebpf"),
            "information": super::information(&sc),
            "baseline": {"label": "abc1234", "ab": ab,
                         "targets": super::targets(&sc, "mesh-ebpf@baseline")},
            "scenarios": sc,
        });
        let md = super::markdown(&result);
        assert!(md.contains("| mesh-ebpf@abc1234 | cross_node |"), "{md}");
        assert!(
            md.contains("| Gbit/s 1 stream | cross_node | 6 | 3 | 2.000x |"),
            "{md}"
        );
        assert!(md.contains("[abc1234: 0.300x, bare-relay: 0.800x]"), "{md}");
        assert!(
            md.contains("proxy CPU per request at 1,000/s, both nodes, bare-relay: 100 µs"),
            "{md}"
        );
    }
}
