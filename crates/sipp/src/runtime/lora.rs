//! LoRA adapter sets: which adapters (by id, in load order) a request runs
//! with, and at what scales.
//!
//! llama.cpp applies adapters to a whole context, so a batch computes rows of
//! one set only (the executor runs one `llama_decode` per set in a step), and
//! KV computed under one set is never reused by another (the set's
//! [`AdapterSet::key`] tags every KV sequence).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// The adapters a request runs with: `(id, scale)` sorted by id, scale 0
/// left out. The empty set is the base model.
#[derive(Debug, Clone, Default)]
pub struct AdapterSet(Arc<[(usize, f32)]>);

impl AdapterSet {
    /// The base model.
    pub fn none() -> Self {
        Self::default()
    }

    /// A set from `(id, scale)` pairs (any order; zero scales are left out;
    /// a later pair for the same id wins).
    pub fn new(pairs: impl IntoIterator<Item = (usize, f32)>) -> Self {
        let mut v: Vec<(usize, f32)> = Vec::new();
        for (id, scale) in pairs {
            v.retain(|(i, _)| *i != id);
            v.push((id, scale));
        }
        v.retain(|(_, s)| *s != 0.0);
        v.sort_by_key(|(id, _)| *id);
        Self(v.into())
    }

    /// The adapters applied, by id, with their scales.
    pub fn entries(&self) -> &[(usize, f32)] {
        &self.0
    }

    /// Whether this is the base model.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A tag for KV computed under this set: 0 for the base model, and a
    /// hash of the ids and scales' bits otherwise (never 0).
    pub fn key(&self) -> u64 {
        if self.0.is_empty() {
            return 0;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.hash(&mut h);
        h.finish().max(1)
    }
}

impl PartialEq for AdapterSet {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(other.0.iter())
                .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits())
    }
}

impl Eq for AdapterSet {}

impl Hash for AdapterSet {
    fn hash<H: Hasher>(&self, state: &mut H) {
        for (id, scale) in self.0.iter() {
            id.hash(state);
            scale.to_bits().hash(state);
        }
    }
}

/// Checks, from its header alone, that `path` is a LoRA adapter made for a
/// model of architecture `arch` (llama.cpp would only log why it refused
/// it). `id` names it in the error.
pub fn check_adapter(
    id: usize,
    path: &std::path::Path,
    arch: &str,
) -> Result<(), super::RuntimeError> {
    let failed =
        |m: String| super::RuntimeError::Lora(format!("adapter {id} ({}): {m}", path.display()));
    let header = super::gguf::check_gguf(path).map_err(|e| failed(e.to_string()))?;
    let text = |k: &str| {
        header
            .metadata
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string()
    };
    if text("general.type") != "adapter" || text("adapter.type") != "lora" {
        return Err(failed(format!(
            "not a LoRA adapter (general.type `{}`, adapter.type `{}`)",
            text("general.type"),
            text("adapter.type")
        )));
    }
    if header.architecture() != Some(arch) {
        return Err(failed(format!(
            "made for a `{}` model, and this model is `{arch}`",
            header.architecture().unwrap_or("?")
        )));
    }
    Ok(())
}

/// A loaded adapter as requests and `/lora-adapters` see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoraAdapterInfo {
    /// Its id (place in the configured list).
    pub id: usize,
    /// The name that selects it as `TARGET:NAME`.
    pub name: String,
    /// Its file.
    pub path: String,
    /// Its scale when a request or `TARGET:NAME` selects it.
    pub scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_canonical_and_zero_scales_vanish() {
        let a = AdapterSet::new([(2, 0.5), (0, 1.0), (1, 0.0)]);
        assert_eq!(a.entries(), &[(0, 1.0), (2, 0.5)]);
        assert_eq!(a, AdapterSet::new([(0, 1.0), (2, 0.5)]));
        assert_eq!(a.key(), AdapterSet::new([(0, 1.0), (2, 0.5)]).key());
        assert_ne!(a, AdapterSet::new([(0, 1.0), (2, 0.25)]));
        assert_ne!(a.key(), AdapterSet::new([(0, 1.0)]).key());
        assert_eq!(AdapterSet::new([(3, 0.0)]), AdapterSet::none());
        assert_eq!(AdapterSet::none().key(), 0);
        assert_ne!(AdapterSet::new([(0, 1.0)]).key(), 0);
        assert_eq!(AdapterSet::new([(1, 1.0), (1, 2.0)]).entries(), &[(1, 2.0)]);
    }
}
