//! `cargo xtask bindgen`: cuda.h -> `crates/cumempool-sys/src/generated/cuda_<version>.rs`.
//!
//! bindgen emits the types and the `extern` declarations of the functions we cover; this module
//! reshapes each declaration into a function-pointer type named after the function's base name
//! (`PFN_cuMemcpyHtoDAsync`, not `_v2`), since the loader resolves every entry point through
//! `cuGetProcAddress` instead of linking. Each entry point is listed with the CUDA version that
//! introduced the ABI its declaration has, read from the same release's cudaTypedefs.h, so the
//! loader can refuse it by name on an older driver instead of handing out a mismatched ABI.

use crate::headers::{self, Headers};
use quote::{format_ident, quote};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct Options {
    cuda: Option<String>,
    header: Option<PathBuf>,
    check: bool,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let mut options = Options { cuda: None, header: None, check: false };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--check" => options.check = true,
                "--cuda" => {
                    options.cuda = Some(args.next().ok_or("--cuda needs a pinned version, such as 13.4")?.clone())
                }
                "--header" => options.header = Some(args.next().ok_or("--header needs a path to cuda.h")?.into()),
                other => return Err(format!("unknown argument `{other}` (see `cargo xtask help`)")),
            }
        }
        if let Some(cuda) = &options.cuda {
            if !headers::PINNED.iter().any(|p| p.label == cuda) {
                let known: Vec<_> = headers::PINNED.iter().map(|p| p.label).collect();
                return Err(format!("--cuda {cuda} is not pinned; pinned versions: {}", known.join(", ")));
            }
        }
        Ok(options)
    }
}

/// The functions the bindings cover, by base name (the name `cuGetProcAddress` takes).
const FUNCTIONS: &[&str] = &[
    // initialisation, versions, errors, entry points
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuGetProcAddress",
    // devices
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceGetUuid",
    "cuDeviceTotalMem",
    "cuDeviceCanAccessPeer",
    // the primary context
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent",
    "cuCtxPopCurrent",
    "cuCtxSynchronize",
    "cuCtxGetDevice",
    // streams and events
    "cuStreamCreate",
    "cuStreamDestroy",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy",
    "cuEventElapsedTime",
    // memory outside pools: copies, sets, pointer queries, managed memory
    "cuMemAlloc",
    "cuMemFree",
    "cuMemGetInfo",
    "cuMemcpyAsync",
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuMemPrefetchAsync",
    "cuMemAdvise",
    // stream-ordered allocation and memory pools
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
    "cuDeviceGetDefaultMemPool",
    "cuDeviceGetMemPool",
    "cuDeviceSetMemPool",
    "cuMemGetDefaultMemPool",
    "cuMemGetMemPool",
    "cuMemSetMemPool",
    // stream capture and graphs: capture-aware operations, the graph API, graph memory
    "cuStreamBeginCapture",
    "cuStreamEndCapture",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo",
    "cuThreadExchangeStreamCaptureMode",
    "cuGraphCreate",
    "cuGraphDestroy",
    "cuGraphGetNodes",
    "cuGraphInstantiateWithFlags",
    "cuGraphExecDestroy",
    "cuGraphLaunch",
    "cuGraphUpload",
    "cuDeviceGetGraphMemAttribute",
    "cuDeviceSetGraphMemAttribute",
    "cuDeviceGraphMemTrim",
    // the virtual memory management API: arenas that NCCL can register
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetAccess",
    "cuMemGetAllocationGranularity",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle",
];

/// Functions younger than the oldest pinned header, each with the CUDA release whose cuda.h first
/// declares it: required from that release on, absent (so not generated) before it.
const FUNCTIONS_SINCE: &[(&str, u32)] = &[
    // where the pages of a managed or pageable range reside, per region
    ("cuMemGetLocationInfo", 13040),
];

/// Types a safe layer needs beyond those the functions pull in.
const TYPES: &[&str] = &[
    "CUdevice_attribute",
    "CUpointer_attribute",
    "CUmemPool_attribute",
    "CUmemLocationType",
    "CUmemAllocationType",
    "CUmemAllocationHandleType",
    "CUmemAccess_flags",
    "CUmemPoolProps",
    "CUmemPoolPtrExportData",
    "CUmemAccessDesc",
    "CUmemFabricHandle",
    "CUstream_flags",
    "CUevent_flags",
    "CUmem_advise",
    "CUdriverProcAddress_flags",
    "CUdriverProcAddressQueryResult",
    "CUresult",
    "CUmemorytype",
    "CUuuid",
    "CUstreamCaptureStatus",
    "CUstreamCaptureMode",
    "CUgraphInstantiate_flags",
    "CUgraphMem_attribute",
    "CUmemAllocationProp",
    "CUmemAllocationGranularity_flags",
    "CUmemAllocationCompType",
];

const VARS: &[&str] = &["CUDA_VERSION", "CU_MEM_POOL_CREATE_USAGE_HW_DECOMPRESS"];

/// Enums that grow between releases: each gets a `<typedef>_MEMBERS` list of every member, so
/// the safe layer can test that it maps (or deliberately leaves out) each one.
const GROWING_ENUMS: &[&str] =
    &["CUmemLocationType", "CUmemAllocationType", "CUmemPool_attribute", "CUmemAllocationHandleType"];

pub fn run(options: &Options) -> Result<(), String> {
    // Before any download: without libclang nothing can be generated.
    let libclang = crate::libclang::load()?;
    eprintln!("libclang: {}", libclang.display());
    let root = crate::workspace::root();
    let mut jobs: Vec<(Headers, u32)> = Vec::new();
    if let Some(header) = &options.header {
        jobs.push(headers::explicit(header)?);
    } else {
        for pin in headers::PINNED {
            if options.cuda.as_deref().is_some_and(|c| c != pin.label) {
                continue;
            }
            jobs.push((headers::pinned(&root, pin)?, pin.cuda_version));
        }
    }
    let mut stale = Vec::new();
    for (headers, version) in &jobs {
        let generated = generate(&root, headers, *version)?;
        let relative = format!("crates/cumempool-sys/src/generated/cuda_{version}.rs");
        let path = root.join(&relative);
        if options.check {
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            if committed != generated {
                stale.push(format!("{relative} ({})", first_difference(&committed, &generated)));
            } else {
                eprintln!("{relative} is up to date");
            }
        } else {
            std::fs::write(&path, &generated).map_err(|e| format!("writing {}: {e}", path.display()))?;
            eprintln!("wrote {relative} ({} lines)", generated.lines().count());
        }
    }
    if stale.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the committed bindings differ from what the pinned headers generate:\n  {}\nrun `cargo xtask bindgen` and commit the result",
            stale.join("\n  ")
        ))
    }
}

fn first_difference(committed: &str, generated: &str) -> String {
    if committed.is_empty() {
        return "missing".into();
    }
    let line = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
    match line {
        Some(n) => format!("first difference at line {}", n + 1),
        None => "lengths differ".into(),
    }
}

/// The options every generated file shares: newtype enums (a newer library may answer values
/// these headers do not know), `core` types, no comments (the headers' comments hold C snippets
/// rustdoc would run as doctests), layout tests, common derives, unformatted (rustfmt follows).
pub(crate) fn common_options(builder: bindgen::Builder) -> bindgen::Builder {
    builder
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .use_core()
        .ctypes_prefix("::core::ffi")
        .generate_comments(false)
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(true)
        .derive_eq(true)
        .derive_hash(true)
        .merge_extern_blocks(true)
        .formatter(bindgen::Formatter::None)
}

fn anchored(names: &[&str], suffix: &str) -> String {
    format!("^({}){suffix}$", names.join("|"))
}

fn generate(root: &Path, headers: &Headers, cuda_version: u32) -> Result<String, String> {
    let functions: Vec<&str> = FUNCTIONS.iter().copied().chain(FUNCTIONS_SINCE.iter().map(|(name, _)| *name)).collect();
    let bindings = bindgen::Builder::default()
        .header(headers.cuda_h.to_string_lossy())
        // The header maps base names to versioned symbols (`cuMemAlloc` -> `cuMemAlloc_v2`).
        .allowlist_function(anchored(&functions, "(_v[0-9]+)?"))
        .allowlist_type(anchored(TYPES, "(_enum|_st)?"))
        .allowlist_var(anchored(VARS, ""))
        // A newer driver may write back enum values these headers do not know: newtypes, not enums.
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .bitfield_enum("CUmemAllocationHandleType_enum")
        .bitfield_enum("CUmemAllocationHandleType_enum");
    let bindings = common_options(bindings)
        .generate()
        .map_err(|e| format!("bindgen failed on {}: {e}", headers.cuda_h.display()))?;
    let abi_versions = abi_versions(&headers.typedefs_h)?;
    let file = syn::parse_file(&bindings.to_string()).map_err(|e| format!("parsing bindgen's output: {e}"))?;

    // Where cuda.h declares a base name more than once (`cuCtxGetDevice` and `cuCtxGetDevice_v2`),
    // the highest suffix is the newest ABI, which is what cuGetProcAddress hands out for it.
    let mut declarations: BTreeMap<String, (u32, syn::ForeignItemFn)> = BTreeMap::new();
    let mut items = Vec::new();
    for item in file.items {
        let syn::Item::ForeignMod(block) = item else {
            items.push(item);
            continue;
        };
        for foreign in block.items {
            let syn::ForeignItem::Fn(function) = foreign else {
                return Err("bindgen emitted a foreign item that is not a function".into());
            };
            let symbol = function.sig.ident.to_string();
            let (base, suffix) = split_version(&symbol);
            let newer = declarations.get(base).is_none_or(|(known, _)| suffix > *known);
            if newer {
                declarations.insert(base.to_string(), (suffix, function));
            }
        }
    }
    for typedef in GROWING_ENUMS {
        items.push(members_list(&items, typedef)?);
    }
    let mut entry_points = BTreeMap::new();
    for (base, (_, function)) in &declarations {
        let since = *abi_versions
            .get(base)
            .ok_or_else(|| format!("{base} has no PFN typedef in cudaTypedefs.h: its ABI version is unknown"))?;
        let inputs = &function.sig.inputs;
        let output = &function.sig.output;
        let alias = format_ident!("PFN_{}", base);
        let doc = format!(" `{base}` as the driver hands it out for CUDA {} and later.", version_label(since));
        items.push(syn::parse_quote! {
            #[doc = #doc]
            pub type #alias = unsafe extern "C" fn(#inputs) #output;
        });
        entry_points.insert(base.clone(), since);
    }
    let required = FUNCTIONS
        .iter()
        .copied()
        .chain(FUNCTIONS_SINCE.iter().filter(|(_, since)| *since <= cuda_version).map(|(name, _)| *name));
    let missing: Vec<_> = required.filter(|f| !entry_points.contains_key(*f)).collect();
    if !missing.is_empty() {
        return Err(format!("cuda.h {} does not declare {missing:?}", headers.cuda_h.display()));
    }
    let body = quote! { #(#items)* }.to_string();
    let mut text = format!(
        "//! Generated by `cargo xtask bindgen`. Do not edit by hand.\n//!\n//! Source: {}; bindgen 0.72.1.\n\n{body}\n",
        headers.provenance
    );
    // The list of entry points as a macro that calls back with it: the loader builds its table
    // from it (so these declarations depend on nothing hand-written), and other crates (the
    // fault-injecting driver) cover every function without listing it by hand.
    text.push_str(
        "\n/// Calls `$callback! { name: $crate::PFN_name = since, ... }` with every entry point these\n\
         /// bindings declare and the CUDA version of its declared ABI. Not part of the public API.\n\
         #[doc(hidden)]\n#[macro_export]\nmacro_rules! for_each_entry_point {\n    ($callback:ident) => {\n        $callback! {\n",
    );
    for (name, since) in &entry_points {
        text.push_str(&format!("            {name}: $crate::PFN_{name} = {since},\n"));
    }
    text.push_str("        }\n    };\n}\n");
    rustfmt(root, &text)
}

/// `pub const <typedef>_MEMBERS: &[(&str, <typedef>)]`, from the associated constants bindgen
/// gave the enum's newtype.
fn members_list(items: &[syn::Item], typedef: &str) -> Result<syn::Item, String> {
    let newtype = format!("{typedef}_enum");
    let mut names = Vec::new();
    for item in items {
        let syn::Item::Impl(block) = item else {
            continue;
        };
        let syn::Type::Path(self_type) = &*block.self_ty else {
            continue;
        };
        if !self_type.path.is_ident(&newtype) {
            continue;
        }
        for member in &block.items {
            if let syn::ImplItem::Const(constant) = member {
                names.push(constant.ident.clone());
            }
        }
    }
    if names.is_empty() {
        return Err(format!("found no members of {newtype}"));
    }
    let list = format_ident!("{}_MEMBERS", typedef);
    let ty = format_ident!("{}", typedef);
    let doc = format!(" Every member of `{typedef}` these headers declare.");
    let strings: Vec<String> = names.iter().map(ToString::to_string).collect();
    Ok(syn::parse_quote! {
        #[doc = #doc]
        pub const #list: &[(&str, #ty)] = &[#((#strings, #ty::#names)),*];
    })
}

/// `cuMemcpyHtoDAsync_v2` -> (`cuMemcpyHtoDAsync`, 2); an unsuffixed name is version 1.
fn split_version(symbol: &str) -> (&str, u32) {
    match symbol.rsplit_once("_v") {
        Some((base, digits)) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            (base, digits.parse().unwrap_or(1))
        }
        _ => (symbol, 1),
    }
}

fn version_label(version: u32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// For each function, the newest ABI version among cudaTypedefs.h's `PFN_<name>_v<version>`
/// typedefs, which is the ABI cuda.h declares. The legacy section (`__CUDA_API_VERSION_INTERNAL`)
/// and the per-thread-stream variants are not what cuda.h declares, so they are skipped.
fn abi_versions(typedefs_h: &Path) -> Result<BTreeMap<String, u32>, String> {
    let text = std::fs::read_to_string(typedefs_h).map_err(|e| format!("reading {}: {e}", typedefs_h.display()))?;
    let current = text.split("#if defined(__CUDA_API_VERSION_INTERNAL)").next().unwrap_or(&text);
    let mut versions = BTreeMap::new();
    for line in current.lines() {
        let Some((_, rest)) = line.split_once("(CUDAAPI *PFN_") else {
            continue;
        };
        let Some((name, _)) = rest.split_once(')') else {
            continue;
        };
        if name.ends_with("_ptsz") || name.ends_with("_ptds") {
            continue;
        }
        let Some((base, digits)) = name.rsplit_once("_v") else {
            continue;
        };
        let Ok(version) = digits.parse::<u32>() else {
            continue;
        };
        let entry = versions.entry(base.to_string()).or_insert(version);
        *entry = (*entry).max(version);
    }
    if versions.is_empty() {
        return Err(format!("{} holds no PFN typedefs", typedefs_h.display()));
    }
    Ok(versions)
}

pub(crate) fn rustfmt(root: &Path, text: &str) -> Result<String, String> {
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2021", "--emit", "stdout"])
        .current_dir(root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running rustfmt: {e} (install it with `rustup component add rustfmt`)"))?;
    let mut stdin = child.stdin.take().ok_or("rustfmt has no stdin")?;
    let input = text.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child.wait_with_output().map_err(|e| format!("waiting for rustfmt: {e}"))?;
    writer.join().map_err(|_| "writing to rustfmt panicked")?.map_err(|e| format!("writing to rustfmt: {e}"))?;
    if !output.status.success() {
        return Err(format!("rustfmt failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    String::from_utf8(output.stdout).map_err(|e| format!("rustfmt wrote invalid UTF-8: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names_drop_only_version_suffixes() {
        assert_eq!(split_version("cuMemcpyHtoDAsync_v2"), ("cuMemcpyHtoDAsync", 2));
        assert_eq!(split_version("cuCtxCreate_v4"), ("cuCtxCreate", 4));
        assert_eq!(split_version("cuMemAllocAsync"), ("cuMemAllocAsync", 1));
        assert_eq!(split_version("cuMemPool_vx"), ("cuMemPool_vx", 1));
    }

    #[test]
    fn version_labels_read_as_cuda_releases() {
        assert_eq!(version_label(13020), "13.2");
        assert_eq!(version_label(11040), "11.4");
    }
}
