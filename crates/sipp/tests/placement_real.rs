//! Placement on the real default model: where the layers go, what the
//! engine reports, and what llama.cpp's fitting refuses. On a GPU build
//! (`--features vulkan|cuda`, run by `scripts/check-gpu.sh`) the offloaded
//! model must agree with the CPU under the near-tie rule.

mod common;

use common::{default_model, engine_with};
use sipp::config::GpuLayers;
use sipp::runtime::llama::check_placement;
use sipp::runtime::placement::gpu_devices;
use sipp::runtime::RuntimeError;
use sipp::NativeRuntimeConfig;

/// A context no machine here holds (terabytes of KV) is refused by the
/// fitting before anything is allocated, naming what to change; the same
/// context with the fitting off is not checked (llama.cpp then fails or
/// succeeds on its own); a GPU beyond the devices there are is refused.
#[test]
fn what_does_not_fit_or_does_not_exist_is_refused_before_the_load() {
    let path = default_model();
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 50_000_000;
    match check_placement(&path, &cfg, 8) {
        Err(RuntimeError::Placement(m)) => {
            assert!(m.contains("does not fit") && m.contains("50000000"), "{m}")
        }
        other => panic!("expected a placement error, got {other:?}"),
    }
    cfg.context.n_ctx = 2048;
    let fits = check_placement(&path, &cfg, 8).expect("a small context fits");
    assert_eq!(fits.total_layers, 31, "30 layers and the output layer");
    let gpus = gpu_devices();
    cfg.placement.main_gpu = gpus.len().max(1) as u32;
    match check_placement(&path, &cfg, 8) {
        Err(RuntimeError::Placement(m)) => assert!(m.contains("does not exist"), "{m}"),
        other => panic!("expected a placement error, got {other:?}"),
    }
}

/// With no GPU device every layer stays on the CPU whatever `gpu_layers`
/// says, and the engine reports it.
#[cfg(not(any(feature = "cuda", feature = "vulkan", feature = "metal")))]
#[test]
fn a_cpu_build_keeps_every_layer_on_the_cpu() {
    assert!(gpu_devices().is_empty(), "{:?}", gpu_devices());
    for layers in [GpuLayers::Auto, GpuLayers::All, GpuLayers::Count(12)] {
        let e = engine_with(1, |c| {
            c.context.n_ctx = 512;
            c.placement.gpu_layers = layers;
        });
        let p = &e.info().model.placement;
        assert_eq!(
            (p.backend.as_str(), p.offloaded_layers),
            ("CPU", 0),
            "{layers}"
        );
        assert_eq!(p.summary(), "CPU");
        let out = common::run(&e, "The capital of France is", 4);
        assert!(!out.tokens.is_empty(), "{layers}: generates");
    }
}

/// On a GPU build: every layer goes to the GPU by default (fitted), the
/// engine names the device, and greedy output over 10 prompts agrees with
/// the same build's CPU placement (`gpu_layers = 0`) under the near-tie rule.
#[cfg(any(feature = "cuda", feature = "vulkan", feature = "metal"))]
#[test]
fn offloaded_layers_agree_with_the_cpu() {
    const NEAR_TIE: f32 = 1.0;
    let gpus = gpu_devices();
    assert!(!gpus.is_empty(), "a GPU build sees a GPU device here");
    let gpu = engine_with(1, |c| c.context.n_ctx = 2048);
    let cpu = engine_with(1, |c| {
        c.context.n_ctx = 2048;
        c.placement.gpu_layers = GpuLayers::Count(0);
    });
    let p = &gpu.info().model.placement;
    eprintln!("placement: {}", p.summary());
    assert_eq!(p.offloaded_layers, p.total_layers, "{p:?}");
    assert_ne!(p.backend, "CPU", "{p:?}");
    assert!(
        p.devices.iter().any(|d| d.starts_with(&gpus[0].name)),
        "{p:?}"
    );
    assert_eq!(cpu.info().model.placement.offloaded_layers, 0);
    common::compare_greedy(&cpu, &gpu, &common::PROMPTS, 24, NEAR_TIE);
}
