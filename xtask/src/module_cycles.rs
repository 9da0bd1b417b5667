//! `cargo xtask module-cycles`: finds modules of one crate that depend on each other, directly
//! (a parent using its child's items while the child uses the parent's, two siblings using each
//! other) or through others, in every crate of the workspace.
//!
//! A module depends on another when its code names an item of it: a `use` of `crate::`,
//! `super::` or `self::` paths, or such a path (or one through a child module) in its code.
//! Paths are followed through `pub use` re-exports to the module that defines the item, and a
//! re-export itself is no dependency: a facade that re-exports its children does not depend on
//! them. The crate root declares and wires every module, so what it names is no dependency
//! either; a module that uses an item the root defines does depend on the root. Inline modules
//! (`mod tests { .. }`) count as part of their file's module. A macro invocation's path is seen,
//! the tokens inside it are not.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// Cycles reported without failing the check, each with why it is still there: (crate, the
/// modules of the cycle, reason). A cycle is pending when each of its modules is one listed for
/// its crate or lies below one. To enforce the rule for a cycle, delete its entry; the test
/// `the_workspace_has_no_module_cycles` then fails until the cycle is gone. An entry that matches
/// no cycle fails the check too, so none outlives its cycle.
pub const PENDING: &[(&str, &[&str], &str)] = &[];

/// A module's path inside its crate: empty for the crate root.
type ModulePath = Vec<String>;

/// One module file: where it is, and what it refers to.
struct Module {
    file: PathBuf,
    /// `pub use` re-exports: the name visible here, and the absolute path it stands for.
    reexports: BTreeMap<String, ModulePath>,
    /// Absolute paths (crate-relative segments) this module's code refers to.
    references: Vec<ModulePath>,
}

/// A cycle of modules of one crate, with one reference per step that makes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Cycle {
    pub krate: String,
    /// The modules of the cycle (`crate` for the root), sorted.
    pub modules: Vec<String>,
    /// `from -> to (path)` for each dependency inside the cycle.
    pub edges: Vec<String>,
    /// Whether [`PENDING`] lets it pass for now.
    pub pending: bool,
}

impl fmt::Display for Cycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = if self.pending { " (pending: listed in xtask/src/module_cycles.rs)" } else { "" };
        writeln!(f, "{}: {}{state}", self.krate, self.modules.join(" <-> "))?;
        for edge in &self.edges {
            writeln!(f, "    {edge}")?;
        }
        Ok(())
    }
}

fn display(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_owned()
    } else {
        module.join("::")
    }
}

/// The crates of the workspace at `root` with their root files: each member's src/lib.rs and
/// src/main.rs (the latter named `name (bin)`).
fn crate_roots(root: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).map_err(|e| format!("reading Cargo.toml: {e}"))?;
    let mut roots = Vec::new();
    for member in workspace_members(&manifest)? {
        let dir = root.join(&member);
        let name = package_name(&dir).unwrap_or(member);
        for (file, suffix) in [("src/lib.rs", ""), ("src/main.rs", " (bin)")] {
            if dir.join(file).is_file() {
                roots.push((format!("{name}{suffix}"), dir.join(file)));
            }
        }
    }
    Ok(roots)
}

/// The `members = [ ... ]` list of a workspace manifest (just enough TOML for this one list).
fn workspace_members(manifest: &str) -> Result<Vec<String>, String> {
    let start = manifest.find("members").ok_or("Cargo.toml has no workspace members")?;
    let open = manifest[start..].find('[').ok_or("members is not a list")? + start;
    let close = manifest[open..].find(']').ok_or("members is not a closed list")? + open;
    Ok(manifest[open + 1..close].split('"').skip(1).step_by(2).map(str::to_owned).collect())
}

/// The `name` of a member's package.
fn package_name(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("Cargo.toml")).ok()?;
    let line = text.lines().find(|l| l.trim_start().starts_with("name"))?;
    Some(line.split('"').nth(1)?.to_owned())
}

/// Every module file of the crate whose root file is `root_file`, by module path.
fn load_crate(root_file: &Path) -> Result<BTreeMap<ModulePath, Module>, String> {
    let mut modules = BTreeMap::new();
    let mut queue = vec![(Vec::new(), root_file.to_owned(), true)];
    while let Some((path, file, owns_dir)) = queue.pop() {
        if modules.contains_key(&path) {
            continue; // the same module under several `cfg`s: the first file stands for all
        }
        let text = std::fs::read_to_string(&file).map_err(|e| format!("reading {}: {e}", file.display()))?;
        let syntax = syn::parse_file(&text).map_err(|e| format!("parsing {}: {e}", file.display()))?;
        // Where this file's `mod x;` children live: beside a root or mod.rs, else in a folder
        // named after the module.
        let dir = match (owns_dir, file.parent()) {
            (true, Some(parent)) => parent.to_owned(),
            (false, Some(parent)) => parent.join(path.last().map_or("", String::as_str)),
            (_, None) => PathBuf::new(),
        };
        let mut collector = Collector { module: path.clone(), depth: 0, ..Collector::default() };
        collector.visit_file(&syntax);
        for (name, attribute_path) in &collector.file_children {
            let mut child = path.clone();
            child.push(name.clone());
            let (child_file, child_owns_dir) = match attribute_path {
                Some(relative) => (file.parent().unwrap_or(Path::new("")).join(relative), false),
                None if dir.join(format!("{name}.rs")).is_file() => (dir.join(format!("{name}.rs")), false),
                None => (dir.join(name).join("mod.rs"), true),
            };
            if child_file.is_file() {
                queue.push((child, child_file, child_owns_dir));
            }
        }
        modules.insert(path, Module { file, reexports: collector.reexports, references: collector.references });
    }
    Ok(modules)
}

/// Walks one file, collecting its child modules, re-exports and the paths its code names.
#[derive(Default)]
struct Collector {
    /// The module being walked (an inline module's path while inside it).
    module: ModulePath,
    /// How deep in inline modules the walk is.
    depth: usize,
    /// `mod x;` declarations, with a `#[path]` if one is given.
    file_children: Vec<(String, Option<String>)>,
    children: BTreeSet<String>,
    reexports: BTreeMap<String, ModulePath>,
    references: Vec<ModulePath>,
}

impl Collector {
    /// The absolute form of `segments`, named in the module being walked; `None` for paths
    /// that do not start in this crate (`std::`, other crates, local names).
    fn absolute(&self, segments: &[String]) -> Option<ModulePath> {
        let mut base = self.module.clone();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().map(String::as_str) == Some("super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
            }
            // A child declared in the file's module (top level only: inside an inline module
            // the same name would need `super::`).
            Some(first) if self.depth == 0 && self.children.contains(first) && rest.len() > 1 => {}
            _ => return None,
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    fn add_use(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>, public: bool) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.add_use(&p.tree, prefix, public);
                prefix.pop();
            }
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.add_use(item, prefix, public);
                }
            }
            syn::UseTree::Name(n) => self.add_import(prefix, &n.ident.to_string(), &n.ident.to_string(), public),
            syn::UseTree::Rename(r) => self.add_import(prefix, &r.ident.to_string(), &r.rename.to_string(), public),
            syn::UseTree::Glob(_) => {
                if let Some(target) = self.absolute(prefix) {
                    if !public {
                        self.references.push(target);
                    }
                }
            }
        }
    }

    fn add_import(&mut self, prefix: &[String], name: &str, visible_as: &str, public: bool) {
        let mut segments = prefix.to_vec();
        if name != "self" {
            segments.push(name.to_owned());
        }
        let Some(target) = self.absolute(&segments) else { return };
        if public && self.depth == 0 {
            self.reexports.insert(visible_as.to_owned(), target);
        } else if !public {
            self.references.push(target);
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        let name = item.ident.to_string();
        if self.depth == 0 {
            self.children.insert(name.clone());
        }
        match &item.content {
            None => {
                if self.depth == 0 {
                    let path = item.attrs.iter().find(|a| a.path().is_ident("path")).and_then(|a| match &a.meta {
                        syn::Meta::NameValue(nv) => match &nv.value {
                            syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value()),
                            _ => None,
                        },
                        _ => None,
                    });
                    self.file_children.push((name, path));
                }
            }
            Some((_, items)) => {
                self.module.push(name);
                self.depth += 1;
                for item in items {
                    self.visit_item(item);
                }
                self.depth -= 1;
                self.module.pop();
            }
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let public = !matches!(item.vis, syn::Visibility::Inherited);
        self.add_use(&item.tree, &mut Vec::new(), public);
    }

    /// `pub(crate)` and `pub(in path)` name modules without depending on them.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if let Some(target) = self.absolute(&segments) {
            self.references.push(target);
        }
        syn::visit::visit_path(self, path);
    }
}

/// The module file `target` lies in, following re-exports to where an item is defined.
fn resolve(modules: &BTreeMap<ModulePath, Module>, target: &[String]) -> Option<ModulePath> {
    let mut target = target.to_vec();
    for _ in 0..16 {
        let module = (0..=target.len()).rev().map(|n| &target[..n]).find(|p| modules.contains_key(*p))?.to_vec();
        let next = target.get(module.len());
        match next.and_then(|name| modules[&module].reexports.get(name)) {
            Some(origin) if origin.as_slice() != target.as_slice() => {
                let mut followed = origin.clone();
                followed.extend(target[module.len() + 1..].iter().cloned());
                target = followed;
            }
            _ => return Some(module),
        }
    }
    None
}

/// The cycles of one crate: its strongly connected groups of more than one module.
fn crate_cycles(krate: &str, modules: &BTreeMap<ModulePath, Module>) -> Vec<Cycle> {
    let mut edges: BTreeMap<ModulePath, BTreeMap<ModulePath, String>> = BTreeMap::new();
    for (from, module) in modules {
        for reference in &module.references {
            if let Some(to) = resolve(modules, reference) {
                // The root declares and wires every module, so each lies below it: what the
                // root itself names is no dependency that could close a cycle.
                if to != *from && !from.is_empty() {
                    edges.entry(from.clone()).or_default().entry(to).or_insert_with(|| display(reference));
                }
            }
        }
    }
    let groups = strongly_connected(modules.keys().cloned().collect(), &edges);
    groups
        .into_iter()
        .filter(|group| group.len() > 1)
        .map(|group| {
            let members: BTreeSet<&ModulePath> = group.iter().collect();
            let mut steps = Vec::new();
            for from in &group {
                for (to, via) in edges.get(from).into_iter().flatten() {
                    if members.contains(to) {
                        steps.push(format!(
                            "{} -> {} ({via}, {})",
                            display(from),
                            display(to),
                            modules[from].file.display()
                        ));
                    }
                }
            }
            let mut names: Vec<String> = group.iter().map(|m| display(m)).collect();
            names.sort();
            steps.sort();
            let pending = PENDING.iter().any(|&(k, listed, _)| k == krate && names.iter().all(|m| covers(listed, m)));
            Cycle { krate: krate.to_owned(), modules: names, edges: steps, pending }
        })
        .collect()
}

/// Whether `module` (as [`display`] writes it) is one of the top-level modules `listed`, or lies
/// below one. The crate root is never listed.
fn covers(listed: &[&str], module: &str) -> bool {
    module != "crate" && module.split("::").next().is_some_and(|top| listed.contains(&top))
}

/// The entries of `pending` that match none of `cycles`: the cycle was broken and its entry left
/// behind, where it would let a new cycle among the same modules pass unnoticed.
fn stale_entries(pending: &[(&str, &[&str], &str)], cycles: &[Cycle]) -> Vec<String> {
    pending
        .iter()
        .filter(|&&(krate, listed, _)| {
            !cycles.iter().any(|c| c.krate == krate && c.modules.iter().all(|m| covers(listed, m)))
        })
        .map(|(krate, listed, _)| format!("{krate}: {}", listed.join(", ")))
        .collect()
}

/// Tarjan's strongly connected components, iteratively small enough for a crate's modules.
fn strongly_connected(
    nodes: Vec<ModulePath>,
    edges: &BTreeMap<ModulePath, BTreeMap<ModulePath, String>>,
) -> Vec<Vec<ModulePath>> {
    struct State<'a> {
        edges: &'a BTreeMap<ModulePath, BTreeMap<ModulePath, String>>,
        index: BTreeMap<ModulePath, usize>,
        low: BTreeMap<ModulePath, usize>,
        stack: Vec<ModulePath>,
        on_stack: BTreeSet<ModulePath>,
        groups: Vec<Vec<ModulePath>>,
    }
    fn connect(state: &mut State<'_>, node: &ModulePath) {
        let n = state.index.len();
        state.index.insert(node.clone(), n);
        state.low.insert(node.clone(), n);
        state.stack.push(node.clone());
        state.on_stack.insert(node.clone());
        let targets: Vec<ModulePath> = state.edges.get(node).map(|e| e.keys().cloned().collect()).unwrap_or_default();
        for target in targets {
            if !state.index.contains_key(&target) {
                connect(state, &target);
                let low = state.low[node].min(state.low[&target]);
                state.low.insert(node.clone(), low);
            } else if state.on_stack.contains(&target) {
                let low = state.low[node].min(state.index[&target]);
                state.low.insert(node.clone(), low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut group = Vec::new();
            while let Some(member) = state.stack.pop() {
                state.on_stack.remove(&member);
                let done = member == *node;
                group.push(member);
                if done {
                    break;
                }
            }
            state.groups.push(group);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        groups: Vec::new(),
    };
    for node in &nodes {
        if !state.index.contains_key(node) {
            connect(&mut state, node);
        }
    }
    state.groups
}

/// Every module cycle of every crate of the workspace at `root`.
pub fn find(root: &Path) -> Result<Vec<Cycle>, String> {
    let mut cycles = Vec::new();
    for (krate, file) in crate_roots(root)? {
        cycles.extend(crate_cycles(&krate, &load_crate(&file)?));
    }
    Ok(cycles)
}

/// `cargo xtask module-cycles`: lists every cycle; fails on any not [`PENDING`].
pub fn run(root: &Path) -> Result<(), String> {
    let cycles = find(root)?;
    for cycle in &cycles {
        print!("{cycle}");
    }
    let failing = cycles.iter().filter(|c| !c.pending).count();
    if failing > 0 {
        return Err(format!("{failing} module cycle(s); docs/decisions.md promises none"));
    }
    let stale = stale_entries(PENDING, &cycles);
    if !stale.is_empty() {
        return Err(format!(
            "PENDING in xtask/src/module_cycles.rs lists cycles that are gone: {}; delete those entries",
            stale.join("; ")
        ));
    }
    match cycles.len() {
        0 => println!("no module cycles"),
        pending => println!("no module cycles but the {pending} pending ones"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throwaway crate written under the target directory.
    fn fixture(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/module-cycles-fixtures").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let file = dir.join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(file, text).unwrap();
        }
        dir.join("lib.rs")
    }

    fn cycles_of(name: &str, files: &[(&str, &str)]) -> Vec<Vec<String>> {
        let root = fixture(name, files);
        crate_cycles(name, &load_crate(&root).unwrap()).into_iter().map(|c| c.modules).collect()
    }

    #[test]
    fn an_entry_of_pending_that_matches_no_cycle_is_stale() {
        let cycle = |krate: &str, modules: &[&str]| Cycle {
            krate: krate.to_owned(),
            modules: modules.iter().map(|m| (*m).to_owned()).collect(),
            edges: Vec::new(),
            pending: true,
        };
        let cycles = [cycle("cumempool", &["bench", "bench::copies"]), cycle("cumempool-alloc", &["crate", "lanes"])];
        let pending: &[(&str, &[&str], &str)] = &[
            ("cumempool", &["bench"], "still there"),
            ("cumempool", &["graph", "stream"], "broken since"),
            ("cumempool-cli", &["bench"], "another crate's modules"),
            ("cumempool-alloc", &["lanes"], "the root is never covered"),
        ];
        assert_eq!(
            stale_entries(pending, &cycles),
            ["cumempool: graph, stream", "cumempool-cli: bench", "cumempool-alloc: lanes"]
        );
        assert!(stale_entries(&[], &cycles).is_empty());
    }

    #[test]
    fn a_parent_and_a_child_that_use_each_other_are_a_cycle() {
        let found = cycles_of(
            "parent_child",
            &[
                ("lib.rs", "mod bench;\n"),
                ("bench.rs", "mod copies;\nfn median() {}\npub fn run() { copies::measure() }\n"),
                ("bench/copies.rs", "use super::median;\npub fn measure() { median() }\n"),
            ],
        );
        assert_eq!(found, vec![vec!["bench".to_owned(), "bench::copies".to_owned()]]);
    }

    #[test]
    fn siblings_that_use_each_other_are_a_cycle() {
        let found = cycles_of(
            "siblings",
            &[
                ("lib.rs", "mod entry_table;\nmod injection;\n"),
                (
                    "entry_table.rs",
                    "use crate::injection;\npub const COUNT: usize = 1;\nfn f() { injection::decide() }\n",
                ),
                ("injection.rs", "use crate::entry_table::COUNT;\npub fn decide() {}\n"),
            ],
        );
        assert_eq!(found, vec![vec!["entry_table".to_owned(), "injection".to_owned()]]);
    }

    #[test]
    fn re_exports_tests_and_one_way_uses_are_no_cycle() {
        let found = cycles_of(
            "acyclic",
            &[
                ("lib.rs", "mod error;\nmod pool;\npub use error::Error;\npub use pool::Pool;\n"),
                ("error.rs", "pub struct Error;\n#[cfg(test)]\nmod tests { use super::*; }\n"),
                ("pool.rs", "use crate::Error;\npub struct Pool;\n#[cfg(test)]\nmod tests { use super::*; }\n"),
            ],
        );
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn the_workspace_has_no_module_cycles() {
        let cycles = find(&crate::workspace::root()).unwrap();
        let failing: Vec<String> = cycles.iter().filter(|c| !c.pending).map(ToString::to_string).collect();
        assert!(failing.is_empty(), "module cycles:\n{}", failing.concat());
    }
}
