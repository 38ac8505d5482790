//! GGUF header checks in Rust, before llama.cpp sees a file.
//!
//! llama.cpp aborts the process on some malformed files; reading the header,
//! metadata and tensor table here first turns every such file into a one-line
//! error. The parsed metadata also feeds `sipp inspect` and the model fingerprint.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";
/// Strings and arrays longer than this are treated as corruption, not allocated.
const MAX_LEN: u64 = 1 << 31;

/// Why a file is not a usable GGUF model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    /// No file at the path.
    #[error("model file not found: {0}")]
    NotFound(String),
    /// The path is a directory.
    #[error("model path is a directory, not a GGUF file: {0}")]
    IsDirectory(String),
    /// The file cannot be read.
    #[error("cannot read model file {path}: {message}")]
    Unreadable {
        /// The file.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The file does not start with the GGUF magic.
    #[error("not a GGUF file: {0} (expected the magic bytes \"GGUF\" at offset 0)")]
    NotGguf(String),
    /// A GGUF version this build does not read.
    #[error("unsupported GGUF version {version} in {path} (supported: 2 and 3)")]
    UnsupportedVersion {
        /// The file.
        path: String,
        /// The version found.
        version: u32,
    },
    /// The file ends before its header or tensor data does.
    #[error("truncated GGUF file {path}: {what} needs {needed} bytes but the file has {size}")]
    Truncated {
        /// The file.
        path: String,
        /// What was being read.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        size: u64,
    },
    /// The header is inconsistent.
    #[error("corrupt GGUF file {path}: {message}")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Any integer type.
    Int(i64),
    /// u64 values above i64::MAX.
    UInt(u64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// string.
    Str(String),
    /// An array; only its length and element type are kept, plus strings for
    /// short string arrays.
    Array {
        /// GGUF element type id.
        elem_type: u32,
        /// Number of elements.
        len: u64,
    },
}

impl MetaValue {
    /// The value as an unsigned integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::Int(i) => u64::try_from(i).ok(),
            MetaValue::UInt(u) => Some(u),
            _ => None,
        }
    }
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's entry in the table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Dimensions.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// A checked GGUF header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version.
    pub version: u32,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, MetaValue>,
    /// The tensor table.
    pub tensors: Vec<TensorInfo>,
    /// File size in bytes.
    pub file_size: u64,
    /// Where tensor data starts.
    pub data_offset: u64,
    /// sha256 of the header bytes and the file size: identifies these weights.
    pub fingerprint: String,
}

impl GgufHeader {
    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata
            .get("general.architecture")
            .and_then(MetaValue::as_str)
    }

    /// A metadata value under the architecture's prefix (`{arch}.{suffix}`).
    pub fn arch_value(&self, suffix: &str) -> Option<&MetaValue> {
        let arch = self.architecture()?;
        self.metadata.get(&format!("{arch}.{suffix}"))
    }

    /// The quantization name of `general.file_type`, or the most common tensor type.
    pub fn quantization(&self) -> String {
        if let Some(ft) = self
            .metadata
            .get("general.file_type")
            .and_then(MetaValue::as_u64)
        {
            if let Some(name) = file_type_name(ft) {
                return name.to_string();
            }
        }
        let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
        for t in &self.tensors {
            *counts.entry(t.ggml_type).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|&(_, c)| c)
            .map(|(t, _)| ggml_type_name(t).to_string())
            .unwrap_or_else(|| "unknown".into())
    }
}

/// Counts bytes read so a short read can report where it happened.
struct Cursor<R> {
    inner: R,
    pos: u64,
    size: u64,
    path: String,
    hasher: Sha256,
}

impl<R: Read> Cursor<R> {
    fn truncated(&self, what: &str, n: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.clone(),
            what: what.to_string(),
            needed: self.pos.saturating_add(n),
            size: self.size,
        }
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, GgufError> {
        if n > MAX_LEN {
            return Err(GgufError::Corrupt {
                path: self.path.clone(),
                message: format!("{what} claims {n} bytes"),
            });
        }
        if self.pos.saturating_add(n) > self.size {
            return Err(self.truncated(what, n));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| self.truncated(what, n))?;
        self.hasher.update(&buf);
        self.pos += n;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        let b = self.bytes(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let b = self.bytes(len, what)?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    fn skip_string(&mut self, what: &str) -> Result<(), GgufError> {
        let len = self.u64(what)?;
        self.bytes(len, what).map(|_| ())
    }

    fn scalar(&mut self, ty: u32, what: &str) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::Int(i64::from(self.bytes(1, what)?[0])),
            1 => MetaValue::Int(i64::from(self.bytes(1, what)?[0] as i8)),
            2 => {
                let b = self.bytes(2, what)?;
                MetaValue::Int(i64::from(u16::from_le_bytes([b[0], b[1]])))
            }
            3 => {
                let b = self.bytes(2, what)?;
                MetaValue::Int(i64::from(i16::from_le_bytes([b[0], b[1]])))
            }
            4 => MetaValue::Int(i64::from(self.u32(what)?)),
            5 => MetaValue::Int(i64::from(self.u32(what)? as i32)),
            6 => MetaValue::Float(f64::from(f32::from_bits(self.u32(what)?))),
            7 => MetaValue::Bool(self.bytes(1, what)?[0] != 0),
            8 => MetaValue::Str(self.string(what)?),
            10 => {
                let v = self.u64(what)?;
                i64::try_from(v).map_or(MetaValue::UInt(v), MetaValue::Int)
            }
            11 => MetaValue::Int(self.u64(what)? as i64),
            12 => MetaValue::Float(f64::from_bits(self.u64(what)?)),
            other => {
                return Err(GgufError::Corrupt {
                    path: self.path.clone(),
                    message: format!("{what} has unknown value type {other}"),
                })
            }
        })
    }

    fn value(&mut self, ty: u32, what: &str) -> Result<MetaValue, GgufError> {
        if ty != 9 {
            return self.scalar(ty, what);
        }
        let elem_type = self.u32(what)?;
        let len = self.u64(what)?;
        if len > MAX_LEN {
            return Err(GgufError::Corrupt {
                path: self.path.clone(),
                message: format!("{what} claims {len} array elements"),
            });
        }
        let fixed = match elem_type {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4 | 5 | 6 => Some(4),
            10 | 11 | 12 => Some(8),
            _ => None,
        };
        match (fixed, elem_type) {
            (Some(width), _) => {
                self.bytes(len * width, what)?;
            }
            (None, 8) => {
                for _ in 0..len {
                    self.skip_string(what)?;
                }
            }
            _ => {
                return Err(GgufError::Corrupt {
                    path: self.path.clone(),
                    message: format!("{what} is an array of unsupported type {elem_type}"),
                })
            }
        }
        Ok(MetaValue::Array { elem_type, len })
    }
}

/// Reads and checks a GGUF file's header, metadata and tensor table, and that
/// every tensor's data lies inside the file.
pub fn check_gguf(path: &Path) -> Result<GgufHeader, GgufError> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => GgufError::NotFound(shown.clone()),
        _ => GgufError::Unreadable {
            path: shown.clone(),
            message: e.to_string(),
        },
    })?;
    if meta.is_dir() {
        return Err(GgufError::IsDirectory(shown));
    }
    let file = File::open(path).map_err(|e| GgufError::Unreadable {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let size = meta.len();
    let mut c = Cursor {
        inner: BufReader::with_capacity(1 << 16, file),
        pos: 0,
        size,
        path: shown.clone(),
        hasher: Sha256::new(),
    };
    if size < 4 {
        return Err(GgufError::NotGguf(shown));
    }
    let magic = c.bytes(4, "magic")?;
    if magic.as_slice() != MAGIC {
        return Err(GgufError::NotGguf(shown));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion {
            path: shown,
            version,
        });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Counts beyond any real model are corruption; smaller ones are read and a
    // short file then reports where it ends.
    if n_tensors > 1 << 24 || n_kv > 1 << 24 {
        return Err(GgufError::Corrupt {
            path: shown,
            message: format!("header claims {n_tensors} tensors and {n_kv} metadata entries"),
        });
    }
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&format!("type of `{key}`"))?;
        let value = c.value(ty, &format!("metadata `{key}`"))?;
        metadata.insert(key, value);
    }
    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor {i} name"))?;
        let n_dims = c.u32(&format!("tensor `{name}` rank"))?;
        if n_dims == 0 || n_dims > 8 {
            return Err(GgufError::Corrupt {
                path: shown,
                message: format!("tensor `{name}` has rank {n_dims}"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("tensor `{name}` shape"))?);
        }
        let ggml_type = c.u32(&format!("tensor `{name}` type"))?;
        let offset = c.u64(&format!("tensor `{name}` offset"))?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let alignment = metadata
        .get("general.alignment")
        .and_then(MetaValue::as_u64)
        .filter(|a| *a > 0 && a.is_power_of_two())
        .unwrap_or(32);
    let data_offset = c.pos.div_ceil(alignment) * alignment;
    for t in &tensors {
        let elems = t
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| GgufError::Corrupt {
                path: shown.clone(),
                message: format!("tensor `{}` shape overflows", t.name),
            })?;
        let bytes = ggml_type_size(t.ggml_type)
            .map(|(block, size)| elems.div_ceil(block) * size)
            .unwrap_or(0);
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|v| v.checked_add(bytes))
            .ok_or_else(|| GgufError::Corrupt {
                path: shown.clone(),
                message: format!("tensor `{}` offset overflows", t.name),
            })?;
        if end > size {
            return Err(GgufError::Truncated {
                path: shown,
                what: format!("tensor `{}`", t.name),
                needed: end,
                size,
            });
        }
    }
    c.hasher.update(size.to_le_bytes());
    let fingerprint = hex::encode(c.hasher.finalize());
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        file_size: size,
        data_offset,
        fingerprint,
    })
}

/// (elements per block, bytes per block) of a ggml type.
fn ggml_type_size(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),
        1 => (1, 2),
        2 => (32, 18),
        3 => (32, 20),
        6 => (32, 22),
        7 => (32, 24),
        8 => (32, 34),
        9 => (32, 36),
        10 => (256, 84),
        11 => (256, 110),
        12 => (256, 144),
        13 => (256, 176),
        14 => (256, 210),
        15 => (256, 292),
        16 => (256, 66),
        17 => (256, 74),
        18 => (256, 98),
        19 => (256, 50),
        20 => (32, 18),
        21 => (256, 110),
        22 => (256, 82),
        23 => (256, 136),
        24 => (1, 1),
        25 => (1, 2),
        26 => (1, 4),
        27 => (1, 8),
        28 => (1, 8),
        29 => (256, 56),
        30 => (1, 2),
        34 => (256, 54),
        35 => (256, 66),
        39 => (32, 17),
        _ => return None,
    })
}

fn ggml_type_name(t: u32) -> &'static str {
    match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        30 => "BF16",
        _ => "other",
    }
}

/// llama.cpp's `llama_ftype` names.
fn file_type_name(ft: u64) -> Option<&'static str> {
    Some(match ft {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gguf_bytes(tensor_len: u64, data: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        let name = b"w";
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&tensor_len.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend_from_slice(data);
        b
    }

    /// `bytes` written to `name` in a new temporary folder (removed when
    /// the returned handle drops).
    fn write_tmp(name: &str, bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("sipp-gguf-test-")
            .tempdir()
            .expect("tmp dir");
        let p = dir.path().join(name);
        let mut f = File::create(&p).expect("create");
        f.write_all(bytes).expect("write");
        (dir, p)
    }

    #[test]
    fn accepts_a_complete_file() {
        let (_dir, p) = write_tmp("ok.gguf", &gguf_bytes(4, &[0u8; 16]));
        let h = check_gguf(&p).expect("valid");
        assert_eq!(h.architecture(), Some("llama"));
        assert_eq!(h.tensors.len(), 1);
        assert_eq!(h.quantization(), "F32");
    }

    #[test]
    fn rejects_truncated_tensor_data_with_numbers() {
        let (_dir, p) = write_tmp("short.gguf", &gguf_bytes(1000, &[0u8; 16]));
        let err = check_gguf(&p).unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
        assert!(err.to_string().contains("needs"), "{err}");
    }

    #[test]
    fn rejects_truncated_header() {
        let full = gguf_bytes(4, &[0u8; 16]);
        let (_dir, p) = write_tmp("cut.gguf", &full[..30]);
        let err = check_gguf(&p).unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    }

    #[test]
    fn rejects_non_gguf_directory_and_missing() {
        let (_dir, p) = write_tmp("text.gguf", b"hello world, not a model");
        assert!(matches!(check_gguf(&p), Err(GgufError::NotGguf(_))));
        let dir = p.parent().expect("parent");
        assert!(matches!(check_gguf(dir), Err(GgufError::IsDirectory(_))));
        assert!(matches!(
            check_gguf(&dir.join("absent.gguf")),
            Err(GgufError::NotFound(_))
        ));
    }

    #[test]
    fn rejects_absurd_counts_without_allocating() {
        let mut b = gguf_bytes(4, &[0u8; 16]);
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let (_dir, p) = write_tmp("huge.gguf", &b);
        assert!(matches!(check_gguf(&p), Err(GgufError::Corrupt { .. })));
    }
}
