//! The serde visitors that stream each endpoint's prompt (`messages`,
//! `prompt`, `input`) into the prefix hasher as canonical prompt text, as
//! described in the `openai` module's documentation.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

use crate::request::prefix::PromptHasher;

pub(crate) fn duplicate<E: de::Error>(field: &'static str) -> E {
    E::custom(format_args!("duplicate field `{field}`"))
}

/// Responses API `input`: a string (one `user` message), or an array of
/// items.
pub(crate) struct InputSeed<'h>(pub(crate) &'h mut PromptHasher);

impl<'de> DeserializeSeed<'de> for InputSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for InputSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("`input` as a string or an array of input items")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.feed(b"user\n");
        self.0.feed(v.as_bytes());
        self.0.feed(b"\n");
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(ItemSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One Responses API input item. A message (`role`, `content`) is
/// canonicalised as a chat message; any other item (`function_call`,
/// `function_call_output`, `reasoning`, ...) as its `type` followed by its
/// `name`, `arguments`, `output` and `summary`, in that order whatever the
/// order of the fields. Ids are left out: they name the item, not text the
/// engine prefills.
struct ItemSeed<'h>(&'h mut PromptHasher);

impl<'de> DeserializeSeed<'de> for ItemSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

enum ItemKey {
    Type,
    Role,
    Content,
    Name,
    Arguments,
    Output,
    Summary,
    Other,
}

impl<'de> de::Deserialize<'de> for ItemKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ItemKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ItemKey, E> {
                Ok(match v {
                    "type" => ItemKey::Type,
                    "role" => ItemKey::Role,
                    "content" => ItemKey::Content,
                    "name" => ItemKey::Name,
                    "arguments" => ItemKey::Arguments,
                    "output" => ItemKey::Output,
                    "summary" => ItemKey::Summary,
                    _ => ItemKey::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Visitor<'de> for ItemSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input item object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut kind: Option<String> = None;
        let mut role: Option<String> = None;
        // content, name, arguments, output, summary
        let mut parts: [Option<Vec<u8>>; 5] = Default::default();
        while let Some(key) = map.next_key::<ItemKey>()? {
            let slot = match key {
                ItemKey::Type => {
                    kind = map.next_value()?;
                    continue;
                }
                ItemKey::Role => {
                    role = map.next_value()?;
                    continue;
                }
                ItemKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
                ItemKey::Content => 0,
                ItemKey::Name => 1,
                ItemKey::Arguments => 2,
                ItemKey::Output => 3,
                ItemKey::Summary => 4,
            };
            let Some(buf) = parts.get_mut(slot) else {
                continue;
            };
            if buf.is_some() {
                return Err(de::Error::custom("duplicate field in an input item"));
            }
            let mut text = Vec::new();
            map.next_value_seed(ContentSeed(Sink::Buffer(&mut text)))?;
            *buf = Some(text);
        }
        let label = match (&role, &kind) {
            (Some(r), _) => r.as_str(),
            (None, Some(k)) => k.as_str(),
            (None, None) => {
                return Err(de::Error::custom(
                    "every input item needs a `role` or a `type`",
                ))
            }
        };
        self.0.feed(label.as_bytes());
        self.0.feed(b"\n");
        for text in parts.iter().flatten() {
            self.0.feed(text);
        }
        self.0.feed(b"\n");
        Ok(())
    }
}

pub(crate) struct MessagesSeed<'h>(pub(crate) &'h mut PromptHasher);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MessagesSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of message objects")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut n = 0usize;
        while seq.next_element_seed(MessageSeed(&mut *self.0))?.is_some() {
            n += 1;
        }
        if n == 0 {
            return Err(de::Error::custom(
                "`messages` must contain at least one message",
            ));
        }
        Ok(())
    }
}

struct MessageSeed<'h>(&'h mut PromptHasher);

impl<'de> DeserializeSeed<'de> for MessageSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

enum MessageKey {
    Role,
    Content,
    Other,
}

impl<'de> de::Deserialize<'de> for MessageKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MessageKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MessageKey, E> {
                Ok(match v {
                    "role" => MessageKey::Role,
                    "content" => MessageKey::Content,
                    _ => MessageKey::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// Sink for text: straight into the hasher, or into a buffer when a
/// message's `content` comes before its `role` (rare, but valid JSON).
enum Sink<'h> {
    Hasher(&'h mut PromptHasher),
    Buffer(&'h mut Vec<u8>),
}

impl Sink<'_> {
    fn feed(&mut self, bytes: &[u8]) {
        match self {
            Sink::Hasher(h) => h.feed(bytes),
            Sink::Buffer(b) => b.extend_from_slice(bytes),
        }
    }
}

impl<'de> Visitor<'de> for MessageSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object with `role` and `content`")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let hasher = self.0;
        let mut role_seen = false;
        let mut content_seen = false;
        let mut pending: Option<Vec<u8>> = None;
        while let Some(key) = map.next_key::<MessageKey>()? {
            match key {
                MessageKey::Role => {
                    if std::mem::replace(&mut role_seen, true) {
                        return Err(duplicate("role"));
                    }
                    map.next_value_seed(TextSeed(&mut Sink::Hasher(&mut *hasher)))?;
                    hasher.feed(b"\n");
                    if let Some(buf) = pending.take() {
                        hasher.feed(&buf);
                        hasher.feed(b"\n");
                    }
                }
                MessageKey::Content => {
                    if std::mem::replace(&mut content_seen, true) {
                        return Err(duplicate("content"));
                    }
                    if role_seen {
                        map.next_value_seed(ContentSeed(Sink::Hasher(&mut *hasher)))?;
                        hasher.feed(b"\n");
                    } else {
                        let mut buf = Vec::new();
                        map.next_value_seed(ContentSeed(Sink::Buffer(&mut buf)))?;
                        pending = Some(buf);
                    }
                }
                MessageKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !role_seen {
            return Err(de::Error::custom("every message needs a `role`"));
        }
        if !content_seen {
            hasher.feed(b"\n");
        }
        Ok(())
    }
}

/// A string, streamed into the sink.
struct TextSeed<'s, 'h>(&'s mut Sink<'h>);

impl<'de> DeserializeSeed<'de> for TextSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for TextSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }
}

/// `content`: a string, null, or an array of content parts.
struct ContentSeed<'h>(Sink<'h>);

impl<'de> DeserializeSeed<'de> for ContentSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("`content` as a string, null, or an array of content parts")
    }
    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(PartSeed(&mut self.0))?.is_some() {}
        Ok(())
    }
}

struct PartSeed<'s, 'h>(&'s mut Sink<'h>);

impl<'de> DeserializeSeed<'de> for PartSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

enum PartKey {
    Type,
    Text,
    Media,
    Other,
}

impl<'de> de::Deserialize<'de> for PartKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = PartKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PartKey, E> {
                Ok(match v {
                    "type" => PartKey::Type,
                    "text" => PartKey::Text,
                    "image_url" | "input_audio" | "file" | "video_url" | "audio_url" => {
                        PartKey::Media
                    }
                    _ => PartKey::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Visitor<'de> for PartSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content part object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut kind: Option<String> = None;
        let mut fed = false;
        while let Some(key) = map.next_key::<PartKey>()? {
            match key {
                PartKey::Type => kind = Some(map.next_value::<String>()?),
                PartKey::Text => {
                    map.next_value_seed(TextSeed(&mut *self.0))?;
                    fed = true;
                }
                PartKey::Media => {
                    // The media's identity (URL or inline data) is part of the
                    // prefix the engine caches; hash it, do not keep it.
                    map.next_value_seed(MediaSeed(&mut *self.0))?;
                    fed = true;
                }
                PartKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !fed {
            if let Some(k) = kind {
                self.0.feed(k.as_bytes());
            }
        }
        Ok(())
    }
}

/// A media reference: a string, or an object whose string fields are hashed
/// in order (e.g. `{"url": …}` or `{"data": …, "format": …}`).
struct MediaSeed<'s, 'h>(&'s mut Sink<'h>);

impl<'de> DeserializeSeed<'de> for MediaSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MediaSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a media reference")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(MediaSeed(&mut *self.0))?;
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(MediaSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// `prompt`: a string, an array of strings, an array of token ids, or an
/// array of arrays of token ids.
pub(crate) struct PromptSeed<'h>(pub(crate) &'h mut PromptHasher);

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("`prompt` as a string, an array of strings, or an array of token ids")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut first = true;
        while seq
            .next_element_seed(PromptElementSeed {
                hasher: &mut *self.0,
                first,
            })?
            .is_some()
        {
            first = false;
        }
        if first {
            return Err(de::Error::custom("`prompt` must not be an empty array"));
        }
        Ok(())
    }
}

struct PromptElementSeed<'h> {
    hasher: &'h mut PromptHasher,
    first: bool,
}

impl<'de> DeserializeSeed<'de> for PromptElementSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl PromptElementSeed<'_> {
    fn separate(&mut self) {
        if !self.first {
            self.hasher.feed(b"\n");
        }
    }
}

impl<'de> Visitor<'de> for PromptElementSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id, or an array of token ids")
    }
    fn visit_str<E: de::Error>(mut self, v: &str) -> Result<(), E> {
        self.separate();
        self.hasher.feed(v.as_bytes());
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let id = u32::try_from(v).map_err(|_| E::custom("token id out of range"))?;
        self.hasher.feed(&id.to_le_bytes());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        self.separate();
        while let Some(id) = seq.next_element::<u32>()? {
            self.hasher.feed(&id.to_le_bytes());
        }
        Ok(())
    }
}
