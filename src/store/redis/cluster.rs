//! Redis Cluster: which slot a key is in, and which master serves it (`CLUSTER SLOTS`), so
//! that each master gets its own connection, queue and circuit breaker.

use redis::Value;

use super::script::hash_tag;

/// The Redis Cluster slot of a state key: CRC16 (XMODEM) of its hash tag, modulo 16,384 (the
/// Redis Cluster specification's key distribution model).
pub(crate) fn slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).as_bytes()) % 16_384
}

/// Slot ranges and the master (`host:port`) that serves each.
#[derive(Debug, Default)]
pub(crate) struct SlotMap {
    ranges: Vec<(u16, u16, String)>,
}

impl SlotMap {
    /// Reads a `CLUSTER SLOTS` reply: `[[start, end, [host, port, ...], replicas...], ...]`.
    pub(crate) fn parse(reply: &Value) -> Option<Self> {
        let Value::Array(entries) = reply else { return None };
        let mut ranges = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Array(fields) = entry else { return None };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let host = match master.first()? {
                Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let Some(Value::Int(port)) = master.get(1) else { return None };
            ranges.push((
                u16::try_from(*start).ok()?,
                u16::try_from(*end).ok()?,
                format!("{host}:{port}"),
            ));
        }
        ranges.sort_unstable();
        Some(Self { ranges })
    }

    /// The master serving `slot`.
    pub(crate) fn node_of(&self, slot: u16) -> Option<&str> {
        let i = self.ranges.partition_point(|(start, _, _)| *start <= slot);
        let (start, end, addr) = self.ranges.get(i.checked_sub(1)?)?;
        (*start <= slot && slot <= *end).then_some(addr.as_str())
    }

    /// Every master.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = &str> {
        let mut seen: Vec<&str> = Vec::new();
        for (_, _, addr) in &self.ranges {
            if !seen.contains(&addr.as_str()) {
                seen.push(addr);
            }
        }
        seen.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_hash_tag() {
        // The specification's example: "123456789" hashes to 0x31C3 (12,739).
        assert_eq!(slot("123456789"), 12_739);
        assert_eq!(slot("{123456789}:x"), 12_739);
        assert_eq!(slot("a{123456789}b"), 12_739);
    }

    #[test]
    fn a_slot_map_finds_each_slots_master() {
        let node =
            |host: &str, port| Value::Array(vec![Value::BulkString(host.into()), Value::Int(port)]);
        let reply = Value::Array(vec![
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("127.0.0.1", 7001)]),
            Value::Array(vec![Value::Int(0), Value::Int(5460), node("127.0.0.1", 7000)]),
            Value::Array(vec![Value::Int(10923), Value::Int(16383), node("127.0.0.1", 7002)]),
        ]);
        let map = SlotMap::parse(&reply).unwrap();
        assert_eq!(map.node_of(0), Some("127.0.0.1:7000"));
        assert_eq!(map.node_of(5461), Some("127.0.0.1:7001"));
        assert_eq!(map.node_of(16383), Some("127.0.0.1:7002"));
        assert_eq!(map.nodes().count(), 3);
        assert!(SlotMap::parse(&Value::Int(1)).is_none());
    }
}
