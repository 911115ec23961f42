//! What the load benches share: their flags and environment.
#![allow(dead_code)]

pub mod receiver;

/// `--name N` from the command line, else `default`.
pub fn arg(name: &str, default: u64) -> u64 {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

/// Whether the bare flag `name` was given.
pub fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// `--out DIR` (default `target/bench`), created.
pub fn out_dir() -> String {
    let out = std::env::args()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[0] == "--out")
        .map(|w| w[1].clone())
        .unwrap_or_else(|| "target/bench".into());
    std::fs::create_dir_all(&out).expect("create the output dir");
    out
}

/// An environment variable `scripts/bench.sh MODE` sets.
pub fn env(k: &str, mode: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set: run through scripts/bench.sh {mode}"))
}

/// utime + stime of a process (or of several), in seconds.
pub fn cpu_seconds(pids: &str) -> f64 {
    // A comma-separated list sums its processes (the nodes of a cluster).
    pids.split(',').map(cpu_seconds_of).sum()
}

fn cpu_seconds_of(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|u| u.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field(11) + field(12)) / 100.0
}

/// (current RSS, peak RSS) in MiB.
pub fn rss_mib(pid: &str) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let get = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (get("VmRSS:"), get("VmHWM:"))
}
