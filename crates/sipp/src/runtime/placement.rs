//! Where a model runs: ggml's devices as this build sees them, and the
//! placement a loaded model got (which devices hold how many layers).
//!
//! The loading itself (llama.cpp's memory fitting, model parameters) is in
//! `llama.rs`; this module is the part the engine, server and CLI read.

use serde::Serialize;

/// The llama.cpp backends this binary was built with.
pub fn compiled_backends() -> Vec<&'static str> {
    let mut b = vec!["CPU"];
    if cfg!(feature = "cuda") {
        b.push("CUDA");
    }
    if cfg!(feature = "vulkan") {
        b.push("Vulkan");
    }
    if cfg!(feature = "metal") {
        b.push("Metal");
    }
    if cfg!(feature = "llama") {
        // GGML_RPC=ON in .cargo/config.toml: every llama build has it.
        b.push("RPC");
    }
    b
}

/// What kind of device ggml reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// A discrete GPU (also ggml's RPC devices, which stand for remote ones).
    Gpu,
    /// An integrated GPU sharing host memory.
    Igpu,
    /// An accelerator used next to the CPU (BLAS, AMX, ...).
    Accel,
}

/// One ggml backend device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Device {
    /// ggml's device index.
    pub index: usize,
    /// e.g. "Vulkan0", "CUDA0", "CPU".
    pub name: String,
    /// e.g. "NVIDIA H100 80GB HBM3", "llvmpipe (LLVM 15.0.6, 256 bits)".
    pub description: String,
    /// The backend that owns it: "CUDA", "Vulkan", "CPU", "RPC".
    pub backend: String,
    /// Its kind.
    pub kind: DeviceKind,
    /// Memory in bytes (0 where the device does not say).
    pub memory_total: u64,
    /// Free memory in bytes when listed.
    pub memory_free: u64,
    /// The largest single buffer the device allocates (Vulkan's storage
    /// buffer range, say); `u64::MAX` where it has no such limit.
    pub max_buffer: u64,
}

impl Device {
    /// Whether layers can be offloaded to it.
    pub fn takes_layers(&self) -> bool {
        matches!(self.kind, DeviceKind::Gpu | DeviceKind::Igpu)
    }

    /// "Vulkan0 (llvmpipe ...)".
    pub fn label(&self) -> String {
        if self.description.is_empty() {
            self.name.clone()
        } else {
            format!("{} ({})", self.name, self.description)
        }
    }
}

/// Every device ggml sees (after RPC servers are registered). Empty without
/// the `llama` feature.
pub fn devices() -> Vec<Device> {
    #[cfg(feature = "llama")]
    {
        use llama_cpp_2::LlamaBackendDeviceType as T;
        llama_cpp_2::list_llama_ggml_backend_devices()
            .into_iter()
            .map(|d| Device {
                index: d.index,
                name: d.name,
                description: d.description,
                backend: d.backend,
                kind: match d.device_type {
                    T::Cpu => DeviceKind::Cpu,
                    T::Gpu => DeviceKind::Gpu,
                    T::IntegratedGpu => DeviceKind::Igpu,
                    _ => DeviceKind::Accel,
                },
                memory_total: d.memory_total as u64,
                memory_free: d.memory_free as u64,
                // SAFETY: `index` is one ggml just listed; the buffer type
                // belongs to the device and lives as long as the process.
                max_buffer: unsafe {
                    let dev = llama_cpp_sys_2::ggml_backend_dev_get(d.index);
                    let buft = llama_cpp_sys_2::ggml_backend_dev_buffer_type(dev);
                    if buft.is_null() {
                        u64::MAX
                    } else {
                        llama_cpp_sys_2::ggml_backend_buft_get_max_size(buft) as u64
                    }
                },
            })
            .collect()
    }
    #[cfg(not(feature = "llama"))]
    Vec::new()
}

/// The devices layers can go to, in ggml's order (`main_gpu` and
/// `tensor_split` count in this order).
pub fn gpu_devices() -> Vec<Device> {
    devices().into_iter().filter(Device::takes_layers).collect()
}

/// Where a loaded model's layers are.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Placement {
    /// The backend holding the offloaded layers ("CUDA", "Vulkan", "RPC"),
    /// or "CPU" when none are offloaded.
    pub backend: String,
    /// The devices holding offloaded layers (labels), empty on the CPU.
    pub devices: Vec<String>,
    /// Layers on those devices; llama.cpp counts the output layer, so a fully
    /// offloaded model has `total_layers` of `total_layers`.
    pub offloaded_layers: u32,
    /// The model's layers plus its output layer.
    pub total_layers: u32,
    /// Whether the KV cache sits with the offloaded layers.
    pub kv_offload: bool,
}

impl Placement {
    /// All on the CPU.
    pub fn cpu(total_layers: u32) -> Self {
        Self {
            backend: "CPU".into(),
            devices: Vec::new(),
            offloaded_layers: 0,
            total_layers,
            kv_offload: false,
        }
    }

    /// One line for logs, `inspect` and `/v1/models`:
    /// "31/31 layers on Vulkan0 (llvmpipe ...)" or "CPU".
    pub fn summary(&self) -> String {
        if self.offloaded_layers == 0 {
            return "CPU".into();
        }
        format!(
            "{}/{} layers on {}",
            self.offloaded_layers,
            self.total_layers,
            self.devices.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_devices_and_layers() {
        assert_eq!(Placement::cpu(31).summary(), "CPU");
        let p = Placement {
            backend: "Vulkan".into(),
            devices: vec!["Vulkan0 (llvmpipe)".into()],
            offloaded_layers: 31,
            total_layers: 31,
            kv_offload: true,
        };
        assert_eq!(p.summary(), "31/31 layers on Vulkan0 (llvmpipe)");
        assert!(compiled_backends().contains(&"CPU"));
    }
}
