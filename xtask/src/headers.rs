//! The pinned CUDA headers: which wheel each version comes from, its checksum, and fetching it.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One pinned CUDA release whose headers the bindings are generated from.
pub struct PinnedCuda {
    /// `13.0`, as given to `--cuda`.
    pub label: &'static str,
    /// The value of `CUDA_VERSION` in its cuda.h, which also names the generated file.
    pub cuda_version: u32,
    pub wheel_requirement: &'static str,
    pub wheel_sha256: &'static str,
    pub cuda_h_sha256: &'static str,
}

pub const PINNED: &[PinnedCuda] = &[
    PinnedCuda {
        label: "13.0",
        cuda_version: 13000,
        wheel_requirement: "nvidia-cuda-runtime==13.0.96",
        wheel_sha256: "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
        cuda_h_sha256: "64025f81a9d6d2b10e9e11654f3523e5b046d01b883f0b9ca474e463274b80d4",
    },
    PinnedCuda {
        label: "13.2",
        cuda_version: 13020,
        wheel_requirement: "nvidia-cuda-runtime==13.2.86",
        wheel_sha256: "3498247680dfddce31bad102af7e3e26fc795342a3cac64722bb0fa95e7f60f0",
        cuda_h_sha256: "673873a292718591d75ea3c2e65330b1f8f8278eac3c96b32245418fb0817851",
    },
    PinnedCuda {
        label: "13.4",
        cuda_version: 13040,
        wheel_requirement: "nvidia-cuda-runtime==13.4.92",
        wheel_sha256: "9641f797da20ce1dd8e779b6e96d08cf9ba564cec8e8225458811ee26423f3a5",
        cuda_h_sha256: "7a79d67ca888061b1dfbe4739b51ad64f85a2f3ad874947ce09b2c635b4c7072",
    },
    PinnedCuda {
        label: "13.5",
        cuda_version: 13050,
        wheel_requirement: "nvidia-cuda-runtime==13.5.37",
        wheel_sha256: "df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d",
        cuda_h_sha256: "f4250132eae986e244c693f562f81bdaa919c378665228bece23182da33a39b0",
    },
];

/// cuda.h and cudaTypedefs.h of one release, ready for bindgen.
pub struct Headers {
    pub cuda_h: PathBuf,
    pub typedefs_h: PathBuf,
    /// Where they came from, for the generated file's preamble.
    pub provenance: String,
}

const WHEEL_INCLUDE: &str = "nvidia/cu13/include/";

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Fetches the pinned wheel into `target/cuda-headers/<version>/` (once), checks its sha256 and
/// extracts the two headers from it.
pub fn pinned(root: &Path, pin: &PinnedCuda) -> Result<Headers, String> {
    let cache = root.join("target").join("cuda-headers").join(pin.label);
    let cuda_h = cache.join("cuda.h");
    let typedefs_h = cache.join("cudaTypedefs.h");
    let provenance = format!(
        "cuda.h of CUDA {} from the PyPI wheel {} (cuda.h sha256 {})",
        pin.label, pin.wheel_requirement, pin.cuda_h_sha256
    );
    if file_has_sha(&cuda_h, pin.cuda_h_sha256) && typedefs_h.is_file() {
        return Ok(Headers { cuda_h, typedefs_h, provenance });
    }
    std::fs::create_dir_all(&cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    let wheel = download_wheel(&cache, pin.wheel_requirement, "manylinux2014_x86_64")?;
    let bytes = std::fs::read(&wheel).map_err(|e| format!("reading {}: {e}", wheel.display()))?;
    let found = sha256_hex(&bytes);
    if found != pin.wheel_sha256 {
        return Err(format!(
            "{} has sha256 {found}, expected {}: the download is not the pinned wheel",
            wheel.display(),
            pin.wheel_sha256
        ));
    }
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes))
        .map_err(|e| format!("opening {} as a zip: {e}", wheel.display()))?;
    for (name, dest) in [("cuda.h", &cuda_h), ("cudaTypedefs.h", &typedefs_h)] {
        let path = format!("{WHEEL_INCLUDE}{name}");
        let mut entry = archive.by_name(&path).map_err(|e| format!("{path} in {}: {e}", wheel.display()))?;
        let mut content = Vec::new();
        entry.read_to_end(&mut content).map_err(|e| format!("extracting {path}: {e}"))?;
        std::fs::write(dest, content).map_err(|e| format!("writing {}: {e}", dest.display()))?;
    }
    if !file_has_sha(&cuda_h, pin.cuda_h_sha256) {
        return Err(format!("{} does not have the pinned sha256 {}", cuda_h.display(), pin.cuda_h_sha256));
    }
    Ok(Headers { cuda_h, typedefs_h, provenance })
}

fn file_has_sha(path: &Path, sha: &str) -> bool {
    std::fs::read(path).map(|b| sha256_hex(&b) == sha).unwrap_or(false)
}

/// The wheel `requirement` for `platform` in `cache`, fetched with pip unless already there.
pub fn download_wheel(cache: &Path, requirement: &str, platform: &str) -> Result<PathBuf, String> {
    let existing = find_wheel(cache);
    if let Some(wheel) = existing {
        return Ok(wheel);
    }
    eprintln!("fetching {requirement} with pip...");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"])
        .args(["--platform", platform, "--python-version", "3.12"])
        .arg("--dest")
        .arg(cache)
        .arg(requirement)
        .status()
        .map_err(|e| format!("running `python3 -m pip download`: {e} (is python3 with pip installed?)"))?;
    if !status.success() {
        return Err(format!("`python3 -m pip download {requirement}` failed ({status})"));
    }
    find_wheel(cache).ok_or_else(|| format!("pip reported success but left no wheel in {}", cache.display()))
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
}

/// A header given with `--header`: its version is read from its own `CUDA_VERSION`.
pub fn explicit(cuda_h: &Path) -> Result<(Headers, u32), String> {
    let text = std::fs::read_to_string(cuda_h).map_err(|e| format!("reading {}: {e}", cuda_h.display()))?;
    let version = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("#define CUDA_VERSION").map(str::trim))
        .and_then(|v| v.parse::<u32>().ok())
        .ok_or_else(|| format!("{} has no `#define CUDA_VERSION <number>`", cuda_h.display()))?;
    let typedefs_h = cuda_h.with_file_name("cudaTypedefs.h");
    if !typedefs_h.is_file() {
        return Err(format!(
            "{} is needed beside {} (it gives each function's ABI version)",
            typedefs_h.display(),
            cuda_h.display()
        ));
    }
    let provenance = format!("cuda.h with CUDA_VERSION {version} (sha256 {})", sha256_hex(text.as_bytes()));
    Ok((Headers { cuda_h: cuda_h.to_path_buf(), typedefs_h, provenance }, version))
}
