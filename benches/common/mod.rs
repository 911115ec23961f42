//! What the load benches share: their flags and environment.
#![allow(dead_code)]

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
