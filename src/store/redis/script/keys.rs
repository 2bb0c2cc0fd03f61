//! State keys: the policy's hash tag and fingerprint, and each key's name, raw or hashed
//! with the store's secret.

use super::*;

/// Escapes the characters that would end a Redis Cluster hash tag early (`{`, `}`) or make the
/// `policy|key` split ambiguous (`|`), and the escape character itself.
pub(super) fn escape(s: &str) -> Cow<'_, str> {
    if !s.bytes().any(|b| matches!(b, b'{' | b'}' | b'|' | b'%')) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '|' => out.push_str("%7C"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// The parts of a policy's state keys around the key itself:
/// `{prefix}{{policy}|` and `}:{fingerprint}`. Everything that identifies the limit is inside
/// the hash tag, so a policy's tiers (and sliding-log sets) share one Redis Cluster slot.
pub(crate) fn key_parts(prefix: &str, policy: &Policy) -> (String, String) {
    (format!("{prefix}{{{}|", escape(policy.name())), format!("}}:{:08x}", fingerprint(policy)))
}

/// How state keys name the key they limit.
#[derive(Clone, Copy)]
pub(crate) enum KeyNames {
    /// `#` and 32 hexadecimal digits: SipHash-2-4 (128-bit output) of the key's `Display`
    /// form, keyed with these 16 bytes (derived from the deployment's secret by
    /// [`derive_secret`]).
    Hashed([u8; 16]),
    /// The key's `Display` form itself, escaped (for debugging).
    Raw,
}

impl fmt::Debug for KeyNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secret stays out of logs and panics.
        f.write_str(match self {
            Self::Hashed(_) => "Hashed",
            Self::Raw => "Raw",
        })
    }
}

/// The secret state keys are hashed with when none is given: 16 ASCII bytes, documented, so a
/// fleet that sets none still shares budgets.
pub(crate) const DEFAULT_KEY_SECRET: &[u8] = b"tollgate:default";

/// The 16-byte SipHash key of a deployment's secret (of any length): SipHash-2-4 with a
/// fixed, public key over a domain label and the secret. The result is as hard to guess as
/// the secret, up to 128 bits.
pub(crate) fn derive_secret(secret: &[u8]) -> [u8; 16] {
    let mut h = SipHasher24::new_with_key(&[0; 16]);
    h.write(b"tollgate redis key secret\0");
    h.write(secret);
    u128::from(h.finish128()).to_le_bytes()
}

/// Streams formatted text into a hasher, so a key is hashed without first being rendered.
pub(super) struct Feed<'a>(&'a mut SipHasher24);

impl fmt::Write for Feed<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

/// The keyed 128-bit hash of `key`: of its `Display` form, which is the same on every
/// platform and version (unlike `Key::feed`, whose lengths are `usize`), so every node of a
/// fleet names a key alike.
pub(super) fn key_hash(secret: &[u8; 16], key: &Key) -> u128 {
    use std::fmt::Write as _;
    let mut h = SipHasher24::new_with_key(secret);
    // `Feed` never fails, and `Key`'s `Display` only fails when its writer does.
    let _ = write!(Feed(&mut h), "{key}");
    u128::from(h.finish128())
}

/// The key of the string holding every tier's state of `key`, between the parts of
/// [`key_parts`], the key named as `names` says.
pub(crate) fn state_key(parts: &(String, String), names: &KeyNames, key: &Key) -> String {
    match names {
        KeyNames::Hashed(secret) => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let hash = key_hash(secret, key);
            let mut out = String::with_capacity(parts.0.len() + 33 + parts.1.len());
            out.push_str(&parts.0);
            out.push('#');
            // `{:032x}`, without the formatting machinery (a third of the naming's cost).
            out.extend((0..32).rev().map(|i| char::from(HEX[(hash >> (4 * i)) as usize & 0xf])));
            out.push_str(&parts.1);
            out
        }
        KeyNames::Raw => {
            let key = key.to_string();
            let key = escape(&key);
            let mut out = String::with_capacity(parts.0.len() + key.len() + parts.1.len());
            out.push_str(&parts.0);
            out.push_str(&key);
            out.push_str(&parts.1);
            out
        }
    }
}

/// The hash tag of a state key: what its Redis Cluster slot is computed from.
pub(crate) fn hash_tag(state_key: &str) -> &str {
    let Some(open) = state_key.find('{') else { return state_key };
    match state_key[open + 1..].find('}') {
        Some(len) if len > 0 => &state_key[open + 1..open + 1 + len],
        _ => state_key,
    }
}
