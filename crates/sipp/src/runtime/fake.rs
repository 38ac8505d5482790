//! A fake backend in plain Rust, for testing the scheduler and KV bookkeeping
//! without a model.
//!
//! It models what matters to the layers above: a byte-level vocabulary (so
//! multi-byte characters arrive split across tokens), a KV cache of cells tagged
//! with the sequences that hold them (as llama.cpp's unified cache does, so a
//! shared prefix is one set of cells), "logits" that are a deterministic function
//! of a sequence's whole resident history (so reusing a wrong prefix changes the
//! output), and injectable failures.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::{
    logprobs_from_logits, Backend, BatchError, BatchRow, ModelInfo, Pooling, RuntimeError,
    SampleError, Sampled, SamplerSpec, SeqId, Token, Vocab,
};
use crate::sampling::{OutputConstraint, SamplingError};

/// Beginning of sequence.
pub const BOS: Token = 256;
/// End of sequence.
pub const EOS: Token = 257;
/// A token whose presence in a batch makes the batch fail (failure injection).
pub const POISON: Token = 258;
/// An image hash whose image the fake backend fails to compute.
pub const POISON_IMAGE: u64 = 0xBAD_1A6E;
/// Vocabulary size.
pub const N_VOCAB: usize = 259;
/// Width of fake embeddings.
pub const N_EMBD: usize = 8;
/// A grammar text the fake refuses, to test invalid-grammar handling.
pub const INVALID_GRAMMAR: &str = "root ::= (";
/// A grammar text after which the fake's grammar allows nothing (exhaustion).
pub const EXHAUSTING_GRAMMAR: &str = "root ::= \"x\" # exhausts";

/// Characters the fake "model" writes, one or more bytes each.
const ALPHABET: &[&str] = &[
    "a", "b", "c", "d", "e", "n", "o", "s", "t", " ", ".", "é", "日", "🙂",
];

/// The fake vocabulary: one token per byte, plus BOS, EOS and POISON.
#[derive(Debug)]
pub struct FakeVocab {
    info: ModelInfo,
}

impl FakeVocab {
    /// A vocabulary for a decoder (or, with `encoder_only`, an encoder) model.
    pub fn new(n_ctx_train: u32, encoder_only: bool) -> Self {
        Self {
            info: ModelInfo {
                path: "fake".into(),
                takes_images: false,
                decoder_start: None,
                architecture: if encoder_only { "fake-bert" } else { "fake" }.into(),
                name: Some("fake".into()),
                description: "fake byte-level model".into(),
                n_params: 0,
                size_bytes: 0,
                quantization: "none".into(),
                n_ctx_train,
                n_vocab: N_VOCAB,
                n_embd: N_EMBD,
                n_layer: 1,
                bos: Some(BOS),
                eos: Some(EOS),
                eot: None,
                add_bos: true,
                has_decoder: !encoder_only,
                has_encoder: encoder_only,
                pooling: encoder_only.then_some(Pooling::Mean),
                chat_template: None,
                sliding_window: None,
                fingerprint: if encoder_only {
                    "fake-encoder"
                } else {
                    "fake-decoder"
                }
                .into(),
                placement: super::placement::Placement::default(),
                fim: super::FimTokens::default(),
            },
        }
    }
}

impl Vocab for FakeVocab {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, RuntimeError> {
        let mut out = Vec::with_capacity(text.len() + 1);
        if add_special {
            out.push(BOS);
        }
        let bytes = text.as_bytes();
        let specials: [(&[u8], Token); 3] = [(b"<s>", BOS), (b"</s>", EOS), (b"<poison>", POISON)];
        let mut i = 0;
        while i < bytes.len() {
            if parse_special {
                if let Some((lit, tok)) =
                    specials.iter().find(|(lit, _)| bytes[i..].starts_with(lit))
                {
                    out.push(*tok);
                    i += lit.len();
                    continue;
                }
            }
            out.push(Token::from(bytes[i]));
            i += 1;
        }
        Ok(out)
    }

    fn token_bytes(&self, token: Token) -> Vec<u8> {
        match u8::try_from(token) {
            Ok(b) => vec![b],
            Err(_) => Vec::new(),
        }
    }

    fn token_text(&self, token: Token) -> String {
        match token {
            BOS => "<s>".into(),
            EOS => "</s>".into(),
            POISON => "<poison>".into(),
            t => String::from_utf8_lossy(&self.token_bytes(t)).into_owned(),
        }
    }

    fn is_eog(&self, token: Token) -> bool {
        token == EOS
    }

    fn check_constraint(
        &self,
        constraint: &OutputConstraint,
        _bounds: &crate::sampling::JsonBounds,
    ) -> Result<(), SamplingError> {
        match constraint {
            OutputConstraint::Grammar(g) if g == INVALID_GRAMMAR => {
                Err(SamplingError::Grammar("parse error at `(`".into()))
            }
            _ => Ok(()),
        }
    }
}

/// Settings of a fake backend.
#[derive(Debug, Clone)]
pub struct FakeConfig {
    /// KV cells.
    pub n_ctx: u32,
    /// Sequences.
    pub n_seq_max: u32,
    /// Largest batch.
    pub n_batch: u32,
    /// Largest micro-batch.
    pub n_ubatch: u32,
    /// Behave as an encoder-only embedding model.
    pub encoder_only: bool,
    /// Produce embeddings with this pooling.
    pub embeddings: Option<Pooling>,
    /// One EOS in this many generated tokens (on average); 0 never.
    pub eos_one_in: u64,
    /// The model's chat template (`tokenizer.chat_template`); none by default,
    /// so chat requests fail as they do on a model without one.
    pub chat_template: Option<String>,
    /// Predict from the last this-many tokens only (0: the whole history).
    /// A short window makes text that repeats itself, which n-gram drafts
    /// can predict.
    pub window: usize,
    /// Time each decode takes (none by default), so the requests a test
    /// submits one after another overlap however its thread is scheduled.
    pub step_delay: std::time::Duration,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            n_ctx: 4096,
            n_seq_max: 16,
            n_batch: 64,
            n_ubatch: 64,
            encoder_only: false,
            embeddings: None,
            eos_one_in: 40,
            chat_template: None,
            window: 0,
            step_delay: std::time::Duration::ZERO,
        }
    }
}

#[derive(Debug, Clone)]
struct Cell {
    pos: u32,
    token: Token,
    seqs: BTreeSet<SeqId>,
    /// The key of the adapter set it was computed under (0: none).
    adapter: u64,
}

/// A fake sampler: greedy or seeded, with a toy grammar stand-in.
#[derive(Debug)]
pub struct FakeSampler {
    greedy: bool,
    rng: u64,
    exhausting: bool,
    accepted: usize,
}

/// The fake backend.
#[derive(Debug)]
pub struct FakeBackend {
    cfg: FakeConfig,
    vocab: Arc<FakeVocab>,
    cells: Vec<Option<Cell>>,
    outputs: Vec<Option<Vec<f32>>>,
    row_seqs: Vec<SeqId>,
    seq_embeddings: std::collections::HashMap<SeqId, Vec<f32>>,
    /// Batches run so far (for tests).
    pub batches: u64,
    /// Images computed (`decode_media` calls).
    pub media_batches: u64,
    /// The largest batch seen (for tests).
    pub max_batch_rows: usize,
    /// Fail the next this-many batches with "no KV space" (failure injection).
    pub inject_no_kv: u32,
    /// The adapter set applied (any set is accepted: the fake has adapters
    /// of every id).
    pub adapters: crate::runtime::AdapterSet,
    /// Batches that ran under each adapter key (for tests).
    pub adapter_batches: std::collections::HashMap<u64, u64>,
}

impl FakeBackend {
    /// A fake backend with these settings.
    pub fn new(cfg: FakeConfig) -> Self {
        let mut vocab = FakeVocab::new(cfg.n_ctx, cfg.encoder_only);
        vocab.info.chat_template = cfg.chat_template.clone();
        let vocab = Arc::new(vocab);
        Self {
            cells: vec![None; cfg.n_ctx as usize],
            cfg,
            vocab,
            outputs: Vec::new(),
            row_seqs: Vec::new(),
            seq_embeddings: std::collections::HashMap::new(),
            batches: 0,
            media_batches: 0,
            max_batch_rows: 0,
            inject_no_kv: 0,
            adapters: crate::runtime::AdapterSet::none(),
            adapter_batches: std::collections::HashMap::new(),
        }
    }

    /// The tokens a sequence holds, by position. Panics if positions have gaps:
    /// a gap means the layers above corrupted the sequence.
    pub fn seq_tokens(&self, seq: SeqId) -> Vec<Token> {
        let mut cells: Vec<(u32, Token)> = self
            .cells
            .iter()
            .flatten()
            .filter(|c| c.seqs.contains(&seq))
            .map(|c| (c.pos, c.token))
            .collect();
        cells.sort_unstable();
        for (i, (pos, _)) in cells.iter().enumerate() {
            assert_eq!(
                *pos as usize, i,
                "sequence {seq} has a gap or duplicate at position {pos}"
            );
        }
        cells.into_iter().map(|(_, t)| t).collect()
    }

    /// Cells in use.
    pub fn used_cells(&self) -> u32 {
        self.cells.iter().flatten().count() as u32
    }

    fn seq_len(&self, seq: SeqId) -> u32 {
        self.cells
            .iter()
            .flatten()
            .filter(|c| c.seqs.contains(&seq))
            .count() as u32
    }

    /// The fake model's most likely next token after a history (sampling
    /// takes it three times in four, the runner-up otherwise).
    pub fn most_likely(&self, history: &[Token]) -> Token {
        self.predict(history).0
    }

    /// [`Self::most_likely`] under an adapter set (the history computed
    /// under it too).
    pub fn most_likely_with(&self, history: &[Token], set: &crate::runtime::AdapterSet) -> Token {
        let key = set.key();
        let salt = (0..history.len() as u32).fold(0u64, |s, pos| s ^ Self::cell_salt(pos, key));
        self.predict_salted(history, salt).0
    }

    /// What a cell computed under adapter key `key` at `pos` adds to its
    /// sequence's salt (nothing without adapters).
    fn cell_salt(pos: u32, key: u64) -> u64 {
        if key == 0 {
            0
        } else {
            key.rotate_left(pos % 64) ^ u64::from(pos)
        }
    }

    /// The fake LoRA: each cell of a sequence computed under adapters salts
    /// what the model predicts, as KV computed under other weights would.
    fn adapter_salt(&self, seq: SeqId) -> u64 {
        self.cells
            .iter()
            .flatten()
            .filter(|c| c.seqs.contains(&seq))
            .fold(0, |s, c| s ^ Self::cell_salt(c.pos, c.adapter))
    }

    fn predict(&self, history: &[Token]) -> (Token, Token) {
        self.predict_salted(history, 0)
    }

    /// The fake model: the next token after a history, and its runner-up.
    fn predict_salted(&self, history: &[Token], salt: u64) -> (Token, Token) {
        // Finish a multi-byte character that the history has started.
        let bytes: Vec<u8> = history
            .iter()
            .filter_map(|&t| u8::try_from(t).ok())
            .collect();
        let tail = bytes.len().saturating_sub(4);
        if let Err(e) = std::str::from_utf8(&bytes[tail..]) {
            if e.error_len().is_none() {
                let start = tail + e.valid_up_to();
                let lead = bytes[start];
                let ch = ALPHABET
                    .iter()
                    .find(|s| s.as_bytes()[0] == lead)
                    .map_or("é", |s| *s);
                let have = bytes.len() - start;
                if let Some(&b) = ch.as_bytes().get(have) {
                    return (Token::from(b), Token::from(b'a'));
                }
            }
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ salt;
        let from = match self.cfg.window {
            0 => 0,
            w => history.len().saturating_sub(w),
        };
        for &t in &history[from..] {
            h ^= t as u64 as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= h >> 29;
        if self.cfg.eos_one_in > 0 && h % self.cfg.eos_one_in == 0 {
            return (EOS, Token::from(b'e'));
        }
        let i = (h / 7) as usize % ALPHABET.len();
        let j = (i + 1 + (h / 11) as usize % (ALPHABET.len() - 1)) % ALPHABET.len();
        let (first, second) = (ALPHABET[i], ALPHABET[j]);
        (
            Token::from(first.as_bytes()[0]),
            Token::from(second.as_bytes()[0]),
        )
    }

    /// The fake LoRA on embeddings: the applied set shifts the vector.
    fn adapted(&self, mut v: Vec<f32>) -> Vec<f32> {
        let key = self.adapters.key();
        if key != 0 {
            v[0] += 1.0 + (key % 1000) as f32 / 1000.0;
        }
        v
    }

    fn fake_embedding(tokens: &[Token]) -> Vec<f32> {
        let mut v = vec![0.0f32; N_EMBD];
        for &t in tokens {
            for (k, x) in v.iter_mut().enumerate() {
                *x += ((t as f32 + 1.0) * (k as f32 + 1.0) * 0.37).sin();
            }
        }
        let n = tokens.len().max(1) as f32;
        v.iter_mut().for_each(|x| *x /= n);
        v
    }

    fn check_batch(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.max_batch_rows = self.max_batch_rows.max(rows.len());
        if rows.is_empty() {
            return Err(BatchError::Failed(-1));
        }
        assert!(
            rows.len() <= self.cfg.n_batch as usize,
            "batch of {} rows exceeds n_batch",
            rows.len()
        );
        if rows.iter().any(|r| r.token == POISON) {
            return Err(BatchError::Failed(-3));
        }
        Ok(())
    }
}

impl Backend for FakeBackend {
    type Sampler = FakeSampler;

    fn vocab(&self) -> Arc<dyn Vocab> {
        self.vocab.clone()
    }

    fn n_ctx(&self) -> u32 {
        self.cfg.n_ctx
    }

    fn n_seq_max(&self) -> u32 {
        self.cfg.n_seq_max
    }

    fn n_batch(&self) -> u32 {
        self.cfg.n_batch
    }

    fn n_ubatch(&self) -> u32 {
        self.cfg.n_ubatch
    }

    fn embedding_pooling(&self) -> Option<Pooling> {
        if self.cfg.encoder_only {
            Some(self.cfg.embeddings.unwrap_or(Pooling::Mean))
        } else {
            self.cfg.embeddings
        }
    }

    fn set_adapters(&mut self, set: &crate::runtime::AdapterSet) -> Result<(), RuntimeError> {
        self.adapters = set.clone();
        Ok(())
    }

    fn decode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.check_batch(rows)?;
        if !self.cfg.step_delay.is_zero() {
            std::thread::sleep(self.cfg.step_delay);
        }
        self.batches += 1;
        *self.adapter_batches.entry(self.adapters.key()).or_insert(0) += 1;
        if self.inject_no_kv > 0 {
            self.inject_no_kv -= 1;
            return Err(BatchError::NoKvSpace);
        }
        let free = self.cells.iter().filter(|c| c.is_none()).count();
        if free < rows.len() {
            return Err(BatchError::NoKvSpace);
        }
        // Positions must continue each sequence without gaps, as llama.cpp's
        // position checks require.
        let mut next: std::collections::HashMap<SeqId, u32> = std::collections::HashMap::new();
        for r in rows {
            let expected = *next.entry(r.seq).or_insert_with(|| self.seq_len(r.seq));
            assert_eq!(
                r.pos, expected,
                "sequence {} gets position {} but holds {} tokens",
                r.seq, r.pos, expected
            );
            next.insert(r.seq, expected + 1);
        }
        self.outputs.clear();
        self.row_seqs.clear();
        let mut free_iter = (0..self.cells.len())
            .filter(|&i| self.cells[i].is_none())
            .collect::<Vec<_>>()
            .into_iter();
        for r in rows {
            let idx = free_iter.next().expect("free cells were counted");
            self.cells[idx] = Some(Cell {
                pos: r.pos,
                token: r.token,
                seqs: BTreeSet::from([r.seq]),
                adapter: self.adapters.key(),
            });
            self.row_seqs.push(r.seq);
            if r.output {
                let history = self.seq_tokens(r.seq);
                let (best, second) = self.predict_salted(&history, self.adapter_salt(r.seq));
                let mut logits = vec![-10.0f32; N_VOCAB];
                logits[second as usize] = 5.0;
                logits[best as usize] = 10.0;
                self.outputs.push(Some(logits));
                if self.cfg.embeddings.is_some() {
                    self.seq_embeddings
                        .insert(r.seq, self.adapted(Self::fake_embedding(&history)));
                }
            } else {
                self.outputs.push(None);
            }
        }
        Ok(())
    }

    fn decode_media(
        &mut self,
        seq: SeqId,
        pos: u32,
        chunk: &super::MediaChunk,
    ) -> Result<(), BatchError> {
        // An image is its placeholder tokens to the fake, computed like a
        // prompt chunk with no output row.
        self.media_batches += 1;
        if chunk.hash == POISON_IMAGE {
            return Err(BatchError::Failed(-4));
        }
        let rows: Vec<BatchRow> = crate::media::placeholder_tokens(chunk.hash, chunk.n_tokens)
            .into_iter()
            .enumerate()
            .map(|(i, token)| BatchRow {
                token,
                pos: pos + i as u32,
                seq,
                output: false,
            })
            .collect();
        // In batches of at most n_batch rows, as libmtmd's helper decodes.
        let batches = self.batches;
        let n = (self.cfg.n_batch as usize).max(1);
        let r = rows.chunks(n).try_for_each(|c| self.decode(c));
        self.batches = batches;
        r
    }

    fn encode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.check_batch(rows)?;
        self.batches += 1;
        self.outputs.clear();
        self.row_seqs.clear();
        self.seq_embeddings.clear();
        let mut per_seq: std::collections::BTreeMap<SeqId, Vec<Token>> =
            std::collections::BTreeMap::new();
        for r in rows {
            per_seq.entry(r.seq).or_default().push(r.token);
            self.row_seqs.push(r.seq);
            self.outputs.push(None);
        }
        for (seq, toks) in per_seq {
            let e = self.adapted(Self::fake_embedding(&toks));
            self.seq_embeddings.insert(seq, e);
        }
        Ok(())
    }

    fn logits(&self, row: usize) -> &[f32] {
        self.outputs
            .get(row)
            .and_then(Option::as_deref)
            .expect("logits asked for a row that had no output")
    }

    fn embedding(&self, seq: SeqId, _row: usize) -> Option<Vec<f32>> {
        self.seq_embeddings.get(&seq).cloned()
    }

    fn new_sampler(&self, spec: SamplerSpec<'_>) -> Result<Self::Sampler, SamplingError> {
        if let Some(c) = spec.constraint {
            self.vocab.check_constraint(c, &spec.params.json_bounds)?;
        }
        let exhausting = matches!(spec.constraint, Some(OutputConstraint::Grammar(g)) if g == EXHAUSTING_GRAMMAR);
        Ok(FakeSampler {
            greedy: spec.params.is_greedy(),
            rng: u64::from(spec.seed) | 1,
            exhausting,
            accepted: 0,
        })
    }

    fn reset_sampler(
        &self,
        sampler: &mut Self::Sampler,
        spec: SamplerSpec<'_>,
    ) -> Result<(), SamplingError> {
        *sampler = self.new_sampler(spec)?;
        Ok(())
    }

    fn sampler_accept_prompt(&self, _sampler: &mut Self::Sampler, _tokens: &[Token]) {}

    fn sample(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        top_logprobs: Option<usize>,
    ) -> Result<Sampled, SampleError> {
        if sampler.exhausting && sampler.accepted >= 3 {
            return Err(SampleError::GrammarExhausted);
        }
        let logits = self.logits(row);
        let argmax = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as Token);
        let token = if sampler.greedy {
            argmax
        } else {
            sampler.rng ^= sampler.rng << 13;
            sampler.rng ^= sampler.rng >> 7;
            sampler.rng ^= sampler.rng << 17;
            // Take the runner-up one time in four.
            if sampler.rng % 4 == 0 {
                logits
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i as Token != argmax)
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(argmax, |(i, _)| i as Token)
            } else {
                argmax
            }
        };
        sampler.accepted += 1;
        let logprobs = top_logprobs.map(|n| logprobs_from_logits(logits, token, n));
        Ok(Sampled { token, logprobs })
    }

    fn accept_forced(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        token: Token,
        top_logprobs: Option<usize>,
    ) -> Sampled {
        sampler.accepted += 1;
        let logprobs = top_logprobs.map(|n| logprobs_from_logits(self.logits(row), token, n));
        Sampled { token, logprobs }
    }

    fn kv_truncate(&mut self, seq: SeqId, from: u32) {
        for slot in &mut self.cells {
            if let Some(c) = slot {
                if c.pos >= from && c.seqs.remove(&seq) && c.seqs.is_empty() {
                    *slot = None;
                }
            }
        }
    }

    fn kv_share_prefix(&mut self, src: SeqId, dst: SeqId, len: u32) {
        assert_eq!(
            self.seq_len(dst),
            0,
            "prefix shared into non-empty sequence {dst}"
        );
        for c in self.cells.iter_mut().flatten() {
            if c.pos < len && c.seqs.contains(&src) {
                c.seqs.insert(dst);
            }
        }
    }

    fn kv_cells_used(&self) -> Option<u32> {
        Some(self.used_cells())
    }

    fn kv_clear(&mut self) {
        self.cells.iter_mut().for_each(|c| *c = None);
    }

    fn kv_seq_positions(&self, seq: SeqId) -> Option<(u32, u32)> {
        let positions = || {
            self.cells
                .iter()
                .flatten()
                .filter(|c| c.seqs.contains(&seq))
                .map(|c| c.pos)
        };
        Some((positions().min()?, positions().max()?))
    }

    fn seq_state_save(&mut self, seq: SeqId) -> Vec<u8> {
        let mut out = b"FAKESEQ1".to_vec();
        for t in self.seq_tokens(seq) {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out
    }

    fn seq_state_restore(&mut self, seq: SeqId, state: &[u8]) -> Result<(), RuntimeError> {
        let body = state
            .strip_prefix(b"FAKESEQ1")
            .filter(|b| b.len() % 4 == 0)
            .ok_or_else(|| RuntimeError::StateRestore("not a fake sequence state".into()))?;
        assert_eq!(
            self.seq_len(seq),
            0,
            "state restored into non-empty sequence {seq}"
        );
        let tokens: Vec<Token> = body
            .chunks_exact(4)
            .map(|c| Token::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let free: Vec<usize> = (0..self.cells.len())
            .filter(|&i| self.cells[i].is_none())
            .collect();
        if free.len() < tokens.len() {
            return Err(RuntimeError::StateRestore("no KV space".into()));
        }
        for (pos, (&idx, &token)) in free.iter().zip(&tokens).enumerate() {
            self.cells[idx] = Some(Cell {
                pos: pos as u32,
                token,
                seqs: BTreeSet::from([seq]),
                adapter: 0,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(seq: SeqId, start: u32, toks: &[Token]) -> Vec<BatchRow> {
        toks.iter()
            .enumerate()
            .map(|(i, &t)| BatchRow {
                token: t,
                pos: start + i as u32,
                seq,
                output: i + 1 == toks.len(),
            })
            .collect()
    }

    #[test]
    fn shared_prefix_is_one_set_of_cells_and_survives_source_truncation() {
        let mut b = FakeBackend::new(FakeConfig::default());
        b.decode(&rows(0, 0, &[1, 2, 3, 4])).expect("decode");
        b.kv_share_prefix(0, 1, 3);
        assert_eq!(b.used_cells(), 4);
        assert_eq!(b.seq_tokens(1), vec![1, 2, 3]);
        b.kv_truncate(0, 0);
        assert_eq!(b.seq_tokens(1), vec![1, 2, 3]);
        assert_eq!(b.used_cells(), 3);
    }

    #[test]
    fn output_depends_on_whole_history() {
        let mut b = FakeBackend::new(FakeConfig {
            eos_one_in: 0,
            ..Default::default()
        });
        let mut outputs = std::collections::HashSet::new();
        for first in 0..10 {
            b.decode(&rows(first, 0, &[first + 20, 2, 3]))
                .expect("decode");
            outputs.insert(
                b.logits(2)
                    .to_vec()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
            );
        }
        assert!(
            outputs.len() > 1,
            "changing only the first token never changed the output"
        );
    }

    #[test]
    fn state_round_trips() {
        let mut b = FakeBackend::new(FakeConfig::default());
        b.decode(&rows(2, 0, &[5, 6, 7])).expect("decode");
        let s = b.seq_state_save(2);
        b.kv_truncate(2, 0);
        b.seq_state_restore(3, &s).expect("restore");
        assert_eq!(b.seq_tokens(3), vec![5, 6, 7]);
        assert!(b.seq_state_restore(4, b"garbage").is_err());
    }

    #[test]
    fn tokenizer_is_bytes_with_specials() {
        let v = FakeVocab::new(100, false);
        let t = v.tokenize("é<poison>", true, true).expect("tokenize");
        assert_eq!(t, vec![BOS, 0xC3, 0xA9, POISON]);
        assert_eq!(v.detokenize(&t), "é");
    }
}
