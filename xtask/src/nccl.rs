//! `cargo xtask bindgen --nccl`: nccl.h -> `crates/cumempool-nccl/src/generated/nccl_<code>.rs`.
//!
//! nccl.h comes from the pinned `nvidia-nccl-cu13` wheel (216 MB, fetched into target/ once and
//! never committed). It includes the CUDA runtime's headers only for `cudaStream_t` and the
//! half-precision types, which the declarations covered here do not use beyond the stream: a
//! three-line stand-in for each is written beside it instead of needing a CUDA toolkit.
//!
//! NCCL has no `cuGetProcAddress`: the loader resolves each function by symbol name. nccl.h does
//! not say which release added a function, so [`FUNCTIONS`] does, from NCCL's release notes; the
//! loader refuses a function the loaded library is too old for, naming both versions.

use crate::headers::sha256_hex;
use quote::{format_ident, quote};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The pinned NCCL release.
const VERSION: &str = "2.30.7";
const WHEEL_REQUIREMENT: &str = "nvidia-nccl-cu13==2.30.7";
const WHEEL_SHA256: &str = "cefa7fdb9710efd0f39c5f1be1d61ff6fc9a996c451265bd7fbdcf9455ed4b50";
const NCCL_H_SHA256: &str = "1447f19c849c9a9f0f7ff2fd1ad2631e84a7ac2fb65cbe52102324c28a591997";
const WHEEL_HEADER: &str = "nvidia/nccl/include/nccl.h";
/// `NCCL_VERSION_CODE` of the pinned header, which names the generated file.
const VERSION_CODE: u32 = 23007;

/// The functions covered, each with the first NCCL release that has it (as `NCCL_VERSION_CODE`).
const FUNCTIONS: &[(&str, u32)] = &[
    ("ncclGetVersion", 2000),
    ("ncclGetErrorString", 2000),
    ("ncclGetUniqueId", 2000),
    ("ncclCommInitRank", 2000),
    ("ncclCommInitAll", 2000),
    ("ncclCommDestroy", 2000),
    ("ncclCommCount", 2000),
    ("ncclCommCuDevice", 2000),
    ("ncclCommUserRank", 2000),
    ("ncclAllReduce", 2000),
    ("ncclAllGather", 2000),
    ("ncclReduceScatter", 2000),
    ("ncclBroadcast", 2200),
    ("ncclGroupStart", 2000),
    ("ncclGroupEnd", 2000),
    ("ncclCommAbort", 2400),
    ("ncclCommGetAsyncError", 2400),
    ("ncclSend", 2700),
    ("ncclRecv", 2700),
    ("ncclGetLastError", 21304),
    ("ncclCommFinalize", 21403),
    ("ncclMemAlloc", 21903),
    ("ncclMemFree", 21903),
    ("ncclCommRegister", 21903),
    ("ncclCommDeregister", 21903),
    ("ncclCommWindowRegister", 22700),
    ("ncclCommWindowDeregister", 22700),
];

const TYPES: &[&str] = &["ncclResult_t", "ncclRedOp_t", "ncclDataType_t", "ncclUniqueId", "ncclComm_t", "ncclWindow_t"];
const VARS: &[&str] = &["NCCL_VERSION_CODE", "NCCL_UNIQUE_ID_BYTES", "NCCL_WIN_.*"];

const STUBS: &[(&str, &str)] = &[
    ("cuda_runtime.h", "#include <stddef.h>\n#include <stdint.h>\n#include <limits.h>\ntypedef struct CUstream_st *cudaStream_t;\n#define CUDART_VERSION 13000\n"),
    ("cuda_fp16.h", ""),
    ("cuda_bf16.h", ""),
];

/// Fetches the pinned wheel into `target/nccl-headers/<version>/` (once), checks both checksums
/// and returns the path of nccl.h with the stand-in headers beside it.
fn pinned_header(root: &Path) -> Result<PathBuf, String> {
    let cache = root.join("target").join("nccl-headers").join(VERSION);
    let nccl_h = cache.join("nccl.h");
    std::fs::create_dir_all(&cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    for (name, text) in STUBS {
        std::fs::write(cache.join(name), text).map_err(|e| format!("writing the stand-in {name}: {e}"))?;
    }
    if std::fs::read(&nccl_h).is_ok_and(|b| sha256_hex(&b) == NCCL_H_SHA256) {
        return Ok(nccl_h);
    }
    eprintln!("the pinned NCCL wheel is 216 MB; it is fetched once");
    // The wheel is tagged manylinux_2_18: name that platform, whatever this machine is.
    let wheel = crate::headers::download_wheel(&cache, WHEEL_REQUIREMENT, "manylinux_2_18_x86_64")?;
    let bytes = std::fs::read(&wheel).map_err(|e| format!("reading {}: {e}", wheel.display()))?;
    let found = sha256_hex(&bytes);
    if found != WHEEL_SHA256 {
        return Err(format!("{} has sha256 {found}, expected {WHEEL_SHA256}: not the pinned wheel", wheel.display()));
    }
    let mut archive =
        zip::ZipArchive::new(std::io::Cursor::new(bytes)).map_err(|e| format!("opening {}: {e}", wheel.display()))?;
    let mut entry = archive.by_name(WHEEL_HEADER).map_err(|e| format!("{WHEEL_HEADER} in {}: {e}", wheel.display()))?;
    let mut content = Vec::new();
    entry.read_to_end(&mut content).map_err(|e| format!("extracting {WHEEL_HEADER}: {e}"))?;
    if sha256_hex(&content) != NCCL_H_SHA256 {
        return Err(format!("{WHEEL_HEADER} does not have the pinned sha256 {NCCL_H_SHA256}"));
    }
    std::fs::write(&nccl_h, content).map_err(|e| format!("writing {}: {e}", nccl_h.display()))?;
    Ok(nccl_h)
}

/// Regenerates the NCCL bindings, or with `check` compares them with the committed file.
pub fn run(check: bool) -> Result<(), String> {
    let libclang = crate::libclang::load()?;
    eprintln!("libclang: {}", libclang.display());
    let root = crate::workspace::root();
    let nccl_h = pinned_header(&root)?;
    let generated = generate(&root, &nccl_h)?;
    let relative = format!("crates/cumempool-nccl/src/generated/nccl_{VERSION_CODE}.rs");
    let path = root.join(&relative);
    if check {
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != generated {
            return Err(format!(
                "{relative} differs from what the pinned nccl.h generates: run `cargo xtask bindgen --nccl` and commit the result"
            ));
        }
        eprintln!("{relative} is up to date");
        return Ok(());
    }
    std::fs::write(&path, &generated).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("wrote {relative} ({} lines)", generated.lines().count());
    Ok(())
}

/// The list of functions as a macro that calls back with it: the loader builds its table from
/// it, so these declarations depend on nothing hand-written. `bindings::EntryPoints` and
/// `bindings::ENTRY_POINTS` are public paths through `bindings.rs`, which re-exports these
/// declarations and the loader's table.
const LIST_MACRO_HEAD: &str = concat!(
    "/// Calls `$callback! { name: $crate::bindings::PFN_name = since, ... }` with every function\n",
    "/// these bindings declare and the NCCL release that added it.\n",
    "macro_rules! for_each_entry_point {\n",
    "    ($callback:ident) => {\n",
    "        $callback! {\n",
);
const LIST_MACRO_TAIL: &str = concat!("        }\n", "    };\n", "}\n", "pub(crate) use for_each_entry_point;\n",);

fn generate(root: &Path, nccl_h: &Path) -> Result<String, String> {
    let names: Vec<&str> = FUNCTIONS.iter().map(|(name, _)| *name).collect();
    let include = nccl_h.parent().ok_or("nccl.h has no folder")?;
    let bindings = bindgen::Builder::default()
        .header(nccl_h.to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function(format!("^({})$", names.join("|")))
        .allowlist_type(format!("^({})$", TYPES.join("|")))
        .allowlist_var(format!("^({})$", VARS.join("|")));
    let bindings = crate::bindgen::common_options(bindings)
        .generate()
        .map_err(|e| format!("bindgen failed on {}: {e}", nccl_h.display()))?;
    let file = syn::parse_file(&bindings.to_string()).map_err(|e| format!("parsing bindgen's output: {e}"))?;
    let mut items = Vec::new();
    let mut declared = std::collections::BTreeMap::new();
    for item in file.items {
        let syn::Item::ForeignMod(block) = item else {
            items.push(item);
            continue;
        };
        for foreign in block.items {
            let syn::ForeignItem::Fn(function) = foreign else {
                return Err("bindgen emitted a foreign item that is not a function".into());
            };
            declared.insert(function.sig.ident.to_string(), function);
        }
    }
    let mut table = String::new();
    for (name, since) in FUNCTIONS {
        let function = declared.get(*name).ok_or_else(|| format!("nccl.h does not declare {name}"))?;
        let inputs = &function.sig.inputs;
        let output = &function.sig.output;
        let alias = format_ident!("PFN_{}", name);
        let doc = format!(" `{name}`, in NCCL {} and later.", version_label(*since));
        items.push(syn::parse_quote! {
            #[doc = #doc]
            pub type #alias = unsafe extern "C" fn(#inputs) #output;
        });
        table.push_str(&format!("            {name}: $crate::bindings::PFN_{name} = {since},\n"));
    }
    let body = quote! { #(#items)* }.to_string();
    let text = format!(
        "//! Generated by `cargo xtask bindgen --nccl`. Do not edit by hand.\n//!\n//! Source: nccl.h of NCCL {VERSION} from the PyPI wheel {WHEEL_REQUIREMENT} (nccl.h sha256 {NCCL_H_SHA256}); bindgen 0.72.1.\n\n{body}\n\n{LIST_MACRO_HEAD}{table}{LIST_MACRO_TAIL}"
    );
    crate::bindgen::rustfmt(root, &text)
}

/// `22809` -> `2.28.9`; codes before 2.9 (`2400`) are `X*1000 + Y*100 + Z`.
fn version_label(code: u32) -> String {
    if code < 10000 {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_read_as_releases() {
        assert_eq!(version_label(22809), "2.28.9");
        assert_eq!(version_label(2400), "2.4.0");
        assert_eq!(version_label(VERSION_CODE), VERSION);
    }
}
