//! Images through llama.cpp's multimodal library (libmtmd), over its C API.
//!
//! llama-cpp-2 wraps part of libmtmd; what the engine needs it does not:
//! an owned image chunk the engine keeps until a step computes it, the
//! encoder's output embeddings, and decoding them into one sequence at a
//! given position. So this module holds small unsafe wrappers over the C
//! functions (`mtmd_tokenize`, `mtmd_encode_chunk`, `mtmd_get_output_embd`,
//! `mtmd_helper_decode_image_chunk`), each owning what it allocates.
//!
//! Tokenizing (splitting the prompt at markers, preprocessing each image) runs
//! on the caller's thread; encoding and the embedding decode run on the engine
//! thread, between batches. One mutex serializes the projector context, which
//! libmtmd does not make thread-safe for encoding.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use super::{MediaChunk, MediaPiece, MediaTokenizer, RuntimeError, Token};
use crate::media::{Image, IMAGE_MARKER};

/// Encoded images kept, by hash: the same image in several requests is
/// encoded once while it stays among the most recent.
const EMBD_CACHE_IMAGES: usize = 16;

/// A loaded projector (`--mmproj`) for one text model.
pub struct Projector {
    ctx: Mutex<ProjectorCtx>,
    /// Encoded embeddings of recent images.
    cache: Mutex<EmbdCache>,
    /// Embedding width the text model takes.
    n_embd: usize,
}

struct ProjectorCtx(NonNull<sys::mtmd_context>);

// SAFETY: the context is only used under the projector's mutex.
unsafe impl Send for ProjectorCtx {}

impl Drop for ProjectorCtx {
    fn drop(&mut self) {
        // SAFETY: created by mtmd_init_from_file, freed once.
        unsafe { sys::mtmd_free(self.0.as_ptr()) }
    }
}

/// One image chunk of a tokenized prompt, owned (a copy of libmtmd's).
struct OwnedChunk(NonNull<sys::mtmd_input_chunk>);

// SAFETY: an image chunk is immutable data once made (preprocessed pixels).
unsafe impl Send for OwnedChunk {}
// SAFETY: as above; libmtmd only reads it.
unsafe impl Sync for OwnedChunk {}

impl Drop for OwnedChunk {
    fn drop(&mut self) {
        // SAFETY: made by mtmd_input_chunk_copy, freed once.
        unsafe { sys::mtmd_input_chunk_free(self.0.as_ptr()) }
    }
}

#[derive(Default)]
struct EmbdCache {
    map: HashMap<u64, Arc<Vec<f32>>>,
    order: VecDeque<u64>,
}

impl EmbdCache {
    fn get(&mut self, hash: u64) -> Option<Arc<Vec<f32>>> {
        let v = self.map.get(&hash).cloned()?;
        self.order.retain(|&h| h != hash);
        self.order.push_back(hash);
        Some(v)
    }

    fn put(&mut self, hash: u64, v: Arc<Vec<f32>>) {
        if self.map.insert(hash, v).is_none() {
            self.order.push_back(hash);
        }
        while self.order.len() > EMBD_CACHE_IMAGES {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

impl std::fmt::Debug for Projector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projector")
            .field("n_embd", &self.n_embd)
            .finish_non_exhaustive()
    }
}

impl Projector {
    /// Loads `path` for `model` (its raw pointer), encoding on `threads`
    /// threads. Refuses projectors whose images need positions other than one
    /// per embedding (M-RoPE, the Qwen2-VL family): the scheduler places an
    /// image's embeddings at consecutive positions.
    pub fn load(
        path: &std::path::Path,
        model: *const sys::llama_model,
        threads: i32,
        use_gpu: bool,
    ) -> Result<Self, RuntimeError> {
        let failed = |m: &str| RuntimeError::Media(format!("projector {}: {m}", path.display()));
        if !path.is_file() {
            return Err(failed("no such file"));
        }
        let cpath = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| failed("the path contains a NUL byte"))?;
        let marker = CString::new(IMAGE_MARKER).expect("no NUL in the marker");
        // SAFETY: plain struct from libmtmd's defaults; the strings outlive the call.
        let raw = unsafe {
            let mut params = sys::mtmd_context_params_default();
            params.use_gpu = use_gpu;
            params.print_timings = false;
            params.n_threads = threads.max(1);
            params.media_marker = marker.as_ptr();
            params.warmup = false;
            sys::mtmd_init_from_file(cpath.as_ptr(), model, params)
        };
        let ctx = ProjectorCtx(NonNull::new(raw).ok_or_else(|| {
            failed("llama.cpp could not load it (not a projector, or not one for this model)")
        })?);
        // SAFETY: a live context.
        let (vision, mrope) = unsafe {
            (
                sys::mtmd_support_vision(ctx.0.as_ptr()),
                sys::mtmd_decode_use_mrope(ctx.0.as_ptr()),
            )
        };
        if !vision {
            return Err(failed(
                "it has no vision encoder (audio projectors are not supported)",
            ));
        }
        if mrope {
            return Err(failed(
                "its model places image embeddings with M-RoPE (Qwen2-VL family), which sipp \
                 does not support yet",
            ));
        }
        // SAFETY: a live model.
        let n_embd = unsafe { sys::llama_model_n_embd_inp(model) }.max(0) as usize;
        Ok(Self {
            ctx: Mutex::new(ctx),
            cache: Mutex::new(EmbdCache::default()),
            n_embd,
        })
    }

    /// Encodes an image chunk (or takes its embeddings from the cache) and
    /// decodes them into `seq` at `pos..` on `lctx`, in batches of `n_batch`.
    pub fn decode(
        &self,
        lctx: *mut sys::llama_context,
        chunk: &MediaChunk,
        seq: i32,
        pos: u32,
        n_batch: u32,
    ) -> Result<(), i32> {
        let Some(owned) = chunk.handle.downcast_ref::<OwnedChunk>() else {
            return Err(-1);
        };
        let ctx = self.ctx.lock().unwrap_or_else(|e| e.into_inner());
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(chunk.hash);
        let embd = match cached {
            Some(e) => e,
            None => {
                // SAFETY: a live context and chunk; the output buffer holds
                // n_tokens * n_embd floats until the next encode, which the
                // mutex keeps away while they are copied.
                let e = unsafe {
                    let rc = sys::mtmd_encode_chunk(ctx.0.as_ptr(), owned.0.as_ptr());
                    if rc != 0 {
                        return Err(rc);
                    }
                    let out = sys::mtmd_get_output_embd(ctx.0.as_ptr());
                    if out.is_null() {
                        return Err(-2);
                    }
                    std::slice::from_raw_parts(out, chunk.n_tokens * self.n_embd).to_vec()
                };
                let e = Arc::new(e);
                self.cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .put(chunk.hash, e.clone());
                e
            }
        };
        let mut new_pos: sys::llama_pos = 0;
        // SAFETY: live contexts; the helper reads `embd` (n_tokens * n_embd
        // floats) and does not keep it. It toggles non-causal attention for
        // the models that need it and restores it.
        let rc = unsafe {
            sys::mtmd_helper_decode_image_chunk(
                ctx.0.as_ptr(),
                lctx,
                owned.0.as_ptr(),
                embd.as_ptr().cast_mut(),
                pos as sys::llama_pos,
                seq,
                n_batch as i32,
                &raw mut new_pos,
                None,
                std::ptr::null_mut(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(rc)
        }
    }
}

/// Frees a `mtmd_input_chunks` list on every path.
struct Chunks(NonNull<sys::mtmd_input_chunks>);

impl Drop for Chunks {
    fn drop(&mut self) {
        // SAFETY: made by mtmd_input_chunks_init, freed once.
        unsafe { sys::mtmd_input_chunks_free(self.0.as_ptr()) }
    }
}

/// Frees a bitmap on every path.
struct Bitmap(NonNull<sys::mtmd_bitmap>);

impl Drop for Bitmap {
    fn drop(&mut self) {
        // SAFETY: made by mtmd_bitmap_init, freed once.
        unsafe { sys::mtmd_bitmap_free(self.0.as_ptr()) }
    }
}

impl MediaTokenizer for Projector {
    fn tokenize(&self, text: &str, images: &[Arc<Image>]) -> Result<Vec<MediaPiece>, RuntimeError> {
        let err = |m: String| RuntimeError::Media(m);
        let ctext = CString::new(text).map_err(|_| err("the prompt contains a NUL byte".into()))?;
        let mut bitmaps = Vec::with_capacity(images.len());
        for img in images {
            if img.rgb.len() != img.width as usize * img.height as usize * 3 {
                return Err(err("image pixels do not match its size".into()));
            }
            // SAFETY: `rgb` holds width * height * 3 bytes; libmtmd copies them.
            let raw = unsafe { sys::mtmd_bitmap_init(img.width, img.height, img.rgb.as_ptr()) };
            let b =
                Bitmap(NonNull::new(raw).ok_or_else(|| err("libmtmd refused an image".into()))?);
            let id = CString::new(format!("{:016x}", img.hash)).expect("hex has no NUL");
            // SAFETY: a live bitmap; the id is copied.
            unsafe { sys::mtmd_bitmap_set_id(b.0.as_ptr(), id.as_ptr()) };
            bitmaps.push(b);
        }
        let ptrs: Vec<*const sys::mtmd_bitmap> =
            bitmaps.iter().map(|b| b.0.as_ptr().cast_const()).collect();
        // SAFETY: allocation only.
        let chunks = Chunks(
            NonNull::new(unsafe { sys::mtmd_input_chunks_init() })
                .ok_or_else(|| err("libmtmd could not allocate".into()))?,
        );
        let input = sys::mtmd_input_text {
            text: ctext.as_ptr(),
            text_len: ctext.as_bytes().len(),
            add_special: false,
            parse_special: true,
        };
        let rc = {
            let ctx = self.ctx.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: live context, output list, text and bitmaps for the call.
            unsafe {
                sys::mtmd_tokenize(
                    ctx.0.as_ptr(),
                    chunks.0.as_ptr(),
                    &raw const input,
                    ptrs.as_ptr().cast_mut(),
                    ptrs.len(),
                )
            }
        };
        match rc {
            0 => {}
            1 => {
                return Err(err(format!(
                    "the prompt has a different number of image places than the {} images sent",
                    images.len()
                )))
            }
            2 => return Err(err("the projector could not preprocess an image".into())),
            c => {
                return Err(err(format!(
                    "libmtmd could not tokenize the prompt (code {c})"
                )))
            }
        }
        let mut out = Vec::new();
        let mut seen: Vec<u64> = Vec::new();
        // SAFETY: indices below the list's size; chunk data is read (text
        // tokens copied, image chunks copied into owned chunks) before the
        // list is freed.
        unsafe {
            let n = sys::mtmd_input_chunks_size(chunks.0.as_ptr());
            for i in 0..n {
                let c = sys::mtmd_input_chunks_get(chunks.0.as_ptr(), i);
                if sys::mtmd_input_chunk_get_type(c) == sys::MTMD_INPUT_CHUNK_TYPE_TEXT {
                    let mut len = 0usize;
                    let t = sys::mtmd_input_chunk_get_tokens_text(c, &raw mut len);
                    let tokens: Vec<Token> = if t.is_null() || len == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(t, len).to_vec()
                    };
                    out.push(MediaPiece::Text(tokens));
                    continue;
                }
                if sys::mtmd_input_chunk_get_type(c) != sys::MTMD_INPUT_CHUNK_TYPE_IMAGE {
                    return Err(err("only images are supported".into()));
                }
                let n_tokens = sys::mtmd_input_chunk_get_n_tokens(c);
                let n_pos = sys::mtmd_input_chunk_get_n_pos(c);
                if n_pos as usize != n_tokens {
                    return Err(err("an image takes other positions than embeddings".into()));
                }
                let copy = NonNull::new(sys::mtmd_input_chunk_copy(c))
                    .ok_or_else(|| err("libmtmd could not copy an image chunk".into()))?;
                // The chunk carries its image's id (the hash, in hex). A
                // model that cuts an image into several chunks gets one hash
                // per chunk, so embeddings and placeholders stay apart.
                let id = sys::mtmd_input_chunk_get_id(c);
                let image_hash = if id.is_null() {
                    None
                } else {
                    std::ffi::CStr::from_ptr(id)
                        .to_str()
                        .ok()
                        .and_then(|h| u64::from_str_radix(h, 16).ok())
                };
                let image_hash = image_hash.unwrap_or(0);
                let nth = seen.iter().filter(|&&h| h == image_hash).count() as u64;
                seen.push(image_hash);
                let hash = image_hash ^ nth.wrapping_mul(0xD6E8_FEB8_6659_FD93);
                out.push(MediaPiece::Image(MediaChunk {
                    hash,
                    n_tokens,
                    handle: Arc::new(OwnedChunk(copy)),
                }));
            }
        }
        Ok(out)
    }
}
