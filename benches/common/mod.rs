//! What the load benches share: their flags and environment.
#![allow(dead_code)]

pub mod receiver;

/// Flags every bench takes, flattened into its own: `--out DIR` for its
/// results, and the `--bench` that `cargo bench` adds.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// Where result files go (created).
    #[arg(long, default_value = "target/bench")]
    pub out: String,
    #[arg(long, hide = true)]
    pub bench: bool,
}

impl Common {
    /// `--out`, created.
    pub fn out_dir(&self) -> String {
        std::fs::create_dir_all(&self.out).expect("create the output dir");
        self.out.clone()
    }
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
    (field(11) + field(12)) / clock_ticks()
}

/// Clock ticks per second, the unit of /proc's CPU times: the kernel's
/// `AT_CLKTCK` from this process's auxiliary vector (what `sysconf
/// (_SC_CLK_TCK)` reads), not an assumed 100.
pub fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        const AT_CLKTCK: u64 = 17;
        let auxv = std::fs::read("/proc/self/auxv").expect("read /proc/self/auxv");
        let word = |c: &[u8]| u64::from_ne_bytes(c.try_into().expect("8 bytes"));
        auxv.chunks_exact(16)
            .find(|pair| word(&pair[..8]) == AT_CLKTCK)
            .map(|pair| word(&pair[8..]) as f64)
            .filter(|t| *t > 0.0)
            .expect("AT_CLKTCK in /proc/self/auxv")
    })
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
