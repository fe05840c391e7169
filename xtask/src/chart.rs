//! The benchmark chart (SVG, drawn with plotters from zt-bench's JSON):
//! - left: the target ratios of one run (cross-node) as bars, each with its
//!   target as a black tick; green when met, red when missed;
//! - right: bare-relay (the floor) and every mesh scenario relative to the
//!   direct baseline of the same run (cross-node), higher is better for every bar (request/response is
//!   drawn as direct p50 / scenario p50).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use serde_json::Value;

const MET: RGBColor = RGBColor(46, 139, 87);
const MISSED: RGBColor = RGBColor(205, 92, 92);
const SCENARIO_COLORS: [(&str, RGBColor); 4] = [
    // The floor (a TCP relay without TLS) first, in grey, so each mesh bar
    // reads against it.
    ("bare-relay", RGBColor(150, 150, 150)),
    ("mesh-ebpf", RGBColor(31, 119, 180)),
    ("mesh-ebpf-sockmap", RGBColor(127, 179, 213)),
    ("mesh-iptables", RGBColor(255, 127, 14)),
];

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart: {e}")
}

/// Writes the chart of `result` to `path`.
pub fn render(result: &Value, path: &Path) -> Result<()> {
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(560);
    targets(&left, result)?;
    versus_direct(&right, result)?;
    root.present().map_err(err)?;
    Ok(())
}

fn targets(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    result: &Value,
) -> Result<()> {
    let list: Vec<(String, f64, f64, bool)> = result["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["ratio"].as_bool() == Some(true))
        .map(|t| {
            let name = t["name"].as_str().unwrap_or_default();
            // "conn/s, mesh-ebpf / mesh-iptables" -> "conn/s vs iptables"
            let (what, over) = name.split_once(", ").unwrap_or((name, ""));
            let over = over
                .rsplit(" / ")
                .next()
                .unwrap_or("")
                .trim_start_matches("mesh-");
            (
                format!("{what} vs {over}"),
                t["value"].as_f64().unwrap_or(0.0),
                t["target"].as_f64().unwrap_or(0.0),
                t["met"].as_bool() == Some(true),
            )
        })
        .collect();
    let n = list.len() as i32;
    let top = list
        .iter()
        .map(|(_, v, t, _)| v.max(*t))
        .fold(1.0, f64::max)
        * 1.25;
    let mut chart = ChartBuilder::on(area)
        .caption("mesh-ebpf: target ratios (cross-node)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(48)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..top)
        .map_err(err)?;
    let names: Vec<String> = list.iter().map(|l| l.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(list.len().max(1))
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("ratio (same run)")
        .draw()
        .map_err(err)?;
    let met: Vec<bool> = list.iter().map(|l| l.3).collect();
    chart
        .draw_series(
            Histogram::vertical(&chart)
                .margin(24)
                .style_func(|x, _| {
                    let i = match x {
                        SegmentValue::Exact(i) | SegmentValue::CenterOf(i) => *i,
                        SegmentValue::Last => 0,
                    };
                    let ok = met.get(i as usize).copied().unwrap_or(false);
                    (if ok { MET } else { MISSED }).filled()
                })
                .data(list.iter().enumerate().map(|(i, l)| (i as i32, l.1))),
        )
        .map_err(err)?;
    for (i, (_, value, target, _)) in list.iter().enumerate() {
        let i = i as i32;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![
                    (SegmentValue::Exact(i), *target),
                    (SegmentValue::Exact(i + 1), *target),
                ],
                BLACK.stroke_width(3),
            )))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("{value:.2}x (target {target})"),
                (SegmentValue::Exact(i), value.max(*target) + top * 0.04),
                ("sans-serif", 13),
            )))
            .map_err(err)?;
    }
    Ok(())
}

fn versus_direct(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    result: &Value,
) -> Result<()> {
    // (label, metric, higher_is_better)
    let metrics = [
        ("Gbit/s, 1 stream", "throughput_gbps", true),
        ("Gbit/s, 4 streams", "throughput4_gbps", true),
        ("conn/s", "conn_per_s", true),
        ("RR (p50)", "rr_p50_us", false),
    ];
    let get = |s: &str, k: &str| result["scenarios"][s]["cross_node"][k].as_f64();
    let slots = SCENARIO_COLORS.len() as i32 + 1;
    let mut bars = Vec::new();
    for (m, (_, key, higher)) in metrics.iter().enumerate() {
        for (s, (scenario, color)) in SCENARIO_COLORS.iter().enumerate() {
            let rel = get(scenario, key).zip(get("direct", key)).map(|(v, d)| {
                if *higher {
                    if d > 0.0 { v / d } else { 0.0 }
                } else if v > 0.0 {
                    d / v
                } else {
                    0.0
                }
            });
            bars.push((m as i32 * slots + s as i32, rel.unwrap_or(0.0), *color));
        }
    }
    let top = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 1.15;
    // The last slot of the last group is the gap: leave it out.
    let n = metrics.len() as i32 * slots - 1;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "relative to direct, same run (cross-node)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(48)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n as usize)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) if i % slots == 1 => metrics
                .get((i / slots) as usize)
                .map(|m| m.0.to_owned())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("scenario / direct")
        .draw()
        .map_err(err)?;
    for (scenario, color) in SCENARIO_COLORS {
        let mine: Vec<(i32, f64)> = bars
            .iter()
            .filter(|b| b.2 == color)
            .map(|b| (b.0, b.1))
            .collect();
        chart
            .draw_series(
                Histogram::vertical(&chart)
                    .margin(3)
                    .style(color.filled())
                    .data(mine),
            )
            .map_err(err)?
            .label(scenario)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(SegmentValue::Exact(0), 1.0), (SegmentValue::Last, 1.0)],
            BLACK.stroke_width(1),
        )))
        .map_err(err)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn draws_targets_and_scenarios() {
        let figures = |t: f64, c: f64, p50: f64| json!({"cross_node": {"throughput_gbps": t, "throughput4_gbps": t, "conn_per_s": c, "rr_p50_us": p50}});
        let result = json!({
            "targets": [
                {"name": "conn/s, mesh-ebpf / mesh-iptables", "value": 1.4, "target": 1.3, "op": ">=", "ratio": true, "met": true},
                {"name": "RR p50, mesh-ebpf / mesh-iptables", "value": 0.9, "target": 0.8, "op": "<=", "ratio": true, "met": false},
                {"name": "ztunnel RSS idle (MiB)", "value": 7.5, "target": 8.0, "op": "<=", "ratio": false, "met": true},
            ],
            "scenarios": {
                "direct": figures(10.0, 5000.0, 20.0),
                "bare-relay": figures(7.0, 3500.0, 30.0),
                "mesh-ebpf": figures(6.0, 3000.0, 40.0),
                "mesh-ebpf-sockmap": figures(5.0, 2900.0, 45.0),
                "mesh-iptables": figures(4.0, 2000.0, 60.0),
            }
        });
        let dir = std::env::temp_dir().join(format!("xtask-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("chart.svg");
        super::render(&result, &path).expect("render");
        let svg = std::fs::read_to_string(&path).expect("svg written");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            svg.starts_with("<svg"),
            "not an SVG: {}",
            &svg[..svg.len().min(80)]
        );
        // Only ratio targets are drawn, with their values and targets.
        assert!(
            svg.contains("conn/s vs iptables"),
            "conn/s bar label missing"
        );
        assert!(svg.contains("1.40x (target 1.3)"), "value label missing");
        assert!(
            !svg.contains("RSS idle"),
            "absolute targets are not ratio bars"
        );
        for scenario in [
            "bare-relay",
            "mesh-ebpf",
            "mesh-ebpf-sockmap",
            "mesh-iptables",
        ] {
            assert!(svg.contains(scenario), "legend lacks {scenario}");
        }
        // Bars in the met and missed colours.
        assert!(svg.contains("#2E8B57"), "no green (met) bar");
        assert!(svg.contains("#CD5C5C"), "no red (missed) bar");
    }
}
