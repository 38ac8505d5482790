//! A small server-sent events decoder (the `event:` and `data:` fields), fed
//! bytes as they arrive.

use std::time::Duration;

use futures::StreamExt;

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined by newlines.
    pub data: String,
}

/// Incremental decoder.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: String,
    pending_utf8: Vec<u8>,
}

impl SseDecoder {
    /// Adds bytes; returns the events now complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.pending_utf8.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending_utf8) {
            Ok(_) => self.pending_utf8.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.pending_utf8.len(),
        };
        let text = String::from_utf8_lossy(&self.pending_utf8[..valid]).into_owned();
        self.pending_utf8.drain(..valid);
        self.buf.push_str(&text);
        // Normalize CRLF on the whole buffer: a pair may straddle two chunks.
        if self.buf.contains("\r\n") {
            self.buf = self.buf.replace("\r\n", "\n");
        }
        let mut out = Vec::new();
        while let Some(end) = self.buf.find("\n\n") {
            let block: String = self.buf.drain(..end + 2).collect();
            let mut event = None;
            let mut data: Vec<&str> = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v));
                } else if let Some(v) = line.strip_prefix("event:") {
                    event = Some(v.trim().to_string());
                }
            }
            if event.is_some() || !data.is_empty() {
                out.push(SseEvent {
                    event,
                    data: data.join("\n"),
                });
            }
        }
        out
    }
}

/// Reads the next batch of events from a response, waiting at most `timeout`
/// for bytes. `Ok(None)` at the end of the stream.
pub async fn next_events<S>(
    stream: &mut S,
    decoder: &mut SseDecoder,
    timeout: Duration,
) -> Result<Option<Vec<SseEvent>>, String>
where
    S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
{
    loop {
        let chunk = tokio::time::timeout(timeout, stream.next())
            .await
            .map_err(|_| format!("no data for {timeout:?}"))?;
        match chunk {
            None => return Ok(None),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(bytes)) => {
                let events = decoder.push(&bytes);
                if !events.is_empty() {
                    return Ok(Some(events));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_split_events_and_multibyte_text() {
        let mut d = SseDecoder::default();
        let all =
            "event: message_start\ndata: {\"a\":1}\n\ndata: h\u{e9}llo\r\n\r\ndata: [DONE]\n\n"
                .as_bytes();
        let mut events = Vec::new();
        for chunk in all.chunks(3) {
            events.extend(d.push(chunk));
        }
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].event.as_deref(), Some("message_start"));
        assert_eq!(events[1].data, "h\u{e9}llo");
        assert_eq!(events[2].data, "[DONE]");
    }
}

/// What one streamed event means to a run.
#[derive(Debug)]
pub(crate) enum Piece {
    /// New text.
    Text(String),
    /// New reasoning text.
    Reasoning(String),
    /// A tool call started; `index` is the remote's (calls are numbered 0,
    /// 1, ... in the order they start).
    CallStart {
        /// The remote's index of the call.
        index: usize,
        /// Its id.
        id: String,
        /// The function's name.
        name: String,
    },
    /// More of a call's arguments.
    CallArguments {
        /// The remote's index of the call.
        index: usize,
        /// The piece (JSON text).
        fragment: String,
    },
    /// The finish reason.
    Finish(String),
    /// Token counts.
    Usage(crate::engine::Usage),
    /// The whole final answer, as the remote sent it.
    Done(super::Response),
    /// The end: the answer is what the pieces built.
    End,
}

/// The answer the pieces of a stream build.
#[derive(Default)]
struct Builder {
    r: super::Response,
    /// The remote's index of each call, in `r.tool_calls` order.
    indexes: Vec<usize>,
}

impl Builder {
    /// Adds a piece; returns the event to stream, if any.
    fn apply(&mut self, p: Piece) -> Option<super::RunEvent> {
        use super::RunEvent;
        Some(match p {
            Piece::Text(t) | Piece::Reasoning(t) if t.is_empty() => return None,
            Piece::Text(t) => {
                self.r.text.push_str(&t);
                RunEvent::Delta(t)
            }
            Piece::Reasoning(t) => {
                self.r
                    .reasoning
                    .get_or_insert_with(String::new)
                    .push_str(&t);
                RunEvent::Reasoning(t)
            }
            Piece::CallStart { index, id, name } => {
                self.indexes.push(index);
                self.r
                    .tool_calls
                    .push(crate::tools::ToolCall::new(id.clone(), name.clone(), ""));
                RunEvent::ToolCallStart {
                    index: self.indexes.len() - 1,
                    id,
                    name,
                }
            }
            Piece::CallArguments { index, fragment } => {
                let at = self.indexes.iter().rposition(|&i| i == index)?;
                self.r.tool_calls[at].function.arguments.push_str(&fragment);
                RunEvent::ToolCallArguments {
                    index: at,
                    fragment,
                }
            }
            Piece::Finish(f) => {
                self.r.finish_reason = f;
                return None;
            }
            Piece::Usage(u) => {
                self.r.usage = u;
                return None;
            }
            Piece::Done(_) | Piece::End => return None,
        })
    }

    /// The answer: a call without arguments has `{}`, and an answer that
    /// called tools and stopped by itself finished with `tool_calls`.
    fn finish(&mut self) -> super::Response {
        let mut r = std::mem::take(&mut self.r);
        finish_calls(&mut r);
        r
    }
}

/// Fills in what a remote may leave out of an answer with calls: `{}` as
/// the arguments of a call without any, and `tool_calls` as the finish reason
/// of an answer that called and stopped.
pub(crate) fn finish_calls(r: &mut super::Response) {
    for c in &mut r.tool_calls {
        if c.function.arguments.trim().is_empty() {
            c.function.arguments = "{}".into();
        }
    }
    if !r.tool_calls.is_empty() && matches!(r.finish_reason.as_str(), "stop" | "eos") {
        r.finish_reason = "tool_calls".into();
    }
}

/// Turns a streamed response into a run: `parse` maps each event onto pieces;
/// text, reasoning and calls are streamed when `stream`; a cancelled run
/// closes the connection (which the remote takes as a cancellation) and
/// reports what it had.
pub(crate) fn stream_run<F>(
    id: &str,
    resp: reqwest::Response,
    read_timeout: Duration,
    stream: bool,
    mut parse: F,
) -> super::Run
where
    F: FnMut(&SseEvent) -> Result<Vec<Piece>, super::ClientError> + Send + 'static,
{
    use super::{gateway::protocol, gateway::transport, Run, RunEvent};
    let (tx, cancel, run) = Run::channel();
    let id = id.to_string();
    tokio::spawn(async move {
        let mut bytes = resp.bytes_stream();
        let mut dec = SseDecoder::default();
        let mut b = Builder::default();
        loop {
            let batch = tokio::select! {
                b = next_events(&mut bytes, &mut dec, read_timeout) => b,
                () = cancel.cancelled() => {
                    drop(bytes);
                    let mut r = b.finish();
                    r.finish_reason = "cancelled".into();
                    let _ = tx.send(RunEvent::Done(r));
                    return;
                }
            };
            let events = match batch {
                Ok(Some(e)) => e,
                Ok(None) => break,
                Err(e) => {
                    let _ = tx.send(RunEvent::Error(transport(&id, e)));
                    return;
                }
            };
            for ev in &events {
                let pieces = match parse(ev) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(RunEvent::Error(e));
                        return;
                    }
                };
                for p in pieces {
                    match p {
                        Piece::Done(full) => {
                            let _ = tx.send(RunEvent::Done(full));
                            return;
                        }
                        Piece::End => {
                            let _ = tx.send(RunEvent::Done(b.finish()));
                            return;
                        }
                        p => {
                            if let Some(ev) = b.apply(p) {
                                if stream {
                                    let _ = tx.send(ev);
                                }
                            }
                        }
                    }
                }
            }
        }
        // Some servers end the stream without a closing event.
        if b.r.finish_reason.is_empty() {
            let _ = tx.send(RunEvent::Error(protocol(
                &id,
                "the stream ended before the answer finished",
            )));
        } else {
            let _ = tx.send(RunEvent::Done(b.finish()));
        }
    });
    run
}
