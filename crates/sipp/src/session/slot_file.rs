//! Saved slots (llama-server's `POST /slots/{id}?action=save|restore|erase`):
//! one sequence's KV state written to a named file and read back, in the
//! spill-file format of [`super::snapshot`] (model fingerprint, tokens, a hash
//! of them, then the state), and the KV bookkeeping of putting it back.
//!
//! The file I/O here runs on the caller's thread; only the state copy in and
//! out of llama.cpp runs on the engine thread.

use std::io::Read;
use std::path::Path;

use super::mirror::KvOp;
use super::snapshot::{read_spill_header, write_spill};
use super::KvSessions;
use crate::runtime::{Backend, SeqId, Token};

/// What a saved-slot file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFile {
    /// The tokens the state holds, by position.
    pub tokens: Vec<Token>,
    /// The sequence's KV state as llama.cpp wrote it.
    pub state: Vec<u8>,
    /// The file's size in bytes.
    pub file_bytes: u64,
}

/// Why a saved-slot file cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotFileError {
    /// No such file.
    #[error("no saved slot file `{0}`")]
    NotFound(String),
    /// It was written by another model (its fingerprint differs).
    #[error("`{file}` was saved by another model (fingerprint {theirs}, this model is {ours}); its KV state cannot be used here")]
    OtherModel {
        /// The file's name.
        file: String,
        /// The fingerprint in the file.
        theirs: String,
        /// This model's.
        ours: String,
    },
    /// Not a slot file, or damaged.
    #[error("`{file}` is not a valid saved slot file: {reason}")]
    Invalid {
        /// The file's name.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing failed.
    #[error("`{file}`: {reason}")]
    Io {
        /// The file's name.
        file: String,
        /// The I/O error.
        reason: String,
    },
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Writes a saved slot; returns the file's size.
pub fn write_slot_file(
    path: &Path,
    fingerprint: &str,
    tokens: &[Token],
    state: &[u8],
) -> Result<u64, SlotFileError> {
    let io = |e: std::io::Error| SlotFileError::Io {
        file: file_name(path),
        reason: e.to_string(),
    };
    write_spill(path, fingerprint, tokens, state).map_err(io)?;
    Ok(std::fs::metadata(path).map_err(io)?.len())
}

/// Reads a saved slot, refusing one from another model (by fingerprint), of
/// the wrong size or whose tokens do not match their hash, or holding token
/// ids outside the vocabulary (`n_vocab`).
pub fn read_slot_file(
    path: &Path,
    fingerprint: &str,
    n_vocab: usize,
) -> Result<SlotFile, SlotFileError> {
    let file = file_name(path);
    if !path.is_file() {
        return Err(SlotFileError::NotFound(file));
    }
    let header = read_spill_header(path).map_err(|reason| SlotFileError::Invalid {
        file: file.clone(),
        reason,
    })?;
    if header.model_fingerprint != fingerprint {
        return Err(SlotFileError::OtherModel {
            file,
            theirs: header.model_fingerprint,
            ours: fingerprint.to_string(),
        });
    }
    if let Some(t) = header
        .tokens
        .iter()
        .find(|&&t| t < 0 || t as usize >= n_vocab)
    {
        return Err(SlotFileError::Invalid {
            file,
            reason: format!("token {t} is outside the vocabulary"),
        });
    }
    let io = |e: std::io::Error| SlotFileError::Io {
        file: file.clone(),
        reason: e.to_string(),
    };
    let mut all = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut all))
        .map_err(io)?;
    let offset = header.state_offset as usize;
    if all.len() != offset + header.state_len as usize {
        return Err(SlotFileError::Invalid {
            file,
            reason: "the file changed while it was read".into(),
        });
    }
    Ok(SlotFile {
        tokens: header.tokens,
        file_bytes: all.len() as u64,
        state: all.split_off(offset),
    })
}

/// Why a saved state could not be put into a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    /// Not enough free KV cells, even after evicting idle sequences.
    #[error("the KV cache has room for {free} more tokens, the saved slot holds {need}")]
    NoRoom {
        /// Tokens in the file.
        need: usize,
        /// Cells that could be freed.
        free: usize,
    },
    /// llama.cpp refused the state.
    #[error("{0}")]
    Refused(String),
}

impl KvSessions {
    /// The generation of a sequence's latest lease (bumped by each lease, so
    /// a remembered (sequence, generation) pair tells whether anyone leased
    /// the sequence since).
    pub fn lease_generation(&self, seq: SeqId) -> u64 {
        self.mirror.seqs[seq as usize].lease_generation
    }

    /// Whether a sequence is leased by a running request.
    pub fn is_leased(&self, seq: SeqId) -> bool {
        self.mirror.is_leased(seq)
    }

    /// The sequences tagged with a session's `context_key`.
    pub fn sequences_with_key(&self, key: &str) -> Vec<SeqId> {
        self.mirror
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.context_key.as_deref() == Some(key))
            .map(|(i, _)| i as SeqId)
            .collect()
    }

    /// A sequence to restore into: an empty idle one, else the idle one
    /// evicted first. `None` when every sequence is leased.
    pub fn sequence_for_restore(&self) -> Option<SeqId> {
        let m = &self.mirror;
        let idle = || (0..m.n_seq() as SeqId).filter(|&s| !m.is_leased(s));
        idle()
            .find(|&s| m.resident_len(s) == 0)
            .or_else(|| idle().min_by_key(|&s| m.seqs[s as usize].eviction_rank()))
    }

    /// How many tokens an idle sequence holds, in the live cache or parked.
    pub fn held_len(&self, seq: SeqId) -> usize {
        self.parked_tokens(seq)
            .map_or_else(|| self.mirror.resident_len(seq), <[Token]>::len)
    }

    /// An idle sequence's tokens and KV state, from the live cache or, for
    /// a parked sequence, from its snapshot (`None` when the store has
    /// dropped it since).
    pub fn save_sequence<B: Backend>(
        &mut self,
        kv: &mut B,
        seq: SeqId,
    ) -> Option<(Vec<Token>, Vec<u8>)> {
        match self.parked_tokens(seq).map(<[Token]>::to_vec) {
            Some(tokens) => self.snapshots.take_exact(&tokens, &mut self.stats),
            None => Some((self.mirror.resident_tokens(seq), kv.seq_state_save(seq))),
        }
    }

    /// Clears an idle sequence (no snapshot: an erased slot keeps nothing for
    /// later requests) and forgets its context key. Returns the tokens it held.
    pub fn erase_sequence<B: Backend>(&mut self, kv: &mut B, seq: SeqId) -> usize {
        if let Some(tokens) = self.parked_tokens(seq).map(<[Token]>::to_vec) {
            self.snapshots.forget(&tokens);
            self.parked.remove(&seq);
            return tokens.len();
        }
        let n = self.mirror.resident_len(seq);
        self.apply(
            kv,
            &KvOp::Evict {
                seq,
                snapshot: false,
            },
        );
        n
    }

    /// Puts a saved state into the idle sequence `seq` (cleared first),
    /// evicting other idle sequences when the cache lacks room; afterwards the
    /// sequence holds exactly `tokens`, tagged with `context_key` when given,
    /// and a prompt extending them reuses it like any resident prefix.
    pub fn restore_sequence<B: Backend>(
        &mut self,
        kv: &mut B,
        seq: SeqId,
        tokens: &[Token],
        state: &[u8],
        context_key: Option<&str>,
    ) -> Result<(), RestoreError> {
        // What the sequence held goes; a parked prefix stays in the store
        // as a plain snapshot (the sequence may be another slot's).
        self.parked.remove(&seq);
        self.erase_sequence(kv, seq);
        let need = tokens.len() as u32;
        while self.mirror.cells_free() < need {
            let Some(victim) = self.mirror.eviction_victim(&[seq]) else {
                return Err(RestoreError::NoRoom {
                    need: tokens.len(),
                    free: self.mirror.cells_free() as usize,
                });
            };
            let op = KvOp::Evict {
                seq: victim,
                snapshot: self
                    .policy
                    .snapshot_on_evict(self.mirror.resident_len(victim)),
            };
            self.apply(kv, &op);
        }
        if !tokens.is_empty() {
            kv.seq_state_restore(seq, state)
                .map_err(|e| RestoreError::Refused(e.to_string()))?;
        }
        // Recorded as if just decoded: the mirror holds the tokens and the
        // sequence counts as the most recently used.
        self.mirror.record(seq, tokens);
        let e = &mut self.mirror.seqs[seq as usize];
        e.context_key = context_key.map(str::to_string);
        // A slot file holds the base model's KV (saving refuses KV computed
        // under LoRA adapters).
        e.adapters = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_file_reads_back_and_refuses_other_models_and_bad_tokens() {
        let tmp = tempfile::Builder::new()
            .prefix("sipp-slotfile-")
            .tempdir()
            .expect("dir");
        let dir = tmp.path();
        let path = dir.join("a.bin");
        let n = write_slot_file(&path, "model-a", &[1, 2, 3], b"state").expect("write");
        assert_eq!(n, std::fs::metadata(&path).expect("meta").len());
        let f = read_slot_file(&path, "model-a", 10).expect("read");
        assert_eq!(
            (f.tokens, f.state, f.file_bytes),
            (vec![1, 2, 3], b"state".to_vec(), n)
        );
        assert!(matches!(
            read_slot_file(&path, "model-b", 10),
            Err(SlotFileError::OtherModel { .. })
        ));
        assert!(matches!(
            read_slot_file(&path, "model-a", 3),
            Err(SlotFileError::Invalid { .. })
        ));
        assert!(matches!(
            read_slot_file(&dir.join("missing.bin"), "model-a", 10),
            Err(SlotFileError::NotFound(_))
        ));
        std::fs::write(dir.join("junk.bin"), b"not a slot").expect("write");
        assert!(matches!(
            read_slot_file(&dir.join("junk.bin"), "model-a", 10),
            Err(SlotFileError::Invalid { .. })
        ));
    }
}
