//! The engine's LoRA adapters as callers see them: their ids and names,
//! their global scales (`GET`/`POST /lora-adapters`), how a request's
//! `lora` list becomes an [`AdapterSet`], and requests counted per adapter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use super::request::{EngineError, LoraScale};
use crate::config::LoraAdapterConfig;
use crate::runtime::{AdapterSet, LoraAdapterInfo};

/// The adapters of one engine.
#[derive(Debug)]
pub struct LoraTable {
    adapters: Vec<LoraAdapterInfo>,
    /// The scale each adapter has for requests that choose none.
    global: RwLock<Vec<f32>>,
    /// Requests that ran with each adapter.
    requests: Vec<AtomicU64>,
}

/// An adapter and its global scale now.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoraAdapterState {
    /// The adapter.
    #[serde(flatten)]
    pub info: LoraAdapterInfo,
    /// Its scale for requests that choose no adapters.
    pub global_scale: f32,
}

fn invalid(message: String) -> EngineError {
    EngineError::InvalidRequest {
        field: "lora",
        message,
    }
}

impl LoraTable {
    /// The adapters of a config, in id order.
    pub fn new(config: &[LoraAdapterConfig]) -> Self {
        let adapters: Vec<LoraAdapterInfo> = config
            .iter()
            .enumerate()
            .map(|(id, a)| LoraAdapterInfo {
                id,
                name: a.resolved_name(),
                path: a.path.display().to_string(),
                scale: a.scale,
            })
            .collect();
        let global = config
            .iter()
            .map(|a| if a.apply { a.scale } else { 0.0 })
            .collect();
        Self {
            requests: adapters.iter().map(|_| AtomicU64::new(0)).collect(),
            adapters,
            global: RwLock::new(global),
        }
    }

    /// The adapters, by id.
    pub fn adapters(&self) -> &[LoraAdapterInfo] {
        &self.adapters
    }

    /// The adapters with their global scales.
    pub fn states(&self) -> Vec<LoraAdapterState> {
        let global = self.global_scales();
        self.adapters
            .iter()
            .zip(global)
            .map(|(a, g)| LoraAdapterState {
                info: a.clone(),
                global_scale: g,
            })
            .collect()
    }

    fn global_scales(&self) -> Vec<f32> {
        self.global
            .read()
            .map(|g| g.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Checks a `lora` list: known ids, finite scales.
    fn check(&self, list: &[LoraScale]) -> Result<(), EngineError> {
        for l in list {
            if l.id >= self.adapters.len() {
                return Err(invalid(match self.adapters.len() {
                    0 => format!("no adapter {}: this model has no LoRA adapters", l.id),
                    n => format!(
                        "no adapter {}: this model's adapters are 0 to {} (GET /lora-adapters)",
                        l.id,
                        n - 1
                    ),
                }));
            }
            if !l.scale.is_finite() {
                return Err(invalid(format!(
                    "adapter {}: scale must be a finite number, got {}",
                    l.id, l.scale
                )));
            }
        }
        Ok(())
    }

    /// Sets the global scales as llama-server's `POST /lora-adapters`
    /// does: the listed adapters at their scales, the others at 0.
    pub fn set_global(&self, list: &[LoraScale]) -> Result<(), EngineError> {
        self.check(list)?;
        let mut scales = vec![0.0; self.adapters.len()];
        for l in list {
            scales[l.id] = l.scale;
        }
        match self.global.write() {
            Ok(mut g) => *g = scales,
            Err(e) => *e.into_inner() = scales,
        }
        Ok(())
    }

    /// The set a request runs with: its own list (the others off), else (no
    /// list, or an empty one, as llama-server reads it) the global scales.
    pub fn resolve(&self, list: Option<&[LoraScale]>) -> Result<AdapterSet, EngineError> {
        match list {
            // An empty list means the global scales, as in llama-server.
            Some(list) if !list.is_empty() => {
                self.check(list)?;
                Ok(AdapterSet::new(list.iter().map(|l| (l.id, l.scale))))
            }
            _ => Ok(AdapterSet::new(
                self.global_scales().into_iter().enumerate(),
            )),
        }
    }

    /// The adapter named `name`, alone at its configured scale (the
    /// selection of `model: "TARGET:NAME"`).
    pub fn by_name(&self, name: &str) -> Option<Vec<LoraScale>> {
        self.adapters.iter().find(|a| a.name == name).map(|a| {
            vec![LoraScale {
                id: a.id,
                scale: a.scale,
            }]
        })
    }

    /// Counts a request under each adapter of its set.
    pub fn count(&self, set: &AdapterSet) {
        for &(id, _) in set.entries() {
            if let Some(c) = self.requests.get(id) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Requests that ran with each adapter, by id.
    pub fn request_counts(&self) -> Vec<u64> {
        self.requests
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> LoraTable {
        let mut b = LoraAdapterConfig::new("/m/b.gguf".into(), 0.5);
        b.apply = false;
        LoraTable::new(&[LoraAdapterConfig::new("/m/a.gguf".into(), 1.0), b])
    }

    #[test]
    fn requests_choose_their_set_and_the_rest_get_the_global_scales() {
        let t = table();
        assert_eq!(t.resolve(None).unwrap(), AdapterSet::new([(0, 1.0)]));
        let only_b = [LoraScale { id: 1, scale: 2.0 }];
        assert_eq!(
            t.resolve(Some(&only_b)).unwrap(),
            AdapterSet::new([(1, 2.0)])
        );
        assert_eq!(t.resolve(Some(&[])).unwrap(), AdapterSet::new([(0, 1.0)]));
        let off = [LoraScale { id: 0, scale: 0.0 }];
        assert!(t.resolve(Some(&off)).unwrap().is_empty());
        t.set_global(&[LoraScale { id: 1, scale: 0.25 }]).unwrap();
        assert_eq!(t.resolve(None).unwrap(), AdapterSet::new([(1, 0.25)]));
        assert_eq!(t.states()[0].global_scale, 0.0);
        assert_eq!(
            t.by_name("b").unwrap(),
            vec![LoraScale { id: 1, scale: 0.5 }]
        );
        assert!(t.by_name("c").is_none());
        for bad in [
            LoraScale { id: 2, scale: 1.0 },
            LoraScale {
                id: 0,
                scale: f32::NAN,
            },
        ] {
            let e = t.resolve(Some(&[bad])).expect_err("refused").to_string();
            assert!(e.contains("lora"), "{e}");
            assert!(t.set_global(&[bad]).is_err());
        }
        t.count(&AdapterSet::new([(0, 1.0), (1, 1.0)]));
        t.count(&AdapterSet::new([(1, 1.0)]));
        assert_eq!(t.request_counts(), vec![1, 2]);
    }
}
