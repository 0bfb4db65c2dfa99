//! The source tree keeps its shape: inside each crate, module dependencies point one way,
//! among the top-level modules and among the sibling submodules of every module, at any
//! depth.
//!
//! A module depends on another when its non-test code names it through a path that starts
//! at `crate::`, `super::` (any number of them) or a group under either
//! (`super::{record::Keys, stream::TlsRead}`). Each such name counts in the graph of the
//! nearest module that holds both: `tls/known` naming `crate::tls::record` (or
//! `super::record`) is an edge `known -> record` among `tls`'s submodules, and `quic/driver`
//! naming `crate::route` is an edge `quic -> route` among the crate's top-level modules. A
//! module naming its own parent or its own submodules adds nothing. Comments and test
//! modules (`#[cfg(test)] mod tests`, and files of a module named `tests`) are left out: a
//! doc link or a test may look anywhere. A name reached through a parent's `pub use` is
//! not followed to the module that defines it, and `super::` inside an inline module
//! (`mod x { .. }`) is read as if it were at the file's level.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Module name to the sibling modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// A module's path inside its crate (`["tls", "record"]`; the crate root is empty).
type ModPath = Vec<String>;

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

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The lowercase identifiers (module-like names) at the start of `s`, joined by `::`.
/// `{` opens a group whose members each continue the path read so far.
fn read_paths(s: &str, prefix: &[String], out: &mut Vec<ModPath>) -> usize {
    let mut path = prefix.to_vec();
    let mut i = 0;
    loop {
        let rest = &s[i..];
        if let Some(group) = rest.strip_prefix('{') {
            // The path before the group is named even when no member is a module
            // (`record::{Keys, Opened}`).
            if path.len() > prefix.len() {
                out.push(path.clone());
            }
            // Members, separated by commas at this level, up to the closing brace.
            let mut j = 0;
            loop {
                let member = &group[j..];
                let skipped = member.len() - member.trim_start().len();
                j += skipped;
                j += read_paths(&group[j..], &path, out);
                let after = &group[j..];
                let end = after.find([',', '}']).unwrap_or(after.len());
                j += end;
                match group[j..].chars().next() {
                    Some(',') => j += 1,
                    Some('}') => return i + 1 + j + 1,
                    _ => return i + 1 + j,
                }
            }
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 || rest[end..].starts_with(|c: char| is_ident(c)) {
            break;
        }
        path.push(rest[..end].to_owned());
        i += end;
        match rest[end..].strip_prefix("::") {
            Some(_) => i += 2,
            None => break,
        }
    }
    if path.len() > prefix.len() {
        out.push(path);
    }
    i
}

/// Every module path `code`, the text of module `at`, names from the crate root or from
/// an ancestor, made absolute. Paths may run on past the module into an item.
fn named_paths(code: &str, at: &[String]) -> Vec<ModPath> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with(|c: char| is_ident(c) || c == ':') {
            continue;
        }
        read_paths(&code[i + "crate::".len()..], &[], &mut out);
    }
    for (i, _) in code.match_indices("super::") {
        // The first of a chain only; later ones follow `::`.
        if code[..i].ends_with(|c: char| is_ident(c) || c == ':') {
            continue;
        }
        let mut rest = &code[i..];
        let mut up = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            rest = r;
            up += 1;
        }
        let Some(base) = at.len().checked_sub(up) else {
            continue;
        };
        read_paths(rest, &at[..base], &mut out);
    }
    out
}

/// The module a file under `src` holds, or `None` for the crate root and test modules.
fn module_of(rel: &Path) -> Option<ModPath> {
    let mut parts: ModPath = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] || parts.iter().any(|p| p == "tests") {
        return None;
    }
    Some(parts)
}

/// For every module with submodules (the crate root is `[]`), the graph of its submodules.
/// `files` are the crate's source files: their paths under `src` and their text.
fn module_graphs<'a>(
    files: impl IntoIterator<Item = (&'a Path, &'a str)>,
) -> BTreeMap<ModPath, Graph> {
    let mut named: Vec<(ModPath, Vec<ModPath>)> = Vec::new();
    for (rel, text) in files {
        let Some(at) = module_of(rel) else {
            continue;
        };
        let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let code: String = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let paths = named_paths(&code, &at);
        named.push((at, paths));
    }
    let modules: BTreeSet<ModPath> = named.iter().map(|(m, _)| m.clone()).collect();
    let mut graphs: BTreeMap<ModPath, Graph> = BTreeMap::new();
    for module in &modules {
        let (parent, name) = module.split_at(module.len() - 1);
        graphs
            .entry(parent.to_vec())
            .or_default()
            .entry(name[0].clone())
            .or_default();
    }
    for (from, paths) in &named {
        for to in paths {
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            let (Some(a), Some(b)) = (from.get(common), to.get(common)) else {
                // An ancestor or a descendant: not a sibling.
                continue;
            };
            if !modules.contains(&to[..=common]) {
                continue;
            }
            graphs
                .entry(from[..common].to_vec())
                .or_default()
                .entry(a.clone())
                .or_default()
                .insert(b.clone());
        }
    }
    graphs
}

/// One import loop among the submodules of each module that has any, each as a chain of
/// module paths.
fn find_loops(graphs: &BTreeMap<ModPath, Graph>) -> Vec<String> {
    graphs
        .iter()
        .filter_map(|(parent, graph)| {
            let cycle = find_cycle(graph)?;
            let names: Vec<String> = cycle
                .into_iter()
                .map(|m| {
                    parent
                        .iter()
                        .chain([&m])
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("/")
                })
                .collect();
            Some(names.join(" -> "))
        })
        .collect()
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
    let mut nested = 0;
    let mut loops = Vec::new();
    for group in ["crates", "cmd"] {
        for entry in fs::read_dir(root.join(group)).expect("read_dir") {
            let src = entry.expect("entry").path().join("src");
            if !src.is_dir() {
                continue;
            }
            let mut paths = Vec::new();
            rust_files(&src, &mut paths);
            let files: Vec<(PathBuf, String)> = paths
                .into_iter()
                .map(|p| {
                    let text = fs::read_to_string(&p).expect("read");
                    (p.strip_prefix(&src).expect("under src").to_owned(), text)
                })
                .collect();
            let graphs = module_graphs(files.iter().map(|(p, t)| (p.as_path(), t.as_str())));
            for cycle in find_loops(&graphs) {
                loops.push(format!("{}: import loop {cycle}", src.display()));
            }
            checked += 1;
            nested += graphs.keys().filter(|p| !p.is_empty()).count();
        }
    }
    assert!(loops.is_empty(), "{}", loops.join("\n"));
    assert!(
        checked >= 6,
        "expected the workspace's crates, found {checked}"
    );
    // derp-io's tls and quic, derp-server's conn and quic, and more.
    assert!(
        nested >= 4,
        "expected modules with submodules, found {nested}"
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

/// `files` as a crate's sources, then its loops.
fn loops_in(files: &[(&str, &str)]) -> Vec<String> {
    find_loops(&module_graphs(
        files.iter().map(|(p, t)| (Path::new(*p), *t)),
    ))
}

#[test]
fn the_finder_sees_loops_between_submodules() {
    let tree = |known: &'static str, record: &'static str| {
        [
            ("lib.rs", "mod tls;\nmod server;\n"),
            (
                "tls.rs",
                "mod known;\nmod record;\nmod stream;\npub use record::Keys;\n",
            ),
            ("tls/known.rs", known),
            ("tls/record.rs", record),
            ("tls/stream.rs", "use super::record::Keys;\n"),
            ("server.rs", "use crate::tls::Keys;\n"),
        ]
    };
    // Downwards only: no loop.
    let down = tree(
        "pub struct Known;\n",
        "use super::known::Known;\nuse crate::tls::known;\n",
    );
    assert_eq!(loops_in(&down), Vec::<String>::new());
    // Back up through `super::`, through `crate::`, inside a group, after a chain.
    for back in [
        "use super::record::Keys;\n",
        "use crate::tls::record::Keys;\n",
        "use super::{self as tls, record::{Keys, Opened}};\n",
        "fn f(_: super::super::tls::record::Keys) {}\n",
        "use crate::{tls::{self, record}};\n",
    ] {
        let looped = tree(back, "use super::known::Known;\n");
        assert_eq!(
            loops_in(&looped),
            ["tls/known -> tls/record -> tls/known"],
            "{back}"
        );
    }
    // Comments, test modules and names that only end in `crate` or `super` name nothing.
    let quiet = tree(
        "// use super::record::Keys;\n/// [`super::record`]\nuse my_crate::record;\n\
         #[cfg(test)]\nmod tests {\n    use super::super::record::Keys;\n}\n",
        "use super::known::Known;\n",
    );
    assert_eq!(loops_in(&quiet), Vec::<String>::new());
}

#[test]
fn the_finder_sees_loops_at_every_depth() {
    let mut files = [
        ("main.rs", "mod conn;\n"),
        ("conn/mod.rs", "mod read;\nmod write;\n"),
        (
            "conn/read/mod.rs",
            "mod batch;\nmod frames;\n#[cfg(test)]\nmod tests;\n",
        ),
        (
            "conn/read/frames.rs",
            "use super::batch::Batch;\nuse crate::conn::write;\n",
        ),
        (
            "conn/read/batch.rs",
            "use crate::conn::read::frames::parse;\n",
        ),
        ("conn/write.rs", "use super::super::conn::read::frames;\n"),
        ("conn/read/tests.rs", "use super::batch;\n"),
        (
            "conn/read/tests/cases.rs",
            "use crate::conn::read::tests;\n",
        ),
    ];
    assert_eq!(
        loops_in(&files),
        [
            "conn/read -> conn/write -> conn/read",
            "conn/read/batch -> conn/read/frames -> conn/read/batch",
        ]
    );
    files[5].1 = "";
    assert_eq!(
        loops_in(&files),
        ["conn/read/batch -> conn/read/frames -> conn/read/batch"]
    );
    files[4].1 = "";
    assert_eq!(loops_in(&files), Vec::<String>::new());
}
