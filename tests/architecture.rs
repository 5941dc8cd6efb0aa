//! The architecture test: the modules of `src/` form layers that point one way (docs/architecture.md).
//!
//! It reads every `.rs` file under `src/`, finds each reference one top-level module makes to
//! another (`crate::x…`, `use crate::{x, y::z}`, and `super::` chains that climb out of the
//! module), and checks each arrow against [`LAYERS`]: a module may use any module of a lower
//! layer, a module of its own layer only where [`SIDEWAYS`] lists the pair, and nothing above.
//! The graph of all arrows must have no cycle. A new module fails the test until it is placed in
//! a layer, and an allowance that no code uses any more fails it too, so the table stays the
//! truth. Comments are ignored; test code counts like any other code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. Items of the crate root (`crate::error_line`, `crate::quoted`,
/// `crate::redact_userinfo`, `crate::AbortOnDrop`: small text and task helpers) are below everything.
const LAYERS: &[(&str, &[&str])] = &[
    // Helpers with no knowledge of plans: durations, back-off, race-free files, log levels.
    ("base", &["duration", "backoff", "safefs", "logging", "disk"]),
    // Leaves anyone may use: the config (its defaults and ranges) and metrics (plain labels).
    ("leaves", &["config", "metrics", "board"]),
    // The pure model: plans, the pause/cancel flow, the on-node file formats.
    ("model", &["plan", "flow", "formats"]),
    // The host edge: processes (spawn, the stop ladder, records, cgroups).
    ("host", &["process"]),
    // The Kubernetes edge: the bounded client, the one list/watch, Events.
    ("kube", &["k8s", "events"]),
    // Execution: the applyinator, images, probes.
    ("exec", &["apply", "image", "probe"]),
    // The agent: the reconcile loop, its plan sources, the Lease.
    ("agent", &["reconcile", "local", "remote", "nodeplan", "lease"]),
    // Many nodes, and the installer.
    ("fleet", &["fleet", "install"]),
    // The thin command line.
    ("cli", &["cli"]),
];

/// Arrows allowed inside one layer (the graph stays acyclic: the test checks that too).
const SIDEWAYS: &[(&str, &str)] = &[
    ("flow", "plan"),
    ("formats", "plan"),
    ("events", "k8s"),
    ("apply", "image"),
    ("local", "reconcile"),
    ("remote", "reconcile"),
    ("nodeplan", "reconcile"),
    ("lease", "reconcile"),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, mods)| mods.contains(&module))
}

/// Source text with comments, string and char literals blanked (lengths and lines kept), so
/// braces and paths are only the code's own.
fn code_only(text: &str) -> String {
    // Every other character as one ASCII letter: paths are ASCII, and byte offsets stay on char
    // boundaries.
    let ascii: String = text.chars().map(|c| if c.is_ascii() { c } else { 'x' }).collect();
    let b = ascii.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let blank = |c: u8| if c == b'\n' { b'\n' } else { b' ' };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
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
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if (rest.starts_with(b"r\"") || rest.starts_with(b"r#"))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let hashes = rest[1..].iter().take_while(|&&c| c == b'#').count();
            if rest.get(1 + hashes) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let start = i + 2 + hashes;
            let end = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| start + p + close.len());
            out.extend(b[i..end].iter().map(|&c| blank(c)));
            i = end;
        } else if b[i] == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
                out.push(blank(b[i]));
                i += 1;
            }
            out.push(b' ');
            i += 1;
        } else if b[i] == b'\'' {
            // A char literal ('x', '\n', '{') or a lifetime ('a): blank only the former.
            let lit = if rest.get(1) == Some(&b'\\') {
                rest.iter().skip(2).position(|&c| c == b'\'').map(|p| p + 3)
            } else if rest.get(2) == Some(&b'\'') {
                Some(3)
            } else {
                None
            };
            match lit {
                Some(n) => {
                    out.extend(std::iter::repeat_n(b' ', n.min(rest.len())));
                    i += n;
                }
                None => {
                    out.push(b'\'');
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

fn ident_at(s: &str, from: usize) -> &str {
    let rest = &s[from..];
    let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
    &rest[..end]
}

/// The top-level modules one file refers to, with the line of each reference.
/// `path` is the file's module path (`["remote", "agent"]` for src/remote/agent.rs).
fn references(code: &str, path: &[String]) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let line_of = |pos: usize| code[..pos].matches('\n').count() + 1;
    // Inline modules (`mod tests {`), by brace depth, to resolve `super::`.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let at_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        let rest = &code[i..];
        if bytes[i] == b'{' {
            depth += 1;
        } else if bytes[i] == b'}' {
            depth = depth.saturating_sub(1);
            while inline.last().is_some_and(|(_, d)| *d > depth) {
                inline.pop();
            }
        } else if at_word && rest.starts_with("mod ") {
            let name = ident_at(code, i + 4);
            let after = code[i + 4 + name.len()..].trim_start();
            if after.starts_with('{') {
                inline.push((name.to_string(), depth + 1));
            }
        } else if at_word && rest.starts_with("crate::") {
            let line = line_of(i);
            found.extend(first_segments(code, i + "crate::".len()).into_iter().map(|m| (m, line)));
        } else if at_word && rest.starts_with("super::") {
            let mut here: Vec<String> = path.to_vec();
            here.extend(inline.iter().map(|(n, _)| n.clone()));
            let mut j = i;
            while code[j..].starts_with("super::") {
                here.pop();
                j += "super::".len();
            }
            if here.is_empty() {
                // Climbed to the crate root: the next segment is a top-level module.
                let line = line_of(i);
                found.extend(first_segments(code, j).into_iter().map(|m| (m, line)));
            }
            i = j;
            continue;
        }
        i += 1;
    }
    found
}

/// The first segment of the path at `at` (`x` of `x::y`), or of each path of a `{x, y::z}` list.
fn first_segments(code: &str, at: usize) -> Vec<String> {
    if !code[at..].starts_with('{') {
        return vec![ident_at(code, at).to_string()];
    }
    let close = matching_brace(code, at);
    split_top(&code[at + 1..close])
        .into_iter()
        .map(|part| ident_at(part.trim_start(), 0).to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

fn matching_brace(s: &str, open: usize) -> usize {
    let mut depth = 0;
    for (k, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    s.len()
}

fn split_top(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (k, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    parts
}

/// Arrows between top-level modules: (from, to) → where (file:line).
type Arrows = BTreeMap<(String, String), Vec<String>>;

/// Every top-level module, and every arrow between them.
fn arrows(src: &Path) -> (BTreeSet<String>, Arrows) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut modules = BTreeSet::new();
    let mut out = Arrows::new();
    for f in &files {
        let path = module_path(src, f);
        let Some(top) = path.first() else { continue };
        if top == "lib" || top == "main" {
            continue;
        }
        modules.insert(top.clone());
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        for (to, line) in references(&code, &path) {
            if to != *top && (src.join(&to).is_dir() || src.join(format!("{to}.rs")).is_file()) {
                let at = format!("{}:{line}", f.strip_prefix(src.parent().unwrap()).unwrap().display());
                out.entry((top.clone(), to)).or_default().push(at);
            }
        }
    }
    (modules, out)
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_module_is_placed_in_one_layer() {
    let (modules, _) = arrows(&src_dir());
    let placed: Vec<&str> = LAYERS.iter().flat_map(|(_, m)| m.iter().copied()).collect();
    for m in &modules {
        assert_eq!(
            placed.iter().filter(|p| **p == m).count(),
            1,
            "module `{m}` must be placed in exactly one layer of tests/architecture.rs (and docs/architecture.md)"
        );
    }
    for p in &placed {
        assert!(modules.contains(*p), "the layer table names `{p}`, which is not a module of src/");
    }
}

#[test]
fn arrows_point_down_or_sideways_where_allowed() {
    let (_, arrows) = arrows(&src_dir());
    let mut wrong = Vec::new();
    for ((from, to), at) in &arrows {
        let (Some(a), Some(b)) = (layer_of(from), layer_of(to)) else { continue };
        let ok = b < a || (a == b && SIDEWAYS.contains(&(from.as_str(), to.as_str())));
        if !ok {
            let dir = if b > a { "up" } else { "sideways, not allowed" };
            wrong.push(format!("{from} ({}) -> {to} ({}) [{dir}] at {}", LAYERS[a].0, LAYERS[b].0, at.join(", ")));
        }
    }
    assert!(wrong.is_empty(), "arrows against the layers:\n{}", wrong.join("\n"));
    for (from, to) in SIDEWAYS {
        assert!(
            arrows.contains_key(&(from.to_string(), to.to_string())),
            "SIDEWAYS allows {from} -> {to}, which no code uses any more: remove the allowance"
        );
        assert_eq!(layer_of(from), layer_of(to), "SIDEWAYS {from} -> {to} crosses layers");
    }
}

#[test]
fn the_module_graph_has_no_cycle() {
    let (modules, arrows) = arrows(&src_dir());
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in arrows.keys() {
        next.entry(from).or_default().push(to);
    }
    // Depth-first search; a grey node met again closes a cycle.
    fn visit<'a>(
        n: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<&'a str>> {
        state.insert(n, 1);
        stack.push(n);
        for &m in next.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|s| *s == m).unwrap_or(0);
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(m);
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, next, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n, 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in &modules {
        if state.get(m.as_str()).copied().unwrap_or(0) == 0
            && let Some(cycle) = visit(m, &next, &mut state, &mut Vec::new())
        {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}

/// The reader itself: paths in comments and strings are not arrows; `use crate::{…}` lists,
/// `super::` chains that leave the module and nested inline modules are.
#[test]
fn the_reader_finds_what_code_uses_and_nothing_else() {
    let text = r#"
//! Uses [`crate::cli`] in a doc comment only.
use crate::{plan::{self, Hold}, flow};
use super::sibling::Thing;
fn f() { let s = "crate::install"; let c = '{'; crate::process::run(); }
/* crate::fleet */
mod tests {
    use super::*;
    use super::super::metrics::Hook;
    mod deeper { use super::super::super::super::config; }
}
"#;
    let code = code_only(text);
    let path = vec!["remote".to_string(), "agent".to_string()];
    let got: BTreeSet<String> = references(&code, &path).into_iter().map(|(m, _)| m).collect();
    let want: BTreeSet<String> = ["plan", "flow", "process", "config"].iter().map(|s| s.to_string()).collect();
    assert_eq!(got, want);
    // From a top-level file, one `super::` at the top already reaches the crate root.
    let top = references(&code_only("use super::lease::X;\nmod t { use super::*; }"), &["config".to_string()]);
    assert_eq!(top.into_iter().map(|(m, _)| m).collect::<Vec<_>>(), ["lease"]);
}

/// How many `Result<_, String>` there are in `src/` (issue 44): errors as enums at module
/// boundaries, so this count only falls. Lower it when it falls; never raise it.
const STRING_ERRORS_CEILING: usize = 127;

/// The number of `Result<T, String>` types in `code` (comments and literals blanked): a `Result`
/// whose last top-level type argument is `String`, whatever path it is named by.
fn string_results(code: &str) -> usize {
    let b = code.as_bytes();
    let mut n = 0;
    let mut from = 0;
    while let Some(at) = code[from..].find("Result<").map(|i| from + i) {
        from = at + "Result<".len();
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        // The arguments up to the matching `>` (an arrow `->` inside is not a bracket).
        let (mut depth, mut end) = (1usize, None);
        for (i, c) in code[from..].char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' if i > 0 && b[from + i - 1] == b'-' => {}
                '>' | ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(from + i);
                        break;
                    }
                }
                ';' | '{' | '}' => break,
                _ => {}
            }
        }
        let Some(end) = end else { continue };
        let args = &code[from..end];
        let (mut depth, mut last) = (0usize, 0);
        for (i, c) in args.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' if i > 0 && args.as_bytes()[i - 1] == b'-' => {}
                '>' | ')' | ']' => depth = depth.saturating_sub(1),
                ',' if depth == 0 => last = i + 1,
                _ => {}
            }
        }
        if last > 0 && args[last..].trim() == "String" {
            n += 1;
        }
    }
    n
}

#[test]
fn string_errors_only_fall() {
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let mut per_file: Vec<(usize, String)> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            (string_results(&code_only(&text)), f.strip_prefix(src_dir()).unwrap().display().to_string())
        })
        .filter(|(n, _)| *n > 0)
        .collect();
    per_file.sort();
    let total: usize = per_file.iter().map(|(n, _)| n).sum();
    assert!(
        total <= STRING_ERRORS_CEILING,
        "{total} `Result<_, String>` in src/, above the ceiling of {STRING_ERRORS_CEILING}: return an error enum \
         instead (by file: {per_file:?})"
    );
    if total < STRING_ERRORS_CEILING {
        eprintln!(
            "{total} `Result<_, String>` in src/: lower STRING_ERRORS_CEILING in tests/architecture.rs to {total}"
        );
    }
}

/// The counter itself: nested types, paths and arrows; other names ending in `Result`, one-argument
/// aliases and errors that are not `String` do not count.
#[test]
fn the_counter_finds_string_results_only() {
    let text = r#"
fn a() -> Result<Vec<Option<u8>>, String> {}
fn b() -> std::result::Result<(u8, String), String> {}
fn c() -> io::Result<String> {}
fn d() -> ApplyResult<u8, String> {}
fn e() -> Result<Box<dyn Fn() -> u8>, String> {}
fn f() -> Result<String, Error> {}
/* Result<u8, String> */ fn g(s: &str) { let _ = "Result<u8, String>"; }
"#;
    assert_eq!(string_results(&code_only(text)), 3);
}
