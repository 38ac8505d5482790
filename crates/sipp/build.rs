//! Builds sipp's own CPU kernels (`kernels/`) against the llama.cpp that
//! llama-cpp-sys-2 compiled, when the `llama` feature is on.
//!
//! The kernels plug into ggml's CPU backend through its internal headers
//! (`ggml-cpu/traits.h`), which llama-cpp-sys-2 does not install. Their
//! source tree is found through the CMake cache of its build, whose install
//! directory it exports as `DEP_LLAMA_GGML_CMAKE_DIR`.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(sipp_cpu_kernels)");
    if env::var_os("CARGO_FEATURE_LLAMA").is_none() {
        return;
    }
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return;
    }
    let Some(llama_src) = llama_source() else {
        println!(
            "cargo:warning=llama.cpp's source tree was not found; sipp's CPU kernels are left out"
        );
        return;
    };
    let ggml = llama_src.join("ggml");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file("kernels/cpu_gemm.cpp")
        .file("kernels/attention.cpp")
        .include("kernels")
        .include(ggml.join("include"))
        .include(ggml.join("src"))
        .include(ggml.join("src/ggml-cpu"))
        .flag_if_supported("-fno-math-errno")
        .warnings(false)
        .opt_level(3);
    for flag in arch_flags() {
        build.flag(&flag);
    }
    build.compile("sipp_kernels");
    println!("cargo:rustc-cfg=sipp_cpu_kernels");
}

/// The compiler flags that match Rust's target CPU, as llama-cpp-sys-2 passes
/// them to ggml: `-march=native` for `target-cpu=native`, `-march=CPU` for
/// another CPU, otherwise one flag per enabled target feature.
fn arch_flags() -> Vec<String> {
    let rustflags = env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let cpu = rustflags
        .split('\x1f')
        .find_map(|f| f.split("target-cpu=").nth(1).map(str::to_string));
    if let Some(cpu) = cpu {
        return vec![format!("-march={cpu}")];
    }
    let features = env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    features
        .split(',')
        .filter_map(|f| match f {
            "avx2" | "fma" | "f16c" | "avx512f" | "avx512bw" | "avx512dq" | "avx512vl"
            | "avx512vnni" => Some(format!("-m{f}")),
            _ => None,
        })
        .collect()
}

/// llama.cpp's source directory, from the CMake cache next to the install
/// directory llama-cpp-sys-2 exports.
fn llama_source() -> Option<PathBuf> {
    let cmake_dir = PathBuf::from(env::var_os("DEP_LLAMA_GGML_CMAKE_DIR")?);
    // <out>/lib/cmake -> <out>/build/CMakeCache.txt
    let out = cmake_dir.parent()?.parent()?;
    let cache = std::fs::read_to_string(out.join("build/CMakeCache.txt")).ok()?;
    let dir = cache
        .lines()
        .find_map(|line| line.strip_prefix("CMAKE_HOME_DIRECTORY:INTERNAL="))?;
    let dir = Path::new(dir.trim());
    dir.join("ggml/src/ggml-cpu/traits.h")
        .is_file()
        .then(|| dir.to_path_buf())
}
