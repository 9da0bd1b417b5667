//! `cargo xtask internals-check`: every file and item `docs/internals.md` names exists, so the
//! map a maintainer starts from cannot go stale; and every row of the pool-attribute table has
//! the places that follow from it (`attribute_places`).
//!
//! Read in each table row's last cell: a backticked path (ending in a source or doc extension,
//! or `/`) must exist, written from the workspace root or relative to a folder of the path named
//! before it in the cell (`crates/cumempool-alloc/src/caching/lanes.rs`, then
//! `caching/table.rs`); `<...>` and `*` stand for any name. A backticked item after a path
//! (`Stream::legacy_for_per_thread`, `gated!`, `LENT`) must appear in that file: its last
//! segment, as a word.

use std::path::{Path, PathBuf};

/// One name the map gives that the tree lacks.
#[derive(Debug, PartialEq, Eq)]
pub struct Stale {
    pub line: usize,
    pub name: String,
    pub why: &'static str,
}

/// Runs the check over the workspace at `root`.
pub fn run(root: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(root.join("docs/internals.md"))
        .map_err(|e| format!("reading docs/internals.md: {e}"))?;
    let stale = check(root, &text);
    let lacks = crate::attribute_places::missing(root);
    if stale.is_empty() && lacks.is_empty() {
        println!("internals-check: every file and item docs/internals.md names exists, and every pool attribute has its places");
        return Ok(());
    }
    let mut message = String::new();
    if !stale.is_empty() {
        message.push_str("docs/internals.md names what the tree lacks; correct the map:\n");
        for entry in &stale {
            message.push_str(&format!("  line {}: `{}`: {}\n", entry.line, entry.name, entry.why));
        }
    }
    if !lacks.is_empty() {
        message.push_str("rows of the pool-attribute table (crates/cumempool/src/bare_pools/attributes.rs) lack:\n");
        for lack in &lacks {
            message.push_str(&format!("  {lack}\n"));
        }
    }
    Err(message)
}

/// What the map at `text` names that the tree at `root` lacks.
pub fn check(root: &Path, text: &str) -> Vec<Stale> {
    let mut stale = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if !line.starts_with('|') || line.starts_with("|---") {
            continue;
        }
        let Some(cell) = line.trim().trim_end_matches('|').rsplit('|').next() else {
            continue;
        };
        let mut current: Option<PathBuf> = None;
        for name in backticked(cell) {
            if is_path(name) {
                match resolve(root, name, current.as_deref()) {
                    Some(found) => current = Some(found),
                    None => {
                        stale.push(Stale { line: index + 1, name: name.to_owned(), why: "no such file or folder" });
                        current = None;
                    }
                }
            } else if let (Some(file), Some(word)) = (current.as_deref(), item_word(name)) {
                let Ok(source) = std::fs::read_to_string(file) else {
                    continue; // a folder or a pattern: items are not looked for there
                };
                if !contains_word(&source, word) {
                    stale.push(Stale {
                        line: index + 1,
                        name: name.to_owned(),
                        why: "not in the file named before it",
                    });
                }
            }
        }
    }
    stale
}

fn backticked(cell: &str) -> impl Iterator<Item = &str> {
    cell.split('`').skip(1).step_by(2)
}

fn is_path(name: &str) -> bool {
    const ENDINGS: [&str; 8] = [".rs", ".py", ".pyi", ".md", ".sh", ".c", ".toml", "/"];
    !name.contains(' ') && ENDINGS.iter().any(|ending| name.ends_with(ending))
}

/// `name` found from the root, or from a folder of `previous` (the nearest first).
fn resolve(root: &Path, name: &str, previous: Option<&Path>) -> Option<PathBuf> {
    let mut bases = vec![root.to_path_buf()];
    if let Some(previous) = previous {
        bases.extend(previous.ancestors().skip(1).take_while(|a| a.starts_with(root)).map(Path::to_path_buf));
    }
    bases.iter().find_map(|base| matching(base, name))
}

/// `base/name`, where `<...>` or `*` in a segment matches any name.
fn matching(base: &Path, name: &str) -> Option<PathBuf> {
    let mut found = base.to_path_buf();
    for segment in name.trim_end_matches('/').split('/') {
        if segment.contains('<') || segment.contains('*') {
            let (prefix, suffix) = pattern_parts(segment);
            let entry = std::fs::read_dir(&found).ok()?.flatten().find(|e| {
                let file = e.file_name().to_string_lossy().into_owned();
                file.starts_with(prefix) && file.ends_with(suffix) && file.len() >= prefix.len() + suffix.len()
            })?;
            found = entry.path();
        } else {
            found.push(segment);
        }
    }
    found.exists().then_some(found)
}

/// What a patterned segment keeps before and after its wildcard (`cuda_<version>.rs`).
fn pattern_parts(segment: &str) -> (&str, &str) {
    let start = segment.find(['<', '*']).unwrap_or(segment.len());
    let end = segment.rfind(['>', '*']).map_or(segment.len(), |at| at + 1);
    (&segment[..start], &segment[end..])
}

/// The word an item must appear as: its last path segment, without call parentheses or a
/// macro's `!`; `None` for what is no item (prose, a value, a command).
fn item_word(name: &str) -> Option<&str> {
    let bare = name.trim_end_matches("()").trim_end_matches('!');
    let word = bare.rsplit([':', '.']).next()?;
    let is_word = !word.is_empty()
        && word.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let is_path = bare.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '.');
    (is_word && is_path).then_some(word)
}

fn contains_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        let boundary = |c: Option<char>| c.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        boundary(before) && boundary(after)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_and_a_missing_item_are_found() {
        let root = crate::workspace::root();
        let map = "| concept | file |\n|---|---|\n\
                   | a | `crates/cumempool/src/nowhere.rs` |\n\
                   | b | `crates/cumempool/src/streams/stream.rs` (`Stream::no_such_method`, `Stream::legacy_for_per_thread`) |\n\
                   | c | `crates/cumempool-alloc/src/caching/lanes.rs`, `caching/table.rs`, `crates/cumempool-sys/src/generated/cuda_<version>.rs` |\n";
        let stale = check(&root, map);
        let names: Vec<&str> = stale.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["crates/cumempool/src/nowhere.rs", "Stream::no_such_method"]);
    }

    #[test]
    fn the_map_names_only_what_exists() {
        let root = crate::workspace::root();
        if let Err(message) = run(&root) {
            panic!("{message}");
        }
    }
}
