//! Prefix snapshots: the KV state of an evicted sequence, kept in an in-memory
//! LRU bounded by bytes and entries, optionally spilled to a directory.
//!
//! A spill file carries the model's fingerprint, the tokens and a hash of them;
//! a file whose size, model or hash is wrong is ignored with a warning.

use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

use super::CacheStats;
use crate::config::CacheConfig;
use crate::runtime::Token;

const MAGIC: &[u8; 8] = b"SIPPKV01";

#[derive(Debug)]
struct Snapshot {
    tokens: Vec<Token>,
    state: Vec<u8>,
    last_used: u64,
}

#[derive(Debug)]
struct Spilled {
    path: PathBuf,
    tokens: Vec<Token>,
    /// The state while the writer thread still holds it: a restore in the
    /// meantime reads it from here, not from a half-written file.
    pending: Option<Arc<Vec<u8>>>,
}

/// What the writer thread does, in order.
enum SpillJob {
    Write {
        path: PathBuf,
        fingerprint: Arc<str>,
        tokens: Vec<Token>,
        state: Arc<Vec<u8>>,
    },
    Remove(PathBuf),
}

/// Disk writes of spilled snapshots, off the engine thread: a slow disk
/// never stalls decoding. Dropping it waits for the queued writes.
#[derive(Debug)]
struct SpillWriter {
    jobs: Option<mpsc::Sender<SpillJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SpillWriter {
    fn start() -> Self {
        let (tx, rx) = mpsc::channel::<SpillJob>();
        let thread = std::thread::Builder::new()
            .name("sipp-kv-spill".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        SpillJob::Write {
                            path,
                            fingerprint,
                            tokens,
                            state,
                        } => {
                            if let Err(e) = write_spill(&path, &fingerprint, &tokens, &state) {
                                tracing::warn!(
                                    "could not spill snapshot to {}: {e}",
                                    path.display()
                                );
                            }
                        }
                        SpillJob::Remove(path) => {
                            let _ = std::fs::remove_file(path);
                        }
                    }
                }
            })
            .ok();
        Self {
            jobs: thread.as_ref().map(|_| tx),
            thread,
        }
    }

    fn send(&self, job: SpillJob) {
        match &self.jobs {
            Some(tx) => {
                let _ = tx.send(job);
            }
            None => tracing::warn!("the snapshot writer thread is not running"),
        }
    }
}

impl Drop for SpillWriter {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The parsed header of a spill file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillHeader {
    /// Fingerprint of the model that wrote it.
    pub model_fingerprint: String,
    /// The tokens the state holds.
    pub tokens: Vec<Token>,
    /// sha256 of the tokens as stored.
    pub token_hash: [u8; 32],
    /// Length of the state that follows.
    pub state_len: u64,
    /// Where the state starts in the file.
    pub state_offset: u64,
}

fn token_hash(tokens: &[Token]) -> [u8; 32] {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The file name of a spilled snapshot: a hash of its tokens.
fn spill_name(tokens: &[Token]) -> String {
    format!("{}.sippkv", hex::encode(&token_hash(tokens)[..12]))
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Writes a spill file.
pub fn write_spill(
    path: &Path,
    fingerprint: &str,
    tokens: &[Token],
    state: &[u8],
) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(MAGIC)?;
        f.write_all(&(fingerprint.len() as u32).to_le_bytes())?;
        f.write_all(fingerprint.as_bytes())?;
        f.write_all(&(tokens.len() as u32).to_le_bytes())?;
        for t in tokens {
            f.write_all(&t.to_le_bytes())?;
        }
        f.write_all(&token_hash(tokens))?;
        f.write_all(&(state.len() as u64).to_le_bytes())?;
        f.write_all(state)?;
        f.flush()?;
    }
    std::fs::rename(tmp, path)
}

/// Reads and checks a spill file's header against the file's size.
pub fn read_spill_header(path: &Path) -> Result<SpillHeader, String> {
    let size = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    let mut f = std::io::BufReader::new(std::fs::File::open(path).map_err(|e| e.to_string())?);
    let mut read = |n: usize| -> Result<Vec<u8>, String> {
        let mut b = vec![0u8; n];
        f.read_exact(&mut b)
            .map_err(|_| "file is truncated".to_string())?;
        Ok(b)
    };
    if read(8)?.as_slice() != MAGIC {
        return Err("not a sipp snapshot file".into());
    }
    let u32_at = |b: Vec<u8>| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let fp_len = u32_at(read(4)?) as u64;
    if fp_len > 1024 {
        return Err("corrupt header".into());
    }
    let model_fingerprint = String::from_utf8_lossy(&read(fp_len as usize)?).into_owned();
    let n_tokens = u32_at(read(4)?) as u64;
    if 8 + 4 + fp_len + 4 + n_tokens * 4 > size {
        return Err("file is truncated".into());
    }
    let raw = read(n_tokens as usize * 4)?;
    let tokens: Vec<Token> = raw
        .chunks_exact(4)
        .map(|c| Token::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&read(32)?);
    let mut len = [0u8; 8];
    len.copy_from_slice(&read(8)?);
    let state_len = u64::from_le_bytes(len);
    let state_offset = 8 + 4 + fp_len + 4 + n_tokens * 4 + 32 + 8;
    if state_offset + state_len != size {
        return Err(format!(
            "size mismatch: header says {} bytes, file has {size}",
            state_offset + state_len
        ));
    }
    if token_hash(&tokens) != hash {
        return Err("token hash mismatch".into());
    }
    Ok(SpillHeader {
        model_fingerprint,
        tokens,
        token_hash: hash,
        state_len,
        state_offset,
    })
}

/// The snapshot LRU.
#[derive(Debug)]
pub struct SnapshotStore {
    entries: Vec<Snapshot>,
    spilled: Vec<Spilled>,
    bytes: u64,
    max_bytes: u64,
    max_entries: usize,
    spill_dir: Option<PathBuf>,
    writer: Option<SpillWriter>,
    fingerprint: Arc<str>,
    tick: u64,
}

impl SnapshotStore {
    /// A store with the cache config's budgets; indexes the spill directory,
    /// refusing files from other models.
    pub fn new(cache: &CacheConfig, fingerprint: &str, stats: &mut CacheStats) -> Self {
        let mut store = Self {
            entries: Vec::new(),
            spilled: Vec::new(),
            bytes: 0,
            max_bytes: cache.max_snapshot_bytes,
            max_entries: cache.max_snapshot_entries as usize,
            spill_dir: cache.snapshot_dir.clone(),
            writer: None,
            fingerprint: fingerprint.into(),
            tick: 0,
        };
        if let Some(dir) = store.spill_dir.clone() {
            if let Err(e) = std::fs::create_dir_all(&dir) {
                tracing::warn!("snapshot directory {} is unusable: {e}", dir.display());
                store.spill_dir = None;
            } else {
                store.index_dir(&dir, stats);
                store.writer = Some(SpillWriter::start());
            }
        }
        store
    }

    fn index_dir(&mut self, dir: &Path, stats: &mut CacheStats) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("sippkv") {
                continue;
            }
            match read_spill_header(&path) {
                Ok(h) if *h.model_fingerprint == *self.fingerprint => self.spilled.push(Spilled {
                    path,
                    tokens: h.tokens,
                    pending: None,
                }),
                Ok(_) => {
                    stats.snapshot_files_rejected += 1;
                    tracing::warn!(
                        "ignoring snapshot file {}: it was made by another model",
                        path.display()
                    );
                }
                Err(e) => {
                    stats.snapshot_files_rejected += 1;
                    tracing::warn!("ignoring snapshot file {}: {e}", path.display());
                }
            }
        }
    }

    /// Whether snapshots are kept at all.
    pub fn enabled(&self) -> bool {
        (self.max_bytes > 0 && self.max_entries > 0) || self.spill_dir.is_some()
    }

    /// Bytes the in-memory store may hold (0: none; a spill directory alone
    /// writes every snapshot to disk).
    pub fn memory_budget(&self) -> u64 {
        if self.max_entries > 0 {
            self.max_bytes
        } else {
            0
        }
    }

    /// Drops the snapshots of exactly these tokens, in memory and spilled.
    pub fn forget(&mut self, tokens: &[Token]) {
        self.drop_where(|t| t == tokens);
    }

    /// Drops every snapshot whose tokens match, in memory and spilled (its
    /// file removed by the writer).
    fn drop_where(&mut self, matches: impl Fn(&[Token]) -> bool) {
        let mut freed = 0;
        self.entries.retain(|e| {
            let drop = matches(&e.tokens);
            if drop {
                freed += e.state.len() as u64;
            }
            !drop
        });
        self.bytes -= freed;
        let writer = &self.writer;
        self.spilled.retain(|s| {
            let drop = matches(&s.tokens);
            if let (true, Some(w)) = (drop, writer) {
                w.send(SpillJob::Remove(s.path.clone()));
            }
            !drop
        });
    }

    /// Entries and bytes in memory.
    pub fn usage(&self) -> (usize, u64) {
        (self.entries.len(), self.bytes)
    }

    /// Whether an existing snapshot already holds these tokens (or more).
    pub fn covers(&self, tokens: &[Token]) -> bool {
        self.entries
            .iter()
            .map(|e| &e.tokens)
            .chain(self.spilled.iter().map(|s| &s.tokens))
            .any(|t| t.len() >= tokens.len() && t[..tokens.len()] == *tokens)
    }

    /// Adds a snapshot, dropping ones it supersedes, then enforces the budgets
    /// (spilling the least recently used when a directory is configured).
    pub fn insert(&mut self, tokens: Vec<Token>, state: Vec<u8>, stats: &mut CacheStats) {
        self.tick += 1;
        self.drop_where(|t| t.len() <= tokens.len() && tokens[..t.len()] == *t);
        self.bytes += state.len() as u64;
        self.entries.push(Snapshot {
            tokens,
            state,
            last_used: self.tick,
        });
        while self.bytes > self.max_bytes || self.entries.len() > self.max_entries {
            let Some(i) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let e = self.entries.swap_remove(i);
            self.bytes -= e.state.len() as u64;
            self.spill(e, stats);
        }
    }

    /// Hands an entry pushed out of memory to the writer thread; until it
    /// is written, a restore reads the state kept with the index entry.
    fn spill(&mut self, e: Snapshot, _stats: &mut CacheStats) {
        let (Some(dir), Some(writer)) = (&self.spill_dir, &self.writer) else {
            return;
        };
        let path = dir.join(spill_name(&e.tokens));
        let state = Arc::new(e.state);
        writer.send(SpillJob::Write {
            path: path.clone(),
            fingerprint: self.fingerprint.clone(),
            tokens: e.tokens.clone(),
            state: state.clone(),
        });
        self.spilled.push(Spilled {
            path,
            tokens: e.tokens,
            pending: Some(state),
        });
    }

    /// The snapshot sharing the longest prefix with the prompt: (index, length).
    pub fn best_match(&self, prompt: &[Token]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .map(|e| &e.tokens)
            .chain(self.spilled.iter().map(|s| &s.tokens))
            .enumerate()
            .map(|(i, t)| (i, common_prefix(t, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Takes the best snapshot for the prompt: its tokens and state. A spilled
    /// file is read and checked again; a bad one is dropped with a warning.
    pub fn take_for(
        &mut self,
        prompt: &[Token],
        stats: &mut CacheStats,
    ) -> Option<(Vec<Token>, Vec<u8>)> {
        let (i, _) = self.best_match(prompt)?;
        self.take_at(i, stats)
    }

    /// Takes the snapshot of exactly these tokens, if one is kept.
    pub fn take_exact(
        &mut self,
        tokens: &[Token],
        stats: &mut CacheStats,
    ) -> Option<(Vec<Token>, Vec<u8>)> {
        let i = self
            .entries
            .iter()
            .map(|e| &e.tokens)
            .chain(self.spilled.iter().map(|s| &s.tokens))
            .position(|t| t == tokens)?;
        self.take_at(i, stats)
    }

    /// Entry `i` of the in-memory entries followed by the spilled ones.
    fn take_at(&mut self, i: usize, stats: &mut CacheStats) -> Option<(Vec<Token>, Vec<u8>)> {
        self.tick += 1;
        if i < self.entries.len() {
            let e = &mut self.entries[i];
            e.last_used = self.tick;
            return Some((e.tokens.clone(), e.state.clone()));
        }
        let mut s = self.spilled.remove(i - self.entries.len());
        if let Some(state) = s.pending.take() {
            let tokens = s.tokens.clone();
            let bytes = state.as_ref().clone();
            // Still being written: keep the bytes until the writer is done.
            if Arc::strong_count(&state) > 1 {
                s.pending = Some(state);
            }
            self.spilled.push(s);
            return Some((tokens, bytes));
        }
        let loaded = read_spill_header(&s.path).and_then(|h| {
            if *h.model_fingerprint != *self.fingerprint {
                return Err("it was made by another model".into());
            }
            if h.tokens != s.tokens {
                return Err("its tokens changed on disk".into());
            }
            let mut f = std::fs::File::open(&s.path).map_err(|e| e.to_string())?;
            let mut all = Vec::new();
            f.read_to_end(&mut all).map_err(|e| e.to_string())?;
            Ok((h.tokens, all[h.state_offset as usize..].to_vec()))
        });
        match loaded {
            Ok((tokens, state)) => {
                // Back into memory; the file stays as the durable copy.
                self.spilled.push(s);
                Some((tokens, state))
            }
            Err(e) => {
                stats.snapshot_files_rejected += 1;
                tracing::warn!("ignoring snapshot file {}: {e}", s.path.display());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_bytes: u64, dir: Option<PathBuf>) -> CacheConfig {
        CacheConfig {
            max_snapshot_bytes: max_bytes,
            max_snapshot_entries: 4,
            snapshot_dir: dir,
            ..CacheConfig::default()
        }
    }

    #[test]
    fn lru_respects_byte_budget_and_supersedes_prefixes() {
        let mut stats = CacheStats::default();
        let mut s = SnapshotStore::new(&cfg(100, None), "m", &mut stats);
        s.insert(vec![1, 2], vec![0; 40], &mut stats);
        s.insert(vec![1, 2, 3], vec![0; 40], &mut stats);
        assert_eq!(s.usage(), (1, 40), "the shorter prefix is superseded");
        s.insert(vec![7], vec![0; 40], &mut stats);
        s.insert(vec![8], vec![0; 40], &mut stats);
        assert!(s.usage().1 <= 100);
        assert_eq!(
            s.best_match(&[1, 2, 3, 4]),
            None,
            "oldest entry was evicted"
        );
        assert_eq!(s.best_match(&[8, 1]).map(|m| m.1), Some(1));
    }

    #[test]
    fn spill_files_from_other_models_are_refused() {
        let tmp = tempfile::Builder::new()
            .prefix("sipp-snap-test-")
            .tempdir()
            .expect("dir");
        let dir = tmp.path().to_path_buf();
        write_spill(&dir.join("a.sippkv"), "model-a", &[1, 2, 3], b"state").expect("write");
        let mut stats = CacheStats::default();
        let s = SnapshotStore::new(&cfg(0, Some(dir.clone())), "model-b", &mut stats);
        assert_eq!(stats.snapshot_files_rejected, 1);
        assert_eq!(s.best_match(&[1, 2, 3]), None);
        let mut stats = CacheStats::default();
        let mut s = SnapshotStore::new(&cfg(0, Some(dir.clone())), "model-a", &mut stats);
        assert_eq!(stats.snapshot_files_rejected, 0);
        let (tokens, state) = s.take_for(&[1, 2, 3, 4], &mut stats).expect("found");
        assert_eq!(tokens, vec![1, 2, 3]);
        assert_eq!(state, b"state");
        // A truncated file is refused by its size check.
        let bytes = std::fs::read(dir.join("a.sippkv")).expect("read");
        std::fs::write(dir.join("b.sippkv"), &bytes[..bytes.len() - 2]).expect("write");
        let err = read_spill_header(&dir.join("b.sippkv")).unwrap_err();
        assert!(err.contains("size mismatch"), "{err}");
    }

    /// A spill whose file cannot be written yet (its temporary path is a
    /// FIFO nobody reads) must not block the caller: the engine thread
    /// inserts snapshots between decode steps.
    #[test]
    fn a_blocked_disk_write_does_not_stall_the_inserting_thread() {
        let tmp = tempfile::Builder::new()
            .prefix("sipp-snap-fifo-")
            .tempdir()
            .expect("dir");
        let dir = tmp.path().to_path_buf();
        let tokens = vec![5, 6, 7];
        let tmp = dir.join(spill_name(&tokens)).with_extension("tmp");
        let made = std::process::Command::new("mkfifo")
            .arg(&tmp)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());
        let (done_tx, done_rx) = mpsc::channel();
        let dir2 = dir.clone();
        let t = std::thread::spawn(move || {
            let mut stats = CacheStats::default();
            // No room in memory: the entry goes straight to the writer.
            let mut s = SnapshotStore::new(&cfg(1, Some(dir2)), "m", &mut stats);
            s.insert(vec![5, 6, 7], b"state".to_vec(), &mut stats);
            let restored = s.take_for(&[5, 6, 7, 8], &mut stats);
            done_tx.send(restored).expect("send");
            s // dropped after the FIFO is read: waits for the writer
        });
        let restored = done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("insert and restore returned while the write was blocked");
        assert_eq!(
            restored,
            Some((vec![5, 6, 7], b"state".to_vec())),
            "a pending spill restores from memory"
        );
        // Unblock the writer: read what it writes into the FIFO.
        let written = std::fs::read(&tmp).expect("read fifo");
        drop(t.join().expect("store thread"));
        assert!(written.starts_with(MAGIC), "the writer wrote a spill file");
        assert!(dir.join(spill_name(&tokens)).exists(), "renamed into place");
    }
}
