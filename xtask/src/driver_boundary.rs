//! `cargo xtask driver-boundary`: the Python package reaches the CUDA driver only through the
//! core crate, whose operations carry the checks (captures, lifetimes, contexts). A second
//! implementation of a driver call in the Python crate is how its capture refusals were lost
//! twice, so the check fails on any driver entry point the Python crate's code names outside
//! [`ALLOWED`].
//!
//! What counts, in code (comments and string literals are skipped, so messages and docs may
//! still name the driver's functions):
//! - Rust: a call of a name of the driver's form (`cuMemcpyAsync(..)`, `d.cuMemcpyAsync()`), or
//!   the loader itself (`sys::driver`, `cumempool_sys`);
//! - Python: a call of a name of the driver's form (`driver.cuMemGetInfo()`), or an import of
//!   NVIDIA's driver bindings (`cuda.bindings`, `cuda.cuda`).

use std::path::{Path, PathBuf};

/// Files of the Python crate allowed to name driver entry points, relative to the crate: none.
/// Every operation on memory and streams is the core crate's (`cumempool::Block`, `Stream`,
/// `Context`); add a file here only for a call the core cannot offer, and say why beside it.
pub const ALLOWED: &[&str] = &[];

/// The Python crate, relative to the workspace root.
const PYTHON_CRATE: &str = "crates/cumempool-py";

/// One place that names the driver.
#[derive(Debug, PartialEq, Eq)]
pub struct Finding {
    pub file: PathBuf,
    pub line: usize,
    pub text: String,
}

/// Runs the check over the workspace at `root`.
pub fn run(root: &Path) -> Result<(), String> {
    let findings = scan(&root.join(PYTHON_CRATE))?;
    if findings.is_empty() {
        println!("driver-boundary: the Python crate names no driver entry point");
        return Ok(());
    }
    let mut message = String::from(
        "the Python crate calls the CUDA driver itself; call the core crate's operation instead (cumempool::Block for fills, copies and orderings, Stream, Context), or add the operation to the core with its checks:\n",
    );
    for finding in &findings {
        message.push_str(&format!("  {}:{}: {}\n", finding.file.display(), finding.line, finding.text.trim()));
    }
    Err(message)
}

/// Every place under `krate` (its `src` and `python` folders) that names a driver entry point,
/// outside [`ALLOWED`].
pub fn scan(krate: &Path) -> Result<Vec<Finding>, String> {
    let mut files = Vec::new();
    for folder in ["src", "python"] {
        collect(&krate.join(folder), &mut files)?;
    }
    files.sort();
    let mut findings = Vec::new();
    for file in files {
        let relative = file.strip_prefix(krate).unwrap_or(&file);
        if ALLOWED.iter().any(|allowed| Path::new(allowed) == relative) {
            continue;
        }
        let text = std::fs::read_to_string(&file).map_err(|e| format!("reading {}: {e}", file.display()))?;
        let rust = file.extension().is_some_and(|e| e == "rs");
        for (line, code) in code_lines(&text, rust).into_iter().enumerate() {
            if names_driver(&code, rust) {
                findings.push(Finding { file: relative.to_path_buf(), line: line + 1, text: code });
            }
        }
    }
    Ok(findings)
}

fn collect(folder: &Path, files: &mut Vec<PathBuf>) -> Result<(), String> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "rs" || e == "py" || e == "pyi") {
            files.push(path);
        }
    }
    Ok(())
}

/// The file's lines with comments and string literals blanked out (a string becomes `""`), so a
/// line number still points at the source. Rust: `//` and `/* */` comments, `"..."` and raw
/// strings; Python: `#` comments and every quote form, triple quotes included.
pub fn code_lines(text: &str, rust: bool) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let line_comment = if rust { c == '/' && next == Some('/') } else { c == '#' };
        if line_comment {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if rust && c == '/' && next == Some('*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                if chars[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
            continue;
        }
        if rust && c == '\'' {
            // A char literal ('"', '\''), not a lifetime ('a): skipped whole.
            let end = if next == Some('\\') { i + 3 } else { i + 2 };
            if chars.get(end) == Some(&'\'') {
                out.push_str("' '");
                i = end + 1;
                continue;
            }
        }
        if rust && c == 'r' && (next == Some('"') || next == Some('#')) && !is_ident(chars.get(i.wrapping_sub(1))) {
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            if chars.get(i + 1 + hashes) == Some(&'"') {
                i += 2 + hashes;
                let closing: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
                while i < chars.len() && !chars[i..].iter().collect::<String>().starts_with(&closing) {
                    if chars[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                i += closing.chars().count();
                out.push_str("\"\"");
                continue;
            }
        }
        let quote = c == '"' || (!rust && c == '\'');
        if quote {
            let triple = !rust && next == Some(c) && chars.get(i + 2) == Some(&c);
            let width = if triple { 3 } else { 1 };
            i += width;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '\\' {
                    i += 2;
                    continue;
                }
                if chars[i] == c && (!triple || (chars.get(i + 1) == Some(&c) && chars.get(i + 2) == Some(&c))) {
                    i += width;
                    break;
                }
                if chars[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            out.push_str("\"\"");
            continue;
        }
        out.push(c);
        i += 1;
    }
    out.split('\n').map(str::to_owned).collect()
}

fn is_ident(c: Option<&char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || *c == '_')
}

/// Whether a line of code (comments and strings blanked) names the driver.
pub fn names_driver(code: &str, rust: bool) -> bool {
    if rust && (code.contains("sys::driver") || code.contains("cumempool_sys")) {
        return true;
    }
    if !rust
        && (code.contains("cuda.bindings")
            || code.contains("from cuda import cuda")
            || code.contains("import cuda.cuda"))
    {
        return true;
    }
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i + 2 < chars.len() {
        let starts_name = chars[i] == 'c' && chars[i + 1] == 'u' && chars[i + 2].is_ascii_uppercase();
        if starts_name && !is_ident(i.checked_sub(1).and_then(|p| chars.get(p))) {
            let mut end = i + 2;
            while is_ident(chars.get(end)) {
                end += 1;
            }
            let rest: String = chars[end..].iter().collect();
            if rest.trim_start().starts_with('(') {
                return true;
            }
            i = end;
            continue;
        }
        i += 1;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finds(source: &str, rust: bool) -> bool {
        code_lines(source, rust).iter().any(|line| names_driver(line, rust))
    }

    #[test]
    fn a_driver_call_in_rust_is_found() {
        assert!(finds("let copy = sys::driver().and_then(|d| d.cuMemcpyAsync())?;", true));
        assert!(finds("unsafe { memset(ptr, 0, len, s) }; let f = d.cuMemsetD8Async ();", true));
        assert!(finds("use cumempool_sys as raw;", true));
    }

    #[test]
    fn a_driver_call_in_python_is_found() {
        assert!(finds("free, total = driver.cuMemGetInfo()", false));
        assert!(finds("from cuda.bindings import driver", false));
    }

    #[test]
    fn names_in_comments_strings_and_other_identifiers_are_not_calls() {
        assert!(!finds("// calls cuMemcpyAsync() on the stream", true));
        assert!(!finds("let what = \"cuMemAllocFromPoolAsync(pool)\";", true));
        assert!(!finds("let what = r#\"cuMemFreeAsync(p)\"#;", true));
        assert!(!finds("/* cuStreamSynchronize(s) */ let x = 1;", true));
        assert!(!finds("let c = '\"'; let y = 2;", true));
        assert!(!finds("fn my_cuThing() {} let accuDevice = 1;", true));
        assert!(!finds("# driver.cuMemGetInfo()\n\"\"\"cuMemGetInfo()\"\"\"", false));
        assert!(!finds("x = 'cuMemGetInfo()'", false));
    }

    #[test]
    fn line_numbers_survive_blanked_multiline_strings() {
        let lines = code_lines("a = \"\"\"one\ntwo\"\"\"\nb = driver.cuInit(0)\n", false);
        assert!(names_driver(&lines[2], false));
    }

    #[test]
    fn the_python_crate_names_no_driver_entry_point() {
        let root = crate::workspace::root();
        let findings = scan(&root.join(PYTHON_CRATE)).expect("the Python crate can be read");
        assert!(findings.is_empty(), "{}", run(&root).unwrap_err());
    }
}
