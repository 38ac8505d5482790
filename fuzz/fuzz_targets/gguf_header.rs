//! GGUF header checks on arbitrary files: an error or a header, never a panic
//! or a huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("sipp-fuzz-gguf-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        if let Ok(h) = sipp::runtime::gguf::check_gguf(&path) {
            let _ = h.quantization();
            let _ = h.architecture();
        }
    }
});
