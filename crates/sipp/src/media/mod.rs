//! Images in: what a request's image parts become before a model sees them.
//!
//! A part names an image by URL. Here only `data:` URLs are read (base64
//! PNG, JPEG or WebP); fetching `http(s)` URLs is the server's policy, and it
//! hands the bytes on as a data URL. Each image is decoded to RGB pixels under
//! limits ([`ImageLimits`]) and named by a hash of its pixels. In a prompt an
//! image is a run of placeholder tokens derived from that hash
//! ([`placeholder_tokens`]): negative ids, which no vocabulary has, so prefix
//! matching treats the same image at the same place as the same tokens (its KV
//! is reused) and a different image as different ones.

use std::sync::Arc;

use base64::Engine as _;
use sha2::{Digest, Sha256};

use crate::runtime::Token;

/// The text an image part stands as in a rendered prompt, where the model's
/// projector puts the image's embeddings. Unlikely in real text; a message
/// that contains it while images are attached is refused.
pub const IMAGE_MARKER: &str = "<__sipp_image__>";

/// A decoded image.
#[derive(Clone, PartialEq, Eq)]
pub struct Image {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Pixels, RGB, 8 bits per channel, row-major.
    pub rgb: Vec<u8>,
    /// A hash of the size and pixels (stable across processes).
    pub hash: u64,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("width", &self.width)
            .field("height", &self.height)
            .field("hash", &format_args!("{:016x}", self.hash))
            .finish()
    }
}

/// How much image a request may bring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Images in one request.
    pub max_images: usize,
    /// Encoded bytes of one image.
    pub max_bytes: usize,
    /// Width and height of one image, in pixels.
    pub max_side: u32,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_images: 8,
            max_bytes: 20 << 20,
            max_side: 8192,
        }
    }
}

/// Why an image was refused; every one is the sender's to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// Not a data URL.
    #[error(
        "image {index}: only `data:` URLs are read here (base64 PNG, JPEG or WebP); this \
         server does not fetch http(s) image URLs (start it with --fetch-image-urls to allow it)"
    )]
    NotDataUrl {
        /// Which image.
        index: usize,
    },
    /// A data URL that is not base64 or does not parse.
    #[error("image {index}: malformed data URL ({why})")]
    BadDataUrl {
        /// Which image.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// Bytes over the limit.
    #[error("image {index}: {bytes} bytes is more than the {max} allowed per image")]
    TooLarge {
        /// Which image.
        index: usize,
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Sides over the limit.
    #[error("image {index}: {width}x{height} pixels is larger than the {max}x{max} allowed")]
    TooManyPixels {
        /// Which image.
        index: usize,
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// The limit per side.
        max: u32,
    },
    /// More images than allowed.
    #[error("{count} images in one request; at most {max} are allowed")]
    TooMany {
        /// Images sent.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A format this server does not read.
    #[error("image {index}: {format} is not supported (PNG, JPEG and WebP are)")]
    Unsupported {
        /// Which image.
        index: usize,
        /// What it looks like.
        format: String,
    },
    /// Bytes that do not decode.
    #[error("image {index}: the {format} data does not decode ({why})")]
    Undecodable {
        /// Which image.
        index: usize,
        /// The format it claimed.
        format: String,
        /// The decoder's reason.
        why: String,
    },
}

/// Reads a `data:[<mime>][;base64],<data>` URL's bytes (base64 only: images
/// are binary). Image `index` names it in errors.
pub fn data_url_bytes(
    url: &str,
    index: usize,
    limits: &ImageLimits,
) -> Result<Vec<u8>, ImageError> {
    let Some(rest) = url.trim().strip_prefix("data:") else {
        return Err(ImageError::NotDataUrl { index });
    };
    let bad = |why: &str| ImageError::BadDataUrl {
        index,
        why: why.to_string(),
    };
    let (head, data) = rest
        .split_once(',')
        .ok_or_else(|| bad("no `,` before the data"))?;
    if !head.split(';').any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(bad("images must be base64-encoded (`;base64,`)"));
    }
    // Base64 takes 4 bytes for 3: refuse before decoding what is too large.
    if data.len() / 4 * 3 > limits.max_bytes + 3 {
        return Err(ImageError::TooLarge {
            index,
            bytes: data.len() / 4 * 3,
            max: limits.max_bytes,
        });
    }
    let cleaned: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(cleaned.as_bytes())
        .map_err(|e| bad(&format!("invalid base64: {e}")))?;
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooLarge {
            index,
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    Ok(bytes)
}

/// Decodes PNG, JPEG or WebP bytes to RGB under the limits.
pub fn decode_image(bytes: &[u8], index: usize, limits: &ImageLimits) -> Result<Image, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooLarge {
            index,
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    let format = image::guess_format(bytes).map_err(|_| ImageError::Unsupported {
        index,
        format: "data that is no known image format".into(),
    })?;
    let name = format!("{format:?}").to_uppercase();
    if !matches!(
        format,
        image::ImageFormat::Png | image::ImageFormat::Jpeg | image::ImageFormat::WebP
    ) {
        return Err(ImageError::Unsupported {
            index,
            format: name,
        });
    }
    let undecodable = |e: image::ImageError| ImageError::Undecodable {
        index,
        format: name.clone(),
        why: e.to_string(),
    };
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    let mut lim = image::Limits::default();
    lim.max_image_width = Some(limits.max_side);
    lim.max_image_height = Some(limits.max_side);
    reader.limits(lim);
    let decoded = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(_) => {
            let (width, height) =
                image::ImageReader::with_format(std::io::Cursor::new(bytes), format)
                    .into_dimensions()
                    .unwrap_or((0, 0));
            ImageError::TooManyPixels {
                index,
                width,
                height,
                max: limits.max_side,
            }
        }
        e => undecodable(e),
    })?;
    let rgb = decoded.to_rgb8();
    let (width, height) = rgb.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::Undecodable {
            index,
            format: name,
            why: "the image has no pixels".into(),
        });
    }
    let rgb = rgb.into_raw();
    let hash = pixel_hash(width, height, &rgb);
    Ok(Image {
        width,
        height,
        rgb,
        hash,
    })
}

/// Reads and decodes the images of one request, in order, checking the count.
pub fn load_images(urls: &[&str], limits: &ImageLimits) -> Result<Vec<Arc<Image>>, ImageError> {
    if urls.len() > limits.max_images {
        return Err(ImageError::TooMany {
            count: urls.len(),
            max: limits.max_images,
        });
    }
    urls.iter()
        .enumerate()
        .map(|(i, url)| {
            let bytes = data_url_bytes(url, i, limits)?;
            decode_image(&bytes, i, limits).map(Arc::new)
        })
        .collect()
}

/// Bytes as a base64 `data:` URL (the format is found from the bytes when
/// read back, so the MIME type is generic).
pub fn data_url(bytes: &[u8]) -> String {
    format!(
        "data:application/octet-stream;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// SHA-256 of the size and pixels, first 8 bytes.
fn pixel_hash(width: u32, height: u32, rgb: &[u8]) -> u64 {
    let mut h = Sha256::new();
    h.update(width.to_le_bytes());
    h.update(height.to_le_bytes());
    h.update(rgb);
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// The placeholder tokens an image of hash `hash` takes in a prompt, `n` of
/// them: negative ids (no vocabulary has them), different per position and
/// per image, the same for the same image.
pub fn placeholder_tokens(hash: u64, n: usize) -> Vec<Token> {
    (0..n as u64)
        .map(|i| {
            let x = hash.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            -1 - ((x >> 34) as Token)
        })
        .collect()
}

/// Whether a prompt token stands for part of an image.
pub fn is_placeholder(token: Token) -> bool {
    token < 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32, seed: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([x as u8 ^ seed, y as u8, seed])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png)
            .expect("png");
        out.into_inner()
    }

    fn data_url(bytes: &[u8], mime: &str) -> String {
        format!(
            "data:{mime};base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    #[test]
    fn data_urls_decode_and_hash_by_pixels() {
        let lim = ImageLimits::default();
        let a = load_images(&[&data_url(&png(5, 3, 1), "image/png")], &lim).expect("decodes");
        assert_eq!((a[0].width, a[0].height, a[0].rgb.len()), (5, 3, 45));
        // The same pixels under another MIME type name the same image.
        let b = load_images(&[&data_url(&png(5, 3, 1), "image/jpeg")], &lim).expect("decodes");
        assert_eq!(a[0].hash, b[0].hash);
        let c = load_images(&[&data_url(&png(5, 3, 2), "image/png")], &lim).expect("decodes");
        assert_ne!(a[0].hash, c[0].hash);
    }

    #[test]
    fn bad_images_get_their_own_errors() {
        let lim = ImageLimits {
            max_images: 2,
            max_bytes: 4096,
            max_side: 64,
        };
        let ok = data_url(&png(4, 4, 0), "image/png");
        let err = |urls: &[&str]| load_images(urls, &lim).expect_err("refused");
        assert!(matches!(
            err(&["https://example.com/a.png"]),
            ImageError::NotDataUrl { index: 0 }
        ));
        assert!(matches!(
            err(&[&ok, "data:image/png,abc"]),
            ImageError::BadDataUrl { index: 1, .. }
        ));
        assert!(matches!(
            err(&["data:image/png;base64,!!!"]),
            ImageError::BadDataUrl { .. }
        ));
        assert!(matches!(
            err(&[&ok, &ok, &ok]),
            ImageError::TooMany { count: 3, max: 2 }
        ));
        assert!(matches!(
            err(&[&data_url(&png(65, 2, 0), "image/png")]),
            ImageError::TooManyPixels { width: 65, .. }
        ));
        assert!(matches!(
            err(&[&data_url(b"GIF89a\x01\x00\x01\x00", "image/gif")]),
            ImageError::Unsupported { .. }
        ));
        let mut broken = png(4, 4, 0);
        broken.truncate(30);
        assert!(matches!(
            err(&[&data_url(&broken, "image/png")]),
            ImageError::Undecodable { .. }
        ));
        assert!(matches!(
            err(&[&data_url(&vec![0u8; 5000], "image/png")]),
            ImageError::TooLarge { .. }
        ));
    }

    #[test]
    fn placeholders_are_negative_stable_and_distinct() {
        let a = placeholder_tokens(42, 16);
        assert!(a.iter().all(|&t| is_placeholder(t)));
        assert_eq!(a, placeholder_tokens(42, 16));
        let b = placeholder_tokens(43, 16);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let mut d = a.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), 16);
    }
}
