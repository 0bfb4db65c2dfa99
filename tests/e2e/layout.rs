//! The source tree keeps its shape: inside each crate, module dependencies point one way.
//!
//! A module depends on another when its non-test code names it through `crate::` (or, for a
//! top-level module, `super::`). Comments and `#[cfg(test)] mod tests` are left out: a doc
//! link or a test may look anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Top-level module name to the top-level modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Identifiers following `prefix` in `code`.
fn names_after<'a>(code: &'a str, prefix: &str) -> impl Iterator<Item = &'a str> {
    code.match_indices(prefix).filter_map(move |(i, _)| {
        let rest = &code[i + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        (end > 0).then(|| &rest[..end])
    })
}

fn module_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph = Graph::new();
    for file in &files {
        let rel = file
            .strip_prefix(src)
            .expect("under src")
            .with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        if parts == ["lib"] || parts == ["main"] {
            continue;
        }
        let text = fs::read_to_string(file).expect("read");
        let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let top = parts[0].clone();
        let mut deps: BTreeSet<String> = names_after(&code, "crate::").map(String::from).collect();
        let parent = match parts.len() {
            1 => Some("super::"),
            2 => Some("super::super::"),
            _ => None,
        };
        if let Some(prefix) = parent {
            deps.extend(names_after(&code, prefix).map(String::from));
        }
        deps.remove(&top);
        graph.entry(top).or_default().extend(deps);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for deps in graph.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    graph
}

/// One cycle through the graph, if there is any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for dep in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(graph, dep, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}

#[test]
fn no_crate_has_an_import_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    for group in ["crates", "cmd"] {
        for entry in fs::read_dir(root.join(group)).expect("read_dir") {
            let src = entry.expect("entry").path().join("src");
            if !src.is_dir() {
                continue;
            }
            let graph = module_graph(&src);
            if let Some(cycle) = find_cycle(&graph) {
                panic!("{}: import loop {}", src.display(), cycle.join(" -> "));
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 6,
        "expected the workspace's crates, found {checked}"
    );
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let mut graph = Graph::new();
    graph.insert("a".into(), ["b".into()].into());
    graph.insert("b".into(), ["c".into()].into());
    graph.insert("c".into(), BTreeSet::new());
    assert_eq!(find_cycle(&graph), None);
    graph.get_mut("c").expect("c").insert("a".into());
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}
