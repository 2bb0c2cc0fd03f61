//! [`ConfigFileError`]: where a configuration file is wrong (file, line, column, field) and why.

use std::error::Error as StdError;
use std::fmt;
use std::ops::Range;

/// A byte range of the file's text.
pub(super) type Span = Range<usize>;

/// Why a configuration file was refused, and where: the file, the line and column (1-based,
/// columns counted in characters) of the offending value, and the field's path in the
/// document (`policies.free.tiers[0].period`, `rules[2].allow_cidrs[1]`).
///
/// Its `Display` is one line, in the form editors and CI annotate:
///
/// ```text
/// tollgate.toml:14:9: policies.free.tiers[0].period: invalid duration "1 fortnight": ...
/// ```
///
/// without the field when the whole file is at fault (a TOML syntax error:
/// `tollgate.toml:3:1: duplicate key`), and without line and column when the file could not
/// be read (`/etc/tollgate.toml: cannot read: No such file or directory (os error 2)`).
/// [`source`](StdError::source) gives the underlying error where there is one: the
/// [`std::io::Error`] of an unreadable file, the [`ConfigError`](crate::ConfigError) of a
/// value the builders refused.
///
/// ```
/// use tollgate::config::LimitsConfig;
///
/// let text = "[policies.api]\n[[policies.api.tiers]]\nname = \"api\"\ncount = 0\nperiod = \"1m\"\n";
/// let err = LimitsConfig::from_toml(text, "tollgate.toml").unwrap_err();
/// assert_eq!((err.file(), err.line(), err.column()), ("tollgate.toml", Some(4), Some(9)));
/// assert_eq!(err.field(), Some("policies.api.tiers[0].count"));
/// assert_eq!(
///     err.to_string(),
///     "tollgate.toml:4:9: policies.api.tiers[0].count: tier `api`: count must be at least 1"
/// );
/// // The same line from `Debug`, as `main` prints an error it returns.
/// assert_eq!(format!("{err:?}"), err.to_string());
/// ```
#[derive(thiserror::Error)]
pub struct ConfigFileError {
    file: String,
    /// Line and column, 1-based.
    at: Option<(usize, usize)>,
    field: Option<String>,
    message: String,
    #[source]
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl ConfigFileError {
    /// The file: the path it was loaded from, or the name given to
    /// [`from_toml`](super::LimitsConfig::from_toml).
    #[must_use]
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The line of the offending value, 1-based; `None` when the file could not be read (or
    /// the TOML parser did not say where).
    #[must_use]
    pub fn line(&self) -> Option<usize> {
        self.at.map(|(line, _)| line)
    }

    /// The column of the offending value, 1-based, in characters; `None` when the line is.
    #[must_use]
    pub fn column(&self) -> Option<usize> {
        self.at.map(|(_, column)| column)
    }

    /// The path of the offending field in the document (`policies.free.tiers[0].count`,
    /// `rules[1].key[0]`); `None` when the file as a whole is at fault (unreadable, not TOML).
    #[must_use]
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// What is wrong, without the location.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    fn render(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some((line, column)) = self.at {
            write!(f, ":{line}:{column}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.message)
    }

    /// An error about the file as a whole, without a location.
    pub(super) fn unlocated(
        file: &str,
        message: impl Into<String>,
        source: Option<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self { file: file.to_owned(), at: None, field: None, message: message.into(), source }
    }
}

/// The text of one file, to turn byte offsets into lines and columns.
#[derive(Clone, Copy)]
pub(super) struct Source<'a> {
    pub(super) file: &'a str,
    pub(super) text: &'a str,
}

impl Source<'_> {
    /// The 1-based line of byte `offset`.
    pub(super) fn line(&self, offset: usize) -> usize {
        self.locate(offset).0
    }

    /// The 1-based line and column (in characters) of byte `offset`.
    fn locate(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.bytes().filter(|b| *b == b'\n').count() + 1;
        let start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[start..].chars().count() + 1)
    }

    /// An error at `span` (`None`: unknown) about `field`.
    pub(super) fn error(
        &self,
        span: Option<&Span>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> ConfigFileError {
        ConfigFileError {
            file: self.file.to_owned(),
            at: span.map(|s| self.locate(s.start)),
            field: field.filter(|f| !f.is_empty()),
            message: message.into(),
            source: None,
        }
    }

    /// An error at `span` about `field`, caused by `source` (whose text is the message).
    pub(super) fn caused(
        &self,
        span: &Span,
        field: String,
        source: impl StdError + Send + Sync + 'static,
    ) -> ConfigFileError {
        let mut e = self.error(Some(span), Some(field), source.to_string());
        e.source = Some(Box::new(source));
        e
    }
}

/// `key` as it would be written in a dotted TOML key: bare when it can be, else quoted.
pub(super) fn toml_key(key: &str) -> String {
    let bare =
        !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare { key.to_owned() } else { format!("{key:?}") }
}

impl fmt::Debug for ConfigFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.render(f)
    }
}

impl fmt::Display for ConfigFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.render(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_columns_are_one_based_in_characters() {
        let src = Source { file: "f.toml", text: "a = 1\nname = \"é\" # x\n\nz" };
        assert_eq!(src.locate(0), (1, 1));
        assert_eq!(src.locate(4), (1, 5));
        assert_eq!(src.locate(6), (2, 1));
        // After the two-byte `é`, one column further.
        let after = src.text.find(" # x").unwrap();
        assert_eq!(src.locate(after), (2, 11));
        // Inside a character: its start.
        let inside = src.text.find('é').unwrap() + 1;
        assert_eq!(src.locate(inside), (2, 9));
        assert_eq!(src.locate(usize::MAX), (4, 2));
    }

    #[test]
    fn display_is_one_line_with_what_is_known() {
        let src = Source { file: "t.toml", text: "x\ny = 2\n" };
        let e = src.error(Some(&(4..5)), Some("y".into()), "bad");
        assert_eq!(e.to_string(), "t.toml:2:3: y: bad");
        let e = src.error(Some(&(0..1)), None, "duplicate key");
        assert_eq!(e.to_string(), "t.toml:1:1: duplicate key");
        let e = ConfigFileError::unlocated("t.toml", "cannot read: gone", None);
        assert_eq!(e.to_string(), "t.toml: cannot read: gone");
        assert_eq!((e.line(), e.column(), e.field()), (None, None, None));
    }

    #[test]
    fn keys_are_quoted_when_not_bare() {
        assert_eq!(toml_key("per-ip_2"), "per-ip_2");
        assert_eq!(toml_key("per ip"), "\"per ip\"");
        assert_eq!(toml_key("a.b"), "\"a.b\"");
        assert_eq!(toml_key(""), "\"\"");
    }
}
