//! `cargo xtask module-cycles`: finds modules of one crate that depend on each other, directly
//! (a parent using its child's items while the child uses the parent's, two siblings using each
//! other) or through others, in every crate of the workspace.
//!
//! A module file depends on another when its code names an item of it: a `use` of `crate::`,
//! `super::` or `self::` paths (whatever its visibility), or such a path (or one through a
//! child module) in its code, in a macro's tokens included. Paths are followed through
//! `pub use` re-exports to the module that defines the item. The one `use` that is no
//! dependency is a top-level `pub use` of an item below the file's own module: a facade that
//! re-exports its children does not depend on them (its code that names them does). The crate
//! root is a file like the others: its `mod` and re-exports wire the crate, its code depends.
//! Inline modules (`mod tests { .. }`) count as part of their file's module.
//!
//! A module is its file and every module below it, so cycles are looked for at each module,
//! among its parts: its own file and each child with what lies below it. `error.rs` naming an
//! item of `route/key.rs` depends on `route`, and with `route.rs` using `error.rs` the two
//! modules make a cycle though no two files do. A cycle of files is always one among the parts
//! of the module that holds them all, so no separate rule for files is needed.

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

/// Which folder may use which: for a crate listed here, its top-level modules (the folders that
/// show its layers, and the files beside them) from the bottom up. A module may use only those
/// listed before it, and every top-level module must be listed: the one place that says which
/// layer may use which. Inside a folder, and in crates not listed, only cycles are looked for.
pub const LAYERS: &[(&str, &[&str])] = &[
    (
        "cumempool",
        &[
            "values",          // locations, routes, access, export handle types: pure values
            "error",           // the error type (it names a `Route`)
            "driver",          // the one driver-call path, handles that may cross threads
            "devices",         // devices, contexts, a route's check against them
            "bare_pools",      // a pool as a bare handle: owner, recipe, retirement, attributes
            "streams",         // streams, events, captures, deferred frees
            "memory",          // blocks, buffers, allocations made during a capture
            "pool",            // the pool handles
            "routing",         // default and current pools, the route table
            "graph",           // captures into graphs, executables
            "sharing",         // IPC, descriptor passing, VMM
            "cudarc_interop",  // cudarc's streams and contexts
            "header_coverage", // the test of what the headers add
        ],
    ),
    (
        "cumempool-py",
        &[
            "sync",        // the GIL, released around driver calls; locks that outlive a panic
            "errors",      // the Python exception classes and the conversion of every Rust error
            "values",      // enums, locations and routes, devices, what the build's features offer
            "streams",     // the `Stream` class, lent streams, default-stream handles, contexts
            "memory",      // a live allocation, the resource it goes back to, DLPack, sharing, `Buffer`
            "pools",       // `MemPool`, default and current pools, resources, the stack's driver link
            "plugins",     // the torch plug-in's C entry points, CuPy's common case
            "bench_hooks", // hooks for the Python bench (cargo feature `bench-hooks`)
        ],
    ),
];

/// A module's path inside its crate: empty for the crate root.
type ModulePath = Vec<String>;

/// One module file: where it is, and what it refers to.
struct Module {
    file: PathBuf,
    /// `pub use` re-exports: the name visible here, and the absolute path it stands for.
    reexports: BTreeMap<String, ModulePath>,
    /// `pub use x::*` re-exports: the absolute paths whose names are visible here too.
    globs: Vec<ModulePath>,
    /// The names of the items the file defines at its top level.
    defines: BTreeSet<String>,
    /// Absolute paths (crate-relative segments) this module's code refers to.
    references: Vec<ModulePath>,
}

/// A cycle of modules of one crate, with one reference per step that makes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Cycle {
    pub krate: String,
    /// The parts of the cycle, sorted: children of one module (each with what lies below it) and
    /// that module's own file (`crate` for the root).
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
        let collector = Collector::new(path.clone(), &syntax).collect(&syntax);
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
        let defines = syntax.items.iter().filter_map(item_name).collect();
        let Collector { reexports, globs, references, .. } = collector;
        modules.insert(path, Module { file, reexports, globs, defines, references });
    }
    Ok(modules)
}

/// The name an item defines, if any.
fn item_name(item: &syn::Item) -> Option<String> {
    let ident = match item {
        syn::Item::Const(i) => &i.ident,
        syn::Item::Enum(i) => &i.ident,
        syn::Item::Fn(i) => &i.sig.ident,
        syn::Item::Macro(i) => i.ident.as_ref()?,
        syn::Item::Mod(i) => &i.ident,
        syn::Item::Static(i) => &i.ident,
        syn::Item::Struct(i) => &i.ident,
        syn::Item::Trait(i) => &i.ident,
        syn::Item::TraitAlias(i) => &i.ident,
        syn::Item::Type(i) => &i.ident,
        syn::Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
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
    /// The file's top-level modules, inline or not: known before the walk, so a `use` above
    /// its `mod` resolves too.
    children: BTreeSet<String>,
    reexports: BTreeMap<String, ModulePath>,
    globs: Vec<ModulePath>,
    /// Names a top-level `pub use` of a module below this one brings in: the facade's own code
    /// may name them bare (`impl Route`), which does depend on the child.
    facade_names: BTreeMap<String, ModulePath>,
    /// Top-level paths that start with a name of neither this crate nor a child, resolved once
    /// the whole file is walked (a bare name may come from a `pub use` further down).
    bare_paths: Vec<Vec<String>>,
    references: Vec<ModulePath>,
}

impl Collector {
    /// A collector for `file`, the module `module`.
    fn new(module: ModulePath, file: &syn::File) -> Self {
        let children = file
            .items
            .iter()
            .filter_map(|item| match item {
                syn::Item::Mod(m) => Some(m.ident.to_string()),
                _ => None,
            })
            .collect();
        Collector { module, children, ..Collector::default() }
    }

    /// Walks `file` and settles the bare names its code used.
    fn collect(mut self, file: &syn::File) -> Self {
        self.visit_file(file);
        for path in std::mem::take(&mut self.bare_paths) {
            if let Some(target) = self.facade_names.get(&path[0]) {
                let mut target = target.clone();
                target.extend(path[1..].iter().cloned());
                self.references.push(target);
            }
        }
        self
    }

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

    /// Whether `target` lies below the file's own module: re-exporting it is a facade's work.
    fn below_this_file(&self, target: &[String]) -> bool {
        let file_module = &self.module[..self.module.len() - self.depth];
        target.len() > file_module.len() && target.starts_with(file_module)
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
                    // One that re-exports a child is the facade's, any other is a dependency
                    // like a private one.
                    let facade = public && self.depth == 0 && self.below_this_file(&target);
                    if public && self.depth == 0 {
                        self.globs.push(target.clone());
                    }
                    if !facade {
                        self.references.push(target);
                    }
                }
            }
        }
    }

    /// One imported name. Every `use` is a dependency of the file, with one exception: a
    /// top-level `pub use` (any `pub(..)` too) of an item below the file's own module, which
    /// only re-exports a child's item; the facade's code that names it bare still depends on
    /// it. A `pub use` of a module elsewhere is both a re-export and a dependency: the file
    /// imports the item like any `use`, and its users reach it through the file.
    fn add_import(&mut self, prefix: &[String], name: &str, visible_as: &str, public: bool) {
        let mut segments = prefix.to_vec();
        if name != "self" {
            segments.push(name.to_owned());
        }
        let Some(target) = self.absolute(&segments) else { return };
        if public && self.depth == 0 {
            self.reexports.insert(visible_as.to_owned(), target.clone());
            if self.below_this_file(&target) {
                self.facade_names.insert(visible_as.to_owned(), target);
                return;
            }
        }
        self.references.push(target);
    }

    /// The paths among a macro's tokens (`crate::x`, `$crate::x`, `super::x`, `child::x`): the
    /// tokens of `format!`, `wrap_pyfunction!` or a `macro_rules!` body are code as much as any.
    fn add_token_paths(&mut self, tokens: proc_macro2::TokenStream) {
        use proc_macro2::{Spacing, TokenTree};
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let is_colons = |i: usize| {
            matches!((tokens.get(i), tokens.get(i + 1)),
                (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
                    if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':')
        };
        let mut i = 0;
        while i < tokens.len() {
            match &tokens[i] {
                TokenTree::Group(group) => self.add_token_paths(group.stream()),
                TokenTree::Ident(ident) if is_colons(i + 1) && !(i >= 2 && is_colons(i - 2)) => {
                    let mut segments = vec![ident.to_string()];
                    let mut j = i + 1;
                    while is_colons(j) {
                        let Some(TokenTree::Ident(next)) = tokens.get(j + 2) else { break };
                        segments.push(next.to_string());
                        j += 3;
                    }
                    if let Some(target) = self.absolute(&segments) {
                        self.references.push(target);
                    } else if self.depth == 0 {
                        self.bare_paths.push(segments);
                    }
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        let name = item.ident.to_string();
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
        } else if self.depth == 0 && path.leading_colon.is_none() {
            self.bare_paths.push(segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        syn::visit::visit_macro(self, mac);
        self.add_token_paths(mac.tokens.clone());
    }
}

/// The module file `target` lies in, following re-exports (named or glob) to where an item is
/// defined.
fn resolve(modules: &BTreeMap<ModulePath, Module>, target: &[String]) -> Option<ModulePath> {
    let mut target = target.to_vec();
    for _ in 0..16 {
        let module = (0..=target.len()).rev().map(|n| &target[..n]).find(|p| modules.contains_key(*p))?.to_vec();
        let Some(name) = target.get(module.len()) else { return Some(module) };
        let here = &modules[&module];
        let origin = match here.reexports.get(name) {
            Some(origin) => Some(origin.clone()),
            None if here.defines.contains(name) => None,
            None => here.globs.iter().find(|glob| provides(modules, glob, name, 8)).map(|glob| {
                let mut origin = glob.clone();
                origin.push(name.clone());
                origin
            }),
        };
        match origin {
            Some(origin) if origin.as_slice() != target.as_slice() => {
                let mut followed = origin;
                followed.extend(target[module.len() + 1..].iter().cloned());
                target = followed;
            }
            _ => return Some(module),
        }
    }
    None
}

/// Whether the module `module` defines or re-exports `name`.
fn provides(modules: &BTreeMap<ModulePath, Module>, module: &[String], name: &str, depth: usize) -> bool {
    let Some(here) = modules.get(module) else { return false };
    here.defines.contains(name)
        || here.reexports.contains_key(name)
        || (depth > 0 && here.globs.iter().any(|glob| provides(modules, glob, name, depth - 1)))
}

/// Where a dependency of `from` on `to` (two module files) counts: at the deepest module that
/// holds both (`level`), between the two parts of it that hold them: the level's own file, or
/// one of its children with everything below it. So `error -> route::key` is `error -> route`
/// among the crate's top-level modules, and `route::key -> route` is a child using its parent.
fn placed(from: &[String], to: &[String]) -> (ModulePath, ModulePath, ModulePath) {
    let shared = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    let part = |module: &[String]| module[..module.len().min(shared + 1)].to_vec();
    (from[..shared].to_vec(), part(from), part(to))
}

/// The cycles of one crate: at each module, the strongly connected groups of more than one of
/// its parts (its own file and each child with what lies below it). A cycle between files is
/// always one between the parts of the module that holds them all, so this finds those too;
/// and a dependency on a child's file is one on the child, however the path reached it
/// (`crate::route::Route` re-exported from `route::key` is still `route`).
fn crate_cycles(krate: &str, modules: &BTreeMap<ModulePath, Module>) -> Vec<Cycle> {
    type Edges = BTreeMap<ModulePath, BTreeMap<ModulePath, String>>;
    let mut levels: BTreeMap<ModulePath, Edges> = BTreeMap::new();
    for (from, module) in modules {
        for reference in &module.references {
            let Some(to) = resolve(modules, reference) else { continue };
            if to == *from {
                continue;
            }
            let (level, from_part, to_part) = placed(from, &to);
            let defined_in = if to == to_part { String::new() } else { format!(" in {}", display(&to)) };
            let via = format!("{}{defined_in}, {}", display(reference), module.file.display());
            levels.entry(level).or_default().entry(from_part).or_default().entry(to_part).or_insert(via);
        }
    }
    let mut cycles = Vec::new();
    for (level, edges) in &levels {
        let parts: Vec<ModulePath> =
            modules.keys().filter(|m| m.starts_with(level) && m.len() <= level.len() + 1).cloned().collect();
        for group in strongly_connected(parts, edges).into_iter().filter(|group| group.len() > 1) {
            let members: BTreeSet<&ModulePath> = group.iter().collect();
            let mut steps = Vec::new();
            for from in &group {
                for (to, via) in edges.get(from).into_iter().flatten() {
                    if members.contains(to) {
                        steps.push(format!("{} -> {} ({via})", display(from), display(to)));
                    }
                }
            }
            let mut names: Vec<String> = group.iter().map(|m| display(m)).collect();
            names.sort();
            steps.sort();
            let pending = PENDING.iter().any(|&(k, listed, _)| k == krate && names.iter().all(|m| covers(listed, m)));
            cycles.push(Cycle { krate: krate.to_owned(), modules: names, edges: steps, pending });
        }
    }
    cycles
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

/// The uses against a crate's [`LAYERS`] order, `layers` (its top-level modules from the
/// bottom up), one line each, and the top-level modules the order lacks. The crate root only
/// wires the layers (its `mod`s and re-exports), so its uses are not looked at.
fn layer_breaches(krate: &str, layers: &[&str], modules: &BTreeMap<ModulePath, Module>) -> Vec<String> {
    let rank = |top: &str| layers.iter().position(|layer| *layer == top);
    let mut breaches = BTreeSet::new();
    for top in modules.keys().filter(|m| m.len() == 1).map(|m| m[0].as_str()) {
        if rank(top).is_none() {
            breaches.insert(format!("{krate}: `{top}` is in no layer; place it in LAYERS"));
        }
    }
    for (from, module) in modules {
        let Some(from_top) = from.first() else { continue };
        for reference in &module.references {
            let Some(to) = resolve(modules, reference) else { continue };
            let Some(to_top) = to.first() else { continue };
            if let (Some(user), Some(used)) = (rank(from_top), rank(to_top)) {
                if used > user {
                    breaches.insert(format!(
                        "{krate}: {from_top} may not use {to_top}, a layer above it ({}, {})",
                        display(reference),
                        module.file.display()
                    ));
                }
            }
        }
    }
    breaches.into_iter().collect()
}

/// Every use against [`LAYERS`] in the workspace at `root`.
pub fn find_layer_breaches(root: &Path) -> Result<Vec<String>, String> {
    let mut breaches = Vec::new();
    for (krate, file) in crate_roots(root)? {
        if let Some(&(_, layers)) = LAYERS.iter().find(|(listed, _)| *listed == krate) {
            breaches.extend(layer_breaches(&krate, layers, &load_crate(&file)?));
        }
    }
    Ok(breaches)
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
    let breaches = find_layer_breaches(root)?;
    if !breaches.is_empty() {
        return Err(format!(
            "uses against the layers of LAYERS in xtask/src/module_cycles.rs:\n  {}",
            breaches.join("\n  ")
        ));
    }
    let stale = stale_entries(PENDING, &cycles);
    if !stale.is_empty() {
        return Err(format!(
            "PENDING in xtask/src/module_cycles.rs lists cycles that are gone: {}; delete those entries",
            stale.join("; ")
        ));
    }
    match cycles.len() {
        0 => println!("no module cycles, and every folder uses only the layers below it"),
        pending => {
            println!("no module cycles but the {pending} pending ones; every folder uses only the layers below it")
        }
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

    /// The shape `cumempool` had: error.rs names `crate::route::InvalidRoute`, which route.rs
    /// re-exports from its child route/key.rs, while route.rs uses error.rs. No two files use
    /// each other, but the modules `error` and `route` do.
    #[test]
    fn a_module_that_uses_a_child_of_a_module_that_uses_it_is_a_cycle() {
        let found = cycles_of(
            "through_a_child",
            &[
                ("lib.rs", "mod error;\nmod route;\npub use route::InvalidRoute;\n"),
                ("error.rs", "use crate::route::InvalidRoute;\npub enum Error { Route(InvalidRoute) }\n"),
                (
                    "route.rs",
                    "mod key;\npub use key::InvalidRoute;\nuse crate::error::Error;\nfn check() -> Error { todo!() }\n",
                ),
                ("route/key.rs", "pub struct InvalidRoute;\n"),
            ],
        );
        assert_eq!(found, vec![vec!["error".to_owned(), "route".to_owned()]]);
    }

    /// What the old check took for no dependency: a `pub(crate) use` of a sibling (a re-export,
    /// but an import too), a path inside a macro's tokens, and the crate root's own code.
    #[test]
    fn restricted_re_exports_macro_tokens_and_the_root_s_code_are_dependencies() {
        let re_export = cycles_of(
            "restricted_re_export",
            &[
                ("lib.rs", "mod a;\nmod b;\n"),
                ("a.rs", "pub(crate) use crate::b::Limit;\npub struct Size;\n"),
                ("b.rs", "use crate::a::Size;\npub struct Limit;\n"),
            ],
        );
        assert_eq!(re_export, vec![vec!["a".to_owned(), "b".to_owned()]]);
        let macro_tokens = cycles_of(
            "macro_tokens",
            &[
                ("lib.rs", "mod a;\nmod b;\n"),
                ("a.rs", "pub const N: u8 = 1;\nfn f() -> String { format!(\"{}\", crate::b::M) }\n"),
                ("b.rs", "pub const M: u8 = crate::a::N;\n"),
            ],
        );
        assert_eq!(macro_tokens, vec![vec!["a".to_owned(), "b".to_owned()]]);
        let child_in_tokens = cycles_of(
            "child_in_macro_tokens",
            &[
                ("lib.rs", "mod m;\n"),
                ("m.rs", "mod key;\npub const N: u8 = 1;\nfn f() -> String { format!(\"{}\", key::K) }\n"),
                ("m/key.rs", "pub const K: u8 = super::N;\n"),
            ],
        );
        assert_eq!(child_in_tokens, vec![vec!["m".to_owned(), "m::key".to_owned()]]);
        let root_code = cycles_of(
            "root_code",
            &[
                ("lib.rs", "mod a;\nfn root() {}\nfn main() { a::run() }\n"),
                ("a.rs", "pub fn run() { crate::root() }\n"),
            ],
        );
        assert_eq!(root_code, vec![vec!["a".to_owned(), "crate".to_owned()]]);
    }

    /// A facade's code that names its child's item through its own `pub use` depends on the
    /// child: with the child using the facade, the two files make a cycle.
    #[test]
    fn a_facade_that_uses_what_it_re_exports_depends_on_the_child() {
        let found = cycles_of(
            "facade_use",
            &[
                ("lib.rs", "mod route;\n"),
                ("route.rs", "pub use key::Route;\nmod key;\nfn limit() -> u8 { 1 }\nimpl Route { fn f() {} }\n"),
                ("route/key.rs", "pub struct Route(u8);\nfn g() -> u8 { super::limit() }\n"),
            ],
        );
        assert_eq!(found, vec![vec!["route".to_owned(), "route::key".to_owned()]]);
    }

    /// The generated bindings' shape: a list macro that names `$crate::bindings::..`, which
    /// re-exports the generated file with a glob. Followed through the glob, the loader uses
    /// the generated file and not the facade that re-exports the loader's table; a generated
    /// file that re-exports the loader's table itself is a cycle.
    #[test]
    fn glob_re_exports_are_followed_to_where_the_item_is() {
        let files = |generated_tail: &'static str| {
            [
                ("lib.rs", "mod generated;\nmod loader;\npub mod bindings;\n"),
                ("bindings.rs", "pub use crate::generated::*;\npub use crate::loader::Table;\n"),
                ("loader.rs", "use crate::bindings::Code;\npub struct Table(Code);\n"),
                ("generated.rs", generated_tail),
            ]
        };
        let generated = "pub struct Code;\nmacro_rules! each { () => { $crate::bindings::Code } }\n";
        assert!(cycles_of("glob_followed", &files(generated)).is_empty());
        let re_exporting = "pub struct Code;\npub use crate::loader::Table;\n";
        assert_eq!(
            cycles_of("generated_re_exports_the_loader", &files(re_exporting)),
            vec![vec!["generated".to_owned(), "loader".to_owned()]]
        );
    }

    #[test]
    fn the_workspace_has_no_module_cycles() {
        let cycles = find(&crate::workspace::root()).unwrap();
        let failing: Vec<String> = cycles.iter().filter(|c| !c.pending).map(ToString::to_string).collect();
        assert!(failing.is_empty(), "module cycles:\n{}", failing.concat());
    }

    #[test]
    fn the_workspace_keeps_its_layers() {
        let breaches = find_layer_breaches(&crate::workspace::root()).unwrap();
        assert!(breaches.is_empty(), "uses against LAYERS:\n{}", breaches.join("\n"));
    }

    #[test]
    fn a_use_of_a_layer_above_and_a_module_in_no_layer_are_breaches() {
        let root = fixture(
            "layers",
            &[
                ("lib.rs", "mod values;\nmod streams;\nmod extra;\npub use streams::stream::Stream;\n"),
                ("values.rs", "pub(crate) mod route;\n"),
                ("values/route.rs", "pub struct Route;\nfn f() { let _ = crate::Stream::new(); }\n"),
                ("streams.rs", "pub(crate) mod stream;\n"),
                ("streams/stream.rs", "use crate::values::route::Route;\npub struct Stream(Route);\n"),
                ("extra.rs", "use crate::values::route::Route;\n"),
            ],
        );
        let modules = load_crate(&root).unwrap();
        let breaches = layer_breaches("layers", &["values", "streams"], &modules);
        assert_eq!(breaches.len(), 2, "{breaches:#?}");
        assert!(breaches[0].starts_with("layers: `extra` is in no layer"), "{breaches:#?}");
        assert!(breaches[1].starts_with("layers: values may not use streams"), "{breaches:#?}");
        assert!(layer_breaches("layers", &["values", "streams", "extra"], &modules).len() == 1);
    }
}
