//! Chat: the message types every surface shares (local engine, server,
//! gateway and providers), and chat-template rendering with a real Jinja engine
//! set up the way Hugging Face transformers renders templates.

mod json;

use serde::{Deserialize, Serialize};

use crate::tools::{Tool, ToolCall};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// The name templates see.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image, by URL (OpenAI's `image_url` part): a `data:` URL with
    /// base64 PNG, JPEG or WebP, or an http(s) URL a server may fetch.
    ImageUrl {
        /// The image.
        image_url: ImageUrl,
    },
}

/// An image part's URL and detail hint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageUrl {
    /// `data:image/png;base64,...` or `https://...`.
    pub url: String,
    /// OpenAI's `auto`, `low` or `high` (accepted; the projector decides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl ContentPart {
    /// An image part from a URL.
    pub fn image(url: impl Into<String>) -> Self {
        ContentPart::ImageUrl {
            image_url: ImageUrl {
                url: url.into(),
                detail: None,
            },
        }
    }
}

/// A message's content: text, or a list of parts (OpenAI's two shapes).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The content as one text: text parts joined by newlines, an image
    /// part as [`crate::media::IMAGE_MARKER`] (where its embeddings go) with
    /// no newline before or after it, as llama.cpp joins them.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(t) => t.clone(),
            MessageContent::Parts(parts) => {
                let mut out = String::new();
                let mut after_image = false;
                for p in parts {
                    match p {
                        ContentPart::Text { text } => {
                            if !after_image && !out.is_empty() {
                                out.push('\n');
                            }
                            out.push_str(text);
                            after_image = false;
                        }
                        ContentPart::ImageUrl { .. } => {
                            out.push_str(crate::media::IMAGE_MARKER);
                            after_image = true;
                        }
                    }
                }
                out
            }
        }
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    /// A string, or a list of parts; a bad part says what is wrong with it
    /// (an untagged enum would only say that nothing matched).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => Ok(MessageContent::Text(s)),
            v @ serde_json::Value::Array(_) => serde_json::from_value(v)
                .map(MessageContent::Parts)
                .map_err(D::Error::custom),
            _ => Err(D::Error::custom(
                "expected a string or a list of content parts",
            )),
        }
    }
}

impl From<&str> for MessageContent {
    fn from(s: &str) -> Self {
        MessageContent::Text(s.to_string())
    }
}

impl From<String> for MessageContent {
    fn from(s: String) -> Self {
        MessageContent::Text(s)
    }
}

/// A chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// What it says (`null` on an assistant message that only calls tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Optional author name (for `tool` messages: the function's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// For `tool` messages: the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For assistant messages: the calls it made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For assistant messages: the reasoning that came before the answer
    /// (templates that show earlier reasoning read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: Role, content: impl Into<MessageContent>) -> Self {
        Self {
            role,
            content: Some(content.into()),
            name: None,
            tool_call_id: None,
            tool_calls: None,
            reasoning_content: None,
        }
    }

    /// The URLs of its image parts, in order.
    pub fn image_urls(&self) -> Vec<&str> {
        match &self.content {
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .filter_map(|p| match p {
                    ContentPart::ImageUrl { image_url } => Some(image_url.url.as_str()),
                    ContentPart::Text { .. } => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Whether its text (not its images) contains the image marker.
    pub fn has_marker_text(&self) -> bool {
        match &self.content {
            Some(MessageContent::Text(t)) => t.contains(crate::media::IMAGE_MARKER),
            Some(MessageContent::Parts(parts)) => parts.iter().any(|p| {
                matches!(p, ContentPart::Text { text } if text.contains(crate::media::IMAGE_MARKER))
            }),
            None => false,
        }
    }

    /// The content as one text ("" when there is none).
    pub fn text(&self) -> String {
        self.content
            .as_ref()
            .map(MessageContent::text)
            .unwrap_or_default()
    }

    /// An assistant message that calls tools.
    pub fn tool_calls(content: Option<String>, calls: Vec<ToolCall>) -> Self {
        Self {
            content: content.map(MessageContent::Text),
            tool_calls: Some(calls),
            ..Self::new(Role::Assistant, "")
        }
    }

    /// A tool's result, answering the call `call_id`.
    pub fn tool_result(call_id: impl Into<String>, content: impl Into<MessageContent>) -> Self {
        Self {
            tool_call_id: Some(call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// A system message.
    pub fn system(content: impl Into<MessageContent>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<MessageContent>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<MessageContent>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

/// Why a chat prompt could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// The model has no template.
    #[error("this model has no chat template (the GGUF key `tokenizer.chat_template` is missing); send a plain prompt instead")]
    NoTemplate,
    /// The template does not parse.
    #[error("the model's chat template is invalid: {0}")]
    InvalidTemplate(String),
    /// The template raised an error for these messages.
    #[error("the chat template rejected the conversation: {0}")]
    Raised(String),
    /// Rendering failed.
    #[error("the chat template failed to render: {0}")]
    Render(String),
    /// No messages.
    #[error("`messages` must contain at least one message")]
    NoMessages,
    /// A message or option that cannot be rendered, named as the request
    /// names it (`messages[2].tool_calls[0].function.arguments`).
    #[error("invalid `{field}`: {message}")]
    Field {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// How to render a conversation.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions<'a> {
    /// Append the opening of the assistant's turn.
    pub add_generation_prompt: bool,
    /// Tools the template shows the model (`tools` in the template; `none`
    /// when absent, as transformers passes it).
    pub tools: Option<&'a [Tool]>,
    /// Extra template variables (`chat_template_kwargs`, e.g.
    /// `enable_thinking`).
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

impl RenderOptions<'_> {
    /// Just the generation-prompt switch.
    pub fn new(add_generation_prompt: bool) -> Self {
        Self {
            add_generation_prompt,
            ..Self::default()
        }
    }
}

/// Template variables sipp sets itself; `chat_template_kwargs` may not set them.
pub const RESERVED_TEMPLATE_VARIABLES: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// A message as templates see it: OpenAI's shape, with each call's
/// `arguments` parsed from JSON text into an object (what templates index
/// and `tojson`, as vLLM and llama.cpp hand them over).
pub fn message_value(m: &ChatMessage, index: usize) -> Result<serde_json::Value, ChatError> {
    let mut o = serde_json::Map::new();
    o.insert("role".into(), m.role.as_str().into());
    o.insert(
        "content".into(),
        m.content
            .as_ref()
            .map_or(serde_json::Value::Null, |c| c.text().into()),
    );
    if let Some(n) = &m.name {
        o.insert("name".into(), n.clone().into());
    }
    if let Some(id) = &m.tool_call_id {
        o.insert("tool_call_id".into(), id.clone().into());
    }
    if let Some(r) = &m.reasoning_content {
        o.insert("reasoning_content".into(), r.clone().into());
    }
    if let Some(calls) = &m.tool_calls {
        let calls = calls
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let args: serde_json::Value =
                    serde_json::from_str(&c.function.arguments).map_err(|e| ChatError::Field {
                        field: format!("messages[{index}].tool_calls[{j}].function.arguments"),
                        message: format!("is not JSON: {e}"),
                    })?;
                Ok(serde_json::json!({
                    "id": c.id,
                    "type": c.kind,
                    "function": {"name": c.function.name, "arguments": args},
                }))
            })
            .collect::<Result<Vec<_>, ChatError>>()?;
        o.insert("tool_calls".into(), calls.into());
    }
    Ok(serde_json::Value::Object(o))
}

/// The chat template of a model family whose base GGUFs ship without one
/// (Gemma 3's base models have the turn tokens but no template): the
/// instruction-tuned model's own template, so chat works as llama.cpp's
/// built-in `gemma` template does.
pub fn family_template(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma3" => Some(include_str!("templates/gemma3.jinja")),
        _ => None,
    }
}

/// Rendering limit: a hostile template cannot loop forever.
const TEMPLATE_FUEL: u64 = 2_000_000;

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .finish()
    }
}

fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        format!("raise_exception: {message}"),
    ))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

impl ChatTemplate {
    /// Compiles a template with the bos/eos token texts it may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = minijinja::Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::InvalidTemplate(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(64);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", json::tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ChatError::InvalidTemplate(describe(&e)))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders a conversation; `add_generation_prompt` appends the opening of
    /// the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(messages, &RenderOptions::new(add_generation_prompt))
    }

    /// Renders a conversation with tools and extra template variables, as
    /// transformers' `apply_chat_template(messages, tools=..., **kwargs)`.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        opts: &RenderOptions<'_>,
    ) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::NoMessages);
        }
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| message_value(m, i))
            .collect::<Result<Vec<_>, _>>()?;
        self.render_values(&msgs, opts)
    }

    /// Renders messages already in the shape templates see.
    fn render_values(
        &self,
        msgs: &[serde_json::Value],
        opts: &RenderOptions<'_>,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::InvalidTemplate(describe(&e)))?;
        let mut vars: std::collections::BTreeMap<String, minijinja::Value> = Default::default();
        if let Some(kwargs) = opts.kwargs {
            for (k, v) in kwargs {
                if RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()) {
                    return Err(ChatError::Field {
                        field: format!("chat_template_kwargs.{k}"),
                        message: "is set by the server and cannot be overridden".into(),
                    });
                }
                vars.insert(
                    k.clone(),
                    minijinja::Value::from(minijinja::value::Serde(v)),
                );
            }
        }
        vars.insert(
            "messages".into(),
            minijinja::Value::from(minijinja::value::Serde(msgs)),
        );
        vars.insert(
            "tools".into(),
            match opts.tools {
                Some(t) => minijinja::Value::from(minijinja::value::Serde(t)),
                None => minijinja::Value::from(()),
            },
        );
        vars.insert(
            "add_generation_prompt".into(),
            opts.add_generation_prompt.into(),
        );
        vars.insert("bos_token".into(), self.bos_token.as_str().into());
        vars.insert("eos_token".into(), self.eos_token.as_str().into());
        tmpl.render(vars).map_err(|e| {
            // The message of raise_exception, wherever in the chain it sits.
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = cur {
                if let Some(m) = err.downcast_ref::<minijinja::Error>() {
                    if let Some(msg) = m.detail().and_then(|d| d.strip_prefix("raise_exception: "))
                    {
                        return ChatError::Raised(msg.to_string());
                    }
                }
                cur = err.source();
            }
            ChatError::Render(describe(&e))
        })
    }

    /// True when the template shows the model the tools it is given (it
    /// renders a probe tool's name), so calls and tool results can go
    /// through it as they are.
    pub fn renders_tools(&self) -> bool {
        let probe = Tool::function(
            "sipp_probe_tool_7f3a",
            "probe",
            serde_json::json!({"type": "object", "properties": {}}),
        );
        let tools = [probe];
        let msgs = [serde_json::json!({"role": "user", "content": "hi"})];
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: Some(&tools),
            kwargs: None,
        };
        self.render_values(&msgs, &opts)
            .is_ok_and(|out| out.contains("sipp_probe_tool_7f3a"))
    }

    /// True when a system message renders (some templates refuse the role).
    pub fn renders_system(&self) -> bool {
        let msgs = [
            serde_json::json!({"role": "system", "content": "sipp-probe-system"}),
            serde_json::json!({"role": "user", "content": "hi"}),
        ];
        self.render_values(&msgs, &RenderOptions::new(true))
            .is_ok_and(|out| out.contains("sipp-probe-system"))
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS token text templates see.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }
}

/// One line for an error, with its cause chain.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").expect("compiles");
        let out = t
            .render(
                &[ChatMessage::system("Be brief."), ChatMessage::user("Hi")],
                true,
            )
            .expect("renders");
        assert_eq!(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_a_clear_error() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "")
            .expect("compiles");
        let err = t.render(&[ChatMessage::user("x")], true).unwrap_err();
        assert_eq!(err, ChatError::Raised("roles must alternate".into()));
    }

    #[test]
    fn broken_and_looping_templates_fail_cleanly() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ChatError::InvalidTemplate(_))
        ));
        let t = ChatTemplate::new("{% for i in range(100000000) %}{{ i }}{% endfor %}", "", "")
            .expect("compiles");
        assert!(matches!(
            t.render(&[ChatMessage::user("x")], true),
            Err(ChatError::Render(_))
        ));
        let t =
            ChatTemplate::new("{{ messages[5]['content'].upper() }}", "", "").expect("compiles");
        assert!(t.render(&[ChatMessage::user("x")], true).is_err());
    }

    #[test]
    fn python_methods_and_tojson_work() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip().upper() }}|{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}",
            "",
            "",
        )
        .expect("compiles");
        let out = t
            .render(&[ChatMessage::user("  hé <b> ")], false)
            .expect("renders");
        assert_eq!(
            out,
            "HÉ <B>|{\"role\": \"user\", \"content\": \"  hé <b> \"}|4"
        );
    }

    #[test]
    fn content_parts_are_joined() {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
        )
        .expect("parses");
        assert_eq!(m.text(), "a\nb");
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role":"wizard","content":"x"}"#).is_err());
    }
}
