//! Slot persistence, as llama-server's `POST /slots/{id}?action=save|restore|erase`:
//! a slot's KV (or a `context_key` session's) saved to a file, erased, and
//! restored, so a conversation continues later, or on another server with the
//! same model, without recomputing its prompt.
//!
//! A sipp slot is a worker that leases whichever KV sequence admission picks,
//! so "a slot's KV" is the sequence its latest request used, for as long as
//! no other request has leased that sequence since (its lease generation
//! tells). The state moves in and out of llama.cpp on the engine thread
//! between steps, never while the sequence is leased; the file is read and
//! written on the caller's thread.

use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

use super::{Command, Engine};
use crate::runtime::{Backend, SeqId, Token};
use crate::scheduler::{Admission, Slot};
use crate::session::{
    read_slot_file, write_slot_file, KvSessions, RestoreError, SeqLease, SlotFileError,
};

/// Whose KV a slot action works on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvHolder {
    /// A slot, by its index (GET /slots' `id`): the sequence its latest
    /// request used.
    Slot(usize),
    /// The sequence a native-profile conversation with this `context_key`
    /// is pinned to.
    Session(String),
}

impl std::fmt::Display for KvHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvHolder::Slot(i) => write!(f, "slot {i}"),
            KvHolder::Session(k) => write!(f, "the session with context_key `{k}`"),
        }
    }
}

/// Why a slot action failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotActionError {
    /// The slot index is out of range.
    #[error("slot {id} does not exist: this model has {slots} slots (ids 0 to {})", slots.saturating_sub(1))]
    NoSuchSlot {
        /// The index asked for.
        id: usize,
        /// Slots the model has.
        slots: usize,
    },
    /// The slot or session is serving a request (or, on restore, every KV
    /// sequence is).
    #[error("{0} is processing a request; try again once it is idle")]
    Busy(String),
    /// Nothing resident to save.
    #[error("{0} holds no KV to save")]
    Empty(String),
    /// Its KV was computed under LoRA adapters, which a slot file does not
    /// record (it would come back as the base model's).
    #[error("{0} holds KV computed under LoRA adapters, which cannot be saved (a slot file holds the base model's KV only)")]
    Adapters(String),
    /// The file could not be written, read or used.
    #[error(transparent)]
    File(#[from] SlotFileError),
    /// The state could not be put back.
    #[error("restoring {holder}: {error}")]
    Restore {
        /// The slot or session.
        holder: String,
        /// What went wrong.
        error: RestoreError,
    },
    /// The engine thread is not running.
    #[error("the engine has stopped")]
    EngineStopped,
}

/// A save's outcome (llama-server's answer fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvSaved {
    /// Tokens saved.
    pub n_saved: usize,
    /// Bytes written.
    pub n_written: u64,
    /// Milliseconds, waiting for the engine included.
    pub save_ms: f64,
}

/// A restore's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvRestored {
    /// Tokens restored.
    pub n_restored: usize,
    /// Bytes read.
    pub n_read: u64,
    /// Milliseconds, waiting for the engine included.
    pub restore_ms: f64,
}

/// An erase's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvErased {
    /// Tokens erased.
    pub n_erased: usize,
}

type Reply<T> = mpsc::Sender<Result<T, SlotActionError>>;

/// A slot action for the engine thread, with where its answer goes.
pub(super) enum SlotAction {
    Save(KvHolder, Reply<(Vec<Token>, Vec<u8>)>),
    Restore(KvHolder, Vec<Token>, Vec<u8>, Reply<usize>),
    Erase(KvHolder, Reply<usize>),
}

impl std::fmt::Debug for SlotAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotAction::Save(h, _) => write!(f, "Save({h})"),
            SlotAction::Restore(h, t, _, _) => write!(f, "Restore({h}, {} tokens)", t.len()),
            SlotAction::Erase(h, _) => write!(f, "Erase({h})"),
        }
    }
}

impl Engine {
    /// Saves a slot's or session's KV to `path` (tokens, state and the
    /// model's fingerprint). Blocks until the engine reaches a step boundary
    /// and the file is written.
    pub fn save_kv(&self, holder: &KvHolder, path: &Path) -> Result<KvSaved, SlotActionError> {
        let started = Instant::now();
        self.check_holder(holder)?;
        let (tokens, state) = self.ask(|r| SlotAction::Save(holder.clone(), r))?;
        let n_written = write_slot_file(path, &self.info().model.fingerprint, &tokens, &state)?;
        Ok(KvSaved {
            n_saved: tokens.len(),
            n_written,
            save_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Restores a file written by [`Engine::save_kv`] on this model into a
    /// slot or session (replacing what it held): a following prompt that
    /// extends the restored tokens reuses their KV. A file from another model
    /// is refused.
    pub fn restore_kv(
        &self,
        holder: &KvHolder,
        path: &Path,
    ) -> Result<KvRestored, SlotActionError> {
        let started = Instant::now();
        self.check_holder(holder)?;
        let info = &self.info().model;
        let file = read_slot_file(path, &info.fingerprint, info.n_vocab)?;
        let n_read = file.file_bytes;
        let n_restored =
            self.ask(|r| SlotAction::Restore(holder.clone(), file.tokens, file.state, r))?;
        Ok(KvRestored {
            n_restored,
            n_read,
            restore_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Erases a slot's or session's KV: no later request reuses it.
    pub fn erase_kv(&self, holder: &KvHolder) -> Result<KvErased, SlotActionError> {
        self.check_holder(holder)?;
        let n_erased = self.ask(|r| SlotAction::Erase(holder.clone(), r))?;
        Ok(KvErased { n_erased })
    }

    /// A slot index in range.
    fn check_holder(&self, holder: &KvHolder) -> Result<(), SlotActionError> {
        let slots = self.info().slots;
        match holder {
            KvHolder::Slot(id) if *id >= slots => {
                Err(SlotActionError::NoSuchSlot { id: *id, slots })
            }
            _ => Ok(()),
        }
    }

    fn ask<T>(&self, action: impl FnOnce(Reply<T>) -> SlotAction) -> Result<T, SlotActionError> {
        let (tx, rx) = mpsc::channel();
        self.inner
            .commands
            .send(Command::Slot(action(tx)))
            .map_err(|_| SlotActionError::EngineStopped)?;
        rx.recv().map_err(|_| SlotActionError::EngineStopped)?
    }
}

/// Which sequence each slot's latest request leased, kept by the engine
/// core; a pair whose generation is no longer the sequence's means another
/// request took the sequence since, and the slot holds nothing.
#[derive(Debug)]
pub(super) struct SlotSequences {
    held: Vec<Option<SeqLease>>,
}

impl SlotSequences {
    pub(super) fn new(slots: usize) -> Self {
        Self {
            held: vec![None; slots],
        }
    }

    /// Remembers the leases of a step's admissions.
    pub(super) fn note(&mut self, admissions: &[Admission]) {
        for a in admissions {
            if let Some(h) = self.held.get_mut(a.slot) {
                *h = Some(a.lease);
            }
        }
    }

    /// Carries out a slot action between steps and sends its answer.
    pub(super) fn run<B: Backend>(
        &mut self,
        slots: &[Slot],
        kv: &mut KvSessions,
        backend: &mut B,
        action: SlotAction,
    ) {
        match action {
            SlotAction::Save(h, reply) => {
                let r = self.save(&h, slots, kv, backend);
                let _ = reply.send(r);
            }
            SlotAction::Restore(h, tokens, state, reply) => {
                let r = self.restore(&h, slots, kv, backend, &tokens, &state);
                let _ = reply.send(r.map(|()| tokens.len()));
            }
            SlotAction::Erase(h, reply) => {
                let r = self.erase(&h, slots, kv, backend);
                let _ = reply.send(r);
            }
        }
    }

    /// The idle sequences a slot or session holds (a slot: at most one).
    fn sequences(
        &self,
        holder: &KvHolder,
        slots: &[Slot],
        kv: &KvSessions,
    ) -> Result<Vec<SeqId>, SlotActionError> {
        let busy = || SlotActionError::Busy(holder.to_string());
        match holder {
            KvHolder::Slot(i) => {
                let slot = slots.get(*i).ok_or(SlotActionError::NoSuchSlot {
                    id: *i,
                    slots: slots.len(),
                })?;
                if slot.phase().is_busy() {
                    return Err(busy());
                }
                Ok(self.held[*i]
                    .filter(|l| {
                        kv.lease_generation(l.seq_id) == l.lease_generation
                            && !kv.is_leased(l.seq_id)
                    })
                    .map(|l| l.seq_id)
                    .into_iter()
                    .collect())
            }
            KvHolder::Session(key) => {
                let seqs = kv.sequences_with_key(key);
                if seqs.iter().any(|&s| kv.is_leased(s)) {
                    return Err(busy());
                }
                Ok(seqs)
            }
        }
    }

    fn save<B: Backend>(
        &self,
        holder: &KvHolder,
        slots: &[Slot],
        kv: &mut KvSessions,
        backend: &mut B,
    ) -> Result<(Vec<Token>, Vec<u8>), SlotActionError> {
        let seq = self
            .sequences(holder, slots, kv)?
            .into_iter()
            .filter(|&s| kv.held_len(s) > 0)
            .max_by_key(|&s| kv.held_len(s))
            .ok_or_else(|| SlotActionError::Empty(holder.to_string()))?;
        if kv.mirror().adapters_of(seq) != 0 {
            return Err(SlotActionError::Adapters(holder.to_string()));
        }
        kv.save_sequence(backend, seq)
            .ok_or_else(|| SlotActionError::Empty(holder.to_string()))
    }

    fn erase<B: Backend>(
        &self,
        holder: &KvHolder,
        slots: &[Slot],
        kv: &mut KvSessions,
        backend: &mut B,
    ) -> Result<usize, SlotActionError> {
        let seqs = self.sequences(holder, slots, kv)?;
        Ok(seqs
            .into_iter()
            .map(|s| kv.erase_sequence(backend, s))
            .sum())
    }

    fn restore<B: Backend>(
        &mut self,
        holder: &KvHolder,
        slots: &[Slot],
        kv: &mut KvSessions,
        backend: &mut B,
        tokens: &[Token],
        state: &[u8],
    ) -> Result<(), SlotActionError> {
        let held = self.sequences(holder, slots, kv)?;
        // A session's other sequences go: the restored one is its only one.
        for &s in held.iter().skip(1) {
            kv.erase_sequence(backend, s);
        }
        let seq = match held.first() {
            Some(&s) => s,
            None => kv
                .sequence_for_restore()
                .ok_or_else(|| SlotActionError::Busy("every KV sequence".into()))?,
        };
        // The sequence is this holder's now, no longer another slot's.
        for h in &mut self.held {
            if h.is_some_and(|l| l.seq_id == seq) {
                *h = None;
            }
        }
        let key = match holder {
            KvHolder::Session(k) => Some(k.as_str()),
            KvHolder::Slot(_) => None,
        };
        kv.restore_sequence(backend, seq, tokens, state, key)
            .map_err(|error| SlotActionError::Restore {
                holder: holder.to_string(),
                error,
            })?;
        if let KvHolder::Slot(i) = holder {
            self.held[*i] = Some(SeqLease {
                seq_id: seq,
                lease_generation: kv.lease_generation(seq),
            });
        }
        Ok(())
    }
}
