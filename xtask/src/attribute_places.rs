//! The pool-attribute table (`crates/cumempool/src/bare_pools/attributes.rs`, one row per
//! attribute) is the one source: this check fails when a row lacks any of the places that follow
//! from it, so adding an attribute is one row plus what the check names.
//!
//! The places, for a row `MaxPoolSize = CU_MEMPOOL_ATTR_MAX_POOL_SIZE, ..., ReadOnly`:
//! - the typed accessor of `Pool` (`crates/cumempool/src/pool.rs`: `pub fn max_pool_size(&self)`);
//! - the Python property (`crates/cumempool-py/src/pools.rs`: `fn max_pool_size(`), with its
//!   setter for a read-write attribute (`fn set_...(`) and its reset for a high-water mark
//!   (`fn reset_...(`);
//! - the stub line of `MemPool` (`_native.pyi`);
//! - the attribute's name in the `MemPool` bullet of `docs/python.md`.
//!
//! Names follow the row's variant in snake case; the few that read better otherwise are in
//! [`RUST_NAMES`] and [`PYTHON_NAMES`].

use std::path::Path;

/// Variants whose `Pool` accessor is named otherwise (the plain name is taken by what the
/// pool's creation recorded).
const RUST_NAMES: &[(&str, &str)] = &[
    ("AllocationType", "allocation_type_attribute"),
    ("LocationId", "location_attribute"),
    ("LocationType", "location_attribute"),
];

/// Variants Python shows as one property (a location is its id and type together).
const PYTHON_NAMES: &[(&str, &str)] = &[("LocationId", "location"), ("LocationType", "location")];

/// One row of the table: its variant and access.
struct Row {
    variant: String,
    access: String,
}

fn rows(source: &str) -> Vec<Row> {
    source
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let (variant, rest) = line.split_once(" = CU_MEMPOOL_ATTR_")?;
            let access = rest.trim_end_matches(',').rsplit(',').next()?.trim().to_owned();
            Some(Row { variant: variant.trim().to_owned(), access })
        })
        .collect()
}

fn snake(variant: &str) -> String {
    let mut out = String::new();
    for (index, c) in variant.chars().enumerate() {
        if c.is_ascii_uppercase() && index > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

fn named(table: &[(&str, &str)], variant: &str) -> String {
    table.iter().find(|(v, _)| *v == variant).map_or_else(|| snake(variant), |(_, name)| (*name).to_owned())
}

/// The `MemPool` bullet of python.md with its shorthands spelled out (`used_mem_current/high`,
/// `reuse_*`).
fn documented(python_md: &str) -> String {
    let start = python_md.find("- `MemPool(").unwrap_or(0);
    let bullet = &python_md[start..];
    let end = bullet[2..].find("\n- ").map_or(bullet.len(), |at| at + 2);
    bullet[..end].replace("_current/high", "_current`, `_high").replace("/high`", "`, `_high`")
}

/// What the tree at `root` lacks, one line each.
pub fn missing(root: &Path) -> Vec<String> {
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap_or_default();
    let table = read("crates/cumempool/src/bare_pools/attributes.rs");
    let pool = read("crates/cumempool/src/pool.rs");
    let python = read("crates/cumempool-py/src/pools.rs");
    let stub = read("crates/cumempool-py/python/cumempool/_native.pyi");
    let stub = stub.split("class MemPool").nth(1).and_then(|rest| rest.split("\nclass ").next()).unwrap_or("");
    let docs = documented(&read("docs/python.md"));
    let mut lacks = Vec::new();
    for row in rows(&table) {
        let (rust, py) = (named(RUST_NAMES, &row.variant), named(PYTHON_NAMES, &row.variant));
        let mut need = |place: bool, what: String| {
            if !place {
                lacks.push(format!("{}: {what}", row.variant));
            }
        };
        need(
            pool.contains(&format!("pub fn {rust}(&self)")),
            format!("`Pool::{rust}` in crates/cumempool/src/pool.rs"),
        );
        need(python.contains(&format!("fn {py}(")), format!("the property `{py}` in crates/cumempool-py/src/pools.rs"));
        if row.access == "ReadWrite" {
            need(python.contains(&format!("fn set_{py}(")), format!("its setter `set_{py}` in pools.rs"));
        }
        if row.access == "ReadReset" {
            need(python.contains(&format!("fn reset_{py}(")), format!("its reset `reset_{py}` in pools.rs"));
        }
        need(
            stub.contains(&format!("def {py}(self)")) || stub.contains(&format!("{py}: ")),
            format!("`{py}` in MemPool's stub (_native.pyi)"),
        );
        let shorthand = py.split('_').next().is_some_and(|head| docs.contains(&format!("`{head}_*`")));
        let high = py.strip_suffix("_high").is_some_and(|_| docs.contains("`_high`"));
        need(
            docs.contains(&format!("`{py}`")) || shorthand || high,
            format!("`{py}` in docs/python.md's MemPool bullet"),
        );
    }
    lacks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pool_attribute_has_its_places() {
        let root = crate::workspace::root();
        let lacks = missing(&root);
        assert!(lacks.is_empty(), "the pool-attribute table's rows lack:\n{}", lacks.join("\n"));
    }

    #[test]
    fn a_row_without_its_places_is_found() {
        let root = crate::workspace::root();
        let table =
            std::fs::read_to_string(root.join("crates/cumempool/src/bare_pools/attributes.rs")).unwrap_or_default();
        let added = "    BrandNewThing = CU_MEMPOOL_ATTR_BRAND_NEW_THING, since CUDA_13_5, Bytes, ReadWrite,";
        assert_eq!(
            rows(&format!("{table}\n{added}\n")).last().map(|r| (r.variant.as_str(), r.access.as_str())),
            Some(("BrandNewThing", "ReadWrite"))
        );
        let dir = std::env::temp_dir().join(format!("attribute-places-{}", std::process::id()));
        for path in [
            "crates/cumempool/src/pool.rs",
            "crates/cumempool-py/src/pools.rs",
            "crates/cumempool-py/python/cumempool/_native.pyi",
            "docs/python.md",
        ] {
            let target = dir.join(path);
            std::fs::create_dir_all(target.parent().unwrap_or(&dir)).ok();
            std::fs::copy(root.join(path), &target).ok();
        }
        let table_copy = dir.join("crates/cumempool/src/bare_pools/attributes.rs");
        std::fs::create_dir_all(table_copy.parent().unwrap_or(&dir)).ok();
        std::fs::write(&table_copy, format!("{table}\n{added}\n")).ok();
        let lacks = missing(&dir);
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(lacks.len(), 5, "accessor, property, setter, stub and docs: {lacks:#?}");
        assert!(lacks.iter().all(|l| l.starts_with("BrandNewThing: ")));
    }
}
