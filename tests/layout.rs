//! The crate's import graph has no circle: every file of `src/` is a node,
//! every path it names into another file (`use crate::…`, `super::…`, a child
//! module's `name::…`) is an edge, and no file may reach itself again.
//!
//! A circle means two files can only be understood (and changed) together;
//! the fix is a leaf both use, or moving the shared thing up or down. Comments,
//! doc links and string literals are not edges, nor is `#[cfg(test)]` code:
//! tests may look anywhere. `mod x;` declarations are not edges either: the
//! parent owning a child is the tree itself, not a use of it.
//!
//! Run on its own: `cargo test --test integration layout`. On failure it
//! prints each circle with one edge per file and the line that makes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path inside the crate: `["relay", "link"]`; the root is `[]`.
type ModPath = Vec<String>;

#[test]
fn the_import_graph_of_src_has_no_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = Graph::of(&src);
    assert!(
        graph.files.len() > 20,
        "the walk found only {} files under {}",
        graph.files.len(),
        src.display()
    );
    // The checker must see the edges it is meant to see, or an empty graph
    // would pass: the relay's session reads the watermark, and the CLI
    // reaches the relay.
    for (from, to) in [("relay::session", "relay::watermark"), ("cli", "relay")] {
        assert!(
            graph.has_edge(from, to),
            "the checker lost the edge {from} -> {to}; its parser is broken"
        );
    }
    let circles = graph.circles();
    assert!(
        circles.is_empty(),
        "the import graph has {} circle(s):\n{}",
        circles.len(),
        circles
            .iter()
            .map(|c| graph.describe(c))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_checker_finds_a_circle_it_is_shown() {
    let graph = fixture(
        "circle",
        &[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n// crate::c is a comment\n"),
        (
            "c.rs",
            "use crate::a;\npub fn g() -> a::inner::X { todo!() }\n#[cfg(test)]\nmod t;\n",
        ),
        ("c/t.rs", "use crate::c;\n"),
        (
            "a/mod.rs",
            "mod inner;\npub use inner::X;\nconst S: &str = \"crate::b\";\n",
        ),
        ("a/inner.rs", "use crate::{b::{Y, self}};\npub struct X;\n"),
        (
            "b.rs",
            "pub struct Y;\nfn f() -> super::a::X { todo!() }\n#[cfg(test)]\nmod tests { use crate::c; }\n",
        ),
        ],
    );
    assert!(graph.has_edge("a", "a::inner"));
    assert!(graph.has_edge("a::inner", "b"));
    assert!(graph.has_edge("b", "a"));
    assert!(!graph.has_edge("", "b"), "a comment is not an edge");
    assert!(!graph.has_edge("a", "b"), "a string is not an edge");
    assert!(
        graph.has_edge("c", "a::inner"),
        "a path through an imported module reaches the file it names"
    );
    assert!(
        !graph
            .files
            .contains_key(&vec!["c".to_owned(), "t".to_owned()]),
        "a module only under #[cfg(test)] is test code"
    );
    let circles = graph.circles();
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert_eq!(circles[0].len(), 3, "{circles:?}");
}

/// The layers, bottom to top: what the components share (the contract,
/// schemas, metric names, readiness, the durability verdict, the Postgres
/// and NATS connections), the components (relay, consumer), then the
/// operations commands, the console and the CLI. An arrow runs down only.
const BELOW_THE_OPERATIONS: [&str; 14] = [
    "relay",
    "consumer",
    "postgres",
    "nats",
    "schema",
    "wire",
    "metrics",
    "readiness",
    "durability",
    "backoff",
    "json",
    "error",
    "triage",
    "testing",
];
const THE_OPERATIONS_AND_ABOVE: [&str; 4] = ["ops", "console", "cli", "config"];

#[test]
fn no_component_imports_the_operations_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = Graph::of(&src);
    // The checker must see arrows into `ops` where they are allowed, or a
    // parser that lost them would pass.
    assert!(
        graph.has_edge("cli", "ops::endpoint"),
        "the checker lost the edge cli -> ops::endpoint; its parser is broken"
    );
    // Every top-level module sits in one layer: a new one must be placed,
    // or its imports would go unchecked.
    let tops: BTreeSet<&str> = graph
        .files
        .keys()
        .filter_map(|m| m.first().map(String::as_str))
        .collect();
    for top in tops {
        let below = BELOW_THE_OPERATIONS.contains(&top);
        let above = THE_OPERATIONS_AND_ABOVE.contains(&top);
        assert!(
            below != above || top == "<bin>",
            "src/{top} is in {} layer lists; put it in one (tests/layout.rs)",
            if below { "both" } else { "neither of the" }
        );
    }
    let upward = graph.upward(&BELOW_THE_OPERATIONS, &THE_OPERATIONS_AND_ABOVE);
    assert!(
        upward.is_empty(),
        "{} import(s) run up from a component into the operations layer; move \
         what both need below the components (src/metrics.rs, src/readiness.rs, \
         src/durability.rs, src/nats.rs):\n{}",
        upward.len(),
        upward.join("\n")
    );
}

#[test]
fn the_checker_finds_an_upward_import_it_is_shown() {
    let graph = fixture(
        "up",
        &[
            ("lib.rs", "mod ops;\nmod relay;\nmod metrics;\n"),
            ("metrics.rs", "pub const X: &str = \"x\";\n"),
            ("ops/mod.rs", "pub mod dlq;\nuse crate::relay;\n"),
            ("ops/dlq.rs", "pub fn watch() {}\n"),
            ("relay/mod.rs", "mod publish;\nuse crate::metrics as m;\n"),
            (
                "relay/publish.rs",
                "// crate::ops::dlq in a comment\nfn f() { crate::ops::dlq::watch() }\n\
             #[cfg(test)]\nmod tests { use crate::ops; }\n",
            ),
        ],
    );
    let upward = graph.upward(&["relay", "metrics"], &["ops"]);
    assert_eq!(upward.len(), 1, "{upward:?}");
    assert!(
        upward[0].starts_with("relay::publish -> ops::dlq"),
        "{upward:?}"
    );
}

/// The graph of a crate made of `files` (path under `src/`, text), written
/// to a temporary directory for the walk and removed after.
fn fixture(name: &str, files: &[(&str, &str)]) -> Graph {
    let dir = std::env::temp_dir().join(format!("layout-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().expect("under the directory")).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let graph = Graph::of(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    graph
}

struct Graph {
    files: BTreeMap<ModPath, PathBuf>,
    /// from → to → the first line of `from` that names `to`.
    edges: BTreeMap<ModPath, BTreeMap<ModPath, String>>,
}

impl Graph {
    fn of(src: &Path) -> Graph {
        let mut files = BTreeMap::new();
        walk(src, src, &mut files);
        // Files that are modules only under `#[cfg(test)]` are test code.
        let mut test_only = Vec::new();
        for (module, path) in &files {
            let text = std::fs::read_to_string(path).expect("read a source file");
            for name in test_modules(&blank_comments_and_literals(&text)) {
                let mut child = module.clone();
                child.push(name);
                test_only.push(child);
            }
        }
        files.retain(|m, _| !test_only.iter().any(|t| m.starts_with(t)));
        let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, String>> = BTreeMap::new();
        for (module, path) in &files {
            let text = std::fs::read_to_string(path).expect("read a source file");
            let is_dir_module = matches!(
                path.file_name().and_then(|n| n.to_str()),
                Some("mod.rs" | "lib.rs" | "main.rs")
            );
            let code = strip_test_items(&blank_comments_and_literals(&text));
            let children = child_modules(&code);
            let named = paths_named(&code);
            // What `use` brought into scope: a later `name::…` goes on
            // from where the import points (`use crate::relay;` then
            // `relay::config::X` is `crate::relay::config::X`).
            let mut imported: BTreeMap<String, ModPath> = BTreeMap::new();
            for (_, path, is_use) in &named {
                if let (true, Some(last)) = (*is_use, path.last()) {
                    if let Some(abs) = absolute(module, is_dir_module, &children, path) {
                        imported.insert(last.clone(), abs);
                    }
                }
            }
            for (line, name, is_use) in named {
                let name = match name.first().and_then(|f| imported.get(f)) {
                    Some(abs) if !is_use && !children.contains(&name[0]) => {
                        let mut p = vec!["crate".to_owned()];
                        p.extend(abs.iter().cloned());
                        p.extend(name[1..].iter().cloned());
                        p
                    }
                    _ => name,
                };
                let Some(absolute) = absolute(module, is_dir_module, &children, &name) else {
                    continue;
                };
                let Some(target) = longest_file_prefix(&files, &absolute) else {
                    continue;
                };
                if &target != module {
                    edges
                        .entry(module.clone())
                        .or_default()
                        .entry(target)
                        .or_insert_with(|| format!("{}:{line}", path.display()));
                }
            }
        }
        Graph { files, edges }
    }

    /// Every edge from a module under one of `low`'s top-level names to
    /// one under `high`'s: `from -> to (file:line)`.
    fn upward(&self, low: &[&str], high: &[&str]) -> Vec<String> {
        let under =
            |m: &ModPath, tops: &[&str]| m.first().is_some_and(|t| tops.contains(&t.as_str()));
        let mut out = Vec::new();
        for (from, targets) in &self.edges {
            if !under(from, low) {
                continue;
            }
            for (to, at) in targets {
                if under(to, high) {
                    out.push(format!("{} -> {} ({at})", name(from), name(to)));
                }
            }
        }
        out
    }

    fn has_edge(&self, from: &str, to: &str) -> bool {
        let key = |s: &str| -> ModPath {
            if s.is_empty() {
                vec![]
            } else {
                s.split("::").map(str::to_owned).collect()
            }
        };
        self.edges
            .get(&key(from))
            .is_some_and(|t| t.contains_key(&key(to)))
    }

    /// Strongly connected components of more than one file (Tarjan).
    fn circles(&self) -> Vec<Vec<ModPath>> {
        struct Walk<'g> {
            g: &'g Graph,
            index: BTreeMap<ModPath, usize>,
            low: BTreeMap<ModPath, usize>,
            stack: Vec<ModPath>,
            on_stack: BTreeSet<ModPath>,
            out: Vec<Vec<ModPath>>,
        }
        impl Walk<'_> {
            fn visit(&mut self, v: &ModPath) {
                let n = self.index.len();
                self.index.insert(v.clone(), n);
                self.low.insert(v.clone(), n);
                self.stack.push(v.clone());
                self.on_stack.insert(v.clone());
                let targets: Vec<ModPath> = self
                    .g
                    .edges
                    .get(v)
                    .map(|t| t.keys().cloned().collect())
                    .unwrap_or_default();
                for w in targets {
                    if !self.index.contains_key(&w) {
                        self.visit(&w);
                        let low = self.low[v].min(self.low[&w]);
                        self.low.insert(v.clone(), low);
                    } else if self.on_stack.contains(&w) {
                        let low = self.low[v].min(self.index[&w]);
                        self.low.insert(v.clone(), low);
                    }
                }
                if self.low[v] == self.index[v] {
                    let mut component = Vec::new();
                    while let Some(w) = self.stack.pop() {
                        self.on_stack.remove(&w);
                        let done = &w == v;
                        component.push(w);
                        if done {
                            break;
                        }
                    }
                    if component.len() > 1 {
                        component.sort();
                        self.out.push(component);
                    }
                }
            }
        }
        let mut walk = Walk {
            g: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            out: Vec::new(),
        };
        for v in self.files.keys() {
            if !walk.index.contains_key(v) {
                walk.visit(v);
            }
        }
        walk.out
    }

    /// The members of a circle and, for each, the shortest way back to
    /// itself: the edges to cut are usually plain from those few lines.
    fn describe(&self, circle: &[ModPath]) -> String {
        let members: BTreeSet<&ModPath> = circle.iter().collect();
        let mut out = format!(
            "  {} files: {}\n",
            circle.len(),
            circle.iter().map(name).collect::<Vec<_>>().join(", ")
        );
        let mut seen = BTreeSet::new();
        for start in circle {
            let Some(cycle) = self.shortest_cycle(start, &members) else {
                continue;
            };
            let mut key = cycle.clone();
            key.sort();
            if !seen.insert(key) {
                continue;
            }
            out.push_str("    ");
            for (k, from) in cycle.iter().enumerate() {
                let to = &cycle[(k + 1) % cycle.len()];
                out.push_str(&format!("{} -> ({}) ", name(from), self.edges[from][to]));
            }
            out.push_str(&format!("{}\n", name(start)));
        }
        out
    }

    /// Breadth-first from `start` inside the circle back to `start`.
    fn shortest_cycle(
        &self,
        start: &ModPath,
        members: &BTreeSet<&ModPath>,
    ) -> Option<Vec<ModPath>> {
        let mut came_from: BTreeMap<ModPath, ModPath> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start.clone()]);
        while let Some(v) = queue.pop_front() {
            for to in self.edges.get(&v).into_iter().flat_map(|t| t.keys()) {
                if !members.contains(to) {
                    continue;
                }
                if to == start {
                    let mut cycle = vec![v.clone()];
                    let mut at = v.clone();
                    while &at != start {
                        at = came_from[&at].clone();
                        cycle.push(at.clone());
                    }
                    cycle.reverse();
                    return Some(cycle);
                }
                if !came_from.contains_key(to) {
                    came_from.insert(to.clone(), v.clone());
                    queue.push_back(to.clone());
                }
            }
        }
        None
    }
}

fn name(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".to_owned()
    } else {
        m.join("::")
    }
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<ModPath, PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read a source directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(root, &path, out);
            continue;
        }
        if path.extension().and_then(|e| e.to_str()) != Some("rs") {
            continue;
        }
        let rel = path.strip_prefix(root).expect("under the root");
        let mut module: ModPath = rel
            .with_extension("")
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if matches!(
            module.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            module.pop();
        }
        // main.rs is the binary, a client of the library: it is its own node.
        if rel == Path::new("main.rs") {
            module = vec!["<bin>".to_owned()];
        }
        out.insert(module, path);
    }
}

/// The text with every comment, string and char literal turned to spaces
/// (newlines kept, so line numbers still hold).
fn blank_comments_and_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, c: u8| out.push(if c == b'\n' { b'\n' } else { b' ' });
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                blank(&mut out, b[i]);
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if (rest.starts_with(b"r\"") || rest.starts_with(b"r#") || rest.starts_with(b"br"))
            && !prev_is_ident(b, i)
            && raw_string_len(rest).is_some()
        {
            let n = raw_string_len(rest).unwrap_or(1);
            for &c in &b[i..i + n] {
                blank(&mut out, c);
            }
            i += n;
        } else if b[i] == b'"' {
            blank(&mut out, b[i]);
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                blank(&mut out, b[i]);
                i += 1;
            }
            if i < b.len() {
                blank(&mut out, b[i]);
                i += 1;
            }
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            let end = if rest.get(1) == Some(&b'\\') {
                rest.iter().skip(2).position(|&c| c == b'\'').map(|p| p + 3)
            } else if rest.get(2) == Some(&b'\'') {
                Some(3)
            } else {
                // A multi-byte UTF-8 char: up to 4 bytes, then the quote.
                (2..=5)
                    .find(|&k| rest.get(k) == Some(&b'\'') && rest[1] >= 0x80)
                    .map(|k| k + 1)
            };
            match end {
                Some(n) => {
                    for &c in &b[i..i + n] {
                        blank(&mut out, c);
                    }
                    i += n;
                }
                None => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn prev_is_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// The byte length of a raw string literal at the start of `s`, if it is one.
fn raw_string_len(s: &[u8]) -> Option<usize> {
    let mut i = if s.starts_with(b"br") { 2 } else { 1 };
    let mut hashes = 0;
    while s.get(i) == Some(&b'#') {
        hashes += 1;
        i += 1;
    }
    if s.get(i) != Some(&b'"') {
        return None;
    }
    i += 1;
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let end = s[i..].windows(close.len()).position(|w| w == close)?;
    Some(i + end + close.len())
}

/// The code without the items under a bare `#[cfg(test)]` (the item ends at
/// its first `;` outside braces, or at the brace closing its first block).
fn strip_test_items(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, c) in item.char_indices().skip(MARK.len()) {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        out.extend(
            item[..end]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' }),
        );
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Modules this file declares only under `#[cfg(test)]`: `mod name;`
/// right after the attribute.
fn test_modules(code: &str) -> Vec<String> {
    let t = tokens(code);
    let mark = ["#", "[", "cfg", "(", "test", ")", "]", "mod"];
    t.windows(mark.len() + 2)
        .filter(|w| w.iter().zip(mark).all(|((_, a), b)| a == b) && w[mark.len() + 1].1 == ";")
        .map(|w| w[mark.len()].1.clone())
        .collect()
}

/// Modules this file declares with `mod name;` (its child files).
fn child_modules(code: &str) -> BTreeSet<String> {
    let tokens = tokens(code);
    let mut out = BTreeSet::new();
    for w in tokens.windows(3) {
        if w[0].1 == "mod" && w[2].1 == ";" {
            out.insert(w[1].1.clone());
        }
    }
    out
}

/// Identifiers, `::` and single punctuation, each with its line number.
fn tokens(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut line = 1;
    let mut chars = code.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c == '\n' {
            line += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push((line, code[i..end].to_owned()));
        } else if c == ':' && chars.peek().map(|&(_, d)| d) == Some(':') {
            chars.next();
            out.push((line, "::".to_owned()));
        } else if !c.is_whitespace() {
            out.push((line, c.to_string()));
        }
    }
    out
}

/// Every path the code names, with its line and whether a `use` names it:
/// `use` trees expanded, and in other code each run of `ident::ident…`.
fn paths_named(code: &str) -> Vec<(usize, Vec<String>, bool)> {
    let t = tokens(code);
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        if t[i].1 == "use" && (i == 0 || t[i - 1].1 != "::") {
            let line = t[i].0;
            let mut j = i + 1;
            for path in use_tree(&t, &mut j, Vec::new()) {
                out.push((line, path, true));
            }
            i = j;
            continue;
        }
        let is_ident = |k: usize| {
            t.get(k).is_some_and(|(_, s)| {
                s.chars()
                    .next()
                    .is_some_and(|c| c.is_alphabetic() || c == '_')
            })
        };
        if is_ident(i)
            && t.get(i + 1).is_some_and(|(_, s)| s == "::")
            && (i == 0 || t[i - 1].1 != "::")
        {
            let line = t[i].0;
            let mut path = vec![t[i].1.clone()];
            let mut j = i + 1;
            while t.get(j).is_some_and(|(_, s)| s == "::") && is_ident(j + 1) {
                path.push(t[j + 1].1.clone());
                j += 2;
            }
            out.push((line, path, false));
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// One `use` tree starting at `t[*j]`, ending after its `;`, `,` or `}`.
fn use_tree(t: &[(usize, String)], j: &mut usize, prefix: Vec<String>) -> Vec<Vec<String>> {
    let mut path = prefix;
    let mut out = Vec::new();
    while *j < t.len() {
        let s = t[*j].1.as_str();
        match s {
            "::" => *j += 1,
            "{" => {
                *j += 1;
                loop {
                    out.extend(use_tree(t, j, path.clone()));
                    match t.get(*j).map(|x| x.1.as_str()) {
                        Some(",") => *j += 1,
                        Some("}") => {
                            *j += 1;
                            break;
                        }
                        _ => break,
                    }
                    if t.get(*j).map(|x| x.1.as_str()) == Some("}") {
                        *j += 1;
                        break;
                    }
                }
                return out;
            }
            ";" => {
                *j += 1;
                out.push(path);
                return out;
            }
            "," | "}" => {
                out.push(path);
                return out;
            }
            "as" => *j += 2,
            "*" => *j += 1,
            "self" if !path.is_empty() => *j += 1,
            _ => {
                path.push(s.to_owned());
                *j += 1;
            }
        }
    }
    out.push(path);
    out
}

/// The crate-absolute form of a path named in `module`, or None when it
/// leaves the crate (std, a dependency) or names a local item.
fn absolute(
    module: &ModPath,
    is_dir_module: bool,
    children: &BTreeSet<String>,
    path: &[String],
) -> Option<ModPath> {
    let first = path.first()?;
    // `super` is relative to the module the file *is*: a mod.rs is its
    // directory's module, so its super is the directory's parent.
    let _ = is_dir_module;
    let mut base: ModPath = module.clone();
    if base.first().map(String::as_str) == Some("<bin>") {
        base.clear();
    }
    let mut rest = path;
    match first.as_str() {
        "crate" => {
            base.clear();
            rest = &path[1..];
        }
        "super" => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        "self" => rest = &path[1..],
        name if children.contains(name) => {}
        "outbox_relay" if module.first().map(String::as_str) == Some("<bin>") => {
            base.clear();
            rest = &path[1..];
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

fn longest_file_prefix(files: &BTreeMap<ModPath, PathBuf>, path: &ModPath) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| files.contains_key(p))
}

/// Tests run at once on one Postgres and one NATS: two tests of one
/// database name drop each other's database, and two of one context
/// share a slot name (cluster-wide) and a stream. Each literal name is
/// one test's (found the hard way: an audit test took `a_marked` and
/// `marked` from another, and each failed when the other ran beside it).
#[test]
fn no_two_tests_share_a_database_or_a_context() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let mut test = String::new();
        for line in text.lines() {
            if let Some(rest) = line.trim_start().strip_prefix("async fn ") {
                test = rest.split('(').next().unwrap_or_default().to_owned();
            }
            for pat in ["fresh_db(&stack, \"", "empty_db(&stack, \"", "let ctx = \""] {
                if let Some(rest) = line.split(pat).nth(1) {
                    let name = rest.split('"').next().unwrap_or_default();
                    let kind = if pat.starts_with("let") {
                        "context"
                    } else {
                        "database"
                    };
                    let owners = seen.entry(format!("{kind} {name}")).or_default();
                    let owner = format!("{file}::{test}");
                    if !owners.contains(&owner) {
                        owners.push(owner);
                    }
                }
            }
        }
    }
    let shared: Vec<String> = seen
        .iter()
        .filter(|(_, owners)| owners.len() > 1)
        .map(|(name, owners)| format!("{name}: {}", owners.join(", ")))
        .collect();
    assert!(seen.len() > 50, "{seen:?}");
    assert!(
        shared.is_empty(),
        "shared by tests that run at once:\n{}",
        shared.join("\n")
    );
}
