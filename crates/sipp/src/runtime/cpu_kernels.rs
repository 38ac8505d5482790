//! sipp's own CPU kernels for llama.cpp's CPU backend (`kernels/`, compiled
//! by `build.rs`).
//!
//! Matrix products for Q4_1 weights (the default model's type) and Q8_0
//! weights (its tied embeddings and output layer, and whole Q8_0 models).
//! ggml multiplies a Q4_1 matrix one (weight row, activation row) pair at a
//! time, so on a CPU each extra row of a step (a prompt chunk, several
//! slots, speculative drafts) cost nearly a one-row step; Q8_0 has a tiled
//! product for many rows but the pairwise path for one. The kernels register
//! as an extra buffer type of ggml's CPU backend, the hook of ggml's own
//! repacked kernels: such matrices are repacked at load, 16 rows
//! interleaved, and every product over them runs through AVX-512 VNNI dot
//! instructions, one weight row per lane.
//!
//! Beside them, flash attention (ggml asks every extra buffer type about
//! every op, so it needs no buffer of its own): ggml's CPU flash attention
//! walks the cache one cell at a time per row and head below 64 rows, and
//! tiles from 64; the kernel takes 32 cells at a time for every row. Its
//! tiles and chunks are made of the cells a row sees, in cell order, so a
//! row's result depends on nothing else, bit for bit: not on the batch (a
//! drafted token gets the logits it would get decoded alone, a prompt the
//! same logits in one batch as token by token), the threads, or where its
//! cells lie in the cache.
//!
//! They are compiled in for x86-64 CPUs with AVX-512 VNNI, and in a second
//! form for those with AVX2, FMA and F16C (a 16-lane vector as two 8-lane
//! registers; products by vpmaddubsw). The build targets the build
//! machine's CPU. `SIPP_CPU_KERNELS=off` leaves them out of a process, for
//! comparisons with llama.cpp's own arithmetic.

use std::sync::OnceLock;

/// Whether the build's target CPU has what the kernels are compiled for
/// (x86-64 with F16C, and AVX-512 F, BW, DQ, VL and VNNI or AVX2 and FMA):
/// where it does not, `build.rs` compiles them empty and ggml's own path
/// runs.
pub const FOR_THIS_TARGET: bool = cfg!(all(
    feature = "llama",
    target_arch = "x86_64",
    target_feature = "f16c",
    any(
        all(
            target_feature = "avx512f",
            target_feature = "avx512bw",
            target_feature = "avx512dq",
            target_feature = "avx512vl",
            target_feature = "avx512vnni"
        ),
        all(target_feature = "avx2", target_feature = "fma")
    )
));

#[cfg(sipp_cpu_kernels)]
mod ffi {
    extern "C" {
        pub fn sipp_cpu_gemm_register() -> bool;
        pub fn sipp_cpu_gemm_calls() -> std::os::raw::c_ulonglong;
        pub fn sipp_cpu_attention_calls() -> std::os::raw::c_ulonglong;
        pub fn sipp_cpu_gemm_check(q8_0: bool, k: i32, m: i32, n: i32, seed: u32) -> f64;
        pub fn sipp_cpu_attention_check(
            d: i32,
            n: i32,
            heads: i32,
            kv_heads: i32,
            cells: i32,
            threads: i32,
            seed: u32,
        ) -> f64;
        pub fn sipp_cpu_attention_invariance(
            d: i32,
            heads: i32,
            kv_heads: i32,
            cache: i32,
            seen: i32,
            seed: u32,
        ) -> f64;
    }
}

/// A weight type the kernels take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    /// 4-bit quants with a scale and a minimum per block of 32.
    Q4_1,
    /// 8-bit quants with a scale per block of 32.
    Q8_0,
}

/// Registers the kernels with ggml's CPU backend, once per process, unless
/// `SIPP_CPU_KERNELS=off`. Must run before the first model loads. Returns
/// whether they are active.
pub fn register() -> bool {
    static ACTIVE: OnceLock<bool> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let off = std::env::var("SIPP_CPU_KERNELS")
            .is_ok_and(|v| matches!(v.trim(), "off" | "0" | "false" | "no"));
        let active = !off && register_compiled();
        tracing::debug!(active, "sipp CPU matrix kernels");
        active
    })
}

#[cfg(sipp_cpu_kernels)]
fn register_compiled() -> bool {
    // SAFETY: registration takes no arguments and runs once (OnceLock).
    unsafe { ffi::sipp_cpu_gemm_register() }
}

#[cfg(not(sipp_cpu_kernels))]
fn register_compiled() -> bool {
    false
}

/// Whether the kernels serve this process's Q4_1 and Q8_0 products
/// (registered, and compiled in for this CPU).
pub fn active() -> bool {
    register()
}

/// Matrix products the kernels have computed in this process so far.
pub fn products() -> u64 {
    #[cfg(sipp_cpu_kernels)]
    {
        // SAFETY: reads an atomic counter.
        unsafe { ffi::sipp_cpu_gemm_calls() }
    }
    #[cfg(not(sipp_cpu_kernels))]
    {
        0
    }
}

/// Attention ops the attention kernel has
/// computed in this process so far.
pub fn attention_ops() -> u64 {
    #[cfg(sipp_cpu_kernels)]
    {
        // SAFETY: reads an atomic counter.
        unsafe { ffi::sipp_cpu_attention_calls() }
    }
    #[cfg(not(sipp_cpu_kernels))]
    {
        0
    }
}

/// Runs the kernel for `weights` on random data, `k` x `m` weights times `n`
/// activation rows, against ggml's own activation quantization and dot
/// product on the original blocks: the largest difference relative to the
/// largest result. The repacked weights must unpack to the original blocks
/// and the quantized activations must equal ggml's bit for bit (otherwise
/// the result is 1e9). `None` where the kernels are not compiled in or take
/// no such shape.
pub fn check(weights: WeightType, k: usize, m: usize, n: usize, seed: u32) -> Option<f64> {
    #[cfg(sipp_cpu_kernels)]
    {
        let dims = (
            i32::try_from(k).ok()?,
            i32::try_from(m).ok()?,
            i32::try_from(n).ok()?,
        );
        let q8_0 = weights == WeightType::Q8_0;
        // SAFETY: the check allocates and frees its own data.
        let err = unsafe { ffi::sipp_cpu_gemm_check(q8_0, dims.0, dims.1, dims.2, seed) };
        (err >= 0.0).then_some(err)
    }
    #[cfg(not(sipp_cpu_kernels))]
    {
        let _ = (weights, k, m, n, seed);
        None
    }
}

/// Runs the attention kernel and ggml's flash attention on the
/// same random queries, keys, values and causal-style mask (`heads` query
/// heads over `kv_heads`, dimension `d`, `n` rows over `cells` cells, on
/// `threads` threads) and compares both with attention in double precision:
/// the kernel's largest difference relative to the largest output (1e9 when
/// it is more than twice ggml's own). `None` where the kernel is not
/// compiled in or takes no such shape.
pub fn check_attention(
    d: usize,
    n: usize,
    heads: usize,
    kv_heads: usize,
    cells: usize,
    threads: usize,
    seed: u32,
) -> Option<f64> {
    #[cfg(sipp_cpu_kernels)]
    {
        let int = |x: usize| i32::try_from(x).ok();
        // SAFETY: the check allocates and frees its own ggml context.
        let err = unsafe {
            ffi::sipp_cpu_attention_check(
                int(d)?,
                int(n)?,
                int(heads)?,
                int(kv_heads)?,
                int(cells)?,
                int(threads)?,
                seed,
            )
        };
        (err >= 0.0).then_some(err)
    }
    #[cfg(not(sipp_cpu_kernels))]
    {
        let _ = (d, n, heads, kv_heads, cells, threads, seed);
        None
    }
}

/// Computes one query row (every head seeing `seen` cells of a `cache`-cell
/// cache, with the same keys and values each time) through the attention
/// kernel seven ways: alone on one thread over 256 cells, alone on two
/// threads over the whole cache, as one of 33 rows on two and on three
/// threads (the threads splitting the cells, then the rows), as one of 100
/// rows, alone with its cells 300 cells further, and as the first of 40 rows
/// of its sequence with its cells elsewhere and a gap in them. Returns how
/// many of its outputs differ between the runs (`Some(0)`: equal bit for
/// bit). `None` where the kernel is not compiled in or takes no such shape.
pub fn attention_invariance(
    d: usize,
    heads: usize,
    kv_heads: usize,
    cache: usize,
    seen: usize,
    seed: u32,
) -> Option<u64> {
    #[cfg(sipp_cpu_kernels)]
    {
        let int = |x: usize| i32::try_from(x).ok();
        // SAFETY: the check allocates and frees its own ggml context.
        let diff = unsafe {
            ffi::sipp_cpu_attention_invariance(
                int(d)?,
                int(heads)?,
                int(kv_heads)?,
                int(cache)?,
                int(seen)?,
                seed,
            )
        };
        (diff >= 0.0).then_some(diff as u64)
    }
    #[cfg(not(sipp_cpu_kernels))]
    {
        let _ = (d, heads, kv_heads, cache, seen, seed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiled in exactly where the build targets AVX-512 VNNI, or AVX2 and
    /// FMA, on x86-64.
    const EXPECTED: bool = FOR_THIS_TARGET;

    #[test]
    fn the_kernels_match_ggmls_dot_products() {
        // Activation rows on both sides of the 2 or 4 a pass takes, odd
        // block counts, the model's shapes (and its output layer) and a long
        // row: results within float rounding of ggml's.
        let shapes = [
            (32, 16, 1),
            (64, 16, 2),
            (96, 32, 3),
            (576, 192, 5),
            (576, 1536, 8),
            (1536, 576, 13),
            (576, 49152, 2),
            (4096, 16, 33),
        ];
        for weights in [WeightType::Q4_1, WeightType::Q8_0] {
            for (i, &(k, m, n)) in shapes.iter().enumerate() {
                let err = check(weights, k, m, n, i as u32 + 1);
                assert_eq!(err.is_some(), EXPECTED, "{weights:?} {k}x{m}: compiled in");
                if let Some(err) = err {
                    assert!(
                        err < 1e-5,
                        "{weights:?} {k}x{m} times {n} rows: relative error {err}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_the_kernels_do_not_take_are_refused() {
        // Whole blocks of 32 columns and whole groups of 16 rows.
        for weights in [WeightType::Q4_1, WeightType::Q8_0] {
            assert_eq!(check(weights, 48, 16, 2, 1), None);
            assert_eq!(check(weights, 64, 24, 2, 1), None);
        }
    }

    #[test]
    fn attention_matches_ggmls_flash_attention() {
        // One row, two and a draft's worth, the default model's heads (9 over 3,
        // dimension 64), cells that end inside a tile, one and two threads.
        let shapes = [
            (64, 1, 9, 3, 500, 1),
            (64, 1, 9, 3, 500, 2),
            (64, 2, 9, 3, 500, 1),
            (64, 2, 9, 3, 500, 2),
            (64, 33, 9, 3, 700, 2),
            (64, 8, 4, 4, 45, 2),
            (128, 63, 8, 2, 1030, 2),
            (64, 64, 9, 3, 500, 2),
            (64, 200, 9, 3, 700, 3),
            // dimensions that are no multiple of 64 (values weighed 16 at a
            // time) and two of them (64 at a time, twice); three heads to a
            // kv head for three rows: more queries than one call takes
            (80, 5, 6, 2, 300, 2),
            (128, 3, 9, 3, 300, 1),
        ];
        for (i, &(d, n, heads, kv_heads, cells, threads)) in shapes.iter().enumerate() {
            let err = check_attention(d, n, heads, kv_heads, cells, threads, i as u32 + 1);
            assert_eq!(
                err.is_some(),
                EXPECTED,
                "{d} {n} {heads}/{kv_heads} {cells}: compiled in"
            );
            if let Some(err) = err {
                assert!(
                    err < 1e-5,
                    "{d} {n} {heads}/{kv_heads} {cells}: relative error {err}"
                );
            }
        }
    }

    #[test]
    fn attention_of_a_row_does_not_depend_on_its_batch_or_its_cells() {
        // The default model's heads; a row seeing one cell, part of the
        // first chunk, a few chunks; a cache long enough for longer chunks;
        // and a larger head dimension.
        let cases = [
            (64, 9, 3, 4096, 1),
            (64, 9, 3, 4096, 45),
            (64, 9, 3, 4096, 256),
            (64, 9, 3, 1 << 16, 200),
            (128, 8, 2, 2048, 130),
        ];
        for (i, &(d, heads, kv_heads, cache, seen)) in cases.iter().enumerate() {
            let diff = attention_invariance(d, heads, kv_heads, cache, seen, i as u32 + 1);
            assert_eq!(diff.is_some(), EXPECTED, "compiled in");
            if let Some(diff) = diff {
                assert_eq!(
                    diff, 0,
                    "{d} {heads}/{kv_heads}, {seen} of {cache} cells: outputs that differ"
                );
            }
        }
    }
}
