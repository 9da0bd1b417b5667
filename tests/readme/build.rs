//! Turns every Rust code block of the repository's Markdown (the README, each crate's README and
//! docs/*.md) into a test of `tests/doc_blocks.rs`, so the examples a reader copies are compiled
//! by `cargo test` and run by the GPU suite (`cargo xtask gpu-pack` packs the test binary; the
//! tests are ignored without a GPU like every GPU test).
//!
//! A block is written as rustdoc writes doctests: lines starting with `# ` are hidden from the
//! reader but compiled, and the block ends with `Ok::<(), ErrorType>(())`. The fence's attributes
//! choose how it runs: `ignore` (never compiled here), `two_gpus` (skipped on a machine with one).

// A build script reports a malformed page by failing the build, with the page and line.
#![allow(clippy::expect_used, clippy::panic)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo")).join("../..");
    let mut pages = vec![root.join("README.md")];
    for folder in ["crates", "docs"] {
        let Ok(entries) = std::fs::read_dir(root.join(folder)) else { continue };
        let mut found: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        found.sort();
        for path in found {
            let page = if path.is_dir() { path.join("README.md") } else { path };
            if page.extension().is_some_and(|e| e == "md") && page.is_file() {
                pages.push(page);
            }
        }
    }
    let mut out = String::new();
    for page in &pages {
        println!("cargo:rerun-if-changed={}", page.display());
        let text = std::fs::read_to_string(page).expect("a readable Markdown page");
        let name = page.strip_prefix(&root).unwrap_or(page);
        for block in rust_blocks(&text) {
            write_test(&mut out, name, &block);
        }
    }
    let dest = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo")).join("doc_blocks.rs");
    std::fs::write(dest, out).expect("OUT_DIR is writable");
}

struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    two_gpus: bool,
    code: Vec<String>,
}

fn rust_blocks(text: &str) -> Vec<Block> {
    /// Where the scan stands: outside any block, in a Rust block, or in another language's.
    enum Inside {
        Text,
        Rust(Block),
        Other,
    }
    let mut blocks = Vec::new();
    let mut inside = Inside::Text;
    for (index, line) in text.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        inside = match (inside, fence) {
            (Inside::Text, Some(info)) => {
                let attributes: Vec<&str> = info.split(',').map(str::trim).collect();
                if attributes.first() == Some(&"rust") && !attributes.contains(&"ignore") {
                    Inside::Rust(Block {
                        line: index + 1,
                        two_gpus: attributes.contains(&"two_gpus"),
                        code: Vec::new(),
                    })
                } else {
                    Inside::Other
                }
            }
            (Inside::Rust(block), Some(_)) => {
                blocks.push(block);
                Inside::Text
            }
            (Inside::Rust(mut block), None) => {
                block.code.push(unhide(line).to_owned());
                Inside::Rust(block)
            }
            (Inside::Other, Some(_)) => Inside::Text,
            (state, _) => state,
        };
    }
    blocks
}

/// A rustdoc hidden line (`# code` or a lone `#`) shown to the compiler.
fn unhide(line: &str) -> &str {
    let trimmed = line.trim_start();
    if trimmed == "#" {
        ""
    } else if let Some(rest) = trimmed.strip_prefix("# ") {
        rest
    } else {
        line
    }
}

fn write_test(out: &mut String, page: &Path, block: &Block) {
    let page_name: String = page
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
        .collect();
    let test = format!("{page_name}_line_{}", block.line);
    let last = block.code.iter().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim()).unwrap_or_default();
    let error_type = last.strip_prefix("Ok::<(), ").and_then(|rest| rest.strip_suffix(">(())")).unwrap_or_else(|| {
        panic!("{}:{}: a Rust block must end with Ok::<(), ErrorType>(())", page.display(), block.line)
    });
    // The block's `use` declarations go to the module, where the signature can see them.
    let (uses, body): (Vec<&String>, Vec<&String>) =
        block.code.iter().partition(|l| l.trim_start().starts_with("use "));
    let _ = writeln!(out, "/// {}, the block at line {}.", page.display(), block.line);
    let _ = writeln!(out, "#[allow(unused, clippy::all)]\nmod {test} {{");
    for line in uses {
        let _ = writeln!(out, "    {line}");
    }
    let _ = writeln!(out, "    pub(super) fn body() -> Result<(), {error_type}> {{");
    for line in body {
        let _ = writeln!(out, "        {line}");
    }
    let _ = writeln!(out, "    }}\n}}\n");
    let _ = writeln!(out, "#[test]\n#[ignore = \"runs a documentation example: requires a CUDA GPU\"]");
    let _ = writeln!(
        out,
        "fn {test}_runs() {{ run_in_own_process(\"{test}_runs\", {}, || {test}::body().map_err(|e| e.to_string())) }}\n",
        block.two_gpus
    );
}
