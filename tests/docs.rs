//! Docs that cannot drift (issue 29): README.md, ARCHITECTURE.md and every
//! page under docs/ link only to files and anchors that exist, name only
//! subcommands and flags that `--help` has (or the bench harness and the
//! tools the docs drive), and name only metrics the processes export.
//! The checks are plain functions, each also run on a page made wrong on
//! purpose, so a check that cannot fail would show.

use std::collections::{BTreeMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Commands whose `--help` lists the flags a page may name.
const COMMANDS: &[&[&str]] = &[
    &[],
    &["relay"],
    &["consume"],
    &["migrate"],
    &["slot"],
    &["slot", "status"],
    &["slot", "drop"],
    &["prune"],
    &["audit"],
    &["dlq"],
    &["dlq", "list"],
    &["dlq", "replay"],
    &["consumer"],
    &["consumer", "reset"],
    &["dlq", "delete"],
    &["admin"],
    &["admin", "log"],
    &["admin", "log", "verify"],
    &["admin", "token"],
    &["admin", "token", "create"],
    &["admin", "token", "list"],
    &["admin", "token", "revoke"],
    &["console"],
];

/// Flags of the tools the docs drive besides ours: cargo and the test
/// runner, psql, the Prometheus and container tools, perf.
const TOOL_FLAGS: &[&str] = &[
    // docker compose
    "build",
    "rm",
    // cargo and the test runner
    "release",
    "bin",
    "bench",
    "test",
    "nocapture",
    "test-threads",
    "locked",
    "all-targets",
    "no-run",
    "quiet",
    "features",
    "lib",
    "ignored",
    "exact",
    "skip",
    "help",
    "version",
    "yes",
];

/// Markdown pages the checks read, by path from the repository root.
fn pages() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in ["README.md", "ARCHITECTURE.md"] {
        out.insert(p.to_owned(), read(p));
    }
    let mut dirs = vec![PathBuf::from(ROOT).join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                let rel = p.strip_prefix(ROOT).unwrap().to_string_lossy().into_owned();
                out.insert(rel.clone(), read(&rel));
            }
        }
    }
    out
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The text outside fenced code blocks (links and headings live there).
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A heading's anchor as forges make it: lower case, punctuation dropped
/// (but `-` and `_`), spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> HashSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = HashSet::new();
    for line in prose(text).lines() {
        let Some(h) = line.strip_prefix('#') else {
            continue;
        };
        let h = h.trim_start_matches('#');
        if !h.starts_with(' ') {
            continue;
        }
        let s = slug(h);
        let n = seen.entry(s.clone()).or_insert(0);
        out.insert(if *n == 0 {
            s.clone()
        } else {
            format!("{s}-{n}")
        });
        *n += 1;
    }
    out
}

/// `[text](target)` targets, outside code.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_owned());
        }
    }
    out
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Broken links of `pages`: a missing file, or a missing anchor in a page.
fn broken_links(pages: &BTreeMap<String, String>, exists: impl Fn(&str) -> bool) -> Vec<String> {
    let mut problems = Vec::new();
    for (page, text) in pages {
        for link in links(text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if path.is_empty() {
                page.clone()
            } else {
                let dir = Path::new(page).parent().unwrap_or(Path::new(""));
                normalize(&dir.join(path)).to_string_lossy().into_owned()
            };
            if !pages.contains_key(&target) && !exists(&target) {
                problems.push(format!("{page}: link to missing {target}"));
                continue;
            }
            if !anchor.is_empty() {
                let Some(t) = pages.get(&target) else {
                    continue;
                };
                if !anchors(t).contains(anchor) {
                    problems.push(format!("{page}: link to missing anchor {target}#{anchor}"));
                }
            }
        }
    }
    problems
}

/// `--flag` tokens of a text.
fn flags(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 2 < b.len() {
        let starts = b[i] == b'-'
            && b[i + 1] == b'-'
            && b[i + 2].is_ascii_lowercase()
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'-'));
        if starts {
            let end = (i + 2..b.len())
                .find(|&j| !(b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-'))
                .unwrap_or(b.len());
            out.push(text[i + 2..end].trim_end_matches('-').to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// Words after `outbox-relay ` (a subcommand, and its own subcommand).
fn subcommands(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("outbox-relay ") {
        if i > 0 && !text[..i].ends_with([' ', '`', '(', '\n', '|', '"', '\'']) {
            continue;
        }
        let mut words = text[i + "outbox-relay ".len()..]
            .split(|c: char| !(c.is_ascii_lowercase() || c == '-'))
            .take(2);
        let first = words.next().unwrap_or_default().to_owned();
        if first.is_empty() || first.starts_with('-') {
            continue;
        }
        let second = words
            .next()
            .filter(|w| !w.is_empty() && !w.starts_with('-'));
        out.push((first, second.map(str::to_owned)));
    }
    out
}

/// Names with a metric's prefix that are not metrics: the relay's default
/// slot names in examples (`outbox_relay_{context}`).
const NOT_METRICS: &[&str] = &[
    "outbox_relay_orders",
    "outbox_relay_bench",
    "outbox_relay_demo",
    "outbox_relay_orders_keep",
    "outbox_relay_demo_keep",
];

/// Metric names of a text: the exporters' prefixes. A name inside a
/// recording rule's (`job:…:rate5m`) is the rule's, and `pg_replication_slots`
/// is Postgres's view.
fn metrics(text: &str) -> Vec<String> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
        match (is_word(c), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                start = None;
                let w = &text[s..i];
                let prefixed = [
                    "outbox_relay_",
                    "outbox_consumer_",
                    "outbox_dlq_",
                    "outbox_schema_",
                ]
                .iter()
                .any(|p| w.starts_with(p))
                    || w == "pg_replication_slot"
                    || w.starts_with("pg_replication_slot_");
                let in_rule = text[..s].ends_with(':');
                if prefixed && !in_rule && !w.ends_with('_') && !NOT_METRICS.contains(&w) {
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|x| w.strip_suffix(x))
                        .unwrap_or(w);
                    out.push(base.to_owned());
                }
            }
            _ => {}
        }
    }
    out
}

/// What `--help` knows: flags, and subcommands with their own.
struct Cli {
    flags: HashSet<String>,
    commands: BTreeMap<String, HashSet<String>>,
}

fn cli() -> Cli {
    let mut flags: HashSet<String> = HashSet::new();
    let mut commands: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    for cmd in COMMANDS {
        let out = Command::new(BIN).args(*cmd).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{cmd:?} --help: {help}");
        flags.extend(flags_of_help(&help));
        let subs = subcommands_of_help(&help);
        match cmd {
            [] => {
                for s in subs {
                    commands.entry(s).or_default();
                }
            }
            [one] => commands.entry((*one).to_owned()).or_default().extend(subs),
            _ => {}
        }
    }
    Cli { flags, commands }
}

fn flags_of_help(help: &str) -> Vec<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            // `--flag <V>`, or `-x, --flag`.
            let long = if l.starts_with("--") {
                l
            } else if l.starts_with('-') {
                &l[l.find(", --")? + 2..]
            } else {
                return None;
            };
            long.strip_prefix("--").map(|f| {
                f.split([' ', '<', '=', ','])
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
        })
        .collect()
}

fn subcommands_of_help(help: &str) -> Vec<String> {
    let Some(section) = help.split("Commands:\n").nth(1) else {
        return Vec::new();
    };
    section
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "help")
        .map(str::to_owned)
        .collect()
}

/// Flags the bench harness and the project's scripts take: their sources
/// name them as string literals or `--x)` cases.
fn harness_flags() -> HashSet<String> {
    let mut out = HashSet::new();
    let mut files = vec![];
    for dir in ["benches", "benches/common", "scripts"] {
        for e in std::fs::read_dir(Path::new(ROOT).join(dir))
            .unwrap()
            .flatten()
        {
            if e.path().is_file() {
                files.push(e.path());
            }
        }
    }
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        out.extend(flags(&text));
        out.extend(clap_fields(&text));
    }
    out
}

/// The long flags a clap derive declares: a field after `#[arg(long…)]`
/// is `--field-name` (the benches parse their flags as the binary does).
fn clap_fields(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending: Option<Option<String>> = None;
    for line in text.lines().map(str::trim) {
        if let Some(attr) = line.strip_prefix("#[arg(") {
            if attr.starts_with("long") || attr.contains(", long") {
                let named = attr
                    .split("long = \"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .map(str::to_owned);
                pending = Some(named);
            }
            continue;
        }
        if let Some(named) = pending.take() {
            let field = line
                .trim_start_matches("pub ")
                .split(':')
                .next()
                .unwrap_or("");
            out.push(named.unwrap_or_else(|| field.replace('_', "-")));
        }
    }
    out
}

fn unknown_flags(pages: &BTreeMap<String, String>, known: &HashSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    for (page, text) in pages {
        for f in flags(text) {
            if !known.contains(&f) {
                problems.push(format!("{page}: --{f} is no flag of outbox-relay, the bench harness or the tools the docs drive"));
            }
        }
    }
    problems
}

/// Code in a page: fenced blocks and `inline` spans.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            out.push_str(line);
            out.push('\n');
        } else {
            for (i, span) in line.split('`').enumerate() {
                if i % 2 == 1 {
                    out.push_str(span);
                    out.push('\n');
                }
            }
        }
    }
    out
}

fn unknown_subcommands(pages: &BTreeMap<String, String>, cli: &Cli) -> Vec<String> {
    let mut problems = Vec::new();
    for (page, text) in pages {
        for (first, second) in subcommands(&code(text)) {
            match cli.commands.get(&first) {
                None => problems.push(format!("{page}: `outbox-relay {first}` is no subcommand")),
                Some(subs) if !subs.is_empty() => {
                    if let Some(s) = second.filter(|s| !subs.contains(s)) {
                        problems.push(format!(
                            "{page}: `outbox-relay {first} {s}` is no subcommand"
                        ));
                    }
                }
                Some(_) => {}
            }
        }
    }
    problems
}

fn unknown_metrics(pages: &BTreeMap<String, String>) -> Vec<String> {
    let known: HashSet<&str> = outbox_relay::metrics::ALL.iter().copied().collect();
    let mut problems = Vec::new();
    for (page, text) in pages {
        for m in metrics(text) {
            if !known.contains(m.as_str()) {
                problems.push(format!("{page}: {m} is not a metric outbox-relay exports"));
            }
        }
    }
    problems
}

fn known_flags(cli: &Cli) -> HashSet<String> {
    let mut known = cli.flags.clone();
    known.extend(harness_flags());
    known.extend(TOOL_FLAGS.iter().map(|s| (*s).to_owned()));
    known
}

#[test]
fn the_docs_link_name_and_measure_only_what_exists() {
    let pages = pages();
    assert!(pages.len() > 8, "read the guide: {:?}", pages.keys());
    let cli = cli();
    let exists = |p: &str| Path::new(ROOT).join(p).exists();
    let mut problems = broken_links(&pages, exists);
    problems.extend(unknown_flags(&pages, &known_flags(&cli)));
    problems.extend(unknown_subcommands(&pages, &cli));
    problems.extend(unknown_metrics(&pages));
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn each_check_catches_what_it_is_for() {
    let cli = cli();
    let mut pages = BTreeMap::new();
    pages.insert(
        "docs/guide/a.md".to_owned(),
        "# A\n\n## Dead letters: triage\n\nSee [b](b.md), [c](c.md#nowhere), [here](#dead-letters-triage), [gone](#gone).\n\
         Run `outbox-relay relay --no-such-flag` and `outbox-relay frobnicate`, `outbox-relay dlq frob`.\n\
         Watch `outbox_relay_events_published_total` and `outbox_relay_no_such_metric`.\n"
            .to_owned(),
    );
    pages.insert("docs/guide/c.md".to_owned(), "# C\n".to_owned());
    let links = broken_links(&pages, |_| false);
    assert_eq!(
        links,
        [
            "docs/guide/a.md: link to missing docs/guide/b.md",
            "docs/guide/a.md: link to missing anchor docs/guide/c.md#nowhere",
            "docs/guide/a.md: link to missing anchor docs/guide/a.md#gone",
        ]
    );
    let flags = unknown_flags(&pages, &known_flags(&cli));
    assert_eq!(flags.len(), 1, "{flags:?}");
    assert!(flags[0].contains("--no-such-flag"));
    let subs = unknown_subcommands(&pages, &cli);
    assert_eq!(subs.len(), 2, "{subs:?}");
    assert!(subs[0].contains("frobnicate") && subs[1].contains("dlq frob"));
    let metrics = unknown_metrics(&pages);
    assert_eq!(
        metrics,
        ["docs/guide/a.md: outbox_relay_no_such_metric is not a metric outbox-relay exports"]
    );
}

/// The relay guide's conformance table names its tests as `file::name`:
/// each must be a test in that file, so the table cannot claim a case no
/// test covers.
#[test]
fn the_conformance_table_names_tests_that_exist() {
    let guide = read("docs/guide/relay.md");
    let table = guide
        .split("### Conformance")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/guide/relay.md has a Conformance section");
    let mut named = 0;
    for cell in table.split('`') {
        let Some((file, name)) = cell.split_once("::") else {
            continue;
        };
        if file.contains(' ') || name.contains(' ') {
            continue;
        }
        let source = read(&format!("tests/{file}.rs"));
        assert!(
            source.contains(&format!("async fn {name}(")),
            "the conformance table names {file}::{name}, which is not a test in tests/{file}.rs"
        );
        named += 1;
    }
    assert!(named >= 10, "only {named} tests named");
}
