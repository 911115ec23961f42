//! The benchmarks guide's plots, rendered from the result files it cites:
//! `scripts/bench.sh plot [DIR]` (default `docs/bench`) reads them there
//! and writes each plot beside them as `plot-*.svg`.
//!
//! A plot is drawn only where a reader would rather look than read: the
//! latency of a paced run second by second, the relay flat out build by
//! build against Postgres alone, and the consumer's throughput by processes and by
//! concurrency. No dependency: each is a few SVG lines.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#7f7f7f",
];

/// Renders one plot from the files in a directory.
type Plot = fn(&Path) -> Result<String, String>;

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .skip(1)
            .find(|a| !a.starts_with("--"))
            .unwrap_or_else(|| "docs/bench".to_owned()),
    );
    let plots: [(&str, Plot); 4] = [
        ("plot-latency-2000eps.svg", latency_2000eps),
        ("plot-flat-out.svg", flat_out),
        ("plot-consumer-by-processes.svg", consumer_by_processes),
        ("plot-consumer-by-concurrency.svg", consumer_by_concurrency),
    ];
    let mut failed = false;
    for (name, plot) in plots {
        match plot(&dir) {
            Ok(svg) => {
                let out = dir.join(name);
                if let Err(e) = std::fs::write(&out, svg) {
                    eprintln!("cannot write {}: {e}", out.display());
                    failed = true;
                } else {
                    println!("wrote {}", out.display());
                }
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                failed = true;
            }
        }
    }
    std::process::exit(i32::from(failed));
}

fn read(dir: &Path, file: &str) -> Result<Value, String> {
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read {} ({e}): is it a result the guide cites?",
            path.display()
        )
    })?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
}

/// The phase named `phase` of a relay result.
fn phase<'a>(v: &'a Value, phase: &str, file: &str) -> Result<&'a Value, String> {
    v["phases"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["phase"] == phase))
        .ok_or_else(|| format!("{file} has no {phase} phase"))
}

fn num(v: &Value, key: &str, file: &str) -> Result<f64, String> {
    v[key]
        .as_f64()
        .ok_or_else(|| format!("{file} has no number {key}"))
}

/// p50 and p99 second by second, on one nats-server (R1) and on a 3-node
/// cluster (R3), at 2,000 events/s.
fn latency_2000eps(dir: &Path) -> Result<String, String> {
    let mut lines = Vec::new();
    for (file, label) in [
        ("relay-2000eps-r1-2026-11-25-review-after.json", "R1"),
        ("relay-2000eps-r3-2026-11-25-poisson.json", "R3"),
    ] {
        let cdc = phase(&read(dir, file)?, "cdc", file)?.clone();
        let by_second = cdc["latency_by_second"]
            .as_array()
            .ok_or_else(|| format!("{file} has no latency_by_second"))?;
        let at = |i: usize| -> Vec<(f64, f64)> {
            by_second
                .iter()
                .filter_map(|s| Some((s[0].as_f64()?, s[i].as_f64()?)))
                .collect()
        };
        lines.push((format!("{label} p50"), at(1)));
        lines.push((format!("{label} p99"), at(2)));
    }
    Ok(line_chart(
        "Commit → received at 2,000 events/s, second by second (2026-11-25, b5b3b94 on R1; 79c12d3 on R3)",
        "s",
        "ms",
        &lines,
    ))
}

/// The relay flat out as a share of what Postgres alone inserts in the
/// same run (the figure that survives the box's changes of speed), build by
/// build, with the polling worker where the run had one.
fn flat_out(dir: &Path) -> Result<String, String> {
    let mut bars = Vec::new();
    for (file, label) in [
        ("relay-flat-r1-2026-11-23.json", "11-23"),
        ("relay-flat-r1-2026-11-23-mimalloc.json", "mimalloc"),
        ("relay-flat-r1-2026-11-25-79c12d3.json", "79c12d3"),
        ("relay-flat-r1-2026-11-25-link-after.json", "7fd0bfd"),
        ("relay-flat-r1-2026-11-25-review-after.json", "b5b3b94"),
    ] {
        let v = read(dir, file)?;
        let raw = num(phase(&v, "raw", file)?, "events_per_s", file)?;
        for (name, color) in [("cdc", COLORS[0]), ("poll", COLORS[1])] {
            if let Ok(p) = phase(&v, name, file) {
                let share = num(p, "events_per_s", file)? / raw;
                bars.push((format!("{label} {name}"), share, color));
            }
        }
    }
    Ok(bar_chart(
        "Flat out, one nats-server: events/s ÷ Postgres alone, same run (blue: the relay; red: polling)",
        "÷ raw",
        &bars,
    ))
}

/// Handler calls per second with 1, 2 and 4 consume processes, each at
/// concurrency 8 against a handler that takes 40 ms.
fn consumer_by_processes(dir: &Path) -> Result<String, String> {
    let mut bars = Vec::new();
    for p in [1, 2, 4] {
        let file = format!("consumer-procs-p{p}-c8-h40-2026-11-25.json");
        let v = read(dir, &file)?;
        bars.push((
            format!("{p} process{}", if p == 1 { "" } else { "es" }),
            num(&v, "messages_per_second", &file)?,
            COLORS[0],
        ));
    }
    Ok(bar_chart(
        "consume: messages/s by processes, concurrency 8 each, 40 ms handler (2026-11-25)",
        "messages/s",
        &bars,
    ))
}

/// Messages per second by `--concurrency`, HTTP handler and Rust handler.
fn consumer_by_concurrency(dir: &Path) -> Result<String, String> {
    let mut bars = Vec::new();
    for (kind, list) in [("HTTP", &[1, 32, 128][..]), ("Rust", &[32, 128, 256][..])] {
        for c in list {
            let file = format!("consumer-{}-c{c}-2026-11-23.json", kind.to_lowercase());
            let v = read(dir, &file)?;
            let color = if kind == "HTTP" { COLORS[0] } else { COLORS[2] };
            bars.push((
                format!("{kind} c{c}"),
                num(&v, "messages_per_second", &file)?,
                color,
            ));
        }
    }
    Ok(bar_chart(
        "consume: messages/s by concurrency, handler answering at once (2026-11-23; blue: HTTP, green: Rust)",
        "messages/s",
        &bars,
    ))
}

const W: f64 = 900.0;
const H: f64 = 360.0;
const PAD: f64 = 60.0;

fn head(title: &str) -> String {
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{PAD}" y="22" font-size="14">{}</text>
"#,
        escape(title)
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A round axis top at or above `max`, in four round steps.
fn axis_top(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    step * 4.0
}

fn axes(svg: &mut String, y_top: f64, y_unit: &str) {
    let (x0, y0, x1, y1) = (PAD, H - PAD, W - PAD, PAD);
    let _ = writeln!(
        svg,
        r#"<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>"#
    );
    for i in 0..=4 {
        let v = y_top * f64::from(i) / 4.0;
        let y = y0 - (y0 - y1) * f64::from(i) / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            short(v)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" >{}</text>"#,
        x0 - 50.0,
        y1 - 10.0,
        escape(y_unit)
    );
}

fn short(v: f64) -> String {
    if v >= 1000.0 {
        format!("{}k", (v / 100.0).round() / 10.0)
    } else if v >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn line_chart(
    title: &str,
    x_unit: &str,
    y_unit: &str,
    lines: &[(String, Vec<(f64, f64)>)],
) -> String {
    let x_max = lines
        .iter()
        .flat_map(|l| l.1.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_top = axis_top(
        lines
            .iter()
            .flat_map(|l| l.1.iter().map(|p| p.1))
            .fold(0.0, f64::max),
    );
    let x = |t: f64| PAD + t / x_max * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - v / y_top * (H - 2.0 * PAD);
    let mut svg = head(title);
    axes(&mut svg, y_top, y_unit);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="end">{x_max:.0} {x_unit}</text>"#,
        W - PAD,
        H - PAD + 18.0
    );
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let dashed = if name.ends_with("p99") {
            r#" stroke-dasharray="6 3""#
        } else {
            ""
        };
        let pts: Vec<String> = points
            .iter()
            .map(|&(t, v)| format!("{:.1},{:.1}", x(t), y(v)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dashed} points="{}"/>"#,
            pts.join(" ")
        );
        let ly = PAD + 16.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dashed}/><text x="{}" y="{}">{}</text>"#,
            W - PAD - 110.0,
            W - PAD - 85.0,
            W - PAD - 80.0,
            ly + 4.0,
            escape(name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn bar_chart(title: &str, y_unit: &str, bars: &[(String, f64, &str)]) -> String {
    let y_top = axis_top(bars.iter().map(|b| b.1).fold(0.0, f64::max));
    let slot = (W - 2.0 * PAD) / bars.len().max(1) as f64;
    let mut svg = head(title);
    axes(&mut svg, y_top, y_unit);
    for (i, (label, v, color)) in bars.iter().enumerate() {
        let h = v / y_top * (H - 2.0 * PAD);
        let x = PAD + slot * i as f64 + slot * 0.2;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            H - PAD - h,
            slot * 0.6,
            color,
            x + slot * 0.3,
            H - PAD + 18.0,
            escape(label),
            x + slot * 0.3,
            H - PAD - h - 6.0,
            short(*v)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
