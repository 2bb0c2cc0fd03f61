//! envoyproxy/ratelimit's YAML, read as that service reads it.
//!
//! A file is one domain and its tree of descriptors. The keys a file may use anywhere are the
//! reference's list (`domain`, `key`, `value`, `descriptors`, `rate_limit`, `unit`,
//! `requests_per_unit`, `unlimited`, `shadow_mode`, `quota_mode`, `name`, `replaces`,
//! `detailed_metric`, `value_to_metric`, `share_threshold`, `metadata`): any other key is
//! refused, and one of these in a place where it means nothing is ignored, as the reference
//! ignores it. The maps are read by hand (no derive) so that each error carries the line and
//! column of the node it is about.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::Unit;

/// The keys envoyproxy/ratelimit accepts at any level of a file.
const VALID_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

/// A file: `domain` and its `descriptors`.
#[derive(Debug, Default)]
pub(crate) struct RawRoot {
    pub(crate) domain: String,
    pub(crate) descriptors: Vec<RawDescriptor>,
}

/// One node of the descriptor tree.
#[derive(Debug, Default)]
pub(crate) struct RawDescriptor {
    pub(crate) key: String,
    pub(crate) value: String,
    pub(crate) rate_limit: Option<RawRateLimit>,
    pub(crate) descriptors: Vec<RawDescriptor>,
    pub(crate) shadow_mode: bool,
    pub(crate) quota_mode: bool,
    pub(crate) detailed_metric: bool,
    pub(crate) value_to_metric: bool,
    pub(crate) share_threshold: bool,
    pub(crate) has_metadata: bool,
}

impl RawDescriptor {
    /// The node's name among its siblings: `key`, or `key_value` when it has a value.
    pub(crate) fn composite(&self) -> String {
        if self.value.is_empty() {
            self.key.clone()
        } else {
            format!("{}_{}", self.key, self.value)
        }
    }
}

/// A `rate_limit` block.
#[derive(Debug, Default)]
pub(crate) struct RawRateLimit {
    pub(crate) requests_per_unit: u32,
    pub(crate) unit: Option<Unit>,
    pub(crate) unlimited: bool,
    pub(crate) name: String,
    pub(crate) replaces: Vec<String>,
}

/// Reads one file's text.
pub(crate) fn parse(text: &str) -> Result<RawRoot, serde_yaml_ng::Error> {
    if text.trim().is_empty() {
        // An empty document is an empty map to the reference; its check of the domain refuses it.
        return Ok(RawRoot::default());
    }
    serde_yaml_ng::from_str::<RawRoot>(text)
}

fn unknown<E: de::Error>(key: &str) -> E {
    E::custom(format_args!("unknown key '{key}'"))
}

/// Whether `key` may appear in a file at all; the caller then ignores it where it means
/// nothing.
fn valid(key: &str) -> bool {
    VALID_KEYS.contains(&key)
}

/// A scalar read as text, as the reference's YAML library reads a number or a boolean into a
/// string field (`value: 123` is the value "123").
struct Text(String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_owned()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Text, E> {
                Ok(Text(String::new()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A boolean; a null (`shadow_mode:`) is false, as in the reference.
struct Flag(bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Option::<bool>::deserialize(d).map(|b| Flag(b.unwrap_or(false)))
    }
}

impl<'de> Deserialize<'de> for RawRoot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawRoot;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map with `domain` and `descriptors`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawRoot, A::Error> {
                let mut root = RawRoot::default();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "domain" => root.domain = map.next_value::<Text>()?.0,
                        "descriptors" => root.descriptors = map.next_value::<Descriptors>()?.0,
                        k if valid(k) => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        k => return Err(unknown(k)),
                    }
                }
                Ok(root)
            }
        }
        d.deserialize_map(V)
    }
}

/// A list of sibling descriptors; two with the same `key` and `value` are refused.
struct Descriptors(Vec<RawDescriptor>);

impl<'de> Deserialize<'de> for Descriptors {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Descriptors;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of descriptors (maps)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Descriptors, E> {
                Ok(Descriptors(Vec::new()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Descriptors, A::Error> {
                let mut out: Vec<RawDescriptor> = Vec::new();
                while let Some(d) = seq.next_element::<RawDescriptor>()? {
                    let name = d.composite();
                    if out.iter().any(|o| o.composite() == name) {
                        return Err(de::Error::custom(format_args!(
                            "duplicate descriptor composite key '{name}'"
                        )));
                    }
                    out.push(d);
                }
                Ok(Descriptors(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for RawDescriptor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawDescriptor;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a descriptor (a map with `key`)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawDescriptor, A::Error> {
                let mut r = RawDescriptor::default();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "key" => r.key = map.next_value::<Text>()?.0,
                        "value" => r.value = map.next_value::<Text>()?.0,
                        "rate_limit" => r.rate_limit = map.next_value::<Option<RawRateLimit>>()?,
                        "descriptors" => r.descriptors = map.next_value::<Descriptors>()?.0,
                        "shadow_mode" => r.shadow_mode = map.next_value::<Flag>()?.0,
                        "quota_mode" => r.quota_mode = map.next_value::<Flag>()?.0,
                        "detailed_metric" => r.detailed_metric = map.next_value::<Flag>()?.0,
                        "value_to_metric" => r.value_to_metric = map.next_value::<Flag>()?.0,
                        "share_threshold" => r.share_threshold = map.next_value::<Flag>()?.0,
                        "metadata" => {
                            map.next_value::<IgnoredAny>()?;
                            r.has_metadata = true;
                        }
                        k if valid(k) => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        k => return Err(unknown(k)),
                    }
                }
                if r.key.is_empty() {
                    return Err(de::Error::custom("descriptor has empty key"));
                }
                if r.share_threshold && !r.composite().contains('*') {
                    return Err(de::Error::custom(format_args!(
                        "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                        r.composite()
                    )));
                }
                if let Some(rl) = &r.rate_limit {
                    if rl.replaces.iter().any(String::is_empty) {
                        return Err(de::Error::custom("should not have an empty replaces entry"));
                    }
                    if !rl.name.is_empty() && rl.replaces.contains(&rl.name) {
                        return Err(de::Error::custom(
                            "replaces should not contain name of same descriptor",
                        ));
                    }
                }
                Ok(r)
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for RawRateLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawRateLimit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a rate_limit map (`unit`, `requests_per_unit`, ...)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawRateLimit, A::Error> {
                let mut r = RawRateLimit::default();
                let mut unit_text = String::new();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "requests_per_unit" => {
                            r.requests_per_unit = map.next_value::<Option<u32>>()?.unwrap_or(0);
                        }
                        "unit" => unit_text = map.next_value::<Text>()?.0,
                        "unlimited" => r.unlimited = map.next_value::<Flag>()?.0,
                        "name" => r.name = map.next_value::<Text>()?.0,
                        "replaces" => {
                            r.replaces = map
                                .next_value::<Option<Vec<Replace>>>()?
                                .unwrap_or_default()
                                .into_iter()
                                .map(|x| x.0)
                                .collect();
                        }
                        k if valid(k) => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        k => return Err(unknown(k)),
                    }
                }
                // As the reference: an unlimited limit takes no unit, any other one a known unit.
                r.unit = Unit::from_name(&unit_text);
                if r.unlimited && r.unit.is_some() {
                    return Err(de::Error::custom(
                        "should not specify rate limit unit when unlimited",
                    ));
                }
                if !r.unlimited && r.unit.is_none() {
                    return Err(de::Error::custom(format_args!(
                        "invalid rate limit unit '{unit_text}'"
                    )));
                }
                Ok(r)
            }
        }
        d.deserialize_map(V)
    }
}

/// One `replaces` entry: `{name: ...}`.
struct Replace(String);

impl<'de> Deserialize<'de> for Replace {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Replace;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map with `name`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Replace, A::Error> {
                let mut name = String::new();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "name" => name = map.next_value::<Text>()?.0,
                        k if valid(k) => {
                            map.next_value::<IgnoredAny>()?;
                        }
                        k => return Err(unknown(k)),
                    }
                }
                Ok(Replace(name))
            }
        }
        d.deserialize_map(V)
    }
}
